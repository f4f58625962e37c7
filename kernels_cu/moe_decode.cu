// NVFP4 MoE decode: a decoder layer's MoE half for T <= 8 tokens, one kernel a stage.
//
//   moe_post_attn  mid = bf16(x + rmsnorm(o) * w_pa); n = rmsnorm(mid):
//                  rr = bf16(n * w_router); fq/fs = e4m3 dense input; gq/gsc = NVFP4 MoE input
//   moe_router     logit[t, e] = f32(pes[e]) * dot(rr[t], Wr[e]); the last CTA (ticket) takes
//                  the top K (ties to the lowest id) and the softmax of the K selected logits
//   moe_glu        g/u = the certified NVFP4 GEMV of expert ids[t, k] against the dequantized
//                  activation; a = gelu_tanh(g) * u quantized to NVFP4 (hq, hs)
//   moe_down       opair[t, k] = the same GEMV of the expert's down weights against hq * hs * act_h
//   moe_final      out = bf16((mid + rmsnorm(dense) * w_d + rmsnorm(sum_k wts * opair) * w_m) * ls)
//   moe_glu_quant_ref  the GLU + quantizer device functions alone, on given g/u (the reference
//                  arm the glu link compares hq/hs with)
//
// Slots: token t's k-th expert is slot t * kcap + k of ids, wts, hq, hs and opair (kcap >= K
// slots a token; slots K..kcap-1 are never written). Expert e's weights live at
// store = table[e] of the expert arrays; ids and table entries outside [0, E) trap.
// The GEMV rows of glu and down are computed exactly as nvfp4_gemv's base kernel computes an
// output: 64 virtual lanes (nvfp4_partial, nvfp4_dot.cuh), two warp reductions, the halves
// added low first, bf16(gs * sum). The launcher (moe_decode.py) owns every grid.
#include "nvfp4_dot.cuh"

#define MOE_THREADS 256       // post_attn, glu, down, final: threads a block
#define MOE_ROUTER_WARPS 8    // router: experts a block, one warp an expert
#define MOE_GLU_ROWS 16       // glu: expert-width rows a block (one NVFP4 block of a), gate and up
#define MOE_DOWN_ROWS 16      // down: hidden rows a block
#define MOE_MAX_T 8
#define MOE_MAX_K 8
#define MOE_MAX_E 256

static_assert(MOE_THREADS % NVFP4_VLANES == 0, "whole 64-lane rows a pass");
static_assert(MOE_GLU_ROWS == NVFP4_GROUP, "a glu block quantizes one NVFP4 block of a");
static_assert((2 * MOE_GLU_ROWS) % (MOE_THREADS / NVFP4_VLANES) == 0, "glu rows in whole passes");
static_assert(MOE_DOWN_ROWS % (MOE_THREADS / NVFP4_VLANES) == 0, "down rows in whole passes");
static_assert(MOE_MAX_E <= 32 * 8, "router top-K keeps 8 logits a lane");

#define MOE_ROWS_PER_PASS (MOE_THREADS / NVFP4_VLANES)

__device__ __forceinline__ float moe_f(__nv_bfloat16 v) { return __bfloat162float(v); }

__device__ __forceinline__ float moe_e4m3_value(unsigned char b)
{
    return __half2float(__half(__nv_cvt_fp8_to_halfraw(b, __NV_E4M3)));
}

// Deterministic block reductions: each warp's shift-down tree into its lane 0, which alone
// holds the warp's result and stores it, then every thread adds the warp results in warp order. `red` holds one float a warp; the leading barrier makes it reusable.
__device__ __forceinline__ float moe_block_sum(float v, float* red)
{
    v = nvfp4_warp_sum(v);
    __syncthreads();
    if ((threadIdx.x & 31u) == 0u) red[threadIdx.x >> 5] = v;
    __syncthreads();
    float s = 0.f;
    for (unsigned int w = 0; w < blockDim.x / 32u; ++w) s += red[w];
    return s;
}

__device__ __forceinline__ float moe_block_max(float v, float* red)
{
#pragma unroll
    for (int m = 16; m > 0; m >>= 1) v = fmaxf(v, __shfl_down_sync(0xffffffffu, v, m));
    __syncthreads();
    if ((threadIdx.x & 31u) == 0u) red[threadIdx.x >> 5] = v;
    __syncthreads();
    float s = 0.f;
    for (unsigned int w = 0; w < blockDim.x / 32u; ++w) s = fmaxf(s, red[w]);
    return s;
}

