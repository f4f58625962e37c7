"""The compile path: a `.cu` to a cubin with NVRTC through cuda.core (or nvcc), through its
device-only view, cached by its whole source closure. `compile` (`compile_file`) and what it
stands on: `options` (the options NVRTC receives, as recorded), `includes` (include paths, a
source's closure), `backends`, `arch`, `cubin_cache`, `toolchain`, `ptxas`, `trap_shadow`,
`modsettings` (a launcher's declared settings), `kernelfile` (what a kernel file's compile
gate expects), `deviceview` and `closureview` (the views of a `.cu` and its headers),
`cuda_syntax` (the one CUDA syntax tree), `cpp_text`; `shims/` (the standard headers NVRTC
lacks) and `standin/` (what a set-aside host header's line includes instead)."""
