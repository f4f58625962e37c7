"""Demonstration gates over kernels_cu/demo.cu: anchors (one block, and several blocks with
guard zones around sentinel-filled outputs), a link, a refusal and a trap gate."""

import numpy as np
import pytest

from harness import assert_bits_eq
from harness.library.dtypes import to_bf16
from kernels_cu import demo

N = 1000  # not a multiple of the block: the guarded tail is exercised


@pytest.fixture(scope="module")
def device_input():
    import cupy

    # Multiples of 1/8 up to 125: bf16 holds them exactly, and doubling them is exact.
    host = to_bf16(np.arange(N, dtype=np.float32) / 8)
    return host, cupy.asarray(host)


def run_scale(x, vectorised):
    import cupy

    out = cupy.zeros(x.shape, dtype=x.dtype)
    demo.run_scale(out, x, 2.0, vectorised=vectorised)
    return out


@pytest.mark.gpu
@pytest.mark.anchor
def test_scale_by_two_is_exact(device_input):
    host, x = device_input
    assert_bits_eq("out", run_scale(x, vectorised=False), to_bf16(host.astype(np.float32) * 2))


@pytest.mark.gpu
@pytest.mark.link
def test_vectorised_template_equals_scalar_kernel(device_input):
    _, x = device_input
    assert_bits_eq("out", run_scale(x, vectorised=True), run_scale(x, vectorised=False))


@pytest.mark.refusal
def test_short_output_is_refused_before_launch():
    with pytest.raises(ValueError, match="allocate at least n"):
        demo.check_scale_args(n=10, out_len=5)


@pytest.mark.gpu
@pytest.mark.trap
def test_gather_index_past_the_end_fires_the_device_guard():
    import cupy

    x = cupy.arange(8, dtype=cupy.float32)
    idx = cupy.asarray([0, 3, 8], dtype=cupy.int32)
    out = cupy.zeros(3, dtype=cupy.float32)
    demo.run_gather(out, x, idx)
    cupy.cuda.runtime.deviceSynchronize()


@pytest.mark.gpu
@pytest.mark.link
@pytest.mark.names_faults  # a guard that fires on these valid indices fails it by its own assertion
def test_gather_in_bounds_after_a_trap_gate():
    """Beside the trap gate (which runs in a fresh worker of its own, and reports last when
    the pool starts trap gates ahead): the shared worker's verdicts never depend on it.

    The guard's other side: indices in [0, n), the ends 0 and n - 1 included, never trip it.
    A guard that fires on one (a bound one too strict) or a launch that faults on valid
    input fails this gate by assertion, naming that claim."""
    import cupy

    from harness.core.device import guard_must_not_fire

    x = cupy.arange(8, dtype=cupy.float32)
    idx = cupy.asarray([7, 0, 3], dtype=cupy.int32)  # n - 1, 0 and one inside
    out = cupy.zeros(3, dtype=cupy.float32)
    with guard_must_not_fire("in-bounds indices 7 (n - 1), 0 and 3 must pass the gather guard"):
        demo.run_gather(out, x, idx)
        got = out.get()
    assert_bits_eq("out", got, np.asarray([7, 0, 3], dtype=np.float32))


# Multi-block launches with guard zones, on the demonstration kernels:
# sizes put a partial block last (1000), leave the last full stride one short (1022: a
# stride of blockDim - 1 no longer reaches the end), and give the vectorised kernel several
# blocks (4099); outputs start as sentinels inside guard zones, so an element never
# written, a store one before or past the output, and a block that overwrites another's
# range all show.
PAD = 64
# 4094: the vectorised kernel's four blocks all but full (a stride of blockDim - 1 falls short
# of the end there; at 4099 a fifth block covers the gap).
SIZES = (1000, 1022, 4 * demo.BLOCK * demo.VEC - 2, 4 * demo.BLOCK * demo.VEC + 3)


def _guarded_out(n, dtype, sentinel):
    from harness.library.buffers import filled

    whole = filled((n + 2 * PAD,), dtype, sentinel)
    return whole, whole[PAD:PAD + n]


