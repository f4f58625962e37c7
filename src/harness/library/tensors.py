"""Arrays from other libraries as the harness's arrays: torch tensors and DLPack producers,
read as NumPy without a round trip through float, and never a reason to import torch.

A torch tensor is recognised by its type's module (`is_torch`): torch is imported by whoever
made the tensor, so the harness only ever finds it in `sys.modules`. Its bits are read through
its integer view (`t.view(torch.int16)` for bf16), then viewed as the ml_dtypes type of the
same name; a CUDA tensor is synchronised and copied to the host as those integers. Any other
object with `__dlpack__` is read through DLPack: `numpy.from_dlpack` for what NumPy reads, and
for bf16 / fp8 / packed fp4 (which NumPy's DLPack refuses) the DLTensor's own bytes. Bad input
is one line naming the array and the fix, never a silent cast:

- a dtype the harness does not know (complex, quantized, bits*): `UnknownDtype`;
- a torch-only dtype where NumPy values are needed (`torch.float4_e2m1fn_x2` holds two e2m1
  values a byte, which no NumPy dtype holds): `TorchOnlyDtype`;
- a tensor on a device that is neither the CPU nor CUDA (a meta tensor, MPS): `ValueError`.
"""

from __future__ import annotations

import ctypes
import sys

import ml_dtypes
import numpy as np

from harness.core.errors import HarnessError

_UINT_OF_SIZE = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_INT_NAME_OF_SIZE = {1: "int8", 2: "int16", 4: "int32", 8: "int64"}


class UnknownDtype(HarnessError, TypeError):
    """An array whose dtype the harness cannot read as bits."""


class TorchOnlyDtype(HarnessError, TypeError):
    """A torch dtype NumPy has no dtype for, where NumPy values were needed."""


# torch dtype (as str(tensor.dtype)) -> the NumPy dtype its bits are read as.
TORCH_DTYPES: dict[str, np.dtype] = {
    "torch.bool": np.dtype(np.bool_),
    "torch.uint8": np.dtype(np.uint8), "torch.int8": np.dtype(np.int8),
    "torch.int16": np.dtype(np.int16), "torch.uint16": np.dtype(np.uint16),
    "torch.int32": np.dtype(np.int32), "torch.uint32": np.dtype(np.uint32),
    "torch.int64": np.dtype(np.int64), "torch.uint64": np.dtype(np.uint64),
    "torch.float16": np.dtype(np.float16), "torch.float32": np.dtype(np.float32),
    "torch.float64": np.dtype(np.float64),
    "torch.bfloat16": np.dtype(ml_dtypes.bfloat16),
    "torch.float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn),
    "torch.float8_e5m2": np.dtype(ml_dtypes.float8_e5m2),
    "torch.float8_e4m3fnuz": np.dtype(ml_dtypes.float8_e4m3fnuz),
    "torch.float8_e5m2fnuz": np.dtype(ml_dtypes.float8_e5m2fnuz),
    "torch.float8_e8m0fnu": np.dtype(ml_dtypes.float8_e8m0fnu),
}
# torch dtypes whose bits the harness reads (as bytes) but NumPy holds no values of.
TORCH_PACKED = {"torch.float4_e2m1fn_x2": "two fp4 e2m1 values a byte, low nibble first"}
PACKED_FIX = ("compare its bits with assert_bits_eq (they are read as uint8), or unpack the values with "
              "harness.library.dtypes.unpack_fp4(t.view(torch.uint8))")


def is_torch(x) -> bool:
    """Whether `x` is a torch tensor (or a subclass: a Parameter), without importing torch."""
    return any(c.__name__ == "Tensor" and c.__module__ == "torch" for c in type(x).__mro__)


def is_dlpack(x) -> bool:
    """A DLPack producer that is neither a NumPy array nor a torch tensor (JAX, CuPy, ...)."""
    return hasattr(x, "__dlpack__") and hasattr(x, "__dlpack_device__") and not isinstance(x, np.ndarray)


def torch_dtype_name(t) -> str:
    return str(t.dtype)


def numpy_dtype_of_torch(t, what: str = "the tensor", *, values: bool = False) -> np.dtype:
    """The NumPy dtype a torch tensor's bits are read as (uint8 for packed fp4 unless `values`)."""
    name = torch_dtype_name(t)
    if name in TORCH_PACKED:
        if values:
            raise TorchOnlyDtype(f"{what} is a {name} tensor ({TORCH_PACKED[name]}), which no NumPy dtype holds: "
                                 f"{PACKED_FIX}")
        return np.dtype(np.uint8)
    dtype = TORCH_DTYPES.get(name)
    if dtype is None:
        size = getattr(t, "itemsize", None)
        view = f"t.view(torch.{_INT_NAME_OF_SIZE[size]})" if size in _INT_NAME_OF_SIZE else "an integer view"
        raise UnknownDtype(f"{what} is a {name} tensor, a dtype the harness does not know (it knows "
                           f"{', '.join(n.removeprefix('torch.') for n in (*TORCH_DTYPES, *TORCH_PACKED))}): "
                           f"compare its raw bits through {view}")
    return dtype


def _torch():
    return sys.modules["torch"]  # imported by whoever made the tensor


