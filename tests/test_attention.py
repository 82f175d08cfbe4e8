"""Reference attention against dense float64 SDPA: forward, LSE and gradients."""

import math

import pytest
import torch
from conftest import dense_attention, random_column_mask
from flashmask3.reference import masks
from flashmask3.verify import random_inputs
from hypothesis import given, settings
from hypothesis import strategies as st

import flashmask3 as fm
from flashmask3 import peers


def check_against_dense(mask, b, sq, sk, hq, hkv, d, seed=0):
    q, k, v, dout = random_inputs(b, sq, sk, hq, hkv, d, torch.float64, seed=seed)
    scale = 1 / math.sqrt(d)
    ins = [x.clone().requires_grad_() for x in (q, k, v)]
    out, lse = fm.attention(*ins, mask, backend="reference", return_lse=True)
    grads = torch.autograd.grad(out, ins, dout)
    ref_ins = [x.clone().requires_grad_() for x in (q, k, v)]
    dense = mask.to_dense() if mask is not None else torch.ones(1, 1, sq, sk, dtype=torch.bool)
    ref_out, ref_lse = dense_attention(*ref_ins, dense, scale)
    ref_grads = torch.autograd.grad(ref_out, ref_ins, dout)
    torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse.double(), ref_lse.float().double(), rtol=1e-6, atol=1e-6)
    for got, ref in zip(grads, ref_grads):
        torch.testing.assert_close(got, ref, rtol=1e-9, atol=1e-9)
    return out, lse, grads


@pytest.mark.parametrize("name", masks.MASK_NAMES)
def test_every_benchmark_mask_matches_dense_float64(name):
    mask = masks.build(name, 333, batch=2, heads=4, seed=5)
    check_against_dense(mask, 2, 333, 333, 4, 2, 32)


@pytest.mark.parametrize("name", ["causal_document", "document", "random_eviction", "share_question"])
def test_long_chunked_path_matches_dense(name):
    # 1300 rows: several query chunks, a ragged last key block, and gathered (non-contiguous) keys.
    mask = masks.build(name, 1300, batch=1, heads=2, seed=2)
    check_against_dense(mask, 1, 1300, 1300, 2, 1, 16)


