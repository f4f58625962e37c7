"""`host_cache`: a per-process cache of pure host data that a warm campaign worker may keep.

A mutation campaign's warm worker serves one mutant after another. Between them it clears
every functools cache of the project's own modules (`harness.workers.reset_for_next_mutant`),
because a cache may hold what a mutated kernel computed or a device buffer a stray store
hit. A cache whose values are computed on the host alone (random inputs, a float64
reference), never by a kernel and never on the device, is the same for every mutant:
mark it with `@host_cache` and it survives, so each mutant does not pay for it again.
"""

from __future__ import annotations

import functools


def host_cache(fn):
    """`functools.cache`, marked as holding host-only data (kept across mutants)."""
    cached = functools.cache(fn)
    cached.harness_host_cache = True
    return cached
