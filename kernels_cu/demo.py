"""Launcher for the demonstration module (kernels_cu/demo.cu)."""

from __future__ import annotations

import numpy as np

from harness.library.kernels import module
from harness.library.launch import Refusal

BLOCK = 256
VEC = 4
NAME_EXPRESSIONS = (f"demo_scale_vec<{VEC}>",)


def _module():
    return module("demo.cu", name_expressions=NAME_EXPRESSIONS)


def check_scale_args(n: int, out_len: int) -> None:
    if n <= 0:
        raise Refusal(f"demo_scale: n must be positive, got {n}")
    if out_len < n:
        raise Refusal(f"demo_scale: out holds {out_len} elements but n is {n}: allocate at least n")


def run_scale(out, x, scale: float, *, vectorised: bool = False) -> None:
    n = int(x.size)
    check_scale_args(n, int(out.size))
    args = (out, x, np.float32(scale), np.int32(n))
    if vectorised:
        grid = (-(-n // (BLOCK * VEC)), 1, 1)
        _module().get(NAME_EXPRESSIONS[0])(grid, (BLOCK, 1, 1), args)
    else:
        _module().get("demo_scale")((-(-n // BLOCK), 1, 1), (BLOCK, 1, 1), args)


def run_gather(out, x, idx) -> None:
    m = int(idx.size)
    _module().get("demo_gather_guarded")((-(-m // BLOCK), 1, 1), (BLOCK, 1, 1),
                                         (out, x, idx, np.int32(x.size), np.int32(m)))
