import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    # Without a GPU the CuTe DSL targets sm_100a; compile checks of the Hopper kernel need sm_90a.
    # It is read when cutlass is first imported, so it is set before any test imports it.
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

from flashmask3.reference import ColumnMask
from flashmask3.reference import attention as reference


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def random_column_mask(gen: torch.Generator, batch, heads, seqlen_q, seqlen_k, causal, width) -> ColumnMask:
    """A random valid ColumnMask of the given variant (start <= end within each pair)."""
    pairs = []
    for _ in range(width // 2 if width > 1 else 1):
        a = torch.randint(0, seqlen_q + 1, (batch, heads, seqlen_k, 2), generator=gen)
        pairs.append(a.sort(-1).values)
    if width == 1:
        idx = pairs[0][..., :1]
    elif causal or width == 4:
        idx = torch.cat(pairs, -1)
    else:  # non-causal [LTS, UTE]: independent
        idx = torch.stack([pairs[0][..., 0], pairs[0][..., 1]], -1)
    return ColumnMask(idx.to(torch.int32), causal, seqlen_q)


def plain_causal_mask(batch, seqlen_q, seqlen_k, width, device) -> ColumnMask:
    """The causal mask alone (bottom-right aligned when Sq != Sk) in the causal variant of `width`
    bounds per key: every bound at Sq, so no interval hides a row and only the diagonal cuts tiles."""
    bounds = torch.full((batch, 1, seqlen_k, width), seqlen_q, dtype=torch.int32, device=device)
    return ColumnMask(bounds, True, seqlen_q)


# -- the cute custom ops on the CPU ----------------------------------------------------------------
def _op_mask(q, k, row_indices, causal) -> ColumnMask | None:
    """The mask the custom ops' arguments stand for (no boundaries: none, or the causal one alone)."""
    if row_indices is None:
        return plain_causal_mask(1, q.shape[1], k.shape[1], 1, q.device) if causal else None
    return ColumnMask._unchecked(row_indices, causal, q.shape[1])


def _reference_forward(q, k, v, row_indices, causal, segmented, softmax_scale, deterministic, sinks=None):
    mask = _op_mask(q, k, row_indices, causal)
    out, lse = reference.forward(q, k, v, mask, softmax_scale, torch.float64)
    out, lse = out.to(q.dtype).contiguous(), lse.float().contiguous()
    return (out, lse) if sinks is None else reference.join_sinks(out, lse, sinks)


def _reference_backward(dout, q, k, v, out, lse, row_indices, causal, softmax_scale, deterministic, dlse=None):
    mask = _op_mask(q, k, row_indices, causal)
    grads = reference.backward(dout, q, k, v, out, lse, mask, softmax_scale, torch.float64, dlse)
    return tuple(g.to(x.dtype).contiguous() for g, x in zip(grads, (q, k, v)))


@pytest.fixture
def cute_on_cpu(monkeypatch):
    """The custom ops on CPU through the reference (the kernels are registered for CUDA only), and
    `backend="cute"` let through on CPU."""
    from flashmask3.optimized import ops

    import flashmask3.api as api

    ops.cute_forward.register_kernel("cpu", _reference_forward)
    ops.cute_backward.register_kernel("cpu", _reference_backward)
    monkeypatch.setattr(api, "unsupported_reason", lambda *inputs, **kwargs: None)


def dense_attention(q, k, v, attend, scale, sinks=None):
    """Textbook attention in q's dtype: (out [B, Sq, Hq, Dv], lse [B, Hq, Sq]). attend: bool
    [B or 1, 1 or Hkv or Hq, Sq, Sk] (True = attend) or None; `sinks` [Hq]: one more softmax column
    per row, a key of value 0. Rows that see nothing give 0 (and lse -inf, or the sink)."""
    group = q.shape[2] // k.shape[2]
    qh = q.transpose(1, 2)
    kh, vh = (x.transpose(1, 2).repeat_interleave(group, 1) for x in (k, v))
    scores = qh @ kh.transpose(-1, -2) * scale
    if attend is not None:
        if attend.shape[1] not in (1, q.shape[2]):
            attend = attend.repeat_interleave(q.shape[2] // attend.shape[1], 1)
        scores = scores.masked_fill(~attend, -math.inf)
    if sinks is not None:
        scores = torch.cat([scores, sinks.view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)], -1)
    lse = torch.logsumexp(scores, -1)
    p = torch.softmax(scores, -1).nan_to_num(0.0)
    if sinks is not None:
        p = p[..., :-1]
    return (p @ vh).transpose(1, 2), lse
