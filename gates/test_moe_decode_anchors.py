"""NVFP4 MoE decode: the anchors. Each compares one GPU stage with host math on inputs
designed so the expected bits are certain (oracles/moe_decode.py says why for each), at the
seed's sizes and at small ones off every block size."""

from __future__ import annotations

import numpy as np
import pytest

from gates import _moe_decode as g
from harness import assert_bits_eq, assert_close, rel_rms
from harness.library.dtypes import bits_of, to_bf16
from oracles import moe_decode as od

shapes = pytest.mark.parametrize("shape_id", g.SHAPE_IDS)


@pytest.mark.gpu
@pytest.mark.anchor
@shapes
def test_post_attn_matches_host_quantization_on_designed_inputs(shape_id):
    # Exact: mean(o^2) = mean(mid^2) = 1 by design and every rounding is margin-checked on the
    # host (post_attn_designed), incl. block scales saturated at 448, e2m1 at 6, a zero block
    # a token and a last token that is the zero vector.
    s = g.SHAPES[shape_id]
    case = od.post_attn_designed(s.t, s.h, seed=s.h)
    out = g.run_post_attn(case.x, case.o, case.w_pa, case.w_router, act_g=case.act_g, eps=case.eps)
    _assert_post_attn_outputs(out, case)


def _assert_post_attn_outputs(out, case, how: str = "") -> None:
    assert_bits_eq(f"post_attn mid{how}", g.host(out.mid), case.mid)
    assert_bits_eq(f"post_attn rr{how}", g.host(out.rr), case.rr)
    assert_bits_eq(f"post_attn gsc (NVFP4 block scales){how}", g.host(out.gsc), case.gsc)
    assert_bits_eq(f"post_attn gq (NVFP4 codes){how}", g.host(out.gq), case.gq)
    assert_bits_eq(f"post_attn fq (e4m3 dense input){how}", g.host(out.fq), case.fq)
    # fs = amax(n) / 448 is not rounded after the norm: it carries rsqrtf's 2 ulp and three f32
    # roundings, under 2^-20 relative; FS_RTOL is 2^-19.
    assert_close(f"post_attn fs{how}", g.host(out.fs), case.fs, atol=0.0, rtol=od.FS_RTOL)


@pytest.mark.gpu
@pytest.mark.anchor
@shapes
def test_post_attn_normalises_an_o_whose_mean_square_is_four(shape_id):
    # The designed anchor above with o twice as large (mean(o^2) = 4 exactly, o_scale 2): the
    # first norm halves it, so mid and everything after it are the unit design's, bit for bit
    # (margins checked on the host as above). With mean(o^2) = 1 the norm's factor is 1 to bf16
    # and a kernel that divides by it, or skips it, agrees; here it is off by 4x or 2x.
    s = g.SHAPES[shape_id]
    case = od.post_attn_designed(s.t, s.h, seed=s.h, o_scale=2.0)
    out = g.run_post_attn(case.x, case.o, case.w_pa, case.w_router, act_g=case.act_g, eps=case.eps)
    assert_bits_eq("post_attn mid (mean(o^2) = 4)", g.host(out.mid), case.mid)
    assert_bits_eq("post_attn rr (mean(o^2) = 4)", g.host(out.rr), case.rr)
    assert_bits_eq("post_attn gq (mean(o^2) = 4)", g.host(out.gq), case.gq)
    assert_close("post_attn fs (mean(o^2) = 4)", g.host(out.fs), case.fs, atol=0.0, rtol=od.FS_RTOL)


@pytest.mark.gpu
@pytest.mark.anchor
@shapes
def test_zero_token_normalises_to_zero_in_every_output(shape_id):
    # rmsnorm(0) = 0 * rsqrt(0 + eps) = 0 exactly; without eps it is 0 * inf = NaN.
    s = g.SHAPES[shape_id]
    z = to_bf16(np.zeros((s.t, s.h)))
    w = to_bf16(np.linspace(0.5, 1.5, s.h))
    out = g.run_post_attn(z, z, w, w, act_g=od.ACT_G, eps=1e-6)
    for name in ("mid", "rr", "fq", "gq", "gsc", "fs"):
        got = bits_of(g.host(getattr(out, name)))
        assert np.all(got == 0), (
            f"zero token: post_attn {name} has {int(np.count_nonzero(got))} nonzero elements "
            f"(first bits 0x{int(got.ravel()[np.flatnonzero(got.ravel())[0]]):x}); rmsnorm of a zero vector must be 0"
        )


