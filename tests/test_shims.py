"""The NVRTC shims (`harness/compiling/shims/`) and the stand-in for a set-aside host header
(`harness/compiling/standin/`): what kernels and their headers take from the C++ standard library
compiles under NVRTC with a plain `#include`, beside real CUDA and CCCL headers, with no
ambiguity; and what device code got through a host header the device view set aside (a c10
header: the standard integer types, std::max over an initializer list, __half) stays
reachable, under NVRTC and under nvcc, with no launcher setting."""

import textwrap

import pytest

from harness.compiling import toolchain
from harness.compiling.compile import compile_file

# Each call's value is checked at compile time: a wrong shim is a failed static_assert.
MIN_MAX_FAMILY = """\
#include <algorithm>
#include <cstdint>
#include <cstddef>
struct Greater { __host__ __device__ constexpr bool operator()(int a, int b) const { return a > b; } };
constexpr int kArr[] = {4, 1, 7, 1, 7};
static_assert(std::min(3, 5) == 3 && std::max(3, 5) == 5, "two values");
static_assert(std::min(3, 5, Greater()) == 5 && std::max(3, 5, Greater()) == 3, "a comparator");
static_assert(std::max({sizeof(int), sizeof(double), sizeof(char)}) == sizeof(double), "an initializer list");
static_assert(std::min({4, 2, 9}) == 2 && std::max({4, 2, 9}, Greater()) == 2, "a list and a comparator");
static_assert(std::minmax(5, 3).first == 3 && std::minmax({4, 1, 7, 1}).second == 7, "minmax");
static_assert(std::clamp(12, 0, 10) == 10 && std::clamp(-1, 0, 10) == 0 && std::clamp(4, 0, 10) == 4, "clamp");
static_assert(std::min_element(kArr, kArr + 5) == kArr + 1, "the first smallest");
static_assert(std::max_element(kArr, kArr + 5) == kArr + 2, "the first largest");
static_assert(std::minmax_element(kArr, kArr + 5).second == kArr + 4, "minmax_element: the last largest");
template <int N> struct Traits { static constexpr std::size_t kSmem = std::max({N * 4, 1024, N * 2}); };
extern "C" __global__ void k(const float* x, float* out, std::int64_t n) {
  const std::int64_t i = threadIdx.x;
  if (i < n) out[i] = std::clamp(std::max(std::min(x[i], 1.0f), -1.0f), -0.5f, 0.5f) + Traits<512>::kSmem;
}
"""


def test_the_min_max_family_compiles_in_device_code_and_constant_expressions_from_a_plain_include(tmp_path):
    (tmp_path / "k.cu").write_text(MIN_MAX_FAMILY)
    mod = compile_file("k.cu", kernel_root=tmp_path, arch="sm_90", use_cache=False)
    assert mod.backend == "nvrtc" and [r.kernel for r in mod.resources] == ["k"]
    assert not mod.set_aside and not any(o.startswith("--pre-include") for o in mod.options)


# Real headers kernels include beside the standard library's: CUB's block and warp
# primitives, the half, bfloat16 and fp8 types, cooperative groups, libcu++.
REAL_HEADERS = ["cub/block/block_load.cuh", "cub/block/block_store.cuh", "cub/block/block_reduce.cuh",
                "cub/block/block_scan.cuh", "cub/block/block_radix_sort.cuh", "cub/warp/warp_reduce.cuh",
                "cuda_fp16.h", "cuda_bf16.h", "cuda_fp8.h", "cooperative_groups.h", "cuda/std/utility",
                "cuda/std/limits"]
SHIMMED = ["algorithm", "cstdint", "cstddef", "climits", "cfloat", "limits", "type_traits", "utility",
           "initializer_list", "cmath"]
USES = """
template <class T> constexpr std::size_t widest(std::initializer_list<std::size_t> l) { return std::max(l); }
extern "C" __global__ void k(float* out, std::uint32_t n) {
  constexpr std::size_t w = std::max({sizeof(float), sizeof(double), alignof(std::int64_t)});
  static_assert(w == 8 && std::numeric_limits<std::uint32_t>::max() == UINT_MAX, "std through the shims");
  if (threadIdx.x < n) out[threadIdx.x] = std::min(std::fabs(out[threadIdx.x]), FLT_MAX) + w;
}
"""


@pytest.mark.parametrize("header", REAL_HEADERS)
@pytest.mark.parametrize("order", ["shims first", "header first"])
def test_a_real_header_compiles_beside_every_shim_with_std_min_max_unambiguous(tmp_path, header, order):
    shims = "".join(f"#include <{s}>\n" for s in SHIMMED)
    real = f"#include <{header}>\n"
    (tmp_path / "k.cu").write_text((shims + real if order == "shims first" else real + shims) + USES)
    mod = compile_file("k.cu", kernel_root=tmp_path, arch="sm_90", use_cache=False)
    assert mod.backend == "nvrtc" and [r.kernel for r in mod.resources] == ["k"], mod.set_aside


def test_every_shim_is_listed_above():
    names = {p.name for p in toolchain.SHIMS.iterdir() if p.is_file() and "." not in p.name}
    assert names == set(SHIMMED) | {"cassert", "cstdio"}, "a shim without a test: add it to SHIMMED"


# A torch extension's header reaches the standard integer types, size_t, std::max and __half
# through c10, which the device view sets aside: here through <c10/util/Half.h> alone.
C10_USER = {
    "params.h": """\
        #pragma once
        struct Params {
            using index_t = uint32_t;
            int batch, dim;
            index_t stride;
            int64_t total;
            void *__restrict__ x_ptr;
        };
        """,
    "k.cu": """\
        #include <c10/util/Half.h>
        #include <c10/cuda/CUDAException.h>
        #include "params.h"
        template <typename T> struct Traits { static constexpr size_t kBytes = std::max({sizeof(T), sizeof(uint4)}); };
        extern "C" __global__ void k(Params p) {
            __half* x = reinterpret_cast<__half*>(p.x_ptr);
            x[threadIdx.x] = __float2half(float(Traits<__half>::kBytes + p.stride));
        }
        """,
}


@pytest.mark.parametrize("compiler", ["nvrtc", "nvcc"])
def test_what_device_code_got_through_a_set_aside_c10_header_stays_reachable(tmp_path, compiler):
    if compiler == "nvcc" and toolchain.find_nvcc() is None:
        pytest.skip("nvcc is not installed here")
    for name, text in C10_USER.items():
        (tmp_path / name).write_text(textwrap.dedent(text))
    (tmp_path / "k.py").write_text(f"COMPILER = {compiler!r}\n")
    mod = compile_file("k.cu", kernel_root=tmp_path, arch="sm_90", use_cache=False)
    assert [r.kernel for r in mod.resources] == ["k"]
    assert [s.what for s in mod.set_aside] == ["#include <c10/util/Half.h>", "#include <c10/cuda/CUDAException.h>"]
    assert not any(o.startswith(("--pre-include", "-include")) for o in mod.options)
