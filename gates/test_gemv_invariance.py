"""Batch invariance and run-to-run determinism of the quantized GEMVs and lm_head.

A row's bits must not depend on the batch it is computed in: an FP8 token's outputs on how
many tokens share its launch, where it sits among them (which tile of
FP8_GEMV_TOKENS_PER_BLOCK, whether that tile is full) or how the weight rows are cut into
segments; an lm_head token's answer on the batch, on whose scratch holds the block partials
or on how the vocabulary is cut into shards; an NVFP4 output on how many weight rows share
its launch, its place among them (which block of 4 or 8, a partial last block) or which arm
computes it. And a repeated launch must give the same bits.

The inputs are order-sensitive (oracles.quant_gemv, "order-sensitive inputs"): paired
outlier channels whose products cancel, so the outputs' bits carry the rounding of the order
in which the f32 partial sums met, and a change of that order shows (plain random inputs hide
most of it behind the bf16 output rounding).
"""

from __future__ import annotations

import pytest

from gates._quant_gemv import (SENTINEL, fp8_inputs_to_device, lm_head_to_device, nvfp4_to_device, run_fp8_gemv_tokens,
                               run_lm_head_tokens, run_nvfp4_rows)
from harness import host_cache
from harness.library.graphs import GraphReplay, eager_and_graph
from harness.library.invariance import assert_batch_invariant, assert_deterministic
from kernels_cu import fp8_gemv, nvfp4_gemv
from oracles.quant_gemv import fp8_outlier_case, lm_head_outlier_case, nvfp4_outlier_case

# What an output holds before the launch, repeat r taking fill r % 4 (the determinism gates).
BF16_FILLS = (SENTINEL, 0x0000, 0xFFFF, 0x3F80)  # the sentinel NaN, +0, a negative NaN, 1.0
# (value bits, index bits) of a caller's lm_head scratch: a slot the kernels read unwritten
# answers +inf (a winner), NaN (never one), -inf, or 0 at another index.
SCRATCH_FILLS = ((0x7F800000, 0xA5A5A5A5), (0x7FC00000, 0), (0xFF800000, 0xFFFFFFFF), (0, 7))
POSITIONS = (0, 1, "middle", -2, -1)

# FP8: 9 tokens (a batch of all of them is two whole tiles of 4 and a partial one of 1), K =
# 1600 = 100 chunks of 16 (lanes 0-3 take 4 chunks, the rest 3), N = 45 rows (the last block
# of 8 has 5 live warps), as three segments whose edges fall inside blocks, or as one.
FP8_T, FP8_K, FP8_SEGMENTS, FP8_SEED = 9, 1600, (21, 14, 10), 3
FP8_ROWS, FP8_FILLERS = (0, 1, 2), tuple(range(3, FP8_T))
FP8_BATCH_SIZES = tuple(range(1, FP8_T + 1))  # 1-3 one partial tile, 4 one whole, 5-7 a second tile, 8, 9 a third
FP8_VARIANTS = {"segments 21+14+10": FP8_SEGMENTS, "one segment of 45": (sum(FP8_SEGMENTS),)}

# NVFP4: rows are weight rows (outputs). K = 4688: K16 = 293 = four whole sweeps of 64 virtual
# lanes and a tail of 37. Batch sizes cross the base kernel's 4 outputs a block and the
# single-warp kernel's 8: 1, 3 (one partial block), 4 (one whole base block), 5, 8 (one whole SW
# block), 9, 12, 13, 17 (a third SW block of 1).
NV_N, NV_K, NV_SEED = 2048, 4688, 5
NV_ROWS, NV_FILLERS = (0, 3, 5, 9), tuple(range(10, 25))
NV_BATCH_SIZES = (1, 3, 4, 5, 8, 9, 12, 13, 17)
NV_ARMS = {"base": False, "single-warp": True}

