"""The staged-table claims (gates/_nvfp4_table.py) on small sources: quiet on the canonical
stage, one problem naming the kernel and line on each broken form."""

from __future__ import annotations

from gates._nvfp4_table import publish_problems, staging_problems

HEADER = "__constant__ float E2M1_LUT[16] = {0};\n"

BLOCK = """extern "C" __global__ void k(float* y)
{
    __shared__ float s_lut[16];
    const unsigned int tid = threadIdx.x;
    if (tid < 16u) s_lut[tid] = E2M1_LUT[tid];
    __syncthreads();
    y[tid] = nvfp4_partial(0, 0, 0, 1u, tid, s_lut);
}
"""

WARP = """__device__ void stage(float* __restrict__ row, unsigned int lane)
{
    if (lane < 16u) row[lane] = E2M1_LUT[lane];
    __syncwarp();
}
extern "C" __global__ void k(float* y)
{
    __shared__ float s_lut[8][16];
    const unsigned int warp = threadIdx.x >> 5, lane = threadIdx.x & 31u;
    stage(s_lut[warp], lane);
    const float lo = nvfp4_partial(0, 0, 0, 1u, lane, s_lut[warp]);
    const float hi = nvfp4_partial(0, 0, 0, 1u, lane + 32u, s_lut[warp]);
    y[warp] = lo + hi;
}
"""


def problems(src: str) -> list[str]:
    return publish_problems(HEADER, src, "k.cu", ("k",), ("k",)) + staging_problems(HEADER, src, ("k",))


def test_the_canonical_block_and_warp_stages_hold_both_claims():
    assert problems(BLOCK) == []
    assert problems(WARP) == []


def test_a_block_stage_without_its_barrier_before_the_first_read_is_named():
    # A barrier later (after another read) does not publish the table to the first reader.
    src = BLOCK.replace("    __syncthreads();\n    y[tid] = nvfp4_partial",
                        "    y[0] = s_lut[1];\n    __syncthreads();\n    y[tid] = nvfp4_partial")
    found = problems(src)
    assert len(found) == 1 and found[0].startswith("k (k.cu line 8): nvfp4_partial(..., s_lut) reads the table k stores, "
                                                   "without a barrier"), found


def test_a_warp_stage_without_its_syncwarp_is_named():
    found = problems(WARP.replace("    __syncwarp();\n", ""))
    assert len(found) == 2 and all("reads the table stage stores, without a barrier" in p for p in found), found


def test_a_warp_reading_another_warps_row_is_named():
    found = problems(WARP.replace("lane + 32u, s_lut[warp]", "lane + 32u, s_lut[0]"))
    assert found == ["k (k.cu line 12): nvfp4_partial(..., s_lut[0]) reads a table this warp never staged before the call"]


def test_a_stage_wider_or_narrower_than_16_entries_or_from_another_index_is_named():
    for old, new in (("lane < 16u", "lane < 32u"), ("lane < 16u", "lane <= 16u"), ("lane < 16u", "true"),
                     ("row[lane] = E2M1_LUT[lane]", "row[lane] = E2M1_LUT[0]")):
        found = staging_problems(HEADER, WARP.replace(old, new), ("k",))
        assert len(found) == 1 and found[0].startswith("k: the table is staged by `if ("), (old, new, found)
