"""CUDA-graph replay's bookkeeping with no GPU: a stand-in device records the captured launch
and replays it on the buffers it was captured with, as the driver does."""

from __future__ import annotations

import numpy as np
import pytest

from harness.core.errors import UsageError
from harness.library.graphs import GraphReplay, eager_and_graph
from harness.library.invariance import NotBatchInvariant, assert_batch_invariant


class StandInDevice:
    """Numpy buffers; a capture keeps the closure, a replay calls it (on the captured buffers)."""

    def __init__(self):
        self.allocated = 0
        self.captured = []

    def copy(self, a, label=None):
        return a.copy()

    def copy_into(self, dst, src):
        dst[...] = src

    def allocated_bytes(self):
        return self.allocated

    def capture(self, launch):
        launch()  # the closure runs while captured (what it allocates counts); its kernels would not
        self.captured.append(launch)
        return launch

    def replay(self, graph):
        graph()


def double(x, y):
    y[...] = 2 * x


def test_a_replay_writes_new_inputs_into_the_captured_buffers_and_hands_back_the_outputs():
    dev = StandInDevice()
    replay = GraphReplay("double", device=dev)
    for step in range(3):
        x, y = np.arange(4.0) + step, np.full(4, np.nan)
        replay("graph", "k", double, x=x, y=y)
        assert (y == 2 * x).all(), step
    assert (replay.captures, replay.replays, len(dev.captured)) == (1, 3, 1)


def test_another_shape_or_key_is_another_graph_and_eager_captures_nothing():
    dev = StandInDevice()
    replay = GraphReplay("double", device=dev)
    replay("graph", "k", double, x=np.ones(4), y=np.zeros(4))
    replay("graph", "k", double, x=np.ones(5), y=np.zeros(5))
    replay("graph", "other", double, x=np.ones(4), y=np.zeros(4))
    y = np.zeros(3)
    replay("eager", "k", double, x=np.ones(3), y=y)
    assert (y == 2).all()
    assert replay.captures == 3


def test_a_launch_that_allocates_while_captured_is_named():
    dev = StandInDevice()

    def greedy(x, y):
        dev.allocated += 4096  # a launcher making its own scratch
        double(x, y)

    with pytest.raises(UsageError, match=r"allocated 4096 bytes of device memory while captured.*scratch"):
        GraphReplay("greedy", device=dev)("graph", 3, greedy, x=np.ones(2), y=np.zeros(2))


def test_a_launch_the_driver_will_not_capture_is_one_usage_error():
    class Refusing(StandInDevice):
        def capture(self, launch):
            raise RuntimeError("cudaErrorStreamCaptureUnsupported: operation not permitted when stream is capturing")

    with pytest.raises(UsageError, match=r"could not be captured.*StreamCaptureUnsupported.*no host synchronisation"):
        GraphReplay("sync", device=Refusing())("graph", 0, double, x=np.ones(2), y=np.zeros(2))


def test_bad_modes_and_missing_buffers_say_what_to_do():
    replay = GraphReplay("double", device=StandInDevice())
    with pytest.raises(UsageError, match="launch mode 'graphs': use one of eager, graph"):
        replay("graphs", 0, double, x=np.ones(2), y=np.zeros(2))
    with pytest.raises(UsageError, match="needs its buffers by name"):
        replay("graph", 0, lambda: None)


def test_eager_and_graph_doubles_the_variants_eager_first():
    assert eager_and_graph() == {"default": (None, "eager"), "CUDA-graph replay": (None, "graph")}
    assert list(eager_and_graph({"a": 1, "b": 2})) == ["a", "b", "a, CUDA-graph replay", "b, CUDA-graph replay"]
    with pytest.raises(ValueError, match="variants is empty"):
        eager_and_graph({})


def test_a_kernel_that_reads_what_the_capture_froze_fails_batch_invariance_under_replay():
    # The launch closes over the batch size of the call that was captured (a size passed by value
    # that the key does not name): replayed for a batch of another size it computes the old count.
    dev = StandInDevice()
    replay = GraphReplay("scaled", device=dev)
    inputs = np.arange(1.0, 9.0)

    # Buffers of one fixed size (8) for every batch: the first capture's closure is replayed for all.
    def run_fixed(ids, variant):
        _, mode = variant
        x = np.zeros(8)
        x[:len(ids)] = inputs[ids]
        y = np.zeros(8)
        state = {"n": len(ids)}

        def launch(x, y, n=state["n"]):
            y[:] = 0
            y[:n] = x[:n] * 2
        replay(mode, "one key for every size", launch, x=x, y=y)
        return y[:len(ids)]

    assert_batch_invariant("eager only", run_fixed, [0, 1], batch_sizes=(1, 3), variants={"e": (None, "eager")})
    with pytest.raises(NotBatchInvariant, match="CUDA-graph replay"):
        assert_batch_invariant("scaled", run_fixed, [0, 1], batch_sizes=(1, 3), variants=eager_and_graph())