def torch_to_host(t, what: str = "the tensor", *, values: bool = False) -> np.ndarray:
    """A torch tensor (CPU or CUDA, any strides) as NumPy, bits unchanged: its integer view read
    on the host, viewed as the ml_dtypes / NumPy dtype of the same name. A CUDA tensor is read
    after its device finished its work."""
    dtype = numpy_dtype_of_torch(t, what, values=values)
    kind = t.device.type
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"{what} is a torch tensor on device {t.device}, which the harness cannot read: move it to "
                         "the CPU or a CUDA device first (.cpu())")
    torch = _torch()
    t = t.detach()
    if kind == "cuda":
        torch.cuda.synchronize(t.device)
    ints = t.view(getattr(torch, _INT_NAME_OF_SIZE[dtype.itemsize]))
    return ints.cpu().numpy().view(dtype)


# ------------------------------------------------------------------ DLPack

# DLPack's dtype codes (dlpack.h, DLDataTypeCode) for what NumPy's from_dlpack refuses.
_DLPACK_CODES = {
    (4, 16): ml_dtypes.bfloat16,  # kDLBfloat
    (7, 8): ml_dtypes.float8_e3m4,
    (8, 8): ml_dtypes.float8_e4m3,
    (9, 8): ml_dtypes.float8_e4m3b11fnuz,
    (10, 8): ml_dtypes.float8_e4m3fn,
    (11, 8): ml_dtypes.float8_e4m3fnuz,
    (12, 8): ml_dtypes.float8_e5m2,
    (13, 8): ml_dtypes.float8_e5m2fnuz,
    (14, 8): ml_dtypes.float8_e8m0fnu,
}
_DL_FLOAT4_E2M1 = 17  # kDLFloat4_e2m1fn: two lanes of 4 bits are one byte of packed fp4
_DL_CPU, _DL_CUDA = 1, 2


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int), ("device_id", ctypes.c_int)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int), ("dtype", _DLDataType),
                ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
                ("byte_offset", ctypes.c_uint64)]


def _capsule_pointer(capsule) -> int:
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    return get(capsule, b"dltensor")


def _read_dltensor(x, what: str, values: bool) -> np.ndarray:
    """Copy a host DLTensor's elements into NumPy by their bits. The capsule is never consumed:
    its producer frees it when it is collected, as the DLPack protocol says."""
    capsule = x.__dlpack__()
    tensor = _DLTensor.from_address(_capsule_pointer(capsule))
    code, bits, lanes = tensor.dtype.code, tensor.dtype.bits, tensor.dtype.lanes
    if (code, bits, lanes) == (_DL_FLOAT4_E2M1, 4, 2):
        if values:
            raise TorchOnlyDtype(f"{what} holds packed fp4 (DLPack float4_e2m1fn x2: two e2m1 values a byte), which "
                                 f"no NumPy dtype holds: {PACKED_FIX.replace('t.view(torch.uint8)', 'its bytes')}")
        dtype = np.dtype(np.uint8)
    elif lanes == 1 and (code, bits) in _DLPACK_CODES:
        dtype = np.dtype(_DLPACK_CODES[(code, bits)])
    else:
        raise UnknownDtype(f"{what} has DLPack dtype code {code}, {bits} bits x {lanes} lanes, which the harness does "
                           "not know: pass a view as the unsigned integer of its item size")
    shape = tuple(tensor.shape[i] for i in range(tensor.ndim))
    size = dtype.itemsize
    if tensor.strides:
        strides = tuple(tensor.strides[i] for i in range(tensor.ndim))
    else:  # NULL strides: C-contiguous
        strides = tuple(int(np.prod(shape[i + 1:], dtype=np.int64)) for i in range(len(shape)))
    if any(s < 0 for s in strides):
        raise ValueError(f"{what} has negative strides {strides}: pass a copy with positive strides")
    count = int(np.prod(shape, dtype=np.int64))
    if count == 0:
        return np.zeros(shape, dtype)
    extent = (1 + sum((n - 1) * s for n, s in zip(shape, strides))) * size
    raw = (ctypes.c_char * extent).from_address(tensor.data + tensor.byte_offset)
    host = np.ndarray(shape, dtype=_UINT_OF_SIZE[size], buffer=raw, strides=tuple(s * size for s in strides))
    out = host.copy().view(dtype)
    del capsule
    return out


def dlpack_to_host(x, what: str = "the array", *, values: bool = False) -> np.ndarray:
    """Any DLPack producer on the CPU or a CUDA device, as NumPy, bits unchanged."""
    device_type, device_id = x.__dlpack_device__()
    if int(device_type) == _DL_CUDA:
        import cupy

        try:
            return cupy.from_dlpack(x).get()
        except Exception as exc:
            raise UnknownDtype(f"{what} is a CUDA DLPack array CuPy cannot read ({exc}): pass a view as the unsigned "
                               "integer of its item size") from None
    if int(device_type) != _DL_CPU:
        raise ValueError(f"{what} is a DLPack array on device type {int(device_type)} (id {device_id}), which the "
                         "harness cannot read: copy it to the CPU or a CUDA device first")
    try:
        return np.from_dlpack(x)
    except (RuntimeError, TypeError, BufferError):  # a dtype NumPy's DLPack refuses (bf16, fp8, packed fp4)
        return _read_dltensor(x, what, values)


def to_host(x, what: str = "the array", *, values: bool = False) -> np.ndarray:
    """A torch tensor or another DLPack producer as NumPy (bits unchanged); anything else as
    `numpy.asarray` reads it. `values=True`: NumPy values are needed (`assert_close`), so a
    packed fp4 tensor is refused rather than compared as bytes."""
    if is_torch(x):
        return torch_to_host(x, what, values=values)
    if is_dlpack(x):
        return dlpack_to_host(x, what, values=values)
    return np.asarray(x)
