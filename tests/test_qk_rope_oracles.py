"""Host-only tests of the QK-RoPE oracles (designed inputs, closed form, paged layout,
scenario metadata) and of the launcher's refusal messages. No GPU needed."""

import numpy as np
import pytest

from harness.library.dtypes import bf16, bits_of
from kernels_cu import qk_rope as launcher
from oracles import qk_rope as design
from oracles.paged_layout import K, V, PagedKvLayout

HEAD_DIMS = (256, 512)


# ------------------------------------------------------------------ paged layout


def test_layout_index_matches_the_contract_formula_at_a_hand_computed_point():
    layout = PagedKvLayout(page_size=4, num_layers=2, nkv=2, head_dim=256, num_pages=6)
    # kv_block 2048, layer_stride 4096, page_stride 8192:
    # 1 * 8192 + 1 * 4096 + 1 * 2048 + (5 % 4) * 512 + 1 * 256 + 3
    assert int(layout.index(1, 1, V, 5, 1, 3)) == 15107
    assert layout.pool_elements == 6 * 8192


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_layout_index_is_a_bijection_onto_the_pool(head_dim):
    layout = PagedKvLayout(page_size=4, num_layers=2, nkv=2, head_dim=head_dim, num_pages=3)
    page, layer, kind, slot, head, d = np.meshgrid(
        np.arange(3), np.arange(2), np.arange(2), np.arange(4), np.arange(2), np.arange(head_dim), indexing="ij")
    idx = layout.index(page, layer, kind, slot, head, d).ravel()
    assert np.array_equal(np.sort(idx), np.arange(layout.pool_elements))


def test_layout_image_places_rows_at_their_addresses_and_zeros_elsewhere():
    layout = PagedKvLayout(page_size=4, num_layers=2, nkv=2, head_dim=256, num_pages=3)
    k_rows = np.full((2, 2, 256), 2.0, dtype=bf16)
    v_rows = np.full((2, 2, 256), -3.0, dtype=bf16)
    image = layout.image(1, [2, 0], [9, 1], k_rows, v_rows).astype(np.float32)
    k_at = layout.index(2, 1, K, 9, np.arange(2)[:, None], np.arange(256)[None, :])
    v_at = layout.index(0, 1, V, 1, np.arange(2)[:, None], np.arange(256)[None, :])
    assert np.all(image[k_at] == 2.0) and np.all(image[v_at] == -3.0)
    assert np.count_nonzero(image) == 2 * 2 * 2 * 256


def test_layout_image_refuses_two_tokens_in_one_slot():
    layout = PagedKvLayout(page_size=4, num_layers=1, nkv=1, head_dim=256, num_pages=2)
    rows = np.ones((2, 1, 256), dtype=bf16)
    with pytest.raises(ValueError, match="already written"):
        layout.image(0, [1, 1], [4, 8], rows, rows)


def test_layout_page_of_refuses_a_position_outside_the_window():
    layout = PagedKvLayout(page_size=4, num_layers=1, nkv=1, head_dim=256, num_pages=6)
    assert layout.page_of(9, (4, 1, 3), 1) == 1
    with pytest.raises(ValueError, match="outside the window"):
        layout.page_of(3, (4, 1, 3), 1)
    with pytest.raises(ValueError, match="outside the window"):
        layout.page_of(16, (4, 1, 3), 1)


# ------------------------------------------------------------------ designed inputs


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_designed_sign_patterns_differ_between_every_pair_of_vectors(head_dim):
    vectors = np.concatenate([
        design.designed_heads(design.TENSOR_Q, 10, 4, head_dim).reshape(-1, head_dim),
        design.designed_heads(design.TENSOR_K, 10, 2, head_dim).reshape(-1, head_dim),
        design.designed_heads(design.TENSOR_V, 10, 2, head_dim).reshape(-1, head_dim),
    ]).astype(np.float32)
    signs = np.sign(vectors)
    # Pairwise agreement of sign patterns: +HD on the diagonal only, never -HD (a negated twin).
    agreement = signs @ signs.T
    off = agreement[~np.eye(len(signs), dtype=bool)]
    assert np.all(np.abs(off) < head_dim), "two vectors share a sign pattern (or its negation)"


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_designed_vectors_have_one_magnitude_each(head_dim):
    x = design.designed_heads(design.TENSOR_Q, 10, 4, head_dim).astype(np.float32)
    mags = np.abs(x)
    assert np.all(mags == mags[..., :1])
    assert len(np.unique(mags[..., 0])) > 1, "magnitudes should vary so the norm has something to erase"


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_norm_weights_start_at_one_are_nonzero_and_k_is_the_negation_of_q(head_dim):
    q_w, k_w = design.norm_weights(head_dim)
    assert float(q_w[0]) == 1.0
    assert np.all(q_w.astype(np.float32) != 0)
    assert np.array_equal(k_w.astype(np.float32), -q_w.astype(np.float32))
    assert len(np.unique(q_w.astype(np.float32))) >= 128, "weights must vary with d"


