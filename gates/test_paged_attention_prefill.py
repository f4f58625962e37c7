"""Paged prefill gates.

Chain: staircase anchors (exact: each row's output is one V row the host copies out of the
pool) certify prefill's causal and sliding-window masks on every row of a context; the page-map
link carries that to a permuted pool with a NaN null page; the float64 reference anchors the
arithmetic on random inputs (tolerance). See docs/paged_attention.md.
"""

import numpy as np
import pytest

from harness import assert_bits_eq
from harness.library.dtypes import bf16
from kernels_cu import paged_attention as pa
from oracles import paged_attention as ora

from gates._paged_attention import (CONFIGS, STAIR_WINDOW, assert_near_reference, config_id, edge_case, engine_scale,
                                    host_arrays, permuted_device_pool, random_case, reference_of, run_paged_prefill,
                                    staircase_case, to_device)

WINDOWS = (0, STAIR_WINDOW)


@pytest.fixture(scope="module", params=sorted(CONFIGS), ids=config_id)
def prefill_config(request):
    """(config name, device copy of every position of its context as prefill rows)."""
    return request.param, to_device(random_case(request.param, "prefill"))


@pytest.fixture(scope="module", params=sorted(CONFIGS), ids=config_id)
def chunk_config(request):
    """(config name, device copy of its last CHUNK_ROWS positions: a chunked prefill)."""
    return request.param, to_device(random_case(request.param, "chunk"))


def staircase_out(hd, window, rising):
    case = staircase_case(hd, window, rising)
    return run_paged_prefill(to_device(case)), ora.copy_rows(case)


@pytest.mark.gpu
@pytest.mark.anchor
@pytest.mark.parametrize("window", WINDOWS, ids=lambda w: f"w{w}")
@pytest.mark.parametrize("hd", pa.HEAD_SIZES, ids=lambda hd: f"hd{hd}")
def test_prefill_each_row_copies_the_v_row_of_its_last_visible_key(hd, window):
    got, expected = staircase_out(hd, window, rising=True)
    assert_bits_eq(f"prefill out [row, head, dim], rising staircase, window {window}", got, expected, dtype=bf16)


@pytest.mark.gpu
@pytest.mark.anchor
@pytest.mark.parametrize("window", WINDOWS, ids=lambda w: f"w{w}")
@pytest.mark.parametrize("hd", pa.HEAD_SIZES, ids=lambda hd: f"hd{hd}")
def test_prefill_each_row_copies_the_v_row_of_its_first_visible_key(hd, window):
    got, expected = staircase_out(hd, window, rising=False)
    assert_bits_eq(f"prefill out [row, head, dim], falling staircase, window {window}", got, expected, dtype=bf16)


# A first row one page minus (rows a tile - 1) in: every tile's last row sits one page past its
# first row's (rows 9..16 at hd 256, 8 a tile; 13..16 at hd 512, 4 a tile), so a tile's page
# range must come from its last row, not its first.
MID_PAGE_START = {hd: ora.PAGE + 1 - pa.prefill_rows_per_tile(hd) for hd in pa.HEAD_SIZES}


@pytest.mark.gpu
@pytest.mark.anchor
@pytest.mark.parametrize("hd", pa.HEAD_SIZES, ids=lambda hd: f"hd{hd}")
def test_prefill_rows_starting_mid_page_copy_the_v_row_of_their_last_visible_key(hd):
    case = staircase_case(hd, 0, rising=True, start=MID_PAGE_START[hd])
    assert_bits_eq(f"prefill out [row, head, dim], rising staircase from row {MID_PAGE_START[hd]} (mid-page)",
                   run_paged_prefill(to_device(case)), ora.copy_rows(case), dtype=bf16)


@pytest.mark.gpu
@pytest.mark.anchor
@pytest.mark.parametrize("window", WINDOWS, ids=lambda w: f"w{w}")
@pytest.mark.parametrize("hd", pa.HEAD_SIZES, ids=lambda hd: f"hd{hd}")
def test_prefill_paired_staircase_rows_average_their_two_tied_keys(hd, window):
    # Rising staircase with keys 2i and 2i + 1 on one level: an odd row's last two keys tie
    # (weights exactly 1 and 1), so its output is bf16((v[q - 1] + v[q]) / 2), nearest even; an
    # even row's last key stands alone (a copy). The copies above cannot see the division by l,
    # the second key's weight or the output rounding; this can, on 100 rows of 200.
    case = staircase_case(hd, window, rising=True, paired=True)
    assert_bits_eq(f"prefill out [row, head, dim], paired staircase, window {window}",
                   run_paged_prefill(to_device(case)), ora.mean_rows(case), dtype=bf16)


@pytest.mark.gpu
@pytest.mark.link
def test_prefill_page_mapped_pool_equals_identity_pool_bitwise(chunk_config):
    _, dc = chunk_config
    assert_bits_eq("chunked prefill out, permuted pool with NaN null page vs identity pool",
                   run_paged_prefill(dc, pool=permuted_device_pool(dc.host)), run_paged_prefill(dc), dtype=bf16)


