"""`--compare-to REF`: REF's kernel tree materialised and removed, every gate run over both
trees, each arm output compared bit for bit. Host gates that read the kernel tree stand in
for GPU gates (the same executor runs them: a fresh pytest each side, with no device)."""

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

from harness.core.child import LAUNCHERS_OF_CHANNEL
from harness.plugin.compare.arms import compare_arm, compare_sides, ordered
from tests._machine import child_env, use_child_env

REPO = Path(__file__).resolve().parents[1]
PLUGIN = ("-p", "harness.plugin")

GATE = """
import re

import numpy as np
import pytest

import harness
from harness.library.kernels import kernel_root


def scale():
    return float(re.search(r"#define SCALE ([0-9.]+)", (kernel_root() / "k.cu").read_text()).group(1))


@pytest.mark.structural
def test_scaled():
    got = (np.arange(8, dtype=np.float32) * np.float32(scale())).astype(np.float32)
    harness.record("y", got)


@pytest.mark.structural
def test_unscaled():
    harness.record("z", np.arange(3, dtype=np.int32))


@pytest.mark.structural
def test_asserts_scale_three():
    harness.assert_bits_eq("w", np.full(4, scale(), np.float32), np.full(4, 3.0, np.float32))
"""


def git(root: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True, text=True).stdout


@pytest.fixture
def project(pytester, monkeypatch, tmp_path):
    return make_project(pytester, monkeypatch, tmp_path)


