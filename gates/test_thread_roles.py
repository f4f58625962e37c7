"""Structural gates: the FP8 GEMV, lm_head, MoE and paged-attention kernels' threads take one role each.

They read the `.cu` of the ACTIVE kernel root (a control's or mutant's sandbox) through
harness.library.source, parse it with the tree-sitter CUDA grammar and evaluate each kernel's index
expressions for every thread of a block of its `__launch_bounds__` size (gates/_thread_roles.py).
No GPU. (lm_head's slot bounds and warp and lane roles are in `gates/test_lm_head_structure.py`.)

A wrong role makes a kernel hang or come out right (the GPU happens to order the race), so
no value gate names it:

- **Strided loops take every index once.** A loop whose variable starts at a thread's own
  index (`i = tid; i < H; i += MOE_THREADS`, `c = lane; c < chunks; c += 32`, lm_head's
  `b = threadIdx.x; b < blocks; b += LM_HEAD_THREADS`, a half-warp's
  `b = tid / 16u; b < nb; b += MOE_THREADS / 16u`) must, over a block's threads, take each
  index below its bound once (threads that share a sequence are one team), at sizes on and
  off every multiple. A step of 0 never ends (a hang); a bound one past reads and writes one
  element past the row.
- **A warp's work is the warp's.** Where a warp's 32 lanes work on one row or one expert
  with full-mask shuffles after a warp-uniform exit (`fp8_gemv`'s row `n`, its tile's first
  token `t0` and live `tokens`, `moe_router`'s
  expert `e`, paged attention's split, head, row and tile), the value that picks it is the same across each hardware warp, for every
  block; lanes that pick different work leave the shuffle apart and the warp never returns.
- **One lane stores a warp's result, its first.** Where lane 0 stores what a shift-down sum
  left there (`fp8_gemv`, `moe_router`, `moe_glu`, `moe_down`), exactly one thread of each
  hardware warp has `lane == 0`, its first. Several lanes storing one address in one
  instruction is a race the GPU happens to order.
"""

from __future__ import annotations

import pytest

from gates._thread_roles import (TEMPLATE_ARGS, WARP, analysed, block_size, callee, compiled_inits, defined,
                                 first_lanes, functions, initialisers, partition_problem, read_kernel_file,
                                 strided_loops, thread_env, warp_values)
from gates._warp_structure import Unevaluable, line_of, loop_variable, text_of
from harness.compiling.cuda_syntax import walk

pytestmark = pytest.mark.structural

# file -> kernels whose strided loops are checked (each with the device functions it names)
KERNELS = {
    "fp8_gemv.cu": ("fp8_gemv",),
    "lm_head.cu": ("lm_head_partial", "lm_head_reduce"),
    "moe_decode.cu": ("moe_post_attn", "moe_router", "moe_glu", "moe_down", "moe_final"),
    "paged_attention.cu": ("paged_decode", "paged_combine", "paged_prefill"),
}
# (file, kernel) -> strided loops whose bounds are read from memory, by their variable: paged
# decode's page loop runs from a row's first visible page (its qpos and window); which pages a
# warp takes is the warp-work gate's and the anchors' business
DATA_BOUND_LOOPS = {("paged_attention.cu", "paged_decode"): ("p",)}
# (file, kernel) -> the locals that pick a hardware warp's shared work
WARP_WORK = {
    ("fp8_gemv.cu", "fp8_gemv"): ("warp", "n", "t0", "tokens"),
    ("moe_decode.cu", "moe_router"): ("warp", "e"),
    ("paged_attention.cu", "paged_decode"): ("warp", "split", "h", "row"),
    ("paged_attention.cu", "paged_prefill"): ("warp", "tile", "h"),
}
# kernels where lane 0 of each warp stores the warp's result
# (paged attention's are not: its xor butterflies leave the same bits in every lane, so any
# one lane may store them)
LANE_ZERO_STORES = (("fp8_gemv.cu", "fp8_gemv"), ("moe_decode.cu", "moe_router"), ("moe_decode.cu", "moe_glu"),
                    ("moe_decode.cu", "moe_down"))
BLOCKS = (0, 1, 5)  # blockIdx.x values the warp-work check is run at
# file -> {runtime size: the constant its contract bounds it by} (the launchers refuse more)
CAPS = {"moe_decode.cu": {"T": "MOE_MAX_T", "K": "MOE_MAX_K"}}


def _called(fn, tree) -> list:
    """The functions of the file that `fn` calls by name (one level: the staging helpers)."""
    names = {callee(n) for n in walk(fn) if n.type == "call_expression"}
    return [f for name, f in functions(tree).items() if name in names and f is not fn]


