// QK RMSNorm + RoPE for head sizes 256 (with a V input) and 512 (K = V fork).
//
// Per (token, head) vector x of HD bf16 values, in f32:
//   inv_rms = 1 / sqrt(sum(x^2) / HD + eps)
//   n[d]    = x[d] * inv_rms * w[d]
//   for d < half (half = rotary_dim / 2), c = cos[pos][d], s = sin[pos][d]:
//     out[d]        = n[d] * c - n[d + half] * s
//     out[d + half] = n[d] * s + n[d + half] * c
//   for rotary_dim <= d < HD: out[d] = n[d]
// V (HD 256) gets bf16(v * inv_rms_v); HD 512 has no V input and its V slot gets
// bf16(k * inv_rms_k), the raw K row, weightless and unrotated.
//
// Three arms:
//   qk_rope_flat<HD>                   tokens at positions[t], rows land at row_offset + t
//   qk_rope_paged<HD, false>           paged prefill: one request at start_pos + t
//   qk_rope_paged<HD, true>            paged decode: per-token position, CSR window, origin
// Prefill and decode are ONE template (PER_TOKEN_META): the only difference is where
// pos, the window and the origin come from.
//
// Work split: one warp per (token, head) job; a job of a KV head computes K and V.
// Each lane holds HD / 32 values, loaded as 16-byte vectors (coalesced), reductions
// use __shfl_xor_sync, the rotation partner d +- half is read from a per-warp
// shared-memory staging row, accumulation is f32, results round to nearest even.
// Pool writes are element-wise and coalesced (lane-strided) through the staging row:
// the pool promises only element alignment, like a reshape-and-cache kernel.

#include <cuda_bf16.h>

namespace qkr {

constexpr int kWarp = 32;
constexpr int kWarpsPerBlock = 4;
constexpr int kVec = 8;  // bf16 values in one 16-byte vector

template <int HD>
struct Shape {
  static_assert(HD == 256 || HD == 512, "head size must be 256 or 512");
  static constexpr int kPerLane = HD / kWarp;
  static constexpr int kChunks = kPerLane / kVec;
  static constexpr bool kHasV = HD == 256;  // HD 512: the V slot is the K = V fork
};

// The head dimension held in a lane's i-th register: vector chunk c covers
// 256 contiguous values, each lane 8 of them.
__device__ __forceinline__ int dim_of(int lane, int i) {
  return (i / kVec) * (kWarp * kVec) + lane * kVec + (i % kVec);
}

template <int HD>
__device__ __forceinline__ void load_row(const __nv_bfloat16* __restrict__ src, int lane,
                                         float (&x)[Shape<HD>::kPerLane]) {
#pragma unroll
  for (int c = 0; c < Shape<HD>::kChunks; ++c) {
    const uint4 raw = reinterpret_cast<const uint4*>(src)[c * kWarp + lane];
    const __nv_bfloat162* h2 = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
    for (int j = 0; j < kVec / 2; ++j) {
      const float2 f = __bfloat1622float2(h2[j]);
      x[c * kVec + 2 * j] = f.x;
      x[c * kVec + 2 * j + 1] = f.y;
    }
  }
}

template <int HD>
__device__ __forceinline__ void store_row(__nv_bfloat16* __restrict__ dst, int lane,
                                          const float (&y)[Shape<HD>::kPerLane]) {
#pragma unroll
  for (int c = 0; c < Shape<HD>::kChunks; ++c) {
    uint4 raw;
    __nv_bfloat162* h2 = reinterpret_cast<__nv_bfloat162*>(&raw);
#pragma unroll
    for (int j = 0; j < kVec / 2; ++j) {
      h2[j] = __floats2bfloat162_rn(y[c * kVec + 2 * j], y[c * kVec + 2 * j + 1]);
    }
    reinterpret_cast<uint4*>(dst)[c * kWarp + lane] = raw;
  }
}

// Element-wise coalesced store through the warp's staging row.
template <int HD>
__device__ __forceinline__ void store_pool_row(__nv_bfloat16* __restrict__ dst, int lane,
                                               const float (&y)[Shape<HD>::kPerLane],
                                               float* stage) {
#pragma unroll
  for (int i = 0; i < Shape<HD>::kPerLane; ++i) stage[dim_of(lane, i)] = y[i];
  __syncwarp();
#pragma unroll
  for (int i = 0; i < Shape<HD>::kPerLane; ++i) {
    dst[i * kWarp + lane] = __float2bfloat16_rn(stage[i * kWarp + lane]);
  }
  __syncwarp();
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = kWarp / 2; offset > 0; offset >>= 1) {
    v += __shfl_xor_sync(0xffffffffu, v, offset);
  }
  return v;
}

