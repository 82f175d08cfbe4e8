"""The peers the benchmark scripts time our kernels against, each on the masks it can express.

Benchmark-only: the library (`flashmask3.api` and its backends) never imports this module. Every
peer takes q as [B, S, Hq, D], k and v as [B, S, Hkv, D] (GQA: Hkv divides Hq, K/V head j serving
the G = Hq / Hkv query heads j * G to j * G + G - 1, as ours) and returns the output as [B, S, Hq,
D], differentiable, so the same function serves the forward bench and the fwd+bwd bench
(autograd). Each takes the fewer K/V heads as they are, none repeats them: FA4 (dense, varlen,
block-sparse), cuDNN frontend and FlashMask V3 by the tensors' shapes, Flex and torch SDPA (cuDNN)
with `enable_gqa`.

- `flex`: FlexAttention compiled, `kernel_options={"BACKEND": "TRITON"}`, on a BlockMask: every mask.
- `flex_flash`: the same with `{"BACKEND": "FLASH"}` (FA4's kernels inside Flex): every mask.
- `fa4`: FA4's own API (`flash_attn.cute`): `causal` for full and causal, the causal
  `window_size` for sliding_window, varlen `cu_seqlens` for causal_document and document.
- `fa4_sparse`: FA4 with a CuTe `mask_mod` and block sparsity, forward and backward: every mask.
- `cudnn`: cuDNN's attention through torch SDPA (`is_causal`): full and causal.
- `flashmask_v3`: FlashMask V3, the FA3-based Hopper kernel of the FlashMask paper (a PyTorch build
  of PaddlePaddle/flash-attention's, `tools/peers/build_flashmask_v3.sh`), on our column mask as it
  is: the same `startend_row_indices` format and `causal` flag. Every mask; head dim 128 as built.
- `cudnn_flex`: cuDNN frontend's interval-mask attention (`cudnn.flex_attention`, CuTe DSL kernels,
  forward and backward), each query row's visible keys as intervals (`reference.row_intervals`):
  every mask whose intervals fit `CUDNN_FLEX_MASK_BYTES` (at the benchmarks' 128K query rows, all
  but random_eviction).

The block-sparse peers (`flex`, `flex_flash`, `fa4_sparse`) use the 128 x 128 blocks of
`ColumnMask.block_classes`, the classification our kernels make: SKIP blocks left out, UNMASKED
ones run without the mask, the mask read on PARTIAL ones only. They come from the column vectors
in O(B * Hm * Tm * Tn), never from a dense [S, S] mask, so 128K-token masks fit.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from .bench import error_string
from .peers import block_lists, flex_block_mask, head_block_classes
from .reference import ColumnMask, IntervalLimitError, row_intervals

AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""q, k, v [B, S, H, D] -> out [B, S, H, D]."""


@dataclass
class PeerCase:
    """One benchmark mask as the peers take it; what they build from it is built once, outside
    any timing.

    Args:
        mask_name: the `masks.MASK_NAMES` entry `mask` was built as.
        mask: the mask, on the device the peers run on; batch 1 or `batch`, Sq == Sk.
        batch: batch size of q, k, v.
        heads: query heads (k and v may have fewer: GQA); the masks' heads, the BlockMask's and the
            block-sparse lists' are query heads.
        softmax_scale: the scale every contender uses.
        sinks: [heads] fp32 sink logits joined to every row's softmax, or None; only the peers of
            `SINK_PEERS` take them (FA4's `learnable_sink`), the others sit the case out.
    """

    mask_name: str
    mask: ColumnMask
    batch: int
    heads: int
    softmax_scale: float
    sinks: torch.Tensor | None = None
    block_mask_seconds: float | None = field(default=None, init=False)

    @functools.cached_property
    def block_mask(self):
        """The 128 x 128 BlockMask from our block classes (None for the full mask); its build time
        goes to `block_mask_seconds`."""
        start = time.perf_counter()
        seqlen = self.mask.seqlen_k
        block_mask = flex_block_mask(
            self.mask, self.batch, self.heads, seqlen, seqlen, self.mask.device, from_tiles=True
        )
        if self.mask.device.type == "cuda":
            torch.cuda.synchronize()
        self.block_mask_seconds = time.perf_counter() - start
        return block_mask


