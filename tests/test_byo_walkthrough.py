"""docs/your-kernels.md is a walkthrough whose commands run: every block marked `file:` is
written into an empty folder, every block marked `run` is run there (the `run: gpu` blocks
need a device and are left to a GPU machine), and every `expect:` line must appear in the
output of the command before it. Then the structural control is proven here."""

import re
import subprocess
import sys
from pathlib import Path

from tests._machine import child_env

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "your-kernels.md"
BLOCK = re.compile(r"<!-- (file: (?P<file>\S+)|run(?P<gpu>: gpu)?) -->\s*```[a-z]*\n(?P<body>.*?)```", re.S)
EXPECT = re.compile(r"<!-- expect: (.*?) -->")


def steps():
    text = DOC.read_text()
    found = list(BLOCK.finditer(text))
    out = []
    for i, m in enumerate(found):
        end = found[i + 1].start() if i + 1 < len(found) else len(text)
        expects = EXPECT.findall(text[m.end():end])
        out.append((m.group("file"), bool(m.group("gpu")), m.group("body"), expects))
    return out


def test_the_walkthrough_runs_from_an_empty_folder(tmp_path):
    project = tmp_path / "my-kernels"
    project.mkdir()
    env = child_env({"HARNESS_CACHE_DIR": str(tmp_path / "cache"), "HARNESS_KERNEL_ROOT": None})
    ran = 0
    all_steps = steps()
    assert sum(1 for f, *_ in all_steps if f) >= 5 and sum(1 for f, g, *_ in all_steps if not f and not g) >= 3
    for file, gpu, body, expects in all_steps:
        if file:
            (project / file).parent.mkdir(parents=True, exist_ok=True)
            (project / file).write_text(body)
            continue
        if gpu:
            continue  # needs a device: run on a GPU machine
        command = body.strip().replace("python ", f"{sys.executable} ", 1)
        proc = subprocess.run(command, shell=True, cwd=project, env=env, capture_output=True, text=True,
                              timeout=600)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, f"{body.strip()} exited {proc.returncode}:\n{out}"
        for line in expects:
            assert line in " ".join(out.split()), f"{body.strip()}: {line!r} not in its output:\n{out}"
        ran += 1
    assert ran >= 3
    # As the page says: plain `pytest` from a subfolder finds the launchers (the ini's pythonpath),
    # and a command run there writes its report in the project's root. (The structural control
    # is proven by that run: one campaign, not one from the root and one from the subfolder.)
    proc = subprocess.run([sys.executable, "-c", "import sys, pytest; sys.exit(pytest.main(['-q']))"],
                          cwd=project / "gates", env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "3 passed, 1 skipped" in proc.stdout, proc.stdout + proc.stderr
    proc = subprocess.run([sys.executable, "-m", "harness", "controls", "saxpy_threads_moved_in_cu_only",
                           "--no-require-gpu"], cwd=project / "gates", env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "saxpy_threads_moved_in_cu_only: proven, as expected" in proc.stdout + proc.stderr
    assert (project / "harness-report" / "controls.md").is_file() and not (project / "gates" / "harness-report").exists()
    assert sorted(p.name for p in (project / "kernels").iterdir() if p.suffix in (".cu", ".py")) == \
        ["saxpy.cu", "saxpy.py"]
    assert (project / "kernels" / "saxpy.cu").read_text() == dict(
        (f, b) for f, _, b, _ in all_steps if f)["kernels/saxpy.cu"]  # never edited
