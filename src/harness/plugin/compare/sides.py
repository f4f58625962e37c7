"""A comparison's two sides: what each run of the gates gave (`Side`, put together from the
`Piece`s its lanes gave), each gate's verdict on a side in words, the gates a side gave no
verdict for and why (in the words of the lane that held them, its log kept in the report
folder), and each gate's report: today's verdict, with what the comparison found."""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from harness.plugin.compare.arms import GateComparison, compare_sides, compare_timing, read_launches, read_side
from harness.plugin.compare.report import arm_text
from harness.runs.result import GateRuns, merged

NOT_IN_REF = "not in REF (new today)"  # a gate REF's tree has no file for: a .cu added today
# In the report folder: a side's log, kept only where it gave no verdict for a gate; one for
# each lane that did, where several did.
LOG = "compare-{side}.log"
LANE_LOG = "compare-{side}-lane{lane}.log"


@dataclass(frozen=True)
class Piece:
    """What one lane of a side gave: the gates it was given and the executor's run of them."""

    lane: int  # from 0
    gates: tuple[str, ...]
    run: GateRuns

    def silent(self) -> list[str]:
        """Its gates it gave no verdict for."""
        records = self.run.records
        return [g for g in self.gates if g not in records]


@dataclass(frozen=True)
class Side:
    name: str  # "REF" or "today"
    run: GateRuns  # its lanes' runs, merged (`harness.runs.result.merged`)
    absent: frozenset[str] = frozenset()  # gates not run on this side: it has no file for them
    # {gate: why it gave no verdict for it}: its lane's note, or its pytest's own words
    why: dict[str, str] = field(default_factory=dict)

    def outcome(self, nodeid: str) -> str:
        """The side's verdict of a gate in words: `passed`, `failed by assertion`, `not run (why)`."""
        if nodeid in self.absent:
            return NOT_IN_REF
        rec = self.run.records.get(nodeid)
        if rec is None:
            why = self.why.get(nodeid)
            return "not run" + (f" ({why})" if why else "")
        return rec.outcome + (f" by {rec.route}" if rec.red else "")

    def silent(self, gates: list[str]) -> list[str]:
        """The gates this side was given and gave no verdict for."""
        return [g for g in gates if g not in self.absent and g not in self.run.records]


def own_words(log: str | None, last: bool = True) -> str | None:
    """The line a side's pytest gave when it stopped short: its first `ERROR:` line (a usage
    error, a node id not found), else its first `E ` line, else (`last`) its last line."""
    try:
        lines = [x.strip() for x in Path(log).read_text(errors="replace").splitlines()
                 if x.strip() and not x.startswith("$ ")]
    except (OSError, TypeError):
        return None
    for prefix in ("ERROR:", "E "):
        hit = next((x for x in lines if x.startswith(prefix)), None)
        if hit:
            return hit
    return lines[-1] if lines and last else None


def settle(name: str, pieces: list[Piece], absent: frozenset[str], report_dir: Path, rootdir: Path) -> Side:
    """One side, from what its lanes gave: for each gate a lane gave no verdict for, why, in that
    lane's words (its note: a deadline, a death; or its pytest's own words) and its log, kept in
    the report folder (it lives in a temporary folder with the rest of the run). Stale logs of
    that side from an earlier run go."""
    key = "ref" if name == "REF" else name
    for pattern in (LOG.format(side=key), LANE_LOG.format(side=key, lane="*")):
        for stale in Path(report_dir).glob(pattern):
            stale.unlink(missing_ok=True)
    short = [p for p in pieces if p.silent()]
    why: dict[str, str] = {}
    for piece in short:
        kept = Path(report_dir) / (LOG.format(side=key) if len(short) == 1 else
                                   LANE_LOG.format(side=key, lane=piece.lane + 1))
        words = lane_words(piece.run, kept, rootdir)
        own = {o.nodeid: o.first_failure_line for o in piece.run.outcomes if o.first_failure_line}
        for gate in piece.silent():  # a gate's own line first, where its worker gave one (not collected there)
            said = "; ".join(x for x in (own.get(gate), words) if x)
            if said:
                why[gate] = said
    return Side(name, merged([p.run for p in pieces]), absent, why)


