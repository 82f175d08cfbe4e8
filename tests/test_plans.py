"""The per-mask plans apart from the launch (optimized/plans.py), and `prepare_mask`, on the CPU:
the kernels' launches faked, the GPU's SM count given."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from flashmask3.optimized import interface, plans, segments, tile_plan
from flashmask3.reference import ColumnMask, masks

from flashmask3 import prepare_mask

SMS = 132


def _launches(monkeypatch) -> dict[str, list]:
    """Each faked launch's (config, tensors), the `Contiguous` arguments' tensors unwrapped."""
    launched: dict[str, list] = {}

    def launch(direction, *args, **kw):
        tensors = [t.tensor if isinstance(t, interface.Contiguous) else t for t in args[5]]
        launched.setdefault(direction, []).append((args[4], tensors))

    monkeypatch.setattr(interface, "_launch", launch)
    monkeypatch.setattr(interface, "_sm_count", lambda device: SMS)
    return launched


def _train_call(mask: ColumnMask, deterministic: bool = False, heads: int = 16, kv_heads: int = 4) -> None:
    """The forward and backward of one training call (the kernels faked): q [1, S, 16, 128]."""
    seqlen = mask.seqlen_k
    q = torch.zeros(1, seqlen, heads, 128, dtype=torch.bfloat16)
    k = v = torch.zeros(1, seqlen, kv_heads, 128, dtype=torch.bfloat16)
    out, lse = interface.forward(q, k, v, mask, 0.1)
    interface.backward(q, q, k, v, out, lse, mask, 0.1, deterministic)


def test_a_call_without_a_mask_validates_none(monkeypatch):
    """Without a mask the kernels run on a stand-in full mask: made unchecked, since a validation
    reads the boundaries back, one wait for the GPU per call, forward and backward."""
    launched = _launches(monkeypatch)
    monkeypatch.setattr(ColumnMask, "__post_init__", lambda self: pytest.fail("a mask was validated at the call"))
    q = torch.zeros(1, 1024, 16, 128, dtype=torch.bfloat16)
    k = v = torch.zeros(1, 1024, 4, 128, dtype=torch.bfloat16)
    out, lse = interface.forward(q, k, v, None, 0.1)
    interface.backward(q, q, k, v, out, lse, None, 0.1)
    assert set(launched) == {"fwd", "bwd_pre", "bwd", "bwd_post"}


def test_calls_without_a_mask_share_one_stand_in_and_its_key_block_bounds(monkeypatch):
    """The full mask standing in for no mask is kept per (Sq, Sk, device): later calls launch with
    the same boundaries and key-block min/max, made once (no small kernels per call); another Sk
    has its own."""
    launched = _launches(monkeypatch)
    q = torch.zeros(1, 1024, 16, 128, dtype=torch.bfloat16)
    k = torch.zeros(1, 1024, 4, 128, dtype=torch.bfloat16)
    for keys in (k, k, k[:, :512]):
        interface.forward(q, keys, keys, None, 0.1)
    (_, first), (_, second), (_, shorter) = launched["fwd"]
    assert first[5] is second[5] and first[6] is second[6]  # boundaries, key-block min/max
    assert shorter[5].shape[2] == 512 and shorter[6] is not first[6]


@pytest.mark.parametrize("name, deterministic", [("causal_document", False), ("document", False), ("document", True)])
def test_a_prepared_mask_launches_with_the_plans_made_where_it_was_built(monkeypatch, name, deterministic):
    """The plans computed on the host mask (`plans.plan_mask`) travel with its copy
    (`tile_plan.moved_plans`, here a clone standing in for the GPU copy): the forward and backward
    on the copy compute none of them (the segment plan, the key blocks' min/max, the orders, the
    split table) and launch with the same configurations and tensors as a mask planned at the call."""
    launched = _launches(monkeypatch)
    host = masks.build(name, 8192, seed=3)
    plans.plan_mask(host, 1, 16, 4, 128, SMS, deterministic)
    copy = ColumnMask._unchecked(host.startend_row_indices.clone(), host.causal, host.seqlen_q, host.segmented)
    tile_plan.moved_plans(host, copy, torch.clone)

    fresh = ColumnMask._unchecked(host.startend_row_indices.clone(), host.causal, host.seqlen_q, host.segmented)
    _train_call(fresh, deterministic)
    planned_at_call = {direction: calls[-1] for direction, calls in launched.items()}

    def computed(*args, **kwargs):
        raise AssertionError("a plan was computed at the call")

    for module, function in (
        (segments, "segment_plan"),
        (tile_plan, "block_minmax"),
        (tile_plan, "longest_first"),
        (plans, "backward_split_plan"),
        (plans, "dq_ranks"),
    ):
        monkeypatch.setattr(module, function, computed)
    _train_call(copy, deterministic)
    for direction in ("fwd", "bwd"):
        (config, tensors), (config_at_call, tensors_at_call) = launched[direction][-1], planned_at_call[direction]
        assert config == config_at_call
        plan_tensors = [5, 6, 8, 9] if direction == "fwd" else [9, 10, 11, 13, 14, 16]  # bounds, orders, tables
        for i in plan_tensors:
            mine, theirs = tensors[i], tensors_at_call[i]
            assert (mine is None) == (theirs is None), (direction, i)
            assert mine is None or torch.equal(mine, theirs), (direction, i)
    bwd_tensors = launched["bwd"][-1][1]
    assert (bwd_tensors[16] is not None) == (name == "causal_document")  # causal documents split their long CTAs


def test_moved_plans_leave_out_what_an_in_place_change_made_stale(monkeypatch):
    _launches(monkeypatch)
    host = masks.build("causal_document", 2048, seed=1)
    plans.plan_mask(host, 1, 16, 4, 128, SMS)
    host.startend_row_indices[..., 0] = 2048  # now causal
    copy = ColumnMask._unchecked(host.startend_row_indices.clone(), host.causal, host.seqlen_q, host.segmented)
    tile_plan.moved_plans(host, copy, torch.clone)
    assert not tile_plan._per_mask.get(id(copy.startend_row_indices))


def test_a_plan_of_a_kind_that_cannot_be_moved_is_an_error():
    host = masks.build("causal", 512)
    tile_plan.kept_per_mask(host, "odd", lambda: [torch.zeros(1)])  # a list: its tensors would stay behind
    copy = ColumnMask._unchecked(host.startend_row_indices.clone(), host.causal, host.seqlen_q)
    with pytest.raises(TypeError, match="a kept plan of type list cannot be moved"):
        tile_plan.moved_plans(host, copy, torch.clone)


def test_prepare_mask_names_a_bad_argument():
    mask = ColumnMask(torch.full((2, 4, 1024, 1), 1024, dtype=torch.int32), True, 1024)  # causal, 4 heads
    shape = dict(batch=2, q_heads=8, kv_heads=4, head_dim=128)
    for change, message in (
        (dict(batch=3), "batch dim must be"),
        (dict(q_heads=6), "q_heads \\(6\\) must be a multiple of kv_heads \\(4\\)"),
        (dict(kv_heads=0), "kv_heads must be an int >= 1, got 0"),
        (dict(batch=True), "batch must be an int >= 1, got True"),
        (dict(head_dim="x"), "head_dim must be an int >= 1, got 'x'"),
        (dict(head_dim=-1), "head_dim must be an int >= 1, got -1"),
        (dict(q_heads=16, kv_heads=8), "head dim must be"),
    ):
        with pytest.raises(ValueError, match=message):
            prepare_mask(mask, "cpu", **(shape | change))
    with pytest.raises(TypeError, match="deterministic must be a bool, got str"):
        prepare_mask(mask, "cpu", **shape, deterministic="x")
    with pytest.raises(TypeError, match="mask must be a ColumnMask, got Tensor"):
        prepare_mask(mask.startend_row_indices, "cpu", **shape)
    assert prepare_mask(mask, "cpu", **shape) is mask  # already there, and no kernel runs on a CPU
    numpy_shape = {name: np.int64(value) for name, value in shape.items()}
    assert prepare_mask(mask, "cpu", **numpy_shape, deterministic=True) is mask


def test_counted_key_tiles_only_without_a_mask_over_whole_key_tiles():
    """`counted_keys` (the readers count the key tiles), the choice for plain calls but the causal
    one at 192-row tiles (head dim 64), stays in the plan of a call without a mask, or with the
    causal one alone, whose keys fill whole tiles; any mask or a ragged last key tile keeps the
    list."""
    for head_dim in (64, 128, 192, 256):
        assert interface.mask_configs(head_dim, None)[0].counted_keys
        assert interface.mask_configs(head_dim, None, causal=True)[0].counted_keys == (head_dim != 64)
        causal_mask = masks.build("causal", 1024, batch=1, heads=1, seed=0)
        assert not interface.mask_configs(head_dim, causal_mask)[0].counted_keys  # a mask given
    config = interface.mask_configs(128, None)[0]
    no_mask = tile_plan.full_mask(1024, 2048, "cpu")
    assert plans.forward_plan(no_mask, config, 2, 4, SMS, uniform_work=True, plain=True).config == config
    kept_list = dataclasses.replace(config, counted_keys=False)
    ragged = tile_plan.full_mask(1024, 2000, "cpu")
    assert plans.forward_plan(ragged, config, 2, 4, SMS, uniform_work=True, plain=True).config == kept_list
    causal = masks.build("causal", 2048, batch=1, heads=1, seed=0)
    for head_dim in (128, 64):  # asked for at 64 too (an ablation), the plan keeps it
        causal_config = dataclasses.replace(interface.mask_configs(head_dim, causal)[0], counted_keys=True)
        assert plans.forward_plan(causal, causal_config, 1, 4, SMS, plain=True).config.counted_keys
        assert not plans.forward_plan(causal, causal_config, 1, 4, SMS).config.counted_keys  # a mask given
