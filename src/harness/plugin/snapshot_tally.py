"""The line that ends a `--snapshot-update` run (`harness.plugin.snapshots`): how many arms of how many
gates were stored under which `__snapshots__` folders, and why the other gates stored none. A
feature plugin of its own: it reads the reports' `snapshot` property, never the store."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from harness.plugin.snapshots import PROPERTY, SNAPSHOT_DIR, STORED, shown_path
from harness.plugin.state import Role

TALLY = "harness-snapshot-tally"


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("snapshot_update", False) and Role.of(config).reports:  # the process that prints the summary
        config.pluginmanager.register(StoredTally(config.rootpath), TALLY)


def pytest_unconfigure(config: pytest.Config) -> None:
    if config.pluginmanager.has_plugin(TALLY):
        config.pluginmanager.unregister(name=TALLY)


@dataclass
class _Gate:
    """One gate's part in an update run, folded from its phase reports."""

    nodeid: str
    gpu: bool
    outcome: str = "passed"  # passed | red | skipped
    arms: int = 0  # arms stored (0: none)
    where: Path | None = None  # the snapshot file stored
    skip_reason: str = ""


class StoredTally:
    """What --snapshot-update stored, gate by gate, for one line at the end of the run: how many
    arms of which gates went where, and why the others stored none."""

    def __init__(self, rootdir: Path):
        self.rootdir = rootdir
        self.gates: dict[str, _Gate] = {}

    def pytest_runtest_logreport(self, report) -> None:
        props = dict(getattr(report, "user_properties", ()) or ())
        if props.get("kind") in (None, "compile"):  # an ordinary test, or a compile item: no arms to store
            return
        gate = self.gates.setdefault(report.nodeid, _Gate(report.nodeid, gpu=props.get("gpu") == "true"))
        stored = STORED.fullmatch(str(props.get(PROPERTY, "")))
        if stored:
            gate.arms, gate.where = int(stored.group(1)), Path(stored.group(2))
        if report.failed:
            gate.outcome = "red"
        elif report.skipped and gate.outcome == "passed":
            gate.outcome = "skipped"
            longrepr = report.longrepr
            gate.skip_reason = str(longrepr[2]).removeprefix("Skipped: ") if isinstance(longrepr, tuple) else ""

    def line(self) -> str:
        stored = [g for g in self.gates.values() if g.where is not None]
        why = why_none([g for g in self.gates.values() if g.where is None])
        if not stored:
            return "snapshots: none stored: " + (why or "no gate ran (select the gates, e.g. pytest gates "
                                                       "--snapshot-update)")
        places = sorted({shown_path(_snapshot_root(g.where), self.rootdir) for g in stored})
        names = ", ".join(g.nodeid for g in stored[:3]) + (f", ... ({len(stored)} in all)" if len(stored) > 3 else "")
        text = (f"snapshots: stored {sum(g.arms for g in stored)} arm(s) of {len(stored)} gate(s) ({names}) under "
                f"{', '.join(places)}")
        return text + (f"; none stored for: {why}" if why else "")

    def pytest_terminal_summary(self, terminalreporter) -> None:
        terminalreporter.write_line(self.line())


def why_none(gates: list[_Gate]) -> str:
    """Why these gates stored nothing, one clause per cause."""
    gpu = [g for g in gates if g.outcome == "skipped" and g.gpu]
    parts = []
    if gpu:
        parts.append(f"{len(gpu)} GPU gate(s) skipped ({gpu[0].skip_reason or 'skipped'}): run on a machine with a "
                     "CUDA device (--require-gpu makes a missing one a failure)")
    skipped = sum(1 for g in gates if g.outcome == "skipped" and not g.gpu)
    if skipped:
        parts.append(f"{skipped} gate(s) skipped")
    red = sum(1 for g in gates if g.outcome == "red")
    if red:
        parts.append(f"{red} gate(s) red (a red gate's arms are not stored)")
    idle = sum(1 for g in gates if g.outcome == "passed")
    if idle:
        parts.append(f"{idle} gate(s) recorded no arm output (assert_bits_eq, assert_close and harness.record "
                     "note them)")
    return "; ".join(parts)


def _snapshot_root(path: Path) -> Path:
    """The `__snapshots__` folder a stored snapshot file lies in."""
    return next((p for p in path.parents if p.name == SNAPSHOT_DIR), path.parent)
