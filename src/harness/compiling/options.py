"""The option list each compiler receives for a module's settings, and its recorded form: the
same list with include folders as labels, so what is recorded and hashed is the compiler's own
list and a sandbox copy of the kernel root records (and hits) the same."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import re
from functools import lru_cache
from pathlib import Path

from harness.compiling.arch import cuda_core
from harness.compiling.cubin_cache import atomic_write
from harness.compiling.includes import IncludePath, include_path
from harness.compiling.modsettings import ModuleSettings
from harness.core import settings as _settings


def nvrtc_options(arch: str, ms: ModuleSettings, inc: IncludePath, cache_dir: Path | None = None) -> list[str]:
    """The option list NVRTC receives, from `cuda.core.ProgramOptions` (its own spelling,
    kept in `cache_dir` when given) plus the module's EXTRA_FLAGS verbatim. The include
    folders are spelled as placeholders, then put in: a sandbox (each mutant's, each
    control's) is another folder, never another spelling."""
    folders = [str(d) for d in inc.searched()]
    marks = [_INCLUDE_MARK.format(i) for i in range(len(folders))]
    spelled = spelled_for_nvrtc(cache_dir, dict(
        arch=arch, std="c++17", ftz=ms.ftz_effective, prec_div=not ms.fast_math, prec_sqrt=not ms.fast_math,
        fma=ms.fmad, use_fast_math=ms.fast_math, include_path=marks, ptxas_options=["-v"],
        define_macro=[name if value is None else f"{name}={value}" for name, value in ms.defines] or None,
    ))
    real = dict(zip(marks, folders))
    return [_INCLUDE_MARKS.sub(lambda m: real[m.group(0)], o) for o in spelled] + nvrtc_extra_flags(ms.extra_flags)


# An upstream build's nvcc flags (a torch extension's setup.py) that NVRTC does not take, as
# NVRTC takes them, so a launcher declares the upstream build's EXTRA_FLAGS as they are:
# - relaxed constexpr: NVRTC's JIT mode allows no host function at all, so the unannotated
#   constexpr helpers device code calls compile as device functions (-default-device); the
#   device view has set aside every unannotated function no kept code names;
# - extended lambdas: a __device__ lambda handed to a kernel from host code, set aside;
# - -O<n>, --threads <n>: nvcc's host-code optimisation and parallel build (ptxas already
#   optimises device code fully).
_AS_NVRTC = {"--expt-relaxed-constexpr": "-default-device", "-expt-relaxed-constexpr": "-default-device"}
_HOST_SIDE = re.compile(r"^(-O[0-3s]?|--optimize=\d|-?-expt-extended-lambda|-?-extended-lambda|--threads=\d+|-t\d+)$")
_HOST_SIDE_WITH_VALUE = ("--threads", "-t", "--optimize")


def nvrtc_extra_flags(flags) -> list[str]:
    """A module's EXTRA_FLAGS as NVRTC receives them: nvcc-only flags of an upstream build
    spelled for NVRTC or dropped (above), the rest verbatim, each once."""
    out, skip = [], False
    for flag in flags:
        if skip:
            skip = False
            continue
        if flag in _HOST_SIDE_WITH_VALUE:
            skip = True
            continue
        if _HOST_SIDE.match(flag):
            continue
        flag = _AS_NVRTC.get(flag, flag)
        if flag not in out or not flag.startswith("-default-device"):
            out.append(flag)
    return out


_INCLUDE_MARK = "@harness-include-{}@"
_INCLUDE_MARKS = re.compile(r"@harness-include-\d+@")


OPTIONS_FOLDER = "nvrtc-options"  # in the cache dir: cuda.core's spellings, a few hundred bytes each
_SPELLED: dict[str, tuple[str, ...]] = {}


def spelled_for_nvrtc(cache_dir: Path | None, program_options: dict) -> tuple[str, ...]:
    """`cuda.core.ProgramOptions(**program_options).as_bytes("nvrtc")`, decoded. A compile
    whose cubin is cached needs nothing of `cuda.core` but this list (the cache key holds it),
    and importing `cuda.core` would be paid by every process that compiles: so each spelling is
    kept in `cache_dir` (`nvrtc-options/`, none when None) under `cuda.core`'s version and the
    options, and a process that finds it there never imports `cuda.core`. Another version of
    it, or other options, is another entry; a missing or unreadable one is spelled again."""
    version = _cuda_core_version()
    text = json.dumps([version, program_options], sort_keys=True)
    if text in _SPELLED:
        return _SPELLED[text]
    path = None
    if version is not None and cache_dir is not None:
        path = Path(cache_dir) / OPTIONS_FOLDER / f"{hashlib.sha256(text.encode()).hexdigest()[:40]}.json"
    spelled = _read_spelling(path, text) if path is not None else None
    if spelled is None:
        po = cuda_core().ProgramOptions(**program_options)
        spelled = tuple(b.decode() for b in po.as_bytes("nvrtc"))
        if path is not None:
            _write_spelling(path, text, spelled)
    _SPELLED[text] = spelled
    return spelled


@lru_cache(maxsize=None)
def _cuda_core_version() -> str | None:
    """The installed `cuda-core`'s version, read from its metadata (no import); None when it
    cannot be read, and then nothing is kept on disk."""
    try:
        return importlib.metadata.version("cuda-core")
    except Exception:  # noqa: BLE001 - unknown: spell it every time
        return None


def _read_spelling(path: Path, text: str) -> tuple[str, ...] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    spelled = data.get("spelled") if isinstance(data, dict) and data.get("of") == text else None
    if not isinstance(spelled, list) or not all(isinstance(o, str) for o in spelled):
        return None
    return tuple(spelled)


def _write_spelling(path: Path, text: str, spelled: tuple[str, ...]) -> None:
    try:  # a temporary file of its own (threads of the screen spell at once), then renamed
        atomic_write(path, json.dumps({"of": text, "spelled": list(spelled)}).encode())
    except OSError:  # a read-only or full cache dir: the next process spells it again, nothing else
        pass


def nvcc_options(arch: str, ms: ModuleSettings, inc: IncludePath) -> list[str]:
    """The nvcc command line between `nvcc` and the input and output files."""
    opts = [f"-arch={arch}", "--cubin", "-std=c++17", f"--ftz={str(ms.ftz_effective).lower()}",
            f"--prec-div={str(not ms.fast_math).lower()}", f"--prec-sqrt={str(not ms.fast_math).lower()}",
            f"--fmad={str(ms.fmad).lower()}"]
    if ms.fast_math:
        opts.append("--use_fast_math")
    opts += [f"-D{name}" if value is None else f"-D{name}={value}" for name, value in ms.defines]
    opts += [f"-I{d}" for d in inc.searched()]
    opts += ["-Xptxas=-v", *ms.extra_flags]
    return opts


_PATH_OPTION = re.compile(r"^(--include-path=|-I)(.+)$")


def normalise_options(options: list[str], inc: IncludePath) -> tuple[str, ...]:
    """`options` with every include folder replaced by its label (`$ROOT/...`, `@cccl`, ...),
    so the recorded and hashed options are the compiler's own list and a sandbox copy of the
    kernel root records (and hits) the same."""
    out = []
    for o in options:
        m = _PATH_OPTION.match(o)
        out.append(m.group(1) + inc.label(Path(m.group(2))) if m else o)
    return tuple(out)


def recorded_options(arch: str, defines: dict | None = None, fmad: bool = True,
                     settings: ModuleSettings | None = None) -> tuple[str, ...]:
    """The options a module with these settings is compiled with by NVRTC, as recorded:
    derived from the very list NVRTC receives, include folders as labels. With no kernel
    root at hand the source folder is the root (`$ROOT`)."""
    ms = settings or ModuleSettings()
    if defines:
        ms = ms.with_overrides(defines=defines)
    if not fmad:
        ms = ms.with_overrides(fmad=False)
    run = _settings.in_effect()
    inc = include_path(run.kernel_root / "x.cu", run.kernel_root, ms.include_dirs, run_dirs=run.include_dirs)
    return normalise_options(nvrtc_options(arch, ms, inc, run.cache_dir), inc)
