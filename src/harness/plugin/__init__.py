"""The pytest plugin: options, markers, the require-gpu policy, trap and sticky-error
isolation, failure routes, reports and the terminal summary. In lifecycle order.

Installed, the plugin loads in every pytest run of the environment, so it stays inert until
a project opts in (`opt_in_reason`): a harness ini key, a harness command-line option (or
HARNESS_REQUIRE_GPU / HARNESS_KERNEL_ROOT), or a collected item that can only be a gate
(`harness.core.kinds.claim`: a kind marker or a harness fixture, never a common name such as `gpu`).
Inert, it imports nothing heavy, checks nothing and writes nothing. Active, it owns the gates
only; every other test runs as plain pytest runs it.

Its state is in the config's stash (`harness.plugin.state`): the process's `Role`, the run's
`HarnessRun` once opted in (its `Settings`, bound as the settings in effect for the session),
the pool's `GpuGates`, the `Recorder` of verdicts. Its features (bit snapshots, the comparison,
shards) are plugins of their own that talk to it through `harness.plugin.hookspecs`, never its state.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from harness.core import device, settings as _settings, usage
from harness.core.errors import as_pytest_usage
from harness.core.gate_reports import properties, props_of, synthetic
from harness.core.kinds import (MARKERS, REQUIRE_GPU_ENV, check_kinds, claim, foreign_markers, gate_key, is_gate,
                                is_gpu, opt_in_reason, owned)
from harness.core.records import Outcome, Route
from harness.library import coverage
from harness.plugin import cufiles
from harness.plugin.options import check_configuration, deadline_value, pytest_addoption, setting_notes  # noqa: F401
from harness.plugin.pool import (claim_lanes, lanes_wanted, new_pool, plan_lanes, probe_beside_xdist,
                                 refuse_without_device, run_in_pool, run_lanes, start_pool)
from harness.plugin.report import classify_route, failure_message, first_line, write_reports
from harness.plugin.state import GpuGates, HarnessRun, Role, gpu_key, harness_run, role_key, run_key
from harness.plugin.verdicts import Recorder, run_facts, worker_reports

# bit snapshots (and the line an update run ends with), comparisons, --shard and the redzones' gate
# hooks, features of their own
pytest_plugins = ["harness.plugin.snapshots", "harness.plugin.snapshot_tally", "harness.plugin.compare",
                  "harness.plugin.shard", "harness.plugin.redzones"]


def pytest_addhooks(pluginmanager: pytest.PytestPluginManager) -> None:
    from harness.plugin import hookspecs

    pluginmanager.add_hookspecs(hookspecs)


# ------------------------------------------------------------------ configure


def _trace(event: str) -> None:
    """One line of the pool's timeline (HARNESS_POOL_TRACE): this process's events and its children's."""
    if os.environ.get(_settings.TRACE_ENV):  # read here so an inert run never imports the pool
        from harness.pool import channel

        channel.trace(event)


_trace("plugin imported")  # the first line fixes the time base its children share


def _ini(config: pytest.Config):
    def read(key: str):
        value = config.getini(key)
        return value or None
    return read


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    for name, text in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {text}")
    if config.option.harness_child_timeout is not None:
        raise as_pytest_usage("--harness-child-timeout was removed: every GPU gate now runs under a per-gate deadline; pass "
                     "--harness-deadline S (or the ini key harness_deadline)")
    role = config.stash[role_key] = Role.of(config)
    reason = opt_in_reason(config)
    if reason is not None:
        _activate(config, reason, before_collection=True)
    elif role.xdist_controller:
        config.pluginmanager.register(_GateWatcher(config), "harness-gate-watcher")


_settings_token = pytest.StashKey[object]()  # the binding of the run's settings, undone at unconfigure


