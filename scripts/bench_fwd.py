"""Forward kernel on the H200: correctness against the reference, then speed against the peers.

    python scripts/bench_fwd.py check                 # every mask, bf16/fp16, hdim 64/128, GQA, odd lengths
    python scripts/bench_fwd.py check --head-dim 256  # the same cases at head dim 256
    python scripts/bench_fwd.py bench --seqlens 8192   # paper setup: hidden 4096, 128K tokens per run
    python scripts/bench_fwd.py bench --seqlens 32768 --peers fa4,flex_flash   # only these peers
    python scripts/bench_fwd.py bench --seqlens 32768 --batch 1 --heads 16 --kv-heads 4   # GQA, as in training
    python scripts/bench_fwd.py bench --head-dim 192 --head-dim-v 128 --heads 16   # MLA's head dims
    python scripts/bench_fwd.py ablate --head-dim 64 --variants persistent=false num_stages=3+tile_m=128

Correctness: out and LSE vs the fp64 reference within the verify/ tolerance (2x the error of the
same computation in the input precision), on poisoned output buffers. Speed: CUDA events around each
call, no sync between calls (launch work overlaps the previous call, as in training), warm-up,
median over several input sets, the contenders (cute and each peer, or the ablation's variants)
taking turns round by round (`flashmask3.bench.interleaved_ms`); TFLOP/s counts only unmasked work
(4 B H Sq Sk D density; 2 B H Sq Sk (D + Dv) density with --head-dim-v) and the cute time
includes the mask preprocessing. `ablate` times kernel configurations against the chosen ones
(`fwd_config` / `bwd_config`) on the same inputs, each variant
a set of `field=value` changes of them joined by '+', with each one's largest difference from the
chosen configuration's output. Peers in the same run (`--peers`, default all;
`flashmask3.bench_peers` says which masks each takes): Flex with BACKEND TRITON and FLASH, FA4's own
API (causal, window, varlen documents), FA4 with mask_mod + block sparsity, cuDNN SDPA. Each row
holds per peer its time, TFLOP/s and largest absolute difference from our output, or the error
that stopped it (the run goes on). Shape (`bench`, `ablate`; `check` runs its own cases): by default
hidden 4096, i.e. 4096 / D query heads (`--heads`), as many K/V heads (`--kv-heads`, a divisor of
the query heads: GQA, which every peer takes as it is, `flashmask3.bench_peers`) and 128K tokens
per run, i.e. batch 128K / S (`--batch`); masks with one head or one per query head; TFLOP/s count
the query heads. Each row records its batch, heads and kv_heads. Writes JSON to $OUT (or runs/) and
prints a table last.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch
from flashmask3.optimized import compile_seconds
from flashmask3.optimized.config import config_fields
from flashmask3.optimized.interface import forward as cute_forward
from flashmask3.optimized.interface import loaded_keys, mask_configs
from flashmask3.reference import ColumnMask, masks
from flashmask3.verify import compare, random_inputs, random_sinks

from flashmask3 import bench_peers
from flashmask3.bench import (
    attention_flops,
    called_mask,
    git_commit,
    host_us,
    interleaved_ms,
    progress,
    result_json,
    results_dir,
)


def check_case(name: str, mask: ColumnMask | None, b, sq, sk, hq, hkv, d, dtype, seed, dv=None) -> dict:
    q, k, v, _ = random_inputs(b, sq, sk, hq, hkv, d, dtype, "cuda", seed=seed, head_dim_v=dv)
    report = compare("cute", q, k, v, mask)
    out = torch.full((b, sq, hq, v.shape[-1]), math.nan, dtype=dtype, device="cuda")
    lse = torch.full((b, hq, sq), math.nan, device="cuda")
    cute_forward(q, k, v, mask, 1 / math.sqrt(d), out=out, lse=lse)
    torch.cuda.synchronize()
    unwritten = int(out.isnan().sum() + lse.isnan().sum())
    ok = report.passed and unwritten == 0
    return {
        "mask": name,
        "b": b,
        "sq": sq,
        "sk": sk,
        "hq": hq,
        "hkv": hkv,
        "d": d,
        "dv": v.shape[-1],
        "dtype": str(dtype)[6:],
        "err_out": report.errors["out"],
        "err_lse": report.errors["lse"],
        "tol_out": report.tolerance("out"),
        "tol_lse": report.tolerance("lse"),
        "unwritten": unwritten,
        "notes": report.notes,
        "passed": ok,
    }


def compile_case(name: str, mask: ColumnMask | None, b, sq, sk, hq, hkv, d, dtype, seed, dv=None) -> dict:
    """`check_case`'s kernels, compiled into the kernel cache on the CPU (`--compile-only`)."""
    q, k, v, _ = random_inputs(b, sq, sk, hq, hkv, d, dtype, "cpu", seed=seed, head_dim_v=dv)
    cute_forward(q, k, v, mask, 1 / math.sqrt(d))
    return {"mask": name, "sq": sq, "sk": sk, "d": d, "dtype": str(dtype)[6:]}


