"""The pool holds a fork back while killed workers are still exiting (harness.pool_exits.Exits),
on a clock the tests move; and a pool leaves nothing in the temp folder, closed, interrupted
while it closes, or never started."""

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from harness.pool import channel, controller
from harness.pool import exits as pool_exits
from tests._machine import child_env

REPO = Path(__file__).resolve().parents[1]


def _sleeper(seconds: float = 600) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({seconds})"])


def _exited_unreaped(pid: int) -> None:
    """Until `pid` (a child) has exited, leaving it a zombie: nobody reaps it yet."""
    os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)


class Clock:
    """The hold's clock: it moves only by the hold's own pauses; `on_sleep(n)` runs at the
    n-th pause (the test's events: a process exits)."""

    def __init__(self):
        self.t = 1000.0
        self.sleeps = 0
        self.on_sleep = lambda n: None

    def now(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.sleeps += 1
        self.t += seconds
        self.on_sleep(self.sleeps)


def _exits(clock: Clock, **kw) -> pool_exits.Exits:
    return pool_exits.Exits(clock=clock.now, sleep=clock.sleep, **kw)


def test_a_fork_waits_while_the_limit_of_killed_workers_are_still_exiting():
    clock = Clock()
    exits = _exits(clock, limit=1, hold_s=20.0)
    p = _sleeper()  # stands for a killed worker whose exit (its context's teardown) is slow
    try:
        exits.killed(p.pid)
        assert exits.exiting() == 1

        def exits_at_the_tenth_look(n):
            if n == 10:
                p.kill()
                _exited_unreaped(p.pid)

        clock.on_sleep = exits_at_the_tenth_look
        exits.hold()
        # held until it was gone, not a look longer: ten pauses of 0.02 s on the hold's clock
        assert clock.sleeps == 10 and exits.held_s == pytest.approx(0.2) and exits.holds == 1
        # gone once it exited, although nobody reaped it yet: a zombie counts as gone
        assert exits.exiting() == 0 and exits.exited == 1 and exits.exit_s == pytest.approx(0.2)
        assert "1 killed worker(s) were seen gone" in exits.summary() and "1 fork(s) held back" in exits.summary()
    finally:
        p.kill()
        p.wait()


def test_below_the_limit_a_fork_is_not_held():
    clock = Clock()
    exits = _exits(clock, limit=2, hold_s=20.0)
    p = _sleeper()
    try:
        exits.killed(p.pid)
        exits.hold()
        assert clock.sleeps == 0 and exits.holds == 0 and exits.summary() == ""
    finally:
        p.kill()
        p.wait()


def test_a_process_stuck_in_its_exit_holds_a_fork_back_no_longer_than_the_cap():
    clock = Clock()
    exits = _exits(clock, limit=1, hold_s=0.5)
    p = _sleeper()  # never exits in time: the pool must not stop for good
    try:
        exits.killed(p.pid)
        exits.hold()
        # the cap, give or take the last pause (0.02 s), on the hold's clock
        assert exits.holds == 1 and 0.5 - 1e-9 <= exits.held_s <= 0.52 + 1e-9, exits.held_s
        clock.t += 0.02  # past the cap whichever pause ended the hold
        assert exits.exiting() == 0, "dropped once past the cap"
        assert exits.exited == 0, "not counted as an exit it never made"
    finally:
        p.kill()
        p.wait()


def test_a_killed_worker_is_recorded_by_its_pools_exits():
    p = _sleeper()
    try:
        w = controller.Worker.__new__(controller.Worker)
        w.alive, w.pid, w.pgid = True, p.pid, None
        w.channel = channel.Channel.__new__(channel.Channel)
        w.channel.sock = __import__("socket").socket()
        w.exits = pool_exits.Exits(limit=5)
        w.kill()
        p.wait()  # SIGKILLed: reaped at once
        assert w.exits.exited == 0 and w.exits._killed, "the kill is recorded"
        assert w.exits.exiting() == 0 and w.exits.exited == 1
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_without_a_limit_nothing_is_held_and_a_campaigns_pool_has_one(tmp_path, monkeypatch):
    clock = Clock()
    exits = _exits(clock, limit=None)
    p = _sleeper()
    try:
        exits.killed(p.pid)
        exits.hold()
        assert clock.sleeps == 0 and exits.holds == 0
    finally:
        p.kill()
        p.wait()
    # the gate run's pool (the plugin's default config) never holds a fork back; a campaign's does
    assert controller.PoolConfig(rootdir=tmp_path, invocation_dir=tmp_path, pytest_args=[]).max_exiting is None
    from harness.runs.warm import WarmExecutor

    made = {}

    class Pool:
        def __init__(self, config):
            made["config"] = config

        def start_server(self):
            raise controller.PoolError("stop here: the config is what this test reads")

        def close(self):  # a failed start closes its pool
            made["closed"] = True

    monkeypatch.setattr(controller, "Pool", Pool)
    ex = WarmExecutor(rootdir=tmp_path, gates=(), kernel_root=tmp_path, cache_dir=tmp_path)
    with pytest.raises(controller.PoolError, match="stop here"):
        ex.start()
    assert made["config"].max_exiting == pool_exits.MAX_EXITING and made["closed"]
    assert made["config"].max_starting == controller.MAX_STARTING
    assert controller.PoolConfig(rootdir=tmp_path, invocation_dir=tmp_path, pytest_args=[]).max_starting is None


@contextlib.contextmanager
def _counting_pool(tmp_path, spares, max_starting):
    """A pool whose server only counts spawn requests (no process starts); closed after, so
    its folder goes (else each pool would leave one in the temp folder)."""
    pool = controller.Pool(controller.PoolConfig(rootdir=tmp_path, invocation_dir=tmp_path, pytest_args=[], spares=spares,
                                           max_starting=max_starting))
    asked = []

    class Server:
        def send(self, msg):
            asked.append(msg["token"])

        def close(self):
            pass

    pool.server_channel = Server()
    try:
        yield pool, asked
    finally:
        pool.close()


class Spare:
    """A spare that said hello (no process behind it)."""

    def kill(self):
        pass


def test_a_campaigns_pool_starts_no_more_than_its_cap_of_workers_at_once(tmp_path):
    with _counting_pool(tmp_path, spares=14, max_starting=4) as (pool, asked):
        pool.warm_up()
        assert len(asked) == 4 and pool._pending == set(asked), "4 starting, not 14"
        pool._pending.discard(asked[0])  # one said hello and became a spare
        pool.spares.append(Spare())
        pool._fill()
        assert len(asked) == 5 and len(pool._pending) == 4, "one more starts in its place"
    # with no cap (a gate run) every spare starts at once
    with _counting_pool(tmp_path, spares=14, max_starting=None) as (pool, asked):
        pool.warm_up()
        assert len(asked) == 14


# ---------------------------------------------------------------- the pool's folder


@pytest.fixture
def private_tmp(tmp_path, monkeypatch):
    """A temp folder of this test's own (short: a pool keeps its socket there), empty at the
    start. (After tmp_path: pytest's own basetemp is then made where it always is.)"""
    folder = Path(tempfile.mkdtemp(prefix="hwx-", dir="/tmp"))
    monkeypatch.setenv("TMPDIR", str(folder))
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def _config(tmp_path) -> controller.PoolConfig:
    return controller.PoolConfig(rootdir=tmp_path, invocation_dir=tmp_path, pytest_args=[])


def test_this_files_scenarios_leave_nothing_in_the_temp_folder(tmp_path):
    # every other test of this file in a pytest of its own, whose temp folder is a fresh one
    # (pytest's own basetemp elsewhere): nothing of theirs may be left in it
    private = Path(tempfile.mkdtemp(prefix="hwx-", dir="/tmp"))
    try:
        here = Path(__file__).relative_to(REPO).as_posix()
        run = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--color=no",
                              f"--basetemp={tmp_path / 'basetemp'}", here,
                              "--deselect", f"{here}::test_this_files_scenarios_leave_nothing_in_the_temp_folder"],
                             cwd=REPO, env=child_env({"TMPDIR": str(private)}), capture_output=True, text=True)
        left = sorted(p.name for p in private.iterdir())
    finally:
        shutil.rmtree(private, ignore_errors=True)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert left == [], f"left in the temp folder: {left}"