# lm_head: 8 tokens over V = 17317 (271 partials a row: two passes of the reduce kernel, a
# partial last block), H = 264, softcap 30, one excluded id (in the second shard below). The
# vocabulary in two shards cut at row 8001 = 125 * 64 + 1: every row of the second shard sits
# one place earlier in its block and warp than in one launch.
LM_T, LM_V, LM_H, LM_SEED, LM_EXCLUDED = 8, 64 * 270 + 37, 264, 4, 9000
LM_ROWS, LM_FILLERS = (0, 1, 2), tuple(range(3, LM_T))
LM_BATCH_SIZES = (1, 2, 3, 5, 8)
LM_SHARD_CUT = 8001
LM_VARIANTS = {"launcher's scratch": {}, "caller's scratch": {"scratch_fill": SCRATCH_FILLS[0]},
               f"two vocabulary shards cut at {LM_SHARD_CUT}": {"shards": (0, LM_SHARD_CUT)}}


@host_cache
def fp8_inputs():
    assert FP8_T > 2 * fp8_gemv.TOKENS_PER_BLOCK and FP8_T % fp8_gemv.TOKENS_PER_BLOCK, \
        "the batch of every token must end in a partial tile after two whole ones"
    return fp8_outlier_case(FP8_T, FP8_K, sum(FP8_SEGMENTS), FP8_SEED)


@host_cache
def nvfp4_inputs():
    assert NV_K // nvfp4_gemv.GROUP % 64 and max(NV_BATCH_SIZES) > 2 * nvfp4_gemv.N_PER_BLOCK_SW, \
        "the design needs a K tail and a batch past two single-warp blocks"
    return nvfp4_outlier_case(NV_N, NV_K, NV_SEED)


@host_cache
def lm_head_inputs():
    return lm_head_outlier_case(LM_T, LM_V, LM_H, LM_SEED)


@pytest.fixture(scope="module")
def fp8_dev():
    return fp8_inputs_to_device(fp8_inputs())


@pytest.fixture(scope="module")
def nvfp4_dev():
    return nvfp4_to_device(nvfp4_inputs())


@pytest.fixture(scope="module")
def lm_head_dev():
    return lm_head_to_device(lm_head_inputs())


@pytest.mark.gpu
@pytest.mark.invariance
def test_an_fp8_token_has_its_bits_in_every_batch_tile_place_and_segment_split(fp8_dev):
    # Each token's f32 sums are its own (one accumulator a token, the same chunks a lane, the
    # same warp tree): the tile only interleaves other tokens' independent sums. So a token
    # alone (T = 1, a partial tile of 1) has the bits it has in every batch of 1..9, first,
    # second, middle, last but one or last: in a whole tile, in a partial one, in tile 0, 1 or
    # 2; and with the rows given as three segments or one. Launched eagerly and replayed from a
    # CUDA graph captured once a split and batch size (an engine decodes under graphs).
    replay = GraphReplay("fp8_gemv y")

    def run(ids, variant):
        segments, mode = variant
        return run_fp8_gemv_tokens(fp8_dev, ids, segments, mode=mode, replay=replay)

    assert_batch_invariant("fp8_gemv y", run, FP8_ROWS, batch_sizes=FP8_BATCH_SIZES, positions=POSITIONS,
                           variants=eager_and_graph(FP8_VARIANTS), fillers=FP8_FILLERS)
    assert replay.replays > replay.captures > 0, (replay.captures, replay.replays)


@pytest.mark.gpu
@pytest.mark.determinism
def test_fp8_gemv_gives_the_same_bits_on_every_repeat(fp8_dev):
    # All 9 tokens (three tiles, the last partial), 20 repeats a segment split, on the current
    # stream and on fresh ones, the output prefilled with other bits each repeat (an output left
    # unwritten differs between repeats).
    replay = GraphReplay("fp8_gemv y")

    def run(repeat, variant):
        segments, mode = variant
        return run_fp8_gemv_tokens(fp8_dev, range(FP8_T), segments, fill=BF16_FILLS[repeat % len(BF16_FILLS)],
                                   mode=mode, replay=replay)

    assert_deterministic("fp8_gemv y", run, repeats=20, variants=eager_and_graph(FP8_VARIANTS))
    assert replay.replays > replay.captures > 0, (replay.captures, replay.replays)


