"""How much of a kernel's time its last wave wastes, predicted from the mask alone (no GPU).

    python tools/tail_model.py --mask causal_document --seqlen 32768 --batch 1 --heads 16 --kv-heads 4
    python tools/tail_model.py --train-batches 10             # scripts/train_e2e.py's H200 masks
    python tools/tail_model.py --forward --train-batches 10
    python tools/tail_model.py --mask causal_document --orders   # the backward's orders side by side

Backward: one CTA per SM (its shared memory allows no second), each CTA taking `--fixed-us` plus
`--step-us` per query-tile step (its key tile's non-SKIP query tiles over its KV head's query
heads), CTAs starting in launch order on the first free SM. Forward (`--forward`): one persistent
CTA per SM drawing work tiles (a query tile of a head, one step per non-SKIP key tile) in the order
it draws them (causal: a head's query tiles last-first). Prints the makespan over the ideal (every
SM busy to the end) in the kernel's order and longest first (`BwdConfig.longest_ctas_first_waves`,
`FwdConfig.longest_tiles_first_waves`). `--orders` (backward): grid order, length classes
(`BwdConfig.longest_ctas_first_buckets`), the exact sort, each KV head's CTAs sorted (the heads in
grid order), the SM count's or three times its longest CTAs first, then grid order, and grid order
with the long CTAs split over parts of their query range, past a fixed step count or, as the split
backward plans (`tile_plan.split_parts`), past the ideal makespan (none of these four is a kernel
option), each with the mean number of (KV head, 64-row query tile) pairs that the CTAs running at a
time read, an L2 footprint proxy (each pair is 256 KB of Q, dO and dQ accumulator at head dim 128
with four query heads per KV head). Default costs: the backward's profiled build at 8K (2.5 us per
step, ~1 us until K/V land plus ~2.4 us of epilogue per CTA); the forward's per-tile fit (1.7 us per
key tile, 2 us per work tile).
"""

from __future__ import annotations

import argparse
import heapq
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def schedule(durations: list[float], sms: int) -> list[tuple[float, float]]:
    """List scheduling: each unit of work, in order, on the SM that frees first; each unit's
    (start, end)."""
    free = [0.0] * sms
    spans = []
    for duration in durations:
        start = heapq.heappop(free)
        spans.append((start, start + duration))
        heapq.heappush(free, start + duration)
    return spans


def makespan(durations: list[float], sms: int) -> float:
    """When the last unit of `schedule` ends."""
    return max(end for _, end in schedule(durations, sms))


def footprint(spans: list[tuple[float, float]], reads: list[set], samples: int = 200) -> float:
    """The mean size of the union of `reads` (one set per unit) over the units running at
    `samples` - 1 evenly spaced times strictly inside the schedule."""
    end = max(stop for _, stop in spans)
    sizes = []
    for i in range(1, samples):
        now = end * i / samples
        sizes.append(len(set().union(*(r for (start, stop), r in zip(spans, reads) if start <= now < stop))))
    return statistics.mean(sizes)


