"""The pytest plugin: options, markers, the require-gpu policy, trap and sticky-error
isolation, failure routes, reports and the terminal summary. In lifecycle order.

Installed, the plugin loads in every pytest run of the environment, so it stays inert until
a project opts in (`opt_in_reason`): a harness ini key, a harness command-line option (or
HARNESS_REQUIRE_GPU / HARNESS_KERNEL_ROOT), or a collected item that can only be a gate
(`harness.kinds.claim`: a kind marker or a harness fixture, never a common name such as `gpu`). Inert, it imports nothing heavy, checks nothing and writes
nothing. Active, it owns the gates only; every other test runs as plain pytest runs it."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from harness import _settings, coverage, cufiles, device, usage
from harness._settings import GATES_INI
from harness.gate_verdicts import Recorder, is_gpu, properties, props_of, run_facts, synthetic, worker_reports
from harness.kinds import (MARKERS, REQUIRE_GPU_ENV, check_kinds, claim, foreign_markers, gate_key, is_gate,
                           opt_in_reason, owned)
from harness.plugin_pool import (lanes_wanted, new_pool, plan_lanes, probe_beside_xdist, refuse_without_device, run_in_pool,
                                 start_pool)
from harness.records import GateRecord, Outcome, Route
from harness.report import classify_route, failure_message, first_line, write_reports

# bit snapshots (and the line an update run ends with), comparisons and --shard, features of their own
pytest_plugins = ["harness.snapshots", "harness.snapshot_tally", "harness.compare", "harness.shard"]
if TYPE_CHECKING:
    from harness.pool import controller

DEFAULT_DEADLINE = 120.0  # seconds a GPU gate may take before the watchdog kills its worker
SANITIZER_DEADLINE_FACTOR = 10  # a default deadline stretches under --sanitize (an explicit one does not)


def deadline_value(text: str) -> float:
    """argparse type for a deadline: a finite number of seconds above zero."""
    from harness.usage import UsageError, positive_seconds

    try:
        return positive_seconds(text, "--harness-deadline", "120")
    except UsageError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None

# ------------------------------------------------------------------ options


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


# ------------------------------------------------------------------ state

state_key = pytest.StashKey["HarnessState"]()


class HarnessState:
    def __init__(self, config: pytest.Config):
        opt = config.option
        self.active = False  # opted in (opt_in_reason, or a gate among the collected items)
        self.opted_in_by: str | None = None
        self.gate_paths: tuple[Path, ...] = ()
        self.require_gpu = bool(opt.require_gpu) or os.environ.get(REQUIRE_GPU_ENV, "") not in ("", "0")
        self.serving = bool(opt.harness_serve)  # a pool server or an exec'd worker: runs no gate loop
        self.is_worker = hasattr(config, "workerinput")  # an xdist worker
        self.is_controller = not self.is_worker and bool(getattr(opt, "numprocesses", None)) \
            and getattr(opt, "dist", "no") != "no"
        self.report_dir = Path(opt.harness_report) if opt.harness_report else None
        self.sanitize: str | None = opt.sanitize
        self.shard: str | None = str(opt.shard) if getattr(opt, "shard", None) else None  # K/N (harness.shard)
        self.sanitizer_cmd: list[str] | None = None
        self.deadline, self.deadline_source = DEFAULT_DEADLINE, "the default"
        self.records: dict[str, GateRecord] = {}
        self.others: dict[str, GateRecord] = {}  # ordinary tests (not gates), folded only for the summary's count
        self.poisoned_by: str | None = None
        self.kernel_root: Path = Path()
        self.arch: str | None = None
        self.gpu_selected = 0
        self.no_gpu_executed = False
        self.pool: controller.Pool | None = None
        self.pool_error: str | None = None
        self.probe: dict | None = None
        self.launches = 0
        self.sanitizer_findings = 0
        self.traps = None  # harness.pool.traps.TrapsAhead: trap gates started ahead on spares
        self.shadow_traps = not opt.harness_real_traps  # trap gates run in the trap shadow (harness.trap_shadow)
        self.shadow_worker = None  # outside the trap lane (xdist): the worker trap gates run in the shadow in
        self.lanes = None  # harness.pool.lanes.Lanes, False where the run takes one lane; None: not planned yet
        self.gate_times = None  # harness.pool.lanes.GateTimes: what each GPU gate took, for the next split
        self.notes: list[str] = []  # lines the summary says of a setting that runs but means less than it seems


def _resolve_deadline(config: pytest.Config, sanitize: str | None) -> tuple[float, str]:
    if config.option.harness_deadline is not None:
        return config.option.harness_deadline, "--harness-deadline"
    ini = str(config.getini("harness_deadline") or "").strip()
    if ini:
        from harness.usage import UsageError, positive_seconds

        try:
            return positive_seconds(ini, "ini harness_deadline", "", fix="set e.g. harness_deadline = 120"), \
                "ini harness_deadline"
        except UsageError as exc:
            raise pytest.UsageError(f"harness: {exc}") from None
    if sanitize:
        return DEFAULT_DEADLINE * SANITIZER_DEADLINE_FACTOR, "the default under --sanitize"
    return DEFAULT_DEADLINE, "the default"


def _trace(event: str) -> None:
    """One line of the pool's timeline (HARNESS_POOL_TRACE): this process's events and its children's."""
    if os.environ.get(_settings.TRACE_ENV):  # read here so an inert run never imports the pool
        from harness.pool import channel

        channel.trace(event)


