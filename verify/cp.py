"""Context-parallel attention against single-device attention: the reference, one rank's forward and
backward, the errors (max abs, and verify's relative-L2 rule), and the kernels' warm-up for ranks
run as threads (the CP tests, on gloo processes or the emulator, scripts/cp_emulate.py and
scripts/cp_bench.py)."""

from __future__ import annotations

import math

import torch

from ..api import attention
from ..distributed import CPConfig, CPPlan, chunk_loads, context_parallel, cp_attention, make_plan
from ..reference import ColumnMask, masks
from ..reference.attention import reference_attention
from .compare import Report, random_inputs, rel_l2

NAMES = ("out", "dq", "dk", "dv")
"""The tensors compared, in the order `run_cp` returns them."""


def single_device(
    name_or_mask: str | ColumnMask,
    seqlen: int,
    seed: int = 0,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 16,
    dtype: torch.dtype = torch.float64,
    device: torch.device | str = "cpu",
):
    """mask, inputs (q, k, v, dout in `dtype`) and the fp64 single-device reference (out, dq, dk, dv)
    of those inputs."""
    mask = (
        masks.build(name_or_mask, seqlen, batch=1, heads=heads, seed=seed, device=device)
        if isinstance(name_or_mask, str)
        else name_or_mask
    )
    inputs = random_inputs(1, seqlen, seqlen, heads, kv_heads, head_dim, dtype, device, seed=seed)
    return mask, inputs, exact(mask, inputs)


def exact(mask: ColumnMask, inputs) -> tuple[torch.Tensor, ...]:
    """(out, dq, dk, dv) of single-device attention on `inputs` (q, k, v, dout), computed in fp64."""
    q, k, v, dout = inputs
    ins = [x.to(torch.float64, copy=True).requires_grad_() for x in (q, k, v)]
    out = attention(*ins, mask, backend="reference")
    return (out.detach(), *torch.autograd.grad(out, ins, dout.double()))


def low_precision(mask: ColumnMask, inputs) -> tuple[torch.Tensor, ...]:
    """(out, dq, dk, dv) of the reference computed in the inputs' dtype: verify's baseline."""
    q, k, v, dout = inputs
    ins = [x.detach().requires_grad_() for x in (q, k, v)]
    out, _ = reference_attention(*ins, mask, 1.0 / math.sqrt(q.shape[-1]), q.dtype)
    return (out.detach(), *torch.autograd.grad(out, ins, dout))


def cp_plan(mask: ColumnMask, world: int, chunks_per_rank: int, assignment: str) -> CPPlan:
    """`make_plan` of `assignment` for the mask's length; "balanced" from the chunk loads in tiles of
    128 tokens (whole chunks where they are not a multiple of 128)."""
    chunk = mask.seqlen_q // (world * chunks_per_rank)
    loads = chunk_loads(mask, chunk, tile=128 if chunk % 128 == 0 else chunk) if assignment == "balanced" else None
    return make_plan(mask.seqlen_q, world, chunks_per_rank, assignment, loads)


def run_cp(rank: int, plan: CPPlan, mask: ColumnMask, inputs, config: CPConfig, group=None) -> tuple:
    """This rank's (out, dq, dk, dv) of one CP forward + backward."""
    q, k, v, dout = inputs
    local = [plan.shard(x, rank).clone().requires_grad_() for x in (q, k, v)]
    out = cp_attention(*local, mask, plan, group, config)
    return (out.detach(), *torch.autograd.grad(out, local, plan.shard(dout, rank)))


def max_error(rank: int, plan: CPPlan, got, expected) -> float:
    """The largest absolute error of a rank's results against its shard of `expected` (inf for NaN)."""
    return max(
        torch.nan_to_num((g.double() - plan.shard(e, rank)).abs(), nan=math.inf).max().item()
        for g, e in zip(got, expected)
    )


def cp_report(backend: str, plan: CPPlan, results: list, expected, baseline) -> Report:
    """verify's rule on every rank's results reassembled: relative L2 error against the fp64
    reference, at most twice that of `baseline` (`low_precision`) plus the dtype's floor."""
    report = Report(backend, results[0][0].dtype)
    for i, name in enumerate(NAMES):
        report.errors[name] = rel_l2(plan.unshard([r[i] for r in results]), expected[i])
        report.baseline[name] = rel_l2(baseline[i], expected[i])
    return report


def compile_cp_kernels(device: torch.device | str, dtype: torch.dtype, head_dim: int) -> None:
    """Compile, on this thread, the CuTe kernels of CP's local calls: forward and backward of the
    localized mask variants (non-causal, 2 or 4 bounds per key). The CuTe DSL compiles on the main
    thread only: the emulator's `warm_up` for ranks that use backend="cute"."""
    tokens = 128
    q, k, v, dout = random_inputs(1, tokens, tokens, 2, 1, head_dim, dtype, device)
    kv = torch.stack([k, v])
    for bounds in ([tokens, 0], [tokens, tokens, 0, 0]):  # nothing hidden
        idx = torch.tensor(bounds, dtype=torch.int32, device=device).expand(1, 1, tokens, len(bounds))
        mask = ColumnMask(idx.contiguous(), False, tokens)
        out, lse = context_parallel._local_forward("cute", q, kv, mask, 1.0)
        context_parallel._local_backward("cute", dout, q, kv, out.to(dtype), lse, mask, 1.0)
