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

TENSORS = ("out", "lse", "dq", "dk", "dv")


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
        return 2 * self.baseline[name] + FLOOR[self.dtype]

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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fresh q, k, v, dout (standard normal, rounded to `dtype`) for a comparison."""
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def make(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    q = make(batch, seqlen_q, heads_q, head_dim)
    k = make(batch, seqlen_k, heads_kv, head_dim)
    v = make(batch, seqlen_k, heads_kv, head_dim)
    return q, k, v, make(batch, seqlen_q, heads_q, head_dim)


def _run(fn, q, k, v, dout, backward: bool):
    qs, ks, vs = (x.detach().requires_grad_(backward) for x in (q, k, v))
    out, lse = fn(qs, ks, vs)
    result = {"out": out.detach(), "lse": lse.detach()}
    if backward:
        result.update(zip(("dq", "dk", "dv"), torch.autograd.grad(out, (qs, ks, vs), dout)))
    return result


def compare(
    backend: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: ColumnMask | None,
    dout: torch.Tensor | None = None,
    softmax_scale: float | None = None,
) -> Report:
    """Run `backend` and the references on the same inputs; backward too when `dout` is given."""
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[-1])
    backward = dout is not None
    ref_mask = mask.to(q.device) if mask is not None else None

    def run_backend(a, b, c):
        return attention(a, b, c, mask, backend=backend, softmax_scale=scale, return_lse=True)

    def run_reference(compute_dtype):
        def fn(a, b, c):
            out, lse = reference_attention(a, b, c, ref_mask, scale, compute_dtype)
            return out, lse.float()

        return fn

    exact = _run(
        run_reference(torch.float64), q.double(), k.double(), v.double(), dout.double() if backward else None, backward
    )
    low = _run(run_reference(q.dtype), q, k, v, dout, backward)
    got = _run(run_backend, q, k, v, dout, backward)
    report = Report(backend, q.dtype)
    for name in exact:
        report.errors[name] = rel_l2(got[name], exact[name])
        report.baseline[name] = rel_l2(low[name], exact[name])
    dead_ref = exact["lse"] == -math.inf
    if not torch.equal(got["lse"] == -math.inf, dead_ref):
        report.notes.append("lse: rows that see no key differ from the reference (-inf pattern)")
    if bool(dead_ref.any()) and bool(got["out"].transpose(1, 2)[dead_ref].abs().max() != 0):
        report.notes.append("out: rows that see no key are not 0")
    return report
