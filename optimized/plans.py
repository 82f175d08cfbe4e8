"""The per-mask plans a kernel launches with, chosen apart from the launch (plan -> launch).

Besides q, k, v and the mask's boundaries, a launch reads tensors that follow from the mask alone:
the forward's segment plan (segment-aligned virtual rows), the key blocks' min/max and, in a short
grid, the order of its work tiles; the backward's key blocks' min/max and, in a short grid, the
split table of its CTAs or their order. `forward_plan` and `backward_plan` choose them from the
configuration and the grid's size, as `interface.forward` / `backward` launch them, each computed
once per mask (`tile_plan.kept_per_mask`): the layers of a training step share the computation.

`prepare_mask` computes them where the mask is built (a data loader's host) and copies them to the
GPU with it, as FlexAttention's `create_block_mask` is made once per batch outside the model: the
training step then launches none of their few hundred small kernels.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from ..reference import ColumnMask
from ..reference.constructors import check_flag, check_int
from .config import BACKWARD_HEAD_DIMS, SPLIT_CTA_SLOTS_PER_SM, BwdConfig, FwdConfig, bwd_config, fwd_config
from .segments import cached_segment_plan, query_tile_rows
from .tile_plan import (
    backward_cta_steps,
    backward_split_plan,
    cached_block_minmax,
    cached_longest_first,
    dq_ranks,
    forward_tile_steps,
    kept_per_mask,
    moved_mask,
)


@dataclasses.dataclass(frozen=True)
class ForwardPlan:
    """What the forward launches with besides q, k, v.

    `mask`: the mask the kernel reads (with segment tiles, the segment plan's virtual rows);
    `config`: the configuration it runs (segment tiles off where they do not apply); `tile_rows`:
    the segment plan's real rows per granule, else None; `bounds`: the key blocks' min/max;
    `order`: the work tiles longest first in a short grid, else None."""

    mask: ColumnMask
    config: FwdConfig
    tile_rows: torch.Tensor | None
    bounds: torch.Tensor
    order: torch.Tensor | None


@dataclasses.dataclass(frozen=True)
class BackwardPlan:
    """What the backward's main kernel launches with besides its inputs and buffers.

    `mask`, `config`, `bounds`: as `ForwardPlan`'s (segment steps, a short grid's stages);
    `step_rows`: the segment steps' rows, else None; in a short grid either `split_table` (the
    split CTAs' work table, `tile_plan.backward_split_plan`) with `slots` workspace slots, or
    `order` (the CTAs longest first); None and 0 otherwise. `ranks`: in deterministic mode the
    key tiles' places in the dQ sums (`tile_plan.dq_ranks`), else None."""

    mask: ColumnMask
    config: BwdConfig
    step_rows: torch.Tensor | None
    bounds: torch.Tensor
    order: torch.Tensor | None
    split_table: torch.Tensor | None
    slots: int
    ranks: torch.Tensor | None


