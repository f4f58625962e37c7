"""Host tests of the MoE decode oracles and launcher plans: they run with no GPU.

They hold the designs to their promises (exact sums of squares, ties where the controls need
them, saturation and zero blocks present), the host quantizers to ml_dtypes, and the
kernel's e2m1 thresholds (copied in oracles.moe_decode.e2m1_device_codes) to ml_dtypes'
round-to-nearest-even on every boundary."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from harness.library.dtypes import bits_of, decode_e4m3, to_bf16, unpack_fp4
from kernels_cu import moe_decode as moe
from oracles import moe_decode as od

SHAPES = {"seed": (2, 2816, 128, 704, 8), "small": (3, 192, 13, 128, 3)}


# ------------------------------------------------------------------ quantizers


def test_device_e2m1_thresholds_round_like_ml_dtypes_on_every_boundary():
    grid = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)
    mids = (grid[:-1] + grid[1:]) / 2
    pts = np.concatenate([grid, mids, np.nextafter(mids, np.float32(0)), np.nextafter(mids, np.float32(9)),
                          np.array([6.5, 7.0, 100.0, 1e30], np.float32), np.linspace(0, 8, 4001, dtype=np.float32)])
    pts = np.concatenate([pts, -pts]).astype(np.float32)
    expected = np.clip(pts, -6, 6).astype(ml_dtypes.float4_e2m1fn).view(np.uint8) & 0xF
    np.testing.assert_array_equal(od.e2m1_device_codes(pts), expected)
    np.testing.assert_array_equal(od.e2m1_sat_codes(pts), expected)


def test_e2m1_keeps_the_sign_of_zero_and_saturates_at_six():
    codes = od.e2m1_sat_codes(np.array([0.0, -0.0, 5.0, 5.01, 6.0, 7.5, -9.0], np.float32))
    assert codes.tolist() == [0x0, 0x8, 0x6, 0x7, 0x7, 0x7, 0xF]


def test_e4m3_scale_saturates_at_448_where_ml_dtypes_gives_nan():
    assert np.isnan(np.float32(470).astype(ml_dtypes.float8_e4m3fn).astype(np.float32))
    assert od.e4m3_sat_bits(np.array([470.0, 448.0, 1e9, -470.0])).tolist() == [0x7E, 0x7E, 0x7E, 0xFE]


def test_nvfp4_quantizer_zero_block_saturation_and_round_trip():
    rng = np.random.default_rng(0)
    v = rng.normal(0, 1, (4, 64)).astype(np.float32)
    v[0, :16] = 0.0  # a zero block
    v[1, 16] = 40.0  # amax / (6 * 2^-8) = 1707 > 448: the scale saturates, e2m1 too
    q, s = od.nvfp4_quantize(v, 2.0**-8)
    assert s[0, 0] == 0 and np.all(q[0, :8] == 0), "a zero block must give s = 0 and q = 0"
    assert s[1, 1] == 0x7E, f"block scale {s[1, 1]:#x} not saturated at 448"
    assert (q[1, 8] & 0xF) == 0x7, "40 / (448 * 2^-8) = 22.9 must saturate at e2m1 6"
    back = od.nvfp4_dequantize(q, s, 2.0**-8).astype(np.float32)
    step = np.repeat(decode_e4m3(s), 16, axis=-1) * np.float32(2.0**-8)
    ok = np.ones_like(v, dtype=bool)
    ok[1, 16:32] = False  # the saturated block is clipped, not rounded
    assert np.all(np.abs(back - v)[ok] <= step[ok] * 1.0 + 1e-12), "dequantized value further than a grid step"


def test_nvfp4_dequantize_is_exact_in_bf16_for_a_power_of_two_scale():
    q = np.arange(256, dtype=np.uint8).reshape(4, 64)
    s = np.array([[0x01, 0x38, 0x7E, 0x40, 0x08, 0x30, 0x50, 0x77]] * 4, np.uint8)
    x = od.nvfp4_dequantize(q, s, 2.0**-8)
    exact = unpack_fp4(q, 128).astype(np.float64) * np.repeat(decode_e4m3(s).astype(np.float64), 16, -1) * 2.0**-8
    np.testing.assert_array_equal(x.astype(np.float64), exact)


def test_fp8_token_quantizer_gives_zero_for_a_zero_vector():
    fq, fs = od.fp8_token_quantize(np.zeros((1, 64), np.float32))
    assert fs.tolist() == [0.0] and np.all(fq == 0)


# ------------------------------------------------------------------ designs


@pytest.mark.parametrize("n", [64, 192, 2816])
def test_unit_rms_codes_have_an_exact_unit_mean_square(n):
    rng = np.random.default_rng(n)
    j = od.unit_rms_codes(n, rng, zero_block=1)
    assert int(np.sum(j * j)) == 64 * n
    assert np.all(j[16:32] == 0) and np.abs(j).max() <= 127
    assert np.count_nonzero(j) > n - 40, "more zeros than the zero block"


@pytest.mark.parametrize("name", SHAPES)
def test_post_attn_design_has_zero_saturated_and_ordinary_blocks(name):
    t, h, _, _, _ = SHAPES[name]
    c = od.post_attn_designed(t, h, seed=h)
    for tok in range(t - 1):
        assert 0 in c.gsc[tok], f"token {tok} has no zero block"
        assert 0x7E in c.gsc[tok], f"token {tok} has no block scale saturated at 448"
        codes = np.stack([c.gq[tok] & 0xF, c.gq[tok] >> 4], -1).ravel()
        assert np.any((codes & 7) == 7), f"token {tok} has no e2m1 value saturated at 6"
        assert len(set(c.gsc[tok].tolist())) > 5, "too few distinct block scales"
    assert np.all(bits_of(c.x[-1]) == 0) and np.all(bits_of(c.o[-1]) == 0), "the last token must be the zero vector"
    assert np.all(bits_of(c.mid[-1]) == 0) and c.fs[-1] == 0
    for tok in range(t - 1):
        m = c.mid[tok].astype(np.float64)
        assert np.mean(m * m) == 1.0, "mid's mean square must be exactly 1"
    if t > 2:
        assert not np.array_equal(bits_of(c.mid[0]), bits_of(c.mid[1])), "tokens must differ"


@pytest.mark.parametrize("name", SHAPES)
def test_router_design_ties_straddle_the_k_boundary_and_expert_zero_never_wins(name):
    t, h, e, _, k = SHAPES[name]
    c = od.router_designed(t, h, e, k, seed=e)
    assert not np.any(c.ids == 0), "expert 0 must not win"
    assert len({tuple(r) for r in c.ids.tolist()}) == t, "tokens picked the same experts"
    for tok in range(t):
        kth = c.logits[tok, c.ids[tok, -1]]
        tied = np.flatnonzero(c.logits[tok] == kth)
        outside = [x for x in tied if x not in c.ids[tok]]
        assert outside and min(outside) > max(x for x in tied if x in c.ids[tok]), (
            f"token {tok}: no tie straddling the K boundary with the loser holding the higher id")
        flipped = od.topk_ties_low(-(-c.logits[tok:tok + 1]), k)
        assert np.array_equal(flipped[0], c.ids[tok])
    # Ties to the highest id would pick another set: the control moe_router_ties_go_to_the_highest_id.
    high = np.stack([np.lexsort((-np.arange(e), -row))[:k] for row in c.logits])
    assert not np.array_equal(high, c.ids)
    # A softmax over all E is far outside WTS_RTOL: the control moe_router_softmax_over_all_experts.
    sel = np.take_along_axis(c.logits, c.ids, 1).astype(np.float64)
    over_all = np.exp(sel - sel[:, :1]) / np.exp(c.logits - sel[:, :1]).sum(-1, keepdims=True)
    assert np.min(np.abs(over_all / c.wts - 1)) > 100 * od.WTS_RTOL


@pytest.mark.parametrize("k", [1, 2, 3, 4, 8])
def test_equal_top_logits_weigh_exactly_one_over_k(k):
    c = od.router_designed(2, 192, 13, k, seed=k, equal_top=True)
    assert np.all(c.wts == np.float32(1) / np.float32(k))
    if k in (1, 2, 4, 8):
        assert np.all(c.wts == 1.0 / k)


def test_glu_design_needs_zero_or_saturated_g():
    with pytest.raises(od.DesignError, match="g must be 0 or"):
        od.glu_saturated(np.array([3.0]), np.array([1.0]))
    a = od.glu_saturated(np.array([0.0, 10.0, -12.0, 0.0], np.float32), np.array([2.0, -3.0, 5.0, -1.0], np.float32))
    assert bits_of(a).tolist() == bits_of(np.array([0.0, -30.0, -0.0, -0.0], np.float32)).tolist()


@pytest.mark.parametrize("name", SHAPES)
def test_glu_design_has_zero_and_saturated_blocks(name):
    t, _, _, i, k = SHAPES[name]
    c = od.glu_designed(t * k, i, seed=i)
    assert np.all(np.any(c.hs == 0, axis=1)) and np.all(np.any(c.hs == 0x7E, axis=1))


@pytest.mark.parametrize("name", SHAPES)
def test_glu_weights_design_gives_zero_or_saturated_gates_and_distinct_tokens(name):
    t, h, e, i, k = SHAPES[name]
    c = od.glu_weights_designed(t, h, e, i, k, seed=i + 1)
    g = c.gu[..., :i].astype(np.float32)
    assert np.all((g == 0) | (np.abs(g) >= od.GELU_SATURATED))
    assert 0.1 < np.mean(g == 0) < 0.5, "zero and saturated gate rows must both be present"
    assert not np.any(c.ids == 0) and len({tuple(r) for r in c.ids.tolist()}) == t
    assert np.count_nonzero(c.gu[..., i:].astype(np.float32)) > c.gu[..., i:].size // 2, "up rows mostly zero"
    assert len(np.unique(c.hs)) > 5


@pytest.mark.parametrize("name", SHAPES)
def test_final_design_moves_when_the_last_slot_is_dropped(name):
    t, h, _, _, k = SHAPES[name]
    c = od.final_designed(t, h, k, seed=h + k)
    m = np.einsum("tk,tkh->th", c.wts.astype(np.float64), c.opair.astype(np.float64))
    assert np.all(np.mean(m * m, axis=-1) == 1.0)
    wts = c.wts.copy()
    wts[:, -1] = 0
    try:
        dropped = od.final_expected(c.mid, c.dense, c.opair, wts, c.w_d, c.w_m, c.layer_scalar, c.eps)
    except od.DesignError:
        return  # a different output that is not even cleanly rounded: certainly not equal
    assert np.count_nonzero(bits_of(dropped) != bits_of(c.out)) > h // 2


def test_layer_reference_with_zero_experts_is_mid_times_the_layer_scalar():
    t, h, e, i, k = 2, 128, 5, 64, 2
    inp = od.random_layer(t, h, e, seed=1)
    inp = od.LayerInputs(**{**vars(inp), "dense": to_bf16(np.zeros((t, h)))})
    ids = np.array([[1, 3], [4, 2]], np.int32)
    w = od.random_experts(ids, h, i, seed=0)
    for d in (w.wgu, w.wdn):
        for key in d:
            d[key] = np.zeros_like(d[key])
    ref = od.layer_reference(inp, ids, w)
    x, o = inp.x.astype(np.float64), inp.o.astype(np.float64)
    mid = x + o * od.rms_factor64(o, inp.eps) * inp.w_pa.astype(np.float64)
    np.testing.assert_allclose(ref.out, mid * inp.layer_scalar, rtol=1e-12)


def test_layer_reference_bound_is_meaningful_on_random_experts():
    t, h, e, i, k = 2, 192, 13, 128, 3
    inp = od.random_layer(t, h, e, seed=2)
    ids = np.array([[1, 5, 9], [2, 7, 12]], np.int32)
    ref = od.layer_reference(inp, ids, od.random_experts(ids, h, i, seed=3))
    assert 2.0**-8 < ref.bound < 0.5, f"bound {ref.bound}"
    assert np.all(np.isfinite(ref.out))


def test_permuted_table_has_no_fixed_point():
    for e in (2, 13, 128):
        p = od.permuted_table(e, seed=e)
        assert sorted(p.tolist()) == list(range(e)) and np.all(p != np.arange(e))


# ------------------------------------------------------------------ launcher plans


def test_grids_cover_every_expert_row_and_slot():
    assert moe.router_grid(13) == (2, 1, 1) and moe.router_grid(128) == (16, 1, 1)
    assert moe.glu_grid(704, 2, 8) == (44, 16, 1)
    assert moe.down_grid(2816, 3, 3) == (176, 9, 1)


@pytest.mark.parametrize("kwargs, message", [
    (dict(t=0, h=64), "T=0 is not in 1..8"),
    (dict(t=1, h=64, e=4, k=5), "K=5 > E=4"),
    (dict(t=1, h=64, i=100), "I=100 is not a positive multiple of 64"),
    (dict(t=1, h=64, e=300), "E=300 is not in 1..256"),
    (dict(t=1, h=64, e=8, k=3, kcap=2), "kcap=2 < K=3"),
    (dict(t=True, h=64), "T=True is not an int"),
])
def test_size_refusals_name_the_argument_the_value_and_the_rule(kwargs, message):
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        moe.check_sizes("moe test", **kwargs)


# ------------------------------------------------------------------ boundary designs (mutation survivors)


def test_post_attn_amax_design_puts_each_tokens_maximum_in_one_warp():
    c = od.post_attn_designed(8, 256, seed=256, zero_token=False, amax_warps=True)
    warp = (np.arange(256) % 256) // 32
    for t in range(8):
        m = np.abs(c.mid[t].astype(np.float64))
        assert set(warp[m == m.max()].tolist()) == {t}, f"token {t}: its maximum must lie in warp {t} alone"
        assert np.max(m[warp != t]) < m.max() / 2, "the other warps' maximum must be far below (fs moves visibly)"
        assert np.mean(m * m) == 1.0
        assert m[0] < m.max(), f"token {t}: element 0 (where a read one slot past the warp maxima lands) is a maximum"
    assert od.warps_owning(192) == 6 and od.warps_owning(2816) == 8


@pytest.mark.parametrize("e, k", [(256, 8), (13, 3)])
def test_router_edges_design_reaches_the_selections_edges(e, k):
    c = od.router_edges_designed(64, e, k, seed=e)
    edges, negative, dominant = c.ids
    if e == 256:
        assert {224, 255} <= set(edges.tolist()), "the eighth logit of a lane (ids 224..255) must win"
        # A selection that never reads a lane's eighth logit (j < 7) picks another set.
        assert not np.array_equal(od.topk_ties_low(c.logits[:1, :224], k)[0], edges)
    assert c.logits[0, edges[0]] == c.logits[0, edges[1]] and edges[0] < edges[1], "the top two tie"
    assert np.all(c.logits[1] < 0) and negative[0] == 0, "negative token: every logit < 0, expert 0 on top"
    # The padding value 0.0 at e == E would win over every logit of the negative token.
    padded = np.concatenate([c.logits[1:2], np.zeros((1, 1), np.float32)], axis=1)
    assert od.topk_ties_low(padded, k)[0, 0] == e
    top = np.sort(c.logits[2])[::-1]
    with np.errstate(over="ignore"):
        assert np.isinf(np.exp(np.float32(top[0] - top[1]))), "exp(l_0 - l_1) must overflow f32"
    assert c.wts[2, 0] == 1.0 and np.all(c.wts[2, 1:] < od.TINY_WEIGHT)
    assert np.all(c.wts[:2] > 2.0**-10), "the edges and negative tokens' weights are ordinary normals"
    assert not np.any(np.signbit(c.logits) & (c.logits == 0)), "a -0 logit: the device's one-hot dot gives +0"


def _e2m1_with_flipped(x, flip: int) -> np.ndarray:
    """moe_e2m1's thresholds with the inclusiveness of threshold `flip` (0..6) flipped."""
    a = np.abs(np.asarray(x, np.float32))
    bounds = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    inclusive = [True, False, True, False, True, False, True]
    inclusive[flip] = not inclusive[flip]
    conds = [(a <= b) if inc else (a < b) for b, inc in zip(bounds, inclusive)]
    return (np.select(conds, range(7), 7) | np.where(np.signbit(x), 8, 0)).astype(np.uint8)


