"""One fresh pytest process over some gates, with a deadline, read back from gates.json.

The child runs in its own session (process group), so a deadline or a Ctrl-C kills it and
everything it started (the plugin's trap-gate subprocesses included) with one signal.
Outcomes come from the plugin's `--harness-report` file, never from terminal text.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Sequence

from harness.core.records import GateRecord, Outcome
from harness.runs import forkserver
from harness.runs.result import Executor, ExecutorFactory, GateOutcome, GateRuns
from harness.runs.sandbox import temp_folder

# Every child process alive now, so an interrupted campaign can kill them all.
_live: set[subprocess.Popen] = set()
_live_lock = threading.Lock()
_stopping = threading.Event()


def kill_all() -> None:
    """Kill every live child and refuse to start new ones (until `reset`)."""
    _stopping.set()
    with _live_lock:
        procs = list(_live)
    for proc in procs:
        _kill_group(proc)


def reset() -> None:
    _stopping.clear()


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the child's process group and every descendant's group: the plugin starts
    trap-gate processes in sessions of their own, which the child's group does not hold."""
    own = os.getpgrp()
    groups = {proc.pid}
    for pid in _descendants(proc.pid):
        try:
            groups.add(os.getpgid(pid))
        except (ProcessLookupError, PermissionError):
            pass
    for group in groups:
        if group == own:
            continue
        try:
            os.killpg(group, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _descendants(pid: int) -> list[int]:
    """Every live descendant of `pid` (Linux /proc; empty elsewhere)."""
    parents: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
        except OSError:
            continue
        # the command name may hold spaces and parentheses: the ppid follows the last ')'
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) > 1:
            parents.setdefault(int(fields[1]), []).append(int(entry))
    out, stack = [], [pid]
    while stack:
        for kid in parents.get(stack.pop(), []):
            out.append(kid)
            stack.append(kid)
    return out


def pytest_command(
    targets: list[str],
    *,
    kernel_root: Path,
    report_dir: Path,
    cache_dir: Path,
    require_gpu: bool,
    arch: str | None,
    deadline: float,
) -> list[str]:
    from harness.core.child import ChildPytest

    # the cubin cache the compile check filled; isolated (trap) gates end within the deadline
    return ChildPytest(tuple(targets), kernel_root=kernel_root, report_dir=report_dir, cache_dir=cache_dir,
                       deadline=deadline, require_gpu=require_gpu, arch=arch, no_fail_fast=True).command()


