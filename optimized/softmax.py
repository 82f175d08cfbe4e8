"""Online softmax on a WGMMA accumulator (fp32, base-2 exponentials).

Each thread holds two rows of every 64-row MMA atom; a row is spread over the 4 threads of a quad,
so row maxima end with a 4-lane shuffle. Row sums stay per thread until `finalize`.
"""

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from .layout import acc_rows_view


@cute.jit
def softmax_update(
    acc_S: cute.Tensor, acc_O: cute.Tensor, row_max: cute.Tensor, row_sum: cute.Tensor, scale_log2: Float32
) -> None:
    """Turn scores into exp2(s * scale - max) in place and rescale O for the new row max.

    Rows with no visible key yet keep max -inf; their probabilities come out 0.
    """
    s_rows = acc_rows_view(acc_S)
    o_rows = acc_rows_view(acc_O)
    for r in cutlass.range_constexpr(cute.size(row_max)):
        row = s_rows[r, None].load()
        new_max = row.reduce(cute.ReductionOp.MAX, row_max[r], 0)
        new_max = cute.arch.warp_reduction_max(new_max, threads_in_group=4)
        safe_max = 0.0 if new_max == -Float32.inf else new_max
        correction = cute.math.exp2((row_max[r] - safe_max) * scale_log2, fastmath=True)
        p = cute.math.exp2(row * scale_log2 - safe_max * scale_log2, fastmath=True)
        s_rows[r, None].store(p)
        row_sum[r] = row_sum[r] * correction + p.reduce(cute.ReductionOp.ADD, 0.0, 0)
        row_max[r] = new_max
        o_rows[r, None].store(o_rows[r, None].load() * correction)


@cute.jit
def softmax_finalize(
    acc_O: cute.Tensor, row_max: cute.Tensor, row_sum: cute.Tensor, scale_log2: Float32
) -> cute.Tensor:
    """Normalize O by the row sums; return the natural-log LSE per row (-inf for empty rows)."""
    o_rows = acc_rows_view(acc_O)
    lse = cute.make_rmem_tensor(cute.size(row_max), Float32)
    for r in cutlass.range_constexpr(cute.size(row_max)):
        total = cute.arch.warp_reduction_sum(row_sum[r], threads_in_group=4)
        empty = total == 0.0
        inv = cute.arch.rcp_approx(1.0 if empty else total)
        o_rows[r, None].store(o_rows[r, None].load() * (0.0 if empty else inv))
        lse[r] = (
            -Float32.inf
            if empty
            else (row_max[r] * scale_log2 + cute.math.log2(total, fastmath=True)) * math.log(2.0)
        )
    return lse
