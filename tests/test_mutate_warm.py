"""The warm executor over a fake suite with a fake device (no GPU needed): a forked worker
serves one mutant after another against each mutant's sandbox, with the project's caches
cleared between them (host caches kept); it stops at the first kill by assertion, judges
trap gates as the plugin does, goes on in another worker after a poisoned context, and
turns a hang into a timeout with a new worker for the next mutant."""

import json
import textwrap
from pathlib import Path

import pytest

from harness.runs.warm import WarmExecutor
from tests._machine import use_child_env

CONFTEST = """
import sys
pytest_plugins = [] if "harness.plugin" in sys.modules else ["harness.plugin"]
import harness.core.device as device
from harness.core.device import DeviceProbe
_fake = DeviceProbe(count=1, name="Fake GPU", arch="sm_90")


def _probe():
    import os, pathlib
    dead = os.environ.get("FAKE_GPU_DEAD_FLAG")
    if dead and pathlib.Path(dead).exists():  # the GPU fell off the bus: workers forked now cannot start
        raise RuntimeError("cudaErrorNoDevice: no CUDA-capable device is detected")
    return _fake


device.probe = _probe
device.context_is_poisoned = lambda: False

# The trap shadow without a GPU: a fake module's guard counts here when the shadow is on.
import harness.library.kernels as kernels
SHADOW_HITS = [0]
kernels.trap_shadow_hits = lambda: SHADOW_HITS[0]
_forget = kernels.forget_loaded


def _forget_and_clear():
    SHADOW_HITS[0] = 0  # a module loaded afresh starts its count at zero
    _forget()


kernels.forget_loaded = _forget_and_clear
"""

GATES = """
import ctypes, functools, os, signal
import pytest
from harness import host_cache
from harness.library import coverage

@functools.cache
def device_side(kernel_root):
    return [str(kernel_root)]

@host_cache
def host_side():
    return [os.getpid()]

class CUDARuntimeError(RuntimeError):
    pass

def text(kernel_root):
    coverage.note_module("k.cu")
    return (kernel_root / "k.cu").read_text()

@pytest.mark.gpu
@pytest.mark.anchor
def test_adds_one(kernel_root):
    assert "x + 1" in text(kernel_root), "out is not x + 1"

@pytest.mark.gpu
@pytest.mark.trap
def test_guard_fires(kernel_root):
    if "guard" in text(kernel_root):
        raise CUDARuntimeError("cudaErrorLaunchFailure: unspecified launch failure")

@pytest.mark.gpu
@pytest.mark.trap
def test_guard_counts_in_the_shadow(kernel_root):
    import conftest
    from harness.library import kernels
    if "guard" in text(kernel_root):
        if kernels.trap_shadow_on():
            conftest.SHADOW_HITS[0] += 1  # what the shadow build's __trap() does: count, go on
        else:
            raise CUDARuntimeError("cudaErrorLaunchFailure: unspecified launch failure")

@pytest.mark.gpu
@pytest.mark.anchor
@pytest.mark.parametrize("i", range(6))
def test_each_launch(kernel_root, i):
    if "FAULT" in text(kernel_root):
        raise CUDARuntimeError("cudaErrorIllegalAddress: an illegal memory access was encountered")

@pytest.mark.gpu
@pytest.mark.anchor
def test_frozen(kernel_root):
    import gc
    assert gc.get_freeze_count() > 1000, f"only {gc.get_freeze_count()} objects frozen before the fork"

@pytest.mark.gpu
@pytest.mark.link
def test_pid(kernel_root):
    cached = device_side(kernel_root)
    assert cached == [str(kernel_root)], f"a cache kept {cached} from another mutant"
    cached.append("seen")
    host = host_side()
    host.append("seen")
    open(kernel_root.parent / "pids", "a").write(f"{os.getpid()} {len(host)}\\n")
    if "SPIN" in text(kernel_root):
        signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
        ctypes.CDLL(None).sleep(3600)
"""

KERNEL = "// guard\n__global__ void k(float* y, const float* x) { *y = *x + 1; }  // x + 1\n"
# a bounds-guarded kernel: its mutants include a guard loosened and dropped
GUARDED_KERNEL = ("// guard\n__global__ void k(float* y, const float* x, int n) {\n"
                  "    int i = blockIdx.x * blockDim.x + threadIdx.x;\n    if (i < n) y[i] = x[i] + 1;  // x + 1\n}\n")


def make_suite(tmp_path, monkeypatch, gates: str, kernel: str, spares: int = 2) -> tuple[Path, WarmExecutor]:
    """A fake suite (gates/test_k.py, kernels/k.cu, the fake device's conftest) and a warm
    executor over it; the caller closes the executor."""
    root = tmp_path / "suite"
    (root / "kernels").mkdir(parents=True)
    (root / "gates").mkdir()
    (root / "pytest.ini").write_text("[pytest]\nkernel_root = kernels\n")
    (root / "conftest.py").write_text(CONFTEST)
    (root / "gates" / "test_k.py").write_text(textwrap.dedent(gates))
    (root / "kernels" / "k.cu").write_text(kernel)
    use_child_env(monkeypatch)
    return root, WarmExecutor(root, ("gates",), root / "kernels", tmp_path / "cache", spares=spares)


@pytest.fixture
def suite(tmp_path, monkeypatch):
    root, ex = make_suite(tmp_path, monkeypatch, GATES, KERNEL)
    yield root, ex
    ex.close()


def _mutant(root: Path, name: str, text: str) -> Path:
    box = root.parent / name / "kernels"
    box.mkdir(parents=True)
    (box / "k.cu").write_text(text)
    return box


GATE_IDS = ["gates/test_k.py::test_adds_one", "gates/test_k.py::test_guard_fires", "gates/test_k.py::test_pid"]


