"""harness.library.invariance: batch invariance and determinism, with host `run` functions that go
wrong at a chosen row, batch size, position, variant or repeat; the failure text is checked
line by line."""

import sys

import numpy as np
import pytest

from harness.library import coverage
from harness.library.invariance import (NotBatchInvariant, NotDeterministic, assert_batch_invariant, assert_deterministic,
                                        batch_of)
from tests._machine import use_child_env

DATA = np.arange(40, dtype=np.float32).reshape(8, 5) / np.float32(3)  # 8 row ids, 5 elements each


def rowwise(ids, variant):
    return DATA[ids] * np.float32(2)


@pytest.fixture(autouse=True)
def fresh_coverage():
    coverage.begin("g::t")
    yield
    coverage.reset()


def test_a_rowwise_kernel_is_invariant_and_the_report_says_what_was_tried():
    seen = []

    def run(ids, variant):
        seen.append((tuple(ids), variant))
        return rowwise(ids, variant)

    assert_batch_invariant("y", run, [1, 6], batch_sizes=[1, 3, 8], variants={"splits=1": 1, "splits=4": 4},
                           fillers=[0, 7])
    assert ((1,), 1) in seen and ((6,), 1) in seen and ((1,), 4) in seen
    assert ((1, 6, 0), 1) in seen and ((6, 0, 1), 4) in seen  # row 1 last of three: fillers after the rows
    (tried,) = coverage.current().tried
    assert tried.startswith("batch invariance of y: rows [1, 6] alone, then in batches of [1, 3, 8] at positions "
                            "[0, 'middle', -1], variants ['splits=1', 'splits=4']:")
    assert tried.endswith("28 batches, 76 rows compared")


def test_a_row_that_depends_on_the_batch_size_is_named_with_its_place_and_variant():
    def run(ids, variant):
        out = rowwise(ids, variant)
        if len(ids) >= 5 and variant == 4:  # past a threshold, another split: another rounding
            out[len(ids) // 2, 3] = np.nextafter(out[len(ids) // 2, 3], np.float32(np.inf))
        return out

    with pytest.raises(NotBatchInvariant) as info:
        assert_batch_invariant("y", run, [2, 3], batch_sizes=[1, 4, 5], variants={"splits=1": 1, "splits=4": 4})
    lines = str(info.value).splitlines()
    assert lines[0] == ("batch invariance of y: row 3 at position 2 of a batch of 5 (variant splits=4; the batch is "
                        "rows 2, 3, 3, 3, 3) differs from row 3 alone (variant splits=1)")
    assert lines[1].endswith("1 of 5 elements differ bitwise (float32)")
    assert lines[2] == "first difference at flat index 3, index [3]:"
    assert lines[3].startswith("  got      0x")


def test_the_exact_failure_line_for_one_row_in_a_fixed_place():
    def run(ids, variant):
        out = rowwise(ids, variant)
        if len(ids) == 3:
            out[1, 0] = -out[1, 0]
        return out

    with pytest.raises(NotBatchInvariant) as info:
        assert_batch_invariant("y", run, [5], batch_sizes=[3], positions=[1], fillers=[0])
    assert str(info.value).splitlines()[:3] == [
        "batch invariance of y: row 5 at position 1 of a batch of 3 (variant default; the batch is rows 0, 5, 0) "
        "differs from row 5 alone (variant default)",
        "y row 5: 1 of 5 elements differ bitwise (float32)",
        "first difference at flat index 0, index [0]:",
    ]


def test_a_variant_that_changes_the_row_alone_is_caught():
    def run(ids, variant):
        return rowwise(ids, variant) + np.float32(variant)

    with pytest.raises(NotBatchInvariant, match=r"row 0 at position 0 of a batch of 1 \(variant b;"):
        assert_batch_invariant("y", run, [0], batch_sizes=[1], variants={"a": 0, "b": 1})


def test_batches_are_filled_with_the_other_rows_then_the_fillers():
    assert batch_of(7, 2, 5, [1, 9]) == [1, 9, 7, 1, 9]
    assert batch_of(7, 0, 1, [1]) == [7]


def test_bad_arguments_are_one_line():
    with pytest.raises(ValueError, match="at least one row and one batch size"):
        assert_batch_invariant("y", rowwise, [], batch_sizes=[2])
    with pytest.raises(ValueError, match="batch sizes must be at least 1"):
        assert_batch_invariant("y", rowwise, [1], batch_sizes=[0, 2])
    with pytest.raises(ValueError, match=r"returned 1 rows; it must return one output a row id"):
        assert_batch_invariant("y", lambda ids, v: DATA[:1], [1], batch_sizes=[2])
    with pytest.raises(ValueError, match="determinism needs at least 2 repeats"):
        assert_deterministic("y", lambda i, v: DATA, repeats=1)


def test_a_deterministic_launch_passes_and_a_repeat_that_differs_is_named(monkeypatch):
    # a host run, whatever this machine has: with no CuPy to import, every repeat stays on the
    # current stream (where a device is, repeats also take two other streams)
    monkeypatch.setitem(sys.modules, "cupy", None)
    assert_deterministic("y", lambda i, v: DATA.copy(), repeats=5, variants={"chunk=64": 64})
    (tried,) = coverage.current().tried
    assert tried == "determinism of y: 5 repeats under variants ['chunk=64'] on the current stream"

    def racy(i, variant):
        out = DATA.copy()
        if i == 3:
            out[2, 1] = np.float32(0)
        return out

    with pytest.raises(NotDeterministic) as info:
        assert_deterministic("y", racy, repeats=5)
    assert str(info.value).splitlines()[:3] == [
        "determinism of y: repeat 3 of 5 (variant default, the current stream) differs from repeat 0",
        "y repeat 3: 1 of 40 elements differ bitwise (float32)",
        "first difference at flat index 11, index [2, 1]:",
    ]


HOST_GATES = """
import numpy as np
import pytest

from harness.library.invariance import assert_batch_invariant, assert_deterministic

DATA = np.arange(12, dtype=np.float32).reshape(6, 2)


@pytest.mark.invariance
def test_rows():
    assert_batch_invariant("y", lambda ids, v: DATA[ids] * np.float32(3), [0, 5], batch_sizes=[1, 4])


@pytest.mark.determinism
def test_repeats():
    assert_deterministic("y", lambda i, v: DATA * np.float32(2), repeats=3)
"""


def test_what_a_check_tried_is_in_the_gate_report_and_the_kinds_are_counted(pytester, monkeypatch):
    import xml.etree.ElementTree as ET

    use_child_env(monkeypatch)
    pytester.makeini("[pytest]\nharness_gates = gates\n")
    (pytester.mkdir("gates") / "test_host.py").write_text(HOST_GATES)
    result = pytester.runpytest_subprocess("-p", "harness.plugin", "gates", "--junitxml=junit.xml",
                                           "--harness-report=report")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["*invariance*1*", "*determinism*1*"])  # the kinds table's rows
    tried = [p.get("value") for p in ET.parse(pytester.path / "junit.xml").iter("property") if p.get("name") == "tried"]
    assert tried == [
        "batch invariance of y: rows [0, 5] alone, then in batches of [1, 4] at positions [0, 'middle', -1], "
        "variants ['default']: 8 batches, 26 rows compared",
        "determinism of y: 3 repeats under variants ['default'] on the current stream"]
