"""Query and key tiles aligned to the mask's independent segments (as varlen kernels align to documents).

A mask over Sq = Sk often splits into independent segments: rows of one segment see no key of
another (packed documents, share-question and prefix-LM documents). Tiles aligned to the sequence
straddle the segment boundaries: such a query tile needs key tiles of two segments, and a segment
starting mid-tile shares its first key tile with its neighbour, partially masked on both sides.
Aligned tiles (FA4's varlen) take fewer key-tile steps, fewer of them masked.

`segment_plan` keeps the kernels' mask machinery as it is and moves the alignment into the
addressing: each segment is padded to a multiple of `granule` rows in a *virtual* sequence, the
mask is mapped there (its boundaries through the monotone map from real to virtual rows; padding
keys are masked for every row), and a table gives, per granule of the virtual sequence, its real
first row and how many real rows it holds. A kernel then tiles the virtual sequence as before,
loads Q/K/V from the real rows of each tile and stores only a tile's real rows.

Exactness: a monotone map keeps every masked interval and the causal comparison between real rows
and keys, and padding keys are masked, so real rows get the same result. Padding rows between two
segments are masked for every key too (the segments are independent), which the backward needs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..reference import ColumnMask
from .tile_plan import kept_per_mask

GRANULE = 128
"""Rows per virtual granule: the forward's query tile, a multiple of every key tile and query step."""


@dataclass(frozen=True)
class SegmentPlan:
    """A mask mapped to segment-aligned virtual rows (see the module's docstring).

    `mask`: the virtual mask, int32 [Bm, Hm, Sv, width], Sq = Sk = Sv (a multiple of `granule`).
    `tile_rows`: int32 [Bm, Hm, Sv / granule, 2], per granule its real first row and its number of
    real rows (0 for the granules past a mask row's segments; their first row is then Sq).
    """

    mask: ColumnMask
    tile_rows: torch.Tensor
    granule: int

    @property
    def seqlen(self) -> int:
        return self.mask.seqlen_q


def segment_starts(mask: ColumnMask, min_len: int = GRANULE) -> torch.Tensor:
    """bool [Bm, Hm, S]: the rows that start a segment (row 0 always). A boundary b splits the mask
    where no key before b is seen by a row from b on and no key from b on by a row before b; it is
    kept where a piece next to it (between candidate boundaries) holds at least `min_len` rows, so
    runs of short pieces stay one segment (padding each would cost more than it saves)."""
    if mask.seqlen_q != mask.seqlen_k:
        raise ValueError(f"segments need Sq = Sk, got Sq={mask.seqlen_q}, Sk={mask.seqlen_k}")
    lo, hi = _seen_by(mask)
    s = mask.seqlen_k
    before = torch.cummax(hi, dim=-1).values  # at j: the last row that sees a key <= j
    after = torch.flip(torch.cummin(torch.flip(lo, (-1,)), dim=-1).values, (-1,))  # at j: first row seeing a key >= j
    rows = torch.arange(s, device=mask.device)
    candidate = torch.zeros_like(lo, dtype=torch.bool)
    candidate[..., 1:] = (before[..., :-1] < rows[1:]) & (after[..., 1:] >= rows[1:])
    at = torch.where(candidate, rows, 0)
    previous = torch.cummax(at, dim=-1).values  # the candidate at or before each row (0: none)
    previous = torch.cat([torch.zeros_like(previous[..., :1]), previous[..., :-1]], dim=-1)
    at_next = torch.where(candidate, rows, s)
    following = torch.flip(torch.cummin(torch.flip(at_next, (-1,)), dim=-1).values, (-1,))
    following = torch.cat([following[..., 1:], torch.full_like(following[..., :1], s)], dim=-1)
    keep = candidate & (((rows - previous) >= min_len) | ((following - rows) >= min_len))
    keep[..., 0] = True
    return keep


def _seen_by(mask: ColumnMask) -> tuple[torch.Tensor, torch.Tensor]:
    """int64 [Bm, Hm, Sk] each: per key, the first and the last row that sees it (Sq and -1: none).
    The rows seeing a key are [base, Sq) less the two masked intervals, whose pieces start at base
    or an interval's end and end at Sq - 1 or before an interval's start."""
    lts, lte, uts, ute = (v.to(torch.int64) for v in mask.intervals())
    sq = mask.seqlen_q
    base = torch.zeros_like(lts)
    if mask.causal:
        base = base + torch.arange(mask.seqlen_k, device=mask.device) - (mask.seqlen_k - sq)

    def seen(row: torch.Tensor) -> torch.Tensor:
        hidden = ((row >= lts) & (row < lte)) | ((row >= uts) & (row < ute))
        return (row >= base) & (row >= 0) & (row < sq) & ~hidden

    first = torch.full_like(lts, sq)
    for row in (base.clamp(min=0), lte, ute):
        first = torch.where(seen(row), torch.minimum(first, row), first)
    last = torch.full_like(lts, -1)
    for row in (torch.full_like(lts, sq - 1), lts - 1, uts - 1):
        last = torch.where(seen(row), torch.maximum(last, row), last)
    return first, last