// rmsnorm's factor from the sum of squares of n values: rsqrt(mean(v^2) + eps).
__device__ __forceinline__ float moe_rms_scale(float sumsq, unsigned int n, float eps)
{
    return rsqrtf(sumsq / (float)n + eps);
}

// e2m1 code of v, round to nearest even on the grid 0 .5 1 1.5 2 3 4 6, saturating at 6;
// the sign bit is v's (so -0 gives 0x8).
__device__ __forceinline__ unsigned int moe_e2m1(float v)
{
    const float a = fabsf(v);
    const unsigned int code = a <= 0.25f ? 0u : a < 0.75f ? 1u : a <= 1.25f ? 2u : a < 1.75f ? 3u
                            : a <= 2.5f ? 4u : a < 3.5f ? 5u : a <= 5.f ? 6u : 7u;
    return code | (signbit(v) ? 8u : 0u);
}

// NVFP4 quantization of one block of 16, held by the 16 lanes of an aligned half-warp
// (j = lane & 15 is the element). Every lane of the warp must call it (shuffles).
// s = e4m3_sat(amax / (6 * act)); q = e2m1(v / (f32(s) * act)), q = 0 where s = 0.
// Returns the packed byte of elements (j, j + 1) on even j; `scale` gets s.
__device__ __forceinline__ unsigned int moe_quant16(float v, float act, unsigned char& scale)
{
    float amax = fabsf(v);
#pragma unroll
    for (int m = 8; m > 0; m >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, m));
    const unsigned char s = __nv_cvt_float_to_fp8(amax / (6.f * act), __NV_SATFINITE, __NV_E4M3);
    const float sf = moe_e4m3_value(s);
    const unsigned int code = sf == 0.f ? 0u : moe_e2m1(v / (sf * act));
    const unsigned int next = __shfl_down_sync(0xffffffffu, code, 1);
    scale = s;
    return code | (next << 4);
}

// a = gelu_tanh(g) * u in f32.
__device__ __forceinline__ float moe_glu_value(float g, float u)
{
    const float inner = 0.7978845608028654f * fmaf(0.044715f * g, g * g, g);
    return 0.5f * g * (1.f + tanhf(inner)) * u;
}

// Stage the dequantized NVFP4 activation q * s * act as bf16 (exact when act is a power of
// two) into shared memory, one byte (two elements) a thread a step. Needs the staged table.
__device__ __forceinline__ void moe_stage_activation(__nv_bfloat16* __restrict__ xs,
                                                     const unsigned char* __restrict__ q,
                                                     const unsigned char* __restrict__ s,
                                                     float act, unsigned int n, const float* lut)
{
    for (unsigned int j = threadIdx.x; j < n / 2u; j += blockDim.x) {
        const unsigned int b = q[j];
        const float scale = moe_e4m3_value(s[j / 8u]) * act;
        xs[2u * j] = __float2bfloat16_rn(lut[b & 0xfu] * scale);
        xs[2u * j + 1u] = __float2bfloat16_rn(lut[b >> 4] * scale);
    }
}

// The expert's storage slot, both lookups guarded: a bad id must never address weights.
__device__ __forceinline__ unsigned int moe_expert_store(const int* __restrict__ ids, const int* __restrict__ table,
                                                         unsigned int slot, unsigned int E)
{
    const int e = ids[slot];
    if (e < 0 || e >= (int)E) __trap();
    const int store = table[e];
    if (store < 0 || store >= (int)E) __trap();
    return (unsigned int)store;
}

// ------------------------------------------------------------------ stage 1: post_attn