template <int HD>
__device__ __forceinline__ float inv_rms(const float (&x)[Shape<HD>::kPerLane], float eps) {
  float sum = 0.0f;
#pragma unroll
  for (int i = 0; i < Shape<HD>::kPerLane; ++i) sum += x[i] * x[i];
  sum = warp_sum(sum);
  return 1.0f / sqrtf(sum / HD + eps);
}

// n = x * inv * w, or the weightless x * inv when w is null.
template <int HD>
__device__ __forceinline__ void normalize(const float (&x)[Shape<HD>::kPerLane], float inv,
                                          const __nv_bfloat16* __restrict__ w, int lane,
                                          float (&n)[Shape<HD>::kPerLane]) {
  if (w == nullptr) {
#pragma unroll
    for (int i = 0; i < Shape<HD>::kPerLane; ++i) n[i] = x[i] * inv;
    return;
  }
  float wf[Shape<HD>::kPerLane];
  load_row<HD>(w, lane, wf);
#pragma unroll
  for (int i = 0; i < Shape<HD>::kPerLane; ++i) n[i] = x[i] * inv * wf[i];
}

// In-place rotation of the first rotary_dim values; the tail passes through.
template <int HD>
__device__ __forceinline__ void rope(float (&n)[Shape<HD>::kPerLane],
                                     const float* __restrict__ cos_row,
                                     const float* __restrict__ sin_row, int rotary_dim,
                                     float* stage, int lane) {
#pragma unroll
  for (int i = 0; i < Shape<HD>::kPerLane; ++i) stage[dim_of(lane, i)] = n[i];
  __syncwarp();
  const int half = rotary_dim / 2;
#pragma unroll
  for (int i = 0; i < Shape<HD>::kPerLane; ++i) {
    const int d = dim_of(lane, i);
    if (d < half) {
      const float c = cos_row[d];
      const float s = sin_row[d];
      n[i] = n[i] * c - stage[d + half] * s;
    } else if (d < rotary_dim) {
      const int p = d - half;
      const float c = cos_row[p];
      const float s = sin_row[p];
      n[i] = stage[p] * s + n[i] * c;
    }
  }
  __syncwarp();
}

// Normalised, weighted and rotated row of Q or K.
template <int HD>
__device__ __forceinline__ void norm_rope(const float (&x)[Shape<HD>::kPerLane], float inv,
                                          const __nv_bfloat16* __restrict__ w,
                                          const float* __restrict__ cos_row,
                                          const float* __restrict__ sin_row, int rotary_dim,
                                          float* stage, int lane,
                                          float (&out)[Shape<HD>::kPerLane]) {
  normalize<HD>(x, inv, w, lane, out);
  rope<HD>(out, cos_row, sin_row, rotary_dim, stage, lane);
}

