"""Closed-form host anchors and input builders for the quantized GEMV family.

Each builder returns host inputs designed so that the expected output is exact, and the
expected output from the contract's formula (never the kernel's association order): the
inputs make every partial sum exactly representable in f32, so every order gives the
same f32 sum and the bf16 rounding of it is the only rounding. Builders check their own
exactness precondition and raise when a shape breaks it.

Decoding of e4m3 and e2m1 goes through harness.library.dtypes (ml_dtypes), never hand-rolled bits.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from harness.library.dtypes import (
                                    decode_e2m1,
                                    decode_e4m3,
                                    pack_fp4,
                                    to_bf16,
                                    to_fp8_e4m3,
                                    unpack_fp4,
                                    )

F32_EXACT = 2.0**24  # integers below this are exact in f32


def e4m3_bits(values) -> np.ndarray:
    """Values exactly representable in e4m3 -> their uint8 bits (raises on any rounding)."""
    v = np.asarray(values, dtype=np.float32)
    bits = to_fp8_e4m3(v).view(np.uint8)
    if not np.array_equal(decode_e4m3(bits), v):
        raise ValueError(f"not exact in e4m3: {v[decode_e4m3(bits) != v][:4]}; pick values e4m3 holds")
    return bits


def exact_bf16(values) -> np.ndarray:
    """float64 values that bf16 must hold exactly -> bf16 (raises on any rounding)."""
    v = np.asarray(values, dtype=np.float64)
    b = to_bf16(v)
    if not np.array_equal(b.astype(np.float64), v):
        raise ValueError("expected values are not exact in bf16: the designed inputs lost their exactness")
    return b


def _check_f32_exact(abs_sums: np.ndarray, granularity: float, what: str) -> None:
    """Every partial sum is a multiple of `granularity` bounded by `abs_sums`: exact in f32
    when abs_sums / granularity < 2^24."""
    worst = float(np.max(abs_sums)) / granularity
    if worst >= F32_EXACT:
        raise ValueError(f"{what}: partial sums reach {worst:.3g} units of {granularity}, past 2^24: shrink K")


# ------------------------------------------------------------------ FP8 GEMV

FP8_ROW_VALUES = (1.0, 2.0, 0.5)  # weight rows constant 1.0 / 2.0 / 0.5 in turn


@dataclass(frozen=True)
class Fp8GemvCase:
    x: np.ndarray  # uint8 e4m3 bits [T, K]
    xs: np.ndarray  # f32 [T]
    segments: tuple[tuple[np.ndarray, np.ndarray], ...]  # (w uint8 [n, K], ws f32 [n])
    expected: np.ndarray  # bf16 [T, N]


def fp8_gemv_case(t: int, k: int, segment_rows: tuple[int, ...], segment_scales: tuple[float, ...],
                  token_scales: tuple[float, ...]) -> Fp8GemvCase:
    """x = 1.0 everywhere; row r of each segment is constant FP8_ROW_VALUES[r % 3]; segment
    i's rows scaled by segment_scales[i]; token t by token_scales[t]. Powers of two only, so

        y[t, n] = K * w_n * ws[n] * xs[t]            exactly

    (each product x * w is 1, 2 or 0.5, the f32 running sums are multiples of 0.5 below
    2^24, and scaling by powers of two is exact)."""
    if len(token_scales) != t or len(segment_scales) != len(segment_rows):
        raise ValueError("one scale a token and one a segment")
    _check_f32_exact(np.asarray([2.0 * k]), 0.5, "fp8_gemv_case")
    segments, expected_cols = [], []
    for rows, scale in zip(segment_rows, segment_scales):
        row_value = np.asarray([FP8_ROW_VALUES[r % 3] for r in range(rows)])
        w = np.repeat(e4m3_bits(row_value)[:, None], k, axis=1)
        ws = np.full(rows, scale, dtype=np.float32)
        segments.append((w, ws))
        expected_cols.append(k * row_value * scale)
    col = np.concatenate(expected_cols)
    xs = np.asarray(token_scales, dtype=np.float32)
    expected = exact_bf16(xs.astype(np.float64)[:, None] * col[None, :])
    x = np.full((t, k), e4m3_bits([1.0])[0], dtype=np.uint8)
    return Fp8GemvCase(x=x, xs=xs, segments=tuple(segments), expected=expected)


# Position-dependent designed inputs: x and w draw from a
# small exact set, so every element pairs with one partner only and every index shows.
SIGNED_SET = (-2.0, -1.0, -0.5, 0.5, 1.0, 2.0)  # exact in e4m3 and bf16; products are multiples of 1/4
FP8_CHUNK = 16  # e4m3 bytes one lane loads a step (FP8_GEMV_BYTES_PER_LANE)
# The FP8 anchor's set: products are multiples of 1/64 (1.125 * 1.125 = 81/64), so most dots
# need more than bf16's 8 significant bits and the output rounding is exercised. 1.125 and
# -1.375 have odd e4m3 mantissas (codes ...001 and ...011): without them every code's lowest
# bit is 0 and a kernel that drops it (a mask 0xfffe where 0xffff belongs) is invisible.
FP8_SET = (-3.0, -2.0, -1.5, -1.375, -1.0, -0.75, -0.5, 0.5, 0.75, 1.0, 1.125, 1.5, 2.0, 3.0)
FP8_GRANULE = 1.0 / 64  # every product of two FP8_SET values is a multiple of it
# Weight rows decoded to float64 at once for the host dot: a decode-sized segment (8192 rows
# of K = 8192) would be 0.5 GB of float64 and seconds of page faults; 1024 rows are 64 MB.
FP8_DOT_ROWS = 1024


def rne_bf16_of_exact_f32(values) -> np.ndarray:
    """float64 values that f32 holds exactly -> bf16, rounded to nearest even once: the
    kernel's one rounding (`__float2bfloat16_rn` of an exact f32). Raises if f32 would round."""
    v = np.asarray(values, dtype=np.float64)
    if not np.array_equal(v.astype(np.float32).astype(np.float64), v):
        raise ValueError("the designed value is not exact in f32: the expected bf16 would depend on the order")
    return to_bf16(v)


