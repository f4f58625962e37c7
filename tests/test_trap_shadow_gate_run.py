"""Trap gates in the gate run's trap shadow (harness.pool.traps, harness.plugin.pool), where no
GPU is: a fake device whose guard "counts" when the worker loaded its modules in the shadow
build (the settings in effect, harness.library.kernels.trap_shadow_on) and traps otherwise. A counted guard settles a pass;
a device fault settles a pass; a run that counted nothing is settled by a real trap in a
second fresh worker, so a red trap gate is always a real trap's word; --harness-real-traps
traps each for real."""

import json

import pytest

from harness.pool.controller import Ending, RunResult
from harness.plugin.pool import shadow_unsettled
from tests.test_plugin import FAKE_DEVICE_CONFTEST
from tests._machine import use_child_env


# The guard of a fake kernel: in the trap shadow it counts (a module of the shadow build in
# harness.library.kernels' loaded modules, as a real one is), else it traps.
GUARD = FAKE_DEVICE_CONFTEST + '''

class _Counted:
    def trap_shadow_hits(self):
        return 1


def guard_fires(log):
    import os
    from harness.library import kernels

    open(log, "a").write(f"{os.getpid()} {kernels.trap_shadow_on()}\\n")
    if kernels.trap_shadow_on():
        kernels._loaded[("fake",)] = _Counted()
        return
    fire_trap()
'''

GATES = """
import os, pytest
from conftest import fire_trap, guard_fires

@pytest.mark.gpu
@pytest.mark.trap
def test_guard_fires():
    guard_fires("fires.log")

@pytest.mark.gpu
@pytest.mark.trap
def test_guard_missing():
    open("missing.log", "a").write(f"{os.getpid()}\\n")

@pytest.mark.gpu
@pytest.mark.trap
def test_faults():
    open("faults.log", "a").write(f"{os.getpid()}\\n")
    fire_trap()
"""


@pytest.fixture
def suite(pytester, monkeypatch):
    use_child_env(monkeypatch)
    monkeypatch.setenv("HARNESS_CACHE_DIR", str(pytester.path / "cache"))
    pytester.makeini("[pytest]\nkernel_root = .\nharness_lanes = 1\n")
    pytester.makeconftest(GUARD)
    pytester.makepyfile(test_t=GATES)
    return pytester


def _gates(suite) -> dict:
    report = json.loads((suite.path / "rep" / "gates.json").read_text())
    return {g["nodeid"].split("::")[1]: g for g in report["gates"]}


def _runs(suite, name: str) -> list[list[str]]:
    return [line.split() for line in (suite.path / f"{name}.log").read_text().splitlines()]


def test_by_default_a_counted_guard_passes_in_the_shadow_and_only_a_red_is_left_to_a_real_trap(suite):
    result = suite.runpytest_subprocess("--require-gpu", "--harness-report", "rep")
    result.assert_outcomes(passed=2, failed=1)
    gates = _gates(suite)
    fires = _runs(suite, "fires")
    assert [shadow for _, shadow in fires] == ["True"], "one run, in the shadow, settled it"
    assert gates["test_guard_fires"]["outcome"] == "passed"
    assert gates["test_guard_fires"]["trap_shadow_hits"] == 1
    assert gates["test_guard_fires"]["isolated"] is True
    assert len(_runs(suite, "faults")) == 1, "a device fault in the shadow settles the pass: no second run"
    assert gates["test_faults"]["outcome"] == "passed" and gates["test_faults"]["trap_shadow_hits"] is None
    missing = gates["test_guard_missing"]
    assert (missing["outcome"], missing["route"]) == ("failed", "assertion")
    assert missing["first_failure_line"].startswith("the device guard did not fire")
    assert missing["trap_shadow_unsettled"] == "it counted no guard in the trap shadow"
    pids = [pid for (pid,) in _runs(suite, "missing")]
    assert len(pids) == 2 and pids[0] != pids[1], "the shadow's red was run again, for real, in a fresh worker"
    out = " ".join(result.stdout.str().split())  # the summary as rich wrapped it
    assert ("trap gates: 1 of 3 passed in the trap shadow (their guards counted, no trap; --harness-real-traps "
            "traps each for real); trapped for real: test_t.py::test_guard_missing (it counted no guard in the "
            "trap shadow)") in out


