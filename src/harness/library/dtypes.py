"""bf16, fp8 e4m3 and fp4 e2m1 on the host, built on ml_dtypes.

ml_dtypes rounds to nearest even like CUDA's `__float2bfloat16` / `__nv_cvt_float_to_fp8`.
Two gaps are filled here: CUDA's *saturating* fp8 conversion (`__NV_SATFINITE`, which
clamps to +-448 where ml_dtypes gives NaN) and fp4's two-per-byte packing.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from harness.library import tensors

bf16 = np.dtype(ml_dtypes.bfloat16)
fp8_e4m3 = np.dtype(ml_dtypes.float8_e4m3fn)
fp4_e2m1 = np.dtype(ml_dtypes.float4_e2m1fn)

FP8_E4M3_MAX = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)  # 448
FP4_E2M1_MAX = float(ml_dtypes.finfo(ml_dtypes.float4_e2m1fn).max)  # 6

_UINT_OF_SIZE = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _host(a, what: str = "the array", *, values: bool = False) -> np.ndarray:
    """`a` as NumPy on the host, bits unchanged: a NumPy array as it is, a CuPy array copied
    back, a torch tensor (CPU or CUDA) or another DLPack producer read by `harness.library.tensors`.
    `values=True` where NumPy values are needed (a packed fp4 tensor is then refused); `what`
    names `a` in the one-line error a bad input gets."""
    if isinstance(a, np.ndarray):
        return a
    if tensors.is_torch(a):
        return tensors.torch_to_host(a, what, values=values)
    if hasattr(a, "get"):  # CuPy
        return a.get()
    if tensors.is_dlpack(a):
        return tensors.dlpack_to_host(a, what, values=values)
    return np.asarray(a)


def as_dtype(dtype) -> np.dtype:
    """A NumPy dtype from a NumPy / ml_dtypes dtype or a torch dtype (`torch.bfloat16`)."""
    if type(dtype).__module__ == "torch":
        name = str(dtype)
        if name in tensors.TORCH_DTYPES:
            return tensors.TORCH_DTYPES[name]
        if name in tensors.TORCH_PACKED:
            raise tensors.TorchOnlyDtype(f"{name} ({tensors.TORCH_PACKED[name]}) has no NumPy dtype: show its bits as "
                                         "uint8 (dtype=numpy.uint8)")
        raise tensors.UnknownDtype(f"{name} is a dtype the harness does not know: name a NumPy or ml_dtypes dtype")
    return np.dtype(dtype)


def bits_of(a) -> np.ndarray:
    """The raw bits of an array (NumPy, CuPy, a torch tensor or another DLPack producer), as
    the unsigned integer type of its item size."""
    a = _host(a)
    try:
        return a.view(_UINT_OF_SIZE[a.dtype.itemsize])
    except KeyError:
        raise TypeError(f"no unsigned integer type of {a.dtype.itemsize} bytes to hold {a.dtype} bits") from None


def from_bits(bits, dtype) -> np.ndarray:
    """Reinterpret unsigned integer bits as `dtype` (same item size)."""
    dtype = np.dtype(dtype)
    return np.asarray(bits, dtype=_UINT_OF_SIZE[dtype.itemsize]).view(dtype)


def to_bf16(x) -> np.ndarray:
    """Round to nearest even, like `__float2bfloat16`."""
    return np.asarray(x, dtype=np.float32).astype(bf16)


def to_fp8_e4m3(x) -> np.ndarray:
    """Non-saturating conversion (out of range becomes NaN, like `__NV_NOSAT`)."""
    return np.asarray(x, dtype=np.float32).astype(fp8_e4m3)


def to_fp8_e4m3_saturating(x) -> np.ndarray:
    """CUDA's `__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3)`: finite values past
    +-448 clamp to +-448, infinities too; NaN stays NaN."""
    x = np.asarray(x, dtype=np.float32)
    return np.where(np.isnan(x), x, np.clip(x, -FP8_E4M3_MAX, FP8_E4M3_MAX)).astype(fp8_e4m3)


def decode_e4m3(raw) -> np.ndarray:
    """uint8 e4m3 bits -> float32."""
    return np.asarray(raw, dtype=np.uint8).view(fp8_e4m3).astype(np.float32)


def decode_e2m1(nibbles) -> np.ndarray:
    """Values 0..15 (one e2m1 code each) -> float32."""
    n = np.asarray(nibbles, dtype=np.uint8)
    if n.size and int(n.max()) > 15:
        raise ValueError("decode_e2m1 takes 4-bit codes 0..15; unpack two-per-byte data with unpack_fp4 first")
    return n.view(fp4_e2m1).astype(np.float32)


def to_fp4_e2m1(x) -> np.ndarray:
    """float -> e2m1 codes 0..15 (uint8), round to nearest even."""
    return np.asarray(x, dtype=np.float32).astype(fp4_e2m1).view(np.uint8) & 0x0F


def pack_fp4(values) -> np.ndarray:
    """Pack e2m1 values two per byte, low nibble first, along the last axis (even length)."""
    codes = to_fp4_e2m1(values)
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_fp4 needs an even last axis, got {codes.shape[-1]}: pad with a zero")
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)


def unpack_fp4(packed, n: int | None = None) -> np.ndarray:
    """Two-per-byte e2m1 (low nibble first) -> float32, `n` values along the last axis."""
    p = np.asarray(packed, dtype=np.uint8)
    codes = np.stack([p & 0x0F, p >> 4], axis=-1).reshape(*p.shape[:-1], p.shape[-1] * 2)
    if n is not None:
        if n > codes.shape[-1]:
            raise ValueError(f"unpack_fp4: asked for {n} values but the data holds {codes.shape[-1]}")
        codes = codes[..., :n]
    return decode_e2m1(codes)
