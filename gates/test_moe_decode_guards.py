"""NVFP4 MoE decode: refusals (host, no GPU) and traps (the device guard on expert ids).

Every refusal names the argument, its value and the rule, and fires before any launch: the
launchers run their checks on numpy arrays here. The trap gates write a bad id into the
routing buffer the expert kernels read; the plugin runs each in the trap shadow, or
trapping for real in a fresh worker (docs/gate-run.md, "Trap gates")."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from gates import _moe_decode as g
from harness.library.dtypes import bf16, bits_of
from kernels_cu import moe_decode as moe

T, H, I, E, K = 3, 192, 128, 13, 3
KCAP = K + 2


def _bf(*shape):
    return np.zeros(shape, bf16)


def _u8(*shape):
    return np.zeros(shape, np.uint8)


def _f32(*shape):
    return np.zeros(shape, np.float32)


def _i32(*shape):
    return np.zeros(shape, np.int32)


def _misaligned(shape, dtype):
    """A C-contiguous array starting one element past a 16-byte boundary."""
    n = int(np.prod(shape))
    flat = np.zeros(n + 16, dtype)
    off = (-flat.__array_interface__["data"][0] % 16) // flat.itemsize + 1
    return flat[off:off + n].reshape(shape)


def experts(e=E, h=H, i=I, **over) -> moe.Experts:
    base = dict(wgu=_u8(e, 2 * i, h // 2), sgu=_u8(e, 2 * i, h // 16), gs_gu=_f32(e), wdn=_u8(e, h, i // 2),
                sdn=_u8(e, h, i // 16), gs_dn=_f32(e), table=np.arange(e, dtype=np.int32))
    base.update(over)
    return moe.Experts(**base)


def post_attn(t=T, h=H, **over):
    a = dict(mid=_bf(t, h), rr=_bf(t, h), fq=_u8(t, h), fs=_f32(t), gq=_u8(t, h // 2), gsc=_u8(t, h // 16),
             x=_bf(t, h), o=_bf(t, h), w_pa=_bf(h), w_router=_bf(h), act_g=2.0**-8, eps=1e-6)
    a.update(over)
    moe.run_post_attn(a.pop("mid"), a.pop("rr"), a.pop("fq"), a.pop("fs"), a.pop("gq"), a.pop("gsc"), a.pop("x"),
                      a.pop("o"), a.pop("w_pa"), a.pop("w_router"), **a)


def router(t=T, h=H, e=E, k=K, kcap=KCAP, **over):
    a = dict(logits=_f32(t, e), ids=_i32(t, kcap), wts=_f32(t, kcap), ticket=np.zeros(1, np.uint32),
             rr=_bf(t, h), wr=_bf(e, h), pes=_bf(e))
    a.update(over)
    moe.run_router(a["logits"], a["ids"], a["wts"], a["ticket"], a["rr"], a["wr"], a["pes"], k=k)


def glu(t=T, h=H, i=I, e=E, k=K, kcap=KCAP, ex=None, **over):
    a = dict(hq=_u8(t, kcap, i // 2), hs=_u8(t, kcap, i // 16), ids=_i32(t, kcap), gq=_u8(t, h // 2),
             gsc=_u8(t, h // 16))
    a.update(over)
    moe.run_glu(a["hq"], a["hs"], a["ids"], a["gq"], a["gsc"], ex or experts(e, h, i), act_g=2.0**-8,
                act_h=2.0**-8, k=k)


def down(t=T, h=H, i=I, e=E, k=K, kcap=KCAP, ex=None, **over):
    a = dict(opair=_bf(t, kcap, h), ids=_i32(t, kcap), hq=_u8(t, kcap, i // 2), hs=_u8(t, kcap, i // 16))
    a.update(over)
    moe.run_down(a["opair"], a["ids"], a["hq"], a["hs"], ex or experts(e, h, i), act_h=2.0**-8, k=k)


def final(t=T, h=H, k=K, kcap=KCAP, **over):
    a = dict(out=_bf(t, h), dense=_bf(t, h), opair=_bf(t, kcap, h), wts=_f32(t, kcap), mid=_bf(t, h),
             w_d=_bf(h), w_m=_bf(h))
    a.update(over)
    moe.run_final(a["out"], a["dense"], a["opair"], a["wts"], a["mid"], a["w_d"], a["w_m"], layer_scalar=1.0,
                  eps=1e-6, k=k)


@dataclass(frozen=True)
class Refusal:
    id: str
    substring: str
    call: object


REFUSALS = [
    Refusal("router_k_greater_than_e", "K=5 > E=4", lambda: router(e=4, k=5, kcap=5)),
    Refusal("glu_k_greater_than_e", "K=5 > E=4", lambda: glu(e=4, k=5, kcap=5)),
    Refusal("router_k_9", "K=9 is not in 1..8", lambda: router(e=16, k=9, kcap=9)),
    Refusal("down_k_9", "K=9 is not in 1..8", lambda: down(e=16, k=9, kcap=9)),
    Refusal("final_k_0", "K=0 is not in 1..8", lambda: final(k=0)),
    Refusal("post_attn_t_9", "T=9 is not in 1..8", lambda: post_attn(t=9)),
    Refusal("router_t_9", "T=9 is not in 1..8", lambda: router(t=9)),
    Refusal("glu_t_9", "T=9 is not in 1..8", lambda: glu(t=9)),
    Refusal("final_t_9", "T=9 is not in 1..8", lambda: final(t=9)),
    Refusal("post_attn_h_96", "H=96 is not a positive multiple of 64", lambda: post_attn(h=96)),
    Refusal("router_h_96", "H=96 is not a positive multiple of 64", lambda: router(h=96)),
    Refusal("glu_h_96", "H=96 is not a positive multiple of 64", lambda: glu(h=96)),
    Refusal("glu_i_80", "I=80 is not a positive multiple of 64", lambda: glu(i=80)),
    Refusal("down_i_80", "I=80 is not a positive multiple of 64", lambda: down(i=80)),
    Refusal("router_e_257", "E=257 is not in 1..256", lambda: router(e=257)),
    Refusal("kcap_below_k", "kcap=2 < K=3", lambda: glu(kcap=2)),
    Refusal("post_attn_x_f32", "x has dtype float32, expected bfloat16 or uint16", lambda: post_attn(x=_f32(T, H))),
    Refusal("router_ids_int64", "ids has dtype int64, expected int32", lambda: router(ids=np.zeros((T, KCAP), np.int64))),
    Refusal("router_wts_f16", "wts has dtype float16, expected float32", lambda: router(wts=np.zeros((T, KCAP), np.float16))),
    Refusal("glu_scales_f32", "sgu has dtype float32, expected float8_e4m3fn or uint8",
            lambda: glu(ex=experts(sgu=np.zeros((E, 2 * I, H // 16), np.float32)))),
    Refusal("down_table_wrong_length", "table has shape (12,), expected (13,)",
            lambda: down(ex=experts(table=np.arange(12, dtype=np.int32)))),
    Refusal("glu_hq_wrong_shape", "hq has shape (3, 5, 32), expected (3, 5, 64)", lambda: glu(hq=_u8(T, KCAP, 32))),
    Refusal("final_opair_wrong_shape", "opair has shape (3, 3, 192), expected (3, 5, 192)", lambda: final(opair=_bf(T, K, H))),
    Refusal("router_rr_misaligned", "rr starts at", lambda: router(rr=_misaligned((T, H), bf16))),
    Refusal("router_wr_misaligned", "not 16-byte aligned", lambda: router(wr=_misaligned((E, H), bf16))),
    Refusal("glu_wgu_misaligned", "not 8-byte aligned", lambda: glu(ex=experts(wgu=_misaligned((E, 2 * I, H // 2), np.uint8)))),
    Refusal("post_attn_h_too_large", "needs 65536 bytes of shared memory", lambda: post_attn(t=1, h=16384)),
    Refusal("down_i_too_large", "I needs 49280 bytes of shared memory, more than 49152: split the expert width",
            lambda: down(t=1, e=1, k=1, kcap=1, h=64, i=24640)),
    Refusal("post_attn_eps_zero", "eps=0.0 must be a finite positive float", lambda: post_attn(eps=0.0)),
]


@pytest.mark.refusal
@pytest.mark.parametrize("refusal", REFUSALS, ids=[r.id for r in REFUSALS])
def test_launcher_refuses_bad_arguments_before_any_launch(refusal):
    with pytest.raises(ValueError, match=__import__("re").escape(refusal.substring)):
        refusal.call()


# ------------------------------------------------------------------ traps


def _trap_glu(ids: np.ndarray, table: np.ndarray | None = None) -> None:
    """moe_glu on spare-backed tables (gates/_moe_decode.zero_experts): without its guard the
    bad id reads a valid table entry and valid weights, and nothing faults."""
    import cupy

    s = g.SHAPES["small-E13-H192-I128-K3-T3"]
    ex = g.zero_experts(s, spare=True)
    if table is not None:
        ex = moe.Experts(**{**vars(ex), "table": g.put(table)})
    g.run_glu(ids, np.zeros((s.t, s.h // 2), np.uint8), np.full((s.t, s.h // 16), 0x38, np.uint8), ex,
              act_g=2.0**-8, act_h=2.0**-8, k=s.k, i=s.i)
    cupy.cuda.runtime.deviceSynchronize()


def _valid_ids() -> np.ndarray:
    s = g.SHAPES["small-E13-H192-I128-K3-T3"]
    return np.tile(np.arange(1, s.kcap + 1, dtype=np.int32), (s.t, 1))


@pytest.mark.gpu
@pytest.mark.trap
def test_glu_guard_fires_on_an_expert_id_equal_to_e():
    ids = _valid_ids()
    ids[1, 2] = 13
    _trap_glu(ids)


@pytest.mark.gpu
@pytest.mark.trap
def test_down_guard_fires_on_a_negative_expert_id():
    import cupy

    s = g.SHAPES["small-E13-H192-I128-K3-T3"]
    ids = _valid_ids()
    ids[2, 0] = -1
    g.run_down(ids, np.zeros((s.t, s.kcap, s.i // 2), np.uint8), np.zeros((s.t, s.kcap, s.i // 16), np.uint8),
               g.zero_experts(s, spare=True), act_h=2.0**-8, k=s.k, h=s.h)
    cupy.cuda.runtime.deviceSynchronize()


@pytest.mark.gpu
@pytest.mark.trap
def test_glu_guard_fires_on_a_table_entry_outside_e():
    table = np.arange(13, dtype=np.int32)
    table[2] = 13
    _trap_glu(_valid_ids(), table)


@pytest.mark.gpu
@pytest.mark.anchor
@pytest.mark.names_faults  # a guard that fires on these valid ids fails it by its own assertion
def test_expert_guard_admits_the_boundary_ids_0_and_e_minus_1():
    # The guard traps outside [0, E) and nowhere else: ids 0 and E - 1, stored at the boundary
    # slots E - 1 and 0 (a reversed table), must run through glu and down. Zero experts make
    # every output +0 (the seed's case), so the outputs are checked too. A trap here is this
    # gate's own failure (a guard that rejects a valid expert), reported by assertion.
    import cupy

    from harness.core.device import guard_must_not_fire

    s = g.SHAPES["small-E13-H192-I128-K3-T3"]
    table = np.arange(s.e, dtype=np.int32)[::-1].copy()
    ex = moe.Experts(**{**vars(g.zero_experts(s)), "table": g.put(table)})
    ids = np.full((s.t, s.kcap), -1, np.int32)
    ids[:, :s.k] = [[0, s.e - 1, 1], [s.e - 1, 0, 2], [5, 0, s.e - 1]]
    with guard_must_not_fire(f"the expert guard fired on valid ids 0 and E-1={s.e - 1} (stored at slots E-1 and 0)"):
        hq, hs, gu = g.run_glu(ids, np.zeros((s.t, s.h // 2), np.uint8), np.full((s.t, s.h // 16), 0x38, np.uint8),
                               ex, act_g=2.0**-8, act_h=2.0**-8, k=s.k, i=s.i)
        hq, hs, gu = g.host(hq), g.host(hs), g.host(gu)
        opair = g.host(g.run_down(ids, hq, hs, ex, act_h=2.0**-8, k=s.k, h=s.h))
        cupy.cuda.runtime.deviceSynchronize()
    for name, a in (("g/u", gu), ("hq", hq), ("hs", hs), ("opair", opair)):
        g.assert_fully_written(f"glu/down {name} (boundary ids)", a, s.k)
        assert np.all(bits_of(a[:, :s.k]) == 0), f"zero experts at the boundary ids gave a nonzero {name}"
