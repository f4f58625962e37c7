"""lm_head argmax with soft-capping and an excluded id: analytic anchors."""

from __future__ import annotations

import numpy as np
import pytest

from gates._quant_gemv import run_lm_head
from harness import assert_bits_eq, assert_close
from kernels_cu import lm_head
from oracles.quant_gemv import LM_HEAD_HOT_ROW, TANHF_ULP_BOUND, capped, lm_head_case

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
