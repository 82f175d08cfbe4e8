"""Context-parallel attention on torch.distributed (NCCL on GPUs, gloo on CPU).

Every rank holds its query/key/value chunks (see plan.py) and the global ColumnMask. Schemes:

- "mask_aware": each KV chunk goes only to the ranks whose queries see some of it (communication
  pruning, decided by every rank from the mask alone). Point-to-point messages, one per rank pair,
  are posted first; attention on the rank's own chunks runs while they travel (overlap); remote
  chunks follow, and partial results merge by LSE. With `ranks_per_node`, routing is hierarchical:
  a chunk crosses to another node once, to the rank in the same slot there, which relays it inside
  its node. Backward: the remote chunks first, then the own chunks while the remote chunks' dK/dV
  travel the same routes back, summed at the owners (pruned the same way); dQ stays local.
- "ring": Megatron-style ring; every rank's KV passes around the ring, the next block posted before
  the current one is computed; dK/dV travel with it in the backward and arrive summed at the owner.
- "allgather": plain all-gather of K and V, local attention on everything; dK/dV reduce-scattered
  back (all-reduced where the backend has no reduce-scatter).

The code splits as MagiAttention's does: plan (`_Layout`: who needs which chunk and the routes,
the same on every rank, no communication), comm (`_Comm`: point-to-point batches, ring shifts and
collectives on the group) and runtime (`_LocalAttention`: one kernel call per set of chunks, and
the per-scheme loops). Local calls pick their kernel once per call (`_local_backend`): the CuTe
Hopper kernels where they support the inputs, else the PyTorch reference, in both directions; the
backward is the kernel's own, fed the merged O and LSE (FlashAttention's backward splits exactly
over key blocks given the final LSE).

Memory: by default a rank keeps only its own K/V for the backward and fetches the remote K/V
again along the same routes (the ring passes KV around again, as Megatron's does);
`CPConfig(hold_remote_kv=True)` keeps the remote chunks instead, trading memory per layer for one
fewer K/V exchange. mask_aware otherwise receives every remote chunk at once; with
`CPConfig(stage_chunks=k)` it receives them in stages of at most k chunks per rank, in both
directions, the next stage posted before the current one is computed and each stage's buffers
let go after it (ring-flash-attention's loop; the backward sends each stage's dK/dV home while
the next computes): a rank holds its own K/V plus at most 2k remote chunks. Stages take a rank's
chunks in ring order, the next ranks' first, so that a stage's receivers mostly ask different
senders. `rank_stats()` (one
rank per process: `last_forward_stats` / `last_backward_stats`) reports the bytes held, sent and
the times.
"""

from __future__ import annotations

import contextlib
import math
import os
import socket
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import cast

import numpy as np
import torch
import torch.distributed as dist

from ..memo import TensorMemo
from ..optimized import interface as cute_kernels
from ..reference import ColumnMask
from ..reference import attention as reference
from ..reference.constructors import check_count, check_flag
from .localize import chunk_visibility, localize
from .plan import CPPlan

SCHEMES = ("mask_aware", "ring", "allgather")
BACKENDS = ("auto", "reference", "cute")

# reduce_scatter_single is torch 2.13's name for reduce_scatter_tensor (same arguments).
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass(frozen=True)
class CPConfig:
    """How `cp_attention` communicates and computes.

    Args:
        scheme: "mask_aware" (pruned point-to-point all-gather), "ring" or "allgather".
        prune: skip chunks a receiver's queries cannot see (mask_aware: not sent; all schemes: not
            computed).
        overlap: mask_aware only: compute on local chunks while remote chunks travel, and in the
            backward while their dK/dV travel back (the ring always overlaps).
        ranks_per_node: mask_aware only: route hierarchically with this many consecutive group
            ranks per node (None: one level). Checked against the hosts' names at the first call.
        backend: local attention kernels, forward and backward: "cute" (the Hopper kernels; an
            error where they cannot run), "reference" (PyTorch) or "auto" (cute where supported).
        hold_remote_kv: keep the remote K/V chunks from the forward for the backward instead of
            fetching them again (more memory per layer, one fewer K/V exchange).
        stage_chunks: mask_aware only: receive the remote K/V chunks in stages of at most this
            many per rank, forward and backward (the next stage travels while one is computed,
            then its buffers go), so a rank holds its own K/V plus at most two stages' chunks
            instead of every remote chunk at once. None: one stage. Not with `ranks_per_node`
            (its relays would need staging across two phases) nor with `hold_remote_kv` (holding
            every remote chunk is what staging avoids).
    """

    scheme: str = "mask_aware"
    prune: bool = True
    overlap: bool = True
    ranks_per_node: int | None = None
    backend: str = "auto"
    hold_remote_kv: bool = False
    stage_chunks: int | None = None

    def __post_init__(self) -> None:
        if self.scheme not in SCHEMES:
            raise ValueError(f"unknown CP scheme {self.scheme!r}; accepted: {', '.join(SCHEMES)}")
        if self.backend not in BACKENDS:
            raise ValueError(f"unknown CP backend {self.backend!r}; accepted: {', '.join(BACKENDS)}")
        for name in ("prune", "overlap", "hold_remote_kv"):
            check_flag(name, getattr(self, name))
        for name in ("ranks_per_node", "stage_chunks"):  # a numpy int is kept as a plain int
            object.__setattr__(self, name, check_count(name, getattr(self, name)))
        if self.stage_chunks is not None:
            for clash, why in (
                (self.scheme != "mask_aware", f"scheme={self.scheme!r}: only mask_aware fetches in stages"),
                (self.ranks_per_node is not None, "ranks_per_node: hierarchical routing's relays are not staged"),
                (self.hold_remote_kv, "hold_remote_kv=True: holding every remote chunk is what staging avoids"),
            ):
                if clash:
                    raise ValueError(f"CPConfig(stage_chunks={self.stage_chunks}) does not go with {why}")


