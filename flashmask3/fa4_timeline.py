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

With a `step_marks` buffer the steps are profiled too (the forward's key blocks after the first,
the backward's query blocks): the recorder thread reads the SM clock at each step's entry, after
each synchronization the step calls (pipeline waits, WGMMA group waits, named barriers), before
each wait for all WGMMA groups, and at its exit, as our profiled builds do at their segments
(`TurnEvent`, `BwdEvent`); `step_segments` gives the cycles between consecutive marks, named
after the call that ends each. These marks sit inside the loop: time the steps from a build
without them.

FA4 compiles a kernel per argument set and caches it in memory (and on disk where its persistent
cache is on; `stamped_fa4` refuses to run then): the stamped build bakes in the buffers'
addresses, so the in-memory cache is cleared on entry and on exit, and a plain FA4 call afterwards
compiles FA4's own kernel again.
"""

from __future__ import annotations

import contextlib
import math
import statistics
from collections.abc import Callable, Iterable, Iterator
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
    LOOP_START = 4  # forward: Q has landed, the first key block's wait begins; backward: the block range
    # is known, the first step (which waits for K and V with its Q and dO) begins
    LOOP_END = 5  # forward: the last PV GEMM is done; backward: the last step is done
    STORED = 6  # the epilogue's stores are issued


STEP_MARKS = 16
"""Clock marks per step at most: its entry, one after (or before) each synchronization, its exit."""


def stamp_rows(num_ctas: int, device: torch.device | str = "cuda") -> torch.Tensor:
    """A buffer for `num_ctas` CTAs (at least FA4's grid), -1 where nothing is written."""
    return torch.full((num_ctas, len(PeerEvent)), -1, dtype=torch.int64, device=device)


def step_mark_rows(num_ctas: int, steps: int, device: torch.device | str = "cuda") -> torch.Tensor:
    """A buffer of step marks for the first `num_ctas` CTAs (a sample of the grid: the others are
    not marked) with up to `steps` blocks each (the block index is the step's slot): int32 [CTAs,
    steps, STEP_MARKS + 1], the SM clock at each mark, and in the last column the block + 1 once
    the step's marks are all written (0: no step)."""
    return torch.zeros((num_ctas, steps, STEP_MARKS + 1), dtype=torch.int32, device=device)


def _cta_index():
    import cutlass.cute as cute

    bx, by, bz = cute.arch.block_idx()
    gx, gy, _ = cute.arch.grid_dim()
    return bx + gx * (by + gy * bz)


class _Recorder:
    """What the stamped builds write, and the trace-time state of the step marks: the step being
    traced (its block, a traced value), the next mark's index, and the marks' names."""

    def __init__(self, stamps: torch.Tensor, step_marks: torch.Tensor | None):
        import cutlass
        import cutlass.cute as cute
        from cutlass import Int32, Int64

        rows, columns, address = stamps.shape[0], len(PeerEvent), stamps.data_ptr()

        @cute.jit
        def stamp(column: cutlass.Constexpr[int], value: Int32 | None = None) -> None:
            tidx, _, _ = cute.arch.thread_idx()
            if tidx == RECORDER:
                cta = _cta_index()
                if cta < rows:
                    pointer = cute.make_ptr(Int64, address, cute.AddressSpace.gmem, assumed_align=8)
                    row = cute.make_tensor(pointer + cta * columns, cute.make_layout(columns))
                    if cutlass.const_expr(value is None):
                        row[column] = cute.arch.globaltimer()
                    else:
                        row[column] = Int64(value)

        self.stamp = stamp
        self.mark = None
        if step_marks is not None:
            mark_rows, steps, per_step = step_marks.shape[0], step_marks.shape[1], STEP_MARKS + 1
            mark_address = step_marks.data_ptr()

            @cute.jit
            def mark(block: Int32, index: cutlass.Constexpr[int], value: Int32 | None = None) -> None:
                tidx, _, _ = cute.arch.thread_idx()
                if tidx == RECORDER:
                    cta = _cta_index()
                    if cta < mark_rows and block < steps:
                        pointer = cute.make_ptr(Int32, mark_address, cute.AddressSpace.gmem, assumed_align=4)
                        step = cute.make_tensor(pointer + (cta * steps + block) * per_step, per_step)
                        if cutlass.const_expr(value is None):
                            step[index] = cute.arch.clock()
                        else:
                            step[index] = value

            self.mark = mark
        self.block = None
        self.next_mark = 0
        self.labels: dict[str, list[str]] = {}
        self.kind = ""

    @contextlib.contextmanager
    def step(self, kind: str, block) -> Iterator[None]:
        """Marks for the step of `block` traced inside (`kind`: "forward" or "backward")."""
        if self.mark is None:
            yield
            return
        self.block, self.kind, self.next_mark = block, kind, 0
        try:
            self.at("entry")
            yield
            self.at("exit")
            self.mark(block, STEP_MARKS, block + 1)
        finally:
            self.block = None

    def at(self, label: str) -> None:
        """A mark named `label`, if a step is being traced."""
        if self.block is None:
            return
        if self.next_mark >= STEP_MARKS:
            raise RuntimeError(f"FA4's {self.kind} step makes more than {STEP_MARKS - 2} marked synchronization calls")
        self.mark(self.block, self.next_mark)
        labels = self.labels.setdefault(self.kind, [])
        if len(labels) == self.next_mark:  # the first trace of the step names the marks
            labels.append(label)
        self.next_mark += 1


def _wrapped(recorder: _Recorder) -> list[tuple[object, str, Callable]]:
    """(class or module, attribute, wrapper) for FA4's SM90 forward and backward; with step marks,
    also the steps and the synchronization calls they make."""
    import cutlass.cute as cute
    from cutlass.cute.nvgpu import warpgroup
    from flash_attn.cute import pipeline
    from flash_attn.cute.block_info import BlockInfo
    from flash_attn.cute.flash_bwd_sm90 import FlashAttentionBackwardSm90
    from flash_attn.cute.flash_fwd_sm90 import FlashAttentionForwardSm90

    stamp = recorder.stamp

    def stamping(method: Callable, before: tuple[PeerEvent, ...] = (), after: tuple[PeerEvent, ...] = ()) -> Callable:
        def wrapper(self, *args, **kwargs):
            for column in before:
                stamp(column)
            result = method(self, *args, **kwargs)
            for column in after:
                stamp(column)
            return result

        return wrapper

    def at_start(method: Callable) -> Callable:
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

    fwd, bwd = FlashAttentionForwardSm90, FlashAttentionBackwardSm90
    wrapped: list[tuple[object, str, Callable]] = [
        (fwd, "mma", at_start(fwd.mma)),
        (BlockInfo, "get_n_block_min_max", block_range(BlockInfo.get_n_block_min_max)),
        (fwd, "first_half_block_overlap", stamping(fwd.first_half_block_overlap, before=(PeerEvent.LOOP_START,))),
        (fwd, "last_half_block_overlap", stamping(fwd.last_half_block_overlap, after=(PeerEvent.LOOP_END,))),
        (fwd, "epilogue", stamping(fwd.epilogue, after=(PeerEvent.STORED,))),
        (bwd, "mma", at_start(bwd.mma)),
        (BlockInfo, "get_m_block_min_max", block_range(BlockInfo.get_m_block_min_max, PeerEvent.LOOP_START)),
        (bwd, "epilogue_dKV", stamping(bwd.epilogue_dKV, before=(PeerEvent.LOOP_END,), after=(PeerEvent.STORED,))),
    ]
    if recorder.mark is None:
        return wrapped

    def forward_step(method: Callable) -> Callable:  # called with n_block= (its other arguments vary)
        def wrapper(self, *args, **kwargs):
            with recorder.step("forward", kwargs["n_block"]):
                return method(self, *args, **kwargs)

        return wrapper

    def backward_step(method: Callable) -> Callable:
        def wrapper(self, m_block, *args, **kwargs):
            with recorder.step("backward", m_block):
                return method(self, m_block, *args, **kwargs)

        return wrapper

    def marked(function: Callable, label: Callable[..., str]) -> Callable:
        def wrapper(*args, **kwargs):
            result = function(*args, **kwargs)
            recorder.at(label(*args, **kwargs))
            return result

        return wrapper

    def wait_group(group: int, *args, **kwargs):
        if group == 0:  # the work before it, then the wait itself
            recorder.at("before wait_group(0)")
        result = warpgroup_wait_group(group, *args, **kwargs)
        recorder.at(f"wait_group({group})")
        return result

    def barrier_label(*args, number_of_threads=None, **kwargs) -> str:  # the thread count tells them apart
        return f"barrier ({number_of_threads} threads)"

    def arrive_label(*args, number_of_threads=None, **kwargs) -> str:
        return f"barrier arrive ({number_of_threads} threads)"

    warpgroup_wait_group = warpgroup.wait_group
    # NamedBarrier.arrive_and_wait and the turn barriers go through cute.arch.barrier: marked there
    wrapped += [
        (fwd, "mma_one_n_block_intrawg_overlap", forward_step(fwd.mma_one_n_block_intrawg_overlap)),
        (bwd, "mma_one_m_block", backward_step(bwd.mma_one_m_block)),
        (warpgroup, "wait_group", wait_group),
        (
            pipeline.PipelineTmaAsync,
            "consumer_wait",
            marked(pipeline.PipelineTmaAsync.consumer_wait, _named("TMA wait")),
        ),
        (cute.arch, "barrier", marked(cute.arch.barrier, barrier_label)),
        (cute.arch, "barrier_arrive", marked(cute.arch.barrier_arrive, arrive_label)),
    ]
    return wrapped


def _named(label: str) -> Callable[..., str]:
    return lambda *args, **kwargs: label


def _check_fa4_caches() -> None:
    from flash_attn.cute import interface
    from flash_attn.cute.cache_utils import JITPersistentCache

    for entry in (interface._flash_attn_fwd, interface._flash_attn_bwd):
        if isinstance(entry.compile_cache, JITPersistentCache):
            raise RuntimeError(
                "stamped_fa4 needs FA4's on-disk compile cache off (FA4 was imported with "
                "FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1): unset it, or set it to 0, before importing flash_attn"
            )


def _clear_compile_caches() -> None:
    from flash_attn.cute import interface

    for entry in (interface._flash_attn_fwd, interface._flash_attn_bwd):
        entry.compile_cache.clear()


def _check_buffers(stamps: torch.Tensor, step_marks: torch.Tensor | None) -> None:
    columns = len(PeerEvent)
    if stamps.dtype != torch.int64 or list(stamps.shape[1:]) != [columns] or not stamps.is_contiguous():
        got = f"{stamps.dtype} {list(stamps.shape)}"
        raise ValueError(f"stamps must be a contiguous int64 [CTAs, {columns}] tensor, got {got}")
    if step_marks is not None:
        shape = list(step_marks.shape)
        if step_marks.dtype != torch.int32 or len(shape) != 3 or shape[2] != STEP_MARKS + 1:
            got = f"{step_marks.dtype} {shape}"
            raise ValueError(f"step_marks must be an int32 [CTAs, steps, {STEP_MARKS + 1}] tensor, got {got}")
        if not step_marks.is_contiguous():
            raise ValueError("step_marks must be contiguous (from step_mark_rows)")
    for name, buffer in (("stamps", stamps), ("step_marks", step_marks)):
        if buffer is not None and torch.cuda.is_available() and buffer.device.type != "cuda":
            raise ValueError(f"{name} must be on the GPU the kernels run on, got {buffer.device}")


@contextlib.contextmanager
def stamped_fa4(stamps: torch.Tensor, step_marks: torch.Tensor | None = None) -> Iterator[dict[str, list[str]]]:
    """FA4's SM90 forward and backward, compiled inside the block, stamp each CTA's events into
    `stamps` (int64 [CTAs, len(PeerEvent)], contiguous, e.g. from `stamp_rows`) and, given
    `step_marks` (from `step_mark_rows`), mark the steps of the CTAs it holds. Yields the marks'
    names per step kind ("forward", "backward"), filled in as the kernels compile. FA4's forward
    must run with intra-warpgroup overlap (its SM90 default at every head dim). The buffers are
    on the GPU (on a machine without one, only compiling makes sense)."""
    _check_buffers(stamps, step_marks)
    _check_fa4_caches()
    recorder = _Recorder(stamps, step_marks)
    wrapped = _wrapped(recorder)
    saved = [(owner, name, vars(owner).get(name)) for owner, name, _ in wrapped]
    _clear_compile_caches()
    try:
        for owner, name, wrapper in wrapped:
            setattr(owner, name, wrapper)
        yield recorder.labels
    finally:
        for owner, name, original in reversed(saved):
            if original is None:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
        _clear_compile_caches()


def patch_points() -> list[tuple[object, str]]:
    """The (class or module, attribute) pairs `stamped_fa4` replaces while active, step marks on."""
    recorder = _Recorder(stamp_rows(1, "cpu"), step_mark_rows(1, 1, "cpu"))
    return [(owner, name) for owner, name, _ in _wrapped(recorder)]


def _stored_rows(stamps: torch.Tensor) -> list[tuple[int, list[int]]]:
    """(CTA, row) of the CTAs that stored, checked for the loop's stamps."""
    rows = [(cta, row) for cta, row in enumerate(stamps.tolist()) if row[PeerEvent.STORED] >= 0]
    for event in (PeerEvent.SM, PeerEvent.START, PeerEvent.LOOP_START, PeerEvent.LOOP_END):
        if any(row[event] < 0 for _, row in rows):
            raise ValueError(
                f"FA4 CTAs stored without a {event.name} stamp: a code path the wrappers do not cover "
                "(the forward needs intra-warpgroup overlap and no block sparsity)"
            )
    return rows


def per_sm_work_tiles(stamps: torch.Tensor) -> list[list[dict]]:
    """FA4's CTAs per SM in the order they ran, each as the work tile dict `scripts/timeline.py`'s
    `summarize` reads for ours (times in us from the first stamp): `start`, `loop_start`, `loop_end`,
    `stored`, `key_tiles` (the CTA's blocks: key blocks forward, query-block steps backward) and
    `work_tile` (the CTA's row). CTAs that did not run their loop (no blocks) keep their times."""
    rows = _stored_rows(stamps)
    if not rows:
        return []
    first = min(row[PeerEvent.START] for _, row in rows)
    per_sm: dict[int, list[dict]] = {}
    for cta, row in rows:
        tile = {
            name: (row[event] - first) / 1e3
            for name, event in (
                ("start", PeerEvent.START),
                ("loop_start", PeerEvent.LOOP_START),
                ("loop_end", PeerEvent.LOOP_END),
                ("stored", PeerEvent.STORED),
            )
        }
        tile.update(work_tile=cta, key_tiles=max(row[PeerEvent.BLOCK_MAX] - row[PeerEvent.BLOCK_MIN], 0))
        per_sm.setdefault(row[PeerEvent.SM], []).append(tile)
    return [sorted(tiles, key=lambda tile: tile["start"]) for _, tiles in sorted(per_sm.items())]


def summarize_backward(stamps: torch.Tensor, sm_count: int) -> dict:
    """FA4's backward CTAs (one per key tile and head). Steps are query blocks. Only
    `mean_step_from_start_us` (the consumers' time from their start to the last step's end over
    all steps) is defined as ours is; FA4's first step also waits for K and V (they come with its
    first Q and dO), so its step and setup times are not our `median_step_us` and
    `median_kv_wait_us`. `sm_busy_share`: the CTAs' summed lifetimes (consumers' start to stores)
    over `sm_count` x the span."""
    rows = [row for _, row in _stored_rows(stamps)]
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
        "median_setup_before_loads_us": median_us(PeerEvent.START, PeerEvent.LOOP_START),
        "median_step_with_first_loads_us": statistics.median(
            (row[PeerEvent.LOOP_END] - row[PeerEvent.LOOP_START]) / 1e3 / n for row, n in zip(with_steps, steps)
        ),
        "median_epilogue_us": median_us(PeerEvent.LOOP_END, PeerEvent.STORED),
    }


def step_segments(step_marks: torch.Tensor, labels: list[str]) -> dict:
    """Medians over the marked steps: SM cycles from each mark to the next, named after the call
    that ends the segment (numbered, in the step's order), and of the whole step."""
    marks = step_marks.reshape(-1, STEP_MARKS + 1).to(torch.int64)
    marks = marks[marks[:, STEP_MARKS] > 0, : len(labels)]
    cycles = ((marks[:, 1:] - marks[:, :-1]) % (1 << 32)).tolist()  # the 32-bit clock may wrap in a step
    names = [f"{index:02d} {label}" for index, label in enumerate(labels[1:], start=1)]
    return {
        "marked_steps": len(cycles),
        "median_step_cycles": median_or_nan(sum(step) for step in cycles),
        "segment_cycles_per_step": {name: median_or_nan(step[i] for step in cycles) for i, name in enumerate(names)},
    }


def median_or_nan(values: Iterable[float]) -> float:
    """The median, NaN when there are no values (a profile that recorded nothing)."""
    values = list(values)
    return float(statistics.median(values)) if values else math.nan