def test_one_worker_serves_mutant_after_mutant_with_the_projects_caches_cleared(suite):
    root, ex = suite
    first_box, second_box = _mutant(root, "same", KERNEL), _mutant(root, "again", KERNEL)
    no_trap = [GATE_IDS[0], GATE_IDS[2]]  # a trap gate poisons its context: its worker is not reused
    first = ex.run(first_box, no_trap, 60)
    second = ex.run(second_box, no_trap, 60)
    assert [o.outcome for o in first.outcomes] == ["passed"] * 2, first
    assert [o.outcome for o in second.outcomes] == ["passed"] * 2, second
    # the timings a campaign records per mutant: inside the gates, and waiting for a worker
    assert all(o.duration > 0 for o in first.outcomes) and 0 <= second.waited < second.seconds
    # test_pid checks device_side's cache holds its own kernel root (cleared between mutants);
    # host_side (marked host_cache) is kept: its list grew in the first mutant
    (pid1, n1), = [line.split() for line in (first_box.parent / "pids").read_text().splitlines()]
    (pid2, n2), = [line.split() for line in (second_box.parent / "pids").read_text().splitlines()]
    assert pid1 == pid2 and (n1, n2) == ("2", "3")
    assert not ex.replaced and ex.summary() == "every worker was kept from mutant to mutant"


def test_workers_inherit_the_servers_collected_objects_frozen_out_of_the_collectors_sight(suite):
    # a worker's collection per mutant (reset_for_next_mutant) never walks the collected
    # session, and never writes to the pages the fork shares with the server
    root, ex = suite
    got = ex.run(_mutant(root, "same", KERNEL), ["gates/test_k.py::test_frozen"], 60)
    assert [o.outcome for o in got.outcomes] == ["passed"], got


def test_without_reuse_each_mutant_gets_a_fresh_worker(suite):
    root, ex = suite
    ex.reuse = False
    box = _mutant(root, "same", KERNEL)
    assert [o.outcome for o in ex.run(box, GATE_IDS, 60).outcomes] == ["passed"] * 3
    assert [o.outcome for o in ex.run(box, GATE_IDS, 60).outcomes] == ["passed"] * 3
    pids = [line.split()[0] for line in (box.parent / "pids").read_text().splitlines()]
    assert len(set(pids)) == 2


def test_a_gate_that_poisons_the_context_ends_its_worker(suite):
    root, ex = suite
    box = _mutant(root, "trap", KERNEL)
    runs = ex.run(box, GATE_IDS[1:], 60)  # the trap gate (passes, context poisoned), then test_pid
    assert [o.outcome for o in runs.outcomes] == ["passed", "passed"], runs
    assert all(w.alive for w in ex._idle) and len(ex._idle) == 1
    assert ex.replaced == {"a gate left the CUDA context unusable": 1}, ex.replaced
    assert ex.summary() == "1 worker(s) replaced: 1 x a gate left the CUDA context unusable"


def test_a_kill_by_assertion_stops_the_run_and_names_the_gate(suite):
    root, ex = suite
    box = _mutant(root, "minus", KERNEL.replace("x + 1", "x - 1").replace("*x + 1", "*x - 1"))
    runs = ex.run(box, GATE_IDS, 60)
    first = runs.outcomes[0]
    assert (first.outcome, first.route, first.first_failure_line) == ("failed", "assertion", "out is not x + 1")
    assert [o.outcome for o in runs.outcomes[1:]] == ["not run", "not run"]


def test_a_silent_guard_fails_its_trap_gate_by_assertion(suite):
    root, ex = suite
    box = _mutant(root, "noguard", KERNEL.replace("// guard", "// none"))
    runs = ex.run(box, GATE_IDS[1:2], 60)
    assert (runs.outcomes[0].outcome, runs.outcomes[0].route) == ("failed", "assertion")


def test_waiting_for_a_worker_does_not_count_against_the_mutants_deadline(suite, monkeypatch):
    # every spare taken by other slots' faults: the slot waits, and the mutant's own gates
    # still get their whole deadline (were the wait counted, green mutants would time out)
    import time

    root, ex = suite
    take = ex._take

    def slow_take():
        time.sleep(1.5)
        return take()

    monkeypatch.setattr(ex, "_take", slow_take)
    # the trap gate ends its worker: the second gate waits for another (two waits, 3 s, past
    # the 2 s deadline: were they counted, the second gate would never start)
    runs = ex.run(_mutant(root, "waits", KERNEL), [GATE_IDS[1], GATE_IDS[0]], 2.0)
    assert not runs.timed_out and [o.outcome for o in runs.outcomes] == ["passed", "passed"], runs
    assert runs.waited >= 3.0


def test_a_hang_is_a_timeout_and_the_next_mutant_gets_a_new_worker(suite):
    root, ex = suite
    box = _mutant(root, "spin", KERNEL + "// SPIN\n")
    runs = ex.run(box, GATE_IDS[2:], 2)
    assert runs.timed_out
    ok = ex.run(_mutant(root, "after", KERNEL), GATE_IDS[:1], 60)
    assert ok.outcomes[0].outcome == "passed"
    assert ex.replaced == {"it ran past its deadline": 1}, ex.replaced


@pytest.fixture(scope="module")
def bench_both_ways(tmp_path_factory):
    """The whole mutation bench, both halves, naive-jobs 2, for TestTheMutationBench: (its
    status, its temp folders left behind, its output folder, the warm half's campaign, the
    naive half's baseline)."""
    import shutil
    import tempfile

    from harness.campaigns.mutate import campaign
    from harness.campaigns.mutate.bench import main

    tmp_path = tmp_path_factory.mktemp("bench")
    real, warm = campaign.run_campaign, []
    real_baseline, baselines = campaign.run_baseline, []

    def run_campaign(*args, **kwargs):
        result = real(*args, **kwargs)
        warm.append(result)
        return result

    def run_baseline(*args, **kwargs):
        baselines.append(real_baseline(*args, **kwargs))
        return baselines[-1]

    with pytest.MonkeyPatch.context() as mp:
        root, ex = make_suite(tmp_path, mp, GATES, KERNEL)
        ex.close()
        (root / "kernels" / "k.cu").write_text(GUARDED_KERNEL)
        mp.setattr(campaign, "run_campaign", run_campaign)
        mp.setattr(campaign, "run_baseline", run_baseline)
        out = tmp_path / "out"
        private = Path(tempfile.mkdtemp(prefix="hbt-", dir="/tmp"))  # the bench's own folders, and its children's
        saved, tempfile.tempdir = tempfile.tempdir, str(private)
        try:
            status = main(["--out", str(out), "--name", "b", "--naive-jobs", "2", "--rootdir", str(root),
                           "--seed", "1", "--max-per-file", "4", "--gpu-jobs", "2", "--deadline", "30",
                           "--jobs", "1", "--cache-dir", str(tmp_path / "cache")])
            left = sorted(p.name for p in private.iterdir())
        finally:
            tempfile.tempdir = saved
            shutil.rmtree(private, ignore_errors=True)
    return status, left, out, warm[0], baselines[-1]


