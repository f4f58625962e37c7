"""Device buffers filled with sentinels, the checks that they stayed untouched, and the
host <-> device copies that carry bf16 through its raw bits (CuPy has no bfloat16 type of
its own: a bf16 array lives on the device as its uint16 bits, viewed as ml_dtypes' bf16).

In a run with `--redzones`, every buffer made here lies between redzones (`harness.library.redzones`): guard regions of
poison, checked on the device after each launch. Each helper takes `label=` (the buffer's name
in a failure; by default the helper and its call site) and `redzone=False` (none for this
buffer: a kernel that writes past it on purpose)."""

from __future__ import annotations

import numpy as np

from harness.library import redzones, tensors
from harness.library.bits import BitsMismatch, bits_mismatch_lines
from harness.library.dtypes import _UINT_OF_SIZE, _host, bf16, from_bits

BF16_SENTINEL = 0x7FA5
"""A bf16 NaN with a payload: the kernels' own NaNs are 0x7fc0 or 0x7fff, so no output computed
from finite inputs has these bits. Fill outputs with it to see what a kernel never wrote."""


def _guarded_copy(bits: np.ndarray, dtype, shape, helper: str, label: str | None, redzone: bool):
    """`bits` (a host array of unsigned ints of the item size) on the device, 1-D, between
    redzones where this buffer gets them (`harness.library.redzones.allocate`)."""
    inside = redzones.allocate(bits.size, dtype, shape=shape, helper=helper, label=label, redzone=redzone,
                               contents=bits)
    if inside is not None:
        return inside
    import cupy

    return cupy.asarray(bits.reshape(-1))


def to_device(a, *, bits: bool = False, label: str | None = None, redzone: bool = True):
    """A host array as a C-contiguous CuPy array. bf16 goes through its bits and comes back
    viewed as bf16, or as the raw uint16 bits with `bits=True` (for kernels taking
    `uint16_t*`/`__nv_bfloat16*` and launchers accepting either)."""
    import cupy

    a = np.ascontiguousarray(a)
    if not (a.dtype == bf16 or (a.dtype.kind in "biufc" and a.dtype.itemsize in _UINT_OF_SIZE)):
        return cupy.asarray(a)  # no redzones for a dtype CuPy does not hold by its bits
    raw = a.reshape(-1).view(_UINT_OF_SIZE[a.dtype.itemsize])
    dev = _guarded_copy(raw, a.dtype, a.shape, "to_device", label, redzone).reshape(a.shape)
    if a.dtype == bf16:
        return dev if bits else dev.view(bf16)
    return dev.view(a.dtype)


def to_host(a, dtype=None) -> np.ndarray:
    """A device (or host) array as numpy, after the device finished its work (a fault in
    an earlier launch surfaces here). bf16 comes through its bits; `dtype` reinterprets the
    raw bits (e.g. `to_host(uint16_bits, bf16)`). A numpy array is returned as it is; a torch
    tensor (CPU or CUDA) or another DLPack producer is read by its bits (`harness.library.tensors`:
    bf16 and fp8 as the ml_dtypes types, packed fp4 as uint8)."""
    if isinstance(a, np.ndarray):
        return a if dtype is None else a.view(dtype)
    if tensors.is_torch(a) or (tensors.is_dlpack(a) and not hasattr(a, "get")):
        host = _host(a)
        return host if dtype is None else from_bits(host.view(_UINT_OF_SIZE[host.dtype.itemsize]), dtype)
    import cupy

    redzones.check_redzones("to_host")  # waits for the device: a kernel's write past a buffer is named first
    cupy.cuda.runtime.deviceSynchronize()
    host = a.view(cupy.uint16).get().view(bf16) if np.dtype(a.dtype) == bf16 else a.get()
    return host if dtype is None else from_bits(host.view(_UINT_OF_SIZE[host.dtype.itemsize]), dtype)


def filled(shape, dtype, bits: int, *, label: str | None = None, redzone: bool = True):
    """A CuPy array whose every element has the raw bit pattern `bits`."""
    import cupy

    dtype = np.dtype(dtype)
    u = _UINT_OF_SIZE[dtype.itemsize]
    n = int(np.prod(shape, dtype=np.int64))
    inside = redzones.allocate(n, dtype, shape=shape, helper="filled", label=label, redzone=redzone, fill_bits=bits)
    if inside is None:
        return cupy.full(shape, bits, dtype=u).view(dtype)
    return inside.reshape(shape).view(dtype)


def fenced(a, fill_bits: int | None = None, *, min_pad: int = 256, label: str | None = None, redzone: bool = True):
    """A host array on the device as a view into the middle of an allocation three times its
    size (at least `min_pad` elements each side): the fences before and after hold the raw
    bit pattern `fill_bits` (a NaN, for a kernel whose every read must stay inside `a`;
    by default the quiet NaN of `a`'s floating dtype, `nan_bits`). A kernel that reads up to
    a whole buffer length before or past `a` reads the fence, defined memory, and fails by a
    value its gate can assert, not by a fault; reading further still faults. Returns the
    view, C-contiguous, in `a`'s shape and dtype (bf16 as in `to_device`). The redzones lie
    outside the fences."""
    a = np.ascontiguousarray(a)
    if fill_bits is None:
        if not (a.dtype == bf16 or np.issubdtype(a.dtype, np.floating)):
            raise TypeError(f"fenced: {a.dtype} has no NaN to fence with: pass fill_bits (an e4m3 NaN is 0x7f)")
        fill_bits = nan_bits(a.dtype)
    u = _UINT_OF_SIZE[a.dtype.itemsize]
    n = a.size
    pad = max(n, min_pad)
    fence = np.full(pad, fill_bits, dtype=u)
    dev = _guarded_copy(np.concatenate([fence, a.reshape(-1).view(u), fence]), a.dtype, a.shape, "fenced", label,
                        redzone)
    return dev[pad:pad + n].reshape(a.shape).view(a.dtype)


