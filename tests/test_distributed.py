"""Context parallelism: plans, localization, the balancer, and CP attention on gloo processes."""

import dataclasses
import importlib
import itertools
import os
import re
import tempfile

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import random_column_mask
from flashmask3.distributed import (
    SCHEMES,
    ContextParallelAttention,
    CPConfig,
    CPPlan,
    balance,
    chunk_loads,
    chunk_visibility,
    context_parallel,
    contiguous_assignment,
    cp_attention,
    imbalance,
    local_rows_below,
    localize,
    lower_bound,
    make_plan,
    zigzag_assignment,
)
from flashmask3.reference import PARTIAL, UNMASKED, ColumnMask, masks
from flashmask3.verify import random_inputs
from flashmask3.verify.cp import max_error, run_cp, single_device

import flashmask3 as fm

VARIANTS = [(True, 1), (True, 2), (False, 2), (False, 4)]


# -- plans -------------------------------------------------------------------------------------
def test_zigzag_and_contiguous_assignments():
    assert zigzag_assignment(4, 2) == ((0, 7), (1, 6), (2, 5), (3, 4))
    assert zigzag_assignment(2, 4) == ((0, 3, 4, 7), (1, 2, 5, 6))
    assert contiguous_assignment(2, 2) == ((0, 1), (2, 3))


def test_shard_and_unshard_are_inverse():
    plan = make_plan(64, 4, 2, "zigzag")
    x = torch.arange(64).view(1, 64, 1, 1)
    parts = [plan.shard(x, r) for r in range(4)]
    assert parts[1].flatten().tolist() == list(range(8, 16)) + list(range(48, 56))
    assert torch.equal(plan.unshard(parts), x)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(seqlen=60, world_size=4, chunks_per_rank=2), "multiple of world_size"),
        (dict(seqlen=64, world_size=4, chunks_per_rank=3, scheme="zigzag"), "multiple of world_size"),
        (dict(seqlen=48, world_size=4, chunks_per_rank=3, scheme="zigzag"), "even number of chunks"),
        (dict(seqlen=64, world_size=4, scheme="round_robin"), "accepted: contiguous, zigzag, balanced"),
        (dict(seqlen=64, world_size=4, scheme="balanced"), "needs the per-chunk loads"),
    ],
)
def test_plan_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_plan(**kwargs)
    with pytest.raises(ValueError, match="every chunk"):
        CPPlan(64, 16, ((0, 1), (1, 2)))


# -- localization ------------------------------------------------------------------------------
def test_clip_shift_max_counts_local_rows_below():
    # Local rows are chunks 1 and 3 of size 4: global rows 4-7 and 12-15.
    values = torch.tensor([0, 4, 6, 8, 12, 13, 16])
    assert local_rows_below(values, [4, 12], 4).tolist() == [0, 0, 2, 4, 4, 5, 8]


def assert_localized(mask, q_chunks, k_chunks, chunk):
    dense = mask.to_dense()
    rows = torch.cat([torch.arange(c * chunk, (c + 1) * chunk) for c in q_chunks])
    cols = torch.cat([torch.arange(c * chunk, (c + 1) * chunk) for c in k_chunks])
    local = localize(mask, q_chunks, k_chunks, chunk)
    assert not local.causal
    assert torch.equal(local.to_dense(), dense[:, :, rows][:, :, :, cols])


@pytest.mark.parametrize("name", masks.MASK_NAMES)
def test_localized_masks_equal_the_global_block(name):
    mask = masks.build(name, 256, batch=2, heads=2, seed=4)
    rng = np.random.default_rng(0)
    for _ in range(4):
        q_chunks = sorted(rng.choice(16, size=4, replace=False).tolist())
        k_chunks = sorted(rng.choice(16, size=rng.integers(1, 6), replace=False).tolist())
        assert_localized(mask, q_chunks, k_chunks, 16)


@pytest.mark.parametrize("causal, width", VARIANTS)
def test_localization_is_exact_for_every_variant(causal, width):
    gen = torch.Generator().manual_seed(width + causal)
    mask = random_column_mask(gen, 1, 3, 96, 96, causal, width)
    for q_chunks, k_chunks in [([0, 5], [1, 2, 5]), ([2, 3], [0]), ([1, 4], [4, 5]), ([5], [0, 1, 2, 3, 4, 5])]:
        assert_localized(mask, q_chunks, k_chunks, 16)


def clip_shift_max(values, chunk_starts, chunk_size):
    """localize.py's rule as written: the max over the local chunks."""
    out = torch.zeros_like(values)
    for b, start in enumerate(chunk_starts):
        local = (values - start).clamp(0, chunk_size)
        out = torch.maximum(out, torch.where(local > 0, local + b * chunk_size, torch.zeros_like(local)))
    return out


def test_local_rows_below_is_the_clip_shift_max_rule():
    rng = np.random.default_rng(0)
    for trial in range(200):
        size, chunks = int(rng.integers(1, 9)), int(rng.integers(1, 12))
        starts = [c * size for c in sorted(rng.choice(chunks, int(rng.integers(0, chunks + 1)), replace=False))]
        values = torch.tensor(rng.integers(0, chunks * size + 1, 64), dtype=(torch.int32, torch.int64)[trial % 2])
        got = local_rows_below(values, starts, size)
        assert got.dtype == values.dtype and torch.equal(got, clip_shift_max(values, starts, size))


def random_masks(count, seed=0, chunk_sizes=(1, 2, 4, 8)):
    """(mask, chunk size) of every variant, random boundaries, 1-2 batches and heads, 1-11 chunks."""
    gen, rng = torch.Generator().manual_seed(seed), np.random.default_rng(seed)
    for causal, width in VARIANTS:
        for _ in range(count):
            chunk = int(rng.choice(chunk_sizes))
            seqlen = chunk * int(rng.integers(1, 12))
            batch, heads = (int(x) for x in rng.integers(1, 3, 2))
            yield random_column_mask(gen, batch, heads, seqlen, seqlen, causal, width), chunk


def blockwise_visible(mask, chunk):
    """[query chunk, key chunk]: any attended pair in the block, from the dense mask."""
    n = mask.seqlen_q // chunk
    return mask.to_dense().any(0).any(0).view(n, chunk, n, chunk).any(3).any(1).numpy()


def test_chunk_visibility_is_the_dense_masks_blockwise_any():
    for mask, chunk in random_masks(40):
        assert np.array_equal(chunk_visibility(mask, chunk), blockwise_visible(mask, chunk))
    for name in masks.MASK_NAMES:
        mask = masks.build(name, 256, batch=2, heads=2, seed=3)
        assert np.array_equal(chunk_visibility(mask, 32), blockwise_visible(mask, 32)), name


