"""`python -m harness mutate` from the shell: bad input refused with the fix, `--static`
end to end with a report that validates, and the HTML page rendered by headless Chromium."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from harness.__main__ import main as harness_main
from harness.campaigns.mutate.cli import ExitStatus, main
from harness.campaigns.mutate.operators import OPERATORS
from tests._machine import CHROMIUM, PACKAGE, child_env, use_child_env

SUITE = Path(__file__).parent / "fixtures" / "mutate_suite"
REPO = Path(__file__).resolve().parents[1]
SCHEMA = PACKAGE / "campaigns" / "mutate" / "schema" / "mutation-testing-report-schema.json"


@pytest.fixture
def suite(tmp_path, monkeypatch):
    use_child_env(monkeypatch)
    copy = tmp_path / "suite"
    shutil.copytree(SUITE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    return copy


# every operator but the one whose mutant hangs a fake gate (`(blockDim.x - 1)`): --static runs
# the fake gates on the CPU, and that mutant would cost its whole deadline
NO_HANG = ("--operators", ",".join(op for op in OPERATORS if op != "gpu-index"))


def run(suite: Path, *args: str) -> int:
    return main(["--rootdir", str(suite), "--no-require-gpu", "--cache-dir", str(suite / "cache"),
                 "--report", str(suite / "report"), "--arch", "sm_90", *args])


@pytest.fixture
def browser() -> str:
    """Headless Chromium renders the mutation report (an optional tool: tests/_machine.py)."""
    return CHROMIUM.program("chromium", "chromium-browser", "google-chrome")


@pytest.fixture(scope="module")
def static_run(tmp_path_factory):
    """One `--static` run of the fake suite (every operator but the hanging one), read by the
    tests of its report: (its exit status, what it printed, the suite holding its report)."""
    import contextlib
    import io

    suite = tmp_path_factory.mktemp("static") / "suite"
    shutil.copytree(SUITE, suite, ignore=shutil.ignore_patterns("__pycache__"))
    printed = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(printed):
        use_child_env(mp)
        status = run(suite, "--static", "--jobs", "1", *NO_HANG)
    return status, printed.getvalue(), suite


@pytest.mark.parametrize("args, words", [
    (["--jobs", "0"], ["--jobs must be at least 1", "--jobs 4"]),
    (["--jobs", "two"], ["not a whole number"]),
    (["--gpu-jobs", "0"], ["--gpu-jobs must be at least 1"]),
    (["--deadline", "-5"], ["--deadline must be a positive", "--deadline 120"]),
    (["--deadline", "nan"], ["--deadline must be a positive, finite"]),
    (["--deadline", "inf"], ["finite"]),
    (["--deadline", "soon"], ["--deadline 'soon' is not a number of seconds or auto"]),
    (["--max-per-file", "0"], ["--max-per-file must be at least 1"]),
    (["--operators", "arithmetic,nope"], ["'nope'", *OPERATORS]),
    (["--operators", ""], ["(none named)", *OPERATORS]),
    (["--since", "no-such-ref-anywhere"], ["--since no-such-ref-anywhere", "no commit by that name"]),
    (["missing.cu"], ["missing.cu: no such file"]),
    (["--kernel-root", "nowhere"], ["is not a folder"]),
    (["--arch", "sm_1"], ["unknown --arch"]),
])
def test_bad_input_is_refused_with_the_fix(suite, capsys, args, words):
    if "--since" in args:
        env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
               "GIT_COMMITTER_EMAIL": "t@t", "PATH": "/usr/bin:/bin", "HOME": str(suite)}
        for cmd in (["init", "-q"], ["add", "."], ["commit", "-q", "-m", "base"]):
            subprocess.run(["git", *cmd], cwd=suite, check=True, capture_output=True, env=env)
    assert run(suite, *args) == ExitStatus.USAGE
    err = " ".join(capsys.readouterr().err.split())
    for word in words:
        assert word in err, err
    assert not (suite / "report" / "mutation.json").exists(), "nothing ran"


def test_since_outside_git_says_so(suite, capsys):
    assert run(suite, "--since", "HEAD") == ExitStatus.USAGE
    assert "--since needs a git checkout" in capsys.readouterr().err


def test_the_command_is_registered():
    assert harness_main(["mutate", "--jobs", "0"]) == ExitStatus.USAGE


class TestOneStaticRun:
    """The tests that read the module's one --static run: a class, so that under xdist they run on
    one worker together (the root conftest's scheduler) and the campaign runs once."""

    def test_static_screens_and_writes_a_report_that_validates(self, static_run):
        import jsonschema  # a test dependency (pyproject [test]): never skipped

        status, out, suite = static_run
        assert status == ExitStatus.OK, out
        assert "sum.cu" in out and "other.cu" in out and "mutants (0 resumed)" in out
        doc = json.loads((suite / "report" / "mutation.json").read_text())
        jsonschema.validate(doc, json.loads(SCHEMA.read_text()))
        statuses = {m["status"] for f in doc["files"].values() for m in f["mutants"]}
        # the fake gates need no GPU: --static runs them all on the CPU (tests/test_mutate_static.py)
        assert "Killed" in statuses and "Ignored" in statuses and "Pending" not in statuses
        assert doc["harness"]["mode"] == "static"
        assert (suite / "report" / "mutation.html").is_file()

    def test_the_html_report_shows_every_mutant_in_headless_chromium(self, static_run, tmp_path, browser):
        status, out, suite = static_run
        assert status == ExitStatus.OK, out
        page = suite / "report" / "mutation.html"
        doc = json.loads((suite / "report" / "mutation.json").read_text())
        n = sum(len(f["mutants"]) for f in doc["files"].values())
        base = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                f"--user-data-dir={tmp_path / 'profile'}"]
        dom = subprocess.run([*base, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120).stdout
        # the page's script builds every mutant row from the embedded data: they exist only if it ran
        assert f'id="rendered" data-mutants="{n}"' in dom, dom[-2000:]
        assert dom.count('class="mutant"') == n
        first = next(iter(doc["files"].values()))["mutants"][0]
        assert f'data-id="{first["id"]}"' in dom
        shot = tmp_path / "report.png"
        subprocess.run([*base, f"--screenshot={shot}", "--window-size=1400,1000", page.as_uri()],
                       capture_output=True, timeout=120)
        assert shot.is_file() and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    def test_report_only_rewrites_the_reports_from_the_results_file_and_runs_nothing(self, suite, static_run, capsys):
        report = suite / "report"
        assert run(suite, "--report-only") == ExitStatus.USAGE  # no results yet
        assert "holds no result for the mutants" in capsys.readouterr().err
        status, out, static_suite = static_run  # the module's --static run of the same suite: its results
        assert status == ExitStatus.OK, out
        shutil.copytree(static_suite / "report", report, dirs_exist_ok=True)
        before = json.loads((report / "mutation.json").read_text())["harness"]["verdicts"]
        (report / "mutation.json").unlink()
        (report / "mutation.html").unlink()
        lines = (report / "mutants.jsonl").read_text().splitlines()
        (report / "mutants.jsonl").write_text("\n".join(lines[:-1]) + "\n")  # a campaign cut short
        capsys.readouterr()
        stamp = {p: p.stat().st_mtime_ns for p in report.rglob("*") if p.is_file() and p.suffix != ".html"}
        assert run(suite, "--report-only", *NO_HANG) == ExitStatus.OK
        out = capsys.readouterr().out
        changed = [p.name for p, t in stamp.items() if not p.exists() or p.stat().st_mtime_ns != t]
        assert changed == [], changed  # no baseline, no screen, no gate run: only the two reports are written
        assert f"{len(lines) - 1} of {len(lines)} mutants have a result" in out and "nothing run" in out
        after = json.loads((report / "mutation.json").read_text())["harness"]["verdicts"]
        assert after == {k: v for k, v in before.items() if k in after} and len(after) == len(lines) - 1
        assert (report / "mutation.html").is_file()


def tree_hash(root: Path) -> str:
    import hashlib

    h = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        h.update(path.relative_to(root).as_posix().encode() + b"\0")
        if path.is_file():
            h.update(path.read_bytes())
    return h.hexdigest()


def session_processes(session: int, needle: bytes = b"") -> list[str]:
    """Command lines of the live processes in `session` that contain `needle`."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
                cmd = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            fields = stat[stat.rfind(")") + 2 :].split()
            if int(fields[3]) == session and fields[0] != "Z" and needle in cmd:
                found.append(cmd.replace(b"\0", b" ").decode(errors="replace"))
    return found


@pytest.mark.parametrize("signum", ["SIGINT", "SIGTERM"])
def test_ctrl_c_or_a_kill_during_the_screen_leaves_nothing_behind(suite, signum):
    # SIGINT: what a terminal's Ctrl-C sends the whole foreground group; SIGTERM: what a
    # cancelled CI job or `kill` sends (Python's default would exit without the sweep)
    import signal
    import tempfile
    import time

    root = suite / "kernels"
    before = tree_hash(root)
    cmd = [sys.executable, "-m", "harness", "mutate", "--rootdir", str(suite), "--no-require-gpu", "--static",
           "--cache-dir", str(suite / "cache"), "--report", str(suite / "report"), "--arch", "sm_90", "--jobs", "2"]
    (suite / "report").mkdir()
    (suite / "report" / "mutation.json").write_text("an earlier run's report")
    proc = subprocess.Popen(cmd, cwd=suite, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env=child_env())
    lines = []
    for line in proc.stderr:  # plain lines: stderr is not a terminal
        lines.append(line)
        if line.strip().startswith("screening"):
            break
    deadline = time.time() + 60
    while not session_processes(proc.pid, b"spawn_main") and time.time() < deadline:
        time.sleep(0.05)  # until the screening workers exist: then the screen is under way
    assert session_processes(proc.pid, b"spawn_main"), "the screen started its workers"
    os.killpg(proc.pid, getattr(signal, signum))  # to the whole group, the screening workers too
    rest, _ = proc.communicate(timeout=120)
    assert proc.returncode == ExitStatus.INTERRUPTED, "".join(lines)
    assert tree_hash(root) == before
    assert not (suite / "report" / "mutation.json").exists(), "an earlier run's report stood for this one"
    # every process of the run gone first (multiprocessing's resource tracker exits once its
    # pipe closes; a screening worker once its interrupt is handled): then nothing of theirs
    # can still be removing, or making, a sandbox. Waited for, not slept on; bounded against a hang.
    deadline = time.time() + 120
    while session_processes(proc.pid) and time.time() < deadline:
        time.sleep(0.05)
    assert session_processes(proc.pid) == [], "no process of the run outlives it"
    from harness.campaigns.mutate.generate import generate, select_files

    ids = {m.id for m in generate(root, select_files(root, []), tuple(OPERATORS))[0]}
    # this run's sandboxes: harness-mutant-<id>-<the campaign's pid>-<random>, and its screen's
    # home, harness-screen-<the campaign's pid>-<random>, where its workers make theirs
    # (another run, killed before this one, may have left its own)
    left = [p for p in Path(tempfile.gettempdir()).glob("harness-mutant-*")
            if p.name.split("-")[2] in ids and p.name.split("-")[3] == str(proc.pid)]
    left += list(Path(tempfile.gettempdir()).glob(f"harness-screen-{proc.pid}-*"))
    assert left == [], "no sandbox outlives the run"


def test_each_gpus_executor_keeps_a_spare_for_each_of_its_slots_plus_two(monkeypatch):
    from harness.core import device
    from harness.runs.warm import spares_for

    monkeypatch.setattr(device, "assignable_devices", lambda: [])
    assert spares_for(12, None) == 14  # one GPU: every slot on it
    monkeypatch.setattr(device, "assignable_devices", lambda: ["0", "1"])
    assert spares_for(24, "0") == spares_for(24, "1") == 14  # two GPUs: 12 slots each, not 24
    assert spares_for(3, "0") == 4 and spares_for(3, "1") == 3


def test_the_recheck_in_workers_ends_the_campaigns_workers_and_never_reuses_one(monkeypatch, tmp_path):
    from types import SimpleNamespace

    from harness.core import device
    from harness.campaigns.mutate.campaign import MutateConfig
    from harness.campaigns.mutate.cli import _fresh_worker_slots

    monkeypatch.setattr(device, "assignable_devices", lambda: ["0", "1"])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    closed = []
    campaign_executors = {"0": SimpleNamespace(close=lambda: closed.append("0")),
                          "1": SimpleNamespace(close=lambda: closed.append("1"))}
    config = MutateConfig(rootdir=tmp_path, kernel_root=Path("kernels"), report_dir=Path("r"), gpu_jobs=4)
    gates = {"gates/test_k.py::test_a": SimpleNamespace(duration=1.0)}
    coverage = SimpleNamespace(gates=gates, memory_safety_gates=lambda: frozenset({"gates/test_k.py::test_a"}),
                               fault_naming_gates=lambda: frozenset({"gates/test_k.py::test_a"}),
                               place=lambda nodeid: (False, True))  # not a trap gate; it launches kernels
    slots = _fresh_worker_slots(config, tmp_path / "cache", SimpleNamespace(arch="sm_90", coverage=coverage),
                                campaign_executors)
    assert sorted(closed) == ["0", "1"], "the campaign's workers end before the re-check starts its own"
    assert len(slots) == 4 and len({id(s) for s in slots}) == 2  # four slots on two GPUs' executors
    assert [s.device_ordinal for s in slots] == [0, 1, 0, 1]
    for s in slots:
        assert s.reuse is False and s.spares == 4 and s.arch == "sm_90"
        assert s.memory_safety == {"gates/test_k.py::test_a"}  # the campaign's fault cap spares them
        assert s.names_faults == {"gates/test_k.py::test_a"}  # ... and these, run first after a fault
        assert s.trap_gates == frozenset()
        assert s.gate_deadlines and s.gate_deadlines["gates/test_k.py::test_a"] > 1.0
    assert set(campaign_executors) == {("recheck", "0"), ("recheck", "1")}, "closed with the campaign's"


def test_an_unknown_recheck_process_is_refused(suite, capsys):
    with pytest.raises(SystemExit) as exc:
        run(suite, "--recheck-in", "container")
    assert exc.value.code == 2
    assert "--recheck-in" in capsys.readouterr().err


def test_a_run_that_ends_before_its_report_leaves_no_report_of_an_earlier_run(suite, capsys):
    """A red baseline writes no report: the one an earlier run left must not stand for this run."""
    report = suite / "report"
    report.mkdir()
    for name in ("mutation.json", "mutation.html"):
        (report / name).write_text("an earlier run's report")
    sum_cu = suite / "kernels" / "sum.cu"
    sum_cu.write_text(sum_cu.read_text().replace("in[i] + 1;", "in[i] + 2;"))  # test_adds_one goes red
    assert run(suite, "--static", "--jobs", "1", *NO_HANG) == ExitStatus.BASELINE_RED
    assert sorted(p.name for p in report.iterdir() if p.name.startswith("mutation.")) == []