def sliding_window_left(mask: ColumnMask) -> int:
    """FA4's `window_size[0]` for a causal sliding window of W keys (`masks.build("sliding_window")`:
    key j hidden from the rows >= j + W, i.e. LTS_j = min(j + W, S)).

    Query i then sees keys i - W < j <= i. FA4 keeps, for Sq == Sk, the keys i - left <= j <= i +
    right (`flash_attn/cute/mask.py`, local masking: `col_limit_left = row - window_size_left`,
    `col_limit_right = row + 1 + window_size_right`), so the window is `causal=True,
    window_size=(W - 1, 0)`. Raises a ValueError if `mask` is no such window.
    """
    seqlen = mask.seqlen_k
    if not mask.causal or mask.seqlen_q != seqlen:
        raise ValueError(
            f"mask must be causal with Sq == Sk for a sliding window, got causal={mask.causal}, "
            f"Sq={mask.seqlen_q}, Sk={seqlen}"
        )
    intervals = mask.intervals()
    width = int(intervals.lts.flatten()[0])  # key 0 is hidden from row W on
    expected = (torch.arange(seqlen, device=mask.device) + width).clamp(max=seqlen)
    if width < 1 or not bool((intervals.lts == expected).all()) or not bool((intervals.lte == seqlen).all()):
        raise ValueError(
            f"mask is not a sliding window: LTS_j != min(j + W, S) for one W, or an LTE below S (W from key 0: {width})"
        )
    return width - 1


def document_cu_seqlens(mask: ColumnMask, batch: int) -> tuple[torch.Tensor, int]:
    """FA4's varlen form of a packed-documents mask (`masks.build`'s `causal_document`, causal, or
    `document`): the `batch` sequences of S tokens, flattened to one [batch * S] token dim, as one
    varlen batch of all their documents.

    A document [start, end) hides each of its keys from the rows >= end (LTS = end) and, unless
    causal, from the rows < start (UTE = start). Returns (cu_seqlens: int32 [documents + 1] on the
    mask's device, the offsets batch element b's documents start at plus b * S, then batch * S;
    the longest document). Raises a ValueError naming what does not fit.
    """
    seqlen = mask.seqlen_k
    if mask.seqlen_q != seqlen:
        raise ValueError(f"mask must have Sq == Sk for documents, got Sq={mask.seqlen_q}, Sk={seqlen}")
    if mask.batch not in (1, batch):
        raise ValueError(f"mask batch must be 1 or batch={batch}, got {mask.batch}")
    rows = mask.startend_row_indices
    if not torch.equal(rows, rows[:, :1].expand_as(rows)):
        raise ValueError("mask heads differ: documents are the same for every head")
    intervals = mask.intervals()
    if not bool((intervals.lte == seqlen).all()) or not bool((intervals.uts == 0).all()):
        raise ValueError("mask is not packed documents: an LTE below S or a UTS above 0")
    starts_per_element = []
    for b in range(mask.batch):
        ends = torch.unique_consecutive(intervals.lts[b, 0])
        if int(ends[0]) < 1 or int(ends[-1]) != seqlen or not bool((ends[1:] > ends[:-1]).all()):
            raise ValueError(
                f"mask is not packed documents: batch {b}'s LTS is not increasing document ends ending at S={seqlen}"
            )
        starts = torch.cat([ends.new_zeros(1), ends[:-1]])
        lengths = ends - starts
        first_rows_hidden = torch.zeros_like(starts) if mask.causal else starts
        if not (
            torch.equal(intervals.lts[b, 0], ends.repeat_interleave(lengths))
            and torch.equal(intervals.ute[b, 0], first_rows_hidden.repeat_interleave(lengths))
        ):
            raise ValueError(
                f"mask is not packed documents: batch {b} has a key whose LTS is not its "
                f"document's end{'' if mask.causal else ' or whose UTE is not its start'}"
            )
        starts_per_element.append(starts)
    starts_per_element *= batch // mask.batch
    offsets = [starts + b * seqlen for b, starts in enumerate(starts_per_element)]
    cu_seqlens = torch.cat([*offsets, offsets[0].new_full((1,), batch * seqlen)]).to(torch.int32)
    return cu_seqlens, int(cu_seqlens.diff().max())


