"""`ColumnMask` constructors from packing metadata, O(S) on the metadata's device.

Packed documents are given as a training batch carries them: FlashAttention's `cu_seqlens`
(document boundaries, [N + 1] or [B, N + 1]), per-token `document_ids` ([S] or [B, S]; a document
is a run of equal ids) or HF-style `position_ids` ([S] or [B, S], restarting at 0 at each
document). Everything is vectorized torch on the metadata's device and no value is read on the
host, so building a mask from GPU metadata costs no sync; the values of CPU metadata are checked,
which costs nothing there. The masks are built unchecked: their boundaries are valid by
construction.

In the batched `cu_seqlens` form every row has N + 1 entries: pad a row with fewer documents by
repeating its last entry (empty documents). Tokens after `cu_seqlens[-1]` form one more document.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple, Sequence, TypeGuard

import numpy as np
import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from .mask import ColumnMask

IndexLike = torch.Tensor | Sequence[int]


class MaskConstructors:
    """`ColumnMask`'s constructors from packing metadata, mixed into it (they build each mask
    with its `_unchecked`)."""

    if TYPE_CHECKING:

        @classmethod
        def _unchecked(
            cls, startend_row_indices: torch.Tensor, causal: bool, seqlen_q: int, segmented: bool = False
        ) -> ColumnMask: ...

    @classmethod
    def causal_document(
        cls,
        cu_seqlens: IndexLike | None = None,
        *,
        document_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        seqlen: int | None = None,
    ) -> ColumnMask:
        """Causal attention within each packed document: query i sees key j iff j <= i, same document.

        Give exactly one of `cu_seqlens`, `document_ids`, `position_ids` (see the module
        docstring). `seqlen` defaults to the last `cu_seqlens` entry, which reads it on the host:
        pass it to avoid that read for GPU metadata. Equals `masks.build("causal_document")` for
        the same documents.
        """
        _, end = _documents(cu_seqlens, document_ids, position_ids, seqlen)
        return cls._from_vectors([end], causal=True, segmented=True)

    @classmethod
    def document(
        cls,
        cu_seqlens: IndexLike | None = None,
        *,
        document_ids: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        seqlen: int | None = None,
    ) -> ColumnMask:
        """Bidirectional attention within each packed document: query i sees key j iff same document.

        Arguments as for `causal_document`. Equals `masks.build("document")` for the same
        documents.
        """
        start, end = _documents(cu_seqlens, document_ids, position_ids, seqlen)
        return cls._from_vectors([end, start], causal=False, segmented=True)

    @classmethod
    def prefix_lm_document(
        cls, cu_seqlens: IndexLike, prefix_lens: IndexLike, *, seqlen: int | None = None
    ) -> ColumnMask:
        """Prefix-LM within each packed document: the first `prefix_lens[d]` tokens of document d
        are seen by the whole document, the rest causally (query i sees key j iff same document
        and (j < start + prefix or j <= i)).

        `prefix_lens` has one entry per document: the shape of `cu_seqlens` with one entry fewer
        in the last dim; a prefix longer than its document covers it. `seqlen` as for
        `causal_document`. Equals `masks.build("prefix_lm_document")` for the same documents and
        prefixes.
        """
        seg = _segments(cu_seqlens, seqlen)
        prefix = _per_segment(prefix_lens, "prefix_lens", cu_seqlens)
        if prefix.is_floating_point() or prefix.dtype == torch.bool:
            raise TypeError(f"prefix_lens must hold integers, got {prefix.dtype}")
        if prefix.device.type == "cpu" and bool((prefix < 0).any()):
            raise ValueError(f"prefix_lens must be >= 0, got {prefix.tolist()}")
        prefix = F.pad(prefix, (0, 1), value=0).to(seg.start.device)  # none after cu_seqlens[-1]
        prefix_end = torch.minimum(seg.start + prefix.gather(-1, seg.segment), seg.end)
        j = torch.arange(seg.start.shape[-1], device=seg.start.device)
        # Prefix keys are seen from the document's first row, the others from their own row.
        return cls._from_vectors([seg.end, torch.where(j < prefix_end, seg.start, j)], causal=False, segmented=True)

    @classmethod
    def share_question(
        cls, cu_seqlens: IndexLike, is_question: torch.Tensor | Sequence[bool], *, seqlen: int | None = None
    ) -> ColumnMask:
        """Shared-question packing, causal: each question is seen by the answers that follow it,
        each answer only by itself.

        `cu_seqlens` are the boundaries of the segments (every question and every answer is one)
        and `is_question` flags, one per segment (the shape of `cu_seqlens` with one entry fewer
        in the last dim), which segments are questions. A document runs from a question to the
        next question. Query i sees key j iff j <= i and either j is in i's segment or j is in the
        question of i's document. Equals `masks.build("share_question")` for the same documents.
        """
        seg = _segments(cu_seqlens, seqlen)
        questions = _per_segment(is_question, "is_question", cu_seqlens)
        if questions.dtype != torch.bool:
            raise TypeError(f"is_question must be bool, got {questions.dtype}")
        # The tokens after cu_seqlens[-1] count as a question of their own.
        questions = F.pad(questions, (0, 1), value=True).to(seg.cu.device)
        s = seg.start.shape[-1]
        # Mark where every question starts, empty ones too: they still open a document.
        starts = torch.where(questions, seg.cu, s)
        marks = torch.zeros(*starts.shape[:-1], s + 1, dtype=torch.bool, device=starts.device)
        marks = marks.scatter(-1, starts, True)[..., :s]
        next_question = _next_start(marks)
        in_question = questions.gather(-1, seg.segment)
        return cls._from_vectors([torch.where(in_question, next_question, seg.end)], causal=True, segmented=True)

    @classmethod
    def sliding_window(
        cls, seqlen: int, window: int, causal: bool = True, *, device: torch.device | str | None = None
    ) -> ColumnMask:
        """Each query sees the `window` keys ending at itself: key j visible from query i iff
        i - window < j <= i; with `causal=False` also the window - 1 keys after it (|i - j| < window).

        FlashAttention's `window_size=(left, right)` shows key j to query i iff
        i - left <= j <= i + right, so this is `window_size=(window - 1, 0)` with `causal=True`
        and `(window - 1, window - 1)` without. Equals `masks.build("sliding_window", window=...)`.
        """
        seqlen, window = check_int("seqlen", seqlen, 1), check_int("window", window, 1)
        check_flag("causal", causal)
        return cls._band(seqlen, seqlen, window - 1, window - 1, causal, device=device)

    @classmethod
    def global_sliding_window(
        cls, seqlen: int, window: int, global_tokens: int, *, device: torch.device | str | None = None
    ) -> ColumnMask:
        """A bidirectional band plus global tokens: query i sees key j iff |i - j| <= window, or
        i < global_tokens, or j < global_tokens.

        Note `window` counts the keys on each side, not counting the query (FlashAttention's
        `window_size=(window, window)`), as in `masks.build("global_sliding_window", window=...)`,
        which this equals.
        """
        seqlen = check_int("seqlen", seqlen, 1)
        window, global_tokens = check_int("window", window, 0), check_int("global_tokens", global_tokens, 0)
        j = torch.arange(seqlen, device=device)
        is_global = j < global_tokens
        narrow = j < global_tokens + window + 1  # no rows between the global ones and the band
        lts = torch.where(is_global, 0, (j + window + 1).clamp(max=seqlen))
        lte = torch.where(is_global, 0, seqlen)
        uts = torch.where(narrow, 0, min(global_tokens, seqlen))
        ute = torch.where(narrow, 0, j - window)
        return cls._from_vectors([lts, lte, uts, ute], causal=False)

    @classmethod
    def _band(
        cls,
        seqlen_q: int,
        seqlen_k: int,
        left: int,
        right: int,
        causal: bool,
        *,
        cu_seqlens: torch.Tensor | None = None,
        cu_seqlens_k: torch.Tensor | None = None,
        device: torch.device | str | None = None,
    ) -> ColumnMask:
        """FlashAttention's `window_size=(left, right)`: query i sees key j iff
        i' - left <= j <= i' + right, i' = i + Sk - Sq (bottom-right aligned), -1 = unbounded;
        `causal` hides the keys after i'; with `cu_seqlens` (Sq = Sk) only within each document.
        With `cu_seqlens_k` too, `cu_seqlens` packs the queries and `cu_seqlens_k` the keys of the
        same documents (`_varlen_bounds`).
        """
        if cu_seqlens_k is not None:
            if cu_seqlens is None:
                raise ValueError("cu_seqlens_k needs cu_seqlens, the queries' packing of the same documents")
            bounds = _varlen_bounds((seqlen_q, seqlen_k), (cu_seqlens, cu_seqlens_k), (left, right), causal)
            return cls._from_vectors(bounds, False, seqlen_q)
        if cu_seqlens is not None:
            device = cu_seqlens.device
        # The query row i' of each key column j is j - (Sk - Sq): the window's rows count from it.
        diagonal = torch.arange(seqlen_k, device=device) - (seqlen_k - seqlen_q)
        if cu_seqlens is None:
            start, end = torch.zeros_like(diagonal), torch.full_like(diagonal, seqlen_q)
        else:
            start, end = _documents(cu_seqlens, None, None, seqlen_q)
        vectors = [end if left < 0 else torch.minimum(end, diagonal + left + 1)]
        if not causal:
            vectors.append(start if right < 0 else torch.maximum(start, diagonal - right))
        segmented = cu_seqlens is not None
        return cls._from_vectors([v.clamp(0, seqlen_q) for v in vectors], causal, seqlen_q, segmented)

    @classmethod
    def _from_vectors(
        cls, vectors: list[torch.Tensor], causal: bool, seqlen_q: int | None = None, segmented: bool = False
    ) -> ColumnMask:
        """The mask of boundary vectors [Sk] or [B, Sk] (valid by construction); Sq = Sk by default.
        `segmented`: the constructor's documents are independent segments (`ColumnMask.segmented`)."""
        idx = torch.stack(vectors, dim=-1).to(torch.int32)
        idx = idx.reshape(idx.shape[:-2].numel(), 1, *idx.shape[-2:])  # not view(-1, ...): Sk may be 0
        return cls._unchecked(idx, causal, idx.shape[-2] if seqlen_q is None else seqlen_q, segmented)