def run_check(
    case=check_case,
    first_seed: int = 0,
    head_dims: tuple[int, int] | None = None,
    save=lambda rows: None,
    device: str = "cuda",
) -> list[dict]:
    """`case` (this script's forward check, or bench_bwd's gradient check) over every mask at three
    dtype / head dim / length combinations, plus Sq != Sk, MQA and no mask, the masks on `device`.
    `head_dims` (q/k, v): every case at that pair instead of at 64 and 128. `save(rows)` after each
    case, so a run cut short keeps what it checked."""
    d_big, d_small, dv = (128, 64, None) if head_dims is None else (head_dims[0], head_dims[0], head_dims[1])
    rows, seed = [], first_seed
    for name in progress(masks.MASK_NAMES, "check"):
        combos = ((1024, d_big, torch.bfloat16), (1531, d_small, torch.float16), (2048, d_big, torch.float16))
        for sq, d, dtype in combos:
            seed += 1
            mask = masks.build(name, sq, batch=2, heads=4, seed=seed, device=device)
            rows.append(case(name, None if name == "full" else mask, 2, sq, sq, 4, 2, d, dtype, seed, dv))
            save(rows)
    # Sq != Sk (causal bottom-right), MQA, and no mask.
    for sq, sk in ((700, 1300), (1300, 700)):
        mask = ColumnMask(torch.full((1, 1, sk, 1), sq, dtype=torch.int32, device=device), True, sq)
        rows.append(case("causal_sq!=sk", mask, 1, sq, sk, 8, 1, d_big, torch.bfloat16, seed + sq, dv))
        rows.append(case("none_sq!=sk", None, 1, sq, sk, 8, 1, d_small, torch.bfloat16, seed + sk, dv))
        save(rows)
    return rows


def check_head_dims(args: argparse.Namespace) -> tuple[int, int] | None:
    """The head-dim pair `check` runs every case at: --head-dim / --head-dim-v, or None where that is
    (64, 64) or (128, 128), which the default check covers (its cases at both)."""
    pair = (args.head_dim, args.head_dim_v or args.head_dim)
    return None if pair in ((64, 64), (128, 128)) else pair


TOKENS_PER_RUN = 131072
"""The default batch makes this many tokens per run (128K, the paper's setup): B = max(1, 128K / S)."""


def head_counts(head_dim: int, heads: int | None = None, kv_heads: int | None = None) -> tuple[int, int]:
    """(query heads, K/V heads) of the inputs: `heads`, by default 4096 // head_dim (hidden 4096), and
    `kv_heads`, by default as many (no GQA). A ValueError naming --kv-heads and the accepted values
    where `kv_heads` does not divide the query heads."""
    heads = heads or 4096 // head_dim
    kv_heads = kv_heads or heads
    if heads % kv_heads:
        accepted = ", ".join(str(n) for n in range(1, heads + 1) if heads % n == 0)
        raise ValueError(f"--kv-heads {kv_heads} must divide the query heads ({heads}); accepted: {accepted}")
    return heads, kv_heads


