"""A header-only template library from the field, unedited (tests/fixtures/flashinfer_norm:
FlashInfer v0.2.3's RMSNorm headers): its files are upstream's byte for byte, it compiles
through NVRTC with its headers' host code set aside, its CPU gates are green with no GPU,
its controls apply and compile, and the two structural controls are proven."""

import hashlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

from harness.compiling.compile import compile_file
from harness.compiling.modsettings import declared_settings
from tests._machine import child_env

REPO = Path(__file__).resolve().parents[1]
TREE = REPO / "tests" / "fixtures" / "flashinfer_norm"
KERNELS = TREE / "kernels"


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("flashinfer-cache")  # one compile of norm.cu for the module


def run(args, tmp_path, cache, timeout=600):
    env = child_env({"HARNESS_CACHE_DIR": str(cache), "HARNESS_KERNEL_ROOT": None})
    return subprocess.run([sys.executable, *args], cwd=TREE, env=env, capture_output=True, text=True, timeout=timeout)


def provenance() -> list[tuple[str, str, str, int]]:
    rows = re.findall(r"^\| `([^`]+)` \| `([^`]+)` \| `([0-9a-f]{40})` \| (\d+) \|$",
                      (TREE / "PROVENANCE.md").read_text(), re.M)
    return [(here, up, blob, int(n)) for here, up, blob, n in rows]


def git_blob(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def test_the_upstream_files_are_byte_for_byte_the_ones_provenance_names():
    rows = provenance()
    assert {here for here, *_ in rows} == {"LICENSE", *(f"kernels/flashinfer/{p.name}"
                                                         for p in (KERNELS / "flashinfer").iterdir())}
    for here, upstream, blob, size in rows:
        data = (TREE / here).read_bytes()
        assert (git_blob(data), len(data)) == (blob, size), f"{here} differs from upstream {upstream} at v0.2.3"
    assert "fdedc4321e98053e75f970d8b183eddda3aadab0" in (TREE / "PROVENANCE.md").read_text()
    assert (TREE / "LICENSE").read_text().lstrip().startswith("Apache License")


class TestTheTreesCommands:
    """The tree's compiles and commands, over the module's one cache: a class, so that under
    xdist they run on one worker together (the root conftest's scheduler): norm.cu compiles
    once, and the controls run last finds its perturbed modules compiled by the static check
    (the cache key is each module's whole source closure, so a hit is the same cubin)."""

    def test_the_library_compiles_through_nvrtc_with_its_headers_host_code_set_aside(self, cache):
        declared = declared_settings(KERNELS / "norm.cu")
        assert declared.defines == (("ushort", "unsigned short"),) and declared.compiler == "auto"
        mod = compile_file("norm.cu", kernel_root=KERNELS, arch="sm_90", cache_dir=cache)
        assert mod.backend == "nvrtc" and len(mod.resources) == 16
        aside = {(s.file, s.what) for s in mod.set_aside}
        for item in [("flashinfer/norm.cuh", "function RMSNorm"), ("flashinfer/norm.cuh", "function FusedAddRMSNorm"),
                     ("flashinfer/norm.cuh", "#include <numeric>"), ("flashinfer/utils.cuh", "#include <iostream>"),
                     ("flashinfer/utils.cuh", "function GetCudaComputeCapability"),
                     ("flashinfer/utils.cuh", "function DebugPrintCUDAArray"),
                     ("flashinfer/utils.cuh", "#include <cuda_device_runtime_api.h>"),
                     ("flashinfer/exception.h", "type Error"), ("flashinfer/exception.h", "#include <sstream>")]:
            assert item in aside, f"{item} not set aside: {sorted(aside)}"
        assert not any(f in ("flashinfer/vec_dtypes.cuh", "flashinfer/math.cuh", "") for f, _ in aside)


    def test_the_trees_own_run_is_green_with_no_gpu(self, tmp_path, cache):
        proc = run(["-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider"], tmp_path, cache)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, out
        assert "PASSED kernels/norm.cu::compile" in out and "set aside in flashinfer/norm.cuh:" in out
        assert "11 passed, 16 skipped" in out  # compile, 5 structural, 5 refusals; the 16 GPU anchors skip here


    def test_the_controls_apply_and_compile(self, tmp_path, cache):
        proc = run(["-m", "harness", "controls", "--static", "--report", str(tmp_path / "rep")], tmp_path, cache)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "4 of 4 controls as expected" in proc.stdout


    def test_an_edit_to_the_headers_host_dispatch_or_kernel_signature_is_caught(self, tmp_path, cache):
        proc = run(["-m", "harness", "controls", "stride_parameters_swapped_in_the_header",
                    "host_dispatch_caps_blocks_at_512", "--no-require-gpu", "--report", str(tmp_path / "rep")],
                   tmp_path, cache)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert proc.stdout.count("proven") == 2 and "2 of 2 controls as expected" in proc.stdout
