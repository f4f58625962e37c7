"""The campaign: validate every control, run the baseline, then each control in a sandbox.

    validate -> baseline (unperturbed, must be all green) -> per control:
    sandbox copy -> apply edits exactly once -> compile the perturbed modules once
    -> fresh pytest over the control's gate modules -> classify -> ControlResult

`--static` stops after the compile. `--naive` runs the same campaign the slow way (a
fresh pytest over the whole gates folder per control, each with a cold compile cache),
so the two can be timed against each other on the device.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from harness.campaigns.controls.classify import GateCheck, check_gate, decide, judged_without_device
from harness.campaigns.controls.collect import Collector
from harness.campaigns.controls.edits import EditError, apply
from harness.campaigns.controls.results import CampaignResult, ControlResult
from harness.campaigns.controls.spec import Control, load_controls
from harness.core.device import slot_devices
from harness.core.records import GateRecord, Outcome, Route
from harness.runs import fresh as child
from harness.runs.compilecheck import compile_perturbed, declared_names
from harness.runs.config import RunConfig
from harness.runs.fresh import run_gates
from harness.runs.result import Baseline, GateRuns
from harness.runs.sandbox import sandbox, temp_folder, write
from harness.runs.slots import from_list, run_in_slots
from harness.runs.verdict import Verdict

if TYPE_CHECKING:
    from harness.runs.cluster import Cluster
    from harness.runs.result import Executor, ExecutorFactory

KILL_ROWS = ("modules", "campaign")
# The baseline runs every module of the campaign, usually with a cold compile cache.
BASELINE_DEADLINE_FACTOR = 4


@dataclass(frozen=True, kw_only=True)
class CampaignConfig(RunConfig):
    controls_dir: Path
    names: tuple[str, ...] = ()
    deadline: float = 300.0  # seconds per control
    jobs: int = 1  # controls at once
    static: bool = False
    naive: bool = False
    kill_row: str = "modules"  # run the expected gates' modules, or every module of the campaign
    executor: str = "fresh"  # fresh: a pytest per control; warm: the mutants' warm workers


class Listener(Protocol):
    def phase(self, text: str) -> None: ...
    def total(self, n: int) -> None: ...
    def started(self, control: Control) -> None: ...
    def finished(self, result: ControlResult) -> None: ...


class _Quiet:
    def phase(self, text: str) -> None:
        pass

    def total(self, n: int) -> None:
        pass

    def started(self, control: Control) -> None:
        pass

    def finished(self, result: ControlResult) -> None:
        pass


# ---------------------------------------------------------------- the campaign


def validate(config: CampaignConfig, collect: Collector | None = None) -> list[Control]:
    """Every control in the folder, validated; the selected ones. Raises ControlSpecError.
    `collect` lists the gates (a campaign passes its own, so it collects each module once)."""
    root = config.path(config.kernel_root)
    rootdir = config.rootdir.resolve()
    return load_controls(
        config.path(config.controls_dir),
        root,
        names=config.names,
        collect=collect or Collector(rootdir=rootdir, kernel_root=root),
        rootdir=rootdir,
    )


def run_campaign(config: CampaignConfig, listener: Listener | None = None,
                 cluster: "Cluster | None" = None) -> CampaignResult:
    """The campaign; on a Ray `cluster` (`harness.runs.cluster.connect`) each control's gates
    run on one of its GPU actors, as many controls at once as it has GPUs. Interrupted, it
    leaves no sandbox behind (`harness.runs.sandbox.swept_on_interrupt`)."""
    from harness.runs.sandbox import swept_on_interrupt

    with swept_on_interrupt():
        return _campaign(config, listener, cluster)


def _campaign(config: CampaignConfig, listener: Listener | None, cluster: "Cluster | None") -> CampaignResult:
    if config.kill_row not in KILL_ROWS:
        raise ValueError(f"kill_row {config.kill_row!r} is not one of {', '.join(KILL_ROWS)}")
    listener = listener or _Quiet()
    start = time.perf_counter()
    child.reset()
    listener.phase("validating controls")
    root = config.path(config.kernel_root)
    collect = Collector(rootdir=config.rootdir.resolve(), kernel_root=root)
    controls = validate(config, collect)
    listener.total(len(controls))
    cache_dir = config.cache()
    if config.static:
        from harness.compiling.arch import resolve_arch

        arch = resolve_arch(config.arch)
        names = declared_names(root)
        results = []
        for control in controls:
            listener.started(control)
            result = _static(control, root, arch, cache_dir, names)
            listener.finished(result)
            results.append(result)
        return CampaignResult(mode="static", kernel_root=root, arch=arch, baseline=None, controls=tuple(results),
                              seconds=time.perf_counter() - start)

    mode = "naive" if config.naive else "campaign"
    targets = {c.name: _targets(c, controls, config) for c in controls}
    baseline_targets = sorted({t for ts in targets.values() for t in ts})
    listener.phase(f"baseline: {len(baseline_targets)} module(s), unperturbed")
    baseline = _baseline(baseline_targets, root, config, cache_dir)
    if not baseline.ok:
        return CampaignResult(mode=mode, kernel_root=root, arch=config.arch, baseline=baseline, controls=(),
                              seconds=time.perf_counter() - start)
    arch = config.arch or baseline.arch
    names = declared_names(root)
    warm = (_warm_controls(config, root, cache_dir, baseline_targets, arch, collect, cluster)
            if (config.executor == "warm" or cluster is not None) and not config.naive else None)

    # Up to `jobs` controls at once, in file order, slot i on its own GPU where several are
    # visible. Controls whose gate modules overlap run at once too: each has its own sandbox
    # copy, its own run and report folder; the cubin cache they share is content-addressed
    # and written by atomic rename.
    jobs = 1 if config.naive else cluster.gpus if cluster is not None else max(1, config.jobs)
    devices = slot_devices(jobs)
    results: dict[str, ControlResult] = {}

    def one(control: Control, slot: int) -> ControlResult:
        listener.started(control)
        return _run_control(control, targets[control.name], root, config, arch, cache_dir, names, devices[slot], warm)

    def done(control: Control, result: ControlResult) -> None:
        results[control.name] = result
        listener.finished(result)

    try:
        run_in_slots(from_list(controls), jobs, one, done, on_abort=warm.close if warm else None, name="control")
    finally:
        if warm is not None:
            warm.close()
    return CampaignResult(mode=mode, kernel_root=root, arch=arch, baseline=baseline,
                          controls=tuple(results[c.name] for c in controls), seconds=time.perf_counter() - start)


def _targets(control: Control, controls: list[Control], config: CampaignConfig) -> tuple[str, ...]:
    if config.naive:
        # the naive way: every gate under the folders holding the expected modules
        return tuple(sorted({Path(m).parts[0] for c in controls for m in c.modules}))
    if config.kill_row == "campaign":
        return tuple(sorted({m for c in controls for m in c.modules}))
    return control.modules


def _baseline(targets: list[str], root: Path, config: CampaignConfig, cache_dir: Path) -> Baseline:
    with _cache(config, cache_dir) as cache:
        run = run_gates(
            targets,
            kernel_root=root,
            rootdir=config.rootdir,
            report_dir=config.path(config.report_dir) / "runs" / "baseline",
            deadline=config.deadline * BASELINE_DEADLINE_FACTOR,
            cache_dir=cache,
            require_gpu=config.require_gpu,
            arch=config.arch,
            spawn=config.naive,  # the naive way: a new interpreter a run
        )
    return Baseline.of(run)


@contextmanager
def _cache(config: CampaignConfig, cache_dir: Path):
    """The shared cache folder, or (naive) a cold one made and removed per run."""
    if not config.naive:
        yield cache_dir
        return
    with temp_folder("naive-cache") as cold:
        yield cold


# ---------------------------------------------------------------- one control


def _static(control: Control, root: Path, arch: str | None, cache_dir: Path, names) -> ControlResult:
    start = time.perf_counter()
    with sandbox(root, control.name) as copy:
        invalid = _apply_and_compile(control, copy, arch, cache_dir, names)
    if isinstance(invalid, str):
        return _invalid(control, invalid, time.perf_counter() - start)
    return ControlResult(
        control.name, control.description, control.why, control.edits,
        verdict=None, matches=True, checks=(), kill_row=(),
        seconds=time.perf_counter() - start, compiled=invalid,
    )


def perturb(copy: Path, control: Control) -> dict[str, str]:
    """Apply the control's edits to the sandbox copy; returns {relpath: perturbed text}.
    Raises EditError when an edit does not apply exactly once (the kernel changed since
    validation, or two edits collide)."""
    copy = Path(copy).resolve()
    perturbed = apply(control.edits, {f: (copy / f).read_text(encoding="utf-8") for f in control.files})
    for rel, text in perturbed.items():
        write(copy, rel, text)
    return perturbed


def _apply_and_compile(control: Control, copy: Path, arch, cache_dir: Path, names) -> str | tuple[str, ...]:
    """The compiled modules, or the reason the control is invalid."""
    try:
        perturb(copy, control)
    except EditError as exc:
        return f"{control.edit_key(exc.index, exc.key)}: {exc}"
    check = compile_perturbed(copy, control.files, arch=arch, cache_dir=cache_dir, names=names)
    if not check.modules:
        return (
            f"no .cu under the kernel root includes {', '.join(control.files)}: "
            "the perturbation reaches no kernel; edit a .cu or a header one includes"
        )
    if not check.ok:
        # paths relative to the kernel root, not the sandbox; NVRTC logs can end in a NUL
        log = check.error.replace(f"{copy}/", "").replace("\x00", "")
        errors = [line.strip() for line in log.splitlines() if "error" in line and "(" in line]
        first = errors[0] if errors else log.splitlines()[0]
        return f"does not compile: {first}\n{log}"
    return check.modules


def _invalid(control: Control, note: str, seconds: float, log: Path | None = None) -> ControlResult:
    return ControlResult(
        control.name, control.description, control.why, control.edits,
        verdict=Verdict.COMPILE_ERROR, matches=False, checks=(), kill_row=(),
        seconds=seconds, note=note, log=log,
    )


def _run_control(
    control: Control,
    targets: tuple[str, ...],
    root: Path,
    config: CampaignConfig,
    arch: str | None,
    cache_dir: Path,
    names: dict,
    device: str | None,
    warm: "WarmControls | None" = None,
) -> ControlResult:
    start = time.perf_counter()
    with sandbox(root, control.name) as copy, _cache(config, cache_dir) as cache:
        if config.naive:
            try:
                perturb(copy, control)
            except EditError as exc:
                return _invalid(control, f"{control.edit_key(exc.index, exc.key)}: {exc}", time.perf_counter() - start)
            compiled: tuple[str, ...] = ()
        else:
            outcome = _apply_and_compile(control, copy, arch, cache, names)
            if isinstance(outcome, str):
                return _invalid(control, outcome, time.perf_counter() - start)
            compiled = outcome
        remaining = max(1.0, config.deadline - (time.perf_counter() - start))
        if warm is not None:
            run = warm.executor(device).run(copy, warm.nodeids(targets), remaining)
            result = _classify(control, run, compiled, time.perf_counter() - start, config.require_gpu)
            return replace(result, ran_on=(run.facts or {}).get("ran_on"))
        run = run_gates(
            list(targets),
            kernel_root=copy,
            rootdir=config.rootdir,
            report_dir=config.path(config.report_dir) / "runs" / control.name,
            deadline=remaining,
            cache_dir=cache,
            require_gpu=config.require_gpu,
            arch=arch,
            device=device,
            spawn=config.naive,
        )
    return _classify(control, run, compiled, time.perf_counter() - start, config.require_gpu)


@dataclass
class WarmControls:
    """The controls on the warm executors the mutation campaign uses, one per GPU (on a Ray
    cluster: one actor per GPU holding one): each control's gates (its modules' whole kill
    row) in a worker forked from a server that collected them, context made ahead; a worker
    serves control after control, reset between them as between mutants, and is replaced
    when a gate poisons it."""

    executors: "ExecutorFactory"
    cache_dir: Path
    arch: str | None
    gates: dict  # module -> its node ids, in collection order

    def executor(self, device: str | None) -> "Executor":
        return self.executors(None, self.cache_dir, self.arch, device)

    def nodeids(self, targets: tuple[str, ...]) -> list[str]:
        return [n for t in targets for n in self.gates.get(t, ())]

    def close(self) -> None:
        for ex in self.executors.made.values():
            ex.close()


def _warm_controls(config: CampaignConfig, root: Path, cache_dir: Path, targets: list[str],
                   arch: str | None, collect: Collector, cluster: "Cluster | None" = None) -> WarmControls:
    from harness.runs.warm import WarmExecutors

    collected, error = collect(targets)
    if error:
        raise RuntimeError(f"collecting the controls' gates failed:\n{error}")
    gates: dict = {}
    for nodeid in sorted(collected):
        gates.setdefault(nodeid.split("::", 1)[0], []).append(nodeid)
    if cluster is not None:
        from harness.runs.ray_executor import RayExecutors

        executors = RayExecutors(cluster, tuple(targets), root, stop_on_kill=False)
    else:
        executors = WarmExecutors(config.rootdir.resolve(), tuple(targets), root, max(1, config.jobs),
                                  stop_on_kill=False)
    return WarmControls(executors, cache_dir, arch, gates)


def _classify(control: Control, run: GateRuns, compiled: tuple[str, ...], seconds: float,
              device: bool = True) -> ControlResult:
    if run.timed_out:
        checks = tuple(
            GateCheck(e.gate, e.route, e.message, Route.TIMEOUT, Route.TIMEOUT, None, False, "the run hit the deadline")
            for e in control.expects
        )
        verdict, matches = Verdict.TIMEOUT, False
    else:
        records = run.records
        if run.crashed:
            # the run died before it reported: red, but not by any gate's assertion
            records = {e.gate: GateRecord(e.gate, Outcome.ERROR, Route.ERROR, run.crashed, run.crashed)
                       for e in control.expects}
        checks = tuple(check_gate(e, records.get(e.gate)) for e in control.expects)
        if not device:
            checks = judged_without_device(checks)
        verdict, matches = decide(checks, device)
    return ControlResult(
        control.name, control.description, control.why, control.edits,
        verdict=verdict, matches=matches, checks=checks, kill_row=run.red,
        seconds=seconds, compiled=compiled, note=run.note(), log=Path(run.log) if run.log else None,
    )
