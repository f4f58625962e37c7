"""Shared helpers of the quantized GEMV gates: one helper an arm, device uploads, sentinels.

Every kernel call of the family is spelled here once. Outputs are allocated filled with a
sentinel (a bf16 NaN payload no kernel computes from finite inputs), so an output the
kernel never wrote is visible, and NVFP4 outputs carry a sentinel tail past N.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from harness import host_cache
from harness.library.buffers import BF16_SENTINEL, INDEX_32, fenced, filled, to_device, to_host
from harness.library.dtypes import bf16, to_bf16
from kernels_cu import fp8_gemv, lm_head, nvfp4_gemv
from oracles.quant_gemv import (Fp8GemvCase, Fp8Inputs, LmHeadCase, LmHeadFarRowsCase, LmHeadSweepCase, Nvfp4Case,
                                lm_head_block_partials, lm_head_edge_case, lm_head_positional_case)

SENTINEL = BF16_SENTINEL  # bf16 NaN with a payload; a kernel's NaN would be 0x7fc0 or 0x7fff
TAIL = 16  # sentinel outputs past N


def bf16_sentinels(shape):
    return filled(shape, bf16, SENTINEL)


def shaped(shape, dtype) -> np.ndarray:
    """A host array of `shape` and `dtype`, C-contiguous, that holds no memory (every element
    is one element, read-only): what a launcher's argument checks read (shape, dtype, layout)
    for a structural gate's shapes, the big-index ones (gigabytes) included."""
    dtype = np.dtype(dtype)
    strides, step = [], dtype.itemsize
    for d in reversed(shape):
        strides.append(step)
        step *= int(d)
    return np.lib.stride_tricks.as_strided(np.zeros(1, dtype), tuple(shape), tuple(reversed(strides)),
                                           writeable=False)


def run_fp8_gemv(case: Fp8GemvCase):
    """The FP8 GEMV arm: y [T, N] on the device (sentinel where the kernel did not write)."""
    import cupy

    segments = [(cupy.asarray(w), cupy.asarray(ws)) for w, ws in case.segments]
    y = bf16_sentinels(case.expected.shape)
    fp8_gemv.run_fp8_gemv(y, cupy.asarray(case.x), cupy.asarray(case.xs), segments)
    return y


PAD_W8 = 0x38  # e4m3 1.0: what lies past each FP8 segment's last row (nonzero, defined memory)


def run_fp8_gemv_with_tail(case: Fp8GemvCase):
    """The FP8 GEMV arm writing into the head of a sentinel buffer TAIL elements longer than
    T * N: (y [T, N], the TAIL sentinels after it). Each segment's weights and scales are
    views of allocations one block of rows longer, so a warp past N (a tail guard removed)
    reads defined memory and its write lands in the tail or in the next token's row."""
    import cupy

    t, n = case.expected.shape
    segments = []
    for w, ws in case.segments:  # views of allocations ROWS_PER_BLOCK rows longer: w PAD_W8, ws 1.0
        rows, k = w.shape
        pad = fp8_gemv.ROWS_PER_BLOCK
        wd = cupy.asarray(np.concatenate([w, np.full((pad, k), PAD_W8, dtype=np.uint8)]))
        wsd = cupy.asarray(np.concatenate([ws, np.full(pad, 1.0, dtype=np.float32)]))
        segments.append((wd[:rows], wsd[:rows]))
    flat = bf16_sentinels((t * n + TAIL,))
    fp8_gemv.run_fp8_gemv(flat[:t * n].reshape(t, n), cupy.asarray(case.x), cupy.asarray(case.xs), segments)
    return flat[:t * n].reshape(t, n), flat[t * n:]


# The fenced arms (the memory-safety gates "reads nothing outside its inputs"): every input
# is a view into the middle of an allocation three times its size, the fences a NaN of the
# input's type. A read up to a whole buffer before or past an input (another token's or
# row's offset negated, a chunk index walking backwards, one row too many) reads a NaN into
# a dot: an output the gate names by assertion. A read further away faults, in a gate
# written for exactly that property (docs/mutation.md, Verdicts).
E4M3_NAN = 0x7F
F32_NAN = 0x7FC00000
BF16_NAN = 0x7FC0


