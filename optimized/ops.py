"""The cute kernels as `torch.library` custom ops, so `torch.compile` keeps attention in its graph.

`flashmask3::cute_forward` runs `interface.forward` and `flashmask3::cute_backward` runs
`interface.backward`; `register_autograd` joins them. Custom ops take tensors and scalars, not
Python objects, so the mask travels as its `startend_row_indices` (None: no mask, or with
`causal` the causal mask alone), its `causal`
flag (and, to the forward, its `segmented` hint) and is rebuilt inside each op (seqlen_q from
q). The fake implementations give the outputs' shapes and dtypes without a kernel: Dynamo traces
through `attention(..., backend="cute")` with no graph break, and AOTAutograd sees the backward
as one op.

The kernels are registered for CUDA only; a CPU implementation can be added with
`cute_forward.register_kernel("cpu", fn)` (the tests do, with the reference backend).
"""

from __future__ import annotations

import torch

from ..reference import ColumnMask
from ..reference.attention import sinks_backward
from . import interface


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: ColumnMask | None,
    softmax_scale: float,
    deterministic: bool = False,
    sinks: torch.Tensor | None = None,
    causal: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, Sq, Hq, D], lse fp32 [B, Hq, Sq]) through the custom ops; differentiable in q, k, v
    (and `sinks`).

    Inputs as for `interface.forward`; the mask must already be on q's device with seqlen_q = Sq.
    `causal` with `mask` None: the causal mask alone (`interface.forward`'s `causal`).
    `deterministic` is read by the backward. `sinks` [Hq]: joined to each row's softmax in the
    forward kernel's epilogue (out and lse are `join_sinks`'s); the backward runs the kernel on
    those, where the sink is a key of value 0, and adds d(sinks).
    """
    row_indices = None if mask is None else mask.startend_row_indices
    causal, segmented = (causal, False) if mask is None else (mask.causal, mask.segmented)
    # The kernels read q, k and v in place where TMA can (transformers' [B, S, H, D] views of
    # [B, H, S, D] tensors); any copy is made here, once, and is what the backward gets back.
    q, k, v = (interface.tma_operand(x) for x in (q, k, v))
    return cute_forward(q, k, v, row_indices, causal, segmented, softmax_scale, deterministic, sinks)


def _mask(row_indices: torch.Tensor | None, causal: bool, seqlen_q: int, segmented: bool = False) -> ColumnMask | None:
    # The boundaries were checked when the caller's ColumnMask was built.
    return None if row_indices is None else ColumnMask._unchecked(row_indices, causal, seqlen_q, segmented)


@torch.library.custom_op("flashmask3::cute_forward", mutates_args=(), device_types="cuda")
def cute_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    row_indices: torch.Tensor | None,
    causal: bool,
    segmented: bool,
    softmax_scale: float,
    deterministic: bool,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Hopper forward kernel: (out, lse), with `sinks` joined in its epilogue. `deterministic` is
    an input only for the backward."""
    mask = _mask(row_indices, causal, q.shape[1], segmented)
    return interface.forward(q, k, v, mask, softmax_scale, sinks=sinks, causal=causal and mask is None)


@cute_forward.register_fake
def _forward_fake(q, k, v, row_indices, causal, segmented, softmax_scale, deterministic, sinks=None):
    b, sq, hq, _ = q.shape
    return q.new_empty((b, sq, hq, v.shape[-1])), q.new_empty((b, hq, sq), dtype=torch.float32)


@torch.library.custom_op("flashmask3::cute_backward", mutates_args=(), device_types="cuda")
def cute_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    row_indices: torch.Tensor | None,
    causal: bool,
    softmax_scale: float,
    deterministic: bool,
    dlse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The Hopper backward kernels: (dq, dk, dv), dk and dv summed over each GQA group; `dlse`: the
    gradient that reaches the LSE too, if any."""
    mask = _mask(row_indices, causal, q.shape[1])
    return interface.backward(
        dout, q, k, v, out, lse, mask, softmax_scale, deterministic, causal=causal and mask is None, dlse=dlse
    )


@cute_backward.register_fake
def _backward_fake(dout, q, k, v, out, lse, row_indices, causal, softmax_scale, deterministic, dlse=None):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, row_indices, causal, _, softmax_scale, deterministic, sinks = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, row_indices, sinks)
    ctx.causal, ctx.softmax_scale, ctx.deterministic = causal, softmax_scale, deterministic
    ctx.set_materialize_grads(False)  # an unused out or LSE brings None, not zeros


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, row_indices, sinks = ctx.saved_tensors
    dout = torch.zeros_like(out) if dout is None else dout
    dq, dk, dv = cute_backward(
        dout, q, k, v, out, lse, row_indices, ctx.causal, ctx.softmax_scale, ctx.deterministic, dlse
    )
    dsinks = None
    if sinks is not None and ctx.needs_input_grad[8]:
        dsinks = sinks_backward(dout, out, lse, sinks, torch.float32, dlse).to(sinks.dtype)
    return dq, dk, dv, None, None, None, None, None, dsinks


cute_forward.register_autograd(_backward, setup_context=_setup_context)
