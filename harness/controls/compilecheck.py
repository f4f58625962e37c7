"""Compile a control's perturbed modules once, into the cache the gate run will read.

The compile cache is content-addressed (source closure, options, name expressions, arch,
toolchain). Compiling the perturbed `.cu` here with the arch and cache folder the gate run
uses, and with the name expressions its launcher declares (NAME_EXPRESSIONS in the `.py`
beside the `.cu`, the tuple it loads the module with), means the gate run's
`harness.kernels.module` hits this cubin instead of compiling again, and the `--static`
check instantiates the same templates the gates do. A launcher that declares nothing is
compiled with no name expressions; its gate run then compiles once more (slower, never
wrong: a compile error there is still reported, as route `compile`).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

from harness.compile import CompileError, compile_file, declared_name_expressions, find_sources, source_closure


@dataclass(frozen=True)
class CompileCheck:
    """The outcome of compiling a control's perturbed modules."""

    ok: bool
    modules: tuple[str, ...]  # kernel-root-relative .cu files compiled
    compiled: int  # compile_file calls that ran NVRTC (cache misses)
    error: str | None = None  # the first CompileError, NVRTC log included
    seconds: float = 0.0


def dependents(kernel_root: Path, files: tuple[str, ...]) -> list[str]:
    """The `.cu` files under `kernel_root` whose source closure holds any of `files`."""
    root = Path(kernel_root).resolve()
    wanted = set(files)
    out = []
    for source in find_sources(root):
        rel = source.resolve().relative_to(root).as_posix()
        if rel in wanted or any(name in wanted for name, _ in source_closure(source, root)):
            out.append(rel)
    return out


def declared_names(kernel_root: Path) -> dict[str, tuple[str, ...]]:
    """{relpath: NAME_EXPRESSIONS} for every `.cu` of the (real) kernel root, read without
    writing __pycache__ into it."""
    root = Path(kernel_root).resolve()
    before = sys.dont_write_bytecode
    sys.dont_write_bytecode = True
    try:
        return {s.resolve().relative_to(root).as_posix(): declared_name_expressions(s) for s in find_sources(root)}
    finally:
        sys.dont_write_bytecode = before


def compile_perturbed(
    sandbox_root: Path,
    files: tuple[str, ...],
    *,
    arch: str | None,
    cache_dir: Path,
    names: dict[str, tuple[str, ...]],
) -> CompileCheck:
    """Compile every `.cu` in the sandbox that includes an edited file, with its launcher's
    name expressions (`names`, from `declared_names` over the real kernel root)."""
    start = time.perf_counter()
    modules = dependents(sandbox_root, files)
    misses = 0
    for rel in modules:
        try:
            compiled = compile_file(
                rel, kernel_root=sandbox_root, arch=arch, name_expressions=names.get(rel, ()), cache_dir=cache_dir,
            )
        except CompileError as exc:
            return CompileCheck(False, tuple(modules), misses, str(exc), time.perf_counter() - start)
        misses += not compiled.cache_hit
    return CompileCheck(True, tuple(modules), misses, None, time.perf_counter() - start)
