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
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from cuda.core import Program, ProgramOptions  # at import: a first import from several threads races

from harness import _settings

CACHE_FORMAT = 1
_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*[<"]([^>"]+)[>"]', re.MULTILINE)


class CompileError(Exception):
    """A `.cu` did not compile. The message carries NVRTC's log and the options used."""

    def __init__(self, source: Path, log: str, options: tuple[str, ...]):
        self.source = source
        self.log = log
        self.options = options
        lines = [f"NVRTC could not compile {source}", "", log.rstrip() or "(NVRTC printed no log)", ""]
        lines.append("options: " + " ".join(options))
        super().__init__("\n".join(lines))


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


def check_arch(arch: str) -> str:
    arch = arch.strip()
    known = supported_arches()
    if arch not in known:
        raise ArchError(
            f"unknown --arch {arch!r}: NVRTC {nvrtc_version()} targets "
            f"{', '.join(known)}; pass one of them (e.g. --arch sm_90)"
        )
    return arch


def resolve_arch(arch: str | None = None) -> str:
    """`arch`, else the settings' arch, else the device's, else sm_90."""
    arch = arch or _settings.current().arch
    if not arch:
        from harness import device

        arch = device.device_arch() or _settings.DEFAULT_ARCH_WITHOUT_DEVICE
    return check_arch(arch)


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

    if use_cache and cubin_path.is_file() and meta_path.is_file():
        try:
            meta = json.loads(meta_path.read_text())
            cubin = cubin_path.read_bytes()
        except (OSError, ValueError):
            meta = None
        if meta is not None and hashlib.sha256(cubin).hexdigest() == meta.get("cubin_sha256"):
            return result(cubin, meta["symbol_mapping"], meta["log"], hit=True)

    log = io.StringIO()
    try:
        program = Program(path.read_text(), "c++", _program_options(path, root, arch, defines, fmad))
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
        _atomic_write(cubin_path, cubin)
        _atomic_write(meta_path, json.dumps(meta, indent=1).encode())
    return result(cubin, mapping, text, hit=False)


LAUNCHER_ATTRIBUTE = "NAME_EXPRESSIONS"


def declared_name_expressions(source: str | os.PathLike) -> tuple[str, ...]:
    """The C++ name expressions that the launcher beside `x.cu` (`x.py`) declares as
    `NAME_EXPRESSIONS`, so that tools compiling without a gate (the compile command, the
    static control check) instantiate the same templates the gates do. `()` when there is
    no launcher or it declares none."""
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
        try:
            spec.loader.exec_module(mod)
        except Exception as exc:
            del sys.modules[name]
            raise RuntimeError(f"{launcher}: importing the launcher to read {LAUNCHER_ATTRIBUTE} failed: "
                               f"{type(exc).__name__}: {exc}") from exc
    names = getattr(mod, LAUNCHER_ATTRIBUTE, ())
    if isinstance(names, str) or not all(isinstance(n, str) for n in names):
        raise TypeError(f"{launcher}: {LAUNCHER_ATTRIBUTE} must be a tuple of C++ name expressions (strings), "
                        f"got {names!r}")
    return tuple(names)


def find_sources(kernel_root: str | os.PathLike) -> list[Path]:
    root = Path(kernel_root)
    if not root.is_dir():
        raise FileNotFoundError(
            f"kernel root {root} does not exist or is not a folder: "
            "pass --kernel-root DIR to the folder holding your .cu files"
        )
    return sorted(p.resolve() for p in root.rglob("*.cu") if p.is_file())
