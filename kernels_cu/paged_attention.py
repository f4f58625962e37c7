"""Launchers for kernels_cu/paged_attention.cu: split-K paged decode, its combine kernel,
and paged prefill over row tiles.

Layouts (bf16 tensors travel as uint16 bits, or as an ml_dtypes bfloat16 array):

- q, out: [rows, nh, hd]
- k_pool, v_pool: [num_pages, nkv, 16, hd]
- bt (int32, 1-D): a row's logical page p is pool page bt[off[row] + p]
- off, qpos (int32, [rows]): block-table row start and query position of each row
- pmap (int32, 1-D, optional): pool page -> physical page of a permuted pool

Every argument check runs on shapes, dtypes and Python ints before the device is touched,
so the refusals hold on a machine with no GPU (numpy arrays stand in for device arrays).
The launcher owns the grid maths; the kernels trust it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from harness.library.kernels import module
from harness.library.launch import Refusal, check_int32_vector, ptr_or_null, require

SOURCE = "paged_attention.cu"
PAGE = 16
HEAD_SIZES = (256, 512)
MAX_SPLITS = 16
DECODE_THREADS = 128          # pa::DECODE_WARPS * 32 in the .cu
SM_TARGET = 132               # a fixed CTA target: splits never depend on the device that runs
MIN_PAGES_PER_SPLIT = 4
_ROWS_PER_TILE = {256: 8, 512: 4}

NAME_EXPRESSIONS = tuple(
    [f"paged_decode<{hd}>" for hd in HEAD_SIZES]
    + [f"paged_combine<{hd}>" for hd in HEAD_SIZES]
    + [f"paged_prefill<{hd}, {_ROWS_PER_TILE[hd]}>" for hd in HEAD_SIZES]
)


def _module():
    return module(SOURCE, name_expressions=NAME_EXPRESSIONS)


# ------------------------------------------------------------------ plans (pure, host ints)


def check_head_size(hd: int) -> None:
    if hd not in HEAD_SIZES:
        raise Refusal(
            f"paged attention: head size {hd} is not supported; the kernels are built for head sizes "
            f"{' and '.join(map(str, HEAD_SIZES))} (pad the head or add an instantiation)"
        )


def prefill_rows_per_tile(hd: int) -> int:
    """Query rows per prefill CTA (one warp each): the ROWS template argument for `hd`."""
    check_head_size(hd)
    return _ROWS_PER_TILE[hd]


def choose_splits(kv_len: int, rows: int, nh: int, *, fixed: int | None = None) -> int:
    """Deterministic split count for decode: enough CTAs to fill about two waves of
    SM_TARGET SMs, at least MIN_PAGES_PER_SPLIT pages per split, at most MAX_SPLITS.
    `kv_len` is the longest visible range (min(ctx, window) for sliding layers).

    That count depends on the batch (its rows, and its longest row), and a row's output bits
    depend on its split count (the f32 sums are grouped by split): the same row decoded alone
    and in a batch may differ in the last bits. `fixed` is the batch-invariant mode: an engine
    that needs a row's bits not to depend on the batch around it pins one count per model (say
    choose_splits(longest context, 1, nh)) and passes it here; it is checked and returned
    whatever the batch. docs/paged_attention.md, "Batch invariance and determinism"."""
    for name, v in (("kv_len", kv_len), ("rows", rows), ("nh", nh)):
        if not isinstance(v, (int, np.integer)) or v <= 0:
            raise Refusal(f"choose_splits: {name} must be a positive int, got {v!r}")
    if fixed is not None:
        if isinstance(fixed, bool) or not isinstance(fixed, (int, np.integer)) or not 1 <= fixed <= MAX_SPLITS:
            raise Refusal(f"choose_splits: fixed={fixed!r} must be an int in 1..{MAX_SPLITS} (the split count "
                          f"every batch uses, the batch-invariant mode); pass None for the count chosen per batch")
        return int(fixed)
    want = -(-2 * SM_TARGET // (rows * nh))
    by_pages = -(-(-(-kv_len // PAGE)) // MIN_PAGES_PER_SPLIT)
    return int(max(1, min(MAX_SPLITS, want, by_pages)))


def decode_scratch_floats(rows: int, nh: int, splits: int, hd: int) -> int:
    """f32 elements of the split-K partials: (max, sum, acc[hd]) per (row, head, split)."""
    return rows * nh * splits * (hd + 2)


@dataclass(frozen=True)
class Tiles:
    """Prefill row tiles: tile i covers rows start[i] .. start[i] + length[i] - 1."""

    start: np.ndarray
    length: np.ndarray

    def __len__(self) -> int:
        return int(self.start.size)


def make_tiles(off, rows_per_tile: int) -> Tiles:
    """Consecutive rows sharing a block-table row (one sequence), `rows_per_tile` at most per
    tile. `off` is the host copy of the rows' block-table offsets."""
    off = np.asarray(off)
    if off.ndim != 1 or off.size == 0:
        raise Refusal(f"make_tiles: off must be a non-empty 1-D array of block-table offsets, got shape {off.shape}")
    if rows_per_tile <= 0:
        raise Refusal(f"make_tiles: rows_per_tile must be positive, got {rows_per_tile}")
    starts, lengths = [], []
    begin = 0
    for r in range(1, off.size + 1):
        if r == off.size or off[r] != off[begin] or r - begin == rows_per_tile:
            starts.append(begin)
            lengths.append(r - begin)
            begin = r
    return Tiles(np.asarray(starts, np.int32), np.asarray(lengths, np.int32))


