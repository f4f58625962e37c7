"""The campaign end to end over a fake suite (tests/fixtures/mutate_suite), no GPU: its fake
gates read the sandbox's text and fail the way real gates fail. Verdicts, selection, stop at
the first kill, the full matrix, resume, duplicates taking their twin's verdict, scores, the
reports, and a kernel root that is never written."""

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from harness.campaigns.mutate import report
from harness.campaigns.mutate.campaign import RESULTS_FILE, MutateConfig, run_campaign
from harness.campaigns.mutate.execute import judge
from harness.runs.result import Executor, Executors, GateOutcome, GateRuns
from harness.campaigns.mutate.verdicts import MutantResult, Score, Verdict, read_results
from tests._machine import PACKAGE, use_child_env

SUITE = Path(__file__).parent / "fixtures" / "mutate_suite"
SCHEMA = PACKAGE / "campaigns" / "mutate" / "schema" / "mutation-testing-report-schema.json"


def tree_hash(root: Path) -> str:
    h = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        h.update(path.relative_to(root).as_posix().encode() + b"\0")
        if path.is_file():
            h.update(path.read_bytes())
    return h.hexdigest()




@pytest.fixture
def suite(tmp_path, monkeypatch):
    use_child_env(monkeypatch)
    copy = tmp_path / "suite"
    shutil.copytree(SUITE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    return copy


@pytest.fixture(scope="module")
def recorded_baseline(tmp_path_factory):
    """The fake suite's baseline, run once (a pytest recording each gate's loads and reads) for
    the tests whose gate stage is a FakeExecutor's: their campaigns differ in paths, operators,
    executors and report folders, never in what a baseline runs (the suite's gates over its
    kernel root, for sm_90). The fresh-process test above runs a campaign's own baseline."""
    from harness.campaigns.mutate.campaign import run_baseline

    copy = tmp_path_factory.mktemp("baseline") / "suite"
    shutil.copytree(SUITE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    with pytest.MonkeyPatch.context() as mp:
        use_child_env(mp)
        cfg = config(copy)
        baseline, coverage = run_baseline(cfg, cfg.cache())
    assert baseline.ok and coverage is not None and coverage.recorded, baseline
    return baseline, coverage


@pytest.fixture
def shared_baseline(recorded_baseline, monkeypatch):
    """This test's campaigns read the module's one recorded baseline."""
    from harness.campaigns.mutate import campaign

    monkeypatch.setattr(campaign, "run_baseline", lambda config, cache_dir: recorded_baseline)


def config(suite: Path, **changes) -> MutateConfig:
    # jobs=1: the screen compiles in a thread of this process, which has NVRTC loaded already; a
    # pool of two spawned compilers costs seconds of imports a campaign (the end-to-end test
    # below and tests/test_mutate_screen.py keep the pool's path)
    base = dict(rootdir=suite, kernel_root=Path("kernels"), report_dir=suite / "report", jobs=1, deadline=60.0,
                require_gpu=False, cache_dir=suite / "cache", arch="sm_90")
    base.update(changes)
    return MutateConfig(**base)


def validate(doc: dict) -> None:
    import jsonschema  # a test dependency (pyproject [test]): never skipped

    jsonschema.validate(doc, json.loads(SCHEMA.read_text()))


def by_text(campaign) -> dict[tuple, MutantResult]:
    return {(r.mutant.file, r.mutant.start_line, r.mutant.original, r.mutant.replacement): r
            for r in campaign.ordered()}


def test_fresh_process_campaign_gives_every_kind_of_verdict(suite):
    root = suite / "kernels"
    before = tree_hash(root)
    campaign = run_campaign(config(suite, jobs=2, operators=("arithmetic", "guard-dropped", "int-literal")))
    assert campaign.baseline.ok, campaign.baseline
    assert tree_hash(root) == before
    ids = {m.id for m in campaign.mutants}
    left = [p for p in Path(tempfile.gettempdir()).glob("harness-mutant-*")
            if p.name.split("-")[2] in ids and p.name.split("-")[3] == str(os.getpid())]
    assert left == [], "no sandbox outlives its mutant"
    got = by_text(campaign)
    verdicts = {k: r.verdict for k, r in got.items()}
    assert verdicts[("sum.cu", 6, "+", "-")] is Verdict.KILLED
    assert verdicts[("sum.cu", 6, "i < n", "true")] is Verdict.KILLED_BY_TRAP
    assert verdicts[("sum.cu", 5, "*", "/")] is Verdict.SURVIVED
    assert verdicts[("other.cu", 4, "*=", "/=")] is Verdict.NO_COVERAGE
    assert verdicts[("other.cu", 3, "*", "/")] is Verdict.EQUIVALENT
    dup = [r for r in campaign.ordered() if r.verdict is Verdict.DUPLICATE]
    assert dup and all(r.effective is campaign.results[r.duplicate_of].verdict for r in dup)
    killed = got[("sum.cu", 6, "+", "-")]
    assert killed.killed_by == ["gates/gate_sum.py::test_adds_one"]
    assert 0 < killed.gate_seconds < killed.seconds  # the rest is its compile in the screen
    assert "out[0] is not in[0] + 1" in killed.reason
    trap = got[("sum.cu", 6, "i < n", "true")]
    assert trap.reason.startswith("killed by a trap only")
    # the direct gates ran, the source reader among them
    assert "gates/gate_sum.py::test_block_define" in killed.covered_by

    doc = report.mutation_json(campaign)
    validate(doc)
    statuses = {m["id"]: (m["status"], m["statusReason"]) for f in doc["files"].values() for m in f["mutants"]}
    assert statuses[trap.mutant.id][0] == "Killed" and "killed by a trap only" in statuses[trap.mutant.id][1]
    eq = got[("other.cu", 3, "*", "/")]
    assert statuses[eq.mutant.id] == ("Ignored", "equivalent: identical cubin")
    assert statuses[dup[0].mutant.id][1] == f"duplicate of {dup[0].duplicate_of}"
    per_file = doc["harness"]["per_file"]["sum.cu"]
    assert per_file["valid"] == per_file["total"] and per_file["score"] < per_file["stryker_score"]


class FakeExecutor(Executor):
    """Reads the mutated text like the fake gates do; records every call."""

    def __init__(self, per_gate=False, timeout_on=None):
        self.per_gate = per_gate
        self.calls = []
        self.timeout_on = timeout_on

    def run(self, sandbox, gates, deadline):
        self.calls.append(tuple(gates))
        text = (Path(sandbox) / "sum.cu").read_text()
        if self.timeout_on and self.timeout_on in text:
            return GateRuns((), timed_out=True, seconds=deadline)
        outcomes = []
        for g in gates:
            if g.endswith("test_adds_one") and "in[i] + 1;" not in text:
                outcomes.append(GateOutcome(g, "failed", "assertion", "out[0] is not in[0] + 1"))
            elif g.endswith("test_guard_keeps_the_kernel_in_bounds") and "if (i < n)" not in text:
                outcomes.append(GateOutcome(g, "failed", "trap", "CUDARuntimeError: illegal address"))
            else:
                outcomes.append(GateOutcome(g, "passed"))
        return GateRuns(tuple(outcomes), seconds=0.01)


@pytest.mark.usefixtures("shared_baseline")
def test_stop_at_the_first_kill_or_run_the_whole_matrix(suite):
    fake = FakeExecutor(per_gate=True)
    campaign = run_campaign(config(suite, paths=("sum.cu",), operators=("arithmetic",)),
                            executor_factory=Executors(lambda *a: fake))
    killed = by_text(campaign)[("sum.cu", 6, "+", "-")]
    assert killed.verdict is Verdict.KILLED and killed.gates_run[-1] == "gates/gate_sum.py::test_adds_one"
    assert len(killed.gates_run) < len(killed.covered_by) + 1
    full = FakeExecutor(per_gate=False)
    campaign = run_campaign(config(suite, paths=("sum.cu",), operators=("arithmetic",), all_gates=True,
                                   report_dir=suite / "report-all"), executor_factory=Executors(lambda *a: full))
    killed = by_text(campaign)[("sum.cu", 6, "+", "-")]
    assert len(killed.gates_run) == 4, "every gate of the family ran"
    assert all(len(c) == 4 for c in full.calls), "one batch: the whole matrix"


@pytest.mark.usefixtures("shared_baseline")
def test_a_deadline_is_a_timeout(suite):
    fake = FakeExecutor(timeout_on="(blockDim.x - 1)")
    campaign = run_campaign(config(suite, paths=("sum.cu",), operators=("gpu-index",)),
                            executor_factory=Executors(lambda *a: fake))
    assert by_text(campaign)[("sum.cu", 5, "blockDim.x", "(blockDim.x - 1)")].verdict is Verdict.TIMEOUT


@pytest.mark.usefixtures("shared_baseline")
def test_resume_runs_only_what_is_missing(suite):
    cfg = config(suite, paths=("sum.cu",), operators=("arithmetic", "guard-dropped"))
    first = FakeExecutor()
    done = run_campaign(cfg, executor_factory=Executors(lambda *a: first))
    results = suite / "report" / RESULTS_FILE
    lines = results.read_text().splitlines()
    assert len(lines) == len(done.mutants)
    results.write_text("\n".join(lines[:2]) + "\n" + lines[2][:40])  # interrupted, a torn last line
    again = FakeExecutor()
    resumed = run_campaign(MutateConfig(**{**vars(cfg), "resume": True}), executor_factory=Executors(lambda *a: again))
    assert resumed.resumed == 2
    assert len(again.calls) == len(first.calls) - 2
    assert {k: r.verdict for k, r in by_text(resumed).items()} == {k: r.verdict for k, r in by_text(done).items()}
    assert len(read_results(results)) == len(done.mutants)


def test_a_survivor_names_the_selected_gates_that_never_judged_it():
    # a survivor is only as good as the gates that ran: one whose selected gates were in part
    # skipped or absent from the report says so, with the first of them
    whole = judge([GateRuns((GateOutcome("g::a", "passed"), GateOutcome("g::b", "passed")))])
    assert whole.verdict is Verdict.SURVIVED and whole.reason == "2 gate(s) stayed green"
    part = judge([GateRuns((GateOutcome("g::a", "passed"), GateOutcome("g::b", "skipped"),
                            GateOutcome("g::c", "not run")))])
    assert part.verdict is Verdict.SURVIVED
    assert part.reason == "1 gate(s) stayed green; 2 selected gate(s) neither passed nor failed (first: g::b, skipped)"


def test_judge_rules():
    a = GateOutcome("g::a", "failed", "assertion", "boom")
    t = GateOutcome("g::t", "failed", "trap", "fault")
    p = GateOutcome("g::p", "passed")
    assert judge([GateRuns((t, a))]).verdict is Verdict.KILLED
    assert judge([GateRuns((t, p))]).verdict is Verdict.KILLED_BY_TRAP
    assert judge([GateRuns((p,), timed_out=True)]).verdict is Verdict.TIMEOUT
    hung = judge([GateRuns((p,), timed_out=True, timeout_note="g::h ran past its deadline")])
    assert hung.reason == "the gate run hit the deadline: g::h ran past its deadline"
    assert judge([GateRuns((p,), crashed="died")]).verdict is Verdict.KILLED_BY_TRAP
    assert judge([GateRuns((p, p))]).verdict is Verdict.SURVIVED
    assert judge([GateRuns((GateOutcome("g::s", "skipped"),))]).verdict is Verdict.SURVIVED


def test_a_fault_counts_as_a_kill_only_in_a_memory_safety_gate():
    fault = GateOutcome("g::never_follows", "failed", "trap", "illegal address")
    other = GateOutcome("g::anchor", "failed", "trap", "illegal address")
    safe = judge([GateRuns((other, fault))], frozenset({"g::never_follows"}))
    assert safe.verdict is Verdict.KILLED_BY_TRAP and safe.memory_safety
    assert safe.reason.startswith("killed by a fault in a memory-safety gate: g::never_follows")
    plain = judge([GateRuns((other,))], frozenset({"g::never_follows"}))
    assert not plain.memory_safety and plain.reason.startswith("killed by a trap only")
    from harness.campaigns.mutate.verdicts import scores

    def result(verdict, safety=False):
        return MutantResult(mutant=None, verdict=verdict, memory_safety=safety)

    row = scores([result(Verdict.KILLED), result(Verdict.KILLED_BY_TRAP, True), result(Verdict.KILLED_BY_TRAP),
                  result(Verdict.SURVIVED)], lambda r: "f")["f"]
    assert row.safety == 1 and row.score == 0.5 and row.stryker_score == 0.75
    assert row.to_json()["killed_by_memory_safety_gate"] == 1


def test_scores_exclude_screened_out_mutants():
    s = Score({"killed": 6, "killed-by-trap": 1, "timeout": 1, "survived": 2, "no-coverage": 0, "equivalent": 3,
               "duplicate": 2, "compile-error": 4, "pending": 0})
    assert s.valid == 10 and s.score == 0.6 and s.stryker_score == 0.8


@pytest.mark.usefixtures("shared_baseline")
def test_recheck_counts_agreement(suite):
    from harness.campaigns.mutate.recheck import recheck

    campaign = run_campaign(config(suite, paths=("sum.cu",), operators=("arithmetic", "guard-dropped")),
                            executor_factory=Executors(lambda *a: FakeExecutor()))
    survivors = [r for r in campaign.ordered() if r.verdict is Verdict.SURVIVED]
    same = recheck(campaign, FakeExecutor(), sample=1)
    assert len(same.checked) == len(survivors) + 1 and same.agreed == len(same.checked)

    class Flaky(FakeExecutor):
        def run(self, sandbox, gates, deadline):
            return GateRuns((), timed_out=True)

    seen = []
    differ = recheck(campaign, Flaky(), sample=1, on_result=lambda first, second: seen.append((first, second)))
    # each re-run is handed over as it ends (a re-check cut short keeps what it measured);
    # one that timed out where the campaign had a verdict ran once more, and is handed over again
    n = len(differ.checked)
    assert [f.mutant.id for f, _ in seen] == differ.checked * 2 and all(s.verdict is Verdict.TIMEOUT for _, s in seen)
    assert differ.agreed == 0 and set(differ.disagreements) == set(differ.checked)
    assert differ.retried == differ.checked and differ.agreed_on_retry == 0
    assert differ.line() == (f"0 of {n} re-run verdicts agreed ({n} re-run(s) hit the deadline where the campaign "
                             f"had a verdict and ran once more, at most 4 at once: 0 agreed then)")
    # each disagreement says what the second run saw, not only its verdict
    assert all(second == "timeout" and "deadline" in why for _, second, why in differ.disagreements.values())


@pytest.mark.usefixtures("shared_baseline")
def test_a_recheck_timeout_under_load_runs_once_more_with_fewer_at_once(suite):
    # Re-runs that each trap for real contend for the driver's lock, so many at once can run
    # past their deadline: those, and only those, run again, at most RETRY_JOBS at once.
    import threading

    from harness.campaigns.mutate.recheck import RECHECKED, RETRY_JOBS, recheck
    from harness.campaigns.mutate.operators import OPERATORS

    campaign = run_campaign(config(suite, paths=("sum.cu",), operators=tuple(OPERATORS)),
                            executor_factory=Executors(lambda *a: FakeExecutor()))
    calm = next(r.mutant.id for r in campaign.ordered() if r.verdict in RECHECKED)  # every one is re-run below

    class LoadedOnce(FakeExecutor):
        runs: dict = {}
        live = most = second_runs = 0
        lock = threading.Lock()
        # the first RETRY_JOBS second runs end only once all of them run: they must run at once
        # (the bound only stops a hang; it breaks the barrier, and the re-check raises)
        together = threading.Barrier(RETRY_JOBS, timeout=120)

        def run(self, sandbox, gates, deadline):
            mutant_id = Path(sandbox).parent.name.split("-")[2]
            with self.lock:
                n = self.runs[mutant_id] = self.runs.get(mutant_id, 0) + 1
                if n > 1:
                    LoadedOnce.live += 1
                    LoadedOnce.most = max(LoadedOnce.most, LoadedOnce.live)
                    LoadedOnce.second_runs += 1
                    wait = LoadedOnce.second_runs <= RETRY_JOBS
            try:
                if n == 1 and mutant_id != calm:
                    return GateRuns((), timed_out=True)  # the first run of all but one: load
                if n > 1 and wait:
                    LoadedOnce.together.wait()
                return super().run(sandbox, gates, deadline)
            finally:
                with self.lock:
                    if n > 1:
                        LoadedOnce.live -= 1

    executors = [LoadedOnce() for _ in range(RETRY_JOBS + 4)]
    got = recheck(campaign, executors, sample=len(campaign.results))
    loaded = [i for i in got.checked if i != calm]
    assert len(loaded) > RETRY_JOBS
    assert got.retried == loaded and got.agreed_on_retry == len(loaded)
    assert got.agreed == len(got.checked) and not got.disagreements
    assert LoadedOnce.runs == {**{i: 2 for i in loaded}, calm: 1}, "only the timeouts run again, once"
    assert LoadedOnce.most == RETRY_JOBS  # RETRY_JOBS at once (the barrier), never more
    assert f"{len(loaded)} re-run(s) hit the deadline where the campaign had a verdict and ran once more" in got.line()


@pytest.mark.usefixtures("shared_baseline")
def test_a_fresh_process_gets_its_start_on_top_of_the_gates_deadline(suite, monkeypatch):
    import types

    from harness.campaigns.mutate import execute
    from harness.campaigns.mutate.campaign import mutant_deadline
    from harness.runs.fresh import FRESH_START_SECONDS

    # run_mutant's clock stands still: what each batch is given is the deadline itself, exactly
    # (on the wall clock, the time between its batches came off it, by however slow the machine)
    monkeypatch.setattr(execute, "time", types.SimpleNamespace(perf_counter=lambda: 0.0))
    seen = []

    class Fresh(FakeExecutor):
        start_seconds = FRESH_START_SECONDS

        def run(self, sandbox, gates, deadline):
            seen.append(deadline)
            return super().run(sandbox, gates, deadline)

    cfg = config(suite, paths=("sum.cu",), operators=("arithmetic",), deadline=7.0)
    run_campaign(cfg, executor_factory=Executors(lambda *a: Fresh()))
    assert seen and all(d == 7.0 + FRESH_START_SECONDS for d in seen), seen
    assert mutant_deadline(cfg, None, None) == 7.0


def test_the_recheck_runs_about_four_cores_a_fresh_pytest():
    from harness.campaigns.mutate.recheck import recheck_jobs

    assert recheck_jobs(12, cpus=16) == 4
    assert recheck_jobs(2, cpus=64) == 2
    assert recheck_jobs(8, cpus=2) == 1


@pytest.mark.usefixtures("shared_baseline")
def test_several_mutants_run_at_once_with_the_same_verdicts(suite):
    import threading

    class Slow(FakeExecutor):
        calls = 0
        lock = threading.Lock()
        # the first two runs (two mutants': the first one's next batch waits for its first)
        # end only once both run: they must run at once (the bound only stops a hang; it
        # breaks the barrier, and the campaign raises)
        first_two = threading.Barrier(2, timeout=120)

        def run(self, sandbox, gates, deadline):
            with Slow.lock:
                Slow.calls += 1
                mine = Slow.calls
            if mine <= 2:
                Slow.first_two.wait()
            return super().run(sandbox, gates, deadline)

    cfg = dict(paths=("sum.cu",), operators=("arithmetic", "guard-dropped"))
    one = run_campaign(config(suite, **cfg), executor_factory=Executors(lambda *a: FakeExecutor()))
    made = []
    two = run_campaign(config(suite, gpu_jobs=3, report_dir=suite / "report-3", **cfg),
                       executor_factory=Executors(lambda *a: made.append(Slow()) or made[-1]))
    assert len(made) == 3, "one executor a slot"
    assert Slow.calls > 2 and not Slow.first_two.broken, "mutants ran at once"
    assert {k: r.verdict for k, r in by_text(two).items()} == {k: r.verdict for k, r in by_text(one).items()}


def test_a_cubin_identical_mutant_whose_source_readers_pass_is_equivalent_or_a_duplicate_not_a_survivor(suite, tmp_path):
    import dataclasses

    from harness.campaigns.mutate.campaign import gate_stage, prepare
    from harness.campaigns.mutate.select import Coverage

    cfg = config(suite, paths=("sum.cu",), operators=("arithmetic",))
    mutant = prepare(cfg)[0][0]
    gates = tmp_path / "gates.json"
    gates.write_text(json.dumps({"version": 1, "gates": [
        {"nodeid": "gates/gate_sum.py::test_block_define", "module": "gates/gate_sum.py", "kind": "structural",
         "duration": 0.01, "modules_loaded": [], "sources_read": ["sum.cu"]},
        {"nodeid": "gates/gate_sum.py::test_adds_one", "module": "gates/gate_sum.py", "kind": "anchor",
         "duration": 0.01, "modules_loaded": ["sum.cu"], "sources_read": []}]}))
    coverage = Coverage.from_report(gates)
    pending = MutantResult(mutant, Verdict.PENDING, "", cubin_identical=True)

    class Passes(FakeExecutor):
        def run(self, sandbox, gates, deadline):
            self.calls.append(tuple(gates))
            return GateRuns(tuple(GateOutcome(g, "passed") for g in gates), seconds=0.01)

    ex = Passes()
    r = gate_stage(pending, suite / "kernels", coverage, {"sum.cu": ("sum.cu",)}, ex, cfg)
    assert r.verdict is Verdict.EQUIVALENT and "reading its source passed" in r.reason
    assert ex.calls[0] == ("gates/gate_sum.py::test_block_define",)  # only the source reader (then siblings)
    not_identical = gate_stage(dataclasses.replace(pending, cubin_identical=False), suite / "kernels", coverage,
                               {"sum.cu": ("sum.cu",)}, Passes(), cfg)
    assert not_identical.verdict is Verdict.SURVIVED
    twin = dataclasses.replace(pending, cubin_identical=False, duplicate_of="0123456789ab")
    ex = Passes()
    dup = gate_stage(twin, suite / "kernels", coverage, {"sum.cu": ("sum.cu",)}, ex, cfg)
    assert (dup.verdict, dup.duplicate_of) == (Verdict.DUPLICATE, "0123456789ab")
    assert ex.calls[0] == ("gates/gate_sum.py::test_block_define",)  # its cubin ran as its twin


@pytest.mark.usefixtures("shared_baseline")
def test_gates_run_while_the_screen_still_compiles(suite, monkeypatch):
    import threading
    import time

    from harness.campaigns.mutate import screen
    from harness.campaigns.mutate.campaign import prepare

    cfg = config(suite, paths=("sum.cu",), operators=("arithmetic", "guard-dropped"))
    total = len(prepare(cfg)[0])
    real = screen.compile_mutant
    compiled_at = []
    gate_ran = threading.Event()

    def slow_compile(m, ctx):  # jobs=1: the screen compiles in its own thread, in this process
        c = real(m, ctx)
        if len(compiled_at) == total - 1:
            # the last compile ends only once a gate ran: at once if the gates run while the
            # screen compiles; if they waited for the whole screen, only at this bound (against
            # a hang), and the first gate run comes after it
            gate_ran.wait(120)
        compiled_at.append(time.perf_counter())
        return c

    monkeypatch.setattr(screen, "compile_mutant", slow_compile)

    class Timed(FakeExecutor):
        first = None

        def run(self, sandbox, gates, deadline):
            Timed.first = Timed.first or time.perf_counter()
            gate_ran.set()
            return super().run(sandbox, gates, deadline)

    campaign = run_campaign(cfg, executor_factory=Executors(lambda *a: Timed()))
    assert campaign.baseline.ok and len(compiled_at) == len(campaign.mutants) > 2
    assert Timed.first is not None and Timed.first < compiled_at[-1], "the first gate run waited for the whole screen"
    assert len(campaign.results) == len(campaign.mutants)
    # where the gate stage's time went: each step's end, in the order the steps come
    steps = ["executors_ready", "trap_shadow_checked", "first_mutant_screened", "first_mutant_judged",
             "last_mutant_judged"]
    assert list(campaign.stage) == steps
    assert [campaign.stage[k] for k in steps] == sorted(campaign.stage.values())
    assert campaign.stage["last_mutant_judged"] <= campaign.gpu_seconds + 0.005  # each mark is rounded to 0.01 s


def test_stage_line_says_each_step_of_the_gate_stage_it_knows():
    from harness.campaigns.mutate.campaign import stage_line

    assert stage_line({}) is None
    assert stage_line({"executors_ready": 0.04, "trap_shadow_checked": 1.25, "first_mutant_screened": 2.0,
                       "first_mutant_judged": 2.61, "last_mutant_judged": 20.0}) == (
        "gate stage: slots' executors ready at 0.0 s, trap shadow checked at 1.2 s, first mutant screened at "
        "2.0 s, first judged at 2.6 s, last judged at 20.0 s")


@pytest.mark.usefixtures("shared_baseline")
def test_a_lost_device_stops_the_campaign_and_takes_back_its_recent_faults(suite):
    """A worker that cannot start mid-campaign is the GPU's failure, never a verdict: the
    campaign stops, the faults and timeouts just before are taken back for --resume, and
    kills by assertion stay."""
    from harness.core.errors import DeviceLost

    class DiesOnTheThirdMutant(FakeExecutor):
        boxes: list = []

        def run(self, sandbox, gates, deadline):
            if sandbox not in self.boxes:
                self.boxes.append(sandbox)
            if len(self.boxes) == 2:  # the GPU already failing: this one times out
                return GateRuns((), timed_out=True)
            if len(self.boxes) >= 3:
                raise DeviceLost("harness: a GPU gate worker could not start: cudaErrorNoDevice")
            return super().run(sandbox, gates, deadline)

    fake = DiesOnTheThirdMutant()
    cfg = config(suite, paths=("sum.cu",), operators=("arithmetic", "guard-dropped"))
    with pytest.raises(DeviceLost, match="stopped answering.*--resume"):
        run_campaign(cfg, executor_factory=Executors(lambda *a: fake))
    kept = read_results(cfg.report_dir / RESULTS_FILE)
    ran = [r for r in kept.values() if r.gates_run]
    assert len(ran) == 1 and ran[0].verdict is not Verdict.TIMEOUT, "the first mutant's verdict stays"
    assert not any(r.verdict is Verdict.TIMEOUT for r in kept.values()), "the timeout before the loss is taken back"
    resumed = run_campaign(cfg.__class__(**{**cfg.__dict__, "resume": True}), executor_factory=Executors(lambda *a: FakeExecutor()))
    assert resumed.resumed == len(kept) and len(resumed.results) == len(resumed.mutants)


def test_a_files_frequent_killers_run_first_and_trap_gates_stay_last():
    from harness.campaigns.mutate.campaign import KillHistory
    from harness.campaigns.mutate.generate import Mutant
    from harness.campaigns.mutate.select import Coverage, GateInfo

    def info(name, kind="anchor", duration=0.1):
        return GateInfo(f"gates/t.py::{name}", "gates/t.py", kind, duration, frozenset({"a.cu"}), frozenset())

    cov = Coverage([info("fast"), info("slow", duration=1.0), info("killer", duration=0.5),
                    info("trap", kind="trap", duration=0.0)])
    gates = cov.select("a.cu", ("a.cu",)).direct
    assert [g.split("::")[1] for g in gates] == ["fast", "killer", "slow", "trap"]
    history = KillHistory()
    assert history.order("a.cu", gates, cov) == gates, "nothing killed yet: the baseline's order"

    def result(file, verdict, killed_by):
        m = Mutant("id" + killed_by + file, file, "arithmetic", 1, 1, 1, 2, 0, 1, "+", "-", "", "f")
        return MutantResult(m, verdict, "", killed_by=[f"gates/t.py::{killed_by}"])

    history.record(result("a.cu", Verdict.KILLED, "slow"))
    history.record(result("a.cu", Verdict.KILLED, "slow"))
    history.record(result("a.cu", Verdict.KILLED, "killer"))
    history.record(result("a.cu", Verdict.KILLED_BY_TRAP, "trap"))  # not a kill by assertion
    history.record(result("b.cu", Verdict.KILLED, "fast"))  # another file's killers do not count
    assert [g.split("::")[1] for g in history.order("a.cu", gates, cov)] == ["slow", "killer", "fast", "trap"]


def test_the_table_shows_the_memory_safety_kills_that_the_score_counts():
    from types import SimpleNamespace

    from rich.console import Console

    from harness.campaigns.mutate.report import table
    from harness.campaigns.mutate.verdicts import MutantResult, Verdict

    def result(verdict, safety=False):
        return MutantResult(mutant=SimpleNamespace(file="k.cu", id=f"{verdict.value}{safety}{id(object())}"),
                            verdict=verdict, memory_safety=safety)

    results = [result(Verdict.KILLED), result(Verdict.KILLED_BY_TRAP, True), result(Verdict.KILLED_BY_TRAP),
               result(Verdict.SURVIVED)]
    campaign = SimpleNamespace(ordered=lambda: results, mode="campaign")
    console = Console(width=240, record=True)
    console.print(table(campaign))
    text = console.export_text()
    assert "2 (1 ms)" in text and "50.0%" in text, text  # (1 killed + 1 ms) of 4
    assert "killed-by-trap in a gate marked memory_safety (ms)" in " ".join(text.split()), text
