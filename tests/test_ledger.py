"""Runs that share a machine share its lanes (harness.pool.ledger, harness.pool.share): claims
written down and released, a holder killed by SIGKILL swept, claims made at once from several
processes never past the budget (and the control: without the ledger's lock they are), what
each bound gives and the line the summary says it in; then runs through pytester on a stand-in
GPU that the probe names by UUID, beside a process that holds lanes in the same ledger."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import pytest

from harness.pool import share
from harness.pool.ledger import Holding, Ledger, process_start
from harness.pool.share import GIB, Ask, GpuFacts, Limit, decide
from tests._machine import child_env, use_child_env
from tests.test_plugin import FAKE_DEVICE_CONFTEST

UUID = "GPU-fa6e0000-1111-2222-3333-444455556666"
OTHER_GPU = "GPU-0b0e0000-1111-2222-3333-444455556666"


def _gpu(free_gib: float | None = 70.0, total_gib: float | None = 80.0) -> GpuFacts:
    return GpuFacts(UUID, None if free_gib is None else int(free_gib * GIB),
                    None if total_gib is None else int(total_gib * GIB))


# ------------------------------------------------------------------ the ledger's files


def test_a_claim_is_written_down_seen_by_the_next_and_gone_once_released(tmp_path):
    ledger = Ledger(tmp_path / "ledger")
    first = ledger.claim(lambda others: Holding.of_this_process(UUID, lanes=3, workers=5))
    assert first.others == [] and first.path.exists()
    assert json.loads(first.path.read_text())["lanes"] == 3
    second = ledger.claim(lambda others: Holding.of_this_process(UUID, lanes=1, workers=3, fixed="--harness-lanes"))
    assert second.others == [first.holding], "a process may hold two claims, each its own entry"
    first.release()
    assert ledger.holdings() == [second.holding]
    second.release()
    second.release()  # again: nothing
    assert ledger.holdings() == []


_HOLDER = """
import sys, time
from harness.pool.ledger import Holding, Ledger
Ledger(__import__("pathlib").Path(sys.argv[1])).claim(lambda others: Holding.of_this_process(sys.argv[2], 4, 6))
print("claimed", flush=True)
time.sleep(120)
"""


def _holder(root: Path, gpu: str = UUID) -> subprocess.Popen:
    """A process that claims 4 lanes (6 workers) on `gpu` in the ledger at `root` and holds them."""
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(root), gpu], stdout=subprocess.PIPE, text=True,
                            env=child_env())
    assert proc.stdout.readline().strip() == "claimed"
    return proc


def test_a_holder_killed_by_sigkill_holds_nothing_even_unreaped_and_the_next_claim_sweeps_its_file(tmp_path):
    ledger = Ledger(tmp_path / "ledger")
    proc = _holder(ledger.root)
    try:
        assert [h.pid for h in ledger.holdings()] == [proc.pid]
        os.kill(proc.pid, signal.SIGKILL)
        # Not reaped yet: a zombie holds nothing either.
        for _ in range(250):
            if not ledger.holdings():
                break
            time.sleep(0.02)
        assert ledger.holdings() == []
        assert len(list(ledger.root.glob("*.json"))) == 1, "only a claim sweeps"
    finally:
        proc.kill()
        proc.wait()
    mine = ledger.claim(lambda others: Holding.of_this_process(UUID, 1, 3))
    assert mine.others == []
    assert list(ledger.root.glob("*.json")) == [mine.path], "the dead holder's file was swept"


def test_a_recycled_pid_holds_nothing_its_entry_names_a_process_started_at_another_time(tmp_path):
    ledger = Ledger(tmp_path / "ledger")
    ledger.claim(lambda others: Holding.of_this_process(UUID, 2, 4))  # makes the folder
    me = Holding.of_this_process(UUID, 2, 4)
    assert me.started == process_start(os.getpid()) != ""
    stale = Holding(pid=os.getpid(), started=str(int(me.started) + 1), gpu=UUID, lanes=8, workers=10)
    (ledger.root / "stale.json").write_text(json.dumps(stale.__dict__))
    assert [h.lanes for h in ledger.holdings()] == [2]


def _claim_at_once(root: str, locked: bool, start, done, results) -> None:
    """One of several processes that claim at once: 3 lanes on a GPU of 10 workers."""
    ledger = Ledger(Path(root))
    if not locked:  # the control: the same claim with no lock around read-then-write
        ledger._make_folder()
        ledger._locked = nullcontext
    slow = share.decide

    def decide_slowly(*args, **kwargs):  # every claimant reads before any writes, unless locked out
        time.sleep(0.3)
        return slow(*args, **kwargs)

    share.decide = decide_slowly
    gpu = GpuFacts(UUID, free=None, total=share.RESERVE_BYTES + 10 * share.WORKER_BYTES)
    start.wait()
    got = share.claim(Ask(wanted=3, beside=0), gpu, cpus=1000, ledger=ledger).share
    results.put((got.lanes, got.over))
    done.wait(60)  # held until every claim is in


def _claims_at_once(root: Path, locked: bool, n: int = 5) -> list[tuple[int, bool]]:
    ctx = multiprocessing.get_context("spawn")
    start, done, results = ctx.Event(), ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_claim_at_once, args=(str(root), locked, start, done, results)) for _ in range(n)]
    for p in procs:
        p.start()
    try:
        start.set()
        got = [results.get(timeout=60) for _ in procs]
    finally:
        done.set()
        for p in procs:
            p.join(30)
    return sorted(got)


def test_claims_made_at_once_from_several_processes_never_take_more_than_the_gpu_holds(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", child_env()["PYTHONPATH"])  # the spawned children import this harness
    got = _claims_at_once(tmp_path / "ledger", locked=True)
    # 10 workers: 3, 3, 3, then the 1 left, then nothing left: the least a run takes, over the budget.
    assert got == [(1, False), (1, True), (3, False), (3, False), (3, False)]


def test_the_control_without_the_lock_claims_made_at_once_all_take_the_whole_budget(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", child_env()["PYTHONPATH"])
    got = _claims_at_once(tmp_path / "ledger", locked=False)
    assert got == [(3, False)] * 5, "each read an empty ledger: 15 lanes on a GPU of 10 workers"


def test_a_ledger_that_cannot_be_written_leaves_the_run_its_own_host_and_gpu_and_it_says_so(tmp_path):
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("")
    got = share.claim(Ask(wanted=4, beside=2), _gpu(), cpus=16, ledger=Ledger(blocked))
    assert got.claim is None and got.share.lanes == 4
    assert got.share.line().startswith("lanes: 4 of 4 (no other harness run holds lanes here; 70.0 of 80.0 GiB free "
                                       f"at the probe; other runs not counted: the ledger could not be used ({blocked}")
    got.release()  # nothing to release


# ------------------------------------------------------------------ the budget and its line


def test_alone_with_room_a_run_gets_all_it_wants():
    got = decide(Ask(wanted=8, beside=2), _gpu(), cpus=16, holdings=[])
    assert (got.lanes, got.limit, got.over, got.workers) == (8, Limit.WANTED, False, 10)
    assert got.line() == "lanes: 8 of 8 (no other harness run holds lanes here; 70.0 of 80.0 GiB free at the probe)"


def test_the_hosts_cores_are_shared_by_every_run_on_the_machine_whatever_its_gpu():
    others = [Holding(101, "", UUID, 4, 6), Holding(102, "", OTHER_GPU, 2, 4)]
    got = decide(Ask(wanted=8, beside=2), _gpu(), cpus=16, holdings=others)
    assert (got.lanes, got.limit) == (2, Limit.CORES)
    assert got.line() == ("lanes: 2 of 8: 16 cores make 8 lanes, 6 held by other runs (2 other harness runs hold "
                          "6 lanes, 6 workers on GPU-fa6e0000; 70.0 of 80.0 GiB free at the probe)")


def test_the_gpus_memory_is_shared_by_the_runs_on_it():
    room = (80 * GIB - share.RESERVE_BYTES) // share.WORKER_BYTES
    others = [Holding(101, "", UUID, 8, room - 5)]
    got = decide(Ask(wanted=8, beside=2), _gpu(), cpus=128, holdings=others)
    assert (got.lanes, got.limit) == (3, Limit.GPU_SHARE)
    assert got.line() == (f"lanes: 3 of 8: GPU-fa6e0000 holds {room} workers of 1.5 GiB (2.0 GiB kept free), "
                          f"{room - 5} held by other runs, 2 beside this run's lanes (1 other harness run holds 8 "
                          f"lanes, {room - 5} workers on GPU-fa6e0000; 70.0 of 80.0 GiB free at the probe)")


def test_the_gpus_free_memory_bounds_a_run_whatever_else_holds_it():
    got = decide(Ask(wanted=8, beside=2), _gpu(free_gib=11.0), cpus=128, holdings=[])
    assert (got.lanes, got.limit) == (4, Limit.GPU_FREE)
    assert got.line() == ("lanes: 4 of 8: 11.0 GiB free on GPU-fa6e0000 is 6 workers of 1.5 GiB (2.0 GiB kept "
                          "free), 2 beside this run's lanes (no other harness run holds lanes here; 11.0 of 80.0 GiB "
                          "free at the probe)")


def test_with_nothing_left_a_run_takes_one_lane_and_says_it_is_over_the_budget():
    got = decide(Ask(wanted=8, beside=2), _gpu(), cpus=16, holdings=[Holding(101, "", UUID, 8, 10)])
    assert (got.lanes, got.budget, got.over, got.limit) == (1, 0, True, Limit.CORES)
    assert got.line() == ("lanes: 1 of 8: 16 cores make 8 lanes, 8 held by other runs; a run takes one lane at least, "
                          "here over the budget (1 other harness run holds 8 lanes, 10 workers on GPU-fa6e0000; 70.0 "
                          "of 80.0 GiB free at the probe)")


def test_a_fixed_count_is_honoured_and_said_to_be_over_the_budget_where_it_is():
    others = [Holding(101, "", UUID, 6, 8)]
    got = decide(Ask(wanted=4, beside=2, fixed="--harness-lanes"), _gpu(), cpus=16, holdings=others)
    assert (got.lanes, got.budget, got.over, got.limit, got.tightest) == (4, 2, True, Limit.FIXED, Limit.CORES)
    assert got.line() == ("lanes: 4, fixed by --harness-lanes, over the budget of 2: 16 cores make 8 lanes, 6 held by "
                          "other runs (1 other harness run holds 6 lanes, 8 workers on GPU-fa6e0000; 70.0 of 80.0 GiB "
                          "free at the probe)")
    within = decide(Ask(wanted=1, beside=1, fixed="--sanitize"), _gpu(None, None), cpus=16, holdings=[])
    assert within.line() == "lanes: 1, fixed by --sanitize (no other harness run holds lanes here)"


def test_the_probe_names_the_gpu_by_uuid_or_there_is_nothing_shared_to_weigh():
    probe = {"count": 2, "devices": [[0, "H", UUID], [1, "H", OTHER_GPU]], "memory": [7 * GIB, 80 * GIB]}
    assert GpuFacts.from_probe(probe, None) == GpuFacts(UUID, 7 * GIB, 80 * GIB)
    assert GpuFacts.from_probe(probe, 1) == GpuFacts(OTHER_GPU), "the memory read is the probe's device's, the first"
    assert GpuFacts.from_probe({"count": 1, "devices": []}, None) is None
    assert GpuFacts.from_probe({"count": 1, "devices": [[0, "Fake", ""]]}, None) is None


# ------------------------------------------------------------------ runs through pytester


# A stand-in GPU the probe names by UUID, with 40 of 80 GiB free, on a host of 8 cores (4 lanes).
LEDGER_CONFTEST = FAKE_DEVICE_CONFTEST + f"""
import harness.pool.lanes as lanes
import harness.pool.worker as worker

