"""The real-world-style fixture tree (tests/fixtures/byo) compiles with no edit to
its files, its gates that need no GPU run green, its expected-failure gate leaves a controls
baseline green, and its CPU control is proven."""

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

from tests._machine import child_env

REPO = Path(__file__).resolve().parents[1]
TREE = REPO / "tests" / "fixtures" / "byo"
KERNELS = TREE / "kernels"

# block_scan.cu is compiled by nvcc (cub/cub.cuh)
needs_nvcc = pytest.mark.usefixtures("nvcc")


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    """One cubin cache for the tree's commands: the cache key is each module's whole source
    closure, so a hit is the same cubin; the first command compiles the tree (nvcc among
    them, seconds), the others find it."""
    return tmp_path_factory.mktemp("byo-cache")


def env(cache: Path) -> dict:
    return child_env({"HARNESS_CACHE_DIR": str(cache), "HARNESS_KERNEL_ROOT": None})


def digests() -> dict[str, str]:
    return {p.relative_to(TREE).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(TREE.rglob("*")) if p.is_file() and "__pycache__" not in p.parts}


def run(args, cwd, cache, timeout=300):
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env(cache), capture_output=True, text=True,
                          timeout=timeout)


def test_compile_items_report_backend_and_what_was_set_aside(tmp_path):
    from harness.compiling.compile import compile_file

    mod = compile_file("gemm_bench.cu", kernel_root=KERNELS, arch="sm_90", cache_dir=tmp_path / "c")
    assert mod.backend == "nvrtc"
    aside = {s.what for s in mod.set_aside}
    assert {"function main", "function gemm", "function fill", "declaration g_handle", "#include <cublas_v2.h>",
            "#include <vector>"} <= aside
    assert {r.kernel for r in mod.resources} == {"row_sumsq", "scale_rows"}
    main = next(s for s in mod.set_aside if s.what == "function main")
    assert (KERNELS / "gemm_bench.cu").read_text().splitlines()[main.line - 1].startswith("int main(")


class TestTheTreesCommands:
    """The tree's commands, over the module's one cache: a class, so that under xdist they run on
    one worker together (the root conftest's scheduler) and the tree compiles once."""

    @needs_nvcc
    def test_the_compile_command_compiles_every_file_unedited_and_says_what_it_set_aside(self, cache):
        before = digests()
        proc = run(["-m", "harness", "compile", "--kernel-root", str(KERNELS)], REPO, cache)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "4 of 4 modules compiled" in proc.stdout
        out = " ".join(proc.stdout.split())
        for text in ("function main", "#include <cublas_v2.h>", "#include <torch/extension.h>",
                     "function PYBIND11_MODULE", "function topk_softmax", "moe::topk_softmax_kernel<16, 4,",
                     "row_max<256>", "segment_offsets<128, 4>", "nvcc 13", "nvrtc 13"):
            assert text in out, f"{text!r} missing from the compile table:\n{proc.stdout}"
        assert digests() == before, "compiling changed a file of the tree"

    @needs_nvcc
    def test_the_trees_own_run_is_green_with_no_gpu(self, cache):
        proc = run(["-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider"], TREE, cache)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, out
        for item in ("block_scan.cu::compile", "gemm_bench.cu::compile", "moe_topk.cu::compile",
                     "row_reverse.cu::compile"):
            assert f"PASSED kernels/{item}" in out, out
        assert "XFAIL gates/byo_moe_topk.py::test_host_dispatch_covers_every_instantiated_configuration" in out
        assert "7 skipped" in out and "1 xfailed" in out  # the GPU gates, on this machine

    @needs_nvcc
    def test_static_controls_apply_and_compile(self, tmp_path, cache):
        proc = run(["-m", "harness", "controls", "--static", "--report", str(tmp_path / "rep")], TREE, cache)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "4 of 4 controls as expected" in proc.stdout

    def test_a_control_is_proven_and_an_xfail_gate_leaves_the_baseline_green(self, tmp_path, cache):
        """moe_threads_moved_in_cu_only's module holds an xfail(strict=True) gate: the baseline
        (which runs the whole module) must be green, and the control proven by assertion."""
        proc = run(["-m", "harness", "controls", "moe_threads_moved_in_cu_only", "--no-require-gpu",
                    "--report", str(tmp_path / "rep")], TREE, cache, timeout=600)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "proven" in proc.stdout and "1 of 1 controls as expected" in proc.stdout
        import json

        report = json.loads((tmp_path / "rep" / "controls.json").read_text())
        assert report["baseline"]["ok"] and report["baseline"]["red"] == [] and report["baseline"]["gates"] == 5
        log = Path(report["baseline"]["log"]).read_text()
        assert "1 xfailed" in log, log[-2000:]
