"""The mutation campaign: generate, screen on the CPU, select, run on the GPU, report.

    generate (tree-sitter, device code) -> baseline (which gates load / read what)
    -> screen (compile each mutant in a sandbox, in a process pool: compile-error,
       equivalent, duplicate) -> per remaining mutant: its gates, fastest first, through an
       Executor, stopping at the first kill by assertion -> verdicts, scores, reports

`--static` runs no GPU: its baseline runs the gates without one (structural gates run and
show which sources they read, GPU gates skip), and after the screen each pending mutant's
gates that need no device run on the CPU (`harness.campaigns.mutate.static`); what only a GPU gate
could settle stays `pending`.
Every finished mutant is appended to `<report>/mutants.jsonl` at once; `--resume` skips
the mutants found there. The kernel root is only ever read.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from harness.campaigns.mutate.execute import run_mutant
from harness.campaigns.mutate.generate import Mutant, changed_lines, generate, select_files
from harness.campaigns.mutate.select import Coverage
from harness.campaigns.mutate.store import VerdictKeys, VerdictStore
from harness.campaigns.mutate.verdicts import MutantResult, Recheck, Verdict, append_result, read_results
from harness.core.device import slot_devices
from harness.core.errors import DeviceLost
from harness.runs.config import RunConfig
from harness.runs.fresh import FreshExecutors
from harness.runs.result import Baseline, CampaignRun, Executor, ExecutorFactory, GatePlan
from harness.runs.slots import run_in_slots

RESULTS_FILE = "mutants.jsonl"
BASELINE_DEADLINE_FACTOR = 4
# --deadline auto: a mutant gets AUTO_FLOOR s plus AUTO_FACTOR x what its selected gates took in
# the baseline, at most AUTO_CAP s. A hung mutant (a loop that never ends) then costs its
# slot seconds, not minutes; a mutant that merely slows its kernel down tenfold still finishes.
# The floor is generous because a fault or trap on a shared GPU is slow to surface when many
# workers fault at once.
AUTO_FLOOR, AUTO_FACTOR, AUTO_CAP = 20.0, 5.0, 120.0
# ... and, where the executor can watch each gate (the warm one), each gate gets GATE_FLOOR s
# plus AUTO_FACTOR x its own baseline time: a mutant that hangs its first gate is found in
# that gate's time, not the whole selection's. The whole selection then only needs a loose
# bound, SET_FLOOR s plus SET_FACTOR x its baseline time: on a loaded machine 20 gates that
# pass can take longer than the tight bound, and a mutant cut there is a false timeout.
GATE_FLOOR = 15.0
SET_FLOOR, SET_FACTOR = 60.0, 10.0
# When the device is lost mid-campaign, the faults and timeouts recorded this many seconds
# before are taken back (the GPU's failure, not the mutant's, may have made them): --resume
# runs them again.
LOST_WINDOW = 120.0


@dataclass(frozen=True, kw_only=True)
class MutateConfig(RunConfig):
    paths: tuple[str, ...] = ()
    operators: tuple[str, ...] = ()
    since: str | None = None
    jobs: int = 1  # CPU processes for the screen
    gpu_jobs: int = 1  # mutants whose gates run at once (fresh processes share the GPU)
    deadline: float | None = None  # seconds per mutant on the GPU; None: derived from the baseline
    all_gates: bool = False
    static: bool = False
    seed: int = 0
    max_per_file: int | None = None
    resume: bool = False
    gates: tuple[str, ...] = ("gates",)  # what the baseline runs, relative to rootdir
    trap_gates: str = "all"  # "reached": skip trap gates whose kernels cannot run the mutated function
    trap_shadow: bool = True  # trap gates that pass the wiring check run in the trap shadow, in warm workers


class Listener(Protocol):
    def phase(self, text: str, total: int | None = None) -> None: ...  # a new stage; its bar counts to total
    def advance(self) -> None: ...  # one more mutant through this stage
    def finished(self, result: MutantResult) -> None: ...  # a final verdict


class _Quiet:
    def phase(self, text, total=None):
        pass

    def advance(self):
        pass

    def finished(self, result):
        pass


@dataclass(kw_only=True)
class MutationCampaign(CampaignRun):
    config: MutateConfig
    mutants: list[Mutant]
    results: dict[str, MutantResult]
    warnings: list[str]
    coverage: Coverage | None
    screen_seconds: float = 0.0
    gpu_seconds: float = 0.0
    resumed: int = 0
    reused: int = 0  # verdicts taken from the verdict store (`--since`), not run
    recheck: Recheck | None = None  # verdict integrity: re-runs in fresh processes
    # the trap shadow's wiring check: {trap gate: None when it runs in the shadow, else why not}
    trap_shadow: dict | None = None
    # where the gate stage's seconds went, from its start (`run_gate_stage`, `stage_line`)
    stage: dict[str, float] = field(default_factory=dict)

    @property
    def mode(self) -> str:
        return "static" if self.config.static else "campaign"

    def ordered(self) -> list[MutantResult]:
        return [self.results[m.id] for m in self.mutants if m.id in self.results]


# ---------------------------------------------------------------- the steps


def prepare(config: MutateConfig) -> tuple[list[Mutant], list[str]]:
    """The mutants (sampled) and the parse warnings. Raises PathError / SinceError."""
    root = config.path(config.kernel_root)
    files = select_files(root, list(config.paths))
    since = changed_lines(root, config.since) if config.since else None
    return generate(root, files, config.operators, since=since, seed=config.seed, max_per_file=config.max_per_file)


def _recording(folder: Path) -> dict[str, str]:
    """The baseline's environment: PYTEST_PLUGINS with the recorder, and its coverage folder.
    Given to the baseline's process alone, never set here: the gate stage's workers start in
    another thread meanwhile, and a server that inherited them would record into the folder."""
    from harness.core.child import COVERAGE_DIR_CHANNEL

    plugins = [p for p in (os.environ.get("PYTEST_PLUGINS") or "").split(",") if p]
    return {"PYTEST_PLUGINS": ",".join([*plugins, "harness.campaigns.mutate.recorder"]), COVERAGE_DIR_CHANNEL: str(folder)}


def run_baseline(config: MutateConfig, cache_dir: Path) -> tuple[Baseline, Coverage | None]:
    import shutil

    from harness.runs.fresh import run_gates

    report = config.path(config.report_dir) / "runs" / "baseline"
    folder = report / "coverage"
    shutil.rmtree(folder, ignore_errors=True)
    deadline = (config.deadline or AUTO_CAP) * BASELINE_DEADLINE_FACTOR
    run = run_gates(list(config.gates), kernel_root=config.path(config.kernel_root), rootdir=config.rootdir,
                    report_dir=report, deadline=deadline, cache_dir=cache_dir,
                    require_gpu=config.require_gpu and not config.static, arch=config.arch, env=_recording(folder))
    coverage = Coverage.from_report(report / "gates.json", folder) if run.facts is not None else None
    return Baseline.of(run), coverage


def dependents_of(root: Path, files: set[str], include_dirs: tuple[Path, ...] = ()) -> dict[str, tuple[str, ...]]:
    from harness.runs.compilecheck import dependents

    return {f: tuple(dependents(root, (f,), include_dirs)) for f in sorted(files)}


def run_campaign(config: MutateConfig, listener: Listener | None = None,
                 executor_factory: ExecutorFactory | None = None) -> MutationCampaign:
    """The campaign (module docstring). Interrupted, it leaves no sandbox behind: its slots'
    threads and the screen's workers are gone when the interrupt leaves it, and what an
    interrupt left half made or half removed is swept."""
    from harness.runs.sandbox import swept_on_interrupt

    with swept_on_interrupt():
        return _campaign(config, listener, executor_factory)


def _campaign(config: MutateConfig, listener: Listener | None,
              executor_factory: ExecutorFactory | None) -> MutationCampaign:
    from harness.campaigns.mutate import screen
    from harness.compiling.arch import resolve_arch
    from harness.runs import fresh as child
    from harness.runs.compilecheck import declared_names

    listener = listener or _Quiet()
    start = time.perf_counter()
    child.reset()  # an earlier interrupted campaign in this process refused new children
    root = config.path(config.kernel_root)
    cache_dir = config.cache()
    report_dir = config.path(config.report_dir)
    report_dir.mkdir(parents=True, exist_ok=True)
    listener.phase("generating mutants")
    mutants, warnings = prepare(config)
    results_path = report_dir / RESULTS_FILE
    done = read_results(results_path) if config.resume else {}
    ids = {m.id for m in mutants}
    # a `pending` line (from --static) is final only for another --static run
    done = {k: v for k, v in done.items() if k in ids and (config.static or v.verdict is not Verdict.PENDING)}
    _rewrite_results(results_path, done.values())  # resume: what was read, so a torn last line goes
    results: dict[str, MutantResult] = dict(done)
    campaign = MutationCampaign(config=config, kernel_root=root, arch=None, mutants=mutants, results=results,
                                warnings=warnings, baseline=None, coverage=None, seconds=0.0, resumed=len(done))
    for r in done.values():
        listener.finished(r)

    listener.phase(f"baseline: {', '.join(config.gates)}" + (" (no GPU)" if config.static else ""))
    # The gate stage's workers start while the baseline runs (an executor factory that can:
    # the warm one): their server collecting the gates, the probe and the spares' contexts
    # take seconds that a campaign otherwise spends before its first mutant.
    factory = executor_factory or FreshExecutors(config.rootdir, config.require_gpu)
    early = None
    if not config.static and any(m.id not in results for m in mutants):
        early = factory.prestart(cache_dir, config.arch, slot_devices(max(1, config.gpu_jobs)))
    baseline, coverage = run_baseline(config, cache_dir)
    if early is not None:
        early.join()  # its failure, if any, is the first slot's to raise again (the executor starts then)
    campaign.baseline, campaign.coverage = baseline, coverage
    if not baseline.ok:
        campaign.seconds = time.perf_counter() - start
        return campaign
    arch = resolve_arch(config.arch or baseline.arch)
    campaign.arch = arch

    todo = [m for m in mutants if m.id not in results]
    declared = declared_names(root)
    deps = dependents_of(root, {m.file for m in mutants}, declared.include_dirs)
    keys = (VerdictKeys(root, config.rootdir, coverage, deps, config, arch, declared.include_dirs)
            if coverage is not None else None)
    store = VerdictStore(cache_dir)
    if config.since and keys is not None:
        todo = _reuse(campaign, todo, keys, store, results_path, listener)
    ctx = screen.ScreenContext(root, arch, cache_dir, declared, deps)
    source_read = coverage.source_read() if coverage is not None else None
    t0 = time.perf_counter()
    cpus = "the cluster's CPUs" if factory.cpu_map() is not None else f"{config.jobs} CPU worker(s)"
    if config.static or not todo:
        listener.phase(f"screening {len(todo)} mutants on {cpus}", len(todo))
        originals = screen.original_fingerprints(ctx)
        compiled = screen.compile_all(todo, ctx, config.jobs, on_done=lambda c: listener.advance(),
                                      cpu_map=factory.cpu_map())
        screened = screen.classify(todo, compiled, originals, source_read)
        campaign.screen_seconds = time.perf_counter() - t0
        if config.static:
            from harness.campaigns.mutate.static import cpu_stage

            cpu_stage(campaign, screened, coverage, deps, config, lambda r: _finish(campaign, results_path, r, listener),
                      listener, functools.partial(cpu_executor, config, coverage, arch),
                      functools.partial(mutant_deadline, config, coverage))
            campaign.gpu_seconds = time.perf_counter() - t0 - campaign.screen_seconds
        else:
            for m in todo:
                _finish(campaign, results_path, screened[m.id], listener)
    else:
        # The screen feeds the gate stage as it goes: a mutant's gates run as soon as it
        # passes the screen, so the GPUs work while the CPUs still compile.
        listener.phase(f"screening {len(todo)} mutants on {cpus}, running the gates of "
                       f"each that passes, {config.gpu_jobs} at once", len(todo))
        screened = screen.ScreenFeed(ctx, interleave_mutants(todo), config.jobs, source_read, factory.cpu_map())
        screened.start()
        try:
            run_gate_stage(campaign, screened, coverage, deps, config, results_path, listener,
                           lambda device: factory(report_dir / "runs" / "mutants", cache_dir, arch, device))
        finally:
            screened.stop()
        campaign.screen_seconds = screened.seconds
        campaign.gpu_seconds = time.perf_counter() - t0
    if keys is not None:
        _store_verdicts(campaign, keys, store)
    resolve_duplicates(campaign.results)
    from harness.compiling.cubin_cache import limit_bytes, prune

    prune(cache_dir, limit_bytes())  # the mutants' cubins past the bound go, least recently used first
    campaign.seconds = time.perf_counter() - start
    return campaign


def _store_verdicts(campaign, keys: VerdictKeys, store: VerdictStore) -> None:
    """Keep every verdict this campaign reached in the store; one that cannot be keyed or
    written costs a later `--since` run that mutant's run, and the campaign says so."""
    try:
        for m in campaign.mutants:
            r = campaign.results.get(m.id)
            if r is not None and not r.reused:
                store.put(keys.key(m), r, static=campaign.config.static)
    except Exception as exc:  # noqa: BLE001 - the campaign's verdicts stand; only their reuse is lost
        campaign.warnings.append(f"the verdict store was not written ({type(exc).__name__}: {exc}): a later "
                                 "--since run runs these mutants again")


