"""The device-only view of a `.cu` and of each kernel-root header it includes: the files as
the compiler sees them, host code set aside.

Real kernel files mix kernels with host code: a `main()`, cuBLAS calls, torch-extension
entry points and the headers they need (`<torch/extension.h>`, `<cublas_v2.h>`), and
benchmark trees keep the same in their headers beside `__device__` reductions. NVRTC
compiles device code only, and neither it nor nvcc can open a header that is not
installed. So the harness compiles a view of each file it derives from the syntax tree
(tree-sitter with the CUDA grammar, `harness.compiling.cuda_syntax`), never an edited copy the user
keeps. The `.cu` and its kernel-root headers are viewed together (`device_views`; the
headers reach the compiler through `harness.compiling.closureview`):

- **set aside**: every function definition or declaration with no `__global__` /
  `__device__` (directly, or through a macro one of the files defines, e.g.
  `#define DEVICE_INLINE __device__ __forceinline__`) that no kept code names: host
  helpers, `main`, `PYBIND11_MODULE(...) {...}`, host template dispatch and its explicit
  instantiations; every variable (not `constexpr`), `using` and `typedef` with no device
  memory space that no kept code names (a `static cublasHandle_t handle;`); every
  struct, class or union definition with no `__global__` / `__device__` in it that no kept
  code names (a host `Timer`, an exception class); `using namespace` of a host library
  (torch, at, c10, pybind11);
- **set aside**: every `#include <...>` the include path cannot resolve (torch, ATen,
  cuBLAS, the C++ standard library headers NVRTC lacks and the harness has no shim for),
  every `#include` that names a host-only library (`HOST_HEADERS`), and the device runtime
  API's header (`DEVICE_RUNTIME_HEADERS`). A quoted `#include "..."` of anything else is
  the project's own header: kept, so a misspelled one is the compiler's error naming the
  file and line, and one in a branch the preprocessor skips (`#ifdef USE_ROCM`) is left
  out as the upstream build leaves it out;
- **stand-in**: the line of each set-aside `#include` (not the device runtime's) includes
  `STANDIN_HEADER` instead: what device code commonly got through a host header (the
  standard integer types, size_t, limits, type traits, the min/max family, `__half`,
  `__nv_bfloat16`) stays declared where the host header declared it;
- **kept**: everything else, byte for byte: kernels, device functions, class templates,
  constants, macros, `#if` blocks (both branches: the preprocessor still chooses).

"Kept code names it" is read across the files viewed together, the files kept whole and
the launcher's name expressions; a name inside a macro's body counts only once kept code
names the macro (a host `check_cuda` that only a host-side `CHECK` macro calls is set
aside).

Set-aside text is replaced by blanks with every newline kept, so compiler messages carry
the file's own line numbers. `DeviceView.set_aside` lists each item with its line, reason
and file (`SetAside.file`: a header's path in the kernel root); the compile table and the
compile items report them. `DeviceView.kept_host` lists the host items kept only because
kept code names them that device code cannot use as they are (functions, variables, types
with member functions; not an alias or a plain data struct, which device code uses as it is),
each with what makes it usable there; a failed compile prints both lists.

Limits:
- `#if` branches are not evaluated: a function whose head differs between branches, or a
  construct the grammar cannot parse (a macro call with no `;` at file level) without a
  `__global__`/`__device__` in it, is a `DeviceViewError` naming the file, the line and
  the text;
- device code that uses a type from a header set aside (`at::Half` in a kernel's
  signature) does not compile: the compile error is followed by the list of what was set
  aside;
- template instances that exist only in host dispatch (`AT_DISPATCH...` launching
  `topk<scalar_t, 4>`) are set aside with the dispatch: name them in the launcher's
  `NAME_EXPRESSIONS`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from harness.compiling import cuda_syntax
from harness.core.errors import HarnessError, SetupError

VERSION = "4"  # part of the cache key: bump when the rules change

DEVICE_FUNCTION_MARKERS = cuda_syntax.DEVICE_MARKERS  # ("__global__", "__device__")
DEVICE_VARIABLE_MARKERS = ("__device__", "__constant__", "__shared__", "__managed__", "__global__")
HOST_NAMESPACES = frozenset({"torch", "at", "c10", "pybind11", "py"})
_HOST_PREFIXES = ("torch/", "ATen/", "c10/", "pybind11/", "nvtx3/", "cublas", "cusparse", "cufft", "cusolver",
                  "nccl", "cudnn", "nvToolsExt")
HOST_HEADERS = frozenset({"Python.h", "curand.h", "cuda_profiler_api.h", "iostream", "fstream", "sstream", "vector",
                          "string", "map", "unordered_map", "set", "unordered_set", "memory", "thread", "mutex",
                          "chrono", "random", "stdexcept", "exception", "cstdlib", "stdlib.h", "cstring", "string.h",
                          "iomanip", "ostream", "istream", "list", "deque", "optional", "tuple", "functional",
                          "numeric", "cstdio"})
# cstdio: printf is built into NVRTC; the shim is for files that only include it. <algorithm>
# is not here: its min/max family is device code too (harness/compiling/shims/algorithm under NVRTC).


# The device runtime API (kernels launching kernels) needs relocatable device code linked
# with cudadevrt, which the harness does not do; under NVRTC its header does not even open
# (it includes crt/ headers the runtime wheel lacks). nvcc's cuda_runtime.h includes it anyway.
DEVICE_RUNTIME_HEADERS = frozenset({"cuda_device_runtime_api.h"})


# What device code may still need from a set-aside host header (the standard integer types,
# the min/max family, __half...): harness/compiling/standin/, on the include path of both compilers.
# Each set-aside #include's line includes it instead, so those names are declared where the
# host header declared them, and the file keeps its line numbers.
STANDIN_HEADER = "harness_set_aside.h"


def is_host_header(name: str) -> bool:
    return name in HOST_HEADERS or name.startswith(_HOST_PREFIXES)


class DeviceViewError(HarnessError, ValueError):
    """A host-code section the device view cannot separate from device code."""


class ViewUnavailable(DeviceViewError, SetupError):
    """tree-sitter or its CUDA grammar is not installed (the device machine may lack them)."""


def available() -> bool:
    return cuda_syntax.available()


@dataclass(frozen=True)
class SetAside:
    line: int
    what: str  # "function main", "#include <torch/extension.h>", "declaration handle"
    reason: str
    file: str = ""  # a header's path in the kernel root; "" for the `.cu` itself

    def __str__(self) -> str:
        where = f"{self.file} line {self.line}" if self.file else f"line {self.line}"
        return f"{where}: {self.what} ({self.reason})"


def grouped(items) -> list[str]:
    """`SetAside` items as lines, those of one file with the same text and reason as one:
    `lines 383-391, 402: 10 instantiations of launch (...)`, so a host dispatch's explicit
    instantiations do not bury the rest. In order of each group's first line."""
    groups: dict[tuple, list[int]] = {}
    for s in items:
        groups.setdefault((s.file, s.what, s.reason), []).append(s.line)
    out = []
    for (file, what, reason), lines in groups.items():
        if len(lines) == 1:
            out.append(str(SetAside(lines[0], what, reason, file)))
            continue
        runs, start = [], None
        for i, n in enumerate(sorted(lines)):
            start = n if start is None else start
            if i + 1 == len(lines) or sorted(lines)[i + 1] != n + 1:
                runs.append(f"{start}-{n}" if n != start else str(n))
                start = None
        kind, _, name = what.partition(" ")
        label = f"{len(lines)} instantiations of {name}" if kind == "instantiation" else f"{what} ({len(lines)} times)"
        out.append(f"{file + ' ' if file else ''}lines {', '.join(runs)}: {label} ({reason})")
    return out


