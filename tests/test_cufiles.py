"""`python -m pytest` compiles every kernel: each `.cu` under the kernel root is a gate of
kind `compile`, whatever testpaths says; the gate vocabulary (one kind marker per gate) is
enforced on gates (not on ordinary tests); the terminal summary counts the two apart. No GPU
needed (NVRTC only)."""

import json
import xml.etree.ElementTree as ET

import pytest

from tests._machine import use_child_env


GOOD = 'template <int N> __global__ void tiled(float* o) { o[threadIdx.x % N] = N; }\n' \
       'extern "C" __global__ void plain(float* o) { o[threadIdx.x] = 1.0f; }\n'
BAD = 'extern "C" __global__ void bad(float* o) {\n    o[0] = not_declared;\n}\n'
LOAD_PLUGIN = 'import sys\npytest_plugins = [] if "harness.plugin" in sys.modules else ["harness.plugin"]\n'


@pytest.fixture
def project(pytester, monkeypatch, tmp_path):
    """testpaths names only tests/; the kernel root is kernels/ (a package with a launcher)."""
    use_child_env(monkeypatch)
    monkeypatch.setenv("HARNESS_CACHE_DIR", str(tmp_path / "cache"))
    pytester.makeini("[pytest]\nkernel_root = kernels\ntestpaths = tests\n")
    pytester.makeconftest(LOAD_PLUGIN)
    kernels = pytester.mkdir("kernels")
    (kernels / "__init__.py").write_text("")
    (kernels / "good.cu").write_text(GOOD)
    (kernels / "good.py").write_text('NAME_EXPRESSIONS = ("tiled<8>",)\n')
    tests = pytester.mkdir("tests")
    (tests / "test_own.py").write_text("def test_harness_itself():\n    pass\n")
    return pytester


def test_every_cu_is_compiled_by_the_plain_test_command_although_testpaths_omits_it(project):
    result = project.runpytest_subprocess("--junitxml", "junit.xml", "-rA")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["*tiled<8>: * registers, 0 spill bytes*", "*PASSED kernels/good.cu::compile*"])
    props = {}
    for case in ET.parse(project.path / "junit.xml").getroot().iter("testcase"):
        if case.get("name") == "compile":
            props = {p.get("name"): p.get("value") for p in case.iter("property")}
    assert props["kind"] == "compile" and props["gpu"] == "false"
    assert props["resources tiled<8>"].startswith("registers=") and "spill_bytes=0" in props["resources tiled<8>"]
    assert "resources plain" in props


def test_the_verbose_line_names_the_compile_item_by_its_node_id_and_its_failure_by_its_file(project):
    (project.path / "kernels" / "broken.cu").write_text(BAD)
    result = project.runpytest_subprocess("-v")
    result.stdout.fnmatch_lines(["kernels/broken.cu::compile FAILED*", "kernels/good.cu::compile PASSED*",
                                 "*_ compile broken.cu _*"])
    assert "::cu::" not in result.stdout.str()  # pytest turns a domain's dots into "::" where it ends the id


def test_a_syntax_error_in_any_cu_turns_the_run_red_naming_file_and_line(project):
    (project.path / "kernels" / "broken.cu").write_text(BAD)
    result = project.runpytest_subprocess("--harness-report", "rep")
    assert result.ret == 1
    result.assert_outcomes(passed=2, failed=1)
    broken = project.path / "kernels" / "broken.cu"
    result.stdout.fnmatch_lines([f"{broken}:2: does not compile", '*broken.cu(2): error: identifier "not_declared"*'])
    gates = {g["nodeid"]: g for g in json.loads((project.path / "rep" / "gates.json").read_text())["gates"]}
    red = gates["kernels/broken.cu::compile"]
    assert (red["kind"], red["outcome"], red["route"]) == ("compile", "failed", "compile")
    assert red["first_failure_line"].endswith("line 2: identifier \"not_declared\" is undefined")


def test_a_launcher_error_fails_its_compile_gate_with_one_line(project):
    (project.path / "kernels" / "good.py").write_text('NAME_EXPRESSIONS = "tiled<8>"\n')
    result = project.runpytest_subprocess()
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*good.py: NAME_EXPRESSIONS must be a tuple of C++ name expressions*"])
    assert "Traceback" not in result.stdout.str()


