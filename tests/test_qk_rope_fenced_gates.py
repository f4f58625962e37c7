"""Host-only checks of the QK-RoPE memory-safety gates' plumbing (no GPU): the fenced inputs
hold the designed values between fences, the guarded outputs sit between untouched guards,
a kernel that computes the right values passes, and one that stores an element past an
output, or reads a fence, fails by assertion. The device stands in for numpy here: the
buffers module's device copies become host arrays and the launcher's kernels are replaced
by a host emulation that writes through the same views the gate hands them."""

import numpy as np
import pytest

from gates import _qk_rope as qk
from harness.library import buffers
from harness.library.bits import BitsMismatch
from harness.library.dtypes import bf16, bits_of
from oracles import qk_rope as design
from tests.host_device import below as _below
from tests.host_device import host_buffers  # noqa: F401 (a fixture)
from tests.host_device import store_before, store_past


@pytest.fixture(params=[256, 512], ids=["hd256", "hd512"])
def host_device(host_buffers, request):
    return qk.host_data(request.param, 128)


def _emulate_flat(mode="right"):
    def run_flat(q, k, v, q_w, k_w, cos, sin, positions, q_out, k_out, v_out, *, rotary_dim, eps, row_offset=0):
        # the launcher's own checks take the fenced views and the guarded outputs
        heads = qk.launcher.check_heads(q, k, v, q_w, k_w, cos, sin, rotary_dim=rotary_dim)
        pos = qk.launcher.check_positions(heads, positions, heads.num_tokens)
        for name, out, n in (("q_out", q_out, heads.nq), ("k_out", k_out, heads.nkv), ("v_out", v_out, heads.nkv)):
            qk.launcher._check_out(name, out, heads.num_tokens, n, heads)
        q_out[...] = design.closed_form(q, q_w, pos, cos, sin, rotary_dim)
        if mode == "reads the fence":
            # element -1 of q read for element 0: the fence's NaN, then every element of the
            # row through its norm, as the kernel would
            q_out.view(np.uint16)[0, 0, :] = _below(q)
        k_out[...] = design.closed_form(k, k_w, pos, cos, sin, rotary_dim)
        v_out[...] = design.closed_form_weightless(v if v is not None else k)
        if mode == "stores one past":
            store_past(k_out)
    return run_flat


def test_the_fenced_inputs_hold_the_design_between_nan_fences(host_device):
    f = qk.fenced_inputs(host_device)
    for name, a in host_device.host.items():
        if a is None:
            assert getattr(f, name) is None
            continue
        got = getattr(f, name)
        assert got.dtype == a.dtype and got.shape == a.shape and np.array_equal(bits_of(got), bits_of(a))
        assert _below(got) == buffers.nan_bits(a.dtype), name


def test_the_guarded_buffer_sits_between_filler_guards(host_device):
    view, whole = qk.guarded((3, 2, 4), 0)
    assert view.dtype == bf16 and view.shape == (3, 2, 4) and not bits_of(view).any()
    assert whole.size == 24 + 2 * qk.GUARD
    qk.assert_guards_untouched("buffer", whole)


def test_the_flat_gate_passes_a_right_kernel_and_names_a_store_past_an_output(host_device, monkeypatch):
    monkeypatch.setattr(qk.launcher, "run_flat", _emulate_flat())
    qk.flat_reads_and_writes_nothing_outside_its_buffers(host_device)
    monkeypatch.setattr(qk.launcher, "run_flat", _emulate_flat("stores one past"))
    with pytest.raises(BitsMismatch, match=r"k_out \(flat\): the 1024 elements past it.*sentinel region was written"):
        qk.flat_reads_and_writes_nothing_outside_its_buffers(host_device)


def test_the_flat_gate_names_a_read_of_the_fence_before_an_input(host_device, monkeypatch):
    monkeypatch.setattr(qk.launcher, "run_flat", _emulate_flat("reads the fence"))
    with pytest.raises(BitsMismatch, match=r"q_out \(flat, inputs between NaN fences, vs closed form\)"):
        qk.flat_reads_and_writes_nothing_outside_its_buffers(host_device)


def test_the_prefill_gate_passes_the_layout_and_names_a_store_before_the_pool(host_device, monkeypatch):
    data = host_device
    scenario = qk.SCENARIO
    layout = qk.layout_for(data, scenario)
    monkeypatch.setattr(qk.launcher, "run_flat", _emulate_flat())
    flat_q, flat_k, flat_v = qk.flat_arm(data, scenario.positions)
    pages = [layout.page_of(int(p), scenario.window, scenario.page_origin) for p in scenario.positions]
    image = layout.image(scenario.layer, pages, scenario.positions, flat_k, flat_v)
    seen = {}

    def run_paged_prefill(q, k, v, q_w, k_w, cos, sin, q_out, pool, *, page_indices, stray=False, **kw):
        heads = qk.launcher.check_heads(q, k, v, q_w, k_w, cos, sin, rotary_dim=kw["rotary_dim"])
        assert qk.launcher.check_pool(heads, pool, page_size=kw["page_size"], num_layers=kw["num_layers"],
                                      layer=kw["layer"]) == layout.num_pages
        qk.launcher._check_out("q_out", q_out, heads.num_tokens, heads.nq, heads)
        seen["window"] = page_indices
        q_out[...] = flat_q
        pool[...] = image
        if seen.get("stray"):
            store_before(pool)

    monkeypatch.setattr(qk.launcher, "run_paged_prefill", run_paged_prefill)
    qk.prefill_reads_and_writes_nothing_outside_its_buffers(data)
    window = seen["window"]
    assert window.tolist() == list(scenario.window) and _below(window) == qk.PAGE_FENCE, "fenced by page id -1"
    seen["stray"] = True
    with pytest.raises(BitsMismatch, match=r"pool \(paged prefill\): the 1024 elements before it"):
        qk.prefill_reads_and_writes_nothing_outside_its_buffers(data)