class TestTheMutationBench:
    """`bench mutate` runs the warm campaign, then the naive way, on the same mutants. The first
    test runs both halves; the other three cut the naive half three ways and read the first's
    warm half and the baseline of its naive half (the same suite, seed and sample: the same
    mutants, verdicts, arch and gates), so the warm campaign and the naive baseline run once.
    A class: an xdist worker takes it whole (the root conftest)."""

    @pytest.fixture
    def warm_half(self, bench_both_ways, monkeypatch):
        """bench.main's first campaign (the warm half) answered by the shared run's; the naive
        half runs for real from the shared run's baseline."""
        from harness.campaigns.mutate import campaign

        real, calls = campaign.run_campaign, []

        def run_campaign(config, *args, **kwargs):
            calls.append(config)
            return bench_both_ways[3] if len(calls) == 1 else real(config, *args, **kwargs)

        monkeypatch.setattr(campaign, "run_campaign", run_campaign)
        monkeypatch.setattr(campaign, "run_baseline", lambda config, cache_dir: bench_both_ways[4])
        return calls

    def test_the_mutation_bench_runs_both_ways_on_the_same_mutants_and_compares_verdicts(
            self, bench_both_ways):
        import json

        status, left, out, warm, (baseline, _) = bench_both_ways
        assert left == [], f"the bench's temp folders outlived it: {left}"
        result = json.loads((out / "b.json").read_text())
        assert status == 0, result
        assert result["campaign"]["reached_gpu"] == result["naive"]["reached_gpu"] > 0
        assert result["compared"] == result["agreed"] == result["campaign"]["reached_gpu"]
        assert result["campaign"]["mutants_per_minute"] and result["naive"]["mutants_per_minute"]
        assert "Speed-up" in (out / "b.md").read_text()
        assert len(warm.results) == 4 and warm.baseline.ok and baseline.ok  # what the other three tests read

    def test_a_mutation_bench_cut_short_in_its_naive_half_still_reports_both_rates(
            self, warm_half, suite, tmp_path, monkeypatch, capsys):
        # a device command has a time limit: the naive way (a pytest per mutant) is the slow
        # half, so a cut there keeps the campaign's numbers and the naive mutants that finished
        import json

        from harness.runs import fresh as runs_fresh
        from harness.campaigns.mutate.bench import main

        root, _ = suite
        (root / "kernels" / "k.cu").write_text(GUARDED_KERNEL)
        real = runs_fresh.FreshProcessExecutor.run
        calls = []

        def cut_after_two(self, *args, **kwargs):
            calls.append(1)
            if len(calls) > 2:
                raise KeyboardInterrupt  # SIGINT from the device command's timeout
            return real(self, *args, **kwargs)

        monkeypatch.setattr(runs_fresh.FreshProcessExecutor, "run", cut_after_two)
        out = tmp_path / "out"
        main(["--out", str(out), "--name", "b", "--naive-jobs", "1", "--rootdir", str(root), "--seed", "1",
              "--max-per-file", "4", "--gpu-jobs", "2", "--deadline", "30", "--jobs", "1",
              "--cache-dir", str(tmp_path / "cache")])
        result = json.loads((out / "b.json").read_text())
        assert result["campaign"]["reached_gpu"] == 4 and result["campaign"]["mutants_per_minute"]
        assert result["naive"]["cut_short"] and result["naive"]["reached_gpu"] == 2, result["naive"]
        assert result["naive"]["mutants_per_minute"] and result["compared"] == 2
        assert "cut short" in (out / "b.md").read_text()
        printed = capsys.readouterr().out
        assert "[campaign] 4 mutants reached the GPU" in printed and "[naive] cut short after" in printed
        assert len(warm_half) == 2  # the shared warm half, then this test's naive half

    def test_a_naive_run_cut_by_its_deadline_is_counted_apart_not_as_a_disagreement(
            self, warm_half, suite, tmp_path, monkeypatch):
        # the naive way (many pytests at once) can run past the campaign's bound for reasons of
        # load: such a run is listed apart, and the naive half gets its own generous deadline
        import json

        from harness.campaigns.mutate import bench
        from harness.runs import fresh as runs_fresh, result as runs_result
        from harness.campaigns.mutate.bench import main

        root, _ = suite
        (root / "kernels" / "k.cu").write_text(GUARDED_KERNEL)
        real = runs_fresh.FreshProcessExecutor.run
        deadlines = []

        def first_one_cut(self, sandbox, gates, deadline):
            deadlines.append(deadline)
            if len(deadlines) == 1:
                return runs_result.GateRuns(tuple(runs_result.GateOutcome(g, "not run") for g in gates),
                                            timed_out=True)
            return real(self, sandbox, gates, deadline)

        monkeypatch.setattr(runs_fresh.FreshProcessExecutor, "run", first_one_cut)
        out = tmp_path / "out"
        status = main(["--out", str(out), "--name", "b", "--naive-jobs", "1", "--rootdir", str(root), "--seed", "1",
                       "--max-per-file", "4", "--gpu-jobs", "2", "--jobs", "1",
                       "--cache-dir", str(tmp_path / "cache")])
        result = json.loads((out / "b.json").read_text())
        assert status == 0, result
        assert min(deadlines) >= bench.NAIVE_DEADLINE, deadlines
        assert len(result["naive_timeouts_only"]) == 1 and not result["disagreements"], result
        assert result["compared"] == result["agreed"] == result["campaign"]["reached_gpu"] - 1
        assert "Not compared: 1 naive run(s) cut by the naive deadline (600 s)" in (out / "b.md").read_text()
        assert len(warm_half) == 2  # the shared warm half, then this test's naive half

    def test_a_mutation_bench_with_naive_seconds_cuts_its_naive_half_and_bounds_the_speedup(
            self, warm_half, suite, tmp_path, monkeypatch):
        # --naive-seconds ends the naive half as a device command's timeout would (SIGINT), and the
        # speed-up is taken against the most the naive way could have managed: the runs it
        # finished and every one still under way counted as done. No wall time decides it: the
        # bench arms its cut on a timer this test fires once the first naive run has finished and
        # the second is under way, and the naive half's seconds are read on a clock this test moves.
        import functools
        import json
        import threading

        from harness.runs import fresh as child
        from harness.campaigns.mutate import bench
        from harness.runs import fresh as runs_fresh

        root, _ = suite
        (root / "kernels" / "k.cu").write_text(GUARDED_KERNEL)
        now = [1000.0]
        timers = []

        class Timer:
            """What the bench arms at the naive gate stage's start, in place of threading.Timer."""

            def __init__(self, seconds, fire):
                self.seconds, self.fire, self.daemon = seconds, fire, False
                self.started, self.cancelled = False, False
                timers.append(self)

            def start(self):
                self.started = True

            def cancel(self):
                self.cancelled = True

        interrupted = threading.Event()  # the cut killed every run under way (as the campaign's Ctrl-C path does)
        real_kill_all = child.kill_all

        def kill_all():
            interrupted.set()
            real_kill_all()

        monkeypatch.setattr(child, "kill_all", kill_all)
        real = runs_fresh.FreshProcessExecutor.run
        calls, seen = [], {}

        def the_second_run_is_cut(self, *args, **kwargs):
            calls.append(1)
            if len(calls) == 2:  # the first naive run finished (its verdict recorded); this one is under way
                now[0] += 4.0  # the gate stage has run its 4 s, by the naive half's clock
                (timer,) = timers
                seen["armed"] = (timer.seconds, timer.started, timer.daemon)
                timer.fire()  # the bench's own cut: SIGINT at the main thread
                seen["interrupted"] = interrupted.wait(300)  # (a bound against a hang only)
            # after the cut, a real run's pytest is killed as it starts (the campaign refuses new children)
            return real(self, *args, **kwargs)

        monkeypatch.setattr(runs_fresh.FreshProcessExecutor, "run", the_second_run_is_cut)
        out = tmp_path / "out"
        bench.main(["--out", str(out), "--name", "b", "--naive-jobs", "1", "--naive-seconds", "4",
                    "--rootdir", str(root), "--seed", "1", "--max-per-file", "4", "--gpu-jobs", "2",
                    "--deadline", "30", "--jobs", "1", "--cache-dir", str(tmp_path / "cache")],
                   naive_clock=functools.partial(bench._Clock, now=lambda: now[0], timer=Timer))
        # the cut was armed at --naive-seconds when the gate stage began, and it interrupted the stage
        assert seen == {"armed": (4.0, True, True), "interrupted": True}, seen
        assert len(calls) == 2 and timers[0].cancelled, "no naive run started after the cut"
        result = json.loads((out / "b.json").read_text())
        n = result["naive"]
        # cut: one run finished, the one under way counted as such
        assert n["cut_short"] and n["reached_gpu"] == 1 and n["in_flight_at_most"] == 1, n
        # the rates over the cut's 4 s: the finished run alone, and with the one under way (the bound)
        assert (n["gpu_stage_s"], n["mutants_per_minute"], n["mutants_per_minute_at_most"]) == (4.0, 15.0, 30.0), \
            n
        assert result["speedup"] == round(result["campaign"]["mutants_per_minute"] / 30.0, 1), result
        md = (out / "b.md").read_text()
        assert "Speed-up: at least" in md, md
        assert "cut after 4.0 s of its gate stage with at most 1 more under way" in md, md
        assert "managed at most 30.0 a minute" in md, md
        assert len(warm_half) == 2  # the shared warm half, then this test's naive half


