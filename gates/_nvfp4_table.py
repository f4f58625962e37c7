"""The staged e2m1 table of the NVFP4 partial dot, read from source: who stores it, which
barrier publishes it, who reads it. Shared by the structural gates of the NVFP4 GEMV and
MoE decode families (every kernel that calls `nvfp4_partial` stages its own table).

A kernel's source is read together with nvfp4_dot.cuh (header first, as the include puts it),
so helpers in either file are followed; lines are reported as the kernel file's own.

Two claims, each a list of problems (empty when it holds):

- `publish_problems`: every `nvfp4_partial` call reads a table the calling kernel staged
  before it (a store `table[i] = ...` in the kernel, or in a helper called with exactly that
  table), and a barrier stands between that store and the first read of the table: the
  threads that read are not the ones that wrote. A single-warp kernel's row is published by
  the warp's own `__syncwarp()`, so reading another warp's row (`s_lut[0]`) is a race even
  though every row holds the same values.
- `staging_problems`: the store is `if (i < 16u) table[i] = E2M1_LUT[i];`, entries 0..15,
  entry i by thread i, and nothing past them (a wider store reads past the __constant__ table
  and writes the next warp's row, or past the array).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

from harness.library.source import FunctionSource, SourceError, calls_in, strip_comments_and_literals
from harness.library.source import function as _function

PARTIAL = "nvfp4_partial"
TABLE_SOURCE = "E2M1_LUT"  # the __constant__ table (nvfp4_dot.cuh) every staged copy is made from
TABLE_ENTRIES = 16
ANY_BARRIER = re.compile(r"(?<!\w)(__syncthreads|__syncwarp|__barrier_sync)\s*\(")


@functools.lru_cache(maxsize=64)
def function(src: str, name: str) -> FunctionSource:
    """harness.library.source.function, once a (text, name): the claims look the same kernels up often."""
    return _function(src, name)


_CALL = re.compile(r"(?<![\w.])([A-Za-z_]\w*)\s*\(")
_NOT_CALLS = {"if", "for", "while", "switch", "return", "sizeof"}


def _helper(src: str, name: str) -> FunctionSource | None:
    """The definition of `name` in `src`, or None (an intrinsic, a keyword, defined elsewhere)."""
    try:
        return function(src, name)
    except SourceError:
        return None


@dataclass(frozen=True)
class Staged:
    owner: FunctionSource  # the kernel (a direct store) or the helper that stores
    store: re.Match  # the store `table[...] =` in owner.body
    published: bool  # a barrier stands between the store and the table's first read


def calls_at(body: str, callee: str) -> list:
    """(offset in body, Call) of every call of `callee` in `body`."""
    return [(m.start(), calls_in(body[m.start():], callee)[0])
            for m in re.finditer(rf"(?<![\w.]){re.escape(callee)}\s*\(", body)]


def _store(body: str, table: str) -> re.Match | None:
    """The first assignment `table[...] = ...` (not `==`) in `body`."""
    return re.search(rf"(?<![\w.]){re.escape(table)}\s*\[[^\]]*\]\s*=(?!=)", body)


def _param_names(params: str) -> list[str]:
    return [p.split()[-1].lstrip("*&") if p.split() else "" for p in params.split(",")]


def _published(body: str, store: re.Match, table: str, until: int) -> bool:
    """A barrier between the end of the store's statement and the first later mention of
    `table` (or `until`, the end of the text that matters, when none comes first)."""
    end = body.find(";", store.end()) + 1
    read = re.search(rf"(?<![\w.]){re.escape(table)}(?!\w)", body[end:until])
    first_read = end + read.start() if read else until
    return ANY_BARRIER.search(body, end, first_read) is not None


def staging(src: str, kernel: str, table: str, before: int) -> Staged | None:
    """Where `kernel` stages `table` (a partial's table argument, e.g. `s_lut` or
    `s_lut[warp]`) before body offset `before`, or None. A direct store `table[i] = ...`
    counts when the table is a whole array; otherwise a call of a helper defined in `src`
    that receives exactly `table` and stores into that parameter."""
    fn = function(src, kernel)
    if "[" not in table:
        store = _store(fn.body[:before], table)
        if store is not None:
            return Staged(fn, store, _published(fn.body, store, table, before))
    for m in _CALL.finditer(fn.body, 0, before):
        name = m.group(1)
        if name in _NOT_CALLS or name == kernel:
            continue
        call = calls_in(fn.body[m.start():], name)[0]
        helper = _helper(src, name) if table in call.args else None
        if helper is not None:
            param = _param_names(helper.params)[call.args.index(table)]
            store = _store(helper.body, param)
            if store is not None:
                return Staged(helper, store, _published(helper.body, store, param, len(helper.body)))
    return None


def _combined(header: str, source: str) -> tuple[str, int]:
    """The text the kernels are read from (header first) and the lines the header adds."""
    return strip_comments_and_literals(header + "\n" + source), header.count("\n") + 1


def publish_problems(header: str, source: str, source_name: str, kernels, single_warp=()) -> list[str]:
    src, skip = _combined(header, source)
    problems = []
    for kernel in kernels:
        fn = function(src, kernel)
        for at, call in calls_at(fn.body, PARTIAL):
            table = call.args[-1] if call.args else ""
            where = f"{kernel} ({source_name} line {fn.body_line + fn.body[:at].count(chr(10)) - skip})"
            staged = staging(src, kernel, table, at)
            if staged is None:
                problems.append(f"{where}: {PARTIAL}(..., {table}) reads a table this "
                                f"{'warp' if kernel in single_warp else 'block'} never staged before the call")
            elif not staged.published:
                problems.append(f"{where}: {PARTIAL}(..., {table}) reads the table {staged.owner.name} stores, "
                                f"without a barrier after the store (__syncthreads() a block, __syncwarp() a warp)")
    return problems


def staging_problems(header: str, source: str, kernels) -> list[str]:
    src, _ = _combined(header, source)
    problems = []
    for kernel in kernels:
        found = calls_at(function(src, kernel).body, PARTIAL)
        staged = staging(src, kernel, found[0][1].args[-1], found[0][0]) if found else None
        if staged is None:
            continue  # publish_problems names it
        body, store = staged.owner.body, staged.store
        target = re.match(r"\w+", store.group(0)).group(0)
        statement = re.split(r"[;{}]", body[:store.start()])[-1] + body[store.start():body.find(";", store.end())]
        wanted = re.compile(rf"^\s*if\s*\(\s*(\w+)\s*<\s*{TABLE_ENTRIES}u?\s*\)\s*{target}\s*\[\s*\1\s*\]\s*=\s*"
                            rf"{TABLE_SOURCE}\s*\[\s*\1\s*\]\s*$")
        if not wanted.match(statement):
            problems.append(f"{kernel}: the table is staged by `{' '.join(statement.split())};` in {staged.owner.name}; "
                            f"expected `if (i < {TABLE_ENTRIES}u) {target}[i] = {TABLE_SOURCE}[i];` (entries 0..15, one a thread)")
    return problems