@pytest.mark.parametrize("name", SHAPES)
def test_glu_design_has_a_tie_block_that_every_flipped_threshold_sees(name):
    t, _, _, i, k = SHAPES[name]
    c = od.glu_designed(t * k, i, seed=i)
    g, u = c.gu[:, :i].astype(np.float32), c.gu[:, i:].astype(np.float32)
    codes = np.stack([c.hq & 0xF, c.hq >> 4], -1).reshape(t * k, i)
    a = od.glu_saturated(g, u)
    for s in range(t * k):
        ties = np.flatnonzero(np.all((g[s].reshape(-1, 16) == od.TIE_G), axis=1))
        assert ties.size == 1 and c.hs[s, ties[0]] == 0x38, "one tie block a slot, block scale exactly 1"
        blk = slice(ties[0] * 16, ties[0] * 16 + 16)
        ratio = a[s, blk] / np.float32(c.act_h)
        assert sorted(np.abs(ratio).tolist()) == sorted(np.abs(od.E2M1_TIES).tolist())
        for flip in range(7):
            assert not np.array_equal(_e2m1_with_flipped(ratio, flip), codes[s, blk]), f"threshold {flip} unseen"


def _gelu_variant(g, inner_scale=1.0, cubic=0.044715, inner=None):
    g = np.asarray(g, np.float64)
    arg = inner(g) if inner is not None else inner_scale * 0.7978845608028654 * (g + cubic * g ** 3)
    return 0.5 * g * (1.0 + np.tanh(arg))