@pytest.mark.gpu
@pytest.mark.anchor
@shapes
def test_router_picks_designed_top_k_with_ties_to_the_lowest_id(shape_id):
    # Exact ids and logits: integer dots times powers of two. A tie straddles the K boundary and
    # (K >= 3) one sits inside the top K; expert 0 never wins.
    s = g.SHAPES[shape_id]
    case = od.router_designed(s.t, s.h, s.e, s.k, seed=s.e)
    _assert_router_designed(g.run_router(case.rr, case.wr, case.pes, k=s.k, kcap=s.kcap), case, s.k)


def _assert_router_designed(out, case, k: int, where: str = "") -> None:
    """The designed router case's logits and ids bit for bit, its weights within WTS_RTOL,
    the slots past K untouched."""
    assert_bits_eq(f"router logits{where}", g.host(out.logits), case.logits)
    assert_bits_eq(f"router ids (descending logit, ties to the lowest id){where}", g.host(out.ids)[:, :k], case.ids)
    # expf is within 2 ulp; with the sum and one IEEE division the weights are within 2^-20.
    assert_close(f"router wts{where}", g.host(out.wts)[:, :k], case.wts, atol=0.0, rtol=od.WTS_RTOL)
    g.assert_slots_past_k_untouched("router ids", out.ids, k)
    g.assert_slots_past_k_untouched("router wts", out.wts, k)


@pytest.mark.gpu
@pytest.mark.anchor
@shapes
def test_router_k_equal_top_logits_weigh_exactly_one_over_k(shape_id):
    # exp(0) = 1 exactly, the sum is K exactly, the weight is the IEEE 1 / K (1/8 exactly for K 8).
    s = g.SHAPES[shape_id]
    case = od.router_designed(s.t, s.h, s.e, s.k, seed=s.e + 1, equal_top=True)
    out = g.run_router(case.rr, case.wr, case.pes, k=s.k, kcap=s.kcap)
    assert_bits_eq("router ids (K equal logits, ascending id)", g.host(out.ids)[:, :s.k], case.ids)
    assert_bits_eq("router wts (K equal logits)", g.host(out.wts)[:, :s.k], case.wts)


@pytest.mark.gpu
@pytest.mark.anchor
@shapes
def test_glu_reference_arm_matches_host_on_saturated_inputs(shape_id):
    # Exact: g is 0 or |g| >= 10, where tanhf is exactly +-1, so a = g * u, 0 or -0 with the
    # kernel's f32 operations; the quantizer then runs on exact f32 values on both sides.
    s = g.SHAPES[shape_id]
    case = od.glu_designed(s.t * s.k, s.i, seed=s.i)
    hq, hs = g.run_glu_reference(case.gu, act_h=case.act_h)
    assert_bits_eq("glu reference hs (block scales)", g.host(hs), case.hs)
    assert_bits_eq("glu reference hq (codes)", g.host(hq), case.hq)


@pytest.mark.gpu
@pytest.mark.anchor
@shapes
def test_glu_matches_host_on_designed_expert_weights(shape_id):
    # Exact: the production moe_glu on designed experts (two live groups a row under one
    # power-of-two scale, gs = 1, act_g = 1): every g/u is a short dyadic sum, exact in any
    # order; gate rows are 0 or |g| >= 10, so a = g * u exactly, then the host quantizer.
    s = g.SHAPES[shape_id]
    case = g.designed_glu(shape_id)
    ids = np.full((s.t, s.kcap), -1, np.int32)
    ids[:, :s.k] = case.ids
    experts = g.device_experts(s, case.weights, np.arange(s.e, dtype=np.int32))
    hq, hs, gu = g.run_glu(ids, case.gq, case.gsc, experts, act_g=case.act_g, act_h=case.act_h, k=s.k, i=s.i)
    assert_bits_eq("glu g/u (designed experts)", g.host(gu)[:, :s.k], case.gu)
    assert_bits_eq("glu hs (designed experts)", g.host(hs)[:, :s.k], case.hs)
    assert_bits_eq("glu hq (designed experts)", g.host(hq)[:, :s.k], case.hq)
    for name, a in (("g/u", gu), ("hq", hq), ("hs", hs)):
        g.assert_slots_past_k_untouched(f"glu {name} (designed experts)", a, s.k)


