"""Context parallelism on several GPUs: every scheme against single-device attention, then timed.

One process per GPU over NCCL, or the same per-rank function (`bench_rank`) with its ranks as
threads on one device (`--emulate N`, distributed/emulator.py):

    torchrun --nproc-per-node 8 scripts/cp_bench.py                # CP 8 on one host (2-8 GPUs alike)
    torchrun --nproc-per-node 8 scripts/cp_bench.py --kv-heads 8   # GQA, 8 KV heads
    python scripts/cp_bench.py --emulate 4 --rounds 3              # one H200: 4 ranks as threads, 32K tokens
    python scripts/cp_bench.py --emulate 4 --quick                 # CPU: fp64, small, 3 masks (seconds)
    python scripts/cp_bench.py --emulate 4 --quick --stage-chunks 1  # + mask_aware fetching in stages
    torchrun --nproc-per-node 4 scripts/cp_bench.py --quick --dist-backend gloo  # CPU processes

Per mask (the 12 benchmark masks by default) and scheme (mask_aware on the balanced plan;
mask_aware routed hierarchically with ranks_per_node = N/2, the two halves of the GPUs taken for two
nodes; ring and allgather on the zigzag plan; with `--stage-chunks N`, also "mask_aware_staged":
mask_aware on the balanced plan, flat routing, its remote K/V fetched in stages of at most N chunks
per rank, `CPConfig(stage_chunks=N)`, right after mask_aware; every row carries its stage_chunks):

1. Check: one CP forward + backward against single-device attention (fp64, computed on rank 0,
   which gathers every rank's out/dQ/dK/dV point to point), by verify's rule: relative L2 error at
   most twice that of the reference computed in the inputs' dtype, plus the dtype's floor (1e-10
   for fp64).
2. Host syncs (CUDA only): one more CP forward + backward under torch's sync debug mode, whose
   warnings name each place where the call waits on the GPU from the host ("host_syncs": file:line
   sites, none for a call that queues all its work without waiting). Under torchrun every rank
   watches its own call; with --emulate the mode is the process's, so rank 0 watches while all
   ranks run the same code at the same time.
3. Time: after `--warmup` calls, `--rounds` rounds, the schemes taking turns; before each call all
   ranks synchronize and meet at a barrier. A call's forward and forward + backward times are the
   slowest rank's (CUDA events; host clock on CPU), the median over rounds. TFLOP/s per GPU count
   unmasked work: 4 * B * H * S^2 * D * density / N for the forward, 3.5x that for fwd+bwd.
   Overlap: the CP layer records per rank how long it waited for messages (`rank_stats()`: the
   communication not hidden under compute); the same scheme run with no compute at all (its
   messages, in its order, on the same routes) gives the communication time; hidden = that minus
   the wait, and overlap efficiency = hidden / communication time, summed over ranks. The wait also
   holds waiting for a slower peer, so the hidden part is a lower bound; allgather's collectives
   block, so its overlap, by construction 0, shows the method's noise. The mask-aware schemes'
   speedups over ring and allgather are their times over theirs.

Defaults: 8192 tokens per GPU in 4 chunks, 32 heads x 128 (`--kv-heads` for GQA), bf16 on CUDA
(fp64 on CPU), the CuTe kernels where they run, else the reference (`--backend`). NVLink multicast
(NCCL's NVLS) is kept off (NCCL_NVLS_ENABLE=0, and PyTorch's symmetric-memory multicast, unless the
environment sets them): on shared hosts a program that uses it can take the host's GPUs out of
service, and the transfers measured are NCCL's point-to-point and ring collectives anyway.

Rank 0 writes one JSON (commit, command, world size, devices, rows, failures; `--out`, default
cp_bench_cp<N>.json in $OUT where set, which the GPU harness brings back, else in runs/) and prints
a table last. A scheme whose check raises on every rank (a kernel that cannot run the inputs, say)
records its error, is not timed, and the run goes on; one that fails on some ranks only, inside
communication, hangs NCCL until its timeout (the emulator names the waits). An error while timing
ends the run (the emulator: "rank N failed: <its error>"). The exit code is 1 where any check fails
or errs. With `--emulate`, the ranks share one device: its times test the harness, they are no
multi-GPU measurement.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from flashmask3.distributed import CPConfig, CPPlan, CPStats, EmulatorError, context_parallel, cp_attention, emulate
from flashmask3.optimized import interface as cute_kernels
from flashmask3.reference import masks
from flashmask3.verify.compare import random_inputs
from flashmask3.verify.cp import NAMES, compile_cp_kernels, cp_plan, cp_report, exact, low_precision, max_error, run_cp
from flashmask3.verify.suite import DTYPES

from flashmask3.bench import attention_flops, error_string, git_commit, result_json, results_dir

SCHEMES = ("mask_aware", "hierarchical", "ring", "allgather")
STAGED = "mask_aware_staged"
"""The scheme row `--stage-chunks N` adds: mask_aware, flat routing, `CPConfig(stage_chunks=N)`."""
MASK_AWARE = ("mask_aware", STAGED, "hierarchical")
"""The schemes whose speedups over ring and allgather the rows carry."""
ASSIGNMENTS = {
    "mask_aware": "balanced",
    STAGED: "balanced",
    "hierarchical": "balanced",
    "ring": "zigzag",
    "allgather": "zigzag",
}
"""The plan each scheme runs on: the balancer's for the mask-aware schemes, Megatron's zigzag else."""
FWD_BWD_FLOPS = 3.5
"""Forward + backward FLOPs per forward FLOP."""
SIZES = {
    "full": dict(tokens_per_gpu=8192, chunks_per_rank=4, heads=32, kv_heads=None, head_dim=128, warmup=3, rounds=10),
    "quick": dict(tokens_per_gpu=64, chunks_per_rank=2, heads=4, kv_heads=2, head_dim=16, warmup=1, rounds=3),
}
QUICK_MASKS = ("causal_document", "share_question", "sliding_window")
RANK_TIMEOUT = datetime.timedelta(minutes=30)  # rank 0's fp64 reference at 64K tokens keeps the others waiting


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--emulate", type=int, metavar="N", help="run N ranks as threads on --device")
    parser.add_argument("--device", help="with --emulate: cpu or cuda (default: cuda where present)")
    parser.add_argument("--dist-backend", choices=("nccl", "gloo"), default="nccl", help="under torchrun")
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="default: bf16 on CUDA, fp64 on CPU")
    parser.add_argument("--backend", choices=("auto", "reference", "cute"), default="auto", help="local kernels")
    parser.add_argument(
        "--quick", action="store_true", help="3 masks, 64 tokens per rank, 4 heads (2 KV) x 16, 3 rounds"
    )
    parser.add_argument("--tokens-per-gpu", type=int)
    parser.add_argument("--chunks-per-rank", type=int)
    parser.add_argument("--heads", type=int)
    parser.add_argument("--kv-heads", type=int, help="default: --heads (no GQA)")
    parser.add_argument("--head-dim", type=int)
    parser.add_argument("--masks", help=f"comma-separated (default: all 12; --quick: {','.join(QUICK_MASKS)})")
    parser.add_argument("--schemes", default=",".join(SCHEMES))
    parser.add_argument(
        "--stage-chunks",
        type=int,
        metavar="N",
        help=f"add the scheme {STAGED}: mask_aware fetching its remote K/V in stages of at most N chunks per rank",
    )
    parser.add_argument("--warmup", type=int)
    parser.add_argument("--rounds", type=int)
    parser.add_argument(
        "--out", type=Path, help="the JSON (default cp_bench_cp<N>.json in $OUT where set, else in runs/)"
    )
    args = parser.parse_args(argv)
    for key, value in SIZES["quick" if args.quick else "full"].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.kv_heads = args.kv_heads or args.heads  # the full size: no GQA unless asked
    args.masks = (args.masks or ",".join(QUICK_MASKS if args.quick else masks.MASK_NAMES)).split(",")
    args.schemes = args.schemes.split(",")
    for option, accepted in (("masks", masks.MASK_NAMES), ("schemes", SCHEMES)):
        unknown = [c for c in getattr(args, option) if c not in accepted]
        if unknown:
            parser.error(f"--{option}: unknown {unknown}; accepted: {', '.join(accepted)}")
    for option in ("tokens_per_gpu", "chunks_per_rank", "heads", "kv_heads", "head_dim", "rounds"):
        if getattr(args, option) < 1:
            parser.error(f"--{option.replace('_', '-')} must be a positive int, got {getattr(args, option)}")
    if args.stage_chunks is not None and args.stage_chunks < 1:
        parser.error(f"--stage-chunks must be a positive int, got {args.stage_chunks}")
    if args.warmup < 0:
        parser.error(f"--warmup must be >= 0, got {args.warmup}")
    if args.tokens_per_gpu % args.chunks_per_rank or args.heads % args.kv_heads:
        parser.error(
            f"--tokens-per-gpu ({args.tokens_per_gpu}) must be a multiple of --chunks-per-rank "
            f"({args.chunks_per_rank}) and --heads ({args.heads}) of --kv-heads ({args.kv_heads})"
        )
    if args.emulate is not None and args.emulate < 2:
        parser.error(f"--emulate takes the number of ranks, 2 or more, got {args.emulate}")
    if args.emulate is None and "LOCAL_RANK" not in os.environ:
        parser.error("launch with torchrun --nproc-per-node N (one process per GPU), or pass --emulate N")
    if args.emulate is not None:
        args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        if torch.device(args.device).type not in ("cpu", "cuda"):
            parser.error(f"--device must be cpu or cuda, got {args.device!r}")
    elif args.device is not None:
        parser.error("--device goes with --emulate; under torchrun each rank takes cuda:LOCAL_RANK (gloo: cpu)")
    cuda = args.device.startswith("cuda") if args.emulate is not None else args.dist_backend == "nccl"
    args.dtype = args.dtype or ("bf16" if cuda else "fp64")
    return args


@dataclass
class Case:
    """One scheme on one mask, as this rank runs it."""

    config: CPConfig
    plan: CPPlan
    local: list[torch.Tensor]  # this rank's q, k, v chunks, leaves that require grad
    dout: torch.Tensor  # this rank's chunks of the output gradient
    zero_grad: torch.Tensor  # one chunk's [dK; dV] of zeros in the accumulator dtype


class _NoCompute(context_parallel._LocalAttention):
    """A scheme's local attention without kernels: the forward adds nothing, the backward zero
    dK/dV for the chunks it would compute, so that the scheme sends exactly its messages, in its
    order, with no compute to hide them under."""

    def __init__(self, layout, rank: int, zero_grad: torch.Tensor):
        super().__init__(layout, rank, "reference", 1.0, CPStats())
        self.zero_grad = zero_grad

    def forward(self, q, kv, acc, span):
        return acc

    def backward(self, dout, q, out, lse, kv, grads, dq, span):
        for c in self.layout.needed(self.rank, kv):
            grads.setdefault(c, self.zero_grad)  # adding zeros: nothing to add (the schemes never add in place)
        return dq


def lockstep(device: torch.device) -> None:
    """Every rank idle and at the same point: the device drained, then a barrier."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def all_ranks(value) -> list:
    """Every rank's `value` (picklable), by rank, on every rank."""
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def gather_to_first(tensors: tuple[torch.Tensor, ...], rank: int, world: int) -> list[tuple[torch.Tensor, ...]] | None:
    """Every rank's `tensors` (same shapes on every rank), by rank, on rank 0, point to point; None
    on the other ranks (only rank 0 holds them all)."""
    if rank == 0:
        received = [
            tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors) for _ in range(1, world)
        ]
        ops = [dist.P2POp(dist.irecv, t, src) for src, ts in enumerate(received, 1) for t in ts]
    else:
        ops = [dist.P2POp(dist.isend, t.contiguous(), 0) for t in tensors]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return [tensors, *received] if rank == 0 else None


