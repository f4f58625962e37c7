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
`buffers.to_host`, the end of every gate (the plugin), and before an allocation when the dead
buffers held or the slots run out. A written guard is a `RedzoneWritten` naming the buffer, the
side, the offset from its end (or start), the first changed guard bytes and the kernel launched
last before the check that saw it; the guard is then filled again.

**Lifetime.** The registry holds each allocation until a read point finds nothing else refers to
it, so no check still in flight reads memory given back to CuPy's pool.

**Off.** `--no-redzones` for the run (`Settings.redzones`); `@pytest.mark.no_redzones(reason=...)`
for a gate whose kernel writes past a view on purpose (it runs with none, and every guard is filled
again after it); `redzone=False` for one buffer. Trap gates run with none: their fault is the
verdict, and nothing can be read after it. A stand-in CuPy whose arrays are host arrays (the
harness's own host tests) gets none: a host array is never launched.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from harness.core import settings as _settings
from harness.library.bits import BitsMismatch
from harness.library.dtypes import _UINT_OF_SIZE

REDZONE_BYTES = 4096  # the least guard on each side of a buffer
ROW_CAP = 1 << 20  # a guard grows to one row of its buffer, up to this
ALIGN = 256  # the view's alignment, and the allocation's length a multiple of it
NONE = (1 << 64) - 1  # a result slot whose guard no check saw written
DEAD_BYTES = 64 << 20  # bytes of buffers nothing refers to any more, held until a read point, at most
DEAD_COUNT = 256  # and as many such buffers, at most
MAX_CHECKS = 1 << 16  # checks between two read points, at most
FIRST_CAPACITY = 256  # buffers the first result array has slots for
WINDOW = 16  # guard bytes a failure shows
THREADS = 256  # the check kernel's block
MAX_BLOCKS_X = 8  # its blocks along one guard

CHECK_SOURCE = Path(__file__).with_name("redzone_check.cu")
CHECK_KERNEL = "harness_redzone_check"
GUARD_RECORD = np.dtype([("start", "<u8"), ("end", "<u8"), ("pattern", "<u8"), ("side", "<u4"), ("slot", "<u4")])
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
    """One guarded buffer: its whole allocation (unsigned ints of the item size), where the view
    lies in it, its pattern and its name in a failure."""

    whole: object
    layout: Layout
    itemsize: int
    pattern: int  # one element's bits
    name: str  # the caller's label, else the helper and its call site
    what: str  # dtype and shape, "bfloat16 (4, 256)"

    def guard(self, side: int) -> slice:
        """The guard's elements in `whole`."""
        s = self.itemsize
        if side == 0:
            return slice(0, self.layout.before // s)
        return slice((self.layout.before + self.layout.nbytes) // s, self.layout.total // s)

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


def _unreferenced(allocation: Allocation) -> bool:
    """Nothing but the registry refers to the allocation (no view of it is alive)."""
    return sys.getrefcount(allocation.whole) <= 2  # the record's attribute and this call's argument


def _replicated(pattern: int, itemsize: int) -> int:
    """One element's bits repeated over 8 bytes, as memory holds them at an 8-aligned address."""
    return int.from_bytes(int(pattern).to_bytes(itemsize, "little") * (8 // itemsize), "little")


class Redzones:
    """One device's guarded buffers and their check (module docstring). `device` does the device's
    part (`_Cupy`; a test's stand-in)."""

    def __init__(self, device):
        self.device = device
        self.allocations: list[Allocation] = []
        self.launched: list[str | None] = []  # by check number: the kernel launched just before it
        self.last_kernel: str | None = None
        self._results = None
        self._capacity = 0  # buffers the result array has slots for (two each)
        self._table = None  # (the guards on the device, how many, blocks along a guard); None: to build
        self._kept: list = []  # tables a check in flight may still read, until the next read point
        self._writes: list = []  # our own writes (fills, resets) a check on another stream must wait for
        self._unread = False  # checked or allocated since the last read point

    # ---------------------------------------------------------------- allocating

    def allocate(self, n: int, dtype, *, guard: int, name: str, what: str, contents=None, fill_bits=None):
        """A buffer of `n` elements of `dtype` between guards of `guard` bytes: holding `contents`
        (host bits, unsigned ints of the item size), else every element `fill_bits`, else the
        pattern. Returns the view, 1-D, as unsigned ints of the item size."""
        dtype = np.dtype(dtype)
        s, pattern = dtype.itemsize, pattern_bits(dtype)
        uint = _UINT_OF_SIZE[s]
        layout = Layout.of(int(n) * s, guard)
        self._make_room(layout.total)
        first, count = layout.before // s, int(n)
        if contents is not None:
            host = np.full(layout.total // s, pattern, dtype=uint)
            host[first:first + count] = np.asarray(contents).reshape(-1).view(uint)
            whole = self.device.from_host(host)
        else:
            whole = self.device.full(layout.total // s, pattern, uint)
            if fill_bits is not None and count:
                self.device.fill(whole[first:first + count], fill_bits)
        self._wrote()
        self.allocations.append(Allocation(whole, layout, s, pattern, name, what))
        self._unread = True
        return whole[first:first + count]

    def _make_room(self, nbytes: int) -> None:
        """A read point first where the buffers nothing refers to hold too much, or the result
        slots run out; then room for one more buffer."""
        dead = [a for a in self.allocations if _unreferenced(a)]
        held = sum(a.layout.total for a in dead)
        if len(self.allocations) >= self._capacity or (dead and (held + nbytes > DEAD_BYTES
                                                                 or len(dead) >= DEAD_COUNT)):
            self.read("a new buffer's allocation")
        if len(self.allocations) >= self._capacity:
            self._capacity = max(FIRST_CAPACITY, 2 * self._capacity)
            self._results = self.device.new_results(2 * self._capacity)  # no check in flight: read above
            self._wrote()

    def _wrote(self) -> None:
        self._writes.append(self.device.record())
        self._table = None  # the next check's stream waits for these writes when it uploads its table

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
        self.last_kernel = name
        self._check(stream, name)

    def _check(self, stream, name: str | None) -> None:
        seq = len(self.launched)
        self.launched.append(name)
        table, count, blocks = self._table_on(stream)
        self.device.launch_check(table, count, self._results, seq, blocks, stream)
        self._unread = True

    def _table_on(self, stream):
        if self._table is None:
            records = np.zeros(2 * len(self.allocations), GUARD_RECORD)
            words = 0
            for i, a in enumerate(self.allocations):
                base, lay = self.device.address(a.whole), a.layout
                pattern = _replicated(a.pattern, a.itemsize)
                records[2 * i] = (base, base + lay.before, pattern, 0, 2 * i)
                records[2 * i + 1] = (base + lay.before + lay.nbytes, base + lay.total, pattern, 1, 2 * i + 1)
                words = max(words, lay.before // 8, lay.after // 8 + 1)
            table = self.device.upload(records, stream, self._writes)
            self._writes = []
            self._kept.append(table)
            self._table = (table, len(records), max(1, min(MAX_BLOCKS_X, -(-words // THREADS))))
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
        self._kept = []  # no check is in flight any more
        return np.asarray(self.device.read(self._results))[:2 * len(self.allocations)]

    def _forget_unreferenced(self) -> None:
        alive = [a for a in self.allocations if not _unreferenced(a)]
        if len(alive) != len(self.allocations):
            self.allocations = alive
            self._table = None

    def read(self, why: str, *, report: bool = True) -> None:
        """A read point (`why`: what asked for it): every result read after a last check. Each
        written guard is filled again and, with `report`, raised as one `RedzoneWritten`; the
        buffers nothing refers to any more are let go."""
        if not self.allocations:
            self.launched.clear()
            return
        results = self._settled()
        if results is None:
            return
        written = [int(slot) for slot in np.flatnonzero(results != NONE)]
        findings = [self._finding(slot, int(results[slot])) for slot in written]
        for slot in written:
            a = self.allocations[slot // 2]
            self.device.fill(a.whole[a.guard(slot % 2)], a.pattern)
        if written:
            self.device.fill(self._results, NONE)
            self._wrote()
        self.launched.clear()
        self._forget_unreferenced()
        if findings and report:
            raise RedzoneWritten(findings, why)

    def rearm(self) -> None:
        """A last check, every written guard filled again and forgotten, unreported."""
        self._unread = True  # launches went unchecked (a gate with no redzones): look once more
        self.read("rearm", report=False)

    def let_go(self) -> None:
        """After a wait for the device, let go of the buffers nothing refers to, unless a guard
        was written (the next read point reports it, with every buffer it names): before the
        pool's cached memory goes back to the driver."""
        if not self.allocations:
            return
        results = self._settled()
        if results is None or (results != NONE).any():
            return
        self.launched.clear()
        self._forget_unreferenced()

    def _finding(self, slot: int, key: int) -> Finding:
        a, side = self.allocations[slot // 2], slot % 2
        seq, distance = key >> 32, key & 0xFFFFFFFF
        raw = np.asarray(self.device.read(a.whole[a.guard(side)])).view(np.uint8)
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


class _Cupy:
    """What the redzones ask of one device, through CuPy (a test gives a stand-in)."""

    def __init__(self, ordinal: int):
        import cupy

        self.cupy = cupy
        self.ordinal = ordinal
        self._module = self._kernel = None

    def full(self, n: int, bits: int, uint):
        return self.cupy.full(int(n), np.dtype(uint).type(bits), dtype=uint)

    def from_host(self, host: np.ndarray):
        return self.cupy.asarray(host)

    def fill(self, array, bits: int) -> None:
        array.fill(np.dtype(array.dtype).type(bits))

    def address(self, array) -> int:
        return int(array.data.ptr)

    def read(self, array) -> np.ndarray:
        return array.get()

    def current_stream(self):
        return self.cupy.cuda.get_current_stream()

    def is_capturing(self, stream) -> bool:
        try:
            return bool(stream.is_capturing())
        except Exception:  # noqa: BLE001 - the legacy stream beside a capture: queue nothing there
            return True

    def record(self):
        event = self.cupy.cuda.Event(disable_timing=True)
        event.record()
        return event

    def upload(self, records: np.ndarray, stream, writes: list):
        with stream:
            for event in writes:
                stream.wait_event(event)
            return self.cupy.asarray(records.view(np.uint8))

    def new_results(self, count: int):
        return self.cupy.full(int(count), np.uint64(NONE), dtype=np.uint64)

    def launch_check(self, table, count: int, results, seq: int, blocks: int, stream) -> None:
        self._check_kernel()((blocks, min(count, 65535)), (THREADS,),
                             (table, np.uint32(count), results, np.uint32(seq)), stream=stream)

    def synchronize(self) -> None:
        self.cupy.cuda.runtime.deviceSynchronize()

    def _check_kernel(self):
        if self._kernel is None:
            self._module = self.cupy.cuda.function.Module()
            self._module.load(compile_check().cubin)
            self._kernel = self._module.get_function(CHECK_KERNEL)
        return self._kernel


def compile_check(run: _settings.Settings | None = None):
    """The check kernel's `CompiledModule`, through the harness's compile path (NVRTC, the cubin
    cache), for the run's arch (`run`: the settings in effect by default)."""
    from dataclasses import replace

    from harness.compiling.compile import compile_file
    from harness.compiling.modsettings import ModuleSettings

    run = run if run is not None else _settings.in_effect()
    return compile_file(CHECK_SOURCE, kernel_root=CHECK_SOURCE.parent, settings=ModuleSettings(device_view=False),
                        include_dirs=(), run=replace(run, trap_shadow=False))


# ------------------------------------------------------------------ this process's redzones

_registries: dict[object, Redzones] = {}  # device ordinal -> its guarded buffers


def enabled() -> bool:
    """Whether buffers made now get redzones and launches now are checked: the settings in effect
    say so (`--no-redzones` turns them off for a run; the plugin for a gate marked no_redzones)."""
    return _settings.in_effect().redzones


def registry() -> Redzones | None:
    """The current device's redzones, made on first use; None where CuPy is a stand-in whose arrays
    are host arrays (no `ndarray` type of its own)."""
    import cupy

    if not isinstance(getattr(cupy, "ndarray", None), type):
        return None
    ordinal = cupy.cuda.runtime.getDevice()
    found = _registries.get(ordinal)
    if found is None:
        found = _registries[ordinal] = Redzones(_Cupy(ordinal))
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


def rearm() -> None:
    """Every written guard filled again and forgotten, unreported: after a gate that ran with no
    redzones (its kernel may write past its views on purpose), so no later gate is blamed."""
    for found in list(_registries.values()):
        found.rearm()


def let_go() -> None:
    """The buffers nothing refers to let go (`Redzones.let_go`): before CuPy's cached blocks go
    back to the driver."""
    for found in list(_registries.values()):
        found.let_go()
