"""Every option, ini key and environment variable is in the one table of
docs/harness-api.md: the plugin's options and ini keys, the compile and controls
commands' options, and every HARNESS_* variable the harness reads."""

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "harness-api.md"


def documented() -> set[tuple[str, str]]:
    """(where, name) for every row of the table between the options-table markers."""
    text = DOC.read_text()
    table = text.split("<!-- options-table -->", 1)[1].split("<!-- /options-table -->", 1)[0]
    rows = set()
    for line in table.strip().splitlines()[2:]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        name = re.match(r"`([^` ]+)", cells[0]).group(1)
        for where in cells[1].split(","):
            rows.add((where.strip(), name))
    return rows


class _Recorder:
    """Stands in for pytest's parser: records what the plugin's pytest_addoption adds."""

    def __init__(self):
        self.options: list[str] = []
        self.ini: list[str] = []

    def getgroup(self, *args, **kwargs):
        return self

    def addoption(self, *names, **kwargs):
        import argparse

        if kwargs.get("help") is argparse.SUPPRESS:  # internal: the pool's own processes
            return
        self.options += [n for n in names if n.startswith("--")]

    def addini(self, name, *args, **kwargs):
        self.ini.append(name)


def plugin_options() -> _Recorder:
    from harness import plugin

    rec = _Recorder()
    plugin.pytest_addoption(rec)
    return rec


def argparse_names(parser) -> list[str]:
    names = []
    for action in parser._actions:
        if action.dest == "help":
            continue
        longs = [s for s in action.option_strings if s.startswith("--")]
        names += longs[:1] if longs else [action.metavar or action.dest.upper()]
    return names


def harness_env_vars() -> set[str]:
    found = set()
    for path in (REPO / "harness").rglob("*.py"):
        found |= set(re.findall(r"""["'](HARNESS_[A-Z0-9_]+)["']""", path.read_text()))
    return found


def test_the_table_parses_and_is_not_empty():
    rows = documented()
    assert ("pytest", "--require-gpu") in rows and ("env", "HARNESS_ARCH") in rows and len(rows) > 30


def test_every_plugin_option_and_ini_key_is_documented():
    rec = plugin_options()
    rows = documented()
    assert rec.options and rec.ini
    missing = [o for o in rec.options if ("pytest", o) not in rows] + [k for k in rec.ini if ("ini", k) not in rows]
    assert not missing, f"add these to the table in {DOC.relative_to(REPO)}: {missing}"


@pytest.mark.parametrize("command", ["compile", "controls"])
def test_every_command_option_is_documented(command):
    if command == "compile":
        from harness.__main__ import compile_parser as build
    else:
        from harness.controls.cli import build_parser as build
    names = argparse_names(build())
    missing = [n for n in names if (command, n) not in documented()]
    assert names and not missing, f"add these {command} options to the table in {DOC.relative_to(REPO)}: {missing}"


def test_every_environment_variable_the_harness_reads_is_documented():
    found = harness_env_vars()
    assert {"HARNESS_ARCH", "HARNESS_CACHE_DIR", "HARNESS_KERNEL_ROOT", "HARNESS_REQUIRE_GPU"} <= found
    missing = sorted(v for v in found if ("env", v) not in documented())
    assert not missing, f"add these variables to the table in {DOC.relative_to(REPO)}: {missing}"


def test_the_recorder_sees_an_option_the_table_lacks(monkeypatch):
    """The check can fail: an option added to the plugin and not to the table is caught."""
    from harness import plugin

    original = plugin.pytest_addoption

    def with_extra(parser):
        original(parser)
        parser.getgroup("harness").addoption("--an-undocumented-option")

    monkeypatch.setattr(plugin, "pytest_addoption", with_extra)
    assert "--an-undocumented-option" in plugin_options().options
    assert ("pytest", "--an-undocumented-option") not in documented()
