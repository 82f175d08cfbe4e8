"""Sparsity-aware load balancing of query chunks over ranks (the HCC-IPO balancer).

Workload of a query chunk: its non-skipped (query tile, key tile) pairs against the whole
sequence, PARTIAL tiles weighted by a measured cost factor (they pay the element mask), counted
from each key block's runs of query tiles, never the tile grid. Every rank gets the same number k
of chunks (equal token counts); the assignment lowers the largest rank load by local search:

1. greedy longest-processing-time start: chunks by decreasing load, each to the lightest rank
   that still has room;
2. iterative pairwise optimal re-partitioning (IPO): the heaviest rank and each partner pool their
   chunks and split them exactly (equal counts, smallest larger half, by dynamic programming over
   loads quantized to 1/1000 of the largest chunk); the best improving split is applied (partners
   are tried lightest first and the search stops at the first whose pool's half cannot beat the
   best split yet); when no pair helps, the heaviest rank and the two lightest others are re-split
   exactly three ways (k <= 4); stop when nothing improves or the lower bound is reached.

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

Communication counts where asked (`visibility`, `chunk_comm`): a rank's cost is then its load plus
`chunk_comm` per remote K/V chunk its queries need (the key chunks its query chunks see, less its
own: what the mask-aware scheme sends it). From the result above, the costliest rank swaps one
chunk with another rank while that lowers the larger of their two costs below its own. The
largest cost is never above that of the compute-only result, and at the end no single swap with
the costliest rank lowers it (a swap optimum on the quantized costs, nothing more; and a linear
model: the code hides part of the transfers under compute).

The tile counts, the exact splits and the swaps run in numba.
"""

from __future__ import annotations

import itertools
from typing import Sequence

import numba
import numpy as np

from ..reference import ColumnMask
from ..reference.constructors import check_int

PARTIAL_TILE_COST = 1.3
"""Cost of a PARTIAL tile relative to an UNMASKED one (element mask + lower issue rate)."""
_RESOLUTION = 1000  # largest quantized chunk load in the exact splits


