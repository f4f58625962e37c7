"""NVFP4 MoE decode: an expert at the far end of tables past 2^32 bytes.

moe_glu and moe_down address expert `store`'s weights as store * rows * bytes-a-row: at
Llama-4 Maverick's sizes (E 128, H 5120, I 8192) the gate/up codes of expert 127 start
5,326,766,080 bytes in, past what 32 bits hold, and its down codes 2,663,383,040 bytes in, past
what a signed int holds. The gate routes one token to expert 127 and checks glu's g/u rows, hq,
hs and down's opair against the sparse designs (oracles.moe_decode.glu_sparse_designed,
down_sparse_designed), bit for bit, as the sweep does at small sizes.

An offset computed in 32 bits wraps to 1,031,798,784 bytes into the gate/up table: the gate
writes a decoy there, the expert's codes with every sign flipped, so a wrapped read computes
-g for g, not garbage that might pass. Only expert 127's rows, its scales and the decoy are
written; the rest of the tables is uninitialised memory no correct launch reads. The down
tables are views of the first half of the gate/up tables' memory (down codes are [E, H, I/2],
half of [E, 2I, H/2]; the regions the launch reads do not overlap, see `far_end_layout`), so
the gate needs 5.6 GiB, not 8.4.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from gates import _moe_decode as g
from harness import assert_bits_eq
from harness.library.buffers import INDEX_32, device_memory
from kernels_cu import moe_decode as moe
from oracles import moe_decode as od

# Llama-4 Maverick (config.json: hidden_size 5120, intermediate_size 8192, num_local_experts 128,
# num_experts_per_tok 1), one decode token.
BIG = g.Shape(t=1, h=5120, i=8192, e=128, k=1)
FAR = BIG.e - 1
WRAP = 1 << 32  # where an unsigned 32-bit offset wraps
SEED = 5120


@dataclass(frozen=True)
class FarEndLayout:
    """Byte offsets of what the launch reads, in the gate/up codes' memory (down's codes are a
    view of its first half) and in the gate/up scales' memory (down's scales likewise)."""

    glu_codes: int  # expert FAR's gate/up codes
    glu_row_bytes: int  # an expert's gate/up codes
    decoy: int  # where glu_codes lands in 32-bit arithmetic
    down_codes: int
    down_row_bytes: int
    glu_scales: int
    down_scales: int
    codes_bytes: int  # the gate/up codes' allocation
    scales_bytes: int


def far_end_layout(s: g.Shape = BIG, far: int = FAR) -> FarEndLayout:
    glu_rows = 2 * s.i * (s.h // 2)
    down_rows = s.h * (s.i // 2)
    return FarEndLayout(glu_codes=far * glu_rows, glu_row_bytes=glu_rows, decoy=(far * glu_rows) % WRAP,
                        down_codes=far * down_rows, down_row_bytes=down_rows,
                        glu_scales=far * 2 * s.i * (s.h // od.GROUP), down_scales=far * s.h * (s.i // od.GROUP),
                        codes_bytes=s.e * glu_rows, scales_bytes=s.e * 2 * s.i * (s.h // od.GROUP))


def layout_problems(lay: FarEndLayout) -> list[str]:
    """Why the layout would not test what the gate claims, or nothing."""
    spans = {"the far expert's gate/up codes": (lay.glu_codes, lay.glu_row_bytes),
             "the decoy": (lay.decoy, lay.glu_row_bytes), "the far expert's down codes": (lay.down_codes,
                                                                                         lay.down_row_bytes)}
    out = []
    if not WRAP <= lay.glu_codes < WRAP + INDEX_32:
        out.append(f"the gate/up codes start at {lay.glu_codes}, not in [2^32, 2^32 + 2^31): a 32-bit offset would "
                   "not wrap into the table")
    if lay.down_codes < INDEX_32:
        out.append(f"the down codes start at {lay.down_codes}, below 2^31")
    names = list(spans)
    for a in range(len(names)):
        for b in range(a + 1, len(names)):
            (sa, na), (sb, nb) = spans[names[a]], spans[names[b]]
            if sa < sb + nb and sb < sa + na:
                out.append(f"{names[a]} and {names[b]} overlap")
    glu_scales, down_scales = lay.glu_row_bytes // 8, lay.down_row_bytes // 8  # one scale a group of 16 codes (8 bytes)
    if lay.glu_scales < lay.down_scales + down_scales and lay.down_scales < lay.glu_scales + glu_scales:
        out.append("the far expert's gate/up and down scales overlap")
    return out


def _slots(a: np.ndarray, kcap: int, fill) -> np.ndarray:
    out = np.full((a.shape[0], kcap, *a.shape[2:]), fill, dtype=a.dtype)
    out[:, :a.shape[1]] = a
    return out


@pytest.mark.gpu
@pytest.mark.anchor
@pytest.mark.memory_safety
def test_the_far_expert_of_tables_past_2_to_the_32_bytes_computes_its_designed_rows():
    # Bitwise, as the sweep's expert stages: two live groups a row under a power-of-two scale,
    # dyadic activations, gs = 1: every dot exact in any order.
    import cupy

    s, lay = BIG, far_end_layout()
    assert not layout_problems(lay), layout_problems(lay)
    ids = np.array([[FAR]], np.int32)
    glu = od.glu_sparse_designed(ids, s.h, s.i, seed=SEED)
    down = od.down_sparse_designed(ids, s.h, s.i, seed=SEED)
    w_glu, s_glu = glu.weights.dense(FAR)
    w_down, s_down = down.weights.dense(FAR)
    with device_memory(lay.codes_bytes + lay.scales_bytes + (256 << 20),
                       f"Llama-4 Maverick's expert tables ({s.e} experts, H {s.h}, I {s.i}) past 2^32 bytes"):
        wgu = cupy.empty((s.e, 2 * s.i, s.h // 2), np.uint8)
        sgu = cupy.empty((s.e, 2 * s.i, s.h // od.GROUP), np.uint8)
        wdn = cupy.ndarray((s.e, s.h, s.i // 2), np.uint8, memptr=wgu.data)  # the first half of wgu's memory
        sdn = cupy.ndarray((s.e, s.h, s.i // od.GROUP), np.uint8, memptr=sgu.data)
        wgu[FAR], sgu[FAR] = g.put(w_glu), g.put(s_glu)
        wdn[FAR], sdn[FAR] = g.put(w_down), g.put(s_down)
        wgu.reshape(-1)[lay.decoy:lay.decoy + lay.glu_row_bytes] = g.put((w_glu ^ 0x88).reshape(-1))
        gs = cupy.full((s.e,), np.nan, np.float32)
        gs[FAR] = 1.0
        experts = moe.Experts(wgu=wgu, sgu=sgu, gs_gu=gs, wdn=wdn, sdn=sdn, gs_dn=gs,
                              table=g.put(np.arange(s.e, dtype=np.int32)))
        slot_ids = _slots(ids, s.kcap, g.ID_SENTINEL)
        hq, hs, gu = g.run_glu(slot_ids, glu.gq, glu.gsc, experts, act_g=glu.act_g, act_h=glu.act_h, k=s.k, i=s.i)
        opair = g.run_down(slot_ids, _slots(down.hq, s.kcap, g.BYTE_SENTINEL), _slots(down.hs, s.kcap, g.BYTE_SENTINEL),
                           experts, act_h=down.act_h, k=s.k, h=s.h)
        got = {name: g.host(a)[:, :s.k] for name, a in (("gu", gu), ("hq", hq), ("hs", hs), ("opair", opair))}
        del wgu, sgu, wdn, sdn, experts
    assert np.count_nonzero(glu.gu.astype(np.float32)) > s.i, "the far expert's g/u rows are mostly zero"
    assert_bits_eq(f"glu g/u of expert {FAR} ({lay.glu_codes} bytes into its table)", got["gu"], glu.gu)
    assert_bits_eq(f"glu hs of expert {FAR}", got["hs"], glu.hs)
    assert_bits_eq(f"glu hq of expert {FAR}", got["hq"], glu.hq)
    assert_bits_eq(f"down opair of expert {FAR} ({lay.down_codes} bytes into its table)", got["opair"], down.opair)
