"""The pytest plugin: options, markers, the require-gpu policy, trap and sticky-error
isolation, failure routes, reports and the terminal summary. In lifecycle order."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest

from harness import _settings, device, isolate, usage
from harness.cufiles import pytest_collect_file, pytest_make_collect_report  # noqa: F401  (.cu: compile gates)
from harness.kinds import check_kinds
from harness.report import (MESSAGE_LIMIT, KINDS, GateRecord, RunFacts, classify_route, failure_message, first_line,
                            write_reports)

MARKERS = {
    "gpu": "the gate needs a CUDA device; skipped without one unless --require-gpu, which fails instead",
    "anchor": "compares a GPU arm with closed-form host math (a tolerance only with a written reason)",
    "link": "compares one GPU arm with another, bit for bit",
    "refusal": "asserts a host launcher rejects bad arguments with a pinned message, before any launch",
    "trap": "asserts the kernel's device guard fires; runs in a fresh child process",
    "structural": "reads kernel source text (a constant agrees with its #define); needs no device",
    "compile": "compiles one .cu with NVRTC (collected from the kernel root; no device)",
}

REQUIRE_GPU_ENV = "HARNESS_REQUIRE_GPU"
DEFAULT_CHILD_TIMEOUT = 300.0

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
    group.addoption("--harness-child-timeout", type=float, default=DEFAULT_CHILD_TIMEOUT, metavar="S",
                    help="deadline for a gate run in a child process (trap gates, after a poisoned context)")
    group.addoption("--harness-child-report", default=None, help=argparse.SUPPRESS)
    parser.addini("kernel_root", "folder holding the .cu files, relative to the rootdir", default="kernels_cu")
    parser.addini("controls_dir", "folder of negative-control TOML files, relative to the rootdir", default="controls")
    parser.addini("harness_cache_dir", "compiled cubin cache folder", default="")


# ------------------------------------------------------------------ state

state_key = pytest.StashKey["HarnessState"]()


class HarnessState:
    def __init__(self, config: pytest.Config):
        opt = config.option
        self.require_gpu = bool(opt.require_gpu) or os.environ.get(REQUIRE_GPU_ENV, "") not in ("", "0")
        self.child_report = opt.harness_child_report
        self.is_child = bool(self.child_report)
        self.is_worker = hasattr(config, "workerinput")
        self.report_dir = Path(opt.harness_report) if opt.harness_report else None
        self.child_timeout = opt.harness_child_timeout
        self.records: dict[str, GateRecord] = {}
        self.poisoned_by: str | None = None
        self.kernel_root: Path = Path()
        self.arch: str | None = None
        self.gpu_selected = 0
        self.no_gpu_executed = False


def _state(config: pytest.Config) -> HarnessState:
    return config.stash[state_key]


def _resolve_kernel_root(config: pytest.Config) -> Path:
    if config.option.kernel_root:
        return Path(config.option.kernel_root).resolve()
    env = os.environ.get("HARNESS_KERNEL_ROOT")
    if env:
        return Path(env).resolve()
    return (config.rootpath / config.getini("kernel_root")).resolve()


# ------------------------------------------------------------------ configure


def pytest_configure(config: pytest.Config) -> None:
    for name, text in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {text}")
    st = HarnessState(config)
    config.stash[state_key] = st
    if config.option.no_fail_fast:
        config.option.maxfail = 0
    usage.check_configuration(config)  # bad options and environment: one line, before any work
    st.kernel_root = _resolve_kernel_root(config)
    explicit_root = bool(config.option.kernel_root or os.environ.get("HARNESS_KERNEL_ROOT"))
    if explicit_root and not st.kernel_root.is_dir():
        raise pytest.UsageError(
            f"harness: kernel root {st.kernel_root} does not exist or is not a folder: "
            "pass --kernel-root DIR (or the ini key kernel_root) naming the folder that holds your .cu files"
        )
    cache = config.option.harness_cache_dir or config.getini("harness_cache_dir") or None
    if config.option.arch:
        from harness.compile import ArchError, check_arch

        try:
            check_arch(config.option.arch)
        except ArchError as exc:
            raise pytest.UsageError(f"harness: {exc}") from None
    st.arch = config.option.arch
    _settings.configure(kernel_root=st.kernel_root, arch=config.option.arch,
                        cache_dir=Path(cache).resolve() if cache else None)
    _enforce_require_gpu(st)
    recorder = _Recorder(st)
    config.stash[recorder_key] = recorder
    config.pluginmanager.register(recorder, "harness-recorder")
    if st.is_worker:
        worker = config.workerinput.get("workerid", "gw0")
        device.select_device_for_worker(int(worker[2:]) if worker[2:].isdigit() else 0)


def pytest_unconfigure(config: pytest.Config) -> None:
    recorder = config.stash.get(recorder_key, None)
    if recorder is not None:
        config.pluginmanager.unregister(recorder)
        del config.stash[recorder_key]
    if state_key in config.stash:
        del config.stash[state_key]
    _settings.reset()


# ------------------------------------------------------------------ the require-gpu policy


def _enforce_require_gpu(st: HarnessState) -> None:
    """No device, or one that cannot make a context: the session fails at once."""
    if st.require_gpu and not st.is_worker:
        p = device.probe()
        if not p.usable:
            raise pytest.UsageError(f"harness: --require-gpu: {p.error}")


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    check_kinds(items, config)  # one kind marker per gate, as --strict-markers for names
    st = _state(config)
    gpu_items = [it for it in items if _is_gpu(it)]
    st.gpu_selected = len(gpu_items)
    if not gpu_items or st.require_gpu:
        return
    p = device.probe()
    if p.usable:
        return
    skip = pytest.mark.skip(reason=f"GPU gate: {p.error}; pass --require-gpu to make this a failure")
    for it in gpu_items:
        it.add_marker(skip)


# ------------------------------------------------------------------ running gates


def _is_gpu(item: pytest.Item) -> bool:
    return bool(item.get_closest_marker("gpu") or item.get_closest_marker("trap"))


def _kind(item: pytest.Item) -> str | None:
    for k in KINDS:
        if item.get_closest_marker(k):
            return k
    return None


def _passthrough(config: pytest.Config) -> list[str]:
    st = _state(config)
    args = [f"--kernel-root={st.kernel_root}"]
    if st.arch:
        args.append(f"--arch={st.arch}")
    args.append(f"--harness-cache-dir={_settings.current().cache_dir}")
    if st.require_gpu:
        args.append("--require-gpu")
    return args


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem) -> bool | None:
    """Trap gates, and GPU gates after a poisoned context, run in a fresh child process."""
    st = _state(item.config)
    if st.is_child or not _is_gpu(item) or item.get_closest_marker("skip"):
        return None
    trap = item.get_closest_marker("trap") is not None
    if not trap and st.poisoned_by is None:
        return None
    item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
    result = isolate.run_child(item.nodeid, rootdir=item.config.rootpath, inifile=item.config.inipath,
                               passthrough=_passthrough(item.config),
                               has_xdist=item.config.pluginmanager.hasplugin("xdist"),
                               timeout=st.child_timeout)
    outcome, longrepr, route, line = _judge_child(item, result, trap)
    props = _properties(item) + [("isolated", "true")]
    if route:
        props += [("route", route), ("first_failure_line", line or "")]
    keywords = {k: 1 for k in item.keywords}
    reports = [
        pytest.TestReport(item.nodeid, item.location, keywords, outcome=o, longrepr=lr, when=when,
                   duration=d, user_properties=list(props),
                   harness_failure_message=result.longrepr[:MESSAGE_LIMIT] if o == "failed" else None)
        for when, o, lr, d in (("setup", "passed", None, 0.0), ("call", outcome, longrepr, result.duration),
                               ("teardown", "passed", None, 0.0))
    ]
    for rep in reports:
        item.ihook.pytest_runtest_logreport(report=rep)
    # The item was never set up here, but fixtures of earlier items that `nextitem` does not
    # share (a module's, when this gate ends its module) must still be torn down now.
    item.session._setupstate.teardown_exact(nextitem)
    item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
    return True


def _judge_child(item: pytest.Item, result: isolate.ChildResult, trap: bool):
    """(outcome, longrepr, route, first line) for the parent's report."""
    if result.outcome == "skipped":
        return "skipped", (str(item.path), item.location[1] or 0, result.longrepr or "skipped in child"), None, None
    if trap:
        if result.outcome in ("failed", "error") and result.route == "trap":
            return "passed", None, None, None
        if result.outcome == "passed":
            line = "the device guard did not fire: the gate's body returned normally in its child process"
            return "failed", f"AssertionError: {line}", "assertion", line
        line = result.first_line or "the trap gate failed in its child process"
        text = (f"the device guard did not fire as a trap; the child failed by route "
                f"{result.route}: {line}\n\n{result.longrepr}")
        return "failed", text, result.route or "error", line
    if result.outcome == "passed":
        return "passed", None, None, None
    text = f"(ran in a fresh process: an earlier gate left the CUDA context unusable)\n{result.longrepr}"
    return "failed", text, result.route or "error", result.first_line


