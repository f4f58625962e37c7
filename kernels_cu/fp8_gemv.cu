// FP8 GEMV with per-token and per-row scales, several weight segments concatenated along N.
//
//   y[t, n] = bf16(ws[n] * xs[t] * sum_k x[t, k] * w[n, k])      f32 accumulation
//
// x: e4m3 [T, K], xs: f32 [T]; segment s: w_s e4m3 [n_s, K], ws_s f32 [n_s]; y: bf16 [T, sum n_s].
// Unused segments have end == the previous end. One warp an output row for a tile of up to
// FP8_GEMV_TOKENS_PER_BLOCK tokens, 16 e4m3 bytes a lane a step: each uint4 of the row's
// weights is loaded once and dotted with the same uint4 of every live token of the tile, one
// f32 accumulator a token, so a decode step reads its weights once per tile, not once per
// token. Each token's sum is the one a block of that token alone would make: the same fmaf
// sequence a lane, the same warp sum, the same scaling. The Python launcher (fp8_gemv.py) owns
// the grid: (ceil(N / FP8_GEMV_ROWS_PER_BLOCK), ceil(T / FP8_GEMV_TOKENS_PER_BLOCK)) blocks of
// FP8_GEMV_THREADS threads; the last tile of tokens may be partial.
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#define FP8_GEMV_THREADS 256
#define FP8_GEMV_ROWS_PER_BLOCK 8
#define FP8_GEMV_BYTES_PER_LANE 16
#define FP8_GEMV_TOKENS_PER_BLOCK 4

static_assert(FP8_GEMV_ROWS_PER_BLOCK * 32 == FP8_GEMV_THREADS, "one warp an output row");

// The warp's sum in lane 0 (a shift-down tree, as CUB's WarpReduce): the other lanes end with
// partial sums nobody may use. Lane 0's bits are those of the xor butterfly: at offset m it adds
// lane m's value, which is the same partial sum under either pattern.
__device__ __forceinline__ float fp8_gemv_warp_sum(float v)
{
#pragma unroll
    for (int m = 16; m > 0; m >>= 1) v += __shfl_down_sync(0xffffffffu, v, m);
    return v;
}

// Two e4m3 bytes -> two floats (e4m3 is a subset of f16, so the conversion is exact).
__device__ __forceinline__ float2 fp8_gemv_pair(unsigned int bits16)
{
    const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)bits16, __NV_E4M3);
    return __half22float2(__half2(h));
}

// acc + dot of 16 e4m3 activations with 16 e4m3 weights, in element order.
__device__ __forceinline__ float fp8_gemv_dot16(uint4 xa, uint4 wa, float acc)
{
    const unsigned int xw[4] = {xa.x, xa.y, xa.z, xa.w};
    const unsigned int ww[4] = {wa.x, wa.y, wa.z, wa.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 x0 = fp8_gemv_pair(xw[i] & 0xffffu), x1 = fp8_gemv_pair(xw[i] >> 16);
        const float2 w0 = fp8_gemv_pair(ww[i] & 0xffffu), w1 = fp8_gemv_pair(ww[i] >> 16);
        acc = fmaf(x0.x, w0.x, acc);
        acc = fmaf(x0.y, w0.y, acc);
        acc = fmaf(x1.x, w1.x, acc);
        acc = fmaf(x1.y, w1.y, acc);
    }
    return acc;
}

extern "C" __global__ void __launch_bounds__(FP8_GEMV_THREADS)
fp8_gemv(__nv_bfloat16* __restrict__ y,
         const unsigned char* __restrict__ x, const float* __restrict__ xs,
         const unsigned char* __restrict__ w0, const float* __restrict__ ws0, int end0,
         const unsigned char* __restrict__ w1, const float* __restrict__ ws1, int end1,
         const unsigned char* __restrict__ w2, const float* __restrict__ ws2, int end2,
         int T, int K)
{
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int n = blockIdx.x * FP8_GEMV_ROWS_PER_BLOCK + warp;
    const int t0 = blockIdx.y * FP8_GEMV_TOKENS_PER_BLOCK;  // the tile's first token
    if (n >= end2) return;  // end2 is the total N
    // The tile's live tokens: all FP8_GEMV_TOKENS_PER_BLOCK but in a partial last tile.
    const int tokens = T - t0 < FP8_GEMV_TOKENS_PER_BLOCK ? T - t0 : FP8_GEMV_TOKENS_PER_BLOCK;

    const unsigned char* w;
    const float* ws;
    int row;
    if (n < end0) {
        w = w0; ws = ws0; row = n;
    } else if (n < end1) {
        w = w1; ws = ws1; row = n - end0;
    } else {
        w = w2; ws = ws2; row = n - end1;
    }

    const uint4* xr = reinterpret_cast<const uint4*>(x + (long long)t0 * K);
    const uint4* wr = reinterpret_cast<const uint4*>(w + (long long)row * K);
    const int chunks = K / FP8_GEMV_BYTES_PER_LANE;
    float accs[FP8_GEMV_TOKENS_PER_BLOCK] = {};  // this lane's sum for each token of the tile, from +0
    for (int c = lane; c < chunks; c += 32) {
        const uint4 wc = __ldg(wr + c);
#pragma unroll
        for (int j = 0; j < FP8_GEMV_TOKENS_PER_BLOCK; ++j)
            if (j < tokens) accs[j] = fp8_gemv_dot16(__ldg(xr + j * chunks + c), wc, accs[j]);
    }
#pragma unroll
    for (int j = 0; j < FP8_GEMV_TOKENS_PER_BLOCK; ++j) {
        if (j < tokens) {  // block-uniform: every lane takes part in the warp sum
            const int t = t0 + j;
            const float acc = fp8_gemv_warp_sum(accs[j]);
            if (lane == 0) y[(long long)t * end2 + n] = __float2bfloat16_rn(ws[row] * xs[t] * acc);
        }
    }
}