def test_matches_torch_sdpa_backend():
    mask = masks.build("global_sliding_window", 500, batch=1, heads=2)
    q, k, v, _ = random_inputs(1, 500, 500, 4, 2, 64, torch.float64)
    ref = fm.attention(q, k, v, mask, backend="reference")
    torch.testing.assert_close(ref, fm.attention(q, k, v, mask, backend="sdpa"), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("from_tiles", [False, True])
def test_flex_block_mask_from_our_tile_classes(from_tiles):
    mask = masks.build("random_eviction", 300, batch=2, heads=4)
    q, k, v, _ = random_inputs(2, 300, 300, 4, 2, 32, torch.float32)
    block_mask = peers.flex_block_mask(mask, 2, 4, 300, 300, "cpu", from_tiles=from_tiles)
    out, _ = peers.flex_attention(q, k, v, mask, 1 / math.sqrt(32), block_mask)
    torch.testing.assert_close(out, fm.attention(q, k, v, mask, backend="reference"), rtol=1e-5, atol=1e-5)


def test_flex_backend_forward_on_cpu():
    mask = masks.build("prefix_lm_document", 384, batch=1)
    q, k, v, _ = random_inputs(1, 384, 384, 2, 2, 32, torch.float32)
    out, lse = fm.attention(q, k, v, mask, backend="flex", return_lse=True)
    ref, ref_lse = fm.attention(q, k, v, mask, backend="reference", return_lse=True)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("causal, width", [(True, 1), (True, 2), (False, 2), (False, 4)])
@pytest.mark.parametrize("sq, sk, hq, hkv, mask_heads", [(200, 200, 4, 4, 4), (131, 257, 6, 2, 2), (300, 130, 4, 1, 1)])
def test_variants_gqa_and_unequal_lengths(causal, width, sq, sk, hq, hkv, mask_heads):
    gen = torch.Generator().manual_seed(sq + sk + width)
    mask = random_column_mask(gen, 2, mask_heads, sq, sk, causal, width)
    check_against_dense(mask, 2, sq, sk, hq, hkv, 16)


def test_no_mask_is_full_attention():
    check_against_dense(None, 1, 150, 170, 2, 2, 8)


def test_rows_that_see_nothing_give_zero_and_minus_inf():
    # qk_sparse hides every key from the first rows of a span that starts at row 0.
    idx = torch.tensor([[[[j, 40] for j in range(40)] + [[j, j] for j in range(40, 64)]]], dtype=torch.int32)
    mask = fm.ColumnMask(idx, True, 64)
    out, lse, grads = check_against_dense(mask, 1, 64, 64, 2, 2, 8)
    dead = mask.to_dense()[0, 0].sum(-1) == 0
    assert dead.sum() == 40
    assert bool((out[:, dead] == 0).all()) and bool((lse[:, :, dead] == -math.inf).all())
    assert all(bool(torch.isfinite(g).all()) for g in grads)
    assert bool((grads[0][:, dead] == 0).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_low_precision_inputs_keep_their_dtype_and_stay_close(dtype):
    mask = masks.build("causal_document", 256)
    q, k, v, dout = random_inputs(1, 256, 256, 2, 2, 64, dtype)
    ins = [x.clone().requires_grad_() for x in (q, k, v)]
    out, lse = fm.attention(*ins, mask, backend="reference", return_lse=True)
    grads = torch.autograd.grad(out, ins, dout)
    assert out.dtype == dtype and lse.dtype == torch.float32 and all(g.dtype == dtype for g in grads)
    ref = fm.attention(q.double(), k.double(), v.double(), mask, backend="reference")
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)


def test_softmax_scale_is_applied():
    q, k, v, _ = random_inputs(1, 64, 64, 1, 1, 16, torch.float64)
    mask = masks.build("causal", 64)
    a = fm.attention(q, k, v, mask, softmax_scale=0.5)
    b = fm.attention(q * 2, k, v, mask, softmax_scale=0.25)
    torch.testing.assert_close(a, b)


@pytest.mark.parametrize(
    "change, error, match",
    [
        (lambda q, k, v: (q[0], k, v), ValueError, "q must be 4-D"),
        (lambda q, k, v: (q.long(), k, v), TypeError, "q dtype must be one of"),
        (lambda q, k, v: (q, k.float(), v), TypeError, "share a dtype"),
        (lambda q, k, v: (q, k, v[:, :10]), ValueError, "k and v must have the same batch, length and heads"),
        (lambda q, k, v: (q[:, :, :3], k, v), ValueError, r"q heads \(3\) must be a multiple of k/v heads \(2\)"),
        (lambda q, k, v: (q[..., :8], k, v), ValueError, "same head dim"),
        (lambda q, k, v: (q.expand(2, -1, -1, -1), k, v), ValueError, "same batch size"),
    ],
)
def test_input_errors(change, error, match):
    q, k, v, _ = random_inputs(1, 32, 32, 4, 2, 16, torch.float64)
    with pytest.raises(error, match=match):
        fm.attention(*change(q, k, v))


def test_mask_and_backend_errors():
    q, k, v, _ = random_inputs(1, 32, 32, 2, 2, 16, torch.float64)
    with pytest.raises(ValueError, match="unknown backend 'magic'; accepted: auto, reference"):
        fm.attention(q, k, v, backend="magic")
    with pytest.raises(TypeError, match="mask must be a ColumnMask"):
        fm.attention(q, k, v, torch.ones(32, 32, dtype=torch.bool))
    with pytest.raises(ValueError, match="seqlen"):
        fm.attention(q, k, v, masks.build("causal", 64))


@settings(max_examples=25, deadline=None)
@given(
    variant=st.sampled_from([(True, 1), (True, 2), (False, 2), (False, 4)]),
    sq=st.integers(1, 300),
    sk=st.integers(1, 300),
    seed=st.integers(0, 2**31 - 1),
)
def test_random_masks_match_dense(variant, sq, sk, seed):
    mask = random_column_mask(torch.Generator().manual_seed(seed), 1, 2, sq, sk, *variant)
    check_against_dense(mask, 1, sq, sk, 2, 1, 8, seed=seed % 1000)


def test_cute_backend_refuses_unsupported_inputs_by_name():
    q, k, v, _ = random_inputs(1, 32, 32, 2, 2, 16, torch.bfloat16)
    with pytest.raises(ValueError, match="backend='cute' needs CUDA tensors"):
        fm.attention(q, k, v, backend="cute")
    # "auto" falls back instead of failing.
    torch.testing.assert_close(fm.attention(q, k, v), fm.attention(q, k, v, backend="reference"))


def test_cute_backend_names_a_missing_launch_package(monkeypatch):
    """A Hopper machine without apache-tvm-ffi (the kernels' launch path): the reason names the
    package, so "auto" falls back and backend="cute" says what to install."""
    import importlib.util
    from types import SimpleNamespace

    from flashmask3.optimized import interface

    pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl not installed")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (9, 0))
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "tvm_ffi" else real_find_spec(name))
    q = SimpleNamespace(is_cuda=True, device="cuda:0", dtype=torch.bfloat16, shape=(1, 128, 2, 128))
    assert "apache-tvm-ffi" in interface.unsupported_reason(q, q)


