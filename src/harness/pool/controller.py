"""The pytest side of the pool: the server it starts, the workers it takes (spares kept warm
ahead of need), and the watchdog that kills a worker past its gate's deadline."""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from harness.core.child import SANITIZER_LOG_CHANNEL, SANITIZER_TOOL_CHANNEL
from harness.core.device import visible_device
from harness.core.errors import DeviceLost, SetupError  # noqa: F401  (DeviceLost: callers import it from here)
from harness.pool.channel import POISONED, POOL_FOLDER_PREFIX, SERVE_MODULE, Channel, ChannelClosed, Timeout, trace
from harness.pool.endings import Ending, Received, RunResult, SetResult  # noqa: F401  (callers read them here)
from harness.pool.exits import Exits
from harness.pool.fork import ForkedServer, PoolEnd, server_start_mode

WORKER_START_TIMEOUT = 120.0  # seconds for a server or worker to start and say hello
SPARES = 4  # warm workers kept ahead of need (trap gates start on them early)
# Workers starting at once (forked, not yet said hello) in a campaign's pool, per GPU: each
# start is a cuInit and a context the driver makes while it handles the campaign's traps and
# faults one at a time; unbounded, a burst of faulting mutants piles processes up in the
# driver until none says hello in time.
MAX_STARTING = 4


