"""Sweep a kernel over the shapes it runs at: a declared shape space, boundaries first, then
Hypothesis, each case checked against the family's oracle; a failure shrinks to the smallest
failing shape and names the one command that replays it.

A launcher (or a gate) declares its kernel's space once:

    SPACE = ShapeSpace("fp8_gemv", (
        Dim("N", 1, 32768),
        Dim("K", 16, 65536, multiple_of=16, tile=1024),  # 1024: the kernel's sweep width
        Dim("T", 1, 64),
    ), where=(("N*K fits the pool", lambda s: s["N"] * s["K"] <= 1 << 26),),
       presets=(Preset("Llama-3 8B q_proj", {"N": 4096, "K": 4096, "T": 1}, "config.json: hidden_size 4096"),))

and a gate of kind `sweep` checks each case (`sweep(SPACE, check)`, `check(shape)` raising on a
mismatch, as any gate's assertion). The cases, in order:

1. the presets: the dimensions of real models, each with its source;
2. the boundaries of each dimension, the others at their smallest: its least and greatest
   value, the multiples of its tile and a tail of one either side of them (the full sweep with
   no tail, the tail of one element), the powers of two in range;
3. `budget` cases Hypothesis draws from the space (derandomised: the same cases every run;
   its example database under the cubin cache, so a case that failed once is tried first).

A failing case is shrunk, dimension by dimension, to the smallest shape found that still fails
(Hypothesis's by its own shrinker first; then each dimension through its boundaries below,
halfway to its least value and its next values down), and the failure names that shape and
the command that replays it alone:

    fp8_gemv: the smallest failing shape is N=1, K=1024, T=1 (found at N=4096, K=65536, T=1; 41 shapes
    tried): <the check's first failure line>
    replay: python -m pytest 'gates/test_fp8_gemv.py::test_x' --sweep-replay 'N=1,K=1024,T=1'

A device fault leaves the context unusable, so the sweep stops at the shape that faulted
instead of shrinking (every later case would fail the same way). `--sweep-budget N` draws more
cases; `--sweep-replay SHAPE` checks that one shape and nothing else. Both reach the run's
children through its settings (`harness.core.settings.Settings`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Callable, Mapping

from harness.core.errors import CheckFailed, UsageError
from harness.library import coverage

DEFAULT_BUDGET = 25  # cases Hypothesis draws after the presets and the boundaries
SEED = 20261207  # the drawn cases' seed: the same every run (CI, a replay, a colleague's machine)
Shape = dict[str, int]


@dataclass(frozen=True)
class Dim:
    """One dimension: the integers from `lo` to `hi` (inclusive) that are a multiple of
    `multiple_of`; `tile` (a multiple of it) is the width the kernel sweeps in, whose multiples
    and their tails of one are boundaries."""

    name: str
    lo: int
    hi: int
    multiple_of: int = 1
    tile: int | None = None

    def __post_init__(self):
        if not self.name.isidentifier():
            raise UsageError(f"a shape dimension is named {self.name!r}: name it as a Python identifier (N, K, heads)")
        if self.multiple_of < 1 or self.lo < self.multiple_of or self.lo > self.hi:
            raise UsageError(f"dimension {self.name}: lo {self.lo}, hi {self.hi}, multiple_of {self.multiple_of} "
                             "give no value: need multiple_of <= lo <= hi")
        if self.lo % self.multiple_of or self.hi % self.multiple_of:
            raise UsageError(f"dimension {self.name}: lo {self.lo} and hi {self.hi} must be multiples of "
                             f"{self.multiple_of}")
        if self.tile is not None and (self.tile < 1 or self.tile % self.multiple_of):
            raise UsageError(f"dimension {self.name}: tile {self.tile} must be a positive multiple of "
                             f"{self.multiple_of}")

    def holds(self, value: int) -> bool:
        return self.lo <= value <= self.hi and value % self.multiple_of == 0

    def boundaries(self) -> list[int]:
        """Its least and greatest value, each tile multiple and its tails of one step either
        side, the powers of two: every one that the dimension holds, ascending."""
        m = self.multiple_of
        out = {self.lo, self.hi}
        if self.tile:
            k = self.tile
            while k <= self.hi:
                out.update((k - m, k, k + m))
                k = k * 2 if k < 8 * self.tile else k + 8 * self.tile  # dense near the tile, sparse far off
        p = 1
        while p <= self.hi:
            out.add(p)
            p *= 2
        return sorted(v for v in out if self.holds(v))


@dataclass(frozen=True)
class Preset:
    """A shape a real model runs the kernel at, with where its numbers come from."""

    name: str
    shape: Mapping[str, int]
    source: str


@dataclass(frozen=True)
class ShapeSpace:
    """A kernel's legal shapes: its dimensions, the rules between them (`where`: named
    predicates over a shape), and its production presets."""

    name: str
    dims: tuple[Dim, ...]
    where: tuple[tuple[str, Callable[[Shape], bool]], ...] = ()
    presets: tuple[Preset, ...] = ()
    names: tuple[str, ...] = field(init=False)

    def __post_init__(self):
        object.__setattr__(self, "names", tuple(d.name for d in self.dims))
        if len(set(self.names)) != len(self.names):
            raise UsageError(f"shape space {self.name}: a dimension is named twice ({', '.join(self.names)})")
        for p in self.presets:
            problem = self.problem(dict(p.shape))
            if problem:
                raise UsageError(f"shape space {self.name}: preset {p.name!r} ({p.source}) is not in the space: "
                                 f"{problem}")

    def smallest(self) -> Shape:
        return {d.name: d.lo for d in self.dims}

    def problem(self, shape: Shape) -> str | None:
        """Why `shape` is not in the space, or None."""
        if set(shape) != set(self.names):
            return f"its dimensions are {sorted(shape)}, the space's {list(self.names)}"
        for d in self.dims:
            if not d.holds(shape[d.name]):
                return f"{d.name}={shape[d.name]} is outside {d.lo}..{d.hi} (a multiple of {d.multiple_of})"
        for rule, test in self.where:
            if not test(shape):
                return f"breaks {rule}"
        return None

    def boundary_cases(self) -> list[Shape]:
        """Each dimension at each of its boundaries, the others at their smallest (nudged up
        to a legal shape where a rule needs it), without repeats, smallest first."""
        seen, out = set(), []
        for d in self.dims:
            for v in d.boundaries():
                shape = self._legal_near({**self.smallest(), d.name: v}, keep=d.name)
                if shape is not None and (key := tuple(shape[n] for n in self.names)) not in seen:
                    seen.add(key)
                    out.append(shape)
        return sorted(out, key=lambda s: (math.prod(s.values()), tuple(s[n] for n in self.names)))

    def _legal_near(self, shape: Shape, keep: str) -> Shape | None:
        """`shape`, or the least change of its other dimensions (each up through its
        boundaries) that the rules accept; None when none does."""
        if self.problem(shape) is None:
            return shape
        for d in self.dims:
            if d.name == keep:
                continue
            for v in d.boundaries():
                candidate = {**shape, d.name: v}
                if self.problem(candidate) is None:
                    return candidate
        return None

    def strategy(self):
        """Hypothesis's strategy over the space: each dimension an integer of its multiple,
        shrinking towards its least value; the rules filter."""
        from hypothesis import strategies as st

        parts = {d.name: st.integers(d.lo // d.multiple_of, d.hi // d.multiple_of).map(
            lambda i, m=d.multiple_of: i * m) for d in self.dims}
        return st.fixed_dictionaries(parts).filter(lambda s: all(test(s) for _, test in self.where))

    def parse(self, text: str) -> Shape:
        """A shape written as `N=64,K=1024,T=1` (the replay form). Raises UsageError."""
        shape = {}
        for part in (p.strip() for p in text.split(",") if p.strip()):
            m = re.fullmatch(r"(\w+)=(-?\d+)", part)
            if m is None:
                raise UsageError(f"--sweep-replay {text!r}: {part!r} is not NAME=INTEGER; write e.g. "
                                 f"{written(self.smallest())}")
            shape[m.group(1)] = int(m.group(2))
        problem = self.problem(shape)
        if problem:
            raise UsageError(f"--sweep-replay {text!r} is not a shape of {self.name}: {problem}")
        return shape


def written(shape: Shape) -> str:
    """`N=64,K=1024,T=1`: a shape as --sweep-replay takes it."""
    return ",".join(f"{k}={v}" for k, v in shape.items())


def shown(shape: Shape) -> str:
    """`N=64, K=1024, T=1`: a shape in a failure's words."""
    return ", ".join(f"{k}={v}" for k, v in shape.items())


