"""Shared data, one helper per arm, and the gate bodies of the QK RMSNorm + RoPE chain.

    anchor (closed form) -> flat arm -> paged prefill -> paged decode

test_qk_rope.py names the claims, each once per head size; the bodies live here once so
the two head sizes cannot drift apart. Every kernel launch goes through one of
`flat_arm`, `prefill_arm`, `decode_arm`, and each spells its launcher call once.

The same helpers run on host (numpy) arrays for the refusal gates: the launcher must
refuse before it touches the device, so those gates need no GPU.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, replace

import numpy as np
import pytest

from harness.library import buffers
from harness.library.bits import assert_bits_eq
from harness.library.dtypes import bf16, bits_of, from_bits
from kernels_cu import qk_rope as launcher
from oracles import qk_rope as design
from oracles.paged_layout import PagedKvLayout

NQ = 4
NKV = 2
NUM_TOKENS = 10
COS_MAX_POS = 32
# Flat-arm anchor positions: out of order, both ends of the table, every residue mod 3.
ANCHOR_POSITIONS = (17, 3, 0, 29, 8, 12, 31, 5, 22, 14)
FILLER = buffers.BF16_SENTINEL  # a NaN payload: no kernel output on the designed inputs has these bits
ROW_OFFSET = 3
SCENARIO = design.PagedScenario(num_tokens=NUM_TOKENS)


# ------------------------------------------------------------------ data


@dataclass(frozen=True)
class QkData:
    """Designed inputs of one (head_dim, rotary_dim), on the device (cupy) or on the
    host (numpy, for refusal gates)."""

    head_dim: int
    rotary_dim: int
    on_device: bool
    q: object
    k: object
    v: object  # None for HD 512 (the K = V fork)
    q_w: object
    k_w: object
    cos: object
    sin: object
    host: dict  # the same arrays as numpy
    eps: float = design.EPS  # the eps every launch of this data passes

    @property
    def num_tokens(self) -> int:
        return int(self.q.shape[0])

    @property
    def nq(self) -> int:
        return int(self.q.shape[1])

    @property
    def nkv(self) -> int:
        return int(self.k.shape[1])

    def put(self, a: np.ndarray):
        """A host array on this data's side (device or host)."""
        return buffers.to_device(a) if self.on_device else np.ascontiguousarray(a)

    def filled(self, shape, bits: int):
        """An array of `shape` whose every bf16 element holds `bits`."""
        if not self.on_device:
            return np.full(shape, bits, dtype=np.uint16).view(bf16)
        from harness.library.buffers import filled

        return filled(shape, bf16, bits)


host = buffers.to_host  # device (or host) array -> numpy, bf16 through its bits


def _build(head_dim: int, rotary_dim: int, on_device: bool, *, num_tokens: int = NUM_TOKENS,
           heads=design.designed_heads, spare_tokens: int = 0, eps: float = design.EPS, nq: int = NQ,
           nkv: int = NKV, cos_max_pos: int = COS_MAX_POS) -> QkData:
    """The inputs of one (head_dim, rotary_dim), nq query and nkv KV heads, a cos/sin table of
    cos_max_pos positions. With spare_tokens, q, k and v are built for num_tokens + spare_tokens
    tokens and the data holds views of the first num_tokens: a warp past the last job reads
    defined (designed) rows there instead of faulting."""
    n = num_tokens + spare_tokens
    q = heads(design.TENSOR_Q, n, nq, head_dim)
    k = heads(design.TENSOR_K, n, nkv, head_dim)
    v = heads(design.TENSOR_V, n, nkv, head_dim) if head_dim == 256 else None
    q_w, k_w = design.norm_weights(head_dim)
    cos, sin = design.rope_tables(cos_max_pos, rotary_dim)
    arrays = dict(q=q, k=k, v=v, q_w=q_w, k_w=k_w, cos=cos, sin=sin)
    shell = QkData(head_dim, rotary_dim, on_device, *([None] * 7), host={}, eps=eps)
    heads_inputs = ("q", "k", "v")
    placed = {name: (None if a is None else shell.put(a)[:num_tokens] if name in heads_inputs else shell.put(a))
              for name, a in arrays.items()}
    host_arrays = {name: (a[:num_tokens] if name in heads_inputs and a is not None else a) for name, a in arrays.items()}
    return replace(shell, host=host_arrays, **placed)


@functools.cache
def device_data(head_dim: int, rotary_dim: int) -> QkData:
    """The designed inputs on the device, built once per process."""
    return _build(head_dim, rotary_dim, on_device=True)


def host_data(head_dim: int, rotary_dim: int) -> QkData:
    """The same inputs as numpy arrays: for refusal gates, which must need no GPU."""
    return _build(head_dim, rotary_dim, on_device=False)


