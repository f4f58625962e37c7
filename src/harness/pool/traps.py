"""Trap gates started ahead: each runs alone in a fresh worker whatever runs beside it, so its
verdict is the same wherever it starts; and a trap surfaces slowly, so trap gates started on
spares at the run's beginning, beside the other gates, leave the critical path.

The driver handles one trap at a time on a GPU, and while it does, a context being made
waits, and so, in part, do the other contexts' launches. So only a few trap gates run at
once, lest many started together hold up the lanes beside them: a gate whose verdict has
arrived frees its place at once, whether or not the run has reached it.

This is the way of `--harness-real-traps`, and of a trap gate the trap shadow did not settle.
By default the trap gates run in the trap shadow (harness.compiling.trap_shadow) in a lane of their own
(harness.plugin.pool.plan_lanes): no trap, and no context made for each."""

from __future__ import annotations

from typing import Callable

from harness.pool.channel import trace

TRAPS_AT_ONCE = 2  # trap gates running at once (their verdicts not yet arrived)


def first_spares(traps: int, shadow: bool = False) -> int:
    """The spares a gate run asks for first: one for each trap gate that can start at once
    (in the trap shadow, one for their lane) and one for the main worker's replacement; one
    when no gate traps."""
    if not traps:
        return 1
    return 2 if shadow else 2 + min(TRAPS_AT_ONCE, traps)


class TrapsAhead:
    """The trap gates still to start (node ids, in run order) and those started ahead on the
    pool's spares, each waiting in its worker for its verdict to be collected."""

    def __init__(self, pool):
        self.pool = pool
        self.queue: list[str] | None = None
        self.inflight: dict = {}  # nodeid -> the controller.Worker it started on

    def running(self) -> int:
        """Trap gates started ahead whose verdicts have not arrived yet."""
        return sum(1 for worker in self.inflight.values() if not worker.has_verdict())

    def spares_wanted(self, starting: int = 0) -> int:
        """The spares the pool keeps once `starting` more trap gates have taken theirs: one for
        each trap gate still to start, up to TRAPS_AT_ONCE, and one for the main worker's
        replacement; no more: the driver makes a context, handles a trap and loads modules one
        at a time, so extra contexts made while traps are handled slow the traps down."""
        return 1 + max(0, min(TRAPS_AT_ONCE, len(self.queue or ())) - starting)

    def start(self, upcoming: Callable[[], list[str]], current: str) -> None:
        """Start upcoming trap gates on ready spares now; `upcoming()` lists them (asked once),
        `current` is the gate being reached."""
        if self.queue is None:
            self.queue = upcoming()
        if current in self.queue:
            self.queue.remove(current)
        running = self.running() if self.queue else 0  # polled only while a trap gate waits to start
        while self.queue and running < TRAPS_AT_ONCE:
            self.pool.config.spares = self.spares_wanted(starting=1)  # the refill as this one takes its spare
            worker = self.pool.ready_spare()
            if worker is None:
                break
            nodeid = self.queue.pop(0)
            trace(f"  start ahead {nodeid} on {worker.name}")
            worker.start(nodeid, None)
            self.inflight[nodeid] = worker
            running += 1
        self.pool.config.spares = self.spares_wanted()
        self.pool.warm_up()

    def take(self, nodeid: str):
        """The worker a trap gate was started ahead on, or None."""
        return self.inflight.pop(nodeid, None)

    def kill_all(self) -> None:
        for worker in self.inflight.values():
            worker.kill()
        self.inflight.clear()
