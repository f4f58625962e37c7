"""NVRTC compilation to cubin through `cuda.core`, with a content-addressed disk cache.

Works with no GPU: the arch comes from `--arch`, the device, or `sm_90`. The cache key is
the whole source closure (the `.cu` and every header it includes from the kernel root),
the recorded options, the name expressions, the NVRTC version and the CUDA headers'
version, so a perturbed header can never hit a stale cubin.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from cuda.core import Program, ProgramOptions  # at import: a first import from several threads races

from harness import _settings
from harness.backends import _compile_nvcc, _compile_nvrtc, _Failed
from harness.modsettings import LauncherError, ModuleSettings, _import_root, declared_settings  # noqa: F401 (re-exported)

CACHE_FORMAT = 1
_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*[<"]([^>"]+)[>"]', re.MULTILINE)


class CompileError(Exception):
    """A `.cu` did not compile. The message carries NVRTC's log and the options used."""

    def __init__(self, source: Path, log: str, options: tuple[str, ...], what: str = "NVRTC could not compile"):
        self.source = source
        self.log = log
        self.options = options
        first = _LOG_ERROR_LINE.search(log)
        head = f"{what} {source}"
        if first:
            where = "" if first.group(1) == str(source) else f"{first.group(1)} "
            head += f": {where}line {first.group(2)}: {first.group(3).strip()}"
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


_LOG_ERROR = re.compile(r"^(.+?)\((\d+)\): (?:catastrophic )?error", re.MULTILINE)
_LOG_ERROR_LINE = re.compile(r"^(.+?)\((\d+)\): (?:catastrophic )?error: ?(.*)$", re.MULTILINE)


class ArchError(ValueError):
    """An arch NVRTC cannot target."""


@dataclass(frozen=True)
class KernelResources:
    """ptxas' report for one entry function."""

    kernel: str  # the name expression when one maps to it, else the symbol
    symbol: str
    registers: int
    spill_stores: int
    spill_loads: int
    shared_bytes: int
    stack_bytes: int

    @property
    def spill_bytes(self) -> int:
        return self.spill_stores + self.spill_loads


@dataclass(frozen=True)
class CompiledModule:
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
    set_aside: tuple = ()  # harness.deviceview.SetAside: what the device view left out
    compiler: str = ""  # "nvrtc 13.2" or "nvcc 13.0.88"
    trap_shadow: bool = False  # compiled with TRAP_SHADOW_PREAMBLE: `__trap()` counts instead of trapping


# The trap shadow: the source compiled with `__trap()` made a count into a module global
# (TRAP_SHADOW_SYMBOL) after which the thread goes on. A mutation campaign runs a trap gate so
# in the mutant's warm worker (harness.runs.warm): a guard that fires leaves the context
# usable, where a real trap costs a fresh process and a context, and the driver handles traps
# and makes contexts one at a time. Up to a shadowed guard's first count, the run is the real
# run; so the count says the real kernel would have trapped there (or faulted earlier), and no
# count with a clean return says the real run returns as clean. Only the campaign uses it;
# the gate run's trap gates always trap for real.
TRAP_SHADOW_SYMBOL = "harness_trap_shadow_hits"
TRAP_SHADOW_PREAMBLE = (f"__device__ unsigned int {TRAP_SHADOW_SYMBOL};\n"
                        f"#define __trap() ((void)atomicAdd(&{TRAP_SHADOW_SYMBOL}, 1u))\n"
                        "#line 1\n")


# ---------------------------------------------------------------- toolchain facts


@lru_cache(maxsize=None)
def nvrtc_version() -> str:
    from cuda.bindings import nvrtc

    err, major, minor = nvrtc.nvrtcVersion()
    if int(err) != 0:
        raise RuntimeError(f"nvrtcVersion failed: {err}")
    return f"{major}.{minor}"


