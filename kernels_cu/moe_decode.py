"""Launchers for kernels_cu/moe_decode.cu: the NVFP4 MoE decode stages, one function a kernel.

Layouts (bf16 travels as ml_dtypes bfloat16 or uint16 bits; e4m3 as float8_e4m3fn or uint8;
NVFP4 values as uint8, two e2m1 codes a byte, low nibble first):

- post_attn: x, o [T, H] -> mid, rr [T, H], fq [T, H] e4m3, fs [T] f32, gq [T, H/2], gsc [T, H/16]
- router: rr [T, H], wr [E, H], pes [E] -> logits [T, E] f32, ids [T, kcap] int32,
  wts [T, kcap] f32; ticket [1] uint32 (zero before the first launch, left zero after each)
- glu: ids, table [E] int32, gq, gsc, Experts.wgu [E, 2I, H/2], sgu [E, 2I, H/16], gs_gu [E]
  -> hq [T, kcap, I/2], hs [T, kcap, I/16], gu [T, kcap, 2I] bf16 (optional)
- down: ids, table, hq, hs, Experts.wdn [E, H, I/2], sdn [E, H, I/16], gs_dn [E] -> opair [T, kcap, H]
- final: dense, mid [T, H], opair, wts, w_d, w_m [H] -> out [T, H]

Token t's k-th expert is slot (t, k); slots K..kcap-1 are never written. Expert e's weights
are stored at table[e]; the kernels trap on an id or a table entry outside [0, E).

Every check runs on shapes, dtypes, Python ints and addresses before the device is touched, so
the refusals hold on a machine with no GPU (numpy arrays stand in for device arrays). Each
refusal names the argument, its value and the rule. The grids live here and only here; the
constants below must equal the `.cu`'s `#define`s (gates/test_moe_decode_structure.py).
The array checks are local to this launcher.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from harness.library.dtypes import bf16, fp8_e4m3
from harness.library.kernels import module
from harness.library.launch import Refusal

SOURCE = "moe_decode.cu"
THREADS = 256  # #define MOE_THREADS
ROUTER_WARPS = 8  # #define MOE_ROUTER_WARPS: experts a router block, one warp each
GLU_ROWS = 16  # #define MOE_GLU_ROWS: expert-width rows a glu block (gate and up each)
DOWN_ROWS = 16  # #define MOE_DOWN_ROWS: hidden rows a down block
MAX_T = 8  # #define MOE_MAX_T
MAX_K = 8  # #define MOE_MAX_K
MAX_E = 256  # #define MOE_MAX_E
GROUP = 16  # NVFP4_GROUP (nvfp4_dot.cuh): values a block scale
DIM_MULTIPLE = 64  # H and I: whole NVFP4 blocks a 64-lane sweep, warp-uniform quantizer loops
MAX_SHARED = 48 * 1024  # dynamic shared memory without an opt-in
WARP = 32

BF16 = (bf16, np.dtype(np.uint16))
E4M3 = (fp8_e4m3, np.dtype(np.uint8))
U8 = (np.dtype(np.uint8),)
F32 = (np.dtype(np.float32),)
I32 = (np.dtype(np.int32),)
TICKET = (np.dtype(np.uint32), np.dtype(np.int32))


# ------------------------------------------------------------------ checks (pure, host values)


def _refuse(op: str, text: str) -> None:
    raise Refusal(f"{op}: {text}")


def _int(op: str, name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        _refuse(op, f"{name}={value!r} is not an int")
    return int(value)


def _need(op: str, name: str, arr, shape: tuple, dtypes: tuple, what: str) -> None:
    """`arr` has exactly `shape`, one of `dtypes`, and is C-contiguous."""
    got = tuple(int(d) for d in arr.shape)
    if got != tuple(shape):
        _refuse(op, f"{name} has shape {got}, expected {tuple(shape)} ({what}): allocate it with that shape")
    if np.dtype(arr.dtype) not in dtypes:
        allowed = " or ".join(str(d) for d in dtypes)
        _refuse(op, f"{name} has dtype {arr.dtype}, expected {allowed} ({what}): convert it first")
    if not arr.flags.c_contiguous:
        _refuse(op, f"{name} is not C-contiguous: pass a contiguous copy")


def _aligned(op: str, name: str, arr, alignment: int = 16) -> None:
    """A device array starts on a multiple of `alignment` bytes (16-byte vector loads)."""
    if isinstance(arr, np.ndarray):
        ptr = arr.__array_interface__["data"][0]
    else:
        ptr = getattr(getattr(arr, "data", None), "ptr", None)
    if ptr is not None and ptr % alignment:
        _refuse(op, f"{name} starts at 0x{ptr:x}, not {alignment}-byte aligned: pass a fresh allocation "
                    f"or a slice starting on a multiple of {alignment} bytes")


def _scalar(op: str, name: str, value, *, positive: bool) -> float:
    v = float(value)
    if not np.isfinite(v) or (positive and v <= 0.0):
        _refuse(op, f"{name}={value!r} must be a finite{' positive' if positive else ''} float")
    return v


@dataclass(frozen=True)
class Sizes:
    """The launch's sizes after the checks: tokens, hidden, expert width, experts, K, slots a token."""

    t: int
    h: int
    i: int
    e: int
    k: int
    kcap: int


