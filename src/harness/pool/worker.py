"""A worker process: its own CUDA context on its own device, then gates (one at a time, or a
mutant's set) sent by the pytest process, pytest's own reports sent back; between mutants it
resets itself to as good as fresh."""

from __future__ import annotations

import gc
import os
import sys
import time
import types
from pathlib import Path

from harness.core.child import BLAS_THREADS_CHANNEL, SANITIZER_LOG_CHANNEL
from harness.pool.channel import POISONED, ROLE, Channel, ChannelClosed, connect, trace

POOL_RESERVE_MB = 512  # device memory each worker puts in CuPy's pool before its first gate

_last_launch: str | None = None
launches = 0  # kernel launches made through harness.library.kernels in this worker


def _on_launch(name: str) -> None:
    """harness.library.kernels' launch listener in a worker: counts launches (the sanitizer's
    attribution) and tells the watchdog the kernel, so a gate that hangs names it."""
    global _last_launch, launches
    launches += 1
    if ROLE.worker is not None and name != _last_launch:
        _last_launch = name
        trace(f"  launch {name}")
        try:
            ROLE.worker.send({"op": "launch", "name": name})
        except OSError:
            pass


def _listen_to_launches() -> None:
    from harness.library import kernels

    kernels.add_launch_listener(_on_launch)


def probe_dict() -> dict:
    from harness.core import device

    p = device.probe()
    return {"count": p.count, "name": p.name, "arch": p.arch, "error": p.error,
            "devices": [list(d) for d in device.list_devices()] if p.usable else [],
            "memory": device_memory() if p.usable else None}


def device_memory() -> list[int] | None:
    """[free, total] bytes of this process's current device, from the driver (through CuPy):
    what the run's share of lanes is weighed against (harness.pool.share); None where they
    cannot be read (no GPU, a stand-in for one)."""
    try:
        import cupy

        free, total = cupy.cuda.runtime.memGetInfo()
        return [int(free), int(total)]
    except Exception:  # noqa: BLE001 - no driver, no device, no CuPy: no facts
        return None


def become_worker(session, token: int) -> None:
    """This process (forked from the server, or exec'd) becomes worker `token`: its context
    made, it says hello and serves until told to quit; it never returns."""
    ROLE.server = None
    code = 0
    try:
        ROLE.token = token
        _listen_to_launches()
        began = time.monotonic()
        hello = {"role": "worker", "token": token, "pid": os.getpid(), "pgid": None}
        if os.environ.get(SANITIZER_LOG_CHANNEL):
            hello["pgid"] = os.getpgid(0)
        try:
            phases = _prepare_device()
            hello["probe"] = probe_dict()
            hello["device"] = _device_facts()
            phases["probe"] = round(time.monotonic() - began - sum(phases.values()), 4)
            hello["start_phases"] = phases
        except BaseException as exc:
            hello["error"] = f"{type(exc).__name__}: {exc}"
        hello["start_s"] = round(time.monotonic() - began, 4)  # its context and CuPy's warm-up
        trace(f"worker t{token}: ready in {hello['start_s']} s {hello.get('start_phases')}")
        # Connect only once ready: a connection the pool accepts always has its hello waiting.
        ch = connect(ROLE.connect_path)
        ch.send(hello)
        if "error" not in hello:
            ROLE.worker = ch
            _worker_loop(session, ch, hello["device"])
    except BaseException:
        code = 1
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


GPU_WAIT_ENV = "HARNESS_GPU_WAIT"
# How a worker's thread waits for the GPU (the primary context's scheduling flag): the
# driver's default (auto) spins on a core for a process with one context; `block` sleeps
# until the GPU is done, for many workers sharing one GPU and the host's cores.
GPU_WAIT_FLAGS = {"auto": 0x00, "spin": 0x01, "yield": 0x02, "block": 0x04}


def set_gpu_wait(mode: str | None, ordinal: int = 0) -> str | None:
    """Set how this process waits for device `ordinal` (GPU_WAIT_FLAGS), before its primary
    context is made; None when set, else why not (no driver, an unknown mode: the driver's
    default stays, which changes no verdict, only the CPU a wait burns)."""
    if not mode:
        return None
    if mode not in GPU_WAIT_FLAGS:
        return f"{GPU_WAIT_ENV}={mode!r} is not one of {', '.join(GPU_WAIT_FLAGS)}"
    from harness.core.device import _driver_present

    if not _driver_present():
        return None  # no GPU here: nothing waits for one (the worker's probe says so)
    try:
        from cuda.bindings import driver

        (err,) = driver.cuInit(0)
        if err == driver.CUresult.CUDA_SUCCESS:
            err, dev = driver.cuDeviceGet(ordinal)
        if err == driver.CUresult.CUDA_SUCCESS:
            (err,) = driver.cuDevicePrimaryCtxSetFlags(dev, GPU_WAIT_FLAGS[mode])
    except Exception as exc:  # noqa: BLE001 - no driver library, no cuda.bindings
        return f"{type(exc).__name__}: {exc}"
    return None if err == driver.CUresult.CUDA_SUCCESS else f"the driver answered {err}"