@pytest.mark.memory_safety
@pytest.mark.gpu
@pytest.mark.link
def test_prefill_never_follows_a_block_table_entry_outside_every_window(chunk_config):
    # For the chunked prefill: entries before the chunk's windows and the
    # spare page past the context are set to a page 2^30, outside any pool; the bits must not
    # change, and a kernel that follows one faults (a memory-safety kill, route trap).
    name, dc = chunk_config
    unseen = ora.unseen_entries(dc.host)
    assert unseen[-1], f"{name}: the spare entry past the context must be invalid"
    assert_bits_eq(f"chunked prefill out {name}, {int(unseen.sum())} unseen block-table entries invalid vs valid",
                   run_paged_prefill(to_device(ora.with_invalid_unseen_entries(dc.host))),
                   run_paged_prefill(dc), dtype=bf16)


@pytest.mark.gpu
@pytest.mark.anchor
@pytest.mark.parametrize("window", ora.EDGE_WINDOWS, ids=lambda w: f"w{w}")
def test_prefill_rows_whose_window_starts_at_a_page_edge_copy_their_first_visible_key(window):
    # The window-edge case as prefill: five sequences (so five tiles, each inside one sequence's
    # block-table row), rows latest first, so a tile's first page comes from its last row and
    # one-row tiles have idle warps. Each row copies its first visible key's V row; window 1
    # gives that key an extreme score per head (see the decode twin).
    case = edge_case("prefill", window)
    assert_bits_eq(f"prefill out [row, head, dim] (window edge, window {window})",
                   run_paged_prefill(to_device(case)), ora.copy_rows(case), dtype=bf16)


@pytest.mark.memory_safety
@pytest.mark.gpu
@pytest.mark.link
@pytest.mark.parametrize("window", ora.EDGE_WINDOWS, ids=lambda w: f"w{w}")
def test_prefill_never_follows_an_entry_before_a_window_that_starts_at_a_page_edge(window):
    # On the window-edge tiles: a tile that stages one page before its
    # first visible page follows an invalid entry and faults (a memory-safety kill, route trap).
    case = edge_case("prefill", window)
    unseen = ora.unseen_entries(case)
    assert unseen[case.off[1]] and unseen[case.off[3] + 1], "the pages before fv 16 and fv 33 must be invalid"
    assert_bits_eq(f"prefill out (window edge, window {window}), {int(unseen.sum())} unseen entries invalid vs valid",
                   run_paged_prefill(to_device(ora.with_invalid_unseen_entries(case))),
                   run_paged_prefill(to_device(case)), dtype=bf16)


@pytest.mark.gpu
@pytest.mark.anchor
def test_prefill_matches_float64_reference_within_rel_rms_1e_2(prefill_config):
    name, dc = prefill_config
    assert_near_reference(f"prefill {name}", run_paged_prefill(dc), reference_of(name, "prefill"))


@pytest.mark.gpu
@pytest.mark.anchor
def test_prefill_matches_float64_reference_at_the_engines_softmax_scale(chunk_config):
    # As the decode twin: every other gate passes scale 1. The chunked prefill's 100 rows (a
    # reference as cheap as the decode rows'), at 1 / sqrt(head size), the same bound.
    name, dc = chunk_config
    scale = engine_scale(dc.host.hd)
    assert_near_reference(f"prefill {name}", run_paged_prefill(dc, scale=scale), reference_of(name, "chunk", scale),
                          scale)


# ------------------------------------------------------------------ refusals (no device)


def _prefill(tiles=None, **changes):
    args = dict(host_arrays(), pmap=None, window=0)
    args.update(changes)
    hd = args["q"].shape[2]
    if tiles is None:
        tiles = pa.make_tiles(np.zeros(args["q"].shape[0], np.int32), pa.prefill_rows_per_tile(hd)
                              if hd in pa.HEAD_SIZES else 1)
    pa.paged_prefill(args.pop("out"), args.pop("q"), args.pop("k_pool"), args.pop("v_pool"), args.pop("bt"),
                     args.pop("off"), args.pop("qpos"), tiles, **args)


@pytest.mark.refusal
def test_prefill_refuses_a_head_size_other_than_256_and_512():
    with pytest.raises(ValueError, match="head size 64 is not supported"):
        _prefill(**host_arrays(hd=64))


@pytest.mark.refusal
def test_prefill_refuses_tiles_with_more_rows_than_the_kernel_stages():
    rows = pa.prefill_rows_per_tile(256) + 1
    a = host_arrays(rows=rows)
    with pytest.raises(ValueError, match=f"a tile holds {rows} rows but the hd 256 kernel stages {rows - 1} rows per tile"):
        _prefill(tiles=pa.make_tiles(np.zeros(rows, np.int32), rows), **a)


@pytest.mark.refusal
def test_prefill_refuses_a_window_that_is_not_a_non_negative_int():
    with pytest.raises(ValueError, match="window must be a non-negative int"):
        _prefill(window=2.5)


@pytest.mark.refusal
def test_prefill_refuses_a_block_table_that_is_not_int32():
    with pytest.raises(ValueError, match="block table must be a contiguous 1-D int32 array"):
        _prefill(bt=np.arange(4, dtype=np.int64))
