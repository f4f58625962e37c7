"""Which runs are harness runs (`opt_in_reason`), which items are gates, and the gate
vocabulary (the markers) enforced on them at collection.

A gate is an item the harness owns: a `.cu` compile item, an item under one of the ini
`harness_gates` paths, an item that carries a harness marker (`gpu`, a kind, `deadline`,
`memory_safety`, `names_faults`), or one that uses a harness fixture (`kernel_root`,
`gpu_device`). Every other item is an ordinary test: the harness neither checks nor
records it, and pytest runs it as it would without the plugin.

Every gate carries exactly one kind marker (`anchor`, `link`, `invariance`, `determinism`,
`refusal`, `trap`, `structural`; `compile` items carry theirs), as `--strict-markers` enforces known markers.
A gate with none or with two is a usage error naming each offender and the fix.
"""

from __future__ import annotations

import os
from pathlib import Path

from harness._settings import GATES_INI, INCLUDE_DIRS_INI, KERNEL_ROOT_ENV
from harness.report import KINDS

# The markers the plugin registers, with their help.
MARKERS = {
    "gpu": "the gate needs a CUDA device; skipped without one unless --require-gpu, which fails instead",
    "anchor": "compares a GPU arm with closed-form host math (a tolerance only with a written reason)",
    "link": "compares one GPU arm with another, bit for bit",
    "invariance": "asserts a row's bits do not depend on the batch around it: its size, its place, the launch "
                  "variants a serving engine varies (harness.invariance.assert_batch_invariant)",
    "determinism": "asserts a repeated launch gives the same bits every time (harness.invariance."
                   "assert_deterministic)",
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
}

REQUIRE_GPU_ENV = "HARNESS_REQUIRE_GPU"

# What opts a project in: a harness option on the command line, its environment equivalent,
# or a harness key in the project's ini. A collected gate opts a run in too (collection).
OPT_IN_OPTIONS = {"require_gpu": "--require-gpu", "kernel_root": "--kernel-root", "arch": "--arch",
                  "harness_report": "--harness-report", "harness_cache_dir": "--harness-cache-dir",
                  "harness_deadline": "--harness-deadline", "sanitize": "--sanitize", "include_dir": "--include-dir",
                  "no_fail_fast": "--no-fail-fast", "harness_serve": "--harness-serve",
                  "snapshot_update": "--snapshot-update", "compare_to": "--compare-to"}
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