def run_batch(seqlen: int, batch: int | None = None) -> int:
    """The batch at sequence length `seqlen`: `batch`, by default `TOKENS_PER_RUN` tokens per run."""
    return batch or max(1, TOKENS_PER_RUN // seqlen)


def fa4_fn(causal: bool):
    """FA4's dense `flash_attn_func` on a full or causal mask, q, k, v -> (out, lse), for
    overheads.py; None, with why, where its wheel is missing."""
    try:
        from flash_attn.cute import flash_attn_func
    except Exception as exc:  # the peer wheels may not be carried
        print("FA4 unavailable:", exc)
        return None
    return lambda q, k, v: flash_attn_func(q, k, v, causal=causal)


_BOOLS = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}


def kernel_overrides(pairs: list[str]) -> dict:
    """["persistent=false", "num_stages=3"] -> changes of the kernel configurations (FwdConfig,
    BwdConfig), values typed like the fields."""
    fields = config_fields()
    changes: dict[str, bool | int] = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        if key not in fields:
            raise SystemExit(f"{pair}: unknown config field {key!r}; fields: {', '.join(fields)}")
        try:
            changes[key] = _BOOLS[value.lower()] if fields[key] is bool else int(value)
        except (KeyError, ValueError):
            accepted = "true or false" if fields[key] is bool else "an integer"
            raise SystemExit(f"{pair}: {key} must be {accepted}, got {value!r}") from None
    return changes


def bench_inputs(sets: int, batch: int, seqlen: int, heads: int, kv_heads: int, head_dim: int, head_dim_v: int):
    """`sets` input sets (q, k, v, dout) in bf16 on the GPU, seeds 0.. (v and dout of `head_dim_v`)."""
    return [
        random_inputs(
            batch, seqlen, seqlen, heads, kv_heads, head_dim, torch.bfloat16, "cuda", seed=s, head_dim_v=head_dim_v
        )
        for s in range(sets)
    ]


def forward_flops(batch: int, heads: int, seqlen: int, head_dim: int, head_dim_v: int, density: float) -> float:
    """Forward FLOPs on unmasked work: QK^T over D and PV over Dv, i.e. the mean head dim in
    `attention_flops`' 4 B H Sq Sk D."""
    return attention_flops(batch, heads, seqlen, seqlen, (head_dim + head_dim_v) / 2, density)


def record_times(row: dict, contenders: dict, keep_errors: bool = True, **timing) -> None:
    """Each contender's median time into `row` (`interleaved_ms` with `timing`), and the median SM
    clock and power it ran at where NVML reads them; with `keep_errors`, the error of a contender
    that raised (it leaves the turns), else the exception propagates."""
    errors: dict[str, str] | None = {} if keep_errors else None
    clocks: dict[str, dict[str, float]] = {}
    for contender, ms in interleaved_ms(contenders, errors=errors, clocks=clocks, **timing).items():
        row[f"{contender}_ms"] = ms
    row.update({f"{contender}_error": error for contender, error in (errors or {}).items()})
    for contender, readings in clocks.items():
        row.update({f"{contender}_{name}": value for name, value in readings.items()})


def add_row(rows: list[dict], row: dict, flops: float, save) -> None:
    """Give every `*_ms` time of `row` its TFLOP/s (`flops` per call), append it, save all rows, print it."""
    for key in [k for k in row if k.endswith("_ms")]:
        row[key.replace("_ms", "_tflops")] = flops / (row[key] * 1e-3) / 1e12
    rows.append(row)
    save(rows)
    print(json.dumps(row), flush=True)