# Where several workers share the host's cores (lanes, xdist), each keeps to its share of
# BLAS threads: a worker forked from the pytest process inherits NumPy's OpenBLAS sized for
# every core (the environment variables are read at import, long before the fork), and
# eight workers with a thread a core each, spinning after every call, starve each other.


def limit_blas(value: str | None) -> str | None:
    """Cap this process's BLAS and OpenMP thread pools at `value` threads
    (HARNESS_BLAS_THREADS, through threadpoolctl); None when capped or not asked, else why
    not (the pools stay as they were, which changes no verdict, only the time)."""
    if not value:
        return None
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        return f"{BLAS_THREADS_CHANNEL}={value!r} is not a whole number from 1"
    try:
        from threadpoolctl import threadpool_limits
    except ImportError as exc:
        return f"threadpoolctl is not installed ({exc}): pip install threadpoolctl"
    threadpool_limits(limits=n)  # kept for the process's life: nothing restores it
    return None


def gpu_wait_mode(ordinal: int = 0) -> str | None:
    """The scheduling flag of device `ordinal`'s primary context (a GPU_WAIT_FLAGS name), or
    None when the driver cannot say."""
    try:
        from cuda.bindings import driver

        err, dev = driver.cuDeviceGet(ordinal)
        if err != driver.CUresult.CUDA_SUCCESS:
            return None
        err, flags, _active = driver.cuDevicePrimaryCtxGetState(dev)
    except Exception:  # noqa: BLE001
        return None
    if err != driver.CUresult.CUDA_SUCCESS:
        return None
    return {v: k for k, v in GPU_WAIT_FLAGS.items()}.get(int(flags) & 0x07)


def _prepare_device() -> dict:
    """Make the context now, so the first gate does not pay for it. Under a sanitizer,
    switch CuPy's pools off: one pooled allocation would hide an out-of-bounds access.
    First, how the worker waits for the GPU (HARNESS_GPU_WAIT), which must precede the
    context. Returns the seconds each step took (the worker's hello carries them)."""
    phases = {}
    began = time.monotonic()

    def lap(name: str) -> None:
        nonlocal began
        now = time.monotonic()
        phases[name] = round(now - began, 4)
        began = now

    why_not = set_gpu_wait(os.environ.get(GPU_WAIT_ENV))
    if why_not:
        print(f"harness: the GPU wait mode was not set: {why_not}", file=sys.stderr)
    why_not = limit_blas(os.environ.get(BLAS_THREADS_CHANNEL))
    if why_not:
        print(f"harness: the BLAS threads were not capped: {why_not}", file=sys.stderr)
    try:
        import cupy
    except Exception:
        return phases
    lap("wait_mode")
    if os.environ.get(SANITIZER_LOG_CHANNEL):
        cupy.cuda.set_allocator(None)
        cupy.cuda.set_pinned_memory_allocator(None)
    try:
        cupy.cuda.runtime.free(0)
        lap("context")
        # CuPy loads each of its own kernels on first use: load the common ones now.
        a = cupy.zeros(256, dtype=cupy.float32)
        a.fill(1.0)
        b = cupy.arange(256, dtype=cupy.int32)
        (a + b).sum()
        cupy.asarray(a.get())
        lap("cupy_kernels")
        if not os.environ.get(SANITIZER_LOG_CHANNEL):
            # One allocation now, handed back to CuPy's pool: later buffers are carved out of
            # it instead of each new size costing a cudaMalloc.
            del a, b
            cupy.empty(POOL_RESERVE_MB << 20, dtype=cupy.uint8)  # freed at once: into the pool
        cupy.cuda.runtime.deviceSynchronize()
        lap("pool")
    except Exception:
        pass
    return phases