def test_rope_table_has_unit_coefficients_repeating_every_three_positions():
    cos, sin = design.rope_tables(32, 128)
    assert cos.dtype == np.float32 and cos.shape == (32, 64)
    pairs = {(float(c), float(s)) for c, s in zip(cos.ravel(), sin.ravel())}
    assert pairs == {(1.0, 0.0), (0.0, 1.0), (-1.0, 0.0)}
    assert np.array_equal(cos[3:], cos[:-3]) and np.array_equal(sin[3:], sin[:-3])
    assert not np.array_equal(cos[1:], cos[:-1]), "the table must vary with position"
    assert np.all(sin.any(axis=1)), "every position needs a swap, or a sign flip in the sin term hides"


# ------------------------------------------------------------------ closed form


@pytest.mark.parametrize("head_dim,rotary_dim", [(256, 256), (256, 128), (512, 128)])
def test_closed_form_on_designed_inputs_only_moves_and_negates_weights(head_dim, rotary_dim):
    x = design.designed_heads(design.TENSOR_Q, 10, 4, head_dim)
    q_w, _ = design.norm_weights(head_dim)
    cos, sin = design.rope_tables(32, rotary_dim)
    positions = np.arange(10) * 3 + 1
    out = design.closed_form(x, q_w, positions, cos, sin, rotary_dim).astype(np.float32)
    w = q_w.astype(np.float32)
    half = rotary_dim // 2
    # each rotated pair holds the pair's two weights, in some order and sign
    got = np.sort(np.abs(np.stack([out[..., :half], out[..., half:rotary_dim]], -1)), -1)
    want = np.sort(np.stack([w[:half], w[half:rotary_dim]], -1), -1)
    assert np.array_equal(got, np.broadcast_to(want, got.shape))
    # the tail is sign(x) * w, untouched by the rotation
    tail = np.sign(x.astype(np.float32)[..., rotary_dim:]) * w[rotary_dim:]
    assert np.array_equal(out[..., rotary_dim:], tail)


def test_closed_form_weightless_is_the_sign_pattern():
    x = design.designed_heads(design.TENSOR_V, 10, 2, 256)
    out = design.closed_form_weightless(x)
    assert np.array_equal(out.astype(np.float32), np.sign(x.astype(np.float32)))


def test_closed_form_refuses_inputs_whose_bits_are_not_exact():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 2, 256)).astype(bf16)
    q_w, _ = design.norm_weights(256)
    cos, sin = design.rope_tables(8, 256)
    with pytest.raises(ValueError, match="design margin"):
        design.closed_form(x, q_w, [0, 1], cos, sin, 256)


# ------------------------------------------------------------------ paged scenario


def test_decode_windows_start_at_each_tokens_own_page_with_distinct_nonzero_origins():
    sc = design.PagedScenario(num_tokens=10)
    indptr, indices = sc.decode_csr()
    origins = sc.decode_origins()
    assert len(set(origins.tolist())) > 1 and np.all(origins > 0)
    layout = PagedKvLayout(page_size=sc.page_size, num_layers=sc.num_layers, nkv=2, head_dim=256,
                           num_pages=sc.num_pages)
    for b, pos in enumerate(sc.positions):
        window = indices[indptr[b]:indptr[b + 1]]
        assert window[0] == layout.page_of(int(pos), sc.window, sc.page_origin), "window starts at own page"
        assert layout.page_of(int(pos), window, int(origins[b])) == layout.page_of(int(pos), sc.window, sc.page_origin)
    assert indices[0] == sc.junk_page and sc.junk_page not in sc.window
    assert sc.num_pages - 1 not in sc.window


def test_scenario_refuses_a_junk_page_inside_the_window():
    with pytest.raises(ValueError, match="junk_page"):
        design.PagedScenario(junk_page=4)


# ------------------------------------------------------------------ launcher refusals


