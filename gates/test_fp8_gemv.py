"""FP8 GEMV with per-token and per-row scales, segments concatenated along N: analytic anchors."""

from __future__ import annotations

import numpy as np
import pytest

from gates._quant_gemv import (SENTINEL, run_fp8_gemv, run_fp8_gemv_far_rows, run_fp8_gemv_fenced,
                               run_fp8_gemv_with_tail, shaped)
from harness import assert_bits_eq
from harness.library.buffers import INDEX_32, assert_untouched, device_memory
from harness.library.sweep import Dim, Preset, ShapeSpace, assert_named_shapes_accepted, sweep
from kernels_cu import fp8_gemv
from oracles.quant_gemv import fp8_chunk_sums, fp8_gemv_case, fp8_gemv_positional_case

# The position-dependent anchor's shape: K = 592 is 37 chunks of
# 16 (lanes 0-4 take two, the rest one); N = 25 = 13 + 7 + 5 rows is no multiple of the 8
# rows a block (the last block has one live warp) and the segment edges fall inside blocks.
POS_T, POS_K, POS_SEGMENTS, POS_SEED, POS_TOKEN_SCALES = 3, 592, (13, 7, 5), 3, (0.5, 2.0, 0.25)

# Two tiles of tokens: a whole one of FP8_GEMV_TOKENS_PER_BLOCK = 4 (blockIdx.y = 0) and a
# partial one of 2 (blockIdx.y = 1). Every other gate's T is at most 4: one tile, starting at token 0.
TILES_T, TILES_SEED, TILES_TOKEN_SCALES = 6, 7, (0.5, 2.0, 0.25, 4.0, 1.0, 0.125)

# The decode-shaped anchor: a fused QKV projection of a model 8192 wide (64 query heads and 8
# KV heads of 128) for a decode step of 4 tokens. Its 10240 x 8192 e4m3 weights (84 MB) do not
# fit the H200's 50 MB L2, so every pass over them streams from HBM and the launch time
# follows the weight bytes read; the other gates' shapes fit in L2 and launch too briefly for a
# change of speed to show. Still exact: 9 K stays below 2^24 units of 1/64 (K < ~29000).
DECODE_T, DECODE_K, DECODE_SEGMENTS, DECODE_SEED = 4, 8192, (8192, 1024, 1024), 5
DECODE_TOKEN_SCALES = (0.5, 2.0, 0.25, 4.0)


@pytest.mark.gpu
@pytest.mark.anchor
def test_fp8_gemv_of_ones_is_k_times_the_row_constant():
    # The contract's anchor: x = 1.0, rows constant 1.0 / 2.0 / 0.5, unit scales.
    # Exact: every product is 1, 2 or 0.5 and K * 2 < 2^24, so y = K * w_n with no rounding.
    case = fp8_gemv_case(t=3, k=256, segment_rows=(64,), segment_scales=(1.0,), token_scales=(1.0, 1.0, 1.0))
    assert_bits_eq("fp8_gemv y", run_fp8_gemv(case), case.expected)


@pytest.mark.gpu
@pytest.mark.anchor
def test_fp8_gemv_concatenates_segments_with_row_and_token_scales():
    # Fused Q / K / V: three segments of 32, 16 and 16 rows, each with its own row scale,
    # and a different scale for each token. Powers of two keep y = K * w_n * ws[n] * xs[t] exact.
    case = fp8_gemv_case(t=3, k=1024, segment_rows=(32, 16, 16), segment_scales=(1.0, 2.0, 0.25),
                         token_scales=(0.5, 1.0, 4.0))
    assert_bits_eq("fp8_gemv y (segments along N)", run_fp8_gemv(case), case.expected)


@pytest.mark.gpu
@pytest.mark.anchor
def test_fp8_gemv_pairs_every_element_of_every_token_and_segment_row():
    # x and every weight row drawn from {+-0.5, +-0.75, +-1, +-1.5, +-2, +-3}, distinct per token
    # and per row of each segment; row scales vary along N, token scales per token (powers of
    # two). Exact: products are multiples of 1/16 and every f32 partial sum is exact in any
    # order, so ws * xs * dot is an exactly known f32 and y is its one bf16 rounding (nearest
    # even; 50 of the 75 outputs round, 15 of them ties). A mispaired element, a chunk read by
    # the wrong lane, dropped or doubled, another token's x, another segment's weights or
    # scales, a rounding toward zero, or a write past N (into the sentinel tail) changes the bits.
    case = fp8_gemv_positional_case(POS_T, POS_K, POS_SEGMENTS, POS_SEED, POS_TOKEN_SCALES)
    assert (fp8_chunk_sums(case) != 0).any(axis=(0, 1)).all(), "a chunk contributes nothing anywhere"
    y, tail = run_fp8_gemv_with_tail(case)
    assert_bits_eq("fp8_gemv y (position-dependent x and rows, N = 25, 37 chunks)", y, case.expected)
    assert_untouched("fp8_gemv past y[T - 1, N - 1]", tail, SENTINEL)


