"""What each thread of a block does, read from a kernel's syntax tree.

For the structural gates of thread roles (`gates/test_lm_head_structure.py`,
`gates/test_thread_roles.py`): the source is parsed with the tree-sitter CUDA grammar the
mutation campaign uses (`gates/_warp_structure.py`), and a kernel's index expressions are
evaluated for every thread of a block, with `threadIdx.x` and `blockDim.x` bound and the
kernel's runtime sizes bound to trial values.

- `kernel(tree, name)`, `name_of(fn)`, `block_size(fn, consts)`: a function and its
  `__launch_bounds__`.
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
"""

from __future__ import annotations

from gates._warp_structure import (Constants, Unevaluable, _function_name, _walk, evaluate, loop_values,
                                   loop_variable, text_of)

THREAD, BLOCK = "threadIdx.x", "blockDim.x"
WARP = 32
# Trial values for a kernel's runtime sizes: below, on and past a warp and a block, and between.
SIZES = (0, 1, 31, 33, 100, 256, 257, 513)


def name_of(fn) -> str:
    """A function definition's name ("?" when it has none the grammar shows)."""
    return _function_name(fn)


def functions(tree) -> dict:
    """{name: function_definition node} of every function defined in the tree."""
    return {name_of(n): n for n in _walk(tree.root_node) if n.type == "function_definition"}


def kernel(tree, name: str):
    """The definition of `name`; None when the file defines no such function."""
    return functions(tree).get(name)


def block_size(fn, consts: Constants, env: dict[str, int] | None = None) -> int | None:
    """The block size a kernel's `__launch_bounds__(N)` names (`env`: its template
    arguments), or None."""
    for node in _walk(fn):
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
    for node in _walk(fn.child_by_field_name("body")):
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
            env[name] = evaluate(value, env, consts)
        except Unevaluable:
            continue
    return env


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
            if name not in dep and {text_of(n) for n in _walk(value)
                                    if n.type in ("identifier", "field_expression")} & dep:
                dep.add(name)
                changed = True
    return dep


def _names(node) -> set[str]:
    return {text_of(n) for n in _walk(node) if n.type in ("identifier", "field_expression")}


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
    for node in _walk(fn.child_by_field_name("body")):
        if node.type == "for_statement":
            found = loop_variable(node)
            if found is not None and {text_of(n) for n in _walk(found[1])
                                      if n.type in ("identifier", "field_expression")} & dep:
                yield node


def loop_head(loop) -> str:
    return " ".join(text_of(loop).split(")")[0].split()) + ")"  # `for (init; cond; step)`


def partition_problem(fn, loop, inits, consts: Constants, block: int, sizes=SIZES,
                      caps: dict[str, int] | None = None) -> str | None:
    """None when, for each trial size, the distinct index sequences of the block's threads
    take every index below the loop's bound exactly once (threads that share a sequence are a
    team: a half-warp on one block of 16); else what is wrong."""
    var, _ = loop_variable(loop)
    cond = loop.child_by_field_name("condition")
    if cond is None or cond.type != "binary_expression" or text_of(cond.child_by_field_name("left")) != var:
        return f"`{loop_head(loop)}`: the condition is not `{var} < bound`"
    only = needed([loop.child_by_field_name("initializer"), cond, loop.child_by_field_name("update")], inits)
    params = size_parameters(fn)
    for size in sizes:
        env0 = thread_env(fn, inits, consts, 0, block, size, only=only, params=params, caps=caps)
        bound = evaluate(cond.child_by_field_name("right"), env0, consts)
        sequences = set()
        for tid in range(block):
            env = thread_env(fn, inits, consts, tid, block, size, only=only, params=params, caps=caps)
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