def timed_round(case: Case, mask, device: torch.device) -> dict[str, float]:
    """This rank's seconds of one CP forward + backward in lockstep: the call's, the waits for
    messages (`rank_stats`), and those of the same messages with no compute (`communication_alone`)."""
    lockstep(device)
    clock = CPStats()  # its spans time on the device's clock
    with clock.timed("fwd_bwd", device):
        with clock.timed("fwd", device):
            out = cp_attention(*case.local, mask, case.plan, config=case.config)
        torch.autograd.grad(out, case.local, case.dout)
    fwd, bwd = context_parallel.rank_stats()
    sample = {
        "fwd_s": clock.seconds("fwd"),
        "fwd_bwd_s": clock.seconds("fwd_bwd"),
        "fwd_wait_s": fwd.wait_s,
        "bwd_wait_s": bwd.wait_s,
        "bytes_sent": fwd.bytes_sent + bwd.bytes_sent,
    }
    sample["fwd_comm_s"], sample["bwd_comm_s"] = communication_alone(case, mask, device)
    return sample


def communication_alone(case: Case, mask, device: torch.device) -> tuple[float, float]:
    """Seconds this rank waits for its messages in one forward and one backward of the case's
    scheme run with no compute (`_NoCompute`), in lockstep: its communication time."""
    lockstep(device)
    layout = context_parallel._layout_for(mask, case.plan, case.config)
    q, k, v = (x.detach() for x in case.local)
    local = torch.stack([k, v])
    fwd, bwd = CPStats(), CPStats()
    attn = _NoCompute(layout, dist.get_rank(), case.zero_grad)
    scheme = case.config.scheme
    (out, lse), remote = context_parallel._FORWARD[scheme](attn, context_parallel._Comm(None, device, fwd), q, local)
    held = remote if case.config.hold_remote_kv else None
    comm = context_parallel._Comm(None, device, bwd)
    context_parallel._BACKWARD[scheme](attn, comm, case.dout, q, out, lse, local, held)
    return fwd.wait_s, bwd.wait_s


