"""Which kernels can run a device function: the call graph of the kernel root, by name.

For `--trap-gates reached`: a mutant in function F can only change what a gate sees if a
kernel the gate launches runs F's code. The graph is read from the sources with the same
tree-sitter grammar as the mutants, and it over-approximates on purpose (a wrong "reaches"
costs a gate run; a wrong "does not reach" would hide a kill):

- a function reaches every function or macro whose name appears anywhere in its body (a
  call, a template call, a method call's field name, a function pointer), not only in calls;
- a function-like or object-like macro reaches every name in its replacement text;
- names are global across files: two functions of one name (paged attention's and
  QK-RoPE's `warp_sum`) are one node, so each reaches what either does.
"""

from __future__ import annotations

import re
from pathlib import Path

from harness.campaigns.mutate.generate import SOURCE_SUFFIXES
from harness.compiling.cuda_syntax import function_name, is_kernel, parse, walk

_NAME = re.compile(r"[A-Za-z_]\w*")


def _names_in(node) -> set[str]:
    return {n.text.decode(errors="replace") for n in walk(node)
            if n.type in ("identifier", "field_identifier", "type_identifier")}


def read_graph(kernel_root: Path) -> tuple[dict[str, set[str]], set[str]]:
    """({name: names it mentions}, kernel names) over every .cu/.cuh under `kernel_root`."""
    edges: dict[str, set[str]] = {}
    kernels: set[str] = set()
    for path in sorted(p for p in Path(kernel_root).rglob("*") if p.suffix in SOURCE_SUFFIXES and p.is_file()):
        for node in walk(parse(path.read_bytes()).root_node):
            if node.type == "function_definition":
                name = function_name(node)
                body = node.child_by_field_name("body")
                if name == "?" or body is None:
                    continue
                edges.setdefault(name, set()).update(_names_in(body))
                if is_kernel(node):
                    kernels.add(name)
            elif node.type in ("preproc_function_def", "preproc_def"):
                name_node, value = node.child_by_field_name("name"), node.child_by_field_name("value")
                if name_node is not None and value is not None:
                    edges.setdefault(name_node.text.decode(errors="replace"), set()).update(
                        _NAME.findall(value.text.decode(errors="replace")))
    return edges, kernels


def kernels_reaching(kernel_root: Path) -> dict[str, frozenset[str]]:
    """{function name: the kernels whose code can run it} (a kernel reaches itself). A
    function no kernel reaches is absent: nothing can be said of it, so nothing is skipped."""
    edges, kernels = read_graph(kernel_root)
    reach: dict[str, set[str]] = {}
    for k in kernels:
        seen, stack = {k}, [k]
        while stack:
            for nxt in edges.get(stack.pop(), ()):
                if nxt in edges and nxt not in seen:
                    seen.add(nxt)
                    stack.append(nxt)
        for name in seen:
            reach.setdefault(name, set()).add(k)
    return {name: frozenset(ks) for name, ks in reach.items()}


def kernel_base_name(launched: str) -> str:
    """`file.cu:name` or `file.cu:ns::name<256>` (gates.json's kernels_launched) -> `name`."""
    head, sep, rest = launched.partition(":")
    expr = rest if sep and head.endswith(SOURCE_SUFFIXES) else launched
    return expr.split("<", 1)[0].split("::")[-1].strip()
