// harness shim for NVRTC (no C++ standard library): stdint.h
#pragma once
#include <cuda/std/cstdint>
