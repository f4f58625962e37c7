"""The GPU arch a module is compiled for: `--arch` or HARNESS_ARCH when given, checked against
what NVRTC targets, else the device's arch, else the default for a machine with no GPU."""

from __future__ import annotations

import re
import threading
from functools import lru_cache

from harness.compiling.toolchain import nvrtc_supported_arches, nvrtc_version
from harness.core import settings as _settings
from harness.core.errors import UsageError


class ArchError(UsageError):
    """An arch NVRTC cannot target."""


_CUDA_CORE = threading.Lock()


def cuda_core():
    """`cuda.core`, imported on its first use: a process that compiles nothing (a pool server
    or a CPU gate run over gates that compile nothing, a fake device's tests) does not pay for
    its import. Under a lock, because a first import of it from several threads at once
    races (the screen compiles in threads)."""
    with _CUDA_CORE:
        import cuda.core

    return cuda.core


@lru_cache(maxsize=None)
def supported_arches() -> tuple[str, ...]:
    return tuple(f"sm_{a}" for a in nvrtc_supported_arches())


_ARCH_VARIANT = re.compile(r"sm_(\d+)([a-z])")


@lru_cache(maxsize=None)
def _nvrtc_compiles_for(arch: str) -> bool:
    """Whether NVRTC compiles an empty kernel for `arch` (asked once per arch and process).
    A `cuda.core` that cannot be imported raises as it is: that is no answer about `arch`."""
    core = cuda_core()
    try:
        core.Program('extern "C" __global__ void harness_arch_probe() {}', "c++",
                     core.ProgramOptions(arch=arch)).compile("cubin")
    except Exception:
        return False
    return True


def check_arch(arch: str, source: str = "--arch") -> str:
    """`arch` when NVRTC targets it: one of NVRTC's supported arches, or an arch-specific or
    family variant of one (`sm_90a`, `sm_100f`) that a trial compile accepts. `source` names
    where the value came from (`--arch`, `HARNESS_ARCH`) for the error message."""
    arch = str(arch).strip()
    known = supported_arches()
    if arch in known:
        return arch
    m = _ARCH_VARIANT.fullmatch(arch)
    if m and f"sm_{m.group(1)}" in known and _nvrtc_compiles_for(arch):
        return arch
    fix = ("set HARNESS_ARCH to one of them, or unset it to use the device's arch"
           if source == "HARNESS_ARCH" else f"pass one of them (e.g. {source} sm_90)")
    raise ArchError(
        f"unknown {source} {arch!r}: NVRTC {nvrtc_version()} targets {', '.join(known)} and the "
        f"arch-specific variants it accepts (e.g. sm_90a); {fix}"
    )


def resolve_arch(arch: str | None = None, run: _settings.Settings | None = None) -> str:
    """`arch`, else the run's arch (`run`, by default the settings in effect), else the
    device's, else sm_90."""
    if arch:
        return check_arch(arch)
    settings = run if run is not None else _settings.in_effect()
    if settings.arch:
        return check_arch(settings.arch, settings.arch_source)
    from harness.core import device

    return check_arch(device.device_arch() or _settings.DEFAULT_ARCH_WITHOUT_DEVICE)


def arch_problem(arch: str | None, source: str) -> str | None:
    """`check_arch`'s one line for a bad `arch` given as `source`, or None."""
    if not arch:
        return None
    try:
        check_arch(arch, source)
    except ArchError as exc:
        return str(exc)
    return None
