"""Paged decode (split-K) gates.

Chain: the needle anchors (exact, host copy of one V row) certify split-K decode with the
launcher's split count and the last-CTA merge; links carry that to every other split count,
to the combine kernel, to a permuted pool behind a page map, and to a second launch on the
same counters. The float64 reference anchors the arithmetic on random inputs (tolerance).
See docs/paged_attention.md.
"""

import numpy as np
import pytest

from harness import assert_bits_eq
from harness.library import buffers
from harness.library.dtypes import bf16
from kernels_cu import paged_attention as pa
from oracles import paged_attention as ora

from gates._paged_attention import (NEEDLE_HEADS, NEEDLE_SEED, OUT_SENTINEL, assert_near_reference, chosen_splits,
                                    decode_config, edge_case, engine_scale, host_arrays, needle_case, new_counters,
                                    permuted_device_pool, reference_of, run_paged_decode, run_paged_decode_guarded,
                                    to_device)

__all__ = ["decode_config"]   # the shared fixture, imported for pytest

NEEDLE_IDS = [f"w{w}-{k}" for w, k in ora.NEEDLE_CASES]
SPLIT_LINK_KINDS = ("last_visible", "window_just_outside")


def needle_device_case(hd, window, kind):
    return to_device(needle_case(hd, window, kind))


@pytest.mark.gpu
@pytest.mark.anchor
@pytest.mark.parametrize("window, kind", ora.NEEDLE_CASES, ids=NEEDLE_IDS)
@pytest.mark.parametrize("hd", pa.HEAD_SIZES, ids=lambda hd: f"hd{hd}")
def test_decode_output_is_the_needle_v_row_bit_for_bit(hd, window, kind):
    dc = needle_device_case(hd, window, kind)
    assert_bits_eq(f"decode out [row, head, dim] ({kind}, window {window}, splits {chosen_splits(dc.host)})",
                   run_paged_decode(dc), ora.copy_rows(dc.host), dtype=bf16)


@pytest.mark.gpu
@pytest.mark.anchor
@pytest.mark.parametrize("hd", pa.HEAD_SIZES, ids=lambda hd: f"hd{hd}")
def test_decode_output_of_twin_needles_is_their_v_rows_mean_rounded_once(hd):
    # Two keys tie at the top (the first visible key and qpos, window 70: pages apart, so in
    # different warps or splits): weights exactly 1 and 1, l = 2, acc = v1 + v2 exact, and the
    # output is bf16((v1 + v2) / 2), nearest even. A single needle is a copy (v / 1): it cannot
    # see the division by l, a weight other than 1 for the second key, or the output rounding
    # (here about half the elements round, a quarter are ties). Both merges run.
    case = ora.twin_needle_case(hd=hd, window=ora.NEEDLE_WINDOW, seed=NEEDLE_SEED, **NEEDLE_HEADS)
    dc = to_device(case)
    expected = ora.mean_rows(case)
    for merge in ("last_cta", "combine"):
        assert_bits_eq(f"decode out [row, head, dim] (twin needles, {merge} merge, splits {chosen_splits(case)})",
                       run_paged_decode(dc, merge=merge), expected, dtype=bf16)


@pytest.mark.gpu
@pytest.mark.link
@pytest.mark.parametrize("kind", SPLIT_LINK_KINDS)
@pytest.mark.parametrize("hd", pa.HEAD_SIZES, ids=lambda hd: f"hd{hd}")
def test_every_split_count_sees_the_same_needle_bits(hd, kind):
    dc = needle_device_case(hd, ora.NEEDLE_WINDOW, kind)
    chosen = chosen_splits(dc.host)
    certified = run_paged_decode(dc)
    # One claim over the launcher's whole range; every differing split count is named.
    failures = []
    for splits in range(1, pa.MAX_SPLITS + 1):
        try:
            assert_bits_eq(f"decode out with splits={splits} vs the launcher's splits={chosen}",
                           run_paged_decode(dc, splits=splits), certified, dtype=bf16)
        except AssertionError as exc:
            failures.append(str(exc))
    assert not failures, f"{len(failures)} of {pa.MAX_SPLITS} split counts differ:\n" + "\n".join(failures)


@pytest.mark.gpu
@pytest.mark.link
def test_combine_kernel_equals_last_cta_merge_bitwise(decode_config):
    _, dc = decode_config
    assert_bits_eq(f"decode out, combine kernel vs last-CTA merge (splits {chosen_splits(dc.host)})",
                   run_paged_decode(dc, merge="combine"), run_paged_decode(dc, merge="last_cta"), dtype=bf16)


@pytest.mark.gpu
@pytest.mark.link
def test_decode_page_mapped_pool_equals_identity_pool_bitwise(decode_config):
    _, dc = decode_config
    assert_bits_eq("decode out, permuted pool with NaN null page vs identity pool",
                   run_paged_decode(dc, pool=permuted_device_pool(dc.host)), run_paged_decode(dc), dtype=bf16)


