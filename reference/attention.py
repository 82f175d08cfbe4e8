"""Pure-PyTorch mask-aware attention: chunked forward with LSE and an explicit backward.

Layout is FlashAttention's: q [B, Sq, Hq, D], k [B, Sk, Hkv, D], v [B, Sk, Hkv, Dv], Hq a multiple
of Hkv; out has v's head dim Dv, which may differ from D (DeepSeek's MLA: D = 192, Dv = 128).
Work is cut into query chunks; for each chunk only the key blocks that are not fully masked (for
any batch or mask head) are gathered, and the element mask is applied only when one of them is
partial. Cost follows the mask density and memory stays O(chunk * Sk), never Sq x Sk.

Rows that see no key give output 0 and LSE -inf; their gradients are 0.

Attention sinks (gpt-oss): a learnable logit per query head that joins every row's softmax
denominator as one more key with value 0. The LSE includes it, so a row that sees no key gives
output 0 and LSE = the sink.
"""

from __future__ import annotations

import math
import numbers

import torch

from .mask import SKIP, UNMASKED, ColumnMask

KEY_BLOCK = 128
QUERY_CHUNK = 256  # rows per chunk: small enough that key selection follows the mask
_SCORE_BUDGET = 64 * 2**20  # score elements per chunk (B * Hq * rows * keys)