def fp8_gemv_positional_case(t: int, k: int, segment_rows: tuple[int, ...], seed: int,
                             token_scales: tuple[float, ...]) -> Fp8GemvCase:
    """x[t, k] and w[n, k] drawn from FP8_SET (seeded; exact in e4m3), a different row for every
    token and every weight row of every segment; row scales vary along N (powers of two,
    1/4 .. 4), token scales are powers of two. Every product is a multiple of 1/64 and every
    f32 partial sum a multiple of 1/64 below 9 K (checked: under 2^24 units), so the f32 value
    ws * xs * dot is exact in any order and

        y[t, n] = bf16_rne(ws[n] * xs[t] * dot(x[t], w[n]))

    rounds once, from an exactly known f32: the expected bits are exact, and the dots that
    need more than 8 significant bits (most of them) exercise the rounding itself."""
    if len(token_scales) != t:
        raise ValueError("one scale a token")
    if k % FP8_CHUNK:
        raise ValueError(f"K={k} is not a multiple of {FP8_CHUNK}: the kernel loads 16 bytes a lane a step")
    _check_f32_exact(np.asarray([9.0 * k]), FP8_GRANULE, "fp8_gemv_positional_case")
    rng = np.random.default_rng(seed)
    values = np.asarray(FP8_SET)
    codes = e4m3_bits(values)
    # Each element is drawn as an index into FP8_SET (the draws of rng.choice(values)) and
    # stored as its code; the float64 weights exist only FP8_DOT_ROWS rows at a time.
    xi = rng.choice(len(values), size=(t, k))
    x = values[xi]
    segments, cols = [], []
    row_base = 0
    for rows in segment_rows:
        wi = rng.choice(len(values), size=(rows, k))
        ws = 2.0 ** ((np.arange(rows) * 3 + row_base) % 5 - 2)  # 1/4 .. 4 along N
        row_base += rows
        segments.append((codes[wi], ws.astype(np.float32)))
        dots = np.concatenate([x @ values[wi[r:r + FP8_DOT_ROWS]].T for r in range(0, rows, FP8_DOT_ROWS)], axis=1)
        cols.append(dots * ws[None, :])
    xs = np.asarray(token_scales, dtype=np.float32)
    expected = rne_bf16_of_exact_f32(np.concatenate(cols, axis=1) * xs.astype(np.float64)[:, None])
    return Fp8GemvCase(x=codes[xi], xs=xs, segments=tuple(segments), expected=expected)