def window_dense(sq, sk, causal, left, right):
    """FlashAttention's causal / window_size as a dense mask [1, 1, Sq, Sk], bottom-right aligned."""
    i = torch.arange(sq).view(-1, 1) + sk - sq
    j = torch.arange(sk).view(1, -1)
    attend = torch.ones(sq, sk, dtype=torch.bool)
    if causal:
        attend &= j <= i
    if left >= 0:
        attend &= j >= i - left
    if right >= 0:
        attend &= j <= i + right
    return attend[None, None]


def assert_grads_close(ins, ref_ins, out, ref_out, dout):
    grads = torch.autograd.grad(out, ins, dout)
    ref_grads = torch.autograd.grad(ref_out, ref_ins, dout)
    for got, ref in zip(grads, ref_grads):
        torch.testing.assert_close(got, ref, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize(
    "causal, window_size",
    [(True, (-1, -1)), (True, (5, 0)), (True, (0, -1)), (False, (3, 2)), (False, (-1, 0)), (False, (4, -1))],
)
@pytest.mark.parametrize("sq, sk", [(70, 70), (50, 90), (90, 50)])
def test_flash_attention_causal_and_window_size_match_dense(causal, window_size, sq, sk):
    q, k, v, dout = random_inputs(2, sq, sk, 4, 2, 16, torch.float64, seed=sq + sk)
    ins = [x.clone().requires_grad_() for x in (q, k, v)]
    out, lse = fm.attention(*ins, causal=causal, window_size=window_size, backend="reference", return_lse=True)
    ref_ins = [x.clone().requires_grad_() for x in (q, k, v)]
    ref_out, ref_lse = dense_attention(*ref_ins, window_dense(sq, sk, causal, *window_size), 1 / math.sqrt(16))
    torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse.double(), ref_lse.float().double(), rtol=1e-6, atol=1e-6)
    assert_grads_close(ins, ref_ins, out, ref_out, dout)