class ShapeFailed(CheckFailed):
    """A sweep found a shape its kernel gets wrong: the smallest such, and how to replay it."""

    def __init__(self, space: str, smallest: Shape, found_at: Shape, tried: int, first_line: str, replay: str):
        self.space, self.smallest, self.found_at, self.tried = space, smallest, found_at, tried
        self.first_line, self.replay = first_line, replay
        at = "" if found_at == smallest else f"found at {shown(found_at)}; "
        super().__init__(f"{space}: the smallest failing shape is {shown(smallest)} ({at}"
                         f"{tried} shapes tried): {first_line}\nreplay: {replay}")


class ShapeFaulted(CheckFailed):
    """A device fault at a shape: the context is gone, so the sweep stops there, unshrunk."""

    def __init__(self, space: str, shape: Shape, tried: int, first_line: str, replay: str):
        self.space, self.shape, self.tried, self.first_line, self.replay = space, shape, tried, first_line, replay
        super().__init__(f"{space}: a device fault at {shown(shape)} ({tried} shapes tried; "
                         f"the context is gone, so it is not shrunk): {first_line}\nreplay: {replay}")


class ShapeRefused(CheckFailed):
    """A shape the space promises (a preset, a boundary) that its launcher refuses or whose
    host check fails: the space is declared wrong, or the launcher is."""

    def __init__(self, space: str, label: str, shape: Shape, first_line: str):
        self.space, self.label, self.shape, self.first_line = space, label, shape, first_line
        super().__init__(f"{space}: {label} ({shown(shape)}) is a shape the space promises, "
                         f"and its check failed: {first_line}")