@pytest.mark.gpu
@pytest.mark.anchor
@shapes
def test_final_matches_host_on_designed_slots(shape_id):
    # Exact: the slot sum is exact (multiples of 1/8), both norms see mean(v^2) = 1 and the
    # output rounding is margin-checked; the last slot weighs most.
    s = g.SHAPES[shape_id]
    case, inputs = g.final_designed_inputs(s)
    out = g.run_final(*inputs, layer_scalar=case.layer_scalar, eps=case.eps, k=s.k)
    assert_bits_eq("final out", g.host(out), case.out)


@pytest.mark.gpu
@pytest.mark.anchor
@pytest.mark.memory_safety
@shapes
def test_post_attn_reads_and_writes_nothing_outside_its_buffers(shape_id):
    # The designed post_attn anchor with x, o and both weights between NaN fences
    # and all six outputs between sentinel guards. A read a little outside an input puts a
    # NaN into mid and everything after it, a store outside an output lands in a guard, both
    # by assertion; a read or store further away (a block reduction's slot from lane -1, a
    # token's row from block -1) faults, and a fault here is this gate's verdict
    # (docs/mutation.md, Verdicts).
    s = g.SHAPES[shape_id]
    case = od.post_attn_designed(s.t, s.h, seed=s.h)
    out, wholes = g.run_post_attn_fenced(case.x, case.o, case.w_pa, case.w_router, act_g=case.act_g, eps=case.eps)
    _assert_post_attn_outputs(out, case, " (inputs between NaN fences)")
    for name, whole in wholes.items():
        g.assert_guards_untouched(f"post_attn {name}", whole)


@pytest.mark.gpu
@pytest.mark.anchor
@pytest.mark.memory_safety
@shapes
def test_final_reads_and_writes_nothing_outside_its_buffers(shape_id):
    # The designed final anchor with every input between NaN fences (the slots
    # past K are NaN already) and out between sentinel guards; as above.
    s = g.SHAPES[shape_id]
    case, inputs = g.final_designed_inputs(s)
    out, whole = g.run_final_fenced(*inputs, layer_scalar=case.layer_scalar, eps=case.eps, k=s.k)
    assert_bits_eq("final out (inputs between NaN fences)", g.host(out), case.out)
    g.assert_guards_untouched("final out", whole)


@pytest.mark.gpu
@pytest.mark.anchor
@pytest.mark.memory_safety
@shapes
def test_router_reads_and_writes_nothing_outside_its_buffers(shape_id):
    # The designed router anchor with rr, Wr and pes between NaN fences and logits, ids and wts
    # between sentinel guards. At the small shape E 13 is not a multiple of a router block's 8
    # experts (warps 13..15 of the last block have none) and T 3 is below its 8 warps (warps
    # 3..7 select for no token): an expert or a token past the end stores a NaN logit, an id or
    # a weight into a guard, by assertion; an index wrapped far away faults, and a fault here is
    # this gate's verdict (docs/mutation.md, Verdicts).
    s = g.SHAPES[shape_id]
    case = od.router_designed(s.t, s.h, s.e, s.k, seed=s.e)
    out, wholes = g.run_router_fenced(case.rr, case.wr, case.pes, k=s.k, kcap=s.kcap)
    _assert_router_designed(out, case, s.k, " (inputs between NaN fences)")
    for name, whole in wholes.items():
        g.assert_guards_untouched(f"router {name}", whole)


@pytest.mark.gpu
@pytest.mark.anchor
@pytest.mark.memory_safety
@shapes
def test_glu_reference_arm_reads_and_writes_nothing_outside_its_buffers(shape_id):
    # The reference arm's moderate design with gu between NaN fences and hq, hs between byte
    # sentinel guards; a block or slot index off by one (unsigned: wrapped at block 0) reads or
    # stores outside them, by assertion nearby and by a fault (this gate's verdict) far away.
    s = g.SHAPES[shape_id]
    case = od.glu_moderate_designed(s.t * s.k, s.i, seed=s.i + 2)
    hq, hs, wholes = g.run_glu_reference_fenced(case.gu, act_h=case.act_h)
    assert_bits_eq("glu reference hs (gu between NaN fences)", g.host(hs), case.hs)
    assert_bits_eq("glu reference hq (gu between NaN fences)", g.host(hq), case.hq)
    for name, whole in wholes.items():
        g.assert_guards_untouched(f"glu reference {name}", whole)


