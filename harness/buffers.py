"""Device buffers filled with sentinels, and the checks that they stayed untouched."""

from __future__ import annotations

import numpy as np

from harness.bits import BitsMismatch, bits_mismatch_lines
from harness.dtypes import _UINT_OF_SIZE


def filled(shape, dtype, bits: int):
    """A CuPy array whose every element has the raw bit pattern `bits`."""
    import cupy

    dtype = np.dtype(dtype)
    u = _UINT_OF_SIZE[dtype.itemsize]
    return cupy.full(shape, bits, dtype=u).view(dtype)


def nan_filled(shape, dtype):
    """Quiet NaN in every element (bf16 0x7fc0, f32 0x7fc00000, f16 0x7e00)."""
    dtype = np.dtype(dtype)
    bits = {2: 0x7FC0 if dtype.name == "bfloat16" else 0x7E00, 4: 0x7FC00000, 8: 0x7FF8000000000000}
    if dtype.itemsize not in bits:
        raise TypeError(f"no NaN of {dtype}: use filled() with an explicit sentinel")
    return filled(shape, dtype, bits[dtype.itemsize])


def assert_untouched(label: str, arr, bits: int) -> None:
    """Every element still holds the sentinel bits."""
    host = arr.get() if hasattr(arr, "get") else np.asarray(arr)
    expected = np.full(host.shape, bits, dtype=_UINT_OF_SIZE[host.dtype.itemsize]).view(host.dtype)
    lines = bits_mismatch_lines(label, host, expected)
    if lines:
        lines[0] += " (a sentinel region was written)"
        raise BitsMismatch("\n".join(lines))