def _activate(config: pytest.Config, reason: str, before_collection: bool) -> None:
    """Make this a harness run: check and resolve its settings once, bind them for the
    session, record the gates' verdicts; where a GPU may be and collection is still ahead,
    fork the pool's server."""
    from harness.core.settings import IncludeDirError
    from harness.core.usage import UsageError
    from harness.pool import channel, server

    opt = config.option
    role = config.stash[role_key]
    lanes_wanted(role, opt.sanitize, config)  # a bad --harness-lanes or ini harness_lanes is one usage error, now
    if opt.no_fail_fast:
        opt.maxfail = 0
    if role.serving:
        opt.xmlpath = None  # a server or worker writes no report of its own: the process that owns it does
    else:
        check_configuration(config)  # bad options and environment: one line, before any work
    try:
        project = _settings.resolve(kernel_root=opt.kernel_root, cache_dir=opt.harness_cache_dir, arch=opt.arch,
                                    include_dir=opt.include_dir, deadline=opt.harness_deadline,
                                    sanitize=bool(opt.sanitize), sweep_budget=opt.sweep_budget,
                                    sweep_replay=opt.sweep_replay, redzones=bool(opt.redzones) and not opt.no_redzones,
                                    rootdir=config.rootpath, ini=_ini(config),
                                    cache_option="--harness-cache-dir")
    except (IncludeDirError, UsageError) as exc:
        raise as_pytest_usage(exc) from None
    settings = project.settings
    notes = [] if role.serving else setting_notes(config, role, project.gate_paths)
    if project.kernel_root_explicit and not role.serving:
        # Named on the command line or in the environment, a folder with no .cu is a slip; named
        # in the ini, it need only exist (a project may configure its tree before its first kernel).
        named_in_ini = project.kernel_root_source.startswith("ini ")
        problem = usage.kernel_root_problem(settings.kernel_root, project.kernel_root_source,
                                            needs_cu=not named_in_ini)
        if problem:
            raise as_pytest_usage(problem)
        empty = usage.kernel_root_problem(settings.kernel_root, project.kernel_root_source) if named_in_ini else None
        if empty:  # it runs, but compiles nothing: the summary says so in one line
            notes.append(f"harness: {empty}")
    if project.cache_source != "the default" and not role.serving:
        problem = usage.folder_problem(settings.cache_dir, project.cache_source, "the compiled cubins")
        if problem:
            raise as_pytest_usage(problem)
    if opt.arch:
        from harness.compiling.arch import ArchError, check_arch

        try:
            check_arch(opt.arch)
        except ArchError as exc:
            raise as_pytest_usage(exc) from None
    sanitizer_cmd = None
    if opt.sanitize and not role.serving:
        from harness.pool import sanitizer

        try:
            sanitizer_cmd = tuple(sanitizer.command(opt.sanitize, sanitizer.find_binary()))
        except sanitizer.SanitizerError as exc:
            raise as_pytest_usage(exc) from None
    run = config.stash[run_key] = HarnessRun(
        opted_in_by=reason, role=role, settings=settings, gate_paths=project.gate_paths,
        require_gpu=bool(opt.require_gpu) or os.environ.get(REQUIRE_GPU_ENV, "") not in ("", "0"),
        sanitize=opt.sanitize, sanitizer_cmd=sanitizer_cmd,
        report_dir=Path(opt.harness_report) if opt.harness_report and not role.serving else None,
        shard=str(opt.shard) if getattr(opt, "shard", None) else None,
        shadow_traps=not opt.harness_real_traps, notes=tuple(notes))
    config.stash[_settings_token] = _settings.bind(settings)  # what launchers read, for this session
    gpu = config.stash[gpu_key] = GpuGates()
    if role.xdist_controller and (run.require_gpu or run.sanitize):
        probe_beside_xdist(run, config)  # no CUDA context lives here
    recorder = config.stash[recorder_key] = Recorder(run, gpu)
    config.pluginmanager.register(recorder, "harness-recorder")
    _trace("configured")
    if role.serving and channel.is_server():
        server.server_configured()
    elif (before_collection and not role.serving and not role.xdist_controller and sanitizer_cmd is None
          and not opt.collectonly and device._driver_present()):
        # Where a GPU may be, the server imports CuPy while this process collects. Forked from
        # here, before any collection: it has this process's imports and conftests already.
        gpu.pool = new_pool(run, config, fork=True)


def pytest_unconfigure(config: pytest.Config) -> None:
    if config.stash.get(run_key, None) is None:
        if config.pluginmanager.has_plugin("harness-gate-watcher"):
            config.pluginmanager.unregister(name="harness-gate-watcher")
        if role_key in config.stash:
            del config.stash[role_key]
        return
    gpu = config.stash.get(gpu_key, None)
    if gpu is not None:
        gpu.close()
    recorder = config.stash.get(recorder_key, None)
    if recorder is not None:
        config.pluginmanager.unregister(recorder)
    token = config.stash.get(_settings_token, None)
    if token is not None:
        _settings.unbind(token)
    for key in (recorder_key, gpu_key, run_key, _settings_token, role_key):
        if key in config.stash:
            del config.stash[key]


