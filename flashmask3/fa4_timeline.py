"""Per-CTA timelines of FA4's SM90 forward and backward, to set beside ours (`scripts/timeline.py
--peer fa4`).

FA4's sources are not changed. While `stamped_fa4(stamps)` is active, a few methods of its SM90
kernel classes are wrapped at trace time, so that the first consumer thread of each CTA writes
`%globaltimer` (ns) or a value into the CTA's row of `stamps` at the events our timeline builds
record (`optimized/timeline.py`): the consumers' start, the block range, the first and last key
block (forward) or query-block step (backward), the epilogue. Nothing is added inside the
kernels' block loops. FA4 runs one CTA per work tile on SM90 (its schedulers there are not
persistent), so a CTA's row is one work tile; `per_sm_work_tiles` orders the rows per SM, which
makes each SM's sequence of CTAs comparable with our persistent CTA's sequence of work tiles.

FA4 compiles a kernel per argument set and caches it in memory (on disk too, where
FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1; `stamped_fa4` refuses to run then): the stamped
build bakes in the buffer's address, so the cache is cleared on entry and on exit, and a plain
FA4 call afterwards compiles FA4's own kernel again.
"""

from __future__ import annotations

import contextlib
import os
import statistics
from collections.abc import Callable, Iterator
from enum import IntEnum

import torch

RECORDER = 128
"""The thread that stamps: the first consumer warpgroup's first thread (FA4's SM90 kernels give
warpgroup 0 to the producer warps)."""


class PeerEvent(IntEnum):
    """A FA4 CTA's row: times in ns, except the values marked."""

    SM = 0  # the SM the CTA ran on (value)
    START = 1  # the consumer warpgroups begin their work (after the CTA's setup)
    BLOCK_MIN = 2  # the first key block (forward) or query block (backward) of the CTA (value)
    BLOCK_MAX = 3  # one past its last (value)
    LOOP_START = 4  # forward: Q has landed, the first key block's wait begins; backward: the first step's
    LOOP_END = 5  # forward: the last PV GEMM is done; backward: the last step is done
    STORED = 6  # the epilogue's stores are issued


def stamp_rows(num_ctas: int, device: torch.device | str = "cuda") -> torch.Tensor:
    """A buffer for `num_ctas` CTAs (at least FA4's grid), -1 where nothing is written."""
    return torch.full((num_ctas, len(PeerEvent)), -1, dtype=torch.int64, device=device)


def _stamper(address: int, rows: int) -> Callable:
    """The traced stamp: the recorder thread writes the time, or `value`, at `column` of its CTA's
    row of the int64 [rows, len(PeerEvent)] buffer at `address` (rows past `rows` are dropped)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass import Int32, Int64

    columns = len(PeerEvent)

    @cute.jit
    def stamp(column: cutlass.Constexpr[int], value: Int32 | None = None) -> None:
        tidx, _, _ = cute.arch.thread_idx()
        if tidx == RECORDER:
            bx, by, bz = cute.arch.block_idx()
            gx, gy, _ = cute.arch.grid_dim()
            cta = bx + gx * (by + gy * bz)
            if cta < rows:
                pointer = cute.make_ptr(Int64, address, cute.AddressSpace.gmem, assumed_align=8)
                row = cute.make_tensor(pointer + cta * columns, cute.make_layout(columns))
                if cutlass.const_expr(value is None):
                    row[column] = cute.arch.globaltimer()
                else:
                    row[column] = Int64(value)

    return stamp


def _wrapped_methods(stamp: Callable) -> list[tuple[type, str, Callable]]:
    """(class, method name, wrapper) for FA4's SM90 forward and backward."""
    from flash_attn.cute.block_info import BlockInfo
    from flash_attn.cute.flash_bwd_sm90 import FlashAttentionBackwardSm90
    from flash_attn.cute.flash_fwd_sm90 import FlashAttentionForwardSm90

    def before(method: Callable, *columns: PeerEvent) -> Callable:
        def wrapper(self, *args, **kwargs):
            for column in columns:
                stamp(column)
            return method(self, *args, **kwargs)

        return wrapper

    def after(method: Callable, *columns: PeerEvent) -> Callable:
        def wrapper(self, *args, **kwargs):
            result = method(self, *args, **kwargs)
            for column in columns:
                stamp(column)
            return result

        return wrapper

    def at_start(method: Callable) -> Callable:
        import cutlass.cute as cute

        def wrapper(self, *args, **kwargs):
            stamp(PeerEvent.SM, cute.arch.smid())
            stamp(PeerEvent.START)
            return method(self, *args, **kwargs)

        return wrapper

    def block_range(method: Callable, *columns: PeerEvent) -> Callable:
        def wrapper(self, *args, **kwargs):
            block_min, block_max = method(self, *args, **kwargs)
            stamp(PeerEvent.BLOCK_MIN, block_min)
            stamp(PeerEvent.BLOCK_MAX, block_max)
            for column in columns:
                stamp(column)
            return block_min, block_max

        return wrapper

    def around(method: Callable, first: PeerEvent, last: PeerEvent) -> Callable:
        def wrapper(self, *args, **kwargs):
            stamp(first)
            result = method(self, *args, **kwargs)
            stamp(last)
            return result

        return wrapper

    fwd, bwd = FlashAttentionForwardSm90, FlashAttentionBackwardSm90
    return [
        (fwd, "mma", at_start(fwd.mma)),
        (BlockInfo, "get_n_block_min_max", block_range(BlockInfo.get_n_block_min_max)),
        (fwd, "first_half_block_overlap", before(fwd.first_half_block_overlap, PeerEvent.LOOP_START)),
        (fwd, "last_half_block_overlap", after(fwd.last_half_block_overlap, PeerEvent.LOOP_END)),
        (fwd, "epilogue", after(fwd.epilogue, PeerEvent.STORED)),
        (bwd, "mma", at_start(bwd.mma)),
        (BlockInfo, "get_m_block_min_max", block_range(BlockInfo.get_m_block_min_max, PeerEvent.LOOP_START)),
        (bwd, "epilogue_dKV", around(bwd.epilogue_dKV, PeerEvent.LOOP_END, PeerEvent.STORED)),
    ]