def run_bench(
    seqlens: list[int],
    head_dim: int,
    mask_names: list[str],
    save=lambda rows: None,
    peer_names: tuple[str, ...] = tuple(bench_peers.PEERS),
    heads: int | None = None,
    kv_heads: int | None = None,
    batch: int | None = None,
    head_dim_v: int | None = None,
    sinks: bool = False,
) -> list[dict]:
    """Rows of the speed table; `save(rows)` after each, so a run cut short keeps what it measured.
    Per mask, cute and the peers of `peer_names` that take the mask take turns (`interleaved_ms`);
    a peer's entries: `_ms`, `_tflops` and `_max_diff` (from our output), or `_error`. `heads`,
    `kv_heads`: `head_counts`' defaults where None; `batch`: `run_batch`'s; `head_dim_v`: V's head
    dim where not `head_dim`; `sinks`: every contender with the same random sink logits per head
    (`random_sinks`), the peers that take them only (`bench_peers.SINK_PEERS`)."""
    rows = []
    heads, kv_heads = head_counts(head_dim, heads, kv_heads)
    head_dim_v = head_dim_v or head_dim
    for seqlen in seqlens:
        batch_size = run_batch(seqlen, batch)
        sets, rounds, repeats = (3, 5, 2) if seqlen <= 8192 else (2, 4, 1)  # longer runs: fewer, still >= 8 samples
        inputs = [x[:3] for x in bench_inputs(sets, batch_size, seqlen, heads, kv_heads, head_dim, head_dim_v)]
        scale = 1 / math.sqrt(head_dim)
        head_sinks = random_sinks(heads, seqlen, "cuda") if sinks else None
        with_sinks = {"sinks": head_sinks} if sinks else {}
        for name in progress(mask_names, f"bench {seqlen}"):
            mask = masks.build(name, seqlen, batch=batch_size, heads=heads, seed=0, device="cuda")
            density = mask.density()
            flops = forward_flops(batch_size, heads, seqlen, head_dim, head_dim_v, density)
            row = {
                "mask": name,
                "seqlen": seqlen,
                "batch": batch_size,
                "heads": heads,
                "kv_heads": kv_heads,
                "head_dim": head_dim,
                **({"head_dim_v": head_dim_v} if head_dim_v != head_dim else {}),
                "density": density,
                **({"sinks": True} if sinks else {}),
            }
            ours_mask, causal = called_mask(name, mask)
            ours = cute_forward(*inputs[0], ours_mask, scale, causal=causal, **with_sinks)[0]
            case = bench_peers.PeerCase(name, mask, batch_size, heads, scale, head_sinks)
            peers = bench_peers.checked_peers(
                case, peer_names, lambda fn: {"max_diff": bench_peers.max_abs_diff(ours, fn(*inputs[0]))}, row
            )
            contenders = {
                "cute": (lambda q, k, v: cute_forward(q, k, v, ours_mask, scale, causal=causal, **with_sinks), inputs)
            }
            contenders.update({peer: (fn, inputs) for peer, fn in peers.items()})
            record_times(row, contenders, rounds=rounds, repeats=repeats)
            add_row(rows, row, flops, save)
    return rows


def bench_table(rows: list[dict], peer_names: tuple[str, ...]) -> str:
    """TFLOP/s of cute and of each peer ('err' where it failed, '-' where it does not take the mask),
    each followed by "@" and its median SM clock in MHz where NVML read one; then cute's ratio to
    the fastest peer, and to the peer with the most work per clock (TFLOP/s over MHz) where every
    contender of the row has a clock: at the power cap the clock each contender runs at moves
    between runs (by ~10% at 8K), its work per clock by ~1%."""

    def cell(row: dict, contender: str) -> str:
        if f"{contender}_tflops" not in row:
            return f"{'err' if contender + '_error' in row else '-':>10s}"
        mhz = row.get(f"{contender}_sm_mhz")
        return f"{row[contender + '_tflops']:.0f}" + (f"@{mhz:.0f}" if mhz else "")

    lines = [
        f"{'mask':24s} {'S':>6s} {'dens':>5s} "
        + " ".join(f"{c:>10s}" for c in ("cute", *peer_names))
        + f" {'x best':>6s} {'/clock':>6s}"
    ]
    for r in rows:
        ran = [c for c in peer_names if f"{c}_tflops" in r]
        best = max(ran, key=lambda c: r[f"{c}_tflops"], default=None)
        ratio = per_clock = math.nan
        if best is not None and "cute_tflops" in r:
            ratio = r["cute_tflops"] / r[f"{best}_tflops"]
            if r.get("cute_sm_mhz") and all(r.get(f"{c}_sm_mhz") for c in ran):
                best_per_clock = max(r[f"{c}_tflops"] / r[f"{c}_sm_mhz"] for c in ran)
                per_clock = r["cute_tflops"] / r["cute_sm_mhz"] / best_per_clock
        lines.append(
            f"{r['mask']:24s} {r['seqlen']:6d} {r['density']:5.2f} "
            + " ".join(f"{cell(r, c):>10s}" for c in ("cute", *peer_names))
            + f" {ratio:6.2f} {per_clock:6.2f}"
        )
    return "\n".join(lines)


