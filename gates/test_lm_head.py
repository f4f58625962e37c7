"""lm_head argmax with soft-capping and an excluded id: analytic anchors."""

from __future__ import annotations

import numpy as np
import pytest

from gates._quant_gemv import (LmHeadGuardedRun, lm_head_edge, lm_head_partials_of, lm_head_positional, run_lm_head,
                               run_lm_head_fenced, run_lm_head_guarded)
from harness import assert_bits_eq, assert_close
from harness.library.buffers import assert_untouched
from kernels_cu import lm_head
from oracles.quant_gemv import (LM_EDGE_WINNER, LM_HEAD_HOT_ROW, LM_LONE_ROWS, LM_POS_RUNNER_UP, LM_POS_SOFTCAP,
                                 LM_POS_UNIT_CAP, LM_POS_UNIT_CAP_RS, LM_POS_V, LM_POS_WINNERS, TANHF_ULP_BOUND,
                                 LmHeadCase, capped, lm_head_argmax, lm_head_case, lm_head_exact_logits,
                                 lm_head_lone_candidate_case)

T, V, H, SOFTCAP = 2, 1024, 64, 30.0


@pytest.fixture(scope="module")
def case():
    return lm_head_case(t=T, v=V, hdim=H, softcap=SOFTCAP)


def assert_capped_value(val: np.ndarray, logit: float) -> None:
    expected = np.full(T, capped(logit, SOFTCAP), dtype=np.float32)
    # Tolerance, not bits: CUDA's tanhf is documented within 2 ulp, not correctly rounded;
    # the logit itself (exact: H or 2H) and the division are exact or IEEE-rounded.
    assert_close(f"capped value of logit {logit:g}", val, expected,
                 atol=TANHF_ULP_BOUND * float(np.spacing(expected[0])), rtol=0.0)


@pytest.mark.gpu
@pytest.mark.anchor
def test_lm_head_picks_the_doubled_row_with_its_capped_value(case):
    idx, val = run_lm_head(case, excluded=lm_head.NONE)
    assert_bits_eq("argmax index", idx, np.full(T, LM_HEAD_HOT_ROW, dtype=np.int32))
    assert_capped_value(val, 2.0 * H)


@pytest.mark.gpu
@pytest.mark.anchor
def test_lm_head_excluded_id_never_wins_and_ties_go_to_the_lowest_index(case):
    # With row 777 excluded every logit is H: a V-way tie that index 0 must win.
    idx, val = run_lm_head(case, excluded=LM_HEAD_HOT_ROW)
    assert_bits_eq("argmax index with 777 excluded", idx, np.zeros(T, dtype=np.int32))
    assert_capped_value(val, float(H))


@pytest.fixture(scope="module")
def positional():
    return lm_head_positional()


@pytest.mark.gpu
@pytest.mark.anchor
def test_lm_head_winners_at_block_warp_and_vocabulary_edges_and_ties_across_reduce_warps(positional):
    # V = 17317: 271 partials a row (the reduce kernel's upper
    # half-warps, several reduce warps, a second pass), the last block partial; H = 264 (lane 0
    # takes two steps). h and E position-dependent from {+-0.5, +-1, +-2}, rs in {1/2, 1, 2},
    # every token a different winner: V - 1, a warp's last row, a three-way tie across reduce
    # warps 1, 4 and 0 (second pass), a tie inside one reduce warp (upper half-warp lane holds
    # the lower index), a tie inside one block, a lone winner in lane 0 of reduce warp 1 (after
    # the shift-down tree only lane 0 holds a warp's best: a wrong writer loses it). softcap 0:
    # every logit is exact in f32 (products multiples of 1/4, |dot| <= 1056, rs powers of two),
    # so index and value compare as bits.
    # Then V - 1 excluded: token 0's winner moves to a block's first row, 0.5 below.
    idx, val = lm_head_argmax(positional.logits)
    assert idx.tolist() == [min(rows) for rows in LM_POS_WINNERS], "the design's winners moved"
    got_idx, got_val = run_lm_head(positional.case, excluded=lm_head.NONE)
    assert_bits_eq("argmax index (softcap 0, position-dependent h and E)", got_idx, idx)
    assert_bits_eq("argmax value (softcap 0: exact logit)", got_val, val.astype(np.float32))
    idx_x, val_x = lm_head_argmax(positional.logits, excluded=LM_POS_V - 1)
    assert idx_x[0] == LM_POS_RUNNER_UP and np.array_equal(idx_x[1:], idx[1:]), "the design's runner-up moved"
    got_idx, got_val = run_lm_head(positional.case, excluded=LM_POS_V - 1)
    assert_bits_eq(f"argmax index with V - 1 = {LM_POS_V - 1} excluded", got_idx, idx_x)
    assert_bits_eq(f"argmax value with V - 1 = {LM_POS_V - 1} excluded", got_val, val_x.astype(np.float32))


