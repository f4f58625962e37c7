"""Launcher for kernels_cu/nvfp4_gemv.cu: NVFP4 W4A16 decode GEMV, base and single-warp.

The grids live here and only here: ceil(N / N_PER_BLOCK) blocks for the base kernel and
ceil(N / N_PER_BLOCK_SW) for the single-warp one. The constants must equal the `.cu`'s
`#define`s; gates/test_gemv_structure.py reads the source to hold them together (a kernel
whose outputs-per-block moved without its grid writes the wrong slice of N, silently).
"""

from __future__ import annotations

import numpy as np

from harness.library.kernels import module
from harness.library.launch import BF16_DTYPES, E4M3_DTYPES, F32_DTYPES, Refusal, check_aligned, check_array

SOURCE = "nvfp4_gemv.cu"
N_PER_BLOCK = 4  # #define N_PER_BLOCK: base outputs a block
N_PER_BLOCK_SW = 8  # #define N_PER_BLOCK_SW: single-warp outputs a block, one warp each
THREADS = 256  # #define NVFP4_THREADS: base threads a block
GROUP = 16  # #define NVFP4_GROUP (nvfp4_dot.cuh): weights a block scale
VLANES = 64  # #define NVFP4_VLANES (nvfp4_dot.cuh): virtual lanes an output, one group of GROUP each a sweep
WARP = 32
KERNELS = {False: "nvfp4_gemv", True: "nvfp4_gemv_sw"}


def grid_base(n: int) -> int:
    return -(-n // N_PER_BLOCK)


def grid_sw(n: int) -> int:
    return -(-n // N_PER_BLOCK_SW)


def launch_shape(n: int, single_warp: bool) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """(grid, block) of one launch."""
    if single_warp:
        return (grid_sw(n), 1, 1), (N_PER_BLOCK_SW * WARP, 1, 1)
    return (grid_base(n), 1, 1), (THREADS, 1, 1)


def check_nvfp4_gemv_args(y, x, w, s) -> tuple[int, int]:
    """Validate the arguments of `run_nvfp4_gemv`; returns (N, K). `y` may be longer than
    N (a sentinel tail); the kernel writes y[0:N] only."""
    op = "nvfp4_gemv"
    if x.ndim != 1:
        raise Refusal(f"{op}: x must be 1-D [K] bf16 (decode, M = 1), got shape {tuple(x.shape)}")
    k = int(x.shape[0])
    if k <= 0 or k % GROUP:
        raise Refusal(f"{op}: K={k} is not a positive multiple of {GROUP} (one e4m3 scale a group of {GROUP}): pad K with zero weights")
    if w.ndim != 2 or int(w.shape[0]) <= 0:
        raise Refusal(f"{op}: w must be 2-D [N, K / 2] packed e2m1 bytes with N > 0, got shape {tuple(w.shape)}")
    n = int(w.shape[0])
    check_array(op, "x", x, (k,), BF16_DTYPES, "bf16 activations [K]")
    check_array(op, "w", w, (n, k // 2), (np.dtype(np.uint8),), "e2m1 two a byte, low nibble first, [N, K / 2]")
    check_array(op, "s", s, (n, k // GROUP), E4M3_DTYPES, f"e4m3 block scales [N, K / {GROUP}]")
    if y.ndim != 1 or int(y.shape[0]) < n:
        raise Refusal(f"{op}: y has shape {tuple(y.shape)} but N={n}: allocate a 1-D y of at least N elements")
    check_array(op, "y", y, tuple(y.shape), BF16_DTYPES, "bf16 output [>= N]")
    if n >= 2**32 or k >= 2**32:
        raise Refusal(f"{op}: N={n}, K={k}: the kernel takes both as 32-bit unsigned; split the GEMV")
    return n, k


def run_nvfp4_gemv(y, x, w, s, gs: float, *, single_warp: bool) -> None:
    """y[n] = bf16(gs * sum_k x[k] * e2m1(w[n, k]) * e4m3(s[n, k / 16])) for n < N."""
    n, k = check_nvfp4_gemv_args(y, x, w, s)
    check_aligned("nvfp4_gemv", "x", x, 16)
    check_aligned("nvfp4_gemv", "w", w, 8)
    grid, block = launch_shape(n, single_warp)
    module(SOURCE).get(KERNELS[single_warp])(grid, block, (y, x, w, s, np.float32(gs), np.uint32(n), np.uint32(k)))
