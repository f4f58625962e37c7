"""QK RMSNorm + RoPE over the shapes it runs at: head size, rotary dim, query and KV head
counts, tokens, page size, positions and layers, each shape through the whole chain.

At every shape (gates/_qk_rope.py, `chain_holds_at`): the flat arm equals the closed form on the
designed inputs (exact at any head count and rotary dim: docs/qk_rope.md), the paged prefill
lands the flat arm's bits at the layout's addresses, and the paged decode equals the prefill,
each bitwise. The fixed gates run 4 query and 2 KV heads, rotary dims 128 and 256, pages of
1, 4 and 16 positions, positions below 32; the sweep runs what models run (the presets) and
what the launcher accepts around them (docs/shapes.md).
"""

from __future__ import annotations

import numpy as np
import pytest

from gates import _qk_rope as qk
from harness.library.dtypes import bf16
from harness.library.sweep import Dim, Preset, ShapeSpace, assert_named_shapes_accepted, sweep
from kernels_cu import qk_rope as launcher


def _inputs(s) -> int:
    """Elements of the q, k and v inputs (and as many outputs)."""
    return s["T"] * (s["NKV"] * s["G"] + 2 * s["NKV"]) * s["HD"]


def _pool(s) -> int:
    return qk.sweep_pool_elements(s["HD"], s["NKV"], s["T"], s["P"], s["CTX"], s["L"])


