"""`--static`'s gate stage: the gates that need no device, run on the CPU for each mutant the
screen left pending.

A GPU campaign runs a mutant's structural gates first (they launch nothing). Without a GPU
those still run, in `harness.runs.cpu` processes, one mutant after another:

- a structural gate that goes red kills the mutant as it would in a GPU campaign (`killed`,
  or `killed-by-trap` / `timeout` by the same judgement, `harness.campaigns.mutate.execute.judge`);
- a mutant whose cubin is the original's (or an earlier mutant's) runs only the gates that
  read its source (and their test files' other gates), as in a GPU campaign: when those
  that need no device all pass it is `equivalent` (or that mutant's `duplicate`). Its
  cubin is the original's, so a GPU gate that only loads and launches it sees the
  original; a gate that reads the source reads it through `harness.library.source`, which the
  baseline records for the gates it runs (a GPU gate skipped without a device records
  nothing: the rule assumes, as the repository's gates do, that source readers need no device);
- every other mutant stays `pending`: the gates that load its module need a GPU (a static
  baseline skips them, so it cannot even say which they are). Its reason says why. In a
  project with no GPU gate at all, the static baseline saw everything: such a mutant is
  `survived`, or `no-coverage` when no gate selects it, as in a GPU campaign.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from harness.campaigns.mutate.execute import run_mutant
from harness.campaigns.mutate.select import Coverage, Selection
from harness.campaigns.mutate.verdicts import MutantResult, Verdict
from harness.runs.slots import from_list, run_in_slots

NO_CPU_GATE = "pending: no gate that runs without a GPU reads its source or loads its module"
NEEDS_GPU = "pending: the gates that load its module need a GPU"


def cpu_selection(r: MutantResult, coverage: Coverage, deps: dict) -> tuple[Selection, list[tuple[str, ...]]]:
    """(the mutant's selection as a GPU campaign makes it, its batches cut to the gates that
    run without a device)."""
    m = r.mutant
    source_only = r.cubin_identical or r.duplicate_of is not None
    sel = coverage.select(m.file, deps.get(m.file, ()), cubin_identical=source_only)
    cpu = coverage.cpu_gates()
    return sel, [tuple(g for g in batch if g in cpu) for batch in coverage.batches(sel)]


def static_judge(r: MutantResult, root: Path, coverage: Coverage, deps: dict, executor, config,
                 deadline_for=None) -> MutantResult:
    """The verdict of a pending mutant from its structural gates alone (module docstring);
    `deadline_for(selection)`: its gates' deadline (the campaign's `mutant_deadline`)."""
    from harness.runs.sandbox import sandbox, write

    m = r.mutant
    sel, batches = cpu_selection(r, coverage, deps)
    cpu = tuple(g for b in batches for g in b)
    if not cpu:
        if not coverage.has_gpu_gates and not r.cubin_identical and r.duplicate_of is None:
            return MutantResult(m, Verdict.NO_COVERAGE, "no gate loads its module or reads its source",
                                seconds=r.seconds)
        return dataclasses.replace(r, reason=_pending(r, NO_CPU_GATE))
    with sandbox(root, f"mutant-{m.id}-{os.getpid()}") as copy:
        write(copy, m.file, m.apply((copy / m.file).read_bytes()).decode("utf-8"))
        deadline = deadline_for(Selection(cpu, ()))
        j = run_mutant(executor, copy, batches, deadline, config.all_gates, coverage.memory_safety_gates())
    verdict, reason, twin = j.verdict, j.reason, None
    gpu_left = sum(1 for g in sel.all if coverage.gates[g].gpu)
    not_run = f"; {gpu_left} GPU gate(s) of the same test files not run: they load the original's cubin" \
        if gpu_left else ""
    if verdict is Verdict.SURVIVED:
        if r.cubin_identical:
            verdict = Verdict.EQUIVALENT
            reason = (f"equivalent: identical cubin, and the {len(j.gates_run)} gate(s) reading its source passed "
                      f"on the CPU{not_run}")
        elif r.duplicate_of is not None:
            verdict, twin = Verdict.DUPLICATE, r.duplicate_of
            reason = (f"duplicate of {r.duplicate_of} (the {len(j.gates_run)} gate(s) reading its source passed "
                      f"on the CPU{not_run})")
        elif not coverage.has_gpu_gates:
            pass  # every gate it selects ran: a survivor, as in a GPU campaign
        else:
            verdict = Verdict.PENDING
            reason = _pending(r, f"{NEEDS_GPU} (its {len(j.gates_run)} structural gate(s) passed)")
    return MutantResult(m, verdict, reason, duplicate_of=twin, killed_by=list(j.killed_by), gates_run=list(j.gates_run),
                        covered_by=list(sel.direct), seconds=r.seconds + j.seconds, cubin_identical=r.cubin_identical,
                        memory_safety=j.memory_safety, gate_seconds=round(j.seconds, 4), in_gates=round(j.in_gates, 4))


def _pending(r: MutantResult, why: str) -> str:
    """`why`, after what the screen said of the mutant (a header no `.cu` includes)."""
    return f"{r.reason}; {why}" if r.reason else why


def cpu_stage(campaign, screened: dict[str, MutantResult], coverage: Coverage | None, deps: dict, config,
              finish, listener, make_executor, deadline_for) -> None:
    """Hand every screened result to `finish`: the final ones at once, the pending ones after
    their structural gates ran (within `deadline_for(selection)`), `config.jobs` mutants at
    once, each slot with an executor of its own (`make_executor()`)."""
    order = [screened[m.id] for m in campaign.mutants if m.id in screened]
    todo = []
    for r in order:
        if r.verdict is not Verdict.PENDING or coverage is None:
            finish(r)
        elif not any(cpu_selection(r, coverage, deps)[1]):
            finish(static_judge(r, campaign.kernel_root, coverage, deps, None, config))
        else:
            todo.append(r)
    if not todo:
        return
    jobs = max(1, min(config.jobs, len(todo)))
    listener.phase(f"structural gates of {len(todo)} mutants on {jobs} CPU process(es)", len(todo))
    executors = [make_executor() for _ in range(jobs)]

    def work(r: MutantResult, slot: int) -> MutantResult:
        return static_judge(r, campaign.kernel_root, coverage, deps, executors[slot], config, deadline_for)

    def done(r: MutantResult, result: MutantResult) -> None:
        finish(result)
        listener.advance()

    def close_all() -> None:
        for ex in executors:
            ex.close()

    try:
        run_in_slots(from_list(todo), jobs, work, done, on_abort=close_all, name="structural")
    finally:
        close_all()


def pending_lines(results) -> list[str]:
    """Why the mutants a static run left pending are pending, one line a reason, most first."""
    why: dict[str, int] = {}
    for r in results:
        if r.verdict is Verdict.PENDING:
            key = next((k for k in (NEEDS_GPU, NO_CPU_GATE) if k in r.reason), r.reason or "pending: not run on a GPU")
            why[key] = why.get(key, 0) + 1
    return [f"{n} {reason}" for reason, n in sorted(why.items(), key=lambda kv: -kv[1])]
