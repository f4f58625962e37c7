"""Launchers for qk_rope.cu: QK RMSNorm + RoPE, flat / paged prefill / paged decode.

Each arm has one function that spells its kernel call once. Every host check runs
before anything touches the device, on shapes and Python ints only, so a refusal can
be proven with numpy arrays on a machine with no GPU. Metadata the device guards
check (page ids, CSR bounds, per-token origins) stays on the device and is not read
back here; positions are host metadata because they index the cos table, which has
no device guard.

Pinned refusal substrings (gates assert them): `head_dim`, `rotary_dim`, `cos table`,
`no whole page`, `page_origin`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import numpy as np

from harness.library.dtypes import bf16
from harness.library.launch import Refusal, check_dtype, check_int32_vector, check_shape, shape_of

SOURCE = "qk_rope.cu"
HEAD_DIMS = (256, 512)
WARPS_PER_BLOCK = 4  # kWarpsPerBlock in qk_rope.cu: one warp per (token, head) job
THREADS_PER_BLOCK = WARPS_PER_BLOCK * 32
NAME_EXPRESSIONS = tuple(
    name
    for hd in HEAD_DIMS
    for name in (f"qk_rope_flat<{hd}>", f"qk_rope_paged<{hd}, false>", f"qk_rope_paged<{hd}, true>")
)
_NULL = np.uint64(0)


@dataclass(frozen=True)
class Heads:
    """What the Q/K/V inputs say about the launch, after the checks."""

    head_dim: int
    num_tokens: int
    nq: int
    nkv: int
    rotary_dim: int
    cos_max_pos: int

    @property
    def has_v(self) -> bool:
        """HD 256 has a V input; HD 512 is the K = V fork."""
        return self.head_dim == 256

    def grid(self) -> tuple[int, int, int]:
        jobs = self.num_tokens * (self.nq + self.nkv)
        return ((jobs + WARPS_PER_BLOCK - 1) // WARPS_PER_BLOCK, 1, 1)


_shape = shape_of
_need_shape = partial(check_shape, "")
_need_dtype = partial(check_dtype, "")


def check_heads(q, k, v, q_w, k_w, cos, sin, *, rotary_dim: int) -> Heads:
    """The checks every arm shares: head size, rotary_dim, the input shapes and the tables."""
    if len(_shape(q)) != 3:
        raise Refusal(f"q has shape {_shape(q)}, expected [num_tokens, nq, head_dim]")
    num_tokens, nq, head_dim = _shape(q)
    if head_dim not in HEAD_DIMS:
        raise Refusal(
            f"head_dim {head_dim} is not supported: qk_rope.cu is built for head_dim 256 or 512"
        )
    if len(_shape(k)) != 3 or _shape(k)[0] != num_tokens or _shape(k)[2] != head_dim:
        raise Refusal(f"k has shape {_shape(k)}, expected [{num_tokens}, nkv, {head_dim}] to match q")
    nkv = _shape(k)[1]
    if num_tokens <= 0 or nq <= 0 or nkv <= 0:
        raise Refusal(f"q {_shape(q)} and k {_shape(k)} must have at least one token and one head")
    if not isinstance(rotary_dim, (int, np.integer)) or rotary_dim <= 0 or rotary_dim > head_dim or rotary_dim % 2:
        raise Refusal(
            f"rotary_dim {rotary_dim} is invalid for head_dim {head_dim}: it must be even and in (0, {head_dim}]"
        )
    if head_dim == 256:
        if v is None:
            raise Refusal("head_dim 256 needs a v input of shape [num_tokens, nkv, 256]")
        _need_shape("v", v, (num_tokens, nkv, head_dim))
    elif v is not None:
        raise Refusal("head_dim 512 has no v input (its V slot is the K = V fork): pass v=None")
    for name, a in (("q", q), ("k", k)) + ((("v", v),) if v is not None else ()):
        _need_dtype(name, a, bf16)
    for name, w in (("q_w", q_w), ("k_w", k_w)):
        _need_shape(name, w, (head_dim,))
        _need_dtype(name, w, bf16)
    half = int(rotary_dim) // 2
    for name, table in (("cos", cos), ("sin", sin)):
        if len(_shape(table)) != 2 or _shape(table)[1] != half:
            raise Refusal(
                f"{name} table has shape {_shape(table)}, expected [cos_max_pos, {half}] (rotary_dim / 2 columns)"
            )
        _need_dtype(f"{name} table", table, np.float32)
    if _shape(cos) != _shape(sin):
        raise Refusal(f"cos table {_shape(cos)} and sin table {_shape(sin)} must have the same shape")
    return Heads(head_dim, num_tokens, nq, nkv, int(rotary_dim), _shape(cos)[0])


def check_positions(heads: Heads, positions, count: int) -> np.ndarray:
    """Host positions, each inside the cos table."""
    if hasattr(positions, "get") and not isinstance(positions, np.ndarray):
        raise Refusal(
            "positions must be host integers (a list or numpy array), not a device array: "
            "the launcher checks them against the cos table before the launch"
        )
    pos = np.asarray(positions)
    if pos.shape != (count,) or not np.issubdtype(pos.dtype, np.integer):
        raise Refusal(f"positions has shape {pos.shape} and dtype {pos.dtype}, expected {count} integers")
    bad = np.flatnonzero((pos < 0) | (pos >= heads.cos_max_pos))
    if bad.size:
        i = int(bad[0])
        raise Refusal(
            f"position {int(pos[i])} (token {i}) is outside the cos table [0, {heads.cos_max_pos}): "
            "build longer cos/sin tables"
        )
    return pos.astype(np.int32)


def _check_out(name: str, a, rows: int, heads_n: int, heads: Heads) -> None:
    if len(_shape(a)) != 3 or _shape(a)[0] < rows or _shape(a)[1:] != (heads_n, heads.head_dim):
        raise Refusal(
            f"{name} has shape {_shape(a)}, expected [>= {rows}, {heads_n}, {heads.head_dim}]"
        )
    _need_dtype(name, a, bf16)


def check_pool(heads: Heads, pool, *, page_size: int, num_layers: int, layer: int) -> int:
    """The number of whole pages in the flat bf16 pool."""
    if page_size <= 0 or num_layers <= 0:
        raise Refusal(f"page_size {page_size} and num_layers {num_layers} must be positive")
    if not 0 <= layer < num_layers:
        raise Refusal(f"layer {layer} is outside [0, {num_layers})")
    page_stride = page_size * num_layers * 2 * heads.nkv * heads.head_dim
    if len(_shape(pool)) != 1:
        raise Refusal(f"pool has shape {_shape(pool)}, expected one flat bf16 array of whole pages")
    _need_dtype("pool", pool, bf16)
    size = _shape(pool)[0]
    if size < page_stride:
        raise Refusal(
            f"pool of {size} elements holds no whole page ({page_stride} elements each): "
            "allocate num_pages * page_stride elements"
        )
    if size % page_stride:
        raise Refusal(
            f"pool of {size} elements is not a multiple of the page stride {page_stride}: "
            "allocate num_pages * page_stride elements"
        )
    return size // page_stride


def _kernel(name: str):
    from harness.library.kernels import module

    return module(SOURCE, name_expressions=NAME_EXPRESSIONS).get(name)


def check_flat(q, k, v, q_w, k_w, cos, sin, positions, q_out, k_out, v_out, *, rotary_dim: int,
               row_offset: int = 0) -> tuple[Heads, np.ndarray]:
    """Every host check of the flat arm (run_flat's arguments): (the heads, the positions)."""
    heads = check_heads(q, k, v, q_w, k_w, cos, sin, rotary_dim=rotary_dim)
    pos = check_positions(heads, positions, heads.num_tokens)
    if row_offset < 0:
        raise Refusal(f"row_offset {row_offset} is negative")
    rows = row_offset + heads.num_tokens
    _check_out("q_out", q_out, rows, heads.nq, heads)
    _check_out("k_out", k_out, rows, heads.nkv, heads)
    _check_out("v_out", v_out, rows, heads.nkv, heads)
    return heads, pos


def run_flat(q, k, v, q_w, k_w, cos, sin, positions, q_out, k_out, v_out, *,
             rotary_dim: int, eps: float, row_offset: int = 0) -> None:
    """Flat arm: token t at positions[t]; its outputs land in row row_offset + t.
    v_out receives V (HD 256) or the K = V fork (HD 512)."""
    heads, pos = check_flat(q, k, v, q_w, k_w, cos, sin, positions, q_out, k_out, v_out, rotary_dim=rotary_dim,
                            row_offset=row_offset)

    import cupy

    d_pos = cupy.asarray(pos)
    _kernel(f"qk_rope_flat<{heads.head_dim}>")(
        heads.grid(), (THREADS_PER_BLOCK, 1, 1),
        (q, k, v if heads.has_v else _NULL, q_w, k_w, cos, sin, d_pos, q_out, k_out, v_out,
         np.int32(heads.num_tokens), np.int32(heads.nq), np.int32(heads.nkv),
         np.int32(heads.rotary_dim), np.int32(row_offset), np.float32(eps)),
    )


def check_paged_prefill(q, k, v, q_w, k_w, cos, sin, q_out, pool, *, page_size: int, num_layers: int,
                        layer: int, start_pos: int, page_indices, page_origin: int,
                        rotary_dim: int) -> tuple[Heads, int]:
    """Every host check of the paged prefill arm (run_paged_prefill's arguments): (the heads,
    the pool's whole pages)."""
    heads = check_heads(q, k, v, q_w, k_w, cos, sin, rotary_dim=rotary_dim)
    num_pages = check_pool(heads, pool, page_size=page_size, num_layers=num_layers, layer=layer)
    if start_pos < 0:
        raise Refusal(f"start_pos {start_pos} is negative")
    last = start_pos + heads.num_tokens - 1
    if last >= heads.cos_max_pos:
        raise Refusal(
            f"position {last} (start_pos {start_pos} + {heads.num_tokens} tokens - 1) is outside the "
            f"cos table [0, {heads.cos_max_pos}): build longer cos/sin tables"
        )
    if page_origin < 0 or page_origin * page_size > start_pos:
        raise Refusal(
            f"page_origin {page_origin} starts the window at position {page_origin * page_size}, "
            f"after start_pos {start_pos}: the window must begin at or before the first token's page"
        )
    check_int32_vector("", "page_indices", page_indices)
    _check_out("q_out", q_out, heads.num_tokens, heads.nq, heads)
    return heads, num_pages


def run_paged_prefill(q, k, v, q_w, k_w, cos, sin, q_out, pool, *, page_size: int, num_layers: int,
                      layer: int, start_pos: int, page_indices, page_origin: int,
                      rotary_dim: int, eps: float) -> None:
    """Paged prefill: one request of T tokens at start_pos + t; its window is
    page_indices (device int32), whose first entry is logical page page_origin."""
    heads, num_pages = check_paged_prefill(q, k, v, q_w, k_w, cos, sin, q_out, pool, page_size=page_size,
                                           num_layers=num_layers, layer=layer, start_pos=start_pos,
                                           page_indices=page_indices, page_origin=page_origin,
                                           rotary_dim=rotary_dim)
    _launch_paged(heads, False, q, k, v, q_w, k_w, cos, sin, q_out, pool, page_size, num_layers, layer,
                  num_pages, page_indices, start_pos, page_origin, _NULL, _NULL, _NULL, eps)


def check_paged_decode(q, k, v, q_w, k_w, cos, sin, q_out, pool, *, page_size: int, num_layers: int,
                       layer: int, positions, page_indptr, page_indices, page_origins,
                       rotary_dim: int) -> tuple[Heads, int, np.ndarray]:
    """Every host check of the paged decode arm (run_paged_decode's arguments): (the heads, the
    pool's whole pages, the positions)."""
    heads = check_heads(q, k, v, q_w, k_w, cos, sin, rotary_dim=rotary_dim)
    num_pages = check_pool(heads, pool, page_size=page_size, num_layers=num_layers, layer=layer)
    pos = check_positions(heads, positions, heads.num_tokens)
    check_int32_vector("", "page_indptr", page_indptr, heads.num_tokens + 1)
    check_int32_vector("", "page_indices", page_indices)
    check_int32_vector("", "page_origins", page_origins, heads.num_tokens)
    _check_out("q_out", q_out, heads.num_tokens, heads.nq, heads)
    return heads, num_pages, pos


def run_paged_decode(q, k, v, q_w, k_w, cos, sin, q_out, pool, *, page_size: int, num_layers: int,
                     layer: int, positions, page_indptr, page_indices, page_origins,
                     rotary_dim: int, eps: float) -> None:
    """Paged decode: token b at positions[b] (host ints), window
    page_indices[page_indptr[b]:page_indptr[b + 1]] with origin page_origins[b] (device int32)."""
    heads, num_pages, pos = check_paged_decode(q, k, v, q_w, k_w, cos, sin, q_out, pool, page_size=page_size,
                                               num_layers=num_layers, layer=layer, positions=positions,
                                               page_indptr=page_indptr, page_indices=page_indices,
                                               page_origins=page_origins, rotary_dim=rotary_dim)

    import cupy

    _launch_paged(heads, True, q, k, v, q_w, k_w, cos, sin, q_out, pool, page_size, num_layers, layer,
                  num_pages, page_indices, 0, 0, cupy.asarray(pos), page_indptr, page_origins, eps)


def _launch_paged(heads: Heads, per_token_meta: bool, q, k, v, q_w, k_w, cos, sin, q_out, pool,
                  page_size: int, num_layers: int, layer: int, num_pages: int, page_indices,
                  start_pos: int, page_origin: int, positions, page_indptr, page_origins,
                  eps: float) -> None:
    """The one call of the paged template; prefill passes null per-token metadata,
    decode passes zero for start_pos and page_origin."""
    meta = "true" if per_token_meta else "false"
    _kernel(f"qk_rope_paged<{heads.head_dim}, {meta}>")(
        heads.grid(), (THREADS_PER_BLOCK, 1, 1),
        (q, k, v if heads.has_v else _NULL, q_w, k_w, cos, sin, q_out, pool,
         np.int32(heads.num_tokens), np.int32(heads.nq), np.int32(heads.nkv),
         np.int32(heads.rotary_dim), np.float32(eps), np.int32(layer), np.int32(num_layers),
         np.int32(page_size), np.int32(num_pages), page_indices, np.int32(_shape(page_indices)[0]),
         np.int32(start_pos), np.int32(page_origin), positions, page_indptr, page_origins),
    )
