"""Host-only checks of the QK-RoPE trap gates' designs (no GPU): each gate's bad input is
stopped by its own guard first, and with that guard gone no other guard fires and every
read and write lands inside the allocation it was given, so the gate can only be red by
its assertion ("the device guard did not fire"), never by a fault.

`_guards` mirrors qk_rope_paged's guard chain, in the kernel's order, with C's truncating
division; a zero divisor gives -1, what sm_90 computes (the signed division's zero-divisor
fix-up `LOP3.LUT R, RZ, d, RZ, 0x33`, read in the SASS of qk_rope.cu's paged kernels).
"""

import numpy as np
import pytest

from gates import _qk_rope as qk
from oracles import qk_rope as design

GUARDS = ("begin < 0", "end < begin", "end > len", "page_size <= 0", "origin < 0", "row before origin",
          "row past window", "page id")


def _c_div(a: int, b: int) -> int:
    if b == 0:
        return -1
    q = abs(a) // abs(b)
    return q if (a < 0) == (b < 0) else -q


def _c_mod(a: int, b: int) -> int:
    return a - _c_div(a, b) * b


def _guards(*, pos, page_size, origin, num_pages, indices, lead=0, indptr=None, t=0, dropped=()):
    """(the first guard that fires, None) or (None, the page the row names). `indices` is the
    whole allocation; the kernel's page_indices is its view from `lead`, of len(indices) - lead."""
    n = len(indices) - lead
    fired = []
    if indptr is not None:
        begin, end = int(indptr[t]), int(indptr[t + 1])
        fired += [g for g, bad in (("begin < 0", begin < 0), ("end < begin", end < begin), ("end > len", end > n))
                  if bad]
    else:
        begin, end = 0, n
    fired += [g for g, bad in (("page_size <= 0", page_size <= 0), ("origin < 0", origin < 0)) if bad]
    for g in fired:
        if g not in dropped:
            return g, None
    q = _c_div(pos, page_size)
    if q < origin and "row before origin" not in dropped:
        return "row before origin", None
    row = q - origin
    if row >= end - begin and "row past window" not in dropped:
        return "row past window", None
    at = lead + begin + row
    assert 0 <= at < len(indices), f"page_indices[{begin + row}] lies outside the allocation: a fault"
    page = int(indices[at])
    if (page < 0 or page >= num_pages) and "page id" not in dropped:
        return "page id", None
    return None, page


def _pool_index(page, layer, kind, pos, kv_head, page_size, num_layers, nkv, hd):
    """pool_index<HD> of qk_rope.cu, with C's % (its sign follows the dividend)."""
    kv_block = page_size * nkv * hd
    return page * num_layers * 2 * kv_block + layer * 2 * kv_block + kind * kv_block \
        + _c_mod(pos, page_size) * nkv * hd + kv_head * hd


def test_the_negative_csr_begin_gate_is_stopped_by_that_guard_and_by_nothing_else():
    s = qk.SCENARIO
    indptr, indices = s.decode_csr()
    indptr[0] = -1
    backing = np.insert(indices, 0, s.junk_page)   # the gate's allocation; its view starts at 1
    origins = s.decode_origins()
    args = lambda t: dict(pos=int(s.positions[t]), page_size=s.page_size, origin=int(origins[t]),  # noqa: E731
                          num_pages=s.num_pages, indices=backing, lead=1, indptr=indptr, t=t)
    assert _guards(**args(0)) == ("begin < 0", None)
    pages = [_guards(**args(t), dropped=("begin < 0",)) for t in range(s.num_tokens)]
    assert all(g is None for g, _ in pages), pages
    assert pages[0][1] == s.junk_page, "token 0's row 0 reads the entry before the view"


def test_the_negative_page_size_gate_is_stopped_by_that_guard_and_lands_inside_its_allocation():
    ps, nkv = qk.NEGATIVE_PAGE_SIZE, qk.NKV
    assert qk.NUM_TOKENS < -ps
    for hd in (256, 512):
        kv_block = -ps * nkv * hd
        for t in range(qk.NUM_TOKENS):   # start_pos 0: pos = t
            kw = dict(pos=t, page_size=ps, origin=0, num_pages=1, indices=np.zeros(1, np.int32))
            assert _guards(**kw) == ("page_size <= 0", None)
            assert _guards(**kw, dropped=("page_size <= 0",)) == (None, 0)
            for kind in (0, 1):
                for kh in range(nkv):
                    first = kv_block + _pool_index(0, 0, kind, t, kh, ps, 1, nkv, hd)  # into the allocation
                    assert 0 <= first and first + hd <= 2 * kv_block, (hd, t, kind, kh, first)


