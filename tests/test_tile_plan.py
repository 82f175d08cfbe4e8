"""What the kernels take of the mask: key-block min/max (the mask role's input), the tile classes
the mask role computes, and the deterministic backward's dQ ranks (CPU check)."""

import pytest
import torch
from flashmask3.optimized.tile_plan import block_minmax, dq_ranks, full_mask, tile_classes
from flashmask3.reference import PARTIAL, SKIP, UNMASKED, masks


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