@pytest.mark.gpu
@pytest.mark.anchor
@shapes
def test_zero_expert_weights_and_zero_dense_return_mid_times_layer_scalar(shape_id):
    # The seed's case, on non-constant inputs: every expert output is exactly 0, so both norms
    # give 0 and out = bf16(f32(mid) * layer_scalar) with the chain's own mid.
    s = g.SHAPES[shape_id]
    inp = od.random_layer(s.t, s.h, s.e, seed=7)
    inp = od.LayerInputs(**{**vars(inp), "dense": to_bf16(np.zeros((s.t, s.h)))})
    chain = g.run_chain(s, inp, experts=g.zero_experts(s))
    mid = chain.post["mid"].astype(np.float32)
    assert np.count_nonzero(mid) > mid.size // 2, "mid is mostly zero: the anchor would be vacuous"
    assert np.all(bits_of(chain.opair[:, :s.k]) & 0x7FFF == 0), "zero experts gave a nonzero opair"
    assert_bits_eq("layer out (zero experts, zero dense)", chain.out,
                   to_bf16(mid * np.float32(inp.layer_scalar)))


@pytest.mark.gpu
@pytest.mark.anchor
@shapes
def test_layer_matches_the_float64_reference_within_the_nvfp4_bound(shape_id):
    # The reference: the whole layer in float64 without quantization, on the device's own ids
    # (top-K flips are not errors). The bound (oracles.moe_decode.layer_reference) comes from
    # the NVFP4 grid steps of the two quantized activations.
    chain = g.random_chain(shape_id)
    ref = g.random_chain_reference(shape_id)
    err = rel_rms(chain.out.astype(np.float64), ref.out)
    assert err <= ref.bound, (
        f"layer out vs float64 reference: rel_rms {err:.3e} > bound {ref.bound:.3e} "
        f"(NVFP4 steps of the activations; a dropped slot or a wrong expert moves it past)"
    )


# ------------------------------------------------------------------ boundary designs (small, cheap)


@pytest.mark.gpu
@pytest.mark.anchor
def test_post_attn_amax_lies_in_each_warp_in_turn():
    # Exact, as the designed post_attn anchor above. T = 8, H = 256: every thread owns one
    # element, and token t's largest |mid| lies in warp t alone, so the block max must read
    # every warp's slot (a block reduction that skips, shifts or overwrites one warp's result
    # moves that token's fs and fq; with the max repeated across warps it would not).
    case = od.post_attn_designed(8, 256, seed=256, zero_token=False, amax_warps=True)
    out = g.run_post_attn(case.x, case.o, case.w_pa, case.w_router, act_g=case.act_g, eps=case.eps)
    assert_close("post_attn fs (token t's amax in warp t)", g.host(out.fs), case.fs, atol=0.0, rtol=od.FS_RTOL)
    assert_bits_eq("post_attn fq (token t's amax in warp t)", g.host(out.fq), case.fq)
    assert_bits_eq("post_attn mid (amax in warp t)", g.host(out.mid), case.mid)
    assert_bits_eq("post_attn rr (amax in warp t)", g.host(out.rr), case.rr)
    assert_bits_eq("post_attn gsc (amax in warp t)", g.host(out.gsc), case.gsc)
    assert_bits_eq("post_attn gq (amax in warp t)", g.host(out.gq), case.gq)


# E 8 is one router block: the last CTA to take the ticket is the first (ticket 0 == gridDim - 1)
ROUTER_EDGES = {"E256-K8-H64": (256, 8), "E13-K3-H64": (13, 3), "E8-K3-H64": (8, 3)}


