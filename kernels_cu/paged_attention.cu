// Paged attention over a bf16 KV pool [num_pages][nkv][16][HD], as an inference engine runs it.
//
//   paged_decode<HD>   split-K decode: grid (splits, nh, rows). Each CTA runs an online softmax
//                      over its chunk of the row's visible pages and writes a partial state
//                      (max, sum, acc[HD]) in f32. With a counter buffer, the last CTA to arrive
//                      for a (row, head) merges all partials and resets the counter; without
//                      one, paged_combine<HD> merges them. Both merges call merge_splits(): same
//                      order, same arithmetic, so they agree bit for bit.
//   paged_combine<HD>  the separate merge: grid (nh, rows).
//   paged_prefill<HD, ROWS>
//                      prefill over row tiles: grid (tiles, nh), one warp per query row; each
//                      visible K/V page of the tile is staged in shared memory once and read by
//                      every row of the tile.
//
// Visibility (the one definition, key_visible): key kpos is visible to a query at qpos when
// kpos <= qpos (causal) and, with a sliding window W > 0, qpos - kpos < W. Masked keys are never
// loaded; pages wholly outside a row's (or a tile's) visible range are never addressed, so a
// NaN-filled null page behind the page map cannot reach the output.
//
// Softmax and accumulation in f32 with explicit fmaf (no contraction freedom), output bf16
// round-to-nearest. Compiled without fast-math, ftz off: expf underflows through the denormals
// to exactly 0 for arguments below about -104, which the needle anchor relies on.
#include <cuda_bf16.h>

namespace pa {

constexpr int PAGE = 16;           // keys per page
constexpr int DECODE_WARPS = 4;    // warps per decode / combine CTA
constexpr int LANES = 32;
__device__ __forceinline__ float neg_inf() { return __uint_as_float(0xff800000u); }

// Page-aligned split of the visible pages [p_lo, p_hi] into `splits` chunks.
__device__ __forceinline__ int split_pages(int p_lo, int p_hi, int splits) {
    return (p_hi - p_lo + splits) / splits;   // ceil((p_hi - p_lo + 1) / splits)
}

__device__ __forceinline__ int first_visible(int qpos, int window) {
    return (window > 0 && qpos - window + 1 > 0) ? qpos - window + 1 : 0;
}

__device__ __forceinline__ bool key_visible(int kpos, int qpos, int window) {
    return kpos <= qpos && (window == 0 || qpos - kpos < window);
}

// Logical page p of a sequence whose block-table row starts at `off`, through the optional
// page map (pool page -> physical page of a permuted pool).
__device__ __forceinline__ long long physical_page(const int* bt, int off, int p, const int* pmap) {
    const int pool_page = bt[off + p];
    return pmap != nullptr ? pmap[pool_page] : pool_page;
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
    for (int o = LANES / 2; o > 0; o /= 2) x += __shfl_xor_sync(0xffffffffu, x, o);
    return x;   // every lane holds the same bits: each butterfly step adds a commutative pair
}

// A lane's share of one HD row: CHUNKS vectors of 8 bf16; chunk c covers c*256 + lane*8 .. +8.
template <int HD>
struct Row {
    static constexpr int CHUNKS = HD / (LANES * 8);
    float v[CHUNKS][8];

    __device__ __forceinline__ void load(const __nv_bfloat16* row, int lane) {
#pragma unroll
        for (int c = 0; c < CHUNKS; ++c) {
            const uint4 u = *reinterpret_cast<const uint4*>(row + c * LANES * 8 + lane * 8);
            const __nv_bfloat162* h2 = reinterpret_cast<const __nv_bfloat162*>(&u);
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const float2 f = __bfloat1622float2(h2[i]);
                v[c][2 * i] = f.x;
                v[c][2 * i + 1] = f.y;
            }
        }
    }
};

// Online softmax state of one warp (m, l uniform across lanes; acc holds the lane's dims).
template <int HD>
struct State {
    float m = neg_inf();
    float l = 0.f;
    Row<HD> acc;

    __device__ __forceinline__ void clear() {
#pragma unroll
        for (int c = 0; c < Row<HD>::CHUNKS; ++c)
#pragma unroll
            for (int i = 0; i < 8; ++i) acc.v[c][i] = 0.f;
    }

