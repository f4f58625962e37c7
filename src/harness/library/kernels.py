"""Loading compiled modules into CuPy and getting kernels by name or C++ name expression."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

from harness.compiling.compile import CompiledModule, compile_file
from harness.core import settings as _settings
from harness.core.errors import HarnessError
from harness.library import coverage, redzones, timing
from harness.library.launch import allow_dynamic_shared, dynamic_shared_allowed, kernel_args, torch_stream


class KernelNotFound(HarnessError, LookupError):
    pass


# Each launch through a Module's kernels is told to these, before it happens: the pool's worker
# (which kernel ran last, for a gate that hangs; how many, for the sanitizer's attribution).
_launch_listeners: list = []


def add_launch_listener(listener) -> None:
    """Call `listener(name)` before every kernel launch made through harness.library.kernels."""
    if listener not in _launch_listeners:
        _launch_listeners.append(listener)


def note_launch(name: str) -> None:
    """Tell the launch listeners that kernel `name` is about to run."""
    for listener in _launch_listeners:
        listener(name)


class Module:
    """A cubin loaded into the current CUDA context."""

    def __init__(self, compiled: CompiledModule):
        import cupy

        self.compiled = compiled
        self.device = cupy.cuda.Device().id  # the device it is loaded on: its kernels run there
        self._module = cupy.cuda.function.Module()
        self._module.load(compiled.cubin)
        self._functions: dict[str, object] = {}

    def trap_shadow_hits(self) -> int | None:
        """How often a `__trap()` of a trap-shadow module counted (None: not one)."""
        if not self.compiled.trap_shadow:
            return None
        import cupy

        from harness.compiling.trap_shadow import TRAP_SHADOW_SYMBOL

        raw = self._module.get_global_var(TRAP_SHADOW_SYMBOL)  # its address (cuModuleGetGlobal)
        raw = raw[0] if isinstance(raw, tuple) else raw
        address = int(getattr(raw, "ptr", raw))
        memory = cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(address, 4, self), 0)
        return int(cupy.ndarray((1,), dtype=cupy.uint32, memptr=memory).get()[0])

    def symbol(self, name: str) -> str:
        """The mangled symbol for a name expression, or `name` itself (extern "C")."""
        return self.compiled.symbol_mapping.get(name, name)

    def get(self, name: str):
        """A CuPy function, called as `fn(grid, block, args, shared_mem=0)`. Each call tells the
        watchdog which kernel was launched last, so a gate that hangs names it."""
        if name in self._functions:
            return self._functions[name]
        symbol = self.symbol(name)
        try:
            fn = self._module.get_function(symbol)
        except Exception as exc:
            known = [r.kernel for r in self.compiled.resources]
            hint = (
                f"pass {name!r} in name_expressions when you load the module"
                if "<" in name or "::" in name
                else "declare it extern \"C\" __global__, or pass its C++ name expression in name_expressions"
            )
            raise KernelNotFound(
                f"kernel {name!r} is not in {self.compiled.source.name}: {hint}. "
                f"Kernels in the module: {', '.join(known) or '(none reported)'}"
            ) from exc
        fn = self._functions[name] = Launch(fn, f"{self.compiled.source.name}:{name}", self.device)
        return fn


class Launch:
    """A kernel that notes its own launches (for the watchdog and the sanitizer's count), each
    followed by the redzones' check on its stream (`harness.library.redzones`). A launch with
    more `shared_mem` than the function takes with no opt-in (48 KiB less its static shared
    memory: `harness.library.launch.dynamic_shared_allowed`, read at its first launch with any)
    first raises the function's dynamic shared memory attribute
    (`harness.library.launch.allow_dynamic_shared`), once per size.

    Arguments may be torch CUDA tensors (or other CUDA-array-interface objects) on the
    kernel's device: each is passed as its device pointer, with no copy
    (`harness.library.launch.kernel_args`, which refuses a tensor on the CPU or another GPU, a
    non-contiguous one, an unknown dtype). `stream="torch"` launches on torch's current
    stream of that device; otherwise the stream is CuPy's (its current one, or `stream=`)."""

    __slots__ = ("function", "name", "shared_allowed", "device")

    def __init__(self, function, name: str, device: int | None = None):
        self.function = function
        self.name = name
        self.shared_allowed: int | None = None  # read at the first launch with dynamic shared memory
        self.device = device  # None: the current CuPy device, read at the first torch argument

    def _device(self) -> int:
        if self.device is None:
            import cupy

            self.device = cupy.cuda.Device().id
        return self.device

    def __call__(self, grid, block, args, *rest, **kwargs):
        args = kernel_args(self.name, args, self.device)
        if isinstance(kwargs.get("stream"), str):
            if kwargs["stream"] != "torch":
                raise ValueError(f"{self.name}: stream={kwargs['stream']!r}: pass 'torch' (torch's current stream) or a "
                                 "CuPy stream")
            kwargs = {**kwargs, "stream": torch_stream(self._device())}
        shared = kwargs.get("shared_mem", rest[0] if rest else 0)
        if int(shared) and self.shared_allowed is None:
            self.shared_allowed = dynamic_shared_allowed(self.function)
        if int(shared) > (self.shared_allowed or 0):
            allow_dynamic_shared(self, int(shared))
            self.shared_allowed = int(shared)
        note_launch(self.name)
        coverage.note_kernel(self.name)  # which gates run which kernel: a campaign's finer selection
        if timing.armed():  # a comparison run: counted, and timed for --compare-timing
            timing.before_launch(self, grid, block, args, rest, kwargs)
        launched = self.function(grid, block, args, *rest, **kwargs)
        # the guards beside the harness's buffers, checked on the same stream, behind it
        redzones.after_launch(self.name, kwargs.get("stream", rest[1] if len(rest) > 1 else None), self.device)
        return launched

    def __getattr__(self, attr):
        return getattr(self.function, attr)


_loaded: dict[tuple, Module] = {}


def kernel_root() -> Path:
    """The kernel root in effect (`--kernel-root`, ini `kernel_root`, or HARNESS_KERNEL_ROOT)."""
    return _settings.in_effect().kernel_root


def load(compiled: CompiledModule) -> Module:
    import cupy

    key = (compiled.key, cupy.cuda.Device().id)
    mod = _loaded.get(key)
    if mod is None:
        mod = _loaded[key] = Module(compiled)
    return mod


def trap_shadow_on() -> bool:
    """Whether `module()` loads the trap-shadow build of each module now (the settings in
    effect say so: a mutation campaign's trap gate in a warm worker)."""
    return _settings.in_effect().trap_shadow


def trap_shadow_hits() -> int:
    """The guards counted by every trap-shadow module loaded now; raises when the context
    cannot say (a sticky error)."""
    return sum(m.trap_shadow_hits() or 0 for m in list(_loaded.values()))


def forget_loaded() -> None:
    """Drop every loaded module (CuPy unloads each once unreferenced): a warm worker that
    served one mutant serves the next without its cubins."""
    _loaded.clear()
    _used.clear()
    _compiled.clear()


# `module()`'s memo: a launcher asks for its module at every launch, and `compile_file`
# re-reads the source closure, derives the device view and reads the cubin from the cache
# each time, which an invariance gate's thousands of launches would pay for each launch. An entry serves while every
# file its compile read has the size and modification time it had when the entry was kept.
# Where one of them had changed within the timestamp granularity of then (git's "racily
# clean" case: it could change again with the same size and time, as a campaign's sandbox
# file does, or have changed between the compile's read and the stamp), the entry also
# checks each file's bytes against the digest the compile took. `forget_loaded` drops all.
_compiled: dict[tuple, tuple[CompiledModule, tuple, bool]] = {}
RACY_NS = 2_000_000_000  # mtimes this close to the stamp do not show the next change on their own


def _stamps(files) -> tuple | None:
    try:
        return tuple((st.st_size, st.st_mtime_ns) for st in (os.stat(path) for path, _ in files))
    except OSError:
        return None


def _unchanged_bytes(files) -> bool:
    try:
        return all(hashlib.sha256(Path(path).read_bytes()).hexdigest() == digest for path, digest in files)
    except OSError:
        return False


def _compiled_module(relpath, name_expressions: tuple, defines: dict | None, fmad: bool | None) -> CompiledModule:
    run = _settings.in_effect()
    key = (os.fspath(relpath), name_expressions, None if defines is None else tuple(sorted(
        (str(k), repr(v)) for k, v in defines.items())), fmad, run)
    hit = _compiled.get(key)
    if hit is not None:
        compiled, stamps, racy = hit
        if _stamps(compiled.files) == stamps and (not racy or _unchanged_bytes(compiled.files)):
            return compiled
        del _compiled[key]
    compiled = compile_file(relpath, name_expressions=name_expressions, defines=defines, fmad=fmad, run=run)
    stamps = _stamps(compiled.files) if compiled.files else None
    if stamps is not None:
        _compiled[key] = (compiled, stamps, max(t for _, t in stamps) >= time.time_ns() - RACY_NS)
    return compiled


def module(
    relpath: str | os.PathLike,
    name_expressions: tuple[str, ...] | list[str] = (),
    defines: dict | None = None,
    fmad: bool | None = None,
) -> Module:
    """Compile (or hit the cache for) `<kernel_root>/<relpath>` and load it into CuPy, with
    the compile settings its launcher declares (`harness.compiling.modsettings`). The arguments may
    repeat the declaration or fill in what it leaves out, never contradict it."""
    compiled = _compiled_module(relpath, tuple(name_expressions), defines, fmad)
    coverage.note_module(relpath)  # which gates load which module: gate selection for mutation campaigns
    _used[compiled.source.name if compiled.source.parent == _settings.in_effect().kernel_root else str(relpath)] = \
        compiled.options
    return load(compiled)


_used: dict[str, tuple[str, ...]] = {}


def used() -> dict[str, list[str]]:
    """{module: its options} loaded through `module` since the last `take_used`, left in place."""
    return {k: list(v) for k, v in _used.items()}


def take_used() -> dict[str, list[str]]:
    """{module: the options it was compiled with} for every module loaded through `module`
    since the last call (the plugin records them on the gate that loaded them)."""
    out = {k: list(v) for k, v in _used.items()}
    _used.clear()
    return out

