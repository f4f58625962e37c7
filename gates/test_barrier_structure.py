"""Structural gates: the barriers and fences that order one thread's stores before another's reads.

A barrier or fence removed leaves a race the GPU rarely shows, which no value gate sees; so
these gates read the order from the source (tree-sitter CUDA grammar, as the campaign parses it):

- **A last-CTA ticket is released and acquired.** Where the last CTA to arrive merges what the
  others wrote (`moe_router`'s top-K selection, `paged_decode`'s split merge), the kernel's
  statements around the ticket are, in order: `__threadfence()` (release: this CTA's stores
  are visible device-wide before it is counted), `__syncthreads()` (every warp's stores are
  done before one thread takes the ticket), the ticket taken by one thread into a `__shared__`
  flag, `__syncthreads()` (the flag is published), `if (!flag) return;`, `__threadfence()`
  (acquire: the merge reads after the ticket).
- **A block reduction's scratch is written between two barriers.** `moe_block_sum` and
  `moe_block_max` store each warp's result into one shared slot a warp, then every thread
  reads all slots: the barrier after publishes the slots, the barrier before keeps a fast
  warp from overwriting a slot a slow warp still reads from the previous call (post_attn and
  final call them back to back on the same scratch).
- **A `__shared__` array is published and released inside loops too.** In a loop that holds a
  barrier (a tile staged into shared memory, read, staged again), every store of a shared
  array and every read of it by the same or the next iteration have a barrier between them:
  within the iteration (read after write, write after read) and around the loop's back edge
  (the next iteration's store must not overwrite what a slow warp still reads). And a barrier
  is reached by every thread of the block or by none: it sits under no branch and in no loop
  whose condition depends on the thread's index.
"""

from __future__ import annotations

import pytest

from gates._thread_roles import (TEMPLATE_ARGS, block_size, callee, defined, functions, initialisers, memory_stores,
                                 read_kernel_file, shared_extents, thread_dependent)
from gates._warp_structure import Unevaluable, evaluate, line_of, text_of
from harness.compiling.cuda_syntax import walk

pytestmark = pytest.mark.structural

# (file, kernel) -> the pointer its last-CTA ticket counts in
TICKETS = {("moe_decode.cu", "moe_router"): "ticket", ("paged_attention.cu", "paged_decode"): "counters"}
# (file, device function) -> its shared scratch parameter
SCRATCH = {("moe_decode.cu", "moe_block_sum"): "red", ("moe_decode.cu", "moe_block_max"): "red"}


def _statements(fn) -> list:
    """The function body's statements in order, declarations and comments left out."""
    return [s for s in fn.child_by_field_name("body").named_children if s.type not in ("declaration", "comment")]


def _spelled(node) -> str:
    return " ".join(text_of(node).split())


def _is_call(stmt, name: str) -> bool:
    return stmt.type == "expression_statement" and _spelled(stmt).replace(" ", "") == f"{name}();"


def _names_ticket(node, ticket: str) -> bool:
    return any(n.type == "call_expression" and text_of(n.child_by_field_name("function")).startswith("atomic")
               and ticket in {text_of(i) for i in walk(n.child_by_field_name("arguments")) if i.type == "identifier"}
               for n in walk(node))


def _flag(stmt) -> str | None:
    """The `__shared__` flag a ticket statement sets (`is_last = atomicAdd(...) == ...`)."""
    for n in walk(stmt):
        if n.type == "assignment_expression" and n.child_by_field_name("left").type == "identifier":
            return text_of(n.child_by_field_name("left"))
    return None


