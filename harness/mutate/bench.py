"""`python -m harness bench mutate`: the warm campaign against the naive way, on the same
mutants, in one run.

- **campaign**: `python -m harness mutate` as it runs by default (the CPU screen, then each
  mutant's selected gates in warm workers that serve mutant after mutant, stopping at the
  first kill, `--gpu-jobs` at once);
- **naive**: a fresh `pytest` per mutant over every gate of the mutated family (the test
  files that hold its gates), as many at once as the machine has cores, with a compile cache
  that holds only the unmutated modules, so each mutant's module compiles cold in its run.

Rates count mutants that reached the GPU (the screen's equivalent, duplicate and
compile-error mutants are reported apart). The verdicts of the mutants both ways ran are
compared one by one.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

GPU_VERDICTS = ("killed", "killed-by-trap", "timeout", "survived")


def _precompile_originals(kernel_root: Path, cache: Path, arch: str | None) -> int:
    from harness.compile import compile_file, find_sources, resolve_arch
    from harness.controls.compilecheck import declared_names

    declared = declared_names(kernel_root)
    arch = resolve_arch(arch)
    n = 0
    for src in find_sources(kernel_root):
        rel = src.resolve().relative_to(kernel_root.resolve()).as_posix()
        compile_file(rel, kernel_root=kernel_root, arch=arch, cache_dir=cache, settings=declared.get(rel))
        n += 1
    return n


def _summary(campaign) -> dict:
    ran = [r for r in campaign.ordered() if r.verdict.value in GPU_VERDICTS]
    screened = [r for r in campaign.ordered() if r.verdict.value in ("equivalent", "duplicate", "compile-error")]
    seconds = campaign.gpu_seconds
    return {"mutants": len(campaign.results), "reached_gpu": len(ran), "screened_out_on_cpu": len(screened),
            "gpu_stage_s": round(seconds, 2), "screen_s": round(campaign.screen_seconds, 2),
            "mutants_per_minute": round(60 * len(ran) / seconds, 1) if seconds > 0 else None,
            "verdicts": {v: sum(1 for r in ran if r.verdict.value == v) for v in GPU_VERDICTS}}


def main(argv: list[str]) -> int:
    from harness.mutate.campaign import run_campaign
    from harness.mutate.cli import UsageError, _executor_factory, build_parser, config_from
    from harness.mutate.execute import FreshProcessExecutor

    bench = argparse.ArgumentParser(prog="python -m harness bench mutate", add_help=False)
    bench.add_argument("--out", default="docs/observed")
    bench.add_argument("--name", default="bench-mutate")
    bench.add_argument("--naive-jobs", default=None)
    mine, rest = bench.parse_known_args(argv)
    args = build_parser().parse_args(rest)
    if args.static:
        print("error: the benchmark runs the gates: drop --static", file=sys.stderr)
        return 2
    try:
        config = config_from(args)
        naive_jobs = int(mine.naive_jobs) if mine.naive_jobs else (os.cpu_count() or 1)
        if naive_jobs < 1:
            raise UsageError(f"--naive-jobs {naive_jobs}: pass 1 or more")
    except (UsageError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    tmp = Path(tempfile.mkdtemp(prefix="harness-bench-mutate-"))
    warm_config = replace(config, report_dir=tmp / "campaign", resume=False)
    factory, executors = _executor_factory(warm_config, "warm")
    try:
        warm = run_campaign(warm_config, executor_factory=factory)
    finally:
        for ex in executors.values():
            ex.close()
    worker_lines = [ex.summary() for ex in executors.values()]
    if warm.baseline is None or not warm.baseline.ok:
        print(f"error: the baseline is red; see {warm.baseline.log if warm.baseline else tmp}", file=sys.stderr)
        return 3
    cold = tmp / "naive-cache"
    _precompile_originals(config.path(config.kernel_root), cold, warm.arch)
    naive_config = replace(config, report_dir=tmp / "naive", resume=False, all_gates=True, gpu_jobs=naive_jobs,
                           cache_dir=tmp / "naive-screen-cache")
    naive = run_campaign(naive_config, executor_factory=lambda report, cache, arch, device=None: FreshProcessExecutor(
        config.rootdir, report, cold, arch=arch, require_gpu=config.require_gpu, device=device))
    both = {k: (warm.results[k].verdict.value, naive.results[k].verdict.value) for k in warm.results
            if k in naive.results and warm.results[k].verdict.value in GPU_VERDICTS
            and naive.results[k].verdict.value in GPU_VERDICTS}
    disagree = {k: v for k, v in both.items() if v[0] != v[1]}
    w, n = _summary(warm), _summary(naive)
    ratio = round(w["mutants_per_minute"] / n["mutants_per_minute"], 1) if w["mutants_per_minute"] and \
        n["mutants_per_minute"] else None
    result = {"command": "python -m harness bench mutate " + " ".join(argv), "campaign": w, "naive": n,
              "naive_jobs": naive_jobs, "gpu_jobs": config.gpu_jobs, "speedup": ratio,
              "compared": len(both), "agreed": len(both) - len(disagree), "disagreements": disagree,
              "campaign_workers": worker_lines}
    out = Path(mine.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{mine.name}.json").write_text(json.dumps(result, indent=2) + "\n")
    md = ["# Mutation campaign against the naive way", "", f"`{result['command']}`, one run.", "",
          "| way | mutants | reached the GPU | screened out on the CPU | gate stage s | mutants a minute |",
          "| --- | --- | --- | --- | --- | --- |"]
    for label, s in (("campaign (warm)", w), (f"naive ({naive_jobs} at once)", n)):
        md.append(f"| {label} | {s['mutants']} | {s['reached_gpu']} | {s['screened_out_on_cpu']} | "
                  f"{s['gpu_stage_s']} | {s['mutants_per_minute']} |")
    md += ["", f"Speed-up: {ratio}x. Verdicts compared: {len(both)}, agreed: {len(both) - len(disagree)}"
           + (f"; disagreements: {disagree}" if disagree else "."), "",
           *(f"Campaign workers: {line}." for line in worker_lines), ""]
    (out / f"{mine.name}.md").write_text("\n".join(md))
    print("\n".join(md))
    return 0 if not disagree else 1
