"""oracles.quant_gemv: the anchors' designed inputs keep their exactness promises (no GPU)."""

from __future__ import annotations

import numpy as np
import pytest

from harness.dtypes import bits_of, decode_e4m3, unpack_fp4
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
