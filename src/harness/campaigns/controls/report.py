"""controls.json, controls.md (observed output per control, ready to paste into docs)
and the rich result table."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from harness.campaigns.controls.results import CampaignResult, ControlResult, Expectation
from harness.runs.verdict import Verdict

VERSION = 2  # 2: a skipped control's matches_expectation is null (not judged); the counts


def observed(check) -> str:
    """'failed by assertion', 'passed', 'timeout': the outcome, and the route when it adds one."""
    if check.route and check.route != check.outcome:
        return f"{check.outcome} by {check.route}"
    return check.outcome


@dataclass(frozen=True)
class Shown:
    """A verdict as the controls' outputs show it: its word, and its style on the terminal."""

    word: str
    style: str


# Every shared verdict in the controls' words (a control that kills its gate proves it). The
# mutants' own verdicts never reach a control, but have a word too: no verdict can lack one.
SHOWN = {
    Verdict.KILLED: Shown("proven", "bold green"),
    Verdict.KILLED_BY_TRAP: Shown("guard-only", "yellow"),
    Verdict.TIMEOUT: Shown("timeout", "bold red"),
    Verdict.SURVIVED: Shown("survived", "bold red"),
    Verdict.NO_COVERAGE: Shown("no-coverage", "bold red"),
    Verdict.EQUIVALENT: Shown("equivalent", "yellow"),
    Verdict.DUPLICATE: Shown("duplicate", "yellow"),
    Verdict.COMPILE_ERROR: Shown("invalid", "bold red"),
    Verdict.PENDING: Shown("pending", "yellow"),
    Verdict.SKIPPED: Shown("skipped", "yellow"),
}
STATIC = Shown("applies and compiles", "green")  # --static: no gate ran, the control applies and compiles

# The "as expected" column of the table and of controls.md.
CELL = {Expectation.MET: Shown("yes", ""), Expectation.NOT_MET: Shown("no", "bold red"),
        Expectation.NOT_JUDGED: Shown("not judged", "yellow")}


def word(verdict: Verdict) -> str:
    return SHOWN[verdict].word


def shown(result: ControlResult) -> Shown:
    if result.verdict is None:
        return STATIC if result.matches else SHOWN[Verdict.COMPILE_ERROR]
    return SHOWN[result.verdict]


def verdict_text(result: ControlResult) -> str:
    return shown(result).word


SKIPPED_WHY = ("every gate they expect needs a GPU, and --no-require-gpu ran none; run them on a machine with a "
               "GPU")


def summary(campaign: CampaignResult) -> tuple[str, str | None]:
    """How many of the judged controls were as expected; and the skipped ones, counted apart."""
    judged = campaign.judged
    head = f"{sum(r.matches for r in judged)} of {len(judged)} controls as expected"
    skipped = len(campaign.controls) - len(judged)
    return head, f"{skipped} control(s) skipped, not judged: {SKIPPED_WHY}" if skipped else None


def campaign_json(campaign: CampaignResult) -> dict:
    baseline = None
    if campaign.baseline is not None:
        b = campaign.baseline
        baseline = {
            "ok": b.ok, "gates": b.gates, "seconds": round(b.seconds, 3), "arch": b.arch,
            "device": b.device, "note": b.note, "log": str(b.log) if b.log else None,
            "red": [asdict(r) for r in b.red],
        }
    controls = []
    for r in campaign.controls:
        controls.append({
            "name": r.name,
            "description": r.description,
            "why": r.why,
            "verdict": word(r.verdict) if r.verdict is not None else None,
            "matches_expectation": None if r.expectation is Expectation.NOT_JUDGED else r.matches,
            "seconds": round(r.seconds, 3),
            "edits": [asdict(e) for e in r.edits],
            "compiled": list(r.compiled),
            "expected": [
                {
                    "gate": c.gate,
                    "route": c.expected_route.value,
                    "message": c.expected_message,
                    "observed": {"outcome": c.outcome, "route": c.route, "first_failure_line": c.first_failure_line},
                    "met": c.met,
                    "reason": c.reason,
                }
                for c in r.checks
            ],
            "kill_row": [
                {"gate": k.nodeid, "outcome": k.outcome, "route": k.route, "first_failure_line": k.first_failure_line}
                for k in r.kill_row
            ],
            "note": r.note,
            "log": str(r.log) if r.log else None,
            **({"ran_on": r.ran_on} if r.ran_on else {}),
        })
    return {
        "version": VERSION,
        "mode": campaign.mode,
        "ok": campaign.ok,
        "interrupted": campaign.interrupted,
        "selected": campaign.selected,
        "judged": len(campaign.judged),
        "as_expected": sum(r.matches for r in campaign.judged),
        "skipped": len(campaign.controls) - len(campaign.judged),
        "kernel_root": str(campaign.kernel_root),
        "arch": campaign.arch,
        "seconds": round(campaign.seconds, 3),
        "baseline": baseline,
        "controls": controls,
    }


def _cell(text) -> str:
    return str(text if text is not None else "").replace("|", "\\|").replace("\n", " ")


