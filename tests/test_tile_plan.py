"""The kernels' tile plan: compacted lists of key tiles with PARTIAL flags (CPU check)."""

import pytest
import torch

from flashmask3.optimized import make_tile_plan
from flashmask3.optimized.tile_plan import full_mask
from flashmask3.reference import PARTIAL, SKIP, masks


@pytest.mark.parametrize("name", ["causal", "document", "random_eviction", "global_sliding_window"])
@pytest.mark.parametrize("seqlen", [1024, 1000])
def test_lists_every_non_skipped_tile_in_order_with_its_flag(name, seqlen):
    mask = masks.build(name, seqlen, batch=2, heads=2)
    classes = mask.block_classes(128, 128).classes
    plan = make_tile_plan(mask, 128, 128)
    tn = classes.shape[-1]
    for b in range(classes.shape[0]):
        for h in range(classes.shape[1]):
            for m in range(classes.shape[2]):
                count = int(plan.counts[b, h, m])
                listed = plan.tiles[b, h, m, :count]
                kept = (classes[b, h, m] != SKIP).nonzero().flatten()
                assert torch.equal(listed >> 1, kept.to(torch.int32))
                partial = classes[b, h, m, kept] == PARTIAL
                if seqlen % 128:  # the ragged last key tile always gets the bounds check
                    partial |= kept == tn - 1
                assert torch.equal((listed & 1).bool(), partial)


def test_ablation_without_skipping_lists_every_tile():
    mask = masks.build("causal_document", 1024)
    plan = make_tile_plan(mask, 128, 128, skip_tiles=False)
    assert bool((plan.counts == 8).all())
    skipped = mask.block_classes(128, 128).classes == SKIP
    flags = torch.zeros_like(skipped)
    flags.scatter_(-1, (plan.tiles >> 1).long(), (plan.tiles & 1).bool())
    assert bool(flags[skipped].all())  # fully masked tiles come back as PARTIAL: masked, not skipped


def test_full_mask_has_no_partial_tile_but_the_ragged_one():
    plan = make_tile_plan(full_mask(1, 300, 300, "cpu"), 128, 128)
    assert plan.counts.flatten().tolist() == [3, 3, 3]
    assert (plan.tiles[0, 0, 0, :3] & 1).tolist() == [0, 0, 1]


@pytest.mark.parametrize("name", ["causal", "share_question", "random_eviction"])
@pytest.mark.parametrize("seqlen", [1024, 1000])
def test_by_key_lists_query_tiles_with_flag_and_dq_rank(name, seqlen):
    """The backward's plan: per key tile its query tiles in order, and in bits 16+ the key tile's
    position among the key tiles of that query tile (the deterministic dQ order)."""
    mask = masks.build(name, seqlen, batch=1, heads=2)
    classes = mask.block_classes(64, 128).classes
    plan = make_tile_plan(mask, 64, 128, by_key=True)
    forward = make_tile_plan(mask, 64, 128)
    tn = classes.shape[-1]
    for h in range(classes.shape[1]):
        for n in range(tn):
            count = int(plan.counts[0, h, n])
            listed = plan.tiles[0, h, n, :count]
            kept = (classes[0, h, :, n] != SKIP).nonzero().flatten()
            assert torch.equal((listed & 0xFFFF) >> 1, kept.to(torch.int32))
            partial = classes[0, h, kept, n] == PARTIAL
            if seqlen % 128 and n == tn - 1:
                partial[:] = True
            assert torch.equal((listed & 1).bool(), partial)
            for m, rank in zip(kept.tolist(), (listed >> 16).tolist()):
                assert int(forward.tiles[0, h, m, rank]) >> 1 == n
