"""Registers the harness plugin for runs from the repo root with nothing installed.
When `harness` is installed, its pytest11 entry point has loaded it already.
`pytester` serves the harness's own plugin tests in tests/."""

import os
import signal
import sys

import pytest

pytest_plugins = ["pytester"] + ([] if "harness.plugin" in sys.modules else ["harness.plugin"])

# Started as a background job of a non-interactive shell, this process ignores SIGINT, and so
# would every child it starts: the tests that interrupt a run (a campaign's Ctrl-C path) need
# SIGINT to reach it, as it does from a terminal.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which turns "auto" into a number of workers
def pytest_cmdline_main(config: pytest.Config) -> None:
    """The README's test command (`python -m pytest`, naming no path: the testpaths) on a
    machine with no NVIDIA driver spreads the harness's own tests over the CPUs (`-n auto`):
    most of them wait on child processes. Anything else runs as asked: a path or `-n` named,
    `-p no:xdist`, `--pdb`, and a machine with a GPU, whose gates the pool already spreads
    over it (the harness's children name their gates, so they never spread)."""
    if (not config.pluginmanager.hasplugin("xdist") or config.args_source is not pytest.Config.ArgsSource.TESTPATHS
            or config.option.numprocesses is not None or config.option.dist != "no" or config.option.usepdb
            or config.option.collectonly or "PYTEST_XDIST_WORKER" in os.environ):
        return
    from harness.device import _driver_present

    if not _driver_present():
        config.option.numprocesses = "auto"
        config.option.dist = "loadgroup"  # the tests that share a module's costly fixture stay on one worker
