// harness shim for NVRTC (no C++ standard library): math.h
#pragma once
// the device math functions are built into NVRTC
