"""QK RMSNorm + RoPE at head sizes 256 and 512: anchors, links, refusals, traps.

Chain: closed form -> flat arm -> paged prefill -> paged decode (docs/qk_rope.md). Each
gate runs once per head size, its id naming the size ([hd256], [hd512]); the bodies live
in gates/_qk_rope.py. HD 256 reads a V input; HD 512 has none: its V slot is the K = V
fork (the raw K row, weightless, unrotated).

The links run at each size's production rotary_dim (256 at HD 256, 128 at HD 512). The
anchor at rotary_dim 128 < HD puts rope-lo, rope-hi and the pass-through tail in one run;
HD 256 has a second anchor at rotary_dim == HD, where no thread reaches the tail: that is
different control flow.
"""

import pytest

from gates import _qk_rope as qk

HEAD_SIZES = (256, 512)
LINK_ROTARY_DIM = {256: 256, 512: 128}  # the production configuration of each head size


def head_id(head_dim: int) -> str:
    return f"hd{head_dim}"


each_head_size = pytest.mark.parametrize("head_dim", HEAD_SIZES, ids=head_id)


@pytest.mark.gpu
@pytest.mark.anchor
@pytest.mark.parametrize("head_dim", [256], ids=head_id)
def test_flat_arm_matches_closed_form_under_full_rotation_rotary_256(head_dim):
    qk.flat_matches_closed_form(qk.device_data(head_dim, 256))


@pytest.mark.gpu
@pytest.mark.anchor
@each_head_size
def test_flat_arm_matches_closed_form_over_rope_lo_rope_hi_and_tail_rotary_128(head_dim):
    data = qk.device_data(head_dim, 128)
    assert 0 < data.rotary_dim < data.head_dim, "this anchor covers rope-lo, rope-hi and the tail at once"
    qk.flat_matches_closed_form(data)


@pytest.mark.gpu
@pytest.mark.link
@each_head_size
def test_paged_prefill_lands_flat_values_at_layout_addresses(head_dim):
    qk.prefill_lands_flat_values_at_layout_addresses(qk.device_data(head_dim, LINK_ROTARY_DIM[head_dim]))


@pytest.mark.gpu
@pytest.mark.link
@each_head_size
def test_paged_decode_equals_paged_prefill_over_the_same_positions(head_dim):
    qk.decode_equals_prefill_over_the_same_positions(qk.device_data(head_dim, LINK_ROTARY_DIM[head_dim]))


@pytest.mark.gpu
@pytest.mark.link
@each_head_size
def test_row_offset_serves_only_the_suffix(head_dim):
    qk.row_offset_serves_only_the_suffix(qk.device_data(head_dim, LINK_ROTARY_DIM[head_dim]))


@pytest.mark.gpu
@pytest.mark.anchor
@each_head_size
def test_flat_arm_matches_closed_form_where_eps_matters_on_tiny_and_zero_heads(head_dim):
    # Where eps matters: every element +-2^-10 with eps = 3 * 2^-20 (exact: inv_rms =
    # 512), some heads the zero vector (outputs zero only while eps is there), 66 jobs.
    qk.flat_matches_closed_form_where_eps_matters(qk.eps_device_data(head_dim, LINK_ROTARY_DIM[head_dim], zeros=True))


@pytest.mark.gpu
@pytest.mark.link
@each_head_size
def test_paged_prefill_from_window_origin_page_zero_lands_flat_values_at_layout_addresses(head_dim):
    # Tiny heads, so eps counts in the paged norms too: origin page 0, a junk entry
    # before the window, 66 jobs with a spare q_out row past them.
    qk.origin_zero_prefill_lands_flat_values_at_layout_addresses(
        qk.eps_device_data(head_dim, LINK_ROTARY_DIM[head_dim]))


@pytest.mark.gpu
@pytest.mark.link
@each_head_size
def test_paged_decode_with_origin_zero_tokens_equals_paged_prefill(head_dim):
    # Tokens 0-2 have window origin page 0, the rest 1 and 2.
    qk.origin_zero_decode_equals_prefill(qk.eps_device_data(head_dim, LINK_ROTARY_DIM[head_dim]))


