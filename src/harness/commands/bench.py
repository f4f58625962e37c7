"""`python -m harness bench`: the benchmarks' entry (`BENCHES`), and `bench gates`: the gate run's
speed, the old way against this one, in one run.

Both trees run the same gates on the same machine with the same warm compile cache (and,
for the tree that has one, its warm disk cache of host references, `harness.host_cache`):

- the *before* tree (`--before DIR`: a checkout of the code before the warm pool) runs its
  own `gates/` serially and with `-n JOBS`;
- this tree runs exactly the before tree's gate ids serially (today's suite, the target),
  then its whole `gates/` serially (what gates added since cost) and with `-n JOBS`.

Each figure is pytest's own "passed in N s" and the process wall time; the isolated (trap)
gates' cost comes from each run's gates.json. Numbers are printed and written as JSON and
Markdown.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from harness.commands import Command, Commands
from harness.commands.figures import device_name, timed_run
from harness.core.child import ChildPytest
from harness.core.usage import add_bench_output, bench_out_folder



def _run(tree: Path, args: list[str], report: Path, env: dict) -> dict:
    cmd = ChildPytest(tuple(args), require_gpu=True, report_dir=report).command()
    ran = timed_run(cmd, tree, env)
    proc = ran.proc
    tail = proc.stdout.strip().splitlines()
    gates = []
    gj = report / "gates.json"
    if gj.is_file():
        gates = json.loads(gj.read_text()).get("gates", [])
    # An isolated gate's duration is how long the run waited for it (its cost to the run).
    isolated = [g["duration"] for g in gates if g.get("isolated")]
    return {
        "command": " ".join(cmd[1:]), "tree": str(tree), "exit": proc.returncode, "wall_s": round(ran.wall_s, 2),
        "pytest_s": ran.pytest_s, "summary": ran.summary, "gates": len(gates),
        "isolated_gates": len(isolated),
        "isolated_mean_s": round(statistics.mean(isolated), 3) if isolated else None,
        "isolated_max_s": round(max(isolated), 3) if isolated else None,
        "output_tail": "\n".join(tail[-5:]) if proc.returncode else "",
    }


def _collect_ids(tree: Path, env: dict) -> list[str]:
    proc = subprocess.run(ChildPytest(("gates",), collect_only=True).command(), cwd=tree, env=env,
                          capture_output=True, text=True)
    return [line.strip() for line in proc.stdout.splitlines() if "::" in line and not line.startswith(" ")]




def _bench_mutate(argv: list[str]) -> int:
    from harness.campaigns.mutate.bench import main

    return main(argv)


def _bench_startup(argv: list[str]) -> int:
    from harness.commands.startup import main

    return main(argv)


def _bench_fresh(argv: list[str]) -> int:
    from harness.runs.fresh_bench import main

    return main(argv)


def _bench_compare(argv: list[str]) -> int:
    from harness.commands.bench_compare import main

    return main(argv)


def main(argv: list[str]) -> int:
    return BENCHES.dispatch(argv)


def bench_gates(argv: list[str]) -> int:
    from harness.commands.startup import tree_env
    from harness.core.settings import find_rootdir

    parser = argparse.ArgumentParser(prog="python -m harness bench gates",
                                     description="Time the GPU gate run, the old way against this one, in one run: "
                                                 "the --before tree's gates, then the same gate ids on this tree, "
                                                 "then this tree's whole gates/ (pytest's own figures).")
    parser.add_argument("--before", required=True, metavar="DIR",
                        help="a checkout of the code before the change (its own gates/ and harness/)")
    parser.add_argument("--jobs", type=int, default=8, metavar="N",
                        help="xdist workers for the parallel figure (0: no parallel figure)")
    parser.add_argument("--repeat", type=int, default=1, metavar="N",
                        help="run the old gate ids on this tree N times (the figure is their median)")
    add_bench_output(parser, "bench-gates")
    args = parser.parse_args(argv)
    out = bench_out_folder(args.out)
    before = Path(args.before).resolve()
    after = find_rootdir()
    if not (before / "gates").is_dir():
        print(f"error: --before {before} has no gates/ folder: pass a checkout of the old tree", file=sys.stderr)
        return 2
    if args.repeat < 1:
        print(f"error: --repeat {args.repeat}: pass 1 or more", file=sys.stderr)
        return 2
    if args.jobs < 0:
        print(f"error: --jobs {args.jobs}: pass 1 or more, or 0 for no parallel figure", file=sys.stderr)
        return 2
    cache = Path(os.environ.get("HARNESS_CACHE_DIR") or tempfile.mkdtemp(prefix="harness-bench-cache-"))
    tmp = Path(tempfile.mkdtemp(prefix="harness-bench-"))
    def env_for(tree: Path) -> dict:
        # both trees keep their bytecode from the warm-up on, as a user's repeated runs do
        return dict(tree_env(tree), HARNESS_CACHE_DIR=str(cache))

    env_before, env_after = env_for(before), env_for(after)
    old_ids = _collect_ids(before, env_before)
    rows: dict[str, dict] = {}

    def step(key: str, tree: Path, env: dict, targs: list[str]) -> None:
        rows[key] = _run(tree, targs, tmp / key, env)
        r = rows[key]
        print(f"{key:28s} pytest {r['pytest_s']} s, wall {r['wall_s']} s, {r['gates']} gates, "
              f"isolated mean {r['isolated_mean_s']} s  [{r['summary']}]", flush=True)

    step("warm-up before", before, env_before, ["gates"])
    step("warm-up after", after, env_after, ["gates"])
    step("before serial", before, env_before, ["gates"])
    for i in range(args.repeat):
        step("after serial (old gates)" + (f" #{i + 1}" if args.repeat > 1 else ""), after, env_after, old_ids)
    step("after serial (all gates)", after, env_after, ["gates"])
    if args.jobs:
        step(f"before -n {args.jobs}", before, env_before, ["gates", "-n", str(args.jobs)])
        step(f"after -n {args.jobs}", after, env_after, ["gates", "-n", str(args.jobs)])
    b, full = rows["before serial"], rows["after serial (all gates)"]
    olds = [r for k, r in rows.items() if k.startswith("after serial (old gates)")]
    old_s = statistics.median(r["pytest_s"] or 0 for r in olds)
    a = {"gates": olds[0]["gates"], "pytest_s": round(old_s, 2)}
    result = {"device": device_name(), "old_gate_ids": len(old_ids), "runs": rows,
              "after_old_gates_median_s": a["pytest_s"], "repeat": args.repeat,
              "added_gates": full["gates"] - a["gates"],
              "added_gates_pytest_s": round((full["pytest_s"] or 0) - (a["pytest_s"] or 0), 2)}
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(result, indent=2) + "\n")
    md = [f"# Gate-run benchmark ({result['device']})", "", "`python -m harness bench gates --before DIR "
          f"--jobs {args.jobs} --repeat {args.repeat}`, one run, warm compile cache (and host-reference cache, where the tree has "
          "one: the warm-up runs fill both).", "",
          "| run | pytest s | wall s | gates | isolated gates | isolated mean s | isolated max s |",
          "| --- | --- | --- | --- | --- | --- | --- |"]
    for key, r in rows.items():
        md.append(f"| {key} | {r['pytest_s']} | {r['wall_s']} | {r['gates']} | {r['isolated_gates']} | "
                  f"{r['isolated_mean_s']} | {r['isolated_max_s']} |")
    md += ["", f"Old suite ({len(old_ids)} gate ids): {b['pytest_s']} s before, {a['pytest_s']} s after"
           + (f" (the median of {args.repeat} runs)" if args.repeat > 1 else "") + ". "
           f"Gates added since: {result['added_gates']}, costing {result['added_gates_pytest_s']} s serial."]
    (out / f"{args.name}.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0 if all(r["exit"] == 0 for r in rows.values()) else 1


BENCHES = Commands(
    prog="python -m harness bench", what="benchmark",
    intro="Benchmarks that print their figures and write them as JSON and Markdown (default: harness-report/bench "
          "in the rootdir; --out DIR to record them elsewhere, e.g. docs/observed).",
    table=(
        Command("gates", "time the GPU gate run against an older tree (--before DIR), in one run", bench_gates),
        Command("mutate", "the mutation campaign against the naive way (a fresh pytest per mutant) on the same "
                          "mutants", _bench_mutate),
        Command("startup", "pytest's start-up with and without the harness plugin: an unrelated project and this "
                           "one", _bench_startup),
        Command("fresh", "a fresh gate run spawned against forked from the fork server, alternating, in one run",
                _bench_fresh),
        Command("compare", "--compare-to REF over the suite against the plain suite: both sides through the lanes, "
                           "and one lane (the sides one after the other), in one run", _bench_compare),
    ),
)
