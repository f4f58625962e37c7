"""Mutation operators over the tree-sitter CUDA syntax tree, device code only.

Each operator is a function `(node, text) -> [(start_byte, end_byte, replacement, what)]`
called on every node inside the body of a `__global__` or `__device__` function. Each
has a one-line reason: the kind of real kernel defect it stands for.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

from harness.core.errors import UsageError


@dataclass(frozen=True)
class Operator:
    name: str
    reason: str  # the defect it stands for, in one line
    fn: Callable


def _text(node) -> str:
    return node.text.decode("utf-8", errors="replace")


def _op_child(node):
    return node.child_by_field_name("operator")


def _swap(node, table: dict[str, list[str]]):
    """Replace the operator token of `node` by each replacement in `table`."""
    op = _op_child(node)
    if op is None:
        return []
    token = _text(op)
    return [(op.start_byte, op.end_byte, r, f"{token} -> {r}") for r in table.get(token, ())]


# ---------------------------------------------------------------- operator swaps

_ARITH = {"+": ["-"], "-": ["+"], "*": ["/"], "/": ["*"], "%": ["*"]}
_ARITH_ASSIGN = {"+=": ["-="], "-=": ["+="], "*=": ["/="], "/=": ["*="]}
_RELATIONAL = {"<": [">="], "<=": [">"], ">": ["<="], ">=": ["<"], "==": ["!="], "!=": ["=="]}
_BOUNDARY = {"<": ["<="], "<=": ["<"], ">": [">="], ">=": [">"]}
_LOGICAL = {"&&": ["||"], "||": ["&&"]}
_BITWISE = {"&": ["|"], "|": ["&"], "^": ["|"], "<<": [">>"], ">>": ["<<"]}
_BITWISE_ASSIGN = {"&=": ["|="], "|=": ["&="], "^=": ["|="], "<<=": [">>="], ">>=": ["<<="]}


def arithmetic(node, text):
    if node.type == "binary_expression":
        return _swap(node, _ARITH)
    if node.type == "assignment_expression":
        return _swap(node, _ARITH_ASSIGN)
    return []


def relational(node, text):
    return _swap(node, _RELATIONAL) if node.type == "binary_expression" else []


def boundary(node, text):
    return _swap(node, _BOUNDARY) if node.type == "binary_expression" else []


def _unary_dropped(node, op: str):
    """`op x` -> `(x)`, for the unary operator `op`."""
    if node.type == "unary_expression" and _op_child(node) is not None and _text(_op_child(node)) == op:
        arg = node.child_by_field_name("argument")
        return [(node.start_byte, node.end_byte, f"({_text(arg)})", f"{op} dropped")]
    return []


def logical(node, text):
    if node.type == "binary_expression":
        return _swap(node, _LOGICAL)
    return _unary_dropped(node, "!")


def bitwise(node, text):
    if node.type == "binary_expression":
        return _swap(node, _BITWISE)
    if node.type == "assignment_expression":
        return _swap(node, _BITWISE_ASSIGN)
    return _unary_dropped(node, "~")


# ---------------------------------------------------------------- literals

# the grammar folds a leading minus into the literal: `-1` is one number_literal
_INT = re.compile(r"^(-?)(0[xX][0-9a-fA-F']+|0[bB][01']+|[0-9][0-9']*)([uUlLzZ]*)$")
_FLOAT = re.compile(r"^-?(?:\d+\.\d*|\.\d+|\d+(?=[eE]))(?:[eE][+-]?\d+)?([fF]?)$|^-?\d+([fF])$")


def _array_size(node) -> bool:
    """A literal that declares an array's size: changing it only breaks the compile or the
    initialiser, never the arithmetic."""
    return node.parent is not None and node.parent.type == "array_declarator"


def int_literal(node, text):
    if node.type != "number_literal" or _array_size(node):
        return []
    m = _INT.match(_text(node))
    if not m:
        return []
    sign, digits, suffix = m.groups()
    value = int(digits.replace("'", ""), 0) * (-1 if sign else 1)
    hexa = digits[:2].lower() == "0x"

    def fmt(v: int) -> str:
        magnitude = f"0x{abs(v):x}" if hexa else str(abs(v))
        return ("-" if v < 0 else "") + magnitude

    out = []
    if value != -1:  # -1 + 1 is 0, made below
        out.append((node.start_byte, node.end_byte, fmt(value + 1) + suffix, "+1"))
    if value > 0 or sign:
        out.append((node.start_byte, node.end_byte, fmt(value - 1) + suffix, "-1"))
    if value != 0:
        out.append((node.start_byte, node.end_byte, "0" + suffix, "-> 0"))
    return [(s, e, r, w) for s, e, r, w in out if r != _text(node)]


def float_constant(node, text):
    if node.type != "number_literal":
        return []
    t = _text(node)
    if not _FLOAT.match(t):
        return []
    suffix = "f" if t[-1] in "fF" else ""
    value = float(t[:-1] if suffix else t)
    if value == 0.0:
        return [(node.start_byte, node.end_byte, "1.0" + suffix, "-> 1")]
    return [(node.start_byte, node.end_byte, "0.0" + suffix, "-> 0"),
            (node.start_byte, node.end_byte, t[1:] if t.startswith("-") else f"(-{t})", "negated"),
            (node.start_byte, node.end_byte, f"({t} * 2)", "doubled")]


# ---------------------------------------------------------------- guards and indices

_EXITS = ("return_statement", "break_statement", "continue_statement")


def _is_exit(stmt) -> bool:
    if stmt is None:
        return False
    if stmt.type in _EXITS:
        return True
    if stmt.type == "expression_statement" and stmt.named_child_count:
        call = stmt.named_children[0]
        fn = call.child_by_field_name("function") if call.type == "call_expression" else None
        return fn is not None and _text(fn) == "__trap"
    if stmt.type == "compound_statement" and stmt.named_child_count == 1:
        return _is_exit(stmt.named_children[0])
    return False


def _has_comparison(node) -> bool:
    if node.type == "binary_expression" and _text(_op_child(node)) in _BOUNDARY:
        return True
    return any(_has_comparison(c) for c in node.named_children)


def guard_dropped(node, text):
    if node.type != "if_statement":
        return []
    cond = node.child_by_field_name("condition")
    value = cond.child_by_field_name("value") if cond is not None else None
    if value is None:
        return []
    consequence = node.child_by_field_name("consequence")
    if _is_exit(consequence):
        return [(value.start_byte, value.end_byte, "false", "early-exit guard never fires")]
    if _has_comparison(value) and node.child_by_field_name("alternative") is None:
        return [(value.start_byte, value.end_byte, "true", "bounds guard always passes")]
    return []


def array_index(node, text):
    if node.type != "subscript_expression":
        return []
    indices = node.child_by_field_name("indices")
    if indices is None or indices.named_child_count != 1:
        return []
    idx = indices.named_children[0]
    t = _text(idx)
    out = [(idx.start_byte, idx.end_byte, f"({t} + 1)", "+1"), (idx.start_byte, idx.end_byte, f"({t} - 1)", "-1")]
    if t.strip() != "0":
        out.append((idx.start_byte, idx.end_byte, "0", "-> 0"))
    return out


_SWAP_INDEX = {"threadIdx": "blockIdx", "blockIdx": "threadIdx"}


def gpu_index(node, text):
    if node.type != "field_expression":
        return []
    arg = node.child_by_field_name("argument")
    if arg is None or arg.type != "identifier":
        return []
    name, t = _text(arg), _text(node)
    if name in _SWAP_INDEX:
        return [(arg.start_byte, arg.end_byte, _SWAP_INDEX[name], f"{name} -> {_SWAP_INDEX[name]}"),
                (node.start_byte, node.end_byte, f"({t} + 1)", "+1"),
                (node.start_byte, node.end_byte, f"({t} - 1)", "-1")]
    if name in ("blockDim", "gridDim"):
        return [(node.start_byte, node.end_byte, f"({t} - 1)", "-1"),
                (node.start_byte, node.end_byte, f"({t} + 1)", "+1")]
    return []


# ---------------------------------------------------------------- synchronisation

_BARRIERS = re.compile(r"^(__syncthreads|__syncwarp|__threadfence\w*|__barrier_sync|__syncthreads_count"
                       r"|__syncthreads_and|__syncthreads_or)$")


def _call(node):
    """(function name, argument nodes) for a call_expression, else None."""
    if node.type != "call_expression":
        return None
    fn = node.child_by_field_name("function")
    args = node.child_by_field_name("arguments")
    if fn is None or args is None:
        return None
    return _text(fn), list(args.named_children)


def barrier(node, text):
    if node.type != "expression_statement" or not node.named_child_count:
        return []
    call = _call(node.named_children[0])
    if call is None or not _BARRIERS.match(call[0]):
        return []
    return [(node.start_byte, node.end_byte, ";", f"{call[0]}() removed")]


def shuffle(node, text):
    call = _call(node)
    if call is None or not call[0].startswith("__shfl_") or not call[0].endswith("_sync"):
        return []
    name, args = call
    if len(args) < 3:
        return []
    mask, lane = args[0], args[2]
    lt = _text(lane)
    out = [(mask.start_byte, mask.end_byte, "0x7fffffffu", "mask loses lane 31"),
           (lane.start_byte, lane.end_byte, f"({lt} + 1)", "lane/offset +1"),
           (lane.start_byte, lane.end_byte, f"({lt} - 1)", "lane/offset -1")]
    if len(args) >= 4:
        w = args[3]
        out.append((w.start_byte, w.end_byte, f"({_text(w)} / 2)", "width halved"))
    else:
        out.append((lane.end_byte, lane.end_byte, ", 16", "width 16 added"))
    return out


_ATOMIC = re.compile(r"^atomic(Add|Sub|Max|Min|Or|And|Xor|Exch|CAS)(_block|_system)?$")
_RMW = {"Add": "old + ({v})", "Sub": "old - ({v})", "Max": "max(old, ({v}))", "Min": "min(old, ({v}))",
        "Or": "old | ({v})", "And": "old & ({v})", "Xor": "old ^ ({v})", "Exch": "({v})"}


def atomic(node, text):
    call = _call(node)
    if call is None:
        return []
    m = _ATOMIC.match(call[0])
    if m is None:
        return []
    kind, args = m.group(1), [_text(a) for a in call[1]]
    if kind == "CAS":
        if len(args) != 3:
            return []
        new = f"(old == ({args[1]}) ? ({args[2]}) : old)"
    else:
        if len(args) != 2:
            return []
        new = _RMW[kind].format(v=args[1])
    p = args[0]
    plain = f"([&]() {{ const auto old = *({p}); *({p}) = {new}; return old; }}())"
    return [(node.start_byte, node.end_byte, plain, f"{call[0]} -> plain read-modify-write")]


def store_dropped(node, text):
    if node.type != "expression_statement" or not node.named_child_count:
        return []
    expr = node.named_children[0]
    if expr.type != "assignment_expression":
        return []
    left = expr.child_by_field_name("left")
    if left is None or left.type not in ("subscript_expression", "pointer_expression", "field_expression"):
        return []
    if left.type == "field_expression" and "->" not in _text(left) and left.child_by_field_name("argument").type \
            not in ("subscript_expression", "pointer_expression"):
        return []  # a member of a local struct: not a memory store
    return [(node.start_byte, node.end_byte, ";", f"store to {_text(left)} dropped")]


def shared_dropped(node, text):
    if node.type != "declaration":
        return []
    for child in node.children:
        if child.type == "type_qualifier" and _text(child) == "__shared__":
            return [(child.start_byte, child.end_byte, "", "__shared__ dropped: one copy per thread")]
    return []


OPERATORS: dict[str, Operator] = {op.name: op for op in (
    Operator("arithmetic", "a wrong sign or scale in the formula (+ for -, * for /)", arithmetic),
    Operator("relational", "a negated comparison: the wrong branch or the wrong rows selected", relational),
    Operator("boundary", "an off-by-one bound: < for <=, the tail element read or dropped", boundary),
    Operator("logical", "a wrong combination of conditions (&& for ||, a ! dropped)", logical),
    Operator("bitwise", "wrong bit packing or masking (& for |, << for >>, a ~ dropped)", bitwise),
    Operator("int-literal", "an off-by-one or zeroed constant (stride, count, lane, offset)", int_literal),
    Operator("float-constant", "a wrong numeric constant (epsilon, scale, initial value)", float_constant),
    Operator("guard-dropped", "a bounds or early-exit guard removed: out-of-range reads and writes", guard_dropped),
    Operator("array-index", "an element off by one, or always the first element", array_index),
    Operator("gpu-index", "a thread mapped to the wrong work item (threadIdx/blockIdx mixed, off by one)", gpu_index),
    Operator("barrier", "a missing __syncthreads/__syncwarp/__threadfence: a data race", barrier),
    Operator("shuffle", "a warp exchange from the wrong lane, width or with a lane missing from the mask", shuffle),
    Operator("atomic", "a lost update: an atomic replaced by a plain read-modify-write", atomic),
    Operator("store-dropped", "a result never written to memory", store_dropped),
    Operator("shared-dropped", "a shared-memory buffer made per-thread: others never see what one thread wrote",
             shared_dropped),
)}


class UnknownOperator(UsageError):
    pass


def parse_operators(spec: str | None) -> tuple[str, ...]:
    """Operator names from a comma-separated list; all when `spec` is None (an empty list names none)."""
    if spec is None:
        return tuple(OPERATORS)
    names = tuple(n.strip() for n in spec.split(",") if n.strip())
    unknown = [n for n in names if n not in OPERATORS]
    if unknown or not names:
        raise UnknownOperator(f"unknown operator(s) {', '.join(map(repr, unknown)) or '(none named)'}: "
                              f"use a comma-separated list of {', '.join(OPERATORS)}")
    return names
