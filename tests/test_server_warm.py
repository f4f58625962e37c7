"""The campaign's server runs the structural gates once before it forks a worker
(`harness.server._warm_structural`): what they keep in host caches every worker inherits,
so a mutant that leaves a gate's input as it was costs that gate nothing (no GPU needed)."""

import pytest

from tests.test_mutate_warm import _mutant, make_suite

GATES = """
import os
import pytest
from harness import host_cache
from harness.library.source import read_source

LOG = os.environ["WARM_LOG"]

@host_cache
def analysis(code):
    open(LOG, "a").write(f"{os.getpid()}\\n")  # one line each time it is computed
    return code.count("+")

@pytest.mark.structural
def test_one_addition(kernel_root):
    code = read_source(kernel_root / "k.cu").split("//")[0]  # what it reads: the code, not the comment
    assert analysis(code) == 1, "not one addition"
"""
KERNEL = "__global__ void k(float* y, const float* x) { *y = *x + 1; }  // a comment\n"


@pytest.fixture
def suite(tmp_path, monkeypatch):
    monkeypatch.setenv("WARM_LOG", str(tmp_path / "computed"))
    root, ex = make_suite(tmp_path, monkeypatch, GATES, KERNEL, spares=1)
    yield root, ex, tmp_path / "computed"
    ex.close()


def test_the_servers_warm_up_serves_every_worker_and_a_changed_input_is_computed_anew(suite):
    root, ex, log = suite
    gate = "gates/test_k.py::test_one_addition"
    same = ex.run(_mutant(root, "comment", KERNEL.replace("a comment", "another comment")), [gate], 60)
    assert [o.outcome for o in same.outcomes] == ["passed"], same
    # computed once, in the server, before any fork: the worker found it
    assert len(log.read_text().split()) == 1
    changed = ex.run(_mutant(root, "minus", KERNEL.replace("+ 1", "- 1")), [gate], 60)
    assert (changed.outcomes[0].outcome, changed.outcomes[0].first_failure_line) == ("failed", "not one addition")
    assert len(log.read_text().split()) == 2 and len(set(log.read_text().split())) == 2  # the worker's own


def test_without_the_warm_up_the_server_computes_nothing_and_the_worker_its_own(suite):
    # a comparison over several lanes: each side's structural gates run once, in their lanes
    root, ex, log = suite
    ex.warm_structural = False
    gate = "gates/test_k.py::test_one_addition"
    ran = ex.run(_mutant(root, "comment", KERNEL.replace("a comment", "another comment")), [gate], 60)
    assert [o.outcome for o in ran.outcomes] == ["passed"], ran
    assert len(log.read_text().split()) == 1  # computed once, in the worker that ran the gate
    assert ex._pool is not None and log.read_text().split()[0] != str(ex._pool.server.pid)