def _device_facts() -> dict:
    from harness.core import device

    p = device.probe()
    if not p.usable:
        return {}
    facts = device.current_device_facts()
    ordinal = device.first_visible_ordinal()
    if ordinal is not None:
        facts["ordinal"] = ordinal
    mode = gpu_wait_mode()
    if mode:
        facts["gpu_wait"] = mode  # how this worker's thread waits for the GPU (HARNESS_GPU_WAIT)
    return facts


class _Profile:
    """HARNESS_WORKER_PROFILE=DIR: the worker profiles itself (cProfile) and writes
    DIR/worker-PID.prof before it waits for each message (a worker may be killed at any
    time after). For finding where a campaign's time goes; off by default."""

    def __init__(self, folder: str | None):
        self.path = None
        self.prof = None
        if folder:
            import cProfile

            Path(folder).mkdir(parents=True, exist_ok=True)
            self.path = Path(folder) / f"worker-{os.getpid()}.prof"
            self.prof = cProfile.Profile()
            self.prof.enable()

    @classmethod
    def from_environment(cls) -> "_Profile":
        return cls(os.environ.get("HARNESS_WORKER_PROFILE"))

    def dump(self) -> None:
        if self.prof is not None:
            self.prof.disable()
            self.prof.dump_stats(str(self.path))
            self.prof.enable()


class ReportSink:
    def __init__(self):
        self.reports: list = []

    def pytest_runtest_logreport(self, report) -> None:
        self.reports.append(report)


def _worker_loop(session, ch: Channel, facts: dict) -> None:
    """Serve gates and mutants over `ch`; `facts` are the device facts this worker said hello
    with (its gates' reports carry them)."""
    config = session.config
    items = {item.nodeid: item for item in session.items}
    sink = ReportSink()
    config.pluginmanager.register(sink, "harness-worker-sink")
    from harness.pool import sanitizer

    watch = sanitizer.LogWatch.from_environment()
    props = []
    if facts:
        props += [("device", facts.get("name", "")), ("device_ordinal", str(facts.get("ordinal", ""))),
                  ("device_uuid", facts.get("uuid", ""))]
    profile = _Profile.from_environment()
    while True:
        try:
            msg = ch.recv()
        except ChannelClosed:
            break
        profile.dump()
        if msg.get("op") == "quit":
            session._setupstate.teardown_exact(None)
            ch.send({"op": "bye"})
            break
        if msg.get("op") == "run_set":
            reply = run_set(session, items, sink, msg, props)
            why_not = "not asked to serve another mutant"
            if any(o["poisoned"] for o in reply["outcomes"]):
                why_not = POISONED
            elif msg.get("reuse"):
                began = time.monotonic()
                why_not = reset_for_next_mutant(session)
                reply["reset_s"] = round(time.monotonic() - began, 4)
            reply["reusable"] = why_not is None
            reply["why_not_reusable"] = why_not
            ch.send(reply)
            if why_not is None:
                continue
            break  # no cache, buffer or stray store of this mutant outlives it
        if msg.get("op") != "run":
            continue
        item = items.get(msg["nodeid"])
        if item is None:
            ch.send({"op": "done", "reports": [], "missing": True})
            continue
        nextitem = items.get(msg.get("nextid") or "")
        sink.reports.clear()
        before = launches
        try:
            session._setupstate.teardown_exact(item)
        except BaseException:
            pass  # a finaliser of an earlier gate failed; that gate already has its verdict
        trace(f"  run {item.nodeid}")
        hits = None
        if msg.get("trap_shadow"):
            hits = _in_trap_shadow(lambda: config.hook.pytest_runtest_protocol(item=item, nextitem=nextitem))
        else:
            config.hook.pytest_runtest_protocol(item=item, nextitem=nextitem)
        if watch is not None:
            watch.attribute(sink.reports, launches - before)
        out = []
        poisoned = False
        for rep in sink.reports:
            rep.user_properties.extend(props)
            if any(k == "poisoned_context" and v == "true" for k, v in rep.user_properties):
                poisoned = True
            out.append(config.hook.pytest_report_to_serializable(config=config, report=rep))
        phases = {rep.when: round(rep.duration, 4) for rep in sink.reports}
        # Asked to reset after the gate (a trap gate in the trap shadow, on a worker the next
        # one reuses): as good as fresh, or the worker ends here and says why.
        ends = POISONED if poisoned else None
        if ends is None and msg.get("reset"):
            ends = reset_for_next_mutant(session)
        ch.send({"op": "done", "reports": out, "poisoned": poisoned, "launches": launches - before,
                 "phases": phases, "shadow_hits": hits, "ends": ends})
        if ends is not None:
            break


