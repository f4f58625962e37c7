"""lm_head argmax with soft-capping and an excluded id: analytic anchors."""

from __future__ import annotations

import numpy as np
import pytest

from gates._quant_gemv import (LmHeadGuardedRun, lm_head_edge, lm_head_partials_of, lm_head_positional,
                               lm_head_sweep_to_device, run_lm_head, run_lm_head_far_rows, run_lm_head_fenced,
                               run_lm_head_guarded, run_lm_head_guarded_on_device, shaped)
from harness import assert_bits_eq, assert_close
from harness.library.buffers import INDEX_32, assert_untouched, device_memory
from harness.library.sweep import Dim, Preset, ShapeSpace, assert_named_shapes_accepted, sweep
from kernels_cu import lm_head
from oracles.quant_gemv import (LM_EDGE_WINNER, LM_HEAD_HOT_ROW, LM_LONE_ROWS, LM_POS_RUNNER_UP, LM_POS_SOFTCAP,
                                 LM_POS_UNIT_CAP, LM_POS_UNIT_CAP_RS, LM_POS_V, LM_POS_WINNERS, TANHF_ULP_BOUND,
                                 LmHeadCase, capped, lm_head_argmax, lm_head_block_partials, lm_head_case,
                                 lm_head_exact_logits, lm_head_far_rows_case, lm_head_lone_candidate_case,
                                 lm_head_sweep_case, lm_head_sweep_excluded)

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
    assert_partials_of(run, *lm_head_partials_of(design, excluded), f"{design}, excluded {excluded}")


def assert_partials_of(run: LmHeadGuardedRun, idx: np.ndarray, val: np.ndarray, what: str) -> None:
    for label, arr, bits in run.guards:
        assert_untouched(label, arr, bits)
    assert_bits_eq(f"block partial indices ({what})", run.part_idx, idx)
    assert_bits_eq(f"block partial values ({what})", run.part_val, val.astype(np.float32))


def assert_answers(run: LmHeadGuardedRun, logits: np.ndarray, excluded: int, what: str) -> None:
    """Every block's partial, then each token's answer, against the exact logits."""
    assert_partials_of(run, *lm_head_block_partials(logits, excluded), what)
    idx, val = lm_head_argmax(logits, excluded)
    assert_bits_eq(f"argmax index ({what})", run.idx, idx)
    assert_bits_eq(f"argmax value ({what})", run.val, val.astype(np.float32))


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


# The sweep: the kernels over their shapes. H is swept 8 elements a lane, 32 lanes a step (256
# a warp's pass): its multiples are the passes with no tail, as most production widths are
# (3584, 4096, 7168, 8192; gpt-oss's 2880 is not), one step of 8 either side a tail of one step.
# V's tile is the reduce kernel's pass: 256 threads, one block partial of 64 rows each, so 16384
# rows fill a pass and more take a second (a whole pass, one row either side). Real
# vocabularies are whole blocks of 64 (every preset's is); drawn V rarely is, so both show. T
# is a grid dimension, every token its own blocks. The bound keeps a shape's embedding (built
# on the device: lm_head_sweep_case) within a GB; the host's work is the T x V logits.
LM_H_PASS = 32 * lm_head.H_PER_LANE
LM_REDUCE_PASS = lm_head.ROWS_PER_BLOCK * lm_head.THREADS
LM_SWEEP_BYTES = 1 << 30  # the largest embedding a shape builds
LM_SHAPES = ShapeSpace(
    "lm_head",
    (Dim("T", 1, 8), Dim("V", 1, 262144, tile=LM_REDUCE_PASS),
     Dim("H", lm_head.H_PER_LANE, 8192, multiple_of=lm_head.H_PER_LANE, tile=LM_H_PASS)),
    where=(("the embedding at most 2^30 bytes", lambda s: s["V"] * s["H"] <= LM_SWEEP_BYTES),),
    presets=(
        Preset("Llama-3 8B decode", {"T": 1, "V": 128256, "H": 4096},
               "Llama-3-8B config.json: vocab_size 128256, hidden_size 4096"),
        Preset("Llama-3 70B decode, batch of 4", {"T": 4, "V": 128256, "H": 8192},
               "Llama-3-70B config.json: vocab_size 128256, hidden_size 8192"),
        Preset("Qwen2.5 7B decode, batch of 8", {"T": 8, "V": 152064, "H": 3584},
               "Qwen2.5-7B config.json: vocab_size 152064, hidden_size 3584"),
        Preset("DeepSeek-V3 decode, batch of 2", {"T": 2, "V": 129280, "H": 7168},
               "DeepSeek-V3 config.json: vocab_size 129280, hidden_size 7168"),
        Preset("Gemma-2 9B decode", {"T": 1, "V": 256000, "H": 3584},
               "gemma-2-9b config.json: vocab_size 256000, hidden_size 3584"),
        Preset("gpt-oss-120b decode", {"T": 1, "V": 201088, "H": 2880},
               "gpt-oss-120b config.json: vocab_size 201088, hidden_size 2880"),
    ),
)


