"""Paged attention over a KV pool past 2^31 elements: the kernels' page addresses in 64 bits.

A serving engine's pool is tens of gigabytes: at Gemma 4 26B-A4B's global layers (2 KV heads
of 512) a page of 16 keys is 16,384 bf16 elements, so page 131072 starts at 2^31 elements
(4 GiB) and a page id times the page's elements no longer fits an int. Here one 4.3 GB pool
holds a decode batch's pages on both sides of that page and a prefill chunk's at the far end;
the rest of the pool is never initialised (nothing may read it). Each launch is checked against
the exact anchor of the sweep (oracles.paged_attention, "ladders"): every row copies its
winner's row, as on a small pool. K and V are one buffer (a pool of 4.3 GB, not two): the copied
row is then the winner's K row, one ladder level a key, so a row read from any other key, page
or kv head shows. Both decode merges and the page map run, decode and prefill.

A 32-bit page address wraps 4 GiB below the pool: a fault there (or another row read) fails
this gate by its own assertion (`guard_must_not_fire`), since reading the right page is its claim.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from gates._paged_attention import DeviceCase, DevicePool, LADDER_SEED, run_paged_decode, run_paged_prefill
from harness import assert_bits_eq
from harness.core.device import guard_must_not_fire
from harness.library import buffers
from harness.library.dtypes import bf16, bits_of
from kernels_cu import paged_attention as pa
from oracles import paged_attention as ora

# Gemma 4 26B-A4B's global layers (config.json: num_attention_heads 16, num_global_key_value_heads 2,
# global_head_dim 512, no sliding window); a prefill chunk of a sliding layer's window too.
HD, NH, NKV = 512, 16, 2
PAGE_ELEMENTS = NKV * pa.PAGE * HD                  # 16,384: page 131072 starts at 2^31
FIRST_PAST = buffers.INDEX_32 // PAGE_ELEMENTS
DECODE_QPOS = (700, 333, 40)                        # three sequences, no window: 44 + 21 + 3 span pages
PREFILL_ROWS, PREFILL_WINDOW = tuple(range(260, 300)), 100


def decode_plan() -> ora.LadderPlan:
    return ora.ladder_plan(HD, NH, NKV, 0, [(q,) for q in DECODE_QPOS], seed=LADDER_SEED)


def prefill_plan() -> ora.LadderPlan:
    return ora.ladder_plan(HD, NH, NKV, PREFILL_WINDOW, [PREFILL_ROWS], seed=LADDER_SEED, prefix=2)


def placement(decode: ora.LadderPlan, prefill: ora.LadderPlan) -> tuple[int, int, int]:
    """(where the decode plan's pages start, where the prefill plan's start, the pool's pages):
    the decode pages straddle page FIRST_PAST (half below 2^31 elements, half past), the prefill
    pages end the pool, a thousand pages further."""
    decode_at = FIRST_PAST - decode.num_pages // 2
    prefill_at = FIRST_PAST + 1000
    return decode_at, prefill_at, prefill_at + prefill.num_pages


def _k_is_v(case: ora.Case) -> ora.Case:
    return replace(case, v_pool=case.k_pool)


def _moved(case: ora.Case, at: int, big) -> DeviceCase:
    """The case's device arrays over the big pool, its block table renumbered by `at` (0: the
    case's own page numbers, for a launch through a page map)."""
    dev = lambda a: buffers.to_device(a, bits=True)  # noqa: E731
    return DeviceCase(case, dev(case.q), big, big, dev(case.bt + np.int32(at)), dev(case.off), dev(case.qpos))


@pytest.mark.gpu
@pytest.mark.anchor
@pytest.mark.names_faults  # a 32-bit page address faults below the pool: this gate fails by its own assertion
def test_paged_attention_copies_each_rows_ladder_winner_from_a_pool_past_2_31_elements():
    import cupy

    dplan, pplan = decode_plan(), prefill_plan()
    decode_at, prefill_at, num_pages = placement(dplan, pplan)
    dcase, pcase = _k_is_v(ora.ladder_case(dplan, 0)), _k_is_v(ora.ladder_case(pplan, 1))
    with buffers.device_memory(num_pages * PAGE_ELEMENTS * 2 + (1 << 28), "a paged-attention pool of 2.16e9 bf16 "
                               "elements"):
        big = cupy.empty((num_pages, NKV, pa.PAGE, HD), dtype=cupy.uint16)   # only the plans' pages written
        big[decode_at:decode_at + dplan.num_pages] = cupy.asarray(bits_of(dcase.k_pool))
        big[prefill_at:prefill_at + pplan.num_pages] = cupy.asarray(bits_of(pcase.k_pool))
        pmap = DevicePool(big, big, buffers.to_device(np.arange(decode_at, decode_at + dplan.num_pages, dtype=np.int32)))
        ppmap = DevicePool(big, big, buffers.to_device(np.arange(prefill_at, prefill_at + pplan.num_pages,
                                                                 dtype=np.int32)))
        claim = (f"paged attention reads pages {decode_at}..{prefill_at + pplan.num_pages - 1} of a pool past 2^31 "
                 "elements")
        with guard_must_not_fire(claim):
            got = {
                "decode, last-CTA merge": run_paged_decode(_moved(dcase, decode_at, big), merge="last_cta"),
                "decode, combine kernel, page map": run_paged_decode(_moved(dcase, 0, big), merge="combine",
                                                                     pool=pmap),
                "prefill": run_paged_prefill(_moved(pcase, prefill_at, big)),
                "prefill, page map": run_paged_prefill(_moved(pcase, 0, big), pool=ppmap),
            }
    for name, out in got.items():
        case = dcase if name.startswith("decode") else pcase
        assert_bits_eq(f"{name} out [row, head, dim] from pages past 2^31 (the ladder's winners)", out,
                       ora.copy_rows(case), dtype=bf16)
