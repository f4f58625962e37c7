"""SIGTERM inside the commands' campaigns takes their Ctrl-C path (harness.core.interrupt)."""

import os
import signal

import pytest

from harness.core.interrupt import sigterm_as_interrupt


def test_sigterm_raises_keyboardinterrupt_inside_and_the_old_handler_comes_back():
    seen = []
    previous = signal.signal(signal.SIGTERM, lambda s, f: seen.append(s))
    try:
        with pytest.raises(KeyboardInterrupt, match=f"signal {int(signal.SIGTERM)}"):
            with sigterm_as_interrupt():
                os.kill(os.getpid(), signal.SIGTERM)  # the handler runs before the next statement
        os.kill(os.getpid(), signal.SIGTERM)  # outside: the handler from before
        assert seen == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, previous)