@pytest.mark.gpu
@pytest.mark.anchor
@pytest.mark.parametrize("case_id", list(ROUTER_EDGES))
def test_router_top_k_at_its_edges(case_id):
    # Exact ids and logits (one-hot rr: every logit is one bf16 weight). Token 0: winners at
    # the largest ids (E - 1; 224 and 255 at E 256, the eighth logit of a lane) and at 32, 64,
    # 65, 96, 97, 130, the top two tied. Token 1: every logit negative, expert 0 on top. Token 2:
    # one logit 96 above the rest, so exp(l - max) overflows unless max is the top logit itself.
    e, k = ROUTER_EDGES[case_id]
    case = od.router_edges_designed(64, e, k, seed=e)
    out = g.run_router(case.rr, case.wr, case.pes, k=k, kcap=k + 2)
    assert_bits_eq("router logits (edges)", g.host(out.logits), case.logits)
    ids = g.host(out.ids)[:, :k]
    for t, kind in enumerate(case.kinds):
        assert_bits_eq(f"router ids of the {kind} token", ids[t], case.ids[t])
    wts = g.host(out.wts)[:, :k]
    # expf within 2 ulp, a sum and one IEEE division: within 2^-20 (WTS_RTOL 2^-19).
    assert_close("router wts (edges and negative tokens)", wts[:2], case.wts[:2], atol=0.0, rtol=od.WTS_RTOL)
    dom = wts[2]
    assert dom[0] == np.float32(1.0), f"router wts of the dominant token: w_0 = {dom[0]!r}, expected exactly 1 (the rest sum below 2^-120)"
    assert np.all((dom[1:] >= 0) & (dom[1:] < od.TINY_WEIGHT)), (
        f"router wts of the dominant token: {dom[1:].tolist()} must lie in [0, 2^-126) (logits 96 below the top)")
    g.assert_slots_past_k_untouched("router ids (edges)", out.ids, k)
    g.assert_slots_past_k_untouched("router wts (edges)", out.wts, k)


@pytest.mark.gpu
@pytest.mark.anchor
@shapes
def test_glu_reference_arm_matches_host_off_tanh_saturation(shape_id):
    # Exact codes and scales on margin-checked inputs: g in [-1.5, -0.25] or [0.25, 4], where
    # gelu_tanh is not g or 0 and every constant of moe_glu_value matters. The device's a is
    # within 2^-18 (relative) of float64's there (oracles.moe_decode.glu_moderate_designed
    # says why); every rounding of the quantizer is at least GLU_MARGIN = 2^-14 from a boundary.
    s = g.SHAPES[shape_id]
    case = od.glu_moderate_designed(s.t * s.k, s.i, seed=s.i + 2)
    hq, hs = g.run_glu_reference(case.gu, act_h=case.act_h)
    assert_bits_eq("glu reference hs off saturation (block scales)", g.host(hs), case.hs)
    assert_bits_eq("glu reference hq off saturation (codes)", g.host(hq), case.hq)


# (E, K, H): H 64 leaves lanes 8..31 of a router warp with no chunk of the row; H 2816 gives
# every lane eleven.
ROUTER_ZERO = {"E13-K3-H64": (13, 3, 64), "E128-K8-H2816": (128, 8, 2816)}


@pytest.mark.gpu
@pytest.mark.anchor
@pytest.mark.parametrize("case_id", list(ROUTER_ZERO))
def test_router_zero_tokens_score_exactly_zero_and_take_the_lowest_ids(case_id):
    # Tokens 0 and 3 have rr = 0 (the zero token of post_attn): every logit is pes * (+0) = +0
    # exactly, all E tie, ids 0..K-1, weights exp(0) / K = the IEEE 1/K. Exact zeros are where an
    # accumulator that does not start at +0 shows: a nonzero dot absorbs a stale denormal left in
    # it, a zero dot does not. Tokens 1 and 2 are one-hot (exact logits, zeros and ties included).
    e, k, h = ROUTER_ZERO[case_id]
    case = od.router_zero_tokens_designed(h, e, k, seed=e)
    out = g.run_router(case.rr, case.wr, case.pes, k=k, kcap=k + 2)
    assert_bits_eq("router logits (zero tokens 0 and 3 must score +0 for every expert)", g.host(out.logits), case.logits)
    assert_bits_eq("router ids (zero tokens: E tied logits, ids 0..K-1)", g.host(out.ids)[:, :k], case.ids)
    wts = g.host(out.wts)[:, :k]
    zero = np.asarray(case.zero)
    assert_bits_eq("router wts of the zero tokens (exactly 1/K)", wts[zero], case.wts[zero])
    # expf within 2 ulp, a sum and one IEEE division: within 2^-20 (WTS_RTOL 2^-19).
    assert_close("router wts of the one-hot tokens", wts[~zero], case.wts[~zero], atol=0.0, rtol=od.WTS_RTOL)
    g.assert_slots_past_k_untouched("router ids (zero tokens)", out.ids, k)
    g.assert_slots_past_k_untouched("router wts (zero tokens)", out.wts, k)
