"""What the kernels need of the mask beyond `startend_row_indices`, computed on the mask's device.

- `block_minmax`: per key tile, the min and max of each boundary column (one reduction, O(Sk)):
  the input of the kernels' mask role (mask_role.py), which classifies the tiles in-kernel;
  `cached_block_minmax` keeps it per mask.
- `tile_classes`: the classes the mask role computes, in torch (FlashMask's rule as
  `ColumnMask.block_classes` defines it, plus the ragged last key tile), O(B * Hm * Tm * Tn).
- `dq_ranks`: for the deterministic backward, each key tile's place among the key tiles a query
  tile sees (the order of its dQ sum).
- `forward_tile_steps` / `backward_cta_steps` / `longest_first`: the steps of the forward's work
  tiles and of the backward's CTAs, and either ordered by them, most first; `cached_longest_first`
  computes such an order once per mask (the layers of a training step share their mask), through
  `kept_per_mask`, which keeps any such per-mask result.
- `split_parts` / `backward_split_plan`: the backward CTAs whose grid-order finish would pass the
  ideal makespan, split into 2 or 4 parts over their query tiles, and the work table (one row per
  launched CTA: its CTA, query-tile range and dK/dV slot) the split kernel reads.
- `moved_mask` / `moved_plans`: a mask's copy on another device with what `kept_per_mask` keeps
  for it (`plans.prepare_mask`).
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

import torch

from ..reference import PARTIAL, SKIP, ColumnMask

T = TypeVar("T")


def full_mask(seqlen_q: int, seqlen_k: int, device) -> ColumnMask:
    """No masking: non-causal [LTS, UTE] = [Sq, 0] for every key. Built unchecked: its validation
    would wait for the GPU at every call without a mask."""
    idx = torch.empty(1, 1, seqlen_k, 2, dtype=torch.int32, device=device)
    idx[..., 0], idx[..., 1] = seqlen_q, 0
    return ColumnMask._unchecked(idx, False, seqlen_q)


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
    return _summed_per_cta(steps, batch, q_heads, kv_heads)


def _summed_per_cta(per_mask_head: torch.Tensor, batch: int, q_heads: int, kv_heads: int) -> torch.Tensor:
    """int32 [batch * kv_heads * Tn, ...]: `per_mask_head` ([Bm, Hm, Tn, ...], per mask batch row,
    mask head and key tile) summed over each backward CTA's query heads (its KV head's group), the
    CTAs in grid order."""
    _, heads, tiles_n, *rest = per_mask_head.shape
    per_q_head = per_mask_head.expand(batch, *per_mask_head.shape[1:]).repeat_interleave(q_heads // heads, dim=1)
    grouped = per_q_head.reshape(batch, kv_heads, q_heads // kv_heads, tiles_n, *rest)
    return grouped.sum(dim=2, dtype=torch.int32).reshape(-1, *rest)


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


def split_parts(steps: torch.Tensor, sms: int, max_parts: int, slack_pct: int, slots: int) -> torch.Tensor:
    """int32 [C]: how many parts (1, 2 or 4, at most `max_parts`) each backward CTA of `steps` (grid
    order) is split into. A CTA costs its steps + 2 (its fixed and part costs) and starts, in a
    fluid grid-order schedule on `sms` SMs, when the CTAs before it have used (their cost) / sms; it
    splits in 2 if it would end past the deadline, (1 + `slack_pct` / 100) x the ideal makespan, and
    in 4 if half of it would too. Only a prefix of the split CTAs, up to `slots` parts in all, keeps
    its split: the CTAs near the front, which delay the most. Integer math (x 100 sms), no host
    sync; `slack_pct` -100 makes the deadline 0 (every CTA splits)."""
    if max_parts not in (2, 4):
        raise ValueError(f"max_parts must be 2 or 4, got {max_parts!r}")
    cost = steps.to(torch.int64) + 2
    start = torch.cumsum(cost, 0) - cost  # x sms
    deadline = (100 + slack_pct) * cost.sum()  # x 100 sms
    parts = torch.where(100 * (start + cost * sms) > deadline, 2, 1)
    if max_parts == 4:
        parts = torch.where(100 * (2 * start + cost * sms) > 2 * deadline, 4, parts)
    split = torch.where(parts > 1, parts, 0)
    return torch.where(torch.cumsum(split, 0) <= slots, parts, 1).to(torch.int32)


def balanced_bounds(cum: torch.Tensor, parts: torch.Tensor) -> torch.Tensor:
    """int64 [C, 5]: per CTA, the query-tile bounds of its parts (part p takes [bounds[p],
    bounds[p + 1]); the bounds past its `parts` are Tm), from `cum` (int32 [C, Tm], each CTA's
    inclusive prefix sums of steps over its query tiles). Each inner bound is the last tile
    boundary at or before p / parts of the CTA's steps, or the next one; of these 8 choices, the
    one whose parts' steps spread least. Rounding every bound down (or to the nearest) can leave
    parts up to 2 G - 1 steps apart when the G query heads of a KV group see different tiles; the
    best choice kept them within G in a brute-force check (G <= 8, up to 20 tiles; not proven)."""
    ctas, tiles = cum.shape
    parts = parts.to(torch.int64)[:, None]
    p = torch.arange(1, 4, device=cum.device)
    target = torch.minimum(p, parts) * cum[:, -1:] // parts
    below = torch.searchsorted(cum, target.to(cum.dtype), right=True)  # [C, 3]
    choice = (torch.arange(8, device=cum.device)[:, None] >> torch.arange(3, device=cum.device)) & 1  # [8, 3]
    inner = torch.where(choice.bool(), (below + 1).clamp(max=tiles)[:, None], below[:, None])  # [C, 8, 3]
    edges = torch.zeros(ctas, 8, 1, dtype=torch.int64, device=cum.device)
    bounds = torch.cat([edges, inner, edges + tiles], dim=-1)  # [C, 8, 5]
    prefix = torch.cat([torch.zeros_like(cum[:, :1]), cum], dim=1)
    sizes = prefix.gather(1, bounds.view(ctas, -1)).view(ctas, 8, 5).diff(dim=-1).to(torch.int64)
    used = torch.arange(4, device=cum.device) < parts[:, :, None]
    most = torch.iinfo(torch.int64).max
    spread = torch.where(used, sizes, 0).amax(-1) - torch.where(used, sizes, most).amin(-1)
    best = torch.where((bounds.diff(dim=-1) >= 0).all(-1), spread, most).argmin(-1)
    return bounds[torch.arange(ctas, device=cum.device), best]


def backward_split_plan(
    mask: ColumnMask,
    batch: int,
    q_heads: int,
    kv_heads: int,
    tile_m: int,
    tile_n: int,
    sms: int,
    max_parts: int,
    slack_pct: int,
    slots: int,
) -> torch.Tensor:
    """int32 [C + `slots`, 4]: the split backward's work table, one row per launched CTA in launch
    order, `(cta, tile_lo, tile_hi, split)`. `cta` is the grid index (key tile + Tn * (KV head +
    kv_heads * batch)), non-decreasing; the CTA walks its query tiles in [tile_lo, tile_hi) for each
    query head of its KV group. An unsplit CTA is one row (cta, 0, Tm, -1); one split by
    `split_parts` into P parts is P rows, part p with split = first_slot * 16 + p * 4 + P - 1, its
    dK/dV slots [first_slot, first_slot + P) below `slots`. The parts cut the CTA's query tiles into
    runs of about equal steps (`balanced_bounds`). The rows past the used ones are idle, (-1, 0, 0,
    -1), launched last. No host sync; C x Tm x q_heads // kv_heads elements at most."""
    seen = (~mask.block_skip(tile_m, tile_n)).transpose(2, 3)  # [Bm, Hm, Tn, Tm]
    cum = torch.cumsum(_summed_per_cta(seen, batch, q_heads, kv_heads), dim=-1, dtype=torch.int32)  # [C, Tm]
    ctas = cum.shape[0]
    parts = split_parts(cum[:, -1], sms, max_parts, slack_pct, slots).to(torch.int64)
    bounds = balanced_bounds(cum, parts)
    end = torch.cumsum(parts, 0)
    row = torch.arange(ctas + slots, device=cum.device)
    cta = torch.searchsorted(end, row, right=True)
    live = cta < ctas
    cta = cta.clamp(max=ctas - 1)
    part = (row - end[cta] + parts[cta]).clamp(max=3)  # idle rows: any part, masked below
    split = torch.where(parts > 1, parts, 0)
    first_slot = torch.cumsum(split, 0) - split
    code = torch.where(parts[cta] > 1, first_slot[cta] * 16 + part * 4 + parts[cta] - 1, -1)
    columns = (cta, bounds[cta, part], bounds[cta, part + 1], code)
    return torch.stack([torch.where(live, c, idle) for c, idle in zip(columns, (-1, 0, 0, -1))], dim=1).to(torch.int32)


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
    kept = _kept(boundaries)
    key = (mask.causal, mask.seqlen_q, key)
    state = _state(boundaries)
    entry = kept.get(key)
    if entry is None or entry[0] != state:
        entry = kept[key] = (state, compute())
    return entry[1]