@dataclass
class CPStats:
    """What one direction (forward or backward) of the last call did on this rank.

    Times are seconds on the device's clock: CUDA events on CUDA, read lazily (the first read
    waits for the call's events, the call itself never synchronizes), host time otherwise. K/V bytes
    count the rank's own K/V once plus the remote chunk buffers it holds; not the concatenation
    made for each kernel call, nor dK/dV. `peak_grad_bytes` (backward) counts the dK/dV message
    buffers at once, sends and receives, each from its posting until it is waited for (mask_aware,
    staged or not, and the ring; not allgather's reduce-scatter, nor the dK/dV a kernel call
    returns or the own chunks' sums).
    """

    bytes_sent: int = 0
    chunks_received: int = 0
    saved_kv_bytes: int = 0  # forward: the K/V kept from the forward for the backward
    peak_kv_bytes: int = 0
    peak_grad_bytes: int = 0
    _spans: dict[str, list] = field(default_factory=dict, repr=False)
    _live_kv: dict[int, int] = field(default_factory=dict, repr=False)  # storage pointer -> bytes
    _live_grad: dict[int, int] = field(default_factory=dict, repr=False)  # storage pointer -> bytes

    @property
    def compute_local_s(self) -> float:
        """Attention on the rank's own chunks (ring: its own block, step 0)."""
        return self.seconds("compute_local")

    @property
    def compute_remote_s(self) -> float:
        """Attention on remote chunks (allgather: on everything, one call)."""
        return self.seconds("compute_remote")

    @property
    def wait_s(self) -> float:
        """Waiting for messages and collectives, the part not hidden under compute."""
        return self.seconds("wait")

    @contextlib.contextmanager
    def timed(self, name: str, device: torch.device):
        """Add the time of the block to `name`, on `device`'s clock."""
        if device.type == "cuda":
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            stop.record()
            self._spans.setdefault(name, []).append((start, stop))
        else:
            began = time.perf_counter()
            yield
            self._spans.setdefault(name, []).append(time.perf_counter() - began)

    def seconds(self, name: str) -> float:
        """The seconds added to `name` (waits for the CUDA events first)."""
        total = 0.0
        for span in self._spans.get(name, ()):
            if isinstance(span, float):
                total += span
            else:
                span[1].synchronize()
                total += span[0].elapsed_time(span[1]) / 1e3
        return total

    def hold_kv(self, *tensors: torch.Tensor) -> None:
        """Count the storages of K/V tensors now held (a view counts its whole buffer, once)."""
        for t in tensors:
            self._live_kv[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        self.peak_kv_bytes = max(self.peak_kv_bytes, self.held_kv_bytes)

    def drop_kv(self, *tensors: torch.Tensor) -> None:
        """Stop counting the storages of these K/V tensors (released; see `hold_kv`)."""
        for t in tensors:
            self._live_kv.pop(t.untyped_storage().data_ptr(), None)

    @property
    def held_kv_bytes(self) -> int:
        return sum(self._live_kv.values())

    def set_kv(self, *tensors: torch.Tensor) -> None:
        """The K/V held from now on is exactly `tensors`."""
        self._live_kv.clear()
        self.hold_kv(*tensors)

    def hold_grad(self, *tensors: torch.Tensor) -> None:
        """Count the storages of dK/dV message buffers now in flight (as `hold_kv`)."""
        for t in tensors:
            self._live_grad[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        self.peak_grad_bytes = max(self.peak_grad_bytes, sum(self._live_grad.values()))

    def drop_grad(self, *tensors: torch.Tensor) -> None:
        """Stop counting the storages of these dK/dV message buffers (waited for; see `hold_grad`)."""
        for t in tensors:
            self._live_grad.pop(t.untyped_storage().data_ptr(), None)


last_forward_stats = CPStats()
"""This process's `CPStats` of the last `cp_attention` forward (ranks as threads: the rank's that
finished last; `rank_stats` has each rank's)."""
last_backward_stats = CPStats()
"""This process's `CPStats` of the last `cp_attention` backward (see `last_forward_stats`)."""
_stats_by_rank: dict[int, list[CPStats]] = {}  # global rank -> [forward, backward] of its last calls


def rank_stats(rank: int | None = None) -> tuple[CPStats, CPStats]:
    """(forward, backward) `CPStats` of the last `cp_attention` forward and backward of global rank
    `rank` (default: the caller's, `dist.get_rank()`). The same as `last_forward_stats` /
    `last_backward_stats` with one rank per process; with ranks as threads (`emulate`), where those
    hold whichever rank's call finished last, each rank's own."""
    entry = _stats_by_rank.get(dist.get_rank() if rank is None else rank)
    return (entry[0], entry[1]) if entry else (CPStats(), CPStats())


def _record_stats(direction: int, stats: CPStats, comm: _Comm) -> None:
    """Keep `stats` as its rank's last of `direction` (0 forward, 1 backward)."""
    _stats_by_rank.setdefault(_global(comm.rank, comm.group), [CPStats(), CPStats()])[direction] = stats


# -- plan: who needs which chunk, and how chunks travel --------------------------------------------
class _Layout:
    """Every rank's view of who needs which chunk and how chunks travel (same on all ranks).

    `needs` is bool [ranks, chunks]: whether a rank's queries see any key of a chunk. `phases` are
    the routing phases, each (src, dst) -> chunk ids in increasing order, the messages in the order
    they are posted (by receiver, then chunk; hierarchical: by chunk, then receiver). `stages`
    (with `stage_chunks`, else None) split the one-level route into stages in ring order (see
    `_stages`), each (src, dst) -> chunk ids of that stage, increasing."""

    def __init__(self, mask: ColumnMask, plan: CPPlan, config: CPConfig):
        self.mask, self.plan, self.config = mask, plan, config
        self._union_masks: dict[tuple, ColumnMask] = {}
        if config.prune:  # a rank needs a key chunk when any of its query chunks sees it
            self.needs = chunk_visibility(mask, plan.chunk_size)[np.asarray(plan.assignment)].any(axis=1)
        else:
            self.needs = np.ones((plan.world_size, plan.num_chunks), dtype=bool)
        self.phases = self._routes()
        self.stages = self._stages(config.stage_chunks) if config.stage_chunks is not None else None

    def needed(self, rank: int, chunks) -> list[int]:
        """The chunks among `chunks` that rank's queries need, sorted."""
        return [c for c in sorted(chunks) if self.needs[rank, c]]

    def union_mask(self, rank: int, chunks: list[int]) -> ColumnMask:
        """Localized mask of rank's queries against the sorted `chunks` concatenated."""
        key = (rank, tuple(chunks))
        if key not in self._union_masks:
            self._union_masks[key] = localize(self.mask, self.plan.assignment[rank], chunks, self.plan.chunk_size)
        return self._union_masks[key]

    def _routes(self) -> list[dict[tuple[int, int], list[int]]]:
        """Messages per phase: (src, dst) -> chunk ids, in order."""
        plan, rpn = self.plan, self.config.ranks_per_node
        world, owner = plan.world_size, plan.chunk_owners
        ranks = np.arange(world)
        wanted = self.needs & (owner != ranks[:, None])  # [rank, chunk]: a remote chunk its queries see
        if rpn is None or rpn >= world:
            dst, chunk = np.nonzero(wanted)  # by receiver, then chunk
            return [_messages(owner[chunk], dst, chunk, world)]
        if world % rpn:
            raise ValueError(f"ranks_per_node={rpn} must divide the world size {world}")
        nodes = np.arange(world // rpn)[:, None]
        # One crossing per (chunk, node) that wants it, to the rank in the owner's slot there, which
        # relays it inside its node; the owner's own node gets it from the owner.
        at_home = nodes == owner // rpn  # [node, chunk]
        holder = np.where(at_home, owner, nodes * rpn + owner % rpn)
        crossing = wanted.reshape(len(nodes), rpn, -1).any(axis=1) & ~at_home
        chunk, node = np.nonzero(crossing.T)  # by chunk, then node
        inter = _messages(owner[chunk], holder[node, chunk], chunk, world)
        relayed = wanted & (ranks[:, None] != holder[ranks // rpn])
        chunk, dst = np.nonzero(relayed.T)  # by chunk, then receiver
        intra = _messages(holder[dst // rpn, chunk], dst, chunk, world)
        return [inter, intra]

    def _stages(self, k: int) -> list[dict[tuple[int, int], list[int]]]:
        """Messages per stage: stage s carries to each rank its needed remote chunks number
        [s*k, (s+1)*k) (k: `stage_chunks`) in ring order: by the owner's distance after the rank,
        (owner - rank) mod world, nearest first, then by chunk. In chunk order every receiver would
        ask the owners of the lowest chunks in stage 0 and leave the others idle; in ring order the
        receivers of a stage mostly ask different senders. Every rank derives the same list, so
        senders post exactly what receivers expect; there are as many stages as the rank needing
        the most chunks has, on every rank, and a rank with nothing in a stage posts nothing."""
        world, owner = self.plan.world_size, self.plan.chunk_owners
        wanted = self.needs & (owner != np.arange(world)[:, None])
        dst, chunk = np.nonzero(wanted)  # by receiver, then chunk
        order = np.lexsort((chunk, (owner[chunk] - dst) % world, dst))  # by receiver, distance, chunk
        dst, chunk = dst[order], chunk[order]
        stage = (np.arange(len(dst)) - np.searchsorted(dst, dst)) // k  # place among the receiver's chunks
        count = int(stage.max()) + 1 if len(stage) else 0
        return [_messages(owner[chunk[stage == s]], dst[stage == s], chunk[stage == s], world) for s in range(count)]


def _messages(src: np.ndarray, dst: np.ndarray, chunks: np.ndarray, world: int) -> dict[tuple[int, int], list[int]]:
    """Chunk sends (parallel arrays, in posting order) grouped into messages: (src, dst) -> chunk ids,
    the pairs in the order of their first send."""
    if not len(chunks):
        return {}
    pair = src * world + dst
    order = np.argsort(pair, kind="stable")  # grouped by pair, each group in posting order
    grouped = pair[order]
    starts = np.flatnonzero(np.r_[True, grouped[1:] != grouped[:-1]])
    ends = np.r_[starts[1:], len(pair)]
    sent = chunks[order].tolist()
    messages = {}
    for g in np.argsort(order[starts], kind="stable"):
        p = int(grouped[starts[g]])
        messages[divmod(p, world)] = sent[starts[g] : ends[g]]
    return messages


_layouts = threading.local()  # one memo per thread, as per process: threads as ranks keep their own


def _layout_for(mask: ColumnMask, plan: CPPlan, config: CPConfig) -> _Layout:
    """The layout of (mask, plan, config), reused while the same plan and config and the same
    boundaries tensor, unchanged, come back (every attention layer of a training step shares them;
    the last eight are kept, each with its localized masks, so schemes or masks taking turns do not
    evict each other): a steady-state call plans nothing, so it makes no host sync, and a CUDA graph
    captured after a first call reuses its plan. An in-place edit of the mask's tensor bumps its
    version and rebuilds the layout; an inference tensor builds it at every call."""
    memo = getattr(_layouts, "memo", None)
    if memo is None:
        memo = _layouts.memo = TensorMemo[_Layout](size=8, build_under_capture=False)
    # The layout holds the plan, so its id cannot be reused while the entry lives.
    key = (id(plan), config, mask.causal, mask.seqlen_q)
    return memo.get(key, [mask.startend_row_indices], lambda: _Layout(mask, plan, config))


# -- comm: the group's side --------------------------------------------------------------------------
_has_reduce_scatter: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # group -> bool, once warm
_checked_node_layouts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # group -> {ranks_per_node}
_TAGS = {"kv": 0, "dkv": 1}  # gloo matches messages by (peer, tag): K/V and dK/dV in flight at once


def _group_key(group) -> dist.ProcessGroup | None:
    return group if group is not None else dist.group.WORLD


def _warm_up(group, device: torch.device) -> bool:
    """Join every rank of the group in one collective, once per group; return whether the backend
    has reduce-scatter.

    NCCL needs every rank of a group in its first collective or batched point-to-point call, and a
    rank without messages posts no batch. The collective is a reduce-scatter where the backend has
    one (NCCL; gloo in recent torch), else an all-reduce: an unsupported collective raises on every
    rank alike, before any communication.
    """
    key = _group_key(group)
    if key not in _has_reduce_scatter:
        world = dist.get_world_size(group)
        probe = torch.zeros(world, device=device)
        try:
            _reduce_scatter(torch.zeros(1, device=device), probe, group=group)
            _has_reduce_scatter[key] = True
        except (RuntimeError, NotImplementedError):
            dist.all_reduce(probe, group=group)
            _has_reduce_scatter[key] = False
    return _has_reduce_scatter[key]


def _check_node_layout(group, ranks_per_node: int) -> None:
    """Hierarchical routing relays inside blocks of `ranks_per_node` consecutive group ranks: check,
    once per group, that each block runs on one host (same host name and, where the launcher sets
    LOCAL_RANK, distinct local ranks: containers on different nodes may share a host name)."""
    world = dist.get_world_size(group)
    if ranks_per_node >= world or ranks_per_node in _checked_node_layouts.get(_group_key(group), ()):
        return
    if world % ranks_per_node:
        raise ValueError(f"CPConfig(ranks_per_node={ranks_per_node}) must divide the group size {world}")
    places: list = [None] * world
    dist.all_gather_object(places, (socket.gethostname(), os.environ.get("LOCAL_RANK")), group=group)
    for first in range(0, world, ranks_per_node):
        block = places[first : first + ranks_per_node]
        hosts = sorted({host for host, _ in block})
        local_ranks = [local for _, local in block if local is not None]
        if len(hosts) > 1 or len(set(local_ranks)) < len(local_ranks):
            raise ValueError(
                f"CPConfig(ranks_per_node={ranks_per_node}) treats group ranks {first}-{first + ranks_per_node - 1} "
                f"as one node, but they run on hosts {hosts} with local ranks {local_ranks}; order the group's "
                f"ranks by node or set ranks_per_node to the number of consecutive group ranks that share a node"
            )
    _checked_node_layouts.setdefault(_group_key(group), set()).add(ranks_per_node)


def _global(rank: int, group) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


@dataclass
class _Pending:
    """Posted messages: their works, the buffers receiving, and the sends kept alive until the wait."""

    works: list
    received: dict
    sends: list
    what: str


class _Comm:
    """The group's side of one call: point-to-point batches, ring shifts and collectives, counted
    in `stats` (bytes sent, time waiting)."""

    def __init__(self, group, device: torch.device, stats: CPStats):
        self.group, self.device, self.stats = group, device, stats
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.has_reduce_scatter = _warm_up(group, device)

    def post(self, sends: dict[int, torch.Tensor], recvs: dict[int, torch.Tensor], what: str) -> _Pending:
        """Post sends (group rank -> tensor) and receives (group rank -> buffer) in one batch."""
        tag = _TAGS[what]
        ops = [dist.P2POp(dist.isend, t, _global(dst, self.group), self.group, tag) for dst, t in sends.items()]
        ops += [dist.P2POp(dist.irecv, t, _global(src, self.group), self.group, tag) for src, t in recvs.items()]
        self.stats.bytes_sent += sum(t.numel() * t.element_size() for t in sends.values())
        if what == "dkv":
            self.stats.hold_grad(*sends.values(), *recvs.values())
        return _Pending(dist.batch_isend_irecv(ops) if ops else [], recvs, list(sends.values()), what)

    def ring_shift(self, block: torch.Tensor, what: str) -> _Pending:
        """Send `block` to the next rank, receive the previous rank's into a new buffer (a ring of
        one hands the block back)."""
        if self.world == 1:
            return _Pending([], {self.rank: block}, [], what)
        block = block.contiguous()
        return self.post(
            {(self.rank + 1) % self.world: block}, {(self.rank - 1) % self.world: torch.empty_like(block)}, what
        )

    def wait(self, pending: _Pending) -> dict:
        with self.stats.timed("wait", self.device):
            for work in pending.works:
                work.wait()
        if pending.what == "dkv":
            self.stats.drop_grad(*pending.sends, *pending.received.values())
        return pending.received

    def all_gather(self, block: torch.Tensor) -> list[torch.Tensor]:
        gathered = [torch.empty_like(block) for _ in range(self.world)]
        with self.stats.timed("wait", self.device):
            dist.all_gather(gathered, block.contiguous(), group=self.group)
        self.stats.bytes_sent += block.numel() * block.element_size() * (self.world - 1)
        return gathered

    def reduce_scatter(self, per_rank: torch.Tensor) -> torch.Tensor:
        """Sum `per_rank` ([world, ...], entry r for rank r) over the group; return this rank's entry.
        Bytes counted as the ring algorithm sends them (all-reduce: twice a reduce-scatter's)."""
        share = per_rank[0].numel() * per_rank.element_size() * (self.world - 1)
        with self.stats.timed("wait", self.device):
            if self.has_reduce_scatter:
                mine = torch.empty_like(per_rank[0])
                _reduce_scatter(mine, per_rank.flatten(0, 1), group=self.group)  # entries concatenated (gloo)
                self.stats.bytes_sent += share
                return mine
            summed = per_rank.contiguous()
            dist.all_reduce(summed, group=self.group)
            self.stats.bytes_sent += 2 * share
            return summed[self.rank]


# -- runtime: local attention ------------------------------------------------------------------------
def _compute_dtype(q: torch.Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _local_backend(requested: str, q: torch.Tensor, k: torch.Tensor) -> str:
    """The kernel of every local call of one cp_attention, forward and backward: "cute" where the
    Hopper kernels support the inputs (CUDA sm_90, bf16/fp16, head dim 64/128), else "reference";
    `requested="cute"` raises where they cannot run."""
    if requested == "reference":
        return "reference"
    reason = cute_kernels.unsupported_reason(q, k)
    if reason is None:
        return "cute"
    if requested == "cute":
        raise ValueError(f"CPConfig(backend='cute'): {reason}")
    return "reference"


def _local_forward(backend: str, q, kv, mask: ColumnMask, scale: float):
    """(out in the accumulator dtype, lse) of q against kv ([2, B, S, H, D]: k and v)."""
    if backend == "cute":
        out, lse = cute_kernels.forward(q, kv[0], kv[1], mask, scale)
        return out.to(_compute_dtype(q)), lse
    return reference.forward(q, kv[0], kv[1], mask, scale, _compute_dtype(q))


def _local_backward(backend: str, dout, q, kv, out, lse, mask: ColumnMask, scale: float, dlse=None):
    """(dq, [dk; dv]) in the accumulator dtype, from the merged out and lse (and `dlse`, the
    gradient reaching the merged lse, if any: each row's, whichever keys the call covers)."""
    compute = _compute_dtype(q)
    if backend == "cute":
        dq, dk, dv = cute_kernels.backward(dout, q, kv[0], kv[1], out, lse, mask, scale, dlse=dlse)
    else:
        dq, dk, dv = reference.backward(dout, q, kv[0], kv[1], out, lse, mask, scale, compute, dlse)
    return dq.to(compute), torch.stack([dk, dv]).to(compute)


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


def _split(data: torch.Tensor, chunks, chunk_size: int) -> dict[int, torch.Tensor]:
    """Chunk id -> view of its tokens in `data` ([2, B, S, H, D], the chunks in order)."""
    return {c: data[:, :, i * chunk_size : (i + 1) * chunk_size] for i, c in enumerate(chunks)}


def _compact(chunks: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
    """The chunks, copied where they are only part of their buffer: kept chunks must not pin the
    rest of a message (a buffer whose every chunk is kept stays as it is)."""
    kept_bytes: dict[int, int] = {}
    for t in chunks.values():
        ptr = t.untyped_storage().data_ptr()
        kept_bytes[ptr] = kept_bytes.get(ptr, 0) + t.numel() * t.element_size()
    return {
        c: t if kept_bytes[t.untyped_storage().data_ptr()] == t.untyped_storage().nbytes() else t.clone()
        for c, t in chunks.items()
    }


class _LocalAttention:
    """This rank's attention to sets of K/V chunks: one kernel call per set, over the needed
    chunks concatenated, with their localized mask (no per-chunk calls). `dlse`: in the backward, the
    gradient that reaches the merged LSE, if any."""

    def __init__(self, layout: _Layout, rank: int, backend: str, scale: float, stats: CPStats, dlse=None):
        self.layout, self.rank, self.backend, self.scale, self.stats = layout, rank, backend, scale, stats
        self.dlse = dlse
        self.plan = layout.plan
        self.own = list(self.plan.assignment[rank])

    def forward(self, q, kv: dict[int, torch.Tensor], acc, span: str):
        """`acc` merged with the attention of the rank's queries to the needed chunks of `kv`."""
        needed = self.layout.needed(self.rank, kv)
        if not needed:
            return acc
        with self.stats.timed(span, q.device):
            part = _local_forward(
                self.backend,
                q,
                torch.cat([kv[c] for c in needed], dim=2),
                self.layout.union_mask(self.rank, needed),
                self.scale,
            )
            return _merge(acc, part)

    def backward(self, dout, q, out, lse, kv: dict[int, torch.Tensor], grads: dict, dq, span: str):
        """`dq` plus the dQ against the needed chunks of `kv`; their [dK; dV] are added into `grads`."""
        needed = self.layout.needed(self.rank, kv)
        if not needed:
            return dq
        with self.stats.timed(span, q.device):
            part, dkv = _local_backward(
                self.backend,
                dout,
                q,
                torch.cat([kv[c] for c in needed], dim=2),
                out,
                lse,
                self.layout.union_mask(self.rank, needed),
                self.scale,
                self.dlse,
            )
            for c, g in _split(dkv, needed, self.plan.chunk_size).items():
                grads[c] = grads[c] + g if c in grads else g
            return part if dq is None else dq + part

    def own_chunks(self, local: torch.Tensor) -> dict[int, torch.Tensor]:
        """Chunk id -> view of this rank's stacked K/V ([2, B, local_len, H, D])."""
        return _split(local, self.own, self.plan.chunk_size)

    def finish(self, acc, q):
        """The merged (out, lse); zeros and -inf where the rank's queries see no key at all."""
        if acc is None:
            b, s, h, d = q.shape
            return (
                torch.zeros(b, s, h, d, dtype=_compute_dtype(q), device=q.device),
                torch.full((b, h, s), -math.inf, dtype=torch.float32, device=q.device),
            )
        return acc


# -- runtime: the schemes --------------------------------------------------------------------------
def _post_phase(comm: _Comm, messages, blocks: dict[int, torch.Tensor], shape, dtype, what: str) -> _Pending:
    """One routing phase: this rank's messages, each its chunks' blocks concatenated along tokens."""
    sends = {
        dst: torch.cat([blocks[c] for c in chunks], dim=2)
        for (src, dst), chunks in messages.items()
        if src == comm.rank
    }
    recvs = {}
    for (src, dst), chunks in messages.items():
        if dst == comm.rank:
            recvs[src] = torch.empty(shape[:2] + (shape[2] * len(chunks),) + shape[3:], dtype=dtype, device=comm.device)
    return comm.post(sends, recvs, what)


def _arrivals(messages, received: dict, rank: int, chunk_size: int):
    """(chunk, block) pairs of this rank's received messages of one phase."""
    for (src, dst), chunks in messages.items():
        if dst == rank:
            yield from _split(received[src], chunks, chunk_size).items()


def _fetch_remote_kv(attn: _LocalAttention, comm: _Comm, local_kv: dict, while_travelling) -> dict:
    """Receive the remote K/V chunks along the layout's routes (relaying where hierarchical) and
    return those this rank needs. `while_travelling()` runs while the first phase's messages
    travel (with `overlap`), else after they all arrived."""
    layout, stats = attn.layout, comm.stats
    held = dict(local_kv)
    template = next(iter(local_kv.values()))
    for phase, messages in enumerate(layout.phases):
        pending = _post_phase(comm, messages, held, tuple(template.shape), template.dtype, "kv")
        stats.hold_kv(*pending.received.values())
        if phase == 0 and layout.config.overlap:
            while_travelling()
        received = comm.wait(pending)
        for c, block in _arrivals(messages, received, comm.rank, attn.plan.chunk_size):
            held[c] = block
            stats.chunks_received += 1
    if not layout.config.overlap:
        while_travelling()
    return {c: t for c, t in held.items() if c not in local_kv and layout.needs[comm.rank][c]}


def _kv_stages(attn: _LocalAttention, comm: _Comm, local_kv: dict, before_first_wait):
    """Yield (stage, {chunk: block}) for each of the layout's stages (`stage_chunks`), the blocks
    this rank receives in it. With `overlap`, stage s+1 is posted before stage s is waited for and
    yielded (ring-flash-attention's loop) and `before_first_wait()` runs while stage 0 travels;
    without, one stage at a time, `before_first_wait()` first. Stage s's buffers are let go when the
    caller asks for the next one (the yielded dict is emptied): at most two stages are held."""
    layout, stats = attn.layout, comm.stats
    stages, overlap = layout.stages or [], layout.config.overlap
    template = next(iter(local_kv.values()))

    def post(s: int) -> _Pending:
        pending = _post_phase(comm, stages[s], local_kv, tuple(template.shape), template.dtype, "kv")
        stats.hold_kv(*pending.received.values())
        return pending

    if not overlap:
        before_first_wait()
    ahead = post(0) if overlap and stages else None  # the stage posted one step early
    if overlap:
        before_first_wait()
    for s, messages in enumerate(stages):
        pending = ahead if ahead is not None else post(s)
        ahead = post(s + 1) if overlap and s + 1 < len(stages) else None
        received = comm.wait(pending)
        blocks = dict(_arrivals(messages, received, comm.rank, attn.plan.chunk_size))
        stats.chunks_received += len(blocks)
        yield s, blocks
        stats.drop_kv(*received.values())
        blocks.clear()  # the caller's reference to the dict no longer pins the buffers
        received.clear()
        pending.sends.clear()


def _forward_mask_aware(attn, comm, q, local):
    local_kv, acc = attn.own_chunks(local), None

    def attend_local():
        nonlocal acc
        acc = attn.forward(q, local_kv, acc, "compute_local")

    if attn.layout.stages is not None:
        for _, blocks in _kv_stages(attn, comm, local_kv, attend_local):
            acc = attn.forward(q, blocks, acc, "compute_remote")
        return attn.finish(acc, q), {}
    remote_kv = _fetch_remote_kv(attn, comm, local_kv, attend_local)
    acc = attn.forward(q, remote_kv, acc, "compute_remote")
    return attn.finish(acc, q), remote_kv


def _backward_mask_aware(attn, comm, dout, q, out, lse, local, remote_kv):
    """Remote chunks first, then the own chunks while the remote chunks' dK/dV travel home (the
    last return phase: the inter-node one where routing is hierarchical). The dK/dV go back in the
    accumulator dtype, twice the bytes of a bf16 K/V fetch, so hiding the return rather than the
    K/V fetch (as the forward hides it) hides the larger transfer."""
    local_kv = attn.own_chunks(local)
    if attn.layout.stages is not None:
        return _backward_mask_aware_staged(attn, comm, dout, q, out, lse, local_kv)
    grads: dict[int, torch.Tensor] = {}
    if remote_kv is None:
        remote_kv = _fetch_remote_kv(attn, comm, local_kv, lambda: None)
    dq = attn.backward(dout, q, out, lse, remote_kv, grads, None, "compute_remote")

    def own_grads():
        nonlocal dq
        dq = attn.backward(dout, q, out, lse, local_kv, grads, dq, "compute_local")

    overlap = attn.layout.config.overlap
    if not overlap:
        own_grads()
    # dK/dV home along the routes reversed; relays and owners add what arrives.
    shape, dtype = tuple(local_kv[attn.own[0]].shape), _compute_dtype(q)
    phases = list(reversed(attn.layout.phases))
    for phase, messages in enumerate(phases):
        back = {(dst, src): chunks for (src, dst), chunks in messages.items()}
        pending = _post_phase(comm, back, grads, shape, dtype, "dkv")
        if overlap and phase == len(phases) - 1:
            own_grads()
        for c, g in _arrivals(back, comm.wait(pending), comm.rank, attn.plan.chunk_size):
            grads[c] = grads[c] + g if c in grads else g
    return dq, grads


def _backward_mask_aware_staged(attn, comm, dout, q, out, lse, local_kv):
    """The backward in stages (`stage_chunks`): each stage's remote K/V is fetched again, its
    backward computed, and its chunks' dK/dV sent home at once, travelling while the next stage
    computes (the last stage's while the own chunks do); owners add what arrives. K/V held: the
    own plus at most two stages'; dK/dV: at most two stages' in flight (`peak_grad_bytes`)."""
    grads: dict[int, torch.Tensor] = {}  # the own chunks' dK/dV: their own part plus what came home
    shape, dtype = tuple(local_kv[attn.own[0]].shape), _compute_dtype(q)
    overlap, dq, returning = attn.layout.config.overlap, None, None

    def home(posted: tuple[dict, _Pending] | None) -> None:
        """Wait for one stage's dK/dV messages and add what arrives to the own chunks' grads."""
        if posted is not None:
            messages, pending = posted
            for c, g in _arrivals(messages, comm.wait(pending), comm.rank, attn.plan.chunk_size):
                grads[c] = grads[c] + g if c in grads else g

    for s, blocks in _kv_stages(attn, comm, local_kv, lambda: None):
        stage_grads: dict[int, torch.Tensor] = {}
        dq = attn.backward(dout, q, out, lse, blocks, stage_grads, dq, "compute_remote")
        back = {(dst, src): chunks for (src, dst), chunks in attn.layout.stages[s].items()}
        posted = (back, _post_phase(comm, back, stage_grads, shape, dtype, "dkv"))
        del stage_grads  # the posted sends are copies
        if overlap:  # the previous stage's dK/dV arrived while this stage computed
            home(returning)
            returning = posted
        else:
            home(posted)
    dq = attn.backward(dout, q, out, lse, local_kv, grads, dq, "compute_local")
    home(returning)
    return dq, grads


def _forward_ring(attn, comm, q, local):
    plan, stats = attn.plan, comm.stats
    block, acc, kept = local, None, {}
    for step in range(comm.world):
        last = step == comm.world - 1
        if not last:  # the next block travels while this one is computed
            pending = comm.ring_shift(block, "kv")
            stats.hold_kv(*pending.received.values())
        blocks = _split(block, plan.assignment[(comm.rank - step) % comm.world], plan.chunk_size)
        acc = attn.forward(q, blocks, acc, "compute_local" if step == 0 else "compute_remote")
        if step > 0:
            stats.drop_kv(block)
            if attn.layout.config.hold_remote_kv:
                kept.update(_compact({c: blocks[c] for c in attn.layout.needed(comm.rank, blocks)}))
                stats.hold_kv(*kept.values())
        if not last:
            block = comm.wait(pending)[(comm.rank - 1) % comm.world]
    return attn.finish(acc, q), kept


def _backward_ring(attn, comm, dout, q, out, lse, local, remote_kv):
    """The ring again: KV (unless held) and a dK/dV accumulator per block; each step posts the next
    KV block, computes, adds its grads to the accumulator arriving from the previous rank and
    passes it on; after a full turn every accumulator is home (ring-flash-attention's loop)."""
    plan, stats = attn.plan, comm.stats
    block, dq, grad_pending = local, None, None
    zeros = torch.zeros(
        local.shape[:2] + (plan.chunk_size,) + local.shape[3:], dtype=_compute_dtype(q), device=q.device
    )
    for step in range(comm.world):
        owner = (comm.rank - step) % comm.world
        chunks = plan.assignment[owner]
        fetch = remote_kv is None and step < comm.world - 1
        if fetch:
            kv_pending = comm.ring_shift(block, "kv")
            stats.hold_kv(*kv_pending.received.values())
        if step == 0 or remote_kv is None:
            blocks = _split(block, chunks, plan.chunk_size)
        else:
            blocks = {c: remote_kv[c] for c in chunks if c in remote_kv}
        grads: dict[int, torch.Tensor] = {}
        dq = attn.backward(dout, q, out, lse, blocks, grads, dq, "compute_local" if step == 0 else "compute_remote")
        block_grad = torch.cat([grads.get(c, zeros) for c in chunks], dim=2)
        if grad_pending is not None:  # this block's accumulator, from the previous rank
            block_grad = block_grad + comm.wait(grad_pending)[(comm.rank - 1) % comm.world]
        grad_pending = comm.ring_shift(block_grad, "dkv")  # on to the next rank; after the last step, home
        if fetch:
            if step > 0:
                stats.drop_kv(block)
            block = comm.wait(kv_pending)[(comm.rank - 1) % comm.world]
    home = comm.wait(grad_pending)[(comm.rank - 1) % comm.world]
    return dq, _split(home, attn.own, plan.chunk_size)


def _gather_remote_kv(attn, comm, local):
    plan, stats = attn.plan, comm.stats
    gathered = comm.all_gather(local)
    stats.hold_kv(*gathered)
    stats.drop_kv(gathered[comm.rank])  # this rank's own copy, dropped on return
    remote = {}
    for r, data in enumerate(gathered):
        if r != comm.rank:
            stats.chunks_received += len(plan.assignment[r])
            remote.update(_split(data, plan.assignment[r], plan.chunk_size))
    return remote


def _forward_allgather(attn, comm, q, local):
    remote = _gather_remote_kv(attn, comm, local)
    acc = attn.forward(q, attn.own_chunks(local) | remote, None, "compute_remote")
    return attn.finish(acc, q), {c: remote[c] for c in attn.layout.needed(comm.rank, remote)}


def _backward_allgather(attn, comm, dout, q, out, lse, local, remote_kv):
    plan = attn.plan
    if remote_kv is None:
        remote_kv = _gather_remote_kv(attn, comm, local)
    grads: dict[int, torch.Tensor] = {}
    dq = attn.backward(dout, q, out, lse, attn.own_chunks(local) | remote_kv, grads, None, "compute_remote")
    zeros = torch.zeros(
        local.shape[:2] + (plan.chunk_size,) + local.shape[3:], dtype=_compute_dtype(q), device=q.device
    )
    per_rank = torch.stack(
        [torch.cat([grads.get(c, zeros) for c in plan.assignment[r]], dim=2) for r in range(comm.world)]
    )
    return dq, _split(comm.reduce_scatter(per_rank), attn.own, plan.chunk_size)


_FORWARD = {"mask_aware": _forward_mask_aware, "ring": _forward_ring, "allgather": _forward_allgather}
_BACKWARD = {"mask_aware": _backward_mask_aware, "ring": _backward_ring, "allgather": _backward_allgather}


class _CPFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, plan, group, config, scale):
        global last_forward_stats
        backend = _local_backend(config.backend, q, k)
        layout = _layout_for(mask, plan, config)
        stats = CPStats()
        comm = _Comm(group, q.device, stats)
        attn = _LocalAttention(layout, comm.rank, backend, scale, stats)
        local = torch.stack([k, v])
        stats.hold_kv(local)
        (out, lse), remote = _FORWARD[config.scheme](attn, comm, q, local)
        out = out.to(q.dtype)
        kept = _compact(remote) if config.hold_remote_kv else {}
        ctx.save_for_backward(q, k, v, out, lse, *kept.values())
        ctx.kept_chunks = list(kept) if config.hold_remote_kv else None
        ctx.attn_args = (layout, group, backend, scale)
        stats.set_kv(local, *kept.values())
        stats.saved_kv_bytes = stats.held_kv_bytes
        last_forward_stats = stats
        _record_stats(0, stats, comm)
        ctx.set_materialize_grads(False)  # an unused out or LSE brings None, not zeros
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        global last_backward_stats
        q, k, v, out, lse, *kept = ctx.saved_tensors
        layout, group, backend, scale = ctx.attn_args
        plan = layout.plan
        stats = CPStats()
        comm = _Comm(group, q.device, stats)
        dout = torch.zeros_like(out) if dout is None else dout
        attn = _LocalAttention(layout, comm.rank, backend, scale, stats, dlse)
        local = torch.stack([k, v])
        stats.hold_kv(local, *kept)
        remote_kv = None if ctx.kept_chunks is None else dict(zip(ctx.kept_chunks, kept))
        dq, grads = _BACKWARD[layout.config.scheme](attn, comm, dout.contiguous(), q, out, lse, local, remote_kv)
        if dq is None:  # the rank's queries see no key
            dq = torch.zeros_like(q)
        zeros = torch.zeros_like(k)
        dk = torch.cat([grads[c][0] if c in grads else zeros[:, : plan.chunk_size] for c in attn.own], dim=1)
        dv = torch.cat([grads[c][1] if c in grads else zeros[:, : plan.chunk_size] for c in attn.own], dim=1)
        last_backward_stats = stats
        _record_stats(1, stats, comm)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None


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
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Context-parallel attention of this rank's chunks; differentiable.

    Args:
        q_local, k_local, v_local: [B, plan.local_len, H, D], this rank's chunks concatenated
            (`plan.shard(x, rank)`); Hq a multiple of Hkv; k and v of one shape (a value head dim
            other than the key's is a ValueError). On NCCL, on the current CUDA device.
        mask: the global ColumnMask (same on every rank).
        plan: the chunk assignment (same on every rank).
        group: the CP process group (default: the world).
        config: scheme, pruning, overlap, hierarchy, local backend, what the backward keeps.
        softmax_scale: scale of q.k; default 1/sqrt(D).
        return_lse: also return this rank's LSE, differentiable (a loss on it reaches dQ, dK, dV).

    Returns:
        This rank's output [B, local_len, Hq, D] (and LSE [B, Hq, local_len] with `return_lse`).
    """
    reference.check_attention_inputs(q_local, k_local, v_local, ("q_local", "k_local", "v_local"))
    reference.check_softmax_scale(softmax_scale)
    check_flag("return_lse", return_lse)
    for name, value, cls in (("mask", mask, ColumnMask), ("plan", plan, CPPlan), ("config", config, CPConfig)):
        if not isinstance(value, cls):
            raise TypeError(f"{name} must be a {cls.__name__}, got {type(value).__name__}")
    if v_local.shape != k_local.shape:
        # K and V travel stacked as one tensor, and the local kernels take them so.
        raise ValueError(
            f"v_local must have k_local's shape {tuple(k_local.shape)}, got {tuple(v_local.shape)}: context "
            "parallelism takes a value head dim equal to the key head dim only (use flashmask3.attention "
            "for a different one)"
        )
    world = dist.get_world_size(group)
    if world != plan.world_size:
        raise ValueError(f"plan is for {plan.world_size} ranks but the group has {world}")
    for name, t in (("q_local", q_local), ("k_local", k_local), ("v_local", v_local)):
        if t.dim() != 4 or t.shape[1] != plan.local_len:
            raise ValueError(f"{name} must be [B, {plan.local_len}, H, D] (this rank's chunks), got {tuple(t.shape)}")
    if mask.seqlen_q != plan.seqlen or mask.seqlen_k != plan.seqlen:
        raise ValueError(f"mask covers {mask.seqlen_q}x{mask.seqlen_k} tokens but the plan {plan.seqlen}")
    batch, heads_q, heads_kv = q_local.shape[0], q_local.shape[2], k_local.shape[2]
    mask.check_compatible(batch, heads_q, heads_kv, plan.seqlen, plan.seqlen)
    if q_local.is_cuda and "nccl" in dist.get_backend(group) and q_local.device.index != torch.cuda.current_device():
        raise ValueError(
            f"q_local is on {q_local.device} but the current CUDA device is "
            f"cuda:{torch.cuda.current_device()}; call torch.cuda.set_device first (NCCL's "
            "batched point-to-point calls hang otherwise)"
        )
    if config.scheme == "mask_aware" and config.ranks_per_node is not None:
        _check_node_layout(group, config.ranks_per_node)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q_local.shape[-1])
    out, lse = _CPFunction.apply(q_local, k_local, v_local, mask, plan, group, config, scale)
    return (out, lse) if return_lse else out


class ContextParallelAttention(torch.nn.Module):
    """`cp_attention` as a module for a model's attention layers: holds the group and config;
    each call takes the batch's global mask and plan (both change with the packing)."""

    def __init__(
        self, group: dist.ProcessGroup | None = None, config: CPConfig = CPConfig(), softmax_scale: float | None = None
    ):
        super().__init__()
        self.group, self.config, self.softmax_scale = group, config, softmax_scale

    def forward(
        self, q_local: torch.Tensor, k_local: torch.Tensor, v_local: torch.Tensor, mask: ColumnMask, plan: CPPlan
    ) -> torch.Tensor:
        """`cp_attention` of this rank's chunks [B, plan.local_len, H, D] with the module's group,
        config and scale; returns this rank's output."""
        out = cp_attention(q_local, k_local, v_local, mask, plan, self.group, self.config, self.softmax_scale)
        return cast(torch.Tensor, out)  # without return_lse: the output alone
