"""The option list each compiler receives for a module's settings, and its recorded form: the
same list with include folders as labels, so what is recorded and hashed is the compiler's own
list and a sandbox copy of the kernel root records (and hits) the same."""

from __future__ import annotations

import re
from pathlib import Path

from harness import _settings
from harness.arch import cuda_core
from harness.includes import IncludePath, include_path
from harness.modsettings import ModuleSettings


def nvrtc_options(arch: str, ms: ModuleSettings, inc: IncludePath) -> list[str]:
    """The option list NVRTC receives, from `cuda.core.ProgramOptions` (its own spelling)
    plus the module's EXTRA_FLAGS verbatim."""
    po = cuda_core().ProgramOptions(
        arch=arch, std="c++17", ftz=ms.ftz_effective, prec_div=not ms.fast_math, prec_sqrt=not ms.fast_math,
        fma=ms.fmad, use_fast_math=ms.fast_math, include_path=[str(d) for d in inc.searched()],
        ptxas_options=["-v"],
        define_macro=[name if value is None else f"{name}={value}" for name, value in ms.defines] or None,
    )
    return [b.decode() for b in po.as_bytes("nvrtc")] + list(ms.extra_flags)


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
    root = _settings.current().kernel_root
    inc = include_path(root / "x.cu", root, ms.include_dirs)
    return normalise_options(nvrtc_options(arch, ms, inc), inc)
