"""The fork server (harness.runs.forkserver): a forked `python -m pytest` is what a spawned one
is, a run it cannot fork as a spawn would be is spawned and says why, a deadline kills what a
forked run started, and the server imports no module that pytest would rewrite."""

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from harness.runs import forkserver
from tests._machine import PACKAGE, use_child_env

REPO = Path(__file__).resolve().parents[1]
SUITE = REPO / "tests" / "fixtures" / "controls_suite"

# A test that writes what its process is; a conftest whose atexit handler leaves a file.
FACTS_TEST = '''
import json, os, sys, tempfile
def test_facts():
    import harness.library.bits
    facts = {
        "argv0": os.path.basename(sys.argv[0]),
        "cwd": os.getcwd(),
        "path0": sys.path[0],
        "tmp": tempfile.gettempdir(),
        "per_run": os.environ.get("HARNESS_FACT"),
        "dont_write_bytecode": sys.dont_write_bytecode,
        "session_leader": os.getsid(0) == os.getpid(),
        "stdin": os.readlink("/proc/self/fd/0"),
        "stdout_is_the_log": os.readlink("/proc/self/fd/1").endswith("run.log"),
        "main": getattr(sys.modules["__main__"], "__spec__", None) and sys.modules["__main__"].__spec__.name,
        "harness_bits_loader": type(harness.library.bits.__loader__).__name__,
        "sigint": str(__import__("signal").getsignal(__import__("signal").SIGINT)),
    }
    open(os.environ["HARNESS_FACTS_OUT"], "w").write(json.dumps(facts))

def test_a_failing_assert():
    assert [1, 2, 3] == [1, 2, 4]
'''
ATEXIT_CONFTEST = '''
import atexit, os
atexit.register(lambda: open(os.environ["HARNESS_FACTS_OUT"] + ".atexit", "w").write("ran"))
'''


def _suite(tmp_path: Path, name: str) -> Path:
    root = tmp_path / name
    root.mkdir()
    (root / "pytest.ini").write_text("[pytest]\n")
    (root / "conftest.py").write_text(ATEXIT_CONFTEST)
    (root / "test_facts.py").write_text(FACTS_TEST)
    return root


def _run(root: Path, tmp_path: Path, name: str, **env_extra) -> tuple[dict, str, str | None, int]:
    out = tmp_path / f"{name}.json"
    private_tmp = tmp_path / f"{name}-tmp"
    private_tmp.mkdir()
    env = {**os.environ, "HARNESS_FACT": name, "HARNESS_FACTS_OUT": str(out), "TMPDIR": str(private_tmp),
           "PYTHONDONTWRITEBYTECODE": "1", **env_extra}
    log = tmp_path / name / "run.log"
    log.parent.mkdir(exist_ok=True)
    proc, why = forkserver.start(["-p", "no:cacheprovider", "-q", "--color=no"], cwd=root, env=env, stdout=log)
    code = proc.wait(timeout=120)
    assert (Path(str(out) + ".atexit")).read_text() == "ran", log.read_text()
    return json.loads(out.read_text()), log.read_text(), why, code


@pytest.fixture(autouse=True)
def harness_importable(monkeypatch):
    """The runs here import the harness from any folder, also where it is not installed, on a
    machine with no GPU (tests/_machine.py)."""
    use_child_env(monkeypatch)


@pytest.fixture
def fresh_servers():  # a process with no fork server yet
    forkserver.shutdown()
    yield
    forkserver.shutdown()


def test_a_forked_pytest_is_what_a_spawned_one_is(tmp_path, monkeypatch):
    root = _suite(tmp_path, "suite")
    forked, forked_log, forked_why, forked_code = _run(root, tmp_path, "forked")
    monkeypatch.setenv("HARNESS_SERVER_START", "spawn")
    spawned, spawned_log, spawned_why, spawned_code = _run(root, tmp_path, "spawned", HARNESS_SERVER_START="spawn")
    assert forked_why is None, forked_why
    assert spawned_why == "HARNESS_SERVER_START=spawn"
    assert forked_code == spawned_code == 1  # the failing assert
    for facts, name in ((forked, "forked"), (spawned, "spawned")):
        assert facts.pop("per_run") == name
        assert facts.pop("tmp") == str(tmp_path / f"{name}-tmp")
    assert forked == spawned  # harness.library.bits's loader among them: pytest rewrote it in both or in neither
    for log in (forked_log, spawned_log):
        assert "At index 2 diff: 3 != 4" in log
        assert "PytestAssertRewriteWarning" not in log and "already imported" not in log, log
    # A warning the environment gives (another installed plugin's, say) is in both logs or in neither
    assert _warning_lines(forked_log) == _warning_lines(spawned_log)


