"""CuTe DSL building blocks the Hopper kernels share: tensor views, smem layouts, TMA, WGMMA."""

from __future__ import annotations

from typing import Type

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90
from cutlass import Float32, Int32, const_expr, pipeline
from cutlass._mlir import ir
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.tensor_utils import LayoutEnum

SMEM_PER_CTA = 232448
"""The most dynamic shared memory one CTA may take on sm_90 (227 KB)."""


def check_smem_fits(storage_bytes: int, kernel: str) -> None:
    """Fail at compile time, naming the kernel, where its shared storage exceeds `SMEM_PER_CTA`
    (the launch would fail with an invalid-configuration error, after the compile succeeded)."""
    if storage_bytes > SMEM_PER_CTA:
        raise ValueError(f"{kernel} needs {storage_bytes} bytes of shared memory, over the {SMEM_PER_CTA} of sm_90")


def select_modes(t: cute.Tensor, modes: list[int]) -> cute.Tensor:
    """The tensor with its modes reordered (e.g. [B, S, H, D] -> (S, D, H, B))."""
    return cute.make_tensor(t.iterator, cute.select(t.layout, mode=modes))


def assume_aligned(t: cute.Tensor) -> cute.Tensor:
    """Tell the compiler every stride but the last is a multiple of 16 bytes (TMA needs it)."""
    divby = 128 // t.element_type.width
    strides = tuple(s if isinstance(s, int) else cute.assume(s, divby=divby) for s in t.stride[:-1])
    return cute.make_tensor(t.iterator, cute.make_layout(t.shape, stride=(*strides, t.stride[-1])))


def smem_layout(
    dtype: Type[cutlass.Numeric], rows: int, cols: int, stages: int | None = None, major_size: int | None = None
):
    """Row-major (rows, cols[, stages]) smem layout, swizzled as widely as the columns allow, as
    WGMMA operands and TMA want it.
    `major_size`: the widest swizzle atom that divides it (default: cols), where an MMA reads the
    columns in slices of that many (a warpgroup's share: a WGMMA operand starts on an atom)."""
    kind = sm90.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, dtype, cols if major_size is None else major_size)
    atom = warpgroup.make_smem_layout_atom(kind, dtype)
    if stages is None:
        return cute.tile_to_shape(atom, (rows, cols), order=(0, 1))
    return cute.tile_to_shape(atom, (rows, cols, stages), order=(0, 1, 2))


def tma_pipeline(barriers, num_stages: int, tx_count: int, consumers) -> pipeline.PipelineTmaAsync:
    """A `num_stages`-deep pipeline one producer thread fills by TMA (`tx_count` bytes per stage)."""
    return pipeline.PipelineTmaAsync.create(
        barrier_storage=barriers.data_ptr(),
        num_stages=num_stages,
        producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
        consumer_group=consumers,
        tx_count=tx_count,
        defer_sync=True,
    )


def tma_tiles(atom: cute.CopyAtom, smem: cute.Tensor, gmem: cute.Tensor, tile_modes: int = 2):
    """(smem, gmem) views of a single-CTA TMA copy: the first `tile_modes` modes of both are one tile,
    the remaining mode indexes pipeline stages (smem) or tiles (gmem)."""
    return cpasync.tma_partition(
        atom, 0, cute.make_layout(1), cute.group_modes(smem, 0, tile_modes), cute.group_modes(gmem, 0, tile_modes)
    )


