"""The verdict store: a mutant's final verdict kept under a digest of everything it rests on,
so a later campaign (`--since REF`, a pull request's pushes in CI) reuses it instead of
compiling and running the mutant again.

The digest (`VerdictKeys.key`) covers:

- the mutant: its id (file, place, original and replacement text, operator);
- its source closure: the text of every file each `.cu` that includes the mutated file
  compiles from (kernel root and user include directories; CUDA's and CCCL's by version);
- its selected gates: their node ids as the baseline selects them, the text of their test
  files, and the text of every other `.py` of the project (conftests, helpers, oracles,
  launchers) and of the harness;
- the toolchain: NVRTC, the CUDA headers, CCCL, the shims, the arch, Python;
- what changes a verdict's meaning: `--static`, `--all-gates`, `--trap-gates`, the trap
  shadow, a fixed `--deadline`.

Any of them changed is another digest, so a stale verdict is never found. A `timeout` is
never stored (a loaded machine may make one: it runs again), and `pending` only by a
`--static` run, for another (`--static` is in the digest: it is what such a run concludes,
its structural gates passed, and never a verdict a GPU campaign takes). Entries live in `<cache dir>/verdicts/`, one small JSON file each, and are
pruned with the cubins (`harness.compiling.cubin_cache.prune`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import sys
from pathlib import Path

from harness.campaigns.mutate.verdicts import MutantResult, Verdict

FOLDER = "verdicts"
FORMAT = 1


class VerdictStore:
    def __init__(self, cache_dir: Path):
        self.folder = Path(cache_dir) / FOLDER

    def _path(self, key: str) -> Path:
        return self.folder / key[:2] / f"{key}.json"

    def get(self, key: str) -> MutantResult | None:
        """The stored verdict for `key` (touched: recently used), or None."""
        path = self._path(key)
        try:
            data = json.loads(path.read_text())
            result = MutantResult.from_json(data["result"])
        except (OSError, ValueError, KeyError, TypeError):
            return None
        try:
            os.utime(path)
        except OSError:
            pass
        return result

    def put(self, key: str, result: MutantResult, static: bool = False) -> bool:
        """Keep `result` under `key`; False when it is no verdict to keep (a timeout; pending,
        unless a `--static` run made it), or cannot be written."""
        if result.verdict is Verdict.TIMEOUT or (result.verdict is Verdict.PENDING and not static):
            return False
        from harness.compiling.cubin_cache import atomic_write

        data = result.to_json() | {"reused": False, "effective": None}
        try:
            atomic_write(self._path(key), json.dumps({"format": FORMAT, "result": data}).encode())
        except OSError:
            return False
        return True


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class VerdictKeys:
    """The digest of each mutant's verdict (module docstring); computed pieces are kept, so a
    campaign reads each file once."""

    def __init__(self, kernel_root: Path, rootdir: Path, coverage, deps: dict, config, arch: str,
                 include_dirs: tuple[Path, ...] = ()):
        self.root = Path(kernel_root).resolve()
        self.include_dirs = tuple(include_dirs)  # the run's extra include folders (harness.runs.compilecheck)
        self.rootdir = Path(rootdir).resolve()
        self.coverage = coverage
        self.deps = deps
        self.common = _sha(json.dumps({
            "format": FORMAT, "toolchain": _toolchain(arch),
            "options": {"static": config.static, "all_gates": config.all_gates, "trap_gates": config.trap_gates,
                        "trap_shadow": config.trap_shadow, "deadline": config.deadline},
            "support": self._support(),
        }, sort_keys=True).encode())

    def _gate_files(self) -> set[Path]:
        return {(self.rootdir / g.file).resolve() for g in self.coverage.gates.values()}

    def _support(self) -> str:
        """A digest of every `.py` of the project, the kernel root and the harness, but the
        gate test files (each selected one enters its mutants' keys by itself)."""
        from harness.library.caching import _skipped

        gate_files = self._gate_files()
        import harness

        harness_dir = Path(harness.__file__).resolve().parent
        bases = [self.rootdir] + [b for b in (self.root, harness_dir) if not b.is_relative_to(self.rootdir)]
        h = hashlib.sha256()
        for base in bases:
            for folder, dirs, names in os.walk(base):
                dirs[:] = sorted(d for d in dirs if not _skipped(Path(folder) / d))
                for name in sorted(n for n in names if n.endswith(".py")):
                    f = Path(folder) / name
                    if f.resolve() in gate_files:
                        continue
                    try:
                        h.update(f.relative_to(base).as_posix().encode() + b"\0" + _sha(f.read_bytes()).encode())
                    except OSError:
                        h.update(f.relative_to(base).as_posix().encode() + b"\0unreadable")
        return h.hexdigest()

    @functools.lru_cache(maxsize=None)
    def _file(self, path: Path) -> str:
        try:
            return _sha(path.read_bytes())
        except OSError:
            return "missing"

    @functools.lru_cache(maxsize=None)
    def _closure(self, module: str) -> tuple:
        from harness.compiling.includes import source_closure

        return tuple(map(tuple, source_closure(self.root / module, self.root, self.include_dirs)))

    def key(self, m) -> str:
        modules = self.deps.get(m.file, ())
        sel = self.coverage.select(m.file, modules)
        gates = sorted(sel.all)
        files = sorted({self.coverage.gates[g].file for g in gates})
        material = {
            "common": self.common, "mutant": m.id, "file": self._file(self.root / m.file),
            "closure": {mod: self._closure(mod) for mod in modules},
            "gates": gates, "gate_files": {f: self._file(self.rootdir / f) for f in files},
        }
        return _sha(json.dumps(material, sort_keys=True).encode())


def _toolchain(arch: str) -> dict:
    from harness.compiling import toolchain

    def version(fn):
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - a toolchain part that cannot say: its absence is the version
            return f"unknown ({type(exc).__name__})"

    return {"arch": arch, "python": list(sys.version_info[:2]), "nvrtc": version(toolchain.nvrtc_version),
            "cuda_headers": version(toolchain.cuda_headers_version), "cccl": version(toolchain.cccl_version),
            "shims": version(toolchain.shims_version)}
