"""Context-parallel attention on torch.distributed (NCCL on GPUs, gloo on CPU).

Every rank holds its query/key/value chunks (see plan.py) and the global ColumnMask. Schemes:

- "mask_aware": each KV chunk goes only to the ranks whose queries see some of it (communication
  pruning, decided by every rank from the mask alone). Point-to-point messages, one per rank pair,
  are posted first; attention on the rank's own chunks runs while they travel (overlap); remote
  chunks follow, and partial results merge by LSE. With `ranks_per_node`, routing is hierarchical:
  a chunk crosses to another node once, to the rank in the same slot there, which relays it inside
  its node. Backward: dK/dV of remote chunks travel the same routes back and are summed at the
  owners (pruned the same way); dQ stays local.
- "ring": Megatron-style ring; every rank's KV passes around the ring, dK/dV travel with it in the
  backward and arrive summed at the owner.
- "allgather": plain all-gather of K and V, local attention on everything; dK/dV reduced back.

Local attention runs on any backend's forward ("reference" on CPU, "cute" on Hopper), with the
explicit backward from the merged O and LSE (FlashAttention's backward splits exactly over key
blocks given the final LSE).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..reference import ColumnMask
from ..reference import attention as reference
from .localize import localize
from .plan import CPPlan

SCHEMES = ("mask_aware", "ring", "allgather")


@dataclass(frozen=True)
class CPConfig:
    """How `cp_attention` communicates.

    Args:
        scheme: "mask_aware" (pruned point-to-point all-gather), "ring" or "allgather".
        prune: mask_aware only: skip chunks a receiver's queries cannot see.
        overlap: mask_aware only: compute on local chunks while remote chunks travel.
        ranks_per_node: mask_aware only: route hierarchically with this many ranks per node
            (None: one level).
        backend: local attention forward: "reference" or "cute".
    """

    scheme: str = "mask_aware"
    prune: bool = True
    overlap: bool = True
    ranks_per_node: int | None = None
    backend: str = "reference"

    def __post_init__(self) -> None:
        if self.scheme not in SCHEMES:
            raise ValueError(f"unknown CP scheme {self.scheme!r}; accepted: {', '.join(SCHEMES)}")
        if self.backend not in ("reference", "cute"):
            raise ValueError(f"CP backend must be 'reference' or 'cute', got {self.backend!r}")


@dataclass
class CPStats:
    """What the last call did on this rank: bytes sent, times (s), and the overlap."""

    bytes_sent: int = 0
    chunks_received: int = 0
    compute_local_s: float = 0.0
    wait_s: float = 0.0
    compute_remote_s: float = 0.0


last_stats = CPStats()


# -- local attention on one block of keys --------------------------------------------------------
def _block_forward(q, k, v, mask: ColumnMask, scale: float, backend: str):
    if backend == "cute":
        from ..optimized.interface import forward as cute_forward

        out, lse = cute_forward(q, k, v, mask, scale)
        return out.float(), lse
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    out, lse = reference.forward(q, k, v, mask, scale, compute)
    return out, lse


def _merge(acc, part):
    """Merge two (out, lse) partial results over disjoint key sets."""
    if acc is None:
        return part
    (o1, l1), (o2, l2) = acc, part
    lse = torch.logaddexp(l1, l2)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    w1 = torch.exp(l1 - safe).transpose(1, 2).unsqueeze(-1)  # [B, S, H, 1]
    w2 = torch.exp(l2 - safe).transpose(1, 2).unsqueeze(-1)
    return o1 * w1 + o2 * w2, lse


def _chunk_slice(plan: CPPlan, rank: int, chunk: int) -> slice:
    i = plan.assignment[rank].index(chunk)
    return slice(i * plan.chunk_size, (i + 1) * plan.chunk_size)


class _Layout:
    """Every rank's view of who needs which chunk and how chunks travel (same on all ranks)."""

    def __init__(self, mask: ColumnMask, plan: CPPlan, config: CPConfig):
        self.mask, self.plan, self.config = mask, plan, config
        self._union_masks: dict[tuple, ColumnMask] = {}
        chunks = range(plan.num_chunks)
        self.needs = []
        for r in range(plan.world_size):
            if not config.prune:
                self.needs.append([True] * plan.num_chunks)
                continue
            # One localization against every key: visible rows per key column, summed per chunk.
            visible = localize(mask, plan.assignment[r], chunks, plan.chunk_size).visible_counts()
            per_chunk = visible.view(*visible.shape[:-1], plan.num_chunks, plan.chunk_size).sum(dim=(0, 1, 3))
            self.needs.append((per_chunk > 0).tolist())
        self.phases = self._routes()

    def needed(self, rank: int, chunks) -> list[int]:
        """The chunks among `chunks` that rank's queries need, sorted."""
        return [c for c in sorted(chunks) if self.needs[rank][c]]

    def union_mask(self, rank: int, chunks: list[int]) -> ColumnMask:
        """Localized mask of rank's queries against the sorted `chunks` concatenated."""
        key = (rank, tuple(chunks))
        if key not in self._union_masks:
            self._union_masks[key] = localize(self.mask, self.plan.assignment[rank], chunks, self.plan.chunk_size)
        return self._union_masks[key]

    def _routes(self) -> list[dict[tuple[int, int], list[int]]]:
        """Messages per phase: (src, dst) -> chunk ids, in order."""
        plan, rpn = self.plan, self.config.ranks_per_node
        world = plan.world_size
        if rpn is None or rpn >= world:
            direct: dict[tuple[int, int], list[int]] = {}
            for dst in range(world):
                for c in range(plan.num_chunks):
                    src = plan.owner(c)
                    if src != dst and self.needs[dst][c]:
                        direct.setdefault((src, dst), []).append(c)
            return [direct]
        if world % rpn:
            raise ValueError(f"world size {world} is not a multiple of ranks_per_node {rpn}")
        inter: dict[tuple[int, int], list[int]] = {}
        intra: dict[tuple[int, int], list[int]] = {}
        for c in range(plan.num_chunks):
            src = plan.owner(c)
            for node in range(world // rpn):
                members = range(node * rpn, (node + 1) * rpn)
                wanting = [r for r in members if self.needs[r][c] and r != src]
                if not wanting:
                    continue
                if src in members:
                    holder = src
                else:  # one crossing per node: to the rank in the owner's slot there
                    holder = node * rpn + src % rpn
                    inter.setdefault((src, holder), []).append(c)
                for r in wanting:
                    if r != holder:
                        intra.setdefault((holder, r), []).append(c)
        return [inter, intra]


_last_layout: tuple | None = None


def _layout_for(mask: ColumnMask, plan: CPPlan, config: CPConfig) -> _Layout:
    """The layout of (mask, plan, config), reused while the same objects come back unchanged
    (every attention layer of a training step shares them); an in-place edit of the mask's
    tensor bumps its version and rebuilds the layout."""
    global _last_layout
    version = mask.startend_row_indices._version
    if _last_layout is None or _last_layout[:4] != (id(mask), id(plan), version, config):
        # The objects are kept in the entry, so their ids cannot be reused while it lives.
        _last_layout = (id(mask), id(plan), version, config, (mask, plan), _Layout(mask, plan, config))
    return _last_layout[5]


def _exchange(messages: dict[tuple[int, int], list[int]], blocks: dict[int, torch.Tensor], template, rank, group):
    """Post one phase of point-to-point messages. Each message is its chunks' blocks
    ([2, B, C, H, D]: k and v, or dk and dv) concatenated along the token dim.

    Returns (works, received: src -> tensor, bytes sent).
    """
    ops, received, sent = [], {}, 0
    for (src, dst), chunks in messages.items():
        if src == rank:
            data = torch.cat([blocks[c] for c in chunks], dim=2).contiguous()
            ops.append(dist.P2POp(dist.isend, data, _global(dst, group), group))
            sent += data.numel() * data.element_size()
        elif dst == rank:
            shape = list(template.shape)
            shape[2] *= len(chunks)
            received[src] = torch.empty(shape, dtype=template.dtype, device=template.device)
            ops.append(dist.P2POp(dist.irecv, received[src], _global(src, group), group))
    works = dist.batch_isend_irecv(ops) if ops else []
    return works, received, sent


def _split(data: torch.Tensor, chunks: list[int], chunk_size: int) -> dict[int, torch.Tensor]:
    return {c: data[:, :, i * chunk_size:(i + 1) * chunk_size] for i, c in enumerate(chunks)}


def _global(rank: int, group) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


def _wait(works, stats: CPStats) -> None:
    start = time.perf_counter()
    for w in works:
        w.wait()
    stats.wait_s += time.perf_counter() - start


class _CPFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, plan, group, config, scale):
        rank = dist.get_rank(group)
        layout = _layout_for(mask, plan, config)
        stats = CPStats()
        held = {c: torch.stack([k[:, _chunk_slice(plan, rank, c)], v[:, _chunk_slice(plan, rank, c)]])
                for c in plan.assignment[rank]}
        forward_fn = {"mask_aware": _forward_mask_aware, "ring": _forward_ring, "allgather": _forward_allgather}
        out, lse, held = forward_fn[config.scheme](q, held, layout, rank, group, scale, stats)
        global last_stats
        last_stats = stats
        ctx.save_for_backward(q, out, lse)
        ctx.layout, ctx.group, ctx.scale, ctx.rank, ctx.held = layout, group, scale, rank, held
        ctx.mark_non_differentiable(lse)
        return out.to(q.dtype), lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, out, lse = ctx.saved_tensors
        layout, rank, group, plan = ctx.layout, ctx.rank, ctx.group, ctx.layout.plan
        if layout.config.scheme == "ring":
            dq, grads = _backward_ring(dout, q, out, lse, ctx.held, layout, rank, group, ctx.scale)
        else:
            dq, grads = _backward_on(dout, q, out, lse, ctx.held, sorted(ctx.held), layout, rank, ctx.scale)
            if layout.config.scheme == "mask_aware":
                _return_grads(grads, layout, rank, group)
            else:
                _reduce_allgather_grads(grads, layout, rank, group)
        own = plan.assignment[rank]
        dk = torch.cat([grads[c][0] for c in own], dim=1)
        dv = torch.cat([grads[c][1] for c in own], dim=1)
        return dq.to(q.dtype), dk.to(q.dtype), dv.to(q.dtype), None, None, None, None, None


