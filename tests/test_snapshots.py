"""Bit snapshots of arm outputs: stored with --snapshot-update, held to their bits after, a
moved bit named by arm and element, a toolchain with no snapshot one line, not a failure.
Host gates (structural) stand in for GPU ones: the arms and the store are the same."""

import xml.etree.ElementTree as ET

import numpy as np
import pytest

from tests._machine import use_child_env

PLUGIN = ("-p", "harness.plugin")

GATE = """
import os

import numpy as np
import pytest

import harness
from harness import assert_bits_eq

SHIFT = int(os.environ.get("ARM_SHIFT", "0"))
N = int(os.environ.get("ARM_N", "64"))


@pytest.mark.structural
def test_sum():
    got = np.arange(N, dtype=np.float32) + np.float32(SHIFT) * (np.arange(N) == 7)
    assert_bits_eq("sum", got, got.copy())  # the kernel's arm checked against itself: the snapshot holds it
    harness.record("side", np.array([1, 2, 3], dtype=np.int32))
    if os.environ.get("ARM_EXTRA"):
        harness.record("extra", np.zeros(2, dtype=np.uint8))
"""


@pytest.fixture
def project(pytester, monkeypatch, tmp_path):
    use_child_env(monkeypatch)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    for var in ("ARM_SHIFT", "ARM_N", "ARM_EXTRA", "HARNESS_REQUIRE_GPU", "HARNESS_KERNEL_ROOT"):
        monkeypatch.delenv(var, raising=False)
    pytester.makeini("[pytest]\nharness_gates = gates\n")
    (pytester.mkdir("gates") / "test_k.py").write_text(GATE)
    return pytester


def snapshot_property(pytester, result) -> str:
    xml = ET.parse(pytester.path / "junit.xml")
    props = [p.get("value") for p in xml.iter("property") if p.get("name") == "snapshot"]
    assert len(props) == 1, (props, result.stdout.str())
    return props[0]


def run(pytester, *args):
    return pytester.runpytest_subprocess(*PLUGIN, "--junitxml=junit.xml", *args)


def test_stored_then_the_same_bits_pass(project):
    result = run(project, "--snapshot-update")
    result.assert_outcomes(passed=1)
    stored = list((project.path / "gates" / "__snapshots__" / "test_k" / "host").glob("*.npz"))
    assert len(stored) == 1 and "stored 2 arm(s)" in snapshot_property(project, result)
    result = run(project)
    result.assert_outcomes(passed=1)
    assert snapshot_property(project, result).startswith("2 arm(s) the same bits as ")


def test_a_moved_bit_fails_the_gate_naming_the_arm_and_the_element(project, monkeypatch):
    run(project, "--snapshot-update").assert_outcomes(passed=1)
    monkeypatch.setenv("ARM_SHIFT", "1")
    result = run(project)
    result.assert_outcomes(failed=1)
    out = result.stdout.str()
    assert "the bits moved" in out and "sum: 1 of 64 elements differ bitwise" in out, out
    assert "[7]" in out and "accept the new bits with --snapshot-update" in out


def test_a_large_arm_is_kept_as_a_digest_and_still_checked(project, monkeypatch):
    monkeypatch.setenv("ARM_N", "5000")
    run(project, "--snapshot-update").assert_outcomes(passed=1)
    monkeypatch.setenv("ARM_SHIFT", "3")
    result = run(project)
    result.assert_outcomes(failed=1)
    assert "sum: the bits moved (5000 elements, kept as a digest: no element named)" in result.stdout.str()


def test_arms_that_do_not_pair_up_are_named(project, monkeypatch):
    run(project, "--snapshot-update").assert_outcomes(passed=1)
    monkeypatch.setenv("ARM_EXTRA", "1")
    result = run(project)
    result.assert_outcomes(failed=1)
    assert "extra: recorded by this run, not in the snapshot" in result.stdout.str()
    monkeypatch.setenv("ARM_N", "65")
    monkeypatch.delenv("ARM_EXTRA")
    result = run(project)
    assert "sum: not comparable: stored float32(64,), now float32(65,)" in result.stdout.str()


def test_a_toolchain_with_no_snapshot_yet_is_one_line_not_a_failure(project):
    other = project.path / "gates" / "__snapshots__" / "test_k" / "nvrtc12.8-0123456789ab"
    other.mkdir(parents=True)
    result = run(project)
    result.assert_outcomes(passed=1)
    line = snapshot_property(project, result)
    assert line.startswith("no snapshot for this toolchain yet (host) (snapshots held: nvrtc12.8-0123456789ab)")
    assert "--snapshot-update" in line


def test_with_no_snapshot_folder_nothing_is_kept_or_written(project):
    result = run(project)
    result.assert_outcomes(passed=1)
    assert not (project.path / "gates" / "__snapshots__").exists()
    assert not [p for p in ET.parse(project.path / "junit.xml").iter("property") if p.get("name") == "snapshot"]


