"""The benchmark peers' mask mappings (CPU): each peer must run exactly our mask."""

import subprocess
import sys

import pytest
import torch
from flashmask3.reference import PARTIAL, UNMASKED, ColumnMask

from flashmask3 import bench_peers, masks


def varlen_dense(cu_seqlens: torch.Tensor, causal: bool) -> torch.Tensor:
    """The mask FA4's varlen call runs over the packed tokens (True = attend): a token sees the
    tokens of its own sequence, only those not after it when causal (equal q and k lengths)."""
    positions = torch.arange(int(cu_seqlens[-1]))
    sequence = torch.searchsorted(cu_seqlens, positions, right=True)
    dense = sequence[:, None] == sequence[None, :]
    return dense & (positions[None, :] <= positions[:, None]) if causal else dense


@pytest.mark.parametrize("name", ["causal_document", "document"])
@pytest.mark.parametrize("seqlen, mask_batch, batch, num_docs", [(300, 3, 3, 4), (1000, 1, 2, None), (257, 2, 2, 1)])
def test_document_cu_seqlens_reproduce_the_mask_over_the_packed_batch(name, seqlen, mask_batch, batch, num_docs):
    """Flattening B sequences into one varlen call: the block-diagonal mask of all B x documents
    equals our mask on each sequence's diagonal block and hides every pair across sequences."""
    mask = masks.build(name, seqlen, batch=mask_batch, seed=5, num_docs=num_docs)
    cu_seqlens, longest = bench_peers.document_cu_seqlens(mask, batch)
    assert cu_seqlens.dtype == torch.int32 and int(cu_seqlens[0]) == 0 and int(cu_seqlens[-1]) == batch * seqlen
    per_sequence = mask.to_dense()[:, 0].expand(batch, seqlen, seqlen)
    assert torch.equal(varlen_dense(cu_seqlens, mask.causal), torch.block_diag(*per_sequence))
    assert longest == int(cu_seqlens.diff().max())


def test_document_cu_seqlens_take_a_mask_repeated_over_heads():
    mask = masks.build("document", 512, batch=2, seed=1)
    per_head = ColumnMask(mask.startend_row_indices.expand(2, 4, 512, 2).contiguous(), False, 512)
    assert torch.equal(bench_peers.document_cu_seqlens(per_head, 2)[0], bench_peers.document_cu_seqlens(mask, 2)[0])


@pytest.mark.parametrize(
    "name, message",
    [
        ("share_question", "batch 0's LTS is not increasing document ends"),
        ("sliding_window", "batch 0 has a key whose LTS is not its document's end"),
        ("prefix_lm_document", "whose UTE is not its start"),
        ("causal_blockwise", "an LTE below S"),
        ("random_eviction", "mask heads differ"),
    ],
)
def test_document_cu_seqlens_refuse_masks_that_are_not_documents(name, message):
    mask = masks.build(name, 512, batch=2, heads=2, seed=3)
    with pytest.raises(ValueError, match=message):
        bench_peers.document_cu_seqlens(mask, 2)


def test_document_cu_seqlens_name_a_batch_mismatch():
    with pytest.raises(ValueError, match="mask batch must be 1 or batch=4, got 2"):
        bench_peers.document_cu_seqlens(masks.build("document", 256, batch=2), 4)


