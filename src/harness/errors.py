"""The harness's errors: one root, `HarnessError`."""

from __future__ import annotations


class HarnessError(Exception):
    """Every error the harness raises on purpose."""


class UsageError(HarnessError, ValueError):
    """Bad input, its message one line naming the option and the fix."""
