"""Mask-aware attention forward for Hopper (sm_90a) in the CuTe DSL.

One CTA per (query tile, query head, batch); 3 warpgroups (4 with `q_tile_192`):
  - warpgroup 0, warp 1: the mask role (mask_role.py). Classifies the key tiles for the CTA's query
    tile from the per-key-block min/max of the mask and publishes the ones not fully masked, each
    flagged PARTIAL or not, into a smem ring the other warps read.
  - warpgroup 0, warp 0: producer. TMA-loads the Q tile once, then K and V of each listed key tile
    into a `num_stages`-deep mbarrier pipeline.
  - warpgroups 1-2 (1-3): consumers, 64 query rows each, taking turns on the tensor cores. S = Q K^T
    (SS-WGMMA), the element mask only on tiles listed PARTIAL (their column bounds cp.async'd into
    smem a tile ahead), online softmax in fp32, O += P V (RS-WGMMA, P stays in registers), O out
    through smem by one TMA store.
Skipped tiles cost neither loads nor MMAs. setmaxnreg moves registers from warpgroup 0 to the
consumers.
"""

from __future__ import annotations

import math
from typing import Type

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90
from cutlass import Float32, Int32, const_expr, pipeline
from cutlass.cute.nvgpu import cpasync, warp, warpgroup
from cutlass.memory import SmemAllocator
from cutlass.tensor_utils import LayoutEnum

from .layout import acc_as_operand_a, acc_rows_view, transpose_view
from .mask import apply_column_mask
from .mask_role import END_OF_LIST, TileList, list_key_tiles
from .softmax import rescale_rows, softmax_finalize, softmax_rescore, softmax_update

LOG2_E = math.log2(math.e)
# Named barriers (0 is sync_threads), with n consumer warpgroups: 1..n whose turn on the tensor
# cores; n + 1 the consumers are done with sQ / wrote their part of O (`epilogue_barrier`); n + 2
# onwards a warpgroup's prefetched column bounds are in smem (`bounds_barrier`).
_MMA_TURN = 1


def _select(t: cute.Tensor, modes: list[int]) -> cute.Tensor:
    return cute.make_tensor(t.iterator, cute.select(t.layout, mode=modes))


def _assume_aligned(t: cute.Tensor) -> cute.Tensor:
    """Tell the compiler every stride but the last is a multiple of 16 bytes (TMA needs it)."""
    divby = 128 // t.element_type.width
    strides = tuple(s if isinstance(s, int) else cute.assume(s, divby=divby) for s in t.stride[:-1])
    return cute.make_tensor(t.iterator, cute.make_layout(t.shape, stride=(*strides, t.stride[-1])))


def _smem_layout(dtype: Type[cutlass.Numeric], rows: int, cols: int, stages: int | None = None):
    """Swizzled row-major (rows, cols[, stages]) smem layout, as WGMMA operands and TMA want it."""
    atom = warpgroup.make_smem_layout_atom(sm90.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, dtype, cols), dtype)
    if stages is None:
        return cute.tile_to_shape(atom, (rows, cols), order=(0, 1))
    return cute.tile_to_shape(atom, (rows, cols, stages), order=(0, 1, 2))


def _tma_pipeline(barriers, num_stages: int, tx_count: int, consumers) -> pipeline.PipelineTmaAsync:
    """A `num_stages`-deep pipeline one producer thread fills by TMA (`tx_count` bytes per stage)."""
    return pipeline.PipelineTmaAsync.create(
        barrier_storage=barriers.data_ptr(), num_stages=num_stages,
        producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1), consumer_group=consumers,
        tx_count=tx_count, defer_sync=True,
    )


def _tma_tiles(atom: cute.CopyAtom, smem: cute.Tensor, gmem: cute.Tensor, tile_modes: int = 2):
    """(smem, gmem) views of a single-CTA TMA copy: the first `tile_modes` modes of both are one tile,
    the remaining mode indexes pipeline stages (smem) or tiles (gmem)."""
    return cpasync.tma_partition(
        atom, 0, cute.make_layout(1), cute.group_modes(smem, 0, tile_modes), cute.group_modes(gmem, 0, tile_modes))


