"""The terminal summary: a rich table of gates by kind and outcome, the red gates with
their routes, and the banners that say when a run proves nothing."""

from __future__ import annotations

import io

from harness.core.kinds import KINDS
from harness.core.records import Outcome, Route
from harness.plugin.report import GateRecord, summarize

OUTCOMES = (Outcome.PASSED, Outcome.FAILED, Outcome.ERROR, Outcome.SKIPPED)
STYLE = {Outcome.PASSED: "green", Outcome.FAILED: "bold red", Outcome.ERROR: "bold red", Outcome.SKIPPED: "yellow"}


def _console(terminalreporter):
    from rich.console import Console

    width = getattr(getattr(terminalreporter, "_tw", None), "fullwidth", 100)
    buf = io.StringIO()
    markup = bool(getattr(terminalreporter, "hasmarkup", False))
    return Console(file=buf, width=width, force_terminal=markup, no_color=not markup,
                   color_system="standard" if markup else None, highlight=False), buf


def banner_lines(records: list[GateRecord], require_gpu: bool, no_gpu_executed: bool) -> list[str]:
    s = summarize(records)
    lines = []
    if s["gpu_skipped"] and not require_gpu:
        lines.append(
            f"{s['gpu_skipped']} GPU gates were SKIPPED (no usable CUDA device): this run proves "
            "nothing about the kernels. Run with --require-gpu on a machine with a GPU."
        )
    if no_gpu_executed:
        lines.append("--require-gpu: no GPU gate was executed, so this run fails: select gates marked gpu")
    return lines


def others_line(others: dict) -> str | None:
    """The ordinary tests (not gates) of the run, counted apart: the harness ran them as
    plain pytest does and checked nothing of theirs."""
    if not others:
        return None
    outcomes = [r.outcome for r in others.values()]
    counts = [f"{outcomes.count(k)} {k}" for k in OUTCOMES if k in outcomes]
    return f"{len(others)} other test(s), not gates (run as plain pytest runs them): {', '.join(counts)}"


def trap_line(records: list[GateRecord]) -> str | None:
    """How the run's trap gates were settled: in the trap shadow (their guards counted, no
    trap: harness.compiling.trap_shadow) or by a real trap, and why the shadow left any to a real one."""
    traps = [r for r in records if r.kind == "trap" and r.isolated and r.outcome != Outcome.SKIPPED]
    shadowed = [r for r in traps if r.trap_shadow_hits]
    if not shadowed and not any(r.trap_shadow_unsettled for r in traps):
        return None
    line = (f"trap gates: {len(shadowed)} of {len(traps)} passed in the trap shadow (their guards counted, no trap; "
            "--harness-real-traps traps each for real)")
    unsettled = [f"{r.nodeid} ({r.trap_shadow_unsettled})" for r in traps if r.trap_shadow_unsettled]
    return line + (f"; trapped for real: {'; '.join(unsettled)}" if unsettled else "")


def render_summary(terminalreporter, run, recorder) -> None:
    """The harness's part of pytest's terminal summary, from the run (`harness.plugin.state.
    HarnessRun`) and what its recorder folded (`harness.plugin.verdicts.Recorder`)."""
    records = list(recorder.records.values())
    for note in run.notes:
        terminalreporter.write_line(note)
    others = others_line(recorder.others)
    if not records:
        if others:
            terminalreporter.write_sep("=", "harness")
            terminalreporter.write_line(f"no gates ran; {others}")
        return
    from rich.table import Table

    console, buf = _console(terminalreporter)
    table = Table(title="harness: gates by kind", title_justify="left")
    table.add_column("kind")
    for o in OUTCOMES:
        table.add_column(o.value, justify="right")
    for kind in (*KINDS, None):
        rows = [r for r in records if r.kind == kind]
        if not rows:
            continue
        cells = []
        for o in OUTCOMES:
            n = sum(1 for r in rows if r.outcome == o)
            cells.append(f"[{STYLE[o]}]{n}[/]" if n else "0")
        table.add_row(kind or "other", *cells)
    console.print(table)
    if others:
        console.print(others)
    red = [r for r in records if r.red]
    if red:
        t = Table(title="red gates", title_justify="left")
        t.add_column("gate", overflow="fold")
        t.add_column("route")
        t.add_column("first failure line", overflow="fold")
        for r in red:
            t.add_row(r.nodeid, r.route or "", r.first_failure_line or "")
        console.print(t)
    if recorder.poisoned_by:
        console.print(f"[bold red]{recorder.poisoned_by} poisoned the CUDA context[/]; its worker process was replaced, "
                      "so later GPU gates' verdicts are their own.")
    timeouts = [r for r in records if r.route == Route.TIMEOUT]
    if timeouts:
        console.print(f"[bold red]{len(timeouts)} GPU gate(s) ran past their deadline[/]; each one's worker was "
                      "killed and replaced, and every other gate kept its own verdict.")
    traps = trap_line(records)
    if traps:
        console.print(traps)
    if recorder.gpu.lane_claim is not None:  # its lanes on a machine it may share (harness.pool.share)
        console.print(recorder.gpu.lane_claim.share.line(), markup=False, soft_wrap=True)
    if run.sanitize:
        console.print(f"compute-sanitizer {run.sanitize}: {recorder.sanitizer_findings} gate(s) with findings over "
                      f"{recorder.launches} kernel launches through harness.library.kernels.")
    for line in banner_lines(records, run.require_gpu, recorder.no_gpu_executed):
        console.print(f"[bold yellow on red] harness: {line} [/]" if "SKIPPED" in line else f"[bold red]harness: {line}[/]")
    terminalreporter.write_sep("=", "harness")
    terminalreporter.write(buf.getvalue())
