"""Zero-communication mask localization: each rank derives its local masks from the global one.

Every rank holds the global ColumnMask (O(S) int32, replicated) and the plan. The local mask of the
rank's queries (its chunks concatenated, in increasing global order) against any set of key chunks
follows from local arithmetic only:

- keys: select the columns of the key chunks;
- rows: map every global row boundary v to the number of local rows below it. With the rank's
  chunks starting at c_0 < c_1 < ... that is the clip-shift-max rule
      local(v) = max_b ( clip(v - c_b, 0, C) + b*C  if  clip(v - c_b, 0, C) > 0  else 0 ),
  and because local rows are global rows in increasing order, local row i lies in
  [local(s), local(e)) exactly when its global row lies in [s, e).
- causal: the global diagonal hides rows [0, j) of key j; it becomes the upper interval
  [0, local(j)), so a causal mask localizes to the non-causal variant of one more interval
  (causal+1 -> non-causal+2, causal+2 -> non-causal+4).

Every combination is therefore representable: the local masks are exact, never approximations,
and no call has to be split per chunk.

With sorted chunks the max is attained by the last chunk starting below v, so `local_rows_below`
finds it by binary search: one pass over the boundaries whatever the number of chunks.
`chunk_visibility` answers, for every (query chunk, key chunk) pair at once, whether any query of
the first sees any key of the second: what a layout needs to know to prune messages.
"""

from __future__ import annotations

from typing import Sequence

import numba
import numpy as np
import torch

from ..reference import ColumnMask


def local_rows_below(values: torch.Tensor, chunk_starts: Sequence[int], chunk_size: int) -> torch.Tensor:
    """clip-shift-max: how many of the local rows (the chunks at `chunk_starts`, sorted) lie below `values`."""
    starts = torch.as_tensor(list(chunk_starts), dtype=values.dtype, device=values.device)
    if not len(starts):
        return torch.zeros_like(values)
    last = torch.searchsorted(starts, values.contiguous()) - 1  # the last chunk starting below each value
    below = last.clamp(min=0)
    inside = (values - starts[below]).clamp(max=chunk_size)
    return torch.where(last >= 0, below.to(values.dtype) * chunk_size + inside, torch.zeros_like(values))


def localize(mask: ColumnMask, q_chunks: Sequence[int], k_chunks: Sequence[int], chunk_size: int) -> ColumnMask:
    """The mask of the queries in `q_chunks` against the keys in `k_chunks` (each sorted, concatenated)."""
    if mask.seqlen_q != mask.seqlen_k:
        raise ValueError(f"context parallelism needs Sq == Sk, got {mask.seqlen_q} and {mask.seqlen_k}")
    if list(q_chunks) != sorted(q_chunks) or list(k_chunks) != sorted(k_chunks):
        raise ValueError("q_chunks and k_chunks must be sorted")
    device = mask.device
    starts = [c * chunk_size for c in q_chunks]
    first_keys = torch.as_tensor(list(k_chunks), dtype=torch.long, device=device).view(-1, 1) * chunk_size
    keys = (first_keys + torch.arange(chunk_size, device=device)).flatten()
    # Only the stored boundaries: the variants' defaults (0, Sq) localize to constants.
    stored = mask.startend_row_indices.index_select(2, keys).unbind(-1)
    vectors = [local_rows_below(v, starts, chunk_size) for v in stored]
    if mask.causal:  # [LTS] or [LTS, LTE] -> [LTS, UTE] or [LTS, LTE, UTS, UTE], the diagonal as UT
        diagonal = local_rows_below(keys, starts, chunk_size).to(torch.int32).expand_as(vectors[0])
        vectors = [vectors[0], diagonal] if len(vectors) == 1 else [*vectors, torch.zeros_like(diagonal), diagonal]
    idx = torch.stack(vectors, dim=-1).contiguous()
    # Derived from a valid mask, so valid: the checks' reads of the device would only sync the host.
    return ColumnMask._unchecked(idx, False, len(q_chunks) * chunk_size)


def chunk_visibility(mask: ColumnMask, chunk_size: int) -> np.ndarray:
    """Which key chunks each query chunk sees: bool [S / chunk_size] * 2, [query chunk, key chunk],
    true where some query row of the first sees some key of the second (any batch, any mask head).

    Exact (the dense mask's block-wise any) in O(B * Hm * S + chunks^2).
    """
    if mask.seqlen_q != mask.seqlen_k:
        raise ValueError(f"context parallelism needs Sq == Sk, got {mask.seqlen_q} and {mask.seqlen_k}")
    seqlen = mask.seqlen_q
    if seqlen % chunk_size:
        raise ValueError(f"seqlen {seqlen} must be a multiple of chunk_size {chunk_size}")
    lts, lte, uts, ute = (v.reshape(-1, seqlen).cpu().numpy() for v in mask.intervals())
    runs = _visible_runs(lts, lte, uts, ute, mask.causal, chunk_size)
    return (runs.cumsum(axis=1)[:, :-1] > 0).T


@numba.njit(cache=True)
def _visible_runs(lts, lte, uts, ute, causal: bool, chunk_size: int) -> np.ndarray:
    """Per key chunk, a difference array over query chunks (int64 [chunks, chunks + 1]) whose prefix
    sums count the keys' visible row intervals touching each query chunk.

    A key's hidden rows are two intervals, LT and UT (the causal diagonal hides rows [0, j), in place
    of the causal variants' empty UT), so its visible rows are at most three intervals: before the
    first hidden one, between them, after both.
    """
    seqlen = lts.shape[1]
    chunks = seqlen // chunk_size
    runs = np.zeros((chunks, chunks + 1), dtype=np.int64)
    for bh in range(lts.shape[0]):
        for j in range(seqlen):
            a0, a1 = lts[bh, j], lte[bh, j]
            b0, b1 = (0, j) if causal else (uts[bh, j], ute[bh, j])
            if a0 >= a1:  # an empty interval moves past the last row, out of the way
                a0 = a1 = seqlen
            if b0 >= b1:
                b0 = b1 = seqlen
            if b0 < a0:
                a0, a1, b0, b1 = b0, b1, a0, a1
            key_chunk = j // chunk_size
            for start, end in ((0, a0), (a1, b0), (max(a1, b1), seqlen)):
                if start < end:
                    runs[key_chunk, start // chunk_size] += 1
                    runs[key_chunk, (end - 1) // chunk_size + 1] -= 1
    return runs