def _check_guards(label, whole, n, sentinel):
    from harness.library.buffers import assert_untouched

    assert_untouched(f"{label}: guard before the output", whole[:PAD], sentinel)
    assert_untouched(f"{label}: guard past the output", whole[PAD + n:], sentinel)


@pytest.mark.gpu
@pytest.mark.anchor
@pytest.mark.memory_safety  # the guard zones around the output: a write outside it faulting is this gate's verdict
@pytest.mark.parametrize("vectorised", [False, True], ids=["scalar", "vec"])
@pytest.mark.parametrize("n", SIZES)
def test_scale_writes_every_element_once_and_nothing_around_it(n, vectorised):
    import cupy

    from harness.library.buffers import BF16_SENTINEL

    # Position-dependent exact values: (i mod 251) / 8, a period prime to every block size
    # (bf16 holds each, doubling is exact), so an element written from its neighbour shows.
    host = to_bf16((np.arange(n) % 251 / 8).astype(np.float32))
    whole, out = _guarded_out(n, np.uint16, BF16_SENTINEL)
    x = cupy.asarray(host.view(np.uint16))
    demo.run_scale(out, x, 2.0, vectorised=vectorised)
    label = f"demo_scale{'_vec' if vectorised else ''} n={n}"
    assert_bits_eq(label, out.get().view(host.dtype), to_bf16(host.astype(np.float32) * 2))
    _check_guards(label, whole, n, BF16_SENTINEL)


@pytest.mark.gpu
@pytest.mark.anchor
def test_gather_over_several_blocks_lands_each_index_in_its_own_slot():
    import cupy

    m, n = 3 * demo.BLOCK - 1, 1000  # three blocks, the last all but full: a stride one short misses the end
    idx = np.random.default_rng(7).permutation(n)[:m].astype(np.int32)
    x = np.arange(n, dtype=np.float32) + 0.5
    sentinel = 0x7FC0_0A5A
    whole, out = _guarded_out(m, np.float32, sentinel)
    # idx is a view of an allocation one block longer holding valid indices: a thread past m
    # (a tail guard one too loose) reads a defined index and its store lands in the guard zone,
    # named by assertion, instead of reading whatever lies past the array and tripping the guard.
    idx_dev = cupy.asarray(np.concatenate([idx, np.arange(demo.BLOCK, dtype=np.int32) % n]))[:m]
    demo.run_gather(out, cupy.asarray(x), idx_dev)
    assert_bits_eq(f"gather m={m}", out, x[idx])
    _check_guards(f"gather m={m}", whole, m, sentinel)


@pytest.mark.gpu
@pytest.mark.invariance
def test_a_scaled_row_has_its_bits_in_every_batch_eager_and_replayed_from_a_cuda_graph():
    # CUDA-graph replay as a launch variant (harness.library.graphs): each batch is launched
    # eagerly, then from a graph captured once a batch size, with the batch's rows copied into
    # the captured buffers. Rows of 250 bf16 (a batch of 5 is 1250: one block's tail, the vector
    # kernel's partial last vector); the replayed bits must be the eager row-alone bits.
    import cupy

    from harness.library.graphs import GraphReplay, eager_and_graph
    from harness.library.invariance import assert_batch_invariant

    rows = to_bf16(np.arange(8 * 250, dtype=np.float32).reshape(8, 250) / 8 - 100)
    replay = GraphReplay("demo_scale out")

    def run(ids, variant):
        vectorised, mode = variant
        x = cupy.asarray(np.ascontiguousarray(rows[ids]).reshape(-1))
        out = cupy.zeros(x.shape, dtype=x.dtype)
        replay(mode, vectorised, lambda x, out: demo.run_scale(out, x, 2.0, vectorised=vectorised), x=x, out=out)
        return out.reshape(len(ids), -1)

    assert_batch_invariant("demo_scale out", run, (0, 3, 7), batch_sizes=(1, 2, 5),
                           variants=eager_and_graph({"scalar": False, "vector of 4": True}), fillers=(1, 2))
    assert replay.captures == 6 and replay.replays > replay.captures, (replay.captures, replay.replays)
