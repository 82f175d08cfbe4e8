"""Hugging Face transformers (5.x): flashmask3 as `attn_implementation="fm3"` (`hf.NAME`).

    from flashmask3.integrations import hf
    hf.register()
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation=hf.NAME)

The name has no "flash" in it: transformers takes every implementation whose name contains
"flash" for FlashAttention (it loads a flash kernel for it and unpads inputs for it).

`register()` adds an attention function (`AttentionInterface`) and a mask function
(`AttentionMaskInterface`). The mask function describes the model's mask (causal or bidirectional,
a sliding window, the 2-D padding mask, cache offsets) without building anything; the first
attention call of a forward (per window, where sliding and full layers alternate) builds the
`ColumnMask` from that description and its own arguments in O(S), on the device, with no host sync,
and the other layers reuse it (under torch.compile, and for inference tensors, each call builds
it); each call runs `flashmask3.attention` (GQA included).

Packed batches (`DataCollatorWithFlattening`): the documents come from `cu_seq_lens_q` /
`cu_seq_lens_k` when the call has them, else, as HF's FlashAttention integration infers them
(`_is_packed_sequence`), from the `position_ids` of a batch of one without a 2-D `attention_mask`:
a new document wherever the position restarts (drops to the row's minimum, 0 from the collator).
Positions that only jump (PoSE-style, [0..9, 50..59]), a call with a 2-D `attention_mask` (where
HF's sdpa and flex masks do not look for packing either) and a batch of several rows give one
sequence per row. As in HF's FlashAttention integration, the documents apply with or without a
cache, whenever the queries are the whole sequence (no cached keys); HF's sdpa and flex masks look
for packing only without a cache.

Masks varlen attention cannot express (share-question, prefix-LM documents, ...) go through the
model call as a `ColumnMask`, the way FlexAttention's integration takes a `BlockMask`:

    mask = fm.ColumnMask.prefix_lm_document(cu_seqlens, prefix_lens)
    model(input_ids, attention_mask=mask, labels=labels)

A dense 4-D `attention_mask` (bool, or additive 0 / -inf) is converted exactly with
`ColumnMask.from_dense` (O(Sq * Sk) and a host read, once per forward).

Attention sinks (gpt-oss passes its `sinks` parameter as `s_aux`, one logit per query head) go to
`flashmask3.attention(..., sinks=...)`, on every backend.

What flashmask3 cannot honour raises a ValueError naming the argument: dropout > 0, `softcap`,
`position_bias`, `output_attentions`, a dense mask with other values or shapes, and mask functions
other than causal / bidirectional, with or without a sliding window (chunked attention, or- and
and-overlays: pass those as a ColumnMask).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, masking_utils
from transformers.masking_utils import AttentionMaskInterface

from ..api import BACKENDS, Backend, attention
from ..memo import TensorMemo
from ..reference import ColumnMask

NAME = "fm3"
"""The `attn_implementation` that `register()` adds."""


def register(backend: Backend = "auto", name: str = NAME) -> None:
    """Register flashmask3's attention and mask functions as `attn_implementation=name` ("fm3").

    Args:
        backend: the `flashmask3.attention` backend every attention call uses ("auto": the cute
            kernel where it supports the inputs, else flex on CUDA, else the reference).
        name: the implementation's name; another name registers the same functions again (two
            models side by side, each with its own entry). Transformers takes a name with
            "flash" in it for FlashAttention, so none may contain it.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; accepted: {', '.join(BACKENDS)}")
    if not isinstance(name, str) or not name or "flash" in name:
        raise ValueError(
            f"name must be a non-empty string without 'flash' (transformers' FlashAttention rule), got {name!r}"
        )

    def flashmask3_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        return _attention_forward(module, query, key, value, attention_mask, dropout, scaling, backend, **kwargs)

    AttentionInterface.register(name, flashmask3_attention_forward)
    AttentionMaskInterface.register(name, _create_mask)


@dataclass(frozen=True)
class _MaskSpec:
    """What HF's mask function asked for. Query i sits at position i + q_offset, key j at
    j + kv_offset; key j is seen iff its position is within `window` = (left, right) of the
    query's (FlashAttention's convention, -1 = unbounded; causal is right = 0) and `keep[:, j]`.
    `shape` is that of the dense mask it stands for: generation passes it back to the model as a
    prepared mask."""

    window: tuple[int, int]
    shape: torch.Size
    q_offset: int | torch.Tensor = 0  # a tensor under a static cache
    kv_offset: int = 0
    keep: torch.Tensor | None = None  # bool [B, Sk], False = padding

    @property
    def ndim(self) -> int:
        return 4


