"""Timing and FLOP accounting shared by the main job and the benchmark scripts."""

from __future__ import annotations

import bisect
import contextlib
import json
import math
import os
import statistics
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch

if TYPE_CHECKING:
    from flashmask3.reference import ColumnMask


def git_commit() -> str:
    """The commit measured: $FLASHMASK3_COMMIT if set (the device copy has no .git), else git's HEAD
    with '+dirty' for uncommitted changes, else 'unknown'."""
    if os.environ.get("FLASHMASK3_COMMIT"):
        return os.environ["FLASHMASK3_COMMIT"]
    here = Path(__file__).resolve().parent
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=here, capture_output=True, text=True)
        return sha.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def called_mask(name: str, mask: ColumnMask) -> tuple[ColumnMask | None, bool]:
    """(mask, causal): how ours is called for the mask family `name` (`masks.build`'s `mask`), as
    its users call it: no mask for "full" (unmasked attention), no mask and causal=True for "causal"
    (`attention(causal=True)`, as FA4's `causal=True` is called), so that the timings hold those
    paths' own costs; `mask` otherwise."""
    if name in ("full", "causal"):
        return None, name == "causal"
    return mask, False


def results_dir() -> Path:
    """Where the benchmark scripts write their records: $OUT where set (the device machine's
    folder that comes back), else runs/."""
    return Path(os.environ.get("OUT", "runs"))


def result_json(record: dict) -> str:
    """A result record as JSON for bench/results/: floats to 4 significant digits and each row of a
    top-level list on one line, so a committed record stays a few KB."""

    def rounded(value):
        if isinstance(value, float):
            return float(f"{value:.4g}")
        if isinstance(value, dict):
            return {key: rounded(item) for key, item in value.items()}
        if isinstance(value, list):
            return [rounded(item) for item in value]
        return value

    fields = []
    for key, value in rounded(record).items():
        if isinstance(value, list) and value:
            value_json = "[\n  " + ",\n  ".join(json.dumps(row) for row in value) + "\n ]"
        else:
            value_json = json.dumps(value)
        fields.append(f"{json.dumps(key)}: {value_json}")
    return "{\n " + ",\n ".join(fields) + "\n}\n"


def attention_flops(batch: int, heads: int, seqlen_q: int, seqlen_k: int, head_dim: int, density: float) -> float:
    """Forward FLOPs on unmasked work: 4 * B * H * Sq * Sk * D * density (backward is 2.5x)."""
    return 4.0 * batch * heads * seqlen_q * seqlen_k * head_dim * density


def progress(items, desc: str):
    """A tqdm progress bar over `items` for long sweeps (plain iteration where tqdm is missing)."""
    try:
        from tqdm import tqdm
    except ImportError:
        return items
    return tqdm(items, desc=desc, leave=False)


def gpu_times_ms(fn: Callable, inputs: list[tuple], warmup: int = 3, repeats: int = 10) -> list[float]:
    """GPU milliseconds of each of `repeats` rounds of fn(*x) over the argument tuples `inputs`, from
    CUDA events around each call. No sync between calls (one at the end), as in a training step: the
    host's launch work overlaps the previous call's GPU time instead of being counted as idle GPU."""
    for _ in range(warmup):
        for x in inputs:
            fn(*x)
    events = []
    for _ in range(repeats):
        for x in inputs:
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(*x)
            stop.record()
            events.append((start, stop))
    torch.cuda.synchronize()
    return [start.elapsed_time(stop) for start, stop in events]


