"""Where a kernel's time goes on the full mask: a fixed cost per CTA vs a cost per key tile.

    python scripts/overheads.py --seqlens 1024,4096,16384 [--backward] [--kernel FIELD=VALUE]

At 128K tokens (B = 128K/S, H = 4096/D, bf16) the number of CTAs is fixed (B * H * S/tile: the
forward's query tiles of 128 rows, 192 at head dim 64; the backward's 128-key tiles) while the
tiles each CTA walks grow with S, so the time per CTA-wave, t(S) = fixed + per_tile * S/128,
separates the prologue/epilogue from the main loop. The same fit for FA4 (no mask) says which part
of our gap to it is which (--masks is not used: no mask). `--backward` times the backward alone
(autograd on a kept forward graph; the pre/post passes, constant at fixed tokens, land in the fixed
term), a tile being 128 query rows. `--kernel` changes a field of the forward's chosen configuration
(`FwdConfig`, e.g. persistent=false; the backward runs through autograd, with the chosen ones).
`--profile` instead runs each forward once at the first length, for `ncu -k regex:Forward`.
`--heads`, `--kv-heads` and `--batch` change the shape (bench_fwd.py's options; `--batch` fixes B,
so the CTAs grow with S, which the fit divides out). With GQA the CTAs are counted as our kernels
launch them: the forward's per query head, the backward's per K/V head, each walking the query
tiles of its group's heads (a tile of the fit is then one of those); FA4's fit takes the same
counts, so only its per-tile cost compares. Writes JSON to $OUT (or runs/) and prints the fit last.
"""

from __future__ import annotations

import argparse
import dataclasses
import math

import torch
from bench_fwd import add_common_arguments, check_common_arguments, fa4_fn, kernel_overrides, new_record
from flashmask3.optimized import fwd_config
from flashmask3.optimized.config import apply_overrides
from flashmask3.optimized.interface import forward as cute_forward
from flashmask3.verify import random_inputs

from flashmask3 import attention
from flashmask3.bench import interleaved_ms

TOKENS, TILE_N, SMS = 131072, 128, 132


def per_wave_fit(rows: list[dict], key: str) -> dict:
    """Least squares of (time per wave of CTAs) on (tiles per CTA: a row's `tiles_per_cta`, else
    S / 128): fixed us + us per tile."""
    xs = [r.get("tiles_per_cta", r["seqlen"] / TILE_N) for r in rows]
    ys = [r[key] * 1e3 / (r["ctas"] / SMS) for r in rows]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return {"fixed_us": my - slope * mx, "per_tile_us": slope}


def kept_graph(forward, q, k, v) -> tuple:
    """(out, q, k, v, dout) of one forward on grad-requiring copies of q, k, v, its graph kept."""
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    out = forward(q, k, v)
    out = out[0] if isinstance(out, tuple) else out
    return out, q, k, v, torch.randn_like(out)


def backward_of_kept_graph(out, q, k, v, dout):
    """One backward through a kept graph: dq, dk, dv."""
    return torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_arguments(parser)
    parser.add_argument("--profile", action="store_true", help="one call of each kernel at the first length, for ncu")
    parser.add_argument("--backward", action="store_true", help="time the backward alone instead of the forward")
    parser.add_argument("--kernel", action="append", default=[], metavar="FIELD=VALUE", help="forward config change")
    args = parser.parse_args()
    check_common_arguments(parser, args)
    if args.backward and args.kernel:
        parser.error("--kernel changes the forward's configuration; --backward runs the chosen ones")
    args.what = "overheads"
    heads, kv_heads, scale = args.heads, args.kv_heads, args.head_dim**-0.5
    result, save = new_record(args, "bwd" if args.backward else "fwd")
    # The full mask's configuration (non-causal, width 2), with --kernel's changes.
    config = apply_overrides(fwd_config(args.head_dim, False, 2), kernel_overrides(args.kernel))
    result["fwd_config"] = dataclasses.asdict(config)
    fa4 = fa4_fn(causal=False)
    if args.backward:  # through autograd, so the pre/post passes count as they do in training
        forwards = {"cute": lambda q, k, v: attention(q, k, v, backend="cute")}
    else:
        forwards = {"cute": lambda q, k, v: cute_forward(q, k, v, None, scale, config=config)}
    if fa4 is not None:
        forwards["fa4"] = fa4
    rows = []
    # Forward: a CTA per query head and query tile (192 rows at head dim 64, else 128), walking the
    # key tiles; backward: a CTA per K/V head and 128-key tile, walking the query tiles of its group.
    tile_m = TILE_N if args.backward else config.tile_m
    cta_heads, group = (kv_heads, heads // kv_heads) if args.backward else (heads, 1)
    for seqlen in [int(s) for s in args.seqlens.split(",")]:
        batch = args.batch or TOKENS // seqlen
        inputs = [
            random_inputs(batch, seqlen, seqlen, heads, kv_heads, args.head_dim, torch.bfloat16, "cuda", seed=s)[:3]
            for s in range(2)
        ]
        if args.profile:
            cute_forward(*inputs[0], None, scale, config=config)
            if fa4 is not None:
                fa4(*inputs[0])
            torch.cuda.synchronize()
            return
        row = {
            "seqlen": seqlen,
            "batch": batch,
            "heads": heads,
            "kv_heads": kv_heads,
            "ctas": batch * cta_heads * math.ceil(seqlen / tile_m),
            "tiles_per_cta": group * seqlen / TILE_N,
        }
        if args.backward:
            contenders = {
                name: (backward_of_kept_graph, [kept_graph(fn, *x) for x in inputs]) for name, fn in forwards.items()
            }
        else:
            contenders = {name: (fn, inputs) for name, fn in forwards.items()}
        for kernel, ms in interleaved_ms(contenders).items():
            row[f"{kernel}_ms"] = ms
        rows.append(row)
        print(row, flush=True)
    result["rows"] = rows
    result["fit"] = {key: per_wave_fit(rows, key) for key in ("cute_ms", "fa4_ms") if key in rows[0]}
    save(result)
    for key, fit in result["fit"].items():
        unit = "128 query rows" if args.backward else "key tile"
        print(f"{key[:-3]:5s} fixed {fit['fixed_us']:7.2f} us per CTA wave, {fit['per_tile_us']:6.3f} us per {unit}")


if __name__ == "__main__":
    main()
