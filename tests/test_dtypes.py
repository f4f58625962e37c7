import numpy as np
import pytest

from harness.library import dtypes


def test_bf16_rounds_to_nearest_even():
    # 1 + 2^-8 is halfway between bf16 neighbours 1 and 1 + 2^-7: ties go to even (1.0).
    assert dtypes.bits_of(dtypes.to_bf16([1 + 2**-8]))[0] == 0x3F80
    assert dtypes.bits_of(dtypes.to_bf16([1 + 3 * 2**-8]))[0] == 0x3F82


def test_fp8_saturating_conversion_clamps_like_satfinite():
    out = dtypes.to_fp8_e4m3_saturating([1000.0, -1e9, np.inf, np.nan, 3.3])
    assert out.astype(np.float32)[:3].tolist() == [448.0, -448.0, 448.0]
    assert np.isnan(out.astype(np.float32)[3])
    assert out.astype(np.float32)[4] == 3.25
    assert np.isnan(dtypes.to_fp8_e4m3([1000.0]).astype(np.float32)[0])  # ml_dtypes' own: NaN


def test_e4m3_decode():
    assert dtypes.decode_e4m3([0x38, 0x40, 0x7E, 0xB8]).tolist() == [1.0, 2.0, 448.0, -1.0]


def test_fp4_packs_two_per_byte_low_nibble_first_and_round_trips():
    values = [0.5, 6.0, 1.0, -1.0, 0.0, 3.0]
    packed = dtypes.pack_fp4(values)
    assert packed.tolist() == [0x71, 0xA2, 0x50]
    assert dtypes.unpack_fp4(packed).tolist() == values
    assert dtypes.unpack_fp4(packed, 3).tolist() == values[:3]


def test_fp4_refuses_an_odd_length_and_bad_codes():
    with pytest.raises(ValueError, match="even last axis"):
        dtypes.pack_fp4([1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="4-bit codes"):
        dtypes.decode_e2m1([16])