def backward_orders(
    mask, batch: int, heads: int, kv_heads: int, head_dim: int, sms: int, fixed_us: float, step_us: float
) -> None:
    """Print each backward order's makespan over the ideal and its mean footprint (`--orders`). The
    pairs a CTA reads are its key tile's query tiles under the mask's first head (every benchmark
    mask but random eviction has one)."""
    from flashmask3.optimized.config import bwd_config
    from flashmask3.optimized.tile_plan import backward_cta_steps, longest_first

    config = bwd_config(head_dim, mask.causal, mask.startend_row_indices.shape[-1])
    tile_m, tile_n = config.query_tile, config.key_tile
    steps = backward_cta_steps(mask, batch, heads, kv_heads, tile_m, tile_n)
    seen = ~mask.block_skip(tile_m, tile_n)  # [Bm, Hm, Tm, Tn]
    tiles_n = seen.shape[-1]
    reads = [
        {(b, h, m) for m in seen[b % seen.shape[0], 0, :, n].nonzero().flatten().tolist()}
        for b in range(batch)
        for h in range(kv_heads)
        for n in range(tiles_n)
    ]
    durations = (fixed_us + step_us * steps.double()).tolist()
    ideal = sum(durations) / sms
    orders = {"grid order": list(range(len(durations)))}
    orders |= {f"{c} length classes": longest_first(steps, c).tolist() for c in (2, 4, 8, 16)}
    orders["exact sort"] = longest_first(steps).tolist()
    # Head-local: each KV head's CTAs longest first, the heads in grid order.
    orders["per-head sort"] = [
        head * tiles_n + i
        for head in range(batch * kv_heads)
        for i in longest_first(steps.view(-1, tiles_n)[head]).tolist()
    ]
    for k in (sms, 3 * sms):  # the k longest first, then the rest in grid order
        first = orders["exact sort"][:k]
        orders[f"{k} longest, grid"] = first + sorted(set(range(len(durations))) - set(first))
    runs = {name: [(i, durations[i]) for i in order] for name, order in orders.items()}
    for over in (128, 64):  # not a kernel option: long CTAs split by query range, in grid order
        runs[f"split > {over} steps"] = split_long(steps.tolist(), over, fixed_us, step_us)
    runs["split fluid"] = split_fluid(steps, sms, fixed_us, step_us)
    for name, units in runs.items():
        spans = schedule([duration for _, duration in units], sms)
        pairs = footprint(spans, [reads[i] for i, _ in units])
        print(f"{name:18s} makespan / ideal {max(stop for _, stop in spans) / ideal:.3f}, footprint {pairs:.0f}")


def split_units(steps: list[int], parts: list[int], fixed_us: float, step_us: float, reduce_us: float = 1.0):
    """(CTA, duration) units in grid order, a CTA split into its `parts` CTAs over parts of its
    query range, each of a split CTA paying `fixed_us` plus `reduce_us` for adding its partial dK
    and dV into fp32 accumulators."""
    units = []
    for cta, (count, split) in enumerate(zip(steps, parts)):
        duration = fixed_us + (reduce_us if split > 1 else 0.0) + step_us * count / split
        units += [(cta, duration)] * split
    return units


def split_long(steps: list[int], over: int, fixed_us: float, step_us: float, reduce_us: float = 1.0):
    """`split_units` with a CTA of more than `over` steps split into 2 (more than 2 `over`: 4)."""
    parts = [4 if count > 2 * over else 2 if count > over else 1 for count in steps]
    return split_units(steps, parts, fixed_us, step_us, reduce_us)


def split_fluid(steps: torch.Tensor, sms: int, fixed_us: float, step_us: float, slack_pct: int = 2):
    """`split_units` with the parts the split backward's plan takes (`tile_plan.split_parts`, with
    `bwd_config`'s parts at head dim 128 and `SPLIT_CTA_SLOTS_PER_SM`): the CTAs that would end
    past the ideal makespan split."""
    from flashmask3.optimized.config import SPLIT_CTA_SLOTS_PER_SM, bwd_config
    from flashmask3.optimized.tile_plan import split_parts

    max_parts = bwd_config(128, True, 1).split_ctas_max_parts
    parts = split_parts(steps, sms, max_parts, slack_pct, SPLIT_CTA_SLOTS_PER_SM * sms)
    return split_units(steps.tolist(), parts.tolist(), fixed_us, step_us)


def wasted(steps: torch.Tensor, sms: int, fixed_us: float, step_us: float) -> tuple[float, float]:
    """(in the given order, longest first): the makespan over the ideal."""
    durations = (fixed_us + step_us * steps.double()).tolist()
    ideal = sum(durations) / sms
    return makespan(durations, sms) / ideal, makespan(sorted(durations, reverse=True), sms) / ideal