def make_project(pytester, monkeypatch, tmp_path):
    """A git repository with the gate module `GATE` over kernels/k.cu (`SCALE 3`), committed and tagged v1."""
    use_child_env(monkeypatch)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    for var in ("HARNESS_REQUIRE_GPU", "HARNESS_KERNEL_ROOT", "HARNESS_ARMS_OUT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    pytester.makeini("[pytest]\nharness_gates = gates\nkernel_root = kernels\n")
    (pytester.mkdir("gates") / "test_k.py").write_text(GATE)
    (pytester.mkdir("kernels") / "k.cu").write_text('#define SCALE 3\nextern "C" __global__ void k() {}\n')
    # pytest itself writes the gate module's rewritten bytecode beside it (unless
    # PYTHONDONTWRITEBYTECODE is set), as in any project that ignores it; the kernel root is
    # not ignored: a file the harness left there would still show
    (pytester.path / ".gitignore").write_text("gates/__pycache__/\n")
    git(pytester.path, "init", "-q", "-b", "main")
    git(pytester.path, "-c", "user.email=t@t", "-c", "user.name=t", "add", ".")
    git(pytester.path, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "scale 3")
    git(pytester.path, "tag", "v1")
    return pytester


def compare(pytester, *args):
    return pytester.runpytest_subprocess(*PLUGIN, "gates", "--harness-report=report", *args)


def report(pytester) -> dict:
    return json.loads((pytester.path / "report" / "compare.json").read_text())


def set_scale(pytester, value: str) -> None:
    (pytester.path / "kernels" / "k.cu").write_text(f'#define SCALE {value}\nextern "C" __global__ void k() {{}}\n')


DIES_TODAY = """
import os
import signal

import pytest

from harness.library.kernels import kernel_root


@pytest.mark.structural
def test_dies_where_the_scale_moved():
    if "SCALE 3\\n" not in (kernel_root() / "k.cu").read_text():
        os.kill(os.getpid(), signal.SIGKILL)  # a change that takes the gate's process down with it
"""


def test_a_gate_a_side_gives_no_verdict_for_is_red_not_left_out(project):
    # Today's process dies in its gate: nothing of today is compared, and the run must not be green
    (project.path / "gates" / "test_dies.py").write_text(DIES_TODAY)
    git(project.path, "add", ".")
    git(project.path, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "a gate that dies")
    set_scale(project, "4")
    result = project.runpytest_subprocess(*PLUGIN, "gates/test_dies.py", "--harness-report=report", "--compare-to=HEAD")
    out = result.stdout.str()
    assert result.ret == 1, out
    assert "1 gate(s) not compared, each red: a side gave no verdict for it" in out
    line = next(x for x in result.stdout.lines if x.strip().startswith("gates/test_dies.py::test_dies_where_the_scale_moved: not compared"))
    assert "today gave no verdict: not run (the pytest process exited -9 without a report; its log: " \
        "report/compare-today.log)" in line, line
    assert (project.path / "report" / "compare-today.log").is_file()
    assert "REF gave no verdict" not in line  # REF's side ran it and passed
    assert "a side gave no verdict (not compared, so red: named below): gates/test_dies.py" in out
    assert "host-only gates" not in out  # not the idle gate's advice: the gate did not finish
    result.assert_outcomes(failed=1)


@pytest.mark.parametrize("ref", ["HEAD", "main", "v1", "sha"])
def test_every_kind_of_revision_gives_the_kernel_tree_it_names_and_removes_it(project, ref):
    from harness.plugin.compare.tree import kernel_tree_at

    ref = git(project.path, "rev-parse", "HEAD").strip() if ref == "sha" else ref
    (project.path / "kernels" / "k.cu").write_text("// today's, uncommitted\n")
    with kernel_tree_at(ref, project.path / "kernels") as tree:
        assert (tree / "k.cu").read_text() == '#define SCALE 3\nextern "C" __global__ void k() {}\n'
        assert tree.resolve() != (project.path / "kernels").resolve()
    assert not tree.exists(), "the materialised tree outlived the comparison"


def test_an_unchanged_tree_has_the_same_bits_against_its_revision(project):
    # the whole run once (each kind of revision materialises the same tree: the test above)
    ref = "v1"
    result = compare(project, f"--compare-to={ref}")
    assert result.ret == 0, result.stdout.str()
    data = report(project)
    assert [(g["nodeid"].split("::")[1], [a["status"] for a in g["arms"]]) for g in data["gates"]] == [
        ("test_scaled", ["same bits"]), ("test_unscaled", ["same bits"]), ("test_asserts_scale_three", ["same bits"])]
    result.stdout.fnmatch_lines([f"*compare to {ref}: 3 gate(s), 3 arm(s): 3 same bits, 0 differ*"])
    assert json.loads((project.path / "report" / "gates.json").read_text())["summary"]["passed"] == 3
    result.assert_outcomes(passed=3)  # pytest's own counts: today's verdicts
    assert git(project.path, "status", "--porcelain", "--", "kernels", "gates") == "", "the working tree was touched"
    assert git(project.path, "diff", "--cached", "--name-only") == "", "the index was touched"


def test_a_changed_kernel_is_red_naming_the_first_difference_and_the_ulps(project):
    set_scale(project, "3.0000002")  # one float32 ulp above 3 scales every element but 0
    result = compare(project, "--compare-to=HEAD")
    assert result.ret == 1
    (scaled,) = [g for g in report(project)["gates"] if g["nodeid"].endswith("test_scaled")]
    (arm,) = scaled["arms"]
    assert arm["status"] == "differs" and arm["differing"] == 7 and arm["elements"] == 8
    assert arm["first"]["index"] == "[1]" and arm["first"]["ref"] == "3.0" and arm["first"]["ref_bits"] == "0x40400000"
    assert arm["ulps"]["max"] >= 1 and scaled["ref_outcome"] == scaled["today_outcome"] == "passed"
    assert "| `gates/test_k.py::test_scaled` | y | passed | passed | differs: 7 of 8" in \
        (project.path / "report" / "compare.md").read_text()
    result = compare(project, "--compare-to=HEAD", "--compare-allow-differ", "--junitxml=junit.xml")
    assert result.ret == 1  # today's own gate is red
    result.assert_outcomes(passed=2, failed=1)
    import xml.etree.ElementTree as ET

    props = {p.get("name"): p.get("value") for p in ET.parse(project.path / "junit.xml").iter("property")}
    assert props["compare y"].startswith("differs: 7 of 8 elements") and props["compare z"] == "same bits"
    (project.path / "gates" / "test_k.py").write_text(GATE.replace("np.full(4, 3.0,", "np.full(4, scale(),"))
    assert compare(project, "--compare-to=HEAD", "--compare-allow-differ").ret == 0  # a study: differs, not red


def test_a_folder_is_a_ref_and_the_materialised_tree_is_removed(project, tmp_path):
    old = tmp_path / "old"
    (old / "sub").mkdir(parents=True)
    (old / "k.cu").write_text('#define SCALE 5\n')
    result = compare(project, f"--compare-to={old}")
    gates = {g["nodeid"].split("::")[1]: g for g in report(project)["gates"]}
    assert result.ret == 1 and gates["test_scaled"]["arms"][0]["status"] == "differs"
    # red by its own assertion over REF's tree: its arm is still compared, and is the difference
    three = gates["test_asserts_scale_three"]
    assert three["ref_outcome"] == "failed by assertion" and three["today_outcome"] == "passed"
    assert three["arms"][0]["status"] == "differs" and three["arms"][0]["first"]["ref"] == "5.0"
    assert list((tmp_path / "tmp").glob("harness-compare-*")) == [] and list((tmp_path / "tmp").glob("harness-arms-*")) == []


@pytest.mark.parametrize("ref, says", [
    ("no-such-branch", "--compare-to no-such-branch: no such revision in"),
    ("EMPTY", "the folder holds no .cu file"),
])
def test_a_bad_ref_is_one_clear_line(project, tmp_path, ref, says):
    if ref == "EMPTY":
        (tmp_path / "empty").mkdir()
        ref = str(tmp_path / "empty")
    result = compare(project, f"--compare-to={ref}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert says in result.stderr.str()


def test_a_shallow_clone_without_the_ref_says_to_fetch_it(project, tmp_path):
    git(project.path, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-q", "--allow-empty", "-m", "two")
    clone = tmp_path / "shallow"
    subprocess.run(["git", "clone", "-q", "--depth", "1", f"file://{project.path}", str(clone)], check=True)
    result = subprocess.run(["python", "-m", "pytest", *PLUGIN, "gates", "--compare-to=v1~0"], cwd=clone,
                            capture_output=True, text=True)
    assert "this clone is shallow" in result.stderr, result.stderr


def test_arms_that_do_not_pair_up_and_shapes_that_changed():
    g = compare_sides("g::t", {"a": np.zeros(2, np.float32), "b": np.zeros(2, np.int32)},
                      {"a": np.zeros(3, np.float32), "c": np.zeros(1)}, "passed", "failed by assertion")
    assert [(a.arm, a.status) for a in g.arms] == [("a", "not comparable"), ("b", "only in REF"), ("c", "only today")]
    assert g.differs and g.arms[0].note == "REF float32(2,), today float32(3,)"
    new = compare_sides("g::n", {}, {"c": np.zeros(1)}, "failed by error", "passed")
    assert [a.status for a in new.arms] == ["only today"] and not new.differs  # a gate new today is not red


def test_ulps_count_across_zero_and_in_low_precision_floats():
    import ml_dtypes

    a = np.array([1.0, -0.0, 2.0], np.float32)
    b = np.nextafter(a, np.float32(np.inf)).astype(np.float32)
    c = compare_arm("x", a, b)
    assert c.differing == 3 and c.ulps["max"] == 1 and c.ulps["histogram"] == {"1": 3}
    zero = compare_arm("z", np.array([0.0], np.float32), np.array([-0.0], np.float32))
    assert zero.status == "differs" and zero.ulps["max"] == 0  # +0 and -0: other bits, no distance
    bf = compare_arm("bf", np.array([1.0], ml_dtypes.bfloat16), np.array([1.0078125], ml_dtypes.bfloat16))
    assert bf.ulps["max"] == 1 and bf.first["today_bits"] == "0x3f81"
    assert ordered(np.array([0x80000001], np.uint32), "f").tolist() == [-1]


LAUNCHER = "FACTOR = {factor}\n\n\ndef factor():\n    return FACTOR\n"
LAUNCHER_GATE = """
import numpy as np
import pytest

import harness
from kernels import launch
from kernels.launch import factor


@pytest.mark.structural
def test_launcher():
    harness.record("module", np.full(2, launch.FACTOR, np.int32))
    harness.record("bound", np.full(2, factor(), np.int32))
"""


def test_ref_runs_its_own_launchers_and_a_broken_one_is_one_line(project, tmp_path):
    # Launchers in the kernel root belong to the kernel tree: REF's side runs REF's, both through
    # the module (`from kernels import launch`) and through a name bound from it.
    (project.path / "kernels" / "__init__.py").write_text("")
    (project.path / "kernels" / "launch.py").write_text(LAUNCHER.format(factor=2))
    (project.path / "gates" / "test_launcher.py").write_text(LAUNCHER_GATE)
    old = tmp_path / "old"
    old.mkdir()
    (old / "k.cu").write_text('#define SCALE 3\n')
    (old / "launch.py").write_text(LAUNCHER.format(factor=7))
    result = compare(project, f"--compare-to={old}", "--compare-allow-differ", "gates/test_launcher.py")
    assert result.ret == 0, result.stdout.str()
    (gate,) = [g for g in report(project)["gates"] if g["nodeid"].endswith("test_launcher")]
    assert [(a["arm"], a["first"]["ref"], a["first"]["today"]) for a in gate["arms"]] == [
        ("module", "7", "2"), ("bound", "7", "2")]
    (old / "launch.py").write_text("from kernels.nowhere import thing\n")
    result = compare(project, f"--compare-to={old}", "gates/test_launcher.py")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "the launcher launch.py of" in result.stderr.str() and "ModuleNotFoundError" in result.stderr.str()
    assert "fix the launcher at REF" in result.stderr.str()
    assert (project.path / "kernels" / "launch.py").read_text() == LAUNCHER.format(factor=2)


def test_launchers_swap_in_place_and_back(tmp_path, monkeypatch):
    import importlib
    import sys

    from harness.library import ref_launchers

    today, other = tmp_path / "proj" / "kpkg", tmp_path / "other"
    today.mkdir(parents=True)
    other.mkdir()
    (today / "__init__.py").write_text("")
    (today / "launch.py").write_text(LAUNCHER.format(factor=2))
    (today / "only_today.py").write_text("X = 1\n")
    (other / "launch.py").write_text(LAUNCHER.format(factor=7))
    (tmp_path / "proj" / "user.py").write_text("from kpkg import launch\nfrom kpkg.launch import factor\n")
    monkeypatch.syspath_prepend(str(tmp_path / "proj"))
    monkeypatch.setenv(LAUNCHERS_OF_CHANNEL, str(today))
    user = importlib.import_module("user")
    importlib.import_module("kpkg.only_today")
    try:
        ref_launchers.use(other, tmp_path / "proj")
        assert user.launch.FACTOR == 7 and user.factor() == 7 and user.launch.__file__ == str(other / "launch.py")
        assert sys.modules["kpkg"].launch is user.launch and sys.modules["kpkg.only_today"].X == 1
        ref_launchers.use(today, tmp_path / "proj")  # back to today's
        assert user.launch.FACTOR == 2 and user.factor() == 2 and user.launch.__file__ == str(today / "launch.py")
    finally:
        ref_launchers.restore()
        for name in ("user", "kpkg", "kpkg.launch", "kpkg.only_today"):
            sys.modules.pop(name, None)


@pytest.mark.parametrize("args, says", [
    (["--compare-timing"], "--compare-timing belongs to a comparison: add --compare-to REF"),
    (["--compare-allow-differ"], "--compare-allow-differ belongs to a comparison"),
    (["--compare-to=HEAD", "--compare-timing", "--compare-repeat=0"], "--compare-repeat 0: give a count"),
    (["--compare-to=HEAD", "--compare-timing", "--compare-repeat=x"], "--compare-repeat 'x': give a count"),
    (["--compare-to=HEAD", "--compare-repeat=5"], "--compare-repeat 5 is the count of timed launches "
                                                  "--compare-timing makes: add --compare-timing, or drop"),
    (["--compare-to=HEAD", "--snapshot-update"], "--snapshot-update stores today's arms, --compare-to compares "
                                                 "two trees' arms: run them one after the other"),
    (["--compare-to="], "--compare-to needs a REF: a git revision"),
    (["--compare-to=gates/test_k.py"], "--compare-to gates/test_k.py is a file: pass a folder holding the old "
                                       "kernel tree, or a git revision"),
    (["--compare-to=HEAD", "-n", "2"], "--compare-to runs the gates itself, each tree's in processes of its own: "
                                       "drop -n/--dist"),
    (["--compare-to=HEAD", "--sanitize=memcheck"], "--sanitize does not reach the runs --compare-to starts"),
    (["--compare-to=HEAD", "--harness-real-traps"], "--harness-real-traps does not reach the runs --compare-to"),
    (["--compare-to=HEAD", "--include-dir=gates"], "--include-dir does not reach the runs --compare-to starts: name "
                                                   "the folders in the ini key harness_include_dirs"),
    (["--compare-to=gates"], "--compare-to gates: the folder holds no .cu file"),
    (["--compare-to=no-such-branch"], "--compare-to no-such-branch: no such revision in"),
])
def test_comparison_options_out_of_place_are_one_line(project, monkeypatch, args, says):
    monkeypatch.setenv("HARNESS_SANITIZER", "/bin/true")  # a compute-sanitizer is found: the combination is the error
    result = compare(project, *args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR, result.stdout.str() + result.stderr.str()
    err = result.stderr.str()
    assert says in err, err
    assert "Traceback" not in err and "collected" not in result.stdout.str()  # said before any collection


def test_a_revision_without_the_kernel_root_is_one_line_before_anything_runs(project):
    git(project.path, "mv", "kernels", "kernels2")
    git(project.path, "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "moved")
    git(project.path, "mv", "kernels2", "kernels")
    result = compare(project, "--compare-to=HEAD")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "--compare-to HEAD: HEAD has no kernels/; compare with a revision that has the kernel root" \
        in result.stderr.str()
    assert "collected" not in result.stdout.str()


PLAIN = """
import os
from pathlib import Path


def test_plain():
    with open(Path(os.environ["RUNS"]), "a") as f:
        f.write(f"{os.getpid()}\\n")
"""


DRIVER_PRESENT = "import harness.core.device\n\nharness.core.device._driver_present = lambda: True\n"


def with_driver(project, monkeypatch, driver: str) -> None:
    """Where a driver is present the run forks its pool's server at configure (and each side's
    pytest too): the other path a comparison takes. Faked; no device answers (none is visible)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    if driver == "present":
        (project.path / "conftest.py").write_text(DRIVER_PRESENT)


@pytest.mark.parametrize("driver", ["as this machine has it", "present"])
@pytest.mark.parametrize("targets", [["tests"], ["tests", "gates"]])
def test_ordinary_tests_run_once_as_without_the_option(project, tmp_path, monkeypatch, targets, driver):
    with_driver(project, monkeypatch, driver)
    (project.mkdir("tests") / "test_plain.py").write_text(PLAIN)
    runs = tmp_path / "runs"
    monkeypatch.setenv("RUNS", str(runs))
    result = project.runpytest_subprocess(*PLUGIN, *targets, "--harness-report=report", "--compare-to=HEAD")
    out = result.stdout.str()
    assert result.ret == 0, out
    assert len(runs.read_text().splitlines()) == 1, runs.read_text()  # once, and by no side's run
    if targets == ["tests"]:
        result.assert_outcomes(passed=1)
        assert "compare to HEAD: no gate selected, nothing compared (1 other test(s) ran as without --compare-to)" in out
    else:
        result.assert_outcomes(passed=4)  # the three gates, today's verdicts, and the ordinary test
        assert "compare to HEAD: 3 gate(s), 3 arm(s): 3 same bits" in out
        assert "1 other test(s), not gates (run as plain pytest runs them): 1 passed" in out


REFUSES_REF = """
import pytest


def pytest_configure(config):
    if "harness-compare-" in (config.getoption("kernel_root", None) or ""):
        raise pytest.UsageError("this project runs no gate over a REF tree")
"""


def test_a_side_that_gave_no_verdict_says_why_in_its_own_words_on_the_terminal(project):
    (project.path / "conftest.py").write_text(REFUSES_REF)
    result = compare(project, "--compare-to=HEAD")
    assert result.ret == 1
    line = next(x for x in result.stdout.lines if x.strip().startswith("gates/test_k.py::test_scaled: not compared"))
    assert "REF gave no verdict: not run (the pytest process exited 4 without a report: this project runs no " \
        "gate over a REF tree; its log: report/compare-ref.log)" in line, line
    assert "ERROR: this project runs no gate over a REF tree" in (project.path / "report" / "compare-ref.log").read_text()


def test_compile_items_are_compared_over_each_sides_own_kernel_file(project, tmp_path):
    # a bare run collects the .cu compile items: unchanged against its own revision, every one is green
    result = project.runpytest_subprocess(*PLUGIN, "--harness-report=report", "--compare-to=HEAD")
    assert result.ret == 0, result.stdout.str()
    result.assert_outcomes(passed=4)
    (cu,) = [g for g in report(project)["gates"] if g["nodeid"] == "kernels/k.cu::compile"]
    assert cu["ref_outcome"] == cu["today_outcome"] == "passed" and cu["kind"] == "compile"
    assert "1 gate(s) with no arm output: compile gates give their verdict by compiling" in result.stdout.str()
    # REF's side compiles REF's file: one that does not compile there, and a file new today
    old = tmp_path / "old"
    old.mkdir()
    (old / "k.cu").write_text("#define SCALE 3\nthis is not C++\n")
    (project.path / "kernels" / "new.cu").write_text('extern "C" __global__ void n() {}\n')
    result = project.runpytest_subprocess(*PLUGIN, "--harness-report=report", f"--compare-to={old}")
    gates = {g["nodeid"]: g for g in report(project)["gates"]}
    assert gates["kernels/k.cu::compile"]["ref_outcome"] == "failed by compile"
    assert gates["kernels/k.cu::compile"]["today_outcome"] == "passed"
    assert gates["kernels/new.cu::compile"]["ref_outcome"] == "not in REF (new today)"
    assert result.ret == 0, result.stdout.str()  # today's verdicts: every gate green, no arm moved
    result.assert_outcomes(passed=5)


@pytest.mark.parametrize("driver", ["as this machine has it", "present"])
def test_nothing_of_a_comparison_is_left_behind_but_its_reports(project, tmp_path, monkeypatch, driver):
    with_driver(project, monkeypatch, driver)
    for args in (["--compare-to=HEAD"], ["--compare-to=HEAD", "gates/test_k.py::test_scaled"]):
        compare(project, *args)
    set_scale(project, "4")
    assert compare(project, "--compare-to=HEAD").ret == 1  # red: still nothing of the sides kept
    assert sorted(p.name for p in (project.path / "report").iterdir()) == [
        "compare.json", "compare.md", "gates.json", "summary.md"]
    assert list((tmp_path / "tmp").iterdir()) == []


def test_a_host_gate_that_launches_nothing_and_records_nothing_says_so(project):
    (project.path / "gates" / "test_host.py").write_text(
        "import pytest\n\n\n@pytest.mark.structural\ndef test_nothing():\n    assert True\n")
    result = compare(project, "--compare-to=HEAD", "--compare-timing", "gates/test_host.py")
    assert result.ret == 0
    result.stdout.fnmatch_lines(["*no kernel launched on either side: nothing to compare*"])
    assert "nothing to compare" in (project.path / "report" / "compare.md").read_text()


SLEEPER = """
import os
import time

import pytest


@pytest.mark.structural
def test_sleeps():
    try:  # the first side to get here sleeps; the other (after it, or beside it in a lane of its own) returns
        fd = os.open(os.environ["MARK"], os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    except FileExistsError:
        return
    os.write(fd, str(os.getpid()).encode())
    os.close(fd)
    time.sleep(60)
"""


@pytest.mark.parametrize("lanes", ["1", "2"])  # the sides one after the other, or side by side
@pytest.mark.parametrize("stop", ["ctrl-c", "killed worker"])
def test_the_materialised_tree_goes_on_ctrl_c_and_a_killed_worker(project, tmp_path, stop, lanes):
    import os
    import signal
    import sys
    import time

    (project.path / "gates" / "test_sleep.py").write_text(SLEEPER)
    mark = tmp_path / "mark"
    env = {**os.environ, "MARK": str(mark)}
    proc = subprocess.Popen([sys.executable, "-m", "pytest", *PLUGIN, "gates/test_sleep.py", "--compare-to=HEAD",
                             "--harness-report=report", "-p", "no:cacheprovider", "--harness-lanes", lanes],
                            cwd=project.path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for _ in range(600):
            if mark.is_file() and mark.read_text():
                break
            time.sleep(0.1)
        else:
            pytest.fail("the gate never started")
        assert list((tmp_path / "tmp").glob("harness-compare-*")), "REF's tree should be there while the gate runs"
        if stop == "ctrl-c":
            proc.send_signal(signal.SIGINT)
        else:
            os.kill(int(mark.read_text()), signal.SIGKILL)  # the side's pytest: the comparison goes on
        out, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    if stop == "killed worker":
        assert "compare to HEAD: 1 gate(s)" in out, out
    assert list((tmp_path / "tmp").glob("harness-compare-*")) == [], out
    assert list((tmp_path / "tmp").glob("harness-arms-*")) == [], out
    assert not (project.path / "report" / "compare").exists(), out  # no side's run folder either


def test_an_arm_too_large_for_a_snapshot_is_still_compared_whole(project, tmp_path):
    (project.path / "gates" / "test_large.py").write_text(GATE.split("@pytest.mark.structural")[0] + '''
@pytest.mark.structural
def test_large():
    harness.record("big", np.arange(5000, dtype=np.float32) * np.float32(scale()))
''')
    old = tmp_path / "old"
    old.mkdir()
    (old / "k.cu").write_text('#define SCALE 5\n')
    result = compare(project, f"--compare-to={old}", "gates/test_large.py")
    (gate,) = [g for g in report(project)["gates"] if g["nodeid"].endswith("test_large")]
    (arm,) = gate["arms"]
    assert result.ret == 1 and arm["status"] == "differs" and arm["differing"] == 4999, arm
    assert arm["first"]["index"] == "[1]" and arm["first"]["ref"] == "5.0" and arm["first"]["today"] == "3.0"


def test_this_repositorys_bare_run_under_compare_to_is_not_spread_over_xdist(tmp_path):
    # With no driver, the repository's conftest spreads a bare run over the CPUs (-n auto); a
    # comparison refuses xdist, so the conftest must leave a bare comparison in one process.
    import sys

    (tmp_path / "no_driver_here.py").write_text("import harness.core.device\n\nharness.core.device._driver_present = lambda: False\n")
    env = child_env(first=(tmp_path,))
    result = subprocess.run([sys.executable, "-m", "pytest", "-p", "no_driver_here", "-p", "no:cacheprovider", "-q",
                             f"--compare-to={REPO / 'kernels_cu'}", "-k", "no_such_test_anywhere"],
                            cwd=REPO, env=env, capture_output=True, text=True)
    assert result.returncode == pytest.ExitCode.NO_TESTS_COLLECTED, result.stdout + result.stderr
    assert "no gate selected, nothing compared" in result.stdout


READ_ONLY_ROOTDIR = """
import os
import tempfile

_mkdtemp = tempfile.mkdtemp


def _refuse_the_rootdir(*args, dir=None, **kwargs):  # as a read-only checkout does
    if dir is not None and os.path.realpath(dir) == os.path.realpath(os.getcwd()):
        raise OSError(30, "Read-only file system")
    return _mkdtemp(*args, dir=dir, **kwargs)


tempfile.mkdtemp = _refuse_the_rootdir
"""


def test_a_report_folder_that_cannot_be_made_is_one_line_before_anything_runs(project, tmp_path, monkeypatch):
    import os

    (tmp_path / "read_only_rootdir.py").write_text(READ_ONLY_ROOTDIR)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ["PYTHONPATH"]]))
    result = project.runpytest_subprocess(*PLUGIN, "-p", "read_only_rootdir", "gates", "--compare-to=HEAD")
    assert result.ret == pytest.ExitCode.USAGE_ERROR, result.stdout.str() + result.stderr.str()
    assert f"--compare-to writes compare.json and compare.md to {project.path / 'harness-report'}, which cannot be " \
           f"made: {project.path} takes no new folder (Read-only file system); pass --harness-report DIR" \
        in result.stderr.str()
    assert "collected" not in result.stdout.str()
