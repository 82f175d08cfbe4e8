"""Persistent scheduling of the forward's work tiles: (query tile, query head, batch) triples.

The grid has at most one CTA per SM. A CTA starts on work tile `blockIdx.x` and draws each further
one from a global counter (one atomic add), so CTAs that drew short tile lists take more work tiles
and the prologue of one work tile (Q and the first K/V loads) runs under the previous one's last
GEMMs and epilogue. The mask role draws the work tiles: it publishes each into the tile ring as a
header entry ahead of the tile's key tiles (mask_role.py), and draws the next one only once every
reader has taken the header of the current one, so no CTA holds more than one work tile in
reserve. With a grid of one CTA per work tile the same code runs each CTA once.

Order: the query tiles of one (head, batch) are consecutive, so the CTAs running at a time share a
few heads' K/V in L2; under a causal mask they go last-first, the longest lists first. With an
`order` (the host's longest-first permutation of the work tiles) the n-th drawn is `order[n]`.
"""

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Int32

NO_MORE_WORK = -1
"""The header entry that ends a CTA's work."""


@dataclass(frozen=True)
class WorkTiles:
    """The work tile index space: query tile fastest, then query head, then batch."""

    num_m_blocks: Int32
    num_heads: Int32
    total: Int32
    last_first: bool  # causal: query tiles in reverse order (without an order)
    order: cute.Tensor | None  # int32 [total]: the work tile to draw n-th

    @cute.jit
    def header(self, work: Int32) -> Int32:
        """The header entry the mask role publishes for the `work`-th work tile drawn: the work
        tile itself, looked up in `order` once here rather than by each reader, where the global
        load would stand before the tile's Q load and first GEMM."""
        if cutlass.const_expr(self.order is not None):
            work = self.order[work]
        return work

    @cute.jit
    def decode(self, entry: Int32):
        """(query tile, query head, batch) of a header entry (`header`)."""
        m_block = entry % self.num_m_blocks
        head_batch = entry // self.num_m_blocks
        if cutlass.const_expr(self.last_first and self.order is None):
            m_block = self.num_m_blocks - 1 - m_block
        return m_block, head_batch % self.num_heads, head_batch // self.num_heads


@cute.jit
def draw_work_tile(counter: cute.Tensor, num_ctas: Int32) -> Int32:
    """The next work tile for this CTA (called by a whole warp): `num_ctas` plus the counter's
    old value. The first `num_ctas` tiles are the CTAs' own; the counter starts at zero."""
    drawn = Int32(0)
    if cute.arch.lane_idx() == 0:
        drawn = cute.arch.atomic_add(counter.iterator, Int32(1), sem="relaxed", scope="gpu")
    return cute.arch.shuffle_sync(drawn, 0) + num_ctas