GUARD = 1024  # elements of a guarded buffer's guard on each side (`guarded`)


def guarded(shape, dtype, guard_bits: int, *, inside_bits: int | None = None, guard: int = GUARD,
            label: str | None = None, redzone: bool = True):
    """An output buffer for a memory-safety gate: a device array of `shape` and `dtype`, a
    view into the middle of an allocation `guard` elements longer on each side. The guards
    hold `guard_bits` (a sentinel), the view `inside_bits` (default: the same). A store a
    little before or past the output lands in a guard, which `assert_guards_untouched`
    names by assertion. Returns (the view, the whole allocation as unsigned ints of the
    dtype's size). The redzones lie outside the guards."""
    dtype = np.dtype(dtype)
    u = _UINT_OF_SIZE[dtype.itemsize]
    n = int(np.prod(shape))
    bits = np.full(n + 2 * guard, guard_bits, dtype=u)
    if inside_bits is not None:
        bits[guard:guard + n] = inside_bits
    whole = _guarded_copy(bits, dtype, shape, "guarded", label, redzone)
    return whole[guard:guard + n].view(dtype).reshape(shape), whole


def assert_guards_untouched(label: str, whole, guard_bits: int, *, guard: int = GUARD) -> None:
    """Both guards of a `guarded` buffer still hold their sentinel."""
    assert_untouched(f"{label}: the {guard} elements before it", whole[:guard], guard_bits)
    assert_untouched(f"{label}: the {guard} elements past it", whole[-guard:], guard_bits)


def nan_bits(dtype) -> int:
    """The raw bits of a quiet NaN of a dtype's size (bf16 0x7fc0, f16 0x7e00, f32 0x7fc00000,
    f64 0x7ff8000000000000)."""
    dtype = np.dtype(dtype)
    bits = {2: 0x7FC0 if dtype.name == "bfloat16" else 0x7E00, 4: 0x7FC00000, 8: 0x7FF8000000000000}
    if dtype.itemsize not in bits:
        raise TypeError(f"no NaN of {dtype}: use filled() with an explicit sentinel")
    return bits[dtype.itemsize]


def nan_filled(shape, dtype, *, label: str | None = None, redzone: bool = True):
    """Quiet NaN in every element (bf16 0x7fc0, f32 0x7fc00000, f16 0x7e00)."""
    return filled(shape, dtype, nan_bits(dtype), label=label, redzone=redzone)


def assert_untouched(label: str, arr, bits: int) -> None:
    """Every element still holds the sentinel bits (a NumPy or CuPy array, a torch tensor)."""
    host = _host(arr, label)
    expected = np.full(host.shape, bits, dtype=_UINT_OF_SIZE[host.dtype.itemsize]).view(host.dtype)
    lines = bits_mismatch_lines(label, host, expected)
    if lines:
        lines[0] += " (a sentinel region was written)"
        raise BitsMismatch("\n".join(lines))


INDEX_32 = 1 << 31
"""The first element index a signed 32-bit int cannot hold: a buffer of more elements than
this is where address arithmetic done in `int` goes wrong (a page id times a page stride)."""


def _free_bytes() -> int:
    """Bytes a new allocation can have now: the driver's free memory and the blocks CuPy's
    pool holds free."""
    import cupy

    free, _total = cupy.cuda.runtime.memGetInfo()
    return int(free) + int(cupy.get_default_memory_pool().free_bytes())


def _release_cached() -> None:
    import cupy

    cupy.cuda.runtime.deviceSynchronize()
    cupy.get_default_memory_pool().free_all_blocks()


class device_memory:
    """Room on the device for a gate whose buffers are large (past `INDEX_32` elements):

        with device_memory(5 << 30, "a KV pool past 2^31 bf16 elements"):
            pool = cupy.empty(...)

    Skips the gate where the device has not `nbytes` free (the reason names the bytes needed,
    the bytes free and what they are for: never a silent pass, never an out-of-memory error
    that reads as the kernel's). On leaving, the pool's cached blocks go back to the driver,
    so a lane does not keep gigabytes that the lanes beside it need."""

    def __init__(self, nbytes: int, why: str):
        if nbytes <= 0:
            raise ValueError(f"device_memory: nbytes is {nbytes}; give the bytes the gate allocates at once")
        self.nbytes, self.why = int(nbytes), why

    def __enter__(self):
        _release_cached()
        free = _free_bytes()
        if free < self.nbytes:
            import pytest

            pytest.skip(f"needs {self.nbytes / 2**30:.1f} GiB of device memory for {self.why}; "
                        f"{free / 2**30:.1f} GiB free on this device: run it on a GPU with the room "
                        "(or with fewer lanes beside it: --harness-lanes 1)")
        return self

    def __exit__(self, *exc):
        try:
            _release_cached()
        except Exception:  # noqa: BLE001 - a faulted context: the gate's own error says why
            pass
        return False
