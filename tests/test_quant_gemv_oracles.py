"""oracles.quant_gemv: the anchors' designed inputs keep their exactness promises (no GPU)."""

from __future__ import annotations

import numpy as np
import pytest

from harness.library.dtypes import bits_of, decode_e4m3, unpack_fp4
from oracles.quant_gemv import (
    capped,
    e4m3_bits,
    exact_bf16,
    fp8_gemv_case,
    lm_head_case,
    nvfp4_designed,
    nvfp4_expected,
    nvfp4_random,
)


def test_e4m3_bits_are_the_standard_encodings_and_refuse_rounding():
    assert e4m3_bits([1.0, 2.0, 0.5]).tolist() == [0x38, 0x40, 0x30]
    with pytest.raises(ValueError, match="not exact in e4m3"):
        e4m3_bits([1.1])


def test_exact_bf16_refuses_a_value_bf16_cannot_hold():
    assert bits_of(exact_bf16([256.0, 0.5])).tolist() == [0x4380, 0x3F00]
    with pytest.raises(ValueError, match="not exact in bf16"):
        exact_bf16([257.0])


def test_fp8_case_expects_k_times_the_row_constant_times_the_scales():
    case = fp8_gemv_case(t=2, k=256, segment_rows=(3, 2), segment_scales=(1.0, 0.25), token_scales=(1.0, 4.0))
    assert [w.shape for w, _ in case.segments] == [(3, 256), (2, 256)]
    assert case.x.shape == (2, 256) and set(case.x.ravel().tolist()) == {0x38}
    np.testing.assert_array_equal(case.expected.astype(np.float64),
                                  [[256, 512, 128, 64, 128], [1024, 2048, 512, 256, 512]])


def test_lm_head_case_doubles_row_777_only():
    case = lm_head_case()
    e = decode_e4m3(case.E)
    assert (e[777] == 2).all() and (np.delete(e, 777, axis=0) == 1).all()
    assert (case.h.astype(np.float32) == 1).all() and (case.rs == 1).all()


def test_capped_value_is_softcap_tanh_of_the_quotient():
    assert capped(128.0, 30.0) == np.float32(30 * np.tanh(np.float32(128) / np.float32(30)))
    assert capped(128.0, 30.0) < 30.0 < 128.0


def test_nvfp4_designed_packs_low_nibble_first_and_uses_exact_scales():
    case = nvfp4_designed(n=5, k=64, seed=1)
    w = unpack_fp4(case.w, 64)
    assert w[0, 0] == unpack_fp4(case.w[0, :1] & 0x0F, 1)[0]  # element 0 is the low nibble of byte 0
    assert w[0, 1] == unpack_fp4(case.w[0, :1] >> 4, 1)[0]
    assert set(decode_e4m3(case.s).ravel().tolist()) <= {0.5, 1.0, 2.0, 4.0}
    x = case.x.astype(np.float64)
    assert (np.mod(x * 4, 1) == 0).all() and np.abs(x).max() <= 4


def test_nvfp4_expected_matches_a_hand_worked_row():
    case = nvfp4_designed(n=1, k=16, seed=3)
    w = unpack_fp4(case.w, 16)[0].astype(np.float64)
    by_hand = case.gs * decode_e4m3(case.s)[0, 0] * sum(float(a) * b for a, b in zip(case.x.astype(np.float64), w))
    assert float(nvfp4_expected(case)[0]) == float(np.float32(by_hand).astype(case.x.dtype))


def test_nvfp4_expected_refuses_inputs_it_cannot_make_exact():
    with pytest.raises(ValueError, match="exact only on nvfp4_designed inputs"):
        nvfp4_expected(nvfp4_random(n=4, k=64, seed=0))


def test_nvfp4_designed_refuses_a_k_that_breaks_f32_exactness():
    with pytest.raises(ValueError, match="past 2\\^24: shrink K"):
        nvfp4_designed(n=1, k=16 * 1024 * 8, seed=0)


# ------------------------------------------------------------------ position-dependent designs

from harness.library.dtypes import bf16, from_bits, to_bf16  # noqa: E402
from oracles.quant_gemv import (  # noqa: E402
    LM_POS_H,
    LM_POS_RUNNER_UP,
    LM_POS_SOFTCAP,
    LM_POS_V,
    LM_POS_WINNERS,
    fp8_chunk_sums,
    fp8_gemv_positional_case,
    rne_bf16_of_exact_f32,
    lm_head_argmax,
    lm_head_positional_case,
)


