"""`python -m harness bench startup`: what the plugin costs a pytest run, measured in one run.

Installed, the plugin loads in every pytest run of the environment. This benchmark times
`pytest --collect-only -q` (the process's whole wall time: interpreter, plugins, collection)
with the plugin (`-p harness.plugin`, as the entry point loads it) and without it
(`-p no:harness.plugin`), interleaved so drift in the machine's load falls on all alike,
over an unrelated project (a temporary folder with one plain test and no harness setting)
and this project (the rootdir found from the working folder up). With `--before DIR`, an
older checkout's plugin runs over the same unrelated project, and its own project is
timed with and without it: the old way against this one, in one run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WITH, WITHOUT = ["-p", "harness.plugin"], ["-p", "no:harness.plugin"]


def _time(cwd: Path, extra: list[str], env: dict) -> tuple[float, int, str]:
    from harness.core.child import ChildPytest

    cmd = ChildPytest((), collect_only=True, extra=tuple(extra)).command()
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    last = proc.stdout.strip().splitlines()[-1:] or [""]
    return seconds, proc.returncode, last[0]


def measure(cases: dict[str, tuple[Path, list[str], dict]], repeat: int, report=print) -> dict:
    """{case: {"seconds": [...], "median_s", "min_s", "exit", "last_line"}}: each case is (folder,
    pytest arguments, environment); every round runs each case once, in an order that turns
    round by round so drift in the machine's load falls on all alike."""
    rows: dict = {name: {"seconds": []} for name in cases}
    names = list(cases)
    for i in range(repeat):
        for name in names[i % len(names):] + names[:i % len(names)]:
            cwd, extra, env = cases[name]
            seconds, code, last = _time(cwd, extra, env)
            row = rows[name]
            row["seconds"].append(round(seconds, 3))
            row["exit"], row["last_line"] = code, last
            report(f"{name:60s} #{i + 1}: {seconds:.2f} s  [{last}]")
    for row in rows.values():
        row["median_s"] = round(statistics.median(row["seconds"]), 3)
        row["min_s"] = min(row["seconds"])
    return rows


def _commit(tree: Path) -> str:
    proc = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return proc.stdout.strip() or "not a git checkout"


def markdown(rows: dict, repeat: int, command: str, facts: str) -> str:
    lines = ["# Plugin start-up cost", "", f"`{command}`: `pytest --collect-only -q` wall time (interpreter, plugins, "
             f"collection), {repeat} runs of each, interleaved. {facts}", "",
             "| run | median s | min s | max s | pytest's last line (exit status) |", "| --- | --- | --- | --- | --- |"]
    for name, row in rows.items():
        lines.append(f"| {name} | {row['median_s']:.2f} | {row['min_s']:.2f} | {max(row['seconds']):.2f} | "
                     f"{row['last_line']} ({row['exit']}) |")
    return "\n".join(lines) + "\n"


def import_root(tree: Path) -> Path:
    """Where a checkout's `harness` package is imported from: `src/` (the layout since the
    harness's importable surface became `harness` alone), or the checkout itself (older trees)."""
    return tree / "src" if (tree / "src" / "harness").is_dir() else tree


def tree_env(tree: Path) -> dict:
    """This environment with `tree`'s harness first on PYTHONPATH, before whatever the caller
    put there (carried wheels, say): a run that imports that tree's harness."""
    path = os.pathsep.join(p for p in (str(import_root(tree)), os.environ.get("PYTHONPATH", "")) if p)
    return dict(os.environ, PYTHONPATH=path)


def main(argv: list[str]) -> int:
    from harness.core.settings import find_rootdir

    parser = argparse.ArgumentParser(prog="python -m harness bench startup",
                                     description="pytest's start-up (--collect-only wall time) with and without "
                                                 "the harness plugin, over an unrelated project and this one; with "
                                                 "--before, the older tree's plugin too.")
    parser.add_argument("--repeat", type=int, default=5, metavar="N", help="runs of each (default 5)")
    parser.add_argument("--before", default=None, metavar="DIR",
                        help="a checkout of an older harness: its plugin over the same unrelated project, and its "
                             "own project with and without it")
    from harness.core.usage import add_bench_output, bench_out_folder

    add_bench_output(parser, "bench-startup")
    args = parser.parse_args(argv)
    out = bench_out_folder(args.out)
    if args.repeat < 1:
        print(f"error: --repeat {args.repeat}: pass 1 or more", file=sys.stderr)
        return 2
    before = Path(args.before).resolve() if args.before else None
    if before is not None and not (import_root(before) / "harness" / "plugin.py").is_file():
        print(f"error: --before {before} holds no src/harness/plugin/__init__.py or harness/plugin/__init__.py: pass a checkout of "
              "the older tree",
              file=sys.stderr)
        return 2
    project = find_rootdir()
    import harness

    here = Path(harness.__file__).resolve().parents[1]  # the import root: src/ in a checkout
    with tempfile.TemporaryDirectory(prefix="harness-bench-startup-") as tmp:
        plain = Path(tmp) / "plain"
        plain.mkdir()
        (plain / "test_plain.py").write_text("def test_add():\n    assert 1 + 1 == 2\n")
        cases = {"unrelated project, this plugin": (plain, WITH, tree_env(here))}
        if before is not None:
            cases["unrelated project, the --before tree's plugin"] = (plain, WITH, tree_env(before))
        cases["unrelated project, no plugin (-p no:harness.plugin)"] = (plain, WITHOUT, tree_env(here))
        cases[f"this project ({project.name}), this plugin"] = (project, WITH, tree_env(here))
        cases[f"this project ({project.name}), no plugin"] = (project, WITHOUT, tree_env(here))
        if before is not None:
            cases[f"the --before tree's project ({before.name}), its plugin"] = (before, WITH, tree_env(before))
            cases[f"the --before tree's project ({before.name}), no plugin"] = (before, WITHOUT, tree_env(before))
        rows = measure(cases, args.repeat)
    command = f"python -m harness bench startup --repeat {args.repeat}" + (" --before DIR" if before else "")
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps({"command": command, "repeat": args.repeat,
                                                      "before": str(before) if before else None, "runs": rows},
                                                     indent=2) + "\n")
    facts = (f"{os.cpu_count()} cores, Python {sys.version.split()[0]}, this tree at {_commit(here)}"
             + (f", the --before tree at {_commit(before)}" if before else "") + ".")
    md = markdown(rows, args.repeat, command, facts)
    (out / f"{args.name}.md").write_text(md)
    print(md)
    failed = [name for name, row in rows.items() if row["exit"] and "--before" not in name]
    if failed:  # the older tree's runs may fail (that can be what is measured); this tree's may not
        print(f"error: pytest --collect-only failed for: {'; '.join(failed)}", file=sys.stderr)
        return 1
    return 0