def named_shapes(space: ShapeSpace, extra: Mapping[str, Shape] | None = None) -> list[tuple[str, Shape]]:
    """(label, shape) for every shape a space names: each preset (`preset NAME (SOURCE)`), each
    boundary case (`boundary case N`), then each of `extra` by its own label."""
    out = [(f"preset {p.name!r} ({p.source})", dict(p.shape)) for p in space.presets]
    out += [(f"boundary case {i}", shape) for i, shape in enumerate(space.boundary_cases(), 1)]
    return out + [(label, dict(shape)) for label, shape in (extra or {}).items()]


def assert_named_shapes_accepted(space: ShapeSpace, check: Callable[[Shape], object], *,
                                 extra: Mapping[str, Shape] | None = None) -> int:
    """Run `check(shape)` (host work only: the launcher's argument checks over stand-in buffers)
    on every shape the space names (`named_shapes`); the first that raises fails by assertion
    (`ShapeRefused`), naming it, a preset with its model and source, and the check's own words.
    Returns how many shapes were checked. A structural gate: a space whose presets a launcher
    refuses promises shapes the kernel does not run."""
    shapes = named_shapes(space, extra)
    for label, shape in shapes:
        try:
            check(shape)
        except Exception as exc:  # noqa: BLE001 - a Refusal, a failed assert: the shape is named either way
            raise ShapeRefused(space.name, label, shape, _first_line(exc)) from exc
    return len(shapes)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]


def _faulted(exc: BaseException) -> bool:
    from harness.core.device import is_cuda_error, is_sticky_error

    return is_cuda_error(exc) and is_sticky_error(exc)


class _Run:
    """One sweep's bookkeeping: the cases tried, and the check as a yes/no for the shrinkers."""

    def __init__(self, space: ShapeSpace, check: Callable[[Shape], object]):
        self.space, self.check = space, check
        self.tried = 0
        self.failures: dict[tuple, BaseException] = {}
        self.passed: set[tuple] = set()  # a shape Hypothesis draws again is not checked again

    def fails(self, shape: Shape) -> bool:
        key = tuple(shape[n] for n in self.space.names)
        if key in self.failures:
            return True
        if key in self.passed:
            return False
        self.tried += 1
        try:
            self.check(dict(shape))
        except Exception as exc:  # noqa: BLE001 - any failure of the check is the shape's
            if _faulted(exc):
                raise _Fault(shape, exc) from exc
            self.failures[key] = exc
            return True
        self.passed.add(key)
        return False

    def error(self, shape: Shape) -> BaseException:
        return self.failures[tuple(shape[n] for n in self.space.names)]

    def shrink(self, shape: Shape) -> Shape:
        """The smallest failing shape found below `shape`: each dimension in turn lowered to the
        least value that still fails among its boundaries below, halfway to its least value
        (repeatedly), and its next `STEPS` values down, until nothing lowers. (A failure that
        comes and goes with a dimension's value has no smallest a search short of every value
        could promise; these are the values a kernel's defects gather at.)"""
        best = dict(shape)
        changed = True
        while changed:
            changed = False
            for d in self.space.dims:
                for v in _below(d, best[d.name]):
                    candidate = {**best, d.name: v}
                    if self.space.problem(candidate) is None and self.fails(candidate):
                        best, changed = candidate, True
                        break
        return best


STEPS = 16  # the values just below a failing one a shrink tries, one multiple apart


