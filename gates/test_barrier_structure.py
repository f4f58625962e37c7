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
"""

from __future__ import annotations

import pytest

from gates._thread_roles import (TEMPLATE_ARGS, block_size, callee, defined, functions, memory_stores,
                                 read_kernel_file, shared_extents)
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