def fp8_chunk_sums(case: Fp8GemvCase) -> np.ndarray:
    """float64 [T, N, K / 16]: each 16-element chunk's contribution to each raw dot (the
    design check: a chunk that contributes 0 everywhere could be dropped unseen)."""
    x = decode_e4m3(case.x).astype(np.float64)
    w = np.concatenate([decode_e4m3(seg) for seg, _ in case.segments]).astype(np.float64)
    t, k = x.shape
    prod = x[:, None, :] * w[None, :, :]
    return prod.reshape(t, w.shape[0], k // FP8_CHUNK, FP8_CHUNK).sum(axis=-1)


# ------------------------------------------------------------------ lm_head argmax

LM_HEAD_HOT_ROW = 777


@dataclass(frozen=True)
class LmHeadCase:
    h: np.ndarray  # bf16 [T, H]
    E: np.ndarray  # uint8 e4m3 bits [V, H]
    rs: np.ndarray  # f32 [V]
    softcap: float


def lm_head_case(t: int = 2, v: int = 1024, hdim: int = 64, softcap: float = 30.0) -> LmHeadCase:
    """h = 1, E = 1 except row 777 = 2, rs = 1: logits are exactly H (2H for row 777)."""
    E = np.full((v, hdim), e4m3_bits([1.0])[0], dtype=np.uint8)
    E[LM_HEAD_HOT_ROW, :] = e4m3_bits([2.0])[0]
    return LmHeadCase(h=to_bf16(np.ones((t, hdim))), E=E, rs=np.ones(v, dtype=np.float32), softcap=softcap)


def capped(logit: float, softcap: float) -> np.float32:
    """softcap * tanh(logit / softcap) through f32 roundings: the division and the product
    are IEEE (correctly rounded, as the kernel's no-fast-math division is); tanh is the
    correctly rounded f32 of the f64 tanh of the f32 quotient."""
    q = np.float32(logit) / np.float32(softcap)
    return np.float32(softcap) * np.float32(np.tanh(np.float64(q)))


# CUDA's tanhf has a documented maximum error of 2 ulp (CUDA C++ Programming Guide,
# "Mathematical Functions", single precision); the product with softcap adds at most
# one rounding. So the device value is within 4 ulp of `capped`.
TANHF_ULP_BOUND = 4


# Position-dependent lm_head design. Block b's partial sits in
# the reduce kernel's thread b % 256 (warp (b % 256) // 32, second pass for b >= 256), so the
# winners below reach both half-warps, several reduce warps and both passes.
LM_ROWS_PER_BLOCK = 64  # LM_HEAD_ROWS_PER_BLOCK (the structural gate pins it to the .cu)
LM_POS_V = 64 * 270 + 37  # 271 partials a row (more than a warp and than a block of 256),
                          # the last block partial (37 rows: its warp 4 has 5, warps 5-7 none)
LM_POS_H = 264  # 33 steps of 8: lane 0 takes two, lanes 1-31 one
LM_POS_RS = (0.5, 1.0, 2.0)
# Per token: the rows whose logit is that token's maximum (a tie when several); the lowest wins.
LM_POS_WINNERS = (
    (LM_POS_V - 1,),                     # V - 1: last row of the partial last block (pass 2)
    (64 * 53 + 8 * 3 + 7,),              # last row of a warp; block 53: reduce lane 21 (upper half-warp)
    (64 * 45 + 63, 64 * 130 + 8, 64 * 261),  # tie across reduce warps 1, 4 and 0 (pass 2): 2943 wins
    (64 * 20 + 56, 64 * 259 + 1),        # tie inside reduce warp 0: lane 20 (upper) beats lane 3 (pass 2)
    (64 * 100 + 8 * 2 + 5, 64 * 100 + 8 * 2 + 6, 64 * 100 + 8 * 6),  # tie inside one block: same warp, other warp
    (64 * 32 + 17,),                     # block 32: reduce lane 0 of warp 1, alone (the lane whose best is
                                         # the warp's after lm_head_warp_best's shift-down tree)
)
LM_POS_RUNNER_UP = 64 * 200  # token 0's best once V - 1 is excluded: the first row of block 200
LM_POS_SOFTCAP = 2048.0  # logits stay below 1100: tanh keeps every order (see lm_head_positional_case)
# A cap of 1 on the same design with every row scale times 2^-11 (exact): the same capped
# values over 2048, with the cap at 1 itself (a kernel that caps only above 1 shows).
LM_POS_UNIT_CAP = 1.0
LM_POS_UNIT_CAP_RS = 2.0**-11


@dataclass(frozen=True)
class LmHeadPositionalCase:
    case: LmHeadCase  # softcap 0
    logits: np.ndarray  # float64 [T, V], exact (every one is exact in f32)


def lm_head_positional_case(seed: int = 11) -> LmHeadPositionalCase:
    """h and E drawn from SIGNED_SET, rs from LM_POS_RS (seeded); for each token t the rows
    LM_POS_WINNERS[t] are 2 * sign(h[t]) with rs = 1, the largest dot any row can reach
    (2 * sum |h[t]|), so they tie for the maximum; LM_POS_RUNNER_UP is token 0's winner row
    with one element halved (2 * sum |h[0]| - 0.5 when that element is +-0.5 in h).

    Exact: every product is a multiple of 1/4, every f32 partial sum a multiple of 1/4
    below 4 H = 1056, rs is a power of two, so each logit is exact in f32 in any order and
    the argmax (ties to the lowest index) is the one of these float64 logits. The builder
    checks that every token's maximum is reached exactly at its designed rows."""
    rng = np.random.default_rng(seed)
    values = np.asarray(SIGNED_SET)
    t = len(LM_POS_WINNERS)
    h = rng.choice(values, size=(t, LM_POS_H))
    E = rng.choice(values, size=(LM_POS_V, LM_POS_H))
    rs = rng.choice(np.asarray(LM_POS_RS), size=LM_POS_V)
    for tok, rows in enumerate(LM_POS_WINNERS):
        for r in rows:
            E[r] = 2.0 * np.sign(h[tok])
            rs[r] = 1.0
    j = int(np.flatnonzero(np.abs(h[0]) == 0.5)[0])
    E[LM_POS_RUNNER_UP] = 2.0 * np.sign(h[0])
    E[LM_POS_RUNNER_UP, j] = np.sign(h[0, j])
    rs[LM_POS_RUNNER_UP] = 1.0
    _check_f32_exact(np.asarray([4.0 * LM_POS_H]), 0.25, "lm_head_positional_case")
    logits = rs[None, :] * (h @ E.T)
    for tok, rows in enumerate(LM_POS_WINNERS):
        top = np.flatnonzero(logits[tok] == logits[tok].max())
        if tuple(top.tolist()) != tuple(sorted(rows)):
            raise ValueError(f"token {tok}: the maximum sits at rows {top.tolist()}, not at the designed {rows}")
    case = LmHeadCase(h=to_bf16(h), E=e4m3_bits(E), rs=rs.astype(np.float32), softcap=0.0)
    return LmHeadPositionalCase(case=case, logits=logits)


LM_NO_INDEX = 0x7FFFFFFF  # LM_HEAD_NO_INDEX: the index a block with no candidate reports


def _first_best(lg: np.ndarray, valid: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Along the last axis: (first position holding the largest valid value, that value), or
    (-1, -inf) where nothing is valid. -inf is a value like any other here: a row of valid
    -inf logits has a winner (its first valid position), which an exclusion done by writing
    -inf over the excluded logit would get wrong."""
    m = np.max(np.where(valid, lg, -np.inf), axis=-1)
    hit = valid & (lg == m[..., None])
    has = hit.any(axis=-1)
    first = np.argmax(hit, axis=-1)
    return np.where(has, first, -1), np.where(has, m, -np.inf)


def lm_head_argmax(logits: np.ndarray, excluded: int = -1) -> tuple[np.ndarray, np.ndarray]:
    """(index int32 [T], value float64 [T]) of exact logits, ties to the lowest index, the
    excluded column never winning: the contract's rule on the contract's logits (f32 values,
    -inf included: a token whose every logit is -inf answers its lowest candidate, -inf)."""
    lg = np.asarray(logits, dtype=np.float64)
    valid = ~np.isnan(lg)
    if excluded >= 0:
        valid[:, excluded] = False
    idx, val = _first_best(lg, valid)
    if np.any(idx < 0):
        raise ValueError("a token has no candidate logit: exclude at most one of V >= 2 rows")
    return idx.astype(np.int32), val


def lm_head_block_partials(logits: np.ndarray, excluded: int = -1,
                           rows_per_block: int = LM_ROWS_PER_BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """What `lm_head_partial` leaves in its scratch: (value float64 [T, blocks], index int32
    [T, blocks]), each block's best candidate by the same rule (ties to the lowest index, the
    excluded row never a candidate), (-inf, LM_NO_INDEX) for a block with no candidate."""
    lg = np.asarray(logits, dtype=np.float64)
    t, v = lg.shape
    blocks = -(-v // rows_per_block)
    pad = blocks * rows_per_block - v
    valid = np.concatenate([~np.isnan(lg), np.zeros((t, pad), dtype=bool)], axis=1)
    if excluded >= 0:
        valid[:, excluded] = False
    lg = np.concatenate([lg, np.full((t, pad), -np.inf)], axis=1)
    first, val = _first_best(lg.reshape(t, blocks, rows_per_block), valid.reshape(t, blocks, rows_per_block))
    base = np.arange(blocks)[None, :] * rows_per_block
    idx = np.where(first >= 0, base + first, LM_NO_INDEX)
    return idx.astype(np.int32), val


def f32_logits(rs: np.ndarray, dots: np.ndarray) -> np.ndarray:
    """float64 [T, V]: the f32 logit rs[v] * dot[t, v] of exact float64 dots (each exact in f32),
    rounded once to f32, as float64 (NaN where rs is infinite and the dot zero). Refuses a logit
    f32 would round other than by overflow:
    an overflow to +-inf is the one rounding every f32 order agrees on (the dot is exact, the
    product's magnitude is past the largest f32 by more than half an ulp)."""
    exact = rs[None, :].astype(np.float64) * dots
    with np.errstate(over="ignore"):
        f32 = exact.astype(np.float32).astype(np.float64)
    # an infinite rs times a zero dot is NaN in float64 and in f32 alike: no rounding
    rounded = (f32 != exact) & ~(np.isinf(f32) & (np.abs(exact) >= 2.0**128)) & ~(np.isnan(f32) & np.isnan(exact))
    if rounded.any() or not np.array_equal(dots.astype(np.float32).astype(np.float64), dots):
        raise ValueError("a designed dot or logit is not exact in f32 (and not an overflow): the argmax "
                         "would depend on the order")
    return f32


# The sweep's design. A real vocabulary (128K to 256K rows) at a real width is up to a GB of
# e4m3: drawn row by row, the host would take seconds a shape. So the embedding repeats: row v
# is base row v % LM_SWEEP_PERIOD, each row with its own scale, except the designed winners'
# rows. The period is a prime above the 64 rows of a block, so no block holds a base row twice
# and blocks (and warps of 8) meet the base rows at every phase: each block has its own best,
# and a row read in another row's place reads other values. The device builds E by gathering
# base rows; the host's logits come from the T x PERIOD dots.
LM_SWEEP_PERIOD = 251


@dataclass(frozen=True)
class LmHeadSweepCase:
    h: np.ndarray  # bf16 [T, H]
    base: np.ndarray  # uint8 e4m3 [PERIOD, H]: row v of E is base[v % PERIOD] ...
    rows: np.ndarray  # int64 [S], ascending: ... except these rows,
    special: np.ndarray  # uint8 e4m3 [S, H]: which hold these
    rs: np.ndarray  # f32 [V]
    excluded: int  # a row that never wins (-1: none)
    logits: np.ndarray  # float64 [T, V], exact

    def embedding(self) -> np.ndarray:
        """E [V, H] on the host (what the device gathers)."""
        v = self.rs.shape[0]
        E = self.base[np.arange(v) % self.base.shape[0]]
        E[self.rows] = self.special
        return E


def lm_head_sweep_excluded(v: int) -> int:
    """The row a sweep case excludes: V // 2, none for a vocabulary of one row."""
    return v // 2 if v >= 2 else -1


def lm_head_sweep_case(t: int, v: int, hdim: int, seed: int) -> LmHeadSweepCase:
    """h and the base rows drawn from SIGNED_SET, row scales from LM_POS_RS (seeded), E
    repeating the base rows (above); the designed rows are 2 * sign(h[tok]) with scale 1, the
    largest dot a row can reach: token 0's is V - 1 (the last block's last row); token 1's
    two tie, one of them the excluded row V // 2, so its answer is the other; every later
    token's is a drawn row. Rows can coincide at small V; the logits are the truth either way.

    Exact as the positional design: products multiples of 1/4, every f32 partial sum a
    multiple of 1/4 below 4 H, scales powers of two; the argmax and every block's partial are
    those of these float64 logits."""
    if v < 1 or t < 1 or hdim < 8 or hdim % 8:
        raise ValueError(f"T={t}, V={v}, H={hdim}: need T, V >= 1 and H a positive multiple of 8")
    _check_f32_exact(np.asarray([4.0 * hdim]), 0.25, "lm_head_sweep_case")
    rng = np.random.default_rng(seed)
    values = np.asarray(SIGNED_SET)
    h = rng.choice(values, size=(t, hdim))
    base = rng.choice(values, size=(LM_SWEEP_PERIOD, hdim))
    rs = rng.choice(np.asarray(LM_POS_RS), size=v)
    excluded = lm_head_sweep_excluded(v)
    designed: dict[int, np.ndarray] = {}
    for tok in range(t):
        if tok == 0:
            rows = (v - 1,)
        elif tok == 1:
            rows = (max(excluded, 0), int(rng.integers(v)))
        else:
            rows = (int(rng.integers(v)),)
        for r in rows:
            designed[r] = 2.0 * np.sign(h[tok])
            rs[r] = 1.0
    rows = np.asarray(sorted(designed), dtype=np.int64)
    special = np.stack([designed[r] for r in rows.tolist()])
    logits = rs[None, :] * (h @ base.T)[:, np.arange(v) % LM_SWEEP_PERIOD]
    logits[:, rows] = rs[rows][None, :] * (h @ special.T)
    return LmHeadSweepCase(h=to_bf16(h), base=e4m3_bits(base), rows=rows, special=e4m3_bits(special),
                           rs=rs.astype(np.float32), excluded=excluded, logits=logits)


@dataclass(frozen=True)
class LmHeadFarRowsCase:
    h: np.ndarray  # bf16 [T, H]
    E: np.ndarray  # uint8 e4m3 [R, H]: the live rows V - R .. V - 1
    rs: np.ndarray  # f32 [V]: NaN outside the live rows, whose logits then never win
    decoys: np.ndarray  # uint8 e4m3 [R, H]: rows of the same design that are no row of E
    logits: np.ndarray  # float64 [T, V]: NaN outside the live rows, exact inside


def lm_head_far_rows_case(t: int, v: int, hdim: int, live: int, winners: tuple[tuple[int, ...], ...],
                          seed: int) -> LmHeadFarRowsCase:
    """A vocabulary of V rows of which only the last `live` are data (the rest are memory a
    gate never writes): h, the live rows and `decoys` drawn from SIGNED_SET, live row scales
    from LM_POS_RS, every other row's scale NaN (its logit NaN, which never wins, whatever its
    row holds). Token t's rows `winners[t]` are 2 * sign(h[t]) with scale 1 (they tie for its
    maximum). Exact as the positional design."""
    if len(winners) != t or any(not v - live <= r < v for rows in winners for r in rows):
        raise ValueError(f"one winner tuple a token, each row among the last {live} of V={v}")
    _check_f32_exact(np.asarray([4.0 * hdim]), 0.25, "lm_head_far_rows_case")
    rng = np.random.default_rng(seed)
    values = np.asarray(SIGNED_SET)
    h = rng.choice(values, size=(t, hdim))
    E = rng.choice(values, size=(live, hdim))
    decoys = rng.choice(values, size=(live, hdim))
    live_rs = rng.choice(np.asarray(LM_POS_RS), size=live)
    for tok, rows in enumerate(winners):
        for r in rows:
            E[r - (v - live)] = 2.0 * np.sign(h[tok])
            live_rs[r - (v - live)] = 1.0
    rs = np.full(v, np.nan)
    rs[v - live:] = live_rs
    logits = np.full((t, v), np.nan)
    logits[:, v - live:] = live_rs[None, :] * (h @ E.T)
    return LmHeadFarRowsCase(h=to_bf16(h), E=e4m3_bits(E), rs=rs.astype(np.float32), decoys=e4m3_bits(decoys),
                             logits=logits)


# The edge design: logits at or below zero, where
# an initial best of 0 or -FLT_MAX instead of -inf shows, and odd e4m3 codes in the winning row.
LM_EDGE_H = 72  # 9 steps of 8: lanes 0-8 take one, lanes 9-31 none
LM_EDGE_V = 64 * 242 + 37  # 243 partials a row (reduce warps 0-7, one pass), the last block partial
LM_EDGE_RS = (8.0, 16.0, 32.0)  # powers of two, >= 8: rs * dot overflows for token 0
POSITIVE_SET = (0.5, 1.0, 1.125, 1.5, 2.0)  # E > 0 everywhere: token 0's every dot is negative
LM_EDGE_OVERFLOW_H = -(2.0**120)  # token 0's h: dot = -2^120 * sum E[v] in [-2^127.2, -2^125.1], exact
LM_EDGE_WINNER = 64 * 230 + 8 * 7 + 5  # token 1's winner: block 230's last warp (warp 7); reduce warp 7
LM_EDGE_ODD = (0, 10, 36, 62)  # even elements (a pair's low byte) of the winner row set to 1.125 (code 0x39)


@dataclass(frozen=True)
class LmHeadEdgeCase:
    case: LmHeadCase  # softcap 0
    logits: np.ndarray  # float64 [2, V]: the f32 logits (token 0 all -inf), exact


# Each token's lone candidate: rows 8w + w of block 0 (warp w, lane-order position w), one in
# block 1's warp 3 and one in its warp 0 (row 66).
LM_LONE_ROWS = (3, 9, 18, 27, 36, 45, 54, 63, 64 + 8 * 3 + 6, 66)
LM_LONE_V = 128  # two blocks


def lm_head_lone_candidate_case() -> LmHeadCase:
    """Every logit NaN but one, which is -inf: rs = +inf for every row, E = -1 on the
    diagonal and 0 elsewhere (V = H = 128), and token t's h the one-hot vector of
    LM_LONE_ROWS[t]. Row v's dot is -1 at v = LM_LONE_ROWS[t] (logit -inf) and a zero
    elsewhere (logit inf * 0 = NaN, which never wins): the answer is (LM_LONE_ROWS[t], -inf).

    So before each token's candidate every warp of its block has no candidate at all: its
    slot holds (-inf, no index), and the block's final stage must still take the -inf row
    over "nothing". A stage that breaks a tie between equal values by another warp's index
    (`s_idx[w - 1]`) keeps no index there; the positional and edge designs always have a
    candidate in an earlier warp, where that index is never lower and nothing changes."""
    v = hdim = LM_LONE_V
    E = np.zeros((v, hdim), dtype=np.uint8)
    E[np.arange(v), np.arange(v)] = e4m3_bits([-1.0])[0]
    h = np.zeros((len(LM_LONE_ROWS), hdim))
    h[np.arange(len(LM_LONE_ROWS)), list(LM_LONE_ROWS)] = 1.0
    return LmHeadCase(h=to_bf16(h), E=E, rs=np.full(v, np.inf, dtype=np.float32), softcap=0.0)


def lm_head_exact_logits(case: LmHeadCase) -> np.ndarray:
    """`f32_logits` of a case's own bits (h bf16, E e4m3, rs f32): refused unless every dot
    and logit is exact in f32."""
    from harness.library.dtypes import decode_e4m3

    with np.errstate(invalid="ignore"):  # rs = inf times a zero dot: NaN, as on the device
        return f32_logits(case.rs, case.h.astype(np.float64) @ decode_e4m3(case.E).astype(np.float64).T)


def lm_head_edge_case(seed: int = 12) -> LmHeadEdgeCase:
    """Two tokens over E drawn from POSITIVE_SET and rs from LM_EDGE_RS (seeded):

    - token 0: h = -2^120 everywhere. Every dot is -2^120 * sum E[v], exact (multiples of
      2^117, at most 2^127.2 in magnitude, so no partial sum rounds or overflows), and every
      logit rs * dot is at most -8 * 2^120 * 36 < -2^128: it overflows to -inf, in every
      order. The answer is (lowest candidate, -inf): an initial best of 0 or -FLT_MAX in
      either kernel reports (LM_NO_INDEX, that value) instead, and a reduce that reads one
      partial past its row takes token 1's block 0 (finite) over -inf.
    - token 1: h = -|h'|, h' drawn from {0.5, 1, 2}: every logit is negative. Its winner is
      LM_EDGE_WINNER, in the last warp of block 230, whose partial the reduce kernel's
      last warp (threads 224-255) holds: a block stage or a cross-warp stage that skips or
      mis-reads its last warp loses it. E = 0.5 there except 1.125 at the even elements
      LM_EDGE_ODD, rs 8: the least negative logit (checked). 1.125 has an odd mantissa
      code, at a pair's low byte, so a dot that drops that bit moves the value.

    Exact: token 1's products are multiples of 1/16, its partial sums below 2 * 2 * H, its
    logits multiples of 1/2 below 32 * 4 * H in magnitude."""
    rng = np.random.default_rng(seed)
    E = rng.choice(np.asarray(POSITIVE_SET), size=(LM_EDGE_V, LM_EDGE_H))
    rs = rng.choice(np.asarray(LM_EDGE_RS), size=LM_EDGE_V)
    E[LM_EDGE_WINNER] = 0.5
    E[LM_EDGE_WINNER, list(LM_EDGE_ODD)] = 1.125
    rs[LM_EDGE_WINNER] = min(LM_EDGE_RS)
    h = np.stack([np.full(LM_EDGE_H, LM_EDGE_OVERFLOW_H),
                  -rng.choice(np.asarray([0.5, 1.0, 2.0]), size=LM_EDGE_H)])
    _check_f32_exact(np.asarray([2.0 * 2.0 * LM_EDGE_H]), 1.0 / 16, "lm_head_edge_case")
    logits = f32_logits(rs, h @ E.T)
    if not np.all(logits[0] == -np.inf):
        raise ValueError("token 0: a logit did not overflow to -inf; raise |h| or the row scales")
    if not (np.all(logits[1] < 0) and np.flatnonzero(logits[1] == logits[1].max()).tolist() == [LM_EDGE_WINNER]):
        raise ValueError(f"token 1: the maximum is not at row {LM_EDGE_WINNER} alone, or a logit is >= 0")
    case = LmHeadCase(h=exact_bf16(h), E=e4m3_bits(E), rs=rs.astype(np.float32), softcap=0.0)
    return LmHeadEdgeCase(case=case, logits=logits)


# ------------------------------------------------------------------ NVFP4 GEMV

NVFP4_GROUP = 16
NVFP4_SCALES = (0.5, 1.0, 2.0, 4.0)  # powers of two: exact in e4m3 and in every product


@dataclass(frozen=True)
class Nvfp4Case:
    x: np.ndarray  # bf16 [K]
    w: np.ndarray  # uint8 [N, K / 2], e2m1 two a byte, low nibble first
    s: np.ndarray  # uint8 e4m3 bits [N, K / 16]
    gs: float


def nvfp4_designed(n: int, k: int, seed: int) -> Nvfp4Case:
    """Inputs on which every order of summation is exact: x multiples of 0.25 in [-4, 4],
    all 16 e2m1 codes, block scales 0.5..4, global scale 0.5. Each product is a multiple of
    1/16 below 96 in magnitude, so every f32 partial sum is exact while 96 K < 2^20."""
    rng = np.random.default_rng(seed)
    x = to_bf16(rng.integers(-16, 17, size=k) / 4.0)
    w = pack_fp4(decode_e2m1(rng.integers(0, 16, size=(n, k), dtype=np.uint8)))
    s = e4m3_bits(rng.choice(NVFP4_SCALES, size=(n, k // NVFP4_GROUP)))
    _check_f32_exact(np.asarray([96.0 * k]), 1.0 / 16, "nvfp4_designed")
    return Nvfp4Case(x=x, w=w, s=s, gs=0.5)


# The sweep's inputs: x of magnitude at most 1 (not nvfp4_designed's 4), so that the exactness
# bound reaches the production K (the largest term is 1 * 6 * 4 = 24, a multiple of 1/16:
# every f32 partial sum is exact while 24 K < 2^20, K below 43690; Llama-3 70B's down_proj
# takes K = 28672). No zero x: an element that multiplies by zero hides which weight it met.
NVFP4_SWEEP_X = (-1.0, -0.75, -0.5, -0.25, 0.25, 0.5, 0.75, 1.0)
E2M1_MAX = 6.0


def nvfp4_sweep_case(n: int, k: int, seed: int) -> Nvfp4Case:
    """x drawn from NVFP4_SWEEP_X, every e2m1 code (drawn as codes and packed, low nibble
    first), block scales from NVFP4_SCALES, global scale 0.5: every term a multiple of 1/16
    below 24, so every f32 partial sum is exact in any order and `nvfp4_expected` is exact.
    Most outputs need more than bf16's 8 significant bits, so the output rounding shows.
    Built for sweep sizes (N * K up to 2^24) in well under a second."""
    if k <= 0 or k % NVFP4_GROUP:
        raise ValueError(f"K={k} is not a positive multiple of {NVFP4_GROUP}")
    _check_f32_exact(np.asarray([24.0 * k]), 1.0 / 16, "nvfp4_sweep_case")
    rng = np.random.default_rng(seed)
    x = to_bf16(rng.choice(np.asarray(NVFP4_SWEEP_X), size=k))
    codes = rng.integers(0, 16, size=(n, k), dtype=np.uint8)
    w = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    s = e4m3_bits(np.asarray(NVFP4_SCALES))[rng.integers(0, len(NVFP4_SCALES), size=(n, k // NVFP4_GROUP))]
    return Nvfp4Case(x=x, w=w, s=s, gs=0.5)


def nvfp4_random(n: int, k: int, seed: int) -> Nvfp4Case:
    """Arbitrary inputs (rounding everywhere) for the SW-equals-base link."""
    rng = np.random.default_rng(seed)
    x = to_bf16(rng.standard_normal(k))
    w = rng.integers(0, 256, size=(n, k // 2), dtype=np.uint8)
    s = to_fp8_e4m3(rng.uniform(0.01, 3.0, size=(n, k // NVFP4_GROUP))).view(np.uint8)
    return Nvfp4Case(x=x, w=w, s=s, gs=0.0123)


def nvfp4_expected(case: Nvfp4Case) -> np.ndarray:
    """y[n] = bf16(gs * sum_k x[k] * e2m1(w[n, k]) * e4m3(s[n, k / 16])), from the contract's
    formula over ml_dtypes decodes. Exact for `nvfp4_designed` and `nvfp4_sweep_case` inputs
    (gs a power of two, x a multiple of 1/4, block scales multiples of 1/2: every term a
    multiple of 1/16, and each row's sum of |terms| bounded below 2^20, both checked); refuses
    other inputs, whose f32 sums round order-dependently.

    Vectorised for sweep-sized weights: each weight times its block scale is exact in f32 (at
    most 2 and 4 significant bits), and so is every partial sum of the dot in any order (a
    multiple of 1/16 below 2^20), so one f32 matrix-vector product gives the exact dot."""
    n, half = case.w.shape
    k = 2 * half
    groups = k // NVFP4_GROUP
    x = case.x.astype(np.float64)
    scale = decode_e4m3(case.s)  # f32 [N, K / 16]
    if (not np.all(np.mod(x * 4, 1) == 0) or not np.all(np.mod(scale * 2, 1) == 0)
            or abs(case.gs) not in (0.25, 0.5, 1.0, 2.0)):
        raise ValueError("nvfp4_expected is exact only on nvfp4_designed inputs; link other inputs to a certified arm")
    group_abs = E2M1_MAX * np.abs(x).reshape(groups, NVFP4_GROUP).sum(axis=1)  # bounds a group's sum of |terms|
    _check_f32_exact(scale.astype(np.float64) @ group_abs, 1.0 / 16, "nvfp4_expected")
    codes = np.arange(256)
    table = decode_e2m1(np.arange(16, dtype=np.uint8))  # the 16 e2m1 values, decoded by ml_dtypes
    pairs = np.stack([table[codes & 0x0F], table[codes >> 4]], axis=-1)  # a byte's two values, low nibble first
    w = pairs[case.w].reshape(n, groups, NVFP4_GROUP) * scale[:, :, None]
    dots = w.reshape(n, k) @ case.x.astype(np.float32)
    return to_bf16(case.gs * dots.astype(np.float64)).reshape(n)


# ------------------------------------------------------------------ order-sensitive inputs
#
# The invariance and determinism gates compare GPU arms with each other, bit for bit, so their
# inputs need no closed form. They need the opposite of the anchors' designs: outputs whose
# bits move when the order of the f32 additions moves. Plain random inputs hide such a change
# behind the bf16 output rounding (a few f32 ulps of the dot rarely cross a bf16 boundary).
# Outlier channels do not: a few channels carry values 2^10 or more above the rest (as the
# outlier features of real activations do), in pairs whose products cancel, so a partial sum
# that holds an outlier keeps only its high bits while the dot itself is small: the output's
# bf16 bits carry the rounding of the order in which the partial sums met.


def _signed_fp(rng, size, exponents, mantissa_bits: int) -> np.ndarray:
    """+-(1 + m / 2^mantissa_bits) * 2^e, e drawn from `exponents`, m from all the mantissas."""
    e = rng.choice(np.asarray(exponents), size=size)
    m = rng.integers(0, 2**mantissa_bits, size=size)
    return rng.choice((-1.0, 1.0), size=size) * (1.0 + m / 2.0**mantissa_bits) * 2.0**e


def _outlier_pairs(rng, slots: int, pairs: int) -> tuple[np.ndarray, np.ndarray]:
    """Two disjoint sets of `pairs` slots of range(slots): pair i is (a[i], b[i])."""
    if 2 * pairs > slots:
        raise ValueError(f"{pairs} outlier pairs need {2 * pairs} slots, there are {slots}")
    chosen = rng.permutation(slots)[:2 * pairs]
    return chosen[:pairs], chosen[pairs:]


@dataclass(frozen=True)
class Fp8Inputs:
    """FP8 GEMV inputs with no expected output: the weights of every segment as one matrix
    (a gate splits it into segments as it likes)."""

    x: np.ndarray  # uint8 e4m3 bits [T, K]
    xs: np.ndarray  # f32 [T]
    w: np.ndarray  # uint8 e4m3 bits [N, K]
    ws: np.ndarray  # f32 [N]


FP8_ORDINARY_EXPONENTS = tuple(range(-6, 0))  # 2^-6 .. 2^-1 (e4m3 normals)
FP8_OUTLIER_EXPONENTS = (5, 6, 7, 8)  # 32 .. 448 (at 2^8 only mantissas up to 1.75)


def fp8_outlier_case(t: int, k: int, n: int, seed: int, pairs: int = 32) -> Fp8Inputs:
    """x [T, K] and w [N, K] from e4m3 values +-2^-6 .. 2^-1 (every mantissa), except `pairs`
    pairs of outlier channels (a, b), the same for every token as activation outliers are:
    x[:, a] = x[:, b] and w[:, b] = -w[:, a], both +-32 .. 448. The pair's products cancel
    exactly, products up to 2^17.6 sit beside ordinary ones down to 2^-12, so a partial sum
    holding one rounds every ordinary product added to it; the dot is of order 1. Token and
    row scales are arbitrary f32 (not powers of two). Every value is exact in e4m3 (checked)."""
    if k % FP8_CHUNK:
        raise ValueError(f"K={k} is not a multiple of {FP8_CHUNK}")
    rng = np.random.default_rng(seed)
    x = _signed_fp(rng, (t, k), FP8_ORDINARY_EXPONENTS, 3)
    w = _signed_fp(rng, (n, k), FP8_ORDINARY_EXPONENTS, 3)
    a, b = _outlier_pairs(rng, k, pairs)
    big = _signed_fp(rng, (t + n, pairs), FP8_OUTLIER_EXPONENTS, 3)
    big = np.clip(big, -448.0, 448.0)  # 2^8 * 1.875 -> 448, still an e4m3 value
    x[:, a] = x[:, b] = big[:t]
    w[:, a] = big[t:]
    w[:, b] = -big[t:]
    xs = (2.0 ** rng.uniform(-3.0, 0.0, size=t)).astype(np.float32)
    ws = (2.0 ** rng.uniform(-4.0, -1.0, size=n)).astype(np.float32)
    return Fp8Inputs(x=e4m3_bits(x), xs=xs, w=e4m3_bits(w), ws=ws)


NVFP4_ORDINARY_EXPONENTS = tuple(range(-10, -5))  # x: 2^-10 .. 2^-6
NVFP4_OUTLIER_EXPONENTS = tuple(range(10, 15))  # x: 2^10 .. 2^14
NVFP4_OUTLIER_SCALES = (0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 4.0)  # e4m3 block scales


def nvfp4_outlier_case(n: int, k: int, seed: int, pairs: int = 32) -> Nvfp4Case:
    """x bf16 [K] of +-2^-10 .. 2^-6 (every bf16 mantissa), all 16 e2m1 codes, block scales
    from NVFP4_OUTLIER_SCALES, global scale 0.0123; except `pairs` pairs of outlier channels
    (a, b) in distinct groups: x[a] = x[b] = +-2^10 .. 2^14, the weight code at b the code at
    a with its sign flipped (nonzero), the block scale of b's group that of a's. Each pair's
    products cancel exactly; the group and lane sums holding one keep only their high bits
    (about 2^-5 against an output of order 2^-5 / 0.0123 before scaling)."""
    if k % NVFP4_GROUP:
        raise ValueError(f"K={k} is not a multiple of {NVFP4_GROUP}")
    rng = np.random.default_rng(seed)
    groups = k // NVFP4_GROUP
    x = _signed_fp(rng, k, NVFP4_ORDINARY_EXPONENTS, 7)
    codes = rng.integers(0, 16, size=(n, k), dtype=np.uint8)
    scales = rng.choice(np.asarray(NVFP4_OUTLIER_SCALES), size=(n, groups))
    ga, gb = _outlier_pairs(rng, groups, pairs)
    a = ga * NVFP4_GROUP + rng.integers(0, NVFP4_GROUP, size=pairs)
    b = gb * NVFP4_GROUP + rng.integers(0, NVFP4_GROUP, size=pairs)
    x[a] = x[b] = _signed_fp(rng, pairs, NVFP4_OUTLIER_EXPONENTS, 7)
    codes[:, a] = rng.integers(1, 8, size=(n, pairs), dtype=np.uint8) | (rng.integers(0, 2, size=(n, pairs),
                                                                                        dtype=np.uint8) << 3)
    codes[:, b] = codes[:, a] ^ 8
    scales[:, gb] = scales[:, ga]
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    return Nvfp4Case(x=exact_bf16(x), w=packed, s=e4m3_bits(scales), gs=0.0123)


LM_OUTLIER_EXPONENTS = tuple(range(8, 11))  # h: 2^8 .. 2^10


def lm_head_outlier_case(t: int, v: int, hdim: int, seed: int, pairs: int = 8, softcap: float = 30.0) -> LmHeadCase:
    """h bf16 [T, H] standard normal, E e4m3 [V, H] of normal values (rounded to e4m3), row
    scales uniform in [0.01, 0.1), except `pairs` pairs of outlier channels (a, b):
    h[:, a] = h[:, b] = +-2^8 .. 2^10, E[:, b] = -E[:, a]. The pair's products cancel exactly;
    a lane's partial holding one is of order 2^11 while the logit is of order 1, so even the
    argmax row's value (the largest logit, the least cancelled on plain random inputs) carries
    the rounding of the order its dot was summed in."""
    rng = np.random.default_rng(seed)
    h = rng.standard_normal((t, hdim))
    E = decode_e4m3(to_fp8_e4m3(rng.standard_normal((v, hdim))).view(np.uint8)).astype(np.float64)
    a, b = _outlier_pairs(rng, hdim, pairs)
    h[:, a] = h[:, b] = _signed_fp(rng, (t, pairs), LM_OUTLIER_EXPONENTS, 7)
    E[:, b] = -E[:, a]
    rs = rng.uniform(0.01, 0.1, size=v).astype(np.float32)
    return LmHeadCase(h=to_bf16(h), E=e4m3_bits(E), rs=rs, softcap=softcap)
