"""Structural gates over the quantized GEMV sources: claims no numeric gate can see.

They read the `.cu` files of the ACTIVE kernel root (a control's sandbox during a control
run) through harness.library.source, and need no GPU: they run in CI.

- Launcher constants equal the `#define`s: a kernel whose outputs-per-block moved without
  its Python grid writes the wrong slice of N (numeric gates catch that only on shapes
  that happen to expose it; this catches it on every edit).
- The NVFP4 partial dot reads a shared-memory table: an e2m1 lookup in `__constant__`
  memory with data-dependent nibbles gives the same bits but serialises the warp (one
  replay per distinct address, about 14 of 16 on real weights) on every multiply.
- A staged e2m1 table is published by a barrier between its store and its first read, each
  single-warp kernel's warp reads only the row it staged itself, and the stage is exactly
  `if (i < 16u) table[i] = E2M1_LUT[i];` (gates/_nvfp4_table.py): a dropped barrier, another
  warp's row, or stray stores past the table are races or faults, never a wrong value a
  numeric gate could name.
- The single-warp kernel has no block barrier: its early return is warp-uniform, not
  block-uniform, so a `__syncthreads()` after it is a divergent barrier (undefined), and
  the kernel's point, a barrier-free reduction for occupancy, would be gone.
- Each lm_head kernel reads its warps' shared slots only after a block barrier: lane 0 of
  every warp stores its (value, index), thread 0 reads all of them. Without the barrier the
  read races the stores; on one GPU the warps may happen to finish in time, so no numeric
  gate sees it reliably.
"""

from __future__ import annotations

import re

import pytest

from gates._nvfp4_table import publish_problems, staging_problems
from harness.library.source import (calls_in, declared_names, define_int, function, line_of, mentions, reachable_functions,
                                    read_source)
from kernels_cu import fp8_gemv, lm_head, nvfp4_gemv

pytestmark = pytest.mark.structural

PARTIAL = "nvfp4_partial"
DOT_HEADER = "nvfp4_dot.cuh"  # nvfp4_partial and its helpers, shared with moe_decode.cu
KERNELS_CALLING_THE_PARTIAL = ("nvfp4_gemv", "nvfp4_gemv_sw")
SINGLE_WARP_KERNELS = ("nvfp4_gemv_sw",)
BLOCK_BARRIERS = ("__syncthreads", "__syncthreads_count", "__syncthreads_and", "__syncthreads_or", "__barrier_sync")


def read(kernel_root, relpath: str) -> str:
    return read_source(kernel_root / relpath)


def assert_no_problems(problems: list[str], fix: str) -> None:
    """Fail with every problem; the first is the message's first line (what reports show)."""
    assert not problems, "\n".join([*problems, f"  {fix}"])


def assert_constants_equal_defines(kernel_root, relpath: str, pairs: dict[str, int]) -> None:
    path = kernel_root / relpath
    wrong = [f"#define {name} {define_int(path, name)} but the launcher uses {value}"
             for name, value in pairs.items() if define_int(path, name) != value]
    assert_no_problems(
        [f"{relpath}: " + "; ".join(wrong)] if wrong else [],
        f"change {relpath} and its launcher together: the launcher's grid must match the kernel's outputs per block",
    )


def test_nvfp4_launcher_constants_equal_the_cu_defines(kernel_root):
    assert_constants_equal_defines(kernel_root, nvfp4_gemv.SOURCE, {
        "N_PER_BLOCK": nvfp4_gemv.N_PER_BLOCK,
        "N_PER_BLOCK_SW": nvfp4_gemv.N_PER_BLOCK_SW,
        "NVFP4_THREADS": nvfp4_gemv.THREADS,
    })
    assert_constants_equal_defines(kernel_root, DOT_HEADER, {"NVFP4_GROUP": nvfp4_gemv.GROUP})


