"""Which kernel modules, kernels and source files each gate touches: a per-process registry.

The gate-running plugin calls `begin(nodeid)` before a gate; `harness.library.kernels.module()`
calls `note_module(relpath)`, each launch through `harness.library.kernels` calls
`note_kernel("file.cu:name")`, and the file reads of `harness.library.source` call
`note_source(path)`. A mutation campaign reads the result (per gate, as
`modules_loaded` and `sources_read`, kernel-root-relative) to run only the gates that
load a mutated module or read its source. Recording is a set insert: it costs nothing
when nobody reads it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class GateCoverage:
    nodeid: str | None
    modules: set[str] = field(default_factory=set)
    sources: set[str] = field(default_factory=set)
    kernels: set[str] = field(default_factory=set)  # "file.cu:name" of every kernel it launched
    tried: list[str] = field(default_factory=list)  # what its invariance and determinism checks tried
    oracles: list[str] = field(default_factory=list)  # the reference functions it called (harness.library.reference)
    compared: list[str] = field(default_factory=list)  # each comparison: "label: bitwise" or its tolerance


_current = GateCoverage(None)
_all: dict[str | None, GateCoverage] = {None: _current}


def begin(nodeid: str | None) -> GateCoverage:
    """Start recording for gate `nodeid` (notes before the first `begin` go to `None`)."""
    global _current
    _current = _all.setdefault(nodeid, GateCoverage(nodeid))
    _current.tried.clear()  # what this run of the gate tried (the sets above are unions over runs)
    _current.oracles.clear()
    _current.compared.clear()
    return _current


def _relative(path: str | os.PathLike) -> str:
    """`path` relative to the active kernel root when it lies inside it, else as given."""
    from harness.core import settings as _settings

    p = Path(path)
    if not p.is_absolute():
        return p.as_posix()
    root = _settings.in_effect().kernel_root
    try:
        return p.resolve().relative_to(root).as_posix()
    except ValueError:
        return p.as_posix()


def note_module(relpath: str | os.PathLike) -> None:
    """The current gate loaded the module compiled from `relpath`."""
    _current.modules.add(_relative(relpath))


def note_kernel(name: str) -> None:
    """The current gate launched kernel `name` ("file.cu:name", as harness.library.kernels names it)."""
    _current.kernels.add(name)


def note_tried(line: str) -> None:
    """What an invariance or determinism check of the current gate tried (`harness.library.invariance`)."""
    _current.tried.append(line)


def note_oracle(name: str) -> None:
    """The current gate called reference function `name` as its oracle (`harness.library.reference`)."""
    if name not in _current.oracles:
        _current.oracles.append(name)


def note_compared(line: str) -> None:
    """One comparison of the current gate: `label: bitwise`, or `label: atol=..., rtol=...`."""
    _current.compared.append(line)


def note_source(path: str | os.PathLike) -> None:
    """The current gate read the source file `path` (absolute or kernel-root-relative)."""
    _current.sources.add(_relative(path))


def current() -> GateCoverage:
    """The record being filled now."""
    return _current


def properties(nodeid: str) -> list[tuple[str, str]]:
    """The report properties of gate `nodeid` when it is the one being recorded (none else):
    what it loaded, read and launched, what its invariance checks tried, and the reference
    functions it used as oracles with how it compared (only for a gate that used one)."""
    cov = _current
    if cov.nodeid != nodeid or not (cov.modules or cov.sources or cov.kernels or cov.tried or cov.oracles):
        return []
    props = [("modules_loaded", " ".join(sorted(cov.modules))), ("sources_read", " ".join(sorted(cov.sources))),
             ("kernels_launched", " ".join(sorted(cov.kernels)))]
    if cov.oracles:
        props += [("oracle", " | ".join(cov.oracles)), ("compared", " | ".join(cov.compared))]
    return props + ([("tried", " | ".join(cov.tried))] if cov.tried else [])


def recorded() -> dict[str | None, GateCoverage]:
    """Every record of this process, keyed by node id."""
    return dict(_all)


def reset() -> None:
    global _current
    _all.clear()
    _current = _all[None] = GateCoverage(None)