# ------------------------------------------------------------------ collecting .cu files (compile gates)


def pytest_collect_file(file_path: Path, parent):
    if file_path.suffix != ".cu" or harness_run(parent.config) is None:
        return None
    return cufiles.collect_file(file_path, parent)


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    rep = yield
    if harness_run(collector.config) is not None:
        cufiles.add_unreached(collector, rep)
    return rep


# ------------------------------------------------------------------ the pool and the require-gpu policy


@pytest.hookimpl(trylast=True, specname="pytest_collection_modifyitems")
def pytest_collection_modifyitems_in_pool_order(session: pytest.Session, config: pytest.Config,
                                                items: list[pytest.Item]) -> None:
    """The run's order beside the pool (`harness.plugin.pool.pool_order`): this process's own
    items first, then the ordinary GPU gates, then the trap gates."""
    run = harness_run(config)
    if run is None or not run.role.runs_gates or run.role.xdist_worker or run.sanitize \
            or config.stash[gpu_key].pool is None:
        return
    from harness.plugin.pool import pool_order

    items[:] = pool_order(items, lambda it: owned(it) and is_gpu(it))


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    foreign = foreign_markers(config)  # harness marker names the project registers as its own
    if harness_run(config) is None:
        why = next(((it, reason) for it in items if (reason := claim(it, foreign))), None)
        if why is None:
            return  # no harness option, ini key or item that can only be a gate: this run is plain pytest's
        # (no ini key opted it in, so there are no harness_gates paths: activation adds no gate)
        _activate(config, f"{why[0].nodeid} {why[1]}", before_collection=False)
    run, gpu = config.stash[run_key], config.stash[gpu_key]
    gates = [it for it in items if is_gate(it, run.gate_paths, foreign)]
    check_kinds(gates, foreign)  # one kind marker per gate, as --strict-markers for names
    for it in gates:
        it.stash[gate_key] = True
        if it.get_closest_marker("deadline") is not None:
            gate_deadline(it, run)  # a bad value is a usage error now, not mid-run (nor never, where GPU gates skip)
    if run.role.serving:
        return
    from harness.pool import controller

    gpu_items = [it for it in gates if is_gpu(it)]
    gpu.selected = len(gpu_items)
    if (not gpu_items and not run.require_gpu) or config.option.collectonly:  # nothing to run on a device
        if gpu.pool is not None:
            gpu.pool.close()
            gpu.pool = None
        return
    _trace("collected")
    # A feature that runs the gates in workers of its own (a comparison): the pool only probes
    # the device and claims the run's lanes, then closes, so none of its workers sits idle.
    taken = bool(config.hook.pytest_harness_takes_gates(config=config))
    start_pool(gpu, run, config, gpu_items or items, workers=not taken)
    try:
        gpu.probe = gpu.pool.wait_probe()
    except controller.PoolError as exc:
        gpu.probe = {"count": 0, "error": str(exc)}
    _trace("probe answered")
    probe = gpu.probe
    device.adopt_probe(device.DeviceProbe(count=probe.get("count", 0), name=probe.get("name"),
                                          arch=probe.get("arch"), error=probe.get("error")))
    usable = probe.get("error") is None and probe.get("count", 0) > 0
    if not usable:
        gpu.pool.close()
        gpu.pool = None
        refuse_without_device(run, probe)
        skip = pytest.mark.skip(reason=f"GPU gate: {probe.get('error')}; pass --require-gpu to make this a failure")
        for it in gpu_items:
            it.add_marker(skip)
        return
    count = probe.get("count", 1)
    if run.role.xdist_worker:
        # The probe's count is the truth: it corrects the hint for the spares started from now.
        gpu.pool.config.device_ordinal = (device.ordinal_for_xdist_worker(
            config.workerinput.get("workerid", "gw0"), count) if count > 1 else None)
    claim_lanes(gpu, run, config, gpu_items)  # its share of the machine, before its workers' contexts
    if taken:
        gpu.pool.close()  # its claim stays until the session's end: the feature's workers run on it
        gpu.pool = None
        return
    gpu.pool.warm_up()
    if run.sanitize:
        skip = pytest.mark.skip(reason=f"trap gate: its device guard's __trap() is itself a {run.sanitize} finding, "
                                       "so trap gates do not run under --sanitize")
        for it in gpu_items:
            if it.get_closest_marker("trap"):
                it.add_marker(skip)


