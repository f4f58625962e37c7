"""Host-only checks of the MoE memory-safety gates' plumbing (no GPU): the launchers' own
checks accept the fenced inputs and guarded outputs, an emulated kernel that writes the
designed values passes, and one that stores past an output or reads a fence fails by
assertion (tests/host_device.py stands in for the device)."""

import sys
import types

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


# ------------------------------------------------------------------ the invariance gate on an emulated device
#
# A numpy model of every moe_decode kernel (each launcher's own checks first, then the kernel's
# order of f32 operations from oracles.moe_decode, a correctly rounded rsqrt and expf, tanh
# per element): batch-invariant by construction, so the gate passes on it; with one norm summed
# in another order for batches past 4 tokens (what the control
# moe_final_dense_norm_order_from_the_batch puts into the .cu) the gate fails by its assertion.

import contextlib  # noqa: E402
import math  # noqa: E402

import numpy as np  # noqa: E402

from gates import test_moe_invariance as inv  # noqa: E402
from gates import test_moe_sweep as sw  # noqa: E402
from harness.library.sweep import Dim, ShapeFailed, ShapeSpace, sweep  # noqa: E402
from harness.library.dtypes import bf16, to_bf16  # noqa: E402
from harness.library.invariance import NotBatchInvariant  # noqa: E402


class EmulatedMoe:
    """The launchers of kernels_cu.moe_decode over host arrays. `final_order(T)` names the
    order of final's dense norm for a batch of T tokens ("kernel" by default); with
    `router_elements` the router's dot stops there (a chunk loop bound cut short)."""

    def __init__(self, final_order=lambda t: "kernel", router_elements=None):
        self.final_order = final_order
        self.router_elements = router_elements

    @staticmethod
    def _rms(v, order="kernel", eps=1e-6):
        return od.rms_factor32(od.block_sum_of_squares(v, order), v.shape[-1], eps)

    def run_post_attn(self, mid, rr, fq, fs, gq, gsc, x, o, w_pa, w_router, *, act_g, eps):
        g.moe.check_post_attn(mid, rr, fq, fs, gq, gsc, x, o, w_pa, w_router, act_g, eps)
        case = od.PostAttnOrderCase(np.asarray(x), np.asarray(o), np.asarray(w_pa), np.asarray(w_router), act_g, eps)
        m = case.mid(case.inv("o"))
        n = (m.astype(np.float32) * case.inv("mid")[:, None]).astype(np.float32)
        f_s, r_r = case.n_outputs(m, case.inv("mid"))
        mid[...], rr[...], fs[...] = m, r_r, f_s
        with np.errstate(divide="ignore", invalid="ignore"):
            q8 = od.e4m3_sat_bits(n / f_s[:, None])
        fq[...] = np.where(f_s[:, None] == 0, np.uint8(0), q8)
        gq[...], gsc[...] = od.nvfp4_quantize(n, act_g)

    def run_router(self, logits, ids, wts, ticket, rr, wr, pes, *, k):
        g.moe.check_router(logits, ids, wts, ticket, rr, wr, pes, k)
        rr = np.array(rr)
        if self.router_elements is not None:
            rr[:, self.router_elements:] = 0
        lg = od.RouterOrderCase(rr, np.asarray(wr), np.asarray(pes)).logits()
        logits[...] = lg
        top = od.topk_ties_low(lg, k)
        sel = np.take_along_axis(lg, top, axis=1)
        ex = np.array([[math.exp(float(np.float32(v - row[0]))) for v in row] for row in sel], np.float32)
        total = np.zeros(sel.shape[0], np.float32)
        for kk in range(k):
            total = (total + ex[:, kk]).astype(np.float32)
        ids[:, :k], wts[:, :k] = top, (ex / total[:, None]).astype(np.float32)

    @staticmethod
    def _store(ids, experts, t, kk):
        e = int(ids[t, kk])
        e_all = experts.table.shape[0]
        assert 0 <= e < e_all, f"the device guard traps on expert {e}"
        return int(experts.table[e])

    def run_glu(self, hq, hs, ids, gq, gsc, experts, *, act_g, act_h, k, gu=None):
        sz = g.moe.check_glu(hq, hs, gu, ids, gq, gsc, experts, act_g, act_h, k)
        for t in range(sz.t):
            x = od.nvfp4_dequantize(gq[t], gsc[t], act_g)
            for kk in range(k):
                st = self._store(ids, experts, t, kk)
                rows = od.nvfp4_rows(experts.wgu[st], experts.sgu[st], float(experts.gs_gu[st]), x)
                gf, uf = rows[:sz.i].astype(np.float32), rows[sz.i:].astype(np.float32)
                cubic = od.fma32((np.float32(0.044715) * gf).astype(np.float32), (gf * gf).astype(np.float32), gf)
                inner = (np.float32(0.7978845608028654) * cubic).astype(np.float32)
                th = np.array([math.tanh(float(v)) for v in inner], np.float32)
                a = (np.float32(0.5) * gf * (np.float32(1) + th) * uf).astype(np.float32)
                hq[t, kk], hs[t, kk] = od.nvfp4_quantize(a, act_h)
                if gu is not None:
                    gu[t, kk] = rows

    def run_down(self, opair, ids, hq, hs, experts, *, act_h, k):
        sz = g.moe.check_down(opair, ids, hq, hs, experts, act_h, k)
        for t in range(sz.t):
            for kk in range(k):
                st = self._store(ids, experts, t, kk)
                x = od.nvfp4_dequantize(hq[t, kk], hs[t, kk], act_h)
                opair[t, kk] = od.nvfp4_rows(experts.wdn[st], experts.sdn[st], float(experts.gs_dn[st]), x)

    def run_final(self, out, dense, opair, wts, mid, w_d, w_m, *, layer_scalar, eps, k):
        sz = g.moe.check_final(out, dense, opair, wts, mid, w_d, w_m, layer_scalar, eps, k)
        case = od.FinalOrderCase(np.asarray(mid), np.asarray(dense), np.asarray(opair)[:, :k], np.asarray(wts)[:, :k],
                                 np.asarray(w_d), np.asarray(w_m), layer_scalar, eps)
        out[...] = case.out(case.inv("dense", self.final_order(sz.t)), case.inv("moe"))


