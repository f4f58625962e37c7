// The NVFP4 partial dot, shared by every kernel that multiplies NVFP4 weights with bf16
// activations (nvfp4_gemv.cu, moe_decode.cu): one association order, one warp reduction.
//
// A weight row is e2m1 [K / 2] bytes (two a byte, low nibble first) with e4m3 block scales
// [K / 16]; x is bf16 [K], 16-byte aligned, in global or shared memory. An output's K16
// groups are spread over NVFP4_VLANES = 64 "virtual lanes": lane v owns groups v, v + 64, ...
// and adds them in that order (the last sweep, the K tail, reaches only v < K16 % 64).
// Callers sum the 64 partials as two warp reductions (nvfp4_warp_sum, each half's sum in its
// lane 0) and add the halves, low half first, then round bf16(gs * (lo + hi)).
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#define NVFP4_VLANES 64
#define NVFP4_GROUP 16

__constant__ float E2M1_LUT[16] = {
    0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f,
    -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f,
};

// The warp's sum in lane 0 (a shift-down tree, as CUB's WarpReduce); the other lanes hold
// partial sums, so only lane 0 may store it. Lane 0's bits are the xor butterfly's: at offset m
// it adds lane m's partial, the same under both patterns.
__device__ __forceinline__ float nvfp4_warp_sum(float v)
{
#pragma unroll
    for (int m = 16; m > 0; m >>= 1) v += __shfl_down_sync(0xffffffffu, v, m);
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
    const uint4 xa = xg[0], xb = xg[1];  // plain loads: x may be global or staged in shared
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
