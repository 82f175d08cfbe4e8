"""Bad arguments to the mask conversions, the CP plan and balancer and CPConfig: each is refused by
name, with the accepted values, before any deep error or silently wrong result."""

import numpy as np
import pytest
import torch
from flashmask3.distributed import CPConfig, balance, chunk_loads, make_plan
from flashmask3.reference import ColumnMask, masks


def causal_mod(b, h, q, kv):
    return kv <= q


def test_from_dense_without_causal_falls_back_to_the_non_causal_variant():
    dense = torch.zeros(4, 4, dtype=torch.bool)
    dense[0, 0] = dense[2, 0] = True  # key 0: two masked runs, one more than the causal variant holds
    mask = ColumnMask.from_dense(dense)
    assert mask == ColumnMask.from_dense(dense, causal=False) and not mask.causal
    assert torch.equal(mask.to_dense()[0, 0], dense)
    causal = torch.tril(torch.ones(6, 6, dtype=torch.bool))
    assert ColumnMask.from_dense(causal) == ColumnMask.from_dense(causal, causal=True)  # still causal where it fits
    three_runs = torch.ones(6, 6, dtype=torch.bool)
    three_runs[[0, 2, 4], 3] = False  # fits neither variant
    with pytest.raises(ValueError, match="key column 3 .* 3 masked row runs"):
        ColumnMask.from_dense(three_runs)


@pytest.mark.parametrize(
    "args, error, match",
    [
        (([[True]],), TypeError, r"mask must be a bool torch.Tensor .*got list"),
        ((torch.ones(4, 4),), TypeError, r"mask must be a bool tensor .*got torch.float32"),
        ((torch.ones(2, 4, 4, dtype=torch.bool),), ValueError, r"mask must be \[Sq, Sk\] or \[B, H, Sq, Sk\]"),
        ((torch.ones(4, 0, dtype=torch.bool),), ValueError, r"mask must be .*every dim >= 1.*got shape \(4, 0\)"),
        ((torch.ones(0, 4, dtype=torch.bool),), ValueError, r"mask must be .*one query row.*got shape \(0, 4\)"),
        ((torch.ones(0, 1, 4, 4, dtype=torch.bool),), ValueError, r"mask must be .*got shape \(0, 1, 4, 4\)"),
        ((torch.ones(4, 4, dtype=torch.bool), "yes"), TypeError, r"causal must be a bool or None, got str"),
        ((torch.ones(4, 4, dtype=torch.bool), 1), TypeError, r"causal must be a bool or None, got int"),
    ],
)
def test_from_dense_refuses_bad_arguments_by_name(args, error, match):
    with pytest.raises(error, match=match):
        ColumnMask.from_dense(*args)


@pytest.mark.parametrize(
    "sizes, causal, error, match",
    [
        ((0, 1, 4, 4), None, ValueError, r"batch must be an int >= 1, got 0"),
        ((1, 0, 4, 4), None, ValueError, r"heads must be an int >= 1, got 0"),
        ((1, 1, -3, 4), None, ValueError, r"seqlen_q must be an int >= 1, got -3"),
        ((1, 1, 4, 0), None, ValueError, r"seqlen_k must be an int >= 1, got 0"),
        ((1, 1, 4.0, 4), None, ValueError, r"seqlen_q must be an int >= 1, got 4.0"),
        ((1, True, 4, 4), None, ValueError, r"heads must be an int >= 1, got True"),
        ((1, 1, 4, 4), "no", TypeError, r"causal must be a bool or None, got str"),
    ],
)
def test_from_mask_mod_refuses_bad_sizes_by_name(sizes, causal, error, match):
    with pytest.raises(error, match=match):
        ColumnMask.from_mask_mod(causal_mod, *sizes, causal=causal)


@pytest.mark.parametrize(
    "block_m, block_n, match",
    [
        (0, 16, r"block_m must be an int >= 1, got 0"),
        (16, 0, r"block_n must be an int >= 1, got 0"),
        (-1, 16, r"block_m must be an int >= 1, got -1"),
        (16, -1, r"block_n must be an int >= 1, got -1"),
        (16.0, 16, r"block_m must be an int >= 1, got 16.0"),
    ],
)
def test_block_classes_refuses_bad_tile_sizes_by_name(block_m, block_n, match):
    mask = masks.build("causal", 64)
    with pytest.raises(ValueError, match=match):
        mask.block_classes(block_m, block_n)
    with pytest.raises(ValueError, match=match):
        mask.block_skip(block_m, block_n)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(seqlen=64, world_size=0), ValueError, r"world_size must be an int >= 1, got 0"),
        (dict(seqlen=64, world_size=4, chunks_per_rank=0), ValueError, r"chunks_per_rank must be an int >= 1, got 0"),
        (dict(seqlen=0, world_size=4), ValueError, r"seqlen must be an int >= 1, got 0"),
        (dict(seqlen=60, world_size=4), ValueError, r"seqlen 60 must be a multiple of world_size \* chunks_per_rank"),
        (
            dict(seqlen=64, world_size=2, scheme="balanced", loads=[1.0, -2.0, 3.0, 4.0]),
            ValueError,
            r"loads must be finite and >= 0, got -2.0 for chunk 1",
        ),
        (
            dict(seqlen=64, world_size=2, scheme="balanced", loads=np.array([1.0, 2.0, np.nan, 4.0])),
            ValueError,
            r"loads must be finite and >= 0, got nan for chunk 2",
        ),
        (
            dict(seqlen=64, world_size=2, scheme="balanced", loads=[1.0, np.inf, 3.0, 4.0]),
            ValueError,
            r"loads must be finite and >= 0, got inf for chunk 1",
        ),
        (
            dict(seqlen=64, world_size=2, scheme="balanced", loads=[1.0, 2.0]),
            ValueError,
            r"loads must have one entry per chunk \(world_size \* chunks_per_rank = 4\), got 2",
        ),
        (
            dict(seqlen=64, world_size=2, scheme="zigzag", loads=[[1.0, 2.0], [3.0, 4.0]]),
            ValueError,
            r"loads must be 1-D",
        ),
        (
            dict(seqlen=64, world_size=2, scheme="balanced", loads=["heavy"] * 4),
            TypeError,
            r"loads must be a 1-D array or sequence of numbers",
        ),
    ],
)
def test_make_plan_refuses_bad_arguments_by_name(kwargs, error, match):
    with pytest.raises(error, match=match):
        make_plan(**kwargs)