def check_sizes(op: str, *, t: int, h: int, i: int | None = None, e: int | None = None,
                k: int | None = None, kcap: int | None = None) -> Sizes:
    """The contract's size rules; a size the stage does not use is None."""
    t = _int(op, "T", t)
    if not 1 <= t <= MAX_T:
        _refuse(op, f"T={t} is not in 1..{MAX_T} (decode, MOE_MAX_T): split the batch into launches of at most {MAX_T} tokens")
    for name, v in (("H", h), ("I", i)):
        if v is None:
            continue
        v = _int(op, name, v)
        if v <= 0 or v % DIM_MULTIPLE:
            _refuse(op, f"{name}={v} is not a positive multiple of {DIM_MULTIPLE}: pad {name} with zero weights")
    if e is not None:
        e = _int(op, "E", e)
        if not 1 <= e <= MAX_E:
            _refuse(op, f"E={e} is not in 1..{MAX_E} (MOE_MAX_E, 8 router logits a lane)")
    if k is not None:
        k = _int(op, "K", k)
        if not 1 <= k <= MAX_K:
            _refuse(op, f"K={k} is not in 1..{MAX_K} (MOE_MAX_K experts a token)")
        if e is not None and k > e:
            _refuse(op, f"K={k} > E={e}: a token cannot select more experts than there are")
    if kcap is not None:
        kcap = _int(op, "kcap", kcap)
        if k is not None and kcap < k:
            _refuse(op, f"kcap={kcap} < K={k}: the slot buffers need at least K slots a token")
    return Sizes(t=t, h=int(h), i=int(i) if i is not None else 0, e=int(e) if e is not None else 0,
                 k=int(k) if k is not None else 0, kcap=int(kcap) if kcap is not None else 0)


def _check_shared(op: str, name: str, nbytes: int, fix: str = "split the hidden size") -> None:
    if nbytes > MAX_SHARED:
        _refuse(op, f"{name} needs {nbytes} bytes of shared memory, more than {MAX_SHARED}: {fix}")


def _dims(op: str, name: str, arr, ndim: int, what: str) -> tuple[int, ...]:
    if arr.ndim != ndim:
        _refuse(op, f"{name} must be {ndim}-D {what}, got shape {tuple(int(d) for d in arr.shape)}")
    return tuple(int(d) for d in arr.shape)


