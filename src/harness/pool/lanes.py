"""Lanes: the ordinary GPU gates of a run on several warm workers at once, on one GPU.

A gate's host work (inputs, references, comparisons) is most of its time; the GPU work is
microseconds to milliseconds. One main worker runs those gates one after another on one
core; lanes run them on several. The run's gates are split, before the first one runs,
into lanes of whole modules (a module's fixtures are made once in its lane, as one worker
makes them), a module cut into consecutive runs of gates only where it alone would outlast
a lane's share. Each lane has its own worker and a thread here that sends it its gates in
run order, each with its own deadline; the pytest process reads the verdicts in its own
order and waits only for the gate it reaches. A verdict is the same wherever its gate runs:
each lane's worker keeps the module's fixtures between its gates exactly as the main worker
would, a gate that poisons its context or passes its deadline costs its lane's worker (the
lane's next gate gets a fresh one), and the other lanes never notice.

Not under xdist (a worker there is not told its gates ahead), a sanitizer, or
`--compare-timing` (timed launches want the GPU to themselves): those keep one main worker.

The split uses what each gate took the last time it ran (`GateTimes`, a small JSON file
in the cubin cache's folder); a gate never run before counts as its kind's typical cost.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

from harness.pool.channel import trace

# A gate with no recorded time: seconds by kind (invariance and determinism gates launch a
# kernel hundreds of times; the rest a few times).
DEFAULT_SECONDS = {"invariance": 2.0, "determinism": 1.0}
DEFAULT_GATE_SECONDS = 0.05
TIMES_FILE = "gate-seconds.json"
MAX_AUTO_LANES = 8


def host_cpus() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def auto_lanes(cpus: int | None = None) -> int:
    """The lanes a run takes with no --harness-lanes: a core for each lane's worker and one
    for the pytest process and the server, at most MAX_AUTO_LANES."""
    cpus = cpus if cpus is not None else host_cpus()
    return max(1, min(MAX_AUTO_LANES, cpus // 2))


def blas_share(workers: int, cpus: int | None = None) -> int:
    """BLAS threads for each of `workers` workers running gates at once on this host's cores
    (harness.pool.worker.limit_blas): an equal share, at least one."""
    cpus = cpus if cpus is not None else host_cpus()
    return max(1, cpus // max(1, workers))


def lanes_value(text: str) -> int | str:
    """--harness-lanes: a whole number of lanes from 1, or `auto`."""
    text = str(text).strip()
    if text == "auto":
        return text
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"--harness-lanes takes a whole number from 1 or `auto`, got {text!r}: "
                         "write e.g. --harness-lanes 4 (1 runs every GPU gate on one worker, in order)")
    return n


class GateTimes:
    """What each gate took the last time it ran here (seconds in its worker, by node id), kept
    beside the cubin cache. Only a hint for the split: a missing, stale or unreadable file
    changes how the gates are spread over the lanes, never a verdict."""

    def __init__(self, path: Path | None):
        self.path = path
        self.seconds: dict[str, float] = {}
        if path is not None:
            try:
                raw = json.loads(path.read_text())
                self.seconds = {str(k): float(v) for k, v in raw.items() if isinstance(v, (int, float))}
            except (OSError, ValueError, AttributeError):
                self.seconds = {}
        self._new: dict[str, float] = {}

    def estimate(self, nodeid: str, kinds: tuple[str, ...] = ()) -> float:
        if nodeid in self.seconds:
            return self.seconds[nodeid]
        return max([DEFAULT_SECONDS.get(k, DEFAULT_GATE_SECONDS) for k in kinds] or [DEFAULT_GATE_SECONDS])

    def record(self, nodeid: str, seconds: float) -> None:
        self._new[nodeid] = round(float(seconds), 4)

    def save(self) -> None:
        """Merge this run's times into the file (written whole, then renamed into place)."""
        if self.path is None or not self._new:
            return
        merged = dict(self.seconds, **self._new)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(merged, sort_keys=True, indent=0) + "\n")
            os.replace(tmp, self.path)
        except OSError:
            pass  # a read-only cache: the next run splits by kind


@dataclass
class Gate:
    nodeid: str
    module: str  # the file it belongs to: a module's gates stay together where they can
    seconds: float  # the estimate the split uses


