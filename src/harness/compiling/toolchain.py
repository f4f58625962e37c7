"""Where the compilers and the headers outside the kernel root are, and their versions: NVRTC
and the CUDA headers, CCCL, the user's include directories, the NVRTC shims for C++ standard
headers, and nvcc.

CCCL (cub, thrust, libcu++ `<cuda/std/...>`, `<nv/target>`, which `<cooperative_groups.h>`
needs) is found by default, first match wins:

1. `$CUDA_HOME/include/cccl` (or `$CUDA_PATH/include/cccl`), when the variable is set;
2. `/usr/local/cuda/include/cccl` (a CUDA 13 toolkit);
3. the `nvidia-cuda-cccl` wheel (`cuda.pathfinder.find_nvidia_header_directory("cccl")`);
4. the copy CuPy bundles (`cupy/_core/include/cupy/_cccl`: its `cub`, `libcudacxx`, `thrust`).

Headers outside the kernel root enter the cache key by version (the CUDA headers' and
CCCL's version numbers) or by content (every header a module includes from a user include
directory), never by absolute path, and the control sandbox copies only the kernel root.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from harness.core.errors import SetupError

NVCC_ENV = "HARNESS_NVCC"
SHIMS = Path(__file__).resolve().parent / "shims"
STANDIN = Path(__file__).resolve().parent / "standin"  # harness_set_aside.h (harness.compiling.deviceview), both compilers


class NvccNotFound(SetupError, RuntimeError):
    """nvcc was asked for (by a launcher or by the backend rule) and is not installed."""


@dataclass(frozen=True)
class IncludeSet:
    """One set of headers outside the kernel root, as it enters the options and the key."""

    label: str  # how recorded options spell it: "@cuda", "@cccl", "@shims", "@include0"
    dirs: tuple[Path, ...]
    version: str  # a version string, or the content hash for user dirs (filled per module)


# ------------------------------------------------------------------ NVRTC and the CUDA headers


@lru_cache(maxsize=None)
def _nvrtc_library():
    """NVRTC's shared library, the one `cuda.bindings` loads (through `cuda.pathfinder`), for
    the two questions that need no program: its version and the arches it targets. Every
    process that compiles asks them (the cache key holds the version), a cached compile asks
    nothing else, and importing `cuda.bindings.nvrtc` pulls in the driver bindings too, a cost
    a cached compile need not pay. None when it cannot be loaded so: then `cuda.bindings`
    answers, or raises its own error."""
    try:
        import ctypes

        from cuda.pathfinder import load_nvidia_dynamic_lib

        lib = ctypes.CDLL(load_nvidia_dynamic_lib("nvrtc").abs_path)
        for name in ("nvrtcVersion", "nvrtcGetNumSupportedArchs", "nvrtcGetSupportedArchs"):
            getattr(lib, name).restype = ctypes.c_int
        return lib
    except Exception:  # noqa: BLE001 - any failure: the bindings' own route and its message
        return None


@lru_cache(maxsize=None)
def nvrtc_version() -> str:
    import ctypes

    lib = _nvrtc_library()
    major, minor = ctypes.c_int(), ctypes.c_int()
    if lib is not None and lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)) == 0:
        return f"{major.value}.{minor.value}"
    from cuda.bindings import nvrtc

    err, major, minor = nvrtc.nvrtcVersion()
    if int(err) != 0:
        raise RuntimeError(f"nvrtcVersion failed: {err}")
    return f"{major}.{minor}"


@lru_cache(maxsize=None)
def nvrtc_supported_arches() -> tuple[int, ...]:
    """The compute capabilities NVRTC targets (75, 80, ..., 120), as `nvrtcGetSupportedArchs`."""
    import ctypes

    lib = _nvrtc_library()
    count = ctypes.c_int()
    if lib is not None and lib.nvrtcGetNumSupportedArchs(ctypes.byref(count)) == 0 and count.value > 0:
        arches = (ctypes.c_int * count.value)()
        if lib.nvrtcGetSupportedArchs(arches) == 0:
            return tuple(arches)
    from cuda.bindings import nvrtc

    err, arches = nvrtc.nvrtcGetSupportedArchs()
    if int(err) != 0:
        raise RuntimeError(f"nvrtcGetSupportedArchs failed: {err}")
    return tuple(arches)


@lru_cache(maxsize=None)
def cuda_include_dir() -> Path:
    from cuda.pathfinder import find_nvidia_header_directory

    found = find_nvidia_header_directory("cudart")
    if not found:
        raise RuntimeError(
            "the CUDA runtime headers (cuda_runtime.h, cuda_bf16.h) were not found: "
            "install nvidia-cuda-runtime (pip) or set CUDA_HOME to a CUDA toolkit"
        )
    return Path(found)


@lru_cache(maxsize=None)
def cuda_headers_version() -> str:
    """CUDART_VERSION of the CUDA headers NVRTC compiles against (in the cache key and labels)."""
    header = cuda_include_dir() / "cuda_runtime_api.h"
    try:
        text = header.read_text(errors="replace")
    except OSError:
        return "unknown"
    m = re.search(r"#define\s+CUDART_VERSION\s+(\d+)", text)
    return m.group(1) if m else "unknown"


# ------------------------------------------------------------------ CCCL, the shims, include directories


@lru_cache(maxsize=None)
def cccl_dirs() -> tuple[tuple[Path, ...], str]:
    """(include dirs, where they came from) for CCCL, by the order in the module docstring;
    ((), "not found") when none has it."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(var)
        if home and (Path(home) / "include" / "cccl" / "cuda").is_dir():
            return (Path(home, "include", "cccl").resolve(),), f"${var}/include/cccl"
    toolkit = Path("/usr/local/cuda/include/cccl")
    if (toolkit / "cuda").is_dir():
        return (toolkit.resolve(),), str(toolkit)
    try:
        from cuda.pathfinder import find_nvidia_header_directory

        found = find_nvidia_header_directory("cccl")
    except Exception:
        found = None
    if found and "site-packages" in str(found) and (Path(found) / "cuda").is_dir():
        return (Path(found).resolve(),), "the nvidia-cuda-cccl wheel"
    bundled = cupy_bundled_cccl()
    if bundled is not None and (bundled / "libcudacxx" / "cuda").is_dir():
        return (bundled / "libcudacxx", bundled / "cub", bundled / "thrust"), "CuPy's bundled copy"
    return (), "not found"


