"""The machine a harness test runs on, made by the test instead of assumed: one place for the
rules docs/architecture.md lists ("Contributing: the harness's own tests").

- A child process imports this checkout's harness, and keeps what PYTHONPATH held: a machine
  may carry packages there (the device machine's wheels), and a child without them compiles
  with other settings, or cannot make mutants.
- A child runs on a machine with no GPU unless its test asks for one: CUDA_VISIBLE_DEVICES=""
  hides every device, and the harness then takes the path of a machine with no driver (no
  pool, no probe process), so it prints what it prints there.
- An optional extra (torch, Ray, Chromium, nvcc) that is absent skips its tests with a reason
  naming it and how to install it; where CI asked for it (its HARNESS_REQUIRE_* variable,
  set by .ci/run, which installs it) the absence fails them instead.
"""

from __future__ import annotations

import importlib
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import NoReturn

import pytest

import harness

# The folder `import harness` is found in: src/ in a checkout.
HARNESS_ROOT = Path(harness.__file__).resolve().parents[1]
PACKAGE = HARNESS_ROOT / "harness"  # the harness's own sources, where it is imported from
NO_GPU = {"CUDA_VISIBLE_DEVICES": ""}


def pythonpath(*first: str | Path) -> str:
    """PYTHONPATH for a child: `first`, then the harness's import root, then what this
    process's PYTHONPATH holds."""
    parts = [str(p) for p in (*first, HARNESS_ROOT)] + os.environ.get("PYTHONPATH", "").split(os.pathsep)
    return os.pathsep.join(dict.fromkeys(p for p in parts if p))


def child_env(extra: dict[str, str | None] | None = None, *, inherit: bool = True,
              first: tuple[str | Path, ...] = ()) -> dict[str, str]:
    """An environment for a child process: this process's (or, `inherit=False`, only PATH),
    PYTHONPATH from `pythonpath(*first)`, every device hidden, then `extra` (a value of None
    removes that variable: `{"CUDA_VISIBLE_DEVICES": None}` gives back this machine's devices)."""
    env = dict(os.environ) if inherit else {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    env["PYTHONPATH"] = pythonpath(*first)
    env.update(NO_GPU)
    for name, value in (extra or {}).items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return env


def use_child_env(monkeypatch: pytest.MonkeyPatch, extra: dict[str, str | None] | None = None) -> None:
    """`child_env` set on this process's environment for the test's length: the children that
    pytester and the harness start inherit it."""
    for name, value in child_env(extra).items():
        if os.environ.get(name) != value:
            monkeypatch.setenv(name, value)
    for name in [n for n, v in (extra or {}).items() if v is None]:
        monkeypatch.delenv(name, raising=False)


# ------------------------------------------------------------------ optional extras


@dataclass(frozen=True)
class Optional:
    """Something the README's test command does not install, that some tests need."""

    what: str  # as a person names it
    install: str  # how to install it
    require: str  # the environment variable under which its absence fails (.ci/run sets it)

    def absent(self) -> NoReturn:
        __tracebackhide__ = True  # a skip is reported where the test asked, not here
        why = f"{self.what} is not installed: {self.install}"
        if os.environ.get(self.require):
            pytest.fail(f"{why} ({self.require} is set: this machine must have it)")
        pytest.skip(why, allow_module_level=True)  # a module of such tests skips whole

    def module(self, name: str) -> ModuleType:
        """The module `name`, or `absent()` where it cannot be imported."""
        __tracebackhide__ = True
        try:
            return importlib.import_module(name)
        except ImportError:
            self.absent()

    def program(self, *names: str) -> str:
        """The first of `names` on PATH, or `absent()`."""
        __tracebackhide__ = True
        for name in names:
            found = shutil.which(name)
            if found:
                return found
        self.absent()


TORCH = Optional("torch (the optional extra [torch])", "pip install torch==2.13.0 (the CPU build; .ci/run installs it)",
                 "HARNESS_REQUIRE_TORCH")
RAY = Optional("Ray (the optional extra [ray])", 'pip install -e ".[ray]" (.ci/run installs it)', "HARNESS_REQUIRE_RAY")
CHROMIUM = Optional("headless Chromium", "apt-get install chromium (.ci/run does)", "HARNESS_REQUIRE_CHROMIUM")
NVCC = Optional("nvcc (a CUDA toolkit)", "install a CUDA toolkit, or pip install nvidia-cuda-nvcc, and put nvcc on PATH",
                "HARNESS_REQUIRE_NVCC")
