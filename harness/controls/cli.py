"""`python -m harness controls [NAME ...]`: the negative-control campaign from the shell."""

from __future__ import annotations

import argparse
import configparser
import enum
import sys
from pathlib import Path

from harness import _settings
from harness.controls.runner import KILL_ROWS, CampaignConfig, run_campaign
from harness.controls.spec import ControlSpecError

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib


class ExitStatus(enum.IntEnum):
    OK = 0  # every control is what it expects
    CONTROLS_DIFFER = 1  # some control is not what it expects
    USAGE = 2  # bad arguments or invalid control files: nothing ran
    BASELINE_RED = 3  # the unperturbed gates are red: controls over them would prove nothing
    INTERRUPTED = 130


def ini_value(rootdir: Path, key: str) -> str | None:
    """`key` from the rootdir's pytest configuration (the first file pytest would use)."""
    candidates = [("pytest.ini", "pytest"), (".pytest.ini", "pytest"), ("pyproject.toml", None),
                  ("tox.ini", "pytest"), ("setup.cfg", "tool:pytest")]
    for name, section in candidates:
        path = rootdir / name
        if not path.is_file():
            continue
        if section is None:
            try:
                tool = tomllib.loads(path.read_text()).get("tool", {})
            except (OSError, ValueError):
                continue
            table = tool.get("pytest", {})
            table = table.get("ini_options", table) if isinstance(table, dict) else {}
            if table:
                value = table.get(key)
                return str(value) if value is not None else None
            continue
        parser = configparser.ConfigParser(interpolation=None)
        try:
            parser.read(path)
        except configparser.Error:
            continue
        if parser.has_section(section):
            return parser.get(section, key, fallback=None)
    return None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m harness controls",
        description="Run the negative controls: perturb a sandbox copy of the kernel sources and "
                    "prove each named gate goes red by its own assertion.",
    )
    p.add_argument("names", nargs="*", metavar="NAME", help="controls to run (file stems); default: all")
    p.add_argument("--rootdir", default=".", metavar="DIR",
                   help="where pytest runs and gate node ids start (default: the current folder)")
    p.add_argument("--kernel-root", default=None, metavar="DIR",
                   help="folder of the .cu files (default: ini kernel_root, else kernels_cu)")
    p.add_argument("--controls-dir", default=None, metavar="DIR",
                   help="folder of control .toml files (default: ini controls_dir, else controls)")
    p.add_argument("--report", default="harness-report", metavar="DIR",
                   help="where controls.json, controls.md and each run's log go (default: harness-report)")
    p.add_argument("--cache-dir", default=None, metavar="DIR",
                   help="cubin cache shared with the gate runs (default: ini harness_cache_dir, "
                        "else HARNESS_CACHE_DIR, else the harness default)")
    p.add_argument("--static", action="store_true",
                   help="validate, apply and compile every control; run no gate (no GPU needed)")
    p.add_argument("--deadline", type=float, default=300.0, metavar="SECONDS",
                   help="per-control deadline; a run past it is killed and recorded as timeout (default 300)")
    p.add_argument("--jobs", type=int, default=1, metavar="N",
                   help="controls run at once when their gate modules do not overlap (default 1)")
    p.add_argument("--arch", default=None, metavar="sm_XX", help="compile target passed to every run")
    p.add_argument("--kill-row", choices=KILL_ROWS, default="modules",
                   help="which gates each control runs: its expected gates' modules (default), or every "
                        "module of the campaign")
    p.add_argument("--naive", action="store_true",
                   help="the slow reference way: a fresh pytest over the whole gates folder per control, "
                        "each with a cold compile cache (for timing against the default)")
    p.add_argument("--no-require-gpu", action="store_true", help=argparse.SUPPRESS)  # the harness's own tests
    return p


