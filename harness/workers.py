"""Warm, supervised processes for GPU gates.

The pytest process never runs a GPU gate itself and never blocks on the device. It owns a
*pool*:

- a **server**: a fresh Python (`python -m harness._serve serve`) that imports numpy, CuPy
  and the harness, collects the gate modules it is given, and never initialises CUDA. It
  forks children on request, so a child starts in milliseconds with everything imported
  and every gate collected;
- **workers**: the server's forked children. Each makes its own CUDA context on its own
  device, says hello, then runs the gates it is sent, one at a time, and sends back
  pytest's own reports. The pool keeps spares warm (context made, probe done) one ahead
  of need: a trap gate takes a spare and the spare is thrown away after it, so an
  isolated gate costs its own run time, not a Python start;
- a **watchdog**: the pytest process waits for each gate's reply with the gate's deadline.
  A worker that does not answer in time is killed (SIGKILL: a thread blocked in a CUDA
  call cannot be interrupted any other way) and the next gate gets a spare.

Under `--sanitize` the workers are not forked: each is a fresh process started under
compute-sanitizer that collects the modules itself (`python -m harness._serve worker`).

Every process talks over one Unix socket the pytest process listens on, in length-prefixed
JSON frames; the first frame of each connection says who it is (server, probe or worker,
with the token the pool gave it).
"""

from __future__ import annotations

import gc
import json
import os
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import types
from dataclasses import dataclass, field
from pathlib import Path

WORKER_START_TIMEOUT = 120.0  # seconds for a server or worker to start and say hello
SPARES = 4  # warm workers kept ahead of need (trap gates start on them early)
POOL_RESERVE_MB = 512  # device memory each worker puts in CuPy's pool before its first gate
# Killed workers still exiting (their CUDA context being torn down, a faulted one's after the
# GPU's fault handling) before the pool forks another: the driver does that work, and a new
# context's, one at a time per GPU. On the H200, a campaign that forked a worker for every
# fault as fast as they came (a dozen slots) piled exits up until no new worker could say
# hello within two minutes, and the campaign stopped as if the GPU were lost.
MAX_EXITING = 3
EXIT_HOLD_S = 60.0  # the longest the pool holds a fork back for them; then it forks anyway
# Workers starting at once (forked, not yet said hello) in a campaign's pool, per GPU. Each
# start is a cuInit and a context the driver makes while it handles the campaign's traps and
# faults one at a time; twice on the H200 (one GPU and two), a campaign whose pool kept a
# dozen or more starting through a burst of faulting mutants saw processes pile up in the
# driver (load 60, 44 in uninterruptible sleep) until none said hello within two minutes.
MAX_STARTING = 4


SERVE_MODULE = "harness._serve"  # python -m SERVE_MODULE {serve|worker|probe}: workers.entry


from harness._settings import TRACE_ENV  # noqa: E402  (the pool's timeline file)
TRACE_T0_ENV = "HARNESS_POOL_T0"  # the pytest process's start (time.monotonic(), shared by every process)


def trace(event: str) -> None:
    """One line of the pool's timeline: seconds since the pytest process started, pid, event.
    CLOCK_MONOTONIC is one clock for every process on the machine, so the server's, the
    probe's and the workers' lines interleave with the pytest process's."""
    path = os.environ.get(TRACE_ENV)
    if not path:
        return
    t0 = os.environ.get(TRACE_T0_ENV)
    if t0 is None:
        os.environ[TRACE_T0_ENV] = t0 = repr(time.monotonic())
    try:
        with open(path, "a") as f:
            f.write(f"{time.monotonic() - float(t0):8.3f} {os.getpid()} {event}\n")
    except (OSError, ValueError):
        pass


class Timeout(Exception):
    pass


class ChannelClosed(EOFError):
    pass


