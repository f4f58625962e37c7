"""What each thread of a block does, read from a kernel's syntax tree.

For the structural gates of thread roles (`gates/test_lm_head_structure.py`,
`gates/test_thread_roles.py`): the source is parsed with the tree-sitter CUDA grammar the
mutation campaign uses (`harness.compiling.cuda_syntax`), and a kernel's index expressions are
evaluated for every thread of a block, with `threadIdx.x` and `blockDim.x` bound and the
kernel's runtime sizes bound to trial values.

- `read_kernel_file(kernel_root, file)`: a file's constants and syntax tree;
  `TEMPLATE_ARGS`: the launchers' template instantiations.
- `analysed(kernel_root, file, names, check, *args)`: a check of some of a file's functions,
  run on the text they can reach (`reachable_text`) and kept for that text.
- `defined(tree, file, name)`, `name_of(fn)`, `callee(call)`, `block_size(fn, consts)`: a
  function, a call's plain name and a kernel's `__launch_bounds__`.
- `initialisers(fn)`: the body's `T name = value` declarations, in order.
- `thread_env(fn, inits, consts, tid, block, size)`: threadIdx.x, blockDim.x, the size
  parameters (each bound to `size`) and every local that can be evaluated from them.
- `guards(node, fn)` and `passes(guards, env, consts)`: the `if` conditions around a
  statement, and whether a thread passes them (one it cannot evaluate counts as passed).
- `first_lanes(envs, hw)` and `warp_values(envs, hw, local)`: what a hardware warp's threads
  hold.
- `strided_loops(fn, inits)` and `partition_problem(...)`: the loops whose variable starts
  at a thread's own index, and whether the threads' sequences take each index below the
  bound exactly once.
- `memory_stores(fn)`, `shared_extents(fn, consts)` and `shared_writers(...)`: the stores
  other threads can see, the `__shared__` arrays' sizes, and whether each address has one
  writer a step, inside its array.
"""

from __future__ import annotations

import functools
import re

from gates._warp_structure import Constants, Unevaluable, compiled, evaluate, loop_values, loop_variable, text_of
from harness.library.caching import host_cache
from harness.compiling.cuda_syntax import function_name, parse, walk

THREAD, BLOCK = "threadIdx.x", "blockDim.x"
WARP = 32
# Trial values for a kernel's runtime sizes: below, on and past a warp and a block, and between.
SIZES = (0, 1, 31, 33, 100, 256, 257, 513)


# (file, function) -> the template arguments the launcher instantiates it with (a device
# function: its kernel's)
TEMPLATE_ARGS = {
    ("paged_attention.cu", "paged_decode"): {"HD": 256},
    ("paged_attention.cu", "paged_combine"): {"HD": 256},
    ("paged_attention.cu", "merge_splits"): {"HD": 256},
    ("paged_attention.cu", "paged_prefill"): {"HD": 256, "ROWS": 8},
}


def read_kernel_file(kernel_root, file: str):
    """(constants, syntax tree) of `file` under the active kernel root, read through
    harness.library.source; its quoted includes are read from the same root on demand."""
    from harness.library.source import read_source

    def include(name: str) -> str | None:
        path = kernel_root / name
        return read_source(path) if path.is_file() else None

    text = read_source(kernel_root / file)
    return Constants(text, include), parse(text)


_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_PREPROC_LINE = re.compile(r"^\s*#.*$", re.MULTILINE)


@functools.lru_cache(maxsize=8)
def _reach_index(text: str) -> tuple[dict, tuple]:
    """({function name: ((body start, body end, names its body says), ...)}, the function names
    a preprocessor line says) of `text`: parsed once for all the gates that read one text."""
    bodies: dict[str, list] = {}
    for n in walk(parse(text).root_node):
        if n.type == "function_definition" and n.child_by_field_name("body") is not None:
            body = n.child_by_field_name("body")
            said = frozenset(text_of(x) for x in walk(body) if x.type in ("identifier", "field_identifier",
                                                                          "type_identifier", "namespace_identifier"))
            bodies.setdefault(name_of(n), []).append((body.start_byte, body.end_byte, said))
    seeds = tuple(w for line in _PREPROC_LINE.findall(text) for w in _WORD.findall(line) if w in bodies)
    return bodies, seeds


