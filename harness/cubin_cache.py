"""The content-addressed cubin cache on disk: the key (the source closure, the recorded options,
the name expressions, the arch and the compiler and header versions, so a changed header never
hits a stale cubin), and its entries, read back only when sound and written atomically."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import warnings
from pathlib import Path

from harness.toolchain import cuda_headers_version, nvrtc_version

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


def entry_paths(cache_dir: Path, key: str) -> tuple[Path, Path]:
    """(cubin, metadata) files of the entry for `key`."""
    folder = cache_dir / key[:2]
    return folder / f"{key}.cubin", folder / f"{key}.json"


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
    return cubin, mapping, log


def write_entry(cache: Path, cubin_path: Path, meta_path: Path, cubin: bytes, about: dict, mapping: dict,
                log: str) -> None:
    """Write one entry: the cubin, and beside it `about` (what was compiled, how), the symbol
    mapping, the log and the cubin's hash. A folder that cannot be written is warned about."""
    meta = {**about, "symbol_mapping": mapping, "log": log, "cubin_sha256": hashlib.sha256(cubin).hexdigest()}
    try:
        _atomic_write(cubin_path, cubin)
        _atomic_write(meta_path, json.dumps(meta, indent=1).encode())
    except OSError as exc:
        _cache_not_writable(cache, exc)


def _atomic_write(path: Path, data: bytes) -> None:
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


class CacheNotWritable(UserWarning):
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
