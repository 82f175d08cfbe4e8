"""Context parallelism: plans, localization, the balancer, and CP attention on gloo processes."""

import itertools
import os
import socket

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import flashmask3 as fm
from conftest import random_column_mask
from flashmask3.distributed import (
    ContextParallelAttention,
    context_parallel,
    CPConfig,
    CPPlan,
    balance,
    chunk_loads,
    contiguous_assignment,
    cp_attention,
    imbalance,
    local_rows_below,
    localize,
    make_plan,
    zigzag_assignment,
)
from flashmask3.reference import ColumnMask, masks
from flashmask3.verify import random_inputs

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
        if not rest:
            best = min(best, worst)
            return
        for group in itertools.combinations(rest[1:], k - 1):
            group = (rest[0], *group)
            search([c for c in rest if c not in group], max(worst, loads[list(group)].sum()))

    search(list(range(len(loads))), 0.0)
    return best


@pytest.mark.parametrize("world, per_rank", [(2, 2), (2, 4), (3, 2), (3, 3), (4, 2)])
def test_balancer_is_optimal_on_small_cases(world, per_rank):
    rng = np.random.default_rng(world * 10 + per_rank)
    for _ in range(8):
        loads = rng.integers(1, 1000, world * per_rank).astype(float)
        assignment = balance(loads, world)
        assert sorted(c for r in assignment for c in r) == list(range(len(loads)))
        assert {len(r) for r in assignment} == {per_rank}
        got = max(loads[list(r)].sum() for r in assignment)
        assert got == pytest.approx(brute_force_max_load(loads, world), rel=2e-3)


