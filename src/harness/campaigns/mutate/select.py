"""Which gates to run for a mutant: those that load its module or read its source.

The baseline's gates.json lists each gate with `modules_loaded` and `sources_read`
(kernel-root-relative paths; written by the plugin, or by `harness.campaigns.mutate.recorder` into a
folder beside it). For a mutant of file F, whose modules are the `.cu` files whose
closure holds F:

1. direct gates: those that load one of the modules, or read F; first the ones that load no
   module (source readers: they launch nothing, so a mutant that hangs or faults on the
   device cannot stop them from naming it by assertion), then fastest first (the
   baseline's durations; the campaign then moves the file's frequent killers first,
   `campaign.KillHistory`), trap gates last (after the siblings too, `Coverage.batches`).
   A trap gate ends its worker (its `__trap()`
   leaves the context unusable, so the next mutant needs a fresh process and context),
   and the baseline records it as taking next to nothing (it ran ahead, on a spare):
   first, it would cost every mutant a worker;
2. then their siblings: the other gates of the same test files. A module-scoped fixture
   that loaded the module in an earlier gate's setup, or a structural gate that reads the
   text itself instead of through `harness.library.source`, is covered this way.

A mutant whose cubin equals the original's runs only the gates that read F (and their
siblings): no numeric gate can see an identical cubin. A mutant with no direct gate is
`no-coverage`. An isolated gate (a trap gate run in its own process) whose loads were not
recorded inherits every module its test file's gates load.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from harness.core.records import Outcome


@dataclass(frozen=True)
class GateInfo:
    nodeid: str
    file: str  # the test file
    kind: str | None
    duration: float
    modules: frozenset[str] | None  # None: not recorded
    sources: frozenset[str] | None
    isolated: bool = False
    memory_safety: bool = False  # written for a memory-safety property: a fault in it is its verdict
    kernels: frozenset[str] | None = None  # "file.cu:name" of each kernel it launched; None: not recorded
    names_faults: bool = False  # fails by its own assertion on a device error with valid input
    gpu: bool = False  # needs a CUDA device (a `gpu` or `trap` gate)
    passed: bool = True  # passed in the baseline (a --static baseline skips every GPU gate)


@dataclass(frozen=True)
class Selection:
    direct: tuple[str, ...]
    siblings: tuple[str, ...]

    @property
    def all(self) -> tuple[str, ...]:
        return self.direct + self.siblings


class Coverage:
    def __init__(self, gates: list[GateInfo]):
        self.gates = {g.nodeid: g for g in gates}
        by_file: dict[str, set[str]] = {}
        for g in gates:
            by_file.setdefault(g.file, set()).update(g.modules or ())
        self._modules: dict[str, frozenset[str]] = {}
        for g in gates:
            mods = g.modules
            if not mods and g.isolated:
                mods = frozenset(by_file.get(g.file, ()))
            self._modules[g.nodeid] = frozenset(mods or ())

    @property
    def recorded(self) -> bool:
        """True when every gate's loads and reads were recorded."""
        return bool(self.gates) and all(g.modules is not None and g.sources is not None for g in self.gates.values())

    def source_read(self) -> set[str] | None:
        """Files some gate reads as source; None when that was not recorded."""
        if not self.recorded:
            return None
        return {s for g in self.gates.values() for s in (g.sources or ())}

    def place(self, nodeid: str) -> tuple[bool, bool]:
        """The part of a gate's order nothing may change: (runs last: a trap gate, which ends
        its worker; launches a kernel: a source reader, which launches nothing, runs first)."""
        g = self.gates[nodeid]
        return (g.kind == "trap" or g.isolated, bool(self._modules[nodeid]))

    def _order(self, ids) -> tuple[str, ...]:
        return tuple(sorted(ids, key=lambda n: (*self.place(n), self.gates[n].duration, n)))

    def batches(self, sel: "Selection") -> list[tuple[str, ...]]:
        """The order a mutant's gates run in: its direct gates, then their siblings, then the
        trap gates of both. A trap gate costs a worker of its own (a fresh process and
        context, then the trap's own fault handling, which the driver does one at a time per
        GPU), so run last they cost nothing for a mutant that an earlier gate kills."""
        last = [g for g in sel.all if self.place(g)[0]]
        return [tuple(g for g in sel.direct if g not in last), tuple(g for g in sel.siblings if g not in last),
                tuple(last)]

    def select(self, file: str, modules: tuple[str, ...] | list[str], cubin_identical: bool = False) -> Selection:
        wanted = set(modules)
        direct = set()
        for nodeid, g in self.gates.items():
            reads = file in (g.sources or ())
            loads = bool(self._modules[nodeid] & wanted)
            if reads or (loads and not cubin_identical):
                direct.add(nodeid)
        files = {self.gates[n].file for n in direct}
        siblings = {n for n, g in self.gates.items() if g.file in files and n not in direct}
        return Selection(self._order(direct), self._order(siblings))

    def unreached_trap_gates(self, nodeids, reaching: frozenset[str]) -> set[str]:
        """The trap gates among `nodeids` that cannot run code a mutant in a function reached
        only by the kernels `reaching` changed: each launched kernels (recorded), none of them
        one of those. Sound for trap gates alone: each ran in a fresh worker of its own in the
        baseline, so every kernel its verdict rests on (fixtures, caches) was launched, and
        recorded, during it. A gate that shares a process with others may take a kernel's
        output from an earlier gate's fixture or cache without launching it."""
        from harness.campaigns.mutate.callgraph import kernel_base_name

        out = set()
        for n in nodeids:
            g = self.gates.get(n)
            if g is None or not g.isolated or not g.kernels:
                continue
            if not {kernel_base_name(k) for k in g.kernels} & reaching:
                out.add(n)
        return out

    def cpu_gates(self) -> frozenset[str]:
        """Gates that need no device and passed in the baseline (structural gates, host-side
        refusals): what `--static` runs for each mutant on the CPU."""
        return frozenset(n for n, g in self.gates.items() if not g.gpu and g.passed)

    @property
    def has_gpu_gates(self) -> bool:
        """Some gate needs a device (then a baseline without one did not see what it loads)."""
        return any(g.gpu for g in self.gates.values())

    def memory_safety_gates(self) -> frozenset[str]:
        """Gates written for a memory-safety property (a fault in them is their verdict)."""
        return frozenset(n for n, g in self.gates.items() if g.memory_safety)

    def fault_naming_gates(self) -> frozenset[str]:
        """Gates that turn a device error on valid input into their own assertion."""
        return frozenset(n for n, g in self.gates.items() if g.names_faults)

    def seconds(self, nodeids) -> float:
        """What these gates took together in the baseline."""
        return sum(self.gates[n].duration for n in nodeids if n in self.gates)

    def modules_of(self, nodeid: str) -> frozenset[str]:
        return self._modules.get(nodeid, frozenset())

    @classmethod
    def from_report(cls, gates_json: Path, coverage_dir: Path | None = None) -> "Coverage":
        """From a baseline gates.json, with `coverage_dir` (the recorder's files) filling in
        what the gates.json records lack."""
        report = json.loads(Path(gates_json).read_text())
        extra: dict = {}
        if coverage_dir is not None and Path(coverage_dir).is_dir():
            from harness.campaigns.mutate.recorder import read_folder

            extra = read_folder(Path(coverage_dir))
        seen: dict[str, GateInfo] = {}
        for rec in report.get("gates", []):
            nodeid = rec["nodeid"]
            rec_extra = extra.get(nodeid, {})

            def field(key):
                if rec.get(key) is not None:
                    return frozenset(rec[key]) | frozenset(rec_extra.get(key, ()))
                if key in rec_extra:
                    return frozenset(rec_extra[key])
                return None

            info = GateInfo(
                nodeid=nodeid,
                file=rec.get("module") or nodeid.split("::")[0],
                kind=rec.get("kind"),
                duration=float(rec.get("duration") or 0.0),
                modules=field("modules_loaded"),
                sources=field("sources_read"),
                isolated=bool(rec.get("isolated")),
                memory_safety=bool(rec.get("memory_safety")),  # the plugin marks trap gates so too
                kernels=field("kernels_launched"),
                names_faults=bool(rec.get("names_faults")),
                gpu=bool(rec.get("gpu")),
                passed=rec.get("outcome", Outcome.PASSED) == Outcome.PASSED,
            )
            previous = seen.get(nodeid)
            if previous is not None:  # setup/teardown lines: keep one, with the longest time
                info = GateInfo(nodeid, info.file, info.kind, max(info.duration, previous.duration),
                                _union(previous.modules, info.modules), _union(previous.sources, info.sources),
                                info.isolated or previous.isolated, info.memory_safety or previous.memory_safety,
                                _union(previous.kernels, info.kernels), info.names_faults or previous.names_faults,
                                info.gpu or previous.gpu, info.passed and previous.passed)
            seen[nodeid] = info
        return cls(list(seen.values()))


def _union(a, b):
    if a is None:
        return b
    if b is None:
        return a
    return a | b
