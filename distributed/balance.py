"""Sparsity-aware load balancing of query chunks over ranks (the HCC-IPO balancer).

Workload of a query chunk: its non-skipped (query tile, key tile) pairs against the whole
sequence, PARTIAL tiles weighted by a measured cost factor (they pay the element mask). Every
rank gets the same number k of chunks (equal token counts); the assignment lowers the largest
rank load by local search:

1. greedy longest-processing-time start: chunks by decreasing load, each to the lightest rank
   that still has room;
2. iterative pairwise optimal re-partitioning (IPO): the heaviest rank and each partner pool their
   chunks and split them exactly (equal counts, smallest larger half, by dynamic programming over
   loads quantized to 1/1000 of the largest chunk); the best improving split is applied; when no
   pair helps, the heaviest rank and the two lightest are re-split exactly three ways (k <= 4);
   stop when nothing improves or the lower bound is reached.

What that guarantees (on the quantized loads; tested against brute force on small cases):
- the result is never worse than the longest-first start;
- it ends at a pairwise optimum: for a heaviest rank, no equal-count re-split of its chunks with
  those of any one other rank lowers its load (nor, for k <= 4, a three-way re-split with the two
  lightest ranks);
- hence it is optimal for two ranks, for one chunk per rank, and whenever it reaches the lower
  bound `lower_bound` (the mean rank load, or the largest chunk plus the k - 1 smallest).
It is not optimal in general: on random loads (uniform 1-199) it misses the optimum of 4 ranks x
3 chunks in 15% of cases, by up to 6.3%, and of 5 x 3 in 31%, by up to 6.6% (1.0% / 0.1% of 3 x 4
and 3 x 3; none found with 2 chunks per rank).

The exact splits run in numba.
"""

from __future__ import annotations

import itertools

import numba
import numpy as np
import torch

from ..reference import PARTIAL, SKIP, ColumnMask

PARTIAL_TILE_COST = 1.3
"""Cost of a PARTIAL tile relative to an UNMASKED one (element mask + lower issue rate)."""
_RESOLUTION = 1000  # largest quantized chunk load in the exact splits