def test_fp8_gemv_launcher_constants_equal_the_cu_defines(kernel_root):
    assert_constants_equal_defines(kernel_root, fp8_gemv.SOURCE, {
        "FP8_GEMV_THREADS": fp8_gemv.THREADS,
        "FP8_GEMV_ROWS_PER_BLOCK": fp8_gemv.ROWS_PER_BLOCK,
        "FP8_GEMV_BYTES_PER_LANE": fp8_gemv.BYTES_PER_LANE,
        "FP8_GEMV_TOKENS_PER_BLOCK": fp8_gemv.TOKENS_PER_BLOCK,
    })


def test_lm_head_launcher_constants_equal_the_cu_defines(kernel_root):
    assert_constants_equal_defines(kernel_root, lm_head.SOURCE, {
        "LM_HEAD_THREADS": lm_head.THREADS,
        "LM_HEAD_ROWS_PER_BLOCK": lm_head.ROWS_PER_BLOCK,
        "LM_HEAD_H_PER_LANE": lm_head.H_PER_LANE,
    })


LM_HEAD_KERNELS = ("lm_head_partial", "lm_head_reduce")


def test_lm_head_reads_its_warps_shared_slots_after_a_block_barrier(kernel_root):
    # For each __shared__ array of each kernel: its first read after its last store (the
    # declaration is neither) must have a block barrier between them.
    src = read(kernel_root, lm_head.SOURCE)
    problems = []
    for kernel in LM_HEAD_KERNELS:
        fn = function(src, kernel)
        body = fn.body
        barriers = [m.start() for b in BLOCK_BARRIERS for m in re.finditer(rf"(?<!\w){b}\s*\(", body)]
        names = declared_names(body, "__shared__")
        checked = 0
        for name in names:
            uses = list(re.finditer(rf"(?<!\w){name}\s*\[[^\]]*\](\s*=(?!=))?", body))[1:]  # [0]: the declaration
            stores = [m.start() for m in uses if m.group(1)]
            reads = [m.start() for m in uses if not m.group(1) and stores and m.start() > max(stores)]
            if not stores or not reads:
                continue
            store, first_read, checked = max(stores), min(reads), checked + 1
            if not any(store < b < first_read for b in barriers):
                problems.append(f"{kernel}, line {fn.body_line + line_of(body, first_read) - 1}: {name}[...] is read "
                                f"after its store at line {fn.body_line + line_of(body, store) - 1} with no "
                                "__syncthreads() between")
        if not checked:
            problems.append(f"{kernel}: no __shared__ slot stored then read found; this gate reads the warps' "
                            "(value, index) slots (s_val[warp] = ...; ... s_val[w])")
    assert_no_problems(problems, "every warp's slot must be stored before thread 0 reads it: "
                                 "put __syncthreads() between the stores and the block stage")


def test_nvfp4_partial_reads_a_staged_table_never_constant_memory(kernel_root):
    src = read(kernel_root, nvfp4_gemv.SOURCE)
    header = read(kernel_root, DOT_HEADER)
    constant = declared_names(header, "__constant__") + declared_names(src, "__constant__")
    problems = []
    # 1. The partial and every helper it calls (all in the header) index no __constant__ array.
    for fn in reachable_functions(header, PARTIAL):
        problems += [f"{fn.name} ({DOT_HEADER} line {fn.line}) reads __constant__ {name}" for name in constant if mentions(fn.body, name)]
    lut = function(header, PARTIAL).params.split(",")[-1].split()[-1]
    if not re.search(rf"(?<!\w){lut}\s*\[", " ".join(f.body for f in reachable_functions(header, PARTIAL))):
        problems.append(f"{PARTIAL}'s last parameter `{lut}` is never indexed: the partial must decode through the table it is given")
    # 2. Every kernel hands it a table staged in its own __shared__ memory.
    for kernel in KERNELS_CALLING_THE_PARTIAL:
        fn = function(src, kernel)
        shared = declared_names(fn.body, "__shared__")
        calls = calls_in(fn.body, PARTIAL)
        if not calls:
            problems.append(f"{kernel} (line {fn.line}) never calls {PARTIAL}: base and single-warp must share it")
        for call in calls:
            table = call.args[-1] if call.args else ""
            base = re.match(r"\w+", table)
            if base is None or base.group(0) not in shared:
                problems.append(
                    f"{kernel}, line {fn.body_line + call.line - 1}: {PARTIAL}(..., {table}) is not given a __shared__ "
                    f"table (shared here: {', '.join(shared) or 'none'}; __constant__: {', '.join(constant) or 'none'})"
                )
    # 3. The single-warp kernel stages one private row a warp.
    for kernel in SINGLE_WARP_KERNELS:
        body = function(src, kernel).body
        if not re.search(r"__shared__\s+float\s+\w+\s*\[\s*N_PER_BLOCK_SW\s*\]\s*\[\s*16\s*\]", body):
            problems.append(f"{kernel}: the e2m1 table must be staged per warp, `__shared__ float s_lut[N_PER_BLOCK_SW][16]`")
    assert_no_problems(problems, "the NVFP4 partial dot must decode through a shared-memory e2m1 table: "
                                 "stage E2M1_LUT into __shared__ memory in the kernel and pass the staged copy")