def run_fp8_gemv_fenced(case: Fp8GemvCase):
    """The FP8 GEMV arm with x, xs and every segment's rows and row scales between NaN
    fences: (y [T, N], the TAIL sentinels after it)."""
    t, n = case.expected.shape
    segments = [(fenced(w, E4M3_NAN), fenced(ws, F32_NAN)) for w, ws in case.segments]
    flat = bf16_sentinels((t * n + TAIL,))
    fp8_gemv.run_fp8_gemv(flat[:t * n].reshape(t, n), fenced(case.x, E4M3_NAN), fenced(case.xs, F32_NAN), segments)
    return flat[:t * n].reshape(t, n), flat[t * n:]


def run_lm_head_fenced(case: LmHeadCase, excluded: int) -> tuple[np.ndarray, np.ndarray]:
    """The lm_head arm with h, E and the row scales between NaN fences: host (idx, val). A
    row whose dot reads a fence has a NaN logit, which never wins: its token answers
    another row (or none)."""
    idx, val = lm_head.run_lm_head_argmax(fenced(case.h, BF16_NAN), fenced(case.E, E4M3_NAN),
                                          fenced(case.rs, F32_NAN), excluded=excluded, softcap=case.softcap)
    return to_host(idx), to_host(val)


def run_lm_head(case: LmHeadCase, excluded: int) -> tuple[np.ndarray, np.ndarray]:
    """The lm_head argmax arm: host (idx int32 [T], val f32 [T])."""
    import cupy

    idx, val = lm_head.run_lm_head_argmax(cupy.asarray(case.h), cupy.asarray(case.E), cupy.asarray(case.rs),
                                          excluded=excluded, softcap=case.softcap)
    return idx.get(), val.get()


@host_cache
def lm_head_positional():
    """The position-dependent lm_head design (oracles.quant_gemv.lm_head_positional_case), built once."""
    return lm_head_positional_case()


@host_cache
def lm_head_edge():
    """The all-negative / overflowing lm_head design (oracles.quant_gemv.lm_head_edge_case), built once."""
    return lm_head_edge_case()


@host_cache
def lm_head_partials_of(design: str, excluded: int) -> tuple[np.ndarray, np.ndarray]:
    """(index, value) of each block's best for `design` ("positional" or "edge"), built once."""
    logits = {"positional": lm_head_positional, "edge": lm_head_edge}[design]().logits
    return lm_head_block_partials(logits, excluded)


# The lm_head scratch (part_val, part_idx [T, blocks]) as views inside sentinel guards: every
# slot starts as a sentinel partial, and so does every guard entry. A sentinel is a winner:
# value +inf beats every logit, so a reduce that reads a slot nobody wrote or a guard entry
# answers the sentinel index; a partial stored outside its slot lands in a guard (defined
# memory: a wrong value to assert, not a fault) or leaves its own slot a sentinel.
PART_GUARD = 64  # sentinel partials on each side of the T * blocks slots
PART_VAL_SENTINEL = 0x7F800000  # f32 +inf
PART_IDX_SENTINEL = 0xA5A5A5A5  # int32 -1515870811: below every row index, no row's index


@dataclass(frozen=True)
class LmHeadGuardedRun:
    idx: np.ndarray  # int32 [T]
    val: np.ndarray  # f32 [T]
    part_val: np.ndarray  # f32 [T, blocks], the slots
    part_idx: np.ndarray  # int32 [T, blocks]
    guards: tuple  # (label, host array, sentinel bits): the entries before and after the slots


