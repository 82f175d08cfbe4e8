"""The equivalence suite: every benchmark mask against the reference, one table row per case."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..reference import masks
from .compare import TENSORS, Report, compare, random_inputs, random_sinks

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp64": torch.float64}


@dataclass
class Case:
    mask: str
    seqlen: int
    report: Report


def run_suite(
    backend: str,
    mask_names: list[str] | tuple[str, ...] = masks.MASK_NAMES,
    seqlens: list[int] | tuple[int, ...] = (257, 1000),
    dtype: str = "fp32",
    batch: int = 1,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 64,
    head_dim_v: int | None = None,
    backward: bool = True,
    device: str = "cpu",
    seed: int = 0,
    sinks: bool = False,
) -> list[Case]:
    """Compare `backend` with the reference on every mask and length (fresh inputs per case); with
    `sinks`, attention sinks too (`random_sinks`, one per query head). `head_dim` is q's and k's
    head dim, `head_dim_v` v's and the output's (DeepSeek's MLA: 192 and 128), by default
    `head_dim`."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    cases = []
    for i, name in enumerate(mask_names):
        for j, seqlen in enumerate(seqlens):
            mask = masks.build(name, seqlen, batch=batch, heads=heads, seed=seed + i, device=device)
            case_seed = seed + 100 * i + j
            q, k, v, dout = random_inputs(
                batch, seqlen, seqlen, heads, kv_heads, head_dim, DTYPES[dtype], device, case_seed, head_dim_v
            )
            head_sinks = random_sinks(heads, seqlen, device, seed=case_seed) if sinks else None
            report = compare(backend, q, k, v, mask, dout if backward else None, sinks=head_sinks)
            cases.append(Case(name, seqlen, report))
    return cases


def format_table(cases: list[Case]) -> str:
    """One line per case: the relative L2 error of each tensor and pass/fail."""
    names = [n for n in TENSORS if cases and n in cases[0].report.errors]
    head = f"{'mask':24s} {'seqlen':>7s} " + " ".join(f"{n:>9s}" for n in names) + "  result"
    lines = [head, "-" * len(head)]
    for c in cases:
        errs = " ".join(f"{c.report.errors[n]:9.2e}" for n in names)
        verdict = "ok" if c.report.passed else "FAIL " + "; ".join(c.report.failures())
        lines.append(f"{c.mask:24s} {c.seqlen:7d} {errs}  {verdict}")
    return "\n".join(lines)