def _reuse(campaign, todo: list, keys: VerdictKeys, store: VerdictStore, results_path: Path, listener) -> list:
    """Finish each mutant of `todo` whose verdict the store holds under its digest (its
    closure, selected gates and toolchain unchanged since); the mutants left to run."""
    listener.phase(f"looking up {len(todo)} mutants in the verdict store", len(todo))
    left = []
    for m in todo:
        hit = store.get(keys.key(m))
        if hit is None:
            left.append(m)
        else:
            _finish(campaign, results_path, dataclasses.replace(hit, mutant=m, reused=True), listener)
            campaign.reused += 1
        listener.advance()
    return left


def cpu_executor(config: MutateConfig, coverage: Coverage, arch: str):
    """An executor of the gates that need no device (`--static`'s gate stage)."""
    from harness.runs.cpu import CpuExecutor

    return CpuExecutor(config.rootdir, tuple(sorted(coverage.cpu_gates())), config.path(config.kernel_root),
                       config.cache(), config.path(config.report_dir) / "runs" / "cpu", arch=arch,
                       stop_on_kill=not config.all_gates)


def run_gate_stage(campaign, feed, coverage, deps, config, results_path, listener, make_executor) -> None:
    """Record every result the feed (a ScreenFeed, still screening) gives: final ones at
    once, pending ones after their gate runs, `config.gpu_jobs` at once (`harness.runs.slots`).
    Each slot has its own executor, on its slot's GPU, armed here once."""
    root = campaign.kernel_root
    jobs = max(1, config.gpu_jobs)
    began = time.monotonic()
    stage = campaign.stage

    def mark(key: str) -> None:
        stage.setdefault(key, round(time.monotonic() - began, 2))

    executors = [make_executor(device) for device in slot_devices(jobs)]
    for ex in executors:
        arm(ex, config, coverage)
    mark("executors_ready")
    if config.trap_shadow:
        campaign.trap_shadow = wire_trap_shadow(executors, root)
        mark("trap_shadow_checked")
    finished_at: dict[str, float] = {}
    history = KillHistory()
    for done_result in campaign.results.values():  # resumed: what killed its file's mutants so far
        history.record(done_result)

    def take(block: bool):
        while True:
            r = feed.get(block=block)
            if r is not None and r.verdict is Verdict.PENDING:
                mark("first_mutant_screened")
            if r is None or r.verdict is Verdict.PENDING:
                return r
            _finish(campaign, results_path, r, listener)  # screened out: final now
            listener.advance()

    def work(r: MutantResult, slot: int) -> MutantResult:
        return gate_stage(r, root, coverage, deps, executors[slot], config, history)

    def done(r: MutantResult, result: MutantResult) -> None:
        finished_at[result.mutant.id] = time.monotonic()
        mark("first_mutant_judged")
        stage["last_mutant_judged"] = round(finished_at[result.mutant.id] - began, 2)
        history.record(result)
        _finish(campaign, results_path, result, listener)
        listener.advance()

    def close_all() -> None:
        for ex in executors:
            ex.close()

    try:
        run_in_slots(take, jobs, work, done, on_abort=close_all, name="mutant")
    except DeviceLost as exc:
        _take_back_after_loss(campaign, results_path, finished_at)
        raise DeviceLost(
            f"the device stopped answering after {len(campaign.results)} mutants ({exc}); the "
            f"faults and timeouts of the last {LOST_WINDOW:.0f} s were taken back: check the GPU "
            "(nvidia-smi), then continue with --resume") from None


