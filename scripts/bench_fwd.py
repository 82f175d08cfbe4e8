"""Forward kernel on the H200: correctness against the reference, then speed against the peers.

    python scripts/bench_fwd.py check                 # every mask, bf16/fp16, hdim 64/128, GQA, odd lengths
    python scripts/bench_fwd.py bench --seqlens 8192   # paper setup: hidden 4096, 128K tokens per run
    python scripts/bench_fwd.py ablate --masks full,causal --variants k_ahead=true k_ahead=true+num_stages=3

Correctness: out and LSE vs the fp64 reference within the verify/ tolerance (2x the error of the
same computation in the input precision), on poisoned output buffers. Speed: CUDA events around each
call, no sync between calls (launch work overlaps the previous call, as in training), warm-up,
median over several input sets, the contenders (cute and each peer, or the ablation's variants)
taking turns round by round (`flashmask3.bench.interleaved_ms`); TFLOP/s counts only unmasked work
(4 B H Sq Sk D density) and the cute time includes the mask preprocessing. `ablate` times kernel
variants (KernelOptions changes joined by '+') against the default on the same inputs, with each
one's largest difference from the default's output. Peers in the same run: FlexAttention (compiled,
BlockMask 128 built once outside the timing), FA4 and cuDNN SDPA where the mask is plain full/causal.
Writes JSON to $OUT (or bench/results/) and prints a table last.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flashmask3 import peers  # noqa: E402
from flashmask3.bench import attention_flops, git_commit, host_us, interleaved_ms, progress, result_json  # noqa: E402
from flashmask3.optimized import KernelOptions, compile_seconds, kernel_options  # noqa: E402
from flashmask3.optimized.interface import forward as cute_forward  # noqa: E402
from flashmask3.reference import ColumnMask, masks  # noqa: E402
from flashmask3.verify import compare, random_inputs  # noqa: E402


def check_case(name: str, mask: ColumnMask | None, b, sq, sk, hq, hkv, d, dtype, seed) -> dict:
    q, k, v, _ = random_inputs(b, sq, sk, hq, hkv, d, dtype, "cuda", seed=seed)
    report = compare("cute", q, k, v, mask)
    out = torch.full_like(q, math.nan)
    lse = torch.full((b, hq, sq), math.nan, device="cuda")
    cute_forward(q, k, v, mask, 1 / math.sqrt(d), out=out, lse=lse)
    torch.cuda.synchronize()
    unwritten = int(out.isnan().sum() + lse.isnan().sum())
    ok = report.passed and unwritten == 0
    return {
        "mask": name, "b": b, "sq": sq, "sk": sk, "hq": hq, "hkv": hkv, "d": d, "dtype": str(dtype)[6:],
        "err_out": report.errors["out"], "err_lse": report.errors["lse"],
        "tol_out": report.tolerance("out"), "tol_lse": report.tolerance("lse"),
        "unwritten": unwritten, "notes": report.notes, "passed": ok,
    }


def run_check(case=check_case, first_seed: int = 0) -> list[dict]:
    """`case` (this script's forward check, or bench_bwd's gradient check) over every mask at three
    dtype / head dim / length combinations, plus Sq != Sk, MQA and no mask."""
    rows, seed = [], first_seed
    for name in progress(masks.MASK_NAMES, "check"):
        for sq, d, dtype in ((1024, 128, torch.bfloat16), (1531, 64, torch.float16), (2048, 128, torch.float16)):
            seed += 1
            mask = masks.build(name, sq, batch=2, heads=4, seed=seed, device="cuda")
            rows.append(case(name, mask, 2, sq, sq, 4, 2, d, dtype, seed))
    # Sq != Sk (causal bottom-right), MQA, and no mask.
    for sq, sk in ((700, 1300), (1300, 700)):
        mask = ColumnMask(torch.full((1, 1, sk, 1), sq, dtype=torch.int32, device="cuda"), True, sq)
        rows.append(case("causal_sq!=sk", mask, 1, sq, sk, 8, 1, 128, torch.bfloat16, seed + sq))
        rows.append(case("none_sq!=sk", None, 1, sq, sk, 8, 1, 64, torch.bfloat16, seed + sk))
    return rows


def fa4_fn(causal: bool):
    try:
        from flash_attn.cute import flash_attn_func
    except Exception as exc:  # the peer wheels may not be carried
        print("FA4 unavailable:", exc)
        return None
    return lambda q, k, v: flash_attn_func(q, k, v, causal=causal)


def dense_peers(mask_name: str) -> dict:
    """The peers that take only a plain full or causal mask, {name: fn(q, k, v)}: FA4 (when its
    wheel is there) and cuDNN's SDPA; none for the other masks."""
    if mask_name not in ("full", "causal"):
        return {}
    causal = mask_name == "causal"
    fa4 = fa4_fn(causal)
    return {**({"fa4": fa4} if fa4 is not None else {}), "cudnn": cudnn_fn(causal)}


