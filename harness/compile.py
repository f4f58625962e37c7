"""NVRTC compilation to cubin through `cuda.core`, with a content-addressed disk cache.

Works with no GPU: the arch comes from `--arch`, the device, or `sm_90`. The cache key is
the whole source closure (the `.cu` and every header it includes from the kernel root),
the recorded options, the name expressions, the NVRTC version and the CUDA headers'
version, so a perturbed header can never hit a stale cubin.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from cuda.core import Program, ProgramOptions  # at import: a first import from several threads races

from harness import _settings

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


class LauncherError(Exception):
    """The launcher beside a `.cu` could not be read for its NAME_EXPRESSIONS. The message is
    one line: the launcher, what went wrong, what to do."""


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


# ---------------------------------------------------------------- source closure


def _strip_comments(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


def source_closure(source: Path, kernel_root: Path) -> list[tuple[str, str]]:
    """(path relative to the kernel root, sha256) of the `.cu` and every header it
    includes, transitively, that lies inside the kernel root. Headers outside the root
    (CUDA's) are covered by the toolchain versions in the key instead."""
    root = kernel_root.resolve()
    seen: dict[Path, str] = {}
    stack = [source.resolve()]
    while stack:
        path = stack.pop()
        if path in seen:
            continue
        data = path.read_bytes()
        seen[path] = hashlib.sha256(data).hexdigest()
        for name in _INCLUDE.findall(_strip_comments(data.decode("utf-8", errors="replace"))):
            for base in (path.parent, root):
                candidate = (base / name).resolve()
                if candidate.is_file() and candidate.is_relative_to(root):
                    stack.append(candidate)
                    break

    def rel(p: Path) -> str:
        return p.relative_to(root).as_posix() if p.is_relative_to(root) else p.name

    return sorted((rel(p), digest) for p, digest in seen.items())


# ---------------------------------------------------------------- options


def recorded_options(arch: str, defines: dict | None = None, fmad: bool = True) -> tuple[str, ...]:
    """The options as NVRTC spells them; part of the cache key and of every report."""
    opts = [
        f"--gpu-architecture={arch}",
        "-std=c++17",
        "--ftz=false",
        "--prec-div=true",
        "--prec-sqrt=true",
        f"--fmad={'true' if fmad else 'false'}",
        "--use_fast_math=false",
    ]
    for name, value in sorted((defines or {}).items()):
        opts.append(f"-D{name}" if value is None else f"-D{name}={value}")
    return tuple(opts)


def _program_options(source: Path, kernel_root: Path, arch: str, defines: dict | None, fmad: bool):
    macros = [name if value is None else f"{name}={value}" for name, value in sorted((defines or {}).items())]
    return ProgramOptions(
        name=str(source),
        arch=arch,
        std="c++17",
        ftz=False,
        prec_div=True,
        prec_sqrt=True,
        fma=fmad,
        use_fast_math=False,
        include_path=[str(source.parent), str(kernel_root), str(cuda_include_dir())],
        ptxas_options=["-v"],
        define_macro=macros or None,
    )


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


def _cache_key(closure, options, name_expressions, arch) -> str:
    material = {
        "format": CACHE_FORMAT,
        "closure": closure,
        "options": list(options),
        "name_expressions": list(name_expressions),
        "arch": arch,
        "nvrtc": nvrtc_version(),
        "cuda_headers": _cuda_headers_version(),
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


def compile_file(
    source: str | os.PathLike,
    *,
    kernel_root: str | os.PathLike | None = None,
    arch: str | None = None,
    name_expressions: tuple[str, ...] | list[str] = (),
    defines: dict | None = None,
    fmad: bool = True,
    cache_dir: str | os.PathLike | None = None,
    use_cache: bool = True,
) -> CompiledModule:
    """Compile one `.cu` to a cubin. `source` is absolute or relative to the kernel root."""
    settings = _settings.current()
    root = Path(kernel_root).resolve() if kernel_root is not None else settings.kernel_root
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
    name_expressions = tuple(name_expressions)
    options = recorded_options(arch, defines, fmad)
    closure = source_closure(path, root)
    key = _cache_key(closure, options, name_expressions, arch)
    cache = Path(cache_dir) if cache_dir is not None else settings.cache_dir
    cubin_path, meta_path = _cache_paths(cache, key)

    start = time.perf_counter()

    def result(cubin: bytes, mapping: dict, log: str, hit: bool) -> CompiledModule:
        return CompiledModule(
            source=path, arch=arch, options=options, name_expressions=name_expressions, key=key,
            cubin=cubin, symbol_mapping=mapping, resources=parse_resources(log, mapping), log=log,
            cache_hit=hit, seconds=time.perf_counter() - start, nvrtc_version=nvrtc_version(),
            cubin_path=cubin_path if use_cache else None,
        )

    if use_cache:
        hit = _read_cache(cubin_path, meta_path)
        if hit is not None:
            return result(*hit, hit=True)

    text_source = _read_source(path, options)
    log = io.StringIO()
    try:
        program = Program(text_source, "c++", _program_options(path, root, arch, defines, fmad))
        code = program.compile("cubin", name_expressions=name_expressions, logs=log)
    except Exception as exc:  # cuda.core raises a generic error carrying the log
        text = (log.getvalue() or str(exc)).replace("\x00", "")
        detail = str(exc).replace("\x00", "")
        if detail and detail not in text:
            text = text.rstrip() + "\n" + detail
        raise CompileError(path, text, options) from None
    cubin = bytes(code.code)
    mapping = {expr: (sym.decode() if isinstance(sym, bytes) else sym) for expr, sym in code.symbol_mapping.items()}
    text = log.getvalue()
    if use_cache:
        meta = {
            "source": str(path),
            "closure": closure,
            "options": list(options),
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


def _import_root(folder: Path) -> Path:
    """The folder a launcher's package imports resolve from: the first parent of `folder`
    that is not a package (holds no __init__.py). For kernels_cu/x.py: the project root, so
    `from kernels_cu.y import ...` and `from harness ...` inside the launcher work from any
    working folder."""
    while (folder / "__init__.py").is_file() and folder.parent != folder:
        folder = folder.parent
    return folder


def declared_name_expressions(source: str | os.PathLike) -> tuple[str, ...]:
    """The C++ name expressions that the launcher beside `x.cu` (`x.py`) declares as
    `NAME_EXPRESSIONS`, so that tools compiling without a gate (the compile command, the
    compile items, the static control check) instantiate the same templates the gates do.
    `()` when there is no launcher or it declares none. Raises `LauncherError` (one line)
    when the launcher fails to import or declares something other than a tuple of strings."""
    import importlib.util

    launcher = Path(source).with_suffix(".py")
    if not launcher.is_file():
        return ()
    name = "_harness_launcher_" + hashlib.sha256(str(launcher.resolve()).encode()).hexdigest()[:16]
    mod = sys.modules.get(name)
    if mod is None:
        spec = importlib.util.spec_from_file_location(name, launcher)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod  # dataclasses in the launcher look their module up here
        root = str(_import_root(launcher.resolve().parent))
        added = root not in sys.path
        if added:
            sys.path.insert(0, root)
        try:
            spec.loader.exec_module(mod)
        except BaseException as exc:
            del sys.modules[name]
            if not isinstance(exc, Exception):
                raise
            where = ""
            tb = exc.__traceback__
            while tb is not None:  # the deepest frame inside the launcher: where it failed
                if Path(tb.tb_frame.f_code.co_filename).resolve() == launcher.resolve():
                    where = f" (line {tb.tb_lineno})"
                tb = tb.tb_next
            detail = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            raise LauncherError(
                f"{launcher}: importing the launcher to read {LAUNCHER_ATTRIBUTE} failed{where}: "
                f"{type(exc).__name__}{': ' + detail if detail else ''}; fix the launcher so that "
                f"`import` of it succeeds with no GPU"
            ) from None
        finally:
            if added and root in sys.path:
                sys.path.remove(root)
    names = getattr(mod, LAUNCHER_ATTRIBUTE, ())
    if isinstance(names, (str, bytes)) or not isinstance(names, (tuple, list)) \
            or not all(isinstance(n, str) for n in names):
        raise LauncherError(
            f"{launcher}: {LAUNCHER_ATTRIBUTE} must be a tuple of C++ name expressions (strings), got "
            f"{names!r}; write e.g. {LAUNCHER_ATTRIBUTE} = (\"my_kernel<256>\",) (note the trailing comma)"
        )
    return tuple(names)


def find_sources(kernel_root: str | os.PathLike) -> list[Path]:
    root = Path(kernel_root)
    if not root.is_dir():
        raise FileNotFoundError(
            f"kernel root {root} does not exist or is not a folder: "
            "pass --kernel-root DIR to the folder holding your .cu files"
        )
    return sorted(p.resolve() for p in root.rglob("*.cu") if p.is_file())
