"""Structural gates over kernels_cu/moe_decode.cu: claims no numeric gate can see, read from
the source of the ACTIVE kernel root (a control's sandbox during a control run). No GPU.

- The launcher's constants equal the `.cu`'s `#define`s: the grids live in Python and the
  rows a block in CUDA; a glu block that moved its rows without its grid quantizes the wrong
  NVFP4 blocks of a (or none), a down block that moved them writes the wrong slice of H.
- The expert GEMVs are the certified one: moe_glu and moe_down compute their rows through
  nvfp4_partial (nvfp4_dot.cuh) with a table staged in their own shared memory and reduce
  with nvfp4_warp_sum, never a private copy of the dot (the bitwise links rely on it).
- Their staged table is published by a __syncthreads() between the 16 threads' store and the
  first read, and holds exactly E2M1_LUT's 16 entries, one a thread (gates/_nvfp4_table.py).
- Every expert kernel resolves its expert through moe_expert_store, whose guard traps on
  an id or a table entry outside [0, E) before any weight is addressed.
"""

from __future__ import annotations

import re

import pytest

from gates._nvfp4_table import publish_problems, staging_problems
from harness.library.source import calls_in, declared_names, define_int, function, mentions, read_source
from kernels_cu import moe_decode as moe

pytestmark = pytest.mark.structural

EXPERT_KERNELS = ("moe_glu", "moe_down")
DOT_HEADER = "nvfp4_dot.cuh"


def _problems(problems: list[str], fix: str) -> None:
    assert not problems, "\n".join([*problems, f"  {fix}"])


def test_moe_launcher_constants_equal_the_cu_defines(kernel_root):
    path = kernel_root / moe.SOURCE
    pairs = {
        "MOE_THREADS": moe.THREADS,
        "MOE_ROUTER_WARPS": moe.ROUTER_WARPS,
        "MOE_GLU_ROWS": moe.GLU_ROWS,
        "MOE_DOWN_ROWS": moe.DOWN_ROWS,
        "MOE_MAX_T": moe.MAX_T,
        "MOE_MAX_K": moe.MAX_K,
        "MOE_MAX_E": moe.MAX_E,
    }
    wrong = [f"#define {name} {define_int(path, name)} but the launcher uses {value}"
             for name, value in pairs.items() if define_int(path, name) != value]
    if define_int(kernel_root / DOT_HEADER, "NVFP4_GROUP") != moe.GROUP:
        wrong.append(f"{DOT_HEADER}: #define NVFP4_GROUP {define_int(kernel_root / DOT_HEADER, 'NVFP4_GROUP')} "
                     f"but the launcher uses {moe.GROUP}")
    _problems([f"{moe.SOURCE}: " + "; ".join(wrong)] if wrong else [],
              f"change {moe.SOURCE} and kernels_cu/moe_decode.py together: the launcher's grids must match the kernels' rows a block")


def test_expert_kernels_use_the_certified_partial_dot_with_a_staged_table(kernel_root):
    src = read_source(kernel_root / moe.SOURCE)
    problems = []
    for kernel in EXPERT_KERNELS:
        fn = function(src, kernel)
        shared = declared_names(fn.body, "__shared__")
        calls = calls_in(fn.body, "nvfp4_partial")
        if not calls:
            problems.append(f"{kernel} (line {fn.line}) never calls nvfp4_partial: its rows must be the certified GEMV's")
        for call in calls:
            table = call.args[-1] if call.args else ""
            base = re.match(r"\w+", table)
            if base is None or base.group(0) not in shared:
                problems.append(f"{kernel}, line {fn.body_line + call.line - 1}: nvfp4_partial(..., {table}) is not "
                                f"given a __shared__ table (shared here: {', '.join(shared) or 'none'})")
        if not calls_in(fn.body, "nvfp4_warp_sum"):
            problems.append(f"{kernel} (line {fn.line}) does not reduce with nvfp4_warp_sum")
    for name in ("nvfp4_partial", "nvfp4_group", "nvfp4_warp_sum"):
        try:
            function(src, name)
        except Exception:
            continue
        problems.append(f"{moe.SOURCE} defines its own {name}: the dot must be the one in {DOT_HEADER}")
    _problems(problems, f"compute expert rows with nvfp4_partial and nvfp4_warp_sum from {DOT_HEADER}, "
                        "on an e2m1 table staged in the kernel's shared memory")


def test_every_expert_kernel_guards_its_expert_before_reading_weights(kernel_root):
    src = read_source(kernel_root / moe.SOURCE)
    problems = []
    guard = function(src, "moe_expert_store")
    traps = len(calls_in(guard.body, "__trap"))
    if traps < 2 or not (mentions(guard.body, "E") and re.search(r"<\s*0", guard.body)):
        problems.append(f"moe_expert_store (line {guard.line}) must trap on an id and on a table entry outside [0, E) "
                        f"({traps} __trap calls found)")
    for kernel in EXPERT_KERNELS:
        fn = function(src, kernel)
        body = fn.body
        call = calls_in(body, "moe_expert_store")
        if not call:
            problems.append(f"{kernel} (line {fn.line}) does not resolve its expert through moe_expert_store")
            continue
        first_weight = min((m.start() for m in re.finditer(r"\b(wgu|wdn|sgu|sdn|gs_gu|gs_dn)\s*[+\[]", body)), default=None)
        guard_at = re.search(r"\bmoe_expert_store\s*\(", body).start()
        if first_weight is not None and first_weight < guard_at:
            problems.append(f"{kernel}: a weight table is addressed before moe_expert_store's guard")
        if mentions(body, "ids") and re.search(r"\bids\s*\[", body):
            problems.append(f"{kernel}: reads ids[...] directly instead of through the guarded moe_expert_store")
    _problems(problems, "resolve every expert with moe_expert_store (both guards) before any weight address")


def test_router_tail_resets_its_ticket_after_the_selection(kernel_root):
    src = read_source(kernel_root / moe.SOURCE)
    body = function(src, "moe_router").body
    reset = re.search(r"\*\s*ticket\s*=\s*0u?\s*;", body)
    select = re.search(r"\bmoe_topk_softmax\s*\(", body)
    _problems([] if reset and select and reset.start() > select.start() else
              ["moe_router: the last CTA must reset *ticket = 0 after moe_topk_softmax"],
              "a ticket left dirty makes the next launch's tail never run (see the paged attention family)")



def test_expert_kernels_publish_their_staged_table_before_reading_it(kernel_root):
    # moe_glu and moe_down stage the e2m1 table with 16 threads and read it with 256 (first in
    # moe_stage_activation, then in nvfp4_partial): a __syncthreads() must stand between the
    # store and the first read. Dropped, the read is a race the GPU may happen to order, and
    # the later barrier after the staged activation comes too late for the staging itself.
    problems = publish_problems(read_source(kernel_root / DOT_HEADER), read_source(kernel_root / moe.SOURCE),
                                moe.SOURCE, EXPERT_KERNELS)
    _problems(problems, "stage the e2m1 table, then __syncthreads(), then read it")


def test_expert_kernels_stage_the_16_entries_of_e2m1_lut_one_a_thread(kernel_root):
    # `if (tid < 16u) s_lut[tid] = E2M1_LUT[tid];`: a wider store reads past the __constant__
    # table and writes past s_lut into the block's other shared arrays (overwritten later, so
    # no value shows it; at a small H, past the block's shared memory: a fault).
    _problems(staging_problems(read_source(kernel_root / DOT_HEADER), read_source(kernel_root / moe.SOURCE),
                               EXPERT_KERNELS),
              "stage exactly the 16 entries of E2M1_LUT, entry i by thread i")
