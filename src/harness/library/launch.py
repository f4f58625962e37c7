"""Launch helpers for kernel launchers: argument checks that refuse bad host arguments
before any launch, and the null pointer.

A launcher validates every argument on plain Python values, so its refusals work on numpy
arrays with no GPU (refusal gates need none). The checks take NumPy and CuPy arrays and torch
tensors alike (a torch dtype is read as the NumPy / ml_dtypes dtype of its name, packed fp4 as
uint8); `kernel_args` turns torch CUDA tensors into kernel arguments without a copy. Every check here raises `Refusal`, a
`ValueError`: reports give a red gate route `refusal` only for a `Refusal`, so a numpy
`ValueError` raised by accident inside a launcher is not mistaken for a deliberate refusal.

    from harness.library.launch import Refusal, check_array, check_aligned, check_int32_vector, NULL

Messages start with `op` (the launcher's name, e.g. "fp8_gemv: ") when one is given, name
the argument, say what it holds and what was expected, and end with what to do.
"""

from __future__ import annotations

import numpy as np

from harness.core.errors import HarnessError
from harness.library import tensors
from harness.library.dtypes import _UINT_OF_SIZE, bf16, fp8_e4m3

# Dtypes a launcher accepts for an array of each kind: the ml_dtypes type, or its raw bits.
BF16_DTYPES = (bf16, np.dtype(np.uint16))
E4M3_DTYPES = (np.dtype(np.uint8), fp8_e4m3)
F32_DTYPES = (np.dtype(np.float32),)


class Refusal(HarnessError, ValueError):
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


def dtype_of(arr, what: str = "the array") -> np.dtype:
    """The NumPy dtype of a NumPy / CuPy array, or the one a torch tensor's bits are read as
    (`harness.library.tensors`; packed fp4 as uint8). An unknown torch dtype is a `Refusal`."""
    if tensors.is_torch(arr):
        try:
            return tensors.numpy_dtype_of_torch(arr, what)
        except tensors.UnknownDtype as exc:
            raise Refusal(str(exc)) from None
    return np.dtype(arr.dtype)


def is_c_contiguous(arr) -> bool:
    return bool(arr.is_contiguous()) if tensors.is_torch(arr) else bool(arr.flags.c_contiguous)


def check_dtype(op: str, name: str, arr, dtypes, what: str = "") -> None:
    """`arr` has one of `dtypes` (a dtype or a tuple of them) and is C-contiguous (the
    kernel's pointer arithmetic assumes the dense row-major layout)."""
    allowed = tuple(np.dtype(d) for d in (dtypes if isinstance(dtypes, (tuple, list)) else (dtypes,)))
    dtype = dtype_of(arr, f"{_prefix(op)}{name}")
    if dtype not in allowed:
        detail = f" ({what})" if what else ": convert it first"
        raise Refusal(f"{_prefix(op)}{name} has dtype {arr.dtype}, expected "
                      f"{' or '.join(str(d) for d in allowed)}{detail}")
    if not is_c_contiguous(arr):
        fix = ".contiguous()" if tensors.is_torch(arr) else "a contiguous copy (.copy())"
        raise Refusal(f"{_prefix(op)}{name} is not C-contiguous: pass {fix}")


def check_array(op: str, name: str, arr, shape: tuple, dtypes, what: str = "") -> None:
    """`arr` has exactly `shape`, one of `dtypes`, and is C-contiguous."""
    check_shape(op, name, arr, shape, what)
    check_dtype(op, name, arr, dtypes, what)


def check_aligned(op: str, name: str, arr, alignment: int) -> None:
    """A device array's address is a multiple of `alignment` bytes (vector loads need it).
    Host (numpy) arrays are not checked: they are never launched."""
    if tensors.is_torch(arr):
        ptr = arr.data_ptr() if arr.device.type == "cuda" else None
    else:
        ptr = getattr(getattr(arr, "data", None), "ptr", None)
    if ptr is not None and ptr % alignment:
        raise Refusal(
            f"{_prefix(op)}{name} starts at 0x{ptr:x}, not {alignment}-byte aligned: "
            "pass a fresh allocation or a slice starting on a multiple of the alignment"
        )