class Hung:
    """The kernels that were the last launched when a gate ran past its deadline, each with
    that gate ({kernel: nodeid}): one run's, shared by its lanes. A later ordinary gate that
    launches one is stopped at that launch (`Worker.wait`), not waited for to its own
    deadline: the run already knows the kernel hangs, and N gates that launch it would
    otherwise cost N deadlines to say so. Its verdict says so and how to see its own."""

    def __init__(self):
        self.kernels: dict[str, str] = {}
        self._lock = threading.Lock()

    def note(self, kernel: str, nodeid: str) -> None:
        with self._lock:
            self.kernels.setdefault(kernel, nodeid)

    def where(self, kernel: str | None) -> str | None:
        return self.kernels.get(kernel) if kernel else None


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
        self._stopped_at: str | None = None  # the hung kernel the last gate launched (`wait`)
        self._read_ahead: list[dict] = []  # messages `has_verdict` read, for `wait` to take first
        self._closed_early: str | None = None  # the channel closed under `has_verdict`: why

    def start(self, nodeid: str, nextid: str | None, shadow: bool = False, reset: bool = False) -> None:
        """Send the gate; `wait` collects the verdict (a trap gate may be started ahead). With
        `shadow`, a trap gate runs in the trap shadow (harness.compiling.trap_shadow); with `reset`, the
        worker makes itself as good as fresh after it (`reset_for_next_mutant`), or ends."""
        self.current_gate = nodeid
        self._send({"op": "run", "nodeid": nodeid, "nextid": nextid, "trap_shadow": shadow, "reset": reset})

    def has_verdict(self) -> bool:
        """Whether the gate sent with `start` has ended (its verdict arrived, or the worker is
        gone), without waiting; `wait` then returns at once, from what was read here."""
        if (self._read_ahead and self._read_ahead[-1].get("op") == "done") or self._closed_early or not self.alive:
            return True
        while self.channel.ready():
            try:
                self._read_ahead.append(self.channel.recv())
            except ChannelClosed as exc:
                self._closed_early = str(exc)
                return True
            if self._read_ahead[-1].get("op") == "done":
                return True
        return False

    def wait(self, deadline: float, hung: Hung | None = None) -> RunResult:
        """The verdict, or a timeout `deadline` seconds after `start`. With `hung`: a timeout
        is noted there under the last kernel launched, and the gate is stopped (the worker
        killed, `RunResult.hung_in`) when it launches a kernel noted there by another gate."""
        got = self._receive("done", deadline, hung=hung)
        msg = got.msg
        result = RunResult(ending=got.ending, why=got.why, last_launch=got.last_launch)
        if hung is not None and result.ending is Ending.TIMED_OUT and result.last_launch:
            hung.note(result.last_launch, self.current_gate)
        if result.ending is Ending.STOPPED:
            result.hung_in = (self._stopped_at, hung.where(self._stopped_at))
        if msg is not None:
            result.reports = msg["reports"]
            result.poisoned = bool(msg.get("poisoned"))
            result.launches = int(msg.get("launches") or 0)
            result.phases = msg.get("phases") or {}
            result.shadow_hits = msg.get("shadow_hits")
            if result.poisoned or msg.get("ends"):  # poisoned, or it could not be made as good as fresh: it has ended
                self.ended_because = msg.get("ends") or POISONED
                self.kill()
        result.seconds = time.monotonic() - self._started
        return result

    def run_set(self, kernel_root: str, gates: list[str], deadline: float, stop_on_kill: bool,
                reuse: bool = False, gate_deadlines: dict | None = None, trap_shadow=()) -> SetResult:
        """A mutant's gates in this worker, as a `SetResult`. With
        `reuse`, a worker that reset itself cleanly stays alive for the next mutant
        (`self.alive`); otherwise, or when it could not, it is gone. `gate_deadlines`
        ({nodeid: seconds}) also bounds each gate on its own: a gate that hangs is found in
        its own time, not the whole set's. The trap gates in `trap_shadow` run in the trap
        shadow (`_in_trap_shadow`), in this worker."""
        self._send({"op": "run_set", "kernel_root": kernel_root, "gates": gates, "stop_on_kill": stop_on_kill,
                    "reuse": reuse, "announce": bool(gate_deadlines), "trap_shadow": list(trap_shadow)})
        got = self._receive("done_set", deadline, gate_deadlines)
        msg = got.msg
        self.set_seconds = time.monotonic() - self._started
        self.set_phases = {k: float((msg or {}).get(k) or 0.0) for k in ("protocol_s", "reset_s")}
        if msg is None or not msg.get("reusable"):
            self.kill()
            self.ended_because = ("it ran past its deadline" if got.ending is Ending.TIMED_OUT
                                  else got.why if got.ending is Ending.DIED and got.why
                                  else (msg or {}).get("why_not_reusable") or "it could not be reset")
        else:
            self.served += 1
        return SetResult(msg["outcomes"] if msg is not None else [], got.ending, got.why, got.last_launch)

    def _send(self, msg: dict) -> None:
        self._started = time.monotonic()
        self._send_error = None
        try:
            self.channel.send(msg)
        except OSError as exc:
            self._send_error = f"the worker could not be sent the gate ({exc})"

    def _receive(self, done: str, deadline: float, gate_deadlines: dict | None = None,
                 hung: Hung | None = None) -> Received:
        """The `done` message, or how the wait ended without it: waits at most `deadline`
        seconds after the send, and each announced gate at most its own `gate_deadlines`
        entry; a worker past either, or gone, is killed, and so is one that launches a kernel
        `hung` holds (`self._stopped_at` names it)."""
        self._stopped_at = None
        if self._send_error:
            self.kill()
            return Received(None, Ending.DIED, self._send_error)
        last = None
        gate_end = None  # when the gate running now must be done
        while True:
            now = time.monotonic()
            remaining = deadline - (now - self._started)
            if gate_end is not None:
                remaining = min(remaining, gate_end - now)
            try:
                if self._read_ahead:
                    msg = self._read_ahead.pop(0)
                elif self._closed_early:
                    raise ChannelClosed(self._closed_early)
                else:
                    msg = self.channel.recv(timeout=max(remaining, 0.0))
            except Timeout:
                self.kill()
                return Received(None, Ending.TIMED_OUT, last_launch=last)
            except ChannelClosed:
                self.kill()
                return Received(None, Ending.DIED, "the worker process ended without a verdict (it crashed or was "
                                "killed)", last)
            if msg.get("op") == "launch":
                last = msg.get("name")
                if hung is not None and hung.where(last) not in (None, self.current_gate):
                    self._stopped_at = last
                    self.kill()
                    return Received(None, Ending.STOPPED, last_launch=last)
            elif msg.get("op") == "gate":
                self.current_gate = msg.get("nodeid")
                seconds = (gate_deadlines or {}).get(msg.get("nodeid"))
                gate_end = time.monotonic() + seconds if seconds else None
            elif msg.get("op") == done:
                return Received(msg, Ending.VERDICT, last_launch=last)

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


