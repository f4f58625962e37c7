"""`python -m harness COMMAND`: compile, controls, mutate, bench, report and cache (`commands()` lists them)."""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

from harness.commands import Command, Commands


def compile_parser() -> argparse.ArgumentParser:
    from harness.core.usage import add_project_options

    parser = argparse.ArgumentParser(prog="python -m harness compile",
                                     description="Compile every .cu under the kernel root with NVRTC and "
                                                 "print each kernel's ptxas resource usage. Templates are "
                                                 "instantiated from NAME_EXPRESSIONS in the launcher x.py "
                                                 "beside x.cu, as the gates load them. Reads the settings a "
                                                 "pytest run reads (ini kernel_root and harness_cache_dir of "
                                                 "the project found from the working folder up, and "
                                                 "HARNESS_KERNEL_ROOT, HARNESS_CACHE_DIR, HARNESS_ARCH).")
    add_project_options(parser, rootdir=False)
    parser.add_argument("--no-cache", action="store_true", help="compile even when the cache has the cubin")
    parser.add_argument("--include-dir", action="append", default=[], metavar="DIR",
                        help="an extra include directory (repeatable), searched before ini harness_include_dirs")
    return parser


def _compile_main(argv: list[str]) -> int:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from harness.compiling import kernelfile
    from harness.compiling.arch import ArchError, resolve_arch
    from harness.compiling.compile import CompileError, UnreadableSource, compile_file, find_sources, not_files
    from harness.compiling.deviceview import grouped
    from harness.compiling.modsettings import LauncherError, declared_settings
    from harness.compiling.toolchain import NvccNotFound
    from harness.core import settings as _settings
    from harness.core.settings import IncludeDirError
    from harness.core.usage import folder_problem, kernel_root_problem

    args = compile_parser().parse_args(argv)
    console = Console(highlight=False, width=None if sys.stdout.isatty() else 160)

    def usage_error(text: str) -> int:
        print(f"error: {text}", file=sys.stderr)
        return 2

    if args.arch is not None and not args.arch.strip():
        return usage_error("--arch is empty: pass e.g. --arch sm_90, or leave it out (then HARNESS_ARCH, else the "
                           "device's arch, else sm_90)")

    try:
        _, settings = _settings.project_settings(kernel_root=args.kernel_root, cache_dir=args.cache_dir, arch=args.arch,
                                                 include_dir=args.include_dir)
    except IncludeDirError as exc:
        return usage_error(str(exc))
    root = settings.kernel_root
    option = ("--kernel-root" if args.kernel_root else
              _settings.KERNEL_ROOT_ENV if os.environ.get(_settings.KERNEL_ROOT_ENV) else "--kernel-root")
    problem = kernel_root_problem(root, option)
    if problem is None and not args.no_cache:
        problem = folder_problem(settings.cache_dir, "--cache-dir" if args.cache_dir else "the cache folder",
                                 "the compiled cubins")
    if problem:
        return usage_error(problem)
    try:
        sources = sorted(find_sources(root) + not_files(root))
        arch = resolve_arch(args.arch, settings)
    except (FileNotFoundError, ArchError) as exc:
        return usage_error(str(exc))
    table = Table(title=f"NVRTC {arch}, kernel root {root}", title_justify="left")
    for col, just in (("module", "left"), ("kernel", "left"), ("registers", "right"), ("spill bytes", "right"),
                      ("shared bytes", "right"), ("cache", "left"), ("seconds", "right"), ("backend", "left"),
                      ("set aside", "left")):
        table.add_column(col, justify=just, overflow="fold")
    failures: list[str] = []
    details: list[str] = []
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for src in sources:
            rel = src.relative_to(root).as_posix()
            try:
                mod = compile_file(src, arch=arch, use_cache=not args.no_cache, run=settings)
            except (CompileError, LauncherError, IncludeDirError, NvccNotFound) as exc:
                failures.append(str(exc) if isinstance(exc, CompileError) else f"{rel}: {exc}")
                what = {CompileError: "compile error", LauncherError: "launcher error", UnreadableSource: "unreadable",
                        IncludeDirError: "include error", NvccNotFound: "nvcc not found"}[type(exc)]
                table.add_row(escape(rel), f"[bold red]{what}[/]", "", "", "", "", "", "", "")
                continue
            cache = "hit" if mod.cache_hit else ("miss" if not args.no_cache else "off")
            headers = sorted({s.file for s in mod.set_aside if s.file})
            aside = "nothing" if not mod.set_aside else f"{len(mod.set_aside)} (below)" if not headers else (
                f"{len(mod.set_aside)} (below; {sum(1 for s in mod.set_aside if s.file)} in "
                f"{len(headers)} header{'s' if len(headers) > 1 else ''})")
            backend = mod.compiler
            details.append(f"{rel}: compiled by {mod.compiler} ({mod.backend_reason}); device view set aside: "
                           + ("nothing" if not mod.set_aside else "; ".join(grouped(mod.set_aside))))
            problem = kernelfile.problem(mod, declared_settings(src).host_only, src.with_suffix(".py"))
            if problem:  # compiled, but its gate proves nothing (or HOST_ONLY says otherwise)
                failures.append(problem)
                table.add_row(escape(rel), "[bold red]" + ("no kernel" if not mod.resources else "HOST_ONLY, yet "
                              "kernels") + "[/]", "", "", "", cache, f"{mod.seconds:.2f}", backend, escape(aside))
                continue
            if not mod.resources:
                table.add_row(escape(rel), "(host-only: HOST_ONLY)", "", "", "", cache, f"{mod.seconds:.2f}", backend,
                              escape(aside))
            for i, r in enumerate(mod.resources):
                spill = f"[bold red]{r.spill_bytes}[/]" if r.spill_bytes else "0"
                table.add_row(escape(rel) if i == 0 else "", escape(r.kernel), str(r.registers), spill,
                              str(r.shared_bytes), cache if i == 0 else "", f"{mod.seconds:.2f}" if i == 0 else "",
                              backend if i == 0 else "", escape(aside) if i == 0 else "")
    console.print(table)
    for line in details:
        print(line)
    for w in caught:
        print(f"warning: {w.message}", file=sys.stderr)
    for text in failures:
        print(f"{text}\n", file=sys.stderr)
    n = len(sources)
    console.print(f"{n - len(failures)} of {n} modules compiled in {time.perf_counter() - start:.1f} s")
    return 1 if failures else 0


