"""The plugin's pool of GPU gate workers: started from the pytest configuration, told what its
server collects and which spares to keep. The pool and what the run learnt of the device are
this module's (`harness.plugin.state.GpuGates`, `gpu`); the run's facts (`run`, a
`HarnessRun`) are read, never written."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from harness.core import device
from harness.core.errors import as_pytest_usage

if TYPE_CHECKING:
    from harness.plugin.state import GpuGates, HarnessRun, Role
    from harness.pool import controller, share


def server_args(run: HarnessRun, config: pytest.Config, files: list[str]) -> list[str]:
    """What the pool's server passes to pytest.main: the files to collect and the settings
    that decide what they collect to, never what the run reports or where it writes."""
    from harness.core.child import ChildPytest

    return ChildPytest.over(
        files, run.settings, rootdir=config.rootpath, config_file=config.inipath,
        extra=("--snapshot-update",) if config.getoption("snapshot_update", False) else (),  # the workers store them
        plugins=tuple(p for p in getattr(config.option, "plugins", None) or [] if p != "no:cacheprovider"),
        overrides=tuple(getattr(config.option, "override_ini", None) or []), no_xdist=True).args()


def new_pool(run: HarnessRun, config: pytest.Config, fork: bool = False) -> controller.Pool:
    from harness.pool import controller

    prefix = config.workerinput.get("workerid", "") + "-" if run.role.xdist_worker else ""
    sanitizer = list(run.sanitizer_cmd) if run.sanitizer_cmd is not None else None
    pool_config = controller.PoolConfig(rootdir=config.rootpath, invocation_dir=config.invocation_params.dir,
                                     pytest_args=[], sanitizer=sanitizer, sanitizer_tool=run.sanitize,
                                     name_prefix=prefix)
    try:
        pool = controller.Pool(pool_config)
    except controller.PoolError as exc:  # a temp dir too deep for the pool's socket: the fix is the user's
        raise as_pytest_usage(exc) from None
    pool_config.sanitizer_log_dir = pool.tmp
    if config.getoption("harness_wait_hung", False):
        pool.hung = None  # every gate waits its own deadline, whatever hung before it
    if run.sanitizer_cmd is None:
        try:
            pool.start_server(fork=fork)
        except BaseException:
            pool.close()  # its folder and any process it started go with it
            raise
    return pool


def start_pool(gpu: GpuGates, run: HarnessRun, config: pytest.Config, items: list[pytest.Item],
               workers: bool = True) -> None:
    """Give the pool (started at configure where a driver exists) the files to collect.
    `workers` False: the pool only probes the device (a feature runs the gates in workers of
    its own, `pytest_harness_takes_gates`), so no worker starts beside the probe."""

    files = sorted({str(it.path) for it in items}) or [str(config.rootpath)]
    if gpu.pool is None:
        # Not started at configure (no driver seen then, or a run opted in by a gate it
        # collected): a fork of this process where that is safe, as at configure, saves a
        # fresh interpreter its imports.
        gpu.pool = new_pool(run, config, fork=True)
    pool, worker_role = gpu.pool, run.role.xdist_worker
    args = server_args(run, config, files)
    pool.config.pytest_args = args + ["--harness-serve"]
    if worker_role:
        at_once = int(config.workerinput.get("workercount", 1))  # its spares: below
    else:
        # The first spares: a worker for each lane, one for the trap lane (the trap shadow) or for
        # each trap gate that may run at once (--harness-real-traps, harness.pool.traps), and the
        # main worker's replacement, their contexts made together before any trap. (A context
        # asked for while traps are handled waits for them: lanes that took the trap gates'
        # spares would have their replacements made during the traps.) Where the probe names the
        # GPU, the lanes are those the run's claim got (`claim_lanes`).
        ask = lane_ask(run, config, items)
        at_once = ask.wanted
        pool.config.spares = ask.beside + at_once - 1
    _share_blas(pool, at_once)
    early = not worker_role
    if worker_role:
        # N xdist workers share the machine and none knows its gates ahead: one spare each.
        # On a machine with one GPU (said without CUDA: CUDA_VISIBLE_DEVICES, else the
        # driver's /proc entries) it starts beside the probe; with several, after it, once the
        # probe says which GPU is this worker's (a wrong early guess would start a spare on a
        # GPU that is not there).
        pool.config.spares = 1
        early = device.device_count_hint() == 1
    if run.sanitizer_cmd is None:
        pool.collect(args)
        if early and workers:
            # The device is known before the probe answers: the main worker starts beside the
            # probe, the others once it answered and the run claimed its lanes (`claim_lanes`):
            # runs that share the GPU must not make their contexts before they know their share.
            # The driver makes contexts one at a time, so made all at once, the first gate
            # would wait for every one of them.
            pool.warm_up(1)


def _share_blas(pool: controller.Pool, at_once: int) -> None:
    """Workers that run gates at once (the lanes, or xdist's workers, a pool each) share the
    host's cores: each keeps to its share of BLAS threads (harness.pool.worker.limit_blas)."""
    from harness.core.child import BLAS_THREADS_CHANNEL
    from harness.pool import lanes

    env = dict(pool.config.worker_env or {})
    env.pop(BLAS_THREADS_CHANNEL, None)
    if at_once > 1:
        env[BLAS_THREADS_CHANNEL] = str(lanes.blas_share(at_once))
    pool.config.worker_env = env or None


def lane_ask(run: HarnessRun, config: pytest.Config, items: list[pytest.Item]) -> share.Ask:
    """What this run asks of the machine (`harness.pool.share`): its lanes (no more than its
    ordinary GPU gates), the workers beside them, and what fixed the count where something did."""
    from harness.pool import share
    from harness.pool.traps import first_spares

    traps = sum(1 for it in items if it.get_closest_marker("trap"))
    ordinary = sum(1 for it in items if it.get_closest_marker("gpu") and not it.get_closest_marker("trap"))
    n, fixed = lanes_setting(run.role, run.sanitize, config)
    return share.Ask(wanted=min(n, max(1, ordinary)), beside=first_spares(traps, run.shadow_traps), fixed=fixed)


def claim_lanes(gpu: GpuGates, run: HarnessRun, config: pytest.Config, items: list[pytest.Item]) -> None:
    """Once the probe answered: claim this run's lanes in the machine's ledger
    (`harness.pool.share`), weighed against the other harness runs there and the GPU's memory,
    and size the pool's first spares to what it got. Nothing where the probe named no GPU by
    its UUID (a stand-in device): there is nothing shared to weigh."""
    from harness.pool import lanes, share
    from harness.pool.ledger import Ledger

    facts = share.GpuFacts.from_probe(gpu.probe or {}, gpu.pool.config.device_ordinal)
    if facts is None:
        return
    ask = lane_ask(run, config, items)
    gpu.lane_claim = share.claim(ask, facts, lanes.host_cpus(), Ledger())
    if not run.role.xdist_worker:
        got = gpu.lane_claim.share.lanes
        gpu.pool.config.spares = ask.beside + got - 1
        _share_blas(gpu.pool, got)


def run_lanes(gpu: GpuGates, run: HarnessRun, config: pytest.Config) -> int:
    """The lanes this run's gates may take: its claim in the machine's ledger where the probe
    named the GPU (`claim_lanes`), else its setting (`lanes_wanted`)."""
    if gpu.lane_claim is not None:
        return gpu.lane_claim.share.lanes
    return lanes_wanted(run.role, run.sanitize, config)


def probe_beside_xdist(run: HarnessRun, config: pytest.Config) -> None:
    """xdist's controller runs no gate and makes no CUDA context, yet --require-gpu (or
    --sanitize) with no usable device must be one usage error there. With no driver that is
    known at once; else a throwaway process probes the device while xdist starts its workers
    (alongside their start, not before it), and the answer is read before the controller hands
    out the first gate (`_ProbeAnswer`)."""
    from harness.pool import controller

    if not device._driver_present():
        refuse_without_device(run, {"count": 0, "error": device.why_no_driver()})
        return
    config.pluginmanager.register(_ProbeAnswer(run, controller.ProbeProcess(config.invocation_params.dir)),
                                  "harness-controller-probe")


class _ProbeAnswer:
    def __init__(self, run: HarnessRun, probe: "controller.ProbeProcess"):
        self.run, self.probe = run, probe

    @pytest.hookimpl(tryfirst=True)
    def pytest_collection(self, session: pytest.Session) -> None:
        # after xdist's session start (its workers are starting) and before its loop; refused
        # here, the session still finishes, so xdist takes its workers down
        refuse_without_device(self.run, self.probe.result())

    def pytest_unconfigure(self, config: pytest.Config) -> None:
        self.probe.close()


def refuse_without_device(run: HarnessRun, probe: dict) -> None:
    """The require-gpu policy: with --require-gpu (or --sanitize) and no usable device, one usage error."""
    if probe.get("error") is None and probe.get("count", 0) > 0:
        return
    why = probe.get("error") or "no CUDA device was found"
    if run.require_gpu:
        raise as_pytest_usage(f"--require-gpu: {why}")
    if run.sanitize:
        raise as_pytest_usage(f"--sanitize {run.sanitize} needs a CUDA device to run the gates on: {why}; "
                                "run it on a machine with a GPU, or drop --sanitize")


def run_in_pool(gpu: GpuGates, run: HarnessRun, item: pytest.Item, nextitem, trap: bool, deadline: float):
    """Run one GPU gate in the pool: (the worker, its controller.RunResult). An ordinary gate in
    its lane (`harness.pool.lanes`, planned at the run's first item: `plan_lanes`) or in the main worker; a
    trap gate in the trap shadow, in the trap lane (or, under xdist, a warm worker of its own
    made as good as fresh after each), or trapping for real in a fresh worker (started ahead
    where it could be, `harness.pool.traps`). Raises controller.PoolError where no worker could be had."""
    from harness.pool.channel import trace as _trace

    _start_traps_ahead(gpu, run, item)
    if gpu.lanes is not None and item.nodeid in gpu.lanes:
        # Trap gates keep starting ahead on spares while this waits (its lane recorded its time).
        worker, result = gpu.lanes.wait(item.nodeid, meanwhile=lambda: _start_traps_ahead(gpu, run, item))
        _trace(f"  from lane worker {worker.name}: {result.phases}")
    else:
        ahead = gpu.traps.take(item.nodeid) if gpu.traps is not None else None
        shadowed = trap and run.shadow_traps  # as in the trap lane: one worker, as good as fresh after each
        if shadowed and gpu.shadow_worker is not None and gpu.shadow_worker.alive:
            worker = gpu.shadow_worker
        else:
            worker = ahead or (gpu.pool.fresh_worker() if trap else gpu.pool.main_worker())
        _trace(f"  worker {worker.name}{' (started ahead)' if ahead else ''}")
        if ahead is None:
            worker.start(item.nodeid, nextitem.nodeid if nextitem is not None and not trap else None,
                         shadow=shadowed, reset=shadowed)
        result = worker.wait(deadline, hung=None if trap else gpu.pool.hung)
        _trace(f"  done in worker {result.phases}")
        if shadowed:
            gpu.shadow_worker = worker if worker.alive else None
        elif trap:
            worker.kill()
        elif gpu.gate_times is not None and result.ran_to_its_end:
            gpu.gate_times.record(item.nodeid, result.seconds)
    unsettled = shadow_unsettled(result) if trap and run.shadow_traps else None
    if unsettled is not None:
        # Up to its first counted guard a run in the trap shadow is the real run, so a counted
        # guard is the real trap gate's pass; any other ending is settled by a real trap.
        _trace(f"  trap shadow did not settle it ({unsettled}): trapping for real")
        worker = gpu.pool.fresh_worker()
        worker.start(item.nodeid, None)
        result = worker.wait(deadline)
        result.unsettled = unsettled
        worker.kill()
    return worker, result


def shadow_unsettled(result) -> str | None:
    """Why a trap gate's run in the trap shadow does not settle its verdict, or None when it
    does: it counted a guard, or ended in a device fault (a guard counted before it, or one the
    real run has too: harness.compiling.trap_shadow). The shadow settles only a pass."""
    from harness.pool.controller import Ending

    if result.ending is Ending.TIMED_OUT:
        return "it ran past its deadline in the trap shadow"
    if result.ending is Ending.DIED:
        return f"its worker died in the trap shadow: {result.why}"
    if result.shadow_hits or result.poisoned:
        return None
    return "it counted no guard in the trap shadow"


def lanes_wanted(role: Role, sanitize: str | None, config: pytest.Config) -> int:
    """How many lanes this run's ordinary GPU gates take (`harness.pool.lanes`), before the
    run's claim weighs them against the machine's (`claim_lanes`): `lanes_setting`'s count."""
    return lanes_setting(role, sanitize, config)[0]


def lanes_setting(role: Role, sanitize: str | None, config: pytest.Config) -> tuple[int, str]:
    """The lanes this run asks for, and what fixed the count ("" where `auto` chose it): 1 under
    xdist (each worker has its own pool and is not told its gates ahead), a sanitizer, or timed
    launches (`--compare-timing`); else --harness-lanes (ini harness_lanes), `auto` by default."""
    from harness.pool import lanes

    if role.xdist_worker:
        return 1, "xdist (a lane a worker)"
    if sanitize:
        return 1, "--sanitize"
    if config.getoption("compare_timing", False):
        return 1, "--compare-timing"
    option = config.getoption("harness_lanes", None)
    raw = option or str(config.getini("harness_lanes") or "").strip() or "auto"
    try:
        n = lanes.lanes_value(raw)
    except ValueError as exc:
        raise as_pytest_usage(exc) from None
    if n == "auto":
        return lanes.auto_lanes(), ""
    return n, "--harness-lanes" if option else "ini harness_lanes"


def pool_order(items: list[pytest.Item], in_pool) -> list[pytest.Item]:
    """The run's items in the order it takes them beside the pool: first those this process
    runs itself (structural gates, refusals, ordinary tests), while the lanes' workers make
    their contexts and run; then the GPU gates (`in_pool`), whose verdicts the lanes have
    ready or soon will; the trap gates last. Each group keeps its own order, and no verdict
    depends on the order: a GPU gate's comes from its worker, a trap gate's from its own."""
    live = [it for it in items if not it.get_closest_marker("skip")]
    traps = [it for it in live if it.get_closest_marker("trap")]
    gpu = [it for it in live if in_pool(it) and not it.get_closest_marker("trap")]
    moved = {id(it) for it in traps + gpu}
    return [it for it in items if id(it) not in moved] + gpu + traps


def plan_lanes(gpu: GpuGates, run: HarnessRun, current: pytest.Item, deadline_for, is_gate):
    """Split the run's ordinary GPU gates from `current` on into lanes, and its trap gates into
    a lane of their own where they run in the trap shadow, and start them; None where the run
    takes one lane (the main worker then runs the ordinary gates in order) and no trap gate
    runs in the shadow there."""
    from harness.core.kinds import is_gpu
    from harness.pool import lanes

    n = run_lanes(gpu, run, current.config)  # the run's share of the machine, where the probe named the GPU
    if not run.role.xdist_worker:  # xdist's workers would overwrite each other's file
        gpu.gate_times = lanes.GateTimes(run.settings.cache_dir / lanes.TIMES_FILE)
    rest = [it for it in _from(current) if is_gpu(it) and is_gate(it) and not it.get_closest_marker("skip")]
    # Not under xdist (a worker there is not told its gates ahead) or a sanitizer (no trap gate runs).
    traps = [it for it in rest if it.get_closest_marker("trap")] \
        if run.shadow_traps and not (run.role.xdist_worker or run.sanitize) else []
    todo = [it for it in rest if not it.get_closest_marker("trap")]
    plan = []
    if n > 1:
        times = gpu.gate_times
        gates = [lanes.Gate(it.nodeid, str(it.path), times.estimate(it.nodeid, tuple(m.name for m in it.iter_markers())))
                 for it in todo]
        plan = lanes.split(gates, n)
        plan = plan if len(plan) > 1 else []
    if not plan and not traps:
        return None
    deadlines = {it.nodeid: deadline_for(it)[0] for it in todo + traps}
    # The lanes take their workers from the spares made at the start: the pool keeps the rest.
    taken = len(plan) + (1 if traps else 0)
    gpu.pool.config.spares = max(1, gpu.pool.config.spares - taken)
    shadowed = frozenset([len(plan)]) if traps else frozenset()
    planned = lanes.Lanes(gpu.pool, plan + ([[it.nodeid for it in traps]] if traps else []), deadlines.__getitem__,
                          gpu.gate_times, shadowed=shadowed)
    planned.start()
    return planned


def _start_traps_ahead(gpu: GpuGates, run: HarnessRun, current: pytest.Item) -> None:
    """Start upcoming trap gates on ready spares now (harness.pool.traps). Not under xdist (a
    worker there does not know which gates it will be sent) or a sanitizer (no trap gate runs)."""
    if run.role.xdist_worker or run.sanitize or run.shadow_traps:  # in the shadow: the trap lane (plan_lanes)
        return
    from harness.pool.traps import TrapsAhead

    if gpu.traps is None:
        gpu.traps = TrapsAhead(gpu.pool)

    def upcoming() -> list[str]:
        return [it.nodeid for it in _from(current) if it.get_closest_marker("trap") and not it.get_closest_marker("skip")]

    gpu.traps.start(upcoming, current.nodeid)


def _from(current: pytest.Item) -> list[pytest.Item]:
    """The run's items from `current` on."""
    items = current.session.items
    return items[items.index(current):] if current in items else items