def chunk_loads(
    mask: ColumnMask, chunk_size: int, tile: int = 128, partial_cost: float = PARTIAL_TILE_COST
) -> np.ndarray:
    """Workload of each query chunk (float64 [Sq / chunk_size]), summed over batch and mask heads:
    its UNMASKED tiles plus `partial_cost` times its PARTIAL tiles, as `ColumnMask.block_classes`
    classifies them, counted exactly in O(B * Hm * Sk / tile + Sq / tile) without the tile grid.
    `chunk_size` and `tile` are ints >= 1, `chunk_size` a multiple of `tile` dividing Sq."""
    check_int("chunk_size", chunk_size, 1)
    check_int("tile", tile, 1)
    if chunk_size % tile:
        raise ValueError(f"chunk_size {chunk_size} must be a multiple of the tile {tile}")
    if mask.seqlen_q % chunk_size:
        raise ValueError(f"seqlen_q {mask.seqlen_q} must be a multiple of chunk_size {chunk_size}")
    bounds = mask.block_bounds(tile)
    per_key_block = bounds.reshape(8, -1, bounds.shape[-1]).cpu().numpy()  # [bound, batch x head, key block]
    runs = _class_runs(per_key_block, mask.causal, mask.seqlen_q, mask.seqlen_k, tile)
    partial, unmasked = runs.cumsum(axis=1)[:, :-1].reshape(2, -1, chunk_size // tile).sum(axis=2)
    return unmasked + partial_cost * partial


@numba.njit(cache=True)
def _class_runs(bounds, causal: bool, seqlen_q: int, seqlen_k: int, tile: int) -> np.ndarray:
    """Difference arrays over query tiles (int64 [2, row_tiles + 1]) whose prefix sums count, per
    query tile, the PARTIAL (row 0) and UNMASKED (row 1) tiles of all key blocks.

    Along one key block, each of `block_classes`' conditions holds on a run of query tiles m
    (tile rows [mT, mT + T)): LT covers them for m in [ceil(LTS max / T), floor(LTE min / T)), LT
    touches them for m in [floor(LTS min / T), ceil(LTE max / T)), UT alike, and the causal diagonal
    skips m < floor((nT - offset) / T) and touches m < ceil((end of block n - 1 - offset) / T). The
    class is constant between consecutive run ends, so each piece adds to one difference array.
    """
    offset, row_tiles = seqlen_k - seqlen_q, seqlen_q // tile  # the causal diagonal's, bottom-right
    runs = np.zeros((2, row_tiles + 1), dtype=np.int64)
    skip = np.zeros((3, 2), dtype=np.int64)
    touch = np.zeros((3, 2), dtype=np.int64)
    ends = np.zeros(14, dtype=np.int64)
    for bh in range(bounds.shape[1]):
        for n in range(bounds.shape[2]):
            for i in range(2):  # LT, UT: bounds[4i:4i+4] = start min/max, end min/max
                s_min, s_max = bounds[4 * i, bh, n], bounds[4 * i + 1, bh, n]
                e_min, e_max = bounds[4 * i + 2, bh, n], bounds[4 * i + 3, bh, n]
                skip[i, 0], skip[i, 1] = -(-s_max // tile), e_min // tile
                touch[i, 0], touch[i, 1] = s_min // tile, -(-e_max // tile)
            if causal:
                block_end = min((n + 1) * tile, seqlen_k)
                skip[2, 0], skip[2, 1] = 0, (n * tile - offset) // tile
                touch[2, 0], touch[2, 1] = 0, -(-(block_end - 1 - offset) // tile)
            for i in range(3):
                for j in range(2):
                    ends[4 * i + 2 * j] = min(max(skip[i, j], 0), row_tiles)
                    ends[4 * i + 2 * j + 1] = min(max(touch[i, j], 0), row_tiles)
            ends[12], ends[13] = 0, row_tiles
            cuts = np.sort(ends)
            for p in range(13):
                m, stop = cuts[p], cuts[p + 1]
                if m == stop:
                    continue
                skipped = touched = False
                for i in range(3 if causal else 2):
                    skipped |= skip[i, 0] <= m < skip[i, 1]
                    touched |= touch[i, 0] <= m < touch[i, 1]
                if not skipped:
                    cls = 0 if touched else 1
                    runs[cls, m] += 1
                    runs[cls, stop] -= 1
    return runs


@numba.njit(cache=True)
def _best_split(weights: np.ndarray, k: int) -> np.ndarray:
    """Pick exactly k of the 2k items so that the larger of the two sums is smallest.

    Returns a 0/1 array marking the chosen items. Dynamic programming over (items, count, sum).
    """
    n = len(weights)
    total = int(weights.sum())
    reach = np.zeros((n + 1, k + 1, total + 1), dtype=np.bool_)
    reach[0, 0, 0] = True
    below = 0  # the sums reachable with the first i items are at most theirs
    for i in range(n):
        w = weights[i]
        for c in range(k + 1):
            for s in range(below + 1):
                if reach[i, c, s]:
                    reach[i + 1, c, s] = True
                    if c < k:
                        reach[i + 1, c + 1, s + w] = True
        below += w
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


def checked_loads(loads: np.ndarray | Sequence[float]) -> np.ndarray:
    """`loads` as float64 [chunks]; TypeError / ValueError naming it unless it is a non-empty 1-D
    sequence of finite numbers >= 0."""
    try:
        array = np.asarray(loads, dtype=np.float64)
    except (TypeError, ValueError):
        raise TypeError(f"loads must be a 1-D array or sequence of numbers, got {type(loads).__name__}") from None
    if array.ndim != 1 or len(array) == 0:
        raise ValueError(f"loads must be 1-D with one entry per chunk (at least one), got shape {array.shape}")
    bad = ~np.isfinite(array) | (array < 0)
    if bad.any():
        chunk = int(np.flatnonzero(bad)[0])
        raise ValueError(f"loads must be finite and >= 0, got {array[chunk]} for chunk {chunk}")
    return array


def lower_bound(loads: np.ndarray | Sequence[float], world_size: int) -> float:
    """No equal-count assignment of `loads` to `world_size` ranks has a smaller largest rank load:
    the mean rank load, and the rank holding the largest chunk holds k - 1 others."""
    loads = np.sort(np.asarray(loads, dtype=np.float64))
    k = len(loads) // world_size
    return float(max(loads.sum() / world_size, loads[-1] + loads[: k - 1].sum()))


def balance(
    loads: np.ndarray | Sequence[float],
    world_size: int,
    max_rounds: int = 200,
    visibility: np.ndarray | None = None,
    chunk_comm: float = 0.0,
) -> tuple[tuple[int, ...], ...]:
    """Assign len(loads) chunks to `world_size` ranks, equal counts, lowering the largest load by
    local search (see the module docstring for what the result guarantees).

    With `visibility` (`chunk_visibility`'s bool [chunk, chunk]) and `chunk_comm` > 0 (the cost of
    receiving one K/V chunk, in units of `loads`), the largest load plus communication instead.
    Every round lowers the largest cost or the number of ranks at it, so each search ends;
    `max_rounds` only caps its time (the guarantees hold when it ends before).
    `loads`: one finite entry >= 0 per chunk; `world_size`: an int >= 1 dividing their number."""
    loads = checked_loads(loads)
    check_int("world_size", world_size, 1)
    n = len(loads)
    if n % world_size:
        raise ValueError(f"{n} chunks cannot be split evenly over {world_size} ranks")
    k = n // world_size
    scale = _RESOLUTION / max(loads.max(), 1e-12)
    weights = np.rint(loads * scale).astype(np.int64)

    ranks: list[list[int]] = [[] for _ in range(world_size)]
    rank_load = np.zeros(world_size, dtype=np.int64)
    full = np.iinfo(np.int64).max
    for c in np.argsort(-weights, kind="stable"):
        r = int(np.argmin(np.where([len(chunks) < k for chunks in ranks], rank_load, full)))  # first lightest
        ranks[r].append(int(c))
        rank_load[r] += weights[c]
    target = int(np.ceil(lower_bound(weights, world_size)))

    def assign(r: int, chunks: list[int]) -> None:
        ranks[r] = chunks
        rank_load[r] = weights[chunks].sum()

    for _ in range(max_rounds):
        heavy = int(np.argmax(rank_load))  # the first heaviest
        if rank_load[heavy] <= target:
            break
        best = None
        by_load = np.argsort(rank_load, kind="stable")  # lightest first, ties by rank
        for partner in by_load.tolist():
            if partner == heavy:
                continue
            # The larger half of any split holds at least half the pool; partners come lightest
            # first, so once that cannot beat the heaviest (or the best split yet), none can.
            if -(-(rank_load[heavy] + rank_load[partner]) // 2) >= (rank_load[heavy] if best is None else best[0]):
                break
            pool = ranks[heavy] + ranks[partner]
            chosen = _best_split(weights[pool], k)
            first = [c for c, pick in zip(pool, chosen) if pick]
            second = [c for c, pick in zip(pool, chosen) if not pick]
            new_max = max(weights[first].sum(), weights[second].sum())
            if new_max < rank_load[heavy] and (best is None or new_max < best[0]):
                best = (new_max, partner, first, second)
        if best is None and world_size >= 3 and k <= 4:
            group = [heavy, *[r for r in by_load.tolist() if r != heavy][:2]]  # with the two lightest others
            pool = [c for r in group for c in ranks[r]]
            parts = _best_three_way(weights[pool], k)
            new_max = max(weights[[pool[i] for i in p]].sum() for p in parts)
            if new_max < rank_load[heavy]:
                for r, p in zip(group, parts):
                    assign(r, [pool[i] for i in p])
                continue
        if best is None:
            break
        _, partner, first, second = best
        assign(heavy, first)
        assign(partner, second)
    if visibility is not None and chunk_comm > 0:
        owned = np.array(ranks, dtype=np.int64)
        _swap_for_cost(owned, weights, _bitsets(visibility), int(np.rint(chunk_comm * scale)), max_rounds)
        ranks = owned.tolist()
    return tuple(tuple(sorted(r)) for r in ranks)


def _bitsets(visibility: np.ndarray) -> np.ndarray:
    """Each row of a bool matrix as bits, uint64 [rows, ceil(columns / 64)], column c in bit c % 64
    of word c // 64."""
    rows, columns = visibility.shape
    padded = np.zeros((rows, -(-columns // 64) * 64), dtype=bool)
    padded[:, :columns] = visibility
    return np.packbits(padded, axis=1, bitorder="little").view("<u8").astype(np.uint64)


@numba.njit(cache=True)
def _popcount(word: np.uint64) -> int:
    """Set bits of one word: counts per 2, 4, 8 bits, then the bytes summed by one multiplication."""
    word = word - ((word >> np.uint64(1)) & np.uint64(0x5555555555555555))
    word = (word & np.uint64(0x3333333333333333)) + ((word >> np.uint64(2)) & np.uint64(0x3333333333333333))
    word = (word + (word >> np.uint64(4))) & np.uint64(0x0F0F0F0F0F0F0F0F)
    return int((word * np.uint64(0x0101010101010101)) >> np.uint64(56))


@numba.njit(cache=True)
def _views(chunks: np.ndarray, bits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A rank's own chunks as bits, and for each of its chunks the key chunks the others see."""
    own = np.zeros(bits.shape[1], dtype=np.uint64)
    for c in chunks:
        own[c // 64] |= np.uint64(1) << np.uint64(c % 64)
    without = np.zeros((len(chunks), bits.shape[1]), dtype=np.uint64)
    for i in range(len(chunks)):
        for j in range(len(chunks)):
            if j != i:
                without[i] |= bits[chunks[j]]
    return own, without


@numba.njit(cache=True)
def _received_after_swap(without: np.ndarray, own: np.ndarray, bits: np.ndarray, out: int, into: int) -> int:
    """Remote chunks a rank's queries see once its chunk `out` is swapped for `into` (`without`:
    what its other chunks see, `own`: its chunks before the swap)."""
    received = 0
    for w in range(len(own)):
        seen = without[w] | bits[into, w]
        mine = own[w]
        if w == out // 64:
            mine &= ~(np.uint64(1) << np.uint64(out % 64))
        if w == into // 64:
            mine |= np.uint64(1) << np.uint64(into % 64)
        received += _popcount(seen & ~mine)
    return received


@numba.njit(cache=True)
def _cost(chunks: np.ndarray, weights: np.ndarray, bits: np.ndarray, chunk_comm: int) -> int:
    """Load plus chunk_comm per remote chunk the rank's queries see."""
    own, without = _views(chunks, bits)
    received = 0
    for w in range(len(own)):
        received += _popcount((without[0, w] | bits[chunks[0], w]) & ~own[w])
    return weights[chunks].sum() + chunk_comm * received


@numba.njit(cache=True)
def _swap_for_cost(owned: np.ndarray, weights: np.ndarray, bits: np.ndarray, chunk_comm: int, max_rounds: int) -> None:
    """Single-chunk swaps between the costliest rank and any other, the best first, while one
    lowers the larger of the pair's costs below the costliest's (in place on `owned` [rank, k])."""
    world, k = owned.shape
    cost = np.array([_cost(owned[r], weights, bits, chunk_comm) for r in range(world)])
    for _ in range(max_rounds):
        heavy = np.argmax(cost)
        best, best_partner, best_i, best_j = cost[heavy], -1, -1, -1
        heavy_own, heavy_without = _views(owned[heavy], bits)
        heavy_load = weights[owned[heavy]].sum()
        for partner in range(world):
            if partner == heavy:
                continue
            partner_own, partner_without = _views(owned[partner], bits)
            partner_load = weights[owned[partner]].sum()
            for i in range(k):
                a = owned[heavy, i]
                for j in range(k):
                    b = owned[partner, j]  # swapped for a
                    received = _received_after_swap(heavy_without[i], heavy_own, bits, a, b)
                    new_heavy = heavy_load - weights[a] + weights[b] + chunk_comm * received
                    received = _received_after_swap(partner_without[j], partner_own, bits, b, a)
                    new_partner = partner_load - weights[b] + weights[a] + chunk_comm * received
                    if max(new_heavy, new_partner) < best:
                        best, best_partner, best_i, best_j = max(new_heavy, new_partner), partner, i, j
        if best_partner < 0:
            return
        owned[heavy, best_i], owned[best_partner, best_j] = owned[best_partner, best_j], owned[heavy, best_i]
        cost[heavy] = _cost(owned[heavy], weights, bits, chunk_comm)
        cost[best_partner] = _cost(owned[best_partner], weights, bits, chunk_comm)


def imbalance(loads: np.ndarray | Sequence[float], assignment: Sequence[Sequence[int]]) -> float:
    """max rank load / mean rank load (1.0 is perfect)."""
    loads = np.asarray(loads, dtype=np.float64)
    per_rank = [loads[list(chunks)].sum() for chunks in assignment]
    return float(max(per_rank) / (sum(per_rank) / len(per_rank)))