def _host_args(head_dim=256, rotary_dim=128, tokens=3):
    q = design.designed_heads(design.TENSOR_Q, tokens, 4, head_dim)
    k = design.designed_heads(design.TENSOR_K, tokens, 2, head_dim)
    v = design.designed_heads(design.TENSOR_V, tokens, 2, head_dim) if head_dim == 256 else None
    q_w, k_w = design.norm_weights(head_dim)
    cos, sin = design.rope_tables(16, rotary_dim)
    return q, k, v, q_w, k_w, cos, sin


def test_head_dim_refusal_names_the_supported_sizes():
    with pytest.raises(ValueError) as info:
        launcher.check_heads(*_host_args(head_dim=128), rotary_dim=128)
    assert str(info.value) == "head_dim 128 is not supported: qk_rope.cu is built for head_dim 256 or 512"


def test_cos_table_refusal_names_the_token_and_the_fix():
    heads = launcher.check_heads(*_host_args(), rotary_dim=128)
    with pytest.raises(ValueError) as info:
        launcher.check_positions(heads, [0, 16, 3], 3)
    assert str(info.value) == (
        "position 16 (token 1) is outside the cos table [0, 16): build longer cos/sin tables")


def test_positions_on_the_device_are_refused_with_the_reason():
    heads = launcher.check_heads(*_host_args(), rotary_dim=128)

    class DeviceLike:
        shape = (3,)

        def get(self):
            return np.zeros(3, np.int32)

    with pytest.raises(ValueError, match="must be host integers"):
        launcher.check_positions(heads, DeviceLike(), 3)


def test_hd512_refuses_a_v_input():
    q, k, _, q_w, k_w, cos, sin = _host_args(head_dim=512)
    with pytest.raises(ValueError, match="K = V fork"):
        launcher.check_heads(q, k, k, q_w, k_w, cos, sin, rotary_dim=128)


def test_pool_refusals_name_the_page_stride():
    heads = launcher.check_heads(*_host_args(), rotary_dim=128)
    stride = 4 * 2 * 2 * 2 * 256
    with pytest.raises(ValueError, match="no whole page"):
        launcher.check_pool(heads, np.zeros(stride - 1, bf16), page_size=4, num_layers=2, layer=1)
    with pytest.raises(ValueError, match="not a multiple of the page stride"):
        launcher.check_pool(heads, np.zeros(stride + 1, bf16), page_size=4, num_layers=2, layer=1)
    assert launcher.check_pool(heads, np.zeros(3 * stride, bf16), page_size=4, num_layers=2, layer=1) == 3


def test_launcher_name_expressions_cover_every_arm_and_head_size():
    assert set(launcher.NAME_EXPRESSIONS) == {
        f"{kernel}<{hd}{meta}>" for hd in HEAD_DIMS
        for kernel, meta in (("qk_rope_flat", ""), ("qk_rope_paged", ", false"), ("qk_rope_paged", ", true"))
    }



# ------------------------------------------------------------------ eps, origin 0, tail jobs


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_tiny_heads_make_eps_half_the_norm_and_the_outputs_exact(head_dim):
    x = design.tiny_heads(design.TENSOR_Q, 11, 4, head_dim)
    assert set(np.abs(x.astype(np.float64)).ravel().tolist()) == {design.TINY}
    mean_square = np.mean(x.astype(np.float64) ** 2, axis=-1)
    np.testing.assert_array_equal(1.0 / np.sqrt(mean_square + design.EPS_TINY), 512.0)
    assert np.float32(design.EPS_TINY) == design.EPS_TINY, "eps must be exact in f32 (the kernel takes a float)"
    q_w, _ = design.norm_weights(head_dim)
    cos, sin = design.rope_tables(32, 128)
    out = design.closed_form(x, q_w, np.arange(11), cos, sin, 128, eps=design.EPS_TINY)
    # Every output is +-w / 2 of some element (moved and negated by the rotation), none zero.
    halves = {abs(v) / 2 for v in q_w.astype(np.float64).tolist()}
    assert set(np.abs(out.astype(np.float64)).ravel().tolist()) <= halves


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_an_eps_dropped_or_moved_changes_every_tiny_output(head_dim):
    # The kill power of the eps anchor, from the contract's formula with other eps placements.
    x = design.tiny_heads(design.TENSOR_K, 11, 2, head_dim).astype(np.float64)
    ms = np.mean(x * x, axis=-1, keepdims=True)
    right = x / np.sqrt(ms + design.EPS_TINY)
    for wrong in (x / np.sqrt(ms), x / (np.sqrt(ms) + design.EPS_TINY), x / np.sqrt(ms + 2 * design.EPS_TINY)):
        assert np.all(wrong.astype(np.float32).astype(bf16) != right.astype(bf16))