def variant_overrides(variant: str) -> dict:
    """ "persistent=false+num_stages=3" -> {"persistent": False, "num_stages": 3}."""
    return kernel_overrides(variant.split("+"))


def forward_step(mask: ColumnMask | None, head_dim: int, overrides: dict, causal: bool = False):
    """The timed call of the forward ablation under a variant's changes: q, k, v, dout -> (out,).
    `mask` and `causal` as ours is called (`bench.called_mask`: with `causal` the causal mask alone)."""
    config, _ = mask_configs(head_dim, mask, overrides, causal=causal)
    return lambda q, k, v, dout: cute_forward(q, k, v, mask, head_dim**-0.5, config=config, causal=causal)[:1]


def run_ablation(
    seqlens: list[int],
    head_dim: int,
    mask_names: list[str],
    variants: list[str],
    step=forward_step,
    flops_per_fwd: float = 1.0,
    save=lambda rows: None,
    rounds: int = 5,
    heads: int | None = None,
    kv_heads: int | None = None,
    batch: int | None = None,
    head_dim_v: int | None = None,
) -> list[dict]:
    """Per mask: the chosen configurations' time ("default"), then each variant's time and largest
    output difference, and each one's host time per call (launch work).
    `step(mask, head_dim, overrides, causal=...)` gives the timed call under a variant's changes (q,
    k, v, dout -> a tuple of output tensors; `causal`: as `forward_step`'s);
    `flops_per_fwd` its FLOPs in forwards (3.5 for fwd+bwd). The configurations take turns in
    `rounds` rounds (median over all), so a drift of the GPU's clock over the run hits them alike.
    `heads`, `kv_heads`, `batch`, `head_dim_v`: the inputs' shape, as in `run_bench`."""
    rows = []
    heads, kv_heads = head_counts(head_dim, heads, kv_heads)
    head_dim_v = head_dim_v or head_dim
    for seqlen in seqlens:
        batch_size = run_batch(seqlen, batch)
        inputs = bench_inputs(2, batch_size, seqlen, heads, kv_heads, head_dim, head_dim_v)
        for name in progress(mask_names, f"ablate {seqlen}"):
            mask = masks.build(name, seqlen, batch=batch_size, heads=heads, seed=0, device="cuda")
            flops = flops_per_fwd * forward_flops(batch_size, heads, seqlen, head_dim, head_dim_v, mask.density())
            mask, causal = called_mask(name, mask)
            run = step(mask, head_dim, {}, causal=causal)
            reference = run(*inputs[0])
            row = {"mask": name, "seqlen": seqlen, "batch": batch_size, "heads": heads, "kv_heads": kv_heads}
            if head_dim_v != head_dim:
                row["head_dim_v"] = head_dim_v
            contenders = {"default": (run, inputs)}
            for variant in variants:
                timed = step(mask, head_dim, variant_overrides(variant), causal=causal)
                row[f"{variant}_max_diff"] = max(
                    float((a.float() - b.float()).abs().max()) for a, b in zip(timed(*inputs[0]), reference)
                )
                contenders[variant] = (timed, inputs)
            record_times(row, contenders, keep_errors=False, rounds=rounds)
            for config, (fn, config_inputs) in contenders.items():
                row[f"{config}_host_us"] = host_us(fn, config_inputs)
            add_row(rows, row, flops, save)
    return rows


