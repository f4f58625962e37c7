"""The gate vocabulary, enforced at collection: every gate carries exactly one kind marker
(`anchor`, `link`, `refusal`, `trap`, `structural`; `compile` items carry theirs), as
`--strict-markers` enforces known markers. A gate with none or with two is a usage error
naming each offender and the fix.

Exempt: the harness's own tests, under the rootdir's `tests/` folder (they test the
harness, not a kernel). The terminal summary calls them "harness tests".
"""

from __future__ import annotations

from pathlib import Path

from harness.report import KINDS

OWN_TESTS = "tests"  # the rootdir folder holding the harness's own tests


def kinds_of(item) -> list[str]:
    return [k for k in KINDS if item.get_closest_marker(k) is not None]


def is_own_test(item, rootpath: Path) -> bool:
    try:
        rel = Path(item.path).resolve().relative_to(Path(rootpath).resolve())
    except (ValueError, OSError):
        return False
    return bool(rel.parts) and rel.parts[0] == OWN_TESTS


def kind_problems(items, rootpath: Path) -> list[str]:
    """One line per gate whose kind markers are not exactly one."""
    problems = []
    for item in items:
        if is_own_test(item, rootpath):
            continue
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


def check_kinds(items, config) -> None:
    """Raise pytest.UsageError listing every gate with no kind or two."""
    import pytest

    problems = kind_problems(items, config.rootpath)
    if problems:
        shown = problems[:20]
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise pytest.UsageError(
            f"harness: {len(problems)} gate(s) break the vocabulary (docs/harness-api.md, Markers):\n  "
            + "\n  ".join(shown) + more)
