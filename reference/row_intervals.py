"""A `ColumnMask` row by row: each query row's visible keys as a list of key intervals.

The column-wise format lists, per key column, the query rows it hides; interval-mask attention
(cuDNN frontend's `flex_attention`) takes the transpose, per query row its visible keys as
[0, E_0) U [E_1, E_2) U ... `row_intervals` converts exactly, a chunk of query rows at a time, so
no [Sq, Sk] mask is ever made in one piece (masks go to 128K tokens).
"""

from __future__ import annotations

import torch

from .constructors import check_count
from .mask import ColumnMask

_CHUNK_ELEMENTS = 1 << 24
"""Mask elements (batch x mask heads x rows x keys) evaluated at a time."""


class IntervalLimitError(ValueError):
    """A query row needs more intervals than the `max_intervals` given to `row_intervals`."""


def row_intervals(mask: ColumnMask, max_intervals: int | None = None) -> torch.Tensor:
    """Each query row's visible keys as interval endpoints: int32 [B, Hm, Sq, n] on the mask's device.

    With E = endpoints[b, h, i], query row i of batch b and mask head h attends key j exactly when

        j in [0, E_0) U [E_1, E_2) U [E_3, E_4) U ... U [E_{n-2}, E_{n-1})

    n is odd and 0 <= E_0 <= E_1 <= ... <= E_{n-1} <= Sk. The endpoints are the keys where the
    row's visibility flips, counting every row as visible before key 0 and hidden from key Sk on:
    a row whose key 0 is hidden has E_0 = 0 (an empty first interval), and each row's list is
    padded with Sk (empty intervals [Sk, Sk)). Equivalently, key j is attended when an even number
    of endpoints are <= j. No row's list could be shorter: n = 2 * I - 1 for I the most intervals
    any row needs, counting its leading [0, E_0), which is cuDNN's `mask_func` form with
    nfunc = n (its layout is [Hmask, nfunc, B * Sq], a permutation of this one).

    Args:
        mask: the mask to convert, any variant, batch and head count; Sq may differ from Sk.
        max_intervals: the most intervals (I above) a row may need, or None for no limit.

    Raises:
        TypeError: `mask` is not a ColumnMask.
        ValueError: `max_intervals` is not a positive int.
        IntervalLimitError: a row needs more than `max_intervals` intervals. Raised at the first
            chunk of rows holding one, so a refused mask costs no more memory than the limit.
    """
    if not isinstance(mask, ColumnMask):
        raise TypeError(f"mask must be a ColumnMask, got {type(mask).__name__}")
    max_intervals = check_count("max_intervals", max_intervals)
    batch, heads, seqlen_q, seqlen_k = mask.batch, mask.heads, mask.seqlen_q, mask.seqlen_k
    rows_per_chunk = max(1, _CHUNK_ELEMENTS // (batch * heads * (seqlen_k + 1)))
    chunks = []
    for row0 in range(0, seqlen_q, rows_per_chunk):
        rows = torch.arange(row0, min(row0 + rows_per_chunk, seqlen_q), device=mask.device)
        chunks.append(_chunk_endpoints(mask, rows, max_intervals))
    width = max(chunk.shape[-1] for chunk in chunks)
    padded = [torch.nn.functional.pad(chunk, (0, width - chunk.shape[-1]), value=seqlen_k) for chunk in chunks]
    return torch.cat(padded, dim=-2)


def _chunk_endpoints(mask: ColumnMask, rows: torch.Tensor, max_intervals: int | None) -> torch.Tensor:
    """`row_intervals` of query `rows` (consecutive), int32 [B, Hm, len(rows), n] with n the most
    endpoints these rows need."""
    visible = ~mask.masked(rows)
    shape = visible.shape
    seqlen_k = shape[-1]
    before = torch.ones(*shape[:-1], 1, dtype=torch.bool, device=visible.device)
    # Position p flips when key p's visibility differs from key p - 1's: visible before key 0,
    # hidden from key Sk on, so every row flips an odd number of times.
    flips = torch.cat([before, visible], dim=-1) != torch.cat([visible, ~before], dim=-1)
    flips = flips.view(-1, seqlen_k + 1)
    counts = flips.sum(-1)
    width = int(counts.max())
    if max_intervals is not None and width > 2 * max_intervals - 1:
        flat_row = int(torch.argmax((counts > 2 * max_intervals - 1).to(torch.int8)))
        b, rest = divmod(flat_row, shape[1] * shape[2])
        h, r = divmod(rest, shape[2])
        raise IntervalLimitError(
            f"query row {int(rows[r])} (batch {b}, mask head {h}) needs {(int(counts[flat_row]) + 1) // 2} "
            f"intervals, more than max_intervals={max_intervals}"
        )
    # nonzero lists each row's flips by ascending key: its rank in the row is its endpoint slot.
    row, key = flips.nonzero(as_tuple=True)
    first_of_row = counts.cumsum(0) - counts
    slot = torch.arange(len(row), device=row.device) - first_of_row[row]
    endpoints = torch.full((flips.shape[0], width), seqlen_k, dtype=torch.int32, device=flips.device)
    endpoints[row, slot] = key.to(torch.int32)
    return endpoints.view(*shape[:-1], width)