def _controls_main(argv: list[str]) -> int:
    from harness.campaigns.controls.cli import main

    return main(argv)


def _bench_main(argv: list[str]) -> int:
    from harness.commands.bench import main

    return main(argv)


def _report_main(argv: list[str]) -> int:
    from harness.commands.report import main

    return main(argv)


def _cache_main(argv: list[str]) -> int:
    from harness.commands.cache import main

    return main(argv)


def _mutate_main(argv: list[str]) -> int:
    from harness.campaigns.mutate.cli import main

    return main(argv)


def commands() -> Commands:
    """The one table of the commands: `--help` and the dispatch both read it. A command with
    subcommands of its own names them from its table."""
    from harness.commands.bench import BENCHES
    from harness.commands.cache import ACTIONS
    from harness.commands.report import REPORTS

    return Commands(
        prog="python -m harness", what="command", metavar="COMMAND",
        intro="The harness's commands. Each reads the settings a pytest run reads (the project found from the "
              "working folder up, its ini keys, and HARNESS_KERNEL_ROOT, HARNESS_CACHE_DIR, HARNESS_ARCH).",
        table=(
            Command("compile", "compile every .cu under the kernel root with NVRTC; print registers, spills and "
                               "shared memory", _compile_main),
            Command("controls", "run the negative controls: perturb a sandbox copy, prove each named gate goes red "
                                "by its assertion", _controls_main),
            Command("mutate", "mutate the device code, screen equivalent mutants on the CPU, report what the gates "
                              "miss", _mutate_main),
            Command("bench", f"`bench {'|'.join(BENCHES.names)}`: benchmarks, their figures written as JSON and "
                             "Markdown (bench --help says what each times)", _bench_main),
            Command("report", f"`report {'|'.join(REPORTS.names)}`: over the reports gate runs write (report --help "
                              "says what each does)", _report_main),
            Command("cache", f"`cache {'|'.join(ACTIONS)}`: what the disk cache keeps (cubins, mutants' cubins, "
                             "verdicts, host data), its bound (HARNESS_CACHE_MAX), and clearing it", _cache_main),
        ),
    )


KEEP_A_CACHE = ("compile", "controls", "mutate", "bench", "cache")  # the commands HARNESS_CACHE_MAX bounds


def main(argv: list[str] | None = None) -> int:
    from harness.compiling.cubin_cache import CACHE_MAX_ENV, cache_max_problem

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in KEEP_A_CACHE and not {"-h", "--help"} & set(argv[1:]):
        problem = cache_max_problem(os.environ.get(CACHE_MAX_ENV))
        if problem:
            print(f"error: {problem}", file=sys.stderr)
            return 2
    return commands().dispatch(argv)


if __name__ == "__main__":
    sys.exit(main())
