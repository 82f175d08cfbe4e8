"""Public entry point: `attention(q, k, v, mask, backend=...)`."""

from __future__ import annotations

import math
from typing import Literal

import torch

from . import peers
from .reference import ColumnMask
from .optimized.interface import cute_attention, unsupported_reason
from .reference.attention import reference_attention

Backend = Literal["auto", "reference", "cute", "sdpa", "flex"]
BACKENDS: tuple[str, ...] = ("auto", "reference", "cute", "sdpa", "flex")
_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: ColumnMask | None = None,
    *,
    backend: Backend = "auto",
    softmax_scale: float | None = None,
    return_lse: bool = False,
    deterministic: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Mask-aware scaled dot-product attention.

    Args:
        q: [B, Sq, Hq, D] queries (bf16, fp16, fp32 or fp64).
        k, v: [B, Sk, Hkv, D] keys and values, same dtype and device; Hq must be a multiple of Hkv
            (GQA / MQA).
        mask: a `ColumnMask` (FlashMask column-wise format) or None for full attention. Use
            `masks.build(...)`, `ColumnMask.from_dense` or `ColumnMask.from_mask_mod` to make one.
        backend: "reference" (pure PyTorch, any device), "cute" (the CuTe DSL Hopper kernel:
            bf16/fp16, head dim 64/128, sm_90), "sdpa" (torch SDPA with a dense mask), "flex"
            (FlexAttention with a BlockMask), or "auto": cute where it supports the inputs, else
            flex on CUDA, else reference.
        softmax_scale: scale of q.k; default 1/sqrt(D).
        return_lse: also return the log-sum-exp of the scaled scores, fp32 [B, Hq, Sq].
        deterministic: the cute backward adds dQ in a fixed order, so gradients are bitwise
            identical run to run (slightly slower); the reference is deterministic anyway.

    Returns:
        out [B, Sq, Hq, D] in q's dtype (and lse if asked). Softmax runs in fp32. A query row that
        sees no key gives out = 0 and lse = -inf (never NaN), and zero gradients.
    """
    _check_inputs(q, k, v)
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    if mask is not None:
        if not isinstance(mask, ColumnMask):
            raise TypeError(f"mask must be a ColumnMask or None, got {type(mask).__name__}")
        mask.check_compatible(b, hq, hkv, sq, sk)
        if mask.device != q.device:
            mask = mask.to(q.device)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(d)
    if backend == "auto":
        backend = _auto_backend(q, k)
    if backend == "reference":
        out, lse = reference_attention(q, k, v, mask, softmax_scale)
        lse = lse.float()
    elif backend == "sdpa":
        out, lse = peers.sdpa_attention(q, k, v, mask, softmax_scale, return_lse)
    elif backend == "cute":
        out, lse = cute_attention(q, k, v, mask, softmax_scale, deterministic)
    elif backend == "flex":
        out, lse = peers.flex_attention(q, k, v, mask, softmax_scale)
    else:
        raise ValueError(f"unknown backend {backend!r}; accepted: {', '.join(BACKENDS)}")
    return (out, lse) if return_lse else out


def _auto_backend(q: torch.Tensor, k: torch.Tensor) -> str:
    if not q.is_cuda:
        return "reference"
    return "flex" if unsupported_reason(q, k) else "cute"


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D [B, S, H, D], got shape {tuple(t.shape)}")
        if t.dtype not in _DTYPES:
            raise TypeError(f"{name} dtype must be one of bf16, fp16, fp32, fp64, got {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"q and k must have the same batch size, got {q.shape[0]} and {k.shape[0]}")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"q and k must have the same head dim, got {q.shape[3]} and {k.shape[3]}")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"q heads ({q.shape[2]}) must be a multiple of k/v heads ({k.shape[2]})")
