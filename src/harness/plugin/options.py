"""The plugin's options and ini keys: declared (`pytest_addoption`, which the plugin's module
hands to pytest as its own), each value read from text once (`deadline_value`), and checked
before any work (`check_configuration`, `setting_notes`)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from harness.core import settings as _settings
from harness.core.errors import as_pytest_usage
from harness.core.kinds import REQUIRE_GPU_ENV
from harness.core.settings import DEFAULT_DEADLINE, GATES_INI, SANITIZER_DEADLINE_FACTOR
from harness.library.sweep import DEFAULT_BUDGET as SWEEP_BUDGET

if TYPE_CHECKING:
    from harness.plugin.state import Role


def deadline_value(text: str) -> float:
    """argparse type for a deadline: a finite number of seconds above zero."""
    from harness.core.usage import UsageError, positive_seconds

    try:
        return positive_seconds(text, "--harness-deadline", "120")
    except UsageError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def sweep_budget_value(text: str) -> int:
    """argparse type for --sweep-budget: a whole number of shapes from 0."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"--sweep-budget {text!r}: give a whole number of shapes from 0 (default "
                                         f"{SWEEP_BUDGET}), e.g. --sweep-budget 200")
    return value


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("harness", "CUDA kernel gates (harness)")
    group.addoption("--require-gpu", action="store_true", default=False,
                    help="a missing or broken CUDA device fails the run instead of skipping GPU gates; "
                         f"a run that executes no GPU gate fails too (env {REQUIRE_GPU_ENV}=1)")
    group.addoption("--kernel-root", default=None, metavar="DIR",
                    help="folder holding the .cu files (ini kernel_root; default kernels_cu)")
    group.addoption("--arch", default=None, metavar="sm_XX",
                    help="compile target (default: the device's arch, or sm_90 with no device)")
    group.addoption("--no-fail-fast", action="store_true", default=False,
                    help="run every selected gate even after a red one: forces maxfail=0 over -x/--maxfail")
    group.addoption("--harness-report", default=None, metavar="DIR",
                    help="write DIR/gates.json and DIR/summary.md")
    group.addoption("--harness-cache-dir", default=None, metavar="DIR",
                    help="compiled cubin cache (ini harness_cache_dir; env HARNESS_CACHE_DIR)")
    group.addoption("--harness-deadline", type=deadline_value, default=None, metavar="S",
                    help=f"per-gate deadline for GPU gates (ini harness_deadline; default {DEFAULT_DEADLINE:g} s, "
                         f"x{SANITIZER_DEADLINE_FACTOR} under --sanitize): a gate past it is red by route timeout, "
                         "its worker process killed and replaced")
    group.addoption("--sanitize", default=None, choices=("memcheck", "racecheck", "initcheck", "synccheck"),
                    help="run the GPU gates under NVIDIA compute-sanitizer with this tool; a finding turns the gate "
                         "that launched the kernel red by route sanitizer (trap gates are skipped)")
    group.addoption("--harness-wait-hung", action="store_true", default=False,
                    help="wait every GPU gate's own deadline; by default a gate that launches a kernel that was "
                         "the last launched when an earlier gate timed out is stopped at that launch, red by route error")
    group.addoption("--harness-real-traps", action="store_true", default=False,
                    help="each trap gate traps for real in its fresh worker; by default it runs there in the trap "
                         "shadow (its guard counted, no trap), and only a run that counted no guard traps for real")
    group.addoption("--harness-lanes", default=None, metavar="N",
                    help="ordinary GPU gates run on N warm workers at once, whole modules to a lane (ini "
                         "harness_lanes; default auto: half the cores, at most 8; 1 runs them in order on one)")
    group.addoption("--sweep-budget", type=sweep_budget_value, default=None, metavar="N",
                    help="shapes each sweep gate draws after its presets and boundaries (default "
                         f"{SWEEP_BUDGET}; 0: the presets and boundaries only)")
    group.addoption("--sweep-replay", default=None, metavar="SHAPE",
                    help="each selected sweep gate checks this one shape (N=64,K=1024), as its failure printed it")
    group.addoption("--redzones", action="store_true", default=False,
                    help="the device buffers the harness makes carry guard regions, checked after each launch: a "
                         "write past a buffer fails its gate naming buffer and offset (harness.library.redzones; "
                         "off by default until proven on a GPU, issue 52)")
    group.addoption("--no-redzones", action="store_true", default=False,
                    help="no guard regions (the default for now; wins over --redzones)")
    group.addoption("--harness-serve", action="store_true", default=False, help=argparse.SUPPRESS)
    group.addoption("--harness-child-timeout", default=None, help=argparse.SUPPRESS)  # removed: says what replaced it
    # Defaults are empty so that "set in the project's ini" can be told from "not set": a set
    # key opts the project in. An empty kernel_root means kernels_cu, an empty controls_dir controls.
    parser.addini("kernel_root", "folder holding the .cu files, relative to the rootdir (default kernels_cu)",
                  default="")
    parser.addini("controls_dir", "folder of negative-control TOML files, relative to the rootdir "
                                  "(default controls)", default="")
    parser.addini(GATES_INI, "folders or files, relative to the rootdir, whose every test is a gate (checked "
                             "for one kind marker); tests elsewhere are gates only by a harness marker or fixture",
                  type="linelist", default=[])
    parser.addini("harness_cache_dir", "compiled cubin cache folder", default="")
    group.addoption("--include-dir", action="append", default=[], metavar="DIR",
                    help="an extra include directory for every module (repeatable; before ini harness_include_dirs)")
    parser.addini(_settings.INCLUDE_DIRS_INI, "extra include directories, one per line, relative to the rootdir",
                  type="linelist", default=[])
    parser.addini("harness_lanes", "GPU gate lanes: N workers at once, or auto (default)", default="")
    parser.addini("harness_deadline", f"per-gate deadline for GPU gates in seconds (default {DEFAULT_DEADLINE:g})",
                  default="")


