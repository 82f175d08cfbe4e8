"""Per-CTA event timestamps, to see where the kernels' time goes.

Forward (`Event`, `Timeline`): compiled in only when `interface.forward` is given a `timeline`
buffer (a debugging build, off by default: the default kernel has none of it). One thread per role
writes `%globaltimer` (ns) at its events into an int64 buffer [CTAs, work tiles per CTA,
len(Event)]; work tiles past the buffer's second dim are not recorded.

Forward turn profile (`TurnEvent`, `SegmentProfile`): compiled in only when `interface.forward`
is given a `turn_profile` buffer [CTAs, len(TurnEvent)] int64. Consumer thread 0 sums the SM clock
cycles of each segment of the key-tile loop's steady-state turns (`clock` between consecutive
marks, into smem) and counts the turns, written out once at the end. The marks sit in the loop:
time the loop from the timeline build, compare segments here.

Backward (`BwdEvent`, `SegmentProfile`): compiled in only when `interface.backward` is given a
`timeline` buffer [CTAs, len(BwdEvent)] int64. Consumer thread 0 stamps the CTA's phases with
`%globaltimer` and sums the SM clock cycles of each segment of its query-tile steps, as above.
`scripts/timeline.py` runs each and summarizes it.
"""

from dataclasses import dataclass
from enum import IntEnum

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64


class Event(IntEnum):
    WORK_TILE = 0  # the work tile's draw index (not a time)
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


class BwdEvent(IntEnum):
    """A backward CTA's record: four times (ns), the step count, then cycles summed over its steps."""

    START = 0  # consumer warpgroup 0 begins
    KV_LANDED = 1  # K and V are in smem
    LOOP_END = 2  # the last step is done
    STORED = 3  # dK and dV's TMA stores issued
    STEPS = 4  # query-tile steps (not a time)
    # Cycles per segment of a step, each from the previous mark to its own:
    WAIT_Q = 5  # the LSE loads (Q's barrier is in NEXT_ENTRY, but a head's first step's here)
    WAIT_S = 6  # S and dP issued (dO's barrier between), S's wait
    SOFTMAX = 7  # the element mask, the exponentials, P to bf16
    WAIT_DP = 8  # dP's wait
    DS = 9  # dS, its stmatrix and the dV / dK GEMMs issued before the barrier, the fence
    DS_BARRIER = 10  # lane 0's wait for the last dQ add to read sdQ, the barrier between warpgroups
    WAIT_DQ = 11  # the dQ GEMM (and dK's) issued, the wait for dQ
    ADD_DQ = 12  # dQ to smem, the warpgroup barrier, the reduce-add issued
    WAIT_DK = 13  # the wait for dK, the stage releases
    NEXT_ENTRY = 14  # the next query tile's Q barrier and its entry, from Q's stage


STEP_SEGMENTS = tuple(e for e in BwdEvent if e >= BwdEvent.WAIT_Q)


class TurnEvent(IntEnum):
    """A forward CTA's turn profile: the steady-state turns of its key-tile loops, then cycles
    summed over them per segment of a turn (each from the previous mark to its own). Each mark
    adds its shared-memory accumulate (a load, an add, a store) to the segment after it."""

    TURNS = 0  # turns profiled (not cycles)
    WAIT_K = 1  # from the previous turn's end: P's conversion (ptxas sinks it below the last mark), K's stage
    WAIT_TURN = 2  # the turn barrier: the other warpgroup has issued its GEMMs
    ISSUE = 3  # S issued, V's wait, PV issued, the turn handed over
    NEXT_ENTRY = 4  # the next list entry and its bounds' cp.async
    WAIT_S = 5  # S's wait
    MASK = 6  # the element mask (PARTIAL and diagonal tiles), K's release
    SOFTMAX = 7  # row maxima, exponentials, row sums
    WAIT_PV = 8  # the PV GEMM's wait, V's release
    RESCALE = 9  # O rescaled


TURN_SEGMENTS = tuple(e for e in TurnEvent if e >= TurnEvent.WAIT_K)


@dataclass(frozen=True)
class SegmentProfile:
    """A profiled build's record: `buffer` [CTAs, columns] int64 and its smem accumulators, or None
    (then every call compiles to nothing). Only one consumer thread (`recorder`) records. The
    columns from `first` on hold cycles per segment (`segments` of them), events before it times
    or values (`stamp`); `count`, a column whose smem slot follows the segments', counts the
    passes (the forward's turns)."""

    buffer: cute.Tensor | None
    cycles: cute.Tensor | None  # Int64 smem [segments], or [segments + 1] with `count`
    recorder: cutlass.Boolean
    first: int
    segments: int
    count: int | None = None

    @cute.jit
    def start(self) -> Int32:
        """Zero the accumulators; the clock to mark from (the SM clock's low 32 bits: one register,
        and a segment is far shorter than its wrap)."""
        now = Int32(0)
        if cutlass.const_expr(self.buffer is not None):
            if self.recorder:
                self.cycles.fill(0)
            now = cute.arch.clock()
        return now

    @cute.jit
    def now(self) -> Int32:
        """The clock to mark from (0 outside a profiled build)."""
        now = Int32(0)
        if cutlass.const_expr(self.buffer is not None):
            now = cute.arch.clock()
        return now

    @cute.jit
    def mark(self, last: Int32, segment: cutlass.Constexpr[int]) -> Int32:
        """Add the cycles since `last` to `segment`; return the clock now."""
        now = last
        if cutlass.const_expr(self.buffer is not None):
            now = cute.arch.clock()
            if self.recorder:
                slot = segment - self.first
                self.cycles[slot] = self.cycles[slot] + Int64(now - last)
        return now

    @cute.jit
    def add_pass(self) -> None:
        """One more pass through the segments (the `count` column)."""
        if cutlass.const_expr(self.buffer is not None and self.count is not None):
            if self.recorder:
                self.cycles[self.segments] = self.cycles[self.segments] + Int64(1)

    @cute.jit
    def stamp(self, cta: Int32, event: cutlass.Constexpr[int], value: Int32 | None = None) -> None:
        """Write `event`: the time, or `value`."""
        if cutlass.const_expr(self.buffer is not None):
            if self.recorder:
                stamp = cute.arch.globaltimer() if cutlass.const_expr(value is None) else Int64(value)
                self.buffer[cta, event] = stamp

    @cute.jit
    def write_cycles(self, cta: Int32) -> None:
        """The accumulators into the CTA's row (and the pass count into `count`)."""
        segments, first = self.segments, self.first  # range_constexpr takes names, not attributes
        if cutlass.const_expr(self.buffer is not None):
            if self.recorder:
                for i in cutlass.range_constexpr(segments):
                    self.buffer[cta, first + i] = self.cycles[i]
                if cutlass.const_expr(self.count is not None):
                    self.buffer[cta, self.count] = self.cycles[segments]
