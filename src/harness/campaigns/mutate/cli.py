"""`python -m harness mutate [PATH ...]`: a mutation campaign from the shell."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from harness.core import settings as _settings
from harness.core.interrupt import sigterm_as_interrupt
from harness.core.usage import (ExitStatus, UsageError, add_project_options, positive_int as _positive_int,
                                positive_seconds, say_baseline_red)
from harness.runs.verdict import Verdict

DESCRIPTION = ("Mutate the device code of the kernels, screen the mutants on the CPU (compile, identical cubins), "
               "then run the gates that load each module and report which mutants survive.")


CACHE_EPILOG = ("The cache folder (--cache-dir) keeps every mutant's cubin (the screen compiles each once; a "
                "later campaign finds it) and each mutant's final verdict (for --since), with the real tree's "
                "cubins and host data; the cubins and verdicts stay under HARNESS_CACHE_MAX (default 256M; 0: no "
                "bound), the least recently used going first, mutants' before the real tree's. python -m harness "
                "cache info says what it holds; python -m harness cache clear empties it.")


def build_parser(prog: str = "python -m harness mutate", description: str = DESCRIPTION) -> argparse.ArgumentParser:
    """The campaign's options (`bench mutate` builds on them under its own name)."""
    from harness.campaigns.mutate.operators import OPERATORS

    p = argparse.ArgumentParser(prog=prog, description=description, epilog=CACHE_EPILOG)
    p.add_argument("paths", nargs="*", metavar="PATH",
                   help=".cu/.cuh files or folders under the kernel root (default: all of it)")
    p.add_argument("--operators", default=None, metavar="LIST",
                   help=f"comma-separated operators (default: all): {', '.join(OPERATORS)}")
    p.add_argument("--since", default=None, metavar="GIT_REF",
                   help="only mutants on lines changed since GIT_REF, and each whose verdict the verdict store "
                        "holds (its source closure, selected gates and toolchain unchanged since a campaign "
                        "stored it) is reused, not run: a pull request's pushes in CI")
    p.add_argument("--jobs", default=None, metavar="N", help="CPU workers for the screen (default: every core)")
    p.add_argument("--gpu-jobs", default="1", metavar="N",
                   help="mutants whose gates run at once; several GPUs are shared out (default 1)")
    p.add_argument("--deadline", default="auto", metavar="S",
                   help="seconds per mutant on the GPU; auto (default): 20 s plus 5 times what the mutant's "
                        "selected gates took in the baseline, at most 120 s")
    p.add_argument("--all-gates", action="store_true",
                   help="run every selected gate (the full kill matrix) instead of stopping at the first kill")
    p.add_argument("--static", action="store_true",
                   help="no GPU (CI): generate, compile and screen, then run each mutant's gates that need no "
                        "device (structural gates) on the CPU, --jobs at once: those kill mutants, and settle "
                        "the ones whose cubin is the original's or another mutant's; the rest stay pending "
                        "(the report says why); write the report")
    p.add_argument("--seed", default="0", metavar="N", help="seed of the --max-per-file sample (default 0)")
    p.add_argument("--max-per-file", default=None, metavar="N", help="at most N mutants of each file (a sample)")
    p.add_argument("--report", default=None, metavar="DIR",
                   help="where mutation.json, mutation.html and mutants.jsonl go (default: harness-report/mutation "
                        "in the rootdir)")
    p.add_argument("--resume", action="store_true", help="continue an interrupted campaign from DIR/mutants.jsonl")
    add_project_options(p, arch_help="compile target (default: HARNESS_ARCH, else the baseline's)")
    p.add_argument("--gates", action="append", default=None, metavar="PATH",
                   help="what the baseline runs, relative to the rootdir (repeatable; default: ini harness_gates, "
                        "else gates)")
    p.add_argument("--executor", choices=("warm", "fresh"), default="warm",
                   help="warm: workers forked from a server that collected the gates, each with its CUDA context "
                        "made ahead, serving mutant after mutant and reset between them (default); fresh: a new "
                        "pytest per mutant (the slow reference way)")
    p.add_argument("--recheck", default="10", metavar="N",
                   help="after a warm campaign, run every survivor and N other mutants again in a fresh process "
                        "and report how many verdicts agree (default 10; 0: the survivors only)")
    p.add_argument("--recheck-in", choices=("worker", "pytest"), default="worker",
                   help="the re-check's fresh process: worker (default): a worker no other mutant used, forked "
                        "for this one mutant and ended after it, up to --gpu-jobs at once; pytest: a whole new "
                        "pytest per mutant, a quarter as many at once as cores (slower: each pays a pytest "
                        "start, a server and a CUDA context of its own)")
    p.add_argument("--trap-gates", choices=("all", "reached"), default="all",
                   help="all (default): every selected trap gate runs; reached: skip a trap gate whose kernels "
                        "(gates.json's kernels_launched) cannot run the function the mutant changed, by the "
                        "sources' call graph (each trap gate costs a fresh worker)")
    p.add_argument("--no-trap-shadow", action="store_true",
                   help="run every trap gate for real, each in a fresh worker (by default a trap gate that passes the "
                        "wiring check runs in the trap shadow, its guards counted instead of trapping, in the "
                        "mutant's own warm worker; the re-check always runs them for real)")
    p.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                   help="run on a Ray cluster (pip install -e '.[ray]'): one actor per GPU holding a warm pool, the "
                        "screen's compiles as Ray tasks on its CPUs, the rootdir shipped as Ray's working_dir; "
                        "--gpu-jobs is then mutants at once on each GPU. ADDRESS: the cluster's (HOST:6379, "
                        "ray://HOST:10001, auto); none: RAY_ADDRESS, else a running local one, else a new local one "
                        "(docs/scaling.md)")
    p.add_argument("--report-only", action="store_true",
                   help="run nothing: write mutation.json, mutation.html and the table again from DIR/mutants.jsonl "
                        "(a campaign cut short before its report, or copied back from a device)")
    p.add_argument("--no-require-gpu", action="store_true", help=argparse.SUPPRESS)  # the harness's own tests
    return p


