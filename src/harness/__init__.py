"""harness: a pytest plugin and library that proves CUDA kernels right to the bit.

What a gate author uses is re-exported here; the rest stays in its modules. The exports
load on first use, so importing the plugin (every pytest run in an environment where the
harness is installed) imports neither numpy nor the CUDA libraries.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "ArchError": "harness.arch",
    "BitsMismatch": "harness.bits",
    "CompileError": "harness.compile",
    "CompiledModule": "harness.compile",
    "NotClose": "harness.bits",
    "assert_bits_eq": "harness.bits",
    "assert_close": "harness.bits",
    "compile_file": "harness.compile",
    "host_cache": "harness.caching",
    "kernel_root": "harness.kernels",
    "module": "harness.kernels",
    "record": "harness.arms",
    "rel_rms": "harness.bits",
    "torch_reference": "harness.reference",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'harness' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
