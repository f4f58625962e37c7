"""The README's test command installs `.[test]` only: on a machine without the optional extras
(torch, Ray), the tests that need one skip naming it, never fail. CI installs the extras and
asks for them (HARNESS_REQUIRE_*), so this test makes the machine without them: a folder first
on the child's PYTHONPATH in which `import torch` and `import ray` find nothing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests._machine import RAY, TORCH, child_env

REPO = Path(__file__).resolve().parents[1]

ABSENT = 'raise ModuleNotFoundError("No module named {0!r}", name={0!r})\n'

# The test the issue found red on a machine without torch (a control's gates import torch in
# the campaign's children), and a module of tests that needs Ray throughout.
SELECTED = ("tests/test_torch_ext_tree.py::TestTheTreesCommands::test_every_control_applies_and_compiles",
            "tests/test_ray_campaign.py")


def test_tests_that_need_an_absent_extra_skip_naming_it_and_how_to_install_it(tmp_path):
    hidden = tmp_path / "hidden"
    for name in ("torch", "ray"):
        (hidden / name).mkdir(parents=True)
        (hidden / name / "__init__.py").write_text(ABSENT.format(name))
    env = child_env({TORCH.require: None, RAY.require: None, "HARNESS_CACHE_DIR": str(tmp_path / "cache")},
                    first=(hidden,))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "0", "-rs", *SELECTED],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout
    assert proc.returncode == 0 and " failed" not in out, out + proc.stderr
    assert f"{TORCH.what} is not installed: {TORCH.install}" in out, out
    assert f"{RAY.what} is not installed: {RAY.install}" in out, out