// Paged pool address of element d = 0 of one (page, layer, kind, pos, kv_head) row.
// kind: K = 0, V = 1.
template <int HD>
__device__ __forceinline__ long long pool_index(int page, int layer, int kind, int pos,
                                                int kv_head, int page_size, int num_layers,
                                                int nkv) {
  const long long kv_block = static_cast<long long>(page_size) * nkv * HD;
  const long long layer_stride = 2 * kv_block;
  const long long page_stride = num_layers * layer_stride;
  return page * page_stride + layer * layer_stride + kind * kv_block +
         static_cast<long long>(pos % page_size) * nkv * HD + kv_head * HD;
}

}  // namespace qkr

template <int HD>
__global__ void __launch_bounds__(qkr::kWarpsPerBlock * qkr::kWarp)
qk_rope_flat(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k,
             const __nv_bfloat16* __restrict__ v, const __nv_bfloat16* __restrict__ q_w,
             const __nv_bfloat16* __restrict__ k_w, const float* __restrict__ cos,
             const float* __restrict__ sin, const int* __restrict__ positions,
             __nv_bfloat16* __restrict__ q_out, __nv_bfloat16* __restrict__ k_out,
             __nv_bfloat16* __restrict__ v_out, int num_tokens, int nq, int nkv,
             int rotary_dim, int row_offset, float eps) {
  using S = qkr::Shape<HD>;
  __shared__ float stage_all[qkr::kWarpsPerBlock][HD];
  const int warp = threadIdx.x / qkr::kWarp;
  const int lane = threadIdx.x % qkr::kWarp;
  float* stage = stage_all[warp];

  const int heads = nq + nkv;
  const long long job = static_cast<long long>(blockIdx.x) * qkr::kWarpsPerBlock + warp;
  if (job >= static_cast<long long>(num_tokens) * heads) return;
  const int t = static_cast<int>(job / heads);
  const int h = static_cast<int>(job % heads);

  const int pos = positions[t];
  const int half = rotary_dim / 2;
  const float* cos_row = cos + static_cast<long long>(pos) * half;
  const float* sin_row = sin + static_cast<long long>(pos) * half;
  const long long out_row = static_cast<long long>(row_offset) + t;

  float x[S::kPerLane];
  float y[S::kPerLane];
  if (h < nq) {
    qkr::load_row<HD>(q + (static_cast<long long>(t) * nq + h) * HD, lane, x);
    const float inv_q = qkr::inv_rms<HD>(x, eps);
    qkr::norm_rope<HD>(x, inv_q, q_w, cos_row, sin_row, rotary_dim, stage, lane, y);
    qkr::store_row<HD>(q_out + (out_row * nq + h) * HD, lane, y);
    return;
  }
  const int kh = h - nq;
  qkr::load_row<HD>(k + (static_cast<long long>(t) * nkv + kh) * HD, lane, x);
  const float inv_k = qkr::inv_rms<HD>(x, eps);
  qkr::norm_rope<HD>(x, inv_k, k_w, cos_row, sin_row, rotary_dim, stage, lane, y);
  qkr::store_row<HD>(k_out + (out_row * nkv + kh) * HD, lane, y);

  float vx[S::kPerLane];
  float inv_v = inv_k;
  if (S::kHasV) {
    qkr::load_row<HD>(v + (static_cast<long long>(t) * nkv + kh) * HD, lane, vx);
    inv_v = qkr::inv_rms<HD>(vx, eps);
  } else {
#pragma unroll
    for (int i = 0; i < S::kPerLane; ++i) vx[i] = x[i];  // K = V fork: the raw K row
  }
  qkr::normalize<HD>(vx, inv_v, nullptr, lane, y);
  qkr::store_row<HD>(v_out + (out_row * nkv + kh) * HD, lane, y);
}