def test_the_command_rechecks_in_fresh_workers_and_names_both_sets_of_workers(suite, tmp_path, capsys):
    # `python -m harness mutate` on the fake suite: the campaign, then every survivor and a
    # sample again in workers forked for one mutant each; the summary names the campaign's
    # workers and the re-check's, and how many verdicts agreed
    from harness.campaigns.mutate.cli import main

    root, _ = suite
    (root / "kernels" / "k.cu").write_text(GUARDED_KERNEL)
    status = main(["--rootdir", str(root), "--no-require-gpu", "--seed", "1", "--max-per-file", "4",
                   "--gpu-jobs", "2", "--deadline", "30", "--jobs", "1", "--recheck", "2",
                   "--cache-dir", str(tmp_path / "cache"), "--report", str(tmp_path / "report")])
    printed = " ".join(capsys.readouterr().out.split())
    assert status in (0, 1), printed
    assert "workers: " in printed and "re-check workers: " in printed, printed
    # where the slots' time went: the fresh workers (each started ahead, on a spare) and the
    # gate sets, with the share pytest and the gates took
    import re as _re
    timing = _re.search(r"worker time: (\d+) fresh worker\(s\): each started in ([\d.]+) s .*?(\d+) gate set\(s\) "
                        r"ending (?:clean|in a poisoned context) \((\d+) gates\): ([\d.]+) s each, of it ([\d.]+) s in "
                        r"pytest's protocol",
                        printed)
    assert timing, printed
    fresh, start, sets, gates, wall, protocol = (float(x) for x in timing.groups())
    # (pytest's protocol around one fake gate can be under 5 ms: printed as 0.00)
    assert fresh >= 1 and start >= 0 and sets >= 1 and gates >= sets and 0 <= protocol <= wall, timing.group(0)
    # one line a re-run mutant, written as each ends
    rows = [json.loads(line) for line in (tmp_path / "report" / "recheck.jsonl").read_text().splitlines()]
    agreed = _re.search(r"verdict integrity: (\d+) of (\d+) re-run verdicts agreed", printed)
    assert agreed and len(rows) == int(agreed.group(2)) and sum(r["agreed"] for r in rows) == int(agreed.group(1))
    assert all(set(r) == {"id", "first", "second", "agreed", "reason"} for r in rows), rows
    per = _re.search(r"(\d+) mutant\(s\) run: ([\d.]+) fresh worker\(s\) a mutant", printed)
    assert per and abs(float(per.group(2)) - fresh / int(per.group(1))) < 0.01, printed
    assert "re-run verdicts agreed (every survivor and a sample, each in a fresh worker no other mutant used)" \
        in printed, printed
    import re

    agreed, checked = map(int, re.search(r"(\d+) of (\d+) re-run verdicts agreed", printed).groups())
    assert agreed == checked >= 2, printed  # a deterministic suite: every verdict the same in a fresh worker