@dataclass(frozen=True)
class DeviceView:
    text: str
    set_aside: tuple[SetAside, ...]
    kept_host: tuple[SetAside, ...] = ()  # host items kept only because kept code names them

    @property
    def changed(self) -> bool:
        return bool(self.set_aside)

    def summary(self) -> str:
        return "; ".join(str(s) for s in self.set_aside) if self.set_aside else "nothing"

    def includes_kept(self) -> list[str]:
        return _INCLUDE.findall(self.text)


_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*[<"]([^>"]+)[>"]', re.MULTILINE)
_IDENT = re.compile(r"[A-Za-z_]\w*")
_DEFINE = re.compile(r"^[ \t]*#[ \t]*define[ \t]+([A-Za-z_]\w*)(?![\w(])[ \t]*(.*)$", re.MULTILINE)


def _tree(src: bytes):
    """The syntax tree of `src` as written (not `cuda_syntax.prepare`d: the view's rules were
    set on that tree); ViewUnavailable when tree-sitter or its grammar is not installed."""
    try:
        parser = cuda_syntax.parser()
    except ImportError as exc:  # pragma: no cover - a dependency
        raise ViewUnavailable(f"the device view needs tree-sitter and tree-sitter-cuda ({exc}): "
                              "pip install tree-sitter tree-sitter-cuda (pyproject lists them)") from None
    return parser.parse(src)


def _markers(texts: list[str]) -> tuple[set[str], set[str]]:
    """(function markers, variable markers): the CUDA keywords plus every object-like macro
    the texts define whose expansion holds one (transitively)."""
    fn, var = set(DEVICE_FUNCTION_MARKERS), set(DEVICE_VARIABLE_MARKERS)
    defs = []
    for t in texts:
        defs += _DEFINE.findall(t)
    changed = True
    while changed:
        changed = False
        for name, body in defs:
            words = set(_IDENT.findall(body))
            if name not in fn and words & fn:
                fn.add(name)
                changed = True
            if name not in var and words & var:
                var.add(name)
                changed = True
    return fn, var


def _head(src: bytes, node) -> str:
    """The text of a declaration before its body, parameters or initializer."""
    body = node.child_by_field_name("body")
    end = body.start_byte if body is not None else node.end_byte
    text = src[node.start_byte:end].decode("utf-8", errors="replace")
    return re.split(r"[({=]", text, maxsplit=1)[0] if body is None else text


def _function_declarator(node):
    stack = [node]
    while stack:
        n = stack.pop(0)
        if n.type == "function_declarator":
            return n
        if n.type in ("compound_statement", "initializer_list", "argument_list"):
            continue
        stack += list(n.named_children)
    return None


def _last_ident(text: str) -> str | None:
    idents = _IDENT.findall(text.split("<", 1)[0])
    return idents[-1] if idents else None


def _declared_names(src: bytes, node) -> list[str]:
    fd = _function_declarator(node)
    if fd is not None:
        inner = fd.child_by_field_name("declarator")
        name = _last_ident(src[inner.start_byte:inner.end_byte].decode(errors="replace")) if inner else None
        return [name] if name else []
    names = []
    for d in node.children_by_field_name("declarator") or []:
        text = src[d.start_byte:d.end_byte].decode(errors="replace")
        name = _last_ident(re.split(r"[\[=({]", text, maxsplit=1)[0])
        if name:
            names.append(name)
    if not names and node.type in ("alias_declaration", "type_definition", "using_declaration"):
        text = src[node.start_byte:node.end_byte].decode(errors="replace")
        if node.type == "alias_declaration":
            m = re.match(r"\s*using\s+([A-Za-z_]\w*)", text)
            names = [m.group(1)] if m else []
        else:
            name = _last_ident(re.split(r"[;\[(]", text.replace("using", " ", 1), maxsplit=1)[0].split("=")[0])
            names = [name] if name else []
    return names


def _snippet(src: bytes, node) -> str:
    text = src[node.start_byte:node.end_byte].decode(errors="replace").strip()
    first = text.splitlines()[0] if text else ""
    return first[:80] + (" ..." if len(first) > 80 or "\n" in text else "")


_CONTAINERS = {"translation_unit", "declaration_list", "preproc_if", "preproc_ifdef", "preproc_else", "preproc_elif",
               "preproc_elifdef", "linkage_specification", "namespace_definition"}
_TYPES = ("struct_specifier", "class_specifier", "union_specifier")


@dataclass
class _Item:
    node: object
    kind: str  # "function", "variable", "alias", "type", "using-namespace"
    names: list[str]
    device: bool
    fix: str = ""  # kept because kept code names it: what makes it usable in device code ("": nothing to)


@dataclass(frozen=True)
class Unit:
    """One file of a module for `device_views`: its text, the name its messages use, where
    the include path finds each of its headers (`resolve(name, quoted)`, None: not found),
    and the label its set-aside items carry (`SetAside.file`; "" for the `.cu`)."""

    text: str
    where: str | Path
    resolve: Callable[[str, bool], Path | None]
    label: str = ""


@dataclass
class _Parsed:
    unit: Unit
    src: bytes
    items: list[_Item]
    includes: list


def device_view(text: str, where: str | Path, resolve: Callable[[str, bool], Path | None],
                extra_texts: tuple[str, ...] = ()) -> DeviceView:
    """The device-only view of `text` (the source of `where`). `resolve(name, quoted)` says
    where the include path finds a header (None: not found). `extra_texts`: files compiled
    with it and kept whole, read for macros that expand to `__device__` / `__global__` and
    for the names they use."""
    return device_views([Unit(text, where, resolve)], extra_texts)[0]


def device_views(units: list[Unit], context: tuple[str, ...] = ()) -> list[DeviceView]:
    """The device-only views of files compiled together (a `.cu` and the kernel-root headers
    it reaches), one per unit, in order. The rules are one file's, with what counts as used
    taken across them all: a host item is kept when kept code of any unit, or `context` (the
    texts kept whole: headers outside the kernel root, name expressions), names it."""
    fn_markers, var_markers = _markers([*(u.text for u in units), *context])
    parsed = [_parse(u, fn_markers, var_markers) for u in units]
    dropped = [[it for it in p.items if not it.device] for p in parsed]
    while True:  # a candidate that kept code names is kept, and what it names counts too
        kept = [_blank(p.src, sorted([(it.node.start_byte, it.node.end_byte) for it in drop]
                                     + [(inc.start_byte, inc.end_byte) for inc in p.includes]))  # `.h` is no reference
                .decode("utf-8", errors="replace") for p, drop in zip(parsed, dropped)]
        referenced = _references([*kept, *context])
        rescued = False
        for i, drop in enumerate(dropped):
            keep = [it for it in drop if set(it.names) & referenced]
            if keep:
                dropped[i] = [it for it in drop if it not in keep]
                rescued = True
        if not rescued:
            break
    return [_view(p, drop, [it for it in p.items if not it.device and it not in drop])
            for p, drop in zip(parsed, dropped)]


_DEFINE_BODY = re.compile(r"^[ \t]*#[ \t]*define[ \t]+([A-Za-z_]\w*)((?:\\\n|[^\n])*)", re.MULTILINE)


def _references(texts: list[str]) -> set[str]:
    """The identifiers the texts name outside macro bodies, and those in the body of every
    macro they name, transitively: a host helper that only a host-side CHECK macro calls
    is named by no kept code until something kept expands that macro."""
    from harness.compiling.cpp_text import strip_comments_and_literals

    bodies: dict[str, set[str]] = {}
    plain = []
    for text in texts:
        text = strip_comments_and_literals(text)
        for name, body in _DEFINE_BODY.findall(text):
            bodies.setdefault(name, set()).update(_IDENT.findall(body))
        plain.append(_DEFINE_BODY.sub("", text))
    referenced = set(_IDENT.findall("\n".join(plain)))
    frontier = referenced & bodies.keys()
    while frontier:
        new = set().union(*(bodies.pop(n) for n in frontier)) - referenced
        referenced |= new
        frontier = new & bodies.keys()
    return referenced


def _parse(unit: Unit, fn_markers: set[str], var_markers: set[str]) -> _Parsed:
    """The unit's file-level items (functions, variables, aliases, types, `using
    namespace`), each marked device or not, and its `#include`s."""
    src = unit.text.encode("utf-8")
    tree = _tree(src)
    items: list[_Item] = []
    includes = []

    def has(markers, head: str) -> bool:
        return bool(set(_IDENT.findall(head)) & markers)

    def visit(node):
        for child in node.named_children:
            t = child.type
            if t in ("comment", "string_literal", "namespace_identifier", "identifier", "preproc_arg"):
                continue
            if node.type in ("preproc_if", "preproc_elif") and child == node.child_by_field_name("condition"):
                continue
            if t in _CONTAINERS:
                if t == "namespace_definition" or t == "linkage_specification":
                    body = child.child_by_field_name("body")
                    if body is not None:
                        visit(body)
                else:
                    visit(child)
            elif t == "preproc_include":
                includes.append(child)
            elif t in ("function_definition", "template_declaration", "template_instantiation", "declaration"):
                inner = child
                while inner.type == "template_declaration":
                    nxt = [c for c in inner.named_children if c.type in ("function_definition", "declaration",
                                                                           "template_declaration")]
                    if not nxt:
                        break
                    inner = nxt[-1]
                if inner.type == "template_declaration" or (child.type == "template_declaration" and inner is child):
                    continue  # a class template or alias template: kept
                is_fn = inner.type in ("function_definition", "template_instantiation") or _is_prototype(inner)
                head = _head(src, inner)
                if is_fn:
                    items.append(_Item(child, "function", _declared_names(src, inner), has(fn_markers, head),
                                       _FIX_CONSTEXPR if "constexpr" in _IDENT.findall(head) else _FIX_FUNCTION))
                else:  # a constexpr constant is usable in device code: kept
                    items.append(_Item(child, "variable", _declared_names(src, inner),
                                       has(var_markers, head) or "constexpr" in _IDENT.findall(head), _FIX_VARIABLE))
            elif t in _TYPES and child.child_by_field_name("body") is not None:
                name = child.child_by_field_name("name")
                whole = src[child.start_byte:child.end_byte].decode(errors="replace")
                names = [_last_ident(src[name.start_byte:name.end_byte].decode(errors="replace"))] if name else []
                items.append(_Item(child, "type", [n for n in names if n], not names or has(fn_markers, whole),
                                   _FIX_TYPE if _has_member_functions(child) else ""))
            elif t in ("alias_declaration", "type_definition", "using_declaration"):
                body = src[child.start_byte:child.end_byte].decode(errors="replace")
                m = re.match(r"\s*using\s+namespace\s+([A-Za-z_]\w*)", body)
                if m:
                    if m.group(1) in HOST_NAMESPACES:
                        items.append(_Item(child, "using-namespace", [], False))
                    continue
                items.append(_Item(child, "alias", _declared_names(src, child), False))
            elif t == "ERROR":
                snippet = src[child.start_byte:child.end_byte].decode(errors="replace")
                if has(fn_markers | var_markers, snippet):
                    continue  # device code the grammar half-parses: kept whole
                line = child.start_point[0] + 1
                raise DeviceViewError(
                    f"{unit.where}:{line}: the device view cannot separate `{_snippet(src, child)}`: the CUDA grammar "
                    "does not parse it as a declaration (a macro call with no `;` at file level, or a declaration "
                    "whose head is split across #if branches). Fix: set DEVICE_VIEW = False in the launcher and "
                    "compile the file as it is (guard its host code with `#ifndef __CUDACC_RTC__`), or move the "
                    "construct into a host-only file")

    visit(tree.root_node)
    return _Parsed(unit, src, items, includes)


_FIX_FUNCTION = "give it __device__ (__host__ __device__ to keep it on the host too), or write a __device__ twin"
_FIX_CONSTEXPR = ("a constexpr function: declare the upstream build's --expt-relaxed-constexpr in EXTRA_FLAGS (NVRTC: "
                  "-default-device), or give it __host__ __device__")
_FIX_VARIABLE = "device code cannot read a host variable: make it constexpr, or __device__ or __constant__"
_FIX_TYPE = "its member functions are host code: give those device code calls __host__ __device__"


def _has_member_functions(node) -> bool:
    """Whether a struct, class or union declares a member function (a constructor, an
    operator): one with only data members and nested types is plain data, device code as
    much as host code."""
    body = node.child_by_field_name("body")
    stack = list(body.named_children) if body is not None else []
    while stack:
        n = stack.pop()
        if n.type == "function_definition":
            return True
        if n.type in ("field_declaration", "declaration"):
            if any(d.type == "function_declarator" for d in n.children_by_field_name("declarator")):
                return True
        if n.type in ("template_declaration", "field_declaration", "struct_specifier", "class_specifier",
                      "union_specifier", "field_declaration_list", "access_specifier", "preproc_if", "preproc_ifdef",
                      "preproc_else", "preproc_elif"):
            stack += list(n.named_children)
    return False


def _what(src: bytes, it: _Item) -> str:
    if it.kind == "function":
        name = it.names[0] if it.names else _snippet(src, it.node)
        return f"function {name}" if it.node.type != "template_instantiation" else f"instantiation {name}"
    if it.kind == "using-namespace":
        return _snippet(src, it.node)
    if it.kind == "type":
        return f"type {it.names[0]}"
    return f"{'declaration' if it.kind == 'variable' else 'alias'} {', '.join(it.names) or _snippet(src, it.node)}"


_REASONS = {"function": "host code: no __global__ or __device__, and no kept code names it",
            "using-namespace": "a host library's namespace",
            "type": "host-only: no __global__ or __device__ member, and no kept code names it"}


def _view(parsed: _Parsed, dropped: list[_Item], rescued: list[_Item]) -> DeviceView:
    src, unit = parsed.src, parsed.unit
    set_aside: list[SetAside] = []
    spans = []
    for it in dropped:
        reason = _REASONS.get(it.kind, "host-only: no device memory space, and no kept code names it")
        set_aside.append(SetAside(it.node.start_point[0] + 1, _what(src, it), reason, unit.label))
        after = it.node.next_sibling  # a type definition's `;` is its own token
        end = after.end_byte if it.kind == "type" and after is not None and after.type == ";" else it.node.end_byte
        spans.append((it.node.start_byte, end))
    kept_host = tuple(SetAside(it.node.start_point[0] + 1, _what(src, it), f"host-only, kept: kept code names it; "
                               f"{it.fix}", unit.label) for it in rescued if it.fix)  # an alias, plain data: usable
    standins = []  # set-aside includes whose line includes STANDIN_HEADER instead

    for inc in parsed.includes:
        if any(s <= inc.start_byte < e for s, e in spans):
            continue
        path_node = inc.child_by_field_name("path")
        raw = src[path_node.start_byte:path_node.end_byte].decode(errors="replace") if path_node else ""
        name, quoted = raw.strip('<>"'), raw.startswith('"')
        if is_host_header(name):
            reason = "a host-only library header"
        elif name in DEVICE_RUNTIME_HEADERS:
            reason = "the device runtime API, which needs relocatable device code the harness does not link"
        elif not quoted and unit.resolve(name, quoted) is None:
            reason = "not found on the include path; device code must not need it"
        else:
            continue
        line = inc.start_point[0] + 1
        set_aside.append(SetAside(line, f"#include {raw}", reason, unit.label))
        end = inc.end_byte
        if src[end - 1:end] == b"\n":
            end -= 1
        spans.append((inc.start_byte, end))
        if name not in DEVICE_RUNTIME_HEADERS:
            standins.append((inc.start_byte, end))

    set_aside.sort(key=lambda s: s.line)
    view = _blank(src, sorted(spans), standins).decode("utf-8") if spans else unit.text
    return DeviceView(view, tuple(set_aside), kept_host)


def _is_prototype(node) -> bool:
    return node.type == "declaration" and any(c.type == "function_declarator"
                                               for c in node.children_by_field_name("declarator") or [])


def _blank(src: bytes, spans, standins=()) -> bytes:
    """`src` with every span blanked (newlines kept); a span in `standins` (a set-aside
    `#include`, on one line) holds `#include <STANDIN_HEADER>` instead."""
    out = bytearray(src)
    for s, e in spans:
        for i in range(s, e):
            if out[i] not in (0x0A,):
                out[i] = 0x20
    for s, e in sorted(standins, reverse=True):  # from the end: a longer line moves nothing before it
        out[s:e] = f"#include <{STANDIN_HEADER}>".encode()
    return bytes(out)
