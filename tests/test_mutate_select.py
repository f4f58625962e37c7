"""Gate selection from a baseline's records (fakes): direct gates fastest first, then their
test files' other gates; source readers; isolated gates; no coverage; the registry and the
recorder plugin that fill the records."""

import json
from pathlib import Path

from harness.library import coverage
from harness.campaigns.mutate.recorder import read_folder
from harness.campaigns.mutate.select import Coverage


def gate(nodeid, duration, modules=None, sources=None, isolated=False, kind=None):
    rec = {"nodeid": nodeid, "module": nodeid.split("::")[0], "kind": kind, "gpu": True, "outcome": "passed",
           "duration": duration, "isolated": isolated}
    if modules is not None:
        rec["modules_loaded"] = modules
    if sources is not None:
        rec["sources_read"] = sources
    return rec


def write_report(tmp_path: Path, gates: list[dict]) -> Path:
    path = tmp_path / "gates.json"
    path.write_text(json.dumps({"version": 1, "gates": gates}))
    return path


GATES = [
    gate("gates/test_a.py::slow_link", 2.0, ["a.cu"], []),
    gate("gates/test_a.py::fast_anchor", 0.1, ["a.cu"], []),
    gate("gates/test_a.py::refusal", 0.01, [], []),
    gate("gates/test_a.py::trap", 0.001, [], [], isolated=True, kind="trap"),
    gate("gates/test_b.py::b_link", 0.5, ["b.cu"], []),
    gate("gates/test_s.py::structure_a", 0.02, [], ["a.cu"], kind="structural"),
    gate("gates/test_s.py::structure_text", 0.03, [], [], kind="structural"),
]


def test_direct_gates_fastest_first_trap_gates_last_then_their_files_other_gates(tmp_path):
    cov = Coverage.from_report(write_report(tmp_path, GATES))
    sel = cov.select("a.cu", ("a.cu",))
    assert sel.direct == ("gates/test_s.py::structure_a", "gates/test_a.py::fast_anchor",
                          "gates/test_a.py::slow_link", "gates/test_a.py::trap")
    assert sel.siblings == ("gates/test_a.py::refusal", "gates/test_s.py::structure_text")
    assert "gates/test_b.py::b_link" not in sel.all


def test_a_mutant_runs_its_trap_gates_after_every_other_gate_siblings_included(tmp_path):
    cov = Coverage.from_report(write_report(tmp_path, GATES + [
        gate("gates/test_s.py::trap_s", 0.001, [], [], isolated=True, kind="trap")]))
    sel = cov.select("a.cu", ("a.cu",))
    assert cov.batches(sel) == [
        ("gates/test_s.py::structure_a", "gates/test_a.py::fast_anchor", "gates/test_a.py::slow_link"),
        ("gates/test_a.py::refusal", "gates/test_s.py::structure_text"),
        ("gates/test_a.py::trap", "gates/test_s.py::trap_s")]
    assert sorted(g for b in cov.batches(sel) for g in b) == sorted(sel.all), "every gate, once"


def test_an_isolated_gate_inherits_its_files_modules(tmp_path):
    cov = Coverage.from_report(write_report(tmp_path, GATES))
    assert cov.modules_of("gates/test_a.py::trap") == {"a.cu"}
    assert cov.modules_of("gates/test_a.py::refusal") == frozenset()


def test_a_header_selects_the_gates_of_every_module_including_it(tmp_path):
    cov = Coverage.from_report(write_report(tmp_path, GATES))
    sel = cov.select("common.cuh", ("a.cu", "b.cu"))
    assert "gates/test_b.py::b_link" in sel.direct and "gates/test_a.py::slow_link" in sel.direct


def test_an_identical_cubin_runs_only_the_source_readers(tmp_path):
    cov = Coverage.from_report(write_report(tmp_path, GATES))
    sel = cov.select("a.cu", ("a.cu",), cubin_identical=True)
    assert sel.direct == ("gates/test_s.py::structure_a",)
    assert sel.siblings == ("gates/test_s.py::structure_text",)


def test_no_gate_no_coverage(tmp_path):
    cov = Coverage.from_report(write_report(tmp_path, GATES))
    assert cov.select("c.cu", ("c.cu",)).direct == ()


def test_source_read_is_unknown_until_every_gate_was_recorded(tmp_path):
    cov = Coverage.from_report(write_report(tmp_path, GATES))
    assert cov.recorded and cov.source_read() == {"a.cu"}
    old = [{k: v for k, v in g.items() if k not in ("modules_loaded", "sources_read")} for g in GATES]
    cov = Coverage.from_report(write_report(tmp_path, old))
    assert not cov.recorded and cov.source_read() is None


def test_the_recorders_files_fill_what_gates_json_lacks(tmp_path):
    old = [{k: v for k, v in g.items() if k not in ("modules_loaded", "sources_read")} for g in GATES]
    folder = tmp_path / "coverage"
    folder.mkdir()
    half = {g["nodeid"]: {"modules_loaded": g["modules_loaded"], "sources_read": []} for g in GATES}
    (folder / "coverage-1.json").write_text(json.dumps(half))
    (folder / "coverage-2.json").write_text(json.dumps({"gates/test_s.py::structure_a": {"sources_read": ["a.cu"]}}))
    merged = read_folder(folder)
    assert merged["gates/test_s.py::structure_a"] == {"modules_loaded": set(), "sources_read": {"a.cu"}}
    cov = Coverage.from_report(write_report(tmp_path, old), folder)
    assert cov.recorded and cov.source_read() == {"a.cu"}
    assert cov.select("a.cu", ("a.cu",)).direct[0] == "gates/test_s.py::structure_a"


