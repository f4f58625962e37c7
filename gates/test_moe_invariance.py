"""NVFP4 MoE decode: batch invariance and run-to-run determinism of every stage (post_attn,
router, glu, down, final), every output read back, on inputs designed to show any other order
of the stages' reductions.

A row is a token. The only batch parameter the launcher takes is T, the tokens of a launch
(1 to MOE_MAX_T = 8); from it come the post_attn and final grids (T blocks), the router's
accumulators and selection warps (token t's logits in acc[t], its top K in warp t of the
last CTA: T = 8 takes every warp) and the expert grids' T * K slot blocks. Nothing else is
derived from T: no split count, no block size, no tile. So the invariance gate runs every T
the launcher accepts (1 to 8), which crosses any threshold a launcher could derive from T,
at the first, middle and last place of each batch, under both launch layouts the family
has (LAYOUTS): a token's bits must be its bits alone.

Random tokens would hide a batch-dependent order: a norm's sum of squares reassociated moves
rsqrt by an ulp, which a bf16, e4m3 or e2m1 output rounds away nearly always. So each stage is
launched on its own designed inputs (oracles.moe_decode, "order-sensitive designs"), not on
the stage before's outputs: ladders of squares whose f32 sum moves by ulps under any other
grouping, outputs whose other addend cancels the normalised term so that an ulp of the
factor moves their bf16 bits, router inputs over twenty binades, and NVFP4 rows that cancel
on a pair of groups so that the bf16 output is made of the roundings. tests/test_moe_decode_
oracles.py shows on the host that every order that regroups at these shapes moves outputs of
the checked tokens.

The pool: live tokens 0..6, token 7 = token 0 (its twin: the same experts, so each of those
experts gets two tokens of the batch) and token 8 zero everywhere (rr = 0: every logit is +0
and the top K is all ties, ids 0..K-1). The expert stages' ids are designed (token 3 shares an
expert with token 0); the router's own picks share experts by pigeonhole from 5 tokens at E 13,
K 3 and from 3 at E 16, K 8 (checked on the batch of 8): an expert's slots then come from
several tokens, at slot places that move with the batch.

The determinism gate repeats every stage at decode's largest batch (T 8, K 8: 64 slots, a
token's 8 expert rows of `opair` computed by 8 different blocks of moe_down, 11,264 blocks in
all) with the seed's H and I, on fresh zeroed buffers each repeat (an engine's zeroed
buffers: a kernel that accumulates into its output then shows the order of its additions,
where a NaN sentinel would read as the same NaN every repeat), alternating the current
stream with two other non-blocking streams, and every other repeat first overwriting a 128 MiB
scratch buffer (more than the H200's L2), so the blocks' loads hit and miss differently
between repeats and any race is run with other timings.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import pytest

from gates import _moe_decode as g
from harness.library.caching import host_cache
from harness.library.invariance import assert_batch_invariant, assert_deterministic
from kernels_cu import moe_decode as moe
from oracles import moe_decode as od


@dataclass(frozen=True)
class Layout:
    """A launch variant: slots a token past K (the slot stride kcap is K + spare), whether
    moe_glu also writes its bf16 g/u rows, and whether the experts sit at a permuted table's
    storage slots. The chain's bits must not depend on any of them."""

    spare_slots: int
    gu_rows: bool
    permuted_table: bool


LAYOUTS = {
    "kcap K+2, g/u rows, identity table": Layout(spare_slots=2, gu_rows=True, permuted_table=False),
    "kcap K, no g/u rows (production), permuted table": Layout(spare_slots=0, gu_rows=False, permuted_table=True),
}

# Every output a token owns, in pipeline order: the first one whose bits differ names the
# stage that made the difference. Slot buffers are read at slots 0..K-1 (kcap differs between
# the layouts); fs is one value a token.
OUTPUTS = ("post_attn mid", "post_attn rr", "post_attn fq", "post_attn fs", "post_attn gq", "post_attn gsc",
           "router logits", "router ids", "router wts", "glu g/u", "glu hq", "glu hs", "down opair", "final out")
# The stages, each launched on its own designed inputs: the invariance gate checks each in a
# gate of its own (the same batches and layouts; a failure names its stage in the node id, and
# the five spread over a run's lanes), the determinism gate runs them in pipeline order.
STAGES = ("post_attn", "router", "glu", "down", "final")


def outputs_of(stage: str) -> tuple[str, ...]:
    return tuple(name for name in OUTPUTS if name.split(" ", 1)[0] == stage)

TWIN, ZERO = od.ORDER_TWIN, od.ORDER_ZERO
ROWS = (0, TWIN, ZERO, 3)  # checked: a live token, its twin, the zero token, another live token
FILLERS = (1, 2, 4, 5, 6)  # computed around them, not checked
BATCH_SIZES = tuple(range(1, moe.MAX_T + 1))
POSITIONS = (0, "middle", -1)