@pytest.mark.gpu
@pytest.mark.link
def test_decode_run_twice_on_the_same_counters_is_bitwise_identical(decode_config):
    _, dc = decode_config
    counters = new_counters(dc.host)
    first = run_paged_decode(dc, counters=counters)
    assert_bits_eq("decode out, second launch on the same ticket counters vs the first",
                   run_paged_decode(dc, counters=counters), first, dtype=bf16)
    assert_bits_eq("ticket counters after two launches (the merging CTA resets them)",
                   counters.get(), np.zeros(dc.host.rows * dc.host.nh, np.int32))


@pytest.mark.memory_safety
@pytest.mark.gpu
@pytest.mark.link
def test_decode_never_follows_a_block_table_entry_outside_every_window(decode_config):
    # Every entry no row may see (before the sliding window, past the
    # context) is set to a page 2^30, outside any pool: the bits must not change. The NaN page of
    # the page-map link proves a masked key is not *used*; this proves its entry is not
    # *followed*. A kernel that follows one faults (a memory-safety kill, route trap).
    name, dc = decode_config
    invalid = ora.with_invalid_unseen_entries(dc.host)
    unseen = ora.unseen_entries(dc.host)
    first_page = int(ora.first_visible(dc.host.qpos, dc.host.window).min()) // pa.PAGE
    assert unseen[-1] and (first_page == 0 or unseen[first_page - 1]), (
        f"{name}: the entries just past the context and just before the earliest window must be invalid")
    # Behind a page map first: decode reads a block-table entry before it knows whether any key
    # of that page is visible, so a kernel that walks one entry too many but masks all of its
    # keys touches no pool memory; through the map, the entry itself is dereferenced
    # (pmap[2^30]) and faults at the first one (a page walk that runs away, rather than
    # walking on through mapped memory in the plain launch until the deadline).
    pool = permuted_device_pool(dc.host)
    assert_bits_eq(f"decode out {name}, unseen entries invalid vs valid, behind a page map",
                   run_paged_decode(to_device(invalid), pool=pool), run_paged_decode(dc, pool=pool), dtype=bf16)
    assert_bits_eq(f"decode out {name}, {int(unseen.sum())} unseen block-table entries invalid vs valid",
                   run_paged_decode(to_device(invalid)), run_paged_decode(dc), dtype=bf16)


@pytest.mark.memory_safety
@pytest.mark.gpu
@pytest.mark.link
def test_decode_writes_nothing_outside_its_output_in_either_merge(decode_config):
    # Both merges (the last CTA's, with ticket counters; the combine kernel's, with none) into an
    # output between sentinel guards, against the certified last-CTA run: a row or head off by
    # one stores into a guard (by assertion); a merge that follows the null counters of the
    # combine path, or a (row, head) index wrapped below zero, faults, and a fault here is this
    # gate's verdict (docs/mutation.md, Verdicts).
    name, dc = decode_config
    certified = run_paged_decode(dc)
    for merge in ("combine", "last_cta"):
        got, whole = run_paged_decode_guarded(dc, merge=merge)
        assert_bits_eq(f"decode out {name}, {merge} merge into a guarded output vs the certified run",
                       got, certified, dtype=bf16)
        buffers.assert_guards_untouched(f"decode out {name} ({merge} merge)", whole, OUT_SENTINEL)


@pytest.mark.gpu
@pytest.mark.anchor
@pytest.mark.parametrize("window", ora.EDGE_WINDOWS, ids=lambda w: f"w{w}")
def test_decode_rows_whose_window_starts_at_a_page_edge_copy_their_first_visible_key(window):
    # Window-edge case (oracles.paged_attention.window_edge_case): rows whose first visible key
    # fv sits at 0, 1, 2, 3 and 15 mod 16, on a falling staircase (every earlier key is a
    # stronger decoy, the winner is fv). The kernel uses fv only as the page fv / 16: a page
    # walk that starts one page late (fv = 15 mod 16) drops the winner. Window 1: one key per
    # row with the scores +-FLT_MAX, 0, -1, -120, +-2^126, -2^-60 (one per head): a copy
    # whatever the score, unless the empty softmax state's max (-inf) collides with a score.
    case = edge_case("decode", window)
    assert_bits_eq(f"decode out [row, head, dim] (window edge, window {window}, splits {chosen_splits(case)})",
                   run_paged_decode(to_device(case)), ora.copy_rows(case), dtype=bf16)