PLAIN_INTERVAL = 30.0  # seconds between progress lines when stderr is not a terminal


def _duration(seconds: float) -> str:
    """`1h02m`, `4m05s` or `12s`."""
    s = int(round(seconds))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def _deadline(text: str) -> float | None:
    """None: derived per mutant from the baseline (auto)."""
    return None if text == "auto" else positive_seconds(text, "--deadline", "120", " or auto")


def config_from(args):
    from harness.campaigns.mutate.campaign import MutateConfig
    from harness.campaigns.mutate.operators import parse_operators

    project = _settings.resolve(kernel_root=args.kernel_root, cache_dir=args.cache_dir, rootdir=args.rootdir)
    rootdir = project.rootdir
    jobs = _positive_int(args.jobs, "--jobs", "4") if args.jobs is not None else (os.cpu_count() or 1)
    try:
        seed = int(args.seed)
    except ValueError:
        raise UsageError(f"--seed {args.seed!r} is not a whole number; pass e.g. --seed 1") from None
    max_per_file = _positive_int(args.max_per_file, "--max-per-file", "12") if args.max_per_file is not None else None
    gates = tuple(args.gates or (p.relative_to(rootdir).as_posix() if p.is_relative_to(rootdir) else str(p)
                                 for p in project.gate_paths) or (_settings.DEFAULT_GATES,))
    report_dir = Path(args.report).resolve() if args.report else _settings.report_root(rootdir) / "mutation"
    from harness.compiling.cubin_cache import CacheLimitError, limit_bytes

    try:
        limit_bytes()
    except CacheLimitError as exc:
        raise UsageError(str(exc)) from None
    return MutateConfig(
        rootdir=rootdir, kernel_root=project.settings.kernel_root, report_dir=report_dir, paths=tuple(args.paths),
        operators=parse_operators(args.operators), since=args.since, jobs=jobs,
        gpu_jobs=_positive_int(args.gpu_jobs, "--gpu-jobs", "4"), deadline=_deadline(args.deadline),
        all_gates=args.all_gates, static=args.static, seed=seed, max_per_file=max_per_file, resume=args.resume,
        arch=args.arch, cache_dir=project.settings.cache_dir, gates=gates,
        require_gpu=not args.no_require_gpu, trap_gates=args.trap_gates,
        trap_shadow=not args.no_trap_shadow,
    )


