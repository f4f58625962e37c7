"""Which gates exist: the node ids pytest collects, for validating `[[expect]] gate`.

A fresh `pytest --collect-only` process loads this module as a plugin (`-p`); the plugin
writes the collected node ids and any collection errors to a JSON file named by
HARNESS_CONTROLS_COLLECT_OUT, so nothing depends on how pytest prints them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ENV = "HARNESS_CONTROLS_COLLECT_OUT"
COLLECT_TIMEOUT = 600  # seconds; collection imports the gate modules, nothing more

_errors: list[str] = []


def pytest_collectreport(report) -> None:
    if report.failed:
        _errors.append(f"{report.nodeid or '(session)'}:\n{report.longreprtext}")


def pytest_collection_finish(session) -> None:
    out = os.environ.get(ENV)
    if out:
        Path(out).write_text(json.dumps({"nodeids": [item.nodeid for item in session.items], "errors": _errors}))


def collect_gates(modules: list[str], *, rootdir: Path, kernel_root: Path) -> tuple[set[str], str | None]:
    """(node ids collected from `modules`, None) or (set(), the collection errors)."""
    with tempfile.TemporaryDirectory(prefix="harness-collect-") as tmp:
        out = Path(tmp) / "collected.json"
        env = dict(os.environ, **{ENV: str(out), "PYTHONDONTWRITEBYTECODE": "1"})
        cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "harness.controls.collect"]
        cmd += ["-p", "no:cacheprovider", f"--kernel-root={kernel_root}", *modules]
        try:
            proc = subprocess.run(cmd, cwd=rootdir, env=env, capture_output=True, text=True,
                                  stdin=subprocess.DEVNULL, timeout=COLLECT_TIMEOUT)
        except subprocess.TimeoutExpired:
            return set(), f"$ {' '.join(cmd)}\ncollecting the gates took longer than {COLLECT_TIMEOUT} s"
        if not out.is_file():
            tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-30:])
            return set(), f"$ {' '.join(cmd)}\n(exit status {proc.returncode})\n{tail}"
        data = json.loads(out.read_text())
    if data["errors"]:
        return set(), "\n".join(data["errors"])
    return set(data["nodeids"]), None
