"""The trap shadow: a source compiled with `__trap()` made a count into a module global
(TRAP_SHADOW_SYMBOL), after which the thread goes on.

A guard that fires leaves the context usable, where a real trap costs a fresh process and a
context, and the driver handles traps and makes contexts one at a time. Up to a shadowed
guard's first count, the run is the real run; so the count says the real kernel would have
trapped there (or faulted earlier), and no count with a clean return says the real run
returns as clean. A mutation campaign runs its trap gates so in each mutant's warm worker
(harness.runs.warm); the gate run, in a lane of their own (harness.plugin.pool.plan_lanes),
where only a pass is the shadow's word: any other ending is run again, trapping for real.
`--harness-real-traps` (and the campaign's re-check) trap each for real.
"""

TRAP_SHADOW_SYMBOL = "harness_trap_shadow_hits"
TRAP_SHADOW_PREAMBLE = (f"__device__ unsigned int {TRAP_SHADOW_SYMBOL};\n"
                        f"#define __trap() ((void)atomicAdd(&{TRAP_SHADOW_SYMBOL}, 1u))\n"
                        "#line 1\n")
