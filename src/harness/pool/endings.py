"""What a wait for a pool worker gives back: how it ended (`Ending`, the one thing a caller asks
first) and what that ending carries, for one gate (`RunResult`) or a mutant's set (`SetResult`)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class Ending(enum.Enum):
    """How a wait for a worker ended: the one thing a caller asks of a result first."""

    VERDICT = "verdict"  # the worker sent what it was asked for (a gate's reports, a set's outcomes)
    TIMED_OUT = "timed out"  # past the deadline: the worker was killed
    DIED = "died"  # the worker ended without a verdict, or could not be sent the work: `why`
    STOPPED = "stopped"  # killed at its launch of a kernel that hung in an earlier gate (`Hung`)


@dataclass(frozen=True)
class Received:
    """What `Worker._receive` got: the `done` message (VERDICT only), how the wait ended, why
    (DIED only) and the last kernel the worker launched."""

    msg: dict | None
    ending: Ending
    why: str | None = None
    last_launch: str | None = None


class _Ended:
    """`timed_out` and `died` read from `ending` and `why`, for the callers that still ask a
    result so."""

    ending: Ending
    why: str | None

    @property
    def timed_out(self) -> bool:
        return self.ending is Ending.TIMED_OUT

    @property
    def died(self) -> str | None:
        """Why the worker died (`why`) when that is how it ended, else None."""
        return self.why if self.ending is Ending.DIED else None


@dataclass
class RunResult(_Ended):
    """What a worker did with one gate: how it ended (`ending`), what that ending carries, and
    what the pytest process notes on it after (`waited`, `unsettled`)."""

    ending: Ending = Ending.VERDICT
    reports: list = field(default_factory=list)  # VERDICT: serialized pytest reports
    poisoned: bool = False  # VERDICT: the gate left the CUDA context unusable: the worker is gone
    why: str | None = None  # DIED: why the worker ended without a verdict
    last_launch: str | None = None
    launches: int = 0  # kernel launches made through harness.library.kernels during the gate
    phases: dict = field(default_factory=dict)  # setup / call / teardown seconds inside the worker
    seconds: float = 0.0  # from the gate's start in the worker to its verdict
    waited: float = 0.0  # how long the pytest process waited for it (its cost to the run)
    # STOPPED: (kernel, gate), the kernel it launched and the earlier gate it hung in (`Hung`)
    hung_in: tuple[str, str] | None = None
    # a trap gate run in the trap shadow: the guards it counted; None: not run there, or unreadable
    shadow_hits: int | None = None
    unsettled: str | None = None  # why a run in the trap shadow did not settle it (then it trapped for real)

    @property
    def ran_to_its_end(self) -> bool:
        """The gate gave its verdict in the worker (not cut by its deadline, a dead worker or a
        hung kernel): `seconds` is what it takes, a time worth keeping for the next run's lanes."""
        return self.ending is Ending.VERDICT


@dataclass(frozen=True)
class SetResult(_Ended):
    """What a worker did with a mutant's gates (`Worker.run_set`): one outcome each for the
    gates that ran (`harness.pool.worker.run_set`), and how the wait ended."""

    outcomes: list
    ending: Ending
    why: str | None = None  # DIED: why the worker ended without a verdict
    last_launch: str | None = None
