"""`python -m harness mutate --static` without a GPU: the structural gates run on the CPU and
kill, the mutants with the original's (or another mutant's) cubin are settled as a GPU
campaign settles them, what needs a GPU stays pending and says why; the plain progress
lines; the verdict store that `--since` reuses. (The cache bound: tests/test_cubin_cache_bound.py.)"""

import io
import os
import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest

from harness.campaigns.mutate.campaign import MutateConfig, run_campaign
from harness.campaigns.mutate.static import NEEDS_GPU
from harness.campaigns.mutate.verdicts import Verdict
from tests._machine import use_child_env

SUITE = Path(__file__).parent / "fixtures" / "mutate_suite"

# Beside the fake suite's gates: a structural gate that reads other.cu's text through
# harness.library.source (so its mutants are never settled by their cubin alone), and a GPU gate,
# skipped here, so the static baseline cannot see everything a GPU campaign would run.
EXTRA_GATES = '''
    import pytest

    from harness.library import coverage
    from harness.library.source import read_source


    @pytest.mark.structural
    def test_other_keeps_its_seven(kernel_root):
        assert "int unused = 7 " in read_source(kernel_root / "other.cu"), "the seven is gone"


    @pytest.mark.gpu
    @pytest.mark.anchor
    def test_sum_on_the_device(kernel_root):
        coverage.note_module("sum.cu")
'''


