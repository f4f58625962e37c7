"""Batch invariance and determinism of QK RMSNorm + RoPE (the flat, paged-prefill and paged-decode arms).

A token's Q, K and V rows must not depend on the batch it is launched in: how many tokens
share the launch (the grid, which block of 4 warps its jobs fall in, whether they straddle
two), where it sits among them, the flat arm's row offset, the paged arms' page size and the
pages the allocator gave them, or where a paged prefill's request starts. And a repeated launch
must give the same bits. Each at the head sizes' production rotary dims with 4 query and 2 KV
heads, and at two models' head counts and rotary dims.

The anchors' designed inputs make every output independent of the f32 evaluation order, so a
kernel that reassociates its sum of squares for some batches passes them. These gates run on
the order-sensitive design instead (oracles.qk_rope.order_sensitive_case): one outlier a head in
one lane's registers, so that lane's running sum rounds at the scale of the whole sum, and
rotary pairs that nearly cancel, so the last bit of inv_rms shows in the bf16 outputs.

What holds: docs/qk_rope.md, "Batch invariance and determinism".
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from gates._qk_rope import NKV, NQ
from harness import host_cache
from harness.library import buffers
from harness.library.dtypes import bf16
from harness.library.invariance import assert_batch_invariant, assert_deterministic
from harness.library.source import constexpr_int, function, read_source
from kernels_cu import qk_rope as launcher
from oracles import qk_rope as design
from oracles.paged_layout import K, V, PagedKvLayout

# (head_dim, rotary_dim, nq, nkv): the production rotary dims of the two head sizes at 4 query
# and 2 KV heads; Qwen3-Next's full-attention layer (config.json: num_attention_heads 16,
# num_key_value_heads 2, head_dim 256, partial_rotary_factor 0.25) and Gemma 4 E2B's global layer
# (num_attention_heads 8, one KV head, global_head_dim 512, partial_rotary_factor 0.25).
CONFIGS = {"hd256": (256, 256, NQ, NKV), "hd512": (512, 128, NQ, NKV),
           "hd256-rotary64-nq16-nkv2": (256, 64, 16, 2), "hd512-rotary128-nq8-nkv1": (512, 128, 8, 1)}
TOKENS, COS_MAX_POS, SEED = 16, 64, 7
# Rows 0-3 are checked, the other 12 tokens fill the larger batches. At 4 Q and 2 KV heads a
# token is 6 jobs, a block 4 warps: a token alone is 2 blocks (2 idle warps); its jobs start a
# block or half-way into one by its place; batches of 1, 2 (3 blocks), 3, 5, 8, 11 and 16 tokens
# (24 blocks) cross every block count from 2 to 24 on the way (18 jobs a token at 16 and 2 heads,
# 9 at 8 and 1: a token's jobs start at each lane of a block by its place).
ROWS, FILLERS = (0, 1, 2, 3), tuple(range(4, TOKENS))
BATCH_SIZES = (1, 2, 3, 5, 8, 11, 16)
POSITIONS = (0, 1, "middle", -1)
# The flat arm at row offset 0 and 5; the paged decode arm with pages of 4 and 16 positions, each
# batch slot b in pool page n - b of n + 1 (the allocator's choice, which must not matter); the
# paged prefill arm with the batch as one request from position 13 in pages of 8 (window origin
# 1, window row w in pool page n - w), each token's own cos/sin row at its request position.
VARIANTS = {"flat": ("flat", 0), "flat, row offset 5": ("flat", 5), "paged decode, pages of 4": ("decode", 4),
            "paged decode, pages of 16": ("decode", 16), "paged prefill from position 13, pages of 8": ("prefill", 8)}
PREFILL_START = 13
DETERMINISM_TOKENS, DETERMINISM_REPEATS = 64, 20  # 384 jobs, 96 blocks a launch
DETERMINISM_VARIANTS = {"flat": ("flat", 0), "paged decode, pages of 16": ("decode", 16)}
# What an output holds before the launch, repeat r taking fill r % 4: the sentinel NaN, +0, a
# negative NaN, 1.0 (an element left unwritten differs between repeats).
FILLS = (buffers.BF16_SENTINEL, 0x0000, 0xFFFF, 0x3F80)
NUM_LAYERS, LAYER = 2, 1


@host_cache
def case(head_dim: int, rotary_dim: int, nq: int = NQ, nkv: int = NKV, tokens: int = TOKENS) -> design.OrderSensitiveCase:
    return design.order_sensitive_case(tokens, nq, nkv, head_dim, rotary_dim, COS_MAX_POS, SEED)


class DeviceCase:
    """The case's inputs on the device, and one launch of any subset of its tokens."""

    def __init__(self, c: design.OrderSensitiveCase):
        self.c = c
        self.head_dim = c.q.shape[-1]
        self.nq, self.nkv = c.q.shape[1], c.k.shape[1]
        self.q, self.k = buffers.to_device(c.q), buffers.to_device(c.k)
        self.v = None if c.v is None else buffers.to_device(c.v)
        self.q_w, self.k_w = buffers.to_device(c.q_w), buffers.to_device(c.k_w)
        self.cos, self.sin = buffers.to_device(c.cos), buffers.to_device(c.sin)

    def run(self, ids, variant, fill: int = FILLS[0]) -> np.ndarray:
        """[len(ids), (nq + 2 nkv) * HD] bf16: each token's Q rows, then its K and V rows."""
        import cupy

        arm, param = variant
        sel = cupy.asarray(np.asarray(ids, dtype=np.int64))
        q, k = self.q[sel], self.k[sel]
        v = None if self.v is None else self.v[sel]
        positions = self.c.positions[list(ids)]
        n, hd, nq, nkv = len(ids), self.head_dim, self.nq, self.nkv
        if arm == "flat":
            rows = param + n
            outs = [buffers.filled((rows, heads, hd), bf16, fill) for heads in (nq, nkv, nkv)]
            launcher.run_flat(q, k, v, self.q_w, self.k_w, self.cos, self.sin, positions, *outs,
                              rotary_dim=self.c.rotary_dim, eps=design.EPS, row_offset=param)
            parts = [buffers.to_host(o)[param:].reshape(n, -1) for o in outs]
        elif arm == "prefill":
            parts = self._prefill(q, k, v, positions, param, fill)
        else:
            page_size, pages = param, n + 1
            layout = PagedKvLayout(page_size=page_size, num_layers=NUM_LAYERS, nkv=nkv, head_dim=hd, num_pages=pages)
            slot_page = pages - 1 - np.arange(n)  # slot b in page n - b; page 0 unused
            q_out = buffers.filled((n, nq, hd), bf16, fill)
            pool = buffers.filled((layout.pool_elements,), bf16, fill)
            launcher.run_paged_decode(
                q, k, v, self.q_w, self.k_w, self.cos, self.sin, q_out, pool, page_size=page_size,
                num_layers=NUM_LAYERS, layer=LAYER, positions=positions,
                page_indptr=buffers.to_device(np.arange(n + 1, dtype=np.int32)),
                page_indices=buffers.to_device(slot_page.astype(np.int32)),
                page_origins=buffers.to_device((positions // page_size).astype(np.int32)),
                rotary_dim=self.c.rotary_dim, eps=design.EPS)
            image = buffers.to_host(pool)
            d = np.arange(hd)
            kv = [image[layout.index(slot_page[:, None, None], LAYER, kind, positions[:, None, None],
                                     np.arange(nkv)[None, :, None], d)].reshape(n, -1) for kind in (K, V)]
            parts = [buffers.to_host(q_out).reshape(n, -1), *kv]
        return np.concatenate(parts, axis=1)

    def _prefill(self, q, k, v, positions, page_size: int, fill: int) -> list[np.ndarray]:
        """The batch as one paged-prefill request at PREFILL_START + t: token t's cos/sin row is
        its own position's (the table's rows before the request are zero, never read), so its
        arithmetic is the flat arm's; its K and V rows read back at its request position."""
        n, hd, nq, nkv = len(positions), self.head_dim, self.nq, self.nkv
        start = PREFILL_START
        origin = start // page_size
        rows = (start + n - 1) // page_size - origin + 1
        window = (rows - np.arange(rows)).astype(np.int32)  # window row w in pool page rows - w; page 0 unused
        half = self.c.rotary_dim // 2
        tables = []
        for t in (self.c.cos, self.c.sin):
            table = np.zeros((start + n, half), np.float32)
            table[start:] = t[positions]
            tables.append(buffers.to_device(table))
        layout = PagedKvLayout(page_size=page_size, num_layers=NUM_LAYERS, nkv=nkv, head_dim=hd, num_pages=rows + 1)
        q_out = buffers.filled((n, nq, hd), bf16, fill)
        pool = buffers.filled((layout.pool_elements,), bf16, fill)
        launcher.run_paged_prefill(q, k, v, self.q_w, self.k_w, *tables, q_out, pool, page_size=page_size,
                                   num_layers=NUM_LAYERS, layer=LAYER, start_pos=start,
                                   page_indices=buffers.to_device(window), page_origin=origin,
                                   rotary_dim=self.c.rotary_dim, eps=design.EPS)
        image = buffers.to_host(pool)
        at = start + np.arange(n)
        pages = window[at // page_size - origin]
        kv = [image[layout.index(pages[:, None, None], LAYER, kind, at[:, None, None], np.arange(nkv)[None, :, None],
                                 np.arange(hd))].reshape(n, -1) for kind in (K, V)]
        return [buffers.to_host(q_out).reshape(n, -1), *kv]


@pytest.fixture(scope="module", params=list(CONFIGS))
def dev(request):
    return DeviceCase(case(*CONFIGS[request.param]))


@pytest.mark.gpu
@pytest.mark.invariance
def test_a_token_has_its_bits_in_every_batch_place_row_offset_and_page_size(dev):
    # Each job is one warp that reads only its own token's rows, positions and page: a token's
    # 4 Q rows, K and V rows alone (a launch of 2 blocks) must equal its rows in batches of up to
    # 16 tokens (24 blocks), first, second, middle or last, through the flat arm at two row
    # offsets and the paged decode arm at two page sizes (the first variant alone is the reference
    # for all of them: the arms' agreement is a link too).
    assert_batch_invariant(f"qk_rope (hd {dev.head_dim}, rotary {dev.c.rotary_dim}) token rows", dev.run, ROWS,
                           batch_sizes=BATCH_SIZES, positions=POSITIONS, variants=VARIANTS, fillers=FILLERS)


@pytest.mark.gpu
@pytest.mark.determinism
@pytest.mark.parametrize("config", ["hd256", "hd512"])
def test_qk_rope_gives_the_same_bits_on_every_repeat(config):
    # 64 tokens (96 blocks), 20 repeats an arm, on the current stream and on fresh ones, every
    # output (and the pool) prefilled with other bits each repeat.
    d = DeviceCase(case(*CONFIGS[config], tokens=DETERMINISM_TOKENS))
    ids = list(range(DETERMINISM_TOKENS))

    def run(repeat, variant):
        return d.run(ids, variant, fill=FILLS[repeat % len(FILLS)])

    assert_deterministic(f"qk_rope (hd {d.head_dim}, rotary {d.c.rotary_dim}) token rows", run,
                         repeats=DETERMINISM_REPEATS, variants=DETERMINISM_VARIANTS)


@pytest.mark.structural
def test_order_sensitive_rows_follow_the_kernels_lane_layout(kernel_root):
    # The design's outlier sits in one lane's registers only because oracles.qk_rope.lane_dims
    # is the kernel's dim_of; a kernel whose lanes held other dimensions would spread it, and
    # the invariance gate would go on passing with far less power. Evaluate dim_of's return
    # expression from the source for every (lane, register) and compare.
    path = kernel_root / launcher.SOURCE
    text = read_source(path)
    body = function(text, "dim_of").body
    ret = re.fullmatch(r"\{\s*return ([^;]*);\s*\}", body.strip())
    assert ret, f"{launcher.SOURCE}: dim_of is no longer one return statement: the lane layout moved ({body.strip()})"
    expr = " ".join(ret.group(1).split())
    assert re.fullmatch(r"[\w\s()*/%+-]+", expr), f"{launcher.SOURCE}: dim_of returns `{expr}`, not integer arithmetic"
    consts = {name: constexpr_int(path, name) for name in ("kWarp", "kVec")}
    assert (design.WARP, design.VEC) == (consts["kWarp"], consts["kVec"]), \
        f"{launcher.SOURCE}: kWarp, kVec = {consts['kWarp']}, {consts['kVec']}; oracles.qk_rope has {design.WARP}, {design.VEC}"
    py = expr.replace("/", "//")
    for hd in (256, 512):
        want = design.lane_dims(hd)
        got = np.array([[eval(py, {"__builtins__": {}}, {**consts, "lane": lane, "i": i})  # an integer expression
                         for i in range(hd // design.WARP)] for lane in range(design.WARP)])
        moved = np.argwhere(got != want)
        assert not moved.size, (f"{launcher.SOURCE}: dim_of ({expr}) puts lane {moved[0][0]}'s register "
                                f"{moved[0][1]} on dimension {got[tuple(moved[0])]}, oracles.qk_rope.lane_dims on "
                                f"{want[tuple(moved[0])]} (hd {hd}): change the design's lane_dims with the kernel")
