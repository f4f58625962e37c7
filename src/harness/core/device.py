"""Finding the device, the require-gpu policy's facts, sticky-error detection, and
one GPU per xdist worker. Nothing here imports CuPy until it is asked a question."""

from __future__ import annotations

import os
from contextlib import contextmanager
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


_adopted: DeviceProbe | None = None
NO_DRIVER = ("no CUDA device was found: this machine has no NVIDIA driver (libcuda.so.1 is not installed); "
             "run the GPU gates on a machine with an NVIDIA GPU and its driver")
HIDDEN = ("no CUDA device was found: CUDA_VISIBLE_DEVICES is empty, which hides every device; "
          "unset it, or name a device, to run the GPU gates")


def adopt_probe(p: DeviceProbe) -> None:
    """The pytest process takes its probe from a worker, so it never makes a context itself."""
    global _adopted
    _adopted = p


def probe() -> DeviceProbe:
    """The adopted probe, or this process's own (count devices, make a context, run a tiny sum)."""
    return _adopted if _adopted is not None else _probe()


@lru_cache(maxsize=None)
def _probe() -> DeviceProbe:
    # The driver first: where it is missing, no device can be, and CuPy's import is not paid
    # by every process of a GPU-less machine that asks.
    if not _driver_present():
        return DeviceProbe(count=0, error=why_no_driver())
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


def _driver_present() -> bool:
    """Whether a device may be usable here, without initialising CUDA: CUDA_VISIBLE_DEVICES
    does not hide every device, and the NVIDIA driver's library loads. With every device
    hidden, a machine with a GPU is one with none: no pool, no probe process, no CuPy import."""
    import ctypes

    if visible_entries() == []:
        return False
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def why_no_driver() -> str:
    """Why `_driver_present()` said no: every device hidden, or no driver."""
    return HIDDEN if visible_entries() == [] else NO_DRIVER


def _uuid_text(raw) -> str:
    if isinstance(raw, str):
        return raw
    b = bytes(raw)[:16]
    if len(b) != 16:
        return ""
    h = b.hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def _driver_uuid(ordinal: int) -> str:
    try:
        from cuda.bindings import driver

        err, dev = driver.cuDeviceGet(ordinal)
        err, uuid = driver.cuDeviceGetUuid(dev)
        return _uuid_text(bytes(uuid.bytes)) if int(err) == 0 else ""
    except Exception:
        return ""


def list_devices() -> list[tuple[int, str, str]]:
    """(ordinal, name, UUID) of every visible device; empty when they cannot be read."""
    try:
        import cupy

        out = []
        for i in range(cupy.cuda.runtime.getDeviceCount()):
            props = cupy.cuda.runtime.getDeviceProperties(i)
            name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
            # The driver's own query first: CuPy reads the 16-byte UUID as a C string, so a
            # UUID holding a zero byte comes back cut short.
            uuid = _driver_uuid(i) or _uuid_text(props.get("uuid", b""))
            out.append((i, name, uuid))
        return out
    except Exception:
        return []


def current_device_facts() -> dict:
    """Name, UUID and ordinal (among the visible devices) of the device this process uses."""
    p = probe()
    facts = {"name": p.name or "", "uuid": "", "ordinal": 0}
    try:
        import cupy

        dev = cupy.cuda.Device().id
        facts["ordinal"] = dev
    except Exception as exc:
        facts["uuid_error"] = f"{type(exc).__name__}: {exc}"
        return facts
    for ordinal, name, uuid in list_devices():
        if ordinal == dev:
            facts["uuid"] = uuid
            facts["name"] = name or facts["name"]
    if not facts["uuid"]:
        facts["uuid_error"] = "the device's properties carry no UUID"
    return facts


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


@contextmanager
def guard_must_not_fire(claim: str):
    """For a gate whose claim is that valid input never trips a device guard (or faults):
    a CUDA error raised inside the block fails the gate by assertion, naming `claim`, with
    the fault chained (so the plugin still finds a poisoned context). Put the launch AND a
    synchronising read (`.get()`, `deviceSynchronize()`) inside the block: a fault surfaces
    at the first synchronisation. Any other exception passes through unchanged.

    Use it only where acceptance is the claim (a guard that rejects a valid index is the
    defect the gate exists for), never as a blanket wrapper: elsewhere a fault is a fault."""
    try:
        yield
    except Exception as exc:
        if not is_cuda_error(exc):
            raise
        raise AssertionError(f"{claim}: the device faulted instead ({_short(exc)})") from exc


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


# ------------------------------------------------------------------ which GPU, from CUDA_VISIBLE_DEVICES
# The one place that reads CUDA_VISIBLE_DEVICES to share GPUs out: an xdist worker's, a
# pool's, each campaign slot's and each control job's GPU.


def visible_entries() -> list[str] | None:
    """CUDA_VISIBLE_DEVICES' entries (empty when it hides every device), or None when unset."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return None
    return [v.strip() for v in visible.split(",") if v.strip()]


def visible_device(ordinal: int) -> str:
    """CUDA_VISIBLE_DEVICES for the ordinal-th device this process can see."""
    entries = visible_entries()
    if entries:
        return entries[ordinal % len(entries)]
    return str(ordinal)


def first_visible_ordinal() -> int | None:
    """The machine's index of the first device this process sees, when CUDA_VISIBLE_DEVICES
    names it by number (the ordinal a worker's records carry); None otherwise."""
    entries = visible_entries()
    return int(entries[0]) if entries and entries[0].isdigit() else None


def device_count_hint() -> int | None:
    """How many GPUs this process will see, without initialising CUDA: CUDA_VISIBLE_DEVICES
    when set, else the driver's /proc entries; None when neither says. Only a hint (MIG
    slices, say, are not counted): an xdist worker on a one-GPU machine starts its spare
    beside the device probe on it."""
    entries = visible_entries()
    if entries is not None:
        return len(entries) or None
    try:
        return len(os.listdir("/proc/driver/nvidia/gpus")) or None
    except OSError:
        return None


def ordinal_for_xdist_worker(workerid: str, count: int) -> int:
    """The GPU an xdist worker (gw0, gw1, ...) uses among `count`: round robin."""
    index = int(workerid[2:]) if workerid[2:].isdigit() else 0
    return index % max(count, 1)


def assignable_devices() -> list[str]:
    """The GPUs jobs can be pinned to (CUDA_VISIBLE_DEVICES values): its entries when set,
    else the indices nvidia-smi lists; empty when neither says."""
    import subprocess

    entries = visible_entries()
    if entries is not None:
        return entries
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]


def slot_devices(jobs: int) -> list[str | None]:
    """The GPU each of `jobs` slots runs on: GPU i % n of the n assignable, or None (the
    default device) when one is visible or one slot runs."""
    devices = assignable_devices() if jobs > 1 else []
    return [devices[i % len(devices)] if len(devices) > 1 else None for i in range(jobs)]


def ordinal_of(device: str | None) -> int | None:
    """The CUDA ordinal, in this process, of an assignable device (a CUDA_VISIBLE_DEVICES
    value), or None."""
    if device is None:
        return None
    entries = visible_entries() or []
    return entries.index(device) if device in entries else int(device) if device.isdigit() else None