_trace("plugin imported")  # the first line fixes the time base its children share


def _state(config: pytest.Config) -> HarnessState:
    return config.stash[state_key]


def _ini(config: pytest.Config):
    def read(key: str):
        value = config.getini(key)
        return value or None
    return read


# ------------------------------------------------------------------ configure


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    for name, text in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {text}")
    if config.option.harness_child_timeout is not None:
        raise pytest.UsageError("harness: --harness-child-timeout was removed: every GPU gate now runs under a "
                                "per-gate deadline; pass --harness-deadline S (or the ini key harness_deadline)")
    st = HarnessState(config)
    config.stash[state_key] = st
    reason = opt_in_reason(config)
    if reason is not None:
        _activate(config, reason, before_collection=True)
    elif st.is_controller:
        config.pluginmanager.register(_GateWatcher(config), "harness-gate-watcher")


def _activate(config: pytest.Config, reason: str, before_collection: bool) -> None:
    """Make this a harness run: check the settings, hand them to the launchers, record the
    gates' verdicts; where a GPU may be and collection is still ahead, fork the pool's server."""
    from harness.pool import channel, server

    st = _state(config)
    st.active, st.opted_in_by = True, reason
    st.deadline, st.deadline_source = _resolve_deadline(config, st.sanitize)
    lanes_wanted(st, config)  # a bad --harness-lanes or ini harness_lanes is one usage error, now
    if config.option.no_fail_fast:
        config.option.maxfail = 0
    if st.serving:
        # A server or worker writes no report of its own: the pytest process that owns it does.
        config.option.xmlpath = None
        st.report_dir = None
    else:
        usage.check_configuration(config)  # bad options and environment: one line, before any work
    from harness.toolchain import IncludeDirError

    try:
        project = _settings.resolve(kernel_root=config.option.kernel_root, cache_dir=config.option.harness_cache_dir,
                                    arch=config.option.arch, include_dir=config.option.include_dir,
                                    rootdir=config.rootpath, ini=_ini(config), cache_option="--harness-cache-dir")
    except IncludeDirError as exc:
        raise pytest.UsageError(f"harness: {exc}") from None
    st.kernel_root, st.gate_paths = project.settings.kernel_root, project.gate_paths
    if not st.serving:
        st.notes += _setting_notes(config, st)
    if project.kernel_root_explicit and not st.serving:
        # Named on the command line or in the environment, a folder with no .cu is a slip; named
        # in the ini, it need only exist (a project may configure its tree before its first kernel).
        named_in_ini = project.kernel_root_source.startswith("ini ")
        problem = usage.kernel_root_problem(st.kernel_root, project.kernel_root_source, needs_cu=not named_in_ini)
        if problem:
            raise pytest.UsageError(f"harness: {problem}")
        empty = usage.kernel_root_problem(st.kernel_root, project.kernel_root_source) if named_in_ini else None
        if empty:  # it runs, but compiles nothing: the summary says so in one line
            st.notes.append(f"harness: {empty}")
    if project.cache_source != "the default" and not st.serving:
        problem = usage.folder_problem(project.settings.cache_dir, project.cache_source, "the compiled cubins")
        if problem:
            raise pytest.UsageError(f"harness: {problem}")
    if config.option.arch:
        from harness.arch import ArchError, check_arch

        try:
            check_arch(config.option.arch)
        except ArchError as exc:
            raise pytest.UsageError(f"harness: {exc}") from None
    st.arch = config.option.arch
    _settings.configure(kernel_root=st.kernel_root, arch=config.option.arch, cache_dir=project.settings.cache_dir,
                        include_dirs=project.settings.include_dirs)
    if st.sanitize and not st.serving:
        from harness import sanitizer

        try:
            st.sanitizer_cmd = sanitizer.command(st.sanitize, sanitizer.find_binary())
        except sanitizer.SanitizerError as exc:
            raise pytest.UsageError(f"harness: {exc}") from None
    if st.is_controller and (st.require_gpu or st.sanitize):
        probe_beside_xdist(st, config)  # no CUDA context lives here
    recorder = Recorder(st)
    config.stash[recorder_key] = recorder
    config.pluginmanager.register(recorder, "harness-recorder")
    _trace("configured")
    if st.serving and channel.is_server():
        server.server_configured()
    elif (before_collection and not st.serving and not st.is_controller and st.sanitizer_cmd is None
          and not config.option.collectonly and device._driver_present()):
        # Where a GPU may be, the server imports CuPy while this process collects. Forked from
        # here, before any collection: it has this process's imports and conftests already.
        st.pool = new_pool(st, config, fork=True)