def cupy_bundled_cccl() -> Path | None:
    """Where CuPy's bundled CCCL would be, found without importing CuPy (its import costs
    more than the lookup it would serve); None without CuPy."""
    try:
        spec = importlib.util.find_spec("cupy")
    except (ImportError, ValueError):
        return None
    where = list(spec.submodule_search_locations or ()) if spec is not None else []
    return Path(where[0]).resolve() / "_core" / "include" / "cupy" / "_cccl" if where else None


@lru_cache(maxsize=None)
def cccl_version() -> str:
    dirs, where = cccl_dirs()
    for d in dirs:
        header = d / "cuda" / "std" / "__cccl" / "version.h"
        if header.is_file():
            m = re.search(r"#\s*define\s+CCCL_VERSION\s+(\d+)", header.read_text(errors="replace"))
            if m:
                return m.group(1)
    return "none" if not dirs else f"unknown ({where})"


@lru_cache(maxsize=None)
def shims_version(folder: Path = SHIMS) -> str:
    """A hash of the files in `folder` (the NVRTC shims by default; `STANDIN` too): their
    version in the cache key and the recorded options."""
    h = hashlib.sha256()
    for p in sorted(folder.iterdir()):
        if p.is_file():
            h.update(p.name.encode() + b"\0" + p.read_bytes())
    return h.hexdigest()[:16]


# ------------------------------------------------------------------ nvcc


def find_nvcc() -> Path | None:
    """nvcc: HARNESS_NVCC, else PATH, else $CUDA_HOME/bin, /usr/local/cuda/bin, else the
    nvidia-cuda-nvcc wheel."""
    env = os.environ.get(NVCC_ENV)
    if env:
        return Path(env) if Path(env).is_file() else None
    found = shutil.which("nvcc")
    if found:
        return Path(found)
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and (Path(home) / "bin" / "nvcc").is_file():
            return Path(home) / "bin" / "nvcc"
    try:
        from cuda.pathfinder import find_nvidia_binary_utility

        found = find_nvidia_binary_utility("nvcc")
        return Path(found) if found else None
    except Exception:
        return None


def require_nvcc(why: str) -> Path:
    nvcc = find_nvcc()
    if nvcc is None:
        where = (f"HARNESS_NVCC={os.environ[NVCC_ENV]} is not a file" if os.environ.get(NVCC_ENV)
                 else "not on PATH, in $CUDA_HOME/bin or /usr/local/cuda/bin, nor the nvidia-cuda-nvcc wheel")
        raise NvccNotFound(
            f"{why}, but nvcc was not found ({where}): install a CUDA toolkit or `pip install nvidia-cuda-nvcc`, "
            "or set HARNESS_NVCC to the nvcc binary; or set COMPILER = \"nvrtc\" in the launcher if NVRTC can take "
            "the file")
    return nvcc


@lru_cache(maxsize=None)
def nvcc_version(nvcc: str) -> str:
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    m = re.search(r"release [\d.]+, V([\d.]+)", out)
    return m.group(1) if m else "unknown"


def demangle(symbols: list[str]) -> dict[str, str]:
    """{mangled: demangled} through c++filt (binutils, which nvcc's host compiler brings);
    {} when c++filt is absent."""
    tool = shutil.which("c++filt") or shutil.which("cu++filt")
    if not tool or not symbols:
        return {}
    try:
        out = subprocess.run([tool], input="\n".join(symbols) + "\n", capture_output=True, text=True,
                             timeout=60).stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        return {}
    return dict(zip(symbols, out)) if len(out) == len(symbols) else {}
