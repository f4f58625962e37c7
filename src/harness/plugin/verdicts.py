"""A gate's verdict in the plugin: the reports made for a GPU gate judged outside pytest's own
protocol (a pool worker's result, a timeout, a trap gate), and the recorder that folds every
gate's phase reports into one GateRecord (ordinary tests counted apart) and owns what the run's
verdicts add up to (a poisoned context, the sanitizer's findings, the launches counted)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import pytest

from harness.core.gate_reports import props_of, synthetic
from harness.core.records import GUARD_DID_NOT_FIRE, GateRecord, Outcome, Route, fold_report, trap_verdict
from harness.plugin.report import RunFacts

if TYPE_CHECKING:
    from harness.plugin.state import GpuGates, HarnessRun
    from harness.pool import controller


def worker_reports(gpu: GpuGates, recorder: "Recorder", item: pytest.Item, result: controller.RunResult, trap: bool,
                   deadline: float, source: str, worker: controller.Worker) -> list:
    """The phase reports of a GPU gate run in a pool worker: its own, or ones made here for a
    timeout, a dead worker or a trap gate's verdict."""
    from harness.pool.controller import Ending

    facts = [("worker", worker.name)]
    if result.phases:
        facts.append(("worker_phases", " ".join(f"{k}={v:g}" for k, v in result.phases.items())))
    if worker.device:
        facts += [("device", worker.device.get("name", "")), ("device_ordinal", str(worker.device.get("ordinal", ""))),
                  ("device_uuid", worker.device.get("uuid", ""))]
    if result.ending is Ending.TIMED_OUT:
        launched = (f"the last kernel launched was {result.last_launch}" if result.last_launch
                    else "no kernel had been launched through harness.library.kernels yet")
        text = (f"timeout: the gate did not finish within its deadline of {deadline:g} s ({source}); {launched}. "
                "Its worker process was killed and replaced; the other gates keep their own verdicts. "
                "A kernel that never returns (a spin in a reduction, a barrier some threads skip) looks like this; "
                "raise the deadline with @pytest.mark.deadline(S) or --harness-deadline S only if the gate is "
                "just slow.")
        line = f"timeout after {deadline:g} s ({source}); last kernel launched: {result.last_launch or 'none'}"
        return synthetic(item, Outcome.FAILED.value, text,
                         facts + [("route", Route.TIMEOUT.value), ("first_failure_line", line)],
                         duration=result.seconds)
    if result.ending is Ending.STOPPED:
        kernel, where = result.hung_in
        line = f"stopped at its launch of {kernel}, which hung in {where}"
        text = (f"not waited for: this gate launched {kernel}, the last kernel launched when {where} ran past its "
                f"deadline earlier in this run, so its worker was stopped at that launch rather than waited for to "
                f"its own deadline of {deadline:g} s (N gates that launch a hung kernel would cost N deadlines to say "
                f"one thing). This is no verdict on the gate's property: fix the hang, or run this gate alone "
                f"(pytest '{item.nodeid}') or with --harness-wait-hung to see its own verdict.")
        return synthetic(item, Outcome.FAILED.value, text,
                         facts + [("route", Route.ERROR.value), ("first_failure_line", line)],
                         duration=result.seconds)
    if result.ending is Ending.DIED:
        tail = gpu.pool.log_tail() if gpu.pool is not None else ""
        text = f"{result.why}; the worker's output ended:\n{tail}" if tail else result.why
        return synthetic(item, Outcome.FAILED.value, text,
                         facts + [("route", Route.ERROR.value), ("first_failure_line", result.why)],
                         duration=result.seconds)
    config = item.config
    reports = [report_from_worker(config, d) for d in result.reports]
    if not reports:
        text = f"the worker did not collect {item.nodeid}: its collection differs from this process's"
        return synthetic(item, Outcome.FAILED.value, text,
                         facts + [("route", Route.ERROR.value), ("first_failure_line", text)])
    recorder.launches += result.launches
    if not trap:
        for rep in reports:
            rep.user_properties.append(("worker", worker.name))
        return reports
    if result.unsettled:
        facts.append(("trap_shadow_unsettled", result.unsettled))
    return judge_trap(item, reports, facts, result.waited, result.shadow_hits)


def report_from_worker(config, data: dict):
    """A report the worker serialised, as pytest's own. The channel is JSON, so a skip's
    longrepr, the tuple (path, line, reason), arrives as a list; pytest's terminal summary
    (`-rs`, `-rA`) asserts it is a tuple, and would end the run with an internal error."""
    rep = config.hook.pytest_report_from_serializable(config=config, data=data)
    if isinstance(rep.longrepr, list):
        rep.longrepr = tuple(rep.longrepr)
    return rep


