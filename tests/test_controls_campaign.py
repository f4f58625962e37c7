"""The campaign end to end over a fake suite (tests/fixtures/controls_suite): every verdict,
the kill row, one compile per perturbed module, reports, exit statuses, and the promise
that the real kernel root is never written, whatever happens to the run. No GPU needed:
the fake gates read the sandbox's kernel text and fail the way real gates fail."""

import hashlib
import json
import os
import shutil
import signal
import tempfile
import threading
from pathlib import Path

import pytest

from harness.compiling.options import OPTIONS_FOLDER
from harness.campaigns.controls import CampaignConfig, Verdict, run_campaign
from harness.campaigns.controls import report as control_report
from harness.campaigns.controls.cli import ExitStatus, main
from harness.runs.slots import from_list, run_in_slots
from harness.campaigns.controls.spec import Control, Expect, Route
from tests._machine import use_child_env

SUITE = Path(__file__).parent / "fixtures" / "controls_suite"

# every control of the suite but `hangs`, which has a test (and a short deadline) of its own
CONTROLS = {
    "value_changed": (Verdict.KILLED, True),
    "scale_changed": (Verdict.KILLED, True),
    "two_files": (Verdict.KILLED, True),
    "guard_removed": (Verdict.KILLED_BY_TRAP, False),
    "guard_removed_trap": (Verdict.KILLED_BY_TRAP, True),
    "wrong_message": (Verdict.KILLED_BY_TRAP, False),
    "multiply_to_add": (Verdict.SURVIVED, False),
    "does_not_compile": (Verdict.COMPILE_ERROR, False),
    "unused_header": (Verdict.COMPILE_ERROR, False),
}


def tree_hash(root: Path) -> str:
    h = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        h.update(path.relative_to(root).as_posix().encode() + b"\0")
        if path.is_file():
            h.update(path.read_bytes())
    return h.hexdigest()


def sandboxes(name: str) -> list[Path]:
    return list(Path(tempfile.gettempdir()).glob(f"harness-{name}-*"))


