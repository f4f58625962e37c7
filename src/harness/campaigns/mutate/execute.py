"""The GPU stage of a mutant: run its selected gates on an executor (`harness.runs`) and turn
their records into a verdict."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from harness.campaigns.mutate.verdicts import Verdict
from harness.core.records import Outcome, Route
from harness.runs.result import Executor, GateRuns


@dataclass(frozen=True)
class Judgement:
    """A mutant's verdict over the runs of its gates, why, and where its time went."""

    verdict: Verdict
    reason: str
    killed_by: tuple[str, ...]
    gates_run: tuple[str, ...]
    seconds: float
    memory_safety: bool = False  # killed-by-trap in a gate written for that memory-safety property
    in_gates: float = 0.0  # of `seconds`, inside the gates themselves (setup, call, teardown)
    waited: float = 0.0  # of `seconds`, waiting for a worker
    ran_on: dict | None = None  # the node and GPU of its last run, where an executor says (a cluster's)


def judge(runs: list[GateRuns], memory_safety: frozenset[str] = frozenset()) -> Judgement:
    """The verdict over every batch a mutant ran: killed if any gate went red by its own
    assertion; else timeout if a run hit the deadline; else killed-by-trap if anything went
    red (a trap, a fault, a launch failure, a crash); else survived."""
    import dataclasses

    outcomes = [o for r in runs for o in r.outcomes]
    seconds = sum(r.seconds for r in runs)
    timing = {"in_gates": sum(o.duration for o in outcomes), "waited": sum(r.waited for r in runs),
              "ran_on": next((r.facts["ran_on"] for r in reversed(runs) if (r.facts or {}).get("ran_on")), None)}
    return dataclasses.replace(_judge(runs, outcomes, seconds, memory_safety), **timing)


def _judge(runs: list[GateRuns], outcomes: list, seconds: float, memory_safety: frozenset[str]) -> Judgement:
    ran = tuple(o.nodeid for o in outcomes if o.outcome != Outcome.NOT_RUN)
    assertion = [o for o in outcomes if o.red and o.route == Route.ASSERTION]
    if assertion:
        return Judgement(Verdict.KILLED, f"{assertion[0].nodeid}: {assertion[0].first_failure_line or ''}".strip(),
                         tuple(o.nodeid for o in assertion), ran, seconds)
    if any(r.timed_out for r in runs) or any(o.red and o.route == Route.TIMEOUT for o in outcomes):
        notes = [r.timeout_note for r in runs if r.timed_out and r.timeout_note]
        return Judgement(Verdict.TIMEOUT, "the gate run hit the deadline" + (f": {notes[0]}" if notes else ""),
                         (), ran, seconds)
    red = [o for o in outcomes if o.red]
    if red:
        safe = [o for o in red if o.nodeid in memory_safety]
        o = (safe or red)[0]
        what = "killed by a fault in a memory-safety gate" if safe else "killed by a trap only"
        stops = [r.stop_note for r in runs if r.stop_note]
        return Judgement(Verdict.KILLED_BY_TRAP, f"{what}: {o.nodeid} red by {o.route or 'error'}: "
                         f"{o.first_failure_line or ''}".strip() + (f"; {stops[0]}" if stops else ""),
                         tuple(x.nodeid for x in red), ran, seconds, memory_safety=bool(safe))
    crashed = [r.crashed for r in runs if r.crashed]
    if crashed:
        return Judgement(Verdict.KILLED_BY_TRAP, f"killed by a trap only: {crashed[0]}", (), ran, seconds)
    not_passed = [o for o in outcomes if o.outcome != Outcome.PASSED]
    if not_passed and len(not_passed) == len(outcomes):
        return Judgement(Verdict.SURVIVED, f"no selected gate passed or failed ({not_passed[0].outcome}): "
                         "run with --require-gpu on a device", (), ran, seconds)
    passed = sum(1 for o in outcomes if o.outcome == Outcome.PASSED)
    if not_passed:  # a survivor some of whose selected gates never judged it: say which
        first = not_passed[0]
        return Judgement(Verdict.SURVIVED, f"{passed} gate(s) stayed green; {len(not_passed)} selected gate(s) "
                         f"neither passed nor failed (first: {first.nodeid}, {first.outcome})", (), ran, seconds)
    return Judgement(Verdict.SURVIVED, f"{passed} gate(s) stayed green", (), ran, seconds)


def run_mutant(executor: Executor, sandbox: Path, batches: list[tuple[str, ...]], deadline: float,
               all_gates: bool, memory_safety: frozenset[str] = frozenset()) -> Judgement:
    """Run the batches in order until one kills (unless `all_gates`), within `deadline`: the
    mutant's own gate time. What the executor reports it spent waiting for a worker (the
    warm one's `waited`) is the campaign's cost, not the mutant's, and is not counted: a
    mutant kept waiting for fresh workers must not reach its later gates past the deadline."""
    start = time.perf_counter()
    if executor.per_gate:
        batches = [(g,) for b in batches for g in b]
    elif all_gates or executor.one_call:
        batches = [tuple(g for b in batches for g in b)]
    runs: list[GateRuns] = []
    for batch in batches:
        if not batch:
            continue
        left = deadline - (time.perf_counter() - start - sum(r.waited for r in runs))
        if left <= 0:
            runs.append(GateRuns((), timed_out=True))
            break
        runs.append(executor.run(sandbox, batch, left))
        j = judge(runs, memory_safety)
        if not all_gates and (j.verdict in (Verdict.KILLED, Verdict.TIMEOUT) or j.memory_safety):
            break
    return judge(runs, memory_safety)