@pytest.mark.parametrize(
    "loads, world_size, match",
    [
        ([1.0, 2.0], 0, r"world_size must be an int >= 1, got 0"),
        ([1.0, -1.0], 2, r"loads must be finite and >= 0, got -1.0 for chunk 1"),
        ([], 1, r"loads must be 1-D with one entry per chunk \(at least one\)"),
    ],
)
def test_balance_refuses_bad_arguments_by_name(loads, world_size, match):
    with pytest.raises(ValueError, match=match):
        balance(loads, world_size)


@pytest.mark.parametrize(
    "shape, rank, dim, error, match",
    [
        ((1, 64, 2, 4), 4, 1, ValueError, r"rank \(world_size 4\) must be an int in \[0, 3\], got 4"),
        ((1, 64, 2, 4), -1, 1, ValueError, r"rank \(world_size 4\) must be an int in \[0, 3\], got -1"),
        ((1, 48, 2, 4), 0, 1, ValueError, r"x must have the plan's seqlen 64 along dim 1 .*got shape \(1, 48, 2, 4\)"),
        ((1, 128, 2, 4), 0, 1, ValueError, r"x must have the plan's seqlen 64 along dim 1"),
        ((64, 2, 4), 0, 4, ValueError, r"dim \(x is 3-D\) must be an int in \[-3, 2\], got 4"),
        (None, 0, 1, TypeError, r"x must be a torch.Tensor, got list"),
    ],
)
def test_shard_refuses_a_bad_rank_or_sequence_length_by_name(shape, rank, dim, error, match):
    plan = make_plan(64, 4, 2, "zigzag")
    x = torch.zeros(shape) if shape is not None else [0.0] * 64
    with pytest.raises(error, match=match):
        plan.shard(x, rank, dim)
    assert plan.shard(torch.arange(64).view(64, 1), 3, 0).flatten().tolist() == [*range(24, 32), *range(32, 40)]


@pytest.mark.parametrize(
    "chunk_size, tile, match",
    [
        (0, 128, r"chunk_size must be an int >= 1, got 0"),
        (-128, 128, r"chunk_size must be an int >= 1, got -128"),
        (128, 0, r"tile must be an int >= 1, got 0"),
        (192, 128, r"chunk_size 192 must be a multiple of the tile 128"),
        (384, 128, r"seqlen_q 512 must be a multiple of chunk_size 384"),
    ],
)
def test_chunk_loads_refuses_a_bad_chunk_size_by_name(chunk_size, tile, match):
    with pytest.raises(ValueError, match=match):
        chunk_loads(masks.build("causal", 512), chunk_size, tile)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(scheme="ring_attention"), ValueError, r"unknown CP scheme 'ring_attention'; accepted: mask_aware, ring"),
        (dict(backend="flex"), ValueError, r"unknown CP backend 'flex'; accepted: auto, reference, cute"),
        (dict(prune="no"), TypeError, r"prune must be a bool, got str"),
        (dict(overlap=1), TypeError, r"overlap must be a bool, got int"),
        (dict(hold_remote_kv=None), TypeError, r"hold_remote_kv must be a bool, got NoneType"),
        (dict(ranks_per_node=0), ValueError, r"ranks_per_node must be a positive int or None, got 0"),
        (dict(ranks_per_node=True), ValueError, r"ranks_per_node must be a positive int or None, got True"),
        (dict(ranks_per_node="2"), ValueError, r"ranks_per_node must be a positive int or None, got '2'"),
        (dict(stage_chunks=0), ValueError, r"stage_chunks must be a positive int or None, got 0"),
        (dict(stage_chunks=False), ValueError, r"stage_chunks must be a positive int or None, got False"),
    ],
)
def test_cp_config_refuses_bad_fields_by_name(kwargs, error, match):
    with pytest.raises(error, match=match):
        CPConfig(**kwargs)


def test_cp_config_keeps_numpy_counts_as_ints():
    hierarchical = CPConfig(ranks_per_node=np.int64(2))
    staged = CPConfig(stage_chunks=np.int32(3))
    assert (hierarchical.ranks_per_node, staged.stage_chunks) == (2, 3)
    assert type(hierarchical.ranks_per_node) is int and type(staged.stage_chunks) is int
