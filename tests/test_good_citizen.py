"""The plugin in a user's pytest: inert until a project opts in, gates and ordinary tests side
by side once it does, and `-p no:harness.plugin` as the way out. Each child pytest loads the
plugin with `-p harness.plugin`, as the installed entry point does in every run, and no other
installed plugin: what a plain run imports or prints is then the harness's doing."""

from pathlib import Path

import pytest

from tests._machine import use_child_env

PLUGIN = ("-p", "harness.plugin")

PLAIN = """
import sys

def test_add():
    assert 1 + 1 == 2

def test_nothing_heavy_was_imported_for_it():
    heavy = [m for m in ("numpy", "ml_dtypes", "cupy", "cuda.core", "rich", "harness.pool.controller") if m in sys.modules]
    assert heavy == []
"""


@pytest.fixture
def user(pytester, monkeypatch, tmp_path):
    """A user's project in an environment where the harness is installed, and no other plugin
    (another installed plugin may import NumPy, or print)."""
    use_child_env(monkeypatch, {"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"})
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    for var in ("HARNESS_REQUIRE_GPU", "HARNESS_KERNEL_ROOT", "HARNESS_CACHE_DIR", "HARNESS_ARCH"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return pytester


def _files(root: Path) -> set[str]:
    """What a run left in the project, less pytester's own (its basetemp and captured output)."""
    own = ("runpytest", "stdout", "stderr")
    return {p.relative_to(root).as_posix() for p in root.rglob("*")
            if "__pycache__" not in p.parts and not p.relative_to(root).parts[0].startswith(own)}


def test_a_project_that_never_opted_in_runs_as_plain_pytest_and_nothing_is_written(user, tmp_path):
    user.makepyfile(test_plain=PLAIN)
    before = _files(user.path)
    result = user.runpytest_subprocess(*PLUGIN, "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)
    out = result.stdout.str() + result.stderr.str()
    assert "harness" not in out.replace("plugins: harness", "")  # no vocabulary check, no summary section
    assert _files(user.path) == before  # no report folder
    assert not any((tmp_path / "tmp").iterdir())  # no pool folder
    assert not (tmp_path / "xdg").exists()  # no cubin cache


def test_an_unmarked_test_in_a_project_that_never_opted_in_is_no_gate(user):
    user.makepyfile(test_plain="def test_x():\n    pass\n")
    user.makeini("[pytest]\nmarkers =\n    slow: a user's own marker\n")
    result = user.runpytest_subprocess(*PLUGIN, "--strict-markers")
    result.assert_outcomes(passed=1)
    assert "gates by kind" not in result.stdout.str() and "not gates" not in result.stdout.str()


def test_gates_beside_ordinary_tests_only_the_gates_are_checked_and_counted(user):
    user.makeini("[pytest]\nharness_gates = gates\n")
    gates = user.mkdir("gates")
    (gates / "test_g.py").write_text(
        "import pytest\n\n@pytest.mark.structural\ndef test_one_kind():\n    pass\n")
    tests = user.mkdir("tests")
    (tests / "test_plain.py").write_text("def test_no_kind_needed():\n    pass\n\n"
                                         "def test_red():\n    assert False\n")
    result = user.runpytest_subprocess(*PLUGIN)
    result.assert_outcomes(passed=2, failed=1)
    rows = [line.split("│")[1].strip() for line in result.stdout.lines if line.startswith("│")]
    assert "structural" in rows and "other" not in rows
    result.stdout.fnmatch_lines(["*2 other test(s), not gates (run as plain pytest runs them): 1 passed, 1 failed*"])

    (tests / "test_marked.py").write_text("import pytest\n\n@pytest.mark.gpu\ndef test_gpu_without_kind():\n"
                                          "    pass\n")
    result = user.runpytest_subprocess(*PLUGIN)
    assert result.ret == pytest.ExitCode.USAGE_ERROR  # a harness marker makes it a gate, wherever it lives
    assert "tests/test_marked.py::test_gpu_without_kind: has no kind" in result.stderr.str()
    assert "test_no_kind_needed" not in result.stderr.str()
    # gpu is a common name: the message says how to keep it the project's own, or turn the harness off
    assert "if gpu is your project's own marker, register it in your ini `markers`" in result.stderr.str()
    assert "-p no:harness.plugin" in result.stderr.str()
    user.makeini("[pytest]\nharness_gates = gates\nmarkers =\n    gpu: this project's own: needs a GPU\n")
    result = user.runpytest_subprocess(*PLUGIN)  # registered, it is the project's: an ordinary test
    result.assert_outcomes(passed=3, failed=1)
    result.stdout.fnmatch_lines(["*3 other test(s), not gates (run as plain pytest runs them): 2 passed, 1 failed*"])


OWN_NAMES = {
    "its own gpu marker": "import pytest\n\n@pytest.mark.gpu\ndef test_needs_gpu():\n    assert False\n",
    "its own link marker, registered": "import pytest\n\n@pytest.mark.link\ndef test_link():\n    assert False\n",
    "its own kernel_root fixture": "import pytest\n\n@pytest.fixture\ndef kernel_root():\n    return 'k'\n\n"
                                   "def test_uses_it(kernel_root):\n    assert kernel_root == 'x'\n",
}


@pytest.mark.parametrize("what", list(OWN_NAMES))
def test_a_project_that_never_opted_in_keeps_plain_pytest_results_whatever_its_names(user, tmp_path, what):
    # a common marker name, a kind name the project registers, a fixture named as the harness's:
    # none is the harness's, so the run is plain pytest's (exit 1, every test run), and inert
    user.makepyfile(test_own=OWN_NAMES[what], test_plain=PLAIN)
    user.makeini("[pytest]\nmarkers =\n    link: the project's own: a network link test\n")
    before = _files(user.path)
    result = user.runpytest_subprocess(*PLUGIN, "-p", "no:cacheprovider", "--strict-markers")
    assert result.ret == pytest.ExitCode.TESTS_FAILED, result.stdout.str() + result.stderr.str()
    result.assert_outcomes(passed=2, failed=1)
    out = result.stdout.str() + result.stderr.str()
    assert "harness" not in out.replace("plugins: harness", "")
    assert _files(user.path) == before and not any((tmp_path / "tmp").iterdir())


def test_a_harness_marker_alone_opts_a_project_in(user):
    user.makepyfile(test_mixed="import pytest\n\n@pytest.mark.refusal\ndef test_gate():\n    pass\n\n"
                               "def test_plain():\n    pass\n")
    report = user.path / "rep"
    result = user.runpytest_subprocess(*PLUGIN, "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["*harness: gates by kind*", "*1 other test(s), not gates*"])
    result = user.runpytest_subprocess(*PLUGIN, f"--harness-report={report}")
    import json

    data = json.loads((report / "gates.json").read_text())
    assert [g["nodeid"] for g in data["gates"]] == ["test_mixed.py::test_gate"]  # ordinary tests are not records


def test_a_project_opted_in_only_by_require_gpu_on_the_command_line(user):
    user.makepyfile(test_plain="def test_plain():\n    pass\n")
    result = user.runpytest_subprocess(*PLUGIN)
    result.assert_outcomes(passed=1)  # not opted in: plain pytest
    result = user.runpytest_subprocess(*PLUGIN, "--require-gpu")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "harness: --require-gpu: " in result.stderr.str()
    assert "Traceback" not in result.stderr.str()


def test_opting_out_with_p_no_harness_plugin_works_where_a_conftest_names_the_plugin(user):
    user.makeconftest('pytest_plugins = ["harness.plugin"]\n')
    user.makeini("[pytest]\nharness_gates = .\n")
    user.makepyfile(test_plain=PLAIN)  # no kind: a vocabulary error when the plugin is on
    result = user.runpytest_subprocess()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "test_plain.py::test_add: has no kind" in result.stderr.str()
    result = user.runpytest_subprocess("-p", "no:harness.plugin", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)
    assert "gates by kind" not in result.stdout.str()


@pytest.mark.parametrize("driver", ["hidden", "present"])
def test_collect_only_starts_no_pool_and_probes_no_device(user, monkeypatch, tmp_path, driver):
    # "hidden": every device hidden (the user fixture), as on a machine with no driver
    monkeypatch.setenv("HARNESS_POOL_TRACE", str(tmp_path / "trace"))
    user.makeini("[pytest]\nharness_gates = .\n")
    if driver == "present":  # where libcuda loads, a run forks its pool's server before collecting; --collect-only must not
        user.makeconftest("import harness.core.device\n\nharness.core.device._driver_present = lambda: True\n")
    user.makepyfile(test_g="import pytest\n\n@pytest.mark.gpu\n@pytest.mark.anchor\ndef test_on_device():\n    pass\n")
    result = user.runpytest_subprocess(*PLUGIN, "--collect-only", "-q", "--require-gpu")
    assert result.ret == pytest.ExitCode.OK, result.stdout.str() + result.stderr.str()
    trace = (tmp_path / "trace").read_text()
    assert "configured" in trace and "probe" not in trace and "server" not in trace, trace
