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
// Both call nvfp4_partial (one association order) and nvfp4_warp_sum (one butterfly), so the
// SW result equals the base result bitwise. The e2m1 table is staged in shared memory (per
// warp in SW): indexing __constant__ memory with data-dependent nibbles would serialise a
// warp, one replay per distinct address. The Python launcher (nvfp4_gemv.py) owns the grids:
// ceil(N / N_PER_BLOCK) and ceil(N / N_PER_BLOCK_SW) blocks.
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#define N_PER_BLOCK 4
#define N_PER_BLOCK_SW 8
#define NVFP4_THREADS 256
#define NVFP4_VLANES 64
#define NVFP4_GROUP 16

static_assert(N_PER_BLOCK * NVFP4_VLANES == NVFP4_THREADS, "base: 64 threads an output");

__constant__ float E2M1_LUT[16] = {
    0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
    -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f,
};

__device__ __forceinline__ float nvfp4_warp_sum(float v)
{
#pragma unroll
    for (int m = 16; m > 0; m >>= 1) v += __shfl_xor_sync(0xffffffffu, v, m);
    return v;
}

// acc + e4m3(scale) * (sum of the 16 products of group g, in element order).
__device__ __forceinline__ float nvfp4_group(const unsigned char* __restrict__ wrow,
                                             const unsigned char* __restrict__ srow,
                                             const __nv_bfloat16* __restrict__ x,
                                             unsigned int g, const float* __restrict__ lut, float acc)
{
    const uint2 wq = __ldg(reinterpret_cast<const uint2*>(wrow) + g);
    const uint4* xg = reinterpret_cast<const uint4*>(x) + 2u * g;
    const uint4 xa = __ldg(xg), xb = __ldg(xg + 1);
    const unsigned int xw[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
    const unsigned int ww[2] = {wq.x, wq.y};
    float gsum = 0.f;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const float2 xv = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&xw[i]));
        const unsigned int byte_val = (ww[i >> 2] >> ((i & 3) * 8)) & 0xffu;
        gsum = fmaf(xv.x, lut[byte_val & 0xfu], gsum);
        gsum = fmaf(xv.y, lut[byte_val >> 4], gsum);
    }
    const float scale = __half2float(__half(__nv_cvt_fp8_to_halfraw(srow[g], __NV_E4M3)));
    return fmaf(gsum, scale, acc);
}

// The partial dot of virtual lane v over one weight row: whole sweeps, then the K tail.
__device__ __forceinline__ float nvfp4_partial(const unsigned char* __restrict__ wrow,
                                               const unsigned char* __restrict__ srow,
                                               const __nv_bfloat16* __restrict__ x,
                                               unsigned int k16, unsigned int v,
                                               const float* __restrict__ lut)
{
    const unsigned int full = k16 - k16 % NVFP4_VLANES;  // groups in whole sweeps of 64
    float acc = 0.f;
    for (unsigned int g = v; g < full; g += NVFP4_VLANES) acc = nvfp4_group(wrow, srow, x, g, lut, acc);
    if (v < k16 - full) acc = nvfp4_group(wrow, srow, x, full + v, lut, acc);
    return acc;
}

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