def _clear_compile_caches() -> None:
    from flash_attn.cute import interface

    for entry in (interface._flash_attn_fwd, interface._flash_attn_bwd):
        entry.compile_cache.clear()


@contextlib.contextmanager
def stamped_fa4(stamps: torch.Tensor) -> Iterator[None]:
    """FA4's SM90 forward and backward, compiled inside the block, stamp each CTA's events into
    `stamps` (int64 [CTAs, len(PeerEvent)], contiguous, e.g. from `stamp_rows`). FA4's forward
    must run with intra-warpgroup overlap (its SM90 default at every head dim)."""
    if os.environ.get("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED") == "1":
        raise RuntimeError(
            "stamped_fa4 needs FA4's on-disk compile cache off (FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1)"
        )
    columns = len(PeerEvent)
    if stamps.dtype != torch.int64 or list(stamps.shape[1:]) != [columns] or not stamps.is_contiguous():
        got = f"{stamps.dtype} {list(stamps.shape)}"
        raise ValueError(f"stamps must be a contiguous int64 [CTAs, {columns}] tensor, got {got}")
    stamp = _stamper(stamps.data_ptr(), stamps.shape[0])
    wrapped = _wrapped_methods(stamp)
    saved = [(cls, name, cls.__dict__.get(name)) for cls, name, _ in wrapped]
    _clear_compile_caches()
    try:
        for cls, name, wrapper in wrapped:
            setattr(cls, name, wrapper)
        yield
    finally:
        for cls, name, original in saved:
            if original is None:
                delattr(cls, name)
            else:
                setattr(cls, name, original)
        _clear_compile_caches()


def per_sm_work_tiles(stamps: torch.Tensor) -> list[list[dict]]:
    """FA4's CTAs per SM in the order they ran, each as the work tile dict `scripts/timeline.py`
    summarizes for ours (times in us from the first stamp): `start`, `loop_start`, `loop_end`,
    `stored`, `key_tiles` (the CTA's blocks: key blocks forward, query-block steps backward) and
    `work_tile` (the CTA's row). CTAs that did not run their loop (no blocks) keep their times."""
    rows = [row for row in stamps.tolist() if row[PeerEvent.STORED] >= 0]
    if not rows:
        return []
    first = min(row[PeerEvent.START] for row in rows)
    per_sm: dict[int, list[dict]] = {}
    for index, row in enumerate(stamps.tolist()):
        if row[PeerEvent.STORED] < 0:
            continue
        tile = {
            name: (row[event] - first) / 1e3
            for name, event in (
                ("start", PeerEvent.START),
                ("loop_start", PeerEvent.LOOP_START),
                ("loop_end", PeerEvent.LOOP_END),
                ("stored", PeerEvent.STORED),
            )
        }
        tile.update(work_tile=index, key_tiles=max(row[PeerEvent.BLOCK_MAX] - row[PeerEvent.BLOCK_MIN], 0))
        per_sm.setdefault(row[PeerEvent.SM], []).append(tile)
    return [sorted(tiles, key=lambda tile: tile["start"]) for _, tiles in sorted(per_sm.items())]


