"""Which items are gates, and the gate vocabulary enforced on them at collection.

A gate is an item the harness owns: a `.cu` compile item, an item under one of the ini
`harness_gates` paths, an item that carries a harness marker (`gpu`, a kind, `deadline`,
`memory_safety`, `names_faults`), or one that uses a harness fixture (`kernel_root`,
`gpu_device`). Every other item is an ordinary test: the harness neither checks nor
records it, and pytest runs it as it would without the plugin.

Every gate carries exactly one kind marker (`anchor`, `link`, `refusal`, `trap`,
`structural`; `compile` items carry theirs), as `--strict-markers` enforces known markers.
A gate with none or with two is a usage error naming each offender and the fix.
"""

from __future__ import annotations

from pathlib import Path

from harness.report import KINDS

HARNESS_MARKERS = (*KINDS, "gpu", "deadline", "memory_safety", "names_faults")
HARNESS_FIXTURES = ("kernel_root", "gpu_device")


def kinds_of(item) -> list[str]:
    return [k for k in KINDS if item.get_closest_marker(k) is not None]


def _under_any(path: Path, folders: tuple[Path, ...]) -> bool:
    try:
        resolved = Path(path).resolve()
    except OSError:
        return False
    return any(resolved == f or resolved.is_relative_to(f) for f in folders)


def is_gate(item, gate_paths: tuple[Path, ...] = ()) -> bool:
    """Whether the harness owns `item` (module docstring)."""
    if any(item.get_closest_marker(m) is not None for m in HARNESS_MARKERS):
        return True
    if any(f in getattr(item, "fixturenames", ()) for f in HARNESS_FIXTURES):
        return True
    return bool(gate_paths) and _under_any(item.path, gate_paths)


def kind_problems(gates) -> list[str]:
    """One line per gate whose kind markers are not exactly one."""
    problems = []
    for item in gates:
        kinds = kinds_of(item)
        if len(kinds) == 1:
            continue
        if kinds:
            problems.append(f"{item.nodeid}: has kinds {', '.join(kinds)}; a gate has exactly one: keep the one "
                            "its assertion makes")
        else:
            problems.append(f"{item.nodeid}: has no kind; mark it with exactly one of "
                            f"{', '.join('@pytest.mark.' + k for k in KINDS if k != 'compile')}")
    return problems


def check_kinds(gates) -> None:
    """Raise pytest.UsageError listing every gate with no kind or two."""
    import pytest

    problems = kind_problems(gates)
    if problems:
        shown = problems[:20]
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise pytest.UsageError(
            f"harness: {len(problems)} gate(s) break the vocabulary (docs/harness-api.md, Markers):\n  "
            + "\n  ".join(shown) + more)