# ------------------------------------------------------------------ running gates


def gate_deadline(item: pytest.Item, run: HarnessRun) -> tuple[float, str]:
    """A GPU gate's deadline and where it came from: its `@pytest.mark.deadline(S)`, else the
    run's (`Settings.deadline`)."""
    marker = item.get_closest_marker("deadline")
    if marker is not None:
        raw = marker.args[0] if marker.args else marker.kwargs.get("seconds")
        from harness.core.usage import UsageError, positive_seconds

        try:
            return positive_seconds(str(raw), "@pytest.mark.deadline", "",
                                    fix="write e.g. @pytest.mark.deadline(120)"), "its deadline marker"
        except UsageError as exc:
            raise as_pytest_usage(f"{item.nodeid}: {exc}") from None
    return run.settings.deadline, run.settings.deadline_source


# The run loop is this module's alone: a pool's server or worker serves instead of looping
# (`pytest_runtestloop_of_a_server`); elsewhere a feature may take the gates
# (`pytest_harness_gate_loop`: a comparison) while pytest's loop runs the other items.


@pytest.hookimpl(tryfirst=True, specname="pytest_runtestloop")
def pytest_runtestloop_of_a_server(session: pytest.Session):
    """In a pool's server: fork workers on request; in an exec'd worker: run gates on request."""
    run = harness_run(session.config)
    if run is None or not run.role.serving:
        return None
    from harness.pool import channel, server, worker as pool_worker

    if channel.is_server():
        server.serve(session)
    else:
        pool_worker.exec_worker_loop(session)
    return True


@pytest.hookimpl(wrapper=True)
def pytest_runtestloop(session: pytest.Session):
    config = session.config
    run = harness_run(config)
    loop = None
    if run is not None and not run.role.serving and not config.option.collectonly:
        gpu = config.stash[gpu_key]
        loop = config.hook.pytest_harness_gate_loop(session=session, run=run, device_ready=gpu.device_ready,
                                                    lanes=run_lanes(gpu, run, config))
    if loop is None:
        return (yield)
    items = session.items
    gates = [it for it in items if owned(it)]
    session.items = [it for it in items if not owned(it)]
    try:
        done = yield
    finally:
        session.items = items
    loop(gates, len(items) - len(gates))
    return done


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem) -> bool | None:
    """GPU gates run in the pool's workers under the watchdog (`run_in_pool`); the lanes are
    planned at the run's first item, whatever it is."""
    run = harness_run(item.config)
    if run is None or run.role.serving:
        return None
    gpu = item.config.stash[gpu_key]
    if gpu.pool is not None and not gpu.lanes_planned:  # the run's first item
        gpu.lanes_planned = True
        gpu.lanes = plan_lanes(gpu, run, item, lambda it: gate_deadline(it, run), owned)
    if gpu.pool is None or not owned(item) or not is_gpu(item) or item.get_closest_marker("skip"):
        return None
    from harness.pool import controller

    trap = item.get_closest_marker("trap") is not None
    deadline, source = gate_deadline(item, run)
    reached = time.monotonic()
    item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
    _trace(f"gate {item.nodeid}")
    recorder = item.config.stash[recorder_key]
    try:
        worker, result = run_in_pool(gpu, run, item, nextitem, trap, deadline)
    except controller.PoolError as exc:
        reports = synthetic(item, Outcome.FAILED.value, str(exc), [("route", Route.ERROR.value),
                                                                   ("first_failure_line", str(exc).splitlines()[0])])
    else:
        # What the gate cost this run: how long it waited here (a trap gate started ahead
        # may have finished before it was reached).
        result.waited = time.monotonic() - reached
        reports = worker_reports(gpu, recorder, item, result, trap, deadline, source, worker)
    for rep in reports:
        item.ihook.pytest_runtest_logreport(report=rep)
    # The item was never set up here, but fixtures of earlier items that `nextitem` does not
    # share (a module's, when this gate ends its module) must still be torn down now.
    item.session._setupstate.teardown_exact(nextitem)
    item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
    return True


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    if owned(item):
        coverage.begin(item.nodeid)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    if not owned(item):  # an ordinary test: its reports are pytest's own
        yield
        return
    if call.when == "setup":
        # On the item, so every phase's report (and JUnit's <properties>) carries them.
        item.user_properties.extend(properties(item))
    outcome = yield
    rep = outcome.get_result()
    if call.when == "teardown":
        # What the gate loaded and read, in the process that ran it (a worker, for GPU gates).
        rep.user_properties.extend(coverage.properties(item.nodeid))
    if "harness.library.kernels" in sys.modules:  # the options each module this gate loaded was compiled with
        used = sys.modules["harness.library.kernels"].take_used()
        if used:
            rep.user_properties.append(("compile_options", json.dumps(used)))
    if rep.failed and call.excinfo is not None:
        exc = call.excinfo.value
        props = [("route", classify_route(exc).value), ("first_failure_line", first_line(exc))]
        from harness.pool import channel

        if is_gpu(item) and channel.is_worker():
            _trace(f"  {call.when} failed: {type(exc).__name__}")
            # Only a CUDA error can poison the context; then ask the device whether it did.
            if device.is_cuda_error(exc) and (device.is_sticky_error(exc) or device.context_is_poisoned()):
                props.append(("poisoned_context", "true"))
        item.user_properties.extend(props)
        rep.user_properties.extend(props)
        # The whole message, for controls whose expected substring is not on the first line.
        # A report attribute, not a property: it travels through xdist but stays out of JUnit.
        rep.harness_failure_message = failure_message(exc)