def segment_plan(
    mask: ColumnMask, granule: int = GRANULE, min_len: int = GRANULE, max_boundaries: int | None = None
) -> SegmentPlan:
    """The mask on segment-aligned virtual rows, each segment padded to a multiple of `granule`.

    Without `max_boundaries`, one host sync (the virtual length, which fixes the grids). With it,
    none: only the first `max_boundaries` segment boundaries of each mask row are kept (its later
    rows stay one segment), each pads fewer than `granule` rows, so the virtual length is fixed at
    S + (granule - 1) * max_boundaries rounded up to a granule; the granules past a row's segments
    hold no real row. `cached_segment_plan` keeps a plan per mask."""
    s = mask.seqlen_k
    starts = segment_starts(mask, min_len)
    if max_boundaries is not None:
        starts = starts & (torch.cumsum(starts, dim=-1) <= max_boundaries + 1)  # row 0 and the first ones
    rows = torch.arange(s, device=mask.device)
    start_of = torch.cummax(torch.where(starts, rows, 0), dim=-1).values  # each row's segment start
    # At a segment's first row, the padding that closes the segment before it.
    previous_start = torch.cat([torch.zeros_like(start_of[..., :1]), start_of[..., :-1]], dim=-1)
    closing = torch.where(starts & (rows > 0), (previous_start - rows) % granule, 0)
    virtual = rows + torch.cumsum(closing, dim=-1)  # int64 [Bm, Hm, S]: each real row's virtual row
    ends = virtual[..., -1] + 1 + (start_of[..., -1] - s) % granule  # [Bm, Hm]: padded length
    if max_boundaries is None:
        sv = int(ends.max())  # the host sync
    else:
        sv = capped_length(s, max_boundaries, granule)
    bm, hm, _, width = mask.startend_row_indices.shape

    # Boundaries: an interval's start x maps to one past row x - 1's virtual row, its end x to row
    # x's virtual row (Sq: the virtual end), so each interval keeps exactly its real rows and the
    # padding between two segments lies inside an interval iff the boundary between them does.
    def mapped_start(x: torch.Tensor) -> torch.Tensor:
        return torch.where(x > 0, torch.gather(virtual, -1, (x - 1).clamp(min=0)) + 1, 0)

    def mapped_end(x: torch.Tensor) -> torch.Tensor:
        return torch.where(x < s, torch.gather(virtual, -1, x.clamp(max=s - 1)), sv)

    idx = mask.startend_row_indices.to(torch.int64).expand(bm, hm, s, width)
    columns = [(mapped_start if c % 2 == 0 else mapped_end)(idx[..., c]) for c in range(width)]
    # Padding keys: masked for every row, with the bounds of a key whose rows ended with its
    # segment's real rows (X, one past them), so a tile's min/max still shows the segments apart.
    ended = torch.zeros(bm, hm, sv, dtype=torch.int64, device=mask.device)
    ended.scatter_(2, virtual.expand(bm, hm, s), virtual.expand(bm, hm, s) + 1)
    x = torch.cummax(ended, dim=-1).values
    full = torch.full_like(x, sv)
    padding = {(True, 1): [x], (True, 2): [x, full], (False, 2): [x, x], (False, 4): [x, full, 0 * x, x]}
    virtual_idx = torch.stack(padding[(mask.causal, width)], dim=-1)
    virtual_idx.scatter_(2, virtual.unsqueeze(-1).expand(bm, hm, s, width), torch.stack(columns, dim=-1))

    tiles = sv // granule
    tile_index = virtual // granule
    tile_rows = torch.zeros(bm, hm, tiles, 2, dtype=torch.int64, device=mask.device)
    tile_rows[..., 1].scatter_add_(2, tile_index, torch.ones_like(tile_index))
    # A granule's first row: the real row at its first virtual row (padding never starts one).
    first = (virtual % granule) == 0
    first_rows = torch.full((bm, hm, tiles + 1), s, dtype=torch.int64, device=mask.device)
    first_rows.scatter_(2, torch.where(first, tile_index, tiles), torch.where(first, rows, s))
    tile_rows[..., 0] = first_rows[..., :tiles]
    virtual_mask = ColumnMask._unchecked(virtual_idx.to(torch.int32), mask.causal, sv)
    return SegmentPlan(virtual_mask, tile_rows.to(torch.int32).contiguous(), granule)