@dataclass(frozen=True)
class Experts:
    """The expert tables. Storage slot j holds one expert's weights; table[e] is where expert e
    is stored (identity by default). gs_* are the per-slot f32 global scales."""

    wgu: object  # uint8 [E, 2I, H/2]
    sgu: object  # e4m3 [E, 2I, H/16]
    gs_gu: object  # f32 [E]
    wdn: object  # uint8 [E, H, I/2]
    sdn: object  # e4m3 [E, H, I/16]
    gs_dn: object  # f32 [E]
    table: object  # int32 [E]

    def sizes(self, op: str) -> tuple[int, int, int]:
        """(E, H, I) from the gate/up table, with every other table checked against them."""
        e, two_i, h_half = _dims(op, "wgu", self.wgu, 3, "[E, 2I, H/2] e2m1 bytes")
        h, i = 2 * h_half, two_i // 2
        if two_i % 2:
            _refuse(op, f"wgu has {two_i} rows, expected 2I (gate rows then up rows)")
        check_sizes(op, t=1, h=h, i=i, e=e)
        _need(op, "wgu", self.wgu, (e, 2 * i, h // 2), U8, "[E, 2I, H/2] e2m1, two a byte")
        _need(op, "sgu", self.sgu, (e, 2 * i, h // GROUP), E4M3, "[E, 2I, H/16] e4m3 block scales")
        _need(op, "gs_gu", self.gs_gu, (e,), F32, "[E] f32 global scales")
        _need(op, "wdn", self.wdn, (e, h, i // 2), U8, "[E, H, I/2] e2m1, two a byte")
        _need(op, "sdn", self.sdn, (e, h, i // GROUP), E4M3, "[E, H, I/16] e4m3 block scales")
        _need(op, "gs_dn", self.gs_dn, (e,), F32, "[E] f32 global scales")
        _need(op, "table", self.table, (e,), I32, "[E] int32 storage slot of each expert")
        for name in ("wgu", "wdn"):
            _aligned(op, name, getattr(self, name), 8)
        return e, h, i


# ------------------------------------------------------------------ grids


def router_grid(e: int) -> tuple[int, int, int]:
    return (-(-e // ROUTER_WARPS), 1, 1)


def glu_grid(i: int, t: int, k: int) -> tuple[int, int, int]:
    return (i // GLU_ROWS, t * k, 1)


def down_grid(h: int, t: int, k: int) -> tuple[int, int, int]:
    return (-(-h // DOWN_ROWS), t * k, 1)


def _module():
    return module(SOURCE)


# ------------------------------------------------------------------ stage 1: post_attn


def check_post_attn(mid, rr, fq, fs, gq, gsc, x, o, w_pa, w_router, act_g, eps) -> Sizes:
    op = "moe post_attn"
    t, h = _dims(op, "x", x, 2, "[T, H] bf16")
    sz = check_sizes(op, t=t, h=h)
    _need(op, "x", x, (t, h), BF16, "residual [T, H] bf16")
    _need(op, "o", o, (t, h), BF16, "attention output [T, H] bf16")
    _need(op, "w_pa", w_pa, (h,), BF16, "post-attention norm weight [H] bf16")
    _need(op, "w_router", w_router, (h,), BF16, "router norm weight [H] bf16")
    _need(op, "mid", mid, (t, h), BF16, "output [T, H] bf16")
    _need(op, "rr", rr, (t, h), BF16, "router input [T, H] bf16")
    _need(op, "fq", fq, (t, h), E4M3, "dense input [T, H] e4m3")
    _need(op, "fs", fs, (t,), F32, "dense input scales [T] f32")
    _need(op, "gq", gq, (t, h // 2), U8, "MoE input [T, H/2] e2m1, two a byte")
    _need(op, "gsc", gsc, (t, h // GROUP), E4M3, "MoE input block scales [T, H/16] e4m3")
    _scalar(op, "act_g", act_g, positive=True)
    _scalar(op, "eps", eps, positive=True)
    _check_shared(op, "H", 4 * h)
    return sz


def run_post_attn(mid, rr, fq, fs, gq, gsc, x, o, w_pa, w_router, *, act_g: float, eps: float) -> None:
    sz = check_post_attn(mid, rr, fq, fs, gq, gsc, x, o, w_pa, w_router, act_g, eps)
    _module().get("moe_post_attn")(
        (sz.t, 1, 1), (THREADS, 1, 1),
        (mid, rr, fq, fs, gq, gsc, x, o, w_pa, w_router, np.float32(act_g), np.uint32(sz.h), np.float32(eps)),
        shared_mem=4 * sz.h)


# ------------------------------------------------------------------ stage 2: router


def check_router(logits, ids, wts, ticket, rr, wr, pes, k) -> Sizes:
    op = "moe router"
    t, h = _dims(op, "rr", rr, 2, "[T, H] bf16")
    e, _ = _dims(op, "wr", wr, 2, "[E, H] bf16")
    kcap = _dims(op, "ids", ids, 2, "[T, kcap] int32")[1]
    sz = check_sizes(op, t=t, h=h, e=e, k=k, kcap=kcap)
    _need(op, "rr", rr, (t, h), BF16, "router input [T, H] bf16")
    _need(op, "wr", wr, (e, h), BF16, "router weights [E, H] bf16")
    _need(op, "pes", pes, (e,), BF16, "per-expert scales [E] bf16")
    _need(op, "logits", logits, (t, e), F32, "scratch [T, E] f32")
    _need(op, "ids", ids, (t, kcap), I32, "selected experts [T, kcap] int32")
    _need(op, "wts", wts, (t, kcap), F32, "routing weights [T, kcap] f32")
    _need(op, "ticket", ticket, (1,), TICKET, "one ticket counter, zero before the first launch")
    for name, a in (("rr", rr), ("wr", wr)):
        _aligned(op, name, a)
    return sz


def run_router(logits, ids, wts, ticket, rr, wr, pes, *, k: int) -> None:
    sz = check_router(logits, ids, wts, ticket, rr, wr, pes, k)
    _module().get("moe_router")(
        router_grid(sz.e), (ROUTER_WARPS * WARP, 1, 1),
        (logits, ids, wts, ticket, rr, wr, pes,
         np.uint32(sz.t), np.uint32(sz.e), np.uint32(sz.h), np.uint32(sz.k), np.uint32(sz.kcap)))


# ------------------------------------------------------------------ stage 3: glu


def check_glu(hq, hs, gu, ids, gq, gsc, experts: Experts, act_g, act_h, k) -> Sizes:
    op = "moe glu"
    e, h, i = experts.sizes(op)
    t, kcap = _dims(op, "ids", ids, 2, "[T, kcap] int32")
    sz = check_sizes(op, t=t, h=h, i=i, e=e, k=k, kcap=kcap)
    _need(op, "ids", ids, (t, kcap), I32, "selected experts [T, kcap] int32")
    _need(op, "gq", gq, (t, h // 2), U8, "MoE input [T, H/2] e2m1, two a byte")
    _need(op, "gsc", gsc, (t, h // GROUP), E4M3, "MoE input block scales [T, H/16] e4m3")
    _need(op, "hq", hq, (t, kcap, i // 2), U8, "GLU output [T, kcap, I/2] e2m1, two a byte")
    _need(op, "hs", hs, (t, kcap, i // GROUP), E4M3, "GLU output block scales [T, kcap, I/16] e4m3")
    if gu is not None:
        _need(op, "gu", gu, (t, kcap, 2 * i), BF16, "g/u rows [T, kcap, 2I] bf16")
    _scalar(op, "act_g", act_g, positive=True)
    _scalar(op, "act_h", act_h, positive=True)
    _check_shared(op, "H", 2 * h)
    return sz


def run_glu(hq, hs, ids, gq, gsc, experts: Experts, *, act_g: float, act_h: float, k: int, gu=None) -> None:
    sz = check_glu(hq, hs, gu, ids, gq, gsc, experts, act_g, act_h, k)
    _module().get("moe_glu")(
        glu_grid(sz.i, sz.t, sz.k), (THREADS, 1, 1),
        (hq, hs, gu if gu is not None else np.uint64(0), ids, experts.table, gq, gsc,
         experts.wgu, experts.sgu, experts.gs_gu, np.float32(act_g), np.float32(act_h),
         np.uint32(sz.e), np.uint32(sz.h), np.uint32(sz.i), np.uint32(sz.k), np.uint32(sz.kcap)),
        shared_mem=2 * sz.h)


def check_glu_quant_ref(hq, hs, gu, act_h) -> tuple[int, int]:
    op = "moe glu reference"
    slots, two_i = _dims(op, "gu", gu, 2, "[slots, 2I] bf16")
    i = two_i // 2
    if two_i % 2 or i % DIM_MULTIPLE or i <= 0:
        _refuse(op, f"I={two_i / 2:g} is not a positive multiple of {DIM_MULTIPLE}: gu must be [slots, 2I]")
    _need(op, "gu", gu, (slots, 2 * i), BF16, "g/u rows [slots, 2I] bf16, gate half first")
    _need(op, "hq", hq, (slots, i // 2), U8, "[slots, I/2] e2m1, two a byte")
    _need(op, "hs", hs, (slots, i // GROUP), E4M3, "[slots, I/16] e4m3")
    _scalar(op, "act_h", act_h, positive=True)
    return slots, i


def run_glu_quant_ref(hq, hs, gu, *, act_h: float) -> None:
    """The reference arm: the GLU and quantizer device functions on given g/u rows."""
    slots, i = check_glu_quant_ref(hq, hs, gu, act_h)
    _module().get("moe_glu_quant_ref")((i // GROUP, slots, 1), (WARP, 1, 1), (hq, hs, gu, np.float32(act_h), np.uint32(i)))


# ------------------------------------------------------------------ stage 4: down


def check_down(opair, ids, hq, hs, experts: Experts, act_h, k) -> Sizes:
    op = "moe down"
    e, h, i = experts.sizes(op)
    t, kcap = _dims(op, "ids", ids, 2, "[T, kcap] int32")
    sz = check_sizes(op, t=t, h=h, i=i, e=e, k=k, kcap=kcap)
    _need(op, "ids", ids, (t, kcap), I32, "selected experts [T, kcap] int32")
    _need(op, "hq", hq, (t, kcap, i // 2), U8, "GLU output [T, kcap, I/2] e2m1, two a byte")
    _need(op, "hs", hs, (t, kcap, i // GROUP), E4M3, "GLU output block scales [T, kcap, I/16] e4m3")
    _need(op, "opair", opair, (t, kcap, h), BF16, "expert outputs [T, kcap, H] bf16")
    _scalar(op, "act_h", act_h, positive=True)
    _check_shared(op, "I", 2 * i, "split the expert width")  # the staged activation, bf16 [I]
    return sz


def run_down(opair, ids, hq, hs, experts: Experts, *, act_h: float, k: int) -> None:
    sz = check_down(opair, ids, hq, hs, experts, act_h, k)
    _module().get("moe_down")(
        down_grid(sz.h, sz.t, sz.k), (THREADS, 1, 1),
        (opair, ids, experts.table, hq, hs, experts.wdn, experts.sdn, experts.gs_dn, np.float32(act_h),
         np.uint32(sz.e), np.uint32(sz.h), np.uint32(sz.i), np.uint32(sz.k), np.uint32(sz.kcap)),
        shared_mem=2 * sz.i)


# ------------------------------------------------------------------ stage 5: final


def check_final(out, dense, opair, wts, mid, w_d, w_m, layer_scalar, eps, k) -> Sizes:
    op = "moe final"
    t, h = _dims(op, "mid", mid, 2, "[T, H] bf16")
    kcap = _dims(op, "wts", wts, 2, "[T, kcap] f32")[1]
    sz = check_sizes(op, t=t, h=h, k=k, kcap=kcap)
    _need(op, "mid", mid, (t, h), BF16, "residual after attention [T, H] bf16")
    _need(op, "dense", dense, (t, h), BF16, "dense-MLP output [T, H] bf16")
    _need(op, "opair", opair, (t, kcap, h), BF16, "expert outputs [T, kcap, H] bf16")
    _need(op, "wts", wts, (t, kcap), F32, "routing weights [T, kcap] f32")
    _need(op, "w_d", w_d, (h,), BF16, "dense norm weight [H] bf16")
    _need(op, "w_m", w_m, (h,), BF16, "MoE norm weight [H] bf16")
    _need(op, "out", out, (t, h), BF16, "layer output [T, H] bf16")
    _scalar(op, "layer_scalar", layer_scalar, positive=False)
    _scalar(op, "eps", eps, positive=True)
    _check_shared(op, "H", 4 * h)
    return sz


def run_final(out, dense, opair, wts, mid, w_d, w_m, *, layer_scalar: float, eps: float, k: int) -> None:
    sz = check_final(out, dense, opair, wts, mid, w_d, w_m, layer_scalar, eps, k)
    _module().get("moe_final")(
        (sz.t, 1, 1), (THREADS, 1, 1),
        (out, dense, opair, wts, mid, w_d, w_m, np.float32(layer_scalar),
         np.uint32(sz.h), np.uint32(sz.k), np.uint32(sz.kcap), np.float32(eps)),
        shared_mem=4 * sz.h)
