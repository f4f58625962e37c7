"""Batch invariance and run-to-run determinism, asserted bit for bit.

    from harness.library.invariance import assert_batch_invariant, assert_deterministic

`assert_batch_invariant(label, run, rows, batch_sizes=..., positions=..., variants=...)`
computes each chosen row alone, then inside batches of each size, at each position, under each
launch variant, and requires every row's bits to be the row-alone bits of the first variant
everywhere. `run(ids, variant)` computes the rows `ids` (a list of row ids of the caller's
inputs) as one batch under `variant` and returns their outputs, row i of the result for
`ids[i]` (a host or device array, first axis the batch). The other places of a batch are
filled with the other chosen rows and then with `fillers` (row ids that are computed but
not checked), cycled.

`assert_deterministic(label, run, repeats=..., variants=...)` calls `run(repeat, variant)`
`repeats` times under each variant and requires the same bits each time. Repeats alternate
between the current stream and two other non-blocking streams (`streams=False` keeps the
current one); `run` gets the repeat index, to vary what it launches around the kernel. The
two streams are made once a process and device and kept: CuPy's memory pool keeps a freed
block for the stream it was allocated on, so a new stream each repeat made every buffer of
every repeat a new `cudaMalloc` (milliseconds for a split-K scratch) and grew
the pool by a repeat's buffers each time. What the repeat runs on is the same either way: a
non-blocking stream other than the current one, idle when the repeat starts (each repeat is
synchronised before the next).

Both raise `BitsMismatch` subclasses naming where the bits differ (the row, the batch size
and position, the variant, or the repeat) and then the first differing element as
`assert_bits_eq` does; both note what they tried in the gate's report (property `tried`).
"""

from __future__ import annotations

from harness.library import arms, coverage
from harness.library.bits import BitsMismatch, bits_mismatch_lines
from harness.library.dtypes import _host


class NotBatchInvariant(BitsMismatch):
    """A row's bits depend on the batch it is computed in (its size, its place, a variant)."""


class NotDeterministic(BitsMismatch):
    """A repeated launch gave other bits."""


def named_variants(variants) -> dict[str, object]:
    """{name: variant} from what the helpers take: None (one default variant), a dict, or a list
    (each named by its str)."""
    if variants is None:
        return {"default": None}
    named = {str(k): v for k, v in variants.items()} if isinstance(variants, dict) else {str(v): v for v in variants}
    if not named:
        raise ValueError("variants is empty: pass None for the launcher's default, or name at least one")
    return named


def _place(position, size: int) -> int | None:
    """The index `position` names in a batch of `size` (None: the batch is too small for it)."""
    if position == "middle":
        return size // 2
    p = int(position)
    return p % size if -size <= p < size else None


def batch_of(row: int, place: int, size: int, others: list[int]) -> list[int]:
    """A batch of `size` ids with `row` at `place`, the other places taken from `others` in
    turn (cycled)."""
    ids, k = [], 0
    for i in range(size):
        if i == place:
            ids.append(row)
        else:
            ids.append(others[k % len(others)])
            k += 1
    return ids


