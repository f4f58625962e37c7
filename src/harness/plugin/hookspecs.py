"""The harness's own hooks: how its features (the comparison, `harness.plugin.compare`) talk to the
core, as pytest-xdist's `newhooks.py` does for xdist's. Registered by the plugin's
`pytest_addhooks`; a feature implements them by name and imports nothing of the plugin."""

from __future__ import annotations

import pytest


@pytest.hookspec(firstresult=True)
def pytest_harness_gate_loop(session: pytest.Session, run, pool_warm: bool):
    """Take the run's gates from pytest's loop: return `loop(gates, others)`, which the plugin
    calls once pytest's own loop has run the other items (`others` of them), or None to leave
    the gates to pytest (the plugin's pool runs the GPU ones).

    Asked by the plugin, which owns pytest's run loop, in the process that reports (never in a
    pool's server or worker, nor under --collect-only). `run` is the run's
    `harness.plugin.state.HarnessRun` (its settings, gate folders, report folder, policies);
    `pool_warm`: a pool of GPU workers was started for this run (a device is there)."""