def reachable_text(text: str, names) -> str:
    """`text` with the body of every function none of `names` can reach emptied (its newlines
    kept, so every line keeps its number, and nothing else: a mutant of such a body that
    keeps its lines leaves this text as it was). A function reaches what its body
    names (any identifier: a call, a template argument, a macro's use), and every function
    a preprocessor line names is reached: an analysis of `names` that reads only their
    bodies, the bodies they reach and what lies outside every function (constants, macros)
    gives the same answer on this text, and an unchanged text says that answer is unchanged."""
    bodies, seeds = _reach_index(text)
    todo = list(names) + list(seeds)
    reached: set[str] = set()
    while todo:
        name = todo.pop()
        if name in reached:
            continue
        reached.add(name)
        for _, _, said in bodies.get(name, ()):
            todo.extend(w for w in said if w in bodies and w not in reached)
    data = text.encode()
    cut = sorted((start, end) for name, defs in bodies.items() if name not in reached for start, end, _ in defs)
    out, at = [], 0
    for start, end in cut:
        out += [data[at:start], b"{", b"\n" * data.count(b"\n", start, end), b"}"]
        at = end
    return b"".join(out + [data[at:]]).decode(errors="replace")


def analysed(kernel_root, file: str, names, check, *args):
    """`check(consts, tree, file, *args)` of `file` under the active kernel root, computed on
    the text its functions `names` can reach (`reachable_text`) and its quoted includes, and
    kept for that text: a mutant of another function of the file finds it again. (A
    structural gate runs first for every mutant of its file: computed afresh each time, it
    would take a large share of each mutant's time.)
    `check` must be a pure function of what it is given; it may fail the gate."""
    from harness.compiling.includes import source_closure
    from harness.library.source import read_source

    text = read_source(kernel_root / file)
    # the headers it includes, as the compile path finds them (the kernel root's ones, by the
    # root-relative path Constants asks for), each read for its constants alone (Constants
    # reads no function body): their bodies emptied, a mutant of one leaves every answer as it was
    headers = tuple((rel, reachable_text(read_source(kernel_root / rel), ()))
                    for rel, _ in source_closure(kernel_root / file, kernel_root)
                    if rel != file and not rel.startswith("@"))
    return _analysis(check, file, reachable_text(text, tuple(names)), headers, args)


@host_cache(disk="source")
def _analysis(check, file: str, text: str, includes: tuple, args: tuple):
    """Kept from mutant to mutant by a campaign's warm worker, and on disk from run to run of
    the project's own sources (a warm gate run reads it back instead of parsing and evaluating
    every kernel again): a pure function of its arguments."""
    found = dict(includes)
    return check(Constants(text, found.get), parse(text), file, *args)


def defined(tree, file: str, name: str):
    """The definition of `name` in `file`; fails the gate when the file has none."""
    import pytest

    fn = functions(tree).get(name)
    if fn is None:
        pytest.fail(f"{file}: no function `{name}`; this gate reads it")
    return fn


def callee(call) -> str:
    """The plain name a call names: `merge_splits` for `pa::merge_splits<HD>(...)`."""
    return text_of(call.child_by_field_name("function")).split("<")[0].split("::")[-1].strip()


def name_of(fn) -> str:
    """A function definition's name ("?" when it has none the grammar shows)."""
    return function_name(fn)


def functions(tree) -> dict:
    """{name: function_definition node} of every function defined in the tree."""
    return {name_of(n): n for n in walk(tree.root_node) if n.type == "function_definition"}