@pytest.mark.parametrize("origin", [0, 1, 7])
def test_a_zero_page_size_is_trapped_by_the_row_guard_even_without_its_own(origin):
    # Why the page-size trap gate uses -16, not 0: on sm_90 pos / 0 is -1, below every origin.
    for pos in (0, 5, 31):
        kw = dict(pos=pos, page_size=0, origin=origin, num_pages=6, indices=np.arange(6))
        assert _guards(**kw) == ("page_size <= 0", None)
        assert _guards(**kw, dropped=("page_size <= 0",)) == ("row before origin", None)


def test_the_scenarios_own_metadata_passes_every_guard():
    # The mirror's sanity: the decode and prefill metadata of the links fire nothing.
    for s in (qk.SCENARIO, design.ORIGIN0_SCENARIO):
        indptr, indices = s.decode_csr()
        for t, origin in enumerate(s.decode_origins()):
            g, page = _guards(pos=int(s.positions[t]), page_size=s.page_size, origin=int(origin),
                              num_pages=s.num_pages, indices=indices, indptr=indptr, t=t)
            assert g is None and page in s.window, (t, g, page)
            g, page = _guards(pos=int(s.positions[t]), page_size=s.page_size, origin=s.page_origin,
                              num_pages=s.num_pages, indices=np.asarray(s.window))
            assert g is None and page in s.window, (t, g, page)


def test_the_row_past_window_gate_is_stopped_by_that_guard_and_by_nothing_else():
    s = qk.SCENARIO
    indptr, indices = s.decode_csr()
    origins = s.decode_origins()
    origins[-1] -= 1
    backing = np.append(indices, s.junk_page)   # the gate's allocation; its view is the first len(indices)
    args = lambda t: dict(pos=int(s.positions[t]), page_size=s.page_size, origin=int(origins[t]),  # noqa: E731
                          num_pages=s.num_pages, indices=backing, indptr=indptr, t=t)
    last = s.num_tokens - 1
    # The mirror's page_indices length is len(backing); the kernel's is indices.size (end > len
    # would fire only past that, and the last end is exactly indices.size).
    assert indptr[-1] == indices.size
    assert _guards(**args(last)) == ("row past window", None)
    pages = [_guards(**args(t), dropped=("row past window",)) for t in range(s.num_tokens)]
    assert all(g is None for g, _ in pages), pages
    assert pages[last][1] == s.junk_page, "the last token's row 1 reads the entry past the view"


def test_the_negative_origin_gate_is_stopped_by_that_guard_and_by_nothing_else():
    s = qk.SCENARIO
    indptr, indices = s.decode_csr()
    origins = s.decode_origins()
    origins[0] = -1
    args = lambda t: dict(pos=int(s.positions[t]), page_size=s.page_size, origin=int(origins[t]),  # noqa: E731
                          num_pages=s.num_pages, indices=indices, indptr=indptr, t=t)
    assert _guards(**args(0)) == ("origin < 0", None)
    pages = [_guards(**args(t), dropped=("origin < 0",)) for t in range(s.num_tokens)]
    assert all(g is None for g, _ in pages), pages


def _boundary_runs():
    """(name, guard-mirror keyword arguments) of every row the boundary-metadata gate launches."""
    s, p1 = design.ORIGIN0_SCENARIO, design.PAGE1_SCENARIO
    indptr, indices = s.decode_csr(junk_lead=False)
    runs = []
    for name, sc, window in (("prefill", s, s.window), ("moved", s, qk.BOUNDARY_WINDOW), ("page size 1", p1, p1.window)):
        runs += [(name, dict(pos=int(p), page_size=sc.page_size, origin=sc.page_origin, num_pages=sc.num_pages,
                             indices=np.asarray(window))) for p in sc.positions]
    runs += [("decode", dict(pos=int(p), page_size=s.page_size, origin=int(o), num_pages=s.num_pages,
                             indices=indices, indptr=indptr, t=t))
             for t, (p, o) in enumerate(zip(s.positions, s.decode_origins()))]
    return runs


def test_the_boundary_metadata_gate_passes_every_guard_and_reaches_every_boundary():
    runs = _boundary_runs()
    for name, kw in runs:
        assert _guards(**kw)[0] is None, (name, kw)
    s = design.ORIGIN0_SCENARIO
    moved = {_guards(**kw)[1] for name, kw in runs if name == "moved"}
    assert {0, s.num_pages - 1} <= moved and len(set(qk.BOUNDARY_WINDOW)) == len(s.window)
    decode = [kw for name, kw in runs if name == "decode"]
    assert decode[0]["indptr"][0] == 0 and decode[-1]["indptr"][-1] == len(decode[-1]["indices"])
    assert any(kw["origin"] == 0 for kw in decode)
    assert all(_c_div(kw["pos"], kw["page_size"]) == kw["origin"] for kw in decode)
    assert design.PAGE1_SCENARIO.page_size == 1


