"""NVFP4 MoE decode: the links. Each compares one GPU arm with another, bit for bit, and reads
the sentinels of the slots past K. The chain they share runs once a shape on random inputs
(gates/_moe_decode.random_chain); its experts are the router's own picks."""

from __future__ import annotations

import numpy as np
import pytest

from gates import _moe_decode as g
from harness import assert_bits_eq
from oracles import moe_decode as od

shapes = pytest.mark.parametrize("shape_id", g.SHAPE_IDS)


def _distinct_experts(chain: g.Chain) -> None:
    """Non-degeneracy: the tokens pick different experts, and not expert 0 alone."""
    ids = g.selected_ids(chain)
    assert len({tuple(row) for row in ids.tolist()}) == ids.shape[0], f"tokens picked the same experts: {ids.tolist()}"


@pytest.mark.gpu
@pytest.mark.link
@shapes
def test_glu_gate_and_up_rows_equal_the_certified_nvfp4_gemv_bitwise(shape_id):
    # Bitwise: moe_glu computes each row as nvfp4_gemv's base kernel does (nvfp4_partial over
    # 64 virtual lanes, two butterflies, halves low first, bf16(gs * sum)), on the dequantized
    # activation q * s * act_g, which is exact in bf16 (act_g a power of two).
    chain = g.random_chain(shape_id)
    s = chain.shape
    _distinct_experts(chain)
    g.assert_fully_written("glu g/u", chain.gu, s.k)
    table = g.host(chain.experts.table)
    for t in range(s.t):
        x = od.nvfp4_dequantize(chain.post["gq"][t], chain.post["gsc"][t], chain.inputs.act_g)
        for k in range(s.k):
            e = int(chain.router["ids"][t, k])
            wgu, sgu, gs_gu, *_ = g.storage_weights(chain.experts, int(table[e]))
            assert_bits_eq(f"glu g/u of token {t} slot {k} (expert {e})", chain.gu[t, k], g.certified_gemv(wgu, sgu, gs_gu, x))
    g.assert_slots_past_k_untouched("glu g/u", chain.gu, s.k)


@pytest.mark.gpu
@pytest.mark.link
@shapes
def test_glu_hq_hs_equal_the_reference_arm_on_the_certified_gemv_bitwise(shape_id):
    # Bitwise: the reference arm runs the same GLU and quantizer device functions on g/u rows
    # the certified GEMV produced (equal to moe_glu's own by the link above).
    chain = g.random_chain(shape_id)
    s = chain.shape
    table = g.host(chain.experts.table)
    rows = []
    for t in range(s.t):
        x = od.nvfp4_dequantize(chain.post["gq"][t], chain.post["gsc"][t], chain.inputs.act_g)
        for k in range(s.k):
            wgu, sgu, gs_gu, *_ = g.storage_weights(chain.experts, int(table[int(chain.router["ids"][t, k])]))
            rows.append(g.certified_gemv(wgu, sgu, gs_gu, x))
    hq, hs = g.run_glu_reference(np.stack(rows), act_h=chain.inputs.act_h)
    assert np.count_nonzero(chain.hs[:, :s.k]) > 0, "every hs is zero: the link would compare nothing"
    assert_bits_eq("glu hs vs the reference arm", chain.hs[:, :s.k].reshape(s.t * s.k, -1), g.host(hs))
    assert_bits_eq("glu hq vs the reference arm", chain.hq[:, :s.k].reshape(s.t * s.k, -1), g.host(hq))
    g.assert_slots_past_k_untouched("glu hq", chain.hq, s.k)
    g.assert_slots_past_k_untouched("glu hs", chain.hs, s.k)


@pytest.mark.gpu
@pytest.mark.link
@shapes
def test_down_opair_equals_the_certified_nvfp4_gemv_bitwise(shape_id):
    # Bitwise: the same GEMV on the expert's down table against hq * hs * act_h (exact in bf16).
    chain = g.random_chain(shape_id)
    s = chain.shape
    g.assert_fully_written("opair", chain.opair, s.k)
    table = g.host(chain.experts.table)
    for t in range(s.t):
        for k in range(s.k):
            e = int(chain.router["ids"][t, k])
            *_, wdn, sdn, gs_dn = g.storage_weights(chain.experts, int(table[e]))
            x = od.nvfp4_dequantize(chain.hq[t, k], chain.hs[t, k], chain.inputs.act_h)
            assert_bits_eq(f"opair of token {t} slot {k} (expert {e})", chain.opair[t, k], g.certified_gemv(wdn, sdn, gs_dn, x))
    g.assert_slots_past_k_untouched("opair", chain.opair, s.k)


@pytest.mark.gpu
@pytest.mark.link
@shapes
def test_t_tokens_in_one_launch_equal_t_one_token_launches(shape_id):
    # Bitwise: no stage mixes tokens; a token's work does not depend on T or on its index.
    chain = g.random_chain(shape_id)
    s, inp = chain.shape, chain.inputs
    one = g.Shape(t=1, h=s.h, i=s.i, e=s.e, k=s.k)
    for t in range(s.t):
        sub = od.LayerInputs(**{**vars(inp), "x": inp.x[t:t + 1], "o": inp.o[t:t + 1], "dense": inp.dense[t:t + 1]})
        single = g.run_chain(one, sub, experts=chain.experts, weights=chain.weights)
        for name in ("mid", "rr", "fq", "fs", "gq", "gsc"):
            assert_bits_eq(f"post_attn {name} of token {t} (alone vs in T={s.t})", single.post[name], chain.post[name][t:t + 1])
        for name in ("logits", "ids", "wts"):
            assert_bits_eq(f"router {name} of token {t} (alone vs in T={s.t})", single.router[name], chain.router[name][t:t + 1])
        for name in ("gu", "hq", "hs", "opair", "out"):
            assert_bits_eq(f"{name} of token {t} (alone vs in T={s.t})", getattr(single, name), getattr(chain, name)[t:t + 1])


