"""Backward kernel on the H200: gradients against the reference, determinism, then fwd+bwd speed.

    python scripts/bench_bwd.py check                 # dQ/dK/dV, every mask, bf16/fp16, hdim 64/128, GQA, odd lengths
    python scripts/bench_bwd.py check --head-dim 192 --head-dim-v 128   # the same cases at MLA's head dims
    python scripts/bench_bwd.py bench --seqlens 8192   # paper setup: hidden 4096, 128K tokens per run
    python scripts/bench_bwd.py bench --seqlens 8192 --peers fa4,fa4_sparse   # only these peers
    python scripts/bench_bwd.py bench --seqlens 32768 --batch 1 --heads 16 --kv-heads 4   # GQA, as in training
    python scripts/bench_bwd.py profile --masks causal,sliding_window --peers fa4   # GPU time per kernel
    python scripts/bench_bwd.py ablate --masks causal --variants lse_ahead=false   # configs vs the chosen ones
    python scripts/bench_bwd.py ablate --head-dim 192 --head-dim-v 128 --heads 16   # MLA's head dims

Correctness: out, LSE, dQ, dK, dV through `attention(..., backend="cute")` and autograd vs the fp64
reference within the verify/ tolerance (2x the error of the same computation in the input
precision), dK/dV written into NaN-poisoned buffers; `deterministic=True` run twice must agree
bit for bit. Speed: fwd+bwd (loss.backward through autograd, mask preprocessing and the dQ/Delta passes
included), CUDA events, median over input sets, cute and its peers taking turns round by round;
TFLOP/s on unmasked work, 3.5x the forward FLOPs (over the mean head dim where v's differs: at
192/128 about 3% under the GEMMs' own count). `bench` times ours through the public entry;
`ablate` calls the kernels directly. Peers in the same run, fwd+bwd through autograd
(`--peers`, default all; `flashmask3.bench_peers` says which masks each takes): Flex with BACKEND
TRITON and FLASH, FA4's own API (causal, window, varlen documents), FA4 with mask_mod + block
sparsity in both directions, cuDNN SDPA. Each row holds per peer its time, TFLOP/s and largest
absolute differences from our output and gradients, or the error that stopped it (the run goes on).
Shape (`bench`, `profile`, `ablate`), as bench_fwd.py's: --heads (default 4096 / D), --kv-heads (GQA;
default as many), --batch (default 128K / S), recorded in each row. Writes JSON to $OUT (or runs/)
and prints a table last.
"""

from __future__ import annotations

import argparse
import functools
import math
import statistics

import torch
from bench_fwd import (
    ablation_table,
    add_common_arguments,
    add_compile_only_argument,
    add_head_dim_v_argument,
    add_peers_argument,
    add_row,
    bench_inputs,
    bench_table,
    check_common_arguments,
    check_head_dim_v,
    check_head_dims,
    forward_flops,
    head_counts,
    new_record,
    record_times,
    run_ablation,
    run_batch,
    run_check,
    run_compile_only,
    variant_overrides,
)
from flashmask3.optimized import compile_seconds
from flashmask3.optimized.interface import backward as cute_backward
from flashmask3.optimized.interface import forward as cute_forward
from flashmask3.optimized.interface import loaded_keys, mask_configs
from flashmask3.reference import ColumnMask, masks
from flashmask3.verify import compare, random_inputs

import flashmask3 as fm
from flashmask3 import bench_peers
from flashmask3.bench import called_mask, progress


def check_case(name: str, mask: ColumnMask | None, b, sq, sk, hq, hkv, d, dtype, seed, dv=None) -> dict:
    q, k, v, dout = random_inputs(b, sq, sk, hq, hkv, d, dtype, "cuda", seed=seed, head_dim_v=dv)
    report = compare("cute", q, k, v, mask, dout)
    scale = 1 / math.sqrt(d)
    out, lse = cute_forward(q, k, v, mask, scale)
    dk, dv = torch.full_like(k, math.nan), torch.full_like(v, math.nan)
    cute_backward(dout, q, k, v, out, lse, mask, scale, dk=dk, dv=dv)
    torch.cuda.synchronize()
    unwritten = int(dk.isnan().sum() + dv.isnan().sum())
    row = {
        "mask": name,
        "b": b,
        "sq": sq,
        "sk": sk,
        "hq": hq,
        "hkv": hkv,
        "d": d,
        "dv": v.shape[-1],
        "dtype": str(dtype)[6:],
        "unwritten": unwritten,
        "notes": report.notes,
        "passed": report.passed and unwritten == 0,
    }
    for t in ("out", "lse", "dq", "dk", "dv"):
        row[f"err_{t}"], row[f"tol_{t}"] = report.errors[t], report.tolerance(t)
    return row