def _code(text: str) -> str:
    text = _cell(text)
    return f"`` {text} ``" if "`" in text else f"`{text}`"


def campaign_markdown(campaign: CampaignResult) -> str:
    lines = [f"# Negative controls ({campaign.mode})" + (": INTERRUPTED" if campaign.interrupted else ""), ""]
    n = len(campaign.controls)
    if campaign.interrupted:
        of = f" of {campaign.selected}" if campaign.selected is not None else ""
        lines += [f"**This run was interrupted** (Ctrl-C): interrupted after {n}{of} controls; the others did not "
                  "run, and what is below is only what finished before it.", ""]
    head, skipped = summary(campaign)
    lines.append(f"**{head}** in {campaign.seconds:.1f} s; arch {campaign.arch or 'n/a'}; kernel root "
                 f"`{campaign.kernel_root}`.")
    if skipped:
        lines.append(f"{skipped}.")
    b = campaign.baseline
    if b is not None:
        state = "green" if b.ok else "**RED: no control was run**"
        lines += ["", f"Baseline: {b.gates} gates, {state} ({b.seconds:.1f} s, device {b.device or 'none'})."]
        if b.note:
            lines.append(f"> {_cell(b.note)}")
        for r in b.red:
            lines.append(f"- `{r.nodeid}` {r.outcome} by {r.route}: {_cell(r.first_failure_line)}")
    if n:
        lines += ["", "| control | verdict | as expected | seconds |", "| --- | --- | --- | --- |"]
        for r in campaign.controls:
            cell = CELL[r.expectation].word
            cell = f"**{cell}**" if r.expectation is Expectation.NOT_MET else cell
            lines.append(f"| {r.name} | {verdict_text(r)} | {cell} | {r.seconds:.1f} |")
    for r in campaign.controls:
        lines += ["", f"## {r.name}: {verdict_text(r)}", "", _cell(r.description), "", f"Why: {_cell(r.why)}", ""]
        for e in r.edits:
            occ = f" (occurrence {e.occurrence})" if e.occurrence else ""
            kind = "regex " if e.regex else ""
            replaced = _code(e.replace) if e.replace else "(deleted)"
            lines.append(f"- `{e.file}`: {kind}{_code(e.find)}{occ} -> {replaced}")
        if r.note:
            lines += ["", "```text", r.note.rstrip(), "```"]
        if r.checks:
            lines += ["", "| expected gate | expected | observed | first failure line |", "| --- | --- | --- | --- |"]
            for c in r.checks:
                expected = c.expected_route.value + (f" with {_code(c.expected_message)}" if c.expected_message else "")
                mark = "" if c.met else " (**not met**)"
                lines.append(f"| `{c.gate}` | {expected} | {observed(c)}{mark} | {_cell(c.first_failure_line)} |")
        if r.log is not None:
            lines += ["", f"Kill row ({len(r.kill_row)} red):"]
            if r.kill_row:
                lines += ["", "| gate | route | first failure line |", "| --- | --- | --- |"]
                for k in r.kill_row:
                    lines.append(f"| `{k.nodeid}` | {k.route} | {_cell(k.first_failure_line)} |")
            else:
                lines.append("none.")
    return "\n".join(lines) + "\n"


FILES = ("controls.json", "controls.md")


def remove(report_dir: Path) -> None:
    """An earlier run's reports, removed as a run starts: however this one ends, they never
    stand for it."""
    for name in FILES:
        (Path(report_dir) / name).unlink(missing_ok=True)


def write(report_dir: Path, campaign: CampaignResult) -> tuple[Path, Path]:
    report_dir = Path(report_dir)
    report_dir.mkdir(parents=True, exist_ok=True)
    j, m = (report_dir / name for name in FILES)
    j.write_text(json.dumps(campaign_json(campaign), indent=2) + "\n")
    m.write_text(campaign_markdown(campaign))
    return j, m


def table(campaign: CampaignResult):
    """The rich result table; its cells are Text, never markup, so no name or message can break it."""
    from rich.table import Table
    from rich.text import Text

    t = Table(title=f"negative controls ({campaign.mode})", title_justify="left")
    for col, just in (("control", "left"), ("verdict", "left"), ("as expected", "left"),
                      ("expected gate: observed", "left"), ("kill row", "right"), ("s", "right")):
        t.add_column(col, justify=just, overflow="fold")
    for r in campaign.controls:
        verdict, cell = shown(r), CELL[r.expectation]
        detail = Text("\n").join(
            Text.assemble(f"{c.gate.split('::')[-1]}: {observed(c)}", ("" if c.met else (f" ({c.reason})", "red")))
            for c in r.checks
        )
        if r.note and not r.checks:
            detail = Text(r.note.splitlines()[0])
        t.add_row(Text(r.name), Text(verdict.word, style=verdict.style), Text(cell.word, style=cell.style), detail,
                  str(len(r.kill_row)) if r.log is not None else "", f"{r.seconds:.1f}")
    return t
