"""Process-wide settings the plugin sets once and launchers read.

Launchers in a kernel tree call `harness.kernels.module("x.cu")`; they cannot see pytest's
`config`, so the plugin hands the kernel root, the arch and the cache folder over here in
`pytest_configure`. Outside pytest the environment variables below apply.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

DEFAULT_KERNEL_ROOT = "kernels_cu"
DEFAULT_ARCH_WITHOUT_DEVICE = "sm_90"


@dataclass(frozen=True)
class Settings:
    kernel_root: Path
    arch: str | None  # None: the device's arch, or sm_90 with no device
    cache_dir: Path


def _default_cache_dir() -> Path:
    env = os.environ.get("HARNESS_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "harness" / "cubin"


def _from_environment() -> Settings:
    return Settings(
        kernel_root=Path(os.environ.get("HARNESS_KERNEL_ROOT", DEFAULT_KERNEL_ROOT)).resolve(),
        arch=os.environ.get("HARNESS_ARCH") or None,
        cache_dir=_default_cache_dir(),
    )


_current: Settings | None = None


def current() -> Settings:
    global _current
    if _current is None:
        _current = _from_environment()
    return _current


def configure(**changes) -> Settings:
    """Replace some settings (kernel_root, arch, cache_dir); returns the new settings."""
    global _current
    if "kernel_root" in changes and changes["kernel_root"] is not None:
        changes["kernel_root"] = Path(changes["kernel_root"]).resolve()
    if "cache_dir" in changes and changes["cache_dir"] is not None:
        changes["cache_dir"] = Path(changes["cache_dir"])
    changes = {k: v for k, v in changes.items() if v is not None or k == "arch"}
    _current = replace(current(), **changes)
    return _current


def reset() -> None:
    global _current
    _current = None