# Data where eps matters, 11 tokens (66 jobs: the last block of 4
# warps has 2 idle), one spare designed token past them.
EPS_TOKENS = design.ORIGIN0_SCENARIO.num_tokens
EPS_ZERO_EVERY = 5  # the anchor's zero vectors: (3 t + h + tensor) % 5 == 0


def _tiny(zero_every: int):
    return lambda tensor, n, heads_n, hd: design.tiny_heads(tensor, n, heads_n, hd, zero_every=zero_every)


def eps_data(head_dim: int, rotary_dim: int, *, on_device: bool = True, zeros: bool = False) -> QkData:
    """Every head +-TINY (zeros=True: some heads the zero vector), eps EPS_TINY."""
    return _build(head_dim, rotary_dim, on_device, num_tokens=EPS_TOKENS, spare_tokens=1,
                  heads=_tiny(EPS_ZERO_EVERY if zeros else 0), eps=design.EPS_TINY)


@functools.cache
def eps_device_data(head_dim: int, rotary_dim: int, zeros: bool = False) -> QkData:
    return eps_data(head_dim, rotary_dim, zeros=zeros)


def layout_for(data: QkData, scenario: design.PagedScenario = SCENARIO) -> PagedKvLayout:
    return PagedKvLayout(page_size=scenario.page_size, num_layers=scenario.num_layers, nkv=data.nkv,
                         head_dim=data.head_dim, num_pages=scenario.num_pages)


# ------------------------------------------------------------------ one helper per arm


def flat_arm(data: QkData, positions, *, row_offset: int = 0, rotary_dim: int | None = None, spare_rows: int = 0):
    """(q_out, k_out, v_out) of the flat arm; outputs start as FILLER (spare_rows more rows
    than the launch covers, which must keep it)."""
    rows = row_offset + data.num_tokens + spare_rows
    q_out = data.filled((rows, data.nq, data.head_dim), FILLER)
    k_out = data.filled((rows, data.nkv, data.head_dim), FILLER)
    v_out = data.filled((rows, data.nkv, data.head_dim), FILLER)
    launcher.run_flat(data.q, data.k, data.v, data.q_w, data.k_w, data.cos, data.sin, positions,
                      q_out, k_out, v_out, rotary_dim=data.rotary_dim if rotary_dim is None else rotary_dim, eps=data.eps,
                      row_offset=row_offset)
    return q_out, k_out, v_out


def zero_pool(data: QkData, scenario: design.PagedScenario = SCENARIO, *, pages: int | None = None):
    layout = layout_for(data, scenario)
    return data.filled(((pages if pages is not None else layout.num_pages) * layout.page_stride,), 0)


def prefill_arm(data: QkData, scenario: design.PagedScenario = SCENARIO, *, window=None, pool=None,
                start_pos: int | None = None, page_origin: int | None = None, junk_lead: bool = False,
                spare_rows: int = 0):
    """(q_out, pool) of the paged prefill arm over a zeroed pool (or the one given). With
    junk_lead, page_indices is a view that starts just after an entry naming the scenario's
    junk page (valid, unreferenced), so a read one entry before the window lands visibly; q_out
    has spare_rows rows past the request, which must keep the filler."""
    q_out = data.filled((data.num_tokens + spare_rows, data.nq, data.head_dim), FILLER)
    pool = zero_pool(data, scenario) if pool is None else pool
    window = scenario.window if window is None else window
    if junk_lead:
        window = data.put(np.asarray((scenario.junk_page, *window), dtype=np.int32))[1:]
    else:
        window = data.put(np.asarray(window, dtype=np.int32))
    launcher.run_paged_prefill(
        data.q, data.k, data.v, data.q_w, data.k_w, data.cos, data.sin, q_out, pool,
        page_size=scenario.page_size, num_layers=scenario.num_layers, layer=scenario.layer,
        start_pos=scenario.start_pos if start_pos is None else start_pos,
        page_indices=window,
        page_origin=scenario.page_origin if page_origin is None else page_origin,
        rotary_dim=data.rotary_dim, eps=data.eps)
    return q_out, pool


def decode_arm(data: QkData, scenario: design.PagedScenario = SCENARIO, *, positions=None, indptr=None,
               indices=None, origins=None, pool=None):
    """(q_out, pool) of the paged decode arm; metadata defaults to the scenario's
    compressed per-token windows. `indices`, when given, is already on the data's side
    (a device view, for a trap gate)."""
    csr_indptr, csr_indices = scenario.decode_csr()
    indptr = csr_indptr if indptr is None else indptr
    indices = data.put(csr_indices) if indices is None else indices
    origins = scenario.decode_origins() if origins is None else origins
    q_out = data.filled((data.num_tokens, data.nq, data.head_dim), FILLER)
    pool = zero_pool(data, scenario) if pool is None else pool
    launcher.run_paged_decode(
        data.q, data.k, data.v, data.q_w, data.k_w, data.cos, data.sin, q_out, pool,
        page_size=scenario.page_size, num_layers=scenario.num_layers, layer=scenario.layer,
        positions=scenario.positions if positions is None else positions,
        page_indptr=data.put(np.asarray(indptr, dtype=np.int32)),
        page_indices=indices,
        page_origins=data.put(np.asarray(origins, dtype=np.int32)),
        rotary_dim=data.rotary_dim, eps=data.eps)
    return q_out, pool