def check_int32_vector(op: str, name: str, arr, length: int | None = None, what: str = "") -> None:
    """`arr` is a contiguous 1-D int32 array, of `length` entries when given."""
    holds = f" ({what})" if what else ""
    if not (dtype_of(arr, f"{_prefix(op)}{name}") == np.int32 and arr.ndim == 1 and is_c_contiguous(arr)):
        raise Refusal(f"{_prefix(op)}{name} must be a contiguous 1-D int32 array{holds}, "
                      f"got {arr.dtype} of shape {shape_of(arr)}: convert it with .astype(int32)")
    if length is not None and int(arr.shape[0]) != int(length):
        raise Refusal(f"{_prefix(op)}{name} has {int(arr.shape[0])} entries, expected {int(length)}{holds}")


# ------------------------------------------------------------------ torch tensors as kernel arguments


def _is_foreign_device_array(arg) -> bool:
    """An object with the CUDA array interface that CuPy does not own (numba, PyTorch, ...)."""
    return hasattr(arg, "__cuda_array_interface__") and not type(arg).__module__.startswith("cupy")


def _device_view(ptr: int, shape: tuple, itemsize: int, owner, device: int):
    """A CuPy array over `owner`'s device memory (no copy), as the unsigned integers of its item
    size: a kernel takes a pointer, and the owner stays alive as long as the view."""
    import cupy

    nbytes = int(np.prod(shape, dtype=np.int64)) * itemsize
    memory = cupy.cuda.UnownedMemory(int(ptr), nbytes, owner, device_id=device)
    return cupy.ndarray(shape, dtype=_UINT_OF_SIZE[itemsize], memptr=cupy.cuda.MemoryPointer(memory, 0))


def _c_strides(shape: tuple, itemsize: int) -> tuple:
    return tuple(int(np.prod(shape[i + 1:], dtype=np.int64)) * itemsize for i in range(len(shape)))


def _current_device() -> int:
    import cupy

    return cupy.cuda.Device().id


def kernel_arg(kernel: str, index: int, arg, device: int | None = None):
    """One kernel argument as CuPy launches it. A torch tensor, or another object with the CUDA
    array interface, becomes a CuPy view of the same memory (no copy), after one-line refusals:
    a dtype the harness does not know, a non-contiguous layout, memory on the CPU or on another
    GPU than `device` (the kernel's; None: CuPy's current device). Anything else is returned as
    it is."""
    return _device_view_of(f"{kernel}: argument {index}", arg, device)


def device_pointer(op: str, name: str, arr, device: int | None = None) -> int:
    """The device address of `arr` (a CuPy array, a torch CUDA tensor, another CUDA array), for
    a kernel that takes its pointers inside a struct argument: a torch tensor gets the refusals
    of a kernel argument first (`kernel_arg`). A host array is a `Refusal`."""
    view = _device_view_of(f"{_prefix(op)}{name}", arr, device)
    if isinstance(view, np.ndarray) or not hasattr(view, "data"):
        raise Refusal(f"{_prefix(op)}{name} is a host array ({type(arr).__name__}): the kernel reads device memory; "
                      "put it on the device first")
    return int(view.data.ptr)