def _strided(consts, tree, file: str, name: str) -> tuple[int, tuple]:
    """(loops checked, problems) of kernel `name`'s strided loops and its callees'."""
    caps = {size: consts.value(bound) for size, bound in CAPS.get(file, {}).items()}
    fn = defined(tree, file, name)
    targs = TEMPLATE_ARGS.get((file, name), {})
    block = block_size(fn, consts, targs)
    if block is None:
        return 0, (f"{file} line {line_of(fn)} ({name}): no `__launch_bounds__(N)`; this gate runs a block "
                   "of N threads",)
    problems, checked = [], 0
    for f in [fn, *_called(fn, tree)]:
        inits = initialisers(f)
        for loop in strided_loops(f, inits):
            if loop_variable(loop)[0] in DATA_BOUND_LOOPS.get((file, name), ()):
                continue
            checked += 1
            try:
                problem = partition_problem(f, loop, inits, consts, block, caps=caps, extra=targs)
            except Unevaluable as exc:
                problem = f"`{' '.join(text_of(loop).split(')')[0].split())})`: {exc}"
            if problem:
                problems.append(f"{file} line {line_of(loop)} ({name}): {problem}")
    return checked, tuple(problems)


@pytest.mark.parametrize("file", sorted(KERNELS))
def test_strided_loops_take_every_index_once(kernel_root, file):
    problems, checked = [], 0
    for name in KERNELS[file]:
        n, found = analysed(kernel_root, file, (name,), _strided, name)
        checked += n
        problems += found
    assert checked, f"{file}: no strided loop found; this gate reads loops from a thread's own index"
    assert not problems, "\n".join(sorted(set(problems)) + [
        "  start each thread at its own index and step by the team's size (the block, or 32 for lanes)"])


@pytest.mark.parametrize("file,name", sorted(WARP_WORK), ids=[k for _, k in sorted(WARP_WORK)])
def test_a_warps_work_is_the_same_for_all_its_lanes(kernel_root, file, name):
    consts, tree = read_kernel_file(kernel_root, file)
    fn = defined(tree, file, name)
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
    consts, tree = read_kernel_file(kernel_root, file)
    fn = defined(tree, file, name)
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


# (file, function) -> (block size, the group whose threads must not share an address, the
# parameters that stand for a thread's index). A kernel's block is its `__launch_bounds__`;
# a device function's is its callers' (`moe_topk_softmax` runs one warp a token, so two
# warps storing one address is a question for its callers' indexing, checked in theirs).
ONE_WRITER = {
    ("fp8_gemv.cu", "fp8_gemv"): (None, "block", {}),
    ("lm_head.cu", "lm_head_partial"): (None, "block", {}),
    ("lm_head.cu", "lm_head_reduce"): (None, "block", {}),
    ("nvfp4_gemv.cu", "nvfp4_stage_lut_warp"): ("32", "warp", {"lane": "threadIdx.x & 31u"}),
    ("nvfp4_gemv.cu", "nvfp4_gemv"): (None, "block", {}),
    ("nvfp4_gemv.cu", "nvfp4_gemv_sw"): (None, "block", {}),
    ("moe_decode.cu", "moe_block_sum"): ("MOE_THREADS", "block", {}),  # `red`: its callers' s_red
    ("moe_decode.cu", "moe_block_max"): ("MOE_THREADS", "block", {}),
    ("moe_decode.cu", "moe_stage_activation"): ("MOE_THREADS", "block", {}),
    ("moe_decode.cu", "moe_post_attn"): (None, "block", {}),
    ("moe_decode.cu", "moe_topk_softmax"): ("MOE_ROUTER_WARPS * 32", "warp", {"lane": "threadIdx.x & 31u"}),
    ("moe_decode.cu", "moe_router"): (None, "block", {}),
    ("moe_decode.cu", "moe_glu"): (None, "block", {}),
    ("moe_decode.cu", "moe_glu_quant_ref"): (None, "block", {}),
    ("moe_decode.cu", "moe_down"): (None, "block", {}),
    ("moe_decode.cu", "moe_final"): (None, "block", {}),
    ("paged_attention.cu", "merge_splits"): ("DECODE_WARPS * LANES", "block", {}),
    ("paged_attention.cu", "paged_decode"): (None, "block", {}),
    ("paged_attention.cu", "paged_prefill"): (None, "block", {}),
}
# (file, function) -> {a pointer parameter: the extent its callers give it}
PARAMETER_EXTENTS = {("moe_decode.cu", "moe_block_sum"): {"red": "MOE_THREADS / 32"},
                     ("moe_decode.cu", "moe_block_max"): {"red": "MOE_THREADS / 32"}}