def test_controls_on_the_warm_executor_are_proven_in_fresh_workers_at_once(suite, tmp_path, monkeypatch):
    from harness.campaigns.controls import collect as collect_module
    from harness.campaigns.controls.report import word
    from harness.campaigns.controls.runner import CampaignConfig, run_campaign

    real_collect, collected = collect_module.collect_gates, []

    def counted(modules, **kw):  # each call is a collect-only pytest process
        collected.append(list(modules))
        return real_collect(modules, **kw)

    monkeypatch.setattr(collect_module, "collect_gates", counted)

    root, _ = suite
    (root / "kernels" / "k.cu").write_text("// guard\n__global__ void k(float* y, const float* x) { *y = *x + 1; }\n")
    controls = root / "controls"
    controls.mkdir()
    (controls / "minus.toml").write_text(textwrap.dedent('''
        description = "subtracts one"
        file = "k.cu"
        find = "*x + 1"
        replace = "*x - 1"
        why = "the anchor compares the value"

        [[expect]]
        gate = "gates/test_k.py::test_adds_one"
        route = "assertion"
        message = "out is not x + 1"
    '''))
    (controls / "no_guard.toml").write_text(textwrap.dedent('''
        description = "the guard is gone"
        file = "k.cu"
        find = "// guard"
        replace = "// none"
        why = "the trap gate fails by its own assertion when the guard stays silent"

        [[expect]]
        gate = "gates/test_k.py::test_guard_fires"
        route = "assertion"
    '''))
    config = CampaignConfig(rootdir=root, kernel_root=root / "kernels", controls_dir=controls,
                            report_dir=tmp_path / "report", jobs=2, executor="warm", cache_dir=tmp_path / "cache",
                            deadline=60)
    result = run_campaign(config)
    assert result.baseline.ok, result.baseline
    verdicts = {r.name: (word(r.verdict), r.matches) for r in result.controls}
    assert verdicts == {"minus": ("proven", True), "no_guard": ("proven", True)}, result.controls
    # the validation and the warm run's plan both ask which gates exist: one process answers both
    assert collected == [["gates/test_k.py"]], collected


def test_clearing_project_caches_spares_host_caches_and_the_harness_itself(tmp_path, monkeypatch):
    import functools
    import sys
    import types

    from harness import host_cache
    from harness.pool.worker import clear_project_caches

    mod = types.ModuleType("gates_fake_caches")
    mod.__file__ = str(tmp_path / "gates" / "fake.py")
    mod.device = functools.cache(lambda: [1])
    mod.host = host_cache(lambda: [2])
    monkeypatch.setitem(sys.modules, "gates_fake_caches", mod)
    mod.device(), mod.host()
    assert clear_project_caches(tmp_path) == 1
    assert mod.device.cache_info().currsize == 0 and mod.host.cache_info().currsize == 1
    from harness.core import device  # a harness module under the repo root keeps its caches

    device._probe()
    before = device._probe.cache_info().currsize
    clear_project_caches(Path(device.__file__).parents[1])
    assert device._probe.cache_info().currsize == before == 1


def test_a_gate_that_hangs_is_found_in_its_own_deadline_not_the_whole_sets(suite):
    root, ex = suite
    ex.gate_deadlines = {GATE_IDS[0]: 30.0, GATE_IDS[2]: 2.0}
    box = _mutant(root, "spin2", KERNEL + "// SPIN\n")
    runs = ex.run(box, [GATE_IDS[0], GATE_IDS[2]], 60)
    # the set's deadline was 60 s of the run's own time (its waits for workers apart): cut
    # before that, the run was cut by the hanging gate's own 2 s (however slow the machine)
    assert runs.timed_out and runs.seconds - runs.waited < 60, runs
    assert runs.timeout_note == f"{GATE_IDS[2]} ran past its deadline"  # named, for the mutant's reason
    ok = ex.run(_mutant(root, "after2", KERNEL), GATE_IDS[:1], 60)  # a new worker for the next mutant
    assert ok.outcomes[0].outcome == "passed"


def test_closing_the_executor_ends_a_run_in_flight_at_once_and_no_new_pool_starts(suite):
    import threading
    import time

    from harness.pool import controller

    root, ex = suite
    box = _mutant(root, "spin3", KERNEL + "// SPIN\n")
    got = {}
    t = threading.Thread(target=lambda: got.setdefault("runs", ex.run(box, GATE_IDS[2:], 120)))
    t.start()
    while not (box.parent / "pids").exists():  # the gate wrote it, then blocks in C in its worker
        assert t.is_alive(), got
        time.sleep(0.05)
    ex.close()  # what an interrupted campaign does
    t.join(300)  # (a bound against a hang only)
    assert not t.is_alive()
    runs = got["runs"]
    # ended by the close: its 120 s deadline (the run's own time, its waits apart) had not come
    assert (runs.crashed or runs.timed_out) and runs.seconds - runs.waited < 120, runs
    with pytest.raises(controller.PoolError, match="closed"):
        ex._take()


def test_reset_refuses_a_worker_whose_device_buffers_outlive_the_mutant(monkeypatch, tmp_path):
    """The pool's memory is kept between mutants; a buffer still held after teardown is not."""
    import sys
    import types

    from harness.core import device
    from harness.pool import worker as pool_worker

    held = {"bytes": 0}
    pool = types.SimpleNamespace(used_bytes=lambda: held["bytes"],
                                 free_all_blocks=lambda: pytest.fail("the pool's memory is kept"))
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(get_default_memory_pool=lambda: pool))
    monkeypatch.setattr(device, "context_is_poisoned", lambda: False)
    session = types.SimpleNamespace(_setupstate=types.SimpleNamespace(teardown_exact=lambda item: None),
                                    config=types.SimpleNamespace(rootpath=tmp_path))
    assert pool_worker.reset_for_next_mutant(session) is None
    # a failed gate's traceback (kept by pytest for a debugger) holds its buffers: let go

    class Buffer:
        def __init__(self):
            held["bytes"] += 512

        def __del__(self):
            held["bytes"] -= 512

    def failing_gate():
        kept = Buffer()  # noqa: F841 - a local of the failing frame, as a gate's device array is
        raise AssertionError("out differs")

    try:
        failing_gate()
    except AssertionError as exc:
        sys.last_type, sys.last_value, sys.last_traceback = type(exc), exc, exc.__traceback__
        sys.last_exc = exc  # (Python 3.12 keeps this one too)
    assert held["bytes"] == 512
    assert pool_worker.reset_for_next_mutant(session) is None and held["bytes"] == 0
    held["bytes"] = 4096
    why = pool_worker.reset_for_next_mutant(session)
    assert why is not None and "4096 bytes" in why and "still held" in why