    __device__ __forceinline__ void add_key(const Row<HD>& q, const __nv_bfloat16* krow,
                                            const __nv_bfloat16* vrow, float scale, int lane) {
        Row<HD> k;
        k.load(krow, lane);
        float s = 0.f;
#pragma unroll
        for (int c = 0; c < Row<HD>::CHUNKS; ++c)
#pragma unroll
            for (int i = 0; i < 8; ++i) s = fmaf(q.v[c][i], k.v[c][i], s);
        s = warp_sum(s) * scale;
        Row<HD> v;
        v.load(vrow, lane);
        const float m_new = fmaxf(m, s);
        const float alpha = expf(m - m_new);   // m = -inf on the first key: exactly 0
        const float p = expf(s - m_new);
        l = fmaf(l, alpha, p);
#pragma unroll
        for (int c = 0; c < Row<HD>::CHUNKS; ++c)
#pragma unroll
            for (int i = 0; i < 8; ++i) acc.v[c][i] = fmaf(acc.v[c][i], alpha, p * v.v[c][i]);
        m = m_new;
    }
};

template <bool FROM_GLOBAL>
__device__ __forceinline__ float load_state(const float* p) {
    if constexpr (FROM_GLOBAL) {
        return __ldcg(p);   // partials written by other CTAs: read through L2, not a stale L1
    } else {
        return *p;
    }
}

// Merge n states laid out as {m, l, acc[...]} every `stride` floats, in index order, for dim d.
// An empty state (m = -inf, l = 0, acc = 0) contributes exactly nothing.
template <bool FROM_GLOBAL>
__device__ __forceinline__ void merge_states(const float* parts, int n, int stride, int d,
                                             float& m_out, float& l_out, float& a_out) {
    float m_max = neg_inf();
    for (int i = 0; i < n; ++i) m_max = fmaxf(m_max, load_state<FROM_GLOBAL>(parts + i * stride));
    float l = 0.f, a = 0.f;
    for (int i = 0; i < n; ++i) {
        const float m = load_state<FROM_GLOBAL>(parts + i * stride);
        const float f = m == neg_inf() ? 0.f : expf(m - m_max);
        l = fmaf(load_state<FROM_GLOBAL>(parts + i * stride + 1), f, l);
        a = fmaf(load_state<FROM_GLOBAL>(parts + i * stride + 2 + d), f, a);
    }
    m_out = m_max;
    l_out = l;
    a_out = a;
}

// The split merge both decode paths share: the `splits` partials at `parts` -> o[0 .. HD), bf16.
template <int HD>
__device__ __forceinline__ void merge_splits(__nv_bfloat16* o, const float* parts, int splits) {
    for (int d = threadIdx.x; d < HD; d += blockDim.x) {
        float m, l, a;
        merge_states<true>(parts, splits, HD + 2, d, m, l, a);
        o[d] = __float2bfloat16_rn(a / l);
    }
}

}  // namespace pa

template <int HD>
__global__ void __launch_bounds__(pa::DECODE_WARPS * pa::LANES)
paged_decode(__nv_bfloat16* __restrict__ out, float* __restrict__ part, int* counters,
             const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ kpool,
             const __nv_bfloat16* __restrict__ vpool, const int* __restrict__ bt,
             const int* __restrict__ off, const int* __restrict__ qpos, const int* pmap,
             int nh, int nkv, int window, int splits, float scale) {
    using namespace pa;
    const int split = blockIdx.x, h = blockIdx.y, row = blockIdx.z;
    const int warp = threadIdx.x / LANES, lane = threadIdx.x % LANES;
    const int kvh = h / (nh / nkv);
    const int qp = qpos[row];
    const int p_lo = first_visible(qp, window) / PAGE, p_hi = qp / PAGE;
    const int per = split_pages(p_lo, p_hi, splits);
    const int p_begin = p_lo + split * per;
    const int p_end = min(p_hi + 1, p_begin + per);

    Row<HD> qr;
    qr.load(q + (static_cast<long long>(row) * nh + h) * HD, lane);
    State<HD> st;
    st.clear();
    for (int p = p_begin + warp; p < p_end; p += DECODE_WARPS) {
        const long long base = (physical_page(bt, off[row], p, pmap) * nkv + kvh) * PAGE * HD;
        for (int slot = 0; slot < PAGE; ++slot) {
            if (!key_visible(p * PAGE + slot, qp, window)) continue;
            st.add_key(qr, kpool + base + slot * HD, vpool + base + slot * HD, scale, lane);
        }
    }

    // Combine the warps' states in warp order, then publish this CTA's partial.
    __shared__ float warp_states[DECODE_WARPS][HD + 2];
    if (lane == 0) {
        warp_states[warp][0] = st.m;
        warp_states[warp][1] = st.l;
    }
#pragma unroll
    for (int c = 0; c < Row<HD>::CHUNKS; ++c)
#pragma unroll
        for (int i = 0; i < 8; ++i) warp_states[warp][2 + c * LANES * 8 + lane * 8 + i] = st.acc.v[c][i];
    __syncthreads();
    float* mine = part + ((static_cast<long long>(row) * nh + h) * splits + split) * (HD + 2);
    for (int d = threadIdx.x; d < HD; d += blockDim.x) {
        float m, l, a;
        merge_states<false>(&warp_states[0][0], DECODE_WARPS, HD + 2, d, m, l, a);
        mine[2 + d] = a;
        if (d == 0) {
            mine[0] = m;
            mine[1] = l;
        }
    }
    if (counters == nullptr) return;   // paged_combine merges

    // Last CTA to arrive for (row, h) merges; it resets the ticket for the next launch.
    __shared__ int is_last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        const int ticket = atomicAdd(&counters[row * nh + h], 1);
        is_last = ticket == splits - 1;
    }
    __syncthreads();
    if (!is_last) return;
    __threadfence();
    merge_splits<HD>(out + (static_cast<long long>(row) * nh + h) * HD,
                     part + (static_cast<long long>(row) * nh + h) * splits * (HD + 2), splits);
    if (threadIdx.x == 0) counters[row * nh + h] = 0;
}