@pytest.mark.parametrize("file,name", sorted(TICKETS), ids=[k for _, k in sorted(TICKETS)])
def test_a_last_cta_ticket_is_released_and_acquired(kernel_root, file, name):
    consts, tree = read_kernel_file(kernel_root, file)
    fn = defined(tree, file, name)
    ticket, stmts = TICKETS[(file, name)], _statements(fn)
    at = [i for i, s in enumerate(stmts) if _names_ticket(s, ticket)]
    assert len(at) == 1, (f"{file} ({name}): {len(at)} statements of the kernel body take the ticket "
                          f"`{ticket}` with an atomic; this gate reads the one that does")
    i, take = at[0], stmts[at[0]]
    flag = _flag(take)
    want = [(i - 2, "__threadfence", "release: this CTA's stores are visible device-wide before it is counted"),
            (i - 1, "__syncthreads", "every warp's stores are done before one thread takes the ticket"),
            (i + 1, "__syncthreads", "the flag the ticket set is published to the block")]
    problems = []
    for j, call, why in want:
        if not (0 <= j < len(stmts) and _is_call(stmts[j], call)):
            got = _spelled(stmts[j]) if 0 <= j < len(stmts) else "nothing"
            problems.append(f"line {line_of(take)}: {'before' if j < i else 'after'} the ticket expected "
                            f"`{call}();` ({why}); found `{got[:60]}`")
    exit_ = stmts[i + 2] if i + 2 < len(stmts) else None
    if flag is None or exit_ is None or exit_.type != "if_statement" or \
            _spelled(exit_.child_by_field_name("condition")).replace(" ", "") != f"(!{flag})" or \
            _spelled(exit_.child_by_field_name("consequence")) != "return;":
        problems.append(f"line {line_of(take)}: after the ticket and its barrier expected `if (!{flag}) return;` "
                        f"(only the last CTA merges); found `{_spelled(exit_)[:60] if exit_ is not None else 'nothing'}`")
    elif not (i + 3 < len(stmts) and _is_call(stmts[i + 3], "__threadfence")):
        problems.append(f"line {line_of(exit_)}: after `if (!{flag}) return;` expected `__threadfence();` "
                        "(acquire: the merge reads the other CTAs' stores after the ticket)")
    targs = TEMPLATE_ARGS.get((file, name), {})
    block = block_size(fn, consts, targs)
    cond = take.child_by_field_name("condition") if take.type == "if_statement" else None
    try:
        takers = [t for t in range(block) if cond is not None and
                  evaluate(cond.named_children[-1], {"threadIdx.x": t, **targs}, consts)]
    except Unevaluable:
        takers = []
    if len(takers) != 1:
        problems.append(f"line {line_of(take)}: the ticket must be taken by one thread of the block "
                        f"(`if (threadIdx.x == 0) {{ ... }}`); {len(takers)} of {block} take it")
    assert not problems, f"{file} ({name}):\n" + "\n".join(f"  {p}" for p in problems)


@pytest.mark.parametrize("file,name", sorted(SCRATCH), ids=[k for _, k in sorted(SCRATCH)])
def test_a_block_reductions_scratch_is_written_between_two_barriers(kernel_root, file, name):
    _, tree = read_kernel_file(kernel_root, file)
    fn = defined(tree, file, name)
    scratch, stmts = SCRATCH[(file, name)], _statements(fn)
    writes = [w for w in memory_stores(fn) if _spelled(w).startswith(f"{scratch}[")]
    at = [i for i, s in enumerate(stmts)
          if any(s.start_byte <= w.start_byte and w.end_byte <= s.end_byte for w in writes)]
    assert at, f"{file} ({name}): no statement stores `{scratch}[...]`; this gate reads the one that does"
    problems = []
    for i in at:
        if not (i >= 1 and _is_call(stmts[i - 1], "__syncthreads")):
            problems.append(f"line {line_of(stmts[i])}: expected `__syncthreads();` just before the store: a fast "
                            f"warp must not overwrite a slot of `{scratch}` a slow warp still reads from the last call")
        if not (i + 1 < len(stmts) and _is_call(stmts[i + 1], "__syncthreads")):
            problems.append(f"line {line_of(stmts[i])}: expected `__syncthreads();` just after the store: every "
                            f"warp's slot of `{scratch}` is stored before any thread reads them")
    assert not problems, f"{file} ({name}):\n" + "\n".join(f"  {p}" for p in problems)


# file -> the block reductions whose scratch a kernel passes as the second argument
REDUCTIONS = {"moe_decode.cu": ("moe_block_sum", "moe_block_max")}


