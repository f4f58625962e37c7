"""CPU screening, no GPU: compile every mutant, compare its cubins with the original's.

Each mutant is written into its own sandbox copy of the kernel root (the real root is only
read) and every `.cu` whose source closure holds the mutated file is compiled through
`harness.compiling.compile.compile_file`, with the launcher's name expressions, into the shared
cubin cache, so a later gate run over the same sandbox text hits that cubin. Work is spread
over a process pool (`spawn`: no worker inherits a parent that may have touched CUDA).

- `compile-error`: NVRTC refused the mutant.
- `equivalent`: every affected module's fingerprint (harness.campaigns.mutate.elf) equals the
  original's.
- `duplicate`: the fingerprints equal an earlier mutant's (by file order); it takes that
  mutant's verdict.
A mutant of a file some gate reads as source (a structural gate) is never screened out by
its cubin: it stays `pending` for the gate stage, marked `cubin_identical` when the cubin
is the original's (then only the gates that read the source can tell it apart, and when
they all pass it is `equivalent` after all: `campaign.gate_stage`).
"""

from __future__ import annotations

import dataclasses
import functools
import multiprocessing
import os
import re
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path

from harness.campaigns.mutate.generate import Mutant
from harness.campaigns.mutate.verdicts import MutantResult, Verdict


@dataclass(frozen=True)
class Compiled:
    """One mutant through the compiler."""

    mutant_id: str
    ok: bool
    fingerprints: tuple[tuple[str, str], ...]  # (module relpath, fingerprint), sorted
    error: str | None
    seconds: float
    keys: tuple[str, ...] = ()  # the cubin cache keys of its modules (shipped with it on a cluster)


@dataclass(frozen=True)
class ScreenContext:
    kernel_root: Path
    arch: str
    cache_dir: Path
    names: dict  # {module relpath: ModuleSettings}: the compile settings its launcher declares
    dependents: dict  # {source relpath: (module relpaths,)}
    # the campaign's process: in the name of its screen's home and of every sandbox
    owner: str = field(default_factory=lambda: str(os.getpid()))
    home: Path | None = None  # where the sandboxes are made (`compile_all` makes it; None: the temp folder)


def compile_mutant(mutant: Mutant, ctx: ScreenContext) -> Compiled:
    """Write `mutant` into a fresh sandbox, compile its modules, fingerprint the cubins."""
    from harness.campaigns.mutate.elf import fingerprint
    from harness.compiling.compile import CompileError, compile_file
    from harness.runs.compilecheck import run_dirs
    from harness.runs.sandbox import sandbox, write

    start = time.perf_counter()
    modules = ctx.dependents.get(mutant.file, ())
    with sandbox(ctx.kernel_root, f"mutant-{mutant.id}-{ctx.owner}", parent=ctx.home) as copy:
        original = (copy / mutant.file).read_bytes()
        write(copy, mutant.file, mutant.apply(original).decode("utf-8"))
        prints, keys = [], []
        for rel in modules:
            try:
                compiled = compile_file(rel, kernel_root=copy, arch=ctx.arch, cache_dir=ctx.cache_dir,
                                        settings=ctx.names.get(rel), include_dirs=run_dirs(ctx.names))
            except CompileError as exc:
                return Compiled(mutant.id, False, (), _first_error(exc, copy), time.perf_counter() - start)
            prints.append((rel, fingerprint(compiled.cubin)))
            keys.append(compiled.key)
    return Compiled(mutant.id, True, tuple(sorted(prints)), None, time.perf_counter() - start, tuple(keys))


def compile_shipped(mutant: Mutant, shipped, ctx: ScreenContext) -> tuple[Compiled, dict]:
    """`compile_mutant` on a cluster node (a Ray task, `harness.runs.cluster`): over the
    node's copy of the kernel root into its own cache; returns the result and the cache
    entries it made, for the head's cache (and from there the GPU that runs the mutant)."""
    from harness.runs.cluster import read_entries

    root = shipped.kernel()
    here = dataclasses.replace(ctx, kernel_root=root, cache_dir=shipped.cache(), names=_names_here(root), home=None)
    compiled = compile_mutant(mutant, here)
    return compiled, read_entries(here.cache_dir, compiled.keys)


