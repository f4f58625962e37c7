"""Bad input to the pytest plugin's options and ini keys: one line saying what was wrong and
what to do, before any work, never a traceback; and a setting that runs but means less than it
seems says so in one line. No GPU needed (children run with CUDA_VISIBLE_DEVICES="")."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

import harness

HARNESS_ROOT = Path(harness.__file__).resolve().parents[1]
GATE = "import pytest\n\n\n@pytest.mark.structural\ndef test_gate():\n    pass\n"
KERNEL = 'extern "C" __global__ void k(float* out) { out[threadIdx.x] = 1.0f; }\n'


@pytest.fixture
def project(tmp_path):
    """A project opted in by its ini: a kernel root with one .cu, a gate, an ordinary test."""
    root = tmp_path / "project"
    (root / "kernels").mkdir(parents=True)
    (root / "kernels" / "k.cu").write_text(KERNEL)
    (root / "gates").mkdir()
    (root / "gates" / "test_g.py").write_text(GATE)
    (root / "pytest.ini").write_text("[pytest]\nkernel_root = kernels\nharness_gates = gates\n")
    return root


def run_pytest(*args, cwd):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "HARNESS_CACHE_DIR": str(Path(cwd).parent / "cache"),
           "PYTHONPATH": os.pathsep.join(p for p in (str(HARNESS_ROOT), os.environ.get("PYTHONPATH")) if p)}
    for var in ("HARNESS_REQUIRE_GPU", "HARNESS_KERNEL_ROOT", "HARNESS_ARCH"):
        env.pop(var, None)
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "harness.plugin", "-p", "no:cacheprovider", *args],
                          cwd=cwd, capture_output=True, text=True, env=env, timeout=300)


def usage_line(result) -> str:
    """The run was refused before any work, in exactly one line and no traceback; that line."""
    out = result.stdout + result.stderr
    assert result.returncode == pytest.ExitCode.USAGE_ERROR, out
    assert "Traceback" not in out and "collected" not in result.stdout, out
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, out
    return lines[0]


def test_an_ini_kernel_root_that_holds_no_cu_says_so_in_one_line_and_the_run_goes_on(project):
    # named in the ini, an empty kernel root is allowed (a project before its first kernel), but said
    (project / "kernels" / "k.cu").unlink()
    result = run_pytest(cwd=project)
    assert result.returncode == 0, result.stdout + result.stderr
    said = [line for line in result.stdout.splitlines() if "holds no .cu file" in line]
    assert said == [f"harness: kernel root {project / 'kernels'} holds no .cu file: set the ini key kernel_root "
                    "(relative to the rootdir) to the folder that holds your .cu files, or pass --kernel-root DIR"], \
        result.stdout