SHAPES = {
    # The contract's small shape (E not a multiple of the router's 8 experts a block, H three
    # 64-lane sweeps, K odd): 3 experts a token among 13.
    "small-E13-H192-I128-K3": g.Shape(t=od.ORDER_POOL, h=192, i=128, e=13, k=3),
    # The seed's H and I with decode's largest K (8 of 16 experts: every expert serves several
    # tokens of a batch); H 2816 is 11 of the router's 16-byte chunks a lane, 11 passes of a
    # norm's 256 threads, and 2 full 64-lane sweeps plus a tail in glu. All 16 experts are
    # filled (48 MB).
    "seed-H2816-I704-E16-K8": g.Shape(t=od.ORDER_POOL, h=2816, i=704, e=16, k=8),
}
DETERMINISM_SHAPE = "seed-H2816-I704-E16-K8"
DETERMINISM_TOKENS = tuple(range(moe.MAX_T))  # T 8: the seven live tokens and the twin
REPEATS = 30
L2_EVICT_BYTES = 128 << 20


@host_cache(disk=True)
def order_pool(shape_id: str) -> od.OrderPool:
    """The designed pool of a shape (host only; seconds to build at the seed's size, so kept on disk)."""
    s = SHAPES[shape_id]
    return od.order_pool(s.h, s.i, s.e, s.k, seed=s.h + s.e)


@dataclass
class Case:
    shape: g.Shape
    pool: od.OrderPool
    experts: dict  # permuted_table -> moe.Experts
    weights: dict  # the shared weights on the device, by name
    ticket: object  # one ticket counter for every launch of the case, as an engine keeps one


@functools.lru_cache(maxsize=None)
def _case(shape_id: str) -> Case:
    s = SHAPES[shape_id]
    pool = order_pool(shape_id)
    w = pool.experts.weights
    experts = {False: g.device_experts(s, w, np.arange(s.e, dtype=np.int32)),
               True: g.device_experts(s, w, od.permuted_table(s.e, seed=s.e))}
    shared = {"w_pa": pool.post.w_pa, "w_router": pool.post.w_router, "wr": pool.router.wr, "pes": pool.router.pes,
              "w_d": pool.final.w_d, "w_m": pool.final.w_m}
    return Case(shape=s, pool=pool, experts=experts, weights={n: g.put(v) for n, v in shared.items()},
                ticket=g.zero_ticket())


def _slots(a: np.ndarray, kcap: int, fill) -> np.ndarray:
    """[n, K, ...] -> [n, kcap, ...], the slots past K holding `fill` (never read)."""
    out = np.full((a.shape[0], kcap, *a.shape[2:]), fill, dtype=a.dtype)
    out[:, :a.shape[1]] = a
    return out


def _stage(case: Case, stage: str, tokens, layout: Layout, *, zeroed: bool = False) -> dict:
    """One stage on the pool's `tokens` as one batch (T = len(tokens)) under `layout`, on its
    designed inputs: every output of it a token owns, on the host, first axis the batch."""
    s, p, w = case.shape, case.pool, case.weights
    rows = np.asarray(tokens, dtype=np.int64)
    k, kcap = s.k, s.k + layout.spare_slots
    experts = case.experts[layout.permuted_table]
    ex = p.experts
    ids = _slots(ex.ids[rows], kcap, g.ID_SENTINEL)
    if stage == "post_attn":
        post = g.run_post_attn(p.post.x[rows], p.post.o[rows], w["w_pa"], w["w_router"], act_g=p.post.act_g,
                               eps=p.post.eps, zeroed=zeroed)
        got = {"post_attn mid": post.mid, "post_attn rr": post.rr, "post_attn fq": post.fq,
               "post_attn fs": post.fs.reshape(-1, 1), "post_attn gq": post.gq, "post_attn gsc": post.gsc}
    elif stage == "router":
        router = g.run_router(p.router.rr[rows], w["wr"], w["pes"], k=k, kcap=kcap, ticket=case.ticket,
                              zeroed=zeroed)
        got = {"router logits": router.logits, "router ids": router.ids[:, :k], "router wts": router.wts[:, :k]}
    elif stage == "glu":
        hq, hs, gu = g.run_glu(ids, ex.gq[rows], ex.gsc[rows], experts, act_g=ex.act_g, act_h=ex.act_h, k=k, i=s.i,
                               gu_rows=layout.gu_rows, zeroed=zeroed)
        got = {"glu hq": hq[:, :k], "glu hs": hs[:, :k]}
        if gu is not None:
            got["glu g/u"] = gu[:, :k]
    elif stage == "down":
        opair = g.run_down(ids, _slots(ex.hq[rows], kcap, g.BYTE_SENTINEL), _slots(ex.hs[rows], kcap, g.BYTE_SENTINEL),
                           experts, act_h=ex.act_h, k=k, h=s.h, zeroed=zeroed)
        got = {"down opair": opair[:, :k]}
    elif stage == "final":
        f = p.final
        got = {"final out": g.run_final(f.dense[rows], _slots(f.opair[rows], kcap, np.nan),
                                        _slots(f.wts[rows], kcap, np.nan), f.mid[rows], w["w_d"], w["w_m"],
                                        layer_scalar=f.layer_scalar, eps=f.eps, k=k, zeroed=zeroed)}
    else:
        raise ValueError(f"no stage {stage!r}: one of {', '.join(STAGES)}")
    return {name: g.host(v) for name, v in got.items()}