def _setting_notes(config: pytest.Config, st: HarnessState) -> list[str]:
    """Settings that run but mean less than they seem, each a line for the summary."""
    notes = []
    for path in st.gate_paths:
        if not path.exists():
            shown = path.relative_to(config.rootpath) if path.is_relative_to(config.rootpath) else path
            notes.append(f"harness: ini harness_gates names {shown} ({path}), which does not exist: no test is a gate "
                         "by it; fix the path, or remove it")
    if config.option.harness_lanes and st.is_controller:
        notes.append(f"harness: --harness-lanes {config.option.harness_lanes} has no effect under xdist (-n): each "
                     "xdist worker runs its GPU gates on a worker of its own, in order; drop -n to spread them over "
                     "lanes")
    return notes


def pytest_unconfigure(config: pytest.Config) -> None:
    st = config.stash.get(state_key, None)
    if st is not None and not st.active:
        if config.pluginmanager.has_plugin("harness-gate-watcher"):
            config.pluginmanager.unregister(name="harness-gate-watcher")
        del config.stash[state_key]
        return
    if st is not None and st.pool is not None:
        st.pool.close()
        st.pool = None
    recorder = config.stash.get(recorder_key, None)
    if recorder is not None:
        config.pluginmanager.unregister(recorder)
        del config.stash[recorder_key]
    if state_key in config.stash:
        del config.stash[state_key]
    _settings.reset()


# ------------------------------------------------------------------ collecting .cu files (compile gates)


def pytest_collect_file(file_path: Path, parent):
    st = parent.config.stash.get(state_key, None)
    if st is None or not st.active or file_path.suffix != ".cu":
        return None
    return cufiles.collect_file(file_path, parent)


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    rep = yield
    st = collector.config.stash.get(state_key, None)
    if st is not None and st.active:
        cufiles.add_unreached(collector, rep)
    return rep


# ------------------------------------------------------------------ the pool and the require-gpu policy


