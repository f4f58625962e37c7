"""A mutant's verdict, its record in the results file, and the scores.

`Verdict` is the run layer's (`harness.runs.verdict`), shared with the controls.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from harness.campaigns.mutate.generate import Mutant
from harness.runs.verdict import Verdict

SCREENED_OUT = (Verdict.EQUIVALENT, Verdict.DUPLICATE, Verdict.COMPILE_ERROR)
DETECTED = (Verdict.KILLED, Verdict.KILLED_BY_TRAP, Verdict.TIMEOUT)  # what Stryker counts as detected


@dataclass
class MutantResult:
    mutant: Mutant
    verdict: Verdict
    reason: str = ""  # one line: the killing gate's first failure line, the compile error, ...
    duplicate_of: str | None = None  # the twin's id
    effective: Verdict | None = None  # a duplicate's twin's verdict
    killed_by: list[str] = field(default_factory=list)
    gates_run: list[str] = field(default_factory=list)
    covered_by: list[str] = field(default_factory=list)
    seconds: float = 0.0
    cubin_identical: bool = False  # same cubin as the original (kept only because a gate reads the source)
    memory_safety: bool = False  # killed-by-trap by a gate written for that memory-safety property
    gate_seconds: float = 0.0  # of `seconds`, the gate stage (the rest: its compile in the screen)
    in_gates: float = 0.0  # of gate_seconds, inside the gates themselves
    worker_wait: float = 0.0  # of gate_seconds, waiting for a worker
    ran_on: dict | None = None  # on a cluster: {"node", "node_id", "gpu"} of the run that made the verdict
    reused: bool = False  # taken from the verdict store (`--since`), not run in this campaign

    def to_json(self) -> dict:
        d = asdict(self)
        d["mutant"] = self.mutant.to_json()
        d["verdict"] = self.verdict.value
        d["effective"] = self.effective.value if self.effective else None
        return d

    @classmethod
    def from_json(cls, d: dict) -> "MutantResult":
        d = dict(d)
        d["mutant"] = Mutant.from_json(d["mutant"])
        d["verdict"] = Verdict(d["verdict"])
        d["effective"] = Verdict(d["effective"]) if d.get("effective") else None
        return cls(**d)


@dataclass
class Recheck:
    """Verdict integrity: mutants run again through another executor (a fresh process)."""

    checked: list[str]
    agreed: int
    disagreements: dict  # id -> (first verdict, second verdict, the second run's reason)
    # re-runs that hit the deadline where the campaign had a verdict, run once more with
    # fewer at once (retry_jobs): their ids, and how many agreed then
    retried: list[str] = field(default_factory=list)
    agreed_on_retry: int = 0
    retry_jobs: int = 0  # how many of those ran at once

    def line(self) -> str:
        text = f"{self.agreed} of {len(self.checked)} re-run verdicts agreed"
        if self.retried:
            text += (f" ({len(self.retried)} re-run(s) hit the deadline where the campaign had a verdict and ran "
                     f"once more, at most {self.retry_jobs} at once: {self.agreed_on_retry} agreed then)")
        return text


# ---------------------------------------------------------------- results file (for --resume)


RESULTS_VERSION = 1


def append_result(path: Path, result: MutantResult) -> None:
    """One JSON line per finished mutant, flushed: an interrupted campaign loses at most one."""
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps({"version": RESULTS_VERSION, **result.to_json()}) + "\n")
        f.flush()


def read_results(path: Path) -> dict[str, MutantResult]:
    """The finished mutants of an earlier run, by id; a line that is not one (a torn last
    line, a damaged file) is ignored: its mutant runs again."""
    out: dict[str, MutantResult] = {}
    if not Path(path).is_file():
        return out
    for line in Path(path).read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            d = json.loads(line)
            if not isinstance(d, dict) or d.pop("version", None) != RESULTS_VERSION:
                continue
            r = MutantResult.from_json(d)
        except (ValueError, KeyError, TypeError, AttributeError):
            continue
        out[r.mutant.id] = r
    return out


# ---------------------------------------------------------------- scores


@dataclass
class Score:
    """Counts and the two scores of one row (a file, a family, an operator or the total)."""

    counts: dict[str, int]
    safety: int = 0  # of the killed-by-trap, those caught by a gate written for that memory-safety property

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @property
    def valid(self) -> int:
        """Mutants that count: not equivalent, not a duplicate, not a compile error (and run)."""
        return self.total - sum(self.counts.get(v.value, 0) for v in (*SCREENED_OUT, Verdict.PENDING))

    @property
    def score(self) -> float | None:
        """Killed by assertion (or by a fault in a gate written for that memory-safety
        property: a trap gate, an invalid-entry gate) over valid mutants."""
        return (self.counts.get(Verdict.KILLED.value, 0) + self.safety) / self.valid if self.valid else None

    @property
    def stryker_score(self) -> float | None:
        """Killed (assertion or trap) and timeouts over valid mutants, as Stryker counts."""
        detected = sum(self.counts.get(v.value, 0) for v in DETECTED)
        return detected / self.valid if self.valid else None

    def to_json(self) -> dict:
        return {"counts": self.counts, "total": self.total, "valid": self.valid, "score": self.score,
                "stryker_score": self.stryker_score, "killed_by_memory_safety_gate": self.safety}


def scores(results: list[MutantResult], key) -> dict[str, Score]:
    """Score rows grouped by `key(result)`; a duplicate is counted as `duplicate`."""
    rows: dict[str, Score] = {}
    for r in results:
        row = rows.setdefault(key(r), Score({v.value: 0 for v in Verdict}))
        row.counts[r.verdict.value] += 1
        row.safety += r.verdict is Verdict.KILLED_BY_TRAP and r.memory_safety
    return dict(sorted(rows.items()))


def total_score(results: list[MutantResult]) -> Score:
    return scores(results, lambda r: "total").get("total", Score({v.value: 0 for v in Verdict}))
