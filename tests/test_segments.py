"""Segment-aligned tiles (optimized/segments.py): the virtual mask keeps every real row's mask,
padding is masked, attention through the virtual layout (loaded and stored as the kernels do)
equals attention on the real rows, and aligned tiles take fewer and less often masked key-tile
steps on the document masks (CPU)."""

import pytest
import torch
from conftest import random_column_mask
from flashmask3.optimized.segments import (
    cached_segment_plan,
    kernel_boundaries,
    loaded_rows,
    query_tile_rows,
    segment_plan,
    segment_starts,
    stored_rows,
)
from flashmask3.reference import ColumnMask, masks
from flashmask3.reference.attention import reference_attention

SEGMENTED = ["causal_document", "document", "share_question", "prefix_lm_document", "causal_blockwise", "qk_sparse"]


def _starts(mask: ColumnMask, min_len: int) -> list[int]:
    return segment_starts(mask, min_len)[0, 0].nonzero()[:, 0].tolist()


def test_segments_start_at_the_documents_that_are_long_enough():
    cu_seqlens = torch.tensor([0, 300, 310, 320, 700, 1000], dtype=torch.int32)
    for mask in (ColumnMask.causal_document(cu_seqlens), ColumnMask.document(cu_seqlens)):
        assert _starts(mask, 1) == [0, 300, 310, 320, 700]
        # 10-row documents between two long ones: their boundaries with the long ones stay, the
        # one between them (short on both sides) goes, and they are one segment.
        assert _starts(mask, 128) == [0, 300, 320, 700]
        assert _starts(mask, 400) == [0]
    assert _starts(ColumnMask.sliding_window(1000, 64), 1) == [0]  # every row sees its predecessors


def test_a_key_seen_across_a_boundary_joins_the_segments():
    cu_seqlens = torch.tensor([0, 256, 512, 768], dtype=torch.int32)
    idx = ColumnMask.causal_document(cu_seqlens).startend_row_indices.clone()
    assert _starts(ColumnMask(idx, True, 768), 1) == [0, 256, 512]
    idx[0, 0, 100, 0] = 600  # key 100 is now seen by rows up to 599
    assert _starts(ColumnMask(idx, True, 768), 1) == [0]