@pytest.mark.memory_safety
@pytest.mark.gpu
@pytest.mark.anchor
def test_lm_head_reads_nothing_outside_its_inputs(positional):
    # Memory safety: every read stays inside h, E and rs. The positional design with each
    # input a view between bf16 / e4m3 / f32 NaN fences a whole buffer long
    # (gates/_quant_gemv.py): a row whose dot reads a fence (a row's or a token's offset
    # negated, a chunk walking back) has a NaN logit that never wins, so its token answers
    # another row, by assertion; no design winner is row 0, whose offset no sign can move.
    # A read further away faults: this gate's verdict too (docs/mutation.md, Verdicts).
    idx, val = lm_head_argmax(positional.logits)
    assert 0 not in idx.tolist(), "a design winner is row 0"
    got_idx, got_val = run_lm_head_fenced(positional.case, excluded=lm_head.NONE)
    assert_bits_eq("argmax index (inputs between NaN fences)", got_idx, idx)
    assert_bits_eq("argmax value (inputs between NaN fences)", got_val, val.astype(np.float32))


@pytest.mark.gpu
@pytest.mark.anchor
def test_lm_head_capping_keeps_the_positional_winners_and_caps_their_values(positional):
    # softcap 2048 on the same logits (|logit| <= rs * 4 H <= 2112): tanh is increasing, its
    # slope stays above 0.39 up to |logit / 2048| = 1.04, and distinct logits differ by >= 1/8,
    # so distinct capped values differ by > 0.04, far past tanhf's 2 ulp (under 3e-4 below
    # 2048); equal logits give equal capped values. So the argmax
    # index (ties included) is the uncapped one, exactly; the value within TANHF_ULP_BOUND ulp.
    idx, val = lm_head_argmax(positional.logits)
    capped_case = LmHeadCase(h=positional.case.h, E=positional.case.E, rs=positional.case.rs,
                             softcap=LM_POS_SOFTCAP)
    got_idx, got_val = run_lm_head(capped_case, excluded=lm_head.NONE)
    assert_bits_eq(f"argmax index (softcap {LM_POS_SOFTCAP:g})", got_idx, idx)
    expected = np.asarray([capped(v, LM_POS_SOFTCAP) for v in val], dtype=np.float32)
    assert_close(f"capped values (softcap {LM_POS_SOFTCAP:g})", got_val, expected,
                 atol=TANHF_ULP_BOUND * float(np.spacing(np.abs(expected).max())), rtol=0.0)


@pytest.mark.gpu
@pytest.mark.anchor
def test_lm_head_a_cap_of_one_still_caps(positional):
    # softcap 1.0 (the contract caps for every softcap > 0; the other anchors use 30 and 2048)
    # on the positional design with every row scale times 2^-11 (exact): logits below 0.5 in
    # magnitude (|logit| <= 665 before scaling), distinct ones at least 2^-14 apart; tanh's
    # slope stays above 0.78 there, so distinct capped values differ by more than 5e-5, far
    # past tanhf's 2 ulp (under 6e-8 below 0.5; checked on the host): the index is the
    # uncapped one, exactly; the value within TANHF_ULP_BOUND ulp. The division by 1 and the
    # product with 1 are exact. A kernel that caps only above 1 returns the scaled logit.
    idx, val = lm_head_argmax(positional.logits)
    c = positional.case
    unit = LmHeadCase(h=c.h, E=c.E, rs=(c.rs * np.float32(LM_POS_UNIT_CAP_RS)).astype(np.float32),
                      softcap=LM_POS_UNIT_CAP)
    got_idx, got_val = run_lm_head(unit, excluded=lm_head.NONE)
    assert_bits_eq(f"argmax index (softcap {LM_POS_UNIT_CAP:g})", got_idx, idx)
    expected = np.asarray([capped(v * LM_POS_UNIT_CAP_RS, LM_POS_UNIT_CAP) for v in val], dtype=np.float32)
    assert_close(f"capped values (softcap {LM_POS_UNIT_CAP:g})", got_val, expected,
                 atol=TANHF_ULP_BOUND * float(np.spacing(np.abs(expected).max())), rtol=0.0)


def assert_partials(run: LmHeadGuardedRun, design: str, excluded: int) -> None:
    """Every block's (value, index) in its own slot, nothing written around the slots."""
    for label, arr, bits in run.guards:
        assert_untouched(label, arr, bits)
    idx, val = lm_head_partials_of(design, excluded)
    assert_bits_eq(f"block partial indices ({design}, excluded {excluded})", run.part_idx, idx)
    assert_bits_eq(f"block partial values ({design}, excluded {excluded})", run.part_val, val.astype(np.float32))


@pytest.mark.gpu
@pytest.mark.anchor
def test_lm_head_every_block_partial_lands_in_its_own_slot_between_sentinel_guards(positional):
    # The positional design (271 blocks, the last partial) with the scratch inside sentinel
    # guards, every slot and guard entry a sentinel winner (+inf, 0xa5a5a5a5). Each block's
    # partial is the exact (value, index) of its best row (host: lm_head_block_partials),
    # bitwise, so a partial stored in the wrong slot, one slot early or late, or not at all
    # shows here, in the slot or in a guard, as a value rather than a fault. Then the answer:
    # a reduce that reads one partial past a row takes the next row's block 0, or for the
    # last token the guard's sentinel, which wins.
    run = run_lm_head_guarded(positional.case, excluded=lm_head.NONE)
    assert_partials(run, "positional", lm_head.NONE)
    idx, val = lm_head_argmax(positional.logits)
    assert_bits_eq("argmax index (guarded scratch)", run.idx, idx)
    assert_bits_eq("argmax value (guarded scratch)", run.val, val.astype(np.float32))