@pytest.hookimpl(trylast=True, specname="pytest_collection_modifyitems")
def pytest_collection_modifyitems_in_pool_order(session: pytest.Session, config: pytest.Config,
                                                items: list[pytest.Item]) -> None:
    """The run's order beside the pool (`harness.plugin_pool.pool_order`): this process's own
    items first, then the ordinary GPU gates, then the trap gates."""
    st = _state(config)
    if not st.active or st.serving or st.is_worker or st.is_controller or st.sanitize or st.pool is None:
        return
    from harness.plugin_pool import pool_order

    items[:] = pool_order(items, lambda it: owned(it) and is_gpu(it))


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    st = _state(config)
    foreign = foreign_markers(config)  # harness marker names the project registers as its own
    if not st.active:
        why = next(((it, reason) for it in items if (reason := claim(it, foreign))), None)
        if why is None:
            return  # no harness option, ini key or item that can only be a gate: this run is plain pytest's
        # (no ini key opted it in, so there are no harness_gates paths: activation adds no gate)
        _activate(config, f"{why[0].nodeid} {why[1]}", before_collection=False)
    gates = [it for it in items if is_gate(it, st.gate_paths, foreign)]
    check_kinds(gates, foreign)  # one kind marker per gate, as --strict-markers for names
    for it in gates:
        it.stash[gate_key] = True
        if it.get_closest_marker("deadline") is not None:
            _deadline(it)  # a bad value is a usage error now, not mid-run (nor never, where GPU gates skip)
    if st.serving:
        return
    from harness.pool import controller

    gpu_items = [it for it in gates if is_gpu(it)]
    st.gpu_selected = len(gpu_items)
    if (not gpu_items and not st.require_gpu) or config.option.collectonly:  # nothing to run on a device
        if st.pool is not None:
            st.pool.close()
            st.pool = None
        return
    _trace("collected")
    start_pool(st, config, gpu_items or items)
    try:
        st.probe = st.pool.wait_probe()
    except controller.PoolError as exc:
        st.probe = {"count": 0, "error": str(exc)}
    _trace("probe answered")
    device.adopt_probe(device.DeviceProbe(count=st.probe.get("count", 0), name=st.probe.get("name"),
                                          arch=st.probe.get("arch"), error=st.probe.get("error")))
    usable = st.probe.get("error") is None and st.probe.get("count", 0) > 0
    if not usable:
        st.pool.close()
        st.pool = None
        refuse_without_device(st, st.probe)
        skip = pytest.mark.skip(reason=f"GPU gate: {st.probe.get('error')}; pass --require-gpu to make this a failure")
        for it in gpu_items:
            it.add_marker(skip)
        return
    count = st.probe.get("count", 1)
    if st.is_worker:
        # The probe's count is the truth: it corrects the hint for the spares started from now.
        st.pool.config.device_ordinal = (device.ordinal_for_xdist_worker(
            config.workerinput.get("workerid", "gw0"), count) if count > 1 else None)
    st.pool.warm_up()
    if st.sanitize:
        skip = pytest.mark.skip(reason=f"trap gate: its device guard's __trap() is itself a {st.sanitize} finding, "
                                       "so trap gates do not run under --sanitize")
        for it in gpu_items:
            if it.get_closest_marker("trap"):
                it.add_marker(skip)


# ------------------------------------------------------------------ running gates


def _deadline(item: pytest.Item) -> tuple[float, str]:
    st = _state(item.config)
    marker = item.get_closest_marker("deadline")
    if marker is not None:
        raw = marker.args[0] if marker.args else marker.kwargs.get("seconds")
        from harness.usage import UsageError, positive_seconds

        try:
            return positive_seconds(str(raw), "@pytest.mark.deadline", "",
                                    fix="write e.g. @pytest.mark.deadline(120)"), "its deadline marker"
        except UsageError as exc:
            raise pytest.UsageError(f"harness: {item.nodeid}: {exc}") from None
    return st.deadline, st.deadline_source


