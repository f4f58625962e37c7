"""NVFP4 MoE decode swept over its shape space: T tokens, K experts a token, E experts, hidden H
and expert width I, every stage of the chain checked at each shape against the family's designed
oracles (oracles.moe_decode), bit for bit (fs and the router's weights within the rtol their
anchors give: rsqrtf and expf are not exact). The stages chain as designs, not as launches: the
router's designed ids are the ids glu and down get.

What the fixed shapes never reach: H or I a whole number of 64-lane sweeps (K/16 a multiple of
64: the gates' K/16 are 4, 8, 12, 44, 68 and 176), H past the seed's 2816 (the router's chunk
loop, post_attn's quantizer loop), E past 128 with a winner there, E = K, K = 1, and the
production models' sizes (the presets).
"""

from __future__ import annotations

import numpy as np
import pytest

from gates import _moe_decode as g
from harness import assert_bits_eq, assert_close
from harness.library.buffers import device_memory
from harness.library.sweep import Dim, Preset, ShapeSpace, assert_named_shapes_accepted, sweep
from kernels_cu import moe_decode as moe
from oracles import moe_decode as od

SWEEP_WIDTH = 64 * od.GROUP  # nvfp4_dot.cuh: 64 virtual lanes of one 16-value group each
TABLE_BYTES = 1 << 28  # E * H * I at most: the gate/up codes 256 MB, all tables about 430 MB (the seed's)
ORACLE_ROWS = 1 << 19  # T * K * (2I + H) at most: the expert rows the host designs for a shape

MOE_SHAPES = ShapeSpace(
    "moe_decode",
    (
        Dim("T", 1, moe.MAX_T),
        Dim("K", 1, moe.MAX_K),
        # 32: the router's top K keeps a lane's logits e = lane + 32 j (a router block's 8 experts
        # divide it, so E +- 1 off a multiple of 32 also leaves a block part empty).
        Dim("E", 1, moe.MAX_E, tile=32),
        # 4H bytes of shared memory in post_attn and final (48 KiB without an opt-in): H <= 12288.
        Dim("H", moe.DIM_MULTIPLE, 12288, multiple_of=moe.DIM_MULTIPLE, tile=SWEEP_WIDTH),
        # 2I bytes in down: I <= 24576.
        Dim("I", moe.DIM_MULTIPLE, 24576, multiple_of=moe.DIM_MULTIPLE, tile=SWEEP_WIDTH),
    ),
    where=(
        ("K <= E: a token selects at most E experts", lambda s: s["K"] <= s["E"]),
        ("E * H * I <= 2^28: the expert tables of one shape within the seed's 430 MB",
         lambda s: s["E"] * s["H"] * s["I"] <= TABLE_BYTES),
        ("T * K * (2I + H) <= 2^19: the expert rows the host designs, a fraction of a second",
         lambda s: s["T"] * s["K"] * (2 * s["I"] + s["H"]) <= ORACLE_ROWS),
    ),
    presets=(
        Preset("the contract's seed", {"T": 2, "K": 8, "E": 128, "H": 2816, "I": 704},
               "seeds/000 (contracts/moe_decode.md): E 128, H 2816, I 704, K 8, T 2"),
        Preset("DeepSeek-V3 decode: router and norms", {"T": 4, "K": 8, "E": 256, "H": 7168, "I": 128},
               "DeepSeek-V3 config.json: hidden_size 7168, n_routed_experts 256, num_experts_per_tok 8; "
               "moe_intermediate_size 2048 scaled to 128 (E * H * I within 2^28)"),
        Preset("DeepSeek-V3 decode: experts", {"T": 2, "K": 8, "E": 16, "H": 7168, "I": 2048},
               "DeepSeek-V3 config.json: hidden_size 7168, moe_intermediate_size 2048, num_experts_per_tok 8; "
               "n_routed_experts 256 scaled to 16 (E * H * I within 2^28)"),
        Preset("Qwen3-30B-A3B decode", {"T": 8, "K": 8, "E": 128, "H": 2048, "I": 768},
               "Qwen3-30B-A3B config.json: hidden_size 2048, moe_intermediate_size 768, num_experts 128, "
               "num_experts_per_tok 8 (unscaled)"),
        Preset("Qwen3-235B-A22B decode", {"T": 4, "K": 8, "E": 32, "H": 4096, "I": 1536},
               "Qwen3-235B-A22B config.json: hidden_size 4096, moe_intermediate_size 1536, num_experts_per_tok 8; "
               "num_experts 128 scaled to 32 (E * H * I within 2^28)"),
        Preset("Mixtral-8x7B decode", {"T": 8, "K": 2, "E": 4, "H": 4096, "I": 14336},
               "Mixtral-8x7B config.json: hidden_size 4096, intermediate_size 14336, num_experts_per_tok 2; "
               "num_local_experts 8 scaled to 4 (E * H * I within 2^28)"),
        Preset("gpt-oss-20b decode", {"T": 4, "K": 4, "E": 32, "H": 2880, "I": 2880},
               "gpt-oss-20b config.json: hidden_size 2880, intermediate_size 2880, num_local_experts 32, "
               "num_experts_per_tok 4 (unscaled)"),
    ),
)


