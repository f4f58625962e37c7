"""Shared pieces of the paged-attention gates: the configurations, one helper per kernel arm
(`run_paged_decode`, `run_paged_prefill`), device copies of host cases, and the fixtures
both gate modules import.

Device buffers the kernel must overwrite start as sentinels: the output as bf16 0xFFBF (a
NaN no kernel computes), the split-K scratch as f32 NaN, so a value that was never written
shows up in a bitwise comparison instead of passing as stale data.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import numpy as np
import pytest

from harness import assert_bits_eq, host_cache, rel_rms
from harness.library import buffers
from harness.library.dtypes import bf16
from kernels_cu import paged_attention as pa
from oracles import paged_attention as ora

OUT_SENTINEL = 0xFFBF
SCRATCH_SENTINEL = 0x7FC00000
NEEDLE_HEADS = dict(nh=8, nkv=2)     # GQA group of 4
NEEDLE_SEED = 5
STAIR_WINDOW = 37                    # odd: each prefill tile's window edges fall mid-page
STAIR_SEED = 7
POOL_SEED = 9

# The contract's two configurations (decode rows; prefill runs every position of the context).
CONFIGS = {
    "A": dict(nh=16, nkv=8, hd=256, window=1024, ctx=1500, rows=5),
    "B": dict(nh=16, nkv=2, hd=512, window=0, ctx=700, rows=1),
}
CHUNK_ROWS = 100                     # chunked prefill for the page-map link: pages before the
                                     # chunk's windows go to the NaN page
EDGE_HD = {"decode": 256, "prefill": 512}   # the window-edge gates run one head size per kernel:
                                            # first_visible and the softmax state are shared by both


def config_id(name: str) -> str:
    c = CONFIGS[name]
    return f"{name}-nh{c['nh']}-nkv{c['nkv']}-hd{c['hd']}-w{c['window']}-ctx{c['ctx']}"


@host_cache
def random_case(name: str, rows: str) -> ora.Case:
    """Config `name` with the decode rows, every row ('prefill') or the last CHUNK_ROWS ('chunk')."""
    c = dict(CONFIGS[name])
    c["rows"] = {"decode": c["rows"], "prefill": c["ctx"], "chunk": CHUNK_ROWS}[rows]
    return ora.random_case(**c, seed={"A": 101, "B": 202}[name])


@host_cache
def edge_case(kernel: str, window: int) -> ora.Case:
    """The window-edge case (oracles.paged_attention.window_edge_case) at EDGE_HD[kernel]."""
    return ora.window_edge_case(hd=EDGE_HD[kernel], window=window, **NEEDLE_HEADS)


@host_cache
def needle_case(hd: int, window: int, kind: str) -> ora.Case:
    """The decode needle case (oracles.paged_attention.needle_case) at NEEDLE_HEADS, NEEDLE_SEED:
    built once per process (the needle anchors and the split-count links share them)."""
    return ora.needle_case(hd=hd, window=window, kind=kind, seed=NEEDLE_SEED, **NEEDLE_HEADS)


@host_cache
def staircase_case(hd: int, window: int, rising: bool, paired: bool = False, start: int = 0) -> ora.Case:
    """The prefill staircase (oracles.paged_attention.staircase_case), nh 4, nkv 2, STAIR_SEED:
    built once per process."""
    return ora.staircase_case(hd=hd, nh=4, nkv=2, window=window, rising=rising, seed=STAIR_SEED, paired=paired,
                              start=start)


@host_cache(disk=True)
def reference_of(name: str, rows: str, scale: float = 1.0) -> np.ndarray:
    """The float64 reference of a random case at softmax scale `scale`: computed once per
    process, and kept on disk between runs (config A's prefill rows take seconds)."""
    return ora.reference(random_case(name, rows), scale)


REFERENCE_BOUND = 1e-2  # rel_rms of a random-input anchor: the contract's bound for bf16 outputs


def assert_near_reference(label: str, got: np.ndarray, ref: np.ndarray, scale: float = 1.0) -> None:
    """A random-input anchor's check: rel_rms of the kernel's output against the float64
    reference under REFERENCE_BOUND (bf16 output rounding, up to 2^-9 relative per element,
    after f32 softmax and accumulation; exactness is the designed anchors' job)."""
    at = "" if scale == 1.0 else f" at scale {scale:.4g}"
    err = rel_rms(got.astype(np.float64), ref)
    assert err < REFERENCE_BOUND, f"{label}{at}: rel_rms vs float64 reference = {err:.3e} (bound {REFERENCE_BOUND:g})"


def engine_scale(hd: int) -> float:
    """The softmax scale an engine passes: 1 / sqrt(head size) (1/16 at 256). Every other gate
    runs at scale 1, where scores * scale and scores / scale agree."""
    return 1.0 / float(np.sqrt(hd))


# ------------------------------------------------------------------ device data


@dataclass(frozen=True)
class DeviceCase:
    host: ora.Case
    q: object
    k_pool: object
    v_pool: object
    bt: object
    off: object
    qpos: object


_dev = partial(buffers.to_device, bits=True)  # bf16 as its uint16 bits


def to_device(case: ora.Case) -> DeviceCase:
    return DeviceCase(case, _dev(case.q), _dev(case.k_pool), _dev(case.v_pool), _dev(case.bt),
                      _dev(case.off), _dev(case.qpos))


@dataclass(frozen=True)
class DevicePool:
    """A permuted pool with its NaN null page and the page map that reaches it."""

    k_pool: object
    v_pool: object
    pmap: object


def permuted_device_pool(case: ora.Case) -> DevicePool:
    k, v, pmap = ora.permuted_pool(case, seed=POOL_SEED)
    return DevicePool(_dev(k), _dev(v), _dev(pmap))


def _out(case: ora.Case):
    import cupy

    return cupy.full(case.q.shape, OUT_SENTINEL, dtype=cupy.uint16)


_host_bf16 = partial(buffers.to_host, dtype=bf16)


def kv_len(case: ora.Case) -> int:
    """The longest visible range of the case's rows: what the launcher's choose_splits takes."""
    return int(np.max(case.qpos - ora.first_visible(case.qpos, case.window) + 1))


def chosen_splits(case: ora.Case) -> int:
    return pa.choose_splits(kv_len(case), case.rows, case.nh)


def new_counters(case: ora.Case):
    import cupy

    return cupy.zeros(case.rows * case.nh, dtype=cupy.int32)


def new_scratch(case: ora.Case, splits: int):
    """A split-K scratch for `case` at `splits`, every float the NaN SCRATCH_SENTINEL."""
    import cupy

    return cupy.full(pa.decode_scratch_floats(case.rows, case.nh, splits, case.hd), SCRATCH_SENTINEL,
                     dtype=cupy.uint32).view(cupy.float32)


def run_paged_decode(dc: DeviceCase, *, splits: int | None = None, merge: str = "last_cta",
                     counters=None, pool: DevicePool | None = None, partials: bool = False, scale: float = 1.0,
                     out=None, scratch=None, mode: str = "eager", replay=None):
    """One split-K decode launch; `merge` is 'last_cta' (ticket counters) or 'combine'.
    partials=True returns (out, scratch as f32 [rows, nh, splits, hd + 2]). `out`: the output
    buffer (uint16 bf16 bits, holding OUT_SENTINEL) if not a fresh one; `scratch`: the split-K
    scratch (f32, at least decode_scratch_floats) if not a fresh NaN one (`new_scratch`). With a
    `replay` (harness.library.graphs.GraphReplay), `mode` "graph" replays the launch from a CUDA
    graph captured once a merge, split count, set of pools and batch shape: the batch's queries,
    block table, offsets and positions and the output, scratch and counters are the captured
    buffers, the pools stay put (as an engine's KV cache)."""
    case = dc.host
    splits = chosen_splits(case) if splits is None else splits
    if merge == "last_cta" and counters is None:
        counters = new_counters(case)
    elif merge == "combine":
        counters = None
    scratch = new_scratch(case, splits) if scratch is None else scratch
    out = _out(case) if out is None else out
    k_pool, v_pool = (pool.k_pool, pool.v_pool) if pool else (dc.k_pool, dc.v_pool)
    pmap = pool.pmap if pool else None

    def launch(q, bt, off, qpos, out, scratch, counters=None):
        pa.paged_decode(out, q, k_pool, v_pool, bt, off, qpos, scratch=scratch, splits=splits, counters=counters,
                        pmap=pmap, window=case.window, scale=scale)

    bufs = dict(q=dc.q, bt=dc.bt, off=dc.off, qpos=dc.qpos, out=out, scratch=scratch)
    if counters is not None:
        bufs["counters"] = counters
    if replay is None:
        launch(**bufs)
    else:
        # The pools are captured as they are (not copied in): other pools are another graph.
        replay(mode, (merge, splits, id(k_pool), id(v_pool), id(pmap)), launch, **bufs)
    if partials:
        parts = buffers.to_host(scratch).reshape(case.rows, case.nh, splits, case.hd + 2)
        return _host_bf16(out), parts
    return _host_bf16(out)


def run_paged_decode_guarded(dc: DeviceCase, *, merge: str) -> tuple[np.ndarray, object]:
    """run_paged_decode into an output between OUT_SENTINEL guards (`harness.library.buffers.guarded`):
    (the output, bf16 on the host; the whole allocation, for `assert_guards_untouched`)."""
    out, whole = buffers.guarded(dc.host.q.shape, np.uint16, OUT_SENTINEL)
    return run_paged_decode(dc, merge=merge, out=out), whole


def run_paged_prefill(dc: DeviceCase, *, pool: DevicePool | None = None, scale: float = 1.0,
                      tiles: pa.Tiles | None = None) -> np.ndarray:
    """One prefill launch over `tiles` (default: make_tiles at the kernel's rows per tile)."""
    case = dc.host
    out = _out(case)
    tiles = pa.make_tiles(case.off, pa.prefill_rows_per_tile(case.hd)) if tiles is None else tiles
    pa.paged_prefill(out, dc.q, pool.k_pool if pool else dc.k_pool, pool.v_pool if pool else dc.v_pool,
                     dc.bt, dc.off, dc.qpos, tiles, pmap=pool.pmap if pool else None, window=case.window,
                     scale=scale)
    return _host_bf16(out)


# ------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module", params=sorted(CONFIGS), ids=config_id)
def decode_config(request):
    """(config name, device copy of its decode rows)."""
    return request.param, to_device(random_case(request.param, "decode"))


# ------------------------------------------------------------------ host arrays for refusals


def host_arrays(hd: int = 256, rows: int = 2, nh: int = 4, nkv: int = 2, pages: int = 4) -> dict:
    """numpy stand-ins with a valid layout: refusal gates change one thing and need no device."""
    return dict(
        out=np.zeros((rows, nh, hd), np.uint16),
        q=np.zeros((rows, nh, hd), np.uint16),
        k_pool=np.zeros((pages, nkv, pa.PAGE, hd), np.uint16),
        v_pool=np.zeros((pages, nkv, pa.PAGE, hd), np.uint16),
        bt=np.arange(pages, dtype=np.int32),
        off=np.zeros(rows, np.int32),
        qpos=np.arange(rows, dtype=np.int32),
    )


# ------------------------------------------------------------------ ladders: the sweep's shapes


LADDER_SEED = 23
WINDOW_NONE = 1   # a sweep shape's W = 1 stands for window 0 (no sliding window): a dimension starts at 1,
                  # and a window of one key is no model's


def window_of(w: int) -> int:
    return 0 if w == WINDOW_NONE else int(w)


def decode_qpos(ctx: int, rows: int) -> list[int]:
    """The query positions of a decode batch of `rows` sequences, the longest at ctx - 1 and the
    others shorter, evenly down to about ctx / rows (every row a sequence of its own)."""
    return [((ctx - 1) * (rows - r)) // rows for r in range(rows)]


def _span_pages(qpos, window: int) -> int:
    lo = int(ora.first_visible(np.asarray(qpos), window).min())
    return max(qpos) // pa.PAGE - lo // pa.PAGE + 1


def decode_spans(shape) -> tuple[int, int]:
    """(the longest span a row climbs, in keys; the span pages of all rows): what bounds a decode
    sweep shape's work and pools."""
    window = window_of(shape["W"])
    qpos = decode_qpos(shape["CTX"], shape["ROWS"])
    longest = max(q - int(ora.first_visible(q, window)) + 1 for q in qpos)
    return longest, sum(_span_pages([q], window) for q in qpos)


def prefill_rows(ctx: int, m: int) -> tuple[int, ...]:
    """The query positions of a prefill chunk: the last m positions of a ctx-key context."""
    return tuple(range(ctx - m, ctx))


def prefill_spans(shape) -> tuple[int, int]:
    """(the chunk's span in keys, its span pages)."""
    window = window_of(shape["W"])
    rows = prefill_rows(shape["CTX"], shape["M"])
    return rows[-1] - int(ora.first_visible(rows[0], window)) + 1, _span_pages(rows, window)


def decode_plan(shape) -> ora.LadderPlan:
    """A decode sweep shape (HD, NKV, G, W, CTX, ROWS, SPLITS) as a ladder: ROWS sequences of one
    query row each (decode_qpos), nh = NKV * G."""
    qpos = decode_qpos(shape["CTX"], shape["ROWS"])
    return ora.ladder_plan(shape["HD"], shape["NKV"] * shape["G"], shape["NKV"], window_of(shape["W"]),
                           [(q,) for q in qpos], seed=LADDER_SEED)


def prefill_plan(shape) -> ora.LadderPlan:
    """A prefill sweep shape (HD, NKV, G, W, CTX, M) as a ladder: one sequence's last M positions
    (a chunked prefill's rows), its block-table row after another sequence's two entries."""
    return ora.ladder_plan(shape["HD"], shape["NKV"] * shape["G"], shape["NKV"], window_of(shape["W"]),
                           [prefill_rows(shape["CTX"], shape["M"])], seed=LADDER_SEED, prefix=2)



def decode_ladder_holds(plan: ora.LadderPlan, splits: int) -> None:
    """Each row copies its winner's V row in every head, bitwise: the last-CTA merge on the
    ladders as planned, the combine kernel on the ladders flipped (each kv head climbing the
    other way). The ladders alternate direction by kv head, so each merge sees both directions
    (on alternate kv heads) and every kv head climbs both ways over the two launches."""
    for flip, merge in ((0, "last_cta"), (1, "combine")):
        case = ora.ladder_case(plan, flip)
        assert_bits_eq(f"paged decode out [row, head, dim] ({merge} merge, splits {splits}, ladders flipped {flip})",
                       run_paged_decode(to_device(case), splits=splits, merge=merge), ora.copy_rows(case), dtype=bf16)


def prefill_ladder_holds(plan: ora.LadderPlan) -> None:
    """Each row of the chunk copies its winner's V row in every head, bitwise, the kv heads'
    ladders one way and then flipped."""
    for flip in (0, 1):
        case = ora.ladder_case(plan, flip)
        assert_bits_eq(f"paged prefill out [row, head, dim] (ladders flipped {flip})",
                       run_paged_prefill(to_device(case)), ora.copy_rows(case), dtype=bf16)
