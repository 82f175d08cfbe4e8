"""FlashMask's column-wise mask format (`ColumnMask`) and its exact semantics.

For key column j, query rows in [LTS_j, LTE_j) U [UTS_j, UTE_j) are masked (half-open).
`startend_row_indices` is int32 [B, H or 1, Sk, k]; `causal` and k pick the variant:

    causal=True,  k=1: [LTS]                 LT = [LTS, Sq)
    causal=True,  k=2: [LTS, LTE]            LT = [LTS, LTE)
    causal=False, k=2: [LTS, UTE]            LT = [LTS, Sq), UT = [0, UTE)
    causal=False, k=4: [LTS, LTE, UTS, UTE]  LT = [LTS, LTE), UT = [UTS, UTE)

Causal masks also hide keys after the query, aligned bottom-right when Sq != Sk
(query i sees key j only if j <= i + Sk - Sq), as FlashAttention >= 2.1 does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch

SKIP, PARTIAL, UNMASKED = 0, 1, 2
"""Tile classes of `ColumnMask.block_classes`."""

_VARIANTS = {True: (1, 2), False: (2, 4)}


class Intervals(NamedTuple):
    """The four boundary vectors with the variant's defaults filled in, each int32 [B, Hm, Sk]."""

    lts: torch.Tensor
    lte: torch.Tensor
    uts: torch.Tensor
    ute: torch.Tensor


class BlockClasses(NamedTuple):
    """Per-tile classes (int8 [B, Hm, Tm, Tn] of SKIP / PARTIAL / UNMASKED) and their counts."""

    classes: torch.Tensor
    skip: int
    partial: int
    unmasked: int