def _outcome(item, reports: list, shadow_hits: int | None = None) -> dict:
    """One gate's outcome from its phase reports, folded and judged as the plugin does
    (`harness.core.records.fold_report`, and `trap_verdict` for a trap gate, with the guards it
    counted when it ran in the trap shadow)."""
    from harness.core.records import GUARD_DID_NOT_FIRE, GateRecord, Route, fold_report, trap_verdict

    rec = GateRecord(item.nodeid)
    props = {}
    for rep in reports:
        props.update((k, v) for k, v in rep.user_properties)
        fold_report(rec, rep)
    if item.get_closest_marker("trap") is not None:
        outcome, route, judged = trap_verdict(rec.outcome, rec.route, shadow_hits)
        if judged:
            line = GUARD_DID_NOT_FIRE if route == Route.ASSERTION else None
            message = None if shadow_hits else rec.failure_message
            rec.outcome, rec.route, rec.first_failure_line, rec.failure_message = outcome, route, line, message
    return {"nodeid": item.nodeid, "outcome": rec.outcome, "route": rec.route,
            "first_failure_line": rec.first_failure_line, "failure_message": rec.failure_message,
            "poisoned": props.get("poisoned_context") == "true", "duration": round(rec.duration, 4),
            "shadow_hits": shadow_hits}


def run_set(session, items: dict, sink: ReportSink, msg: dict, props: list) -> dict:
    """A mutant's gates in this fresh worker, against its sandboxed kernel root: in order,
    stopping at the first kill by assertion unless told to run them all, and at a gate that
    poisoned the context (the rest go to another fresh worker). The trap gates named in
    `trap_shadow` run in the trap shadow, here, their guards counted instead of trapping."""
    from dataclasses import replace

    from harness.core import settings as _settings
    from harness.core.records import Outcome, Route
    from harness.library import ref_launchers

    # This worker serves the mutant's tree from now on (it serves no other: it is fresh), whose
    # source analyses are not kept on disk.
    _settings.bind(replace(_settings.in_effect().with_kernel_root(msg["kernel_root"]), generated_sources=True))
    gates = list(msg["gates"])
    try:  # a comparison's side over another kernel tree runs that tree's launchers
        ref_launchers.use(Path(msg["kernel_root"]), Path(session.config.rootpath))
    except ref_launchers.LauncherImportError as exc:
        return {"op": "done_set", "protocol_s": 0.0, "outcomes": [
            {"nodeid": g, "outcome": Outcome.ERROR.value, "route": Route.ERROR.value, "first_failure_line": str(exc),
             "failure_message": str(exc), "poisoned": False} for g in gates]}
    shadowed = set(msg.get("trap_shadow") or ())
    outcomes = []
    protocol = 0.0  # seconds inside pytest's run-test protocol (the gates' reports time less of it)
    for i, nodeid in enumerate(gates):
        item = items.get(nodeid)
        if item is None:
            outcomes.append({"nodeid": nodeid, "outcome": Outcome.NOT_RUN.value, "route": None,
                             "first_failure_line": "not collected by the campaign's workers", "poisoned": False})
            continue
        nxt = items.get(gates[i + 1]) if i + 1 < len(gates) else None
        if msg.get("announce"):
            try:
                ROLE.worker.send({"op": "gate", "nodeid": nodeid})  # the executor's per-gate deadline
            except (OSError, AttributeError):
                pass
        sink.reports.clear()
        try:
            session._setupstate.teardown_exact(item)
        except BaseException:
            pass
        began = time.monotonic()
        hits = None
        if nodeid in shadowed:
            hits = _in_trap_shadow(lambda: session.config.hook.pytest_runtest_protocol(item=item, nextitem=nxt))
        else:
            session.config.hook.pytest_runtest_protocol(item=item, nextitem=nxt)
        protocol += time.monotonic() - began
        out = _outcome(item, sink.reports, shadow_hits=hits)
        outcomes.append(out)
        killed = out["outcome"] == Outcome.FAILED and out["route"] == Route.ASSERTION
        if out["poisoned"] or (msg.get("stop_on_kill") and killed):
            break
    return {"op": "done_set", "outcomes": outcomes, "protocol_s": round(protocol, 4)}


