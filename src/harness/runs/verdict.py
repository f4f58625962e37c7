"""The one verdict vocabulary of a perturbed tree's run, for controls and mutants alike.

A perturbation is killed when a gate goes red by its own assertion, killed-by-trap when red
only through a device guard, a fault, a refusal or a crash; the rest say why no gate judged
it. The controls report says `proven`, `guard-only` and `invalid` for the first two and for
a compile error (`harness.campaigns.controls.report.word`); the mutation report uses these values.
"""

from __future__ import annotations

import enum


class Verdict(str, enum.Enum):
    KILLED = "killed"  # a gate red by its own assertion
    KILLED_BY_TRAP = "killed-by-trap"  # red only through a device guard, a fault, a refusal or a crash
    TIMEOUT = "timeout"  # the run hit its deadline
    SURVIVED = "survived"  # a gate that should have gone red stayed green
    NO_COVERAGE = "no-coverage"  # no gate loads the module or reads the source
    EQUIVALENT = "equivalent"  # cubin identical to the original's in everything that runs
    DUPLICATE = "duplicate"  # cubin identical to another mutant's: takes its verdict
    COMPILE_ERROR = "compile-error"  # the perturbation does not apply or does not compile
    PENDING = "pending"  # --static: screened, valid, not run on a GPU
    SKIPPED = "skipped"  # with no device (--no-require-gpu): every gate that would judge it needs one

    def __str__(self) -> str:
        return self.value