def kernel_overrides(pairs: list[str]) -> dict:
    """["intra_wg_overlap=true", "num_stages=3"] -> KernelOptions changes, values typed like the fields."""
    fields = {f.name: f.type for f in dataclasses.fields(KernelOptions)}
    options = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        if key not in fields:
            raise SystemExit(f"--kernel {pair}: unknown option {key!r}; options: {', '.join(fields)}")
        options[key] = value.lower() in ("1", "true", "yes") if fields[key] in (bool, "bool") else int(value)
    return options


def fa4_sparse_fn(row: dict, mask, heads: int, inputs: list):
    """FA4 with block sparsity on the same mask (issue 3's last peer): its call, with its largest
    difference from our output put in `row`; or None, with why it could not run."""
    try:
        fa4 = peers.fa4_block_sparse(mask, heads, "cuda")
        q, k, v = inputs[0]
        row["fa4_sparse_max_diff"] = float((fa4(q, k, v).float() - cute_forward(q, k, v, mask, 1 / math.sqrt(
            q.shape[-1]))[0].float()).abs().max())
        return fa4
    except Exception as exc:  # a peer failure is a result to report, not a reason to stop the bench
        row["fa4_sparse_error"] = repr(exc)[:300]
        return None


def cudnn_fn(causal: bool):
    """cuDNN's SDPA on (batch, seq, heads, dim) tensors (dense masks only)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def run(q, k, v):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal).transpose(1, 2)
    return run


def add_row(rows: list[dict], row: dict, flops: float, save) -> None:
    """Give every `*_ms` time of `row` its TFLOP/s (`flops` per call), append it, save all rows, print it."""
    for key in [k for k in row if k.endswith("_ms")]:
        row[key.replace("_ms", "_tflops")] = flops / (row[key] * 1e-3) / 1e12
    rows.append(row)
    save(rows)
    print(json.dumps(row), flush=True)


def run_bench(seqlens: list[int], head_dim: int, mask_names: list[str], save=lambda rows: None) -> list[dict]:
    """Rows of the speed table; `save(rows)` after each, so a run cut short keeps what it measured.
    Per mask, cute and its peers take turns (`interleaved_ms`)."""
    rows = []
    heads = 4096 // head_dim
    for seqlen in seqlens:
        batch = max(1, 131072 // seqlen)
        sets, rounds, repeats = (3, 5, 2) if seqlen <= 8192 else (2, 4, 1)  # longer runs: fewer, still >= 8 samples
        inputs = [random_inputs(batch, seqlen, seqlen, heads, heads, head_dim, torch.bfloat16, "cuda", seed=s)[:3]
                  for s in range(sets)]
        scale = 1 / math.sqrt(head_dim)
        for name in progress(mask_names, f"bench {seqlen}"):
            mask = masks.build(name, seqlen, batch=batch, heads=heads, seed=0, device="cuda")
            density = mask.density()
            flops = attention_flops(batch, heads, seqlen, seqlen, head_dim, density)
            row = {"mask": name, "seqlen": seqlen, "batch": batch, "heads": heads, "head_dim": head_dim,
                   "density": density}
            contenders = {"cute": (lambda q, k, v: cute_forward(q, k, v, mask, scale), inputs)}
            start = time.perf_counter()
            block_mask = peers.flex_block_mask(mask, batch, heads, seqlen, seqlen, "cuda")
            torch.cuda.synchronize()
            row["flex_block_mask_s"] = time.perf_counter() - start
            contenders["flex"] = (lambda q, k, v: peers.flex_attention(q, k, v, None, scale, block_mask), inputs)
            fa4_sparse = fa4_sparse_fn(row, mask, heads, inputs)
            if fa4_sparse is not None:
                contenders["fa4_sparse"] = (fa4_sparse, inputs)
            contenders.update({peer: (fn, inputs) for peer, fn in dense_peers(name).items()})
            for contender, ms in interleaved_ms(contenders, rounds, repeats=repeats).items():
                row[f"{contender}_ms"] = ms
            add_row(rows, row, flops, save)
    return rows


def variant_overrides(variant: str) -> dict:
    """"k_ahead=true+num_stages=3" -> {"k_ahead": True, "num_stages": 3}."""
    return kernel_overrides(variant.split("+"))


def with_options(fn, overrides: dict):
    """`fn` run under the KernelOptions changes `overrides`."""
    def run(*args):
        with kernel_options(**overrides):
            return fn(*args)
    return run


def forward_step(mask: ColumnMask, head_dim: int):
    """The timed call of the forward ablation: q, k, v, dout -> (out,)."""
    return lambda q, k, v, dout: cute_forward(q, k, v, mask, head_dim ** -0.5)[:1]


def run_ablation(seqlens: list[int], head_dim: int, mask_names: list[str], variants: list[str],
                 step=forward_step, flops_per_fwd: float = 1.0, save=lambda rows: None, rounds: int = 5) -> list[dict]:
    """Per mask: the default kernel's time, then each variant's time and largest output difference,
    and each one's host time per call (launch work).
    `step(mask, head_dim)` gives the timed call (q, k, v, dout -> a tuple of output tensors);
    `flops_per_fwd` its FLOPs in forwards (3.5 for fwd+bwd). The configurations take turns in
    `rounds` rounds (median over all), so a drift of the GPU's clock over the run hits them alike."""
    rows = []
    heads = 4096 // head_dim
    for seqlen in seqlens:
        batch = max(1, 131072 // seqlen)
        inputs = [random_inputs(batch, seqlen, seqlen, heads, heads, head_dim, torch.bfloat16, "cuda", seed=s)
                  for s in range(2)]
        for name in progress(mask_names, f"ablate {seqlen}"):
            mask = masks.build(name, seqlen, batch=batch, heads=heads, seed=0, device="cuda")
            flops = flops_per_fwd * attention_flops(batch, heads, seqlen, seqlen, head_dim, mask.density())
            run = step(mask, head_dim)
            reference = run(*inputs[0])
            row = {"mask": name, "seqlen": seqlen}
            contenders = {"default": (run, inputs)}
            for variant in variants:
                timed = with_options(run, variant_overrides(variant))
                row[f"{variant}_max_diff"] = max(float((a.float() - b.float()).abs().max())
                                                 for a, b in zip(timed(*inputs[0]), reference))
                contenders[variant] = (timed, inputs)
            for config, ms in interleaved_ms(contenders, rounds).items():
                row[f"{config}_ms"] = ms
            for config, (fn, config_inputs) in contenders.items():
                row[f"{config}_host_us"] = host_us(fn, config_inputs)
            add_row(rows, row, flops, save)
    return rows


def ablation_table(rows: list[dict], variants: list[str]) -> str:
    """TFLOP/s of the default and of each variant (with its largest difference from the default)."""
    lines = [f"{'mask':24s} {'S':>6s} {'default':>8s} " + " ".join(f"{v[-24:]:>24s}" for v in variants)]
    for r in rows:
        lines.append(f"{r['mask']:24s} {r['seqlen']:6d} {r['default_tflops']:8.0f} " + " ".join(
            f"{r[v + '_tflops']:14.0f} d={r[v + '_max_diff']:7.1e}" for v in variants))
    return "\n".join(lines)


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    """--seqlens, --head-dim, --masks and --kernel, shared with bench_bwd.py."""
    parser.add_argument("--seqlens", default="8192")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--masks", default=",".join(masks.MASK_NAMES))
    parser.add_argument("--kernel", action="append", default=[], metavar="OPTION=VALUE",
                        help="a KernelOptions field for the cute kernels, e.g. intra_wg_overlap=true (repeatable)")


def new_record(args: argparse.Namespace, prefix: str):
    """(the result record: commit, command, GPU, kernel options; a function writing a record to
    $OUT or bench/results/ under one timestamped name)."""
    out_dir = Path(os.environ.get("OUT", "bench/results"))
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{prefix}_{args.what}_{time.strftime('%Y%m%d-%H%M%S')}.json"
    result = {"commit": git_commit(), "command": " ".join(sys.argv), "gpu": torch.cuda.get_device_name(),
              "torch": torch.__version__, "kernel_options": kernel_overrides(args.kernel)}
    return result, lambda data: path.write_text(result_json(data))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["check", "bench", "all", "ablate"])
    add_common_arguments(parser)
    parser.add_argument("--variants", nargs="*", default=[], metavar="OPTION=VALUE[+OPTION=VALUE]",
                        help="ablate: kernel variants to time against the default")
    args = parser.parse_args()
    result, save = new_record(args, "fwd")
    with kernel_options(**result["kernel_options"]):
        if args.what in ("check", "all"):
            result["check"] = run_check()
            result["compile_s"] = {str(k): v for k, v in compile_seconds.items()}
            print(f"{'case':24s} {'S':>11s} {'d':>4s} {'dtype':>9s} {'err_out':>9s} {'tol':>9s} {'err_lse':>9s} ok")
            for r in result["check"]:
                print(f"{r['mask']:24s} {r['sq']:5d}x{r['sk']:<5d} {r['d']:4d} {r['dtype']:>9s} {r['err_out']:9.2e} "
                      f"{r['tol_out']:9.2e} {r['err_lse']:9.2e} {'ok' if r['passed'] else 'FAIL ' + str(r['notes']) + ' unwritten=' + str(r['unwritten'])}")
            print(f"check: {sum(r['passed'] for r in result['check'])} passed, "
                  f"{sum(not r['passed'] for r in result['check'])} failed; compile s: {result['compile_s']}")
        if args.what in ("bench", "all"):
            result["bench"] = run_bench([int(s) for s in args.seqlens.split(",")], args.head_dim, args.masks.split(","),
                                        save=lambda rows: save({**result, "bench": rows}))
            print(f"{'mask':24s} {'S':>6s} {'dens':>5s} {'cute':>6s} {'flex':>6s} {'x flex':>6s} {'fa4 bs':>6s} "
                  f"{'fa4':>6s} {'cudnn':>6s}")
            for r in result["bench"]:
                print(f"{r['mask']:24s} {r['seqlen']:6d} {r['density']:5.2f} {r['cute_tflops']:6.0f} {r['flex_tflops']:6.0f} "
                      f"{r['cute_tflops'] / r['flex_tflops']:6.2f} {r.get('fa4_sparse_tflops', float('nan')):6.0f} "
                      f"{r.get('fa4_tflops', float('nan')):6.0f} {r.get('cudnn_tflops', float('nan')):6.0f}")
        if args.what == "ablate":
            for variant in args.variants:
                variant_overrides(variant)  # a typo fails before any GPU time is spent
            result["ablate"] = run_ablation([int(s) for s in args.seqlens.split(",")], args.head_dim,
                                            args.masks.split(","), args.variants,
                                            save=lambda rows: save({**result, "ablate": rows}))
            print(ablation_table(result["ablate"], args.variants))
    save(result)


if __name__ == "__main__":
    main()