def host_us(fn: Callable, inputs: list[tuple], calls: int = 10) -> float:
    """Host microseconds per call of fn(*x) (its launch work, Python included): `calls` calls issued
    after a sync and timed on the host clock while the GPU runs behind them."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(calls):
        fn(*inputs[i % len(inputs)])
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def error_string(exc: BaseException) -> str:
    """An exception as one line of at most 300 characters, for a result row."""
    return " ".join(f"{type(exc).__name__}: {exc}".split())[:300]


def clock_reading() -> tuple[float, float] | None:
    """(SM clock MHz, power W) now, or None where NVML cannot be read."""
    try:
        return float(torch.cuda.clock_rate()), torch.cuda.power_draw() / 1e3
    except Exception:  # no GPU, no pynvml, no permission: no clocks in the record
        return None


@contextlib.contextmanager
def _sampling_thread(sample: Callable[[], None], stop: threading.Event) -> Iterator[None]:
    """`sample` (a loop until `stop` is set) in a background thread for the block, where NVML can
    be read."""
    if not torch.cuda.is_available() or clock_reading() is None:
        yield
        return
    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


class ClockTrace:
    """The GPU's SM clock and power through NVML every `interval_s`, each reading with the host's
    `time.perf_counter()`, in a background thread: afterwards, the medians over the readings taken
    within given windows of host time (`within`), e.g. the GPU-time spans of one backend's steps
    mapped onto the host clock. Nothing is read where NVML cannot be."""

    def __init__(self, interval_s: float = 0.002):
        self.interval_s = interval_s
        self.samples: list[tuple[float, float, float]] = []  # (host seconds, SM MHz, W)
        self._stop = threading.Event()

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            reading = clock_reading()
            if reading is not None:
                self.samples.append((time.perf_counter(), *reading))

    @contextlib.contextmanager
    def sampling(self) -> Iterator[ClockTrace]:
        with _sampling_thread(self._sample, self._stop):
            yield self

    def within(self, windows: list[tuple[float, float]], outside: list[tuple[float, float]] = ()) -> dict | None:
        """Median SM clock (MHz) and power (W) and the count of the readings inside one of
        `windows` and none of `outside`, or None where there are none."""
        included, excluded = _merged(windows), _merged(outside)
        inside = [
            (mhz, watts) for at, mhz, watts in self.samples if _covered(at, included) and not _covered(at, excluded)
        ]
        if not inside:
            return None
        return {
            "sm_mhz": statistics.median(mhz for mhz, _ in inside),
            "power_w": statistics.median(watts for _, watts in inside),
            "readings": len(inside),
        }


def _merged(windows: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """`windows` sorted, the overlapping ones merged."""
    merged: list[tuple[float, float]] = []
    for a, b in sorted(windows):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(b, merged[-1][1]))
        else:
            merged.append((a, b))
    return merged


def _covered(at: float, merged: list[tuple[float, float]]) -> bool:
    """Whether `at` lies in one of the sorted, disjoint `merged` windows."""
    i = bisect.bisect_right(merged, (at, math.inf)) - 1
    return i >= 0 and merged[i][0] <= at <= merged[i][1]


class ClockSampler:
    """The GPU's SM clock (MHz) and board power (W), read through NVML every `interval_s` in a
    background thread and filed under the contender running at the time (`running`), so that two
    kernels' times can be set beside the clocks they ran at (one that draws more power may run at
    a lower clock). NVML's power is an average over its own window (about a second on Hopper), the
    clock a momentary reading. Where NVML cannot be read (no GPU, no nvidia-ml-py), nothing is
    sampled."""

    def __init__(self, interval_s: float = 0.002):
        self.interval_s = interval_s
        self.running: str | None = None
        self.samples: dict[str, list[tuple[float, float]]] = {}
        self._stop = threading.Event()

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            name, reading = self.running, clock_reading()
            if name is not None and reading is not None:
                self.samples.setdefault(name, []).append(reading)

    @contextlib.contextmanager
    def sampling(self) -> Iterator[ClockSampler]:
        with _sampling_thread(self._sample, self._stop):
            yield self

    def medians(self) -> dict[str, dict[str, float]]:
        """Per contender its median SM clock and power over the samples taken while it ran."""
        return {
            name: {
                "sm_mhz": statistics.median(mhz for mhz, _ in readings),
                "power_w": statistics.median(watts for _, watts in readings),
            }
            for name, readings in self.samples.items()
        }


def interleaved_ms(
    contenders: dict[str, tuple[Callable, list[tuple]]],
    rounds: int = 5,
    warmup: int = 3,
    repeats: int = 2,
    errors: dict[str, str] | None = None,
    clocks: dict[str, dict[str, float]] | None = None,
    clock_min_ms: float = 100.0,
) -> dict[str, float]:
    """Median GPU milliseconds per call of each contender (`name: (fn, argument tuples)`), the
    contenders taking turns: `warmup` untimed calls of each per argument tuple (compilation,
    autotuning), then `rounds` rounds, every other one in reverse order, in which each runs `repeats`
    times per argument tuple (`gpu_times_ms`). Timing them one after the other instead lets a drift
    of the GPU's clock over the run pass for a difference.

    With `errors`, a contender that raises (out of memory, say) leaves the turns with its
    `error_string` there and the others go on; without it, the exception propagates. With `clocks`,
    each contender's median SM clock and power over its timed rounds go there (`ClockSampler`;
    none where NVML cannot be read), for contenders timed for at least `clock_min_ms` in all: over
    shorter runs NVML's readings are those of the idle card between the calls (measured: the idle
    1,980 MHz and 121 W for both contenders of 0.8 ms calls on an H100)."""
    times: dict[str, list[float]] = {name: [] for name in contenders}
    sampler = ClockSampler()

    def run(name: str, warmup: int, repeats: int) -> None:
        fn, inputs = contenders[name]
        sampler.running = name if repeats else None
        try:
            times[name] += gpu_times_ms(fn, inputs, warmup, repeats)
        except Exception as exc:
            if errors is None:
                raise
            errors[name] = error_string(exc)
            del times[name]
        finally:
            sampler.running = None

    for name in contenders:
        run(name, warmup, repeats=0)
    with sampler.sampling() if clocks is not None else contextlib.nullcontext(sampler):
        for turn in range(rounds):
            order = [name for name in contenders if name in times]
            for name in order if turn % 2 == 0 else order[::-1]:
                run(name, warmup=1, repeats=repeats)
    if clocks is not None:
        readings = sampler.medians()
        clocks.update({name: readings[name] for name in times if name in readings and sum(times[name]) >= clock_min_ms})
    return {name: statistics.median(samples) for name, samples in times.items()}


def time_fn(fn: Callable[[], object], warmup: int = 3, repeats: int = 10, device: torch.device | str = "cpu") -> float:
    """Median seconds per call: CUDA events on a GPU (`gpu_times_ms`), perf_counter on the CPU."""
    if torch.device(device).type == "cuda":
        return statistics.median(gpu_times_ms(fn, [()], warmup, repeats)) / 1e3
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
