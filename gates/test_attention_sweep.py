"""Paged attention over the shapes it runs at: head size, KV heads and the GQA group, sliding
window, context length, decode rows and split count, prefill chunk rows.

At every shape the anchor is exact: the ladder case (oracles.paged_attention, "ladders") makes
each (row, kv head)'s output one V row the host copies out of the pool, at any context length,
with every key no row may see a decoy that would win. Decode checks both merges (the last CTA's
and the combine kernel's), prefill the kernel's row tiles, each with the kv heads' ladders one
way and then the other. The fixed gates run 4, 8 and 16 query heads in groups of 2, 4 and 8,
contexts to 2048, windows to 1024; the sweep runs what models run (the presets) and what the
launcher accepts around them (docs/shapes.md).
"""

from __future__ import annotations

import numpy as np
import pytest

from gates._paged_attention import (WINDOW_NONE, decode_ladder_holds, decode_plan, decode_spans, prefill_ladder_holds,
                                    prefill_plan, prefill_spans)
from harness.library.sweep import Dim, Preset, ShapeSpace, assert_named_shapes_accepted, sweep
from kernels_cu import paged_attention as pa
from oracles import paged_attention as ora

def _pool(s, pages: int) -> int:
    """Elements of `pages` pool pages (of K, and as many of V)."""
    return pages * s["NKV"] * pa.PAGE * s["HD"]


# Shared dimensions (pages are 16 keys: pa.PAGE, the one page size the kernels are built for).
# W: the sliding window, W = 1 (WINDOW_NONE) for none; its tile, 512, is the
# smallest window models use (Gemma 3 1B), the others its multiples (1024 Gemma 3 and 4, 4096
# Gemma 2): a key either side puts the window's first key mid-page. CTX: the context; its tile,
# 4096 keys (256 pages), puts a query on a page's first slot, its last and the one before, at
# contexts long enough for every split count to have pages to share.
HEAD_DIMS = (Dim("HD", 256, 512, multiple_of=256), Dim("NKV", 1, 16), Dim("G", 1, 16))
WINDOW = Dim("W", WINDOW_NONE, 8192, tile=512)
CONTEXT = Dim("CTX", 1, 262144, tile=4096)
# Bounds on a shape's cost (the host builds its pools; the device walks them): a ladder climbs at
# most LADDER_MAX keys; the K pool (and the V pool) at most 2^23 elements; rows x query heads x
# pages walked at most 2^19 (a few milliseconds of device time).
COMMON_RULES = (("at most 64 query heads", lambda s: s["NKV"] * s["G"] <= 64),)


def _decode_ok(s) -> bool:
    longest, pages = decode_spans(s)
    return longest <= ora.LADDER_MAX and _pool(s, pages) <= 1 << 23 and s["ROWS"] * s["NKV"] * s["G"] * pages <= 1 << 19


def _prefill_ok(s) -> bool:
    keys, pages = prefill_spans(s)
    return keys <= ora.LADDER_MAX and _pool(s, pages) <= 1 << 23 and s["M"] * s["NKV"] * s["G"] * pages <= 1 << 19


def _splits(hd, nkv, g, w, ctx, rows) -> int:
    """The launcher's split count for a decode preset."""
    longest, _ = decode_spans({"HD": hd, "NKV": nkv, "G": g, "W": w, "CTX": ctx, "ROWS": rows})
    return pa.choose_splits(longest, rows, nkv * g)


def _decode(hd, nkv, g, w, ctx, rows) -> dict:
    return {"HD": hd, "NKV": nkv, "G": g, "W": w, "CTX": ctx, "ROWS": rows,
            "SPLITS": _splits(hd, nkv, g, w, ctx, rows)}


# Models with head size 256 or 512 (the sizes paged_attention.cu is built for; Llama-3's 128 and
# gpt-oss's 64 are not), each at the launcher's split count.
GEMMA4_SLIDING = "Gemma 4 26B-A4B config.json: num_attention_heads 16, num_key_value_heads 8, head_dim 256, " \
                 "sliding_window 1024, max_position_embeddings 262144"
GEMMA4_GLOBAL = "Gemma 4 26B-A4B config.json: global_head_dim 512, num_global_key_value_heads 2 (K = V)"
GEMMA4_E2B = "Gemma 4 E2B config.json: num_attention_heads 8, num_key_value_heads 1, global_head_dim 512"
GEMMA3_1B = "Gemma 3 1B config.json: num_attention_heads 4, num_key_value_heads 1, head_dim 256, sliding_window 512"
GEMMA2_9B = "Gemma 2 9B config.json: num_attention_heads 16, num_key_value_heads 8, head_dim 256, sliding_window 4096"
GEMMA_7B = "Gemma 7B config.json: num_attention_heads 16, num_key_value_heads 16 (no grouping), head_dim 256"
QWEN3_NEXT = "Qwen3-Next-80B-A3B config.json: num_attention_heads 16, num_key_value_heads 2, head_dim 256"