def compile_case(name: str, mask: ColumnMask | None, b, sq, sk, hq, hkv, d, dtype, seed, dv=None) -> dict:
    """`check_case`'s kernels, compiled into the kernel cache on the CPU (`--compile-only`)."""
    q, k, v, dout = random_inputs(b, sq, sk, hq, hkv, d, dtype, "cpu", seed=seed, head_dim_v=dv)
    scale = 1 / math.sqrt(d)
    out, lse = cute_forward(q, k, v, mask, scale)
    cute_backward(dout, q, k, v, out, lse, mask, scale)
    return {"mask": name, "sq": sq, "sk": sk, "d": d, "dtype": str(dtype)[6:]}


def run_determinism(
    names=("document", "causal", "share_question", "random_eviction"),
    head_dims: tuple[int, int] | None = None,
    device: str = "cuda",
) -> dict:
    """Gradients of deterministic runs must be bitwise equal (many key tiles per query tile), at head
    dims 128 and 64 (their query steps may differ) or at the pair `head_dims` (q/k, v); the atomic
    default is shown for contrast. `device`: the inputs' (the CPU under `compile_only`)."""
    result = {}
    built = {name: masks.build(name, 4096, batch=2, heads=8, seed=7, device=device) for name in names}
    for d, dv in ((128, 128), (64, 64)) if head_dims is None else (head_dims,):
        q, k, v, dout = random_inputs(2, 4096, 4096, 8, 2, d, torch.bfloat16, device, seed=7, head_dim_v=dv)
        scale = 1 / math.sqrt(d)
        for name, mask in built.items():
            out, lse = cute_forward(q, k, v, mask, scale)
            for deterministic in (True, False):
                runs = [cute_backward(dout, q, k, v, out, lse, mask, scale, deterministic) for _ in range(4)]
                result[f"{name}_d{d}_{'deterministic' if deterministic else 'atomic'}"] = all(
                    all(torch.equal(a, b) for a, b in zip(runs[0], r)) for r in runs[1:]
                )
    return result


def fwd_bwd(fn):
    """q, k, v, dout -> one forward and backward through `fn(q, k, v)`, returning dq, dk, dv. Not
    `backward()` into q.grad: on leaf inputs that adds an elementwise pass over the three gradients to
    every call after the first (2.2 ms at 8K, `bwd_profile_v4_8k.json`), which training never pays."""

    def run(q, k, v, dout):
        return output_and_gradients(fn, q, k, v, dout)[1:]

    return run


def output_and_gradients(fn, q, k, v, dout) -> tuple[torch.Tensor, ...]:
    """out, dq, dk, dv of one forward and backward through `fn(q, k, v)` (out, or a tuple led by it)."""
    out = fn(q, k, v)
    out = out[0] if isinstance(out, tuple) else out
    return (out.detach(), *torch.autograd.grad(out, (q, k, v), dout))


def differences(ours: tuple[torch.Tensor, ...], theirs: tuple[torch.Tensor, ...]) -> dict[str, float]:
    """Largest absolute differences of a peer's out, dq, dk, dv from ours, as row entries."""
    return {
        key: bench_peers.max_abs_diff(a, b)
        for key, a, b in zip(("max_diff", "max_diff_dq", "max_diff_dk", "max_diff_dv"), ours, theirs)
    }


