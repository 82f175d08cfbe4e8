"""How much of the backward's time the last wave wastes, predicted from the mask alone (no GPU).

    python tools/bwd_schedule.py --mask causal_document --seqlen 32768 --batch 1 --heads 16 --kv-heads 4
    python tools/bwd_schedule.py --train-batches 10     # the masks of scripts/train_e2e.py's H200 run

One CTA per SM (the backward's shared memory allows no second), each CTA taking `--fixed-us` plus
`--step-us` per query-tile step (its non-SKIP query tiles over its KV head's query heads, as the mask
role lists them); CTAs start in launch order on the first free SM. Prints the makespan over the ideal
(all SMs busy to the end) for the grid's order and for longest-first (`BwdConfig.longest_first`).
The defaults are the profiled build's medians at 8K (full mask): 2.5 us per step, ~1 us until K/V
land plus ~2.4 us of epilogue per CTA.
"""

from __future__ import annotations

import argparse
import heapq
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def makespan(durations: list[float], sms: int) -> float:
    """List scheduling: each CTA, in order, on the SM that frees first."""
    free = [0.0] * sms
    for duration in durations:
        heapq.heappush(free, heapq.heappop(free) + duration)
    return max(free)


def cta_steps(mask, batch: int, heads: int, kv_heads: int) -> torch.Tensor:
    """Steps per backward CTA in grid order, at the kernel's tile shape."""
    from flashmask3.optimized.flash_bwd_sm90 import FlashMaskBackwardSm90 as Kernel
    from flashmask3.optimized.tile_plan import backward_cta_steps

    return backward_cta_steps(mask, batch, heads, kv_heads, Kernel.tile_m, Kernel.tile_n)


def wasted(steps: torch.Tensor, sms: int, fixed_us: float, step_us: float) -> tuple[float, float]:
    """(grid order, longest first): the makespan over the ideal."""
    durations = (fixed_us + step_us * steps.double()).tolist()
    ideal = sum(durations) / sms
    return makespan(durations, sms) / ideal, makespan(sorted(durations, reverse=True), sms) / ideal


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mask", default="causal_document")
    parser.add_argument("--seqlen", type=int, default=32768)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--sms", type=int, default=132)
    parser.add_argument("--fixed-us", type=float, default=3.4)
    parser.add_argument("--step-us", type=float, default=2.5)
    parser.add_argument("--train-batches", type=int, default=0, help="use train_e2e's first N batches' masks")
    args = parser.parse_args()
    rows = []
    if args.train_batches:
        sys.path.insert(0, str(ROOT / "scripts"))
        import train_e2e
        from omegaconf import OmegaConf

        for name in ("causal_document", "share_question", "prefix_lm_document"):
            data = OmegaConf.merge(OmegaConf.load(ROOT / "conf" / "preset" / "h200.yaml").data, {"mask": name})
            for step in range(args.train_batches):
                mask = train_e2e.column_mask(name, train_e2e.make_batch(data, 32000, 0, step))
                rows.append(
                    (
                        name,
                        *wasted(cta_steps(mask, 1, args.heads, args.kv_heads), args.sms, args.fixed_us, args.step_us),
                    )
                )
    else:
        from flashmask3.reference import masks

        mask = masks.build(args.mask, args.seqlen, batch=args.batch, heads=args.heads, seed=0)
        steps = cta_steps(mask, args.batch, args.heads, args.kv_heads)
        rows.append((args.mask, *wasted(steps, args.sms, args.fixed_us, args.step_us)))
    for name in dict.fromkeys(r[0] for r in rows):
        grid, lpt = zip(*[(r[1], r[2]) for r in rows if r[0] == name])
        print(
            f"{name:20s} makespan / ideal: grid order median {statistics.median(grid):.3f} "
            f"({min(grid):.3f}-{max(grid):.3f}), longest first {statistics.median(lpt):.3f} "
            f"({min(lpt):.3f}-{max(lpt):.3f})"
        )


if __name__ == "__main__":
    main()