def _check_virtual_mask(mask: ColumnMask, granule: int, min_len: int, max_boundaries: int | None = None) -> None:
    plan = segment_plan(mask, granule, min_len, max_boundaries)
    assert plan.seqlen % granule == 0 and plan.tile_rows.dtype == torch.int32
    assert plan.tile_rows.shape == (mask.batch, mask.heads, plan.seqlen // granule, 2)
    real = mask.to_dense()
    virtual = plan.mask.to_dense()
    loaded, stored = loaded_rows(plan), stored_rows(plan)
    starts = segment_starts(mask, min_len)
    if max_boundaries is not None:
        starts &= starts.cumsum(-1) <= max_boundaries + 1
    for b in range(mask.batch):
        for h in range(mask.heads):
            rows = loaded[b, h][stored[b, h]]
            assert torch.equal(rows, torch.arange(mask.seqlen_q))  # every real row stored once, in order
            seen = virtual[b, h]
            assert torch.equal(seen[stored[b, h]][:, stored[b, h]], real[b, h])
            assert not seen[:, ~stored[b, h]].any()  # padding keys: masked for every row
            if int(starts[b, h].sum()) > 1:  # between independent segments, padding rows are masked too
                assert not seen[~stored[b, h]].any()


@pytest.mark.parametrize("max_boundaries", [None, 2])
@pytest.mark.parametrize("name", masks.MASK_NAMES)
@pytest.mark.parametrize("seqlen", [512, 389])
def test_the_virtual_mask_keeps_every_real_rows_mask_and_masks_the_padding(name, seqlen, max_boundaries):
    mask = (
        masks.build(name, seqlen, batch=2, heads=2, num_docs=5)
        if name in SEGMENTED
        else masks.build(name, seqlen, batch=2, heads=2)
    )
    _check_virtual_mask(mask, 32, 32, max_boundaries)


@pytest.mark.parametrize("max_boundaries", [None, 1])
@pytest.mark.parametrize("causal,width", [(True, 1), (True, 2), (False, 2), (False, 4)])
def test_the_virtual_mask_of_random_masks_and_documents_in_every_variant(causal, width, max_boundaries):
    gen = torch.Generator().manual_seed(width + 10 * causal)
    _check_virtual_mask(random_column_mask(gen, 2, 2, 200, 200, causal, width), 16, 1, max_boundaries)
    cu_seqlens = torch.tensor([0, 40, 45, 130, 200], dtype=torch.int32)
    documents = ColumnMask.causal_document(cu_seqlens) if causal else ColumnMask.document(cu_seqlens)
    idx = documents.startend_row_indices
    if width != idx.shape[-1]:  # the same documents in the wider variant of the same semantics
        lts = idx[..., :1]
        full, zero = torch.full_like(lts, 200), torch.zeros_like(lts)
        idx = torch.cat([lts, full], -1) if causal else torch.cat([lts, full, zero, idx[..., 1:]], -1)
    _check_virtual_mask(ColumnMask(idx, causal, 200), 16, 1, max_boundaries)


def _through_virtual_rows(q, k, v, mask, plan, scale):
    """Attention as a kernel on the virtual rows computes it: each (batch, query head) loads its
    mask head's virtual rows (zeros past the end), stores the real ones."""
    b, s, hq, _ = q.shape
    hkv = k.shape[2]
    out, lse = torch.full_like(q[..., : v.shape[-1]], float("nan")), torch.full((b, hq, s), float("nan"), dtype=q.dtype)
    loaded, stored = loaded_rows(plan), stored_rows(plan)
    for bi in range(b):
        for h in range(hq):
            mb, mh = bi % mask.batch, h // (hq // mask.heads)
            rows = loaded[mb, mh]

            def gather(x, head):
                padded = torch.cat([x[bi, :, head], torch.zeros_like(x[bi, :1, head])])
                return padded[rows.clamp(max=s)].unsqueeze(0).unsqueeze(2)

            idx = plan.mask.startend_row_indices[mb : mb + 1, mh : mh + 1]
            one = ColumnMask._unchecked(idx, mask.causal, plan.seqlen)
            part_out, part_lse = reference_attention(
                gather(q, h), gather(k, h * hkv // hq), gather(v, h * hkv // hq), one, scale
            )
            keep = stored[mb, mh]
            out[bi, rows[keep], h] = part_out[0, keep, 0]
            lse[bi, h, rows[keep]] = part_lse[0, 0, keep]
    return out, lse


@pytest.mark.parametrize("max_boundaries", [None, 2])
@pytest.mark.parametrize("name", ["causal_document", "document", "share_question", "prefix_lm_document", "full"])
def test_attention_through_the_virtual_rows_equals_attention_on_the_real_rows(name, max_boundaries):
    gen = torch.Generator().manual_seed(3)
    s, hq, hkv = 301, 4, 2
    mask = masks.build(name, s, batch=2, heads=1, num_docs=4) if name != "full" else masks.build(name, s, batch=2)
    q, k, v = (torch.randn(2, s, h, 16, generator=gen, dtype=torch.float64) for h in (hq, hkv, hkv))
    plan = segment_plan(mask, 32, 32, max_boundaries)
    out, lse = _through_virtual_rows(q, k, v, mask, plan, 0.25)
    expected_out, expected_lse = reference_attention(q, k, v, mask, 0.25)
    torch.testing.assert_close(out, expected_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, expected_lse, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("max_boundaries", [None, 2])
@pytest.mark.parametrize("name", ["causal_document", "share_question", "prefix_lm_document"])
def test_gradients_through_the_virtual_rows_equal_the_real_ones(name, max_boundaries):
    """The backward's premise: on the virtual rows, with every virtual row's dO loaded as the
    kernels load it (a padding row's from another segment's row), the padding rows and keys add
    nothing to any real row's gradient (padding rows are masked for every key between segments),
    so dQ, dK and dV gathered back to the real rows are the reference's."""
    gen = torch.Generator().manual_seed(4)
    s, hq, hkv = 301, 4, 2
    mask = masks.build(name, s, batch=2, heads=1, num_docs=4)
    q, k, v = (torch.randn(2, s, h, 16, generator=gen, dtype=torch.float64).requires_grad_() for h in (hq, hkv, hkv))
    dout = torch.randn(2, s, hq, 16, generator=gen, dtype=torch.float64)
    plan = segment_plan(mask, 32, 32, max_boundaries)
    loss = torch.zeros((), dtype=torch.float64)
    for bi in range(2):
        rows = loaded_rows(plan)[bi, 0].clamp(max=s)

        def gather(x, head):
            return torch.cat([x[bi, :, head], torch.zeros_like(x[bi, :1, head])])[rows].unsqueeze(0).unsqueeze(2)

        one = ColumnMask._unchecked(plan.mask.startend_row_indices[bi : bi + 1], mask.causal, plan.seqlen)
        for h in range(hq):
            out, _ = reference_attention(gather(q, h), gather(k, h * hkv // hq), gather(v, h * hkv // hq), one, 0.25)
            loss = loss + (out * gather(dout, h)).sum()  # the real rows' dO and the padding rows' loaded one
    got = torch.autograd.grad(loss, (q, k, v))
    expected_out, _ = reference_attention(q, k, v, mask, 0.25)
    expected = torch.autograd.grad((expected_out * dout).sum(), (q, k, v))
    for grad, want in zip(got, expected):
        torch.testing.assert_close(grad, want, rtol=1e-12, atol=1e-12)


def _steps(mask: ColumnMask, tile: int, real_rows: torch.Tensor | None = None) -> tuple[int, int]:
    """(key-tile steps, masked ones) of tile x tile tiles with a visible element, counting only
    `real_rows` of each query tile where given (as the kernels' mask role classifies them)."""
    steps = masked = 0
    for start in range(0, mask.seqlen_q, tile):
        seen = ~mask.masked(torch.arange(start, start + tile))[0, 0]
        if real_rows is not None:
            seen = seen[real_rows[start : start + tile]]
        tiles = seen.reshape(seen.shape[0], -1, tile)
        listed, unmasked = tiles.any(dim=(0, 2)), tiles.all(dim=(0, 2))
        steps, masked = steps + int(listed.sum()), masked + int((listed & ~unmasked).sum())
    return steps, masked


def test_aligned_tiles_take_fewer_and_fewer_masked_steps_on_the_benchmarks_documents():
    mask = masks.build("causal_document", 8192, seed=0)  # the benchmark's mask at 8K: 7 documents
    plan = segment_plan(mask)
    assert _steps(mask, 128) == (567, 160)
    assert _steps(plan.mask, 128, stored_rows(plan)[0, 0]) == (545, 68)  # one masked step per query tile


def test_a_plan_without_a_host_sync_keeps_the_first_boundaries_and_a_fixed_length():
    """`max_boundaries`: the virtual length is fixed by S alone; the first boundaries of each row
    are aligned as without the cap, the later documents stay one segment, and the granules past
    the segments hold no real row."""
    cu_seqlens = torch.tensor([0, 200, 512, 700, 1000], dtype=torch.int32)
    mask = ColumnMask.causal_document(cu_seqlens)
    plan = segment_plan(mask, max_boundaries=2)
    assert plan.seqlen == -(-(1000 + 2 * 127) // 128) * 128 == 1280
    first, count = plan.tile_rows[0, 0, :, 0].tolist(), plan.tile_rows[0, 0, :, 1].tolist()
    # 200 rows in two granules, 312 in three, then 488 from row 512 on (700 is not kept) in four
    assert first == [0, 128, 200, 328, 456, 512, 640, 768, 896, 1000]
    assert count == [128, 72, 128, 128, 56, 128, 128, 128, 104, 0]
    assert kernel_boundaries(1000) == 8 and kernel_boundaries(32768) == 16
    # the forward's plan: 1,000 + 8 x 127 rounded up; the backward's: every segment, synced
    assert cached_segment_plan(mask, synced=False).seqlen == 2048
    uncapped = cached_segment_plan(mask, synced=True)
    assert (
        uncapped.seqlen == 256 + 384 + 256 + 384
        and uncapped.tile_rows[0, 0, :5].tolist() == plan.tile_rows[0, 0, :5].tolist()
    )


@pytest.mark.parametrize("synced", [True, False])
def test_the_plan_is_kept_per_mask_and_rebuilt_after_an_in_place_change(synced):
    mask = ColumnMask.causal_document(torch.tensor([0, 200, 512], dtype=torch.int32))
    plan = cached_segment_plan(mask, synced)
    assert cached_segment_plan(mask, synced) is plan and plan.tile_rows[0, 0, :2, 1].tolist() == [128, 72]
    mask.startend_row_indices.fill_(512)  # one causal segment now
    assert cached_segment_plan(mask, synced).tile_rows[0, 0, :2, 1].tolist() == [128, 128]


def test_segments_need_as_many_queries_as_keys():
    idx = torch.full((1, 1, 64, 1), 32, dtype=torch.int32)
    with pytest.raises(ValueError, match="segments need Sq = Sk, got Sq=32, Sk=64"):
        segment_plan(ColumnMask(idx, True, 32))


def test_query_tile_rows_split_each_granule_for_every_batch_element_and_head():
    mask = masks.build("causal_document", 1000, batch=1, heads=1, num_docs=6)
    plan = segment_plan(mask)
    rows = query_tile_rows(plan, 64, batch=2, heads=4)
    assert rows.shape == (2, 4, plan.seqlen // 64, 2) and rows.dtype == torch.int32
    loaded, stored = loaded_rows(plan)[0, 0], stored_rows(plan)[0, 0]
    for b in range(2):
        for h in range(4):
            assert torch.equal(rows[b, h, :, 0].long(), loaded[::64])
            assert torch.equal(rows[b, h, :, 1].long(), stored.reshape(-1, 64).sum(-1))


def test_the_plan_of_an_inference_tensor_is_not_kept():
    with torch.inference_mode():
        mask = ColumnMask.causal_document(torch.tensor([0, 200, 512], dtype=torch.int32))
        assert cached_segment_plan(mask, synced=False).tile_rows[0, 0, :2, 1].tolist() == [128, 72]
        mask.startend_row_indices.fill_(512)  # in place, with no version to show it
        assert cached_segment_plan(mask, synced=False).tile_rows[0, 0, :2, 1].tolist() == [128, 128]
