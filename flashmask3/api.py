"""Public entry points: `attention(q, k, v, mask, backend=...)` and FlashAttention's drop-in forms
(`attention(q, k, v, causal=..., window_size=...)`, `varlen_attention` over packed documents)."""

from __future__ import annotations

import functools
import math
from typing import Literal

import torch

from . import peers
from .memo import TensorMemo
from .optimized import ops
from .optimized.interface import requires_backward, unsupported_error, unsupported_reason
from .reference import ColumnMask
from .reference.attention import (
    check_attention_inputs,
    check_sinks,
    check_softmax_scale,
    join_sinks,
    reference_attention,
)
from .reference.constructors import check_flag, is_int

Backend = Literal["auto", "reference", "cute", "sdpa", "flex"]
BACKENDS: tuple[str, ...] = ("auto", "reference", "cute", "sdpa", "flex")


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: ColumnMask | None = None,
    *,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    backend: Backend = "auto",
    softmax_scale: float | None = None,
    return_lse: bool = False,
    deterministic: bool = False,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Mask-aware scaled dot-product attention.

    Args:
        q: [B, Sq, Hq, D] queries (bf16, fp16, fp32 or fp64).
        k: [B, Sk, Hkv, D] keys, with q's head dim D; Hq must be a multiple of Hkv (GQA / MQA).
        v: [B, Sk, Hkv, Dv] values: k's batch, length and heads, and a head dim Dv that may differ
            from D (DeepSeek's MLA: D = 192, Dv = 128) on the reference, sdpa and flex backends;
            cute takes (D, Dv) = (64, 64), (128, 128), (192, 128) and (256, 256), and (128, 64)
            in the forward only (with inputs that require grad "auto" falls back to flex there).
            q, k, v share a dtype and a device.
        mask: a `ColumnMask` (FlashMask column-wise format) or None for full attention. Use its
            constructors (`ColumnMask.causal_document(cu_seqlens)`, ...), `masks.build(...)`,
            `ColumnMask.from_dense` or `ColumnMask.from_mask_mod` to make one.
        causal, window_size: FlashAttention's arguments, for calls without `mask` (the mask is
            built from them on q's device). `causal=True` hides the keys after each query,
            bottom-right aligned when Sq != Sk. `window_size=(left, right)` shows key j to query i
            iff i + Sk - Sq - left <= j <= i + Sk - Sq + right, -1 meaning unbounded; with
            causal=True, right must be 0 or -1. Given together with `mask`: ValueError.
        backend: "reference" (pure PyTorch, any device), "cute" (the CuTe DSL Hopper kernels:
            bf16/fp16, sm_90; head dims as for v above), "sdpa" (torch SDPA with a dense mask),
            "flex" (FlexAttention with a BlockMask), or "auto": cute where it supports the inputs,
            else flex on CUDA, else reference.
        softmax_scale: scale of q.k, a finite float; default 1/sqrt(D), D being q's (and k's)
            head dim.
        return_lse: also return the log-sum-exp of the scaled scores, fp32 [B, Hq, Sq];
            differentiable on every backend (a loss on it reaches dQ, dK and the sinks).
        deterministic: the cute backward adds dQ in a fixed order (and keeps its key tiles'
            dK and dV whole, never split over several CTAs), so gradients are bitwise identical
            run to run (slightly slower; without it dQ's adds, and where a long key tile is split
            its dK and dV, sum in the order the GPU runs them); the reference is deterministic anyway; sdpa
            and flex run their own backward as it is (also where "auto" falls back to flex).
        sinks: learnable attention sinks (gpt-oss): a floating-point tensor [Hq] on q's device,
            one logit per query head (GQA: per query head, not per kv head), any float dtype; it
            may require grad. Each query row's softmax gets one more term in its denominator:
            p_ij = exp(s_ij) / (sum_j exp(s_ij) + exp(sinks[h])), out_i = sum_j p_ij v_j, and the
            returned lse includes it: logaddexp(lse, sinks[h]). The reference computes it
            directly, cute's forward kernel in its epilogue; sdpa and flex apply it to their
            (out, lse) after the fact, exactly: out * sigmoid(lse - sink). cute's backward runs
            its kernel on the joined out and lse (the sink is a key of value 0) and adds
            d(sinks); sdpa's and flex's gradients flow through their differentiable lse. Every
            backend takes them.

    Returns:
        out [B, Sq, Hq, Dv] (v's head dim) in q's dtype (and lse if asked). Softmax runs in fp32.
        A query row that sees no key gives out = 0 and lse = -inf (never NaN), and zero
        gradients; so does every row when Sk = 0, on any backend. With sinks such a row gives
        out = 0 and lse = its sink. B = 0 or Sq = 0 gives empty results; 0 heads or head dim 0 is
        a ValueError.
    """
    check_attention_inputs(q, k, v)
    check_softmax_scale(softmax_scale)
    check_flag("return_lse", return_lse)
    check_flag("deterministic", deterministic)
    if sinks is not None:
        check_sinks(sinks, q)
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    window = _check_flash_arguments(causal, window_size)
    causal_alone = mask is None and causal and window[0] < 0  # the kernels take it without its bounds
    if mask is None:
        mask = _flash_attention_mask(causal, window, sq, sk, q.device)
    elif causal or window != (-1, -1):
        raise ValueError(
            "pass either mask or FlashAttention's causal / window_size, not both: the mask already "
            f"says which keys each query sees (got a mask and causal={causal}, window_size={window})"
        )
    if mask is not None:
        if isinstance(mask, torch.Tensor):
            raise TypeError(
                f"mask must be a ColumnMask or None, got a {mask.dtype} tensor of shape {tuple(mask.shape)}; "
                "convert a dense bool mask (True = attend) with ColumnMask.from_dense(mask)"
            )
        if not isinstance(mask, ColumnMask):
            raise TypeError(f"mask must be a ColumnMask or None, got {type(mask).__name__}")
        mask.check_compatible(b, hq, hkv, sq, sk)
        if mask.device != q.device:
            mask = mask.to(q.device)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(d)
    if 0 in (b, sq, sk) and backend in BACKENDS:
        # Nothing to compute, or no key at all (every row sees nothing: out 0, lse -inf): the
        # reference answers it on any backend, without a kernel launch over an empty grid or a
        # reduction over an empty key axis.
        backend = "reference"
    if backend == "auto":
        backend = _auto_backend(q, k, v, requires_backward(q, k, v, sinks))
    if backend == "reference":
        out, lse = reference_attention(q, k, v, mask, softmax_scale, sinks=sinks)
    elif backend == "sdpa":  # its lse is None only where not asked for (no lse and no sinks)
        out, lse = peers.sdpa_attention(  # type: ignore[assignment]
            q, k, v, mask, softmax_scale, return_lse or sinks is not None
        )
    elif backend == "cute":
        reason = _cute_unsupported(q, k, v, requires_backward(q, k, v, sinks))
        if reason:
            raise unsupported_error(reason, q)
        out, lse = ops.attention(
            q, k, v, None if causal_alone else mask, softmax_scale, deterministic, sinks, causal_alone
        )
    elif backend == "flex":
        out, lse = peers.flex_attention(q, k, v, mask, softmax_scale)
    else:
        raise ValueError(f"unknown backend {backend!r}; accepted: {', '.join(BACKENDS)}")
    if sinks is not None and backend in ("sdpa", "flex"):  # the reference and cute joined them already
        out, lse = join_sinks(out, lse, sinks)
    return (out, lse.float()) if return_lse else out


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    causal: bool = False,
    softmax_scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    return_lse: bool = False,
    deterministic: bool = False,
    backend: Backend = "auto",
    sinks: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """FlashAttention's `flash_attn_varlen_func`: attention within each packed document.

    The documents stay packed as one row of tokens, attended with a document mask: with equal
    packings `ColumnMask.document` / `.causal_document` cut to the window, else the non-causal
    two-bound mask of each key's document rows: the same kernels as `attention`, no varlen kernel
    of their own.

    Args:
        q: [total_q, Hq, D]; k: [total_k, Hkv, D]; v: [total_k, Hkv, Dv] (dtypes, GQA and head dims
            as in `attention`: Dv may differ from D).
        cu_seqlens_q, cu_seqlens_k: int32 or int64 [N + 1] boundaries of the N documents' queries
            and keys, 0 first, total_q and total_k last. Where they differ (a document with more
            keys than queries, e.g. a chunk of queries against its cached keys), causal and the
            window are aligned bottom-right within each document, as FlashAttention's; a document
            with no keys gives its queries output 0 and LSE -inf. Equal packings compute as one
            document mask over Sq = Sk (the causal kernels' path): pass the same tensor twice to
            skip comparing them, which reads them on the host.
        max_seqlen_q, max_seqlen_k: accepted for FlashAttention compatibility and not needed:
            the mask carries every document's length.
        causal, window_size: as in `attention`, within each document.
        softmax_scale, return_lse, deterministic, backend, sinks: as in `attention` (FA4's
            `learnable_sink`: one logit per query head, joined to every row's softmax).

    Returns:
        out [total_q, Hq, Dv] in q's dtype (and lse fp32 [Hq, total_q], FlashAttention's varlen
        layout, if asked).
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name} must be a 3-D tensor [total, H, D], got {shape}")
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if (
            not isinstance(cu, torch.Tensor)
            or cu.dim() != 1
            or cu.shape[0] < 2
            or cu.dtype not in (torch.int32, torch.int64)
        ):
            got = f"{cu.dtype} {tuple(cu.shape)}" if isinstance(cu, torch.Tensor) else type(cu).__name__
            raise ValueError(f"{name} must be an int32 or int64 tensor [N + 1] with N >= 1, got {got}")
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(
            "cu_seqlens_q and cu_seqlens_k must bound the same N documents, shape [N + 1] each, got "
            f"{tuple(cu_seqlens_q.shape)} and {tuple(cu_seqlens_k.shape)}"
        )
    if cu_seqlens_q.device != cu_seqlens_k.device:
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must be on one device, got {cu_seqlens_q.device} and {cu_seqlens_k.device}"
        )
    if v.shape[:2] != k.shape[:2]:
        raise ValueError(
            f"v must be [total_k, Hkv, Dv] with k's total and Hkv (k is {tuple(k.shape)}), got {tuple(v.shape)}"
        )
    _check_packing("cu_seqlens_q", cu_seqlens_q, q.shape[0], "total_q")
    _check_packing("cu_seqlens_k", cu_seqlens_k, k.shape[0], "total_k")
    window = _check_flash_arguments(causal, window_size)
    run = functools.partial(
        attention,
        backend=backend,
        softmax_scale=softmax_scale,
        return_lse=return_lse,
        deterministic=deterministic,
        sinks=sinks,
    )
    if 0 in (q.shape[0], k.shape[0]):  # no query, or no key for any: nothing to mask
        return _varlen_result(run(q[None], k[None], v[None]))
    same_packing = q.shape[0] == k.shape[0] and (
        cu_seqlens_q is cu_seqlens_k or torch.equal(cu_seqlens_q, cu_seqlens_k.to(cu_seqlens_q.dtype))
    )
    # Built on cu_seqlens's device, where CPU metadata gets checked; attention moves it to q's.
    mask = _flash_attention_mask(
        causal,
        window,
        q.shape[0],
        k.shape[0],
        q.device,
        cu_seqlens=cu_seqlens_q,
        cu_seqlens_k=None if same_packing else cu_seqlens_k,
    )
    return _varlen_result(run(q[None], k[None], v[None], mask))


