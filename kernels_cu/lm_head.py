"""Launcher for kernels_cu/lm_head.cu: lm_head argmax with soft-capping and an excluded id.

Two launches: `lm_head_partial` (grid ceil(V / ROWS_PER_BLOCK) x T) leaves each block's best
(value, index) in scratch; `lm_head_reduce` (grid T) picks each row's winner.
"""

from __future__ import annotations

import math

import numpy as np

from harness.library.kernels import module
from harness.library.launch import BF16_DTYPES, E4M3_DTYPES, F32_DTYPES, Refusal, check_aligned, check_array

I32_DTYPES = (np.dtype(np.int32),)

SOURCE = "lm_head.cu"
THREADS = 256  # LM_HEAD_THREADS
ROWS_PER_BLOCK = 64  # LM_HEAD_ROWS_PER_BLOCK
H_PER_LANE = 8  # LM_HEAD_H_PER_LANE: 8 bf16 (one uint4) and 8 e4m3 (one uint2) a lane a step
NONE = -1  # excluded id meaning "exclude nothing"


def check_lm_head_args(h, E, rs, excluded: int, softcap: float) -> tuple[int, int, int]:
    """Validate the arguments of `run_lm_head_argmax`; returns (T, V, H)."""
    op = "lm_head_argmax"
    if h.ndim != 2 or E.ndim != 2:
        raise Refusal(f"{op}: h must be [T, H] bf16 and E [V, H] e4m3, got shapes {tuple(h.shape)} and {tuple(E.shape)}")
    t, hdim = (int(d) for d in h.shape)
    v = int(E.shape[0])
    if t <= 0 or v <= 0 or hdim <= 0:
        raise Refusal(f"{op}: empty input (T={t}, V={v}, H={hdim}); there is nothing to pick")
    if hdim % H_PER_LANE:
        raise Refusal(f"{op}: H={hdim} is not a multiple of {H_PER_LANE}: pad the hidden size with zeros")
    check_array(op, "h", h, (t, hdim), BF16_DTYPES, "bf16 hidden states [T, H]")
    check_array(op, "E", E, (v, hdim), E4M3_DTYPES, "e4m3 embedding [V, H], H as in h")
    check_array(op, "rs", rs, (v,), F32_DTYPES, "per-row scales [V]")
    if not (excluded == NONE or 0 <= excluded < v):
        raise Refusal(f"{op}: excluded id {excluded} is outside [0, {v}): pass a token id, or -1 to exclude none")
    if excluded != NONE and v == 1:
        raise Refusal(f"{op}: excluded id {excluded} is the only token: there is no candidate left to pick")
    if not (math.isfinite(softcap) and softcap >= 0):
        raise Refusal(f"{op}: softcap {softcap} must be finite and >= 0 (0 turns capping off)")
    return t, v, hdim


def partial_blocks(v: int) -> int:
    """Partials a row: one a block of ROWS_PER_BLOCK vocabulary rows."""
    return -(-v // ROWS_PER_BLOCK)


def check_lm_head_scratch(t: int, v: int, scratch) -> None:
    """A caller's scratch is (part_val f32 [T, blocks], part_idx int32 [T, blocks]), dense."""
    op = "lm_head_argmax"
    if not (isinstance(scratch, tuple) and len(scratch) == 2):
        raise Refusal(f"{op}: scratch must be a pair (part_val, part_idx), got {type(scratch).__name__}")
    blocks = partial_blocks(v)
    check_array(op, "part_val", scratch[0], (t, blocks), F32_DTYPES, f"f32 [T, ceil(V / {ROWS_PER_BLOCK})]")
    check_array(op, "part_idx", scratch[1], (t, blocks), I32_DTYPES, f"int32 [T, ceil(V / {ROWS_PER_BLOCK})]")


def run_lm_head_argmax(h, E, rs, *, excluded: int = NONE, softcap: float = 0.0, scratch=None):
    """(idx int32 [T], val f32 [T]): each row's argmax over v != excluded of the (capped)
    logit rs[v] * dot(h[t], E[v]); ties go to the lowest index. `scratch`, when given, is
    the pair (part_val f32, part_idx int32), each [T, ceil(V / ROWS_PER_BLOCK)], where the
    partial kernel leaves each block's best and the reduce kernel reads them (gates pass
    views inside sentinel guards); by default the launcher allocates it."""
    import cupy

    t, v, _ = check_lm_head_args(h, E, rs, excluded, softcap)
    check_aligned("lm_head_argmax", "h", h, 16)
    check_aligned("lm_head_argmax", "E", E, 8)
    blocks = partial_blocks(v)
    if scratch is None:
        part_val = cupy.empty((t, blocks), dtype=cupy.float32)
        part_idx = cupy.empty((t, blocks), dtype=cupy.int32)
    else:
        check_lm_head_scratch(t, v, scratch)
        part_val, part_idx = scratch
    idx = cupy.empty((t,), dtype=cupy.int32)
    val = cupy.empty((t,), dtype=cupy.float32)
    m = module(SOURCE)
    m.get("lm_head_partial")((blocks, t, 1), (THREADS, 1, 1),
                             (part_val, part_idx, h, E, rs, np.int32(v), np.int32(h.shape[1]),
                              np.int32(excluded), np.float32(softcap)))
    m.get("lm_head_reduce")((t, 1, 1), (THREADS, 1, 1), (idx, val, part_val, part_idx, np.int32(blocks)))
    return idx, val
