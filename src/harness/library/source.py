"""Read-only introspection of CUDA C++ source for structural gates.

A structural gate asserts something no numeric gate can see: a launcher constant that
must equal a `#define`, a device function that must read a shared-memory table, a kernel
that must contain no block barrier. These helpers find those things in source text.

Every helper first blanks comments and the insides of string and character literals
(`strip_comments_and_literals`), keeping every newline and every offset, so a commented-
out `__syncthreads()` or a `"#define X 4"` inside a string can never satisfy or break a
gate, and line numbers in messages are the file's own.

Each helper accepts source text; `define_value` and `define_int` also accept a path.
Failures raise `SourceError` naming what was looked for, where, and what to do.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from harness.compiling.cpp_text import line_of, strip_comments_and_literals  # noqa: F401  (gates read them here)
from harness.core.errors import HarnessError
from harness.library import coverage

__all__ = [
    "Call",
    "FunctionSource",
    "SourceError",
    "active_text",
    "calls_in",
    "constexpr_int",
    "contains_call",
    "declared_names",
    "define_int",
    "define_value",
    "function",
    "function_body",
    "line_of",
    "mentions",
    "reachable_functions",
    "strip_comments_and_literals",
    "struct_fields",
]


class SourceError(HarnessError, LookupError):
    """A structural lookup that found nothing, or more than one candidate."""


_IDENT = r"[A-Za-z_]\w*"
# Words followed by `(...)` and sometimes `{` that are not function names.
_STATEMENT_KEYWORDS = frozenset(
    {"if", "for", "while", "switch", "catch", "return", "sizeof", "alignof", "decltype", "static_assert"}
)


def _read(text_or_path: str | Path) -> tuple[str, str]:
    """(text, where) for a path or for source text (text is never mistaken for a path:
    anything with a newline, or a str that names no existing file, is source)."""
    if isinstance(text_or_path, Path) or ("\n" not in text_or_path and Path(text_or_path).is_file()):
        path = Path(text_or_path)
        coverage.note_source(path)  # which gates read which source: gate selection for mutation campaigns
        return path.read_text(), str(path)
    return text_or_path, "<source text>"


def read_source(path: str | Path) -> str:
    """A source file's text, noted as read by the running gate (a mutation campaign then
    never screens a mutant of that file out by its cubin alone: the gate reads its text)."""
    return _read(Path(path))[0]


def _logical_lines(text: str):
    """(first line number, joined text) for each line, backslash continuations joined."""
    lines = text.split("\n")
    i = 0
    while i < len(lines):
        start, parts = i + 1, [lines[i]]
        while parts[-1].endswith("\\") and i + 1 < len(lines):
            parts[-1] = parts[-1][:-1]
            i += 1
            parts.append(lines[i])
        yield start, " ".join(parts)
        i += 1


def define_value(text_or_path: str | Path, name: str, defines: dict | None = None) -> str:
    """The replacement text of the object-like macro `#define name value`, stripped.

    With `defines` (the macros the module is compiled with, e.g. its launcher's DEFINES;
    `{}` for none), the preprocessor branches are taken first (`active_text`), so a macro
    defined once per branch of an `#if` has the one value that builds. Without it, raises
    `SourceError` when `name` is defined more than once (a structural gate must not guess
    which branch builds). Also when it is never defined, or is a function-like macro.
    """
    text, where = _read(text_or_path)
    if defines is not None:
        text = active_text(text, defines)
    clean = strip_comments_and_literals(text)
    pattern = re.compile(rf"^\s*#\s*define\s+{re.escape(name)}(?![\w])(\(?)(.*)$")
    found = []
    for line, logical in _logical_lines(clean):
        m = pattern.match(logical)
        if m:
            found.append((line, m.group(1), m.group(2).strip()))
    if not found:
        raise SourceError(f"{where}: no `#define {name}`; define it there or check the name")
    if len(found) > 1:
        lines = ", ".join(str(line) for line, _, _ in found)
        raise SourceError(
            f"{where}: `#define {name}` appears {len(found)} times (lines {lines}); "
            + "keep one definition so the gate knows which value builds"
            + ("" if defines is not None else
               ", or pass defines={...} (the macros the module is compiled with) to take its #if branch")
        )
    line, paren, value = found[0]
    if paren:
        raise SourceError(f"{where}:{line}: `{name}` is a function-like macro; a value needs `#define {name} VALUE`")
    return value


def define_int(text_or_path: str | Path, name: str, defines: dict | None = None) -> int:
    """`define_value` read as an integer literal: `8`, `8u`, `(8)`, `0x10`."""
    value = define_value(text_or_path, name, defines)
    m = re.fullmatch(r"\(?\s*(0[xX][0-9a-fA-F]+|\d+)[uUlL]*\s*\)?", value)
    if not m:
        raise SourceError(f"`#define {name} {value}` is not an integer literal; structural gates compare literals only")
    return int(m.group(1), 0)


def _matching(text: str, open_at: int, open_ch: str, close_ch: str) -> int:
    """Offset of the bracket closing the one at `open_at` (text already stripped)."""
    depth = 0
    for i in range(open_at, len(text)):
        if text[i] == open_ch:
            depth += 1
        elif text[i] == close_ch:
            depth -= 1
            if depth == 0:
                return i
    raise SourceError(f"unbalanced `{open_ch}` opened on line {line_of(text, open_at)}")


@dataclass(frozen=True)
class FunctionSource:
    """A function definition found in source: offsets index the original text."""

    name: str
    params: str  # the parameter list without its parentheses (comments blanked)
    body: str  # from `{` to the matching `}` inclusive (comments and literals blanked)
    line: int  # line of the name
    body_offset: int  # offset of the body's `{`
    body_line: int  # line of the body's `{`: a line L within `body` is line body_line + L - 1


_BETWEEN_PARAMS_AND_BODY = re.compile(r"(?:\s|\b(?:const|noexcept|override|final|volatile)\b)*")


def function(text: str, name: str) -> FunctionSource:
    """The one definition of `name` (a name followed by `(...)` then `{`).

    Calls (`name(...)` followed by `;`, `,`, `)`...) and declarations (`...);`) are not
    definitions. Raises `SourceError` when there is no definition or more than one
    (overloads, template specialisations): say which one you mean by renaming.
    """
    if name in _STATEMENT_KEYWORDS:
        raise SourceError(f"`{name}` is a C++ keyword, not a function name")
    clean = strip_comments_and_literals(text)
    found = []
    for m in re.finditer(rf"(?<![\w.])(?<!->){re.escape(name)}\s*\(", clean):
        close = _matching(clean, m.end() - 1, "(", ")")
        tail = _BETWEEN_PARAMS_AND_BODY.match(clean, close + 1)
        if tail.end() < len(clean) and clean[tail.end()] == "{":
            found.append((m, close, tail.end()))
    if not found:
        raise SourceError(f"no definition of `{name}(...) {{` found; check the name or that it is defined in this file")
    if len(found) > 1:
        lines = ", ".join(str(line_of(clean, m.start())) for m, _, _ in found)
        raise SourceError(f"`{name}` is defined {len(found)} times (lines {lines}); a structural gate needs one definition")
    m, close, brace = found[0]
    end = _matching(clean, brace, "{", "}")
    return FunctionSource(
        name=name,
        params=clean[m.end() : close],
        body=clean[brace : end + 1],
        line=line_of(clean, m.start()),
        body_offset=brace,
        body_line=line_of(clean, brace),
    )


def function_body(text: str, name: str) -> str:
    """The brace-matched body of the one definition of `name` (comments blanked)."""
    return function(text, name).body


def struct_fields(text: str, name: str) -> list[tuple[str, str]]:
    """[(field, type)] of the data members of `struct name { ... };`, in declaration order: what
    a launcher that packs the struct by hand (a NumPy structured dtype) must match. `int a, b;`
    is two fields of type `int`; a pointer's type ends in `*` (`void *__restrict__ p` is
    (`p`, `void*`)); `using`, `static` members and member functions are not fields. Raises
    `SourceError` when the file does not define the struct once."""
    clean = strip_comments_and_literals(text)
    found = list(re.finditer(rf"\b(?:struct|class)\s+{re.escape(name)}\s*(?::[^{{;]*)?{{", clean))
    if len(found) != 1:
        raise SourceError(f"`struct {name} {{` is defined {len(found)} times here; a structural gate needs one "
                          "definition (check the name)")
    body = clean[found[0].end():_matching(clean, found[0].end() - 1, "{", "}")]
    fields = []
    for decl in body.split(";"):
        decl = " ".join(decl.replace("__restrict__", " ").split())
        if not decl or "(" in decl or decl.startswith(("using ", "typedef ", "static ", "public:", "private:")):
            continue
        head = re.match(rf"((?:const |volatile |unsigned |signed )*{_IDENT}(?:::{_IDENT})*)\s*(.*)$", decl)
        if head is None:
            continue
        for declarator in head.group(2).split(","):
            declarator = declarator.split("=")[0].strip()
            stars = len(declarator) - len(declarator.lstrip("*"))
            fields.append((declarator.lstrip("* ").split("[")[0].strip(), head.group(1) + "*" * stars))
    return fields


@dataclass(frozen=True)
class Call:
    """One call `callee(args...)` inside a body."""

    callee: str
    args: tuple[str, ...]  # top-level comma-split arguments, whitespace-collapsed
    line: int  # 1-based line within the text searched


def _split_args(arg_text: str) -> tuple[str, ...]:
    args, depth, start = [], 0, 0
    for i, c in enumerate(arg_text):
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif c == "," and depth == 0:
            args.append(arg_text[start:i])
            start = i + 1
    args.append(arg_text[start:])
    collapsed = tuple(" ".join(a.split()) for a in args)
    return () if collapsed == ("",) else collapsed


def calls_in(body: str, callee: str) -> list[Call]:
    """Every call of `callee` in `body` (templated calls `f<N>(...)` included)."""
    clean = strip_comments_and_literals(body)
    calls = []
    for m in re.finditer(rf"(?<!\w){re.escape(callee)}\s*(<[^;{{}}()]*?>)?\s*\(", clean):
        close = _matching(clean, m.end() - 1, "(", ")")
        calls.append(Call(callee, _split_args(clean[m.end() : close]), line_of(clean, m.start())))
    return calls


def contains_call(body: str, callee: str) -> bool:
    """True when `body` calls `callee` at least once (comments and strings ignored)."""
    return bool(calls_in(body, callee))


def mentions(body: str, identifier: str) -> bool:
    """True when `identifier` appears as a whole token in `body`, outside comments and literals."""
    return re.search(rf"(?<!\w){re.escape(identifier)}(?!\w)", strip_comments_and_literals(body)) is not None


def declared_names(text: str, qualifier: str) -> list[str]:
    """Names of the variables declared with `qualifier` (e.g. `__constant__`, `__shared__`).

    Reads declarations such as `__constant__ float T[16] = {...};` or
    `__shared__ __align__(16) float s[N][16];`: the name is the last identifier before
    the first `[`, `=`, `;` or `,` of the declaration.
    """
    clean = strip_comments_and_literals(text)
    names = []
    for m in re.finditer(rf"(?<!\w){re.escape(qualifier)}(?!\w)", clean):
        rest = clean[m.end() :]
        rest = re.sub(r"__align__\s*\([^)]*\)", " ", rest, count=1)
        head = re.split(r"[\[=;,(]", rest, maxsplit=1)[0]
        idents = re.findall(_IDENT, head)
        if idents:
            names.append(idents[-1])
    return names


_CALLED = re.compile(rf"(?<![\w.])({_IDENT})\s*\(")


def reachable_functions(text: str, name: str) -> list[FunctionSource]:
    """The definition of `name` and, transitively, of every function defined in `text`
    that it calls, in discovery order. A structural claim about a kernel ("no block
    barrier in it") must hold for its helpers too; callees defined elsewhere (CUDA
    intrinsics, headers) are not followed."""
    clean = strip_comments_and_literals(text)
    found: dict[str, FunctionSource] = {}
    pending = [name]
    while pending:
        current = pending.pop(0)
        if current in found:
            continue
        try:
            found[current] = function(clean, current)
        except SourceError:
            if current == name:
                raise
            continue  # a keyword, an intrinsic, or a function defined in another file
        pending += [m.group(1) for m in _CALLED.finditer(found[current].body) if m.group(1) not in _STATEMENT_KEYWORDS]
    return list(found.values())


# ------------------------------------------------------------------ constexpr constants and #if branches

_INT_LITERAL = re.compile(r"\b(0[xX][0-9a-fA-F]+|0[bB][01]+|\d+)(?:[uU](?:ll|LL|l|L)?|(?:ll|LL|l|L)[uU]?)?\b")


def _int_expression(expr: str) -> int | None:
    """The value of an integer constant expression made of literals, `+ - * / % << >> & | ^ ~`
    and parentheses; None when it holds anything else (a name, a call, a float)."""
    import ast

    py = _INT_LITERAL.sub(lambda m: str(int(m.group(1).replace("'", ""), 0)), expr.replace("'", ""))
    py = py.replace("/", "//")
    try:
        tree = ast.parse(py.strip(), mode="eval")
    except SyntaxError:
        return None
    allowed = (ast.Expression, ast.BinOp, ast.UnaryOp, ast.Constant, ast.Add, ast.Sub, ast.Mult, ast.FloorDiv,
               ast.Mod, ast.LShift, ast.RShift, ast.BitAnd, ast.BitOr, ast.BitXor, ast.Invert, ast.USub, ast.UAdd)
    if not all(isinstance(n, allowed) for n in ast.walk(tree)):
        return None
    if not all(isinstance(n.value, int) for n in ast.walk(tree) if isinstance(n, ast.Constant)):
        return None
    try:
        return int(eval(compile(tree, "<constexpr>", "eval")))
    except (ArithmeticError, ValueError):
        return None


def constexpr_int(text_or_path: str | Path, name: str, defines: dict | None = None) -> int:
    """The value of the integer constant `name` declared `constexpr` (at file, namespace or
    class scope): `constexpr int N = 8;`, `static constexpr unsigned kRows{16};`,
    `inline constexpr int kTile = 4 * 32;`. The initializer must be an integer constant
    expression of literals. With `defines`, the preprocessor branches are taken first
    (`active_text`). Raises `SourceError` when it is not found, found more than once, or its
    initializer is not a literal expression."""
    text, where = _read(text_or_path)
    if defines is not None:
        text = active_text(text, defines)
    clean = strip_comments_and_literals(text)
    pattern = re.compile(rf"\bconstexpr\b[^;{{}}()=]*?(?<![\w:]){re.escape(name)}\s*(?:=\s*([^;{{}}]+?)|\{{\s*([^;{{}}]+?)\s*\}})\s*;")
    found = [(line_of(clean, m.start()), (m.group(1) or m.group(2)).strip()) for m in pattern.finditer(clean)]
    if not found:
        raise SourceError(f"{where}: no `constexpr ... {name} = ...;`; declare it there or check the name")
    if len(found) > 1:
        lines = ", ".join(str(line) for line, _ in found)
        raise SourceError(f"{where}: `constexpr ... {name}` is declared {len(found)} times (lines {lines}); "
                          + "keep one declaration so the gate knows which value builds"
                          + ("" if defines is not None else ", or pass defines={...} to take its #if branch"))
    line, expr = found[0]
    value = _int_expression(re.sub(r"^\(\s*|static_cast<[^>]*>\s*", "", expr) if expr.startswith("static_cast")
                            else expr)
    if value is None:
        raise SourceError(f"{where}:{line}: `{name}` is initialised with `{expr}`, not an integer expression of "
                          "literals; structural gates compare literals only")
    return value


_DIRECTIVE = re.compile(r"^\s*#\s*(if|ifdef|ifndef|elif|else|endif|define|undef)\b(.*)$")


def _condition_value(expr: str, macros: dict, where: str, line: int) -> bool:
    def defined(m):
        return " 1 " if m.group(1) in macros else " 0 "

    text = re.sub(r"\bdefined\s*\(\s*([A-Za-z_]\w*)\s*\)", defined, expr)
    text = re.sub(r"\bdefined\s+([A-Za-z_]\w*)", defined, text)
    for _ in range(16):  # expand macros to their values (a name with no numeric value is 0, as in C)
        new = re.sub(r"\b(?!\d)([A-Za-z_]\w*)\b",
                     lambda m: f" ({macros[m.group(1)] if macros.get(m.group(1)) not in (None, '') else 0}) "
                     if m.group(1) in macros else " 0 ", text)
        if new == text:
            break
        text = new
    text = text.replace("&&", " and ").replace("||", " or ")
    text = re.sub(r"!(?!=)", " not ", text)
    py = _INT_LITERAL.sub(lambda m: str(int(m.group(1), 0)), text).replace("/", "//")
    import ast

    try:
        tree = ast.parse(py.strip() or "0", mode="eval")
    except SyntaxError:
        raise SourceError(f"{where}:{line}: cannot evaluate `#if {expr.strip()}` by its defines; "
                          "structural gates take branches on integer conditions and defined() only") from None
    allowed = (ast.Expression, ast.BinOp, ast.UnaryOp, ast.BoolOp, ast.Compare, ast.Constant, ast.And, ast.Or,
               ast.Not, ast.Add, ast.Sub, ast.Mult, ast.FloorDiv, ast.Mod, ast.LShift, ast.RShift, ast.BitAnd,
               ast.BitOr, ast.BitXor, ast.Invert, ast.USub, ast.UAdd, ast.Eq, ast.NotEq, ast.Lt, ast.LtE, ast.Gt,
               ast.GtE)
    if not all(isinstance(n, allowed) for n in ast.walk(tree)):
        raise SourceError(f"{where}:{line}: cannot evaluate `#if {expr.strip()}` by its defines")
    return bool(eval(compile(tree, "<if>", "eval")))


def active_text(text_or_path: str | Path, defines: dict) -> str:
    """`text` with every line in an inactive preprocessor branch blanked (line numbers kept),
    taking `#if` / `#ifdef` / `#ifndef` / `#elif` / `#else` by `defines` (a dict of macro
    name to value, None for a bare `-DNAME`) and by the `#define`s and `#undef`s met on the
    way in active text. A macro no one defines is 0 in a condition, as in C."""
    text, where = _read(text_or_path)
    macros = {k: (None if v is None else str(v)) for k, v in (defines or {}).items()}
    clean = strip_comments_and_literals(text)
    out = text.split("\n")
    stack: list[tuple[bool, bool]] = []  # (this branch active, some branch of this #if taken)
    logical_lines = list(_logical_lines(clean))
    for index, (start, logical) in enumerate(logical_lines):
        end = logical_lines[index + 1][0] - 1 if index + 1 < len(logical_lines) else len(out)
        m = _DIRECTIVE.match(logical)
        kind, rest = (m.group(1), m.group(2)) if m else (None, "")
        parent = all(a for a, _ in stack)
        if kind in ("if", "ifdef", "ifndef"):
            if not parent:
                stack.append((False, True))
            else:
                name = rest.strip().split()[0] if rest.strip() else ""
                value = (_condition_value(rest, macros, where, start) if kind == "if" else
                         (name in macros) if kind == "ifdef" else (name not in macros))
                stack.append((value, value))
        elif kind in ("elif", "else", "endif") and not stack:
            raise SourceError(f"{where}:{start}: #{kind} without #if")
        elif kind == "elif":
            _, taken = stack[-1]
            outer = all(a for a, _ in stack[:-1])
            value = outer and not taken and _condition_value(rest, macros, where, start)
            stack[-1] = (value, taken or value)
        elif kind == "else":
            _, taken = stack[-1]
            stack[-1] = (not taken, True)
        elif kind == "endif":
            stack.pop()
        active_now = all(a for a, _ in stack)
        if kind in ("define", "undef") and active_now:
            dm = re.match(r"\s*([A-Za-z_]\w*)(\(?)(.*)$", rest)
            if dm and kind == "define" and not dm.group(2):
                macros[dm.group(1)] = dm.group(3).strip()
            elif dm and kind == "undef":
                macros.pop(dm.group(1), None)
        if not active_now:
            for physical in range(start - 1, end):
                out[physical] = ""
    if stack:
        raise SourceError(f"{where}: an #if is not closed by #endif")
    return "\n".join(out)