def host_syncs(case: Case, mask, device: torch.device, watch: bool) -> list[str]:
    """One CP forward + backward of this rank in lockstep; where `watch`, under torch's sync debug
    mode: the places (file:line) where the call made the host wait on the GPU, sorted, [] for none.
    Only a watching thread touches the warnings machinery (`catch_warnings` is not thread-safe)."""
    lockstep(device)
    if not watch:
        out = cp_attention(*case.local, mask, case.plan, config=case.config)
        torch.autograd.grad(out, case.local, case.dout)
        return []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            out = cp_attention(*case.local, mask, case.plan, config=case.config)
            torch.autograd.grad(out, case.local, case.dout)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "called a synchronizing CUDA operation" in str(w.message)]
    return sorted({f"{Path(w.filename).name}:{w.lineno}" for w in syncs})


def describe_errors(errors: dict[int, str], world: int) -> str:
    """Rank -> error as one line: "every rank: ..." where all ranks raised the same."""
    if len(errors) == world and len(set(errors.values())) == 1:
        return f"every rank: {errors[0]}"
    return "; ".join(f"rank {r}: {e}" for r, e in errors.items())


def check(case: Case, mask, inputs, reference, kernels: str, rank: int, world: int) -> dict:
    """One CP forward + backward against single-device attention: on rank 0, the row's check
    fields (verify's rule); on the others, {} (rank 0 has their results). {"error": ...} on every
    rank where any rank raised."""
    try:
        got, error = run_cp(rank, case.plan, mask, inputs, case.config), None
    except EmulatorError:
        raise
    except Exception as exc:  # on every rank alike, or NCCL hangs before this
        got, error = None, error_string(exc)
    errors = {r: e for r, e in enumerate(all_ranks(error)) if e}
    if errors:
        return {"error": describe_errors(errors, world)}
    results = gather_to_first(got, rank, world)
    if results is None:
        return {}
    expected, baseline = reference
    report = cp_report(kernels, case.plan, results, expected, baseline)
    return {
        "passed": report.passed,
        "check_failures": report.failures(),
        "rel_errors": dict(report.errors),
        "tolerance": {name: report.tolerance(name) for name in NAMES},
        "max_abs_error": max(max_error(r, case.plan, got, expected) for r, got in enumerate(results)),
    }


