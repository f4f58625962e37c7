"""The trap shadow: a source compiled with `__trap()` made a count into a module global
(TRAP_SHADOW_SYMBOL), after which the thread goes on.

A mutation campaign runs a trap gate so in the mutant's warm worker (harness.runs.warm): a
guard that fires leaves the context usable, where a real trap costs a fresh process and a
context, and the driver handles traps and makes contexts one at a time. Up to a shadowed
guard's first count, the run is the real run; so the count says the real kernel would have
trapped there (or faulted earlier), and no count with a clean return says the real run
returns as clean. Only the campaign uses it; the gate run's trap gates always trap for real.
"""

TRAP_SHADOW_SYMBOL = "harness_trap_shadow_hits"
TRAP_SHADOW_PREAMBLE = (f"__device__ unsigned int {TRAP_SHADOW_SYMBOL};\n"
                        f"#define __trap() ((void)atomicAdd(&{TRAP_SHADOW_SYMBOL}, 1u))\n"
                        "#line 1\n")