def _synchronize() -> None:
    import cupy

    cupy.cuda.runtime.deviceSynchronize()


# ------------------------------------------------------------------ anchors


def flat_matches_closed_form(data: QkData) -> None:
    h = data.host
    q_out, k_out, v_out = flat_arm(data, ANCHOR_POSITIONS)
    pos = np.asarray(ANCHOR_POSITIONS)
    expected_q = design.closed_form(h["q"], h["q_w"], pos, h["cos"], h["sin"], data.rotary_dim)
    expected_k = design.closed_form(h["k"], h["k_w"], pos, h["cos"], h["sin"], data.rotary_dim)
    expected_v = design.closed_form_weightless(h["v"] if h["v"] is not None else h["k"])
    # Exact, not a tolerance: closed_form refuses inputs whose values are not within
    # 2^-14 of their bf16 rounding, so any f32 evaluation order rounds to these bits.
    assert_bits_eq("q_out (flat vs closed form)", host(q_out), expected_q)
    assert_bits_eq("k_out (flat vs closed form)", host(k_out), expected_k)
    assert_bits_eq("v_out (flat vs closed form, weightless)", host(v_out), expected_v)


# Flat positions of the eps anchor: ANCHOR_POSITIONS and one more, every residue mod 3.
EPS_ANCHOR_POSITIONS = ANCHOR_POSITIONS + (26,)


def _magnitude_where_zero(a: np.ndarray, zero: np.ndarray) -> np.ndarray:
    """bf16 bits with the sign bit cleared where `zero` (the contract fixes a zero's
    magnitude, not its sign, which follows the evaluation order)."""
    b = bits_of(a).copy()
    b[zero] &= 0x7FFF
    return from_bits(b, bf16)


def flat_matches_closed_form_where_eps_matters(data: QkData) -> None:
    """Where eps matters: tiny heads (eps sets half the norm) and zero vectors through
    every norm (Q, K, V or the K = V fork), 11 tokens (66 jobs, 2 idle warps), a spare output row."""
    h = data.host
    assert data.eps == design.EPS_TINY and data.num_tokens == EPS_TOKENS
    pos = np.asarray(EPS_ANCHOR_POSITIONS)
    expected = {
        "q_out": design.closed_form(h["q"], h["q_w"], pos, h["cos"], h["sin"], data.rotary_dim, eps=data.eps),
        "k_out": design.closed_form(h["k"], h["k_w"], pos, h["cos"], h["sin"], data.rotary_dim, eps=data.eps),
        "v_out": design.closed_form_weightless(h["v"] if h["v"] is not None else h["k"], eps=data.eps),
    }
    raw = {"q_out": h["q"], "k_out": h["k"], "v_out": h["v"] if h["v"] is not None else h["k"]}
    outs = dict(zip(("q_out", "k_out", "v_out"), (host(a) for a in flat_arm(data, pos, spare_rows=1))))
    t = data.num_tokens
    for name, exp in expected.items():
        zero_heads = ~np.any(raw[name].astype(np.float64) != 0, axis=-1)
        assert zero_heads.any() and not zero_heads.all(), f"{name}: the design needs zero and tiny heads"
        zero = np.broadcast_to(zero_heads[..., None], exp.shape)
        assert_bits_eq(f"{name} (flat vs closed form, eps {data.eps:g}: tiny heads exact, zero heads zero)",
                       _magnitude_where_zero(outs[name][:t], zero), _magnitude_where_zero(exp, zero))
        filler = np.full(outs[name][t:].shape, FILLER, dtype=np.uint16).view(bf16)
        assert_bits_eq(f"{name} row {t}, past the last token (must keep its filler)", outs[name][t:], filler)


# ------------------------------------------------------------------ memory safety

PAGE_FENCE = 0xFFFFFFFF  # page id -1: a window entry read from before or past the window trips the page-id guard
GUARD = buffers.GUARD  # filler elements before and after each output buffer: two 512-element head rows


def fenced_inputs(data: QkData) -> QkData:
    """The same designed inputs, each a view between NaN fences a whole buffer long
    (`harness.library.buffers.fenced`): a read up to a buffer before or past an input (a head row, a
    weight, a cos/sin row walked an element too far) puts a NaN into an output, and the gate
    fails by assertion; a read further away faults, which is this gate's verdict too."""
    return replace(data, **{name: None if a is None else buffers.fenced(a) for name, a in data.host.items()})