@pytest.mark.gpu
@pytest.mark.anchor
def test_fp8_gemv_pairs_every_token_of_a_whole_and_a_partial_tile():
    # The position-dependent design above (K = 592, N = 25) for six tokens, each its own x and
    # power-of-two scale, in two tiles. A tile that starts at the wrong token, reads another
    # tile's activations or scales, writes another tile's rows, or computes the tokens past T
    # in its partial tile (their rows land in the sentinel tail) changes the bits.
    assert TILES_T // fp8_gemv.TOKENS_PER_BLOCK == 1 and TILES_T % fp8_gemv.TOKENS_PER_BLOCK, \
        "the design needs one whole tile of tokens and one partial tile"
    case = fp8_gemv_positional_case(TILES_T, POS_K, POS_SEGMENTS, TILES_SEED, TILES_TOKEN_SCALES)
    y, tail = run_fp8_gemv_with_tail(case)
    assert_bits_eq("fp8_gemv y (two tiles of tokens, 4 + 2; N = 25)", y, case.expected)
    assert_untouched("fp8_gemv past y[T - 1, N - 1]", tail, SENTINEL)


@pytest.mark.memory_safety
@pytest.mark.gpu
@pytest.mark.anchor
def test_fp8_gemv_reads_nothing_outside_its_inputs():
    # Memory safety: every read stays inside x, xs and each segment's rows and row scales.
    # The position-dependent design again, each input now a view between e4m3 / f32 NaN
    # fences a whole buffer long (gates/_quant_gemv.py): a read up to a buffer before or past
    # an input (a token's or a row's offset negated, a chunk walking back, a row or a token
    # too far) puts a NaN into a dot, and y differs by assertion. A read further away faults:
    # this gate's verdict too (docs/mutation.md, Verdicts).
    case = fp8_gemv_positional_case(POS_T, POS_K, POS_SEGMENTS, POS_SEED, POS_TOKEN_SCALES)
    y, tail = run_fp8_gemv_fenced(case)
    assert_bits_eq("fp8_gemv y (inputs between NaN fences)", y, case.expected)
    assert_untouched("fp8_gemv past y[T - 1, N - 1]", tail, SENTINEL)


@pytest.mark.gpu
@pytest.mark.anchor
def test_fp8_gemv_at_a_decode_shape_pairs_every_element():
    # The position-dependent design at the decode shape above: every token its own x, every
    # row of every segment its own weights, row scales along N and a power-of-two scale a
    # token, so the expected bits are exact (38727 of the 40960 outputs round, 1575 of them
    # ties). Builds in well under a second on the host (the weights are drawn as codes).
    case = fp8_gemv_positional_case(DECODE_T, DECODE_K, DECODE_SEGMENTS, DECODE_SEED, DECODE_TOKEN_SCALES)
    assert_bits_eq("fp8_gemv y (decode shape: T = 4, K = 8192, N = 8192 + 1024 + 1024)", run_fp8_gemv(case),
                   case.expected)


def _args(t=2, k=64, rows=(8,)):
    x = np.empty((t, k), np.uint8)
    segments = [(np.empty((n, k), np.uint8), np.empty(n, np.float32)) for n in rows]
    y = np.empty((t, sum(rows)), np.uint16)
    return y, x, np.empty(t, np.float32), segments


@pytest.mark.refusal
def test_k_not_a_multiple_of_16_is_refused_before_launch():
    y, _, xs, _ = _args()
    with pytest.raises(ValueError, match="K=40 is not a multiple of 16"):
        fp8_gemv.check_fp8_gemv_args(y, np.empty((2, 40), np.uint8), xs, [(np.empty((8, 40), np.uint8), np.empty(8, np.float32))])


@pytest.mark.refusal
def test_more_than_three_segments_are_refused_before_launch():
    with pytest.raises(ValueError, match="got 4 weight segments, expected 1 to 3"):
        fp8_gemv.check_fp8_gemv_args(*_args(rows=(8, 8, 8, 8)))


@pytest.mark.refusal
def test_an_output_narrower_than_the_segments_is_refused_before_launch():
    y, x, xs, segments = _args(rows=(8, 4))
    with pytest.raises(ValueError, match=r"y has shape \(2, 8\), expected \(2, 12\)"):
        fp8_gemv.check_fp8_gemv_args(y[:, :8], x, xs, segments)