def time_cases(cases: dict[str, Case], mask, args, device: torch.device) -> dict[str, list]:
    """This rank's `timed_round` samples per scheme after the warm-up calls, the schemes taking
    turns (every other round in reverse) so that a drift of the clocks is no difference between
    them.

    An error here ends the run: every case ran its check on every rank, so what fails now (out of
    memory, say) may fail on some ranks only, amid communication; a rank that went on to the next
    scheme would make other collectives than its peers (NCCL hangs, the emulator names the
    mismatch, either way hiding the error)."""
    samples: dict[str, list] = {scheme: [] for scheme in cases}
    for turn in range(args.warmup + args.rounds):
        order = list(cases) if turn % 2 == 0 else list(cases)[::-1]
        for scheme in order:
            sample = timed_round(cases[scheme], mask, device)
            if turn >= args.warmup:
                samples[scheme].append(sample)
    return samples


def summarize(per_rank: list[list[dict]], flops: float) -> dict:
    """A scheme's timing fields from every rank's samples (`timed_round`), `flops` the forward's
    unmasked FLOPs per GPU."""
    rounds = range(len(per_rank[0]))

    def slowest_median(key: str) -> float:
        return statistics.median(max(samples[i][key] for samples in per_rank) for i in rounds)

    fwd, total = slowest_median("fwd_s"), slowest_median("fwd_bwd_s")
    row = {
        "fwd_ms": fwd * 1e3,
        "fwd_bwd_ms": total * 1e3,
        "tflops_fwd": flops / fwd / 1e12,
        "tflops_fwd_bwd": FWD_BWD_FLOPS * flops / total / 1e12,
        "sent_mib": sum(samples[0]["bytes_sent"] for samples in per_rank) / 2**20,
    }
    comm_total = hidden_total = 0.0
    for direction in ("fwd", "bwd"):
        comm = [statistics.median(s[f"{direction}_comm_s"] for s in samples) for samples in per_rank]
        waited = [statistics.median(s[f"{direction}_wait_s"] for s in samples) for samples in per_rank]
        hidden = [max(0.0, c - w) for c, w in zip(comm, waited)]
        row[f"{direction}_comm_ms"] = statistics.mean(comm) * 1e3  # per rank
        row[f"{direction}_hidden_ms"] = statistics.mean(hidden) * 1e3
        comm_total, hidden_total = comm_total + sum(comm), hidden_total + sum(hidden)
    row["overlap_efficiency"] = hidden_total / comm_total if comm_total > 0 else None
    return row


