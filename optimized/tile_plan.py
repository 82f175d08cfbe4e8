"""What the kernels need of the mask beyond `startend_row_indices`, computed on the mask's device.

- `block_minmax`: per key tile, the min and max of each boundary column (one reduction, O(Sk)):
  the input of the kernels' mask role (mask_role.py), which classifies the tiles in-kernel.
- `tile_classes`: the classes the mask role computes, in torch (FlashMask's rule as
  `ColumnMask.block_classes` defines it, plus the ragged last key tile), O(B * Hm * Tm * Tn).
- `dq_ranks`: for the deterministic backward, each key tile's place among the key tiles a query
  tile sees (the order of its dQ sum).
- `forward_tile_steps` / `backward_cta_steps` / `longest_first`: the steps of the forward's work
  tiles and of the backward's CTAs, and either ordered by them, most first; `cached_longest_first`
  computes such an order once per mask (the layers of a training step share their mask), through
  `kept_per_mask`, which keeps any such per-mask result.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

import torch

from ..reference import PARTIAL, SKIP, ColumnMask

T = TypeVar("T")


def full_mask(batch: int, seqlen_q: int, seqlen_k: int, device) -> ColumnMask:
    """No masking: non-causal [LTS, UTE] = [Sq, 0] for every key."""
    idx = torch.empty(1, 1, seqlen_k, 2, dtype=torch.int32, device=device)
    idx[..., 0], idx[..., 1] = seqlen_q, 0
    return ColumnMask(idx, False, seqlen_q)


def block_minmax(mask: ColumnMask, tile_n: int) -> torch.Tensor:
    """int32 [Bm, Hm, Tn, 2 * width]: per key tile, the min of each column of `startend_row_indices`,
    then the max. A ragged last tile repeats its last key, which leaves its min/max unchanged."""
    idx = mask.startend_row_indices
    bm, hm, sk, width = idx.shape
    tiles = -(-sk // tile_n)
    if tiles * tile_n != sk:
        idx = torch.cat([idx, idx[:, :, -1:].expand(bm, hm, tiles * tile_n - sk, width)], dim=2)
    lo, hi = torch.aminmax(idx.reshape(bm, hm, tiles, tile_n, width), dim=3)
    return torch.cat([lo, hi], dim=-1)


def compact(selected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of the last dim: how many are selected (int32), and their indices listed first, in
    order (int32; the unselected follow)."""
    order = torch.sort((~selected).to(torch.int8), dim=-1, stable=True).indices.to(torch.int32)
    return selected.sum(-1, dtype=torch.int32).contiguous(), order.contiguous()


def tile_classes(mask: ColumnMask, tile_m: int, tile_n: int) -> torch.Tensor:
    """int8 [Bm, Hm, Tm, Tn]: SKIP, PARTIAL or UNMASKED, as the kernels' mask role classifies.

    The ragged last key tile is PARTIAL unless SKIP (it needs the bounds check).
    """
    classes = mask.block_classes(tile_m, tile_n).classes
    if mask.seqlen_k % tile_n:
        last = classes[..., -1]
        classes[..., -1] = torch.where(last == SKIP, last, torch.full_like(last, PARTIAL))
    return classes


def dq_ranks(mask: ColumnMask, tile_m: int, tile_n: int) -> torch.Tensor:
    """int32 [Bm, Hm, Tn, Tm]: at [n, m], how many key tiles before n query tile m sees (its place
    in the deterministic, key-ordered dQ sum of query tile m)."""
    seen = tile_classes(mask, tile_m, tile_n) != SKIP
    return (torch.cumsum(seen, dim=-1, dtype=torch.int32) - seen.int()).transpose(-1, -2).contiguous()