template <int HD>
__global__ void __launch_bounds__(pa::DECODE_WARPS * pa::LANES)
paged_combine(__nv_bfloat16* __restrict__ out, const float* __restrict__ part, int nh, int splits) {
    const long long rh = static_cast<long long>(blockIdx.y) * nh + blockIdx.x;   // (row, head)
    pa::merge_splits<HD>(out + rh * HD, part + rh * splits * (HD + 2), splits);
}

template <int HD, int ROWS>
__global__ void __launch_bounds__(ROWS * pa::LANES)
paged_prefill(__nv_bfloat16* __restrict__ out, const __nv_bfloat16* __restrict__ q,
              const __nv_bfloat16* __restrict__ kpool, const __nv_bfloat16* __restrict__ vpool,
              const int* __restrict__ bt, const int* __restrict__ off, const int* __restrict__ qpos,
              const int* __restrict__ tile_start, const int* __restrict__ tile_len, const int* pmap,
              int nh, int nkv, int window, float scale) {
    using namespace pa;
    __shared__ __align__(16) __nv_bfloat16 k_page[PAGE * HD];
    __shared__ __align__(16) __nv_bfloat16 v_page[PAGE * HD];
    __shared__ int row_lo[ROWS], row_hi[ROWS];

    const int tile = blockIdx.x, h = blockIdx.y;
    const int warp = threadIdx.x / LANES, lane = threadIdx.x % LANES;
    const int t0 = tile_start[tile], tn = tile_len[tile];
    const bool active = warp < tn;
    const int row = t0 + warp;
    const int kvh = h / (nh / nkv);
    const int qp = active ? qpos[row] : 0;
    if (lane == 0) {
        row_lo[warp] = active ? first_visible(qp, window) : 0x7fffffff;
        row_hi[warp] = active ? qp : -1;
    }
    __syncthreads();
    int lo = 0x7fffffff, hi = -1;
    for (int w = 0; w < ROWS; ++w) {
        lo = min(lo, row_lo[w]);
        hi = max(hi, row_hi[w]);
    }
    const int seq_off = off[t0];   // make_tiles keeps a tile inside one sequence

    Row<HD> qr;
    if (active) qr.load(q + (static_cast<long long>(row) * nh + h) * HD, lane);
    State<HD> st;
    st.clear();
    for (int p = lo / PAGE; p <= hi / PAGE; ++p) {
        const long long base = (physical_page(bt, seq_off, p, pmap) * nkv + kvh) * PAGE * HD;
        const uint4* kg = reinterpret_cast<const uint4*>(kpool + base);
        const uint4* vg = reinterpret_cast<const uint4*>(vpool + base);
        for (int i = threadIdx.x; i < PAGE * HD / 8; i += blockDim.x) {
            reinterpret_cast<uint4*>(k_page)[i] = kg[i];
            reinterpret_cast<uint4*>(v_page)[i] = vg[i];
        }
        __syncthreads();
        if (active) {
            for (int slot = 0; slot < PAGE; ++slot) {
                if (!key_visible(p * PAGE + slot, qp, window)) continue;
                st.add_key(qr, k_page + slot * HD, v_page + slot * HD, scale, lane);
            }
        }
        __syncthreads();
    }
    if (!active) return;
    __nv_bfloat16* o = out + (static_cast<long long>(row) * nh + h) * HD;
#pragma unroll
    for (int c = 0; c < Row<HD>::CHUNKS; ++c)
#pragma unroll
        for (int i = 0; i < 8; ++i) o[c * LANES * 8 + lane * 8 + i] = __float2bfloat16_rn(st.acc.v[c][i] / st.l);
}
