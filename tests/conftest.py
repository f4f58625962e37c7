"""The fixtures of optional things: `torch` (the CPU build is enough) for the tests of the
harness's torch paths, `nvcc` for the nvcc backend's. Where one is absent its tests skip, or
fail under its HARNESS_REQUIRE_* variable, as every optional extra does (tests/_machine.py)."""

import sys

import pytest

from tests._machine import NVCC, TORCH


# Session scope: torch's C extension loads once a process. pytester puts sys.modules back after
# each test that uses it, so a torch first imported inside such a test (test_reference.py) was
# dropped from sys.modules, and the next `import torch` died ("SystemError: bad call flags", then
# a segmentation fault, in CI). Imported here first, it is in every pytester snapshot.
@pytest.fixture(scope="session")
def torch():
    return TORCH.module("torch")


@pytest.fixture(scope="session")
def nvcc() -> str:
    """nvcc's path, for the tests of the nvcc backend (a CUDA toolkit is optional: tests/_machine.py)."""
    return NVCC.program("nvcc")


@pytest.fixture(autouse=True)
def _fresh_runs_allowed_again():
    """An interrupted campaign leaves harness.runs.fresh refusing new children until the next
    campaign resets it; a test that interrupts one must not make a later test's `run_gates`
    (same xdist worker) kill its child at birth."""
    yield
    fresh = sys.modules.get("harness.runs.fresh")
    if fresh is not None:
        fresh.reset()


@pytest.fixture
def settings_in_effect():
    """`settings_in_effect(settings)` makes them the settings in effect for the rest of the test
    (as a run's owner binds its own: harness.core.settings.bind); undone at its end."""
    from harness.core import settings as _settings

    tokens = []

    def use(settings):
        tokens.append(_settings.bind(settings))
        return settings

    yield use
    for token in reversed(tokens):
        _settings.unbind(token)