@pytest.mark.parametrize("file", sorted(REDUCTIONS))
def test_a_block_reductions_scratch_has_one_slot_a_warp(kernel_root, file):
    # One float a warp of the kernel's block: fewer and the last warps store past it (into the
    # next shared variable); more wastes static shared memory that, with the kernels' dynamic
    # H-sized rows, crosses the 48 KiB a launch may use without opting in (from H 4096).
    consts, tree = read_kernel_file(kernel_root, file)
    problems, checked = [], 0
    for name, fn in functions(tree).items():
        block = block_size(fn, consts)
        for call in (n for n in walk(fn) if n.type == "call_expression"
                     and text_of(n.child_by_field_name("function")) in REDUCTIONS[file]):
            args = call.child_by_field_name("arguments").named_children
            scratch = text_of(args[1]) if len(args) > 1 else "?"
            size = shared_extents(fn, consts).get(scratch, (None,))[0]
            checked += 1
            if block is None or size is None or size != block // 32:
                problems.append(f"line {line_of(call)} ({name}): `{text_of(call)}` reduces over a block of {block} "
                                f"threads into `{scratch}`, a `__shared__` array of {size} floats; it needs "
                                f"{None if block is None else block // 32} (one a warp)")
    assert checked, f"{file}: no call of {REDUCTIONS[file]}; this gate reads their scratch"
    assert not problems, f"{file}:\n" + "\n".join(f"  {p}" for p in sorted(set(problems)))


# (file, function) whose `__shared__` arrays are stored by some threads and read by others
PUBLISHED = [("lm_head.cu", "lm_head_partial"), ("lm_head.cu", "lm_head_reduce"),
             ("nvfp4_gemv.cu", "nvfp4_gemv"), ("moe_decode.cu", "moe_post_attn"), ("moe_decode.cu", "moe_glu"),
             ("moe_decode.cu", "moe_down"), ("moe_decode.cu", "moe_final"), ("paged_attention.cu", "paged_decode"),
             ("paged_attention.cu", "paged_prefill")]


def _barrier_functions(tree) -> set[str]:
    """The functions of the file whose body holds a `__syncthreads()` (a call is a barrier)."""
    return {name for name, fn in functions(tree).items()
            if any(n.type == "call_expression" and text_of(n.child_by_field_name("function")) == "__syncthreads"
                   for n in walk(fn.child_by_field_name("body")))}


@pytest.mark.parametrize("file,name", PUBLISHED, ids=[f"{f}:{k}" for f, k in PUBLISHED])
def test_a_shared_arrays_stores_are_published_by_a_barrier(kernel_root, file, name):
    # A statement of the kernel body that stores into a `__shared__` array, and the next one
    # that reads it, have a `__syncthreads()` between them (or a call of a function that holds
    # one, such as a block reduction): the readers are other threads. Value gates cannot hold
    # this: without the barrier the outcome depends on timing, right in one run, wrong the next.
    consts, tree = read_kernel_file(kernel_root, file)
    fn = defined(tree, file, name)
    barriers = _barrier_functions(tree)
    shared = set(shared_extents(fn, consts, TEMPLATE_ARGS.get((file, name), {}))) | {
        text_of(d) for n in walk(fn.child_by_field_name("body"))
        if n.type == "declaration" and text_of(n).startswith("extern __shared__")
        for d in walk(n) if d.type == "identifier" and d.parent.type == "array_declarator"}
    body = [s for s in fn.child_by_field_name("body").named_children if s.type != "comment"]
    stores = memory_stores(fn)

    def stored(stmt) -> set[str]:
        out = set()
        for w in stores:
            if stmt.start_byte <= w.start_byte and w.end_byte <= stmt.end_byte:
                base = w.child_by_field_name("left")
                while base.type == "subscript_expression":
                    base = base.child_by_field_name("argument")
                if text_of(base) in shared:
                    out.add(text_of(base))
        return out

    targets = {w.child_by_field_name("left").start_byte for w in stores}

    def read(stmt, array: str) -> bool:
        for n in walk(stmt):
            if n.type == "identifier" and text_of(n) == array:
                top = n
                while top.parent is not None and top.parent.type == "subscript_expression" and \
                        top.parent.child_by_field_name("argument") == top:
                    top = top.parent
                if top.start_byte not in targets or top.type == "identifier":
                    return True
        return False

    def barrier(stmt) -> bool:
        return _is_call(stmt, "__syncthreads") or any(
            n.type == "call_expression" and callee(n) in barriers for n in walk(stmt))

    problems, checked = [], 0
    for i, stmt in enumerate(body):
        for array in sorted(stored(stmt)):
            checked += 1
            for later in body[i + 1:]:
                if barrier(later):
                    break
                if read(later, array):
                    problems.append(f"line {line_of(stmt)}: `{array}` is stored here and read at line {line_of(later)} "
                                    "with no `__syncthreads()` between: a thread may read it before another's store")
                    break
    assert checked, f"{file} ({name}): no statement stores a `__shared__` array; this gate reads them"
    assert not problems, f"{file} ({name}):\n" + "\n".join(f"  {p}" for p in problems)