def ablation_table(rows: list[dict], variants: list[str]) -> str:
    """TFLOP/s of the default and of each variant (with its largest difference from the default),
    each followed by "@" and its median SM clock in MHz where NVML read one: on a card at its
    power cap, two runs of one kernel differ by as much as their clocks do (6% measured)."""

    def timed(row: dict, contender: str) -> str:
        mhz = row.get(f"{contender}_sm_mhz")
        return f"{row[contender + '_tflops']:.0f}" + (f"@{mhz:.0f}" if mhz else "")

    lines = [f"{'mask':24s} {'S':>6s} {'default':>9s} " + " ".join(f"{v[-25:]:>25s}" for v in variants)]
    for r in rows:
        lines.append(
            f"{r['mask']:24s} {r['seqlen']:6d} {timed(r, 'default'):>9s} "
            + " ".join(f"{timed(r, v):>15s} d={r[v + '_max_diff']:7.1e}" for v in variants)
        )
    return "\n".join(lines)


def positive_int(text: str) -> int:
    """An argparse type: an int >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive int, got {text!r}")
    return value


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    """--seqlens, --head-dim, --masks and the inputs' shape (--heads, --kv-heads, --batch), shared
    with bench_bwd.py and overheads.py; `check_common_arguments` completes them after parsing."""
    parser.add_argument("--seqlens", default="8192")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--masks", default=",".join(masks.MASK_NAMES))
    parser.add_argument("--heads", type=positive_int, help="query heads (default 4096 // head dim: hidden 4096)")
    parser.add_argument(
        "--kv-heads", type=positive_int, help="K/V heads, a divisor of --heads (GQA; default --heads: none)"
    )
    parser.add_argument(
        "--batch",
        type=positive_int,
        help=f"sequences per call (default {TOKENS_PER_RUN // 1024}K tokens per run: max(1, {TOKENS_PER_RUN} // S))",
    )


def add_head_dim_v_argument(parser: argparse.ArgumentParser) -> None:
    """--head-dim-v (check, bench and ablate; `check_head_dim_v` refuses it elsewhere after parsing)."""
    parser.add_argument(
        "--head-dim-v",
        type=positive_int,
        help="check, bench, ablate: V's head dim where not --head-dim (e.g. 128 with 192: MLA's shape)",
    )


def add_compile_only_argument(parser: argparse.ArgumentParser) -> None:
    """--compile-only (check; `run_compile_only` runs it)."""
    parser.add_argument(
        "--compile-only",
        action="store_true",
        help="check: compile its kernels into the kernel cache (FLASHMASK3_KERNEL_CACHE) on the CPU, "
        "run nothing; a GPU machine given that cache then loads them instead of compiling",
    )


def run_compile_only(parser: argparse.ArgumentParser, args: argparse.Namespace, case, then=lambda: None) -> None:
    """`check --compile-only`: `run_check` with `case` (the check's kernels, compiled and kept, not
    run) on CPU masks under `compile_only`, then `then()` (the script's other checks), and a line
    saying how many kernels and where."""
    if args.what != "check":
        parser.error(
            f"--compile-only is for 'check', got it with {args.what!r} (a workload: python -m flashmask3.precompile)"
        )
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")  # without a GPU the DSL would target another chip
    from flashmask3.optimized import interface, kernel_cache

    start = time.perf_counter()
    with interface.compile_only():
        cases = run_check(case, head_dims=check_head_dims(args), device="cpu")
        then()
    root = kernel_cache.cache_root()
    where = "memory only: FLASHMASK3_KERNEL_CACHE is off" if root is None else root / kernel_cache.fingerprint()
    print(
        f"check --compile-only: {len(cases)} cases, {len(compile_seconds)} kernels compiled "
        f"({len(loaded_keys)} loaded) in {time.perf_counter() - start:.0f} s; cache: {where}"
    )


def check_head_dim_v(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The parser's error where --head-dim-v differs from --head-dim outside 'check', 'bench' and 'ablate'."""
    if args.head_dim_v not in (None, args.head_dim) and args.what not in ("check", "bench", "ablate"):
        parser.error(f"--head-dim-v is for 'check', 'bench' and 'ablate', got it with {args.what!r}")


def check_common_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Sets args.heads and args.kv_heads (`head_counts`: their defaults filled in, checked; a wrong
    --kv-heads is the parser's error, naming the accepted values). args.batch stays None for the
    default, which depends on the sequence length (`run_batch`)."""
    try:
        args.heads, args.kv_heads = head_counts(args.head_dim, args.heads, args.kv_heads)
    except ValueError as exc:
        parser.error(str(exc))


def new_record(args: argparse.Namespace, prefix: str):
    """(the result record: commit, command, GPU; a function writing a record to $OUT or runs/
    under one timestamped name)."""
    # runs/ by default: a run never lands in the committed bench/results/ unless copied there.
    out_dir = results_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{prefix}_{args.what}_{time.strftime('%Y%m%d-%H%M%S')}.json"
    result = {
        "commit": git_commit(),
        "command": " ".join(sys.argv),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
    }
    return result, lambda data: path.write_text(result_json(data))


def add_peers_argument(parser: argparse.ArgumentParser) -> None:
    """--peers, shared with bench_bwd.py: a comma list of `bench_peers.PEERS`, all by default."""

    def peer_list(text: str) -> tuple[str, ...]:
        try:
            return bench_peers.select_peers(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parser.add_argument(
        "--peers",
        type=peer_list,
        default=tuple(bench_peers.PEERS),
        help=f"bench: the peers to time, a comma list of {','.join(bench_peers.PEERS)} (default all)",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["check", "bench", "all", "ablate"])
    add_common_arguments(parser)
    add_peers_argument(parser)
    parser.add_argument(
        "--variants",
        nargs="*",
        default=[],
        metavar="FIELD=VALUE[+FIELD=VALUE]",
        help="ablate: changes of the chosen kernel configurations to time against them",
    )
    parser.add_argument(
        "--sinks",
        action="store_true",
        help="bench: every contender with per-head sink logits (gpt-oss); peers: FA4's learnable_sink only",
    )
    add_head_dim_v_argument(parser)
    add_compile_only_argument(parser)
    args = parser.parse_args()
    check_common_arguments(parser, args)
    check_head_dim_v(parser, args)
    if args.compile_only:
        return run_compile_only(parser, args, compile_case)
    result, save = new_record(args, "fwd")
    if args.what in ("check", "all"):
        result["check"] = run_check(head_dims=check_head_dims(args), save=lambda rows: save({**result, "check": rows}))
        result["compile_s"] = {str(k): v for k, v in compile_seconds.items()}
        result["kernels_loaded"] = len(loaded_keys)  # from the kernel cache, not compiled
        print(f"{'case':24s} {'S':>11s} {'d':>4s} {'dtype':>9s} {'err_out':>9s} {'tol':>9s} {'err_lse':>9s} ok")
        for r in result["check"]:
            print(
                f"{r['mask']:24s} {r['sq']:5d}x{r['sk']:<5d} {r['d']:4d} {r['dtype']:>9s} {r['err_out']:9.2e} "
                f"{r['tol_out']:9.2e} {r['err_lse']:9.2e} "
                f"{'ok' if r['passed'] else 'FAIL ' + str(r['notes']) + ' unwritten=' + str(r['unwritten'])}"
            )
        print(
            f"check: {sum(r['passed'] for r in result['check'])} passed, "
            f"{sum(not r['passed'] for r in result['check'])} failed; compile s: {result['compile_s']}"
        )
    if args.what in ("bench", "all"):
        result["peers"], result["peer_versions"] = list(args.peers), bench_peers.versions()
        result["bench"] = run_bench(
            [int(s) for s in args.seqlens.split(",")],
            args.head_dim,
            args.masks.split(","),
            save=lambda rows: save({**result, "bench": rows}),
            peer_names=args.peers,
            heads=args.heads,
            kv_heads=args.kv_heads,
            batch=args.batch,
            head_dim_v=args.head_dim_v,
            sinks=args.sinks,
        )
        print(bench_table(result["bench"], args.peers))
    if args.what == "ablate":
        for variant in args.variants:
            variant_overrides(variant)  # a typo fails before any GPU time is spent
        result["ablate"] = run_ablation(
            [int(s) for s in args.seqlens.split(",")],
            args.head_dim,
            args.masks.split(","),
            args.variants,
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