def _in_trap_shadow(run) -> int | None:
    """Run `run()` with every module loaded afresh in its trap-shadow build; the guards they
    counted, or None when the context cannot say (the gate left a sticky error: a guard
    counted before it, or a fault the real run has too; either way a trap gate's pass)."""
    from dataclasses import replace

    from harness.core import settings as _settings
    from harness.library import kernels

    kernels.forget_loaded()  # no module loaded before (the real build) serves the gate
    try:
        with _settings.applied(replace(_settings.in_effect(), trap_shadow=True)):
            run()
            try:
                return kernels.trap_shadow_hits()
            except Exception:  # noqa: BLE001 - a sticky error: the counters cannot be read
                return None
    finally:
        kernels.forget_loaded()  # and no shadow module serves a later gate


def reset_for_next_mutant(session) -> str | None:
    """Make this worker as good as fresh for the next mutant; None when it is, else why not.

    Nothing a mutant computed may reach the next one: every fixture is torn down; every
    functools cache of the project's own modules (gates, oracles, launchers) is cleared,
    except those marked `harness.host_cache` (pure host data, no kernel involved); every
    loaded module is dropped; every device buffer must be back in CuPy's pool, so none
    outlives the mutant (a stray store of this mutant landed in memory that the next one
    allocates and fills afresh). A context with a sticky error is not reused."""

    from harness.core import device

    why_not = reset_host_state(session)
    if why_not is not None:
        return why_not
    if device.context_is_poisoned():
        return "the CUDA context has a sticky error"
    try:
        import cupy

        in_use = cupy.get_default_memory_pool().used_bytes()
    except Exception:  # noqa: BLE001 - no CuPy or no driver (a fake device in the harness's own tests)
        return None
    # Every buffer must be back in CuPy's pool now. The pool's memory itself is kept, not
    # handed back to the driver: giving it back and allocating it again (cudaFree and
    # cudaMalloc) is slow, and the next mutant overwrites every buffer it allocates (gates
    # fill outputs with sentinels and copy inputs in) before reading it.
    if in_use:
        return f"{in_use} bytes of device memory are still held after the mutant's teardown"
    return None


def reset_host_state(session) -> str | None:
    """The host half of `reset_for_next_mutant` (all of it for a process that runs no GPU
    gate, `harness.runs.cpu`): fixtures torn down, the project's caches cleared but for
    `harness.host_cache`, loaded modules dropped; None when done, else why not."""
    from harness.library import kernels

    try:
        session._setupstate.teardown_exact(None)
    except BaseException as exc:  # noqa: BLE001 - a finaliser of the mutant's gates failed
        return f"a fixture's teardown raised {type(exc).__name__}: {exc}"
    clear_project_caches(Path(session.config.rootpath))
    kernels.forget_loaded()
    # pytest keeps the last failure for a post-mortem debugger (sys.last_value and friends):
    # its traceback's frames hold the failed gate's device buffers. A killed mutant always
    # leaves one; it must not keep them past the mutant.
    for name in ("last_type", "last_value", "last_traceback", "last_exc"):
        if hasattr(sys, name):
            delattr(sys, name)
    gc.collect()
    return None


def clear_project_caches(rootdir: Path) -> int:
    """Clear every functools cache defined in a module under `rootdir` (not an installed
    package, not the harness itself) unless marked `harness.host_cache`; returns how many
    were cleared."""
    from harness.core.project_modules import project_modules

    cleared = 0
    # the harness's own caches (toolchain, compile settings, parsers) hold no kernel output: not visited
    for _, mod in project_modules(rootdir):
        for obj in list(vars(mod).values()):
            # A module holds no cache of its own to clear here (its functions are visited as its
            # own entry of sys.modules); and touching a lazily loaded one (importlib's
            # LazyLoader, as CuPy loads cupyx) imports it, slowing each fresh worker's first reset.
            if isinstance(obj, types.ModuleType):
                continue
            if callable(getattr(obj, "cache_clear", None)) and hasattr(obj, "cache_info") \
                    and not getattr(obj, "harness_host_cache", False):
                obj.cache_clear()
                cleared += 1
    return cleared


def worker_main(argv: list[str]) -> int:
    """An exec'd worker (under a sanitizer): collect, then serve gates as a forked one does."""
    ROLE.connect_path = argv[argv.index("--connect") + 1]
    ROLE.token = int(argv[argv.index("--token") + 1])
    args = argv[argv.index("--") + 1:]
    import pytest

    pytest.main(args + ["--harness-serve"])
    return 0


def exec_worker_loop(session) -> None:
    """The run loop of an exec'd worker (called by the plugin)."""
    become_worker(session, ROLE.token)
