"""`--compare-to REF`: did this change move any bits against REF, on every input the gates use?

REF is a git revision of the repository holding the kernel root, or a folder holding a kernel
tree. Its kernel tree is materialised in a temporary folder (the working tree and the index
are only read) and removed on every way out. Every selected gate then runs over REF's tree and
over today's, through the run layer's executor (warm workers where a device is, a fresh
pytest otherwise) on the run's lanes, both sides at once (`work`), with its arm outputs
(`harness.library.arms`) written per side; each arm of the two sides is compared bit for bit.
The report says per gate and arm: `same bits`, or `differs` with the count, the first
difference and the distances in ULPs, or `only in REF` / `only today` / `not comparable`; and
each side's verdict of the gate. Red when an arm differs, unless `--compare-allow-differ`.

The ordinary tests of the run (not gates) run once, here, as without the option; the gates
run only on the two sides. Modules: `tree` (REF's kernel tree), `work` (the sides through the
lanes), `sides` (what each side gave), `arms` (the arms compared), `report` (the table and the
report files).
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from harness.core.child import ARMS_OUT_CHANNEL, COMPARE_TIMING_CHANNEL, LAUNCHERS_OF_CHANNEL
from harness.core.errors import as_pytest_usage
from harness.core.kinds import kinds_of
from harness.core.usage import UsageError
from harness.library.timing import DEFAULT_REPEAT, DEFAULT_WARMUP

if TYPE_CHECKING:  # the comparison's own modules load only in a run that compares
    from harness.plugin.compare.arms import GateComparison
    from harness.plugin.compare.sides import Side


def repeat_value(text: str) -> int:
    """argparse type for --compare-repeat: a count of timed launches of at least 1."""
    try:
        repeat = int(text)
    except ValueError:
        repeat = None
    if repeat is None or repeat < 1:
        shown = repr(text) if repeat is None else text
        raise argparse.ArgumentTypeError(f"--compare-repeat {shown}: give a count of timed launches of at least 1 "
                                         f"(default {DEFAULT_REPEAT})")
    return repeat


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("harness")
    group.addoption("--compare-to", default=None, metavar="REF",
                    help="run every selected gate over REF's kernel tree (a git revision, or a folder) and over "
                         "today's, and compare every arm output bit for bit (docs/regression.md)")
    group.addoption("--compare-allow-differ", action="store_true", default=False,
                    help="with --compare-to: report arms that differ without failing the run (a study run)")
    group.addoption("--compare-timing", action="store_true", default=False,
                    help="with --compare-to: time each kernel launch of the gates on both sides with CUDA events "
                         "(warm-up, then the median and spread of --compare-repeat launches)")
    group.addoption("--compare-repeat", type=repeat_value, default=None, metavar="N",
                    help=f"with --compare-timing: timed launches of each kernel launch (default {DEFAULT_REPEAT})")


def pytest_configure(config: pytest.Config) -> None:
    """Options that belong to a comparison, and a comparison's own, checked before collection:
    one line naming the fix."""
    ref = config.getoption("compare_to", None)
    if ref is None:
        for flag, given in (("--compare-allow-differ", config.getoption("compare_allow_differ", False)),
                            ("--compare-timing", config.getoption("compare_timing", False)),
                            ("--compare-repeat", config.getoption("compare_repeat", None) is not None)):
            if given:
                raise pytest.UsageError(f"{flag} belongs to a comparison: add --compare-to REF (a git revision, "
                                        "or a folder holding the old kernel tree)")
        return
    problem = usage_problem(config, ref)
    if problem:
        raise as_pytest_usage(problem)


def usage_problem(config: pytest.Config, ref: str) -> str | None:
    """What is wrong with this comparison's options, or None."""
    if not ref.strip():
        return ("--compare-to needs a REF: a git revision (main, HEAD~1, a tag, a SHA) or a folder holding the old "
                "kernel tree")
    if getattr(config.option, "numprocesses", None) or getattr(config.option, "dist", "no") != "no":
        return ("--compare-to runs the gates itself, each tree's in processes of its own: drop -n/--dist (xdist), "
                "or pass -n 0")
    if config.getoption("snapshot_update", False):
        return ("--snapshot-update stores today's arms, --compare-to compares two trees' arms: run them one after "
                "the other (the comparison first)")
    for flag, given in (("--sanitize", config.getoption("sanitize", None)),
                        ("--harness-real-traps", config.getoption("harness_real_traps", False)),
                        ("--harness-wait-hung", config.getoption("harness_wait_hung", False))):
        if given:
            return f"{flag} does not reach the runs --compare-to starts: run the gates with it without --compare-to"
    if config.getoption("include_dir", None):
        return ("--include-dir does not reach the runs --compare-to starts: name the folders in the ini key "
                "harness_include_dirs, which they read")
    repeat = config.getoption("compare_repeat", None)
    if repeat is not None and not config.getoption("compare_timing", False):
        return (f"--compare-repeat {repeat} is the count of timed launches --compare-timing makes: add "
                "--compare-timing, or drop --compare-repeat")
    if config.getoption("harness_serve", False):
        return None
    from harness.core import settings as _settings
    from harness.core.usage import writable_problem
    from harness.plugin.compare.tree import ref_problem

    report_dir = config.getoption("harness_report", None) or _settings.report_root(config.rootpath)
    unwritable = writable_problem(report_dir)
    if unwritable:
        return (f"--compare-to writes compare.json and compare.md to {report_dir}, which cannot be made: {unwritable}; "
                "pass --harness-report DIR naming a folder you can write to")
    return ref_problem(ref, _settings.in_effect().kernel_root)


