"""Compile a perturbed tree's modules once, into the cache the gate run will read.

The compile cache is content-addressed (source closure, options, name expressions, arch,
toolchain). Compiling the perturbed `.cu` here with the arch and cache folder the gate run
uses, and with the name expressions its launcher declares (NAME_EXPRESSIONS in the `.py`
beside the `.cu`, the tuple it loads the module with), means the gate run's
`harness.library.kernels.module` hits this cubin instead of compiling again, and the `--static`
check instantiates the same templates the gates do. A launcher that declares nothing is
compiled with no name expressions; its gate run then compiles once more (slower, never
wrong: a compile error there is still reported, as route `compile`).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from harness.compiling.compile import CompileError, compile_file, find_sources
from harness.compiling.includes import source_closure
from harness.compiling.modsettings import LauncherError, ModuleSettings, declared_settings
from harness.compiling.toolchain import NvccNotFound
from harness.core import settings as _settings
from harness.core.settings import IncludeDirError


@dataclass(frozen=True)
class CompileCheck:
    """The outcome of compiling a control's perturbed modules."""

    ok: bool
    modules: tuple[str, ...]  # kernel-root-relative .cu files compiled
    compiled: int  # compile_file calls that ran NVRTC (cache misses)
    error: str | None = None  # the first CompileError, NVRTC log included
    seconds: float = 0.0


def dependents(kernel_root: Path, files: tuple[str, ...], include_dirs: tuple[Path, ...] = ()) -> list[str]:
    """The `.cu` files under `kernel_root` whose source closure (through the run's extra
    `include_dirs`) holds any of `files`."""
    root = Path(kernel_root).resolve()
    wanted = set(files)
    out = []
    for source in find_sources(root):
        rel = source.resolve().relative_to(root).as_posix()
        if rel in wanted or any(name in wanted for name, _ in source_closure(source, root, include_dirs)):
            out.append(rel)
    return out


class Declared(dict):
    """{relpath: ModuleSettings} of the real kernel root `root`, and the run's extra include
    folders (`include_dirs`) every compile of the campaign passes down."""

    def __init__(self, root: Path, items, include_dirs: tuple[Path, ...] = ()):
        super().__init__(items)
        self.root = root
        self.include_dirs = tuple(include_dirs)


def declared_names(kernel_root: Path) -> Declared:
    """{relpath: the compile settings its launcher declares (harness.compiling.modsettings)} for every
    `.cu` of the (real) kernel root, read without writing __pycache__ into it; with the extra
    include folders of the settings in effect, else the project's ini `harness_include_dirs`
    (the rootdir found from the kernel root up)."""
    root = Path(kernel_root).resolve()
    dirs = _settings.in_effect().include_dirs
    if not dirs:
        rootdir = _settings.find_rootdir(root)
        dirs = _settings.include_dirs((), _settings.ini_lines(rootdir, _settings.INCLUDE_DIRS_INI), rootdir)
    before = sys.dont_write_bytecode
    sys.dont_write_bytecode = True
    try:
        return Declared(root, {s.resolve().relative_to(root).as_posix(): declared_settings(s)
                               for s in find_sources(root)}, dirs)
    finally:
        sys.dont_write_bytecode = before


def run_dirs(names: dict) -> tuple[Path, ...]:
    """The extra include folders a campaign's compiles pass down (`Declared.include_dirs`)."""
    return getattr(names, "include_dirs", ())


def _in_sandbox(ms: ModuleSettings, real_root: Path | None, sandbox_root: Path) -> ModuleSettings:
    """`ms` with include directories inside the real kernel root moved to the sandbox copy."""
    if real_root is None or not ms.include_dirs:
        return ms
    dirs = tuple(sandbox_root / d.relative_to(real_root) if d.is_relative_to(real_root) else d
                 for d in ms.include_dirs)
    return replace(ms, include_dirs=dirs)


def settings_for(names: dict, rel: str, sandbox_root: Path) -> ModuleSettings:
    """The settings module `rel` of a (sandbox copy of the) kernel root compiles with: what
    its launcher declares in the real root (`names`, from `declared_names`; a tuple of name
    expressions is accepted too), include directories moved into the copy."""
    declared = names.get(rel)
    if declared is None or isinstance(declared, (tuple, list)):
        return ModuleSettings(name_expressions=tuple(declared or ()))
    return _in_sandbox(declared, getattr(names, "root", None), Path(sandbox_root).resolve())


def compile_perturbed(
    sandbox_root: Path,
    files: tuple[str, ...],
    *,
    arch: str | None,
    cache_dir: Path,
    names: dict,
) -> CompileCheck:
    """Compile every `.cu` in the sandbox that includes an edited file, with the settings its
    launcher declares (`names`, from `declared_names` over the real kernel root; a tuple of
    name expressions is accepted too)."""
    start = time.perf_counter()
    modules = dependents(sandbox_root, files, run_dirs(names))
    misses = 0
    for rel in modules:
        ms = settings_for(names, rel, sandbox_root)
        try:
            compiled = compile_file(rel, kernel_root=sandbox_root, arch=arch, settings=ms, cache_dir=cache_dir,
                                    include_dirs=run_dirs(names))
        except (CompileError, LauncherError, IncludeDirError, NvccNotFound) as exc:
            return CompileCheck(False, tuple(modules), misses, str(exc), time.perf_counter() - start)
        misses += not compiled.cache_hit
    return CompileCheck(True, tuple(modules), misses, None, time.perf_counter() - start)
