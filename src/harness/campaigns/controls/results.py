"""The records a controls campaign produces: one frozen result per control, and the campaign's
(its baseline is the run layer's `Baseline`)."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from pathlib import Path

from harness.campaigns.controls.classify import GateCheck
from harness.campaigns.controls.edits import Edit
from harness.core.records import GateRecord
from harness.runs.result import CampaignRun
from harness.runs.verdict import Verdict


class Expectation(str, enum.Enum):
    """Whether a control's result is what it expects; every output says it in these words."""

    MET = "as expected"
    NOT_MET = "NOT as expected"
    # skipped with no device (--no-require-gpu): counted neither way, and not in the exit status
    NOT_JUDGED = "not judged"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class ControlResult:
    name: str
    description: str
    why: str
    edits: tuple[Edit, ...]
    verdict: Verdict | None  # None: --static, no gate ran
    matches: bool  # the result is what the control expects (static: it applies and compiles)
    checks: tuple[GateCheck, ...]  # expected vs observed, per expected gate
    kill_row: tuple[GateRecord, ...]  # every gate that went red in the run, expected or not
    seconds: float
    compiled: tuple[str, ...] = ()  # the perturbed modules compiled by the compile check
    note: str | None = None  # why invalid / timed out / crashed
    log: Path | None = None  # the child's pytest output
    ran_on: dict | None = None  # on a cluster (--ray): {"node", "node_id", "gpu"} of the run

    @property
    def expectation(self) -> Expectation:
        if self.verdict is Verdict.SKIPPED:
            return Expectation.NOT_JUDGED
        return Expectation.MET if self.matches else Expectation.NOT_MET


@dataclass(kw_only=True)
class CampaignResult(CampaignRun):
    mode: str  # "campaign", "naive" or "static"
    controls: tuple[ControlResult, ...]
    interrupted: bool = False  # Ctrl-C: `controls` are those that finished before it
    selected: int | None = None  # how many controls the campaign was to run (known once validated)

    @property
    def judged(self) -> tuple[ControlResult, ...]:
        """The controls a verdict was reached for: all but those skipped for want of a device."""
        return tuple(c for c in self.controls if c.verdict is not Verdict.SKIPPED)

    @property
    def ok(self) -> bool:
        if self.baseline_red or self.interrupted:
            return False
        return all(c.matches for c in self.judged)
