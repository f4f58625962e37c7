"""A torch function as a gate's oracle: `harness.library.reference.torch_reference` notes it on the
gate, and gates.json and summary.md say which gates took a reference and how each compared
(bitwise for a link, the stated tolerance for an anchor)."""

import json
import textwrap

import pytest

from harness.library import coverage
from harness.core.records import GateRecord
from harness.library.reference import torch_reference
from harness.plugin.report import RunFacts, summary_markdown
from tests._machine import use_child_env

LOAD_PLUGIN = 'import sys\npytest_plugins = [] if "harness.plugin" in sys.modules else ["harness.plugin"]\n'


def ref_double(x):
    return x * 2


def test_each_call_notes_the_reference_on_the_running_gate_once():
    coverage.begin("g::a")
    ref = torch_reference(ref_double)
    assert ref(3) == 6 and ref(4) == 8
    assert coverage.current().oracles == [f"torch {__name__}.ref_double"]
    assert ref.__name__ == "ref_double" and ref.oracle == f"torch {__name__}.ref_double"
    coverage.begin("g::b")
    assert coverage.current().oracles == []
    coverage.reset()


def test_the_summary_lists_each_gate_with_an_oracle_its_kind_and_its_comparisons():
    records = [GateRecord("g.py::test_link", kind="link", oracle="torch m.ref", compared=["out: bitwise"]),
               GateRecord("g.py::test_anchor", kind="anchor", oracle="torch m.ref",
                          compared=["out: atol=1e-05, rtol=0"]),
               GateRecord("g.py::test_other", kind="structural")]
    md = summary_markdown(records, RunFacts(device=None, arch="sm_90", kernel_root="k", compile_options=[],
                                            require_gpu=False))
    section = md.split("## Oracles")[1].split("## All gates")[0]
    assert "| `g.py::test_link` | link | torch m.ref | out: bitwise | passed |" in section
    assert "| `g.py::test_anchor` | anchor | torch m.ref | out: atol=1e-05, rtol=0 | passed |" in section
    assert "test_other" not in section


@pytest.fixture
def suite(pytester, monkeypatch):
    use_child_env(monkeypatch)
    pytester.makeini("[pytest]\nkernel_root = .\n")
    pytester.makeconftest(LOAD_PLUGIN)
    return pytester


def test_a_gate_run_records_the_torch_oracle_and_how_each_gate_compared(suite, torch):
    suite.makepyfile(test_g=textwrap.dedent("""
        import numpy as np
        import pytest
        import torch
        from harness import assert_bits_eq, assert_close, torch_reference

        relu = torch_reference(torch.nn.functional.relu)
        softplus = torch_reference(torch.nn.functional.softplus, "nn.functional.softplus")
        X = np.array([-2.0, 0.0, 0.5, 3.0], np.float32)  # no -0: numpy and torch differ on max(-0, 0)

        @pytest.mark.link
        def test_relu_is_bit_exact_by_construction():
            # max(x, 0) rounds nothing: any correct arm equals the reference bit for bit
            assert_bits_eq("relu", np.maximum(X, np.float32(0)), relu(torch.from_numpy(X)))

        @pytest.mark.anchor
        def test_softplus_within_its_tolerance():
            # log1p(exp(x)) in float32: a few ulp apart between libraries
            assert_close("softplus", np.log1p(np.exp(X)), softplus(torch.from_numpy(X)), atol=1e-6, rtol=1e-6)

        @pytest.mark.structural
        def test_no_oracle():
            assert_bits_eq("x", X, X)
        """))
    result = suite.runpytest_subprocess("--harness-report", "rep", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=3)
    gates = {g["nodeid"].split("::")[1]: g for g in json.loads((suite.path / "rep" / "gates.json").read_text())["gates"]}
    link, anchor, other = (gates[n] for n in ("test_relu_is_bit_exact_by_construction",
                                              "test_softplus_within_its_tolerance", "test_no_oracle"))
    assert (link["kind"], link["oracle"], link["compared"]) == (
        "link", "torch torch.nn.functional.relu", ["relu: bitwise"])
    assert (anchor["kind"], anchor["oracle"], anchor["compared"]) == (
        "anchor", "torch nn.functional.softplus", ["softplus: atol=1e-06, rtol=1e-06"])
    assert other["oracle"] is None and other["compared"] == []
    md = (suite.path / "rep" / "summary.md").read_text()
    assert "| link | torch torch.nn.functional.relu | relu: bitwise | passed |" in md