def child_environment(cache_dir: Path, device: str | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["HARNESS_CACHE_DIR"] = str(cache_dir)
    # Python would otherwise write __pycache__ into the kernel root when launchers live there.
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    if device is not None:
        env["CUDA_VISIBLE_DEVICES"] = device
    return env


def run_pytest(args: list[str], *, cwd: Path, env: dict, stdout: Path, timeout: float,
               fork: bool = True) -> tuple:
    """`python -m pytest ARGS` (`forkserver.start`: forked where that is what a spawn would be),
    waited for up to `timeout` seconds: (the process, why it was spawned or None, whether it ran
    past `timeout`). Past it, or on an interrupt (here or `kill_all`), it is killed with
    everything it started; whatever it left in its group dies with it at its end."""
    proc, spawned_because = forkserver.start(args, cwd=cwd, env=env, stdout=stdout, fork=fork)
    timed_out = False
    with _live_lock:
        _live.add(proc)
        if _stopping.is_set():
            _kill_group(proc)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        _kill_group(proc)
        proc.wait()
    except BaseException:  # KeyboardInterrupt: the child must not outlive us
        _kill_group(proc)
        proc.wait()
        raise
    finally:
        with _live_lock:
            _live.discard(proc)
        _kill_group(proc)
    return proc, spawned_because, timed_out


def run_gates(
    targets: list[str],
    *,
    kernel_root: Path,
    rootdir: Path,
    report_dir: Path,
    deadline: float,
    cache_dir: Path,
    require_gpu: bool = True,
    arch: str | None = None,
    device: str | None = None,
    env: dict[str, str] | None = None,
    spawn: bool = False,
) -> GateRuns:
    """Run pytest over `targets` (node ids or files relative to `rootdir`) in a fresh process:
    every gate its gates.json names, in its order; `env`: variables set for that process alone
    (this process's environment is not touched: other threads start processes of their own
    meanwhile). The process is a fork of the fork server where that is what a spawn would be
    (`harness.runs.forkserver`); `spawn`: a new interpreter always (the benches' naive way)."""
    report_dir = Path(report_dir)
    report_dir.mkdir(parents=True, exist_ok=True)
    gates_json = report_dir / "gates.json"
    gates_json.unlink(missing_ok=True)
    log = report_dir / "pytest.log"
    cmd = pytest_command(
        targets, kernel_root=kernel_root, report_dir=report_dir, cache_dir=cache_dir,
        require_gpu=require_gpu, arch=arch, deadline=deadline,
    )
    start = time.perf_counter()
    # The child's own temp dir, removed once it ended: a pytest killed at its deadline or by an
    # interrupt cannot remove what its pool made there.
    log.write_bytes(("$ " + " ".join(cmd) + "\n").encode())
    with temp_folder("child") as child_tmp:
        proc, spawned_because, timed_out = run_pytest(
            cmd[3:], cwd=Path(rootdir),
            env={**child_environment(cache_dir, device), "TMPDIR": str(child_tmp), **(env or {})},
            stdout=log, timeout=deadline, fork=not spawn,
        )
    if spawned_because is not None and not spawn:
        with open(log, "a") as f:
            f.write(f"\n# this pytest was spawned, not forked from the fork server: {spawned_because}\n")
    seconds = time.perf_counter() - start
    if timed_out:
        return GateRuns((), True, None, seconds, str(log))
    refused = _usage_error(log) if proc.returncode == USAGE_ERROR else None
    if not gates_json.is_file():
        why = f": {refused}" if refused else ""
        return GateRuns((), False, f"the pytest process exited {proc.returncode} without a report{why}; see {log}",
                        seconds, str(log))
    report = json.loads(gates_json.read_text())
    records: dict[str, GateRecord] = {}
    for gate in report.get("gates", []):
        rec = GateRecord.from_json(gate)
        previous = records.get(rec.nodeid)
        # setup/teardown errors can add a second line for a gate: keep the red one
        if previous is None or (rec.red and not previous.red):
            records[rec.nodeid] = rec
    facts = {k: v for k, v in report.items() if k != "gates"}
    return GateRuns(tuple(records.values()), False, None, seconds, str(log), facts=facts,
                    stop_note=f"pytest refused the run: {refused}" if refused else None)


USAGE_ERROR = 4  # pytest.ExitCode.USAGE_ERROR, without importing pytest here


def _usage_error(log: Path) -> str | None:
    """The line a pytest that refused its arguments printed (`ERROR: ...`), so a note can say
    why, not only where the log is."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return None
    return next((line.removeprefix("ERROR: ").strip() for line in lines if line.startswith("ERROR: ")), None)


# A fresh pytest pays for its start (interpreter, imports, collection, a server, a CUDA
# context) before its first gate, slower when a dozen start at once: its deadline gets this
# much on top of the gates' own.
FRESH_START_SECONDS = 45.0


@dataclass
class FreshProcessExecutor(Executor):
    """One fresh `pytest` per call over the given node ids, `--kernel-root=<sandbox>`. It
    watches no gate on its own: the whole call has one deadline, and it has no trap shadow
    (the plugin in the child isolates its trap gates)."""

    rootdir: Path
    report_dir: Path
    cache_dir: Path
    arch: str | None = None
    require_gpu: bool = True
    device: str | None = None
    per_gate: bool = False
    start_seconds: float = FRESH_START_SECONDS  # added to a mutant's deadline
    spawn: bool = False  # a new interpreter a run, never a fork (the naive way a bench times)
    _counter: itertools.count = field(default_factory=itertools.count, repr=False)

    def close(self) -> None:
        pass  # its processes end with each call; an interrupt kills them all (kill_all)

    def run(self, mutant_sandbox: Path, gates: Sequence[str], deadline: float) -> GateRuns:
        run = run_gates(
            list(gates), kernel_root=mutant_sandbox, rootdir=self.rootdir,
            report_dir=Path(self.report_dir) / f"{Path(mutant_sandbox).parent.name}-{next(self._counter)}",
            deadline=deadline, cache_dir=self.cache_dir, require_gpu=self.require_gpu, arch=self.arch,
            device=self.device, spawn=self.spawn,
        )
        records = run.records
        outcomes = tuple(records.get(g) or GateOutcome(g, Outcome.NOT_RUN) for g in gates)
        return replace(run, outcomes=outcomes)


@dataclass(frozen=True)
class FreshExecutors(ExecutorFactory):
    """The factory of fresh-process executors, one a campaign slot; nothing starts ahead."""

    rootdir: Path
    require_gpu: bool = True

    def __call__(self, report_dir: Path, cache_dir: Path, arch: str | None,
                 device: str | None = None) -> FreshProcessExecutor:
        return FreshProcessExecutor(self.rootdir, report_dir, cache_dir, arch=arch, require_gpu=self.require_gpu,
                                    device=device)