def forward_tile_steps(
    mask: ColumnMask, batch: int, q_heads: int, tile_m: int, tile_n: int, tile_rows: torch.Tensor | None = None
) -> torch.Tensor:
    """int32 [batch * q_heads * Tm]: each forward work tile's key-tile steps (its query tile's
    non-SKIP key tiles), in work-tile order: query tile + Tm * (query head + q_heads * batch).
    `tile_rows`: a segment plan's (segments.py; granules of `tile_m` rows), whose granules with no
    real row take no step (the mask role draws past them)."""
    steps = (~mask.block_skip(tile_m, tile_n)).sum(dim=3, dtype=torch.int32)  # [Bm, Hm, Tm]
    if tile_rows is not None:
        steps = torch.where(tile_rows[..., 1] > 0, steps, 0)
    return steps.expand(batch, -1, -1).repeat_interleave(q_heads // mask.heads, dim=1).flatten()


def backward_cta_steps(
    mask: ColumnMask, batch: int, q_heads: int, kv_heads: int, tile_m: int, tile_n: int
) -> torch.Tensor:
    """int32 [batch * kv_heads * Tn]: each backward CTA's query-tile steps (its key tile's non-SKIP
    query tiles, summed over its KV head's query heads), in grid order: key tile + Tn * (KV head +
    kv_heads * batch)."""
    steps = (~mask.block_skip(tile_m, tile_n)).sum(dim=2, dtype=torch.int32)  # [Bm, Hm, Tn]
    steps = steps.expand(batch, -1, -1).repeat_interleave(q_heads // mask.heads, dim=1)  # [B, Hq, Tn]
    return steps.reshape(batch, kv_heads, q_heads // kv_heads, -1).sum(dim=2, dtype=torch.int32).flatten()


def longest_first(steps: torch.Tensor, buckets: int = 0) -> torch.Tensor:
    """int32: the indices of `steps` (a kernel's work units in its own order) sorted by steps, most
    first, ties in that order. Launched or drawn in this order, the long units start first and the
    last ones are short (longest-processing-time-first list scheduling).

    With `buckets` > 0 the sort is by length class instead: `buckets` equal ranges of steps up to
    the longest, longest class first, each class in the units' own order. That order keeps units
    that read the same data (one head's tiles) together, so the ones running at a time share it in
    L2, while a class's lengths differ by at most max / `buckets` steps."""
    if buckets == 0 or steps.numel() == 0:
        return torch.sort(steps, descending=True, stable=True).indices.to(torch.int32)
    steps = steps.to(torch.int64)
    shorter_class = buckets - 1 - steps * buckets // (steps.max() + 1)  # on the device: no host sync
    position = torch.arange(steps.numel(), device=steps.device)
    return torch.argsort(shorter_class * steps.numel() + position).to(torch.int32)


# Per live boundaries tensor, by identity: the custom ops rebuild the ColumnMask around the same
# tensor at each call, and comparing masks by value would read the boundaries (a host sync).
_per_mask: dict[int, dict[Hashable, tuple[Hashable, Any]]] = {}


def kept_per_mask(mask: ColumnMask, key: Hashable, compute: Callable[[], T], keep_unversioned: bool = True) -> T:
    """`compute()`, computed on the first call per `mask` (its boundaries tensor, variant and
    seqlen_q) and `key`, and kept while that tensor lives unchanged (its version, shape and
    storage). An inference tensor records no version: its result is kept on its shape and storage
    only where `keep_unversioned` (a result that stays right past an in-place change), else not at
    all. While a CUDA graph is captured nothing is kept (the computation is recorded in it)."""
    boundaries = mask.startend_row_indices
    unversioned = torch.is_inference(boundaries)
    if (boundaries.is_cuda and torch.cuda.is_current_stream_capturing()) or (unversioned and not keep_unversioned):
        return compute()
    kept = _per_mask.get(id(boundaries))
    if kept is None:
        kept = _per_mask[id(boundaries)] = {}
        weakref.finalize(boundaries, _per_mask.pop, id(boundaries), None)
    key = (mask.causal, mask.seqlen_q, key)
    state = (None if unversioned else boundaries._version, tuple(boundaries.shape), boundaries.data_ptr())
    entry = kept.get(key)
    if entry is None or entry[0] != state:
        entry = kept[key] = (state, compute())
    return entry[1]


def cached_longest_first(
    mask: ColumnMask, key: Hashable, steps: Callable[[], torch.Tensor], buckets: int = 0
) -> torch.Tensor:
    """`longest_first(steps(), buckets)`, kept per mask and `key` (which must fix the kernel's grid)
    by `kept_per_mask`: the sort's few dozen small kernels then run once per mask, not once per
    layer. An order only permutes the kernel's work units, so one kept past an in-place change that
    no version records (inference tensors) still gives the same numbers."""
    return kept_per_mask(mask, (key, buckets), lambda: longest_first(steps(), buckets))
