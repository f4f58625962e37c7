"""What a gate author calls: `kernels` (a module compiled and loaded, the launch hook), `launch`
(argument checks, refusals), `bits` (`assert_bits_eq`, `assert_close`), `dtypes` (bf16, fp8,
fp4 on ml_dtypes), `tensors` (torch tensors read by their bits), `buffers` (sentinels, guard
zones), `redzones` (guard regions around every buffer `buffers` makes, checked on the device
after each launch), `invariance` (batch invariance, determinism), `arms` (a gate's recorded outputs),
`reference` (a torch function as an oracle), `source` (structural reading of `.cu` text),
`caching` (`host_cache`), `timing`, `coverage` (what a gate loaded and read) and
`ref_launchers` (a comparison's REF side runs REF's launchers). `from harness import ...`
re-exports the names most gates use."""