# Models with a QK RMSNorm and head size 256 or 512 (the sizes qk_rope.cu is built for; Llama-3's
# 128 and gpt-oss's 64 are not, and neither has the norm). A preset's T tokens end at position
# CTX - 1; its pages hold 16 positions (a paged engine's default) or 1 (a token-level pool).
QK_ROPE_SHAPES = ShapeSpace(
    "qk_rope",
    (
        Dim("HD", 256, 512, multiple_of=256),
        # 16: a rotary dim whose half is a whole number of a lane's 8-value vectors (every
        # production one); a step either side splits a vector between rope-lo and rope-hi
        Dim("R", 2, 512, multiple_of=2, tile=16),
        Dim("NKV", 1, 16),
        Dim("G", 1, 16),                 # query heads per KV head
        Dim("T", 1, 128),
        Dim("P", 1, 256, tile=16),       # engines page by multiples of 16 positions; one either side is odd
        Dim("CTX", 1, 32768),
        Dim("L", 1, 64),                 # layers in a page; the request writes the last
    ),
    where=(
        ("rotary_dim <= head_dim", lambda s: s["R"] <= s["HD"]),
        ("at most 64 query heads", lambda s: s["NKV"] * s["G"] <= 64),
        ("the T tokens end at position CTX - 1", lambda s: s["T"] <= s["CTX"]),
        # Bounds on the host's work a shape (tables, closed forms in float64, pool images):
        ("cos and sin tables of at most 2^21 floats each", lambda s: s["CTX"] * (s["R"] // 2) <= 1 << 21),
        ("q, k and v of at most 2^20 elements", lambda s: _inputs(s) <= 1 << 20),
        ("a pool of at most 2^23 elements", lambda s: _pool(s) <= 1 << 23),
    ),
    presets=(
        Preset("Gemma 4 26B-A4B sliding layer: 16 tokens at 4096",
               {"HD": 256, "R": 256, "NKV": 8, "G": 2, "T": 16, "P": 16, "CTX": 4096, "L": 30},
               "config.json: num_attention_heads 16, num_key_value_heads 8, head_dim 256 (full rotary), "
               "num_hidden_layers 30"),
        Preset("Gemma 4 26B-A4B global layer (K = V): 16 tokens at 8192",
               {"HD": 512, "R": 128, "NKV": 2, "G": 8, "T": 16, "P": 16, "CTX": 8192, "L": 30},
               "config.json: global_head_dim 512, num_global_key_value_heads 2, partial_rotary_factor 0.25, "
               "attention_k_eq_v"),
        Preset("Gemma 4 E2B global layer: 32 tokens at 32768",
               {"HD": 512, "R": 128, "NKV": 1, "G": 8, "T": 32, "P": 16, "CTX": 32768, "L": 35},
               "config.json: num_attention_heads 8, global_head_dim 512, one KV head, partial_rotary_factor "
               "0.25, num_hidden_layers 35"),
        Preset("Qwen3-Next-80B-A3B full attention: 64 tokens at 16384",
               {"HD": 256, "R": 64, "NKV": 2, "G": 8, "T": 64, "P": 16, "CTX": 16384, "L": 48},
               "config.json: num_attention_heads 16, num_key_value_heads 2, head_dim 256, partial_rotary_factor "
               "0.25, num_hidden_layers 48"),
        Preset("Gemma 3 1B: a 128-token chunk at 16384",
               {"HD": 256, "R": 256, "NKV": 1, "G": 4, "T": 128, "P": 16, "CTX": 16384, "L": 26},
               "config.json: num_attention_heads 4, num_key_value_heads 1, head_dim 256, num_hidden_layers 26"),
        Preset("Gemma 3 4B, a token-level pool (pages of 1): 32 tokens at 1024",
               {"HD": 256, "R": 256, "NKV": 4, "G": 2, "T": 32, "P": 1, "CTX": 1024, "L": 34},
               "config.json: num_attention_heads 8, num_key_value_heads 4, head_dim 256, num_hidden_layers 34"),
    ),
)


def qk_rope_shape_check(shape):
    s = qk.sweep_shape(shape)
    qk.chain_holds_at(qk.sweep_data(s), s.scenario)


@pytest.mark.gpu
@pytest.mark.sweep
def test_qk_rope_chain_holds_bitwise_over_its_shape_space():
    sweep(QK_ROPE_SHAPES, qk_rope_shape_check)


@pytest.mark.structural
def test_every_preset_and_boundary_of_the_qk_rope_shape_space_is_a_shape_the_launcher_accepts():
    # The space promises shapes the kernel runs: each arm's host checks take each preset and
    # boundary as the sweep builds it (numpy stand-ins of its buffers: nothing is launched).
    def accepted(shape):
        s = qk.sweep_shape(shape)
        sc, hd, t = s.scenario, s.head_dim, s.num_tokens
        q = np.empty((t, s.nq, hd), bf16)
        k = np.empty((t, s.nkv, hd), bf16)
        v = np.empty((t, s.nkv, hd), bf16) if hd == 256 else None
        w = np.empty(hd, bf16)
        cos = np.empty((s.cos_max_pos, s.rotary_dim // 2), np.float32)
        outs = [np.empty((t, n, hd), bf16) for n in (s.nq, s.nkv, s.nkv)]
        pool = np.empty(_pool(shape), bf16)
        paged = dict(page_size=sc.page_size, num_layers=sc.num_layers, layer=sc.layer, rotary_dim=s.rotary_dim)
        heads, pos = launcher.check_flat(q, k, v, w, w, cos, cos, sc.positions, *outs, rotary_dim=s.rotary_dim)
        assert (heads.nq, heads.nkv, int(pos[-1])) == (s.nq, s.nkv, s.cos_max_pos - 1)
        _, pages = launcher.check_paged_prefill(q, k, v, w, w, cos, cos, outs[0], pool, start_pos=sc.start_pos,
                                                page_indices=np.asarray(sc.window, np.int32),
                                                page_origin=sc.page_origin, **paged)
        assert pages == sc.num_pages
        indptr, indices = sc.decode_csr()
        launcher.check_paged_decode(q, k, v, w, w, cos, cos, outs[0], pool, positions=sc.positions,
                                    page_indptr=indptr, page_indices=indices, page_origins=sc.decode_origins(),
                                    **paged)

    assert_named_shapes_accepted(QK_ROPE_SHAPES, accepted)