template <int HD, bool PER_TOKEN_META>
__global__ void __launch_bounds__(qkr::kWarpsPerBlock * qkr::kWarp)
qk_rope_paged(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k,
              const __nv_bfloat16* __restrict__ v, const __nv_bfloat16* __restrict__ q_w,
              const __nv_bfloat16* __restrict__ k_w, const float* __restrict__ cos,
              const float* __restrict__ sin, __nv_bfloat16* __restrict__ q_out,
              __nv_bfloat16* __restrict__ pool, int num_tokens, int nq, int nkv,
              int rotary_dim, float eps, int layer, int num_layers, int page_size,
              int num_pages, const int* __restrict__ page_indices, int page_indices_len,
              int start_pos, int page_origin, const int* __restrict__ positions,
              const int* __restrict__ page_indptr, const int* __restrict__ page_origins) {
  using S = qkr::Shape<HD>;
  __shared__ float stage_all[qkr::kWarpsPerBlock][HD];
  const int warp = threadIdx.x / qkr::kWarp;
  const int lane = threadIdx.x % qkr::kWarp;
  float* stage = stage_all[warp];

  const int heads = nq + nkv;
  const long long job = static_cast<long long>(blockIdx.x) * qkr::kWarpsPerBlock + warp;
  if (job >= static_cast<long long>(num_tokens) * heads) return;
  const int t = static_cast<int>(job / heads);
  const int h = static_cast<int>(job % heads);

  // Where this token's position, page window and window origin come from.
  int pos;
  int begin;
  int end;
  int origin;
  if (PER_TOKEN_META) {
    const int csr_row = t;
    pos = positions[t];
    begin = page_indptr[csr_row];
    end = page_indptr[csr_row + 1];
    if (begin < 0) __trap();
    if (end < begin) __trap();
    if (end > page_indices_len) __trap();
    origin = page_origins[t];
  } else {
    pos = start_pos + t;
    begin = 0;
    end = page_indices_len;
    origin = page_origin;
  }
  if (page_size <= 0) __trap();
  if (origin < 0) __trap();
  if (pos / page_size < origin) __trap();
  const int row = pos / page_size - origin;
  if (row >= end - begin) __trap();
  const int page = page_indices[begin + row];
  if (page < 0 || page >= num_pages) __trap();

  const int half = rotary_dim / 2;
  const float* cos_row = cos + static_cast<long long>(pos) * half;
  const float* sin_row = sin + static_cast<long long>(pos) * half;

  float x[S::kPerLane];
  float y[S::kPerLane];
  if (h < nq) {
    qkr::load_row<HD>(q + (static_cast<long long>(t) * nq + h) * HD, lane, x);
    const float inv_q = qkr::inv_rms<HD>(x, eps);
    qkr::norm_rope<HD>(x, inv_q, q_w, cos_row, sin_row, rotary_dim, stage, lane, y);
    qkr::store_row<HD>(q_out + (static_cast<long long>(t) * nq + h) * HD, lane, y);
    return;
  }
  const int kh = h - nq;
  qkr::load_row<HD>(k + (static_cast<long long>(t) * nkv + kh) * HD, lane, x);
  const float inv_k = qkr::inv_rms<HD>(x, eps);
  qkr::norm_rope<HD>(x, inv_k, k_w, cos_row, sin_row, rotary_dim, stage, lane, y);
  qkr::store_pool_row<HD>(
      pool + qkr::pool_index<HD>(page, layer, 0, pos, kh, page_size, num_layers, nkv), lane, y,
      stage);

  float vx[S::kPerLane];
  float inv_v = inv_k;
  if (S::kHasV) {
    qkr::load_row<HD>(v + (static_cast<long long>(t) * nkv + kh) * HD, lane, vx);
    inv_v = qkr::inv_rms<HD>(vx, eps);
  } else {
#pragma unroll
    for (int i = 0; i < S::kPerLane; ++i) vx[i] = x[i];  // K = V fork: the raw K row
  }
  qkr::normalize<HD>(vx, inv_v, nullptr, lane, y);  // the pool's V slot: weightless
  qkr::store_pool_row<HD>(
      pool + qkr::pool_index<HD>(page, layer, 1, pos, kh, page_size, num_layers, nkv), lane, y,
      stage);
}