def test_arms_are_named_by_label_and_order_and_kept_only_when_armed():
    from harness.library import arms

    arms.note("x", np.zeros(1))
    assert arms.end() == {}
    arms.begin("g::t")
    for v in (1, 2, 3):
        arms.note("x", np.array([v]))
    arms.note("y", np.array([9]))
    kept = arms.end()
    assert list(kept) == ["x", "x#1", "x#2", "y"] and kept["x#2"].tolist() == [3]
    arms.note("x", np.zeros(1))
    assert arms.end() == {}


def failure_section(result, test: str) -> list[str]:
    """The lines pytest printed for one failed test, under its `___ test ___` header."""
    lines = result.stdout.lines
    start = next(i for i, line in enumerate(lines) if line.strip("_ ") == test)
    end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith(("___", "===", "- generated xml")))
    return [line for line in lines[start + 1:end] if line.strip()]


def test_a_moved_snapshot_is_one_message_without_the_harness_hook_source(project, monkeypatch):
    run(project, "--snapshot-update").assert_outcomes(passed=1)
    monkeypatch.setenv("ARM_SHIFT", "1")
    result = run(project)
    result.assert_outcomes(failed=1)
    section = failure_section(result, "test_sum")
    assert section[0].startswith("bit snapshot ") and section[0].endswith(": the bits moved"), section
    assert section[1] == "sum: 1 of 64 elements differ bitwise (float32)", section
    assert section[-1] == "accept the new bits with --snapshot-update", section
    assert len(section) < 20 and not any("snapshots.py" in line or "yield" in line for line in section), section


def test_snapshot_update_says_how_many_arms_of_which_gates_it_stored_where(project):
    result = run(project, "--snapshot-update")
    result.stdout.fnmatch_lines(["snapshots: stored 2 arm(s) of 1 gate(s) (gates/test_k.py::test_sum) under "
                                 "gates/__snapshots__"])


NOTHING_TO_STORE = """
import pytest


@pytest.mark.structural
def test_records_nothing():
    assert True


@pytest.mark.gpu
@pytest.mark.anchor
def test_on_the_device():
    assert True
"""


@pytest.mark.parametrize("driver", ["as this machine has it", "present"])
def test_snapshot_update_says_why_it_stored_nothing(project, monkeypatch, driver):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    if driver == "present":  # the run forks its pool's server and probes there; no device answers
        (project.path / "conftest.py").write_text("import harness.core.device\n\nharness.core.device._driver_present = lambda: True\n")
    (project.path / "gates" / "test_k.py").write_text(NOTHING_TO_STORE)
    result = run(project, "--snapshot-update")
    result.assert_outcomes(passed=1, skipped=1)
    line = next(x for x in result.stdout.lines if x.startswith("snapshots: "))
    assert line.startswith("snapshots: none stored: "), line
    assert "1 GPU gate(s) skipped (GPU gate: " in line and "run on a machine with a CUDA device" in line, line
    assert "1 gate(s) recorded no arm output (assert_bits_eq, assert_close and harness.record note them)" in line


def test_snapshot_update_where_a_file_is_in_the_way_is_one_line(project):
    (project.path / "gates" / "__snapshots__").write_text("not a folder\n")
    result = run(project, "--snapshot-update")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    err = [x for x in result.stderr.lines if x.strip()]
    assert len(err) == 1 and err[0].startswith("ERROR: harness: --snapshot-update cannot store the bit snapshots of "
                                               "gates/test_k.py"), err
    assert "is a file" in err[0]


def test_a_snapshot_that_cannot_be_written_fails_its_gate_in_one_line(project):
    run(project, "--snapshot-update").assert_outcomes(passed=1)
    (stored,) = (project.path / "gates" / "__snapshots__").rglob("*.npz")
    stored.unlink()
    stored.mkdir()  # a folder where the file goes: the write itself fails, past every check before it
    result = run(project, "--snapshot-update")
    result.assert_outcomes(failed=1)
    section = failure_section(result, "test_sum")
    assert len(section) == 1 and section[0].startswith(f"bit snapshot {stored}: not stored: "), section
    assert "run without --snapshot-update" in section[0]


@pytest.mark.parametrize("writable", [True, False])
def test_a_snapshot_place_that_is_not_writable_is_named(tmp_path, monkeypatch, writable):
    import tempfile

    from harness.plugin.snapshots import place_problem

    if not writable:  # a read-only place refuses a new folder (root passes permission bits: the test cannot chmod)
        def refuse(*args, **kwargs):
            raise PermissionError(13, "Permission denied")

        monkeypatch.setattr(tempfile, "mkdtemp", refuse)
    problem = place_problem(tmp_path / "gates" / "__snapshots__" / "test_k")
    if writable:
        assert problem is None
        assert list(tmp_path.iterdir()) == []  # the probe left nothing
    else:
        assert problem == f"{tmp_path} takes no new folder (Permission denied): make it writable, or run without " \
                          "--snapshot-update"