@pytest.mark.gpu
@pytest.mark.link
@pytest.mark.names_faults  # a guard that fires on this valid metadata fails it by its own assertion
@each_head_size
def test_device_guards_admit_valid_metadata_at_their_boundaries(head_dim):
    # Pages 0 and num_pages - 1, CSR begin 0 and end = length, origin 0, rows on their origin
    # page, page size 1: a trap here fails the gate by assertion (a guard rejecting valid input).
    qk.guards_admit_valid_boundary_metadata(qk.eps_device_data(head_dim, LINK_ROTARY_DIM[head_dim]))


@pytest.mark.refusal
@pytest.mark.parametrize("refusal", qk.REFUSALS, ids=[r.id for r in qk.REFUSALS])
@each_head_size
def test_launcher_refuses_bad_arguments_before_any_launch(head_dim, refusal):
    refusal.check(head_dim)


@pytest.mark.gpu
@pytest.mark.trap
@each_head_size
def test_device_guard_fires_on_an_out_of_range_page_id(head_dim):
    qk.launch_with_out_of_range_page_id(qk.device_data(head_dim, LINK_ROTARY_DIM[head_dim]))


@pytest.mark.gpu
@pytest.mark.trap
@each_head_size
def test_device_guard_fires_on_a_csr_end_past_the_page_indices(head_dim):
    qk.launch_with_csr_end_past_the_indices(qk.device_data(head_dim, LINK_ROTARY_DIM[head_dim]))


@pytest.mark.gpu
@pytest.mark.trap
@each_head_size
def test_device_guard_fires_on_a_row_before_its_window_origin(head_dim):
    qk.launch_with_row_before_origin(qk.device_data(head_dim, LINK_ROTARY_DIM[head_dim]))


@pytest.mark.gpu
@pytest.mark.trap
@each_head_size
def test_device_guard_fires_on_a_row_past_its_window(head_dim):
    qk.launch_with_row_past_its_window(qk.device_data(head_dim, LINK_ROTARY_DIM[head_dim]))


@pytest.mark.gpu
@pytest.mark.trap
@each_head_size
def test_device_guard_fires_on_a_negative_window_origin(head_dim):
    qk.launch_with_negative_window_origin(qk.device_data(head_dim, LINK_ROTARY_DIM[head_dim]))


@pytest.mark.gpu
@pytest.mark.trap
@each_head_size
def test_device_guard_fires_on_a_negative_csr_begin(head_dim):
    qk.launch_with_negative_csr_begin(qk.device_data(head_dim, LINK_ROTARY_DIM[head_dim]))


@pytest.mark.gpu
@pytest.mark.trap
@each_head_size
def test_device_guard_fires_on_a_negative_page_size(head_dim):
    # The launcher refuses page_size <= 0, so this launches past its checks (docs/qk_rope.md).
    qk.launch_with_negative_page_size(qk.device_data(head_dim, LINK_ROTARY_DIM[head_dim]))


@pytest.mark.gpu
@pytest.mark.anchor
@pytest.mark.memory_safety
@each_head_size
def test_flat_arm_reads_and_writes_nothing_outside_its_buffers(head_dim):
    # The flat anchor (rotary_dim 128: rope-lo, rope-hi and the tail) with
    # every input between NaN fences and every output between filler guards. A read or a
    # store a little outside shows by assertion; one further away faults, and a fault here
    # is this gate's verdict too (docs/mutation.md, Verdicts).
    qk.flat_reads_and_writes_nothing_outside_its_buffers(qk.device_data(head_dim, 128))


@pytest.mark.gpu
@pytest.mark.link
@pytest.mark.memory_safety
@each_head_size
def test_paged_prefill_reads_and_writes_nothing_outside_its_buffers(head_dim):
    # The prefill link with fenced inputs, a fenced window (page id -1 past both
    # ends, which the page-id guard refuses), and q_out and the pool between filler guards.
    qk.prefill_reads_and_writes_nothing_outside_its_buffers(qk.device_data(head_dim, LINK_ROTARY_DIM[head_dim]))