# ------------------------------------------------------------------ argument checks


def _is_bf16(a) -> bool:
    return a.dtype == np.uint16 or a.dtype.name == "bfloat16"


_need = require


def _check_int32_vector(name: str, a, length: int | None, what: str) -> None:
    check_int32_vector("paged attention", name, a, length,
                       what if length is None else f"{what}: one per query row")


def check_common(out, q, k_pool, v_pool, bt, off, qpos, pmap, window) -> tuple[int, int, int, int]:
    """Shapes, dtypes, head size, GQA, window, block table. Returns (rows, nh, nkv, hd)."""
    _need(q.ndim == 3, f"paged attention: q must be [rows, nh, hd], got shape {q.shape}")
    rows, nh, hd = (int(x) for x in q.shape)
    check_head_size(hd)
    _need(_is_bf16(q) and q.flags.c_contiguous, f"paged attention: q must be contiguous bf16 bits (uint16), got {q.dtype}")
    _need(out.shape == q.shape and _is_bf16(out) and out.flags.c_contiguous,
          f"paged attention: out must be contiguous bf16 bits of q's shape {q.shape}, got {out.dtype} {out.shape}")
    _need(k_pool.ndim == 4 and k_pool.shape[2] == PAGE and k_pool.shape[3] == hd,
          f"paged attention: k_pool must be [num_pages, nkv, {PAGE}, {hd}] (page size {PAGE}, q's head size), "
          f"got shape {k_pool.shape}")
    _need(v_pool.shape == k_pool.shape, f"paged attention: v_pool shape {v_pool.shape} differs from k_pool's {k_pool.shape}")
    for name, a in (("k_pool", k_pool), ("v_pool", v_pool)):
        _need(_is_bf16(a) and a.flags.c_contiguous, f"paged attention: {name} must be contiguous bf16 bits (uint16), got {a.dtype}")
    nkv = int(k_pool.shape[1])
    _need(nkv > 0 and nh % nkv == 0,
          f"paged attention: GQA needs nh divisible by nkv, got nh={nh}, nkv={nkv}")
    _need(isinstance(window, (int, np.integer)) and not isinstance(window, bool) and 0 <= window < 2**31,
          f"paged attention: window must be a non-negative int (0 = no sliding window), got {window!r}")
    _need(bt.ndim == 1 and bt.size > 0,
          f"paged attention: block table must be a non-empty 1-D int32 array (rows index it through off), "
          f"got shape {bt.shape}; flatten a [seqs, pages] table and pass off = seq * pages")
    _check_int32_vector("block table", bt, None, "pool page of each logical page")
    _check_int32_vector("off", off, rows, "each row's start in the block table")
    _check_int32_vector("qpos", qpos, rows, "each row's position")
    if pmap is not None:
        _check_int32_vector("pmap", pmap, None, "pool page -> physical page")
    return rows, nh, nkv, hd


