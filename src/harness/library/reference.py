"""A reference implementation as a gate's oracle: the torch function a kernel tree already
tests its kernel against (`ref_impl(x)`), named in the gate's report.

    from harness.library.reference import torch_reference
    ref = torch_reference(hadamard_transform_ref)       # the tree's own torch reference
    assert_bits_eq("out", out, ref(x, scale))            # a link: bit-exact by construction
    assert_close("out", out, ref(x, scale), atol=..., rtol=...)  # an anchor: a stated tolerance

Each call notes the function on the running gate; the report then says which gates took a
torch function as their oracle and how each compared (`gates.json`: `oracle`, `compared`;
`summary.md`: the Oracles table). The gate's kind says which it is: `link` when the reference
is bit-exact by construction (say why beside the call), `anchor` with the tolerance's reason.
torch is never imported here.
"""

from __future__ import annotations

import functools

from harness.library import coverage


def torch_reference(fn, name: str | None = None):
    """`fn` wrapped so that each call records it as the running gate's oracle, as
    `torch <module>.<name>` (or `torch <name>` when given)."""
    label = f"torch {name or f'{fn.__module__}.{fn.__qualname__}'}"

    @functools.wraps(fn)
    def call(*args, **kwargs):
        coverage.note_oracle(label)
        return fn(*args, **kwargs)

    call.oracle = label
    return call
