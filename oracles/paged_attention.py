"""Host side of the paged-attention chain.

- `reference`: float64 attention over the paged pool, vectorised numpy (one matmul pair per
  sequence and kv head). It is the tolerance anchor's oracle, nothing else.
- Needle builders (`needle_case`, `staircase_case`): inputs whose exact output is one V row
  per (row, head), named by `Case.winner`; `copy_rows` gathers those rows. No softmax runs on
  the host for them: the expected image is a copy out of the V pool.
- `permuted_pool`: the same pages in a shuffled pool behind a page map whose physical page 0
  is filled with NaN and receives every page no row may see.

bf16 arrays here are ml_dtypes bfloat16 (harness.library.dtypes.bf16). Layouts follow
kernels_cu/paged_attention.py: q [rows, nh, hd], pools [pages, nkv, 16, hd].

The needle gap. Scores are s = q . k with scale 1 and q = 1 in every element, so s is the sum
of the key's elements. Other keys have elements in [-1/8, 1/8] (|s| <= hd/8); the needle key
is 1 everywhere (s = hd); a decoy the kernel must not see is 4 everywhere (s = 4 hd). The
needle beats every other key by at least 7 hd / 8 = 224 (hd 256) or 448 (hd 512), and a leaked
decoy beats the needle by 3 hd. In f32 without ftz, expf(x) is exactly 0 for x below about
-103.97 (e^-103.97 is half the smallest denormal, 2^-149), so every weight except the
winner's is exactly 0 and the winner's is exactly 1: the output is the winner's V row. V
holds no zeros (|v| >= 1/64), so no signed-zero addition can turn a copied -0 into +0.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from harness.library.dtypes import bf16, bits_of, from_bits

PAGE = 16
NAN_BF16 = 0x7FC0

NEEDLE_QPOS = (181, 150, 95)         # decode needle rows, one sequence each
NEEDLE_WINDOW = 70                   # window edges land mid-page for rows 1, 2 and on a page start for row 0
NEEDLE_OTHER_MAX = 0.125
NEEDLE_K = 1.0
DECOY_K = 4.0
NEEDLE_KINDS_ANY = ("first_visible", "last_visible", "page_last_slot", "page_first_slot", "causal_just_outside")
NEEDLE_KINDS_WINDOW = ("window_just_outside",)
# (window, kind) of every decode needle anchor; with the window, first_visible is "just inside".
NEEDLE_CASES = tuple((0, k) for k in NEEDLE_KINDS_ANY) + tuple(
    (NEEDLE_WINDOW, k) for k in NEEDLE_KINDS_ANY + NEEDLE_KINDS_WINDOW)
STAIR_CTX = 200                      # c * (j + 1) stays exact in bf16 for every key of the pool
STAIR_STEP_SCORE = 128.0             # score step between neighbouring keys (> 104: exp underflows to 0)
STAIR_PREFIX_PAGES = 2               # block-table entries of another sequence before this one


@dataclass(frozen=True)
class Case:
    """Host inputs of one launch. `winner[r]` (needle cases) is the position whose V row
    row r's output copies in every head."""

    q: np.ndarray
    k_pool: np.ndarray
    v_pool: np.ndarray
    bt: np.ndarray
    off: np.ndarray
    qpos: np.ndarray
    window: int
    winner: np.ndarray | None = None
    twin: np.ndarray | None = None  # a second key tying with the winner (twin needles): mean_rows

    @property
    def rows(self) -> int:
        return int(self.q.shape[0])

    @property
    def nh(self) -> int:
        return int(self.q.shape[1])

    @property
    def hd(self) -> int:
        return int(self.q.shape[2])

    @property
    def nkv(self) -> int:
        return int(self.k_pool.shape[1])


# ------------------------------------------------------------------ visibility (the contract's words)


def first_visible(qpos, window: int):
    """First visible key of a query at qpos: 0, or qpos - window + 1 with a sliding window."""
    qpos = np.asarray(qpos, np.int64)
    return np.maximum(qpos - window + 1, 0) if window > 0 else np.zeros_like(qpos)


def visible(kpos, qpos, window: int):
    """kpos <= qpos, and qpos - kpos < window when window > 0 (broadcasting)."""
    kpos, qpos = np.asarray(kpos, np.int64), np.asarray(qpos, np.int64)
    vis = kpos <= qpos
    if window > 0:
        vis &= qpos - kpos < window
    return vis


# ------------------------------------------------------------------ the float64 reference


# Query rows per block of the reference's score matrices: every case of the suite (at most
# 1500 rows) is one block, because smaller blocks, though they skip more masked keys, made the
# prefill anchor slower on the GPU host.
REFERENCE_ROW_BLOCK = 2048