def _warning_lines(log: str) -> list[str]:
    return [line.strip() for line in log.splitlines() if "Warning" in line]  # a class's name, not the summary's count


def test_a_run_whose_folder_would_stand_in_for_a_module_the_server_imported_is_spawned(tmp_path):
    root = _suite(tmp_path, "suite")
    import queue

    shutil.copy(queue.__file__, root / "queue.py")  # a copy of the stdlib's, which the run then imports
    facts, log, why, code = _run(root, tmp_path, "shadowed")
    assert why is not None and f"{root / 'queue.py'} would stand in for the module queue" in why
    assert code == 1 and facts["per_run"] == "shadowed"


def test_a_startup_environment_gets_a_server_of_its_own_and_an_idle_one_makes_way(tmp_path, fresh_servers,
                                                                                    monkeypatch):
    monkeypatch.setattr(forkserver, "MAX_SERVERS", 1)
    root = _suite(tmp_path, "suite")
    _, _, first, _ = _run(root, tmp_path, "first")
    (first_server,) = forkserver._servers.values()
    _, _, again, _ = _run(root, tmp_path, "again", HARNESS_OTHER="run time")  # HARNESS_*: the same server
    assert first is None and again is None and list(forkserver._servers.values()) == [first_server]
    # a run in flight keeps its server: a run in another environment meanwhile is spawned
    waits = tmp_path / "waits"
    waits.mkdir()
    (waits / "test_wait.py").write_text("import time\ndef test_wait():\n    time.sleep(600)\n")
    busy, why = forkserver.start(["-q", "test_wait.py"], cwd=waits, env=dict(os.environ), stdout=tmp_path / "busy.log")
    assert why is None
    try:
        _, _, other, code = _run(root, tmp_path, "other", SOME_STARTUP_VARIABLE="1")
    finally:
        os.killpg(busy.pid, signal.SIGKILL)
        busy.wait(timeout=60)
    assert other == "each of this process's 1 fork servers has a run, each in another environment"
    assert code == 1
    # once idle, it makes way for the other environment's server
    _, _, later, code = _run(root, tmp_path, "later", SOME_STARTUP_VARIABLE="1")
    assert later is None and code == 1
    assert first_server.proc.poll() is not None and list(forkserver._servers.values()) != [first_server]


def test_a_forked_run_past_its_deadline_is_killed_with_what_it_started(tmp_path):
    from harness.runs.fresh import run_gates

    root = tmp_path / "hang"
    shutil.copytree(SUITE, root)
    pids = tmp_path / "pids"
    (root / "gates" / "gate_hang.py").write_text(textwrap.dedent(f"""
        import os, subprocess, time
        import pytest

        @pytest.mark.structural
        def test_hangs_with_a_grandchild():
            sleeper = subprocess.Popen(["sleep", "600"])
            open({str(pids)!r}, "w").write(f"{{os.getpid()}} {{sleeper.pid}}")
            time.sleep(600)
    """))
    run = run_gates(["gates/gate_hang.py"], kernel_root=root / "kernels", rootdir=root, report_dir=tmp_path / "rep",
                    deadline=6, cache_dir=tmp_path / "cache", require_gpu=False)
    log = (tmp_path / "rep" / "pytest.log").read_text()
    assert run.timed_out, log
    assert "spawned, not forked" not in log
    gone = []
    for pid in map(int, pids.read_text().split()):
        for _ in range(100):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                gone.append(pid)
                break
            time.sleep(0.05)
    assert len(gone) == 2, f"still running after the deadline: {pids.read_text()} (gone: {gone})"


