// NVFP4 W4A16 decode GEMV (M = 1), two kernels that agree bit for bit.
//
//   y[n] = bf16(gs * sum_k x[k] * e2m1(w[n, k]) * e4m3(s[n, k / 16]))      f32 accumulation
//
// w: e2m1 [N, K / 2] bytes, two a byte, low nibble first; s: e4m3 [N, K / 16]; gs: f32;
// x: bf16 [K]; y: bf16 [N]. K is a multiple of 16 (one block scale a group of 16).
//
// Both kernels give an output NVFP4_VLANES = 64 "virtual lanes"; virtual lane v owns the
// K16 groups v, v + 64, ... (the last sweep, the K tail, reaches only v < K16 % 64).
//   base nvfp4_gemv:   256 threads, N_PER_BLOCK outputs a block, 64 threads (2 warps) an
//                      output; each warp sums its 32 partials, the two halves meet in shared.
//   SW nvfp4_gemv_sw:  one warp an output, N_PER_BLOCK_SW outputs a block; lane l plays
//                      virtual lanes l and l + 32, sums each half like a base warp, adds them.
// Both call nvfp4_partial (one association order, nvfp4_dot.cuh) and nvfp4_warp_sum (one warp reduction), so the
// SW result equals the base result bitwise. The e2m1 table is staged in shared memory (per
// warp in SW): indexing __constant__ memory with data-dependent nibbles would serialise a
// warp, one replay per distinct address. The Python launcher (nvfp4_gemv.py) owns the grids:
// ceil(N / N_PER_BLOCK) and ceil(N / N_PER_BLOCK_SW) blocks.
#include "nvfp4_dot.cuh"

#define N_PER_BLOCK 4
#define N_PER_BLOCK_SW 8
#define NVFP4_THREADS 256

static_assert(N_PER_BLOCK * NVFP4_VLANES == NVFP4_THREADS, "base: 64 threads an output");

// One warp's private copy of the table; published to the warp only.
__device__ __forceinline__ void nvfp4_stage_lut_warp(float* __restrict__ warp_lut, unsigned int lane)
{
    if (lane < 16u) warp_lut[lane] = E2M1_LUT[lane];
    __syncwarp();
}

extern "C" __global__ void __launch_bounds__(NVFP4_THREADS)
nvfp4_gemv(__nv_bfloat16* __restrict__ y, const __nv_bfloat16* __restrict__ x,
           const unsigned char* __restrict__ w, const unsigned char* __restrict__ s,
           float gs, unsigned int N, unsigned int K)
{
    __shared__ float s_lut[16];
    __shared__ float s_half[N_PER_BLOCK][2];
    const unsigned int tid = threadIdx.x;
    const unsigned int o = tid / NVFP4_VLANES, v = tid % NVFP4_VLANES;
    const unsigned int out = blockIdx.x * N_PER_BLOCK + o;
    if (tid < 16u) s_lut[tid] = E2M1_LUT[tid];
    __syncthreads();

    const unsigned int k16 = K / NVFP4_GROUP;
    float part = 0.f;
    if (out < N)
        part = nvfp4_partial(w + (unsigned long long)out * (K / 2u), s + (unsigned long long)out * k16, x, k16, v, s_lut);
    part = nvfp4_warp_sum(part);
    if ((tid & 31u) == 0u) s_half[o][v >> 5] = part;
    __syncthreads();
    if (v == 0u && out < N) y[out] = __float2bfloat16_rn(gs * (s_half[o][0] + s_half[o][1]));
}

extern "C" __global__ void __launch_bounds__(N_PER_BLOCK_SW * 32)
nvfp4_gemv_sw(__nv_bfloat16* __restrict__ y, const __nv_bfloat16* __restrict__ x,
              const unsigned char* __restrict__ w, const unsigned char* __restrict__ s,
              float gs, unsigned int N, unsigned int K)
{
    __shared__ float s_lut[N_PER_BLOCK_SW][16];
    const unsigned int warp = threadIdx.x >> 5, lane = threadIdx.x & 31u;
    const unsigned int out = blockIdx.x * N_PER_BLOCK_SW + warp;
    if (out >= N) return;  // warp-uniform, not block-uniform: no block barrier may follow
    nvfp4_stage_lut_warp(s_lut[warp], lane);

    const unsigned int k16 = K / NVFP4_GROUP;
    const unsigned char* wrow = w + (unsigned long long)out * (K / 2u);
    const unsigned char* srow = s + (unsigned long long)out * k16;
    const float lo = nvfp4_warp_sum(nvfp4_partial(wrow, srow, x, k16, lane, s_lut[warp]));
    const float hi = nvfp4_warp_sum(nvfp4_partial(wrow, srow, x, k16, lane + 32u, s_lut[warp]));
    if (lane == 0u) y[out] = __float2bfloat16_rn(gs * (lo + hi));
}