@pytest.hookimpl(tryfirst=True)
def pytest_runtestloop(session: pytest.Session):
    """In a pool's server: fork workers on request. In an exec'd worker: run gates on request."""
    st = _state(session.config)
    if not st.active or not st.serving:
        return None
    from harness.pool import channel, worker as pool_worker, server

    if channel.is_server():
        server.serve(session)
    else:
        pool_worker.exec_worker_loop(session)
    return True


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem) -> bool | None:
    """GPU gates run in the pool's workers under the watchdog (`run_in_pool`); the lanes are
    planned at the run's first item, whatever it is."""
    st = _state(item.config)
    if st.active and not st.serving and st.pool is not None and st.lanes is None:  # the run's first item
        st.lanes = plan_lanes(st, item, _deadline, owned) or False
    if not st.active or st.serving or st.pool is None or not owned(item) or not is_gpu(item) \
            or item.get_closest_marker("skip"):
        return None
    from harness.pool import controller

    trap = item.get_closest_marker("trap") is not None
    deadline, source = _deadline(item)
    reached = time.monotonic()
    item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
    _trace(f"gate {item.nodeid}")
    try:
        worker, result = run_in_pool(st, item, nextitem, trap, deadline)
    except controller.PoolError as exc:
        reports = synthetic(item, Outcome.FAILED.value, str(exc), [("route", Route.ERROR.value),
                                                                   ("first_failure_line", str(exc).splitlines()[0])])
    else:
        # What the gate cost this run: how long it waited here (a trap gate started ahead
        # may have finished before it was reached).
        result.waited = time.monotonic() - reached
        reports = worker_reports(st, item, result, trap, deadline, source, worker)
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
    if "harness.kernels" in sys.modules:  # the options each module this gate loaded was compiled with
        used = sys.modules["harness.kernels"].take_used()
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
        st = self.config.stash.get(state_key, None)
        if st is None or st.active or "kind" not in props_of(report):
            return
        self.config.pluginmanager.unregister(self)
        _activate(self.config, f"{report.nodeid} is a gate (an xdist worker collected it as one)", before_collection=False)
        self.config.stash[recorder_key].pytest_runtest_logreport(report)


# ------------------------------------------------------------------ finishing


def pytest_sessionstart(session: pytest.Session) -> None:
    st = _state(session.config)
    if st.active and not st.serving:
        _trace("session start")  # where pytest's own "passed in N s" starts counting


def pytest_sessionfinish(session: pytest.Session, exitstatus) -> None:
    config = session.config
    st = _state(config)
    if not st.active:
        return
    _trace("session finish")
    if st.traps is not None:
        st.traps.kill_all()
    if st.lanes:
        st.lanes.stop()
    if st.gate_times is not None:
        st.gate_times.save()  # the next run's split (harness.pool.lanes)
    if st.pool is not None:
        st.pool.close()
        st.pool = None
        _trace("pool closed")
    if st.serving or st.is_worker:
        return
    records = list(st.records.values())
    if st.report_dir is not None:
        facts = run_facts(st, records)
        for r in records:
            if r.gpu:
                r.device = r.device or facts.device
                r.compile_options = r.compile_options or facts.compile_options  # its modules' own, when known
            else:
                r.device = None
        write_reports(st.report_dir, records, facts)
        _trace("reports written")
    if st.require_gpu and not config.option.collectonly and exitstatus not in (pytest.ExitCode.INTERRUPTED,
                                                                               pytest.ExitCode.USAGE_ERROR):
        executed = sum(1 for r in records if r.gpu and r.outcome in (Outcome.PASSED, Outcome.FAILED))
        if executed == 0:
            st.no_gpu_executed = True
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter, exitstatus, config: pytest.Config) -> None:
    st = _state(config)
    if not st.active or st.serving or st.is_worker:
        return
    from harness.summary import render_summary

    _trace("terminal summary")
    render_summary(terminalreporter, list(st.records.values()), st)
    _trace("terminal summary written")


# ------------------------------------------------------------------ fixtures


@pytest.fixture(scope="session")
def kernel_root() -> Path:
    """The active kernel root: launchers and structural gates read .cu files from here."""
    return _settings.current().kernel_root


@pytest.fixture(scope="session")
def gpu_device():
    """The probed device; using this fixture does not mark a gate `gpu` by itself."""
    return device.probe()
