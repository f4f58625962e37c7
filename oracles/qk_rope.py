"""Host side of the QK RMSNorm + RoPE chain: the designed inputs, the closed-form anchor,
and the paged metadata (windows, CSR, origins) the links run over.

Input design (docs/qk_rope.md says why each choice matters):

- each (token, head) vector is one magnitude m times a sign pattern, so sum(x^2) =
  HD * m^2 is exact in f32 in any order; sign patterns are drawn per (tensor, token,
  head), so no two vectors share one and h -> 2h, h % 8, h +- 1 cannot map onto each other;
- the RoPE table entry for (pos, j) is one of identity (1, 0), swap-negate (0, 1) and
  negate (-1, 0), chosen by (pos + j) % 3: the rotation only moves and negates values;
- norm weights are bf16 values 1 + k/128 times a power of two (w[0] = 1, none zero), and
  K's weights are the negation of Q's;
- eps = 1e-6, so x * inv_rms = sign * (1 - eps / (2 m^2) + ...), within 2^-17 of the bf16
  value sign * w: every output rounds to that value whatever the f32 evaluation order.

A second design (tiny_heads, EPS_TINY) makes eps matter instead of designing it out.

`closed_form` checks that last claim on the inputs it is given and refuses inputs that
do not satisfy it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from harness.dtypes import bf16, to_bf16

EPS = 1e-6
MAGNITUDES = (0.5, 1.0, 1.5, 2.0, 3.0, 0.75)  # bf16-exact, m^2 has few significant bits
# Q, K, V raw inputs draw from different streams, so raw Q and K differ.
TENSOR_Q, TENSOR_K, TENSOR_V = 1, 2, 3
# Largest relative distance from a pre-rounding value to its bf16 rounding that the
# design allows: f32 evaluation (a few ulp, 2^-22 relative) cannot move a value that
# close to its bf16 neighbour (half an ulp, >= 2^-9 relative) across a rounding boundary.
DESIGN_MARGIN = 2.0**-14


def designed_heads(tensor: int, num_tokens: int, num_heads: int, head_dim: int) -> np.ndarray:
    """[T, H, HD] bf16: per (token, head) one magnitude times a random sign pattern."""
    rng = np.random.default_rng([tensor, num_tokens, num_heads, head_dim])
    signs = rng.choice(np.array([-1.0, 1.0]), size=(num_tokens, num_heads, head_dim))
    t = np.arange(num_tokens)[:, None]
    h = np.arange(num_heads)[None, :]
    mags = np.asarray(MAGNITUDES)[(3 * t + 5 * h + tensor) % len(MAGNITUDES)]
    return to_bf16(signs * mags[..., None])


# Where eps matters. With every element +-TINY the mean square is TINY^2 =
# 2^-20, and EPS_TINY = 3 * 2^-20 makes mean + eps = 2^-18 exactly: inv_rms = 2^9 and
# x * inv_rms = +-1/2, all exact in f32, so the outputs are exact bf16 values (+-w / 2, moved
# and negated by the rotation). An eps dropped doubles them; an eps added outside the square
# root, or inside it scaled, moves them off their bf16 values. A zero vector has inv_rms =
# 1 / sqrt(eps): finite only while eps is there, so its outputs are zeros (the contract fixes
# their magnitude, not the sign of a zero, which follows the evaluation order).
TINY = 2.0**-10
EPS_TINY = 3.0 * 2.0**-20


def tiny_heads(tensor: int, num_tokens: int, num_heads: int, head_dim: int, *, zero_every: int = 0) -> np.ndarray:
    """[T, H, HD] bf16: every element +-TINY, a random sign pattern per (token, head)
    (different streams per tensor, as designed_heads); with zero_every > 0, the heads with
    (3 t + h + tensor) % zero_every == 0 are the zero vector."""
    rng = np.random.default_rng([tensor, num_tokens, num_heads, head_dim, 11])
    signs = rng.choice(np.array([-1.0, 1.0]), size=(num_tokens, num_heads, head_dim))
    x = signs * TINY
    if zero_every:
        t = np.arange(num_tokens)[:, None]
        h = np.arange(num_heads)[None, :]
        x[(3 * t + h + tensor) % zero_every == 0] = 0.0
    return to_bf16(x)


def norm_weights(head_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """(q_w, k_w), bf16 [HD]: w[d] = (1 + (d % 128) / 128) * 2^((d // 128) % 4); k_w = -q_w."""
    d = np.arange(head_dim)
    q_w = (1.0 + (d % 128) / 128.0) * 2.0 ** ((d // 128) % 4)
    return to_bf16(q_w), to_bf16(-q_w)


def rope_tables(cos_max_pos: int, rotary_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """(cos, sin), f32 [cos_max_pos, rotary_dim / 2], unit coefficients repeating every
    three positions: (pos + j) % 3 -> identity (1, 0), swap-negate (0, 1), negate (-1, 0)."""
    pattern_cos = np.array([1.0, 0.0, -1.0], dtype=np.float32)
    pattern_sin = np.array([0.0, 1.0, 0.0], dtype=np.float32)
    k = (np.arange(cos_max_pos)[:, None] + np.arange(rotary_dim // 2)[None, :]) % 3
    return pattern_cos[k], pattern_sin[k]


def _rounded(exact: np.ndarray) -> np.ndarray:
    """bf16 of float64 values, refusing any that is not within DESIGN_MARGIN of it."""
    out = exact.astype(bf16)
    back = out.astype(np.float64)
    scale = np.maximum(np.abs(exact), np.finfo(np.float64).tiny)
    worst = float(np.max(np.abs(back - exact) / scale)) if exact.size else 0.0
    if not worst <= DESIGN_MARGIN:
        raise ValueError(
            f"closed_form: a value lies {worst:.3g} (relative) from its bf16 rounding, more than the "
            f"design margin {DESIGN_MARGIN:.3g}, so the expected bits are not exact: build the inputs "
            "with designed_heads, norm_weights and rope_tables"
        )
    return out


def _inv_rms(x: np.ndarray, eps: float) -> np.ndarray:
    x = x.astype(np.float64)
    return 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def closed_form(x, w, positions, cos, sin, rotary_dim: int, eps: float = EPS) -> np.ndarray:
    """The anchor for Q or K: [T, H, HD] bf16 from raw x [T, H, HD], weight w [HD], the
    token positions and the tables, in float64, rounded once to bf16."""
    x64 = np.asarray(x).astype(np.float64)
    n = x64 * _inv_rms(x64, eps) * np.asarray(w).astype(np.float64)
    pos = np.asarray(positions)
    c = np.asarray(cos, dtype=np.float64)[pos][:, None, :]
    s = np.asarray(sin, dtype=np.float64)[pos][:, None, :]
    half = rotary_dim // 2
    lo, hi = n[..., :half], n[..., half:rotary_dim]
    out = n.copy()
    out[..., :half] = lo * c - hi * s
    out[..., half:rotary_dim] = lo * s + hi * c
    return _rounded(out)


def closed_form_weightless(x, eps: float = EPS) -> np.ndarray:
    """The anchor for the V slot: bf16(x * inv_rms), no weight, no rotation."""
    x64 = np.asarray(x).astype(np.float64)
    return _rounded(x64 * _inv_rms(x64, eps))


# ------------------------------------------------------------------ paged metadata


@dataclass(frozen=True)
class PagedScenario:
    """One request of num_tokens tokens at start_pos + t, and the decode batch over the
    same positions.

    Prefill: `window` holds the pool pages of logical pages page_origin, page_origin + 1, ...
    Decode: token b's window is compressed to start at its own logical page (its origin),
    each a separate CSR span of `decode_indices`, which begins with a junk entry naming a
    valid but unreferenced page, so a dereference that ignores the CSR begin lands visibly.
    """

    page_size: int = 4
    num_layers: int = 2
    layer: int = 1  # layer 0 must stay zero
    num_pages: int = 6
    start_pos: int = 6
    num_tokens: int = 10
    page_origin: int = 1
    window: tuple[int, ...] = (4, 1, 3)  # logical pages 1, 2, 3; pages 0, 2, 5 unreferenced
    junk_page: int = 2

    def __post_init__(self) -> None:
        if self.junk_page in self.window or not 0 <= self.junk_page < self.num_pages:
            raise ValueError(f"junk_page {self.junk_page} must be a valid page outside the window {self.window}")
        if self.num_pages - 1 in self.window:
            raise ValueError(
                f"the window {self.window} must leave the last page {self.num_pages - 1} unreferenced, so a "
                "perturbed address that overruns a page stays inside the pool (and fails by assertion)"
            )
        if self.page_origin * self.page_size > self.start_pos:
            raise ValueError("page_origin must be the logical page of start_pos or before it")
        if (self.start_pos + self.num_tokens - 1) // self.page_size - self.page_origin >= len(self.window):
            raise ValueError(f"the window {self.window} does not cover the request's last position")

    @property
    def positions(self) -> np.ndarray:
        return np.arange(self.start_pos, self.start_pos + self.num_tokens, dtype=np.int32)

    @property
    def unreferenced_pages(self) -> tuple[int, ...]:
        return tuple(p for p in range(self.num_pages) if p not in self.window)

    def decode_origins(self) -> np.ndarray:
        return (self.positions // self.page_size).astype(np.int32)

    def decode_csr(self, junk_lead: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """(page_indptr [B + 1], page_indices): token b's window covers logical pages
        origins[b] .. the request's last page. junk_lead=False drops the junk entry, so token
        0's span begins at entry 0 (the CSR begin guard's boundary)."""
        indices = [self.junk_page] if junk_lead else []
        indptr = [len(indices)]
        for origin in self.decode_origins():
            indices.extend(self.window[origin - self.page_origin:])
            indptr.append(len(indices))
        return np.asarray(indptr, dtype=np.int32), np.asarray(indices, dtype=np.int32)


# The request of the origin-0 links: positions 1..11 from logical
# page 0, so the prefill window's origin is page 0 and decode tokens 0-2 have origin 0; 11
# tokens make 11 * (4 + 2) = 66 jobs, not a multiple of the kernel's 4 warps a block. The
# window's fourth entry (pool page 0) covers position 12, one past the request: a warp past
# the last job (its tail guard gone) finds a valid page there and lands visibly.
ORIGIN0_SCENARIO = PagedScenario(start_pos=1, num_tokens=11, page_origin=0, window=(4, 1, 3, 0), junk_page=2)

# Page size 1 (the smallest the page-size guard admits): the origin-0 request's positions 1..11
# on logical pages 1..11 of a window from page 0, twelve pool pages shuffled, junk page 5 and the
# last page 13 unreferenced.
PAGE1_SCENARIO = PagedScenario(page_size=1, num_pages=14, start_pos=1, num_tokens=11, page_origin=0,
                               window=(12, 0, 7, 3, 9, 1, 11, 4, 8, 2, 10, 6), junk_page=5)
