"""Bad input wherever a user can reach: each error names the argument and the accepted values."""

import pytest
import torch

import flashmask3 as fm
from flashmask3.reference import ColumnMask, masks


@pytest.mark.parametrize(
    "name, params, match",
    [
        ("sliding_window", {"window": 0}, r"window \(mask 'sliding_window', seqlen 256\) must be an int >= 1, got 0"),
        ("sliding_window", {"window": -3}, r"window .* must be an int >= 1, got -3"),
        ("sliding_window", {"window": 2.5}, r"window .* must be an int >= 1, got 2.5"),
        ("global_sliding_window", {"window": -1}, r"window .* must be an int >= 0, got -1"),
        ("global_sliding_window", {"global_tokens": -1}, r"global_tokens .* must be an int >= 0, got -1"),
        ("prefix_lm_causal", {"prefix": -1}, r"prefix .* must be an int in \[0, 256\], got -1"),
        ("prefix_lm_causal", {"prefix": 257}, r"prefix .* must be an int in \[0, 256\], got 257"),
        ("document", {"num_docs": -2}, r"num_docs .* must be an int in \[1, 256\], got -2"),
        ("causal_document", {"num_docs": 0}, r"num_docs .* must be an int in \[1, 256\], got 0"),
        ("share_question", {"num_docs": 300}, r"num_docs .* must be an int in \[1, 256\], got 300"),
        ("random_eviction", {"evict_start": 0}, r"evict_start .* must be an int in \[1, 256\], got 0"),
        ("random_eviction", {"evict_start": 257}, r"evict_start .* must be an int in \[1, 256\], got 257"),
        ("document", {"num_doc": 3}, "mask 'document' takes no parameter 'num_doc'; its parameters: num_docs"),
        ("causal", {"window": 8}, "mask 'causal' takes no parameter 'window'; its parameters: none"),
        ("random_eviction", {"batch": 0}, "batch must be an int >= 1, got 0"),
        ("random_eviction", {"heads": 0}, "heads must be an int >= 1, got 0"),
        ("causal", {"seed": -1}, "seed must be an int >= 0, got -1"),
    ],
)
def test_masks_build_names_a_bad_parameter_and_its_range(name, params, match):
    with pytest.raises(ValueError, match=match):
        masks.build(name, 256, **params)


def test_masks_build_keeps_defaults_and_the_ends_of_each_range():
    assert masks.build("sliding_window", 256, window=None) == masks.build("sliding_window", 256)
    assert masks.build("sliding_window", 256, window=1).to_dense()[0, 0].sum() == 256  # the diagonal
    assert masks.build("global_sliding_window", 256, window=0, global_tokens=4) == (
        ColumnMask.global_sliding_window(256, window=0, global_tokens=4))
    assert masks.build("document", 256, num_docs=256).to_dense()[0, 0].equal(torch.eye(256, dtype=torch.bool))
    assert masks.build("prefix_lm_causal", 256, prefix=256).to_dense().all()
    evict_none = masks.build("random_eviction", 256, evict_start=256)
    assert evict_none.to_dense()[0, 0].equal(torch.ones(256, 256, dtype=torch.bool).tril())
    assert masks.build("random_eviction", 256, evict_start=1).to_dense()[0, 0, 255].sum() == 1


def qkv(batch=1, sq=8, sk=8, hq=2, hkv=2, d=16):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(batch, sq, hq, d, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(batch, sk, hkv, d, generator=gen, dtype=torch.float64) for _ in range(2))
    return q, k, v


@pytest.mark.parametrize("backend", ["auto", "reference", "sdpa", "flex", "cute"])
@pytest.mark.parametrize("form", ["no mask", "mask", "causal", "window"])
def test_no_keys_give_zero_and_minus_inf_on_every_backend(backend, form):
    q, k, v = (x.requires_grad_() for x in qkv(sk=0))
    kwargs = {
        "no mask": {},
        "mask": {"mask": ColumnMask(torch.zeros(1, 1, 0, 1, dtype=torch.int32), True, 8)},
        "causal": {"causal": True},
        "window": {"window_size": (2, 2)},
    }[form]
    out, lse = fm.attention(q, k, v, backend=backend, return_lse=True, **kwargs)
    assert out.shape == q.shape and not out.any() and lse.shape == (1, 2, 8) and (lse == -torch.inf).all()
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    assert not dq.any() and dk.shape == k.shape and dv.shape == v.shape


def test_empty_batch_and_queries_give_empty_results():
    for q, k, v in (qkv(batch=0), qkv(sq=0)):
        out, lse = fm.attention(q, k, v, return_lse=True)
        assert out.shape == q.shape and lse.shape == (q.shape[0], 2, q.shape[1])


@pytest.mark.parametrize(
    "shapes, match",
    [
        ({"d": 0}, r"q head dim \(D of \[B, S, H, D\]\) must be >= 1, got shape \(1, 8, 2, 0\)"),
        ({"hq": 0, "hkv": 0}, r"q heads \(H of \[B, S, H, D\]\) must be >= 1, got shape \(1, 8, 0, 16\)"),
        ({"hkv": 0}, r"k heads \(H of \[B, S, H, D\]\) must be >= 1, got shape \(1, 8, 0, 16\)"),
    ],
)
def test_zero_heads_or_head_dim_are_refused_by_name(shapes, match):
    with pytest.raises(ValueError, match=match):
        fm.attention(*qkv(**shapes))


def test_a_dense_mask_points_to_from_dense():
    q, k, v = qkv()
    with pytest.raises(TypeError, match=r"got a torch.bool tensor of shape \(8, 8\); .*ColumnMask.from_dense"):
        fm.attention(q, k, v, torch.ones(8, 8, dtype=torch.bool))


def test_mask_batch_and_head_errors_list_each_accepted_count_once():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="startend_row_indices batch dim must be 1, got 2$"):
        fm.attention(q, k, v, masks.build("causal", 8, batch=2))
    with pytest.raises(ValueError, match=r"head dim must be 1 or 2 \(q heads\), got 3$"):
        fm.attention(q, k, v, masks.build("random_eviction", 8, heads=3))
    with pytest.raises(ValueError, match=r"head dim must be 1, 2 \(kv heads\) or 4 \(q heads\), got 3$"):
        fm.attention(*qkv(hq=4), masks.build("random_eviction", 8, heads=3))


def test_cute_on_a_gpu_that_is_not_hopper_names_its_capability(monkeypatch):
    from types import SimpleNamespace

    from flashmask3.optimized import interface

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    q = SimpleNamespace(is_cuda=True, device="cuda:0", dtype=torch.bfloat16, shape=(1, 128, 2, 128))
    with pytest.raises(NotImplementedError, match=r"Hopper GPU \(sm_90\), got NVIDIA A100.*compute capability 8.0 \(sm_80\)"):
        interface.cute_attention(q, q, q, None, 0.1)