@pytest.mark.parametrize("name", ["causal", "causal_document", "share_question", "random_eviction"])
def test_balancer_beats_contiguous_and_zigzag(name):
    mask = masks.build(name, 16384, seed=2)
    loads = chunk_loads(mask, 256)
    assert loads.sum() == pytest.approx(
        float(chunk_loads(mask, 16384)[0]), rel=1e-6)  # loads add up
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, result_dir, assignment):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    seqlen, lines = 512, []
    for i, name in enumerate(masks.MASK_NAMES):
        mask = masks.build(name, seqlen, batch=1, heads=4, seed=i)
        q, k, v, dout = random_inputs(1, seqlen, seqlen, 4, 2, 16, torch.float64, seed=i)
        ins = [x.clone().requires_grad_() for x in (q, k, v)]
        ref = fm.attention(*ins, mask, backend="reference")
        ref_grads = torch.autograd.grad(ref, ins, dout)
        loads = chunk_loads(mask, 32, tile=32) if assignment == "balanced" else None
        plan = make_plan(seqlen, world, 16 // world, assignment, loads)
        for scheme, options in CASES:
            if options.get("ranks_per_node") and world < 4:
                continue
            local = [plan.shard(x, rank).clone().requires_grad_() for x in (q, k, v)]
            out = cp_attention(*local, mask, plan, config=CPConfig(scheme=scheme, **options))
            grads = torch.autograd.grad(out, local, plan.shard(dout, rank))
            err = max([(out - plan.shard(ref, rank)).abs().max().item()]
                      + [(g - plan.shard(r, rank)).abs().max().item() for g, r in zip(grads, ref_grads)])
            lines.append(f"{name} {scheme} {options} {err:.3e}")
    with open(os.path.join(result_dir, f"rank{rank}.txt"), "w") as f:
        f.write("\n".join(lines))
    dist.destroy_process_group()


@pytest.mark.parametrize("world, assignment", [(2, "zigzag"), (4, "zigzag"), (4, "balanced")])
def test_cp_attention_equals_single_device(tmp_path, world, assignment):
    mp.spawn(_worker, args=(world, free_port(), str(tmp_path), assignment), nprocs=world, join=True)
    rows = []
    for rank in range(world):
        rows += (tmp_path / f"rank{rank}.txt").read_text().splitlines()
    expected = len(masks.MASK_NAMES) * (len(CASES) - (1 if world < 4 else 0))
    assert len(rows) == world * expected
    bad = [r for r in rows if float(r.rsplit(" ", 1)[1]) > 1e-10]
    assert not bad, bad[:5]


def _pruning_worker(rank, world, port, result_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    cp = context_parallel
    mask = masks.build("document", 512, num_docs=4, seed=0)
    q, k, v, _ = random_inputs(1, 512, 512, 2, 2, 16, torch.float32)
    plan = make_plan(512, world, 2, "contiguous")
    sent = {}
    for name, config in [("pruned", CPConfig()), ("unpruned", CPConfig(prune=False)),
                         ("allgather", CPConfig(scheme="allgather")),
                         ("hierarchical", CPConfig(ranks_per_node=2, prune=False))]:
        cp_attention(*(plan.shard(x, rank) for x in (q, k, v)), mask, plan, config=config)
        sent[name] = cp.last_stats.bytes_sent
    layer = ContextParallelAttention(config=CPConfig(scheme="ring"))
    local = [plan.shard(x, rank) for x in (q, k, v)]
    same = torch.equal(layer(*local, mask, plan), cp_attention(*local, mask, plan, config=CPConfig(scheme="ring")))
    with open(os.path.join(result_dir, f"rank{rank}.txt"), "w") as f:
        f.write(" ".join(f"{k}={v}" for k, v in sent.items()) + f" module_matches={int(same)}")
    dist.destroy_process_group()


def test_pruning_sends_fewer_bytes(tmp_path):
    mp.spawn(_pruning_worker, args=(4, free_port(), str(tmp_path)), nprocs=4, join=True)
    totals = {}
    for rank in range(4):
        for item in (tmp_path / f"rank{rank}.txt").read_text().split():
            key, value = item.split("=")
            totals[key] = totals.get(key, 0) + int(value)
    chunk_bytes = 2 * 64 * 2 * 16 * 4  # k and v of one 64-token chunk, 2 heads x 16, fp32
    assert totals["module_matches"] == 4  # the module is the function on every rank
    assert totals["unpruned"] == totals["allgather"] == 4 * 3 * 2 * chunk_bytes
    # Pruned: exactly the chunks a receiver's queries see some of (from the dense mask).
    mask, plan = masks.build("document", 512, num_docs=4, seed=0), make_plan(512, 4, 2, "contiguous")
    dense = mask.to_dense()[0, 0]
    needed = sum(
        bool(dense[plan.token_index(r)][:, c * 64:(c + 1) * 64].any())
        for r in range(4) for c in range(8) if plan.owner(c) != r
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
        return sum(len(chunks) for phase in layout.phases for (src, dst), chunks in phase.items()
                   if node(src) != node(dst))

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


def test_fitted_rank_time_replaces_the_tile_rate_for_mask_aware_compute():
    from flashmask3.distributed.cost_model import Hardware, RankTimeFit, predict

    mask = masks.build("share_question", 8192, seed=2)
    loads = chunk_loads(mask, 1024)
    plan = make_plan(8192, 4, 2, "balanced", loads)
    layout = context_parallel._Layout(mask, plan, CPConfig())
    fit = RankTimeFit(fixed_s=1e-3, per_load_s=2e-6, per_needed_chunk_s=5e-5)
    result = predict(mask, plan, "mask_aware", 32, 8, 128, Hardware(), fit=fit, loads=loads)
    for rank, per_rank in enumerate(result["per_rank"]):
        expected = 1e-3 + 2e-6 * loads[list(plan.assignment[rank])].sum() + 5e-5 * sum(layout.needs[rank])
        assert per_rank["compute_s"] == pytest.approx(expected, rel=1e-9)


def test_layout_is_reused_and_rebuilt_after_an_in_place_mask_edit():
    mask = masks.build("document", 512, num_docs=4, seed=0)
    plan = make_plan(512, 4, 2, "contiguous")
    first = context_parallel._layout_for(mask, plan, CPConfig())
    assert context_parallel._layout_for(mask, plan, CPConfig()) is first
    mask.startend_row_indices[..., 1] = 0  # every key now visible to all earlier rows
    rebuilt = context_parallel._layout_for(mask, plan, CPConfig())
    assert rebuilt is not first and rebuilt.needs != first.needs