def _rewrite_results(path: Path, results) -> None:
    """The results file holding exactly `results`."""
    path.write_text("")
    for r in results:
        append_result(path, r)


def _take_back_after_loss(campaign: MutationCampaign, path: Path, finished_at: dict[str, float]) -> None:
    """Drop the faults and timeouts recorded in the LOST_WINDOW before a device loss, from
    the results and from the results file (so --resume runs them again)."""
    now = time.monotonic()
    suspect = {i for i, t in finished_at.items() if now - t <= LOST_WINDOW
               and campaign.results[i].verdict in (Verdict.KILLED_BY_TRAP, Verdict.TIMEOUT)}
    for i in suspect:
        del campaign.results[i]
    _rewrite_results(path, campaign.results.values())


def _finish(campaign: MutationCampaign, path: Path, result: MutantResult, listener: Listener) -> None:
    campaign.results[result.mutant.id] = result
    append_result(path, result)
    listener.finished(result)


class KillHistory:
    """Which gates have killed each file's mutants so far in this campaign. A mutant's gates
    then run the file's most frequent killers first, within the places the selection fixes
    (source readers first, trap gates last: `Coverage.place`); ties and gates that killed
    nothing keep the baseline's order. Most mutants of a file die in the same few gates, so
    a killed mutant then runs fewer gates than fastest-first would have it run. Thread-safe."""

    def __init__(self):
        import threading

        self._kills: dict[str, dict[str, int]] = {}
        self._lock = threading.Lock()

    def record(self, result: MutantResult) -> None:
        if result.verdict is Verdict.KILLED and result.killed_by:
            with self._lock:
                by_gate = self._kills.setdefault(result.mutant.file, {})
                by_gate[result.killed_by[0]] = by_gate.get(result.killed_by[0], 0) + 1

    def order(self, file: str, gates: tuple[str, ...], coverage: Coverage) -> tuple[str, ...]:
        with self._lock:
            kills = dict(self._kills.get(file, {}))
        if not kills:
            return gates
        position = {n: i for i, n in enumerate(gates)}
        return tuple(sorted(gates, key=lambda n: (*coverage.place(n), -kills.get(n, 0), position[n])))


