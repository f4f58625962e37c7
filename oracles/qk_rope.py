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

from harness.library.dtypes import bf16, bits_of, to_bf16

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
    return _rounded(_rotated(n, positions, cos, sin, rotary_dim))


def _rotated(n: np.ndarray, positions, cos, sin, rotary_dim: int) -> np.ndarray:
    """n [T, H, HD] with its first rotary_dim values rotated by the table rows of each token's
    position, in n's dtype (float64 for the anchor, float32 for the kernel's model)."""
    pos = np.asarray(positions)
    c = np.asarray(cos, dtype=n.dtype)[pos][:, None, :]
    s = np.asarray(sin, dtype=n.dtype)[pos][:, None, :]
    half = rotary_dim // 2
    lo, hi = n[..., :half], n[..., half:rotary_dim]
    out = n.copy()
    out[..., :half] = lo * c - hi * s
    out[..., half:rotary_dim] = lo * s + hi * c
    return out


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


# ------------------------------------------------------------------ order-sensitive design (invariance)
#
# The designs above make every output independent of the f32 evaluation order, which is what
# an anchor needs and exactly what an invariance gate must not have: a kernel whose sum of
# squares is reassociated for some batches would pass. Here the inputs are random, the RoPE
# table holds the usual angles, and each rotary pair's partner is chosen so that one of its two
# rotated outputs nearly cancels (x_lo w_lo c ~ x_hi w_hi s): that output is a small difference
# of two products, so the f32 rounding of n = x * inv_rms * w, and with it the last bit of
# inv_rms, shows in its bf16 bits. Another order of the 256 or 512 squares moves inv_rms by an
# ulp for many heads, and the cancelling outputs of those heads by a bf16 bit.

ROPE_BASE = 10000.0
WARP = 32  # qk_rope.cu's kWarp
VEC = 8  # qk_rope.cu's kVec: bf16 values in a lane's 16-byte vector


def rope_tables_generic(cos_max_pos: int, rotary_dim: int, base: float = ROPE_BASE) -> tuple[np.ndarray, np.ndarray]:
    """(cos, sin), f32 [cos_max_pos, rotary_dim / 2], of the usual angles pos * base^(-2j / rotary_dim)."""
    half = rotary_dim // 2
    inv_freq = base ** (-2.0 * np.arange(half) / rotary_dim)
    angle = np.arange(cos_max_pos)[:, None] * inv_freq[None, :]
    return np.cos(angle).astype(np.float32), np.sin(angle).astype(np.float32)