def copy_suite(folder: Path, extra: bool = True) -> Path:
    copy = folder / "suite"
    shutil.copytree(SUITE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    if extra:
        (copy / "gates" / "gate_extra.py").write_text(textwrap.dedent(EXTRA_GATES))
    return copy


def config(suite: Path, **changes) -> MutateConfig:
    base = dict(rootdir=suite, kernel_root=Path("kernels"), report_dir=suite / "report", jobs=2, deadline=60.0,
                require_gpu=False, cache_dir=suite / "cache", arch="sm_90", static=True)
    base.update(changes)
    return MutateConfig(**base)


@pytest.fixture(scope="module")
def static_run(tmp_path_factory):
    """One static campaign, read by several tests: int-literal and arithmetic mutants of both
    files (no mutant that hangs a fake gate)."""
    mp = pytest.MonkeyPatch()
    use_child_env(mp)
    try:
        suite = copy_suite(tmp_path_factory.mktemp("static"))
        yield run_campaign(config(suite, operators=("int-literal", "arithmetic"), jobs=1))
    finally:
        mp.undo()


class TestOneStaticRun:
    """The tests that read the module's one static campaign: a class, so that under xdist they
    run on one worker together (the root conftest's scheduler) and the campaign runs once."""

    def test_a_structural_gate_kills_a_mutant_without_a_gpu(self, static_run):
        killed = [r for r in static_run.ordered() if r.verdict is Verdict.KILLED]
        by_gate = {r.killed_by[0].split("::")[1] for r in killed}
        assert "test_adds_one" in by_gate  # sum.cu: `in[i] + 1` made `in[i] - 1`
        minus = next(r for r in killed if r.mutant.file == "sum.cu" and r.mutant.start_line == 6
                     and (r.mutant.original, r.mutant.replacement) == ("+", "-"))
        assert minus.killed_by == ["gates/gate_sum.py::test_adds_one"] and "out[0] is not in[0] + 1" in minus.reason


    def test_an_identical_cubin_is_killed_by_the_gate_that_reads_its_source(self, static_run):
        # `int unused = 7 * 3`: every edit of it leaves the cubin as it was, yet changing the
        # seven changes what test_other_keeps_its_seven reads
        sevens = [r for r in static_run.ordered() if r.mutant.file == "other.cu" and r.mutant.original == "7"]
        assert sevens and all(r.cubin_identical and r.verdict is Verdict.KILLED for r in sevens)
        assert all(r.killed_by == ["gates/gate_extra.py::test_other_keeps_its_seven"] for r in sevens)


    def test_an_identical_cubin_whose_source_readers_pass_is_equivalent(self, static_run):
        threes = [r for r in static_run.ordered() if r.mutant.file == "other.cu" and r.mutant.original == "3"]
        assert threes and all(r.verdict is Verdict.EQUIVALENT for r in threes), [(r.verdict, r.reason) for r in threes]
        assert all("gate(s) reading its source passed on the CPU" in r.reason for r in threes)
        assert all("gates/gate_extra.py::test_other_keeps_its_seven" in r.gates_run for r in threes)


    def test_another_mutants_cubin_is_a_duplicate_once_its_source_readers_pass(self, static_run):
        # `x[threadIdx.x + 1 - 1]`: `+ 2 - 1` and `+ 1 - 0` compile alike, as do `+ 0 - 1` and `+ 1 - 2`
        results = {r.mutant.id: r for r in static_run.ordered()}
        dups = [r for r in results.values() if r.verdict is Verdict.DUPLICATE]
        assert len(dups) >= 2 and all(r.mutant.file == "other.cu" for r in dups)
        for r in dups:
            twin = results[r.duplicate_of]
            assert twin.verdict is Verdict.PENDING and r.effective is Verdict.PENDING
            assert "reading its source passed on the CPU" in r.reason and r.gates_run


    def test_what_only_a_gpu_gate_could_settle_stays_pending_and_says_why(self, static_run, capsys):
        from harness.campaigns.mutate.static import pending_lines

        pending = [r for r in static_run.ordered() if r.verdict is Verdict.PENDING]
        assert pending and all(NEEDS_GPU in r.reason and "structural gate(s) passed" in r.reason for r in pending)
        lines = pending_lines(static_run.ordered())
        assert lines == [f"{len(pending)} {NEEDS_GPU}"]
        assert not [r for r in static_run.ordered() if r.verdict is Verdict.SURVIVED]  # a GPU gate was not run


# ---------------------------------------------------------------- progress on a CI log


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def test_plain_progress_says_rate_and_time_left_at_most_every_interval():
    from rich.console import Console

    from harness.campaigns.mutate.cli import _Progress

    out = io.StringIO()
    clock = Clock()
    with _Progress(Console(file=out, force_terminal=False, width=200), clock=clock, interval=30.0) as progress:
        progress.phase("screening 100 mutants", 100)
        for i in range(100):
            clock.now += 1.0  # a mutant a second
            progress.advance()
    lines = out.getvalue().splitlines()
    assert lines[0] == "screening 100 mutants"
    assert lines[1:] == ["  30/100 (1.0 mutants/s, 30s elapsed, 1m10s left)",
                         "  60/100 (1.0 mutants/s, 1m00s elapsed, 40s left)",
                         "  90/100 (1.0 mutants/s, 1m30s elapsed, 10s left)",
                         "  100/100 (1.0 mutants/s, 1m40s elapsed)"]


def test_a_fast_stage_prints_only_its_end():
    from rich.console import Console

    from harness.campaigns.mutate.cli import _Progress

    out = io.StringIO()
    clock = Clock()
    with _Progress(Console(file=out, force_terminal=False, width=200), clock=clock, interval=30.0) as progress:
        progress.phase("screening 1000 mutants", 1000)
        for i in range(1000):
            clock.now += 0.01
            progress.advance()
    assert out.getvalue().splitlines()[1:] == ["  1000/1000 (100.0 mutants/s, 10s elapsed)"]


def test_on_a_terminal_the_bar_shows_the_time_left():
    from rich.progress import TimeRemainingColumn
    from rich.console import Console

    from harness.campaigns.mutate.cli import _Progress

    progress = _Progress(Console(file=io.StringIO(), force_terminal=True))
    assert progress.live and any(isinstance(c, TimeRemainingColumn) for c in progress.progress.columns)


# ---------------------------------------------------------------- --since and the verdict store


def git(suite: Path, *args: str) -> None:
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t", "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(suite)}
    subprocess.run(["git", *args], cwd=suite, check=True, capture_output=True, env=env)


