"""QK RMSNorm + RoPE, head size 512: anchors, links, refusals, traps.

No V input: the V slot is the K = V fork (the raw K row, weightless, unrotated).

Chain: closed form -> flat arm -> paged prefill -> paged decode (docs/qk_rope.md).
One anchor: rotary_dim 128 < 512 puts rope-lo, rope-hi and the pass-through tail in
one run. The links run at the same rotary_dim, the production configuration.
"""

import pytest

from gates import _qk_rope as qk

HEAD_DIM = 512
LINK_ROTARY_DIM = 128


@pytest.mark.gpu
@pytest.mark.anchor
def test_flat_arm_matches_closed_form_over_rope_lo_rope_hi_and_tail_rotary_128():
    data = qk.device_data(HEAD_DIM, 128)
    assert 0 < data.rotary_dim < data.head_dim, "this anchor covers rope-lo, rope-hi and the tail at once"
    qk.flat_matches_closed_form(data)


@pytest.mark.gpu
@pytest.mark.link
def test_paged_prefill_lands_flat_values_at_layout_addresses():
    qk.prefill_lands_flat_values_at_layout_addresses(qk.device_data(HEAD_DIM, LINK_ROTARY_DIM))


@pytest.mark.gpu
@pytest.mark.link
def test_paged_decode_equals_paged_prefill_over_the_same_positions():
    qk.decode_equals_prefill_over_the_same_positions(qk.device_data(HEAD_DIM, LINK_ROTARY_DIM))


@pytest.mark.gpu
@pytest.mark.link
def test_row_offset_serves_only_the_suffix():
    qk.row_offset_serves_only_the_suffix(qk.device_data(HEAD_DIM, LINK_ROTARY_DIM))


@pytest.mark.gpu
@pytest.mark.anchor
def test_flat_arm_matches_closed_form_where_eps_matters_on_tiny_and_zero_heads():
    # Where eps matters: every element +-2^-10 with eps = 3 * 2^-20 (exact: inv_rms =
    # 512), some heads the zero vector (outputs zero only while eps is there), 66 jobs.
    qk.flat_matches_closed_form_where_eps_matters(qk.eps_device_data(HEAD_DIM, LINK_ROTARY_DIM, zeros=True))


@pytest.mark.gpu
@pytest.mark.link
def test_paged_prefill_from_window_origin_page_zero_lands_flat_values_at_layout_addresses():
    # Tiny heads, so eps counts in the paged norms too: origin page 0, a junk entry
    # before the window, 66 jobs with a spare q_out row past them.
    qk.origin_zero_prefill_lands_flat_values_at_layout_addresses(qk.eps_device_data(HEAD_DIM, LINK_ROTARY_DIM))


@pytest.mark.gpu
@pytest.mark.link
def test_paged_decode_with_origin_zero_tokens_equals_paged_prefill():
    # Tokens 0-2 have window origin page 0, the rest 1 and 2.
    qk.origin_zero_decode_equals_prefill(qk.eps_device_data(HEAD_DIM, LINK_ROTARY_DIM))


@pytest.mark.gpu
@pytest.mark.link
@pytest.mark.names_faults  # a guard that fires on this valid metadata fails it by its own assertion
def test_device_guards_admit_valid_metadata_at_their_boundaries():
    # Pages 0 and num_pages - 1, CSR begin 0 and end = length, origin 0, rows on their origin
    # page, page size 1: a trap here fails the gate by assertion (a guard rejecting valid input).
    qk.guards_admit_valid_boundary_metadata(qk.eps_device_data(HEAD_DIM, LINK_ROTARY_DIM))


@pytest.mark.refusal
@pytest.mark.parametrize("refusal", qk.REFUSALS, ids=[r.id for r in qk.REFUSALS])
def test_launcher_refuses_bad_arguments_before_any_launch(refusal):
    refusal.check(HEAD_DIM)


@pytest.mark.gpu
@pytest.mark.trap
def test_device_guard_fires_on_an_out_of_range_page_id():
    qk.launch_with_out_of_range_page_id(qk.device_data(HEAD_DIM, LINK_ROTARY_DIM))


@pytest.mark.gpu
@pytest.mark.trap
def test_device_guard_fires_on_a_csr_end_past_the_page_indices():
    qk.launch_with_csr_end_past_the_indices(qk.device_data(HEAD_DIM, LINK_ROTARY_DIM))


@pytest.mark.gpu
@pytest.mark.trap
def test_device_guard_fires_on_a_row_before_its_window_origin():
    qk.launch_with_row_before_origin(qk.device_data(HEAD_DIM, LINK_ROTARY_DIM))


@pytest.mark.gpu
@pytest.mark.trap
def test_device_guard_fires_on_a_row_past_its_window():
    qk.launch_with_row_past_its_window(qk.device_data(HEAD_DIM, LINK_ROTARY_DIM))


@pytest.mark.gpu
@pytest.mark.trap
def test_device_guard_fires_on_a_negative_window_origin():
    qk.launch_with_negative_window_origin(qk.device_data(HEAD_DIM, LINK_ROTARY_DIM))


@pytest.mark.gpu
@pytest.mark.trap
def test_device_guard_fires_on_a_negative_csr_begin():
    qk.launch_with_negative_csr_begin(qk.device_data(HEAD_DIM, LINK_ROTARY_DIM))


@pytest.mark.gpu
@pytest.mark.trap
def test_device_guard_fires_on_a_negative_page_size():
    # The launcher refuses page_size <= 0, so this launches past its checks (docs/qk_rope.md).
    qk.launch_with_negative_page_size(qk.device_data(HEAD_DIM, LINK_ROTARY_DIM))


@pytest.mark.gpu
@pytest.mark.anchor
@pytest.mark.memory_safety
def test_flat_arm_reads_and_writes_nothing_outside_its_buffers():
    # The flat anchor (rotary_dim 128: rope-lo, rope-hi and the tail) with
    # every input between NaN fences and every output between filler guards. A read or a
    # store a little outside shows by assertion; one further away faults, and a fault here
    # is this gate's verdict too (docs/mutation.md, Verdicts).
    qk.flat_reads_and_writes_nothing_outside_its_buffers(qk.device_data(HEAD_DIM, 128))


@pytest.mark.gpu
@pytest.mark.link
@pytest.mark.memory_safety
def test_paged_prefill_reads_and_writes_nothing_outside_its_buffers():
    # The prefill link with fenced inputs, a fenced window (page id -1 past both
    # ends, which the page-id guard refuses), and q_out and the pool between filler guards.
    qk.prefill_reads_and_writes_nothing_outside_its_buffers(qk.device_data(HEAD_DIM, LINK_ROTARY_DIM))