def _wgmma(tiled_mma: cute.TiledMma, acc: cute.Tensor, a: cute.Tensor, b: cute.Tensor, zero_init: bool) -> None:
    """Issue acc (+)= a @ b over the k-blocks of one warpgroup and commit the group."""
    warpgroup.fence()
    atom = cute.make_mma_atom(tiled_mma.op)
    atom.set(warpgroup.Field.ACCUMULATE, not zero_init)
    for k in range(cute.size(a.shape[2])):  # unrolled at trace time
        cute.gemm(atom, acc, a[None, None, k], b[None, None, k], acc)
        atom.set(warpgroup.Field.ACCUMULATE, True)
    warpgroup.commit_group()


class FlashMaskForwardSm90:
    """Compile-time configuration and kernel of the forward pass."""

    tile_m = 128  # query rows per CTA (192 with `q_tile_192`)
    tile_n = 128

    def __init__(
        self,
        dtype: Type[cutlass.Numeric],
        head_dim: int,
        causal: bool,
        mask_width: int,
        num_stages: int = 2,
        pingpong: bool = True,
        setmaxnreg: bool = True,
        skip_tiles: bool = True,
        intra_wg_overlap: bool = True,
        tma_store: bool = True,
        k_ahead: bool = True,
        bounds_prefetch: bool = True,
        entry_ahead: bool = True,
        q_tile_192: bool = True,
    ):
        if head_dim not in (64, 128):
            raise ValueError(f"head_dim must be 64 or 128 for the cute backend, got {head_dim}")
        self.dtype = dtype
        self.head_dim = head_dim
        self.causal = causal
        self.mask_width = mask_width
        self.num_stages = num_stages
        self.pingpong = pingpong
        self.setmaxnreg = setmaxnreg
        self.skip_tiles = skip_tiles
        self.intra_wg_overlap = intra_wg_overlap
        self.tma_store = tma_store
        self.k_ahead = k_ahead and intra_wg_overlap  # the load order only the overlapped loop wants
        # The overlapped loop's turn barrier is what lets a buffer be refilled: ping-pong only.
        self.bounds_prefetch = bounds_prefetch and intra_wg_overlap and pingpong
        self.entry_ahead = entry_ahead and intra_wg_overlap
        if q_tile_192 and head_dim == 64:  # FA3/FA4's SM90 shape at head dim 64: 1.5x the rows per K/V load
            self.tile_m = 192
        self.num_consumer_wgs = self.tile_m // 64
        self.num_threads = 128 * (self.num_consumer_wgs + 1)
        # setmaxnreg: the producer warpgroup's registers to the consumers (65536 per SM in all)
        self.producer_regs, self.consumer_regs = (24, 240) if self.num_consumer_wgs == 2 else (32, 160)
        self.epilogue_barrier = _MMA_TURN + self.num_consumer_wgs
        self.bounds_barrier = self.epilogue_barrier + 1

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # [B, Sq, Hq, D]
        mK: cute.Tensor,  # [B, Sk, Hkv, D]
        mV: cute.Tensor,  # [B, Sk, Hkv, D]
        mO: cute.Tensor,  # [B, Sq, Hq, D]
        mLSE: cute.Tensor,  # [B, Hq, Sq] fp32
        mRowIndices: cute.Tensor,  # [Bm, Hm, Sk, 1|2|4] int32: the mask's startend_row_indices
        mBlockBounds: cute.Tensor,  # [Bm, Hm, Tn, 2 * width] int32: per key tile, min then max of each column
        softmax_scale: Float32,
        qheads_per_kvhead: Int32,
        qheads_per_maskhead: Int32,
        mask_batch_stride: Int32,
        stream: cuda.CUstream,
    ):
        mQ, mK, mV, mO = (_select(_assume_aligned(t), [1, 3, 2, 0]) for t in (mQ, mK, mV, mO))
        mLSE = _select(mLSE, [2, 1, 0])  # (Sq, Hq, B)
        sQ_layout = _smem_layout(self.dtype, self.tile_m, self.head_dim)
        sKV_layout = _smem_layout(self.dtype, self.tile_n, self.head_dim, self.num_stages)
        kv_tile = cute.select(sKV_layout, mode=[0, 1])
        tiled_mma_qk = sm90.make_trivial_tiled_mma(
            self.dtype, self.dtype, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.K, Float32,
            atom_layout_mnk=(self.num_consumer_wgs, 1, 1), tiler_mn=(64, self.tile_n),
        )
        tiled_mma_pv = sm90.make_trivial_tiled_mma(
            self.dtype, self.dtype, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.MN, Float32,
            atom_layout_mnk=(self.num_consumer_wgs, 1, 1), tiler_mn=(64, self.head_dim),
            a_source=warpgroup.OperandSource.RMEM,
        )
        load_op = cpasync.CopyBulkTensorTileG2SOp()
        tma_q, tma_mQ = cpasync.make_tiled_tma_atom(load_op, mQ, sQ_layout, (self.tile_m, self.head_dim))
        tma_k, tma_mK = cpasync.make_tiled_tma_atom(load_op, mK, kv_tile, (self.tile_n, self.head_dim), 1)
        tma_v, tma_mV = cpasync.make_tiled_tma_atom(load_op, mV, kv_tile, (self.tile_n, self.head_dim), 1)
        tma_o, tma_mO = None, None
        if const_expr(self.tma_store):  # O leaves through the Q buffer, free by then
            tma_o, tma_mO = cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileS2GOp(), mO, sQ_layout, (self.tile_m, self.head_dim))
        q_bytes = cute.size_in_bytes(self.dtype, sQ_layout)
        kv_bytes = cute.size_in_bytes(self.dtype, kv_tile)
        # (key in tile, boundary, buffer, warpgroup): each warpgroup alternates two tiles' bounds.
        w = self.mask_width
        bounds_layout = cute.make_layout((self.tile_n, w, 2, self.num_consumer_wgs),
                                         stride=(w, 1, self.tile_n * w, 2 * self.tile_n * w))

        @cute.struct
        class SharedStorage:
            mbar_q: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_k: cute.struct.MemRange[cutlass.Int64, self.num_stages * 2]
            mbar_v: cute.struct.MemRange[cutlass.Int64, self.num_stages * 2]
            mbar_tiles: cute.struct.MemRange[cutlass.Int64, TileList.slots * 2]
            tile_ring: cute.struct.MemRange[Int32, TileList.slots]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sKV_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sKV_layout)], 1024]
            if const_expr(self.bounds_prefetch):  # per warpgroup, two tiles' column bounds
                sBounds: cute.struct.Align[cute.struct.MemRange[
                    Int32, cute.cosize(bounds_layout)], 16]

        grid = (cute.ceil_div(cute.size(mQ.shape[0]), self.tile_m), cute.size(mQ.shape[2]), cute.size(mQ.shape[3]))
        self.kernel(
            tma_mQ, tma_mK, tma_mV, mO, mLSE, mRowIndices, mBlockBounds,
            tma_q, tma_k, tma_v, tma_o, tma_mO, q_bytes, kv_bytes,
            Float32(softmax_scale * LOG2_E), qheads_per_kvhead, qheads_per_maskhead, mask_batch_stride,
            sQ_layout, sKV_layout, bounds_layout, tiled_mma_qk, tiled_mma_pv, SharedStorage,
        ).launch(grid=grid, block=[self.num_threads, 1, 1], stream=stream, min_blocks_per_mp=1)

    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mO: cute.Tensor,
        mLSE: cute.Tensor,
        mRowIndices: cute.Tensor,
        mBlockBounds: cute.Tensor,
        tma_q: cute.CopyAtom,
        tma_k: cute.CopyAtom,
        tma_v: cute.CopyAtom,
        tma_o: cute.CopyAtom | None,
        tma_mO: cute.Tensor | None,
        q_bytes: cutlass.Constexpr[int],
        kv_bytes: cutlass.Constexpr[int],
        scale_log2: Float32,
        qheads_per_kvhead: Int32,
        qheads_per_maskhead: Int32,
        mask_batch_stride: Int32,
        sQ_layout: cute.ComposedLayout,
        sKV_layout: cute.ComposedLayout,
        bounds_layout: cute.Layout,
        tiled_mma_qk: cute.TiledMma,
        tiled_mma_pv: cute.TiledMma,
        SharedStorage: cutlass.Constexpr,
    ):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        m_block, head, batch = cute.arch.block_idx()
        if warp_idx == 0:
            for atom in [a for a in (tma_q, tma_k, tma_v, tma_o) if a is not None]:
                cpasync.prefetch_descriptor(atom)

        storage = SmemAllocator().allocate(SharedStorage)
        consumer_warps = pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_consumer_wgs * 4)
        pipe_q = _tma_pipeline(storage.mbar_q, 1, q_bytes, consumer_warps)
        pipe_k = _tma_pipeline(storage.mbar_k, self.num_stages, kv_bytes, consumer_warps)
        pipe_v = _tma_pipeline(storage.mbar_v, self.num_stages, kv_bytes, consumer_warps)
        tile_list = TileList(storage.tile_ring.get_tensor(cute.make_layout(TileList.slots)),
                             storage.mbar_tiles.data_ptr())
        tile_list.init(1 + 4 * self.num_consumer_wgs, warp_idx, self.num_threads // 32)  # read by producer, consumers
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sKV_layout.outer, swizzle=sKV_layout.inner)
        sV = storage.sV.get_tensor(sKV_layout.outer, swizzle=sKV_layout.inner)
        sBounds = storage.sBounds.get_tensor(bounds_layout) if const_expr(self.bounds_prefetch) else None

        mask_batch = batch * mask_batch_stride
        mask_head = head // qheads_per_maskhead
        seqlen_q, seqlen_k = mQ.shape[0], mK.shape[0]

        if warp_idx < 4:
            if const_expr(self.setmaxnreg):
                cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == 0:
                self.load(mQ, mK, mV, sQ, sK, sV, tma_q, tma_k, tma_v, pipe_q, pipe_k, pipe_v,
                          m_block, head, head // qheads_per_kvhead, batch, tile_list)
            if warp_idx == 1:
                row_start = m_block * self.tile_m
                list_key_tiles(tile_list, mBlockBounds[mask_batch, mask_head, None, None], row_start,
                               cutlass.min(row_start + self.tile_m, seqlen_q), seqlen_k, seqlen_k - seqlen_q,
                               self.tile_n, self.causal, self.mask_width, self.skip_tiles)
        else:
            if const_expr(self.setmaxnreg):
                cute.arch.setmaxregister_increase(self.consumer_regs)
            self.consume(mO if const_expr(tma_o is None) else (tma_o, tma_mO), mLSE, mRowIndices, sQ, sK,
                         transpose_view(sV), sBounds, tiled_mma_qk, tiled_mma_pv, pipe_q, pipe_k, pipe_v, tidx - 128,
                         scale_log2, m_block, head, batch, mask_batch, mask_head, tile_list, seqlen_q, seqlen_k)

    @cute.jit
    def load(self, mQ, mK, mV, sQ, sK, sV, tma_q, tma_k, tma_v, pipe_q, pipe_k, pipe_v,
             m_block, head, head_kv, batch, tile_list):
        """Producer warp: Q once, then K and V of every listed key tile (with `k_ahead`, K of tile j+1
        before V of tile j: a turn of the overlapped loop needs both)."""
        gQ = cute.local_tile(mQ[None, None, head, batch], (self.tile_m, self.head_dim), (m_block, 0))
        gK = cute.local_tile(mK[None, None, head_kv, batch], (self.tile_n, self.head_dim), (None, 0))
        gV = cute.local_tile(mV[None, None, head_kv, batch], (self.tile_n, self.head_dim), (None, 0))
        tQsQ, tQgQ = _tma_tiles(tma_q, sQ, gQ)
        tKsK, tKgK = _tma_tiles(tma_k, sK, gK)
        tVsV, tVgV = _tma_tiles(tma_v, sV, gV)

        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        pipe_q.producer_acquire(q_state)
        cute.copy(tma_q, tQgQ, tQsQ, tma_bar_ptr=pipe_q.producer_get_barrier(q_state))
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
        position = Int32(0)
        entry = tile_list.read(position)
        if const_expr(self.k_ahead):
            v_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
            if entry != END_OF_LIST:
                self.load_tile(tma_k, tKgK, tKsK, pipe_k, state, entry >> 1)
                state.advance()
                previous = entry
                position += 1
                entry = tile_list.read(position)
                while entry != END_OF_LIST:
                    self.load_tile(tma_k, tKgK, tKsK, pipe_k, state, entry >> 1)
                    state.advance()
                    self.load_tile(tma_v, tVgV, tVsV, pipe_v, v_state, previous >> 1)
                    v_state.advance()
                    previous = entry
                    position += 1
                    entry = tile_list.read(position)
                self.load_tile(tma_v, tVgV, tVsV, pipe_v, v_state, previous >> 1)
        else:
            while entry != END_OF_LIST:
                self.load_tile(tma_k, tKgK, tKsK, pipe_k, state, entry >> 1)
                self.load_tile(tma_v, tVgV, tVsV, pipe_v, state, entry >> 1)
                state.advance()
                position += 1
                entry = tile_list.read(position)

    @cute.jit
    def load_tile(self, tma, gmem_tiles, smem_stages, pipe, state, n_block):
        """TMA of key tile `n_block` into the pipeline stage of `state`, once it is free."""
        pipe.producer_acquire(state)
        cute.copy(tma, gmem_tiles[None, n_block], smem_stages[None, state.index],
                  tma_bar_ptr=pipe.producer_get_barrier(state))

    @cute.jit
    def consume(self, mO, mLSE, mRowIndices, sQ, sK, sVt, sBounds, tiled_mma_qk, tiled_mma_pv, pipe_q, pipe_k, pipe_v,
                tidx, scale_log2, m_block, head, batch, mask_batch, mask_head, tile_list, seqlen_q, seqlen_k):
        """Consumer warpgroups: the masked online-softmax main loop and the epilogue. `mO` is the output
        tensor, or with `tma_store` the (TMA atom, TMA tensor) of it; `sBounds` the smem for
        `bounds_prefetch` (or None)."""
        wg = cute.arch.make_warp_uniform(tidx // 128)
        thr_qk = tiled_mma_qk.get_slice(tidx)
        thr_pv = tiled_mma_pv.get_slice(tidx)
        wg_qk = tiled_mma_qk.get_slice(wg * 128)
        wg_pv = tiled_mma_pv.get_slice(wg * 128)
        tSrQ = wg_qk.make_fragment_A(wg_qk.partition_A(sQ))
        tSrK = wg_qk.make_fragment_B(wg_qk.partition_B(sK))
        tOrV = wg_pv.make_fragment_B(wg_pv.partition_B(sVt))
        tOrP = wg_pv.make_fragment_A(wg_pv.partition_shape_A((self.tile_m, self.tile_n)))
        acc_O = cute.make_rmem_tensor(wg_pv.partition_shape_C((self.tile_m, self.head_dim)), Float32)
        acc_O.fill(0.0)
        s_shape = wg_qk.partition_shape_C((self.tile_m, self.tile_n))
        s_coords = thr_qk.partition_C(cute.make_identity_tensor((self.tile_m, self.tile_n)))
        row_max = cute.make_rmem_tensor(cute.size(acc_rows_view(acc_O), mode=[0]), Float32)
        row_sum = cute.make_rmem_tensor_like(row_max, Float32)
        row_max.fill(-Float32.inf)
        row_sum.fill(0.0)
        row_start = m_block * self.tile_m
        causal_offset = seqlen_k - seqlen_q

        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        pipe_q.consumer_wait(q_state)
        # Ping-pong: the two warpgroups take turns on the tensor cores (PV of one tile and QK of
        # the next), so one warpgroup's softmax runs under the other's GEMMs. Warpgroup 0 starts.
        if const_expr(self.pingpong):
            if wg == 0:
                cute.arch.barrier_arrive(barrier_id=_MMA_TURN, number_of_threads=256)
            cute.arch.barrier(barrier_id=_MMA_TURN + wg, number_of_threads=256)
        mask_args = (s_coords, mRowIndices, mask_batch, mask_head, row_start, seqlen_k, causal_offset)
        if const_expr(self.intra_wg_overlap):
            bounds = None
            if const_expr(self.bounds_prefetch):
                bounds = (sBounds[None, None, None, wg], tidx % 128, wg)
            self.overlapped_loop(tiled_mma_qk, tiled_mma_pv, tSrQ, tSrK, tOrV, tOrP, acc_O, s_shape, row_max,
                                 row_sum, pipe_k, pipe_v, wg, scale_log2, tile_list, mask_args, bounds)
        else:
            state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
            position = Int32(0)
            entry = tile_list.read(position)
            while entry != END_OF_LIST:
                acc_S = self.scores_alone(tiled_mma_qk, tSrQ, tSrK, s_shape, pipe_k, state, wg)
                self.mask_scores(acc_S, entry, position, None, *mask_args)
                softmax_update(acc_S, acc_O, row_max, row_sum, scale_log2)
                tOrP.store(acc_as_operand_a(acc_S).load().to(self.dtype))
                pipe_v.consumer_wait(state)
                self.begin_turn(wg)
                _wgmma(tiled_mma_pv, acc_O, tOrP, tOrV[None, None, None, state.index], zero_init=False)
                warpgroup.wait_group(0)
                pipe_v.consumer_release(state)
                state.advance()
                position += 1
                entry = tile_list.read(position)
            self.end_turn(wg)

        lse = softmax_finalize(acc_O, row_max, row_sum, scale_log2)
        if const_expr(self.tma_store):
            self.store_tma(acc_O, lse, tiled_mma_pv, thr_pv, sQ, *mO, mLSE, m_block, head, batch, seqlen_q, tidx)
        else:
            self.store(acc_O, lse, thr_pv, mO, mLSE, m_block, head, batch, seqlen_q)

    @cute.jit
    def overlapped_loop(self, tiled_mma_qk, tiled_mma_pv, tSrQ, tSrK, tOrV, tOrP, acc_O, s_shape, row_max, row_sum,
                        pipe_k, pipe_v, wg, scale_log2, tile_list, mask_args, bounds):
        """The main loop with intra-warpgroup overlap (FA3; `KernelOptions.intra_wg_overlap`, the
        default): in one turn on the tensor cores a warpgroup issues S_j = Q K_j^T and
        O += P_{j-1} V_{j-1} back to back, then runs the softmax of S_j while its PV runs, and
        rescales O once the PV is done. Entered inside the warpgroup's first turn. `bounds`:
        (smem buffers, lane, warpgroup) with `bounds_prefetch`, else None."""
        k_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
        v_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
        position = Int32(0)
        entry = tile_list.read(position)
        if entry != END_OF_LIST:
            self.prefetch_bounds(bounds, entry, position, mask_args)
            acc_S = self.scores_alone(tiled_mma_qk, tSrQ, tSrK, s_shape, pipe_k, k_state, wg)
            k_state.advance()
            self.mask_scores(acc_S, entry, position, bounds, *mask_args)
            softmax_rescore(acc_S, row_max, row_sum, scale_log2)  # O is still zero: nothing to rescale
            tOrP.store(acc_as_operand_a(acc_S).load().to(self.dtype))
            position += 1
            entry = tile_list.read(position)
            self.prefetch_bounds(bounds, entry, position, mask_args)
            while entry != END_OF_LIST:
                acc_S = cute.make_rmem_tensor(s_shape, Float32)
                if const_expr(self.k_ahead):  # K_j comes before V_{j-1}: start the QK before waiting for V
                    pipe_k.consumer_wait(k_state)
                    self.begin_turn(wg)
                    _wgmma(tiled_mma_qk, acc_S, tSrQ, tSrK[None, None, None, k_state.index], zero_init=True)
                    pipe_v.consumer_wait(v_state)
                else:
                    pipe_v.consumer_wait(v_state)
                    self.begin_turn(wg)
                    pipe_k.consumer_wait(k_state)
                    _wgmma(tiled_mma_qk, acc_S, tSrQ, tSrK[None, None, None, k_state.index], zero_init=True)
                _wgmma(tiled_mma_pv, acc_O, tOrP, tOrV[None, None, None, v_state.index], zero_init=False)
                self.end_turn(wg)
                next_entry = entry
                if const_expr(self.entry_ahead):  # the ring read and the next bounds' cp.async under the GEMMs
                    next_entry = tile_list.read(position + 1)
                    self.prefetch_bounds(bounds, next_entry, position + 1, mask_args)
                warpgroup.wait_group(1)  # S_j is ready, the PV may still run
                pipe_k.consumer_release(k_state)
                k_state.advance()
                self.mask_scores(acc_S, entry, position, bounds, *mask_args, newer_groups=int(self.entry_ahead))
                correction = softmax_rescore(acc_S, row_max, row_sum, scale_log2)
                warpgroup.wait_group(0)
                pipe_v.consumer_release(v_state)
                v_state.advance()
                rescale_rows(acc_O, correction)
                tOrP.store(acc_as_operand_a(acc_S).load().to(self.dtype))
                position += 1
                if const_expr(self.entry_ahead):
                    entry = next_entry
                else:
                    entry = tile_list.read(position)
                    self.prefetch_bounds(bounds, entry, position, mask_args)
            pipe_v.consumer_wait(v_state)
            self.begin_turn(wg)
            _wgmma(tiled_mma_pv, acc_O, tOrP, tOrV[None, None, None, v_state.index], zero_init=False)
            self.end_turn(wg)
            warpgroup.wait_group(0)
            pipe_v.consumer_release(v_state)
        else:
            self.end_turn(wg)  # no key tile: hand over the (empty) first turn

    @cute.jit
    def scores_alone(self, tiled_mma_qk, tSrQ, tSrK, s_shape, pipe_k, state, wg) -> cute.Tensor:
        """S = Q K^T of the key tile in `state`'s stage as the turn's only GEMM: hand the turn over,
        wait for S, release the K stage."""
        acc_S = cute.make_rmem_tensor(s_shape, Float32)
        pipe_k.consumer_wait(state)
        _wgmma(tiled_mma_qk, acc_S, tSrQ, tSrK[None, None, None, state.index], zero_init=True)
        self.end_turn(wg)
        warpgroup.wait_group(0)
        pipe_k.consumer_release(state)
        return acc_S

    @cute.jit
    def prefetch_bounds(self, bounds, entry, position, mask_args):
        """`bounds_prefetch`: for a PARTIAL tile, each thread of the warpgroup starts a cp.async of one
        key column's boundaries into the warpgroup's smem buffer of `position` (two alternate), so
        `mask_scores` reads smem, not global memory, right after the QK GEMM. The turn barrier between
        refills of a buffer proves the whole warpgroup is done reading it."""
        if const_expr(bounds is not None):
            sBounds, lane, _ = bounds
            _, mRowIndices, mask_batch, mask_head, _, seqlen_k, _ = mask_args
            if entry != END_OF_LIST and (entry & 1) != 0:
                key = cutlass.min((entry >> 1) * self.tile_n + lane, seqlen_k - 1)
                atom = cute.make_copy_atom(cpasync.CopyG2SOp(), Int32, num_bits_per_copy=32)
                one_per_copy = cute.make_layout((1, self.mask_width))  # (atom value, boundary)
                cute.copy(atom, cute.make_tensor(mRowIndices[mask_batch, mask_head, key, None].iterator, one_per_copy),
                          cute.make_tensor(sBounds[lane, None, position % 2].iterator, one_per_copy))
                if const_expr(not self.entry_ahead):
                    cute.arch.cp_async_commit_group()
            if const_expr(self.entry_ahead):  # a group per entry, empty if unmasked: the mask waits by count
                cute.arch.cp_async_commit_group()

    @cute.jit
    def mask_scores(self, acc_S, entry, position, bounds, s_coords, mRowIndices, mask_batch, mask_head, row_start,
                    seqlen_k, causal_offset, newer_groups: cutlass.Constexpr[int] = 0):
        """The element mask, on tiles the mask role listed PARTIAL only; with `bounds` (see
        `prefetch_bounds`) the column boundaries come from smem, once all but the `newer_groups`
        latest cp.async groups (a later tile's, with `entry_ahead`) have landed."""
        if (entry & 1) != 0:
            tile_bounds = None
            if const_expr(bounds is not None):
                sBounds, _, wg = bounds
                cute.arch.cp_async_wait_group(newer_groups)
                cute.arch.barrier(barrier_id=self.bounds_barrier + wg, number_of_threads=128)
                tile_bounds = sBounds[None, None, position % 2]
            apply_column_mask(acc_S, s_coords, mRowIndices, mask_batch, mask_head, row_start,
                              (entry >> 1) * self.tile_n, seqlen_k, causal_offset, self.causal, self.mask_width,
                              tile_bounds=tile_bounds)

    @cute.jit
    def begin_turn(self, wg):
        """Wait for this warpgroup's turn on the tensor cores (ping-pong)."""
        if const_expr(self.pingpong):
            cute.arch.barrier(barrier_id=_MMA_TURN + wg, number_of_threads=256)

    @cute.jit
    def end_turn(self, wg):
        """Hand the tensor cores to the next warpgroup (ping-pong; round robin with three)."""
        if const_expr(self.pingpong):
            if const_expr(self.num_consumer_wgs == 2):
                cute.arch.barrier_arrive(barrier_id=_MMA_TURN + 1 - wg, number_of_threads=256)
            else:
                next_wg = (wg + 1) % self.num_consumer_wgs
                cute.arch.barrier_arrive(barrier_id=_MMA_TURN + next_wg, number_of_threads=256)

    @cute.jit
    def store(self, acc_O, lse, thr_pv, mO, mLSE, m_block, head, batch, seqlen_q):
        """Epilogue: O in the input dtype and the LSE, rows past seqlen_q left unwritten."""
        rO = cute.make_rmem_tensor_like(acc_O, self.dtype)
        rO.store(acc_O.load().to(self.dtype))
        o_rows = acc_rows_view(rO)
        coords = acc_rows_view(thr_pv.partition_C(cute.make_identity_tensor((self.tile_m, self.head_dim))))
        gO = mO[None, None, head, batch]
        for r in cutlass.range_constexpr(cute.size(o_rows, mode=[0])):
            row = m_block * self.tile_m + coords[r, 0][0]
            if row < seqlen_q:
                for c in cutlass.range_constexpr(cute.size(o_rows, mode=[1])):
                    gO[row, coords[r, c][1]] = o_rows[r, c]
                if coords[r, 0][1] == 0:
                    mLSE[row, head, batch] = lse[r]

    @cute.jit
    def store_tma(self, acc_O, lse, tiled_mma_pv, thr_pv, sQ, tma_o, mO, mLSE, m_block, head, batch, seqlen_q,
                  tidx):
        """Epilogue (`tma_store`): O into the Q buffer by stmatrix, then one TMA store of the tile, which
        leaves out rows past seqlen_q (full 128-byte lines instead of 4-byte stores); the LSE as in `store`."""
        rO = cute.make_rmem_tensor_like(acc_O, self.dtype)
        rO.store(acc_O.load().to(self.dtype))
        # Every consumer warpgroup's last QK GEMM (the readers of sQ) is done before it is overwritten.
        cute.arch.barrier(barrier_id=self.epilogue_barrier, number_of_threads=128 * self.num_consumer_wgs)
        st_copy = cute.make_tiled_copy_C(
            cute.make_copy_atom(warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype), tiled_mma_pv)
        thr_copy = st_copy.get_slice(tidx)
        cute.copy(st_copy, thr_copy.retile(rO), thr_copy.partition_D(sQ))
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=self.epilogue_barrier, number_of_threads=128 * self.num_consumer_wgs)
        if tidx == 0:
            gO = cute.local_tile(mO[None, None, head, batch], (self.tile_m, self.head_dim), (m_block, 0))
            t_s, t_g = _tma_tiles(tma_o, sQ, gO)
            cute.copy(tma_o, t_s, t_g)
            cute.arch.cp_async_bulk_commit_group()
        coords = acc_rows_view(thr_pv.partition_C(cute.make_identity_tensor((self.tile_m, self.head_dim))))
        if coords[0, 0][1] == 0:  # the thread holding column 0 of its rows writes their LSE
            for r in cutlass.range_constexpr(cute.size(lse)):
                row = m_block * self.tile_m + coords[r, 0][0]
                if row < seqlen_q:
                    mLSE[row, head, batch] = lse[r]
        if tidx == 0:
            cute.arch.cp_async_bulk_wait_group(0, read=True)  # sQ stays valid until the TMA has read it
