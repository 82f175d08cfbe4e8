"""Load balance and communication of the CP schemes for the 12 masks (CPU, no GPU needed).

    python scripts/cp_report.py --tokens-per-rank 8192 --ranks 4,8,16,32 --chunk 2048 [--model]

For every mask and CP size R (sequence = R x tokens-per-rank): the imbalance (max / mean rank
workload, workload = non-skipped 128 x 128 tiles, partial tiles weighted) of the contiguous,
zigzag and balanced assignments; the balancer's run time; and the KV bytes each scheme sends per
layer (bf16, 8 KV heads x 128 = one GQA layer of hidden 4096), counted from the actual routes:
plain all-gather and ring send every chunk to every other rank, the mask-aware all-gather only
the chunks a receiver's queries can see. With --model, also the cost model's predicted forward +
backward TFLOP/s per GPU of each scheme (distributed/cost_model.py: a model, not a measurement; 32
query heads, 3.5x the forward FLOPs, balanced plan for mask_aware, zigzag for ring and all-gather);
with --stage-chunks N too, mask_aware fetching its remote K/V in stages of at most N chunks per
rank (`CPConfig(stage_chunks=N)`, flat routing, balanced plan): its TFLOP/s per GPU, overlap and
the K/V MB a rank holds at peak (own + two stages), next to one stage's (own + every remote chunk),
the largest rank's each. `--call-ms` replaces the fixed cost the model charges every kernel call
(default the fit's, `RankTimeFit.fixed_s` / `bwd_fixed_s`, measured on mask-aware union calls that
include their host-side mask work): the dense masks' comparison with the ring rests on it. Writes
JSON to cp_report_<K>k_per_rank.json in $OUT or runs/ (or --out; the committed one is
bench/results/), prints a table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

from flashmask3.distributed import CPConfig, chunk_loads, imbalance, make_plan
from flashmask3.distributed.context_parallel import _Layout
from flashmask3.distributed.cost_model import Hardware, RankTimeFit, predict
from flashmask3.reference import masks

from flashmask3.bench import git_commit, progress, result_json, results_dir

KV_BYTES_PER_TOKEN = 2 * 8 * 128 * 2  # k and v, 8 kv heads x 128, bf16


def modeled(
    mask, seqlen: int, world: int, per_rank: int, loads, stage_chunks: int | None = None, fit=RankTimeFit()
) -> dict:
    """Cost-model forward + backward TFLOP/s per GPU (unmasked work) and overlap efficiency of each
    scheme; with `stage_chunks`, also mask_aware's staged fetch and its peak K/V MB per rank. `fit`:
    the per-call costs."""
    heads, kv_heads, head_dim = 32, 8, 128
    flops = 3.5 * 4.0 * seqlen * seqlen * mask.density() * heads * head_dim
    out = {}
    for scheme, assignment in (("mask_aware", "balanced"), ("ring", "zigzag"), ("allgather", "zigzag")):
        plan = make_plan(seqlen, world, per_rank, assignment, loads)
        pred = predict(mask, plan, scheme, heads, kv_heads, head_dim, Hardware(), fit=fit)
        out[f"{scheme}_tflops_per_gpu"] = flops / world / pred["slowest_rank_s"] / 1e12
        out[f"{scheme}_overlap"] = pred["overlap_efficiency"]
    if stage_chunks is not None:
        plan = make_plan(seqlen, world, per_rank, "balanced", loads)
        pred = predict(
            mask,
            plan,
            "mask_aware",
            heads,
            kv_heads,
            head_dim,
            Hardware(),
            fit=fit,
            stage_chunks=stage_chunks,
        )
        out["mask_aware_staged_tflops_per_gpu"] = flops / world / pred["slowest_rank_s"] / 1e12
        out["mask_aware_staged_overlap"] = pred["overlap_efficiency"]
        out["mask_aware_staged_peak_kv_mb"] = pred["peak_kv_bytes"] / 2**20
        out["mask_aware_single_stage_peak_kv_mb"] = pred["single_stage_peak_kv_bytes"] / 2**20
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens-per-rank", type=int, default=8192)
    parser.add_argument("--ranks", default="4,8,16,32")
    parser.add_argument("--chunk", type=int, default=2048)
    parser.add_argument("--masks", default=",".join(masks.MASK_NAMES))
    parser.add_argument("--model", action="store_true", help="add the cost model's predictions")
    parser.add_argument(
        "--stage-chunks",
        type=int,
        metavar="N",
        help="with --model: add mask_aware fetching its remote K/V in stages of at most N chunks per rank",
    )
    parser.add_argument(
        "--call-ms",
        type=float,
        metavar="MS",
        help="with --model: the fixed cost per kernel call in ms (default the fitted one)",
    )
    parser.add_argument(
        "--out", type=Path, help="the JSON file (default: cp_report_<K>k_per_rank.json in $OUT or runs/)"
    )
    args = parser.parse_args()
    if args.call_ms is not None and not args.model:
        parser.error("--call-ms goes with --model (it changes the cost model only)")
    if args.call_ms is not None and args.call_ms < 0:
        parser.error(f"--call-ms takes a number of ms >= 0, got {args.call_ms}")
    fit = RankTimeFit()
    if args.call_ms is not None:
        fit = dataclasses.replace(fit, fixed_s=args.call_ms / 1e3, bwd_fixed_s=args.call_ms / 1e3)
    if args.stage_chunks is not None and (args.stage_chunks < 1 or not args.model):
        parser.error(f"--stage-chunks takes a positive int and goes with --model, got {args.stage_chunks}")
    out = args.out or results_dir() / f"cp_report_{args.tokens_per_rank // 1024}k_per_rank.json"
    rows = []
    for world in (int(r) for r in args.ranks.split(",")):
        seqlen = world * args.tokens_per_rank
        per_rank = args.tokens_per_rank // args.chunk
        for name in progress(args.masks.split(","), f"CP {world}"):
            mask = masks.build(name, seqlen, seed=0)
            loads = chunk_loads(mask, args.chunk)
            start = time.perf_counter()
            plan = make_plan(seqlen, world, per_rank, "balanced", loads)
            balance_s = time.perf_counter() - start
            row = {"mask": name, "ranks": world, "seqlen": seqlen, "chunk": args.chunk, "balance_s": balance_s}
            for scheme in ("contiguous", "zigzag"):
                row[f"imbalance_{scheme}"] = imbalance(loads, make_plan(seqlen, world, per_rank, scheme).assignment)
            row["imbalance_balanced"] = imbalance(loads, plan.assignment)
            layout = _Layout(mask, plan, CPConfig())
            sent_chunks = sum(len(c) for phase in layout.phases for c in phase.values())
            full_chunks = plan.num_chunks * (world - 1)
            row["kv_mb_allgather"] = full_chunks * args.chunk * KV_BYTES_PER_TOKEN / 2**20
            row["kv_mb_mask_aware"] = sent_chunks * args.chunk * KV_BYTES_PER_TOKEN / 2**20
            if args.model:
                row.update(modeled(mask, seqlen, world, per_rank, loads, args.stage_chunks, fit))
            rows.append(row)
            print(json.dumps(row), flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"commit": git_commit(), "command": " ".join(["python", *sys.argv]), "rows": rows}
    if args.model:
        result["model"] = {
            "kind": "cost model of forward + backward, not a measurement",
            "hardware": Hardware().__dict__,
            "mask_aware_rank_time": fit.__dict__,
        }
        if args.stage_chunks is not None:
            result["model"]["stage_chunks"] = args.stage_chunks
    out.write_text(result_json(result))
    model = " model fwd+bwd TFLOP/s/GPU: mask-aware ring allgather" if args.model else ""
    if args.stage_chunks is not None:
        model += f" staged(k={args.stage_chunks}); peak KV MB staged, one stage"
    print(
        f"{'mask':24s} {'R':>3s} {'contig':>7s} {'zigzag':>7s} {'balanced':>8s} {'bal ms':>7s} {'AG MB':>8s} "
        f"{'MA MB':>8s}{model}"
    )
    for r in rows:
        line = (
            f"{r['mask']:24s} {r['ranks']:3d} {r['imbalance_contiguous']:7.2f} {r['imbalance_zigzag']:7.2f} "
            f"{r['imbalance_balanced']:8.3f} {r['balance_s'] * 1e3:7.1f} {r['kv_mb_allgather']:8.0f} "
            f"{r['kv_mb_mask_aware']:8.0f}"
        )
        if args.model:
            line += "".join(f" {r[f'{s}_tflops_per_gpu']:6.0f}" for s in ("mask_aware", "ring", "allgather"))
        if args.stage_chunks is not None:
            line += (
                f" {r['mask_aware_staged_tflops_per_gpu']:6.0f} {r['mask_aware_staged_peak_kv_mb']:8.0f}"
                f" {r['mask_aware_single_stage_peak_kv_mb']:8.0f}"
            )
        print(line)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