def _below(d: Dim, value: int) -> list[int]:
    """Smaller values of `d` to try for a failing `value`, least first: its boundaries below,
    the halfway points down to its least value, then the next STEPS values down."""
    out = [v for v in d.boundaries() if v < value]
    span = value - d.lo
    while span >= 2 * d.multiple_of:
        span //= 2
        out.append(value - span - (value - span) % d.multiple_of)
    out += [value - i * d.multiple_of for i in range(STEPS, 0, -1)]
    return sorted({v for v in out if d.lo <= v < value})


class _Fault(Exception):
    def __init__(self, shape: Shape, exc: BaseException):
        super().__init__(str(exc))
        self.shape, self.exc = shape, exc


def replay_command(nodeid: str | None, shape: Shape) -> str:
    target = f"'{nodeid}'" if nodeid else "THE_GATE"
    return f"python -m pytest {target} --sweep-replay '{written(shape)}'"


def sweep(space: ShapeSpace, check: Callable[[Shape], object], *, budget: int | None = None,
          replay: str | None = None, nodeid: str | None = None) -> int:
    """Check `space`'s presets, its boundaries, then `budget` drawn shapes (module docstring);
    the number of shapes checked. Raises ShapeFailed naming the smallest failing shape, or
    ShapeFaulted at a device fault. `budget` and `replay` default to the run's settings
    (--sweep-budget, --sweep-replay); `nodeid` (default: the running gate's) names the gate in
    the replay command."""
    from harness.core import settings as _settings

    run_settings = _settings.in_effect()
    budget = run_settings.sweep_budget if budget is None else budget
    budget = DEFAULT_BUDGET if budget is None else budget
    replay = run_settings.sweep_replay if replay is None else replay
    nodeid = nodeid or coverage.current().nodeid
    run = _Run(space, check)
    if replay:
        shape = space.parse(replay)
        try:
            if run.fails(shape):
                raise ShapeFailed(space.name, shape, shape, 1, _first_line(run.error(shape)),
                                  replay_command(nodeid, shape)) from run.error(shape)
        except _Fault as fault:
            raise ShapeFaulted(space.name, fault.shape, 1, _first_line(fault.exc),
                               replay_command(nodeid, fault.shape)) from fault.exc
        coverage.note_tried(f"sweep {space.name}: replayed {written(shape)}")
        return 1
    try:
        found = _search(space, run, budget)
    except _Fault as fault:
        raise ShapeFaulted(space.name, fault.shape, run.tried, _first_line(fault.exc),
                           replay_command(nodeid, fault.shape)) from fault.exc
    if found is not None:
        at, smallest = found
        raise ShapeFailed(space.name, smallest, at, run.tried, _first_line(run.error(smallest)),
                          replay_command(nodeid, smallest)) from run.error(smallest)
    coverage.note_tried(f"sweep {space.name}: {run.tried} shapes ({len(space.presets)} presets, the boundaries, "
                        f"{budget} drawn)")
    return run.tried


def _search(space: ShapeSpace, run: _Run, budget: int) -> tuple[Shape, Shape] | None:
    """(where a failure was found, the smallest failing shape), or None when every case holds."""
    for case in [dict(p.shape) for p in space.presets] + space.boundary_cases():
        if run.fails(case):
            return case, run.shrink(case)
    if budget <= 0:
        return None
    return _drawn(space, run, budget)


def _drawn(space: ShapeSpace, run: _Run, budget: int) -> tuple[Shape, Shape] | None:
    """Hypothesis's cases: from a fixed seed (the same cases every run), a case that failed
    before tried first (the example database, keyed by the space), shrunk by its own shrinker,
    then by the boundaries below."""
    import random

    from hypothesis import HealthCheck, Phase, find, settings
    from hypothesis.errors import NoSuchExample

    config = settings(max_examples=budget, database=_database(), deadline=None,
                      phases=(Phase.reuse, Phase.generate, Phase.shrink),
                      suppress_health_check=list(HealthCheck))
    try:
        found = find(space.strategy(), run.fails, settings=config, random=random.Random(SEED),
                     database_key=f"harness-sweep:{space.name}".encode())
    except NoSuchExample:
        return None
    return dict(found), run.shrink(dict(found))


def _database():
    """Hypothesis's example database under the cubin cache (a failing case tried first next
    time); None where the cache cannot be written."""
    from hypothesis.database import DirectoryBasedExampleDatabase

    from harness.core import settings as _settings

    folder = _settings.in_effect().cache_dir / "sweeps"
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    return DirectoryBasedExampleDatabase(str(folder))