def fa4_key_block(head_dim: int) -> int:
    """The key block of FA4's block-sparse lists at `head_dim`: its SM90 backward's key tile with
    block sparsity (`_tile_size_bwd_sm90`: 96 at head dims up to 192, 64 above), which the lists
    must match; its forward narrows its own key tile to the block (128 up to head dim 128)."""
    return 128 if head_dim <= 128 else 96 if head_dim <= 192 else 64


def fa4_block_sparse_tensors(
    mask: ColumnMask, heads: int, key_block: int = 128
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """FA4's block-sparse lists of `mask` (128 x `key_block` blocks from `ColumnMask.block_classes`),
    each (partial counts, partial indices, full counts, full indices), for the forward and the backward.

    The forward walks query blocks: per query block its key blocks ([Bm, H, Tm] counts, [Bm, H, Tm,
    Tn] indices). The backward walks key blocks: per key block its query blocks ([Bm, H, Tn] and
    [Bm, H, Tn, Tm]), the transpose. FA4 checks the backward lists against its backward tiles
    (`normalize_block_sparse_config_bwd`: block size = q_subtile_factor x tile_m by kv_subtile_factor
    x tile_n). On SM90 with a mask_mod (not causal, not local) `_tile_size_bwd_sm90` gives tile_n
    128 and tile_m 128 at head dim 64, 64 at head dim 128 (80 does not divide a 128-row block), and
    kv_subtile_factor stays 1: 128 x 128 fits both, a query block being two 64-row tiles at head
    dim 128; above 128 the backward's key tile is narrower (`fa4_key_block`). `heads` are query
    heads in both directions, for GQA too: FA4 checks the lists against [B, Hq, ...] (`num_head` =
    q's heads in `normalize_block_sparse_config` and its `_bwd`; a head dim of 1 is broadcast, and
    only then does the forward pack the query heads of a K/V head together).
    """
    classes = head_block_classes(mask, heads, mask.device, key_block)
    return block_lists(classes), block_lists(classes.transpose(-1, -2))


FA4_NATIVE_MASKS = ("full", "causal", "sliding_window", "causal_document", "document")
"""The benchmark masks FA4's own API expresses without a mask_mod."""


def _fa4_native(case: PeerCase) -> AttentionFn | None:
    """FA4's own API: `causal`, the causal `window_size` of `sliding_window_left`, or varlen over
    the documents of `document_cu_seqlens`; None for the other masks."""
    if case.mask_name not in FA4_NATIVE_MASKS:
        return None
    from flash_attn.cute import flash_attn_func, flash_attn_varlen_func

    scale, sinks = case.softmax_scale, case.sinks
    if case.mask_name in ("full", "causal"):
        causal = case.mask_name == "causal"
        return lambda q, k, v: flash_attn_func(q, k, v, softmax_scale=scale, causal=causal, learnable_sink=sinks)[0]
    if case.mask_name == "sliding_window":
        left = sliding_window_left(case.mask)
        return lambda q, k, v: flash_attn_func(
            q, k, v, softmax_scale=scale, causal=True, window_size=(left, 0), learnable_sink=sinks
        )[0]
    cu_seqlens, longest = document_cu_seqlens(case.mask, case.batch)
    causal = case.mask.causal

    def run(q, k, v):
        batch, seqlen = q.shape[:2]
        packed = (x.reshape(batch * seqlen, *x.shape[2:]) for x in (q, k, v))
        out = flash_attn_varlen_func(
            *packed,
            cu_seqlens_q=cu_seqlens,
            cu_seqlens_k=cu_seqlens,
            max_seqlen_q=longest,
            max_seqlen_k=longest,
            softmax_scale=scale,
            causal=causal,
            learnable_sink=sinks,
        )[0]
        return out.view(batch, seqlen, *out.shape[1:])

    return run


def _fa4_mask_mod(case: PeerCase) -> AttentionFn:
    """FA4 with block sparsity (`fa4_block_sparse_tensors` in the head dim's `fa4_key_block`,
    forward and backward) and, on PARTIAL
    blocks, a CuTe `mask_mod` reading `startend_row_indices` with our kernels' element rule
    (`optimized.mask._hidden`)."""
    import cutlass
    import cutlass.cute as cute
    from flash_attn.cute import flash_attn_func
    from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch

    from .optimized.mask import _hidden

    mask, heads, scale = case.mask, case.heads, case.softmax_scale

    @functools.cache
    def sparse_tensors(key_block: int):  # built at the first (untimed) call per head dim
        return tuple(
            BlockSparseTensorsTorch(*lists, block_size=(128, key_block))  # `head_block_classes`' blocks
            for lists in fa4_block_sparse_tensors(mask, heads, key_block)
        )

    row_indices = mask.startend_row_indices.contiguous()
    causal, width = mask.causal, row_indices.shape[-1]
    per_batch, heads_per_mask_head = mask.batch > 1, heads // mask.heads
    causal_offset = mask.seqlen_k - mask.seqlen_q

    @cute.jit
    def mask_mod(batch_idx, head_idx, q_idx, kv_idx, seqlen_info, aux_tensors):
        bounds = aux_tensors[0]
        b = batch_idx[0] if cutlass.const_expr(per_batch) else 0
        h = head_idx[0] // heads_per_mask_head
        query, key = q_idx[0], kv_idx[0]
        first = bounds[b, h, key, 0]
        second = bounds[b, h, key, 1] if cutlass.const_expr(width >= 2) else first
        third = bounds[b, h, key, 2] if cutlass.const_expr(width == 4) else first
        fourth = bounds[b, h, key, 3] if cutlass.const_expr(width == 4) else first
        keep = cute.make_rmem_tensor(1, cutlass.Boolean)
        keep[0] = not _hidden(query, key, first, second, third, fourth, causal_offset, causal, width)
        return keep.load()

    # FA4 caches its kernels by this hash: name every compile-time constant the closure captures.
    mask_mod.__cute_hash__ = f"flashmask3-column-{causal}-{width}-{per_batch}-{heads_per_mask_head}-{causal_offset}"

    def run(q, k, v):
        forward, backward = sparse_tensors(fa4_key_block(q.shape[-1]))
        return flash_attn_func(
            q,
            k,
            v,
            softmax_scale=scale,
            mask_mod=mask_mod,
            aux_tensors=[row_indices],
            block_sparse_tensors=forward,
            block_sparse_tensors_bwd=backward,
            learnable_sink=case.sinks,
        )[0]

    return run


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    # Each mask variant, length and BACKEND is a graph of its own; past the default limit of 8
    # recompilations dynamo would run the unfused eager flex_attention instead, unnoticed.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 256)
    return torch.compile(flex_attention, dynamic=False)


def _flex(backend: str) -> Callable[[PeerCase], AttentionFn]:
    """FlexAttention compiled with `kernel_options={"BACKEND": backend}` on the case's BlockMask
    (query heads), with `enable_gqa` where k and v have fewer heads than q."""

    def build(case: PeerCase) -> AttentionFn:
        block_mask, scale, options = case.block_mask, case.softmax_scale, {"BACKEND": backend}
        flex = _compiled_flex()

        def run(q, k, v):
            out = flex(
                q.transpose(1, 2),
                k.transpose(1, 2),
                v.transpose(1, 2),
                block_mask=block_mask,
                scale=scale,
                enable_gqa=k.shape[2] != q.shape[2],
                kernel_options=options,
            )
            return out.transpose(1, 2)

        return run

    return build


def _cudnn(case: PeerCase) -> AttentionFn | None:
    """cuDNN's attention through torch SDPA, on the full and causal masks only; `enable_gqa` where k
    and v have fewer heads than q, which SDPA's cuDNN backend takes as they are (a torch whose cuDNN
    backend refuses them raises "No available kernel": the peer's error, not a silent repeat)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if case.mask_name not in ("full", "causal"):
        return None
    causal, scale = case.mask_name == "causal", case.softmax_scale

    def run(q, k, v):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2),
                k.transpose(1, 2),
                v.transpose(1, 2),
                is_causal=causal,
                scale=scale,
                enable_gqa=k.shape[2] != q.shape[2],
            ).transpose(1, 2)

    return run


CUDNN_FLEX_PATH_VARIABLE = "FLASHMASK3_CUDNN_FLEX_PATH"
"""Environment variable naming a folder that holds cuDNN frontend's `cudnn/` package (an unpacked
frontend), searched before the installed packages for `cudnn.flex_attention`."""

CUDNN_FLEX_MASK_BYTES = 1 << 30
"""The most memory `cudnn_flex`'s interval mask may take. cuDNN takes any number of intervals per
row, but holds them all (int32 per endpoint, query row and mask head) and reads them all for every
key block it classifies: random_eviction's late rows see O(S) runs of keys, which over 128K query
rows of 32 per-head masks is 8 GiB at 1K tokens per sequence, growing with S."""


def cudnn_flex_mask_func(mask: ColumnMask, batch: int, heads: int) -> torch.Tensor | None:
    """cuDNN flex_attention's `mask_func` of `mask` for q of `batch` sequences and `heads` heads,
    or None where it would take more than `CUDNN_FLEX_MASK_BYTES`.

    int32 [Hmask, nfunc, batch * S], contiguous, on the mask's device: Hmask is 1 for a mask shared
    by the heads, else `heads` (mask heads repeated, as `head_block_classes` does); column b * S + i
    holds query i of sequence b's `reference.row_intervals` endpoints, nfunc of them (odd): the
    visible keys [0, F_0) U [F_1, F_2) U ... of that sequence. Raises a ValueError if the mask's
    batch or heads do not fit `batch` and `heads`.
    """
    if mask.batch not in (1, batch):
        raise ValueError(f"mask batch must be 1 or batch={batch}, got {mask.batch}")
    if heads % mask.heads:
        raise ValueError(f"mask heads must divide heads={heads}, got {mask.heads}")
    mask_heads = 1 if mask.heads == 1 else heads
    query_rows = batch * mask.seqlen_q
    most_endpoints = CUDNN_FLEX_MASK_BYTES // (4 * mask_heads * query_rows)
    if most_endpoints < 1:
        return None
    try:
        endpoints = row_intervals(mask, max_intervals=(most_endpoints + 1) // 2)
    except IntervalLimitError:
        return None
    endpoints = endpoints.expand(batch, -1, -1, -1).repeat_interleave(mask_heads // mask.heads, dim=1)
    # [B, Hmask, S, nfunc] -> [Hmask, nfunc, B * S]: cuDNN's query rows are the sequences' rows in turn.
    return endpoints.permute(1, 3, 0, 2).reshape(mask_heads, -1, query_rows).contiguous()


def _import_peer(path_variable: str, module: str):
    """`module`, from the folder the environment variable `path_variable` names if set (peers
    unpacked beside the benchmark rather than installed), else from the installed packages."""
    folder = os.environ.get(path_variable)
    if folder and folder not in sys.path:
        sys.path.insert(0, folder)
    return importlib.import_module(module)


def _cudnn_flex(case: PeerCase) -> AttentionFn | None:
    """cuDNN frontend's interval-mask attention on `cudnn_flex_mask_func` of the case's mask (None
    where that is None), q, k, v in its fixed-length layout, which is ours: [B, S, H, D]. Its
    autograd Function runs its own backward. Its plan (the block lists and mask payloads, the
    backward's too when q, k or v need gradients) is made on the first call for a q, k, v geometry,
    the benchmarks' check outside the timing, and reused."""
    mask_func = cudnn_flex_mask_func(case.mask, case.batch, case.heads)
    if mask_func is None:
        return None
    flex_attention = _import_peer(CUDNN_FLEX_PATH_VARIABLE, "cudnn.flex_attention")
    scale = case.softmax_scale
    plans: dict[tuple, object] = {}

    def run(q, k, v):
        with_backward = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))
        geometry = (q.shape, k.shape, v.shape, q.dtype, q.device, with_backward)
        if geometry not in plans:
            plans[geometry] = flex_attention.create_mask_plan(mask_func, q, k, v, build_backward=with_backward)
        return flex_attention.flex_attn_func(q, k, v, mask_plan=plans[geometry], softmax_scale=scale)

    return run