def _device_view_of(what: str, arg, device: int | None):
    if tensors.is_torch(arg):
        dtype = dtype_of(arg, what)
        if not arg.is_contiguous():
            raise Refusal(f"{what} is a non-contiguous torch tensor (shape {tuple(arg.shape)}, strides "
                          f"{tuple(arg.stride())}): the kernel reads the dense row-major layout; pass .contiguous()")
        if arg.device.type != "cuda":
            raise Refusal(f"{what} is a torch tensor on {arg.device}, but a kernel reads device memory: move it to "
                          "the kernel's GPU (.to('cuda'))")
        device = _current_device() if device is None else device
        if arg.device.index != device:
            raise Refusal(f"{what} is a torch tensor on {arg.device}, but the kernel is loaded on cuda:{device}: move "
                          f"it with .to('cuda:{device}'), or make cuda:{arg.device.index} current before loading and "
                          f"launching the kernel (cupy.cuda.Device({arg.device.index}).use())")
        return _device_view(arg.data_ptr(), tuple(arg.shape), dtype.itemsize, arg, device)
    if not _is_foreign_device_array(arg):
        return arg
    cai = arg.__cuda_array_interface__
    shape, ptr = tuple(int(n) for n in cai["shape"]), int(cai["data"][0])
    dtype = np.dtype(cai["typestr"])
    if dtype.itemsize not in _UINT_OF_SIZE:
        raise Refusal(f"{what} has item size {dtype.itemsize} ({cai['typestr']}): pass a view as an integer type of "
                      "1, 2, 4 or 8 bytes")
    strides = cai.get("strides")
    if strides is not None and tuple(strides) != _c_strides(shape, dtype.itemsize):
        raise Refusal(f"{what} is a non-contiguous device array (shape {shape}, byte strides {tuple(strides)}): the "
                      "kernel reads the dense row-major layout; pass a contiguous copy")
    device = _current_device() if device is None else device
    if ptr:
        import cupy

        owner_device = cupy.cuda.runtime.pointerGetAttributes(ptr).device
        if owner_device != device:
            raise Refusal(f"{what} is device memory of cuda:{owner_device}, but the kernel is loaded on cuda:{device}: "
                          f"copy it to cuda:{device}, or make cuda:{owner_device} current before loading the kernel")
    return _device_view(ptr, shape, dtype.itemsize, arg, device)


def kernel_args(kernel: str, args, device: int | None = None) -> tuple:
    """`args` with every torch tensor (or foreign CUDA array) made a kernel argument by
    `kernel_arg`; the same tuple when there is none."""
    if not any(tensors.is_torch(a) or _is_foreign_device_array(a) for a in args):
        return args
    return tuple(kernel_arg(kernel, i, a, device) for i, a in enumerate(args))


def torch_stream(device: int):
    """torch's current stream on cuda:`device`, as a CuPy stream over the same handle
    (`stream="torch"` on a launch): the kernel is ordered with the torch work around it, and
    torch's caching allocator sees it on the stream its tensors were allocated on."""
    import cupy
    import torch  # asked for by name: stream="torch"

    return cupy.cuda.ExternalStream(int(torch.cuda.current_stream(device).cuda_stream), device)


# ------------------------------------------------------------------ dynamic shared memory above 48 KiB

DEFAULT_DYNAMIC_SHARED_LIMIT = 48 * 1024
"""Shared memory a block may take with no opt-in, static and dynamic together: a kernel with S
static bytes may launch with 48 KiB - S dynamic ones (the function attribute
CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES starts there). Above that the attribute must
be raised first (or the launch fails with "invalid argument"); `harness.library.kernels` does
that for every launch with `shared_mem=` above `dynamic_shared_allowed`, through
`allow_dynamic_shared`."""


def dynamic_shared_allowed(function) -> int:
    """The dynamic shared memory `function` (a kernel from `Module.get`, or a CuPy function) may
    launch with now: its CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, which starts at 48 KiB
    less its static shared memory (a kernel with a `__shared__` array besides an `extern` one
    cannot take the whole 48 KiB without the opt-in)."""
    from cupy.cuda import driver

    fn = getattr(function, "function", function)
    return int(driver.funcGetAttribute(driver.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, fn.ptr))


def check_dynamic_shared(op: str, nbytes: int, static_bytes: int, optin_limit: int) -> None:
    """Refuse `nbytes` of dynamic shared memory that, with the kernel's static shared memory,
    exceeds the device's opt-in limit per block (227 KiB on compute capability 9.0)."""
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