def _properties(item: pytest.Item) -> list[tuple[str, str]]:
    props = [("kind", _kind(item) or "other"), ("module", item.nodeid.split("::")[0]),
             ("gpu", "true" if _is_gpu(item) else "false")]
    return props


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    if call.when == "setup":
        # On the item, so every phase's report (and JUnit's <properties>) carries them.
        item.user_properties.extend(_properties(item))
    outcome = yield
    rep = outcome.get_result()
    st = _state(item.config)
    if rep.failed and call.excinfo is not None:
        exc = call.excinfo.value
        props = [("route", classify_route(exc).value), ("first_failure_line", first_line(exc))]
        if _is_gpu(item) and st.poisoned_by is None and not st.is_child:
            # Only a CUDA error can poison the context; then ask the device whether it did.
            if device.is_cuda_error(exc) and (device.is_sticky_error(exc) or device.context_is_poisoned()):
                st.poisoned_by = item.nodeid
                props.append(("poisoned_context", "true"))
        item.user_properties.extend(props)
        rep.user_properties.extend(props)
        # The whole message, for controls whose expected substring is not on the first line.
        # A report attribute, not a property: it travels through xdist but stays out of JUnit.
        rep.harness_failure_message = failure_message(exc)


# ------------------------------------------------------------------ collecting verdicts


