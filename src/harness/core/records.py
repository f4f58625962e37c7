"""One typed record of a gate's verdict, shared by the plugin (which writes gates.json), the
controls engine and the mutation campaign (which read it), and the pool's workers.

Outcome and route are str enums: they compare equal to their plain values, and JSON writes
them as those values. `RECORD_VERSION` is gates.json's `version`; `GateRecord.from_json`
reads one line of its `gates` list and ignores fields it does not know (a newer writer), so
a reader never breaks on an added field.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from enum import Enum

RECORD_VERSION = 1


class Outcome(str, Enum):
    PASSED = "passed"
    FAILED = "failed"  # its call went red
    ERROR = "error"  # its setup or teardown went red
    SKIPPED = "skipped"
    NOT_RUN = "not run"  # a campaign stopped before it (an earlier gate killed the mutant)

    def __str__(self) -> str:
        return self.value


RED = (Outcome.FAILED, Outcome.ERROR)


class Route(str, Enum):
    """How a red gate went red."""

    ASSERTION = "assertion"  # the gate's own assertion (or a trap gate whose guard did not fire)
    TRAP = "trap"  # a CUDA fault: the kernel's __trap(), an illegal address, a poisoned context
    REFUSAL = "refusal"  # a launcher refused the arguments (harness.library.launch.Refusal)
    COMPILE = "compile"  # the module did not compile
    TIMEOUT = "timeout"  # the gate ran past its deadline; its worker was killed
    SANITIZER = "sanitizer"  # compute-sanitizer reported a finding while the gate ran (--sanitize)
    ERROR = "error"  # anything else

    def __str__(self) -> str:
        return self.value


@dataclass
class GateRecord:
    """One gate: what it is, how it ended, where it ran, what it touched."""

    nodeid: str
    outcome: str = Outcome.PASSED.value  # an Outcome value
    route: str | None = None  # a Route value, when red
    first_failure_line: str | None = None
    failure_message: str | None = None  # the whole message, bounded; for controls' substrings
    module: str = ""
    kind: str | None = None
    gpu: bool = False
    duration: float = 0.0
    skip_reason: str | None = None
    device: str | None = None
    device_ordinal: int | None = None  # which GPU of the machine (nvidia-smi's index)
    device_uuid: str | None = None  # tells apart GPUs that share a name
    worker: str | None = None  # the pool worker process that ran the gate
    worker_phases: str | None = None  # an isolated gate's setup / call / teardown seconds inside its worker
    compile_options: list[str] = field(default_factory=list)
    isolated: bool = False  # ran alone in a fresh worker process (trap gates)
    trap_shadow_hits: int | None = None  # a trap gate that passed in the trap shadow: the guards it counted
    trap_shadow_unsettled: str | None = None  # why the trap shadow did not settle it (it then trapped for real)
    memory_safety: bool = False  # written for a memory-safety property (trap gates, @pytest.mark.memory_safety)
    names_faults: bool = False  # turns a device error on valid input into its own assertion (@pytest.mark.names_faults)
    modules_loaded: list[str] = field(default_factory=list)  # kernel-root-relative modules the gate loaded
    sources_read: list[str] = field(default_factory=list)  # kernel-root-relative sources it read (structural)
    kernels_launched: list[str] = field(default_factory=list)  # "file.cu:name" of each kernel it launched
    oracle: str | None = None  # the reference function(s) it used as its oracle: "torch module.fn" (harness.library.reference)
    compared: list[str] = field(default_factory=list)  # with an oracle: each comparison, "label: bitwise" or tolerance

    @property
    def red(self) -> bool:
        return self.outcome in RED

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "GateRecord":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


MESSAGE_LIMIT = 4000  # characters of a failure message kept in a record (controls match substrings of it)
GUARD_DID_NOT_FIRE = "the device guard did not fire: the gate's body returned normally"


def fold_report(rec: GateRecord, report) -> GateRecord:
    """Fold one of a gate's phase reports (pytest's TestReport: setup, call, teardown) into its
    record: the first red phase decides (`failed` for the call, `error` for setup or
    teardown), with the route and first failure line its `user_properties` carry; a skip
    counts while nothing is red. The one fold of pytest reports: the plugin's recorder and
    the pool's workers both use it."""
    props = dict(getattr(report, "user_properties", ()) or ())
    rec.duration += getattr(report, "duration", 0.0) or 0.0
    if report.skipped and rec.outcome == Outcome.PASSED:
        rec.outcome = Outcome.SKIPPED.value
        lr = report.longrepr
        rec.skip_reason = lr[2] if isinstance(lr, tuple) and len(lr) == 3 else str(lr)
    elif report.failed and rec.outcome not in RED:
        rec.outcome = (Outcome.FAILED if report.when == "call" else Outcome.ERROR).value
        rec.route = props.get("route", Route.ERROR.value)
        rec.first_failure_line = props.get("first_failure_line")
        rec.failure_message = (getattr(report, "harness_failure_message", None)
                               or str(report.longrepr)[:MESSAGE_LIMIT])
    return rec


def trap_verdict(outcome: str, route: str | None, shadow_hits: int | None = None) -> tuple[str, str | None, bool]:
    """A trap gate's verdict from how its body ended: (outcome, route, whether the trap rule
    changed it). A device fault (route trap), or guards counted in the trap shadow
    (`shadow_hits` > 0: the real kernel would have trapped at the first), is a pass; a body
    that returned normally fails by assertion (GUARD_DID_NOT_FIRE); anything else stands."""
    if outcome not in (Outcome.PASSED, Outcome.FAILED):
        return outcome, route, False
    if shadow_hits:
        return Outcome.PASSED.value, None, True
    if outcome == Outcome.PASSED:
        return Outcome.FAILED.value, Route.ASSERTION.value, True
    if route == Route.TRAP:
        return Outcome.PASSED.value, None, True
    return outcome, route, False
