"""What the kernels take of the mask: key-block min/max (the mask role's input), the tile classes
the mask role computes, the deterministic backward's dQ ranks, the backward's longest-first
launch order and its split CTAs' work table (CPU check)."""

import pytest
import torch
from flashmask3.optimized import tile_plan
from flashmask3.optimized.segments import segment_plan
from flashmask3.optimized.tile_plan import (
    backward_cta_steps,
    backward_split_plan,
    block_minmax,
    cached_block_minmax,
    cached_longest_first,
    dq_ranks,
    forward_tile_steps,
    full_mask,
    longest_first,
    split_parts,
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


def test_the_block_minmax_is_kept_per_mask_and_recomputed_after_an_in_place_change():
    """`cached_block_minmax`: the layers' calls with one mask get the same tensor; an in-place
    change of the boundaries (a new version) gives the new min/max; an inference tensor (no
    version) is computed at every call."""
    mask = masks.build("causal_document", 1000, batch=1, heads=1, seed=3)
    first = cached_block_minmax(mask, 128)
    assert torch.equal(first, block_minmax(mask, 128)) and cached_block_minmax(mask, 128) is first
    assert torch.equal(cached_block_minmax(mask, 64), block_minmax(mask, 64))  # kept per tile size
    mask.startend_row_indices[..., 5, 0] = 999
    changed = cached_block_minmax(mask, 128)
    assert changed is not first and torch.equal(changed, block_minmax(mask, 128))
    with torch.inference_mode():
        frozen = ColumnMask(mask.startend_row_indices.clone(), True, 1000)
        assert cached_block_minmax(frozen, 128) is not cached_block_minmax(frozen, 128)


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
    classes = tile_classes(full_mask(300, 300, "cpu"), 128, 128)
    assert classes[0, 0].tolist() == [[UNMASKED, UNMASKED, PARTIAL]] * 3


def test_the_full_mask_of_a_call_without_a_mask_is_not_validated(monkeypatch):
    """The kernels stand a full mask in for no mask: built unchecked, since the validation reads
    the boundaries back (a wait for the GPU per call), and equal to the checked one."""
    from flashmask3.reference import ColumnMask

    built = full_mask(300, 200, "cpu")
    checked = ColumnMask(built.startend_row_indices.clone(), False, 300)
    monkeypatch.setattr(ColumnMask, "__post_init__", lambda self: pytest.fail("validated"))
    assert full_mask(300, 200, "cpu") == checked


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


def test_the_ctas_that_would_end_past_the_deadline_split():
    """`split_parts` on 3 SMs, six 1-step CTAs then a 10-step one: costs 3 x 6 then 12, ideal 30 / 3
    = 10. The last starts at 18 / 3 = 6 and would end at 18 (half of it at 12), the others by 8:
    only it splits, in 4 with no slack, in 2 with 20% (deadline 12), not with 100% (deadline 20)."""
    steps = torch.tensor([1] * 6 + [10], dtype=torch.int32)
    assert split_parts(steps, 3, 4, 0, 28).tolist() == [1] * 6 + [4]
    assert split_parts(steps, 3, 2, 0, 28).tolist() == [1] * 6 + [2]
    assert split_parts(steps, 3, 4, 20, 28).tolist() == [1] * 6 + [2]
    assert split_parts(steps, 3, 4, 100, 28).tolist() == [1] * 7
    assert split_parts(steps, 3, 4, 0, 3).tolist() == [1] * 7  # its 4 parts pass the 3 slots
    # Slack -100: a deadline of 0, every CTA splits up to the slots, the front first.
    assert split_parts(steps, 3, 4, -100, 9).tolist() == [4, 4] + [1] * 5
    assert split_parts(steps, 3, 2, -100, 5).tolist() == [2, 2] + [1] * 5
    # 2 SMs, the long CTA first: ideal 27 / 2 = 13.5, it ends at 12; the last 1-step one, starting
    # at 24 / 2 = 12, would end at 15 (half of it at 13.5, not past): it splits in 2.
    steps = torch.tensor([10] + [1] * 5, dtype=torch.int32)
    parts = split_parts(steps, 2, 4, 0, 8)
    assert parts.dtype == torch.int32 and parts.tolist() == [1] * 5 + [2]
    with pytest.raises(ValueError, match="max_parts"):
        split_parts(steps, 2, 3, 0, 8)


def per_head_causal_documents(seqlen: int, heads: int) -> ColumnMask:
    """A causal-document mask with its own documents per head (seeds 0..heads-1)."""
    built = [masks.build("causal_document", seqlen, seed=seed) for seed in range(heads)]
    return ColumnMask(torch.cat([m.startend_row_indices for m in built], dim=1), True, seqlen)


def check_split_plan(mask, batch, q_heads, kv_heads, sms, max_parts, slack_pct, slots) -> list[int]:
    """Check `backward_split_plan` (tiles 64 x 128) against the tile classes read head by head; each
    CTA's parts, in grid order."""
    group, per_mask_head = q_heads // kv_heads, q_heads // mask.heads
    seen = tile_classes(mask, 64, 128) != SKIP  # [Bm, Hm, Tm, Tn]
    tiles_m = seen.shape[2]
    lists = [  # per CTA in grid order, per query head of its group: its non-SKIP query tiles
        [
            seen[b % mask.batch, (h * group + g) // per_mask_head, :, n].nonzero().flatten().tolist()
            for g in range(group)
        ]
        for b in range(batch)
        for h in range(kv_heads)
        for n in range(seen.shape[3])
    ]
    steps = backward_cta_steps(mask, batch, q_heads, kv_heads, 64, 128)
    assert steps.tolist() == [sum(map(len, heads)) for heads in lists]
    table = backward_split_plan(mask, batch, q_heads, kv_heads, 64, 128, sms, max_parts, slack_pct, slots)
    assert table.dtype == torch.int32 and table.is_contiguous() and table.shape == (len(lists) + slots, 4)
    rows = table.tolist()
    live = sum(row[0] >= 0 for row in rows)
    assert rows[live:] == [[-1, 0, 0, -1]] * (len(rows) - live)  # idle rows, only at the end
    ctas = [row[0] for row in rows[:live]]
    assert ctas == sorted(ctas) and set(ctas) == set(range(len(lists)))
    parts = [ctas.count(cta) for cta in range(len(lists))]
    assert parts == split_parts(steps, sms, max_parts, slack_pct, slots).tolist()
    first_slot = 0
    for cta, heads in enumerate(lists):
        own = rows[ctas.index(cta) : ctas.index(cta) + parts[cta]]
        bounds = [lo for _, lo, _, _ in own] + [own[-1][2]]
        assert parts[cta] in (1, 2, 4) and parts[cta] <= max_parts
        assert bounds[0] == 0 and bounds[-1] == tiles_m and bounds == sorted(bounds)
        assert [hi for _, _, hi, _ in own[:-1]] == bounds[1:-1]  # contiguous: no gap, no overlap
        for tiles in heads:  # the parts rebuild each head's list, in order
            assert [m for _, lo, hi, _ in own for m in tiles if lo <= m < hi] == tiles
        totals = [sum(lo <= m < hi for tiles in heads for m in tiles) for _, lo, hi, _ in own]
        assert sum(totals) == steps[cta] and max(totals) - min(totals) <= group
        if parts[cta] == 1:
            assert own[0][3] == -1
        else:  # one counter and consecutive slots per split CTA, after the earlier ones'
            assert [split for *_, split in own] == [first_slot * 16 + p * 4 + parts[cta] - 1 for p in range(parts[cta])]
            first_slot += parts[cta]
    assert first_slot <= slots
    return parts


SPLIT_CASES = {  # mask, batch, q heads, KV heads; CTAs of 4 or 2 parts at 16 SMs and 2% slack
    "gqa": (lambda: masks.build("causal_document", 2048, seed=1), 1, 16, 4, (10, 6)),
    "mha": (lambda: masks.build("document", 2048, seed=2), 1, 8, 8, (6, 5)),
    "gqa per-head": (lambda: per_head_causal_documents(2048, 16), 1, 16, 4, (12, 5)),
    "mha per-head, ragged": (lambda: per_head_causal_documents(1000, 8), 1, 8, 8, (8, 5)),
    "batch 2, batch-1 mask": (lambda: masks.build("share_question", 1000, seed=4), 2, 8, 2, (7, 9)),
}


@pytest.mark.parametrize("case", SPLIT_CASES)
def test_the_split_plan_cuts_the_long_ctas_into_balanced_parts(case):
    """Per case, 16 SMs, 64 slots: with 4 parts at most and 2% slack, some CTAs split (in 4 or in
    2); with 2 parts at most none has more; with slack -100 every CTA splits in `max_parts` until
    the slots run out."""
    build, batch, q_heads, kv_heads, (fours, twos) = SPLIT_CASES[case]
    mask = build()
    parts = check_split_plan(mask, batch, q_heads, kv_heads, 16, 4, 2, 64)
    assert (parts.count(4), parts.count(2)) == (fours, twos)
    assert max(check_split_plan(mask, batch, q_heads, kv_heads, 16, 2, 2, 64)) == 2
    for max_parts in (4, 2):
        parts = check_split_plan(mask, batch, q_heads, kv_heads, 16, max_parts, -100, 64)
        assert parts == [max_parts] * (64 // max_parts) + [1] * (len(parts) - 64 // max_parts)


@pytest.mark.parametrize("name, slots_used", [("causal_document", 366), ("causal", 438), ("full", 312)])
def test_the_split_plan_at_32k_tokens_stays_within_its_slots(name, slots_used):
    """32K tokens, 16 query heads on 4 KV heads, tiles 64 x 128, 132 SMs, 4 parts at most, 2% slack,
    528 slots: the slots used, and each CTA's parts summing to its steps."""
    mask = full_mask(32768, 32768, "cpu") if name == "full" else masks.build(name, 32768, seed=0)
    table = backward_split_plan(mask, 1, 16, 4, 64, 128, 132, 4, 2, 528)
    cta, lo, hi, split = table.unbind(1)
    assert int((split >= 0).sum()) == slots_used <= 528
    seen = (~mask.block_skip(64, 128)).transpose(2, 3)[0, 0].int() * 4  # [Tn, Tm], 4 heads per KV head
    prefix = torch.nn.functional.pad(seen.cumsum(1), (1, 0)).repeat(4, 1)  # [C, Tm + 1]
    live = cta >= 0
    totals = torch.zeros(4 * 256, dtype=torch.int64).index_add_(
        0, cta[live].long(), prefix[cta[live].long(), hi[live].long()] - prefix[cta[live].long(), lo[live].long()]
    )
    assert torch.equal(totals, backward_cta_steps(mask, 1, 16, 4, 64, 128).long())


def test_the_model_splits_the_ctas_that_the_plan_splits():
    """tools/tail_model.py `split_fluid`: on 3 SMs the 10-step CTA after six 1-step ones splits in 4
    (`split_parts`), each part paying the fixed and the reduce cost and a quarter of the steps. At
    32K causal documents (16 query heads on 4 KV heads, 132 SMs, default costs) the makespan over
    the ideal falls from grid order's 1.153 to 1.012."""
    import tail_model

    units = tail_model.split_fluid(torch.tensor([1] * 6 + [10]), 3, fixed_us=1.0, step_us=2.0)
    assert units == [(cta, 3.0) for cta in range(6)] + [(6, 7.0)] * 4
    steps = backward_cta_steps(masks.build("causal_document", 32768, seed=0), 1, 16, 4, 64, 128)
    ideal = (3.4 + 2.5 * steps.double()).sum().item() / 132
    grid = tail_model.makespan((3.4 + 2.5 * steps.double()).tolist(), 132)
    split = tail_model.makespan([duration for _, duration in tail_model.split_fluid(steps, 132, 3.4, 2.5)], 132)
    assert (round(grid / ideal, 3), round(split / ideal, 3)) == (1.153, 1.012)
