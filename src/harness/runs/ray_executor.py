"""The executor on a Ray cluster: one long-lived actor per GPU (`num_gpus=1`), each holding the
warm executor a local campaign uses on one GPU (`harness.runs.warm`: a forked server, the
context made ahead, the trap shadow), fed mutants by the campaign through one `RayExecutor`
that every slot shares.

A call ships what differs from the real kernel root (the perturbed files) and the cubins
its modules compiled to (`harness.runs.cluster`); the actor writes them into a sandbox copy
of the node's own tree and runs the gates there. The run comes back with the node and GPU
that made it. When an actor's node dies, or its GPU stops starting workers, or the call
outlives its deadline by GRACE_SECONDS, that actor is dropped and the same call runs on
another: a result is taken from exactly one completed call, so a mutant is never lost and
never counted twice. With no actor left the campaign stops as on a lost device (--resume).
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Sequence

from harness.runs.cluster import Cluster, Shipped, cache_entries, changed_files, node_facts, where, write_entries
from harness.runs.result import Executor, ExecutorFactory, GatePlan, GateRuns

# A call's result may come this long after its deadline (the network, Ray noticing a dead
# node) before the actor is taken for lost and the call runs elsewhere.
GRACE_SECONDS = 60.0
# added to a mutant's deadline: the round trip to the node and the cubins written there
SHIP_SECONDS = 5.0


class GpuActor:
    """One GPU of the cluster: its warm executor over the node's copy of the project. Made a
    Ray actor by `RayExecutors` (so this module imports Ray only when a campaign uses it)."""

    def __init__(self, shipped: Shipped, gates: tuple[str, ...], arch: str | None, spares: int,
                 stop_on_kill: bool, reuse: bool):
        from harness.runs.warm import WarmExecutor

        self.shipped = shipped
        self.facts = node_facts()
        self.cache = shipped.cache()
        # Ray set CUDA_VISIBLE_DEVICES to this actor's GPU: the workers take its first device
        self.warm = WarmExecutor(shipped.root(), tuple(gates), shipped.kernel(), self.cache, arch=arch,
                                 device_ordinal=None, spares=spares, stop_on_kill=stop_on_kill, reuse=reuse)

    def start(self) -> dict:
        self.warm.start_ahead()
        return self.facts

    def unpack(self, entries: dict) -> None:
        write_entries(self.cache, entries)

    def arm(self, plan: GatePlan) -> None:
        self.warm.arm(plan)

    def check_trap_shadow(self) -> dict:
        return self.warm.check_trap_shadow(self.shipped.kernel())

    def run(self, files: dict, entries: dict, gates: list, deadline: float) -> GateRuns:
        from harness.runs.sandbox import sandbox, write

        write_entries(self.cache, entries)
        with sandbox(self.shipped.kernel(), "ray") as copy:
            for rel, text in files.items():
                write(copy, rel, text)
            run = self.warm.run(copy, gates, deadline)
        return replace(run, facts={**(run.facts or {}), "ran_on": self.facts})

    def lines(self) -> list[str]:
        return [self.warm.summary(), self.warm.timing()]

    def close(self) -> None:
        self.warm.close()


@dataclass
class _Slot:
    actor: object
    name: str
    in_flight: int = 0
    alive: bool = True


@dataclass
class RayExecutor(Executor):
    """Every campaign slot's executor on the cluster: each call goes to the live GPU actor with
    the fewest calls in flight."""

    cluster: Cluster
    slots: list
    kernel_root: Path  # the real one, on the head
    cache_dir: Path
    arch: str | None
    names: dict  # the real kernel root's declared compile settings
    one_call: bool = True  # the warm executor on the node stops at the first kill itself
    start_seconds: float = SHIP_SECONDS
    ran: Counter = field(default_factory=Counter)  # {where: calls that returned}
    lost: list = field(default_factory=list)  # (where, why) of every actor dropped
    rerun: int = 0  # calls that ran again on another actor after theirs was dropped
    _shipped_cache: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def arm(self, plan: GatePlan) -> None:
        import ray

        self.gate_deadlines, self.trap_gates = plan.gate_deadlines, plan.trap_gates
        self._ship_cache()
        self._each(lambda a: a.arm.remote(plan), ray)

    def _ship_cache(self) -> None:
        """The original modules' cubins (the baseline compiled them here), to every node's
        cache, once: one object in the object store, one copy a node."""
        import ray

        from harness.compiling.compile import find_sources

        if self._shipped_cache:
            return
        self._shipped_cache = True
        root = Path(self.kernel_root).resolve()
        modules = [s.resolve().relative_to(root).as_posix() for s in find_sources(root)]
        ref = ray.put(cache_entries(root, modules, arch=self.arch, cache_dir=self.cache_dir, names=self.names))
        self._each(lambda a: a.unpack.remote(ref), ray)

    def _each(self, call, ray) -> list:
        """[(slot, result)] of `call(actor)` on every live actor, all sent at once; an actor that
        died meanwhile, or whose GPU cannot serve, is dropped."""
        from harness.pool import controller

        sent = [(slot, call(slot.actor)) for slot in self.slots if slot.alive]
        out = []
        for slot, ref in sent:
            try:
                out.append((slot, ray.get(ref)))
            except ray.exceptions.RayActorError as exc:
                self._drop(slot, _first_line(exc))
            except (controller.DeviceLost, controller.PoolError) as exc:
                self._drop(slot, f"its GPU could not serve ({_first_line(exc)})")
        return out

    def check_trap_shadow(self, kernel_root: Path) -> dict:
        import ray

        merged: dict = {}
        for _, why_not in self._each(lambda a: a.check_trap_shadow.remote(), ray):
            for gate in self.trap_gates:
                merged[gate] = merged.get(gate) or why_not.get(gate)
        return {g: why for g, why in merged.items() if why is not None}

    def run(self, mutant_sandbox: Path, gates: Sequence[str], deadline: float) -> GateRuns:
        import ray

        from harness.pool import controller
        from harness.runs.compilecheck import dependents, run_dirs

        files = changed_files(self.kernel_root, mutant_sandbox)
        modules = dependents(mutant_sandbox, tuple(files), run_dirs(self.names))
        entries = cache_entries(mutant_sandbox, modules, arch=self.arch, cache_dir=self.cache_dir, names=self.names)
        tries = 0
        while True:
            slot = self._take()
            tries += 1
            try:
                run = ray.get(slot.actor.run.remote(files, entries, list(gates), deadline),
                              timeout=deadline + GRACE_SECONDS)
            except ray.exceptions.GetTimeoutError:
                self._drop(slot, f"no answer {deadline + GRACE_SECONDS:.0f} s after a call")
            except ray.exceptions.RayActorError as exc:
                self._drop(slot, _first_line(exc))
            except controller.DeviceLost as exc:  # the node's GPU stopped starting workers
                self._drop(slot, f"its GPU was lost ({_first_line(exc)})")
            else:
                with self._lock:
                    self.ran[where((run.facts or {}).get("ran_on")) or slot.name] += 1
                    self.rerun += tries > 1
                return run
            finally:
                with self._lock:
                    slot.in_flight -= 1

    def _take(self) -> _Slot:
        from harness.pool import controller

        with self._lock:
            live = [s for s in self.slots if s.alive]
            if not live:
                lost = "; ".join(f"{name}: {why}" for name, why in self.lost[-3:])
                raise controller.DeviceLost(f"every GPU actor of the Ray cluster is gone ({lost})")
            slot = min(live, key=lambda s: s.in_flight)
            slot.in_flight += 1
            return slot

    def _drop(self, slot: _Slot, why: str) -> None:
        import ray

        with self._lock:
            if not slot.alive:
                return
            slot.alive = False
            self.lost.append((slot.name, why))
        ray.kill(slot.actor, no_restart=True)

    def lines(self) -> list[str]:
        """What the terminal says of the cluster: the runs each node's GPU made, the actors lost
        and the runs made again elsewhere, then each live actor's worker lines."""
        import ray

        served = ", ".join(f"{name}: {n}" for name, n in sorted(self.ran.items()))
        out = [f"ray: {sum(self.ran.values())} run(s) on {len(self.slots)} GPU actor(s) ({served or 'none'})"]
        if self.lost:
            out.append(f"ray: {len(self.lost)} GPU actor(s) lost ("
                       + "; ".join(f"{name}: {why}" for name, why in self.lost)
                       + f"); {self.rerun} run(s) made again on another")
        if ray.is_initialized():
            for slot, lines in self._each(lambda a: a.lines.remote(), ray):
                out += [f"workers on {slot.name}: {line}" for line in lines]
        return out

    def close(self) -> None:
        import ray

        if not ray.is_initialized():
            return
        for slot in self.slots:
            if slot.alive:
                slot.alive = False
                try:
                    ray.get(slot.actor.close.remote(), timeout=30)
                except Exception:  # noqa: BLE001 - a dead or stuck actor is killed below all the same
                    pass
                ray.kill(slot.actor, no_restart=True)


