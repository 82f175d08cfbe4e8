"""One rank of a large CP run, alone: its memory and local kernel time at full scale, its peers faked.

    python scripts/cp_memory.py --world 64 --tokens 1048576              # one H200: CP 64 at 1M tokens
    python scripts/cp_memory.py --world 64 --tokens 1048576 --kv-heads 8 --masks causal_document,full
    python scripts/cp_memory.py --world 8 --tokens 1024 --heads 4 --kv-heads 2 --head-dim 16  # CPU
    python scripts/cp_memory.py --world 64 --tokens 1048576 --kv-heads 8 --stage-chunks 4  # staged fetch

Rank r (`--rank`; default, per mask, the rank whose queries need the most remote K/V chunks: the
largest receive buffers) of a world of `--world` ranks runs CP attention forward + backward on its
own chunks of a `--tokens` sequence, the global mask and plan (balanced) as every rank would build
them. The other ranks do not exist: torch's fake process group (backend "fake",
torch.testing._internal.distributed.fake_pg) answers every collective and point-to-point call at
once, without peers (an all-gather copies this rank's input into every output; a receive leaves its
buffer as allocated). So the received K/V is garbage and the outputs are no attention: the numbers
are memory and time only (the kernels' time does not depend on the values), and the time has no
communication in it.

For each mask and scheme (mask_aware, ring, allgather; hierarchical routing is left out: its node
check gathers the hosts' names, which the fake group cannot), with the remote K/V fetched again for
the backward (the default) and held from the forward (`hold_remote_kv`), after one warm-up call.
`--stage-chunks N` fetches mask_aware's remote K/V in stages of N chunks (`CPConfig.stage_chunks`;
not with `hold_remote_kv`, so only fetched again):

- the whole call's time (forward + backward, median of `--repeats`; CUDA events, host clock on
  CPU) and the local kernel time, forward and backward (the CP layer's compute spans: its calls on
  the own and on the remote chunks);
- the K/V bytes the CP layer holds (`rank_stats()`): at peak in each direction, and kept from the
  forward for the backward;
- on CUDA, the rank's peak memory (torch.cuda.max_memory_allocated over the calls) and its part
  above what was allocated before them (the inputs, the mask). The CPU has no allocator statistics:
  there only the CP layer's K/V bytes are reported.

A configuration that runs out of memory records the error and the run goes on. Writes the rows as
JSON to `--out` (default cp_memory_cp<W>.json in $OUT where set, which the GPU harness brings back,
else in runs/) and prints a table.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from flashmask3.distributed import SCHEMES, CPConfig, chunk_visibility, context_parallel, cp_attention
from flashmask3.reference import masks
from flashmask3.verify.compare import random_inputs
from flashmask3.verify.cp import cp_plan
from flashmask3.verify.suite import DTYPES
from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

from flashmask3.bench import error_string, git_commit, progress, result_json, results_dir, time_fn


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=64, help="the ranks of the run, this one among them")
    parser.add_argument("--rank", type=int, help="default: per mask, the rank that needs the most remote K/V")
    parser.add_argument("--tokens", type=int, default=1 << 20, help="sequence length, all ranks together")
    parser.add_argument("--chunks-per-rank", type=int, default=4)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, help="default: --heads (no GQA)")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="default: bf16 on CUDA, fp32 on CPU")
    parser.add_argument("--backend", choices=("auto", "reference", "cute"), default="auto", help="local kernels")
    parser.add_argument("--masks", default=",".join(masks.MASK_NAMES))
    parser.add_argument("--schemes", default="mask_aware", help=f"comma-separated, of {', '.join(SCHEMES)}")
    parser.add_argument("--repeats", type=int, default=1, help="timed calls after the warm-up (median)")
    parser.add_argument("--stage-chunks", type=int, help="mask_aware: remote K/V chunks per stage (default: one stage)")
    parser.add_argument(
        "--out", type=Path, help="the JSON (default cp_memory_cp<W>.json in $OUT where set, else in runs/)"
    )
    args = parser.parse_args(argv)
    args.kv_heads = args.kv_heads or args.heads
    args.dtype = args.dtype or ("bf16" if args.device.startswith("cuda") else "fp32")
    args.masks, args.schemes = args.masks.split(","), args.schemes.split(",")
    for option, accepted in (("masks", masks.MASK_NAMES), ("schemes", SCHEMES)):
        unknown = [c for c in getattr(args, option) if c not in accepted]
        if unknown:
            parser.error(f"--{option}: unknown {unknown}; accepted: {', '.join(accepted)}")
    if args.world < 2 or args.tokens % (args.world * args.chunks_per_rank):
        parser.error(
            f"--world must be 2 or more and --tokens a multiple of --world x --chunks-per-rank, got --world "
            f"{args.world}, --tokens {args.tokens}, --chunks-per-rank {args.chunks_per_rank}"
        )
    if args.rank is not None and not 0 <= args.rank < args.world:
        parser.error(f"--rank must be in 0..{args.world - 1} (--world {args.world}), got {args.rank}")
    if args.stage_chunks is not None and args.stage_chunks < 1:
        parser.error(f"--stage-chunks must be >= 1, got {args.stage_chunks}")
    if args.repeats < 1 or args.heads % args.kv_heads:
        parser.error(f"--repeats must be >= 1 and --heads ({args.heads}) a multiple of --kv-heads ({args.kv_heads})")
    return args


def remote_chunks_needed(mask, plan) -> np.ndarray:
    """Per rank, how many chunks of other ranks its queries see (what the mask-aware scheme fetches)."""
    needs = chunk_visibility(mask, plan.chunk_size)[np.asarray(plan.assignment)].any(axis=1)  # [rank, chunk]
    return (needs & (plan.chunk_owners != np.arange(plan.world_size)[:, None])).sum(axis=1)


@contextlib.contextmanager
def fake_world(rank: int, world: int):
    """This process as rank `rank` of `world` ranks that do not exist (torch's fake process group)."""
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def measure(mask, plan, rank: int, config: CPConfig, args: argparse.Namespace) -> dict:
    """One config's row: this rank's times, the K/V bytes the CP layer holds and, on CUDA, its peak
    memory; the fake group's ranks must be up (`fake_world`)."""
    device = torch.device(args.device)
    local_len = plan.local_len
    q, k, v, dout = random_inputs(
        1, local_len, local_len, args.heads, args.kv_heads, args.head_dim, DTYPES[args.dtype], device, seed=rank
    )
    leaves = [x.requires_grad_() for x in (q, k, v)]

    def call() -> None:
        torch.autograd.grad(cp_attention(*leaves, mask, plan, config=config), leaves, dout)

    call()  # compiles the kernels, warms the caches
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    seconds = time_fn(call, warmup=0, repeats=args.repeats, device=device)
    fwd, bwd = context_parallel.rank_stats()  # the last call's
    row = {
        "fwd_bwd_ms": seconds * 1e3,
        "kernel_fwd_ms": (fwd.compute_local_s + fwd.compute_remote_s) * 1e3,
        "kernel_bwd_ms": (bwd.compute_local_s + bwd.compute_remote_s) * 1e3,
        "remote_chunks": fwd.chunks_received,
        "saved_kv_bytes": fwd.saved_kv_bytes,
        "fwd_peak_kv_bytes": fwd.peak_kv_bytes,
        "bwd_peak_kv_bytes": bwd.peak_kv_bytes,
        "bwd_peak_grad_bytes": bwd.peak_grad_bytes,
    }
    if cuda:
        peak = torch.cuda.max_memory_allocated(device)
        row |= {"peak_gib": peak / 2**30, "peak_above_inputs_gib": (peak - before) / 2**30}
    return row


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    rows = []
    for i, name in enumerate(progress(args.masks, "masks")):
        mask = masks.build(name, args.tokens, heads=args.heads, seed=i, device=args.device)
        plan = cp_plan(mask, args.world, args.chunks_per_rank, "balanced")
        needed = remote_chunks_needed(mask, plan)
        rank = int(needed.argmax()) if args.rank is None else args.rank
        with fake_world(rank, args.world):
            for scheme in args.schemes:
                stage = args.stage_chunks if scheme == "mask_aware" else None
                for hold in (False,) if stage else (False, True):
                    config = CPConfig(scheme=scheme, backend=args.backend, hold_remote_kv=hold, stage_chunks=stage)
                    row = {"mask": name, "scheme": scheme, "hold_remote_kv": hold, "stage_chunks": stage, "rank": rank}
                    try:
                        row |= measure(mask, plan, rank, config, args)
                    except torch.OutOfMemoryError as exc:  # a finding at this scale: recorded, the run goes on
                        row["error"] = error_string(exc)
                    rows.append(row)
    device = torch.device(args.device)
    record = {
        "commit": git_commit(),
        "command": " ".join(["python", *sys.argv]),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "note": "one real rank, its peers faked: the received K/V is garbage, the numbers are memory and time only"
        + ("" if device.type == "cuda" else "; no peak memory on CPU, only the K/V bytes the CP layer holds"),
        "rows": rows,
    }
    out = args.out or results_dir() / f"cp_memory_cp{args.world}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(result_json(record))
    print(
        f"{'mask':22s} {'scheme':10s} {'hold':>5s} {'stage':>5s} {'rank':>4s} {'f+b ms':>9s} {'kern f':>8s} "
        f"{'kern b':>8s} {'saved MiB':>9s} {'fwd pk':>8s} {'bwd pk':>8s} {'dKV pk':>8s} {'peak GiB':>8s}"
    )
    for r in rows:
        head = f"{r['mask']:22s} {r['scheme']:10s} {str(r['hold_remote_kv']):>5s} {str(r['stage_chunks'] or '-'):>5s}"
        if "error" in r:
            print(f"{head} {r['rank']:4d} {r['error'][:70]}")
            continue
        peak = f"{r['peak_gib']:8.2f}" if "peak_gib" in r else f"{'-':>8s}"
        print(
            f"{head} {r['rank']:4d} {r['fwd_bwd_ms']:9.2f} "
            f"{r['kernel_fwd_ms']:8.2f} {r['kernel_bwd_ms']:8.2f} {r['saved_kv_bytes'] / 2**20:9.2f} "
            f"{r['fwd_peak_kv_bytes'] / 2**20:8.2f} {r['bwd_peak_kv_bytes'] / 2**20:8.2f} "
            f"{r['bwd_peak_grad_bytes'] / 2**20:8.2f} {peak}"
        )
    print(f"(K/V MiB: the CP layer's, this rank; dKV pk: its dK/dV messages in flight; wrote {out})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