# The sweep: the kernel over its shapes. K is swept 16 bytes a lane, 32 lanes a step (512 a
# warp's pass): its multiples are the passes with no tail, one chunk either side a tail of one
# chunk. T crosses the tiles of FP8_GEMV_TOKENS_PER_BLOCK tokens (its tile: a whole tile, one
# token either side); N crosses the blocks of 8 rows by its powers of two (a whole block, several)
# and by the drawn values (a partial last block; a tile for N would add some 190 boundaries of
# little more worth). The bound keeps the host oracle's dot products
# (T * K * N of them) quick, and K keeps the positional design exact (9 K below 2^24 units of
# 1/64).
FP8_PASS = 32 * fp8_gemv.BYTES_PER_LANE
FP8_SHAPES = ShapeSpace(
    "fp8_gemv",
    (Dim("T", 1, 9, tile=fp8_gemv.TOKENS_PER_BLOCK),
     Dim("K", 16, 28672, multiple_of=fp8_gemv.BYTES_PER_LANE, tile=FP8_PASS), Dim("N", 1, 4096)),
    where=(("the host oracle's T * K * N at most 2^24", lambda s: s["T"] * s["K"] * s["N"] <= 1 << 24),),
    presets=(
        Preset("Llama-3 8B decode, q_proj", {"T": 1, "K": 4096, "N": 4096},
               "Llama-3-8B config.json: hidden_size 4096 (32 heads of 128)"),
        Preset("Llama-3 8B decode, k_proj", {"T": 1, "K": 4096, "N": 1024},
               "Llama-3-8B config.json: 8 key-value heads of 128"),
        Preset("Qwen2.5 7B decode batch of 4, k_proj", {"T": 4, "K": 3584, "N": 512},
               "Qwen2.5-7B config.json: hidden_size 3584, 4 key-value heads of 128"),
    ),
)


def fp8_gemv_shape_check(shape):
    t, k, n = shape["T"], shape["K"], shape["N"]
    scales = tuple(2.0 ** ((i % 5) - 2) for i in range(t))  # powers of two: exact
    case = fp8_gemv_positional_case(t, k, (n,), seed=t * 31 + k + n, token_scales=scales)
    assert_bits_eq(f"fp8_gemv y (T={t}, K={k}, N={n})", run_fp8_gemv(case), case.expected)


@pytest.mark.gpu
@pytest.mark.sweep
def test_fp8_gemv_matches_the_positional_design_over_its_shape_space():
    sweep(FP8_SHAPES, fp8_gemv_shape_check)


@pytest.mark.structural
def test_every_preset_and_boundary_of_the_fp8_shape_space_is_a_shape_the_launcher_accepts():
    # The space promises shapes the kernel runs: one the launcher refuses is a space declared wrong.
    # So is the big-index gate's shape.
    def accepted(shape):
        t, k, n = shape["T"], shape["K"], shape["N"]
        y, x, xs = shaped((t, n), np.uint16), shaped((t, k), np.uint8), shaped((t,), np.float32)
        segments = [(shaped((n, k), np.uint8), shaped((n,), np.float32))]
        assert fp8_gemv.check_fp8_gemv_args(y, x, xs, segments) == (t, k, n)

    assert_named_shapes_accepted(FP8_SHAPES, accepted,
                                 extra={"the big-index gate's shape": {"T": BIG_T, "K": BIG_K, "N": BIG_N}})


# Past 2^31 weight bytes: one segment of N = 2^18 + 64 rows of K = 8192 (Llama-3 70B's
# hidden_size), so row * K passes 2^31 at row 2^18 and the last 64 rows (8 blocks) lie past it.
# Only the last BIG_LIVE rows are data: 8 before the boundary, 64 past it. The kernel computes
# every row; the gate reads the live rows' outputs.
BIG_K = 8192
BIG_PAST = 8 * fp8_gemv.ROWS_PER_BLOCK  # rows past 2^31 bytes
BIG_N = INDEX_32 // BIG_K + BIG_PAST
BIG_LIVE = BIG_PAST + fp8_gemv.ROWS_PER_BLOCK
BIG_T, BIG_SEED, BIG_TOKEN_SCALES = 2, 17, (0.5, 2.0)
# The weights sit 2^31 bytes into their allocation (run_fp8_gemv_far_rows), so the whole is
# 2^31 + N * K bytes, plus the row scales and y.
BIG_BYTES = INDEX_32 + BIG_N * BIG_K + 4 * BIG_N + 2 * BIG_T * BIG_N


@pytest.mark.memory_safety
@pytest.mark.gpu
@pytest.mark.anchor
def test_fp8_gemv_rows_past_2_31_weight_bytes_match_the_positional_design():
    # The kernel takes int sizes: a row offset `row * K` in 32 bits wraps past 2^31 to
    # row * K - 2^32 (negative). The weights start 2^31 bytes into their allocation, whose
    # first rows hold decoys (the same design, another seed), so a wrapped row reads decoy
    # row - 2^18 and its outputs differ by assertion, not by a fault. The positional design
    # (every token and row its own values, power-of-two scales) keeps the expected bits exact.
    # memory_safety: a wrap that lands off the allocation faults, and that is this gate's verdict.
    case = fp8_gemv_positional_case(BIG_T, BIG_K, (BIG_LIVE,), BIG_SEED, BIG_TOKEN_SCALES)
    decoys = fp8_gemv_positional_case(BIG_T, BIG_K, (BIG_PAST,), BIG_SEED + 1, BIG_TOKEN_SCALES).segments[0][0]
    with device_memory(BIG_BYTES, f"FP8 weights past 2^31 bytes ({BIG_N} rows of K = {BIG_K})"):
        y = run_fp8_gemv_far_rows(case, decoys, BIG_N)
    assert_bits_eq(f"fp8_gemv y of rows {BIG_N - BIG_LIVE}..{BIG_N - 1} (rows from {BIG_N - BIG_PAST} start past "
                   "2^31 weight bytes)", y, case.expected)
