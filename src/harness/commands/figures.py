"""What a benchmark reads off a pytest run and the machine it ran on: a child pytest timed
(`timed_run`: its wall, pytest's own "in N s" by `SUMMARY`, its summary line) and the GPUs'
name (`device_name`). Shared by `bench gates` and `bench compare`."""

from __future__ import annotations

import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

SUMMARY = re.compile(r"\b\d+ (?:passed|failed)\b.* in ([0-9.]+)s")


@dataclass(frozen=True)
class TimedRun:
    proc: subprocess.CompletedProcess
    wall_s: float  # the process's wall time
    pytest_s: float | None  # pytest's own "in N s", None where its summary line is missing
    summary: str  # that line, without its "=" rule


def timed_run(cmd: list[str], cwd: Path, env: dict) -> TimedRun:
    """Run `cmd` (a child pytest) in `cwd`, its output captured, and read its figures."""
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    found = next((m for m in map(SUMMARY.search, reversed(proc.stdout.splitlines())) if m), None)
    return TimedRun(proc, wall, float(found.group(1)) if found else None,
                    found.string.strip("= ").strip() if found else "")


def device_name() -> str:
    """`N x <name>` of the GPUs nvidia-smi lists, or `no GPU`."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30).stdout.strip().splitlines()
        return f"{len(out)} x {out[0]}" if out else "no GPU"
    except (OSError, subprocess.SubprocessError):
        return "no GPU"