def test_a_worker_that_cannot_start_mid_campaign_is_a_lost_device_not_a_verdict(suite, tmp_path, monkeypatch):
    from harness.core.errors import DeviceLost

    flag = tmp_path / "dead"
    monkeypatch.setenv("FAKE_GPU_DEAD_FLAG", str(flag))
    root, ex = suite
    assert ex.run(_mutant(root, "alive", KERNEL), GATE_IDS[:1], 60).outcomes[0].outcome == "passed"
    flag.write_text("")
    with pytest.raises(DeviceLost, match="could not start.*cudaErrorNoDevice"):
        for i in range(6):  # each trap gate ends its worker; the spares made before the loss run out
            ex.run(_mutant(root, f"after{i}", KERNEL), GATE_IDS[1:2], 60)


def test_a_mutant_that_faults_gate_after_gate_stops_after_a_few_faults(suite):
    from harness.campaigns.mutate.execute import judge
    from harness.runs.warm import MAX_FAULTS

    root, ex = suite
    launches = [f"gates/test_k.py::test_each_launch[{i}]" for i in range(6)]
    runs = ex.run(_mutant(root, "faults", KERNEL + "// FAULT\n"), launches, 60)
    ran = [o for o in runs.outcomes if o.outcome != "not run"]
    assert len(ran) == MAX_FAULTS and all(o.outcome == "failed" for o in ran), runs
    j = judge([runs])
    assert j.verdict.value == "killed-by-trap" and f"faulted in {MAX_FAULTS} gates (2 gate(s) not run)" in j.reason
    # after its first fault, the mutant's memory-safety gates run next: a fault there is a
    # kill, and the run stops at it
    ex.memory_safety = frozenset({launches[5]})
    runs = ex.run(_mutant(root, "faults-safe", KERNEL + "// FAULT\n"), launches, 60)
    by_gate = {o.nodeid: o.outcome for o in runs.outcomes}
    assert [by_gate[g] for g in launches] == ["failed"] + ["not run"] * 4 + ["failed"]
    assert judge([runs], frozenset({launches[5]})).memory_safety
    # a trap gate is a memory-safety gate too, but a fault is what it expects: it is neither
    # moved first nor run past the cap
    ex.memory_safety, ex.trap_gates = frozenset({launches[5]}), frozenset({launches[5]})
    runs = ex.run(_mutant(root, "faults-trap-gate", KERNEL + "// FAULT\n"), launches, 60)
    by_gate = {o.nodeid: o.outcome for o in runs.outcomes}
    assert [by_gate[g] for g in launches] == ["failed"] * MAX_FAULTS + ["not run"] * 2, by_gate
    ex.trap_gates = frozenset()
    # a gate that names a fault by its own assertion (@pytest.mark.names_faults) runs first
    # after the first fault, before the memory-safety gates
    ex.memory_safety, ex.names_faults = frozenset({launches[5]}), frozenset({launches[4]})
    runs = ex.run(_mutant(root, "faults-naming", KERNEL + "// FAULT\n"), launches, 60)
    order = [o.nodeid for o in runs.outcomes if o.outcome != "not run"]
    assert order == [launches[0], launches[4], launches[5]], runs.outcomes
    ex.memory_safety, ex.names_faults = frozenset(), frozenset()
    ex.stop_on_kill = False  # --all-gates: the whole matrix, every fault
    runs = ex.run(_mutant(root, "faults-all", KERNEL + "// FAULT\n"), launches, 60)
    assert [o.outcome for o in runs.outcomes] == ["failed"] * 6


def test_a_slot_waiting_for_a_fresh_worker_does_not_hold_up_the_others(tmp_path):
    """One slot blocked on a spare that is still starting must not stop another slot from
    giving back its reset worker and a third from taking it."""
    import threading
    import types

    started = threading.Event()
    release = threading.Event()

    class SlowPool:
        def fresh_worker(self):
            started.set()
            release.wait(10)
            return types.SimpleNamespace(alive=True, served=0, ended_because=None, name="fresh", start_s=0.0,
                                         start_phases={}, device={"gpu_wait": "block"})

    ex = WarmExecutor(tmp_path, ("gates",), tmp_path, tmp_path / "cache")
    ex._pool = SlowPool()
    fresh = []
    waiting = threading.Thread(target=lambda: fresh.append(ex._take()))
    waiting.start()
    assert started.wait(10), "the first slot asked the pool for a fresh worker"
    reset = types.SimpleNamespace(alive=True, served=3, ended_because=None, name="reset")
    done = threading.Event()
    got = []

    def give_back_and_take():
        ex._give_back(reset)
        got.append(ex._take())
        done.set()

    threading.Thread(target=give_back_and_take).start()
    assert done.wait(5), "giving back and taking a reset worker waited for the pool"
    assert got == [reset]
    release.set()
    waiting.join(10)
    assert [w.name for w in fresh] == ["fresh"], "the waiting slot got its fresh worker"
    assert ex.gpu_wait == "block" and ex.summary().endswith("(each waited for the GPU by block)")