def _fp8_gate_case():
    from gates.test_fp8_gemv import POS_K, POS_SEED, POS_SEGMENTS, POS_T, POS_TOKEN_SCALES

    return fp8_gemv_positional_case(POS_T, POS_K, POS_SEGMENTS, POS_SEED, POS_TOKEN_SCALES)


def test_fp8_positional_case_is_exact_and_matches_the_contract_formula():
    case = _fp8_gate_case()
    x = decode_e4m3(case.x).astype(np.float64)
    w = np.concatenate([decode_e4m3(s) for s, _ in case.segments]).astype(np.float64)
    ws = np.concatenate([s for _, s in case.segments]).astype(np.float64)
    value = (x @ w.T) * ws[None, :] * case.xs[:, None]
    assert np.all(np.mod(x[:, None, :] * w[None, :, :] * 64, 1) == 0), "products are multiples of 1/64"
    assert np.array_equal(value.astype(np.float32).astype(np.float64), value), "the f32 value is exact"
    np.testing.assert_array_equal(bits_of(case.expected), bits_of(to_bf16(value)))
    assert case.expected.shape == (3, 25) and 25 % 8 and (592 // 16) % 32


def test_fp8_positional_case_sets_the_lowest_mantissa_bit_of_both_bytes_of_a_pair_everywhere():
    # A kernel that masks the low byte of a pair with 0xfffe (or the high one) drops a code's
    # lowest bit: it must change some product of every token and row, in both pair halves.
    case = _fp8_gate_case()
    for name, codes in [("x", case.x)] + [(f"w{i}", s) for i, (s, _) in enumerate(case.segments)]:
        odd = (codes & 1) == 1
        assert odd[:, 0::2].any(axis=1).all() and odd[:, 1::2].any(axis=1).all(), name


def test_fp8_positional_case_exercises_the_output_rounding_and_its_ties():
    case = _fp8_gate_case()
    x = decode_e4m3(case.x).astype(np.float64)
    w = np.concatenate([decode_e4m3(s) for s, _ in case.segments]).astype(np.float64)
    ws = np.concatenate([s for _, s in case.segments]).astype(np.float64)
    f32 = ((x @ w.T) * ws[None, :] * case.xs[:, None]).astype(np.float32).view(np.uint32)
    toward_zero = from_bits((f32 >> 16).astype(np.uint16), bf16)
    low = f32 & 0xFFFF
    assert np.count_nonzero(low) >= 40, "most outputs must round"
    assert np.count_nonzero(bits_of(toward_zero) != bits_of(case.expected)) >= 10, "round-toward-zero must show"
    assert np.count_nonzero(low == 0x8000) >= 5, "ties to even must occur"


def test_rne_bf16_of_exact_f32_refuses_a_value_f32_would_round():
    assert bits_of(rne_bf16_of_exact_f32([257.0])).tolist() == [0x4380]  # 257 -> 256 (tie to even)
    with pytest.raises(ValueError, match="not exact in f32"):
        rne_bf16_of_exact_f32([1.0 + 2.0**-30])


def test_fp8_positional_case_makes_every_index_visible():
    case = _fp8_gate_case()
    x = decode_e4m3(case.x).astype(np.float64)
    w = np.concatenate([decode_e4m3(s) for s, _ in case.segments]).astype(np.float64)
    assert len({r.tobytes() for r in x}) == 3, "tokens must differ"
    assert len({r.tobytes() for r in w}) == w.shape[0], "rows must differ, across segments too"
    chunks = fp8_chunk_sums(case)
    assert (chunks != 0).any(axis=(0, 1)).all(), "every chunk contributes somewhere"
    # A lane that reads chunk a twice and drops chunk b shows wherever their sums differ.
    c = chunks.shape[-1]
    for a in range(c):
        for b in range(c):
            if a != b:
                assert np.any(chunks[..., a] != chunks[..., b])
    ws = np.concatenate([s for _, s in case.segments])
    assert len(set(ws.tolist())) > 2 and len(set(case.xs.tolist())) == 3


def test_lm_head_positional_case_puts_each_winner_where_designed():
    pc = lm_head_positional_case()
    assert pc.case.E.shape == (LM_POS_V, LM_POS_H) and pc.case.softcap == 0.0
    idx, val = lm_head_argmax(pc.logits)
    assert idx.tolist() == [min(r) for r in LM_POS_WINNERS]
    assert idx[0] == LM_POS_V - 1 and len(set(idx.tolist())) == len(idx), "a different winner for every token"
    assert np.all(val.astype(np.float32) == val), "winning logits are exact in f32"
    idx_x, val_x = lm_head_argmax(pc.logits, excluded=LM_POS_V - 1)
    assert idx_x[0] == LM_POS_RUNNER_UP and val_x[0] == val[0] - 0.5
    blocks = -(-LM_POS_V // 64)
    assert blocks > 256 and LM_POS_V % 64, "more partials than a reduce block, a partial last block"
    # The winners' partials sit in the upper half-warp, in reduce warps other than 0, and in the
    # second pass of the reduce loop.
    partial_threads = [(r // 64) % 256 for rows in LM_POS_WINNERS for r in rows]
    assert any(t % 32 >= 16 for t in partial_threads) and any(t // 32 > 0 for t in partial_threads)
    # and one token's only winner sits in a lane 0 other than warp 0's: after the shift-down tree
    # only that lane holds the warp's best, so a wrong writer loses the winner
    assert any(len(rows) == 1 and (rows[0] // 64) % 256 in range(32, 256, 32) for rows in LM_POS_WINNERS)
    assert any(r // 64 >= 256 for rows in LM_POS_WINNERS for r in rows)


def test_lm_head_positional_logits_keep_their_order_under_the_cap():
    pc = lm_head_positional_case()
    assert np.abs(pc.logits).max() <= 2 * 4 * LM_POS_H
    top = np.sort(np.unique(pc.logits), axis=None)
    assert np.min(np.diff(top)) >= 0.125
    capped_top = np.asarray([capped(v, LM_POS_SOFTCAP) for v in top[-50:]], dtype=np.float64)
    assert np.all(np.diff(capped_top) > 0.04)


# ------------------------------------------------------------------ lm_head edges

from harness.library.dtypes import decode_e4m3  # noqa: E402
from oracles.quant_gemv import (  # noqa: E402
    LM_EDGE_H,
    LM_EDGE_ODD,
    LM_EDGE_V,
    LM_EDGE_WINNER,
    LM_NO_INDEX,
    f32_logits,
    lm_head_block_partials,
    lm_head_edge_case,
)

NEG_INF = -np.inf


def test_lm_head_argmax_keeps_minus_inf_candidates_and_never_picks_the_excluded_one():
    lg = np.asarray([[NEG_INF, NEG_INF, NEG_INF], [np.nan, -3.0, -3.0], [-1.0, NEG_INF, -1.0]])
    idx, val = lm_head_argmax(lg, excluded=0)
    assert idx.tolist() == [1, 1, 2] and val.tolist() == [NEG_INF, -3.0, -1.0]
    idx, val = lm_head_argmax(lg)
    assert idx.tolist() == [0, 1, 0], "ties to the lowest index, -inf ties included; NaN never wins"
    with pytest.raises(ValueError, match="no candidate"):
        lm_head_argmax(np.asarray([[1.0]]), excluded=0)


def test_lm_head_block_partials_by_hand():
    # rows per block 2, V = 5: blocks {0, 1}, {2, 3}, {4}; row 4 excluded leaves block 2 empty.
    lg = np.asarray([[NEG_INF, NEG_INF, -2.0, 5.0, 9.0], [3.0, 3.0, np.nan, -1.0, 0.0]])
    idx, val = lm_head_block_partials(lg, excluded=4, rows_per_block=2)
    assert idx.tolist() == [[0, 3, LM_NO_INDEX], [0, 3, LM_NO_INDEX]]
    assert val.tolist() == [[NEG_INF, 5.0, NEG_INF], [3.0, -1.0, NEG_INF]]
    idx, _ = lm_head_block_partials(lg, excluded=0, rows_per_block=2)
    assert idx[:, 0].tolist() == [1, 1], "the excluded row is no candidate, even among -inf ties"


def _best_of_partials(idx, val):
    """The reduce's rule over partials: largest value, then lowest index."""
    out = []
    for pi, pv in zip(idx, val):
        m = pv.max()
        out.append((int(pi[pv == m].min()), m))
    return out


@pytest.mark.parametrize("excluded", [-1, 0])
def test_lm_head_edge_case_is_exact_and_puts_its_winners_where_designed(excluded):
    ec = lm_head_edge_case()
    c = ec.case
    assert c.E.shape == (LM_EDGE_V, LM_EDGE_H) and c.softcap == 0.0
    assert LM_EDGE_V % 64 and LM_EDGE_H // 8 < 32, "a partial last block, idle lanes"
    # token 0: exact finite dots, every logit past -2^128: -inf in f32
    h = c.h.astype(np.float64)
    E = decode_e4m3(c.E).astype(np.float64)
    dots = h @ E.T
    assert np.all(np.isfinite(dots)) and np.all(dots[0] < 0) and np.max(np.abs(dots)) < 2.0**127.5
    assert np.all(c.rs.astype(np.float64) * dots[0] < -(2.0**128)) and np.all(ec.logits[0] == NEG_INF)
    # token 1: every logit negative, the winner alone at the top, in the last warp of block 2
    assert np.all(ec.logits[1] < 0) and np.all(np.isfinite(ec.logits[1]))
    assert (LM_EDGE_WINNER % 64) // 8 == 7, "the winner in its block's last warp"
    assert (LM_EDGE_WINNER // 64) // 32 == 7 and -(-LM_EDGE_V // 64) <= 256, "its partial in the last reduce warp"
    idx, val = lm_head_argmax(ec.logits, excluded=excluded)
    assert idx.tolist() == [0 if excluded < 0 else 1, LM_EDGE_WINNER] and val[0] == NEG_INF
    # the partials reduce to the same answer, and token 1's block 0 beats token 0's every partial
    pidx, pval = lm_head_block_partials(ec.logits, excluded=excluded)
    assert _best_of_partials(pidx, pval) == list(zip(idx.tolist(), val.tolist()))
    assert np.all(pval[0] == NEG_INF) and np.all(pidx[0] != LM_NO_INDEX) and np.isfinite(pval[1, 0])


def test_lm_head_edge_winner_moves_when_a_pairs_low_code_bit_is_dropped():
    # lm_head_dot8 pairs elements (2i, 2i + 1), the even one in the low byte: a 0xfffe mask
    # clears its code's lowest bit. The winner row holds 1.125 (0x39 -> 0x38, 1.0) there.
    ec = lm_head_edge_case()
    c = ec.case
    assert all(k % 2 == 0 for k in LM_EDGE_ODD)
    assert np.all(c.E[LM_EDGE_WINNER, list(LM_EDGE_ODD)] == 0x39)
    masked = c.E.copy()
    masked[:, 0::2] &= 0xFE
    logits = f32_logits(c.rs, c.h.astype(np.float64) @ decode_e4m3(masked).astype(np.float64).T)
    assert logits[1, LM_EDGE_WINNER] != ec.logits[1, LM_EDGE_WINNER]
    assert lm_head_argmax(logits)[1][1] != lm_head_argmax(ec.logits)[1][1], "the answer's value moves"


def test_f32_logits_refuses_a_rounding_product_but_takes_an_overflow():
    assert f32_logits(np.asarray([2.0**100]), np.asarray([[-(2.0**30)]]))[0, 0] == NEG_INF
    with pytest.raises(ValueError, match="not exact in f32"):
        f32_logits(np.asarray([3.0]), np.asarray([[1.0 + 2.0**-23]]))


def test_lm_head_positional_partials_reduce_to_the_argmax_and_spread_over_the_slots():
    pc = lm_head_positional_case()
    for excluded in (-1, LM_POS_V - 1):
        idx, val = lm_head_argmax(pc.logits, excluded=excluded)
        pidx, pval = lm_head_block_partials(pc.logits, excluded=excluded)
        assert pidx.shape == (len(LM_POS_WINNERS), -(-LM_POS_V // 64))
        assert _best_of_partials(pidx, pval) == list(zip(idx.tolist(), val.tolist()))
        # every slot holds a real row of its own block, so a slot shifted by one shows
        blocks = np.arange(pidx.shape[1])[None, :]
        assert np.all(pidx // 64 == blocks)
        assert np.all(np.any(pval[:, 1:] != pval[:, :-1], axis=1)), "a row's values shifted by a slot would show"


def test_lm_head_unit_cap_keeps_the_positional_order_past_tanhf_error():
    from oracles.quant_gemv import LM_POS_UNIT_CAP, LM_POS_UNIT_CAP_RS

    pc = lm_head_positional_case()
    scaled = np.unique(pc.logits) * LM_POS_UNIT_CAP_RS
    assert np.array_equal(scaled.astype(np.float32).astype(np.float64), scaled), "scaling by 2^-11 is exact"
    assert np.abs(scaled).max() < 0.5 and np.min(np.diff(scaled)) >= 2.0**-14
    capped_all = np.float64(LM_POS_UNIT_CAP) * np.tanh(scaled / LM_POS_UNIT_CAP)
    assert np.min(np.diff(capped_all)) > 5e-5 > 100 * 2 * np.spacing(np.float32(0.5))
    # a kernel that caps only above 1 returns the scaled logit itself: visible on every winner
    idx, val = lm_head_argmax(pc.logits)
    uncapped = val * LM_POS_UNIT_CAP_RS
    assert np.all(np.abs(uncapped - np.tanh(uncapped)) > 1e-3)


def test_lm_head_lone_candidate_case_has_one_minus_inf_logit_a_token_after_warps_with_none():
    from oracles.quant_gemv import (LM_LONE_ROWS, LM_NO_INDEX, LM_ROWS_PER_BLOCK, lm_head_block_partials,
                                    lm_head_exact_logits, lm_head_lone_candidate_case)

    from kernels_cu import lm_head

    case = lm_head_lone_candidate_case()
    assert lm_head.check_lm_head_args(case.h, case.E, case.rs, lm_head.NONE, case.softcap) == (len(LM_LONE_ROWS), 128, 128)
    lg = lm_head_exact_logits(case)
    t = np.arange(len(LM_LONE_ROWS))
    assert np.all(np.isneginf(lg[t, list(LM_LONE_ROWS)]))
    assert np.isnan(lg).sum() == lg.size - len(LM_LONE_ROWS), "every other logit is NaN"
    # every warp of block 0 holds one token's candidate, and block 1 two, in different warps
    where = {(r // LM_ROWS_PER_BLOCK, r % LM_ROWS_PER_BLOCK // 8) for r in LM_LONE_ROWS}
    assert {w for b, w in where if b == 0} == set(range(8)) and len({w for b, w in where if b == 1}) == 2
    idx, val = lm_head_argmax(lg)
    assert idx.tolist() == list(LM_LONE_ROWS) and np.all(np.isneginf(val))
    part_idx = lm_head_block_partials(lg)[0]
    blocks = np.array(LM_LONE_ROWS) // LM_ROWS_PER_BLOCK
    assert np.array_equal(part_idx[t, blocks], LM_LONE_ROWS)
    assert np.all(part_idx[t, 1 - blocks] == LM_NO_INDEX), "the other block has no candidate at all"
    # the mutant this design exists for: a final stage that breaks ties by s_idx[w - 1]
    for r in LM_LONE_ROWS:
        slots = [(-np.inf, LM_NO_INDEX)] * 8
        slots[r % LM_ROWS_PER_BLOCK // 8] = (-np.inf, r)
        best = slots[0]
        for w in range(1, 8):
            v, i = slots[w][0], slots[w - 1][1]
            if v > best[0] or (v == best[0] and i < best[1]):
                best = (v, slots[w][1])
        assert best[1] == (r if r % LM_ROWS_PER_BLOCK < 8 else LM_NO_INDEX), r


# ------------------------------------------------------------------ the sweeps' and big-index designs

from harness.library.buffers import INDEX_32  # noqa: E402
from oracles.quant_gemv import (  # noqa: E402
    LM_SWEEP_PERIOD,
    lm_head_block_partials,
    lm_head_far_rows_case,
    lm_head_sweep_case,
    lm_head_sweep_excluded,
    nvfp4_sweep_case,
)


def _nvfp4_by_the_formula(case) -> np.ndarray:
    n, half = case.w.shape
    w = unpack_fp4(case.w, 2 * half).astype(np.float64)
    scale = np.repeat(decode_e4m3(case.s).astype(np.float64), 16, axis=1)
    return to_bf16(case.gs * (case.x.astype(np.float64)[None, :] * w * scale).sum(axis=1))


@pytest.mark.parametrize("n, k", [(9, 1024), (5, 32768), (3, 16), (17, 3600)])
def test_nvfp4_sweep_case_is_exact_and_expected_is_the_contract_formula(n, k):
    case = nvfp4_sweep_case(n, k, seed=n + k)
    assert case.w.shape == (n, k // 2) and case.s.shape == (n, k // 16)
    x = case.x.astype(np.float64)
    assert np.all(np.mod(x * 4, 1) == 0) and np.abs(x).max() <= 1 and np.all(x != 0)
    assert set(decode_e4m3(case.s).ravel().tolist()) <= {0.5, 1.0, 2.0, 4.0}
    np.testing.assert_array_equal(bits_of(nvfp4_expected(case)), bits_of(_nvfp4_by_the_formula(case)))


def test_nvfp4_sweep_case_exercises_the_rounding_and_every_code():
    case = nvfp4_sweep_case(64, 4096, seed=1)
    codes = np.concatenate([case.w & 0x0F, case.w >> 4], axis=1)
    assert set(np.unique(codes).tolist()) == set(range(16))
    exact = _nvfp4_by_the_formula(case).astype(np.float64)
    w = unpack_fp4(case.w, 4096).astype(np.float64) * np.repeat(decode_e4m3(case.s).astype(np.float64), 16, axis=1)
    f32 = (case.gs * (w @ case.x.astype(np.float64))).astype(np.float32)
    assert np.count_nonzero(f32.view(np.uint32) & 0xFFFF) >= 48, "most outputs must round to bf16"
    # a dropped last sweep of 64 groups moves most outputs
    dropped = (case.gs * (w[:, :3072] @ case.x.astype(np.float64)[:3072])).astype(np.float64)
    assert np.count_nonzero(bits_of(to_bf16(dropped)) != bits_of(to_bf16(exact))) >= 60


def test_nvfp4_sweep_case_refuses_a_k_past_its_exactness():
    nvfp4_sweep_case(1, 43680, seed=0)
    with pytest.raises(ValueError, match="past 2\\^24: shrink K"):
        nvfp4_sweep_case(1, 43696, seed=0)


def test_nvfp4_expected_refuses_scales_that_are_not_multiples_of_a_half():
    case = nvfp4_sweep_case(2, 64, seed=3)
    quarter = e4m3_bits([0.25])[0]
    with pytest.raises(ValueError, match="exact only on nvfp4_designed inputs"):
        nvfp4_expected(type(case)(x=case.x, w=case.w, s=np.full_like(case.s, quarter), gs=case.gs))


@pytest.mark.parametrize("t, v, hdim", [(3, 200, 264), (1, 1, 8), (2, 2, 16), (4, 64 * 5, 256), (8, 16385, 8)])
def test_lm_head_sweep_case_logits_are_those_of_its_embedding(t, v, hdim):
    case = lm_head_sweep_case(t, v, hdim, seed=5)
    E = case.embedding()
    assert E.shape == (v, hdim) and case.h.shape == (t, hdim) and case.rs.shape == (v,)
    logits = case.rs.astype(np.float64)[None, :] * (case.h.astype(np.float64) @ decode_e4m3(E).astype(np.float64).T)
    np.testing.assert_array_equal(logits, case.logits)
    assert np.array_equal(logits.astype(np.float32).astype(np.float64), logits), "exact in f32"
    assert case.excluded == lm_head_sweep_excluded(v)
    idx, _ = lm_head_argmax(case.logits, case.excluded)
    if hdim >= 64 and v >= 3:  # the designed rows' 2 * sum |h| is past every drawn row's reach
        assert idx[0] == v - 1
        if t >= 2:  # token 1's designed rows tie, one of them excluded: the other answers
            assert case.excluded in case.rows.tolist() and idx[1] != case.excluded
            assert case.logits[1, idx[1]] == case.logits[1, case.excluded]


def test_lm_head_sweep_case_repeats_its_base_rows_but_every_block_and_warp_sees_other_phases():
    case = lm_head_sweep_case(2, 64 * 300, 256, seed=9)
    E = case.embedding()
    generic = np.setdiff1d(np.arange(E.shape[0]), case.rows)
    assert np.array_equal(E[generic], case.base[generic % LM_SWEEP_PERIOD])
    assert LM_SWEEP_PERIOD > 64 and all(LM_SWEEP_PERIOD % d for d in range(2, 16)), "a prime past a block"
    # the bests spread over the base rows, and a row read one place off (its neighbour's values under its own
    # scale) moves most block partials
    pidx, pval = lm_head_block_partials(case.logits, case.excluded)
    assert len(np.unique(pidx % LM_SWEEP_PERIOD)) > 32, "the blocks' bests come from many base rows"
    e = decode_e4m3(np.roll(E, -1, axis=0)).astype(np.float64)
    shifted = case.rs.astype(np.float64)[None, :] * (case.h.astype(np.float64) @ e.T)
    sidx, sval = lm_head_block_partials(shifted, case.excluded)
    assert np.mean(sval != pval) > 0.5 and np.mean(sidx != pidx) > 0.5


def test_lm_head_far_rows_case_is_data_only_in_its_live_rows():
    v, live = 64 * 10, 128
    winners = ((v - 1,), (v - 65, v - 64))
    case = lm_head_far_rows_case(2, v, 64, live, winners, seed=2)
    assert np.all(np.isnan(case.rs[:v - live])) and not np.any(np.isnan(case.rs[v - live:]))
    assert np.all(np.isnan(case.logits[:, :v - live])) and not np.any(np.isnan(case.logits[:, v - live:]))
    idx, _ = lm_head_argmax(case.logits)
    assert idx.tolist() == [v - 1, v - 65]
    e = decode_e4m3(case.E).astype(np.float64)
    np.testing.assert_array_equal(case.logits[:, v - live:],
                                  case.rs[v - live:].astype(np.float64)[None, :] * (case.h.astype(np.float64) @ e.T))
    assert not np.array_equal(case.decoys, case.E)
    with pytest.raises(ValueError, match="among the last"):
        lm_head_far_rows_case(1, v, 64, live, ((0,),), seed=2)


def test_each_big_index_gate_puts_a_32_bit_wrap_on_other_rows_of_its_design():
    # The geometry the big-index gates and their 32-bit controls rely on: the live rows past
    # the limit, and where a 32-bit product sends each of them (gates/_quant_gemv.py).
    import gates.test_fp8_gemv as f
    import gates.test_lm_head as lm
    import gates.test_nvfp4_gemv as nv

    def signed(x):
        return (x + 2**31) % 2**32 - 2**31

    # FP8 and lm_head: int products; the weights sit INDEX_32 bytes into their allocation.
    for rows, width, live, decoys in ((f.BIG_N, f.BIG_K, f.BIG_LIVE, f.BIG_PAST),
                                      (lm.BIG_V, lm.BIG_H, lm.BIG_LIVE, lm.BIG_LIVE)):
        past = [r for r in range(rows - live, rows) if r * width >= INDEX_32]
        assert past and rows - live < past[0] and (rows - 1) * width < 2 * INDEX_32
        wrapped = [INDEX_32 + signed(r * width) for r in past]
        assert all(0 <= a and a + width <= decoys * width for a in wrapped), "a wrap lands on the decoys"
    # NVFP4: unsigned products; the rows past 2^32 bytes wrap onto rows of the first run.
    half = nv.BIG_K // 2
    live = [r for s in nv.BIG_STARTS for r in range(s, s + nv.BIG_RUN)]
    past = [r for r in live if r * half >= 2 * INDEX_32]
    assert len(past) == nv.BIG_PAST and past[-1] == nv.BIG_N - 1
    assert all((r * half) % 2**32 // half in range(nv.BIG_STARTS[0], nv.BIG_STARTS[0] + nv.BIG_RUN) for r in past)
    for limit in (INDEX_32 // 2, INDEX_32, 2 * INDEX_32):  # element 2^31, byte 2^31, byte 2^32: straddled
        assert any(r * half < limit for r in live if r * half >= limit - nv.BIG_RUN * half)
        assert any(r * half >= limit for r in live if r * half < limit + nv.BIG_RUN * half)