def gate_stage(r: MutantResult, root: Path, coverage: Coverage | None, deps: dict, executor: Executor,
               config: MutateConfig, history: KillHistory | None = None) -> MutantResult:
    from harness.runs.sandbox import sandbox, write

    m = r.mutant
    if coverage is None:
        return MutantResult(m, Verdict.NO_COVERAGE, "the baseline recorded no coverage", seconds=r.seconds)
    source_only = r.cubin_identical or r.duplicate_of is not None  # its cubin already ran (or is the original)
    sel = coverage.select(m.file, deps.get(m.file, ()), cubin_identical=source_only)
    if history is not None:
        sel = dataclasses.replace(sel, direct=history.order(m.file, sel.direct, coverage),
                                  siblings=history.order(m.file, sel.siblings, coverage))
    if not sel.direct:
        return MutantResult(m, Verdict.NO_COVERAGE, "no gate loads its module or reads its source",
                            seconds=r.seconds, cubin_identical=r.cubin_identical)
    skipped: set[str] = set()
    if config.trap_gates == "reached":
        reaching = _reaching(root).get(m.function)
        if reaching:
            skipped = coverage.unreached_trap_gates(sel.all, reaching)
            sel = dataclasses.replace(sel, direct=tuple(g for g in sel.direct if g not in skipped),
                                      siblings=tuple(g for g in sel.siblings if g not in skipped))
    per_gate = bool(executor.gate_deadlines)
    with sandbox(root, f"mutant-{m.id}-{os.getpid()}") as copy:  # named as the screen's (screen.ScreenContext)
        write(copy, m.file, m.apply((copy / m.file).read_bytes()).decode("utf-8"))
        deadline = mutant_deadline(config, coverage, sel, per_gate) + executor.start_seconds
        j = run_mutant(executor, copy, coverage.batches(sel), deadline, config.all_gates,
                       coverage.memory_safety_gates())
    verdict, reason = j.verdict, j.reason
    if r.cubin_identical and verdict is Verdict.SURVIVED:
        # Not screened out by its cubin alone: the gates that read its source ran and passed
        # too, so nothing that runs and nothing a gate reads tells it from the original.
        verdict = Verdict.EQUIVALENT
        reason = f"equivalent: identical cubin, and the {len(j.gates_run)} gate(s) reading its source passed"
    elif r.duplicate_of is not None and verdict is Verdict.SURVIVED:
        verdict = Verdict.DUPLICATE  # takes its twin's verdict (resolve_duplicates)
        reason = f"duplicate of {r.duplicate_of} (the {len(j.gates_run)} gate(s) reading its source passed)"
    if skipped and verdict is Verdict.SURVIVED:
        reason = (f"{reason}; {len(skipped)} trap gate(s) not run (--trap-gates reached): none of their kernels "
                  f"runs {m.function}")
    return MutantResult(m, verdict, reason, killed_by=list(j.killed_by), gates_run=list(j.gates_run),
                        covered_by=list(sel.direct), seconds=r.seconds + j.seconds, cubin_identical=r.cubin_identical,
                        duplicate_of=r.duplicate_of if verdict is Verdict.DUPLICATE else None,
                        memory_safety=j.memory_safety, gate_seconds=round(j.seconds, 4),
                        in_gates=round(j.in_gates, 4), worker_wait=round(j.waited, 4), ran_on=j.ran_on)


