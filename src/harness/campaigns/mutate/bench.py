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

import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

from harness.campaigns.mutate.verdicts import SCREENED_OUT
from harness.runs.verdict import Verdict

GPU_VERDICTS = (Verdict.KILLED, Verdict.KILLED_BY_TRAP, Verdict.TIMEOUT, Verdict.SURVIVED)
# The naive way's deadline a mutant, when --deadline is not given: a fresh pytest over a whole
# family's gates, a dozen or more at once on one GPU, is slow for reasons that are not the
# mutant's. The campaign's own bound would cut naive runs short under that load, and the
# comparison would then measure the load, not the verdicts.
NAIVE_DEADLINE = 600.0


def _precompile_originals(kernel_root: Path, cache: Path, arch: str | None) -> int:
    from harness.compiling.arch import resolve_arch
    from harness.compiling.compile import compile_file, find_sources
    from harness.runs.compilecheck import declared_names

    declared = declared_names(kernel_root)
    arch = resolve_arch(arch)
    n = 0
    for src in find_sources(kernel_root):
        rel = src.resolve().relative_to(kernel_root.resolve()).as_posix()
        compile_file(rel, kernel_root=kernel_root, arch=arch, cache_dir=cache, settings=declared.get(rel),
                     include_dirs=declared.include_dirs)
        n += 1
    return n


def compare(warm: dict[str, str], naive: dict[str, str]) -> tuple[dict, dict, dict, dict]:
    """The verdicts of the mutants both ways ran on the GPU, by id: (compared, naive runs cut
    by their deadline, kills of another kind, disagreements); each maps id -> (warm, naive)."""
    both = {k: (warm[k], naive[k]) for k in warm if k in naive and warm[k] in GPU_VERDICTS and naive[k] in GPU_VERDICTS}
    # a naive run cut by its deadline where the warm one finished says how loaded the naive
    # way was, not what the mutant is: counted apart, never as agreement
    naive_cut = {k: v for k, v in both.items() if v[1] == Verdict.TIMEOUT and v[0] != Verdict.TIMEOUT}
    both = {k: v for k, v in both.items() if k not in naive_cut}
    # The campaign stops at a mutant's first kill; the naive way runs every gate of the family.
    # A first kill by a trap or fault and an assertion among all the gates is the same kill:
    # it agrees, and is listed (the other way round, killed warm and only trapped naive, is a
    # disagreement: the naive run had the asserting gate too).
    kind_only = {k: v for k, v in both.items() if v == ("killed-by-trap", "killed")}
    disagree = {k: v for k, v in both.items() if v[0] != v[1] and k not in kind_only}
    return both, naive_cut, kind_only, disagree


def _summary(campaign) -> dict:
    summary = _counts(campaign.ordered(), campaign.gpu_seconds, campaign.screen_seconds, len(campaign.results))
    summary["whole_s"] = round(campaign.seconds, 2)  # generating, the baseline, the screen and the gates
    return summary


def _counts(results, seconds: float, screen_seconds: float, mutants: int) -> dict:
    ran = [r for r in results if r.verdict in GPU_VERDICTS]
    screened = [r for r in results if r.verdict in SCREENED_OUT]
    return {"mutants": mutants, "reached_gpu": len(ran), "screened_out_on_cpu": len(screened),
            "gpu_stage_s": round(seconds, 2), "screen_s": round(screen_seconds, 2),
            "mutants_per_minute": round(60 * len(ran) / seconds, 1) if seconds > 0 else None,
            "verdicts": {v.value: sum(1 for r in ran if r.verdict is v) for v in GPU_VERDICTS}}


