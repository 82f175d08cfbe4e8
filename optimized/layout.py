"""Views of Hopper WGMMA register fragments.

A 64 x N fp32 accumulator is laid out per thread as ((2, 2, N/8), MMA_M, MMA_N): pairs of
adjacent columns, two rows 8 apart, then N/8 column groups. These helpers re-view it as
(rows, cols) for row-wise softmax and as the A operand of a following register-sourced WGMMA.
"""

import cutlass.cute as cute


def acc_rows_view(acc: cute.Tensor) -> cute.Tensor:
    """((2, 2, V), M, N) -> ((2, M), (2, V, N)): index [row, col] of the thread's elements."""
    flat = cute.make_layout(acc.layout.shape)
    s, d = flat.shape, flat.stride
    rows_cols = cute.make_layout(
        ((s[0][1], s[1]), (s[0][0], s[0][2], s[2])),
        stride=((d[0][1], d[1]), (d[0][0], d[0][2], d[2])),
    )
    return cute.make_tensor(acc.iterator, cute.composition(acc.layout, rows_cols))


def acc_as_operand_a(acc: cute.Tensor) -> cute.Tensor:
    """((2, 2, V), M, N) -> ((2, 2, 2), M, (V/2, N)): the accumulator of S = QK^T read as the
    16-bit A operand of O += P V (each k-step of 16 columns takes two 8-column groups)."""
    split = cute.logical_divide(acc.layout, ((None, None, 2), None, None))
    s, d = split.shape, split.stride
    a_view = cute.make_layout(
        ((s[0][0], s[0][1], s[0][2][0]), s[1], (s[0][2][1], s[2])),
        stride=((d[0][0], d[0][1], d[0][2][0]), d[1], (d[0][2][1], d[2])),
    )
    return cute.make_tensor(acc.iterator, a_view)


def transpose_view(smem: cute.Tensor) -> cute.Tensor:
    """Swap the first two modes of a staged smem tensor (V as (d, n) for the PV product)."""
    shape = (smem.shape[1], smem.shape[0], *smem.shape[2:])
    order = (1, 0, *range(2, cute.rank(smem)))
    return cute.composition(smem, cute.make_ordered_layout(shape, order=order))
