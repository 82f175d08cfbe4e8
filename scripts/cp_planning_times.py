"""CPU time of context-parallel planning on one rank (CPU only; one core).

    python scripts/cp_planning_times.py --cases 131072x32x8,1048576x128x8 --masks causal_document,full

Every rank plans on its own from the global mask: the chunk loads (`chunk_loads`), the balanced
assignment (`make_plan(..., "balanced")`), the layout (which chunks each rank needs and the routes,
`_Layout`) and its localized mask against the K/V chunks it needs. A case is SEQLENxRANKSxCHUNKS
(chunks per rank). Each (case, mask) runs in a fresh process pinned to one core with one thread:
`cold` is its first plan (numba's first calls in a process included, its on-disk cache warm, as
after the first run on a machine), `warm` the plan of the next batch's mask (seed + 1) in the same
process, as a training run meets it. The localized mask is timed for every rank and the slowest
counted in `per_rank_s`. Writes cp_planning_times.json to $OUT (or runs/; or --out); the committed
record, with the same command run on the code before vectorization, is bench/results/cp_planning_times.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from flashmask3.bench import git_commit, result_json, results_dir

ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1"}


def plan_seconds(name: str, seqlen: int, world: int, chunks_per_rank: int, seed: int) -> dict:
    """Seconds of each planning step of one mask, the localized mask for every rank."""
    from flashmask3.distributed import CPConfig, chunk_loads, make_plan
    from flashmask3.distributed.context_parallel import _Layout
    from flashmask3.reference import masks

    mask = masks.build(name, seqlen, seed=seed)
    chunk = seqlen // (world * chunks_per_rank)
    times = {}
    start = time.perf_counter()
    loads = chunk_loads(mask, chunk)
    times["loads_s"] = time.perf_counter() - start
    start = time.perf_counter()
    plan = make_plan(seqlen, world, chunks_per_rank, "balanced", loads)
    times["balance_s"] = time.perf_counter() - start
    start = time.perf_counter()
    layout = _Layout(mask, plan, CPConfig())
    times["layout_s"] = time.perf_counter() - start
    localized = []
    for rank in range(world):
        start = time.perf_counter()
        layout.union_mask(rank, layout.needed(rank, range(plan.num_chunks)))
        localized.append(time.perf_counter() - start)
    times["localize_max_s"] = max(localized)
    times["per_rank_s"] = times["loads_s"] + times["balance_s"] + times["layout_s"] + times["localize_max_s"]
    return times


def one_case(name: str, case: str) -> dict:
    """Runs in the child process: the first plan and the next batch's."""
    import torch

    torch.set_num_threads(1)
    seqlen, world, chunks_per_rank = (int(x) for x in case.split("x"))
    row: dict = {"mask": name, "seqlen": seqlen, "ranks": world, "chunks_per_rank": chunks_per_rank}
    for when, seed in (("cold", 0), ("warm", 1)):
        times = plan_seconds(name, seqlen, world, chunks_per_rank, seed)
        row |= {f"{when}_{key}": value for key, value in times.items()}
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default="131072x32x8,1048576x128x8,1048576x128x16")
    parser.add_argument("--masks", default="causal_document,share_question,full,random_eviction")
    parser.add_argument("--core", type=int, default=0, help="the CPU core each case runs on")
    parser.add_argument("--out", type=Path, default=results_dir() / "cp_planning_times.json")
    parser.add_argument("--child", nargs=2, metavar=("MASK", "CASE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(one_case(*args.child)))
        return

    def run_child(name: str, case: str) -> dict:
        command = ["taskset", "-c", str(args.core), sys.executable, __file__, "--child", name, case]
        done = subprocess.run(command, env=os.environ | ONE_THREAD, capture_output=True, text=True, check=True)
        return json.loads(done.stdout.splitlines()[-1])

    for name in args.masks.split(","):  # fills numba's on-disk cache: compiling is not planning
        run_child(name, "8192x4x2")
    rows = []
    for case in args.cases.split(","):
        for name in args.masks.split(","):
            rows.append(run_child(name, case))
            r = rows[-1]
            print(
                f"{case:>16s} {name:16s} per rank: cold {r['cold_per_rank_s']:7.3f} s, "
                f"warm {r['warm_per_rank_s']:7.3f} s "
                f"(loads {r['warm_loads_s']:.3f}, balance {r['warm_balance_s']:.3f}, layout {r['warm_layout_s']:.3f}, "
                f"localize {r['warm_localize_max_s']:.3f})",
                flush=True,
            )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "commit": git_commit(),
        "command": " ".join(["python", *sys.argv]),
        "machine": "one CPU core, one thread per process",
        "rows": rows,
    }
    args.out.write_text(result_json(result))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