# ------------------------------------------------------------------ collecting verdicts


recorder_key = pytest.StashKey[Recorder]()


class _GateWatcher:
    """xdist's controller collects nothing, so it learns that gates exist from the first
    report its workers send for one (they carry a `kind` property)."""

    def __init__(self, config: pytest.Config):
        self.config = config

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_logreport(self, report) -> None:
        if harness_run(self.config) is not None or "kind" not in props_of(report):
            return
        self.config.pluginmanager.unregister(self)
        _activate(self.config, f"{report.nodeid} is a gate (an xdist worker collected it as one)", before_collection=False)
        self.config.stash[recorder_key].pytest_runtest_logreport(report)


# ------------------------------------------------------------------ finishing


def pytest_sessionstart(session: pytest.Session) -> None:
    run = harness_run(session.config)
    if run is not None and not run.role.serving:
        _trace("session start")  # where pytest's own "passed in N s" starts counting


def pytest_sessionfinish(session: pytest.Session, exitstatus) -> None:
    config = session.config
    run = harness_run(config)
    if run is None:
        return
    _trace("session finish")
    gpu = config.stash[gpu_key]
    gpu.stop_ahead()
    if gpu.gate_times is not None:
        gpu.gate_times.save()  # the next run's split (harness.pool.lanes)
    if gpu.pool is not None:
        gpu.close()
        _trace("pool closed")
    if not run.role.reports:
        return
    recorder = config.stash[recorder_key]
    records = list(recorder.records.values())
    if run.report_dir is not None:
        facts = run_facts(run, gpu, recorder, records)
        for r in records:
            if r.gpu:
                r.device = r.device or facts.device
                r.compile_options = r.compile_options or facts.compile_options  # its modules' own, when known
            else:
                r.device = None
        write_reports(run.report_dir, records, facts)
        _trace("reports written")
    if run.require_gpu and not config.option.collectonly and exitstatus not in (pytest.ExitCode.INTERRUPTED,
                                                                                pytest.ExitCode.USAGE_ERROR):
        executed = sum(1 for r in records if r.gpu and r.outcome in (Outcome.PASSED, Outcome.FAILED))
        if executed == 0:
            recorder.no_gpu_executed = True
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter, exitstatus, config: pytest.Config) -> None:
    run = harness_run(config)
    if run is None or not run.role.reports:
        return
    from harness.plugin.summary import render_summary

    _trace("terminal summary")
    recorder = config.stash[recorder_key]
    render_summary(terminalreporter, run, recorder)
    _trace("terminal summary written")


# ------------------------------------------------------------------ fixtures


@pytest.fixture(scope="session")
def kernel_root() -> Path:
    """The kernel root in effect: launchers and structural gates read .cu files from here."""
    return _settings.in_effect().kernel_root


@pytest.fixture(scope="session")
def gpu_device():
    """The probed device; using this fixture does not mark a gate `gpu` by itself."""
    return device.probe()
