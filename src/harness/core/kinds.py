"""Which runs are harness runs (`opt_in_reason`, `claim`), which items are gates, and the gate
vocabulary (the markers) enforced on them at collection.

A run is the harness's when it names a harness ini key, option or variable (`opt_in_reason`), or
when it collects an item that can only be a gate (`claim`): one with a kind marker the project
does not register as its own, or one using a harness fixture that really is the harness's (a
project's own `kernel_root` fixture is the project's). `gpu`, `deadline`, `memory_safety` and
`names_faults` qualify a gate and are common names (a project's own `@pytest.mark.gpu`): they
never opt a run in by themselves.

In a harness run a gate is an item the harness owns: a `.cu` compile item, an item under one of
the ini `harness_gates` paths, an item that carries a harness marker (`gpu`, a kind, `deadline`,
`memory_safety`, `names_faults`) that the project does not register as its own (ini `markers`,
a conftest), or one that uses a harness fixture (`kernel_root`, `gpu_device`). Every other item
is an ordinary test: the harness neither checks nor records it, and pytest runs it as it would
without the plugin.

Every gate carries exactly one kind marker (`anchor`, `link`, `invariance`, `determinism`,
`refusal`, `trap`, `structural`; `compile` items carry theirs), as `--strict-markers` enforces known markers.
A gate with none or with two is a usage error naming each offender and the fix.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from harness.core.errors import as_pytest_usage
from harness.core.settings import GATES_INI, INCLUDE_DIRS_INI, KERNEL_ROOT_ENV

KINDS = ("anchor", "link", "invariance", "determinism", "sweep", "refusal", "trap", "structural", "compile")  # one each

# The markers the plugin registers, with their help.
MARKERS = {
    "gpu": "the gate needs a CUDA device; skipped without one unless --require-gpu, which fails instead",
    "anchor": "compares a GPU arm with closed-form host math (a tolerance only with a written reason)",
    "link": "compares one GPU arm with another, bit for bit",
    "invariance": "asserts a row's bits do not depend on the batch around it: its size, its place, the launch "
                  "variants a serving engine varies (harness.library.invariance.assert_batch_invariant)",
    "determinism": "asserts a repeated launch gives the same bits every time (harness.library.invariance."
                   "assert_deterministic)",
    "sweep": "checks the kernel over its declared shape space, presets and boundaries first, then drawn shapes; "
             "a failure shrinks to the smallest failing shape and names its replay (harness.library.sweep.sweep)",
    "refusal": "asserts a host launcher rejects bad arguments with a pinned message, before any launch",
    "trap": "asserts the kernel's device guard fires; runs in the trap shadow in its own lane, or traps for "
            "real in a fresh worker",
    "memory_safety": "the gate exists for a memory-safety property (an entry that must never be followed, a "
                     "buffer that must never be touched): a fault in it is the verdict it is written to give, so "
                     "a mutation campaign counts a mutant it catches by a fault as killed (trap gates are so "
                     "by definition)",
    "names_faults": "the gate turns a device error on valid input (a guard that fires where it must not) into "
                    "a failure by its own assertion: after a mutant's first fault a mutation campaign runs it "
                    "next, and its fault cap never skips it",
    "structural": "reads kernel source text (a constant agrees with its #define); needs no device",
    "compile": "compiles one .cu with NVRTC (collected from the kernel root; no device)",
    "deadline(seconds)": "this GPU gate's deadline, over --harness-deadline / ini harness_deadline",
    "no_redzones(reason)": "the gate's kernel writes past a buffer's view on purpose: its buffers carry no "
                           "redzones and its launches no check (harness.library.redzones); the reason is required",
}

REQUIRE_GPU_ENV = "HARNESS_REQUIRE_GPU"

# What opts a project in: a harness option on the command line, its environment equivalent,
# or a harness key in the project's ini. A collected gate opts a run in too (collection).
OPT_IN_OPTIONS = {"require_gpu": "--require-gpu", "kernel_root": "--kernel-root", "arch": "--arch",
                  "harness_report": "--harness-report", "harness_cache_dir": "--harness-cache-dir",
                  "harness_deadline": "--harness-deadline", "sanitize": "--sanitize", "include_dir": "--include-dir",
                  "no_fail_fast": "--no-fail-fast", "harness_serve": "--harness-serve",
                  "snapshot_update": "--snapshot-update", "compare_to": "--compare-to", "no_redzones": "--no-redzones"}
OPT_IN_ENV = (REQUIRE_GPU_ENV, KERNEL_ROOT_ENV)
OPT_IN_INI = ("kernel_root", GATES_INI, "controls_dir", "harness_cache_dir", INCLUDE_DIRS_INI,
              "harness_deadline")


def opt_in_reason(config) -> str | None:
    """What makes this run a harness run before collection, or None (inert until a gate is collected)."""
    for attr, flag in OPT_IN_OPTIONS.items():
        if getattr(config.option, attr, None):
            return flag
    for var in OPT_IN_ENV:
        if os.environ.get(var, "") not in ("", "0"):
            return var
    for key in OPT_IN_INI:
        if config.getini(key):
            return f"ini {key}"
    return None


QUALIFIERS = ("gpu", "deadline", "memory_safety", "names_faults")  # qualify a gate; never claim a run alone
HARNESS_MARKERS = (*KINDS, *QUALIFIERS)
HARNESS_FIXTURES = ("kernel_root", "gpu_device")
FIXTURES_MODULE = "harness.plugin"  # where the harness's own fixtures are defined

gate_key = pytest.StashKey[bool]()  # on each item the harness owns, set at collection


def owned(item) -> bool:
    """Whether the harness took `item` as a gate at collection (`is_gate`)."""
    return item.stash.get(gate_key, False)


def kinds_of(item) -> list[str]:
    return [k for k in KINDS if item.get_closest_marker(k) is not None]


def kind_of(item) -> str | None:
    """The gate's kind marker (the first, where a run let two through), or None."""
    return next(iter(kinds_of(item)), None)


