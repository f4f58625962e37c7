"""Structural gates: the FP8 GEMV, lm_head, MoE and paged-attention kernels' threads take one role each.

They read the `.cu` of the ACTIVE kernel root (a control's or mutant's sandbox) through
harness.source, parse it with the tree-sitter CUDA grammar and evaluate each kernel's index
expressions for every thread of a block of its `__launch_bounds__` size (gates/_thread_roles.py).
No GPU. (lm_head's slot bounds and warp and lane roles are in `gates/test_lm_head_structure.py`.)

What a wrong role does on the H200 is hang or come out right, so no value gate names it
(the full campaign's timeouts and survivors, docs/observed/mutation-campaign-h200.md,
section 9):

- **Strided loops take every index once.** A loop whose variable starts at a thread's own
  index (`i = tid; i < H; i += MOE_THREADS`, `c = lane; c < chunks; c += 32`, lm_head's
  `b = threadIdx.x; b < blocks; b += LM_HEAD_THREADS`, a half-warp's
  `b = tid / 16u; b < nb; b += MOE_THREADS / 16u`) must, over a block's threads, take each
  index below its bound once (threads that share a sequence are one team), at sizes on and
  off every multiple. A step of 0 never ends (a hang); a bound one past reads and writes one
  element past the row.
- **A warp's work is the warp's.** Where a warp's 32 lanes work on one row or one expert
  with full-mask shuffles after a warp-uniform exit (`fp8_gemv`'s row `n`, `moe_router`'s
  expert `e`, paged attention's split, head, row and tile), the value that picks it is the same across each hardware warp, for every
  block; lanes that pick different work leave the shuffle apart and the warp never returns.
- **One lane stores a warp's result, its first.** Where lane 0 stores what a shift-down sum
  left there (`fp8_gemv`, `moe_router`, `moe_glu`, `moe_down`), exactly one thread of each
  hardware warp has `lane == 0`, its first. Several lanes storing one address in one
  instruction is a race the H200 happens to order.
"""

from __future__ import annotations

import pytest

from gates._thread_roles import (WARP, block_size, first_lanes, initialisers, kernel, partition_problem,
                                 strided_loops, thread_env, warp_values)
from gates._warp_structure import Constants, Unevaluable, _walk, line_of, parse, text_of
from harness.source import read_source

pytestmark = pytest.mark.structural

# file -> kernels whose strided loops are checked (each with the device functions it names)
KERNELS = {
    "fp8_gemv.cu": ("fp8_gemv",),
    "lm_head.cu": ("lm_head_partial", "lm_head_reduce"),
    "moe_decode.cu": ("moe_post_attn", "moe_router", "moe_glu", "moe_down", "moe_final"),
}
# (file, kernel) -> the locals that pick a hardware warp's shared work
WARP_WORK = {
    ("fp8_gemv.cu", "fp8_gemv"): ("warp", "n"),
    ("moe_decode.cu", "moe_router"): ("warp", "e"),
    ("paged_attention.cu", "paged_decode"): ("warp", "split", "h", "row"),
    ("paged_attention.cu", "paged_prefill"): ("warp", "tile", "h"),
}
# (file, kernel) -> the template arguments it is checked at (the launcher's instantiations)
TEMPLATE_ARGS = {
    ("paged_attention.cu", "paged_decode"): {"HD": 256},
    ("paged_attention.cu", "paged_prefill"): {"HD": 256, "ROWS": 8},
}
# kernels where lane 0 of each warp stores the warp's result
# (paged attention's are not: its xor butterflies leave the same bits in every lane, so any
# one lane may store them, and its lanes rotated by one survived the campaign as equivalent)
LANE_ZERO_STORES = (("fp8_gemv.cu", "fp8_gemv"), ("moe_decode.cu", "moe_router"), ("moe_decode.cu", "moe_glu"),
                    ("moe_decode.cu", "moe_down"))
BLOCKS = (0, 1, 5)  # blockIdx.x values the warp-work check is run at
# file -> {runtime size: the constant its contract bounds it by} (the launchers refuse more)
CAPS = {"moe_decode.cu": {"T": "MOE_MAX_T"}}


def _read(kernel_root, name: str):
    text = read_source(kernel_root / name)
    return Constants(text, lambda include: _include(kernel_root, include)), parse(text)