def _attend(q, chunks, held, layout, rank, scale, acc):
    """Merge into `acc` the attention of rank's queries to the needed chunks among `chunks`: one
    call over their concatenated keys (one localized mask), not one per chunk."""
    needed = layout.needed(rank, chunks)
    if not needed:
        return acc
    kv = torch.cat([held[c] for c in needed], dim=2)
    part = _block_forward(q, kv[0], kv[1], layout.union_mask(rank, needed), scale, layout.config.backend)
    return _merge(acc, part)


def _finish(acc, q):
    if acc is None:  # the rank's queries see no key at all
        b, s, h, d = q.shape
        out = torch.zeros(b, s, h, d, dtype=torch.float32, device=q.device)
        return out, torch.full((b, h, s), -math.inf, device=q.device)
    return acc


def _forward_mask_aware(q, held, layout, rank, group, scale, stats):
    plan, config = layout.plan, layout.config
    template = next(iter(held.values()))
    own = list(plan.assignment[rank])
    acc = None
    for phase, messages in enumerate(layout.phases):
        works, received, sent = _exchange(messages, held, template, rank, group)
        stats.bytes_sent += sent
        if phase == 0 and config.overlap:  # local chunks while the remote ones travel
            start = time.perf_counter()
            acc = _attend(q, own, held, layout, rank, scale, acc)
            stats.compute_local_s = time.perf_counter() - start
        _wait(works, stats)
        for (src, dst), chunks in messages.items():
            if dst == rank:
                held.update(_split(received[src], chunks, plan.chunk_size))
                stats.chunks_received += len(chunks)
    if not config.overlap:
        start = time.perf_counter()
        acc = _attend(q, own, held, layout, rank, scale, acc)
        stats.compute_local_s = time.perf_counter() - start
    start = time.perf_counter()
    acc = _attend(q, [c for c in sorted(held) if c not in own], held, layout, rank, scale, acc)
    stats.compute_remote_s = time.perf_counter() - start
    return (*_finish(acc, q), held)


