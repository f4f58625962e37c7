"""Comparisons of torch tensors and DLPack producers, read by their bits with no GPU: torch
CPU tensors of every dtype the harness knows, and objects that expose only the DLPack
protocol (made by NumPy, and by torch for the dtypes NumPy's DLPack refuses), mixed with
NumPy on the other side. Bad input is one line naming the fix."""

import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

from harness import BitsMismatch, assert_bits_eq, assert_close, rel_rms
from harness.library.dtypes import bf16, bits_of, fp8_e4m3
from harness.library.tensors import TorchOnlyDtype, UnknownDtype, is_torch
from tests._machine import child_env

VALUES = np.array([[0.0, -0.0, 1.0, -1.5], [0.25, 448.0, -2.0, 3.0], [0.5, 6.0, -4.0, 0.75]], np.float32)

# (torch dtype name, the NumPy dtype its bits are read as)
FLOAT_DTYPES = [
    ("bfloat16", bf16),
    ("float16", np.dtype(np.float16)),
    ("float32", np.dtype(np.float32)),
    ("float8_e4m3fn", fp8_e4m3),
    ("float8_e5m2", np.dtype(ml_dtypes.float8_e5m2)),
]


class Producer:
    """Only the DLPack protocol of an array: neither NumPy, CuPy nor torch to the harness."""

    def __init__(self, array):
        self.array = array

    def __dlpack__(self, **kwargs):
        return self.array.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self.array.__dlpack_device__()


def lines(fn, *args, **kw) -> list[str]:
    with pytest.raises(AssertionError) as info:
        fn(*args, **kw)
    return str(info.value).splitlines()


@pytest.mark.parametrize("name,dtype", FLOAT_DTYPES, ids=[n for n, _ in FLOAT_DTYPES])
def test_a_torch_cpu_tensor_has_the_bits_of_the_numpy_array_of_the_same_values(torch, name, dtype):
    t = torch.tensor(VALUES).to(getattr(torch, name))
    expected = VALUES.astype(dtype)
    assert np.array_equal(bits_of(t), bits_of(expected))
    assert_bits_eq("x", t, expected)
    assert_bits_eq("x", expected, t)
    assert_bits_eq("x", t, t.clone())


def test_packed_fp4_is_compared_as_its_bytes_as_torch_uint8_or_float4_e2m1fn_x2(torch):
    packed = np.arange(12, dtype=np.uint8).reshape(3, 4) * 17
    as_uint8 = torch.from_numpy(packed.copy())
    as_x2 = as_uint8.view(torch.float4_e2m1fn_x2)
    assert_bits_eq("w", as_uint8, packed)
    assert_bits_eq("w", as_x2, packed)
    assert bits_of(as_x2).dtype == np.uint8
    changed = packed.copy()
    changed[2, 3] ^= 0x10
    assert lines(assert_bits_eq, "w", as_x2, changed)[0] == "w: 1 of 12 elements differ bitwise (uint8)"


def test_a_bf16_tensor_mismatch_shows_bits_and_values_through_ml_dtypes(torch):
    t = torch.tensor([1.0, -0.0, 3.5]).to(torch.bfloat16)
    assert lines(assert_bits_eq, "out", t, np.array([1.0, 0.0, 3.5], np.float32).astype(bf16)) == [
        "out: 1 of 3 elements differ bitwise (bfloat16)",
        "first difference at flat index 1, index [1]:",
        "  got      0x8000  -0.0",
        "  expected 0x0000  0.0",
        "first 1 differences:",
        "  flat  index  got     value  expected  value",
        "  1     [1]    0x8000  -0.0   0x0000    0.0",
    ]


def test_an_fp8_nan_payload_is_kept_no_float_round_trip(torch):
    raw = np.array([0x7F, 0xFF, 0x01], np.uint8)  # e4m3fn NaN, -NaN, the smallest subnormal
    t = torch.from_numpy(raw.copy()).view(torch.float8_e4m3fn)
    assert np.array_equal(bits_of(t), raw)
    with pytest.raises(BitsMismatch):
        assert_bits_eq("q", t, np.array([0x7F, 0x7F, 0x01], np.uint8).view(fp8_e4m3))


def test_strided_and_grad_tensors_are_read_by_logical_index(torch):
    t = torch.tensor(VALUES, requires_grad=True)
    assert_bits_eq("x", t.t(), VALUES.T)
    assert_bits_eq("x", t[:, ::2], VALUES[:, ::2])


def test_the_display_dtype_may_be_a_torch_dtype(torch):
    raw = torch.tensor([0x3F80, 0x4000], dtype=torch.int16)
    got = lines(assert_bits_eq, "b", raw, np.array([0x3F80, 0x4040], np.int16), dtype=torch.bfloat16)
    assert got[0] == "b: 1 of 2 elements differ bitwise (bfloat16)"
    assert got[2] == "  got      0x4000  2.0"


def test_assert_close_and_rel_rms_read_torch_values(torch):
    t = torch.tensor(VALUES).to(torch.bfloat16)
    assert_close("x", t, VALUES, atol=0.0, rtol=2.0**-8)
    assert rel_rms(t, VALUES) < 2.0**-8
    with pytest.raises(AssertionError, match="differ by more than"):
        assert_close("x", t, VALUES + 1, atol=0.0, rtol=0.0)