FLASHMASK_V3_PATH_VARIABLE = "FLASHMASK3_FLASHMASK_V3_PATH"
"""Environment variable naming a folder that holds FlashMask V3's built extension
(`flashmask/_C.abi3.so`) and its `interface_torch.py`, as `tools/peers/build_flashmask_v3.sh`
packs them."""


def _flashmask_v3(case: PeerCase) -> AttentionFn | None:
    """FlashMask V3's `flashmask_attention` on the case's column mask, q, k, v [B, S, H, D] as
    ours; its autograd Function runs its backward. It takes the mask's batch only equal to q's, and
    mask heads 1, Hq or Hkv (`interface_torch`'s check): the benchmarks' masks have 1 or Hq (query
    heads); other ones give None."""
    if case.mask.heads not in (1, case.heads):
        return None
    interface = _import_peer(FLASHMASK_V3_PATH_VARIABLE, "interface_torch")
    bounds = case.mask.startend_row_indices.expand(case.batch, -1, -1, -1).contiguous()
    causal, scale = case.mask.causal, case.softmax_scale

    def run(q, k, v):
        return interface.flashmask_attention(q, k, v, bounds, causal=causal, softmax_scale=scale)

    return run


PEERS: dict[str, Callable[[PeerCase], AttentionFn | None]] = {
    "flex": _flex("TRITON"),
    "flex_flash": _flex("FLASH"),
    "fa4": _fa4_native,
    "fa4_sparse": _fa4_mask_mod,
    "cudnn": _cudnn,
    "cudnn_flex": _cudnn_flex,
    "flashmask_v3": _flashmask_v3,
}
"""Peer name -> builder: the peer's function for a case, or None where it cannot express the mask."""
SINK_PEERS = ("fa4", "fa4_sparse")
"""The peers that take attention sinks (FA4's `learnable_sink`, its native and block-sparse paths)."""