extern "C" __global__ void __launch_bounds__(MOE_THREADS)
moe_post_attn(__nv_bfloat16* __restrict__ mid, __nv_bfloat16* __restrict__ rr,
              unsigned char* __restrict__ fq, float* __restrict__ fs,
              unsigned char* __restrict__ gq, unsigned char* __restrict__ gsc,
              const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ o,
              const __nv_bfloat16* __restrict__ w_pa, const __nv_bfloat16* __restrict__ w_router,
              float act_g, unsigned int H, float eps)
{
    extern __shared__ float s_v[];  // [H]: f32(mid), then n
    __shared__ float s_red[MOE_THREADS / 32];
    const unsigned int t = blockIdx.x, tid = threadIdx.x;
    const unsigned long long row = (unsigned long long)t * H;

    float ss = 0.f;
    for (unsigned int i = tid; i < H; i += MOE_THREADS) {
        const float v = moe_f(o[row + i]);
        ss = fmaf(v, v, ss);
    }
    const float inv_o = moe_rms_scale(moe_block_sum(ss, s_red), H, eps);

    ss = 0.f;
    for (unsigned int i = tid; i < H; i += MOE_THREADS) {
        const __nv_bfloat16 m = __float2bfloat16_rn(fmaf(moe_f(o[row + i]) * inv_o, moe_f(w_pa[i]), moe_f(x[row + i])));
        mid[row + i] = m;
        const float mf = moe_f(m);
        s_v[i] = mf;
        ss = fmaf(mf, mf, ss);
    }
    const float inv_m = moe_rms_scale(moe_block_sum(ss, s_red), H, eps);

    float amax = 0.f;
    for (unsigned int i = tid; i < H; i += MOE_THREADS) {
        const float n = s_v[i] * inv_m;
        s_v[i] = n;
        rr[row + i] = __float2bfloat16_rn(n * moe_f(w_router[i]));
        amax = fmaxf(amax, fabsf(n));
    }
    amax = moe_block_max(amax, s_red);  // its barriers also publish s_v

    // The dense-MLP input: e4m3 with a per-token scale amax / 448 (fq = 0 where the scale is 0).
    const float scale = amax / 448.f;
    if (tid == 0u) fs[t] = scale;
    for (unsigned int i = tid; i < H; i += MOE_THREADS)
        fq[row + i] = scale == 0.f ? (unsigned char)0 : (unsigned char)__nv_cvt_float_to_fp8(s_v[i] / scale, __NV_SATFINITE, __NV_E4M3);

    // The MoE input: NVFP4, one aligned half-warp a block of 16. H / 16 is a multiple of 4, so
    // both halves of a warp are in range or neither is: the loop is warp-uniform.
    const unsigned int nb = H / NVFP4_GROUP, j = tid & 15u;
    for (unsigned int b = tid / 16u; b < nb; b += MOE_THREADS / 16u) {
        unsigned char s;
        const unsigned int byte = moe_quant16(s_v[b * NVFP4_GROUP + j], act_g, s);
        if ((j & 1u) == 0u) gq[row / 2u + b * 8u + j / 2u] = (unsigned char)byte;
        if (j == 0u) gsc[(unsigned long long)t * nb + b] = s;
    }
}

// ------------------------------------------------------------------ stage 2: router

// (v, e) beats (bv, be): a greater logit, or an equal one with a lower expert id.
__device__ __forceinline__ bool moe_better(float v, unsigned int e, float bv, unsigned int be)
{
    return v > bv || (v == bv && e < be);
}

// One warp: token t's top K of row[0..E) (ties to the lowest id, descending order) and the
// softmax of the K selected logits, exp(l - max) / sum, the sum in slot order.
__device__ __forceinline__ void moe_topk_softmax(int* __restrict__ ids, float* __restrict__ wts,
                                                 const float* row, unsigned int E, unsigned int K,
                                                 unsigned int lane)
{
    float vals[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const unsigned int e = lane + 32u * j;
        vals[j] = e < E ? __ldcg(row + e) : 0.f;
    }
    unsigned int taken = 0u;
    float sel_v[MOE_MAX_K];
    unsigned int sel_e[MOE_MAX_K];
#pragma unroll
    for (int k = 0; k < MOE_MAX_K; ++k) {
        float bv = -__int_as_float(0x7f800000);
        unsigned int be = 0xffffffffu;
        if ((unsigned int)k < K) {
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const unsigned int e = lane + 32u * j;
                if (e < E && !((taken >> j) & 1u) && moe_better(vals[j], e, bv, be)) {
                    bv = vals[j];
                    be = e;
                }
            }
#pragma unroll
            for (int m = 16; m > 0; m >>= 1) {
                const float ov = __shfl_xor_sync(0xffffffffu, bv, m);
                const unsigned int oe = __shfl_xor_sync(0xffffffffu, be, m);
                if (moe_better(ov, oe, bv, be)) {
                    bv = ov;
                    be = oe;
                }
            }
            if (be < E && be % 32u == lane) taken |= 1u << (be / 32u);
        }
        sel_v[k] = bv;
        sel_e[k] = be;
    }
    const float mx = sel_v[0];
    float ex[MOE_MAX_K];
#pragma unroll
    for (int k = 0; k < MOE_MAX_K; ++k) ex[k] = (unsigned int)k < K ? expf(sel_v[k] - mx) : 0.f;
    float sum = 0.f;
