"""Mask-aware attention backward for Hopper (sm_90a) in the CuTe DSL.

Column-parallel, FlashAttention-2/3 style: one CTA per (key tile, KV head, batch) keeps K, V and
the dK, dV accumulators on chip and walks the query tiles (`tile_m` rows: 64, or 128 at head dim
64, `BwdConfig.query_tile`) that can see it, for every query head of its KV group (so GQA sums
dK/dV in registers, no extra pass). The tuning choices come as a `BwdConfig` (config.py).

Warpgroup 0, warp 1 is the mask role (mask_role.py): per query head, it classifies the query tiles
against the key tile from the key block's min/max and publishes the ones not fully masked, flagged
PARTIAL, DIAGONAL_ONLY (causal: only the diagonal cuts it, no key's bounds are needed) or neither,
into a smem ring. Warp 0 is the producer (TMA: K and V once, then Q and dO of each
listed query tile through `q_stages`- and `do_stages`-deep mbarrier pipelines); it writes each
entry beside its Q stage, so the consumers read it after the Q wait (a head's end is a stage
without bytes). Warpgroups 1-2 are consumers; at head dims 64 and 128 (keys on rows), 64 keys
each. They work on the transposed scores, so the rows of a
thread's fragment are keys and each thread loads the mask bounds of only its own two keys:
    S^T = K Q^T, dP^T = V dO^T                      (SS-WGMMA)
    P^T = exp2(S^T * scale * log2 e - LSE * log2 e)  (element mask only on PARTIAL/DIAGONAL_ONLY tiles)
    dV += P^T dO, dS^T = P^T (dP^T - Delta), dK += dS^T Q   (RS-WGMMA: P^T, dS^T stay in registers)
    dQ_tile = dS K                                  (SS-WGMMA from dS written to smem; the two
                                                     warpgroups each take half of the head dim)
and add dQ_tile into an fp32 dQ accumulator in global memory: each thread writes its fragment to smem
as is, and one bulk reduce-add per warpgroup moves it (the accumulator keeps the fragment order;
the postprocess kernel, flash_bwd_pre_post.py, puts it back in place). In deterministic mode the
key tiles of one query tile add in key order (a per-query-tile semaphore), so dQ is bitwise
reproducible. Delta = rowsum(dO * O), the base-2 LSE and the final dQ come from the pre/post
kernels (flash_bwd_pre_post.py).

Above head dim 128 (v 128 with q/k 192, or 256), dK and dV of 64 keys would not fit in a thread's
registers, so the step turns (`BwdConfig.keys_on_rows` off, FA4's SM90 shape there): a CTA takes
`key_tile` keys (96 or 48), the scores keep queries on rows and the two warpgroups split the keys,
    S = Q K^T, dP = dO V^T                           (SS-WGMMA, each warpgroup half the keys)
and P and dS go to smem (one buffer each), from which
    dV^T += dO^T P, dK^T += Q^T dS                   (SS-WGMMA: head dim on M; the warpgroups split
                                                     the head dim at 256, the keys at 192/128)
    dQ_tile = dS K                                  (as above)
and the epilogue stores dK^T and dV^T transposed (stmatrix) into the K and V buffers.
"""

from __future__ import annotations

import enum
import math
from typing import Type

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90
from cutlass import Float32, Int32, const_expr, pipeline
from cutlass._mlir.dialects import llvm
from cutlass.cute.nvgpu import cpasync, warp, warpgroup
from cutlass.memory import SmemAllocator

from .config import BACKWARD_HEAD_DIMS, BwdConfig
from .hopper import (
    assume_aligned,
    check_smem_fits,
    convert_to_16bit,
    select_modes,
    smem_layout,
    store_rows,
    tma_pipeline,
    tma_tiles,
    wgmma,
)
from .layout import acc_as_operand_a, acc_rows_view, transpose_view
from .mask import apply_causal_diagonal, apply_column_mask
from .mask_role import (
    DIAGONAL_ONLY,
    END_OF_LIST,
    FLAG_BITS,
    PARTIAL,
    TileList,
    counted_query_tiles,
    entry_tile,
    list_query_tiles,
)
from .softmax import LOG2_E
from .timeline import STEP_SEGMENTS, BwdEvent, SegmentProfile


class BwdBarrier(enum.IntEnum):
    """Named barriers of the backward (0 is sync_threads)."""

    DS_READY = 1  # both consumer warpgroups wrote their half of dS
    DQ_FULL = 2  # DQ_FULL + warpgroup (2, 3): its dQ half is in smem, ready for the bulk reduce-add
    PDS_FREE = 4  # queries on rows: both warpgroups' GEMMs of the last step have read the P and dS buffers
    DQ_EMPTY = 5  # DQ_EMPTY + warpgroup (5, 6), with the dQ writer warp: its reduce-add has read that dQ half


def head_dims_refusal(head_dim: int, head_dim_v: int) -> str | None:
    """Why the backward kernel cannot take q/k head dim `head_dim` with v head dim `head_dim_v`, or None."""
    if (head_dim, head_dim_v) in BACKWARD_HEAD_DIMS:
        return None
    pairs = ", ".join(map(str, BACKWARD_HEAD_DIMS))
    return f"the cute backward takes head dims (q/k, v) of {pairs}, got ({head_dim}, {head_dim_v})"


def _stmatrix_copy(dtype: Type[cutlass.Numeric], transpose: bool, tiled_mma: cute.TiledMma) -> cute.TiledCopy:
    """The stmatrix copy of `tiled_mma`'s accumulator into smem: four 8x8 matrices per instruction,
    or two where its MMA atom's columns are a multiple of 8 but not of 16."""
    columns = tiled_mma.op.shape_mnk[1]
    atom = warp.StMatrix8x8x16bOp(transpose=transpose, num_matrices=4 if columns % 16 == 0 else 2)
    return cute.make_tiled_copy_C(cute.make_copy_atom(atom, dtype), tiled_mma)


def _operand_fragments(thr_mma: cute.ThrMma, a: cute.Tensor, b: cute.Tensor) -> tuple[cute.Tensor, cute.Tensor]:
    """The WGMMA fragments of smem tensors `a` and `b` as `thr_mma`'s A and B operands."""
    return thr_mma.make_fragment_A(thr_mma.partition_A(a)), thr_mma.make_fragment_B(thr_mma.partition_B(b))


def _store_dq_fragment(acc_dQ: cute.Tensor, sdQ_thread: cute.Tensor) -> None:
    """The thread's dQ fragment into its sdQ slots (`dq_slot_layout`), fenced for the bulk
    reduce-add that reads them through the async proxy."""
    cute.autovec_copy(cute.make_tensor(acc_dQ.iterator, cute.make_layout(sdQ_thread.shape)), sdQ_thread)
    cute.arch.fence_view_async_shared()


def _bulk_reduce_add_f32(smem: cute.Pointer, gmem: cute.Pointer, num_bytes: int) -> None:
    """global[0:n] += shared[0:n] (fp32), one bulk asynchronous copy in the current bulk group."""
    llvm.inline_asm(
        None,
        [gmem.llvm_ptr, smem.toint().ir_value(), Int32(num_bytes).ir_value()],
        "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [$0], [$1], $2;",
        "l,r,r",
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )


class FlashMaskBackwardSm90:
    """Compile-time configuration and kernel of the backward pass."""

    num_consumer_wgs = 2
    num_threads = 128 * (num_consumer_wgs + 1)
    dq_pair_threads = 128 + 32  # a consumer warpgroup and the dQ writer warp, on DQ_FULL / DQ_EMPTY

    def __init__(
        self,
        dtype: Type[cutlass.Numeric],
        head_dim: int,
        causal: bool,
        mask_width: int,
        config: BwdConfig,
        deterministic: bool = False,
        head_dim_v: int | None = None,
    ):
        head_dim_v = head_dim if head_dim_v is None else head_dim_v
        refusal = head_dims_refusal(head_dim, head_dim_v)
        if refusal:
            raise ValueError(refusal)
        if config.keys_on_rows != (head_dim <= 128):
            raise ValueError(
                f"keys_on_rows={config.keys_on_rows} is not built for head dim {head_dim}: keys on rows "
                "(dK and dV of 64 keys per warpgroup in registers) at 64 and 128, queries on rows at 192 and 256"
            )
        self.dtype = dtype
        self.head_dim = head_dim
        self.head_dim_v = head_dim_v
        self.causal = causal
        self.mask_width = mask_width
        if config.query_tile == 128 and head_dim != 64:
            raise ValueError(
                f"query_tile=128 is built for head dim 64 (S^T and dP^T of 64 registers each fit beside its "
                f"dK and dV), got head dim {head_dim}"
            )
        self.tile_m = config.query_tile  # query rows per step
        self.tile_n = config.key_tile  # the host's key-block min/max are per tile_n keys
        self.keys_on_rows = config.keys_on_rows
        self.num_stages = config.q_stages  # Q pipeline depth
        self.do_stages = config.do_depth
        # Queries on rows: dK^T and dV^T split between the warpgroups by head dim where both halves
        # are whole 64-row WGMMAs (256), else by keys (192/128).
        self.dkv_split_keys = head_dim % 128 != 0 or head_dim_v % 128 != 0
        # setmaxnreg: the producer warpgroup's registers to the consumers (65536 per SM in all);
        # with queries on rows the mask-role warp spills with 24 (at mask width 4).
        self.producer_regs, self.consumer_regs = (24, 240) if self.keys_on_rows else (32, 232)
        if config.segment_steps and mask_width == 4:  # its per-head setup spills at 24 there
            self.producer_regs, self.consumer_regs = 32, 232
        self.lse_ahead = config.lse_ahead
        self.diagonal_steps = config.diagonal_steps and causal
        self.segment_steps = config.segment_steps
        self.dq_writer = config.dq_writer
        self.counted_steps = config.counted_steps
        # Steps masked by their keys' bounds (PARTIAL): none where counted steps cut only by the diagonal.
        self.partial_steps = not self.counted_steps or (causal and not self.diagonal_steps)
        self.deterministic = deterministic

    @classmethod
    def dq_tiled_mma(cls, dtype: Type[cutlass.Numeric], head_dim: int, tile_m: int) -> cute.TiledMma:
        """dQ = dS K: `tile_m` queries x head dim, the warpgroups each taking half of the head dim,
        or, with a 64-row WGMMA per warpgroup (128 rows), half of the rows (FA4's layout there)."""
        rows_split = tile_m == 64 * cls.num_consumer_wgs
        return sm90.make_trivial_tiled_mma(
            dtype,
            dtype,
            warpgroup.OperandMajorMode.K,
            warpgroup.OperandMajorMode.MN,
            Float32,
            atom_layout_mnk=(cls.num_consumer_wgs, 1, 1) if rows_split else (1, cls.num_consumer_wgs, 1),
            tiler_mn=(64, head_dim) if rows_split else (64, head_dim // cls.num_consumer_wgs),
        )

    @classmethod
    def dq_slot_layout(cls, head_dim: int, tile_m: int) -> cute.Layout:
        """(4, thread in warpgroup, value / 4, warpgroup) -> slot of a dQ tile kept in register-fragment
        order: 4 consecutive floats per thread (one 16-byte store), threads side by side, so smem
        writes are conflict-free and each warpgroup's half is one contiguous block for a 1-D bulk
        reduce-add. The accumulator in global memory keeps this order; the postprocess undoes it."""
        values = tile_m * head_dim // (128 * cls.num_consumer_wgs)
        return cute.make_layout((4, 128, values // 4, cls.num_consumer_wgs), stride=(1, 4, 512, 128 * values))

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # [B, Sq, Hq, D]
        mK: cute.Tensor,  # [B, Sk, Hkv, D]
        mV: cute.Tensor,  # [B, Sk, Hkv, Dv]
        mdO: cute.Tensor,  # [B, Sq, Hq, Dv]
        mLSE: cute.Tensor,  # [B, Hq, Sq_pad] fp32: LSE * log2(e), +inf for rows that see nothing
        mDelta: cute.Tensor,  # [B, Hq, Sq_pad] fp32: rowsum(dO * O)
        mdQaccum: cute.Tensor,  # [B, Hq, Tm, tile_m * D] fp32, zeroed: dQ tiles in `dq_slot_layout` order
        mdK: cute.Tensor,  # [B, Sk, Hkv, D]
        mdV: cute.Tensor,  # [B, Sk, Hkv, Dv]
        mRowIndices: cute.Tensor,  # [Bm, Hm, Sk, 1|2|4] int32: the mask's startend_row_indices
        mBlockBounds: cute.Tensor,  # [Bm, Hm, Tn, 2 * width] int32: per key tile, min then max of each column
        mDqRanks: cute.Tensor,  # [Bm, Hm, Tn, Tm] int32, deterministic mode: the key tile's place in dQ's sum
        mSemaphore: cute.Tensor,  # [B, Hq, Tm] int32, zeroed (used in deterministic mode)
        mCtaOrder: cute.Tensor | None,  # [Tn * Hkv * B] int32 in short grids: the CTAs in launch order
        mStepRows: cute.Tensor | None,  # [B, Hq, Tm, 2] int32 with segment_steps (the virtual rows' query
        # tiles: each one's real first row and real row count), else None
        mTimeline: cute.Tensor | None,  # [CTAs, len(BwdEvent)] int64 in a profiled build, else None
        mWork: cute.Tensor | None,  # [launched CTAs, 4] int32 with split CTAs (`tile_plan.backward_split_plan`)
        mSplitPartials: cute.Tensor | None,  # [slots, tile_n * (D + Dv)] fp32 with split CTAs: parts' dK, dV
        mSplitCounters: cute.Tensor | None,  # [slots] int32, zeroed, with split CTAs: the parts done
        softmax_scale: Float32,
        qheads_per_kvhead: Int32,
        qheads_per_maskhead: Int32,
        mask_batch_stride: Int32,
        stream: cuda.CUstream,
    ):
        mQ, mK, mV, mdO = (select_modes(assume_aligned(t), [1, 3, 2, 0]) for t in (mQ, mK, mV, mdO))
        mdK, mdV = (select_modes(assume_aligned(t), [1, 3, 2, 0]) for t in (mdK, mdV))
        mLSE, mDelta = (select_modes(assume_aligned(t), [2, 1, 0]) for t in (mLSE, mDelta))  # (Sq, Hq, B)
        d, dv, tn, wgs = self.head_dim, self.head_dim_v, self.tile_n, self.num_consumer_wgs
        K, MN = warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.MN
        if const_expr(self.keys_on_rows):
            sQ_layout = smem_layout(self.dtype, self.tile_m, d, self.num_stages)
            sdO_layout = sQ_layout
            sK_layout = sV_layout = smem_layout(self.dtype, tn, d)
            sdS_layout = smem_layout(self.dtype, self.tile_m, tn, 2)  # dS, double-buffered
            # S^T, dP^T: keys x queries, the warpgroups split the keys.
            sdp_atoms, sdp_tiler = (wgs, 1, 1), (64, self.tile_m)
            # dV, dK: keys x head dim, A (P^T, dS^T) from registers.
            dkv_a, dkv_atoms, dkv_tiler, dkv_a_source = K, (wgs, 1, 1), (64, d), warpgroup.OperandSource.RMEM
        else:
            # Each tile's swizzle atom divides the slices the warpgroups' MMAs read: Q^T and dO^T
            # by head dim (dK^T, dV^T), K^T by head dim (dQ), P and dS by keys.
            dkv_wgs_on_d = 1 if self.dkv_split_keys else wgs
            sQ_layout = smem_layout(self.dtype, self.tile_m, d, self.num_stages, d // dkv_wgs_on_d)
            sdO_layout = smem_layout(self.dtype, self.tile_m, dv, self.do_stages, dv // dkv_wgs_on_d)
            sK_layout = smem_layout(self.dtype, tn, d, major_size=d // wgs)
            sV_layout = smem_layout(self.dtype, tn, dv)
            pds_major = math.gcd(tn // wgs, tn // (wgs if self.dkv_split_keys else 1))
            sdS_layout = smem_layout(self.dtype, self.tile_m, tn, 2, pds_major)  # [P, dS]
            # S, dP: queries x keys, the warpgroups split the keys.
            sdp_atoms, sdp_tiler = (1, wgs, 1), (64, tn // wgs)
            # dV^T, dK^T: head dim x keys, both operands from smem.
            dkv_a, dkv_a_source = MN, warpgroup.OperandSource.SMEM
            dkv_atoms, dkv_tiler = ((1, wgs, 1), (64, tn // wgs)) if self.dkv_split_keys else ((wgs, 1, 1), (64, tn))
        tiled_mma_sdp = sm90.make_trivial_tiled_mma(
            self.dtype, self.dtype, K, K, Float32, atom_layout_mnk=sdp_atoms, tiler_mn=sdp_tiler
        )
        tiled_mma_dkv = sm90.make_trivial_tiled_mma(
            self.dtype,
            self.dtype,
            dkv_a,
            MN,
            Float32,
            atom_layout_mnk=dkv_atoms,
            tiler_mn=dkv_tiler,
            a_source=dkv_a_source,
        )
        sdQ_layout = self.dq_slot_layout(d, self.tile_m)
        q_tile = cute.select(sQ_layout, mode=[0, 1])
        do_tile = cute.select(sdO_layout, mode=[0, 1])
        tiled_mma_dq = self.dq_tiled_mma(self.dtype, d, self.tile_m)
        load_op = cpasync.CopyBulkTensorTileG2SOp()
        tma_q, tma_mQ = cpasync.make_tiled_tma_atom(load_op, mQ, q_tile, (self.tile_m, d), 1)
        tma_do, tma_mdO = cpasync.make_tiled_tma_atom(load_op, mdO, do_tile, (self.tile_m, dv), 1)
        tma_k, tma_mK = cpasync.make_tiled_tma_atom(load_op, mK, sK_layout, (tn, d))
        tma_v, tma_mV = cpasync.make_tiled_tma_atom(load_op, mV, sV_layout, (tn, dv))
        # LSE and Delta of a query tile ride on Q's and dO's barriers.
        s_row_layout = cute.make_layout((self.tile_m, self.num_stages))
        s_delta_layout = cute.make_layout((self.tile_m, self.do_stages))
        tma_lse, tma_mLSE = cpasync.make_tiled_tma_atom(load_op, mLSE, cute.make_layout(self.tile_m), (self.tile_m,))
        tma_delta, tma_mDelta = cpasync.make_tiled_tma_atom(
            load_op, mDelta, cute.make_layout(self.tile_m), (self.tile_m,)
        )
        q_bytes = cute.size_in_bytes(self.dtype, q_tile) + self.tile_m * 4
        do_bytes = cute.size_in_bytes(self.dtype, do_tile) + self.tile_m * 4
        # dK and dV leave through smem (the K and V buffers, free by then) by TMA stores.
        store_op = cpasync.CopyBulkTensorTileS2GOp()
        tma_dk, tma_mdK = cpasync.make_tiled_tma_atom(store_op, mdK, sK_layout, (tn, d))
        tma_dv, tma_mdV = cpasync.make_tiled_tma_atom(store_op, mdV, sV_layout, (tn, dv))
        kv_bytes = cute.size_in_bytes(self.dtype, sK_layout) + cute.size_in_bytes(self.dtype, sV_layout)

        profiled_slots = len(STEP_SEGMENTS) if const_expr(mTimeline is not None) else 1

        # The 1024-byte aligned tiles first and the small fields after them, so no padding sits
        # between tiles: with three Q/dO stages at head dim 128 the tiles take 224 of the 227 KB,
        # and everything 232,432 bytes in the profiled build with the dQ writer (16 to spare).
        @cute.struct
        class SharedStorage:
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sV_layout)], 1024]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sdO: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sdO_layout)], 1024]
            sdS: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sdS_layout)], 1024]
            sdQ: cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(sdQ_layout)], 1024]
            mbar_kv: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_q: cute.struct.MemRange[cutlass.Int64, self.num_stages * 2]
            mbar_do: cute.struct.MemRange[cutlass.Int64, self.do_stages * 2]
            mbar_tiles: cute.struct.MemRange[cutlass.Int64, TileList.slots * 2]
            tile_ring: cute.struct.MemRange[Int32, TileList.slots]
            stage_entries: cute.struct.MemRange[Int32, self.num_stages]  # the list entry each Q stage holds
            sLSE: cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(s_row_layout)], 128]
            sDelta: cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(s_delta_layout)], 128]
            # The profiled build's cycle accumulators (one unused slot in the default build).
            step_cycles: cute.struct.MemRange[cutlass.Int64, profiled_slots]
            # With the dQ writer, per warpgroup the (query tile, head, batch, rank) of its dQ half in sdQ.
            dq_targets: cute.struct.MemRange[Int32, 4 * wgs if self.dq_writer else 1]

        check_smem_fits(
            SharedStorage.size_in_bytes(),
            f"the backward at head dim {d} with key_tile={tn}, q_stages={self.num_stages}, do_stages={self.do_stages}",
        )
        seqlen_k = mRowIndices.shape[2] if const_expr(self.segment_steps) else mK.shape[0]  # the virtual rows'
        grid = (cute.ceil_div(cute.size(seqlen_k), self.tile_n), cute.size(mK.shape[2]), cute.size(mK.shape[3]))
        if const_expr(mCtaOrder is not None):
            grid = (cute.size(mCtaOrder.shape[0]), 1, 1)
        if const_expr(mWork is not None):
            grid = (cute.size(mWork.shape[0]), 1, 1)
        self.kernel(
            tma_mQ,
            tma_mK,
            tma_mV,
            tma_mdO,
            tma_mLSE,
            tma_mDelta,
            mdQaccum,
            tma_mdK,
            tma_mdV,
            mdK if const_expr(self.segment_steps) else None,
            mdV if const_expr(self.segment_steps) else None,
            mRowIndices,
            mBlockBounds,
            mDqRanks,
            mSemaphore,
            mCtaOrder,
            mStepRows,
            mTimeline,
            mWork,
            mSplitPartials,
            mSplitCounters,
            tma_q,
            tma_k,
            tma_v,
            tma_do,
            tma_lse,
            tma_delta,
            tma_dk,
            tma_dv,
            q_bytes,
            do_bytes,
            kv_bytes,
            Float32(softmax_scale * LOG2_E),
            softmax_scale,
            qheads_per_kvhead,
            qheads_per_maskhead,
            mask_batch_stride,
            sQ_layout,
            sdO_layout,
            sK_layout,
            sV_layout,
            sdS_layout,
            sdQ_layout,
            s_row_layout,
            s_delta_layout,
            tiled_mma_sdp,
            tiled_mma_dkv,
            tiled_mma_dq,
            SharedStorage,
        ).launch(grid=grid, block=[self.num_threads, 1, 1], stream=stream, min_blocks_per_mp=1)

    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mdO: cute.Tensor,
        mLSE: cute.Tensor,
        mDelta: cute.Tensor,
        mdQaccum: cute.Tensor,
        mdK: cute.Tensor,
        mdV: cute.Tensor,
        mdK_rows: cute.Tensor | None,
        mdV_rows: cute.Tensor | None,
        mRowIndices: cute.Tensor,
        mBlockBounds: cute.Tensor,
        mDqRanks: cute.Tensor,
        mSemaphore: cute.Tensor,
        mCtaOrder: cute.Tensor | None,
        mStepRows: cute.Tensor | None,
        mTimeline: cute.Tensor | None,
        mWork: cute.Tensor | None,
        mSplitPartials: cute.Tensor | None,
        mSplitCounters: cute.Tensor | None,
        tma_q: cute.CopyAtom,
        tma_k: cute.CopyAtom,
        tma_v: cute.CopyAtom,
        tma_do: cute.CopyAtom,
        tma_lse: cute.CopyAtom,
        tma_delta: cute.CopyAtom,
        tma_dk: cute.CopyAtom,
        tma_dv: cute.CopyAtom,
        q_bytes: cutlass.Constexpr[int],
        do_bytes: cutlass.Constexpr[int],
        kv_bytes: cutlass.Constexpr[int],
        scale_log2: Float32,
        softmax_scale: Float32,
        qheads_per_kvhead: Int32,
        qheads_per_maskhead: Int32,
        mask_batch_stride: Int32,
        sQ_layout: cute.ComposedLayout,
        sdO_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout,
        sdS_layout: cute.ComposedLayout,
        sdQ_layout: cute.Layout,
        s_row_layout: cute.Layout,
        s_delta_layout: cute.Layout,
        tiled_mma_sdp: cute.TiledMma,
        tiled_mma_dkv: cute.TiledMma,
        tiled_mma_dq: cute.TiledMma,
        SharedStorage: cutlass.Constexpr,
    ):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        n_block, head_kv, batch = cute.arch.block_idx()
        # With split CTAs: whether the launched row holds a part at all (rows past the used ones are
        # idle); the mask-role warp reads the part's query tiles itself, where they are used.
        active = True
        if const_expr(mCtaOrder is not None or mWork is not None):  # a 1-D grid
            tiles_n = cute.ceil_div(self.rows(mK, mStepRows), self.tile_n)
            if const_expr(mWork is not None):  # the parts in grid order
                work = mWork[n_block, 0]
                active = work >= 0
            else:  # the CTAs with the most steps first
                work = mCtaOrder[n_block]
            n_block, head_kv, batch = work % tiles_n, (work // tiles_n) % mK.shape[2], work // tiles_n // mK.shape[2]
        if warp_idx == 0:
            for atom in (tma_q, tma_k, tma_v, tma_do, tma_lse, tma_delta, tma_dk, tma_dv):
                cpasync.prefetch_descriptor(atom)

        storage = SmemAllocator().allocate(SharedStorage)
        consumer_warps = pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_consumer_wgs * 4)
        pipe_kv = tma_pipeline(storage.mbar_kv, 1, kv_bytes, consumer_warps)
        pipe_q = tma_pipeline(storage.mbar_q, self.num_stages, q_bytes, consumer_warps)
        pipe_do = tma_pipeline(storage.mbar_do, self.do_stages, do_bytes, consumer_warps)
        tile_list = TileList(
            storage.tile_ring.get_tensor(cute.make_layout(TileList.slots)), storage.mbar_tiles.data_ptr()
        )
        tile_list.init(1, warp_idx, self.num_threads // 32)  # read by the producer; the consumers get it with Q
        stage_entries = storage.stage_entries.get_tensor(cute.make_layout(self.num_stages))
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sdO = storage.sdO.get_tensor(sdO_layout.outer, swizzle=sdO_layout.inner)
        sdS = storage.sdS.get_tensor(sdS_layout.outer, swizzle=sdS_layout.inner)
        sdQ = storage.sdQ.get_tensor(sdQ_layout)
        sLSE = storage.sLSE.get_tensor(s_row_layout)
        sDelta = storage.sDelta.get_tensor(s_delta_layout)
        dq_targets = None
        if const_expr(self.dq_writer):
            dq_targets = storage.dq_targets.get_tensor(cute.make_layout((4, self.num_consumer_wgs)))
        mask_batch = batch * mask_batch_stride
        steps = None
        if const_expr(self.counted_steps):
            rows_q, rows_k = self.rows(mQ, mStepRows), self.rows(mK, mStepRows)
            steps = counted_query_tiles(
                n_block * self.tile_n, rows_q, rows_k, self.tile_m, self.tile_n, self.causal, self.part_range(mWork)
            )

        if active:  # an idle row (split CTAs) only initialises its barriers
            if warp_idx < 4:
                cute.arch.setmaxregister_decrease(self.producer_regs)
                if warp_idx == 0:
                    self.load(
                        mQ,
                        mK,
                        mV,
                        mdO,
                        mLSE,
                        mDelta,
                        sQ,
                        sK,
                        sV,
                        sdO,
                        sLSE,
                        sDelta,
                        tma_q,
                        tma_k,
                        tma_v,
                        tma_do,
                        tma_lse,
                        tma_delta,
                        pipe_kv,
                        pipe_q,
                        pipe_do,
                        n_block,
                        head_kv,
                        batch,
                        tile_list,
                        stage_entries,
                        steps,
                        qheads_per_kvhead,
                        mStepRows,
                    )
                if const_expr(not self.counted_steps):  # the list of each head's query tiles
                    if warp_idx == 1:
                        position = Int32(0)
                        for g in cutlass.range(qheads_per_kvhead, unroll=1):
                            tile_range = self.part_range(mWork)
                            mask_head = (head_kv * qheads_per_kvhead + g) // qheads_per_maskhead
                            position = list_query_tiles(
                                tile_list,
                                position,
                                mBlockBounds[mask_batch, mask_head, n_block, None],
                                n_block * self.tile_n,
                                self.rows(mQ, mStepRows),
                                self.rows(mK, mStepRows),
                                self.rows(mK, mStepRows) - self.rows(mQ, mStepRows),
                                self.tile_m,
                                self.tile_n,
                                self.causal,
                                self.mask_width,
                                self.diagonal_steps,
                                tile_range,
                            )
                if const_expr(self.dq_writer):
                    if warp_idx == 2:
                        self.write_dq(sdQ, dq_targets, mdQaccum, mSemaphore)
            else:
                cute.arch.setmaxregister_increase(self.consumer_regs)
                cycles = None
                if const_expr(mTimeline is not None):
                    cycles = storage.step_cycles.get_tensor(cute.make_layout(len(STEP_SEGMENTS)))
                self.consume(
                    sLSE,
                    sDelta,
                    mdQaccum,
                    mdK,
                    mdV,
                    (mdK_rows, mdV_rows, mStepRows),
                    mRowIndices,
                    stage_entries,
                    steps,
                    mDqRanks,
                    mSemaphore,
                    sQ,
                    sK,
                    sV,
                    sdO,
                    sdS,
                    sdQ,
                    dq_targets,
                    tma_dk,
                    tma_dv,
                    tiled_mma_sdp,
                    tiled_mma_dkv,
                    tiled_mma_dq,
                    pipe_kv,
                    pipe_q,
                    pipe_do,
                    tidx - 128,
                    scale_log2,
                    softmax_scale,
                    n_block,
                    head_kv,
                    batch,
                    mask_batch,
                    qheads_per_kvhead,
                    qheads_per_maskhead,
                    self.rows(mQ, mStepRows),
                    self.rows(mK, mStepRows),
                    SegmentProfile(mTimeline, cycles, tidx == 128, BwdEvent.WAIT_Q, len(STEP_SEGMENTS)),
                    None if const_expr(mWork is None) else (mWork, mSplitPartials, mSplitCounters),
                )

    @cute.jit
    def load(
        self,
        mQ,
        mK,
        mV,
        mdO,
        mLSE,
        mDelta,
        sQ,
        sK,
        sV,
        sdO,
        sLSE,
        sDelta,
        tma_q,
        tma_k,
        tma_v,
        tma_do,
        tma_lse,
        tma_delta,
        pipe_kv,
        pipe_q,
        pipe_do,
        n_block,
        head_kv,
        batch,
        tile_list,
        stage_entries,
        steps,
        qheads_per_kvhead,
        mStepRows,
    ):
        """Producer warp: K and V once, then Q (+ LSE) and dO (+ Delta) of every listed query tile of
        every query head (`steps`: with counted_steps, `counted_query_tiles`' count, else None).
        With segment_steps each tile is loaded from its real first row (`mStepRows`; the query
        heads of a KV head share one mask head, so the key tile's rows are those of the first one's
        two query tiles it spans)."""
        if const_expr(self.segment_steps):
            first = mStepRows[batch, head_kv * qheads_per_kvhead, n_block * (self.tile_n // self.tile_m), 0]
            mK_tile = cute.domain_offset((first, 0), mK[None, None, head_kv, batch])
            mV_tile = cute.domain_offset((first, 0), mV[None, None, head_kv, batch])
            gK = cute.local_tile(mK_tile, (self.tile_n, self.head_dim), (0, 0))
            gV = cute.local_tile(mV_tile, (self.tile_n, self.head_dim_v), (0, 0))
        else:
            gK = cute.local_tile(mK[None, None, head_kv, batch], (self.tile_n, self.head_dim), (n_block, 0))
            gV = cute.local_tile(mV[None, None, head_kv, batch], (self.tile_n, self.head_dim_v), (n_block, 0))
        tKsK, tKgK = tma_tiles(tma_k, sK, gK)
        tVsV, tVgV = tma_tiles(tma_v, sV, gV)
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        pipe_kv.producer_acquire(kv_state)
        cute.copy(tma_k, tKgK, tKsK, tma_bar_ptr=pipe_kv.producer_get_barrier(kv_state))
        cute.copy(tma_v, tVgV, tVsV, tma_bar_ptr=pipe_kv.producer_get_barrier(kv_state))

        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
        position = Int32(0)
        for g in cutlass.range(qheads_per_kvhead, unroll=1):
            head = head_kv * qheads_per_kvhead + g
            gQ = cute.local_tile(mQ[None, None, head, batch], (self.tile_m, self.head_dim), (None, 0))
            gdO = cute.local_tile(mdO[None, None, head, batch], (self.tile_m, self.head_dim_v), (None, 0))
            tQsQ, tQgQ = tma_tiles(tma_q, sQ, gQ)
            tdOsdO, tdOgdO = tma_tiles(tma_do, sdO, gdO)
            gLSE = cute.local_tile(mLSE[None, head, batch], (self.tile_m,), (None,))
            gDelta = cute.local_tile(mDelta[None, head, batch], (self.tile_m,), (None,))
            tLsL, tLgL = tma_tiles(tma_lse, sLSE, gLSE, 1)
            tDsD, tDgD = tma_tiles(tma_delta, sDelta, gDelta, 1)
            if const_expr(self.counted_steps):
                position = steps[0]
            entry = self.step_entry(tile_list, position, steps)
            position += 1
            while entry != END_OF_LIST:
                m_block = entry_tile(entry)
                pipe_q.sync_object_empty.wait(state.index, state.phase)
                if const_expr(not self.counted_steps):
                    stage_entries[state.index] = entry  # before the arrive that publishes it with the stage
                pipe_q.sync_object_full.arrive(state.index, pipe_q.producer_mask)
                q_bar = pipe_q.producer_get_barrier(state)
                q_tile, do_tile = tQgQ[None, m_block], tdOgdO[None, m_block]
                if const_expr(self.segment_steps):  # from the query tile's real first row
                    first = mStepRows[batch, head, m_block, 0]
                    gQ_real = cute.local_tile(
                        cute.domain_offset((first, 0), mQ[None, None, head, batch]),
                        (self.tile_m, self.head_dim),
                        (None, 0),
                    )
                    gdO_real = cute.local_tile(
                        cute.domain_offset((first, 0), mdO[None, None, head, batch]),
                        (self.tile_m, self.head_dim_v),
                        (None, 0),
                    )
                    q_tile, do_tile = (
                        tma_tiles(tma_q, sQ, gQ_real)[1][None, 0],
                        tma_tiles(tma_do, sdO, gdO_real)[1][None, 0],
                    )
                cute.copy(tma_q, q_tile, tQsQ[None, state.index], tma_bar_ptr=q_bar)
                cute.copy(tma_lse, tLgL[None, m_block], tLsL[None, state.index], tma_bar_ptr=q_bar)
                do_state = self.do_state(state, producer=True)
                pipe_do.producer_acquire(do_state)
                do_bar = pipe_do.producer_get_barrier(do_state)
                cute.copy(tma_do, do_tile, tdOsdO[None, do_state.index], tma_bar_ptr=do_bar)
                cute.copy(tma_delta, tDgD[None, m_block], tDsD[None, do_state.index], tma_bar_ptr=do_bar)
                state.advance()
                entry = self.step_entry(tile_list, position, steps)
                position += 1
            if const_expr(not self.counted_steps):  # the consumers count theirs
                # The head's end as a stage of its own: no bytes, the full barriers only arrived on.
                pipe_q.sync_object_empty.wait(state.index, state.phase)
                stage_entries[state.index] = entry
                do_state = self.do_state(state, producer=True)
                pipe_do.sync_object_empty.wait(do_state.index, do_state.phase)
                with cute.arch.elect_one():
                    cute.arch.mbarrier_arrive(pipe_q.producer_get_barrier(state))
                    cute.arch.mbarrier_arrive(pipe_do.producer_get_barrier(do_state))
                state.advance()

    @cute.jit
    def consume(
        self,
        sLSE,
        sDelta,
        mdQaccum,
        mdK,
        mdV,
        segments,
        mRowIndices,
        stage_entries,
        steps,
        mDqRanks,
        mSemaphore,
        sQ,
        sK,
        sV,
        sdO,
        sdS,
        sdQ,
        dq_targets,
        tma_dk,
        tma_dv,
        tiled_mma_sdp,
        tiled_mma_dkv,
        tiled_mma_dq,
        pipe_kv,
        pipe_q,
        pipe_do,
        tidx,
        scale_log2,
        softmax_scale,
        n_block,
        head_kv,
        batch,
        mask_batch,
        qheads_per_kvhead,
        qheads_per_maskhead,
        seqlen_q,
        seqlen_k,
        profile,
        split_part,
    ):
        """Consumer warpgroups: per query tile S^T, dP^T, P^T, dS^T (or, queries on rows, S, dP,
        P, dS), the dV/dK/dQ products. `profile`: the profiled build's `SegmentProfile` (compiles to
        nothing otherwise). `segments`: with segment_steps, dK and dV themselves and the query
        tiles' real rows (`store_dkv`); the steps work on the virtual rows. `split_part`: with split
        CTAs, (work table, partials, counters) for `gather_split_parts`, else None. `steps`: with
        counted_steps, `counted_query_tiles`' count, else None."""
        wg = cute.arch.make_warp_uniform(tidx // 128)
        thr_sdp = tiled_mma_sdp.get_slice(tidx)
        wg_sdp = tiled_mma_sdp.get_slice(wg * 128)
        wg_dkv = tiled_mma_dkv.get_slice(wg * 128)
        wg_dq = tiled_mma_dq.get_slice(wg * 128)
        tn, wgs = self.tile_n, self.num_consumer_wgs
        if const_expr(self.keys_on_rows):
            tSrK, tSrQ = _operand_fragments(wg_sdp, sK, sQ)
            tdPrV, tdPrdO = _operand_fragments(wg_sdp, sV, sdO)
            tdVrdOt = wg_dkv.make_fragment_B(wg_dkv.partition_B(transpose_view(sdO)))
            tdKrQt = wg_dkv.make_fragment_B(wg_dkv.partition_B(transpose_view(sQ)))
            # dS^T from registers into sdS (where dQ's A operand reads dS), by transposing stmatrix.
            ds_copy = _stmatrix_copy(self.dtype, True, tiled_mma_sdp)
            thr_ds_copy = ds_copy.get_slice(tidx)
            tdSsdS = thr_ds_copy.partition_D(transpose_view(sdS))
            st_tile = (tn, self.tile_m)
            acc_dK = cute.make_rmem_tensor(wg_dkv.partition_shape_C((tn, self.head_dim)), Float32)
            acc_dV = cute.make_rmem_tensor_like(acc_dK, Float32)
        else:
            tSrQ, tSrK = _operand_fragments(wg_sdp, sQ, sK)
            tdPrdO, tdPrV = _operand_fragments(wg_sdp, sdO, sV)
            # [..., 0]: P, 1: dS, the B operand of dV^T and dK^T
            tdVrdOt, tdKVrPdS = _operand_fragments(wg_dkv, transpose_view(sdO), transpose_view(sdS))
            tdKrQt = wg_dkv.make_fragment_A(wg_dkv.partition_A(transpose_view(sQ)))
            # P and dS from registers into their buffers, by stmatrix.
            ds_copy = _stmatrix_copy(self.dtype, False, tiled_mma_sdp)
            thr_ds_copy = ds_copy.get_slice(tidx)
            tdSsdS = thr_ds_copy.partition_D(sdS)
            st_tile = (self.tile_m, tn)
            acc_dK = cute.make_rmem_tensor(wg_dkv.partition_shape_C((self.head_dim, tn)), Float32)
            acc_dV = cute.make_rmem_tensor(wg_dkv.partition_shape_C((self.head_dim_v, tn)), Float32)
        tdQrdS = wg_dq.make_fragment_A(wg_dq.partition_A(sdS))
        tdQrKt = wg_dq.make_fragment_B(wg_dq.partition_B(transpose_view(sK)))
        st_shape = wg_sdp.partition_shape_C(st_tile)
        st_coords = thr_sdp.partition_C(cute.make_identity_tensor(st_tile))
        lane_in_wg = tidx % 128
        sdQ_thread = sdQ[None, lane_in_wg, None, wg]  # (4, values / 4): the thread's 16-byte slots
        acc_dK.fill(0.0)
        acc_dV.fill(0.0)
        key_start = n_block * tn
        causal_offset = seqlen_k - seqlen_q
        st_cols = acc_rows_view(st_coords)
        # The thread's queries: its fragment's columns with keys on rows, else its rows (LSE and
        # Delta are per query).
        query_mode = 1 if const_expr(self.keys_on_rows) else 0
        queries = cute.size(st_cols, mode=[query_mode])

        cta = n_block + cute.ceil_div(seqlen_k, tn) * (head_kv + mdK.shape[2] * batch)  # its place in the grid
        profile.stamp(cta, BwdEvent.START)
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        pipe_kv.consumer_wait(kv_state)
        profile.stamp(cta, BwdEvent.KV_LANDED)
        clock = profile.start()
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
        step = Int32(0)
        tile = Int32(0)  # with counted_steps, the next query tile
        for g in cutlass.range(qheads_per_kvhead, unroll=1):
            head = head_kv * qheads_per_kvhead + g
            mask_head = head // qheads_per_maskhead
            if const_expr(self.counted_steps):
                tile = steps[0]
            entry = self.next_entry(pipe_q, state, stage_entries, tile, steps)
            while entry != END_OF_LIST:
                m_block = entry_tile(entry)
                query_start = m_block * self.tile_m
                do_state = self.do_state(state, producer=False)
                acc_S = cute.make_rmem_tensor(st_shape, Float32)
                acc_dP = cute.make_rmem_tensor(st_shape, Float32)
                if const_expr(self.lse_ahead):
                    lse = cute.make_rmem_tensor(queries, Float32)
                    for i in cutlass.range_constexpr(queries):
                        lse[i] = sLSE[self.query_in_tile(st_cols, i), state.index]
                clock = profile.mark(clock, BwdEvent.WAIT_Q)
                if const_expr(self.keys_on_rows):
                    wgmma(tiled_mma_sdp, acc_S, tSrK, tSrQ[None, None, None, state.index], zero_init=True)
                    pipe_do.consumer_wait(do_state)
                    wgmma(tiled_mma_sdp, acc_dP, tdPrV, tdPrdO[None, None, None, do_state.index], zero_init=True)
                else:
                    wgmma(tiled_mma_sdp, acc_S, tSrQ[None, None, None, state.index], tSrK, zero_init=True)
                    pipe_do.consumer_wait(do_state)
                    wgmma(tiled_mma_sdp, acc_dP, tdPrdO[None, None, None, do_state.index], tdPrV, zero_init=True)
                warpgroup.wait_group(1)
                clock = profile.mark(clock, BwdEvent.WAIT_S)
                if const_expr(self.diagonal_steps):
                    if (entry & DIAGONAL_ONLY) != 0:
                        apply_causal_diagonal(
                            acc_S, st_coords, query_start, key_start, causal_offset, keys_on_rows=self.keys_on_rows
                        )
                if const_expr(self.partial_steps):
                    if (entry & PARTIAL) != 0:
                        apply_column_mask(
                            acc_S,
                            st_coords,
                            mRowIndices,
                            mask_batch,
                            mask_head,
                            query_start,
                            key_start,
                            seqlen_k,
                            causal_offset,
                            self.causal,
                            self.mask_width,
                            keys_on_rows=self.keys_on_rows,
                        )
                p_rows = acc_rows_view(acc_S)
                for r in cutlass.range_constexpr(cute.size(p_rows, mode=[0])):
                    for c in cutlass.range_constexpr(cute.size(p_rows, mode=[1])):
                        i = c if const_expr(self.keys_on_rows) else r
                        lse_i = lse[i] if self.lse_ahead else sLSE[self.query_in_tile(st_cols, i), state.index]
                        p_rows[r, c] = cute.math.exp2(p_rows[r, c] * scale_log2 - lse_i, fastmath=True)
                rP = cute.make_rmem_tensor(st_shape, self.dtype)
                if const_expr(self.keys_on_rows):
                    rP.store(acc_S.load().to(self.dtype))
                    dv_gemm = (acc_dV, acc_as_operand_a(rP), tdVrdOt[None, None, None, do_state.index])  # dV += P^T dO
                else:
                    convert_to_16bit(acc_S, rP)
                    dv_gemm = (acc_dV, tdVrdOt[None, None, None, do_state.index], tdKVrPdS[None, None, None, 0])
                    # P to its buffer while the dP GEMM runs (one P and one dS buffer: the barrier
                    # proves both warpgroups' GEMMs of the last step have read them).
                    cute.arch.barrier(barrier_id=int(BwdBarrier.PDS_FREE), number_of_threads=128 * wgs)
                    cute.copy(ds_copy, thr_ds_copy.retile(rP), tdSsdS[None, None, None, 0])
                clock = profile.mark(clock, BwdEvent.SOFTMAX)
                warpgroup.wait_group(0)
                clock = profile.mark(clock, BwdEvent.WAIT_DP)
                ds_rows = acc_rows_view(acc_dP)
                for r in cutlass.range_constexpr(cute.size(ds_rows, mode=[0])):
                    for c in cutlass.range_constexpr(cute.size(ds_rows, mode=[1])):
                        i = c if const_expr(self.keys_on_rows) else r
                        delta = sDelta[self.query_in_tile(st_cols, i), do_state.index]
                        ds_rows[r, c] = p_rows[r, c] * (ds_rows[r, c] - delta)
                rdS = cute.make_rmem_tensor(st_shape, self.dtype)
                convert_to_16bit(acc_dP, rdS)  # once: the stmatrix and the dK GEMM read the same registers
                if const_expr(self.keys_on_rows):
                    dk_gemm = (acc_dK, acc_as_operand_a(rdS), tdKrQt[None, None, None, state.index])  # dK += dS^T Q
                    # dS to smem (double-buffered: the barrier of this step also proves both
                    # warpgroups finished reading the other buffer in the previous step).
                    ds_slot = step % 2
                    cute.copy(ds_copy, thr_ds_copy.retile(rdS), tdSsdS[None, None, None, ds_slot])
                    # The peers' order: dV issued after dS is in smem, dQ before dK, and the dQ add
                    # while dK runs (dO released once dV is done, Q once dK is).
                    wgmma(tiled_mma_dkv, *dv_gemm, zero_init=False)
                else:
                    dk_gemm = (acc_dK, tdKrQt[None, None, None, state.index], tdKVrPdS[None, None, None, 1])
                    cute.copy(ds_copy, thr_ds_copy.retile(rdS), tdSsdS[None, None, None, 1])
                    ds_slot = 1
                cute.arch.fence_view_async_shared()
                clock = profile.mark(clock, BwdEvent.DS)
                if const_expr(not self.dq_writer):
                    if lane_in_wg == 0:  # sdQ is free again once the previous dQ reduce-add has read it
                        cute.arch.cp_async_bulk_wait_group(0, read=True)
                cute.arch.barrier(barrier_id=int(BwdBarrier.DS_READY), number_of_threads=128 * wgs)
                clock = profile.mark(clock, BwdEvent.DS_BARRIER)
                if const_expr(not self.keys_on_rows):
                    wgmma(tiled_mma_dkv, *dv_gemm, zero_init=False)  # dV^T += dO^T P, P of both warpgroups
                acc_dQ = cute.make_rmem_tensor(wg_dq.partition_shape_C((self.tile_m, self.head_dim)), Float32)
                wgmma(tiled_mma_dq, acc_dQ, tdQrdS[None, None, None, ds_slot], tdQrKt, zero_init=True)
                rank = Int32(0)
                if const_expr(self.deterministic):
                    rank = mDqRanks[mask_batch, mask_head, n_block, m_block]
                dq_target = (m_block, head, batch, rank)
                wgmma(tiled_mma_dkv, *dk_gemm, zero_init=False)
                warpgroup.wait_group(1)  # dV and dQ done, dK may still run
                pipe_do.consumer_release(do_state)
                clock = profile.mark(clock, BwdEvent.WAIT_DQ)
                if const_expr(self.dq_writer):
                    self.hand_dq_to_writer(acc_dQ, sdQ_thread, dq_targets, dq_target, lane_in_wg, wg)
                else:
                    self.add_dq(acc_dQ, sdQ_thread, sdQ, mdQaccum, mSemaphore, *dq_target, lane_in_wg, wg)
                clock = profile.mark(clock, BwdEvent.ADD_DQ)
                warpgroup.wait_group(0)
                pipe_q.consumer_release(state)
                clock = profile.mark(clock, BwdEvent.WAIT_DK)
                state.advance()
                step += 1
                tile += 1
                entry = self.next_entry(pipe_q, state, stage_entries, tile, steps)
                clock = profile.mark(clock, BwdEvent.NEXT_ENTRY)
            if const_expr(not self.counted_steps):
                pipe_q.consumer_release(state)  # the stage that carried the head's end
                pipe_do.consumer_release(self.do_state(state, producer=False))
                state.advance()

        profile.stamp(cta, BwdEvent.LOOP_END)
        profile.stamp(cta, BwdEvent.STEPS, step)
        profile.write_cycles(cta)
        if const_expr(self.dq_writer):  # tell the writer there is no more, once it is free
            self.hand_dq_to_writer(None, sdQ_thread, dq_targets, (Int32(-1), head_kv, batch, Int32(0)), lane_in_wg, wg)
        elif lane_in_wg == 0:  # the last dQ reduce-add must have read sdQ before the CTA exits
            cute.arch.cp_async_bulk_wait_group(0, read=True)
        stores = True
        if const_expr(split_part is not None):
            stores = self.gather_split_parts(acc_dK, acc_dV, *split_part, stage_entries, tidx)
        if stores:
            self.store_dkv(
                acc_dK,
                acc_dV,
                tiled_mma_dkv,
                sK,
                sV,
                tma_dk,
                tma_dv,
                mdK,
                mdV,
                segments,
                softmax_scale,
                n_block,
                head_kv,
                batch,
                qheads_per_kvhead,
                tidx,
            )
        profile.stamp(cta, BwdEvent.STORED)

    def rows(self, mQK: cute.Tensor, mStepRows: cute.Tensor | None):
        """The rows the steps walk: Q's or K's, or with segment_steps the virtual rows (from the step
        table's shape: from the mask's, the mask role's per-head setup spilled at 24 registers)."""
        return mStepRows.shape[2] * self.tile_m if const_expr(self.segment_steps) else mQK.shape[0]

    def do_state(self, q_state: pipeline.PipelineState, producer: bool) -> pipeline.PipelineState:
        """The dO pipeline's state where the Q pipeline's is `q_state`: the two advance together
        (one query tile, or a head's end, per stage), so with fewer dO stages its index and phase
        follow from Q's count (a producer's phase starts at 1)."""
        if self.do_stages == self.num_stages:
            return q_state
        count = q_state.count
        phase = (count // self.do_stages) % 2
        return pipeline.PipelineState(self.do_stages, count, count % self.do_stages, phase ^ 1 if producer else phase)

    def query_in_tile(self, st_cols: cute.Tensor, i: int):
        """The query (row of the query tile) of the thread's i-th query: column i of its fragment
        with keys on rows, else row i."""
        return st_cols[0, i][1] if self.keys_on_rows else st_cols[i, 0][0]

    def part_range(self, mWork: cute.Tensor | None) -> tuple[Int32, Int32] | None:
        """With split CTAs, the query tiles [first, end) of this CTA's part, else None."""
        if mWork is None:
            return None
        row = cute.arch.block_idx()[0]
        return mWork[row, 1], mWork[row, 2]

    @cute.jit
    def next_entry(self, pipe_q, state, stage_entries, tile, steps) -> Int32:
        """A consumer's next list entry, from the Q stage it came with, once the stage is full; with
        counted_steps query tile `tile`'s (`counted_entry`), its stage waited for where there is one."""
        if const_expr(self.counted_steps):
            entry = self.counted_entry(tile, steps)
            if entry != END_OF_LIST:
                pipe_q.consumer_wait(state)
            return entry
        else:
            pipe_q.consumer_wait(state)
            return stage_entries[state.index]

    @cute.jit
    def step_entry(self, tile_list, position, steps) -> Int32:
        """The producer's list entry at `position`: the mask warp's, or with counted_steps query tile
        `position`'s (`counted_entry`)."""
        if const_expr(self.counted_steps):
            return self.counted_entry(position, steps)
        else:
            return tile_list.read(position)

    @cute.jit
    def counted_entry(self, tile, steps) -> Int32:
        """With counted_steps: query tile `tile`'s entry as the mask warp lists it on a plain call
        (DIAGONAL_ONLY where the causal diagonal cuts it, PARTIAL without diagonal_steps, else
        unmasked), END_OF_LIST past the CTA's last (`steps`: `counted_query_tiles`' count)."""
        _, end, cut_end = steps
        entry = tile << FLAG_BITS
        if const_expr(self.causal):
            if tile < cut_end:
                entry = entry | (DIAGONAL_ONLY if self.diagonal_steps else PARTIAL)
        if tile >= end:
            entry = Int32(END_OF_LIST)
        return entry

    @cute.jit
    def add_dq(self, acc_dQ, sdQ_thread, sdQ, mdQaccum, mSemaphore, m_block, head, batch, rank, lane_in_wg, wg):
        """Add this key tile's dQ contribution into the fp32 accumulator: registers to smem, then
        one bulk reduce-add per warpgroup (its half of the tile, contiguous in fragment order).

        Deterministic mode: a warpgroup waits until both warpgroups of every key tile before this
        one (in key order) have added into this query tile, adds, waits for the add to land, then
        counts itself done.
        """
        _store_dq_fragment(acc_dQ, sdQ_thread)
        cute.arch.barrier(barrier_id=int(BwdBarrier.DQ_FULL) + wg, number_of_threads=128)
        if lane_in_wg == 0:
            self.reduce_dq_half(sdQ, mdQaccum, mSemaphore, m_block, head, batch, rank, wg)

    @cute.jit
    def reduce_dq_half(self, sdQ, mdQaccum, mSemaphore, m_block, head, batch, rank, wg):
        """One thread: the bulk reduce-add of warpgroup `wg`'s half of the dQ tile in smem (in key
        order behind the semaphore in deterministic mode)."""
        chunk = cute.cosize(sdQ.layout) // self.num_consumer_wgs
        if const_expr(self.deterministic):
            lock = mSemaphore.iterator + cute.crd2idx((batch, head, m_block), mSemaphore.layout)
            while cute.arch.load(lock, Int32, sem="acquire", scope="gpu") < rank * self.num_consumer_wgs:
                pass
        target = mdQaccum.iterator + cute.crd2idx((batch, head, m_block, wg * chunk), mdQaccum.layout)
        _bulk_reduce_add_f32(sdQ.iterator + wg * chunk, target, chunk * 4)
        cute.arch.cp_async_bulk_commit_group()
        if const_expr(self.deterministic):
            cute.arch.cp_async_bulk_wait_group(0)
            cute.arch.fence_acq_rel_gpu()
            cute.arch.atomic_add(lock, Int32(1), sem="release", scope="gpu")

    @cute.jit
    def hand_dq_to_writer(self, acc_dQ, sdQ_thread, dq_targets, target, lane_in_wg, wg):
        """With the dQ writer warp: once its previous add has read this warpgroup's sdQ half, the
        fragment and its `target` (query tile, head, batch, rank) into smem, and an arrive, not a
        wait, for the writer; without a fragment (`acc_dQ` None, query tile -1), only the word that
        the steps are over."""
        pair = self.dq_pair_threads
        cute.arch.barrier(barrier_id=int(BwdBarrier.DQ_EMPTY) + wg, number_of_threads=pair)
        if lane_in_wg == 0:
            for i in cutlass.range_constexpr(4):
                dq_targets[i, wg] = target[i]
        if const_expr(acc_dQ is not None):
            _store_dq_fragment(acc_dQ, sdQ_thread)
        cute.arch.barrier_arrive(barrier_id=int(BwdBarrier.DQ_FULL) + wg, number_of_threads=pair)

    @cute.jit
    def write_dq(self, sdQ, dq_targets, mdQaccum, mSemaphore):
        """The dQ writer warp (warp 2): per step, each consumer warpgroup's dQ half from smem into
        the fp32 accumulator by a bulk reduce-add, then sdQ freed once the adds have read it, so
        the consumers neither wait for the one thread that issues the add nor for its read. Stops
        at the query tile -1."""
        pair = self.dq_pair_threads
        lane = cute.arch.lane_idx()
        for wg in cutlass.range_constexpr(self.num_consumer_wgs):  # sdQ starts free
            cute.arch.barrier_arrive(barrier_id=int(BwdBarrier.DQ_EMPTY) + wg, number_of_threads=pair)
        m_block = Int32(0)
        while m_block >= 0:
            for wg in cutlass.range_constexpr(self.num_consumer_wgs):
                cute.arch.barrier(barrier_id=int(BwdBarrier.DQ_FULL) + wg, number_of_threads=pair)
                m_block = dq_targets[0, wg]
                if m_block >= 0:
                    if lane == 0:
                        head, batch, rank = dq_targets[1, wg], dq_targets[2, wg], dq_targets[3, wg]
                        self.reduce_dq_half(sdQ, mdQaccum, mSemaphore, m_block, head, batch, rank, wg)
            if m_block >= 0:
                if lane == 0:
                    cute.arch.cp_async_bulk_wait_group(0, read=True)
                cute.arch.sync_warp()
                for wg in cutlass.range_constexpr(self.num_consumer_wgs):
                    cute.arch.barrier_arrive(barrier_id=int(BwdBarrier.DQ_EMPTY) + wg, number_of_threads=pair)

    @cute.jit
    def gather_split_parts(self, acc_dK, acc_dV, mWork, mPartials, mCounters, arrivals, tidx):
        """Whether this CTA stores dK and dV (an unsplit one, split word -1, does). A part of a split
        CTA (its row's split word, read here rather than kept live through the steps: first slot << 4
        | part << 2 | parts - 1) writes its fp32 dK and dV into its slot of
        `mPartials` and counts itself on the CTA's counter (the first slot's); the last part to count
        adds the other parts' slots into its registers and stores. Its count (an acq_rel atomic
        behind every thread's gpu fence) orders the other parts' writes before its reads, so nothing
        waits. `arrivals`: one free Int32 of smem for the count."""
        split = mWork[cute.arch.block_idx()[0], 3]
        stores = split < 0
        if split >= 0:
            first_slot, part, parts = split >> 4, (split >> 2) & 3, (split & 3) + 1
            accs = (acc_dK, acc_dV)
            for which in cutlass.range_constexpr(2):
                slot = self.split_slot(mPartials, first_slot + part, which)
                cute.autovec_copy(cute.make_tensor(accs[which].iterator, cute.make_layout(slot.shape)), slot)
            cute.arch.fence_acq_rel_gpu()
            consumers = 128 * self.num_consumer_wgs
            cute.arch.barrier(barrier_id=int(BwdBarrier.DS_READY), number_of_threads=consumers)
            if tidx == 0:
                counter = mCounters.iterator + first_slot
                arrivals[0] = cute.arch.atomic_add(counter, Int32(1), sem="acq_rel", scope="gpu")
            cute.arch.barrier(barrier_id=int(BwdBarrier.DS_READY), number_of_threads=consumers)
            stores = arrivals[0] == parts - 1
            if stores:
                cute.arch.fence_acq_rel_gpu()
                # The split word read again for each other part (a relaxed load the compiler keeps
                # in place): at 192/128 the accumulators and the loads in flight leave no register
                # to hold it decoded across the adds.
                word_at = mWork.iterator + cute.crd2idx((cute.arch.block_idx()[0], 3), mWork.layout)
                for other in cutlass.range_constexpr(4):
                    word = cute.arch.load(word_at, Int32, sem="relaxed", scope="gpu")
                    if other <= (word & 3) and other != (word >> 2) & 3:
                        for which in cutlass.range_constexpr(2):
                            slot = self.split_slot(mPartials, (word >> 4) + other, which)
                            acc = cute.make_tensor(accs[which].iterator, cute.make_layout(slot.shape))
                            for chunk in cutlass.range_constexpr(cute.size(slot, mode=[1])):  # 16 bytes each
                                values = cute.make_rmem_tensor(4, Float32)
                                cute.autovec_copy(slot[None, chunk], values)
                                for i in cutlass.range_constexpr(4):
                                    acc[i, chunk] += values[i]
        return stores

    def split_slot(self, mPartials: cute.Tensor, slot: Int32, which: int) -> cute.Tensor:
        """The thread's values of dK (`which` 0) or dV (1) in workspace slot `slot`, in fragment order
        (`dq_slot_layout` of the key tile: 16-byte stores, threads side by side), shaped like the
        thread's accumulator."""
        d, dv, tn = self.head_dim, self.head_dim_v, self.tile_n
        one = self.dq_slot_layout(dv if which else d, tn)
        # The slots as a static-stride mode, so the compiler sees 16-byte aligned addresses.
        slots = cute.make_layout((*one.shape, mPartials.shape[0]), stride=(*one.stride, tn * (d + dv)))
        lane = cute.arch.thread_idx()[0] % 128
        wg = cute.arch.make_warp_uniform(cute.arch.warp_idx()) // 4 - 1
        return cute.make_tensor(mPartials.iterator + which * tn * d, slots)[None, lane, None, wg, slot]

    @cute.jit
    def store_dkv(
        self,
        acc_dK,
        acc_dV,
        tiled_mma_dkv,
        sK,
        sV,
        tma_dk,
        tma_dv,
        mdK,
        mdV,
        segments,
        softmax_scale,
        n_block,
        head_kv,
        batch,
        qheads_per_kvhead,
        tidx,
    ):
        """Epilogue: dK (times the softmax scale) and dV in the output dtype, through the K and V smem
        buffers (stmatrix; transposing dK^T and dV^T with queries on rows) and TMA stores, which
        leave out rows past seqlen_k. With segment_steps the key tile's real rows: from its real
        first row, a tile of fewer than `tile_n` (a segment's last) row by row."""
        # Every warpgroup's last MMAs (dQ reads all of sK) are done before sK, sV are overwritten.
        cute.arch.barrier(barrier_id=int(BwdBarrier.DS_READY), number_of_threads=128 * self.num_consumer_wgs)
        st_copy = _stmatrix_copy(self.dtype, not self.keys_on_rows, tiled_mma_dkv)
        thr_copy = st_copy.get_slice(tidx)
        for acc, smem, scale in ((acc_dK, sK, softmax_scale), (acc_dV, sV, Float32(1.0))):
            r_out = cute.make_rmem_tensor_like(acc, self.dtype)
            r_out.store((acc.load() * scale).to(self.dtype))
            target = smem if const_expr(self.keys_on_rows) else transpose_view(smem)
            cute.copy(st_copy, thr_copy.retile(r_out), thr_copy.partition_D(target))
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=int(BwdBarrier.DS_READY), number_of_threads=128 * self.num_consumer_wgs)
        outputs = ((tma_dk, mdK, sK, self.head_dim), (tma_dv, mdV, sV, self.head_dim_v))
        if const_expr(self.segment_steps):
            mdK_rows, mdV_rows, mStepRows = segments
            halves = self.tile_n // self.tile_m  # the key tile spans this many query tiles of the virtual rows
            step_rows = mStepRows[batch, head_kv * qheads_per_kvhead, None, None]
            first, real_rows = step_rows[n_block * halves, 0], Int32(0)
            for half in cutlass.range_constexpr(halves):
                real_rows += step_rows[n_block * halves + half, 1]
            if real_rows == self.tile_n:
                if tidx == 0:
                    for atom, out, smem, dim in outputs:
                        g = cute.local_tile(
                            cute.domain_offset((first, 0), out[None, None, head_kv, batch]), (self.tile_n, dim), (0, 0)
                        )
                        t_s, t_g = tma_tiles(atom, smem, g)
                        cute.copy(atom, t_s, t_g)
                    cute.arch.cp_async_bulk_commit_group()
                    cute.arch.cp_async_bulk_wait_group(0, read=True)
            else:  # a TMA store of the whole tile would write over the next segment's first rows
                for out, smem, dim in ((mdK_rows, sK, self.head_dim), (mdV_rows, sV, self.head_dim_v)):
                    g = cute.local_tile(
                        cute.domain_offset((first, 0), out[None, None, head_kv, batch]), (self.tile_n, dim), (0, 0)
                    )
                    store_rows(smem, g, real_rows, tidx, 128 * self.num_consumer_wgs)
        elif tidx == 0:
            for atom, out, smem, dim in outputs:
                g = cute.local_tile(out[None, None, head_kv, batch], (self.tile_n, dim), (n_block, 0))
                t_s, t_g = tma_tiles(atom, smem, g)
                cute.copy(atom, t_s, t_g)
            cute.arch.cp_async_bulk_commit_group()
            cute.arch.cp_async_bulk_wait_group(0, read=True)