@lru_cache(maxsize=None)
def supported_arches() -> tuple[str, ...]:
    from cuda.bindings import nvrtc

    err, arches = nvrtc.nvrtcGetSupportedArchs()
    if int(err) != 0:
        raise RuntimeError(f"nvrtcGetSupportedArchs failed: {err}")
    return tuple(f"sm_{a}" for a in arches)


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
def _cuda_headers_version() -> str:
    header = cuda_include_dir() / "cuda_runtime_api.h"
    try:
        text = header.read_text(errors="replace")
    except OSError:
        return "unknown"
    m = re.search(r"#define\s+CUDART_VERSION\s+(\d+)", text)
    return m.group(1) if m else "unknown"


_ARCH_VARIANT = re.compile(r"sm_(\d+)([a-z])")


@lru_cache(maxsize=None)
def _nvrtc_compiles_for(arch: str) -> bool:
    """Whether NVRTC compiles an empty kernel for `arch` (asked once per arch and process)."""
    try:
        Program('extern "C" __global__ void harness_arch_probe() {}', "c++",
                ProgramOptions(arch=arch)).compile("cubin")
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


def resolve_arch(arch: str | None = None) -> str:
    """`arch`, else the settings' arch, else the device's, else sm_90."""
    if arch:
        return check_arch(arch)
    settings = _settings.current()
    if settings.arch:
        return check_arch(settings.arch, settings.arch_source)
    from harness import device

    return check_arch(device.device_arch() or _settings.DEFAULT_ARCH_WITHOUT_DEVICE)


# ---------------------------------------------------------------- include path and source closure