def _first_line(exc: BaseException) -> str:
    """The line of a Ray error that says why (its node died), else its first line."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return next((line for line in lines if "died because" in line), lines[0] if lines else type(exc).__name__)


@dataclass
class RayExecutors(ExecutorFactory):
    """One actor per GPU of the cluster, made once; every slot gets the same RayExecutor.
    `per_gpu`: mutants at once on each GPU (the campaign's slots are GPUs x per_gpu)."""

    cluster: Cluster
    gates: tuple[str, ...]
    kernel_root: Path
    per_gpu: int = 1
    stop_on_kill: bool = True
    reuse: bool = True
    made: dict = field(default_factory=dict)

    @property
    def jobs(self) -> int:
        return self.cluster.gpus * max(1, self.per_gpu)

    def __call__(self, report_dir: Path | None, cache_dir: Path, arch: str | None,
                 device: str | None = None) -> RayExecutor:
        if "ray" not in self.made:
            import ray

            from harness.runs.compilecheck import declared_names

            spares = max(1, self.per_gpu) + 2  # as a local GPU's: one a slot, two more
            remote = ray.remote(num_gpus=1, max_restarts=0, max_concurrency=max(1, self.per_gpu) + 4)(GpuActor)
            slots = [_Slot(remote.remote(self.cluster.shipped, self.gates, arch, spares, self.stop_on_kill,
                                         self.reuse), f"GPU actor {i}") for i in range(self.cluster.gpus)]
            self.made["ray"] = RayExecutor(self.cluster, slots, Path(self.kernel_root), Path(cache_dir), arch,
                                           declared_names(Path(self.kernel_root)))
        return self.made["ray"]

    def cpu_map(self):
        return self.cluster.cpu_map

    def prestart(self, cache_dir: Path, arch: str | None, devices) -> threading.Thread:
        """Make the actors and start each one's warm pool in a thread, while the baseline runs
        (an actor that cannot start is dropped; the first run says so when none is left)."""
        executor = self(None, cache_dir, arch)

        def run():
            import ray

            for slot, facts in executor._each(lambda a: a.start.remote(), ray):
                slot.name = where(facts) or slot.name

        thread = threading.Thread(target=run, name="ray-prestart", daemon=True)
        thread.start()
        return thread