def test_a_pool_that_cannot_listen_leaves_no_folder(private_tmp, tmp_path, monkeypatch):
    import socket

    class Unbindable(socket.socket):
        def bind(self, address):
            raise OSError("address in use")

    monkeypatch.setattr(controller.socket, "socket", Unbindable)
    with pytest.raises(OSError, match="address in use"):
        controller.Pool(_config(tmp_path))
    assert list(private_tmp.iterdir()) == []


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_an_interrupt_while_the_pool_closes_still_kills_its_server_and_removes_its_folder(
        private_tmp, tmp_path, signum):
    # the interrupt comes while the main worker tears its fixtures down (close waits up to
    # 10 s for it): the server, in a session of its own, must not outlive the pool beside a
    # folder holding its log
    from harness.core.interrupt import sigterm_as_interrupt

    pool = controller.Pool(_config(tmp_path))
    # a stand-in server: a session of its own, writing into the pool's log, as the real one does
    pool.server = pool._popen([sys.executable, "-c", "import time; print('serving', flush=True); time.sleep(600)"])

    class Main:
        def quit(self):
            os.kill(os.getpid(), signum)  # raises KeyboardInterrupt here, in this (the main) thread
            time.sleep(600)

    pool.main = Main()
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt), sigterm_as_interrupt():
            pool.close()
        assert list(private_tmp.iterdir()) == [], "the pool's folder outlived an interrupted close"
        assert pool.server.wait(timeout=120) == -signal.SIGKILL, "the server outlived an interrupted close"
    finally:
        signal.signal(signal.SIGINT, previous)
        pool.kill_processes()
        pool.server.wait()


