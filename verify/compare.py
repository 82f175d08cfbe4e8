"""Numerical equivalence of any backend with the reference.

FlashAttention's rule: a backend's error against the fp64 reference may be at most twice the error
of the same computation done by PyTorch in the input's precision (the reference with
`compute_dtype` = input dtype), plus a small per-dtype floor. Errors are relative L2 norms.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..api import attention
from ..reference import ColumnMask
from ..reference.attention import reference_attention

FLOOR = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 2e-4, torch.bfloat16: 1e-3}
"""Per-dtype floor added to twice the baseline error (relative L2)."""

TENSORS = ("out", "lse", "dq", "dk", "dv", "dsinks")
"""The tensors compared; dsinks only with attention sinks."""


def rel_l2(x: torch.Tensor, ref: torch.Tensor) -> float:
    """||x - ref|| / ||ref|| over entries where ref is finite; inf if x is not finite there."""
    x, ref = x.detach().double(), ref.detach().double()
    finite = torch.isfinite(ref)
    if not bool(torch.isfinite(x[finite]).all()):
        return math.inf
    diff = torch.linalg.vector_norm(x[finite] - ref[finite])
    return float(diff / torch.linalg.vector_norm(ref[finite]).clamp_min(1e-30))


@dataclass
class Report:
    """Errors of one backend run against the fp64 reference, with the baseline and tolerance."""

    backend: str
    dtype: torch.dtype
    errors: dict[str, float] = field(default_factory=dict)
    baseline: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def tolerance(self, name: str) -> float:
        baseline = self.baseline[name]
        if name == "dsinks":
            # Hq sums over every row of p_sink * (dO . O), terms of both signs: their error is that
            # of O, and their own baseline, from so few values, is too noisy to stand alone.
            baseline = max(baseline, self.baseline["out"])
        return 2 * baseline + FLOOR[self.dtype]

    @property
    def passed(self) -> bool:
        return not self.notes and all(e <= self.tolerance(n) for n, e in self.errors.items())

    def failures(self) -> list[str]:
        bad = [f"{n}: {e:.3g} > tol {self.tolerance(n):.3g}" for n, e in self.errors.items() if e > self.tolerance(n)]
        return bad + self.notes


def random_inputs(
    batch: int,
    seqlen_q: int,
    seqlen_k: int,
    heads_q: int,
    heads_kv: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    seed: int = 0,
    head_dim_v: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fresh q, k, v, dout (standard normal, rounded to `dtype`) for a comparison; v and dout have
    the head dim `head_dim_v` (default: `head_dim`)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def make(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    q = make(batch, seqlen_q, heads_q, head_dim)
    k = make(batch, seqlen_k, heads_kv, head_dim)
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    v = make(batch, seqlen_k, heads_kv, head_dim_v)
    return q, k, v, make(batch, seqlen_q, heads_q, head_dim_v)


def random_sinks(heads_q: int, seqlen_k: int, device: torch.device | str = "cpu", seed: int = 0) -> torch.Tensor:
    """Attention sinks, fp32 [heads_q], about the LSE of a row over `seqlen_k` keys of unit-size
    scores (log Sk), so that each sink takes a real share of its rows' softmax."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return (math.log(seqlen_k) + 2 * torch.randn(heads_q, generator=gen)).to(device)


def _run(fn, inputs: tuple[torch.Tensor, ...], dout, backward: bool):
    """fn's (out, lse) and, with `backward`, the gradients of out (dq, dk, dv, then dsinks) for dout."""
    leaves = [x.detach().requires_grad_(backward) for x in inputs]
    out, lse = fn(*leaves)
    result = {"out": out.detach(), "lse": lse.detach()}
    if backward:
        result.update(zip(("dq", "dk", "dv", "dsinks"), torch.autograd.grad(out, leaves, dout)))
    return result


def compare(
    backend: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: ColumnMask | None,
    dout: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    sinks: torch.Tensor | None = None,
) -> Report:
    """Run `backend` and the references on the same inputs; backward too when `dout` is given.
    With `sinks` [Hq] (float), attention sinks, and their gradient (dsinks) among the tensors."""
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    backward = dout is not None
    ref_mask = mask.to(q.device) if mask is not None else None

    def run_backend(a, b, c, s=None):
        return attention(a, b, c, mask, backend=backend, softmax_scale=scale, return_lse=True, sinks=s)

    def run_reference(compute_dtype):
        def fn(a, b, c, s=None):
            out, lse = reference_attention(a, b, c, ref_mask, scale, compute_dtype, sinks=s)
            return out, lse.float()

        return fn

    inputs = (q, k, v) if sinks is None else (q, k, v, sinks)
    exact = _run(
        run_reference(torch.float64), tuple(x.double() for x in inputs), dout.double() if backward else None, backward
    )
    low = _run(run_reference(q.dtype), inputs, dout, backward)
    got = _run(run_backend, inputs, dout, backward)
    report = Report(backend, q.dtype)
    for name in exact:
        report.errors[name] = rel_l2(got[name], exact[name])
        report.baseline[name] = rel_l2(low[name], exact[name])
    if sinks is None:
        dead_ref = exact["lse"] == -math.inf
        if not torch.equal(got["lse"] == -math.inf, dead_ref):
            report.notes.append("lse: rows that see no key differ from the reference (-inf pattern)")
    else:  # the rows that see no key are those of LSE -inf without the sinks; theirs is the sink
        dead_ref = reference_attention(q.double(), k.double(), v.double(), ref_mask, scale)[1] == -math.inf
        sink_lse = sinks.float().view(1, -1, 1).expand_as(got["lse"])
        if not torch.equal(got["lse"][dead_ref], sink_lse[dead_ref]):
            report.notes.append("lse: rows that see no key do not give their sink")
    if bool(dead_ref.any()) and bool(got["out"].transpose(1, 2)[dead_ref].abs().max() != 0):
        report.notes.append("out: rows that see no key are not 0")
    return report
