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
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..reference import ColumnMask


def local_rows_below(values: torch.Tensor, chunk_starts: Sequence[int], chunk_size: int) -> torch.Tensor:
    """clip-shift-max: how many of the local rows (the chunks at `chunk_starts`) lie below `values`."""
    out = torch.zeros_like(values)
    for b, start in enumerate(chunk_starts):
        local = (values - start).clamp(0, chunk_size)
        out = torch.maximum(out, torch.where(local > 0, local + b * chunk_size, torch.zeros_like(local)))
    return out


def localize(mask: ColumnMask, q_chunks: Sequence[int], k_chunks: Sequence[int], chunk_size: int) -> ColumnMask:
    """The mask of the queries in `q_chunks` against the keys in `k_chunks` (each sorted, concatenated)."""
    if mask.seqlen_q != mask.seqlen_k:
        raise ValueError(f"context parallelism needs Sq == Sk, got {mask.seqlen_q} and {mask.seqlen_k}")
    if list(q_chunks) != sorted(q_chunks) or list(k_chunks) != sorted(k_chunks):
        raise ValueError("q_chunks and k_chunks must be sorted")
    device = mask.device
    starts = [c * chunk_size for c in q_chunks]
    keys = torch.cat([torch.arange(c * chunk_size, (c + 1) * chunk_size, device=device) for c in k_chunks])
    lts, lte, uts, ute = (local_rows_below(v.index_select(-1, keys), starts, chunk_size) for v in mask.intervals())
    width = mask.startend_row_indices.shape[-1]
    if mask.causal:
        ute = local_rows_below(keys, starts, chunk_size).expand_as(lts)
        vectors = [lts, ute] if width == 1 else [lts, lte, torch.zeros_like(lts), ute]
    else:
        vectors = [lts, ute] if width == 2 else [lts, lte, uts, ute]
    idx = torch.stack(vectors, dim=-1).to(torch.int32).contiguous()
    return ColumnMask(idx, False, len(q_chunks) * chunk_size)
