"""The server process: imports what every worker needs, collects the gate modules once,
never initialises CUDA, and forks a worker for each request."""

from __future__ import annotations

import gc
import json
import os
import shutil
import signal
import sys

from harness.core.child import SERVER_WARM_CHANNEL
from harness.pool.channel import POOL_FOLDER_PREFIX, ROLE, ChannelClosed, connect, trace
from harness.pool.worker import become_worker, probe_dict


def server_configured() -> None:
    """In the server's pytest_configure: fork a child that probes the device and tells the
    pytest process, while the server goes on collecting."""
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            ROLE.server.close()
            ch = connect(ROLE.connect_path)
            trace("probe: forked")
            try:
                probe = probe_dict()
            except BaseException as exc:  # never let the child run on into pytest
                probe = {"count": 0, "error": f"the device probe raised {type(exc).__name__}: {exc}"}
            trace("probe: answered")
            ch.send({"role": "probe", "token": None, "pid": os.getpid(), "probe": probe})
            ch.close()
        except BaseException:
            code = 1
        finally:
            os._exit(code)




def _warm_structural(session) -> int:
    """Run each structural gate once, here, on the unmutated kernel root, before any worker is
    forked: what they keep in host caches (`gates._thread_roles.analysed`: each function's
    answer, kept for the text it reads) every worker then has from its first mutant on, and a
    mutant of one function finds every other function's answer. Only gates that launch
    nothing and use no fixture but the kernel root's (no CUDA may start in a process that
    forks). Their reports go nowhere; returns how many ran."""
    items = [it for it in session.items if it.get_closest_marker("structural")
             and set(getattr(it, "fixturenames", ())) <= {"kernel_root", "request"}]
    for i, item in enumerate(items):
        try:
            session.config.hook.pytest_runtest_protocol(item=item, nextitem=items[i + 1] if i + 1 < len(items) else None)
        except BaseException:  # noqa: BLE001 - a warm-up: a gate that fails here fails in the workers too
            pass
    try:
        session._setupstate.teardown_exact(None)
    except BaseException:  # noqa: BLE001
        pass
    return len(items)


def serve(session) -> None:
    """The server's run loop: fork a worker for each spawn request until quit or EOF."""
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # forked workers reap themselves
    if os.environ.get(SERVER_WARM_CHANNEL) == "structural":
        trace(f"server: warmed {_warm_structural(session)} structural gates")
    # Everything collected so far (the gate modules, their host data, pytest's session) lives
    # as long as every worker: out of the collector's sight, so a worker's own collections
    # (one per mutant, in reset_for_next_mutant) never walk it, and never write to its pages
    # (which the fork shares until they are written).
    gc.collect()
    gc.freeze()
    trace(f"server: collected {len(session.items)} items, serving")
    ch = ROLE.server
    while True:
        try:
            msg = ch.recv()
        except ChannelClosed:
            _owner_gone()
            return
        if msg.get("op") == "quit":
            return
        if msg.get("op") == "spawn":
            sys.stdout.flush()
            sys.stderr.flush()
            trace(f"server: fork t{msg.get('token')}")
            pid = os.fork()
            if pid == 0:
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                ch.close()
                os.environ.update(msg.get("env") or {})
                become_worker(session, int(msg["token"]))  # never returns


def _owner_gone() -> None:
    """The server's channel closed: the pool's owner closed the pool, or died without closing
    it (a plain pytest killed by SIGTERM or SIGKILL runs no `finally`, and this server and its
    workers live in a session of their own, out of reach of a signal to the owner's group).
    After a close the owner kills this process group and removes the pool's folder itself;
    after a death nobody would. So the server does both, at once: the folder (the socket, this
    server's log) goes first, then every worker it forked and the server itself, with one
    signal. (A worker deep in a gate ran on for as long as the gate, then wrote its traceback,
    its pool gone, into the log of a folder nobody would remove.)"""
    folder = os.path.dirname(ROLE.connect_path or "")
    if os.path.basename(folder).startswith(POOL_FOLDER_PREFIX):
        shutil.rmtree(folder, ignore_errors=True)
    sys.stdout.flush()
    sys.stderr.flush()
    if os.getpgrp() == os.getpid():  # the server leads a group of its own: never the owner's
        os.killpg(os.getpid(), signal.SIGKILL)


def serve_main(argv: list[str]) -> int:
    path = argv[argv.index("--connect") + 1]
    args = argv[argv.index("--") + 1:] if "--" in argv else []
    return serve_pool(path, args)


def serve_pool(path: str, args: list[str], plugin_args: tuple = ()) -> int:
    """The server: say hello on the pool's socket, import what every worker needs, collect
    the files it is told (or `args`), then fork workers on request (the plugin's run loop)."""
    ROLE.connect_path = path
    ROLE.server = connect(path)
    ROLE.server.send({"role": "server", "token": None, "pid": os.getpid()})
    trace("server: started")
    _warm_imports()
    import pytest

    trace("server: imported")

    if not args:
        try:
            msg = ROLE.server.recv()
        except ChannelClosed:
            _owner_gone()
            return 0
        if msg.get("op") != "collect":
            return 0
        args = msg["args"]
        trace("server: told what to collect")
    # `serve` (in the plugin's run loop) returns on quit; the exit status means nothing here.
    pytest.main(list(plugin_args) + args + ["--harness-serve"])
    return 0


def _warm_imports() -> None:
    for name in ("numpy", "ml_dtypes", "cupy", "harness.library.kernels", "harness.library.bits", "harness.library.dtypes"):
        try:
            __import__(name)
        except Exception:
            pass


def probe_main() -> int:
    print(json.dumps(probe_dict()))
    return 0
