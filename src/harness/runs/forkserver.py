"""Fresh pytest processes as forks of one server that imported pytest once.

The run layer starts many fresh `python -m pytest` processes: a control's run, a mutant's
fresh run, the baseline, a campaign's collect. Each is fresh by design (nothing of one run
reaches the next), and a spawned one pays again, before its first gate, for importing pytest,
its plugins and rich: a fork of a server that imported them once does not.

The server (`harness/core/forkserver_main.py`, started once a process, on first use) is a fresh interpreter
that imports those modules, runs nothing, and forks a child a run. The child takes the run's
folder, environment, stdio and session, and becomes `python -m pytest ARGS`. Every child is a
fork of a server that has run nothing, so it is as fresh as a spawned one. Where a fork would
not be what a spawn is, the run is spawned as before, and `start` says why:

- HARNESS_SERVER_START=spawn, no `fork` on this platform, or the server could not start;
- the run's environment differs from the server's in a variable that is read before the
  first gate (anything but HARNESS_*, TMPDIR, CUDA_VISIBLE_DEVICES, PYTEST_PLUGINS, PYTEST_ADDOPTS and
  PYTHONDONTWRITEBYTECODE, which are read at run time);
- the run's folder holds a module the server imported from elsewhere (it would shadow it);
- the server is not safe to fork: a thread, or an NVIDIA device file open. It never
  touches CUDA; NumPy is imported only where BLAS keeps to one thread, which starts none.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from harness.core.child import pytest_command
from harness.core.settings import SERVER_START_ENV
from harness.pool.channel import Channel, ChannelClosed, Timeout

# Read at run time by the harness, pytest or the CUDA driver, never at import: a run may set
# them differently from the server. PYTHONDONTWRITEBYTECODE is applied to the child by hand.
RUN_TIME_VARIABLES = ("TMPDIR", "CUDA_VISIBLE_DEVICES", "PYTEST_PLUGINS", "PYTEST_ADDOPTS", "PYTHONDONTWRITEBYTECODE")
RUN_TIME_PREFIX = "HARNESS_"
START_TIMEOUT = 60.0  # seconds the server may take to import, on a loaded host
# The server runs as a script, so it imports no module of the harness (harness/core/forkserver_main.py says why).
SERVER_START = "import runpy, sys; runpy.run_path(sys.argv[1], run_name='__main__')"


def _run_time(name: str) -> bool:
    return name.startswith(RUN_TIME_PREFIX) or name in RUN_TIME_VARIABLES


def startup_environment(env: dict) -> tuple[tuple[str, str], ...]:
    """The variables of `env` read before a run's first gate: a server serves the runs whose
    startup environment is its own."""
    return tuple(sorted((k, v) for k, v in env.items() if not _run_time(k)))


# ---------------------------------------------------------------- the client (the run layer)


class ForkedPytest:
    """A forked `python -m pytest`: what the run layer asks of a subprocess.Popen (pid, poll,
    wait, returncode). It runs in its own session (pgid == pid), as a spawned one does; the
    server reaps it and says its exit status."""

    def __init__(self, pid: int, ch: Channel, args: list[str], server: "_Server"):
        self.pid, self.args = pid, args
        self.returncode: int | None = None
        self.cpu_seconds: float | None = None  # its CPU and its children's, once it ended
        self._ch, self._server = ch, server

    def poll(self) -> int | None:
        if self.returncode is None and self._ch.ready():
            self._read(None)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self._read(timeout)
        return self.returncode

    def _read(self, timeout: float | None) -> None:
        try:
            msg = self._ch.recv(timeout=timeout)
        except Timeout:
            raise subprocess.TimeoutExpired(self.args, timeout) from None
        except ChannelClosed:  # the server died: the child's status is lost; make sure it is gone
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            msg = {"exit": -signal.SIGKILL}
        self.returncode = int(msg["exit"])
        self.cpu_seconds = msg.get("cpu")
        self._ch.sock.close()
        with _server_lock:
            self._server.running -= 1


class _Server:
    """One server process, started with `env`, and this process's control socket to it."""

    def __init__(self, env: dict):
        mine, theirs = socket.socketpair()
        self.owner = os.getpid()
        self.running = 0  # its forked runs not yet waited for (guarded by _server_lock)
        self.used = 0.0  # when it last started a run (time.monotonic())
        env = {**env, "PYTHONDONTWRITEBYTECODE": "1"}
        # Started in /, so nothing it imports comes from the folder it was started in, and with
        # no folder of its own (a campaign leaves nothing in the temp dir): its log is a file
        # with no name, read back if it does not start.
        import tempfile

        self.log = tempfile.TemporaryFile()
        script = Path(__file__).parents[1] / "core" / "forkserver_main.py"
        self.proc = subprocess.Popen([sys.executable, "-c", SERVER_START, str(script), str(theirs.fileno())],
                                     cwd="/", env=env, stdin=subprocess.DEVNULL, stdout=self.log,
                                     stderr=subprocess.STDOUT, pass_fds=(theirs.fileno(),), start_new_session=True)
        theirs.close()
        self.control = mine
        self.lock = threading.Lock()
        try:
            ch = Channel(self._connect())
            try:
                hello = ch.recv(timeout=START_TIMEOUT)
            finally:
                ch.sock.close()
        except (OSError, Timeout, ChannelClosed):
            hello = {}
        if hello.get("op") != "hello":
            self._end()
            self.log.seek(0)
            tail = self.log.read().decode(errors="replace").strip().splitlines()[-5:]
            self.log.close()
            raise RuntimeError("the fork server did not start: " + (" | ".join(tail) or "it said nothing"))

    def _connect(self) -> socket.socket:
        mine, theirs = socket.socketpair()
        with self.lock:
            socket.send_fds(self.control, [b"c"], [theirs.fileno()])
        theirs.close()
        return mine

    def start(self, args: list[str], cwd: Path, env: dict, stdout: Path) -> ForkedPytest | str:
        ch = Channel(self._connect())
        ch.send({"args": args, "cwd": str(cwd), "env": env, "stdout": str(stdout)})
        try:
            reply = ch.recv(timeout=START_TIMEOUT)
        except (Timeout, ChannelClosed):
            ch.sock.close()
            return "the fork server did not answer"
        if "pid" not in reply:
            ch.sock.close()
            return reply.get("spawn", repr(reply))
        with _server_lock:
            self.running += 1
        return ForkedPytest(int(reply["pid"]), ch, args, self)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def _end(self) -> None:
        self.control.close()  # the server ends at EOF, and any child still running with it
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def close(self) -> None:
        self._end()
        self.log.close()


