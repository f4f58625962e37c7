"""`python -m harness controls [NAME ...]`: the negative-control campaign from the shell."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from harness.campaigns.controls.runner import KILL_ROWS, CampaignConfig, run_campaign
from harness.campaigns.controls.spec import ControlSpecError
from harness.core import settings as _settings
from harness.core.records import Outcome
from harness.core.usage import ExitStatus, add_project_options, say_baseline_red


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m harness controls",
        description="Run the negative controls: perturb a sandbox copy of the kernel sources and "
                    "prove each named gate goes red by its own assertion.",
    )
    p.add_argument("names", nargs="*", metavar="NAME", help="controls to run (file stems); default: all")
    add_project_options(p, arch_help="compile target passed to every run (default: HARNESS_ARCH, else the "
                                     "device's arch, else sm_90)")
    p.add_argument("--controls-dir", default=None, metavar="DIR",
                   help="folder of control .toml files (default: ini controls_dir, else controls in the rootdir)")
    p.add_argument("--report", default=None, metavar="DIR",
                   help="where controls.json, controls.md and each run's log go (default: harness-report in the "
                        "rootdir)")
    p.add_argument("--static", action="store_true",
                   help="validate, apply and compile every control; run no gate (no GPU needed)")
    p.add_argument("--deadline", default="300", metavar="SECONDS",
                   help="per-control deadline; a run past it is killed and recorded as timeout (default 300)")
    p.add_argument("--jobs", default="1", metavar="N",
                   help="controls run at once, each in its own sandbox and processes (default 1)")
    p.add_argument("--kill-row", choices=KILL_ROWS, default="modules",
                   help="which gates each control runs: its expected gates' modules (default), or every "
                        "module of the campaign")
    p.add_argument("--naive", action="store_true",
                   help="the slow reference way: a fresh pytest over the whole gates folder per control, "
                        "each with a cold compile cache (for timing against the default)")
    p.add_argument("--executor", choices=("fresh", "warm"), default=None,
                   help="warm (default): each control's gates in a worker forked from a server that collected "
                        "them, context made ahead, reset between controls (the mutation campaign's executor); "
                        "fresh: a pytest per control")
    p.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                   help="run the controls on a Ray cluster (pip install -e '.[ray]'): one actor per GPU holding a "
                        "warm pool, as many controls at once as it has GPUs, the rootdir shipped as Ray's working_dir. "
                        "ADDRESS: the cluster's (HOST:6379, ray://HOST:10001, auto); none: RAY_ADDRESS, else a "
                        "running local one, else a new local one (docs/scaling.md)")
    p.add_argument("--no-require-gpu", action="store_true",
                   help="for a machine with no GPU: run the gates that need none (structural, refusal, compile), "
                        "skip the GPU gates, and judge each control by its expected gates that ran; a control "
                        "whose expected gates all need a GPU is reported skipped"),
    return p


def config_from(args: argparse.Namespace) -> CampaignConfig:
    """The campaign's settings, read as a pytest run reads them (`_settings.project_settings`):
    paths given on the command line are relative to the working folder, ini paths to the rootdir.
    Raises harness.core.usage.UsageError for a bad --deadline or --jobs."""
    from harness.core.usage import positive_int, positive_seconds

    deadline = positive_seconds(args.deadline, "--deadline", "300")
    jobs = positive_int(args.jobs, "--jobs", "4")
    project = _settings.resolve(kernel_root=args.kernel_root, cache_dir=args.cache_dir, arch=args.arch,
                                controls_dir=args.controls_dir, rootdir=args.rootdir)
    rootdir, settings = project.rootdir, project.settings
    return CampaignConfig(
        rootdir=rootdir,
        kernel_root=settings.kernel_root,
        controls_dir=project.controls_dir,
        report_dir=Path(args.report).resolve() if args.report else _settings.report_root(rootdir),
        names=tuple(args.names),
        arch=settings.arch,
        deadline=deadline,
        jobs=jobs,
        static=args.static,
        naive=args.naive,
        require_gpu=not args.no_require_gpu,
        kill_row=args.kill_row,
        cache_dir=settings.cache_dir,
        # warm needs a device to make contexts on; the harness's own tests (no GPU) run fresh
        executor=args.executor or ("fresh" if args.no_require_gpu else "warm"),
    )


class _Progress:
    """The rich progress bar, fed by the runner's listener calls; on a console that is not
    a terminal (CI, a log piped through tee) one plain line per step instead."""

    def __init__(self, console):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.console = console
        self.live = console.is_terminal
        self.progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), console=console, transient=True)
        self.task = None
        self.nodes: dict[str, int] = {}
        self.selected: int | None = None
        self.results: list = []  # the controls finished so far: what an interrupted run reports

    def __enter__(self):
        if self.live:
            self.progress.__enter__()
            self.task = self.progress.add_task("starting", total=None)
        return self

    def __exit__(self, *exc):
        if self.live:
            self.progress.__exit__(*exc)

    def phase(self, text: str) -> None:
        if self.live:
            self.progress.update(self.task, description=text)
        else:
            self.console.print(text, markup=False)

    def total(self, n: int) -> None:
        self.selected = n
        if self.live:
            self.progress.update(self.task, total=n)

    def started(self, control) -> None:
        from rich.markup import escape

        if self.live:
            self.progress.update(self.task, description=f"control {escape(control.name)}")

    def finished(self, result) -> None:
        from harness.runs.cluster import where

        self.results.append(result)
        place = where(result.ran_on)
        if place:  # on a cluster: the live count of controls each node's GPU ran
            self.nodes[place] = self.nodes.get(place, 0) + 1
        if self.live:
            nodes = ", ".join(f"{k}: {n}" for k, n in sorted(self.nodes.items()))
            self.progress.update(self.task, description=f"controls by node: {nodes}" if nodes else "controls")
            self.progress.advance(self.task)
        else:
            from harness.campaigns.controls.report import verdict_text
            from harness.campaigns.controls.results import Expectation

            mark = result.expectation.value
            if result.expectation is Expectation.NOT_JUDGED:
                mark += " (every gate it expects needs a GPU)"
            self.console.print(f"{result.name}: {verdict_text(result)}, {mark} ({result.seconds:.1f} s)"
                               + (f" on {place} ({self.nodes[place]} there so far)" if place else ""), markup=False)


def _conflict(args: argparse.Namespace) -> str | None:
    """Options that contradict each other: one would be silently ignored."""
    if args.static:
        for flag, given in (("--naive", args.naive), ("--executor", args.executor is not None),
                            ("--ray", args.ray is not None)):
            if given:
                return f"--static runs no gate: drop {flag}, which chooses how the gates run"
    elif args.naive and args.executor is not None:
        return ("--naive runs a fresh pytest over the whole gates folder per control: drop --executor, or drop "
                "--naive to choose the executor")
    return None


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console
    from rich.markup import escape

    from harness.campaigns.controls import report

    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    out = Console(highlight=False, width=None if sys.stdout.isatty() else 160)
    err = Console(stderr=True, highlight=False, soft_wrap=True)
    from harness.compiling.arch import arch_problem
    from harness.core.usage import (UsageError, folder_problem, kernel_root_option, kernel_root_problem,
                                    output_folder_problem, rootdir_problem)

    problem = rootdir_problem(args.rootdir) or _conflict(args)
    if problem:
        err.print(f"[bold red]error:[/] {escape(problem)}")
        return ExitStatus.USAGE
    try:
        config = config_from(args)
    except UsageError as exc:
        err.print(f"[bold red]error:[/] {escape(str(exc))}")
        return ExitStatus.USAGE
    root = config.path(config.kernel_root)
    problems = (
        arch_problem(config.arch, "--arch" if args.arch else _settings.ARCH_ENV),
        kernel_root_problem(root, kernel_root_option(
            _settings.resolve(kernel_root=args.kernel_root, rootdir=args.rootdir).kernel_root_source)),
        None if config.cache_dir is None else folder_problem(config.cache_dir, "--cache-dir", "the compiled cubins"),
        output_folder_problem(config.report_dir, "--report", "controls.json, controls.md and the run logs"),
    )
    for problem in problems:
        if problem:
            err.print(f"[bold red]error:[/] {escape(problem)}")
            return ExitStatus.USAGE
    cluster = None
    if args.ray is not None and not config.static:
        from harness.runs.cluster import ClusterError, connect

        if args.naive or args.executor == "fresh":
            err.print("[bold red]error:[/] --ray runs the warm executor on every GPU of the cluster: drop --naive "
                      "and --executor fresh")
            return ExitStatus.USAGE
        try:
            cluster = connect(args.ray or None, config.rootdir, config.path(config.kernel_root))
        except ClusterError as exc:
            err.print(f"[bold red]error:[/] {escape(str(exc))}")
            return ExitStatus.USAGE
    elif not config.static and config.require_gpu:
        from harness.core import device

        probe = device.probe()
        if not probe.usable:
            err.print(f"[bold red]error:[/] controls run their gates on a CUDA device, and this machine has none "
                      f"usable ({escape(str(probe.error))}): run `python -m harness controls --static` here (it "
                      "applies and compiles every control with no GPU), and the full campaign on a machine with a GPU")
            return ExitStatus.USAGE
    import time

    from harness.core.errors import DeviceLost
    from harness.core.interrupt import sigterm_as_interrupt

    report.remove(config.path(config.report_dir))
    progress = _Progress(err)
    start = time.perf_counter()
    try:
        with sigterm_as_interrupt(), progress:  # a cancelled CI job: as Ctrl-C
            campaign = run_campaign(config, progress, cluster)
    except ControlSpecError as exc:
        err.print(escape(str(exc)))
        return ExitStatus.USAGE
    except KeyboardInterrupt:
        from harness.campaigns.controls.results import CampaignResult

        mode = "static" if config.static else "naive" if config.naive else "campaign"
        cut = CampaignResult(mode=mode, kernel_root=config.path(config.kernel_root), arch=config.arch, baseline=None,
                             controls=tuple(progress.results), seconds=time.perf_counter() - start, interrupted=True,
                             selected=progress.selected)
        _, md_path = report.write(config.path(config.report_dir), cut)
        err.print("[bold red]interrupted[/]: children killed, sandboxes removed, the kernel root untouched; "
                  f"report of what ran: {escape(str(md_path))}")
        return ExitStatus.INTERRUPTED
    except DeviceLost as exc:
        err.print(f"[bold red]device lost[/]: a gate worker could not start on the GPU that served the campaign "
                  f"({escape(str(exc))}): check it (nvidia-smi) and run the controls again")
        return ExitStatus.DEVICE_LOST
    finally:
        if cluster is not None:
            cluster.close()
    json_path, md_path = report.write(config.path(config.report_dir), campaign)
    if campaign.baseline_red:
        say_baseline_red(err, campaign.baseline)
        err.print(f"report: {escape(str(json_path))}")
        return ExitStatus.BASELINE_RED
    out.print(report.table(campaign))
    judged = campaign.judged
    differ = [r.name for r in judged if not r.matches]
    head, skipped = report.summary(campaign)
    out.print(f"{head} in {campaign.seconds:.1f} s ({campaign.mode}); report: {escape(str(md_path))}")
    if skipped:
        out.print(skipped, style="yellow", markup=False)
    not_judged = sum(1 for r in judged for c in r.checks if c.outcome == Outcome.SKIPPED)
    if not_judged and not config.require_gpu:
        out.print(f"{not_judged} expected GPU gate(s) not judged (no GPU): those controls were decided by the "
                  "gates that ran")
    if differ:
        out.print(f"[bold red]not as expected:[/] {escape(', '.join(differ))}")
        return ExitStatus.CONTROLS_DIFFER
    return ExitStatus.OK


if __name__ == "__main__":
    sys.exit(main())
