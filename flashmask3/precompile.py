"""`python -m flashmask3.precompile`: compile the cute kernels of a workload ahead of time, into the
kernel cache, on any machine (no GPU needed).

A cute kernel compiles in 1-10 s on its first use in a process, and is then kept on disk
(`FLASHMASK3_KERNEL_CACHE`, see `flashmask3.optimized.kernel_cache`), so only the first run on a
machine pays. This fills that cache before the first run: in an image build, or once on a CPU node
for a shared directory the GPU nodes read. It runs the host side of `attention` (the masks'
plans, which choose the kernels) on CPU tensors of the workload's shapes and compiles each kernel
that would be launched, for sm_90a; nothing is computed.

    python -m flashmask3.precompile --masks causal_document,share_question --seqlens 32768 \\
        --heads 16 --kv-heads 4 --head-dims 128 --cache /shared/flashmask3-kernels

Kernels are chosen per head dim, dtype, mask variant and direction, and some plans also depend on
the shapes (the grid against `--sm-count`): give the shapes the job runs.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import sys
import time
from pathlib import Path


def parse_head_dims(text: str) -> list[tuple[int, int]]:
    """ "128,192/128" -> [(128, 128), (192, 128)]: q/k head dim, then v's where it differs."""
    pairs = []
    for item in text.split(","):
        parts = item.strip().split("/")
        if len(parts) > 2 or not all(p.strip().isdigit() for p in parts):
            raise ValueError(f"--head-dims takes D or D/DV items separated by commas, e.g. 128,192/128; got {item!r}")
        d = int(parts[0])
        pairs.append((d, int(parts[-1])))
    return pairs


def parse_seqlens(text: str) -> list[int]:
    """ "8192,32768" -> [8192, 32768]."""
    try:
        return [int(item) for item in text.split(",")]
    except ValueError:
        raise ValueError(f"--seqlens takes lengths separated by commas, e.g. 8192,32768; got {text!r}") from None


def precompile(
    mask_names: list[str],
    seqlens: list[int],
    head_dims: list[tuple[int, int]],
    dtypes: list[str],
    batch: int = 1,
    heads: int = 16,
    kv_heads: int | None = None,
    backward: bool = True,
    deterministic: bool = False,
    sm_count: int = 132,
    sinks: bool = False,
) -> tuple[int, int]:
    """Compile (or find in the cache) every kernel that `attention` would launch for each mask
    name (`flashmask3.masks.MASK_NAMES`, or "none": no mask; "causal" both as a mask and alone, as
    `attention(..., causal=True)` passes it), sequence length, (q/k, v) head dims
    and dtype ("bf16", "fp16"), at `batch` x `heads` query heads over `kv_heads` K/V heads (default:
    as many), forward and, where `backward`, backward (`deterministic`: its deterministic kernels);
    `sinks`: the forwards with attention sinks, a build of their own. Returns (kernels compiled,
    kernels loaded from the cache)."""
    import torch

    from .optimized import interface
    from .reference import masks

    kv_heads = kv_heads or heads
    torch_dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16}
    for name in dtypes:
        if name not in torch_dtypes:
            raise ValueError(f"dtype {name!r} is not one the kernels take; accepted: bf16, fp16")
    for name in mask_names:
        if name != "none" and name not in masks.MASK_NAMES:
            raise ValueError(f"unknown mask name {name!r}; accepted: none, {', '.join(masks.MASK_NAMES)}")
    for d, dv in head_dims:
        reason = interface.head_dims_unsupported(d, dv, backward)
        if reason:
            raise ValueError(reason)
    compiled, loaded = len(interface.compile_seconds), len(interface.loaded_keys)
    with interface.compile_only(sm_count):
        for seqlen in seqlens:
            for name in mask_names:
                mask = None if name == "none" else masks.build(name, seqlen, batch=batch, heads=heads, seed=0)
                for d, dv in head_dims:
                    for dtype in dtypes:
                        # Only shapes and dtypes choose the kernels: the values are never read.
                        empty = functools.partial(torch.empty, dtype=torch_dtypes[dtype])
                        q, dout = empty(batch, seqlen, heads, d), empty(batch, seqlen, heads, dv)
                        k, v = empty(batch, seqlen, kv_heads, d), empty(batch, seqlen, kv_heads, dv)
                        scale = 1 / math.sqrt(d)
                        head_sinks = torch.empty(heads) if sinks else None
                        # "causal": given as a mask, and alone (`attention(..., causal=True)`), which
                        # counts its key tiles instead of listing them: another forward.
                        for called, causal in [(mask, False)] + [(None, True)] * (name == "causal"):
                            out, lse = interface.forward(q, k, v, called, scale, sinks=head_sinks, causal=causal)
                            if backward:
                                interface.backward(dout, q, k, v, out, lse, called, scale, deterministic, causal=causal)
    return len(interface.compile_seconds) - compiled, len(interface.loaded_keys) - loaded


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flashmask3.precompile", description=__doc__.splitlines()[0])
    parser.add_argument("--masks", default="causal_document", help="mask names separated by commas, or 'none'")
    parser.add_argument("--seqlens", default="8192", help="sequence lengths separated by commas")
    parser.add_argument("--head-dims", default="128", help="q/k head dims, D or D/DV (v's), e.g. 128,192/128")
    parser.add_argument("--dtypes", default="bf16", help="bf16, fp16 or both")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=16, help="query heads")
    parser.add_argument("--kv-heads", type=int, default=None, help="K/V heads (default: as many as --heads)")
    parser.add_argument("--forward-only", action="store_true", help="the forward's kernels only")
    parser.add_argument("--deterministic", action="store_true", help="the backward's deterministic kernels")
    parser.add_argument("--sinks", action="store_true", help="the forwards with attention sinks (gpt-oss)")
    parser.add_argument("--sm-count", type=int, default=132, help="SMs of the GPU the kernels will run on")
    parser.add_argument("--cache", type=Path, help="the cache directory (default: FLASHMASK3_KERNEL_CACHE's)")
    parser.add_argument(
        "--prune", action="store_true", help="also remove the cache's folders of other versions (fingerprints)"
    )
    args = parser.parse_args(argv)
    if args.cache is not None:
        os.environ["FLASHMASK3_KERNEL_CACHE"] = str(args.cache)
    # Without a GPU the CuTe DSL would target another architecture; it reads this on first import.
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    from .optimized import kernel_cache

    root = kernel_cache.cache_root()
    if root is None:
        print("error: FLASHMASK3_KERNEL_CACHE is off: pass --cache DIR", file=sys.stderr)
        return 2
    try:
        start = time.perf_counter()
        compiled, loaded = precompile(
            [name.strip() for name in args.masks.split(",")],
            parse_seqlens(args.seqlens),
            parse_head_dims(args.head_dims),
            [name.strip() for name in args.dtypes.split(",")],
            args.batch,
            args.heads,
            args.kv_heads,
            not args.forward_only,
            args.deterministic,
            args.sm_count,
            args.sinks,
        )
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    seconds = time.perf_counter() - start
    if args.prune:
        print(f"removed {len(kernel_cache.prune())} folders of other versions")
    print(
        f"{compiled + loaded} kernels: {compiled} compiled, {loaded} loaded, in {seconds:.1f} s; "
        f"cache: {root / kernel_cache.fingerprint()}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