def config_from(args: argparse.Namespace) -> CampaignConfig:
    rootdir = Path(args.rootdir).resolve()
    kernel_root = args.kernel_root or ini_value(rootdir, "kernel_root") or _settings.DEFAULT_KERNEL_ROOT
    controls_dir = args.controls_dir or ini_value(rootdir, "controls_dir") or "controls"
    cache_dir = args.cache_dir or ini_value(rootdir, "harness_cache_dir") or None
    return CampaignConfig(
        rootdir=rootdir,
        kernel_root=Path(kernel_root),
        controls_dir=Path(controls_dir),
        report_dir=Path(args.report),
        names=tuple(args.names),
        arch=args.arch,
        deadline=args.deadline,
        jobs=args.jobs,
        static=args.static,
        naive=args.naive,
        require_gpu=not args.no_require_gpu,
        kill_row=args.kill_row,
        cache_dir=Path(cache_dir) if cache_dir else None,
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
        if self.live:
            self.progress.update(self.task, total=n)

    def started(self, control) -> None:
        from rich.markup import escape

        if self.live:
            self.progress.update(self.task, description=f"control {escape(control.name)}")

    def finished(self, result) -> None:
        if self.live:
            self.progress.advance(self.task)
        else:
            verdict = result.verdict.value if result.verdict else ("applies and compiles" if result.matches else "invalid")
            mark = "as expected" if result.matches else "NOT as expected"
            self.console.print(f"{result.name}: {verdict}, {mark} ({result.seconds:.1f} s)", markup=False)


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console
    from rich.markup import escape

    from harness.controls import report

    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    out = Console(highlight=False, width=None if sys.stdout.isatty() else 160)
    err = Console(stderr=True, highlight=False, soft_wrap=True)
    if args.deadline <= 0:
        err.print("[bold red]error:[/] --deadline must be a positive number of seconds, e.g. --deadline 300")
        return ExitStatus.USAGE
    if args.jobs < 1:
        err.print("[bold red]error:[/] --jobs must be at least 1")
        return ExitStatus.USAGE
    if args.arch:
        from harness.compile import ArchError, check_arch

        try:
            check_arch(args.arch)
        except ArchError as exc:
            err.print(f"[bold red]error:[/] {escape(str(exc))}")
            return ExitStatus.USAGE
    config = config_from(args)
    root = config.path(config.kernel_root)
    if not root.is_dir():
        err.print(f"[bold red]error:[/] the kernel root {escape(str(root))} is not a folder: pass --kernel-root DIR "
                  "(or the ini key kernel_root) naming the folder of your .cu files")
        return ExitStatus.USAGE
    try:
        with _Progress(err) as progress:
            campaign = run_campaign(config, progress)
    except ControlSpecError as exc:
        err.print(escape(str(exc)))
        return ExitStatus.USAGE
    except KeyboardInterrupt:
        err.print("[bold red]interrupted[/]: children killed, sandboxes removed, the kernel root untouched")
        return ExitStatus.INTERRUPTED
    json_path, md_path = report.write(config.path(config.report_dir), campaign)
    b = campaign.baseline
    if b is not None and not b.ok:
        err.print(f"[bold red]baseline red[/]: the unperturbed gates must all pass before controls prove anything "
                  f"({b.gates} gates ran; log {escape(str(b.log))})")
        if b.note:
            err.print(escape(b.note))
        for r in b.red:
            err.print(f"  {escape(r.nodeid)}: {r.outcome} by {r.route}: {escape(r.first_failure_line or '')}")
        err.print(f"report: {escape(str(json_path))}")
        return ExitStatus.BASELINE_RED
    out.print(report.table(campaign))
    differ = [r.name for r in campaign.controls if not r.matches]
    n = len(campaign.controls)
    out.print(f"{n - len(differ)} of {n} controls as expected in {campaign.seconds:.1f} s "
              f"({campaign.mode}); report: {escape(str(md_path))}")
    if differ:
        out.print(f"[bold red]not as expected:[/] {escape(', '.join(differ))}")
        return ExitStatus.CONTROLS_DIFFER
    return ExitStatus.OK


if __name__ == "__main__":
    sys.exit(main())
