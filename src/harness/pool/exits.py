"""Killed workers until their processes are gone: a pool holds a fork back while too many
are still exiting (the driver tears their contexts down, and makes a new one's, one at a
time per GPU)."""

from __future__ import annotations

import threading
import time

# Killed workers still exiting before the pool forks another: forking a worker for every
# fault as fast as they come piles exits up in the driver until no new worker can say hello
# in time, and the campaign would stop as if the GPU were lost.
MAX_EXITING = 3
EXIT_HOLD_S = 60.0  # the longest the pool holds a fork back for them; then it forks anyway


class Exits:
    """The pool's killed workers until their processes are gone (a forked worker is reaped
    by the kernel: its /proc entry goes when its exit, context teardown included, is done),
    and what waiting for them cost. Thread-safe. `clock` and `sleep` (the hold's look-again
    pause) are the wall clock's by default; a test passes its own, so no wall time decides it."""

    def __init__(self, limit: int | None = MAX_EXITING, hold_s: float = EXIT_HOLD_S,
                 clock=time.monotonic, sleep=time.sleep):
        self.limit, self.hold_s = limit, hold_s
        self._clock, self._sleep = clock, sleep
        self._lock = threading.Lock()
        self._killed: dict[int, float] = {}  # pid -> when it was killed
        self.exited = 0  # killed workers seen gone
        self.exit_s = 0.0  # their time from the kill to gone (as first seen gone: an upper bound)
        self.exit_max_s = 0.0
        self.holds = 0  # forks held back
        self.held_s = 0.0

    def killed(self, pid: int) -> None:
        self.exiting()  # (each look times the exits seen gone since the last one)
        with self._lock:
            self._killed[pid] = self._clock()

    def exiting(self) -> int:
        """How many killed workers are still exiting (one killed longer ago than the hold is
        no longer counted: a process stuck in the driver must not stop the pool for good)."""
        now = self._clock()
        with self._lock:
            for pid, when in list(self._killed.items()):
                gone = not _still_running(pid)
                if gone or now - when > self.hold_s:
                    del self._killed[pid]
                    if gone:
                        self.exited += 1
                        self.exit_s += now - when
                        self.exit_max_s = max(self.exit_max_s, now - when)
            return len(self._killed)

    def hold(self) -> None:
        """Before a fork: wait while `limit` or more killed workers are still exiting, at
        most `hold_s`. With no limit, never."""
        if self.limit is None or self.exiting() < self.limit:
            return
        began = self._clock()
        while self.exiting() >= self.limit and self._clock() - began < self.hold_s:
            self._sleep(0.02)
        with self._lock:
            self.holds += 1
            self.held_s += self._clock() - began

    def summary(self) -> str:
        """One clause for a campaign's `worker time:` line."""
        self.exiting()
        with self._lock:
            if not self.exited and not self.holds:
                return ""
            mean = self.exit_s / self.exited if self.exited else 0.0
            held = (f"; {self.holds} fork(s) held back {self.held_s:.1f} s in all while {self.limit} were still "
                    "exiting") if self.limit is not None else ""
            return (f"{self.exited} killed worker(s) were seen gone {mean:.2f} s after the kill (at most "
                    f"{self.exit_max_s:.2f} s; looked at each kill and fork){held}")


def _still_running(pid: int) -> bool:
    """The process exists and is not a zombie (a zombie's exit, its files and its CUDA
    context, is done; an exec'd worker stays one until the pool reaps it). Where /proc is
    missing, never counted as running."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    state = stat[stat.rfind(b")") + 2:stat.rfind(b")") + 3]
    return state not in (b"Z", b"X")
