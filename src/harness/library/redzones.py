"""Redzones: guard regions on both sides of every device buffer the harness hands a gate, filled
with a poison pattern and checked on the GPU after each launch.

    [ before: G bytes ][ the buffer: nbytes ][ after: G bytes, and up to 255 more ]

**Layout** (`Layout.of`). Each buffer (`harness.library.buffers`: `to_device`, `filled`,
`nan_filled`, `fenced`, `guarded`; a CUDA graph's own copies, `harness.library.graphs`) is a view
into an allocation of its own. G (`guard_bytes`) is at least REDZONE_BYTES, at least one row of
the buffer (its last axis, up to ROW_CAP) and a multiple of 256: the view starts 256-byte aligned
(as the allocation does: vector loads need it), and the allocation ends on a multiple of 256. An
index one past, a stride one off or a tile past the end lands in a guard, not in another buffer.

**Pattern** (`pattern_bits`). Both guards hold one element's bits over and over: a signalling NaN
in float types (bf16 0x7f8d, f16 0x7d8d, f32 0x7f8d8d8d, f64 0x7ff48d8d8d8d8d8d; 2-, 4- and 8-byte
integers take the same bits), 0x7f in 1-byte types (a NaN in fp8 e4m3 and e5m2). A read past the
end sees poison, so it shows in the outputs; a write past the end changes the guard.

**The check.** After each launch through `harness.library.kernels` (and each CUDA-graph replay),
one small kernel (`redzone_check.cu`, compiled by the harness's own compile path) is queued on the
launch's stream: it compares every guard of this device with its pattern and keeps, per guard,
the changed byte nearest the buffer, with the number of the check that first saw it. Nothing
waits for it. The results (8 bytes a guard) are read at a read point: `check_redzones()`,
`buffers.to_host`, the end of every gate (the plugin), and an allocation that finds the slots
all taken. A written guard is a `RedzoneWritten` naming the buffer, the side, the offset from its
end (or start), the first changed guard bytes and the kernel launched last before the check that
saw it; the guard is then filled again.

**Lifetime.** The registry refers to each allocation weakly: it goes back to CuPy's pool when its
last view dies, as it would with no redzones. As it dies, every check still in flight is waited
for, then its two results are read (and its guards, where one was written, for the read point
to report): no check reads memory the pool gave to another buffer, and no write is lost.

**On and off.** A run asks for them with `--redzones` (`Settings.redzones`; opt-in until a GPU run
proves them, issue 52); `--no-redzones` wins over it; `@pytest.mark.no_redzones(reason=...)`
for a gate whose kernel writes past a view on purpose (it runs with none, and every guard is filled
again after it); `redzone=False` for one buffer. Trap gates run with none: their fault is the
verdict, and nothing can be read after it. A stand-in CuPy whose arrays are host arrays (the
harness's own host tests) gets none: a host array is never launched.
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from harness.core import settings as _settings
from harness.library.bits import BitsMismatch
from harness.library.dtypes import _UINT_OF_SIZE
from harness.library.redzone_device import (CHECK_KERNEL, CHECK_SOURCE, GUARD_RECORD, MAX_BLOCKS_X,  # noqa: F401
                                            NONE, THREADS, CupyDevice, compile_check)

REDZONE_BYTES = 4096  # the least guard on each side of a buffer
ROW_CAP = 1 << 20  # a guard grows to one row of its buffer, up to this
ALIGN = 256  # the view's alignment, and the allocation's length a multiple of it
MAX_CHECKS = 1 << 16  # checks between two read points, at most
FIRST_CAPACITY = 256  # buffers the first result array has slots for
WINDOW = 16  # guard bytes a failure shows

SIDES = ("before", "after")
PATTERNS = {1: 0x7F, 2: 0x7F8D, 4: 0x7F8D8D8D, 8: 0x7FF48D8D8D8D8D8D}
F16_PATTERN = 0x7D8D


def pattern_bits(dtype) -> int:
    """One element of the guards' poison: a signalling NaN of the dtype's size (f16 its own),
    0x7f for a 1-byte dtype (module docstring)."""
    dtype = np.dtype(dtype)
    if dtype == np.float16:
        return F16_PATTERN
    if dtype.itemsize not in PATTERNS:
        raise TypeError(f"no redzone pattern for {dtype} ({dtype.itemsize}-byte items): pass redzone=False")
    return PATTERNS[dtype.itemsize]


def _round_up(n: int, to: int) -> int:
    return -(-int(n) // to) * to


def guard_bytes(shape, dtype, minimum: int = REDZONE_BYTES) -> int:
    """The guard on each side of a buffer of `shape` and `dtype`: at least `minimum` bytes and
    one row (the last axis; up to ROW_CAP), rounded up to a multiple of 256."""
    shape = tuple(int(n) for n in shape) if isinstance(shape, (tuple, list)) else (int(shape),)
    row = shape[-1] * np.dtype(dtype).itemsize if len(shape) >= 2 else 0
    return _round_up(max(int(minimum), min(row, ROW_CAP), 1), ALIGN)


@dataclass(frozen=True)
class Layout:
    """Where a buffer lies in its allocation, in bytes: `before` guard bytes (the view's offset),
    the view's `nbytes`, `after` guard bytes."""

    before: int
    nbytes: int
    after: int

    @classmethod
    def of(cls, nbytes: int, guard: int) -> "Layout":
        if guard <= 0 or guard % ALIGN:
            raise ValueError(f"a redzone guard of {guard} bytes: give a positive multiple of {ALIGN} (guard_bytes)")
        total = _round_up(2 * guard + nbytes, ALIGN)
        return cls(guard, int(nbytes), total - guard - int(nbytes))

    @property
    def total(self) -> int:
        return self.before + self.nbytes + self.after


@dataclass(eq=False)
class Allocation:
    """One guarded buffer: a weak reference to its whole allocation (each view of it refers to
    it), the device's hold on its memory while it is registered, where it lies, its pattern and
    its name in a failure."""

    ref: object  # weakref to the whole allocation, unsigned ints of the item size
    keep: object  # the device's hold on its memory (CuPy's MemoryPointer), dropped when it dies
    address: int  # the whole allocation's first byte
    layout: Layout
    itemsize: int
    pattern: int  # one element's bits
    name: str  # the caller's label, else the helper and its call site
    what: str  # dtype and shape, "bfloat16 (4, 256)"

    def guard(self, side: int) -> slice:
        """The guard's elements in the whole allocation."""
        s = self.itemsize
        if side == 0:
            return slice(0, self.layout.before // s)
        return slice((self.layout.before + self.layout.nbytes) // s, self.layout.total // s)

    def guard_bytes(self, side: int) -> tuple[int, int]:
        """(address, bytes) of a guard."""
        if side == 0:
            return self.address, self.layout.before
        return self.address + self.layout.before + self.layout.nbytes, self.layout.after

    def pattern_bytes(self) -> bytes:
        return int(self.pattern).to_bytes(self.itemsize, "little")


def _bytes(n: int) -> str:
    return f"{n} byte" if n == 1 else f"{n} bytes"


@dataclass(frozen=True)
class Finding:
    """A written guard, as a read point found it. Distances count from the view: after it, +0 is
    the first byte past its end; before it, -1 is the last byte before its start."""

    name: str
    what: str
    nbytes: int
    itemsize: int
    side: str  # "before" or "after"
    distance: int  # the changed byte nearest the view
    changed: int  # guard bytes that differ from the pattern now
    guard: int  # the guard's bytes
    farthest: int  # the changed byte farthest from the view
    window_from: int  # the first byte shown, as a distance
    window: bytes  # guard bytes from there, in memory order
    pattern: bytes
    kernel: str | None  # launched last before the check that saw it; None: no launch through the harness since
    last_kernel: str | None  # the last launched through the harness before that check

    def _at(self, distance: int) -> str:
        return f"+{distance}" if self.side == "after" else f"-{distance}"

    def lines(self) -> list[str]:
        after = self.side == "after"
        n = self.nbytes // self.itemsize
        where = "after its end" if after else "before its start"
        if after:
            element = f"element [{n + self.distance // self.itemsize}] (its last is [{n - 1}])"
        else:
            element = f"element [{-((self.distance + self.itemsize - 1) // self.itemsize)}] (its first is [0])"
        lines = [f"redzone written: {self.name} ({self.what}, {_bytes(self.nbytes)}), {where}",
                 f"  nearest changed byte: {self._at(self.distance)} {'past its end' if after else 'before its start'}, "
                 f"in {element}"]
        if self.changed:
            lines.append(f"  changed: {self.changed} of the {self.guard} guard bytes {self.side} it, "
                         f"{self._at(self.distance)} to {self._at(self.farthest)}")
        else:
            lines.append("  changed: none now (the guard holds its pattern again: written back since)")
        last = self.window_from + (len(self.window) - 1 if after else -(len(self.window) - 1))
        lines.append(f"  first changed guard bytes, {self._at(self.window_from)} to {self._at(last)}: "
                     f"{self.window.hex(' ')}  (the pattern: {self.pattern.hex(' ')})")
        if self.kernel is not None:
            lines.append(f"  kernel launched last: {self.kernel}")
        else:
            before = f"; the last launched through it: {self.last_kernel}" if self.last_kernel else ""
            lines.append("  kernel launched last: none through the harness since the check before (a kernel "
                         f"launched otherwise, torch or CuPy, or a copy, wrote it){before}")
        return lines


OPT_OUT = ("  a kernel that writes outside its buffer on purpose: mark its gate "
           "@pytest.mark.no_redzones(reason=...), or make that buffer with redzone=False")


class RedzoneWritten(BitsMismatch):
    """A kernel wrote into the guard region beside a buffer (`harness.library.redzones`): the
    message names each buffer, the side, the offset from its end or start, the first changed
    guard bytes and the kernel launched last."""

    def __init__(self, findings, read_at: str = "check_redzones()"):
        self.findings = tuple(findings)
        self.read_at = read_at
        lines = [line for f in self.findings for line in f.lines()]
        super().__init__("\n".join([*lines, f"  read at: {read_at}", OPT_OUT]))


def _replicated(pattern: int, itemsize: int) -> int:
    """One element's bits repeated over 8 bytes, as memory holds them at an 8-aligned address."""
    return int.from_bytes(int(pattern).to_bytes(itemsize, "little") * (8 // itemsize), "little")


class Redzones:
    """One device's guarded buffers and their check (module docstring). `device` does the device's
    part (`harness.library.redzone_device.CupyDevice`; a test's stand-in)."""

    def __init__(self, device):
        self.device = device
        self.allocations: dict[int, Allocation] = {}  # by index: result slots 2 * index (before) and + 1 (after)
        self.launched: list[str | None] = []  # by check number: the kernel launched just before it
        self._free: list[int] = []  # indexes no buffer holds
        self._capacity = 0
        self._results = None
        self._table = None  # (the guards on the device, how many, blocks along a guard, uploaded); None: to build
        self._kept: list = []  # tables a check in flight may still read
        self._writes: dict = {}  # stream -> the event after our last write on it (fills, resets), waited for
        self._in_flight: dict = {}  # stream -> (stream, the event after its last check)
        self._orphans: list[Finding] = []  # written guards of buffers that died before a read point
        self._unread = False  # checked or allocated since the last read point
        self._busy = 0  # inside one of the methods below: a buffer that dies now is let go after it
        self._dying: list[int] = []
        self.guarded = 0  # buffers made between guards, ever (a run's summary counts them: `tally`)
        self.checks = 0  # checks queued, ever

    @contextlib.contextmanager
    def _working(self):
        """A buffer may die in the middle of our own work (a garbage collection while we allocate):
        it is let go when the work is done, never under a table being built from it."""
        self._busy += 1
        try:
            yield
        finally:
            self._busy -= 1
            while not self._busy and self._dying:
                self._let_go(self._dying.pop())

    # ---------------------------------------------------------------- allocating

    def allocate(self, n: int, dtype, *, guard: int, name: str, what: str, contents=None, fill_bits=None):
        """A buffer of `n` elements of `dtype` between guards of `guard` bytes: holding `contents`
        (host bits, unsigned ints of the item size), else every element `fill_bits`, else the
        pattern. Returns the view, 1-D, as unsigned ints of the item size (None: no slot can be
        had now; the caller allocates without)."""
        dtype = np.dtype(dtype)
        s, pattern = dtype.itemsize, pattern_bits(dtype)
        uint = _UINT_OF_SIZE[s]
        layout = Layout.of(int(n) * s, guard)
        first, count = layout.before // s, int(n)
        with self._working():
            index = self._index()
            if index is None:
                return None
            if contents is not None:
                host = np.full(layout.total // s, pattern, dtype=uint)
                host[first:first + count] = np.asarray(contents).reshape(-1).view(uint)
                whole = self.device.from_host(host)
            else:
                whole = self.device.full(layout.total // s, pattern, uint)
                if fill_bits is not None and count:
                    self.device.fill(whole[first:first + count], fill_bits)
            self._wrote()
            self.allocations[index] = Allocation(weakref.ref(whole, lambda _, i=index: self._died(i)),
                                                 self.device.keep(whole), self.device.address(whole), layout, s,
                                                 pattern, name, what)
            self._unread = True
            self.guarded += 1
            return whole[first:first + count]

    def _index(self) -> int | None:
        """A free index; where none is left, a read point and twice the slots (no check is in
        flight after it, so the new result array replaces the old one). None where no read
        point can be had (inside a graph capture)."""
        if not self._free:
            if self._capacity:
                self.read("a new buffer's allocation")
                if self._in_flight:
                    return None
            grown = max(FIRST_CAPACITY, 2 * self._capacity)
            self._results = self.device.new_results(2 * grown)
            self._free = list(range(grown - 1, self._capacity - 1, -1))
            self._capacity = grown
            self._wrote()
        return self._free.pop()

    def _wrote(self) -> None:
        key = self.device.stream_key(self.device.current_stream())
        self._writes[key] = self.device.record(None, self._writes.get(key))
        self._table = None  # the next check's stream waits for these writes when it uploads its table

    def _died(self, index: int) -> None:
        """A buffer's whole allocation died (its last view with it): let go now, or after the
        work under way."""
        if self._busy:
            self._dying.append(index)
        else:
            self._let_go(index)

    def _let_go(self, index: int) -> None:
        """A dead buffer's guards read while its memory is still held, any write kept for the
        next read point; then its memory goes back and its index is free. A check in flight may
        still read it or write its slots, so every one is waited for first (and our own writes:
        a reset of the results)."""
        a = self.allocations.pop(index, None)
        if a is None:
            return
        try:
            if self._unread and self._results is not None:  # its slots may hold what no read point saw
                self.device.wait([event for _, event in self._in_flight.values()] + list(self._writes.values()))
                self._in_flight.clear()
                self._kept = []
                keys = self.device.read_slots(self._results, 2 * index, 2)
                written = [(side, int(key)) for side, key in enumerate(keys) if int(key) != NONE]
                self._orphans += [self._finding(a, side, key) for side, key in written]
                if written:
                    self.device.set_slots(self._results, 2 * index, [NONE, NONE])
        except Exception:  # noqa: BLE001 - a context that faulted: nothing can be read; the fault is the verdict
            pass
        a.keep = None
        self._free.append(index)
        self._table = None
        if not self.allocations and not self._in_flight:
            self._release()

    def _release(self) -> None:
        """No buffer left and no check in flight: the result array and the tables go back to
        CuPy's pool (a worker that served a mutant must hold no device memory after it)."""
        self._results, self._table, self._kept, self._writes = None, None, [], {}
        self._free, self._capacity = [], 0

    # ---------------------------------------------------------------- checking

    def after_launch(self, name: str, stream=None) -> None:
        """Queue the check behind kernel `name` on `stream` (None: the current one); nothing is
        queued on a stream being captured into a graph."""
        if not self.allocations:
            return
        stream = self.device.current_stream() if stream is None else stream
        if self.device.is_capturing(stream):
            return
        if len(self.launched) >= MAX_CHECKS:
            self.read("the checks' count")
        with self._working():
            self._check(stream, name)

    def _check(self, stream, name: str | None) -> None:
        seq = len(self.launched)
        self.launched.append(name)
        table, count, blocks, uploaded = self._table_on(stream)
        self.device.launch_check(table, count, self._results, seq, blocks, stream, uploaded)
        key = self.device.stream_key(stream)
        event = self._in_flight[key][1] if key in self._in_flight else None
        self._in_flight[key] = (stream, self.device.record(stream, event))
        self._unread = True
        self.checks += 1

    def _table_on(self, stream):
        if self._table is None:
            records = np.zeros(2 * (max(self.allocations) + 1 if self.allocations else 0), GUARD_RECORD)
            words = 0
            for i, a in list(self.allocations.items()):
                pattern = _replicated(a.pattern, a.itemsize)
                for side in (0, 1):
                    start, nbytes = a.guard_bytes(side)
                    records[2 * i + side] = (start, start + nbytes, pattern, side, 2 * i + side)
                words = max(words, a.layout.before // 8, a.layout.after // 8 + 1)
            records = records[records["end"] != 0]  # the free indexes' rows
            table = self.device.upload(records, stream, list(self._writes.values()))
            self._writes = {}
            self._kept.append(table)
            self._table = (table, len(records), max(1, min(MAX_BLOCKS_X, -(-words // THREADS))),
                           self.device.record(stream))
        return self._table

    def _settled(self) -> np.ndarray | None:
        """The results after a last check on the current stream and a wait for the device (None
        while that stream is being captured: nothing can wait there)."""
        stream = self.device.current_stream()
        if self.device.is_capturing(stream):
            return None
        if self._unread:
            self._check(stream, None)
        self.device.synchronize()
        self._unread = False
        self._in_flight.clear()
        self._kept = []  # no check is in flight: only the current table is still needed
        return np.asarray(self.device.read(self._results))

    def read(self, why: str, *, report: bool = True) -> None:
        """A read point (`why`: what asked for it): every result read after a last check. Each
        written guard is filled again and, with `report`, raised with the writes kept from
        buffers that died since, as one `RedzoneWritten`."""
        findings = []
        with self._working():
            if self.allocations:
                results = self._settled()
                if results is None:
                    return
                for index, a in sorted(self.allocations.items()):
                    for side in (0, 1):
                        key = int(results[2 * index + side])
                        if key != NONE:
                            findings.append(self._finding(a, side, key))
                            whole = a.ref()
                            if whole is not None:
                                self.device.fill(whole[a.guard(side)], a.pattern)
                if findings:
                    self.device.fill(self._results, NONE)
                    self._wrote()
        findings, self._orphans = self._orphans + findings, []
        self.launched.clear()
        if findings and report:
            raise RedzoneWritten(findings, why)

    def rearm(self) -> None:
        """A last check, every written guard filled again and forgotten, unreported."""
        self._unread = True  # launches went unchecked (a gate with no redzones): look once more
        self.read("rearm", report=False)

    def _finding(self, a: Allocation, side: int, key: int) -> Finding:
        seq, distance = key >> 32, key & 0xFFFFFFFF
        raw = np.frombuffer(self.device.read_bytes(*a.guard_bytes(side)), np.uint8)
        expected = np.frombuffer(a.pattern_bytes() * (raw.size // a.itemsize), np.uint8)
        at = np.flatnonzero(raw != expected)
        if side == 1:  # byte i of the guard lies i bytes past the view's end
            distances = at
            window = raw[distance:distance + WINDOW]
            window_from = distance
        else:  # byte i lies (guard - i) bytes before the view's start
            distances = raw.size - at
            lo = max(0, raw.size - distance - WINDOW + 1)
            window = raw[lo:raw.size - distance + 1]
            window_from = raw.size - lo
        kernel = self.launched[seq] if seq < len(self.launched) else None
        last = next((k for k in reversed(self.launched[:seq]) if k is not None), None)
        return Finding(name=a.name, what=a.what, nbytes=a.layout.nbytes, itemsize=a.itemsize, side=SIDES[side],
                       distance=distance, changed=int(at.size), guard=int(raw.size),
                       farthest=int(distances.max()) if at.size else distance, window_from=window_from,
                       window=bytes(window), pattern=a.pattern_bytes(), kernel=kernel,
                       last_kernel=last if kernel is None else None)


# ------------------------------------------------------------------ this process's redzones

_registries: dict[object, Redzones] = {}  # device ordinal -> its guarded buffers


def enabled() -> bool:
    """Whether buffers made now get redzones and launches now are checked: the settings in effect
    say so (`--no-redzones` turns them off for a run; the plugin for a gate marked no_redzones)."""
    return _settings.in_effect().redzones


def registry() -> Redzones | None:
    """The current device's redzones, made on first use; None where CuPy is a stand-in whose arrays
    are host arrays (no `ndarray` type of its own, or no `cuda` runtime: a test's emulated device)."""
    import cupy

    if not isinstance(getattr(cupy, "ndarray", None), type) or getattr(cupy, "cuda", None) is None:
        return None
    ordinal = cupy.cuda.runtime.getDevice()
    found = _registries.get(ordinal)
    if found is None:
        found = _registries[ordinal] = Redzones(CupyDevice(ordinal))
    return found


def call_site(helper: str) -> str:
    """`helper at FILE:LINE in FUNCTION`, the first caller outside the harness."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_globals.get("__name__", "").startswith("harness."):
        frame = frame.f_back
    if frame is None:
        return helper
    path = Path(frame.f_code.co_filename)
    try:
        path = path.resolve().relative_to(Path.cwd().resolve())
    except (OSError, ValueError):
        pass
    return f"{helper} at {path.as_posix()}:{frame.f_lineno} in {frame.f_code.co_name}"


def allocate(n: int, dtype, *, shape, helper: str, label: str | None = None, redzone: bool = True,
             redzone_bytes: int = REDZONE_BYTES, contents=None, fill_bits=None):
    """`Redzones.allocate` on the current device for a buffer helper (`helper`, named in a failure
    with its call site unless `label` names the buffer); the guards sized for `shape`. None where
    this buffer gets none: `redzone=False`, redzones off (`enabled`), an item size of other than
    1, 2, 4 or 8 bytes, a stand-in CuPy; the helper then allocates as it would without."""
    dtype = np.dtype(dtype)
    if not redzone or dtype.itemsize not in _UINT_OF_SIZE or not enabled():
        return None
    found = registry()
    if found is None:
        return None
    dims = tuple(int(d) for d in shape) if isinstance(shape, (tuple, list)) else (int(shape),)
    name = label if label is not None else call_site(helper)
    return found.allocate(n, dtype, guard=guard_bytes(dims, dtype, redzone_bytes), name=name,
                          what=f"{dtype.name} {dims}", contents=contents, fill_bits=fill_bits)


def after_launch(name: str, stream=None, device=None) -> None:
    """Kernel `name` was just launched on `stream` (None: the current one) of `device` (None: the
    current one): queue the check behind it. Nothing at all where no buffer is guarded."""
    if not _registries or not enabled():
        return
    if device is None:
        import cupy

        device = cupy.cuda.runtime.getDevice()
    found = _registries.get(device)
    if found is not None:
        found.after_launch(name, stream)


def check_redzones(why: str = "check_redzones()") -> None:
    """Wait for the device, then raise `RedzoneWritten` for every guard written since the last
    read point (each device's). The plugin calls it at the end of every gate; a gate may call it
    where it wants a write named before it compares outputs."""
    if not _registries or not enabled():
        return
    for found in list(_registries.values()):
        found.read(why)


def tally() -> tuple[int, int]:
    """(buffers guarded, checks queued) in this process so far, every device's: a gate's share
    is the difference across its call (the plugin's `redzones` property)."""
    found = list(_registries.values())
    return sum(r.guarded for r in found), sum(r.checks for r in found)


def rearm() -> None:
    """Every written guard filled again and forgotten, unreported: after a gate that ran with no
    redzones (its kernel may write past its views on purpose), so no later gate is blamed."""
    for found in list(_registries.values()):
        found.rearm()
