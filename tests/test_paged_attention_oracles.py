"""Host-only tests of the paged-attention oracles, builders and launcher plans (no GPU)."""


import numpy as np
import pytest

from harness.library.dtypes import bf16, bits_of
from kernels_cu import paged_attention as pa
from oracles import paged_attention as ora


def _loop_reference(case: ora.Case) -> np.ndarray:
    """Textbook attention, one (row, head) at a time: the oracle's own check on tiny cases."""
    g = case.nh // case.nkv
    out = np.zeros((case.rows, case.nh, case.hd))
    for r in range(case.rows):
        qp = int(case.qpos[r])
        keys = [p for p in range(qp + 1) if case.window == 0 or qp - p < case.window]
        for h in range(case.nh):
            kh = h // g
            rows_k, rows_v = [], []
            for p in keys:
                page = case.bt[case.off[r] + p // 16]
                rows_k.append(case.k_pool[page, kh, p % 16].astype(np.float64))
                rows_v.append(case.v_pool[page, kh, p % 16].astype(np.float64))
            s = np.array([case.q[r, h].astype(np.float64) @ kr for kr in rows_k])
            w = np.exp(s - s.max())
            out[r, h] = (w / w.sum()) @ np.array(rows_v)
    return out


@pytest.mark.parametrize("window", [0, 21])
def test_reference_matches_textbook_attention_on_a_tiny_case(window):
    case = ora.random_case(nh=4, nkv=2, hd=8, window=window, ctx=45, rows=3, seed=1)
    np.testing.assert_allclose(ora.reference(case), _loop_reference(case), rtol=1e-12, atol=1e-12)


def test_reference_reads_through_block_table_offsets():
    case = ora.needle_case(hd=8, nh=4, nkv=2, window=0, kind="last_visible", seed=2)
    np.testing.assert_allclose(ora.reference(case), _loop_reference(case), rtol=1e-12, atol=1e-12)


def test_reference_with_zero_query_averages_the_visible_values():
    case = ora.random_case(nh=2, nkv=1, hd=4, window=5, ctx=30, rows=1, seed=3)
    case = ora.Case(np.zeros_like(case.q), case.k_pool, case.v_pool, case.bt, case.off, case.qpos, case.window)
    v = case.v_pool.astype(np.float64).transpose(1, 0, 2, 3).reshape(1, -1, 4)[0]
    np.testing.assert_allclose(ora.reference(case)[0, 0], v[25:30].mean(axis=0), rtol=1e-12)


@pytest.mark.parametrize("hd", [256, 512])
@pytest.mark.parametrize("window, kind", ora.NEEDLE_CASES, ids=[f"w{w}-{k}" for w, k in ora.NEEDLE_CASES])
def test_needle_wins_the_float64_reference_by_the_documented_gap(hd, window, kind):
    case = ora.needle_case(hd=hd, nh=8, nkv=2, window=window, kind=kind, seed=5)
    # In float64 the other weights are at most exp(-224), far below half an ulp of any |v| >= 1/64,
    # so even the float64 softmax returns the needle row exactly.
    np.testing.assert_array_equal(ora.reference(case), ora.copy_rows(case).astype(np.float64))


@pytest.mark.parametrize("hd", [256, 512])
@pytest.mark.parametrize("window", [0, 37])
@pytest.mark.parametrize("rising", [True, False])
def test_staircase_winner_is_the_float64_reference(hd, window, rising):
    case = ora.staircase_case(hd=hd, nh=4, nkv=2, window=window, rising=rising, seed=7)
    np.testing.assert_array_equal(ora.reference(case), ora.copy_rows(case).astype(np.float64))


def test_needle_values_have_no_zero_so_copies_keep_their_sign():
    case = ora.needle_case(hd=256, nh=8, nkv=2, window=0, kind="first_visible", seed=5)
    assert not np.any(case.v_pool.astype(np.float32) == 0)


def test_permuted_pool_maps_live_pages_to_their_data_and_dead_pages_to_the_nan_page():
    case = ora.random_case(nh=4, nkv=2, hd=8, window=40, ctx=130, rows=3, seed=4)
    k, v, pmap = ora.permuted_pool(case, seed=9)
    live = ora.live_pool_pages(case)
    assert np.all(np.isnan(k[0].astype(np.float32))) and np.all(np.isnan(v[0].astype(np.float32)))
    np.testing.assert_array_equal(bits_of(k[pmap[live]]), bits_of(case.k_pool[live]))
    np.testing.assert_array_equal(bits_of(v[pmap[live]]), bits_of(case.v_pool[live]))
    assert np.all(pmap[~live] == 0)
    assert sorted(pmap[live]) == list(range(1, int(live.sum()) + 1))
    assert not np.any(pmap[live] == np.flatnonzero(live))
    # rows at 127..129 with window 40 see keys 88..129: pages 5..8 live, 0..4 and the spare 9 dead
    assert list(np.flatnonzero(live)) == [5, 6, 7, 8]


def test_reference_of_the_largest_prefill_is_whole_and_finite():
    # (the suite's largest reference, so its cost is the row blocks'; a test does not time it)
    case = ora.random_case(nh=16, nkv=8, hd=256, window=1024, ctx=1500, rows=1500, seed=11)
    out = ora.reference(case)
    assert out.shape == (1500, 16, 256) and np.all(np.isfinite(out))


def _dense_reference(case: ora.Case) -> np.ndarray:
    """The reference without row blocks: every row of a sequence against every key, masked."""
    q = case.q.astype(np.float64)
    g = case.nh // case.nkv
    out = np.empty(q.shape, np.float64)
    for o in np.unique(case.off):
        idx = np.flatnonzero(case.off == o)
        n = int(case.qpos[idx].max()) + 1
        pages = case.bt[o:o + -(-n // 16)]
        k = case.k_pool[pages].astype(np.float64).transpose(1, 0, 2, 3).reshape(case.nkv, -1, case.hd)[:, :n]
        v = case.v_pool[pages].astype(np.float64).transpose(1, 0, 2, 3).reshape(case.nkv, -1, case.hd)[:, :n]
        vis = ora.visible(np.arange(n)[None, :], case.qpos[idx][:, None], case.window)
        for h in range(case.nh):
            s = np.where(vis, q[idx, h] @ k[h // g].T, -np.inf)
            w = np.exp(s - s.max(axis=-1, keepdims=True))
            out[idx, h] = (w / w.sum(axis=-1, keepdims=True)) @ v[h // g]
    return out


@pytest.mark.parametrize("window", [0, 70])
def test_the_row_blocked_reference_equals_the_dense_one(window, monkeypatch):
    monkeypatch.setattr(ora, "REFERENCE_ROW_BLOCK", 64)  # the blocked path, not the suite's one block
    # Blocks of rows see only the keys some row of the block can see: a masked key's weight is
    # exactly 0 either way. Rows out of order (the edge case lists them latest first), several
    # sequences, more rows than one block.
    cases = [ora.random_case(nh=4, nkv=2, hd=256, window=window, ctx=300, rows=300, seed=3),
             ora.needle_case(hd=256, nh=8, nkv=2, window=window, kind="first_visible", seed=5)]
    if window:
        cases.append(ora.window_edge_case(hd=256, nh=8, nkv=2, window=window))
    assert cases[0].rows > ora.REFERENCE_ROW_BLOCK
    for case in cases:
        np.testing.assert_allclose(ora.reference(case), _dense_reference(case), rtol=1e-13, atol=1e-15)


def test_choose_splits_is_deterministic_and_within_the_kernel_range():
    seen = {pa.choose_splits(kv_len, rows, nh) for kv_len in (1, 15, 16, 64, 700, 1024, 100000)
            for rows in (1, 3, 5, 64) for nh in (1, 8, 16, 64)}
    assert seen <= set(range(1, pa.MAX_SPLITS + 1))
    assert pa.choose_splits(1024, 5, 16) == 4 and pa.choose_splits(700, 1, 16) == 11
    assert pa.choose_splits(1, 1, 1) == 1


def test_make_tiles_keeps_tiles_inside_one_sequence():
    tiles = pa.make_tiles(np.array([0] * 10 + [7] * 3, np.int32), rows_per_tile=4)
    assert tiles.start.tolist() == [0, 4, 8, 10]
    assert tiles.length.tolist() == [4, 4, 2, 3]


def test_prefill_rows_per_tile_refuses_an_unknown_head_size():
    with pytest.raises(ValueError, match="head size 128 is not supported"):
        pa.prefill_rows_per_tile(128)


def test_needle_case_refuses_a_window_kind_without_a_window():
    with pytest.raises(ValueError, match="needs a sliding window"):
        ora.needle_case(hd=256, nh=8, nkv=2, window=0, kind="window_just_outside", seed=1)



def test_unseen_entries_are_outside_every_window_and_invalid_ones_lie_past_any_pool():
    case = ora.random_case(nh=2, nkv=1, hd=256, window=40, ctx=100, rows=3, seed=1)
    unseen = ora.unseen_entries(case)
    # rows at 97..99 with window 40 see keys from 58: pages 3..6; page 7 is past the context.
    assert np.flatnonzero(unseen).tolist() == [0, 1, 2, 7]
    bad = ora.with_invalid_unseen_entries(case)
    assert np.all(bad.bt[unseen] == ora.INVALID_PAGE) and np.array_equal(bad.bt[~unseen], case.bt[~unseen])
    assert ora.INVALID_PAGE >= 2**30 > case.k_pool.shape[0]


def test_the_gate_configurations_have_invalid_entries_before_and_after_the_windows():
    from gates._paged_attention import random_case

    for name, rows in (("A", "decode"), ("A", "chunk"), ("B", "decode"), ("B", "chunk")):
        unseen = ora.unseen_entries(random_case(name, rows))
        assert unseen[-1], (name, rows)
        if name == "A":
            assert unseen[0] and unseen.sum() > 20, (name, rows)


@pytest.mark.parametrize("hd", (256, 512))
def test_twin_needles_mean_is_the_float64_reference_and_rounds(hd):
    case = ora.twin_needle_case(hd=hd, nh=8, nkv=2, window=ora.NEEDLE_WINDOW, seed=5)
    assert np.all(case.twin == case.qpos) and np.all(case.winner < case.qpos)
    assert np.all(case.qpos // 16 - case.winner // 16 >= 4), "the twins sit pages apart"
    expected = ora.mean_rows(case)
    np.testing.assert_array_equal(expected, ora.reference(case).astype(bf16))
    f32 = ((ora.copy_rows(case).astype(np.float64)
            + ora.copy_rows(ora.replace(case, winner=case.twin)).astype(np.float64)) / 2).astype(np.float32)
    low = f32.view(np.uint32) & 0xFFFF
    assert np.count_nonzero(low) > expected.size // 3 and np.count_nonzero(low == 0x8000) > expected.size // 10
    assert np.count_nonzero(bits_of(expected) != bits_of(ora.copy_rows(case))) > expected.size // 2


@pytest.mark.parametrize("window", (0, 37))
def test_paired_staircase_ties_odd_rows_and_copies_even_rows(window):
    case = ora.staircase_case(hd=256, nh=4, nkv=2, window=window, rising=True, seed=7, paired=True)
    expected = ora.mean_rows(case)
    np.testing.assert_array_equal(expected, ora.reference(case).astype(bf16))
    copy = ora.copy_rows(case)
    odd = case.qpos % 2 == 1
    assert np.array_equal(bits_of(expected[~odd]), bits_of(copy[~odd]))
    assert np.count_nonzero(bits_of(expected[odd]) != bits_of(copy[odd])) > expected[odd].size // 2
    with pytest.raises(ValueError, match="window of 0 or at least 2"):
        ora.staircase_case(hd=256, nh=4, nkv=2, window=1, rising=True, seed=7, paired=True)


# ------------------------------------------------------------------ window edges at page boundaries


def _c_div(a: int, b: int) -> int:
    """C's integer division (toward zero), as the kernels divide a first visible key by 16."""
    return int(a / b) if a >= 0 else -((-a) // b)


# The kernels' first_visible and the survivors of the mutation run that move it (paged_attention.cu
# line 38); the window-edge case must make each of them follow an unseen entry or lose a winner.
def _fv(qpos, w):
    return qpos - w + 1 if w > 0 and qpos - w + 1 > 0 else 0


FIRST_VISIBLE_MUTANTS = {
    "window > 1": lambda qpos, w: qpos - w + 1 if w > 1 and qpos - w + 1 > 0 else 0,
    "returns qpos - window + 0": lambda qpos, w: qpos - w + 0 if w > 0 and qpos - w + 1 > 0 else 0,
    "returns qpos - window - 1": lambda qpos, w: qpos - w - 1 if w > 0 and qpos - w + 1 > 0 else 0,
    "returns qpos - window + 2": lambda qpos, w: qpos - w + 2 if w > 0 and qpos - w + 1 > 0 else 0,
}
# Equivalent by argument: they change fv only inside page 0 (fv / 16 stays 0).
FIRST_VISIBLE_EQUIVALENT = {
    "condition qpos - window - 1 > 0": lambda qpos, w: qpos - w + 1 if w > 0 and qpos - w - 1 > 0 else 0,
    "condition qpos - window + 0 > 0": lambda qpos, w: qpos - w + 1 if w > 0 and qpos - w > 0 else 0,
    "else 1": lambda qpos, w: qpos - w + 1 if w > 0 and qpos - w + 1 > 0 else 1,
    # Not even fv moves: where qpos - window + 1 == 0 both branches return 0.
    "condition qpos - window + 1 >= 0": lambda qpos, w: qpos - w + 1 if w > 0 and qpos - w + 1 >= 0 else 0,
}


def _decode_pages(case, fv_fn):
    """Per row: the logical pages the decode kernel walks, [fv / 16, qpos / 16]."""
    return [range(_c_div(fv_fn(int(q), case.window), 16), int(q) // 16 + 1) for q in case.qpos]


def _prefill_pages(case, fv_fn, hd):
    """Per row: the pages its prefill tile stages, [min fv / 16, max qpos / 16] over the tile."""
    tiles = pa.make_tiles(case.off, pa.prefill_rows_per_tile(hd))
    pages = [None] * case.rows
    for s, n in zip(tiles.start, tiles.length):
        rows = range(int(s), int(s + n))
        lo = min(fv_fn(int(case.qpos[r]), case.window) for r in rows)
        hi = max(int(case.qpos[r]) for r in rows)
        for r in rows:
            pages[r] = range(_c_div(lo, 16), hi // 16 + 1)
    return pages


def _mutant_seen_by(case, pages):
    """(follows an unseen entry, loses a row's winner page) for one page plan."""
    unseen = ora.unseen_entries(case)
    follows = any(unseen[int(case.off[r]) + p] for r, rng in enumerate(pages) for p in rng if p >= 0)
    follows |= any(p < 0 for rng in pages for p in rng)
    loses = any(int(case.winner[r]) // 16 not in rng for r, rng in enumerate(pages))
    return follows, loses


@pytest.mark.parametrize("window", ora.EDGE_WINDOWS)
def test_window_edge_rows_sit_on_the_page_residues_and_copy_their_first_visible_key(window):
    case = ora.window_edge_case(hd=256, nh=8, nkv=2, window=window)
    fv = ora.first_visible(case.qpos, window)
    assert np.array_equal(case.winner, fv)
    assert {0, 1, 2, 15} <= set((fv[fv >= 16] % 16).tolist()) and 0 in fv.tolist()
    assert all(_fv(int(q), window) == int(f) for q, f in zip(case.qpos, fv)), "oracle vs kernel first_visible"
    # latest row first: in every two-row sequence the tile's first page comes from its second row
    for o in np.unique(case.off):
        rows = np.flatnonzero(case.off == o)
        assert rows.size == 1 or int(np.argmin(fv[rows])) == rows.size - 1
    # every visible key other than the winner scores at least 128 less, in f32 and float64 alike
    if window > 1:
        np.testing.assert_array_equal(ora.reference(case), ora.copy_rows(case).astype(np.float64))


@pytest.mark.parametrize("hd", (256, 512))
def test_window_one_scores_are_exactly_the_extreme_scores_in_the_kernels_order(hd):
    case = ora.window_edge_case(hd=hd, nh=8, nkv=2, window=1)
    scores = ora.winner_scores(case)
    expected = np.broadcast_to(np.asarray(ora.EXTREME_SCORES, np.float32), scores.shape)
    np.testing.assert_array_equal(bits_of(scores), bits_of(np.ascontiguousarray(expected)))
    assert np.float32(-ora.FLT_MAX) in scores and np.all(np.isfinite(scores))
    assert np.any(scores < -104) and np.any(scores == 0) and np.any((scores < 0) & (scores > -104))
    # one visible key per row: weight 1 whatever its score, in float64 too
    np.testing.assert_array_equal(ora.reference(case), ora.copy_rows(case).astype(np.float64))


def test_kernel_score_is_the_f32_dot_product_when_it_is_exact():
    rng = np.random.default_rng(3)
    q = rng.integers(-8, 9, 512).astype(np.float64)
    k = rng.integers(-8, 9, 512).astype(np.float64)
    assert ora.kernel_score(q, k) == np.float32(q @ k)
    # and rounds in the kernels' order where it is not: 2^24 + 1 + 1 in one lane
    q2, k2 = np.zeros(256), np.zeros(256)
    q2[:3], k2[:3] = (2.0 ** 24, 1.0, 1.0), (1.0, 1.0, 1.0)
    assert ora.kernel_score(q2, k2) == np.float32(2.0 ** 24)   # each +1 rounds back (ties to even)


@pytest.mark.parametrize("name", sorted(FIRST_VISIBLE_MUTANTS))
def test_every_page_moving_first_visible_mutant_follows_an_unseen_entry_or_loses_a_winner(name):
    # The model of the kernels' page walks: the decode gates see a walk that follows an unseen
    # (invalid) entry as a fault, and one that misses a winner's page as wrong bits.
    fn = FIRST_VISIBLE_MUTANTS[name]
    for kernel in ("decode", "prefill"):
        seen = []
        for window in ora.EDGE_WINDOWS:
            hd = 256 if kernel == "decode" else 512
            case = ora.window_edge_case(hd=hd, nh=8, nkv=2, window=window)
            plan = _decode_pages(case, fn) if kernel == "decode" else _prefill_pages(case, fn, hd)
            original = _decode_pages(case, _fv) if kernel == "decode" else _prefill_pages(case, _fv, hd)
            assert _mutant_seen_by(case, original) == (False, False), "the real kernel follows nothing unseen"
            seen.append(_mutant_seen_by(case, plan))
        assert any(f or lo for f, lo in seen), f"{name}: no window-edge case sees it in {kernel}"
        if name == "returns qpos - window + 2":
            assert all(lo for _, lo in seen), f"{name}: every window loses a winner ({kernel})"
        if name in ("returns qpos - window + 0", "returns qpos - window - 1"):
            assert all(f for f, _ in seen), f"{name}: every window follows an unseen entry ({kernel})"


@pytest.mark.parametrize("name", sorted(FIRST_VISIBLE_EQUIVALENT))
def test_the_equivalent_first_visible_mutants_never_move_a_page(name):
    # Exhaustive over windows 1..600 and positions 0..1200: the page fv / 16 never changes.
    fn = FIRST_VISIBLE_EQUIVALENT[name]
    for w in range(0, 601):
        for q in range(0, 1201):
            assert _c_div(fn(q, w), 16) == _c_div(_fv(q, w), 16), (name, q, w)


def test_the_first_visible_boundary_mutant_returns_the_same_key_everywhere():
    fn = FIRST_VISIBLE_EQUIVALENT["condition qpos - window + 1 >= 0"]
    for w in range(0, 601):
        for q in range(0, 1201):
            assert fn(q, w) == _fv(q, w), (q, w)


def _strided_cover(hd: int, threads: int, stride: int) -> list[int]:
    """How many times `for (d = threadIdx.x; d < HD; d += stride)` visits each d, over a block."""
    seen = [0] * hd
    for t in range(threads):
        for d in range(t, hd, stride):
            seen[d] += 1
    return seen


@pytest.mark.parametrize("hd", pa.HEAD_SIZES)
def test_a_merge_stride_of_blockdim_minus_1_still_visits_every_d(hd):
    # merge_splits' `d += blockDim.x` -> `d += blockDim.x - 1` (and paged_decode's own loop):
    # at the launchers' 128 threads (fixed by __launch_bounds__ too), thread t visits t + 127 k,
    # so every d < HD is visited at least once; the d = 127 + 127 k visited twice (threads 127 and
    # 0) get the same merge of the same partials, the same bits. Equivalent: no input sees it.
    assert pa.DECODE_THREADS == 128
    exact = _strided_cover(hd, pa.DECODE_THREADS, pa.DECODE_THREADS)
    mutant = _strided_cover(hd, pa.DECODE_THREADS, pa.DECODE_THREADS - 1)
    assert exact == [1] * hd
    assert min(mutant) == 1 and max(mutant) == 2
    assert [d for d in range(hd) if mutant[d] == 2] == list(range(127, hd, 127))


def test_split_chunks_cover_every_visible_page_once_as_documented():
    case = ora.window_edge_case(hd=256, nh=8, nkv=2, window=70)
    for splits in range(1, pa.MAX_SPLITS + 1):
        chunks = ora.split_chunks(case, splits)
        for r, (fv, qp) in enumerate(zip(ora.first_visible(case.qpos, 70), case.qpos)):
            pages = [p for b, e in chunks[r] for p in range(b, e)]
            assert pages == list(range(int(fv) // 16, int(qp) // 16 + 1)), (splits, r)
            sizes = [int(e - b) for b, e in chunks[r]]
            assert max(sizes) == -(-len(pages) // splits)


@pytest.mark.parametrize("splits", (1, 2, 3, 7, 16))
def test_split_partials_hold_each_chunks_first_visible_key_by_the_gap(splits):
    case = ora.window_edge_case(hd=256, nh=8, nkv=2, window=70)
    parts = ora.split_partials(case, splits)
    fv = ora.first_visible(case.qpos, 70)
    g = case.nh // case.nkv
    for r, chunks in enumerate(ora.split_chunks(case, splits)):
        for s, (b, e) in enumerate(chunks):
            keys = [k for k in range(b * 16, e * 16) if ora.visible(k, case.qpos[r], 70)]
            if not keys:
                assert parts[r, 0, s, 0] == -np.inf and not np.any(parts[r, :, s, 1:])
                continue
            for h in (0, 7):
                sc = []
                for k in keys:
                    page, slot = ora._key_slot(case.bt, case.off[r], k)
                    sc.append(case.q[r, h].astype(np.float64) @ case.k_pool[page, h // g, slot].astype(np.float64))
                sc = np.asarray(sc)
                assert keys[int(np.argmax(sc))] == max(int(fv[r]), b * 16)
                assert sc.max() == parts[r, h, s, 0]
                if len(sc) > 1:
                    assert sc.max() - np.sort(sc)[-2] >= 128
    assert np.all(parts[..., 1][np.isfinite(parts[..., 0])] == 1)


def _chunk_winners(chunks, fv, qpos):
    """Per row and split: the key a split's partial holds (its chunk's first visible key) or None."""
    return [[max(int(f), int(b) * 16) if min(int(e), int(q) // 16 + 1) > max(int(b), int(f) // 16) else None
             for b, e in row] for row, f, q in zip(chunks, fv, qpos)]


def test_both_split_pages_survivors_change_some_partial_over_the_gates_split_counts():
    # The model of split_pages (paged_attention.cu line 34) and its two survivors: the output
    # cannot see them (every page still lands in exactly one split), the partials can.
    case = ora.window_edge_case(hd=256, nh=8, nkv=2, window=70)
    fv = ora.first_visible(case.qpos, 70)
    lo, hi = fv // 16, case.qpos // 16
    mutants = {"'-' -> '+'": lambda l, h, n: (h + l + n) // n, "'/' -> '*'": lambda l, h, n: (h - l + n) * n}
    for name, per_of in mutants.items():
        moved_counts = []
        for n in range(1, pa.MAX_SPLITS + 1):
            documented = _chunk_winners(ora.split_chunks(case, n), fv, case.qpos)
            chunks = [[(l + s * per_of(l, h, n), min(h + 1, l + (s + 1) * per_of(l, h, n))) for s in range(n)]
                      for l, h in zip(lo, hi)]
            if _chunk_winners(chunks, fv, case.qpos) != documented:
                moved_counts.append(n)
        assert moved_counts, f"split_pages {name}: no split count moves a partial"
        assert 1 not in moved_counts


# ------------------------------------------------------------------ a host model of the kernels
#
# paged_attention.cu's page walks, online softmax and merges, step for step in f32 (fmaf as an
# exact f64 product plus one rounding, expf as numpy's f32 exp, which agree with the device on
# the designed cases: every weight there is exp(0) = 1 or underflows to 0). Its knobs are the
# survivors of the mutation run and the controls, so this checks here, without a GPU, that
# the gates' expected images are what the kernel computes and that each control turns its
# gate red the way its file says (bits differ: route assertion; an unseen entry followed:
# route trap).

INT_MAX = 0x7FFFFFFF


def _fma(a, b, c):
    with np.errstate(invalid="ignore", over="ignore"):
        return (np.float64(a) * np.float64(b) + np.float64(c)).astype(np.float32)


def _expf(x):
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        return np.exp(np.float32(x)).astype(np.float32)


def _sub(a, b):
    with np.errstate(invalid="ignore", over="ignore"):
        return np.float32(np.float32(a) - np.float32(b))


class _Model:
    def __init__(self, neg=-np.inf, fv=_fv, per=lambda lo, hi, n: (hi - lo + n) // n, w_start=0, tile_off="t0",
                 lo_from_warp0=False):
        self.neg, self.fv, self.per, self.w_start, self.tile_off = np.float32(neg), fv, per, w_start, tile_off
        self.lo_from_warp0 = lo_from_warp0
        self._scores = {}
        self._cases = {}   # keeps every case keyed by id() alive: a freed case's id can be reused

    def new_state(self, hd):
        return [self.neg, np.float32(0), np.zeros(hd, np.float32)]

    def add_page(self, st, case, r, h, entry, p):
        """One page for row r, head h: every visible key, in slot order (State::add_key)."""
        g = case.nh // case.nkv
        qp = int(case.qpos[r])
        slots = [t for t in range(16) if ora.visible(p * 16 + t, qp, case.window)]
        if not slots:
            return False
        key = (id(case), r, h, entry)
        self._cases[id(case)] = case
        if key not in self._scores:
            self._scores[key] = ora.kernel_score(case.q[r, h], case.k_pool[entry, h // g])
        scores = self._scores[key]
        for t in slots:
            s = scores[t]
            v = case.v_pool[entry, h // g, t].astype(np.float32)
            m_new = np.fmax(st[0], s)
            alpha, pw = _expf(_sub(st[0], m_new)), _expf(_sub(s, m_new))
            st[1] = _fma(st[1], alpha, pw)
            with np.errstate(invalid="ignore", over="ignore"):
                st[2] = _fma(st[2], alpha, (pw * v).astype(np.float32))
            st[0] = m_new
        return True

    def merge(self, states):
        m_max = self.neg
        for m, _, _ in states:
            m_max = np.fmax(m_max, m)
        l, a = np.float32(0), np.zeros_like(states[0][2])
        for m, li, ai in states:
            f = np.float32(0) if m == self.neg else _expf(_sub(m, m_max))
            l, a = _fma(li, f, l), _fma(ai, f, a)
        return [m_max, l, a]

    @staticmethod
    def output(st):
        with np.errstate(invalid="ignore", divide="ignore"):
            return (st[2] / st[1]).astype(np.float32).astype(bf16)

    def decode(self, case, splits):
        """(out bf16, partials f32 [rows, nh, splits, hd + 2], followed) where followed holds
        (block-table index, derefed without a page map) for every entry the walk reads."""
        out = np.empty(case.q.shape, bf16)
        parts = np.empty((case.rows, case.nh, splits, case.hd + 2), np.float32)
        followed = []
        for r in range(case.rows):
            qp, o = int(case.qpos[r]), int(case.off[r])
            lo, hi = _c_div(self.fv(qp, case.window), 16), qp // 16
            per = self.per(lo, hi, splits)
            for h in range(case.nh):
                partials = []
                for split in range(splits):
                    begin = lo + split * per
                    end = min(hi + 1, begin + per)
                    warps = [self.new_state(case.hd) for _ in range(4)]
                    for w in range(4):
                        for p in range(begin + w, end, 4):
                            entry = int(case.bt[o + p]) if 0 <= o + p < case.bt.size else -1
                            used = entry >= 0 and entry < case.k_pool.shape[0] and \
                                self.add_page(warps[w], case, r, h, entry, p)
                            followed.append((o + p, used))
                    partial = self.merge(warps)
                    parts[r, h, split] = np.concatenate([[partial[0], partial[1]], partial[2]])
                    partials.append(partial)
                out[r, h] = self.output(self.merge(partials))
        return out, parts, followed

    def prefill(self, case):
        rows_per = pa.prefill_rows_per_tile(case.hd)
        tiles = pa.make_tiles(case.off, rows_per)
        out = np.empty(case.q.shape, bf16)
        followed = []
        for t0, tn in zip(tiles.start.tolist(), tiles.length.tolist()):
            row_lo = [self.fv(int(case.qpos[t0 + w]), case.window) if w < tn else INT_MAX for w in range(rows_per)]
            row_hi = [int(case.qpos[t0 + w]) if w < tn else -1 for w in range(rows_per)]
            lo, hi = min([INT_MAX] + row_lo[self.w_start:]), max([-1] + row_hi[self.w_start:])
            if self.lo_from_warp0:
                lo = row_lo[0]
            o = int(case.off[t0] if self.tile_off == "t0" else case.off[0])
            states = {(w, h): self.new_state(case.hd) for w in range(tn) for h in range(case.nh)}
            for p in range(_c_div(lo, 16), _c_div(hi, 16) + 1):
                entry = int(case.bt[o + p]) if 0 <= o + p < case.bt.size else -1
                followed.append((o + p, True))
                if not 0 <= entry < case.k_pool.shape[0]:
                    continue
                for (w, h), st in states.items():
                    self.add_page(st, case, t0 + w, h, entry, p)
            for (w, h), st in states.items():
                out[t0 + w, h] = self.output(st)
        return out, followed


def _follows_unseen(case, followed, page_map: bool) -> bool:
    """Would the out-of-window gate fault: an unseen entry (invalid there) dereferenced, or,
    behind a page map, read at all (pmap[2^30]); an index outside the table counts too."""
    unseen = ora.unseen_entries(case)
    return any(not 0 <= i < unseen.size or (unseen[i] and (used or page_map)) for i, used in followed)


def _differs(a, b) -> bool:
    return not np.array_equal(bits_of(a), bits_of(b))


@pytest.mark.parametrize("window", ora.EDGE_WINDOWS)
def test_kernel_model_computes_the_window_edge_gates_expected_bits(window):
    model = _Model()
    case = ora.window_edge_case(hd=256, nh=8, nkv=2, window=window)
    splits = pa.choose_splits(window, case.rows, case.nh)
    out, _, followed = model.decode(case, splits)
    np.testing.assert_array_equal(bits_of(out), bits_of(ora.copy_rows(case)))
    assert not _follows_unseen(case, followed, page_map=True)
    pcase = ora.window_edge_case(hd=512, nh=8, nkv=2, window=window)
    pout, pfollowed = model.prefill(pcase)
    np.testing.assert_array_equal(bits_of(pout), bits_of(ora.copy_rows(pcase)))
    assert not _follows_unseen(pcase, pfollowed, page_map=True)


# The model is slow (a Python loop per key); a sample of the gate's split counts, with the
# launcher's (2), one per page (5 pages at most) and counts with empty splits.
MODEL_SPLITS = (1, 2, 3, 5, 7, 16)


def test_kernel_model_computes_the_split_partials_gates_expected_bits():
    case = ora.window_edge_case(hd=256, nh=8, nkv=2, window=70)
    model = _Model()
    for splits in MODEL_SPLITS:
        out, parts, _ = model.decode(case, splits)
        np.testing.assert_array_equal(bits_of(parts), bits_of(ora.split_partials(case, splits)), err_msg=str(splits))
        np.testing.assert_array_equal(bits_of(out), bits_of(ora.copy_rows(case)))


# control -> (model, {(kernel, window): route}); route "assertion" (bits differ), "trap" (an unseen
# entry followed, bits equal), "green" (neither: the gate cannot see it, stated on purpose)
_C = {
    "attention_first_visible_one_key_late": (
        _Model(fv=FIRST_VISIBLE_MUTANTS["returns qpos - window + 2"]),
        {(k, w): "assertion" for k in ("decode", "prefill") for w in ora.EDGE_WINDOWS}),
    "attention_first_visible_one_key_early": (
        _Model(fv=FIRST_VISIBLE_MUTANTS["returns qpos - window + 0"]),
        {(k, w): "trap" for k in ("decode", "prefill") for w in ora.EDGE_WINDOWS}),
    "first_visible returns qpos - window - 1 (no control)": (
        _Model(fv=FIRST_VISIBLE_MUTANTS["returns qpos - window - 1"]),
        {(k, w): "trap" for k in ("decode", "prefill") for w in ora.EDGE_WINDOWS}),
    "attention_window_one_walks_from_page_zero": (
        _Model(fv=FIRST_VISIBLE_MUTANTS["window > 1"]),
        {("decode", 1): "trap", ("prefill", 1): "trap", ("decode", 16): "green", ("prefill", 70): "green"}),
    "attention_softmax_max_starts_at_zero": (
        _Model(neg=0.0), {("decode", 1): "assertion", ("prefill", 1): "assertion", ("decode", 70): "green"}),
    "attention_softmax_max_starts_at_minus_flt_max": (
        _Model(neg=-ora.FLT_MAX), {("decode", 1): "assertion", ("prefill", 1): "green"}),
    "attention_prefill_tiles_read_the_first_sequence": (
        _Model(tile_off="0"), {("prefill", w): "assertion" for w in ora.EDGE_WINDOWS}),
    "prefill row_lo[w] -> row_lo[0] (no control)": (
        _Model(lo_from_warp0=True), {("prefill", w): "assertion" for w in ora.EDGE_WINDOWS}),
    "attention_prefill_tile_range_skips_warp_zero": (
        _Model(w_start=1), {("prefill", w): "assertion" for w in ora.EDGE_WINDOWS}),
}


@pytest.mark.parametrize("control", sorted(_C))
def test_kernel_model_of_each_control_turns_its_window_edge_gates_red_by_the_expected_route(control):
    model, expected = _C[control]
    for (kernel, window), route in expected.items():
        hd = 256 if kernel == "decode" else 512
        case = ora.window_edge_case(hd=hd, nh=8, nkv=2, window=window)
        if kernel == "decode":
            out, _, followed = model.decode(case, pa.choose_splits(window, case.rows, case.nh))
        else:
            out, followed = model.prefill(case)
        got = ("assertion" if _differs(out, ora.copy_rows(case))
               else "trap" if _follows_unseen(case, followed, page_map=True) else "green")
        assert got == route, f"{control}: {kernel} window {window}: {got}, expected {route}"
        if route == "trap" and kernel == "decode":
            # without a page map decode never dereferences a page whose keys are all masked
            assert not _follows_unseen(case, followed, page_map=False)


@pytest.mark.parametrize("per_name", ["'-' -> '+'", "'/' -> '*'"])
def test_kernel_model_split_pages_survivors_change_partials_not_outputs(per_name):
    per = {"'-' -> '+'": lambda lo, hi, n: (hi + lo + n) // n, "'/' -> '*'": lambda lo, hi, n: (hi - lo + n) * n}[per_name]
    case = ora.window_edge_case(hd=256, nh=8, nkv=2, window=70)
    moved = []
    model = _Model(per=per)
    for splits in MODEL_SPLITS:
        out, parts, followed = model.decode(case, splits)
        np.testing.assert_array_equal(bits_of(out), bits_of(ora.copy_rows(case)))   # the output cannot see it
        assert not _follows_unseen(case, followed, page_map=True)
        if _differs(parts, ora.split_partials(case, splits)):
            moved.append(splits)
    assert moved and 1 not in moved and pa.choose_splits(70, case.rows, case.nh) in moved


# ------------------------------------------------------------------ ladders (the sweeps' anchor)


def test_ladder_levels_are_the_bf16_integers_at_least_one_apart():
    levels = ora.ladder_levels(ora.LADDER_MAX)
    assert levels[0] == 1 and np.all(np.diff(levels) >= 1)
    assert np.array_equal(levels.astype(bf16).astype(np.float64), levels)
    assert ora.DECOY_LEVEL > levels[-1] and float(np.float64(ora.DECOY_LEVEL).astype(bf16)) == ora.DECOY_LEVEL
    assert 128 * ora.DECOY_LEVEL < np.finfo(np.float32).max   # every score finite
    with pytest.raises(ValueError, match="at most"):
        ora.ladder_levels(ora.LADDER_MAX + 1)


@pytest.mark.parametrize("window", [0, 1, 37])
@pytest.mark.parametrize("hd", [256, 512])
def test_ladder_winners_are_the_float64_reference_in_both_directions(hd, window):
    decode = ora.ladder_plan(hd, 6, 2, window, [(300,), (16,), (0,), (47,)], seed=3)
    prefill = ora.ladder_plan(hd, 4, 1, window, [tuple(range(120, 161))], seed=3, prefix=2)
    for plan in (decode, prefill):
        rising = []
        for flip in (0, 1):
            case = ora.ladder_case(plan, flip)
            np.testing.assert_array_equal(bits_of(ora.reference(case).astype(bf16)), bits_of(ora.copy_rows(case)))
            rising.append(case.winner == case.qpos[:, None])
        one_key = (ora.first_visible(plan.qpos, window) == plan.qpos)[:, None]   # both ways the same key
        assert np.all(rising[0] | rising[1]) and not np.any(rising[0] & rising[1] & ~one_key), \
            "each (row, kv head) climbs one way, and the other way flipped"


def test_ladder_plan_names_only_span_pages_and_the_decoy_page_and_spares_the_last():
    plan = ora.ladder_plan(256, 4, 2, 40, [(100,), (7,)], seed=1)
    assert plan.bt.max() < plan.num_pages - 1 and plan.bt.min() >= 0
    spans = set(np.concatenate(plan.pages).tolist())
    assert set(plan.bt.tolist()) == spans | {plan.decoy} and plan.decoy not in spans
    case = ora.ladder_case(plan)
    # every key no row sees holds the decoy level (K = c L, c = 128 / hd)
    decoy_k = ora.DECOY_LEVEL * 128 / 256
    assert np.all(case.k_pool[plan.decoy].astype(np.float64) == decoy_k)
    assert np.all(case.k_pool[plan.num_pages - 1].astype(np.float64) == decoy_k)


def test_kernel_model_copies_the_ladder_winners_in_decode_and_prefill():
    # The step-for-step host model of the kernels (below) on small ladders: the expected image is
    # what the kernels compute, at a split count that leaves empty splits and one that does not.
    model = _Model()
    decode = ora.ladder_plan(256, 4, 2, 0, [(70,), (5,)], seed=2)
    for flip, splits in ((0, 3), (1, 16)):
        case = ora.ladder_case(decode, flip)
        out, _, followed = model.decode(case, splits)
        np.testing.assert_array_equal(bits_of(out), bits_of(ora.copy_rows(case)))
        assert not _follows_unseen(case, followed, page_map=True)
    prefill = ora.ladder_plan(512, 2, 1, 20, [tuple(range(30, 41))], seed=2, prefix=2)
    case = ora.ladder_case(prefill, 1)
    out, _ = model.prefill(case)
    np.testing.assert_array_equal(bits_of(out), bits_of(ora.copy_rows(case)))


def test_a_gqa_mapping_by_shift_copies_other_rows_at_a_group_of_3_and_not_at_4():
    # The sweep's control attention_sweep_gqa_group_by_shift, in the host model: a group of 3
    # maps head 2 to kv head 1 (past the last kv head at nkv 1: the next page, still inside the
    # pool, whose last page is spare); a group of 4 is right.
    class Shifted(_Model):
        def add_page(self, st, case, r, h, entry, p):
            g = case.nh // case.nkv
            shifted = h >> (g.bit_length() - 1)   # the kernel's kv head, maybe past the last one
            # base = (entry * nkv + shifted) * 16 * hd: kv head shifted % nkv of page entry + shifted / nkv
            # (q is 1 in every head, so the score is the same from any query head of that kv head)
            return super().add_page(st, case, r, (shifted % case.nkv) * g, entry + shifted // case.nkv, p)

    for g, differs in ((3, True), (4, False)):
        plan = ora.ladder_plan(256, g, 1, 0, [(40,)], seed=4)
        case = ora.ladder_case(plan)
        out, _, _ = Shifted().decode(case, 2)
        assert _differs(out, ora.copy_rows(case)) == differs, g


def test_the_big_index_placement_straddles_2_31_elements_and_ends_the_pool():
    from gates import test_attention_big_index as big
    from harness.library.buffers import INDEX_32

    dplan, pplan = big.decode_plan(), big.prefill_plan()
    decode_at, prefill_at, num_pages = big.placement(dplan, pplan)
    element = lambda page: page * big.PAGE_ELEMENTS  # noqa: E731
    assert element(decode_at) < INDEX_32 < element(decode_at + dplan.num_pages)
    assert element(prefill_at) > INDEX_32 and num_pages == prefill_at + pplan.num_pages
    assert num_pages < 2**31 and decode_at + dplan.num_pages <= prefill_at
    # K = V: each key's copied row is its ladder level, distinct from every other visible key's
    for plan, flip in ((dplan, 0), (pplan, 1)):
        case = big._k_is_v(ora.ladder_case(plan, flip))
        np.testing.assert_array_equal(bits_of(ora.reference(case).astype(bf16)), bits_of(ora.copy_rows(case)))
