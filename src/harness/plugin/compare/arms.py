"""A comparison's arms: each gate's arm outputs and launch timings, REF's side against today's,
as read from the side folders the gates wrote (`harness.plugin.snapshots.side_folder`)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path


def ordered(bits, kind: str):
    """Bits as integers ordered as the values they encode (floats: sign-magnitude folded), so
    that the distance between two is their distance in ULPs."""
    import numpy as np

    x = bits.astype(np.int64)
    if kind != "f":
        return x
    width = bits.dtype.itemsize * 8
    sign = np.int64(1) << (width - 1)
    return np.where(x & sign, -(x & (sign - 1)), x)


class ArmStatus(str, Enum):
    """What comparing one arm found: its value is the word the reports and compare.json write."""

    SAME_BITS = "same bits"
    DIFFERS = "differs"  # same shape and dtype, other bits
    ONLY_IN_REF = "only in REF"
    ONLY_TODAY = "only today"
    NOT_COMPARABLE = "not comparable"  # another shape or dtype

    def __str__(self) -> str:
        return self.value


class Speed(str, Enum):
    """A kernel's time today against REF's: faster or slower when the middle halves of the two
    sides' launches do not overlap."""

    FASTER = "faster"
    SLOWER = "slower"
    SAME = "same speed"

    def __str__(self) -> str:
        return self.value


@dataclass
class ArmComparison:
    arm: str
    status: ArmStatus
    elements: int = 0
    differing: int = 0
    first: dict | None = None  # index, both values, both bit patterns
    ulps: dict | None = None  # max, median, histogram {"1": n, "2-3": n, ...}
    note: str | None = None


def compare_arm(name: str, ref, now) -> ArmComparison:
    import numpy as np

    from harness.library.bits import _hex, _index, _value_text
    from harness.library.dtypes import bits_of

    if ref.shape != now.shape or ref.dtype != now.dtype:
        return ArmComparison(name, ArmStatus.NOT_COMPARABLE, note=f"REF {ref.dtype}{ref.shape}, today {now.dtype}{now.shape}")
    a, b = bits_of(ref).reshape(-1), bits_of(now).reshape(-1)
    bad = np.flatnonzero(a != b)
    if not bad.size:
        return ArmComparison(name, ArmStatus.SAME_BITS, elements=a.size)
    i = int(bad[0])
    size = ref.dtype.itemsize
    first = {"index": _index(i, ref.shape), "ref": _value_text(a[i], ref.dtype), "today": _value_text(b[i], ref.dtype),
             "ref_bits": _hex(a[i], size), "today_bits": _hex(b[i], size)}
    kind = "f" if ref.dtype.kind == "f" or "float" in str(ref.dtype) else "i"
    dist = np.abs(ordered(a[bad], kind) - ordered(b[bad], kind))
    edges = [1, 2, 4, 16, 256, 65536]
    hist, lo = {}, 1
    for hi in edges[1:] + [None]:
        n = int(((dist >= lo) & (dist < hi)).sum()) if hi else int((dist >= lo).sum())
        if n:
            hist[f"{lo}" if hi == lo + 1 else (f"{lo}-{hi - 1}" if hi else f">={lo}")] = n
        lo = hi
    ulps = {"max": int(dist.max()), "median": float(np.median(dist)), "histogram": hist}
    return ArmComparison(name, ArmStatus.DIFFERS, elements=a.size, differing=int(bad.size), first=first, ulps=ulps)


@dataclass
class GateComparison:
    nodeid: str
    ref_outcome: str
    today_outcome: str
    arms: list[ArmComparison] = field(default_factory=list)
    launches: dict = field(default_factory=dict)  # {"ref": {kernel: count}, "today": {...}}
    timing: list[KernelTiming] = field(default_factory=list)
    timing_notes: list[str] = field(default_factory=list)
    kind: str = ""  # the gate's kind marker

    @property
    def differs(self) -> bool:
        """An arm's bits, shape or dtype moved (an arm only one side recorded is reported, not
        red: a gate new today has no REF arm, and a gate red today is red by its own verdict)."""
        return any(a.status in (ArmStatus.DIFFERS, ArmStatus.NOT_COMPARABLE) for a in self.arms)

    @property
    def bits(self) -> str:
        return "bits differ" if self.differs else "same bits"


