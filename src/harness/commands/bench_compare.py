"""`python -m harness bench compare`: `--compare-to REF` over the suite against the plain suite,
and the comparison's two ways, in one run.

Three runs over the same targets, in this order each round, with the same warm caches (a plain
run and a comparison go first, not counted: they fill the compile cache, REF's cubins among
it, and the gate times the lanes split by):

- *plain*: `pytest TARGETS`, the suite as it runs without a comparison;
- *lanes*: `pytest TARGETS --compare-to REF`, both sides through the run's lanes at once;
- *one lane*: the same with `--harness-lanes 1`: every gate of REF's side, then every gate
  of today's, on one worker (the way a comparison ran before it had lanes).

Each figure is the process's wall time and pytest's own "in N s"; the ratios are of the
medians over `--repeat` rounds. Printed, and written as JSON and Markdown.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
from pathlib import Path

TARGET_RATIO = 3.0  # issue 52: a comparison over the whole suite at most 3x the plain suite's wall
LANES_LINE = re.compile(r"^compare to .*: each side's gates in (\d+) lane\(s\) of whole modules, (\d+) at once")
FOUND_LINE = re.compile(r"^compare to .*: \d+ gate\(s\), \d+ arm\(s\): .*")
RUNS = {  # key: (what it is, the options after the targets; {ref} is REF)
    "plain": ("the plain suite", ()),
    "lanes": ("--compare-to, both sides through the run's lanes", ("--compare-to={ref}",)),
    "one lane": ("--compare-to --harness-lanes 1: the sides one after the other on one worker",
                 ("--compare-to={ref}", "--harness-lanes=1")),
}


def _run(rootdir: Path, targets: list[str], extra: tuple[str, ...], report: Path, require_gpu: bool,
         env: dict) -> dict:
    from harness.commands.figures import timed_run
    from harness.core.child import ChildPytest

    cmd = ChildPytest(tuple(targets), require_gpu=require_gpu, report_dir=report, extra=extra).command()
    ran = timed_run(cmd, rootdir, env)
    proc = ran.proc
    lines = proc.stdout.splitlines()
    lanes = next((m for m in map(LANES_LINE.match, lines) if m), None)
    found = next((line for line in lines if FOUND_LINE.match(line)), None)
    tail = (lines + proc.stderr.splitlines())[-8:]
    try:  # how a comparison's sides ran: its lanes, each piece's time, where the workers' time went
        how = json.loads((report / "compare.json").read_text()).get("run")
    except (OSError, ValueError):
        how = None
    return {"command": " ".join(cmd[1:]), "exit": proc.returncode, "wall_s": round(ran.wall_s, 2), "compare_run": how,
            "pytest_s": ran.pytest_s, "summary": ran.summary,
            "lanes": int(lanes.group(1)) if lanes else None, "at_once": int(lanes.group(2)) if lanes else None,
            "compared": found, "output_tail": "\n".join(tail) if proc.returncode else ""}


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a is not None and b else None


def main(argv: list[str]) -> int:
    from harness.commands.figures import device_name
    from harness.commands.startup import tree_env
    from harness.core.settings import find_rootdir
    from harness.core.usage import add_bench_output, bench_out_folder

    parser = argparse.ArgumentParser(
        prog="python -m harness bench compare",
        description="Time --compare-to REF over the targets against the plain run of them, both sides through the "
                    "lanes and the sides one after the other on one worker (--harness-lanes 1), in one run.")
    parser.add_argument("targets", nargs="*", default=["gates"], help="what each run runs (default: gates)")
    parser.add_argument("--ref", default="HEAD", help="the REF each comparison compares with (default: HEAD)")
    parser.add_argument("--require-gpu", action="store_true", help="pass --require-gpu to every run (a GPU machine)")
    parser.add_argument("--lanes", default=None, metavar="N",
                        help="the lanes run's --harness-lanes (default: none given, the run's own: auto, or the ini's)")
    parser.add_argument("--repeat", type=int, default=1, metavar="N",
                        help="rounds of the three runs (default 1); the figures are their medians")
    add_bench_output(parser, "bench-compare")
    args = parser.parse_args(argv)
    if args.repeat < 1:
        print(f"error: --repeat {args.repeat}: pass 1 or more", file=sys.stderr)
        return 2
    if not args.ref.strip():
        print("error: --ref needs a REF: a git revision (HEAD, main, a SHA) or a folder holding the old kernel tree",
              file=sys.stderr)
        return 2
    if args.lanes is not None:
        from harness.pool.lanes import lanes_value

        try:
            lanes_value(args.lanes)
        except ValueError as exc:
            print(f"error: --lanes: {exc}", file=sys.stderr)
            return 2
    out = bench_out_folder(args.out)
    rootdir = find_rootdir()
    env = tree_env(rootdir)
    rows: dict[str, list[dict]] = {key: [] for key in RUNS}
    with tempfile.TemporaryDirectory(prefix="harness-bench-compare-") as tmp:
        def step(key: str, label: str, counted: bool = True) -> dict:
            extra = tuple(x.format(ref=args.ref) for x in RUNS[key][1])
            if key == "lanes" and args.lanes is not None:
                extra += (f"--harness-lanes={args.lanes}",)
            r = _run(rootdir, args.targets, extra, Path(tmp) / f"{label}-{key}".replace(" ", "-"), args.require_gpu,
                     env)
            if counted:
                rows[key].append(r)
            lanes = f", {r['lanes']} lane(s) a side, {r['at_once']} at once" if r["lanes"] else ""
            print(f"{label:9s} {key:9s} wall {r['wall_s']:7.2f} s, pytest {r['pytest_s']} s, exit {r['exit']}"
                  f"{lanes}  [{r['summary']}]", flush=True)
            if r["exit"]:
                print(r["output_tail"], flush=True)
            return r

        step("plain", "warm-up", counted=False)
        step("lanes", "warm-up", counted=False)
        for i in range(args.repeat):
            for key in RUNS:
                step(key, f"round {i + 1}")
    medians = {key: {stat: (round(statistics.median(vals), 2) if (vals := [r[stat] for r in got if r[stat] is not None])
                            else None) for stat in ("wall_s", "pytest_s")} for key, got in rows.items()}
    plain, lanes, one = (medians[k]["wall_s"] for k in RUNS)
    result = {"device": device_name(), "cpus": os.cpu_count(), "rootdir": str(rootdir), "targets": args.targets,
              "ref": args.ref, "require_gpu": args.require_gpu, "repeat": args.repeat, "medians": medians,
              "ratios": {"lanes_over_plain": _ratio(lanes, plain), "one_lane_over_plain": _ratio(one, plain),
                         "one_lane_over_lanes": _ratio(one, lanes)},
              "target_ratio": TARGET_RATIO, "runs": rows}
    ratio = result["ratios"]["lanes_over_plain"]
    result["target_met"] = ratio is not None and ratio <= TARGET_RATIO
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(result, indent=2) + "\n")
    md = markdown(result, argv)
    (out / f"{args.name}.md").write_text(md)
    print(md)
    print(f"written to {out / args.name}.json and .md")
    return 0 if all(r["exit"] == 0 for got in rows.values() for r in got) else 1


def markdown(result: dict, argv: list[str]) -> str:
    r, m = result["ratios"], result["medians"]
    lanes = {key: sorted({x["lanes"] for x in got if x["lanes"]}) for key, got in result["runs"].items()}
    lines = [f"# `--compare-to {result['ref']}` against the plain suite ({result['device']}, {result['cpus']} CPUs)",
             "", f"`python -m harness bench compare {' '.join(argv)}`, one command: a plain run and a comparison "
             "first (not counted: the compile cache, REF's cubins and the gate times warm), then "
             f"{result['repeat']} round(s) of the three runs; the figures are the medians.", "",
             "| run | lanes a side | median wall s | median pytest s | wall / plain |",
             "| --- | --- | ---: | ---: | ---: |"]
    for key, (what, _) in RUNS.items():
        shown = ", ".join(map(str, lanes[key])) or "-"
        over = {"plain": 1.0, "lanes": r["lanes_over_plain"], "one lane": r["one_lane_over_plain"]}[key]
        lines.append(f"| {what} | {shown} | {m[key]['wall_s']} | {m[key]['pytest_s']} | {over} |")
    for key in ("lanes", "one lane"):
        how = next((x["compare_run"] for x in result["runs"][key] if x.get("compare_run")), None)
        if how:
            pieces = ", ".join(f"{p['side']} {p['lane']}: {p['gates']} gates {p['seconds']} s" for p in how["pieces"])
            lines += ["", f"{key}, its first round: the sides' pieces took {how['seconds']} s together ({pieces})"
                      + (f"; workers: {how['workers']}" if how.get("workers") else "") + "."]
    met = "met" if result["target_met"] else "NOT met"
    lines += ["", f"Through the lanes: {r['lanes_over_plain']}x the plain suite's wall (target <= "
              f"{result['target_ratio']:g}x: {met}); one lane: {r['one_lane_over_plain']}x, "
              f"{r['one_lane_over_lanes']}x the lanes' wall.", "",
              "The one-lane run is the order a comparison ran its work in before lanes (REF's side, then today's, "
              "on one warm worker); the run's own pool no longer makes workers that sit idle beside a comparison, in "
              "either run.", ""]
    return "\n".join(lines)