def reference(case: Case, scale: float = 1.0) -> np.ndarray:
    """float64 softmax(q k^T * scale) v over each row's visible keys, [rows, nh, hd].

    Rows go in blocks of REFERENCE_ROW_BLOCK (in the case's row order); a block's scores are
    computed only against the keys some row of the block can see, [min first visible, max
    qpos]: a key outside that range is masked for every row of the block, and a masked key's
    weight is exp(-inf) = 0 exactly, so leaving it out changes nothing but the work (a prefill
    of every position skips most of a causal or sliding-window matrix)."""
    q = case.q.astype(np.float64)
    rows, nh, hd = q.shape
    nkv = case.nkv
    g = nh // nkv
    out = np.empty((rows, nh, hd), np.float64)
    off, qpos = np.asarray(case.off), np.asarray(case.qpos)
    fv = first_visible(qpos, case.window)
    for o in np.unique(off):
        idx = np.flatnonzero(off == o)
        n_keys = int(qpos[idx].max()) + 1
        pages = np.asarray(case.bt[o:o + -(-n_keys // PAGE)])
        # [pages, nkv, 16, hd] -> [nkv, keys, hd]
        k = case.k_pool[pages].astype(np.float64).transpose(1, 0, 2, 3).reshape(nkv, -1, hd)[:, :n_keys]
        v = case.v_pool[pages].astype(np.float64).transpose(1, 0, 2, 3).reshape(nkv, -1, hd)[:, :n_keys]
        for b0 in range(0, idx.size, REFERENCE_ROW_BLOCK):
            blk = idx[b0:b0 + REFERENCE_ROW_BLOCK]
            lo, hi = int(fv[blk].min()), int(qpos[blk].max()) + 1
            vis = visible(np.arange(lo, hi)[None, :], qpos[blk][:, None], case.window)      # [R, keys]
            qs = q[blk].reshape(blk.size, nkv, g, hd)
            for j in range(nkv):
                s = (qs[:, j].reshape(-1, hd) @ k[j, lo:hi].T).reshape(blk.size, g, hi - lo) * scale
                s = np.where(vis[:, None, :], s, -np.inf)
                w = np.exp(s - s.max(axis=-1, keepdims=True))
                w /= w.sum(axis=-1, keepdims=True)
                out[blk, j * g:(j + 1) * g] = (w.reshape(-1, hi - lo) @ v[j, lo:hi]).reshape(blk.size, g, hd)
    return out


# ------------------------------------------------------------------ builders


def _bf16(x) -> np.ndarray:
    return np.asarray(x, np.float32).astype(bf16)


def random_case(nh: int, nkv: int, hd: int, window: int, ctx: int, rows: int, seed: int) -> Case:
    """One sequence of ctx keys (identity block table, plus one page past the context that no
    row may see), uniform(-1, 1) q, k, v; the query rows are the last `rows` positions."""
    rng = np.random.default_rng(seed)
    pages = -(-ctx // PAGE) + 1
    k = _bf16(rng.uniform(-1, 1, (pages, nkv, PAGE, hd)))
    v = _bf16(rng.uniform(-1, 1, (pages, nkv, PAGE, hd)))
    q = _bf16(rng.uniform(-1, 1, (rows, nh, hd)))
    return Case(q, k, v, np.arange(pages, dtype=np.int32), np.zeros(rows, np.int32),
                np.arange(ctx - rows, ctx, dtype=np.int32), window)


def _nonzero_values(rng, shape) -> np.ndarray:
    """bf16 values with 1/64 <= |v| <= 1: no zero, so copies keep their sign bit."""
    mag = rng.uniform(1 / 64, 1, shape)
    return _bf16(np.where(rng.random(shape) < 0.5, -mag, mag))


def _key_slot(case_bt, off: int, pos: int) -> tuple[int, int]:
    return int(case_bt[off + pos // PAGE]), pos % PAGE


def needle_positions(kind: str, qpos: int, window: int) -> tuple[int, int | None]:
    """(needle, decoy) positions for one row: the needle is the best visible key; the decoy,
    stronger still, sits where the kernel must not look (None: no decoy)."""
    fv = int(first_visible(qpos, window))
    mid_page = (fv // PAGE + qpos // PAGE + 1) // 2
    if kind == "first_visible":
        return fv, None
    if kind == "last_visible":
        return qpos, None
    if kind == "page_last_slot":
        return mid_page * PAGE - 1, None
    if kind == "page_first_slot":
        return mid_page * PAGE, None
    if kind == "causal_just_outside":
        return qpos - 3, qpos + 1
    if kind == "window_just_outside":
        if window <= 0:
            raise ValueError("needle kind 'window_just_outside' needs a sliding window > 0")
        return qpos - window // 2, qpos - window
    raise ValueError(f"unknown needle kind {kind!r}; known: {NEEDLE_KINDS_ANY + NEEDLE_KINDS_WINDOW}")


def needle_case(hd: int, nh: int, nkv: int, window: int, kind: str, seed: int) -> Case:
    """Decode rows at NEEDLE_QPOS, one sequence each, pages shuffled through the block table.
    Every key scores |s| <= hd/8 except the row's needle (s = hd) and decoy (s = 4 hd)."""
    rng = np.random.default_rng(seed)
    qpos = np.asarray(NEEDLE_QPOS, np.int32)
    seq_pages = qpos // PAGE + 2          # one page past the query's: later keys exist, unseen
    total = int(seq_pages.sum())
    k = rng.uniform(-NEEDLE_OTHER_MAX, NEEDLE_OTHER_MAX, (total, nkv, PAGE, hd)).astype(np.float32)
    v = _nonzero_values(rng, (total, nkv, PAGE, hd))
    bt = rng.permutation(total).astype(np.int32)
    off = np.concatenate([[0], np.cumsum(seq_pages)[:-1]]).astype(np.int32)
    winner = np.empty(qpos.size, np.int32)
    for r, qp in enumerate(qpos):
        needle, decoy = needle_positions(kind, int(qp), window)
        if not (visible(needle, qp, window) and (decoy is None or not visible(decoy, qp, window))):
            raise ValueError(f"needle_case {kind}: row {r} needle {needle} / decoy {decoy} break visibility")
        page, slot = _key_slot(bt, off[r], needle)
        k[page, :, slot, :] = NEEDLE_K
        if decoy is not None:
            dpage, dslot = _key_slot(bt, off[r], decoy)
            k[dpage, :, dslot, :] = DECOY_K
            if np.any(np.all(v[dpage, :, dslot] == v[page, :, slot], axis=-1)):
                raise ValueError(f"needle_case: seed {seed} gives the decoy the needle's V row; pick another seed")
        winner[r] = needle
    q = _bf16(np.ones((qpos.size, nh, hd)))
    return Case(q, _bf16(k), v, bt, off, qpos, window, winner)


def twin_needle_case(hd: int, nh: int, nkv: int, window: int, seed: int) -> Case:
    """needle_case's first_visible rows with a second needle at qpos: two keys score exactly hd,
    every other at most hd / 8. Both weights are exactly expf(0) = 1 and every other weight
    exactly 0 (the gap argument above), so l = 2 and acc = v1 + v2, both exact in f32 (bf16
    values in [1/64, 1]); the output is (v1 + v2) / 2 rounded once to bf16, nearest even:
    `mean_rows`. Unlike a single needle (v / 1, a copy), it divides and rounds."""
    case = needle_case(hd=hd, nh=nh, nkv=nkv, window=window, kind="first_visible", seed=seed)
    if np.any(case.winner == case.qpos):
        raise ValueError("twin_needle_case needs a window of at least 2: the two needles coincide")
    k = case.k_pool.astype(np.float32)
    for r, qp in enumerate(case.qpos):
        page, slot = _key_slot(case.bt, case.off[r], int(qp))
        k[page, :, slot, :] = NEEDLE_K
    return replace(case, k_pool=_bf16(k), twin=case.qpos.astype(np.int32))


def staircase_case(hd: int, nh: int, nkv: int, window: int, rising: bool, seed: int,
                   paired: bool = False, start: int = 0) -> Case:
    """Prefill of all STAIR_CTX positions of one sequence (its block-table row starts after
    another sequence's STAIR_PREFIX_PAGES entries; its pages are shuffled). Key j has every
    element c*(j+1) (rising) or c*(STAIR_CTX - j) (falling), c = STAIR_STEP_SCORE / hd, q = 1:
    neighbouring scores differ by exactly STAIR_STEP_SCORE, so each row copies the V row of
    its last visible key (rising) or its first (falling).

    paired (rising only): keys 2i and 2i + 1 share level i + 1, so an odd row's last two keys
    tie (weights exactly 1 and 1: the output is their V rows' mean, rounded once, `mean_rows`)
    and an even row's last key stands alone (a copy).

    start: the first query row's position (rows start..STAIR_CTX - 1; the keys are the same).
    Rows that start mid-page put a tile's last rows on a page its first row does not reach."""
    if not 0 <= start < STAIR_CTX:
        raise ValueError(f"staircase_case: start {start} is outside [0, {STAIR_CTX})")
    if paired and not rising:
        raise ValueError("staircase_case: paired levels are built for the rising staircase")
    rng = np.random.default_rng(seed)
    ctx = STAIR_CTX
    pages = -(-ctx // PAGE) + 1
    total = pages + STAIR_PREFIX_PAGES
    j = np.arange(pages * PAGE, dtype=np.float64)
    step = STAIR_STEP_SCORE / hd
    level = step * ((j // 2 if paired else j) + 1) if rising else step * (ctx - j)
    own = rng.permutation(total).astype(np.int32)
    bt = own                                   # entries [0, prefix) belong to the other sequence
    k = np.zeros((total, nkv, PAGE, hd), np.float32)
    k[bt[STAIR_PREFIX_PAGES:]] = level.reshape(pages, 1, PAGE, 1)
    kb = _bf16(k)
    if not np.array_equal(kb.astype(np.float64)[bt[STAIR_PREFIX_PAGES:], 0, :, 0].reshape(-1), level):
        raise ValueError(f"staircase_case: levels are not exact in bf16 for hd {hd}, ctx {ctx}")
    qpos = np.arange(start, ctx, dtype=np.int32)
    winner = (qpos if rising else first_visible(qpos, window)).astype(np.int32)
    twin = None
    if paired:
        if window == 1:
            raise ValueError("staircase_case: a paired staircase needs a window of 0 or at least 2")
        twin = np.where(qpos % 2 == 1, qpos - 1, qpos).astype(np.int32)
    return Case(_bf16(np.ones((len(qpos), nh, hd))), kb, _nonzero_values(rng, (total, nkv, PAGE, hd)), bt,
                np.full(len(qpos), STAIR_PREFIX_PAGES, np.int32), qpos, window, winner, twin)


def copy_rows(case: Case) -> np.ndarray:
    """The exact expected output of a needle case: out[r, h] = V row of winner[r], kv head h / g
    (a winner [rows, nkv] names one key per row and kv head: the ladder cases)."""
    g = case.nh // case.nkv
    heads = np.arange(case.nh) // g
    winner = np.asarray(case.winner)
    winner = winner[:, heads] if winner.ndim == 2 else winner[:, None]
    pages = case.bt[case.off[:, None] + winner // PAGE]
    slots = winner % PAGE
    return case.v_pool[pages, heads[None, :], slots]


def mean_rows(case: Case) -> np.ndarray:
    """The exact expected output of a tie (`twin`): bf16 of (V[winner] + V[twin]) / 2, rounded
    once to nearest even from a value exact in f32 (two bf16 values in [1/64, 1] add exactly,
    halving is exact); where twin == winner it is the copy."""
    if case.twin is None:
        raise ValueError("mean_rows needs a case with twin keys; use copy_rows for one winner")
    a = copy_rows(case).astype(np.float64)
    b = copy_rows(replace(case, winner=case.twin)).astype(np.float64)
    mean = (a + b) / 2
    if not np.array_equal(mean.astype(np.float32).astype(np.float64), mean):
        raise ValueError("mean_rows: the mean is not exact in f32; the expected bits would depend on the order")
    return mean.astype(bf16)


def live_pool_pages(case: Case) -> np.ndarray:
    """bool per pool page: does some row's visible page range [first_visible/16, qpos/16] hold it?"""
    live = np.zeros(case.k_pool.shape[0], bool)
    for o, fv, qp in zip(case.off, first_visible(case.qpos, case.window), case.qpos):
        live[case.bt[o + fv // PAGE:o + qp // PAGE + 1]] = True
    return live


# A block-table entry no row may follow: far past any pool (2^30 pages of
# at least 64 KiB each), so a kernel that follows it faults instead of reading stale data.
INVALID_PAGE = 1 << 30


def unseen_entries(case: Case) -> np.ndarray:
    """bool per block-table entry: True where no row's visible page range
    [first_visible / 16, qpos / 16] reaches it (the entry must never be followed)."""
    used = np.zeros(case.bt.size, bool)
    for o, fv, qp in zip(case.off, first_visible(case.qpos, case.window), case.qpos):
        used[o + fv // PAGE:o + qp // PAGE + 1] = True
    return ~used


def with_invalid_unseen_entries(case: Case) -> Case:
    """The same case with every unseen block-table entry set to INVALID_PAGE: an engine's
    stale or freed entries outside the window. Outputs must not change by a bit."""
    bt = np.array(case.bt, copy=True)
    bt[unseen_entries(case)] = INVALID_PAGE
    return replace(case, bt=bt)


def permuted_pool(case: Case, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(k, v, pmap): live pool pages moved to shuffled physical pages 1..n_live, none to its own
    number; physical page 0 is NaN in every element and every page no row may see maps to it."""
    rng = np.random.default_rng(seed)
    live = np.flatnonzero(live_pool_pages(case))
    pmap = np.zeros(case.k_pool.shape[0], np.int32)
    while True:   # no live page keeps its own number: ignoring the map must read another page
        pmap[live] = rng.permutation(live.size).astype(np.int32) + 1
        if not np.any(pmap[live] == live):
            break
    shape = (live.size + 1,) + case.k_pool.shape[1:]
    k = from_bits(np.full(shape, NAN_BF16, np.uint16), bf16)
    v = from_bits(np.full(shape, NAN_BF16, np.uint16), bf16)
    k[pmap[live]] = case.k_pool[live]
    v[pmap[live]] = case.v_pool[live]
    return k, v, pmap


# ------------------------------------------------------------------ window edges at page boundaries
#
# The kernels use a row's first visible key fv = first_visible(qpos, W) only as a page number,
# fv / 16 (the masking itself is key_visible's). So an error in fv shows only where it moves
# fv / 16: one key early is visible at fv = 0 mod 16 (one more page, all masked: an entry
# outside the window is followed), two keys early at fv = 0 or 1 mod 16, one key late at
# fv = 15 mod 16 (the page that holds the first visible key is skipped). The window-edge case
# puts each row's fv on those residues (and on 2 mod 16 and on key 0), with every earlier key
# a stronger decoy and the key at fv the row's winner.

EDGE_WINDOWS = (1, 16, 70)
# One tuple per sequence: the first visible key of each of its query rows, in row order. Rows
# of a sequence are listed latest first, so the row that sets a prefill tile's first page is
# not the tile's first row. fv residues mod 16: 0 (key 0), 1 and 0, 1, 3 and 2, 0 and 15.
EDGE_FIRST_VISIBLE = ((0,), (17, 16), (33,), (51, 50), (80, 79))
EDGE_SEED = 13
FLT_MAX = float(np.finfo(np.float32).max)
# Window 1: each row sees one key, whose weight is expf(s - s) = 1 for any finite score s, so
# its output is a copy of that key's V row whatever s is. The case gives those keys these
# scores, one per query head (nh 8), at the edges of f32: an empty online-softmax state must
# not be confused with a real score (its max starts at -inf; a start of 0 or -FLT_MAX would
# collide with the scores 0, negative ones, or -FLT_MAX below).
EXTREME_SCORES = (-FLT_MAX, -1.0, 0.0, FLT_MAX, -2.0 ** 126, 2.0 ** 126, -2.0 ** -60, -120.0)
# The window-1 keys' K row (every kv head): score = q[0] 2^63 + q[1] 2^55 + q[2] 2^47, each
# partial sum exact in f32. +-FLT_MAX = +-(2^24 - 1) 2^104 = +-255 (2^120 + 2^112 + 2^104):
# q[0..2] = +-(255 / 128) 2^64; any other score t: q[0] = t / 2^63.
EXTREME_K_HEAD = (2.0 ** 63, 2.0 ** 55, 2.0 ** 47)


def edge_rows(window: int) -> list[tuple[int, ...]]:
    """qpos of every row of the window-edge case, per sequence: fv + window - 1."""
    if window < 1:
        raise ValueError(f"edge_rows: the window-edge case needs a sliding window >= 1, got {window}")
    return [tuple(fv + window - 1 for fv in seq) for seq in EDGE_FIRST_VISIBLE]


def _extreme_q(score: float, hd: int) -> np.ndarray:
    q = np.zeros(hd)
    if abs(score) == FLT_MAX:
        q[:3] = np.copysign(255 / 128 * 2.0 ** 64, score)
    else:
        q[0] = score / EXTREME_K_HEAD[0]
    return q


def kernel_score(q_row, k_row, scale: float = 1.0):
    """The kernels' f32 score of query rows against key rows (broadcast over leading axes), in
    their order: each lane l chains fmaf over its elements c * 256 + l * 8 + i (c, then i), then
    a butterfly x += shfl_xor(x, o) for o = 16 .. 1, then * scale. bf16 products are exact in
    f32, so an f32 add after an exact product is the kernels' fmaf."""
    q = np.asarray(q_row, np.float32)
    k = np.asarray(k_row, np.float32)
    lead = np.broadcast_shapes(q.shape[:-1], k.shape[:-1])
    q = np.broadcast_to(q, lead + q.shape[-1:]).reshape(lead + (-1, 32, 8))   # [..., chunks, lanes, 8]
    k = np.broadcast_to(k, lead + k.shape[-1:]).reshape(lead + (-1, 32, 8))
    s = np.zeros(lead + (32,), np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        for c in range(q.shape[-3]):
            for i in range(8):
                s = (s + q[..., c, :, i] * k[..., c, :, i]).astype(np.float32)
        for o in (16, 8, 4, 2, 1):
            s = (s + s[..., np.arange(32) ^ o]).astype(np.float32)
        out = (s[..., 0] * np.float32(scale)).astype(np.float32)
    return out[()] if out.ndim == 0 else out


def window_edge_case(hd: int, nh: int, nkv: int, window: int, seed: int = EDGE_SEED) -> Case:
    """Rows of EDGE_FIRST_VISIBLE (one block-table row per sequence, pages shuffled, one page
    past each sequence's last query page), a falling staircase in every sequence: key j has
    every element c (STAIR_CTX - j), c = STAIR_STEP_SCORE / hd, q = 1, so each row copies the V
    row of its first visible key and every earlier key (the key just outside the window first)
    beats it by at least 128 if it leaks.

    window 1: each row's one visible key gets the score EXTREME_SCORES[h] in head h (needs
    nh = 8): still a copy, see EXTREME_SCORES."""
    rng = np.random.default_rng(seed)
    seqs = edge_rows(window)
    seq_pages = [max(s) // PAGE + 2 for s in seqs]
    total = sum(seq_pages)
    if max(max(s) for s in seqs) >= STAIR_CTX:
        raise ValueError(f"window_edge_case: window {window} puts a query past key {STAIR_CTX - 1}, "
                         "where the staircase levels stop being exact in bf16")
    bt = rng.permutation(total).astype(np.int32)
    starts = np.concatenate([[0], np.cumsum(seq_pages)[:-1]]).astype(np.int32)
    step = STAIR_STEP_SCORE / hd
    k = np.zeros((total, nkv, PAGE, hd), np.float32)
    for o, n in zip(starts, seq_pages):
        j = np.arange(n * PAGE, dtype=np.float64)
        k[bt[o:o + n]] = (step * (STAIR_CTX - j)).reshape(n, 1, PAGE, 1)
    off = np.concatenate([[o] * len(s) for o, s in zip(starts, seqs)]).astype(np.int32)
    qpos = np.concatenate(seqs).astype(np.int32)
    winner = first_visible(qpos, window).astype(np.int32)
    if not np.array_equal(winner, np.concatenate(EDGE_FIRST_VISIBLE)):
        raise AssertionError("window_edge_case: the rows' first visible keys are not EDGE_FIRST_VISIBLE")
    q = np.ones((qpos.size, nh, hd))
    if window == 1:
        if nh != len(EXTREME_SCORES):
            raise ValueError(f"window_edge_case: window 1 gives head h the score EXTREME_SCORES[h]; "
                             f"it needs nh = {len(EXTREME_SCORES)}, got {nh}")
        q[:] = np.stack([_extreme_q(s, hd) for s in EXTREME_SCORES])
        head_k = np.zeros(hd)
        head_k[:len(EXTREME_K_HEAD)] = EXTREME_K_HEAD
        for o, w in zip(off, winner):
            page, slot = _key_slot(bt, o, int(w))
            k[page, :, slot, :] = head_k
    kb = _bf16(k)
    if not np.array_equal(kb.astype(np.float32), k):
        raise ValueError(f"window_edge_case: K is not exact in bf16 for hd {hd}")
    return Case(_bf16(q), kb, _nonzero_values(rng, (total, nkv, PAGE, hd)), bt, off, qpos, window, winner)


def winner_scores(case: Case) -> np.ndarray:
    """[rows, nh] f32: each row's score against its winner key, as the kernels compute it."""
    g = case.nh // case.nkv
    out = np.empty((case.rows, case.nh), np.float32)
    for r in range(case.rows):
        page, slot = _key_slot(case.bt, case.off[r], int(case.winner[r]))
        for h in range(case.nh):
            out[r, h] = kernel_score(case.q[r, h], case.k_pool[page, h // g, slot])
    return out


# ------------------------------------------------------------------ the split-K plan, seen in the partials


def split_chunks(case: Case, splits: int) -> np.ndarray:
    """[rows, splits, 2]: the logical pages [begin, end) of each decode split, as
    docs/paged_attention.md states the plan: the row's visible pages [fv / 16, qpos / 16] cut
    into chunks of ceil(pages / splits) from the first; trailing chunks may be empty."""
    out = np.zeros((case.rows, splits, 2), np.int64)
    for r, (fv, qp) in enumerate(zip(first_visible(case.qpos, case.window), case.qpos)):
        lo, hi = int(fv) // PAGE, int(qp) // PAGE
        per = -(-(hi - lo + 1) // splits)
        for s in range(splits):
            begin = lo + s * per
            out[r, s] = (begin, max(begin, min(hi + 1, begin + per)))
    return out


def split_partials(case: Case, splits: int) -> np.ndarray:
    """[rows, nh, splits, hd + 2] f32: each decode split's partial (m, l, acc[hd]) on a falling
    staircase (window_edge_case with a window > 1). A chunk's best key is its first visible key
    (every later one scores at least 128 less), so m is that key's score, l = 1 and acc its V
    row, exactly (the needle argument per split); an empty chunk leaves (-inf, 0, +0)."""
    if case.window <= 1:
        raise ValueError("split_partials needs the falling staircase of window_edge_case with a window > 1")
    g = case.nh // case.nkv
    parts = np.zeros((case.rows, case.nh, splits, case.hd + 2), np.float32)
    fv = first_visible(case.qpos, case.window)
    for r, chunks in enumerate(split_chunks(case, splits)):
        for s, (begin, end) in enumerate(chunks):
            if begin == end:
                parts[r, :, s, 0] = -np.inf
                continue
            key = max(int(fv[r]), int(begin) * PAGE)
            page, slot = _key_slot(case.bt, case.off[r], key)
            heads = np.arange(case.nh) // g
            parts[r, :, s, 0] = kernel_score(case.q[r], case.k_pool[page, heads, slot])   # every head at once
            parts[r, :, s, 1] = 1.0
            parts[r, :, s, 2:] = case.v_pool[page, heads, slot].astype(np.float32)
    return parts


# ------------------------------------------------------------------ inputs whose bits show any change of order
#
# Batch invariance and determinism are claims about bits, and a reordered f32 sum usually
# moves its result by an ulp of f32, which the bf16 output rounds away: on uniform random
# inputs a regrouped accumulation changes about one output element in two thousand (host
# emulation of the decode kernel, 16 against 11 splits), too few for a gate to rely on. The
# cancelling case makes a regrouping visible: on pairs of pages every row of the sequence sees
# in full, the even slots hold V values +B m in the first page and -B m in the second
# (B = CANCEL_BIG, m in [1, 2) with 8 significant bits: exact in bf16) under equal K rows, so
# the two keys score alike and their exact contributions cancel. The f32 sums still carry
# values of size B on the way, so each addition leaves a rounding of the order of B 2^-24
# against outputs of the order of 0.1: the output's low bits are that residue, and another
# grouping or order of the additions changes most of them (emulated: 16 against 11 splits
# changes 1600 to 1900 of a row's 2048 elements; one CTA adding its four warps in another order
# changes 10 to 150 elements of its head). The output is still attention: rel_rms against the
# float64 reference about 2e-2 (emulated). The odd slots and every other page hold
# uniform(-1, 1) values.

CANCEL_BIG = 2.0 ** 16


def cancelling_case(hd: int, nh: int, nkv: int, window: int, seqs, seed: int) -> Case:
    """One block-table row per sequence (pages shuffled through the table, one spare page past
    each sequence's last query page); `seqs` holds the query positions of each sequence's rows,
    in row order. q, K and V uniform(-1, 1), then the cancelling pairs above on the pages every
    row of the sequence sees in full, paired from the first such page on."""
    rng = np.random.default_rng(seed)
    seqs = [tuple(int(x) for x in s) for s in seqs]
    seq_pages = [max(s) // PAGE + 2 for s in seqs]
    total = sum(seq_pages)
    bt = rng.permutation(total).astype(np.int32)
    starts = np.concatenate([[0], np.cumsum(seq_pages)[:-1]]).astype(np.int32)
    k = rng.uniform(-1, 1, (total, nkv, PAGE, hd)).astype(np.float32)
    v = rng.uniform(-1, 1, (total, nkv, PAGE, hd)).astype(np.float32)
    for o, s in zip(starts, seqs):
        first_full = -(-int(first_visible(np.asarray(s), window).max()) // PAGE)
        last_full = (min(s) + 1) // PAGE - 1
        for p in range(first_full, last_full, 2):          # pairs (p, p + 1), both seen in full
            a, b = bt[o + p], bt[o + p + 1]
            mant = 1 + rng.integers(0, 128, (nkv, PAGE // 2, hd)) / 128
            big = np.where(rng.random(mant.shape) < 0.5, -1.0, 1.0) * CANCEL_BIG * mant
            v[a, :, 0::2], v[b, :, 0::2] = big, -big
            k[b, :, 0::2] = k[a, :, 0::2]
    off = np.concatenate([[o] * len(s) for o, s in zip(starts, seqs)]).astype(np.int32)
    qpos = np.concatenate([np.asarray(s) for s in seqs]).astype(np.int32)
    return Case(_bf16(rng.uniform(-1, 1, (qpos.size, nh, hd))), _bf16(k), _bf16(v), bt, off, qpos, window)


def sequences(case: Case) -> list[tuple[np.ndarray, int, int]]:
    """Per sequence of a case whose sequences own consecutive block-table ranges, in table order
    (cancelling_case, needle_case): (its rows, its table start, its number of table entries)."""
    starts = np.unique(case.off)
    ends = np.append(starts[1:], case.bt.size)
    return [(np.flatnonzero(case.off == o), int(o), int(e - o)) for o, e in zip(starts, ends)]


def batch_case(case: Case, seqs, table=None) -> Case:
    """The batch an engine would launch for the sequences `seqs` (indexes into sequences(case),
    repeats allowed): their rows in that order, each occurrence with its own copy of its
    block-table row (placed one after the other, so a row's offset depends on its place), read
    from `table` (case.bt renumbered for another placement of the pool; default case.bt)."""
    table = case.bt if table is None else np.asarray(table)
    layout = sequences(case)
    rows, offs, bts, at = [], [], [], 0
    for s in seqs:
        r, start, n = layout[int(s)]
        rows.append(r)
        offs.append(np.full(r.size, at, np.int32))
        bts.append(table[start:start + n])
        at += n
    rows = np.concatenate(rows)
    return Case(case.q[rows], case.k_pool, case.v_pool, np.concatenate(bts).astype(np.int32),
                np.concatenate(offs), case.qpos[rows].astype(np.int32), case.window)


def moved_pool(case: Case, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(k, v, table): the case's pool with its pages moved to other places (a permutation
    without fixed points) and its block table renumbered to match: the same sequences at other
    physical pages, as a serving engine's allocator would place them for another batch."""
    rng = np.random.default_rng(seed)
    n = case.k_pool.shape[0]
    while True:
        perm = rng.permutation(n)
        if not np.any(perm == np.arange(n)):
            break
    k, v = np.empty_like(case.k_pool), np.empty_like(case.v_pool)
    k[perm], v[perm] = case.k_pool, case.v_pool
    return k, v, perm[case.bt].astype(np.int32)


# ------------------------------------------------------------------ ladders: exact anchors at any shape
#
# The needle and the staircase are exact because the winner outscores every other visible key by
# more than 104 (each other weight expf underflows to exactly 0, the winner's is exactly 1: the
# output is a copy of its V row). The staircase's levels c (j + 1) stop being exact in bf16 past
# 256 keys; the ladder keeps the argument at any length by climbing the positive integers bf16
# holds exactly (1 .. 256, then every second one to 512, every fourth to 1024, ...). With q = 1
# and K = c L (c = 128 / hd), a key's score is 128 L, exact in f32 in any order (8 or 16 equal
# products a lane, then the butterfly: sums of equal values of 8 significant bits), and
# neighbouring levels differ by at least 1, so scores by at least 128.
#
# A sequence's span [lo, hi] (every key some row of it sees) climbs one way per kv head: rising
# (hi highest: each row copies its last visible key, qpos) or falling (lo highest: each row
# copies its first visible key). Each key no row of the sequence sees holds DECOY, above the
# whole ladder, and every block-table entry outside the span names a page of decoys: a key let
# through the causal mask (rising) or the window (falling), a page walked one too far, an entry
# followed outside the span, each puts a decoy's V row in the output. The directions alternate
# with the kv head (and the sequence), so a query head reading another kv head copies another
# key, and `flip` swaps them: two launches see both directions on every kv head.

LADDER_MAX = 8192   # keys a span climbs at most: levels up to 2^70, scores 2^77, far inside f32


def ladder_levels(n: int) -> np.ndarray:
    """The first n positive integers exact in bf16, ascending (float64): 256 to the first
    octave, 128 to each after it."""
    if not 0 <= n <= LADDER_MAX:
        raise ValueError(f"ladder_levels: {n} levels; a ladder climbs at most {LADDER_MAX}")
    head = np.arange(1.0, min(n, 256) + 1)
    rest = n - head.size
    octaves = -(-rest // 128)
    tail = [2.0 ** (8 + k) * (1 + np.arange(1, 129) / 128) for k in range(octaves)]
    out = np.concatenate([head, *tail])[:n] if rest > 0 else head
    return out


DECOY_LEVEL = 2.0 ** (int(np.log2(ladder_levels(LADDER_MAX)[-1])) + 2)   # above every level: 2^72


def _nonzero_bf16(rng, shape) -> np.ndarray:
    """Random bf16 values with 2^-7 <= |v| < 2 (no zero: a copy keeps its sign), made from
    random bits at once: a random sign, mantissa and low three exponent bits, the exponent's
    high bits 01111 (exponents 120 .. 127)."""
    return from_bits((rng.integers(0, 1 << 16, size=shape, dtype=np.uint16) & 0x83FF) | 0x3C00, bf16)


@dataclass(frozen=True)
class LadderPlan:
    """Where a ladder case's keys live, without its K and V (cheap: a structural gate holds
    every shape of a sweep to the launcher with it). `seqs[s]` holds sequence s's rows (row ids),
    `spans[s]` its (lo, hi) and `pages[s]` the physical page of each of its span's logical
    pages, from lo // 16 on; `bt`, `off`, `qpos` are the launch's; page `decoy` is all decoys;
    the last page (`num_pages - 1`) is never named by the table (spare: a read a little past a
    named page stays inside the pool)."""

    hd: int
    nh: int
    nkv: int
    window: int
    qpos: np.ndarray
    off: np.ndarray
    bt: np.ndarray
    seqs: tuple
    spans: tuple
    pages: tuple
    num_pages: int
    decoy: int

    @property
    def rows(self) -> int:
        return int(self.qpos.size)


def ladder_plan(hd: int, nh: int, nkv: int, window: int, seqs, seed: int, prefix: int = 0) -> LadderPlan:
    """One block-table row per sequence (`seqs`: the query positions of each sequence's rows, in
    row order), after `prefix` entries of another sequence; each row names its sequence's
    logical pages 0 .. (last qpos) / 16 + 1. The span's pages go to shuffled physical pages;
    every other entry names the decoy page."""
    if nh % nkv:
        raise ValueError(f"ladder_plan: nh {nh} is not a multiple of nkv {nkv}")
    rng = np.random.default_rng([seed, hd, nh, nkv, window])
    seqs = [np.asarray(s, np.int64) for s in seqs]
    spans = [(int(first_visible(s, window).min()), int(s.max())) for s in seqs]
    for lo, hi in spans:
        if hi - lo + 1 > LADDER_MAX:
            raise ValueError(f"ladder_plan: a span of {hi - lo + 1} keys; a ladder climbs at most {LADDER_MAX}")
    counts = [hi // PAGE - lo // PAGE + 1 for lo, hi in spans]
    num_pages = sum(counts) + 2
    perm = rng.permutation(num_pages - 1).astype(np.int32)
    decoy, free = int(perm[0]), perm[1:]
    pages, tables, offs, rows, at, used = [], [], [], [], prefix, 0
    for s, ((lo, hi), n) in enumerate(zip(spans, counts)):
        phys = free[used:used + n]
        used += n
        table = np.full(hi // PAGE + 2, decoy, np.int32)
        table[lo // PAGE:hi // PAGE + 1] = phys
        pages.append(phys)
        tables.append(table)
        offs.append(np.full(seqs[s].size, at, np.int32))
        rows.append(np.arange(sum(x.size for x in seqs[:s]), sum(x.size for x in seqs[:s + 1])))
        at += table.size
    bt = np.concatenate([np.full(prefix, decoy, np.int32), *tables])
    return LadderPlan(hd, nh, nkv, window, np.concatenate(seqs).astype(np.int32), np.concatenate(offs), bt,
                      tuple(rows), tuple(spans), tuple(pages), num_pages, decoy)


def ladder_case(plan: LadderPlan, flip: int = 0, seed: int = 0) -> Case:
    """The plan's K, V and q (q = 1; V random, no zero) and each (row, kv head)'s winner:
    sequence s climbs rising on kv head j when s + j + flip is even, falling otherwise."""
    rng = np.random.default_rng([seed, plan.num_pages, plan.nkv, plan.hd])
    levels = np.full((plan.num_pages, plan.nkv, PAGE), DECOY_LEVEL)
    winner = np.empty((plan.rows, plan.nkv), np.int32)
    fv = first_visible(plan.qpos, plan.window)
    for s, (rows, (lo, hi), phys) in enumerate(zip(plan.seqs, plan.spans, plan.pages)):
        keys = (lo // PAGE + np.arange(phys.size))[:, None] * PAGE + np.arange(PAGE)[None, :]   # [pages, 16]
        inside = (keys >= lo) & (keys <= hi)
        ladder = ladder_levels(hi - lo + 1)
        for j in range(plan.nkv):
            rising = (s + j + flip) % 2 == 0
            at = np.clip(keys - lo if rising else hi - keys, 0, hi - lo)
            levels[phys, j] = np.where(inside, ladder[at], DECOY_LEVEL)
            winner[rows, j] = plan.qpos[rows] if rising else fv[rows]
    k_bits = bits_of(_bf16(levels * (128.0 / plan.hd)))
    k = from_bits(np.ascontiguousarray(np.broadcast_to(k_bits[..., None], levels.shape + (plan.hd,))), bf16)
    v = _nonzero_bf16(rng, (plan.num_pages, plan.nkv, PAGE, plan.hd))
    q = from_bits(np.full((plan.rows, plan.nh, plan.hd), 0x3F80, np.uint16), bf16)   # bf16 1.0
    return Case(q, k, v, plan.bt, plan.off, plan.qpos, plan.window, winner)