DECODE_SHAPES = ShapeSpace(
    "paged_decode",
    (*HEAD_DIMS, WINDOW, CONTEXT, Dim("ROWS", 1, 64), Dim("SPLITS", 1, pa.MAX_SPLITS)),
    where=(*COMMON_RULES, ("a ladder, pools and work within the bounds", _decode_ok)),
    presets=(
        Preset("Gemma 4 26B-A4B sliding layer: 2 sequences at 262144", _decode(256, 8, 2, 1024, 262144, 2),
               GEMMA4_SLIDING),
        Preset("Gemma 4 26B-A4B global layer: 2 sequences at 4096", _decode(512, 2, 8, WINDOW_NONE, 4096, 2),
               GEMMA4_GLOBAL),
        Preset("Gemma 4 E2B global layer: 2 sequences at 8192", _decode(512, 1, 8, WINDOW_NONE, 8192, 2), GEMMA4_E2B),
        Preset("Gemma 3 1B sliding layer: 16 sequences at 32768", _decode(256, 1, 4, 512, 32768, 16), GEMMA3_1B),
        Preset("Gemma 2 9B sliding layer: 1 sequence at 8192", _decode(256, 8, 2, 4096, 8192, 1), GEMMA2_9B),
        Preset("Gemma 7B: 1 sequence at 2048", _decode(256, 16, 1, WINDOW_NONE, 2048, 1), GEMMA_7B),
        Preset("Qwen3-Next-80B-A3B full attention: 2 sequences at 8192", _decode(256, 2, 8, WINDOW_NONE, 8192, 2),
               QWEN3_NEXT),
    ),
)

PREFILL_SHAPES = ShapeSpace(
    "paged_prefill",
    # M: the chunk's rows; 8, the hd 256 kernel's rows a tile (hd 512's 4 divides it)
    (*HEAD_DIMS, WINDOW, CONTEXT, Dim("M", 1, 256, tile=pa.prefill_rows_per_tile(256))),
    where=(*COMMON_RULES, ("M rows of a CTX-key context", lambda s: s["M"] <= s["CTX"]),
           ("a ladder, pools and work within the bounds", _prefill_ok)),
    presets=(
        Preset("Gemma 4 26B-A4B sliding layer: a 256-row chunk at 32768",
               {"HD": 256, "NKV": 8, "G": 2, "W": 1024, "CTX": 32768, "M": 256}, GEMMA4_SLIDING),
        Preset("Gemma 4 26B-A4B global layer: a 64-row chunk at 4096",
               {"HD": 512, "NKV": 2, "G": 8, "W": WINDOW_NONE, "CTX": 4096, "M": 64}, GEMMA4_GLOBAL),
        Preset("Gemma 3 1B sliding layer: a 128-row chunk at 32768",
               {"HD": 256, "NKV": 1, "G": 4, "W": 512, "CTX": 32768, "M": 128}, GEMMA3_1B),
        Preset("Gemma 7B: a 256-row chunk at 2048",
               {"HD": 256, "NKV": 16, "G": 1, "W": WINDOW_NONE, "CTX": 2048, "M": 256}, GEMMA_7B),
        Preset("Qwen3-Next-80B-A3B full attention: a 64-row chunk at 8192",
               {"HD": 256, "NKV": 2, "G": 8, "W": WINDOW_NONE, "CTX": 8192, "M": 64}, QWEN3_NEXT),
    ),
)


def paged_decode_shape_check(shape):
    decode_ladder_holds(decode_plan(shape), shape["SPLITS"])


def paged_prefill_shape_check(shape):
    prefill_ladder_holds(prefill_plan(shape))


@pytest.mark.gpu
@pytest.mark.sweep
def test_paged_decode_copies_each_rows_ladder_winner_over_its_shape_space():
    sweep(DECODE_SHAPES, paged_decode_shape_check)


@pytest.mark.gpu
@pytest.mark.sweep
def test_paged_prefill_copies_each_rows_ladder_winner_over_its_shape_space():
    sweep(PREFILL_SHAPES, paged_prefill_shape_check)


def _host(plan: ora.LadderPlan) -> dict:
    """numpy stand-ins of a plan's buffers (never touched: the launcher checks shapes and dtypes)."""
    q = np.empty((plan.rows, plan.nh, plan.hd), np.uint16)
    pool = np.empty((plan.num_pages, plan.nkv, pa.PAGE, plan.hd), np.uint16)
    return dict(out=q, q=q, k_pool=pool, v_pool=pool, bt=plan.bt, off=plan.off, qpos=plan.qpos, pmap=None,
                window=plan.window)


@pytest.mark.structural
def test_every_preset_and_boundary_of_the_attention_shape_spaces_is_a_shape_the_launcher_accepts():
    # The spaces promise shapes the kernels run: each preset and boundary as the sweep plans it
    # passes the launcher's checks (numpy stand-ins of its buffers: nothing is launched), and its
    # block table names only pages of its pool.
    def decode_accepted(shape):
        plan = decode_plan(shape)
        a = _host(plan)
        scratch = np.empty(pa.decode_scratch_floats(plan.rows, plan.nh, shape["SPLITS"], plan.hd), np.float32)
        counters = np.zeros(plan.rows * plan.nh, np.int32)
        assert pa.check_decode_args(*a.values(), scratch, shape["SPLITS"], counters) == \
            (shape["ROWS"], plan.nh, shape["NKV"], shape["HD"])
        assert 0 <= plan.bt.min() and plan.bt.max() < plan.num_pages - 1, "a block table entry outside the pool"

    def prefill_accepted(shape):
        plan = prefill_plan(shape)
        tiles = pa.make_tiles(plan.off, pa.prefill_rows_per_tile(plan.hd))
        assert pa.check_prefill_args(*_host(plan).values(), tiles) == (shape["M"], plan.nh, shape["NKV"], shape["HD"])
        assert 0 <= plan.bt.min() and plan.bt.max() < plan.num_pages - 1, "a block table entry outside the pool"

    assert_named_shapes_accepted(DECODE_SHAPES, decode_accepted)
    assert_named_shapes_accepted(PREFILL_SHAPES, prefill_accepted)
