// A small demonstration module: the harness's own smoke test on the device.
#include <cuda_bf16.h>

// out[i] = bf16(x[i] * scale), one element per thread, guarded tail.
extern "C" __global__ void demo_scale(__nv_bfloat16* out, const __nv_bfloat16* x, float scale, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = __float2bfloat16(__bfloat162float(x[i]) * scale);
}

// The same result through a template, loaded by its C++ name expression.
template <int VEC>
__global__ void demo_scale_vec(__nv_bfloat16* out, const __nv_bfloat16* x, float scale, int n) {
    int base = (blockIdx.x * blockDim.x + threadIdx.x) * VEC;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
        int i = base + j;
        if (i < n) out[i] = __float2bfloat16(__bfloat162float(x[i]) * scale);
    }
}

// Gathers x[idx[i]]; the device guard traps on an index outside [0, n).
extern "C" __global__ void demo_gather_guarded(float* out, const float* x, const int* idx, int n, int m) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= m) return;
    int j = idx[i];
    if (j < 0 || j >= n) __trap();
    out[i] = x[j];
}