def _props(report) -> dict:
    return {k: v for k, v in getattr(report, "user_properties", [])}


class _Recorder:
    """Folds setup/call/teardown reports (local, from xdist workers, or rebuilt from a
    child process) into one GateRecord per gate."""

    def __init__(self, st: HarnessState):
        self.st = st
        self.longreprs: dict[str, str] = {}

    def pytest_runtest_logreport(self, report) -> None:
        st = self.st
        props = _props(report)
        rec = st.records.get(report.nodeid)
        if rec is None:
            rec = st.records[report.nodeid] = GateRecord(
                nodeid=report.nodeid, module=report.nodeid.split("::")[0], kind=None, gpu=False)
        if "kind" in props:
            rec.kind = None if props["kind"] == "other" else props["kind"]
            rec.gpu = props.get("gpu") == "true"
        rec.isolated = rec.isolated or props.get("isolated") == "true"
        if props.get("poisoned_context") == "true" and st.poisoned_by is None:
            st.poisoned_by = report.nodeid
        rec.duration += getattr(report, "duration", 0.0) or 0.0
        if report.skipped and rec.outcome == "passed":
            rec.outcome = "skipped"
            lr = report.longrepr
            rec.skip_reason = lr[2] if isinstance(lr, tuple) and len(lr) == 3 else str(lr)
        elif report.failed and rec.outcome not in ("failed", "error"):
            rec.outcome = "failed" if report.when == "call" else "error"
            rec.route = props.get("route", "error")
            rec.first_failure_line = props.get("first_failure_line")
            rec.failure_message = getattr(report, "harness_failure_message", None) or str(report.longrepr)[:MESSAGE_LIMIT]
            self.longreprs[report.nodeid] = str(report.longrepr)

    def child_verdicts(self) -> dict:
        return {
            nodeid: {"outcome": r.outcome, "route": r.route, "first_line": r.first_failure_line,
                     "longrepr": self.longreprs.get(nodeid, r.skip_reason or "")}
            for nodeid, r in self.st.records.items()
        }


recorder_key = pytest.StashKey[_Recorder]()


# ------------------------------------------------------------------ finishing


def _facts(config: pytest.Config) -> RunFacts:
    from harness.compile import recorded_options, resolve_arch

    st = _state(config)
    p = device.probe() if st.gpu_selected or st.require_gpu else None
    try:
        arch = resolve_arch(st.arch)
        options = list(recorded_options(arch))
    except Exception:
        arch, options = st.arch, []
    return RunFacts(device=p.name if p is not None and p.usable else None, arch=arch,
                    kernel_root=str(st.kernel_root), compile_options=options,
                    require_gpu=st.require_gpu, poisoned_by=st.poisoned_by)


def pytest_sessionfinish(session: pytest.Session, exitstatus) -> None:
    config = session.config
    st = _state(config)
    if st.is_child:
        Path(st.child_report).write_text(json.dumps(config.stash[recorder_key].child_verdicts()))
        return
    if st.is_worker:
        return
    records = list(st.records.values())
    facts = None
    if st.report_dir is not None:
        facts = _facts(config)
        for r in records:
            r.device = facts.device if r.gpu else None
            r.compile_options = facts.compile_options if r.gpu else []
        write_reports(st.report_dir, records, facts)
    if st.require_gpu and exitstatus not in (pytest.ExitCode.INTERRUPTED, pytest.ExitCode.USAGE_ERROR):
        executed = sum(1 for r in records if r.gpu and r.outcome in ("passed", "failed"))
        if executed == 0:
            st.no_gpu_executed = True
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter, exitstatus, config: pytest.Config) -> None:
    st = _state(config)
    if st.is_child or st.is_worker:
        return
    from harness.summary import render_summary

    render_summary(terminalreporter, list(st.records.values()), st)


# ------------------------------------------------------------------ fixtures


@pytest.fixture(scope="session")
def kernel_root() -> Path:
    """The active kernel root: launchers and structural gates read .cu files from here."""
    return _settings.current().kernel_root


@pytest.fixture(scope="session")
def gpu_device():
    """The probed device; using this fixture does not mark a gate `gpu` by itself."""
    return device.probe()