@pytest.mark.parametrize("name", SHAPES)
def test_glu_moderate_design_is_off_saturation_and_sees_every_gelu_constant(name):
    t, _, _, i, k = SHAPES[name]
    c = od.glu_moderate_designed(t * k, i, seed=i + 2)
    g, u = c.gu[:, :i].astype(np.float64), c.gu[:, i:].astype(np.float64)
    assert np.all((np.abs(g) >= 0.25) & (g >= -1.5) & (g <= 4.0))
    hq, hs = od.nvfp4_quantize64(od.gelu_tanh64(g) * u, c.act_h, 0.0)
    assert np.array_equal(hq, c.hq) and np.array_equal(hs, c.hs)
    variants = {
        "inner doubled": dict(inner_scale=2.0), "inner negated": dict(inner_scale=-1.0),
        "cubic dropped": dict(cubic=0.0), "cubic doubled": dict(cubic=2 * 0.044715),
        "cubic negated": dict(cubic=-0.044715),
        "inner 0.798 * 1.0447 g (0.044715 / g)": dict(inner=lambda x: 0.7978845608028654 * 1.044715 * x),
    }
    for what, kw in variants.items():
        vq, vs = od.nvfp4_quantize64(_gelu_variant(g, **kw) * u, c.act_h, 0.0)
        assert not (np.array_equal(vq, c.hq) and np.array_equal(vs, c.hs)), f"the design cannot see: {what}"


