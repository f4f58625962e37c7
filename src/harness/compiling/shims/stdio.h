// harness shim for NVRTC (no C++ standard library): stdio.h
#pragma once
// printf is built into NVRTC