def speedups(rows: list[dict]) -> None:
    """Add to the mask-aware rows of one mask their speedups over ring and allgather (the other's
    time over theirs), where both were timed."""
    timed = {row["scheme"]: row for row in rows if "fwd_bwd_ms" in row}
    for scheme in MASK_AWARE:
        for other in ("ring", "allgather"):
            if scheme in timed and other in timed:
                for what in ("fwd", "fwd_bwd"):
                    timed[scheme][f"{what}_speedup_vs_{other}"] = (
                        timed[other][f"{what}_ms"] / timed[scheme][f"{what}_ms"]
                    )


def scheme_configs(
    schemes: list[str], world: int, backend: str, stage_chunks: int | None = None
) -> tuple[dict[str, CPConfig], list[str]]:
    """The CPConfig of each scheme at this world size, in the order the ranks run them (the same on
    every rank), and notes on those left out (hierarchical needs two equal halves). With
    `stage_chunks`, STAGED follows mask_aware (first where mask_aware is not asked for)."""
    configs, notes = {}, []
    if stage_chunks is not None:
        schemes = list(schemes)
        schemes.insert(schemes.index("mask_aware") + 1 if "mask_aware" in schemes else 0, STAGED)
    for scheme in schemes:
        if scheme == STAGED:
            configs[scheme] = CPConfig(backend=backend, stage_chunks=stage_chunks)
            continue
        if scheme == "hierarchical":
            if world % 2:
                notes.append(f"hierarchical left out: ranks_per_node = N/2 needs an even world size, got {world}")
                continue
            configs[scheme] = CPConfig(ranks_per_node=world // 2, backend=backend)
        else:
            configs[scheme] = CPConfig(scheme=scheme, backend=backend)
    return configs, notes


def bench_rank(rank: int, world: int, args: argparse.Namespace, device: torch.device) -> dict | None:
    """This rank's share of the whole run: under torchrun, called once per process after
    init_process_group; with --emulate, what each rank thread runs. Returns the run's record on
    rank 0, None on the others."""
    if world < 2:
        raise ValueError(f"context parallelism needs 2 or more ranks, got a world of {world}")
    seqlen = world * args.tokens_per_gpu
    inputs = random_inputs(
        1, seqlen, seqlen, args.heads, args.kv_heads, args.head_dim, DTYPES[args.dtype], device, seed=0
    )
    reason = cute_kernels.unsupported_reason(inputs[0], inputs[1])
    kernels = "cute" if args.backend != "reference" and reason is None else "reference"
    configs, notes = scheme_configs(args.schemes, world, args.backend, args.stage_chunks)
    devices = all_ranks(torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu")
    rows: list[dict] = []
    for i, name in enumerate(args.masks):
        if rank == 0:
            print(f"[cp_bench] {i + 1}/{len(args.masks)} {name}", file=sys.stderr, flush=True)
        mask = masks.build(name, seqlen, heads=args.heads, seed=i, device=device)
        plans = {a: cp_plan(mask, world, args.chunks_per_rank, a) for a in {ASSIGNMENTS[s] for s in configs}}
        reference = (exact(mask, inputs), low_precision(mask, inputs)) if rank == 0 else None
        cases, mask_rows = {}, []
        for scheme, config in configs.items():
            plan = plans[ASSIGNMENTS[scheme]]
            q, k, v, dout = (plan.shard(x, rank) for x in inputs)
            chunk_shape = (2, 1, plan.chunk_size, args.kv_heads, args.head_dim)
            zero_grad = torch.zeros(chunk_shape, dtype=context_parallel._compute_dtype(q), device=device)
            case = Case(config, plan, [x.clone().requires_grad_() for x in (q, k, v)], dout, zero_grad)
            row = {"mask": name, "scheme": scheme, "assignment": ASSIGNMENTS[scheme]}
            row["stage_chunks"] = config.stage_chunks
            row |= check(case, mask, inputs, reference, kernels, rank, world)
            if "error" not in row:
                cases[scheme] = case
                if device.type == "cuda":
                    watch = args.emulate is None or rank == 0
                    sites = all_ranks(host_syncs(case, mask, device, watch))
                    row["host_syncs"] = sorted(set().union(*sites))
            mask_rows.append(row)
        gathered = all_ranks(time_cases(cases, mask, args, device))
        if rank != 0:
            continue
        flops = attention_flops(1, args.heads, seqlen, seqlen, args.head_dim, mask.density()) / world
        for row in mask_rows:
            if row["scheme"] in cases:
                row |= summarize([samples[row["scheme"]] for samples in gathered], flops)
        speedups(mask_rows)
        rows += mask_rows
    if rank != 0:
        return None
    return {"world_size": world, "devices": devices, "kernels": kernels, "notes": notes, "rows": rows}


def failures(rows: list[dict]) -> list[dict]:
    """The rows whose check failed or that raised: mask, scheme, what went wrong."""
    return [
        {"mask": row["mask"], "scheme": row["scheme"], "error": row.get("error") or "; ".join(row["check_failures"])}
        for row in rows
        if "error" in row or not row["passed"]
    ]


def print_table(record: dict) -> None:
    """One line per mask and scheme: the check (worst error over its tolerance), times, TFLOP/s per
    GPU, overlap efficiency and the mask-aware schemes' speedups; the failures after it."""

    def number(value, spec: str) -> str:
        return format(value, spec) if isinstance(value, float) else "-"

    print(
        f"{'mask':22s} {'scheme':17s} {'check':>5s} {'err/tol':>7s} {'fwd ms':>8s} {'f+b ms':>8s} "
        f"{'TF/s f+b':>8s} {'overlap':>7s} {'vs ring':>7s} {'vs AG':>7s}"
    )
    for row in record["rows"]:
        if "error" in row:
            print(f"{row['mask']:22s} {row['scheme']:17s} {'ERROR':>5s} {row['error'][:60]}")
            continue
        worst = max(row["rel_errors"][n] / row["tolerance"][n] for n in NAMES)
        print(
            f"{row['mask']:22s} {row['scheme']:17s} {'ok' if row['passed'] else 'FAIL':>5s} {worst:7.3f} "
            f"{number(row.get('fwd_ms'), '8.3f')} {number(row.get('fwd_bwd_ms'), '8.3f')} "
            f"{number(row.get('tflops_fwd_bwd'), '8.1f')} {number(row.get('overlap_efficiency'), '7.2f')} "
            f"{number(row.get('fwd_bwd_speedup_vs_ring'), '7.2f')} "
            f"{number(row.get('fwd_bwd_speedup_vs_allgather'), '7.2f')}"
        )
    for row in record["rows"]:
        if row.get("host_syncs"):
            print(f"host syncs {row['mask']} {row['scheme']}: {', '.join(row['host_syncs'])}")
    for note in record["notes"]:
        print(f"note: {note}")
    for bad in record["failures"]:
        print(f"FAIL {bad['mask']} {bad['scheme']}: {bad['error']}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    # Before NCCL creates its communicators: no NVLink multicast (see the module's docstring).
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    if args.emulate is not None:
        device, world = torch.device(args.device), args.emulate
        launcher = "emulate"
        command = " ".join(["python", *sys.argv])
        probe = torch.empty(1, 1, 1, args.head_dim, dtype=DTYPES[args.dtype], device=device)
        cute = args.backend != "reference" and cute_kernels.unsupported_reason(probe, probe) is None
        # The CuTe DSL compiles on the main thread only: the local kernels first, then the rank threads.
        warm_up = (lambda: compile_cp_kernels(device, DTYPES[args.dtype], args.head_dim)) if cute else None
        try:
            record = emulate(
                lambda rank, size: bench_rank(rank, size, args, device),
                world,
                device=device,
                warm_up=warm_up,
                timeout=RANK_TIMEOUT.total_seconds(),
            ).results[0]
        except EmulatorError as exc:  # the whole run failed (a rank's error amid communication, a hang)
            record = {"world_size": world, "devices": [], "kernels": None, "notes": [], "rows": []}
            record["run_error"] = error_string(exc)
    else:
        local_rank = int(os.environ["LOCAL_RANK"])
        launcher = "torchrun"
        if args.dist_backend == "nccl":
            torch.cuda.set_device(local_rank)
            device = torch.device("cuda", local_rank)
            dist.init_process_group("nccl", device_id=device, timeout=RANK_TIMEOUT)
        else:
            device = torch.device("cpu")
            dist.init_process_group("gloo", timeout=RANK_TIMEOUT)
        world = dist.get_world_size()
        nodes = world // int(os.environ.get("LOCAL_WORLD_SIZE", world))
        command = f"torchrun --nnodes {nodes} --nproc-per-node {world // nodes} " + " ".join(sys.argv)
        try:
            record = bench_rank(dist.get_rank(), world, args, device)
        finally:
            dist.destroy_process_group()
        if record is None:  # rank 0 reports
            return 0
    rows = record.pop("rows")
    record = {
        "commit": git_commit(),
        "command": command,
        "launcher": launcher,
        **record,
        "dtype": args.dtype,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "timing": "ranks as threads on one device: the times test the harness, they are no multi-GPU measurement"
        if launcher == "emulate"
        else "one process per device",
        "failures": failures(rows),
        "rows": rows,
    }
    out = args.out or results_dir() / f"cp_bench_cp{world}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(result_json(record))
    print(f"wrote {out}")
    if "run_error" in record:
        print(f"FAIL: the run failed: {record['run_error']}", file=sys.stderr)
        return 1
    print_table(record)
    return 1 if record["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