def _ring_neighbors(rank: int, world: int) -> tuple[int, int]:
    return (rank + 1) % world, (rank - 1) % world


def _ring_step(block: torch.Tensor, rank: int, world: int, group, stats: CPStats) -> torch.Tensor:
    """Send `block` to the next rank, receive the previous rank's."""
    nxt, prev = _ring_neighbors(rank, world)
    incoming = torch.empty_like(block)
    ops = [dist.P2POp(dist.isend, block.contiguous(), _global(nxt, group), group),
           dist.P2POp(dist.irecv, incoming, _global(prev, group), group)]
    _wait(dist.batch_isend_irecv(ops), stats)
    stats.bytes_sent += block.numel() * block.element_size()
    return incoming


def _forward_ring(q, held, layout, rank, group, scale, stats):
    plan = layout.plan
    world = plan.world_size
    block = torch.cat([held[c] for c in plan.assignment[rank]], dim=2)
    acc = None
    for step in range(world):
        owner = (rank - step) % world
        chunks = list(plan.assignment[owner])
        blocks = _split(block, chunks, plan.chunk_size)
        start = time.perf_counter()
        acc = _attend(q, chunks, blocks, layout, rank, scale, acc)
        stats.compute_remote_s += time.perf_counter() - start
        if step < world - 1:
            block = _ring_step(block, rank, world, group, stats)
    return (*_finish(acc, q), held)