def _slots(a: np.ndarray, kcap: int, fill) -> np.ndarray:
    out = np.full((a.shape[0], kcap, *a.shape[2:]), fill, dtype=a.dtype)
    out[:, :a.shape[1]] = a
    return out


def moe_shape_check(shape) -> None:
    """Every stage at one shape against its design (module docstring)."""
    t, k, e, h, i = (shape[n] for n in ("T", "K", "E", "H", "I"))
    s = g.Shape(t=t, h=h, i=i, e=e, k=k)
    seed = (t * 31 + k * 7 + e) * 131 + h + i

    post = od.post_attn_designed(t, h, seed=seed)
    out = g.run_post_attn(post.x, post.o, post.w_pa, post.w_router, act_g=post.act_g, eps=post.eps)
    for name in ("mid", "rr", "gsc", "gq", "fq"):
        assert_bits_eq(f"post_attn {name}", g.host(getattr(out, name)), getattr(post, name))
    assert_close("post_attn fs", g.host(out.fs), post.fs, atol=0.0, rtol=od.FS_RTOL)

    router = od.router_designed(t, h, e, k, seed=seed)
    got = g.run_router(router.rr, router.wr, router.pes, k=k, kcap=s.kcap)
    assert_bits_eq("router logits", g.host(got.logits), router.logits)
    assert_bits_eq("router ids", g.host(got.ids)[:, :k], router.ids)
    assert_close("router wts", g.host(got.wts)[:, :k], router.wts, atol=0.0, rtol=od.WTS_RTOL)

    glu = od.glu_sparse_designed(router.ids, h, i, seed=seed)
    down = od.down_sparse_designed(router.ids, h, i, seed=seed)
    ids = _slots(router.ids, s.kcap, g.ID_SENTINEL)
    # Tables of every size up to 430 MB, one size a shape: their blocks go back to the driver
    # after each shape (device_memory), not into a pool that would keep one of each.
    with device_memory(e * h * i * 27 // 16 + (1 << 20), f"the expert tables of E {e}, H {h}, I {i}"):
        experts = g.sparse_device_experts(s, glu.weights, down.weights, np.arange(e, dtype=np.int32))
        hq, hs, gu = g.run_glu(ids, glu.gq, glu.gsc, experts, act_g=glu.act_g, act_h=glu.act_h, k=k, i=i)
        opair = g.run_down(ids, _slots(down.hq, s.kcap, g.BYTE_SENTINEL), _slots(down.hs, s.kcap, g.BYTE_SENTINEL),
                           experts, act_h=down.act_h, k=k, h=h)
        got = {name: g.host(a) for name, a in (("gu", gu), ("hq", hq), ("hs", hs), ("opair", opair))}
        del experts, hq, hs, gu, opair
    assert_bits_eq("glu g/u", got["gu"][:, :k], glu.gu)
    assert_bits_eq("glu hs", got["hs"][:, :k], glu.hs)
    assert_bits_eq("glu hq", got["hq"][:, :k], glu.hq)
    assert_bits_eq("down opair", got["opair"][:, :k], down.opair)
    g.assert_slots_past_k_untouched("down opair", got["opair"], k)

    final = od.final_designed(t, h, k, seed=seed, repair=True)
    op = _slots(final.opair, s.kcap, np.nan)
    wts = _slots(final.wts, s.kcap, np.nan)
    got = g.run_final(final.dense, op, wts, final.mid, final.w_d, final.w_m, layer_scalar=final.layer_scalar,
                      eps=final.eps, k=k)
    assert_bits_eq("final out", g.host(got), final.out)


@pytest.mark.gpu
@pytest.mark.sweep
def test_moe_decode_matches_its_designs_over_its_shape_space():
    sweep(MOE_SHAPES, moe_shape_check)


def launch_args(shape) -> dict:
    """Host stand-ins of every stage's arguments at a shape (np.empty: never touched), by stage."""
    t, k, e, h, i = (shape[n] for n in ("T", "K", "E", "H", "I"))
    kcap = k + 2
    bf, u8, f32 = g.bf16, np.uint8, np.float32

    def z(shape, dtype):
        return np.empty(shape, dtype)

    experts = moe.Experts(wgu=z((e, 2 * i, h // 2), u8), sgu=z((e, 2 * i, h // 16), u8), gs_gu=z(e, f32),
                          wdn=z((e, h, i // 2), u8), sdn=z((e, h, i // 16), u8), gs_dn=z(e, f32),
                          table=np.arange(e, dtype=np.int32))
    ids = z((t, kcap), np.int32)
    return {
        "post_attn": (z((t, h), bf), z((t, h), bf), z((t, h), u8), z(t, f32), z((t, h // 2), u8), z((t, h // 16), u8),
                      z((t, h), bf), z((t, h), bf), z(h, bf), z(h, bf), 2.0**-8, 1e-6),
        "router": (z((t, e), f32), ids, z((t, kcap), f32), np.zeros(1, np.uint32), z((t, h), bf), z((e, h), bf),
                   z(e, bf), k),
        "glu": (z((t, kcap, i // 2), u8), z((t, kcap, i // 16), u8), z((t, kcap, 2 * i), bf), ids, z((t, h // 2), u8),
                z((t, h // 16), u8), experts, 1.0, 64.0, k),
        "down": (z((t, kcap, h), bf), ids, z((t, kcap, i // 2), u8), z((t, kcap, i // 16), u8), experts, 2.0**-6, k),
        "final": (z((t, h), bf), z((t, h), bf), z((t, kcap, h), bf), z((t, kcap), f32), z((t, h), bf), z(h, bf),
                  z(h, bf), 0.5, 1e-6, k),
    }


@pytest.mark.structural
def test_every_preset_and_boundary_of_the_moe_shape_space_is_a_shape_the_launchers_accept():
    # The space promises shapes the kernels run: one a launcher refuses is a space declared wrong.
    checks = {"post_attn": moe.check_post_attn, "router": moe.check_router, "glu": moe.check_glu,
              "down": moe.check_down, "final": moe.check_final}

    def accepted(shape):
        args = launch_args(shape)
        for stage, check in checks.items():
            sz = check(*args[stage])
            got = {"T": sz.t, "H": sz.h, "I": sz.i, "E": sz.e, "K": sz.k}
            want = {n: v for n, v in shape.items() if got[n]}  # a stage's unused sizes are 0
            assert {n: got[n] for n in want} == want, f"{stage}: the launcher read {sz}"

    assert_named_shapes_accepted(MOE_SHAPES, accepted)