@functools.lru_cache(maxsize=2)
def _names_here(root: Path) -> dict:
    from harness.runs.compilecheck import declared_names

    return declared_names(root)


def _first_error(exc, copy: Path) -> str:
    log = str(exc).replace(f"{copy}/", "").replace("\x00", "")
    errors = [line.strip() for line in log.splitlines() if "error" in line and "(" in line]
    if not errors:  # the device view's own message: "file:line: what it cannot separate"
        errors = [line.strip() for line in log.splitlines() if re.match(r"\S+:\d+: ", line.strip())]
    return errors[0] if errors else (log.splitlines()[0] if log else "does not compile")


def original_fingerprints(ctx: ScreenContext) -> dict[str, str]:
    from harness.campaigns.mutate.elf import fingerprint
    from harness.compiling.compile import compile_file
    from harness.runs.compilecheck import run_dirs

    modules = sorted({m for ms in ctx.dependents.values() for m in ms})
    return {rel: fingerprint(compile_file(rel, kernel_root=ctx.kernel_root, arch=ctx.arch, cache_dir=ctx.cache_dir,
                                          settings=ctx.names.get(rel), include_dirs=run_dirs(ctx.names)).cubin)
            for rel in modules}


def _worker_init() -> None:
    os.environ["PYTHONDONTWRITEBYTECODE"] = "1"


POOL_RESTARTS = 3


def compile_all(mutants: list[Mutant], ctx: ScreenContext, jobs: int, on_done=None,
                cpu_map=None) -> dict[str, Compiled]:
    """Every mutant compiled, `jobs` at once; `on_done(Compiled)` after each. Every sandbox is
    made in one home folder of this screen (`harness.runs.sandbox.sandbox_home`), removed once
    its workers are gone, however the screen ends. A worker that dies (killed, out of memory)
    breaks the pool: the home is emptied of what it left and a fresh pool takes the mutants
    not done yet. `cpu_map` (an executor factory's, on a cluster): each compile a task there
    instead, its cache entries written into this host's cache."""
    from concurrent.futures.process import BrokenProcessPool

    from harness.runs.sandbox import sandbox_home

    out: dict[str, Compiled] = {}

    def done(c: Compiled) -> None:
        out[c.mutant_id] = c
        if on_done:
            on_done(c)

    if cpu_map is not None:
        from harness.runs.cluster import write_entries

        def shipped_back(got) -> None:
            compiled, entries = got
            write_entries(ctx.cache_dir, entries)
            done(compiled)

        cpu_map(functools.partial(compile_shipped, ctx=ctx), mutants, shipped_back)
        return out

    with sandbox_home(f"screen-{ctx.owner}") as home:
        ctx = dataclasses.replace(ctx, home=home)
        if jobs <= 1:
            for m in mutants:
                done(compile_mutant(m, ctx))
            return out
        for attempt in range(POOL_RESTARTS + 1):
            todo = [m for m in mutants if m.id not in out]
            if not todo:
                break
            try:
                _pool_round(todo, ctx, jobs, done)
            except BrokenProcessPool:
                _empty(home)  # the dead worker's sandbox
                if attempt == POOL_RESTARTS:
                    raise
    return out


def _pool_round(todo: list[Mutant], ctx: ScreenContext, jobs: int, done) -> None:
    pool = ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn"),
                               initializer=_worker_init)
    try:
        futures = [pool.submit(compile_mutant, m, ctx) for m in todo]
        for future in as_completed(futures):
            done(future.result())
    except BaseException:
        processes = _workers(pool)
        pool.shutdown(wait=False, cancel_futures=True)
        for proc in processes:
            proc.kill()  # no worker may make, or leave half-removed, a sandbox after the home goes
        for proc in processes:
            proc.join(timeout=10)
        raise
    finally:
        pool.shutdown(wait=True)


def _workers(pool: ProcessPoolExecutor) -> list:
    """The pool's worker processes: those it registered, and any it started but had not yet
    registered when an interrupt cut its start short."""
    from concurrent.futures.process import _process_worker

    found = {p.pid: p for p in (getattr(pool, "_processes", None) or {}).values()}
    found.update({p.pid: p for p in multiprocessing.active_children()
                  if getattr(p, "_target", None) is _process_worker})
    return list(found.values())