def pytest_collection_finish(session: pytest.Session) -> None:
    """A side of a comparison run as a fresh pytest over another kernel tree: its launchers are
    that tree's (`harness.library.ref_launchers`)."""
    if os.environ.get(LAUNCHERS_OF_CHANNEL):
        from harness.core import settings as _settings
        from harness.library import ref_launchers

        try:
            ref_launchers.use(_settings.in_effect().kernel_root, session.config.rootpath)
        except ref_launchers.LauncherImportError as exc:
            raise pytest.UsageError(str(exc)) from None


# ---------------------------------------------------------------- the run


def pytest_harness_takes_gates(config: pytest.Config) -> bool | None:
    """With --compare-to the gates run in the comparison's own workers: the run's pool only
    probes the device and claims the run's lanes."""
    return True if config.getoption("compare_to", None) else None


def pytest_harness_gate_loop(session: pytest.Session, run, device_ready: bool, lanes: int):
    """With --compare-to, the run's gates are this feature's: pytest's own loop runs the
    ordinary tests, once, as without the option (the plugin's loop withholds the gates from
    it); then `loop` runs the gates on both sides, on the run's `lanes`, and compares them."""
    ref = session.config.getoption("compare_to", None)
    if not ref:
        return None

    def loop(gates: list[pytest.Item], others: int) -> None:
        config = session.config
        if not gates:
            ran = f" ({others} other test(s) ran as without --compare-to)" if others else ""
            _say(config, [f"compare to {ref}: no gate selected, nothing compared{ran}"])
            return
        from harness.plugin.compare.sides import report_today

        found = compare(session, run, device_ready, lanes, ref, gates)
        report_today(gates, found.today, {g.nodeid: g for g in found.gates}, found.unrun)
        if not config.getoption("compare_allow_differ"):
            session.testsfailed += sum(1 for g in found.gates if g.differs)
    return loop


def _say(config: pytest.Config, lines: list[str]) -> None:
    tr = config.pluginmanager.get_plugin("terminalreporter")
    for line in lines:
        (tr.write_line(line) if tr is not None else print(line))


def _executors(run, device_ready: bool, config, gates: list[str], kernel_root: Path, jobs: int,
               traps: frozenset = frozenset()):
    """The sides' executor factory: warm workers on the device, shared by `jobs` slots (a spare
    for each, and two more), else a fresh pytest a work item. Over several lanes the server
    does not run the structural gates before it forks: a side's run once, spread over the
    lanes, and the server's run would hold back every worker's start. The trap gates (`traps`)
    run in the trap shadow on both sides, as a gate run judges them by default: each counts
    its guards in its lane's worker, where a real trap would cost a fresh CUDA context a gate
    a side (`--harness-real-traps` does not reach a comparison)."""
    from harness.runs.fresh import FreshExecutors
    from harness.runs.warm import WarmExecutors

    files = sorted({g.split("::", 1)[0] for g in gates})
    if device_ready:
        return WarmExecutors(config.rootpath, tuple(files), kernel_root, jobs, stop_on_kill=False, spares=jobs + 2,
                             warm_structural=jobs == 1, shadow_traps=frozenset(traps))
    return FreshExecutors(config.rootpath, require_gpu=run.require_gpu)