def split(gates: list[Gate], lanes: int) -> list[list[str]]:
    """Node ids in `lanes` lanes, each in the order given (the run's order). Whole modules,
    the costliest first, each to the lane with the least so far; a module whose gates alone
    take more than a lane's share (the total over the lanes, or the costliest gate where
    that is more) is first cut into consecutive runs of at most that share.
    Empty lanes are dropped."""
    if lanes <= 1 or len(gates) <= 1:
        return [[g.nodeid for g in gates]] if gates else []
    # No lane can take less than the costliest gate: cutting a module below that share
    # only makes its fixtures again.
    share = max(sum(g.seconds for g in gates) / lanes, max(g.seconds for g in gates))
    order = {g.nodeid: i for i, g in enumerate(gates)}
    modules: dict[str, list[Gate]] = {}
    for g in gates:
        modules.setdefault(g.module, []).append(g)
    units: list[list[Gate]] = []
    for members in modules.values():
        run: list[Gate] = []
        total = 0.0
        for g in members:
            if run and total + g.seconds > share:
                units.append(run)
                run, total = [], 0.0
            run.append(g)
            total += g.seconds
        units.append(run)
    units.sort(key=lambda u: -sum(g.seconds for g in u))
    loads = [0.0] * lanes
    out: list[list[str]] = [[] for _ in range(lanes)]
    for unit in units:
        k = min(range(lanes), key=lambda i: loads[i])
        loads[k] += sum(g.seconds for g in unit)
        out[k] += [g.nodeid for g in unit]
    return [sorted(lane, key=order.__getitem__) for lane in out if lane]


@dataclass
class _Slot:
    """One gate's verdict as its lane left it for the pytest process."""

    done: threading.Event = field(default_factory=threading.Event)
    worker: object = None
    result: object = None
    error: str | None = None  # no worker could be had for it: the pool's error


class Lanes:
    """The run's lanes (`split`), each a thread that runs its gates in its own worker.

    `pool`: harness.pool.controller.Pool; `deadline_of(nodeid)` the gate's deadline in
    seconds; `times`: the GateTimes each finished gate is recorded in. The lanes numbered in
    `shadowed` run trap gates in the trap shadow, their worker made as good as fresh after
    each (`harness.pool.worker.reset_for_next_mutant`) or replaced."""

    def __init__(self, pool, lanes: list[list[str]], deadline_of, times: GateTimes | None = None,
                 shadowed: frozenset[int] = frozenset()):
        self.pool = pool
        self.deadline_of = deadline_of
        self.times = times
        self.shadowed = shadowed
        self.slots = {nodeid: _Slot() for lane in lanes for nodeid in lane}
        self._stopped = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i, lane), name=f"harness-lane-{i}", daemon=True)
                         for i, lane in enumerate(lanes)]

    def __contains__(self, nodeid: str) -> bool:
        return nodeid in self.slots

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def wait(self, nodeid: str, meanwhile=None, every: float = 0.1):
        """(the worker, its RunResult) for a gate of a lane, once its lane has it; raises the
        pool's error where no worker could be had for it. `meanwhile()` is called every
        `every` seconds while it waits (the plugin starts trap gates ahead on spares as they
        come up: a run that waits here for long must not hold them back)."""
        from harness.pool.controller import PoolError

        slot = self.slots[nodeid]
        while not slot.done.wait(every if meanwhile is not None else None):
            meanwhile()
        if slot.error is not None:
            raise PoolError(slot.error)
        return slot.worker, slot.result

    def stop(self) -> None:
        """No lane starts another gate; the one in flight ends with the pool's processes."""
        self._stopped.set()

    def _run(self, index: int, lane: list[str]) -> None:
        from harness.pool.controller import PoolError

        worker = None
        for i, nodeid in enumerate(lane):
            slot = self.slots[nodeid]
            if self._stopped.is_set():
                slot.error = "the run ended before this gate's lane reached it"
                slot.done.set()
                continue
            try:
                if worker is None or not worker.alive:
                    worker = self.pool.fresh_worker()  # the pool's close ends it
                    trace(f"  lane {index}: worker {worker.name}")
                shadow = index in self.shadowed
                nextid = lane[i + 1] if i + 1 < len(lane) and not shadow else None
                trace(f"  lane {index}: start {nodeid}")
                worker.start(nodeid, nextid, shadow=shadow, reset=shadow)
                # A hang in the trap shadow (past a counted guard) says nothing of the real kernel.
                result = worker.wait(self.deadline_of(nodeid), hung=None if shadow else self.pool.hung)
            except (PoolError, OSError, ValueError) as exc:
                # No worker could be had (the GPU is gone), or the pool closed under the lane
                # (the run was stopped): the gate has no verdict, and says why.
                slot.error = str(exc) if isinstance(exc, PoolError) else f"the gate pool closed: {exc}"
                slot.done.set()
                worker = None
                continue
            if self.times is not None and result.ran_to_its_end:
                self.times.record(nodeid, result.seconds)
            slot.worker, slot.result = worker, result
            slot.done.set()
