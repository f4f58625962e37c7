"""Host side of the NVFP4 MoE decode chain: quantizers on ml_dtypes, designed inputs whose
expected values are exact, and the float64 reference of the whole layer.

Why the anchors are exact (docs/moe_decode.md has the long form):

- Norm inputs are built so that mean(v^2) is exactly 1 (values j / 8 with sum(j^2) = 64 n,
  every partial sum of squares exact in f32). rmsnorm's factor is then 1 / sqrt(1 + eps)
  with eps = ANCHOR_EPS = 2^-10, i.e. 1 - 2^-11 to first order: every value after the norm
  sits 2^-11 (relative) below a dyadic value with few significant bits. That offset is far
  larger than the device's own error (rsqrtf 2 ulp plus a few f32 roundings, under 2^-20
  relative) and far smaller than half a bf16 step (2^-9 relative).
- Every rounding the device does (bf16, e4m3, e2m1) is checked on the host with the
  float64 value moved by +-MARGIN (2^-18, relative, four times the device's error bound):
  the design is refused unless both moved values round the same way. So any f32
  evaluation order, and any rsqrtf within its 2 ulp, lands on the host's bits.
- Router logits are integers times powers of two: exact in f32 in any order.
- GLU inputs are 0 or |g| >= 10, where gelu_tanh's tanh argument is at least 43 and
  1 - tanh(43) < 2^-120: tanhf returns exactly +-1 there, so gelu is g or -0 exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from harness.library.dtypes import (bf16, bits_of, decode_e4m3, fp8_e4m3, from_bits, to_bf16, to_fp4_e2m1,
                                    to_fp8_e4m3_saturating, unpack_fp4)

GROUP = 16
ANCHOR_EPS = 2.0**-10
MARGIN = 2.0**-18  # relative: four times the device's error bound on any rounded value
ACT_G = 2.0**-8
ACT_H = 2.0**-6  # not ACT_G: a kernel that quantizes a with act_g is visible
E2M1_MAX = 6.0
E4M3_MAX = 448.0
GELU_SATURATED = 10.0  # |g| >= 10: tanh's argument >= 43.6, tanhf is exactly +-1
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                       dtype=np.float32)


class DesignError(ValueError):
    """A designed input whose expected value is not certain (a rounding too close to call)."""


# ------------------------------------------------------------------ quantizers (ml_dtypes)


def e4m3_sat_bits(x) -> np.ndarray:
    """e4m3fn bits of x, round to nearest even, saturating at +-448 (ml_dtypes would give NaN)."""
    return to_fp8_e4m3_saturating(np.asarray(x, dtype=np.float32)).view(np.uint8)


def e2m1_sat_codes(x) -> np.ndarray:
    """e2m1 codes (0..15) of x, round to nearest even, saturating at +-6; the sign of zero kept."""
    x = np.asarray(x, dtype=np.float32)
    return to_fp4_e2m1(np.clip(x, -E2M1_MAX, E2M1_MAX))


def pack_codes(codes: np.ndarray) -> np.ndarray:
    """Two e2m1 codes a byte, low nibble first, along the last axis."""
    codes = np.asarray(codes, dtype=np.uint8)
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)


def nvfp4_quantize(v, act: float) -> tuple[np.ndarray, np.ndarray]:
    """The contract's NVFP4 quantizer in f32: per block of 16, s = e4m3_sat(amax / (6 act)),
    q = e2m1_sat(v / (f32(s) act)), q = 0 where s = 0. Returns (q packed [..., n/2], s [..., n/16])."""
    v = np.asarray(v, dtype=np.float32)
    blocks = v.reshape(*v.shape[:-1], v.shape[-1] // GROUP, GROUP)
    amax = np.max(np.abs(blocks), axis=-1)
    s = e4m3_sat_bits(amax / np.float32(6.0 * act))
    step = decode_e4m3(s) * np.float32(act)
    with np.errstate(divide="ignore", invalid="ignore"):
        codes = e2m1_sat_codes(blocks / step[..., None])
    codes = np.where(step[..., None] == 0, np.uint8(0), codes)
    return pack_codes(codes.reshape(v.shape)), s


def nvfp4_dequantize(q, s, act: float) -> np.ndarray:
    """bf16(e2m1(q) * (f32(e4m3(s)) * act)), as the kernels stage an NVFP4 activation."""
    q, s = np.asarray(q), np.asarray(s)
    n = q.shape[-1] * 2
    vals = unpack_fp4(q, n)
    step = decode_e4m3(np.asarray(s).view(np.uint8)) * np.float32(act)
    return to_bf16(vals * np.repeat(step, GROUP, axis=-1))


def fp8_token_quantize(n) -> tuple[np.ndarray, np.ndarray]:
    """The dense input: fs = amax / 448 (f32), fq = e4m3_sat(n / fs), 0 where fs = 0."""
    n = np.asarray(n, dtype=np.float32)
    fs = (np.max(np.abs(n), axis=-1) / np.float32(E4M3_MAX)).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        fq = e4m3_sat_bits(n / fs[..., None])
    return np.where(fs[..., None] == 0, np.uint8(0), fq), fs


def e2m1_device_codes(x) -> np.ndarray:
    """A host copy of moe_decode.cu's moe_e2m1 thresholds, for the host test that holds them
    equal to ml_dtypes' rounding on every boundary (not used by any expected value)."""
    x = np.asarray(x, dtype=np.float32)
    a = np.abs(x)
    code = np.select([a <= 0.25, a < 0.75, a <= 1.25, a < 1.75, a <= 2.5, a < 3.5, a <= 5.0], [0, 1, 2, 3, 4, 5, 6], 7)
    return (code | np.where(np.signbit(x), 8, 0)).astype(np.uint8)


# ------------------------------------------------------------------ margin-checked rounding


def _stable(label: str, f, y64: np.ndarray, spread: np.ndarray | float, margin: float = MARGIN) -> np.ndarray:
    """f(y64) after checking f(y64 - d) == f(y64) == f(y64 + d), d = margin * spread."""
    d = margin * np.broadcast_to(np.abs(spread), y64.shape)
    mid, lo, hi = f(y64), f(np.where(d > 0, y64 - d, y64)), f(np.where(d > 0, y64 + d, y64))
    bad = (bits_of(lo) != bits_of(mid)) | (bits_of(hi) != bits_of(mid))
    if np.any(bad):
        first = np.argwhere(bad)[0]
        raise DesignError(f"{label}: {int(bad.sum())} values round differently within {margin:g} (relative); "
                          f"first at {tuple(int(i) for i in first)}: {y64[tuple(first)]!r}")
    return mid


def _bf16_of(y):
    return to_bf16(np.asarray(y, dtype=np.float64).astype(np.float32))


def _e4m3_of(y):
    return e4m3_sat_bits(np.asarray(y, dtype=np.float64).astype(np.float32))


def _e2m1_of(y):
    return e2m1_sat_codes(np.asarray(y, dtype=np.float64).astype(np.float32))