def absent_at(ref_root: Path, gates: list[pytest.Item]) -> frozenset[str]:
    """The compile items whose `.cu` REF's tree does not hold (a kernel file new today)."""
    return frozenset(it.nodeid for it in gates if getattr(it, "kernel_file", None) is not None
                     and not (ref_root / it.kernel_file).is_file())


@dataclass(frozen=True)
class Comparison:
    gates: list[GateComparison]  # each gate's arms, REF's against today's
    today: Side  # today's run: the gates' own verdicts
    unrun: dict[str, str]  # {gate: why it was not compared}: a side gave no verdict for it


def compare(session: pytest.Session, run, device_ready: bool, lanes: int, ref: str,
            items: list[pytest.Item]) -> Comparison:
    """Run the gates over REF's tree and today's, both sides through the run's `lanes` at once
    (`work`), compare their arms, write the reports and say what was found. A warm executor
    starts while REF's tree is materialised; the temporary folders (REF's tree, the arm
    outputs, the sides' runs) go on every way out."""
    from harness.core import settings as _settings
    from harness.plugin.compare.report import table, write_reports
    from harness.plugin.compare.sides import compare_gate, not_compared, not_compared_lines, settle
    from harness.plugin.compare.tree import check_launchers, kernel_tree_at
    from harness.plugin.compare.work import gates_of, lanes_line, run_facts, run_items, work_items
    from harness.plugin.snapshots import side_folder
    from harness.pool.lanes import TIMES_FILE, GateTimes

    config = session.config
    kinds = {item.nodeid: kinds_of(item) for item in items}
    gates = list(kinds)
    today = run.settings.kernel_root
    report_dir = Path(run.report_dir or _settings.report_root(config.rootpath))
    timed = f"{config.getoption('compare_repeat') or DEFAULT_REPEAT},{DEFAULT_WARMUP}" \
        if config.getoption("compare_timing") else None
    times = GateTimes(run.settings.cache_dir / TIMES_FILE)  # the plain run's record, read only: the split's hint
    out = Path(tempfile.mkdtemp(prefix="harness-arms-"))
    previous = {k: os.environ.get(k) for k in (ARMS_OUT_CHANNEL, LAUNCHERS_OF_CHANNEL, COMPARE_TIMING_CHANNEL)}
    os.environ[ARMS_OUT_CHANNEL] = str(out)
    os.environ[LAUNCHERS_OF_CHANNEL] = str(today)
    os.environ.pop(COMPARE_TIMING_CHANNEL, None)
    if timed:
        os.environ[COMPARE_TIMING_CHANNEL] = timed
    try:
        # one executor for both sides and every lane: a warm one's workers serve REF's gates and today's
        traps = frozenset(g for g in gates if "trap" in (kinds[g] or ()))
        factory = _executors(run, device_ready, config, gates, today, lanes, traps)
        executor = factory(out / "runs", run.settings.cache_dir, run.settings.arch)
        ahead = factory.prestart(run.settings.cache_dir, run.settings.arch, [None])
        try:
            with kernel_tree_at(ref, today) as ref_root:
                check_launchers(ref, today, ref_root, config.rootpath)
                absent = absent_at(ref_root, items)
                given = {"ref": [g for g in gates if g not in absent], "today": gates}
                todo = work_items({side: gates_of(ids, kinds, times) for side, ids in given.items()}, lanes)
                roots = {"ref": ref_root, "today": today}
                started = time.monotonic()
                pieces = run_items(executor, todo, roots, lanes,
                                   lambda item: max(60.0, run.settings.deadline * len(item.gates)))
                ran = run_facts(todo, pieces, lanes, time.monotonic() - started, executor)
                sides = {"ref": settle("REF", pieces["ref"], absent, report_dir, config.rootpath),
                         "today": settle("today", pieces["today"], frozenset(), report_dir, config.rootpath)}
                folders = {side: side_folder(out, root) for side, root in roots.items()}
                result = [compare_gate(g, (kinds[g] or [""])[0], folders, sides) for g in gates]
        finally:
            executor.close()
            if ahead is not None:
                ahead.join()  # a start under way ends with the close: nothing of it outlives the run
    except UsageError as exc:
        raise as_pytest_usage(exc) from None
    finally:
        for k, v in previous.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(out, ignore_errors=True)
    write_reports(report_dir, ref, result, ran)
    unrun = not_compared(gates, sides)
    _say(config, [lanes_line(ref, todo, lanes, bool(timed))] + table(ref, result) + not_compared_lines(unrun))
    return Comparison(result, sides["today"], unrun)