def chunk_loads(
    mask: ColumnMask, chunk_size: int, tile: int = 128, partial_cost: float = PARTIAL_TILE_COST
) -> np.ndarray:
    """Workload of each query chunk (float64 [S / chunk_size]), summed over batch and mask heads."""
    if chunk_size % tile:
        raise ValueError(f"chunk_size {chunk_size} must be a multiple of the tile {tile}")
    classes = mask.block_classes(tile, tile).classes
    weight = torch.where(classes == PARTIAL, partial_cost, 1.0) * (classes != SKIP)
    per_row_tile = weight.sum(dim=(0, 1, 3))  # [Tm]
    per_chunk = per_row_tile.view(-1, chunk_size // tile).sum(-1)
    return per_chunk.double().cpu().numpy()


@numba.njit(cache=True)
def _best_split(weights: np.ndarray, k: int) -> np.ndarray:
    """Pick exactly k of the 2k items so that the larger of the two sums is smallest.

    Returns a 0/1 array marking the chosen items. Dynamic programming over (items, count, sum).
    """
    n = len(weights)
    total = int(weights.sum())
    reach = np.zeros((n + 1, k + 1, total + 1), dtype=np.bool_)
    reach[0, 0, 0] = True
    for i in range(n):
        w = weights[i]
        for c in range(k + 1):
            for s in range(total + 1):
                if reach[i, c, s]:
                    reach[i + 1, c, s] = True
                    if c < k:
                        reach[i + 1, c + 1, s + w] = True
    best, best_s = total + 1, -1
    for s in range(total + 1):
        if reach[n, k, s]:
            larger = max(s, total - s)
            if larger < best:
                best, best_s = larger, s
    chosen = np.zeros(n, dtype=np.int64)
    c, s = k, best_s
    for i in range(n, 0, -1):  # walk back: keep item i-1 out if the sum was reachable without it
        if reach[i - 1, c, s]:
            continue
        chosen[i - 1] = 1
        c -= 1
        s -= weights[i - 1]
    return chosen


def _best_three_way(weights: np.ndarray, k: int) -> list[list[int]]:
    """Exact 3-way split of 3k items into groups of k minimizing the largest sum (small k only)."""
    n = len(weights)
    best, best_groups = None, None
    items = range(n)
    for first in itertools.combinations(items, k):
        if 0 not in first:  # symmetry: item 0 is always in the first group
            continue
        rest = [i for i in items if i not in first]
        for second in itertools.combinations(rest, k):
            if rest[0] not in second:
                continue
            third = [i for i in rest if i not in second]
            loads = (weights[list(first)].sum(), weights[list(second)].sum(), weights[third].sum())
            if best is None or max(loads) < best:
                best, best_groups = max(loads), [list(first), list(second), third]
    assert best_groups is not None  # k >= 1: some first group holds item 0
    return best_groups


def lower_bound(loads, world_size: int) -> float:
    """No equal-count assignment of `loads` to `world_size` ranks has a smaller largest rank load:
    the mean rank load, and the rank holding the largest chunk holds k - 1 others."""
    loads = np.sort(np.asarray(loads, dtype=np.float64))
    k = len(loads) // world_size
    return float(max(loads.sum() / world_size, loads[-1] + loads[: k - 1].sum()))


def balance(loads, world_size: int, max_rounds: int = 200) -> tuple[tuple[int, ...], ...]:
    """Assign len(loads) chunks to `world_size` ranks, equal counts, lowering the largest load by
    local search (see the module docstring for what the result guarantees).

    Every round lowers the largest load or the number of ranks at it, so the search ends;
    `max_rounds` only caps its time (the guarantees hold when it ends before)."""
    loads = np.asarray(loads, dtype=np.float64)
    n = len(loads)
    if n % world_size:
        raise ValueError(f"{n} chunks cannot be split evenly over {world_size} ranks")
    k = n // world_size
    scale = _RESOLUTION / max(loads.max(), 1e-12)
    weights = np.rint(loads * scale).astype(np.int64)

    ranks: list[list[int]] = [[] for _ in range(world_size)]
    for c in np.argsort(-weights, kind="stable"):
        open_ranks = [r for r in range(world_size) if len(ranks[r]) < k]
        ranks[min(open_ranks, key=lambda r: weights[ranks[r]].sum())].append(int(c))
    target = int(np.ceil(lower_bound(weights, world_size)))

    def load(r):
        return int(weights[ranks[r]].sum())

    for _ in range(max_rounds):
        heavy = max(range(world_size), key=load)
        if load(heavy) <= target:
            break
        best = None
        for partner in sorted(range(world_size), key=load):
            if partner == heavy:
                continue
            pool = ranks[heavy] + ranks[partner]
            chosen = _best_split(weights[pool], k)
            first = [c for c, pick in zip(pool, chosen) if pick]
            second = [c for c, pick in zip(pool, chosen) if not pick]
            new_max = max(weights[first].sum(), weights[second].sum())
            if new_max < load(heavy) and (best is None or new_max < best[0]):
                best = (new_max, partner, first, second)
        if best is None and world_size >= 3 and k <= 4:
            light = sorted(range(world_size), key=load)[:2]
            group = [heavy, *light]
            pool = [c for r in group for c in ranks[r]]
            parts = _best_three_way(weights[pool], k)
            new_max = max(weights[[pool[i] for i in p]].sum() for p in parts)
            if new_max < load(heavy):
                for r, p in zip(group, parts):
                    ranks[r] = [pool[i] for i in p]
                continue
        if best is None:
            break
        _, partner, first, second = best
        ranks[heavy], ranks[partner] = first, second
    return tuple(tuple(sorted(r)) for r in ranks)


def imbalance(loads, assignment) -> float:
    """max rank load / mean rank load (1.0 is perfect)."""
    loads = np.asarray(loads, dtype=np.float64)
    per_rank = [loads[list(chunks)].sum() for chunks in assignment]
    return float(max(per_rank) / (sum(per_rank) / len(per_rank)))
