"""Where the kernels' time goes, per CTA: the timeline builds' event stamps, summarized (and drawn).

    python scripts/timeline.py --mask sliding_window --seqlen 8192 [--kernel persistent=false] [--peer fa4]
    python scripts/timeline.py --backward --mask full --seqlen 8192 [--kernel q_stages=2] [--peer fa4]

Runs the forward once at 128K tokens (B = 128K/S, H = 4096/D, bf16) in the build that stamps each
role's events (`optimized/timeline.py`), in the configuration chosen for the mask (on the
document masks at head dim 128, segment-aligned tiles; `--kernel segment_tiles=false` for the
sequence's), then per work tile: the consumers' wait before it (from
the previous tile's store to this tile's first turn, or from the kernel's start), its main loop per
key tile (and, fitted over the work tiles, its cost per key tile and per work tile), its
epilogue, and how long Q took from issue to landing; per CTA the idle tail (the kernel's last
store minus the CTA's). Writes the summary as JSON and a picture of the first CTAs'
tiles over time to $OUT (or runs/); prints the summary last.

`--backward`: the forward as usual, then the backward's main kernel in its profiled build: per CTA
the time until K and V land, its steps and its epilogue, and the SM cycles consumer thread 0 spent
in each segment of its query-tile steps (`BwdEvent`: waiting for Q, for S, the softmax, waiting
for dP, dS, the barrier between the warpgroups, waiting for dQ, the dQ add, waiting for dK, reading
the next query tile's list entry), as
medians over CTAs per step and as shares of the step. The profiled build reads the clock at every
segment (a few % slower); compare segments, not its total, with the default build.

`--peer fa4`: FA4's own path for the mask, as the benchmarks run it (causal, window_size, or varlen
over the documents), on the same inputs, in a build that stamps the same events per CTA
(`flashmask3/fa4_timeline.py`). FA4 runs one CTA per work tile, so its CTAs are taken per SM in the
order they ran. Summarized under "fa4" in the same terms (forward: the wait before each work
tile's loop, split into the launch gap and the CTA's setup, the loop per key tile, also scaled to
a 128 x 128 tile, the epilogue; backward: the consumers' time per step from their start, scaled to
a 64 x 128 step, the setup, steps and epilogue; the outputs' or gradients' largest differences
from ours), and the forward is drawn below ours. Then each kernel's steps cut into segments by SM
clock marks, from profiled builds (ours: `forward(..., turn_profile=...)`'s segments of the
steady-state turns, or the backward's profiled segments above; FA4: marks at the step's entry,
after each synchronization it calls, before each wait for all WGMMA groups, at its exit, in the
first 1,024 CTAs of its grid).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from flashmask3.optimized.timeline import STEP_SEGMENTS, TURN_SEGMENTS, BwdEvent, Event, TurnEvent
from flashmask3.reference import masks
from flashmask3.verify import random_inputs

from flashmask3 import bench_peers, fa4_timeline
from flashmask3.bench import git_commit, results_dir

EVENTS = tuple(e.name.lower() for e in Event)
SEGMENTS = tuple(e.name.lower() for e in STEP_SEGMENTS)


def work_tiles_of(stamps: torch.Tensor) -> list[list[dict]]:
    """Per CTA, its recorded work tiles in order as {event: value}, times in us from the kernel's first
    stamp. `stamps`: int64 [CTAs, work tiles, events], -1 where nothing was recorded."""
    times = stamps[..., 1:8]
    start = times[times >= 0].min()
    per_cta = []
    for cta in stamps.tolist():
        tiles = []
        for row in cta:
            if row[0] < 0:
                break
            tile = {name: (value - start.item()) / 1e3 for name, value in zip(EVENTS[1:8], row[1:8])}
            tile.update(work_tile=row[0], key_tiles=row[8])
            tiles.append(tile)
        per_cta.append(tiles)
    return per_cta


def summarize(per_cta: list[list[dict]], rows: str = "ctas") -> dict:
    """Medians over work tiles (us) and the rows' idle tails: each row a CTA of ours, or an SM of
    FA4's (`rows` names them). The wait before a work tile runs from the row's previous stores (or
    the kernel's first stamp) to the tile's loop start; where the tiles have a `start` (FA4's CTAs:
    the consumers' start) it splits into the launch gap and the setup; where they have Q's issue
    and landing (ours), Q's latency. The loop's time over the work tiles' key tile counts, fitted by
    least squares, splits into a cost per key tile and one per work tile (the pipeline's fill and
    drain, the turns that overlap nothing)."""
    waits, epilogues, q_latency, gaps, setups, tails = [], [], [], [], [], []
    loops: list[tuple[int, float]] = []  # (key tiles, loop us) of the work tiles with key tiles
    end = max(tiles[-1]["stored"] for tiles in per_cta if tiles)
    for tiles in per_cta:
        previous_store = 0.0
        for tile in tiles:
            waits.append(tile["loop_start"] - previous_store)
            if "start" in tile:
                gaps.append(tile["start"] - previous_store)
                setups.append(tile["loop_start"] - tile["start"])
            if tile["key_tiles"] > 0:
                loops.append((tile["key_tiles"], tile["loop_end"] - tile["loop_start"]))
            epilogues.append(tile["stored"] - tile["loop_end"])
            if "q_issued" in tile:
                q_latency.append(tile["q_landed"] - tile["q_issued"])
            previous_store = tile["stored"]
        if tiles:
            tails.append(end - tiles[-1]["stored"])
    summary = {
        rows: len(per_cta),
        "work_tiles": sum(len(t) for t in per_cta),
        "kernel_us": end,
        "median_wait_before_tile_us": statistics.median(waits),
        "mean_wait_before_tile_us": statistics.fmean(waits),
        "median_loop_per_key_tile_us": fa4_timeline.median_or_nan(loop / n for n, loop in loops),
        **loop_fit(loops),
        "median_epilogue_us": statistics.median(epilogues),
        "mean_idle_tail_us": statistics.fmean(tails),
        "max_idle_tail_us": max(tails),
    }
    if gaps:
        summary.update(median_launch_gap_us=statistics.median(gaps), median_setup_us=statistics.median(setups))
    if q_latency:
        summary["median_q_issue_to_landed_us"] = statistics.median(q_latency)
    return summary


def loop_fit(loops: list[tuple[int, float]]) -> dict:
    """The least-squares line through (key tiles, loop us) of the work tiles: its slope (us per key
    tile) and intercept (us per work tile); NaN where the tiles have fewer than two key tile counts."""
    if len({key_tiles for key_tiles, _ in loops}) < 2:
        return {"fit_loop_per_key_tile_us": math.nan, "fit_loop_per_work_tile_us": math.nan}
    slope, intercept = statistics.linear_regression(*zip(*loops))
    return {"fit_loop_per_key_tile_us": slope, "fit_loop_per_work_tile_us": intercept}


def summarize_backward(stamps: torch.Tensor, sm_count: int) -> dict:
    """Medians over the backward's CTAs, and how full the SMs were. `stamps`: int64 [CTAs,
    len(BwdEvent)]: start, K/V landed, loop end, stored (ns), the step count, then cycles per step
    segment. `sm_busy_share`: the CTAs' summed lifetimes over `sm_count` x the kernel's span (one CTA
    per SM fits), so 1 - it is the SM time lost to the last wave and to launch gaps."""
    rows = [row for row in stamps.tolist() if row[4] > 0]
    everyone = [row for row in stamps.tolist() if row[3] > 0]
    span_ns = max(row[3] for row in everyone) - min(row[0] for row in everyone)
    lifetimes_ns = sum(row[3] - row[0] for row in everyone)
    per_step = {name: [row[5 + i] / row[4] for row in rows] for i, name in enumerate(SEGMENTS)}
    step_cycles = [sum(row[5:]) / row[4] for row in rows]
    medians = {name: statistics.median(values) for name, values in per_step.items()}
    total = sum(medians.values())
    return {
        "ctas": len(stamps),
        "ctas_with_steps": len(rows),
        "median_steps": statistics.median(row[4] for row in rows),
        "kernel_us": span_ns / 1e3,
        "sm_busy_share": round(lifetimes_ns / (sm_count * span_ns), 4),
        "mean_step_us": sum(row[2] - row[1] for row in rows) / 1e3 / sum(row[4] for row in rows),
        "mean_step_from_start_us": sum(row[2] - row[0] for row in rows) / 1e3 / sum(row[4] for row in rows),
        "mean_cta_overhead_us": statistics.fmean((row[1] - row[0] + row[3] - row[2]) / 1e3 for row in rows),
        "median_kv_wait_us": statistics.median((row[1] - row[0]) / 1e3 for row in rows),
        "median_step_us": statistics.median((row[2] - row[1]) / 1e3 / row[4] for row in rows),
        "median_epilogue_us": statistics.median((row[3] - row[2]) / 1e3 for row in rows),
        "median_step_cycles": statistics.median(step_cycles),
        "segment_cycles_per_step": {name: round(value, 1) for name, value in medians.items()},
        "segment_share": {name: round(value / total, 4) for name, value in medians.items()},
    }


def draw(panels: list[tuple[str, list[list[dict]]]], path: Path, ctas: int, until_us: float, title: str) -> None:
    """A panel per (label, work tiles per CTA or per SM), a row per CTA or SM: the consumers' wait
    (grey), main loop (blue) and epilogue (orange) per work tile."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(panels), 1, figsize=(12, len(panels) * (0.35 * ctas + 1.2)), squeeze=False)
    for (label, per_cta), ax in zip(panels, axes[:, 0]):
        _draw_panel(ax, per_cta, ctas, until_us)
        ax.set_ylabel(label)
    axes[0, 0].set_title(title + " (grey: waiting for the tile; blue: main loop; orange: epilogue)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _draw_panel(ax, per_cta: list[list[dict]], ctas: int, until_us: float) -> None:
    for row, tiles in enumerate(per_cta[:ctas]):
        previous_store = 0.0
        for tile in tiles:
            if previous_store > until_us:
                break
            for begin, finish, color in (
                (previous_store, tile["loop_start"], "0.8"),
                (tile["loop_start"], tile["loop_end"], "tab:blue"),
                (tile["loop_end"], tile["stored"], "tab:orange"),
            ):
                ax.barh(row, max(finish - begin, 0.0), left=begin, height=0.7, color=color, linewidth=0)
            previous_store = tile["stored"]
    ax.set_xlim(0, until_us)
    ax.set_xlabel("us since the kernel's first event")


MARKED_CTAS = 1024
"""FA4 CTAs whose steps are marked: the first in its grid order (a few heads' whole range of tiles)."""


def with_step_shape(summary: dict, rows: int, keys: int) -> None:
    """Add a backward summary's step shape (query rows x keys) and its time per step from the
    consumers' start scaled to a 64 x 128 step, so kernels with other step shapes compare."""
    summary["step_shape"] = [rows, keys]
    summary["mean_us_per_64x128_step_from_start"] = summary["mean_step_from_start_us"] * 64 * 128 / (rows * keys)


def with_tile_shape(summary: dict, rows: int, keys: int) -> None:
    """Add a forward summary's work tile shape (query rows x keys per key tile) and its loop time
    per key tile scaled to a 128 x 128 tile, so kernels with other tile shapes compare."""
    summary["tile_shape"] = [rows, keys]
    summary["median_loop_per_128x128_key_tile_us"] = summary["median_loop_per_key_tile_us"] * 128 * 128 / (rows * keys)


def summarize_turns(profile: torch.Tensor) -> dict:
    """Our forward's turn profile (`TurnEvent` rows per CTA): medians over CTAs of the cycles per
    steady-state turn, per segment and in all (NaN where no CTA had a steady-state turn)."""
    rows = [row for row in profile.tolist() if row[TurnEvent.TURNS] > 0]
    median = fa4_timeline.median_or_nan

    def per_turn(row: list[int], events) -> float:
        return sum(row[event] for event in events) / row[TurnEvent.TURNS]

    return {
        "profiled_ctas": len(rows),
        "median_turn_cycles": median(per_turn(row, TURN_SEGMENTS) for row in rows),
        "segment_cycles_per_turn": {
            event.name.lower(): round(median(per_turn(row, [event]) for row in rows), 1) for event in TURN_SEGMENTS
        },
    }


def fa4_blocks(case: bench_peers.PeerCase) -> int:
    """An upper bound on FA4's tiles or steps per sequence for `case`: they have 64 rows or more."""
    return -(-max(case.mask.seqlen_q, case.mask.seqlen_k) // 64)


def fa4_grid_bound(case: bench_peers.PeerCase) -> int:
    """Above FA4's grid for `case`, forward or backward: a CTA per 64 rows (its smallest tile) of
    each sequence or document, and one more per document, per query head."""
    pieces = case.batch
    if case.mask_name in ("causal_document", "document"):
        pieces = len(bench_peers.document_cu_seqlens(case.mask, case.batch)[0]) - 1
    return case.heads * (case.batch * fa4_blocks(case) + pieces)


def fa4_stamped(case, run_once: Callable, kind: str, marked: bool) -> tuple[object, torch.Tensor, dict | None]:
    """`run_once()` (FA4's forward or backward, `kind`) with FA4 stamped (compile, warm-up, then the
    recorded run): its result, the stamps on the CPU and, if `marked`, the steps' segments
    (`fa4_timeline.step_segments`, from a build with clock marks in the step: time the loop from a
    run without)."""
    stamps = fa4_timeline.stamp_rows(fa4_grid_bound(case))
    marks = fa4_timeline.step_mark_rows(MARKED_CTAS, fa4_blocks(case)) if marked else None
    with fa4_timeline.stamped_fa4(stamps, marks) as labels:
        for _ in range(3):
            stamps.fill_(-1)
            if marks is not None:
                marks.zero_()
            result = run_once()
        torch.cuda.synchronize()
    segments = fa4_timeline.step_segments(marks.cpu(), labels[kind]) if marks is not None else None
    return result, stamps.cpu(), segments


def fa4_forward(case, q, k, v, marked: bool) -> tuple[torch.Tensor, torch.Tensor, dict | None]:
    """FA4's own forward for `case`, stamped (`fa4_stamped`): its output, stamps and segments."""
    run = bench_peers.PEERS["fa4"](case)
    return fa4_stamped(case, lambda: run(q, k, v), "forward", marked)


def fa4_backward(case, q, k, v, dout, marked: bool) -> tuple[tuple[torch.Tensor, ...], torch.Tensor, dict | None]:
    """FA4's own backward for `case` (its forward unstamped), stamped (`fa4_stamped`): its
    gradients, stamps and segments."""
    run = bench_peers.PEERS["fa4"](case)
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    out = run(q, k, v)
    return fa4_stamped(case, lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True), "backward", marked)


def main() -> None:
    from bench_fwd import kernel_overrides
    from flashmask3.optimized.interface import (
        backward,
        backward_ctas,
        forward,
        forward_ctas,
        mask_configs,
    )

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mask", default="sliding_window", choices=masks.MASK_NAMES)
    parser.add_argument("--seqlen", type=int, default=8192)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--head-dim-v", type=int, help="V's head dim where it differs from q/k's (192/128: MLA)")
    parser.add_argument("--batch", type=int, help="default: 128K tokens per run, i.e. 128K / seqlen")
    parser.add_argument("--heads", type=int, help="query heads; default 4096 / head dim")
    parser.add_argument("--kv-heads", type=int, help="K/V heads, a divisor of the query heads; default as many")
    parser.add_argument("--ctas-shown", type=int, default=12)
    parser.add_argument("--until-us", type=float, default=200.0)
    parser.add_argument("--kernel", action="append", default=[], metavar="FIELD=VALUE", help="config change")
    parser.add_argument("--backward", action="store_true", help="profile the backward's main kernel instead")
    parser.add_argument("--peer", choices=["fa4"], help="also FA4's own path for the mask, stamped the same way")
    args = parser.parse_args()
    if args.peer == "fa4" and args.mask not in bench_peers.FA4_NATIVE_MASKS:
        native = ", ".join(bench_peers.FA4_NATIVE_MASKS)
        parser.error(f"--peer fa4 runs FA4's own API, which has a path for {native}; got --mask {args.mask}")
    heads = args.heads or 4096 // args.head_dim
    batch = args.batch or max(1, 131072 // args.seqlen)
    kv_heads = args.kv_heads or heads
    head_dim_v = args.head_dim_v or args.head_dim
    if heads % kv_heads:
        parser.error(f"--kv-heads must divide the query heads ({heads}), got {kv_heads}")
    built = masks.build(args.mask, args.seqlen, batch=batch, heads=heads, seed=0, device="cuda")
    mask = None if args.mask == "full" else built  # no mask for "full", as unmasked attention is called
    q, k, v, dout = random_inputs(
        batch, args.seqlen, args.seqlen, heads, kv_heads, args.head_dim, torch.bfloat16, "cuda", head_dim_v=head_dim_v
    )
    scale = 1 / math.sqrt(args.head_dim)
    config, bwd = mask_configs(args.head_dim, mask, kernel_overrides(args.kernel))
    out_dir = results_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    kind = "timeline_bwd" if args.backward else "timeline"
    dims = (
        ""
        if (args.head_dim, head_dim_v) == (128, 128)
        else f"_d{args.head_dim}" + (f"v{head_dim_v}" if head_dim_v != args.head_dim else "")
    )
    name = f"{kind}_{args.mask}_{args.seqlen}{dims}_b{batch}_h{heads}_kv{kv_heads}" + "".join(
        f"_{o}" for o in args.kernel
    )
    name += f"_{args.peer}" if args.peer else ""
    case = bench_peers.PeerCase(args.mask, built, batch, heads, scale)
    if args.backward:
        out, lse = forward(q, k, v, mask, scale, config=config)
        stamps = torch.zeros(backward_ctas(k, bwd), len(BwdEvent), dtype=torch.int64, device="cuda")
        for _ in range(3):  # compile, warm up, then the recorded run
            stamps.zero_()
            backward(dout, q, k, v, out, lse, mask, scale, config=bwd, timeline=stamps)
        torch.cuda.synchronize()
        sm_count = torch.cuda.get_device_properties(q.device).multi_processor_count
        measured = {"bwd_config": dataclasses.asdict(bwd), **summarize_backward(stamps.cpu(), sm_count)}
        with_step_shape(measured, bwd.query_tile, bwd.key_tile)
        if args.peer:
            from flash_attn.cute.interface import _tile_size_bwd_sm90

            ours = backward(dout, q, k, v, out, lse, mask, scale, config=bwd)
            grads, fa4_stamps, _ = fa4_backward(case, q, k, v, dout, marked=False)
            _, _, fa4_segments = fa4_backward(case, q, k, v, dout, marked=True)
            differences = {
                f"max_diff_d{tensor}": bench_peers.max_abs_diff(mine, theirs)
                for tensor, mine, theirs in zip("qkv", ours, grads)
            }
            measured["fa4"] = {**differences, **fa4_timeline.summarize_backward(fa4_stamps, sm_count), **fa4_segments}
            fa4_config = _tile_size_bwd_sm90(args.head_dim, head_dim_v, built.causal, args.mask == "sliding_window")
            with_step_shape(measured["fa4"], fa4_config.m_block_size, fa4_config.n_block_size)
    else:
        ctas = forward_ctas(q, config)
        per_cta_tiles = 4 * -(-batch * heads * args.seqlen // (128 * ctas)) + 16
        stamps = torch.full((ctas, per_cta_tiles, len(EVENTS)), -1, dtype=torch.int64, device="cuda")
        for _ in range(3):  # compile, warm up, then the recorded run
            stamps.fill_(-1)
            forward(q, k, v, mask, scale, timeline=stamps, config=config)
        torch.cuda.synchronize()
        per_cta = work_tiles_of(stamps.cpu())
        measured = {"fwd_config": dataclasses.asdict(config), **summarize(per_cta)}
        with_tile_shape(measured, config.tile_m, config.tile_n)
        panels = [("ours: CTA", per_cta)]
        if args.peer:
            from flash_attn.cute.interface import _tile_size_fwd_sm90

            ours = forward(q, k, v, mask, scale, config=config)[0]
            if config.tile_m == 128:  # the profiled build spills at 192-row tiles (causal)
                profile = torch.zeros(ctas, len(TurnEvent), dtype=torch.int64, device="cuda")
                for _ in range(3):  # compile, warm up, then the recorded run
                    profile.zero_()
                    forward(q, k, v, mask, scale, config=config, turn_profile=profile)
                measured.update(summarize_turns(profile.cpu()))
            fa4_out, fa4_stamps, _ = fa4_forward(case, q, k, v, marked=False)
            _, _, fa4_segments = fa4_forward(case, q, k, v, marked=True)
            fa4_per_sm = fa4_timeline.per_sm_work_tiles(fa4_stamps)
            measured["fa4"] = {
                "max_diff": bench_peers.max_abs_diff(ours, fa4_out),
                **summarize(fa4_per_sm, rows="sms"),
                **fa4_segments,
            }
            fa4_config = _tile_size_fwd_sm90(args.head_dim, head_dim_v, built.causal, args.mask == "sliding_window")
            with_tile_shape(measured["fa4"], fa4_config.m_block_size, fa4_config.n_block_size)
            panels.append(("FA4: SM", fa4_per_sm))
        draw(panels, out_dir / f"{name}.png", args.ctas_shown, args.until_us, f"{args.mask}, S = {args.seqlen}")
    summary = {
        "commit": git_commit(),
        "command": " ".join(["scripts/timeline.py", *sys.argv[1:]]),
        "gpu": torch.cuda.get_device_name(),
        "mask": args.mask,
        "seqlen": args.seqlen,
        "head_dim": args.head_dim,
        "head_dim_v": head_dim_v,
        "batch": batch,
        "heads": heads,
        "kv_heads": kv_heads,
        **measured,
    }
    (out_dir / f"{name}.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