LOOPS = ("for_statement", "while_statement", "do_statement")
BARRIERS = ("__syncthreads", "__syncthreads_count", "__syncthreads_and", "__syncthreads_or")


def _kernels(tree) -> dict:
    """{name: definition} of the file's `__global__` functions."""
    return {name: fn for name, fn in functions(tree).items()
            if "__global__" in text_of(fn)[:fn.child_by_field_name("body").start_byte - fn.start_byte]}


def _shared_names(fn) -> set[str]:
    """Every `__shared__` variable the function declares (sized or `extern`)."""
    names = set()
    for node in walk(fn.child_by_field_name("body")):
        if node.type == "declaration" and "__shared__" in text_of(node):
            for d in node.children_by_field_name("declarator"):
                while d is not None and d.type != "identifier":
                    d = d.child_by_field_name("declarator")
                if d is not None:
                    names.add(text_of(d))
    return names


def _barrier_calls(node, barrier_fns: set[str]) -> list:
    return [n for n in walk(node) if n.type == "call_expression"
            and (callee(n) in BARRIERS or callee(n) in barrier_fns)]


def _is_barrier(stmt, barrier_fns: set[str]) -> bool:
    """The statement is a barrier every thread reaches: `__syncthreads();` or a call of a function
    that holds one, as an expression statement of its own."""
    return stmt.type == "expression_statement" and bool(_barrier_calls(stmt, barrier_fns)) and \
        stmt.named_children[0].type == "call_expression"


def _store_bases(stmt, shared: set[str]) -> tuple[set[str], set[int]]:
    """(the shared arrays a statement stores into, the byte offsets of the identifiers that name
    them as store targets). A store: an assignment whose target's base (its subscripts, casts
    and dereferences peeled) names the array, or an atomic whose first argument does."""
    arrays, spots = set(), set()
    for n in walk(stmt):
        if n.type == "assignment_expression":
            base = n.child_by_field_name("left")
            while base.type == "subscript_expression":
                base = base.child_by_field_name("argument")
        elif n.type == "call_expression" and callee(n).startswith("atomic"):
            args = n.child_by_field_name("arguments").named_children
            base = args[0] if args else None
        else:
            continue
        for i in (walk(base) if base is not None else ()):
            if i.type == "identifier" and text_of(i) in shared:
                arrays.add(text_of(i))
                spots.add(i.start_byte)
    return arrays, spots


def _reads(stmt, shared: set[str], spots: set[int]) -> set[str]:
    return {text_of(n) for n in walk(stmt) if n.type == "identifier" and text_of(n) in shared
            and n.start_byte not in spots}


def _loop_body(loop) -> list:
    body = loop.child_by_field_name("body")
    stmts = body.named_children if body.type == "compound_statement" else [body]
    return [s for s in stmts if s.type != "comment"]