def test_single_warp_kernel_has_no_block_barrier(kernel_root):
    # The kernel's helpers include the shared partial in the header: read both, header first.
    header = read(kernel_root, DOT_HEADER)
    src = header + "\n" + read(kernel_root, nvfp4_gemv.SOURCE)
    header_lines = header.count("\n") + 1

    def where(line: int) -> str:
        return f"{DOT_HEADER} line {line}" if line <= header_lines else f"line {line - header_lines}"

    found = []
    for kernel in SINGLE_WARP_KERNELS:
        for fn in reachable_functions(src, kernel):
            for barrier in BLOCK_BARRIERS:
                found += [f"{fn.name}, {where(fn.body_line + call.line - 1)}: {barrier}() in single-warp kernel {kernel}"
                          for call in calls_in(fn.body, barrier)]
    assert_no_problems(found, "a single-warp kernel's early return is warp-uniform only: "
                              "publish with __syncwarp(), never a block barrier")


# ------------------------------------------------------------------ the staged e2m1 table: written, published, read


def test_every_table_the_partial_reads_was_staged_and_published_before_it(kernel_root):
    # A staged table is read by other threads than the ones that wrote it (the base kernel: all
    # 256 threads read what 16 wrote; the single-warp kernel: 32 lanes read what 16 lanes wrote),
    # so a barrier must stand between the store and the first read: `__syncthreads()` in the base
    # kernel, `__syncwarp()` in the single-warp kernel's stage (which may have no block barrier).
    # Without it the read is a race that the GPU's convergence happens to order (no numeric gate
    # sees it; racecheck would). And a single-warp kernel's warp may read only the row it staged
    # itself: its __syncwarp publishes to its own warp, never to another (s_lut[0] read by warp 3
    # is a cross-warp race, even though every row holds the same values).
    problems = publish_problems(read(kernel_root, DOT_HEADER), read(kernel_root, nvfp4_gemv.SOURCE), nvfp4_gemv.SOURCE,
                                KERNELS_CALLING_THE_PARTIAL, SINGLE_WARP_KERNELS)
    assert_no_problems(problems, "stage the e2m1 table, publish it with a barrier, and read only the copy you staged")


def test_every_staged_table_holds_the_16_entries_of_e2m1_lut_one_a_thread(kernel_root):
    # Entry i of a staged copy is E2M1_LUT[i], stored by the thread whose index is i, for i < 16
    # and no further: `if (i < 16u) table[i] = E2M1_LUT[i];`. A bound past 16 reads past the
    # __constant__ table and, in the single-warp kernel, writes lanes 16..31 into the NEXT warp's
    # row (a cross-warp race on a row its owner has already published) or past the array; a bound
    # below 16 leaves entries stale. Decoding through the racy row may still give the right bits
    # (the same values, or a fault first), so this reads the source.
    problems = staging_problems(read(kernel_root, DOT_HEADER), read(kernel_root, nvfp4_gemv.SOURCE),
                                KERNELS_CALLING_THE_PARTIAL)
    assert_no_problems(problems, "stage exactly the 16 entries of E2M1_LUT, entry i by thread i")
