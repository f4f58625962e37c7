"""A comparison's work: both sides' gates through the run's lanes, each arm written once.

Each side's gates are split as the plain run splits its GPU gates (`harness.pool.lanes.split`:
whole modules, by what each gate took the last time it ran, `GateTimes` in the cubin cache's
folder), and every (side, lane) is a work item. The items run on as many slots as the run has
lanes (`harness.runs.slots.run_in_slots`), all through one executor (a warm one shares its
workers between the slots; a fresh one starts a pytest an item): the costliest first, REF's
lane and today's of the same rank one after the other, so both sides end together. One lane
(`--harness-lanes 1`, `--compare-timing`, a machine of two or three cores) is two items, REF's then
today's, on one slot: the sides one after the other, as on one worker.

A gate is in exactly one item of its side, and writes its arm outputs and launches into its
side's folder under files named by its node id (`harness.plugin.snapshots.side_folder`,
`dump_name`): lanes that run at once never write the same file, and no arm is written twice.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from harness.plugin.compare.sides import Piece
from harness.pool.lanes import Gate, GateTimes, split

SIDES = ("ref", "today")  # the order a rank's items start in


@dataclass(frozen=True)
class WorkItem:
    """One lane of one side: its gates, in the run's order."""

    side: str  # "ref" or "today"
    lane: int  # its rank among its side's lanes, the costliest 0
    gates: tuple[str, ...]
    seconds: float = 0.0  # what its gates took the last time they ran, summed (an estimate)


def work_items(sides: dict[str, list[Gate]], lanes: int) -> list[WorkItem]:
    """Each side's gates in at most `lanes` lanes (`split`: whole modules, a module cut only
    where it alone would outlast a lane's share), as work items in the order they start: by
    rank, each side's costliest lane first, the sides alternating within a rank in the order
    `sides` names them. Every gate of a side is in exactly one of its items."""
    if isinstance(lanes, bool) or not isinstance(lanes, int) or lanes < 1:
        raise ValueError(f"a comparison's lanes: a whole number from 1, got {lanes!r}")
    ranked: dict[str, list[WorkItem]] = {}
    for side, gates in sides.items():
        twice = sorted(n for n, k in Counter(g.nodeid for g in gates).items() if k > 1)
        if twice:
            raise ValueError(f"{side}'s gates name {', '.join(twice)} more than once: each gate runs once a side")
        seconds = {g.nodeid: g.seconds for g in gates}
        plan = split(gates, lanes)
        if sorted(n for lane in plan for n in lane) != sorted(seconds):  # a gate lost would be compared with nothing
            raise RuntimeError(f"the split of {side}'s {len(seconds)} gates into lanes did not place each once: {plan}")
        costs = [(sum(seconds[n] for n in lane), lane) for lane in plan]
        costs.sort(key=lambda c: -c[0])  # stable: lanes of one cost keep split's order
        ranked[side] = [WorkItem(side, rank, tuple(lane), cost) for rank, (cost, lane) in enumerate(costs)]
    depth = max((len(r) for r in ranked.values()), default=0)
    return [r[rank] for rank in range(depth) for r in ranked.values() if rank < len(r)]


def gates_of(nodeids: Iterable[str], kinds: dict[str, list[str]], times: GateTimes) -> list[Gate]:
    """The split's view of a side's gates: each one's module (its file) and its estimate (what
    it took last time, else its kind's typical cost)."""
    return [Gate(n, n.split("::", 1)[0], times.estimate(n, tuple(kinds.get(n) or ()))) for n in nodeids]


def run_items(executor, items: list[WorkItem], roots: dict[str, Path], jobs: int,
              deadline_of: Callable[[WorkItem], float]) -> dict[str, list[Piece]]:
    """Run every item on `jobs` slots through `executor` (each over its side's kernel root,
    `roots`); {side: its pieces, by lane}. An interrupt (Ctrl-C) kills what runs and closes the
    executor, then is raised again."""
    from harness.runs.slots import from_list, run_in_slots

    pieces: dict[str, list[Piece]] = {side: [] for side in roots}

    def work(item: WorkItem, slot: int):
        return executor.run(roots[item.side], list(item.gates), deadline_of(item))

    def done(item: WorkItem, ran) -> None:
        pieces[item.side].append(Piece(item.lane, item.gates, ran))

    run_in_slots(from_list(items), jobs, work, done, on_abort=executor.close, name="compare")
    return {side: sorted(got, key=lambda p: p.lane) for side, got in pieces.items()}


def run_facts(items: list[WorkItem], pieces: dict[str, list[Piece]], jobs: int, seconds: float, executor) -> dict:
    """How the sides ran, for compare.json: the lanes, each piece's gates, estimate and time
    (and, of it, the wait for a worker), the wall of them all, and where a warm executor's
    time went (`WarmExecutor.timing`, `summary`)."""
    got = {(side, p.lane): p for side, ps in pieces.items() for p in ps}
    rows = []
    for item in items:
        run = got[(item.side, item.lane)].run if (item.side, item.lane) in got else None
        rows.append({"side": item.side, "lane": item.lane, "gates": len(item.gates),
                     "estimate_s": round(item.seconds, 3), "seconds": round(run.seconds, 3) if run else None,
                     "waited_s": round(run.waited, 3) if run else None})
    workers = "; ".join(f() for f in (getattr(executor, "timing", None), getattr(executor, "summary", None)) if f)
    return {"lanes": max((i.lane + 1 for i in items), default=0), "at_once": min(jobs, len(items)),
            "seconds": round(seconds, 3), "pieces": rows, "workers": workers or None}


def lanes_line(ref: str, items: list[WorkItem], jobs: int, timing: bool) -> str:
    """What the terminal says of how the sides ran."""
    per_side = {side: sum(1 for i in items if i.side == side) for side in SIDES}
    lanes = max(per_side.values(), default=0)
    why = " (--compare-timing: timed launches keep the GPU to one worker)" if timing else ""
    return (f"compare to {ref}: each side's gates in {lanes} lane(s) of whole modules, "
            f"{min(jobs, len(items)) or 1} at once{why}")