def test_zero_heads_norm_to_zero_only_with_eps():
    x = design.tiny_heads(design.TENSOR_V, 11, 2, 256, zero_every=5)
    zero = ~np.any(x.astype(np.float64) != 0, axis=-1)
    assert zero.any() and not zero.all()
    out = design.closed_form_weightless(x, eps=design.EPS_TINY).astype(np.float64)
    assert np.all(out[zero] == 0) and np.all(out[~zero] != 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        assert np.all(np.isnan(x.astype(np.float64)[zero] / np.sqrt(0.0))), "without eps a zero head is NaN"


def test_origin_zero_scenario_reaches_page_zero_in_both_arms_and_leaves_idle_warps():
    s = design.ORIGIN0_SCENARIO
    assert s.page_origin == 0 and s.positions[0] // s.page_size == 0
    origins = s.decode_origins()
    assert origins.tolist() == [0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2]
    assert s.num_tokens * (4 + 2) % launcher.WARPS_PER_BLOCK == 2
    # The spare position past the request has a valid window entry, so a warp past the last
    # job writes instead of trapping; the junk page and the last page stay unreferenced.
    spare = int(s.positions[-1]) + 1
    layout = PagedKvLayout(page_size=s.page_size, num_layers=2, nkv=2, head_dim=256, num_pages=s.num_pages)
    assert layout.page_of(spare, s.window, s.page_origin) == s.window[-1]
    used = {layout.page_of(int(p), s.window, s.page_origin) for p in s.positions}
    assert s.junk_page not in used and s.num_pages - 1 not in used and s.window[-1] not in used
    indptr, indices = s.decode_csr()
    assert indptr[0] == 1 and indices[0] == s.junk_page


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_eps_anchor_data_builds_on_the_host_with_zero_and_tiny_heads_and_a_spare_token(head_dim):
    from gates import _qk_rope as qk

    data = qk.eps_data(head_dim, 128, on_device=False, zeros=True)
    assert data.eps == design.EPS_TINY and data.num_tokens == 11 and data.q.shape[0] == 11
    h = data.host
    for name in ("q", "k") + (("v",) if head_dim == 256 else ()):
        zero = ~np.any(h[name].astype(np.float64) != 0, axis=-1)
        assert zero.any() and not zero.all(), name
    pos = np.asarray(qk.EPS_ANCHOR_POSITIONS)
    assert pos.size == 11 and pos.max() < qk.COS_MAX_POS and set(pos % 3) == {0, 1, 2}
    out = design.closed_form(h["q"], h["q_w"], pos, h["cos"], h["sin"], 128, eps=data.eps)
    assert out.shape == (11, qk.NQ, head_dim)
    zero = np.broadcast_to((~np.any(h["q"].astype(np.float64) != 0, axis=-1))[..., None], out.shape)
    cleared = qk._magnitude_where_zero(out, zero)
    assert np.all(bits_of(cleared)[zero] == 0), "zero heads compare as +0 whatever their sign"
    np.testing.assert_array_equal(bits_of(cleared)[~zero], bits_of(out)[~zero])
    assert np.all(bits_of(out)[~zero] & 0x7FFF), "tiny heads give no zero output"


# ------------------------------------------------------------------ order-sensitive design (invariance gates)

from gates import test_qk_rope_invariance as inv  # noqa: E402


def test_lane_dims_is_each_lanes_16_byte_vectors():
    for hd in (256, 512):
        dims = design.lane_dims(hd)
        assert sorted(dims.ravel().tolist()) == list(range(hd)), "every dimension in exactly one register"
        assert dims[0, :8].tolist() == list(range(8)) and dims[1, 0] == 8 and dims[0, 8 % dims.shape[1]] in (0, 256)


def test_sum_of_squares_orders_agree_to_rounding_and_kernel_order_is_the_butterfly():
    rng = np.random.default_rng(3)
    x = design.to_bf16(rng.standard_normal((5, 256)))
    exact = (x.astype(np.float64) ** 2).sum(-1)
    for order in ("kernel", "two accumulators", "sequential"):
        got = design.sum_of_squares(x, order)
        assert got.dtype == np.float32 and np.allclose(got, exact, rtol=1e-5), order
    # integers: every order is exact, so all agree bit for bit
    ints = design.to_bf16(rng.integers(-8, 9, (3, 512)).astype(np.float64))
    ref = design.sum_of_squares(ints)
    for order in ("two accumulators", "sequential"):
        assert np.array_equal(design.sum_of_squares(ints, order), ref)
    with pytest.raises(ValueError, match="unknown order"):
        design.sum_of_squares(x, "tree")


@pytest.mark.parametrize("config", list(inv.CONFIGS))
def test_order_sensitive_design_moves_the_gates_rows_under_another_order(config):
    # The invariance gate's power: on its rows another order of the squares must change output
    # bits. Sequential order moves every row; the two-accumulator grouping (one lane's registers
    # regrouped, the smallest change) moves at least one of them.
    case = inv.case(*inv.CONFIGS[config])
    rows = list(inv.ROWS)
    seq = case.moved_by("sequential")[rows]
    two = case.moved_by("two accumulators")[rows]
    assert (seq > 0).all(), f"sequential order leaves rows {np.flatnonzero(seq == 0).tolist()} unmoved"
    assert (two > 0).any(), "two accumulators move none of the gate's rows"
    # the cancelling pairs: one of each rotary pair's outputs is far smaller than the pair's products
    hd, rot = inv.CONFIGS[config][:2]
    out = design.model_outputs(case.q, case.q_w, case.positions, case.cos, case.sin, rot).astype(np.float64)
    half = rot // 2
    small = np.minimum(np.abs(out[..., :half]), np.abs(out[..., half:rot]))
    big = np.maximum(np.abs(out[..., :half]), np.abs(out[..., half:rot]))
    assert np.median(small / np.maximum(big, 1e-30)) < 2.0**-6
    assert not (case.positions == 0).any(), "position 0 has sin 0: nothing cancels there"


def test_order_sensitive_case_refuses_a_table_too_short():
    with pytest.raises(ValueError, match="at least 2 positions"):
        design.order_sensitive_case(4, 4, 2, 256, 256, 1, 0)


# ------------------------------------------------------------------ the big-index gate's design


def test_the_big_index_window_lies_on_both_sides_of_2_31_pool_elements():
    from gates import test_qk_rope_big_index as big
    from harness.library.buffers import INDEX_32

    layout, sc = big.LAYOUT, big.SCENARIO
    stride = layout.page_stride
    assert layout.pool_elements > INDEX_32 and sc.num_pages - 1 not in sc.window and sc.junk_page not in sc.window
    assert 1092 * stride <= INDEX_32, "pages 1090 and 1091 lie wholly below 2^31"
    last_layer_of_1092 = int(layout.index(1092, sc.layer, K, 0, 0, 0))
    assert 1092 * stride < INDEX_32 < last_layer_of_1092, "page 1092: the layer term carries the address past"
    assert all(p * stride > INDEX_32 for p in sc.window if p >= 1093) and {1090, 1091, 1092} <= set(sc.window)
    assert set(sc.window) <= set(big.REGION) and sc.page_origin == 20
    # every token lands in the checked region, and the region's image holds each of its rows
    rows = np.ones((sc.num_tokens, big.NKV, big.HD), bf16)
    image = big._region_image(rows, -rows)
    assert np.count_nonzero(bits_of(image)) == 2 * sc.num_tokens * big.NKV * big.HD


# ------------------------------------------------------------------ the sweep's chain, on the host
#
# The arms emulated from the contract's formulas on numpy arrays (the closed form for each
# token's rows; the layout's addresses for the pool), so the sweep's check runs here end to end:
# a kernel that follows the contract passes at every preset and boundary, and one that takes the
# page slot by mask fails at a page size that is not a power of two.


def _emulated_arms(monkeypatch, slot=lambda pos, page_size: pos % page_size):
    from gates import _qk_rope as qk

    def rows(q, k, v, q_w, k_w, cos, sin, pos, rotary_dim):
        return (design.closed_form(q, q_w, pos, cos, sin, rotary_dim),
                design.closed_form(k, k_w, pos, cos, sin, rotary_dim),
                design.closed_form_weightless(v if v is not None else k))

    def run_flat(q, k, v, q_w, k_w, cos, sin, positions, q_out, k_out, v_out, *, rotary_dim, eps, row_offset=0):
        heads, pos = launcher.check_flat(q, k, v, q_w, k_w, cos, sin, positions, q_out, k_out, v_out,
                                         rotary_dim=rotary_dim, row_offset=row_offset)
        for out, r in zip((q_out, k_out, v_out), rows(q, k, v, q_w, k_w, cos, sin, pos, rotary_dim)):
            out[row_offset:row_offset + heads.num_tokens] = r

    def store(heads, pool, page_size, num_layers, layer, pos, pages, k_rows, v_rows):
        layout = PagedKvLayout(page_size, num_layers, heads.nkv, heads.head_dim,
                               pool.size // (num_layers * 2 * page_size * heads.nkv * heads.head_dim))
        at = np.arange(heads.nkv)[:, None] * heads.head_dim + np.arange(heads.head_dim)[None, :]
        for t, (p, page) in enumerate(zip(pos, pages)):
            for kind, r in ((K, k_rows), (V, v_rows)):
                base = layout.index(page, layer, kind, 0, 0, 0) + slot(int(p), page_size) * heads.nkv * heads.head_dim
                pool[base + at] = r[t]

    def run_paged_prefill(q, k, v, q_w, k_w, cos, sin, q_out, pool, *, eps, **kw):
        heads, _ = launcher.check_paged_prefill(q, k, v, q_w, k_w, cos, sin, q_out, pool, **kw)
        pos = kw["start_pos"] + np.arange(heads.num_tokens)
        qr, kr, vr = rows(q, k, v, q_w, k_w, cos, sin, pos, kw["rotary_dim"])
        q_out[:heads.num_tokens] = qr
        pages = [int(kw["page_indices"][p // kw["page_size"] - kw["page_origin"]]) for p in pos]
        store(heads, pool, kw["page_size"], kw["num_layers"], kw["layer"], pos, pages, kr, vr)

    def run_paged_decode(q, k, v, q_w, k_w, cos, sin, q_out, pool, *, eps, **kw):
        heads, _, pos = launcher.check_paged_decode(q, k, v, q_w, k_w, cos, sin, q_out, pool, **kw)
        qr, kr, vr = rows(q, k, v, q_w, k_w, cos, sin, pos, kw["rotary_dim"])
        q_out[:heads.num_tokens] = qr
        pages = [int(kw["page_indices"][kw["page_indptr"][b] + p // kw["page_size"] - kw["page_origins"][b]])
                 for b, p in enumerate(pos)]
        store(heads, pool, kw["page_size"], kw["num_layers"], kw["layer"], pos, pages, kr, vr)

    for name, fn in (("run_flat", run_flat), ("run_paged_prefill", run_paged_prefill),
                     ("run_paged_decode", run_paged_decode)):
        monkeypatch.setattr(launcher, name, fn)
    return qk


def test_the_sweep_chain_holds_for_emulated_arms_at_every_preset_and_some_boundaries(monkeypatch):
    from gates.test_qk_rope_sweep import QK_ROPE_SHAPES

    qk = _emulated_arms(monkeypatch)
    boundaries = QK_ROPE_SHAPES.boundary_cases()
    for shape in [dict(p.shape) for p in QK_ROPE_SHAPES.presets] + boundaries[::7] + boundaries[-3:]:
        s = qk.sweep_shape(shape)
        assert s.scenario.positions[-1] == s.cos_max_pos - 1 and s.nq == shape["NKV"] * shape["G"]
        qk.chain_holds_at(qk.sweep_data(s, on_device=False), s.scenario)


def test_the_sweep_chain_fails_a_page_slot_taken_by_mask_at_a_page_size_not_a_power_of_two(monkeypatch):
    from harness.library.bits import BitsMismatch

    qk = _emulated_arms(monkeypatch, slot=lambda pos, page_size: pos & (page_size - 1))
    shape = {"HD": 256, "R": 2, "NKV": 1, "G": 1, "T": 1, "P": 3, "CTX": 4, "L": 1}
    s = qk.sweep_shape(shape)
    with pytest.raises(BitsMismatch, match=r"pool \(paged prefill vs flat values at layout addresses"):
        qk.chain_holds_at(qk.sweep_data(s, on_device=False), s.scenario)
    s = qk.sweep_shape({**shape, "P": 4})
    qk.chain_holds_at(qk.sweep_data(s, on_device=False), s.scenario)   # a power of two: the mask is the modulo