@pytest.mark.gpu
@pytest.mark.invariance
def test_an_nvfp4_output_has_its_bits_in_every_row_set_place_and_arm(nvfp4_dev):
    # An output's 64 virtual-lane partials, two warp trees and one sum of the halves do not
    # depend on N or on the output's place (which block, which of its 4 or 8 slots, a partial
    # last block), and the arms must agree bit for bit (the link): an engine picks the arm by
    # shape, so an output must not change with it. Each row alone in the base arm is the
    # reference for every batch of rows in both arms, eager and replayed from a CUDA graph.
    replay = GraphReplay("nvfp4_gemv y")

    def run(ids, variant):
        single_warp, mode = variant
        return run_nvfp4_rows(nvfp4_dev, ids, single_warp=single_warp, mode=mode, replay=replay)

    assert_batch_invariant("nvfp4_gemv y", run, NV_ROWS, batch_sizes=NV_BATCH_SIZES, positions=POSITIONS,
                           variants=eager_and_graph(NV_ARMS), fillers=NV_FILLERS)
    assert replay.replays > replay.captures > 0, (replay.captures, replay.replays)


@pytest.mark.gpu
@pytest.mark.determinism
def test_nvfp4_gemv_gives_the_same_bits_on_every_repeat(nvfp4_dev):
    # 2048 outputs (512 base blocks, 256 single-warp ones), 30 repeats an arm, the output
    # prefilled with other bits each repeat. On these inputs a change in the order the 64
    # partials of an output meet moves most outputs' bits (an atomicAdd in place of the
    # ordered sums would move them from run to run).
    replay = GraphReplay("nvfp4_gemv y")

    def run(repeat, variant):
        single_warp, mode = variant
        return run_nvfp4_rows(nvfp4_dev, range(NV_N), single_warp=single_warp,
                              fill=BF16_FILLS[repeat % len(BF16_FILLS)], mode=mode, replay=replay)

    assert_deterministic("nvfp4_gemv y", run, repeats=30, variants=eager_and_graph(NV_ARMS))
    assert replay.replays > replay.captures > 0, (replay.captures, replay.replays)


@pytest.mark.gpu
@pytest.mark.invariance
def test_an_lm_head_token_has_its_answer_in_every_batch_scratch_and_vocabulary_split(lm_head_dev):
    # A logit is one warp's dot in a fixed order, wherever its row sits in a block, and the
    # argmax is exact (comparisons, ties to the lowest index), so a token's (index, value)
    # does not depend on the batch (the partial grid's T), on whose scratch holds the block
    # partials, or on the vocabulary cut into shards whose answers meet by the same rule.
    def run(ids, variant):
        return run_lm_head_tokens(lm_head_dev, ids, excluded=LM_EXCLUDED, **variant)

    assert_batch_invariant("lm_head_argmax [index, value]", run, LM_ROWS, batch_sizes=LM_BATCH_SIZES,
                           variants=LM_VARIANTS, fillers=LM_FILLERS)


@pytest.mark.gpu
@pytest.mark.determinism
def test_lm_head_gives_the_same_answer_on_every_repeat(lm_head_dev):
    # 8 tokens, 20 repeats with the launcher's scratch and 20 with a caller's, whose every slot
    # starts as another partial each repeat (+inf, NaN, -inf, 0): a reduce that read a slot the
    # partial kernel did not write would answer differently.
    variants = {"launcher's scratch": False, "caller's scratch": True}

    def run(repeat, callers):
        fill = SCRATCH_FILLS[repeat % len(SCRATCH_FILLS)] if callers else None
        return run_lm_head_tokens(lm_head_dev, range(LM_T), excluded=LM_EXCLUDED, scratch_fill=fill)

    assert_deterministic("lm_head_argmax [index, value]", run, repeats=20, variants=variants)