def rms_factor64(v: np.ndarray, eps: float) -> np.ndarray:
    v = np.asarray(v, dtype=np.float64)
    return 1.0 / np.sqrt(np.mean(v * v, axis=-1, keepdims=True) + eps)


# ------------------------------------------------------------------ designed vectors


def unit_rms_codes(n: int, rng: np.random.Generator, *, zero_block: int | None = None, small: int = 12,
                   big: int = 127) -> np.ndarray:
    """Integers j (values j / 8) with sum(j^2) = 64 n exactly, so mean((j/8)^2) = 1: small
    random values, a few raised towards `big` to meet the sum, an optional block of 16 zeros.
    Raised values sit at random positions; |j| <= 127 keeps j / 8 exact in bf16."""
    target = 64 * n
    live = np.ones(n, dtype=bool)
    if zero_block is not None:
        live[zero_block * GROUP:(zero_block + 1) * GROUP] = False
    # Each block of 16 its own magnitude (1 .. small), so the block scales differ from block to block.
    reach = np.repeat(rng.integers(1, small + 1, n // GROUP), GROUP)
    j = np.where(live, rng.integers(-reach, reach + 1), 0).astype(np.int64)
    j[live & (j == 0)] = 1
    for _ in range(20 * n):
        d = target - int(np.sum(j * j))
        if d == 0:
            return j
        small_at = np.flatnonzero(live & (np.abs(j) <= small))
        if d < 0:
            p = rng.choice(np.flatnonzero(live & (np.abs(j) > 1)))
            j[p] -= np.sign(j[p])
            continue
        # One square that meets the remainder exactly, else raise one value towards `big`
        # (or by one step when the remainder is small), and look again.
        want = d + j[small_at] ** 2
        root = np.round(np.sqrt(want)).astype(np.int64)
        hit = small_at[(root * root == want) & (root <= big)]
        if hit.size:
            p = rng.choice(hit)
            j[p] = (1 if j[p] >= 0 else -1) * int(round(np.sqrt(d + int(j[p]) ** 2)))
            continue
        p = rng.choice(small_at)
        grown = min(big, int(np.sqrt(d + int(j[p]) ** 2)))
        if grown <= abs(int(j[p])):
            grown = abs(int(j[p])) + 1
        j[p] = (1 if rng.random() < 0.5 else -1) * grown
    raise DesignError(f"unit_rms_codes: no exact sum of squares for n={n}")


def _is_square(v: int) -> bool:
    r = int(round(np.sqrt(v)))
    return r * r == v


def _pow2_weights(n: int, rng: np.random.Generator, exponents=(-1, 0, 1)) -> np.ndarray:
    """bf16 norm weights +-2^e: multiplying by them adds no significant bits."""
    e = rng.choice(np.asarray(exponents), n)
    return to_bf16(np.where(rng.random(n) < 0.5, -1.0, 1.0) * np.exp2(e))


# ------------------------------------------------------------------ stage 1: post_attn


@dataclass(frozen=True)
class PostAttnCase:
    x: np.ndarray  # bf16 [T, H]
    o: np.ndarray
    w_pa: np.ndarray  # bf16 [H]
    w_router: np.ndarray
    act_g: float
    eps: float
    mid: np.ndarray  # expected bf16 [T, H]
    rr: np.ndarray  # expected bf16 [T, H]
    fq: np.ndarray  # expected uint8 [T, H]
    fs: np.ndarray  # f32 [T] (within FS_RTOL: the rsqrtf error reaches it)
    gq: np.ndarray  # expected uint8 [T, H/2]
    gsc: np.ndarray  # expected uint8 [T, H/16]


FS_RTOL = 2.0**-19  # fs = amax(n) / 448 carries n's own error: rsqrtf 2 ulp + 3 roundings < 2^-20


def post_attn_expected(x, o, w_pa, w_router, act_g: float, eps: float):
    """Float64 post_attn with every rounding margin-checked. Returns (mid, rr, fq, fs, gq, gsc)."""
    x64, o64 = x.astype(np.float64), o.astype(np.float64)
    wpa, wr = w_pa.astype(np.float64), w_router.astype(np.float64)
    term = o64 * rms_factor64(o64, eps) * wpa
    mid = _stable("mid", _bf16_of, x64 + term, np.abs(x64) + np.abs(term))
    m64 = mid.astype(np.float64)
    n = m64 * rms_factor64(m64, eps)
    rr = _stable("rr", _bf16_of, n * wr, n * wr)
    amax = np.max(np.abs(n), axis=-1, keepdims=True)
    fs = (amax[:, 0] / E4M3_MAX).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(amax > 0, n * E4M3_MAX / np.where(amax > 0, amax, 1.0), 0.0)
    fq = _stable("fq", _e4m3_of, ratio, ratio)
    blocks = n.reshape(n.shape[0], -1, GROUP)
    bmax = np.max(np.abs(blocks), axis=-1)
    arg = bmax / (6.0 * act_g)
    s = _stable("gsc", _e4m3_of, arg, arg)
    step = decode_e4m3(s).astype(np.float64) * act_g
    with np.errstate(divide="ignore", invalid="ignore"):
        r = np.where(step[..., None] > 0, blocks / np.where(step[..., None] > 0, step[..., None], 1.0), 0.0)
    codes = _stable("gq", _e2m1_of, r, r)
    codes = np.where(step[..., None] == 0, np.uint8(0), codes)
    return mid, rr, fq, fs, pack_codes(codes.reshape(n.shape)), s


BLOCK_THREADS = 256  # moe_post_attn's block: element i belongs to warp (i % 256) // 32


def warps_owning(h: int) -> int:
    """How many warps of a 256-thread block own at least one of h elements (i = tid + 256 k)."""
    return min(BLOCK_THREADS // 32, -(-min(h, BLOCK_THREADS) // 32))


def _max_into_warp(jm: np.ndarray, jo: np.ndarray, warp: int, zero_block: int) -> tuple[np.ndarray, np.ndarray]:
    """Swap every element of the largest |jm| (with its paired jo) into elements that warp
    `warp` of a 256-thread block owns, outside the zero block: the block's max is then found in
    that warp alone. Swapping pairs keeps sum(j^2) and the magnitude pairing."""
    idx = np.arange(jm.size)
    # Element 0 never holds a maximum: moe_post_attn keeps its normalised row in dynamic shared
    # memory right after the eight warp slots, so a block max reading one slot too far
    # (red[w + 1]) would read element 0 and find token 0's maximum there.
    own = ((idx % BLOCK_THREADS) // 32 == warp) & (idx // GROUP != zero_block) & (idx != 0)
    big = np.abs(jm) == np.abs(jm).max()
    src, dst = np.flatnonzero(big & ~own), np.flatnonzero(own & ~big)
    if src.size > dst.size:
        raise DesignError(f"_max_into_warp: {src.size} maxima do not fit in warp {warp}'s {dst.size} free elements")
    jm, jo = jm.copy(), jo.copy()
    for a, b in zip(src, dst[:src.size]):
        jm[[a, b]], jo[[a, b]] = jm[[b, a]], jo[[b, a]]
    return jm, jo


def post_attn_designed(t: int, h: int, seed: int, *, act_g: float = ACT_G, eps: float = ANCHOR_EPS,
                       zero_token: bool = True, amax_warps: bool = False, o_scale: float = 1.0) -> PostAttnCase:
    """Tokens with mean(o^2) = mean(mid^2) = 1 exactly, a zero block in every live token, the
    last token the zero vector (x = o = 0) when `zero_token`; a few values of 127 / 8 in each
    live token saturate both the block scale (at 448) and e2m1 (at 6). With `amax_warps`, live
    token t's largest |mid| (every element of it) lies in warp t % warps_owning(h) of the
    256-thread block alone, so the block max reads that warp's slot and no other. With
    `o_scale` (a power of two), o is that many times larger, mean(o^2) = o_scale^2: its norm
    undoes the factor, so mid is the same design, and a kernel that does not normalise o (or
    divides by its factor) is off by o_scale (or its square) at every element."""
    if o_scale <= 0 or np.log2(o_scale) != np.round(np.log2(o_scale)):
        raise DesignError(f"post_attn_designed: o_scale {o_scale} is not a power of two (bf16 would round o)")
    for attempt in range(40):
        rng = np.random.default_rng(seed * 1000 + attempt)
        x = np.zeros((t, h))
        o = np.zeros((t, h))
        w_pa = np.abs(_pow2_weights(h, rng, (0,)).astype(np.float64)) * np.where(rng.random(h) < 0.5, -1.0, 1.0)
        live_tokens = t - 1 if zero_token and t > 1 else t
        for tok in range(live_tokens):
            zb = int(rng.integers(h // GROUP))
            jm = unit_rms_codes(h, rng, zero_block=zb)
            jo = unit_rms_codes(h, rng, zero_block=zb)
            # Pair magnitudes (sorted together) so the norm's 2^-11 offset on o * w stays a
            # small fraction of mid's bf16 step; zeros meet zeros.
            order_m = np.argsort(np.abs(jm), kind="stable")
            mags = np.sort(np.abs(jo), kind="stable")
            jo_paired = np.zeros(h, dtype=np.int64)
            jo_paired[order_m] = mags
            jo_paired *= np.where(rng.random(h) < 0.5, -1, 1)
            if amax_warps:
                jm, jo_paired = _max_into_warp(jm, jo_paired, tok % warps_owning(h), zb)
            o[tok] = jo_paired * o_scale / 8.0
            x[tok] = (jm - jo_paired * w_pa) / 8.0
        w_router = _pow2_weights(h, rng)
        xb, ob = to_bf16(x), to_bf16(o)
        if np.any(xb.astype(np.float64) != x) or np.any(ob.astype(np.float64) != o):
            continue
        try:
            mid, rr, fq, fs, gq, gsc = post_attn_expected(xb, ob, to_bf16(w_pa), w_router, act_g, eps)
        except DesignError:
            continue
        # mid must be the designed eighths (mean square exactly 1), so the device's sum of
        # squares is exact and the second norm's factor is 1 / sqrt(1 + eps) too.
        if not np.array_equal(mid.astype(np.float64), x + o / o_scale * w_pa):
            continue
        return PostAttnCase(x=xb, o=ob, w_pa=to_bf16(w_pa), w_router=w_router, act_g=act_g, eps=eps,
                            mid=mid, rr=rr, fq=fq, fs=fs, gq=gq, gsc=gsc)
    raise DesignError(f"post_attn_designed: no design for T={t}, H={h}, seed={seed} within 40 attempts")


# ------------------------------------------------------------------ stage 2: router


@dataclass(frozen=True)
class RouterCase:
    rr: np.ndarray  # bf16 [T, H]
    wr: np.ndarray  # bf16 [E, H]
    pes: np.ndarray  # bf16 [E]
    k: int
    logits: np.ndarray  # f32 [T, E], exact
    ids: np.ndarray  # int32 [T, K]
    wts: np.ndarray  # f32 [T, K] (exact when `equal_top`)
    equal_top: bool


WTS_RTOL = 2.0**-19  # softmax: expf within 2 ulp each, the sum and one IEEE division: < 2^-20


def topk_ties_low(logits: np.ndarray, k: int) -> np.ndarray:
    """Top-k ids by logit, descending, ties to the lowest id."""
    e = logits.shape[-1]
    return np.stack([np.lexsort((np.arange(e), -row))[:k] for row in logits]).astype(np.int32)


def softmax_selected_f32(sel: np.ndarray) -> np.ndarray:
    """The kernel's f32 operations for the weights when all exp(l - max) are exact."""
    sel = sel.astype(np.float32)
    ex = np.exp((sel - sel[..., :1]).astype(np.float64)).astype(np.float32)
    total = np.zeros(sel.shape[:-1], np.float32)
    for k in range(sel.shape[-1]):
        total = (total + ex[..., k]).astype(np.float32)
    return (ex / total[..., None]).astype(np.float32)


def router_designed(t: int, h: int, e: int, k: int, seed: int, *, equal_top: bool = False) -> RouterCase:
    """Logits designed per token through one private column c_t of rr (rr[t, c_t] = 1, the other
    tokens 0 there): logit[t, e] = pes[e] * (R[t, e] + Wr[e, c_t]) with R the integer dot over the
    other columns. Targets: winners away from expert 0; a tie straddling the K boundary (the
    loser has the higher id) and a tie inside the top K (equal_top=False), or K equal winners."""
    if t > h // 4:
        raise DesignError("router_designed needs a private column a token")
    for attempt in range(40):
        rng = np.random.default_rng(seed * 1000 + attempt)
        cols = rng.choice(h, t, replace=False)
        rr = rng.choice(np.array([-2.0, -1.0, 1.0, 2.0]), (t, h))
        rr[:, cols] = 0.0
        rr[np.arange(t), cols] = 1.0
        wr = rng.choice(np.array([-1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0]), (e, h))
        wr[:, cols] = 0.0
        pes = rng.choice(np.array([1 / 16, 1 / 8, 1 / 4]), e)
        # Targets in quarters: winners a quarter apart, losers a quarter to three below the K-th,
        # so a softmax over all E would move every weight by far more than WTS_RTOL.
        units = np.zeros((t, e))
        for tok in range(t):
            perm = rng.permutation(np.arange(1, e))
            winners = perm[:k]
            top = int(rng.integers(8, 17))
            units[tok] = top - (k - 1) - rng.integers(1, 4, e)
            units[tok, 0] = top - (k - 1) - 4  # expert 0 never wins
            if equal_top:
                units[tok, winners] = top
                continue
            units[tok, winners] = top - np.arange(k)
            if k >= 3:
                units[tok, winners[2]] = units[tok, winners[1]]  # a tie inside the top K
            if k < e - 1:
                units[tok, perm[k]] = units[tok, winners[-1]]  # a tie straddling the K boundary
        target = units / 4.0
        r = (rr[:, None, :] * wr[None, :, :]).sum(-1)  # [T, E], integers
        col = target / pes[None, :] - r
        if np.any(np.abs(col) > 256) or np.any(col != np.round(col)):
            continue
        wr[:, cols] = col.T
        logits = (pes[None, :] * ((rr[:, None, :] * wr[None, :, :]).sum(-1))).astype(np.float32)
        if np.any(logits.astype(np.float64) != target):
            continue
        ids = topk_ties_low(logits, k)
        sel = np.take_along_axis(logits, ids, axis=1)
        if equal_top:
            wts = softmax_selected_f32(sel)
        else:
            ex = np.exp(sel.astype(np.float64) - sel[:, :1])
            wts = (ex / ex.sum(-1, keepdims=True)).astype(np.float32)
        return RouterCase(rr=to_bf16(rr), wr=to_bf16(wr), pes=to_bf16(pes), k=k, logits=logits, ids=ids,
                          wts=wts, equal_top=equal_top)
    raise DesignError(f"router_designed: no design for T={t}, H={h}, E={e}, K={k}, seed={seed}")


DOMINANT_LOGIT = 96.0  # more than 88.72 above the rest: exp(l - l_2nd) overflows f32
TINY_WEIGHT = 2.0**-126  # every weight of the dominance token but the top one lies below it


@dataclass(frozen=True)
class RouterEdgeCase:
    """The top-K at its edges, each token one scenario (`kinds`):
    - "edges": winners at the largest ids (E - 1, 224.. when E > 224: the eighth logit a lane)
      and at ids where a wrong lane or slot split of the id shows (32, 64, 65, 96..), the top two tied;
    - "negative": every logit negative, expert 0 the top winner (an initial best of 0, or an
      expert E past the table holding 0, would win);
    - "dominant": one logit DOMINANT_LOGIT, the rest in [-2, 0]: exp(l - max) must subtract the
      top logit itself (exp(l - l_2nd) overflows), w_0 is exactly 1, every other below TINY_WEIGHT.
    rr is one-hot a token (its own column), so logit[t, e] = pes[e] * Wr[e, c_t] = Wr[e, c_t]
    (pes = 1): every logit is a bf16 value, exact."""

    rr: np.ndarray
    wr: np.ndarray
    pes: np.ndarray
    k: int
    kinds: tuple
    logits: np.ndarray  # f32 [T, E], exact
    ids: np.ndarray  # int32 [T, K]
    wts: np.ndarray  # f32 [T, K] float64 softmax (within WTS_RTOL except the dominance token)


def _edge_winners(e: int, k: int, rng) -> np.ndarray:
    first = [x for x in (e - 1, 224, 32, 64, 65, 96, 97, 130, 255, 31) if x < e]
    rest = [x for x in rng.permutation(e).tolist() if x not in first]
    return np.array(list(dict.fromkeys(first + rest))[:k])


def router_edges_designed(h: int, e: int, k: int, seed: int) -> RouterEdgeCase:
    """Three tokens ("edges", "negative", "dominant"); see RouterEdgeCase."""
    if k < 2 or e < k + 2:
        raise DesignError("router_edges_designed needs K >= 2 and E >= K + 2")
    rng = np.random.default_rng(seed)
    kinds = ("edges", "negative", "dominant")
    t = len(kinds)
    logits = np.zeros((t, e))
    # edges: winners from 4.0 down in quarters, the top two tied; losers a quarter to 2 below.
    win = _edge_winners(e, k, rng)
    logits[0] = 4.0 - (k - 1) / 4.0 - rng.integers(1, 9, e) / 4.0
    logits[0, win] = 4.0 - np.arange(k) / 4.0
    logits[0, win[1]] = 4.0
    # negative: expert 0 on top at -1/4, the other winners below it, everything negative.
    win = np.concatenate([[0], rng.choice(np.arange(1, e), k - 1, replace=False)])
    logits[1] = -(k + 1) / 4.0 - rng.integers(1, 9, e) / 4.0
    logits[1, win] = -(1 + np.arange(k)) / 4.0
    # dominant: one expert at DOMINANT_LOGIT, the others in [-2, 0].
    logits[2] = -rng.integers(0, 9, e) / 4.0
    logits[2, int(rng.integers(1, e))] = DOMINANT_LOGIT
    logits = logits + 0.0  # no -0: the device's dot of a one-hot row gives +0 for a zero weight
    cols = rng.choice(h, t, replace=False)
    rr = np.zeros((t, h))
    rr[np.arange(t), cols] = 1.0
    wr = np.zeros((e, h))
    wr[:, cols] = logits.T
    if np.any(to_bf16(wr).astype(np.float64) != wr):
        raise DesignError("router_edges_designed: a logit is not a bf16 value")
    lf = logits.astype(np.float32)
    ids = topk_ties_low(lf, k)
    sel = np.take_along_axis(logits, ids, axis=1)
    ex = np.exp(sel - sel[:, :1])
    wts = (ex / ex.sum(-1, keepdims=True)).astype(np.float32)
    return RouterEdgeCase(rr=to_bf16(rr), wr=to_bf16(wr), pes=to_bf16(np.ones(e)), k=k, kinds=kinds,
                          logits=lf, ids=ids, wts=wts)


@dataclass(frozen=True)
class RouterZeroCase:
    """Tokens whose router input is all zero (rr = bf16(rmsnorm(0) * w) = 0, the zero token of
    post_attn) beside one-hot tokens, `zero` naming which are zero. A zero token's every logit
    is pes[e] * 0 = +0 exactly, all E tie, so its ids are 0..K-1 and its weights exactly 1/K.
    Those zeros are what an accumulator that does not start at +0 shows: a stale value, even a
    denormal that every nonzero dot absorbs, turns them nonzero and moves the selection. The
    one-hot tokens (logit[t, e] = pes[e] * Wr[e, c_t], quarters in [-2, 2], zeros included)
    keep the zero tokens from being the whole input."""

    rr: np.ndarray  # bf16 [T, H]
    wr: np.ndarray  # bf16 [E, H]
    pes: np.ndarray  # bf16 [E], powers of two
    k: int
    zero: tuple  # bool a token
    logits: np.ndarray  # f32 [T, E], exact
    ids: np.ndarray  # int32 [T, K]
    wts: np.ndarray  # f32 [T, K]: exact 1/K for the zero tokens (IEEE 1/K), float64 softmax otherwise


ROUTER_ZERO_TOKENS = (True, False, False, True)  # tokens 0 and 3 zero: the first and a later accumulator


def router_zero_tokens_designed(h: int, e: int, k: int, seed: int) -> RouterZeroCase:
    """See RouterZeroCase."""
    if e < k + 1 or h < 2:
        raise DesignError("router_zero_tokens_designed needs E > K and H >= 2")
    rng = np.random.default_rng(seed)
    zero = ROUTER_ZERO_TOKENS
    t = len(zero)
    cols = rng.choice(h, t, replace=False)
    rr = np.zeros((t, h))
    wr = np.zeros((e, h))
    for tok in range(t):
        if not zero[tok]:
            rr[tok, cols[tok]] = 1.0
            wr[:, cols[tok]] = rng.integers(-8, 9, e) / 4.0 + 0.0  # quarters, zeros among them, no -0
    pes = rng.choice(np.array([1 / 16, 1 / 8, 1 / 4]), e)
    logits = (pes[None, :] * (rr @ wr.T)).astype(np.float32) + np.float32(0.0)
    if np.any(logits.astype(np.float64) != pes[None, :] * (rr @ wr.T)):
        raise DesignError("router_zero_tokens_designed: a logit is not exact in f32")
    ids = topk_ties_low(logits, k)
    sel = np.take_along_axis(logits, ids, axis=1)
    ex = np.exp(sel.astype(np.float64) - sel[:, :1])
    wts = (ex / ex.sum(-1, keepdims=True)).astype(np.float32)
    zrows = np.asarray(zero)
    wts[zrows] = softmax_selected_f32(sel[zrows])  # exp(0) = 1, the sum K, one IEEE division: exact
    return RouterZeroCase(rr=to_bf16(rr), wr=to_bf16(wr), pes=to_bf16(pes), k=k, zero=zero, logits=logits,
                          ids=ids, wts=wts)


# ------------------------------------------------------------------ stage 3: glu (designed g, u)


def glu_saturated(g, u) -> np.ndarray:
    """a = gelu_tanh(g) * u for g = 0 or |g| >= 10, with the kernel's f32 operations and tanh = +-1."""
    g = np.asarray(g, dtype=np.float32)
    u = np.asarray(u, dtype=np.float32)
    if np.any((g != 0) & (np.abs(g) < GELU_SATURATED)):
        raise DesignError(f"glu_saturated: g must be 0 or |g| >= {GELU_SATURATED}")
    tanh = np.where(g == 0, np.float32(0), np.sign(g)).astype(np.float32)
    return (np.float32(0.5) * g * (np.float32(1) + tanh) * u).astype(np.float32)


@dataclass(frozen=True)
class GluCase:
    gu: np.ndarray  # bf16 [slots, 2I], gate half first
    act_h: float
    hq: np.ndarray  # expected uint8 [slots, I/2]
    hs: np.ndarray  # expected uint8 [slots, I/16]


# A block of a = tie * act_h (act_h a power of two): amax = 6 act_h, so s = e4m3(1) = 1 exactly
# and the ratios a / (s act_h) are exactly the ties: every e2m1 rounding midpoint of both signs,
# where round to nearest even decides (0.25 -> 0, 0.75 -> 1.0, 1.25 -> 1.0, 1.75 -> 2.0, ...).
E2M1_TIES = np.array([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, -6.0])
TIE_G = 16.0  # g of the tie block: saturated, so a = g * u exactly with u = tie / 16


def glu_designed(slots: int, i: int, seed: int, act_h: float = 2.0**-2) -> GluCase:
    """g in {0, +-[10, 64]}, u random bf16; one all-zero-g block a slot (hq = hs = 0), blocks
    whose amax saturates the block scale at 448, blocks with -0 products, and a block of exact
    e2m1 ties a slot (E2M1_TIES: a / (s act_h) on every rounding midpoint)."""
    if i // GROUP < 3:
        raise DesignError("glu_designed needs three blocks a slot (zero, saturating, ties)")
    rng = np.random.default_rng(seed)
    mag = to_bf16(rng.uniform(GELU_SATURATED, 64.0, (slots, i))).astype(np.float32)
    g = np.where(rng.random((slots, i)) < 0.25, 0.0, mag * np.where(rng.random((slots, i)) < 0.5, -1.0, 1.0))
    u = to_bf16(rng.normal(0.0, 2.0, (slots, i))).astype(np.float32)
    nb = i // GROUP
    for s in range(slots):
        b, c, d = (int(x) for x in rng.permutation(nb)[:3])
        g[s, b * GROUP:(b + 1) * GROUP] = 0.0
        g[s, c * GROUP] = 64.0
        u[s, c * GROUP] = 48.0  # a = 3072 > 448 * 6 * act_h: the block scale saturates
        g[s, d * GROUP:(d + 1) * GROUP] = TIE_G
        u[s, d * GROUP:(d + 1) * GROUP] = np.roll(E2M1_TIES, s) * act_h / TIE_G  # a = tie * act_h, s = 1
    g, u = to_bf16(g), to_bf16(u)
    a = glu_saturated(g.astype(np.float32), u.astype(np.float32))
    hq, hs = nvfp4_quantize(a, act_h)
    return GluCase(gu=np.concatenate([g, u], axis=1), act_h=act_h, hq=hq, hs=hs)


GLU_MARGIN = 2.0**-14  # relative: 16 times the device's error on a moderate-g GLU value (below)
GLU_MODERATE_NEG = (-1.5, -0.25)  # 1 + tanh(inner) >= 0.134 here: tanhf's 2 ulp stay small against it
GLU_MODERATE_POS = (0.25, 4.0)


def nvfp4_quantize64(a64: np.ndarray, act: float, margin: float, label: str = "glu") -> tuple[np.ndarray, np.ndarray]:
    """The NVFP4 quantizer on float64 values, every rounding (the block scale, each e2m1 code)
    checked to hold for the value moved by +-margin (relative). Returns (q packed, s)."""
    blocks = np.asarray(a64, dtype=np.float64).reshape(*a64.shape[:-1], -1, GROUP)
    arg = np.max(np.abs(blocks), axis=-1) / (6.0 * act)
    s = _stable(f"{label} block scales", _e4m3_of, arg, arg, margin)
    step = decode_e4m3(s).astype(np.float64) * act
    with np.errstate(divide="ignore", invalid="ignore"):
        r = np.where(step[..., None] > 0, blocks / np.where(step[..., None] > 0, step[..., None], 1.0), 0.0)
    codes = _stable(f"{label} codes", _e2m1_of, r, r, margin)
    codes = np.where(step[..., None] == 0, np.uint8(0), codes)
    return pack_codes(codes.reshape(a64.shape)), s


def glu_moderate_designed(slots: int, i: int, seed: int, act_h: float = 2.0**-2) -> GluCase:
    """The GLU off tanh's saturation: g in [-1.5, -0.25] or [0.25, 4], u random bf16, expected
    hq/hs from float64 gelu_tanh(g) * u, every quantization margin-checked at GLU_MARGIN.

    Why the device lands on these bits: its inner argument carries three f32 roundings
    (3 * 2^-24 relative), tanhf is within 2 ulp (2^-23 absolute near 1), 1 + tanh rounds once;
    on g >= -1.5, 1 + tanh(inner) >= 0.134, so the absolute errors (< 3 * 2^-23) are below
    2^-18 relative, and the three products add 3 * 2^-24. The f32 constants differ from the
    float64 ones by under 2^-24 relative. So the device's a is within 2^-18 of float64's, and
    GLU_MARGIN = 2^-14 leaves a factor 16. In this range an inner argument off by a constant
    factor, or a cubic term dropped or doubled, moves gelu by 1 to 25 %, across e2m1 steps."""
    for attempt in range(40):
        rng = np.random.default_rng(seed * 1000 + attempt)
        neg = rng.uniform(*GLU_MODERATE_NEG, (slots, i))
        pos = rng.uniform(*GLU_MODERATE_POS, (slots, i))
        g = to_bf16(np.where(rng.random((slots, i)) < 0.5, neg, pos))
        u = to_bf16(rng.normal(0.0, 2.0, (slots, i)))
        a64 = gelu_tanh64(g.astype(np.float64)) * u.astype(np.float64)
        try:
            hq, hs = nvfp4_quantize64(a64, act_h, GLU_MARGIN, "glu moderate")
        except DesignError:
            continue
        return GluCase(gu=np.concatenate([g, u], axis=1), act_h=act_h, hq=hq, hs=hs)
    raise DesignError(f"glu_moderate_designed: no design for slots={slots}, I={i}, seed={seed}")


# ------------------------------------------------------------------ stage 5: final (designed)


@dataclass(frozen=True)
class FinalCase:
    mid: np.ndarray  # bf16 [T, H]
    dense: np.ndarray  # bf16 [T, H]
    opair: np.ndarray  # bf16 [T, K, H]
    wts: np.ndarray  # f32 [T, K]
    w_d: np.ndarray  # bf16 [H]
    w_m: np.ndarray
    layer_scalar: float
    eps: float
    out: np.ndarray  # expected bf16 [T, H]


def final_expected(mid, dense, opair, wts, w_d, w_m, layer_scalar, eps) -> np.ndarray:
    """Float64 final stage with the rounding margin-checked."""
    m = np.einsum("tk,tkh->th", wts.astype(np.float64), opair.astype(np.float64))
    d64 = dense.astype(np.float64)
    td = d64 * rms_factor64(d64, eps) * w_d.astype(np.float64)
    tm = m * rms_factor64(m, eps) * w_m.astype(np.float64)
    y = (mid.astype(np.float64) + td + tm) * layer_scalar
    spread = (np.abs(mid.astype(np.float64)) + np.abs(td) + np.abs(tm)) * abs(layer_scalar)
    return _stable("out", _bf16_of, y, spread)


def final_designed(t: int, h: int, k: int, seed: int, *, eps: float = ANCHOR_EPS) -> FinalCase:
    """wts = 2^-(K-1-k): the last slot weighs most. Slots 0..K-2 carry w_k * o_k in {+-1/8 ..
    +-1} (multiples of 1/8); the last slot completes m = sum_k w_k o_k to a unit-RMS vector of
    eighths, so every partial sum is exact and dropping any slot moves m by a whole value."""
    for attempt in range(40):
        rng = np.random.default_rng(seed * 1000 + attempt)
        wts = np.tile(np.exp2(-(k - 1 - np.arange(k))), (t, 1)).astype(np.float32)
        mid = np.zeros((t, h))
        dense = np.zeros((t, h))
        opair = np.zeros((t, k, h))
        for tok in range(t):
            mid[tok] = rng.integers(-64, 65, h) / 8.0
            dense[tok] = unit_rms_codes(h, rng) / 8.0
            target = unit_rms_codes(h, rng) / 8.0
            parts = rng.choice(np.array([-8, -5, -3, -1, 1, 2, 4, 7]), (k - 1, h)) / 8.0  # w_k * o_k
            for kk in range(k - 1):
                opair[tok, kk] = parts[kk] / wts[tok, kk]
            opair[tok, k - 1] = (target - parts.sum(0)) / wts[tok, k - 1]
        w_d, w_m = _pow2_weights(h, rng), _pow2_weights(h, rng)
        # No cancellation: keep mid + dense * w_d + m * w_m at least 1/2 away from 0, so the
        # output is not the norms' small offsets alone.
        rest = dense * w_d.astype(np.float64) + np.einsum("tk,tkh->th", wts.astype(np.float64), opair) * w_m.astype(np.float64)
        mid = np.where(np.abs(mid + rest) < 0.5, mid + 2.0, mid)
        ob = to_bf16(opair)
        if np.any(ob.astype(np.float64) != opair):
            continue
        ls = 0.5
        try:
            out = final_expected(to_bf16(mid), to_bf16(dense), ob, wts, w_d, w_m, ls, eps)
        except DesignError:
            continue
        return FinalCase(mid=to_bf16(mid), dense=to_bf16(dense), opair=ob, wts=wts, w_d=w_d, w_m=w_m,
                         layer_scalar=ls, eps=eps, out=out)
    raise DesignError(f"final_designed: no design for T={t}, H={h}, K={k}, seed={seed}")


# ------------------------------------------------------------------ experts


@dataclass(frozen=True)
class ExpertWeights:
    """Host weights of some experts, by expert id: wgu [2I, H/2], sgu [2I, H/16], gs_gu, and
    the down tables likewise."""

    wgu: dict
    sgu: dict
    gs_gu: dict
    wdn: dict
    sdn: dict
    gs_dn: dict


def random_scales(rng, shape) -> np.ndarray:
    """e4m3 bits between 0.25 and ~1.9 (exponent codes 5..7, any mantissa): no zero, no NaN."""
    return (rng.integers(5 << 3, 8 << 3, shape)).astype(np.uint8)


def random_experts(ids, h: int, i: int, seed: int, *, gs_range=(2.0**-7, 2.0**-5)) -> ExpertWeights:
    """Random NVFP4 weights for each expert id in `ids` (every code 0..15, distinct scales)."""
    out = ExpertWeights({}, {}, {}, {}, {}, {})
    for e in sorted({int(v) for v in np.asarray(ids).ravel()}):
        rng = np.random.default_rng([seed, e])
        out.wgu[e] = rng.integers(0, 256, (2 * i, h // 2), dtype=np.uint8)
        out.sgu[e] = random_scales(rng, (2 * i, h // GROUP))
        out.gs_gu[e] = np.float32(rng.uniform(*gs_range))
        out.wdn[e] = rng.integers(0, 256, (h, i // 2), dtype=np.uint8)
        out.sdn[e] = random_scales(rng, (h, i // GROUP))
        out.gs_dn[e] = np.float32(rng.uniform(*gs_range))
    return out


def permuted_table(e: int, seed: int) -> np.ndarray:
    """table[e] = storage slot of expert e: a permutation with no fixed point (E > 1)."""
    rng = np.random.default_rng(seed)
    while True:
        p = rng.permutation(e).astype(np.int32)
        if e == 1 or np.all(p != np.arange(e)):
            return p


# ------------------------------------------------------------------ float64 reference


def gelu_tanh64(g):
    g = np.asarray(g, dtype=np.float64)
    return 0.5 * g * (1.0 + np.tanh(0.7978845608028654 * (g + 0.044715 * g ** 3)))


def dequant_weights64(w, s, gs) -> np.ndarray:
    """gs * e2m1(w) * e4m3(s), float64 [rows, cols]."""
    cols = w.shape[-1] * 2
    vals = unpack_fp4(w, cols).astype(np.float64)
    return float(gs) * vals * np.repeat(decode_e4m3(s).astype(np.float64), GROUP, axis=-1)


@dataclass(frozen=True)
class LayerInputs:
    x: np.ndarray
    o: np.ndarray
    w_pa: np.ndarray
    w_router: np.ndarray
    wr: np.ndarray
    pes: np.ndarray
    dense: np.ndarray
    w_d: np.ndarray
    w_m: np.ndarray
    layer_scalar: float
    eps: float
    act_g: float
    act_h: float


def random_layer(t: int, h: int, e: int, seed: int) -> LayerInputs:
    """Random layer inputs: every token distinct, nothing constant."""
    rng = np.random.default_rng(seed)
    return LayerInputs(
        x=to_bf16(rng.normal(0, 1, (t, h))), o=to_bf16(rng.normal(0, 1, (t, h))),
        w_pa=to_bf16(rng.uniform(0.5, 1.5, h)), w_router=to_bf16(rng.uniform(0.5, 1.5, h)),
        wr=to_bf16(rng.normal(0, 1, (e, h)) / np.sqrt(h)), pes=to_bf16(rng.uniform(0.5, 2.0, e)),
        dense=to_bf16(rng.normal(0, 1, (t, h))), w_d=to_bf16(rng.uniform(0.5, 1.5, h)),
        w_m=to_bf16(rng.uniform(0.5, 1.5, h)), layer_scalar=0.75, eps=1e-6, act_g=ACT_G, act_h=ACT_H)


@dataclass(frozen=True)
class LayerReference:
    out: np.ndarray  # float64 [T, H]
    bound: float  # rel_rms bound for the device's out against `out`


def layer_reference(inp: LayerInputs, ids: np.ndarray, experts: ExpertWeights) -> LayerReference:
    """The layer in float64, no quantization, on the device's ids (top-K flips are not errors).
    The bound: each NVFP4 rounding is uniform within half a grid step, so its RMS error is
    step / sqrt(12); measured on the host's own quantization of the float64 activations, the
    relative RMS errors of the two NVFP4 activations add in quadrature, pass through the
    normalised MoE branch, and are scaled by that branch's share of the output; x4 for the
    spread of a whole-vector RMS, plus 2^-8 for the bf16 roundings of the stages."""
    x, o = inp.x.astype(np.float64), inp.o.astype(np.float64)
    mid = x + o * rms_factor64(o, inp.eps) * inp.w_pa.astype(np.float64)
    n = mid * rms_factor64(mid, inp.eps)
    rr = n * inp.w_router.astype(np.float64)
    logits = inp.pes.astype(np.float64)[None, :] * (rr @ inp.wr.astype(np.float64).T)
    t, h = x.shape
    k = ids.shape[1]
    sel = np.take_along_axis(logits, ids.astype(np.int64), axis=1)
    ex = np.exp(sel - sel.max(-1, keepdims=True))
    wts = ex / ex.sum(-1, keepdims=True)
    moe = np.zeros((t, h))
    err_act = _nvfp4_rel_error(n, inp.act_g)
    err_h = []
    for tok in range(t):
        for kk in range(k):
            e = int(ids[tok, kk])
            wgu = dequant_weights64(experts.wgu[e], experts.sgu[e], experts.gs_gu[e])
            gu = wgu @ n[tok]
            i = gu.size // 2
            a = gelu_tanh64(gu[:i]) * gu[i:]
            err_h.append(_nvfp4_rel_error(a[None, :], inp.act_h))
            moe[tok] += wts[tok, kk] * (dequant_weights64(experts.wdn[e], experts.sdn[e], experts.gs_dn[e]) @ a)
    d = inp.dense.astype(np.float64)
    tm = moe * rms_factor64(moe, inp.eps) * inp.w_m.astype(np.float64)
    out = (mid + d * rms_factor64(d, inp.eps) * inp.w_d.astype(np.float64) + tm) * inp.layer_scalar
    share = float(np.linalg.norm(tm * inp.layer_scalar) / max(np.linalg.norm(out), 1e-30))
    rel = float(np.sqrt(err_act ** 2 + max(err_h) ** 2))
    return LayerReference(out=out, bound=4.0 * share * rel + 2.0**-8)


def _nvfp4_rel_error(v: np.ndarray, act: float) -> float:
    """RMS of step / sqrt(12) over the elements, relative to RMS(v): the expected NVFP4 error."""
    blocks = v.reshape(*v.shape[:-1], -1, GROUP)
    amax = np.max(np.abs(blocks), axis=-1, keepdims=True)
    scale = decode_e4m3(e4m3_sat_bits(amax / (6.0 * act))).astype(np.float64) * act
    r = np.abs(blocks) / np.where(scale > 0, scale, 1.0)
    step = np.select([r < 2.0, r < 4.0], [0.5, 1.0], 2.0) * scale
    num = np.sqrt(np.mean((step / np.sqrt(12.0)) ** 2))
    return float(num / max(np.sqrt(np.mean(v * v)), 1e-30))


# ------------------------------------------------------------------ stage 3: glu (designed weights)


@dataclass(frozen=True)
class GluWeightsCase:
    """moe_glu on designed experts: the production kernel's own g/u rows are exact."""

    ids: np.ndarray  # int32 [T, K]
    gq: np.ndarray  # uint8 [T, H/2]
    gsc: np.ndarray  # uint8 [T, H/16]
    weights: ExpertWeights
    act_g: float
    act_h: float
    gu: np.ndarray  # expected bf16 [T, K, 2I]
    hq: np.ndarray  # expected uint8 [T, K, I/2]
    hs: np.ndarray  # expected uint8 [T, K, I/16]


def _pow2_e4m3(k) -> np.ndarray:
    """e4m3 bits of 2^k (normal range, -6 <= k <= 8)."""
    return ((np.asarray(k) + 7) << 3).astype(np.uint8)


def glu_weights_designed(t: int, h: int, e: int, i: int, k: int, seed: int, *,
                         act_g: float = 1.0, act_h: float = 64.0) -> GluWeightsCase:
    """The activation: e2m1 codes +-1, +-2, +-4 with power-of-two block scales. Each weight row
    has two nonzero groups (at row-dependent places) under one power-of-two scale, zero codes
    elsewhere, gs = 1: every dot is a short sum of dyadic products, exact in any order. Gate rows
    are scaled so |g| lands in [10, 20) (or are all zero: g = 0); up rows get a random power of
    two. So g is 0 or beyond the tanh saturation bound, and a = g * u is exact. act_g = 1 keeps
    every nonzero sum at least 1/8, so a scale of at most 2^7 lifts it past 10 for every token
    that selects the expert; act_h = 64 keeps the large products of a inside the e4m3 range."""
    rng = np.random.default_rng(seed)
    k16 = h // GROUP
    ids = np.stack([rng.choice(np.arange(1, e), k, replace=False) for _ in range(t)]).astype(np.int32)
    codes_x = rng.choice(np.array([2, 4, 6, 10, 12, 14], np.uint8), (t, h))
    gsc = _pow2_e4m3(rng.integers(-2, 3, (t, k16)))
    gq = pack_codes(codes_x)
    x = unpack_fp4(gq, h).astype(np.float64) * np.repeat(decode_e4m3(gsc).astype(np.float64), GROUP, -1) * act_g
    w = ExpertWeights({}, {}, {}, {}, {}, {})
    gu = np.zeros((t, k, 2 * i), dtype=bf16)
    for ex in sorted({int(v) for v in ids.ravel()}):
        codes = np.zeros((2 * i, h), np.uint8)
        scale_k = rng.integers(-2, 3, (2 * i, k16))
        for n in range(2 * i):
            g1 = (7 * n + 3 * ex) % k16
            g2 = (g1 + k16 // 2) % k16
            if n < i and rng.random() < 0.25:
                continue  # a zero gate row: g = 0
            for grp in (g1, g2):
                codes[n, grp * GROUP:(grp + 1) * GROUP] = rng.integers(0, 16, GROUP)
        w.wgu[ex] = pack_codes(codes)
        vals = unpack_fp4(w.wgu[ex], h).astype(np.float64)
        w.gs_gu[ex] = np.float32(1.0)
        w.wdn[ex] = np.zeros((h, i // 2), np.uint8)
        w.sdn[ex] = np.full((h, i // GROUP), 0x38, np.uint8)
        w.gs_dn[ex] = np.float32(1.0)
        # Per-row scale of the two live groups: chosen from the row's own sums.
        users = np.flatnonzero(np.any(ids == ex, axis=1))
        sums = vals @ x[users].T  # [2I, users] with unit group scales; the row's scale multiplies it
        for n in range(2 * i):
            g1 = (7 * n + 3 * ex) % k16
            g2 = (g1 + k16 // 2) % k16
            if n < i:
                live = np.abs(sums[n])[sums[n] != 0]
                m = 0 if live.size == 0 else int(np.ceil(np.log2(10.0 / np.min(live))))
                m = min(max(m, -6), 8)
            else:
                m = int(rng.integers(-2, 3))
            scale_k[n, [g1, g2]] = m
        w.sgu[ex] = _pow2_e4m3(scale_k)
    for tok in range(t):
        for kk in range(k):
            ex = int(ids[tok, kk])
            dq = dequant_weights64(w.wgu[ex], w.sgu[ex], w.gs_gu[ex])
            gu[tok, kk] = to_bf16((dq @ x[tok]).astype(np.float32))
    g, u = gu[..., :i].astype(np.float32), gu[..., i:].astype(np.float32)
    bad = (g != 0) & (np.abs(g) < GELU_SATURATED)
    if np.any(bad):
        raise DesignError(f"glu_weights_designed: {int(bad.sum())} gate values between 0 and {GELU_SATURATED}")
    hq, hs = nvfp4_quantize(glu_saturated(g, u), act_h)
    return GluWeightsCase(ids=ids, gq=gq, gsc=gsc, weights=w, act_g=act_g, act_h=act_h, gu=gu, hq=hq, hs=hs)


# ------------------------------------------------------------------ stage 4: down (full sweep + tail)


@dataclass(frozen=True)
class DownCase:
    """moe_down on random activations and experts at an I whose K16 = I / 16 passes 64: each
    virtual lane v owns a group of the full sweep and, for v < K16 - 64, one of the tail; the
    lanes v = 31 and v = 63 (the last of each half) carry weight."""

    ids: np.ndarray  # int32 [1, K]
    hq: np.ndarray  # uint8 [1, K, I/2]
    hs: np.ndarray  # uint8 [1, K, I/16]
    weights: ExpertWeights
    act_h: float


def down_sweep_designed(h: int, i: int, e: int, k: int, seed: int, act_h: float = ACT_H) -> DownCase:
    if i // GROUP <= 64:
        raise DesignError(f"down_sweep_designed: I={i} gives K16={i // GROUP}, not past one sweep of 64")
    rng = np.random.default_rng(seed)
    ids = rng.choice(e, k, replace=False).astype(np.int32)[None, :]
    hq = rng.integers(0, 256, (1, k, i // 2), dtype=np.uint8)
    hs = random_scales(rng, (1, k, i // GROUP))
    return DownCase(ids=ids, hq=hq, hs=hs, weights=random_experts(ids, h, i, seed=seed), act_h=act_h)


def warp_tree_sum(vals) -> np.ndarray:
    """nvfp4_warp_sum lane by lane, in f32: `v += __shfl_down_sync(full, v, m)` for m = 16 .. 1,
    where a lane past 31 - m reads its own value. Lane 0 ends with the warp's sum (the same bits
    as an xor butterfly's); every other lane with a partial sum, which only a wrong writer stores.
    `vals`: [..., 32]; returns every lane's final value."""
    vals = np.asarray(vals, np.float32)
    lanes = np.arange(32)
    for m in (16, 8, 4, 2, 1):
        src = np.where(lanes + m < 32, lanes + m, lanes)
        vals = (vals + vals[..., src]).astype(np.float32)
    return vals


def nvfp4_rows_in_kernel_order(w, s, gs: float, x, lane_shift: int = 0) -> np.ndarray:
    """A host emulation of the certified GEMV's association order (nvfp4_dot.cuh, 256 threads,
    64 virtual lanes a row, four rows a pass): each lane's groups v, v + 64, ... by fmaf, each
    half's shift-down tree (warp_tree_sum), lo + hi, bf16(gs * sum). `lane_shift` = 1 computes
    what a kernel whose thread roles are off by one (tid = threadIdx.x - 1) gets: physical warp w
    then holds block-virtual lanes 32 w - 1 .. 32 w + 30, and the thread that stores the half (its
    lane 0 by the shifted tid) is physical lane 1, whose tree holds a partial sum. For host tests
    of a design's sensitivity (not an expected value of any gate: the gates compare with the
    device's certified GEMV)."""
    x = np.asarray(x).astype(np.float32)
    rows, kk = w.shape[0], x.size
    k16 = kk // GROUP
    prod = (unpack_fp4(w, kk).astype(np.float32) * x[None, :]).reshape(rows, k16, GROUP)  # exact
    gsum = np.zeros((rows, k16), np.float32)
    for el in range(GROUP):
        gsum = (gsum + prod[..., el]).astype(np.float32)
    sc = decode_e4m3(s).astype(np.float64)
    part = np.zeros((rows, 64), np.float32)
    for v in range(64):
        for grp in range(v, k16, 64):
            part[:, v] = (part[:, v].astype(np.float64) + gsum[:, grp].astype(np.float64) * sc[:, grp]).astype(np.float32)

    out = np.zeros(rows, np.float32)
    for p0 in range(0, rows, 4):
        q = part[p0:p0 + 4].reshape(-1)  # block-virtual lanes of one pass: row o, lane v at 64 o + v
        q = np.concatenate([q, np.zeros(256 - q.size, np.float32)])
        half = np.zeros((4, 2), np.float32)
        for wp in range(8):
            idx = 32 * wp + np.arange(32) - lane_shift
            vals = np.where((idx >= 0) & (idx < 256), q[np.clip(idx, 0, 255)], np.float32(0))
            half[wp // 2, wp % 2] = warp_tree_sum(vals[None, :])[0, lane_shift]
        n = min(4, rows - p0)
        out[p0:p0 + n] = (half[:n, 0] + half[:n, 1]).astype(np.float32)
    return to_bf16(np.float32(gs) * out)