def lm_head_shape_check(shape):
    # softcap 0: every logit exact, so every block's partial and every answer compare as bits.
    t, v, hdim = shape["T"], shape["V"], shape["H"]
    case = lm_head_sweep_case(t, v, hdim, seed=t + 3 * v + 7 * hdim)
    dev = lm_head_sweep_to_device(case)
    run = run_lm_head_guarded_on_device(dev.h, dev.E, dev.rs, case.excluded, dev.softcap)
    assert_answers(run, case.logits, case.excluded, f"T={t}, V={v}, H={hdim}, excluded {case.excluded}")


@pytest.mark.gpu
@pytest.mark.sweep
def test_lm_head_partials_and_answers_match_the_exact_logits_over_its_shape_space():
    with device_memory(2 * LM_SWEEP_BYTES, "the lm_head sweep's embeddings (up to 2^30 bytes a shape)"):
        sweep(LM_SHAPES, lm_head_shape_check)


# Past 2^31 embedding bytes: V = 2^18 + 64 rows of H = 8192 (Llama-3 70B's hidden_size), so
# v * H passes 2^31 at row 2^18 and the last block of 64 rows lies past it. Live: the last two
# blocks (the one before the boundary and the one past); every other row is never written and
# its scale is NaN, so its logit never wins whatever it holds. Token 0's winner is the last row;
# token 1's two rows tie across the boundary (the one before wins).
BIG_H = 8192
BIG_FIRST_PAST = INDEX_32 // BIG_H  # the first row past 2^31 bytes
BIG_V = BIG_FIRST_PAST + lm_head.ROWS_PER_BLOCK
BIG_LIVE = 2 * lm_head.ROWS_PER_BLOCK
BIG_WINNERS = ((BIG_V - 1,), (BIG_FIRST_PAST - 1, BIG_FIRST_PAST))
BIG_SEED = 23
# The embedding sits 2^31 bytes into its allocation (run_lm_head_far_rows), plus the scales.
BIG_BYTES = INDEX_32 + BIG_V * BIG_H + 4 * BIG_V


@pytest.mark.memory_safety
@pytest.mark.gpu
@pytest.mark.anchor
def test_lm_head_rows_past_2_31_embedding_bytes_keep_their_partials_and_answers():
    # The kernel takes int sizes: a row offset `v * H` in 32 bits wraps past 2^31 to
    # v * H - 2^32 (negative). The embedding starts 2^31 bytes into its allocation, whose first
    # rows hold decoys (rows of the same design), so a wrapped row reads decoy v - 2^18: the last
    # block's partial and token 0's answer differ by assertion, not by a fault. Exact (softcap
    # 0): every block's partial (the dead blocks' (-inf, no index)) and each answer as bits.
    # memory_safety: a wrap that lands off the allocation faults, and that is this gate's verdict.
    case = lm_head_far_rows_case(len(BIG_WINNERS), BIG_V, BIG_H, BIG_LIVE, BIG_WINNERS, BIG_SEED)
    idx, _ = lm_head_argmax(case.logits)
    assert idx.tolist() == [BIG_V - 1, BIG_FIRST_PAST - 1], "the design's winners moved"
    with device_memory(BIG_BYTES, f"an embedding past 2^31 bytes ({BIG_V} rows of H = {BIG_H})"):
        run = run_lm_head_far_rows(case, lm_head.NONE)
    assert_answers(run, case.logits, lm_head.NONE, f"rows {BIG_V - BIG_LIVE}..{BIG_V - 1} live, "
                   f"rows from {BIG_FIRST_PAST} past 2^31 embedding bytes")


@pytest.mark.structural
def test_every_preset_and_boundary_of_the_lm_head_shape_space_is_a_shape_the_launcher_accepts():
    # The space promises shapes the kernel runs: one the launcher refuses is a space declared
    # wrong; so is the big-index gate's shape (with the excluded id each one runs with).
    big = {"T": len(BIG_WINNERS), "V": BIG_V, "H": BIG_H}

    def accepted(shape):
        t, v, hdim = shape["T"], shape["V"], shape["H"]
        excluded = lm_head.NONE if shape == big else lm_head_sweep_excluded(v)
        args = shaped((t, hdim), np.uint16), shaped((v, hdim), np.uint8), shaped((v,), np.float32)
        assert lm_head.check_lm_head_args(*args, excluded, 0.0) == (t, v, hdim)

    assert_named_shapes_accepted(LM_SHAPES, accepted, extra={"the big-index gate's shape": big})