def query_tile_rows(plan: SegmentPlan, tile: int, batch: int, heads: int) -> torch.Tensor:
    """int32 [batch, heads, Sv / tile, 2]: `plan.tile_rows` per `tile`-row query tile (a divisor of
    the granule) for each batch element and query head (mask batch 1 or `batch`, mask heads
    dividing `heads`), as the backward's kernels index them."""
    rows = plan.tile_rows.to(torch.int64)
    first, count = rows[..., :1], rows[..., 1:]
    offsets = torch.arange(0, plan.granule, tile, device=rows.device)
    per_tile = torch.stack([first + offsets, (count - offsets).clamp(0, tile)], dim=-1)  # [Bm, Hm, Tv, parts, 2]
    per_tile = per_tile.flatten(2, 3).to(torch.int32)
    per_tile = per_tile.expand(batch, -1, -1, -1).repeat_interleave(heads // plan.mask.heads, dim=1)
    return per_tile.contiguous()


def loaded_rows(plan: SegmentPlan) -> torch.Tensor:
    """int64 [Bm, Hm, Sv]: the real row each virtual row is loaded from (a tile's real first row
    plus its place in the tile; Sq or more reads zeros), as the kernels' loads do."""
    start = plan.tile_rows[..., 0].to(torch.int64)
    offsets = torch.arange(plan.granule, device=start.device)
    return (start.unsqueeze(-1) + offsets).flatten(-2)


def stored_rows(plan: SegmentPlan) -> torch.Tensor:
    """bool [Bm, Hm, Sv]: the virtual rows whose results are stored (a tile's real rows)."""
    count = plan.tile_rows[..., 1].to(torch.int64)
    offsets = torch.arange(plan.granule, device=count.device)
    return (offsets < count.unsqueeze(-1)).flatten(-2)


def capped_length(seqlen: int, max_boundaries: int, granule: int = GRANULE) -> int:
    """The virtual length of a plan keeping `max_boundaries` boundaries per mask row: each pads
    fewer than `granule` rows, rounded up to a granule."""
    return -(-(seqlen + (granule - 1) * max_boundaries) // granule) * granule


ROWS_PER_BOUNDARY = 2048
"""The forward's plans keep up to S / this many segment boundaries per mask row (at least
`MIN_BOUNDARIES`): packed documents of 2K tokens or more on average are all aligned, and the
virtual sequence, fixed without a host sync, is S / 16 rows longer than the real one from S =
16K on for S a multiple of 2,048 (1,024 rows below, up to 1,143 for lengths not a multiple of
128); its granules past the segments hold no real row, and the forward's mask role draws past
them."""
MIN_BOUNDARIES = 8


def kernel_boundaries(seqlen: int) -> int:
    """The segment boundaries per mask row the forward's plans keep at this sequence length."""
    return max(MIN_BOUNDARIES, seqlen // ROWS_PER_BOUNDARY)


def forward_virtual_length(seqlen: int) -> int:
    """The virtual rows of the forward's plans (`cached_segment_plan(mask, synced=False)`) for
    Sq = Sk = `seqlen`, known without the mask: the grid of a forward on segment tiles."""
    return capped_length(seqlen, kernel_boundaries(seqlen))


def cached_segment_plan(mask: ColumnMask, synced: bool) -> SegmentPlan:
    """The mask's plan, kept per mask by `tile_plan.kept_per_mask` (the layers of a training step
    share their mask, so the plan's kernels run once per mask, not once per layer). `synced`: every
    segment aligned and the virtual length read on the host (one sync per mask; the backward's
    steps, which would walk the capped plan's empty granules), else the first
    `kernel_boundaries(S)` boundaries and no sync (the forward's tiles). Not kept for an inference
    tensor, whose in-place changes record no version (a stale plan, unlike a stale work order,
    would give wrong numbers)."""
    cap = None if synced else kernel_boundaries(mask.seqlen_k)
    return kept_per_mask(
        mask, ("segments", cap), lambda: segment_plan(mask, max_boundaries=cap), keep_unversioned=False
    )
