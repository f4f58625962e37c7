"""The content-addressed cubin cache on disk: the key (the source closure, the recorded options,
the name expressions, the arch and the compiler and header versions, so a changed header never
hits a stale cubin), and its entries, read back only when sound and written atomically.

The cache is bounded (`limit_bytes`: HARNESS_CACHE_MAX, default 256 MiB). A process that has
written an eighth of the bound since it last looked prunes the cache (`prune`): the least
recently used entries go first (a hit touches its entry), and those compiled in a sandbox (a
mutant's or a control's tree: `<cache>/sandbox/`) go before any of the real tree's. The
verdict store (`verdicts/`) is pruned with them; the host cache (`host/`, `harness.library.caching`)
keeps its own bound. `python -m harness cache` says what the cache holds and clears it.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

from harness.compiling.toolchain import cuda_headers_version, nvrtc_version
from harness.core.errors import HarnessWarning, UsageError

CACHE_FORMAT = 1


def cache_key(closure, options, name_expressions, arch, extra: dict | None = None) -> str:
    material = {
        "format": CACHE_FORMAT,
        "closure": closure,
        "options": list(options),
        "name_expressions": list(name_expressions),
        "arch": arch,
        "nvrtc": nvrtc_version(),
        "cuda_headers": cuda_headers_version(),
        **(extra or {}),
    }
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()


def include_hashes(closure, user_dirs) -> dict[str, str]:
    """{`@include<N>`: a hash of the closure's headers from that user include directory}."""
    out = {}
    for i, _ in enumerate(user_dirs):
        h = hashlib.sha256(json.dumps([c for c in closure if c[0].startswith(f"@include{i}/")]).encode())
        out[f"@include{i}"] = h.hexdigest()[:16]
    return out


SANDBOX_MARK = ".harness-sandbox"  # a file beside a sandbox copy of a kernel root (harness.runs.sandbox)
SANDBOX_FOLDER = "sandbox"  # where the entries compiled in a sandbox go, evicted first
PRUNED_FOLDERS = ("verdicts",)  # other folders of small JSON entries pruned with the cubins (harness.campaigns.mutate.store)


def is_sandbox(kernel_root: Path) -> bool:
    """True for a sandbox copy of a kernel root (a mutant's or a control's)."""
    return (Path(kernel_root).parent / SANDBOX_MARK).is_file()


def entry_paths(cache_dir: Path, key: str, sandbox: bool = False) -> tuple[Path, Path]:
    """(cubin, metadata) files of the entry for `key` (compiled in a sandbox: `sandbox`)."""
    folder = (Path(cache_dir) / SANDBOX_FOLDER if sandbox else Path(cache_dir)) / key[:2]
    return folder / f"{key}.cubin", folder / f"{key}.json"


def lookup(cache_dir: Path, key: str, sandbox: bool):
    """(the entry's (cubin, mapping, log) or None, its cubin path, its metadata path): where a
    compile in a sandbox (`sandbox`) or not writes it, else the other place when it is there
    (a mutant's tree compiles the real tree's unmutated modules too)."""
    mine = entry_paths(cache_dir, key, sandbox)
    hit = read_entry(*mine)
    if hit is None:
        other = entry_paths(cache_dir, key, not sandbox)
        found = read_entry(*other)
        if found is not None:
            return found, *other
    return hit, *mine


def read_entry(cubin_path: Path, meta_path: Path):
    """(cubin, symbol mapping, log) of a sound cache entry, else None: a missing, unreadable
    or wrongly shaped entry is a miss, compiled again and overwritten."""
    try:
        if not (cubin_path.is_file() and meta_path.is_file()):
            return None
        meta = json.loads(meta_path.read_text())
        cubin = cubin_path.read_bytes()
    except (OSError, ValueError):
        return None
    if not isinstance(meta, dict):
        return None
    mapping, log = meta.get("symbol_mapping"), meta.get("log")
    if not (isinstance(mapping, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in mapping.items())
            and isinstance(log, str) and meta.get("cubin_sha256") == hashlib.sha256(cubin).hexdigest()):
        return None
    try:
        os.utime(cubin_path)  # recently used: the last to be pruned
    except OSError:
        pass
    return cubin, mapping, log


def write_entry(cache: Path, cubin_path: Path, meta_path: Path, cubin: bytes, about: dict, mapping: dict,
                log: str) -> None:
    """Write one entry: the cubin, and beside it `about` (what was compiled, how), the symbol
    mapping, the log and the cubin's hash. A folder that cannot be written is warned about."""
    meta = {**about, "symbol_mapping": mapping, "log": log, "cubin_sha256": hashlib.sha256(cubin).hexdigest()}
    data = json.dumps(meta, indent=1).encode()
    try:
        atomic_write(cubin_path, cubin)
        atomic_write(meta_path, data)
    except OSError as exc:
        _cache_not_writable(cache, exc)
        return
    wrote(cache, len(cubin) + len(data))


def atomic_write(path: Path, data: bytes) -> None:
    """Write `data` to `path` so that a reader sees the whole file or none."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


class CacheNotWritable(HarnessWarning, UserWarning):
    """The cubin cache folder cannot be written: modules compile without caching."""


_warned_caches: set[str] = set()


def _cache_not_writable(cache: Path, exc: OSError) -> None:
    """Say once per process and folder that the cache cannot be written; compiling goes on.
    The warning points at the caller of `compile_file` (through `write_entry`)."""
    if str(cache) in _warned_caches:
        return
    _warned_caches.add(str(cache))
    reason = exc.strerror or type(exc).__name__
    warnings.warn(CacheNotWritable(
        f"the cubin cache {cache} cannot be written ({reason}): compiling without caching, every run "
        "compiles again. Point HARNESS_CACHE_DIR (or --harness-cache-dir, --cache-dir) at a writable folder"),
        stacklevel=4)


# ---------------------------------------------------------------- the bound


CACHE_MAX_ENV = "HARNESS_CACHE_MAX"
DEFAULT_MAX = 256 << 20
LOW_WATER = 0.9  # a prune leaves the cache at this fraction of the bound, so the next is not at once
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


class CacheLimitError(UsageError):
    """HARNESS_CACHE_MAX is not a size."""


def parse_size(text: str) -> int:
    """Bytes from `256M`, `2G`, `500k`, `1048576`, or 0 from `0` / `off` / `none` (no bound)."""
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    if t in ("0", "off", "none", "unbounded"):
        return 0
    import re

    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kmgt]?)", t)
    if m is None:
        raise CacheLimitError(f"{CACHE_MAX_ENV}={text!r} is not a size: write e.g. {CACHE_MAX_ENV}=256M, 2G, "
                              "or 0 for no bound")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def limit_bytes() -> int:
    """The cache's bound in bytes (0: none): HARNESS_CACHE_MAX, else 256 MiB."""
    env = os.environ.get(CACHE_MAX_ENV)
    return DEFAULT_MAX if env is None or not env.strip() else parse_size(env)


_written: dict[str, int] = {}  # bytes this process wrote into each cache since it last pruned it


def wrote(cache: Path, n: int) -> None:
    """Count `n` bytes written into `cache`; past an eighth of the bound (at least 4 MiB),
    prune it. A bad HARNESS_CACHE_MAX is said by the commands that read it first; here it
    leaves the cache unbounded rather than fail a compile."""
    try:
        limit = limit_bytes()
    except CacheLimitError:
        return
    if not limit:
        return
    key = str(cache)
    _written[key] = _written.get(key, 0) + n
    if _written[key] >= max(limit // 8, 4 << 20):
        _written[key] = 0
        prune(cache, limit)


@dataclass(frozen=True)
class Entry:
    files: tuple[Path, ...]
    size: int
    used: float  # the newest mtime of its files: a hit touches the cubin
    sandbox: bool


@dataclass(frozen=True)
class Usage:
    """What the cache holds, by part, in bytes and entries."""

    cubins: tuple[int, int]  # the real trees' (bytes, entries)
    sandbox: tuple[int, int]  # mutants' and controls'
    verdicts: tuple[int, int]
    host: int  # bytes of the host cache (harness.library.caching), outside the bound

    @property
    def bounded(self) -> int:
        return self.cubins[0] + self.sandbox[0] + self.verdicts[0]


def entries(cache: Path) -> list[Entry]:
    """Every entry of the bounded parts of the cache: cubins (each with its metadata), the
    sandbox's, the verdict store's; half-written temporary files count too."""
    cache = Path(cache)
    out = []
    parts = [(cache, False), (cache / SANDBOX_FOLDER, True), *((cache / f, False) for f in PRUNED_FOLDERS)]
    for base, sandbox in parts:
        try:
            folders = [d for d in os.scandir(base) if d.is_dir() and len(d.name) == 2]
        except OSError:
            continue
        for folder in folders:
            by_stem: dict[str, list] = {}
            try:
                files = list(os.scandir(folder.path))
            except OSError:
                continue
            for f in files:
                try:
                    st = f.stat()
                except OSError:
                    continue
                by_stem.setdefault(f.name.split(".", 1)[0], []).append((Path(f.path), st.st_size, st.st_mtime))
            for group in by_stem.values():
                out.append(Entry(tuple(p for p, _, _ in group), sum(s for _, s, _ in group),
                                 max(t for _, _, t in group), sandbox))
    return out


def usage(cache: Path) -> Usage:
    cache = Path(cache)
    found = entries(cache)

    def part(pred) -> tuple[int, int]:
        picked = [e for e in found if pred(e)]
        return sum(e.size for e in picked), len(picked)

    verdict_dirs = tuple(str(cache / f) for f in PRUNED_FOLDERS)
    in_verdicts = lambda e: str(e.files[0]).startswith(verdict_dirs)  # noqa: E731
    host = 0
    for folder, _, names in os.walk(cache / "host"):
        for name in names:
            try:
                host += (Path(folder) / name).stat().st_size
            except OSError:
                pass
    return Usage(part(lambda e: not e.sandbox and not in_verdicts(e)), part(lambda e: e.sandbox),
                 part(in_verdicts), host)


@dataclass(frozen=True)
class Pruned:
    removed: int  # entries
    freed: int  # bytes
    kept: int  # bytes left in the bounded parts


def prune(cache: Path, limit: int, low_water: float = LOW_WATER) -> Pruned:
    """Remove entries until the bounded parts of `cache` hold at most `limit * low_water`
    bytes, when they hold more than `limit`: the sandbox's least recently used first, then
    the rest by least recent use. Safe beside other processes: an entry removed under a
    reader is a miss, compiled again."""
    found = entries(cache)
    total = sum(e.size for e in found)
    if not limit or total <= limit:
        return Pruned(0, 0, total)
    target = int(limit * low_water)
    removed = freed = 0
    for e in sorted(found, key=lambda e: (not e.sandbox, e.used)):
        if total - freed <= target:
            break
        for f in e.files:
            try:
                f.unlink()
            except OSError:
                pass
        removed += 1
        freed += e.size
    return Pruned(removed, freed, total - freed)


def cache_max_problem(value: str | None) -> str | None:
    """HARNESS_CACHE_MAX (`harness.compiling.cubin_cache.CACHE_MAX_ENV`): unset, empty, or a size. Every
    command that keeps a cache and the pytest plugin check it here, before any work."""
    if value is None or not value.strip():
        return None
    try:
        parse_size(value)
    except CacheLimitError as exc:
        return f"{exc} (unset it for the default, 256M)"
    return None