def lane_dims(head_dim: int) -> np.ndarray:
    """[32, HD / 32]: the head dimension in lane l's register i, qk_rope.cu's `dim_of`: chunk i / 8
    covers 256 contiguous values, 8 a lane. gates/test_qk_rope_invariance.py checks this against
    the kernel source: the order-sensitivity claims below are claims about that layout."""
    lane = np.arange(WARP)[:, None]
    i = np.arange(head_dim // WARP)[None, :]
    return (i // VEC) * (WARP * VEC) + lane * VEC + (i % VEC)


def sum_of_squares(x, order: str = "kernel") -> np.ndarray:
    """f32 sum of squares over the last axis (HD) in a named order: `kernel`, as qk_rope.cu's
    inv_rms (each lane adds its registers in turn, then the xor butterfly: every lane ends with the
    same value); `two accumulators`, each lane's even and odd registers summed apart and then added
    (a control's batch-dependent path); `sequential`, d = 0, 1, ... in one accumulator. A square
    of a bf16 value is exact in f32, so a fused multiply-add and a multiply then add agree."""
    x = np.asarray(x).astype(np.float32)
    sq = x * x
    if order == "sequential":
        acc = np.zeros(sq.shape[:-1], np.float32)
        for d in range(sq.shape[-1]):
            acc = acc + sq[..., d]
        return acc
    regs = sq[..., lane_dims(sq.shape[-1])]  # [..., 32, per_lane]
    per_lane = regs.shape[-1]
    if order == "kernel":
        acc = np.zeros(regs.shape[:-1], np.float32)
        for i in range(per_lane):
            acc = acc + regs[..., i]
    elif order == "two accumulators":
        even = np.zeros(regs.shape[:-1], np.float32)
        odd = np.zeros(regs.shape[:-1], np.float32)
        for i in range(0, per_lane, 2):
            even = even + regs[..., i]
            odd = odd + regs[..., i + 1]
        acc = even + odd
    else:
        raise ValueError(f"unknown order {order!r}: kernel, two accumulators or sequential")
    offset = WARP // 2
    while offset:
        acc = acc + acc[..., np.arange(WARP) ^ offset]
        offset //= 2
    return acc[..., 0]


def model_outputs(x, w, positions, cos, sin, rotary_dim: int, eps: float = EPS, order: str = "kernel") -> np.ndarray:
    """A host model of the kernel's Q/K path in f32 (the sum of squares in `order`, inv_rms, n =
    x * inv * w, the rotation as a multiply and a subtract), rounded to bf16: [T, H, HD]. Not an
    anchor (the kernel may contract the rotation into a fused multiply-add); it tells which
    outputs another order of the squares moves, for the design's claims."""
    x = np.asarray(x).astype(np.float32)
    hd = x.shape[-1]
    total = sum_of_squares(x, order)
    inv = np.float32(1.0) / np.sqrt(total / np.float32(hd) + np.float32(eps))
    n = (x * inv[..., None]) * np.asarray(w).astype(np.float32)
    return _rotated(n, positions, cos, sin, rotary_dim).astype(bf16)


def cancelling_partners(x, w, positions, cos, sin, rotary_dim: int) -> np.ndarray:
    """x [T, H, HD] bf16 with x[..., half:rotary_dim] replaced so that, for each pair, the rotated
    output whose coefficients are the larger pair nearly cancels: out_hi = n_lo s + n_hi c ~ 0
    where |s| <= |c| (x_hi = -x_lo w_lo s / (w_hi c)), else out_lo = n_lo c - n_hi s ~ 0
    (x_hi = x_lo w_lo c / (w_hi s)). The partner is never larger than x_lo times w_lo / w_hi."""
    x64 = np.asarray(x).astype(np.float64)
    w64 = np.asarray(w).astype(np.float64)
    half = rotary_dim // 2
    c = np.asarray(cos, np.float64)[np.asarray(positions)][:, None, :]
    s = np.asarray(sin, np.float64)[np.asarray(positions)][:, None, :]
    lo = x64[..., :half] * w64[:half]
    cancel_hi = np.abs(s) <= np.abs(c)
    partner = np.where(cancel_hi, -lo * s / np.where(cancel_hi, c, 1.0), lo * c / np.where(cancel_hi, 1.0, s))
    out = x64.copy()
    out[..., half:rotary_dim] = partner / w64[half:rotary_dim]
    return to_bf16(out)


@dataclass(frozen=True)
class OrderSensitiveCase:
    """Inputs of the invariance and determinism gates, host arrays: q [T, nq, HD], k and v
    [T, nkv, HD] (v None at HD 512), the weights, the generic RoPE tables and each token's
    position (never 0, where sin is 0 and nothing cancels)."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray | None
    q_w: np.ndarray
    k_w: np.ndarray
    cos: np.ndarray
    sin: np.ndarray
    positions: np.ndarray
    rotary_dim: int

    def moved_by(self, order: str, eps: float = EPS) -> np.ndarray:
        """[T]: how many of each token's Q and K outputs the model rounds otherwise when the
        squares are summed in `order` instead of the kernel's."""
        moved = np.zeros(len(self.positions), dtype=np.int64)
        for x, w in ((self.q, self.q_w), (self.k, self.k_w)):
            a = model_outputs(x, w, self.positions, self.cos, self.sin, self.rotary_dim, eps)
            b = model_outputs(x, w, self.positions, self.cos, self.sin, self.rotary_dim, eps, order=order)
            moved += np.count_nonzero(bits_of(a) != bits_of(b), axis=(1, 2))
        return moved


# Magnitudes (log2) of the order-sensitive heads. Each head has one outlier, the first value of
# one lane's 8-value vector (lane_dims; a dimension 8 L below rotary_dim / 2, so its rotary
# partner is computed from it), whose square (2^10 .. 2^12) dominates the sum and leaves an f32
# ulp of 2^-13 .. 2^-11 there, far above the low bits of the small squares (2^-8 .. 2^-4, 16
# significant bits): the outlier's lane rounds at nearly every addition, and at the scale of the
# whole sum, so another grouping of that lane's registers (or of the dimensions) gives another
# sum of squares. With an outlier in every lane the lanes' rounding would drown in the butterfly.
OUTLIER_EXPONENTS = (5.0, 6.0)
SMALL_EXPONENTS = (-4.0, -2.0)


def order_sensitive_case(num_tokens: int, nq: int, nkv: int, head_dim: int, rotary_dim: int, cos_max_pos: int,
                         seed: int) -> OrderSensitiveCase:
    """Random heads (bf16, random signs, log-uniform magnitudes: SMALL_EXPONENTS but for one
    outlier a head, OUTLIER_EXPONENTS), weights in [0.5, 1.5), the usual RoPE angles, token t at
    position 1 + (7 t + 3) % (cos_max_pos - 1), and each rotary pair cancelling
    (cancelling_partners). V is random and weightless (no rotation, nothing cancels)."""
    if cos_max_pos < 2:
        raise ValueError("order_sensitive_case needs a cos table of at least 2 positions (position 0 cancels nothing)")
    rng = np.random.default_rng([seed, num_tokens, nq, nkv, head_dim, rotary_dim])
    positions = (1 + (7 * np.arange(num_tokens) + 3) % (cos_max_pos - 1)).astype(np.int32)
    cos, sin = rope_tables_generic(cos_max_pos, rotary_dim)
    q_w = to_bf16(rng.uniform(0.5, 1.5, head_dim))
    k_w = to_bf16(rng.uniform(0.5, 1.5, head_dim))
    def heads(n):
        shape = (num_tokens, n, head_dim)
        exponent = rng.uniform(*SMALL_EXPONENTS, shape)
        lanes = max(1, (rotary_dim // 2) // VEC)  # an outlier at 8 L < rotary_dim / 2
        outlier = VEC * rng.integers(0, lanes, shape[:2])
        np.put_along_axis(exponent, outlier[..., None], rng.uniform(*OUTLIER_EXPONENTS, (*shape[:2], 1)), axis=-1)
        return to_bf16(rng.choice([-1.0, 1.0], shape) * 2.0**exponent)

    q = cancelling_partners(heads(nq), q_w, positions, cos, sin, rotary_dim)
    k = cancelling_partners(heads(nkv), k_w, positions, cos, sin, rotary_dim)
    v = heads(nkv) if head_dim == 256 else None
    return OrderSensitiveCase(q, k, v, q_w, k_w, cos, sin, positions, rotary_dim)