device.list_devices = lambda: [(0, "Fake GPU", "{UUID}")]
worker.device_memory = lambda: [40 << 30, 80 << 30]
lanes.host_cpus = lambda: 8
"""

# A gate that writes down the ledger's entries it sees while it runs.
GATES = """
import json, os, pathlib, tempfile, pytest

@pytest.mark.gpu
@pytest.mark.anchor
@pytest.mark.parametrize("i", range(2))
def test_g(i):
    folder = pathlib.Path(tempfile.gettempdir()) / "harness-ledger"
    seen = [json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))]
    pathlib.Path(f"seen-{{os.getpid()}}-{me}-{{i}}").write_text(json.dumps(seen))
"""


@pytest.fixture
def machine(pytester, monkeypatch, tmp_path_factory):
    """A pytester folder whose runs share a ledger (in their temp dir) with a process that holds
    2 lanes (4 workers) on the same stand-in GPU."""
    use_child_env(monkeypatch)
    monkeypatch.setenv("HARNESS_CACHE_DIR", str(pytester.path / "cache"))
    tmp = tmp_path_factory.mktemp("t")
    monkeypatch.setenv("TMPDIR", str(tmp))
    pytester.makeini("[pytest]\nkernel_root = .\n")
    pytester.makeconftest(LEDGER_CONFTEST)
    for me in "abc":
        pytester.makepyfile(**{f"test_{me}": GATES.format(me=me)})
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER.replace("4, 6", "2, 4"), str(tmp / "harness-ledger"),
                               UUID], stdout=subprocess.PIPE, text=True, env=child_env())
    assert holder.stdout.readline().strip() == "claimed"
    pytester.ledger, pytester.holder = tmp / "harness-ledger", holder
    yield pytester
    holder.kill()
    holder.wait()


def _seen(machine) -> list[list[dict]]:
    return [json.loads(p.read_text()) for p in machine.path.glob("seen-*")]


def test_a_run_beside_another_gets_the_lanes_left_says_why_and_gives_them_back(machine):
    result = machine.runpytest_subprocess("--require-gpu", "--harness-report", "rep")
    result.assert_outcomes(passed=6)
    result.stdout.fnmatch_lines(["lanes: 2 of 4: 8 cores make 4 lanes, 2 held by other runs (1 other harness run "
                                 "holds 2 lanes, 4 workers on GPU-fa6e0000; 40.0 of 80.0 GiB free at the probe)"])
    workers = {g["worker"] for g in json.loads((machine.path / "rep" / "gates.json").read_text())["gates"]}
    assert len(workers) == 2, workers
    for seen in _seen(machine):  # while it ran: the holder's entry and its own, 2 lanes and a spare beside them
        assert sorted((e["pid"] == machine.holder.pid, e["lanes"], e["workers"], e["fixed"]) for e in seen) == \
            [(False, 2, 3, ""), (True, 2, 4, "")]
    assert [h.pid for h in Ledger(machine.ledger).holdings()] == [machine.holder.pid], "its claim was released"


def test_harness_lanes_is_honoured_written_down_and_said_to_be_over_the_budget(machine):
    result = machine.runpytest_subprocess("--require-gpu", "--harness-lanes", "3")
    result.assert_outcomes(passed=6)
    result.stdout.fnmatch_lines(["lanes: 3, fixed by --harness-lanes, over the budget of 2: 8 cores make 4 lanes, 2 "
                                 "held by other runs (1 other harness run holds 2 lanes, 4 workers on GPU-fa6e0000; "
                                 "40.0 of 80.0 GiB free at the probe)"])
    mine = [e for seen in _seen(machine) for e in seen if e["pid"] != machine.holder.pid]
    assert mine and {(e["lanes"], e["workers"], e["fixed"]) for e in mine} == {(3, 4, "--harness-lanes")}


def test_a_stand_in_device_the_probe_names_by_no_uuid_claims_nothing_and_says_nothing(machine):
    machine.makeconftest(FAKE_DEVICE_CONFTEST)
    result = machine.runpytest_subprocess("--require-gpu")
    result.assert_outcomes(passed=6)
    assert "lanes:" not in result.stdout.str()
    assert all(e["pid"] == machine.holder.pid for seen in _seen(machine) for e in seen)