def check_configuration(config: pytest.Config) -> None:
    """The plugin's options and the environment, checked once before collection: raises
    pytest.UsageError (one line, `harness: ...`: `harness.core.errors.as_pytest_usage`) on the first
    problem. The kernel root and the cache folder are checked where they are resolved (the
    plugin's activation)."""
    from harness.compiling.arch import arch_problem
    from harness.compiling.cubin_cache import CACHE_MAX_ENV, cache_max_problem
    from harness.core.settings import SERVER_START_ENV
    from harness.core.usage import folder_problem, server_start_problem, writable_problem

    opt = config.option
    problems = []
    if not getattr(opt, "arch", None):
        problems.append(arch_problem(os.environ.get(_settings.ARCH_ENV), _settings.ARCH_ENV))
    if getattr(opt, "harness_report", None):
        problems.append(folder_problem(opt.harness_report, "--harness-report", "gates.json and summary.md"))
        unwritable = writable_problem(opt.harness_report)
        if unwritable:
            problems.append(f"--harness-report {opt.harness_report} cannot be made: {unwritable}; pass a folder you "
                            "can write to")
    problems.append(server_start_problem(os.environ.get(SERVER_START_ENV)))
    problems.append(cache_max_problem(os.environ.get(CACHE_MAX_ENV)))
    for problem in problems:
        if problem:
            raise as_pytest_usage(problem)


def setting_notes(config: pytest.Config, role: Role, gate_paths: tuple[Path, ...]) -> list[str]:
    """Settings that run but mean less than they seem, each a line for the summary."""
    notes = []
    for path in gate_paths:
        if not path.exists():
            shown = path.relative_to(config.rootpath) if path.is_relative_to(config.rootpath) else path
            notes.append(f"harness: ini harness_gates names {shown} ({path}), which does not exist: no test is a gate "
                         "by it; fix the path, or remove it")
    if config.option.harness_lanes and role.xdist_controller:
        notes.append(f"harness: --harness-lanes {config.option.harness_lanes} has no effect under xdist (-n): each "
                     "xdist worker runs its GPU gates on a worker of its own, in order; drop -n to spread them over "
                     "lanes")
    return notes
