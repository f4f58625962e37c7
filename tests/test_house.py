"""What the second renovation promised, held by reading the sources: the run's settings are one
value passed down (no module-level mutable settings), every pytest the harness starts is built
in one place, which alone spells the private environment channels, and the comparison talks to
the plugin through hooks, never its state."""

from __future__ import annotations

import ast
import re

from tests._machine import PACKAGE

# Module-level state that is not a setting, each with why it is module-level: what one gate
# records while it runs (it runs in one process at a time), registries and memos.
STATE = {
    ("library/arms.py", "_gate"): "the arm outputs the running gate recorded",
    ("library/coverage.py", "_current"): "what the running gate loaded and read",
    ("library/timing.py", "_state"): "the running gate's timed launches",
    ("pool/worker.py", "_last_launch"): "the worker's last kernel launched (a hung gate names it)",
    ("pool/worker.py", "launches"): "the worker's launch count (the sanitizer's attribution)",
    ("library/ref_launchers.py", "_active"): "the launcher modules swapped in for a comparison's REF side",
    ("core/device.py", "_adopted"): "the device the pool's probe found, adopted once",
    ("compiling/cuda_syntax.py", "_parser"): "the tree-sitter parser, made once",
    ("runs/forkserver.py", "_atexit"): "whether the fork server's exit hook is registered",
}


def _sources():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path.relative_to(PACKAGE).as_posix(), path.read_text()


def test_no_module_level_mutable_settings():
    """The settings are bound (harness.core.settings.bind/applied, a context variable), never kept
    in a module global; every `global` statement left names state that is no setting."""
    found = {}
    for rel, text in _sources():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Global):
                for name in node.names:
                    found[(rel, name)] = node.lineno
    unknown = {f"{rel}:{line} global {name}" for (rel, name), line in found.items() if (rel, name) not in STATE}
    assert not unknown, ("module-level state that is not in the allow-list (a setting belongs in "
                         f"harness.core.settings.Settings, passed down): {sorted(unknown)}")
    stale = sorted(f"{rel} {name}" for rel, name in STATE if (rel, name) not in found)
    assert not stale, f"allow-list entries no module has any more: {stale}"
    settings = (PACKAGE / "core" / "settings.py").read_text()
    assert "global " not in settings and "ContextVar" in settings


def test_one_place_builds_a_child_pytest_and_spells_the_private_channels():
    from harness.core import child

    builders = sorted(rel for rel, text in _sources()
                      if re.search(r"""["']-m["'],\s*["']pytest["']""", text) and rel != "core/child.py")
    assert builders == [], f"modules that build a `python -m pytest` command of their own: {builders}"
    assert child.CHANNELS and all(c.startswith("HARNESS_") for c in child.CHANNELS)
    spelled = sorted({f"{rel}: {c}" for rel, text in _sources() if rel != "core/child.py"
                      for c in child.CHANNELS if re.search(rf"""["']{c}["']""", text)})
    assert spelled == [], f"private channels spelled outside harness/core/child.py (import its constant): {spelled}"


def test_the_comparison_talks_to_the_plugin_through_hooks_only():
    text = "\n".join(p.read_text() for p in (PACKAGE / "plugin" / "compare").rglob("*.py"))
    assert not re.search(r"harness\.plugin(?!\.compare|\.snapshots)|plugin\.state", text), "the comparison imports the plugin"
    assert "def pytest_harness_gate_loop(" in text
    hookspecs = (PACKAGE / "plugin" / "hookspecs.py").read_text()
    assert "def pytest_harness_gate_loop(" in hookspecs


def test_each_check_notices_what_it_forbids(tmp_path, monkeypatch):
    import tests.test_house as house

    fake = tmp_path / "harness"
    fake.mkdir()
    (fake / "core").mkdir()
    (fake / "core" / "settings.py").write_text("from contextvars import ContextVar\n")
    (fake / "core" / "child.py").write_text("")
    (fake / "runs.py").write_text('CMD = ["-m", "pytest"]\nX = "HARNESS_ARMS_OUT"\n'
                                  "def f():\n    global _current\n    _current = 1\n")
    monkeypatch.setattr(house, "PACKAGE", fake)
    monkeypatch.setattr(house, "STATE", {})
    import pytest

    with pytest.raises(AssertionError, match="runs.py:4 global _current"):
        house.test_no_module_level_mutable_settings()
    with pytest.raises(AssertionError, match="build a `python -m pytest` command of their own: \\['runs.py'\\]"):
        house.test_one_place_builds_a_child_pytest_and_spells_the_private_channels()
    (fake / "runs.py").write_text('X = "HARNESS_ARMS_OUT"\n')
    with pytest.raises(AssertionError, match="runs.py: HARNESS_ARMS_OUT"):
        house.test_one_place_builds_a_child_pytest_and_spells_the_private_channels()
