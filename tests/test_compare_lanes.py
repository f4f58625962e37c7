"""`--compare-to REF` through the run's lanes: each side's gates split into lanes of whole
modules, the (side, lane) work items run at once on the run's lane count, each side's pieces
merged with every gate a lane gave no verdict for named, red. The split and the merge are pure
and tested directly; whole comparisons run on the CPU, through fresh pytests and through warm
workers of a faked device (tests/test_plugin.py's conftest)."""

from collections import Counter
from pathlib import Path

import pytest

from harness.core.records import Outcome
from harness.plugin.compare.sides import Piece, not_compared, not_compared_lines, settle
from harness.plugin.compare.work import WorkItem, work_items
from harness.pool.lanes import Gate
from harness.runs.result import GateOutcome, GateRuns, merged
from tests.test_compare import PLUGIN, git, make_project, report
from tests.test_plugin import FAKE_DEVICE_CONFTEST


@pytest.fixture
def project(pytester, monkeypatch, tmp_path):
    return make_project(pytester, monkeypatch, tmp_path)


def side(modules: dict[str, int], seconds: float = 1.0, missing: frozenset[str] = frozenset()) -> list[Gate]:
    """A side's gates: `modules` {file: how many gates}, each gate `seconds`, in file order."""
    return [Gate(f"{m}::g{i}", m, seconds) for m, n in modules.items() for i in range(n)
            if f"{m}::g{i}" not in missing]


def test_each_side_gets_every_gate_once_in_lanes_of_whole_modules():
    modules = {"a.py": 3, "b.py": 2, "c.py": 2, "d.py": 1}
    items = work_items({"ref": side(modules), "today": side(modules)}, 3)
    for name in ("ref", "today"):
        mine = [i for i in items if i.side == name]
        assert Counter(g for i in mine for g in i.gates) == Counter(g.nodeid for g in side(modules))
        assert len(mine) == 3 and sorted(i.lane for i in mine) == [0, 1, 2]
        for m in modules:  # no module is cut: none alone outlasts a lane's share (8 s over 3 lanes)
            assert sum(1 for i in mine if any(g.startswith(m) for g in i.gates)) == 1, (m, mine)
        for i in mine:  # each lane in the run's order
            order = [g.nodeid for g in side(modules)]
            assert list(i.gates) == sorted(i.gates, key=order.index)


def test_items_start_costliest_first_with_refs_and_todays_lane_of_each_rank_together():
    gates = side({"small.py": 1}) + side({"big.py": 1}, seconds=4.0) + side({"mid.py": 2})
    items = work_items({"ref": gates, "today": gates}, 3)
    assert [(i.side, i.lane, i.seconds) for i in items] == [
        ("ref", 0, 4.0), ("today", 0, 4.0), ("ref", 1, 2.0), ("today", 1, 2.0), ("ref", 2, 1.0), ("today", 2, 1.0)]
    assert [i.gates for i in items[::2]] == [("big.py::g0",), ("mid.py::g0", "mid.py::g1"), ("small.py::g0",)]


def test_one_lane_is_refs_whole_side_then_todays_in_the_runs_order():
    # one lane (--harness-lanes 1, --compare-timing, two cores): the sides one after the other, as before lanes
    modules = {"b.py": 2, "a.py": 3}
    new_today = "b.py::g1"
    items = work_items({"ref": side(modules, missing=frozenset({new_today})), "today": side(modules)}, 1)
    order = [g.nodeid for g in side(modules)]
    assert items == [WorkItem("ref", 0, tuple(g for g in order if g != new_today), 4.0),
                     WorkItem("today", 0, tuple(order), 5.0)]


def test_a_side_with_no_gate_gives_no_item_and_the_other_side_still_runs():
    items = work_items({"ref": [], "today": side({"a.py": 2})}, 4)
    assert [(i.side, i.gates) for i in items] == [("today", ("a.py::g0",)), ("today", ("a.py::g1",))]


@pytest.mark.parametrize("lanes", [0, -1, 1.5, True, "2"])
def test_a_lane_count_that_is_not_a_whole_number_from_one_is_refused(lanes):
    with pytest.raises(ValueError, match=r"a comparison's lanes: a whole number from 1, got"):
        work_items({"ref": side({"a.py": 1})}, lanes)


def test_a_gate_named_twice_on_a_side_is_refused_naming_it():
    gates = side({"a.py": 2}) + [Gate("a.py::g0", "a.py", 1.0)]
    with pytest.raises(ValueError, match=r"today's gates name a\.py::g0 more than once: each gate runs once a side"):
        work_items({"today": gates}, 2)