def lane_words(run: GateRuns, kept: Path, rootdir: Path) -> str | None:
    """Why a lane's run gave no verdict for some of its gates: its note (a deadline, with the
    gate that ran past it; a death; an executor that stopped), or its pytest's own words, and
    its log, copied to `kept`."""
    from harness.plugin.snapshots import shown_path

    note = run.note() or run.stop_note
    if note:
        note = note.replace(f"; see {run.log}", "")  # the log is named below, where it is kept
        if run.timed_out and run.timeout_note:
            note += f": {run.timeout_note}"
    said = own_words(run.log, last=not note) if not run.timed_out else None
    if said and note and said.removeprefix("ERROR: ").strip() in note:
        said = None  # the run's note quotes it already (a pytest that refused its arguments)
    words = [x for x in (note, f"its pytest said: {said}" if said else None) if x]
    if run.log and Path(run.log).is_file():
        kept.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(run.log, kept)
        words.append(f"its log: {shown_path(kept, rootdir)}")
    return "; ".join(words) or None


def compare_gate(nodeid: str, kind: str, folders: dict[str, Path], sides: dict[str, Side]) -> GateComparison:
    """One gate's arms, launches and timings, REF's side against today's."""
    gate = compare_sides(nodeid, read_side(folders["ref"], nodeid), read_side(folders["today"], nodeid),
                         sides["ref"].outcome(nodeid), sides["today"].outcome(nodeid))
    gate.kind = kind
    launches = {key: read_launches(folders[key], nodeid) for key in ("ref", "today")}
    gate.launches = {key: launches[key]["launches"] for key in launches}
    gate.timing, gate.timing_notes = compare_timing(launches["ref"]["timed"], launches["today"]["timed"])
    gate.timing_notes += [f"{key}: {n}" for key in launches for n in launches[key]["notes"]]
    return gate


def not_compared(gates: list[str], sides: dict[str, Side]) -> dict[str, str]:
    """{gate: why} for each gate that a side gave no verdict (its process died, its deadline,
    an executor that lost it): nothing was compared for it, so it is red, never left out."""
    out = {}
    for g in gates:
        missing = [f"{side.name} gave no verdict: {side.outcome(g)}" for side in sides.values() if g in side.silent([g])]
        if missing:
            out[g] = "not compared: " + "; ".join(missing)
    return out


def not_compared_lines(unrun: dict[str, str]) -> list[str]:
    if not unrun:
        return []
    return [f"{len(unrun)} gate(s) not compared, each red: a side gave no verdict for it"] + \
        [f"  {g}: {why}" for g, why in unrun.items()]


def report_today(items: list[pytest.Item], today: Side, compared: dict, unrun: dict[str, str]) -> None:
    """Each gate's report is today's verdict, with what the comparison found as properties
    (`compare <arm>`: JUnit, gates.json): the summary, pytest's counts and the require-gpu rule
    read them as those of any run. A gate a side gave no verdict for (`unrun`) is red."""
    from harness.core.gate_reports import synthetic
    from harness.core.records import Outcome

    for item in items:
        rec = today.run.records.get(item.nodeid)
        if rec is None and item.nodeid not in unrun:
            continue
        gate = compared.get(item.nodeid)
        props = [(f"compare {a.arm}", arm_text(a)) for a in (gate.arms if gate else [])]
        if item.nodeid in unrun:
            why = unrun[item.nodeid]
            if rec is not None and rec.red:  # REF gave none; today's own failure is kept beside it
                why += f"; today {today.outcome(item.nodeid)}: {rec.first_failure_line or 'red'}"
            props += [("route", "error"), ("first_failure_line", why)]
            outcome, longrepr, message = Outcome.FAILED.value, why, why
        else:
            if rec.red:
                props += [("route", str(rec.route or "error")), ("first_failure_line", rec.first_failure_line or "")]
                longrepr = rec.failure_message or rec.first_failure_line or "red"
            elif rec.outcome == Outcome.SKIPPED:
                longrepr = (str(item.path), item.location[1] or 0, f"Skipped: {rec.skip_reason or 'skipped today'}")
            else:
                longrepr = None
            outcome, message = (Outcome.FAILED.value if rec.red else str(rec.outcome)), rec.failure_message
        item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
        for report in synthetic(item, outcome, longrepr, props, duration=rec.duration if rec is not None else 0.0,
                                message=message):
            item.ihook.pytest_runtest_logreport(report=report)
        item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