def is_gpu(item) -> bool:
    """The gate needs a device: marked `gpu`, or a trap gate."""
    return bool(item.get_closest_marker("gpu") or item.get_closest_marker("trap"))


def foreign_markers(config) -> frozenset[str]:
    """Harness marker names that something else registers as its own in this run (the project's
    ini `markers`, a conftest, another plugin): on a test, such a name is not the harness's word."""
    ours = {f"{name}: {text}" for name, text in MARKERS.items()}
    names = {line.split(":", 1)[0].split("(", 1)[0].strip() for line in config.getini("markers") if line not in ours}
    return frozenset(names.intersection(HARNESS_MARKERS))


def _harness_fixture(item, name: str) -> bool:
    """`item` uses fixture `name` and it resolves to the harness's own, not a project's namesake."""
    if name not in getattr(item, "fixturenames", ()):
        return False
    info = getattr(item, "_fixtureinfo", None)
    defs = info.name2fixturedefs.get(name) if info is not None else None
    return bool(defs) and getattr(defs[-1].func, "__module__", None) == FIXTURES_MODULE


def _markers(item, names, foreign: frozenset[str]) -> list[str]:
    return [m for m in names if m not in foreign and item.get_closest_marker(m) is not None]


def claim(item, foreign: frozenset[str] = frozenset()) -> str | None:
    """Why `item` makes a run that has not opted in a harness run, or None: a kind marker the
    project does not register itself, or a harness fixture (never a qualifier such as `gpu`)."""
    kinds = _markers(item, KINDS, foreign)
    if kinds:
        return f"carries @pytest.mark.{kinds[0]}, a harness kind"
    fixtures = [f for f in HARNESS_FIXTURES if _harness_fixture(item, f)]
    return f"uses the harness fixture {fixtures[0]}" if fixtures else None


def _under_any(path: Path, folders: tuple[Path, ...]) -> bool:
    try:
        resolved = Path(path).resolve()
    except OSError:
        return False
    return any(resolved == f or resolved.is_relative_to(f) for f in folders)


def is_gate(item, gate_paths: tuple[Path, ...] = (), foreign: frozenset[str] = frozenset()) -> bool:
    """Whether the harness owns `item` in a harness run (module docstring)."""
    if _markers(item, HARNESS_MARKERS, foreign):
        return True
    if any(_harness_fixture(item, f) for f in HARNESS_FIXTURES):
        return True
    return bool(gate_paths) and _under_any(item.path, gate_paths)


def kind_problems(gates, foreign: frozenset[str] = frozenset()) -> list[str]:
    """One line per gate whose kind markers are not exactly one."""
    problems = []
    for item in gates:
        kinds = kinds_of(item)
        if len(kinds) == 1:
            continue
        if kinds:
            problems.append(f"{item.nodeid}: has kinds {', '.join(kinds)}; a gate has exactly one: keep the one "
                            "its assertion makes")
            continue
        line = (f"{item.nodeid}: has no kind; mark it with exactly one of "
                f"{', '.join('@pytest.mark.' + k for k in KINDS if k != 'compile')}")
        qualifiers = _markers(item, QUALIFIERS, foreign)
        if qualifiers:  # a common name: it may be the project's own marker
            name = qualifiers[0]
            line += (f" (@pytest.mark.{name} makes it a gate in a harness run; if {name} is your project's own "
                     f"marker, register it in your ini `markers` and the harness leaves a test that carries only "
                     f"it alone, or run without the harness: -p no:harness.plugin)")
        problems.append(line)
    return problems


def check_kinds(gates, foreign: frozenset[str] = frozenset()) -> None:
    """Raise pytest.UsageError listing every gate with no kind or two."""
    problems = kind_problems(gates, foreign)
    if problems:
        shown = problems[:20]
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise as_pytest_usage(f"{len(problems)} gate(s) break the vocabulary (docs/harness-api.md, Markers):\n  "
                              + "\n  ".join(shown) + more)
