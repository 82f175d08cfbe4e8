"""How a sequence is cut into chunks and which rank holds which: the CP plan.

The sequence (Sq = Sk = S) is cut into C = k * R equal chunks; rank r holds k of them, its local
tokens being those chunks concatenated in increasing order. Assignments: contiguous, zigzag
(dual-chunk: rank r gets chunks r and 2R-1-r, repeated for k > 2), and the sparsity-aware balancer's.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Sequence

import numpy as np
import torch

from ..reference.constructors import check_int


@dataclass(frozen=True)
class CPPlan:
    """Chunk layout of one context-parallel run.

    Args:
        seqlen: global sequence length S (queries and keys).
        chunk_size: tokens per chunk; S must be a multiple of it.
        assignment: for each rank, its chunk ids (sorted); every rank holds the same number.
    """

    seqlen: int
    chunk_size: int
    assignment: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        if self.seqlen % self.chunk_size:
            raise ValueError(f"seqlen {self.seqlen} must be a multiple of chunk_size {self.chunk_size}")
        chunks = sorted(c for rank in self.assignment for c in rank)
        if chunks != list(range(self.num_chunks)):
            raise ValueError(f"assignment must use every chunk 0..{self.num_chunks - 1} exactly once, got {chunks}")
        if len({len(r) for r in self.assignment}) != 1:
            raise ValueError("every rank must hold the same number of chunks (equal token counts)")
        if any(list(r) != sorted(r) for r in self.assignment):
            raise ValueError("each rank's chunk ids must be sorted")

    @property
    def world_size(self) -> int:
        """Number of ranks R (one chunk tuple each in `assignment`)."""
        return len(self.assignment)

    @property
    def num_chunks(self) -> int:
        """Number of chunks C = seqlen / chunk_size."""
        return self.seqlen // self.chunk_size

    @property
    def local_len(self) -> int:
        """Tokens each rank holds: its chunks times chunk_size."""
        return len(self.assignment[0]) * self.chunk_size

    @cached_property
    def chunk_owners(self) -> np.ndarray:
        """The rank holding each chunk, int64 [num_chunks]."""
        owners = np.empty(self.num_chunks, dtype=np.int64)
        owners[np.asarray(self.assignment)] = np.arange(self.world_size)[:, None]
        return owners

    def owner(self, chunk: int) -> int:
        """The rank holding chunk id `chunk`."""
        return int(self.chunk_owners[chunk])

    def token_index(self, rank: int) -> torch.Tensor:
        """Global positions of rank's local tokens, in local order; `rank` in [0, world_size)."""
        check_int(f"rank (world_size {self.world_size})", rank, 0, self.world_size - 1)
        return torch.cat([torch.arange(c * self.chunk_size, (c + 1) * self.chunk_size) for c in self.assignment[rank]])

    def shard(self, x: torch.Tensor, rank: int, dim: int = 1) -> torch.Tensor:
        """Rank's local part of a full-sequence tensor (e.g. [B, S, H, D] along dim 1): `x` has the
        plan's seqlen along `dim`, the sequence dim."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        check_int(f"dim (x is {x.dim()}-D)", dim, -x.dim(), x.dim() - 1)
        if x.shape[dim] != self.seqlen:
            raise ValueError(
                f"x must have the plan's seqlen {self.seqlen} along dim {dim} (the sequence dim), "
                f"got shape {tuple(x.shape)}"
            )
        return x.index_select(dim, self.token_index(rank).to(x.device))

    def unshard(self, parts: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
        """Inverse of `shard`: the full-sequence tensor from every rank's local part."""
        full = torch.cat(parts, dim=dim)
        order = torch.cat([self.token_index(r) for r in range(self.world_size)])
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(len(order))
        return full.index_select(dim, inverse.to(full.device))


def contiguous_assignment(world_size: int, chunks_per_rank: int) -> tuple[tuple[int, ...], ...]:
    """Rank r takes the k = `chunks_per_rank` consecutive chunks r*k .. (r+1)*k - 1."""
    k = chunks_per_rank
    return tuple(tuple(range(r * k, (r + 1) * k)) for r in range(world_size))


def zigzag_assignment(world_size: int, chunks_per_rank: int) -> tuple[tuple[int, ...], ...]:
    """Dual-chunk swap: in each group of 2R chunks, rank r takes chunks r and 2R-1-r."""
    if chunks_per_rank % 2:
        raise ValueError(f"zigzag needs an even number of chunks per rank, got {chunks_per_rank}")
    out = []
    for r in range(world_size):
        chunks = []
        for g in range(chunks_per_rank // 2):
            base = g * 2 * world_size
            chunks += [base + r, base + 2 * world_size - 1 - r]
        out.append(tuple(sorted(chunks)))
    return tuple(out)


def make_plan(
    seqlen: int,
    world_size: int,
    chunks_per_rank: int = 2,
    scheme: str = "zigzag",
    loads: np.ndarray | Sequence[float] | None = None,
    visibility: np.ndarray | None = None,
    chunk_comm: float = 0.0,
) -> CPPlan:
    """A plan with `scheme` in contiguous | zigzag | balanced (needs per-chunk `loads`; with
    `visibility` and `chunk_comm`, communication counted too: see `balance`).

    `seqlen`, `world_size` and `chunks_per_rank` are ints >= 1, `seqlen` a multiple of
    world_size * chunks_per_rank; `loads`, where given, has one finite entry >= 0 per chunk."""
    check_int("seqlen", seqlen, 1)
    check_int("world_size", world_size, 1)
    check_int("chunks_per_rank", chunks_per_rank, 1)
    num_chunks = world_size * chunks_per_rank
    if seqlen % num_chunks:
        raise ValueError(f"seqlen {seqlen} must be a multiple of world_size * chunks_per_rank = {num_chunks}")
    if loads is not None:
        from .balance import checked_loads  # balance imports numba: only when loads are given

        loads = checked_loads(loads)
        if len(loads) != num_chunks:
            raise ValueError(
                f"loads must have one entry per chunk (world_size * chunks_per_rank = {num_chunks}), got {len(loads)}"
            )
    if scheme == "contiguous":
        assignment = contiguous_assignment(world_size, chunks_per_rank)
    elif scheme == "zigzag":
        assignment = zigzag_assignment(world_size, chunks_per_rank)
    elif scheme == "balanced":
        from .balance import balance

        if loads is None:
            raise ValueError("scheme='balanced' needs the per-chunk loads (see balance.chunk_loads)")
        assignment = balance(loads, world_size, visibility=visibility, chunk_comm=chunk_comm)
    else:
        raise ValueError(f"unknown assignment scheme {scheme!r}; accepted: contiguous, zigzag, balanced")
    return CPPlan(seqlen, seqlen // num_chunks, assignment)
