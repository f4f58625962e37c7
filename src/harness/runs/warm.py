"""The warm executor: a mutant's gates run in a worker forked from a server that already
imported CuPy and the harness and collected every gate, with its CUDA context made and
CuPy warmed before the first mutant arrives (the gate run's pool, `harness.pool`).

A worker serves one mutant after another (`reuse`, the default): after each it tears every
fixture down, clears the project's functools caches (a cache may hold what the mutated
kernel computed, or a device buffer its stray store hit; `harness.host_cache` marks the
host-only ones it may keep), drops the loaded modules, checks that every device buffer is
back in CuPy's pool and checks the context. No device buffer outlives a mutant, so a stray
store lands in memory the next mutant allocates and fills afresh. A worker that cannot be
reset so (a sticky error, a failing teardown, a buffer still held), whose gate poisoned the
context, or that passed its deadline is thrown away and a fresh one (made ahead, on a
spare) takes the next gates. After MAX_SERVED
mutants a worker retires, which bounds what any leak could accumulate. `reuse=False`
gives every mutant a fresh worker (the stricter, slower way).

Thread-safe: the campaign runs several mutants at once through one executor.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from harness.core import settings as _settings
from harness.core.child import SERVER_WARM_CHANNEL
from harness.core.device import ordinal_of, slot_devices
from harness.core.records import RED, Outcome, Route
from harness.pool import controller, exits, worker as pool_worker
from harness.runs.result import Executor, ExecutorFactory, GateOutcome, GatePlan, GateRuns

MAX_SERVED = 200  # mutants one worker serves before it retires
# A mutant whose kernel faults in this many gates is not run further (unless every gate is
# asked for): each fault costs a worker and the fault's own second or two, and the gates
# left could only turn killed-by-trap into killed.
MAX_FAULTS = 4
CLOSED = "the campaign's workers were closed (interrupted)"  # why a closed executor makes no worker
# Many workers share the host's cores: each keeps to one BLAS/OpenMP thread. (numpy's
# OpenBLAS starts a thread per core in every process and spins them after each call.)
# And each sleeps while it waits for the GPU instead of spinning on a core (the driver's
# default for a process with one context): workers time-sharing one GPU would otherwise
# spend their waits spinning, starving the fresh workers that start beside them.
# And the server runs the structural gates once before forking (`server._warm_structural`):
# each worker inherits their answers for the unmutated functions, so a mutant pays only for
# the functions that reach the one it changed, even in a worker of its own.
WORKER_ENV = {**{name: "1" for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
                                        "NUMEXPR_NUM_THREADS")},
              pool_worker.GPU_WAIT_ENV: "block", SERVER_WARM_CHANNEL: "structural"}


def server_args(rootdir: Path, gates: Sequence[str], kernel_root: Path, cache_dir: Path, arch: str | None) -> list[str]:
    # native tracebacks: the verdict and its first line come from the exception itself
    # (harness.plugin), and a killed mutant's gate fails.
    from harness.core.child import ChildPytest

    return ChildPytest(tuple(gates), rootdir=rootdir, native_tracebacks=True, kernel_root=kernel_root,
                       cache_dir=cache_dir, arch=arch, no_xdist=True).args()


@dataclass
class WarmExecutor(Executor):
    rootdir: Path
    gates: tuple[str, ...]
    kernel_root: Path
    cache_dir: Path
    arch: str | None = None
    device_ordinal: int | None = None
    spares: int = 4
    stop_on_kill: bool = True
    per_gate: bool = False
    reuse: bool = True
    gate_deadlines: dict | None = None  # {nodeid: seconds}: each gate's own deadline (the campaign's auto)
    memory_safety: frozenset = frozenset()  # gates written for memory safety: run even past MAX_FAULTS
    # gates that fail by their own assertion when a guard fires on valid input
    # (@pytest.mark.names_faults): after a first fault they run first, and past MAX_FAULTS too
    names_faults: frozenset = frozenset()
    # gates that run last, each in a worker of its own (trap gates: they expect a trap): after
    # a fault they are not moved first, and past MAX_FAULTS they do not run (a fault there is
    # what they expect, not a kill)
    trap_gates: frozenset = frozenset()
    # trap gates that run in the trap shadow (harness.compiling.trap_shadow.TRAP_SHADOW_PREAMBLE) in the
    # mutant's own warm worker instead of a fresh one each: those whose guards the shadow
    # counted on the original kernels (`check_trap_shadow`, the campaign's wiring check)
    shadow_gates: frozenset = frozenset()
    # run_mutant hands this executor all of a mutant's gates in one call, in order: it stops
    # at the first kill itself, and counts faults across the direct gates, the siblings and
    # the trap gates alike (a cap per batch let a faulting mutant fault four times in each)
    one_call: bool = True
    # the server runs the structural gates once before it forks (WORKER_ENV): worth it where the
    # same gates run in worker after worker; not where they run once a side, spread over lanes
    warm_structural: bool = True
    _pool: controller.Pool | None = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)  # _idle, replaced, _closed
    # the pool (its start, a fresh worker): a slot waiting for a spare holds only this, so the
    # other slots still take and give back reset workers meanwhile
    _pool_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _idle: list = field(default_factory=list, repr=False)  # reset workers waiting for a mutant
    _closed: bool = field(default=False, repr=False)  # closed: no new worker or pool (an interrupted campaign)
    replaced: Counter = field(default_factory=Counter, repr=False)  # why workers were not kept: how often
    gpu_wait: str | None = field(default=None, repr=False)  # how the workers wait for the GPU, as they said
    # where the slots' time went, summed over the campaign (timing()): fresh workers taken and
    # what they cost, and each run_set's wall time against what its worker spent in the gates
    times: Counter = field(default_factory=Counter, repr=False)
    _exits: exits.Exits | None = field(default=None, repr=False)  # the pool's killed workers (kept past close)

    def arm(self, plan: GatePlan) -> None:
        self.gate_deadlines = plan.gate_deadlines
        self.memory_safety = plan.memory_safety
        self.names_faults = plan.names_faults
        self.trap_gates = plan.trap_gates

    def start_ahead(self) -> None:
        """`start` from another thread (while the campaign's baseline runs), under the pool's
        lock: a `close` meanwhile waits for it and then ends what it started."""
        with self._pool_lock:
            self.start()

    def start(self) -> None:
        """Start the server and the spares; raises controller.PoolError with the reason."""
        if self._pool is not None:
            return
        if self._closed:
            raise controller.PoolError(CLOSED)
        env = WORKER_ENV if self.warm_structural else {k: v for k, v in WORKER_ENV.items() if k != SERVER_WARM_CHANNEL}
        config = controller.PoolConfig(rootdir=self.rootdir, invocation_dir=self.rootdir, pytest_args=[],
                                    device_ordinal=self.device_ordinal, spares=self.spares, env=env,
                                    max_exiting=exits.MAX_EXITING, max_starting=controller.MAX_STARTING)
        pool = controller.Pool(config)
        try:
            pool.start_server()
            pool.collect(server_args(self.rootdir, self.gates, self.kernel_root, self.cache_dir, self.arch))
            probe = pool.wait_probe()
            if probe.get("error") or not probe.get("count"):
                raise controller.PoolError(f"no usable CUDA device for the campaign: {probe.get('error')}")
            if self._closed:  # closed while it started (an interrupt during the baseline): nothing may outlive it
                raise controller.PoolError(CLOSED)
            pool.warm_up()
        except BaseException:
            # a start that failed (the server never said hello, the probe never came) or was
            # interrupted: the server it started and its folder go with it
            pool.close()
            raise
        self._pool = pool
        self._exits = pool.exits

    def _reused(self) -> controller.Worker | None:
        """A reset worker that served earlier mutants, or None."""
        with self._lock:
            if self._closed:
                raise controller.PoolError(CLOSED)
            while self._idle:
                worker = self._idle.pop()
                if worker.alive:
                    return worker
        return None

    def _take(self) -> controller.Worker:
        """A reset worker that served earlier mutants, else a fresh one."""
        worker = self._reused()
        if worker is not None:
            return worker
        with self._pool_lock:
            worker = self._reused()  # one may have come back while this slot waited
            if worker is not None:
                return worker
            try:
                self.start()
                asked = time.monotonic()
                worker = self._pool.fresh_worker()
                self.gpu_wait = self.gpu_wait or worker.device.get("gpu_wait")
                with self._lock:
                    self.times["fresh"] += 1
                    self.times["fresh_start_s"] += worker.start_s
                    for phase, seconds in worker.start_phases.items():
                        self.times[f"fresh_phase_{phase}"] += float(seconds)
                    self.times["fresh_wait_s"] += time.monotonic() - asked
                return worker
            except controller.PoolError as exc:
                # A worker that cannot start (or no device at all) says nothing about the
                # mutant: the GPU is gone or unusable. Never a verdict.
                raise controller.DeviceLost(str(exc)) from None

    def _give_back(self, worker: controller.Worker) -> None:
        if worker.alive and worker.served >= MAX_SERVED:
            worker.quit()  # up to 10 s for its goodbye: never under a lock
            worker.ended_because = f"retired after {MAX_SERVED} mutants"
        with self._lock:
            if worker.alive and not self._closed:
                self._idle.append(worker)
                return
        if worker.alive:
            worker.kill()  # closed meanwhile
        with self._lock:
            self.replaced[worker.ended_because or "it ended"] += 1

    def check_trap_shadow(self, kernel_root: Path, deadline: float = 300.0) -> dict[str, str]:
        """The trap shadow's wiring check: every trap gate run in the trap shadow against the
        original kernels, in one warm worker. A gate whose guards the shadow counted, and that
        passed so, runs in the shadow for every mutant (`shadow_gates`); each other one says
        why not, and runs in a fresh worker of its own as before. Returns {gate: why not}."""
        gates = sorted(self.trap_gates)
        why_not: dict[str, str] = {}
        passed: set[str] = set()
        while gates:
            worker = self._take()
            ran = worker.run_set(str(kernel_root), gates, deadline, False, reuse=True, trap_shadow=gates)
            self._give_back(worker)
            got = ran.outcomes
            for o in got:
                if o["outcome"] == Outcome.PASSED and o.get("shadow_hits"):
                    passed.add(o["nodeid"])
                elif o["outcome"] == Outcome.NOT_RUN:
                    why_not[o["nodeid"]] = o.get("first_failure_line") or Outcome.NOT_RUN.value
                else:
                    why_not[o["nodeid"]] = (f"{o['outcome']} in the shadow with "
                                            f"{o.get('shadow_hits')} guard(s) counted"
                                            + (f": {o['first_failure_line']}" if o.get("first_failure_line") else ""))
            done = {o["nodeid"] for o in got}
            if ran.ending is not controller.Ending.VERDICT:
                why_not.update({g: "the wiring check's worker " + ("ran past its deadline"
                                                                   if ran.ending is controller.Ending.TIMED_OUT
                                                                   else str(ran.why))
                                for g in gates if g not in done})
                break
            if not done:
                why_not.update({g: "the wiring check's worker ran none of them" for g in gates})
                break
            gates = [g for g in gates if g not in done]  # after a gate that poisoned its worker
        self.shadow_gates = frozenset(passed)
        return why_not

    def _count_set(self, worker, got: list, cut: bool) -> None:
        kind = "cut" if cut else "poisoned" if any(o.get("poisoned") for o in got) else "clean"
        with self._lock:
            self.times["shadowed"] += sum(1 for o in got if o["nodeid"] in self.shadow_gates
                                          and o.get("outcome") != Outcome.NOT_RUN)
            t = self.times
            t[f"{kind}_sets"] += 1
            t[f"{kind}_gates"] += len(got)
            t[f"{kind}_wall_s"] += worker.set_seconds
            t[f"{kind}_reports_s"] += sum(float(o.get("duration") or 0.0) for o in got)
            t[f"{kind}_protocol_s"] += worker.set_phases.get("protocol_s", 0.0)
            t[f"{kind}_reset_s"] += worker.set_phases.get("reset_s", 0.0)

    def timing(self) -> str:
        """One line: where the slots' time went (fresh workers, and each kind of run_set:
        its wall time, the gates' own report durations, pytest's protocol around them, the
        reset after a reused worker's mutant). For finding a campaign's bottleneck."""
        t = self.times
        parts = []
        if t["fresh"]:
            phases = ", ".join(f"{k[len('fresh_phase_'):].replace('_', ' ')} {v / t['fresh']:.2f}"
                               for k, v in t.items() if k.startswith("fresh_phase_"))
            parts.append(f"{t['fresh']} fresh worker(s): each started in {t['fresh_start_s'] / t['fresh']:.2f} s "
                         f"({phases or 'context and CuPy'}), the slot waited {t['fresh_wait_s'] / t['fresh']:.2f} s "
                         "for it")
        for kind, what in (("clean", "ending clean"), ("poisoned", "ending in a poisoned context"),
                           ("cut", "cut by a deadline or a death")):
            n = t[f"{kind}_sets"]
            if not n:
                continue
            parts.append(f"{n} gate set(s) {what} ({t[f'{kind}_gates']} gates): {t[f'{kind}_wall_s'] / n:.2f} s "
                         f"each, of it {t[f'{kind}_protocol_s'] / n:.2f} s in pytest's protocol, "
                         f"{t[f'{kind}_reports_s'] / n:.2f} s in the gates' reports, "
                         f"{t[f'{kind}_reset_s'] / n:.2f} s resetting")
        exits = self._exits.summary() if self._exits is not None else ""
        if exits:
            parts.append(exits)
        if t["shadowed"]:
            parts.append(f"{t['shadowed']} trap gate(s) run in the trap shadow, in the mutant's own worker")
        if t["mutants"]:
            # what sets a campaign's rate: each fresh worker is a context the driver
            # makes, and usually a trap or fault it handled, one at a time per GPU
            parts.append(f"{t['mutants']} mutant(s) run: {t['fresh'] / t['mutants']:.2f} fresh worker(s) a mutant")
        return "; ".join(parts) or "no gate set ran"

    def summary(self) -> str:
        """One line: how many workers were replaced, and why (and how they waited for the GPU)."""
        wait = f" (each waited for the GPU by {self.gpu_wait})" if self.gpu_wait else ""
        if not self.replaced:
            return "every worker was kept from mutant to mutant" + wait
        reasons = "; ".join(f"{n} x {why}" for why, n in self.replaced.most_common(6))
        return f"{sum(self.replaced.values())} worker(s) replaced: {reasons}" + wait

    def run(self, mutant_sandbox: Path, gates: Sequence[str], deadline: float) -> GateRuns:
        start = time.monotonic()
        with self._lock:
            self.times["mutants"] += 1
        remaining = list(gates)
        outcomes: list[GateOutcome] = []
        timed_out, crashed = False, None
        waited, note = 0.0, None
        faults, stopped = 0, None
        while remaining:
            # The deadline bounds the mutant's own gate time: a slot waiting for a fresh worker
            # (the spares all taken by other slots' faults and traps) is not the mutant's doing.
            left = deadline - (time.monotonic() - start - waited)
            if left <= 0:
                timed_out = True
                break
            asked = time.monotonic()
            try:
                worker = self._take()
            except controller.PoolError as exc:
                crashed = str(exc)
                break
            waited += time.monotonic() - asked
            ran = worker.run_set(str(mutant_sandbox), remaining, left, self.stop_on_kill, reuse=self.reuse,
                                 gate_deadlines=self.gate_deadlines,
                                 trap_shadow=[g for g in remaining if g in self.shadow_gates])
            got, timed_out = ran.outcomes, ran.ending is controller.Ending.TIMED_OUT
            self._count_set(worker, got, ran.ending is not controller.Ending.VERDICT)
            self._give_back(worker)
            if ran.ending is not controller.Ending.VERDICT:
                crashed = ran.died
                if timed_out:
                    note = f"{worker.current_gate or 'its gates'} ran past its deadline" + \
                        (f"; the last kernel launched was {ran.last_launch}" if ran.last_launch else "")
                break
            for o in got:
                outcomes.append(GateOutcome(o["nodeid"], o["outcome"], o["route"], o["first_failure_line"],
                                            o.get("failure_message"), duration=float(o.get("duration") or 0.0)))
            done = {o["nodeid"] for o in got}
            faulted = [o["nodeid"] for o in got if o["poisoned"] and o["outcome"] in RED]
            # a fault in a gate written for memory safety is a kill (the score): stop there too
            killed = any(o["outcome"] == Outcome.FAILED and o["route"] == Route.ASSERTION for o in got) or \
                any(g in self.memory_safety for g in faulted)
            poisoned = any(o["poisoned"] for o in got)
            faults += len(faulted)
            remaining = [g for g in remaining if g not in done]
            if not poisoned or (killed and self.stop_on_kill):
                break
            # where a fault is a kill: a memory-safety gate that does not expect a trap itself; and
            # before them the gates that name a fault by their own assertion (a guard that fires on
            # valid metadata would otherwise stop at the fault cap before the gate that says so)
            naming = [g for g in remaining if g in self.names_faults and g not in self.trap_gates]
            safe = naming + [g for g in remaining if g in self.memory_safety and g not in self.trap_gates
                             and g not in naming]
            if faulted and self.stop_on_kill:
                # The mutant faults: those gates next, before more faults (a fresh worker and a
                # trap surfacing each, the GPU's fault handling shared by every worker on it);
                # the gates' own results stay what they are, only the order moves.
                remaining = safe + [g for g in remaining if g not in safe]
            if self.stop_on_kill and faults >= MAX_FAULTS and stopped is None:
                # those gates left still run: a fault there is a kill (the score). The trap gates
                # do not: each costs a worker of its own, and a fault there is what it expects,
                # so it cannot turn into a kill
                kept = safe
                stopped = (f"stopped after it faulted in {faults} gates "
                           f"({len(remaining) - len(kept)} gate(s) not run)")
                remaining = kept
        ran = {o.nodeid for o in outcomes}
        outcomes += [GateOutcome(g, Outcome.NOT_RUN) for g in gates if g not in ran]
        return GateRuns(tuple(outcomes), timed_out, None if timed_out else crashed, time.monotonic() - start,
                        waited=waited, timeout_note=note, stop_note=stopped)

    def close(self) -> None:
        """Kill every worker and the server now (a run in flight ends: its worker is gone).
        Safe to call from another thread, and twice."""
        self._closed = True
        pool = self._pool
        if pool is not None:
            pool.kill_processes()  # first, without the lock: a slot may hold it waiting for a spare
        with self._lock:
            for worker in self._idle:
                worker.kill()
            self._idle.clear()
        with self._pool_lock:
            if self._pool is not None:
                self._pool.close()
                self._pool = None


def spares_for(jobs: int, device: str | None) -> int:
    """Spare workers of one GPU's executor: one for each of the `jobs` slots on that GPU, plus
    two (a slot whose worker a fault or a trap ended takes a spare that is already up)."""
    return sum(1 for d in slot_devices(jobs) if d == device) + 2


@dataclass
class WarmExecutors(ExecutorFactory):
    """One warm executor per GPU, shared by the campaign's `jobs` slots on that GPU, its spares
    covering them; `made` holds them ({device: executor}) for closing and their summaries."""

    rootdir: Path
    gates: tuple[str, ...]
    kernel_root: Path
    jobs: int
    stop_on_kill: bool = True
    reuse: bool = True  # False: a fresh worker for every mutant (the re-check's)
    spares: int | None = None  # each executor's spares; None: `spares_for` its GPU's slots
    warm_structural: bool = True  # WarmExecutor.warm_structural
    # trap gates each executor runs in the trap shadow, with no wiring check (a gate run's way,
    # docs/gate-run.md); a campaign's are set by `arm` and its wiring check instead
    shadow_traps: frozenset = frozenset()
    made: dict = field(default_factory=dict)

    def __call__(self, report_dir: Path | None, cache_dir: Path, arch: str | None,
                 device: str | None = None) -> WarmExecutor:
        if device not in self.made:
            spares = spares_for(self.jobs, device) if self.spares is None else self.spares
            self.made[device] = WarmExecutor(self.rootdir, self.gates, self.kernel_root, cache_dir, arch=arch,
                                             device_ordinal=ordinal_of(device), spares=spares,
                                             stop_on_kill=self.stop_on_kill, reuse=self.reuse,
                                             warm_structural=self.warm_structural, trap_gates=self.shadow_traps,
                                             shadow_gates=self.shadow_traps)
        return self.made[device]

    def prestart(self, cache_dir: Path, arch: str | None, devices) -> threading.Thread:
        """Make each GPU's executor now and start it in a thread (returned, started), so its
        server, probe and spares come up while the baseline runs. The executors are in `made`
        at once: closing them (an interrupt, a red baseline) ends a start under way. A start
        that fails here is tried again, and its error raised, by the first slot."""
        todo = [self(None, cache_dir, arch, device) for device in dict.fromkeys(devices)]

        def run():
            for ex in todo:
                try:
                    ex.start_ahead()
                except Exception:  # noqa: BLE001 - the first slot starts it again and says why
                    pass

        thread = threading.Thread(target=run, name="prestart", daemon=True)
        thread.start()
        return thread


def default_cache_dir() -> Path:
    return _settings.in_effect().cache_dir
