"""The torch-extension fixture (tests/fixtures/torch_ext: Dao-AILab/fast-hadamard-transform,
unedited) with no GPU: its upstream files are byte for byte the ones PROVENANCE.md names, its
.cu compiles through NVRTC with the torch host code set aside and no launcher edit to the
file, its gates that need no GPU (refusals with torch CPU tensors, structural) run green, its
controls apply and compile, and a structural control is proven. The GPU gates against the
tree's torch reference run on the device machine (docs/your-kernels.md, Torch)."""

import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests._machine import child_env

REPO = Path(__file__).resolve().parents[1]
TREE = REPO / "tests" / "fixtures" / "torch_ext"


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    """One cubin cache for the tree's commands (TestTheTreesCommands): the cache key is each
    module's whole source closure, so a hit is the same cubin."""
    return tmp_path_factory.mktemp("torch-ext-cache")


def env(cache: Path) -> dict:
    return child_env({"HARNESS_CACHE_DIR": str(cache), "HARNESS_KERNEL_ROOT": None})


def run(args, cache, timeout=600):
    return subprocess.run([sys.executable, *args], cwd=TREE, env=env(cache), capture_output=True, text=True,
                          timeout=timeout)


def test_the_upstream_files_are_the_ones_provenance_names_byte_for_byte():
    text = (TREE / "PROVENANCE.md").read_text()
    listed = dict((path, digest) for digest, path in re.findall(r"^- `([0-9a-f]{64})` `([^`]+)`$", text, re.M))
    assert len(listed) == 9, f"PROVENANCE.md lists {len(listed)} digests, expected the 9 upstream files"
    for path, digest in listed.items():
        assert hashlib.sha256((TREE / path).read_bytes()).hexdigest() == digest, (
            f"{path} differs from upstream: the fixture is used unedited; restore it from the commit PROVENANCE.md names")
    assert {p.relative_to(TREE).as_posix() for p in (TREE / "kernels").iterdir() if p.suffix in (".cu", ".h")} <= set(
        listed), "a .cu or header in kernels/ is not listed in PROVENANCE.md"


class TestTheTreesCommands:
    """The tree's commands over the module's one cache: a class, so that under xdist they run
    on one worker together (the root conftest's scheduler) and the extension compiles once;
    the control run last finds its perturbed module compiled by the static check."""

    def test_the_extension_compiles_with_nvrtc_and_its_torch_host_code_set_aside(self, cache):
        proc = run(["-m", "harness", "compile", "--kernel-root", "kernels"], cache)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        out = " ".join(proc.stdout.split())
        for text in ("fast_hadamard_transform_cuda.cu: compiled by nvrtc", "#include <c10/cuda/CUDAException.h>",
                     "function fast_hadamard_transform_launch", "function fast_hadamard_transform_cuda",
                     "lines 424-426: 3 instantiations of fast_hadamard_transform_cuda", "1 of 1 modules compiled"):
            assert text in out, f"{text!r} missing from the compile output:\n{proc.stdout}"


    def test_the_trees_own_run_is_green_with_no_gpu(self, cache, torch):
        proc = run(["-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider"], cache)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, out
        for gate in ("kernels/fast_hadamard_transform_cuda.cu::compile",
                     "gates/fht_hadamard.py::test_a_cpu_tensor_is_refused_before_any_launch",
                     "gates/fht_hadamard.py::test_a_non_contiguous_tensor_is_refused_not_copied",
                     "gates/fht_hadamard.py::test_launcher_threads_equal_the_cu_host_dispatch",
                     "gates/fht_hadamard.py::test_launcher_params_match_the_header_struct_field_for_field"):
            assert f"PASSED {gate}" in out, out
        assert "7 passed, 14 skipped" in out, out  # the 14 GPU gates against the torch reference skip here


    def test_every_control_applies_and_compiles(self, tmp_path, cache, torch):  # the controls' gates import torch
        proc = run(["-m", "harness", "controls", "--static", "--report", str(tmp_path / "rep")], cache)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "4 of 4 controls as expected" in proc.stdout


    def test_a_dispatch_the_launcher_does_not_mirror_is_proven_caught_with_no_gpu(self, tmp_path, cache, torch):
        proc = run(["-m", "harness", "controls", "fht_dispatch_threads_moved_in_cu_only", "--no-require-gpu",
                    "--report", str(tmp_path / "rep")], cache)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        report = json.loads((tmp_path / "rep" / "controls.json").read_text())
        (control,) = report["controls"]
        assert control["verdict"] == "proven", control


def test_the_torch_section_of_the_docs_quotes_the_fixture_as_it_is():
    doc = (REPO / "docs" / "your-kernels.md").read_text().split("## Torch: a kernel from a torch-extension tree")[1]
    doc = doc.split("\n## ", 1)[0]  # this section only
    quoted = [line.strip() for block in re.findall(r"```python\n(.*?)```", doc, re.S) for line in block.splitlines()
              if line.strip()]
    fixture = {line.strip() for path in (TREE / "kernels" / "fast_hadamard_transform_cuda.py",
                                         TREE / "gates" / "fht_hadamard.py") for line in path.read_text().splitlines()}
    assert len(quoted) > 20
    stale = [line for line in quoted if line not in fixture]
    assert not stale, f"docs/your-kernels.md quotes lines the fixture does not hold (update the docs): {stale}"
