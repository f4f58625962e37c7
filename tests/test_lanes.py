"""Lanes (harness.pool.lanes): the split of a run's ordinary GPU gates over several warm
workers, the times file it reads, bad input, and a run through pytester with a fake device:
modules side by side in their own workers, module fixtures made once a lane, a hung gate
in one lane while the other lane's gates get their verdicts."""

import json

import pytest

from harness.pool import lanes
from harness.pool.lanes import Gate, GateTimes, split
from tests.test_plugin import FAKE_DEVICE_CONFTEST
from tests._machine import use_child_env



def _ids(plan):
    return [[n.split("::")[-1] for n in lane] for lane in plan]


def test_split_keeps_modules_whole_and_balances_them_costliest_first():
    gates = ([Gate(f"a.py::a{i}", "a.py", 1.0) for i in range(3)] + [Gate(f"b.py::b{i}", "b.py", 1.0) for i in range(2)]
             + [Gate("c.py::c0", "c.py", 2.0)])
    plan = split(gates, 2)
    assert sorted(_ids(plan)) == [["a0", "a1", "a2"], ["b0", "b1", "c0"]]


def test_split_cuts_a_module_that_alone_outlasts_a_lanes_share_into_consecutive_runs():
    gates = [Gate(f"big.py::g{i}", "big.py", 1.0) for i in range(6)] + [Gate("s.py::s", "s.py", 0.5)]
    plan = split(gates, 3)
    assert len(plan) == 3
    big = [lane for lane in _ids(plan) if any(n.startswith("g") for n in lane)]
    for lane in big:  # each piece is consecutive gates of the module, in the run's order
        idx = [int(n[1:]) for n in lane if n.startswith("g")]
        assert idx == list(range(idx[0], idx[0] + len(idx)))
    assert sorted(n for lane in _ids(plan) for n in lane) == sorted([f"g{i}" for i in range(6)] + ["s"])


def test_split_keeps_the_runs_order_inside_a_lane_and_drops_empty_lanes():
    gates = [Gate("m.py::x", "m.py", 1.0), Gate("n.py::y", "n.py", 5.0), Gate("m.py::z", "m.py", 1.0)]
    plan = split(gates, 8)
    assert sorted(_ids(plan)) == [["x", "z"], ["y"]]
    assert split(gates, 1) == [["m.py::x", "n.py::y", "m.py::z"]]
    assert split([], 4) == []


def test_gate_times_round_trip_and_a_torn_file_is_only_a_missing_hint(tmp_path):
    path = tmp_path / "gate-seconds.json"
    t = GateTimes(path)
    assert t.estimate("x::a") == lanes.DEFAULT_GATE_SECONDS
    assert t.estimate("x::b", ("gpu", "invariance")) == lanes.DEFAULT_SECONDS["invariance"]
    t.record("x::a", 1.25)
    t.save()
    assert GateTimes(path).estimate("x::a") == 1.25
    path.write_text("{not json")
    assert GateTimes(path).seconds == {}


@pytest.mark.parametrize("bad", ["0", "-2", "two", "1.5"])
def test_lanes_value_refuses_what_is_not_a_whole_number_from_one(bad):
    with pytest.raises(ValueError, match="--harness-lanes takes a whole number from 1 or `auto`"):
        lanes.lanes_value(bad)


def test_auto_lanes_is_half_the_cores_within_one_and_the_cap():
    assert lanes.auto_lanes(1) == 1
    assert lanes.auto_lanes(2) == 1
    assert lanes.auto_lanes(16) == 8
    assert lanes.auto_lanes(128) == lanes.MAX_AUTO_LANES


@pytest.fixture
def suite(pytester, monkeypatch):
    use_child_env(monkeypatch)
    monkeypatch.setenv("HARNESS_CACHE_DIR", str(pytester.path / "cache"))
    pytester.makeini("[pytest]\nkernel_root = .\n")
    pytester.makeconftest(FAKE_DEVICE_CONFTEST)
    return pytester