def _forward_allgather(q, held, layout, rank, group, scale, stats):
    plan = layout.plan
    mine = torch.cat([held[c] for c in plan.assignment[rank]], dim=2).contiguous()
    gathered = [torch.empty_like(mine) for _ in range(plan.world_size)]
    start = time.perf_counter()
    dist.all_gather(gathered, mine, group=group)
    stats.wait_s = time.perf_counter() - start
    stats.bytes_sent = mine.numel() * mine.element_size() * (plan.world_size - 1)
    everything = {}
    for r, data in enumerate(gathered):
        everything.update(_split(data, list(plan.assignment[r]), plan.chunk_size))
    start = time.perf_counter()
    acc = _attend(q, sorted(everything), everything, layout, rank, scale, None)
    stats.compute_remote_s = time.perf_counter() - start
    return (*_finish(acc, q), everything)


# -- backward ------------------------------------------------------------------------------------
def _backward_on(dout, q, out, lse, held, chunks, layout, rank, scale):
    """dQ and per-chunk [dK; dV] of rank's queries against `chunks` (zeros where unseen), from
    one backward call over the needed chunks concatenated."""
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    needed = layout.needed(rank, chunks)
    grads = {c: torch.zeros(held[c].shape, dtype=compute, device=held[c].device) for c in chunks if c not in needed}
    if not needed:
        return torch.zeros(q.shape, dtype=compute, device=q.device), grads
    kv = torch.cat([held[c] for c in needed], dim=2)
    mask = layout.union_mask(rank, needed)
    dq, dk, dv = reference.backward(dout, q, kv[0], kv[1], out, lse, mask, scale, compute)
    grads.update(_split(torch.stack([dk, dv]), needed, layout.plan.chunk_size))
    return dq, grads


def _return_grads(grads, layout, rank, group):
    """Send dK/dV of held chunks back along the forward routes (reversed), summing on the way."""
    plan = layout.plan
    stats = CPStats()
    for messages in reversed(layout.phases):
        back = {(dst, src): chunks for (src, dst), chunks in messages.items()}
        template = next(iter(grads.values()))
        works, received, _ = _exchange(back, grads, template, rank, group)
        _wait(works, stats)
        for (src, dst), chunks in back.items():
            if dst == rank:
                for c, g in _split(received[src], chunks, plan.chunk_size).items():
                    grads[c] = grads[c] + g


