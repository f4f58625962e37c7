"""Finding the device, the require-gpu policy's facts, sticky-error detection, and
one GPU per xdist worker. Nothing here imports CuPy until it is asked a question."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

# CUDA errors after which the context is unusable ("sticky"): a trap, an illegal
# address or instruction, a misaligned access, a launch that died.
STICKY_ERROR_NAMES = (
    "cudaErrorLaunchFailure",
    "cudaErrorIllegalAddress",
    "cudaErrorIllegalInstruction",
    "cudaErrorMisalignedAddress",
    "cudaErrorInvalidAddressSpace",
    "cudaErrorInvalidPc",
    "cudaErrorHardwareStackError",
    "cudaErrorAssert",
    "cudaErrorLaunchTimeout",
    "CUDA_ERROR_LAUNCH_FAILED",
    "CUDA_ERROR_ILLEGAL_ADDRESS",
    "CUDA_ERROR_ILLEGAL_INSTRUCTION",
    "CUDA_ERROR_MISALIGNED_ADDRESS",
    "CUDA_ERROR_INVALID_ADDRESS_SPACE",
    "CUDA_ERROR_INVALID_PC",
    "CUDA_ERROR_HARDWARE_STACK_ERROR",
    "CUDA_ERROR_ASSERT",
    "CUDA_ERROR_LAUNCH_TIMEOUT",
    "unspecified launch failure",
    "an illegal memory access",
    "an illegal instruction",
)


@dataclass(frozen=True)
class DeviceProbe:
    """What the machine has. `error` is set when a device exists but cannot be used."""

    count: int
    name: str | None = None
    arch: str | None = None
    error: str | None = None

    @property
    def usable(self) -> bool:
        return self.count > 0 and self.error is None


@lru_cache(maxsize=None)
def probe() -> DeviceProbe:
    """Count devices, then make a context on the current one and run a tiny copy."""
    try:
        import cupy
    except Exception as exc:  # no CuPy, or CuPy cannot load its runtime
        return DeviceProbe(count=0, error=f"CuPy could not be imported: {exc}")
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:
        return DeviceProbe(count=0, error=f"no CUDA device was found ({_short(exc)})")
    if count == 0:
        return DeviceProbe(count=0, error="no CUDA device was found (the driver reports 0 devices)")
    try:
        dev = cupy.cuda.Device()
        props = cupy.cuda.runtime.getDeviceProperties(dev.id)
        name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
        arch = f"sm_{props['major']}{props['minor']}"
        check = cupy.arange(4, dtype=cupy.int32)
        if int(check.sum()) != 6:
            return DeviceProbe(count=count, name=name, arch=arch, error="a 4-element sum on the device was wrong")
    except Exception as exc:
        return DeviceProbe(count=count, error=f"a CUDA device exists but a context could not be made ({_short(exc)})")
    return DeviceProbe(count=count, name=name, arch=arch)


def device_arch() -> str | None:
    p = probe()
    return p.arch if p.usable else None


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def is_sticky_error(exc: BaseException) -> bool:
    """A CUDA error that poisons the context (a device trap, an illegal address...)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        text = f"{type(exc).__name__} {exc}"
        if any(name in text for name in STICKY_ERROR_NAMES):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def is_cuda_error(exc: BaseException) -> bool:
    name = type(exc).__name__
    return name in ("CUDARuntimeError", "CUDADriverError", "CUDAError") or is_sticky_error(exc)


def context_is_poisoned() -> bool:
    """True when a trivial device operation now fails: a sticky error happened."""
    try:
        import cupy

        cupy.cuda.runtime.deviceSynchronize()
        a = cupy.zeros(1, dtype=cupy.int32)
        a += 1
        return int(a.get()[0]) != 1
    except Exception:
        return True


def select_device_for_worker(worker_index: int) -> int | None:
    """With several GPUs, xdist worker i uses GPU i % count, chosen before any context
    exists in the worker. Returns the chosen id, or None with fewer than two GPUs."""
    try:
        import cupy

        count = cupy.cuda.runtime.getDeviceCount()
    except Exception:
        return None
    if count < 2:
        return None
    device_id = worker_index % count
    cupy.cuda.runtime.setDevice(device_id)
    return device_id
