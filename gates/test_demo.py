"""Demonstration gates: an anchor, a link, a refusal and a trap gate over kernels_cu/demo.cu."""

import numpy as np
import pytest

from harness import assert_bits_eq
from harness.dtypes import to_bf16
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
def test_gather_in_bounds_after_a_trap_gate():
    """Runs after the trap gate: its verdict must not be poisoned by it."""
    import cupy

    x = cupy.arange(8, dtype=cupy.float32)
    idx = cupy.asarray([7, 0, 3], dtype=cupy.int32)
    out = cupy.zeros(3, dtype=cupy.float32)
    demo.run_gather(out, x, idx)
    assert_bits_eq("out", out, np.asarray([7, 0, 3], dtype=np.float32))