BLOCK_INDEX = {"blockIdx.x": 1, "blockIdx.y": 1, "blockIdx.z": 1, "gridDim.x": 4, "gridDim.y": 4, "gridDim.z": 4}


def _one_writer(consts, tree, file: str, name: str) -> tuple[int | None, int, tuple]:
    """(block, stores placed, problems) of function `name`'s stores (ONE_WRITER)."""
    from gates._thread_roles import memory_stores, shared_extents, shared_writers
    from gates._warp_structure import _expression, evaluate

    fn = defined(tree, file, name)
    spelled, scope, bind = ONE_WRITER[(file, name)]
    targs = TEMPLATE_ARGS.get((file, name), {})
    block = block_size(fn, consts, targs) if spelled is None else evaluate(_expression(spelled), targs, consts)
    if not block:
        return block, 0, ()
    extents = {**shared_extents(fn, consts, targs),
               **{p: (evaluate(_expression(n), targs, consts),)
                  for p, n in PARAMETER_EXTENTS.get((file, name), {}).items()}}
    problems, checked = [], 0
    for store in memory_stores(fn):
        try:
            problem = shared_writers(fn, store, consts, block, WARP if scope == "warp" else block,
                                     extra={**targs, **BLOCK_INDEX}, bind=bind, extents=extents,
                                     caps={size: consts.value(cap) for size, cap in CAPS.get(file, {}).items()})
        except Unevaluable:
            continue  # an address read from memory (a page table, a tile start): not placed here
        checked += 1
        if problem:
            problems.append(f"{file} line {line_of(store)} ({name}): {problem}")
    return block, checked, tuple(problems)


@pytest.mark.parametrize("file,name", sorted(ONE_WRITER), ids=[f"{f}:{k}" for f, k in sorted(ONE_WRITER)])
def test_each_address_has_one_writer_a_step(kernel_root, file, name):
    block, checked, problems = analysed(kernel_root, file, (name,), _one_writer, name)
    assert block, f"{file} ({name}): no `__launch_bounds__(N)`; this gate runs a block of N threads"
    assert checked, f"{file} ({name}): no store whose address this gate can place; it reads `a[i] = v` stores"
    assert not problems, "\n".join(list(problems) + [
        "  one thread stores each element: guard the store by the one lane or thread that holds the value "
        "(several threads storing one address in one instruction is a race the hardware happens to order)"])


# kernels with a `lane` local: the shuffles' source lanes, the `lane == 0` writers and the
# per-lane slices of a row all take it for the thread's hardware lane
LANE_KERNELS = [("fp8_gemv.cu", "fp8_gemv"), ("lm_head.cu", "lm_head_partial"), ("lm_head.cu", "lm_head_reduce"),
                ("moe_decode.cu", "moe_router"), ("moe_decode.cu", "moe_glu"), ("moe_decode.cu", "moe_glu_quant_ref"),
                ("moe_decode.cu", "moe_down"), ("nvfp4_gemv.cu", "nvfp4_gemv_sw"),
                ("paged_attention.cu", "paged_decode"), ("paged_attention.cu", "paged_prefill")]


def _lanes(consts, tree, file: str, name: str) -> tuple[bool, int | None, tuple]:
    """(has a `lane` local, block, (thread, its lane) for each thread whose lane is not its own)."""
    fn = defined(tree, file, name)
    inits = initialisers(fn)
    if "lane" not in dict(inits):
        return False, None, ()
    targs = TEMPLATE_ARGS.get((file, name), {})
    block = block_size(fn, consts, targs)
    if not block:
        return True, block, ()
    wrong = []
    fast = compiled_inits(inits, consts)  # evaluated for every thread of the block
    for tid in range(block):
        env = thread_env(fn, fast, consts, tid, block, extra={**targs, **BLOCK_INDEX})
        if env.get("lane") != tid % WARP:
            wrong.append((tid, env.get("lane", "unevaluable")))
    return True, block, tuple(wrong)


@pytest.mark.parametrize("file,name", LANE_KERNELS, ids=[f"{f}:{k}" for f, k in LANE_KERNELS])
def test_lane_is_the_hardware_lane(kernel_root, file, name):
    has_lane, block, wrong = analysed(kernel_root, file, (name,), _lanes, name)
    assert has_lane, f"{file} ({name}): no `lane` local; this gate reads `lane = ...`"
    assert block, f"{file} ({name}): no `__launch_bounds__(N)`; this gate runs a block of N threads"
    assert not wrong, (f"{file} ({name}): `lane` is not the thread's hardware lane for threads "
                       f"{', '.join(f'{t} (lane {v})' for t, v in wrong[:6])}{' ...' if len(wrong) > 6 else ''}\n"
                       "  lane = threadIdx.x & 31 (the lane the shuffles and the hardware number)")