#pragma unroll
    for (unsigned int k = 0; k < MOE_MAX_K; ++k) if (k < K) sum += ex[k];
    if (lane == 0u) {
#pragma unroll
        for (unsigned int k = 0; k < MOE_MAX_K; ++k) {
            if (k < K) {
                ids[k] = (int)sel_e[k];
                wts[k] = ex[k] / sum;
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(MOE_ROUTER_WARPS * 32)
moe_router(float* __restrict__ logits, int* __restrict__ ids, float* __restrict__ wts,
           unsigned int* ticket, const __nv_bfloat16* __restrict__ rr,
           const __nv_bfloat16* __restrict__ wr, const __nv_bfloat16* __restrict__ pes,
           unsigned int T, unsigned int E, unsigned int H, unsigned int K, unsigned int kcap)
{
    const unsigned int warp = threadIdx.x >> 5, lane = threadIdx.x & 31u;
    const unsigned int e = blockIdx.x * MOE_ROUTER_WARPS + warp;
    if (e < E) {
        // One warp an expert: its row is read once, 16 bytes a lane a step, for all T tokens.
        float acc[MOE_MAX_T];
#pragma unroll
        for (int t = 0; t < MOE_MAX_T; ++t) acc[t] = 0.f;
        const uint4* w4 = reinterpret_cast<const uint4*>(wr + (unsigned long long)e * H);
        for (unsigned int c = lane; c < H / 8u; c += 32u) {
            const uint4 wv = __ldg(w4 + c);
            const unsigned int ww[4] = {wv.x, wv.y, wv.z, wv.w};
#pragma unroll
            for (int t = 0; t < MOE_MAX_T; ++t) {
                if ((unsigned int)t < T) {
                    const uint4 xv = __ldg(reinterpret_cast<const uint4*>(rr + (unsigned long long)t * H) + c);
                    const unsigned int xw[4] = {xv.x, xv.y, xv.z, xv.w};
#pragma unroll
                    for (int i = 0; i < 4; ++i) {
                        const float2 wf = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&ww[i]));
                        const float2 xf = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&xw[i]));
                        acc[t] = fmaf(xf.x, wf.x, acc[t]);
                        acc[t] = fmaf(xf.y, wf.y, acc[t]);
                    }
                }
            }
        }
        const float pe = moe_f(pes[e]);
#pragma unroll
        for (int t = 0; t < MOE_MAX_T; ++t) {
            if ((unsigned int)t < T) {
                const float d = nvfp4_warp_sum(acc[t]);
                if (lane == 0u) logits[(unsigned long long)t * E + e] = pe * d;
            }
        }
    }

    // The last CTA to arrive selects for every token; it resets the ticket for the next launch.
    __shared__ int is_last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) is_last = atomicAdd(ticket, 1u) == gridDim.x - 1u;
    __syncthreads();
    if (!is_last) return;
    __threadfence();
    for (unsigned int t = warp; t < T; t += MOE_ROUTER_WARPS)
        moe_topk_softmax(ids + (unsigned long long)t * kcap, wts + (unsigned long long)t * kcap,
                         logits + (unsigned long long)t * E, E, K, lane);
    if (threadIdx.x == 0) *ticket = 0u;
}

// ------------------------------------------------------------------ stage 3: glu

