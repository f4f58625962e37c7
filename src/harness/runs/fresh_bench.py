"""`python -m harness bench fresh`: a fresh gate run spawned (a new interpreter, the old way)
against forked from the fork server (`harness.runs.forkserver`), in one run, alternating.

Both ways run the run layer's own command (`harness.runs.fresh.pytest_command`) over the same
gates, with the same warm compile cache, one run at a time: each run's wall time and CPU (its
own and its children's; a forked run's comes from the server, which reaps it), the server's
own start, and whether both ways gave every gate the same outcome.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _one(way: str, targets: list[str], *, rootdir: Path, kernel_root: Path, cache_dir: Path, require_gpu: bool,
         deadline: float, folder: Path) -> dict:
    from harness.runs.fresh import child_environment, pytest_command, run_pytest

    folder.mkdir(parents=True)
    cmd = pytest_command(targets, kernel_root=kernel_root, report_dir=folder, cache_dir=cache_dir,
                         require_gpu=require_gpu, arch=None, deadline=deadline)
    env = {**child_environment(cache_dir), "TMPDIR": str(folder)}
    before, start = _children_cpu(), time.perf_counter()
    proc, why, timed_out = run_pytest(cmd[3:], cwd=rootdir, env=env, stdout=folder / "pytest.log", timeout=deadline,
                                      fork=way == "fork")
    if timed_out:
        raise SystemExit(f"error: a {way} run went past its deadline ({deadline:.0f} s); see {folder / 'pytest.log'}")
    if way == "fork" and why is not None:
        raise SystemExit(f"error: the fork server did not fork this run: {why}")
    code = proc.returncode
    wall = time.perf_counter() - start
    cpu = proc.cpu_seconds if way == "fork" else _children_cpu() - before
    report = folder / "gates.json"
    gates = json.loads(report.read_text())["gates"] if report.is_file() else []
    return {"way": way, "exit": code, "wall_s": round(wall, 3), "cpu_s": round(cpu, 3),
            "outcomes": sorted((g["nodeid"], g["outcome"]) for g in gates)}


def main(argv: list[str]) -> int:
    from harness.core.settings import project_settings
    from harness.runs import forkserver

    parser = argparse.ArgumentParser(prog="python -m harness bench fresh",
                                     description="A fresh gate run spawned against forked from the fork server, "
                                                 "alternating, in one run: each way's wall time and CPU a run, and "
                                                 "whether both gave every gate the same outcome.")
    parser.add_argument("targets", nargs="*", default=["gates"], help="what each run runs (default: gates)")
    parser.add_argument("--runs", type=int, default=10, metavar="N", help="runs each way (default 10)")
    parser.add_argument("--require-gpu", action="store_true", help="run the GPU gates too (default: skip them)")
    parser.add_argument("--deadline", type=float, default=600.0, metavar="SECONDS", help="a run's deadline")
    from harness.core.usage import add_bench_output, bench_out_folder

    add_bench_output(parser, "bench-fresh")
    args = parser.parse_args(argv)
    out = bench_out_folder(args.out)
    if args.runs < 1:
        parser.error("--runs must be 1 or more")
    rootdir, settings = project_settings()
    why = forkserver.why_spawn(dict(os.environ))
    if why is not None:
        print(f"error: no fork server here ({why}): nothing to compare", file=sys.stderr)
        return 2
    runs: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="harness-bench-fresh-") as tmp:
        common = dict(rootdir=rootdir, kernel_root=settings.kernel_root, cache_dir=settings.cache_dir,
                      require_gpu=args.require_gpu, deadline=args.deadline)
        # a warm-up each way (the compile cache, the page cache); the server's start timed alone
        forkserver.shutdown()
        before = _children_cpu()
        _one("spawn", args.targets, folder=Path(tmp) / "warm-spawn", **common)
        spawn_warm = _children_cpu() - before
        before, start = _children_cpu(), time.perf_counter()
        server = forkserver._server_for({**os.environ})
        if isinstance(server, str):
            print(f"error: the fork server did not start: {server}", file=sys.stderr)
            return 2
        server_wall = time.perf_counter() - start
        _one("fork", args.targets, folder=Path(tmp) / "warm-fork", **common)
        for i in range(args.runs):
            for way in (("spawn", "fork") if i % 2 == 0 else ("fork", "spawn")):
                runs.append(_one(way, args.targets, folder=Path(tmp) / f"{i}-{way}", **common))
                print(f"run {i + 1} {way}: {runs[-1]['wall_s']:.2f} s, {runs[-1]['cpu_s']:.2f} CPU-s", flush=True)
        forkserver.shutdown()
        # everything the server and its forks used, less the forks' own, and less the spawned runs
        total = _children_cpu() - before
    spawned_cpu = sum(r["cpu_s"] for r in runs if r["way"] == "spawn")
    forked_cpu = sum(r["cpu_s"] for r in runs if r["way"] == "fork")
    warm_fork_and_server = total - spawned_cpu - forked_cpu
    summary = {"targets": args.targets, "runs_each_way": args.runs, "require_gpu": args.require_gpu,
               "rootdir": str(rootdir), "python": sys.version.split()[0], "cpus": os.cpu_count(),
               "server_start_wall_s": round(server_wall, 3),
               "server_and_fork_warmup_cpu_s": round(warm_fork_and_server, 3),
               "spawn_warmup_cpu_s": round(spawn_warm, 3)}
    for way in ("spawn", "fork"):
        mine = [r for r in runs if r["way"] == way]
        summary[way] = {stat: round(fn([r[key] for r in mine]), 3) for key in ("wall_s", "cpu_s")
                        for stat, fn in ((f"median_{key}", statistics.median), (f"mean_{key}", statistics.mean))}
        summary[way]["exits"] = sorted({r["exit"] for r in mine})
    first = runs[0]["outcomes"]
    summary["same_outcomes"] = all(r["outcomes"] == first for r in runs)
    summary["gates"] = len(first)
    summary["outcomes"] = {o: sum(1 for _, got in first if got == o) for o in sorted({got for _, got in first})}
    for r in runs:  # each run's outcomes once in the record: the first run's, and whether each run's matched
        r["same_outcomes_as_the_first_run"] = r.pop("outcomes") == first
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps({"summary": summary, "runs": runs},
                                                      indent=1) + "\n")
    s, f = summary["spawn"], summary["fork"]
    lines = [f"# A fresh gate run: spawned against forked ({len(runs)} runs, alternating)", "",
             f"`python -m harness bench fresh {' '.join(args.targets)} --runs {args.runs}"
             f"{' --require-gpu' if args.require_gpu else ''}`: {summary['gates']} gates a run, "
             f"{os.cpu_count()} CPUs, Python {summary['python']}.", "",
             "| way | median wall (s) | mean wall (s) | median CPU (s) | mean CPU (s) |", "| --- | ---: | ---: | ---: | ---: |",
             f"| spawned | {s['median_wall_s']} | {s['mean_wall_s']} | {s['median_cpu_s']} | {s['mean_cpu_s']} |",
             f"| forked | {f['median_wall_s']} | {f['mean_wall_s']} | {f['median_cpu_s']} | {f['mean_cpu_s']} |", "",
             f"The server started in {summary['server_start_wall_s']} s; it and the forked warm-up run took "
             f"{summary['server_and_fork_warmup_cpu_s']} CPU-s (the spawned warm-up run: "
             f"{summary['spawn_warmup_cpu_s']}). Every gate had the same outcome both ways: "
             f"{'yes' if summary['same_outcomes'] else 'NO'}.", ""]
    (out / f"{args.name}.md").write_text("\n".join(lines))
    print("\n".join(lines[4:8]))
    print(f"same outcomes both ways: {summary['same_outcomes']}; written to {out / args.name}.json and .md")
    return 0 if summary["same_outcomes"] else 1