def test_real_traps_run_each_trap_gate_once_for_real(suite):
    result = suite.runpytest_subprocess("--require-gpu", "--harness-report", "rep", "--harness-real-traps")
    result.assert_outcomes(passed=2, failed=1)
    gates = _gates(suite)
    assert [shadow for _, shadow in _runs(suite, "fires")] == ["False"]
    assert gates["test_guard_fires"]["outcome"] == "passed" and gates["test_guard_fires"]["trap_shadow_hits"] is None
    assert len(_runs(suite, "missing")) == 1 and gates["test_guard_missing"]["trap_shadow_unsettled"] is None
    assert "trap gates:" not in result.stdout.str()


@pytest.mark.parametrize("result, why", [
    (RunResult(shadow_hits=2), None),
    (RunResult(shadow_hits=None, poisoned=True), None),
    (RunResult(shadow_hits=0, poisoned=True), None),
    (RunResult(shadow_hits=0), "it counted no guard in the trap shadow"),
    (RunResult(shadow_hits=None), "it counted no guard in the trap shadow"),
    (RunResult(Ending.TIMED_OUT), "it ran past its deadline in the trap shadow"),
    (RunResult(Ending.DIED, why="the worker exited with code -9"),
     "its worker died in the trap shadow: the worker exited with code -9"),
])
def test_the_shadow_settles_only_a_counted_guard_or_a_device_fault(result, why):
    assert shadow_unsettled(result) == why


def test_trap_gates_in_the_shadow_share_one_worker_made_as_good_as_fresh_after_each(suite):
    # Three trap gates whose guards count run one after another in the trap lane's worker;
    # between them it tears down every fixture and clears the project's caches, so none sees
    # what the one before it made (a stray store past a counted guard, in the real run's place
    # a trap, lands in buffers no later gate is handed).
    suite.makepyfile(test_t="""
        import functools, itertools, os, pytest
        from conftest import guard_fires

        made = itertools.count()

        @functools.cache
        def inputs():
            return next(made)

        @pytest.fixture(scope="module")
        def data():
            open("fixture.log", "a").write("up\\n")
            yield
            open("fixture.log", "a").write("down\\n")

        @pytest.mark.gpu
        @pytest.mark.trap
        @pytest.mark.parametrize("i", range(3))
        def test_guard(data, i):
            open("inputs.log", "a").write(f"{inputs()}\\n")
            guard_fires("fires.log")

        @pytest.mark.gpu
        @pytest.mark.anchor
        def test_ordinary():
            open("ordinary.log", "a").write(f"{os.getpid()}\\n")
    """)
    result = suite.runpytest_subprocess("--require-gpu", "--harness-report", "rep")
    result.assert_outcomes(passed=4)
    fires = _runs(suite, "fires")
    assert [shadow for _, shadow in fires] == ["True"] * 3
    assert len({pid for pid, _ in fires}) == 1, "one worker, the trap lane's, ran all three"
    assert {pid for (pid,) in _runs(suite, "ordinary")}.isdisjoint({pid for pid, _ in fires})
    assert (suite.path / "inputs.log").read_text().split() == ["0", "1", "2"], \
        "each gate's cache was cleared before the next"
    assert (suite.path / "fixture.log").read_text().split() == ["up", "down"] * 3
    assert all(g["trap_shadow_hits"] == 1 for n, g in _gates(suite).items() if n.startswith("test_guard"))


def test_under_xdist_each_workers_trap_gates_share_one_warm_worker_in_the_shadow(suite):
    # xdist's workers are not told their gates ahead, so there is no trap lane: each keeps one
    # worker for its trap gates, made as good as fresh after each, not a fresh one a gate.
    suite.makepyfile(test_t="""
        import pytest
        from conftest import guard_fires

        @pytest.mark.gpu
        @pytest.mark.trap
        @pytest.mark.parametrize("i", range(6))
        def test_guard(i):
            guard_fires("fires.log")
    """)
    # (no --require-gpu: xdist's controller would ask a real driver, which this machine lacks)
    result = suite.runpytest_subprocess("-n", "2", "-p", "xdist")
    result.assert_outcomes(passed=6)
    fires = _runs(suite, "fires")
    assert [shadow for _, shadow in fires] == ["True"] * 6
    assert len({pid for pid, _ in fires}) <= 2, "at most one worker for the trap gates in each xdist worker"
