"""PaddlePaddle's `paddle.nn.functional.flashmask_attention`, with its argument names and semantics,
on flashmask3's backends: code written for FlashMask runs on PyTorch tensors unchanged."""

from __future__ import annotations

import torch

from ..api import attention
from ..reference import ColumnMask
from ..reference.attention import check_attention_inputs
from ..reference.constructors import check_flag, check_int


def flashmask_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    startend_row_indices: torch.Tensor | None = None,
    *,
    dropout: float = 0.0,
    causal: bool = False,
    window_size: int | tuple[int, int] | None = None,
    return_softmax_lse: bool = False,
    return_seed_offset: bool = False,
    fixed_seed_offset: torch.Tensor | None = None,
    rng_name: str = "",
    training: bool = True,
    name: str | None = None,
    softmax_scale: float | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """FlashMask attention as PaddlePaddle calls it: softmax(Q K^T * scale + M) V, M from
    `startend_row_indices` (or `causal` / `window_size`), on `flashmask3.attention` (backend "auto").

    Args:
        query: [B, Sq, Hq, D]; key: [B, Sk, Hkv, D]; value: [B, Sk, Hkv, Dv], Hq a multiple of Hkv
            (GQA), Dv = D or not (as in `flashmask3.attention`). bf16 / fp16 as in Paddle; fp32 /
            fp64 run on the reference and flex backends.
        startend_row_indices: int32 [B or 1, 1 or Hkv or Hq, Sk, 1 | 2 | 4], FlashMask's column-wise
            mask (the `ColumnMask` format): for key column j the query rows [LTS_j, LTE_j) and
            [UTS_j, UTE_j) are masked. With `causal=True`, last dim 1 is [LTS] (LTE = Sq) and 2 is
            [LTS, LTE]; with `causal=False`, 2 is [LTS, UTE] (LTE = Sq, UTS = 0) and 4 is
            [LTS, LTE, UTS, UTE]. None: no mask beyond `causal` / `window_size`.
        dropout: the attention dropout rate; only 0 is supported while `training` (flashmask3 has
            no dropout), any value with `training=False` (Paddle applies none then).
        causal: keys after their query are masked too (bottom-right aligned when Sq != Sk).
        window_size: sliding-window attention, without `startend_row_indices`. An int w is (w, w).
            `causal=True`: query i sees keys [i - window_size[0], i]; `causal=False`: keys
            [i - window_size[0], i + window_size[1]].
        return_softmax_lse: also return the log-sum-exp of each query row, fp32 [B, Hq, Sq].
        return_seed_offset, fixed_seed_offset, rng_name: the dropout RNG's; there is no dropout, so
            asking for them (True, a tensor, a non-empty name) is a ValueError.
        training: whether dropout applies (see `dropout`).
        name: Paddle's operator name for static graphs; accepted and unused.
        softmax_scale: scale of Q K^T, default 1 / sqrt(D).

    Returns:
        out [B, Sq, Hq, Dv] in query's dtype, or (out, lse) with `return_softmax_lse`. A query row
        that sees no key gives 0.

    Example (three packed documents of 4, 3 and 3 tokens, causal)::

        rows = torch.tensor([4, 4, 4, 4, 7, 7, 7, 10, 10, 10], dtype=torch.int32).view(1, 1, 10, 1)
        out = flashmask3.flashmask_attention(q, k, v, rows, causal=True)
    """
    if dropout and training:
        raise ValueError(f"dropout={dropout} with training=True: flashmask3 has no attention dropout; pass 0")
    if return_seed_offset:
        raise ValueError("return_seed_offset=True: there is no dropout, so no RNG seed and offset to return")
    if fixed_seed_offset is not None:
        raise ValueError("fixed_seed_offset: there is no dropout RNG to seed; pass None")
    if rng_name:
        raise ValueError(f"rng_name={rng_name!r}: there is no dropout RNG to select; pass ''")
    check_attention_inputs(query, key, value, ("query", "key", "value"))  # before the mask reads their shapes
    check_flag("return_softmax_lse", return_softmax_lse)
    window = (-1, -1)
    if window_size is not None:
        if startend_row_indices is not None:
            raise ValueError("window_size and startend_row_indices cannot be given together, as in Paddle")
        window = _window(window_size, causal)
    mask = None
    if startend_row_indices is not None and query.shape[1] > 0:  # no query row: nothing to mask
        mask = ColumnMask(startend_row_indices, causal, query.shape[1])
        causal = False  # the mask carries it
    return attention(
        query,
        key,
        value,
        mask,
        causal=causal,
        window_size=window,
        softmax_scale=softmax_scale,
        return_lse=return_softmax_lse,
    )


def _window(window_size: int | tuple[int, int], causal: bool) -> tuple[int, int]:
    """Paddle's window_size as FlashAttention's (left, right)."""
    pair = window_size if isinstance(window_size, (tuple, list)) else (window_size, window_size)
    try:
        if len(pair) != 2:
            raise ValueError
        left, right = (check_int("window_size", w, 0) for w in pair)  # numpy ints too, not bools
    except ValueError:
        raise ValueError(
            f"window_size must be an int >= 0 or a pair (left, right) of them, got {window_size!r}"
        ) from None
    return (left, 0) if causal else (left, right)
