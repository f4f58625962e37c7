"""Trap gates started ahead: each runs alone in a fresh worker whatever runs beside it, so its
verdict is the same wherever it starts; and a trap surfaces slowly, so trap gates started on
spares at the run's beginning, beside the main worker's gates, leave the critical path."""

from __future__ import annotations

from typing import Callable

from harness.pool.channel import trace

# Trap gates in flight at once: the suite's 18 all start at the beginning (one started later,
# once one in flight is reached at the run's end, waits for a fresh context and its trap).
TRAPS_AHEAD = 24


def first_spares(traps: int) -> int:
    """The spares a gate run asks for first: one for each trap gate that can start ahead and
    one for the main worker's replacement; one when no gate traps."""
    return 2 + min(TRAPS_AHEAD, traps) if traps else 1


class TrapsAhead:
    """The trap gates still to start (node ids, in run order) and those started ahead on the
    pool's spares, each waiting in its worker for its verdict to be collected."""

    def __init__(self, pool):
        self.pool = pool
        self.queue: list[str] | None = None
        self.inflight: dict = {}  # nodeid -> the controller.Worker it started on

    def spares_wanted(self, starting: int = 0) -> int:
        """The spares the pool keeps once `starting` more trap gates have taken theirs: one for
        each trap gate that can still start ahead, and one for the main worker's replacement;
        no more: the driver makes a context, handles a trap and loads modules one at a time, so
        extra contexts made while traps are handled slow the traps down."""
        return 1 + max(0, min(TRAPS_AHEAD - len(self.inflight), len(self.queue or ())) - starting)

    def start(self, upcoming: Callable[[], list[str]], current: str) -> None:
        """Start upcoming trap gates on ready spares now; `upcoming()` lists them (asked once),
        `current` is the gate being reached."""
        if self.queue is None:
            self.queue = upcoming()
        if current in self.queue:
            self.queue.remove(current)
        while self.queue and len(self.inflight) < TRAPS_AHEAD:
            self.pool.config.spares = self.spares_wanted(starting=1)  # the refill as this one takes its spare
            worker = self.pool.ready_spare()
            if worker is None:
                break
            nodeid = self.queue.pop(0)
            trace(f"  start ahead {nodeid} on {worker.name}")
            worker.start(nodeid, None)
            self.inflight[nodeid] = worker
        self.pool.config.spares = self.spares_wanted()
        self.pool.warm_up()  # past TRAPS_AHEAD: a spare as each trap gate in flight is reached

    def take(self, nodeid: str):
        """The worker a trap gate was started ahead on, or None."""
        return self.inflight.pop(nodeid, None)

    def kill_all(self) -> None:
        for worker in self.inflight.values():
            worker.kill()
        self.inflight.clear()
