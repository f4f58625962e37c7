"""Every pytest the harness starts, built here: its arguments (`ChildPytest`) and the private
channels a parent tells it through the environment (the `*_CHANNEL` names below).

A child is a fresh `python -m pytest` (the run layer's fresh runs, a campaign's CPU gate
server, a collect) or the `pytest.main` of a pool's server. Each gets the run's settings as
options (`Settings.child_options`, the one serialisation of them) and what else its parent
needs it to do; the public environment variables a user sets are in docs/harness-api.md's
table, the private channels only here.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from harness.core.settings import Settings

# Private channels, parent to child: set by the harness for a process it starts, never by hand.
ARMS_OUT_CHANNEL = "HARNESS_ARMS_OUT"  # a comparison's runs: where each gate writes its arm outputs
LAUNCHERS_OF_CHANNEL = "HARNESS_LAUNCHERS_OF"  # a comparison's side run: today's kernel root (its node ids)
COMPARE_TIMING_CHANNEL = "HARNESS_COMPARE_TIMING"  # --compare-timing: `repeat,warmup` for each gate's launches
CPU_SERVE_FD_CHANNEL = "HARNESS_CPU_SERVE_FD"  # a CPU gate server: its end of the socket pair
COLLECT_OUT_CHANNEL = "HARNESS_CONTROLS_COLLECT_OUT"  # a campaign's collect: where it writes the node ids
SANITIZER_LOG_CHANNEL = "HARNESS_SANITIZER_LOG"  # a worker under --sanitize: its compute-sanitizer log
SANITIZER_TOOL_CHANNEL = "HARNESS_SANITIZER_TOOL"  # a worker under --sanitize: the tool's name
POOL_T0_CHANNEL = "HARNESS_POOL_T0"  # the pool's trace: the parent's start, its children's time base
BLAS_THREADS_CHANNEL = "HARNESS_BLAS_THREADS"  # a GPU gate worker among several: its share of BLAS threads
SERVER_WARM_CHANNEL = "HARNESS_SERVER_WARM"  # a campaign's pool server: warm the structural gates first
COVERAGE_DIR_CHANNEL = "HARNESS_COVERAGE_DIR"  # a gate run recorded for a campaign: where each gate's reads go

CHANNELS = (ARMS_OUT_CHANNEL, LAUNCHERS_OF_CHANNEL, COMPARE_TIMING_CHANNEL, CPU_SERVE_FD_CHANNEL,
            COLLECT_OUT_CHANNEL, SANITIZER_LOG_CHANNEL, SANITIZER_TOOL_CHANNEL, POOL_T0_CHANNEL,
            BLAS_THREADS_CHANNEL, SERVER_WARM_CHANNEL, COVERAGE_DIR_CHANNEL)


@dataclass(frozen=True)
class ChildPytest:
    """One pytest the harness starts: what it runs over, with which settings, reporting where.

    `args()` is pytest's argument list (for `pytest.main` or after `python -m pytest`),
    `command()` the whole command line."""

    targets: tuple[str, ...]
    kernel_root: Path | None = None
    cache_dir: Path | None = None
    arch: str | None = None  # given only where the run named one (HARNESS_ARCH reaches a child anyway)
    include_dirs: tuple[Path, ...] = ()
    deadline: float | None = None  # seconds: each GPU gate's, and its isolated (trap) gates end within it
    sweep_budget: int | None = None
    sweep_replay: str | None = None
    redzones: bool = False  # --redzones: guard regions around the device buffers (opt-in until proven on a GPU)
    rootdir: Path | None = None
    config_file: Path | None = None
    report_dir: Path | None = None  # --harness-report: its gates.json is the child's verdicts
    require_gpu: bool = False
    no_fail_fast: bool = False
    native_tracebacks: bool = False  # a killed mutant's gate fails: pytest's own traceback is slow to build
    collect_only: bool = False
    no_xdist: bool = False  # the child never spreads over xdist (where xdist is installed)
    plugins: tuple[str, ...] = ()  # -p NAME, each
    overrides: tuple[str, ...] = ()  # -o KEY=VALUE, each
    extra: tuple[str, ...] = ()  # options of a feature the child takes part in (--snapshot-update)
    serve: bool = False  # a pool's server: --harness-serve

    @classmethod
    def over(cls, targets, settings: Settings, **kw) -> "ChildPytest":
        """A child over `targets` with the run's `settings` (their one serialisation)."""
        return cls(tuple(targets), kernel_root=settings.kernel_root, cache_dir=settings.cache_dir,
                   arch=settings.arch if settings.arch_source == "--arch" else None,
                   include_dirs=settings.include_dirs, deadline=settings.deadline,
                   sweep_budget=settings.sweep_budget, sweep_replay=settings.sweep_replay,
                   redzones=settings.redzones, **kw)

    def args(self) -> list[str]:
        out = list(self.targets)
        if self.rootdir is not None:
            out.append(f"--rootdir={self.rootdir}")
        if self.config_file is not None:
            out.append(f"--config-file={self.config_file}")
        out += ["-q", "--color=no", "-p", "no:cacheprovider"]
        if self.native_tracebacks:
            out.append("--tb=native")
        if self.collect_only:
            out.append("--collect-only")
        if self.kernel_root is not None:
            out.append(f"--kernel-root={self.kernel_root}")
        if self.cache_dir is not None:
            out.append(f"--harness-cache-dir={self.cache_dir}")
        if self.arch:
            out.append(f"--arch={self.arch}")
        out += [f"--include-dir={d}" for d in self.include_dirs]
        if self.deadline is not None:
            out.append(f"--harness-deadline={float(self.deadline)!r}")
        if self.sweep_budget is not None:
            out.append(f"--sweep-budget={self.sweep_budget}")
        if self.sweep_replay is not None:
            out.append(f"--sweep-replay={self.sweep_replay}")
        if self.redzones:
            out.append("--redzones")
        if self.report_dir is not None:
            out.append(f"--harness-report={self.report_dir}")
        if self.no_fail_fast:
            out.append("--no-fail-fast")
        if self.require_gpu:
            out.append("--require-gpu")
        out += list(self.extra)
        for plugin in self.plugins:
            out += ["-p", plugin]
        for override in self.overrides:
            out += ["-o", override]
        if self.no_xdist and _xdist_installed():
            out += ["-p", "no:xdist"]
        if self.serve:
            out.append("--harness-serve")
        return out

    def command(self) -> list[str]:
        return pytest_command(self.args())


def pytest_command(args: list[str]) -> list[str]:
    """`python -m pytest ARGS` with this interpreter: a child's whole command line."""
    return [sys.executable, "-m", "pytest", *args]


def _xdist_installed() -> bool:
    from importlib.util import find_spec

    return find_spec("xdist") is not None