@pytest.mark.parametrize("failure", [controller.PoolError("no server said hello"), KeyboardInterrupt()],
                         ids=["start-failed", "interrupted"])
def test_a_warm_executor_whose_pool_fails_to_start_closes_it(private_tmp, tmp_path, monkeypatch, failure):
    from harness.runs.warm import WarmExecutor

    started = []
    monkeypatch.setattr(controller.Pool, "start_server", lambda self, fork=False: started.append(self.tmp))

    def collect(self, args):
        raise failure

    monkeypatch.setattr(controller.Pool, "collect", collect)
    ex = WarmExecutor(rootdir=tmp_path, gates=(), kernel_root=tmp_path, cache_dir=tmp_path)
    with pytest.raises(type(failure)):
        ex.start()
    assert started and list(private_tmp.iterdir()) == [], "the pool of a failed start outlived it"
    assert ex._pool is None


def _worker_over_a_socketpair():
    """A controller.Worker whose channel's other end is here, and whose process is a sleeper
    (what `kill` ends)."""
    import socket

    ours, theirs = socket.socketpair()
    sleeper = subprocess.Popen(["sleep", "60"])
    worker = controller.Worker(channel.Channel(ours), {"pid": sleeper.pid, "token": 1})
    return worker, channel.Channel(theirs), sleeper


def test_has_verdict_reads_ahead_without_waiting_and_wait_takes_what_it_read():
    worker, other, sleeper = _worker_over_a_socketpair()
    try:
        worker.start("t.py::test_trap", None)
        assert other.recv(timeout=5)["op"] == "run"
        assert not worker.has_verdict()  # nothing arrived: it does not wait
        other.send({"op": "launch", "name": "k.cu:k"})
        assert not worker.has_verdict()  # a launch is not a verdict
        other.send({"op": "done", "reports": [], "launches": 1})
        assert worker.has_verdict() and worker.has_verdict()  # asked again: still, and nothing lost
        result = worker.wait(deadline=5)
        assert (result.ending, result.last_launch, result.launches) == (controller.Ending.VERDICT, "k.cu:k", 1)
    finally:
        sleeper.kill()
        sleeper.wait()


def test_has_verdict_is_true_for_a_worker_gone_and_wait_then_says_it_died():
    worker, other, sleeper = _worker_over_a_socketpair()
    worker.start("t.py::test_trap", None)
    other.close()
    assert worker.has_verdict()
    result = worker.wait(deadline=5)
    assert result.ending is controller.Ending.DIED and "ended without a verdict" in result.why
    assert sleeper.wait(timeout=10) == -signal.SIGKILL  # and its process was ended


def test_a_gate_past_its_deadline_ends_timed_out_naming_its_last_launch_and_noting_the_kernel():
    worker, other, sleeper = _worker_over_a_socketpair()
    hung = controller.Hung()
    worker.start("t.py::test_spins", None)
    other.send({"op": "launch", "name": "k.cu:spin"})
    result = worker.wait(deadline=0.5, hung=hung)
    assert (result.ending, result.last_launch, result.why) == (controller.Ending.TIMED_OUT, "k.cu:spin", None)
    assert result.timed_out and not result.ran_to_its_end and hung.where("k.cu:spin") == "t.py::test_spins"
    assert sleeper.wait(timeout=10) == -signal.SIGKILL


def test_a_gate_that_launches_a_kernel_hung_earlier_is_stopped_at_that_launch():
    worker, other, sleeper = _worker_over_a_socketpair()
    hung = controller.Hung()
    hung.note("k.cu:spin", "t.py::test_spins")
    worker.start("t.py::test_also_spins", None)
    other.send({"op": "launch", "name": "k.cu:spin"})
    result = worker.wait(deadline=30, hung=hung)
    assert (result.ending, result.hung_in) == (controller.Ending.STOPPED, ("k.cu:spin", "t.py::test_spins"))
    assert not result.timed_out and result.died is None and not result.ran_to_its_end
    assert sleeper.wait(timeout=10) == -signal.SIGKILL


def test_a_mutants_gates_end_as_one_set_result():
    worker, other, sleeper = _worker_over_a_socketpair()
    try:
        outcomes = [{"nodeid": "t.py::test_a", "outcome": "passed"}]
        other.send({"op": "done_set", "outcomes": outcomes, "reusable": True})  # read once it is asked
        got = worker.run_set("kernels", ["t.py::test_a"], deadline=5, stop_on_kill=True, reuse=True)
        assert got == controller.SetResult(outcomes, controller.Ending.VERDICT)
        assert not got.timed_out and got.died is None and worker.alive and worker.served == 1
        other.close()
        got = worker.run_set("kernels", ["t.py::test_a"], deadline=5, stop_on_kill=True, reuse=True)
        assert (got.ending, got.outcomes, got.died) == (controller.Ending.DIED, [], got.why) and got.why
        assert not worker.alive and worker.ended_because == got.why
    finally:
        sleeper.kill()
        sleeper.wait()
