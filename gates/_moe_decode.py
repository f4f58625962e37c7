"""Shared helpers of the MoE decode gates: the shapes, one helper a kernel call, device expert
tables, sentinels, and the chain run the links share.

Every kernel call of the family is spelled here once. Outputs are allocated filled with
sentinels (NaN payloads and an out-of-range id no kernel computes), with kcap = K + 2 slots a
token, so the two slots past K are scratch the launch does not own: reading them back
unchanged is part of every assertion on a slot buffer.

Seed-size expert tables are about 430 MB: only the experts a gate selects are filled
(random NVFP4 weights); every other expert keeps zero codes with NaN block scales (e4m3 0x7F)
and a NaN global scale, so an expert read by mistake poisons its output.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from harness.library import buffers
from harness.library.buffers import assert_untouched, filled
from harness.library.caching import host_cache
from harness.library.dtypes import bf16, to_bf16
from kernels_cu import moe_decode as moe
from kernels_cu import nvfp4_gemv
from oracles import moe_decode as od


@dataclass(frozen=True)
class Shape:
    t: int
    h: int
    i: int
    e: int
    k: int

    @property
    def kcap(self) -> int:
        return self.k + 2


# The seed's sizes, and small ones off every block size (E 13 is not a multiple of the 8
# experts a router block; H 192 is three 64-lane sweeps; K 3 and T 3 are odd).
SHAPES = {
    "seed-E128-H2816-I704-K8-T2": Shape(t=2, h=2816, i=704, e=128, k=8),
    "small-E13-H192-I128-K3-T3": Shape(t=3, h=192, i=128, e=13, k=3),
}
SHAPE_IDS = list(SHAPES)

BF16_SENTINEL = 0x7FA5
F32_SENTINEL = 0x7FA5A5A5
ID_SENTINEL = 0x7FA5A5A5  # an int32 far outside [0, E)
BYTE_SENTINEL = 0xA5
NAN_E4M3 = 0x7F


def host(a) -> np.ndarray:
    return a.get() if hasattr(a, "get") else np.asarray(a)


def put(a):
    """A device copy of a host array; a device array is passed through."""
    import cupy

    if isinstance(a, cupy.ndarray):
        return a
    return cupy.asarray(np.ascontiguousarray(a))


def _bf16(shape):
    return filled(shape, bf16, BF16_SENTINEL)


def _bytes(shape):
    return filled(shape, np.uint8, BYTE_SENTINEL)


def _out(shape, dtype, zeroed: bool):
    """An output buffer holding its dtype's sentinel, or zeros with `zeroed` (what an engine
    hands a kernel that accumulates into its output; the determinism gate's buffers)."""
    return filled(shape, dtype, 0 if zeroed else sentinel_of(dtype))


def sentinel_of(dtype) -> int:
    """The sentinel an output of `dtype` starts as (the helpers above)."""
    dtype = np.dtype(dtype)
    return {1: BYTE_SENTINEL, 2: BF16_SENTINEL, 4: ID_SENTINEL if dtype == np.int32 else F32_SENTINEL}[dtype.itemsize]


def zero_ticket():
    import cupy

    return cupy.zeros(1, dtype=np.uint32)


# ------------------------------------------------------------------ one helper a kernel


@dataclass
class PostAttnOut:
    mid: object
    rr: object
    fq: object
    fs: object
    gq: object
    gsc: object