def _create_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int | torch.Tensor = 0,
    kv_offset: int = 0,
    mask_function: Callable = masking_utils.causal_mask_function,
    attention_mask: torch.Tensor | ColumnMask | None = None,
    **kwargs,
) -> _MaskSpec | ColumnMask:
    """HF's mask interface: a user's ColumnMask or a prepared spec as it is, else a `_MaskSpec`
    (nothing is built)."""
    if isinstance(attention_mask, (ColumnMask, _MaskSpec)):
        return attention_mask
    window = _window_of(mask_function)
    if window is None:
        name = getattr(mask_function, "__qualname__", type(mask_function).__name__)
        raise ValueError(
            f"mask_function: flashmask3 takes causal or bidirectional masks, with or without a sliding "
            f"window, packing and padding; this model asked for {name} (chunked attention, or- / and-"
            "overlays, ...). Build the mask as a ColumnMask (e.g. ColumnMask.from_mask_mod) and pass it "
            "as attention_mask"
        )
    keep = None
    if attention_mask is not None:  # HF's 2-D padding mask over the keys seen so far, True = token
        if attention_mask.dim() != 2:  # 4-D masks do not come here
            raise ValueError(
                f"attention_mask: takes a 2-D padding mask [B, Sk], a 4-D dense mask [B, 1 or H, Sq, Sk] or a "
                f"ColumnMask, got shape {tuple(attention_mask.shape)}"
            )
        padding = F.pad(attention_mask, (0, max(0, kv_offset + kv_length - attention_mask.shape[-1])))
        keep = padding[:, kv_offset : kv_offset + kv_length].bool()
    if isinstance(q_offset, torch.Tensor):  # a static cache's length, which it advances in place
        q_offset = q_offset.clone()
    return _MaskSpec(window, torch.Size((batch_size, 1, q_length, kv_length)), q_offset, kv_offset, keep)


def _free_variables(function: Callable, like: Callable) -> dict | None:
    """The closure of `function` by name if it is made by the same code as `like`, else None."""
    if getattr(function, "__code__", None) is not like.__code__:
        return None
    cells = function.__closure__ or ()
    return dict(zip(function.__code__.co_freevars, (cell.cell_contents for cell in cells)))


# Closures of HF's mask-function factories, to recognize the ones the models pass.
_AND = masking_utils.and_masks()
_WINDOW = masking_utils.sliding_window_overlay(1)
_BIDIRECTIONAL_WINDOW = masking_utils.sliding_window_bidirectional_overlay(1)
_PACKED = masking_utils.packed_sequence_mask_function(torch.empty(0))
# Newer transformers also remap the positions inside each packed document; 5.17 has no such wrapper.
_REMAP_PACKED = (
    masking_utils.remap_positions_for_packed_sequence(masking_utils.causal_mask_function, torch.empty(0))
    if hasattr(masking_utils, "remap_positions_for_packed_sequence")
    else None
)


def _window_of(mask_function: Callable) -> tuple[int, int] | None:
    """FlashAttention's (left, right) window of one of HF's mask functions, None if it is not one."""
    if mask_function is masking_utils.causal_mask_function:
        return -1, 0
    if mask_function is masking_utils.bidirectional_mask_function:
        return -1, -1
    return _combined_window(mask_function)


# Dynamo cannot read the closures of functions made in the code it traces: under torch.compile a
# combined mask function (packing, sliding windows) costs one graph break, before the layers.
@torch.compiler.disable
def _combined_window(mask_function: Callable) -> tuple[int, int] | None:
    """`_window_of` for HF's combinations of mask functions (`and_masks(...)`)."""
    combined = _free_variables(mask_function, _AND)
    if combined is None or len(combined["mask_functions"]) != 2:
        return None
    first, second = combined["mask_functions"]
    window = _free_variables(first, _WINDOW)
    if window is not None and second is masking_utils.causal_mask_function:
        return window["sliding_window"] - 1, 0  # key j seen iff i - window < j <= i
    window = _free_variables(first, _BIDIRECTIONAL_WINDOW)
    if window is not None and second is masking_utils.bidirectional_mask_function:
        return window["sliding_window"], window["sliding_window"]  # |i - j| <= window
    if _free_variables(second, _PACKED) is not None:
        # Packed documents: the attention call finds them in its position_ids / cu_seq_lens.
        remapped = None if _REMAP_PACKED is None else _free_variables(first, _REMAP_PACKED)
        return _window_of(first if remapped is None else remapped["mask_function"])
    return None