def _gates_problem(config, source: str) -> str | None:
    """Each of what the baseline runs (a file or folder, a node id's file) must be there."""
    for gate in config.gates:
        path = config.rootdir / gate.split("::", 1)[0]
        if not path.exists():
            return (f"{source} {gate}: no file or folder {path}; pass gate paths relative to the rootdir "
                    f"{config.rootdir} (--gates PATH, or the ini key harness_gates)")
    return None


def _survivors(campaign) -> bool:
    return any(r.verdict is Verdict.SURVIVED for r in campaign.ordered())


def _executor_factory(config, kind: str, reuse: bool = True, cluster=None):
    """(the campaign's executor factory, the executors it made, to close): fresh processes, or
    (warm) one executor per GPU, shared by the campaign's slots on that GPU, its spares
    covering every slot; on a Ray `cluster`, one actor per GPU holding such an executor."""
    from harness.runs.fresh import FreshExecutors
    from harness.runs.warm import WarmExecutors

    if cluster is not None:
        from harness.runs.ray_executor import RayExecutors

        ray = RayExecutors(cluster, config.gates, config.path(config.kernel_root), per_gpu=config.gpu_jobs,
                           stop_on_kill=not config.all_gates, reuse=reuse)
        return ray, ray.made
    if kind == "fresh":
        return FreshExecutors(config.rootdir, config.require_gpu), {}
    warm = WarmExecutors(config.rootdir, config.gates, config.path(config.kernel_root), config.gpu_jobs,
                         stop_on_kill=not config.all_gates, reuse=reuse)
    return warm, warm.made


