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


def make_tile_plan(mask: ColumnMask, tile_m: int, tile_n: int, skip_tiles: bool = True) -> TilePlan:
    """`skip_tiles=False` (an ablation) lists fully masked tiles too, as PARTIAL."""
    classes = mask.block_classes(tile_m, tile_n).classes
    if not skip_tiles:
        classes = torch.where(classes == SKIP, torch.full_like(classes, PARTIAL), classes)
    if mask.seqlen_k % tile_n:
        # The ragged last key tile always needs the bounds check.
        last = classes[..., -1]
        classes[..., -1] = torch.where(last == SKIP, last, torch.full_like(last, PARTIAL))
    counts, tile_ids = compact(classes != SKIP)
    flags = (torch.gather(classes, -1, tile_ids.long()) == PARTIAL).to(torch.int32)
    return TilePlan(tiles=((tile_ids << 1) | flags).contiguous(), counts=counts)
