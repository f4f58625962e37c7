"""What a kernel file's compile gate expects beyond compiling: kernels in the cubin.

A `.cu` under the kernel root is a kernel file, and its compile gate (the `x.cu::compile`
item, a row of `python -m harness compile`) proves its kernels compile. A cubin with no
kernel proves nothing, so it fails the gate with one line saying why there is none:

- the file's `__global__` functions are templates that only host code instantiated, and the
  device view set that host code aside: name the instances in the launcher's
  `NAME_EXPRESSIONS`;
- it has `__global__` functions that the preprocessor left out: check `DEFINES`;
- it has no `__global__` function at all: a host-only file on purpose (a torch extension's
  bindings) says so with `HOST_ONLY = True` in its launcher, and its gate then expects no
  kernel (a kernel in it fails the gate instead).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

_GLOBAL = re.compile(r"(?<!\w)__global__(?!\w)")
_LAUNCH_BOUNDS = re.compile(r"__launch_bounds__\s*\((?:[^()]|\([^()]*\))*\)")
_OBJECT_MACRO = re.compile(r"^[ \t]*#[ \t]*define[ \t]+([A-Za-z_]\w*)(?![\w(])(.*)$", re.MULTILINE)


@dataclass(frozen=True)
class Kernel:
    """A `__global__` function as written: its name, 1-based line, file, and whether it is a template."""

    name: str
    line: int
    file: Path
    template: bool


def kernels_written(path: Path, text: str) -> list[Kernel]:
    """The `__global__` functions `text` defines or declares (directly, or through an
    object-like macro it defines that expands to `__global__`)."""
    from harness.compiling.cpp_text import line_of, strip_comments_and_literals

    clean = strip_comments_and_literals(text)
    markers = {"__global__"} | {m.group(1) for m in _OBJECT_MACRO.finditer(clean) if _GLOBAL.search(m.group(2))}
    found = []
    marker = re.compile(r"(?<!\w)(?:" + "|".join(map(re.escape, sorted(markers))) + r")(?!\w)")
    for m in marker.finditer(clean):
        line_start = clean.rfind("\n", 0, m.start()) + 1
        if clean[line_start:m.start()].lstrip().startswith("#"):
            continue  # the macro's own #define
        head = _LAUNCH_BOUNDS.sub(" ", clean[m.end():m.end() + 2000]).split("{", 1)[0].split(";", 1)[0]
        name = re.match(r"[^(]*?([A-Za-z_]\w*)\s*\(", head)
        if name is None:
            continue
        before = clean[max(clean.rfind(";", 0, m.start()), clean.rfind("}", 0, m.start())) + 1:m.start()]
        found.append(Kernel(name.group(1), line_of(clean, m.start()), path, re.search(r"\btemplate\s*<", before)
                            is not None))
    return found


def problem(mod, host_only: bool, launcher: Path) -> str | None:
    """The one-line failure of the compile gate of `mod` (a `harness.compiling.compile.CompiledModule`),
    or None: kernels in the cubin, or none and `HOST_ONLY = True` declared in `launcher`."""
    if mod.resources:
        if host_only:
            names = ", ".join(r.kernel for r in mod.resources)
            return (f"{launcher} declares HOST_ONLY = True, but {mod.source.name} compiles to kernels: {names}: "
                    "remove HOST_ONLY (its compile gate then proves these kernels compile)")
        return None
    if host_only:
        return None
    from harness.compiling.cpp_text import strip_comments_and_literals

    try:
        blank = not strip_comments_and_literals(mod.source.read_text(encoding="utf-8", errors="replace")).strip()
    except OSError:
        blank = False
    if blank:
        return f"{mod.source}: compiled to no kernel: the file holds no code (empty, or comments only): write its " \
               "kernels, or remove it"
    written = []
    for path, _ in mod.files or ((mod.source, ""),):
        try:
            written += kernels_written(Path(path), Path(path).read_text(encoding="utf-8", errors="replace"))
        except OSError:
            continue
    head = f"{mod.source}: compiled to no kernel: "

    def where(k: Kernel) -> str:
        return f"{k.name}, line {k.line}" if k.file == mod.source else f"{k.name}, {k.file.name} line {k.line}"

    templates = [k for k in written if k.template]
    if templates:
        listed = "; ".join(where(k) for k in templates[:4]) + ("; ..." if len(templates) > 4 else "")
        return (head + f"its kernels are templates that only host code instantiated ({listed}), and the device view "
                f"set that aside: name the instances your gates launch in NAME_EXPRESSIONS in {launcher} "
                f'(e.g. NAME_EXPRESSIONS = ("{templates[0].name}<...>",))')
    if written:
        listed = "; ".join(where(k) for k in written[:4])
        return (head + f"its __global__ functions ({listed}) are left out by the preprocessor: check the #if "
                f"around them and DEFINES in {launcher}")
    aside = f" (the device view set aside {len(mod.set_aside)} host items)" if mod.set_aside else ""
    return (head + f"no __global__ function in it or the headers it includes{aside}: its compile gate proves "
            f"nothing; if it holds host code on purpose, declare HOST_ONLY = True in {launcher} "
            "(or move it out of the kernel root)")
