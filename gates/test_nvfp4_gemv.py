"""NVFP4 W4A16 decode GEMV: the base kernel anchored on host decodes, the single-warp
kernel linked to it bit for bit, and every output written exactly once below N."""

from __future__ import annotations

import numpy as np
import pytest

from gates._quant_gemv import SENTINEL, TAIL, nvfp4_to_device, run_nvfp4, run_nvfp4_far_rows, shaped
from harness import assert_bits_eq
from harness.library.buffers import INDEX_32, assert_untouched, device_memory
from harness.library.dtypes import bits_of
from harness.library.source import define_int
from harness.library.sweep import Dim, Preset, ShapeSpace, assert_named_shapes_accepted, sweep
from kernels_cu import nvfp4_gemv
from oracles.quant_gemv import nvfp4_designed, nvfp4_expected, nvfp4_random, nvfp4_sweep_case

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


def assert_both_arms_match(case, n: int, k: int) -> None:
    """Both arms on `case` (uploaded once) against its host decode, bitwise, and nothing past N
    written: the host oracle is most of the cost, so the arms share it."""
    dev = nvfp4_to_device(case)
    expected = nvfp4_expected(case)
    for arm, single_warp in ARMS.items():
        y = run_nvfp4(dev, single_warp=single_warp)
        assert_bits_eq(f"nvfp4_gemv {arm} y[:N] (N={n}, K={k})", y[:n], expected)
        assert_untouched(f"nvfp4_gemv {arm} y[N:] (N={n}, K={k})", y[n:], SENTINEL)


@pytest.mark.gpu
@pytest.mark.anchor
@pytest.mark.parametrize("shape", SWEEP_SHAPES.values(), ids=SWEEP_SHAPES.keys())
def test_both_arms_match_host_decode_over_two_sweeps_and_an_all_tail_k(shape):
    # Exact as the anchor above (nvfp4_designed). The link cannot see a defect in the shared
    # partial dot (both arms call it); one sweep of 64 cannot see the sweep stride; so both
    # arms are anchored here on K with two whole sweeps and on K with no whole sweep.
    n, k = shape
    assert_both_arms_match(nvfp4_designed(n, k, seed=n + k), n, k)


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


# The sweep: both arms over the kernel's shapes. K is swept NVFP4_VLANES groups of 16 at a time
# (1024 elements a sweep): its multiples are the production shapes (K16 a multiple of 64, no
# tail at all: Llama-3's 4096 and 8192, DeepSeek-V3's 2048), one group either side a tail of one
# group or a last sweep one group short. N crosses the blocks of 4 (base) and 8 (single-warp)
# outputs. The bound keeps the host oracle (N * K products, vectorised) within a fraction of a
# second a shape; nvfp4_sweep_case stays exact up to K = 43680, past the space's 32768.
NVFP4_SWEEP_WIDTH = nvfp4_gemv.VLANES * nvfp4_gemv.GROUP
NVFP4_SHAPES = ShapeSpace(
    "nvfp4_gemv",
    (Dim("N", 1, 8192, tile=nvfp4_gemv.N_PER_BLOCK_SW),
     Dim("K", nvfp4_gemv.GROUP, 32768, multiple_of=nvfp4_gemv.GROUP, tile=NVFP4_SWEEP_WIDTH)),
    where=(("the host oracle's N * K at most 2^24", lambda s: s["N"] * s["K"] <= 1 << 24),),
    presets=(
        Preset("Llama-3 8B decode, q_proj", {"N": 4096, "K": 4096},
               "Llama-3-8B config.json: hidden_size 4096 (32 heads of 128)"),
        Preset("Llama-3 8B decode, k_proj", {"N": 1024, "K": 4096},
               "Llama-3-8B config.json: hidden_size 4096, 8 key-value heads of 128"),
        Preset("Llama-3 70B decode, k_proj", {"N": 1024, "K": 8192},
               "Llama-3-70B config.json: hidden_size 8192, 8 key-value heads of 128"),
        Preset("DeepSeek-V3 routed expert, down_proj", {"N": 7168, "K": 2048},
               "DeepSeek-V3 config.json: hidden_size 7168, moe_intermediate_size 2048"),
        Preset("Qwen2.5 7B decode, k_proj", {"N": 512, "K": 3584},
               "Qwen2.5-7B config.json: hidden_size 3584, 4 key-value heads of 128"),
        Preset("gpt-oss-120b decode, q_proj", {"N": 4096, "K": 2880},
               "gpt-oss-120b config.json: hidden_size 2880, 64 heads of head_dim 64"),
    ),
)


