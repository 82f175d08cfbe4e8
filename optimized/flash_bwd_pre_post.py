"""The backward's two memory-bound passes around the main kernel (flash_bwd_sm90.py), each one
kernel over (query tile, head, batch):

- preprocess: Delta = rowsum(dO * O) in fp32 (4 threads per row), the LSE in base 2 with +inf for
  rows that see no key (so their P is 0, not NaN), rows padded to the tile, and the zeroed fp32
  dQ accumulator tile;
- postprocess: dQ = scale * accumulator in the input dtype, each thread reading back the slots its
  twin thread of the main kernel wrote (register-fragment order) and storing them in place.
"""

from __future__ import annotations

import math
from typing import Type

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass import Float32

from .flash_bwd_sm90 import FlashMaskBackwardSm90, _assume_aligned

LOG2_E = math.log2(math.e)


class BackwardPreprocess:
    tile_m = FlashMaskBackwardSm90.tile_m
    threads_per_row = 4
    num_threads = tile_m * threads_per_row

    def __init__(self, dtype: Type[cutlass.Numeric], head_dim: int):
        self.dtype = dtype
        self.head_dim = head_dim

    @cute.jit
    def __call__(
        self,
        mO: cute.Tensor,  # [B, Sq, Hq, D]
        mdO: cute.Tensor,  # [B, Sq, Hq, D]
        mLSE: cute.Tensor,  # [B, Hq, Sq] fp32, natural log
        mLSE2: cute.Tensor,  # [B, Hq, Sq_pad] fp32 out
        mDelta: cute.Tensor,  # [B, Hq, Sq_pad] fp32 out
        mdQaccum: cute.Tensor,  # [B, Hq, Tm, tile_m * D] fp32 out (zeroed)
        stream: cuda.CUstream,
    ):
        mO, mdO = (_assume_aligned(t) for t in (mO, mdO))
        grid = (cute.size(mdQaccum.shape[2]), cute.size(mdQaccum.shape[1]), cute.size(mdQaccum.shape[0]))
        self.kernel(mO, mdO, mLSE, mLSE2, mDelta, mdQaccum).launch(
            grid=grid, block=[self.num_threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mO, mdO, mLSE, mLSE2, mDelta, mdQaccum):
        tidx, _, _ = cute.arch.thread_idx()
        m_block, head, batch = cute.arch.block_idx()
        part = tidx % self.threads_per_row
        row = m_block * self.tile_m + tidx // self.threads_per_row
        seqlen_q = mO.shape[1]
        elems = self.head_dim // self.threads_per_row
        dot = Float32(0.0)
        if row < seqlen_q:
            rO = cute.make_rmem_tensor((elems,), self.dtype)
            rdO = cute.make_rmem_tensor((elems,), self.dtype)
            cute.autovec_copy(cute.local_tile(mO[batch, row, head, None], (elems,), (part,)), rO)
            cute.autovec_copy(cute.local_tile(mdO[batch, row, head, None], (elems,), (part,)), rdO)
            dot = (rO.load().to(Float32) * rdO.load().to(Float32)).reduce(cute.ReductionOp.ADD, 0.0, 0)
        dot = cute.arch.warp_reduction_sum(dot, threads_in_group=self.threads_per_row)
        if part == 0:
            lse = mLSE[batch, head, row] if row < seqlen_q else -Float32.inf
            mLSE2[batch, head, row] = Float32.inf if lse == -Float32.inf else lse * LOG2_E
            mDelta[batch, head, row] = dot
        per_thread = self.tile_m * self.head_dim // self.num_threads
        zeros = cute.make_rmem_tensor((per_thread,), Float32)
        zeros.fill(0.0)
        cute.autovec_copy(zeros, cute.local_tile(mdQaccum[batch, head, m_block, None], (per_thread,), (tidx,)))


class BackwardPostprocess:
    def __init__(self, dtype: Type[cutlass.Numeric], head_dim: int):
        self.dtype = dtype
        self.head_dim = head_dim
        self.main = FlashMaskBackwardSm90(dtype, head_dim, causal=False, mask_width=2)
        self.num_threads = 128 * self.main.num_consumer_wgs

    @cute.jit
    def __call__(
        self,
        mdQaccum: cute.Tensor,  # [B, Hq, Tm, tile_m * D] fp32, as the main kernel left it
        mdQ: cute.Tensor,  # [B, Sq, Hq, D] out
        softmax_scale: Float32,
        stream: cuda.CUstream,
    ):
        grid = (cute.size(mdQaccum.shape[2]), cute.size(mdQaccum.shape[1]), cute.size(mdQaccum.shape[0]))
        self.kernel(mdQaccum, mdQ, softmax_scale, self.main.dq_tiled_mma(), self.main.dq_slot_layout()).launch(
            grid=grid, block=[self.num_threads, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, mdQaccum, mdQ, softmax_scale: Float32, tiled_mma_dq: cute.TiledMma, slot_layout: cute.Layout):
        tidx, _, _ = cute.arch.thread_idx()
        m_block, head, batch = cute.arch.block_idx()
        coords = tiled_mma_dq.get_slice(tidx).partition_C(
            cute.make_identity_tensor((self.main.tile_m, self.head_dim)))
        tile = cute.make_tensor(mdQaccum[batch, head, m_block, None].iterator, slot_layout)
        slots = tile[None, tidx % 128, None, tidx // 128]
        values = cute.make_rmem_tensor(slots.shape, Float32)
        cute.autovec_copy(slots, values)
        seqlen_q = mdQ.shape[1]
        for k in cutlass.range_constexpr(cute.size(values)):
            row, col = coords[k]
            q_row = m_block * self.main.tile_m + row
            if q_row < seqlen_q:
                mdQ[batch, q_row, head, col] = (values[k] * softmax_scale).to(self.dtype)


def prepost_compile_args(dtype: Type[cutlass.Numeric], head_dim: int) -> tuple[list, list]:
    """Fake arguments (symbolic sizes) to compile the preprocess and the postprocess without a GPU."""
    b, sq, h, tm = (cute.sym_int32() for _ in range(4))

    def fake(dt, shape):
        order = tuple(reversed(range(len(shape))))
        return cute.runtime.make_fake_compact_tensor(dt, shape, stride_order=order, assumed_align=16)

    q_like = fake(dtype, (b, sq, h, head_dim))
    accum = fake(Float32, (b, h, tm, 64 * head_dim))
    rows = fake(Float32, (b, h, sq))
    stream = cute.runtime.make_fake_stream()
    return [q_like, q_like, rows, rows, rows, accum, stream], [accum, q_like, Float32(0.1), stream]

