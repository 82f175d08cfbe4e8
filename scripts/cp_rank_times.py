"""Per-rank compute of mask-aware CP, emulated rank by rank on one GPU (no communication).

    python scripts/cp_rank_times.py --ranks 4,8 --masks causal,causal_document,document,share_question
    python scripts/cp_rank_times.py --ranks 4,8,16,32 --backward   # the backward call too

For each mask, CP size R and assignment (zigzag, balanced), every rank's local attention (its
queries against every KV chunk it needs, localized masks, LSE merge) runs in turn on the one GPU
and is timed with CUDA events; the spread max/mean of the rank times is the load imbalance a real
run would see. With `--backward`, also each rank's backward call over the same chunks (from the
merged out and LSE, as CP's backward makes it): `rank_bwd_ms`, which scripts/cp_calibrate.py fits
as the forward's. 8K tokens per rank, hidden 4096 (32 query heads x 128, 8 kv heads), bf16.
Writes JSON to $OUT (or runs/) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import torch
from flashmask3.distributed import CPConfig, chunk_loads, imbalance, make_plan
from flashmask3.distributed.context_parallel import CPStats, _Layout, _LocalAttention
from flashmask3.reference import masks

from flashmask3.bench import git_commit, progress, result_json, results_dir

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128


def median_seconds(call, repeats: int) -> float:
    """Median seconds of `call()` over `repeats` runs after one warm-up (compiles on first use)."""
    call()
    times = []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / 1e3)
    return sorted(times)[len(times) // 2]


def rank_seconds(q, held, layout, rank, backend, scale, repeats: int, backward: bool) -> tuple[float, float | None]:
    """Median seconds of one rank's local attention over all the chunks it needs, forward and (if
    `backward`) backward."""
    attn = _LocalAttention(layout, rank, backend, scale, CPStats())
    forward_s = median_seconds(lambda: attn.forward(q, held, None, "compute"), repeats)
    if not backward:
        return forward_s, None
    out, lse = attn.finish(attn.forward(q, held, None, "compute"), q)
    out = out.to(q.dtype)
    dout = torch.randn_like(out)
    backward_s = median_seconds(lambda: attn.backward(dout, q, out, lse, held, {}, None, "compute"), repeats)
    return forward_s, backward_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", default="4,8")
    parser.add_argument("--tokens-per-rank", type=int, default=8192)
    parser.add_argument("--chunk", type=int, default=2048)
    parser.add_argument("--masks", default="causal,causal_document,document,share_question")
    parser.add_argument("--backend", default="cute")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--backward", action="store_true", help="time each rank's backward call too")
    args = parser.parse_args()
    device = "cuda"
    scale = 1 / math.sqrt(HEAD_DIM)
    rows = []
    for world in (int(r) for r in args.ranks.split(",")):
        seqlen = world * args.tokens_per_rank
        per_rank = args.tokens_per_rank // args.chunk
        gen = torch.Generator(device=device).manual_seed(0)
        q_all = torch.randn(1, seqlen, HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16, generator=gen)
        kv_all = torch.randn(2, 1, seqlen, KV_HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16, generator=gen)
        for name in progress(args.masks.split(","), f"CP {world}"):
            mask = masks.build(name, seqlen, seed=0, device=device)
            loads = chunk_loads(mask, args.chunk)
            for assignment in ("zigzag", "balanced"):
                plan = make_plan(seqlen, world, per_rank, assignment, loads)
                start = time.perf_counter()
                layout = _Layout(mask, plan, CPConfig(backend=args.backend))
                layout_s = time.perf_counter() - start
                times, backward_times = [], []
                for rank in range(world):
                    q = plan.shard(q_all, rank)
                    held = {
                        c: kv_all[:, :, c * args.chunk : (c + 1) * args.chunk]
                        for c in range(plan.num_chunks)
                        if layout.needs[rank][c]
                    }
                    forward_s, backward_s = rank_seconds(
                        q, held, layout, rank, args.backend, scale, args.repeats, args.backward
                    )
                    times.append(forward_s)
                    backward_times.append(backward_s)
                mean = sum(times) / world
                row = {
                    "mask": name,
                    "ranks": world,
                    "assignment": assignment,
                    "rank_ms": [t * 1e3 for t in times],
                    "measured_imbalance": max(times) / mean,
                    "modeled_imbalance": imbalance(loads, plan.assignment),
                    "layout_s": layout_s,
                }
                if args.backward:
                    row["rank_bwd_ms"] = [t * 1e3 for t in backward_times]
                    row["measured_bwd_imbalance"] = max(backward_times) * world / sum(backward_times)
                rows.append(row)
                print(json.dumps(row), flush=True)
    out_dir = results_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    result = {
        "commit": git_commit(),
        "command": " ".join(["python", *sys.argv]),
        "gpu": torch.cuda.get_device_name(),
        "rows": rows,
    }
    (out_dir / "cp_rank_times.json").write_text(result_json(result))
    print(f"{'mask':20s} {'R':>3s} {'assignment':>10s} {'max ms':>8s} {'mean ms':>8s} {'measured':>8s} {'modeled':>8s}")
    for r in rows:
        print(
            f"{r['mask']:20s} {r['ranks']:3d} {r['assignment']:>10s} {max(r['rank_ms']):8.2f} "
            f"{sum(r['rank_ms']) / len(r['rank_ms']):8.2f} {r['measured_imbalance']:8.3f} {r['modeled_imbalance']:8.3f}"
        )


if __name__ == "__main__":
    main()
