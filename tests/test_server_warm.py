"""The campaign's server runs the structural gates once before it forks a worker
(`harness.workers._warm_structural`): what they keep in host caches every worker inherits,
so a mutant that leaves a gate's input as it was costs that gate nothing (no GPU needed)."""

import textwrap
from pathlib import Path

import pytest

from harness.mutate.warm import WarmExecutor
from tests.test_mutate_warm import CONFTEST

GATES = """
import os
import pytest
from harness import host_cache
from harness.source import read_source

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
    root = tmp_path / "suite"
    (root / "kernels").mkdir(parents=True)
    (root / "gates").mkdir()
    (root / "pytest.ini").write_text("[pytest]\nkernel_root = kernels\n")
    (root / "conftest.py").write_text(CONFTEST)
    (root / "gates" / "test_s.py").write_text(textwrap.dedent(GATES))
    (root / "kernels" / "k.cu").write_text(KERNEL)
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).resolve().parents[1]))
    monkeypatch.setenv("WARM_LOG", str(tmp_path / "computed"))
    ex = WarmExecutor(root, ("gates",), root / "kernels", tmp_path / "cache", spares=1)
    yield root, ex, tmp_path / "computed"
    ex.close()


def _mutant(root: Path, name: str, text: str) -> Path:
    box = root.parent / name / "kernels"
    box.mkdir(parents=True)
    (box / "k.cu").write_text(text)
    return box


def test_the_servers_warm_up_serves_every_worker_and_a_changed_input_is_computed_anew(suite):
    root, ex, log = suite
    gate = "gates/test_s.py::test_one_addition"
    same = ex.run(_mutant(root, "comment", KERNEL.replace("a comment", "another comment")), [gate], 60)
    assert [o.outcome for o in same.outcomes] == ["passed"], same
    # computed once, in the server, before any fork: the worker found it
    assert len(log.read_text().split()) == 1
    changed = ex.run(_mutant(root, "minus", KERNEL.replace("+ 1", "- 1")), [gate], 60)
    assert (changed.outcomes[0].outcome, changed.outcomes[0].first_failure_line) == ("failed", "not one addition")
    assert len(log.read_text().split()) == 2 and len(set(log.read_text().split())) == 2  # the worker's own