def test_a_split_that_loses_a_gate_stops_the_comparison_rather_than_compare_it_with_nothing(monkeypatch):
    from harness.plugin.compare import work

    monkeypatch.setattr(work, "split", lambda gates, lanes: [[g.nodeid for g in gates[1:]]])
    with pytest.raises(RuntimeError, match=r"the split of ref's 2 gates into lanes did not place each once"):
        work_items({"ref": side({"a.py": 2})}, 2)


@pytest.mark.parametrize("args, lanes, why", [
    (["--harness-lanes=4"], 4, "--harness-lanes"),
    (["--harness-lanes=4", "--compare-timing"], 1, "--compare-timing"),
])
def test_a_comparisons_lanes_are_the_runs_and_timing_keeps_one(project, args, lanes, why):
    from harness.plugin.pool import lanes_setting
    from harness.plugin.state import Role

    config = project.parseconfig(*PLUGIN, "--compare-to=HEAD", *args)
    assert lanes_setting(Role(serving=False, xdist_worker=False, xdist_controller=False), None, config) == (lanes, why)


# ------------------------------------------------------------------ each side's pieces, merged


def ran(*nodeids: str, red: str | None = None) -> tuple[GateOutcome, ...]:
    return tuple(GateOutcome(n, Outcome.FAILED if n == red else Outcome.PASSED) for n in nodeids)


def not_run(*nodeids: str) -> tuple[GateOutcome, ...]:
    return tuple(GateOutcome(n, Outcome.NOT_RUN) for n in nodeids)


def test_merged_pieces_keep_every_outcome_and_each_stopped_lanes_note():
    a = GateRuns(ran("a::1", "a::2"), seconds=2.0, log="a.log")
    b = GateRuns(ran("b::1") + not_run("b::2"), timed_out=True, seconds=5.0, log="b.log",
                 timeout_note="b::2 ran past its deadline")
    c = GateRuns(not_run("c::1"), crashed="the worker process ended without a verdict", seconds=1.0, waited=0.5)
    whole = merged([a, b, c])
    assert [o.nodeid for o in whole.outcomes] == ["a::1", "a::2", "b::1", "b::2", "c::1"]
    assert set(whole.records) == {"a::1", "a::2", "b::1"}
    assert whole.timed_out and whole.crashed == "the worker process ended without a verdict"
    assert whole.timeout_note == "b::2 ran past its deadline" and whole.log == "b.log"
    assert whole.seconds == 5.0 and whole.waited == 0.5  # side by side: the longest piece's wall
    assert merged([a]) is a and merged([]).outcomes == ()


def test_a_lane_that_timed_out_and_one_that_crashed_name_their_unrun_gates_not_compared_and_red(tmp_path):
    logs = tmp_path / "runs"
    logs.mkdir()
    (logs / "lane2.log").write_text("$ python -m pytest ...\nE   RuntimeError: the worker died\n")
    report_dir = tmp_path / "report"
    report_dir.mkdir()
    (report_dir / "compare-today-lane9.log").write_text("an earlier run's\n")
    today = settle("today", [
        Piece(0, ("a::1", "a::2"), GateRuns(ran("a::1", "a::2"))),
        Piece(1, ("b::1", "b::2"), GateRuns(ran("b::1") + not_run("b::2"), timed_out=True, seconds=60.0,
                                            timeout_note="b::2 ran past its deadline")),
        Piece(2, ("c::1",), GateRuns((), crashed="the pytest process exited -9 without a report",
                                     log=str(logs / "lane2.log"))),
    ], frozenset(), report_dir, tmp_path)
    ref = settle("REF", [Piece(0, ("a::1", "a::2", "b::1", "b::2", "c::1"),
                               GateRuns(ran("a::1", "a::2", "b::1", "b::2", "c::1", red="a::2")))],
                 frozenset(), report_dir, tmp_path)
    gates = ["a::1", "a::2", "b::1", "b::2", "c::1"]
    unrun = not_compared(gates, {"ref": ref, "today": today})
    assert unrun == {
        "b::2": "not compared: today gave no verdict: not run (killed at the deadline after 60 s: b::2 ran past "
                "its deadline)",
        "c::1": "not compared: today gave no verdict: not run (the pytest process exited -9 without a report; its "
                "pytest said: E   RuntimeError: the worker died; its log: report/compare-today-lane3.log)",
    }
    assert not_compared_lines(unrun)[0] == "2 gate(s) not compared, each red: a side gave no verdict for it"
    assert sorted(p.name for p in report_dir.iterdir()) == ["compare-today-lane3.log"]  # the stale one went


