"""The device's part of the redzones (`harness.library.redzones`), through CuPy: the check kernel
(`redzone_check.cu`, compiled by the harness's own compile path and loaded once a device), its
table of guards and its results, and the few copies and waits the registry asks for. A test of
the bookkeeping stands in for it with numpy (tests/redzone_standin.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from harness.core import settings as _settings

NONE = (1 << 64) - 1  # a result slot whose guard no check saw written
THREADS = 256  # the check kernel's block
MAX_BLOCKS_X = 8  # its blocks along one guard
CHECK_SOURCE = Path(__file__).with_name("redzone_check.cu")
CHECK_KERNEL = "harness_redzone_check"
GUARD_RECORD = np.dtype([("start", "<u8"), ("end", "<u8"), ("pattern", "<u8"), ("side", "<u4"), ("slot", "<u4")])
"""One guard as the check kernel reads it (`struct Guard` in redzone_check.cu)."""


class CupyDevice:
    """What the redzones ask of one device, through CuPy (a test gives a stand-in). Its own
    small copies (a dead buffer's result slots and guards) go on a stream of its own, so they
    never wait for, or land in, a gate's stream or a graph being captured."""

    def __init__(self, ordinal: int):
        import cupy

        self.cupy = cupy
        self.ordinal = ordinal
        self._module = self._kernel = self._stream = None

    def full(self, n: int, bits: int, uint):
        return self.cupy.full(int(n), np.dtype(uint).type(bits), dtype=uint)

    def from_host(self, host: np.ndarray):
        return self.cupy.asarray(host)

    def fill(self, array, bits: int) -> None:
        array.fill(np.dtype(array.dtype).type(bits))

    def address(self, array) -> int:
        return int(array.data.ptr)

    def keep(self, array):
        return array.data  # the memory stays allocated while the registry holds this

    def read(self, array) -> np.ndarray:
        return array.get()

    def _own_stream(self):
        if self._stream is None:
            self._stream = self.cupy.cuda.Stream(non_blocking=True)
        return self._stream

    def read_bytes(self, address: int, nbytes: int) -> bytes:
        host = np.empty(int(nbytes), np.uint8)
        stream = self._own_stream()
        rt = self.cupy.cuda.runtime
        rt.memcpyAsync(host.ctypes.data, int(address), int(nbytes), rt.memcpyDeviceToHost, stream.ptr)
        stream.synchronize()
        return host.tobytes()

    def read_slots(self, results, start: int, count: int) -> np.ndarray:
        return np.frombuffer(self.read_bytes(results.data.ptr + 8 * start, 8 * count), np.uint64)

    def set_slots(self, results, start: int, values) -> None:
        host = np.asarray(values, np.uint64)
        stream = self._own_stream()
        rt = self.cupy.cuda.runtime
        rt.memcpyAsync(results.data.ptr + 8 * start, host.ctypes.data, host.nbytes, rt.memcpyHostToDevice, stream.ptr)
        stream.synchronize()

    def current_stream(self):
        return self.cupy.cuda.get_current_stream()

    def stream_key(self, stream) -> int:
        return int(stream.ptr)

    def is_capturing(self, stream) -> bool:
        try:
            return bool(stream.is_capturing())
        except Exception:  # noqa: BLE001 - the legacy stream beside a capture: queue nothing there
            return True

    def record(self, stream=None, event=None):
        """`event` (a new one when None) recorded on `stream` (the current one when None)."""
        event = event if event is not None else self.cupy.cuda.Event(disable_timing=True)
        event.record(stream)
        return event

    def wait(self, events) -> None:
        for event in events:
            event.synchronize()

    def upload(self, records: np.ndarray, stream, writes: list):
        with stream:
            for event in writes:
                stream.wait_event(event)
            return self.cupy.asarray(records.view(np.uint8))

    def new_results(self, count: int):
        return self.cupy.full(int(count), np.uint64(NONE), dtype=np.uint64)

    def launch_check(self, table, count: int, results, seq: int, blocks: int, stream, uploaded) -> None:
        if not count:
            return
        stream.wait_event(uploaded)  # a table uploaded on another stream is complete first
        self._check_kernel()((blocks, min(count, 65535)), (THREADS,),
                             (table, np.uint32(count), results, np.uint32(seq)), stream=stream)

    def synchronize(self) -> None:
        self.cupy.cuda.runtime.deviceSynchronize()

    def _check_kernel(self):
        if self._kernel is None:
            self._module = self.cupy.cuda.function.Module()
            self._module.load(compile_check().cubin)
            self._kernel = self._module.get_function(CHECK_KERNEL)
        return self._kernel


def compile_check(run: _settings.Settings | None = None):
    """The check kernel's `CompiledModule`, through the harness's compile path (NVRTC, the cubin
    cache), for the run's arch (`run`: the settings in effect by default)."""
    from dataclasses import replace

    from harness.compiling.compile import compile_file
    from harness.compiling.modsettings import ModuleSettings

    run = run if run is not None else _settings.in_effect()
    return compile_file(CHECK_SOURCE, kernel_root=CHECK_SOURCE.parent, settings=ModuleSettings(device_view=False),
                        include_dirs=(), run=replace(run, trap_shadow=False))