@pytest.mark.gpu
@pytest.mark.link
@shapes
def test_experts_in_a_permuted_table_equal_the_identity_table_bitwise(shape_id):
    # Bitwise: the same weights at other storage slots; every unselected slot has NaN block and
    # global scales, so reading any expert but table[e] poisons the output.
    chain = g.random_chain(shape_id)
    s = chain.shape
    table = od.permuted_table(s.e, seed=s.e)
    ids = chain.router["ids"]
    experts = g.device_experts(s, chain.weights, table)
    hq, hs, gu = g.run_glu(ids, chain.post["gq"], chain.post["gsc"], experts, act_g=chain.inputs.act_g,
                           act_h=chain.inputs.act_h, k=s.k, i=s.i)
    opair = g.run_down(ids, chain.hq, chain.hs, experts, act_h=chain.inputs.act_h, k=s.k, h=s.h)
    assert not np.array_equal(table[g.selected_ids(chain)], g.selected_ids(chain)), "the permutation moved no selected expert"
    assert_bits_eq("glu g/u (permuted table vs identity)", g.host(gu), chain.gu)
    assert_bits_eq("glu hq (permuted table vs identity)", g.host(hq), chain.hq)
    assert_bits_eq("glu hs (permuted table vs identity)", g.host(hs), chain.hs)
    assert_bits_eq("opair (permuted table vs identity)", g.host(opair), chain.opair)


@pytest.mark.gpu
@pytest.mark.link
@shapes
def test_second_router_launch_on_the_same_ticket_equals_the_first(shape_id):
    # Bitwise: the last CTA resets the ticket, so a second launch selects again. Fresh output
    # buffers (sentinels) for the second launch: a stale ticket leaves them unwritten.
    chain = g.random_chain(shape_id)
    s = chain.shape
    ticket = g.zero_ticket()
    first = g.run_router(chain.post["rr"], chain.inputs.wr, chain.inputs.pes, k=s.k, kcap=s.kcap, ticket=ticket)
    left = int(g.host(ticket)[0])
    second = g.run_router(chain.post["rr"], chain.inputs.wr, chain.inputs.pes, k=s.k, kcap=s.kcap, ticket=ticket)
    g.assert_fully_written("router ids (first launch)", first.ids, s.k)
    for name in ("ids", "wts", "logits"):
        assert_bits_eq(f"router {name}: second launch on the same ticket counters", g.host(getattr(second, name)),
                       g.host(getattr(first, name)))
    assert left == 0 and int(g.host(ticket)[0]) == 0, f"the ticket was left at {left}, then {int(g.host(ticket)[0])}; it must be 0"


@pytest.mark.gpu
@pytest.mark.link
def test_down_full_sweep_and_tail_equals_the_certified_nvfp4_gemv_bitwise():
    # Bitwise, as the down link above, at I = 1088: K16 = 68 groups a row, a full sweep of 64
    # virtual lanes and a tail of 4, so every lane's partial is live, the last lane of each
    # half (v = 31, v = 63) included. The chain's shapes (K16 = 8 and 44) never take the full
    # sweep in moe_down and leave v = 63 empty: thread roles shifted by one there only
    # re-associate exact sums. H = 64, E = 3, K = 2, T = 1: a few hundred kilobytes.
    s = g.Shape(t=1, h=64, i=1088, e=3, k=2)
    case = od.down_sweep_designed(s.h, s.i, s.e, s.k, seed=1088)
    experts = g.device_experts(s, case.weights, np.arange(s.e, dtype=np.int32))
    ids = np.full((s.t, s.kcap), -1, np.int32)
    ids[:, :s.k] = case.ids
    hq = np.full((s.t, s.kcap, s.i // 2), g.BYTE_SENTINEL, np.uint8)
    hs = np.full((s.t, s.kcap, s.i // od.GROUP), g.BYTE_SENTINEL, np.uint8)
    hq[:, :s.k], hs[:, :s.k] = case.hq, case.hs
    opair = g.host(g.run_down(ids, hq, hs, experts, act_h=case.act_h, k=s.k, h=s.h))
    g.assert_fully_written("opair (full sweep)", opair, s.k)
    for k in range(s.k):
        e = int(case.ids[0, k])
        *_, wdn, sdn, gs_dn = g.storage_weights(experts, e)
        x = od.nvfp4_dequantize(case.hq[0, k], case.hs[0, k], case.act_h)
        assert_bits_eq(f"opair slot {k} (expert {e}, I=1088: full sweep + tail)", opair[0, k],
                       g.certified_gemv(wdn, sdn, gs_dn, x))
    g.assert_slots_past_k_untouched("opair (full sweep)", opair, s.k)