@cute.jit
def store_rows(smem: cute.Tensor, gmem: cute.Tensor, rows: Int32, tidx: Int32, threads: cutlass.Constexpr[int]) -> None:
    """The first `rows` rows of the 16-bit tile `smem` into `gmem` (a tile of the same shape), 16
    bytes per copy by `threads` threads (`tidx` below it): a tile whose last rows belong to the next
    segment, which a TMA store of the whole tile would overwrite. Call after a barrier that made
    the smem tile complete; another one must follow before the buffer is written again."""
    shape = (cute.size(smem, mode=[0]), cute.size(smem, mode=[1]))
    per_row = shape[1] * smem.element_type.width // 128
    atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), smem.element_type, num_bits_per_copy=128)
    thread_layout = cute.make_layout((threads // per_row, per_row), stride=(per_row, 1))
    tiled_copy = cute.make_tiled_copy_tv(atom, thread_layout, cute.make_layout((1, 128 // smem.element_type.width)))
    thr_copy = tiled_copy.get_slice(tidx)
    t_s = thr_copy.partition_S(smem)
    t_g = thr_copy.partition_D(gmem)
    t_c = thr_copy.partition_S(cute.make_identity_tensor(shape))
    values = cute.make_rmem_tensor_like(t_s)
    cute.autovec_copy(t_s, values)
    for m in cutlass.range_constexpr(cute.size(values.shape[1])):
        if t_c[0, m, 0][0] < rows:
            cute.copy(tiled_copy, values[None, m, None], t_g[None, m, None])


@cute.jit
def store_from_registers(rO: cute.Tensor, coords: cute.Tensor, gO: cute.Tensor, rows: Int32) -> None:
    """A warpgroup MMA's 16-bit C fragment `rO` (shaped like the accumulator: ((2, 2, V), 1, 1)) into
    the global tile `gO`, without smem. `coords`: the fragment's (row, column) in the tile, as
    `acc_rows_view` of its identity partition gives them. Lane q of a quad holds, per row, columns
    2q and 2q + 1 of every 8-column chunk; lanes q and q ^ 1 swap one such pair of every two chunks,
    so each holds 4 consecutive columns of one chunk and a quad stores 32 contiguous bytes of a row
    with four 8-byte stores. Rows at or past `rows` are left out."""
    if const_expr(cute.size(rO, mode=[0]) % 8 or cute.size(rO) != cute.size(rO, mode=[0])):
        raise ValueError(f"store_from_registers takes one MMA's fragment of whole chunk pairs, got {rO.layout}")
    chunks = cute.size(rO, mode=[0]) // 4
    words = cute.make_tensor(cute.recast_ptr(rO.iterator, dtype=Int32), cute.make_layout(2 * chunks))
    quad_lane = coords[0, 0][1] // 2  # column 2q of chunk 0
    odd = (quad_lane & 1) == 1
    atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), rO.element_type, num_bits_per_copy=64)
    pair = cute.make_rmem_tensor((4,), rO.element_type)
    pair_words = cute.make_tensor(cute.recast_ptr(pair.iterator, dtype=Int32), cute.make_layout(2))
    for half in cutlass.range_constexpr(2):  # rows r and r + 8
        row = coords[half, 0][0]
        for p in cutlass.range_constexpr(chunks // 2):
            even_chunk, odd_chunk = words[half + 4 * p], words[half + 4 * p + 2]
            received = cute.arch.shuffle_sync_bfly(cutlass.select_(odd, even_chunk, odd_chunk), offset=1)
            pair_words[0] = cutlass.select_(odd, received, even_chunk)
            pair_words[1] = cutlass.select_(odd, odd_chunk, received)
            first_col = 16 * p + 2 * quad_lane + cutlass.select_(odd, Int32(6), Int32(0))
            if row < rows:
                cute.copy(atom, pair, cute.local_tile(gO[row, None], (4,), (first_col // 4,)))


def wgmma(tiled_mma: cute.TiledMma, acc: cute.Tensor, a: cute.Tensor, b: cute.Tensor, zero_init: bool) -> None:
    """Issue acc (+)= a @ b over the k-blocks of one warpgroup and commit the group."""
    warpgroup.fence()
    atom = cute.make_mma_atom(tiled_mma.op)
    atom.set(warpgroup.Field.ACCUMULATE, not zero_init)
    for k in range(cute.size(a.shape[2])):  # unrolled at trace time
        cute.gemm(atom, acc, a[None, None, k], b[None, None, k], acc)
        atom.set(warpgroup.Field.ACCUMULATE, True)
    warpgroup.commit_group()


def convert_to_16bit(src: cute.Tensor, dst: cute.Tensor) -> None:
    """dst = src (fp32 registers) in dst's bf16 or fp16, two elements per packed `cvt`. Unlike
    `dst.store(src.load().to(...))`, whose conversion the compiler re-emits at each later use of
    dst, the packed values are computed once and every reader of dst shares them."""
    kind = "bf16x2" if dst.element_type == cutlass.BFloat16 else "f16x2"
    packed = cute.recast_tensor(dst, Int32)
    for i in range(cute.size(packed)):  # unrolled at trace time
        lo, hi = Float32(src[2 * i]), Float32(src[2 * i + 1])
        packed[i] = Int32(
            llvm.inline_asm(
                ir.IntegerType.get_signless(32),
                [hi.ir_value(), lo.ir_value()],
                f"cvt.rn.{kind}.f32 $0, $1, $2;",
                "=r,f,f",
                has_side_effects=False,
                is_align_stack=False,
                asm_dialect=llvm.AsmDialect.AD_ATT,
            )
        )