class _Plan:
    """The work of each query chunk: (rows, keys, needs_mask), chunks with no visible key left out.

    `keys` is a slice when the needed key blocks are contiguous, else an index tensor.
    """

    def __init__(self, mask: ColumnMask | None, batch: int, heads: int, sq: int, sk: int, device):
        rows = (_SCORE_BUDGET // max(1, batch * heads * sk)) // KEY_BLOCK * KEY_BLOCK
        chunk = max(KEY_BLOCK, min(rows, QUERY_CHUNK))
        self.chunks: list[tuple[slice, torch.Tensor | slice, bool]] = []
        if mask is None:
            if sk:  # with no key, no row sees anything: no chunk to compute
                self.chunks = [(slice(s, min(s + chunk, sq)), slice(0, sk), False) for s in range(0, sq, chunk)]
            return
        classes = mask.block_classes(chunk, KEY_BLOCK).classes.to("cpu")
        for t, s in enumerate(range(0, sq, chunk)):
            tiles = classes[:, :, t, :]  # [B, Hm, Tn]
            needed = (tiles != SKIP).flatten(0, 1).any(0).nonzero().flatten()
            if len(needed):
                needs_mask = bool((tiles[:, :, needed] != UNMASKED).any())
                keys = _block_keys(needed, sk)
                if not isinstance(keys, slice):
                    keys = keys.to(device)
                self.chunks.append((slice(s, min(s + chunk, sq)), keys, needs_mask))


def _block_keys(blocks: torch.Tensor, sk: int) -> torch.Tensor | slice:
    """Key indices of the given key blocks; a slice when they are contiguous."""
    first, last = int(blocks[0]), int(blocks[-1])
    if last - first + 1 == len(blocks):
        return slice(first * KEY_BLOCK, min((last + 1) * KEY_BLOCK, sk))
    idx = (blocks.view(-1, 1) * KEY_BLOCK + torch.arange(KEY_BLOCK).view(1, -1)).flatten()
    return idx[idx < sk]


def _take(x: torch.Tensor, keys, dim: int) -> torch.Tensor:
    if isinstance(keys, slice):
        return x.narrow(dim, keys.start, keys.stop - keys.start)
    return x.index_select(dim, keys)


def _key_index(keys, device) -> torch.Tensor:
    if isinstance(keys, slice):
        return torch.arange(keys.start, keys.stop, device=device)
    return keys


def _hidden(mask: ColumnMask, rows: slice, keys, heads_kv: int, group: int, device) -> torch.Tensor:
    """Element mask (True = masked) for a chunk, broadcastable to scores [B, Hkv, G, rows, keys]."""
    r = torch.arange(rows.start, rows.stop, device=device)
    hidden = mask.to(device).masked(r, _key_index(keys, device))  # [Bm, Hm, rows, keys]
    bm, hm = hidden.shape[:2]
    if hm == 1:
        return hidden.view(bm, 1, 1, *hidden.shape[2:])
    if hm == heads_kv:
        return hidden.view(bm, heads_kv, 1, *hidden.shape[2:])
    return hidden.view(bm, heads_kv, group, *hidden.shape[2:])


def _accumulator(compute_dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if compute_dtype == torch.float64 else torch.float32


def _split_heads(q: torch.Tensor, heads_kv: int) -> torch.Tensor:
    """[B, S, Hq, D] -> [B, Hkv, G, S, D]."""
    b, s, hq, d = q.shape
    return q.view(b, s, heads_kv, hq // heads_kv, d).permute(0, 2, 3, 1, 4)


def _merge_heads(x: torch.Tensor) -> torch.Tensor:
    """[B, Hkv, G, S, D] -> [B, S, Hq, D]."""
    b, hkv, g, s, d = x.shape
    return x.permute(0, 3, 1, 2, 4).reshape(b, s, hkv * g, d)


def forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: ColumnMask | None,
    softmax_scale: float,
    compute_dtype: torch.dtype,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (out [B, Sq, Hq, Dv], lse [B, Hq, Sq]), both in the accumulator dtype (Dv: v's head dim).

    Matmul operands and results are in `compute_dtype`; softmax statistics in fp32 (fp64 when
    computing in fp64), as the kernels keep them. `sinks` [Hq]: each query head's sink logit, in
    every row's denominator and in its LSE.
    """
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    plan = _Plan(mask, b, hq, sq, sk, q.device)
    qh = _split_heads(q.to(compute_dtype), hkv)  # [B, Hkv, G, Sq, D]
    kh = k.to(compute_dtype).permute(0, 2, 1, 3).unsqueeze(2)  # [B, Hkv, 1, Sk, D]
    vh = v.to(compute_dtype).permute(0, 2, 1, 3).unsqueeze(2)  # [B, Hkv, 1, Sk, Dv]
    acc = _accumulator(compute_dtype)
    out = torch.zeros(*qh.shape[:-1], v.shape[-1], dtype=acc, device=q.device)  # [B, Hkv, G, Sq, Dv]
    lse = torch.full(qh.shape[:-1], -math.inf, dtype=acc, device=q.device)
    if sinks is not None:
        sink = sinks.to(acc).view(1, hkv, hq // hkv, 1, 1)  # broadcasts over [B, Hkv, G, rows, 1]
        lse.copy_(sink.squeeze(-1).expand_as(lse))  # rows left out of the plan see only the sink
    for rows, keys, needs_mask in plan.chunks:
        s = (qh[..., rows, :] @ _take(kh, keys, 3).transpose(-1, -2)).to(acc) * softmax_scale
        if needs_mask and mask is not None:
            s = s.masked_fill(_hidden(mask, rows, keys, hkv, hq // hkv, q.device), -math.inf)
        m = s.amax(-1, keepdim=True)
        if sinks is not None:
            m = torch.maximum(m, sink)
        m = torch.where(torch.isinf(m), torch.zeros_like(m), m)  # fully masked rows
        p = torch.exp(s - m)
        row_sum = p.sum(-1, keepdim=True)
        if sinks is not None:
            row_sum = row_sum + torch.exp(sink - m)
        o = (p.to(compute_dtype) @ _take(vh, keys, 3)).to(acc)
        out[..., rows, :] = o / torch.where(row_sum == 0, torch.ones_like(row_sum), row_sum)
        lse[..., rows] = (m + torch.log(row_sum)).squeeze(-1)
    return _merge_heads(out), lse.flatten(1, 2)


def backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    mask: ColumnMask | None,
    softmax_scale: float,
    compute_dtype: torch.dtype,
    dlse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dQ, dK, dV from dO, O and LSE, as the kernels compute them (P = exp(S - LSE)); dQ and dK
    have q's and k's head dim D, dV (like dO and O) v's head dim Dv. `dlse` [B, Hq, Sq]: the
    gradient that reaches the LSE too, if any (`row_sums`)."""
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    plan = _Plan(mask, b, hq, sq, sk, q.device)
    qh = _split_heads(q.to(compute_dtype), hkv)
    doh = _split_heads(dout.to(compute_dtype), hkv)
    kh = k.to(compute_dtype).permute(0, 2, 1, 3).unsqueeze(2)
    vh = v.to(compute_dtype).permute(0, 2, 1, 3).unsqueeze(2)
    acc = _accumulator(compute_dtype)
    lseh = lse.view(b, hkv, hq // hkv, sq).to(acc)
    delta = row_sums(dout, out, dlse, compute_dtype).reshape(b, hkv, hq // hkv, sq)
    dq = torch.zeros(qh.shape, dtype=acc, device=q.device)
    dk = torch.zeros(b, hkv, sk, d, dtype=acc, device=q.device)
    dv = torch.zeros(b, hkv, sk, v.shape[-1], dtype=acc, device=q.device)
    for rows, keys, needs_mask in plan.chunks:
        q_c, do_c = qh[..., rows, :], doh[..., rows, :]
        k_c, v_c = _take(kh, keys, 3), _take(vh, keys, 3)
        s = (q_c @ k_c.transpose(-1, -2)).to(acc) * softmax_scale
        row_lse = lseh[..., rows].unsqueeze(-1)
        p = torch.exp(s - torch.where(torch.isinf(row_lse), torch.full_like(row_lse, math.inf), row_lse))
        if needs_mask and mask is not None:
            p = p.masked_fill(_hidden(mask, rows, keys, hkv, hq // hkv, q.device), 0)
        dv_c = (p.to(compute_dtype).transpose(-1, -2) @ do_c).to(acc).sum(2)  # sum over the group
        dp = (do_c @ v_c.transpose(-1, -2)).to(acc)
        ds = (p * (dp - delta[..., rows].unsqueeze(-1))).to(compute_dtype)
        dq[..., rows, :] = (ds @ k_c).to(acc) * softmax_scale
        dk_c = (ds.transpose(-1, -2) @ q_c).to(acc).sum(2) * softmax_scale
        if isinstance(keys, slice):
            dk[:, :, keys] += dk_c
            dv[:, :, keys] += dv_c
        else:
            dk.index_add_(2, keys, dk_c)
            dv.index_add_(2, keys, dv_c)
    return _merge_heads(dq), dk.permute(0, 2, 1, 3), dv.permute(0, 2, 1, 3)


def row_sums(
    dout: torch.Tensor, out: torch.Tensor, dlse: torch.Tensor | None, compute_dtype: torch.dtype
) -> torch.Tensor:
    """Delta [B, Hq, Sq] in the accumulator dtype: rowsum(dO * O), less `dlse` [B, Hq, Sq] where
    the LSE has a gradient of its own. With L = log sum_j exp(s_j), dL/ds_j = P_j, so dS = P * (dP
    - rowsum(dO * O)) + P * dL = P * (dP - (rowsum(dO * O) - dL)): the LSE's gradient is the row
    sum less dL, and nothing else changes."""
    acc = _accumulator(compute_dtype)
    delta = (dout.to(compute_dtype).to(acc) * out.to(compute_dtype).to(acc)).sum(-1).transpose(1, 2)
    return delta if dlse is None else delta - dlse.to(acc)


def sinks_backward(
    dout: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    sinks: torch.Tensor,
    compute_dtype: torch.dtype,
    dlse: torch.Tensor | None = None,
) -> torch.Tensor:
    """d(sinks) [Hq] in the accumulator dtype, from dO, O and the LSE that includes the sinks
    (`dlse`: the gradient that reaches that LSE too, if any).

    With L the row's LSE, out = sum_j exp(s_j - L) v_j and dL/d(sink) = exp(sink - L), the sink's
    probability, so d(out)/d(sink) = -exp(sink - L) * out and d(sink) = -sum over the batch and
    rows of exp(sink - L) * (rowsum(dO * O) - dL) (`row_sums`). dQ, dK and dV need nothing more
    than `backward` with this L: the sink is a key of value 0.
    """
    acc = _accumulator(compute_dtype)
    delta = row_sums(dout, out, dlse, compute_dtype)  # [B, Hq, Sq]
    sink = sinks.to(acc).view(1, -1, 1)
    # A sink of -inf takes no share of any row, not even of one that sees no key (L = -inf too,
    # where exp(sink - L) would be NaN).
    sink_probability = torch.where(torch.isneginf(sink), 0.0, torch.exp(sink - lse.to(acc)))  # [B, Hq, Sq]
    return -(sink_probability * delta).sum((0, 2))


def join_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention sinks applied to a backend's (out [B, Sq, Hq, Dv], lse [B, Hq, Sq]) after the fact.

    With L = lse and s the head's sink, the sink's term in the denominator scales every key's
    probability by exp(L) / (exp(L) + exp(s)) = sigmoid(L - s): out * sigmoid(L - s), and the
    LSE becomes logaddexp(L, s). Exact; autograd brings dsinks, and the backend's gradients through
    its lse, provided that lse is differentiable. A row that sees no key (L = -inf) gives 0 and s;
    with s = -inf too it gives 0 and -inf, and no gradient. A sink of -inf leaves the other rows
    as they were. Computed in lse's dtype (out scaled in the wider of the two); out keeps its own.
    """
    sink = sinks.to(lse.dtype).view(1, -1, 1)  # [1, Hq, 1] against lse [B, Hq, Sq]
    # Rows that see neither a key nor a sink: L - s and logaddexp's gradient would be NaN there.
    # L is made finite in them before the arithmetic (so that the backward of the branch that
    # torch.where drops is finite too) and their results set after it.
    empty = torch.isneginf(lse) & torch.isneginf(sink)  # [B, Hq, Sq]
    finite_lse = lse.masked_fill(empty, 0.0)
    keys_share = torch.where(empty, 0.0, torch.sigmoid(finite_lse - sink))
    joined_lse = torch.where(empty, -math.inf, torch.logaddexp(finite_lse, sink))
    scaled = out.to(torch.promote_types(out.dtype, lse.dtype)) * keys_share.transpose(1, 2).unsqueeze(-1)
    return scaled.to(out.dtype), joined_lse


class ReferenceAttention(torch.autograd.Function):
    """Differentiable reference attention; the backward is the explicit one above."""

    @staticmethod
    def forward(ctx, q, k, v, mask, softmax_scale, compute_dtype, sinks):
        out, lse = forward(q, k, v, mask, softmax_scale, compute_dtype, sinks)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.mask, ctx.softmax_scale, ctx.compute_dtype = mask, softmax_scale, compute_dtype
        ctx.set_materialize_grads(False)  # an unused out or LSE brings None, not zeros
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        dout = torch.zeros_like(out) if dout is None else dout
        dq, dk, dv = backward(dout, q, k, v, out, lse, ctx.mask, ctx.softmax_scale, ctx.compute_dtype, dlse)
        dsinks = None
        if sinks is not None and ctx.needs_input_grad[6]:
            dsinks = sinks_backward(dout, out, lse, sinks, ctx.compute_dtype, dlse).to(sinks.dtype)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, dsinks


ATTENTION_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def check_attention_inputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, names: tuple[str, str, str] = ("q", "k", "v")
) -> None:
    """q [B, Sq, Hq, D], k [B, Sk, Hkv, D], v [B, Sk, Hkv, Dv] as every entry point takes them: one
    floating dtype and device, Hq a multiple of Hkv, at least one head and one head-dim column;
    errors name the arguments as `names` (the caller's)."""
    qn, kn, vn = names
    for name, t in zip(names, (q, k, v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D [B, S, H, D], got shape {tuple(t.shape)}")
        if t.dtype not in ATTENTION_DTYPES:
            raise TypeError(f"{name} dtype must be one of bf16, fp16, fp32, fp64, got {t.dtype}")
        if t.shape[2] == 0:
            raise ValueError(f"{name} heads (H of [B, S, H, D]) must be >= 1, got shape {tuple(t.shape)}")
        if t.shape[3] == 0:
            raise ValueError(f"{name} head dim (D of [B, S, H, D]) must be >= 1, got shape {tuple(t.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"{qn}, {kn}, {vn} must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"{qn}, {kn}, {vn} must be on one device, got {q.device}, {k.device}, {v.device}")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(
            f"{kn} and {vn} must have the same batch, length and heads ({kn} [B, Sk, Hkv, D], {vn} [B, Sk, Hkv, Dv]; "
            f"only the head dims may differ), got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"{qn} and {kn} must have the same batch size, got {q.shape[0]} and {k.shape[0]}")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"{qn} and {kn} must have the same head dim, got {q.shape[3]} and {k.shape[3]}")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"{qn} heads ({q.shape[2]}) must be a multiple of {kn}/{vn} heads ({k.shape[2]})")


def check_sinks(sinks: torch.Tensor, q: torch.Tensor) -> None:
    """Shape [Hq], dtype and device of `sinks` against q [B, Sq, Hq, D] (never its values: no host
    sync), as every entry point that takes sinks checks them."""
    if not isinstance(sinks, torch.Tensor):
        raise TypeError(f"sinks must be a torch.Tensor [Hq] or None, got {type(sinks).__name__}")
    heads_q = q.shape[2]
    if sinks.shape != (heads_q,):
        raise ValueError(
            f"sinks must be a 1-D tensor [Hq] = [{heads_q}], one logit per query head, got shape {tuple(sinks.shape)}"
        )
    if sinks.dtype not in ATTENTION_DTYPES:
        raise TypeError(f"sinks dtype must be one of bf16, fp16, fp32, fp64, got {sinks.dtype}")
    if sinks.device != q.device:
        raise ValueError(f"sinks must be on q's device ({q.device}), got {sinks.device}")


def check_softmax_scale(softmax_scale: object) -> None:
    """`softmax_scale`: None (1/sqrt(D)) or a positive finite real number (a symbolic one under
    torch.compile is taken as it is). The kernels' online softmax takes row maxima of the unscaled
    scores and scales masked -inf scores, so 0 or a negative scale would give NaN there."""
    if softmax_scale is None or isinstance(softmax_scale, (torch.SymFloat, torch.SymInt)):
        return
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
        raise TypeError(
            f"softmax_scale must be a float or None (1/sqrt(D)), got {type(softmax_scale).__name__}"
            + ("; pass float(scale)" if isinstance(softmax_scale, torch.Tensor) else "")
        )
    if not (math.isfinite(softmax_scale) and float(softmax_scale) > 0):
        raise ValueError(f"softmax_scale must be a positive finite float, got {softmax_scale}")


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: ColumnMask | None,
    softmax_scale: float,
    compute_dtype: torch.dtype | None = None,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Differentiable (out [B, Sq, Hq, Dv], lse [B, Hq, Sq]), lse not differentiated; Dv is v's head
    dim, which may differ from q's and k's. `compute_dtype` defaults to fp32 (fp64 for fp64
    inputs); pass the input dtype to emulate a low-precision computation (the verify baseline).
    `sinks`: float [Hq], each query head's sink logit (differentiable), or None."""
    if compute_dtype is None:
        compute_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return ReferenceAttention.apply(q, k, v, mask, softmax_scale, compute_dtype, sinks)