@pytest.mark.gpu
@pytest.mark.anchor
def test_lm_head_all_negative_and_all_overflowing_logits_keep_their_winners():
    # The edge design (oracles.quant_gemv.lm_head_edge_case), V = 15525 (243 blocks, the last
    # partial), H = 72 (lanes 9-31 idle), E in {0.5, 1, 1.125, 1.5, 2}, rs in {8, 16, 32}:
    # token 0's every logit overflows to -inf (exact dots, rs * dot < -2^128), so its answer is
    # its lowest candidate with value -inf: 0, or 1 with row 0 excluded. An initial best of 0
    # or -FLT_MAX (either kernel) answers (0x7fffffff, that value); a reduce reading one
    # partial past row 0 takes token 1's block 0. Token 1's logits are all negative (an
    # initial 0 wins over them); its winner sits in the last warp of block 230, whose partial
    # the reduce kernel's last warp holds (a block or cross-warp stage that skips or mis-reads
    # a last warp loses it), and holds 1.125 (odd mantissa code) at even elements, so a dot
    # dropping a pair's low code bit moves its value by 8 * 0.125 * |h|. Exact everywhere
    # (softcap 0): index and value compare as bits, -inf included. Then every block partial,
    # in a sentinel-guarded scratch, over padded inputs (gates/_quant_gemv.py).
    edge = lm_head_edge()
    for excluded in (lm_head.NONE, 0):
        idx, val = lm_head_argmax(edge.logits, excluded=excluded)
        assert idx.tolist() == [0 if excluded == lm_head.NONE else 1, LM_EDGE_WINNER], "the design moved"
        run = run_lm_head_guarded(edge.case, excluded=excluded)
        assert_bits_eq(f"argmax index (logits <= 0 and -inf, excluded {excluded})", run.idx, idx)
        assert_bits_eq(f"argmax value (logits <= 0 and -inf, excluded {excluded})", run.val, val.astype(np.float32))
        assert_partials(run, "edge", excluded)


@pytest.mark.gpu
@pytest.mark.anchor
def test_lm_head_takes_a_lone_minus_inf_candidate_after_warps_with_none():
    # oracles.quant_gemv.lm_head_lone_candidate_case: every logit NaN but each token's one,
    # -inf (rs = +inf, E = -I, h one-hot), in warps 0-7 of block 0 and warps 0 and 3 of
    # block 1. Every warp before a token's candidate reports (-inf, no index), so the
    # block's final stage and the reduce must take a -inf row over nothing; a tie-break that
    # reads another warp's index keeps nothing. Exact: the answer is (row, -inf), as bits.
    case = lm_head_lone_candidate_case()
    idx, val = lm_head_argmax(lm_head_exact_logits(case))
    assert idx.tolist() == list(LM_LONE_ROWS) and np.all(np.isneginf(val)), "the design moved"
    got_idx, got_val = run_lm_head(case, lm_head.NONE)
    assert_bits_eq("argmax index (a lone -inf candidate after warps with none)", got_idx, idx)
    assert_bits_eq("argmax value (a lone -inf candidate after warps with none)", got_val, val.astype(np.float32))


def _check(excluded=-1, softcap=30.0, h=64):
    lm_head.check_lm_head_args(np.empty((2, h), np.uint16), np.empty((16, h), np.uint8),
                               np.empty(16, np.float32), excluded, softcap)


@pytest.mark.refusal
def test_an_excluded_id_outside_the_vocabulary_is_refused_before_launch():
    with pytest.raises(ValueError, match=r"excluded id 16 is outside \[0, 16\)"):
        _check(excluded=16)


@pytest.mark.refusal
def test_a_negative_softcap_is_refused_before_launch():
    with pytest.raises(ValueError, match="softcap -1.0 must be finite and >= 0"):
        _check(softcap=-1.0)


@pytest.mark.refusal
def test_h_not_a_multiple_of_8_is_refused_before_launch():
    with pytest.raises(ValueError, match="H=60 is not a multiple of 8"):
        _check(h=60)


@pytest.mark.refusal
def test_a_scratch_of_the_wrong_shape_is_refused_before_launch():
    with pytest.raises(ValueError, match=r"part_idx has shape \(2, 2\), expected \(2, 1\)"):
        lm_head.check_lm_head_scratch(2, 16, (np.empty((2, 1), np.float32), np.empty((2, 2), np.int32)))
    with pytest.raises(ValueError, match=r"part_val has dtype float64, expected float32"):
        lm_head.check_lm_head_scratch(2, 16, (np.empty((2, 1)), np.empty((2, 1), np.int32)))