# The inputs of the guarded arm are views inside padded allocations, as FP8's: a kernel that
# reads a row too far (or before the first) reads defined, nonzero memory and fails by a
# wrong value rather than by a fault. E's pad rows are e4m3 -448, a row that wins for every
# token whose h sums negative (both edge tokens: an overflow to +inf for token 0).
LM_PAD_H_ROWS = 4  # bf16 1.0 rows before and after h (4 * 2 * H >= the 496 bytes a lane can reach back)
LM_PAD_H = 1.0
LM_PAD_E_ROWS = 64  # e4m3 rows before and after E, with row scales 1.0
LM_PAD_E8 = 0xFE  # e4m3 -448


def _lm_head_padded_inputs(case: LmHeadCase):
    import cupy

    t, hdim = case.h.shape
    v = case.E.shape[0]
    ph, pe = LM_PAD_H_ROWS, LM_PAD_E_ROWS
    h_pad = to_bf16(np.full((ph, hdim), LM_PAD_H))
    h = cupy.asarray(np.concatenate([h_pad, case.h, h_pad]))[ph:ph + t]
    e_pad = np.full((pe, hdim), LM_PAD_E8, dtype=np.uint8)
    E = cupy.asarray(np.concatenate([e_pad, case.E, e_pad]))[pe:pe + v]
    rs_pad = np.ones(pe, dtype=np.float32)
    rs = cupy.asarray(np.concatenate([rs_pad, case.rs, rs_pad]))[pe:pe + v]
    return h, E, rs


def run_lm_head_guarded(case: LmHeadCase, excluded: int) -> LmHeadGuardedRun:
    """The lm_head arm with padded inputs and the scratch in sentinel guards (above),
    everything back on the host."""
    h, E, rs = _lm_head_padded_inputs(case)
    return run_lm_head_guarded_on_device(h, E, rs, excluded, case.softcap)


def run_lm_head_guarded_on_device(h, E, rs, excluded: int, softcap: float) -> LmHeadGuardedRun:
    """The lm_head arm over inputs already on the device, the scratch in sentinel guards
    (above), everything back on the host."""
    t, v = int(h.shape[0]), int(E.shape[0])
    blocks = lm_head.partial_blocks(v)
    n, g = t * blocks, PART_GUARD
    pv = filled((n + 2 * g,), np.float32, PART_VAL_SENTINEL)
    pi = filled((n + 2 * g,), np.int32, PART_IDX_SENTINEL)
    idx, val = lm_head.run_lm_head_argmax(h, E, rs, excluded=excluded, softcap=softcap,
                                          scratch=(pv[g:g + n].reshape(t, blocks), pi[g:g + n].reshape(t, blocks)))
    pv, pi = to_host(pv), to_host(pi)
    guards = (("part_val before row 0", pv[:g], PART_VAL_SENTINEL),
              ("part_idx before row 0", pi[:g], PART_IDX_SENTINEL),
              (f"part_val past row {t - 1}", pv[g + n:], PART_VAL_SENTINEL),
              (f"part_idx past row {t - 1}", pi[g + n:], PART_IDX_SENTINEL))
    return LmHeadGuardedRun(idx=to_host(idx), val=to_host(val), part_val=pv[g:g + n].reshape(t, blocks),
                            part_idx=pi[g:g + n].reshape(t, blocks), guards=guards)


# What the one-step-too-far allocations hold: x 1.0, e2m1 codes 1.0, block scales 1.0.
# Nonzero on purpose: a zero pad would make an over-read add exactly nothing and hide it.
PAD_X, PAD_W, PAD_S = 1.0, 0x22, 0x38


@dataclass(frozen=True)
class Nvfp4Device:
    """An NVFP4 case on the device. Weights, scales and x are views of allocations one row
    (one group for x) longer, filled with nonzero values (PAD_*), so a perturbed kernel that
    reads one step too far reads defined memory and fails by a wrong value rather than by
    an illegal address or by adding zeros."""

    n: int
    x: object
    w: object
    s: object
    gs: float