// grid (I / MOE_GLU_ROWS, T * K): rows i0..i0+15 of the gate half and I+i0..I+i0+15 of the up
// half of expert ids[slot]'s Wgu, against token t's dequantized activation; then the GLU and
// one NVFP4 block of a. gu (optional, may be null) receives the bf16 g/u rows.
extern "C" __global__ void __launch_bounds__(MOE_THREADS)
moe_glu(unsigned char* __restrict__ hq, unsigned char* __restrict__ hs, __nv_bfloat16* __restrict__ gu,
        const int* __restrict__ ids, const int* __restrict__ table,
        const unsigned char* __restrict__ gq, const unsigned char* __restrict__ gsc,
        const unsigned char* __restrict__ wgu, const unsigned char* __restrict__ sgu,
        const float* __restrict__ gs_gu, float act_g, float act_h,
        unsigned int E, unsigned int H, unsigned int I, unsigned int K, unsigned int kcap)
{
    extern __shared__ __align__(16) unsigned char s_dyn[];
    __nv_bfloat16* s_x = reinterpret_cast<__nv_bfloat16*>(s_dyn);  // [H]
    __shared__ float s_lut[16];
    __shared__ float s_half[2 * MOE_GLU_ROWS][2];
    const unsigned int tid = threadIdx.x, lane = tid & 31u;
    const unsigned int t = blockIdx.y / K, k = blockIdx.y % K;
    const unsigned int slot = t * kcap + k;
    const unsigned int store = moe_expert_store(ids, table, slot, E);
    if (tid < 16u) s_lut[tid] = E2M1_LUT[tid];
    __syncthreads();
    moe_stage_activation(s_x, gq + (unsigned long long)t * (H / 2u), gsc + (unsigned long long)t * (H / NVFP4_GROUP),
                         act_g, H, s_lut);
    __syncthreads();

    const unsigned int k16 = H / NVFP4_GROUP, i0 = blockIdx.x * MOE_GLU_ROWS;
    const unsigned char* w = wgu + (unsigned long long)store * (2u * I) * (H / 2u);
    const unsigned char* s = sgu + (unsigned long long)store * (2u * I) * k16;
    const unsigned int o = tid / NVFP4_VLANES, v = tid % NVFP4_VLANES;
#pragma unroll
    for (unsigned int p = 0; p < 2u * MOE_GLU_ROWS; p += MOE_ROWS_PER_PASS) {
        const unsigned int r = p + o;  // 0..15 gate rows, 16..31 up rows
        const unsigned int n = r < MOE_GLU_ROWS ? i0 + r : I + i0 + (r - MOE_GLU_ROWS);
        float part = nvfp4_partial(w + (unsigned long long)n * (H / 2u), s + (unsigned long long)n * k16, s_x, k16, v, s_lut);
        part = nvfp4_warp_sum(part);
        if (lane == 0u) s_half[r][v >> 5] = part;
    }
    __syncthreads();
    if (tid < 32u) {
        const float gs = gs_gu[store];
        const unsigned int j = lane & 15u;
        const __nv_bfloat16 g = __float2bfloat16_rn(gs * (s_half[j][0] + s_half[j][1]));
        const __nv_bfloat16 u = __float2bfloat16_rn(gs * (s_half[MOE_GLU_ROWS + j][0] + s_half[MOE_GLU_ROWS + j][1]));
        unsigned char sc;
        const unsigned int byte = moe_quant16(moe_glu_value(moe_f(g), moe_f(u)), act_h, sc);
        if (lane < 16u) {
            if ((j & 1u) == 0u) hq[(unsigned long long)slot * (I / 2u) + i0 / 2u + j / 2u] = (unsigned char)byte;
            if (j == 0u) hs[(unsigned long long)slot * (I / NVFP4_GROUP) + blockIdx.x] = sc;
            if (gu != nullptr) {
                gu[(unsigned long long)slot * (2u * I) + i0 + j] = g;
                gu[(unsigned long long)slot * (2u * I) + I + i0 + j] = u;
            }
        }
    }
}

// The reference arm of the glu link: the same GLU and quantizer on given bf16 g/u rows
// ([slots, 2I], gate half first), one warp a block of 16. grid (I / 16, slots), 32 threads.
extern "C" __global__ void __launch_bounds__(32)
moe_glu_quant_ref(unsigned char* __restrict__ hq, unsigned char* __restrict__ hs,
                  const __nv_bfloat16* __restrict__ gu, float act_h, unsigned int I)
{
    const unsigned int lane = threadIdx.x, j = lane & 15u, slot = blockIdx.y;
    const unsigned int i = blockIdx.x * NVFP4_GROUP + j;
    const float g = moe_f(gu[(unsigned long long)slot * (2u * I) + i]);
    const float u = moe_f(gu[(unsigned long long)slot * (2u * I) + I + i]);
    unsigned char sc;
    const unsigned int byte = moe_quant16(moe_glu_value(g, u), act_h, sc);
    if (lane < 16u) {
        if ((j & 1u) == 0u) hq[(unsigned long long)slot * (I / 2u) + i / 2u] = (unsigned char)byte;
        if (j == 0u) hs[(unsigned long long)slot * (I / NVFP4_GROUP) + blockIdx.x] = sc;
    }
}

// ------------------------------------------------------------------ stage 4: down