def _varlen_bounds(
    seqlens: tuple[int, int], packings: tuple[torch.Tensor, torch.Tensor], window: tuple[int, int], causal: bool
) -> list[torch.Tensor]:
    """The non-causal two-bound vectors [hi, lo] of FlashAttention's varlen attention where queries
    and keys are packed differently: `seqlens` (total_q, total_k), `packings` (cu_seqlens_q,
    cu_seqlens_k): document d holds queries [cu_seqlens_q[d], cu_seqlens_q[d + 1]) and keys
    [cu_seqlens_k[d], cu_seqlens_k[d + 1]); causal and the `window` (left, right) are aligned
    bottom-right within each document. Tokens after the last boundary form one more document on
    each side. A key column's visible query rows are the interval [lo, hi): its document's rows cut
    by its diagonal row and the window. The packings must be of one shape (`varlen_attention`
    checks)."""
    (seqlen_q, seqlen_k), (cu_seqlens_q, cu_seqlens_k), (left, right) = seqlens, packings, window
    keys = _segments(cu_seqlens_k, seqlen_k, "cu_seqlens_k", "total_k")
    queries = _segments(cu_seqlens_q, seqlen_q, "cu_seqlens_q", "total_q")
    bounds_q = F.pad(queries.cu, (0, 1), value=seqlen_q)
    document = keys.segment  # [B, Sk]: each key's document
    rows_start, rows_end = bounds_q.gather(-1, document), bounds_q.gather(-1, document + 1)
    # The query row of each key column j: its document's last query row lines up with its last key.
    diagonal = torch.arange(seqlen_k, device=keys.cu.device) - keys.end + rows_end
    hi = rows_end if left < 0 else torch.minimum(rows_end, diagonal + left + 1)
    lowest = diagonal if causal else (None if right < 0 else diagonal - right)
    lo = rows_start if lowest is None else torch.maximum(rows_start, lowest)
    return [hi.clamp(0, seqlen_q), lo.clamp(0, seqlen_q)]