def test_a_gate_its_worker_did_not_collect_says_so_in_its_own_line(tmp_path):
    piece = Piece(0, ("a::1", "a::2"), GateRuns(ran("a::1") + (
        GateOutcome("a::2", Outcome.NOT_RUN, first_failure_line="not collected by the campaign's workers"),)))
    got = settle("today", [piece], frozenset(), tmp_path, tmp_path)
    assert got.outcome("a::2") == "not run (not collected by the campaign's workers)"
    assert got.silent(["a::1", "a::2"]) == ["a::2"]


# ------------------------------------------------------------------ whole comparisons on the CPU


SECOND = """
import numpy as np
import pytest

import harness


@pytest.mark.structural
def test_ramp():
    harness.record("r", np.arange(5, dtype=np.float32))


@pytest.mark.structural
def test_constant():
    harness.record("c", np.full(2, 7, np.int32))
"""

RECORD_RUNS = """
import os

import pytest


@pytest.fixture(autouse=True)
def _noted(request):
    from harness.library.kernels import kernel_root

    with open(os.environ["RUNS"], "a") as f:
        f.write(f"{kernel_root()} {request.node.nodeid} {os.getpid()}\\n")
"""

GPU_GATE = """
import numpy as np
import pytest

import harness


@pytest.mark.gpu
@pytest.mark.anchor
def test_on_the_device():
    harness.record("d", np.arange(3, dtype=np.float32))
"""


def two_modules(project, tmp_path, monkeypatch) -> Path:
    """The project's module and a second one, each gate noting (tree, gate, process) in a file."""
    (project.path / "gates" / "test_second.py").write_text(SECOND)
    (project.path / "gates" / "conftest.py").write_text(RECORD_RUNS)
    git(project.path, "add", ".")
    git(project.path, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "two modules")
    runs = tmp_path / "runs"
    monkeypatch.setenv("RUNS", str(runs))
    return runs


def each_side_ran_every_gate_once(runs: Path, gates: int) -> dict[str, list[str]]:
    """{tree: its gates' process ids}: two trees, each gate once on each."""
    lines = [line.split() for line in runs.read_text().splitlines()]
    trees: dict[str, list[tuple[str, str]]] = {}
    for tree, gate, pid in lines:
        trees.setdefault(tree, []).append((gate, pid))
    assert len(trees) == 2, lines
    for tree, seen in trees.items():
        assert len(seen) == gates and len({g for g, _ in seen}) == gates, (tree, seen)
    return {tree: [pid for _, pid in seen] for tree, seen in trees.items()}


def test_both_sides_through_two_lanes_of_fresh_pytests_still_compare_every_arm(project, tmp_path, monkeypatch):
    runs = two_modules(project, tmp_path, monkeypatch)
    result = project.runpytest_subprocess(*PLUGIN, "gates", "--harness-report=report", "--compare-to=HEAD",
                                          "--harness-lanes=2")
    out = result.stdout.str()
    assert result.ret == 0, out
    assert "compare to HEAD: each side's gates in 2 lane(s) of whole modules, 2 at once" in out
    assert "compare to HEAD: 5 gate(s), 5 arm(s): 5 same bits" in out
    assert sorted(a["status"] for g in report(project)["gates"] for a in g["arms"]) == ["same bits"] * 5
    pids = each_side_ran_every_gate_once(runs, 5)
    assert all(len(set(p)) == 2 for p in pids.values()), pids  # a fresh pytest a lane: two a side
    how = report(project)["run"]  # how the sides ran, in compare.json
    assert (how["lanes"], how["at_once"], how["workers"]) == (2, 2, None)
    assert sorted((p["side"], p["lane"]) for p in how["pieces"]) == [("ref", 0), ("ref", 1), ("today", 0), ("today", 1)]
    assert all(sum(p["gates"] for p in how["pieces"] if p["side"] == s) == 5 for s in ("ref", "today"))
    result.assert_outcomes(passed=5)


def test_both_sides_through_two_lanes_of_warm_workers_and_the_runs_own_pool_makes_none(project, tmp_path,
                                                                                      monkeypatch):
    runs = two_modules(project, tmp_path, monkeypatch)
    (project.path / "conftest.py").write_text(FAKE_DEVICE_CONFTEST)  # the warm executor's path, on the CPU
    (project.path / "gates" / "test_device.py").write_text(GPU_GATE)
    trace = tmp_path / "trace.txt"
    monkeypatch.setenv("HARNESS_POOL_TRACE", str(trace))
    monkeypatch.delenv("HARNESS_POOL_T0", raising=False)
    result = project.runpytest_subprocess(*PLUGIN, "gates", "--harness-report=report", "--compare-to=HEAD",
                                          "--harness-lanes=2", "--compare-allow-differ")
    out = result.stdout.str()
    assert result.ret == 0, out
    assert "compare to HEAD: each side's gates in 2 lane(s) of whole modules, 2 at once" in out
    assert "compare to HEAD: 6 gate(s), 6 arm(s): 6 same bits" in out
    each_side_ran_every_gate_once(runs, 6)
    # two servers: the run's own pool (it probed the device, then closed) forked no worker; the
    # comparison's forked every worker its gates ran in
    lines = [line.split(None, 2) for line in trace.read_text().splitlines()]
    servers = [pid for _, pid, event in lines if event == "server: started"]
    assert len(servers) == 2, trace.read_text()
    forks = Counter(pid for _, pid, event in lines if event.startswith("server: fork"))
    assert forks[servers[0]] == 0 and forks[servers[1]] >= 2, (servers, forks)
    result.assert_outcomes(passed=6)


