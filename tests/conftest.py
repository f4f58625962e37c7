"""The `torch` fixture: torch (the CPU build is enough) for the tests of the harness's torch paths.

torch is an optional extra of the harness, so these tests skip where it is not installed,
naming how to install it, except under HARNESS_REQUIRE_TORCH (set by .ci/run, which
installs it): there a missing torch fails them, so CI never passes having skipped the torch
paths."""

import os
import sys

import pytest

INSTALL = "pip install torch==2.13.0 (the CPU build; .ci/run installs it)"


# Session scope: torch's C extension loads once a process. pytester puts sys.modules back after
# each test that uses it, so a torch first imported inside such a test (test_reference.py) was
# dropped from sys.modules, and the next `import torch` died ("SystemError: bad call flags", then
# a segmentation fault, in CI). Imported here first, it is in every pytester snapshot.
@pytest.fixture(scope="session")
def torch():
    try:
        import torch as module
    except ImportError:
        why = f"torch is not installed: {INSTALL}"
        if os.environ.get("HARNESS_REQUIRE_TORCH"):
            pytest.fail(why)
        pytest.skip(why)
    return module


@pytest.fixture(autouse=True)
def _fresh_runs_allowed_again():
    """An interrupted campaign leaves harness.runs.fresh refusing new children until the next
    campaign resets it; a test that interrupts one must not make a later test's `run_gates`
    (same xdist worker) kill its child at birth."""
    yield
    fresh = sys.modules.get("harness.runs.fresh")
    if fresh is not None:
        fresh.reset()