def plain_routes(needs, plan, ranks_per_node):
    """The routes written plainly, message by message (the order they are posted in)."""
    world = plan.world_size
    if ranks_per_node is None or ranks_per_node >= world:
        direct = {}
        for dst in range(world):
            for c in range(plan.num_chunks):
                if plan.owner(c) != dst and needs[dst][c]:
                    direct.setdefault((plan.owner(c), dst), []).append(c)
        return [direct]
    inter, intra = {}, {}
    for c in range(plan.num_chunks):
        src = plan.owner(c)
        for node in range(world // ranks_per_node):
            members = range(node * ranks_per_node, (node + 1) * ranks_per_node)
            wanting = [r for r in members if needs[r][c] and r != src]
            if not wanting:
                continue
            holder = src if src in members else node * ranks_per_node + src % ranks_per_node
            if holder != src:
                inter.setdefault((src, holder), []).append(c)
            for r in wanting:
                if r != holder:
                    intra.setdefault((holder, r), []).append(c)
    return [inter, intra]


def test_layouts_are_their_definition_on_random_masks_and_plans():
    """Which chunks a rank needs (from the dense mask) and the routes, message by message."""
    rng = np.random.default_rng(1)
    for mask, chunk in random_masks(30, seed=1, chunk_sizes=(2, 4)):
        chunks = mask.seqlen_q // chunk
        world = int(rng.choice([w for w in (1, 2, 3, 4, 6, 8) if chunks % w == 0]))
        plan = CPPlan(mask.seqlen_q, chunk, tuple(map(tuple, np.sort(rng.permutation(chunks).reshape(world, -1)))))
        seen = blockwise_visible(mask, chunk)
        needs = [seen[list(plan.assignment[r])].any(0) for r in range(world)]
        for ranks_per_node in [None, *[n for n in (1, 2, 3, 4) if world % n == 0]]:
            for prune in (True, False):
                layout = context_parallel._Layout(mask, plan, CPConfig(prune=prune, ranks_per_node=ranks_per_node))
                expected = needs if prune else np.ones((world, chunks), dtype=bool)
                assert np.array_equal(layout.needs, expected)
                routes = plain_routes(expected, plan, ranks_per_node)
                assert [list(phase.items()) for phase in layout.phases] == [list(p.items()) for p in routes]


def test_stages_split_each_ranks_route_in_ring_order():
    """Stage s carries to each rank its needed remote chunks number [s*k, (s+1)*k) in ring order
    (the owner's distance after the rank, then the chunk), and the stages together are the
    one-level route, message by message."""
    rng = np.random.default_rng(2)
    for mask, chunk in random_masks(20, seed=2, chunk_sizes=(2, 4)):
        chunks = mask.seqlen_q // chunk
        world = int(rng.choice([w for w in (1, 2, 4, 8) if chunks % w == 0]))
        plan = CPPlan(mask.seqlen_q, chunk, tuple(map(tuple, np.sort(rng.permutation(chunks).reshape(world, -1)))))
        [route] = context_parallel._Layout(mask, plan, CPConfig()).phases
        for k in (1, 2, 3):
            stages = context_parallel._Layout(mask, plan, CPConfig(stage_chunks=k)).stages
            for dst in range(world):
                wanted = sorted(
                    (c for (_, d), cs in route.items() if d == dst for c in cs),
                    key=lambda c: ((plan.owner(c) - dst) % world, c),
                )
                for s, stage in enumerate(stages):
                    assert sorted(c for (_, d), cs in stage.items() if d == dst for c in cs) == sorted(
                        wanted[s * k : (s + 1) * k]
                    )
            longest = max((sum(len(cs) for (_, d), cs in route.items() if d == r) for r in range(world)), default=0)
            assert len(stages) == -(-longest // k)
            for pair in route:
                assert sorted(c for stage in stages for c in stage.get(pair, [])) == route[pair]
            for stage in stages:  # one message per pair, its chunks in order
                assert all(cs == sorted(cs) for cs in stage.values())


@pytest.mark.parametrize(
    "name, world, k, stage0, chunk_order_most",
    [
        # Each rank r owns chunks r and 2 * world - 1 - r (zigzag); in ring order rank r asks r + 1.
        ("causal", 8, 1, {((r + 1) % 8, r): [(r + 1) % 8] for r in range(8)}, 7),
        ("full", 4, 2, {((r + 1) % 4, r): [(r + 1) % 4, 7 - (r + 1) % 4] for r in range(4)}, 3),
    ],
)
def test_stages_spread_the_receivers_over_the_senders(name, world, k, stage0, chunk_order_most):
    """In stage 0 each rank is asked by one receiver, the next rank before it; in chunk order the
    owners of the lowest chunks would be asked by most receivers at once (causal: 7 of the 8 ranks
    ask rank 0, the owner of chunk 0; full: 3 of 4 ask each of ranks 0 and 1)."""
    mask, plan = masks.build(name, 64 * world), make_plan(64 * world, world, 2, "zigzag")
    layout = context_parallel._Layout(mask, plan, CPConfig(stage_chunks=k))
    assert layout.stages[0] == stage0
    assert max(np.bincount([src for src, _ in layout.stages[0]])) == 1
    remote = [[c for c in layout.needed(r, range(plan.num_chunks)) if plan.owner(c) != r] for r in range(world)]
    chunk_order = [chunks[:k] for chunks in remote]
    asked = [len({r for r in range(world) for c in chunk_order[r] if plan.owner(c) == src}) for src in range(world)]
    assert max(asked) == chunk_order_most


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(stage_chunks=0), "stage_chunks must be a positive int or None, got 0"),
        (dict(stage_chunks=True), "stage_chunks must be a positive int or None, got True"),
        (dict(stage_chunks=2, scheme="ring"), "does not go with scheme='ring'"),
        (dict(stage_chunks=2, ranks_per_node=2), "stage_chunks=2) does not go with ranks_per_node"),
        (dict(stage_chunks=1, hold_remote_kv=True), "stage_chunks=1) does not go with hold_remote_kv=True"),
    ],
)
def test_stage_chunks_rejects_what_it_does_not_stage(options, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        CPConfig(**options)


def test_chunk_loads_count_the_block_classes():
    def counted(mask, chunk, tile):
        classes = mask.block_classes(tile, tile).classes
        per_row_tile = {c: (classes == c).sum(dim=(0, 1, 3)).numpy() for c in (PARTIAL, UNMASKED)}
        per_chunk = {c: n.reshape(-1, chunk // tile).sum(-1) for c, n in per_row_tile.items()}
        return per_chunk[UNMASKED] + 1.3 * per_chunk[PARTIAL]

    gen, rng = torch.Generator().manual_seed(2), np.random.default_rng(2)
    for causal, width in VARIANTS:
        for trial in range(30):
            tile = int(rng.choice([1, 2, 4, 8]))
            chunk = tile * int(rng.integers(1, 4))
            seqlen_q = chunk * int(rng.integers(1, 6))
            seqlen_k = seqlen_q if trial % 2 else int(rng.integers(1, 3 * seqlen_q))  # bottom-right causal too
            batch, heads = (int(x) for x in rng.integers(1, 3, 2))
            mask = random_column_mask(gen, batch, heads, seqlen_q, seqlen_k, causal, width)
            assert np.array_equal(chunk_loads(mask, chunk, tile), counted(mask, chunk, tile))
    for name in masks.MASK_NAMES:
        mask = masks.build(name, 1024, batch=2, heads=2, seed=3)
        assert np.array_equal(chunk_loads(mask, 256, 64), counted(mask, 256, 64)), name


def test_localize_rejects_unequal_lengths():
    mask = ColumnMask(torch.full((1, 1, 32, 1), 16, dtype=torch.int32), True, 16)
    with pytest.raises(ValueError, match="Sq == Sk"):
        localize(mask, [0], [0], 16)


# -- balancer ----------------------------------------------------------------------------------
def brute_force_max_load(loads, world):
    k = len(loads) // world
    best = float("inf")

    def search(rest, worst):
        nonlocal best
        if worst >= best:
            return
        if not rest:
            best = worst
            return
        for group in itertools.combinations(rest[1:], k - 1):
            group = (rest[0], *group)
            search([c for c in rest if c not in group], max(worst, loads[list(group)].sum()))

    search(list(range(len(loads))), 0.0)
    return best


def best_pair_split(loads, first, second):
    """The smallest larger half of an equal-count split of two ranks' chunks."""
    pool = list(first) + list(second)
    total = loads[pool].sum()
    return min(
        max(loads[list(half)].sum(), total - loads[list(half)].sum())
        for half in itertools.combinations(pool, len(first))
    )


def check_balancer_guarantee(loads, world):
    """The module docstring's guarantee, checked on real loads to the quantization of the exact
    steps (1/1000 of the largest chunk per chunk). Returns (result, optimum)."""
    k = len(loads) // world
    assignment = balance(loads, world)
    assert sorted(c for r in assignment for c in r) == list(range(len(loads)))
    assert {len(r) for r in assignment} == {k}
    rank_loads = [loads[list(r)].sum() for r in assignment]
    got, tol = max(rank_loads), k * loads.max() / 1000
    optimum = brute_force_max_load(loads, world)
    assert lower_bound(loads, world) <= optimum + 1e-9 and optimum <= got
    longest_first = balance(loads, world, max_rounds=0)
    assert got <= max(loads[list(r)].sum() for r in longest_first) + tol
    if got <= lower_bound(loads, world) + tol or world == 2 or k == 1:
        assert got <= optimum + tol
    else:  # a pairwise optimum: some heaviest rank cannot be lowered with any one partner
        heaviest = [h for h in range(world) if rank_loads[h] >= got - tol]
        assert any(
            all(best_pair_split(loads, assignment[h], assignment[p]) >= got - tol for p in range(world) if p != h)
            for h in heaviest
        )
    return got, optimum


@pytest.mark.parametrize("world, per_rank", [(2, 2), (2, 4), (3, 2), (4, 1), (4, 2), (3, 3), (4, 3), (3, 4)])
def test_balancer_keeps_its_guarantee_on_small_cases(world, per_rank):
    rng = np.random.default_rng(world * 10 + per_rank)
    for _ in range(8):
        check_balancer_guarantee(rng.integers(1, 200, world * per_rank).astype(float), world)


def test_balancer_is_a_local_search_not_an_exact_one():
    loads = np.array([44, 76, 98, 143, 75, 7, 150, 143, 195, 134, 70, 63], dtype=float)
    assert check_balancer_guarantee(loads, 4) == (309, 302)


def test_the_three_way_step_re_splits_the_heaviest_with_two_other_ranks():
    # Two ranks tie at the top: the heaviest was once among "the two lightest" and re-split with
    # itself, ending at 417.
    loads = np.array([1, 84, 69, 195, 163, 71, 157, 64, 118, 87, 128, 106], dtype=float)
    assert check_balancer_guarantee(loads, 3) == (416, 416)


def plain_balance(loads, world, max_rounds=200):
    """The balancer's search written plainly (loads summed on demand, every partner split): the
    oracle of the one that keeps loads up to date and stops at partners that cannot win."""
    splits = importlib.import_module("flashmask3.distributed.balance")
    loads = np.asarray(loads, dtype=np.float64)
    k = len(loads) // world
    weights = np.rint(loads * 1000 / max(loads.max(), 1e-12)).astype(np.int64)
    ranks = [[] for _ in range(world)]
    for c in np.argsort(-weights, kind="stable"):
        ranks[min((r for r in range(world) if len(ranks[r]) < k), key=lambda r: weights[ranks[r]].sum())].append(int(c))
    target = int(np.ceil(lower_bound(weights, world)))

    def load(r):
        return int(weights[ranks[r]].sum())

    for _ in range(max_rounds):
        heavy = max(range(world), key=load)
        if load(heavy) <= target:
            break
        best = None
        for partner in sorted(range(world), key=load):
            if partner == heavy:
                continue
            pool = ranks[heavy] + ranks[partner]
            chosen = splits._best_split(weights[pool], k)
            first = [c for c, pick in zip(pool, chosen) if pick]
            second = [c for c, pick in zip(pool, chosen) if not pick]
            new_max = max(weights[first].sum(), weights[second].sum())
            if new_max < load(heavy) and (best is None or new_max < best[0]):
                best = (new_max, partner, first, second)
        if best is None and world >= 3 and k <= 4:
            group = [heavy, *[r for r in sorted(range(world), key=load) if r != heavy][:2]]
            pool = [c for r in group for c in ranks[r]]
            parts = splits._best_three_way(weights[pool], k)
            if max(weights[[pool[i] for i in p]].sum() for p in parts) < load(heavy):
                for r, p in zip(group, parts):
                    ranks[r] = [pool[i] for i in p]
                continue
        if best is None:
            break
        _, partner, ranks[heavy], ranks[partner] = best
    return tuple(tuple(sorted(r)) for r in ranks)


def test_the_balancer_is_its_plain_search():
    rng = np.random.default_rng(0)
    for trial in range(300):
        world, k = int(rng.integers(1, 9)), int(rng.integers(1, 7))
        loads = rng.integers(1, 200, world * k).astype(float) if trial % 2 else rng.lognormal(0, 1, world * k)
        rounds = int(rng.integers(0, 6)) if trial % 5 == 0 else 200
        assert balance(loads, world, rounds) == plain_balance(loads, world, rounds), (world, k, loads.tolist())
    loads = chunk_loads(masks.build("causal_document", 65536, seed=1), 256)  # 256 chunks on 32 ranks
    assert balance(loads, 32) == plain_balance(loads, 32)


def rank_costs(assignment, loads, visibility, chunk_comm):
    """Each rank's load plus chunk_comm per remote chunk its query chunks see."""
    costs = []
    for chunks in assignment:
        seen = visibility[list(chunks)].any(axis=0)
        seen[list(chunks)] = False
        costs.append(loads[list(chunks)].sum() + chunk_comm * seen.sum())
    return costs


def test_the_balancer_counts_communication_where_asked():
    from flashmask3.distributed.cost_model import received_chunk_load

    mask = masks.build("causal_document", 65536, seed=1)
    loads, visibility = chunk_loads(mask, 2048), chunk_visibility(mask, 2048)
    chunk_comm = received_chunk_load(2048, 8, 128)  # 8 MiB of bf16 K/V at 50 GB/s, in load units
    assert chunk_comm == pytest.approx(430.2, abs=0.1)
    compute_only = balance(loads, 8)
    assert balance(loads, 8, visibility=visibility, chunk_comm=0.0) == compute_only
    counted = balance(loads, 8, visibility=visibility, chunk_comm=chunk_comm)
    assert counted == make_plan(65536, 8, 4, "balanced", loads, visibility, chunk_comm).assignment
    # 44 remote chunks received instead of 62 for a larger top load: the largest cost drops by a quarter.
    for assignment, largest_cost, received in ((compute_only, 6874.0, 62), (counted, 5197.1, 44)):
        costs = rank_costs(assignment, loads, visibility, chunk_comm)
        assert max(costs) == pytest.approx(largest_cost, abs=0.1)
        assert round((sum(costs) - loads.sum()) / chunk_comm) == received


def test_the_communication_search_ends_at_a_swap_optimum():
    """On the quantized costs: never above the compute-only result, and no swap of one chunk
    between the costliest rank and another lowers the larger of their costs below its cost."""
    rng = np.random.default_rng(3)
    for _ in range(40):
        world, k = int(rng.integers(2, 6)), int(rng.integers(1, 5))
        chunks = world * k
        loads = rng.integers(1, 100, chunks).astype(float)
        visibility = rng.random((chunks, chunks)) < rng.uniform(0.1, 0.6)
        chunk_comm = float(rng.uniform(1, 60))
        weights = np.rint(loads * 1000 / loads.max())
        comm = np.rint(chunk_comm * 1000 / loads.max())
        got = balance(loads, world, visibility=visibility, chunk_comm=chunk_comm)
        costs = rank_costs(got, weights, visibility, comm)
        assert max(costs) <= max(rank_costs(balance(loads, world), weights, visibility, comm))
        heavy = int(np.argmax(costs))
        for partner in set(range(world)) - {heavy}:
            for a, b in itertools.product(got[heavy], got[partner]):
                swapped = [(set(got[heavy]) - {a}) | {b}, (set(got[partner]) - {b}) | {a}]
                assert max(rank_costs(swapped, weights, visibility, comm)) >= costs[heavy]


@pytest.mark.parametrize("name", ["causal", "causal_document", "share_question", "random_eviction"])
def test_balancer_beats_contiguous_and_zigzag(name):
    mask = masks.build(name, 16384, seed=2)
    loads = chunk_loads(mask, 256)
    assert loads.sum() == pytest.approx(float(chunk_loads(mask, 16384)[0]), rel=1e-6)  # loads add up
    for world in (4, 8):
        balanced = imbalance(loads, balance(loads, world))
        assert balanced <= imbalance(loads, zigzag_assignment(world, len(loads) // world)) + 1e-9
        assert balanced <= imbalance(loads, contiguous_assignment(world, len(loads) // world)) + 1e-9
        assert balanced < 1.05


# -- CP attention on gloo ----------------------------------------------------------------------
CASES = [
    ("mask_aware", dict()),
    ("mask_aware", dict(overlap=False, prune=False)),
    ("mask_aware", dict(ranks_per_node=2)),
    ("ring", dict()),
    ("allgather", dict()),
]


def _rank_main(rank, world, store, result_dir, fn, args):
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    result = fn(rank, world, *args)
    torch.save(result, os.path.join(result_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def run_ranks(tmp_path, world, fn, *args) -> list:
    """fn(rank, world, *args) on `world` gloo processes; every rank's return value. The ranks meet
    through a file store, a fresh one per call (a free TCP port could be taken before rank 0 binds it)."""
    store = os.path.join(tempfile.mkdtemp(dir=tmp_path), "store")
    mp.spawn(_rank_main, args=(world, store, str(tmp_path), fn, args), nprocs=world, join=True)
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]


def _equivalence(rank, world, assignment):
    rows = []
    for i, name in enumerate(masks.MASK_NAMES):
        mask, inputs, expected = single_device(name, 512, seed=i)
        loads = chunk_loads(mask, 32, tile=32) if assignment == "balanced" else None
        plan = make_plan(512, world, 16 // world, assignment, loads)
        for scheme, options in CASES:
            if options.get("ranks_per_node") and world < 4:
                continue
            refetched, held = (
                run_cp(rank, plan, mask, inputs, CPConfig(scheme=scheme, hold_remote_kv=hold, **options))
                for hold in (False, True)
            )
            err = max(max_error(rank, plan, refetched, expected), max_error(rank, plan, held, expected))
            identical = all(torch.equal(a, b) for a, b in zip(refetched, held))
            rows.append((name, scheme, options, err, identical))
    return rows


@pytest.mark.slow  # 2 and 4 gloo processes, ~35 s; the quick tier runs the main job's 2-rank CP check
@pytest.mark.parametrize("world, assignment", [(2, "zigzag"), (4, "zigzag"), (4, "balanced")])
def test_cp_attention_equals_single_device(tmp_path, world, assignment):
    """Forward and dQ/dK/dV of every scheme, remote K/V fetched again or held for the backward,
    against single-device attention in fp64; both backward paths give identical results."""
    rows = [row for rank_rows in run_ranks(tmp_path, world, _equivalence, assignment) for row in rank_rows]
    assert len(rows) == world * len(masks.MASK_NAMES) * (len(CASES) - (1 if world < 4 else 0))
    bad = [row for row in rows if row[3] > 1e-10 or not row[4]]
    assert not bad, bad[:5]


def _lse_loss_gradients(rank, world):
    """Per scheme, this rank's largest error of dQ, dK, dV against single-device autograd in fp64,
    for a loss on out and on the LSE."""
    mask, (q, k, v, dout), _ = single_device("causal_document", 256, seed=3)
    weights = torch.randn(1, 4, 256, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out, lse = fm.attention(*leaves, mask, backend="reference", return_lse=True)
    finite = torch.isfinite(lse)
    expected = torch.autograd.grad((out * dout).sum() + (lse * weights)[finite].sum(), leaves)
    plan = make_plan(256, world, 4, "zigzag")
    errors = {}
    for scheme in SCHEMES:
        local = [plan.shard(x, rank).clone().requires_grad_() for x in (q, k, v)]
        out, lse = cp_attention(*local, mask, plan, config=CPConfig(scheme=scheme), return_lse=True)
        rows = plan.shard(weights.transpose(1, 2), rank).transpose(1, 2)  # this rank's query rows
        loss = (out * plan.shard(dout, rank)).sum() + (lse * rows)[torch.isfinite(lse)].sum()
        errors[scheme] = max_error(rank, plan, torch.autograd.grad(loss, local), expected)
    return errors


def test_a_loss_on_the_cp_lse_has_the_single_device_gradients(tmp_path):
    """The CP LSE is differentiable as the single-device one is: every scheme on 2 gloo ranks."""
    for errors in run_ranks(tmp_path, 2, _lse_loss_gradients):
        assert set(errors) == set(SCHEMES) and max(errors.values()) < 1e-6, errors  # the fp32 LSE of the API


def _recorded(log, label, fn):
    def wrapper(*args, **kwargs):
        log.append(label(*args) if callable(label) else label)
        return fn(*args, **kwargs)

    return wrapper


def _logged_calls(rank, plan, mask, inputs, expected, log: list, configs: dict) -> tuple[dict, float]:
    """One CP forward + backward per config: {(key, "forward" / "backward"): what `log` recorded in
    each direction}, and the largest error against single-device attention."""
    logs, err = {}, 0.0
    q, k, v, dout = inputs
    for key, config in configs.items():
        local = [plan.shard(x, rank).clone().requires_grad_() for x in (q, k, v)]
        log[:] = []
        out = cp_attention(*local, mask, plan, config=config)
        logs[key, "forward"], log[:] = log[:], []
        grads = torch.autograd.grad(out, local, plan.shard(dout, rank))
        logs[key, "backward"], log[:] = log[:], []
        err = max(err, max_error(rank, plan, (out, *grads), expected))
    return logs, err


def _ring_order(rank, world):
    cp = context_parallel
    log = []
    cp._Comm.ring_shift = _recorded(log, lambda comm, block, what: f"post {what}", cp._Comm.ring_shift)
    cp._Comm.wait = _recorded(log, lambda comm, pending: f"wait {pending.what}", cp._Comm.wait)
    cp._local_forward = _recorded(log, "forward", cp._local_forward)
    cp._local_backward = _recorded(log, "backward", cp._local_backward)
    mask, inputs, expected = single_device("full", 192)
    plan = make_plan(192, world, 2, "zigzag")
    configs = {hold: CPConfig(scheme="ring", hold_remote_kv=hold) for hold in (False, True)}
    return _logged_calls(rank, plan, mask, inputs, expected, log, configs)


def test_ring_posts_the_next_block_before_computing(tmp_path):
    """Megatron's overlap: each step posts the next exchange, computes, then waits."""
    for logs, err in run_ranks(tmp_path, 3, _ring_order):
        assert err < 1e-10
        for hold in (False, True):
            assert logs[hold, "forward"] == ["post kv", "forward", "wait kv"] * 2 + ["forward"]
        assert logs[False, "backward"] == (
            ["post kv", "backward", "post dkv", "wait kv"]
            + ["post kv", "backward", "wait dkv", "post dkv", "wait kv"]
            + ["backward", "wait dkv", "post dkv", "wait dkv"]
        )
        assert logs[True, "backward"] == (  # K/V held: only the dK/dV accumulators travel
            ["backward", "post dkv"] + ["backward", "wait dkv", "post dkv"] * 2 + ["wait dkv"]
        )


def _record_mask_aware(log: list, *directions: str) -> None:
    """Record into `log` each message batch the CP layer posts and waits for, and each local
    attention call in `directions` ("forward", "backward") with its last argument."""
    cp = context_parallel
    cp._Comm.post = _recorded(log, lambda comm, sends, recvs, what: f"post {what}", cp._Comm.post)
    cp._Comm.wait = _recorded(log, lambda comm, pending: f"wait {pending.what}", cp._Comm.wait)
    for direction in directions:
        local = getattr(cp._LocalAttention, direction)
        setattr(cp._LocalAttention, direction, _recorded(log, lambda *args: args[-1], local))


def _mask_aware_backward_order(rank, world):
    log = []
    _record_mask_aware(log, "backward")
    mask, inputs, expected = single_device("full", 256)
    plan = make_plan(256, world, 2, "zigzag")
    configs = {
        "fetched again": CPConfig(),
        "held": CPConfig(hold_remote_kv=True),
        "hierarchical": CPConfig(ranks_per_node=2),
        "no overlap": CPConfig(overlap=False),
    }
    logs, err = _logged_calls(rank, plan, mask, inputs, expected, log, configs)
    return {name: logs[name, "backward"] for name in configs}, err


def test_mask_aware_backward_computes_the_own_chunks_while_dkdv_travel_home(tmp_path):
    """Remote chunks first; their dK/dV are posted, then the own chunks' backward runs before the
    wait (in the last return phase, the inter-node one where routing is hierarchical)."""
    for logs, err in run_ranks(tmp_path, 4, _mask_aware_backward_order):
        assert err < 1e-10
        assert logs["fetched again"] == [
            "post kv",
            "wait kv",
            "compute_remote",
            "post dkv",
            "compute_local",
            "wait dkv",
        ]
        assert logs["held"] == ["compute_remote", "post dkv", "compute_local", "wait dkv"]
        assert logs["hierarchical"] == ["post kv", "wait kv"] * 2 + [
            "compute_remote",
            "post dkv",
            "wait dkv",
            "post dkv",
            "compute_local",
            "wait dkv",
        ]
        assert logs["no overlap"] == ["post kv", "wait kv", "compute_remote", "compute_local", "post dkv", "wait dkv"]


def _block_diagonal(seqlen, starts):
    """Documents starting at `starts`, each attending to itself (non-causal)."""
    doc = torch.zeros(seqlen, dtype=torch.long)
    doc[list(starts)] = 1
    doc = doc.cumsum(0)
    return fm.ColumnMask.from_dense((doc[:, None] == doc[None, :])[None, None])


def _warm_up_order(rank, world):
    cp = context_parallel
    log = []
    dist.batch_isend_irecv = _recorded(log, "p2p", dist.batch_isend_irecv)
    dist.all_reduce = _recorded(log, "collective", dist.all_reduce)
    cp._reduce_scatter = _recorded(log, "collective", cp._reduce_scatter)
    # Ranks 0 and 1 share a document; ranks 2 and 3 have one each: no messages at all.
    mask, inputs, expected = single_device(_block_diagonal(512, [0, 256, 384]), 512)
    plan = make_plan(512, world, 2, "contiguous")
    err = max(max_error(rank, plan, run_cp(rank, plan, mask, inputs, CPConfig()), expected) for _ in range(2))
    return log, err


def test_every_rank_joins_a_collective_before_the_first_point_to_point_batch(tmp_path):
    """NCCL wants every rank of a group in its first batched P2P call; ranks without messages
    skip the batch, so one collective warms the group up, once."""
    logs = run_ranks(tmp_path, 4, _warm_up_order)
    for rank, (log, err) in enumerate(logs):
        assert err < 1e-10
        assert log[0] == "collective" and log.count("collective") == 1
        assert ("p2p" in log) == (rank < 2)


def _no_reduce_scatter(*args, **kwargs):
    raise RuntimeError("this backend has no reduce-scatter")


def _allgather_reductions(rank, world):
    cp = context_parallel
    mask, inputs, expected = single_device("causal_document", 256)
    plan = make_plan(256, world, 2, "zigzag")
    results = []
    for group in (None, "without reduce-scatter"):
        if group:  # a backend without reduce-scatter: the warm-up finds out, the grads are all-reduced
            cp._reduce_scatter = _no_reduce_scatter
            group = dist.new_group(list(range(world)))
        got = run_cp(rank, plan, mask, inputs, CPConfig(scheme="allgather"), group)
        results.append((cp._has_reduce_scatter[group or dist.group.WORLD], max_error(rank, plan, got, expected)))
    return results


def test_allgather_reduce_scatters_grads_where_the_backend_can(tmp_path):
    for (gloo, gloo_err), (fallback, fallback_err) in run_ranks(tmp_path, 2, _allgather_reductions):
        assert gloo and not fallback  # torch 2.13's gloo has reduce-scatter
        assert gloo_err < 1e-10 and fallback_err < 1e-10


def _node_layouts(rank, world):
    cp = context_parallel
    mask, inputs, expected = single_device("document", 256)
    plan = make_plan(256, world, 2, "zigzag")
    outcomes = []
    for ranks_per_node, host, local_rank in (
        (3, "node0", None),
        (2, f"node{rank % 2}", None),
        (2, "node0", rank // 2),
        (2, f"node{rank // 2}", rank % 2),
    ):
        cp.socket.gethostname = lambda: host
        if local_rank is not None:
            os.environ["LOCAL_RANK"] = str(local_rank)
        try:
            got = run_cp(rank, plan, mask, inputs, CPConfig(ranks_per_node=ranks_per_node))
            outcomes.append(max_error(rank, plan, got, expected))
        except ValueError as error:
            outcomes.append(str(error))
    return outcomes


def test_hierarchical_routing_checks_that_consecutive_ranks_share_a_node(tmp_path):
    for not_dividing, interleaved, same_local_ranks, by_node in run_ranks(tmp_path, 4, _node_layouts):
        assert "CPConfig(ranks_per_node=3) must divide the group size 4" in not_dividing
        assert "group ranks 0-1 as one node, but they run on hosts ['node0', 'node1']" in interleaved
        assert "ranks 0-1 as one node, but they run on hosts ['node0'] with local ranks ['0', '0']" in same_local_ranks
        assert by_node < 1e-10


def _kernel_routing(rank, world):
    from flashmask3.optimized import interface
    from flashmask3.reference import attention as reference

    mask, inputs, expected = single_device("share_question", 256)
    plan = make_plan(256, world, 2, "zigzag")
    refused = None
    try:
        run_cp(rank, plan, mask, inputs, CPConfig(backend="cute"))
    except ValueError as error:
        refused = str(error)
    calls = []

    def fake_forward(q, k, v, mask, scale):
        calls.append("cute forward")
        out, lse = reference.forward(q, k, v, mask, scale, torch.float64)
        return out.to(q.dtype), lse

    def fake_backward(dout, q, k, v, out, lse, mask, scale, dlse=None):
        calls.append("cute backward")
        return reference.backward(dout, q, k, v, out, lse, mask, scale, torch.float64, dlse)

    interface.unsupported_reason = lambda *inputs, **kwargs: None  # "a Hopper GPU": the fakes compute in fp64
    interface.forward, interface.backward = fake_forward, fake_backward
    errors = {
        scheme: max_error(rank, plan, run_cp(rank, plan, mask, inputs, CPConfig(scheme=scheme)), expected)
        for scheme in SCHEMES
    }
    return refused, sorted(set(calls)), errors


def test_local_calls_use_the_cute_kernels_in_both_directions_where_supported(tmp_path):
    for refused, calls, errors in run_ranks(tmp_path, 2, _kernel_routing):
        assert refused == "CPConfig(backend='cute'): backend='cute' needs CUDA tensors"
        assert calls == ["cute backward", "cute forward"]
        assert max(errors.values()) < 1e-10, errors


def _held_kv(rank, world):
    cp = context_parallel
    rows = []
    for scheme, name in (("mask_aware", "causal_document"), ("ring", "full"), ("allgather", "full")):
        mask, inputs, _ = single_device(name, 256)
        plan = make_plan(256, world, 2, "zigzag")
        for hold in (False, True):
            run_cp(rank, plan, mask, inputs, CPConfig(scheme=scheme, hold_remote_kv=hold))
            fwd, bwd = cp.last_forward_stats, cp.last_backward_stats
            rows.append(
                (
                    scheme,
                    hold,
                    fwd.saved_kv_bytes,
                    fwd.peak_kv_bytes,
                    bwd.peak_kv_bytes,
                    fwd.chunks_received,
                    bwd.chunks_received,
                )
            )
    return rows


def test_backward_fetches_remote_kv_again_unless_held(tmp_path):
    local = 2 * 64 * 2 * 16 * 8  # k and v of a rank: 2 chunks of 32 tokens, 2 kv heads x 16, fp64
    chunk = local // 2
    for rows in run_ranks(tmp_path, 4, _held_kv):
        by = {(scheme, hold): tuple(values) for scheme, hold, *values in rows}
        # mask-aware: its own K/V plus the chunks its queries see, for the forward and again for the backward
        saved, fwd_peak, bwd_peak, received, refetched = by["mask_aware", False]
        assert saved == local and fwd_peak == bwd_peak == local + received * chunk and refetched == received
        saved, fwd_peak, bwd_peak, received, refetched = by["mask_aware", True]
        assert saved == fwd_peak == bwd_peak == local + received * chunk and refetched == 0
        # ring: own block, the one computed and the one arriving; held: every block
        assert by["ring", False][:3] == (local, 3 * local, 3 * local)
        assert by["ring", True][:3] == (4 * local, 4 * local, 4 * local)
        # all-gather: own K/V plus the gathered buffers (its own copy among them)
        assert by["allgather", False][:3] == (local, 5 * local, 5 * local)
        assert by["allgather", True][:3] == (4 * local, 5 * local, 4 * local)


STAGED_MASKS = ("causal_document", "document", "share_question", "full", "sliding_window")


def _staged(rank, world):
    """Per mask and stage size: errors against single-device attention and the single-stage run,
    the K/V held at peak in each direction (staged, single-stage) and the bytes sent."""
    cp = context_parallel
    rows = []
    for i, name in enumerate(STAGED_MASKS):
        mask, inputs, expected = single_device(name, 512, seed=i)
        plan = make_plan(512, world, 4, "zigzag")
        single = run_cp(rank, plan, mask, inputs, CPConfig())
        single_stats = cp.rank_stats()
        for k in (1, 2):
            got = run_cp(rank, plan, mask, inputs, CPConfig(stage_chunks=k))
            fwd, bwd = cp.rank_stats()
            rows.append(
                {
                    "case": (name, k),
                    "error": max_error(rank, plan, got, expected),
                    "vs_single": max((a - b).abs().max().item() for a, b in zip(got, single)),
                    "peaks": (fwd.peak_kv_bytes, bwd.peak_kv_bytes),
                    "single_peaks": tuple(s.peak_kv_bytes for s in single_stats),
                    "received": (fwd.chunks_received, bwd.chunks_received),
                    "single_received": tuple(s.chunks_received for s in single_stats),
                    "sent": (fwd.bytes_sent, bwd.bytes_sent),
                    "single_sent": tuple(s.bytes_sent for s in single_stats),
                }
            )
    return rows


@pytest.mark.slow  # 2 and 4 gloo processes
@pytest.mark.parametrize("world", [2, 4])
def test_staged_fetch_equals_single_device_and_bounds_the_kv_held(tmp_path, world):
    """mask_aware with `stage_chunks` in {1, 2}, forward and dQ/dK/dV in fp64: single-device
    attention, and the single-stage run up to rounding (merges in another order); the same
    chunks and bytes travel. The K/V held at peak, each direction: the own chunks plus at most
    two stages (the one computed, the next arriving), below the single stage where a rank needs
    more than two stages' chunks."""
    chunk = 2 * (512 // (4 * world)) * 2 * 16 * 8  # k and v of one chunk, 2 kv heads x 16, fp64
    local = 4 * chunk
    rows = [row for rank_rows in run_ranks(tmp_path, world, _staged) for row in rank_rows]
    assert len(rows) == world * len(STAGED_MASKS) * 2
    for row in rows:
        (_, k), (fwd_peak, bwd_peak) = row["case"], row["peaks"]
        assert row["error"] < 1e-10 and row["vs_single"] < 1e-12, row
        assert row["received"] == row["single_received"] and row["sent"] == row["single_sent"], row
        remote = row["received"][0]
        assert fwd_peak == bwd_peak == local + min(remote, 2 * k) * chunk, row
        assert row["single_peaks"] == (local + remote * chunk,) * 2, row
    # Full mask: every rank needs all 4 * (world - 1) remote chunks, more than two stages' worth.
    below = {row["case"] for row in rows if max(row["peaks"]) < min(row["single_peaks"])}
    assert below >= {("full", 1)} | ({("full", 2)} if world == 4 else set())


def _staged_order(rank, world):
    log = []
    _record_mask_aware(log, "forward", "backward")
    mask, inputs, expected = single_device("full", 256)
    plan = make_plan(256, world, 2, "zigzag")
    configs = {overlap: CPConfig(stage_chunks=2, overlap=overlap) for overlap in (True, False)}
    return _logged_calls(rank, plan, mask, inputs, expected, log, configs)


def test_staged_fetch_posts_the_next_stage_before_computing_one(tmp_path):
    """Full mask, 4 ranks: 6 remote chunks each, 3 stages of 2. Each stage is posted before the
    previous one is waited for and computed; in the backward each stage's dK/dV go home while the
    next stage computes, the last stage's while the own chunks do."""
    fetch = ["post kv", "wait kv", "compute_remote"]
    for logs, err in run_ranks(tmp_path, 4, _staged_order):
        assert err < 1e-10
        assert logs[True, "forward"] == ["post kv", "compute_local", "post kv", "wait kv", "compute_remote"] + [
            "post kv",
            "wait kv",
            "compute_remote",
            "wait kv",
            "compute_remote",
        ]
        assert logs[True, "backward"] == ["post kv"] + fetch + ["post dkv"] + fetch + ["post dkv", "wait dkv"] + [
            "wait kv",
            "compute_remote",
            "post dkv",
            "wait dkv",
            "compute_local",
            "wait dkv",
        ]
        assert logs[False, "forward"] == ["compute_local"] + fetch * 3
        assert logs[False, "backward"] == (fetch + ["post dkv", "wait dkv"]) * 3 + ["compute_local"]


def _one_rank(rank, world):
    mask, inputs, expected = single_device("causal_document", 256)
    plan = make_plan(256, 1, 2, "zigzag")
    return {
        (scheme, hold): max_error(rank, plan, run_cp(rank, plan, mask, inputs, config), expected)
        for scheme in SCHEMES
        for hold in (False, True)
        for config in [CPConfig(scheme=scheme, hold_remote_kv=hold)]
    }


def test_a_group_of_one_rank_is_single_device_attention(tmp_path):
    [errors] = run_ranks(tmp_path, 1, _one_rank)
    assert max(errors.values()) < 1e-10, errors


def _pruning_worker(rank, world):
    cp = context_parallel
    mask = masks.build("document", 512, num_docs=4, seed=0)
    q, k, v, _ = random_inputs(1, 512, 512, 2, 2, 16, torch.float32)
    plan = make_plan(512, world, 2, "contiguous")
    sent = {}
    for name, config in [
        ("pruned", CPConfig()),
        ("unpruned", CPConfig(prune=False)),
        ("allgather", CPConfig(scheme="allgather")),
        ("hierarchical", CPConfig(ranks_per_node=2, prune=False)),
    ]:
        cp_attention(*(plan.shard(x, rank) for x in (q, k, v)), mask, plan, config=config)
        sent[name] = cp.last_forward_stats.bytes_sent
    layer = ContextParallelAttention(config=CPConfig(scheme="ring"))
    local = [plan.shard(x, rank) for x in (q, k, v)]
    sent["module_matches"] = int(
        torch.equal(layer(*local, mask, plan), cp_attention(*local, mask, plan, config=CPConfig(scheme="ring")))
    )
    return sent


def test_pruning_sends_fewer_bytes(tmp_path):
    totals = {}
    for sent in run_ranks(tmp_path, 4, _pruning_worker):
        for key, value in sent.items():
            totals[key] = totals.get(key, 0) + value
    chunk_bytes = 2 * 64 * 2 * 16 * 4  # k and v of one 64-token chunk, 2 heads x 16, fp32
    assert totals["module_matches"] == 4  # the module is the function on every rank
    assert totals["unpruned"] == totals["allgather"] == 4 * 3 * 2 * chunk_bytes
    # Pruned: exactly the chunks a receiver's queries see some of (from the dense mask).
    mask, plan = masks.build("document", 512, num_docs=4, seed=0), make_plan(512, 4, 2, "contiguous")
    dense = mask.to_dense()[0, 0]
    needed = sum(
        bool(dense[plan.token_index(r)][:, c * 64 : (c + 1) * 64].any())
        for r in range(4)
        for c in range(8)
        if plan.owner(c) != r
    )
    assert totals["pruned"] == needed * chunk_bytes < totals["unpruned"]
    # Hierarchical without pruning: as many messages (relays forward inside the node), but ...
    assert totals["hierarchical"] == totals["unpruned"]


def test_hierarchical_routes_cross_nodes_once_per_chunk():
    cp = context_parallel
    mask = masks.build("full", 512)
    plan = make_plan(512, 8, 2, "zigzag")
    node = lambda r: r // 4  # noqa: E731

    def crossings(config):
        layout = cp._Layout(mask, plan, config)
        return sum(
            len(chunks) for phase in layout.phases for (src, dst), chunks in phase.items() if node(src) != node(dst)
        )

    # ... each chunk crosses to the other node once instead of once per receiver there.
    assert crossings(CPConfig(ranks_per_node=4)) == plan.num_chunks
    assert crossings(CPConfig()) == 4 * plan.num_chunks


def test_cost_model_orders_the_schemes():
    from flashmask3.distributed.cost_model import Hardware, predict

    mask = masks.build("causal_document", 16384, num_docs=6, seed=1)
    hw = Hardware(ranks_per_node=2)  # two "nodes" of 2 ranks: the inter-node link matters
    results = {}
    for scheme, assignment in (("mask_aware", "balanced"), ("ring", "zigzag"), ("allgather", "zigzag")):
        plan = make_plan(16384, 4, 4, assignment, chunk_loads(mask, 1024))
        results[scheme] = predict(mask, plan, scheme, 32, 8, 128, hw)
    for r in results.values():
        assert 0.0 <= r["overlap_efficiency"] <= 1.0 and r["slowest_rank_s"] > 0
    # Pruned traffic + overlap beat the baselines on a sparse document mask.
    assert results["mask_aware"]["slowest_rank_s"] < results["allgather"]["slowest_rank_s"]
    assert results["mask_aware"]["slowest_rank_s"] < results["ring"]["slowest_rank_s"]
    assert results["allgather"]["overlap_efficiency"] == 0.0


def test_cost_model_follows_the_codes_calls_phases_and_overlap():
    """Times by hand, in ms: one chunk (k and v, 128 tokens x 64, bf16) takes 1 ms over NVLink and
    10 ms between nodes, its dK/dV (fp32) twice that; each kernel call costs 1 ms."""
    from flashmask3.distributed.cost_model import Hardware, RankTimeFit, predict

    chunk_bytes = 2 * 128 * 64 * 2
    fit = RankTimeFit(1e-3, 0.0, 0.0, *_BACKWARD_AS_FORWARD)
    mask, plan = masks.build("full", 1024), make_plan(1024, 4, 2, "zigzag")

    def modeled(scheme, ranks_per_node=8, hold=False):
        hw = Hardware(ranks_per_node=ranks_per_node, nvlink_bps=chunk_bytes * 1e3, inter_node_bps=chunk_bytes * 1e2)
        result = predict(mask, plan, scheme, 1, 1, 64, hw, fit=fit, hold_remote_kv=hold)
        (rank_times,) = {tuple(round(v * 1e3, 9) for v in r.values()) for r in result["per_rank"]}  # same on all
        return dict(zip(("forward", "backward", "total", "compute", "comm", "hidden"), rank_times))

    # Mask-aware, one node: each rank sends its 2 chunks to 3 ranks (6 ms) while computing its own
    # (1 ms), then the remote call; backward: fetch again, remote call, dK/dV home (12 ms) under
    # the own chunks' call. Two calls per direction.
    assert modeled("mask_aware") == dict(forward=7, backward=19, total=26, compute=4, comm=24, hidden=2)
    assert modeled("mask_aware", hold=True)["backward"] == 1 + 12
    # Two nodes of 2: the inter-node phase (2 chunks, 20 ms) and the relays' phase (4 chunks, 4 ms)
    # add up: forward max(1, 20) + 4 + 1; backward 20 + 4 + 1 + 8 (relays' dK/dV) + max(1, 40).
    hierarchical = modeled("mask_aware", ranks_per_node=2)
    assert (hierarchical["forward"], hierarchical["backward"]) == (25, 73)
    assert modeled("mask_aware", ranks_per_node=2, hold=True)["backward"] == 1 + 8 + 40
    # Ring, 4 steps, one call each: a 2 ms block travels under each step but the last; backward,
    # the block and the 4 ms dK/dV accumulator share the link, the last accumulator goes home.
    assert modeled("ring") == dict(
        forward=3 * 2 + 1, backward=2 + 2 * 6 + 4 + 4, total=29, compute=8, comm=6 + 22, hidden=7
    )
    assert modeled("ring", hold=True)["backward"] == 1 + 2 * 4 + 4 + 4
    # All-gather: 3 blocks in (6 ms), one call; backward gathers again, reduce-scatters 3 x 4 ms.
    assert modeled("allgather") == dict(forward=7, backward=6 + 1 + 12, total=26, compute=2, comm=24, hidden=0)


_BACKWARD_AS_FORWARD = (None, None, None)  # a RankTimeFit's backward fields: derived from the forward


def test_cost_model_charges_the_fit_per_kernel_call():
    from flashmask3.distributed.cost_model import BACKWARD_FLOPS, Hardware, RankTimeFit, predict

    mask = masks.build("share_question", 8192, seed=2)
    plan = make_plan(8192, 4, 2, "balanced", chunk_loads(mask, 1024))
    layout = context_parallel._Layout(mask, plan, CPConfig())
    fit = RankTimeFit(1e-3, 0.0, 5e-5, *_BACKWARD_AS_FORWARD)
    result = predict(mask, plan, "mask_aware", 32, 8, 128, Hardware(), fit=fit)
    for rank, per_rank in enumerate(result["per_rank"]):
        needed = layout.needed(rank, range(plan.num_chunks))
        calls = len({c in plan.assignment[rank] for c in needed})  # own chunks, remote chunks, or both
        assert per_rank["compute_s"] == pytest.approx(2 * (calls * 1e-3 + 5e-5 * len(needed)), rel=1e-12)
    # The per-load term: forward at the kernel's rate, backward 2.5x the FLOPs at its own rate.
    rate = predict(
        mask,
        plan,
        "allgather",
        32,
        8,
        128,
        Hardware(ranks_per_node=4),
        fit=RankTimeFit(0.0, 1.0, 0.0, *_BACKWARD_AS_FORWARD),
    )
    loads = chunk_loads(mask, 1024)
    for rank, per_rank in enumerate(rate["per_rank"]):
        load = loads[list(plan.assignment[rank])].sum()
        assert per_rank["compute_s"] == pytest.approx(load * (1 + BACKWARD_FLOPS * 577 / 533), rel=1e-3)


def test_cost_model_charges_a_measured_backward_fit_its_own_costs():
    import json
    from pathlib import Path

    from flashmask3.distributed.cost_model import Hardware, RankTimeFit, predict

    mask = masks.build("causal_document", 8192, seed=2)
    plan = make_plan(8192, 4, 2, "balanced", chunk_loads(mask, 1024))
    forward_only = RankTimeFit(1e-3, 0.0, 0.0, *_BACKWARD_AS_FORWARD)
    measured = dataclasses.replace(forward_only, bwd_fixed_s=3e-3, bwd_per_load_s=0.0, bwd_per_needed_chunk_s=0.0)
    assumed = predict(mask, plan, "allgather", 32, 8, 128, Hardware(ranks_per_node=4), fit=forward_only)
    own = predict(mask, plan, "allgather", 32, 8, 128, Hardware(ranks_per_node=4), fit=measured)
    for a, b in zip(assumed["per_rank"], own["per_rank"]):  # one call each way: 1 + 1 ms, then 1 + 3 ms
        assert (a["compute_s"], b["compute_s"]) == (pytest.approx(2e-3), pytest.approx(4e-3))
    calibration = json.loads(Path("bench/results/cp_calibration.json").read_text())
    committed = RankTimeFit.from_calibration(calibration, forward="kernel_rate_slope")  # forward-only timings
    assert committed.bwd_fixed_s is None and committed.per_load_s == pytest.approx(0.465e-6, rel=1e-3)
    both_ways = json.loads(Path("bench/results/cp_calibration_fwd_bwd_h200.json").read_text())
    measured = dataclasses.astuple(RankTimeFit.from_calibration(both_ways))
    assert measured == pytest.approx(dataclasses.astuple(RankTimeFit()), rel=1e-2)  # the defaults
    calibration["fits"]["backward_kernel_rate_slope"] = {
        "coef": {"fixed_s": 2e-3, "per_load_s": 1e-6, "per_needed_chunk_s": 3e-6}
    }
    both = RankTimeFit.from_calibration(calibration)
    assert both.backward_seconds(10.0, 2, Hardware()) == pytest.approx(2e-3 + 1e-5 + 6e-6)


def test_cost_model_stages_the_fetch_as_the_code_does():
    """2 ranks x 4 chunks, full mask: each rank needs the other's 4 chunks. Times by hand, in ms:
    a chunk's K/V takes 2 ms, its dK/dV 4 ms, each kernel call 3 ms (fixed cost only)."""
    from flashmask3.distributed.cost_model import Hardware, RankTimeFit, predict

    chunk_bytes = 2 * 128 * 64 * 2
    fit = RankTimeFit(3e-3, 0.0, 0.0, *_BACKWARD_AS_FORWARD)
    hw = Hardware(ranks_per_node=8, nvlink_bps=chunk_bytes * 500, inter_node_bps=chunk_bytes * 50)
    mask, plan = masks.build("full", 1024), make_plan(1024, 2, 4, "contiguous")
    keys = ("forward_s", "backward_s", "total_s", "compute_s", "comm_s", "hidden_s")

    def modeled(stage_chunks):
        result = predict(mask, plan, "mask_aware", 1, 1, 64, hw, fit=fit, stage_chunks=stage_chunks)
        (times,) = {tuple(round(r[k] * 1e3, 9) for k in keys) for r in result["per_rank"]}  # same on both
        return dict(zip(keys, times)), result

    # One stage (today's model): forward max(3, 8) + 3; backward 8 + 3 + max(3, 16).
    single, _ = modeled(None)
    assert single == dict(forward_s=11, backward_s=27, total_s=38, compute_s=12, comm_s=32, hidden_s=6)
    # Stages of one chunk, 4 of them, each one call of 3 ms (5 calls per direction with the own).
    # Forward: stage 0 under the own chunks, stage s+1 under stage s, the last stage alone:
    # max(3, 2) + 3 x max(3, 2) + 3. Backward: stage 0's K/V alone (2), then under stage s the
    # next stage's K/V and stage s-1's dK/dV: max(3, 2), max(3, 2 + 4) twice, max(3, 4); the last
    # stage's dK/dV under the own chunks: max(3, 4). Hidden: forward 2 + 3 x 2, backward 2 + 3 x 3 + 3.
    staged, result = modeled(1)
    assert staged == dict(
        forward_s=3 + 3 * 3 + 3,
        backward_s=2 + 3 + 6 + 6 + 4 + 4,
        total_s=40,
        compute_s=10 * 3,
        comm_s=2 * 4 * 2 + 4 * 4,
        hidden_s=8 + 14,
    )
    # K/V held at peak: the own 4 chunks plus two stages of one, against all 4 remote at once.
    assert result["stages"] == 4 and result["stage_chunks"] == 1
    assert (result["peak_kv_bytes"], result["single_stage_peak_kv_bytes"]) == (6 * chunk_bytes, 8 * chunk_bytes)
    # Stages of 2: 2 stages of 4 ms K/V, 8 ms dK/dV: forward max(3, 4) + max(3, 4) + 3, backward
    # 4 + max(3, 4) + max(3, 8) + max(3, 8); the peak: every remote chunk (two stages of 2).
    staged, result = modeled(2)
    assert (staged["forward_s"], staged["backward_s"]) == (11, 24)
    assert result["peak_kv_bytes"] == result["single_stage_peak_kv_bytes"] == 8 * chunk_bytes
    # A stage holding every remote chunk is today's model.
    for k in (4, 100):
        assert modeled(k)[0] == single


def test_cost_model_takes_the_stages_in_ring_order():
    """4 ranks x 1 chunk, full mask, stages of one chunk, times in ms as above (K/V 2 per chunk,
    dK/dV 4, a call 3). In ring order every rank sends one chunk and receives one in each of the
    3 stages, so all ranks model alike: forward max(3, 2) x 3 + 3, backward 2 + max(3, 2) +
    max(3, 2 + 4) + max(3, 4) + max(3, 4). In chunk order rank 0 would send chunk 0 to all three
    others in stage 0 (6 ms under its own chunk)."""
    from flashmask3.distributed.cost_model import Hardware, RankTimeFit, predict

    chunk_bytes = 2 * 128 * 64 * 2
    fit = RankTimeFit(3e-3, 0.0, 0.0, *_BACKWARD_AS_FORWARD)
    hw = Hardware(ranks_per_node=8, nvlink_bps=chunk_bytes * 500, inter_node_bps=chunk_bytes * 50)
    mask, plan = masks.build("full", 512), make_plan(512, 4, 1, "contiguous")
    result = predict(mask, plan, "mask_aware", 1, 1, 64, hw, fit=fit, stage_chunks=1)
    assert result["stages"] == 3
    for per_rank in result["per_rank"]:
        assert round(per_rank["forward_s"] * 1e3, 9) == 12 and round(per_rank["backward_s"] * 1e3, 9) == 19
        assert round(per_rank["hidden_s"] * 1e3, 9) == 2 * 3 + 2 + 3 + 3 + 3


def test_cost_model_one_stage_is_the_single_stage_model_and_stages_hold_less():
    """On a document mask at CP 4 (one node: flat routing either way), with the fitted rank time:
    stages as large as the most remote chunks a rank needs give today's numbers on every rank;
    stages of one chunk hold, per rank, the own K/V plus the two largest consecutive stages."""
    from flashmask3.distributed.cost_model import Hardware, RankTimeFit, predict

    mask = masks.build("causal_document", 16384, num_docs=6, seed=1)
    plan = make_plan(16384, 4, 4, "balanced", chunk_loads(mask, 1024))
    layout = context_parallel._Layout(mask, plan, CPConfig())
    remote = [len([c for c in layout.needed(r, range(16)) if plan.owner(c) != r]) for r in range(4)]
    assert max(remote) > 2
    args = (mask, plan, "mask_aware", 32, 8, 128, Hardware(), 2, RankTimeFit())
    single = predict(*args)
    for k in (max(remote), 16):
        staged = predict(*args, stage_chunks=k)
        assert staged["stages"] == 1
        for before, after in zip(single["per_rank"], staged["per_rank"]):
            assert {key: after[key] for key in before} == pytest.approx(before, rel=1e-12)
            assert after["peak_kv_bytes"] == after["single_stage_peak_kv_bytes"]
    staged = predict(*args, stage_chunks=1)
    chunk_bytes = 2 * 1024 * 8 * 128 * 2
    stages = context_parallel._Layout(mask, plan, CPConfig(stage_chunks=1)).stages
    assert staged["stages"] == len(stages) == max(remote)
    for r, per_rank in enumerate(staged["per_rank"]):
        got = [sum(len(chunks) for (_, dst), chunks in stage.items() if dst == r) for stage in stages]
        pairs = max(a + b for a, b in zip(got, got[1:] + [0]))
        assert per_rank["peak_kv_bytes"] == (4 + pairs) * chunk_bytes <= (4 + min(2, remote[r])) * chunk_bytes
        assert per_rank["single_stage_peak_kv_bytes"] == (4 + remote[r]) * chunk_bytes
    assert staged["peak_kv_bytes"] == 6 * chunk_bytes < staged["single_stage_peak_kv_bytes"]
    # What the code does not stage, the model does not either.
    with pytest.raises(ValueError, match="does not go with scheme='ring'"):
        predict(mask, plan, "ring", 32, 8, 128, stage_chunks=1)
    with pytest.raises(ValueError, match="does not go with hold_remote_kv=True"):
        predict(*args, hold_remote_kv=True, stage_chunks=1)


def test_cp_report_adds_the_staged_model_only_when_asked(tmp_path, monkeypatch, capsys):
    """scripts/cp_report.py --model: no staged columns unless --stage-chunks (the committed JSON
    stays as it is); with it, the staged TFLOP/s, overlap and peak K/V MB, the one-stage model's
    columns unchanged."""
    import json
    import sys

    import cp_report
    from flashmask3.distributed.cost_model import Hardware, RankTimeFit, predict

    argv = ["cp_report.py", "--tokens-per-rank", "1024", "--ranks", "4", "--chunk", "256", "--masks", "full"]
    argv += ["--model"]
    rows = {}
    for extra in ([], ["--stage-chunks", "2"]):
        out = tmp_path / f"report{len(extra)}.json"
        monkeypatch.setattr(sys, "argv", [*argv, *extra, "--out", str(out)])
        cp_report.main()
        record = json.loads(out.read_text())
        (rows[bool(extra)],) = record["rows"]
        assert record["model"].get("stage_chunks") == (2 if extra else None)
    assert not any(key.startswith("mask_aware_staged") for key in rows[False])
    staged = {k: v for k, v in rows[True].items() if k not in rows[False]}
    assert {k: rows[True][k] for k in rows[False] if k != "balance_s"} == pytest.approx(
        {k: v for k, v in rows[False].items() if k != "balance_s"}
    )
    # 4 ranks x 4 chunks of 256 tokens, full mask: 12 remote chunks per rank, 8 KV heads x 128, bf16.
    chunk_mb = 2 * 256 * 8 * 128 * 2 / 2**20
    assert staged["mask_aware_staged_peak_kv_mb"] == pytest.approx((4 + 2 * 2) * chunk_mb)
    assert staged["mask_aware_single_stage_peak_kv_mb"] == pytest.approx((4 + 12) * chunk_mb)
    mask = masks.build("full", 4096, seed=0)
    plan = make_plan(4096, 4, 4, "balanced", chunk_loads(mask, 256))
    pred = predict(mask, plan, "mask_aware", 32, 8, 128, Hardware(), fit=RankTimeFit(), stage_chunks=2)
    assert staged["mask_aware_staged_overlap"] == pytest.approx(pred["overlap_efficiency"], rel=1e-3)
    monkeypatch.setattr(sys, "argv", [*argv[:-1], "--stage-chunks", "2"])
    with pytest.raises(SystemExit):
        cp_report.main()
    assert "--stage-chunks takes a positive int and goes with --model" in capsys.readouterr().err


def test_layouts_taking_turns_are_all_kept():
    """Schemes (configs) and masks alternating, as a benchmark's turns or a model with two masks
    do: each layout is built once, so a steady-state call plans nothing."""
    plan = make_plan(512, 4, 2, "contiguous")
    two_masks = [masks.build(name, 512, seed=0) for name in ("document", "causal_document")]
    configs = [CPConfig(), CPConfig(scheme="ring"), CPConfig(stage_chunks=1)]
    first = {
        (i, j): context_parallel._layout_for(m, plan, c) for i, m in enumerate(two_masks) for j, c in enumerate(configs)
    }
    for _ in range(3):
        for (i, j), layout in first.items():
            assert context_parallel._layout_for(two_masks[i], plan, configs[j]) is layout
    # A ColumnMask rebuilt around the same tensor (as the custom ops do) shares its layout.
    again = ColumnMask(two_masks[0].startend_row_indices, False, 512)
    assert context_parallel._layout_for(again, plan, configs[0]) is first[0, 0]


def test_layout_is_reused_and_rebuilt_after_an_in_place_mask_edit():
    mask = masks.build("document", 512, num_docs=4, seed=0)
    plan = make_plan(512, 4, 2, "contiguous")
    first = context_parallel._layout_for(mask, plan, CPConfig())
    assert context_parallel._layout_for(mask, plan, CPConfig()) is first
    mask.startend_row_indices[..., 1] = 0  # every key now visible to all earlier rows
    rebuilt = context_parallel._layout_for(mask, plan, CPConfig())
    assert rebuilt is not first and not np.array_equal(rebuilt.needs, first.needs)
    with torch.inference_mode():  # no version to check: built at every call
        inferred = masks.build("document", 512, num_docs=4, seed=0)
    once, twice = (context_parallel._layout_for(inferred, plan, CPConfig()) for _ in range(2))
    assert once is not twice and np.array_equal(once.needs, twice.needs)
    assert np.array_equal(
        once.needs,
        context_parallel._layout_for(masks.build("document", 512, num_docs=4, seed=0), plan, CPConfig()).needs,
    )
