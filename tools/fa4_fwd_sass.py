"""FA4's SM90 forward beside ours in SASS, without a GPU (docs/fwd-sass-comparison.md).

`compile`: FA4's `FlashAttentionForwardSm90` (the `flash_attn.cute` of the FA4 wheel) built as the
wheel's `interface._flash_attn_fwd` builds it at arch 90 (`_tile_size_fwd_sm90`: 128 x 128 at head
dim 128, P as a register operand, intra-warpgroup overlap; 2 K/V stages, 384 threads, pack_gqa when
there is more than one query head per KV head) and `cute.compile`d with fake tensors and the same
argument list and options (`--enable-tvm-ffi`). Without `--lse` there is no LSE output, as FA4 runs
when no input requires grad (the forward benchmarks).

    pip install --no-deps --target $FA4 flash-attn-4==4.0.0b36 quack-kernels==0.6.5 einops  # or their wheels
    CUTE_DSL_ARCH=sm_90a CUTE_DSL_KEEP=cubin CUTE_DSL_DUMP_DIR=$DUMP/fa4 PYTHONPATH=$FA4 \\
        python tools/fa4_fwd_sass.py compile [--causal] [--qheads-per-kvhead 4] [--lse] \\
            [--head-dim 192 --head-dim-v 128]
    nvdisasm -c $DUMP/fa4/*FlashAttentionForwardSm90*.cubin > fa4.sass

`segments`: the blocks of one loop iteration (as `tools/sass_path.py --path` takes them) cut at
their synchronization instructions (WGMMA group ends, warpgroup arrives and waits, named barriers,
mbarrier waits and arrives, cp.async waits), with the float work and the rest between two cuts:

    python tools/fa4_fwd_sass.py segments fa4.sass --path L_x_22,L_x_67,...
"""

from __future__ import annotations

import argparse
import collections
import time

from ncu_source_summary import opcode
from sass_path import read_blocks
from wgmma_windows import FLOAT


def _is_cut(inst: str) -> bool:
    op = opcode(inst)
    if op == "HGMMA":
        return "gsb0" in inst  # the last HGMMA of a group
    return op in ("WARPGROUP", "BAR", "SYNCS", "DEPBAR")


def segments(sass: str, labels: list[str]) -> str:
    with open(sass) as f:
        by_label = dict(read_blocks(f))
    rows, ops = [], collections.Counter()
    hgmma = 0
    for label in labels:
        for inst in by_label[label]:
            op = opcode(inst)
            if op == "HGMMA":
                hgmma += 1
                if not _is_cut(inst):
                    continue
            if _is_cut(inst):
                n = sum(ops.values())
                mix = " ".join(f"{k}:{ops[k]}" for k in FLOAT if ops[k])
                rest = n - sum(ops[k] for k in FLOAT)
                rows.append(f"  {n:4d}  {mix}{' other:' + str(rest) if rest else ''}")
                shown = inst if op != "HGMMA" else f"{hgmma} x HGMMA ... gsb0"
                rows.append(f"[{shown[:80]}]")
                ops, hgmma = collections.Counter(), 0
            else:
                ops[op] += 1
    n = sum(ops.values())
    rows.append(f"  {n:4d}  " + " ".join(f"{k}:{ops[k]}" for k in FLOAT if ops[k]))
    return "\n".join(rows)


def _stub_autotuner() -> None:
    """quack's package __init__ imports its autotuner, which needs triton; nothing here runs it.
    Without triton installed, a stand-in module with the three names the package imports."""
    import importlib.util
    import sys
    import types

    if importlib.util.find_spec("triton") is not None:
        return
    stub = types.ModuleType("quack.autotuner")
    stub.autotune = lambda *args, **kwargs: lambda fn: fn
    stub.AutotuneConfig = stub.Autotuner = type("Unavailable", (), {"__init__": lambda self, *a, **k: None})
    sys.modules["quack.autotuner"] = stub


def compile_fa4(
    causal: bool, qheads_per_kvhead: int, head_dim: int, lse: bool, pack_gqa: bool, head_dim_v: int | None = None
) -> None:
    _stub_autotuner()
    import cutlass
    import cutlass.cute as cute
    from flash_attn.cute.flash_fwd_sm90 import FlashAttentionForwardSm90
    from flash_attn.cute.interface import _tile_size_fwd_sm90
    from flash_attn.cute.utils import AuxData

    d, dv = head_dim, head_dim_v or head_dim
    cfg = _tile_size_fwd_sm90(d, dv, causal, False)
    pack_gqa = pack_gqa and qheads_per_kvhead > 1
    kernel = FlashAttentionForwardSm90(
        cutlass.BFloat16,
        d,
        dv,
        qheads_per_kvhead,
        is_causal=causal,
        is_local=False,
        pack_gqa=pack_gqa,
        tile_m=cfg.m_block_size,
        tile_n=cfg.n_block_size,
        num_stages=2,
        num_threads=384,
        Q_in_regs=False,
        intra_wg_overlap=cfg.intra_wg_overlap,
        mma_pv_is_rs=cfg.mma_pv_is_rs,
    )
    b, sq, sk, hq, hkv = (cute.sym_int32() for _ in range(5))

    def fake(dt, shape, align=16):
        order = tuple(reversed(range(len(shape))))
        return cute.runtime.make_fake_compact_tensor(dt, shape, stride_order=order, assumed_align=align)

    q, o = fake(cutlass.BFloat16, (b, sq, hq, d)), fake(cutlass.BFloat16, (b, sq, hq, dv))
    k, v = fake(cutlass.BFloat16, (b, sk, hkv, d)), fake(cutlass.BFloat16, (b, sk, hkv, dv))
    m_lse = fake(cutlass.Float32, (b, hq, sq), 4) if lse else None
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    # q, k, v, out, lse, scale, cu_seqlens_q/k, seqused_q/k, page_table, window left/right,
    # learnable_sink, block sparsity, aux data, cu_total_m_blocks, cu_total_splits_m_blocks, stream
    args = [kernel, q, k, v, o, m_lse, 0.088, None, None, None, None, None, None, None, None, None]
    args += [AuxData(None, None), None, None, stream]
    start = time.perf_counter()
    cute.compile(*args, options="--enable-tvm-ffi")
    print(
        f"tile {cfg.m_block_size} x {cfg.n_block_size}, rs={cfg.mma_pv_is_rs}, overlap={cfg.intra_wg_overlap}, "
        f"pack_gqa={pack_gqa}, causal={causal}, lse={lse}: {time.perf_counter() - start:.1f} s"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("compile", help="compile FA4's SM90 forward with fake tensors")
    c.add_argument("--causal", action="store_true")
    c.add_argument("--qheads-per-kvhead", type=int, default=4)
    c.add_argument("--head-dim", type=int, default=128)
    c.add_argument("--head-dim-v", type=int, default=None, help="V's and O's head dim (default: --head-dim)")
    c.add_argument("--lse", action="store_true", help="with an LSE output")
    c.add_argument("--no-pack-gqa", action="store_true", help="pack_gqa off even with GQA")
    s = sub.add_parser("segments", help="one iteration's path cut at its synchronization instructions")
    s.add_argument("sass", help="nvdisasm -c output")
    s.add_argument("--path", required=True, help="comma-separated block labels, as sass_path.py takes them")
    args = parser.parse_args()
    if args.command == "compile":
        compile_fa4(args.causal, args.qheads_per_kvhead, args.head_dim, args.lse, not args.no_pack_gqa, args.head_dim_v)
    else:
        print(segments(args.sass, args.path.split(",")))


if __name__ == "__main__":
    main()