@pytest.mark.parametrize("window", [1, 6, 200])
def test_sliding_window_is_flash_attentions_window_size(window):
    q, k, v, _ = random_inputs(1, 120, 120, 2, 2, 16, torch.float64)
    mask = fm.ColumnMask.sliding_window(120, window)
    assert torch.equal(fm.attention(q, k, v, mask), fm.attention(q, k, v, causal=True, window_size=(window - 1, 0)))
    mask = fm.ColumnMask.sliding_window(120, window, causal=False)
    both = fm.attention(q, k, v, window_size=(window - 1, window - 1))
    assert torch.equal(fm.attention(q, k, v, mask), both)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (
            dict(mask=masks.build("causal", 32), causal=True),
            ValueError,
            "either mask or FlashAttention's causal / window_size",
        ),
        (dict(mask=masks.build("causal", 32), window_size=(4, 0)), ValueError, r"window_size=\(4, 0\)"),
        (
            dict(causal=True, window_size=(4, 2)),
            ValueError,
            r"window_size\[1\] must be 0 or -1 with causal=True .*, got 2",
        ),
        (dict(window_size=(4,)), ValueError, r"window_size must be a pair \(left, right\) of ints >= -1"),
        (dict(window_size=(-2, 0)), ValueError, "window_size must be a pair"),
        (dict(causal=1), TypeError, "causal must be a bool"),
    ],
)
def test_flash_attention_argument_errors(kwargs, error, match):
    q, k, v, _ = random_inputs(1, 32, 32, 2, 2, 16, torch.float64)
    with pytest.raises(error, match=match):
        fm.attention(q, k, v, **kwargs)


def per_document_attention(q, k, v, cu_q, cu_k, causal, window_size, scale):
    """Each document's queries against its keys alone (float64, [n, H, D] slices), FlashAttention's
    causal / window bottom-right aligned per document; a row that sees no key gives 0 and LSE -inf.
    Returns out [total_q, H, Dv] and LSE [H, total_q]."""
    outs, lses = [], []
    g = q.shape[1] // k.shape[1]
    for qs, qe, ks, ke in zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), cu_k[:-1].tolist(), cu_k[1:].tolist()):
        qd, kd, vd = q[qs:qe].transpose(0, 1), k[ks:ke].transpose(0, 1), v[ks:ke].transpose(0, 1)
        allowed = window_dense(qe - qs, ke - ks, causal, *window_size)[0, 0]
        sees = allowed.any(-1, keepdim=True)
        scores = (qd @ kd.repeat_interleave(g, 0).transpose(-1, -2)) * scale
        scores = torch.where(sees, scores.masked_fill(~allowed, -math.inf), 0.0)
        probs = torch.softmax(scores, -1) * sees
        outs.append((probs @ vd.repeat_interleave(g, 0)).transpose(0, 1))
        lses.append(torch.where(sees[:, 0], torch.logsumexp(scores, -1), -math.inf))
    return torch.cat(outs), torch.cat(lses, -1)