def block_size(fn, consts: Constants, env: dict[str, int] | None = None) -> int | None:
    """The block size a kernel's `__launch_bounds__(N)` names (`env`: its template
    arguments), or None."""
    for node in walk(fn):
        if node.type == "compound_statement":
            break
        if node.type in ("call_expression", "attribute_specifier", "ms_declspec_modifier") and \
                text_of(node).startswith("__launch_bounds__"):
            args = node.child_by_field_name("arguments")
            if args is not None and args.named_children:
                return evaluate(args.named_children[0], env or {}, consts)
    text = text_of(fn)
    if "__launch_bounds__(" in text.split("{", 1)[0]:
        from gates._warp_structure import _expression

        spelling = text.split("__launch_bounds__(", 1)[1]
        depth, end = 1, 0
        while depth and end < len(spelling):
            depth += {"(": 1, ")": -1}.get(spelling[end], 0)
            end += 1
        return evaluate(_expression(spelling[:end - 1].split(",")[0]), env or {}, consts)
    return None


def initialisers(fn) -> list[tuple[str, object]]:
    """(name, value node) of the body's `T name = value` declarations, in source order."""
    out = []
    for node in walk(fn.child_by_field_name("body")):
        if node.type == "init_declarator" and node.child_by_field_name("declarator").type == "identifier":
            out.append((text_of(node.child_by_field_name("declarator")), node.child_by_field_name("value")))
    return out


def size_parameters(fn) -> list[str]:
    """The names of a function's non-pointer parameters (runtime sizes and scalars)."""
    out = []
    params = fn.child_by_field_name("declarator")
    while params is not None and params.type != "function_declarator":
        params = params.child_by_field_name("declarator")
    if params is None:
        return out
    for p in params.child_by_field_name("parameters").named_children:
        decl = p.child_by_field_name("declarator")
        if decl is not None and decl.type == "identifier":
            out.append(text_of(decl))
    return out


def thread_env(fn, inits, consts: Constants, tid: int, block: int, size: int = 256,
               extra: dict[str, int] | None = None, only: set[str] | None = None,
               params: list[str] | None = None, caps: dict[str, int] | None = None) -> dict[str, int]:
    """The names thread `tid` of a `block`-thread block can evaluate, sizes bound to `size`
    (at most `caps[name]` where the contract bounds one; with `only`, just those locals;
    `params`: the function's `size_parameters`, if known)."""
    params = size_parameters(fn) if params is None else params
    caps = caps or {}
    env = {THREAD: tid, BLOCK: block, **{p: min(size, caps.get(p, size)) for p in params}, **(extra or {})}
    for name, value in inits:
        if name in env or (only is not None and name not in only):
            continue
        try:
            env[name] = value(env) if callable(value) else evaluate(value, env, consts)
        except Unevaluable:
            continue
    return env


def compiled_inits(inits, consts: Constants) -> list:
    """`inits` with each value node compiled (`_warp_structure.compiled`): what `thread_env`
    takes from a caller that asks for every thread of a block."""
    return [(name, compiled(value, consts)) for name, value in inits]


def hardware_warp(envs, hw: int) -> list[dict]:
    """The environments of hardware warp `hw`'s 32 threads (envs indexed by thread)."""
    return envs[hw * WARP:(hw + 1) * WARP]


def first_lanes(envs, hw: int) -> list[int]:
    """The threads of hardware warp `hw` whose `lane` is 0 (one, its first, where lane 0
    stores the warp's result)."""
    return [e[THREAD] for e in hardware_warp(envs, hw) if e["lane"] == 0]


def warp_values(envs, hw: int, local: str) -> list[int]:
    """The values `local` takes across hardware warp `hw` (one, where it picks the warp's work)."""
    return sorted({e[local] for e in hardware_warp(envs, hw)})


def guards(node, fn) -> list:
    """The conditions of the `if` statements whose consequence holds `node`, innermost first."""
    out, child, parent = [], node, node.parent
    while parent is not None and parent != fn:
        if parent.type == "if_statement" and parent.child_by_field_name("consequence") == child:
            cond = parent.child_by_field_name("condition")  # a condition_clause: `(lane == 0)`
            out.append(cond.named_children[-1] if cond.type == "condition_clause" else cond)
        child, parent = parent, parent.parent
    return out