class _Progress:
    """A rich bar per stage (mutants a second, time elapsed and left, live verdict counts) on
    a terminal; plain lines otherwise (a CI log): each stage, then done/total, the rate and
    the time left at most every `interval` seconds and at the stage's end, and every
    survivor. `clock`: seconds, monotonic (a test passes its own)."""

    def __init__(self, console, clock=time.monotonic, interval: float = PLAIN_INTERVAL):
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                                   TimeRemainingColumn)

        self.console = console
        self.live = console.is_terminal
        self.clock, self.interval = clock, interval
        self.progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[rate]}"), TimeElapsedColumn(), TextColumn("left"),
                                 TimeRemainingColumn(), TextColumn("{task.fields[counts]}"), console=console,
                                 transient=True)
        self.task = None
        self.counts: dict[str, int] = {}
        self.nodes: dict[str, int] = {}  # on a cluster: verdicts made on each node's GPU
        self.n = 0
        self.done = 0
        self.start = self.said = self.clock()

    def __enter__(self):
        if self.live:
            self.progress.__enter__()
            self.task = self.progress.add_task("starting", total=None, rate="", counts="")
        return self

    def __exit__(self, *exc):
        if self.live:
            self.progress.__exit__(*exc)

    def _counts(self) -> str:
        verdicts = " ".join(f"{k} {n}" for k, n in sorted(self.counts.items()))
        nodes = ", ".join(f"{k} {n}" for k, n in sorted(self.nodes.items()))
        return verdicts + (f" | by node: {nodes}" if nodes else "")

    def phase(self, text: str, total: int | None = None) -> None:
        self.n, self.done, self.start = total or 0, 0, self.clock()
        self.said = self.start
        if self.live:
            self.progress.reset(self.task, total=total, description=text, rate="", counts=self._counts())
        else:
            self.console.print(text, markup=False)

    def advance(self) -> None:
        self.done += 1
        now = self.clock()
        rate = self.done / max(1e-9, now - self.start)
        if self.live:
            self.progress.update(self.task, advance=1, rate=f"{rate:.1f} mutants/s", counts=self._counts())
        elif self.n and (self.done == self.n or now - self.said >= self.interval):
            self.said = now
            left = "" if self.done == self.n else f", {_duration((self.n - self.done) / rate)} left"
            self.console.print(f"  {self.done}/{self.n} ({rate:.1f} mutants/s, {_duration(now - self.start)} "
                               f"elapsed{left}) {self._counts()}".rstrip(), markup=False)

    def finished(self, result) -> None:
        v = result.verdict.value
        self.counts[v] = self.counts.get(v, 0) + 1
        if result.ran_on:
            node = f"{result.ran_on.get('node')}/{result.ran_on.get('node_id')} GPU {result.ran_on.get('gpu')}"
            self.nodes[node] = self.nodes.get(node, 0) + 1
        if self.live:
            self.progress.update(self.task, counts=self._counts())
        elif result.verdict in (Verdict.SURVIVED, Verdict.NO_COVERAGE):
            m = result.mutant
            self.console.print(f"  {v}: {m.file}:{m.start_line}:{m.start_col} {m.id} {m.operator} "
                               f"{m.original!r} -> {m.replacement!r}", markup=False)


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console
    from rich.markup import escape

    from harness.campaigns.mutate.generate import PathError, SinceError

    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    out = Console(highlight=False, width=None if sys.stdout.isatty() else 180)
    err = Console(stderr=True, highlight=False, soft_wrap=True)

    def usage(text: str) -> int:
        err.print(f"[bold red]error:[/] {escape(text)}")
        return ExitStatus.USAGE

    from harness.core.usage import (folder_problem, kernel_root_option, kernel_root_problem, output_folder_problem,
                                    rootdir_problem)

    if rootdir_problem(args.rootdir):
        return usage(rootdir_problem(args.rootdir))
    try:
        config = config_from(args)
    except UsageError as exc:
        return usage(str(exc))
    if config.arch:
        from harness.compiling.arch import ArchError, check_arch

        try:
            check_arch(config.arch)
        except ArchError as exc:
            return usage(str(exc))
    project = _settings.resolve(kernel_root=args.kernel_root, rootdir=args.rootdir)
    problems = (
        kernel_root_problem(config.path(config.kernel_root), kernel_root_option(project.kernel_root_source)),
        output_folder_problem(config.path(config.report_dir), "--report",
                              "mutation.json, mutation.html and mutants.jsonl"),
        None if config.cache_dir is None else folder_problem(config.cache_dir, "--cache-dir", "the compiled cubins"),
        _gates_problem(config, "--gates" if args.gates else "ini harness_gates" if project.gate_paths else
                       "--gates (default gates)"),
    )
    for problem in problems:
        if problem:
            return usage(problem)
    from harness.campaigns.mutate.campaign import prepare

    try:
        mutants, warnings = prepare(config)  # bad paths and refs are refused before anything runs
    except (PathError, SinceError) as exc:
        return usage(str(exc))
    if args.report_only:
        return _report_only(config, mutants, warnings, out, err)
    try:
        recheck_n = int(args.recheck)
        if recheck_n < 0:
            raise ValueError
    except ValueError:
        return usage(f"--recheck {args.recheck!r} is not a whole number of mutants >= 0; pass e.g. --recheck 10")
    cluster = None
    if args.ray is not None:
        from harness.runs.cluster import ClusterError, connect

        if args.executor == "fresh" or args.recheck_in == "pytest":
            return usage("--ray runs the warm executor on every GPU of the cluster: drop --executor fresh and "
                         "--recheck-in pytest")
        try:
            cluster = connect(args.ray or None, config.rootdir, config.path(config.kernel_root),
                              need_gpu=not config.static)
        except ClusterError as exc:
            return usage(str(exc))
    factory, executors = _executor_factory(config, args.executor, cluster=cluster)
    if cluster is not None:
        import dataclasses

        config = dataclasses.replace(config, gpu_jobs=factory.jobs)  # GPUs x mutants at once on each
    try:
        with sigterm_as_interrupt():  # a cancelled CI job ends the campaign as Ctrl-C does
            return _run(config, args, recheck_n, factory, out, err, executors, cluster)
    finally:
        for ex in executors.values():
            ex.close()  # no server or worker outlives the campaign, interrupted or not
        if cluster is not None:
            cluster.close()


