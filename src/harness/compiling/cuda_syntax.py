"""The CUDA syntax tree: one tree-sitter parser for the device view, the mutants and the
structural gates.

tree-sitter and its CUDA grammar (`tree-sitter`, `tree-sitter-cuda`) are imported on the
first parse, not when this module is: a caller that can do without a syntax tree (the
device view, `harness.compiling.compile`) checks `available()` or catches the ImportError that
`parser()` raises.

- `parser()`: the one parser, built on first use (ImportError when a package is missing);
  `available()`: whether it can be built.
- `prepare(source)`: `source` with what the grammar cannot parse inside statements
  (`#pragma` lines, `__align__(N)`) blanked with spaces, every byte offset and line kept;
  `parse(source)`: the tree of a prepared source (`prepared=False`: of the source as it is).
- `walk(node, skip=())`: `node` and every node under it, in source order, not descending
  into nodes of the `skip` types (below `node`).
- `function_name(fn)`: a function definition's name (`"?"` when the grammar shows none);
  `is_device_function(fn)`: it says `__global__` or `__device__` in its head;
  `is_kernel(fn)`: it says `__global__`; `device_functions(tree)`: the device function
  definitions of a tree, outermost only, in source order.
- `first_error(node)`: the first ERROR or MISSING node under `node` in source order, or None.

Device code here is what the grammar shows: a `__device__` that a macro expands to is not
seen (the device view reads macros itself: `harness.compiling.deviceview`).
"""

from __future__ import annotations

import re

DEVICE_MARKERS = ("__global__", "__device__")

_parser = None


def parser():
    """The tree-sitter parser of the CUDA grammar, built once. Raises ImportError (the
    import's own) when tree-sitter or tree-sitter-cuda is not installed."""
    global _parser
    if _parser is None:
        import tree_sitter_cuda
        from tree_sitter import Language, Parser

        _parser = Parser(Language(tree_sitter_cuda.language()))
    return _parser


def available() -> bool:
    """Whether tree-sitter and tree-sitter-cuda are installed (the parser can be built)."""
    try:
        parser()
    except ImportError:
        return False
    return True


_PRAGMA = re.compile(rb"^[ \t]*#[ \t]*pragma[^\n]*", re.MULTILINE)
_ALIGN = re.compile(rb"__align__\s*\(\s*\d+\s*\)")


def _blank(m: re.Match) -> bytes:
    return re.sub(rb"[^\n]", b" ", m.group(0))


def prepare(source: bytes) -> bytes:
    """`source` with what the grammar cannot parse blanked, offsets and lines kept."""
    return _ALIGN.sub(_blank, _PRAGMA.sub(_blank, source))


def parse(source: bytes | str, *, prepared: bool = True):
    """The syntax tree of `source` (a str is encoded as UTF-8), parsed after `prepare` unless
    `prepared` is False. Node offsets are those of `source` either way."""
    data = source.encode() if isinstance(source, str) else source
    return parser().parse(prepare(data) if prepared else data)


def walk(node, skip: tuple[str, ...] = ()):
    """`node` and its descendants, depth first in source order; a node whose type is in
    `skip` is yielded but not descended into (`node` itself always is)."""
    stack = [node]
    while stack:
        n = stack.pop()
        yield n
        if n is node or n.type not in skip:
            stack.extend(reversed(n.children))


def function_name(node) -> str:
    """The name in a function definition's declarator (`k`, `ns::k`, `operator+`), or "?"."""
    decl = node.child_by_field_name("declarator")
    while decl is not None and decl.type != "function_declarator":
        decl = decl.child_by_field_name("declarator")
    inner = decl.child_by_field_name("declarator") if decl is not None else None
    return inner.text.decode(errors="replace") if inner is not None else "?"


def is_device_function(node) -> bool:
    """Whether a function definition's head says `__global__` or `__device__` (a child of
    the definition: not through a macro)."""
    return any(c.type in DEVICE_MARKERS for c in node.children)


def is_kernel(node) -> bool:
    """Whether a function definition's head says `__global__`."""
    return any(c.type == "__global__" for c in node.children)


def device_functions(tree) -> list:
    """Every `__global__`/`__device__` function definition of `tree`, in source order; one
    inside another device function is not listed on its own."""
    out, stack = [], [tree.root_node]
    while stack:
        node = stack.pop()
        if node.type == "function_definition" and is_device_function(node):
            out.append(node)
            continue  # nothing device-side nests inside a function we mutate separately
        stack.extend(reversed(node.children))
    return out


def first_error(node):
    """The first ERROR or MISSING node at or under `node`, in source order; None when the
    subtree parsed cleanly."""
    if node.is_error or node.is_missing:
        return node
    if not node.has_error:
        return None
    for child in node.children:
        found = first_error(child)
        if found is not None:
            return found
    return None
