"""Mask-aware attention forward for Hopper (sm_90a) in the CuTe DSL.

A persistent kernel: at most one CTA per SM, each working through (query tile, query head, batch)
work tiles that its mask role draws (tile_scheduler.py). 3 warpgroups (4 with 192-row query tiles;
the tuning choices come as a `FwdConfig`, config.py):
  - warpgroup 0, warp 1: the mask role (mask_role.py). Draws the CTA's next work tile, classifies
    its key tiles from the per-key-block min/max of the mask and publishes a header with the work
    tile, then the key tiles not fully masked with their flags (mask_role.py), into a smem ring
    the other warps read.
  - warpgroup 0, warp 0: producer. TMA-loads each work tile's Q into one of two Q buffers, so the
    next work tile's Q lands while this one runs, then K and V of each listed key tile (K of tile
    j+1 before V of tile j) into a `num_stages`-deep mbarrier pipeline that runs on across work tiles.
  - warpgroups 1-2 (1-3): consumers, 64 query rows each, taking turns on the tensor cores
    (ping-pong). In one turn a warpgroup issues S_j = Q K_j^T (SS-WGMMA) and O += P_{j-1} V_{j-1}
    (RS-WGMMA, P stays in registers), then runs the softmax of S_j under its PV (FA3's intra-warpgroup
    overlap): the element mask only on tiles listed PARTIAL (their column bounds cp.async'd into smem
    a tile ahead), online softmax in fp32. O leaves by stmatrix into the work tile's Q buffer (its
    last S GEMM is done) and one TMA store, which completes under the next work tile; or, with one Q
    buffer and `o_from_registers`, straight from registers, the Q buffer freed after the last S GEMM.
Skipped tiles cost neither loads nor MMAs. setmaxnreg moves registers from warpgroup 0 to the
consumers.
"""

from __future__ import annotations

from typing import Type

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90
from cutlass import Float32, Int32, const_expr, pipeline
from cutlass.cute.nvgpu import cpasync, warp, warpgroup
from cutlass.memory import SmemAllocator

from .config import FwdConfig
from .hopper import (
    assume_aligned,
    check_smem_fits,
    convert_to_16bit,
    select_modes,
    smem_layout,
    store_from_registers,
    store_rows,
    tma_pipeline,
    tma_tiles,
    wgmma,
)
from .layout import acc_as_operand_a, acc_rows_view, transpose_view
from .mask import LOWER, UPPER, apply_causal_diagonal, apply_column_mask
from .mask_role import (
    DIAGONAL_ONLY,
    END_OF_LIST,
    FLAG_BITS,
    LOWER_ONLY,
    OFF_DIAGONAL,
    PARTIAL,
    UNIFORM,
    UPPER_ONLY,
    TileList,
    counted_key_tiles,
    entry_tile,
    list_work_tiles,
)
from .softmax import LOG2_E, rescale_rows, softmax_finalize, softmax_rescore, warp_rows_moved
from .tile_scheduler import NO_MORE_WORK, WorkTiles
from .timeline import TURN_SEGMENTS, Event, SegmentProfile, Timeline, TurnEvent

# Named barriers (0 is sync_threads), with n consumer warpgroups: 1..n whose turn on the tensor
# cores; n + 1 the consumers' epilogue (`epilogue_barrier`); n + 2 onwards a warpgroup's prefetched
# column bounds are in smem, and without turn barriers its bounds buffer is free to refill
# (`bounds_barrier`).
_MMA_TURN = 1