class PoolError(SetupError, RuntimeError):
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
    worker_env: dict | None = None  # set in each worker's environment as it is forked
    # hold a fork back while this many killed workers are still exiting (None: never). A
    # campaign sets it (MAX_EXITING): it kills a worker for every fault, all run long. A gate
    # run kills its trap gates' workers at its end, where a hold would only add to the wall.
    max_exiting: int | None = None
    # at most this many workers starting at once (None: every spare at once). A campaign sets
    # it (MAX_STARTING); a gate run wants its spares all up before its trap gates.
    max_starting: int | None = None


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
        # Lanes (harness.pool.lanes) take workers from their own threads: taking, asking
        # for and keeping spares happens under this lock.
        self.lock = threading.RLock()
        # The kernels that hung in this run's gates; None waits every gate's own deadline
        # (--harness-wait-hung).
        self.hung: Hung | None = Hung()

    # ---------------------------------------------------------------- start-up

    def start_server(self, fork: bool = False) -> None:
        """Start the fork server (fork mode); it imports while this process collects. Returns at once.

        `fork`: where this process may fork (`server_start_mode`), the server is a fork of it,
        not a fresh interpreter: it has this process's imports (pytest, its plugins, the
        harness, the conftests) from its first instruction, and only imports CuPy and collects:
        the server's start is the trap gates' critical path. The server then runs its own pytest
        session, as a spawned one does, so it collects the same items with the same plugins."""
        env = dict(os.environ, **self.config.env) if self.config.env else None
        mode, why = server_start_mode() if fork else ("spawn", "asked to spawn")
        trace(f"server start: {mode} ({why})")
        if mode == "fork":
            self.server = ForkedServer.start(PoolEnd(self.path, self.listener, self.log, self.config.invocation_dir),
                                             env)
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
        env = dict(self.config.worker_env or {})
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
            channels = {SANITIZER_LOG_CHANNEL: str(log), SANITIZER_TOOL_CHANNEL: self.config.sanitizer_tool or ""}
            self._procs.append(self._popen(cmd, env={**os.environ, **channels, **env}))
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
        with self.lock:
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
        with self.lock:
            if self.main is None or not self.main.alive:
                self.main = self._spare()
            return self.main

    def fresh_worker(self) -> Worker:
        """A worker no gate has used: for a gate that runs alone (a trap gate)."""
        with self.lock:
            return self._spare()

    def ready_spare(self) -> Worker | None:
        """A spare that has already said hello, without waiting; None when none is ready yet."""
        with self.lock:
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
                # needs its tail quotes it while the pool is open), so a campaign of fresh
                # pytests leaves no folder behind.
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


class ProbeProcess:
    """The device probe in a throwaway process (no conftest loaded), started now and read later:
    for a process that must make no CUDA context and has no server to ask (xdist's controller)."""

    def __init__(self, cwd: Path, timeout: float = WORKER_START_TIMEOUT):
        self.timeout = timeout
        self.proc = subprocess.Popen([sys.executable, "-m", SERVE_MODULE, "probe"], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, cwd=cwd)

    def result(self) -> dict:
        try:
            out, err = self.proc.communicate(timeout=self.timeout)
        except subprocess.TimeoutExpired:
            self.close()
            return {"count": 0, "error": f"the device probe did not answer in {self.timeout:g} s: check the GPU (nvidia-smi)"}
        try:
            return json.loads(out.strip().splitlines()[-1])
        except (ValueError, IndexError):
            return {"count": 0, "error": f"the device probe failed: {err.strip()[-500:]}"}

    def close(self) -> None:
        """Kill it where it still runs (a run that ended before it was read)."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.communicate()


def probe_in_subprocess(cwd: Path, timeout: float = WORKER_START_TIMEOUT) -> dict:
    return ProbeProcess(cwd, timeout).result()  # waited for


def _kill_quietly(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
