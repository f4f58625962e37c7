// What device code may still need from a host header the device view set aside (a torch,
// ATen or c10 header, <vector>, ...), which in a real build brought these with it: the
// standard integer types and size_t, in std:: and at file scope; the limits macros and
// std::numeric_limits; type traits, std::pair and std::move; the min/max family; __half and
// __nv_bfloat16. harness.compiling.deviceview puts `#include <harness_set_aside.h>` on the line of each
// such #include. Under NVRTC the standard headers below are the harness's shims; under nvcc,
// the real ones.
#pragma once
#include <cstdint>
#include <cstddef>
#include <climits>
#include <cfloat>
#include <initializer_list>
#include <limits>
#include <type_traits>
#include <utility>
#include <algorithm>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
