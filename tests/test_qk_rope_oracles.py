"""Host-only tests of the QK-RoPE oracles (designed inputs, closed form, paged layout,
scenario metadata) and of the launcher's refusal messages. No GPU needed."""

import numpy as np
import pytest

from harness.dtypes import bf16
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