@pytest.mark.parametrize("seqlen, window", [(300, None), (1024, None), (300, 1), (300, 7), (200, 200), (200, 500)])
def test_window_size_reproduces_the_sliding_window_mask(seqlen, window):
    """FA4 keeps keys i - left <= j <= i + right (Sq == Sk); with causal=True, right = 0."""
    mask = masks.build("sliding_window", seqlen, window=window)
    left = bench_peers.sliding_window_left(mask)
    rows, cols = torch.arange(seqlen)[:, None], torch.arange(seqlen)[None, :]
    assert torch.equal((cols >= rows - left) & (cols <= rows), mask.to_dense()[0, 0])
    assert left == min(window or seqlen // 16, seqlen) - 1


def test_window_size_refuses_other_masks():
    with pytest.raises(ValueError, match="not a sliding window"):
        bench_peers.sliding_window_left(masks.build("causal_document", 512))
    with pytest.raises(ValueError, match="must be causal"):
        bench_peers.sliding_window_left(masks.build("document", 512))


def listed(counts: torch.Tensor, indices: torch.Tensor, columns: int) -> torch.Tensor:
    """bool [..., rows, columns]: which columns each row's list names (its first `count` entries)."""
    named = torch.zeros(*counts.shape, columns + 1, dtype=torch.bool)
    valid = torch.arange(indices.shape[-1]) < counts[..., None]
    named.scatter_(-1, torch.where(valid, indices.long(), columns), True)
    return named[..., :columns]


@pytest.mark.parametrize(
    "name",
    [
        "causal",
        "sliding_window",
        "document",
        "share_question",
        "global_sliding_window",
        "random_eviction",
        "prefix_lm_causal",
    ],
)
@pytest.mark.parametrize("head_dim", [128, 192])
def test_backward_block_lists_are_the_transposed_forward_lists(name, head_dim):
    """FA4's backward walks key blocks: per key block the query blocks whose forward list names it,
    partial and full apart, from `ColumnMask.block_classes` (SKIP left out); listed in order. Above
    head dim 128 the key blocks are FA4's narrower backward key tile (96 at 192)."""
    heads, seqlen = 4, 700  # a ragged last block
    key_block = bench_peers.fa4_key_block(head_dim)
    tm, tn = 6, -(-seqlen // key_block)
    mask = masks.build(name, seqlen, batch=2, heads=heads, seed=2)
    classes = mask.block_classes(128, key_block).classes.expand(2, heads, tm, tn)
    forward, backward = bench_peers.fa4_block_sparse_tensors(mask, heads, key_block)
    for kind, (fwd_counts, fwd_indices, bwd_counts, bwd_indices) in {
        PARTIAL: (*forward[:2], *backward[:2]),
        UNMASKED: (*forward[2:], *backward[2:]),
    }.items():
        forward_blocks = listed(fwd_counts, fwd_indices, tn).expand(2, heads, tm, tn)
        assert torch.equal(forward_blocks, classes == kind)
        assert bwd_counts.shape[-1] == bwd_indices.shape[-2] == tn
        assert torch.equal(
            listed(bwd_counts, bwd_indices, tm).expand(2, heads, tn, tm), forward_blocks.transpose(-1, -2)
        )
        first = bwd_indices[..., :-1].long()
        in_list = torch.arange(1, tm) < bwd_counts[..., None]
        assert bool(((bwd_indices[..., 1:] > first) | ~in_list).all())
    assert [bench_peers.fa4_key_block(d) for d in (64, 128, 192, 256)] == [128, 128, 96, 64]


def test_flex_block_mask_at_128k_comes_from_the_block_classes(monkeypatch):
    """128K tokens in one sequence: the BlockMask is built from our block classes, never from a
    dense mask (which would take 16 GiB here), and keeps exactly the non-SKIP blocks, the
    UNMASKED ones as full blocks."""
    seqlen = 131072
    mask = masks.build("causal_document", seqlen, seed=4)

    def dense_forbidden(*args, **kwargs):
        raise AssertionError("a dense mask was built")

    monkeypatch.setattr(ColumnMask, "to_dense", dense_forbidden)
    monkeypatch.setattr("torch.nn.attention.flex_attention.create_block_mask", dense_forbidden)
    case = bench_peers.PeerCase("causal_document", mask, 1, 32, 128**-0.5)
    block_mask = case.block_mask
    classes = mask.block_classes(128, 128).classes[0, 0]
    partial = listed(block_mask.kv_num_blocks, block_mask.kv_indices, 1024)[0, 0]
    full = listed(block_mask.full_kv_num_blocks, block_mask.full_kv_indices, 1024)[0, 0]
    assert torch.equal(partial, classes == PARTIAL) and torch.equal(full, classes == UNMASKED)
    assert case.block_mask_seconds > 0 and case.block_mask is block_mask  # built once


def test_peers_that_do_not_express_a_mask_are_left_out_without_importing_them():
    case = bench_peers.PeerCase("share_question", masks.build("share_question", 256), 1, 4, 0.125)
    assert bench_peers.PEERS["fa4"](case) is None and bench_peers.PEERS["cudnn"](case) is None


def test_checked_peers_record_differences_and_errors():
    """A peer that fails to build or on its first call leaves its error in the row and is left
    out; one that does not take the mask leaves nothing; the others come back, checked."""

    def unavailable(case):
        raise ModuleNotFoundError("No module named 'flash_attn'")

    def fails_to_compile(case):
        def run(q, k, v):
            raise RuntimeError("CuteDSL template failed:\n  unsupported head dim")

        return run

    peers = {
        "good": lambda case: lambda q, k, v: q + 1,
        "absent": lambda case: None,
        "missing": unavailable,
        "broken": fails_to_compile,
    }
    row = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(bench_peers, "PEERS", peers)
        case = bench_peers.PeerCase("causal", masks.build("causal", 256), 1, 4, 0.125)
        q = torch.zeros(3)
        built = bench_peers.checked_peers(case, tuple(peers), lambda fn: {"max_diff": float(fn(q, q, q).max())}, row)
    assert list(built) == ["good"] and built["good"](q, q, q).tolist() == [1.0] * 3
    assert row == {
        "good_max_diff": 1.0,
        "missing_error": "ModuleNotFoundError: No module named 'flash_attn'",
        "broken_error": "RuntimeError: CuteDSL template failed: unsupported head dim",
    }


def test_select_peers_names_the_accepted_ones():
    assert bench_peers.select_peers("fa4, flex_flash") == ("fa4", "flex_flash")
    assert bench_peers.select_peers("") == ()
    with pytest.raises(
        ValueError, match="unknown peer 'fa5' in peers='fa4,fa5'; accepted: flex, flex_flash, fa4, fa4_sparse, cudnn"
    ):
        bench_peers.select_peers("fa4,fa5")


def test_the_library_never_imports_the_benchmark_peers():
    imported = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, flashmask3, flashmask3.api, flashmask3.peers; "
            "print('flashmask3.bench_peers' in sys.modules, 'flash_attn' in sys.modules)",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert imported.stdout.split() == ["False", "False"]