def test_since_reuses_stored_verdicts_until_a_selected_gate_changes(tmp_path, monkeypatch):
    use_child_env(monkeypatch)
    suite = copy_suite(tmp_path, extra=False)
    git(suite, "init", "-q")
    git(suite, "add", ".")
    git(suite, "commit", "-q", "-m", "base")
    kernel = suite / "kernels" / "sum.cu"
    kernel.write_text(kernel.read_text().replace("threadIdx.x;", "threadIdx.x ;"))  # a pull request's change
    cfg = config(suite, paths=("sum.cu",), operators=("arithmetic",), since="HEAD", jobs=1)

    first = run_campaign(cfg)
    n = len(first.results)
    # the fake suite has no GPU gate: its static baseline saw every gate, so a mutant its
    # gates miss is a survivor, as on a device, not pending
    assert n >= 2 and first.reused == 0 and {r.verdict for r in first.ordered()} == {Verdict.SURVIVED}
    second = run_campaign(cfg)  # the next push, nothing changed: nothing compiles, nothing runs
    assert second.reused == n and all(r.reused for r in second.ordered())
    assert {k: r.verdict for k, r in second.results.items()} == {k: r.verdict for k, r in first.results.items()}
    assert not (suite / "report" / "runs" / "cpu").exists() or second.gpu_seconds < first.gpu_seconds
    gate = suite / "gates" / "gate_sum.py"
    gate.write_text(gate.read_text() + "\n# a selected gate's file changed\n")
    third = run_campaign(cfg)
    assert third.reused == 0 and not any(r.reused for r in third.ordered())


def test_a_changed_toolchain_or_option_is_another_digest(tmp_path, monkeypatch):
    from harness.campaigns.mutate import store
    from harness.campaigns.mutate.generate import Mutant

    use_child_env(monkeypatch)
    from harness.campaigns.mutate.select import Coverage, GateInfo

    suite = copy_suite(tmp_path, extra=False)
    cov = Coverage([GateInfo("gates/gate_sum.py::test_adds_one", "gates/gate_sum.py", "anchor", 0.1,
                             frozenset({"sum.cu"}), frozenset())])
    deps = {"sum.cu": ("sum.cu",)}
    m = Mutant.from_json({"id": "abc", "file": "sum.cu", "start_byte": 0, "end_byte": 1, "start_line": 1,
                          "start_col": 1, "end_line": 1, "end_col": 2, "original": "/", "replacement": "*",
                          "operator": "arithmetic", "description": "", "function": "add_one"})
    key = store.VerdictKeys(suite / "kernels", suite, cov, deps, config(suite), "sm_90").key(m)
    assert store.VerdictKeys(suite / "kernels", suite, cov, deps, config(suite), "sm_90").key(m) == key
    assert store.VerdictKeys(suite / "kernels", suite, cov, deps, config(suite), "sm_100").key(m) != key
    assert store.VerdictKeys(suite / "kernels", suite, cov, deps, config(suite, all_gates=True), "sm_90").key(m) != key
    monkeypatch.setattr(store, "_toolchain", lambda arch: {"nvrtc": "another"})
    assert store.VerdictKeys(suite / "kernels", suite, cov, deps, config(suite), "sm_90").key(m) != key


def test_the_store_keeps_no_timeout_and_a_pending_only_for_static_runs(tmp_path):
    from harness.campaigns.mutate.generate import Mutant
    from harness.campaigns.mutate.store import VerdictStore
    from harness.campaigns.mutate.verdicts import MutantResult

    m = Mutant.from_json({"id": "abc", "file": "sum.cu", "start_byte": 0, "end_byte": 1, "start_line": 1,
                          "start_col": 1, "end_line": 1, "end_col": 2, "original": "/", "replacement": "*",
                          "operator": "arithmetic", "description": "", "function": "add_one"})
    store = VerdictStore(tmp_path)
    assert not store.put("aa" * 32, MutantResult(m, Verdict.TIMEOUT), static=True)
    assert not store.put("bb" * 32, MutantResult(m, Verdict.PENDING))
    assert store.put("cc" * 32, MutantResult(m, Verdict.PENDING, "needs a GPU"), static=True)
    assert store.put("dd" * 32, MutantResult(m, Verdict.KILLED, "g: red"))
    assert store.get("aa" * 32) is None and store.get("bb" * 32) is None
    assert store.get("cc" * 32).reason == "needs a GPU" and store.get("dd" * 32).verdict is Verdict.KILLED