@functools.lru_cache(maxsize=4)
def _reaching(root: Path) -> dict[str, frozenset[str]]:
    """{device function: the kernels that can run it}, read once per kernel root."""
    from harness.campaigns.mutate.callgraph import kernels_reaching

    return kernels_reaching(root)


def arm(executor: Executor, config: MutateConfig, coverage: Coverage | None) -> None:
    """Tell an executor what the baseline says of each gate: its own deadline (auto), the
    memory-safety gates its fault cap spares, the fault-naming and the trap gates."""
    if coverage is None:
        return
    executor.arm(GatePlan(gate_deadlines(config, coverage), coverage.memory_safety_gates(),
                          coverage.fault_naming_gates(),
                          frozenset(g for g in coverage.gates if coverage.place(g)[0])))


def wire_trap_shadow(executors: list, root: Path) -> dict | None:
    """Run the trap shadow's wiring check once per warm executor (each GPU's) and keep, on
    each, the trap gates that passed it; {trap gate: None (shadowed) or why not}, or None
    when no executor can (the fresh-process one, or no trap gate)."""
    verdicts: dict = {}
    seen: set[int] = set()
    for ex in executors:
        if id(ex) in seen or not ex.trap_gates:
            continue
        seen.add(id(ex))
        why_not = ex.check_trap_shadow(root)
        for gate in ex.trap_gates:
            verdicts[gate] = verdicts.get(gate) or why_not.get(gate)
    return verdicts or None