def nvfp4_to_device(case: Nvfp4Case) -> Nvfp4Device:
    import cupy

    n, half = case.w.shape
    k = 2 * half
    x = cupy.asarray(np.concatenate([case.x, to_bf16(np.full(nvfp4_gemv.GROUP, PAD_X))]))
    w = cupy.asarray(np.concatenate([case.w, np.full((1, half), PAD_W, dtype=np.uint8)]))
    s = cupy.asarray(np.concatenate([case.s, np.full((1, k // nvfp4_gemv.GROUP), PAD_S, dtype=np.uint8)]))
    return Nvfp4Device(n=n, x=x[:k], w=w[:n], s=s[:n], gs=case.gs)


def run_nvfp4(dev: Nvfp4Device, *, single_warp: bool):
    """The NVFP4 arm (base or single-warp): y [N + TAIL], the tail left holding sentinels."""
    y = bf16_sentinels((dev.n + TAIL,))
    nvfp4_gemv.run_nvfp4_gemv(y, dev.x, dev.w, dev.s, dev.gs, single_warp=single_warp)
    return y


# The invariance and determinism gates (gates/test_gemv_invariance.py): inputs stay on the
# device; a run gathers the rows it computes (tokens, or NVFP4 weight rows) into one batch and
# launches it once. Outputs start filled with `fill` bits; the determinism gates vary them
# from repeat to repeat, so an output the kernel leaves unwritten differs between repeats.


@dataclass(frozen=True)
class Fp8Device:
    x: object  # uint8 e4m3 [T, K]
    xs: object  # f32 [T]
    w: object  # uint8 e4m3 [N, K], every segment's rows in turn
    ws: object  # f32 [N]


def fp8_inputs_to_device(inputs: Fp8Inputs) -> Fp8Device:
    import cupy

    return Fp8Device(x=cupy.asarray(inputs.x), xs=cupy.asarray(inputs.xs), w=cupy.asarray(inputs.w),
                     ws=cupy.asarray(inputs.ws))


def run_fp8_gemv_tokens(dev: Fp8Device, tokens, segment_rows: tuple[int, ...], fill: int = SENTINEL, *,
                        mode: str = "eager", replay=None):
    """y [len(tokens), N] on the device: the tokens `tokens` of `dev` as one batch (T =
    len(tokens)), the weight rows split into segments of `segment_rows` rows (views of one
    allocation, so each segment's first row is where the one before it ends). `mode` "graph"
    replays the launch from a CUDA graph `replay` captured once a segment split and batch size
    (harness.library.graphs), the batch's x, xs and y copied into the captured buffers."""
    import cupy

    n = int(dev.w.shape[0])
    if sum(segment_rows) != n:
        raise ValueError(f"segments {segment_rows} do not add up to the {n} weight rows")
    ids = cupy.asarray(list(tokens), dtype=cupy.int64)
    segments, start = [], 0
    for rows in segment_rows:
        segments.append((dev.w[start:start + rows], dev.ws[start:start + rows]))
        start += rows
    y = filled((len(tokens), n), bf16, fill)
    if replay is None:
        fp8_gemv.run_fp8_gemv(y, dev.x[ids], dev.xs[ids], segments)
    else:
        replay(mode, tuple(segment_rows), lambda x, xs, y: fp8_gemv.run_fp8_gemv(y, x, xs, segments),
               x=dev.x[ids], xs=dev.xs[ids], y=y)
    return y


def run_nvfp4_rows(dev: Nvfp4Device, rows, *, single_warp: bool, fill: int = SENTINEL, mode: str = "eager",
                   replay=None):
    """y [len(rows)] on the device: the weight rows `rows` of `dev` (their outputs) as one
    launch, N = len(rows), by the base or the single-warp arm; `mode` and `replay` as
    `run_fp8_gemv_tokens` takes them (the rows' w, s and y are the captured buffers)."""
    import cupy

    ids = cupy.asarray(list(rows), dtype=cupy.int64)
    y = filled((len(rows),), bf16, fill)
    if replay is None:
        nvfp4_gemv.run_nvfp4_gemv(y, dev.x, dev.w[ids], dev.s[ids], dev.gs, single_warp=single_warp)
    else:
        replay(mode, single_warp, lambda w, s, y: nvfp4_gemv.run_nvfp4_gemv(y, dev.x, w, s, dev.gs,
                                                                             single_warp=single_warp),
               w=dev.w[ids], s=dev.s[ids], y=y)
    return y


@dataclass(frozen=True)
class LmHeadDevice:
    h: object  # bf16 bits (uint16) [T, H]
    E: object  # uint8 e4m3 [V, H]
    rs: object  # f32 [V]
    softcap: float


def lm_head_to_device(case: LmHeadCase) -> LmHeadDevice:
    import cupy

    return LmHeadDevice(h=to_device(case.h, bits=True), E=cupy.asarray(case.E), rs=cupy.asarray(case.rs),
                        softcap=case.softcap)


def run_lm_head_tokens(dev: LmHeadDevice, tokens, *, excluded: int, shards: tuple[int, ...] = (0,),
                       scratch_fill: tuple[int, int] | None = None) -> np.ndarray:
    """float64 [len(tokens), 2] on the host: each token's argmax index and its f32 value (both
    exact in float64, and distinct f32 bits stay distinct), for the tokens `tokens` of `dev`
    as one batch. `shards` are the first vocabulary
    rows of the shards the vocabulary is cut into (the first is 0): each shard is one launch
    over its rows, as the ranks of a vocabulary-parallel engine, and the shards' answers meet
    here by the contract's rule (the larger value; a tie to the lower index, which is the
    earlier shard's). `scratch_fill` (value bits, index bits): the launch takes a caller's
    scratch filled with them; None: the launcher allocates its own."""
    import cupy

    ids = cupy.asarray(list(tokens), dtype=cupy.int64)
    h = dev.h[ids]
    v = int(dev.E.shape[0])
    if shards[0] != 0 or list(shards) != sorted(set(shards)) or shards[-1] >= v:
        raise ValueError(f"shards {shards} must start at 0 and increase below V={v}")
    best = None
    for lo, hi in zip(shards, [*shards[1:], v]):
        scratch = None
        if scratch_fill is not None:
            shape = (len(tokens), lm_head.partial_blocks(hi - lo))
            scratch = (filled(shape, np.float32, scratch_fill[0]), filled(shape, np.int32, scratch_fill[1]))
        local = excluded - lo if lo <= excluded < hi else lm_head.NONE
        idx, val = lm_head.run_lm_head_argmax(h, dev.E[lo:hi], dev.rs[lo:hi], excluded=local,
                                              softcap=dev.softcap, scratch=scratch)
        idx, val = to_host(idx) + np.int32(lo), to_host(val)
        if best is None:
            best = idx, val
        else:
            take = val > best[1]
            best = np.where(take, idx, best[0]), np.where(take, val, best[1])
    return np.stack([best[0].astype(np.float64), best[1].astype(np.float64)], axis=1)


# The sweep gates' arms (gates/test_lm_head.py): the sweep's embedding is built on the device
# from its repeating base rows (oracles.quant_gemv.lm_head_sweep_case), a gather of up to a GB
# the host never holds.


def lm_head_sweep_to_device(case: LmHeadSweepCase) -> LmHeadDevice:
    import cupy

    v = int(case.rs.shape[0])
    E = cupy.asarray(case.base)[cupy.arange(v) % case.base.shape[0]]
    E[cupy.asarray(case.rows)] = cupy.asarray(case.special)
    return LmHeadDevice(h=to_device(case.h, bits=True), E=E, rs=cupy.asarray(case.rs), softcap=0.0)


# The big-index arms: weights (or an embedding) past 2^31 bytes, uninitialised but for the rows a
# gate checks, written by contiguous copies (`.set`: no kernel indexes the whole buffer). The
# rows nobody wrote compute garbage the gates never read. Each arm returns host arrays only, so
# that its device buffers are freed when it returns (inside the gate's `device_memory`).
#
# A row offset computed in 32 bits wraps: a signed int's product past 2^31 goes negative (the
# FP8 and lm_head kernels take int sizes), an unsigned one's past 2^32 restarts from zero (the
# NVFP4 kernels take unsigned sizes). Each arm puts the wrapped address on defined memory that
# holds other rows of the design, so a wrapped read is a wrong value the gate names, not a fault.


def run_fp8_gemv_far_rows(case: Fp8GemvCase, decoys: np.ndarray, n: int) -> np.ndarray:
    """The FP8 arm over one segment of `n` rows of which only the last R (`case`'s rows, with
    their row scales) are written: host y [T, R], their outputs. The weights start 2^31 bytes
    into their allocation, whose first rows hold `decoys`: where a 32-bit signed `row * K`
    wraps (row * K in [2^31, 2^32)), it reads `w - 2^32 + row * K`, the decoy row
    row - 2^31 / K."""
    import cupy

    (w_live, ws_live), = case.segments
    rows, k = w_live.shape
    t = case.x.shape[0]
    whole = cupy.empty(INDEX_32 + n * k, dtype=cupy.uint8)
    whole[:decoys.size].set(np.ascontiguousarray(decoys).reshape(-1))
    w = whole[INDEX_32:].reshape(n, k)
    w[n - rows:].set(w_live)
    ws = cupy.empty(n, dtype=cupy.float32)
    ws[n - rows:].set(ws_live)
    y = bf16_sentinels((t, n))
    fp8_gemv.run_fp8_gemv(y, cupy.asarray(case.x), cupy.asarray(case.xs), [(w, ws)])
    return to_host(y[:, n - rows:])


def run_nvfp4_far_rows(case: Nvfp4Case, n: int, starts: tuple[int, ...], *, single_warp: bool):
    """The NVFP4 arm (base or single-warp) over `n` weight rows of which only `case`'s are
    written, in runs that start at the rows `starts` (case rows in order, the runs splitting
    them evenly): (host y of those rows in case order, host y[n:n + TAIL], the sentinel tail).
    A 32-bit unsigned `out * (K / 2)` past 2^32 wraps to `out * (K / 2) - 2^32`: the row
    out - 2^32 / (K / 2), which a gate makes one of its own rows (a run at row 0)."""
    import cupy

    live, half = case.w.shape
    k = 2 * half
    per = live // len(starts)
    if per * len(starts) != live:
        raise ValueError(f"{live} rows do not split evenly into runs at {starts}")
    w = cupy.empty((n, half), dtype=cupy.uint8)
    s = cupy.empty((n, k // nvfp4_gemv.GROUP), dtype=cupy.uint8)
    for i, start in enumerate(starts):
        w[start:start + per].set(case.w[i * per:(i + 1) * per])
        s[start:start + per].set(case.s[i * per:(i + 1) * per])
    y = bf16_sentinels((n + TAIL,))
    nvfp4_gemv.run_nvfp4_gemv(y, to_device(case.x, bits=True), w, s, case.gs, single_warp=single_warp)
    out = np.concatenate([to_host(y[start:start + per]) for start in starts])
    return out, to_host(y[n:])


def run_lm_head_far_rows(case: LmHeadFarRowsCase, excluded: int) -> LmHeadGuardedRun:
    """The lm_head arm over an embedding of V rows of which only the last R (`case.E`) are
    written, every other row's scale NaN, the scratch in sentinel guards. The embedding starts
    2^31 bytes into its allocation, whose first rows hold `case.decoys`: where a 32-bit signed
    `v * H` wraps (v * H in [2^31, 2^32)), it reads `E - 2^32 + v * H`, the decoy row
    v - 2^31 / H."""
    import cupy

    live, hdim = case.E.shape
    v = int(case.rs.shape[0])
    whole = cupy.empty(INDEX_32 + v * hdim, dtype=cupy.uint8)
    whole[:case.decoys.size].set(case.decoys.reshape(-1))
    E = whole[INDEX_32:].reshape(v, hdim)
    E[v - live:].set(case.E)
    return run_lm_head_guarded_on_device(to_device(case.h, bits=True), E, cupy.asarray(case.rs), excluded, 0.0)