def _strip_comments(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


@dataclass(frozen=True)
class IncludePath:
    """The folders a module's includes are searched in, in order, each with the label the
    recorded options use for it: `$ROOT` and `$ROOT/sub` inside the kernel root (a sandbox
    copy records the same), `@include<N>` for a user include directory outside the root
    (its content hash is added per module), `@cuda-headers`, `@cccl`, `@harness-shims`
    (versions)."""

    source_dir: Path
    root: Path
    user: tuple[Path, ...]  # the launcher's INCLUDE_DIRS, then --include-dir / ini harness_include_dirs
    system: tuple[tuple[Path, str], ...]  # (dir, label) for CUDA headers, CCCL, shims

    def folders(self, quoted: bool) -> list[Path]:
        first = [self.source_dir] if quoted else []
        out = []
        for d in [*first, self.root, *self.user, *(d for d, _ in self.system)]:
            if d not in out:
                out.append(d)
        return out

    def label(self, folder: Path) -> str:
        folder = Path(folder)
        if folder.is_relative_to(self.root):
            rel = folder.relative_to(self.root).as_posix()
            return "$ROOT" if rel == "." else f"$ROOT/{rel}"
        for i, d in enumerate(self.user):
            if folder == d:
                return f"@include{i}"
        for d, label in self.system:
            if folder == d:
                return label
        return str(folder)

    def searched(self) -> list[Path]:
        """The folders handed to the compiler, in order (the source's folder first)."""
        return self.folders(quoted=True)

    def resolve(self, name: str, quoted: bool, origin: Path | None = None) -> Path | None:
        """Where `#include name` is found: the including file's folder first for quoted
        includes, then the search path. A header that two user include directories (or one
        and the kernel root) hold is an `IncludeDirError` saying which wins."""
        candidates = ([origin.parent] if quoted and origin is not None else []) + self.folders(quoted)
        hits = []
        for d in candidates:
            p = d / name
            if p.is_file():
                hits.append(p.resolve())
        if not hits:
            return None
        user_hits = [h for h in dict.fromkeys(hits)
                     if any(h.is_relative_to(d) for d in (self.root, *self.user))
                     and not (origin is not None and h.parent == origin.parent.resolve())]
        distinct = {h.read_bytes() for h in user_hits} if len(user_hits) > 1 else set()
        if len(distinct) > 1:
            from harness.toolchain import IncludeDirError

            spelled = f'"{name}"' if quoted else f"<{name}>"
            raise IncludeDirError(
                f"#include {spelled} is found in two include "
                f"directories: {user_hits[0]} (wins: it comes first in the search order) and {user_hits[1]}: "
                "rename or remove one copy, or drop one of the folders from INCLUDE_DIRS / --include-dir / "
                "ini harness_include_dirs")
        return hits[0]


def include_path(source: Path, kernel_root: Path, module_dirs=(), backend: str = "nvrtc") -> IncludePath:
    from harness import toolchain

    root = Path(kernel_root).resolve()
    user = []
    for d in (*module_dirs, *_settings.current().include_dirs):
        d = Path(d).resolve()
        if d not in user and d != root:
            user.append(d)
    system = []
    if backend == "nvrtc":  # nvcc brings its own toolkit's headers and CCCL (its version is in the key)
        system = [(cuda_include_dir().resolve(), f"@cuda-headers({_cuda_headers_version()})")]
        system += [(d, f"@cccl({toolchain.cccl_version()})") for d in toolchain.cccl_dirs()[0]]
        system.append((toolchain.SHIMS, f"@harness-shims({toolchain.shims_version()[:8]})"))
    return IncludePath(Path(source).resolve().parent, root, tuple(user), tuple(system))


def _closure(source: Path, inc: IncludePath) -> list[tuple[str, str]]:
    """(label, sha256) of the `.cu` and every header it includes, transitively, except the
    CUDA headers, CCCL and the shims (covered by their versions in the key): the kernel
    root's (a root-relative path), a user include directory's (`@include<N>/path`), and any
    a symlink in the root leads to (`@external/abs/path`)."""
    seen: dict[Path, str] = {}
    stack = [source.resolve()]
    while stack:
        path = stack.pop()
        if path in seen:
            continue
        data = path.read_bytes()
        seen[path] = hashlib.sha256(data).hexdigest()
        for m in _INCLUDE_Q.finditer(_strip_comments(data.decode("utf-8", errors="replace"))):
            found = inc.resolve(m.group(2), m.group(1) == '"', origin=path)
            if found is not None and not any(found.is_relative_to(d) for d, _ in inc.system):
                stack.append(found)  # the kernel root's, a user include dir's, or one a symlink leads to

    def rel(p: Path) -> str:
        if p.is_relative_to(inc.root):
            return p.relative_to(inc.root).as_posix()
        for i, d in enumerate(inc.user):
            if p.is_relative_to(d):
                return f"@include{i}/{p.relative_to(d).as_posix()}"
        return f"@external{p.as_posix()}"  # reached through a symlink: the same path from a sandbox

    return sorted((rel(p), digest) for p, digest in seen.items())


_INCLUDE_Q = re.compile(r'^[ \t]*#[ \t]*include[ \t]*([<"])([^>"]+)[>"]', re.MULTILINE)


def source_closure(source: Path, kernel_root: Path, include_dirs=()) -> list[tuple[str, str]]:
    """(path relative to the kernel root, sha256) of the `.cu` and every header it
    includes, transitively, that lies inside the kernel root or a user include directory
    (`@include<N>/...`). Headers of CUDA and CCCL are covered by their versions."""
    return _closure(Path(source), include_path(source, kernel_root, include_dirs))


# ---------------------------------------------------------------- options: one list, what the compiler receives

NVCC_HEADERS = re.compile(r"^(cub/cub\.cuh|cub/device/.*|cub/agent/.*|cub/dispatch/.*|thrust/.*)$")


def _nvrtc_options(arch: str, ms: ModuleSettings, inc: IncludePath) -> list[str]:
    """The option list NVRTC receives, from `cuda.core.ProgramOptions` (its own spelling)
    plus the module's EXTRA_FLAGS verbatim."""
    po = ProgramOptions(
        arch=arch, std="c++17", ftz=ms.ftz_effective, prec_div=not ms.fast_math, prec_sqrt=not ms.fast_math,
        fma=ms.fmad, use_fast_math=ms.fast_math, include_path=[str(d) for d in inc.searched()],
        ptxas_options=["-v"],
        define_macro=[name if value is None else f"{name}={value}" for name, value in ms.defines] or None,
    )
    return [b.decode() for b in po.as_bytes("nvrtc")] + list(ms.extra_flags)


def _nvcc_options(arch: str, ms: ModuleSettings, inc: IncludePath) -> list[str]:
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
    return normalise_options(_nvrtc_options(arch, ms, inc), inc)


def _backend(ms: ModuleSettings, view_includes: list[str], closure_headers: list[str]) -> tuple[str, str]:
    """(backend, why). The rule: COMPILER = "nvrtc" or "nvcc" in the launcher decides;
    "auto" (the default) is NVRTC unless the device view of the `.cu`, or a kernel-root
    header it includes, keeps an include of a CCCL header that pulls in host-side
    device-wide algorithms (`cub/cub.cuh`, `cub/device/...`, `cub/agent/...`,
    `cub/dispatch/...`, `thrust/...`), which NVRTC cannot compile: then nvcc."""
    if ms.compiler != "auto":
        return ms.compiler, f"COMPILER = {ms.compiler!r} in {ms.declared_in}"
    for name in [*view_includes, *closure_headers]:
        if NVCC_HEADERS.match(name):
            return "nvcc", f"auto: <{name}> needs nvcc (NVRTC cannot compile CCCL's host-side algorithms)"
    return "nvrtc", "auto"


# ---------------------------------------------------------------- ptxas report

_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?")


def parse_resources(log: str, symbol_mapping: dict) -> tuple[KernelResources, ...]:
    by_symbol = {sym: expr for expr, sym in symbol_mapping.items()}
    out: list[KernelResources] = []
    current: dict | None = None

    def flush():
        if current and "registers" in current:
            sym = current["symbol"]
            out.append(
                KernelResources(
                    kernel=by_symbol.get(sym, sym),
                    symbol=sym,
                    registers=current["registers"],
                    spill_stores=current.get("spill_stores", 0),
                    spill_loads=current.get("spill_loads", 0),
                    shared_bytes=current.get("smem", 0),
                    stack_bytes=current.get("stack", 0),
                )
            )

    for line in log.splitlines():
        if m := _ENTRY.search(line):
            flush()
            current = {"symbol": m.group(1)}
        elif current is not None and (m := _FRAME.search(line)):
            current["stack"], current["spill_stores"], current["spill_loads"] = map(int, m.groups())
        elif current is not None and (m := _USED.search(line)):
            current["registers"] = int(m.group(1))
            current["smem"] = int(m.group(2) or 0)
    flush()
    return tuple(out)


# ---------------------------------------------------------------- cache


def _cache_key(closure, options, name_expressions, arch, extra: dict | None = None) -> str:
    material = {
        "format": CACHE_FORMAT,
        "closure": closure,
        "options": list(options),
        "name_expressions": list(name_expressions),
        "arch": arch,
        "nvrtc": nvrtc_version(),
        "cuda_headers": _cuda_headers_version(),
        **(extra or {}),
    }
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()


def _atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _cache_paths(cache_dir: Path, key: str) -> tuple[Path, Path]:
    folder = cache_dir / key[:2]
    return folder / f"{key}.cubin", folder / f"{key}.json"


class CacheNotWritable(UserWarning):
    """The cubin cache folder cannot be written: modules compile without caching."""


_warned_caches: set[str] = set()


def _cache_not_writable(cache: Path, exc: OSError) -> None:
    """Say once per process and folder that the cache cannot be written; compiling goes on."""
    if str(cache) in _warned_caches:
        return
    _warned_caches.add(str(cache))
    reason = exc.strerror or type(exc).__name__
    warnings.warn(CacheNotWritable(
        f"the cubin cache {cache} cannot be written ({reason}): compiling without caching, every run "
        "compiles again. Point HARNESS_CACHE_DIR (or --harness-cache-dir, --cache-dir) at a writable folder"),
        stacklevel=3)


def _read_cache(cubin_path: Path, meta_path: Path):
    """(cubin, symbol mapping, log) of a sound cache entry, else None: a missing, unreadable
    or wrongly shaped entry is a miss, compiled again and overwritten."""
    try:
        if not (cubin_path.is_file() and meta_path.is_file()):
            return None
        meta = json.loads(meta_path.read_text())
        cubin = cubin_path.read_bytes()
    except (OSError, ValueError):
        return None
    if not isinstance(meta, dict):
        return None
    mapping, log = meta.get("symbol_mapping"), meta.get("log")
    if not (isinstance(mapping, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in mapping.items())
            and isinstance(log, str) and meta.get("cubin_sha256") == hashlib.sha256(cubin).hexdigest()):
        return None
    return cubin, mapping, log


def _read_source(path: Path, options: tuple[str, ...]) -> str:
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        column = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1
        raise CompileError(path, f"{path}({line}): error: byte 0x{data[exc.start]:02x} at column {column} is not "
                                 "UTF-8: NVRTC reads sources as UTF-8; save the file as UTF-8 (or remove the byte)",
                           options, what="could not read") from None


# ---------------------------------------------------------------- the entry point


_views: dict[tuple, object] = {}  # memo of device views (see compile_file)


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
) -> CompiledModule:
    """Compile one `.cu` to a cubin. `source` is absolute or relative to the kernel root.

    The compile settings are the ones the launcher beside the `.cu` declares
    (`harness.modsettings`), or `settings` when given (the controls pass the real tree's);
    `name_expressions`, `defines` and `fmad` may repeat what the launcher declares, or give
    what it leaves undeclared. The file is compiled through its device-only view
    (`harness.deviceview`) by NVRTC, or by nvcc by the rule in `_backend`. `trap_shadow`:
    with TRAP_SHADOW_PREAMBLE before it (a mutation campaign's trap gates)."""
    run_settings = _settings.current()
    root = Path(kernel_root).resolve() if kernel_root is not None else run_settings.kernel_root
    if not root.is_dir():
        raise FileNotFoundError(
            f"kernel root {root} does not exist or is not a folder: "
            "pass --kernel-root DIR (or set the ini key kernel_root) to the folder holding your .cu files"
        )
    path = Path(source)
    if not path.is_absolute():
        path = root / path
    path = path.resolve()
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such .cu file under the kernel root {root}")
    arch = resolve_arch(arch)
    ms = settings if settings is not None else declared_settings(path)
    ms = ms.with_overrides(name_expressions=name_expressions, defines=defines, fmad=fmad)
    name_expressions = ms.name_expressions

    inc = include_path(path, root, ms.include_dirs)
    provisional = normalise_options(_nvrtc_options(arch, ms, inc), inc)
    text_source = _read_source(path, provisional)
    closure = _closure(path, inc)
    view = None
    view_missing = False
    if ms.device_view:
        from harness.deviceview import DeviceViewError, available, device_view

        view_missing = not available()
    if ms.device_view and not view_missing:
        headers = [inc.resolve(n, q == '"', origin=path) for q, n in _INCLUDE_Q.findall(_strip_comments(text_source))]
        extra = tuple(h.read_text(errors="replace") for h in headers
                      if h is not None and any(h.is_relative_to(d) for d in (inc.root, *inc.user)))
        # The view depends on the text, the macros of its kernel-root headers and where each
        # include resolves: memoised on exactly those, so a launcher calling module() per launch
        # pays for the syntax tree once per process.
        memo = (str(path), hashlib.sha256(text_source.encode()).hexdigest(),
                tuple(hashlib.sha256(e.encode()).hexdigest() for e in extra), tuple(map(str, headers)))
        view = _views.get(memo)
        if view is None:
            try:
                view = device_view(text_source, path, lambda n, q: inc.resolve(n, q, origin=path), extra)
            except DeviceViewError as exc:
                raise CompileError(path, str(exc), provisional, what="could not derive the device view of") from None
            _views[memo] = view
    compiled_text = view.text if view is not None else text_source
    if trap_shadow:
        compiled_text = TRAP_SHADOW_PREAMBLE + compiled_text
    closure_headers = []
    for rel, _ in closure:
        p = root / rel if not rel.startswith("@") else None
        if p is not None and p != path and p.is_file():
            closure_headers += [n for _, n in _INCLUDE_Q.findall(_strip_comments(p.read_text(errors="replace")))]
    view_includes = [n for _, n in _INCLUDE_Q.findall(_strip_comments(compiled_text))]
    backend, backend_why = _backend(ms, view_includes, closure_headers)
    if view_missing:  # compiled as it is: right for device-only files; host code then fails, saying why
        backend_why += "; no device view (tree-sitter and tree-sitter-cuda are not installed)"
    if backend == "nvcc":
        from harness import toolchain

        nvcc = toolchain.require_nvcc(f"{path.name} is compiled by nvcc ({backend_why})")
        inc = include_path(path, root, ms.include_dirs, backend="nvcc")
        real_options = _nvcc_options(arch, ms, inc)
        compiler_version = f"nvcc {toolchain.nvcc_version(str(nvcc))}"
    else:
        real_options = _nvrtc_options(arch, ms, inc)
        compiler_version = f"nvrtc {nvrtc_version()}"
    options = normalise_options(real_options, inc)
    set_aside = view.set_aside if view is not None else ()
    from harness import toolchain as _tc

    user_hash = {}
    for i, _ in enumerate(inc.user):
        h = hashlib.sha256(json.dumps([c for c in closure if c[0].startswith(f"@include{i}/")]).encode())
        user_hash[f"@include{i}"] = h.hexdigest()[:16]
    key = _cache_key(closure, options, name_expressions, arch, {
        "backend": backend, "compiler": compiler_version, "cccl": _tc.cccl_version(),
        "shims": _tc.shims_version() if backend == "nvrtc" else None,
        "device_view": (__import__("harness.deviceview").deviceview.VERSION if view is not None else None),
        "set_aside": [str(s) for s in set_aside], "include_hashes": user_hash,
        **({"trap_shadow": TRAP_SHADOW_PREAMBLE} if trap_shadow else {}),  # every other key as it was
    })
    cache = Path(cache_dir) if cache_dir is not None else run_settings.cache_dir
    cubin_path, meta_path = _cache_paths(cache, key)

    start = time.perf_counter()

    def result(cubin: bytes, mapping: dict, log: str, hit: bool) -> CompiledModule:
        return CompiledModule(
            source=path, arch=arch, options=options, name_expressions=name_expressions, key=key,
            cubin=cubin, symbol_mapping=mapping, resources=parse_resources(log, mapping), log=log,
            cache_hit=hit, seconds=time.perf_counter() - start, nvrtc_version=nvrtc_version(),
            cubin_path=cubin_path if use_cache else None, backend=backend, backend_reason=backend_why,
            set_aside=tuple(set_aside), compiler=compiler_version, trap_shadow=trap_shadow,
        )

    if use_cache:
        hit = _read_cache(cubin_path, meta_path)
        if hit is not None:
            return result(*hit, hit=True)

    try:
        if backend == "nvcc":
            cubin, mapping, text = _compile_nvcc(nvcc, path, compiled_text, real_options, name_expressions)
        else:
            cubin, mapping, text = _compile_nvrtc(path, compiled_text, real_options, name_expressions)
    except _Failed as exc:
        log_text = exc.log
        if view_missing:
            log_text = log_text.rstrip() + (
                "\n\nthe file was compiled as it is, with no device view: tree-sitter and tree-sitter-cuda are not "
                "installed (pip install tree-sitter tree-sitter-cuda; on a machine with no registry, carry their "
                "wheels), so host code and host-only includes were not set aside")
        if set_aside:
            log_text = log_text.rstrip() + (
                "\n\nthe device view set aside (if device code needs one of these, see docs/your-kernels.md, "
                "'Host code'):\n" + "\n".join(f"  {s}" for s in set_aside))
        raise CompileError(path, log_text, options,
                           what="nvcc could not compile" if backend == "nvcc" else "NVRTC could not compile") from None
    if use_cache:
        meta = {
            "source": str(path),
            "closure": closure,
            "options": list(options),
            "backend": backend,
            "set_aside": [str(s) for s in set_aside],
            "name_expressions": list(name_expressions),
            "symbol_mapping": mapping,
            "log": text,
            "cubin_sha256": hashlib.sha256(cubin).hexdigest(),
        }
        try:
            _atomic_write(cubin_path, cubin)
            _atomic_write(meta_path, json.dumps(meta, indent=1).encode())
        except OSError as exc:
            _cache_not_writable(cache, exc)
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
