"""CUDA-graph replay as a launch variant: capture a launch once, replay it with new inputs
written into the same buffers, and require the bits of the eager launch.

Inference engines decode under CUDA graphs: the kernel runs on the buffers it was captured
with, and each step's inputs are copied into them first. A kernel that reads something the
capture froze (a pointer computed on the host, a size passed by value that the next batch
changes, scratch the eager path zeroes on the host) gives other bits there than in the eager
launches a gate makes. So the invariance and determinism gates run each launch both ways:

    from harness.library.graphs import GraphReplay, eager_and_graph

    replay = GraphReplay("fp8_gemv y")

    def run(ids, variant):
        segments, mode = variant
        x, xs, y = inputs_for(ids)             # device arrays: this batch's inputs, its output
        replay(mode, (segments, len(ids)), lambda x, xs, y: launch(y, x, xs, segments), x=x, xs=xs, y=y)
        return y                                # eager or replayed, the caller's own arrays hold the result

    assert_batch_invariant("fp8_gemv y", run, rows, batch_sizes=..., variants=eager_and_graph(VARIANTS))

`replay(mode, key, launch, **buffers)` with mode "eager" calls `launch(**buffers)`. With mode
"graph", the first call of a `key` copies the buffers into buffers of its own (the graph's),
launches once eagerly on them (modules load, lazy initialisation happens outside the capture),
puts their contents back, captures `launch` on them into a graph and instantiates it; every
call of that key (the first too) copies each buffer's contents into the graph's (inputs, the
output's initial fill, scratch: what the engine would write before a step), replays the graph
on the current stream and copies the graph's buffers back into the caller's. Weights and
other arrays the `launch` closes over are the same arrays every call (the engine's weights);
everything that changes from call to call must be a buffer. The key must name whatever the
launch is captured with besides the buffers' shapes and dtypes (a variant, a size passed by
value): buffers of another shape or dtype are another graph anyway.

A launch that allocates device memory while captured (a launcher making its own scratch),
or synchronises with the host, cannot be replayed: that is a UsageError naming the key and
what to do (pass the scratch as a buffer). Each replay object notes in the gate's report how
many graphs it captured and how many times it replayed them.
"""

from __future__ import annotations

from typing import Callable

from harness.core.errors import UsageError
from harness.library import coverage, redzones
from harness.library.invariance import named_variants

MODES = ("eager", "graph")


def eager_and_graph(variants=None) -> dict[str, tuple]:
    """Each variant twice: launched eagerly, then replayed from a CUDA graph. Returns
    {name: (variant, mode)}, the eager ones first (the first is the invariance gates' reference).
    `variants` as the invariance helpers take it: None (one default variant), a list, or a dict."""
    named = named_variants(variants)
    out = {}
    for mode in MODES:
        for name, v in named.items():
            if mode == "eager":
                out[name] = (v, mode)
            else:
                out["CUDA-graph replay" if name == "default" else f"{name}, CUDA-graph replay"] = (v, mode)
    return out


class _Cupy:
    """What replay asks of the device, through CuPy (a test gives a stand-in)."""

    def __init__(self):
        import cupy

        self.cupy = cupy
        self._stream = None

    def _contiguous(self, array, what: str) -> None:
        if not array.flags.c_contiguous:
            raise UsageError(f"graph replay: {what} is not C-contiguous: pass whole buffers (a contiguous copy)")

    def copy(self, array, label: str | None = None):
        """A new device buffer holding `array`'s bytes (raw: bf16 and fp8 views copy as their bits),
        between redzones (`harness.library.redzones`) named `label`."""
        self._contiguous(array, "a buffer")
        inside = redzones.allocate(array.size, array.dtype, shape=array.shape, helper="GraphReplay", label=label)
        if inside is None:
            inside = self.cupy.empty(array.nbytes, dtype=self.cupy.uint8)
        own = inside.view(array.dtype).reshape(array.shape)
        self.copy_into(own, array)
        return own

    def copy_into(self, dst, src) -> None:
        """`src`'s bytes into `dst` (same shape and dtype, both contiguous), on the current stream."""
        self._contiguous(src, "a buffer")
        if src.nbytes:
            rt = self.cupy.cuda.runtime
            rt.memcpyAsync(dst.data.ptr, src.data.ptr, src.nbytes, rt.memcpyDeviceToDevice,
                           self.cupy.cuda.get_current_stream().ptr)

    def allocated_bytes(self) -> int:
        return int(self.cupy.get_default_memory_pool().used_bytes())

    def capture(self, launch: Callable[[], object]):
        if self._stream is None:
            self._stream = self.cupy.cuda.Stream(non_blocking=True)
        self.cupy.cuda.get_current_stream().synchronize()
        with self._stream:
            # Relaxed: an allocation inside the capture is let through, then named (GraphReplay._capture).
            self._stream.begin_capture(mode=getattr(self.cupy.cuda.runtime, "streamCaptureModeRelaxed", None))
            try:
                launch()
            finally:
                graph = self._stream.end_capture()
        return graph

    def replay(self, graph) -> None:
        graph.launch(self.cupy.cuda.get_current_stream())