class Channel:
    """Length-prefixed JSON frames over a stream socket; `recv` takes a timeout."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self._buf = bytearray()

    def send(self, obj) -> None:
        data = json.dumps(obj).encode()
        self.sock.sendall(struct.pack("!I", len(data)) + data)

    def recv(self, timeout: float | None = None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if len(self._buf) >= 4:
                (n,) = struct.unpack("!I", self._buf[:4])
                if len(self._buf) >= 4 + n:
                    data = bytes(self._buf[4:4 + n])
                    del self._buf[:4 + n]
                    return json.loads(data)
            wait = None if deadline is None else deadline - time.monotonic()
            if wait is not None and wait <= 0:
                raise Timeout()
            ready, _, _ = select.select([self.sock], [], [], wait)
            if not ready:
                raise Timeout()
            try:
                chunk = self.sock.recv(1 << 16)
            except OSError as exc:
                raise ChannelClosed(str(exc)) from None
            if not chunk:
                raise ChannelClosed("the other end closed the connection")
            self._buf += chunk

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


def connect(path: str) -> Channel:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    return Channel(s)


# ====================================================================== the pytest side


@dataclass
class RunResult:
    """What a worker did with one gate."""

    reports: list = field(default_factory=list)  # serialized pytest reports
    poisoned: bool = False  # the gate left the CUDA context unusable: the worker is gone
    timed_out: bool = False
    died: str | None = None  # the worker ended without a verdict: why
    last_launch: str | None = None
    launches: int = 0  # kernel launches made through harness.kernels during the gate
    phases: dict = field(default_factory=dict)  # setup / call / teardown seconds inside the worker
    seconds: float = 0.0  # from the gate's start in the worker to its verdict
    waited: float = 0.0  # how long the pytest process waited for it (its cost to the run)


class Worker:
    """The pytest side of one worker process."""

    def __init__(self, channel: Channel, hello: dict, prefix: str = ""):
        self.channel = channel
        self.pid = int(hello["pid"])
        self.pgid = hello.get("pgid")
        self.device = hello.get("device") or {}
        self.name = f"{prefix}w{hello['token']}"
        self.alive = True
        self.served = 0  # mutants served (a reused worker of a campaign)
        self.current_gate: str | None = None  # the gate a run_set announced last
        self.ended_because: str | None = None  # why a campaign's worker was not kept for the next mutant
        self.start_s = float(hello.get("start_s") or 0.0)  # from its fork to its hello (context, CuPy)
        self.start_phases = dict(hello.get("start_phases") or {})  # of start_s: context, cupy_kernels, pool, probe
        self.set_seconds = 0.0  # the last run_set: from the send to its reply, in this process
        self.set_phases: dict = {}  # the last run_set, as the worker timed it: protocol_s, reset_s
        self.exits: Exits | None = None  # the pool's record of killed workers still exiting

    def start(self, nodeid: str, nextid: str | None) -> None:
        """Send the gate; `wait` collects the verdict (a trap gate may be started ahead)."""
        self._send({"op": "run", "nodeid": nodeid, "nextid": nextid})

    def wait(self, deadline: float) -> RunResult:
        """The verdict, or a timeout `deadline` seconds after `start`."""
        result = RunResult()
        msg, result.timed_out, result.died, result.last_launch = self._receive("done", deadline)
        if msg is not None:
            result.reports = msg["reports"]
            result.poisoned = bool(msg.get("poisoned"))
            result.launches = int(msg.get("launches") or 0)
            result.phases = msg.get("phases") or {}
            if result.poisoned:
                self.kill()
        result.seconds = time.monotonic() - self._started
        return result

    def run_set(self, kernel_root: str, gates: list[str], deadline: float, stop_on_kill: bool,
                reuse: bool = False, gate_deadlines: dict | None = None, trap_shadow=()):
        """A mutant's gates in this worker: (outcomes, timed_out, died, last_launch). With
        `reuse`, a worker that reset itself cleanly stays alive for the next mutant
        (`self.alive`); otherwise, or when it could not, it is gone. `gate_deadlines`
        ({nodeid: seconds}) also bounds each gate on its own: a gate that hangs is found in
        its own time, not the whole set's. The trap gates in `trap_shadow` run in the trap
        shadow (`_in_trap_shadow`), in this worker."""
        self._send({"op": "run_set", "kernel_root": kernel_root, "gates": gates, "stop_on_kill": stop_on_kill,
                    "reuse": reuse, "announce": bool(gate_deadlines), "trap_shadow": list(trap_shadow)})
        msg, timed_out, died, last = self._receive("done_set", deadline, gate_deadlines)
        self.set_seconds = time.monotonic() - self._started
        self.set_phases = {k: float((msg or {}).get(k) or 0.0) for k in ("protocol_s", "reset_s")}
        if msg is None or not msg.get("reusable"):
            self.kill()
            self.ended_because = ("it ran past its deadline" if timed_out else died if died
                                  else (msg or {}).get("why_not_reusable") or "it could not be reset")
        else:
            self.served += 1
        return (msg["outcomes"] if msg is not None else []), timed_out, died, last

    def _send(self, msg: dict) -> None:
        self._started = time.monotonic()
        self._send_error = None
        try:
            self.channel.send(msg)
        except OSError as exc:
            self._send_error = f"the worker could not be sent the gate ({exc})"

    def _receive(self, done: str, deadline: float, gate_deadlines: dict | None = None):
        """(the `done` message or None, timed out, why it died or None, the last kernel
        launched): waits at most `deadline` seconds after the send, and each announced gate
        at most its own `gate_deadlines` entry; a worker past either, or gone, is killed."""
        if self._send_error:
            self.kill()
            return None, False, self._send_error, None
        last = None
        gate_end = None  # when the gate running now must be done
        while True:
            now = time.monotonic()
            remaining = deadline - (now - self._started)
            if gate_end is not None:
                remaining = min(remaining, gate_end - now)
            try:
                msg = self.channel.recv(timeout=max(remaining, 0.0))
            except Timeout:
                self.kill()
                return None, True, None, last
            except ChannelClosed:
                self.kill()
                return None, False, "the worker process ended without a verdict (it crashed or was killed)", last
            if msg.get("op") == "launch":
                last = msg.get("name")
            elif msg.get("op") == "gate":
                self.current_gate = msg.get("nodeid")
                seconds = (gate_deadlines or {}).get(msg.get("nodeid"))
                gate_end = time.monotonic() + seconds if seconds else None
            elif msg.get("op") == done:
                return msg, False, None, last

    def kill(self) -> None:
        if not self.alive:
            return
        self.alive = False
        self.channel.close()
        try:
            if self.pgid:
                os.killpg(int(self.pgid), signal.SIGKILL)
            else:
                os.kill(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            return
        if self.exits is not None:
            self.exits.killed(self.pid)

    def quit(self) -> None:
        """Let the worker tear its fixtures down and exit; kill it if it does not."""
        if not self.alive:
            return
        try:
            self.channel.send({"op": "quit"})
            self.channel.recv(timeout=10.0)
        except (OSError, Timeout, ChannelClosed):
            pass
        self.kill()


class Exits:
    """The pool's killed workers until their processes are gone (a forked worker is reaped
    by the kernel: its /proc entry goes when its exit, context teardown included, is done),
    and what waiting for them cost. Thread-safe. `clock` and `sleep` (the hold's look-again
    pause) are the wall clock's by default; a test passes its own, so no wall time decides it."""

    def __init__(self, limit: int | None = MAX_EXITING, hold_s: float = EXIT_HOLD_S,
                 clock=time.monotonic, sleep=time.sleep):
        self.limit, self.hold_s = limit, hold_s
        self._clock, self._sleep = clock, sleep
        self._lock = threading.Lock()
        self._killed: dict[int, float] = {}  # pid -> when it was killed
        self.exited = 0  # killed workers seen gone
        self.exit_s = 0.0  # their time from the kill to gone (as first seen gone: an upper bound)
        self.exit_max_s = 0.0
        self.holds = 0  # forks held back
        self.held_s = 0.0

    def killed(self, pid: int) -> None:
        self.exiting()  # (each look times the exits seen gone since the last one)
        with self._lock:
            self._killed[pid] = self._clock()

    def exiting(self) -> int:
        """How many killed workers are still exiting (one killed longer ago than the hold is
        no longer counted: a process stuck in the driver must not stop the pool for good)."""
        now = self._clock()
        with self._lock:
            for pid, when in list(self._killed.items()):
                gone = not _still_running(pid)
                if gone or now - when > self.hold_s:
                    del self._killed[pid]
                    if gone:
                        self.exited += 1
                        self.exit_s += now - when
                        self.exit_max_s = max(self.exit_max_s, now - when)
            return len(self._killed)

    def hold(self) -> None:
        """Before a fork: wait while `limit` or more killed workers are still exiting, at
        most `hold_s`. With no limit, never."""
        if self.limit is None or self.exiting() < self.limit:
            return
        began = self._clock()
        while self.exiting() >= self.limit and self._clock() - began < self.hold_s:
            self._sleep(0.02)
        with self._lock:
            self.holds += 1
            self.held_s += self._clock() - began

    def summary(self) -> str:
        """One clause for a campaign's `worker time:` line."""
        self.exiting()
        with self._lock:
            if not self.exited and not self.holds:
                return ""
            mean = self.exit_s / self.exited if self.exited else 0.0
            held = (f"; {self.holds} fork(s) held back {self.held_s:.1f} s in all while {self.limit} were still "
                    "exiting") if self.limit is not None else ""
            return (f"{self.exited} killed worker(s) were seen gone {mean:.2f} s after the kill (at most "
                    f"{self.exit_max_s:.2f} s; looked at each kill and fork){held}")


