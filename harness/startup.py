"""`python -m harness bench startup`: what the plugin costs a pytest run, measured in one run.

Installed, the plugin loads in every pytest run of the environment. This benchmark times
`pytest --collect-only -q` (the process's whole wall time: interpreter, plugins, collection)
with the plugin (`-p harness.plugin`, as the entry point loads it) and without it
(`-p no:harness.plugin`), alternating the two so drift in the machine's load falls on both
alike, over two projects:

- an unrelated project: a temporary folder with one plain test and no harness setting;
- this project (the rootdir found from the working folder up), its default test selection.
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

MODES = {"with the plugin": ["-p", "harness.plugin"], "without (-p no:harness.plugin)": ["-p", "no:harness.plugin"]}


def _time(cwd: Path, extra: list[str], env: dict) -> tuple[float, int, str]:
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *extra]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    last = proc.stdout.strip().splitlines()[-1:] or [""]
    return seconds, proc.returncode, last[0]


def measure(projects: dict[str, Path], repeat: int, env: dict, report=print) -> dict:
    """{project: {mode: {"seconds": [...], "median_s", "min_s", "exit", "last_line"}}}, alternating modes."""
    rows: dict = {name: {mode: {"seconds": []} for mode in MODES} for name in projects}
    for i in range(repeat):
        for name, path in projects.items():
            order = list(MODES.items()) if i % 2 == 0 else list(reversed(MODES.items()))
            for mode, extra in order:
                seconds, code, last = _time(path, extra, env)
                row = rows[name][mode]
                row["seconds"].append(round(seconds, 3))
                row["exit"], row["last_line"] = code, last
                report(f"{name:28s} {mode:32s} #{i + 1}: {seconds:.2f} s  [{last}]")
    for by_mode in rows.values():
        for row in by_mode.values():
            row["median_s"] = round(statistics.median(row["seconds"]), 3)
            row["min_s"] = min(row["seconds"])
    return rows


def markdown(rows: dict, repeat: int, command: str) -> str:
    lines = ["# Plugin start-up cost", "", f"`{command}`: `pytest --collect-only -q` wall time, {repeat} runs of "
             "each, the two modes alternating.", "",
             "| project | with the plugin, median s | without, median s | difference s | with, min s | "
             "without, min s |", "| --- | --- | --- | --- | --- | --- |"]
    with_, without = MODES
    for name, by_mode in rows.items():
        a, b = by_mode[with_], by_mode[without]
        lines.append(f"| {name} | {a['median_s']:.2f} | {b['median_s']:.2f} | {a['median_s'] - b['median_s']:+.2f} | "
                     f"{a['min_s']:.2f} | {b['min_s']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    from harness._settings import find_rootdir, report_root

    parser = argparse.ArgumentParser(prog="python -m harness bench startup",
                                     description="pytest's start-up (--collect-only wall time) with and without "
                                                 "the harness plugin, over an unrelated project and this one.")
    parser.add_argument("--repeat", type=int, default=5, metavar="N", help="runs of each mode (default 5)")
    parser.add_argument("--out", default=None, metavar="DIR",
                        help="where the JSON and Markdown go (default: harness-report/bench in the rootdir)")
    parser.add_argument("--name", default="bench-startup", help="file name stem for the JSON and Markdown")
    args = parser.parse_args(argv)
    if args.repeat < 1:
        print(f"error: --repeat {args.repeat}: pass 1 or more", file=sys.stderr)
        return 2
    project = find_rootdir()
    package_parent = Path(__file__).resolve().parents[1]
    path = os.pathsep.join(p for p in (str(package_parent), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, PYTHONPATH=path)
    with tempfile.TemporaryDirectory(prefix="harness-bench-startup-") as tmp:
        plain = Path(tmp) / "plain"
        plain.mkdir()
        (plain / "test_plain.py").write_text("def test_add():\n    assert 1 + 1 == 2\n")
        rows = measure({"unrelated (one plain test)": plain, f"this project ({project.name})": project},
                       args.repeat, env)
    command = f"python -m harness bench startup --repeat {args.repeat}"
    out = Path(args.out) if args.out else report_root() / "bench"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps({"command": command, "repeat": args.repeat, "projects": rows},
                                                     indent=2) + "\n")
    md = markdown(rows, args.repeat, command)
    (out / f"{args.name}.md").write_text(md)
    print(md)
    failed = [f"{name}, {mode}" for name, by_mode in rows.items() for mode, row in by_mode.items() if row["exit"]]
    if failed:
        print(f"error: pytest --collect-only failed for: {'; '.join(failed)}", file=sys.stderr)
        return 1
    return 0
