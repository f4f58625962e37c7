// lm_head argmax with soft-capping and an excluded token id.
//
//   logit[t, v] = rs[v] * dot(h[t], E[v])                         f32 accumulation
//   softcap > 0: logit = softcap * tanh(logit / softcap)
//   idx[t], val[t] = argmax over v != excluded (ties go to the lowest index), f32 value
//
// h: bf16 [T, H]; E: e4m3 [V, H]; rs: f32 [V]. Two kernels:
//   lm_head_partial: grid (ceil(V / LM_HEAD_ROWS_PER_BLOCK), T); each warp scores
//     LM_HEAD_ROWS_PER_WARP vocab rows in increasing order (8 e4m3 + 8 bf16 a lane a step),
//     the block keeps its best (value, index) in part_val / part_idx [T, blocks].
//   lm_head_reduce: grid (T); one block reduces a row's partials.
// The Python launcher (lm_head.py) owns both grids and the scratch.
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#define LM_HEAD_THREADS 256
#define LM_HEAD_ROWS_PER_WARP 8
#define LM_HEAD_ROWS_PER_BLOCK 64
#define LM_HEAD_H_PER_LANE 8
#define LM_HEAD_NO_INDEX 0x7fffffff

static_assert(LM_HEAD_ROWS_PER_BLOCK == LM_HEAD_ROWS_PER_WARP * (LM_HEAD_THREADS / 32), "rows a block");

// (va, ia) beats (vb, ib): a larger value, or an equal value at a lower index. NaN never wins.
__device__ __forceinline__ bool lm_head_better(float va, int ia, float vb, int ib)
{
    return va > vb || (va == vb && ia < ib);
}

// The warp's sum in lane 0 (a shift-down tree): the other lanes hold partial sums, used by no
// store. Lane 0's bits are the xor butterfly's (at offset m it adds lane m's partial, the same
// under both patterns).
__device__ __forceinline__ float lm_head_warp_sum(float v)
{
#pragma unroll
    for (int m = 16; m > 0; m >>= 1) v += __shfl_down_sync(0xffffffffu, v, m);
    return v;
}

// Lane 0 ends with the warp's best (value, index); the other lanes with the best of a part.
__device__ __forceinline__ void lm_head_warp_best(float& v, int& i)
{
#pragma unroll
    for (int m = 16; m > 0; m >>= 1) {
        const float ov = __shfl_down_sync(0xffffffffu, v, m);
        const int oi = __shfl_down_sync(0xffffffffu, i, m);
        if (lm_head_better(ov, oi, v, i)) { v = ov; i = oi; }
    }
}

// acc + dot of 8 bf16 activations with 8 e4m3 embedding values, in element order.
__device__ __forceinline__ float lm_head_dot8(uint4 ha, uint2 ea, float acc)
{
    const unsigned int hw[4] = {ha.x, ha.y, ha.z, ha.w};
    const unsigned int ew[2] = {ea.x, ea.y};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 hv = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&hw[i]));
        const unsigned int e2 = (ew[i >> 1] >> ((i & 1) * 16)) & 0xffffu;
        const float2 ev = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)e2, __NV_E4M3)));
        acc = fmaf(hv.x, ev.x, acc);
        acc = fmaf(hv.y, ev.y, acc);
    }
    return acc;
}

__device__ __forceinline__ float lm_head_cap(float logit, float softcap)
{
    return softcap > 0.f ? softcap * tanhf(logit / softcap) : logit;
}

extern "C" __global__ void __launch_bounds__(LM_HEAD_THREADS)
lm_head_partial(float* __restrict__ part_val, int* __restrict__ part_idx,
                const __nv_bfloat16* __restrict__ h, const unsigned char* __restrict__ E,
                const float* __restrict__ rs, int V, int H, int excluded, float softcap)
{
    __shared__ float s_val[LM_HEAD_THREADS / 32];
    __shared__ int s_idx[LM_HEAD_THREADS / 32];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int t = blockIdx.y;
    const int steps = H / LM_HEAD_H_PER_LANE;
    const uint4* hr = reinterpret_cast<const uint4*>(h + (long long)t * H);

    float best = __int_as_float(0xff800000);  // -inf
    int best_i = LM_HEAD_NO_INDEX;
    const int first = blockIdx.x * LM_HEAD_ROWS_PER_BLOCK + warp * LM_HEAD_ROWS_PER_WARP;
    for (int j = 0; j < LM_HEAD_ROWS_PER_WARP; ++j) {
        const int v = first + j;
        if (v >= V) break;  // warp-uniform
        const uint2* er = reinterpret_cast<const uint2*>(E + (long long)v * H);
        float acc = 0.f;
        for (int c = lane; c < steps; c += 32) acc = lm_head_dot8(__ldg(hr + c), __ldg(er + c), acc);
        const float logit = lm_head_cap(rs[v] * lm_head_warp_sum(acc), softcap);
        if (v != excluded && lm_head_better(logit, v, best, best_i)) { best = logit; best_i = v; }
    }
    if (lane == 0) { s_val[warp] = best; s_idx[warp] = best_i; }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < LM_HEAD_THREADS / 32; ++w)
            if (lm_head_better(s_val[w], s_idx[w], best, best_i)) { best = s_val[w]; best_i = s_idx[w]; }
        part_val[(long long)t * gridDim.x + blockIdx.x] = best;
        part_idx[(long long)t * gridDim.x + blockIdx.x] = best_i;
    }
}

extern "C" __global__ void __launch_bounds__(LM_HEAD_THREADS)
lm_head_reduce(int* __restrict__ idx, float* __restrict__ val,
               const float* __restrict__ part_val, const int* __restrict__ part_idx, int blocks)
{
    __shared__ float s_val[LM_HEAD_THREADS / 32];
    __shared__ int s_idx[LM_HEAD_THREADS / 32];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int t = blockIdx.x;
    float best = __int_as_float(0xff800000);  // -inf
    int best_i = LM_HEAD_NO_INDEX;
    for (int b = threadIdx.x; b < blocks; b += LM_HEAD_THREADS) {
        const float v = part_val[(long long)t * blocks + b];
        const int i = part_idx[(long long)t * blocks + b];
        if (lm_head_better(v, i, best, best_i)) { best = v; best_i = i; }
    }
    lm_head_warp_best(best, best_i);
    if (lane == 0) { s_val[warp] = best; s_idx[warp] = best_i; }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < LM_HEAD_THREADS / 32; ++w)
            if (lm_head_better(s_val[w], s_idx[w], best, best_i)) { best = s_val[w]; best_i = s_idx[w]; }
        idx[t] = best_i;
        val[t] = best;
    }
}