def passes(conds, env, consts: Constants) -> bool:
    """Whether a thread passes every guard it can be evaluated against (one that reads a
    runtime value, `v >= V`, counts as passed: the checks err towards more threads)."""
    for cond in conds:
        try:
            if not evaluate(cond, env, consts):
                return False
        except Unevaluable:
            continue
    return True


def thread_dependent(inits) -> set[str]:
    """The locals whose value depends on the thread's index (tid, lane, warp, ...)."""
    dep = {THREAD}
    changed = True
    while changed:
        changed = False
        for name, value in inits:
            if name not in dep and {text_of(n) for n in walk(value)
                                    if n.type in ("identifier", "field_expression")} & dep:
                dep.add(name)
                changed = True
    return dep


def _names(node) -> set[str]:
    return {text_of(n) for n in walk(node) if n.type in ("identifier", "field_expression")}


def needed(nodes, inits) -> set[str]:
    """The locals the expressions `nodes` read, directly or through other locals."""
    values = dict(inits)
    want, todo = set(), set().union(*(_names(n) for n in nodes if n is not None))
    while todo:
        name = todo.pop()
        if name in want or name not in values:
            continue
        want.add(name)
        todo |= _names(values[name])
    return want


def strided_loops(fn, inits):
    """`for` loops whose variable starts at a value that depends on the thread's index."""
    dep = thread_dependent(inits)
    for node in walk(fn.child_by_field_name("body")):
        if node.type == "for_statement":
            found = loop_variable(node)
            if found is not None and {text_of(n) for n in walk(found[1])
                                      if n.type in ("identifier", "field_expression")} & dep:
                yield node


def loop_head(loop) -> str:
    return " ".join(text_of(loop).split(")")[0].split()) + ")"  # `for (init; cond; step)`


def partition_problem(fn, loop, inits, consts: Constants, block: int, sizes=SIZES,
                      caps: dict[str, int] | None = None, extra: dict[str, int] | None = None) -> str | None:
    """None when, for each trial size, the distinct index sequences of the block's threads
    take every index below the loop's bound exactly once (threads that share a sequence are a
    team: a half-warp on one block of 16); else what is wrong."""
    var, _ = loop_variable(loop)
    cond = loop.child_by_field_name("condition")
    if cond is None or cond.type != "binary_expression" or text_of(cond.child_by_field_name("left")) != var:
        return f"`{loop_head(loop)}`: the condition is not `{var} < bound`"
    only = needed([loop.child_by_field_name("initializer"), cond, loop.child_by_field_name("update")], inits)
    params = size_parameters(fn)
    inits = compiled_inits(inits, consts)
    for size in sizes:
        env0 = thread_env(fn, inits, consts, 0, block, size, extra=extra, only=only, params=params, caps=caps)
        bound = evaluate(cond.child_by_field_name("right"), env0, consts)
        sequences = set()
        for tid in range(block):
            env = thread_env(fn, inits, consts, tid, block, size, extra=extra, only=only, params=params, caps=caps)
            sequences.add(tuple(loop_values(loop, consts, env, max_steps=4 * max(sizes) + 64)))
        counts: dict[int, int] = {}
        for seq in sequences:
            for i in seq:
                counts[i] = counts.get(i, 0) + 1
        wrong = sorted(i for i in set(counts) | set(range(bound)) if counts.get(i, 0) != 1 or not 0 <= i < bound)
        if wrong:
            return (f"`{loop_head(loop)}`: over a block of {block} threads with the sizes at {size}, indices "
                    f"{wrong[:8]} of [0, {bound}) are not taken exactly once")
    return None


# ------------------------------------------------------------------ stores and their writers

def _declared_name(decl) -> str | None:
    """The identifier a declarator declares (`x`, `*p`, `a[N]`, `a[N][M]`, `x = v`)."""
    while decl is not None and decl.type != "identifier":
        decl = decl.child_by_field_name("declarator")
    return text_of(decl) if decl is not None else None