def guarded(shape, inside_bits: int):
    """A bf16 output of `shape` holding `inside_bits` between FILLER guards
    (`harness.library.buffers.guarded`): (the view, the whole allocation)."""
    return buffers.guarded(shape, bf16, FILLER, inside_bits=inside_bits)


def assert_guards_untouched(label: str, whole) -> None:
    buffers.assert_guards_untouched(label, whole, FILLER)


def flat_reads_and_writes_nothing_outside_its_buffers(data: QkData) -> None:
    """The flat anchor with every input between NaN fences and every output between FILLER
    guards: the closed form's bits inside, the guards untouched."""
    f = fenced_inputs(data)
    t = data.num_tokens
    outs = {name: guarded((t, heads, data.head_dim), FILLER)
            for name, heads in (("q_out", data.nq), ("k_out", data.nkv), ("v_out", data.nkv))}
    launcher.run_flat(f.q, f.k, f.v, f.q_w, f.k_w, f.cos, f.sin, ANCHOR_POSITIONS,
                      *(view for view, _ in outs.values()), rotary_dim=data.rotary_dim, eps=data.eps)
    h = data.host
    pos = np.asarray(ANCHOR_POSITIONS)
    expected = {
        "q_out": design.closed_form(h["q"], h["q_w"], pos, h["cos"], h["sin"], data.rotary_dim),
        "k_out": design.closed_form(h["k"], h["k_w"], pos, h["cos"], h["sin"], data.rotary_dim),
        "v_out": design.closed_form_weightless(h["v"] if h["v"] is not None else h["k"]),
    }
    for name, (view, whole) in outs.items():
        assert_bits_eq(f"{name} (flat, inputs between NaN fences, vs closed form)", host(view), expected[name])
        assert_guards_untouched(f"{name} (flat)", whole)


def prefill_reads_and_writes_nothing_outside_its_buffers(data: QkData, scenario=SCENARIO) -> None:
    """The prefill link with every input and the window between fences (NaN; page id -1,
    which the page-id guard refuses) and q_out and the pool between FILLER guards: the flat
    arm's values at the layout's addresses, zero elsewhere in the pool, the guards untouched."""
    layout = layout_for(data, scenario)
    flat_q, flat_k, flat_v = (host(a) for a in flat_arm(data, scenario.positions))
    pages = [layout.page_of(int(p), scenario.window, scenario.page_origin) for p in scenario.positions]
    image = layout.image(scenario.layer, pages, scenario.positions, flat_k, flat_v)
    f = fenced_inputs(data)
    q_out, q_whole = guarded((data.num_tokens, data.nq, data.head_dim), FILLER)
    pool, pool_whole = guarded((layout.num_pages * layout.page_stride,), 0)
    window = buffers.fenced(np.asarray(scenario.window, dtype=np.int32), PAGE_FENCE)
    launcher.run_paged_prefill(
        f.q, f.k, f.v, f.q_w, f.k_w, f.cos, f.sin, q_out, pool,
        page_size=scenario.page_size, num_layers=scenario.num_layers, layer=scenario.layer,
        start_pos=scenario.start_pos, page_indices=window, page_origin=scenario.page_origin,
        rotary_dim=data.rotary_dim, eps=data.eps)
    assert_bits_eq("q_out (paged prefill, inputs between fences, vs flat)", host(q_out), flat_q)
    assert_guards_untouched("q_out (paged prefill)", q_whole)
    assert_bits_eq("pool (paged prefill, inputs between fences: flat values at layout addresses, zero elsewhere)",
                   host(pool), image)
    assert_guards_untouched("pool (paged prefill)", pool_whole)


# ------------------------------------------------------------------ links


def _assert_no_filler_and_no_zero(label: str, a: np.ndarray) -> None:
    """Non-vacuity: every element was written and none is zero (a zero looks untouched)."""
    b = bits_of(a)
    unwritten = int(np.count_nonzero(b == FILLER))
    zeros = int(np.count_nonzero((b & 0x7FFF) == 0))
    assert unwritten == 0 and zeros == 0, (
        f"{label}: {unwritten} elements still hold the filler and {zeros} are zero; the link "
        "would compare nothing there"
    )


def prefill_lands_flat_values_at_layout_addresses(data: QkData, scenario=SCENARIO, *, junk_lead: bool = False,
                                                  spare_rows: int = 0) -> None:
    layout = layout_for(data, scenario)
    positions = scenario.positions
    flat_q, flat_k, flat_v = (host(a) for a in flat_arm(data, positions))
    for label, a in (("flat q_out", flat_q), ("flat k_out", flat_k), ("flat v_out", flat_v)):
        _assert_no_filler_and_no_zero(label, a)
    pages = [layout.page_of(int(p), scenario.window, scenario.page_origin) for p in positions]
    image = layout.image(scenario.layer, pages, positions, flat_k, flat_v)
    q_out, pool = prefill_arm(data, scenario, junk_lead=junk_lead, spare_rows=spare_rows)
    q_out = host(q_out)
    t = data.num_tokens
    if spare_rows:
        filler = np.full(q_out[t:].shape, FILLER, dtype=np.uint16).view(bf16)
        assert_bits_eq(f"q_out rows {t}.., past the last job (must keep their filler)", q_out[t:], filler)
    assert_bits_eq("q_out (paged prefill vs flat)", q_out[:t], flat_q)
    assert_bits_eq("pool (paged prefill vs flat values at layout addresses, zero elsewhere)",
                   host(pool), image)


