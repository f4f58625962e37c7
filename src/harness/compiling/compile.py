"""NVRTC compilation to cubin through `cuda.core`, with a content-addressed disk cache.

Works with no GPU: the arch comes from `--arch`, the device, or `sm_90`. The cache key is
the whole source closure (the `.cu` and every header it includes from the kernel root),
the recorded options, the name expressions, the NVRTC version and the CUDA headers'
version, so a perturbed header can never hit a stale cubin.

`compile_file` puts together the arch (`harness.compiling.arch`), the include path and source closure
(`harness.compiling.includes`), the device view, the backend rule (`harness.compiling.backends`), the option
lists (`harness.compiling.options`), the cubin cache (`harness.compiling.cubin_cache`) and ptxas' report
(`harness.compiling.ptxas`).
"""

from __future__ import annotations

import importlib
import os
import re
import shutil
import tempfile
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

from harness.compiling import toolchain
from harness.compiling.arch import resolve_arch
from harness.compiling.backends import _compile_nvcc, _compile_nvrtc, _Failed, choose_backend
from harness.compiling.cubin_cache import cache_key, include_hashes, is_sandbox, lookup, write_entry
from harness.compiling.includes import closure_with_files, include_path, includes_of
from harness.compiling.modsettings import ModuleSettings, declared_settings
from harness.compiling.options import normalise_options, nvcc_options, nvrtc_options
from harness.compiling.ptxas import KernelResources, parse_resources
from harness.compiling.trap_shadow import TRAP_SHADOW_PREAMBLE
from harness.core import settings as _settings
from harness.core.errors import HarnessError


class CompileError(HarnessError):
    """A `.cu` did not compile. The message carries NVRTC's log and the options used."""

    def __init__(self, source: Path, log: str, options: tuple[str, ...], what: str = "NVRTC could not compile",
                 name_expressions: tuple[str, ...] = (), launcher: str | None = None):
        self.source = source
        self.log = log
        self.options = options
        first = _LOG_ERROR_LINE.search(log)
        head = f"{what} {source}"
        if first and first.group(1) == _NAME_MAP:  # NVRTC's own file of the name expressions
            head += (f": NAME_EXPRESSIONS{f' in {launcher}' if launcher else ''} {tuple(name_expressions)!r} names "
                     f"something {Path(source).name} does not define: {first.group(3).strip()}")
        elif first:
            where = "" if first.group(1) == str(source) else f"{first.group(1)} "
            head += f": {where}line {first.group(2)}: {first.group(3).strip()}"
        elif _LOG_OPTION_ERROR.search(log):  # an option, not a line: EXTRA_FLAGS, a --pre-include
            m = _LOG_OPTION_ERROR.search(log)
            head += f": {m.group(1) or ''}{m.group(2).strip()}"
        lines = [head, "", log.rstrip() or "(NVRTC printed no log)", ""]
        lines.append("options: " + " ".join(options))
        super().__init__("\n".join(lines))


    @property
    def location(self) -> tuple[Path, int | None]:
        """(file, 1-based line) of NVRTC's first error, else (the source, None)."""
        m = _LOG_ERROR.search(self.log)
        if m:
            return Path(m.group(1)), int(m.group(2))
        return self.source, None


class UnreadableSource(CompileError):
    """The `.cu`, or a header it includes, cannot be read: a one-line message naming the
    file, why, and what to do."""

    def __init__(self, path: Path, message: str):
        Exception.__init__(self, message)
        self.source, self.log, self.options = path, message, ()

    @classmethod
    def of(cls, path: Path, exc: OSError | None, source: Path) -> "UnreadableSource":
        """Why `path` (the `.cu` `source`, or a header it includes) cannot be read."""
        header = path != source
        if path.is_symlink() and not path.exists():
            why = f"a symlink to {os.readlink(path)}, which does not exist: fix the link or remove it"
        elif path.is_dir():
            why = ("a folder, not a .cu file: every *.cu under the kernel root is compiled as a kernel file; "
                   "rename it")
        else:
            reason = (exc.strerror if exc is not None and exc.strerror else str(exc)) if exc else "not a regular file"
            fix = "drop the #include" if header else "move it out of the kernel root"
            why = f"cannot be read ({reason}): make it readable (chmod a+r {path}), or {fix}"
        if header:
            head, _, fix = why.partition(": ")
            why = f"{head}, and {source.name} includes it: {fix}"
        return cls(path, f"{path}: {why}")