class FlashMaskForwardSm90:
    """Compile-time configuration and kernel of the forward pass."""

    def __init__(
        self,
        dtype: Type[cutlass.Numeric],
        head_dim: int,
        causal: bool,
        mask_width: int,
        config: FwdConfig,
        head_dim_v: int | None = None,
    ):
        head_dim_v = head_dim if head_dim_v is None else head_dim_v
        if head_dim not in (64, 128, 192, 256):
            raise ValueError(f"head_dim must be 64, 128, 192 or 256 for the cute backend, got {head_dim}")
        if head_dim > 128 and config.q_buffers != 1:
            raise ValueError(
                f"head_dim {head_dim} needs q_buffers=1 (two Q buffers do not fit beside two K/V stages), "
                f"got q_buffers={config.q_buffers}"
            )
        if head_dim_v not in (64, 128, 256) or head_dim_v > head_dim:
            raise ValueError(
                f"head_dim_v must be 64, 128 or 256 and at most head_dim ({head_dim}; O is staged in Q's "
                f"buffer), got {head_dim_v}"
            )
        if config.tile_m == 192 and head_dim != 64:
            raise ValueError(f"192-row query tiles need head_dim 64, got {head_dim}")
        self.dtype = dtype
        self.head_dim = head_dim
        self.head_dim_v = head_dim_v
        self.causal = causal
        self.mask_width = mask_width
        self.tile_m = config.tile_m
        self.tile_n = config.tile_n  # the host's key-block min/max are per tile_n keys
        self.num_stages = config.num_stages
        self.q_buffers = config.q_buffers
        self.uniform_tiles = config.uniform_tiles
        self.diagonal_tiles = config.diagonal_tiles and causal
        self.off_diagonal_tiles = config.off_diagonal_tiles and causal
        self.one_interval_tiles = config.one_interval_tiles and not causal
        self.late_k_release = config.late_k_release
        self.fmax_row_max = config.fmax_row_max
        self.lazy_rescale = config.lazy_rescale
        self.segment_tiles = config.segment_tiles
        self.o_from_registers = config.o_from_registers
        self.turn_barriers = config.turn_barriers
        self.counted_keys = config.counted_keys
        self.num_consumer_wgs = config.num_consumer_wgs
        self.num_threads = 128 * (self.num_consumer_wgs + 1)
        # setmaxnreg: the producer warpgroup's registers to the consumers (65536 per SM in all); at
        # head dims above 128 the mask-role warp spills with 24 (at causal, width 2), and 232 fit
        # the consumers' loop.
        self.producer_regs, self.consumer_regs = (24, 240) if self.num_consumer_wgs == 2 else (32, 160)
        if head_dim > 128:
            self.producer_regs, self.consumer_regs = 32, 232
        self.epilogue_barrier = _MMA_TURN + self.num_consumer_wgs
        self.bounds_barrier = self.epilogue_barrier + 1

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # [B, Sq, Hq, D]
        mK: cute.Tensor,  # [B, Sk, Hkv, D]
        mV: cute.Tensor,  # [B, Sk, Hkv, Dv]
        mO: cute.Tensor,  # [B, Sq, Hq, Dv]
        mLSE: cute.Tensor,  # [B, Hq, Sq] fp32
        mRowIndices: cute.Tensor,  # [Bm, Hm, Sk, 1|2|4] int32: the mask's startend_row_indices
        mBlockBounds: cute.Tensor,  # [Bm, Hm, Tn, 2 * width] int32: per key tile, min then max of each column
        mTileCounter: cute.Tensor,  # [1] int32, zero: the work tiles drawn so far beyond the first per CTA
        mTileOrder: cute.Tensor | None,  # [work tiles] int32 when few per SM: the n-th to draw
        mTileRows: cute.Tensor | None,  # [Bm, Hm, Tv, 2] int32 with segment_tiles (segments.py), else None
        mTimeline: cute.Tensor | None,  # [CTAs, work tiles, len(Event)] int64 in a timeline build, else None
        mTurnProfile: cute.Tensor | None,  # [CTAs, len(TurnEvent)] int64 in a turn-profiled build, else None
        mSinks: cute.Tensor | None,  # [Hq] fp32: each head's sink logit, joined to its rows' softmax
        softmax_scale: Float32,
        qheads_per_kvhead: Int32,
        qheads_per_maskhead: Int32,
        mask_batch_stride: Int32,
        max_ctas: Int32,  # the SM count for a persistent grid (larger: one CTA per work tile)
        stream: cuda.CUstream,
    ):
        mQ, mK, mV, mO = (select_modes(assume_aligned(t), [1, 3, 2, 0]) for t in (mQ, mK, mV, mO))
        mLSE = select_modes(mLSE, [2, 1, 0])  # (Sq, Hq, B)
        sQ_layout = smem_layout(self.dtype, self.tile_m, self.head_dim, self.q_buffers)  # each Q, then O
        q_tile = cute.select(sQ_layout, mode=[0, 1])
        # O is staged in its work tile's Q buffer: the same layout, or Dv columns at Q's buffer stride.
        sO_layout, o_tile = sQ_layout, q_tile
        if const_expr(self.head_dim_v != self.head_dim):
            o_tile = smem_layout(self.dtype, self.tile_m, self.head_dim_v)
            buffers = cute.make_layout(self.q_buffers, stride=cute.cosize(q_tile))
            sO_layout = cute.make_composed_layout(o_tile.inner, 0, cute.append(o_tile.outer, buffers))
        sK_layout = smem_layout(self.dtype, self.tile_n, self.head_dim, self.num_stages)
        k_tile = cute.select(sK_layout, mode=[0, 1])
        sV_layout = smem_layout(self.dtype, self.tile_n, self.head_dim_v, self.num_stages)
        v_tile = cute.select(sV_layout, mode=[0, 1])
        tiled_mma_qk = sm90.make_trivial_tiled_mma(
            self.dtype,
            self.dtype,
            warpgroup.OperandMajorMode.K,
            warpgroup.OperandMajorMode.K,
            Float32,
            atom_layout_mnk=(self.num_consumer_wgs, 1, 1),
            tiler_mn=(64, self.tile_n),
        )
        tiled_mma_pv = sm90.make_trivial_tiled_mma(
            self.dtype,
            self.dtype,
            warpgroup.OperandMajorMode.K,
            warpgroup.OperandMajorMode.MN,
            Float32,
            atom_layout_mnk=(self.num_consumer_wgs, 1, 1),
            tiler_mn=(64, self.head_dim_v),
            a_source=warpgroup.OperandSource.RMEM,
        )
        load_op = cpasync.CopyBulkTensorTileG2SOp()
        tma_q, tma_mQ = cpasync.make_tiled_tma_atom(load_op, mQ, q_tile, (self.tile_m, self.head_dim), 1)
        tma_k, tma_mK = cpasync.make_tiled_tma_atom(load_op, mK, k_tile, (self.tile_n, self.head_dim), 1)
        tma_v, tma_mV = cpasync.make_tiled_tma_atom(load_op, mV, v_tile, (self.tile_n, self.head_dim_v), 1)
        tma_o, tma_mO = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(), mO, o_tile, (self.tile_m, self.head_dim_v)
        )
        q_bytes = cute.size_in_bytes(self.dtype, q_tile)
        k_bytes = cute.size_in_bytes(self.dtype, k_tile)
        v_bytes = cute.size_in_bytes(self.dtype, v_tile)
        # (key in tile, boundary, buffer, warpgroup): each warpgroup alternates two tiles' bounds.
        w = self.mask_width
        bounds_layout = cute.make_layout(
            (self.tile_n, w, 2, self.num_consumer_wgs), stride=(w, 1, self.tile_n * w, 2 * self.tile_n * w)
        )

        turn_slots = len(TURN_SEGMENTS) + 1 if const_expr(mTurnProfile is not None) else 0

        @cute.struct
        class SharedStorage:
            # The 1024-aligned tiles first, so no padding sits between the small fields and them.
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sV_layout)], 1024]
            mbar_q: cute.struct.MemRange[cutlass.Int64, self.q_buffers * 2]
            mbar_k: cute.struct.MemRange[cutlass.Int64, self.num_stages * 2]
            mbar_v: cute.struct.MemRange[cutlass.Int64, self.num_stages * 2]
            mbar_tiles: cute.struct.MemRange[cutlass.Int64, TileList.slots * 2]
            tile_ring: cute.struct.MemRange[Int32, TileList.slots]
            sBounds: cute.struct.Align[cute.struct.MemRange[Int32, cute.cosize(bounds_layout)], 16]
            # The turn profile's cycles per segment, then its turn count (none in the default build).
            turn_cycles: cute.struct.MemRange[cutlass.Int64, turn_slots]

        check_smem_fits(
            SharedStorage.size_in_bytes(),
            f"the forward at head dim {self.head_dim} with tile_m={self.tile_m}, tile_n={self.tile_n}, "
            f"num_stages={self.num_stages}, q_buffers={self.q_buffers}",
        )
        num_ctas = cutlass.min(self.work_tiles(mQ, mRowIndices, None).total, max_ctas)
        self.kernel(
            tma_mQ,
            tma_mK,
            tma_mV,
            tma_mO,
            mO if const_expr(self.segment_tiles or self.o_from_registers) else None,
            mLSE,
            mRowIndices,
            mBlockBounds,
            mTileCounter,
            mTileOrder,
            mTileRows,
            mTimeline,
            mTurnProfile,
            mSinks,
            tma_q,
            tma_k,
            tma_v,
            tma_o,
            q_bytes,
            k_bytes,
            v_bytes,
            Float32(softmax_scale * LOG2_E),
            qheads_per_kvhead,
            qheads_per_maskhead,
            mask_batch_stride,
            sQ_layout,
            sO_layout,
            sK_layout,
            sV_layout,
            bounds_layout,
            tiled_mma_qk,
            tiled_mma_pv,
            SharedStorage,
        ).launch(grid=(num_ctas, 1, 1), block=[self.num_threads, 1, 1], stream=stream, min_blocks_per_mp=1)

    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mO: cute.Tensor,
        mO_rows: cute.Tensor | None,
        mLSE: cute.Tensor,
        mRowIndices: cute.Tensor,
        mBlockBounds: cute.Tensor,
        mTileCounter: cute.Tensor,
        mTileOrder: cute.Tensor | None,
        mTileRows: cute.Tensor | None,
        mTimeline: cute.Tensor | None,
        mTurnProfile: cute.Tensor | None,
        mSinks: cute.Tensor | None,
        tma_q: cute.CopyAtom,
        tma_k: cute.CopyAtom,
        tma_v: cute.CopyAtom,
        tma_o: cute.CopyAtom,
        q_bytes: cutlass.Constexpr[int],
        k_bytes: cutlass.Constexpr[int],
        v_bytes: cutlass.Constexpr[int],
        scale_log2: Float32,
        qheads_per_kvhead: Int32,
        qheads_per_maskhead: Int32,
        mask_batch_stride: Int32,
        sQ_layout: cute.ComposedLayout,
        sO_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout,
        bounds_layout: cute.Layout,
        tiled_mma_qk: cute.TiledMma,
        tiled_mma_pv: cute.TiledMma,
        SharedStorage: cutlass.Constexpr,
    ):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        num_ctas, _, _ = cute.arch.grid_dim()
        work_tiles = self.work_tiles(mQ, mRowIndices, mTileOrder)
        timeline = Timeline(mTimeline)
        if warp_idx == 0:
            for atom in (tma_q, tma_k, tma_v, tma_o):
                cpasync.prefetch_descriptor(atom)

        storage = SmemAllocator().allocate(SharedStorage)
        consumer_warps = pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_consumer_wgs * 4)
        # A Q buffer is free once the TMA store of the O staged in it has read it: one thread knows.
        # With O stored from registers, once each warpgroup's last S GEMM has read it: one thread each.
        q_releasers = self.num_consumer_wgs if const_expr(self.o_from_registers) else 1
        pipe_q = tma_pipeline(
            storage.mbar_q, self.q_buffers, q_bytes, pipeline.CooperativeGroup(pipeline.Agent.Thread, q_releasers)
        )
        pipe_k = tma_pipeline(storage.mbar_k, self.num_stages, k_bytes, consumer_warps)
        pipe_v = tma_pipeline(storage.mbar_v, self.num_stages, v_bytes, consumer_warps)
        tile_list = TileList(
            storage.tile_ring.get_tensor(cute.make_layout(TileList.slots)), storage.mbar_tiles.data_ptr()
        )
        tile_list.init(1 + 4 * self.num_consumer_wgs, warp_idx, self.num_threads // 32)  # read by producer, consumers
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sO = sQ  # O in the work tile's Q buffer
        if const_expr(self.head_dim_v != self.head_dim):
            sO = storage.sQ.get_tensor(sO_layout.outer, swizzle=sO_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        sBounds = storage.sBounds.get_tensor(bounds_layout)
        seqlen_q, seqlen_k = mQ.shape[0], mK.shape[0]
        if const_expr(self.segment_tiles):  # the tiles walk the virtual rows; the loads and stores map them
            seqlen_q = seqlen_k = mRowIndices.shape[2]
        heads = (qheads_per_kvhead, qheads_per_maskhead, mask_batch_stride)

        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == 0:
                self.load(
                    mQ,
                    mK,
                    mV,
                    sQ,
                    sK,
                    sV,
                    tma_q,
                    tma_k,
                    tma_v,
                    pipe_q,
                    pipe_k,
                    pipe_v,
                    work_tiles,
                    heads,
                    mTileRows,
                    tile_list,
                    timeline,
                )
            if warp_idx == 1:
                list_work_tiles(
                    tile_list,
                    work_tiles,
                    mTileCounter,
                    num_ctas,
                    mBlockBounds,
                    mTileRows,
                    mask_batch_stride,
                    qheads_per_maskhead,
                    seqlen_q,
                    seqlen_k,
                    self.tile_m,
                    self.tile_n,
                    self.causal,
                    self.mask_width,
                    self.uniform_tiles,
                    self.diagonal_tiles,
                    self.off_diagonal_tiles,
                    self.one_interval_tiles,
                    self.counted_keys,
                    timeline,
                )
        else:
            cute.arch.setmaxregister_increase(self.consumer_regs)
            cycles = None
            if const_expr(mTurnProfile is not None):
                cycles = storage.turn_cycles.get_tensor(cute.make_layout(len(TURN_SEGMENTS) + 1))
            turn_profile = SegmentProfile(
                mTurnProfile, cycles, tidx == 128, TurnEvent.WAIT_K, len(TURN_SEGMENTS), TurnEvent.TURNS
            )
            self.consume(
                tma_o,
                mO,
                mO_rows,
                mLSE,
                mSinks,
                mRowIndices,
                mTileRows,
                sQ,
                sO,
                sK,
                transpose_view(sV),
                sBounds,
                tiled_mma_qk,
                tiled_mma_pv,
                pipe_q,
                pipe_k,
                pipe_v,
                tidx - 128,
                scale_log2,
                work_tiles,
                heads,
                tile_list,
                seqlen_q,
                seqlen_k,
                timeline,
                turn_profile,
            )

    def work_tiles(self, mQ: cute.Tensor, mRowIndices: cute.Tensor, order: cute.Tensor | None) -> WorkTiles:
        """The work tiles of Q, (Sq, D, Hq, B): query tiles (of the virtual rows, the mask's keys, with
        segment_tiles) x query heads x batch, drawn in `order`."""
        seqlen_q = mRowIndices.shape[2] if const_expr(self.segment_tiles) else mQ.shape[0]
        num_m_blocks = cute.ceil_div(cute.size(seqlen_q), self.tile_m)
        num_heads = cute.size(mQ.shape[2])
        total = num_m_blocks * num_heads * cute.size(mQ.shape[3])
        return WorkTiles(num_m_blocks, num_heads, total, self.causal, order)

    @cute.jit
    def load(
        self,
        mQ,
        mK,
        mV,
        sQ,
        sK,
        sV,
        tma_q,
        tma_k,
        tma_v,
        pipe_q,
        pipe_k,
        pipe_v,
        work_tiles,
        heads,
        mTileRows,
        tile_list,
        timeline,
    ):
        """Producer warp: per work tile, Q once a Q buffer is free, then K and V of every
        listed key tile, K of tile j+1 before V of tile j (a turn of the consumers' loop needs both).
        With segment_tiles each tile is loaded from its real first row (`mTileRows`)."""
        qheads_per_kvhead, qheads_per_maskhead, mask_batch_stride = heads
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.q_buffers)
        k_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
        v_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
        seqlen_q, seqlen_k = Int32(mQ.shape[0]), Int32(mK.shape[0])
        position = Int32(0)
        tiles_done = Int32(0)
        work = tile_list.read(position)
        while work != NO_MORE_WORK:
            m_block, head, batch = work_tiles.decode(work)
            head_kv = head // qheads_per_kvhead
            mK_head, mV_head = mK[None, None, head_kv, batch], mV[None, None, head_kv, batch]
            tile_rows = None
            if const_expr(self.segment_tiles):
                tile_rows = mTileRows[batch * mask_batch_stride, head // qheads_per_maskhead, None, None]
                mQ_tile = cute.domain_offset((tile_rows[m_block, 0], 0), mQ[None, None, head, batch])
                gQ = cute.local_tile(mQ_tile, (self.tile_m, self.head_dim), (0, 0))
            else:
                gQ = cute.local_tile(mQ[None, None, head, batch], (self.tile_m, self.head_dim), (m_block, 0))
            gK = cute.local_tile(mK_head, (self.tile_n, self.head_dim), (None, 0))
            gV = cute.local_tile(mV_head, (self.tile_n, self.head_dim_v), (None, 0))
            tQsQ, tQgQ = tma_tiles(tma_q, sQ, gQ)
            tKsK, tKgK = tma_tiles(tma_k, sK, gK)
            tVsV, tVgV = tma_tiles(tma_v, sV, gV)
            keys = (tma_k, tKgK, tKsK, pipe_k, (sK, mK_head, self.head_dim, tile_rows))
            values = (tma_v, tVgV, tVsV, pipe_v, (sV, mV_head, self.head_dim_v, tile_rows))
            pipe_q.producer_acquire(q_state)
            cute.copy(tma_q, tQgQ, tQsQ[None, q_state.index], tma_bar_ptr=pipe_q.producer_get_barrier(q_state))
            if cute.arch.lane_idx() == 0:
                timeline.record(tiles_done, Event.Q_ISSUED)
            q_state.advance()
            position += 1
            first = position
            counted = self.counted_tiles(m_block * self.tile_m, seqlen_q, seqlen_k)
            entry = self.key_entry(tile_list, position, first, counted)
            if entry != END_OF_LIST:
                self.load_key_tile(*keys, k_state, entry_tile(entry))
                k_state.advance()
                previous = entry
                position += 1
                entry = self.key_entry(tile_list, position, first, counted)
                while entry != END_OF_LIST:
                    self.load_key_tile(*keys, k_state, entry_tile(entry))
                    k_state.advance()
                    self.load_key_tile(*values, v_state, entry_tile(previous))
                    v_state.advance()
                    previous = entry
                    position += 1
                    entry = self.key_entry(tile_list, position, first, counted)
                self.load_key_tile(*values, v_state, entry_tile(previous))
                v_state.advance()
            position = self.after_key_tiles(position, first)
            tiles_done += 1
            work = tile_list.read(position)

    @cute.jit
    def counted_tiles(self, row_start, seqlen_q, seqlen_k):
        """With `counted_keys`: (how many key tiles the work tile of rows from `row_start` sees,
        the last key its first row sees: causal, the tiles past it are cut by the diagonal)."""
        count = counted_key_tiles(row_start, seqlen_q, seqlen_k, self.tile_m, self.tile_n, self.causal)
        return count, row_start + seqlen_k - seqlen_q

    @cute.jit
    def key_entry(self, tile_list, position, first, counted):
        """List entry number `position` of a work tile whose key tiles start at `first`: the mask
        warp's, or with `counted_keys` key tile `position - first` (DIAGONAL_ONLY where the causal
        diagonal cuts it, else unmasked) while there are `counted` ones (`counted_tiles`), then the
        END_OF_LIST the mask warp put at `first`. Each position is read once, by every reader."""
        if const_expr(self.counted_keys):
            count, diagonal = counted
            index = position - first
            entry = index << FLAG_BITS
            if const_expr(self.causal):
                if (index + 1) * self.tile_n - 1 > diagonal:
                    entry = entry | DIAGONAL_ONLY
            if index >= count:
                entry = tile_list.read(first)
            return entry
        else:
            return tile_list.read(position)

    def after_key_tiles(self, position, first):
        """The list position after a work tile's END_OF_LIST, read at `position` (`key_entry`)."""
        return first + 1 if self.counted_keys else position + 1

    @cute.jit
    def load_key_tile(self, tma, gmem_tiles, smem_stages, pipe, segments, state, n_block):
        """TMA of key tile `n_block` of K or V (`gmem_tiles`, its TMA partition) into the pipeline stage
        of `state`, once it is free. With segment_tiles, from the tile's real first row: `segments` is
        (the smem stages, K or V of the head, its columns, `tile_rows`), and a key tile's first row is
        its granule's (the query tile's size: 128) plus its place in the granule."""
        if const_expr(self.segment_tiles):
            smem, mKV_head, cols, tile_rows = segments
            key = n_block * self.tile_n
            first = tile_rows[key // self.tile_m, 0] + key % self.tile_m
            tile = cute.local_tile(cute.domain_offset((first, 0), mKV_head), (self.tile_n, cols), (None, 0))
            _, gmem_tiles = tma_tiles(tma, smem, tile)
            n_block = 0
        pipe.producer_acquire(state)
        cute.copy(
            tma, gmem_tiles[None, n_block], smem_stages[None, state.index], tma_bar_ptr=pipe.producer_get_barrier(state)
        )

    @cute.jit
    def consume(
        self,
        tma_o,
        mO,
        mO_rows,
        mLSE,
        mSinks,
        mRowIndices,
        mTileRows,
        sQ,
        sO,
        sK,
        sVt,
        sBounds,
        tiled_mma_qk,
        tiled_mma_pv,
        pipe_q,
        pipe_k,
        pipe_v,
        tidx,
        scale_log2,
        work_tiles,
        heads,
        tile_list,
        seqlen_q,
        seqlen_k,
        timeline,
        turn_profile,
    ):
        """Consumer warpgroups: per work tile, the masked online-softmax main loop and the epilogue.
        `sBounds`: the warpgroups' smem buffers of prefetched column bounds (`prefetch_bounds`).
        With segment_tiles the loop works on the virtual rows and the epilogue stores the tile's real
        rows (`mTileRows`; `mO_rows`: O itself, for a tile of fewer than 128 real rows, and for
        o_from_registers).
        `turn_profile`: the turn-profiled build's `SegmentProfile` (compiles to nothing otherwise).
        `mSinks`: the heads' sink logits, joined to each row's softmax in the epilogue, or None."""
        wg = cute.arch.make_warp_uniform(tidx // 128)
        thr_qk = tiled_mma_qk.get_slice(tidx)
        thr_pv = tiled_mma_pv.get_slice(tidx)
        wg_qk = tiled_mma_qk.get_slice(wg * 128)
        wg_pv = tiled_mma_pv.get_slice(wg * 128)
        tSrQ = wg_qk.make_fragment_A(wg_qk.partition_A(sQ))
        tSrK = wg_qk.make_fragment_B(wg_qk.partition_B(sK))
        tOrV = wg_pv.make_fragment_B(wg_pv.partition_B(sVt))
        tOrP = wg_pv.make_fragment_A(wg_pv.partition_shape_A((self.tile_m, self.tile_n)))
        acc_O = cute.make_rmem_tensor(wg_pv.partition_shape_C((self.tile_m, self.head_dim_v)), Float32)
        s_shape = wg_qk.partition_shape_C((self.tile_m, self.tile_n))
        s_coords = thr_qk.partition_C(cute.make_identity_tensor((self.tile_m, self.tile_n)))
        row_max = cute.make_rmem_tensor(cute.size(acc_rows_view(acc_O), mode=[0]), Float32)
        row_sum = cute.make_rmem_tensor_like(row_max, Float32)
        qheads_per_kvhead, qheads_per_maskhead, mask_batch_stride = heads
        causal_offset = seqlen_k - seqlen_q
        bounds = (sBounds[None, None, None, wg], tidx % 128, wg)

        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.q_buffers)
        k_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
        v_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
        # Ping-pong (`turn_barriers`): the warpgroups take turns on the tensor cores (PV of one tile
        # and QK of the next), so one warpgroup's softmax runs under the other's GEMMs. Each takes
        # as many turns per work tile as the others, so the order carries over to the next one.
        if const_expr(self.turn_barriers):
            if wg == 0:
                cute.arch.barrier_arrive(barrier_id=_MMA_TURN, number_of_threads=256)
        position = Int32(0)
        tiles_done = Int32(0)
        turn_profile.start()
        work = tile_list.read(position)
        while work != NO_MORE_WORK:
            m_block, head, batch = work_tiles.decode(work)
            row_start = m_block * self.tile_m
            mask_args = (
                s_coords,
                mRowIndices,
                batch * mask_batch_stride,
                head // qheads_per_maskhead,
                row_start,
                seqlen_k,
                causal_offset,
            )
            tile_rows = None
            if const_expr(self.segment_tiles):  # read here, used by the epilogue: the loop hides the load
                real = mTileRows[batch * mask_batch_stride, head // qheads_per_maskhead, m_block, None]
                tile_rows = (real[0], real[1])
            acc_O.fill(0.0)
            row_max.fill(-Float32.inf)
            row_sum.fill(0.0)
            pipe_q.consumer_wait(q_state)
            if tidx == 0:
                timeline.record(tiles_done, Event.Q_LANDED)
            self.begin_turn(wg)
            if tidx == 0:
                timeline.record(tiles_done, Event.LOOP_START)
            # The other Q buffer holds the previous work tile's O until its store has read it (with
            # one buffer, the store was waited for before this Q could land).
            free_previous_q = (pipe_q, q_state, False)
            # With O stored from registers, each warpgroup frees this Q once its last S GEMM is done.
            own_q = (pipe_q, q_state, self.o_from_registers and tidx % 128 == 0)
            if const_expr(self.q_buffers == 2):
                previous_q = pipeline.PipelineState(2, q_state.count, 1 - q_state.index, q_state.phase)
                free_previous_q = (pipe_q, previous_q, tiles_done > 0 and tidx == 0)
            k_state, v_state, position = self.overlapped_loop(
                tiled_mma_qk,
                tiled_mma_pv,
                tSrQ[None, None, None, q_state.index],
                tSrK,
                tOrV,
                tOrP,
                acc_O,
                s_shape,
                row_max,
                row_sum,
                free_previous_q,
                own_q,
                pipe_k,
                pipe_v,
                k_state,
                v_state,
                wg,
                scale_log2,
                tile_list,
                position + 1,
                self.counted_tiles(row_start, seqlen_q, seqlen_k),
                mask_args,
                bounds,
                turn_profile,
            )
            if tidx == 0:
                timeline.record(tiles_done, Event.LOOP_END)
            sink_log2 = None
            if const_expr(mSinks is not None):
                sink_log2 = mSinks[head] * LOG2_E
            lse = softmax_finalize(acc_O, row_max, row_sum, scale_log2, sink_log2)
            self.store(
                acc_O,
                lse,
                tiled_mma_pv,
                thr_pv,
                sO[None, None, q_state.index],
                tma_o,
                mO,
                mO_rows,
                tile_rows,
                mLSE,
                m_block,
                head,
                batch,
                seqlen_q,
                tidx,
            )
            if const_expr(self.q_buffers == 1 and not self.o_from_registers):  # the next Q needs this buffer
                self.free_q(pipe_q, q_state, tidx == 0)
            q_state.advance()
            if tidx == 0:
                timeline.record(tiles_done, Event.STORED)
            tiles_done += 1
            work = tile_list.read(position)
        turn_profile.write_cycles(cute.arch.block_idx()[0])
        if tidx == 0:
            cute.arch.cp_async_bulk_wait_group(0, read=True)  # smem stays valid until the last store has read it

    @cute.jit
    def overlapped_loop(
        self,
        tiled_mma_qk,
        tiled_mma_pv,
        tSrQ,
        tSrK,
        tOrV,
        tOrP,
        acc_O,
        s_shape,
        row_max,
        row_sum,
        free_previous_q,
        own_q,
        pipe_k,
        pipe_v,
        k_state,
        v_state,
        wg,
        scale_log2,
        tile_list,
        position,
        counted,
        mask_args,
        bounds,
        turn_profile,
    ):
        """One work tile's main loop, from its first list entry at `position` (`counted`: its key
        tiles with `counted_keys`, `counted_tiles`), with intra-warpgroup
        overlap (FA3): in one turn on the tensor cores a warpgroup issues S_j = Q K_j^T and
        O += P_{j-1} V_{j-1} back to back, then runs the softmax of S_j while its PV runs, and rescales
        O once the PV is done; the next list entry is read and its bounds' cp.async started under the
        GEMMs. Entered inside the warpgroup's first turn; once its first S GEMM is in flight, frees the
        previous work tile's Q buffer (`free_previous_q`: the pipeline, that buffer's state, and whether
        this thread does it); once its last S GEMM is done, frees this work tile's (`own_q`, likewise:
        with O stored from registers). Returns the K and V pipeline states and the position after END_OF_LIST.
        `bounds`: the warpgroup's (smem buffers, lane, warpgroup) for `prefetch_bounds`; `turn_profile`
        marks the segments of the steady-state turns (`TurnEvent`)."""
        first = position
        entry = self.key_entry(tile_list, position, first, counted)
        if entry != END_OF_LIST:
            self.prefetch_bounds(bounds, entry, position, mask_args)
            acc_S = self.scores_alone(tiled_mma_qk, tSrQ, tSrK, s_shape, pipe_k, k_state, wg, free_previous_q)
            k_state.advance()
            self.mask_scores(acc_S, entry, position, bounds, *mask_args)
            softmax_rescore(acc_S, row_max, row_sum, scale_log2, self.fmax_row_max)  # O is zero: no rescale
            self.scores_to_operand(acc_S, tOrP)
            position += 1
            entry = self.key_entry(tile_list, position, first, counted)
            self.prefetch_bounds(bounds, entry, position, mask_args)
            self.free_q_after_last_s(own_q, entry == END_OF_LIST)  # a one-key-tile list: S_0 was the last
            clock = turn_profile.now()
            while entry != END_OF_LIST:
                acc_S = cute.make_rmem_tensor(s_shape, Float32)
                pipe_k.consumer_wait(k_state)  # K_j comes before V_{j-1}: start the QK before waiting for V
                clock = turn_profile.mark(clock, TurnEvent.WAIT_K)
                self.begin_turn(wg)
                clock = turn_profile.mark(clock, TurnEvent.WAIT_TURN)
                wgmma(tiled_mma_qk, acc_S, tSrQ, tSrK[None, None, None, k_state.index], zero_init=True)
                pipe_v.consumer_wait(v_state)
                wgmma(tiled_mma_pv, acc_O, tOrP, tOrV[None, None, None, v_state.index], zero_init=False)
                self.end_turn(wg)
                clock = turn_profile.mark(clock, TurnEvent.ISSUE)
                next_entry = self.key_entry(tile_list, position + 1, first, counted)
                self.prefetch_bounds(bounds, next_entry, position + 1, mask_args)
                clock = turn_profile.mark(clock, TurnEvent.NEXT_ENTRY)
                warpgroup.wait_group(1)  # S_j is ready, the PV may still run
                self.free_q_after_last_s(own_q, next_entry == END_OF_LIST)
                clock = turn_profile.mark(clock, TurnEvent.WAIT_S)
                if const_expr(not self.late_k_release):
                    pipe_k.consumer_release(k_state)
                    k_state.advance()
                self.mask_scores(acc_S, entry, position, bounds, *mask_args, newer_groups=1)
                if const_expr(self.late_k_release):  # keeps the PV's wait below the softmax
                    pipe_k.consumer_release(k_state)
                    k_state.advance()
                clock = turn_profile.mark(clock, TurnEvent.MASK)
                correction = softmax_rescore(acc_S, row_max, row_sum, scale_log2, self.fmax_row_max, self.lazy_rescale)
                moved = warp_rows_moved(correction) if const_expr(self.lazy_rescale) else True
                clock = turn_profile.mark(clock, TurnEvent.SOFTMAX)
                warpgroup.wait_group(0)
                pipe_v.consumer_release(v_state)
                v_state.advance()
                clock = turn_profile.mark(clock, TurnEvent.WAIT_PV)
                if moved:
                    rescale_rows(acc_O, correction)
                self.scores_to_operand(acc_S, tOrP)
                clock = turn_profile.mark(clock, TurnEvent.RESCALE)
                turn_profile.add_pass()
                position += 1
                entry = next_entry
            pipe_v.consumer_wait(v_state)
            self.begin_turn(wg)
            wgmma(tiled_mma_pv, acc_O, tOrP, tOrV[None, None, None, v_state.index], zero_init=False)
            self.end_turn(wg)
            warpgroup.wait_group(0)
            pipe_v.consumer_release(v_state)
            v_state.advance()
        else:
            self.end_turn(wg)  # no key tile: hand over the (empty) first turn
            self.free_q(*free_previous_q)
            self.free_q_after_last_s(own_q, True)
        return k_state, v_state, self.after_key_tiles(position, first)

    @cute.jit
    def scores_to_operand(self, acc_S, tOrP):
        """P = S in 16 bits, into `tOrP`, the PV GEMM's A operand in registers. Over key tiles of a
        multiple of 64 the tensor conversion packs the pairs that the operand's registers hold; over
        other widths its pairs straddle them, and ptxas moves registers between the PV GEMM's
        WGMMAs, serializing them (C7519): there, one packed cvt per operand register."""
        if const_expr(self.tile_n % 64 == 0):
            tOrP.store(acc_as_operand_a(acc_S).load().to(self.dtype))
        else:
            convert_to_16bit(acc_as_operand_a(acc_S), tOrP)

    @cute.jit
    def scores_alone(self, tiled_mma_qk, tSrQ, tSrK, s_shape, pipe_k, state, wg, free_previous_q) -> cute.Tensor:
        """S = Q K^T of the key tile in `state`'s stage as the turn's only GEMM: hand the turn over,
        free the previous Q buffer under the GEMM, wait for S, release the K stage."""
        acc_S = cute.make_rmem_tensor(s_shape, Float32)
        pipe_k.consumer_wait(state)
        wgmma(tiled_mma_qk, acc_S, tSrQ, tSrK[None, None, None, state.index], zero_init=True)
        self.end_turn(wg)
        self.free_q(*free_previous_q)
        warpgroup.wait_group(0)
        pipe_k.consumer_release(state)
        return acc_S

    @cute.jit
    def free_q_after_last_s(self, own_q, last_s_done):
        """With O stored from registers: free the work tile's Q buffer (`own_q`: the pipeline, its
        state, whether this thread arrives for its warpgroup) once the warpgroup's last S GEMM is done."""
        if const_expr(self.o_from_registers):
            pipe_q, q_state, this_thread = own_q
            if this_thread and last_s_done:
                pipe_q.consumer_release(q_state)

    @cute.jit
    def free_q(self, pipe_q, q_state, this_thread):
        """Release the Q buffer of `q_state` once the TMA store of the O staged in it (issued by this
        thread, the epilogue's) has read it."""
        if this_thread:
            cute.arch.cp_async_bulk_wait_group(0, read=True)
            pipe_q.consumer_release(q_state)

    @cute.jit
    def prefetch_bounds(self, bounds, entry, position, mask_args):
        """For a PARTIAL tile, each thread of the warpgroup starts a cp.async of one key column's
        boundaries (per 128 keys of the tile) into the warpgroup's smem buffer of `position` (two
        alternate), so `mask_scores` reads smem, not global memory, right after the QK GEMM (read
        from global memory there, the loads sat on the softmax's critical path: 4-25% slower on the
        partial-heavy masks). The turn barrier between refills of a buffer proves the whole
        warpgroup is done reading it; without turn barriers the warpgroup meets at its bounds
        barrier before the refill instead. One cp.async group per entry, empty unless PARTIAL:
        `mask_scores` waits by count."""
        if const_expr(self.counted_keys):  # no bounds to copy
            return
        sBounds, lane, wg = bounds
        _, mRowIndices, mask_batch, mask_head, _, seqlen_k, _ = mask_args
        if entry != END_OF_LIST and (entry & PARTIAL) != 0:
            if const_expr(not self.turn_barriers):
                cute.arch.barrier(barrier_id=self.bounds_barrier + wg, number_of_threads=128)
            atom = cute.make_copy_atom(cpasync.CopyG2SOp(), Int32, num_bits_per_copy=32)
            one_per_copy = cute.make_layout((1, self.mask_width))  # (atom value, boundary)
            for first in cutlass.range_constexpr(0, self.tile_n, 128):  # the warpgroup has 128 threads
                column = lane + first
                copies = True
                if const_expr(self.uniform_tiles):  # a UNIFORM tile's keys share the first key's bounds
                    copies = (entry & UNIFORM) == 0 or column == 0
                if const_expr(first + 128 > self.tile_n):
                    copies = copies and column < self.tile_n
                if copies:
                    key = cutlass.min(entry_tile(entry) * self.tile_n + column, seqlen_k - 1)
                    cute.copy(
                        atom,
                        cute.make_tensor(mRowIndices[mask_batch, mask_head, key, None].iterator, one_per_copy),
                        cute.make_tensor(sBounds[column, None, position & 1].iterator, one_per_copy),
                    )
        cute.arch.cp_async_commit_group()

    @cute.jit
    def mask_scores(
        self,
        acc_S,
        entry,
        position,
        bounds,
        s_coords,
        mRowIndices,
        mask_batch,
        mask_head,
        row_start,
        seqlen_k,
        causal_offset,
        newer_groups: cutlass.Constexpr[int] = 0,
    ):
        """The element mask, on tiles the mask role listed PARTIAL only; the column boundaries come
        from smem (`bounds`, see `prefetch_bounds`) once all but the `newer_groups` latest cp.async
        groups (the next entry's) have landed. DIAGONAL_ONLY tiles: the causal comparison alone;
        OFF_DIAGONAL tiles: the bounds alone."""
        if const_expr(self.counted_keys):  # no bounds: only the causal diagonal cuts a tile
            if const_expr(self.causal):
                if (entry & DIAGONAL_ONLY) != 0:
                    apply_causal_diagonal(acc_S, s_coords, row_start, entry_tile(entry) * self.tile_n, causal_offset)
            return
        if (entry & PARTIAL) != 0:
            sBounds, _, wg = bounds
            cute.arch.cp_async_wait_group(newer_groups)
            cute.arch.barrier(barrier_id=self.bounds_barrier + wg, number_of_threads=128)
            tile_bounds = sBounds[None, None, position & 1]
            key_start = entry_tile(entry) * self.tile_n
            mask = (acc_S, s_coords, mRowIndices, mask_batch, mask_head, row_start, key_start, seqlen_k, causal_offset)
            if const_expr(self.off_diagonal_tiles):
                if (entry & OFF_DIAGONAL) != 0:
                    self.mask_partial(mask, tile_bounds, entry, diagonal=False)
                else:
                    self.mask_partial(mask, tile_bounds, entry, diagonal=True)
            else:
                self.mask_partial(mask, tile_bounds, entry, diagonal=True)
        if const_expr(self.diagonal_tiles):
            if (entry & (PARTIAL | UNIFORM)) == DIAGONAL_ONLY:
                apply_causal_diagonal(acc_S, s_coords, row_start, entry_tile(entry) * self.tile_n, causal_offset)

    @cute.jit
    def mask_partial(self, mask, tile_bounds, entry, diagonal: cutlass.Constexpr[bool]):
        """A PARTIAL tile's element mask from its bounds in smem: per row where UNIFORM; one interval
        where LOWER_ONLY or UPPER_ONLY; the causal comparison only if `diagonal`."""
        if const_expr(self.uniform_tiles):
            if (entry & UNIFORM) != 0:
                apply_column_mask(
                    *mask, self.causal, self.mask_width, tile_bounds=tile_bounds, uniform=True, diagonal=diagonal
                )
            else:
                self.mask_by_columns(mask, tile_bounds, entry, diagonal)
        else:
            self.mask_by_columns(mask, tile_bounds, entry, diagonal)

    @cute.jit
    def mask_by_columns(self, mask, tile_bounds, entry, diagonal: cutlass.Constexpr[bool]):
        """A PARTIAL tile's element mask from each key's bounds: of the one interval that reaches its
        rows where the tile is listed LOWER_ONLY or UPPER_ONLY, else of all."""
        if const_expr(self.one_interval_tiles):
            if (entry & LOWER_ONLY) != 0:
                apply_column_mask(*mask, False, self.mask_width, tile_bounds=tile_bounds, interval=LOWER)
            elif (entry & UPPER_ONLY) != 0:
                apply_column_mask(*mask, False, self.mask_width, tile_bounds=tile_bounds, interval=UPPER)
            else:
                apply_column_mask(*mask, False, self.mask_width, tile_bounds=tile_bounds)
        else:
            apply_column_mask(*mask, self.causal, self.mask_width, tile_bounds=tile_bounds, diagonal=diagonal)

    @cute.jit
    def begin_turn(self, wg):
        """Wait for this warpgroup's turn on the tensor cores (ping-pong)."""
        if const_expr(self.turn_barriers):
            cute.arch.barrier(barrier_id=_MMA_TURN + wg, number_of_threads=256)

    @cute.jit
    def end_turn(self, wg):
        """Hand the tensor cores to the next warpgroup (ping-pong; round robin with three)."""
        if const_expr(self.turn_barriers):
            if const_expr(self.num_consumer_wgs == 2):
                cute.arch.barrier_arrive(barrier_id=_MMA_TURN + 1 - wg, number_of_threads=256)
            else:
                next_wg = (wg + 1) % self.num_consumer_wgs
                cute.arch.barrier_arrive(barrier_id=_MMA_TURN + next_wg, number_of_threads=256)

    @cute.jit
    def store(
        self,
        acc_O,
        lse,
        tiled_mma_pv,
        thr_pv,
        sO,
        tma_o,
        mO,
        mO_rows,
        tile_rows,
        mLSE,
        m_block,
        head,
        batch,
        seqlen_q,
        tidx,
    ):
        """Epilogue: O into `sO` (the work tile's Q buffer) by stmatrix, then one TMA store of the tile,
        which leaves out rows past seqlen_q and completes under the next work tile; or, with
        o_from_registers, O straight from registers (`store_from_registers`). The LSE by the threads
        holding column 0. With segment_tiles the tile's real rows, from `tile_rows` (first row,
        count): a tile of fewer than 128 (a segment's last) is stored row by row."""
        rO = cute.make_rmem_tensor_like(acc_O, self.dtype)
        rO.store(acc_O.load().to(self.dtype))
        coords = acc_rows_view(thr_pv.partition_C(cute.make_identity_tensor((self.tile_m, self.head_dim_v))))
        if const_expr(self.o_from_registers):
            mO_head = mO_rows[None, None, head, batch]
            if const_expr(self.segment_tiles):
                first_row, real_rows = tile_rows
                real_tile = cute.domain_offset((first_row, 0), mO_head)
                gO = cute.local_tile(real_tile, (self.tile_m, self.head_dim_v), (0, 0))
                store_from_registers(rO, coords, gO, real_rows)
            else:
                gO = cute.local_tile(mO_head, (self.tile_m, self.head_dim_v), (m_block, 0))
                store_from_registers(rO, coords, gO, seqlen_q - m_block * self.tile_m)
        else:
            self.store_staged(rO, tiled_mma_pv, sO, tma_o, mO, mO_rows, tile_rows, m_block, head, batch, tidx)
        if coords[0, 0][1] == 0:  # the thread holding column 0 of its rows writes their LSE
            for r in cutlass.range_constexpr(cute.size(lse)):
                if const_expr(self.segment_tiles):
                    if coords[r, 0][0] < tile_rows[1]:
                        mLSE[tile_rows[0] + coords[r, 0][0], head, batch] = lse[r]
                else:
                    row = m_block * self.tile_m + coords[r, 0][0]
                    if row < seqlen_q:
                        mLSE[row, head, batch] = lse[r]

    @cute.jit
    def store_staged(self, rO, tiled_mma_pv, sO, tma_o, mO, mO_rows, tile_rows, m_block, head, batch, tidx):
        """O by stmatrix into `sO`, then the TMA store of the tile (`store`)."""
        # Every consumer warpgroup's last S GEMM (the readers of this Q buffer) is done.
        cute.arch.barrier(barrier_id=self.epilogue_barrier, number_of_threads=128 * self.num_consumer_wgs)
        st_copy = cute.make_tiled_copy_C(
            cute.make_copy_atom(warp.StMatrix8x8x16bOp(transpose=False, num_matrices=4), self.dtype), tiled_mma_pv
        )
        thr_copy = st_copy.get_slice(tidx)
        cute.copy(st_copy, thr_copy.retile(rO), thr_copy.partition_D(sO))
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=self.epilogue_barrier, number_of_threads=128 * self.num_consumer_wgs)
        if const_expr(self.segment_tiles):
            first_row, real_rows = tile_rows
            if real_rows == self.tile_m:
                if tidx == 0:
                    self.store_tile(tma_o, sO, cute.domain_offset((first_row, 0), mO[None, None, head, batch]), 0)
            else:  # a TMA store of the whole tile would write over the next segment's first rows
                real_tile = cute.domain_offset((first_row, 0), mO_rows[None, None, head, batch])
                gO = cute.local_tile(real_tile, (self.tile_m, self.head_dim_v), (0, 0))
                threads = 128 * self.num_consumer_wgs
                store_rows(sO, gO, real_rows, tidx, threads)
                # Every thread has read the Q buffer (ordered before the next TMA write into it)
                # before it is released.
                cute.arch.fence_view_async_shared()
                cute.arch.barrier(barrier_id=self.epilogue_barrier, number_of_threads=threads)
        elif tidx == 0:
            self.store_tile(tma_o, sO, mO[None, None, head, batch], m_block)

    @cute.jit
    def store_tile(self, tma_o, sO, mO_head, m_block):
        """One TMA store of the tile in `sO` as query tile `m_block` of `mO_head` (one thread)."""
        gO = cute.local_tile(mO_head, (self.tile_m, self.head_dim_v), (m_block, 0))
        t_s, t_g = tma_tiles(tma_o, sO, gO)
        cute.copy(tma_o, t_s, t_g)
        cute.arch.cp_async_bulk_commit_group()