def summarize_per_sm(per_sm: list[list[dict]]) -> dict:
    """Medians over FA4's CTAs (us), in the terms of our forward's summary: the wait before a work
    tile's loop (from the SM's previous CTA's stores, or the kernel's start, to this CTA's loop
    start: CTA exit, launch, setup and the first loads), split into the launch gap (to the
    consumers' start) and the setup (to the loop start); the loop per block; the epilogue; each
    SM's idle tail."""
    gaps, setups, waits, per_block, epilogues, tails = [], [], [], [], [], []
    end = max(tiles[-1]["stored"] for tiles in per_sm if tiles)
    for tiles in per_sm:
        previous_store = 0.0
        for tile in tiles:
            gaps.append(tile["start"] - previous_store)
            setups.append(tile["loop_start"] - tile["start"])
            waits.append(tile["loop_start"] - previous_store)
            if tile["key_tiles"] > 0:
                per_block.append((tile["loop_end"] - tile["loop_start"]) / tile["key_tiles"])
            epilogues.append(tile["stored"] - tile["loop_end"])
            previous_store = tile["stored"]
        if tiles:
            tails.append(end - tiles[-1]["stored"])
    return {
        "sms": len(per_sm),
        "work_tiles": sum(len(tiles) for tiles in per_sm),
        "kernel_us": end,
        "median_launch_gap_us": statistics.median(gaps),
        "median_setup_us": statistics.median(setups),
        "median_wait_before_tile_us": statistics.median(waits),
        "mean_wait_before_tile_us": statistics.fmean(waits),
        "median_loop_per_block_us": statistics.median(per_block) if per_block else float("nan"),
        "median_epilogue_us": statistics.median(epilogues),
        "mean_idle_tail_us": statistics.fmean(tails),
        "max_idle_tail_us": max(tails),
    }


def summarize_backward(stamps: torch.Tensor, sm_count: int) -> dict:
    """FA4's backward CTAs (one per key tile and head), in the terms of our backward's summary:
    steps are query blocks; `mean_step_from_start_us` is the consumers' time from their start to the
    last step's end over all steps (the first step's wait for K and V included), defined the same
    way for ours; `sm_busy_share` the CTAs' summed lifetimes (consumers' start to stores) over
    `sm_count` x the span."""
    rows = [row for row in stamps.tolist() if row[PeerEvent.STORED] >= 0]
    with_steps = [row for row in rows if row[PeerEvent.BLOCK_MAX] > row[PeerEvent.BLOCK_MIN]]
    steps = [row[PeerEvent.BLOCK_MAX] - row[PeerEvent.BLOCK_MIN] for row in with_steps]
    span_ns = max(row[PeerEvent.STORED] for row in rows) - min(row[PeerEvent.START] for row in rows)
    lifetimes_ns = sum(row[PeerEvent.STORED] - row[PeerEvent.START] for row in rows)

    def median_us(first: PeerEvent, last: PeerEvent) -> float:
        return statistics.median((row[last] - row[first]) / 1e3 for row in with_steps)

    return {
        "ctas": len(rows),
        "ctas_with_steps": len(with_steps),
        "median_steps": statistics.median(steps),
        "kernel_us": span_ns / 1e3,
        "sm_busy_share": round(lifetimes_ns / (sm_count * span_ns), 4),
        "mean_step_from_start_us": sum(row[PeerEvent.LOOP_END] - row[PeerEvent.START] for row in with_steps)
        / 1e3
        / sum(steps),
        "median_setup_us": median_us(PeerEvent.START, PeerEvent.LOOP_START),
        "median_step_us": statistics.median(
            (row[PeerEvent.LOOP_END] - row[PeerEvent.LOOP_START]) / 1e3 / n for row, n in zip(with_steps, steps)
        ),
        "median_epilogue_us": median_us(PeerEvent.LOOP_END, PeerEvent.STORED),
    }