@contextmanager
def _reading(source: Path):
    """An OSError while reading `source` or a header it reaches is an `UnreadableSource`."""
    try:
        yield
    except OSError as exc:
        raise UnreadableSource.of(Path(exc.filename) if exc.filename else source, exc, source) from None


_LOG_ERROR = re.compile(r"^(.+?)\((\d+)\): (?:catastrophic )?error", re.MULTILINE)
_LOG_OPTION_ERROR = re.compile(r"^(?:(nvrtc: )error: |Command-line error: )(.*)$", re.MULTILINE)
_NAME_MAP = "__nv_name_map"
_LOG_ERROR_LINE = re.compile(r"^(.+?)\((\d+)\): (?:catastrophic )?error: ?(.*)$", re.MULTILINE)


@dataclass(frozen=True)
class CompiledModule:
    """One compiled `.cu`: what it was compiled from and with, its cache key and its cubin."""

    source: Path
    arch: str
    options: tuple[str, ...]
    name_expressions: tuple[str, ...]
    key: str
    cubin: bytes = field(repr=False)
    symbol_mapping: dict = field(repr=False)
    resources: tuple[KernelResources, ...]
    log: str = field(repr=False)
    cache_hit: bool
    seconds: float
    nvrtc_version: str
    cubin_path: Path | None = None
    backend: str = "nvrtc"  # "nvrtc" or "nvcc"
    backend_reason: str = "auto"
    set_aside: tuple = ()  # harness.compiling.deviceview.SetAside: what the device view left out
    compiler: str = ""  # "nvrtc 13.2" or "nvcc 13.0.88"
    trap_shadow: bool = False  # compiled with TRAP_SHADOW_PREAMBLE: `__trap()` counts instead of trapping
    files: tuple[tuple[Path, str], ...] = ()  # (path, sha256) of the .cu and the headers its closure read (harness.library.kernels' memo checks them)


def _read_source(path: Path, options: tuple[str, ...]) -> str:
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _bad_byte(path, data, exc.start, "is not UTF-8: NVRTC reads sources as UTF-8; save the file as UTF-8 "
                                               "(or remove the byte)", options) from None
    if "\0" in text:  # NVRTC and the syntax tree would stop reading there
        raise _bad_byte(path, data, data.index(b"\0"), "is a NUL: a source file holds text; remove it (a file "
                                                       "half-written, or not source at all?)", options)
    return text


def _bad_byte(path: Path, data: bytes, at: int, why: str, options) -> CompileError:
    line = data.count(b"\n", 0, at) + 1
    column = at - (data.rfind(b"\n", 0, at) + 1) + 1
    return CompileError(path, f"{path}({line}): error: byte 0x{data[at]:02x} at column {column} {why}", options,
                        what="could not read")


# ---------------------------------------------------------------- the entry point