def stage_line(stage: dict[str, float]) -> str | None:
    """Where the gate stage's seconds went, for the terminal: each step's end, from its start."""
    names = (("executors_ready", "slots' executors ready"), ("trap_shadow_checked", "trap shadow checked"),
             ("first_mutant_screened", "first mutant screened"), ("first_mutant_judged", "first judged"),
             ("last_mutant_judged", "last judged"))
    parts = [f"{label} at {stage[key]:.1f} s" for key, label in names if key in stage]
    return f"gate stage: {', '.join(parts)}" if parts else None


def trap_shadow_line(verdicts: dict | None) -> str | None:
    """One line on the trap shadow's wiring check, for the terminal: how many trap gates run
    in it, and why each other one does not."""
    if not verdicts:
        return None
    shadowed = sum(1 for why in verdicts.values() if why is None)
    line = (f"trap shadow: {shadowed} of {len(verdicts)} trap gates counted their guards on the original kernels and "
            "ran in each mutant's own worker (the re-check runs them for real)")
    out = [f"{gate} ({why})" for gate, why in sorted(verdicts.items()) if why is not None]
    return line + (f"; each in a fresh worker: {'; '.join(out)}" if out else "")


def gate_deadlines(config: MutateConfig, coverage: Coverage) -> dict[str, float] | None:
    """{nodeid: seconds} under --deadline auto; None with a fixed --deadline."""
    if config.deadline is not None:
        return None
    return {n: min(AUTO_CAP, GATE_FLOOR + AUTO_FACTOR * g.duration) for n, g in coverage.gates.items()}