def _report_only(config, mutants, warnings, out, err) -> int:
    """The reports of the results already in DIR/mutants.jsonl, for the mutants the same
    arguments generate; nothing runs."""
    from rich.markup import escape

    from harness.campaigns.mutate import report
    from harness.campaigns.mutate.campaign import RESULTS_FILE, MutationCampaign, resolve_duplicates
    from harness.campaigns.mutate.verdicts import read_results

    directory = config.path(config.report_dir)
    results_path = directory / RESULTS_FILE
    found = read_results(results_path)
    ids = {m.id for m in mutants}
    results = {k: v for k, v in found.items() if k in ids}
    if not results:
        err.print(f"[bold red]error:[/] {escape(str(results_path))} holds no result for the mutants these arguments "
                  "generate: pass the --report DIR of the campaign, and the same PATHs, --operators, --seed and "
                  "--max-per-file")
        return ExitStatus.USAGE
    resolve_duplicates(results)
    campaign = MutationCampaign(config=config, kernel_root=config.path(config.kernel_root), arch=config.arch,
                                mutants=mutants, results=results, warnings=warnings, baseline=None, coverage=None,
                                seconds=0.0, resumed=len(results))
    json_path, html_path = report.write(directory, campaign)
    out.print(report.table(campaign))
    out.print(f"{len(results)} of {len(mutants)} mutants have a result (reported from {escape(str(results_path))}, "
              f"nothing run); report: {escape(str(json_path))}, {escape(str(html_path))}")
    return ExitStatus.OK


def _fresh_worker_slots(config, cache, campaign, executors: dict, cluster=None) -> list:
    """The re-check's executors in worker mode, one for each campaign slot: per GPU, a warm
    executor of its own (its own server and spares) that never reuses a worker, so each
    mutant runs in a process no other mutant touched. The campaign's own workers are ended
    first: their contexts and memory go back to the GPU (on a cluster: its actors, and the
    re-check's own take their GPUs)."""
    from harness.campaigns.mutate.campaign import arm
    from harness.core.device import slot_devices

    for ex in list(executors.values()):
        ex.close()
    executors.clear()
    if cluster is not None:
        factory, _ = _executor_factory(config, "warm", reuse=False, cluster=cluster)
        ex = executors[("recheck", "ray")] = factory(None, cache, campaign.arch)
        arm(ex, config, campaign.coverage)
        factory.prestart(cache, campaign.arch, ()).join()
        return [ex] * config.gpu_jobs
    devices = slot_devices(config.gpu_jobs)
    fresh_workers, _ = _executor_factory(config, "warm", reuse=False)
    for device in dict.fromkeys(devices):
        ex = executors[("recheck", device)] = fresh_workers(None, cache, campaign.arch, device)
        arm(ex, config, campaign.coverage)  # the same deadlines and fault cap as the campaign's own run
    return [executors[("recheck", device)] for device in devices]


def _recheck_log(path: Path):
    """A re-check callback appending one JSON line a re-run mutant to `path` (started empty):
    id, both verdicts, whether they agree and the second run's reason. A re-run that hit the
    deadline where the campaign had a verdict runs once more (harness.campaigns.mutate.recheck.RETRY_JOBS): its id
    has a second line, the one that counts."""
    import json
    import threading

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("")
    lock = threading.Lock()

    def log(first, second) -> None:
        line = json.dumps({"id": first.mutant.id, "first": first.verdict.value, "second": second.verdict.value,
                           "agreed": first.verdict is second.verdict, "reason": second.reason})
        with lock, path.open("a") as f:
            f.write(line + "\n")

    return log


def _worker_lines(config, executors) -> list[str]:
    """What the warm executors say of their workers: the `workers:` lines (replaced, and why),
    then the `worker time:` lines (where the slots' time went)."""
    if config.static:
        return []
    from harness.runs.warm import WarmExecutor

    warm = [ex for ex in (executors or {}).values() if isinstance(ex, WarmExecutor)]
    from harness.runs.ray_executor import RayExecutor

    on_ray = [line for ex in (executors or {}).values() if isinstance(ex, RayExecutor) for line in ex.lines()]
    return on_ray + [f"workers: {ex.summary()}" for ex in warm] + [f"worker time: {ex.timing()}" for ex in warm]


