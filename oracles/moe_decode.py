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

from harness.library.dtypes import (bf16, bits_of, decode_e2m1, decode_e4m3, fp8_e4m3, from_bits, to_bf16, to_fp4_e2m1,
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


def _unstable(f, y64: np.ndarray, spread: np.ndarray | float, margin: float = MARGIN) -> tuple[np.ndarray, np.ndarray]:
    """(f(y64), where f(y64 - d) or f(y64 + d) differs from it), d = margin * spread."""
    d = margin * np.broadcast_to(np.abs(spread), y64.shape)
    mid, lo, hi = f(y64), f(np.where(d > 0, y64 - d, y64)), f(np.where(d > 0, y64 + d, y64))
    return mid, (bits_of(lo) != bits_of(mid)) | (bits_of(hi) != bits_of(mid))


def _stable(label: str, f, y64: np.ndarray, spread: np.ndarray | float, margin: float = MARGIN) -> np.ndarray:
    """f(y64) after checking f(y64 - d) == f(y64) == f(y64 + d), d = margin * spread."""
    mid, bad = _unstable(f, y64, spread, margin)
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
ROUTER_DENSE_H = 4096  # router_designed: Wr a fifth nonzero up to this H, 4096 / (5 H) past it (dots within 256)


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
    other columns. Targets: winners away from expert 0 (unless K = E); a tie straddling the K
    boundary (the loser has the higher id) and a tie inside the top K (equal_top=False), or K
    equal winners."""
    if t > h // 4:
        raise DesignError("router_designed needs a private column a token")
    for attempt in range(40):
        rng = np.random.default_rng(seed * 1000 + attempt)
        cols = rng.choice(h, t, replace=False)
        rr = rng.choice(np.array([-2.0, -1.0, 1.0, 2.0]), (t, h))
        rr[:, cols] = 0.0
        rr[np.arange(t), cols] = 1.0
        if h <= ROUTER_DENSE_H:
            wr = rng.choice(np.array([-1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0]), (e, h))
        else:  # sparser, so the private column's integer stays within 256 (bf16-exact)
            live = rng.random((e, h)) < 0.2 * ROUTER_DENSE_H / h
            wr = np.where(live, rng.choice(np.array([-1.0, 1.0]), (e, h)), 0.0)
        wr[:, cols] = 0.0
        pes = rng.choice(np.array([1 / 16, 1 / 8, 1 / 4]), e)
        # Targets in quarters: winners a quarter apart, losers a quarter to three below the K-th,
        # so a softmax over all E would move every weight by far more than WTS_RTOL.
        units = np.zeros((t, e))
        for tok in range(t):
            # Expert 0 never wins unless every expert does (K = E).
            perm = rng.permutation(np.arange(1, e)) if k < e else rng.permutation(e)
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
        r = rr @ wr.T  # [T, E], integers: exact in float64
        col = target / pes[None, :] - r
        if np.any(np.abs(col) > 256) or np.any(col != np.round(col)):
            continue
        wr[:, cols] = col.T
        logits = (pes[None, :] * (rr @ wr.T)).astype(np.float32)
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


def quantized_glu(gu: np.ndarray, i: int, act_h: float, who: str) -> tuple[np.ndarray, np.ndarray]:
    """(hq, hs): the GLU of a design's bf16 gate/up outputs `gu` [..., 2I], NVFP4-quantised under
    `act_h`; a gate value between 0 and GELU_SATURATED (where tanh is not +-1 in f32) is a
    DesignError naming the design `who` and how many."""
    g, u = gu[..., :i].astype(np.float32), gu[..., i:].astype(np.float32)
    bad = (g != 0) & (np.abs(g) < GELU_SATURATED)
    if np.any(bad):
        raise DesignError(f"{who}: {int(bad.sum())} gate values between 0 and {GELU_SATURATED}")
    return nvfp4_quantize(glu_saturated(g, u), act_h)


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


def _final64(mid, dense, opair, wts, w_d, w_m, layer_scalar, eps) -> tuple[np.ndarray, np.ndarray]:
    """The final stage's float64 output before its bf16 rounding, and the spread of its terms."""
    m = np.einsum("tk,tkh->th", wts.astype(np.float64), opair.astype(np.float64))
    d64 = dense.astype(np.float64)
    td = d64 * rms_factor64(d64, eps) * w_d.astype(np.float64)
    tm = m * rms_factor64(m, eps) * w_m.astype(np.float64)
    y = (mid.astype(np.float64) + td + tm) * layer_scalar
    return y, (np.abs(mid.astype(np.float64)) + np.abs(td) + np.abs(tm)) * abs(layer_scalar)


def final_expected(mid, dense, opair, wts, w_d, w_m, layer_scalar, eps) -> np.ndarray:
    """Float64 final stage with the rounding margin-checked."""
    return _stable("out", _bf16_of, *_final64(mid, dense, opair, wts, w_d, w_m, layer_scalar, eps))


def final_designed(t: int, h: int, k: int, seed: int, *, eps: float = ANCHOR_EPS, repair: bool = False) -> FinalCase:
    """wts = 2^-(K-1-k): the last slot weighs most. Slots 0..K-2 carry w_k * o_k in {+-1/8 ..
    +-1} (multiples of 1/8); the last slot completes m = sum_k w_k o_k to a unit-RMS vector of
    eighths, so every partial sum is exact and dropping any slot moves m by a whole value.
    With `repair`, an output whose rounding is too close to call moves its mid by 1/4 (mid is
    an input of its element alone) instead of the design starting over: at T * H in the tens of
    thousands some element nearly always is."""
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
        for _ in range(8 if repair else 0):
            _, bad = _unstable(_bf16_of, *_final64(to_bf16(mid), to_bf16(dense), ob, wts, w_d, w_m, ls, eps))
            if not bad.any():
                break
            mid = np.where(bad, mid + 0.25, mid)
            mid = np.where(np.abs(mid + rest) < 0.5, mid + 2.0, mid)
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
    hq, hs = quantized_glu(gu, i, act_h, "glu_weights_designed")
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


# ------------------------------------------------------------------ sparse designed experts (sweep, big index)
#
# glu_weights_designed at production sizes is seconds of Python a shape; these are its design
# vectorised, for any ids: every expert row has two live groups (at places that depend on the
# row and the expert) under one power-of-two scale, zero codes elsewhere, gs = 1; activations
# are e2m1 codes +-1, +-2, +-4 under power-of-two block scales. Every dot is then a short sum of
# dyadic products, exact in f32 in any order, so the kernel's bf16 rows are known bit for bit.
# On the device the zero groups' scales are 1.0 (a zero code times a finite scale adds 0) and
# every expert no token selects keeps NaN scales (sparse_device_experts).

DYADIC_CODES = np.array([2, 4, 6, 10, 12, 14], np.uint8)  # e2m1 +-1, +-2, +-4


@dataclass(frozen=True)
class SparseExperts:
    """Designed rows of some experts over K inputs, by expert id: `groups` [rows, 2] the live
    groups, `codes` uint8 [rows, 2, 16] their e2m1 codes, `scales` uint8 [rows] the e4m3 scale
    both share (a power of two)."""

    k: int
    groups: dict
    codes: dict
    scales: dict

    def dense(self, e: int) -> tuple[np.ndarray, np.ndarray]:
        """Expert e's whole tables on the host: (codes [rows, K/2] packed, scales [rows, K/16]),
        zero codes under scale 1.0 off the live groups."""
        rows = self.groups[e].shape[0]
        codes = np.zeros((rows, self.k // GROUP, GROUP), np.uint8)
        scales = np.full((rows, self.k // GROUP), 0x38, np.uint8)
        r = np.arange(rows)[:, None]
        codes[r, self.groups[e]] = self.codes[e]
        scales[r, self.groups[e]] = self.scales[e][:, None]
        return pack_codes(codes.reshape(rows, self.k)), scales

    def dots(self, e: int, x: np.ndarray) -> np.ndarray:
        """float64 [n, rows]: expert e's rows against activations x [n, K] (gs = 1), exact."""
        x = np.asarray(x, np.float64).reshape(x.shape[0], self.k // GROUP, GROUP)
        xg = x[:, self.groups[e]]  # [n, rows, 2, 16]
        vals = decode_e2m1(self.codes[e]).astype(np.float64)
        return np.einsum("nrgj,rgj->nr", xg, vals) * decode_e4m3(self.scales[e]).astype(np.float64)[None, :]


def _live_groups(rows: int, k16: int, e: int, stride: int) -> np.ndarray:
    g1 = (stride * np.arange(rows) + 3 * e) % k16
    return np.stack([g1, (g1 + k16 // 2) % k16], axis=1)


def _dyadic_activation(rng, lead: tuple, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(packed codes [..., K/2], e4m3 block scales [..., K/16]): codes +-1, +-2, +-4 under 2^-2 .. 2^2."""
    codes = rng.choice(DYADIC_CODES, (*lead, k))
    return pack_codes(codes), _pow2_e4m3(rng.integers(-2, 3, (*lead, k // GROUP)))


@dataclass(frozen=True)
class GluSparseCase:
    ids: np.ndarray  # int32 [T, K]
    gq: np.ndarray  # uint8 [T, H/2]
    gsc: np.ndarray  # uint8 [T, H/16]
    weights: SparseExperts  # 2I rows over H: gate rows then up rows
    act_g: float
    act_h: float
    gu: np.ndarray  # expected bf16 [T, K, 2I]
    hq: np.ndarray  # expected uint8 [T, K, I/2]
    hs: np.ndarray  # expected uint8 [T, K, I/16]


def glu_sparse_designed(ids, h: int, i: int, seed: int, *, act_g: float = 1.0, act_h: float = 64.0) -> GluSparseCase:
    """glu_weights_designed's design, vectorised, on any ids [T, K]: gate rows scaled so every
    token that selects the expert sees g = 0 or |g| >= 10 (a quarter of them all zero), up rows
    under a random power of two; act_g = 1 keeps every nonzero dot at least 1/8, so a scale of
    at most 2^7 lifts it past 10, and act_h = 64 keeps a = g * u inside e4m3's range."""
    ids = np.asarray(ids, np.int32)
    t, k = ids.shape
    rng = np.random.default_rng([seed, h, i, t, k, 6])
    gq, gsc = _dyadic_activation(rng, (t,), h)
    x = unpack_fp4(gq, h).astype(np.float64) * np.repeat(decode_e4m3(gsc).astype(np.float64), GROUP, -1) * act_g
    w = SparseExperts(h, {}, {}, {})
    gu = np.zeros((t, k, 2 * i), np.float64)
    for e in sorted({int(v) for v in ids.ravel()}):
        w.groups[e] = _live_groups(2 * i, h // GROUP, e, 7)
        codes = rng.integers(0, 16, (2 * i, 2, GROUP), dtype=np.uint8)
        codes[:i][rng.random(i) < 0.25] = 0  # gate rows that give g = 0
        w.codes[e] = codes
        w.scales[e] = np.full(2 * i, 0x38, np.uint8)
        users = np.flatnonzero(np.any(ids == e, axis=1))
        sums = w.dots(e, x[users])  # [users, 2I] under scale 1
        live = np.where(sums[:, :i] != 0, np.abs(sums[:, :i]), np.inf).min(axis=0)
        m = np.where(np.isfinite(live), np.ceil(np.log2(10.0 / np.where(np.isfinite(live), live, 1.0))), 0)
        w.scales[e] = _pow2_e4m3(np.concatenate([np.clip(m, -6, 8), rng.integers(-2, 3, i)]).astype(np.int64))
        for tok, kk in zip(*np.nonzero(ids == e)):
            gu[tok, kk] = w.dots(e, x[tok:tok + 1])[0]
    gu = to_bf16(gu.astype(np.float32))
    hq, hs = quantized_glu(gu, i, act_h, "glu_sparse_designed")
    return GluSparseCase(ids=ids, gq=gq, gsc=gsc, weights=w, act_g=act_g, act_h=act_h, gu=gu, hq=hq, hs=hs)


@dataclass(frozen=True)
class DownSparseCase:
    ids: np.ndarray  # int32 [T, K]
    hq: np.ndarray  # uint8 [T, K, I/2]
    hs: np.ndarray  # uint8 [T, K, I/16]
    weights: SparseExperts  # H rows over I
    act_h: float
    opair: np.ndarray  # expected bf16 [T, K, H]


def down_sparse_designed(ids, h: int, i: int, seed: int, *, act_h: float = ACT_H) -> DownSparseCase:
    """Each slot's activation dyadic (codes +-1, +-2, +-4 under 2^-2 .. 2^2, act_h a power of
    two), each down row two live groups under 2^-3 .. 2^3: opair = bf16 of an exact dot."""
    ids = np.asarray(ids, np.int32)
    t, k = ids.shape
    rng = np.random.default_rng([seed, h, i, t, k, 7])
    hq, hs = _dyadic_activation(rng, (t, k), i)
    x = unpack_fp4(hq, i).astype(np.float64) * np.repeat(decode_e4m3(hs).astype(np.float64), GROUP, -1) * act_h
    w = SparseExperts(i, {}, {}, {})
    opair = np.zeros((t, k, h), np.float64)
    for e in sorted({int(v) for v in ids.ravel()}):
        w.groups[e] = _live_groups(h, i // GROUP, e, 5)
        w.codes[e] = rng.integers(0, 16, (h, 2, GROUP), dtype=np.uint8)
        w.scales[e] = _pow2_e4m3(rng.integers(-3, 4, h))
        for tok, kk in zip(*np.nonzero(ids == e)):
            opair[tok, kk] = w.dots(e, x[tok, kk][None, :])[0]
    return DownSparseCase(ids=ids, hq=hq, hs=hs, weights=w, act_h=act_h, opair=to_bf16(opair.astype(np.float32)))


# ------------------------------------------------------------------ f32 evaluation orders (host emulation)
#
# The invariance and determinism gates compare the device with itself, so their inputs must make
# the order of every reduction visible: a kernel that sums in another order for some batches
# must change an output bit. The functions below emulate, exactly in f32, the order each kernel
# of moe_decode.cu reduces in ("kernel") and the orders a batch-dependent kernel might take
# instead; the designs further down are checked against them (tests/test_moe_decode_oracles.py).
# They are not expected values of any gate: the gates compare the device with itself.


def fma32(a, b, c) -> np.ndarray:
    """fmaf(a, b, c) on f32 values, exactly: a * b is exact in float64 (two 24-bit significands),
    the float64 sum's own rounding error is recovered (TwoSum), and a float64 sum that lands on
    an f32 rounding midpoint is moved to the side the exact value lies on before the f32 rounding."""
    a64, b64, c64 = (np.asarray(v, np.float32).astype(np.float64) for v in (a, b, c))
    p = a64 * b64
    s = p + c64
    z = s - p
    err = (p - (s - z)) + (c64 - z)  # s + err == p + c exactly
    r = s.astype(np.float32)
    r64 = r.astype(np.float64)
    other = np.nextafter(r, np.where(s > r64, np.float32(np.inf), np.float32(-np.inf))).astype(np.float32)
    midpoint = (s != r64) & (s == (r64 + other.astype(np.float64)) / 2) & (err != 0)
    toward = np.where(err > 0, np.maximum(r, other), np.minimum(r, other))
    return np.where(midpoint, toward, r).astype(np.float32)


def _add32(a, b) -> np.ndarray:
    return (np.asarray(a, np.float32) + np.asarray(b, np.float32)).astype(np.float32)


def _lane0(vals) -> np.ndarray:
    """nvfp4_warp_sum's result (lane 0 of the shift-down tree) over the last axis of 32 lanes."""
    return warp_tree_sum(vals)[..., 0]


# Orders of a block's sum of squares (moe_block_sum over fmaf(v, v, ss) in post_attn and final):
# "kernel" is moe_decode.cu's (256 threads, thread tid adds i = tid, tid + 256, ... in turn, each
# warp's shift-down tree, then the 8 warp results added in warp order from 0); the others are what
# a kernel that derives its reduction from the batch might do instead.
NORM_ORDERS = ("threads 128", "threads 512", "two accumulators", "warps reversed", "sequential")


def block_sum_of_squares(v, order: str = "kernel") -> np.ndarray:
    """The f32 sum of v^2 over the last axis in a named order (NORM_ORDERS or "kernel"), each
    step an exact fmaf(v, v, acc) (fma32: v may be any f32, as final's slot sum is)."""
    v = np.asarray(v).astype(np.float32)
    lead, n = v.shape[:-1], v.shape[-1]
    if order == "sequential":
        acc = np.zeros(lead, np.float32)
        for i in range(n):
            acc = fma32(v[..., i], v[..., i], acc)
        return acc
    threads = {"threads 128": 128, "threads 512": 512}.get(order, BLOCK_THREADS)
    if order not in NORM_ORDERS and order != "kernel":
        raise ValueError(f"unknown order {order!r}: kernel or one of {', '.join(NORM_ORDERS)}")
    accs = np.zeros((2, *lead, threads), np.float32)
    for p, lo in enumerate(range(0, n, threads)):
        seg = v[..., lo:lo + threads]
        which = p % 2 if order == "two accumulators" else 0
        accs[which, ..., :seg.shape[-1]] = fma32(seg, seg, accs[which, ..., :seg.shape[-1]])
    per_thread = _add32(accs[0], accs[1]) if order == "two accumulators" else accs[0]
    red = _lane0(per_thread.reshape(*lead, threads // 32, 32))  # [..., warps]
    warps = range(red.shape[-1] - 1, -1, -1) if order == "warps reversed" else range(red.shape[-1])
    s = np.zeros(lead, np.float32)
    for w in warps:
        s = _add32(s, red[..., w])
    return s


def rms_factor32(sumsq, n: int, eps: float) -> np.ndarray:
    """moe_rms_scale's rsqrt(sumsq / n + eps) with the division and the addition in f32 (IEEE, as
    the kernels are compiled) and a correctly rounded rsqrt standing for rsqrtf (within 2 ulp of
    it on the device: these models count moved outputs, they are not expected values)."""
    y = (np.asarray(sumsq, np.float32) / np.float32(n) + np.float32(eps)).astype(np.float32)
    with np.errstate(divide="ignore"):
        return (1.0 / np.sqrt(y.astype(np.float64))).astype(np.float32)


# Orders of a router logit's dot (moe_router: one warp an expert, lane l adds the 8 products of
# chunks l, l + 32, ... in element order by fmaf, then the warp's shift-down tree).
ROUTER_ORDERS = ("16 lanes", "two accumulators", "sequential")


def router_dots(rr, wr, order: str = "kernel") -> np.ndarray:
    """f32 dot(rr[t], wr[e]) for every token and expert in a named order: [T, E]. The products of
    two bf16 values are exact in f32, so each fmaf is one f32 addition."""
    x = np.asarray(rr).astype(np.float32)
    w = np.asarray(wr).astype(np.float32)
    prod = x[:, None, :] * w[None, :, :]  # exact
    t, e, h = prod.shape
    if order == "sequential":
        acc = np.zeros((t, e), np.float32)
        for i in range(h):
            acc = _add32(acc, prod[..., i])
        return acc
    if order not in ROUTER_ORDERS and order != "kernel":
        raise ValueError(f"unknown order {order!r}: kernel or one of {', '.join(ROUTER_ORDERS)}")
    lanes = 16 if order == "16 lanes" else 32
    chunks = prod.reshape(t, e, h // 8, 8)
    accs = np.zeros((2, t, e, 32), np.float32)
    for p, c0 in enumerate(range(0, h // 8, lanes)):
        live = min(lanes, h // 8 - c0)
        which = p % 2 if order == "two accumulators" else 0
        for el in range(8):
            accs[which, ..., :live] = _add32(accs[which, ..., :live], chunks[:, :, c0:c0 + live, el])
    return _lane0(_add32(accs[0], accs[1]) if order == "two accumulators" else accs[0])


# Orders of an NVFP4 row's dot (nvfp4_dot.cuh, as moe_glu and moe_down call it: 64 virtual lanes,
# lane v adds groups v, v + 64, ... by fmaf(group sum, scale, acc), a shift-down tree each half,
# the halves added low first).
GEMV_ORDERS = ("32 lanes", "128 lanes", "sequential")


def nvfp4_rows(w, s, gs: float, x, order: str = "kernel") -> np.ndarray:
    """bf16 [rows]: bf16(gs * dot) of NVFP4 rows (w [rows, K/2] codes, s [rows, K/16] e4m3 bits)
    against bf16 x [K], in a named order, every f32 step exact (fma32). A group's 16 products are
    exact in f32 and summed in element order."""
    x = np.asarray(x).astype(np.float32)
    kk = x.shape[-1]
    k16 = kk // GROUP
    rows = w.shape[0]
    prod = (unpack_fp4(w, kk) * x[None, :]).astype(np.float32).reshape(rows, k16, GROUP)  # exact
    gsum = np.zeros((rows, k16), np.float32)
    for el in range(GROUP):
        gsum = _add32(gsum, prod[..., el])
    sc = decode_e4m3(s)
    if order == "sequential":
        total = np.zeros(rows, np.float32)
        for grp in range(k16):
            total = fma32(gsum[:, grp], sc[:, grp], total)
    else:
        lanes = {"kernel": 64, "32 lanes": 32, "128 lanes": 128}.get(order)
        if lanes is None:
            raise ValueError(f"unknown order {order!r}: kernel or one of {', '.join(GEMV_ORDERS)}")
        part = np.zeros((rows, lanes), np.float32)
        for g0 in range(0, k16, lanes):
            live = min(lanes, k16 - g0)
            part[:, :live] = fma32(gsum[:, g0:g0 + live], sc[:, g0:g0 + live], part[:, :live])
        halves = _lane0(part.reshape(rows, lanes // 32, 32))
        total = halves[:, 0]
        for hh in range(1, halves.shape[1]):
            total = _add32(total, halves[:, hh])
    return to_bf16((np.float32(gs) * total).astype(np.float32))



def norm_orders_at(h: int) -> tuple[str, ...]:
    """The NORM_ORDERS that group H squares otherwise than the kernel: with one element a thread
    (H <= 256) two accumulators and 512 threads add the same numbers the same way; with two
    passes two accumulators still do (the second starts from 0); two nonzero warps commute."""
    return tuple(o for o, needs in (("threads 128", h > 128), ("threads 512", h > 256),
                                    ("two accumulators", h > 512), ("warps reversed", h > 64),
                                    ("sequential", True)) if needs)


def router_orders_at(h: int) -> tuple[str, ...]:
    """The ROUTER_ORDERS that group a dot of H over 8-element chunks otherwise than the kernel."""
    chunks = h // 8
    return tuple(o for o, needs in (("16 lanes", chunks > 16), ("two accumulators", chunks > 64),
                                    ("sequential", True)) if needs)


def gemv_orders_at(k: int) -> tuple[str, ...]:
    """The GEMV_ORDERS that group K / 16 groups otherwise than the kernel's 64 lanes."""
    k16 = k // GROUP
    return tuple(o for o, needs in (("32 lanes", k16 > 32), ("128 lanes", k16 > 64), ("sequential", k16 > 2)) if needs)


# ------------------------------------------------------------------ order-sensitive designs (invariance, determinism)
#
# One pool of tokens, each stage given its own designed inputs: the gates launch each stage on
# them, not on the stage before's outputs, so each design holds whatever the device's rsqrtf
# and expf give upstream. Tokens 0..6 are live, ORDER_TWIN repeats token 0 and ORDER_ZERO is
# zero everywhere. How a reduction order reaches each stage's outputs:
#
# - A norm's sum of squares (a "ladder", _ladder): one outlier a token, 64 (its square 2^12,
#   whose f32 ulp u is 2^-11), first in its thread; every other square is 0.3 to 0.5 u. Added
#   one at a time to a partial at the outlier's scale such a square is lost (under half an ulp),
#   added as part of any sum of two or more it counts. So the kernel loses the outlier thread's
#   later elements, and an order that gives them (or the elements of the thread 128 further)
#   another accumulator, another thread or another warp counts them: 2 to 5 ulps of the sum.
#   Each other warp's sum is set a residue past a whole ulp (three filler elements a warp,
#   ladder_residues), so the kernel's warp-order sum drops each residue and the same sum taken
#   last warp first drops their total's fraction once. The factor rsqrt(sum / H + eps) then
#   moves by an ulp or more.
# - That ulp reaches a bf16 output through cancellation: the output's other addend cancels the
#   normalised term to bf16 precision (post_attn: x = -bf16(o * inv_o * w_pa); final: mid =
#   -bf16(dense * inv_d * w_d) where w_m = 0, or of the MoE term where w_d = 0), so the bf16
#   output is the product's low bits and an ulp of the factor moves it by about a bf16 step
#   (a few elements in a hundred, whatever their size).
# - post_attn's second norm shows in fs = max|n| / 448, an f32 output: mid's largest element is
#   x = 64 where o = 0 (mid = x exactly there: n_max = 64 inv_m), on a ladder of its own over
#   the elements where o = 0, beside o's ladder.
# - A router logit is an f32 output of a dot over log-uniform rr (products over 2^20 apart).
# - An NVFP4 row (glu, down) cancels: two groups of equal activation blocks, one with the row's
#   codes and one with their negations, both under scale 256, in two lanes; every other group
#   is small (a couple of the pair's f32 ulps, bits far below): each side of the pair rounds
#   the small groups at its own scale in its lane and in the warp tree, the pair cancels, and
#   the bf16 output is made of those roundings.
#
# The norm and router designs keep only tokens whose outputs the host model moves under every
# order that regroups at the shape (norm_orders_at, router_orders_at). The models take a
# correctly rounded rsqrt for the device's rsqrtf (within 2 ulp of it): a sum that moves by an
# ulp or two on the host may keep its rsqrtf on the device, so each checked token is a separate
# chance. tests/test_moe_decode_oracles.py holds every design to these claims.

ORDER_LIVE = 7  # tokens 0..6
ORDER_TWIN, ORDER_ZERO = 7, 8
ORDER_POOL = 9
ORDER_EPS = 1e-6
ORDER_LAYER_SCALAR = 0.75
OUTLIER = 64.0
OUTLIER_ULP = 2.0**-11  # of 64^2 = 2^12 and of every f32 in [2^12, 2^13)
HALF_ULP = (0.3, 0.5)  # a ladder's other squares, in OUTLIER_ULP
FILLERS = 3  # elements a warp that set its residue
SEARCH_BATCH = 32  # candidate tokens a try
SEARCH_TRIES = 12


def _pool_rows(live: np.ndarray) -> np.ndarray:
    """The pool from its live tokens: token ORDER_TWIN = token 0, token ORDER_ZERO = 0."""
    return np.concatenate([live, live[:1], np.zeros_like(live[:1])])


def _log_uniform(rng, shape, log2_range) -> np.ndarray:
    return np.where(rng.random(shape) < 0.5, -1.0, 1.0) * np.exp2(rng.uniform(*log2_range, shape))


def _search(label: str, rng, make, keep) -> dict:
    """ORDER_LIVE candidate tokens that `keep` accepts: `make(rng, n)` draws n candidates as a
    dict of arrays (first axis the token), `keep(candidates)` says which to keep."""
    kept: dict[str, list] = {}
    count = 0
    for _ in range(SEARCH_TRIES):
        cand = make(rng, SEARCH_BATCH)
        ok = np.flatnonzero(keep(cand))
        for name, arr in cand.items():
            kept.setdefault(name, []).append(arr[ok])
        count += ok.size
        if count >= ORDER_LIVE:
            return {name: np.concatenate(parts)[:ORDER_LIVE] for name, parts in kept.items()}
    raise DesignError(f"{label}: {count} of {SEARCH_TRIES * SEARCH_BATCH} candidate tokens move every output "
                      f"under every order, {ORDER_LIVE} needed")


def warp_sums_of_squares(v) -> np.ndarray:
    """[..., 8]: each warp's result in moe_block_sum's kernel order (the 8 values it adds)."""
    v = np.asarray(v).astype(np.float32)
    acc = np.zeros((*v.shape[:-1], BLOCK_THREADS), np.float32)
    for lo in range(0, v.shape[-1], BLOCK_THREADS):
        seg = v[..., lo:lo + BLOCK_THREADS]
        acc[..., :seg.shape[-1]] = fma32(seg, seg, acc[..., :seg.shape[-1]])
    return _lane0(acc.reshape(*v.shape[:-1], BLOCK_THREADS // 32, 32))


def ladder_residues(h: int) -> np.ndarray:
    """[warps]: each outlier-free warp's sum past a whole OUTLIER_ULP, in it (warp 0, the
    outlier's, 0). Under 1/2, so the kernel's warp-order sum drops it; 0.24 where 128 threads a
    block would add the warp to another outlier-free one (two residues, still under 1/2), 0.45
    elsewhere, so that their total's fraction, all the reversed order drops, is well under it."""
    warps = -(-min(h, BLOCK_THREADS) // 32)
    out = np.zeros(warps)
    for w in range(1, warps):
        paired = (w + 4 < warps) or (w - 4 >= 1)
        out[w] = 0.24 if paired else 0.45
    return out


def _ladder_places(rng, n: int, h: int, taken: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(outlier element [n], filler elements [n, warps, FILLERS]) on elements not `taken`: the
    outlier in warp 0 (first pass), fillers in the first pass of warps 1..7, off the thread 128
    past the outlier."""
    warps = -(-min(h, BLOCK_THREADS) // 32)
    taken = np.zeros((n, h), bool) if taken is None else taken
    at = np.array([rng.choice(np.flatnonzero(~taken[t, :min(h, 32)])) for t in range(n)])
    fill = np.full((n, warps, FILLERS), -1)
    for t in range(n):
        for w in range(1, warps):
            lanes = [32 * w + l for l in rng.permutation(32) if 32 * w + l < h and not taken[t, 32 * w + l]
                     and 32 * w + l != at[t] + 128]
            fill[t, w] = lanes[:FILLERS]
    return at, fill


def _ladder(rng, h: int, at: np.ndarray, fill: np.ndarray, free: np.ndarray, elements=None) -> np.ndarray:
    """bf16 [n, H]: OUTLIER at `at`, squares in HALF_ULP (of OUTLIER_ULP) on the `free` elements,
    0 elsewhere, the fillers set so that each other warp's sum is its ladder_residues past a
    whole ulp.
    `elements(v)` maps the values to what the kernel squares (identity by default); with it the
    fillers are adjusted on `v` and their effect read through it."""
    n = at.size
    u = OUTLIER_ULP
    elements = elements or (lambda v: v)
    mag = np.sqrt(rng.uniform(*HALF_ULP, (n, h)) * u)
    v = np.where(free, np.where(rng.random((n, h)) < 0.5, -1.0, 1.0) * mag, 0.0)
    v[np.arange(n), at] = np.where(rng.random(n) < 0.5, -OUTLIER, OUTLIER)
    v = to_bf16(v).astype(np.float64)
    target = ladder_residues(h)
    for _ in range(3):
        r = warp_sums_of_squares(elements(to_bf16(v))).astype(np.float64)[:, :target.size] / u
        need = target - (r - np.floor(r))  # in (-1, 1): the change of each warp's sum, in u
        for t in range(n):
            for w in range(1, fill.shape[1]):
                d = need[t, w]
                if abs(d) < 0.01:
                    continue
                sq = v[t, fill[t, w]] ** 2 / u
                if d > 0 and d > np.sum(0.49 - sq):
                    d -= 1.0  # lower the sum to the residue below instead
                if d < 0 and -d > np.sum(sq):
                    d += 1.0
                for j, f in enumerate(fill[t, w]):
                    new = float(np.clip(sq[j] + d, 0.0, 0.49))
                    d -= new - sq[j]
                    v[t, f] = np.copysign(np.sqrt(new * u), v[t, f] if v[t, f] else 1.0)
        v = to_bf16(v).astype(np.float64)
    return to_bf16(v)


@dataclass(frozen=True)
class PostAttnOrderCase:
    x: np.ndarray  # bf16 [n, H]
    o: np.ndarray
    w_pa: np.ndarray  # bf16 [H]
    w_router: np.ndarray
    act_g: float
    eps: float

    def mid(self, inv_o) -> np.ndarray:
        """mid = bf16(fmaf(o * inv_o, w_pa, x)) for given per-token factors."""
        a = (self.o.astype(np.float32) * np.asarray(inv_o, np.float32)[:, None]).astype(np.float32)
        return to_bf16(fma32(a, self.w_pa.astype(np.float32)[None, :], self.x.astype(np.float32)))

    def inv(self, which: str, order: str = "kernel") -> np.ndarray:
        """The factor of norm `which` ("o", or "mid": of the kernel-order mid) in `order`."""
        v = self.o if which == "o" else self.mid(self.inv("o"))
        return rms_factor32(block_sum_of_squares(v, order), v.shape[-1], self.eps)

    def n_outputs(self, mid, inv_m) -> tuple[np.ndarray, np.ndarray]:
        """(fs [n] f32, rr [n, H] bf16) from mid and its norm's factor."""
        n = (mid.astype(np.float32) * np.asarray(inv_m, np.float32)[:, None]).astype(np.float32)
        fs = (np.max(np.abs(n), axis=-1) / np.float32(E4M3_MAX)).astype(np.float32)
        return fs, to_bf16((n * self.w_router.astype(np.float32)[None, :]).astype(np.float32))

    def moved_by(self, which: str, order: str) -> np.ndarray:
        """[n]: outputs the model rounds otherwise when norm `which` sums in `order`: mid's elements
        for "o"; fs (one) and rr's elements for "mid"."""
        if which == "o":
            return np.count_nonzero(bits_of(self.mid(self.inv("o"))) != bits_of(self.mid(self.inv("o", order))), axis=1)
        mid = self.mid(self.inv("o"))
        (fs_a, rr_a), (fs_b, rr_b) = (self.n_outputs(mid, self.inv("mid", o)) for o in ("kernel", order))
        rr_moved = np.count_nonzero(bits_of(rr_a) != bits_of(rr_b), axis=1)
        return (bits_of(fs_a) != bits_of(fs_b)).astype(np.int64) + rr_moved

    def moves_under_every_order(self) -> np.ndarray:
        h = self.x.shape[-1]
        return np.all([self.moved_by(which, order) > 0 for which in ("o", "mid") for order in norm_orders_at(h)],
                      axis=0)


def post_attn_order_designed(h: int, seed: int) -> PostAttnOrderCase:
    """Each live token: o on a ladder, x cancelling o's normalised values; on the elements of
    another warp-0 thread, the thread 128 past it and three fillers a warp, o = 0 and x on a
    ladder of its own (mid = x there, its largest 64 = mid's largest)."""
    rng = np.random.default_rng([seed, h, 1])
    w_pa = to_bf16(rng.uniform(0.5, 1.5, h))
    w_router = to_bf16(rng.uniform(0.5, 1.5, h))
    idx = np.arange(h)

    def make(rng, n):
        at_x, fill_x = _ladder_places(rng, n, h)
        plain = np.zeros((n, h), bool)
        for t in range(n):
            lane = at_x[t] % BLOCK_THREADS
            plain[t] = (idx % BLOCK_THREADS == lane) | (idx % BLOCK_THREADS == lane + 128)
            plain[t, fill_x[t][fill_x[t] >= 0]] = True
        at_o, fill_o = _ladder_places(rng, n, h, taken=plain)
        o = _ladder(rng, h, at_o, fill_o, ~plain)
        inv_o = rms_factor32(block_sum_of_squares(o), h, ORDER_EPS)
        a = (o.astype(np.float32) * inv_o[:, None]).astype(np.float64) * w_pa.astype(np.float64)
        cancel = -to_bf16(a).astype(np.float64) + 0.0

        def mid_of(x_plain):  # the model's mid: x where o = 0, the cancelled residue elsewhere
            x = np.where(plain, x_plain.astype(np.float64), cancel)
            return PostAttnOrderCase(to_bf16(x), o, w_pa, w_router, ACT_G, ORDER_EPS).mid(inv_o)

        x_plain = _ladder(rng, h, at_x, fill_x, plain, elements=mid_of)
        return {"x": to_bf16(np.where(plain, x_plain.astype(np.float64), cancel)), "o": o}

    def keep(c):
        return PostAttnOrderCase(c["x"], c["o"], w_pa, w_router, ACT_G, ORDER_EPS).moves_under_every_order()

    live = _search(f"post_attn_order_designed(H={h})", rng, make, keep)
    return PostAttnOrderCase(x=_pool_rows(live["x"]), o=_pool_rows(live["o"]), w_pa=w_pa, w_router=w_router,
                             act_g=ACT_G, eps=ORDER_EPS)


@dataclass(frozen=True)
class RouterOrderCase:
    rr: np.ndarray  # bf16 [n, H]
    wr: np.ndarray  # bf16 [E, H]
    pes: np.ndarray  # bf16 [E], powers of two: logit = pes * dot exactly

    def logits(self, order: str = "kernel") -> np.ndarray:
        return (self.pes.astype(np.float32)[None, :] * router_dots(self.rr, self.wr, order)).astype(np.float32)

    def moved_by(self, order: str) -> np.ndarray:
        """[n]: logits whose bits another order of the dot changes."""
        return np.count_nonzero(bits_of(self.logits()) != bits_of(self.logits(order)), axis=1)

    def moves_under_every_order(self) -> np.ndarray:
        return np.all([self.moved_by(o) > 0 for o in router_orders_at(self.rr.shape[-1])], axis=0)


def router_order_designed(h: int, e: int, seed: int) -> RouterOrderCase:
    """rr log-uniform over 2^-8 .. 2^2 with an outlier 64 a token; Wr normal; pes powers of two."""
    rng = np.random.default_rng([seed, h, e, 2])
    wr = to_bf16(rng.normal(0.0, 1.0, (e, h)) / np.sqrt(h))
    pes = to_bf16(np.exp2(rng.integers(-1, 2, e)))

    def make(rng, n):
        rr = _log_uniform(rng, (n, h), (-8.0, 2.0))
        rr[np.arange(n), rng.integers(0, h, n)] = OUTLIER
        return {"rr": to_bf16(rr)}

    live = _search(f"router_order_designed(H={h}, E={e})", rng, make,
                   lambda c: RouterOrderCase(c["rr"], wr, pes).moves_under_every_order())
    return RouterOrderCase(rr=_pool_rows(live["rr"]), wr=wr, pes=pes)


# The cancelling NVFP4 design: activation blocks of PAIRS pairs (2p, 2p + 1) equal and large,
# the rest small; a row's pair under BIG_SCALE with codes and negated codes, the other pair zero,
# every other group under a scale in [0.5, 1). With the activation scale act, a large block's
# values are e2m1 / 4 and a small block's e2m1 * 2^-14: the pair's terms are about 2^10, the
# small groups' about 2^-11, a couple of the pair's f32 ulps, with bits far below them.
PAIRS = 2
BIG_SCALE = 0x78  # e4m3 256
SMALL_SCALES = (0x30, 0x38)  # e4m3 [0.5, 1): any mantissa


def _e4m3_pow2_bits(log2: int) -> int:
    """e4m3 bits of 2^log2 (-9 <= log2 <= 8; subnormal below -6)."""
    return (log2 + 7) << 3 if log2 >= -6 else 1 << (log2 + 9)


@dataclass(frozen=True)
class PairedNvfp4:
    """NVFP4 activations [n, K] whose pair blocks are equal, and weight tables [tables, rows, K]
    whose rows cancel on one pair each (the comment above)."""

    q: np.ndarray  # uint8 [n, K/2]
    s: np.ndarray  # uint8 [n, K/16]
    w: np.ndarray  # uint8 [tables, rows, K/2]
    sw: np.ndarray  # uint8 [tables, rows, K/16]
    pairs: tuple  # the pair indices p (blocks 2p, 2p + 1)


def paired_nvfp4_designed(n: int, k: int, tables: int, rows: int, act: float, seed: int) -> PairedNvfp4:
    """Activations for n vectors of K values, and `tables` weight tables of `rows` rows."""
    k16 = k // GROUP
    rng = np.random.default_rng([seed, n, k, tables, rows, 3])
    pairs = tuple(int(p) for p in rng.choice(k16 // 2, PAIRS, replace=False))
    big = [b for p in pairs for b in (2 * p, 2 * p + 1)]
    # The activation: random codes; block scales 2^6 (large) and 2^-6 (small) under act 2^-8.
    shift = int(round(np.log2(ACT_G / act)))
    codes = rng.integers(0, 16, (n, k16, GROUP), dtype=np.uint8)
    s = np.full((n, k16), _e4m3_pow2_bits(-6 + shift), np.uint8)
    s[:, big] = _e4m3_pow2_bits(6 + shift)
    for p in pairs:
        codes[:, 2 * p + 1] = codes[:, 2 * p]
    wc = rng.integers(0, 16, (tables, rows, k16, GROUP), dtype=np.uint8)
    sw = rng.integers(*SMALL_SCALES, (tables, rows, k16), dtype=np.uint8)
    own = np.array(pairs)[np.arange(rows) % PAIRS]  # rows alternate between the pairs
    for p in pairs:
        mine = (own == p)[None, :, None]
        sign = 8 * rng.integers(0, 2, (tables, rows, GROUP), dtype=np.uint8)
        live = rng.integers(1, 8, (tables, rows, GROUP), dtype=np.uint8) | sign
        wc[:, :, 2 * p] = np.where(mine, live, 0)
        wc[:, :, 2 * p + 1] = np.where(mine, live ^ 0x8, 0)
        sw[:, :, 2 * p] = np.where(mine[..., 0], BIG_SCALE, sw[:, :, 2 * p])
        sw[:, :, 2 * p + 1] = np.where(mine[..., 0], BIG_SCALE, sw[:, :, 2 * p + 1])
    return PairedNvfp4(q=pack_codes(codes.reshape(n, k)), s=s, w=pack_codes(wc.reshape(tables, rows, k)), sw=sw,
                       pairs=pairs)


MOVED_ROWS = 64  # the rows of each slot the designs and their tests count moved values over
GLU_ORDER_GS = 256.0  # glu's global scale: g and u of order 1 (the cancelled rows are about 2^-7), so a = gelu(g) * u
# quantizes to live codes and scales under act_h (a power of two: the bits of g and u only move up)


@dataclass(frozen=True)
class ExpertsOrderCase:
    """glu's and down's pool: ids [POOL, K] (collisions by design), glu's activation a token,
    down's a slot, every expert's tables (gs GLU_ORDER_GS and 1) and the models of their rows."""

    ids: np.ndarray  # int32 [POOL, K]
    gq: np.ndarray  # uint8 [POOL, H/2]
    gsc: np.ndarray  # uint8 [POOL, H/16]
    hq: np.ndarray  # uint8 [POOL, K, I/2]
    hs: np.ndarray  # uint8 [POOL, K, I/16]
    weights: ExpertWeights
    act_g: float
    act_h: float

    def rows(self, stage: str, token: int, slot: int, order: str = "kernel", rows=slice(None)) -> np.ndarray:
        """The model's bf16 g/u rows (stage "glu") or opair row (stage "down") of a slot."""
        e = int(self.ids[token, slot])
        w = self.weights
        if stage == "glu":
            x = nvfp4_dequantize(self.gq[token], self.gsc[token], self.act_g)
            return nvfp4_rows(w.wgu[e][rows], w.sgu[e][rows], w.gs_gu[e], x, order)
        x = nvfp4_dequantize(self.hq[token, slot], self.hs[token, slot], self.act_h)
        return nvfp4_rows(w.wdn[e][rows], w.sdn[e][rows], w.gs_dn[e], x, order)

    def moved_by(self, stage: str, token: int, order: str, rows=slice(None)) -> int:
        """How many of a token's g/u ("glu") or opair ("down") values, over its K slots and the
        given rows, another order of the row's dot rounds otherwise."""
        return sum(int(np.count_nonzero(bits_of(self.rows(stage, token, k, rows=rows))
                                        != bits_of(self.rows(stage, token, k, order, rows))))
                   for k in range(self.ids.shape[1]))

    def orders(self, stage: str) -> tuple[str, ...]:
        """The orders that regroup the stage's dot (over H for glu, I for down)."""
        return gemv_orders_at(2 * self.gq.shape[-1] if stage == "glu" else 2 * self.hq.shape[-1])

    def moves_under_every_order(self, stage: str, token: int, rows=slice(0, MOVED_ROWS)) -> bool:
        return all(self.moved_by(stage, token, order, rows) > 0 for order in self.orders(stage))



def order_ids(e: int, k: int, seed: int) -> np.ndarray:
    """[POOL, K] expert ids: K distinct experts a live token (token 3 shares one with token 0),
    the twin token 0's, the zero token 0..K-1."""
    rng = np.random.default_rng([seed, e, k, 4])
    live = np.stack([rng.choice(e, k, replace=False) for _ in range(ORDER_LIVE)]).astype(np.int32)
    if not set(live[3].tolist()) & set(live[0].tolist()):
        live[3, 0] = live[0, 0]
    return np.concatenate([live, live[:1], np.arange(k, dtype=np.int32)[None, :]]).astype(np.int32)


def experts_order_designed(h: int, i: int, e: int, k: int, seed: int) -> ExpertsOrderCase:
    ids = order_ids(e, k, seed)
    glu = paired_nvfp4_designed(ORDER_LIVE, h, e, 2 * i, ACT_G, seed)
    down = paired_nvfp4_designed(ORDER_LIVE * k, i, e, h, ACT_H, seed + 1)
    w = ExpertWeights({}, {}, {}, {}, {}, {})
    for ex in range(e):
        w.wgu[ex], w.sgu[ex], w.gs_gu[ex] = glu.w[ex], glu.sw[ex], np.float32(GLU_ORDER_GS)
        w.wdn[ex], w.sdn[ex], w.gs_dn[ex] = down.w[ex], down.sw[ex], np.float32(1.0)
    case = ExpertsOrderCase(ids=ids, gq=_pool_rows(glu.q), gsc=_pool_rows(glu.s),
                            hq=_pool_rows(down.q.reshape(ORDER_LIVE, k, -1)),
                            hs=_pool_rows(down.s.reshape(ORDER_LIVE, k, -1)), weights=w, act_g=ACT_G, act_h=ACT_H)
    for stage in ("glu", "down"):
        still = [t for t in range(ORDER_LIVE) if not case.moves_under_every_order(stage, t)]
        if still:
            raise DesignError(f"experts_order_designed(H={h}, I={i}, E={e}, K={k}): {stage} rows of tokens {still} "
                              f"keep their bits under one of {case.orders(stage)}")
    return case


@dataclass(frozen=True)
class FinalOrderCase:
    """final's tokens: half the elements carry the dense term alone (w_m = 0 there), half the
    MoE term alone (w_d = 0), and mid cancels whichever term an element carries."""

    mid: np.ndarray  # bf16 [n, H]
    dense: np.ndarray
    opair: np.ndarray  # bf16 [n, K, H]
    wts: np.ndarray  # f32 [n, K]
    w_d: np.ndarray  # bf16 [H]
    w_m: np.ndarray
    layer_scalar: float
    eps: float

    def slot_sum(self) -> np.ndarray:
        """moe_final's m = sum_k fmaf(wts_k, opair_k, m), in slot order from 0."""
        return slot_sum(self.wts, self.opair)

    def inv(self, which: str, order: str = "kernel") -> np.ndarray:
        v = self.dense if which == "dense" else self.slot_sum()
        return rms_factor32(block_sum_of_squares(v, order), v.shape[-1], self.eps)

    def terms(self, inv_d, inv_m) -> tuple[np.ndarray, np.ndarray]:
        """(f32(dense * inv_d), f32(m * inv_m)): the normalised terms before their weights."""
        a = (self.dense.astype(np.float32) * np.asarray(inv_d, np.float32)[:, None]).astype(np.float32)
        return a, (self.slot_sum() * np.asarray(inv_m, np.float32)[:, None]).astype(np.float32)

    def out(self, inv_d, inv_m) -> np.ndarray:
        a, b = self.terms(inv_d, inv_m)
        acc = fma32(a, self.w_d.astype(np.float32)[None, :], self.mid.astype(np.float32))
        acc = fma32(b, self.w_m.astype(np.float32)[None, :], acc)
        return to_bf16((acc * np.float32(self.layer_scalar)).astype(np.float32))

    def moved_by(self, which: str, order: str) -> np.ndarray:
        """[n]: output elements the model rounds otherwise when norm `which` ("dense" or "moe")
        sums in `order`."""
        base = self.out(self.inv("dense"), self.inv("moe"))
        if which == "dense":
            other = self.out(self.inv("dense", order), self.inv("moe"))
        else:
            other = self.out(self.inv("dense"), self.inv("moe", order))
        return np.count_nonzero(bits_of(base) != bits_of(other), axis=1)

    def moves_under_every_order(self) -> np.ndarray:
        h = self.dense.shape[-1]
        return np.all([self.moved_by(which, order) > 0 for which in ("dense", "moe") for order in norm_orders_at(h)],
                      axis=0)


def slot_sum(wts, opair) -> np.ndarray:
    """moe_final's m = sum_k fmaf(wts_k, opair_k, m), slot order from 0: f32 [n, H]."""
    wts = np.asarray(wts, np.float32)
    m = np.zeros((wts.shape[0], opair.shape[-1]), np.float32)
    for kk in range(wts.shape[1]):
        m = fma32(wts[:, kk:kk + 1], np.asarray(opair[:, kk]).astype(np.float32), m)
    return m


def final_order_designed(h: int, k: int, seed: int) -> FinalOrderCase:
    """dense on a ladder; the slot sum on a ladder too (slot 0 carries it, the other slots add
    small log-uniform terms with low bits); wts a softmax of random logits; mid cancels each
    element's normalised term (FinalOrderCase)."""
    rng = np.random.default_rng([seed, h, k, 5])
    dense_half = rng.random(h) < 0.5
    w_d = to_bf16(np.where(dense_half, rng.uniform(0.5, 1.5, h), 0.0))
    w_m = to_bf16(np.where(dense_half, 0.0, rng.uniform(0.5, 1.5, h)))
    free = np.ones(h, bool)

    def make(rng, n):
        at, fill = _ladder_places(rng, n, h)
        dense = _ladder(rng, h, at, fill, np.broadcast_to(free, (n, h)))
        logits = rng.normal(0.0, 1.0, (n, k))
        wts = (np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)).astype(np.float32)
        rest = np.zeros((n, k, h))
        rest[:, 1:] = _log_uniform(rng, (n, k - 1, h), (-16.0, -12.0))  # well under the ladder's squares' roots
        rest = to_bf16(rest)

        def opair_for(target):  # slot 0 brings the slot sum to `target`
            others = np.einsum("nk,nkh->nh", wts[:, 1:].astype(np.float64), rest[:, 1:].astype(np.float64))
            op = rest.astype(np.float64).copy()
            op[:, 0] = (np.asarray(target, np.float64) - others) / wts[:, :1].astype(np.float64)
            return to_bf16(op)

        at_m, fill_m = _ladder_places(rng, n, h)
        target = _ladder(rng, h, at_m, fill_m, np.broadcast_to(free, (n, h)),
                         elements=lambda t: slot_sum(wts, opair_for(t)))
        opair = opair_for(target)
        case = FinalOrderCase(mid=to_bf16(np.zeros((n, h))), dense=dense, opair=opair, wts=wts, w_d=w_d,
                              w_m=w_m, layer_scalar=ORDER_LAYER_SCALAR, eps=ORDER_EPS)
        a, b = case.terms(case.inv("dense"), case.inv("moe"))
        term = np.where(dense_half[None, :], a.astype(np.float64) * w_d.astype(np.float64),
                        b.astype(np.float64) * w_m.astype(np.float64))
        return {"mid": to_bf16(-to_bf16(term).astype(np.float64) + 0.0), "dense": dense, "opair": opair, "wts": wts}

    def keep(c):
        return FinalOrderCase(**c, w_d=w_d, w_m=w_m, layer_scalar=ORDER_LAYER_SCALAR,
                              eps=ORDER_EPS).moves_under_every_order()

    live = _search(f"final_order_designed(H={h}, K={k})", rng, make, keep)
    wts = np.concatenate([live["wts"], live["wts"][:1], np.full((1, k), 1.0 / k, np.float32)]).astype(np.float32)
    return FinalOrderCase(mid=_pool_rows(live["mid"]), dense=_pool_rows(live["dense"]),
                          opair=_pool_rows(live["opair"]), wts=wts, w_d=w_d, w_m=w_m,
                          layer_scalar=ORDER_LAYER_SCALAR, eps=ORDER_EPS)


@dataclass(frozen=True)
class OrderPool:
    """Every stage's order-sensitive inputs for one shape, ORDER_POOL tokens."""

    post: PostAttnOrderCase
    router: RouterOrderCase
    experts: ExpertsOrderCase
    final: FinalOrderCase


def order_pool(h: int, i: int, e: int, k: int, seed: int) -> OrderPool:
    return OrderPool(post=post_attn_order_designed(h, seed), router=router_order_designed(h, e, seed),
                     experts=experts_order_designed(h, i, e, k, seed), final=final_order_designed(h, k, seed))