def _hazards(loop, shared: set[str], barrier_fns: set[str]) -> list[str]:
    """What in a loop holding a barrier leaves a shared array unordered (module docstring)."""
    stmts = _loop_body(loop)
    n = len(stmts)
    bar = [_is_barrier(s, barrier_fns) for s in stmts]
    if not any(bar):
        return []
    stores, reads = [], []
    for s in stmts:
        arrays, spots = _store_bases(s, shared)
        stores.append(arrays)
        reads.append(_reads(s, shared, spots))

    def fenced(a: int, b: int, wrap: bool) -> bool:
        """A barrier strictly after statement a and strictly before b (around the back edge when wrap)."""
        between = range(a + 1, n) if wrap else range(a + 1, b)
        return any(bar[j] for j in between) or (wrap and any(bar[j] for j in range(0, b)))

    problems = []
    for s in range(n):
        for array in sorted(stores[s]):
            for r in range(n):
                if array not in reads[r]:
                    continue
                if r > s and not fenced(s, r, False):
                    problems.append(f"line {line_of(stmts[s])}: `{array}` is stored and then read at line "
                                    f"{line_of(stmts[r])} in the same iteration with no barrier between")
                if r < s and not fenced(r, s, False):
                    problems.append(f"line {line_of(stmts[s])}: `{array}` is overwritten after line "
                                    f"{line_of(stmts[r])} read it in the same iteration, with no barrier between")
                if r >= s and not fenced(r, s, True):
                    problems.append(f"line {line_of(stmts[s])}: the next iteration stores `{array}` while a slow "
                                    f"warp may still read it at line {line_of(stmts[r])}: no barrier between the "
                                    "read and the loop's next store (around the back edge)")
                if r < s and not fenced(s, r, True):
                    problems.append(f"line {line_of(stmts[r])}: the next iteration reads `{array}` before a barrier "
                                    f"publishes this iteration's store at line {line_of(stmts[s])}")
    return problems


def _uniformity(fn, barrier_fns: set[str]) -> list[str]:
    """Barriers under a branch, or in a loop, whose condition depends on the thread's index."""
    dep = thread_dependent(initialisers(fn))
    body = fn.child_by_field_name("body")
    problems = []
    for call in _barrier_calls(body, barrier_fns):
        node = call.parent
        while node is not None and node != body:
            if node.type in LOOPS:
                head = [node.child_by_field_name(f) for f in ("initializer", "condition", "update")]
            elif node.type in ("if_statement", "conditional_expression", "switch_statement"):
                head = [node.child_by_field_name("condition")]
            else:
                head = []
            names = {text_of(i) for h in head if h is not None for i in walk(h)
                     if i.type in ("identifier", "field_expression")}
            if names & dep:
                what = "loop" if node.type in LOOPS else "branch"
                problems.append(f"line {line_of(call)}: `{text_of(call)}` sits in a {what} whose condition depends on "
                                f"the thread (`{' '.join(text_of(node).split('{')[0].split())[:70]}`): some threads "
                                "of the block would wait at it for ever, or pass it out of turn")
                break
            node = node.parent
    return problems


KERNEL_FILES = ("fp8_gemv.cu", "lm_head.cu", "moe_decode.cu", "nvfp4_gemv.cu", "paged_attention.cu", "qk_rope.cu")


@pytest.mark.parametrize("file", KERNEL_FILES)
def test_barriers_inside_loops_order_every_shared_store_and_read(kernel_root, file):
    # The top-level reading above (a store, then the next read, then a barrier between) stops at
    # a loop: this one reads each loop that holds a barrier as a cycle, so a staged tile's
    # second barrier (the one that keeps the next iteration's store from overwriting what a slow
    # warp still reads) is held too. It reads every kernel of the file, with no list to keep.
    _, tree = read_kernel_file(kernel_root, file)
    barrier_fns = _barrier_functions(tree)
    problems, loops = [], 0
    for name, fn in sorted(_kernels(tree).items()):
        shared = _shared_names(fn)
        problems += [f"{name}: {p}" for p in _uniformity(fn, barrier_fns)]
        for loop in (n for n in walk(fn.child_by_field_name("body")) if n.type in LOOPS):
            if any(_is_barrier(s, barrier_fns) for s in _loop_body(loop)):
                loops += 1
                problems += [f"{name}: {p}" for p in _hazards(loop, shared, barrier_fns)]
    assert _kernels(tree), f"{file}: no `__global__` function; this gate reads its kernels"
    assert not problems, f"{file} ({loops} loop(s) holding a barrier read):\n" + "\n".join(f"  {p}" for p in problems)
