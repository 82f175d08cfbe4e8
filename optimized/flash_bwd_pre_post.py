"""The backward's two memory-bound passes around the main kernel (flash_bwd_sm90.py), each one
kernel over (query tile, head, batch):

- preprocess: Delta = rowsum(dO * O) in fp32 (4 threads per row), the LSE in base 2 with +inf for
  rows that see no key (so their P is 0, not NaN), rows padded to the tile, and the zeroed fp32
  dQ accumulator tile;
- postprocess: dQ = scale * accumulator in the input dtype, each thread reading back the slots its
  twin thread of the main kernel wrote (register-fragment order, 16-byte loads) and storing them in
  place through smem (stmatrix) and one TMA store per tile.
"""

from __future__ import annotations

from typing import Type

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32, const_expr
from cutlass.cute.nvgpu import cpasync, warp
from cutlass.memory import SmemAllocator

from .flash_bwd_sm90 import FlashMaskBackwardSm90
from .hopper import assume_aligned, select_modes, smem_layout, store_rows, tma_tiles
from .softmax import LOG2_E


class BackwardPreprocess:
    threads_per_row = 4

    def __init__(self, dtype: Type[cutlass.Numeric], head_dim: int, tile_m: int, head_dim_v: int | None = None):
        self.tile_m = tile_m  # the main kernel's query rows per step
        self.num_threads = tile_m * self.threads_per_row
        self.dtype = dtype
        self.head_dim = head_dim  # Q's: the dQ accumulator's
        self.head_dim_v = head_dim if head_dim_v is None else head_dim_v  # O's and dO's: Delta's

    @cute.jit
    def __call__(
        self,
        mO: cute.Tensor,  # [B, Sq, Hq, Dv]
        mdO: cute.Tensor,  # [B, Sq, Hq, Dv]
        mLSE: cute.Tensor,  # [B, Hq, Sq] fp32, natural log
        mLSE2: cute.Tensor,  # [B, Hq, Sq_pad] fp32 out
        mDelta: cute.Tensor,  # [B, Hq, Sq_pad] fp32 out
        mdQaccum: cute.Tensor,  # [B, Hq, Tm, tile_m * D] fp32 out (zeroed)
        mStepRows: cute.Tensor | None,  # [B, Hq, Tm, 2] int32: the virtual rows' tiles (see below), or None
        stream: cuda.CUstream,
    ):
        """With `mStepRows` (segment-aligned steps) the outputs are on the virtual rows of the main
        kernel: tile m's rows come from O's, dO's and the LSE's rows from its real first row on, as
        many as it has real rows; its padding rows get Delta 0 and an LSE of +inf."""
        mO, mdO = (assume_aligned(t) for t in (mO, mdO))
        grid = (cute.size(mdQaccum.shape[2]), cute.size(mdQaccum.shape[1]), cute.size(mdQaccum.shape[0]))
        self.kernel(mO, mdO, mLSE, mLSE2, mDelta, mdQaccum, mStepRows).launch(
            grid=grid, block=[self.num_threads, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(self, mO, mdO, mLSE, mLSE2, mDelta, mdQaccum, mStepRows: cute.Tensor | None):
        tidx, _, _ = cute.arch.thread_idx()
        m_block, head, batch = cute.arch.block_idx()
        part = tidx % self.threads_per_row
        row = m_block * self.tile_m + tidx // self.threads_per_row
        seqlen_q = mO.shape[1]
        source, valid = row, row < seqlen_q
        if const_expr(mStepRows is not None):  # read from the tile's real rows, written on the virtual ones
            local = row - m_block * self.tile_m
            source, valid = mStepRows[batch, head, m_block, 0] + local, local < mStepRows[batch, head, m_block, 1]
        self.row_sums(mO, mdO, mLSE, mLSE2, mDelta, head, batch, part, row, source, valid)
        # Zero the accumulator tile with 16-byte stores, consecutive threads on consecutive chunks.
        zeros = cute.make_rmem_tensor((4,), Float32)
        zeros.fill(0.0)
        tile = mdQaccum[batch, head, m_block, None]
        for j in cutlass.range_constexpr(self.tile_m * self.head_dim // (4 * self.num_threads)):
            cute.autovec_copy(zeros, cute.local_tile(tile, (4,), (j * self.num_threads + tidx,)))

    @cute.jit
    def row_sums(self, mO, mdO, mLSE, mLSE2, mDelta, head, batch, part, row, source, valid):
        """Delta and the base-2 LSE of `row` (its four threads) from row `source` of O, dO and the
        LSE where `valid`, else as a padding row's: Delta 0, LSE +inf."""
        # The threads of a row take interleaved 16-byte chunks, so each load instruction of the
        # 4 threads covers 64 contiguous bytes of the row.
        vec = 8
        chunks = self.head_dim_v // (vec * self.threads_per_row)
        dot = Float32(0.0)
        if valid:
            for j in cutlass.range_constexpr(chunks):
                col = (j * self.threads_per_row + part) * vec
                rO = cute.make_rmem_tensor((vec,), self.dtype)
                rdO = cute.make_rmem_tensor((vec,), self.dtype)
                cute.autovec_copy(cute.local_tile(mO[batch, source, head, None], (vec,), (col // vec,)), rO)
                cute.autovec_copy(cute.local_tile(mdO[batch, source, head, None], (vec,), (col // vec,)), rdO)
                dot += (rO.load().to(Float32) * rdO.load().to(Float32)).reduce(cute.ReductionOp.ADD, 0.0, 0)
        dot = cute.arch.warp_reduction_sum(dot, threads_in_group=self.threads_per_row)
        if part == 0:
            lse = mLSE[batch, head, source] if valid else -Float32.inf
            mLSE2[batch, head, row] = Float32.inf if lse == -Float32.inf else lse * LOG2_E
            mDelta[batch, head, row] = dot


class BackwardPostprocess:
    main = FlashMaskBackwardSm90  # whose dQ accumulator this reads back
    num_threads = 128 * main.num_consumer_wgs

    def __init__(self, dtype: Type[cutlass.Numeric], head_dim: int, tile_m: int):
        self.dtype = dtype
        self.head_dim = head_dim
        self.tile_m = tile_m  # the main kernel's query rows per step

    @cute.jit
    def __call__(
        self,
        mdQaccum: cute.Tensor,  # [B, Hq, Tm, tile_m * D] fp32, as the main kernel left it
        mdQ: cute.Tensor,  # [B, Sq, Hq, D] out
        mStepRows: cute.Tensor | None,  # [B, Hq, Tm, 2] int32: the virtual rows' tiles, or None
        softmax_scale: Float32,
        stream: cuda.CUstream,
    ):
        """With `mStepRows` (segment-aligned steps) the accumulator is on the virtual rows: tile m
        goes to dQ from its real first row, only its real rows."""
        mdQ = select_modes(assume_aligned(mdQ), [1, 3, 2, 0])  # (Sq, D, Hq, B)
        # A swizzle atom within each warpgroup's half of the columns where the halves would split
        # a 64-column one (head dim 192: 96 each); at 64 both halves share one atom.
        half = self.head_dim // self.main.num_consumer_wgs
        halves_split_an_atom = self.head_dim > 64 and half % 64 != 0
        s_layout = smem_layout(
            self.dtype, self.tile_m, self.head_dim, major_size=half if halves_split_an_atom else None
        )
        tma_dq, tma_mdQ = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(), mdQ, s_layout, (self.tile_m, self.head_dim)
        )

        @cute.struct
        class SharedStorage:
            sdQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(s_layout)], 1024]

        grid = (cute.size(mdQaccum.shape[2]), cute.size(mdQaccum.shape[1]), cute.size(mdQaccum.shape[0]))
        self.kernel(
            mdQaccum,
            tma_mdQ,
            mdQ if const_expr(mStepRows is not None) else None,
            mStepRows,
            tma_dq,
            softmax_scale,
            self.main.dq_tiled_mma(self.dtype, self.head_dim, self.tile_m),
            self.main.dq_slot_layout(self.head_dim, self.tile_m),
            s_layout,
            SharedStorage,
        ).launch(grid=grid, block=[self.num_threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(
        self,
        mdQaccum,
        mdQ,
        mdQ_rows: cute.Tensor | None,
        mStepRows: cute.Tensor | None,
        tma_dq: cute.CopyAtom,
        softmax_scale: Float32,
        tiled_mma_dq: cute.TiledMma,
        slot_layout: cute.Layout,
        s_layout: cute.ComposedLayout,
        SharedStorage: cutlass.Constexpr,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        m_block, head, batch = cute.arch.block_idx()
        storage = SmemAllocator().allocate(SharedStorage)
        sdQ = storage.sdQ.get_tensor(s_layout.outer, swizzle=s_layout.inner)
        tile = cute.make_tensor(mdQaccum[batch, head, m_block, None].iterator, slot_layout)
        slots = tile[None, tidx % 128, None, tidx // 128]
        values = cute.make_rmem_tensor(slots.shape, Float32)
        cute.autovec_copy(slots, values)
        # The thread holds the fragment its twin thread of the main kernel computed: view it as
        # that accumulator, scale, convert, and store it in place through smem (stmatrix + TMA,
        # which leaves out rows past seqlen_q).
        acc = cute.make_rmem_tensor(
            tiled_mma_dq.get_slice(tidx).partition_shape_C((self.tile_m, self.head_dim)), self.dtype
        )
        acc.store((cute.make_tensor(values.iterator, acc.layout).load() * softmax_scale).to(self.dtype))
        st_copy = cute.make_tiled_copy_C(
            cute.make_copy_atom(warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype), tiled_mma_dq
        )
        thr_copy = st_copy.get_slice(tidx)
        cute.copy(st_copy, thr_copy.retile(acc), thr_copy.partition_D(sdQ))
        cute.arch.fence_view_async_shared()
        cute.arch.sync_threads()
        tile, dq_head = (self.tile_m, self.head_dim), mdQ[None, None, head, batch]
        if const_expr(mStepRows is not None):
            first, real_rows = mStepRows[batch, head, m_block, 0], mStepRows[batch, head, m_block, 1]
            if real_rows == self.tile_m:
                if tidx == 0:
                    self.store_tile(tma_dq, sdQ, cute.local_tile(cute.domain_offset((first, 0), dq_head), tile, (0, 0)))
            else:  # a TMA store of the whole tile would write over the next segment's first rows
                real_tile = cute.domain_offset((first, 0), mdQ_rows[None, None, head, batch])
                store_rows(sdQ, cute.local_tile(real_tile, tile, (0, 0)), real_rows, tidx, self.num_threads)
        elif tidx == 0:
            self.store_tile(tma_dq, sdQ, cute.local_tile(dq_head, tile, (m_block, 0)))

    @cute.jit
    def store_tile(self, tma_dq, sdQ, g):
        """One TMA store of the tile in `sdQ` to `g` (one thread)."""
        t_s, t_g = tma_tiles(tma_dq, sdQ, g)
        cute.copy(tma_dq, t_s, t_g)
        cute.arch.cp_async_bulk_commit_group()
        cute.arch.cp_async_bulk_wait_group(0, read=True)
