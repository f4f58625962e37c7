"""Launcher for kernels_cu/fp8_gemv.cu: FP8 GEMV, per-token and per-row scales, segments along N.

`check_fp8_gemv_args` validates shapes and dtypes on plain Python values and works on numpy
arrays (refusal gates run it with no GPU); `run_fp8_gemv` calls it before any launch. The
array checks here (`check_array`, `check_aligned`) are shared by the quant GEMV launchers.
"""

from __future__ import annotations

import numpy as np

from harness.dtypes import bf16, fp8_e4m3
from harness.kernels import module

SOURCE = "fp8_gemv.cu"
THREADS = 256  # FP8_GEMV_THREADS
ROWS_PER_BLOCK = 8  # FP8_GEMV_ROWS_PER_BLOCK: one warp an output row
BYTES_PER_LANE = 16  # FP8_GEMV_BYTES_PER_LANE: one uint4 of e4m3 a lane a step
MAX_SEGMENTS = 3

E4M3_DTYPES = (np.dtype(np.uint8), fp8_e4m3)
BF16_DTYPES = (bf16, np.dtype(np.uint16))
F32_DTYPES = (np.dtype(np.float32),)


def check_array(op: str, name: str, arr, shape: tuple, dtypes: tuple, what: str) -> None:
    """`arr` has exactly `shape`, one of `dtypes`, and is C-contiguous, else a ValueError
    naming the argument, what it holds and what was expected."""
    if tuple(arr.shape) != tuple(shape):
        raise ValueError(f"{op}: {name} has shape {tuple(arr.shape)}, expected {tuple(shape)} ({what})")
    if np.dtype(arr.dtype) not in dtypes:
        allowed = " or ".join(str(d) for d in dtypes)
        raise ValueError(f"{op}: {name} has dtype {arr.dtype}, expected {allowed} ({what})")
    if not arr.flags.c_contiguous:
        raise ValueError(f"{op}: {name} is not C-contiguous: pass a contiguous copy (.copy())")


def check_aligned(op: str, name: str, arr, alignment: int) -> None:
    """A device array's address is a multiple of `alignment` bytes (vector loads need it)."""
    ptr = getattr(getattr(arr, "data", None), "ptr", None)
    if ptr is not None and ptr % alignment:
        raise ValueError(
            f"{op}: {name} starts at 0x{ptr:x}, not {alignment}-byte aligned: "
            "pass a fresh allocation or a slice starting on a multiple of the alignment"
        )


def check_fp8_gemv_args(y, x, xs, segments) -> tuple[int, int, int]:
    """Validate the arguments of `run_fp8_gemv`; returns (T, K, N total)."""
    op = "fp8_gemv"
    if x.ndim != 2:
        raise ValueError(f"{op}: x must be 2-D [T, K] e4m3, got shape {tuple(x.shape)}")
    t, k = (int(d) for d in x.shape)
    if t <= 0 or k <= 0:
        raise ValueError(f"{op}: x is empty (T={t}, K={k}); there is nothing to compute")
    if k % BYTES_PER_LANE:
        raise ValueError(f"{op}: K={k} is not a multiple of {BYTES_PER_LANE}: pad K with zero weights")
    if not 1 <= len(segments) <= MAX_SEGMENTS:
        raise ValueError(f"{op}: got {len(segments)} weight segments, expected 1 to {MAX_SEGMENTS}")
    check_array(op, "x", x, (t, k), E4M3_DTYPES, "e4m3 activations [T, K]")
    check_array(op, "xs", xs, (t,), F32_DTYPES, "per-token scales [T]")
    n_total = 0
    for i, (w, ws) in enumerate(segments):
        if w.ndim != 2 or int(w.shape[0]) <= 0:
            raise ValueError(f"{op}: segment {i} weights must be 2-D [n, K] with n > 0, got shape {tuple(w.shape)}")
        n = int(w.shape[0])
        check_array(op, f"segment {i} weights", w, (n, k), E4M3_DTYPES, "e4m3 [n, K], K as in x")
        check_array(op, f"segment {i} scales", ws, (n,), F32_DTYPES, "per-row scales [n]")
        n_total += n
    if n_total >= 2**31:
        raise ValueError(f"{op}: N={n_total} does not fit the kernel's int row index: split the GEMV")
    check_array(op, "y", y, (t, n_total), BF16_DTYPES, "bf16 output [T, N], N the sum of segment rows")
    return t, k, n_total


def grid(n_total: int, t: int) -> tuple[int, int, int]:
    return (-(-n_total // ROWS_PER_BLOCK), t, 1)


def run_fp8_gemv(y, x, xs, segments) -> None:
    """y[t, n] = bf16(ws[n] * xs[t] * sum_k x[t, k] * w[n, k]); `segments` is a list of
    (w e4m3 [n_s, K], ws f32 [n_s]) whose outputs are concatenated along N."""
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
    args.append(np.int32(k))
    module(SOURCE).get("fp8_gemv")(grid(n_total, t), (THREADS, 1, 1), tuple(args))
