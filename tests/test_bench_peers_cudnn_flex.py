"""The `cudnn_flex` peer on CPU: its interval mask, and what it passes to `cudnn.flex_attention`, which a
stand-in module takes in place of cuDNN's (its kernels need a Hopper or Blackwell GPU)."""

import sys
import types

import pytest
import torch
from conftest import random_column_mask
from flashmask3.reference import masks, reference_attention

from flashmask3 import bench_peers


def interval_mask(mask_func: torch.Tensor, seqlen_k: int) -> torch.Tensor:
    """bool [Hmask, total_q, Sk] (True = attend) of cuDNN's `mask_func` [Hmask, nfunc, total_q], read
    as its planner reads it: interval i is [F_{2i-1}, F_{2i}) (its first [0, F_0)), the endpoints in
    [0, Sk] and nondecreasing, else a ValueError as cuDNN's."""
    hmask, nfunc, total_q = mask_func.shape
    ends = mask_func.long()
    if int(ends.min()) < 0 or int(ends.max()) > seqlen_k or bool((ends[:, 1:] < ends[:, :-1]).any()):
        raise ValueError("mask_func endpoints must lie in each row's local-K range and be nondecreasing")
    keys = torch.arange(seqlen_k)
    attend = torch.zeros(hmask, total_q, seqlen_k, dtype=torch.bool)
    for i in range((nfunc + 1) // 2):
        begin = ends[:, 2 * i - 1] if i else torch.zeros_like(ends[:, 0])
        attend |= (keys >= begin[..., None]) & (keys < ends[:, 2 * i][..., None])
    return attend


@pytest.mark.parametrize("name", masks.MASK_NAMES)
def test_mask_func_holds_each_sequence_and_query_head_of_the_mask(name):
    """Column b * S + i of mask head h holds query i of sequence b, for query head h's mask head;
    a mask of batch 1 serves every sequence."""
    seqlen, batch, heads = 203, 3, 4
    mask = masks.build(name, seqlen, batch=1 if name == "causal" else batch, heads=heads, seed=1)
    mask_func = bench_peers.cudnn_flex_mask_func(mask, batch, heads)
    hmask = heads if name == "random_eviction" else 1
    assert mask_func.dtype == torch.int32 and mask_func.is_contiguous()
    assert mask_func.shape[0] == hmask and mask_func.shape[1] % 2 == 1 and mask_func.shape[2] == batch * seqlen
    attend = interval_mask(mask_func, seqlen).view(hmask, batch, seqlen, seqlen).transpose(0, 1)
    assert torch.equal(attend, mask.to_dense().expand(batch, hmask, seqlen, seqlen))


def test_mask_heads_of_the_kv_heads_repeat_over_their_query_heads():
    mask = random_column_mask(torch.Generator().manual_seed(0), 2, 2, 50, 50, False, 4)
    attend = interval_mask(bench_peers.cudnn_flex_mask_func(mask, 2, 6), 50).view(6, 2, 50, 50).transpose(0, 1)
    assert torch.equal(attend, mask.to_dense().repeat_interleave(3, dim=1))


def test_mask_func_names_a_batch_or_heads_mismatch():
    mask = masks.build("random_eviction", 64, batch=2, heads=4)
    with pytest.raises(ValueError, match="mask batch must be 1 or batch=3, got 2"):
        bench_peers.cudnn_flex_mask_func(mask, 3, 4)
    with pytest.raises(ValueError, match="mask heads must divide heads=6, got 4"):
        bench_peers.cudnn_flex_mask_func(mask, 2, 6)


def test_masks_over_the_memory_budget_are_left_out_without_importing_cudnn(monkeypatch):
    """random_eviction needs the most intervals; at the budget its mask is taken, one endpoint per
    query row and head less and it is not, and the peer is then left out before cuDNN is imported."""
    seqlen, batch, heads = 256, 2, 2
    mask = masks.build("random_eviction", seqlen, batch=batch, heads=heads)
    nfunc = bench_peers.cudnn_flex_mask_func(mask, batch, heads).shape[1]
    needed = 4 * heads * batch * seqlen * nfunc
    monkeypatch.setattr(bench_peers, "CUDNN_FLEX_MASK_BYTES", needed)
    assert bench_peers.cudnn_flex_mask_func(mask, batch, heads).shape[1] == nfunc
    monkeypatch.setattr(bench_peers, "CUDNN_FLEX_MASK_BYTES", needed - 4 * heads * batch * seqlen)
    assert bench_peers.cudnn_flex_mask_func(mask, batch, heads) is None
    monkeypatch.setitem(sys.modules, "cudnn", None)  # an import would raise
    case = bench_peers.PeerCase("random_eviction", mask, batch, heads, 0.125)
    assert bench_peers.PEERS["cudnn_flex"](case) is None


class StandInFlexAttention(types.ModuleType):
    """`cudnn.flex_attention` as its API documents it: `create_mask_plan` checks its arguments as
    cuDNN's does (fixed-length BSHD q, k, v; mask_func [Hmask, nfunc, B * Sq]) and records them;
    `flex_attn_func` attends over the plan's intervals, differentiably, in plain PyTorch."""

    def __init__(self):
        super().__init__("cudnn.flex_attention")
        self.plans = []
        self.calls = []

    def create_mask_plan(self, mask_func, q, k, v, *, build_backward=None):
        batch, seqlen_q, heads_q, _ = q.shape
        assert q.dim() == k.dim() == v.dim() == 4 and k.shape[:2] == v.shape[:2] and k.shape[0] == batch
        assert mask_func.dtype == torch.int32 and mask_func.is_contiguous() and mask_func.device == q.device
        assert mask_func.dim() == 3 and mask_func.shape[0] in (1, heads_q) and mask_func.shape[1] % 2 == 1
        assert mask_func.shape[2] == batch * seqlen_q
        attend = interval_mask(mask_func, k.shape[1])
        plan = types.SimpleNamespace(
            attend=attend.view(-1, batch, seqlen_q, k.shape[1]).transpose(0, 1),
            build_backward=build_backward,
            geometry=(q.shape, k.shape, v.shape),
        )
        self.plans.append(plan)
        return plan

    def flex_attn_func(self, q, k, v, *, mask_plan, softmax_scale=None):
        self.calls.append((q, k, v, mask_plan, softmax_scale))
        assert mask_plan.geometry == (q.shape, k.shape, v.shape)
        group = q.shape[2] // k.shape[2]
        k, v = (x.repeat_interleave(group, dim=2) for x in (k, v))
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * softmax_scale
        scores = scores.masked_fill(~mask_plan.attend, float("-inf"))
        weights = torch.nan_to_num(scores.softmax(-1))  # a row that sees no key gives 0
        return torch.einsum("bhqk,bkhd->bqhd", weights, v)


def install_stand_in(monkeypatch) -> StandInFlexAttention:
    """`cudnn.flex_attention` replaced by the stand-in (and no wheel path set), for this test."""
    module = StandInFlexAttention()
    package = types.ModuleType("cudnn")
    package.flex_attention = module
    monkeypatch.setitem(sys.modules, "cudnn", package)
    monkeypatch.setitem(sys.modules, "cudnn.flex_attention", module)
    monkeypatch.delenv(bench_peers.CUDNN_FLEX_PATH_VARIABLE, raising=False)
    return module


@pytest.fixture
def stand_in(monkeypatch):
    return install_stand_in(monkeypatch)


@pytest.mark.parametrize("name, mask_heads", [("share_question", 1), ("random_eviction", 2), ("document", 1)])
def test_the_peer_passes_our_layout_and_runs_our_mask(stand_in, name, mask_heads):
    """q, k, v go through as they are ([B, S, H, D], no copy); the output and the gradients are
    those of our reference on the mask; one plan per geometry, with the backward's payloads when
    q, k or v need gradients."""
    batch, seqlen, heads_q, heads_kv, dim, scale = 2, 131, 4, 2, 16, 0.3
    mask = masks.build(name, seqlen, batch=batch, heads=mask_heads, seed=5)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(batch, seqlen, heads_q, dim, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(batch, seqlen, heads_kv, dim, generator=gen, dtype=torch.float64) for _ in range(2))
    run = bench_peers.PEERS["cudnn_flex"](bench_peers.PeerCase(name, mask, batch, heads_q, scale))

    out = run(q, k, v)
    assert torch.allclose(out, reference_attention(q, k, v, mask, scale)[0])
    assert all(passed is given for passed, given in zip(stand_in.calls[0], (q, k, v)))
    assert stand_in.calls[0][4] == scale and [plan.build_backward for plan in stand_in.plans] == [False]

    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    dout = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    for _ in range(2):
        grads = torch.autograd.grad(run(q, k, v), (q, k, v), dout)
    expected = torch.autograd.grad(reference_attention(q, k, v, mask, scale)[0], (q, k, v), dout)
    assert all(torch.allclose(ours, theirs) for ours, theirs in zip(grads, expected))
    assert [plan.build_backward for plan in stand_in.plans] == [False, True]
    assert len(stand_in.calls) == 3 and stand_in.calls[2][3] is stand_in.plans[1]


def test_cudnn_flex_is_imported_from_the_folder_the_variable_names(tmp_path, monkeypatch):
    """An unpacked frontend (`cudnn/` in the folder) is found first, before any installed one."""
    (tmp_path / "cudnn" / "flex_attention").mkdir(parents=True)
    (tmp_path / "cudnn" / "__init__.py").write_text("")
    (tmp_path / "cudnn" / "flex_attention" / "__init__.py").write_text("UNPACKED = True\n")
    monkeypatch.setenv(bench_peers.CUDNN_FLEX_PATH_VARIABLE, str(tmp_path))
    monkeypatch.setattr(sys, "path", list(sys.path))
    for name in ("cudnn", "cudnn.flex_attention"):  # removed again after the test
        monkeypatch.setitem(sys.modules, name, None)
        monkeypatch.delitem(sys.modules, name)
    module = bench_peers._import_peer(bench_peers.CUDNN_FLEX_PATH_VARIABLE, "cudnn.flex_attention")
    assert module.UNPACKED and module.__file__ == str(tmp_path / "cudnn" / "flex_attention" / "__init__.py")
