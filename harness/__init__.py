"""harness: a pytest plugin and library that proves CUDA kernels right to the bit.

What a gate author uses is re-exported here; the rest stays in its modules.
"""

from harness.caching import host_cache
from harness.bits import BitsMismatch, NotClose, assert_bits_eq, assert_close, rel_rms
from harness.compile import ArchError, CompileError, CompiledModule, compile_file
from harness.kernels import kernel_root, module

__all__ = [
    "ArchError",
    "BitsMismatch",
    "CompileError",
    "CompiledModule",
    "NotClose",
    "assert_bits_eq",
    "assert_close",
    "compile_file",
    "host_cache",
    "kernel_root",
    "module",
    "rel_rms",
]
