"""Peer backends behind the same interface: torch SDPA (dense mask) and FlexAttention (BlockMask)."""

from __future__ import annotations

import functools
import math
import warnings

import torch
import torch.nn.functional as F

from .optimized.tile_plan import compact
from .reference import PARTIAL, UNMASKED, ColumnMask


def _dense_heads(mask: ColumnMask, heads_q: int) -> torch.Tensor:
    """Dense attend-mask [Bm, 1 or Hq, Sq, Sk] with mask heads mapped onto query heads."""
    dense = mask.to_dense()
    if dense.shape[1] in (1, heads_q):
        return dense
    return dense.repeat_interleave(heads_q // dense.shape[1], dim=1)


def sdpa_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: ColumnMask | None, softmax_scale: float,
    return_lse: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """torch SDPA with a dense bool mask (O(Sq*Sk) memory); rows that see no key give 0.

    SDPA has no LSE output: with `return_lse` it is computed densely from the scores in fp32.
    """
    attn_mask = None if mask is None else _dense_heads(mask, q.shape[2])
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    gqa = k.shape[2] != q.shape[2]
    out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=attn_mask, scale=softmax_scale, enable_gqa=gqa)
    if attn_mask is not None:
        out = out.masked_fill(~attn_mask.any(-1, keepdim=True), 0)
    lse = None
    if return_lse:
        kf = kt.float().repeat_interleave(q.shape[2] // k.shape[2], dim=1)
        scores = (qt.float() @ kf.transpose(-1, -2)) * softmax_scale
        if attn_mask is not None:
            scores = scores.masked_fill(~attn_mask, -math.inf)
        lse = torch.logsumexp(scores, dim=-1)
    return out.transpose(1, 2), lse


def column_mask_mod(mask: ColumnMask, batch: int, heads_q: int):
    """FlexAttention `mask_mod(b, h, q_idx, kv_idx)` (True = attend) reading the column vectors."""
    iv = mask.intervals()
    batch_step = mask.batch // batch  # 1 for a per-batch mask, 0 for a broadcast one
    head_div = heads_q // mask.heads
    off = mask.seqlen_k - mask.seqlen_q
    causal = mask.causal

    def mask_mod(b, h, q_idx, kv_idx):
        bb, hh = b * batch_step, h // head_div
        hidden = ((q_idx >= iv.lts[bb, hh, kv_idx]) & (q_idx < iv.lte[bb, hh, kv_idx])) | (
            (q_idx >= iv.uts[bb, hh, kv_idx]) & (q_idx < iv.ute[bb, hh, kv_idx])
        )
        if causal:
            hidden = hidden | (kv_idx > q_idx + off)
        return ~hidden

    return mask_mod


_DENSE_BLOCK_MASK_LIMIT = 2**33  # mask elements create_block_mask may evaluate at once


def flex_block_mask(
    mask: ColumnMask | None, batch: int, heads_q: int, seqlen_q: int, seqlen_k: int, device, from_tiles: bool | None = None
):
    """BlockMask (128 x 128) for FlexAttention; None for full attention.

    By default FlexAttention's own `create_block_mask` classifies the blocks, exactly; it evaluates
    the whole mask, which does not fit in memory at 128K tokens. Beyond that size (or with
    `from_tiles=True`) the blocks come from `ColumnMask.block_classes` instead: the same SKIP
    blocks, and PARTIAL blocks where create_block_mask might find some full.
    """
    if mask is None:
        return None
    from torch.nn.attention.flex_attention import BlockMask, create_block_mask

    mask_mod = column_mask_mod(mask, batch, heads_q)
    heads = 1 if mask.heads == 1 else heads_q
    if from_tiles is None:
        from_tiles = mask.batch * heads * seqlen_q * seqlen_k > _DENSE_BLOCK_MASK_LIMIT
    if not from_tiles:
        return create_block_mask(
            mask_mod, batch if mask.batch > 1 else None, None if heads == 1 else heads, seqlen_q, seqlen_k,
            device=device, BLOCK_SIZE=128, _compile=torch.device(device).type == "cuda",
        )
    partial_num, partial_idx, full_num, full_idx = _block_lists(mask, heads, device)
    return BlockMask.from_kv_blocks(
        partial_num, partial_idx, full_num, full_idx, BLOCK_SIZE=128, mask_mod=mask_mod, seq_lengths=(seqlen_q, seqlen_k)
    )


def _block_lists(mask: ColumnMask, heads: int, device) -> tuple[torch.Tensor, ...]:
    """Per 128-row query block, the compacted PARTIAL and UNMASKED 128-key blocks of
    `ColumnMask.block_classes` (counts, indices; SKIP blocks left out), mask heads repeated to `heads`."""
    classes = mask.to(device).block_classes(128, 128).classes
    if heads != mask.heads:
        classes = classes.repeat_interleave(heads // mask.heads, dim=1)
    return (*compact(classes == PARTIAL), *compact(classes == UNMASKED))


def fa4_block_sparse(mask: ColumnMask, heads_q: int, device):
    """FA4 (flash_attn.cute) on this mask with its block sparsity, for `q, k, v -> out`: 128 x 128
    blocks from `ColumnMask.block_classes` (SKIP blocks left out, UNMASKED ones run unmasked) and,
    on PARTIAL blocks, a CuTe `mask_mod` reading `startend_row_indices` (the same element rule as
    our kernel, `optimized.mask._hidden`). Built once, outside any timing."""
    import cutlass
    import cutlass.cute as cute
    from flash_attn.cute import flash_attn_func
    from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch

    from .optimized.mask import _hidden

    partial_num, partial_idx, full_num, full_idx = _block_lists(mask, 1 if mask.heads == 1 else heads_q, device)
    sparse = BlockSparseTensorsTorch(partial_num, partial_idx, full_num, full_idx, block_size=(128, 128))
    row_indices = mask.startend_row_indices.to(device).contiguous()
    causal, width = mask.causal, row_indices.shape[-1]
    per_batch, heads_per_maskhead = mask.batch > 1, heads_q // mask.heads
    causal_offset = mask.seqlen_k - mask.seqlen_q

    @cute.jit
    def mask_mod(batch_idx, head_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
        bounds = aux_tensors[0]
        b = batch_idx[0] if cutlass.const_expr(per_batch) else 0
        h = head_idx[0] // heads_per_maskhead
        query, key = q_idx[0], kv_idx[0]
        first = bounds[b, h, key, 0]
        second = bounds[b, h, key, 1] if cutlass.const_expr(width >= 2) else first
        third = bounds[b, h, key, 2] if cutlass.const_expr(width == 4) else first
        fourth = bounds[b, h, key, 3] if cutlass.const_expr(width == 4) else first
        keep = cute.make_rmem_tensor(1, cutlass.Boolean)
        keep[0] = not _hidden(query, key, first, second, third, fourth, causal_offset, causal, width)
        return keep.load()

    # FA4 caches its kernels by this hash: name every compile-time constant the closure captures.
    mask_mod.__cute_hash__ = f"flashmask3-column-{causal}-{width}-{per_batch}-{heads_per_maskhead}-{causal_offset}"
    return lambda q, k, v: flash_attn_func(
        q, k, v, mask_mod=mask_mod, aux_tensors=[row_indices], block_sparse_tensors=sparse)[0]


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def flex_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: ColumnMask | None,
    softmax_scale: float,
    block_mask=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FlexAttention (compiled on CUDA, eager on CPU). Pass `block_mask` to reuse one."""
    from torch.nn.attention.flex_attention import AuxRequest
    from torch.nn.attention.flex_attention import flex_attention as flex_eager

    b, sq, hq, _ = q.shape
    if block_mask is None:
        block_mask = flex_block_mask(mask, b, hq, sq, k.shape[1], q.device)
    fn = _compiled_flex() if q.is_cuda else flex_eager
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*flex_attention.*compile", category=UserWarning)
        out, aux = fn(
            qt, kt, vt, block_mask=block_mask, scale=softmax_scale,
            enable_gqa=k.shape[2] != hq, return_aux=AuxRequest(lse=True),
        )
    lse = aux.lse.float()
    out = out.masked_fill((lse == -math.inf).unsqueeze(-1), 0)  # rows that see no key
    return out.transpose(1, 2), lse
