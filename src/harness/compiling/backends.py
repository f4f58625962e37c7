"""The two compilers behind `harness.compiling.compile.compile_file`, and the rule that picks one for a
module: NVRTC (through cuda.bindings, with exactly the option list that is recorded) and
`nvcc --cubin`. Each takes the device view's text and the option list, and returns
(cubin, {name expression: symbol}, log), or raises `_Failed` carrying the compiler's log."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

from harness.compiling.modsettings import ModuleSettings
from harness.compiling.ptxas import ENTRY

NVCC_HEADERS = re.compile(r"^(cub/cub\.cuh|cub/device/.*|cub/agent/.*|cub/dispatch/.*|thrust/.*)$")


def choose_backend(ms: ModuleSettings, view_includes: list[str], closure_headers: list[str]) -> tuple[str, str]:
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


class _Failed(Exception):
    def __init__(self, log: str):
        self.log = log


def _check(result, what: str):
    err, *rest = result
    if int(err) != 0:
        raise RuntimeError(f"{what} failed: {err}")
    return rest[0] if len(rest) == 1 else rest


def _compile_nvrtc(path: Path, text: str, options: list[str], name_expressions) -> tuple[bytes, dict, str]:
    """NVRTC with exactly `options` (the list recorded, before paths become labels)."""
    from cuda.bindings import nvrtc

    prog = _check(nvrtc.nvrtcCreateProgram(text.encode(), str(path).encode(), 0, [], []), "nvrtcCreateProgram")
    try:
        for ne in name_expressions:
            _check(nvrtc.nvrtcAddNameExpression(prog, ne.encode()) + (None,), "nvrtcAddNameExpression")
        opts = [o.encode() for o in options]
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        # NVRTC writes into the buffer it is given: a bytearray, never a bytes object. Some
        # cuda-bindings (13.3) write into the bytes passed, and `b" " * 1` (the size of an empty
        # log) is CPython's one shared b" ": its space became a NUL for the whole process
        # (every lone space it then encoded, print's separators among them).
        size = _check(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
        buf = bytearray(size)
        nvrtc.nvrtcGetProgramLog(prog, buf)
        log = bytes(buf).decode("utf-8", errors="replace").replace("\x00", "")
        if int(err) != 0:
            raise _Failed(log or str(err))
        size = _check(nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
        cubin = bytearray(size)
        nvrtc.nvrtcGetCUBIN(prog, cubin)
        mapping = {}
        for ne in name_expressions:
            lowered = _check(nvrtc.nvrtcGetLoweredName(prog, ne.encode()), "nvrtcGetLoweredName")
            mapping[ne] = lowered.decode() if isinstance(lowered, bytes) else str(lowered)
        return bytes(cubin), mapping, log
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def _compile_nvcc(nvcc: Path, path: Path, text: str, options: list[str], name_expressions) -> tuple[bytes, dict, str]:
    """nvcc --cubin on the device view, written beside nothing the user owns (a temporary
    folder); quoted includes resolve through the -I of the source's folder. Name
    expressions are instantiated by a host-side reference appended to the view and mapped
    back from ptxas' entry names through c++filt."""
    import subprocess

    from harness.compiling import toolchain

    stub = "".join(f"\nstatic void __harness_instantiate_{i}() {{ (void)&{ne}; }}" for i, ne in enumerate(name_expressions))
    with tempfile.TemporaryDirectory(prefix="harness-nvcc-") as tmp:
        src = Path(tmp) / path.name
        src.write_text(text + stub + "\n", encoding="utf-8")
        out = Path(tmp) / "out.cubin"
        cmd = [str(nvcc), *options, "-o", str(out), str(src)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        log = (proc.stdout + proc.stderr).replace(str(src), str(path))
        if proc.returncode != 0 or not out.is_file():
            raise _Failed(log or f"nvcc exited with {proc.returncode}")
        cubin = out.read_bytes()
    symbols = ENTRY.findall(log)
    mapping = {}
    if name_expressions:
        demangled = toolchain.demangle(symbols)
        by_name = {}
        for sym, dem in demangled.items():
            by_name.setdefault(_expression_of(dem), sym)
        for ne in name_expressions:
            sym = by_name.get(re.sub(r"\s+", "", ne))
            if sym is None:
                raise _Failed(f"{log}\nnvcc compiled {path.name} but no kernel demangles to the name expression "
                              f"{ne!r} (kernels: {', '.join(demangled.values()) or ', '.join(symbols)}): spell it as "
                              "the demangled name, e.g. kernel<float, 256u>")
            mapping[ne] = sym
    return cubin, mapping, log


def _expression_of(demangled: str) -> str:
    """`void ns::k<float, 4>(float*, int)` -> `ns::k<float,4>` (spaces removed)."""
    text = re.sub(r"^\s*void\s+", "", demangled)
    depth = 0
    for i, ch in enumerate(text):
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif ch == "(" and depth == 0:
            text = text[:i]
            break
    return re.sub(r"\s+", "", text)