def test_run_gates_gives_the_records_a_spawned_run_gives(tmp_path, monkeypatch):
    from harness.runs.fresh import run_gates

    root = tmp_path / "perturbed"
    shutil.copytree(SUITE, root)
    value = root / "kernels" / "value.cu"
    value.write_text(value.read_text().replace("#define VALUE 3", "#define VALUE 4"))

    def records(name):
        run = run_gates(["gates/gate_value.py"], kernel_root=root / "kernels", rootdir=root,
                        report_dir=tmp_path / name, deadline=120, cache_dir=tmp_path / "cache", require_gpu=False)
        log = (tmp_path / name / "pytest.log").read_text()
        return {(r.nodeid, r.outcome, r.route, r.first_failure_line, r.failure_message) for r in run.records.values()}, log

    forked, forked_log = records("forked")
    monkeypatch.setenv("HARNESS_SERVER_START", "spawn")
    spawned, spawned_log = records("spawned")
    assert "spawned, not forked" not in forked_log
    assert "# this pytest was spawned, not forked from the fork server: HARNESS_SERVER_START=spawn" in spawned_log
    assert forked == spawned
    assert any(r[1] == "failed" and "expects 3" in (r[4] or "") for r in forked), forked


def test_the_server_imports_no_module_of_a_pytest_plugins_distribution():
    # pytest rewrites the asserts of every module of a distribution with a pytest11 entry point
    # as it imports it; one the server imported would reach every child unrewritten
    probe = textwrap.dedent("""
        import importlib.metadata, json, runpy, sys
        server = runpy.run_path(sys.argv[1], run_name="probe")
        failed = server["_preimport"]()
        from _pytest.config import _iter_rewritable_modules
        plugin_packages = set()
        for dist in importlib.metadata.distributions():
            if any(ep.group == "pytest11" for ep in dist.entry_points):
                plugin_packages |= set(_iter_rewritable_modules(str(f) for f in dist.files or []))
                plugin_packages |= {ep.value.split(":")[0].split(".")[0] for ep in dist.entry_points
                                    if ep.group == "pytest11"}
        print(json.dumps({"failed": failed, "plugin_packages": sorted(plugin_packages), "modules": sorted(sys.modules)}))
    """)
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", probe, str(PACKAGE / "core" / "forkserver_main.py")],
                         cwd="/", env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout.splitlines()[-1])
    import importlib.metadata

    try:
        importlib.metadata.distribution("harness")
        assert "harness" in seen["plugin_packages"]  # installed, the harness is a pytest plugin's distribution
    except importlib.metadata.PackageNotFoundError:  # run from a checkout with nothing installed
        pass
    imported = [m for m in seen["modules"] if m.split(".")[0] in seen["plugin_packages"]]
    assert imported == [], f"the fork server imported {imported}: pytest could not rewrite them in its children"
    assert {"pytest", "rich.console", "numpy", "ml_dtypes"} <= set(seen["modules"]), seen["failed"]
    assert not any(m.startswith("cuda.bindings") or m.startswith("cuda.core") for m in seen["modules"])


def test_a_server_with_a_thread_forks_nothing(tmp_path):
    import runpy

    server = runpy.run_path(str(PACKAGE / "core" / "forkserver_main.py"), run_name="probe")
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)
    thread.start()
    try:
        why = server["_why_not_fork"]({"cwd": str(tmp_path)}, {})
    finally:
        stop.set()
        thread.join()
    assert why is not None and why.startswith("the fork server runs ") and why.endswith(" threads")


def test_the_server_ends_with_the_process_that_started_it(tmp_path):
    client = textwrap.dedent("""
        import os, sys, time
        from harness.runs import forkserver
        server = forkserver._server_for(dict(os.environ))
        print(server.proc.pid, flush=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", client], stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        server_pid = int(proc.stdout.readline())
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    for _ in range(200):
        try:
            os.kill(server_pid, 0)
        except ProcessLookupError:
            return
        try:
            with open(f"/proc/{server_pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":  # ended, not yet reaped by init
                    return
        except FileNotFoundError:  # reaped since
            return
        time.sleep(0.05)
    pytest.fail(f"the fork server {server_pid} outlived the process that started it")


def test_the_fresh_bench_times_both_ways_and_checks_they_agree(tmp_path, monkeypatch):
    from harness.runs import fresh_bench

    monkeypatch.chdir(SUITE)
    monkeypatch.setenv("HARNESS_CACHE_DIR", str(tmp_path / "cache"))
    assert fresh_bench.main(["gates/gate_value.py", "--runs", "1", "--out", str(tmp_path / "out")]) == 0
    data = json.loads((tmp_path / "out" / "bench-fresh.json").read_text())
    assert [r["way"] for r in data["runs"]] == ["spawn", "fork"]
    assert data["summary"]["same_outcomes"] and data["summary"]["gates"] == 5
    assert all(r["cpu_s"] > 0 and r["exit"] == 0 for r in data["runs"])
    assert "| forked |" in (tmp_path / "out" / "bench-fresh.md").read_text()
