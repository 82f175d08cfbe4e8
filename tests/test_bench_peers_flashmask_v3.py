"""The `flashmask_v3` peer on CPU: what it passes to FlashMask V3's `flashmask_attention`, which a
stand-in `interface_torch` takes in place of the built extension (its kernels need a Hopper GPU)."""

import sys
import types

import torch
from flashmask3.reference import ColumnMask, masks, reference_attention

from flashmask3 import bench_peers


def stand_in_interface(calls: list) -> types.ModuleType:
    """`interface_torch` with FlashMask V3's signature and its checks on the mask (batch equal to
    q's, heads 1, Hq or Hk, Sk rows), attending in plain PyTorch over the mask it is given."""

    def flashmask_attention(query, key, value, startend_row_indices, *, causal=False, softmax_scale=None):
        batch, seqlen_q, heads, _ = query.shape
        assert startend_row_indices.dtype == torch.int32 and startend_row_indices.shape[0] == batch
        assert startend_row_indices.shape[1] in (1, heads, key.shape[2])
        assert startend_row_indices.shape[2] == key.shape[1]
        calls.append((startend_row_indices, causal, softmax_scale))
        mask = ColumnMask(startend_row_indices, causal, seqlen_q)
        out, _ = reference_attention(
            query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), mask, softmax_scale
        )
        return out.transpose(1, 2)

    module = types.ModuleType("interface_torch")
    module.flashmask_attention = flashmask_attention
    return module


def test_flashmask_v3_gets_our_mask_for_each_sequence_and_matches_the_reference(monkeypatch):
    seqlen, batch, heads, dim = 97, 2, 3, 16
    calls: list = []
    monkeypatch.setitem(sys.modules, "interface_torch", stand_in_interface(calls))
    generator = torch.Generator().manual_seed(0)
    for name in ("causal_document", "share_question", "global_sliding_window"):
        mask = masks.build(name, seqlen, batch=1, heads=1, seed=2)
        case = bench_peers.PeerCase(name, mask, batch, heads, 0.25)
        q, k, v = (torch.randn(batch, seqlen, heads, dim, generator=generator, dtype=torch.float64) for _ in range(3))
        out = bench_peers.PEERS["flashmask_v3"](case)(q, k, v)
        bounds, causal, scale = calls[-1]
        assert bounds.shape == (batch, *mask.startend_row_indices.shape[1:]) and bounds.is_contiguous()
        assert torch.equal(bounds, mask.startend_row_indices.expand(batch, -1, -1, -1))
        assert (causal, scale) == (mask.causal, 0.25)
        expected, _ = reference_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, 0.25)
        torch.testing.assert_close(out, expected.transpose(1, 2), rtol=0, atol=1e-12)
