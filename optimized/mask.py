"""Element mask of a PARTIAL tile from the column-wise boundaries (FlashMask semantics).

Only tiles the tile plan marks partial come here; SKIP tiles never reach the consumers and
UNMASKED tiles skip this entirely. Query row i is hidden from key j when i lies in
[LTS_j, LTE_j) or [UTS_j, UTE_j), when the key is after the query (causal, bottom-right aligned),
or when j is past the end of the keys (the ragged last tile).
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

from .layout import acc_rows_view


@cute.jit
def apply_column_mask(
    acc_S: cute.Tensor,
    coords: cute.Tensor,
    mBounds: cute.Tensor,
    mask_batch: Int32,
    mask_head: Int32,
    row_start: Int32,
    col_start: Int32,
    seqlen_k: Int32,
    causal_offset: Int32,
    causal: cutlass.Constexpr[bool],
) -> None:
    """Set hidden scores of the thread's fragment to -inf.

    `coords` is the identity tensor of the tile partitioned like the accumulator; `mBounds` is
    int32 [Bm, Hm, Sk, 4] with (LTS, LTE, UTS, UTE) per key, variant defaults filled in.
    """
    s_rows = acc_rows_view(acc_S)
    c_rows = acc_rows_view(coords)
    for c in cutlass.range_constexpr(cute.size(s_rows, mode=[1])):
        col = col_start + c_rows[0, c][1]
        in_range = col < seqlen_k
        key = col if in_range else seqlen_k - 1
        lts = mBounds[mask_batch, mask_head, key, 0]
        lte = mBounds[mask_batch, mask_head, key, 1]
        uts = mBounds[mask_batch, mask_head, key, 2]
        ute = mBounds[mask_batch, mask_head, key, 3]
        for r in cutlass.range_constexpr(cute.size(s_rows, mode=[0])):
            row = row_start + c_rows[r, 0][0]
            hidden = (not in_range) or (row >= lts and row < lte) or (row >= uts and row < ute)
            if cutlass.const_expr(causal):
                hidden = hidden or col > row + causal_offset
            s_rows[r, c] = -Float32.inf if hidden else s_rows[r, c]