def work_steps(mask, batch: int, heads: int, kv_heads: int, head_dim: int, forward: bool) -> torch.Tensor:
    """Steps per unit of work in the order the kernel takes them (the forward on the sequence's
    tiles, as without the mask's segmented hint)."""
    from flashmask3.optimized.config import bwd_config, fwd_config
    from flashmask3.optimized.tile_plan import backward_cta_steps, forward_tile_steps

    variant = (mask.causal, mask.startend_row_indices.shape[-1])
    if not forward:
        backward = bwd_config(head_dim, *variant)
        return backward_cta_steps(mask, batch, heads, kv_heads, backward.query_tile, backward.key_tile)
    config = fwd_config(head_dim, *variant)
    tile_m = config.tile_m
    steps = forward_tile_steps(mask, batch, heads, tile_m, config.tile_n)
    return steps.view(-1, -(-mask.seqlen_q // tile_m)).flip(1).flatten() if mask.causal else steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mask", default="causal_document")
    parser.add_argument("--seqlen", type=int, default=32768)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=128, choices=(64, 128, 192, 256))
    parser.add_argument("--sms", type=int, default=132)
    parser.add_argument("--forward", action="store_true", help="the forward's work tiles, not the backward's CTAs")
    parser.add_argument("--fixed-us", type=float, help="per CTA (backward, default 3.4) or work tile (forward, 2)")
    parser.add_argument("--step-us", type=float, help="per step (backward, default 2.5; forward 1.7)")
    parser.add_argument("--train-batches", type=int, default=0, help="use train_e2e's first N batches' masks")
    parser.add_argument(
        "--orders",
        action="store_true",
        help="the backward's orders with their L2 footprint (--mask, not --train-batches)",
    )
    args = parser.parse_args()
    fixed_us = args.fixed_us if args.fixed_us is not None else (2.0 if args.forward else 3.4)
    step_us = args.step_us if args.step_us is not None else (1.7 if args.forward else 2.5)
    if args.orders:
        if args.forward or args.train_batches:
            parser.error("--orders takes the backward of one --mask: not with --forward or --train-batches")
        from flashmask3.reference import masks

        mask = masks.build(args.mask, args.seqlen, batch=args.batch, heads=args.heads, seed=0)
        backward_orders(mask, args.batch, args.heads, args.kv_heads, args.head_dim, args.sms, fixed_us, step_us)
        return
    rows = []
    if args.train_batches:
        sys.path.insert(0, str(ROOT / "scripts"))
        import train_e2e
        from omegaconf import OmegaConf

        for name in ("causal_document", "share_question", "prefix_lm_document"):
            data = OmegaConf.merge(OmegaConf.load(ROOT / "conf" / "preset" / "h200.yaml").data, {"mask": name})
            for step in range(args.train_batches):
                mask = train_e2e.column_mask(name, train_e2e.make_batch(data, 32000, 0, step))
                steps = work_steps(mask, 1, args.heads, args.kv_heads, args.head_dim, args.forward)
                rows.append((name, *wasted(steps, args.sms, fixed_us, step_us)))
    else:
        from flashmask3.reference import masks

        mask = masks.build(args.mask, args.seqlen, batch=args.batch, heads=args.heads, seed=0)
        steps = work_steps(mask, args.batch, args.heads, args.kv_heads, args.head_dim, args.forward)
        rows.append((args.mask, *wasted(steps, args.sms, fixed_us, step_us)))
    for name in dict.fromkeys(r[0] for r in rows):
        ordered, lpt = zip(*[(r[1], r[2]) for r in rows if r[0] == name])
        print(
            f"{name:20s} makespan / ideal: kernel order median {statistics.median(ordered):.3f} "
            f"({min(ordered):.3f}-{max(ordered):.3f}), longest first {statistics.median(lpt):.3f} "
            f"({min(lpt):.3f}-{max(lpt):.3f})"
        )


if __name__ == "__main__":
    main()