def test_paths_on_the_command_line_collect_only_what_they_reach_and_never_twice(project):
    only_tests = project.runpytest_subprocess("tests")
    only_tests.assert_outcomes(passed=1)
    only_kernels = project.runpytest_subprocess("kernels")
    only_kernels.assert_outcomes(passed=1)
    project.makeini("[pytest]\nkernel_root = kernels\ntestpaths = tests kernels\n")
    both = project.runpytest_subprocess("--collect-only", "-q")
    assert both.stdout.str().count("kernels/good.cu::compile") == 1


def test_compile_gates_honour_k_deselection(project):
    result = project.runpytest_subprocess("-k", "not compile")
    result.assert_outcomes(passed=1, deselected=1)


# ------------------------------------------------------------------ the vocabulary


def test_a_gate_with_no_kind_or_two_kinds_is_a_usage_error_naming_each(project):
    project.makeini("[pytest]\nkernel_root = kernels\ntestpaths = tests\nharness_gates = gates\n")
    gates = project.mkdir("gates")
    (gates / "test_g.py").write_text(
        "import pytest\n\n"
        "def test_none():\n    pass\n\n"
        "@pytest.mark.anchor\n@pytest.mark.link\ndef test_two():\n    pass\n\n"
        "@pytest.mark.link\ndef test_one():\n    pass\n")
    result = project.runpytest_subprocess("gates", "tests")
    assert result.ret == 4
    err = result.stderr.str()
    assert "harness: 2 gate(s) break the vocabulary" in err
    assert "gates/test_g.py::test_none: has no kind; mark it with exactly one of @pytest.mark.anchor" in err
    assert "gates/test_g.py::test_two: has kinds anchor, link; a gate has exactly one" in err
    assert "test_one" not in err and "test_harness_itself" not in err  # one kind; the harness's own test
    assert "Traceback" not in err


def test_a_test_outside_the_gate_paths_with_no_harness_marker_or_fixture_is_an_ordinary_test(project):
    project.makeini("[pytest]\nkernel_root = kernels\ntestpaths = tests\nharness_gates = gates\n")
    (project.path / "tests" / "test_uses_kernel_root.py").write_text(
        "def test_reads_the_root(kernel_root):\n    assert kernel_root.name == 'kernels'\n")
    result = project.runpytest_subprocess("tests")
    assert result.ret == 4  # the harness fixture makes it a gate, and a gate needs its kind
    assert "tests/test_uses_kernel_root.py::test_reads_the_root: has no kind" in result.stderr.str()
    assert "test_harness_itself" not in result.stderr.str()


def test_the_table_counts_gates_by_kind_and_ordinary_tests_apart(project):
    result = project.runpytest_subprocess()
    rows = [line.split("│")[1].strip() for line in result.stdout.lines if line.startswith("│")]
    assert rows == ["compile"], result.stdout.str()
    result.stdout.fnmatch_lines(["1 other test(s), not gates (run as plain pytest runs them): 1 passed"])
    assert "(no kind)" not in result.stdout.str()


SWITCH_TREE = LOAD_PLUGIN + '''
import os
from pathlib import Path

import pytest


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_call(item):
    from harness.core import settings as _settings

    _settings.bind(_settings.in_effect().with_kernel_root(os.environ["OTHER_TREE"]))  # as a pool worker switched
'''


def test_a_compile_item_compiles_the_file_of_the_kernel_tree_in_place_when_it_runs(project, tmp_path, monkeypatch):
    # A warm worker runs a comparison's REF side (or a sandbox) by switching the kernel root, not
    # by collecting again: the item must compile that tree's file at its path, not the one it was
    # collected from.
    other = tmp_path / "other"
    other.mkdir()
    (other / "good.cu").write_text(BAD)
    (other / "good.py").write_text('NAME_EXPRESSIONS = ()\n')
    monkeypatch.setenv("OTHER_TREE", str(other))
    project.makeconftest(SWITCH_TREE)
    result = project.runpytest_subprocess("kernels/good.cu")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([f"{other / 'good.cu'}:2: does not compile"])
