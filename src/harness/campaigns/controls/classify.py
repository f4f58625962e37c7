"""Verdicts: how each expected gate went red (or did not), and the control's verdict.

Pure functions over the child's gate records, so every rule is testable without pytest.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from harness.campaigns.controls.spec import Expect, Route
from harness.core.records import GateRecord, Outcome
from harness.runs.verdict import Verdict


@dataclass(frozen=True)
class GateCheck:
    """One expected gate: what the control expected and what the run showed."""

    gate: str
    expected_route: Route
    expected_message: str | None
    outcome: str  # passed | failed | error | skipped | not run
    route: str | None  # the observed route when red
    first_failure_line: str | None
    met: bool
    reason: str  # one line saying why it is (not) met


def check_gate(expect: Expect, record: GateRecord | None) -> GateCheck:
    def result(outcome, route, line, met, reason):
        return GateCheck(expect.gate, expect.route, expect.message, outcome, route, line, met, reason)

    if record is None:
        return result(Outcome.NOT_RUN, None, None, False, "the gate did not run: it is missing from the run's gates.json")
    line = record.first_failure_line
    if record.outcome == Outcome.SKIPPED:
        return result(Outcome.SKIPPED, None, None, False, "the gate was skipped: it caught nothing (run with --require-gpu on a device)")
    if not record.red:
        return result(record.outcome, None, None, False, f"the gate {record.outcome}: it does not catch this perturbation")
    route = record.route or Route.ERROR
    if route != expect.route.value:
        return result(record.outcome, route, line, False, f"red by {route}, not by {expect.route.value}")
    if expect.message is not None:
        text = record.failure_message or line or ""
        if expect.message not in text:
            return result(record.outcome, route, line, False, f"red by {route}, but the failure message lacks {expect.message!r}")
    return result(record.outcome, route, line, True, f"red by {route} as expected")


NOT_JUDGED = "not judged here: the gate was skipped (no GPU; --no-require-gpu); run on a device to judge it"


def judged_without_device(checks: tuple[GateCheck, ...]) -> tuple[GateCheck, ...]:
    """A run with no device (--no-require-gpu) skips the GPU gates: such a check says it was
    not judged instead of "caught nothing"; `decide` leaves it out."""
    return tuple(replace(c, reason=NOT_JUDGED) if c.outcome == Outcome.SKIPPED else c for c in checks)


def decide(checks: tuple[GateCheck, ...], device: bool = True) -> tuple[Verdict, bool]:
    """(verdict, whether it is what the control expects) for the checks of one run.

    A control that expects route = "trap" is met by a trap and is reported `guard-only`
    while matching its expectation; every other met control is `proven`. With no device
    (`device` false), skipped gates are not judged: the control is decided by the expected
    gates that ran, and is `skipped` when none did.
    """
    if not device:
        checks = tuple(c for c in checks if c.outcome != Outcome.SKIPPED)
        if not checks:
            return Verdict.SKIPPED, False
    if any(c.outcome in (Outcome.PASSED, Outcome.SKIPPED, Outcome.NOT_RUN) for c in checks):
        return Verdict.SURVIVED, False
    if any(c.route == Route.COMPILE for c in checks):
        return Verdict.COMPILE_ERROR, False
    if any(c.route == Route.TIMEOUT for c in checks):
        return Verdict.TIMEOUT, False
    if all(c.met for c in checks):
        if any(c.expected_route is Route.TRAP for c in checks):
            return Verdict.KILLED_BY_TRAP, True
        return Verdict.KILLED, True
    return Verdict.KILLED_BY_TRAP, False