def register_arrays(fn) -> set[str]:
    """The names of a function's local arrays that are not `__shared__` (they live in
    registers or local memory: each thread has its own, so they have no shared writers)."""
    out = set()
    for node in walk(fn.child_by_field_name("body")):
        if node.type != "declaration" or "__shared__" in text_of(node).split("[")[0]:
            continue
        for decl in node.children_by_field_name("declarator"):
            inner = decl.child_by_field_name("declarator") if decl.type == "init_declarator" else decl
            if inner is not None and inner.type == "array_declarator":
                out.add(_declared_name(inner))
    return out


def shared_scalars(fn) -> set[str]:
    """The `__shared__` variables of a function that are not arrays (`__shared__ int is_last;`)."""
    out = set()
    for node in walk(fn.child_by_field_name("body")):
        if node.type == "declaration" and "__shared__" in text_of(node):
            for decl in node.children_by_field_name("declarator"):
                if decl.type == "identifier":
                    out.add(text_of(decl))
    return out


def shared_extents(fn, consts: Constants, env: dict | None = None) -> dict[str, tuple[int, ...]]:
    """{name: its dimensions} of the `__shared__` arrays a function declares with sizes this
    can evaluate (`env`: template arguments); `extern` ones (sized at launch) left out."""
    out = {}
    for node in walk(fn.child_by_field_name("body")):
        if node.type != "declaration" or "__shared__" not in text_of(node) or "extern" in text_of(node).split("[")[0]:
            continue
        for decl in node.children_by_field_name("declarator"):
            dims = []
            while decl is not None and decl.type == "array_declarator":
                try:
                    dims.append(evaluate(decl.child_by_field_name("size"), env or {}, consts))
                except (Unevaluable, AttributeError):
                    dims = None
                    break
                decl = decl.child_by_field_name("declarator")
            if dims and decl is not None and decl.type == "identifier":
                out[text_of(decl)] = tuple(reversed(dims))
    return out


def memory_stores(fn) -> list:
    """The assignments of `fn` that store to memory other threads can see: an element of a
    pointer or a `__shared__` array (`a[i] = v`, `a[i][j] += v`, `*p = v`) or a `__shared__`
    scalar. A thread's own arrays and fields (`acc[t]`, `st.m`) are left out."""
    local, scalars, out = register_arrays(fn), shared_scalars(fn), []
    for node in walk(fn.child_by_field_name("body")):
        if node.type != "assignment_expression":
            continue
        left = node.child_by_field_name("left")
        if left.type == "identifier":
            if text_of(left) in scalars:
                out.append(node)
            continue
        if left.type == "pointer_expression" and text_of(left).startswith("*"):
            out.append(node)
            continue
        base = left
        while base.type == "subscript_expression":
            base = base.child_by_field_name("argument")
        if left.type == "subscript_expression" and base.type == "identifier" and text_of(base) not in local:
            out.append(node)
    return out


def address(target, env, consts: Constants, moving: set[str] = frozenset()) -> tuple:
    """(the base's spelling, its evaluated indices) of a store's target (`moving`: the local
    pointers that differ between threads, whose stores this cannot place)."""
    if target.type == "identifier":
        return (text_of(target),)
    if target.type == "pointer_expression":
        arg = target.child_by_field_name("argument")
        if arg.type == "identifier":
            return ("*" + text_of(arg),)
        raise Unevaluable(f"`{text_of(target)}` is not a store through a named pointer")
    indices = []
    while target.type == "subscript_expression":
        index = target.child_by_field_name("index")
        if index is None:  # grammars spell the index as a subscript_argument_list
            index = target.named_children[-1]
        while index.type == "subscript_argument_list" and index.named_child_count == 1:
            index = index.named_children[0]
        indices.append(evaluate(index, env, consts))
        target = target.child_by_field_name("argument")
    if text_of(target) in moving:
        raise Unevaluable(f"`{text_of(target)}` is a pointer that differs between threads")
    return (text_of(target), *reversed(indices))


