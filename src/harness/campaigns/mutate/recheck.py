"""Verdict integrity: a campaign's survivors and a sample of its other gate-run mutants run
again through other executors (fresh processes: workers never reused, or a fresh pytest
each), and the verdicts are counted that agree."""

from __future__ import annotations

import os

from harness.campaigns.mutate.campaign import MutationCampaign, dependents_of, gate_stage
from harness.campaigns.mutate.verdicts import MutantResult, Recheck, Verdict
from harness.core.errors import DeviceLost
from harness.runs.result import Executor

# A re-run that hits its deadline where the campaign's run had a verdict is run once more,
# this many at once. The re-check runs every trap gate for real, each in a fresh worker, a
# dozen mutants at once, and every CUDA context made or torn down and every trap handled
# waits for the driver's lock, so a trap gate can run past its deadline in a burst. A timeout
# there says how loaded the driver was, not what the mutant does; run alone with a few others
# it says what the mutant does. The line says how many agreed only then.
RETRY_JOBS = 4


RECHECKED = (Verdict.KILLED, Verdict.KILLED_BY_TRAP, Verdict.TIMEOUT, Verdict.SURVIVED)


def recheck(campaign: MutationCampaign, executor: Executor | list, *, sample: int = 10, seed: int = 0,
            on_result=None) -> Recheck:
    """Run every survivor and `sample` other gate-run mutants again through `executor` (for
    a warm-worker campaign: fresh processes, either workers never reused or a
    FreshProcessExecutor) and count how many verdicts agree. A list of executors runs that
    many mutants at once, one on each (an executor may appear more than once).
    `on_result(first, second)` is called as each re-run ends (from the re-run's thread), so
    a re-check cut short still leaves what it measured. A device that stops answering raises
    DeviceLost, as the gate stage does (`campaign.run_gate_stage`): every verdict is in
    already, and the caller wrote the campaign's report before the re-check."""
    try:
        return _recheck(campaign, executor, sample, seed, on_result)
    except DeviceLost as exc:
        report_dir = campaign.config.path(campaign.config.report_dir)
        raise DeviceLost(
            f"the device stopped answering during the re-check ({exc}); the campaign's {len(campaign.results)} "
            f"verdicts stand in {report_dir} (mutation.json, mutation.html, mutants.jsonl) and recheck.jsonl has the "
            "re-runs that ended: check the GPU (nvidia-smi), then --resume runs the re-check again") from None


def _recheck(campaign: MutationCampaign, executor: Executor | list, sample: int, seed: int, on_result) -> Recheck:
    import random
    from concurrent.futures import ThreadPoolExecutor
    from queue import Queue

    ran = [r for r in campaign.ordered() if r.verdict in RECHECKED]
    survivors = [r for r in ran if r.verdict is Verdict.SURVIVED]
    rest = sorted((r for r in ran if r.verdict is not Verdict.SURVIVED), key=lambda r: r.mutant.id)
    chosen = survivors + random.Random(seed).sample(rest, min(sample, len(rest)))
    deps = dependents_of(campaign.kernel_root, {r.mutant.file for r in chosen})
    free: Queue = Queue()
    for ex in (executor if isinstance(executor, list) else [executor]):
        free.put(ex)

    def again(r: MutantResult) -> MutantResult:
        ex = free.get()
        try:
            second = gate_stage(r, campaign.kernel_root, campaign.coverage, deps, ex, campaign.config)
        finally:
            free.put(ex)
        if on_result is not None:
            on_result(r, second)
        return second

    with ThreadPoolExecutor(max_workers=free.qsize(), thread_name_prefix="recheck") as pool:
        second = list(pool.map(again, chosen))
    loaded = [i for i, (r, a) in enumerate(zip(chosen, second))
              if a.verdict is Verdict.TIMEOUT and r.verdict is not Verdict.TIMEOUT]
    if loaded:
        with ThreadPoolExecutor(max_workers=min(RETRY_JOBS, free.qsize()), thread_name_prefix="recheck-again") as pool:
            for i, third in zip(loaded, pool.map(again, [chosen[i] for i in loaded])):
                second[i] = third
    agreed, disagreements = 0, {}
    for r, a in zip(chosen, second):
        if a.verdict is r.verdict:
            agreed += 1
        else:
            disagreements[r.mutant.id] = (r.verdict.value, a.verdict.value, a.reason)
    return Recheck([r.mutant.id for r in chosen], agreed, disagreements,
                   retried=[chosen[i].mutant.id for i in loaded],
                   agreed_on_retry=sum(1 for i in loaded if second[i].verdict is chosen[i].verdict),
                   retry_jobs=RETRY_JOBS)


def recheck_jobs(gpu_jobs: int, cpus: int | None = None) -> int:
    """How many fresh pytests the re-check runs at once: each starts a server, a probe and
    workers with their own CUDA contexts, so about four cores each, and never more than
    the campaign's own slots."""
    cpus = cpus or os.cpu_count() or 1
    return max(1, min(gpu_jobs, cpus // 4))
