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

from .constructors import MaskConstructors, check_flag, check_int

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


@dataclass(frozen=True, eq=False)
class ColumnMask(MaskConstructors):
    """A FlashMask column-wise attention mask.

    Args:
        startend_row_indices: int32 [B, H or 1, Sk, 1|2|4] row boundaries, values in [0, seqlen_q].
        causal: causal variant (keys after the query are masked too).
        seqlen_q: number of query rows the boundaries index.
        segmented: the rows split into independent segments (packed documents: no row sees a key
            of another segment), as the constructors from packing metadata and `masks.build`'s
            document masks say. A hint, never read from the boundaries: where it is set, the cute
            forward aligns its tiles to the segments (exact for any mask; faster where it holds).

    The constructor checks the boundaries, which reads them on the host (a sync on a GPU). The
    constructors from packing metadata (`ColumnMask.causal_document`, `.document`,
    `.sliding_window`, ...) build valid boundaries on the metadata's device and skip that check.
    Two masks are equal when their variant, seqlen_q, device and boundaries are equal.
    """

    startend_row_indices: torch.Tensor
    causal: bool
    seqlen_q: int
    segmented: bool = False

    def __post_init__(self) -> None:
        idx = self.startend_row_indices
        if not isinstance(idx, torch.Tensor):
            raise TypeError(f"startend_row_indices must be a torch.Tensor, got {type(idx).__name__}")
        if idx.dtype != torch.int32:
            raise TypeError(f"startend_row_indices must be int32, got {idx.dtype}")
        if idx.dim() != 4:
            raise ValueError(f"startend_row_indices must be 4-D [B, H or 1, Sk, 1|2|4], got shape {tuple(idx.shape)}")
        check_flag("causal", self.causal)
        allowed = _VARIANTS[self.causal]
        if idx.shape[-1] not in allowed:
            raise ValueError(
                f"startend_row_indices last dim must be one of {allowed} when causal={self.causal}, got {idx.shape[-1]}"
            )
        check_flag("segmented", self.segmented)
        # A numpy int is taken as the constructors take it, and stored as a plain int.
        object.__setattr__(self, "seqlen_q", check_int("seqlen_q", self.seqlen_q, 1))
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

    @classmethod
    def _unchecked(
        cls, startend_row_indices: torch.Tensor, causal: bool, seqlen_q: int, segmented: bool = False
    ) -> ColumnMask:
        """A mask from boundaries this package computed: no validation, so no device sync."""
        mask = object.__new__(cls)
        object.__setattr__(mask, "startend_row_indices", startend_row_indices)
        object.__setattr__(mask, "causal", causal)
        object.__setattr__(mask, "seqlen_q", seqlen_q)
        object.__setattr__(mask, "segmented", segmented)
        return mask

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ColumnMask):
            return NotImplemented
        a, b = self.startend_row_indices, other.startend_row_indices
        return (
            self.causal == other.causal
            and self.seqlen_q == other.seqlen_q
            and a.device == b.device
            and a.shape == b.shape
            and torch.equal(a, b)
        )

    def __hash__(self) -> int:
        # Equal masks agree on all of these, and none of them reads the boundaries.
        return hash((self.causal, self.seqlen_q, tuple(self.startend_row_indices.shape), str(self.device)))

    # -- shape ----------------------------------------------------------------------------------
    @property
    def batch(self) -> int:
        """B of `startend_row_indices` [B, H or 1, Sk, k]: 1 (broadcast) or the batch size."""
        return self.startend_row_indices.shape[0]

    @property
    def heads(self) -> int:
        """Mask heads (H of `startend_row_indices`): 1 (broadcast), the kv heads or the q heads."""
        return self.startend_row_indices.shape[1]

    @property
    def seqlen_k(self) -> int:
        """Number of key columns Sk (one boundary row per key)."""
        return self.startend_row_indices.shape[2]

    @property
    def shape(self) -> torch.Size:
        """(batch, heads, seqlen_q, seqlen_k): the dense mask's shape, as FlexAttention's
        `BlockMask.shape` (batch and heads 1 where they broadcast). With `ndim`, what a Hugging Face
        model reads of a prepared `attention_mask`, so a model call takes the mask as it is."""
        return torch.Size((self.batch, self.heads, self.seqlen_q, self.seqlen_k))

    @property
    def ndim(self) -> int:
        """4, the dense mask's dimensions (see `shape`)."""
        return 4

    @property
    def device(self) -> torch.device:
        """The device of `startend_row_indices`."""
        return self.startend_row_indices.device

    def to(self, device: torch.device | str, non_blocking: bool = False) -> ColumnMask:
        """The same mask with its boundaries on `device` (unchecked: they are already valid);
        `non_blocking` as `torch.Tensor.to`: from pinned memory (`pin_memory`) the copy does not
        wait for the GPU, so a data loader's host stays ahead of the training step."""
        idx = self.startend_row_indices.to(device, non_blocking=non_blocking)
        return ColumnMask._unchecked(idx, self.causal, self.seqlen_q, self.segmented)

    def pin_memory(self) -> ColumnMask:
        """The same mask with its boundaries in page-locked host memory (for `to(..., non_blocking=True)`)."""
        return ColumnMask._unchecked(self.startend_row_indices.pin_memory(), self.causal, self.seqlen_q, self.segmented)

    def check_compatible(self, batch: int, heads_q: int, heads_kv: int, seqlen_q: int, seqlen_k: int) -> None:
        """Raise a ValueError naming the mismatch if this mask cannot apply to q/k of these sizes."""
        if self.seqlen_q != seqlen_q:
            raise ValueError(f"mask.seqlen_q={self.seqlen_q} but q has seqlen {seqlen_q}")
        if self.seqlen_k != seqlen_k:
            raise ValueError(f"startend_row_indices has Sk={self.seqlen_k} but k has seqlen {seqlen_k}")
        if self.batch not in (1, batch):
            accepted = _one_of({1: "", batch: "q's batch size"})
            raise ValueError(f"startend_row_indices batch dim must be {accepted}, got {self.batch}")
        if self.heads not in (1, heads_kv, heads_q):
            accepted = _one_of({1: "", heads_kv: "kv heads", heads_q: "q heads"})
            raise ValueError(f"startend_row_indices head dim must be {accepted}, got {self.heads}")

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
        skip, partial = self._block_skip_partial(block_m, block_n)
        classes = torch.full(skip.shape, UNMASKED, dtype=torch.int8, device=self.device)
        classes[partial] = PARTIAL
        classes[skip] = SKIP
        counts = torch.bincount(classes.flatten().to(torch.int64), minlength=3).tolist()
        return BlockClasses(classes, counts[SKIP], counts[PARTIAL], counts[UNMASKED])

    def block_skip(self, block_m: int = 128, block_n: int = 128) -> torch.Tensor:
        """bool [B, Hm, Tm, Tn]: the SKIP tiles of `block_classes`, on the mask's device without a
        host sync (no counts)."""
        return self._block_skip_partial(block_m, block_n)[0]

    def _block_skip_partial(self, block_m: int, block_n: int) -> tuple[torch.Tensor, torch.Tensor]:
        check_int("block_m", block_m, 1)
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
        return skip, partial

    def block_bounds(self, block_n: int) -> torch.Tensor:
        """Per-key-block min/max of each interval bound, int32 [8, B, Hm, Tn].

        Order: LTS min/max, LTE min/max, UTS min/max, UTE min/max. A ragged last block repeats its
        last column, which leaves its min/max unchanged.
        """
        check_int("block_n", block_n, 1)
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
        """Exact conversion of a dense bool mask (True = attend), [Sq, Sk] or [B, H, Sq, Sk], every
        dim >= 1.

        `causal=None` picks the causal variant when every key after its query (bottom-right
        aligned) is masked and the causal variant can hold the rest, else the non-causal one.
        Raises ValueError naming a column whose masked rows do not fit the variant (more than two
        runs, or rows visible above the causal diagonal). Reads the mask in chunks of query rows,
        so the working memory is that of one chunk.
        """
        if not isinstance(mask, torch.Tensor):
            raise TypeError(f"mask must be a bool torch.Tensor (True = attend), got {type(mask).__name__}")
        if mask.dtype != torch.bool:
            raise TypeError(f"mask must be a bool tensor (True = attend), got {mask.dtype}")
        if mask.dim() not in (2, 4) or 0 in mask.shape:
            raise ValueError(
                f"mask must be [Sq, Sk] or [B, H, Sq, Sk] with every dim >= 1 (at least one query row and "
                f"one key column), got shape {tuple(mask.shape)}"
            )
        if mask.dim() == 2:
            mask = mask[None, None]
        batch, heads, sq, sk = mask.shape
        return _convert(lambda rows: mask[..., rows, :], batch, heads, sq, sk, causal, mask.device)

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

        `mask_mod` is called on broadcast index tensors (b [B, 1, 1, 1], h [1, H, 1, 1],
        q_idx [1, 1, rows, 1], kv_idx [1, 1, 1, Sk]) on `device`, one chunk of query rows at a time,
        as FlexAttention's `create_block_mask` evaluates block by block: no [Sq, Sk] tensor is ever
        made. The result is converted exactly as `from_dense` does, raising if it is not
        representable. Returns a mask of batch `batch` and `heads` heads. `batch`, `heads`,
        `seqlen_q` and `seqlen_k` are ints >= 1.
        """
        batch, heads, seqlen_q, seqlen_k = (
            check_int(name, value, 1)
            for name, value in (("batch", batch), ("heads", heads), ("seqlen_q", seqlen_q), ("seqlen_k", seqlen_k))
        )
        device = torch.device(device)
        b = torch.arange(batch, device=device).view(-1, 1, 1, 1)
        h = torch.arange(heads, device=device).view(1, -1, 1, 1)
        kv = torch.arange(seqlen_k, device=device).view(1, 1, 1, -1)

        def attend(rows: slice) -> torch.Tensor:
            q = torch.arange(rows.start, rows.stop, device=device).view(1, 1, -1, 1)
            return torch.as_tensor(mask_mod(b, h, q, kv), device=device).to(torch.bool)

        mask = _convert(attend, batch, heads, seqlen_q, seqlen_k, causal, device)
        idx = mask.startend_row_indices.expand(batch, heads, -1, -1).contiguous()
        return ColumnMask._unchecked(idx, mask.causal, seqlen_q)


def _one_of(counts: dict[int, str]) -> str:
    """'1', '1 or 4 (q heads)', '1, 2 (kv heads) or 4 (q heads)': each accepted count once (equal
    counts share a key), 1 (broadcast) unlabelled."""
    items = [f"{n} ({what})" if n != 1 else "1" for n, what in counts.items()]
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " or " + items[-1]


_CHUNK_ELEMENTS = 1 << 22
"""Dense mask elements (batch x heads x rows x Sk) converted at a time by `from_dense` and
`from_mask_mod`."""


def _convert(
    attend_rows: Callable[[slice], torch.Tensor],
    batch: int,
    heads: int,
    seqlen_q: int,
    seqlen_k: int,
    causal: bool | None,
    device: torch.device,
) -> ColumnMask:
    """Exact ColumnMask of the dense mask that `attend_rows(rows)` gives chunk by chunk.

    `attend_rows` returns bool (True = attend) broadcastable to [B or 1, H or 1, rows, Sk].
    `causal=None`: the causal variant where it can hold the mask, else the non-causal one.
    """
    if causal is not None and not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool or None, got {type(causal).__name__}")
    chunk = max(1, _CHUNK_ELEMENTS // (batch * heads * seqlen_k))
    switches = _ColumnSwitches(seqlen_q, seqlen_k, device)
    for row0 in range(0, seqlen_q, chunk):
        rows = slice(row0, min(row0 + chunk, seqlen_q))
        attend = attend_rows(rows)
        attend = attend[(None,) * (4 - attend.dim())]
        attend = attend.expand(*attend.shape[:2], rows.stop - row0, seqlen_k)
        if causal is not False:
            seen = _first_visible_above_diagonal(attend, row0, seqlen_k - seqlen_q)
            if seen is not None and causal:
                b, h, r, c = seen
                raise ValueError(f"mask is not causal: query {r} attends key {c} (batch {b}, head {h})")
            if seen is not None:
                causal = False
        switches.add(attend, row0)
    if causal is None:  # nothing seen above the diagonal: causal if its single run per column fits
        try:
            return switches.column_mask(True)
        except ValueError:
            causal = False  # the non-causal variant's two runs may hold it; if not, its error names a column
    return switches.column_mask(causal)


def _first_visible_above_diagonal(attend: torch.Tensor, row0: int, offset: int) -> tuple[int, ...] | None:
    """(batch, head, query, key) of an attended key after its query in this chunk, or None."""
    rows, sk = attend.shape[-2:]
    key0 = max(row0 + offset + 1, 0)  # keys before it are on or below the diagonal for every row
    if key0 >= sk:
        return None
    r = torch.arange(row0, row0 + rows, device=attend.device).view(-1, 1)
    c = torch.arange(key0, sk, device=attend.device).view(1, -1)
    above = attend[..., key0:] & (c > r + offset)
    if not bool(above.any()):
        return None
    b, h, i, j = (int(x) for x in above.nonzero()[0])
    return b, h, row0 + i, key0 + j


class _ColumnSwitches:
    """The rows where each key column switches between attended and masked, fed chunk by chunk.

    Above row 0 every column counts as attended, so a column's switches alternate run start, run
    end. The rows of the first four (two masked runs) are kept and all are counted: O(Sk) memory
    for any number of rows.
    """

    def __init__(self, seqlen_q: int, seqlen_k: int, device: torch.device):
        self.seqlen_q, self.seqlen_k = seqlen_q, seqlen_k
        self.first = torch.full((1, 1, seqlen_k, 4), seqlen_q, dtype=torch.int64, device=device)
        self.count = torch.zeros(1, 1, seqlen_k, dtype=torch.int64, device=device)
        self.last = torch.ones(1, 1, seqlen_k, dtype=torch.bool, device=device)  # the row above

    def add(self, attend: torch.Tensor, row0: int) -> None:
        """Take rows [row0, row0 + rows) of the mask, attend bool [B or 1, H or 1, rows, Sk]."""
        shape = tuple(max(a, s) for a, s in zip(attend.shape[:2], self.count.shape[:2]))
        if shape != tuple(self.count.shape[:2]):  # the first chunk that depends on b or h
            self.first = self.first.expand(*shape, -1, -1).clone()
            self.count = self.count.expand(*shape, -1).clone()
            self.last = self.last.expand(*shape, -1)
        attend = attend.expand(*shape, -1, -1)
        switch = torch.empty(attend.shape, dtype=torch.bool, device=attend.device)
        torch.ne(attend[..., :1, :], self.last.unsqueeze(-2), out=switch[..., :1, :])
        torch.ne(attend[..., 1:, :], attend[..., :-1, :], out=switch[..., 1:, :])
        self.last = attend[..., -1, :].clone()
        b, h, r, c = switch.nonzero(as_tuple=True)
        column = (b * shape[1] + h) * self.seqlen_k + c
        # nonzero lists each column's switches by ascending row; a stable sort keeps that order.
        column, order = column.sort(stable=True)
        within = torch.arange(len(column), device=column.device) - torch.searchsorted(column, column)
        rank = self.count.view(-1)[column] + within
        keep = rank < 4
        self.first.view(-1)[column[keep] * 4 + rank[keep]] = r[order][keep] + row0
        self.count.view(-1).index_add_(0, column, torch.ones_like(column))

    def column_mask(self, causal: bool) -> ColumnMask:
        """The ColumnMask of the rows seen, in its smallest variant; ValueError if none fits."""
        sq, sk = self.seqlen_q, self.seqlen_k
        s1, e1, s2, e2 = self.first.unbind(-1)  # a missing run is the empty [Sq, Sq)
        runs = (self.count + 1) // 2
        if causal:
            # Rows above the diagonal are masked in every column, so the first run starts at row
            # 0; the causal part covers those rows: the run keeps the rows from the diagonal on,
            # and goes if none are left.
            diagonal = (torch.arange(sk, device=s1.device) - (sk - sq)).clamp(0, sq)
            s1 = torch.maximum(s1, diagonal)
            gone = (runs > 0) & (s1 == e1)
            s1, e1 = torch.where(gone, s2, s1), torch.where(gone, e2, e1)
            runs = runs - gone.to(runs.dtype)
        bad = runs > (1 if causal else 2)
        if bool(bad.any()):
            b, h, c = (int(x) for x in bad.nonzero()[0])
            raise ValueError(
                f"mask is not representable as a {'causal' if causal else 'non-causal'} ColumnMask: "
                f"key column {c} (batch {b}, head {h}) has {int(runs[b, h, c])} masked row runs"
            )
        if causal:
            vecs = [s1] if bool((e1 == sq).all()) else [s1, e1]
        else:
            # Two runs: the upper one is UT, the lower one LT. One run is UT if it starts at row
            # 0 and stops short of the end (so prefixes fit the 2-vector form), else LT.
            two, one = runs == 2, runs == 1
            upper = one & (s1 == 0) & (e1 < sq)
            lower = one & ~upper
            lts = torch.where(two, s2, torch.where(lower, s1, sq))
            lte = torch.where(two, e2, torch.where(lower, e1, sq))
            uts = torch.where(two, s1, 0)
            ute = torch.where(two | upper, e1, 0)
            vecs = [lts, ute] if bool(((lte == sq) & (uts == 0)).all()) else [lts, lte, uts, ute]
        idx = torch.stack(vecs, dim=-1).to(torch.int32).contiguous()
        return ColumnMask._unchecked(idx, causal, sq)