def check_decode_args(out, q, k_pool, v_pool, bt, off, qpos, pmap, window, scratch, splits, counters):
    rows, nh, nkv, hd = check_common(out, q, k_pool, v_pool, bt, off, qpos, pmap, window)
    _need(isinstance(splits, (int, np.integer)) and 1 <= splits <= MAX_SPLITS,
          f"paged decode: splits must be an int in 1..{MAX_SPLITS}, got {splits!r}; use choose_splits()")
    need = decode_scratch_floats(rows, nh, int(splits), hd)
    _need(scratch.dtype == np.float32 and scratch.flags.c_contiguous,
          f"paged decode: scratch must be contiguous float32, got {scratch.dtype}")
    _need(scratch.size >= need,
          f"paged decode: scratch holds {scratch.size} floats but {rows} rows x {nh} heads x {splits} splits "
          f"x (hd {hd} + 2) need {need}; allocate decode_scratch_floats(rows, nh, splits, hd) floats")
    if counters is not None:
        _need(counters.dtype == np.int32 and counters.size >= rows * nh,
              f"paged decode: counters must be int32 with one zeroed ticket per (row, head) = {rows * nh}, "
              f"got {counters.dtype} of size {counters.size}")
    return rows, nh, nkv, hd


def check_prefill_args(out, q, k_pool, v_pool, bt, off, qpos, pmap, window, tiles: Tiles):
    rows, nh, nkv, hd = check_common(out, q, k_pool, v_pool, bt, off, qpos, pmap, window)
    per = prefill_rows_per_tile(hd)
    start, length = np.asarray(tiles.start), np.asarray(tiles.length)
    _need(start.shape == length.shape and start.ndim == 1 and start.size > 0,
          f"paged prefill: tiles must be non-empty matching 1-D start/length arrays, got {start.shape} and {length.shape}")
    _need(int(length.max()) <= per and int(length.min()) >= 1,
          f"paged prefill: a tile holds {int(length.max())} rows but the hd {hd} kernel stages {per} rows per tile; "
          f"build tiles with make_tiles(off, prefill_rows_per_tile({hd}))")
    ends = start.astype(np.int64) + length
    _need(int(start[0]) == 0 and bool(np.all(start[1:] == ends[:-1])) and int(ends[-1]) == rows,
          f"paged prefill: tiles must cover rows 0..{rows - 1} once, in order; build them with make_tiles")
    return rows, nh, nkv, hd


# ------------------------------------------------------------------ launches


_ptr_or_null = ptr_or_null


def _bits(a):
    """The device array as uint16 bits (CuPy kernels take raw pointers either way)."""
    return a if a.dtype == np.uint16 else a.view(np.uint16)


def paged_decode(out, q, k_pool, v_pool, bt, off, qpos, *, scratch, splits: int, counters=None,
                 pmap=None, window: int = 0, scale: float = 1.0) -> None:
    """Split-K decode. With `counters` (int32, zeroed, one per (row, head)) the last CTA to
    arrive merges and resets its counter; without, paged_combine merges."""
    rows, nh, nkv, hd = check_decode_args(out, q, k_pool, v_pool, bt, off, qpos, pmap, window,
                                          scratch, splits, counters)
    m = _module()
    m.get(f"paged_decode<{hd}>")(
        (int(splits), nh, rows), (DECODE_THREADS, 1, 1),
        (_bits(out), scratch, _ptr_or_null(counters), _bits(q), _bits(k_pool), _bits(v_pool), bt, off, qpos,
         _ptr_or_null(pmap), np.int32(nh), np.int32(nkv), np.int32(window), np.int32(splits), np.float32(scale)))
    if counters is None:
        m.get(f"paged_combine<{hd}>")((nh, rows, 1), (DECODE_THREADS, 1, 1),
                                      (_bits(out), scratch, np.int32(nh), np.int32(splits)))


def paged_prefill(out, q, k_pool, v_pool, bt, off, qpos, tiles: Tiles, *, pmap=None, window: int = 0,
                  scale: float = 1.0) -> None:
    """Prefill: every row attends causally (and within the window) over its sequence's pages."""
    import cupy

    rows, nh, nkv, hd = check_prefill_args(out, q, k_pool, v_pool, bt, off, qpos, pmap, window, tiles)
    per = prefill_rows_per_tile(hd)
    start = cupy.asarray(np.asarray(tiles.start, np.int32))
    length = cupy.asarray(np.asarray(tiles.length, np.int32))
    _module().get(f"paged_prefill<{hd}, {per}>")(
        (len(tiles), nh, 1), (per * 32, 1, 1),
        (_bits(out), _bits(q), _bits(k_pool), _bits(v_pool), bt, off, qpos, start, length, _ptr_or_null(pmap),
         np.int32(nh), np.int32(nkv), np.int32(window), np.float32(scale)))

