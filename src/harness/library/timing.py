"""Each kernel launch of a gate, counted and, for `--compare-timing`, timed with CUDA events.

A comparison run (`harness.plugin.compare`) arms every gate (`begin`): each launch made through
`harness.library.kernels` is then counted by kernel, and when timing was asked for, the launch is
first repeated on the same stream with the same arguments: a few warm-up launches, then
`repeat` launches each between two CUDA events. The gate's own launch comes after, on its
inputs as they were: the array arguments a launch changes (found by comparing their bits after
the first warm-up launch with a copy taken before it) are put back before each repeated launch
and before the gate's own, so a kernel that accumulates into its output, or counts in a
workspace, is timed on the same inputs every time and leaves the gate what it expects. State a
kernel keeps outside its array arguments (a `__device__` variable, memory reached through a
raw address) is not put back. Launches made while a stream is being captured into a graph are
counted, not timed.

At most MAX_TIMED launches of each kernel a gate are timed; launches are named by kernel and
their order among that kernel's launches in the gate (`demo.cu:scale#0`), so the two sides of
a comparison pair up.
"""

from __future__ import annotations

MAX_TIMED = 16  # launches of one kernel a gate: the rest are counted, not timed
DEFAULT_REPEAT, DEFAULT_WARMUP = 50, 5

_state: dict | None = None  # the armed gate's record, None when nothing is armed


def begin(repeat: int = 0, warmup: int = DEFAULT_WARMUP) -> None:
    """Count every launch from now on; time the first MAX_TIMED of each kernel `repeat` times
    (none when 0)."""
    global _state
    _state = {"repeat": int(repeat), "warmup": int(warmup), "launches": {}, "timed": {}, "notes": []}


def end() -> dict:
    """Stop; {"launches": {kernel: count}, "timed": {"kernel#i": {"grid", "block", "ms"}}, "notes"}."""
    global _state
    state, _state = _state, None
    if state is None:
        return {"launches": {}, "timed": {}, "notes": []}
    return {k: state[k] for k in ("launches", "timed", "notes")}


def from_environment(value: str | None) -> tuple[int, int]:
    """(repeat, warmup) from the value of the channel `harness.core.child.COMPARE_TIMING_CHANNEL` ("repeat,warmup"); (0, 0) when unset."""
    if not value:
        return 0, 0
    repeat, _, warmup = value.partition(",")
    return int(repeat), int(warmup or DEFAULT_WARMUP)


def armed() -> bool:
    return _state is not None


def before_launch(launch, grid, block, args, rest, kwargs) -> None:
    """Count this launch of `launch` (a harness.library.kernels.Launch); time it when asked."""
    state = _state
    n = state["launches"].get(launch.name, 0)
    state["launches"][launch.name] = n + 1
    if not state["repeat"] or n >= MAX_TIMED:
        return
    import cupy

    stream = kwargs.get("stream") or cupy.cuda.get_current_stream()
    if stream.is_capturing():
        state["notes"].append(f"{launch.name}#{n}: launched during a graph capture, not timed")
        return
    ms = _time(launch.function, stream, grid, block, args, rest, kwargs, state["repeat"], state["warmup"])
    state["timed"][f"{launch.name}#{n}"] = {"grid": _dims(grid), "block": _dims(block), "ms": ms}


def _dims(d) -> list[int]:
    return [int(v) for v in (d if isinstance(d, (tuple, list)) else (d,))]


def _bits(a):
    """`a` viewed as unsigned integers of its item size (NaNs compare by their bits), or None."""
    import cupy

    kind = {1: cupy.uint8, 2: cupy.uint16, 4: cupy.uint32, 8: cupy.uint64}.get(a.dtype.itemsize)
    return a.view(kind) if kind is not None else None


def _time(function, stream, grid, block, args, rest, kwargs, repeat: int, warmup: int) -> list[float]:
    import cupy

    with stream:
        arrays = [a for a in args if isinstance(a, cupy.ndarray)]
        saved = [(a, a.copy()) for a in arrays]

        def launch():
            function(grid, block, args, *rest, **kwargs)

        launch()  # the first warm-up: which arrays does a launch change?
        changed = []
        for a, copy in saved:
            now, before = _bits(a), _bits(copy)
            if now is None or not bool((now == before).all()):
                changed.append((a, copy))

        def put_back():
            for a, copy in changed:
                cupy.copyto(a, copy)

        for _ in range(max(0, warmup - 1)):
            put_back()
            launch()
        pairs = []
        for _ in range(repeat):
            put_back()
            start, stop = cupy.cuda.Event(), cupy.cuda.Event()
            start.record(stream)
            launch()
            stop.record(stream)
            pairs.append((start, stop))
        put_back()  # the gate's own launch sees its inputs as they were
        stream.synchronize()
    return [round(float(cupy.cuda.get_elapsed_time(a, b)), 5) for a, b in pairs]