def test_a_batchs_wait_for_workers_does_not_cut_the_next_batch(monkeypatch):
    # run_mutant gives the siblings batch what is left of the deadline: the direct batch's
    # wait for fresh workers (a warm executor's `waited`) is not the mutant's time. Its clock
    # is one this test moves (by the direct batch's 0.6 s, all of it waiting): exact figures.
    import types

    from harness.campaigns.mutate import execute
    from harness.campaigns.mutate.execute import run_mutant
    from harness.campaigns.mutate.verdicts import Verdict
    from harness.runs.result import Executor, GateOutcome, GateRuns

    now = [100.0]
    monkeypatch.setattr(execute, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))

    class Waiting(Executor):
        calls = []

        def run(self, sandbox, gates, deadline):
            self.calls.append((tuple(gates), deadline))
            now[0] += 0.5  # all of it waiting for a worker, longer than the whole deadline
            return GateRuns(tuple(GateOutcome(g, "passed") for g in gates), seconds=0.5, waited=0.5)

    ex = Waiting()
    j = run_mutant(ex, Path("."), [("g/direct",), ("g/sibling",)], 0.25, all_gates=False)
    assert ex.calls == [(("g/direct",), 0.25), (("g/sibling",), 0.25)], "the siblings ran, with the whole deadline"
    assert j.verdict is Verdict.SURVIVED, j.reason


def test_a_fault_in_a_memory_safety_gate_ends_the_mutants_run_as_a_kill_does():
    # killed-by-trap in a gate written for memory safety counts as a kill (the score): the
    # sibling batch does not run after it, as it would not after a kill by assertion
    from harness.campaigns.mutate.execute import run_mutant
    from harness.runs.result import Executor, GateOutcome, GateRuns

    class Faulting(Executor):
        calls = []

        def run(self, sandbox, gates, deadline):
            self.calls.append(tuple(gates))
            return GateRuns(tuple(GateOutcome(g, "failed", "trap", "cudaErrorIllegalAddress") for g in gates))

    ex = Faulting()
    j = run_mutant(ex, Path("."), [("g/safe",), ("g/sibling",)], 5, all_gates=False, memory_safety=frozenset({"g/safe"}))
    assert ex.calls == [("g/safe",)] and j.memory_safety, (ex.calls, j)
    ex.calls.clear()
    j = run_mutant(ex, Path("."), [("g/other",), ("g/sibling",)], 5, all_gates=False, memory_safety=frozenset({"g/safe"}))
    assert ex.calls == [("g/other",), ("g/sibling",)] and not j.memory_safety, "a plain fault does not stop the run"


SHADOW_GATE = "gates/test_k.py::test_guard_counts_in_the_shadow"


def test_the_trap_shadows_wiring_check_keeps_the_trap_gates_whose_guards_counted(suite):
    root, ex = suite
    ex.trap_gates = frozenset({SHADOW_GATE, GATE_IDS[1]})
    why_not = ex.check_trap_shadow(root / "kernels")
    assert ex.shadow_gates == {SHADOW_GATE}
    # the other trap gate trapped for real in the shadow (no count): it keeps a fresh worker each
    assert set(why_not) == {GATE_IDS[1]} and "0 guard(s) counted" in why_not[GATE_IDS[1]], why_not


def test_a_shadowed_trap_gate_passes_in_the_mutants_own_worker_and_fails_when_its_guard_is_gone(suite):
    root, ex = suite
    ex.trap_gates = frozenset({SHADOW_GATE, GATE_IDS[1]})
    ex.check_trap_shadow(root / "kernels")
    ex.replaced.clear()  # the check's own: the unshadowable trap gate trapped for real
    box = _mutant(root, "same", KERNEL)
    runs = ex.run(box, [GATE_IDS[0], SHADOW_GATE, GATE_IDS[2]], 60)
    assert [o.outcome for o in runs.outcomes] == ["passed"] * 3, runs
    assert not ex.replaced, ex.replaced  # no trap: the worker is kept for the next mutant
    assert ex.times["shadowed"] == 1 and "1 trap gate(s) run in the trap shadow" in ex.timing()
    gone = ex.run(_mutant(root, "noguard", KERNEL.replace("// guard", "// none")), [SHADOW_GATE], 60)
    o = gone.outcomes[0]
    assert (o.outcome, o.route) == ("failed", "assertion"), o
    assert "did not fire" in o.first_failure_line
    # the same gate unshadowed (the re-check's way) traps for real and ends its worker
    ex.shadow_gates = frozenset()
    real = ex.run(_mutant(root, "real", KERNEL), [SHADOW_GATE], 60)
    assert real.outcomes[0].outcome == "passed" and ex.replaced == {"a gate left the CUDA context unusable": 1}


@pytest.mark.parametrize("bad", ["0", "-5", "nan", "inf", "soon"])
def test_a_bad_naive_seconds_is_refused_with_the_fix(bad, capsys):
    from harness.campaigns.mutate.bench import main

    assert main(["--naive-seconds", bad]) == 2
    err = capsys.readouterr().err
    assert "--naive-seconds" in err and "e.g. --naive-seconds 300" in err and err.count("\n") == 1, err


def test_the_bench_compares_kills_of_another_kind_as_agreement_one_way_only():
    # the campaign stops at the first kill (here a fault), the naive way runs every gate (and
    # one asserted): the same kill. Killed warm but only trapped naive is a disagreement.
    from harness.campaigns.mutate.bench import compare

    warm = {"a": "killed-by-trap", "b": "killed", "c": "survived", "d": "killed", "e": "equivalent", "f": "killed"}
    naive = {"a": "killed", "b": "killed-by-trap", "c": "survived", "d": "timeout", "e": "equivalent", "f": "survived"}
    both, cut, kind_only, disagree = compare(warm, naive)
    assert set(both) == {"a", "b", "c", "f"} and cut == {"d": ("killed", "timeout")}
    assert kind_only == {"a": ("killed-by-trap", "killed")}
    assert disagree == {"b": ("killed", "killed-by-trap"), "f": ("killed", "survived")}