def select_peers(names: str) -> tuple[str, ...]:
    """A comma list of peer names (`PEERS`' keys, "" for none) as a tuple, checked."""
    chosen = tuple(name.strip() for name in names.split(",") if name.strip())
    unknown = [name for name in chosen if name not in PEERS]
    if unknown:
        raise ValueError(f"unknown peer {unknown[0]!r} in peers={names!r}; accepted: {', '.join(PEERS)}")
    return chosen


def checked_peers(
    case: PeerCase, names: tuple[str, ...], check: Callable[[AttentionFn], dict], row: dict
) -> dict[str, AttentionFn]:
    """The peers `names` built for `case`, each called once through `check(fn)` (its compilation,
    and its differences from our output: `check` returns them as {"max_diff": ...}, which go into
    `row` under f"{name}_max_diff"...). A peer whose build or check raises (import error,
    unsupported shape, out of memory, compile error) leaves its `error_string` in `row` under
    f"{name}_error" and is left out, as is a peer that cannot express the mask."""
    built = {}
    for name in names:
        try:
            if case.sinks is not None and name not in SINK_PEERS:
                row[f"{name}_skipped"] = "takes no attention sinks"
                continue
            fn = PEERS[name](case)
            if fn is None:
                continue
            row.update({f"{name}_{key}": value for key, value in check(fn).items()})
            built[name] = fn
        except Exception as exc:  # a peer that fails is a result to report, not a reason to stop
            row[f"{name}_error"] = error_string(exc)
    if case.block_mask_seconds is not None:
        row["flex_block_mask_s"] = case.block_mask_seconds
    return built


def max_abs_diff(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    """Largest absolute difference, in fp32."""
    return float((ours.float() - theirs.float()).abs().max())


def versions() -> dict[str, str]:
    """Versions of the peers' packages ("missing" where absent), for the result record."""
    from importlib import metadata

    found = {}
    for package in ("flash-attn-4", "nvidia-cutlass-dsl", "triton"):
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            found[package] = "missing"
    found["cudnn"] = str(torch.backends.cudnn.version())
    return found