# Servers a process keeps, each for one startup environment. A run in another environment ends
# the one used longest ago with no run in flight, or, where every one has a run, is spawned.
MAX_SERVERS = 4
_servers: dict[tuple, _Server] = {}
_failed: dict[tuple, str] = {}
_atexit = None
_server_lock = threading.Lock()


def _server_for(env: dict) -> _Server | str:
    """The server for runs with `env`'s startup environment, started on first use; or why none."""
    key = startup_environment(env)
    with _server_lock:
        for k, server in list(_servers.items()):
            if server.owner != os.getpid():  # a fork of the process that started it: the parent's
                server.control.close()
                del _servers[k]
            elif not server.alive():  # killed with a campaign's processes: a new one on demand
                del _servers[k]
        if key in _servers:
            _servers[key].used = time.monotonic()
            return _servers[key]
        if key in _failed:
            return _failed[key]
        if len(_servers) >= MAX_SERVERS:
            idle = [k for k, server in _servers.items() if server.running == 0]
            if not idle:
                return f"each of this process's {MAX_SERVERS} fork servers has a run, each in another environment"
            oldest = min(idle, key=lambda k: _servers[k].used)
            _servers.pop(oldest).close()
        own = {k: v for k, v in os.environ.items() if _run_time(k)}
        try:
            server = _Server({**dict(key), **own})
        except (OSError, RuntimeError) as e:
            _failed[key] = str(e)
            return _failed[key]
        server.used = time.monotonic()
        global _atexit
        if not _atexit:
            import atexit

            _atexit = atexit.register(shutdown)
        _servers[key] = server
        return server


def shutdown() -> None:
    """End this process's servers (at exit, or when a test wants new ones)."""
    with _server_lock:
        servers = list(_servers.values())
        _servers.clear()
        _failed.clear()
    for server in servers:
        if server.owner == os.getpid():
            server.close()


def why_spawn(env: dict) -> str | None:
    """Why a run with this environment is spawned, not forked, before asking the server."""
    asked = (env.get(SERVER_START_ENV) or os.environ.get(SERVER_START_ENV) or "").strip().lower()
    if asked == "spawn":
        return f"{SERVER_START_ENV}=spawn"
    if not hasattr(os, "fork") or not hasattr(socket, "send_fds") or not sys.platform.startswith("linux"):
        return "this platform has no fork server"
    return None


def start(args: list[str], *, cwd: Path, env: dict, stdout: Path,
          fork: bool = True) -> tuple[ForkedPytest | subprocess.Popen, str | None]:
    """`python -m pytest ARGS` in `cwd` with exactly `env`, its stdin /dev/null, its stdout and
    stderr appended to the file `stdout`, in a session of its own: a fork of the server where
    that is what a spawn would be (and `fork`), else spawned. Returns the process and why it was
    spawned (None: forked)."""
    why = why_spawn(env) if fork else "asked to spawn"
    if why is None:
        server = _server_for(env)
        if isinstance(server, str):
            why = server
        else:
            try:
                forked = server.start(args, cwd, env, stdout)
            except OSError as e:  # it died since
                forked = f"the fork server is gone ({e})"
            if isinstance(forked, ForkedPytest):
                return forked, None
            why = forked
    with open(stdout, "ab") as out:
        proc = subprocess.Popen(pytest_command(args), cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, why