def test_the_campaigns_workers_start_while_its_baseline_runs(suite, tmp_path, monkeypatch):
    # the warm factory starts the server's collection, the probe and the spares beside the
    # baseline, so the first mutant does not wait for them
    import os
    import time

    from harness.campaigns.mutate import campaign as campaign_mod
    from harness.campaigns.mutate.cli import _executor_factory, build_parser, config_from

    root, _ = suite
    (root / "kernels" / "k.cu").write_text(GUARDED_KERNEL)
    args = build_parser().parse_args(["--rootdir", str(root), "--no-require-gpu", "--seed", "1", "--max-per-file", "2",
                                      "--gpu-jobs", "1", "--deadline", "30", "--jobs", "1",
                                      "--cache-dir", str(tmp_path / "cache"), "--report", str(tmp_path / "report")])
    config = config_from(args)
    factory, made = _executor_factory(config, "warm")
    real = campaign_mod.run_baseline
    seen = {}

    def baseline_that_watches(*a, **k):
        got = real(*a, **k)
        end = time.monotonic() + 60
        while time.monotonic() < end and not all(ex._pool is not None for ex in made.values()):
            time.sleep(0.05)
        seen["started during the baseline"] = bool(made) and all(ex._pool is not None for ex in made.values())
        return got

    monkeypatch.setattr(campaign_mod, "run_baseline", baseline_that_watches)
    # the baseline's recorder is set for its own process only: a server started meanwhile
    # from this process's environment must not record into the baseline's coverage
    from harness.runs import fresh as child
    from harness.core.child import COVERAGE_DIR_CHANNEL as ENV

    real_run_gates = child.run_gates
    envs = []

    def run_gates(*a, **k):
        envs.append((os.environ.get("PYTEST_PLUGINS"), os.environ.get(ENV), k.get("env")))
        return real_run_gates(*a, **k)

    monkeypatch.setattr(child, "run_gates", run_gates)
    monkeypatch.delenv("PYTEST_PLUGINS", raising=False)
    try:
        result = campaign_mod.run_campaign(config, executor_factory=factory)
    finally:
        for ex in made.values():
            ex.close()
    assert seen == {"started during the baseline": True}
    (plugins, folder, env), = envs
    assert (plugins, folder) == (None, None) and env["PYTEST_PLUGINS"] == "harness.campaigns.mutate.recorder" and env[ENV]
    assert len(made) == 1 and result.baseline.ok
    assert all(r.verdict.value != "pending" for r in result.results.values()) and result.results


def test_workers_started_ahead_and_closed_at_once_leave_nothing_running(suite, tmp_path):
    # an interrupt during the baseline closes the executors while their start is under way:
    # the start ends what it made, and no server or worker outlives the campaign
    import time

    from harness.campaigns.mutate.cli import _executor_factory, build_parser, config_from

    root, _ = suite
    args = build_parser().parse_args(["--rootdir", str(root), "--no-require-gpu", "--gpu-jobs", "2",
                                      "--cache-dir", str(tmp_path / "cache")])
    factory, made = _executor_factory(config_from(args), "warm")
    before = _descendants()  # e.g. multiprocessing's resource tracker, kept by an earlier test's screen
    thread = factory.prestart(tmp_path / "cache", None, [None, None])
    time.sleep(0.3)  # the server is starting
    for ex in made.values():
        ex.close()
    thread.join(timeout=300)  # (a bound against a hang only)
    assert not thread.is_alive()
    assert all(ex._pool is None for ex in made.values())
    for _ in range(6000):  # until the killed processes are gone (a zombie counts as gone); bounded against a hang
        if not _descendants() - before:
            break
        time.sleep(0.02)
    mine = sorted(_descendants() - before)
    names = {p: open(f"/proc/{p}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")[:200]
             for p in mine}
    assert mine == [], f"processes of the started-ahead executor outlived its close: {names}"


def _descendants() -> set[str]:
    import os

    return {p for p in os.listdir("/proc") if p.isdigit() and _parent_chain_has(int(p), os.getpid())}


def _parent_chain_has(pid: int, ancestor: int) -> bool:
    """Whether `ancestor` is `pid`'s parent, grandparent, ... (a zombie counts as gone)."""
    seen = 0
    while pid > 1 and seen < 64:
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
        except OSError:
            return False
        fields = stat[stat.rfind(")") + 2:].split()
        if fields[0] == "Z":
            return False
        pid, seen = int(fields[1]), seen + 1
        if pid == ancestor:
            return True
    return False


def test_clearing_the_project_caches_loads_no_lazily_loaded_module(tmp_path, monkeypatch):
    # a lazily loaded module (importlib's LazyLoader, as CuPy loads cupyx) in sys.modules is
    # read without being loaded: a reset must not import what no gate imported
    import importlib.util
    import sys

    from harness.pool.worker import clear_project_caches

    (tmp_path / "lazy_mod.py").write_text("raise RuntimeError('loaded by the reset')\n")
    spec = importlib.util.spec_from_file_location("lazy_mod", tmp_path / "lazy_mod.py")
    spec.loader = importlib.util.LazyLoader(spec.loader)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setitem(sys.modules, "lazy_mod", mod)
    assert clear_project_caches(tmp_path / "elsewhere") == 0
    assert type(mod).__name__ == "_LazyModule", "the module was loaded"


def test_a_device_lost_in_the_recheck_is_one_line_and_the_campaigns_report_stands(suite, tmp_path, monkeypatch, capsys):
    # the GPU stops answering once the campaign is done and its re-check starts fresh
    # workers: one red line that says the verdicts stand and how to re-check, no traceback
    from harness.campaigns.mutate import cli, recheck as recheck_mod

    root, _ = suite
    (root / "kernels" / "k.cu").write_text(GUARDED_KERNEL)
    flag = tmp_path / "dead"
    monkeypatch.setenv("FAKE_GPU_DEAD_FLAG", str(flag))
    real = recheck_mod.recheck

    def the_gpu_falls_off_the_bus(*a, **k):
        flag.write_text("")
        return real(*a, **k)

    monkeypatch.setattr(recheck_mod, "recheck", the_gpu_falls_off_the_bus)
    report = tmp_path / "report"
    status = cli.main(["--rootdir", str(root), "--no-require-gpu", "--seed", "1", "--max-per-file", "4",
                       "--gpu-jobs", "1", "--deadline", "30", "--jobs", "1", "--recheck", "2",
                       "--cache-dir", str(tmp_path / "cache"), "--report", str(report)])
    got = capsys.readouterr()
    said = " ".join(got.err.split())
    assert status == cli.ExitStatus.DEVICE_LOST, said
    assert "Traceback" not in got.err + got.out, got.err
    assert "device lost: the device stopped answering during the re-check" in said, said
    assert "then --resume runs the re-check again" in said, said
    rows = (report / "mutants.jsonl").read_text().splitlines()
    verdicts = json.loads((report / "mutation.json").read_text())["harness"]["verdicts"]
    assert f"the campaign's {len(rows)} verdicts stand in" in said and len(verdicts) == len(rows) > 0, said