def nvfp4_gemv_shape_check(shape):
    n, k = shape["N"], shape["K"]
    assert_both_arms_match(nvfp4_sweep_case(n, k, seed=n + 7 * k), n, k)


@pytest.mark.gpu
@pytest.mark.sweep
def test_both_nvfp4_arms_match_host_decode_over_their_shape_space():
    sweep(NVFP4_SHAPES, nvfp4_gemv_shape_check)


# Past 2^32 weight bytes: N = 2^20 + 8 rows of K = 8192 (Llama-3 70B's hidden_size), 4096 bytes
# a row. The kernels take unsigned sizes, so a row offset `out * (K / 2)` done in 32 bits wraps
# only past 2^32 bytes (row 2^20), to the row out - 2^20. Live rows, in runs of 12: the first
# rows (where such a wrap lands), and rows straddling element 2^31 (byte 2^30, row 2^18), byte
# 2^31 (a signed int's limit, row 2^19) and byte 2^32 (the last 12 rows: 4 before, the last
# block of 8 past). The rest is never written; every arm computes it and the gate ignores it.
BIG_K = 8192
BIG_ROW_BYTES = BIG_K // 2
BIG_PAST = nvfp4_gemv.N_PER_BLOCK_SW  # rows past 2^32 bytes
BIG_N = INDEX_32 * 2 // BIG_ROW_BYTES + BIG_PAST
BIG_RUN = 12
BIG_STARTS = (0, INDEX_32 // 2 // BIG_ROW_BYTES - BIG_RUN // 2, INDEX_32 // BIG_ROW_BYTES - BIG_RUN // 2,
              BIG_N - BIG_RUN)
BIG_SEED = 19
BIG_BYTES = BIG_N * (BIG_ROW_BYTES + BIG_K // nvfp4_gemv.GROUP) + 2 * (BIG_N + TAIL) + 2 * BIG_K


@pytest.mark.memory_safety
@pytest.mark.gpu
@pytest.mark.anchor
def test_both_nvfp4_arms_match_host_decode_on_rows_past_2_32_weight_bytes():
    # nvfp4_sweep_case's rows in the runs above: exact, so each output compares as bits. A row
    # offset that wraps reads one of the first rows (other weights under its own scales) and
    # its output differs by assertion. memory_safety: a wrap that lands off the buffer (a
    # signed product past 2^31 goes before it) faults, and that is this gate's verdict.
    case = nvfp4_sweep_case(BIG_RUN * len(BIG_STARTS), BIG_K, seed=BIG_SEED)
    expected = nvfp4_expected(case)
    rows = [r for start in BIG_STARTS for r in range(start, start + BIG_RUN)]
    for arm, single_warp in ARMS.items():
        with device_memory(BIG_BYTES, f"NVFP4 weights past 2^32 bytes ({BIG_N} rows of K = {BIG_K})"):
            y, tail = run_nvfp4_far_rows(case, BIG_N, BIG_STARTS, single_warp=single_warp)
        assert_bits_eq(f"nvfp4_gemv {arm} y of rows {rows[0]}..{rows[BIG_RUN - 1]}, "
                       + ", ".join(f"{rows[i]}..{rows[i + BIG_RUN - 1]}" for i in range(BIG_RUN, len(rows), BIG_RUN))
                       + f" (the last {BIG_PAST} start past 2^32 weight bytes)", y, expected)
        assert_untouched(f"nvfp4_gemv {arm} y[N:]", tail, SENTINEL)


@pytest.mark.structural
def test_every_preset_and_boundary_of_the_nvfp4_shape_space_is_a_shape_the_launcher_accepts(kernel_root):
    # The space promises shapes the kernel runs: one the launcher refuses is a space declared
    # wrong; so is the big-index gate's shape. And the sweep's width is the kernel's: the
    # launcher's VLANES is nvfp4_dot.cuh's NVFP4_VLANES.
    assert define_int(kernel_root / "nvfp4_dot.cuh", "NVFP4_VLANES") == nvfp4_gemv.VLANES, \
        "kernels_cu/nvfp4_gemv.py VLANES differs from nvfp4_dot.cuh's #define NVFP4_VLANES"
    def accepted(shape):
        n, k = shape["N"], shape["K"]
        args = (shaped((n + TAIL,), np.uint16), shaped((k,), np.uint16), shaped((n, k // 2), np.uint8),
                shaped((n, k // nvfp4_gemv.GROUP), np.uint8))
        assert nvfp4_gemv.check_nvfp4_gemv_args(*args) == (n, k)

    assert_named_shapes_accepted(NVFP4_SHAPES, accepted, extra={"the big-index gate's shape": {"N": BIG_N, "K": BIG_K}})