def _post_attn_outputs(t: int, h: int):
    """(name, shape, dtype) of each post_attn output."""
    return (("mid", (t, h), bf16), ("rr", (t, h), bf16), ("fq", (t, h), np.uint8), ("fs", (t,), np.float32),
            ("gq", (t, h // 2), np.uint8), ("gsc", (t, h // od.GROUP), np.uint8))


def run_post_attn(x, o, w_pa, w_router, *, act_g: float, eps: float, zeroed: bool = False) -> PostAttnOut:
    t, h = x.shape
    out = PostAttnOut(**{name: _out(shape, dtype, zeroed) for name, shape, dtype in _post_attn_outputs(t, h)})
    moe.run_post_attn(out.mid, out.rr, out.fq, out.fs, out.gq, out.gsc, put(x), put(o), put(w_pa), put(w_router),
                      act_g=act_g, eps=eps)
    return out


@dataclass
class RouterOut:
    logits: object
    ids: object
    wts: object


def run_router(rr, wr, pes, *, k: int, kcap: int, ticket=None, zeroed: bool = False) -> RouterOut:
    t = rr.shape[0]
    e = wr.shape[0]
    out = RouterOut(logits=_out((t, e), np.float32, zeroed), ids=_out((t, kcap), np.int32, zeroed),
                    wts=_out((t, kcap), np.float32, zeroed))
    moe.run_router(out.logits, out.ids, out.wts, zero_ticket() if ticket is None else ticket,
                   put(rr), put(wr), put(pes), k=k)
    return out


def run_glu(ids, gq, gsc, experts: moe.Experts, *, act_g: float, act_h: float, k: int, i: int,
            gu_rows: bool = True, zeroed: bool = False):
    """(hq, hs, gu) device arrays; gu holds the bf16 g/u rows (None without `gu_rows`: the
    production launch, whose gu pointer is null)."""
    t, kcap = ids.shape
    hq, hs = _out((t, kcap, i // 2), np.uint8, zeroed), _out((t, kcap, i // od.GROUP), np.uint8, zeroed)
    gu = _out((t, kcap, 2 * i), bf16, zeroed) if gu_rows else None
    moe.run_glu(hq, hs, put(ids), put(gq), put(gsc), experts, act_g=act_g, act_h=act_h, k=k, gu=gu)
    return hq, hs, gu


def run_down(ids, hq, hs, experts: moe.Experts, *, act_h: float, k: int, h: int, zeroed: bool = False):
    t, kcap = ids.shape
    opair = _out((t, kcap, h), bf16, zeroed)
    moe.run_down(opair, put(ids), put(hq), put(hs), experts, act_h=act_h, k=k)
    return opair


def run_final(dense, opair, wts, mid, w_d, w_m, *, layer_scalar: float, eps: float, k: int, zeroed: bool = False):
    out = _out(mid.shape, bf16, zeroed)
    moe.run_final(out, put(dense), put(opair), put(wts), put(mid), put(w_d), put(w_m),
                  layer_scalar=layer_scalar, eps=eps, k=k)
    return out


def final_designed_inputs(shape: Shape):
    """The designed final case at `shape` and run_final's inputs for it: (case, (dense, opair,
    wts, mid, w_d, w_m)), opair and wts NaN in the slots past K (which must never be read)."""
    case = od.final_designed(shape.t, shape.h, shape.k, seed=shape.h + shape.k)
    opair = np.full((shape.t, shape.kcap, shape.h), np.nan, dtype=np.float32)
    opair[:, :shape.k] = case.opair.astype(np.float32)
    wts = np.full((shape.t, shape.kcap), np.nan, np.float32)
    wts[:, :shape.k] = case.wts
    return case, (case.dense, to_bf16(opair), wts, case.mid, case.w_d, case.w_m)


# ------------------------------------------------------------------ memory safety

def guarded(shape, dtype):
    """An output holding its dtype's sentinel between sentinel guards
    (`harness.library.buffers.guarded`): (the view, the whole allocation)."""
    return buffers.guarded(shape, dtype, sentinel_of(dtype))


def assert_guards_untouched(label: str, whole) -> None:
    """Both guards of a `guarded` output untouched (`whole` is its unsigned view: ID_SENTINEL
    and F32_SENTINEL are the same bits, so its size says which sentinel)."""
    buffers.assert_guards_untouched(label, whole, sentinel_of(whole.dtype))


def run_post_attn_fenced(x, o, w_pa, w_router, *, act_g: float, eps: float):
    """run_post_attn with every input fenced and every output guarded: (PostAttnOut, {name:
    the output's whole allocation})."""
    t, h = x.shape
    made = {name: guarded(shape, dtype) for name, shape, dtype in _post_attn_outputs(t, h)}
    out = PostAttnOut(**{name: view for name, (view, _) in made.items()})
    moe.run_post_attn(out.mid, out.rr, out.fq, out.fs, out.gq, out.gsc,
                      *map(buffers.fenced, (x, o, w_pa, w_router)), act_g=act_g, eps=eps)  # between quiet NaNs
    return out, {name: whole for name, (_, whole) in made.items()}


def run_final_fenced(dense, opair, wts, mid, w_d, w_m, *, layer_scalar: float, eps: float, k: int):
    """run_final with every input fenced and the output guarded: (out, its whole allocation)."""
    out, whole = guarded(mid.shape, bf16)
    moe.run_final(out, *map(buffers.fenced, (dense, opair, wts, mid, w_d, w_m)),  # between quiet NaNs
                  layer_scalar=layer_scalar, eps=eps, k=k)
    return out, whole


def run_router_fenced(rr, wr, pes, *, k: int, kcap: int):
    """run_router with rr, wr and pes fenced and logits, ids and wts guarded: (RouterOut,
    {name: the output's whole allocation})."""
    t, e = rr.shape[0], wr.shape[0]
    made = {"logits": guarded((t, e), np.float32), "ids": guarded((t, kcap), np.int32),
            "wts": guarded((t, kcap), np.float32)}
    out = RouterOut(**{name: view for name, (view, _) in made.items()})
    moe.run_router(out.logits, out.ids, out.wts, zero_ticket(), *map(buffers.fenced, (rr, wr, pes)), k=k)
    return out, {name: whole for name, (_, whole) in made.items()}


def run_glu_reference_fenced(gu_rows, *, act_h: float):
    """run_glu_reference with gu fenced and hq, hs guarded: (hq, hs, {name: whole allocation})."""
    slots, two_i = gu_rows.shape
    (hq, hq_whole), (hs, hs_whole) = guarded((slots, two_i // 4), np.uint8), \
        guarded((slots, two_i // 2 // od.GROUP), np.uint8)
    moe.run_glu_quant_ref(hq, hs, buffers.fenced(gu_rows), act_h=act_h)
    return hq, hs, {"hq": hq_whole, "hs": hs_whole}


def run_glu_reference(gu_rows, *, act_h: float):
    """The reference arm: the GLU and quantizer device functions on given g/u rows [slots, 2I]."""
    slots, two_i = gu_rows.shape
    hq, hs = _bytes((slots, two_i // 4)), _bytes((slots, two_i // 2 // od.GROUP))
    moe.run_glu_quant_ref(hq, hs, put(gu_rows), act_h=act_h)
    return hq, hs


def certified_gemv(w, s, gs: float, x_bf16):
    """The certified NVFP4 GEMV (nvfp4_gemv base) of one weight table against bf16 x."""
    n = w.shape[0]
    y = _bf16((n,))
    nvfp4_gemv.run_nvfp4_gemv(y, put(x_bf16), w, s, float(gs), single_warp=False)
    return host(y)


# ------------------------------------------------------------------ expert tables


def _poisoned_tables(shape: Shape):
    """(wgu, sgu, gs_gu, wdn, sdn, gs_dn) of E storage slots: zero codes under NaN block and global
    scales, so a slot no expert was written into poisons whatever reads it."""
    import cupy

    e, h, i = shape.e, shape.h, shape.i
    return (cupy.zeros((e, 2 * i, h // 2), np.uint8), cupy.full((e, 2 * i, h // od.GROUP), NAN_E4M3, np.uint8),
            cupy.full((e,), np.nan, np.float32), cupy.zeros((e, h, i // 2), np.uint8),
            cupy.full((e, h, i // od.GROUP), NAN_E4M3, np.uint8), cupy.full((e,), np.nan, np.float32))


def device_experts(shape: Shape, weights: od.ExpertWeights, table: np.ndarray) -> moe.Experts:
    """Tables of E storage slots; the experts in `weights` at table[e], the rest NaN-scaled."""
    wgu, sgu, gs_gu, wdn, sdn, gs_dn = _poisoned_tables(shape)
    for eid in weights.wgu:
        st = int(table[eid])
        wgu[st] = put(weights.wgu[eid])
        sgu[st] = put(weights.sgu[eid])
        wdn[st] = put(weights.wdn[eid])
        sdn[st] = put(weights.sdn[eid])
        gs_gu[st] = weights.gs_gu[eid]
        gs_dn[st] = weights.gs_dn[eid]
    return moe.Experts(wgu=wgu, sgu=sgu, gs_gu=gs_gu, wdn=wdn, sdn=sdn, gs_dn=gs_dn, table=put(table.astype(np.int32)))


def sparse_device_experts(shape: Shape, glu: od.SparseExperts, down: od.SparseExperts,
                          table: np.ndarray) -> moe.Experts:
    """Tables of E storage slots for designed sparse experts (oracles.moe_decode.SparseExperts):
    a selected expert's slot holds zero codes under scale 1.0 but on its live groups, written
    there alone (a few bytes a row: the host never builds a whole table), and every other slot
    NaN block and global scales, so an expert read by mistake poisons its output."""
    wgu, sgu, gs_gu, wdn, sdn, gs_dn = _poisoned_tables(shape)
    for eid in glu.groups:
        st = int(table[eid])
        for w, sc, design in ((wgu, sgu, glu), (wdn, sdn, down)):
            sc[st] = 0x38
            groups, rows = design.groups[eid], np.arange(design.groups[eid].shape[0])
            cols = groups[:, :, None] * (od.GROUP // 2) + np.arange(od.GROUP // 2)  # [rows, 2, 8] byte columns
            w[st][put(np.broadcast_to(rows[:, None, None], cols.shape).ravel()), put(cols.ravel())] = \
                put(od.pack_codes(design.codes[eid]).ravel())
            sc[st][put(np.repeat(rows, 2)), put(groups.ravel())] = put(np.repeat(design.scales[eid], 2))
        gs_gu[st] = 1.0
        gs_dn[st] = 1.0
    return moe.Experts(wgu=wgu, sgu=sgu, gs_gu=gs_gu, wdn=wdn, sdn=sdn, gs_dn=gs_dn, table=put(table.astype(np.int32)))


def zero_experts(shape: Shape, *, spare: bool = False) -> moe.Experts:
    """The seed's tables: every code zero, every block scale 1.0 (0x38), every global scale 1.
    With `spare`, every table is a view of an allocation one expert longer (the table one entry
    longer on both sides, valid there): a kernel whose guard is gone then reads defined memory
    and does not fault, so a trap gate fails by its own assertion."""
    import cupy

    e, h, i = shape.e, shape.h, shape.i
    n = e + 1 if spare else e
    table = np.concatenate([[0], np.arange(e), [0]]).astype(np.int32) if spare else np.arange(e, dtype=np.int32)
    table_dev = put(table)[1:e + 1] if spare else put(table)
    return moe.Experts(
        wgu=cupy.zeros((n, 2 * i, h // 2), np.uint8)[:e], sgu=cupy.full((n, 2 * i, h // od.GROUP), 0x38, np.uint8)[:e],
        gs_gu=cupy.ones((n,), np.float32)[:e], wdn=cupy.zeros((n, h, i // 2), np.uint8)[:e],
        sdn=cupy.full((n, h, i // od.GROUP), 0x38, np.uint8)[:e], gs_dn=cupy.ones((n,), np.float32)[:e],
        table=table_dev)


def storage_weights(experts: moe.Experts, store: int):
    """(wgu, sgu, gs_gu, wdn, sdn, gs_dn) of one storage slot, device views + host scalars."""
    return (experts.wgu[store], experts.sgu[store], float(host(experts.gs_gu[store])),
            experts.wdn[store], experts.sdn[store], float(host(experts.gs_dn[store])))


# ------------------------------------------------------------------ sentinels


def assert_slots_past_k_untouched(label: str, a, k: int) -> None:
    """Slots K..kcap-1 of a [T, kcap, ...] or [T, kcap] buffer keep their sentinel."""
    h = host(a)
    assert_untouched(f"{label} slots {k}.. past K", h[:, k:], sentinel_of(h.dtype))


def assert_fully_written(label: str, a, k: int | None = None) -> None:
    """Non-vacuity: no element of the owned part still holds its sentinel (or, for bytes,
    not every byte of a row does)."""
    h = host(a)
    h = h[:, :k] if k is not None else h
    b = h.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[h.dtype.itemsize])
    sentinel = sentinel_of(h.dtype)
    if h.dtype.itemsize == 1:
        rows = b.reshape(-1, b.shape[-1])
        unwritten = int(np.count_nonzero(np.all(rows == sentinel, axis=-1)))
        assert unwritten == 0, f"{label}: {unwritten} rows still hold only the sentinel byte 0x{sentinel:02x}"
        return
    unwritten = int(np.count_nonzero(b == sentinel))
    assert unwritten == 0, f"{label}: {unwritten} of {b.size} elements still hold the sentinel 0x{sentinel:x}"


# ------------------------------------------------------------------ the shared chain run


@dataclass
class Chain:
    """One run of the whole chain on random inputs, every intermediate on the host."""

    shape: Shape
    inputs: od.LayerInputs
    weights: od.ExpertWeights
    experts: moe.Experts
    post: dict
    router: dict
    hq: np.ndarray
    hs: np.ndarray
    gu: np.ndarray
    opair: np.ndarray
    out: np.ndarray


def _host_all(obj) -> dict:
    return {name: host(value) for name, value in vars(obj).items()}


def run_chain(shape: Shape, inp: od.LayerInputs, experts: moe.Experts | None = None,
              weights: od.ExpertWeights | None = None, table: np.ndarray | None = None) -> Chain:
    """post_attn -> router -> (fill the selected experts) -> glu -> down -> final."""
    post = run_post_attn(inp.x, inp.o, inp.w_pa, inp.w_router, act_g=inp.act_g, eps=inp.eps)
    router = run_router(host(post.rr), inp.wr, inp.pes, k=shape.k, kcap=shape.kcap)
    ids = host(router.ids)
    if experts is None:
        weights = od.random_experts(ids[:, :shape.k], shape.h, shape.i, seed=shape.e + shape.h)
        table = np.arange(shape.e, dtype=np.int32) if table is None else table
        experts = device_experts(shape, weights, table)
    hq, hs, gu = run_glu(ids, host(post.gq), host(post.gsc), experts, act_g=inp.act_g, act_h=inp.act_h,
                         k=shape.k, i=shape.i)
    opair = run_down(ids, host(hq), host(hs), experts, act_h=inp.act_h, k=shape.k, h=shape.h)
    out = run_final(inp.dense, host(opair), host(router.wts), host(post.mid), inp.w_d, inp.w_m,
                    layer_scalar=inp.layer_scalar, eps=inp.eps, k=shape.k)
    return Chain(shape=shape, inputs=inp, weights=weights, experts=experts, post=_host_all(post),
                 router=_host_all(router), hq=host(hq), hs=host(hs), gu=host(gu), opair=host(opair), out=host(out))


@functools.lru_cache(maxsize=None)
def random_chain(shape_id: str) -> Chain:
    """The chain on random inputs, run once a shape per process and shared by the links."""
    shape = SHAPES[shape_id]
    return run_chain(shape, od.random_layer(shape.t, shape.h, shape.e, seed=shape.h + shape.e))


def selected_ids(chain: Chain) -> np.ndarray:
    return chain.router["ids"][:, :chain.shape.k]


@host_cache(disk=True)
def designed_glu(shape_id: str) -> od.GluWeightsCase:
    """The designed GLU case of a shape (host only; a warm campaign worker keeps it, and the
    disk keeps it between runs: it is slow to build at the seed's size)."""
    s = SHAPES[shape_id]
    return od.glu_weights_designed(s.t, s.h, s.e, s.i, s.k, seed=s.i + 1)


def random_chain_reference(shape_id: str):
    """The float64 reference of `random_chain(shape_id)` on the ids its router selected."""
    ids = np.ascontiguousarray(selected_ids(random_chain(shape_id)), dtype=np.int32)
    return _reference_on(shape_id, ids.tobytes())


@host_cache(disk=True)
def _reference_on(shape_id: str, ids: bytes):
    # A pure function of its key (the shape and the selected ids): the random inputs and the
    # experts random_chain fills are recomputed here from the same seeds, so a mutant whose
    # router selects other ids gets its own entry, never another mutant's reference.
    s = SHAPES[shape_id]
    sel = np.frombuffer(ids, dtype=np.int32).reshape(s.t, s.k)
    inp = od.random_layer(s.t, s.h, s.e, seed=s.h + s.e)
    return od.layer_reference(inp, sel, od.random_experts(sel, s.h, s.i, seed=s.e + s.h))
