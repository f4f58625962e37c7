// harness shim for NVRTC (no C++ standard library): stddef.h
#pragma once
#include <cuda/std/cstddef>
