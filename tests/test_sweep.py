"""harness.library.sweep with no GPU: a "kernel" in NumPy with a bug planted at a production
shape (a K that is a multiple of its sweep width, a row count past a threshold), its oracle, and
the sweep that must find the bug, shrink it to the smallest failing shape, and name the command
that replays it; then the sweep as a gate of kind `sweep` in a pytest run, its replay and its
budget reaching the run's children through the settings."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from harness.core.errors import CheckFailed, UsageError
from harness.library.sweep import Dim, Preset, ShapeFailed, ShapeFaulted, ShapeSpace, sweep, written
from tests._machine import child_env

TILE = 1024  # the "kernel's" sweep width


def gemv_kernel(w: np.ndarray, x: np.ndarray) -> np.ndarray:
    """A GEMV that sweeps K in tiles of TILE; its bug: with no tail (K a multiple of the
    tile), its last full tile is dropped, the defect a guard written for the tail makes."""
    n, k = w.shape
    tiles = k // TILE if k % TILE else k // TILE - 1
    full = tiles * TILE
    y = w[:, :full] @ x[:full]
    if k % TILE:
        y = y + w[:, full:] @ x[full:]
    return y


def gemv_check(shape):
    rng = np.random.default_rng(shape["N"] * 7919 + shape["K"])
    w = rng.integers(-3, 4, size=(shape["N"], shape["K"])).astype(np.float64)
    x = rng.integers(-3, 4, size=shape["K"]).astype(np.float64)
    got, want = gemv_kernel(w, x), w @ x  # integers: exact in float64
    assert np.array_equal(got, want), f"gemv y: {int(np.sum(got != want))} of {shape['N']} rows differ"


GEMV = ShapeSpace("toy_gemv", (Dim("N", 1, 64), Dim("K", 16, 8192, multiple_of=16, tile=TILE)),
                  presets=(Preset("a small layer", {"N": 8, "K": 512}, "made up for the test"),))


def test_a_bug_at_a_multiple_of_the_sweep_width_is_found_and_shrunk_to_the_smallest_shape():
    with pytest.raises(ShapeFailed) as err:
        sweep(GEMV, gemv_check, budget=0, nodeid="gates/test_g.py::test_sweep")
    failed = err.value
    assert failed.smallest == {"N": 1, "K": 1024} and isinstance(failed, CheckFailed)
    assert str(failed).splitlines() == [
        f"toy_gemv: the smallest failing shape is N=1, K=1024 ({failed.tried} shapes tried): gemv y: 1 of 1 rows differ",
        "replay: python -m pytest 'gates/test_g.py::test_sweep' --sweep-replay 'N=1,K=1024'"]


def test_a_failure_found_at_a_larger_shape_says_where_it_was_found():
    space = ShapeSpace("toy_gemv", GEMV.dims, presets=(Preset("a wide layer", {"N": 48, "K": 4096}, "made up"),))
    with pytest.raises(ShapeFailed) as err:
        sweep(space, gemv_check, budget=0, nodeid="g.py::t")
    assert err.value.found_at == {"N": 48, "K": 4096} and err.value.smallest == {"N": 1, "K": 1024}
    assert str(err.value).startswith("toy_gemv: the smallest failing shape is N=1, K=1024 (found at N=48, K=4096; "
                                     "25 shapes tried): gemv y: 1 of 1 rows differ")  # docs/shapes.md quotes it


def test_boundaries_come_first_and_include_the_full_sweep_and_its_tails_of_one():
    k = GEMV.dims[1].boundaries()
    assert {16, 1008, 1024, 1040, 2048, 8192} <= set(k) and k == sorted(k)
    assert all(v % 16 == 0 for v in k)
    cases = GEMV.boundary_cases()
    assert cases[0] == {"N": 1, "K": 16} and {"N": 1, "K": 1024} in cases and {"N": 64, "K": 16} in cases


def test_a_bug_off_every_boundary_is_found_by_the_drawn_shapes_and_shrunk_by_hypothesis(tmp_path, settings_in_effect):
    from dataclasses import replace

    from harness.core import settings as _settings

    settings_in_effect(replace(_settings.in_effect(), cache_dir=tmp_path / "cache"))
    space = ShapeSpace("rows", (Dim("N", 1, 1000),))

    def check(shape):
        assert not (shape["N"] >= 100 and shape["N"] % 10 == 7), f"row {shape['N']} wrong"

    with pytest.raises(ShapeFailed) as err:
        sweep(space, check, budget=300, nodeid="g.py::t")
    assert err.value.smallest == {"N": 107}
    assert (tmp_path / "cache" / "sweeps").is_dir(), "the failing case is kept for the next run"


def test_a_clean_kernel_passes_every_case_and_says_how_many_it_tried():
    def fixed(shape):
        rng = np.random.default_rng(1)
        w = rng.integers(-3, 4, size=(shape["N"], shape["K"])).astype(np.float64)
        x = rng.integers(-3, 4, size=shape["K"]).astype(np.float64)
        assert np.array_equal(w @ x, w @ x)

    tried = sweep(GEMV, fixed, budget=0)
    assert tried == 1 + len(GEMV.boundary_cases())


def test_replay_checks_the_one_shape_and_fails_the_same_way():
    with pytest.raises(ShapeFailed) as err:
        sweep(GEMV, gemv_check, replay="N=1,K=1024", nodeid="g.py::t")
    assert err.value.tried == 1 and err.value.smallest == {"N": 1, "K": 1024}
    assert sweep(GEMV, gemv_check, replay="N=3,K=1040") == 1


@pytest.mark.parametrize("text, says", [
    ("N=1", "is not a shape of toy_gemv: its dimensions are ['N'], the space's ['N', 'K']"),
    ("N=1,K=1000", "K=1000 is outside 16..8192 (a multiple of 16)"),
    ("N=1;K=16", "'N=1;K=16' is not NAME=INTEGER; write e.g. N=1,K=16"),
])
def test_a_replay_shape_that_is_not_in_the_space_is_one_line(text, says):
    with pytest.raises(UsageError, match=None) as err:
        sweep(GEMV, gemv_check, replay=text)
    assert says in str(err.value) and "\n" not in str(err.value)


def test_a_device_fault_stops_the_sweep_at_its_shape_unshrunk():
    class CUDARuntimeError(RuntimeError):
        pass

    def faulting(shape):
        if shape["K"] >= 1024:
            raise CUDARuntimeError("cudaErrorIllegalAddress: an illegal memory access was encountered")

    with pytest.raises(ShapeFaulted) as err:
        sweep(GEMV, faulting, budget=0, nodeid="g.py::t")
    assert err.value.shape["K"] >= 1024 and "it is not shrunk" in str(err.value)


@pytest.mark.parametrize("declare, says", [
    (lambda: Dim("N", 0, 8), "give no value"),
    (lambda: Dim("K", 16, 100, multiple_of=16), "must be multiples of 16"),
    (lambda: Dim("K", 16, 64, multiple_of=16, tile=24), "tile 24 must be a positive multiple of 16"),
    (lambda: Dim("not a name", 1, 2), "name it as a Python identifier"),
    (lambda: ShapeSpace("s", (Dim("N", 1, 4), Dim("N", 1, 4))), "a dimension is named twice"),
    (lambda: ShapeSpace("s", (Dim("N", 1, 4),), presets=(Preset("big", {"N": 5}, "src"),)),
     "preset 'big' (src) is not in the space: N=5 is outside 1..4"),
])
def test_a_space_declared_wrong_is_one_line_at_its_declaration(declare, says):
    with pytest.raises(UsageError) as err:
        declare()
    assert says in str(err.value)


GATE = '''
import numpy as np
import pytest

from harness.library.sweep import Dim, ShapeSpace, sweep

SPACE = ShapeSpace("toy_gemv", (Dim("N", 1, 8), Dim("K", 16, 4096, multiple_of=16, tile=1024)))


def check(shape):
    # the bug: no tail, so the last full tile is dropped
    k = shape["K"]
    kept = k if k % 1024 else k - 1024
    assert kept == k, f"y: the last {k - kept} of {k} columns were dropped"


@pytest.mark.sweep
def test_toy_gemv_over_its_shape_space():
    sweep(SPACE, check)
'''


@pytest.fixture
def project(tmp_path):
    (tmp_path / "gates").mkdir()
    (tmp_path / "gates" / "test_sweeps.py").write_text(GATE)
    (tmp_path / "pytest.ini").write_text("[pytest]\nharness_gates = gates\n")
    return tmp_path


def run_pytest(project: Path, *args):
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "harness.plugin", "-p", "no:cacheprovider", "-q",
                           *args], cwd=project, capture_output=True, text=True, timeout=300,
                          env=child_env({"HARNESS_CACHE_DIR": str(project / "cache"), "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}))


def test_a_sweep_gate_names_its_smallest_failing_shape_and_the_replay_reproduces_it(project):
    result = run_pytest(project, "--sweep-budget", "0")
    assert result.returncode == 1, result.stdout + result.stderr
    out = result.stdout
    assert "toy_gemv: the smallest failing shape is N=1, K=1024" in out, out
    replay = next(line for line in out.splitlines() if "replay: python -m pytest" in line)
    assert replay.split("replay: ", 1)[1] == ("python -m pytest 'gates/test_sweeps.py::test_toy_gemv_over_its_shape_"
                                               "space' --sweep-replay 'N=1,K=1024'")
    again = run_pytest(project, "gates/test_sweeps.py::test_toy_gemv_over_its_shape_space", "--sweep-replay", "N=1,K=1024")
    assert again.returncode == 1 and "the smallest failing shape is N=1, K=1024 (1 shapes tried)" in again.stdout
    clean = run_pytest(project, "--sweep-replay", "N=1,K=1040")
    assert clean.returncode == 0, clean.stdout


def test_a_bad_sweep_budget_is_one_line(project):
    result = run_pytest(project, "--sweep-budget", "many")
    assert result.returncode == 4 and "--sweep-budget 'many': give a whole number of shapes from 0" in result.stderr


def test_a_shape_drawn_again_is_checked_once(tmp_path, settings_in_effect):
    # Hypothesis may draw a shape it drew (or a boundary) before; the check runs once a shape.
    from dataclasses import replace

    from harness.core import settings as _settings

    seen = []

    def check(shape):
        seen.append(tuple(shape.values()))

    settings_in_effect(replace(_settings.in_effect(), cache_dir=tmp_path / "cache"))
    space = ShapeSpace("tiny", (Dim("N", 1, 3),))
    sweep(space, check, budget=40, nodeid="g.py::t")
    assert sorted(seen) == sorted(set(seen)) and len(seen) <= 3, seen