def _run(config, args, recheck_n, factory, out, err, executors=None, cluster=None) -> int:
    from rich.markup import escape

    from harness.campaigns.mutate import report
    from harness.campaigns.mutate.campaign import run_campaign
    from harness.core.errors import DeviceLost

    report.remove(config.path(config.report_dir))
    try:
        with _Progress(err) as progress:
            campaign = run_campaign(config, progress, executor_factory=factory)
            # the campaign's own workers, said before the re-check ends them and starts its own
            worker_lines = _worker_lines(config, executors)
            if not config.static and args.executor == "warm" and (recheck_n or _survivors(campaign)):
                from harness.campaigns.mutate.recheck import recheck, recheck_jobs
                from harness.core.device import slot_devices
                from harness.runs.fresh import FreshProcessExecutor

                if campaign.baseline is not None and campaign.baseline.ok:
                    report.write(config.path(config.report_dir), campaign)  # kept if the re-run is cut short
                progress.phase("re-running survivors and a sample in fresh processes")
                cache = config.cache()
                if args.recheck_in == "pytest":
                    fresh = [FreshProcessExecutor(config.rootdir, config.path(config.report_dir) / "runs" / "recheck",
                                                  cache, arch=campaign.arch, require_gpu=config.require_gpu,
                                                  device=device)
                             for device in slot_devices(recheck_jobs(config.gpu_jobs))]
                else:
                    fresh = _fresh_worker_slots(config, cache, campaign, executors, cluster)
                campaign.recheck = recheck(campaign, fresh, sample=recheck_n, seed=config.seed,
                                           on_result=_recheck_log(config.path(config.report_dir) / "recheck.jsonl"))
    except KeyboardInterrupt:
        for line in _worker_lines(config, executors):  # where the time went so far: a cut campaign says it too
            err.print(line, markup=False)
        err.print("[bold red]interrupted[/]: workers and children killed, sandboxes removed, the kernel root "
                  "untouched; continue with --resume, or write the report of what ran with --report-only")
        return ExitStatus.INTERRUPTED
    except DeviceLost as exc:
        err.print(f"[bold red]device lost[/]: {escape(str(exc))}")
        return ExitStatus.DEVICE_LOST
    for w in campaign.warnings:
        err.print(f"[yellow]warning:[/] {escape(w)}")
    if campaign.baseline_red:
        say_baseline_red(err, campaign.baseline)
        return ExitStatus.BASELINE_RED
    json_path, html_path = report.write(config.path(config.report_dir), campaign)
    out.print(report.table(campaign))
    n = len(campaign.results)
    reused = f", {campaign.reused} reused from the verdict store" if config.since else ""
    out.print(f"{n} mutants ({campaign.resumed} resumed{reused}) in {campaign.seconds:.1f} s: screen {campaign.screen_seconds:.1f} s"
              f" on {config.jobs} worker(s), gates {campaign.gpu_seconds:.1f} s; report: {escape(str(json_path))}, "
              f"{escape(str(html_path))}")
    if campaign.coverage is None or campaign.coverage.source_read() is None:
        out.print("note: the baseline did not record which sources each gate reads, so no mutant was screened out "
                  "by its cubin alone", markup=False)
    for line in worker_lines:
        out.print(line, markup=False)
    from harness.campaigns.mutate.campaign import stage_line, trap_shadow_line

    stage = stage_line(campaign.stage)
    if stage:
        out.print(stage, markup=False)
    shadow = trap_shadow_line(campaign.trap_shadow)
    if shadow:
        out.print(shadow, markup=False)
    for key, ex in (executors or {}).items():
        if isinstance(key, tuple) and key[0] == "recheck":
            for line in ([ex.summary()] if hasattr(ex, "summary") else ex.lines()):
                out.print(f"re-check workers: {line}", markup=False)
    if campaign.recheck is not None:
        line = campaign.recheck.line()
        where = "a fresh pytest" if args.recheck_in == "pytest" else "a fresh worker no other mutant used"
        out.print(f"verdict integrity: {line} (every survivor and a sample, each in {where})"
                  + (f"; disagreements: {campaign.recheck.disagreements}" if campaign.recheck.disagreements else ""),
                  markup=False)
    if config.static:
        from harness.campaigns.mutate.static import pending_lines

        for line in pending_lines(campaign.ordered()):
            out.print(line, markup=False)
        return ExitStatus.OK
    bad = [r for r in campaign.ordered() if r.verdict in (Verdict.SURVIVED, Verdict.NO_COVERAGE)]
    return ExitStatus.SURVIVORS if bad else ExitStatus.OK
