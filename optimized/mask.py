"""Element mask of a PARTIAL tile from the column-wise boundaries (FlashMask semantics).

Only tiles the mask role lists partial come here; SKIP tiles never reach the consumers and
UNMASKED tiles skip this entirely. The mask variant is a compile-time constant, so each key
column costs exactly the loads its variant has (1, 2 or 4 int32 from `startend_row_indices`):

    causal, 1: hidden if row >= LTS            causal, 2: LTS <= row < LTE
    non-causal, 2: row >= LTS or row < UTE     non-causal, 4: [LTS, LTE) or [UTS, UTE)

plus the causal part (key after the query, bottom-right aligned) and keys past the end (the
ragged last tile). A non-causal tile that only one of the two intervals reaches tests that one
alone (`interval`: LOWER, [LTS, LTE) or row >= LTS; UPPER, [UTS, UTE) or row < UTE).
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from .layout import acc_rows_view

LOWER = 0  # `interval`: the lower interval of a non-causal mask alone
UPPER = 1  # the upper one alone


@cute.jit
def _hidden(
    query,
    key,
    first,
    second,
    third,
    fourth,
    causal_offset,
    causal: cutlass.Constexpr[bool],
    width: cutlass.Constexpr[int],
    diagonal: cutlass.Constexpr[bool] = True,
    interval: cutlass.Constexpr[int | None] = None,
):
    """Whether (query, key) is masked, given the key's 1, 2 or 4 boundaries (unused ones repeat);
    not `diagonal`: the causal part is left out (it hides nothing here, or the caller tests it);
    `interval` (non-causal, LOWER or UPPER): that interval alone (the other reaches no row here)."""
    if cutlass.const_expr(causal and width == 1):
        hidden = query >= first
    elif cutlass.const_expr(causal):
        hidden = query >= first and query < second
    elif cutlass.const_expr(width == 2 and interval == LOWER):
        hidden = query >= first
    elif cutlass.const_expr(width == 2 and interval == UPPER):
        hidden = query < second
    elif cutlass.const_expr(width == 2):
        hidden = query >= first or query < second
    elif cutlass.const_expr(interval == LOWER):
        hidden = query >= first and query < second
    elif cutlass.const_expr(interval == UPPER):
        hidden = query >= third and query < fourth
    else:
        hidden = (query >= first and query < second) or (query >= third and query < fourth)
    if cutlass.const_expr(causal and diagonal):
        hidden = hidden or key > query + causal_offset
    return hidden


@cute.jit
def _apply_row_mask(s_rows, c_rows, bounds, query_start, key_start, causal_offset, causal, width, diagonal=True):
    """The mask of a tile whose keys share `bounds`: whether a row is hidden is decided once per
    row; only the causal diagonal is left per element (none unless `diagonal`). `bounds` None: no
    row is hidden."""
    if cutlass.const_expr(bounds is not None):
        first = bounds[0]
        second = bounds[1] if cutlass.const_expr(width >= 2) else first
        third = bounds[2] if cutlass.const_expr(width == 4) else first
        fourth = bounds[3] if cutlass.const_expr(width == 4) else first
    for q in cutlass.range_constexpr(cute.size(s_rows, mode=[0])):
        query = query_start + c_rows[q, 0][0]
        row_hidden = False
        if cutlass.const_expr(bounds is not None):
            # No key: the causal part is tested per element below.
            row_hidden = _hidden(
                query, None, first, second, third, fourth, causal_offset, causal, width, diagonal=False
            )
        for k in cutlass.range_constexpr(cute.size(s_rows, mode=[1])):
            hidden = row_hidden
            if cutlass.const_expr(causal and diagonal):
                hidden = hidden or key_start + c_rows[q, k][1] > query + causal_offset
            s_rows[q, k] = -Float32.inf if hidden else s_rows[q, k]


@cute.jit
def apply_causal_diagonal(
    acc_S: cute.Tensor,
    coords: cute.Tensor,
    query_start: Int32,
    key_start: Int32,
    causal_offset: Int32,
    keys_on_rows: cutlass.Constexpr[bool] = False,
):
    """Set the scores of keys after their query (bottom-right aligned) to -inf: the whole mask of a
    tile that no key's bounds reach (`DIAGONAL_ONLY`). `coords` and `keys_on_rows` as in
    `apply_column_mask`."""
    s_rows = acc_rows_view(acc_S)
    c_rows = acc_rows_view(coords)
    if cutlass.const_expr(not keys_on_rows):
        _apply_row_mask(s_rows, c_rows, None, query_start, key_start, causal_offset, causal=True, width=1)
        return
    for k in cutlass.range_constexpr(cute.size(s_rows, mode=[0])):
        key = key_start + c_rows[k, 0][0]
        for q in cutlass.range_constexpr(cute.size(s_rows, mode=[1])):
            hidden = key > query_start + c_rows[k, q][1] + causal_offset
            s_rows[k, q] = -Float32.inf if hidden else s_rows[k, q]


@cute.jit
def apply_column_mask(
    acc_S: cute.Tensor,
    coords: cute.Tensor,
    mRowIndices: cute.Tensor,
    mask_batch: Int32,
    mask_head: Int32,
    query_start: Int32,
    key_start: Int32,
    seqlen_k: Int32,
    causal_offset: Int32,
    causal: cutlass.Constexpr[bool],
    width: cutlass.Constexpr[int],
    keys_on_rows: cutlass.Constexpr[bool] = False,
    tile_bounds: cute.Tensor | None = None,
    uniform: cutlass.Constexpr[bool] = False,
    diagonal: cutlass.Constexpr[bool] = True,
    interval: cutlass.Constexpr[int | None] = None,
) -> None:
    """Set hidden scores of the thread's fragment to -inf.

    `coords` is the identity tensor of the tile partitioned like the accumulator: (query, key)
    coordinates, or (key, query) with `keys_on_rows` (the backward's transposed scores);
    `mRowIndices` is the mask's int32 [Bm, Hm, Sk, width] `startend_row_indices`. The bounds of
    each of the thread's keys are loaded once, from `tile_bounds` (the tile's (key, boundary) copy
    in smem) when given. `uniform` (forward, with `tile_bounds`): every key of the tile has the
    bounds of `tile_bounds` row 0 and none is past the end, so the mask is a set of rows (and the
    causal diagonal). Not `diagonal` (forward, causal): the causal diagonal does not cut the tile
    (`OFF_DIAGONAL`), so no element is tested against it. `interval` (forward, non-causal, LOWER or
    UPPER): only that interval reaches the tile's rows (`LOWER_ONLY`, `UPPER_ONLY`).
    """
    s_rows = acc_rows_view(acc_S)
    c_rows = acc_rows_view(coords)
    if cutlass.const_expr(uniform):
        bounds = tile_bounds[0, None]
        _apply_row_mask(s_rows, c_rows, bounds, query_start, key_start, causal_offset, causal, width, diagonal)
        return
    key_mode = 0 if cutlass.const_expr(keys_on_rows) else 1
    for k in cutlass.range_constexpr(cute.size(s_rows, mode=[key_mode])):
        key_in_tile = c_rows[k, 0][0] if cutlass.const_expr(keys_on_rows) else c_rows[0, k][1]
        key = key_start + key_in_tile
        in_range = key < seqlen_k
        if cutlass.const_expr(tile_bounds is not None):
            bounds = tile_bounds[key_in_tile, None]
        else:
            bounds = mRowIndices[mask_batch, mask_head, key if in_range else seqlen_k - 1, None]
        first = bounds[0]
        second = bounds[1] if cutlass.const_expr(width >= 2) else first
        third = bounds[2] if cutlass.const_expr(width == 4) else first
        fourth = bounds[3] if cutlass.const_expr(width == 4) else first
        for q in cutlass.range_constexpr(cute.size(s_rows, mode=[1 - key_mode])):
            r, c = (k, q) if cutlass.const_expr(keys_on_rows) else (q, k)
            query = query_start + (c_rows[r, c][1] if cutlass.const_expr(keys_on_rows) else c_rows[r, c][0])
            hidden = _hidden(query, key, first, second, third, fourth, causal_offset, causal, width, diagonal, interval)
            hidden = not in_range or hidden
            s_rows[r, c] = -Float32.inf if hidden else s_rows[r, c]