@pytest.mark.parametrize("name,dtype", FLOAT_DTYPES, ids=[n for n, _ in FLOAT_DTYPES])
def test_a_torch_made_dlpack_producer_is_read_by_its_bits(torch, name, dtype):
    t = torch.tensor(VALUES).to(getattr(torch, name))
    expected = VALUES.astype(dtype)
    assert_bits_eq("x", Producer(t), expected)
    assert_bits_eq("x", Producer(t.t()), expected.T)  # strides from the DLTensor


def test_a_torch_made_dlpack_producer_of_packed_fp4_is_read_as_bytes(torch):
    packed = (np.arange(8, dtype=np.uint8) * 31).reshape(2, 4)
    t = torch.from_numpy(packed.copy()).view(torch.float4_e2m1fn_x2)
    assert_bits_eq("w", Producer(t), packed)
    with pytest.raises(TorchOnlyDtype, match="packed fp4"):
        assert_close("w", Producer(t), packed, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.uint8, np.uint16, np.int32],
                         ids=lambda d: np.dtype(d).name)
def test_a_numpy_made_dlpack_producer_is_read_with_no_torch_and_no_cupy(dtype):
    a = (np.arange(12).reshape(3, 4) * 3).astype(dtype)
    assert_bits_eq("x", Producer(a), a)
    assert_bits_eq("x", Producer(a.T), a.T)
    with pytest.raises(BitsMismatch):
        assert_bits_eq("x", Producer(a), a + 1)


@pytest.mark.parametrize("name,dtype", [("bf16 bits", bf16), ("fp8 e4m3 bits", fp8_e4m3),
                                        ("packed fp4 bytes", np.dtype(np.uint8))])
def test_numpy_dlpack_carries_the_narrow_dtypes_as_their_integer_bits(name, dtype):
    values = VALUES if dtype != np.uint8 else np.arange(12).reshape(3, 4)
    host = values.astype(dtype)
    bits = bits_of(host)
    assert_bits_eq(name, Producer(bits), host)  # item sizes agree: compared as bits, shown as `expected`'s dtype


def test_a_zero_size_tensor_compares(torch):
    assert_bits_eq("e", torch.zeros((0, 4), dtype=torch.bfloat16), np.zeros((0, 4), bf16))


def test_an_unknown_torch_dtype_is_one_line_naming_the_integer_view(torch):
    with pytest.raises(UnknownDtype) as info:
        assert_bits_eq("c", torch.zeros(2, dtype=torch.complex64), np.zeros(2, np.uint64))
    text = str(info.value)
    assert "\n" not in text
    assert text.startswith("c: got is a torch.complex64 tensor, a dtype the harness does not know")
    assert text.endswith("compare its raw bits through t.view(torch.int64)")


def test_a_torch_only_dtype_where_numpy_values_are_needed_is_one_line(torch):
    t = torch.zeros(3, dtype=torch.uint8).view(torch.float4_e2m1fn_x2)
    for call in (lambda: assert_close("w", t, np.zeros(3, np.uint8), atol=0, rtol=0),
                 lambda: rel_rms(t, np.zeros(3, np.uint8))):
        with pytest.raises(TorchOnlyDtype) as info:
            call()
        assert "\n" not in str(info.value)
        assert "torch.float4_e2m1fn_x2 tensor (two fp4 e2m1 values a byte" in str(info.value)
        assert "unpack_fp4(t.view(torch.uint8))" in str(info.value)
    with pytest.raises(TorchOnlyDtype, match="show its bits as uint8"):
        assert_bits_eq("w", t, np.zeros(3, np.uint8), dtype=torch.float4_e2m1fn_x2)


def test_a_tensor_on_a_device_the_harness_cannot_read_is_one_line(torch):
    with pytest.raises(ValueError, match=r"^x: got is a torch tensor on device meta, .*\(\.cpu\(\)\)$"):
        assert_bits_eq("x", torch.zeros(2, device="meta"), np.zeros(2, np.float32))


def test_a_shape_mismatch_between_torch_and_numpy_has_the_short_message(torch):
    assert lines(assert_bits_eq, "x", torch.zeros(2, 3), np.zeros((3, 2), np.float32)) == [
        "x: shapes differ: got (2, 3), expected (3, 2)"]


def test_is_torch_knows_tensors_and_parameters_and_nothing_else(torch):
    assert is_torch(torch.zeros(1)) and is_torch(torch.nn.Parameter(torch.zeros(1)))
    assert not is_torch(np.zeros(1)) and not is_torch(Producer(np.zeros(1)))


def test_comparing_numpy_arrays_never_imports_torch():
    code = ("import sys, numpy as np\n"
            "from harness import assert_bits_eq, assert_close\n"
            "from harness.library import buffers, kernels, launch, reference\n"
            "assert_bits_eq('x', np.zeros(3, np.float32), np.zeros(3, np.float32))\n"
            "assert_close('x', np.zeros(3, np.float32), np.zeros(3, np.float32), atol=0, rtol=0)\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=child_env())
    assert proc.returncode == 0, proc.stderr