def work_tiles(batch: int, heads: int, seqlen_q: int, config: FwdConfig) -> int:
    """The forward's work tiles: query tiles (of the virtual rows with segment tiles) x query heads
    x batch."""
    return batch * heads * -(-seqlen_q // config.tile_m)


def backward_grid(batch: int, kv_heads: int, seqlen_k: int, config: BwdConfig) -> int:
    """The backward's CTAs: one per key tile, KV head and batch."""
    return batch * kv_heads * -(-seqlen_k // config.key_tile)


def countable(mask: ColumnMask, plain: bool, key_tile: int) -> bool:
    """Whether the kernels may count their tiles in registers (`FwdConfig.counted_keys`,
    `BwdConfig.counted_steps`) instead of listing them: a plain call (`plain`: no interval hides a
    row) whose keys fill whole tiles of `key_tile`, so no tile is masked by more than the causal
    diagonal (else the list says which)."""
    return plain and mask.startend_row_indices.shape[-2] % key_tile == 0


def forward_plan(
    mask: ColumnMask,
    config: FwdConfig,
    batch: int,
    q_heads: int,
    sms: int,
    uniform_work: bool = False,
    sequence_tiles: bool = False,
    plain: bool = False,
) -> ForwardPlan:
    """The forward's plan for `mask` under `config`, q of `batch` x `q_heads` heads, on a GPU of
    `sms` SMs. `uniform_work`: the mask stands for no mask (every work tile sees every key tile:
    nothing to order, no segments); `sequence_tiles`: the kernel must keep the sequence's tiles
    (Sq != Sk, or a CUDA graph being captured, where a kept plan would be replayed stale);
    `plain`: the mask stands for no mask or for the causal one alone (no interval hides a row)."""
    tile_rows = None
    if config.counted_keys and not countable(mask, plain, config.tile_n):
        config = dataclasses.replace(config, counted_keys=False)
    if config.segment_tiles:
        if uniform_work or sequence_tiles:
            config = dataclasses.replace(config, segment_tiles=False)
        else:
            segments = cached_segment_plan(mask, synced=False)
            mask, tile_rows = segments.mask, segments.tile_rows
    bounds = cached_block_minmax(mask, config.tile_n)
    order = None
    if not uniform_work and work_tiles(batch, q_heads, mask.seqlen_q, config) <= config.longest_tiles_first_waves * sms:
        tile_m, tile_n = config.tile_m, config.tile_n
        order = cached_longest_first(
            mask,
            ("fwd", batch, q_heads, tile_m, tile_n),
            lambda: forward_tile_steps(mask, batch, q_heads, tile_m, tile_n, tile_rows),
        )
    return ForwardPlan(mask, config, tile_rows, bounds, order)


def backward_plan(
    mask: ColumnMask,
    config: BwdConfig,
    batch: int,
    q_heads: int,
    kv_heads: int,
    sms: int,
    uniform_work: bool = False,
    sequence_tiles: bool = False,
    deterministic: bool = False,
    profiled: bool = False,
    plain: bool = False,
) -> BackwardPlan:
    """The backward's plan, as `forward_plan`'s, for K/V of `kv_heads` heads. Deterministic mode
    keeps the grid order (its key tiles wait for the ones before them); a profiled build
    (`profiled`) does not split its CTAs."""
    step_rows = None
    if config.counted_steps and not countable(mask, plain, config.key_tile):
        config = dataclasses.replace(config, counted_steps=False)
    if config.segment_steps:
        # A CTA's key tile serves every query head of its KV head: they must share one virtual layout.
        shared_layout = (q_heads // mask.heads) % (q_heads // kv_heads) == 0
        if uniform_work or sequence_tiles or not shared_layout:
            config = dataclasses.replace(config, segment_steps=False)
        else:
            segments = cached_segment_plan(mask, synced=True)
            tile_m = config.query_tile
            step_rows = kept_per_mask(
                mask,
                ("query_tile_rows", batch, q_heads),
                lambda: query_tile_rows(segments, tile_m, batch, q_heads),
                keep_unversioned=False,
            )
            mask = segments.mask
    tile_m, tile_n = config.query_tile, config.key_tile
    bounds = cached_block_minmax(mask, tile_n)
    ctas = backward_grid(batch, kv_heads, mask.seqlen_k, config)
    short_grid = ctas <= config.longest_ctas_first_waves * sms and not (deterministic or uniform_work)
    split_ctas = short_grid and config.split_ctas_max_parts > 0 and not config.segment_steps and not profiled
    # The parts' slots: at most four per SM, and never more than every CTA's parts.
    slots = min(SPLIT_CTA_SLOTS_PER_SM * sms, config.split_ctas_max_parts * ctas) if split_ctas else 0
    order = split_table = None
    if short_grid:
        if split_ctas:  # grid order, the long CTAs split
            parts, slack = config.split_ctas_max_parts, config.split_ctas_slack_pct
            split_table = kept_per_mask(
                mask,
                ("bwd_split", batch, q_heads, kv_heads, tile_m, tile_n, sms, parts, slack, slots),
                lambda: backward_split_plan(mask, batch, q_heads, kv_heads, tile_m, tile_n, sms, parts, slack, slots),
            )
        else:
            order = cached_longest_first(
                mask,
                ("bwd", batch, q_heads, kv_heads, tile_m, tile_n),
                lambda: backward_cta_steps(mask, batch, q_heads, kv_heads, tile_m, tile_n),
                config.longest_ctas_first_buckets,
            )
        config = config.for_short_grid()
    ranks = None
    if deterministic:  # each key tile's place in its query tiles' dQ sums (a stale one would hang)
        ranks = kept_per_mask(
            mask, ("dq_ranks", tile_m, tile_n), lambda: dq_ranks(mask, tile_m, tile_n), keep_unversioned=False
        )
    return BackwardPlan(mask, config, step_rows, bounds, order, split_table, slots, ranks)


def mask_variant(mask: ColumnMask | None, causal: bool = False) -> tuple[bool, int]:
    """(causal, width) of `mask`, as `fwd_config` / `bwd_config` take it (no mask: non-causal, 2,
    or with `causal` the causal mask alone: causal, 1; the kernels' stand-ins for them)."""
    if mask is None:
        return (True, 1) if causal else (False, 2)
    return mask.causal, mask.startend_row_indices.shape[-1]


def mask_fwd_config(head_dim: int, mask: ColumnMask | None, causal: bool = False) -> FwdConfig:
    """`fwd_config`'s choice for this head dim and mask: its variant and its segmented hint; `mask`
    None: a plain call, without a mask or (`causal`) with the causal one alone."""
    if mask is None:
        return fwd_config(head_dim, *mask_variant(None, causal), plain=True)
    return fwd_config(head_dim, *mask_variant(mask), segmented=mask.segmented)


def mask_bwd_config(
    head_dim: int, mask: ColumnMask | None, deterministic: bool = False, causal: bool = False
) -> BwdConfig:
    """`bwd_config`'s choice for this head dim, mask and mode, as `mask_fwd_config`'s."""
    return bwd_config(head_dim, *mask_variant(mask, causal), deterministic, plain=mask is None)


@functools.cache
def sm_count(device: torch.device) -> int:
    """The SMs of CUDA `device`."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def plan_mask(
    mask: ColumnMask, batch: int, q_heads: int, kv_heads: int, head_dim: int, sms: int, deterministic: bool = False
) -> None:
    """Compute and keep, per `mask`, the plans that the forward and backward of q [`batch`, S,
    `q_heads`, `head_dim`] and k, v with `kv_heads` heads launch with on a GPU of `sms` SMs, in the
    configurations they choose (v's head dim changes no plan)."""
    sequence_tiles = mask.seqlen_q != mask.seqlen_k
    forward_plan(mask, mask_fwd_config(head_dim, mask), batch, q_heads, sms, sequence_tiles=sequence_tiles)
    config = mask_bwd_config(head_dim, mask, deterministic)
    backward_plan(
        mask, config, batch, q_heads, kv_heads, sms, sequence_tiles=sequence_tiles, deterministic=deterministic
    )


def prepare_mask(
    mask: ColumnMask,
    device: torch.device | str,
    *,
    batch: int,
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    deterministic: bool = False,
) -> ColumnMask:
    """`mask` on `device` with the cute kernels' per-mask plans, computed where the mask is (a data
    loader's host) for q [`batch`, S, `q_heads`, `head_dim`], k and v with `kv_heads` heads, and
    copied with it from pinned memory without waiting for the GPU (`non_blocking`). The forward and
    backward of that shape on that mask then launch none of the plans' small kernels; another
    shape computes its own plans at its call, as an unprepared mask does. Once per batch, as
    FlexAttention's `create_block_mask`; a mask already on `device` gets its plans there (their
    kernels queued now); on a device other than a GPU, or at a head dim the kernels do not take
    (64, 128, 192 and 256 they do), only the move. The plans are kept in this process, for the
    mask's boundaries tensor: call it in the process that trains (a data loader's main-process
    collate or prefetch, not a worker), with the GPU's index where several are used, and on the
    stream the model runs on (the copies are queued there).

    Raises TypeError if `mask` is not a ColumnMask or `deterministic` not a bool, ValueError if
    `batch`, `q_heads`, `kv_heads` or `head_dim` is not an int >= 1 (Python or numpy) or they do
    not fit the mask (its batch and heads broadcast or match)."""
    if not isinstance(mask, ColumnMask):
        raise TypeError(f"mask must be a ColumnMask, got {type(mask).__name__}")
    batch, q_heads, kv_heads, head_dim = (
        check_int(name, value, 1)
        for name, value in (("batch", batch), ("q_heads", q_heads), ("kv_heads", kv_heads), ("head_dim", head_dim))
    )
    check_flag("deterministic", deterministic)
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if q_heads % kv_heads:
        raise ValueError(f"q_heads ({q_heads}) must be a multiple of kv_heads ({kv_heads})")
    mask.check_compatible(batch, q_heads, kv_heads, mask.seqlen_q, mask.seqlen_k)
    if device.type == "cuda" and head_dim in {d for d, _ in BACKWARD_HEAD_DIMS}:  # where the kernels run
        plan_mask(mask, batch, q_heads, kv_heads, head_dim, sm_count(device), deterministic)
    if mask.device == device:
        return mask
    pinned = mask.device.type == "cpu" and device.type == "cuda"

    def move(tensor: torch.Tensor) -> torch.Tensor:
        if not pinned:
            return tensor.to(device)
        # A pinned buffer of its own (the host allocator keeps it until the copy has run), even
        # where the caller's is pinned already and may be refilled while the copy waits.
        staged = tensor.clone().pin_memory() if tensor.is_pinned() else tensor.pin_memory()
        return staged.to(device, non_blocking=True)

    return moved_mask(mask, move)
