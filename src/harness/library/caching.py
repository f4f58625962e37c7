"""`host_cache`: a cache of pure host data, kept by a warm campaign worker and on disk.

A mutation campaign's warm worker serves one mutant after another. Between them it clears
every functools cache of the project's own modules (`harness.pool.worker.reset_for_next_mutant`),
because a cache may hold what a mutated kernel computed or a device buffer a stray store
hit. A cache whose values are computed on the host alone (random inputs, a float64
reference), never by a kernel and never on the device, is the same for every mutant:
mark it with `@host_cache` and it survives, so each mutant does not pay for it again.

With `@host_cache(disk=True)` the values are kept on disk between runs too, beside the
cubin cache (`<cache dir>/host`, or HARNESS_HOST_CACHE_DIR; `off` turns it off): a gate
run's float64 references cost seconds to compute and milliseconds to read, and every fresh
worker of a campaign (one after each trap gate) would otherwise compute them again. A value
is found again only under the same key: the function, its arguments (str, int, float, bool,
None, bytes and tuples of them; other arguments are not kept on disk), the text of every
`.py` file of the project (the pytest rootdir of the function's file) and of the harness,
and the versions of Python, numpy and ml_dtypes. So an edit to any gate, oracle or helper
is a miss, never a stale reference; the values of the last three source states are kept.
A host-cached function must be a pure function of its arguments and that source: no clock,
no unseeded randomness, no file outside the project. A module-level function passed as an
argument is keyed by its module and name (its text is in the project's, or the harness's).

`@host_cache(disk="source")` is for values keyed by a kernel source's text (a structural
gate's analysis of a file): kept on disk like `disk=True` in a plain gate run, where the
texts are the project's own and a warm run reads each analysis back, but only in memory
under settings that say the tree is generated (`Settings.generated_sources`: a campaign's
worker, whose every mutant is a new text: kept on disk, one entry a mutant and analysis
would fill it; what is on disk is still read there, the original's analyses among it).
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import os
import pickle
import sys
from pathlib import Path

HOST_CACHE_ENV = "HARNESS_HOST_CACHE_DIR"
_PLAIN = (str, int, float, bool, type(None), bytes)
_MAX_FILES = 5000  # a project larger than this is not fingerprinted: no disk cache


def host_cache(fn=None, *, disk: bool | str = False):
    """`functools.cache`, marked as holding host-only data (kept across mutants). With
    `disk=True` (`@host_cache(disk=True)`), over the disk cache above too: for values that
    take seconds to compute (a float64 reference), not for those that are cheap to make and
    large to store (random inputs). `disk="source"`: on disk unless this process serves
    generated sources (module docstring)."""
    if disk not in (True, False, "source"):
        raise ValueError(f"host_cache(disk={disk!r}): disk is True, False or \"source\"")

    def mark(f):
        cached = functools.cache(_on_disk(f, disk == "source") if disk else f)
        cached.harness_host_cache = True
        return cached

    return mark(fn) if fn is not None else mark


def _serving_generated_sources() -> bool:
    """The settings in effect are a campaign's mutant tree's (`Settings.generated_sources`):
    a `host_cache(disk="source")` value computed now stays in memory, not written to disk
    (what is on disk is still read)."""
    from harness.core import settings as _settings

    return _settings.in_effect().generated_sources


def _on_disk(fn, per_source: bool = False):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        path = _path(fn, args, kwargs)
        if path is not None:
            try:
                return pickle.loads(path.read_bytes())
            except Exception:  # noqa: BLE001 - absent, torn or from another numpy: compute it
                pass
        value = fn(*args, **kwargs)
        if path is not None and not (per_source and _serving_generated_sources()):  # read, never written, there
            _store(path, value)
        return value

    return wrapper


def folder() -> Path | None:
    """Where host-cached values go, or None when the disk cache is off."""
    env = os.environ.get(HOST_CACHE_ENV)
    if env is not None:
        return None if env.strip().lower() in ("", "0", "off", "no") else Path(env)
    from harness.core import settings as _settings

    return Path(_settings.in_effect().cache_dir) / "host"


class _NotKept(Exception):
    """An argument the disk key cannot name."""


def _key(value):
    """What names `value` in a disk key: plain values as they are, tuples element by element,
    a module-level function by its module and name; anything else is not kept on disk."""
    if isinstance(value, tuple):
        return tuple(_key(v) for v in value)
    if isinstance(value, _PLAIN):
        return value
    if inspect.isfunction(value) and "<" not in value.__qualname__:  # not a lambda or a local function
        return ("function", value.__module__, value.__qualname__)
    raise _NotKept


def _path(fn, args, kwargs) -> Path | None:
    base = folder()
    if base is None:
        return None
    try:
        named = (_key(tuple(args)), sorted((k, _key(v)) for k, v in kwargs.items()))
    except _NotKept:
        return None
    project = _project_fingerprint(_project_of(fn))
    if project is None:
        return None
    key = hashlib.sha256(repr((fn.__module__, fn.__qualname__, *named, _versions())).encode()).hexdigest()
    return _generation(base, project) / f"{key}.pkl"


KEEP_GENERATIONS = 3  # source states kept on disk: the current one and the two before it


def _generation(base: Path, project: str) -> Path:
    """The folder of this source state (`base/<fingerprint>`); making a new one removes all
    but the KEEP_GENERATIONS most recently made, so editing gates does not fill the disk."""
    here = base / project[:24]
    if here.is_dir():
        return here
    try:
        here.mkdir(parents=True, exist_ok=True)
        others = sorted((d for d in base.iterdir() if d.is_dir() and d != here), key=lambda d: d.stat().st_mtime)
        import shutil

        for old in others[:max(0, len(others) - (KEEP_GENERATIONS - 1))]:
            shutil.rmtree(old, ignore_errors=True)
    except OSError:
        pass
    return here


def _store(path: Path, value) -> None:
    try:
        data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)  # readers see the whole file or none
    except Exception:  # noqa: BLE001 - a read-only or full disk costs the next run the compute, nothing else
        pass


def _project_of(fn) -> Path | None:
    from harness.core.settings import find_rootdir

    try:
        return find_rootdir(Path(inspect.getfile(fn)).parent)
    except (TypeError, OSError):
        return None


@functools.cache
def _versions() -> tuple:
    import numpy

    try:
        import ml_dtypes

        ml = ml_dtypes.__version__
    except Exception:  # noqa: BLE001
        ml = None
    return sys.version_info[:2], numpy.__version__, ml


def _skipped(folder: Path) -> bool:
    return (folder.name.startswith(".") or folder.name in ("__pycache__", "site-packages", "node_modules")
            or (folder / "pyvenv.cfg").exists())


@functools.cache
def _project_fingerprint(root: Path | None) -> str | None:
    """sha256 over every `.py` file under `root` (hidden folders, virtualenvs and caches
    skipped) and the harness's own; None when `root` is unknown or too large."""
    if root is None:
        return None
    root = Path(root).resolve()
    import harness

    harness_dir = Path(harness.__file__).resolve().parent
    bases = [root] + ([] if harness_dir.is_relative_to(root) else [harness_dir])
    h = hashlib.sha256()
    count = 0
    for base in bases:
        for folder, dirs, names in os.walk(base):
            dirs[:] = sorted(d for d in dirs if not _skipped(Path(folder) / d))
            for name in sorted(n for n in names if n.endswith(".py")):
                count += 1
                if count > _MAX_FILES:
                    return None
                f = Path(folder) / name
                try:  # the path as the project sees it: the same key on another machine's checkout
                    h.update(f.relative_to(base).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
                except OSError:
                    return None
    return h.hexdigest()