@pytest.fixture
def emulated_moe(monkeypatch):
    """The gates' device over numpy: CuPy's allocations are numpy's, the launchers emulated."""
    fake = types.SimpleNamespace(asarray=np.asarray, full=np.full, zeros=np.zeros, empty=np.empty, ndarray=np.ndarray)
    monkeypatch.setitem(sys.modules, "cupy", fake)
    emu = EmulatedMoe()
    for name in ("run_post_attn", "run_router", "run_glu", "run_down", "run_final"):
        monkeypatch.setattr(g.moe, name, getattr(emu, name))
    monkeypatch.setattr(sw, "device_memory", lambda nbytes, why: contextlib.nullcontext())
    inv._case.cache_clear()
    yield emu
    inv._case.cache_clear()


SMALL = "small-E13-H192-I128-K3"


@pytest.mark.parametrize("stage", inv.STAGES)
def test_the_invariance_gate_passes_a_batch_invariant_device(emulated_moe, monkeypatch, stage):
    monkeypatch.setattr(inv, "BATCH_SIZES", (1, 5, 8))  # the emulation is slow; these cross T > 4
    inv.test_a_tokens_outputs_do_not_depend_on_its_batch_its_place_or_the_layout(SMALL, stage)


def test_the_invariance_gate_of_each_stage_checks_that_stages_outputs_and_together_every_output():
    assert sorted(name for stage in inv.STAGES for name in inv.outputs_of(stage)) == sorted(inv.OUTPUTS)
    assert all(inv.outputs_of(stage) for stage in inv.STAGES)


def test_the_invariance_gate_fails_a_final_dense_norm_summed_otherwise_past_four_tokens(emulated_moe, monkeypatch):
    monkeypatch.setattr(inv, "BATCH_SIZES", (1, 5))
    emulated_moe.final_order = lambda t: "warps reversed" if t > 4 else "kernel"
    with pytest.raises(NotBatchInvariant, match=r"batch invariance of moe decode final out: row 0 at position"):
        inv.test_a_tokens_outputs_do_not_depend_on_its_batch_its_place_or_the_layout(SMALL, "final")
    for stage in ("post_attn", "router", "glu", "down"):  # the stages before it launch as they did
        inv.test_a_tokens_outputs_do_not_depend_on_its_batch_its_place_or_the_layout(SMALL, stage)


# ------------------------------------------------------------------ the sweep's check on the emulated device

# Small shapes at the space's edges: E = K, K = 1, E past 128 with winners there, H and I a
# whole 64-lane sweep (1024) and a tail past it, H past the seed's 2816.
SWEEP_SHAPES = [dict(T=1, K=1, E=1, H=64, I=64), dict(T=3, K=3, E=3, H=192, I=128),
                dict(T=2, K=8, E=200, H=1024, I=64), dict(T=8, K=2, E=9, H=64, I=1088),
                dict(T=2, K=4, E=33, H=2880, I=64)]


@pytest.mark.parametrize("shape", SWEEP_SHAPES, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
def test_the_sweep_check_passes_an_emulated_device(emulated_moe, shape):
    assert sw.MOE_SHAPES.problem(shape) is None
    sw.moe_shape_check(shape)


def test_the_sweep_shrinks_a_router_cut_at_the_seeds_hidden_size_to_h_2880(emulated_moe):
    # What the control moe_router_chunk_loop_stops_at_the_seeds_hidden puts into the .cu, on a
    # small space of the same check (the real one's presets are too large to emulate).
    emulated_moe.router_elements = 2816
    space = ShapeSpace("moe_small", (Dim("T", 1, 2), Dim("K", 1, 2), Dim("E", 1, 16), Dim("H", 64, 3072, 64, 1024),
                                     Dim("I", 64, 128, 64)), where=sw.MOE_SHAPES.where[:1])
    with pytest.raises(ShapeFailed, match=r"smallest failing shape is T=1, K=1, E=1, H=2880, I=64 .*router logits"):
        sweep(space, sw.moe_shape_check, budget=0, nodeid="gates/test_moe_sweep.py::x")