def judge_trap(item: pytest.Item, reports: list, facts: list, duration: float, shadow_hits: int | None = None) -> list:
    """A trap gate passes when its body died by a device fault, or counted guards in the trap
    shadow (`shadow_hits`); it fails by assertion when the body returned normally. Setup and
    teardown in the thrown-away worker do not count."""
    call = next((r for r in reports if r.when == "call"), None)
    if call is None:  # setup failed or skipped: that is the verdict, as reported
        for rep in reports:
            rep.user_properties.append(("isolated", "true"))
        return reports
    props = dict((k, v) for k, v in call.user_properties)
    route = props.get("route")
    if call.skipped:
        return reports
    outcome, judged_route, judged = trap_verdict(call.outcome, route, shadow_hits)
    if judged and outcome == Outcome.FAILED:
        return synthetic(item, Outcome.FAILED.value, f"AssertionError: {GUARD_DID_NOT_FIRE}",
                          facts + [("route", judged_route), ("first_failure_line", GUARD_DID_NOT_FIRE)],
                          duration=duration)
    if judged:
        shadow = [("trap_shadow_hits", str(shadow_hits))] if shadow_hits else []
        return synthetic(item, Outcome.PASSED.value, None, facts + shadow, duration=duration)
    line = props.get("first_failure_line") or "the trap gate failed in its fresh worker process"
    text = (f"the device guard did not fire as a trap; the gate failed by route {route}: {line}\n\n"
            f"{call.longrepr}")
    return synthetic(item, Outcome.FAILED.value, text,
                     facts + [("route", route or Route.ERROR.value), ("first_failure_line", line)],
                     duration=duration, message=getattr(call, "harness_failure_message", None))


class Recorder:
    """Folds setup/call/teardown reports (local, from the pool's workers, or from xdist
    workers) into one GateRecord per gate, and what they add up to for the run."""

    def __init__(self, run: HarnessRun, gpu: GpuGates):
        self.run, self.gpu = run, gpu
        self.records: dict[str, GateRecord] = {}
        self.others: dict[str, GateRecord] = {}  # ordinary tests (not gates), folded only for the summary's count
        self.poisoned_by: str | None = None  # the first gate that poisoned its worker's CUDA context
        self.sanitizer_findings = 0  # gates red by route sanitizer
        self.launches = 0  # kernel launches the pool's workers counted
        self.no_gpu_executed = False  # --require-gpu, and no GPU gate ran (set at the session's end)

    def pytest_runtest_logreport(self, report) -> None:
        props = props_of(report)
        if "kind" not in props:  # an ordinary test: counted apart, never a gate record
            fold_report(self.others.setdefault(report.nodeid, GateRecord(report.nodeid)), report)
            return
        rec = self.records.get(report.nodeid)
        if rec is None:
            rec = self.records[report.nodeid] = GateRecord(
                nodeid=report.nodeid, module=report.nodeid.split("::")[0], kind=None, gpu=False)
        if "kind" in props:
            rec.kind = None if props["kind"] == "other" else props["kind"]
            rec.gpu = props.get("gpu") == "true"
        rec.isolated = rec.isolated or props.get("isolated") == "true"
        if props.get("trap_shadow_hits", "").isdigit():
            rec.trap_shadow_hits = int(props["trap_shadow_hits"])
        rec.trap_shadow_unsettled = props.get("trap_shadow_unsettled") or rec.trap_shadow_unsettled
        rec.memory_safety = rec.memory_safety or props.get("memory_safety") == "true"
        rec.names_faults = rec.names_faults or props.get("names_faults") == "true"
        for key in ("modules_loaded", "sources_read", "kernels_launched"):
            if props.get(key):
                getattr(rec, key).extend(x for x in props[key].split() if x not in getattr(rec, key))
        if props.get("oracle"):
            rec.oracle = props["oracle"]
            rec.compared = [c for c in props.get("compared", "").split(" | ") if c]
        if props.get("compile_options"):
            used = json.loads(props["compile_options"])
            rec.compile_options = (list(next(iter(used.values()))) if len(used) == 1 else
                                   [f"{m}: {' '.join(o)}" for m, o in sorted(used.items())])
        for key in ("worker", "device", "device_ordinal", "device_uuid", "worker_phases"):
            if props.get(key):
                setattr(rec, key, int(props[key]) if key == "device_ordinal" and props[key].isdigit() else props[key])
        if props.get("poisoned_context") == "true" and self.poisoned_by is None:
            self.poisoned_by = report.nodeid
        was_red = rec.red
        fold_report(rec, report)
        if rec.red and not was_red and rec.route == Route.SANITIZER:
            self.sanitizer_findings += 1


def run_facts(run: HarnessRun, gpu: GpuGates, recorder: Recorder, records: list[GateRecord]) -> RunFacts:
    """The run's facts for its reports."""
    from harness.compiling.arch import resolve_arch
    from harness.compiling.options import recorded_options

    try:
        arch = resolve_arch(None, run.settings)
        options = list(recorded_options(arch))
    except Exception:
        arch, options = run.settings.arch, []
    seen = {}
    for r in records:
        if r.gpu and r.device_uuid is not None:
            seen[(r.device_ordinal, r.device_uuid)] = r.device
    devices = [{"ordinal": o, "uuid": u, "name": n} for (o, u), n in sorted(seen.items(), key=lambda kv: str(kv[0]))]
    probe = gpu.probe or {}
    name = probe.get("name") if probe.get("error") is None else None
    if name is None:
        name = next((r.device for r in records if r.gpu and r.device), None)
    return RunFacts(device=name, arch=arch, kernel_root=str(run.settings.kernel_root), compile_options=options,
                    require_gpu=run.require_gpu, poisoned_by=recorder.poisoned_by, devices=devices,
                    sanitizer=run.sanitize, shard=run.shard)
