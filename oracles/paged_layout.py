"""The paged KV pool layout, as one host object: the host mirror of the address formula
in qk_rope.cu's `pool_index`, the page windows, and the builder of expected pool images.

    kv_block     = page_size * nkv * HD
    layer_stride = 2 * kv_block            # K block, then V block
    page_stride  = num_layers * layer_stride
    index(page, layer, kind, pos, kv_head, d) =
        page * page_stride + layer * layer_stride + kind * kv_block
        + (pos % page_size) * nkv * HD + kv_head * HD + d        # kind: K = 0, V = 1

Gates address the pool only through this object.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from harness.library.dtypes import bf16, bits_of, from_bits

K = 0
V = 1


@dataclass(frozen=True)
class PagedKvLayout:
    page_size: int
    num_layers: int
    nkv: int
    head_dim: int
    num_pages: int

    def __post_init__(self) -> None:
        for name in ("page_size", "num_layers", "nkv", "head_dim", "num_pages"):
            if getattr(self, name) <= 0:
                raise ValueError(f"PagedKvLayout.{name} is {getattr(self, name)}: it must be positive")

    @property
    def kv_block(self) -> int:
        return self.page_size * self.nkv * self.head_dim

    @property
    def layer_stride(self) -> int:
        return 2 * self.kv_block

    @property
    def page_stride(self) -> int:
        return self.num_layers * self.layer_stride

    @property
    def pool_elements(self) -> int:
        return self.num_pages * self.page_stride

    def index(self, page, layer, kind, pos, kv_head, d):
        """Flat pool index; numpy-broadcasts over its arguments (int64)."""
        page, layer, kind, pos, kv_head, d = (np.asarray(a, dtype=np.int64)
                                              for a in (page, layer, kind, pos, kv_head, d))
        return (page * self.page_stride + layer * self.layer_stride + kind * self.kv_block
                + (pos % self.page_size) * self.nkv * self.head_dim + kv_head * self.head_dim + d)

    def page_of(self, pos: int, window, origin: int) -> int:
        """The pool page holding `pos` in a window whose first entry is logical page `origin`."""
        row = pos // self.page_size - origin
        if row < 0 or row >= len(window):
            raise ValueError(
                f"position {pos} is logical page {pos // self.page_size}, outside the window of "
                f"{len(window)} pages starting at logical page {origin}"
            )
        page = int(window[row])
        if not 0 <= page < self.num_pages:
            raise ValueError(f"window row {row} names page {page}, outside [0, {self.num_pages})")
        return page

    def image(self, layer: int, pages, positions, k_rows, v_rows) -> np.ndarray:
        """The expected pool: zeros, with k_rows[t] and v_rows[t] (each [T, nkv, HD], any
        2-byte dtype, placed as bits) at the K and V addresses of token t, which sits at
        positions[t] in pool page pages[t]. Two tokens naming one slot is an error."""
        k_bits, v_bits = bits_of(k_rows), bits_of(v_rows)
        num_tokens = len(positions)
        shape = (num_tokens, self.nkv, self.head_dim)
        if k_bits.shape != shape or v_bits.shape != shape or len(pages) != num_tokens:
            raise ValueError(
                f"image needs k_rows and v_rows of shape {shape} and one page per position; got "
                f"{k_bits.shape}, {v_bits.shape} and {len(pages)} pages for {num_tokens} positions"
            )
        out = np.zeros(self.pool_elements, dtype=np.uint16)
        written = np.zeros(self.pool_elements, dtype=bool)
        heads = np.arange(self.nkv)[:, None]
        dims = np.arange(self.head_dim)[None, :]
        for t in range(num_tokens):
            for kind, rows in ((K, k_bits), (V, v_bits)):
                idx = self.index(pages[t], layer, kind, positions[t], heads, dims)
                if written[idx].any():
                    raise ValueError(f"token {t} at position {positions[t]} names a pool slot already written")
                written[idx] = True
                out[idx] = rows[t]
        return from_bits(out, bf16)
