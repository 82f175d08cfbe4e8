"""What the kernels take of the mask: key-block min/max (the mask role's input), the tile classes
the mask role computes, the deterministic backward's dQ ranks and the backward's longest-first
launch order (CPU check)."""

import pytest
import torch
from flashmask3.optimized import tile_plan
from flashmask3.optimized.segments import segment_plan
from flashmask3.optimized.tile_plan import (
    backward_cta_steps,
    block_minmax,
    cached_longest_first,
    dq_ranks,
    forward_tile_steps,
    full_mask,
    longest_first,
    tile_classes,
)
from flashmask3.reference import PARTIAL, SKIP, UNMASKED, ColumnMask, masks


@pytest.mark.parametrize("name", ["causal", "sliding_window", "document", "random_eviction"])
@pytest.mark.parametrize("seqlen", [1024, 1000])
def test_block_minmax_is_the_min_then_max_of_each_column_per_key_tile(name, seqlen):
    mask = masks.build(name, seqlen, batch=2, heads=2)
    idx = mask.startend_row_indices
    bounds = block_minmax(mask, 128)
    width = idx.shape[-1]
    assert bounds.shape == (*idx.shape[:2], -(-seqlen // 128), 2 * width) and bounds.dtype == torch.int32
    for n in range(bounds.shape[2]):
        keys = idx[:, :, n * 128 : (n + 1) * 128]
        assert torch.equal(bounds[:, :, n, :width], keys.amin(2))
        assert torch.equal(bounds[:, :, n, width:], keys.amax(2))


@pytest.mark.parametrize("seqlen", [1024, 1000])
def test_tile_classes_follow_the_reference_and_check_the_ragged_last_key_tile(seqlen):
    mask = masks.build("document", seqlen, batch=1, heads=1)
    reference = mask.block_classes(64, 128).classes
    classes = tile_classes(mask, 64, 128)
    if seqlen % 128 == 0:
        assert torch.equal(classes, reference)
    else:
        assert torch.equal(classes[..., :-1], reference[..., :-1])
        last = reference[..., -1]
        assert torch.equal(classes[..., -1], torch.where(last == SKIP, last, torch.full_like(last, PARTIAL)))


def test_full_mask_has_no_partial_tile_but_the_ragged_one():
    classes = tile_classes(full_mask(1, 300, 300, "cpu"), 128, 128)
    assert classes[0, 0].tolist() == [[UNMASKED, UNMASKED, PARTIAL]] * 3


@pytest.mark.parametrize("name", ["causal", "share_question", "random_eviction"])
@pytest.mark.parametrize("seqlen", [1024, 1000])
def test_dq_rank_counts_the_earlier_key_tiles_a_query_tile_sees(name, seqlen):
    mask = masks.build(name, seqlen, batch=1, heads=2)
    seen = tile_classes(mask, 64, 128) != SKIP
    ranks = dq_ranks(mask, 64, 128)
    _, heads, tm, tn = seen.shape
    assert ranks.shape == (1, heads, tn, tm)
    for h in range(heads):
        for m in range(tm):
            for n in range(tn):
                assert int(ranks[0, h, n, m]) == int(seen[0, h, m, :n].sum())


@pytest.mark.parametrize("name, mask_batch", [("random_eviction", 2), ("causal_document", 2), ("document", 1)])
def test_longest_first_orders_the_backward_ctas_by_their_steps(name, mask_batch):
    """Batch 2, 4 query heads on 2 KV heads, 1000 keys (8 key tiles, the last ragged), masks per
    head (random_eviction) or shared, per batch element or broadcast: each CTA's steps (non-SKIP
    query tiles of 64 rows, summed over its KV head's query heads, each reading its mask head)
    counted tile by tile; the order is a permutation, most steps first, ties in grid order."""
    mask = masks.build(name, 1000, batch=mask_batch, heads=4, seed=3)
    order = longest_first(backward_cta_steps(mask, 2, 4, 2, 64, 128))
    classes = tile_classes(mask, 64, 128)
    tiles_n = classes.shape[-1]
    steps = []
    for b in range(2):
        for kv_head in range(2):
            for n in range(tiles_n):
                heads = [(2 * kv_head + g) // (4 // mask.heads) for g in range(2)]
                steps.append(sum(int((classes[b % mask.batch, h, :, n] != SKIP).sum()) for h in heads))
    assert order.dtype == torch.int32 and sorted(order.tolist()) == list(range(2 * 2 * tiles_n))
    expected = sorted(range(len(steps)), key=lambda cta: (-steps[cta], cta))
    assert order.tolist() == expected
    assert len(set(steps)) > 3  # the masks make the CTAs' work differ


@pytest.mark.parametrize("name, mask_batch", [("random_eviction", 2), ("share_question", 1)])
def test_longest_first_orders_the_forward_work_tiles_by_their_steps(name, mask_batch):
    """Batch 2, 4 query heads, 1000 queries in tiles of 192 (6, the last ragged): each work tile's
    steps (its non-SKIP key tiles, its head reading its mask head), in work-tile order (query tile
    fastest, then head, then batch); the order is a permutation, most steps first, ties in order."""
    mask = masks.build(name, 1000, batch=mask_batch, heads=4, seed=5)
    classes = tile_classes(mask, 192, 128)
    tiles_m = classes.shape[2]
    steps = [
        int((classes[b % mask.batch, h // (4 // mask.heads), m] != SKIP).sum())
        for b in range(2)
        for h in range(4)
        for m in range(tiles_m)
    ]
    assert forward_tile_steps(mask, 2, 4, 192, 128).tolist() == steps
    order = longest_first(forward_tile_steps(mask, 2, 4, 192, 128))
    assert order.dtype == torch.int32
    assert order.tolist() == sorted(range(len(steps)), key=lambda tile: (-steps[tile], tile))
    assert len(set(steps)) > 2


def test_the_granules_of_a_segment_plan_with_no_real_row_take_no_forward_step():
    """A capped plan's granules past the segments hold no real row: the mask role draws past them,
    so the longest-first order counts no step for them (and draws them last)."""
    mask = masks.build("causal_blockwise", 1000)  # no segments: rows past the last see keys
    plan = segment_plan(mask, max_boundaries=2)
    assert plan.seqlen == 1280 and plan.tile_rows[0, 0, :, 1].tolist() == [128] * 7 + [104, 0, 0]
    plain = forward_tile_steps(plan.mask, 1, 2, 128, 128)
    steps = forward_tile_steps(plan.mask, 1, 2, 128, 128, plan.tile_rows)
    real = (plan.tile_rows[0, 0, :, 1] > 0).repeat(2)
    assert torch.equal(steps[real], plain[real]) and not steps[~real].any() and plain[~real].all()
    assert sorted(longest_first(steps)[-4:].tolist()) == [8, 9, 18, 19]


@pytest.mark.parametrize("buckets", [1, 3, 8])
def test_length_classes_go_longest_first_each_in_its_own_order(buckets):
    """`longest_first(steps, buckets)`: class c holds the units with steps in [c, c + 1) x (max + 1)
    / buckets; the highest class first, each class in the units' order (a permutation)."""
    steps = torch.tensor([3, 40, 0, 17, 40, 39, 5, 22, 9, 40, 1], dtype=torch.int32)
    order = longest_first(steps, buckets).tolist()
    classes = [int(s) * buckets // 41 for s in steps.tolist()]
    assert order == sorted(range(len(steps)), key=lambda unit: (-classes[unit], unit))
    if buckets == 1:
        assert order == list(range(len(steps)))  # one class: the units' own order


def test_no_units_give_an_empty_order_in_classes_too():
    assert longest_first(torch.zeros(0, dtype=torch.int32), 16).tolist() == []


def test_an_order_in_length_classes_is_kept_apart_from_the_exact_one():
    mask = masks.build("causal_document", 1000, seed=1)
    steps = lambda: backward_cta_steps(mask, 1, 4, 2, 64, 128)  # noqa: E731
    exact, classes = cached_longest_first(mask, "bwd", steps), cached_longest_first(mask, "bwd", steps, 2)
    assert torch.equal(exact, longest_first(steps())) and torch.equal(classes, longest_first(steps(), 2))
    assert cached_longest_first(mask, "bwd", steps, 2) is classes


def test_an_order_is_sorted_once_per_mask_until_its_boundaries_change():
    """`cached_longest_first`: the second call with the same mask and key returns the kept order
    without computing the steps, also through another ColumnMask on the same boundaries tensor (as
    the custom ops pass it); another key, another (even equal) mask or an in-place change of the
    boundaries sorts again, and the new order follows the new boundaries."""
    mask = masks.build("causal_document", 1000, batch=1, heads=1, seed=3)
    calls = []

    def steps():
        calls.append(1)
        return backward_cta_steps(mask, 1, 2, 2, 64, 128)

    first = cached_longest_first(mask, "bwd", steps)
    assert cached_longest_first(mask, "bwd", steps) is first and len(calls) == 1
    rewrapped = ColumnMask._unchecked(mask.startend_row_indices, mask.causal, mask.seqlen_q)
    assert cached_longest_first(rewrapped, "bwd", steps) is first and len(calls) == 1
    cached_longest_first(mask, "other", steps)
    other_mask = masks.build("causal_document", 1000, batch=1, heads=1, seed=3)
    cached_longest_first(other_mask, "bwd", steps)
    assert len(calls) == 3
    kept = len(tile_plan._per_mask)
    del other_mask  # its orders go with it
    assert len(tile_plan._per_mask) == kept - 1
    mask.startend_row_indices[..., 0] = 0  # every key masked from row 0 on: no steps anywhere
    changed = cached_longest_first(mask, "bwd", lambda: backward_cta_steps(mask, 1, 2, 2, 64, 128))
    assert changed is not first and changed.tolist() == list(range(len(first)))


def test_orders_of_inference_masks_and_of_boundaries_given_another_shape():
    """Inference tensors have no version: their order is kept on their shape and storage; a
    boundaries tensor given another shape in place (`.data`, no version bump) sorts again, for its
    new grid."""
    with torch.inference_mode():
        mask = masks.build("causal_document", 1000, batch=1, heads=1, seed=3)
    steps = lambda: backward_cta_steps(mask, 1, 2, 2, 64, 128)  # noqa: E731
    first = cached_longest_first(mask, "bwd", steps)
    assert cached_longest_first(mask, "bwd", steps) is first and len(first) == 2 * 8
    grown = masks.build("causal_document", 1500, batch=1, heads=1, seed=3)
    wider = masks.build("causal_document", 1000, batch=1, heads=1, seed=3)
    before = cached_longest_first(wider, "bwd", lambda: torch.arange(16, dtype=torch.int32))
    version = wider.startend_row_indices._version
    wider.startend_row_indices.data = grown.startend_row_indices.clone()
    assert wider.startend_row_indices._version == version
    after = cached_longest_first(wider, "bwd", lambda: torch.arange(24, dtype=torch.int32))
    assert len(before) == 16 and len(after) == 24


def test_the_schedule_model_puts_a_long_cta_last_in_grid_order_and_first_longest_first():
    """tools/tail_model.py: four 1-step CTAs then a 4-step one on 2 SMs (no fixed cost): in grid
    order the long one starts at 2 and ends at 6, longest first it ends at 4 = the ideal."""
    import tail_model

    assert tail_model.wasted(torch.tensor([1, 1, 1, 1, 4]), sms=2, fixed_us=0.0, step_us=1.0) == (1.5, 1.0)


def test_the_footprint_counts_what_the_units_running_together_read():
    """tools/tail_model.py: two units reading {1, 2} and {2, 3} share one pair; run side by side
    (two SMs) they read 3 pairs at every sampled time, one after the other (one SM) 2."""
    import tail_model

    reads = [{1, 2}, {2, 3}]
    side_by_side = tail_model.schedule([1.0, 1.0], sms=2)
    one_after_the_other = tail_model.schedule([1.0, 1.0], sms=1)
    assert side_by_side == [(0.0, 1.0), (0.0, 1.0)] and one_after_the_other == [(0.0, 1.0), (1.0, 2.0)]
    assert tail_model.footprint(side_by_side, reads) == 3
    assert tail_model.footprint(one_after_the_other, reads) == 2


def test_the_model_splits_a_long_cta_over_its_query_range():
    """tools/tail_model.py `split_long`: 3 steps stay one CTA, 5 become two (each the fixed and the
    reduce cost plus half the steps), 9 become four, in grid order."""
    import tail_model

    units = tail_model.split_long([3, 5, 9], over=4, fixed_us=1.0, step_us=2.0, reduce_us=0.5)
    assert units == [(0, 7.0), (1, 6.5), (1, 6.5), (2, 6.0), (2, 6.0), (2, 6.0), (2, 6.0)]
