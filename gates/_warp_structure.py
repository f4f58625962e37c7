"""Warp primitives read from the syntax tree, for gates/test_warp_structure.py.

The source is parsed with the tree-sitter CUDA grammar exactly as the mutation generator
parses it (`harness.compiling.cuda_syntax.parse`), so the calls, loops and arguments this module sees
are the ones a mutant changes.

- `warp_calls(text)`: every call of a warp primitive (`__shfl_*_sync`, `__ballot_sync`,
  `__any_sync`, `__all_sync`, `__uni_sync`, `__match_*_sync`, `__reduce_*_sync`,
  `__syncwarp`) with its function, line, arguments and enclosing `for` loops; also the
  lines where the text names a primitive the tree holds no call for (a macro, a parse
  error), so a gate can never pass by not seeing a call.
- `Constants`: the integer names a file defines at namespace scope (`#define N 32`,
  `constexpr int N = 32;`), its quoted includes read on demand through `read_source`.
- `evaluate(node, env, consts)`: an integer constant expression (literals, names, the
  operators `+ - * / % << >> & | ^ ~ !`, comparisons, `&&`, `||`, parentheses); `env`
  binds names and fields (`threadIdx.x`) to values.
- `loop_values(loop, consts, env)`: the values a `for` loop's variable takes, by running
  its init, condition and step.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable

from harness.compiling.cuda_syntax import function_name, parse, walk
from harness.library.source import strip_comments_and_literals

# The first argument of each is the member mask.
MASKED = re.compile(r"^(__shfl(_xor|_down|_up)?_sync|__ballot_sync|__any_sync|__all_sync|__uni_sync"
                    r"|__match_(any|all)_sync|__reduce_\w+_sync|__syncwarp)$")
# The third argument of each is a lane offset (a butterfly's xor mask or a shift).
OFFSET_SHUFFLES = ("__shfl_xor_sync", "__shfl_down_sync", "__shfl_up_sync")
SHUFFLES = ("__shfl_sync",) + OFFSET_SHUFFLES  # an optional fourth argument is the width
_NAMED = re.compile(r"(?<!\w)(__shfl(?:_xor|_down|_up)?_sync|__ballot_sync|__any_sync|__all_sync|__uni_sync"
                    r"|__match_(?:any|all)_sync|__reduce_\w+_sync|__syncwarp)\s*\(")
FULL_MASK_LITERAL = re.compile(r"0[xX][fF]{8}[uU]?")
FULL_MASK = 0xFFFFFFFF
MAX_LOOP_STEPS = 64


class Unevaluable(ValueError):
    """An expression that is not an integer constant expression of what we can read."""


def text_of(node) -> str:
    return node.text.decode(errors="replace")


def line_of(node) -> int:
    return node.start_point[0] + 1


# ------------------------------------------------------------------ integer constants

_INT = re.compile(r"(0[xX][0-9a-fA-F']+|0[bB][01']+|[0-9][0-9']*)([uU]?[lL]{0,2}[uU]?)")


def int_literal(spelling: str) -> int:
    m = _INT.fullmatch(spelling)
    if m is None:
        raise Unevaluable(f"`{spelling}` is not an integer literal")
    digits = m.group(1).replace("'", "")
    if len(digits) > 1 and digits[0] == "0" and digits[1] not in "xXbB":
        return int(digits, 8)
    return int(digits, 0)


class Constants:
    """Integer names defined at namespace scope in one file (and, on a miss, in the files it
    includes with quotes, each loaded by `load(name)`, which returns its text or None)."""

    def __init__(self, text: str, load: Callable[[str], str | None] | None = None):
        self._defs: dict[str, list] = {}
        self._includes: list[str] = []
        self._load = load
        self._seen: set[str] = set()
        self._absorb(text)
        self._evaluating: set[str] = set()
        self._values: dict[str, int] = {}  # each name evaluated once (a macro's text is parsed each time)
        self._compiled: dict = {}  # `evaluate`'s closures of the expressions evaluated with these constants

    def _absorb(self, text: str) -> None:
        tree = parse(text)
        for node in walk(tree.root_node, skip=("function_definition", "template_declaration",
                                                 "struct_specifier", "class_specifier")):
            if node.type == "preproc_def" and node.child_by_field_name("value") is not None:
                name = text_of(node.child_by_field_name("name"))
                self._defs.setdefault(name, []).append(text_of(node.child_by_field_name("value")))
            elif node.type == "declaration" and any(c.type == "type_qualifier" and text_of(c) == "constexpr"
                                                    for c in node.children):
                for decl in node.children_by_field_name("declarator"):
                    if decl.type == "init_declarator" and decl.child_by_field_name("value") is not None:
                        name = text_of(decl.child_by_field_name("declarator"))
                        self._defs.setdefault(name, []).append(decl.child_by_field_name("value"))
            elif node.type == "preproc_include":
                path = text_of(node.child_by_field_name("path"))
                if path.startswith('"'):
                    self._includes.append(path.strip('"'))

    def _more(self) -> bool:
        """Absorb the next unread quoted include; False when none is left."""
        while self._load is not None and self._includes:
            name = self._includes.pop(0)
            if name in self._seen:
                continue
            self._seen.add(name)
            text = self._load(name)
            if text is not None:
                self._absorb(text)
                return True
        return False

    def value(self, name: str) -> int:
        if name not in self._values:
            self._values[name] = self._value(name)
        return self._values[name]

    def _value(self, name: str) -> int:
        while name not in self._defs and self._more():
            pass
        found = self._defs.get(name)
        if not found:
            raise Unevaluable(f"`{name}` is neither a loop variable nor a namespace-scope constant "
                              "(`#define` or `constexpr`) of this file or its includes")
        if name in self._evaluating:
            raise Unevaluable(f"`{name}` is defined through itself")
        self._evaluating.add(name)
        try:
            values = {evaluate(_expression(d) if isinstance(d, str) else d, {}, self) for d in found}
        finally:
            self._evaluating.discard(name)
        if len(values) > 1:
            raise Unevaluable(f"`{name}` is defined {len(found)} times with different values {sorted(values)}")
        return values.pop()


def _expression(spelling: str):
    """The syntax node of an expression given as text (a macro's replacement)."""
    spelling = " ".join(strip_comments_and_literals(spelling.replace("\\\n", " ")).split())
    tree = parse(f"int __warp_gate_probe = ({spelling});")
    for node in walk(tree.root_node):
        if node.type == "init_declarator" and not tree.root_node.has_error:
            return node.child_by_field_name("value")
    raise Unevaluable(f"`{spelling}` is not an expression")


def _c_div(a: int, b: int, op: str) -> int:
    if b == 0:
        raise Unevaluable(f"division by zero (`{op}`)")
    q = abs(a) // abs(b) * (1 if (a >= 0) == (b >= 0) else -1)
    return q if op == "/" else a - q * b


_BINARY = {
    "+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b,
    "<<": lambda a, b: a << b, ">>": lambda a, b: a >> b, "&": lambda a, b: a & b,
    "|": lambda a, b: a | b, "^": lambda a, b: a ^ b,
    "<": lambda a, b: int(a < b), "<=": lambda a, b: int(a <= b), ">": lambda a, b: int(a > b),
    ">=": lambda a, b: int(a >= b), "==": lambda a, b: int(a == b), "!=": lambda a, b: int(a != b),
    "&&": lambda a, b: int(bool(a) and bool(b)), "||": lambda a, b: int(bool(a) or bool(b)),
}
_UNARY = {"-": lambda v: -v, "+": lambda v: v, "~": lambda v: ~v, "!": lambda v: int(not v)}


def evaluate(node, env: dict[str, int], consts: Constants) -> int:
    """The integer value of expression `node`; `env` binds loop variables. The node is
    compiled once into a closure over `env` (`_compile`, kept by `consts` for as long as it
    lives): a structural gate evaluates the same expressions for every thread of a block."""
    return compiled(node, consts)(env)


def compiled(node, consts: Constants):
    """`evaluate` of `node` as a function of `env` alone, for a caller that evaluates one
    expression under many environments (every thread of a block)."""
    # the node is kept with its closure: it keeps its tree alive, so no other tree's node can
    # take its id while the entry lives (an inline leaf's id is its kind and size, not an
    # address: the text in the key tells two of them apart)
    key = (node.id, node.start_byte, node.end_byte, node.type, node.text)
    found = consts._compiled.get(key)
    if found is None:
        found = consts._compiled[key] = (_compile(node, consts), node)
    return found[0]


def _unevaluable(message: str):
    def fail(env):
        raise Unevaluable(message)
    return fail


def _compile(node, consts: Constants):
    """A function of `env` that returns what the tree walk of `evaluate`'s contract gives, or
    raises the same Unevaluable: every name read from `env` first, then from `consts`, both
    sides of a binary operator evaluated before it is applied (`&&` and `||` too), one branch
    of `?:`."""
    kind = node.type
    if kind == "number_literal":
        try:
            value = int_literal(text_of(node))
        except Unevaluable as exc:
            return _unevaluable(str(exc))
        return lambda env: value
    if kind == "parenthesized_expression" and node.named_child_count == 1:
        return _compile(node.named_children[0], consts)
    if kind == "identifier":
        name = text_of(node)
        return lambda env: env[name] if name in env else consts.value(name)
    if kind == "qualified_identifier":  # pa::LANES: namespace constants are read by their own name
        name = text_of(node).split("::")[-1].strip()
        return lambda env: env[name] if name in env else consts.value(name)
    generic = (f"`{text_of(node)}` is not an integer constant expression this gate reads "
               "(literals, constants, casts, + - * / % << >> & | ^ ~, comparisons and `?:`)")
    if kind == "field_expression":  # threadIdx.x, bound by the caller
        spelled = text_of(node)

        def field(env):
            if spelled in env:
                return env[spelled]
            raise Unevaluable(generic)
        return field
    if kind == "unary_expression":
        arg = _compile(node.child_by_field_name("argument"), consts)
        op = _UNARY.get(text_of(node.child_by_field_name("operator")))
        if op is None:
            def unknown(env):
                arg(env)
                raise Unevaluable(generic)
            return unknown
        return lambda env: op(arg(env))
    if kind in ("true", "false"):
        value = int(kind == "true")
        return lambda env: value
    if kind == "cast_expression":  # `(unsigned long long)slot`: the value, wrapped as an unsigned type wraps
        value = _compile(node.child_by_field_name("value"), consts)
        spelled = " ".join(text_of(node.child_by_field_name("type")).split())
        if spelled.startswith("unsigned"):
            modulus = 1 << (64 if "long long" in spelled else 32)
            return lambda env: value(env) % modulus
        return value
    if kind == "conditional_expression":  # `c ? a : b`
        cond, yes, no = (_compile(node.child_by_field_name(f), consts)
                         for f in ("condition", "consequence", "alternative"))
        return lambda env: yes(env) if cond(env) else no(env)
    if kind == "binary_expression":
        op = text_of(node.child_by_field_name("operator"))
        left = _compile(node.child_by_field_name("left"), consts)
        right = _compile(node.child_by_field_name("right"), consts)
        if op in ("/", "%"):
            return lambda env: _c_div(left(env), right(env), op)
        apply = _BINARY.get(op)
        if apply is None:
            def unknown_binary(env):
                left(env), right(env)
                raise Unevaluable(generic)
            return unknown_binary
        return lambda env: apply(left(env), right(env))
    return _unevaluable(generic)


# ------------------------------------------------------------------ loops


def loop_variable(loop) -> tuple[str, object] | None:
    """(name, initial value node) of a `for` loop's variable: `int m = 16` or `m = 16`."""
    init = loop.child_by_field_name("initializer")
    if init is None:
        return None
    if init.type == "declaration":
        decls = [d for d in init.children_by_field_name("declarator") if d.type == "init_declarator"]
        if len(decls) == 1:
            return text_of(decls[0].child_by_field_name("declarator")), decls[0].child_by_field_name("value")
    if init.type == "assignment_expression" and text_of(init.child_by_field_name("operator")) == "=":
        left = init.child_by_field_name("left")
        if left.type == "identifier":
            return text_of(left), init.child_by_field_name("right")
    return None


def _step(update, var: str, value: int, consts: Constants, env: dict[str, int] | None = None) -> int:
    if update is None:
        raise Unevaluable("the loop has no step")
    if update.type == "update_expression":
        arg = update.child_by_field_name("argument")
        if arg is not None and text_of(arg) == var:
            return value + (1 if "++" in text_of(update) else -1)
    if update.type == "assignment_expression" and text_of(update.child_by_field_name("left")) == var:
        op = text_of(update.child_by_field_name("operator"))
        right = evaluate(update.child_by_field_name("right"), {**(env or {}), var: value}, consts)
        if op == "=":
            return right
        base = op[:-1]
        if base in ("/", "%"):
            return _c_div(value, right, base)
        if base in _BINARY:
            return _BINARY[base](value, right)
    raise Unevaluable(f"the step `{text_of(update)}` is not an update of `{var}` this gate reads")


def loop_values(loop, consts: Constants, env: dict[str, int] | None = None, max_steps: int = MAX_LOOP_STEPS) -> list[int]:
    """The values the loop variable takes in the body, in order (`env` binds the other names
    its init and condition read: a thread's index, a runtime bound)."""
    found = loop_variable(loop)
    if found is None:
        raise Unevaluable("the loop's initializer does not set one variable (`int m = 16`)")
    var, init = found
    cond = loop.child_by_field_name("condition")
    if cond is None:
        raise Unevaluable("the loop has no condition")
    env = dict(env or {})
    # an `unsigned` loop variable wraps modulo 2^32, as on the device (`t -= 8` from 7 ends a
    # `t < T` loop; as a Python int it would never end)
    declared = loop.child_by_field_name("initializer")
    wrap = declared is not None and declared.type == "declaration" and "unsigned" in text_of(declared).split("=")[0]
    value, values = evaluate(init, env, consts), []
    for _ in range(max_steps):
        if wrap:
            value %= 1 << 32
        if not evaluate(cond, {**env, var: value}, consts):
            return values
        values.append(value)
        value = _step(loop.child_by_field_name("update"), var, value, consts, env)
    raise Unevaluable(f"the loop does not end within {max_steps} steps (values {values[:8]}...)")


# ------------------------------------------------------------------ calls


@dataclass
class WarpCall:
    name: str
    line: int
    function: str  # the enclosing function's name, "?" at file scope
    args: list  # argument nodes
    loops: list = field(default_factory=list)  # enclosing `for` statements, innermost first (call in the body)

    @property
    def spelling(self) -> str:
        return f"{self.name}({', '.join(text_of(a) for a in self.args)})"


def _context(node) -> tuple[str, list]:
    loops, child, parent = [], node, node.parent
    while parent is not None:
        if parent.type == "for_statement" and parent.child_by_field_name("body") == child:
            loops.append(parent)
        if parent.type == "function_definition":
            return function_name(parent), loops
        child, parent = parent, parent.parent
    return "?", loops


def warp_calls(text: str) -> tuple[list[WarpCall], list[str]]:
    """(every warp-primitive call in the tree, a problem for each line where the text names
    a primitive with no call in the tree)."""
    tree = parse(text)
    calls = []
    for node in walk(tree.root_node):
        if node.type != "call_expression":
            continue
        name = text_of(node.child_by_field_name("function"))
        if MASKED.match(name):
            function, loops = _context(node)
            args = node.child_by_field_name("arguments").named_children
            calls.append(WarpCall(name, line_of(node), function, [a for a in args if a.type != "comment"], loops))
    seen = {}
    for c in calls:
        seen[(c.line, c.name)] = seen.get((c.line, c.name), 0) + 1
    clean = strip_comments_and_literals(text)
    named = {}
    for m in _NAMED.finditer(clean):
        key = (clean.count("\n", 0, m.start()) + 1, m.group(1))
        named[key] = named.get(key, 0) + 1
    unseen = [f"line {line}: `{name}(` is not a call the parser sees (in a macro, or a parse error): "
              "write warp primitives as plain calls in a function so this gate can read them"
              for (line, name), n in sorted(named.items()) if seen.get((line, name), 0) < n]
    return calls, unseen


def identifiers(node) -> set[str]:
    return {text_of(n) for n in walk(node) if n.type == "identifier"}