def assert_batch_invariant(label: str, run, rows, *, batch_sizes, positions=(0, "middle", -1), variants=None,
                           fillers=()) -> None:
    """Raise NotBatchInvariant unless every row of `rows` has its row-alone bits in every
    batch of `batch_sizes`, at every place of `positions`, under every one of `variants`
    ({name: variant} or a list; None: one default variant). Module docstring."""
    rows = [int(r) for r in rows]
    sizes = sorted({int(s) for s in batch_sizes})
    if not rows or not sizes:
        raise ValueError("assert_batch_invariant needs at least one row and one batch size")
    if min(sizes) < 1:
        raise ValueError(f"batch sizes must be at least 1, got {min(sizes)}")
    named = named_variants(variants)
    first = next(iter(named))
    fillers = [int(f) for f in fillers]

    def outputs(ids, name):
        out = _host(run(list(ids), named[name]))
        if len(out) != len(ids):
            raise ValueError(f"{label}: run({len(ids)} ids, {name}) returned {len(out)} rows; it must return one "
                             "output a row id, in order")
        return out

    alone = {r: outputs([r], first)[0] for r in rows}
    for r in rows:
        arms.note(f"{label} row {r} alone", alone[r])
    batches = compared = 0
    for name in named:
        for size in sizes:
            places = sorted({p for p in (_place(q, size) for q in positions) if p is not None})
            for row in rows:
                others = [r for r in rows if r != row] + fillers or [row]
                for place in places:
                    ids = batch_of(row, place, size, others)
                    out = outputs(ids, name)
                    batches += 1
                    for i, rid in enumerate(ids):
                        if rid not in alone:
                            continue
                        compared += 1
                        lines = bits_mismatch_lines(f"{label} row {rid}", out[i], alone[rid])
                        if lines:
                            where = (f"row {rid} at position {i} of a batch of {size} (variant {name}; the batch "
                                     f"is rows {_ids_text(ids)})")
                            raise NotBatchInvariant("\n".join(
                                [f"batch invariance of {label}: {where} differs from row {rid} alone (variant "
                                 f"{first})", *lines]))
    coverage.note_tried(f"batch invariance of {label}: rows {rows} alone, then in batches of {sizes} at positions "
                        f"{list(positions)}, variants {list(named)}: {batches} batches, {compared} rows compared")


def _ids_text(ids: list[int]) -> str:
    return ", ".join(map(str, ids[:12])) + (f", ... ({len(ids)} in all)" if len(ids) > 12 else "")


def assert_deterministic(label: str, run, *, repeats: int = 10, variants=None, streams: bool = True) -> None:
    """Raise NotDeterministic unless `run(repeat, variant)` gives the bits of its first repeat
    on every one of `repeats` repeats, under each variant. Module docstring."""
    if repeats < 2:
        raise ValueError(f"repeats={repeats}: determinism needs at least 2 repeats")
    named = named_variants(variants)
    kinds = set()
    for name, variant in named.items():
        first = None
        for i in range(repeats):
            got, kind = _on_stream(lambda: run(i, variant), i if streams else 0)
            kinds.add(kind)
            if first is None:
                first = got
                arms.note(f"{label} ({name})", first)
                continue
            lines = bits_mismatch_lines(f"{label} repeat {i}", got, first)
            if lines:
                raise NotDeterministic("\n".join(
                    [f"determinism of {label}: repeat {i} of {repeats} (variant {name}, {kind}) differs from "
                     "repeat 0", *lines]))
    coverage.note_tried(f"determinism of {label}: {repeats} repeats under variants {list(named)} on "
                        f"{', '.join(sorted(kinds))}")


_STREAMS: dict[int, tuple] = {}  # device id -> the two non-blocking streams repeats take turns on


def _other_stream(repeat: int):
    """One of two non-blocking streams of the current device, by the repeat's parity; made on
    first use and kept (module docstring)."""
    import cupy

    device = cupy.cuda.runtime.getDevice()
    if device not in _STREAMS:
        _STREAMS[device] = (cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True))
    return _STREAMS[device][repeat % 2]


def _on_stream(call, repeat: int):
    """(call()'s output on the host, which stream) with repeat 0 and every third repeat on the
    current stream and the others on one of two non-blocking streams, synchronised before
    reading."""
    if repeat % 3 == 0:
        return _host(call()), "the current stream"
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            raise RuntimeError("no device")
        stream = _other_stream(repeat)
    except Exception:  # noqa: BLE001 - no CuPy or no device: a host run (the harness's own tests)
        return _host(call()), "the current stream"
    with stream:
        out = call()
        stream.synchronize()
        host = _host(out)
    return host, "other non-blocking streams"
