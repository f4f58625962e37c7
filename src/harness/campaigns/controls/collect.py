"""Which gates exist: the node ids pytest collects, for validating `[[expect]] gate`.

A fresh `pytest --collect-only` process loads this module as a plugin (`-p`); the plugin
writes the collected node ids and any collection errors to a JSON file named by
HARNESS_CONTROLS_COLLECT_OUT, so nothing depends on how pytest prints them.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from harness.core.child import COLLECT_OUT_CHANNEL

COLLECT_TIMEOUT = 600  # seconds; collection imports the gate modules, nothing more

_errors: list[str] = []


def pytest_collectreport(report) -> None:
    if report.failed:
        _errors.append(f"{report.nodeid or '(session)'}:\n{report.longreprtext}")


def pytest_collection_finish(session) -> None:
    out = os.environ.get(COLLECT_OUT_CHANNEL)
    if out:
        Path(out).write_text(json.dumps({"nodeids": [item.nodeid for item in session.items], "errors": _errors}))


def collect_gates(modules: list[str], *, rootdir: Path, kernel_root: Path) -> tuple[set[str], str | None]:
    """(node ids collected from `modules`, None) or (set(), the collection errors)."""
    # here, not at the top: a collect's own pytest loads this module as a plugin, and needs none of it
    from harness.core.child import ChildPytest
    from harness.runs.fresh import run_pytest

    with tempfile.TemporaryDirectory(prefix="harness-collect-") as tmp:
        out, log = Path(tmp) / "collected.json", Path(tmp) / "pytest.log"
        env = dict(os.environ, **{COLLECT_OUT_CHANNEL: str(out), "PYTHONDONTWRITEBYTECODE": "1"})
        child = ChildPytest(tuple(modules), collect_only=True, plugins=("harness.campaigns.controls.collect",),
                            kernel_root=kernel_root)
        args = child.args()
        shown = " ".join(child.command())
        proc, _, timed_out = run_pytest(args, cwd=Path(rootdir), env=env, stdout=log, timeout=COLLECT_TIMEOUT)
        if timed_out:
            return set(), f"$ {shown}\ncollecting the gates took longer than {COLLECT_TIMEOUT} s"
        if not out.is_file():
            tail = "\n".join(log.read_text(errors="replace").strip().splitlines()[-30:])
            return set(), f"$ {shown}\n(exit status {proc.returncode})\n{tail}"
        data = json.loads(out.read_text())
    if data["errors"]:
        return set(), "\n".join(data["errors"])
    return set(data["nodeids"]), None


class Collector:
    """`collect_gates` for one campaign, each module collected once: the validation and the
    warm run's plan ask for the same modules, and each ask is a pytest process (the gate
    modules and their imports loaded again). A module's node ids are those
    whose path part is the module as asked; where one is not (a module named another way),
    nothing is kept and each ask collects afresh."""

    def __init__(self, *, rootdir: Path, kernel_root: Path):
        self.rootdir, self.kernel_root = rootdir, kernel_root
        self.known: dict[str, set[str]] = {}

    def __call__(self, modules: list[str]) -> tuple[set[str], str | None]:
        missing = [m for m in modules if m not in self.known]
        if missing:
            ids, error = collect_gates(missing, rootdir=self.rootdir, kernel_root=self.kernel_root)
            if error:
                return set(), error
            split = {m: {n for n in ids if n.split("::", 1)[0] == m} for m in missing}
            if set().union(*split.values()) != ids:
                return (ids | set().union(*(self.known[m] for m in modules if m in self.known))), None
            self.known.update(split)
        return set().union(*(self.known[m] for m in modules)), None
