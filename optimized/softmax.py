"""Online softmax on a WGMMA accumulator (fp32, base-2 exponentials).

Each thread holds two rows of every 64-row MMA atom; a row is spread over the 4 threads of a quad,
so row maxima end with a 4-lane shuffle. Row sums stay per thread until `finalize`.
"""

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from .layout import acc_rows_view

LOG2_E = math.log2(math.e)
"""The scores' scale into base 2: the kernels take exponentials and the LSE's sums in base 2."""

RESCALE_THRESHOLD_LOG2 = 8.0
"""With lazy rescaling a row's running max moves only when a key tile raises it by more than this
(base 2): until then the probabilities are taken against the old max, so they stay below 2^8, exact
in fp32 sums and in a 16-bit P (FA4's Blackwell forward uses the same bound)."""


@cute.jit
def _row_max_by_fmax(s_rows: cute.Tensor, r: int, start: Float32) -> Float32:
    """max(start, row r of the scores) by `fmax` (a plain FMNMX each; the scores are never NaN) in
    four independent chains, as FA4's softmax does, where `reduce(MAX)` lowers to NaN-propagating
    compares and selects."""
    n = cute.size(s_rows, mode=[1])
    chains = [start] + [s_rows[r, i] for i in range(1, 4)]
    chains[0] = cute.arch.fmax(chains[0], s_rows[r, 0])
    for i in cutlass.range_constexpr(4, n):
        chains[i % 4] = cute.arch.fmax(chains[i % 4], s_rows[r, i])
    return cute.arch.fmax(cute.arch.fmax(chains[0], chains[1]), cute.arch.fmax(chains[2], chains[3]))


@cute.jit
def _rescore_row(
    s_rows: cute.Tensor,
    r: int,
    row_max: cute.Tensor,
    row_sum: cute.Tensor,
    scale_log2: Float32,
    fmax_row_max: cutlass.Constexpr[bool],
    lazy_rescale: cutlass.Constexpr[bool],
):
    """Row r of the scores to exp2(s * scale - new max) in place, its running max and sum updated;
    returns the factor the row of O must be rescaled by. A row with no visible key yet keeps max
    -inf and probabilities 0. `lazy_rescale`: the max stays where it was unless the tile raises it
    by more than `RESCALE_THRESHOLD_LOG2`, and the factor is then exactly 1."""
    row = s_rows[r, None].load()
    if cutlass.const_expr(fmax_row_max):
        new_max = _row_max_by_fmax(s_rows, r, row_max[r])
    else:
        new_max = row.reduce(cute.ReductionOp.MAX, row_max[r], 0)
    new_max = cute.arch.warp_reduction_max(new_max, threads_in_group=4)
    kept = False
    if cutlass.const_expr(lazy_rescale):  # from -inf the difference is inf or NaN: never kept
        kept = (new_max - row_max[r]) * scale_log2 <= RESCALE_THRESHOLD_LOG2
        new_max = row_max[r] if kept else new_max
    safe_max = 0.0 if new_max == -Float32.inf else new_max
    correction = cute.math.exp2((row_max[r] - safe_max) * scale_log2, fastmath=True)
    if cutlass.const_expr(lazy_rescale):
        correction = 1.0 if kept else correction
    p = cute.math.exp2(row * scale_log2 - safe_max * scale_log2, fastmath=True)
    s_rows[r, None].store(p)
    row_sum[r] = row_sum[r] * correction + p.reduce(cute.ReductionOp.ADD, 0.0, 0)
    row_max[r] = new_max
    return correction


@cute.jit
def softmax_rescore(
    acc_S: cute.Tensor,
    row_max: cute.Tensor,
    row_sum: cute.Tensor,
    scale_log2: Float32,
    fmax_row_max: cutlass.Constexpr[bool] = False,
    lazy_rescale: cutlass.Constexpr[bool] = False,
) -> cute.Tensor:
    """Turn scores into probabilities in place for the new row maxima, without touching O (which a
    GEMM may still be writing): returns the per-row factors for `rescale_rows`. `fmax_row_max`: the
    row maxima by `_row_max_by_fmax`; `lazy_rescale`: see `_rescore_row`."""
    s_rows = acc_rows_view(acc_S)
    correction = cute.make_rmem_tensor_like(row_max, Float32)
    for r in cutlass.range_constexpr(cute.size(row_max)):
        correction[r] = _rescore_row(s_rows, r, row_max, row_sum, scale_log2, fmax_row_max, lazy_rescale)
    return correction


@cute.jit
def rescale_rows(acc_O: cute.Tensor, correction: cute.Tensor) -> None:
    o_rows = acc_rows_view(acc_O)
    for r in cutlass.range_constexpr(cute.size(correction)):
        o_rows[r, None].store(o_rows[r, None].load() * correction[r])


@cute.jit
def warp_rows_moved(correction: cute.Tensor) -> cutlass.Boolean:
    """Whether any row of the warp has a factor other than 1 (one vote): with lazy rescaling, the
    turns where O needs no rescale skip it, which after the first key tiles is nearly all."""
    moved = correction[0] != 1.0
    for r in cutlass.range_constexpr(1, cute.size(correction)):
        moved = moved | (correction[r] != 1.0)
    return cute.arch.vote_any_sync(moved)


@cute.jit
def softmax_finalize(
    acc_O: cute.Tensor, row_max: cute.Tensor, row_sum: cute.Tensor, scale_log2: Float32, sink_log2=None
) -> cute.Tensor:
    """Normalize O by the row sums; return the natural-log LSE per row (-inf for empty rows).
    `sink_log2`: the head's sink logit times log2(e), or None: a key of value 0 joined to every row's
    softmax (its term exp(sink) added to the sum, the LSE including it; an empty row gets O = 0
    and LSE = sink; with a sink of -inf too, 0 and -inf), taken against the larger of the row's max
    and the sink so neither overflows."""
    o_rows = acc_rows_view(acc_O)
    lse = cute.make_rmem_tensor(cute.size(row_max), Float32)
    for r in cutlass.range_constexpr(cute.size(row_max)):
        total = cute.arch.warp_reduction_sum(row_sum[r], threads_in_group=4)
        if cutlass.const_expr(sink_log2 is None):
            empty = total == 0.0
            inv = cute.arch.rcp_approx(1.0 if empty else total)
            o_rows[r, None].store(o_rows[r, None].load() * (0.0 if empty else inv))
            lse[r] = (
                -Float32.inf
                if empty
                else (row_max[r] * scale_log2 + cute.math.log2(total, fastmath=True)) * math.log(2.0)
            )
        else:
            scores_max = row_max[r] * scale_log2  # -inf for an empty row, whose total is 0
            joint_max = cute.arch.fmax(scores_max, sink_log2)
            nothing = joint_max == -Float32.inf  # an empty row and a sink of -inf: O = 0, LSE = -inf
            safe_max = 0.0 if nothing else joint_max
            scores_factor = cute.math.exp2(scores_max - safe_max, fastmath=True)
            joint_total = total * scores_factor + cute.math.exp2(sink_log2 - safe_max, fastmath=True)
            inv = cute.arch.rcp_approx(1.0 if nothing else joint_total)
            o_rows[r, None].store(o_rows[r, None].load() * (0.0 if nothing else scores_factor * inv))
            lse[r] = (
                -Float32.inf if nothing else (joint_max + cute.math.log2(joint_total, fastmath=True)) * math.log(2.0)
            )
    return lse