def moved_plans(source: ColumnMask, target: ColumnMask, move: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Keep for `target` (`source`'s boundaries moved, e.g. to the GPU) what `kept_per_mask` keeps
    for `source` and is still current, each tensor moved by `move`, each mask in it (a segment
    plan's virtual mask) moved with what is kept for it in turn."""
    source_boundaries = source.startend_row_indices
    kept = _per_mask.get(id(source_boundaries), {})
    current = _state(source_boundaries)
    target_kept, target_state = _kept(target.startend_row_indices), _state(target.startend_row_indices)
    for key, (state, value) in list(kept.items()):
        if state == current:
            target_kept[key] = (target_state, _moved(value, move))


def moved_mask(mask: ColumnMask, move: Callable[[torch.Tensor], torch.Tensor]) -> ColumnMask:
    """`mask` with its boundaries moved by `move` (e.g. to the GPU), with what `kept_per_mask`
    keeps for it (`moved_plans`)."""
    moved = ColumnMask._unchecked(move(mask.startend_row_indices), mask.causal, mask.seqlen_q, mask.segmented)
    moved_plans(mask, moved, move)
    return moved


def _moved(value: Any, move: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """`value` (a kept plan: tensors, masks, tuples and dataclasses of them, numbers) moved."""
    if isinstance(value, torch.Tensor):
        return move(value)
    if isinstance(value, ColumnMask):
        return moved_mask(value, move)
    if isinstance(value, tuple):
        return tuple(_moved(item, move) for item in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: _moved(getattr(value, f.name), move) for f in dataclasses.fields(value) if f.init}
        return dataclasses.replace(value, **fields)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"a kept plan of type {type(value).__name__} cannot be moved (tensors, masks, tuples, dataclasses)")


def _kept(boundaries: torch.Tensor) -> dict[Hashable, tuple[Hashable, Any]]:
    """What is kept for the boundaries tensor `boundaries`, dropped when it is freed."""
    kept = _per_mask.get(id(boundaries))
    if kept is None:
        kept = _per_mask[id(boundaries)] = {}
        weakref.finalize(boundaries, _per_mask.pop, id(boundaries), None)
    return kept


def _state(boundaries: torch.Tensor) -> Hashable:
    """What a kept result was computed from: the tensor's version (None for an inference tensor),
    shape and storage."""
    version = None if torch.is_inference(boundaries) else boundaries._version
    return version, tuple(boundaries.shape), boundaries.data_ptr()


def cached_block_minmax(mask: ColumnMask, tile_n: int) -> torch.Tensor:
    """`block_minmax(mask, tile_n)`, kept per mask by `kept_per_mask`: computed once for the layers
    of a training step (their calls share the mask), not at every call, forward and backward."""
    return kept_per_mask(mask, ("block_minmax", tile_n), lambda: block_minmax(mask, tile_n), keep_unversioned=False)


def cached_longest_first(
    mask: ColumnMask, key: Hashable, steps: Callable[[], torch.Tensor], buckets: int = 0
) -> torch.Tensor:
    """`longest_first(steps(), buckets)`, kept per mask and `key` (which must fix the kernel's grid)
    by `kept_per_mask`: the sort's few dozen small kernels then run once per mask, not once per
    layer. An order only permutes the kernel's work units, so one kept past an in-place change that
    no version records (inference tensors) still gives the same numbers."""
    return kept_per_mask(mask, (key, buckets), lambda: longest_first(steps(), buckets))
