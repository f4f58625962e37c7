"""Launch helpers for kernel launchers: argument checks that refuse bad host arguments
before any launch, and the null pointer.

A launcher validates every argument on plain Python values, so its refusals work on numpy
arrays with no GPU (refusal gates need none). Every check here raises `Refusal`, a
`ValueError`: reports give a red gate route `refusal` only for a `Refusal`, so a numpy
`ValueError` raised by accident inside a launcher is not mistaken for a deliberate refusal.

    from harness.launch import Refusal, check_array, check_aligned, check_int32_vector, NULL

Messages start with `op` (the launcher's name, e.g. "fp8_gemv: ") when one is given, name
the argument, say what it holds and what was expected, and end with what to do.
"""

from __future__ import annotations

import numpy as np

from harness.dtypes import bf16, fp8_e4m3

# Dtypes a launcher accepts for an array of each kind: the ml_dtypes type, or its raw bits.
BF16_DTYPES = (bf16, np.dtype(np.uint16))
E4M3_DTYPES = (np.dtype(np.uint8), fp8_e4m3)
F32_DTYPES = (np.dtype(np.float32),)


class Refusal(ValueError):
    """A launcher refused its arguments before any launch. The message names the argument,
    what was wrong and what to do."""


NULL = np.uint64(0)
"""A null device pointer as a kernel argument: the kernel reads it as `nullptr` (for an
optional array the kernel tests against null). Pass it where the argument is a pointer;
CuPy passes a `numpy.uint64` by value, the same width as a device pointer."""


def ptr_or_null(arr):
    """`arr` itself, or `NULL` when `arr` is None (an optional array argument)."""
    return NULL if arr is None else arr


def _prefix(op: str) -> str:
    return f"{op}: " if op else ""


def require(condition: bool, message: str) -> None:
    """Refuse with `message` unless `condition` holds."""
    if not condition:
        raise Refusal(message)


def shape_of(arr) -> tuple[int, ...]:
    return tuple(int(n) for n in arr.shape)


def check_shape(op: str, name: str, arr, shape: tuple, what: str = "") -> None:
    """`arr` has exactly `shape`."""
    if shape_of(arr) != tuple(int(n) for n in shape):
        detail = f" ({what})" if what else ": allocate it with that shape"
        raise Refusal(f"{_prefix(op)}{name} has shape {shape_of(arr)}, expected {tuple(shape)}{detail}")


def check_dtype(op: str, name: str, arr, dtypes, what: str = "") -> None:
    """`arr` has one of `dtypes` (a dtype or a tuple of them) and is C-contiguous (the
    kernel's pointer arithmetic assumes the dense row-major layout)."""
    allowed = tuple(np.dtype(d) for d in (dtypes if isinstance(dtypes, (tuple, list)) else (dtypes,)))
    if np.dtype(arr.dtype) not in allowed:
        detail = f" ({what})" if what else ": convert it first"
        raise Refusal(f"{_prefix(op)}{name} has dtype {arr.dtype}, expected "
                      f"{' or '.join(str(d) for d in allowed)}{detail}")
    if not arr.flags.c_contiguous:
        raise Refusal(f"{_prefix(op)}{name} is not C-contiguous: pass a contiguous copy (.copy())")


def check_array(op: str, name: str, arr, shape: tuple, dtypes, what: str = "") -> None:
    """`arr` has exactly `shape`, one of `dtypes`, and is C-contiguous."""
    check_shape(op, name, arr, shape, what)
    check_dtype(op, name, arr, dtypes, what)


def check_aligned(op: str, name: str, arr, alignment: int) -> None:
    """A device array's address is a multiple of `alignment` bytes (vector loads need it).
    Host (numpy) arrays are not checked: they are never launched."""
    ptr = getattr(getattr(arr, "data", None), "ptr", None)
    if ptr is not None and ptr % alignment:
        raise Refusal(
            f"{_prefix(op)}{name} starts at 0x{ptr:x}, not {alignment}-byte aligned: "
            "pass a fresh allocation or a slice starting on a multiple of the alignment"
        )


def check_int32_vector(op: str, name: str, arr, length: int | None = None, what: str = "") -> None:
    """`arr` is a contiguous 1-D int32 array, of `length` entries when given."""
    holds = f" ({what})" if what else ""
    if not (np.dtype(arr.dtype) == np.int32 and arr.ndim == 1 and arr.flags.c_contiguous):
        raise Refusal(f"{_prefix(op)}{name} must be a contiguous 1-D int32 array{holds}, "
                      f"got {arr.dtype} of shape {shape_of(arr)}: convert it with .astype(int32)")
    if length is not None and int(arr.shape[0]) != int(length):
        raise Refusal(f"{_prefix(op)}{name} has {int(arr.shape[0])} entries, expected {int(length)}{holds}")


# ------------------------------------------------------------------ dynamic shared memory above 48 KiB

DEFAULT_DYNAMIC_SHARED_LIMIT = 48 * 1024
"""Dynamic shared memory a kernel may take with no opt-in. Above it the function attribute
CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES must be raised first (or the launch fails
with "invalid argument"); `harness.kernels` does that for every launch with
`shared_mem=` above the limit, through `allow_dynamic_shared`."""


def check_dynamic_shared(op: str, nbytes: int, static_bytes: int, optin_limit: int) -> None:
    """Refuse `nbytes` of dynamic shared memory that, with the kernel's static shared memory,
    exceeds the device's opt-in limit per block (227 KiB on an H100/H200)."""
    nbytes = int(nbytes)
    if nbytes < 0:
        raise Refusal(f"{_prefix(op)}shared_mem={nbytes} is negative: pass the dynamic shared memory in bytes")
    if static_bytes + nbytes > optin_limit:
        raise Refusal(
            f"{_prefix(op)}shared_mem={nbytes} bytes of dynamic shared memory plus the kernel's {static_bytes} static "
            f"bytes exceed the device's {optin_limit} bytes per block (opt-in limit): use a smaller tile or fewer "
            "stages")


def allow_dynamic_shared(function, nbytes: int, op: str = "") -> None:
    """Let `function` (a kernel from `Module.get`, or a CuPy function) launch with `nbytes`
    of dynamic shared memory: raises the function's max-dynamic-shared attribute on the
    current device after checking the opt-in limit (a `Refusal` when it is exceeded)."""
    from cupy.cuda import Device, driver, runtime

    fn = getattr(function, "function", function)
    static = driver.funcGetAttribute(driver.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, fn.ptr)
    optin = runtime.deviceGetAttribute(runtime.cudaDevAttrMaxSharedMemoryPerBlockOptin, Device().id)
    check_dynamic_shared(op or getattr(function, "name", ""), nbytes, static, optin)
    driver.funcSetAttribute(fn.ptr, driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, int(nbytes))