def decode_equals_prefill_over_the_same_positions(data: QkData, scenario=SCENARIO, *, junk_lead: bool = False) -> None:
    indptr, indices = scenario.decode_csr()
    origins = scenario.decode_origins()
    spans = list(zip(indptr[:-1].tolist(), indptr[1:].tolist()))
    windows = {tuple(indices[b:e].tolist()) for b, e in spans}
    # Non-degeneracy: one origin for all, or one window for all, would agree with the
    # prefill arm whether or not the per-token metadata is read at all.
    assert len(set(origins.tolist())) > 1 and np.any(origins != 0), f"origins {origins} are degenerate"
    assert len(set(spans)) == len(spans) and len(windows) > 1, f"windows {spans} are not over different spans"
    assert indptr[0] > 0 and indices[0] not in scenario.window, "the CSR must start after a junk entry"
    prefill_q, prefill_pool = (host(a) for a in prefill_arm(data, scenario, junk_lead=junk_lead))
    assert np.count_nonzero(bits_of(prefill_pool)) > 0, "the prefill arm wrote nothing into the pool"
    decode_q, decode_pool = (host(a) for a in decode_arm(data, scenario))
    assert_bits_eq("q_out (paged decode vs paged prefill)", decode_q, prefill_q)
    assert_bits_eq("pool (paged decode vs paged prefill)", decode_pool, prefill_pool)


def origin_zero_prefill_lands_flat_values_at_layout_addresses(data: QkData) -> None:
    """The prefill window's origin is logical page 0, behind a junk
    entry; 66 jobs (2 idle warps) and a spare q_out row; tiny heads, so eps sets the values."""
    scenario = design.ORIGIN0_SCENARIO
    assert scenario.page_origin == 0 and data.num_tokens == scenario.num_tokens
    assert data.num_tokens * (data.nq + data.nkv) % launcher.WARPS_PER_BLOCK, "the job count must leave idle warps"
    prefill_lands_flat_values_at_layout_addresses(data, scenario, junk_lead=True, spare_rows=1)


def origin_zero_decode_equals_prefill(data: QkData) -> None:
    """Decode tokens whose window origin is page 0 (and others at 1 and 2)."""
    scenario = design.ORIGIN0_SCENARIO
    origins = scenario.decode_origins()
    assert np.any(origins == 0) and np.any(origins != 0), f"origins {origins}: need page 0 and others"
    decode_equals_prefill_over_the_same_positions(data, scenario, junk_lead=True)


def row_offset_serves_only_the_suffix(data: QkData, offset: int = ROW_OFFSET) -> None:
    positions = SCENARIO.positions
    base = [host(a) for a in flat_arm(data, positions)]
    shifted = [host(a) for a in flat_arm(data, positions, row_offset=offset)]
    for name, b, s in zip(("q_out", "k_out", "v_out"), base, shifted):
        _assert_no_filler_and_no_zero(f"{name} at row_offset 0", b)
        filler = np.full(s[:offset].shape, FILLER, dtype=np.uint16).view(bf16)
        assert_bits_eq(f"{name} rows before row_offset {offset} (must keep their filler)", s[:offset], filler)
        assert_bits_eq(f"{name} rows from row_offset {offset} (vs a zero-offset run)", s[offset:], b)


# ------------------------------------------------------------------ trap bodies


def launch_with_out_of_range_page_id(data: QkData, scenario=SCENARIO) -> None:
    """A referenced window row names page num_pages. The pool passed is a view of one
    page more, so without the guard the write lands in memory and nothing faults."""
    window = list(scenario.window)
    window[1] = scenario.num_pages
    layout = layout_for(data, scenario)
    backing = zero_pool(data, scenario, pages=scenario.num_pages + 1)
    prefill_arm(data, scenario, window=window, pool=backing[: layout.pool_elements])
    _synchronize()


def launch_with_csr_end_past_the_indices(data: QkData, scenario=SCENARIO) -> None:
    """The last CSR end is one past page_indices; the array passed is a view of one
    valid entry more, so without the guard nothing faults."""
    indptr, indices = scenario.decode_csr()
    indptr[-1] += 1
    backing = data.put(np.append(indices, scenario.window[-1]).astype(np.int32))
    decode_arm(data, scenario, indptr=indptr, indices=backing[: indices.size])
    _synchronize()


