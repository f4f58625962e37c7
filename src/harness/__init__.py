"""harness: a pytest plugin and library that proves CUDA kernels right to the bit.

What a gate author uses is re-exported here; the rest stays in its modules, grouped by layer
(docs/architecture.md): `core`, `compiling`, `library`, `pool`, `runs`, `plugin`, `campaigns`,
`commands`. The exports load on first use, so importing the plugin (every pytest run in an
environment where the harness is installed) imports neither numpy nor the CUDA libraries.

A module's path from before that grouping (`harness.launch`, `harness.kernels`, ...) still
imports, as the same module object (`_MOVED`), so a launcher written then runs unchanged.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

_EXPORTS = {
    "ArchError": "harness.compiling.arch",
    "BitsMismatch": "harness.library.bits",
    "CompileError": "harness.compiling.compile",
    "CompiledModule": "harness.compiling.compile",
    "NotClose": "harness.library.bits",
    "assert_bits_eq": "harness.library.bits",
    "assert_close": "harness.library.bits",
    "compile_file": "harness.compiling.compile",
    "host_cache": "harness.library.caching",
    "kernel_root": "harness.library.kernels",
    "module": "harness.library.kernels",
    "record": "harness.library.arms",
    "rel_rms": "harness.library.bits",
    "torch_reference": "harness.library.reference",
}

__all__ = sorted(_EXPORTS)

# harness.<old> -> harness.<new>: every module the grouping by layer moved.
_MOVED = {
    "_settings": "core.settings", "errors": "core.errors", "values": "core.values", "device": "core.device",
    "records": "core.records", "kinds": "core.kinds", "gate_reports": "core.gate_reports", "child": "core.child",
    "interrupt": "core.interrupt", "gitref": "core.gitref", "project_modules": "core.project_modules",
    "usage": "core.usage", "_forkserver": "core.forkserver_main",
    "compile": "compiling.compile", "compile_options": "compiling.options", "includes": "compiling.includes",
    "backends": "compiling.backends", "arch": "compiling.arch", "cubin_cache": "compiling.cubin_cache",
    "toolchain": "compiling.toolchain", "ptxas": "compiling.ptxas", "trap_shadow": "compiling.trap_shadow",
    "modsettings": "compiling.modsettings", "kernelfile": "compiling.kernelfile", "deviceview": "compiling.deviceview",
    "closureview": "compiling.closureview", "cuda_syntax": "compiling.cuda_syntax",
    "bits": "library.bits", "dtypes": "library.dtypes", "tensors": "library.tensors", "buffers": "library.buffers",
    "launch": "library.launch", "kernels": "library.kernels", "invariance": "library.invariance",
    "arms": "library.arms", "reference": "library.reference", "source": "library.source", "timing": "library.timing",
    "caching": "library.caching", "coverage": "library.coverage", "ref_launchers": "library.ref_launchers",
    "_serve": "pool.serve", "sanitizer": "pool.sanitizer",
    "plugin_pool": "plugin.pool", "plugin_state": "plugin.state", "hookspecs": "plugin.hookspecs",
    "gate_verdicts": "plugin.verdicts", "summary": "plugin.summary", "cufiles": "plugin.cufiles",
    "snapshots": "plugin.snapshots", "snapshot_tally": "plugin.snapshot_tally", "shard": "plugin.shard",
    "report": "plugin.report", "compare": "plugin.compare",
    "controls": "campaigns.controls", "mutate": "campaigns.mutate",
    "cache_cli": "commands.cache", "report_cli": "commands.report", "bench": "commands.bench",
    "startup": "commands.startup",
}


def _moved_to(fullname: str) -> str | None:
    """The module `harness.<old>[.rest]` is now, or None when it did not move."""
    parts = fullname.split(".")
    if len(parts) < 2 or parts[0] != __name__ or parts[1] not in _MOVED:
        return None
    return ".".join([__name__, _MOVED[parts[1]], *parts[2:]])


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """`import harness.<old>` gives the module at its new path, the same object."""

    def find_spec(self, fullname, path=None, target=None):
        new = _moved_to(fullname)
        return importlib.util.spec_from_loader(fullname, self) if new is not None else None

    def create_module(self, spec):
        return importlib.import_module(_moved_to(spec.name))

    def exec_module(self, module):
        pass  # the module ran once, at its new path


# First on the path: `harness.<old>.<sub>` must not be found again, as a second copy, under the
# old package's `__path__` (which is the new package's folder).
if not any(isinstance(f, _MovedModules) for f in sys.meta_path):
    sys.meta_path.insert(0, _MovedModules())


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module), name)
    elif name in _MOVED:
        value = importlib.import_module(f"{__name__}.{_MOVED[name]}")
    else:
        raise AttributeError(f"module 'harness' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
