"""Running one gate in a fresh pytest process.

Two users: gates marked `trap` (their body is expected to kill the CUDA context) and every
GPU gate that follows a gate which poisoned the context unexpectedly. The child writes its
verdict to a JSON file; the parent turns it back into pytest reports.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

CHILD_ENV = "HARNESS_CHILD"


@dataclass(frozen=True)
class ChildResult:
    outcome: str  # passed | failed | skipped | error | timeout
    route: str | None
    longrepr: str
    first_line: str | None
    duration: float


def child_command(nodeid: str, report_file: Path, *, rootdir: Path, inifile: Path | None,
                  passthrough: list[str], has_xdist: bool) -> list[str]:
    cmd = [sys.executable, "-m", "pytest", nodeid, "-q", "-p", "no:cacheprovider",
           f"--rootdir={rootdir}", f"--harness-child-report={report_file}"]
    if inifile is not None:
        cmd.append(f"--config-file={inifile}")
    if has_xdist:
        cmd += ["-p", "no:xdist"]
    return cmd + passthrough


def run_child(nodeid: str, *, rootdir: Path, inifile: Path | None, passthrough: list[str],
              has_xdist: bool, timeout: float) -> ChildResult:
    with tempfile.TemporaryDirectory(prefix="harness-child-") as tmp:
        report_file = Path(tmp) / "child.json"
        cmd = child_command(nodeid, report_file, rootdir=rootdir, inifile=inifile,
                            passthrough=passthrough, has_xdist=has_xdist)
        env = dict(os.environ, **{CHILD_ENV: "1"})
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=rootdir, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            output, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            return ChildResult("timeout", "timeout", f"the child process ran past {timeout:g} s and was killed",
                               f"timeout after {timeout:g} s in a child process", time.perf_counter() - start)
        duration = time.perf_counter() - start
        try:
            data = json.loads(report_file.read_text())[nodeid]
        except (OSError, ValueError, KeyError):
            tail = "\n".join(output.strip().splitlines()[-15:])
            return ChildResult("error", "error", f"the child process for {nodeid} exited {proc.returncode} "
                               f"without a verdict; its output ended:\n{tail}",
                               f"child process exited {proc.returncode} without a verdict", duration)
        return ChildResult(data["outcome"], data.get("route"), data.get("longrepr") or "",
                           data.get("first_line"), duration)
