// harness shim for NVRTC (no C library headers): limits.h, from libcu++ (which defines the
// macros under NVRTC), so that <climits>, <limits> and this one never define them twice
#pragma once
#include <cuda/std/climits>
