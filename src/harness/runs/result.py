"""One run result for every engine: what an executor did with a perturbed tree's gates; the
baseline (the unperturbed tree's run) made of one; and the executor protocol every engine
calls (a warm pool, a fresh pytest, and any backend that runs gates elsewhere)."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol, Sequence

from harness.core.records import GateRecord, Outcome

# One gate's result in a run: the record every engine shares (outcome "not run" when the run
# stopped before it).
GateOutcome = GateRecord


@dataclass(frozen=True)
class GateRuns:
    """What one executor call (or one fresh pytest) did."""

    outcomes: tuple[GateOutcome, ...]
    timed_out: bool = False
    crashed: str | None = None  # the process died without a report: why
    seconds: float = 0.0
    log: str | None = None
    waited: float = 0.0  # of `seconds`, waiting for a worker (a warm executor)
    timeout_note: str | None = None  # timed out: which gate was running, the last kernel launched
    stop_note: str | None = None  # why the executor stopped before the gates it was given ran
    facts: dict | None = None  # a fresh pytest's gates.json header (arch, device, ...)

    @property
    def records(self) -> dict[str, GateOutcome]:
        """{nodeid: record} of the gates that ran."""
        return {o.nodeid: o for o in self.outcomes if o.outcome != Outcome.NOT_RUN}

    @property
    def red(self) -> tuple[GateOutcome, ...]:
        return tuple(o for o in self.outcomes if o.red)

    def note(self) -> str | None:
        """Why the run says nothing of some gate: it hit its deadline, or its process died."""
        if self.timed_out:
            return f"killed at the deadline after {self.seconds:.0f} s; see {self.log}"
        return self.crashed


def merged(pieces: Sequence[GateRuns]) -> GateRuns:
    """One run of several executor calls over disjoint gates that ran side by side (a
    comparison's lanes of one side): every piece's outcomes, in the pieces' order; timed out
    where a piece was; each stopped piece's note (`crashed`, `stop_note`, `timeout_note`) kept,
    joined; the longest piece's seconds (the wall they took together), the waits summed; the log
    and facts of the first piece that stopped short (one that timed out first), else of the
    first piece. One piece is
    itself; none is a run of no gate. Which piece left which gate without a verdict is the
    caller's to keep (`harness.plugin.compare.sides.settle` does, gate by gate)."""
    if len(pieces) == 1:
        return pieces[0]
    if not pieces:
        return GateRuns(())

    def joined(notes) -> str | None:
        return "; ".join(dict.fromkeys(n for n in notes if n)) or None

    short = sorted((p for p in pieces if p.timed_out or p.crashed or p.stop_note), key=lambda p: not p.timed_out)
    first = (short or list(pieces))[0]  # a timed-out piece's, where one is: the log `note()` names
    return GateRuns(tuple(o for p in pieces for o in p.outcomes), timed_out=any(p.timed_out for p in pieces),
                    crashed=joined(p.crashed for p in pieces), seconds=max(p.seconds for p in pieces),
                    log=first.log, waited=sum(p.waited for p in pieces),
                    timeout_note=joined(p.timeout_note for p in pieces), stop_note=joined(p.stop_note for p in pieces),
                    facts=first.facts)


@dataclass(frozen=True)
class Baseline:
    """The unperturbed tree's run: every gate must pass before a perturbation proves anything."""

    gates: int
    red: tuple[GateRecord, ...]
    seconds: float
    arch: str | None
    device: str | None
    log: str | None
    note: str | None = None

    @classmethod
    def of(cls, run: GateRuns) -> "Baseline":
        note = run.note()
        if note is None and not run.records:
            note = f"the baseline ran no gate{': ' + run.stop_note if run.stop_note else ''}; see {run.log}"
        facts = run.facts or {}
        return cls(len(run.records), run.red, run.seconds, facts.get("arch"), facts.get("device"), run.log, note)

    @property
    def ok(self) -> bool:
        return not self.red and self.note is None and self.gates > 0

    def lines(self) -> list[str]:
        """What a red baseline says, for the terminal: what ran, why, which gates went red."""
        head = (f"the unperturbed gates must pass before a perturbation proves anything ({self.gates} gates ran; "
                f"log {self.log})")
        red = (f"  {r.nodeid}: {r.outcome} by {r.route}: {r.first_failure_line or ''}" for r in self.red)
        return [head, *([self.note] if self.note else []), *red]


@dataclass(kw_only=True)
class CampaignRun:
    """What every campaign returns: the kernel root it perturbed, the arch, the baseline (None
    where none ran) and the wall time; each campaign adds its perturbations' results."""

    kernel_root: Path
    arch: str | None
    baseline: Baseline | None
    seconds: float

    @property
    def baseline_red(self) -> bool:
        """A baseline ran and was red: nothing over it proves anything."""
        return self.baseline is not None and not self.baseline.ok


@dataclass(frozen=True)
class GatePlan:
    """What the campaign knows of each gate from the baseline, for an executor that watches
    each gate (the warm one): its own deadline, and how faults and traps are expected."""

    gate_deadlines: dict[str, float] | None = None  # {nodeid: seconds}; None: only the run's deadline
    memory_safety: frozenset[str] = frozenset()  # gates written for memory safety: run even past the fault cap
    names_faults: frozenset[str] = frozenset()  # gates that fail by their own assertion when a guard fires
    trap_gates: frozenset[str] = frozenset()  # gates that expect a trap: last, each in a worker of its own


class Executor(Protocol):
    """Runs a perturbed tree's gates. The campaigns call nothing else of it. A class may
    subclass it to take these defaults: a batch a call, no per-gate watch, no trap shadow."""

    per_gate: bool = False  # True: give me one gate a call (I am cheap per call); False: a batch
    one_call: bool = False  # True: give me all of a mutant's gates at once; I stop at the first kill myself
    start_seconds: float = 0.0  # what a call costs before its first gate: added to a mutant's deadline
    gate_deadlines: dict[str, float] | None = None  # from `arm`; None: no gate has a deadline of its own
    trap_gates: frozenset[str] = frozenset()  # from `arm`: the trap gates this executor runs

    def arm(self, plan: GatePlan) -> None:
        """Take what the baseline says of each gate; an executor that cannot use it ignores it."""

    def check_trap_shadow(self, kernel_root: Path) -> dict[str, str | None]:
        """{trap gate: None when it may run in the trap shadow, else why not}; empty when this
        executor has no trap shadow."""
        return {}

    def run(self, mutant_sandbox: Path, gates: Sequence[str], deadline: float) -> GateRuns: ...

    def close(self) -> None:
        """End every worker or process this executor started (an interrupt, the campaign's end)."""


class ExecutorFactory(Protocol):
    """Makes a campaign slot's executor (a slot on `device`, a CUDA_VISIBLE_DEVICES entry, or
    None for the default GPU); may start executors ahead, while the baseline runs."""

    def __call__(self, report_dir: Path, cache_dir: Path, arch: str | None,
                 device: str | None = None) -> Executor: ...

    def prestart(self, cache_dir: Path, arch: str | None,
                 devices: Sequence[str | None]) -> threading.Thread | None:
        """Start these GPUs' executors in a thread (returned); None when nothing starts ahead."""
        return None

    def cpu_map(self) -> Callable | None:
        """Where a campaign's CPU work (the mutation screen's compiles) runs when not on this
        host: a function (fn, items, on_done) calling `on_done(fn(item, shipped))` for each
        item on the executors' machines (`harness.runs.cluster.Cluster.cpu_map`); None: here."""
        return None


@dataclass(frozen=True)
class Executors(ExecutorFactory):
    """An executor factory made of a function (report_dir, cache_dir, arch, device) -> Executor."""

    make: Callable[..., Executor]

    def __call__(self, report_dir: Path, cache_dir: Path, arch: str | None, device: str | None = None) -> Executor:
        return self.make(report_dir, cache_dir, arch, device)