def run_bench(
    seqlens: list[int],
    head_dim: int,
    mask_names: list[str],
    deterministic: bool,
    save=lambda rows: None,
    peer_names: tuple[str, ...] = tuple(bench_peers.PEERS),
    heads: int | None = None,
    kv_heads: int | None = None,
    batch: int | None = None,
    head_dim_v: int | None = None,
) -> list[dict]:
    """Rows of the speed table; `save(rows)` after each, so a run cut short keeps what it measured.
    Per mask, cute and the peers of `peer_names` that take the mask take turns (`interleaved_ms`);
    a peer's entries: `_ms`, `_tflops`, `_max_diff` (output) and `_max_diff_dq/dk/dv` (from ours),
    or `_error`. `heads`, `kv_heads`, `batch`, `head_dim_v`: the inputs' shape (`bench_fwd.run_bench`)."""
    rows = []
    heads, kv_heads = head_counts(head_dim, heads, kv_heads)
    head_dim_v = head_dim_v or head_dim
    for seqlen in seqlens:
        batch_size = run_batch(seqlen, batch)
        rounds = 5 if seqlen <= 8192 else 3
        inputs = [
            (q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), dout)
            for q, k, v, dout in bench_inputs(2, batch_size, seqlen, heads, kv_heads, head_dim, head_dim_v)
        ]
        scale = 1 / math.sqrt(head_dim)
        for name in progress(mask_names, f"bench {seqlen}"):
            mask = masks.build(name, seqlen, batch=batch_size, heads=heads, seed=0, device="cuda")
            density = mask.density()
            flops = 3.5 * forward_flops(batch_size, heads, seqlen, head_dim, head_dim_v, density)
            row = {
                "mask": name,
                "seqlen": seqlen,
                "batch": batch_size,
                "heads": heads,
                "kv_heads": kv_heads,
                "head_dim": head_dim,
                **({"head_dim_v": head_dim_v} if head_dim_v != head_dim else {}),
                "density": density,
                "deterministic": deterministic,
            }

            ours_mask, causal = called_mask(name, mask)

            def cute(q, k, v):
                return fm.attention(q, k, v, ours_mask, backend="cute", deterministic=deterministic, causal=causal)

            ours = output_and_gradients(cute, *inputs[0])
            case = bench_peers.PeerCase(name, mask, batch_size, heads, scale)
            peers = bench_peers.checked_peers(
                case, peer_names, lambda fn: differences(ours, output_and_gradients(fn, *inputs[0])), row
            )
            contenders = {"cute": fwd_bwd(cute), **{peer: fwd_bwd(fn) for peer, fn in peers.items()}}
            record_times(row, {key: (fn, inputs) for key, fn in contenders.items()}, rounds=rounds, warmup=2, repeats=1)
            add_row(rows, row, flops, save)
    return rows


def backward_step(
    mask: ColumnMask | None, head_dim: int, overrides: dict, deterministic: bool = False, causal: bool = False
):
    """The timed call of the backward ablation under a variant's changes: the cute forward, then its
    backward (`deterministic` mode's configuration and kernel where set) -> (dq, dk, dv). `causal`:
    as `bench_fwd.forward_step`'s."""
    scale = head_dim**-0.5
    fwd, bwd = mask_configs(head_dim, mask, overrides, deterministic, causal)

    def run(q, k, v, dout):
        out, lse = cute_forward(q, k, v, mask, scale, config=fwd, causal=causal)
        return cute_backward(dout, q, k, v, out, lse, mask, scale, deterministic, config=bwd, causal=causal)

    return run


