"""Bad input to the pytest plugin's options and ini keys: one line saying what was wrong and
what to do, before any work, never a traceback; and a setting that runs but means less than it
seems says so in one line. No GPU needed (children run with CUDA_VISIBLE_DEVICES="")."""

import subprocess
import sys
from pathlib import Path

import pytest

from tests._machine import child_env

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
    env = child_env({"HARNESS_CACHE_DIR": str(Path(cwd).parent / "cache"), "HARNESS_REQUIRE_GPU": None,
                     "HARNESS_KERNEL_ROOT": None, "HARNESS_ARCH": None})
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


def test_a_harness_report_folder_that_cannot_be_made_is_one_line_before_the_run(project):
    # /proc takes no new folder, even for root: the reports would fail only after every gate ran
    line = usage_line(run_pytest("--harness-report=/proc/harness-report", cwd=project))
    assert line.startswith("ERROR: harness: --harness-report /proc/harness-report cannot be made: "), line
    assert line.endswith("pass a folder you can write to"), line


def test_an_ini_harness_gates_path_that_does_not_exist_says_so_in_one_line(project):
    result = run_pytest("-o", "harness_gates=gates\nnowhere", cwd=project)
    assert result.returncode == 0, result.stdout + result.stderr
    said = [line for line in result.stdout.splitlines() if "nowhere" in line]
    assert said == [f"harness: ini harness_gates names nowhere ({project / 'nowhere'}), which does not exist: no "
                    "test is a gate by it; fix the path, or remove it"], result.stdout


@pytest.mark.parametrize("marker, says", [
    ('deadline("soon")', "@pytest.mark.deadline 'soon' is not a number of seconds"),
    ("deadline()", "@pytest.mark.deadline 'None' is not a number of seconds"),
    ("deadline(-5)", "@pytest.mark.deadline must be a positive, finite number of seconds (got -5)"),
])
def test_a_bad_deadline_marker_is_one_line_at_collection_not_mid_run(project, marker, says):
    # without a device the GPU gate is skipped: its deadline would go unread until a GPU run hit it
    (project / "gates" / "test_g.py").write_text(f"import pytest\n\n\n@pytest.mark.gpu\n@pytest.mark.anchor\n"
                                                 f"@pytest.mark.{marker}\ndef test_on_device():\n    pass\n")
    result = run_pytest(cwd=project)
    assert result.returncode == pytest.ExitCode.USAGE_ERROR, result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines == [f"ERROR: harness: gates/test_g.py::test_on_device: {says}; write e.g. "
                     "@pytest.mark.deadline(120)"], result.stderr


def test_harness_lanes_under_xdist_says_it_has_no_effect(project):
    result = run_pytest("--harness-lanes=3", "-n", "2", cwd=project)
    assert result.returncode == 0, result.stdout + result.stderr
    said = [line for line in result.stdout.splitlines() if "--harness-lanes" in line]
    assert said == ["harness: --harness-lanes 3 has no effect under xdist (-n): each xdist worker runs its GPU "
                    "gates on a worker of its own, in order; drop -n to spread them over lanes"], result.stdout
