"""The harness's importable surface is `harness` alone.

A kernel author on a machine with no package registry puts the harness on PYTHONPATH. Its
import root must hold nothing but the `harness` package: this repository's subject suite
(`kernels_cu`, `oracles`) beside it once shadowed a user's own `oracles` package, which an
installed project reaches only after PYTHONPATH (site-packages), with an ImportError."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import harness
from tests._machine import HARNESS_ROOT, child_env

REPO = Path(__file__).resolve().parents[1]


def _importable(folder: Path) -> set[str]:
    """What `import NAME` finds in `folder`: packages (regular or namespace) and modules."""
    names = set()
    for p in folder.iterdir():
        if p.is_dir() and p.name.isidentifier():
            names.add(p.name)
        elif p.suffix == ".py":
            names.add(p.stem)
    return names


def test_the_checkouts_import_root_holds_the_harness_package_alone():
    src = REPO / "src"
    assert (src / "harness" / "__init__.py").is_file(), "the harness lives in src/harness (src layout)"
    assert _importable(src) == {"harness"}, (
        f"src/ holds {sorted(_importable(src) - {'harness'})} beside harness: anything there is importable by "
        "every user who puts the checkout's src/ on PYTHONPATH")


def test_the_harness_on_pythonpath_leaves_a_users_own_oracles_package_to_the_user(tmp_path):
    """The user's `oracles` sits where an installed project's packages sit, after PYTHONPATH's
    entries: the harness's import root, first, must not answer for it."""
    site = tmp_path / "site"
    (site / "oracles").mkdir(parents=True)
    (site / "oracles" / "__init__.py").write_text("WHOSE = 'the user'\n")
    code = ("import oracles, harness, importlib.util; print(oracles.WHOSE); "
            "print(importlib.util.find_spec('kernels_cu') is None)")
    env = child_env({"PYTHONPATH": os.pathsep.join([str(HARNESS_ROOT), str(site)])}, inherit=False)
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, env=env,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["the", "user", "True"], proc.stdout


def test_the_readmes_no_registry_command_loads_the_plugin_from_the_checkout(tmp_path):
    """`PYTHONPATH=<checkout>/src PYTEST_PLUGINS=harness.plugin`, the README's way with nothing
    installed (no entry point: autoloading off stands for that here), collects a kernel tree's
    `.cu` as a compile gate."""
    readme = (REPO / "README.md").read_text()
    assert "export PYTHONPATH=/path/to/harness/src PYTEST_PLUGINS=harness.plugin" in readme
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "k.cu").write_text('extern "C" __global__ void k(float* y) { y[0] = 1.0f; }\n')
    (tmp_path / "pytest.ini").write_text("[pytest]\nkernel_root = kernels\n")
    env = child_env({"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", "HARNESS_CACHE_DIR": str(tmp_path / "cache"),
                     "PYTEST_PLUGINS": None})

    def pytest(**extra):
        return subprocess.run([sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "kernels"],
                              cwd=tmp_path, capture_output=True, text=True, env={**env, **extra}, timeout=300)

    named = pytest(PYTEST_PLUGINS="harness.plugin")
    assert named.returncode == 0, named.stdout + named.stderr
    assert "kernels/k.cu::compile PASSED" in named.stdout, named.stdout
    unnamed = pytest()  # the control: without the variable no plugin, so no compile gate
    assert unnamed.returncode == 5 and "::compile" not in unnamed.stdout, unnamed.stdout + unnamed.stderr


def test_a_launcher_written_for_the_old_module_paths_imports_the_same_modules(tmp_path):
    """The grouping by layer moved `harness.launch` to `harness.library.launch` (and so on,
    `harness._MOVED`): an old path imports the very module at the new one, its submodules too,
    in a process of its own (nothing of the new paths imported first)."""
    code = ("import sys\n"
            "from harness.launch import Refusal\n"
            "from harness.kernels import module\n"
            "import harness.controls.spec as old_spec\n"
            "from harness import device\n"
            "import harness.library.launch, harness.library.kernels, harness.campaigns.controls.spec as new_spec\n"
            "assert Refusal is harness.library.launch.Refusal and module is harness.library.kernels.module\n"
            "assert old_spec is new_spec and device is sys.modules['harness.core.device']\n"
            "copies = [m for m in list(sys.modules) if m.startswith('harness.controls.')\n"
            "          and sys.modules[m] is not sys.modules['harness.campaigns.' + m[len('harness.'):]]]\n"
            "assert not copies, f'second copies: {copies}'\n"
            "print('ok')\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                          env=child_env(), timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_every_old_path_names_a_module_that_exists():
    import importlib.util

    for old, new in harness._MOVED.items():
        assert importlib.util.find_spec(f"harness.{new}") is not None, f"harness.{old} -> harness.{new}: no such module"