def _reduce_allgather_grads(grads, layout, rank, group):
    """Sum every rank's dK/dV of every chunk at its owner (all-reduce: gloo has no reduce-scatter)."""
    plan = layout.plan
    full = torch.cat([grads[c] for c in range(plan.num_chunks)], dim=2).contiguous()
    dist.all_reduce(full, group=group)
    grads.update(_split(full, list(range(plan.num_chunks)), plan.chunk_size))


def _backward_ring(dout, q, out, lse, held, layout, rank, group, scale):
    """KV travels the ring again with its dK/dV accumulator; after a full turn the sums are home."""
    plan = layout.plan
    world = plan.world_size
    stats = CPStats()
    own = list(plan.assignment[rank])
    block = torch.cat([held[c] for c in own], dim=2)
    dq_total = None
    acc_grad = None
    for step in range(world):
        owner = (rank - step) % world
        chunks = list(plan.assignment[owner])
        blocks = _split(block, chunks, plan.chunk_size)
        dq, grads = _backward_on(dout, q, out, lse, blocks, chunks, layout, rank, scale)
        dq_total = dq if dq_total is None else dq_total + dq
        mine = torch.cat([grads[c] for c in chunks], dim=2)
        acc_grad = mine if acc_grad is None else acc_grad + mine
        if step < world - 1:
            block = _ring_step(block, rank, world, group, stats)
            acc_grad = _ring_step(acc_grad, rank, world, group, stats)
    # After world-1 steps each accumulator sits one rank before its owner's successor: one more hop.
    acc_grad = _ring_step(acc_grad, rank, world, group, stats)
    return dq_total, _split(acc_grad, own, plan.chunk_size)


def cp_attention(
    q_local: torch.Tensor,
    k_local: torch.Tensor,
    v_local: torch.Tensor,
    mask: ColumnMask,
    plan: CPPlan,
    group: dist.ProcessGroup | None = None,
    config: CPConfig = CPConfig(),
    softmax_scale: float | None = None,
    return_lse: bool = False,
):
    """Context-parallel attention of this rank's chunks; differentiable.

    Args:
        q_local, k_local, v_local: [B, plan.local_len, H, D], this rank's chunks concatenated
            (`plan.shard(x, rank)`); Hq a multiple of Hkv.
        mask: the global ColumnMask (same on every rank).
        plan: the chunk assignment (same on every rank).
        group: the CP process group (default: the world).
        config: scheme, pruning, overlap, hierarchy, local backend.

    Returns:
        This rank's output [B, local_len, Hq, D] (and LSE [B, Hq, local_len] with `return_lse`).
    """
    world = dist.get_world_size(group)
    if world != plan.world_size:
        raise ValueError(f"plan is for {plan.world_size} ranks but the group has {world}")
    for name, t in (("q_local", q_local), ("k_local", k_local), ("v_local", v_local)):
        if t.dim() != 4 or t.shape[1] != plan.local_len:
            raise ValueError(f"{name} must be [B, {plan.local_len}, H, D] (this rank's chunks), got {tuple(t.shape)}")
    if mask.seqlen_q != plan.seqlen or mask.seqlen_k != plan.seqlen:
        raise ValueError(f"mask covers {mask.seqlen_q}x{mask.seqlen_k} tokens but the plan {plan.seqlen}")
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q_local.shape[-1])
    out, lse = _CPFunction.apply(q_local, k_local, v_local, mask, plan, group, config, scale)
    return (out, lse) if return_lse else out


class ContextParallelAttention(torch.nn.Module):
    """`cp_attention` as a module for a model's attention layers: holds the group and config;
    each call takes the batch's global mask and plan (both change with the packing)."""

    def __init__(self, group: dist.ProcessGroup | None = None, config: CPConfig = CPConfig(),
                 softmax_scale: float | None = None):
        super().__init__()
        self.group, self.config, self.softmax_scale = group, config, softmax_scale

    def forward(self, q_local, k_local, v_local, mask: ColumnMask, plan: CPPlan) -> torch.Tensor:
        return cp_attention(q_local, k_local, v_local, mask, plan, self.group, self.config, self.softmax_scale)
