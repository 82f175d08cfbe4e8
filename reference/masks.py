"""The 12 benchmark masks of the FlashMask paper, built as `ColumnMask`s.

The construction follows the FlashMask benchmark harness: documents are sampled per sequence
(3-7 docs at <= 8K tokens, 10-14 at <= 32K, 11-15 beyond), sliding windows are S/16 wide, 16 global
tokens, prefix S/2, share-question docs are 1 question + 2-6 answers, random eviction starts at
row S/2 and differs per head. Every mask is seeded: the same arguments give the same mask.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from .constructors import check_int
from .mask import ColumnMask

MASK_NAMES = (
    "full",
    "causal",
    "sliding_window",
    "causal_document",
    "document",
    "share_question",
    "global_sliding_window",
    "causal_blockwise",
    "prefix_lm_document",
    "prefix_lm_causal",
    "qk_sparse",
    "random_eviction",
)


def doc_count_range(seqlen: int) -> tuple[int, int]:
    """Inclusive range of sampled document counts per sequence length (the paper's)."""
    if seqlen <= 8192:
        return 3, 7
    if seqlen <= 32768:
        return 10, 14
    return 11, 15


def split_lengths(rng: np.random.Generator, total: int, parts: int) -> list[int]:
    """Random composition of `total` into `parts` positive lengths."""
    parts = max(1, min(parts, total))
    cuts: np.ndarray | list[int] = (
        np.sort(rng.choice(np.arange(1, total), size=parts - 1, replace=False)) if parts > 1 else []
    )
    edges = [0, *[int(c) for c in cuts], total]
    return [edges[i + 1] - edges[i] for i in range(parts)]


def sample_docs(rng: np.random.Generator, seqlen: int, num_docs: int | None) -> list[int]:
    """Random lengths of the packed documents of one sequence, summing to `seqlen`: `num_docs` of
    them (at most `seqlen`), or a count drawn from `doc_count_range(seqlen)` where None."""
    lo, hi = doc_count_range(seqlen)
    n = num_docs if num_docs is not None else int(rng.integers(lo, hi + 1))
    return split_lengths(rng, seqlen, n)


def _starts_ends(lengths: list[int]) -> tuple[np.ndarray, np.ndarray]:
    ends = np.cumsum(lengths)
    return ends - np.asarray(lengths), ends


def _per_column(lengths: list[int], per_doc: np.ndarray) -> np.ndarray:
    """Expand a per-doc value to every key column of that doc."""
    return np.repeat(per_doc, lengths)


def _full(S, rng):
    return [np.full(S, S), np.zeros(S, np.int64)], False


def _causal(S, rng):
    return [np.full(S, S)], True


def _sliding_window(S, rng, window=None):
    w = window if window is not None else max(1, S // 16)
    return [np.minimum(np.arange(S) + w, S)], True


def _causal_document(S, rng, num_docs=None):
    lengths = sample_docs(rng, S, num_docs)
    _, ends = _starts_ends(lengths)
    return [_per_column(lengths, ends)], True


def _document(S, rng, num_docs=None):
    lengths = sample_docs(rng, S, num_docs)
    starts, ends = _starts_ends(lengths)
    return [_per_column(lengths, ends), _per_column(lengths, starts)], False


def _share_question(S, rng, num_docs=None):
    lts, doc_start = [], 0
    for length in sample_docs(rng, S, num_docs):
        doc_end = doc_start + length
        parts = split_lengths(rng, length, int(rng.integers(2, 7)) + 1)
        lts.append(np.full(parts[0], doc_end))  # question: seen by every answer of its doc
        part_end = doc_start + parts[0]
        for part in parts[1:]:
            part_end += part
            lts.append(np.full(part, part_end))  # answer: seen only by itself
        doc_start = doc_end
    return [np.concatenate(lts)], True


def _global_sliding_window(S, rng, window=None, global_tokens=16):
    w = window if window is not None else max(1, S // 16)
    g = global_tokens
    j = np.arange(S)
    lts = np.minimum(j + w + 1, S)
    lte = np.full(S, S)
    uts = np.full(S, g)
    ute = j - w
    lts[:g] = lte[:g] = 0  # global keys: seen by every query
    narrow = j < g + w + 1  # upper interval [g, j - w) would be empty
    uts[narrow] = ute[narrow] = 0
    return [lts, lte, uts, ute], False


def _causal_blockwise(S, rng, num_docs=None):
    lengths = sample_docs(rng, S, num_docs)
    starts, ends = _starts_ends(lengths)
    last_start = starts[-1]
    lts = _per_column(lengths, ends)
    lte = np.where(np.arange(S) < last_start, last_start, S)  # the last doc sees every demo
    return [lts, lte], True


def _prefix_lm_document(S, rng, num_docs=None):
    lengths = sample_docs(rng, S, num_docs)
    starts, ends = _starts_ends(lengths)
    prefix = np.asarray([int(rng.integers(1, n + 1)) for n in lengths])
    j = np.arange(S)
    in_prefix = j < _per_column(lengths, starts + prefix)
    ute = np.where(in_prefix, _per_column(lengths, starts), j)  # prefix keys: whole doc; rest: causal
    return [_per_column(lengths, ends), ute], False


def _prefix_lm_causal(S, rng, prefix=None):
    p = prefix if prefix is not None else S // 2
    j = np.arange(S)
    return [np.full(S, S), np.where(j < p, 0, j)], False


def _qk_sparse(S, rng, num_docs=None):
    lengths = sample_docs(rng, S, num_docs)
    starts, ends = _starts_ends(lengths)
    flags = rng.random(len(lengths)) < 0.5
    if not flags.any():
        flags[int(rng.integers(len(lengths)))] = True
    j = np.arange(S)
    lts, lte = j.copy(), j.copy()  # empty intervals outside masked-out spans
    for start, end, flag in zip(starts, ends, flags):
        if flag:  # tokens of a masked-out span do not see each other
            lte[start:end] = end
    return [lts, lte], True


def _random_eviction(S, rng, evict_start=None):
    r = evict_start if evict_start is not None else S // 2
    lts = np.full(S, S)
    chosen = rng.choice(S - 1, size=S - r, replace=False) if S > 1 else np.zeros(0, np.int64)
    lts[chosen] = r + np.arange(len(chosen))  # the k-th chosen key is evicted from row r + k on
    return [lts], True


_BUILDERS: dict[str, Callable] = {
    "full": _full,
    "causal": _causal,
    "sliding_window": _sliding_window,
    "causal_document": _causal_document,
    "document": _document,
    "share_question": _share_question,
    "global_sliding_window": _global_sliding_window,
    "causal_blockwise": _causal_blockwise,
    "prefix_lm_document": _prefix_lm_document,
    "prefix_lm_causal": _prefix_lm_causal,
    "qk_sparse": _qk_sparse,
    "random_eviction": _random_eviction,
}
_PER_HEAD = {"random_eviction"}
_SEGMENTED = {"causal_document", "document", "share_question", "prefix_lm_document"}  # independent documents


def _accepted_params(name: str, seqlen: int) -> dict[str, tuple[int, int | None]]:
    """The parameters mask `name` takes, each with its smallest and largest value (None: no limit)."""
    docs: dict[str, tuple[int, int | None]] = {"num_docs": (1, seqlen)}  # every document holds at least one token
    accepted: dict[str, dict[str, tuple[int, int | None]]] = {
        "full": {},
        "causal": {},
        "sliding_window": {"window": (1, None)},  # window 0 would hide every key; past S: causal
        "causal_document": docs,
        "document": docs,
        "share_question": docs,
        "global_sliding_window": {"window": (0, None), "global_tokens": (0, None)},
        "causal_blockwise": docs,
        "prefix_lm_document": docs,
        "prefix_lm_causal": {"prefix": (0, seqlen)},
        "qk_sparse": docs,
        "random_eviction": {"evict_start": (1, seqlen)},  # a key per row from there, of the first S - 1
    }
    return accepted[name]


def build(
    name: str,
    seqlen: int,
    batch: int = 1,
    heads: int = 1,
    seed: int = 0,
    device: torch.device | str = "cpu",
    **params,
) -> ColumnMask:
    """Build benchmark mask `name` for Sq = Sk = `seqlen`.

    Every batch element gets its own document sample; `random_eviction` also differs per head
    (mask heads = `heads`), the others have one mask head. Parameters, each only for the masks
    that use it (None or absent: the paper's default):

    - `num_docs` in [1, seqlen] (document masks; default sampled, 3-7 at <= 8K tokens, ...);
    - `window`: >= 1 for `sliding_window`, >= 0 for `global_sliding_window` (default seqlen/16);
    - `global_tokens` >= 0 (`global_sliding_window`, default 16);
    - `prefix` in [0, seqlen] (`prefix_lm_causal`, default seqlen/2);
    - `evict_start` in [1, seqlen] (`random_eviction`, default seqlen/2).

    Any other name, or a value out of its range, is a ValueError naming it.
    """
    if name not in _BUILDERS:
        raise ValueError(f"unknown mask name {name!r}; accepted: {', '.join(MASK_NAMES)}")
    seqlen = check_int("seqlen", seqlen, 2)
    batch, heads, seed = check_int("batch", batch, 1), check_int("heads", heads, 1), check_int("seed", seed, 0)
    accepted = _accepted_params(name, seqlen)
    params = {key: value for key, value in params.items() if value is not None}
    for key, value in params.items():
        if key not in accepted:
            raise ValueError(
                f"mask {name!r} takes no parameter {key!r}; its parameters: {', '.join(accepted) or 'none'}"
            )
        params[key] = check_int(f"{key} (mask {name!r}, seqlen {seqlen})", value, *accepted[key])
    mask_heads = heads if name in _PER_HEAD else 1
    rows, causal = [], True
    for b in range(batch):
        per_head = []
        for h in range(mask_heads):
            rng = np.random.default_rng([seed, b, h])
            vecs, causal = _BUILDERS[name](seqlen, rng, **params)
            per_head.append(np.stack([np.clip(v, 0, seqlen) for v in vecs], axis=-1))
        rows.append(np.stack(per_head))
    idx = torch.from_numpy(np.stack(rows).astype(np.int32)).to(device)
    return ColumnMask(idx, causal, seqlen, segmented=name in _SEGMENTED)
