"""Structural gates over lm_head.cu: thread roles and shared slots no value can show.

They read the `.cu` of the ACTIVE kernel root (a control's or mutant's sandbox) through
harness.library.source, parse it with the tree-sitter CUDA grammar (harness.compiling.cuda_syntax) and
evaluate the kernels' index expressions for every thread of a block. They need no GPU.

Each claim is one the kernels rely on, and a wrong one breaks without a wrong value: the
kernel hangs, or the GPU happens to order the race, so no value gate can name it:

- **Every shared slot a thread indexes lies inside its array.** `s_val[warp]` stored by
  each warp's lane 0 and `s_val[w]` read by the block stage: an array one slot short puts
  warp 7's slot past its end, still inside the block's shared allocation, so it reads back
  right and no fence or sanitizer sees it.
- **Warps and lanes take one role each.** In `lm_head_partial` a warp's 32 lanes score one
  row together (the full-mask warp sum), so `warp` must be the same across a hardware warp
  (else lanes break out of the row loop apart and the shuffle waits forever), and the 8
  warps must take the 8 row groups once each. In both kernels exactly one lane of each
  hardware warp, its first (the one the shift-down sum leaves holding the result), stores
  the warp's slot, and the storing lanes fill every slot once. Two lanes storing one slot
  is a race the GPU happens to order.

Its strided loops (`c = lane; c < steps; c += 32`, `b = threadIdx.x; b < blocks;
b += LM_HEAD_THREADS`) are checked with every family's, in `gates/test_thread_roles.py`.
"""

from __future__ import annotations

import pytest

from gates._thread_roles import (WARP, defined, first_lanes, guards, initialisers, name_of, passes,
                                 read_kernel_file, thread_env, warp_values)
from gates._warp_structure import Unevaluable, evaluate, line_of, loop_values, text_of
from harness.compiling.cuda_syntax import walk
from kernels_cu import lm_head

pytestmark = pytest.mark.structural

KERNELS = ("lm_head_partial", "lm_head_reduce")
# The kernels whose `warp` chooses what a whole hardware warp does together (rows summed with
# full-mask shuffles): it must be uniform across the warp. lm_head_reduce's `warp` names only
# the slot its storing lane writes.
WARP_UNIFORM = ("lm_head_partial",)


def _shared_arrays(fn, consts) -> dict[str, tuple[int, int]]:
    """{name: (slots, line)} of the body's `__shared__ T name[N]` arrays."""
    out = {}
    for node in walk(fn.child_by_field_name("body")):
        if node.type == "declaration" and any(c.type == "type_qualifier" and text_of(c) == "__shared__"
                                              for c in node.children):
            for decl in node.children_by_field_name("declarator"):
                if decl.type == "array_declarator":
                    size = decl.child_by_field_name("size")
                    out[text_of(decl.child_by_field_name("declarator"))] = (evaluate(size, {}, consts), line_of(decl))
    return out


def _enclosing_loop(node, name):
    parent = node.parent
    while parent is not None:
        if parent.type == "for_statement":
            init = parent.child_by_field_name("initializer")
            if init is not None and name in {text_of(n) for n in walk(init) if n.type == "identifier"}:
                return parent
        parent = parent.parent
    return None


def _problem(fn, node, text: str) -> str:
    return f"{lm_head.SOURCE} line {line_of(node)} ({name_of(fn)}): {text}"


def test_lm_head_every_shared_slot_a_thread_indexes_lies_inside_its_array(kernel_root):
    consts, tree = read_kernel_file(kernel_root, lm_head.SOURCE)
    threads = consts.value("LM_HEAD_THREADS")
    problems, checked = [], 0
    for name in KERNELS:
        fn = defined(tree, lm_head.SOURCE, name)
        arrays, inits = _shared_arrays(fn, consts), initialisers(fn)
        for node in walk(fn.child_by_field_name("body")):
            if node.type != "subscript_expression":
                continue
            array = text_of(node.child_by_field_name("argument"))
            if array not in arrays:
                continue
            slots, declared = arrays[array]
            index = node.child_by_field_name("indices") or node.child_by_field_name("index")
            index = index.named_children[0] if index is not None and index.type == "subscript_argument_list" else index
            conds, seen = guards(node, fn), set()
            try:
                loop = _enclosing_loop(node, text_of(index)) if index.type == "identifier" else None
                for tid in range(threads):
                    env = thread_env(fn, inits, consts, tid, threads)
                    if not passes(conds, env, consts):
                        continue
                    if loop is not None:
                        seen.update(loop_values(loop, consts, env))
                    else:
                        seen.add(evaluate(index, env, consts))
            except Unevaluable as exc:
                problems.append(_problem(fn, node, f"cannot read the index of `{text_of(node)}`: {exc}"))
                continue
            checked += 1
            outside = sorted(i for i in seen if not 0 <= i < slots)
            if outside:
                problems.append(_problem(fn, node, f"`{text_of(node)}` takes index {outside} but `{array}` "
                                                   f"(line {declared}) holds {slots} slots"))
    assert checked >= 4, f"{lm_head.SOURCE}: found {checked} shared-slot accesses; this gate reads s_val/s_idx"
    assert not problems, "\n".join([*problems, "  size each warp-slot array for every warp of the block "
                                               "(LM_HEAD_THREADS / 32) and index it only below that"])


def test_lm_head_warps_and_lanes_take_one_role_each(kernel_root):
    consts, tree = read_kernel_file(kernel_root, lm_head.SOURCE)
    threads = consts.value("LM_HEAD_THREADS")
    warps = threads // WARP
    problems = []
    for name in KERNELS:
        fn = defined(tree, lm_head.SOURCE, name)
        inits = initialisers(fn)
        if not {"warp", "lane"} <= {name for name, _ in inits}:
            problems.append(f"{lm_head.SOURCE} ({name}): no `warp = ...` and `lane = ...`; this gate reads them")
            continue
        try:
            envs = [thread_env(fn, inits, consts, tid, threads) for tid in range(threads)]
        except Unevaluable as exc:
            problems.append(_problem(fn, fn, f"cannot read warp and lane: {exc}"))
            continue
        if any("warp" not in e or "lane" not in e for e in envs):
            problems.append(_problem(fn, fn, "cannot evaluate `warp` and `lane` from the thread's index"))
            continue
        where = dict(inits)
        storers = []
        for hw in range(warps):
            first = first_lanes(envs, hw)
            if first != [hw * WARP]:
                problems.append(_problem(fn, where["lane"], f"in hardware warp {hw} the threads with lane == 0 are "
                                                            f"{first}: exactly one, its first ({hw * WARP}), must "
                                                            "store the warp's slot (the shift-down sum leaves the "
                                                            "result there)"))
            else:
                storers.append(envs[hw * WARP]["warp"])
            if name in WARP_UNIFORM and len(warp_values(envs, hw, "warp")) != 1:
                problems.append(_problem(fn, where["warp"], f"`warp` differs across hardware warp {hw} "
                                                            f"({warp_values(envs, hw, 'warp')}): its lanes score "
                                                            "one row together with full-mask shuffles"))
        if len(storers) == warps and sorted(storers) != list(range(warps)):
            problems.append(_problem(fn, where["warp"], f"the storing lanes' `warp` is {storers}: each of the "
                                                        f"{warps} slots must be written once"))
    assert not problems, "\n".join([*problems, "  warp = threadIdx.x >> 5 and lane = threadIdx.x & 31"])
