"""How many lanes a run gets on a machine it may share with other harness runs, and why.

Each lane's worker is a CUDA context with its buffers on the GPU and a process on the host's
cores. A run alone takes `auto_lanes` (half the cores, at most MAX_AUTO_LANES); runs side by
side, each taking that, would make more contexts than the GPU has memory for (a run's probe
then cannot make one) and more processes than the host has cores. So a run claims its lanes in
the machine's ledger (`harness.pool.ledger`) once its probe has named the device, and gets the
least of:

- what it wants (its auto lanes, no more than its ordinary GPU gates);
- the host's lanes (half its cores) less the lanes every other harness run on it holds;
- the workers the GPU holds (its memory less RESERVE_BYTES, in WORKER_BYTES a worker) less
  those the other runs on that GPU hold, less its own workers beside its lanes;
- the workers the GPU's free memory holds at the probe, less its workers beside its lanes
  (what else uses the GPU: another user's program, a harness run the ledger does not see);

and at least one lane: a run always runs. A count the run fixed (`--harness-lanes`, ini
`harness_lanes`, a sanitizer, `--compare-timing`, an xdist worker) is honoured and written down
all the same, so the runs after it count it. The summary says what it got and why (`LaneShare.line`).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from harness.pool.ledger import Claim, Holding, Ledger
from harness.pool.worker import POOL_RESERVE_MB

GIB = 1 << 30
MIB = 1 << 20
# A worker on the GPU: its CUDA context (CuPy's kernels loaded), the memory it puts in CuPy's
# pool before its first gate, and a gate's buffers past that pool.
CONTEXT_BYTES = 512 * MIB
GATE_BUFFER_BYTES = 512 * MIB
WORKER_BYTES = CONTEXT_BYTES + POOL_RESERVE_MB * MIB + GATE_BUFFER_BYTES
# Kept free of every budget: the driver's own, a display, and what another program allocates
# between a run's probe and its claim.
RESERVE_BYTES = 2 * GIB


@dataclass(frozen=True)
class GpuFacts:
    """The GPU a run's workers use: its UUID, and its memory at the probe where known."""

    uuid: str
    free: int | None = None
    total: int | None = None

    @classmethod
    def from_probe(cls, probe: dict, ordinal: int | None) -> "GpuFacts | None":
        """The facts of visible device `ordinal` (None: the first) from the pool's probe
        (`harness.pool.worker.probe_dict`); None where the probe named no device by UUID (no
        GPU, or a stand-in for one): then there is nothing shared to budget. The memory is the
        probe's own device's, the first visible one."""
        ordinal = ordinal or 0
        devices = [d for d in probe.get("devices") or [] if len(d) == 3 and d[0] == ordinal and d[2]]
        if not devices:
            return None
        memory = probe.get("memory") if ordinal == 0 else None
        free, total = (int(memory[0]), int(memory[1])) if memory and len(memory) == 2 else (None, None)
        return cls(uuid=str(devices[0][2]), free=free, total=total)

    @property
    def short(self) -> str:
        """The UUID's first eight digits, as `nvidia-smi -L` users recognise it."""
        return self.uuid[:12] if self.uuid.startswith("GPU-") else self.uuid[:8]


@dataclass(frozen=True)
class Ask:
    """What a run asks for: `wanted` lanes, `beside` workers besides them (the trap lane's, the
    spares: harness.pool.traps.first_spares), and what fixed its count ("" where auto chose it)."""

    wanted: int
    beside: int
    fixed: str = ""


class Limit(str, Enum):
    """What decided a run's lanes."""

    WANTED = "wanted"  # all it wanted
    FIXED = "fixed"  # the run fixed its count
    CORES = "cores"  # the host's cores, less the other runs' lanes
    GPU_SHARE = "gpu_share"  # the GPU's memory, less the other runs' workers on it
    GPU_FREE = "gpu_free"  # the GPU's free memory at the probe


@dataclass(frozen=True)
class Others:
    """The other harness runs on the machine at the claim."""

    runs: int = 0
    lanes: int = 0  # on the whole machine
    gpu_workers: int = 0  # on this run's GPU

    @classmethod
    def of(cls, holdings: list[Holding], gpu: str) -> "Others":
        return cls(runs=len({h.pid for h in holdings}), lanes=sum(h.lanes for h in holdings),
                   gpu_workers=sum(h.workers for h in holdings if h.gpu == gpu))


def _gib(n: int) -> str:
    return f"{n / GIB:.1f} GiB"