def mutant_deadline(config: MutateConfig, coverage: Coverage, sel, per_gate: bool = False) -> float:
    """The fixed --deadline, or (auto) the floor plus a multiple of the selected gates'
    baseline time; looser when each gate also has its own deadline (`per_gate`)."""
    if config.deadline is not None:
        return config.deadline
    if per_gate:
        return min(AUTO_CAP, SET_FLOOR + SET_FACTOR * coverage.seconds(sel.all))
    return min(AUTO_CAP, AUTO_FLOOR + AUTO_FACTOR * coverage.seconds(sel.all))


def interleave_mutants(mutants: list) -> list:
    """Mutants in round-robin over their files, each file's own order kept."""
    by_file: dict[str, list] = {}
    for m in mutants:
        by_file.setdefault(m.file, []).append(m)
    queues = list(by_file.values())
    out = []
    while queues:
        out += [q.pop(0) for q in queues]
        queues = [q for q in queues if q]
    return out


def resolve_duplicates(results: dict[str, MutantResult]) -> None:
    """A duplicate takes its twin's verdict (as `effective`), once each group's twin is its
    lowest id (`lowest_twins`)."""
    lowest_twins(results)
    for r in results.values():
        if r.verdict is Verdict.DUPLICATE and r.duplicate_of in results:
            r.effective = results[r.duplicate_of].verdict


def lowest_twins(results: dict[str, MutantResult]) -> None:
    """Each group of identical mutants (one cubin) of one file that no gate reads takes its
    lowest id as the twin whose run stands for all. The screen takes the first whose compile
    finished, which the order of compiles decides; the verdicts are the same by construction
    (the same cubin, and no gate reads the source), so with the twin fixed two campaigns report
    them alike, mutant by mutant. A group where a gate reads the source (a duplicate that ran
    the gates reading its own: `gates_run`) keeps its twin: that twin's run saw its own source."""
    groups: dict[str, list[MutantResult]] = {}
    for r in results.values():
        if r.verdict is Verdict.DUPLICATE and r.duplicate_of in results:
            groups.setdefault(r.duplicate_of, []).append(r)
    for twin_id, dups in groups.items():
        twin = results[twin_id]
        if twin.verdict is Verdict.DUPLICATE or any(d.gates_run or d.mutant.file != twin.mutant.file for d in dups):
            continue
        low = min(d.mutant.id for d in dups)
        if low > twin_id:
            continue
        was_duplicate = results[low]
        results[low] = dataclasses.replace(twin, mutant=was_duplicate.mutant, seconds=was_duplicate.seconds)
        results[twin_id] = dataclasses.replace(was_duplicate, mutant=twin.mutant, seconds=twin.seconds,
                                               duplicate_of=low, reason=f"duplicate of {low}")
        for d in dups:
            if d.mutant.id != low:
                results[d.mutant.id] = dataclasses.replace(d, duplicate_of=low, reason=f"duplicate of {low}")