@pytest.mark.memory_safety
@pytest.mark.gpu
@pytest.mark.link
@pytest.mark.parametrize("window", ora.EDGE_WINDOWS, ids=lambda w: f"w{w}")
def test_decode_never_follows_an_entry_before_a_window_that_starts_at_a_page_edge(window):
    # On the window-edge rows: the entries before each sequence's first
    # visible page (and the spare past it) are invalid. A page walk that starts one page early
    # (fv - 1 at fv = 0 mod 16, fv - 2 at 0 or 1 mod 16, or from page 0 at window 1) follows one:
    # behind the page map it dereferences pmap[2^30] and faults (a memory-safety kill, route
    # trap); its keys are all masked, so no value could show it.
    case = edge_case("decode", window)
    unseen = ora.unseen_entries(case)
    assert unseen[case.off[1]] and unseen[case.off[3] + 1], "the pages before fv 16 and fv 33 must be invalid"
    dc, invalid = to_device(case), to_device(ora.with_invalid_unseen_entries(case))
    pool = permuted_device_pool(case)  # behind the page map first, as above
    assert_bits_eq(f"decode out (window edge, window {window}), unseen entries invalid vs valid, behind a page map",
                   run_paged_decode(invalid, pool=pool), run_paged_decode(dc, pool=pool), dtype=bf16)
    assert_bits_eq(f"decode out (window edge, window {window}), {int(unseen.sum())} unseen entries invalid vs valid",
                   run_paged_decode(invalid), run_paged_decode(dc), dtype=bf16)


@pytest.mark.gpu
@pytest.mark.anchor
def test_decode_split_partials_each_hold_the_first_visible_key_of_their_chunk():
    # The output cannot see how pages are shared out among the splits (each page lands in one
    # split whatever the plan; only the f32 association order changes). The partials can: on
    # the falling staircase (window 70) a split's partial is exactly (score, 1, V row) of its
    # chunk's first visible key, or (-inf, 0, 0) for an empty chunk, so the scratch shows the
    # documented plan (ceil(pages / splits) pages a split, from the window's first page) for
    # every split count the launcher may choose. A plan that piles pages onto the first splits
    # (split_pages' survivors) idles the CTAs the launcher asked for.
    case = edge_case("decode", 70)
    dc = to_device(case)
    failures = []
    for splits in range(1, pa.MAX_SPLITS + 1):
        _, parts = run_paged_decode(dc, splits=splits, merge="combine", partials=True)
        try:
            assert_bits_eq(f"decode split partials [row, head, split, (m, l, acc)] with splits={splits}",
                           parts, ora.split_partials(case, splits))
        except AssertionError as exc:
            failures.append(str(exc))
    assert not failures, f"{len(failures)} of {pa.MAX_SPLITS} split counts differ:\n" + "\n".join(failures)


@pytest.mark.gpu
@pytest.mark.anchor
def test_decode_matches_float64_reference_within_rel_rms_1e_2(decode_config):
    name, dc = decode_config
    assert_near_reference(f"decode {name}", run_paged_decode(dc), reference_of(name, "decode"))


@pytest.mark.gpu
@pytest.mark.anchor
def test_decode_matches_float64_reference_at_the_engines_softmax_scale(decode_config):
    # Every other gate passes scale 1, where a kernel that divides the scores by the scale (or
    # drops it) agrees; engines pass 1 / sqrt(head size). The same random rows and the same
    # bound as the reference anchor above: at scale 1/16 the softmax is flatter, every output
    # still one bf16 rounding of an f32 accumulation. A kernel that divides puts 256 times the
    # logit spread into the exponent: rel_rms about 29 against the reference (host-computed).
    name, dc = decode_config
    scale = engine_scale(dc.host.hd)
    assert_near_reference(f"decode {name}", run_paged_decode(dc, scale=scale), reference_of(name, "decode", scale),
                          scale)


# ------------------------------------------------------------------ refusals (no device)


def _decode(**changes):
    args = host_arrays()
    rows, nh, hd = args["q"].shape
    args.update(scratch=np.zeros(pa.decode_scratch_floats(rows, nh, 2, hd), np.float32), splits=2,
                counters=np.zeros(rows * nh, np.int32), pmap=None, window=0)
    args.update(changes)
    pa.paged_decode(args.pop("out"), args.pop("q"), args.pop("k_pool"), args.pop("v_pool"), args.pop("bt"),
                    args.pop("off"), args.pop("qpos"), **args)


@pytest.mark.refusal
def test_decode_refuses_a_head_size_other_than_256_and_512():
    a = host_arrays(hd=128)
    with pytest.raises(ValueError, match="head size 128 is not supported"):
        _decode(**a)


@pytest.mark.refusal
def test_decode_refuses_scratch_smaller_than_rows_heads_splits():
    rows, nh, hd = host_arrays()["q"].shape
    short = np.zeros(pa.decode_scratch_floats(rows, nh, 2, hd) - 1, np.float32)
    with pytest.raises(ValueError, match="scratch holds .* need .*; allocate decode_scratch_floats"):
        _decode(scratch=short)


@pytest.mark.refusal
def test_decode_refuses_a_negative_window():
    with pytest.raises(ValueError, match="window must be a non-negative int"):
        _decode(window=-1)


@pytest.mark.refusal
def test_decode_refuses_a_two_dimensional_block_table():
    with pytest.raises(ValueError, match="block table must be a non-empty 1-D int32 array"):
        _decode(bt=np.zeros((2, 2), np.int32))


@pytest.mark.refusal
def test_decode_refuses_splits_outside_the_kernel_range():
    with pytest.raises(ValueError, match=f"splits must be an int in 1..{pa.MAX_SPLITS}"):
        _decode(splits=pa.MAX_SPLITS + 1)
