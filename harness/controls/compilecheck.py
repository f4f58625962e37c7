"""Compile a control's perturbed modules once, into the cache the gate run will read.

The compile cache is content-addressed (source closure, options, name expressions, arch,
toolchain), so compiling the perturbed `.cu` here with the same arch, cache folder, name
expressions and defines the launcher uses means the gate run's `harness.kernels.module`
hits this cubin instead of compiling again. Which name expressions a launcher uses is
learnt from the cache entries the unperturbed baseline left (`known_variants`); a module
no gate has loaded yet is compiled with none.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from harness.compile import CompileError, compile_file, find_sources, source_closure


@dataclass(frozen=True)
class Variant:
    """One way a launcher loads a `.cu`: its `compile_file` arguments besides the path."""

    name_expressions: tuple[str, ...] = ()
    defines: tuple[tuple[str, str | None], ...] = ()
    fmad: bool = True


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


def _variant_from(meta: dict) -> Variant:
    defines: list[tuple[str, str | None]] = []
    fmad = True
    for opt in meta.get("options", []):
        if opt.startswith("-D"):
            name, eq, value = opt[2:].partition("=")
            defines.append((name, value if eq else None))
        elif opt.startswith("--fmad="):
            fmad = opt.split("=", 1)[1] == "true"
    return Variant(tuple(meta.get("name_expressions", ())), tuple(defines), fmad)


def known_variants(kernel_root: Path, cache_dir: Path) -> dict[str, list[Variant]]:
    """For each `.cu` of `kernel_root`, the variants its current text was compiled with,
    read from the cache entries (whichever root they were compiled from)."""
    root = Path(kernel_root).resolve()
    closures = {}
    for source in find_sources(root):
        rel = source.resolve().relative_to(root).as_posix()
        closures[rel] = [list(pair) for pair in source_closure(source, root)]
    found: dict[str, list[Variant]] = {}
    if not Path(cache_dir).is_dir():
        return found
    for meta_path in sorted(Path(cache_dir).glob("*/*.json")):
        try:
            meta = json.loads(meta_path.read_text())
        except (OSError, ValueError):
            continue
        source = Path(meta.get("source", "")).as_posix()
        for rel, closure in closures.items():
            if (source == rel or source.endswith("/" + rel)) and meta.get("closure") == closure:
                variant = _variant_from(meta)
                if variant not in found.setdefault(rel, []):
                    found[rel].append(variant)
    return found


def compile_perturbed(
    sandbox_root: Path,
    files: tuple[str, ...],
    *,
    arch: str | None,
    cache_dir: Path,
    variants: dict[str, list[Variant]],
) -> CompileCheck:
    """Compile every `.cu` in the sandbox that includes an edited file, once per variant."""
    import time

    start = time.perf_counter()
    modules = dependents(sandbox_root, files)
    misses = 0
    for rel in modules:
        for variant in variants.get(rel) or [Variant()]:
            try:
                compiled = compile_file(
                    rel,
                    kernel_root=sandbox_root,
                    arch=arch,
                    name_expressions=variant.name_expressions,
                    defines=dict(variant.defines) or None,
                    fmad=variant.fmad,
                    cache_dir=cache_dir,
                )
            except CompileError as exc:
                return CompileCheck(False, tuple(modules), misses, str(exc), time.perf_counter() - start)
            misses += not compiled.cache_hit
    return CompileCheck(True, tuple(modules), misses, None, time.perf_counter() - start)
