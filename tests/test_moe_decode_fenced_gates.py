"""Host-only checks of the MoE memory-safety gates' plumbing (no GPU): the launchers' own
checks accept the fenced inputs and guarded outputs, an emulated kernel that writes the
designed values passes, and one that stores past an output or reads a fence fails by
assertion (tests/host_device.py stands in for the device)."""

import pytest

from gates import _moe_decode as g
from harness import assert_bits_eq
from harness.library.bits import BitsMismatch
from oracles import moe_decode as od
from tests.host_device import below, host_buffers, store_before, store_past, whole_of  # noqa: F401 (a fixture)

SHAPE = g.SHAPES["small-E13-H192-I128-K3-T3"]
BF16_NAN = 0x7FC0


def _post_attn_case():
    return od.post_attn_designed(SHAPE.t, SHAPE.h, seed=SHAPE.h)


def _emulate_post_attn(case, mode="right"):
    def run_post_attn(mid, rr, fq, fs, gq, gsc, x, o, w_pa, w_router, *, act_g, eps):
        g.moe.check_post_attn(mid, rr, fq, fs, gq, gsc, x, o, w_pa, w_router, act_g, eps)
        for name, out in dict(mid=mid, rr=rr, fq=fq, fs=fs, gq=gq, gsc=gsc).items():
            out[...] = getattr(case, name)
        assert below(x) == BF16_NAN and below(w_router) == BF16_NAN, "the inputs are fenced"
        if mode == "stores one past gsc":
            store_past(gsc)
    return run_post_attn


def test_the_post_attn_gate_passes_the_design_and_names_a_store_past_an_output(host_buffers, monkeypatch):
    case = _post_attn_case()
    monkeypatch.setattr(g.moe, "run_post_attn", _emulate_post_attn(case))
    out, wholes = g.run_post_attn_fenced(case.x, case.o, case.w_pa, case.w_router, act_g=case.act_g, eps=case.eps)
    assert set(wholes) == {"mid", "rr", "fq", "fs", "gq", "gsc"}
    for name, whole in wholes.items():
        g.assert_guards_untouched(name, whole)
    assert_bits_eq("mid", g.host(out.mid), case.mid)
    monkeypatch.setattr(g.moe, "run_post_attn", _emulate_post_attn(case, "stores one past gsc"))
    _, wholes = g.run_post_attn_fenced(case.x, case.o, case.w_pa, case.w_router, act_g=case.act_g, eps=case.eps)
    with pytest.raises(BitsMismatch, match=r"post_attn gsc: the 1024 elements past it"):
        for name, whole in wholes.items():
            g.assert_guards_untouched(f"post_attn {name}", whole)


def test_every_post_attn_input_lies_between_nan_fences_and_every_output_between_guards(host_buffers, monkeypatch):
    case = _post_attn_case()
    seen = {}
    monkeypatch.setattr(g.moe, "run_post_attn", lambda *a, **kw: seen.update(args=a))
    g.run_post_attn_fenced(case.x, case.o, case.w_pa, case.w_router, act_g=case.act_g, eps=case.eps)
    outs, ins = seen["args"][:6], seen["args"][6:]
    for a in ins:
        whole, start = whole_of(a)
        assert whole[start - 1] == BF16_NAN and whole[start + a.size] == BF16_NAN
    for a in outs:
        whole, start = whole_of(a)
        sentinel = g.sentinel_of(a.dtype)
        assert start == g.buffers.GUARD and whole.size == a.size + 2 * g.buffers.GUARD
        assert whole[start - 1] == sentinel and whole[start + a.size] == sentinel


def test_the_final_gate_passes_the_design_and_names_a_store_before_out(host_buffers, monkeypatch):
    s = SHAPE
    case, args = g.final_designed_inputs(s)
    stray = {"on": False}

    def run_final(out, dense, opair_d, wts_d, mid, w_d, w_m, *, layer_scalar, eps, k):
        g.moe.check_final(out, dense, opair_d, wts_d, mid, w_d, w_m, layer_scalar, eps, k)
        assert below(wts_d) == 0x7FC00000 and below(opair_d) == BF16_NAN
        out[...] = case.out
        if stray["on"]:
            store_before(out)

    monkeypatch.setattr(g.moe, "run_final", run_final)
    out, whole = g.run_final_fenced(*args, layer_scalar=case.layer_scalar, eps=case.eps, k=s.k)
    assert_bits_eq("final out", g.host(out), case.out)
    g.assert_guards_untouched("final out", whole)
    stray["on"] = True
    _, whole = g.run_final_fenced(*args, layer_scalar=case.layer_scalar, eps=case.eps, k=s.k)
    with pytest.raises(BitsMismatch, match=r"final out: the 1024 elements before it"):
        g.assert_guards_untouched("final out", whole)