def launch_with_row_before_origin(data: QkData, scenario=SCENARIO) -> None:
    """The last token's origin is one past its own logical page. Without the guard its
    row is -1, which reads the previous (valid) CSR entry, and nothing faults."""
    origins = scenario.decode_origins()
    origins[-1] += 1
    decode_arm(data, scenario, origins=origins)
    _synchronize()


def launch_with_row_past_its_window(data: QkData, scenario=SCENARIO) -> None:
    """The last token's origin is one page before its own, so its row is 1 in a window of one
    entry. page_indices is a view of an array with one valid entry more, so without the guard
    the row reads that entry and nothing faults."""
    indptr, indices = scenario.decode_csr()
    origins = scenario.decode_origins()
    origins[-1] -= 1
    assert indptr[-1] - indptr[-2] == 1, "the last token's window must be one entry"
    backing = data.put(np.append(indices, scenario.junk_page).astype(np.int32))
    decode_arm(data, scenario, origins=origins, indices=backing[: indices.size])
    _synchronize()


def launch_with_negative_window_origin(data: QkData, scenario=SCENARIO) -> None:
    """Token 0's window origin is -1 (decode origins stay on the device; the prefill launcher
    refuses a negative page_origin). Without the guard its row is pos / page_size + 1 = 2, inside
    its three-entry window, so it reads a valid entry and nothing faults."""
    origins = scenario.decode_origins()
    origins[0] = -1
    decode_arm(data, scenario, origins=origins)
    _synchronize()


def launch_with_negative_csr_begin(data: QkData, scenario=SCENARIO) -> None:
    """Token 0's CSR begin is -1 (the launcher never reads page_indptr: it stays on the
    device). page_indices is a view one entry into an array whose first entry is the junk
    page (valid), so without the guard token 0's row 0 reads that entry and nothing faults."""
    indptr, indices = scenario.decode_csr()
    indptr[0] = -1
    backing = data.put(np.insert(indices, 0, scenario.junk_page).astype(np.int32))
    decode_arm(data, scenario, indptr=indptr, indices=backing[1:])
    _synchronize()


# A page size the launcher refuses, so the trap gate below launches past its checks. Zero
# would not do: on sm_90 `pos / 0` is -1 (the division's fix-up for a zero divisor), which
# the row-before-origin guard traps for every origin >= 0 whether or not the page-size guard
# is there. A negative size is stopped by the page-size guard alone.
NEGATIVE_PAGE_SIZE = -16


def launch_with_negative_page_size(data: QkData) -> None:
    """Paged prefill with page_size -16 through the launcher's one spelled kernel call
    (`_launch_paged`), skipping `check_pool`, which refuses it. The request is positions
    0..T-1 (T < 16), origin 0, a one-entry window naming page 0 of a one-page, one-layer
    pool: pos / -16 = 0 is row 0 of the window, so no other guard fires. pool_index then puts
    K at (pos * nkv + kv_head) * HD, inside the first kv block, and V one kv block earlier,
    before the pool; the pool passed is a view one kv block into a zeroed allocation of two,
    so without the guard every store lands in memory and nothing faults."""
    assert data.num_tokens < -NEGATIVE_PAGE_SIZE, "every position must give pos / page_size = 0"
    heads = launcher.check_heads(data.q, data.k, data.v, data.q_w, data.k_w, data.cos, data.sin,
                                 rotary_dim=data.rotary_dim)
    kv_block = -NEGATIVE_PAGE_SIZE * data.nkv * data.head_dim
    backing = data.filled((2 * kv_block,), 0)
    q_out = data.filled((data.num_tokens, data.nq, data.head_dim), FILLER)
    launcher._launch_paged(heads, False, data.q, data.k, data.v, data.q_w, data.k_w, data.cos, data.sin,
                           q_out, backing[kv_block:], NEGATIVE_PAGE_SIZE, 1, 0, 1,
                           data.put(np.zeros(1, dtype=np.int32)), 0, 0,
                           launcher._NULL, launcher._NULL, launcher._NULL, data.eps)
    _synchronize()


# ------------------------------------------------------------------ the guards admit valid input


# ORIGIN0_SCENARIO's window (4, 1, 3, 0) moved to (5, 3, 0, 1): the page-id guard's two
# boundaries, page 0 and the last page 5, both named by real rows (logical pages 2 and 0).
BOUNDARY_WINDOW = (5, 3, 0, 1)


