"""The kernels' tile plan, computed on the mask's device: per query tile, the compacted list of
key tiles that are not fully masked, each flagged PARTIAL or UNMASKED.

It is FlashMask's classification (per-key-block min/max of the boundary vectors, as
`ColumnMask.block_classes` defines it) followed by a stable compaction, a handful of tensor ops
whose cost is O(B * Hm * Tm * Tn) and is counted in the kernel timings.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..reference import PARTIAL, SKIP, ColumnMask


class TilePlan(NamedTuple):
    tiles: torch.Tensor  # int32 [Bm, Hm, Tm, Tn]: key tile << 1 | partial, listed first
    counts: torch.Tensor  # int32 [Bm, Hm, Tm]: number of listed key tiles


def full_mask(batch: int, seqlen_q: int, seqlen_k: int, device) -> ColumnMask:
    """No masking: non-causal [LTS, UTE] = [Sq, 0] for every key."""
    idx = torch.empty(1, 1, seqlen_k, 2, dtype=torch.int32, device=device)
    idx[..., 0], idx[..., 1] = seqlen_q, 0
    return ColumnMask(idx, False, seqlen_q)


def compact(selected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of the last dim: how many are selected (int32), and their indices listed first, in
    order (int32; the unselected follow)."""
    order = torch.sort((~selected).to(torch.int8), dim=-1, stable=True).indices.to(torch.int32)
    return selected.sum(-1, dtype=torch.int32).contiguous(), order.contiguous()


def make_tile_plan(
    mask: ColumnMask, tile_m: int, tile_n: int, skip_tiles: bool = True, by_key: bool = False
) -> TilePlan:
    """Per query tile, its key tiles (the forward); with `by_key`, per key tile, its query tiles
    (the backward), each entry also carrying in bits 16+ the key tile's rank among the key tiles
    its query tile lists (the order of the deterministic dQ sum).

    `skip_tiles=False` (an ablation) lists fully masked tiles too, as PARTIAL.
    """
    classes = mask.block_classes(tile_m, tile_n).classes
    if not skip_tiles:
        classes = torch.where(classes == SKIP, torch.full_like(classes, PARTIAL), classes)
    if mask.seqlen_k % tile_n:
        # The ragged last key tile always needs the bounds check.
        last = classes[..., -1]
        classes[..., -1] = torch.where(last == SKIP, last, torch.full_like(last, PARTIAL))
    listed = classes != SKIP
    if by_key:
        rank = (torch.cumsum(listed, dim=-1, dtype=torch.int32) - 1).transpose(-1, -2)
        classes, listed = classes.transpose(-1, -2), listed.transpose(-1, -2)
    counts, tile_ids = compact(listed)
    flags = (torch.gather(classes, -1, tile_ids.long()) == PARTIAL).to(torch.int32)
    tiles = (tile_ids << 1) | flags
    if by_key:
        tiles |= torch.gather(rank, -1, tile_ids.long()).clamp_(min=0) << 16
    return TilePlan(tiles=tiles.contiguous(), counts=counts)