class GraphReplay:
    """One gate's graphs, by key (module docstring)."""

    def __init__(self, label: str, *, device=None):
        self.label = label
        self._device = device
        self._graphs: dict[tuple, tuple[object, dict]] = {}
        self.captures = self.replays = 0

    @property
    def device(self):
        if self._device is None:
            self._device = _Cupy()
        return self._device

    def __call__(self, mode: str, key, launch: Callable[..., object], **buffers) -> None:
        if mode not in MODES:
            raise UsageError(f"{self.label}: launch mode {mode!r}: use one of {', '.join(MODES)} "
                             "(harness.library.graphs.eager_and_graph names them)")
        if not buffers:
            raise UsageError(f"{self.label}: a replayed launch needs its buffers by name (x=..., y=...): everything "
                             "that changes from call to call must be one")
        if mode == "eager":
            launch(**buffers)
            return
        full_key = (key, tuple((name, tuple(b.shape), str(b.dtype)) for name, b in sorted(buffers.items())))
        if full_key not in self._graphs:
            self._graphs[full_key] = self._capture(key, launch, buffers)
        graph, own = self._graphs[full_key]
        if set(own) != set(buffers):
            raise UsageError(f"{self.label}: key {key!r} was captured with buffers {sorted(own)}, now given "
                             f"{sorted(buffers)}: give the same names every call of a key")
        dev = self.device
        for name, b in buffers.items():
            dev.copy_into(own[name], b)
        dev.replay(graph)
        redzones.after_launch(f"{self.label}: CUDA-graph replay of key {key!r}")
        for name, b in buffers.items():
            dev.copy_into(b, own[name])
        self.replays += 1
        coverage.note_tried(f"CUDA-graph replay of {self.label}: {self.captures} graph(s) captured, "
                            f"{self.replays} replay(s) with new inputs in the captured buffers")

    def _capture(self, key, launch, buffers: dict) -> tuple[object, dict]:
        dev = self.device
        own = {name: dev.copy(b, f"{self.label}: the graph's {name}") for name, b in buffers.items()}
        launch(**own)  # outside the capture: modules load, one-time initialisation happens here
        for name, b in buffers.items():
            dev.copy_into(own[name], b)
        before = dev.allocated_bytes()
        try:
            graph = dev.capture(lambda: launch(**own))
        except UsageError:
            raise
        except Exception as exc:  # noqa: BLE001 - the driver's refusal of something inside the capture
            raise UsageError(f"{self.label}: the launch of key {key!r} could not be captured into a CUDA graph "
                             f"({type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}): "
                             "a captured launch may only launch kernels and copy between device buffers (no host "
                             "synchronisation, no copy from host memory, no allocation)") from exc
        grew = dev.allocated_bytes() - before
        if grew > 0:
            raise UsageError(f"{self.label}: the launch of key {key!r} allocated {grew} bytes of device memory while "
                             "captured; a replay would reuse memory freed after the capture. Allocate it before (pass "
                             "the scratch as a buffer)")
        self.captures += 1
        return graph, own