def _include(kernel_root, include: str) -> str | None:
    path = kernel_root / include
    return read_source(path) if path.is_file() else None


def _kernel(tree, file: str, name: str):
    fn = kernel(tree, name)
    if fn is None:
        pytest.fail(f"{file}: no kernel `{name}`; this gate reads it")
    return fn


def _called(fn, tree) -> list:
    """The functions of the file that `fn` calls by name (one level: the staging helpers)."""
    from gates._thread_roles import functions

    names = {text_of(n.child_by_field_name("function")) for n in _walk(fn) if n.type == "call_expression"}
    return [f for name, f in functions(tree).items() if name in names and f is not fn]


@pytest.mark.parametrize("file", sorted(KERNELS))
def test_strided_loops_take_every_index_once(kernel_root, file):
    consts, tree = _read(kernel_root, file)
    caps = {size: consts.value(bound) for size, bound in CAPS.get(file, {}).items()}
    problems, checked = [], 0
    for name in KERNELS[file]:
        fn = _kernel(tree, file, name)
        block = block_size(fn, consts)
        if block is None:
            problems.append(f"{file} line {line_of(fn)} ({name}): no `__launch_bounds__(N)`; this gate runs a block "
                            "of N threads")
            continue
        for f in [fn, *_called(fn, tree)]:
            inits = initialisers(f)
            for loop in strided_loops(f, inits):
                checked += 1
                try:
                    problem = partition_problem(f, loop, inits, consts, block, caps=caps)
                except Unevaluable as exc:
                    problem = f"`{' '.join(text_of(loop).split(')')[0].split())})`: {exc}"
                if problem:
                    problems.append(f"{file} line {line_of(loop)} ({name}): {problem}")
    assert checked, f"{file}: no strided loop found; this gate reads loops from a thread's own index"
    assert not problems, "\n".join(sorted(set(problems)) + [
        "  start each thread at its own index and step by the team's size (the block, or 32 for lanes)"])


@pytest.mark.parametrize("file,name", sorted(WARP_WORK), ids=[k for _, k in sorted(WARP_WORK)])
def test_a_warps_work_is_the_same_for_all_its_lanes(kernel_root, file, name):
    consts, tree = _read(kernel_root, file)
    fn = _kernel(tree, file, name)
    targs = TEMPLATE_ARGS.get((file, name), {})
    block, inits = block_size(fn, consts, targs), initialisers(fn)
    problems = []
    for b in BLOCKS:
        envs = [thread_env(fn, inits, consts, tid, block, extra={**targs, "blockIdx.x": b, "blockIdx.y": b,
                                                                "blockIdx.z": b}) for tid in range(block)]
        for local in WARP_WORK[(file, name)]:
            if any(local not in e for e in envs):
                problems.append(f"{file} ({name}): cannot evaluate `{local}` from the thread's and block's index")
                break
            for hw in range(block // WARP):
                values = warp_values(envs, hw, local)
                if len(values) != 1:
                    problems.append(f"{file} ({name}): `{local}` differs across hardware warp {hw} of block {b} "
                                    f"({values[:4]}): its lanes leave the warp's full-mask shuffles apart")
                    break
    assert not problems, "\n".join(sorted(set(problems)) + ["  derive a warp's row or expert from threadIdx.x >> 5"])


@pytest.mark.parametrize("file,name", LANE_ZERO_STORES, ids=[k for _, k in LANE_ZERO_STORES])
def test_one_lane_stores_each_warps_result_its_first(kernel_root, file, name):
    consts, tree = _read(kernel_root, file)
    fn = _kernel(tree, file, name)
    targs = TEMPLATE_ARGS.get((file, name), {})
    block, inits = block_size(fn, consts, targs), initialisers(fn)
    envs = [thread_env(fn, inits, consts, tid, block, extra=targs) for tid in range(block)]
    assert all("lane" in e for e in envs), f"{file} ({name}): cannot evaluate `lane` from the thread's index"
    problems = []
    for hw in range(block // WARP):
        first = first_lanes(envs, hw)
        if first != [hw * WARP]:
            problems.append(f"{file} ({name}): in hardware warp {hw} the threads with lane == 0 are {first[:8]}: "
                            f"exactly one, its first ({hw * WARP}), must store the warp's result")
    assert not problems, "\n".join(problems + ["  lane = threadIdx.x & 31"])