@dataclass(frozen=True)
class LaneShare:
    """A run's lanes, and what decided them: `budget` is what the budget allowed (below one where
    it had nothing left: the run still takes one lane, over it)."""

    lanes: int
    ask: Ask
    limit: Limit
    budget: int
    tightest: Limit  # the tightest bound, whether or not it decided
    cpus: int
    gpu: GpuFacts
    others: Others
    ledger_error: str = ""  # the ledger could not be used: other runs were not counted

    @property
    def workers(self) -> int:
        return self.lanes + self.ask.beside

    @property
    def over(self) -> bool:
        """Its lanes are more than the budget allowed."""
        return self.lanes > self.budget

    def why(self, limit: Limit) -> str:
        """What bound the lanes at `limit` (CORES, GPU_SHARE or GPU_FREE), in a phrase."""
        if limit is Limit.CORES:
            return f"{self.cpus} cores make {max(1, self.cpus // 2)} lanes, {self.others.lanes} held by other runs"
        per, kept = _gib(WORKER_BYTES), _gib(RESERVE_BYTES)
        if limit is Limit.GPU_SHARE:
            room = (self.gpu.total - RESERVE_BYTES) // WORKER_BYTES
            return (f"{self.gpu.short} holds {room} workers of {per} ({kept} kept free), "
                    f"{self.others.gpu_workers} held by other runs, {self.ask.beside} beside this run's lanes")
        room = max(0, (self.gpu.free - RESERVE_BYTES) // WORKER_BYTES)
        return (f"{_gib(self.gpu.free)} free on {self.gpu.short} is {room} workers of {per} ({kept} kept free), "
                f"{self.ask.beside} beside this run's lanes")

    def line(self) -> str:
        """One line for the summary: the lanes, what decided them, what the run shares."""
        o = self.others
        if o.runs:
            held = (f"{o.runs} other harness {'run holds' if o.runs == 1 else 'runs hold'} {o.lanes} lanes, "
                    f"{o.gpu_workers} workers on {self.gpu.short}")
        else:
            held = "no other harness run holds lanes here"
        if self.gpu.free is not None and self.gpu.total is not None:
            held += f"; {self.gpu.free / GIB:.1f} of {_gib(self.gpu.total)} free at the probe"
        if self.ledger_error:
            held += f"; other runs not counted: the ledger could not be used ({self.ledger_error})"
        if self.limit is Limit.FIXED:
            head = f"lanes: {self.lanes}, fixed by {self.ask.fixed}"
            if self.over:
                head += f", over the budget of {max(self.budget, 0)}: {self.why(self.tightest)}"
        else:
            head = f"lanes: {self.lanes} of {self.ask.wanted}"
            if self.limit is not Limit.WANTED:
                head += f": {self.why(self.limit)}"
            if self.over:
                head += "; a run takes one lane at least, here over the budget"
        return f"{head} ({held})"


def decide(ask: Ask, gpu: GpuFacts, cpus: int, holdings: list[Holding], ledger_error: str = "") -> LaneShare:
    """The lanes `ask` gets beside `holdings` (the other runs' live entries in the ledger), on
    a host of `cpus` cores, on `gpu`."""
    others = Others.of(holdings, gpu.uuid)
    bounds = {Limit.CORES: max(1, cpus // 2) - others.lanes}
    if gpu.total is not None:
        bounds[Limit.GPU_SHARE] = (gpu.total - RESERVE_BYTES) // WORKER_BYTES - others.gpu_workers - ask.beside
    if gpu.free is not None:
        bounds[Limit.GPU_FREE] = (gpu.free - RESERVE_BYTES) // WORKER_BYTES - ask.beside
    limit = min(bounds, key=bounds.__getitem__)  # the first of the tightest, in the order above
    budget = min(bounds[limit], ask.wanted)
    if ask.fixed:
        return LaneShare(ask.wanted, ask, Limit.FIXED, budget, limit, cpus, gpu, others, ledger_error)
    decided = Limit.WANTED if bounds[limit] >= ask.wanted else limit
    return LaneShare(max(1, budget), ask, decided, budget, limit, cpus, gpu, others, ledger_error)


@dataclass
class LaneClaim:
    """A run's lanes (`share`) and its entry in the ledger (None where the ledger could not be used)."""

    share: LaneShare
    claim: Claim | None

    def release(self) -> None:
        if self.claim is not None:
            self.claim.release()


def claim(ask: Ask, gpu: GpuFacts, cpus: int, ledger: Ledger) -> LaneClaim:
    """Claim `ask`'s lanes in `ledger`, weighed against every other live holding, in one step
    under its lock. Where the ledger cannot be used (a folder this user may not write), the run
    is weighed against its own host and GPU alone, and says so."""
    got: list[LaneShare] = []

    def weigh(holdings: list[Holding]) -> Holding:
        got.append(decide(ask, gpu, cpus, holdings))
        share = got[-1]
        return Holding.of_this_process(gpu.uuid, share.lanes, share.workers, ask.fixed)

    try:
        entry = ledger.claim(weigh)
    except OSError as exc:
        return LaneClaim(decide(ask, gpu, cpus, [], ledger_error=f"{ledger.root}: {exc.strerror or exc}"), None)
    return LaneClaim(got[-1], entry)