@dataclass
class KernelTiming:
    """One kernel's launches in one gate, timed on both sides: sums over its launches paired by
    order (`kernel#i`) of each launch's median, lower and upper quartile, in microseconds."""

    kernel: str
    launches: int
    repeat: int
    ref_us: float
    today_us: float
    ref_quartiles: tuple[float, float]
    today_quartiles: tuple[float, float]
    speed: Speed

    @property
    def ratio(self) -> float:
        return self.ref_us / self.today_us if self.today_us else float("inf")


def compare_timing(ref: dict, today: dict) -> tuple[list[KernelTiming], list[str]]:
    """Each kernel's timed launches of one gate ({"kernel#i": {"ms": [...]}, ...} a side),
    REF's against today's; and a note for launches timed on one side only."""
    import numpy as np

    kernels: dict[str, list[str]] = {}
    for key in ref:
        if key in today:
            kernels.setdefault(key.rpartition("#")[0], []).append(key)
    notes = [f"{k}: timed {'in REF only' if k in ref else 'today only'}" for k in sorted(ref.keys() ^ today.keys())]
    out = []
    for kernel, keys in kernels.items():
        sums = {}
        for side, data in (("ref", ref), ("today", today)):
            q = np.array([np.percentile(np.asarray(data[k]["ms"]) * 1000.0, (25, 50, 75)) for k in keys]).sum(axis=0)
            sums[side] = q
        r, t = sums["ref"], sums["today"]
        speed = Speed.FASTER if t[2] < r[0] else Speed.SLOWER if t[0] > r[2] else Speed.SAME
        out.append(KernelTiming(kernel, len(keys), min(len(ref[k]["ms"]) for k in keys), round(float(r[1]), 3),
                                round(float(t[1]), 3), (round(float(r[0]), 3), round(float(r[2]), 3)),
                                (round(float(t[0]), 3), round(float(t[2]), 3)), speed))
    return out, notes


def compare_sides(nodeid: str, ref: dict, today: dict, ref_outcome: str, today_outcome: str) -> GateComparison:
    """Every arm of one gate, REF's against today's ({name: array} each)."""
    gate = GateComparison(nodeid, ref_outcome, today_outcome)
    for name in ref:
        gate.arms.append(compare_arm(name, ref[name], today[name]) if name in today
                         else ArmComparison(name, ArmStatus.ONLY_IN_REF))
    gate.arms += [ArmComparison(name, ArmStatus.ONLY_TODAY) for name in today if name not in ref]
    return gate




def read_side(folder: Path, nodeid: str) -> dict:
    """{arm: array} a gate wrote in a side folder (empty when it wrote none)."""
    from harness.library.dtypes import from_bits
    from harness.plugin.snapshots import dump_name, read

    path = folder / dump_name(nodeid)
    if not path.is_file():
        return {}
    out = {}
    for name, (meta, bits) in read(path).items():
        out[name] = from_bits(bits, _dtype(meta["dtype"])).reshape(meta["shape"])
    return out


def read_launches(folder: Path, nodeid: str) -> dict:
    """A gate's launch counts and timings in a side folder (`harness.library.timing.end`)."""
    from harness.plugin.snapshots import launches_name

    path = folder / launches_name(nodeid)
    return json.loads(path.read_text()) if path.is_file() else {"launches": {}, "timed": {}, "notes": []}


def _dtype(name: str):
    """numpy's dtype of that name, or ml_dtypes' (bfloat16, float8_e4m3fn, ...)."""
    import numpy as np

    try:
        return np.dtype(name)
    except TypeError:
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, name))