# Two modules whose gates can only pass side by side: each module's first gate leaves a
# file and waits (up to its bound, which only stops a hang) for the other module's. In one
# lane the first module's gate waits for a file no gate has written yet, and fails.
MEET = """
import os, pathlib, time, pytest

@pytest.fixture(scope="module")
def made():
    open("made-{me}", "a").write(f"{{os.getpid()}}\\n")

@pytest.mark.gpu
@pytest.mark.anchor
def test_meet(made):
    pathlib.Path("here-{me}").write_text(str(os.getpid()))
    for _ in range(400):
        if pathlib.Path("here-{other}").exists():
            break
        time.sleep(0.02)
    assert pathlib.Path("here-{other}").exists(), "the other module's gate never ran beside this one"

@pytest.mark.gpu
@pytest.mark.anchor
@pytest.mark.parametrize("i", range(3))
def test_more(made, i):
    open("pids-{me}", "a").write(f"{{os.getpid()}}\\n")
    from threadpoolctl import threadpool_info
    blas = max(p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas")
    open("blas-{me}", "a").write(f"{{os.environ.get('HARNESS_BLAS_THREADS')}} {{blas}}\\n")
"""


def _report(suite) -> dict:
    report = json.loads((suite.path / "rep" / "gates.json").read_text())
    return {g["nodeid"]: g for g in report["gates"]}


def test_two_lanes_run_modules_side_by_side_each_in_its_own_worker_with_its_fixtures_made_once(suite, monkeypatch):
    for name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)  # NumPy's own thread count in the child, which the lanes cap
    suite.makepyfile(test_a=MEET.format(me="a", other="b"), test_b=MEET.format(me="b", other="a"))
    result = suite.runpytest_subprocess("--require-gpu", "--harness-lanes", "2", "--harness-report", "rep")
    result.assert_outcomes(passed=8)
    pids = {m: set((suite.path / f"pids-{m}").read_text().split()) for m in "ab"}
    assert len(pids["a"]) == 1 and len(pids["b"]) == 1 and pids["a"] != pids["b"]
    for m in "ab":  # the module fixture once, in the lane's worker
        assert (suite.path / f"made-{m}").read_text().split() == sorted(pids[m])
    workers = {g["nodeid"]: g["worker"] for g in _report(suite).values()}
    assert len(set(workers.values())) == 2, workers
    times = json.loads((suite.path / "cache" / lanes.TIMES_FILE).read_text())
    assert set(times) == set(_report(suite)), "every gate's time is kept for the next split"
    share = lanes.blas_share(2)  # each lane's worker keeps to its share of the cores' BLAS threads
    for m in "ab":
        assert (suite.path / f"blas-{m}").read_text().split("\n")[:-1] == [f"{share} {share}"] * 3


def test_one_lane_runs_the_same_gates_in_order_so_the_meeting_gate_fails_by_its_own_assertion(suite):
    # The control of the test above: its meeting can only happen side by side.
    suite.makepyfile(test_a=MEET.format(me="a", other="b").replace("range(400)", "range(50)"),
                     test_b=MEET.format(me="b", other="a").replace("range(400)", "range(50)"))
    result = suite.runpytest_subprocess("--require-gpu", "--harness-lanes", "1")
    result.assert_outcomes(passed=7, failed=1)
    result.stdout.fnmatch_lines(["*the other module's gate never ran beside this one*"])
    # one worker at a time: its BLAS threads are left as NumPy made them
    assert {line.split()[0] for line in (suite.path / "blas-a").read_text().split("\n")[:-1]} == {"None"}


def test_blas_share_is_an_equal_share_of_the_cores_at_least_one():
    assert lanes.blas_share(8, cpus=16) == 2
    assert lanes.blas_share(3, cpus=16) == 5
    assert lanes.blas_share(4, cpus=2) == 1
    assert lanes.blas_share(0, cpus=4) == 4


