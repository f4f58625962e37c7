"""QK RMSNorm + RoPE into a KV pool past 2^31 elements: the paged arms' addresses in 64 bits.

A serving engine's pool is tens of gigabytes: one Gemma 4 26B-A4B sliding-layer page of 16
positions holds 30 layers x (K, V) x 8 KV heads x 256 = 1,966,080 bf16 elements, so page 1093
starts past 2^31 elements (4 GiB of bf16) and a page id times the page stride no longer fits an
int. Here the request's window lies at the far end of a 4.3 GB pool of 1100 such pages: pages
1090 and 1091 wholly below 2^31, page 1092 below it but its last layer (the one written) past
it, pages 1093 to 1097 past it by the page term alone. The chain is the fixed gates' (flat arm ->
paged prefill at layout addresses -> paged decode equals prefill), checked bitwise over the
pages around the window; the rest of the pool is never initialised (nothing may touch it).

A 32-bit address wraps below the pool: a fault there (or a store somewhere else) fails this gate
by its own assertion (`guard_must_not_fire`), since landing at the right address is its claim.
"""

from __future__ import annotations

import numpy as np
import pytest

from gates import _qk_rope as qk
from harness.core.device import guard_must_not_fire
from harness.library import buffers
from harness.library.bits import assert_bits_eq
from harness.library.dtypes import bf16
from oracles import qk_rope as design
from oracles.paged_layout import PagedKvLayout

# Gemma 4 26B-A4B's sliding layers (config.json: num_attention_heads 16, num_key_value_heads 8,
# head_dim 256 with full rotary, num_hidden_layers 30), in pages of 16 positions.
HD, ROTARY, NQ, NKV, LAYERS, PAGE = 256, 256, 16, 8, 30, 16
NUM_PAGES = 1100
START_POS, TOKENS = 325, 100                 # positions 325 .. 424: logical pages 20 .. 26
WINDOW = (1097, 1090, 1093, 1091, 1096, 1092, 1094)
JUNK = 1095                                  # the decode CSR's lead entry: a page no token names
REGION = range(1089, NUM_PAGES)              # zeroed and checked: the window and the pages around it
SCENARIO = design.PagedScenario(page_size=PAGE, num_layers=LAYERS, layer=LAYERS - 1, num_pages=NUM_PAGES,
                                start_pos=START_POS, num_tokens=TOKENS, page_origin=START_POS // PAGE,
                                window=WINDOW, junk_page=JUNK)
LAYOUT = PagedKvLayout(page_size=PAGE, num_layers=LAYERS, nkv=NKV, head_dim=HD, num_pages=NUM_PAGES)


def _region_image(flat_k, flat_v) -> np.ndarray:
    """The expected REGION pages: the flat arm's K and V bits at the layout's addresses, zero
    elsewhere (the layout of the REGION pages alone, page p as p - REGION.start)."""
    local = PagedKvLayout(page_size=PAGE, num_layers=LAYERS, nkv=NKV, head_dim=HD, num_pages=len(REGION))
    positions = SCENARIO.positions
    pages = [LAYOUT.page_of(int(p), WINDOW, SCENARIO.page_origin) - REGION.start for p in positions]
    return local.image(SCENARIO.layer, pages, positions, flat_k, flat_v)


@pytest.mark.gpu
@pytest.mark.link
@pytest.mark.names_faults  # a 32-bit address faults below the pool: this gate fails by its own assertion
def test_paged_prefill_and_decode_land_at_layout_addresses_past_2_31_pool_elements():
    import cupy

    data = qk._build(HD, ROTARY, True, num_tokens=TOKENS, nq=NQ, nkv=NKV, cos_max_pos=START_POS + TOKENS)
    flat_q, flat_k, flat_v = (qk.host(a) for a in qk.flat_arm(data, SCENARIO.positions))
    h = data.host
    assert_bits_eq("q_out (flat vs closed form)", flat_q,
                   design.closed_form(h["q"], h["q_w"], SCENARIO.positions, h["cos"], h["sin"], ROTARY))
    image = _region_image(flat_k, flat_v)
    stride = LAYOUT.page_stride
    lo, hi = REGION.start * stride, REGION.stop * stride
    with buffers.device_memory(2 * LAYOUT.pool_elements + (1 << 28), "a QK-RoPE KV pool of 2.16e9 bf16 elements"):
        raw = cupy.empty(LAYOUT.pool_elements, dtype=cupy.uint16)   # never initialised but around the window
        pool = raw.view(bf16)
        claim = f"QK-RoPE writes pages {min(WINDOW)}..{max(WINDOW)} of a pool past 2^31 elements at their addresses"
        with guard_must_not_fire(claim):
            raw[lo:hi] = 0
            prefill_q, _ = qk.prefill_arm(data, SCENARIO, pool=pool)
            prefill_region = qk.host(pool[lo:hi])
            raw[lo:hi] = 0
            decode_q, _ = qk.decode_arm(data, SCENARIO, pool=pool)
            decode_region = qk.host(pool[lo:hi])
        assert_bits_eq("q_out (paged prefill vs flat, pool past 2^31)", qk.host(prefill_q), flat_q)
        assert_bits_eq(f"pool pages {REGION.start}..{REGION.stop - 1} past 2^31 (paged prefill vs flat values at "
                       "layout addresses, zero elsewhere)", prefill_region, image)
        assert_bits_eq("q_out (paged decode vs paged prefill, pool past 2^31)", qk.host(decode_q), qk.host(prefill_q))
        assert_bits_eq(f"pool pages {REGION.start}..{REGION.stop - 1} past 2^31 (paged decode vs paged prefill)",
                       decode_region, prefill_region)
