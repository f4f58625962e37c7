"""The warm executor: each mutant's gates run in a fresh process forked from a server that
already imported CuPy and the harness and collected every gate, with its CUDA context made
and CuPy warmed before the mutant arrives (the gate run's pool, `harness.workers`).

Why a fresh worker per mutant rather than one long-lived process: gate helpers cache what
they build (`functools.cache` over device inputs, a chain's GPU outputs), and a mutant's
stray stores can corrupt device memory a later mutant would read. A process that served
one mutant is thrown away, so no cache, buffer or context outlives it; the cost of a fresh
process (a fork and a context) is paid ahead, on spares, while other mutants run.

A gate that poisons the context ends its worker; the mutant's remaining gates go to another
fresh worker. A deadline kills the worker (route timeout). Thread-safe: the campaign runs
several mutants at once through one executor.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from harness import _settings, workers
from harness.mutate.execute import GateOutcome, GateRuns


def server_args(rootdir: Path, gates: Sequence[str], kernel_root: Path, cache_dir: Path, arch: str | None) -> list[str]:
    args = [*gates, f"--rootdir={rootdir}", "-q", "--color=no", "-p", "no:cacheprovider",
            f"--kernel-root={kernel_root}", f"--harness-cache-dir={cache_dir}"]
    if arch:
        args.append(f"--arch={arch}")
    from importlib.util import find_spec

    if find_spec("xdist") is not None:
        args += ["-p", "no:xdist"]
    return args


@dataclass
class WarmExecutor:
    rootdir: Path
    gates: tuple[str, ...]
    kernel_root: Path
    cache_dir: Path
    arch: str | None = None
    device_ordinal: int | None = None
    spares: int = 4
    stop_on_kill: bool = True
    per_gate: bool = False
    _pool: workers.Pool | None = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def start(self) -> None:
        """Start the server and the spares; raises workers.PoolError with the reason."""
        if self._pool is not None:
            return
        config = workers.PoolConfig(rootdir=self.rootdir, invocation_dir=self.rootdir, pytest_args=[],
                                    device_ordinal=self.device_ordinal, spares=self.spares)
        pool = workers.Pool(config)
        pool.start_server()
        pool.collect(server_args(self.rootdir, self.gates, self.kernel_root, self.cache_dir, self.arch))
        probe = pool.wait_probe()
        if probe.get("error") or not probe.get("count"):
            pool.close()
            raise workers.PoolError(f"no usable CUDA device for the campaign: {probe.get('error')}")
        pool.warm_up()
        self._pool = pool

    def _fresh(self) -> workers.Worker:
        with self._lock:
            self.start()
            return self._pool.fresh_worker()

    def run(self, mutant_sandbox: Path, gates: Sequence[str], deadline: float) -> GateRuns:
        start = time.monotonic()
        remaining = list(gates)
        outcomes: list[GateOutcome] = []
        timed_out, crashed = False, None
        while remaining:
            left = deadline - (time.monotonic() - start)
            if left <= 0:
                timed_out = True
                break
            try:
                worker = self._fresh()
            except workers.PoolError as exc:
                crashed = str(exc)
                break
            got, timed_out, died, last = worker.run_set(str(mutant_sandbox), remaining, left, self.stop_on_kill)
            if timed_out or died:
                crashed = died
                if timed_out and last:
                    crashed = f"timed out; the last kernel launched was {last}"
                break
            for o in got:
                outcomes.append(GateOutcome(o["nodeid"], o["outcome"], o["route"], o["first_failure_line"],
                                            o.get("failure_message")))
            done = {o["nodeid"] for o in got}
            killed = any(o["outcome"] == "failed" and o["route"] == "assertion" for o in got)
            poisoned = any(o["poisoned"] for o in got)
            remaining = [g for g in remaining if g not in done]
            if not poisoned or (killed and self.stop_on_kill):
                break
        ran = {o.nodeid for o in outcomes}
        outcomes += [GateOutcome(g, "not run") for g in gates if g not in ran]
        return GateRuns(tuple(outcomes), timed_out, None if timed_out else crashed, time.monotonic() - start)

    def close(self) -> None:
        with self._lock:
            if self._pool is not None:
                self._pool.close()
                self._pool = None


def default_cache_dir() -> Path:
    return _settings.current().cache_dir