def test_repeated_lines_of_one_gate_merge(tmp_path):
    gates = [gate("g.py::t", 0.5, ["a.cu"], []), gate("g.py::t", 0.7, [], ["h.cuh"])]
    cov = Coverage.from_report(write_report(tmp_path, gates))
    g = cov.gates["g.py::t"]
    assert g.duration == 0.7 and g.modules == {"a.cu"} and g.sources == {"h.cuh"}


def test_the_registry_records_per_gate_relative_to_the_kernel_root(tmp_path, monkeypatch, settings_in_effect):
    from harness.core import settings as _settings
    from harness.library.source import define_int

    root = tmp_path / "kernels"
    root.mkdir()
    (root / "x.cu").write_text("#define X 3\n")
    settings_in_effect(_settings.Settings(root.resolve(), None, tmp_path))
    coverage.reset()
    try:
        coverage.begin("g.py::one")
        coverage.note_module("x.cu")
        assert define_int(root / "x.cu", "X") == 3  # harness.library.source notes the read
        coverage.begin("g.py::two")
        coverage.note_source(tmp_path / "elsewhere.cu")
        records = coverage.recorded()
        assert records["g.py::one"].modules == {"x.cu"} and records["g.py::one"].sources == {"x.cu"}
        assert records["g.py::two"].sources == {(tmp_path / "elsewhere.cu").as_posix()}
        assert coverage.current().nodeid == "g.py::two"
    finally:
        coverage.reset()


def test_kernels_module_notes_the_module_it_loads(tmp_path, monkeypatch, settings_in_effect):
    from harness.core import settings as _settings
    from harness.library import kernels

    root = tmp_path / "kernels"
    root.mkdir()
    (root / "m.cu").write_text('extern "C" __global__ void k(int* p) { p[0] = 1; }\n')
    settings_in_effect(_settings.Settings(root.resolve(), "sm_90", tmp_path / "cache"))
    monkeypatch.setattr(kernels, "load", lambda compiled: compiled)  # no GPU here: compile, note, skip the load
    coverage.reset()
    try:
        coverage.begin("g.py::loads")
        kernels.module("m.cu")
        assert coverage.recorded()["g.py::loads"].modules == {"m.cu"}
    finally:
        coverage.reset()


def test_auto_deadline_grows_with_the_selected_gates_baseline_time_and_is_capped(tmp_path):
    from harness.campaigns.mutate.campaign import AUTO_CAP, AUTO_FACTOR, AUTO_FLOOR, MutateConfig, mutant_deadline

    cov = Coverage.from_report(write_report(tmp_path, GATES))
    sel = cov.select("a.cu", ("a.cu",))
    took = 2.0 + 0.1 + 0.01 + 0.001 + 0.02 + 0.03  # every direct and sibling gate of a.cu
    assert abs(cov.seconds(sel.all) - took) < 1e-9
    auto = MutateConfig(rootdir=tmp_path, kernel_root=tmp_path, report_dir=tmp_path)
    assert abs(mutant_deadline(auto, cov, sel) - (AUTO_FLOOR + AUTO_FACTOR * took)) < 1e-9
    slow = Coverage.from_report(write_report(tmp_path, [gate("g.py::slow", 1000.0, ["a.cu"], [])]))
    assert mutant_deadline(auto, slow, slow.select("a.cu", ("a.cu",))) == AUTO_CAP
    fixed = MutateConfig(rootdir=tmp_path, kernel_root=tmp_path, report_dir=tmp_path, deadline=7.0)
    assert mutant_deadline(fixed, slow, slow.select("a.cu", ("a.cu",))) == 7.0
    from harness.campaigns.mutate.campaign import GATE_FLOOR, SET_FACTOR, SET_FLOOR, gate_deadlines

    assert abs(mutant_deadline(auto, cov, sel, per_gate=True) - (SET_FLOOR + SET_FACTOR * took)) < 1e-9

    each = gate_deadlines(auto, cov)
    assert each["gates/test_a.py::slow_link"] == GATE_FLOOR + AUTO_FACTOR * 2.0
    assert gate_deadlines(auto, slow)["g.py::slow"] == AUTO_CAP and gate_deadlines(fixed, cov) is None


def test_mutants_to_screen_and_run_interleave_their_files():
    from types import SimpleNamespace as NS

    from harness.campaigns.mutate.campaign import interleave_mutants

    ms = [NS(file=f, id=f"{f}{i}") for f, n in (("a.cu", 3), ("b.cu", 1), ("c.cu", 2)) for i in range(n)]
    assert [m.id for m in interleave_mutants(ms)] == ["a.cu0", "b.cu0", "c.cu0", "a.cu1", "c.cu1", "a.cu2"]


def test_source_readers_run_before_any_gate_that_launches_even_when_slower(tmp_path):
    # A butterfly loop mutated to `m >= 0` hangs the first GPU gate; the structural gate that
    # reads the file names it by assertion, so it must not wait behind a faster GPU gate.
    gates = [gate("gates/test_a.py::quick_gpu", 0.001, ["a.cu"], []),
             gate("gates/test_s.py::slow_reader", 0.5, [], ["a.cu"], kind="structural"),
             gate("gates/test_a.py::trap", 0.0001, [], [], isolated=True, kind="trap")]
    sel = Coverage.from_report(write_report(tmp_path, gates)).select("a.cu", ("a.cu",))
    assert sel.direct == ("gates/test_s.py::slow_reader", "gates/test_a.py::quick_gpu", "gates/test_a.py::trap")
