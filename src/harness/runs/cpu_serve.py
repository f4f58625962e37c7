"""A pytest plugin (`-p harness.runs.cpu_serve`) that makes a pytest process the CPU
executor's child (`harness.runs.cpu`): it collects the gates it was given, says hello over
the socket named by HARNESS_CPU_SERVE_FD, then runs each mutant's set against the mutant's
sandbox as a warm worker does, resetting itself between mutants, until the socket closes."""

from __future__ import annotations

import os

import pytest


@pytest.hookimpl(tryfirst=True)
def pytest_runtestloop(session):
    from harness.core.child import CPU_SERVE_FD_CHANNEL

    fd = os.environ.get(CPU_SERVE_FD_CHANNEL)
    if not fd:
        return None
    import socket

    from harness.pool.channel import Channel, ChannelClosed
    from harness.pool.worker import ReportSink, reset_host_state, run_set

    ch = Channel(socket.socket(fileno=int(fd)))
    items = {item.nodeid: item for item in session.items}
    sink = ReportSink()
    session.config.pluginmanager.register(sink, "harness-cpu-sink")
    ch.send({"op": "hello", "collected": len(items)})
    while True:
        try:
            msg = ch.recv()
        except ChannelClosed:
            break
        if msg.get("op") != "run_set":
            break
        reply = run_set(session, items, sink, msg, [])
        reply["why_not_reusable"] = reset_host_state(session)
        ch.send(reply)
        if reply["why_not_reusable"]:
            break  # nothing of this mutant may reach the next: a new process serves it
    return True