# One guard one too strict (or always firing): each must trap on some row the gate launches.
STRICT = {
    "begin <= 0": lambda c: c["begin"] <= 0,
    "end >= len": lambda c: c["end"] >= c["len"],
    "origin <= 0": lambda c: c["origin"] <= 0,
    "pos / page_size <= origin": lambda c: c["q"] <= c["origin"],
    "page_size <= 1": lambda c: c["page_size"] <= 1,
    "page <= 0": lambda c: c["page"] <= 0,
    "page >= num_pages - 1": lambda c: c["page"] >= c["num_pages"] - 1,
}


@pytest.mark.parametrize("strict", sorted(STRICT))
def test_a_guard_one_too_strict_fires_on_some_row_of_the_boundary_metadata_gate(strict):
    fired = []
    for name, kw in _boundary_runs():
        g, page = _guards(**kw)
        assert g is None
        n = len(kw["indices"])
        begin, end = (int(kw["indptr"][kw["t"]]), int(kw["indptr"][kw["t"] + 1])) if "indptr" in kw else (0, n)
        ctx = dict(begin=begin, end=end, len=n, origin=kw["origin"], q=_c_div(kw["pos"], kw["page_size"]),
                   page_size=kw["page_size"], page=page, num_pages=kw["num_pages"])
        fired.append(STRICT[strict](ctx))
    assert any(fired), f"{strict}: no row of the boundary-metadata gate would trap"


class _Recorder:
    """Stands in for the compiled kernel: records each launch's arguments."""

    def __init__(self):
        self.calls = []

    def __call__(self, name):
        return lambda grid, block, args: self.calls.append((name, args))


@pytest.mark.parametrize("head_dim", [256, 512])
def test_the_trap_bodies_hand_the_kernel_the_designed_metadata(head_dim, monkeypatch):
    # The gate bodies on host data, the kernel call recorded: what reaches the kernel's
    # page_size / page_indptr / pool arguments is what the designs above assume.
    rec = _Recorder()
    monkeypatch.setattr(qk.launcher, "_kernel", rec)
    monkeypatch.setattr(qk, "_synchronize", lambda: None)
    data = qk.host_data(head_dim, 128)

    qk.launch_with_negative_page_size(data)
    name, args = rec.calls[-1]
    assert name == f"qk_rope_paged<{head_dim}, false>"
    pool, page_size, num_pages, indices = args[8], args[16], args[17], args[18]
    assert int(page_size) == qk.NEGATIVE_PAGE_SIZE and int(num_pages) == 1 and list(indices) == [0]
    kv_block = -qk.NEGATIVE_PAGE_SIZE * qk.NKV * head_dim
    assert pool.size == kv_block and pool.base is not None and pool.base.size == 2 * kv_block
    assert np.shares_memory(pool, pool.base[kv_block:])

    import cupy
    monkeypatch.setattr(cupy, "asarray", np.asarray)   # the decode launcher uploads positions
    qk.launch_with_negative_csr_begin(data)
    name, args = rec.calls[-1]
    assert name == f"qk_rope_paged<{head_dim}, true>"
    indices, indptr = args[18], args[23]
    assert int(indptr[0]) == -1 and indices.base is not None and int(indices.base[0]) == qk.SCENARIO.junk_page
    assert list(indices) == list(qk.SCENARIO.decode_csr()[1])

    qk.launch_with_negative_window_origin(data)
    assert int(rec.calls[-1][1][24][0]) == -1

    qk.launch_with_row_past_its_window(data)
    name, args = rec.calls[-1]
    indices, origins = args[18], args[24]
    assert int(origins[-1]) == int(qk.SCENARIO.decode_origins()[-1]) - 1
    assert indices.base is not None and int(indices.base[indices.size]) == qk.SCENARIO.junk_page


def test_the_end_before_begin_guard_is_dominated_by_the_row_guard():
    # Equivalent by argument: once the origin guards pass, row >= 0, so a window with end < begin
    # (negative length) or end == begin (empty) traps at `row >= end - begin` anyway. Dropping the
    # guard, or making it `end <= begin`, changes which guard fires, never whether one does.
    indices = np.arange(6)
    for begin in range(5):
        for end in range(5):
            indptr = np.asarray([begin, end])
            for pos in range(12):
                for origin in range(4):
                    kw = dict(pos=pos, page_size=4, origin=origin, num_pages=6, indices=indices, indptr=indptr, t=0)
                    g, _ = _guards(**kw)
                    if end <= begin:
                        assert g is not None, kw
                        assert _guards(**kw, dropped=("end < begin",))[0] is not None, kw