def processes_mentioning(text: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if text.encode() in Path(f"/proc/{entry}/cmdline").read_bytes():
                    found.append(int(entry))
            except OSError:
                pass
    return found


def copy_suite(base: Path) -> Path:
    copy = base / "suite"
    shutil.copytree(SUITE, copy)
    return copy


def config(suite: Path, **kw) -> CampaignConfig:
    kw.setdefault("deadline", 120.0)
    kw.setdefault("controls_dir", Path("controls"))
    return CampaignConfig(
        rootdir=suite, kernel_root=Path("kernels"), report_dir=Path("report"),
        require_gpu=False, cache_dir=suite / "cache", **kw,
    )


@pytest.fixture(scope="module")
def child_env():
    with pytest.MonkeyPatch.context() as mp:
        use_child_env(mp)
        # the fake compile gate asserts that a sandboxed run hits the compile check's cubin
        mp.setenv("FAKE_SUITE_SANDBOX_MUST_HIT", "1")
        # the fake gate that plays Ctrl-C signals this process
        mp.setenv("HARNESS_FAKE_SUITE_CAMPAIGN_PID", str(os.getpid()))
        yield


@pytest.fixture(scope="module")
def campaign_tmp(tmp_path_factory):
    """The campaign's own temp folder, so parallel test workers never see each other's sandboxes."""
    return tmp_path_factory.mktemp("sandboxes")


@pytest.fixture(scope="module")
def campaign(tmp_path_factory, child_env, campaign_tmp):
    suite = copy_suite(tmp_path_factory.mktemp("campaign"))
    before = tree_hash(suite / "kernels")
    saved, tempfile.tempdir = tempfile.tempdir, str(campaign_tmp)
    try:
        result = run_campaign(config(suite, names=tuple(CONTROLS), jobs=2))
    finally:
        tempfile.tempdir = saved
    return suite, before, result


def by_name(result, name):
    (found,) = [r for r in result.controls if r.name == name]
    return found


class TestOneCampaign:
    """The tests that read the module's one campaign: a class, so that under xdist they run on
    one worker together (the root conftest's scheduler) and the campaign runs once."""

    @pytest.mark.parametrize("name", list(CONTROLS))
    def test_each_control_gets_the_verdict_its_perturbation_earns(self, campaign, name):
        _, _, result = campaign
        r = by_name(result, name)
        assert (r.verdict, r.matches) == CONTROLS[name], r

    def test_the_baseline_ran_every_module_of_the_campaign_green_first(self, campaign):
        _, _, result = campaign
        assert result.baseline.ok
        assert result.baseline.gates == 6  # gate_value.py's five and gate_scale.py's one
        assert result.arch == "sm_90"

    def test_expected_versus_observed_carries_route_and_first_failure_line(self, campaign):
        _, _, result = campaign
        (check,) = by_name(result, "value_changed").checks
        assert (check.outcome, check.route, check.met) == ("failed", "assertion", True)
        assert check.first_failure_line == "VALUE is 4 in value.cu"  # its expected "expects 3" is on line two
        (check,) = by_name(result, "guard_removed").checks
        assert (check.route, check.met) == ("trap", False)
        assert check.first_failure_line == "CUDARuntimeError: cudaErrorIllegalAddress: an illegal memory access was encountered"

    def test_the_kill_row_holds_every_red_gate_of_the_run(self, campaign):
        _, _, result = campaign
        assert [k.nodeid for k in by_name(result, "value_changed").kill_row] == [
            "gates/gate_value.py::test_value_define_is_three"]
        assert sorted(k.nodeid for k in by_name(result, "two_files").kill_row) == [
            "gates/gate_scale.py::test_scale_is_accepted", "gates/gate_value.py::test_value_define_is_three"]
        assert by_name(result, "multiply_to_add").kill_row == ()

    def test_an_invalid_control_says_why_and_runs_no_gate(self, campaign):
        _, _, result = campaign
        r = by_name(result, "does_not_compile")
        assert r.note.startswith("does not compile: value.cu(9): error: expected an expression\n")
        assert r.log is None and r.checks == ()
        assert by_name(result, "unused_header").note.startswith("no .cu under the kernel root includes unused.cuh")

    def test_each_perturbed_module_is_compiled_once_and_the_gate_run_reuses_that_cubin(self, campaign):
        suite, _, result = campaign
        ran = [r for r in result.controls if r.log is not None]
        # one cubin for the baseline's value.cu, one per control that ran (each perturbs value.cu's closure)
        assert len(list((suite / "cache").rglob("*.cubin"))) == 1 + len(ran)
        # and no sandboxed run had to compile again (the fake gate asserts a cache hit there)
        for r in ran:
            assert "gates/gate_value.py::test_module_compiles_with_its_name_expressions" not in [k.nodeid for k in r.kill_row]

    def test_a_header_edit_compiles_the_cu_that_includes_it(self, campaign):
        _, _, result = campaign
        assert by_name(result, "scale_changed").compiled == ("value.cu",)

    def test_the_real_kernel_root_is_byte_identical_after_a_campaign_with_failing_controls(self, campaign):
        suite, before, _ = campaign
        assert tree_hash(suite / "kernels") == before

    def test_no_sandbox_outlives_the_campaign(self, campaign, campaign_tmp):
        assert sorted(p.name for p in campaign_tmp.iterdir()) == []

    def test_the_reports_hold_each_control_ready_to_paste(self, campaign, tmp_path):
        _, _, result = campaign
        json_path, md_path = control_report.write(tmp_path, result)
        data = json.loads(json_path.read_text())
        assert data["ok"] is False and data["mode"] == "campaign"
        entry = {c["name"]: c for c in data["controls"]}["value_changed"]
        assert entry["verdict"] == "proven" and entry["matches_expectation"] is True
        assert entry["expected"] == [{
            "gate": "gates/gate_value.py::test_value_define_is_three", "route": "assertion", "message": "expects 3",
            "observed": {"outcome": "failed", "route": "assertion", "first_failure_line": "VALUE is 4 in value.cu"},
            "met": True, "reason": "red by assertion as expected",
        }]
        md = md_path.read_text()
        assert "## value_changed: proven" in md
        assert ("| `gates/gate_value.py::test_value_define_is_three` | assertion with `expects 3` | failed by assertion "
                "| VALUE is 4 in value.cu |") in md
        assert "| multiply_to_add | survived | **no** |" in md


def test_a_hung_run_is_killed_at_the_deadline_and_recorded_as_timeout(tmp_path, child_env, monkeypatch):
    suite = copy_suite(tmp_path)
    before = tree_hash(suite / "kernels")
    # a temp dir of this test's own (short: the child's pool keeps its socket there): a child
    # killed at its deadline cannot clean up what its pool made in it; its runner does
    private = Path(tempfile.mkdtemp(prefix="hct-", dir="/tmp"))
    monkeypatch.setenv("TMPDIR", str(private))
    monkeypatch.setattr(tempfile, "tempdir", str(private))
    from harness.campaigns.controls import runner

    runs = []

    def run_gates(*args, **kwargs):
        run = real_run_gates(*args, **kwargs)
        runs.append((kwargs["deadline"], run.timed_out, run.seconds))
        return run

    real_run_gates = runner.run_gates
    monkeypatch.setattr(runner, "run_gates", run_gates)
    try:
        # 4 s: the child starts, compiles nothing (the control did) and reaches the hang in about 1 s;
        # the baseline gets 4 times as long. Any deadline gives a timeout (the gate sleeps 600 s).
        result = run_campaign(config(suite, names=("hangs",), deadline=4.0))
        left = sorted(p.name for p in private.iterdir())
    finally:
        shutil.rmtree(private, ignore_errors=True)
    assert left == [], "a temp folder of the killed child outlived it"
    (r,) = result.controls
    assert (r.verdict, r.matches) == (Verdict.TIMEOUT, False)
    assert r.note.startswith("killed at the deadline")
    # one pytest for the baseline, green; one for the control, killed once its deadline (the
    # control's 4 s less its compile) passed: not before it, and not waited out (its gate
    # sleeps 600 s), nor run again. (Its wall time is the machine's: no bound on it here.)
    (base_deadline, base_cut, _), (deadline, cut, seconds) = runs
    assert not base_cut and cut and deadline <= 4.0 and seconds >= deadline, runs
    assert r.seconds >= 4.0
    assert processes_mentioning("harness-hangs-") == []  # the child's whole group is gone
    assert sandboxes("hangs") == []
    assert tree_hash(suite / "kernels") == before


def test_an_interrupt_kills_the_child_removes_the_sandbox_and_leaves_the_root_untouched(tmp_path, child_env):
    suite = copy_suite(tmp_path)
    before = tree_hash(suite / "kernels")
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            # the fake gate sends SIGINT to this process while its run is in flight
            run_campaign(config(suite, controls_dir=Path("controls_extra"), names=("interrupts",)))
    finally:
        signal.signal(signal.SIGINT, previous)
    assert processes_mentioning("harness-interrupts-") == []
    assert sandboxes("interrupts") == []
    assert tree_hash(suite / "kernels") == before


def test_a_killed_child_is_red_by_no_assertion_and_leaves_the_root_untouched(tmp_path, child_env):
    suite = copy_suite(tmp_path)
    before = tree_hash(suite / "kernels")
    result = run_campaign(config(suite, controls_dir=Path("controls_extra"), names=("killed",)))
    (r,) = result.controls
    assert (r.verdict, r.matches) == (Verdict.KILLED_BY_TRAP, False)
    assert r.note.startswith("the pytest process exited -9 without a report")
    assert r.checks[0].first_failure_line.startswith("the pytest process exited -9 without a report")
    assert sandboxes("killed") == []
    assert tree_hash(suite / "kernels") == before


def test_static_applies_and_compiles_every_control_and_runs_no_gate(tmp_path, child_env):
    suite = copy_suite(tmp_path)
    result = run_campaign(config(suite, static=True))
    verdicts = {r.name: (r.verdict, r.matches) for r in result.controls}
    assert verdicts.pop("does_not_compile") == (Verdict.COMPILE_ERROR, False)
    assert verdicts.pop("unused_header") == (Verdict.COMPILE_ERROR, False)
    assert set(verdicts.values()) == {(None, True)} and len(verdicts) == 8
    assert result.baseline is None and not (suite / "report" / "runs").exists()
    # the templates the launcher declares were instantiated, as the gates instantiate them
    metas = [json.loads(p.read_text()) for p in (suite / "cache").rglob("*.json")
             if OPTIONS_FOLDER not in p.relative_to(suite / "cache").parts]  # the cubins' metadata
    assert metas and {tuple(m["name_expressions"]) for m in metas} == {("fill_k<3>",)}


def run_cli(suite: Path, *args: str) -> int:
    return main(["--rootdir", str(suite), "--no-require-gpu", "--cache-dir", str(suite / "cache"),
                 "--report", str(suite / "report"), *args])


def test_the_cli_exits_zero_only_when_every_control_is_as_expected(tmp_path, child_env, capsys):
    suite = copy_suite(tmp_path)
    assert run_cli(suite, "value_changed", "guard_removed_trap") == ExitStatus.OK
    out = capsys.readouterr().out
    assert "2 of 2 controls as expected" in out
    assert json.loads((suite / "report" / "controls.json").read_text())["ok"] is True
    assert run_cli(suite, "multiply_to_add") == ExitStatus.CONTROLS_DIFFER
    assert "not as expected: multiply_to_add" in capsys.readouterr().out


def test_the_cli_refuses_invalid_controls_with_every_problem_and_runs_nothing(tmp_path, child_env, capsys):
    suite = copy_suite(tmp_path)
    (suite / "controls" / "bad.toml").write_text('descripton = "x"\n')
    assert run_cli(suite, "--static") == ExitStatus.USAGE
    err = capsys.readouterr().err
    assert "problems in the controls; nothing was run:" in err
    assert "bad.toml: descripton: unknown key; did you mean 'description'?" in err
    assert not (suite / "report").exists()


def test_the_cli_static_check_needs_no_gpu_and_reports_invalid_controls(tmp_path, child_env, capsys):
    suite = copy_suite(tmp_path)
    assert run_cli(suite, "--static", "value_changed", "two_files") == ExitStatus.OK
    assert run_cli(suite, "--static", "does_not_compile") == ExitStatus.CONTROLS_DIFFER


@pytest.fixture(scope="module")
def red_baseline(tmp_path_factory, child_env):
    """`python -m harness controls value_changed` over the suite with its kernel made
    `extern "C++"` (a gate of the baseline goes red), for TestARedBaseline: (its exit status,
    what it wrote to stderr, the campaign it ran)."""
    import contextlib
    import io

    from harness.campaigns.controls import cli

    suite = copy_suite(tmp_path_factory.mktemp("red"))
    source = suite / "kernels" / "value.cu"
    source.write_text(source.read_text().replace('extern "C" __global__', 'extern "C++" __global__'))
    real, ran, err = cli.run_campaign, [], io.StringIO()

    def run_campaign(*args, **kwargs):
        ran.append(real(*args, **kwargs))
        return ran[-1]

    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stderr(err):
        mp.setattr(cli, "run_campaign", run_campaign)
        status = run_cli(suite, "value_changed")
    (result,) = ran
    return status, err.getvalue(), result


class TestARedBaseline:
    """The campaign and the CLI over one red baseline: a class, so that under xdist they run on
    one worker together (the root conftest's scheduler) and the campaign runs once."""

    def test_a_red_baseline_stops_the_campaign_before_any_control(self, red_baseline):
        _, _, result = red_baseline
        assert not result.baseline.ok and result.controls == ()
        assert [r.nodeid for r in result.baseline.red] == ["gates/gate_value.py::test_kernel_is_extern_c"]
        assert not result.ok

    def test_the_cli_names_a_red_baseline_and_exits_with_its_own_status(self, red_baseline):
        status, err, _ = red_baseline
        assert status == ExitStatus.BASELINE_RED
        assert "gates/gate_value.py::test_kernel_is_extern_c: failed by assertion" in err


def test_parallel_jobs_run_controls_that_share_a_gate_module_at_once_in_file_order():
    def control(name, module):
        return Control(name, Path(f"{name}.toml"), "d", "w", (), (Expect(f"{module}::test_x", Route.ASSERTION),))

    controls = [control("a", "gates/m1.py"), control("b", "gates/m1.py"), control("c", "gates/m1.py"),
                control("d", "gates/m3.py")]
    started = []
    lock = threading.Lock()
    # a, b and c each wait until all three run: they end at all only if they run at once (a
    # bound stops a hang, and breaks the barrier: then run_in_slots raises and the test fails)
    together = threading.Barrier(3, timeout=300)
    slots, finished = [], []

    def one(c, slot):
        with lock:
            started.append(c.name)
            slots.append(slot)
        if c.name != "d":
            together.wait()
        return c.name

    run_in_slots(from_list(controls), 3, one, lambda c, result: finished.append(result))
    assert sorted(finished) == ["a", "b", "c", "d"] and sorted(slots[:3]) == [0, 1, 2]
    # three on one module, at once; d, fourth in file order, only once a slot was free
    assert sorted(started[:3]) == ["a", "b", "c"] and started[3] == "d", started


@pytest.fixture(scope="module")
def bench(tmp_path_factory, child_env):
    """`python -m harness.campaigns.controls.bench` over two controls, for TestTheBench: (its status, the
    suite, the campaign of its naive half)."""
    from harness.campaigns.controls import bench as bench_module

    suite = copy_suite(tmp_path_factory.mktemp("bench"))
    real, ran = bench_module.run_campaign, []

    def run_campaign(config):
        ran.append(real(config))
        return ran[-1]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(bench_module, "run_campaign", run_campaign)
        status = bench_module.main(["--rootdir", str(suite), "--no-require-gpu", "--report", str(suite / "report"),
                                    "--cache-dir", str(suite / "cache"), "value_changed", "multiply_to_add"])
    assert [c.mode for c in ran][1:] == ["naive"]  # the campaign, then the naive mode
    return status, suite, ran[1]


class TestTheBench:
    """The bench runs the campaign, then the naive mode, on the same two controls: the naive
    mode's own test reads the bench's naive half (a class: an xdist worker takes both)."""

    def test_the_bench_times_both_ways_and_checks_they_agree(self, bench):
        status, suite, _ = bench
        assert status == ExitStatus.OK
        data = json.loads((suite / "report" / "bench.json").read_text())
        assert data["disagree"] == [] and data["campaign_seconds"] > 0 and data["naive_seconds"] > 0
        assert data["verdicts"]["naive"] == {"multiply_to_add": "survived", "value_changed": "proven"}
        assert (suite / "report" / "bench-naive" / "controls.md").is_file()

    def test_naive_mode_reaches_the_same_verdicts_the_slow_way(self, bench):
        _, suite, result = bench
        assert result.mode == "naive"
        assert [(r.name, r.verdict) for r in result.controls] == [
            ("multiply_to_add", Verdict.SURVIVED), ("value_changed", Verdict.KILLED)]
        # every run compiled into a cold cache of its own, not the --cache-dir the bench was given
        assert not (suite / "cache").exists()


def test_a_skipped_control_is_not_judged_alike_in_the_progress_line_table_reports_and_exit_status(
        tmp_path, child_env, capsys, monkeypatch):
    # its one expected gate needs a GPU: the children see none, whatever this machine has
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    suite = copy_suite(tmp_path)
    status = run_cli(suite, "--controls-dir", str(suite / "controls_extra"), "gpu_only")
    out, err = capsys.readouterr()
    assert status == ExitStatus.OK, err  # not judged is not counted against the exit status
    assert "gpu_only: skipped, not judged (every gate it expects needs a GPU)" in err  # the progress line
    (row,) = [line for line in out.splitlines() if line.strip().startswith("│ gpu_only")]
    assert [cell.strip() for cell in row.strip("│ ").split("│")][:3] == ["gpu_only", "skipped", "not judged"]
    assert "0 of 0 controls as expected in" in out and "1 control(s) skipped, not judged: " in out
    md = (suite / "report" / "controls.md").read_text()
    assert "| gpu_only | skipped | not judged |" in md
    assert "**0 of 0 controls as expected**" in md and "\n1 control(s) skipped, not judged: " in md
    data = json.loads((suite / "report" / "controls.json").read_text())
    (entry,) = data["controls"]
    assert (entry["verdict"], entry["matches_expectation"]) == ("skipped", None)
    assert (data["ok"], data["judged"], data["as_expected"], data["skipped"]) == (True, 0, 0, 1)


def test_a_child_pytest_that_refuses_its_arguments_says_why_in_the_run_and_the_baseline(tmp_path, child_env):
    from harness.runs.fresh import run_gates
    from harness.runs.result import Baseline

    suite = copy_suite(tmp_path)
    empty = tmp_path / "empty"
    empty.mkdir()

    def run(target, kernel_root):
        return run_gates([target], kernel_root=kernel_root, rootdir=suite, report_dir=tmp_path / "r", deadline=120,
                         cache_dir=suite / "cache", require_gpu=False)

    # the child's usage error before any report: the note quotes it, not only the log's path
    refused = Baseline.of(run("gates/gate_value.py", empty))
    assert f"harness: kernel root {empty} holds no .cu file" in refused.note, refused.note
    # a usage error after the report was written (a gate that breaks the vocabulary): the same
    (suite / "gates" / "gate_no_kind.py").write_text("import pytest\n\n\n@pytest.mark.gpu\ndef test_no_kind():\n"
                                                     "    pass\n")
    vocabulary = Baseline.of(run("gates/gate_no_kind.py", suite / "kernels"))
    assert not vocabulary.ok and "harness: 1 gate(s) break the vocabulary" in vocabulary.note, vocabulary.note


def test_an_interrupted_cli_campaign_reports_what_ran_and_never_an_earlier_run(tmp_path, child_env, capsys,
                                                                              monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # gpu_only is skipped, whatever this machine has
    suite = copy_suite(tmp_path)
    extra = ("--controls-dir", str(suite / "controls_extra"))
    assert run_cli(suite, *extra, "killed") == ExitStatus.CONTROLS_DIFFER  # an earlier run's report
    assert "## killed: " in (suite / "report" / "controls.md").read_text()
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        # in file order: gpu_only runs, then the fake gate of `interrupts` sends this process SIGINT
        status = run_cli(suite, *extra, "gpu_only", "interrupts")
    finally:
        signal.signal(signal.SIGINT, previous)
    assert status == ExitStatus.INTERRUPTED
    md = (suite / "report" / "controls.md").read_text()
    assert "## killed" not in md
    assert md.startswith("# Negative controls (campaign): INTERRUPTED\n")
    assert "interrupted after 1 of 2 controls; the others did not run" in md and "## gpu_only: skipped" in md
    data = json.loads((suite / "report" / "controls.json").read_text())
    assert (data["interrupted"], data["ok"]) == (True, False)
    assert [c["name"] for c in data["controls"]] == ["gpu_only"]
    assert "report of what ran: " in capsys.readouterr().err
