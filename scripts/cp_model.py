"""Cost-model predictions (a model, not a measurement) of CP forward throughput per scheme.

    python scripts/cp_model.py --tokens-per-rank 8192 --ranks 4,8,16,32

Hidden 4096 (32 query heads x 128, 8 kv heads), bf16, 8 GPUs per node, balanced assignment for
mask_aware and zigzag for ring / all-gather; see distributed/cost_model.py for the assumptions.
Prints modeled TFLOP/s per GPU on unmasked work and the overlap efficiency; writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flashmask3.distributed import chunk_loads, make_plan  # noqa: E402
from flashmask3.distributed.cost_model import Hardware, predict  # noqa: E402
from flashmask3.bench import progress  # noqa: E402
from flashmask3.reference import masks  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens-per-rank", type=int, default=8192)
    parser.add_argument("--ranks", default="4,8,16,32")
    parser.add_argument("--chunk", type=int, default=2048)
    parser.add_argument("--masks", default=",".join(masks.MASK_NAMES))
    args = parser.parse_args()
    hw = Hardware()
    rows = []
    for world in (int(r) for r in args.ranks.split(",")):
        seqlen = world * args.tokens_per_rank
        per_rank = args.tokens_per_rank // args.chunk
        for name in progress(args.masks.split(","), f"CP {world}"):
            mask = masks.build(name, seqlen, seed=0)
            flops = 4.0 * seqlen * seqlen * mask.density() * HEADS * HEAD_DIM
            row = {"mask": name, "ranks": world, "seqlen": seqlen}
            for scheme, assignment in (("mask_aware", "balanced"), ("ring", "zigzag"), ("allgather", "zigzag")):
                plan = make_plan(seqlen, world, per_rank, assignment, chunk_loads(mask, args.chunk))
                pred = predict(mask, plan, scheme, HEADS, KV_HEADS, HEAD_DIM, hw)
                row[f"{scheme}_tflops_per_gpu"] = flops / world / pred["slowest_rank_s"] / 1e12
                row[f"{scheme}_overlap"] = pred["overlap_efficiency"]
            rows.append(row)
            print(json.dumps(row), flush=True)
    out_dir = Path(os.environ.get("OUT", "bench/results"))
    out_dir.mkdir(parents=True, exist_ok=True)
    result = {"kind": "cost model, not a measurement", "hardware": hw.__dict__,
              "command": " ".join(["python", *sys.argv]), "rows": rows}
    (out_dir / f"cp_model_{args.tokens_per_rank // 1024}k_per_rank.json").write_text(json.dumps(result, indent=1))
    print(f"{'mask':24s} {'R':>3s} {'mask-aware':>10s} {'ring':>6s} {'allgather':>9s} {'overlap':>7s}  (modeled TFLOP/s per GPU)")
    for r in rows:
        print(f"{r['mask']:24s} {r['ranks']:3d} {r['mask_aware_tflops_per_gpu']:10.0f} {r['ring_tflops_per_gpu']:6.0f} "
              f"{r['allgather_tflops_per_gpu']:9.0f} {r['mask_aware_overlap']:7.2f}")


if __name__ == "__main__":
    main()
