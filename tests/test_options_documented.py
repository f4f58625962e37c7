"""Every option, ini key and environment variable is in the one table of
docs/harness-api.md: the plugin's options and ini keys, the compile and controls
commands' options, and every HARNESS_* variable the harness reads. And the other way: every
row of the table names one of those, a marker the plugin registers, or one of the few
outside variables the table documents on purpose."""

import re
import sys
from pathlib import Path

import pytest
from tests._machine import PACKAGE

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "harness-api.md"
# Variables the harness does not own that the table names on purpose: where the default cache
# lives, where CCCL and nvcc are looked for, which devices CUDA shows. Keep this list explicit:
# a row for any other outside variable is a row to justify here first.
OUTSIDE_VARIABLES = frozenset({"XDG_CACHE_HOME", "CUDA_HOME", "CUDA_VISIBLE_DEVICES"})


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
    """What the plugin adds, and the feature plugins it names in `pytest_plugins`."""
    import importlib

    from harness import plugin

    rec = _Recorder()
    plugin.pytest_addoption(rec)
    for name in plugin.pytest_plugins:
        feature = importlib.import_module(name)
        if hasattr(feature, "pytest_addoption"):  # a feature plugin may add no option (snapshot_tally)
            feature.pytest_addoption(rec)
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
    """The public HARNESS_* variables the harness reads: every one it spells but the private
    channels to its children (harness.core.child.CHANNELS)."""
    from harness.core.child import CHANNELS

    found = set()
    for path in PACKAGE.rglob("*.py"):
        found |= set(re.findall(r"""["'](HARNESS_[A-Z0-9_]+)["']""", path.read_text()))
    return found - set(CHANNELS)


def test_the_table_names_no_private_channel():
    from harness.core.child import CHANNELS

    named = sorted(name for where, name in documented() if where == "env" and name in CHANNELS)
    assert not named, f"{DOC.relative_to(REPO)} names private channels (harness/core/child.py has them): {named}"


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
        from harness.campaigns.controls.cli import build_parser as build
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


def existing() -> dict[str, set[str]]:
    """What a row of each `where` may name: the names that exist today."""
    from harness import plugin
    from harness.__main__ import compile_parser
    from harness.campaigns.controls.cli import build_parser

    rec = plugin_options()
    return {
        "pytest": set(rec.options),
        "ini": set(rec.ini),
        "compile": set(argparse_names(compile_parser())),
        "controls": set(argparse_names(build_parser())),
        "env": harness_env_vars() | OUTSIDE_VARIABLES,
        "marker": {name.split("(", 1)[0] for name in plugin.MARKERS},  # "deadline(seconds)" -> "deadline"
    }


def named_by(where: str, name: str) -> str:
    """The name a row stands for: a marker row reads `@pytest.mark.deadline(S)`."""
    if where == "marker":
        return name.removeprefix("@pytest.mark.").split("(", 1)[0]
    return name


def rows_naming_nothing() -> list[tuple[str, str]]:
    there = existing()
    return sorted((where, name) for where, name in documented() if named_by(where, name) not in there.get(where, ()))


def test_every_row_of_the_table_names_something_that_exists():
    stale = rows_naming_nothing()
    assert not stale, (f"these rows of the table in {DOC.relative_to(REPO)} name nothing the harness defines or "
                       f"reads (removed or misspelt; an outside variable belongs in OUTSIDE_VARIABLES first): {stale}")


def test_the_outside_variables_are_ones_the_harness_reads():
    """OUTSIDE_VARIABLES stays honest: each is read (or set for a child) somewhere in harness/."""
    sources = "\n".join(p.read_text() for p in PACKAGE.rglob("*.py"))
    unread = sorted(v for v in OUTSIDE_VARIABLES if not re.search(rf"""["']{v}["']""", sources))
    assert not unread, f"the harness no longer reads {unread}: drop them from OUTSIDE_VARIABLES and the table"


def test_the_table_check_sees_a_row_that_names_nothing(monkeypatch, tmp_path):
    """The check can fail: rows for an option, a variable and a marker that do not exist, and a
    row under a `where` the harness has not, added to a copy of the page, are each caught."""
    doc = tmp_path / "harness-api.md"
    extra = ("| `--a-removed-option` | pytest | off | gone |\n"
             "| `HARNESS_NOT_READ` | env | unset | read by nothing |\n"
             "| `@pytest.mark.not_a_marker` | marker | | registered by nothing |\n"
             "| `--require-gpu` | mutate | off | the table does not cover that command |\n")
    doc.write_text(DOC.read_text().replace("<!-- /options-table -->", extra + "<!-- /options-table -->"))
    monkeypatch.setattr(sys.modules[__name__], "DOC", doc)
    assert rows_naming_nothing() == [("env", "HARNESS_NOT_READ"), ("marker", "@pytest.mark.not_a_marker"),
                                     ("mutate", "--require-gpu"), ("pytest", "--a-removed-option")]