// grid (H / MOE_DOWN_ROWS, T * K): rows of expert ids[slot]'s Wdn [H, I] against hq * hs * act_h.
extern "C" __global__ void __launch_bounds__(MOE_THREADS)
moe_down(__nv_bfloat16* __restrict__ opair, const int* __restrict__ ids, const int* __restrict__ table,
         const unsigned char* __restrict__ hq, const unsigned char* __restrict__ hs,
         const unsigned char* __restrict__ wdn, const unsigned char* __restrict__ sdn,
         const float* __restrict__ gs_dn, float act_h,
         unsigned int E, unsigned int H, unsigned int I, unsigned int K, unsigned int kcap)
{
    extern __shared__ __align__(16) unsigned char s_dyn[];
    __nv_bfloat16* s_x = reinterpret_cast<__nv_bfloat16*>(s_dyn);  // [I]
    __shared__ float s_lut[16];
    __shared__ float s_half[MOE_DOWN_ROWS][2];
    const unsigned int tid = threadIdx.x, lane = tid & 31u;
    const unsigned int t = blockIdx.y / K, k = blockIdx.y % K;
    const unsigned int slot = t * kcap + k;
    const unsigned int store = moe_expert_store(ids, table, slot, E);
    if (tid < 16u) s_lut[tid] = E2M1_LUT[tid];
    __syncthreads();
    moe_stage_activation(s_x, hq + (unsigned long long)slot * (I / 2u), hs + (unsigned long long)slot * (I / NVFP4_GROUP),
                         act_h, I, s_lut);
    __syncthreads();

    const unsigned int k16 = I / NVFP4_GROUP, h0 = blockIdx.x * MOE_DOWN_ROWS;
    const unsigned char* w = wdn + (unsigned long long)store * H * (I / 2u);
    const unsigned char* s = sdn + (unsigned long long)store * H * k16;
    const unsigned int o = tid / NVFP4_VLANES, v = tid % NVFP4_VLANES;
#pragma unroll
    for (unsigned int p = 0; p < MOE_DOWN_ROWS; p += MOE_ROWS_PER_PASS) {
        const unsigned int n = h0 + p + o;
        float part = 0.f;
        if (n < H) part = nvfp4_partial(w + (unsigned long long)n * (I / 2u), s + (unsigned long long)n * k16, s_x, k16, v, s_lut);
        part = nvfp4_warp_sum(part);
        if (lane == 0u) s_half[p + o][v >> 5] = part;
    }
    __syncthreads();
    if (tid < MOE_DOWN_ROWS && h0 + tid < H) {
        const float gs = gs_dn[store];
        opair[(unsigned long long)slot * H + h0 + tid] = __float2bfloat16_rn(gs * (s_half[tid][0] + s_half[tid][1]));
    }
}

// ------------------------------------------------------------------ stage 5: final

extern "C" __global__ void __launch_bounds__(MOE_THREADS)
moe_final(__nv_bfloat16* __restrict__ out, const __nv_bfloat16* __restrict__ dense,
          const __nv_bfloat16* __restrict__ opair, const float* __restrict__ wts,
          const __nv_bfloat16* __restrict__ mid, const __nv_bfloat16* __restrict__ w_d,
          const __nv_bfloat16* __restrict__ w_m, float layer_scalar,
          unsigned int H, unsigned int K, unsigned int kcap, float eps)
{
    extern __shared__ float s_m[];  // [H]: sum_k wts * opair
    __shared__ float s_red[MOE_THREADS / 32];
    __shared__ float s_w[MOE_MAX_K];
    const unsigned int t = blockIdx.x, tid = threadIdx.x;
    const unsigned long long row = (unsigned long long)t * H;
    const __nv_bfloat16* op = opair + (unsigned long long)t * kcap * H;
    if (tid < K) s_w[tid] = wts[(unsigned long long)t * kcap + tid];
    __syncthreads();

    float sd = 0.f, sm = 0.f;
    for (unsigned int i = tid; i < H; i += MOE_THREADS) {
        const float d = moe_f(dense[row + i]);
        sd = fmaf(d, d, sd);
        float m = 0.f;
        for (unsigned int k = 0; k < K; ++k) m = fmaf(s_w[k], moe_f(op[(unsigned long long)k * H + i]), m);
        s_m[i] = m;
        sm = fmaf(m, m, sm);
    }
    const float inv_d = moe_rms_scale(moe_block_sum(sd, s_red), H, eps);
    const float inv_m = moe_rms_scale(moe_block_sum(sm, s_red), H, eps);
    for (unsigned int i = tid; i < H; i += MOE_THREADS) {
        float acc = fmaf(moe_f(dense[row + i]) * inv_d, moe_f(w_d[i]), moe_f(mid[row + i]));
        acc = fmaf(s_m[i] * inv_m, moe_f(w_m[i]), acc);
        out[row + i] = __float2bfloat16_rn(acc * layer_scalar);
    }
}
