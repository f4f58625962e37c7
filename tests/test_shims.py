"""The NVRTC shim for <algorithm>: std::min and std::max in device code and in constant
expressions, beside the other shims (which bring cuda::std into std) with no ambiguity. The
device view sets an `#include <algorithm>` aside as a host header, so the shim serves code that
got std::min from a header the view set aside (a torch header): the launcher pre-includes it,
as tests/fixtures/torch_ext does."""

import textwrap

from harness.compile import compile_file


def test_std_min_and_max_compile_in_device_code_and_constant_expressions(tmp_path):
    (tmp_path / "k.py").write_text('EXTRA_FLAGS = ("--pre-include=algorithm",)\n')
    (tmp_path / "k.cu").write_text(textwrap.dedent("""\
        #include <cstdint>
        #include <utility>
        #include <type_traits>
        template <int N> struct Traits { static constexpr int kSmem = std::min(N * 4, 32 * 1024); };
        static_assert(Traits<16384>::kSmem == 32 * 1024 && std::max(3, 5) == 5, "constexpr min and max");
        extern "C" __global__ void k(const float* x, float* out, std::int64_t n) {
          const std::int64_t i = threadIdx.x;
          if (i < n) out[i] = std::max(std::min(x[i], 1.0f), -1.0f) + Traits<8>::kSmem;
        }
        """))
    mod = compile_file("k.cu", kernel_root=tmp_path, arch="sm_90", cache_dir=tmp_path / "cache")
    assert mod.backend == "nvrtc" and [r.kernel for r in mod.resources] == ["k"]
    assert "--pre-include=algorithm" in mod.options