def _attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: _MaskSpec | ColumnMask | torch.Tensor | None,
    dropout: float,
    scaling: float | None,
    backend: Backend,
    sliding_window: int | None = None,
    is_causal: bool | None = None,
    position_ids: torch.Tensor | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    cu_seq_lens_k: torch.Tensor | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """HF's attention interface: q [B, Hq, Sq, D], k [B, Hkv, Sk, D], v [B, Hkv, Sk, Dv] ->
    ([B, Sq, Hq, Dv], None); Dv may differ from D (DeepSeek-V3's MLA, which pads v only for
    implementations named "flash..."). `s_aux`: the module's attention sinks [Hq] (gpt-oss), passed
    on as `sinks`."""
    if dropout:
        raise ValueError(
            f"dropout={dropout}: flashmask3 has no attention dropout; set the config's attention_dropout "
            "to 0 (or call model.eval())"
        )
    for name in ("softcap", "position_bias"):
        if kwargs.get(name) is not None:
            raise ValueError(f"{name}: flashmask3 does not support it; use attn_implementation='eager' or 'sdpa'")
    if kwargs.get("output_attentions"):
        raise ValueError("output_attentions=True: flashmask3 never forms the attention weights")
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))
    sq, sk = q.shape[1], k.shape[1]
    if attention_mask is None:
        causal = module.is_causal if is_causal is None else is_causal
        if sliding_window is None:
            window = (-1, 0 if causal else -1)
        else:
            window = (sliding_window - 1, 0 if causal else sliding_window - 1)
        # Bottom-right aligned, as FlashAttention.
        attention_mask = _MaskSpec(window, torch.Size((q.shape[0], 1, sq, sk)), q_offset=sk - sq)
    elif isinstance(attention_mask, _MaskSpec) and sliding_window is not None and attention_mask.window[0] < 0:
        raise ValueError(
            f"sliding_window={sliding_window}, but the model's mask function has no window (the mask decides)"
        )
    if isinstance(attention_mask, _MaskSpec):
        mask = _mask_of(attention_mask, sq, sk, q.device, position_ids, cu_seq_lens_q, cu_seq_lens_k)
    elif isinstance(attention_mask, ColumnMask):
        mask = attention_mask
    elif isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 4:
        # No row, key or batch element: nothing to mask (attention gives the empty or zero rows).
        mask = None if 0 in attention_mask.shape else _from_dense(attention_mask)
    else:
        got = (
            f"shape {tuple(attention_mask.shape)}"
            if isinstance(attention_mask, torch.Tensor)
            else type(attention_mask).__name__
        )
        raise TypeError(f"attention_mask must be a 4-D tensor, a ColumnMask or None, got {got}")
    return cast(torch.Tensor, attention(q, k, v, mask, softmax_scale=scaling, backend=backend, sinks=s_aux)), None


def _is_zero(offset: int | torch.Tensor) -> bool:
    return isinstance(offset, int) and offset == 0