def guards_admit_valid_boundary_metadata(data: QkData) -> None:
    """Every device guard traps outside the valid metadata and nowhere inside it: valid input
    at each guard's boundary must run. On the origin-0 request (tiny-head data, 11 tokens):

    - prefill over BOUNDARY_WINDOW (pages 0 and num_pages - 1) vs over the scenario's window:
      the same q_out, and the same pages, moved;
    - decode over a CSR without the junk entry (token 0's begin is 0, the last end is the
      array's length), every token on its window's origin page (pos / page_size == origin),
      tokens 0-2 at origin 0: equal to the prefill, bit for bit;
    - the prefill link at page size 1 (PAGE1_SCENARIO).

    A guard one too strict (or always firing) traps here: this gate catches the fault and fails
    by its own assertion, instead of a link dying by a trap no gate would have named."""
    from harness.core.device import is_cuda_error

    s = design.ORIGIN0_SCENARIO
    assert data.num_tokens == s.num_tokens
    indptr, indices = s.decode_csr(junk_lead=False)
    origins = s.decode_origins()
    assert indptr[0] == 0 and indptr[-1] == indices.size and np.any(origins == 0)
    assert np.array_equal(s.positions // s.page_size, origins), "every token sits on its origin page (row 0)"
    try:
        q_ref, pool_ref = (host(a) for a in prefill_arm(data, s))
        q_moved, pool_moved = (host(a) for a in prefill_arm(data, s, window=BOUNDARY_WINDOW))
        q_dec, pool_dec = (host(a) for a in decode_arm(data, s, indptr=indptr, indices=data.put(indices)))
        prefill_lands_flat_values_at_layout_addresses(data, design.PAGE1_SCENARIO)
        _synchronize()
    except Exception as exc:  # noqa: BLE001 - only a device error is this gate's verdict
        if not is_cuda_error(exc):
            raise
        pytest.fail(f"a device guard fired on valid input at its boundary (pages 0 and {s.num_pages - 1}, "
                    f"CSR begin 0 and end {indices.size}, origin 0, rows on their origin page, page size 1): "
                    f"{type(exc).__name__}: {exc}")
    stride = layout_for(data, s).page_stride
    ref = bits_of(pool_ref).reshape(s.num_pages, stride)
    for page in (4, 1, 3):
        assert np.count_nonzero(ref[page]), f"the reference prefill wrote nothing into page {page}"
    expected = np.zeros_like(ref)
    for old, new in zip(s.window, BOUNDARY_WINDOW):
        expected[new] = ref[old]
    assert_bits_eq(f"q_out (prefill over window {BOUNDARY_WINDOW} vs {s.window})", q_moved, q_ref)
    assert_bits_eq(f"pool after prefill over window {BOUNDARY_WINDOW} (the pages of window {s.window}, moved; "
                   "zero elsewhere)", pool_moved, from_bits(expected.reshape(-1), bf16))
    assert_bits_eq("q_out (decode from CSR begin 0 vs prefill)", q_dec, q_ref)
    assert_bits_eq("pool (decode from CSR begin 0, rows on their origin pages, vs prefill)", pool_dec, pool_ref)


# ------------------------------------------------------------------ the sweep: the chain at any shape


@dataclass(frozen=True)
class SweepShape:
    """One shape of the sweep (gates/test_qk_rope_sweep.py) as the chain runs it: head size,
    rotary dim, head counts, and the request of T tokens that ends at position cos_max_pos - 1
    (the last row of its cos/sin table), laid out by `scenario`."""

    head_dim: int
    rotary_dim: int
    nq: int
    nkv: int
    cos_max_pos: int
    scenario: design.PagedScenario

    @property
    def num_tokens(self) -> int:
        return self.scenario.num_tokens


def sweep_window(t: int, page_size: int, ctx: int) -> tuple[int, int]:
    """(page_origin, window pages) of a request of t tokens ending at position ctx - 1: the
    window starts a page before the first token's page where there is one (a window entry no
    token writes), so the origin is not 0 once the request starts past page 1."""
    origin = max(0, (ctx - t) // page_size - 1)
    return origin, (ctx - 1) // page_size - origin + 1


def sweep_pool_elements(hd: int, nkv: int, t: int, page_size: int, ctx: int, num_layers: int) -> int:
    """The pool of a sweep shape: its window, a junk page and an unreferenced last page."""
    _, pages = sweep_window(t, page_size, ctx)
    return (pages + 2) * num_layers * 2 * page_size * nkv * hd


def sweep_shape(shape) -> SweepShape:
    """A sweep shape (HD, R, NKV, G, T, P, CTX, L): nq = NKV * G query heads, T tokens at
    positions CTX - T .. CTX - 1, pages of P positions, L layers (the request writes the last,
    layer L - 1: the far end of every page). The window's pages are shuffled over the pool;
    the junk page (the decode CSR's lead entry) and the last page are pages no token names."""
    hd, t, p, ctx, layers = shape["HD"], shape["T"], shape["P"], shape["CTX"], shape["L"]
    origin, pages = sweep_window(t, p, ctx)
    num_pages = pages + 2
    rng = np.random.default_rng([shape[k] for k in sorted(shape)])
    perm = [int(x) for x in rng.permutation(num_pages - 1)]
    scenario = design.PagedScenario(page_size=p, num_layers=layers, layer=layers - 1, num_pages=num_pages,
                                    start_pos=ctx - t, num_tokens=t, page_origin=origin, window=tuple(perm[1:]),
                                    junk_page=perm[0])
    return SweepShape(hd, shape["R"], shape["NKV"] * shape["G"], shape["NKV"], ctx, scenario)


def sweep_data(s: SweepShape, on_device: bool = True) -> QkData:
    """The designed inputs of a sweep shape (the anchors' design: exact at any shape)."""
    return _build(s.head_dim, s.rotary_dim, on_device, num_tokens=s.num_tokens, nq=s.nq, nkv=s.nkv,
                  cos_max_pos=s.cos_max_pos)


def chain_holds_at(data: QkData, scenario: design.PagedScenario) -> None:
    """The whole chain at one shape, each link bitwise: the flat arm equals the closed form at
    the request's positions (the anchor: exact on the designed inputs at any head count and
    rotary dim); the paged prefill puts the flat arm's Q bits in q_out and its K and V bits at
    the layout's addresses, zero elsewhere; the paged decode over the same positions (per-token
    windows from each token's own page, behind a junk CSR entry) equals the prefill."""
    h, positions = data.host, scenario.positions
    flat = [host(a) for a in flat_arm(data, positions)]
    expected = (design.closed_form(h["q"], h["q_w"], positions, h["cos"], h["sin"], data.rotary_dim),
                design.closed_form(h["k"], h["k_w"], positions, h["cos"], h["sin"], data.rotary_dim),
                design.closed_form_weightless(h["v"] if h["v"] is not None else h["k"]))
    for name, got, exp in zip(("q_out", "k_out", "v_out"), flat, expected):
        assert_bits_eq(f"{name} (flat vs closed form)", got, exp)
    layout = layout_for(data, scenario)
    pages = [layout.page_of(int(p), scenario.window, scenario.page_origin) for p in positions]
    image = layout.image(scenario.layer, pages, positions, flat[1], flat[2])
    prefill_q, prefill_pool = (host(a) for a in prefill_arm(data, scenario))
    assert_bits_eq("q_out (paged prefill vs flat)", prefill_q, flat[0])
    assert_bits_eq("pool (paged prefill vs flat values at layout addresses, zero elsewhere)", prefill_pool, image)
    decode_q, decode_pool = (host(a) for a in decode_arm(data, scenario))
    assert_bits_eq("q_out (paged decode vs paged prefill)", decode_q, prefill_q)
    assert_bits_eq("pool (paged decode vs paged prefill)", decode_pool, prefill_pool)


# ------------------------------------------------------------------ refusals


@dataclass(frozen=True)
class Refusal:
    """Bad host arguments, the arm they go to, and the pinned message substring."""

    id: str
    substring: str
    call: object  # (head_dim) -> None, must raise ValueError

    def check(self, head_dim: int) -> None:
        with pytest.raises(ValueError, match=re.escape(self.substring)):
            self.call(head_dim)


def _short_pool(data: QkData):
    layout = layout_for(data)
    return data.filled((layout.page_stride - 1,), 0)


REFUSALS = (
    Refusal("head_dim_128", "head_dim", lambda hd: flat_arm(host_data(128, 128), SCENARIO.positions)),
    Refusal("rotary_dim_odd", "rotary_dim",
            lambda hd: flat_arm(host_data(hd, 128), SCENARIO.positions, rotary_dim=127)),
    Refusal("rotary_dim_past_head_dim", "rotary_dim",
            lambda hd: flat_arm(host_data(hd, 128), SCENARIO.positions, rotary_dim=hd + 2)),
    Refusal("rotary_dim_zero", "rotary_dim",
            lambda hd: flat_arm(host_data(hd, 128), SCENARIO.positions, rotary_dim=0)),
    Refusal("flat_position_at_cos_table_end", "cos table",
            lambda hd: flat_arm(host_data(hd, 128), [COS_MAX_POS] * NUM_TOKENS)),
    Refusal("prefill_position_past_cos_table", "cos table",
            lambda hd: prefill_arm(host_data(hd, 128), start_pos=COS_MAX_POS - NUM_TOKENS + 1)),
    Refusal("decode_position_past_cos_table", "cos table",
            lambda hd: decode_arm(host_data(hd, 128), positions=SCENARIO.positions + COS_MAX_POS)),
    Refusal("prefill_pool_shorter_than_one_page", "no whole page",
            lambda hd: prefill_arm(d := host_data(hd, 128), pool=_short_pool(d))),
    Refusal("decode_pool_shorter_than_one_page", "no whole page",
            lambda hd: decode_arm(d := host_data(hd, 128), pool=_short_pool(d))),
    Refusal("page_origin_after_start_pos", "page_origin",
            lambda hd: prefill_arm(host_data(hd, 128), page_origin=2)),
)

