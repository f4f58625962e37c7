"""Registers the harness plugin for runs from the repo root with nothing installed.
When `harness` is installed, its pytest11 entry point has loaded it already.
`pytester` serves the harness's own plugin tests in tests/."""

import signal
import sys

pytest_plugins = ["pytester"] + ([] if "harness.plugin" in sys.modules else ["harness.plugin"])

# Started as a background job of a non-interactive shell, this process ignores SIGINT, and so
# would every child it starts: the tests that interrupt a run (a campaign's Ctrl-C path) need
# SIGINT to reach it, as it does from a terminal.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