def test_glu_moderate_design_refuses_values_near_a_rounding_boundary():
    with pytest.raises(od.DesignError, match="round differently"):
        od.nvfp4_quantize64(np.array([[0.25 * 6] + [0.625 * 1.0000001] + [0.0] * 14]), 0.25, od.GLU_MARGIN)


def test_down_sweep_design_sees_thread_roles_shifted_by_one():
    h, i, e, k = 64, 1088, 3, 2
    c = od.down_sweep_designed(h, i, e, k, seed=1088)
    assert (i // 16) % 64 and i // 16 > 64, "a full sweep and a tail"
    for kk in range(k):
        ex = int(c.ids[0, kk])
        w, s, gs = c.weights.wdn[ex], c.weights.sdn[ex], c.weights.gs_dn[ex]
        x = od.nvfp4_dequantize(c.hq[0, kk], c.hs[0, kk], c.act_h)
        ok = od.nvfp4_rows_in_kernel_order(w, s, gs, x)
        ref = od.dequant_weights64(w, s, gs) @ x.astype(np.float64)
        assert np.max(np.abs(ok.astype(np.float64) - ref)) <= 2.0**-7 * np.max(np.abs(ref)), "emulation off float64"
        shifted = od.nvfp4_rows_in_kernel_order(w, s, gs, x, lane_shift=1)
        assert np.count_nonzero(bits_of(shifted) != bits_of(ok)) > h // 2, "a shift by one must move most rows"


def _xor_butterfly(v):
    for m in (16, 8, 4, 2, 1):
        v = (v + v[:, np.arange(32) ^ m]).astype(np.float32)
    return v


def test_the_shift_down_tree_gives_lane_0_the_xor_butterflys_bits_and_no_other_lane_the_sum():
    # nvfp4_warp_sum (and fp8_gemv's, lm_head's) is a shift-down tree, not an xor butterfly:
    # lane 0 must hold the butterfly's bits (the bitwise links and every certified value rest on
    # them), and the other lanes must not hold the sum, so a wrong writer stores a wrong value.
    rng = np.random.default_rng(3)
    vals = (rng.normal(size=(20000, 32)) * np.exp2(rng.integers(-20, 20, (20000, 32)))).astype(np.float32)
    xor, down = _xor_butterfly(vals), od.warp_tree_sum(vals)
    assert np.array_equal(bits_of(down[:, 0]), bits_of(xor[:, 0])), "lane 0: the butterfly's bits"
    assert np.all(bits_of(xor) == bits_of(xor[:, :1])), "the butterfly leaves the sum in every lane"
    same_scale = od.warp_tree_sum(rng.normal(size=(20000, 32)).astype(np.float32))
    for lane in (1, 16, 31):
        assert np.mean(bits_of(same_scale[:, lane]) != bits_of(same_scale[:, 0])) > 0.99, \
            f"lane {lane} holds a partial sum"


def test_a_rotation_of_a_warps_inputs_keeps_lane_0s_bits_but_not_the_rotated_writers():
    # Why roles shifted by one go unseen at the chain's I = 704 (K16 = 44) under an xor
    # butterfly: lanes 44..63 hold nothing, and the butterfly (masks 16, 8, 4, 2, 1) is
    # invariant under a cyclic rotation of its 32 inputs. Lane 0 of the shift-down tree computes
    # the same function, so it is invariant too; what the tree changes is the writer: roles
    # shifted by one make physical lane 1 the writer, and lane 1 holds a partial sum.
    rng = np.random.default_rng(3)
    vals = rng.normal(size=(2000, 32)).astype(np.float32)
    out = _xor_butterfly(vals)
    for r in (1, 5, 31):
        rolled = np.roll(vals, r, axis=1)
        assert np.array_equal(bits_of(_xor_butterfly(rolled)[:, 0]), bits_of(out[:, 0]))
        assert np.array_equal(bits_of(od.warp_tree_sum(rolled)[:, 0]), bits_of(out[:, 0]))
    shifted_writer = od.warp_tree_sum(np.roll(vals, 1, axis=1))[:, 1]
    assert np.mean(bits_of(shifted_writer) != bits_of(out[:, 0])) > 0.99


def _topk_like_the_kernel(row, e, k, *, incl=False, init=-np.inf, slots=8, mod=32, div=32, masks=(16, 8, 4, 2, 1)):
    """moe_topk_softmax's selection, lane by lane (8 logits a lane, lane-local then butterfly
    argmax, the taken bits), with one of its expressions changed through the keywords."""
    def better(v, x, bv, bx):
        return v > bv or (v == bv and x < bx)

    vals = [[float(row[lane + 32 * j]) if lane + 32 * j < e else 0.0 for j in range(8)] for lane in range(32)]
    taken = [0] * 32
    out = []
    for _ in range(k):
        bv, be = [init] * 32, [0xFFFFFFFF] * 32
        for lane in range(32):
            for j in range(slots):
                x = lane + 32 * j
                if (x <= e if incl else x < e) and not (taken[lane] >> j) & 1 and better(vals[lane][j], x, bv[lane], be[lane]):
                    bv[lane], be[lane] = vals[lane][j], x
        for m in masks:
            nv, ne = list(bv), list(be)
            for lane in range(32):
                o = lane ^ m
                if better(bv[o], be[o], bv[lane], be[lane]):
                    nv[lane], ne[lane] = bv[o], be[o]
            bv, be = nv, ne
        for lane in range(32):
            if be[lane] < e and be[lane] % mod == lane:
                taken[lane] |= 1 << (be[lane] // div)
        out.append(be[0] if be[0] != 0xFFFFFFFF else -1)
    return out


@pytest.mark.parametrize("e, k", [(256, 8), (13, 3)])
def test_router_edges_design_sees_each_changed_selection_expression(e, k):
    c = od.router_edges_designed(64, e, k, seed=e)
    base = [_topk_like_the_kernel(row, e, k) for row in c.logits]
    assert np.array_equal(np.array(base), c.ids), "the emulated selection must equal topk_ties_low"
    variants = {"an initial best of 0": dict(init=0.0), "even lanes only (masks 16, 8, 4, 2)": dict(masks=(16, 8, 4, 2))}
    if e == 256:  # at E 13 every expert sits in lanes 0..12, slot 0: these cannot differ there
        variants.update({"seven logits a lane": dict(slots=7), "taken lane be % 33": dict(mod=33),
                         "taken slot be / 33": dict(div=33), "half-warp argmax (masks 15, 7, 3, 1)": dict(masks=(15, 7, 3, 1))})
    else:
        variants["the padding e == E admitted"] = dict(incl=True)
    for what, kw in variants.items():
        got = [_topk_like_the_kernel(row, e, k, **kw) for row in c.logits]
        assert not np.array_equal(np.array(got), c.ids), f"the edges design cannot see: {what}"


@pytest.mark.parametrize("name", SHAPES)
def test_glu_moderate_design_holds_for_an_f32_evaluation_like_the_kernels(name):
    # moe_glu_value's f32 operations in order (numpy's float32 tanh for tanhf), then the f32
    # quantizer: the same bits as the float64 expectation, as GLU_MARGIN promises for any
    # evaluation within 2^-18.
    t, _, _, i, k = SHAPES[name]
    c = od.glu_moderate_designed(t * k, i, seed=i + 2)
    g, u = c.gu[:, :i].astype(np.float32), c.gu[:, i:].astype(np.float32)
    f = np.float32
    inner = f(0.7978845608028654) * ((f(0.044715) * g) * (g * g) + g).astype(np.float32)
    a = (((f(0.5) * g) * (f(1) + np.tanh(inner.astype(np.float32)))) * u).astype(np.float32)
    hq, hs = od.nvfp4_quantize(a, c.act_h)
    assert np.array_equal(hs, c.hs) and np.array_equal(hq, c.hq)


@pytest.mark.parametrize("e, k, h", [(13, 3, 64), (128, 8, 2816)])
def test_router_zero_tokens_design_sees_an_accumulator_that_does_not_start_at_zero(e, k, h):
    c = od.router_zero_tokens_designed(h, e, k, seed=e)
    zero = np.asarray(c.zero)
    assert zero.any() and not zero.all() and zero[0], "token 0 (the first accumulator) must be a zero token"
    assert np.all(bits_of(c.logits[zero]) == 0), "a zero token's logits are +0 exactly"
    assert np.all(c.ids[zero] == np.arange(k)), "E tied logits select ids 0..K-1"
    assert np.all(c.wts[zero] == np.float32(1.0) / np.float32(k))
    assert np.all(bits_of(to_bf16(c.rr.astype(np.float32)[zero])) == 0)
    # The one-hot tokens hold zero logits (ties) and negative ones, and pick other ids.
    one_hot = c.logits[~zero]
    assert np.any(one_hot == 0) and np.any(one_hot < 0) and np.any(c.ids[~zero] != np.arange(k))
    # Emulate the router with each lane's accumulator starting at a stale denormal (what an
    # uninitialised register held in the code NVRTC makes for sm_90: the low word of the row
    # offset e * H): the zero tokens' logits turn nonzero and the selection moves, while every
    # nonzero logit absorbs it.
    pes = c.pes.astype(np.float32)
    stale = (np.arange(e, dtype=np.int64) * h).astype(np.int32).view(np.float32)  # e * H as f32 bits
    lanes = min(32, h // 8)
    dots = (c.rr.astype(np.float64) @ c.wr.astype(np.float64).T).astype(np.float32)
    drift = (dots + np.float32(lanes) * stale[None, :]).astype(np.float32)
    perturbed = (pes[None, :] * drift).astype(np.float32)
    assert np.all(bits_of(perturbed[~zero][one_hot != 0]) == bits_of(one_hot[one_hot != 0])), "nonzero logits absorb it"
    assert np.any(bits_of(perturbed[zero]) != 0)
    assert np.any(od.topk_ties_low(perturbed[zero], k) != c.ids[zero])


@pytest.mark.parametrize("name", SHAPES)
def test_post_attn_design_with_o_four_times_its_unit_mean_square_keeps_mid_and_shows_an_unnormalised_o(name):
    # The mutant `o * inv_o` -> `o / inv_o`: with mean(o^2) = 1 the factor is 1 to
    # bf16 and nothing can see it. At o_scale 2 the norm halves o and mid is the unit design's;
    # a kernel that divides by the factor (4x) or skips it (2x) moves every live token's mid.
    t, h, _, _, _ = SHAPES[name]
    unit = od.post_attn_designed(t, h, seed=h)
    big = od.post_attn_designed(t, h, seed=h, o_scale=2.0)
    live = slice(0, t - 1)
    o = big.o[live].astype(np.float64)
    assert np.all(np.mean(o * o, axis=-1) == 4.0), "o's mean square must be exactly 4"
    assert np.array_equal(bits_of(big.mid), bits_of(unit.mid)), "the norm must undo o_scale"
    x, w = big.x[live].astype(np.float64), big.w_pa.astype(np.float64)
    for wrong in (4.0, 2.0):  # o / inv_o is o * 2 * 2 here; no norm at all, o * 2
        moved = od._bf16_of(x + o / 2.0 * wrong * w)
        assert np.count_nonzero(bits_of(moved) != bits_of(big.mid[live])) > h // 2, wrong
    with pytest.raises(od.DesignError, match="not a power of two"):
        od.post_attn_designed(t, h, seed=h, o_scale=3.0)


# ------------------------------------------------------------------ order-sensitive designs (invariance gates)

from fractions import Fraction  # noqa: E402

from gates import test_moe_invariance as inv  # noqa: E402

CHECKED = [r for r in inv.ROWS if r < od.ORDER_LIVE]  # the live tokens the invariance gate checks


def _f32_round(v: Fraction) -> np.float32:
    """The f32 nearest an exact value, ties to even."""
    f = np.float32(float(v))
    near = [f, np.nextafter(f, np.float32(np.inf)), np.nextafter(f, np.float32(-np.inf))]
    return min(near, key=lambda c: (abs(Fraction(float(c)) - v), int(np.array(c).view(np.uint32)) & 1))


def test_fma32_rounds_the_exact_product_and_sum_once():
    rng = np.random.default_rng(0)
    a = (rng.normal(size=400) * np.exp2(rng.integers(-20, 20, 400))).astype(np.float32)
    b = (rng.normal(size=400) * np.exp2(rng.integers(-20, 20, 400))).astype(np.float32)
    c = (rng.normal(size=400) * np.exp2(rng.integers(-40, 40, 400))).astype(np.float32)
    c[::2] = (-(a[::2].astype(np.float64) * b[::2])).astype(np.float32)  # near-cancellation
    got = od.fma32(a, b, c)
    want = [_f32_round(Fraction(float(x)) * Fraction(float(y)) + Fraction(float(z))) for x, y, z in zip(a, b, c)]
    assert np.array_equal(bits_of(got), bits_of(np.array(want, np.float32)))
    # On an f32 midpoint the float64 sum lost the part that decides: (1 + 2^-12)^2 = 1 + 2^-11 + 2^-24.
    one = np.float32(1 + 2**-12)
    assert od.fma32(one, one, np.float32(2.0**-80)) == np.nextafter(np.float32(1 + 2**-11), np.float32(2))
    assert od.fma32(one, one, np.float32(-2.0**-80)) == np.float32(1 + 2**-11)


def test_the_same_squares_summed_in_another_order_give_another_quantised_output():
    # The property the invariance gate rests on, on one ladder: the kernel's order and 128 threads
    # a block sum the same squares to different f32 values, the factors differ, and the bf16
    # outputs that cancel the normalised term differ.
    case = inv.order_pool("seed-H2816-I704-E16-K8").post
    sums = {o: od.block_sum_of_squares(case.o[:1], o) for o in ("kernel", "threads 128")}
    assert sums["kernel"] != sums["threads 128"], f"both orders sum to {sums['kernel']}"
    inv_o = {o: od.rms_factor32(s, case.o.shape[-1], case.eps) for o, s in sums.items()}
    assert inv_o["kernel"] != inv_o["threads 128"]
    sub = od.PostAttnOrderCase(case.x[:1], case.o[:1], case.w_pa, case.w_router, case.act_g, case.eps)
    mids = {o: sub.mid(v) for o, v in inv_o.items()}
    assert np.count_nonzero(bits_of(mids["kernel"]) != bits_of(mids["threads 128"])) > 0


def test_the_kernel_order_of_a_block_sum_is_the_threads_then_the_warp_trees_then_the_warps():
    # An independent spelling of moe_block_sum over fmaf(v, v, ss) at H 2816 (11 passes).
    rng = np.random.default_rng(1)
    v = to_bf16(rng.normal(0, 1, (3, 2816)) * np.exp2(rng.integers(-6, 6, (3, 2816))))
    x = v.astype(np.float32)
    want = np.zeros(3, np.float32)
    for t in range(3):
        threads = np.zeros(256, np.float32)
        for i in range(2816):
            threads[i % 256] = np.float32(threads[i % 256] + np.float32(x[t, i] * x[t, i]))
        warps = [od.warp_tree_sum(threads[32 * w:32 * w + 32][None, :])[0, 0] for w in range(8)]
        s = np.float32(0)
        for r in warps:
            s = np.float32(s + r)
        want[t] = s
    assert np.array_equal(bits_of(od.block_sum_of_squares(v)), bits_of(want))


@pytest.mark.parametrize("h", [64, 192, 256, 512, 704, 2816])
def test_an_order_that_does_not_regroup_at_a_size_gives_the_kernels_bits(h):
    # norm_orders_at leaves out exactly the orders that add the same numbers the same way at H;
    # the designs are held to every order it names.
    rng = np.random.default_rng(h)
    v = to_bf16(rng.normal(0, 1, (16, h)) * np.exp2(rng.uniform(-12, 6, (16, h))))
    base = bits_of(od.block_sum_of_squares(v))
    for order in set(od.NORM_ORDERS) - set(od.norm_orders_at(h)):
        assert np.array_equal(bits_of(od.block_sum_of_squares(v, order)), base), order
    assert any(not np.array_equal(bits_of(od.block_sum_of_squares(v, o)), base) for o in od.norm_orders_at(h))


@pytest.mark.parametrize("shape_id", list(inv.SHAPES))
def test_every_norm_order_moves_the_checked_tokens_outputs(shape_id):
    # Under every order that regroups at H, each checked live token of post_attn moves mid (o's
    # norm) and fs (mid's norm), and of final moves out (both norms), in the host model.
    pool = inv.order_pool(shape_id)
    h = inv.SHAPES[shape_id].h
    for order in od.norm_orders_at(h):
        for which in ("o", "mid"):
            moved = pool.post.moved_by(which, order)[CHECKED]
            assert (moved > 0).all(), f"post_attn {which} norm in {order}: moved {moved.tolist()}"
        for which in ("dense", "moe"):
            moved = pool.final.moved_by(which, order)[CHECKED]
            assert (moved > 0).all(), f"final {which} norm in {order}: moved {moved.tolist()}"


@pytest.mark.parametrize("shape_id", list(inv.SHAPES))
def test_the_ladders_sums_move_by_an_ulp_or_more_and_mid_s_maximum_is_64(shape_id):
    pool = inv.order_pool(shape_id)
    h = inv.SHAPES[shape_id].h
    post, final = pool.post, pool.final
    mid = post.mid(post.inv("o"))
    for label, v in (("o", post.o), ("mid", mid), ("dense", final.dense), ("slot sum", final.slot_sum())):
        base = od.block_sum_of_squares(v[CHECKED]).view(np.int32).astype(np.int64)
        for order in od.norm_orders_at(h):
            ulps = od.block_sum_of_squares(v[CHECKED], order).view(np.int32).astype(np.int64) - base
            assert (np.abs(ulps) >= 1).all(), f"{label} summed in {order}: {ulps.tolist()} ulps"
    assert (np.max(np.abs(mid[:od.ORDER_LIVE].astype(np.float32)), axis=1) == od.OUTLIER).all()
    r = od.warp_sums_of_squares(post.o[CHECKED]).astype(np.float64) / od.OUTLIER_ULP
    target = od.ladder_residues(h)
    assert np.allclose((r - np.floor(r))[:, 1:target.size], target[1:], atol=0.02)


@pytest.mark.parametrize("shape_id", list(inv.SHAPES))
def test_every_router_order_moves_the_checked_tokens_logits(shape_id):
    pool = inv.order_pool(shape_id)
    for order in od.router_orders_at(inv.SHAPES[shape_id].h):
        moved = pool.router.moved_by(order)[CHECKED]
        assert (moved > 0).all(), f"router dot in {order}: moved {moved.tolist()}"


@pytest.mark.parametrize("shape_id", list(inv.SHAPES))
def test_every_gemv_order_moves_the_checked_tokens_expert_rows(shape_id):
    ex = inv.order_pool(shape_id).experts
    for stage in ("glu", "down"):
        assert ex.orders(stage), f"{stage}: no order regroups at this shape"
        for token in CHECKED:
            for order in ex.orders(stage):
                moved = ex.moved_by(stage, token, order, rows=slice(0, od.MOVED_ROWS))
                assert moved > 0, f"{stage} rows of token {token} in {order}: none moved"


def test_a_cancelling_pair_makes_the_row_its_roundings():
    # One row: the pair's two groups carry +-B of about 2^10, the rest about 2^-11; the kernel's
    # bf16 output is far below B and the orders that regroup give other bits.
    pair = od.paired_nvfp4_designed(1, 2816, 1, 4, od.ACT_G, seed=3)
    x = od.nvfp4_dequantize(pair.q[0], pair.s[0], od.ACT_G)
    rows = od.nvfp4_rows(pair.w[0], pair.sw[0], 1.0, x).astype(np.float32)
    assert (np.abs(rows) < 2.0**-2).all() and (rows != 0).all(), rows
    for order in od.gemv_orders_at(2816):
        assert not np.array_equal(bits_of(od.nvfp4_rows(pair.w[0], pair.sw[0], 1.0, x, order)), bits_of(to_bf16(rows)))


@pytest.mark.parametrize("shape_id", list(inv.SHAPES))
def test_the_pool_has_its_twin_its_zero_token_and_shared_experts(shape_id):
    pool = inv.order_pool(shape_id)
    s = inv.SHAPES[shape_id]
    twin, zero = od.ORDER_TWIN, od.ORDER_ZERO
    for name, a in (("x", pool.post.x), ("o", pool.post.o), ("rr", pool.router.rr), ("gq", pool.experts.gq),
                    ("hq", pool.experts.hq), ("dense", pool.final.dense), ("opair", pool.final.opair),
                    ("mid", pool.final.mid)):
        assert np.array_equal(bits_of(a[twin]), bits_of(a[0])), f"{name}: the twin is not token 0"
        assert not np.any(bits_of(a[zero])), f"{name}: the zero token is not zero"
    ids = pool.experts.ids
    assert np.array_equal(ids[twin], ids[0]) and np.array_equal(ids[zero], np.arange(s.k))
    assert set(ids[3].tolist()) & set(ids[0].tolist())
    assert all(len(set(row.tolist())) == s.k for row in ids) and ids.max() < s.e
    # every checked token's outputs are not the zero token's: a vacuous row would compare nothing
    assert all(np.count_nonzero(bits_of(pool.post.o[t])) > s.h // 2 for t in CHECKED)


# ------------------------------------------------------------------ the big-index gate's layout and the sparse designs

from gates import test_moe_big_index as big  # noqa: E402


def test_the_far_expert_lies_past_2_32_bytes_and_its_wrapped_offset_on_a_decoy_of_its_own():
    lay = big.far_end_layout()
    assert big.layout_problems(lay) == []
    assert lay.glu_codes >= 1 << 32 and lay.down_codes >= 1 << 31
    assert lay.decoy == lay.glu_codes - (1 << 32)
    # an expert nearer the start would not wrap: the gate's own check refuses such a layout
    assert any("not in [2^32" in p for p in big.layout_problems(big.far_end_layout(far=100)))


@pytest.mark.parametrize("t, k, e, h, i", [(1, 1, 1, 64, 64), (3, 3, 13, 192, 128), (2, 8, 40, 1024, 1088)])
def test_the_sparse_designs_are_the_kernel_order_rows_of_their_whole_tables(t, k, e, h, i):
    # The sparse designs' expected rows are the kernel-order emulation of the tables they write
    # (exact dyadic dots: any order), and gate rows are 0 or past the tanh saturation bound.
    ids = od.router_designed(t, h, e, k, seed=e).ids
    glu, down = od.glu_sparse_designed(ids, h, i, seed=1), od.down_sparse_designed(ids, h, i, seed=1)
    for tok in range(t):
        x = od.nvfp4_dequantize(glu.gq[tok], glu.gsc[tok], glu.act_g)
        for kk in range(k):
            ex = int(ids[tok, kk])
            w, s = glu.weights.dense(ex)
            assert np.array_equal(bits_of(od.nvfp4_rows(w, s, 1.0, x)), bits_of(glu.gu[tok, kk]))
            w, s = down.weights.dense(ex)
            xd = od.nvfp4_dequantize(down.hq[tok, kk], down.hs[tok, kk], down.act_h)
            assert np.array_equal(bits_of(od.nvfp4_rows(w, s, 1.0, xd)), bits_of(down.opair[tok, kk]))
    g = glu.gu[..., :i].astype(np.float32)
    assert np.all((g == 0) | (np.abs(g) >= od.GELU_SATURATED)) and np.count_nonzero(g) > g.size // 2