@pytest.mark.parametrize("causal, window_size", [(True, (-1, -1)), (False, (-1, -1)), (True, (3, 0)), (False, (2, 1))])
def test_varlen_attention_matches_per_document_attention(causal, window_size):
    cu = torch.tensor([0, 1, 18, 23, 24, 54, 55], dtype=torch.int32)  # documents of 1, 17, 5, 1, 30, 1
    q, k, v, dout = (x[0] for x in random_inputs(1, 55, 55, 4, 2, 16, torch.float64, seed=7))
    scale = 0.3
    ins = [x.clone().requires_grad_() for x in (q, k, v)]
    out, lse = fm.varlen_attention(
        *ins,
        cu,
        cu,
        30,
        30,
        causal=causal,
        window_size=window_size,
        softmax_scale=scale,
        return_lse=True,
        backend="reference",
    )
    ref_ins = [x.clone().requires_grad_() for x in (q, k, v)]
    ref_out, ref_lse = per_document_attention(*ref_ins, cu, cu, causal, window_size, scale)
    assert out.shape == (55, 4, 16) and lse.shape == (4, 55)
    torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse.double(), ref_lse.float().double(), rtol=1e-6, atol=1e-6)
    assert_grads_close(ins, ref_ins, out, ref_out, dout)
    # The same boundaries in another tensor are compared, and take the same path.
    again = fm.varlen_attention(
        q, k, v, cu, cu.long(), 30, 30, causal=causal, window_size=window_size, softmax_scale=scale
    )
    torch.testing.assert_close(again, ref_out.detach(), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("backend", ["reference", "sdpa"])
def test_varlen_attention_joins_the_sinks_to_each_document_row(backend):
    """`sinks` (FA4's learnable_sink): the per-document softmax with each head's sink joined (a
    document of one token included), out, LSE and the gradients, d(sinks) among them."""
    from flashmask3.reference.attention import join_sinks

    cu = torch.tensor([0, 1, 18, 23, 24, 54, 55], dtype=torch.int32)
    q, k, v, dout = (x[0] for x in random_inputs(1, 55, 55, 4, 2, 16, torch.float64, seed=8))
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], dtype=torch.float64)
    ins = [x.clone().requires_grad_() for x in (q, k, v, sinks)]
    out, lse = fm.varlen_attention(
        *ins[:3], cu, cu, 30, 30, causal=True, softmax_scale=0.3, return_lse=True, backend=backend, sinks=ins[3]
    )
    ref_ins = [x.clone().requires_grad_() for x in (q, k, v, sinks)]
    plain_out, plain_lse = per_document_attention(*ref_ins[:3], cu, cu, True, (-1, -1), 0.3)
    ref_out, ref_lse = join_sinks(plain_out[None], plain_lse[None], ref_ins[3])
    torch.testing.assert_close(out, ref_out[0], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse.double(), ref_lse[0].double(), rtol=1e-6, atol=1e-6)
    for got, want in zip(torch.autograd.grad(out, ins, dout), torch.autograd.grad(ref_out[0], ref_ins, dout)):
        torch.testing.assert_close(got, want, rtol=1e-8, atol=1e-8)


@pytest.mark.parametrize("causal, window_size", [(True, (-1, -1)), (False, (-1, -1)), (True, (3, 0)), (False, (2, 1))])
def test_varlen_attention_with_other_key_packing_matches_per_document_attention(causal, window_size):
    """Queries and keys packed differently (chunked prefill against cached keys, cross-attention):
    documents with more keys than queries, more queries than keys (causal: the first rows see no
    key), no queries and no keys."""
    cu_q = torch.tensor([0, 3, 10, 10, 15, 19], dtype=torch.int32)  # 3, 7, 0, 5, 4 queries
    cu_k = torch.tensor([0, 5, 9, 14, 30, 30], dtype=torch.int64)  # 5, 4, 5, 16, 0 keys
    q = random_inputs(1, 19, 19, 4, 2, 16, torch.float64, seed=3)[0][0]
    _, k, v, _ = (x[0] for x in random_inputs(1, 30, 30, 4, 2, 16, torch.float64, seed=4))
    dout = torch.randn(19, 4, 16, dtype=torch.float64)
    scale = 0.25
    ins = [x.clone().requires_grad_() for x in (q, k, v)]
    out, lse = fm.varlen_attention(
        *ins, cu_q, cu_k, 7, 16, causal=causal, window_size=window_size, softmax_scale=scale, return_lse=True
    )
    ref_ins = [x.clone().requires_grad_() for x in (q, k, v)]
    ref_out, ref_lse = per_document_attention(*ref_ins, cu_q, cu_k, causal, window_size, scale)
    assert out.shape == (19, 4, 16) and lse.shape == (4, 19)
    torch.testing.assert_close(out, ref_out, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse.double(), ref_lse.float().double(), rtol=1e-6, atol=1e-6)
    assert torch.isneginf(lse[:, 15:]).all()  # the last document has no keys
    assert_grads_close(ins, ref_ins, out, ref_out, dout)


