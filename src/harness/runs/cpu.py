"""The CPU executor: the gates that need no device (structural gates, host-side refusals) of
one mutant after another, in a pytest process that collected them once.

`python -m harness mutate --static` has no GPU, but a mutant's structural gates can still
kill it, and they are what tells a mutant with the original's cubin (or another mutant's)
from that one. Each `CpuExecutor` keeps one `pytest` child that collected the gates it may
be asked for and serves them (`harness.runs.cpu_serve`) against each mutant's sandbox, as a
warm worker does: the same run of a set (`harness.pool.worker`), the same reset between
mutants (fixtures torn down, the project's caches cleared but for `harness.host_cache`). A
set past its deadline, or a child that cannot be reset, ends the child; the next mutant
starts a new one. No CUDA is touched: no gate here is a `gpu` or `trap` gate.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from harness.core.child import CPU_SERVE_FD_CHANNEL
from harness.core.errors import SetupError
from harness.core.records import Outcome
from harness.pool.channel import Channel, ChannelClosed, Timeout
from harness.runs import fresh
from harness.runs.result import Executor, GateOutcome, GateRuns

START_TIMEOUT = 300.0  # seconds a child may take to import and collect, on a loaded host


class CpuServeError(SetupError, RuntimeError):
    """The CPU gate server did not start (its log says why)."""


@dataclass
class CpuExecutor(Executor):
    rootdir: Path
    gates: tuple[str, ...]  # node ids it may be asked for (collected once)
    kernel_root: Path
    cache_dir: Path
    log_dir: Path
    arch: str | None = None
    stop_on_kill: bool = True
    one_call: bool = True  # it stops at the first kill itself
    started: int = 0  # children started (the first, and one after each that ended)
    _proc: subprocess.Popen | None = field(default=None, repr=False)
    _ch: Channel | None = field(default=None, repr=False)

    def _command(self) -> list[str]:
        from harness.core.child import ChildPytest

        return ChildPytest(self.gates, plugins=("harness.runs.cpu_serve",), rootdir=self.rootdir,
                           native_tracebacks=True, kernel_root=self.kernel_root, cache_dir=self.cache_dir,
                           arch=self.arch, no_xdist=True).command()

    def _start(self) -> None:
        mine, theirs = socket.socketpair()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = self.log_dir / f"cpu-gates-{os.getpid()}-{id(self):x}-{self.started}.log"
        env = {**fresh.child_environment(self.cache_dir), CPU_SERVE_FD_CHANNEL: str(theirs.fileno())}
        with open(log, "wb") as out:
            proc = subprocess.Popen(self._command(), cwd=self.rootdir, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, pass_fds=(theirs.fileno(),), start_new_session=True)
        theirs.close()
        with fresh._live_lock:  # an interrupted campaign kills it with the fresh pytests (fresh.kill_all)
            fresh._live.add(proc)
        self._proc, self._ch = proc, Channel(mine)
        self.started += 1
        try:
            hello = self._ch.recv(timeout=START_TIMEOUT)
        except (Timeout, ChannelClosed):
            self.close()
            raise CpuServeError(f"the CPU gate server did not start; see {log}") from None
        if hello.get("op") != "hello":
            self.close()
            raise CpuServeError(f"the CPU gate server said {hello!r}; see {log}")

    def run(self, mutant_sandbox: Path, gates: Sequence[str], deadline: float) -> GateRuns:
        start = time.perf_counter()
        if self._ch is None:
            self._start()
        waited = time.perf_counter() - start
        self._ch.send({"op": "run_set", "kernel_root": str(mutant_sandbox), "gates": list(gates),
                       "stop_on_kill": self.stop_on_kill})
        try:
            reply = self._ch.recv(timeout=deadline)
        except Timeout:
            self.close(kill=True)
            return GateRuns((), timed_out=True, seconds=time.perf_counter() - start, waited=waited,
                            timeout_note=f"the structural gates ran past {deadline:.0f} s")
        except ChannelClosed:
            self.close()
            return GateRuns((), crashed="the CPU gate process died mid-mutant", seconds=time.perf_counter() - start,
                            waited=waited)
        if reply.get("why_not_reusable"):
            self.close()
        ran = {o["nodeid"]: o for o in reply.get("outcomes", ())}
        outcomes = tuple(_record(ran[g]) if g in ran else GateOutcome(g, Outcome.NOT_RUN.value) for g in gates)
        return GateRuns(outcomes, seconds=time.perf_counter() - start, waited=waited)

    def close(self, kill: bool = False) -> None:
        """End the child: at once (`kill`: a set past its deadline), else at the end of its loop."""
        ch, proc, self._ch, self._proc = self._ch, self._proc, None, None
        if ch is not None:
            ch.close()  # the child's loop ends at EOF
        if proc is not None:
            try:
                proc.wait(timeout=0 if kill else 10)
            except subprocess.TimeoutExpired:
                fresh._kill_group(proc)
                proc.wait()
            finally:
                fresh._kill_group(proc)  # anything it started dies with it
                with fresh._live_lock:
                    fresh._live.discard(proc)


def _record(o: dict) -> GateOutcome:
    return GateOutcome(o["nodeid"], o["outcome"], route=o.get("route"), first_failure_line=o.get("first_failure_line"),
                       failure_message=o.get("failure_message"), duration=float(o.get("duration") or 0.0))