class _Clock:
    """A campaign listener that notes when its gate stage began and prints its stages and
    every tenth of its mutants (the benchmark's progress, for a run that may be cut).

    With a `limit` (--naive-seconds), the gate stage is cut `limit` seconds after it began:
    `timer(limit, self.cut)` is armed then, a threading.Timer by default. `now` is the clock
    the stage's seconds are read on, the wall clock by default. Both are seams: a test arms a
    timer that fires when it says and reads a clock it moves, so no wall time decides it."""

    def __init__(self, label: str, limit: float | None = None, now=time.perf_counter, timer=threading.Timer):
        self.label, self.gates_from, self.total, self.done = label, None, None, 0
        self.limit, self.timer = limit, None
        self.now, self._timer = now, timer

    def phase(self, text, total=None):
        if "running the gates" in text:
            self.gates_from = self.now()
            if self.limit is not None:  # --naive-seconds: the cut a device command's timeout would make
                self.timer = self._timer(self.limit, self.cut)
                self.timer.daemon = True
                self.timer.start()
        self.total, self.done = total, 0
        print(f"[{self.label}] {text}", flush=True)

    @staticmethod
    def cut() -> None:
        """End the gate stage now: SIGINT at the main thread, as `timeout -s INT` would send it,
        and the runs under way killed at once, as the campaign's Ctrl-C path kills them: a
        main thread that takes the signal only when its wait ends is then woken at once."""
        from harness.runs import fresh

        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
        fresh.kill_all()

    def seconds(self) -> float:
        """How long the gate stage has run (0 before it began)."""
        return self.now() - self.gates_from if self.gates_from is not None else 0.0

    def cancel(self) -> None:
        if self.timer is not None:
            self.timer.cancel()

    def advance(self):
        self.done += 1
        if self.total and self.done % max(1, self.total // 10) == 0:
            print(f"[{self.label}] {self.done}/{self.total}", flush=True)

    def finished(self, result):
        pass


def _partial(label: str, clock: _Clock, results_path: Path, mutants: int, jobs: int) -> dict:
    """The summary of a half cut short: the mutants its results file holds, over the time
    its gate stage ran until the cut. Up to `jobs` more were under way at the cut: counting
    them as done gives the most this way could have managed (`mutants_per_minute_at_most`),
    the rate a speed-up is taken against, so a cut can only understate the speed-up."""
    from harness.campaigns.mutate.verdicts import read_results

    seconds = clock.seconds()
    results = read_results(results_path)
    summary = _counts(list(results.values()), seconds, 0.0, mutants)
    summary["cut_short"] = True
    summary["in_flight_at_most"] = in_flight = min(jobs, mutants - len(results))
    summary["mutants_per_minute_at_most"] = (round(60 * (summary["reached_gpu"] + in_flight) / seconds, 1)
                                             if seconds > 0 else None)
    print(f"[{label}] cut short after {seconds:.0f} s of its gate stage: {summary['reached_gpu']} mutants "
          f"reached the GPU and finished, at most {in_flight} more were under way", flush=True)
    return summary


def main(argv: list[str], *, naive_clock=_Clock) -> int:
    """`naive_clock(label, limit=...)` makes the naive half's listener (a test passes one on
    a clock it moves, with a timer it fires); the CLI's is `_Clock`."""
    from harness.campaigns.mutate.campaign import run_campaign
    from harness.campaigns.mutate.cli import (UsageError, _executor_factory, _positive_int, build_parser, config_from,
                                              positive_seconds)
    from harness.runs.fresh import FreshProcessExecutor
    from harness.runs.result import Executors

    parser = build_parser(prog="python -m harness bench mutate",
                          description="The mutation campaign against the naive way (a fresh pytest per mutant, "
                                      "every selected gate, a cold compile cache) on the same mutants, in one run: "
                                      "both halves' rates and whether their verdicts agree. Takes the campaign's "
                                      "options, and these:")
    bench = parser.add_argument_group("the benchmark")
    from harness.core.usage import add_bench_output, bench_out_folder

    add_bench_output(bench, "bench-mutate")
    bench.add_argument("--naive-jobs", default=None, metavar="N",
                       help="naive pytests at once (default: every core)")
    bench.add_argument("--naive-seconds", default=None, metavar="S",
                       help="cut the naive half's gate stage after S seconds, as a device's time limit would; its "
                            "rate is then taken against the most it could have managed")
    args = mine = parser.parse_args(argv)
    if args.static:
        print("error: the benchmark runs the gates: drop --static", file=sys.stderr)
        return 2
    try:
        out = bench_out_folder(mine.out)
        config = config_from(args)
        naive_jobs = (_positive_int(mine.naive_jobs, "--naive-jobs", "16") if mine.naive_jobs is not None
                      else (os.cpu_count() or 1))
        naive_seconds = (positive_seconds(mine.naive_seconds, "--naive-seconds", "300")
                         if mine.naive_seconds is not None else None)
    except (UsageError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    tmp = Path(tempfile.mkdtemp(prefix="harness-bench-mutate-"))
    kept = False  # the two halves' reports, runs and the naive cache go with the run (kept: a red baseline's)
    try:
        out.mkdir(parents=True, exist_ok=True)
        warm_config = replace(config, report_dir=tmp / "campaign", resume=False)
        factory, executors = _executor_factory(warm_config, "warm")
        try:
            warm = run_campaign(warm_config, listener=_Clock("campaign"), executor_factory=factory)
        finally:
            for ex in executors.values():
                ex.close()
        worker_lines = [ex.summary() for ex in executors.values()]
        time_lines = [ex.timing() for ex in executors.values()]  # where the slots' time went
        if warm.baseline is None or not warm.baseline.ok:
            print(f"error: the baseline is red; see {warm.baseline.log if warm.baseline else tmp}", file=sys.stderr)
            kept = True  # its logs are what the error names
            return 3
        w = _summary(warm)
        print(f"[campaign] {w['reached_gpu']} mutants reached the GPU in {w['gpu_stage_s']} s: "
              f"{w['mutants_per_minute']} a minute", flush=True)
        result = {"command": "python -m harness bench mutate " + " ".join(argv), "campaign": w, "naive": None,
                  "naive_jobs": naive_jobs, "gpu_jobs": config.gpu_jobs, "campaign_workers": worker_lines,
                  "campaign_worker_time": time_lines}
        (out / f"{mine.name}.json").write_text(json.dumps(result, indent=2) + "\n")  # kept if the naive half is cut
        cold = tmp / "naive-cache"
        _precompile_originals(config.path(config.kernel_root), cold, warm.arch)
        # The naive half screens through the campaign's cache (the screen is not what is timed);
        # its pytests compile each mutant cold, from a cache that holds only the originals.
        naive_config = replace(config, report_dir=tmp / "naive", resume=False, all_gates=True, gpu_jobs=naive_jobs,
                               deadline=config.deadline or NAIVE_DEADLINE)
        clock = naive_clock("naive", limit=naive_seconds)
        # The cut is a SIGINT at this thread: make sure it raises, also in a process that started
        # with SIGINT ignored (a background job of a non-interactive shell, nohup).
        int_handler = signal.signal(signal.SIGINT, signal.default_int_handler) if naive_seconds else None
        try:
            naive = run_campaign(naive_config, listener=clock, executor_factory=Executors(
                lambda report, cache, arch, device: FreshProcessExecutor(config.rootdir, report, cold, arch=arch,
                                                                         require_gpu=config.require_gpu, device=device,
                                                                         spawn=True)))
            clock.cancel()
            n, naive_results = _summary(naive), naive.results
        except KeyboardInterrupt:  # the rate over the mutants it finished, and their verdicts
            from harness.campaigns.mutate.campaign import RESULTS_FILE
            from harness.campaigns.mutate.verdicts import read_results

            clock.cancel()
            results_path = tmp / "naive" / RESULTS_FILE
            n = _partial("naive", clock, results_path, len(warm.results), naive_jobs)
            naive_results = read_results(results_path)
        finally:
            if int_handler is not None:
                signal.signal(signal.SIGINT, int_handler)
        both, naive_cut, kind_only, disagree = compare({k: r.verdict.value for k, r in warm.results.items()},
                                                       {k: r.verdict.value for k, r in naive_results.items()})
        naive_rate = n.get("mutants_per_minute_at_most") or n["mutants_per_minute"]
        ratio = round(w["mutants_per_minute"] / naive_rate, 1) if w["mutants_per_minute"] and naive_rate else None
        result.update({"naive": n, "speedup": ratio, "compared": len(both), "agreed": len(both) - len(disagree),
                       "disagreements": disagree, "first_kill_by_trap_naive_by_assertion": kind_only,
                       "naive_timeouts_only": naive_cut})
        (out / f"{mine.name}.json").write_text(json.dumps(result, indent=2) + "\n")
        md = ["# Mutation campaign against the naive way", "", f"`{result['command']}`, one run.", "",
              "| way | mutants | reached the GPU | screened out on the CPU | gate stage s | mutants a minute | "
              "whole run s |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
        cut = " (cut short: the mutants it finished)" if n.get("cut_short") else ""
        for label, s in (("campaign (warm)", w), (f"naive ({naive_jobs} at once){cut}", n)):
            md.append(f"| {label} | {s['mutants']} | {s['reached_gpu']} | {s['screened_out_on_cpu']} | "
                      f"{s['gpu_stage_s']} | {s['mutants_per_minute']} | {s.get('whole_s', '-')} |")
        at_most = (f" The naive half was cut after {n['gpu_stage_s']} s of its gate stage with at most "
                   f"{n['in_flight_at_most']} more under way: counted as done, the naive way managed at most "
                   f"{n['mutants_per_minute_at_most']} a minute, and the speed-up is taken against that."
                   if n.get("cut_short") else "")
        md += ["", f"Speed-up: {'at least ' if n.get('cut_short') else ''}{ratio}x.{at_most} "
               f"Verdicts compared: {len(both)}, agreed: {len(both) - len(disagree)}"
               + (f"; disagreements: {disagree}" if disagree else "."), "",
               *([f"Of those that agreed, {len(kind_only)} killed by a trap or fault first in the campaign (which "
                  f"stops at the first kill) and by an assertion among all the gates the naive way ran: "
                  f"{sorted(kind_only)}.", ""] if kind_only else []),
               *([f"Not compared: {len(naive_cut)} naive run(s) cut by the naive deadline "
                  f"({naive_config.deadline:g} s) where the warm verdict was final: {sorted(naive_cut)}.", ""]
                 if naive_cut else []),
               "Rates are over the gate stage: from the first mutant's screen to the last verdict. The whole run "
               "adds generating the mutants and the baseline (the campaign starts its workers during its baseline).",
               "", *(f"Campaign workers: {line}." for line in worker_lines),
               *(f"Campaign worker time: {line}." for line in time_lines), ""]
        (out / f"{mine.name}.md").write_text("\n".join(md))
        print("\n".join(md))
        return 0 if not disagree else 1
    finally:
        if not kept:
            shutil.rmtree(tmp, ignore_errors=True)
