"""The plugin's state: small typed objects, each with one owner, kept in the config's stash
(as pytest's own plugins keep theirs); per-gate facts live in each item's stash
(`harness.core.kinds.gate_key`).

- `Role`: what this pytest process is (the one that reports, a pool's server or worker, an
  xdist worker or controller). Fixed at configure; every run has one.
- `HarnessRun`: a harness run, fixed when the project opts in (the plugin's `_activate`): its
  `Settings`, the policies it was asked for and the lines the summary owes. Absent from the
  stash, the run is plain pytest's.
- `GpuGates`: the pool of GPU gate workers and what this run learnt of the device (owned by
  `harness.plugin.pool`).
- `Recorder` (`harness.plugin.verdicts`): every gate's verdict, folded from its reports.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from harness.core.settings import Settings

if TYPE_CHECKING:
    from harness.pool.controller import Pool, Worker
    from harness.pool.lanes import GateTimes, Lanes
    from harness.pool.share import LaneClaim
    from harness.pool.traps import TrapsAhead


@dataclass(frozen=True)
class Role:
    """What this pytest process is."""

    serving: bool  # a pool's server or an exec'd worker: runs no gate loop, writes no report
    xdist_worker: bool
    xdist_controller: bool

    @classmethod
    def of(cls, config: pytest.Config) -> "Role":
        opt = config.option
        worker = hasattr(config, "workerinput")
        return cls(serving=bool(getattr(opt, "harness_serve", False)), xdist_worker=worker,
                   xdist_controller=(not worker and bool(getattr(opt, "numprocesses", None))
                                     and getattr(opt, "dist", "no") != "no"))

    @property
    def reports(self) -> bool:
        """This process prints the summary and writes the run's reports."""
        return not self.serving and not self.xdist_worker

    @property
    def runs_gates(self) -> bool:
        """GPU gates are judged here (in this process's pool), not by an xdist worker or a server."""
        return not self.serving and not self.xdist_controller


@dataclass(frozen=True)
class HarnessRun:
    """A harness run, as its options made it when the project opted in."""

    opted_in_by: str
    role: Role
    settings: Settings
    gate_paths: tuple[Path, ...] = ()  # ini harness_gates, absolute
    require_gpu: bool = False
    sanitize: str | None = None  # --sanitize TOOL
    sanitizer_cmd: tuple[str, ...] | None = None  # the compute-sanitizer command, found at activation
    report_dir: Path | None = None  # --harness-report
    shard: str | None = None  # --shard K/N
    shadow_traps: bool = True  # trap gates run in the trap shadow (no --harness-real-traps)
    notes: tuple[str, ...] = ()  # lines the summary says of a setting that runs but means less than it seems


@dataclass
class GpuGates:
    """The pool of GPU gate workers of this process and what the run learnt of the device."""

    pool: "Pool | None" = None
    probe: dict | None = None  # the pool's probe of the device (count, name, arch, error)
    selected: int = 0  # GPU gates collected
    lanes_planned: bool = False  # planned at the run's first item (`lanes` None then: one lane)
    lanes: "Lanes | None" = None
    lane_claim: "LaneClaim | None" = None  # its lanes, claimed in the machine's ledger once the probe named the GPU
    gate_times: "GateTimes | None" = None  # what each GPU gate took, for the next run's split
    traps: "TrapsAhead | None" = None  # trap gates started ahead on spares
    shadow_worker: "Worker | None" = None  # outside the trap lane: the worker trap gates shadow in

    @property
    def device_ready(self) -> bool:
        """The probe found a usable device."""
        probe = self.probe or {}
        return probe.get("error") is None and probe.get("count", 0) > 0

    def stop_ahead(self) -> None:
        """Stop what runs ahead of the gates: trap gates started on spares, the lanes."""
        if self.traps is not None:
            self.traps.kill_all()
            self.traps = None
        if self.lanes is not None:
            self.lanes.stop()
            self.lanes = None

    def close(self) -> None:
        """Stop everything this run started on the device, the pool last; then give its lanes
        back to the machine's ledger (the claim stays, for the summary)."""
        self.stop_ahead()
        if self.pool is not None:
            self.pool.close()
            self.pool = None
        if self.lane_claim is not None:
            self.lane_claim.release()


role_key = pytest.StashKey[Role]()
run_key = pytest.StashKey[HarnessRun]()
gpu_key = pytest.StashKey[GpuGates]()


def harness_run(config: pytest.Config) -> HarnessRun | None:
    """The run's `HarnessRun`, or None while it is plain pytest's."""
    return config.stash.get(run_key, None)