def test_limit_blas_caps_the_pools_and_says_why_not_for_bad_input():
    __import__("numpy")  # its OpenBLAS is the pool capped
    from threadpoolctl import threadpool_info, threadpool_limits

    from harness.pool.worker import limit_blas

    before = max(p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas")
    target = 2 if before == 1 else 1  # a change either way (the test command's workers keep to 1)
    try:
        assert limit_blas(str(target)) is None
        assert all(p["num_threads"] == target for p in threadpool_info() if p["user_api"] == "blas")
    finally:
        threadpool_limits(limits=before, user_api="blas")
    assert limit_blas(None) is None and limit_blas("") is None
    for bad in ("0", "two", "-1"):
        assert limit_blas(bad) == f"HARNESS_BLAS_THREADS={bad!r} is not a whole number from 1"


def test_a_hung_gate_in_one_lane_is_timed_out_while_the_other_lane_gives_its_verdicts(suite):
    suite.makepyfile(test_h="""
        import pytest, time
        @pytest.mark.gpu
        @pytest.mark.anchor
        def test_hangs():
            time.sleep(3600)
        @pytest.mark.gpu
        @pytest.mark.anchor
        def test_after_in_a_fresh_worker():
            pass
    """, test_ok="""
        import pytest
        @pytest.mark.gpu
        @pytest.mark.anchor
        @pytest.mark.parametrize("i", range(3))
        def test_fine(i):
            assert i >= 0
    """)
    result = suite.runpytest_subprocess("--require-gpu", "--harness-lanes", "2", "--harness-deadline", "2",
                                        "--harness-report", "rep")
    result.assert_outcomes(passed=4, failed=1)
    gates = _report(suite)
    hung = gates["test_h.py::test_hangs"]
    assert hung["route"] == "timeout"
    after = gates["test_h.py::test_after_in_a_fresh_worker"]
    assert after["outcome"] == "passed"
    assert after["worker"] and after["worker"] != hung["worker"], "the hung gate's lane goes on in a fresh worker"


@pytest.mark.parametrize("args", [["--harness-lanes", "0"], ["-o", "harness_lanes=many"]])
def test_a_bad_lane_count_is_one_usage_error(suite, args):
    suite.makepyfile(test_g="""
        import pytest
        @pytest.mark.gpu
        @pytest.mark.anchor
        def test_g():
            pass
    """)
    result = suite.runpytest_subprocess(*args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--harness-lanes takes a whole number from 1 or `auto`*"])


@pytest.mark.parametrize("real", [False, True], ids=["trap-lane", "real-traps"])
def test_trap_gates_start_ahead_while_the_run_waits_on_a_lane(suite, real):
    # The run's first gate is a lane's and waits (up to its bound) for a file the trap gate
    # writes: the trap gate runs after every other gate in the report, so only its start
    # ahead, in the trap lane (the trap shadow) or on a spare that came up while the pytest
    # process waited for the lane (--harness-real-traps), lets the lane gate pass. Spares come
    # up after the lanes took theirs.
    suite.makepyfile(test_a="""
        import pathlib, time, pytest
        from conftest import fire_trap
        @pytest.mark.gpu
        @pytest.mark.anchor
        def test_waits_for_the_trap_gate():
            for _ in range(400):
                if pathlib.Path("trap-started").exists():
                    break
                time.sleep(0.02)
            assert pathlib.Path("trap-started").exists(), "the trap gate was not started ahead"
        @pytest.mark.gpu
        @pytest.mark.trap
        def test_trap():
            pathlib.Path("trap-started").write_text("1")
            fire_trap()
    """, test_b="""
        import pytest
        @pytest.mark.gpu
        @pytest.mark.anchor
        def test_other_lane():
            pass
    """)
    result = suite.runpytest_subprocess("--require-gpu", "--harness-lanes", "2", "--harness-report", "rep",
                                        *(["--harness-real-traps"] if real else []))
    result.assert_outcomes(passed=3)
    assert _report(suite)["test_a.py::test_trap"]["outcome"] == "passed"


# A gate that hangs after announcing a launch of kernel k.cu:spin, then gates that launch it,
# and one that launches another kernel. The launches are announced as harness.library.kernels' own
# launches announce themselves to the pool's worker.
HUNG_KERNEL = """
import time, pytest
from harness.library.kernels import note_launch

@pytest.mark.gpu
@pytest.mark.anchor
def test_hangs():
    note_launch("k.cu:spin")
    time.sleep(3600)

@pytest.mark.gpu
@pytest.mark.anchor
def test_launches_it_and_hangs():
    note_launch("k.cu:spin")
    time.sleep(3600)

@pytest.mark.gpu
@pytest.mark.anchor
def test_launches_another_kernel():
    note_launch("k.cu:other")
"""


def test_a_gate_that_launches_a_kernel_that_hung_earlier_is_stopped_at_the_launch_not_waited_for(suite):
    suite.makepyfile(test_h=HUNG_KERNEL)
    result = suite.runpytest_subprocess("--require-gpu", "--harness-lanes", "1", "--harness-deadline", "2",
                                        "--harness-report", "rep")
    result.assert_outcomes(passed=1, failed=2)
    gates = _report(suite)
    assert gates["test_h.py::test_hangs"]["route"] == "timeout"
    stopped = gates["test_h.py::test_launches_it_and_hangs"]
    assert stopped["route"] == "error", "stopped at the launch: not a second timeout"
    assert stopped["first_failure_line"] == "stopped at its launch of k.cu:spin, which hung in test_h.py::test_hangs"
    result.stdout.fnmatch_lines(["*not waited for: this gate launched k.cu:spin*run this gate alone*"
                                 "--harness-wait-hung*"])
    assert gates["test_h.py::test_launches_another_kernel"]["outcome"] == "passed"


def test_with_wait_hung_each_gate_that_launches_the_kernel_waits_its_own_deadline(suite):
    # The control of the test above: without the stop, the second gate times out on its own.
    suite.makepyfile(test_h=HUNG_KERNEL)
    result = suite.runpytest_subprocess("--require-gpu", "--harness-lanes", "1", "--harness-deadline", "2",
                                        "--harness-wait-hung", "--harness-report", "rep")
    result.assert_outcomes(passed=1, failed=2)
    gates = _report(suite)
    assert [gates[f"test_h.py::{g}"]["route"] for g in ("test_hangs", "test_launches_it_and_hangs")] == \
        ["timeout", "timeout"]


def test_a_few_real_trap_gates_run_at_once_and_one_that_ended_frees_its_place_before_the_run_reaches_it(suite):
    """--harness-real-traps: the run waits on a lane's gate that ends only once all five trap
    gates have run: they start ahead while it waits, at most TRAPS_AT_ONCE running at a time,
    each in its own worker (each records when it ran, then traps)."""
    from harness.pool.traps import TRAPS_AT_ONCE

    suite.makepyfile(test_a="""
        import pathlib, time, pytest

        @pytest.mark.gpu
        @pytest.mark.anchor
        def test_waits_for_every_trap_gate():
            spans = pathlib.Path("spans")
            for _ in range(1500):  # a bound on a hang, not a time the trap gates must beat
                if spans.exists() and len(spans.read_text().splitlines()) == 5:
                    break
                time.sleep(0.02)
            assert len(spans.read_text().splitlines()) == 5, "the trap gates did not run while the run waited here"
        """, test_b="""
        import pytest

        @pytest.mark.gpu
        @pytest.mark.anchor
        def test_other_lane():
            pass
        """, test_c="""
        import os, time, pytest
        from conftest import fire_trap

        @pytest.mark.gpu
        @pytest.mark.trap
        @pytest.mark.parametrize("i", range(5))
        def test_trap(i):
            began = time.time()
            time.sleep(0.2)
            open("spans", "a").write(f"{began} {time.time()} {os.getpid()}\\n")
            fire_trap()
        """)
    result = suite.runpytest_subprocess("--require-gpu", "--harness-lanes", "2", "--harness-real-traps")
    result.assert_outcomes(passed=7)
    spans = [line.split() for line in (suite.path / "spans").read_text().splitlines()]
    assert len({pid for _, _, pid in spans}) == 5  # each trap gate in a worker of its own
    most = max(sum(1 for b, e, _ in spans if float(b) <= float(t) < float(e)) for t, _, _ in spans)
    assert most <= TRAPS_AT_ONCE, spans


def test_a_run_with_fewer_gates_than_lanes_makes_no_worker_for_a_lane_it_cannot_fill(suite, monkeypatch):
    # --harness-lanes 4 over one ordinary GPU gate: the first spares count one lane, not four
    # (each worker is a CUDA context, made beside the run)
    trace = suite.path / "trace.txt"
    monkeypatch.setenv("HARNESS_POOL_TRACE", str(trace))
    monkeypatch.delenv("HARNESS_POOL_T0", raising=False)
    suite.makepyfile(test_one="""
        import pytest

        @pytest.mark.gpu
        @pytest.mark.anchor
        def test_only():
            pass
        """)
    suite.runpytest_subprocess("--require-gpu", "--harness-lanes", "4").assert_outcomes(passed=1)
    forks = [line for line in trace.read_text().splitlines() if "server: fork" in line]
    assert len(forks) == 2, trace.read_text()  # the main worker and one spare kept
