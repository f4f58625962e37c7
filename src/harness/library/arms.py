"""Arm outputs: every value a gate checks, kept for a regression check between commits.

The `got` side of `assert_bits_eq` and `assert_close`, and whatever a gate passes to
`harness.record(label, array)`, is an arm output of the running gate, named by its label and
its order among the arms of that label (`label`, then `label#1`, ...). Nothing is kept unless
a snapshot check or update armed the gate (`begin`): otherwise noting an arm is one test of a
flag.
"""

from __future__ import annotations

import numpy as np

from harness.library.dtypes import _host

_gate: str | None = None  # the armed gate, None when nothing is kept
_arms: dict[str, dict[str, np.ndarray]] = {}


def begin(nodeid: str) -> None:
    """Keep the arm outputs of gate `nodeid` from now on (until `end`)."""
    global _gate
    _gate = nodeid
    _arms[nodeid] = {}


def end() -> dict[str, np.ndarray]:
    """Stop keeping; the armed gate's arm outputs ({name: host copy}, in the order noted)."""
    global _gate
    gate, _gate = _gate, None
    return _arms.pop(gate, {}) if gate is not None else {}


def note(label: str, array) -> None:
    """An arm output of the running gate (nothing when no gate is armed)."""
    if _gate is None:
        return
    arms = _arms[_gate]
    name, n = label, 0
    while name in arms:
        n += 1
        name = f"{label}#{n}"
    arms[name] = np.array(_host(array), copy=True)


def record(label: str, array) -> None:
    """Record `array` as an arm output of the running gate, for an arm it does not assert on:
    a snapshot check then holds its bits to the stored ones. Costs nothing when not armed."""
    note(label, array)