def _still_running(pid: int) -> bool:
    """The process exists and is not a zombie (a zombie's exit, its files and its CUDA
    context, is done; an exec'd worker stays one until the pool reaps it). Where /proc is
    missing, never counted as running."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    state = stat[stat.rfind(b")") + 2:stat.rfind(b")") + 3]
    return state not in (b"Z", b"X")


class DeviceLost(RuntimeError):
    """A fresh worker could not start on a device that served gates before: the GPU is gone
    (a driver reset, an Xid, a GPU off the bus). Nothing run from now on is a verdict."""


class PoolError(RuntimeError):
    """The pool could not start a server or a worker; the message says why and what to do."""


@dataclass
class PoolConfig:
    rootdir: Path
    invocation_dir: Path
    pytest_args: list[str]  # what the server (or an exec'd worker) passes to pytest.main
    device_ordinal: int | None = None  # None: the first visible device
    sanitizer: list[str] | None = None  # the compute-sanitizer command prefix, or None to fork
    sanitizer_log_dir: Path | None = None
    sanitizer_tool: str | None = None
    spares: int = SPARES
    name_prefix: str = ""  # the xdist worker's id, so worker names stay unique across a -n run
    start_timeout: float = WORKER_START_TIMEOUT
    env: dict | None = None  # set in the server's environment (so in every worker forked from it)
    # hold a fork back while this many killed workers are still exiting (None: never). A
    # campaign sets it (MAX_EXITING): it kills a worker for every fault, all run long. A gate
    # run kills its trap gates' workers at its end, where a hold would only add to the wall.
    max_exiting: int | None = None
    # at most this many workers starting at once (None: every spare at once). A campaign sets
    # it (MAX_STARTING); a gate run wants its spares all up before its trap gates.
    max_starting: int | None = None


POOL_FOLDER_PREFIX = "harness-pool-"  # the pool's folder under the temp dir: its socket, the server's log
SOCKET_PATH_MAX = 107  # bytes of a Unix socket's path (sun_path is 108 on Linux, the last a NUL)


def _socket_folder() -> Path:
    """The pool's own folder, under the temp dir, or /tmp when the temp dir's path is too long
    for a Unix socket inside it (a deep TMPDIR, as pytest's own tmp_path under xdist can be)."""
    folder = Path(tempfile.mkdtemp(prefix=POOL_FOLDER_PREFIX))
    if len(os.fsencode(folder / "pool.sock")) <= SOCKET_PATH_MAX:
        return folder
    folder.rmdir()
    short = Path(tempfile.mkdtemp(prefix=POOL_FOLDER_PREFIX, dir="/tmp")) if os.path.isdir("/tmp") else None
    if short is None or len(os.fsencode(short / "pool.sock")) > SOCKET_PATH_MAX:
        raise PoolError(f"harness: the temp dir {tempfile.gettempdir()} is too deep for the GPU gate pool's socket "
                        f"(at most {SOCKET_PATH_MAX} bytes for its path): set TMPDIR to a shorter folder")
    return short


class Pool:
    """Owns the listening socket, the server (fork mode), the spares and the main worker."""

    def __init__(self, config: PoolConfig):
        self.config = config
        self.tmp = _socket_folder()
        self.path = str(self.tmp / "pool.sock")
        self.log = self.tmp / "server.log"
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.listener.bind(self.path)
            self.listener.listen(64)
        except BaseException:  # no pool: nothing of it stays in the temp dir
            self.listener.close()
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise
        self.server: subprocess.Popen | ForkedServer | None = None
        self.server_channel: Channel | None = None
        self.probe: dict | None = None
        self.main: Worker | None = None
        self.spares: list[Worker] = []
        self._pending: set[int] = set()  # tokens asked for, not yet connected
        self._early: dict[tuple, tuple[Channel, dict]] = {}  # hellos that arrived before asked for
        self._token = 0
        self._procs: list[subprocess.Popen] = []  # exec'd workers
        self.started_workers = 0
        self.exits = Exits(limit=config.max_exiting)

    # ---------------------------------------------------------------- start-up

    def start_server(self, fork: bool = False) -> None:
        """Start the fork server (fork mode); it imports while this process collects. Returns at once.

        `fork`: where this process may fork (`server_start_mode`), the server is a fork of it,
        not a fresh interpreter: it has this process's imports (pytest, its plugins, the
        harness, the conftests) from its first instruction, and only imports CuPy and collects.
        On the H200 a fresh server took 1.14 s from the pytest process's configure to its first
        fork, the trap gates' critical path. The server then runs its own pytest session, as a
        spawned one does, so it collects the same items with the same plugins."""
        env = dict(os.environ, **self.config.env) if self.config.env else None
        mode, why = server_start_mode() if fork else ("spawn", "asked to spawn")
        trace(f"server start: {mode} ({why})")
        if mode == "fork":
            self.server = ForkedServer.start(self, env)
            return
        cmd = [sys.executable, "-m", SERVE_MODULE, "serve", "--connect", self.path]
        self.server = self._popen(cmd, env)

    def collect(self, collect_args: list[str]) -> None:
        """Hand the server what to collect; its probe child then reports the device."""
        if self.server_channel is None:
            self.server_channel, _ = self._accept("server")
        self.server_channel.send({"op": "collect", "args": collect_args})

    def _popen(self, cmd: list[str], env: dict | None = None) -> subprocess.Popen:
        out = open(self.log, "ab")
        try:
            return subprocess.Popen(cmd, cwd=self.config.invocation_dir, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True,
                                    env=dict(os.environ if env is None else env, PYTHONUNBUFFERED="1"))
        finally:
            out.close()

    def _accept(self, role: str, token: int | None = None, timeout: float | None = None) -> tuple[Channel, dict]:
        """The next connection of this role (and token); others are kept for later."""
        timeout = self.config.start_timeout if timeout is None else timeout
        key = (role, token)
        if key in self._early:
            return self._early.pop(key)
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise PoolError(self._start_failure(f"no {role} said hello within {timeout:g} s"))
            ready, _, _ = select.select([self.listener], [], [], min(remaining, 0.5))
            if not ready:
                if self.server is not None and self.server.poll() is not None and role != "worker-exec":
                    raise PoolError(self._start_failure(f"the server exited with status {self.server.returncode}"))
                continue
            conn, _ = self.listener.accept()
            ch = Channel(conn)
            try:
                hello = ch.recv(timeout=max(remaining, 1.0))
            except (Timeout, ChannelClosed):
                ch.close()
                continue
            got = (hello.get("role"), hello.get("token"))
            if got == key:
                return ch, hello
            self._early[got] = (ch, hello)

    def _start_failure(self, what: str) -> str:
        tail = ""
        try:
            lines = self.log.read_text(errors="replace").strip().splitlines()
            tail = "\n".join(lines[-20:])
        except OSError:
            pass
        return (f"harness: the GPU gate workers could not start: {what}. "
                f"Their output ended:\n{tail}" if tail else f"harness: the GPU gate workers could not start: {what}")

    def wait_probe(self) -> dict:
        """The device probe, made in a process forked from the server after the conftests loaded."""
        if self.probe is None:
            if self.config.sanitizer is not None:
                self.probe = probe_in_subprocess(self.config.invocation_dir, self.config.start_timeout)
            else:
                ch, hello = self._accept("probe")
                ch.close()
                self.probe = hello["probe"]
        return self.probe

    def _server(self) -> Channel:
        """The server's channel. Spawn requests queue there while it still collects: it
        reads them once its run loop starts."""
        if self.server_channel is None:
            self.server_channel, _ = self._accept("server")
        return self.server_channel

    # ---------------------------------------------------------------- workers

    def _ask(self) -> int:
        """Ask for one more worker; returns its token."""
        self._token += 1
        token = self._token
        trace(f"ask t{token}")
        env = {}
        if self.config.device_ordinal is not None:
            env["CUDA_VISIBLE_DEVICES"] = visible_device(self.config.device_ordinal)
        if self.config.sanitizer is None:
            self.exits.hold()
            self._server().send({"op": "spawn", "token": token, "env": env})
        else:
            log = self.config.sanitizer_log_dir / f"sanitizer-w{token}.log"
            cmd = (self.config.sanitizer + ["--log-file", str(log), sys.executable, "-m", SERVE_MODULE,
                                            "worker", "--connect", self.path, "--token", str(token), "--"]
                   + self.config.pytest_args)
            self._procs.append(self._popen(cmd, env=dict(os.environ, HARNESS_SANITIZER_LOG=str(log),
                                                     HARNESS_SANITIZER_TOOL=self.config.sanitizer_tool or "", **env)))
        self._pending.add(token)
        self.started_workers += 1
        return token

    def _take(self, token: int) -> Worker:
        ch, hello = self._accept("worker", token)
        self._pending.discard(token)
        worker = Worker(ch, hello, self.config.name_prefix)
        worker.exits = self.exits
        if hello.get("error"):
            worker.kill()
            raise PoolError(f"harness: a GPU gate worker could not start: {hello['error']}")
        return worker

    def warm_up(self, count: int | None = None) -> None:
        """Start the spares now (`count` of them, at most the pool's number), so the first GPU
        gate finds a context ready."""
        self._fill(count)

    def _fill(self, count: int | None = None) -> None:
        cap = self.config.max_starting
        target = self.config.spares if count is None else min(count, self.config.spares)
        while len(self.spares) + len(self._pending) < target and (cap is None or len(self._pending) < cap):
            self._ask()

    def _spare(self) -> Worker:
        if self.spares:
            worker = self.spares.pop(0)
        else:
            if not self._pending:
                self._ask()
            worker = self._take(min(self._pending))
        self._fill()
        return worker

    def main_worker(self) -> Worker:
        if self.main is None or not self.main.alive:
            self.main = self._spare()
        return self.main

    def fresh_worker(self) -> Worker:
        """A worker no gate has used: for a gate that runs alone (a trap gate)."""
        return self._spare()

    def ready_spare(self) -> Worker | None:
        """A spare that has already said hello, without waiting; None when none is ready yet."""
        while True:
            ready, _, _ = select.select([self.listener], [], [], 0)
            if not ready:
                break
            conn, _ = self.listener.accept()
            ch = Channel(conn)
            try:
                hello = ch.recv(timeout=5.0)
            except (Timeout, ChannelClosed):
                ch.close()
                continue
            self._early[(hello.get("role"), hello.get("token"))] = (ch, hello)
        for token in sorted(self._pending):
            if ("worker", token) in self._early:
                try:
                    self.spares.append(self._take(token))
                except PoolError:
                    continue
        if len(self.spares) < 2:  # keep one for the main worker's replacement
            return None
        worker = self.spares.pop(0)
        self._fill()
        return worker

    # ---------------------------------------------------------------- end

    def close(self) -> None:
        """End the pool: its main worker tears its fixtures down, every process it started is
        killed, its folder (the socket, the server's log) goes. The kill and the folder come in
        a `finally`: an interrupt while closing (a second Ctrl-C, or a SIGTERM taken as one,
        during the main worker's teardown) must not leave the server running, in a session of
        its own, beside a folder it then writes its traceback into."""
        try:
            if self.main is not None:
                self.main.quit()
            for w in self.spares:
                w.kill()
            for ch, hello in self._early.values():
                ch.close()
                if hello.get("pid"):
                    _kill_quietly(int(hello["pid"]))
            if self.server_channel is not None:
                self.server_channel.close()
        finally:
            # The server holds nothing worth a graceful exit (its pytest session ran no gate), and
            # its forked workers share its process group: one signal ends them all, at once.
            self.kill_processes()
            try:
                for proc in ([self.server] if self.server is not None else []) + self._procs:
                    try:
                        proc.wait(timeout=5)
                    except subprocess.TimeoutExpired:
                        pass
            finally:
                self.listener.close()
                # The folder goes whole, the server's log with it: every process that wrote there
                # was killed above, and nothing reads the log after the pool closed (a failure that
                # needs its tail quotes it while the pool is open). A gate run used to leave the
                # folder with its log behind, one a run: a campaign of fresh pytests left one a
                # mutant in /tmp.
                shutil.rmtree(self.tmp, ignore_errors=True)

    def kill_processes(self) -> None:
        """SIGKILL the server's process group (its forked workers) and every exec'd worker, at
        once, touching no other state: safe from any thread, before `close`."""
        for proc in ([self.server] if self.server is not None else []) + list(self._procs):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def log_tail(self, n: int = 15) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").strip().splitlines()[-n:])
        except OSError:
            return ""


SERVER_START_ENV = "HARNESS_SERVER_START"  # fork (the default where safe) or spawn: how a gate run starts its server
SERVER_START_MODES = ("fork", "spawn")


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


def _nvidia_device_opened() -> bool | None:
    """Whether this process holds an NVIDIA device file open (cuInit opens /dev/nvidiactl):
    None where /proc cannot say."""
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return None
    for fd in fds:
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith("/dev/nvidia"):
                return True
        except OSError:
            continue
    return False


class ForkedServer:
    """The server as a fork of the pytest process: what the pool asks of a subprocess.Popen
    (pid, poll, wait, returncode). Its own session (setsid), so one signal to its process
    group ends it and every worker it forked, as for a spawned one."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: int | None = None

    @classmethod
    def start(cls, pool: "Pool", env: dict | None) -> "ForkedServer":
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


def _run_forked_server(pool: "Pool", env: dict | None, log_fd: int, null_fd: int) -> None:
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
        os.chdir(pool.config.invocation_dir)
        if env is not None:
            os.environ.update(env)
        os.environ["PYTHONUNBUFFERED"] = "1"
        # The harness plugin by name, first: a tree that loads it from a conftest as
        # `[] if "harness.plugin" in sys.modules else ["harness.plugin"]` (for an installed
        # harness, whose entry point loaded it already) would not load it here, where the module
        # is imported but the new session has not registered it. Named twice, pytest loads it once.
        code = _serve(pool.path, [], plugin_args=("-p", "harness.plugin"))
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def probe_in_subprocess(cwd: Path, timeout: float = WORKER_START_TIMEOUT) -> dict:
    """The device probe in a throwaway process (no conftest loaded): for a process that must
    make no CUDA context itself and has no server to ask."""
    out = subprocess.run([sys.executable, "-m", SERVE_MODULE, "probe"], capture_output=True, text=True,
                         timeout=timeout, cwd=cwd)
    try:
        return json.loads(out.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"count": 0, "error": f"the device probe failed: {out.stderr.strip()[-500:]}"}


def _kill_quietly(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def visible_device(ordinal: int) -> str:
    """CUDA_VISIBLE_DEVICES for the ordinal-th device this process can see."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        entries = [v.strip() for v in visible.split(",") if v.strip()]
        if entries:
            return entries[ordinal % len(entries)]
    return str(ordinal)


def device_count_hint() -> int | None:
    """How many GPUs this process will see, without initialising CUDA: CUDA_VISIBLE_DEVICES
    when set, else the driver's /proc entries; None when neither says. Only a hint (MIG
    slices, say, are not counted): an xdist worker on a one-GPU machine starts its spare
    beside the device probe on it."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        entries = [v.strip() for v in visible.split(",") if v.strip()]
        return len(entries) or None
    try:
        return len(os.listdir("/proc/driver/nvidia/gpus")) or None
    except OSError:
        return None


def ordinal_for_xdist_worker(workerid: str, count: int) -> int:
    """The GPU an xdist worker (gw0, gw1, ...) uses among `count`: round robin."""
    index = int(workerid[2:]) if workerid[2:].isdigit() else 0
    return index % max(count, 1)


# ====================================================================== the server side

_server_channel: Channel | None = None  # set in the server process
_connect_path: str | None = None
_worker_channel: Channel | None = None  # set in a worker process
_worker_token: int | None = None
_last_launch: str | None = None
launches = 0  # kernel launches made through harness.kernels in this worker


def is_server() -> bool:
    return _server_channel is not None and _worker_channel is None


def is_worker() -> bool:
    return _worker_token is not None


def note_launch(name: str) -> None:
    """Called by harness.kernels before each launch: the watchdog names the last one."""
    global _last_launch, launches
    launches += 1
    if _worker_channel is not None and name != _last_launch:
        _last_launch = name
        trace(f"  launch {name}")
        try:
            _worker_channel.send({"op": "launch", "name": name})
        except OSError:
            pass


def _probe_dict() -> dict:
    from harness import device

    p = device.probe()
    return {"count": p.count, "name": p.name, "arch": p.arch, "error": p.error,
            "devices": [list(d) for d in device.list_devices()] if p.usable else []}


def server_configured() -> None:
    """In the server's pytest_configure: fork a child that probes the device and tells the
    pytest process, while the server goes on collecting."""
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            _server_channel.close()
            ch = connect(_connect_path)
            trace("probe: forked")
            try:
                probe = _probe_dict()
            except BaseException as exc:  # never let the child run on into pytest
                probe = {"count": 0, "error": f"the device probe raised {type(exc).__name__}: {exc}"}
            trace("probe: answered")
            ch.send({"role": "probe", "token": None, "pid": os.getpid(), "probe": probe})
            ch.close()
        except BaseException:
            code = 1
        finally:
            os._exit(code)


SERVER_WARM_ENV = "HARNESS_SERVER_WARM"  # "structural": the server runs the structural gates once before serving


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
    if os.environ.get(SERVER_WARM_ENV) == "structural":
        trace(f"server: warmed {_warm_structural(session)} structural gates")
    # Everything collected so far (the gate modules, their host data, pytest's session) lives
    # as long as every worker: out of the collector's sight, so a worker's own collections
    # (one per mutant, in reset_for_next_mutant) never walk it, and never write to its pages
    # (which the fork shares until they are written).
    gc.collect()
    gc.freeze()
    trace(f"server: collected {len(session.items)} items, serving")
    ch = _server_channel
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
                _become_worker(session, int(msg["token"]))  # never returns


def _owner_gone() -> None:
    """The server's channel closed: the pool's owner closed the pool, or died without closing
    it (a plain pytest killed by SIGTERM or SIGKILL runs no `finally`, and this server and its
    workers live in a session of their own, out of reach of a signal to the owner's group).
    After a close the owner kills this process group and removes the pool's folder itself;
    after a death nobody would. So the server does both, at once: the folder (the socket, this
    server's log) goes first, then every worker it forked and the server itself, with one
    signal. (A worker deep in a gate ran on for as long as the gate, then wrote its traceback,
    its pool gone, into the log of a folder nobody would remove.)"""
    folder = os.path.dirname(_connect_path or "")
    if os.path.basename(folder).startswith(POOL_FOLDER_PREFIX):
        shutil.rmtree(folder, ignore_errors=True)
    sys.stdout.flush()
    sys.stderr.flush()
    if os.getpgrp() == os.getpid():  # the server leads a group of its own: never the owner's
        os.killpg(os.getpid(), signal.SIGKILL)


def _become_worker(session, token: int) -> None:
    global _worker_channel, _worker_token, _server_channel
    _server_channel = None
    code = 0
    try:
        _worker_token = token
        began = time.monotonic()
        hello = {"role": "worker", "token": token, "pid": os.getpid(), "pgid": None}
        if os.environ.get("HARNESS_SANITIZER_LOG"):
            hello["pgid"] = os.getpgid(0)
        try:
            phases = _prepare_device()
            hello["probe"] = _probe_dict()
            hello["device"] = _device_facts()
            phases["probe"] = round(time.monotonic() - began - sum(phases.values()), 4)
            hello["start_phases"] = phases
        except BaseException as exc:
            hello["error"] = f"{type(exc).__name__}: {exc}"
        hello["start_s"] = round(time.monotonic() - began, 4)  # its context and CuPy's warm-up
        trace(f"worker t{token}: ready in {hello['start_s']} s {hello.get('start_phases')}")
        # Connect only once ready: a connection the pool accepts always has its hello waiting.
        ch = connect(_connect_path)
        ch.send(hello)
        if "error" not in hello:
            _worker_channel = ch
            _worker_loop(session, ch, hello["device"])
    except BaseException:
        code = 1
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


GPU_WAIT_ENV = "HARNESS_GPU_WAIT"
# How a worker's thread waits for the GPU (the primary context's scheduling flag): the
# driver's default (auto) spins on a core for a process with one context; `block` sleeps
# until the GPU is done, for many workers sharing one GPU and the host's cores.
GPU_WAIT_FLAGS = {"auto": 0x00, "spin": 0x01, "yield": 0x02, "block": 0x04}


def set_gpu_wait(mode: str | None, ordinal: int = 0) -> str | None:
    """Set how this process waits for device `ordinal` (GPU_WAIT_FLAGS), before its primary
    context is made; None when set, else why not (no driver, an unknown mode: the driver's
    default stays, which changes no verdict, only the CPU a wait burns)."""
    if not mode:
        return None
    if mode not in GPU_WAIT_FLAGS:
        return f"{GPU_WAIT_ENV}={mode!r} is not one of {', '.join(GPU_WAIT_FLAGS)}"
    from harness.device import _driver_present

    if not _driver_present():
        return None  # no GPU here: nothing waits for one (the worker's probe says so)
    try:
        from cuda.bindings import driver

        (err,) = driver.cuInit(0)
        if err == driver.CUresult.CUDA_SUCCESS:
            err, dev = driver.cuDeviceGet(ordinal)
        if err == driver.CUresult.CUDA_SUCCESS:
            (err,) = driver.cuDevicePrimaryCtxSetFlags(dev, GPU_WAIT_FLAGS[mode])
    except Exception as exc:  # noqa: BLE001 - no driver library, no cuda.bindings
        return f"{type(exc).__name__}: {exc}"
    return None if err == driver.CUresult.CUDA_SUCCESS else f"the driver answered {err}"


def gpu_wait_mode(ordinal: int = 0) -> str | None:
    """The scheduling flag of device `ordinal`'s primary context (a GPU_WAIT_FLAGS name), or
    None when the driver cannot say."""
    try:
        from cuda.bindings import driver

        err, dev = driver.cuDeviceGet(ordinal)
        if err != driver.CUresult.CUDA_SUCCESS:
            return None
        err, flags, _active = driver.cuDevicePrimaryCtxGetState(dev)
    except Exception:  # noqa: BLE001
        return None
    if err != driver.CUresult.CUDA_SUCCESS:
        return None
    return {v: k for k, v in GPU_WAIT_FLAGS.items()}.get(int(flags) & 0x07)


def _prepare_device() -> dict:
    """Make the context now, so the first gate does not pay for it. Under a sanitizer,
    switch CuPy's pools off: one pooled allocation would hide an out-of-bounds access.
    First, how the worker waits for the GPU (HARNESS_GPU_WAIT), which must precede the
    context. Returns the seconds each step took (the worker's hello carries them)."""
    phases = {}
    began = time.monotonic()

    def lap(name: str) -> None:
        nonlocal began
        now = time.monotonic()
        phases[name] = round(now - began, 4)
        began = now

    why_not = set_gpu_wait(os.environ.get(GPU_WAIT_ENV))
    if why_not:
        print(f"harness: the GPU wait mode was not set: {why_not}", file=sys.stderr)
    try:
        import cupy
    except Exception:
        return phases
    lap("wait_mode")
    if os.environ.get("HARNESS_SANITIZER_LOG"):
        cupy.cuda.set_allocator(None)
        cupy.cuda.set_pinned_memory_allocator(None)
    try:
        cupy.cuda.runtime.free(0)
        lap("context")
        # CuPy loads each of its own kernels on first use: load the common ones now.
        a = cupy.zeros(256, dtype=cupy.float32)
        a.fill(1.0)
        b = cupy.arange(256, dtype=cupy.int32)
        (a + b).sum()
        cupy.asarray(a.get())
        lap("cupy_kernels")
        if not os.environ.get("HARNESS_SANITIZER_LOG"):
            # One allocation now, handed back to CuPy's pool: later buffers are carved out of
            # it instead of each new size costing a cudaMalloc (a gate that sweeps 16 split
            # counts spent about 10 ms in each of its 16 scratch allocations on the H200).
            del a, b
            cupy.empty(POOL_RESERVE_MB << 20, dtype=cupy.uint8)  # freed at once: into the pool
        cupy.cuda.runtime.deviceSynchronize()
        lap("pool")
    except Exception:
        pass
    return phases


def _device_facts() -> dict:
    from harness import device

    p = device.probe()
    if not p.usable:
        return {}
    facts = device.current_device_facts()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    entry = visible.split(",")[0].strip() if visible else ""
    if entry.isdigit():
        facts["ordinal"] = int(entry)
    mode = gpu_wait_mode()
    if mode:
        facts["gpu_wait"] = mode  # how this worker's thread waits for the GPU (HARNESS_GPU_WAIT)
    return facts


class _Profile:
    """HARNESS_WORKER_PROFILE=DIR: the worker profiles itself (cProfile) and writes
    DIR/worker-PID.prof before it waits for each message (a worker may be killed at any
    time after). For finding where a campaign's time goes; off by default."""

    def __init__(self, folder: str | None):
        self.path = None
        self.prof = None
        if folder:
            import cProfile

            Path(folder).mkdir(parents=True, exist_ok=True)
            self.path = Path(folder) / f"worker-{os.getpid()}.prof"
            self.prof = cProfile.Profile()
            self.prof.enable()

    @classmethod
    def from_environment(cls) -> "_Profile":
        return cls(os.environ.get("HARNESS_WORKER_PROFILE"))

    def dump(self) -> None:
        if self.prof is not None:
            self.prof.disable()
            self.prof.dump_stats(str(self.path))
            self.prof.enable()


class _ReportSink:
    def __init__(self):
        self.reports: list = []

    def pytest_runtest_logreport(self, report) -> None:
        self.reports.append(report)


def _worker_loop(session, ch: Channel, facts: dict) -> None:
    """Serve gates and mutants over `ch`; `facts` are the device facts this worker said hello
    with (its gates' reports carry them)."""
    config = session.config
    items = {item.nodeid: item for item in session.items}
    sink = _ReportSink()
    config.pluginmanager.register(sink, "harness-worker-sink")
    from harness import sanitizer

    watch = sanitizer.LogWatch.from_environment()
    props = []
    if facts:
        props += [("device", facts.get("name", "")), ("device_ordinal", str(facts.get("ordinal", ""))),
                  ("device_uuid", facts.get("uuid", ""))]
    profile = _Profile.from_environment()
    while True:
        try:
            msg = ch.recv()
        except ChannelClosed:
            break
        profile.dump()
        if msg.get("op") == "quit":
            session._setupstate.teardown_exact(None)
            ch.send({"op": "bye"})
            break
        if msg.get("op") == "run_set":
            reply = _run_set(session, items, sink, msg, props)
            why_not = "not asked to serve another mutant"
            if any(o["poisoned"] for o in reply["outcomes"]):
                why_not = "a gate left the CUDA context unusable"
            elif msg.get("reuse"):
                began = time.monotonic()
                why_not = reset_for_next_mutant(session)
                reply["reset_s"] = round(time.monotonic() - began, 4)
            reply["reusable"] = why_not is None
            reply["why_not_reusable"] = why_not
            ch.send(reply)
            if why_not is None:
                continue
            break  # no cache, buffer or stray store of this mutant outlives it
        if msg.get("op") != "run":
            continue
        item = items.get(msg["nodeid"])
        if item is None:
            ch.send({"op": "done", "reports": [], "missing": True})
            continue
        nextitem = items.get(msg.get("nextid") or "")
        sink.reports.clear()
        before = launches
        try:
            session._setupstate.teardown_exact(item)
        except BaseException:
            pass  # a finaliser of an earlier gate failed; that gate already has its verdict
        trace(f"  run {item.nodeid}")
        config.hook.pytest_runtest_protocol(item=item, nextitem=nextitem)
        if watch is not None:
            watch.attribute(sink.reports, launches - before)
        out = []
        poisoned = False
        for rep in sink.reports:
            rep.user_properties.extend(props)
            if any(k == "poisoned_context" and v == "true" for k, v in rep.user_properties):
                poisoned = True
            out.append(config.hook.pytest_report_to_serializable(config=config, report=rep))
        phases = {rep.when: round(rep.duration, 4) for rep in sink.reports}
        ch.send({"op": "done", "reports": out, "poisoned": poisoned, "launches": launches - before,
                 "phases": phases})
        if poisoned:
            break


def _outcome(item, reports: list, shadow_hits: int | None = None) -> dict:
    """One gate's outcome from its phase reports, judged as the plugin judges it (a trap
    gate passes when its body died by a device fault). A trap gate run in the trap shadow
    (harness.compile.TRAP_SHADOW_PREAMBLE) also passes when its guards counted
    (`shadow_hits` > 0): the real kernel would have trapped at the first of them."""
    props = {}
    outcome, route, line, message = "passed", None, None, None
    for rep in reports:
        props.update((k, v) for k, v in rep.user_properties)
        if rep.skipped and outcome == "passed":
            outcome = "skipped"
        elif rep.failed and outcome not in ("failed", "error"):
            outcome = "failed" if rep.when == "call" else "error"
            route = dict(rep.user_properties).get("route", "error")
            line = dict(rep.user_properties).get("first_failure_line")
            message = getattr(rep, "harness_failure_message", None) or str(rep.longrepr)[:4000]
    if item.get_closest_marker("trap") is not None and outcome in ("passed", "failed"):
        if shadow_hits:
            outcome, route, line, message = "passed", None, None, None
        elif outcome == "passed":
            outcome, route = "failed", "assertion"
            line = "the device guard did not fire: the gate's body returned normally"
        elif route == "trap":
            outcome, route, line = "passed", None, None
    return {"nodeid": item.nodeid, "outcome": outcome, "route": route, "first_failure_line": line,
            "failure_message": message, "poisoned": props.get("poisoned_context") == "true",
            "duration": round(sum(getattr(rep, "duration", 0.0) or 0.0 for rep in reports), 4),
            "shadow_hits": shadow_hits}


def _run_set(session, items: dict, sink: _ReportSink, msg: dict, props: list) -> dict:
    """A mutant's gates in this fresh worker, against its sandboxed kernel root: in order,
    stopping at the first kill by assertion unless told to run them all, and at a gate that
    poisoned the context (the rest go to another fresh worker). The trap gates named in
    `trap_shadow` run in the trap shadow, here, their guards counted instead of trapping."""
    from harness import _settings

    _settings.configure(kernel_root=msg["kernel_root"])
    gates = list(msg["gates"])
    shadowed = set(msg.get("trap_shadow") or ())
    outcomes = []
    protocol = 0.0  # seconds inside pytest's run-test protocol (the gates' reports time less of it)
    for i, nodeid in enumerate(gates):
        item = items.get(nodeid)
        if item is None:
            outcomes.append({"nodeid": nodeid, "outcome": "not run", "route": None,
                             "first_failure_line": "not collected by the campaign's workers", "poisoned": False})
            continue
        nxt = items.get(gates[i + 1]) if i + 1 < len(gates) else None
        if msg.get("announce"):
            try:
                _worker_channel.send({"op": "gate", "nodeid": nodeid})  # the executor's per-gate deadline
            except (OSError, AttributeError):
                pass
        sink.reports.clear()
        try:
            session._setupstate.teardown_exact(item)
        except BaseException:
            pass
        began = time.monotonic()
        hits = None
        if nodeid in shadowed:
            hits = _in_trap_shadow(lambda: session.config.hook.pytest_runtest_protocol(item=item, nextitem=nxt))
        else:
            session.config.hook.pytest_runtest_protocol(item=item, nextitem=nxt)
        protocol += time.monotonic() - began
        out = _outcome(item, sink.reports, shadow_hits=hits)
        outcomes.append(out)
        if out["poisoned"] or (msg.get("stop_on_kill") and out["outcome"] == "failed" and out["route"] == "assertion"):
            break
    return {"op": "done_set", "outcomes": outcomes, "protocol_s": round(protocol, 4)}


def _in_trap_shadow(run) -> int | None:
    """Run `run()` with every module loaded afresh in its trap-shadow build; the guards they
    counted, or None when the context cannot say (the gate left a sticky error: a guard
    counted before it, or a fault the real run has too; either way a trap gate's pass)."""
    from harness import kernels

    kernels.forget_loaded()  # no module loaded before (the real build) serves the gate
    kernels.set_trap_shadow(True)
    try:
        run()
        try:
            return kernels.trap_shadow_hits()
        except Exception:  # noqa: BLE001 - a sticky error: the counters cannot be read
            return None
    finally:
        kernels.set_trap_shadow(False)
        kernels.forget_loaded()  # and no shadow module serves a later gate


def reset_for_next_mutant(session) -> str | None:
    """Make this worker as good as fresh for the next mutant; None when it is, else why not.

    Nothing a mutant computed may reach the next one: every fixture is torn down; every
    functools cache of the project's own modules (gates, oracles, launchers) is cleared,
    except those marked `harness.host_cache` (pure host data, no kernel involved); every
    loaded module is dropped; every device buffer must be back in CuPy's pool, so none
    outlives the mutant (a stray store of this mutant landed in memory that the next one
    allocates and fills afresh). A context with a sticky error is not reused."""

    from harness import device, kernels

    try:
        session._setupstate.teardown_exact(None)
    except BaseException as exc:  # noqa: BLE001 - a finaliser of the mutant's gates failed
        return f"a fixture's teardown raised {type(exc).__name__}: {exc}"
    clear_project_caches(Path(session.config.rootpath))
    kernels.forget_loaded()
    # pytest keeps the last failure for a post-mortem debugger (sys.last_value and friends):
    # its traceback's frames hold the failed gate's device buffers. A killed mutant always
    # leaves one; it must not keep them past the mutant.
    for name in ("last_type", "last_value", "last_traceback", "last_exc"):
        if hasattr(sys, name):
            delattr(sys, name)
    gc.collect()
    if device.context_is_poisoned():
        return "the CUDA context has a sticky error"
    try:
        import cupy

        in_use = cupy.get_default_memory_pool().used_bytes()
    except Exception:  # noqa: BLE001 - no CuPy or no driver (a fake device in the harness's own tests)
        return None
    # Every buffer must be back in CuPy's pool now. The pool's memory itself is kept, not
    # handed back to the driver: giving it back and allocating it again cost the H200 about
    # 0.5 s a mutant (cudaFree and cudaMalloc), and the next mutant overwrites every buffer it
    # allocates (gates fill outputs with sentinels and copy inputs in) before reading it.
    if in_use:
        return f"{in_use} bytes of device memory are still held after the mutant's teardown"
    return None


def clear_project_caches(rootdir: Path) -> int:
    """Clear every functools cache defined in a module under `rootdir` (not an installed
    package, not the harness itself) unless marked `harness.host_cache`; returns how many
    were cleared."""
    root = str(rootdir.resolve())
    cleared = 0
    for name, mod in list(sys.modules.items()):
        f = getattr(mod, "__file__", None)
        if not f or not f.startswith(root) or "site-packages" in f:
            continue
        if name == "harness" or name.startswith("harness."):
            continue  # the harness's own caches (toolchain, compile settings, parsers) hold no kernel output
        for obj in list(vars(mod).values()):
            # A module holds no cache of its own to clear here (its functions are visited as its
            # own entry of sys.modules); and touching a lazily loaded one (importlib's
            # LazyLoader, as CuPy loads cupyx) imports it: on the H200 that was cupyx, SciPy
            # and 0.65 s of each fresh worker's first reset.
            if isinstance(obj, types.ModuleType):
                continue
            if callable(getattr(obj, "cache_clear", None)) and hasattr(obj, "cache_info") \
                    and not getattr(obj, "harness_host_cache", False):
                obj.cache_clear()
                cleared += 1
    return cleared


# ====================================================================== entry points


def _serve_main(argv: list[str]) -> int:
    path = argv[argv.index("--connect") + 1]
    args = argv[argv.index("--") + 1:] if "--" in argv else []
    return _serve(path, args)


def _serve(path: str, args: list[str], plugin_args: tuple = ()) -> int:
    """The server: say hello on the pool's socket, import what every worker needs, collect
    the files it is told (or `args`), then fork workers on request (the plugin's run loop)."""
    global _server_channel, _connect_path
    _connect_path = path
    _server_channel = connect(path)
    _server_channel.send({"role": "server", "token": None, "pid": os.getpid()})
    trace("server: started")
    _warm_imports()
    import pytest

    trace("server: imported")

    if not args:
        try:
            msg = _server_channel.recv()
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


def _worker_main(argv: list[str]) -> int:
    """An exec'd worker (under a sanitizer): collect, then serve gates as a forked one does."""
    global _connect_path, _worker_token
    _connect_path = argv[argv.index("--connect") + 1]
    token = int(argv[argv.index("--token") + 1])
    args = argv[argv.index("--") + 1:]
    _worker_token = token
    import pytest

    pytest.main(args + ["--harness-serve"])
    return 0


def exec_worker_loop(session) -> None:
    """The run loop of an exec'd worker (called by the plugin)."""
    _become_worker(session, _worker_token)


def _warm_imports() -> None:
    for name in ("numpy", "ml_dtypes", "cupy", "harness.kernels", "harness.bits", "harness.dtypes"):
        try:
            __import__(name)
        except Exception:
            pass


def _probe_main() -> int:
    print(json.dumps(_probe_dict()))
    return 0


def entry(argv: list[str]) -> int:
    """The harness's own processes: `python -m harness._serve {serve|worker|probe}` (a module
    of its own, so `-m` never runs a second copy of this one, which the package has already
    imported: the plugin reads this module's globals, the server channel and worker token)."""
    command = argv[0] if argv else ""
    if command == "serve":
        return _serve_main(argv[1:])
    if command == "worker":
        return _worker_main(argv[1:])
    if command == "probe":
        return _probe_main()
    print("usage: python -m harness._serve {serve|worker|probe} (started by the harness plugin)", file=sys.stderr)
    return 2
