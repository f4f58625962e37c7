"""Structural gate over qk_rope.cu: each warp's staging row is published and released.

It reads the `.cu` of the ACTIVE kernel root (a control's or mutant's sandbox) through
harness.library.source and needs no GPU.

Each warp owns one row of `stage_all` in shared memory. A helper that takes it (`rope`,
`store_pool_row`: a `float* stage` parameter) has every lane store its values into the row
and then read values other lanes stored (the rotation's partner `d + half`, the coalesced
store's transposed element). Two `__syncwarp()` make that correct: one between the last
store and the first read (the other lanes' values are published), and one after the last
read (the row is released: the warp's next helper stores into the same row while a lane
may still be reading it). Dropped, each is a race the GPU happens to order (a converged
warp's shared-memory accesses run in program order), so no numeric gate can see it.
"""

from __future__ import annotations

import re

import pytest

from harness.library.source import function, read_source
from kernels_cu import qk_rope

pytestmark = pytest.mark.structural

STAGE = "stage"
HELPERS = ("rope", "store_pool_row")  # the helpers that take a warp's staging row
SYNC = re.compile(r"(?<!\w)__syncwarp\s*\(")


def _accesses(body: str):
    """(stores, reads) of `stage[...]` in `body`: offsets of each subscript."""
    stores, reads = [], []
    for m in re.finditer(rf"(?<![\w.]){STAGE}\s*\[", body):
        depth, i = 1, m.end()
        while depth and i < len(body):
            depth += {"[": 1, "]": -1}.get(body[i], 0)
            i += 1
        after = body[i:i + 3].lstrip()
        (stores if after.startswith("=") and not after.startswith("==") else reads).append(m.start())
    return stores, reads


def test_qk_rope_stage_row_is_published_and_released_by_the_warp(kernel_root):
    text = read_source(kernel_root / qk_rope.SOURCE)
    problems = []
    for name in HELPERS:
        fn = function(text, name)
        if not re.search(rf"float\s*\*\s*{STAGE}\b", fn.params):
            problems.append(f"{qk_rope.SOURCE} line {fn.line}: `{name}` takes no `float* {STAGE}`; this gate reads "
                            "the helpers that stage a warp's row")
            continue
        body = fn.body
        stores, reads = _accesses(body)
        syncs = [m.start() for m in SYNC.finditer(body)]

        def line(offset: int) -> int:
            return fn.body_line + body.count("\n", 0, offset)

        if not stores or not reads:
            problems.append(f"{qk_rope.SOURCE} line {fn.line}: `{name}` stores {len(stores)} and reads {len(reads)} "
                            f"`{STAGE}[...]`; it must stage the row and read it back")
            continue
        last_store = max(stores)
        later = [r for r in reads if r > last_store]
        if not later:
            problems.append(f"{qk_rope.SOURCE} line {line(last_store)}: `{name}` reads no `{STAGE}[...]` after its "
                            "last store")
            continue
        first_read, last_read = min(later), max(reads)
        if not any(last_store < s < first_read for s in syncs):
            problems.append(f"{qk_rope.SOURCE} line {line(first_read)}: `{name}` reads `{STAGE}[...]` after the "
                            f"lanes' stores (line {line(last_store)}) with no __syncwarp() between: the row is not "
                            "published")
        if not any(s > last_read for s in syncs):
            problems.append(f"{qk_rope.SOURCE} line {line(last_read)}: `{name}` returns after its last `{STAGE}[...]` "
                            "read with no __syncwarp(): the warp's next helper restages the row while a lane may "
                            "still read it")
    assert not problems, "\n".join([*problems, "  publish a staged row with __syncwarp() before reading other "
                                               "lanes' values, and release it with __syncwarp() before returning"])