def compile_file(
    source: str | os.PathLike,
    *,
    kernel_root: str | os.PathLike | None = None,
    arch: str | None = None,
    name_expressions: tuple[str, ...] | list[str] = (),
    defines: dict | None = None,
    fmad: bool | None = None,
    settings: ModuleSettings | None = None,
    cache_dir: str | os.PathLike | None = None,
    use_cache: bool = True,
    trap_shadow: bool = False,
    include_dirs: tuple[Path, ...] | None = None,
    run: _settings.Settings | None = None,
) -> CompiledModule:
    """Compile one `.cu` to a cubin. `source` is absolute or relative to the kernel root.

    The compile settings are the ones the launcher beside the `.cu` declares
    (`harness.compiling.modsettings`), or `settings` when given (the controls pass the real tree's);
    `name_expressions`, `defines` and `fmad` may repeat what the launcher declares, or give
    what it leaves undeclared. The file is compiled through its device-only view
    (`harness.compiling.deviceview`) by NVRTC, or by nvcc by the rule in `harness.compiling.backends.choose_backend`.
    `trap_shadow`: with TRAP_SHADOW_PREAMBLE before it (a mutation campaign's trap gates).
    `run`: the run's settings (kernel root, arch, cache, extra include folders, trap shadow),
    by default those in effect; `kernel_root`, `arch`, `cache_dir` and `include_dirs` (the run's
    extra include folders) override them."""
    run = run if run is not None else _settings.in_effect()
    run_dirs = tuple(include_dirs) if include_dirs is not None else run.include_dirs
    trap_shadow = trap_shadow or run.trap_shadow
    root = Path(kernel_root).resolve() if kernel_root is not None else run.kernel_root
    if not root.is_dir():
        raise FileNotFoundError(
            f"kernel root {root} does not exist or is not a folder: "
            "pass --kernel-root DIR (or set the ini key kernel_root) to the folder holding your .cu files"
        )
    path = Path(source)
    if not path.is_absolute():
        path = root / path
    if not path.is_file() and (path.is_symlink() or path.exists()):
        raise UnreadableSource.of(path, None, path)
    path = path.resolve()
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such .cu file under the kernel root {root}")
    arch = resolve_arch(arch, run)
    ms = settings if settings is not None else declared_settings(path)
    ms = ms.with_overrides(name_expressions=name_expressions, defines=defines, fmad=fmad)
    name_expressions = ms.name_expressions

    inc = include_path(path, root, ms.include_dirs, run_dirs=run_dirs)
    cache = Path(cache_dir) if cache_dir is not None else run.cache_dir
    spellings = cache if use_cache else None  # cuda.core's option spellings, kept beside the cubins
    provisional = normalise_options(nvrtc_options(arch, ms, inc, spellings), inc)
    with _reading(path):
        text_source = _read_source(path, provisional)
        closure, closure_files = closure_with_files(path, inc)
        view = None
        view_missing = False
        if ms.device_view:
            from harness.compiling.deviceview import DeviceViewError, available

            view_missing = not available()
        if ms.device_view and not view_missing:
            from harness.compiling.closureview import closure_view

            try:
                view = closure_view(path, text_source, inc, name_expressions)
            except DeviceViewError as exc:
                raise CompileError(path, str(exc), provisional, what="could not derive the device view of") from None
    compiled_text = view.view.text if view is not None else text_source
    program = path
    if view is not None and view.headers_changed:  # the compiler reads the headers' views from a folder made on a miss
        inc = replace(inc, view=Path(tempfile.gettempdir()) / f"harness-view-{os.getpid()}-{uuid.uuid4().hex[:12]}")
    if view is not None:
        view_includes, closure_headers = view.includes_kept()
    else:
        view_includes, closure_headers = [n for _, n in includes_of(compiled_text)], []
        for rel, _ in closure:
            p = root / rel if not rel.startswith("@") else None
            if p is not None and p != path and p.is_file():
                closure_headers += [n for _, n in includes_of(p.read_text(errors="replace"))]
    backend, backend_why = choose_backend(ms, view_includes, closure_headers)
    if view_missing:  # compiled as it is: right for device-only files; host code then fails, saying why
        backend_why += "; no device view (tree-sitter and tree-sitter-cuda are not installed)"
    if backend == "nvcc":
        nvcc = toolchain.require_nvcc(f"{path.name} is compiled by nvcc ({backend_why})")
        inc = replace(include_path(path, root, ms.include_dirs, backend="nvcc", run_dirs=run_dirs),
                      view=inc.view)
        real_options = nvcc_options(arch, ms, inc)
        compiler_version = f"nvcc {toolchain.nvcc_version(str(nvcc))}"
    else:
        real_options = nvrtc_options(arch, ms, inc, spellings)
        compiler_version = f"nvrtc {toolchain.nvrtc_version()}"
    options = normalise_options(real_options, inc)
    set_aside = view.set_aside if view is not None else ()
    key = cache_key(closure, options, name_expressions, arch, {
        "backend": backend, "compiler": compiler_version, "cccl": toolchain.cccl_version(),
        "shims": toolchain.shims_version() if backend == "nvrtc" else None,
        "device_view": (importlib.import_module("harness.compiling.deviceview").VERSION if view is not None else None),
        "set_aside": [str(s) for s in set_aside], "include_hashes": include_hashes(closure, inc.user),
        **({"trap_shadow": TRAP_SHADOW_PREAMBLE} if trap_shadow else {}),  # every other key as it was
    })
    start = time.perf_counter()
    hit, cubin_path, meta_path = lookup(cache, key, is_sandbox(root)) if use_cache else (None, None, None)

    def result(cubin: bytes, mapping: dict, log: str, hit: bool) -> CompiledModule:
        return CompiledModule(
            source=path, arch=arch, options=options, name_expressions=name_expressions, key=key,
            cubin=cubin, symbol_mapping=mapping, resources=parse_resources(log, mapping), log=log,
            cache_hit=hit, seconds=time.perf_counter() - start, nvrtc_version=toolchain.nvrtc_version(),
            cubin_path=cubin_path if use_cache else None, backend=backend, backend_reason=backend_why,
            set_aside=tuple(set_aside), compiler=compiler_version, trap_shadow=trap_shadow,
            files=closure_files,
        )

    if hit is not None:
        return result(*hit, hit=True)

    preamble = TRAP_SHADOW_PREAMBLE if trap_shadow else ""
    try:
        if inc.view is not None:
            program, compiled_text = view.write(inc.view, preamble)
        else:
            compiled_text = preamble + compiled_text
        if backend == "nvcc":
            cubin, mapping, text = _compile_nvcc(nvcc, program, compiled_text, real_options, name_expressions)
        else:
            cubin, mapping, text = _compile_nvrtc(program, compiled_text, real_options, name_expressions)
    except _Failed as exc:
        log_text = exc.log if inc.view is None else exc.log.replace(str(inc.view), str(root))
        if view_missing:
            log_text = log_text.rstrip() + (
                "\n\nthe file was compiled as it is, with no device view: tree-sitter and tree-sitter-cuda are not "
                "installed (pip install tree-sitter tree-sitter-cuda; on a machine with no registry, carry their "
                "wheels), so host code and host-only includes were not set aside")
        if set_aside:
            from harness.compiling.deviceview import grouped

            log_text = log_text.rstrip() + (
                "\n\nthe device view set aside (if device code needs one of these, see docs/your-kernels.md, "
                "'Host code'):\n" + "\n".join(f"  {s}" for s in grouped(set_aside)))
        if view is not None and view.kept_host:
            log_text = log_text.rstrip() + (
                "\n\nkept although host-only, because kept code names them (each with what makes it usable in "
                "device code):\n" + "\n".join(f"  {s}" for s in view.kept_host))
        raise CompileError(path, log_text, options,
                           what="nvcc could not compile" if backend == "nvcc" else "NVRTC could not compile",
                           name_expressions=name_expressions, launcher=ms.declared_in) from None
    finally:
        if inc.view is not None:
            shutil.rmtree(inc.view, ignore_errors=True)
    if use_cache:
        about = {"source": str(path), "closure": closure, "options": list(options), "backend": backend,
                 "set_aside": [str(s) for s in set_aside], "name_expressions": list(name_expressions)}
        write_entry(cache, cubin_path, meta_path, cubin, about, mapping, text)
    return result(cubin, mapping, text, hit=False)


LAUNCHER_ATTRIBUTE = "NAME_EXPRESSIONS"


def declared_name_expressions(source: str | os.PathLike) -> tuple[str, ...]:
    """The C++ name expressions the launcher beside `x.cu` declares (`NAME_EXPRESSIONS`);
    `()` when there is none. Raises `LauncherError` (one line)."""
    return declared_settings(source).name_expressions


def find_sources(kernel_root: str | os.PathLike) -> list[Path]:
    root = Path(kernel_root)
    if not root.is_dir():
        raise FileNotFoundError(
            f"kernel root {root} does not exist or is not a folder: "
            "pass --kernel-root DIR to the folder holding your .cu files"
        )
    return sorted(p.resolve() for p in root.rglob("*.cu") if p.is_file())


def not_files(kernel_root: str | os.PathLike) -> list[Path]:
    """The `*.cu` entries under the kernel root that are not files (a broken symlink, a folder):
    `find_sources` skips them, so the compile command and the compile items name them instead
    (`compile_file` raises `UnreadableSource` for one)."""
    root = Path(kernel_root)
    return sorted(p.parent.resolve() / p.name for p in root.rglob("*.cu") if not p.is_file())