def _varlen_result(
    result: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`attention`'s batch of one as FlashAttention's varlen layout: out [total, H, Dv], lse [H, total]."""
    if isinstance(result, tuple):
        out, lse = result
        return out[0], lse[0]
    return result[0]


def _check_packing(name: str, cu_seqlens: torch.Tensor, total: int, total_name: str) -> None:
    """FlashAttention's boundaries: 0 first, non-decreasing, `total` last. Read only where they are on
    the CPU (on a GPU that would be a host sync; there the mask clamps them instead)."""
    if cu_seqlens.device.type != "cpu":
        return
    if cu_seqlens[0] != 0 or bool((cu_seqlens[1:] < cu_seqlens[:-1]).any()) or cu_seqlens[-1] != total:
        raise ValueError(
            f"{name} must go from 0 to {total_name}={total} without decreasing (the documents' boundaries), "
            f"got {cu_seqlens.tolist()}"
        )


def _check_flash_arguments(causal: bool, window_size: tuple[int, int]) -> tuple[int, int]:
    """FlashAttention's causal / window_size checked; window_size as a tuple."""
    check_flag("causal", causal)
    if (
        not isinstance(window_size, (tuple, list))
        or len(window_size) != 2
        or not all(is_int(w) and w >= -1 for w in window_size)
    ):
        raise ValueError(
            f"window_size must be a pair (left, right) of ints >= -1 (-1 = unbounded), got {window_size!r}"
        )
    left, right = (int(w) for w in window_size)  # a numpy int goes on as a plain int
    if causal and right > 0:
        raise ValueError(
            f"window_size[1] must be 0 or -1 with causal=True (no key after its query is seen), got {right}"
        )
    return left, right


def _flash_attention_mask(
    causal: bool,
    window: tuple[int, int],
    seqlen_q: int,
    seqlen_k: int,
    device: torch.device,
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
) -> ColumnMask | None:
    """The mask of FlashAttention's causal / window_size (and documents: `cu_seqlens`, with
    `cu_seqlens_k` where the keys are packed differently); None for full attention. Kept for the
    next calls with the same arguments (and the same cu_seqlens tensors, unchanged): the layers of a
    model share it, and the kernels' work orders with it."""
    if not causal and window == (-1, -1) and cu_seqlens is None:
        return None
    key = (causal, window, seqlen_q, seqlen_k, str(device), cu_seqlens_k is None)
    tensors = [t for t in (cu_seqlens, cu_seqlens_k) if t is not None]

    def build() -> ColumnMask:
        return ColumnMask._band(
            seqlen_q, seqlen_k, *window, causal, cu_seqlens=cu_seqlens, cu_seqlens_k=cu_seqlens_k, device=device
        )

    return build() if torch.compiler.is_compiling() else _flash_masks.get(key, tensors, build)


_flash_masks: TensorMemo[ColumnMask] = TensorMemo(size=4)


def _auto_backend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backward: bool) -> Backend:
    if not q.is_cuda:
        return "reference"
    return "flex" if _cute_unsupported(q, k, v, backward) else "cute"


def _cute_unsupported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backward: bool) -> str | None:
    """`unsupported_reason` (`backward`: the gradients too), which reads shapes, devices, dtypes and
    installed packages, never tensor values: under torch.compile it is evaluated once at trace time
    instead of traced (no graph break)."""
    if torch.compiler.is_compiling():
        return _cute_unsupported_at_trace(q.device, q.dtype, int(q.shape[-1]), int(v.shape[-1]), backward)
    return unsupported_reason(q, k, v, backward)


@torch.compiler.assume_constant_result
def _cute_unsupported_at_trace(
    device: torch.device, dtype: torch.dtype, head_dim: int, head_dim_v: int, backward: bool
) -> str | None:
    qk, v = (torch.empty(0, d, dtype=dtype, device=device) for d in (head_dim, head_dim_v))
    return unsupported_reason(qk, qk, v, backward)
