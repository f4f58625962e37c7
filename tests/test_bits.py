"""The exact text of harness.library.bits messages, line by line."""

import numpy as np
import pytest

from harness import BitsMismatch, NotClose, assert_bits_eq, assert_close, rel_rms
from harness.library.dtypes import bf16, fp8_e4m3, to_bf16


def message(fn, *args, **kw) -> list[str]:
    with pytest.raises(AssertionError) as info:
        fn(*args, **kw)
    return str(info.value).splitlines()


def test_equal_bits_pass_for_numpy_arrays():
    a = to_bf16(np.arange(12, dtype=np.float32).reshape(3, 4))
    assert_bits_eq("q", a, a.copy())


def test_a_bf16_mismatch_names_label_index_bits_values_count_and_a_table():
    expected = to_bf16(np.arange(24, dtype=np.float32).reshape(2, 3, 4))
    got = expected.copy()
    got[0, 0, 1] = 7
    got[1, 2, 3] = 0
    assert message(assert_bits_eq, "pool", got, expected) == [
        "pool: 2 of 24 elements differ bitwise (bfloat16)",
        "first difference at flat index 1, index [0, 0, 1]:",
        "  got      0x40e0  7.0",
        "  expected 0x3f80  1.0",
        "first 2 differences:",
        "  flat  index      got     value  expected  value",
        "  1     [0, 0, 1]  0x40e0  7.0    0x3f80    1.0",
        "  23    [1, 2, 3]  0x0000  0.0    0x41b8    23.0",
    ]


def test_plus_zero_and_minus_zero_differ():
    lines = message(assert_bits_eq, "out", np.asarray([0.0], np.float32), np.asarray([-0.0], np.float32))
    assert lines[0] == "out: 1 of 1 elements differ bitwise (float32)"
    assert lines[2:4] == ["  got      0x00000000  0.0", "  expected 0x80000000  -0.0"]


def test_nan_payloads_differ():
    a = np.asarray([0x7FC00000], np.uint32).view(np.float32)
    b = np.asarray([0x7FC00001], np.uint32).view(np.float32)
    lines = message(assert_bits_eq, "nan", a, b)
    assert lines[2:4] == ["  got      0x7fc00000  nan", "  expected 0x7fc00001  nan"]


def test_fp8_values_are_decoded_through_ml_dtypes():
    got = np.asarray([0x38], np.uint8).view(fp8_e4m3)  # 1.0
    expected = np.asarray([0x40], np.uint8).view(fp8_e4m3)  # 2.0
    lines = message(assert_bits_eq, "w", got, expected)
    assert lines[0] == "w: 1 of 1 elements differ bitwise (float8_e4m3fn)"
    assert lines[2:4] == ["  got      0x38  1.0", "  expected 0x40  2.0"]


def test_raw_bits_can_be_shown_as_a_declared_dtype():
    got = np.asarray([0x3F80], np.uint16)
    expected = np.asarray([0x4000], np.uint16)
    lines = message(assert_bits_eq, "k", got, expected, dtype=bf16)
    assert lines[2:4] == ["  got      0x3f80  1.0", "  expected 0x4000  2.0"]


def test_a_shape_mismatch_has_its_own_short_message():
    assert message(assert_bits_eq, "q", np.zeros((2, 3), np.float32), np.zeros((3, 2), np.float32)) == [
        "q: shapes differ: got (2, 3), expected (3, 2)"
    ]


def test_an_item_size_mismatch_has_its_own_short_message_naming_the_fix():
    assert message(assert_bits_eq, "q", np.zeros(3, np.float32), to_bf16(np.zeros(3))) == [
        "q: item sizes differ: got float32 (4 bytes), expected bfloat16 (2 bytes); "
        "compare arrays of one dtype (cast or .view() one side first)"
    ]


def test_the_table_stops_after_eight_rows_and_counts_the_rest():
    got = np.arange(100, dtype=np.int32)
    lines = message(assert_bits_eq, "ids", got, np.zeros(100, np.int32))
    assert lines[0] == "ids: 99 of 100 elements differ bitwise (int32)"
    assert lines[-1] == "  ... and 91 more"
    assert len(lines) == 5 + 1 + 8 + 1


def test_bits_mismatch_is_an_assertion_error():
    assert issubclass(BitsMismatch, AssertionError)


def test_assert_close_reports_first_and_worst_element():
    expected = np.asarray([1.0, 2.0, 3.0, 4.0])
    got = np.asarray([1.0, 2.5, 3.0, 5.0])
    assert message(assert_close, "y", got, expected, atol=0.1, rtol=0.0) == [
        "y: 2 of 4 elements differ by more than atol=0.1 + rtol=0 * |expected|",
        "  first at flat index 1, index [1]: got 2.5, expected 2.0, |diff| 0.5",
        "  worst at flat index 3, index [3]: got 5.0, expected 4.0, |diff| 1.0",
    ]
    assert issubclass(NotClose, AssertionError)


def test_assert_close_never_calls_nan_close():
    with pytest.raises(NotClose):
        assert_close("y", np.asarray([np.nan]), np.asarray([np.nan]), atol=1.0, rtol=1.0)


def test_rel_rms():
    assert rel_rms(np.asarray([1.0, 1.0]), np.asarray([1.0, 1.0])) == 0.0
    assert rel_rms(np.asarray([2.0, 0.0]), np.asarray([1.0, 1.0])) == pytest.approx(1.0)
