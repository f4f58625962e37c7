"""Launcher for kernels_cu/fp8_gemv.cu: FP8 GEMV, per-token and per-row scales, segments along N.

`check_fp8_gemv_args` validates shapes and dtypes on plain Python values and works on numpy
arrays (refusal gates run it with no GPU); `run_fp8_gemv` calls it before any launch. The
array checks come from `harness.library.launch`.
"""

from __future__ import annotations

import numpy as np

from harness.library.kernels import module
from harness.library.launch import BF16_DTYPES, E4M3_DTYPES, F32_DTYPES, Refusal, check_aligned, check_array

SOURCE = "fp8_gemv.cu"
THREADS = 256  # FP8_GEMV_THREADS
ROWS_PER_BLOCK = 8  # FP8_GEMV_ROWS_PER_BLOCK: one warp an output row
BYTES_PER_LANE = 16  # FP8_GEMV_BYTES_PER_LANE: one uint4 of e4m3 a lane a step
TOKENS_PER_BLOCK = 4  # FP8_GEMV_TOKENS_PER_BLOCK: the tokens a block takes, each weight row read once for them
MAX_SEGMENTS = 3


def check_fp8_gemv_args(y, x, xs, segments) -> tuple[int, int, int]:
    """Validate the arguments of `run_fp8_gemv`; returns (T, K, N total)."""
    op = "fp8_gemv"
    if x.ndim != 2:
        raise Refusal(f"{op}: x must be 2-D [T, K] e4m3, got shape {tuple(x.shape)}")
    t, k = (int(d) for d in x.shape)
    if t <= 0 or k <= 0:
        raise Refusal(f"{op}: x is empty (T={t}, K={k}); there is nothing to compute")
    if k % BYTES_PER_LANE:
        raise Refusal(f"{op}: K={k} is not a multiple of {BYTES_PER_LANE}: pad K with zero weights")
    if not 1 <= len(segments) <= MAX_SEGMENTS:
        raise Refusal(f"{op}: got {len(segments)} weight segments, expected 1 to {MAX_SEGMENTS}")
    check_array(op, "x", x, (t, k), E4M3_DTYPES, "e4m3 activations [T, K]")
    check_array(op, "xs", xs, (t,), F32_DTYPES, "per-token scales [T]")
    n_total = 0
    for i, (w, ws) in enumerate(segments):
        if w.ndim != 2 or int(w.shape[0]) <= 0:
            raise Refusal(f"{op}: segment {i} weights must be 2-D [n, K] with n > 0, got shape {tuple(w.shape)}")
        n = int(w.shape[0])
        check_array(op, f"segment {i} weights", w, (n, k), E4M3_DTYPES, "e4m3 [n, K], K as in x")
        check_array(op, f"segment {i} scales", ws, (n,), F32_DTYPES, "per-row scales [n]")
        n_total += n
    if n_total >= 2**31:
        raise Refusal(f"{op}: N={n_total} does not fit the kernel's int row index: split the GEMV")
    check_array(op, "y", y, (t, n_total), BF16_DTYPES, "bf16 output [T, N], N the sum of segment rows")
    return t, k, n_total


def grid(n_total: int, t: int) -> tuple[int, int, int]:
    """(ceil(N / ROWS_PER_BLOCK), ceil(T / TOKENS_PER_BLOCK), 1): a block takes ROWS_PER_BLOCK
    rows (one a warp) for a tile of TOKENS_PER_BLOCK tokens; the last tile may be partial."""
    return (-(-n_total // ROWS_PER_BLOCK), -(-t // TOKENS_PER_BLOCK), 1)


def run_fp8_gemv(y, x, xs, segments) -> None:
    """y[t, n] = bf16(ws[n] * xs[t] * sum_k x[t, k] * w[n, k]); `segments` is a list of
    (w e4m3 [n_s, K], ws f32 [n_s]) whose outputs are concatenated along N.

    Kernel arguments: y, x, xs, then (w, ws, end) for each of MAX_SEGMENTS segments (end the
    running row count; an unused segment repeats the last one with the same end), then T and K.
    Grid: `grid(N, T)`, FP8_GEMV_THREADS threads a block."""
    t, k, n_total = check_fp8_gemv_args(y, x, xs, segments)
    check_aligned("fp8_gemv", "x", x, BYTES_PER_LANE)
    for i, (w, _) in enumerate(segments):
        check_aligned("fp8_gemv", f"segment {i} weights", w, BYTES_PER_LANE)
    args = [y, x, xs]
    end = 0
    for i in range(MAX_SEGMENTS):
        if i < len(segments):
            w, ws = segments[i]
            end += int(w.shape[0])
        else:  # an unused segment: empty, its end the previous end; the kernel never selects it
            w, ws = segments[-1]
        args += [w, ws, np.int32(end)]
    args += [np.int32(t), np.int32(k)]
    module(SOURCE).get("fp8_gemv")(grid(n_total, t), (THREADS, 1, 1), tuple(args))