def _documents(
    seqlen: int,
    position_ids: torch.Tensor | None,
    cu_seq_lens_q: torch.Tensor | None,
    cu_seq_lens_k: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """First token and end of each token's document, int32 [B or 1, S] each; None: one document."""
    if cu_seq_lens_q is not None:
        if (
            cu_seq_lens_k is not None
            and cu_seq_lens_k is not cu_seq_lens_q
            and (
                cu_seq_lens_k.shape != cu_seq_lens_q.shape
                or (not cu_seq_lens_q.is_cuda and not torch.equal(cu_seq_lens_q, cu_seq_lens_k.to(cu_seq_lens_q)))
            )
        ):
            raise ValueError(
                "cu_seq_lens_k must equal cu_seq_lens_q (self-attention over the same packed documents), "
                f"got {cu_seq_lens_q.tolist()} and {cu_seq_lens_k.tolist()}"
            )
        iv = ColumnMask.document(cu_seq_lens_q, seqlen=seqlen).intervals()
    elif position_ids is not None:
        if position_ids.dim() != 2 or position_ids.shape[-1] != seqlen:
            raise ValueError(
                f"position_ids must be [B, {seqlen}] or [1, {seqlen}] to find the packed documents, "
                f"got shape {tuple(position_ids.shape)}"
            )
        # HF's FlashAttention rule (`prepare_fa_kwargs_from_position_ids`): a document starts where
        # the position restarts at its minimum (0, or a RoBERTa-like padding_idx + 1), not at a jump.
        restarts = position_ids == position_ids.amin(-1, keepdim=True)
        iv = ColumnMask.document(document_ids=restarts.cumsum(-1)).intervals()
    else:
        return None
    return iv.ute[:, 0], iv.lts[:, 0]  # a document mask hides rows below its start and from its end


def _build(
    spec: _MaskSpec, sq: int, sk: int, documents: tuple[torch.Tensor, torch.Tensor] | None, device: torch.device
) -> ColumnMask:
    """The ColumnMask of `spec` (and `documents`): key j is seen by the query rows [lo_j, hi_j)."""
    left, right = spec.window
    diagonal = torch.arange(sk, device=device) + (spec.kv_offset - spec.q_offset)  # the row at key j's position
    lo = diagonal - right if right >= 0 else torch.zeros_like(diagonal)
    hi = diagonal + left + 1 if left >= 0 else torch.full_like(diagonal, sq)
    if documents is not None:
        start, end = (x.to(device) for x in documents)
        lo, hi = torch.maximum(lo, start), torch.minimum(hi, end)
    if spec.keep is not None:
        hi = torch.where(spec.keep.to(device), hi, 0)  # a padding key is seen by no row
    lo, hi = torch.broadcast_tensors(lo.clamp(0, sq), hi.clamp(0, sq))
    # The causal variant when its implicit diagonal (rows i >= j - (Sk - Sq)) is exactly lo.
    shift = spec.kv_offset - spec.q_offset
    segmented = documents is not None  # packed documents: no row sees another document's keys
    if right == 0 and isinstance(shift, int) and shift == sq - sk:
        return ColumnMask._from_vectors([hi], causal=True, seqlen_q=sq, segmented=segmented)
    return ColumnMask._from_vectors([hi, lo], causal=False, seqlen_q=sq, segmented=segmented)


_built: TensorMemo[ColumnMask] = TensorMemo(size=4)
"""The masks last built from a spec and its packing metadata: the layers of one forward pass the
same spec values and metadata tensors, so a mask is built once per forward (per window, where
sliding and full layers alternate) and the kernels' tile orders, kept per mask, are sorted once."""


def _mask_of(
    spec: _MaskSpec,
    sq: int,
    sk: int,
    device: torch.device,
    position_ids: torch.Tensor | None,
    cu_seq_lens_q: torch.Tensor | None,
    cu_seq_lens_k: torch.Tensor | None,
) -> ColumnMask:
    """The ColumnMask of `spec` and the call's packing metadata, reused while the spec's values and
    the very tensors it was built from (unchanged in place) come back. Under torch.compile it is
    built in the graph each time (the reuse test would break the graph)."""

    def build() -> ColumnMask:
        documents = _documents_of(spec, sq, sk, position_ids, cu_seq_lens_q, cu_seq_lens_k)
        return _build(spec, sq, sk, documents, device)

    if torch.compiler.is_compiling():
        return build()
    sources = (spec.q_offset, spec.keep, position_ids, cu_seq_lens_q, cu_seq_lens_k)
    tensors = [t for t in sources if isinstance(t, torch.Tensor)]
    values = tuple("tensor" if isinstance(t, torch.Tensor) else t for t in sources)
    return _built.get((spec.window, spec.shape, spec.kv_offset, sq, sk, str(device), values), tensors, build)


def _documents_of(spec: _MaskSpec, sq: int, sk: int, position_ids, cu_seq_lens_q, cu_seq_lens_k):
    """The packed documents, read (as HF's FlashAttention integration does) when the queries are the
    whole sequence: no cached keys. Packing is inferred from `position_ids` only where HF's
    `_is_packed_sequence` would: a batch of one without a padding mask (HF unpads by that mask
    instead, and its sdpa / flex masks look for packing only without one)."""
    if not (sq == sk and _is_zero(spec.q_offset) and _is_zero(spec.kv_offset)):
        return None
    if spec.keep is not None or spec.shape[0] != 1:
        position_ids = None
    return _documents(sq, position_ids, cu_seq_lens_q, cu_seq_lens_k)


_converted: TensorMemo[ColumnMask] = TensorMemo(size=1)
"""The last dense mask converted: the layers of one forward share their mask, so it is converted
once."""


def _from_dense(attention_mask: torch.Tensor) -> ColumnMask:
    """The exact ColumnMask of a dense 4-D mask: bool (True = attend) or additive (0 / -inf or the
    dtype's minimum); anything else is a ValueError naming attention_mask."""
    return _converted.get(None, [attention_mask], lambda: _convert(attention_mask))


def _convert(attention_mask: torch.Tensor) -> ColumnMask:
    if attention_mask.dtype == torch.bool:
        attend = attention_mask
    elif attention_mask.is_floating_point():
        attend = attention_mask == 0
        hidden = torch.isneginf(attention_mask) | (attention_mask == torch.finfo(attention_mask.dtype).min)
        if not bool((attend | hidden).all()):
            raise ValueError(
                "attention_mask: an additive mask must hold only 0 (attend) and -inf or the dtype's "
                "minimum (masked); flashmask3 applies masks, not biases"
            )
    else:
        raise TypeError(f"attention_mask must be bool or floating point, got {attention_mask.dtype}")
    try:
        mask = ColumnMask.from_dense(attend)
    except ValueError as error:
        raise ValueError(
            f"attention_mask: this dense mask is not a FlashMask column mask ({error}); pass a ColumnMask instead"
        ) from error
    return mask
