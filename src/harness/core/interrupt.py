"""SIGTERM handled as Ctrl-C by the commands that start processes and sandboxes.

A cancelled CI job, a `timeout`, or `kill` sends SIGTERM. Python's default handler for it
exits at once: no `finally` runs, so the campaign's workers are not reaped and its
sandboxes stay in the temp folder. Inside `sigterm_as_interrupt()` a SIGTERM raises
KeyboardInterrupt instead, and the command's Ctrl-C path (children killed, sandboxes swept,
results kept for --resume) runs.
"""

from __future__ import annotations

import signal
from contextlib import contextmanager


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


@contextmanager
def sigterm_as_interrupt():
    """Within the block, SIGTERM raises KeyboardInterrupt; the previous handler comes back
    after. Outside the main thread (where no handler can be set) it does nothing."""
    try:
        previous = signal.signal(signal.SIGTERM, _interrupt)
    except ValueError:  # signal only works in the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
