"""NVFP4 W4A16 decode GEMV: the base kernel anchored on host decodes, the single-warp
kernel linked to it bit for bit, and every output written exactly once below N."""

from __future__ import annotations

import numpy as np
import pytest

from gates._quant_gemv import SENTINEL, TAIL, nvfp4_to_device, run_nvfp4
from harness import assert_bits_eq
from harness.library.buffers import assert_untouched
from harness.library.dtypes import bits_of
from kernels_cu import nvfp4_gemv
from oracles.quant_gemv import nvfp4_designed, nvfp4_expected, nvfp4_random

# N = 301: not a multiple of 4 or 8, so the last block of either kernel is partial.
# K = 1616: 101 groups of 16 = one whole sweep of 64 virtual lanes and a tail of 37.
N, K = 301, 1616
# (N, K) of the link: the shape above, and one whose K is all tail (3 groups) with N = 13.
LINK_SHAPES = {"N301-K1616": (301, 1616), "N13-K48": (13, 48)}
ARMS = {"base": False, "sw": True}
# (N, K) of the second anchor: K16 = 165 is two whole sweeps of 64 and a
# tail of 37 (the sweep loop runs twice, so its stride shows); K16 = 3 is all tail; N 37 and 13
# are multiples of neither 4 nor 8.
SWEEP_SHAPES = {"N37-K2640": (37, 2640), "N13-K48": (13, 48)}


@pytest.fixture(scope="module")
def designed():
    case = nvfp4_designed(N, K, seed=6)
    return case, nvfp4_to_device(case)


@pytest.mark.gpu
@pytest.mark.anchor
def test_nvfp4_base_matches_host_decode_on_exact_inputs(designed):
    # Exact, no tolerance: nvfp4_designed makes every f32 partial sum exact in any order,
    # so bf16(gs * sum) is the only rounding on both sides.
    case, dev = designed
    y = run_nvfp4(dev, single_warp=False)
    assert_bits_eq("nvfp4_gemv y[:N]", y[:N], nvfp4_expected(case))
    assert_untouched("nvfp4_gemv y[N:]", y[N:], SENTINEL)


@pytest.mark.gpu
@pytest.mark.anchor
@pytest.mark.parametrize("shape", SWEEP_SHAPES.values(), ids=SWEEP_SHAPES.keys())
def test_both_arms_match_host_decode_over_two_sweeps_and_an_all_tail_k(shape):
    # Exact as the anchor above (nvfp4_designed). The link cannot see a defect in the shared
    # partial dot (both arms call it); one sweep of 64 cannot see the sweep stride; so both
    # arms are anchored here on K with two whole sweeps and on K with no whole sweep.
    n, k = shape
    case = nvfp4_designed(n, k, seed=n + k)
    dev = nvfp4_to_device(case)
    expected = nvfp4_expected(case)
    for arm, single_warp in ARMS.items():
        y = run_nvfp4(dev, single_warp=single_warp)
        assert_bits_eq(f"nvfp4_gemv {arm} y[:N] (N={n}, K={k})", y[:n], expected)
        assert_untouched(f"nvfp4_gemv {arm} y[N:]", y[n:], SENTINEL)


@pytest.mark.gpu
@pytest.mark.link
@pytest.mark.parametrize("shape", LINK_SHAPES.values(), ids=LINK_SHAPES.keys())
def test_single_warp_equals_base_bitwise(shape):
    # Bitwise: both kernels call nvfp4_partial for the same 64 virtual lanes and
    # nvfp4_warp_sum for the same two halves, then add the halves in the same order.
    n, k = shape
    dev = nvfp4_to_device(nvfp4_random(n, k, seed=n + k))
    base = run_nvfp4(dev, single_warp=False)
    assert_untouched("base y[N:]", base[n:], SENTINEL)
    assert_bits_eq("single-warp y (tail included)", run_nvfp4(dev, single_warp=True), base)


@pytest.mark.memory_safety
@pytest.mark.gpu
@pytest.mark.link
@pytest.mark.parametrize("single_warp", ARMS.values(), ids=ARMS.keys())
def test_every_output_below_n_is_written_and_none_past_it(designed, single_warp):
    # Memory safety: no output store lands outside y[0, N). A store past N lands in the
    # sentinel tail and is named by assertion; a store below y[0] cannot be: the output index
    # is unsigned, so `out - 1` at out = 0 wraps to y + 2^32 - 1 elements (8 GB away) and
    # faults. That fault is this gate's verdict (docs/mutation.md, Verdicts).
    _, dev = designed
    y = run_nvfp4(dev, single_warp=single_warp)
    assert_untouched(f"y[{N}:{N + TAIL}] past N", y[N:], SENTINEL)
    unwritten = np.flatnonzero(bits_of(y[:N]) == SENTINEL)
    assert unwritten.size == 0, (
        f"{unwritten.size} of {N} outputs below N still hold the sentinel 0x{SENTINEL:04x} "
        f"(first at index {unwritten[:8].tolist()}): the grid or the kernel's output mapping skips them"
    )


@pytest.mark.refusal
def test_k_not_a_multiple_of_16_is_refused_before_launch():
    with pytest.raises(ValueError, match="not a positive multiple of 16"):
        nvfp4_gemv.check_nvfp4_gemv_args(np.empty(8, np.uint16), np.empty(40, np.uint16),
                                         np.empty((8, 20), np.uint8), np.empty((8, 2), np.uint8))


@pytest.mark.refusal
def test_scales_of_the_wrong_shape_are_refused_before_launch():
    with pytest.raises(ValueError, match=r"s has shape \(8, 2\), expected \(8, 3\)"):
        nvfp4_gemv.check_nvfp4_gemv_args(np.empty(8, np.uint16), np.empty(48, np.uint16),
                                         np.empty((8, 24), np.uint8), np.empty((8, 2), np.uint8))


@pytest.mark.refusal
def test_an_output_shorter_than_n_is_refused_before_launch():
    with pytest.raises(ValueError, match="allocate a 1-D y of at least N"):
        nvfp4_gemv.check_nvfp4_gemv_args(np.empty(7, np.uint16), np.empty(48, np.uint16),
                                         np.empty((8, 24), np.uint8), np.empty((8, 3), np.uint8))
