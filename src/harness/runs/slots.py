"""One slot scheduler for every campaign: run work items on `jobs` slots, at most one item a
slot at a time; a caller pins slot i to GPU `harness.core.device.slot_devices(jobs)[i]`.

Items come from `take(block)`, which may still be producing them (the mutation screen feeds
the gate stage as it compiles): it returns the next item, None at the end, or raises
`queue.Empty` when asked not to block and none is ready. Each item runs in a thread of its
own slot; its result is handed to `done` in the calling thread, in the order items finish.
An exception (Ctrl-C included) kills every fresh pytest in flight (`fresh.kill_all`), calls
`on_abort` (to close warm workers, so no slot waits out its deadline) and is raised again.
"""

from __future__ import annotations

import queue
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from typing import Callable, TypeVar

Item = TypeVar("Item")
Result = TypeVar("Result")

POLL_SECONDS = 0.05  # how soon a free slot looks at a feed that is still producing


def from_list(items: list) -> Callable[[bool], object]:
    """A `take` over a list known up front."""
    pending = list(items)
    return lambda block: pending.pop(0) if pending else None


def run_in_slots(take: Callable[[bool], Item | None], jobs: int, work: Callable[[Item, int], Result],
                 done: Callable[[Item, Result], None], *, on_abort: Callable[[], None] | None = None,
                 name: str = "slot") -> None:
    """Run `work(item, slot)` for every item `take` gives, `jobs` at once; `done(item, result)`
    as each ends."""
    jobs = max(1, jobs)
    free = list(range(jobs))
    running: dict = {}  # future -> (item, slot)
    ended = False
    with ThreadPoolExecutor(max_workers=jobs, thread_name_prefix=name) as pool:
        try:
            while not ended or running:
                while free and not ended:
                    try:
                        item = take(not running)  # wait for the feed only when nothing runs
                    except queue.Empty:
                        break
                    if item is None:
                        ended = True
                    else:
                        slot = free.pop(0)
                        running[pool.submit(work, item, slot)] = (item, slot)
                if not running:
                    continue
                finished, _ = wait(list(running), timeout=POLL_SECONDS if free and not ended else None,
                                   return_when=FIRST_COMPLETED)
                for future in finished:
                    item, slot = running.pop(future)
                    free.append(slot)
                    done(item, future.result())
        except BaseException:
            from harness.runs import fresh  # the module as it is now (a test may stand in for kill_all)

            fresh.kill_all()  # every gate run in flight dies with its process group
            if on_abort is not None:
                on_abort()
            for future in running:
                future.cancel()
            raise

