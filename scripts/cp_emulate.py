"""CP attention with its ranks as threads (the emulator), against single-device attention, on the
device present: every scheme (mask-aware, hierarchical mask-aware, ring, all-gather), every plan and
mask, forward and backward; each case plain, with a delay before every transfer, and with waits
skipped (the negative control: it must fail where messages travel, or the check sees nothing).

    python scripts/cp_emulate.py                       # CPU, fp64, reference kernels: under a minute
    python scripts/cp_emulate.py --device cuda --dtype bf16 --backend cute --tokens 8192 \\
        --heads 8 --kv-heads 2 --head-dim 128          # one H200, the CuTe kernels on 4 emulated ranks

A case passes by verify's rule (relative L2 error at most twice that of the reference computed in
the inputs' dtype, plus the dtype's floor; for fp64, 1e-10). Writes the cases and a summary as JSON
to --out (cp_emulate.json in $OUT where set, else in runs/) and prints a table; exits 1 where a
plain or delayed case fails or the control fails nowhere. On CUDA every rank shares the one GPU:
the peak memory is the device's, all ranks together.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from pathlib import Path

import torch
from flashmask3.distributed import CPConfig, emulate
from flashmask3.optimized import interface as cute_kernels
from flashmask3.reference import masks
from flashmask3.verify.cp import (
    NAMES,
    compile_cp_kernels,
    cp_plan,
    cp_report,
    low_precision,
    max_error,
    run_cp,
    single_device,
)
from flashmask3.verify.suite import DTYPES

from flashmask3.bench import git_commit, progress, result_json, results_dir

SCHEMES = {
    "mask_aware": CPConfig(),
    "hierarchical": CPConfig(ranks_per_node=2),
    "ring": CPConfig(scheme="ring"),
    "allgather": CPConfig(scheme="allgather"),
}
PLANS = ("contiguous", "zigzag", "balanced")
MODES = ("plain", "delay", "no_wait")


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="default: fp64 on CPU, bf16 on CUDA")
    parser.add_argument("--backend", choices=("auto", "reference", "cute"), default="auto")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=256, help="sequence length, all ranks together")
    parser.add_argument("--chunks-per-rank", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=16)
    parser.add_argument("--masks", default=",".join(masks.MASK_NAMES))
    parser.add_argument("--plans", default=",".join(PLANS))
    parser.add_argument("--schemes", default=",".join(SCHEMES))
    parser.add_argument("--delay", type=float, default=1e-3, help="seconds before each transfer (mode delay)")
    parser.add_argument(
        "--control-delay",
        type=float,
        default=2e-2,
        help="seconds before each transfer of the no-wait control (CUDA: long enough that a rank reads its "
        "buffers before the copies land; on CPU its transfers come after the run anyway)",
    )
    parser.add_argument("--out", type=Path, default=results_dir() / "cp_emulate.json")
    args = parser.parse_args(argv)
    args.dtype = args.dtype or ("bf16" if args.device.startswith("cuda") else "fp64")
    for option, accepted in (("masks", masks.MASK_NAMES), ("plans", PLANS), ("schemes", tuple(SCHEMES))):
        chosen = getattr(args, option).split(",")
        unknown = [c for c in chosen if c not in accepted]
        if unknown:
            parser.error(f"--{option}: unknown {unknown}; accepted: {', '.join(accepted)}")
        setattr(args, option, chosen)
    return args


def run_case(args, case: dict, kernels: str, mask, inputs, expected, baseline) -> dict:
    """One emulated CP forward + backward (`case`: mask, plan, scheme, mode) against single device."""
    plan = cp_plan(mask, args.ranks, args.chunks_per_rank, case["plan"])
    config = dataclasses.replace(SCHEMES[case["scheme"]], backend=args.backend)
    cuda = args.device.startswith("cuda")
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    emulation = emulate(
        lambda rank, world: run_cp(rank, plan, mask, inputs, config),
        args.ranks,
        device=args.device,
        delay={"plain": 0.0, "delay": args.delay, "no_wait": args.control_delay}[case["mode"]],
        skip_waits=case["mode"] == "no_wait",
        warm_up=(lambda: compile_cp_kernels(args.device, inputs[0].dtype, args.head_dim))
        if kernels == "cute"
        else None,
    )
    seconds = time.perf_counter() - start
    report = cp_report(kernels, plan, emulation.results, expected, baseline)
    row = {
        **case,
        "passed": report.passed,
        "rel_errors": dict(report.errors),
        "tolerance": {name: report.tolerance(name) for name in NAMES},
        "max_abs_error": max(max_error(r, plan, got, expected) for r, got in enumerate(emulation.results)),
        "messages": sum(c.op == "send" for calls in emulation.calls for c in calls),
        "seconds": seconds,
    }
    if cuda:
        row["device_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return row


def summary(rows: list[dict]) -> dict:
    """Per mode: cases passed and failed, and the largest finite errors (the control's are NaN)."""
    out = {}
    for mode in MODES:
        cases = [r for r in rows if r["mode"] == mode]
        if not cases:
            continue

        def worst(values) -> float:
            return max((v for v in values if math.isfinite(v)), default=0.0)

        out[mode] = {
            "cases": len(cases),
            "passed": sum(r["passed"] for r in cases),
            "failed": sum(not r["passed"] for r in cases),
            "failed_with_messages": sum(not r["passed"] and r["messages"] > 0 for r in cases),
            "max_rel_error": {n: worst(r["rel_errors"][n] for r in cases) for n in NAMES},
            "max_abs_error": worst(r["max_abs_error"] for r in cases),
        }
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    rows = []
    for i, name in enumerate(progress(args.masks, "masks")):
        mask, inputs, expected = single_device(
            name, args.tokens, i, args.heads, args.kv_heads, args.head_dim, DTYPES[args.dtype], args.device
        )
        reason = cute_kernels.unsupported_reason(inputs[0], inputs[1])
        if args.backend == "cute" and reason is not None:
            sys.exit(f"--backend cute: {reason}")
        kernels = "cute" if args.backend != "reference" and reason is None else "reference"
        baseline = low_precision(mask, inputs)
        for plan in args.plans:
            for scheme in args.schemes:
                for mode in MODES:
                    case = {"mask": name, "plan": plan, "scheme": scheme, "mode": mode}
                    rows.append(run_case(args, case, kernels, mask, inputs, expected, baseline))
    result = {
        "commit": git_commit(),
        "command": " ".join(["python", *sys.argv]),
        "device": torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "cpu",
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "summary": summary(rows),
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(result_json(result))
    print(
        f"{'mode':8s} {'cases':>5s} {'passed':>6s} {'failed':>6s} {'max abs':>9s}  "
        + " ".join(f"{n:>9s}" for n in NAMES)
    )
    for mode, s in result["summary"].items():
        errors = " ".join(f"{s['max_rel_error'][n]:9.2e}" for n in NAMES)
        print(f"{mode:8s} {s['cases']:5d} {s['passed']:6d} {s['failed']:6d} {s['max_abs_error']:9.2e}  {errors}")
    print(f"(errors: the largest finite, relative L2 per tensor; wrote {args.out})")
    waited = [s for mode, s in result["summary"].items() if mode != "no_wait"]
    if any(s["failed"] for s in waited):
        print("FAIL: cases with their waits failed", file=sys.stderr)
        return 1
    if not result["summary"]["no_wait"]["failed"]:
        print("FAIL: the no-wait control failed nowhere: the check cannot see a missing wait", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