def _layer(case: Case, tokens, layout: Layout, *, zeroed: bool = False) -> dict:
    """Every stage on the pool's `tokens` as one batch: every output a token owns."""
    out = {}
    for stage in STAGES:
        out.update(_stage(case, stage, tokens, layout, zeroed=zeroed))
    return out


def _layouts_with(name: str) -> dict:
    """The layouts under which output `name` exists (the g/u rows only where glu writes them)."""
    return {n: lay for n, lay in LAYOUTS.items() if name != "glu g/u" or lay.gu_rows}


def _assert_the_pool_collides(case: Case, stage: str, full: dict) -> None:
    """Non-vacuity: the batch of every checked row and filler writes every output of the stage;
    for the router, the twin picks its token's experts, the zero token's top K is all ties (ids
    0..K-1), and two different tokens share an expert, in the router's picks and in the expert
    stages' ids."""
    s, tokens = case.shape, ROWS + FILLERS[:moe.MAX_T - len(ROWS)]
    for name, a in full.items():
        g.assert_fully_written(f"{name} (a batch of {len(tokens)})", a)
    if stage != "router":
        return
    ids = full["router ids"]
    pos = {tok: i for i, tok in enumerate(tokens)}
    assert np.array_equal(ids[pos[TWIN]], ids[pos[0]]), f"the twin picked {ids[pos[TWIN]]}, token 0 {ids[pos[0]]}"
    assert np.array_equal(ids[pos[ZERO]], np.arange(s.k)), \
        f"the zero token picked {ids[pos[ZERO]]}, not 0..K-1 (all ties)"
    for label, picks in (("the router's picks", ids), ("the expert stages' ids", case.pool.experts.ids[list(tokens)])):
        distinct = [set(picks[pos[tok]].tolist()) for tok in tokens if tok not in (TWIN, ZERO)]
        shared = any(a & b for i, a in enumerate(distinct) for b in distinct[i + 1:])
        assert shared, f"no two different tokens share an expert in {label}: {picks.tolist()}"


@pytest.mark.gpu
@pytest.mark.invariance
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("shape_id", list(SHAPES))
def test_a_tokens_outputs_do_not_depend_on_its_batch_its_place_or_the_layout(shape_id, stage):
    # Bitwise: every stage reduces within a token (over H, over its K slots) in an order fixed
    # by H, K and the block size; no stage reads another token's data or derives anything
    # from T but the grid. Each token alone (T = 1, first layout) is the reference.
    case = _case(shape_id)
    runs = {}

    def launch(tokens, layout):
        key = (tuple(tokens), layout)
        if key not in runs:
            runs[key] = _stage(case, stage, tokens, layout)
        return runs[key]

    _assert_the_pool_collides(case, stage, launch(ROWS + FILLERS[:moe.MAX_T - len(ROWS)], LAYOUTS[next(iter(LAYOUTS))]))
    for name in outputs_of(stage):
        assert_batch_invariant(f"moe decode {name}", lambda tokens, layout, name=name: launch(tokens, layout)[name],
                               ROWS, batch_sizes=BATCH_SIZES, positions=POSITIONS, variants=_layouts_with(name),
                               fillers=FILLERS)


@pytest.mark.gpu
@pytest.mark.determinism
def test_the_chain_gives_the_same_bits_on_every_repeat():
    # Bitwise: the only atomic of the chain is the router's ticket (a counter; the last CTA's
    # selection reads logits every block published before it took its ticket); every float
    # reduction has a fixed order. See the module docstring for what changes between repeats.
    import cupy

    case = _case(DETERMINISM_SHAPE)
    scratch = cupy.empty(L2_EVICT_BYTES, dtype=np.uint8)
    runs = {}

    def chain(repeat, layout):
        key = (repeat, layout)
        if key not in runs:
            if repeat % 2:
                scratch.fill(repeat & 0xFF)
            runs[key] = _layer(case, DETERMINISM_TOKENS, layout, zeroed=True)
        return runs[key]

    for name in OUTPUTS:
        assert_deterministic(f"moe decode {name}", lambda repeat, layout, name=name: chain(repeat, layout)[name],
                             repeats=REPEATS, variants=_layouts_with(name))
