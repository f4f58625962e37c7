"""The harness's own hooks: how its features (the comparison, `harness.plugin.compare`) talk to the
core, as pytest-xdist's `newhooks.py` does for xdist's. Registered by the plugin's
`pytest_addhooks`; a feature implements them by name and imports nothing of the plugin."""

from __future__ import annotations

import pytest


@pytest.hookspec(firstresult=True)
def pytest_harness_takes_gates(config: pytest.Config) -> bool | None:
    """Will a feature take the run's gates (`pytest_harness_gate_loop`) and run them in workers
    of its own? Return True to say so, None to leave them to the plugin.

    Asked by the plugin once the gates are collected, before its pool makes any worker. Where a
    feature takes them, the pool only probes the device and claims the run's lanes in the
    machine's ledger, then closes: no worker of the run's own pool sits idle while the
    feature's run."""


@pytest.hookspec(firstresult=True)
def pytest_harness_gate_loop(session: pytest.Session, run, device_ready: bool, lanes: int):
    """Take the run's gates from pytest's loop: return `loop(gates, others)`, which the plugin
    calls once pytest's own loop has run the other items (`others` of them), or None to leave
    the gates to pytest (the plugin's pool runs the GPU ones).

    Asked by the plugin, which owns pytest's run loop, in the process that reports (never in a
    pool's server or worker, nor under --collect-only). `run` is the run's
    `harness.plugin.state.HarnessRun` (its settings, gate folders, report folder, policies);
    `device_ready`: the pool's probe found a usable device for this run; `lanes`: how many
    workers the run's gates may run on at once (`harness.pool.lanes`: the run's claim in the
    machine's ledger where the probe named the GPU, else its --harness-lanes setting; 1 under
    --compare-timing)."""
