"""The campaign: validate every control, run the baseline, then each control in a sandbox.

    validate -> baseline (unperturbed, must be all green) -> per control:
    sandbox copy -> apply edits exactly once -> compile the perturbed modules once
    -> fresh pytest over the control's gate modules -> classify -> ControlResult

`--static` stops after the compile. `--naive` runs the same campaign the slow way (a
fresh pytest over the whole gates folder per control, each with a cold compile cache),
so the two can be timed against each other on the device.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from harness import _settings
from harness.runs import fresh as child
from harness.runs.fresh import GateRun, run_gates
from harness.controls.classify import GateCheck, Verdict, check_gate, decide, judged_without_device
from harness.controls.collect import collect_gates
from harness.controls.compilecheck import compile_perturbed, declared_names
from harness.controls.edits import EditError
from harness.controls.results import BaselineResult, CampaignResult, ControlResult
from harness.controls.sandbox import perturb, sandbox
from harness.controls.spec import Control, load_controls
from harness.records import GateRecord

KILL_ROWS = ("modules", "campaign")
# The baseline runs every module of the campaign, usually with a cold compile cache.
BASELINE_DEADLINE_FACTOR = 4


@dataclass(frozen=True)
class CampaignConfig:
    rootdir: Path  # where pytest runs; node ids are relative to it
    kernel_root: Path
    controls_dir: Path
    report_dir: Path
    names: tuple[str, ...] = ()
    arch: str | None = None
    deadline: float = 300.0  # seconds per control
    jobs: int = 1
    static: bool = False
    naive: bool = False
    require_gpu: bool = True  # False: --no-require-gpu, GPU gates skipped and controls judged by the rest
    kill_row: str = "modules"  # run the expected gates' modules, or every module of the campaign
    cache_dir: Path | None = None  # default: HARNESS_CACHE_DIR or the harness' cache
    executor: str = "fresh"  # fresh: a pytest per control; warm: a fresh forked worker per control (the mutants' way)

    def path(self, p: Path) -> Path:
        p = Path(p)
        return (p if p.is_absolute() else self.rootdir / p).resolve()


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


def validate(config: CampaignConfig) -> list[Control]:
    """Every control in the folder, validated; the selected ones. Raises ControlSpecError."""
    root = config.path(config.kernel_root)
    rootdir = config.rootdir.resolve()
    return load_controls(
        config.path(config.controls_dir),
        root,
        names=config.names,
        collect=lambda modules: collect_gates(modules, rootdir=rootdir, kernel_root=root),
        rootdir=rootdir,
    )


def run_campaign(config: CampaignConfig, listener: Listener | None = None) -> CampaignResult:
    if config.kill_row not in KILL_ROWS:
        raise ValueError(f"kill_row {config.kill_row!r} is not one of {', '.join(KILL_ROWS)}")
    listener = listener or _Quiet()
    start = time.perf_counter()
    child.reset()
    listener.phase("validating controls")
    controls = validate(config)
    listener.total(len(controls))
    root = config.path(config.kernel_root)
    cache_dir = config.path(config.cache_dir) if config.cache_dir else _settings.current().cache_dir
    if config.static:
        from harness.arch import resolve_arch

        arch = resolve_arch(config.arch)
        names = declared_names(root)
        results = []
        for control in controls:
            listener.started(control)
            result = _static(control, root, arch, cache_dir, names)
            listener.finished(result)
            results.append(result)
        return CampaignResult("static", root, arch, None, tuple(results), time.perf_counter() - start)

    mode = "naive" if config.naive else "campaign"
    targets = {c.name: _targets(c, controls, config) for c in controls}
    baseline_targets = sorted({t for ts in targets.values() for t in ts})
    listener.phase(f"baseline: {len(baseline_targets)} module(s), unperturbed")
    baseline = _baseline(baseline_targets, root, config, cache_dir)
    if not baseline.ok:
        return CampaignResult(mode, root, config.arch, baseline, (), time.perf_counter() - start)
    arch = config.arch or baseline.arch
    names = declared_names(root)
    warm = (_warm_controls(config, root, cache_dir, baseline_targets, arch)
            if config.executor == "warm" and not config.naive else None)

    def one(control: Control, device: str | None) -> ControlResult:
        listener.started(control)
        result = _run_control(control, targets[control.name], root, config, arch, cache_dir, names, device, warm)
        listener.finished(result)
        return result

    jobs = 1 if config.naive else max(1, config.jobs)
    try:
        if jobs == 1:
            results = [one(c, None) for c in controls]
        else:
            results = _parallel(controls, targets, jobs, one)
    finally:
        if warm is not None:
            warm.executor.close()
    return CampaignResult(mode, root, arch, baseline, tuple(results), time.perf_counter() - start)


def _targets(control: Control, controls: list[Control], config: CampaignConfig) -> tuple[str, ...]:
    if config.naive:
        # the naive way: every gate under the folders holding the expected modules
        return tuple(sorted({Path(m).parts[0] for c in controls for m in c.modules}))
    if config.kill_row == "campaign":
        return tuple(sorted({m for c in controls for m in c.modules}))
    return control.modules


def _baseline(targets: list[str], root: Path, config: CampaignConfig, cache_dir: Path) -> BaselineResult:
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
        )
    report = run.report or {}
    note = run.note()
    if note is None and not run.records:
        note = f"the baseline ran no gate; see {run.log}"
    return BaselineResult(
        gates=len(run.records),
        red=run.red,
        seconds=run.seconds,
        arch=report.get("arch"),
        device=report.get("device"),
        log=run.log,
        note=note,
    )


class _cache:
    """The shared cache folder, or (naive) a cold one made and removed per run."""

    def __init__(self, config: CampaignConfig, cache_dir: Path):
        self.naive = config.naive
        self.cache_dir = cache_dir
        self.tmp: str | None = None

    def __enter__(self) -> Path:
        if self.naive:
            self.tmp = tempfile.mkdtemp(prefix="harness-naive-cache-")
            return Path(self.tmp)
        return self.cache_dir

    def __exit__(self, *exc) -> None:
        if self.tmp:
            shutil.rmtree(self.tmp, ignore_errors=True)


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
        verdict=Verdict.INVALID, matches=False, checks=(), kill_row=(),
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
            return _classify(control, _warm_run(warm, copy, targets, remaining), compiled,
                             time.perf_counter() - start, config.require_gpu)
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
        )
    return _classify(control, run, compiled, time.perf_counter() - start, config.require_gpu)


@dataclass
class WarmControls:
    """The controls on the mutation campaign's warm executor: each control's gates (its
    modules' whole kill row) in a worker forked from a server that collected them, context
    made ahead; a worker serves control after control, reset between them as between
    mutants (harness.pool.worker.reset_for_next_mutant), and is replaced when a gate poisons it."""

    executor: object  # harness.runs.warm.WarmExecutor
    gates: dict  # module -> its node ids, in collection order

    def nodeids(self, targets: tuple[str, ...]) -> list[str]:
        return [n for t in targets for n in self.gates.get(t, ())]


def _warm_controls(config: CampaignConfig, root: Path, cache_dir: Path, targets: list[str],
                   arch: str | None) -> WarmControls:
    from harness.runs.warm import WarmExecutor

    collected, error = collect_gates(targets, rootdir=config.rootdir.resolve(), kernel_root=root)
    if error:
        raise RuntimeError(f"collecting the controls' gates failed:\n{error}")
    gates: dict = {}
    for nodeid in sorted(collected):
        gates.setdefault(nodeid.split("::", 1)[0], []).append(nodeid)
    executor = WarmExecutor(config.rootdir.resolve(), tuple(targets), root, cache_dir, arch=arch,
                            spares=max(1, config.jobs) + 2, stop_on_kill=False)
    return WarmControls(executor, gates)


def _warm_run(warm: WarmControls, copy: Path, targets: tuple[str, ...], deadline: float) -> GateRun:
    """A control's run on the warm executor, as a GateRun the classification reads."""
    start = time.perf_counter()
    runs = warm.executor.run(copy, warm.nodeids(targets), deadline)
    records = {o.nodeid: o for o in runs.outcomes if o.outcome != "not run"}
    report = None if runs.crashed else {"gates": [r.to_json() for r in records.values()]}
    return GateRun(records, None if runs.timed_out else (0 if report is not None else 1), runs.timed_out,
                   time.perf_counter() - start, Path(runs.log or "."), report)


def _classify(control: Control, run: GateRun, compiled: tuple[str, ...], seconds: float,
              device: bool = True) -> ControlResult:
    if run.timed_out:
        checks = tuple(
            GateCheck(e.gate, e.route, e.message, "timeout", "timeout", None, False, "the run hit the deadline")
            for e in control.expects
        )
        verdict, matches = Verdict.TIMEOUT, False
    else:
        records = run.records
        if run.report is None:
            # the child died before writing its report: red, but not by any gate's assertion
            died = f"the pytest process died (exit status {run.returncode}) before writing gates.json"
            records = {e.gate: GateRecord(e.gate, "error", "error", died, died) for e in control.expects}
        checks = tuple(check_gate(e, records.get(e.gate)) for e in control.expects)
        if not device:
            checks = judged_without_device(checks)
        verdict, matches = decide(checks, device)
    return ControlResult(
        control.name, control.description, control.why, control.edits,
        verdict=verdict, matches=matches, checks=checks, kill_row=run.red,
        seconds=seconds, compiled=compiled, note=run.note(), log=run.log,
    )


# ---------------------------------------------------------------- parallel controls


def _parallel(controls: list[Control], targets: dict, jobs: int, one) -> list[ControlResult]:
    """Run up to `jobs` controls at once, in file order; with several GPUs each job gets its
    own (CUDA_VISIBLE_DEVICES). Controls whose gate modules overlap run at once too: each
    has its own sandbox copy of the kernel root, its own pytest process (with its own pool
    of worker processes and CUDA contexts) and its own report folder, and the one thing they
    share, the cubin cache, is content-addressed and written by atomic rename."""
    from harness.device import assignable_devices

    devices = assignable_devices()
    slots = list(range(jobs))
    pending = list(controls)
    running: dict = {}  # future -> (control, slot)
    results: dict[str, ControlResult] = {}
    with ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="control") as pool:
        try:
            while pending or running:
                while pending and slots:
                    control = pending.pop(0)
                    slot = slots.pop(0)
                    device = devices[slot % len(devices)] if len(devices) > 1 else None
                    running[pool.submit(one, control, device)] = (control, slot)
                done, _ = wait(list(running), return_when=FIRST_COMPLETED)
                for future in done:
                    control, slot = running.pop(future)
                    results[control.name] = future.result()
                    slots.append(slot)
        except BaseException:
            child.kill_all()
            for future in running:
                future.cancel()
            raise
    return [results[c.name] for c in controls]
