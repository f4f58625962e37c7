"""One run result for every engine: what an executor did with a perturbed tree's gates, and
the executor protocol every engine calls (a warm pool, a fresh pytest, and any backend that
runs gates elsewhere)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, Sequence

from harness.records import GateRecord


# One gate's result in a mutant's run: the record every engine shares (outcome "not run"
# when the run stopped before it).
GateOutcome = GateRecord


@dataclass(frozen=True)
class GateRuns:
    """What one executor call did."""

    outcomes: tuple[GateOutcome, ...]
    timed_out: bool = False
    crashed: str | None = None  # the process died without a report: why
    seconds: float = 0.0
    log: str | None = None
    waited: float = 0.0  # of `seconds`, waiting for a worker (a warm executor)
    timeout_note: str | None = None  # timed out: which gate was running, the last kernel launched
    stop_note: str | None = None  # why the executor stopped before the gates it was given ran


class Executor(Protocol):
    per_gate: bool  # True: give me one gate a call (I am cheap per call); False: a batch

    def run(self, mutant_sandbox: Path, gates: Sequence[str], deadline: float) -> GateRuns: ...