def enclosing_loops(node, fn) -> list:
    """The `for` statements whose body holds `node`, outermost first."""
    out, child, parent = [], node, node.parent
    while parent is not None and parent != fn:
        if parent.type == "for_statement" and parent.child_by_field_name("body") == child:
            out.append(parent)
        child, parent = parent, parent.parent
    return out[::-1]


def store_env(fn, store, inits, consts: Constants, tid: int, block: int, extra: dict, params: list[str],
              size: int, caps: dict[str, int] | None = None) -> dict:
    """Thread `tid`'s names at `store`, each enclosing loop at its thread's first value."""
    env = thread_env(fn, inits, consts, tid, block, size, extra=extra, params=params, caps=caps)
    loops = {}
    for loop in enclosing_loops(store, fn):
        found = loop_variable(loop)
        if found is None:
            continue
        try:
            loops[found[0]] = env[found[0]] = evaluate(found[1], env, consts)
        except Unevaluable:
            continue
    return thread_env(fn, inits, consts, tid, block, size, extra={**extra, **loops}, params=params,
                      caps=caps) if loops else env


def shared_writers(fn, store, consts: Constants, block: int, scope: int, extra: dict | None = None,
                   bind: dict | None = None, sizes=(1, 33, 256),
                   extents: dict[str, tuple[int, ...]] | None = None,
                   caps: dict[str, int] | None = None) -> str | None:
    """None when, in one step of every enclosing loop, no two threads of a `scope`-thread
    group (a warp, or the block) that pass the store's guards store to one address, every
    store to an array of known `extents` is inside it, and some thread stores, at each trial
    size; else what is wrong. `bind`: parameters that stand for a thread's index ({"lane":
    "threadIdx.x & 31u"}); `caps`: the bounds a contract puts on runtime sizes. Raises
    Unevaluable when an address cannot be read."""
    from gates._warp_structure import _expression

    inits, conds = initialisers(fn), guards(store, fn)
    bound = {name: _expression(spelling) for name, spelling in (bind or {}).items()}
    params = [p for p in size_parameters(fn) if p not in bound]
    target = store.child_by_field_name("left")
    # local pointers set from a value that differs between threads (`o = out + row * HD` with
    # a row read from memory): their stores are placed only where the pointer's value can be
    dep = thread_dependent(inits)
    moving = {_declared_name(node) for node in walk(fn.child_by_field_name("body"))
              if node.type == "init_declarator" and node.child_by_field_name("declarator").type == "pointer_declarator"
              and _names(node.child_by_field_name("value")) & dep}
    stored = False
    fast = compiled_inits(inits, consts)
    for size in sizes:
        seen: dict[tuple, list[int]] = {}
        for tid in range(block):
            own = {name: evaluate(node, {THREAD: tid, BLOCK: block}, consts) for name, node in bound.items()}
            env = store_env(fn, store, fast, consts, tid, block, {**(extra or {}), **own}, params, size, caps)
            if not passes(conds, env, consts):
                continue
            where = address(target, env, consts, moving)
            dims = (extents or {}).get(where[0])
            if dims is not None and (len(dims) != len(where) - 1 or
                                     any(not 0 <= i < d for i, d in zip(where[1:], dims))):
                return (f"`{' '.join(text_of(store).split())}`: thread {tid} stores "
                        f"`{where[0]}{''.join(f'[{i}]' for i in where[1:])}`, outside "
                        f"`{where[0]}{''.join(f'[{d}]' for d in dims)}` (sizes at {size})")
            seen.setdefault((tid // scope, where), []).append(tid)
        stored = stored or bool(seen)
        shared = {key: tids for key, tids in seen.items() if len(tids) > 1}
        if shared:
            (_, where), tids = min(shared.items(), key=lambda kv: kv[1][0])
            spelled = where[0] + "".join(f"[{i}]" for i in where[1:])
            return (f"`{' '.join(text_of(store).split())}`: threads {tids[:6]}{' ...' if len(tids) > 6 else ''} "
                    f"store `{spelled}` in the same step (sizes at {size})")
    if not stored:
        return f"`{' '.join(text_of(store).split())}`: no thread of the block stores, at any size {sizes}"
    return None
