"""FP8 GEMV with per-token and per-row scales, segments concatenated along N: analytic anchors."""

from __future__ import annotations

import numpy as np
import pytest

from gates._quant_gemv import run_fp8_gemv
from harness import assert_bits_eq
from kernels_cu import fp8_gemv
from oracles.quant_gemv import fp8_gemv_case


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