def _empty(home: Path) -> None:
    import shutil

    for entry in home.iterdir():
        shutil.rmtree(entry, ignore_errors=True)


class Classifier:
    """Screening verdicts, one compiled mutant at a time (in the order they are added: the
    first of identical mutants is the twin). `source_read`: files some gate reads (None:
    unknown, so every file is treated as read and nothing is screened out by its cubin)."""

    def __init__(self, originals: dict[str, str], source_read: set[str] | None):
        self.originals = originals
        self.source_read = source_read
        self.first_by_print: dict[tuple, str] = {}

    def add(self, m: Mutant, c: Compiled) -> MutantResult:
        if not c.ok:
            return MutantResult(m, Verdict.COMPILE_ERROR, c.error or "does not compile", seconds=c.seconds)
        if not c.fingerprints:
            return MutantResult(m, Verdict.PENDING, "no .cu includes this file: no module to compile",
                                seconds=c.seconds)
        read = self.source_read is None or m.file in self.source_read
        if all(self.originals.get(rel) == fp for rel, fp in c.fingerprints):
            if read:
                return MutantResult(m, Verdict.PENDING, "cubin identical to the original's, but a gate reads "
                                    "this source: only source-reading gates are run", seconds=c.seconds,
                                    cubin_identical=True)
            return MutantResult(m, Verdict.EQUIVALENT, "equivalent: identical cubin", seconds=c.seconds)
        twin = self.first_by_print.setdefault(c.fingerprints, m.id)
        if twin != m.id and not read:
            return MutantResult(m, Verdict.DUPLICATE, f"duplicate of {twin}", duplicate_of=twin, seconds=c.seconds)
        if twin != m.id:
            # the same cubin as its twin: only the gates that read the source can tell them apart
            return MutantResult(m, Verdict.PENDING, f"cubin identical to {twin}'s, but a gate reads this "
                                "source: only source-reading gates are run", duplicate_of=twin, seconds=c.seconds)
        return MutantResult(m, Verdict.PENDING, "", seconds=c.seconds)


def classify(mutants: list[Mutant], compiled: dict[str, Compiled], originals: dict[str, str],
             source_read: set[str] | None) -> dict[str, MutantResult]:
    """Screening verdicts of every mutant, in file order (the first of identical mutants is
    the twin)."""
    classifier = Classifier(originals, source_read)
    return {m.id: classifier.add(m, compiled[m.id]) for m in mutants}


class _Stop(Exception):
    """Raised in the screen's callback to end it early (the gate stage was interrupted)."""


class ScreenFeed:
    """The CPU screen in a background thread, yielding each mutant's screening result as
    its compile finishes (pending ones go to the GPU, the others are final). The twin of
    identical mutants is the first whose compile finished."""

    def __init__(self, ctx, mutants: list, jobs: int, source_read, cpu_map=None):
        import queue
        import threading

        self.ctx, self.mutants, self.jobs, self.source_read = ctx, mutants, jobs, source_read
        self.cpu_map = cpu_map  # where the compiles run: None, a local process pool
        self.inbox: queue.Queue = queue.Queue()
        self.error: BaseException | None = None
        self.seconds = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="screen", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        start = time.perf_counter()
        by_id = {m.id: m for m in self.mutants}
        try:
            classifier = Classifier(original_fingerprints(self.ctx), self.source_read)

            def done(c):
                if self._stop.is_set():
                    raise _Stop()
                self.inbox.put(classifier.add(by_id[c.mutant_id], c))

            compile_all(self.mutants, self.ctx, self.jobs, on_done=done, cpu_map=self.cpu_map)
        except _Stop:
            pass
        except BaseException as exc:  # noqa: BLE001 - handed to the consuming thread
            self.error = exc
        finally:
            self.seconds = time.perf_counter() - start
            self.inbox.put(None)

    def get(self, block: bool):
        """The next result, None at the end; raises queue.Empty when not blocking and none is ready."""
        item = self.inbox.get(block=block)
        if item is None and self.error is not None:
            raise self.error
        return item

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