def run_profile(
    seqlen: int,
    head_dim: int,
    mask_names: list[str],
    heads: int | None = None,
    kv_heads: int | None = None,
    batch: int | None = None,
    peer_names: tuple[str, ...] = (),
) -> dict:
    """Per mask and contender (cute, then the peers of `peer_names` that take the mask), one fwd+bwd
    through autograd: its time (CUDA events, median of 5 after a warm-up) and the GPU time of each
    kernel it launches (torch.profiler: name, calls, ms), so that the kernels' sum against the
    step's time shows the GPU's idle gaps; a peer that fails (to build or in its warm-up call)
    leaves its error under the mask's "errors"; `heads`, `kv_heads`, `batch` as in `run_bench`."""
    from torch.profiler import ProfilerActivity, profile

    heads, kv_heads = head_counts(head_dim, heads, kv_heads)
    batch = run_batch(seqlen, batch)
    q, k, v, dout = random_inputs(batch, seqlen, seqlen, heads, kv_heads, head_dim, torch.bfloat16, "cuda", seed=0)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    result = {}
    for name in mask_names:
        mask = masks.build(name, seqlen, batch=batch, heads=heads, seed=0, device="cuda")
        case = bench_peers.PeerCase(name, mask, batch, heads, 1 / math.sqrt(head_dim))
        failed: dict = {}

        def warm_up(fn) -> dict:
            fwd_bwd(fn)(q, k, v, dout)  # its compilation, out of the timing; an error is kept below
            return {}

        peers = bench_peers.checked_peers(case, peer_names, warm_up, failed)
        ours_mask, causal = called_mask(name, mask)
        contenders = {"cute": lambda q, k, v: fm.attention(q, k, v, ours_mask, backend="cute", causal=causal), **peers}
        errors = {key.removesuffix("_error"): value for key, value in failed.items() if key.endswith("_error")}
        result[name] = {"errors": errors} if errors else {}
        for peer, error in errors.items():
            print(f"--- {name} {peer}: {error}")
        for contender, fn in contenders.items():
            step = fwd_bwd(fn)
            times = []
            for _ in range(6):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                step(q, k, v, dout)
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                step(q, k, v, dout)
                torch.cuda.synchronize()
            kernels = sorted(
                (
                    (e.key[:80], e.count, round(e.device_time_total / 1e3, 4))
                    for e in prof.key_averages()
                    if e.device_time_total > 0
                ),
                key=lambda r: -r[2],
            )
            step_ms, kernel_ms = statistics.median(times[1:]), sum(ms for _, _, ms in kernels)
            result[name][contender] = {"step_ms": step_ms, "kernels_ms": kernel_ms, "kernels": kernels[:12]}
            print(f"--- {name} {contender}: step {step_ms:.3f} ms, kernels {kernel_ms:.3f} ms")
            for key, calls, ms in kernels[:12]:
                print(f"  {ms:8.3f} ms {calls:3d}x  {key}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["check", "bench", "all", "profile", "ablate"])
    add_common_arguments(parser)
    add_peers_argument(parser)
    parser.add_argument("--deterministic", action="store_true", help="bench (or ablate) the deterministic backward")
    parser.add_argument(
        "--variants",
        nargs="*",
        default=[],
        metavar="FIELD=VALUE[+FIELD=VALUE]",
        help="ablate: changes of the chosen kernel configurations to time (fwd+bwd) against them",
    )
    add_head_dim_v_argument(parser)
    add_compile_only_argument(parser)
    args = parser.parse_args()
    check_common_arguments(parser, args)
    check_head_dim_v(parser, args)
    if args.compile_only:
        head_dims = check_head_dims(args)
        return run_compile_only(parser, args, compile_case, lambda: run_determinism(head_dims=head_dims, device="cpu"))
    result, save = new_record(args, "bwd")
    if args.what in ("check", "all"):
        head_dims = check_head_dims(args)
        result["check"] = run_check(check_case, 100, head_dims, save=lambda rows: save({**result, "check": rows}))
        result["determinism"] = run_determinism(head_dims=head_dims)
        result["compile_s"] = {str(k): v for k, v in compile_seconds.items()}
        result["kernels_loaded"] = len(loaded_keys)  # from the kernel cache, not compiled
        print(
            f"{'case':22s} {'S':>11s} {'d':>4s} {'dtype':>9s} {'err_dq':>8s} {'tol':>8s} {'err_dk':>8s} "
            f"{'tol':>8s} "
            f"{'err_dv':>8s} {'tol':>8s} ok"
        )
        for r in result["check"]:
            print(
                f"{r['mask']:22s} {r['sq']:5d}x{r['sk']:<5d} {r['d']:4d} {r['dtype']:>9s} "
                + " ".join(f"{r['err_' + t]:8.1e} {r['tol_' + t]:8.1e}" for t in ("dq", "dk", "dv"))
                + (
                    " ok"
                    if r["passed"]
                    else f" FAIL {r['notes']} unwritten={r['unwritten']} out={r['err_out']:.1e} lse={r['err_lse']:.1e}"
                )
            )
        print(
            f"check: {sum(r['passed'] for r in result['check'])} passed, "
            f"{sum(not r['passed'] for r in result['check'])} failed; determinism {result['determinism']}"
        )
    if args.what in ("bench", "all"):
        result["peers"], result["peer_versions"] = list(args.peers), bench_peers.versions()
        result["bench"] = run_bench(
            [int(s) for s in args.seqlens.split(",")],
            args.head_dim,
            args.masks.split(","),
            args.deterministic,
            save=lambda rows: save({**result, "bench": rows}),
            peer_names=args.peers,
            heads=args.heads,
            kv_heads=args.kv_heads,
            batch=args.batch,
            head_dim_v=args.head_dim_v,
        )
        print(bench_table(result["bench"], args.peers))
    if args.what == "profile":
        result["profile"] = run_profile(
            int(args.seqlens.split(",")[0]),
            args.head_dim,
            args.masks.split(","),
            args.heads,
            args.kv_heads,
            args.batch,
            peer_names=args.peers,
        )
    if args.what == "ablate":
        for variant in args.variants:
            variant_overrides(variant)  # a typo fails before any GPU time is spent
        result["ablate"] = run_ablation(
            [int(s) for s in args.seqlens.split(",")],
            args.head_dim,
            args.masks.split(","),
            args.variants,
            functools.partial(backward_step, deterministic=args.deterministic),
            3.5,
            save=lambda rows: save({**result, "ablate": rows}),
            heads=args.heads,
            kv_heads=args.kv_heads,
            batch=args.batch,
            head_dim_v=args.head_dim_v,
        )
        print(ablation_table(result["ablate"], args.variants))
    save(result)


if __name__ == "__main__":
    main()
