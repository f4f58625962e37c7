"""The pool's server as a fork of the pytest process, where that is safe: it then has the
pytest process's imports (pytest, its plugins, the harness, the conftests) from its first
instruction."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from harness.core.forkserver_main import nvidia_device_opened as _nvidia_device_opened  # stdlib only
from harness.core.settings import SERVER_START_ENV  # noqa: E402


def server_start_mode() -> tuple[str, str]:
    """How a gate run starts its server, and why: a fork of this process where that is safe
    (no other thread, no NVIDIA device file open: a process that has initialised CUDA must
    never fork), else a fresh interpreter. HARNESS_SERVER_START=spawn asks for the latter."""
    asked = os.environ.get(SERVER_START_ENV, "").strip().lower()
    if asked == "spawn":
        return "spawn", f"{SERVER_START_ENV}=spawn"
    if not hasattr(os, "fork"):
        return "spawn", "this platform has no fork"
    threads = threading.active_count()
    if threads > 1:
        return "spawn", f"this process runs {threads} threads"
    opened = _nvidia_device_opened()
    if opened is None:
        return "spawn", "no /proc/self/fd to tell whether this process has initialised CUDA"
    if opened:
        return "spawn", "this process has initialised CUDA (an NVIDIA device file is open)"
    return "fork", "this process has no other thread and no CUDA context"


@dataclass(frozen=True)
class PoolEnd:
    """What the forked server takes from the pool: its socket (path and the listener, which
    the child closes), its log, and the folder it runs in."""

    path: str
    listener: object  # the listening socket
    log: Path
    invocation_dir: Path


class ForkedServer:
    """The server as a fork of the pytest process: what the pool asks of a subprocess.Popen
    (pid, poll, wait, returncode). Its own session (setsid), so one signal to its process
    group ends it and every worker it forked, as for a spawned one."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: int | None = None

    @classmethod
    def start(cls, pool: "PoolEnd", env: dict | None) -> "ForkedServer":
        sys.stdout.flush()
        sys.stderr.flush()
        log_fd = os.open(pool.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        null_fd = os.open(os.devnull, os.O_RDONLY)
        try:
            pid = os.fork()
        except OSError:
            os.close(log_fd)
            os.close(null_fd)
            raise
        if pid == 0:  # pragma: no cover - the child; its work is checked through the pool
            _run_forked_server(pool, env, log_fd, null_fd)
        os.close(log_fd)
        os.close(null_fd)
        return cls(pid)

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere: gone, status unknown
                self.returncode = -1
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired("harness server (forked)", timeout)
            time.sleep(0.005)
        return self.returncode


def _run_forked_server(pool: "PoolEnd", env: dict | None, log_fd: int, null_fd: int) -> None:
    """The forked server's first steps: a session and stdio of its own (the pool's log, as a
    spawned server has), default signal handling, the pool's environment; then serve. Never
    returns into the pytest process's code."""
    code = 1
    try:
        # Everything this process inherited stays out of the collector's sight: a collection
        # that walked it would write to every page the fork shares with the pytest process.
        gc.freeze()
        os.setsid()
        os.dup2(null_fd, 0)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        # The pytest process's sys.stdout is its capture's file; this process writes to its log.
        # (The old objects stay referenced by the copied capture manager, so none closes an fd.)
        sys.stdin = open(0, closefd=False)
        sys.stdout = open(1, "w", buffering=1, closefd=False)
        sys.stderr = open(2, "w", buffering=1, closefd=False)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        import faulthandler

        if faulthandler.is_enabled():
            faulthandler.enable(file=sys.stderr)
        pool.listener.close()
        os.chdir(pool.invocation_dir)
        if env is not None:
            os.environ.update(env)
        os.environ["PYTHONUNBUFFERED"] = "1"
        # The harness plugin by name, first: a tree that loads it from a conftest as
        # `[] if "harness.plugin" in sys.modules else ["harness.plugin"]` (for an installed
        # harness, whose entry point loaded it already) would not load it here, where the module
        # is imported but the new session has not registered it. Named twice, pytest loads it once.
        from harness.pool.server import serve_pool

        code = serve_pool(pool.path, [], plugin_args=("-p", "harness.plugin"))
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)