# ------------------------------------------------------------------ `python -m harness bench compare`


def test_bench_compare_times_the_plain_run_and_both_ways_and_writes_its_figures(project, tmp_path, monkeypatch,
                                                                                capsys):
    from harness.commands.bench import main

    monkeypatch.chdir(project.path)
    monkeypatch.setenv("HARNESS_CACHE_DIR", str(tmp_path / "cache"))  # no gate times: each gate its kind's cost
    out = tmp_path / "out"
    assert main(["compare", "--out", str(out), "--lanes", "2"]) == 0, capsys.readouterr()
    printed = capsys.readouterr().out
    data = __import__("json").loads((out / "bench-compare.json").read_text())
    assert set(data["runs"]) == {"plain", "lanes", "one lane"} and data["ref"] == "HEAD"
    for key, (run,) in data["runs"].items():  # one round of each (the warm-ups are not counted)
        assert run["exit"] == 0 and run["wall_s"] > 0 and run["summary"].startswith("3 passed in ")
        assert float(run["summary"].removeprefix("3 passed in ").removesuffix("s")) == run["pytest_s"]
        assert ("--compare-to=HEAD" in run["command"]) == (key != "plain")
    assert data["runs"]["plain"][0]["lanes"] is None
    # three gates of one module, no time recorded: the module alone outlasts a lane's share, so it is cut in two
    assert data["runs"]["lanes"][0]["lanes"] == 2 and data["runs"]["lanes"][0]["at_once"] == 2
    assert data["runs"]["one lane"][0]["lanes"] == 1 and data["runs"]["one lane"][0]["at_once"] == 1
    assert data["runs"]["lanes"][0]["compared"].startswith("compare to HEAD: 3 gate(s), 3 arm(s): 3 same bits")
    assert data["runs"]["plain"][0]["compare_run"] is None and data["runs"]["lanes"][0]["compare_run"]["lanes"] == 2
    assert len(data["runs"]["one lane"][0]["compare_run"]["pieces"]) == 2  # REF's whole side, then today's
    assert set(data["ratios"]) == {"lanes_over_plain", "one_lane_over_plain", "one_lane_over_lanes"}
    assert all(isinstance(v, float) for v in data["ratios"].values()) and isinstance(data["target_met"], bool)
    md = (out / "bench-compare.md").read_text()
    assert "| run | lanes a side | median wall s | median pytest s | wall / plain |" in md
    assert "Through the lanes: " in md and md in printed


@pytest.mark.parametrize("args, says", [
    (["--repeat", "0"], "error: --repeat 0: pass 1 or more"),
    (["--ref", " "], "error: --ref needs a REF"),
    (["--lanes", "x"], "error: --lanes: --harness-lanes takes a whole number from 1 or `auto`"),
])
def test_bench_compare_refuses_bad_input_before_anything_runs(tmp_path, monkeypatch, capsys, args, says):
    from harness.commands.bench import main

    monkeypatch.chdir(tmp_path)
    assert main(["compare", "--out", str(tmp_path / "out"), *args]) == 2
    assert says in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_comparisons_warm_workers_run_its_trap_gates_in_the_trap_shadow(tmp_path):
    # as a gate run judges them by default: a real trap would cost a fresh CUDA context a gate a side
    from types import SimpleNamespace

    from harness.plugin.compare import _executors

    run = SimpleNamespace(require_gpu=True)
    config = SimpleNamespace(rootpath=tmp_path)
    gates = ["gates/test_a.py::test_guard_traps", "gates/test_a.py::test_values"]
    factory = _executors(run, True, config, gates, tmp_path / "kernels", 4, frozenset(gates[:1]))
    executor = factory(None, tmp_path / "cache", "sm_90")  # made, not started: no device here
    assert executor.trap_gates == executor.shadow_gates == frozenset(gates[:1])
    assert _executors(run, True, config, gates, tmp_path, 4)(None, tmp_path, None).shadow_gates == frozenset()