def _documents(
    cu_seqlens: IndexLike | None,
    document_ids: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    seqlen: int | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """First token and one past the last token of each token's document, int64 [B, S] each."""
    given = {"cu_seqlens": cu_seqlens, "document_ids": document_ids, "position_ids": position_ids}
    given = {name: value for name, value in given.items() if value is not None}
    if len(given) != 1:
        raise ValueError(
            "give exactly one of cu_seqlens, document_ids, position_ids; got " + (", ".join(given) if given else "none")
        )
    if cu_seqlens is not None:
        seg = _segments(cu_seqlens, seqlen)
        return seg.start, seg.end
    name, ids = next(iter(given.items()))
    if not isinstance(ids, torch.Tensor) or ids.dim() not in (1, 2) or ids.shape[-1] < 1:
        shape = tuple(ids.shape) if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise ValueError(f"{name} must be a tensor [S] or [B, S] with S >= 1, got {shape}")
    if ids.is_floating_point() or ids.dtype == torch.bool:
        raise TypeError(f"{name} must hold integers, got {ids.dtype}")
    if seqlen is not None and seqlen != ids.shape[-1]:
        raise ValueError(f"seqlen={seqlen} but {name} has {ids.shape[-1]} tokens")
    ids = ids.reshape(-1, ids.shape[-1])
    if name == "document_ids":
        first = ids[:, 1:] != ids[:, :-1]
    else:
        first = ids[:, 1:] == 0
    starts = F.pad(first, (1, 0), value=True)
    t = torch.arange(ids.shape[-1], device=ids.device)
    return torch.where(starts, t, 0).cummax(-1).values, _next_start(starts)


def _next_start(starts: torch.Tensor) -> torch.Tensor:
    """For each token, the first marked position after it (S if none), int64 [B, S]."""
    s = starts.shape[-1]
    marked = torch.where(starts, torch.arange(s, device=starts.device), s)
    after = F.pad(marked[..., 1:], (0, 1), value=s)
    return after.flip(-1).cummin(-1).values.flip(-1)


class _CuSegments(NamedTuple):
    """Per token, int64 [B, S]: its segment's index, first token and end; `cu` [B, N + 1], clamped."""

    segment: torch.Tensor
    start: torch.Tensor
    end: torch.Tensor
    cu: torch.Tensor


def _segments(
    cu_seqlens: IndexLike, seqlen: int | None, name: str = "cu_seqlens", length_name: str = "seqlen"
) -> _CuSegments:
    """The segments of `cu_seqlens` over `seqlen` tokens; errors name the arguments `name` and
    `length_name`."""
    cu = _as_index_tensor(cu_seqlens, name)
    if cu.dim() not in (1, 2) or cu.shape[-1] < 2:
        raise ValueError(f"{name} must be [N + 1] or [B, N + 1] with N >= 1, got shape {tuple(cu.shape)}")
    cu = cu.reshape(-1, cu.shape[-1]).to(torch.int64)
    if seqlen is None:
        seqlen = int(cu[:, -1].max())  # a host read: pass seqlen for GPU metadata
    check_int("seqlen", seqlen, 1)
    if cu.device.type == "cpu":
        if bool((cu[:, 0] != 0).any()):
            raise ValueError(f"{name} must start at 0, got {cu[:, 0].tolist()}")
        if bool((cu[:, 1:] < cu[:, :-1]).any()):
            raise ValueError(f"{name} must be non-decreasing, got {cu.tolist()}")
        if bool((cu[:, -1] > seqlen).any()):
            raise ValueError(f"{name} must end at or before {length_name}={seqlen}, got {cu[:, -1].tolist()}")
    # The clamps keep the boundaries and gathers in range for unchecked (GPU) metadata.
    cu = cu.clamp(0, seqlen)
    t = torch.arange(seqlen, device=cu.device).expand(cu.shape[0], seqlen).contiguous()
    index = (torch.searchsorted(cu.contiguous(), t, right=True) - 1).clamp(min=0)
    bounds = F.pad(cu, (0, 1), value=seqlen)  # the tokens after cu_seqlens[-1] end at seqlen
    return _CuSegments(index, bounds.gather(-1, index), bounds.gather(-1, index + 1), bounds[:, :-1])


def _per_segment(values: IndexLike | Sequence[bool], name: str, cu_seqlens: IndexLike) -> torch.Tensor:
    """`values`, one per segment of cu_seqlens, as [B, N]."""
    values = torch.as_tensor(values) if not isinstance(values, torch.Tensor) else values
    expected = tuple(torch.as_tensor(cu_seqlens).shape)
    expected = expected[:-1] + (expected[-1] - 1,)
    if tuple(values.shape) != expected:
        raise ValueError(
            f"{name} must have one entry per segment of cu_seqlens, shape {expected}, got {tuple(values.shape)}"
        )
    return values.reshape(-1, values.shape[-1])


def _as_index_tensor(values: IndexLike, name: str) -> torch.Tensor:
    if not isinstance(values, torch.Tensor):
        values = torch.as_tensor(values)
    if values.is_floating_point() or values.dtype == torch.bool:
        raise TypeError(f"{name} must hold integers, got {values.dtype}")
    return values


def check_flag(name: str, value: object) -> None:
    """A bool argument: a truthy string or number is a TypeError naming `name`, not True."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")


def is_int(value: object) -> TypeGuard[int | np.integer]:
    """Whether `value` is an integer argument: a Python or numpy int, not a bool."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def check_count(name: str, value: object) -> int | None:
    """`value` None or an int (Python or numpy, not bool) >= 1, as a plain Python int; else a
    ValueError naming `name` (an optional limit or count)."""
    if value is None:
        return None
    if not is_int(value) or value < 1:
        raise ValueError(f"{name} must be a positive int or None, got {value!r}")
    return int(value)


def check_int(name: str, value: object, low: int, high: int | None = None) -> int:
    """`value` an int (Python or numpy, not bool) >= `low` and, if given, <= `high`, as a plain
    Python int (what a mask stores); else a ValueError naming `name` and the accepted range."""
    if not is_int(value) or value < low or (high is not None and value > high):
        accepted = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be an int {accepted}, got {value!r}")
    return int(value)
