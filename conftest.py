"""Registers the harness plugin for runs from the repo root with nothing installed.
When `harness` is installed, its pytest11 entry point has loaded it already.
`pytester` serves the harness's own plugin tests in tests/."""

import os
import signal
import sys
from pathlib import Path

import pytest

# With nothing installed, the ini's `pythonpath = ["src"]` put this checkout's harness on this
# process's path; the processes the harness starts (its pool, fresh pytests, campaigns) find it
# the same way only through PYTHONPATH.
_SRC = str(Path(__file__).resolve().parent / "src")
if _SRC in sys.path and _SRC not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_SRC, os.environ.get("PYTHONPATH")) if p)

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
    `-p no:xdist`, `--pdb`, `--compare-to` (it runs the gates itself, each tree's in runs of its
    own, and refuses xdist), and a machine with a GPU, whose gates the pool already spreads
    over it (the harness's children name their gates, so they never spread)."""
    if (not config.pluginmanager.hasplugin("xdist") or hasattr(config, "workerinput")
            or config.args_source is not pytest.Config.ArgsSource.TESTPATHS or config.option.numprocesses is not None
            or config.option.dist != "no" or config.option.usepdb or config.option.collectonly
            or getattr(config.option, "compare_to", None) is not None):
        return
    from harness.core.device import _driver_present

    if not _driver_present():
        config.option.numprocesses = "auto"
        # A worker a core: each keeps to one BLAS/OpenMP thread, and so does every process it
        # starts (NumPy's OpenBLAS otherwise starts a thread a core in each and spins them
        # after every call, taking the cores the other workers need). Read at import,
        # so set before xdist starts its workers; a value already set is kept.
        for name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ.setdefault(name, "1")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """`--dist load` (xdist's default), except that a test class goes to one worker whole: tests
    that share a costly fixture (a campaign, a compile cache) live in one class, so it is made
    once, not once a worker. (xdist's own `xdist_group` mark renames items in a way pytest 9
    no longer sees.)"""
    if config.option.dist != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ClassesWhole(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            parts = nodeid.split("[", 1)[0].split("::")
            return "::".join(parts[:2]) if len(parts) > 2 else nodeid

    return ClassesWhole(config, log)
