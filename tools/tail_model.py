"""How much of a kernel's time its last wave wastes, predicted from the mask alone (no GPU).

    python tools/tail_model.py --mask causal_document --seqlen 32768 --batch 1 --heads 16 --kv-heads 4
    python tools/tail_model.py --train-batches 10             # scripts/train_e2e.py's H200 masks
    python tools/tail_model.py --forward --train-batches 10

Backward: one CTA per SM (its shared memory allows no second), each CTA taking `--fixed-us` plus
`--step-us` per query-tile step (its key tile's non-SKIP query tiles over its KV head's query
heads), CTAs starting in launch order on the first free SM. Forward (`--forward`): one persistent
CTA per SM drawing work tiles (a query tile of a head, one step per non-SKIP key tile) in the order
it draws them (causal: a head's query tiles last-first). Prints the makespan over the ideal (every
SM busy to the end) in the kernel's order and longest first (`BwdConfig.longest_ctas_first_waves`,
`FwdConfig.longest_tiles_first_waves`). Default costs: the backward's profiled build at 8K (2.5 us per
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


def makespan(durations: list[float], sms: int) -> float:
    """List scheduling: each unit of work, in order, on the SM that frees first."""
    free = [0.0] * sms
    for duration in durations:
        heapq.heappush(free, heapq.heappop(free) + duration)
    return max(free)


def wasted(steps: torch.Tensor, sms: int, fixed_us: float, step_us: float) -> tuple[float, float]:
    """(in the given order, longest first): the makespan over the ideal."""
    durations = (fixed_us + step_us * steps.double()).tolist()
    ideal = sum(durations) / sms
    return makespan(durations, sms) / ideal, makespan(sorted(durations, reverse=True), sms) / ideal


def work_steps(mask, batch: int, heads: int, kv_heads: int, head_dim: int, forward: bool) -> torch.Tensor:
    """Steps per unit of work in the order the kernel takes them (the forward on the sequence's
    tiles, as without the mask's segmented hint)."""
    from flashmask3.optimized.config import bwd_config, fwd_config
    from flashmask3.optimized.flash_bwd_sm90 import FlashMaskBackwardSm90 as Backward
    from flashmask3.optimized.tile_plan import backward_cta_steps, forward_tile_steps

    variant = (mask.causal, mask.startend_row_indices.shape[-1])
    if not forward:
        key_tile = bwd_config(head_dim, *variant).key_tile
        return backward_cta_steps(mask, batch, heads, kv_heads, Backward.tile_m, key_tile)
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
    args = parser.parse_args()
    fixed_us = args.fixed_us if args.fixed_us is not None else (2.0 if args.forward else 3.4)
    step_us = args.step_us if args.step_us is not None else (1.7 if args.forward else 2.5)
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