def test_varlen_attention_errors_name_the_argument():
    q = k = v = torch.zeros(8, 2, 16, dtype=torch.float64)
    cu = torch.tensor([0, 4, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"cu_seqlens_q and cu_seqlens_k must bound the same N documents"):
        fm.varlen_attention(q, k, v, cu, torch.tensor([0, 3, 5, 8], dtype=torch.int32), 4, 5)
    with pytest.raises(ValueError, match=r"cu_seqlens_q must be .*\[N \+ 1\] with N >= 1, got torch.int32 \(1,\)"):
        fm.varlen_attention(q, k, v, cu[:1], cu[:1], 4, 4)
    with pytest.raises(ValueError, match=r"q must be a 3-D tensor \[total, H, D\]"):
        fm.varlen_attention(q[None], k, v, cu, cu, 4, 4)
    with pytest.raises(
        ValueError, match=r"cu_seqlens_k must be an int32 or int64 tensor \[N \+ 1\] with N >= 1, got torch.float32"
    ):
        fm.varlen_attention(q, k, v, cu, cu.float(), 4, 4)
    with pytest.raises(ValueError, match=r"cu_seqlens_k must go from 0 to total_k=6 .*, got \[0, 4, 8\]"):
        fm.varlen_attention(q, k[:6], v[:6], cu, cu, 4, 4)
    with pytest.raises(ValueError, match=r"cu_seqlens_q must go from 0 to total_q=8 .*, got \[1, 4, 8\]"):
        fm.varlen_attention(q, k, v, torch.tensor([1, 4, 8]), torch.tensor([0, 3, 8]), 4, 5)
    with pytest.raises(ValueError, match=r"cu_seqlens_q must go from 0 to total_q=8 .*, got \[0, 4, 6\]"):
        fm.varlen_attention(q, k, v, torch.tensor([0, 4, 6]), cu, 4, 4)  # tokens past the last document
    with pytest.raises(ValueError, match=r"window_size\[1\] must be 0 or -1 with causal=True"):
        fm.varlen_attention(q, k, v, cu, cu, 4, 4, causal=True, window_size=(2, 2))
    with pytest.raises(ValueError, match=r"cu_seqlens_q must go from 0 to total_q=8 without decreasing"):
        fm.varlen_attention(q, k, v, torch.tensor([0, 5, 4, 8]), torch.tensor([0, 5, 4, 8]), 5, 5)


def test_varlen_attention_without_queries_or_keys():
    """A packing of 0 queries gives empty results; 0 keys, output 0 and LSE -inf for every query."""
    q, k, v = (torch.randn(n, 2, 16, dtype=torch.float64) for n in (5, 0, 0))
    out, lse = fm.varlen_attention(q, k, v, torch.tensor([0, 2, 5]), torch.tensor([0, 0, 0]), 3, 0, return_lse=True)
    assert torch.equal(out, torch.zeros(5, 2, 16, dtype=torch.float64)) and torch.isneginf(lse).all()
    out = fm.varlen_attention(q[:0], q, q, torch.tensor([0, 0]), torch.tensor([0, 5]), 0, 5, causal=True)
    assert out.shape == (0, 2, 16)


def test_flex_builds_a_masks_block_mask_once_and_drops_it_with_the_mask(monkeypatch):
    """The flex backend builds a BlockMask once per mask object and shape (every layer of a model
    passes the same mask) and forgets it when the mask is gone; the output is unchanged."""
    import gc

    from flashmask3 import peers

    built = []
    real = peers.flex_block_mask
    monkeypatch.setattr(peers, "flex_block_mask", lambda *a, **kw: built.append(a[1:]) or real(*a, **kw))
    monkeypatch.setattr(peers, "_block_masks", {})
    q, k, v, _ = random_inputs(1, 256, 256, 2, 2, 32, torch.float32, seed=4)
    mask = masks.build("causal_document", 256, seed=4)
    first, _ = peers.flex_attention(q, k, v, mask, 0.125)
    again, _ = peers.flex_attention(q, k, v, mask, 0.125)
    assert len(built) == 1 and torch.equal(first, again)
    same_values = masks.build("causal_document", 256, seed=4)  # another object: keyed by identity, no sync
    peers.flex_attention(q, k, v, same_values, 0.125)
    assert len(built) == 2
    del mask, same_values
    gc.collect()
    assert len(peers._block_masks) == 0
