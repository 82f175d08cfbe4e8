"""Element mask of a PARTIAL tile from the column-wise boundaries (FlashMask semantics).

Only tiles the tile plan marks partial come here; SKIP tiles never reach the consumers and
UNMASKED tiles skip this entirely. The mask variant is a compile-time constant, so each key
column costs exactly the loads its variant has (1, 2 or 4 int32 from `startend_row_indices`):

    causal, 1: hidden if row >= LTS            causal, 2: LTS <= row < LTE
    non-causal, 2: row >= LTS or row < UTE     non-causal, 4: [LTS, LTE) or [UTS, UTE)

plus the causal part (key after the query, bottom-right aligned) and keys past the end (the
ragged last tile).
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from .layout import acc_rows_view


@cute.jit
def apply_column_mask(
    acc_S: cute.Tensor,
    coords: cute.Tensor,
    mRowIndices: cute.Tensor,
    mask_batch: Int32,
    mask_head: Int32,
    row_start: Int32,
    col_start: Int32,
    seqlen_k: Int32,
    causal_offset: Int32,
    causal: cutlass.Constexpr[bool],
    width: cutlass.Constexpr[int],
) -> None:
    """Set hidden scores of the thread's fragment to -inf.

    `coords` is the identity tensor of the tile partitioned like the accumulator;
    `mRowIndices` is the mask's int32 [Bm, Hm, Sk, width] `startend_row_indices`.
    """
    s_rows = acc_rows_view(acc_S)
    c_rows = acc_rows_view(coords)
    for c in cutlass.range_constexpr(cute.size(s_rows, mode=[1])):
        col = col_start + c_rows[0, c][1]
        in_range = col < seqlen_k
        key = col if in_range else seqlen_k - 1
        bounds = mRowIndices[mask_batch, mask_head, key, None]
        first = bounds[0]
        second = bounds[1] if cutlass.const_expr(width >= 2) else first
        third = bounds[2] if cutlass.const_expr(width == 4) else first
        fourth = bounds[3] if cutlass.const_expr(width == 4) else first
        for r in cutlass.range_constexpr(cute.size(s_rows, mode=[0])):
            row = row_start + c_rows[r, 0][0]
            hidden = not in_range
            if cutlass.const_expr(causal and width == 1):
                hidden = hidden or row >= first or col > row + causal_offset
            elif cutlass.const_expr(causal):
                hidden = hidden or (row >= first and row < second) or col > row + causal_offset
            elif cutlass.const_expr(width == 2):
                hidden = hidden or row >= first or row < second
            else:
                hidden = hidden or (row >= first and row < second) or (row >= third and row < fourth)
            s_rows[r, c] = -Float32.inf if hidden else s_rows[r, c]
