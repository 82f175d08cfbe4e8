"""Peer backends behind the same interface: torch SDPA (dense mask) and FlexAttention (BlockMask)."""

from __future__ import annotations

import functools
import math
import warnings
import weakref

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
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: ColumnMask | None,
    softmax_scale: float,
    return_lse: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """torch SDPA with a dense bool mask (O(Sq*Sk) memory); rows that see no key give 0.

    SDPA has no LSE output: with `return_lse` it is computed densely from the scores, in fp32 (fp64
    for fp64 inputs) and differentiable.
    """
    attn_mask = None if mask is None else _dense_heads(mask, q.shape[2])
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    gqa = k.shape[2] != q.shape[2]
    out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=attn_mask, scale=softmax_scale, enable_gqa=gqa)
    if attn_mask is not None:
        out = out.masked_fill(~attn_mask.any(-1, keepdim=True), 0)
    lse = None
    if return_lse:
        accumulator = torch.promote_types(q.dtype, torch.float32)
        kf = kt.to(accumulator).repeat_interleave(q.shape[2] // k.shape[2], dim=1)
        scores = (qt.to(accumulator) @ kf.transpose(-1, -2)) * softmax_scale
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
    mask: ColumnMask | None,
    batch: int,
    heads_q: int,
    seqlen_q: int,
    seqlen_k: int,
    device,
    from_tiles: bool | None = None,
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
            mask_mod,
            batch if mask.batch > 1 else None,
            None if heads == 1 else heads,
            seqlen_q,
            seqlen_k,
            device=device,
            BLOCK_SIZE=128,
            _compile=torch.device(device).type == "cuda",
        )
    partial_num, partial_idx, full_num, full_idx = block_lists(head_block_classes(mask, heads, device))
    return BlockMask.from_kv_blocks(
        partial_num,
        partial_idx,
        full_num,
        full_idx,
        BLOCK_SIZE=128,
        mask_mod=mask_mod,
        seq_lengths=(seqlen_q, seqlen_k),
    )


def head_block_classes(mask: ColumnMask, heads: int, device, key_block: int = 128) -> torch.Tensor:
    """`ColumnMask.block_classes` of 128 x `key_block` blocks (int8 [Bm, 1 or `heads`, Tm, Tn]) on
    `device`, mask heads repeated to `heads` where the mask has more than one."""
    classes = mask.to(device).block_classes(128, key_block).classes
    if classes.shape[1] not in (1, heads):
        classes = classes.repeat_interleave(heads // mask.heads, dim=1)
    return classes


def block_lists(classes: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Per row of `classes`' last two dims, the compacted PARTIAL and the compacted UNMASKED blocks
    (counts int32 [..., rows], indices int32 [..., rows, cols]; SKIP blocks left out)."""
    return (*compact(classes == PARTIAL), *compact(classes == UNMASKED))


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


_block_masks: dict[tuple, tuple[weakref.ref, object]] = {}


def _cached_block_mask(mask: ColumnMask | None, batch: int, heads: int, seqlen_q: int, seqlen_k: int, device):
    """`flex_block_mask`, built once per mask object and shape (a layer stack shares one; masks are
    not changed in place) and dropped with the mask. Keyed by identity: comparing masks by value
    would read their tensors, a host sync on the GPU."""
    if mask is None:
        return None
    key = (id(mask), batch, heads, seqlen_q, seqlen_k, str(device))
    hit = _block_masks.get(key)
    if hit is not None and hit[0]() is mask:
        return hit[1]
    block_mask = flex_block_mask(mask, batch, heads, seqlen_q, seqlen_k, device)
    _block_masks[key] = (weakref.ref(mask, lambda _, key=key: _block_masks.pop(key, None)), block_mask)
    return block_mask


def flex_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: ColumnMask | None,
    softmax_scale: float,
    block_mask=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FlexAttention (compiled on CUDA, eager on CPU). Pass `block_mask` to reuse one.

    lse is FlexAttention's, differentiable: fp32, fp64 for fp64 inputs."""
    from torch.nn.attention.flex_attention import AuxRequest
    from torch.nn.attention.flex_attention import flex_attention as flex_eager

    b, sq, hq, _ = q.shape
    if block_mask is None:
        block_mask = _cached_block_mask(mask, b, hq, sq, k.shape[1], q.device)
    fn = _compiled_flex() if q.is_cuda else flex_eager
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*flex_attention.*compile", category=UserWarning)
        out, aux = fn(
            qt,
            kt,
            vt,
            block_mask=block_mask,
            scale=softmax_scale,
            enable_gqa=k.shape[2] != hq,
            return_aux=AuxRequest(lse=True),
        )
    lse = aux.lse.to(torch.promote_types(q.dtype, torch.float32))
    out = out.masked_fill((lse == -math.inf).unsqueeze(-1), 0)  # rows that see no key
    return out.transpose(1, 2), lse
