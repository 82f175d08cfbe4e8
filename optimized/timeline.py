"""Per-CTA event timestamps of the persistent forward, to see where a work tile's time goes.

Compiled in only when `interface.forward` is given a `timeline` buffer (a debugging build, off by
default: the default kernel has none of it). One thread per role writes `%globaltimer` (ns) at its
events into an int64 buffer [CTAs, work tiles per CTA, len(Event)]; work tiles past the buffer's
second dim are not recorded.
`scripts/timeline.py` runs it and draws the picture.
"""

from dataclasses import dataclass
from enum import IntEnum

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64


class Event(IntEnum):
    WORK_TILE = 0  # the work tile's index (not a time)
    LISTED = 1  # mask warp: the header is out (the tile is drawn)
    LIST_END = 2  # mask warp: the key tile list is out
    Q_ISSUED = 3  # producer: Q's TMA issued (sQ was free)
    Q_LANDED = 4  # consumer warpgroup 0: Q is in smem
    LOOP_START = 5  # consumer warpgroup 0: its first turn on the tensor cores began
    LOOP_END = 6  # consumer warpgroup 0: its last PV GEMM is done
    STORED = 7  # consumer warpgroup 0: O's TMA store issued and the LSE written
    KEY_TILES = 8  # the number of listed key tiles (not a time)


@dataclass(frozen=True)
class Timeline:
    """The buffer, or None (then `record` compiles to nothing)."""

    buffer: cute.Tensor | None

    @cute.jit
    def record(self, work_tile: Int32, event: cutlass.Constexpr[int], value: Int32 | None = None) -> None:
        """Write `event` of the CTA's `work_tile`-th work tile: the time, or `value`. One thread calls."""
        if cutlass.const_expr(self.buffer is not None):
            cta, _, _ = cute.arch.block_idx()
            if work_tile < self.buffer.shape[1]:
                stamp = cute.arch.globaltimer() if cutlass.const_expr(value is None) else Int64(value)
                self.buffer[cta, work_tile, event] = stamp