@dataclass(frozen=True)
class ColumnMask:
    """A FlashMask column-wise attention mask.

    Args:
        startend_row_indices: int32 [B, H or 1, Sk, 1|2|4] row boundaries, values in [0, seqlen_q].
        causal: causal variant (keys after the query are masked too).
        seqlen_q: number of query rows the boundaries index.
    """

    startend_row_indices: torch.Tensor
    causal: bool
    seqlen_q: int

    def __post_init__(self) -> None:
        idx = self.startend_row_indices
        if not isinstance(idx, torch.Tensor):
            raise TypeError(f"startend_row_indices must be a torch.Tensor, got {type(idx).__name__}")
        if idx.dtype != torch.int32:
            raise TypeError(f"startend_row_indices must be int32, got {idx.dtype}")
        if idx.dim() != 4:
            raise ValueError(
                f"startend_row_indices must be 4-D [B, H or 1, Sk, 1|2|4], got shape {tuple(idx.shape)}"
            )
        if not isinstance(self.causal, bool):
            raise TypeError(f"causal must be a bool, got {type(self.causal).__name__}")
        allowed = _VARIANTS[self.causal]
        if idx.shape[-1] not in allowed:
            raise ValueError(
                f"startend_row_indices last dim must be one of {allowed} when causal={self.causal}, "
                f"got {idx.shape[-1]}"
            )
        if not isinstance(self.seqlen_q, int) or self.seqlen_q < 1:
            raise ValueError(f"seqlen_q must be a positive int, got {self.seqlen_q!r}")
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) > self.seqlen_q):
            raise ValueError(
                f"startend_row_indices values must lie in [0, seqlen_q={self.seqlen_q}], "
                f"got min {int(idx.min())}, max {int(idx.max())}"
            )
        iv = self.intervals()
        for name, start, end in (("LTS > LTE", iv.lts, iv.lte), ("UTS > UTE", iv.uts, iv.ute)):
            bad = start > end
            if bool(bad.any()):
                b, h, j = (int(x) for x in bad.nonzero()[0])
                raise ValueError(
                    f"startend_row_indices has an interval with start > end ({name}) "
                    f"at batch {b}, head {h}, key {j}: [{int(start[b, h, j])}, {int(end[b, h, j])})"
                )

    # -- shape ----------------------------------------------------------------------------------
    @property
    def batch(self) -> int:
        return self.startend_row_indices.shape[0]

    @property
    def heads(self) -> int:
        return self.startend_row_indices.shape[1]

    @property
    def seqlen_k(self) -> int:
        return self.startend_row_indices.shape[2]

    @property
    def device(self) -> torch.device:
        return self.startend_row_indices.device

    def to(self, device: torch.device | str) -> ColumnMask:
        return ColumnMask(self.startend_row_indices.to(device), self.causal, self.seqlen_q)

    def check_compatible(self, batch: int, heads_q: int, heads_kv: int, seqlen_q: int, seqlen_k: int) -> None:
        """Raise a ValueError naming the mismatch if this mask cannot apply to q/k of these sizes."""
        if self.seqlen_q != seqlen_q:
            raise ValueError(f"mask.seqlen_q={self.seqlen_q} but q has seqlen {seqlen_q}")
        if self.seqlen_k != seqlen_k:
            raise ValueError(f"startend_row_indices has Sk={self.seqlen_k} but k has seqlen {seqlen_k}")
        if self.batch not in (1, batch):
            raise ValueError(f"startend_row_indices batch dim must be 1 or {batch}, got {self.batch}")
        if self.heads not in (1, heads_kv, heads_q):
            raise ValueError(
                f"startend_row_indices head dim must be 1, {heads_kv} (kv heads) or {heads_q} (q heads), "
                f"got {self.heads}"
            )

    # -- semantics ------------------------------------------------------------------------------
    def intervals(self) -> Intervals:
        """LT = [lts, lte) and UT = [uts, ute) for every key column, variant defaults filled in."""
        idx = self.startend_row_indices
        cols = idx.unbind(-1)
        full = torch.full_like(cols[0], self.seqlen_q)
        zero = torch.zeros_like(cols[0])
        if self.causal:
            lte = cols[1] if len(cols) == 2 else full
            return Intervals(cols[0], lte, zero, zero)
        if len(cols) == 2:
            return Intervals(cols[0], full, zero, cols[1])
        return Intervals(*cols)

    def _causal_offset(self) -> int:
        return self.seqlen_k - self.seqlen_q

    def masked(self, rows: torch.Tensor, cols: torch.Tensor | None = None) -> torch.Tensor:
        """Element mask (True = masked) of query `rows` against key `cols`, bool [B, Hm, len(rows), len(cols)]."""
        iv = self.intervals()
        if cols is not None:
            iv = Intervals(*(v.index_select(-1, cols) for v in iv))
        else:
            cols = torch.arange(self.seqlen_k, device=self.device)
        r = rows.to(self.device).view(1, 1, -1, 1)
        lts, lte, uts, ute = (v.unsqueeze(-2) for v in iv)
        hidden = ((r >= lts) & (r < lte)) | ((r >= uts) & (r < ute))
        if self.causal:
            hidden = hidden | (cols.view(1, 1, 1, -1) > r + self._causal_offset())
        return hidden

    def to_dense(self) -> torch.Tensor:
        """Dense bool mask [B, Hm, Sq, Sk], True = attend. O(Sq*Sk) memory: for checks and small sizes."""
        return ~self.masked(torch.arange(self.seqlen_q, device=self.device))

    def visible_counts(self) -> torch.Tensor:
        """Number of attended query rows per key column, int64 [B, Hm, Sk], computed in O(Sk)."""
        iv = self.intervals()
        sq = self.seqlen_q
        lo = torch.zeros_like(iv.lts, dtype=torch.int64)
        if self.causal:
            j = torch.arange(self.seqlen_k, device=self.device)
            lo = (j - self._causal_offset()).clamp(0, sq).expand_as(lo).to(torch.int64)
        lts, lte, uts, ute = (v.to(torch.int64) for v in iv)

        def overlap(a0, a1, b0, b1):
            return (torch.minimum(a1, b1) - torch.maximum(a0, b0)).clamp(min=0)

        top = torch.full_like(lo, sq)
        hidden = overlap(lts, lte, lo, top) + overlap(uts, ute, lo, top)
        # The two intervals may overlap in the 4-vector variant: count shared rows once.
        hidden -= overlap(torch.maximum(lts, lo), lte, torch.maximum(uts, lo), ute)
        return (sq - lo) - hidden

    def density(self) -> float:
        """Fraction of (query, key) pairs attended, averaged over batch and mask heads."""
        return float(self.visible_counts().sum()) / (self.visible_counts().numel() * self.seqlen_q)

    def block_classes(self, block_m: int = 128, block_n: int = 128) -> BlockClasses:
        """Classify every (query tile, key tile) as SKIP, PARTIAL or UNMASKED.

        Uses only the per-key-block min/max of each boundary vector, as FlashMask's kernels do:
        SKIP tiles are fully masked and UNMASKED tiles fully visible (both exact); PARTIAL tiles
        need the element mask (conservative: a PARTIAL tile may turn out full or empty).
        """
        bounds = self.block_bounds(block_n)
        tm = -(-self.seqlen_q // block_m)
        r0 = torch.arange(tm, device=self.device) * block_m
        r1 = (r0 + block_m).clamp(max=self.seqlen_q)
        r0, r1 = r0.view(1, 1, -1, 1), r1.view(1, 1, -1, 1)

        def pair(start_min, start_max, end_min, end_max):
            s_min, s_max, e_min, e_max = (v.unsqueeze(-2) for v in (start_min, start_max, end_min, end_max))
            covers = (s_max <= r0) & (e_min >= r1)
            touches = (s_min < r1) & (e_max > r0)
            return covers, touches

        lt_full, lt_touch = pair(*bounds[0:4])
        ut_full, ut_touch = pair(*bounds[4:8])
        skip = lt_full | ut_full
        partial = lt_touch | ut_touch
        if self.causal:
            tn = bounds.shape[-1]
            c0 = (torch.arange(tn, device=self.device) * block_n).view(1, 1, 1, -1)
            c1 = (c0 + block_n).clamp(max=self.seqlen_k)
            off = self._causal_offset()
            skip = skip | (c0 > r1 - 1 + off)
            partial = partial | (c1 - 1 > r0 + off)
        classes = torch.full(skip.shape, UNMASKED, dtype=torch.int8, device=self.device)
        classes[partial] = PARTIAL
        classes[skip] = SKIP
        counts = torch.bincount(classes.flatten().to(torch.int64), minlength=3).tolist()
        return BlockClasses(classes, counts[SKIP], counts[PARTIAL], counts[UNMASKED])

    def block_bounds(self, block_n: int) -> torch.Tensor:
        """Per-key-block min/max of each interval bound, int32 [8, B, Hm, Tn].

        Order: LTS min/max, LTE min/max, UTS min/max, UTE min/max. A ragged last block repeats its
        last column, which leaves its min/max unchanged.
        """
        tn = -(-self.seqlen_k // block_n)
        pad = tn * block_n - self.seqlen_k
        out = []
        for v in self.intervals():
            if pad:
                v = torch.cat([v, v[..., -1:].expand(*v.shape[:-1], pad)], dim=-1)
            blocks = v.view(*v.shape[:-1], tn, block_n)
            out += [blocks.amin(-1), blocks.amax(-1)]
        return torch.stack(out)

    # -- conversions ----------------------------------------------------------------------------
    @staticmethod
    def from_dense(mask: torch.Tensor, causal: bool | None = None) -> ColumnMask:
        """Exact conversion of a dense bool mask (True = attend), [Sq, Sk] or [B, H, Sq, Sk].

        `causal=None` picks the causal variant when every key after its query (bottom-right
        aligned) is masked. Raises ValueError naming a column whose masked rows do not fit the
        variant (more than two runs, or rows visible above the causal diagonal).
        """
        if mask.dtype != torch.bool:
            raise TypeError(f"mask must be a bool tensor (True = attend), got {mask.dtype}")
        if mask.dim() == 2:
            mask = mask[None, None]
        if mask.dim() != 4:
            raise ValueError(f"mask must be [Sq, Sk] or [B, H, Sq, Sk], got shape {tuple(mask.shape)}")
        sq, sk = mask.shape[-2:]
        i = torch.arange(sq, device=mask.device).view(-1, 1)
        j = torch.arange(sk, device=mask.device).view(1, -1)
        above = j > i + (sk - sq)
        if causal is None:
            causal = not bool((mask & above).any())
        hidden = ~mask
        if causal:
            if bool((mask & above).any()):
                b, h, r, c = (int(x) for x in (mask & above).nonzero()[0])
                raise ValueError(f"mask is not causal: query {r} attends key {c} (batch {b}, head {h})")
            hidden = hidden & ~above  # the causal part needs no interval
        runs = _column_runs(hidden)
        (s1, e1, s2, e2), nruns = runs
        if bool((nruns > 2).any()) or (causal and bool((nruns > 1).any())):
            b, h, c = (int(x) for x in (nruns > (1 if causal else 2)).nonzero()[0])
            raise ValueError(
                f"mask is not representable as a {'causal' if causal else 'non-causal'} ColumnMask: "
                f"key column {c} (batch {b}, head {h}) has {int(nruns[b, h, c])} masked row runs"
            )
        if causal:
            if bool((e1 == sq).all()):
                vecs = [s1]
            else:
                vecs = [s1, e1]
        else:
            # Two runs: the upper one is UT, the lower one LT. One run is UT if it starts at row
            # 0 and stops short of the end (so prefixes fit the 2-vector form), else LT.
            two, one = nruns == 2, nruns == 1
            upper = one & (s1 == 0) & (e1 < sq)
            lower = one & ~upper
            lts = torch.where(two, s2, torch.where(lower, s1, sq))
            lte = torch.where(two, e2, torch.where(lower, e1, sq))
            uts = torch.where(two, s1, 0)
            ute = torch.where(two | upper, e1, 0)
            if bool(((lte == sq) & (uts == 0)).all()):
                vecs = [lts, ute]
            else:
                vecs = [lts, lte, uts, ute]
        idx = torch.stack(vecs, dim=-1).to(torch.int32)
        return ColumnMask(idx.contiguous(), bool(causal), sq)

    @staticmethod
    def from_mask_mod(
        mask_mod: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
        batch: int,
        heads: int,
        seqlen_q: int,
        seqlen_k: int,
        causal: bool | None = None,
        device: torch.device | str = "cpu",
    ) -> ColumnMask:
        """Convert a FlexAttention-style `mask_mod(b, h, q_idx, kv_idx) -> bool` (True = attend).

        Evaluates the mask densely (broadcast index tensors) and converts it exactly with
        `from_dense`, raising if it is not representable.
        """
        b = torch.arange(batch, device=device).view(-1, 1, 1, 1)
        h = torch.arange(heads, device=device).view(1, -1, 1, 1)
        q = torch.arange(seqlen_q, device=device).view(1, 1, -1, 1)
        kv = torch.arange(seqlen_k, device=device).view(1, 1, 1, -1)
        dense = torch.as_tensor(mask_mod(b, h, q, kv), device=device)
        dense = dense.to(torch.bool).expand(batch, heads, seqlen_q, seqlen_k)
        return ColumnMask.from_dense(dense, causal)


def _column_runs(hidden: torch.Tensor):
    """Start/end of the first two runs of True down each column, and the run count.

    Returns ((s1, e1, s2, e2), nruns), each [B, H, Sk]; a missing run is the empty [sq, sq).
    """
    sq = hidden.shape[-2]
    prev = torch.zeros_like(hidden)
    prev[..., 1:, :] = hidden[..., :-1, :]
    nxt = torch.zeros_like(hidden)
    nxt[..., :-1, :] = hidden[..., 1:, :]
    starts = hidden & ~prev
    ends = hidden & ~nxt
    nruns = starts.sum(-2)
    rows = torch.arange(sq, device=hidden.device).view(1, 1, -1, 1)
    start_id = torch.cumsum(starts.to(torch.int32), -2)
    end_id = torch.cumsum(ends.to(torch.int32), -2)
    out = []
    for k in (1, 2):
        s = torch.where(starts & (start_id == k), rows, sq).amin(-2)
        e = torch.where(ends & (end_id == k), rows + 1, sq).amin(-2)
        out += [s, e]
    return tuple(out), nruns
