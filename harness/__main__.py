"""`python -m harness compile ...` and `python -m harness controls ...`."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def _compile_main(argv: list[str]) -> int:
    from rich.console import Console
    from rich.table import Table

    from harness import _settings
    from harness.compile import (ArchError, CompileError, compile_file, declared_name_expressions, find_sources,
                                 resolve_arch)

    parser = argparse.ArgumentParser(prog="python -m harness compile",
                                     description="Compile every .cu under the kernel root with NVRTC and "
                                                 "print each kernel's ptxas resource usage. Templates are "
                                                 "instantiated from NAME_EXPRESSIONS in the launcher x.py "
                                                 "beside x.cu, as the gates load them.")
    parser.add_argument("--kernel-root", default=_settings.DEFAULT_KERNEL_ROOT, metavar="DIR")
    parser.add_argument("--arch", default=None, metavar="sm_XX",
                        help="default: the device's arch, or sm_90 with no device")
    parser.add_argument("--cache-dir", default=None, metavar="DIR")
    parser.add_argument("--no-cache", action="store_true", help="compile even when the cache has the cubin")
    args = parser.parse_args(argv)
    console = Console(highlight=False, width=None if sys.stdout.isatty() else 160)
    root = Path(args.kernel_root)
    try:
        sources = find_sources(root)
        arch = resolve_arch(args.arch)
    except (FileNotFoundError, ArchError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not sources:
        print(f"error: no .cu file under {root}: point --kernel-root at your kernels", file=sys.stderr)
        return 2
    table = Table(title=f"NVRTC {arch}, kernel root {root}", title_justify="left")
    for col, just in (("module", "left"), ("kernel", "left"), ("registers", "right"), ("spill bytes", "right"),
                      ("shared bytes", "right"), ("cache", "left"), ("seconds", "right")):
        table.add_column(col, justify=just, overflow="fold")
    failures = []
    start = time.perf_counter()
    for src in sources:
        rel = src.relative_to(root.resolve()).as_posix()
        try:
            mod = compile_file(src, kernel_root=root, arch=arch, cache_dir=args.cache_dir,
                               name_expressions=declared_name_expressions(src), use_cache=not args.no_cache)
        except CompileError as exc:
            failures.append(exc)
            table.add_row(rel, "[bold red]compile error[/]", "", "", "", "", "")
            continue
        cache = "hit" if mod.cache_hit else "miss"
        if not mod.resources:
            table.add_row(rel, "(no kernels)", "", "", "", cache, f"{mod.seconds:.2f}")
        for i, r in enumerate(mod.resources):
            spill = f"[bold red]{r.spill_bytes}[/]" if r.spill_bytes else "0"
            table.add_row(rel if i == 0 else "", r.kernel, str(r.registers), spill, str(r.shared_bytes),
                          cache if i == 0 else "", f"{mod.seconds:.2f}" if i == 0 else "")
    console.print(table)
    for exc in failures:
        print(f"{exc}\n", file=sys.stderr)
    n = len(sources)
    console.print(f"{n - len(failures)} of {n} modules compiled in {time.perf_counter() - start:.1f} s")
    return 1 if failures else 0


def _controls_main(argv: list[str]) -> int:
    from harness.controls.cli import main

    return main(argv)


COMMANDS = {"compile": _compile_main, "controls": _controls_main}
COMMANDS["mutate"] = lambda argv: __import__("harness.mutate.cli").mutate.cli.main(argv)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        known = ", ".join(COMMANDS)
        if argv and argv[0] not in ("-h", "--help"):
            print(f"unknown command {argv[0]!r}: use one of {known}", file=sys.stderr)
        print(f"usage: python -m harness {{{known}}} [options]  (python -m harness COMMAND --help)",
              file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    return COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
