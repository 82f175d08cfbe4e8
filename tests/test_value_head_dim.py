"""A value head dim Dv other than the query/key head dim D (DeepSeek's MLA: 192 / 128): q [B, Sq, Hq, D],
k [B, Sk, Hkv, D], v [B, Sk, Hkv, Dv] -> out [B, Sq, Hq, Dv]. The fp64 reference against textbook
attention (forward, LSE, gradients, gradcheck, sinks), sdpa and flex against the reference (also
through verify's suite and command line), the cute backend's head dims (its forward at (128, 64)
too, gradients at (192, 128)) and auto's fallback, and the other entry points (varlen, Paddle,
Hugging Face's DeepSeek-V3, context parallelism)."""

import importlib
import math
import re
from types import SimpleNamespace

import pytest
import torch
from conftest import dense_attention, random_column_mask
from flashmask3.reference import ColumnMask, masks, reference_attention
from flashmask3.verify import compare, random_inputs, random_sinks, run_suite
from flashmask3.verify.__main__ import main as verify_main

import flashmask3 as fm
import flashmask3.api as api

compare_mod = importlib.import_module("flashmask3.verify.compare")


def inputs(batch, sq, sk, hq, hkv, d, dv, seed=0, dtype=torch.float64):
    return random_inputs(batch, sq, sk, hq, hkv, d, dtype, seed=seed, head_dim_v=dv)


def values_and_grads(fn, tensors, dout):
    """fn's (out, lse) and the gradients of out for dout, for every tensor of `tensors`."""
    leaves = [x.clone().requires_grad_() for x in tensors]
    out, lse = fn(*leaves)
    return [out.detach(), lse.detach(), *torch.autograd.grad(out, leaves, dout)]


def assert_close_all(got, expected, tol, names=("out", "lse", "dq", "dk", "dv", "dsinks")):
    for name, a, b in zip(names, got, expected):
        assert a.shape == b.shape, f"{name}: shape {tuple(a.shape)} != {tuple(b.shape)}"
        close = max(tol, 1e-6) if name == "lse" else tol  # the API's lse is fp32
        torch.testing.assert_close(a, b.to(a.dtype), rtol=close, atol=close, msg=lambda m: f"{name}: {m}")


# (B, Sq, Sk, Hq, Hkv) -> mask; the masks of Sq = Sk take Sq only.
MASKS = {
    "none": lambda b, sq, sk, hq, hkv: None,
    "causal_document": lambda b, sq, sk, hq, hkv: masks.build("causal_document", sq, batch=b, seed=4),
    "share_question": lambda b, sq, sk, hq, hkv: masks.build("share_question", sq, batch=b, seed=5),
    # one mask per query head
    "random_eviction, per q head": lambda b, sq, sk, hq, hkv: masks.build(
        "random_eviction", sq, batch=b, heads=hq, seed=6
    ),
    # random masks of every variant, per kv head, Sq != Sk allowed
    "causal, 1, per kv head": lambda b, sq, sk, hq, hkv: random_column_mask(
        torch.Generator().manual_seed(sq + sk), b, hkv, sq, sk, True, 1
    ),
    "causal, 2": lambda b, sq, sk, hq, hkv: random_column_mask(
        torch.Generator().manual_seed(sq), b, 1, sq, sk, True, 2
    ),
    "bidirectional, 4, per q head": lambda b, sq, sk, hq, hkv: random_column_mask(
        torch.Generator().manual_seed(sk), b, hq, sq, sk, False, 4
    ),
}
SQUARE = {"causal_document", "share_question", "random_eviction, per q head"}


@pytest.mark.parametrize("mask_name", list(MASKS))
@pytest.mark.parametrize(
    "b, sq, sk, hq, hkv, d, dv",
    [
        (2, 333, 333, 4, 2, 24, 16),  # GQA, odd length, Dv < D (MLA's direction)
        (1, 77, 131, 6, 2, 12, 20),  # Sq < Sk, Dv > D, groups of 3
        (2, 150, 45, 3, 1, 9, 5),  # Sq > Sk, MQA
    ],
)
def test_reference_matches_dense_fp64_with_another_value_head_dim(mask_name, b, sq, sk, hq, hkv, d, dv):
    if mask_name in SQUARE and sq != sk:
        pytest.skip("the benchmark masks are square")
    mask = MASKS[mask_name](b, sq, sk, hq, hkv)
    q, k, v, dout = inputs(b, sq, sk, hq, hkv, d, dv, seed=sq + dv)
    attend = None if mask is None else mask.to_dense()
    scale = 1 / math.sqrt(d)  # the default: q's head dim, not v's

    def ours(*x):
        return fm.attention(*x, mask, backend="reference", return_lse=True)

    got = values_and_grads(ours, (q, k, v), dout)
    expected = values_and_grads(lambda *x: dense_attention(*x, attend, scale), (q, k, v), dout)
    assert got[0].shape == (b, sq, hq, dv) and got[3].shape == (b, sk, hkv, d) and got[4].shape == (b, sk, hkv, dv)
    assert_close_all(got, expected, 1e-10)
    assert got[0].abs().max() > 0.1 and got[4].abs().max() > 0.1  # real values, not zeros


def test_reference_chunked_path_with_gathered_keys():
    """1300 rows: several query chunks, a ragged last key block and gathered key blocks, Dv != D."""
    mask = masks.build("random_eviction", 1300, batch=1, heads=2, seed=2)
    q, k, v, dout = inputs(1, 1300, 1300, 2, 1, 16, 8, seed=2)
    got = values_and_grads(lambda *x: reference_attention(*x, mask, 0.25), (q, k, v), dout)
    expected = values_and_grads(lambda *x: dense_attention(*x, mask.to_dense(), 0.25), (q, k, v), dout)
    assert_close_all(got, expected, 1e-10)


@pytest.mark.parametrize("mask_name", ["none", "causal, 2", "bidirectional, 4, per q head"])
def test_reference_gradcheck_with_another_value_head_dim(mask_name):
    mask = MASKS[mask_name](2, 7, 10, 4, 2)
    q, k, v, _ = inputs(2, 7, 10, 4, 2, 3, 5, seed=1)
    leaves = [x.requires_grad_() for x in (q, k, v)]
    assert torch.autograd.gradcheck(lambda *x: reference_attention(*x, mask, 0.5)[0], leaves)


def test_no_keys_at_all_give_zeros_of_vs_head_dim():
    q, k, v, dout = inputs(2, 9, 0, 4, 2, 24, 16)
    leaves = [x.requires_grad_() for x in (q, k, v)]
    out, lse = fm.attention(*leaves, causal=True, return_lse=True)
    assert out.shape == (2, 9, 4, 16) and not out.any() and bool(torch.isneginf(lse).all())
    dq, dk, dv = torch.autograd.grad(out, leaves, dout)
    assert (dq.shape, dk.shape, dv.shape) == ((2, 9, 4, 24), (2, 0, 2, 24), (2, 0, 2, 16)) and not dq.any()


def test_softmax_scale_default_is_one_over_sqrt_of_qs_head_dim():
    q, k, v, _ = inputs(1, 40, 40, 2, 2, 36, 4, seed=3)
    default = fm.attention(q, k, v, causal=True)
    torch.testing.assert_close(default, fm.attention(q, k, v, causal=True, softmax_scale=1 / 6), rtol=0, atol=0)
    assert (default - fm.attention(q, k, v, causal=True, softmax_scale=0.5)).abs().max() > 1e-3


# -- the peer backends ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "mask_name", ["none", "causal_document", "random_eviction, per q head", "causal, 1, per kv head"]
)
def test_sdpa_matches_the_reference_forward_lse_and_gradients(mask_name):
    mask = MASKS[mask_name](2, 200, 200, 4, 2)
    q, k, v, dout = inputs(2, 200, 200, 4, 2, 24, 16, seed=8)

    def run(backend):
        return lambda *x: fm.attention(*x, mask, backend=backend, return_lse=True)

    got = values_and_grads(run("sdpa"), (q, k, v), dout)
    assert_close_all(got, values_and_grads(run("reference"), (q, k, v), dout), 1e-10)
    assert got[0].shape == (2, 200, 4, 16) and got[4].shape == (2, 200, 2, 16)


@pytest.mark.parametrize("mask_name", ["none", "causal_document", "random_eviction, per q head"])
def test_flex_forward_on_cpu_matches_the_reference(mask_name):
    """FlexAttention takes a value head dim of its own; it has no CPU backward (the GPU tests do it)."""
    mask = MASKS[mask_name](2, 300, 300, 4, 2)
    q, k, v, _ = inputs(2, 300, 300, 4, 2, 24, 16, seed=9, dtype=torch.float32)
    out, lse = fm.attention(q, k, v, mask, backend="flex", return_lse=True)
    ref, ref_lse = fm.attention(q, k, v, mask, backend="reference", return_lse=True)
    assert out.shape == (2, 300, 4, 16)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["reference", "sdpa"])
def test_verify_compare_passes_with_another_value_head_dim(backend):
    q, k, v, dout = random_inputs(2, 257, 257, 4, 2, 24, torch.bfloat16, seed=3, head_dim_v=16)
    report = compare(backend, q, k, v, masks.build("causal_document", 257, batch=2), dout)
    assert report.passed and set(report.errors) == {"out", "lse", "dq", "dk", "dv"}, report.failures()


@pytest.mark.parametrize("backend", ["reference", "sdpa"])
def test_the_verify_suite_and_its_command_line_take_another_value_head_dim(backend, monkeypatch, capsys):
    """run_suite(head_dim=192, head_dim_v=128) and `head_dim_v=128` on the command line: every
    backend call gets v and gives out of head dim 128, and each case passes with a real error."""
    real, out_shapes = compare_mod.attention, []

    def recording(q, k, v, mask, **kw):
        out, lse = real(q, k, v, mask, **kw)
        out_shapes.append((v.shape[-1], tuple(out.shape)))
        return out, lse

    monkeypatch.setattr(compare_mod, "attention", recording)
    cases = run_suite(
        backend, ["causal_document", "share_question"], seqlens=[130], dtype="bf16", head_dim=192, head_dim_v=128
    )
    assert [c.mask for c in cases] == ["causal_document", "share_question"]
    for report in (c.report for c in cases):
        assert report.passed and set(report.errors) == {"out", "lse", "dq", "dk", "dv"}, report.failures()
        assert 1e-4 < report.errors["out"] < 2e-2  # bf16's rounding against the fp64 reference
    assert out_shapes == [(128, (1, 130, 4, 128))] * 2
    argv = [f"backend={backend}", "masks=causal", "seqlens=97", "head_dim=192", "head_dim_v=128"]
    assert verify_main(argv) == 0 and "1 passed, 0 failed" in capsys.readouterr().out
    assert out_shapes[-1] == (128, (1, 97, 4, 128))


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["auto", "cute", "flex", "sdpa"])
def test_gpu_backends_pass_verify_at_mlas_head_dims(backend):
    """q/k head dim 192, v 128 in bf16 on CUDA: cute, auto (which takes cute at this pair, its
    gradients too: `unsupported_reason`), flex and sdpa within verify's tolerance of the fp64
    reference, gradients included."""
    q, k, v, dout = random_inputs(1, 1000, 1000, 4, 2, 192, torch.bfloat16, "cuda", seed=1, head_dim_v=128)
    report = compare(backend, q, k, v, masks.build("causal_document", 1000, device="cuda"), dout)
    assert report.passed and set(report.errors) == {"out", "lse", "dq", "dk", "dv"}, report.failures()


# -- sinks ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mask_name", ["none", "causal_document", "bidirectional, 4, per q head"])
def test_reference_and_sdpa_with_sinks_match_dense_with_a_sink_column(mask_name):
    mask = MASKS[mask_name](2, 90, 90, 6, 2)
    q, k, v, dout = inputs(2, 90, 90, 6, 2, 20, 12, seed=10)
    sinks = random_sinks(6, 90, seed=10).double()
    attend = None if mask is None else mask.to_dense()
    expected = values_and_grads(lambda *x: dense_attention(*x[:3], attend, 0.3, x[3]), (q, k, v, sinks), dout)
    for backend in ("reference", "sdpa"):

        def ours(*x, backend=backend):
            return fm.attention(*x[:3], mask, backend=backend, softmax_scale=0.3, return_lse=True, sinks=x[3])

        got = values_and_grads(ours, (q, k, v, sinks), dout)
        assert got[0].shape == (2, 90, 6, 12) and got[4].shape == (2, 90, 2, 12)
        assert_close_all(got, expected, 1e-10)
        assert got[5].abs().max() > 1e-3  # the sinks take a real share


def test_reference_gradcheck_with_sinks_and_another_value_head_dim():
    mask = MASKS["causal, 2"](2, 8, 8, 4, 2)
    q, k, v, _ = inputs(2, 8, 8, 4, 2, 3, 5, seed=11)
    sinks = random_sinks(4, 8, seed=11).double()
    leaves = [x.requires_grad_() for x in (q, k, v, sinks)]
    assert torch.autograd.gradcheck(lambda *x: reference_attention(*x[:3], mask, 0.5, sinks=x[3])[0], leaves)


# -- the cute backend: its head dims, and auto's fallback ------------------------------------------


BOTH_DIRECTIONS = r"\(64, 64\), \(128, 128\), \(192, 128\), \(256, 256\)"
CUTE_GRAD_REFUSAL = (
    rf"backend='cute' computes gradients at head dims \(q/k, v\) of {BOTH_DIRECTIONS}, got q/k head dim 128 "
    r"and v head dim 64 on inputs that require grad"
)
CUTE_SHAPE_REFUSAL = (
    rf"backend='cute' takes head dims \(q/k, v\) of {BOTH_DIRECTIONS} \(forward and backward\) and "
    r"\(128, 64\) \(forward only\), got \(128, 96\)"
)


def head_dims_only(q, k, v=None, backward=False):
    """The kernels' checks as on a Hopper GPU with everything installed: only the head dims count."""
    from flashmask3.optimized.interface import head_dims_unsupported

    return head_dims_unsupported(q.shape[-1], (k if v is None else v).shape[-1], backward)


@pytest.fixture
def cute_on_a_hopper_gpu(cute_on_cpu, monkeypatch):
    """The custom ops on CPU through the reference, and the kernels' checks as on a Hopper GPU."""
    monkeypatch.setattr(api, "unsupported_reason", head_dims_only)


def test_cute_backend_names_the_head_dims_it_takes(cute_on_a_hopper_gpu):
    q, k, v, _ = inputs(1, 16, 16, 2, 1, 128, 96, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=CUTE_SHAPE_REFUSAL):
        fm.attention(q, k, v, backend="cute")


def test_cute_backend_refuses_gradients_at_another_value_head_dim(cute_on_a_hopper_gpu):
    """The forward at (128, 64) runs without grad and matches the reference; with inputs that
    require grad it is refused by name, before any launch (the backward kernel does not build it)."""
    q, k, v, _ = inputs(1, 16, 16, 2, 1, 128, 64, dtype=torch.bfloat16)
    expected = fm.attention(q, k, v, causal=True, backend="reference")
    torch.testing.assert_close(fm.attention(q, k, v, causal=True, backend="cute"), expected)  # bf16 rounding
    with torch.no_grad():
        out = fm.attention(q.requires_grad_(), k, v, causal=True, backend="cute")
    torch.testing.assert_close(out, expected)
    with pytest.raises(ValueError, match=CUTE_GRAD_REFUSAL):
        fm.attention(q, k, v, causal=True, backend="cute")
    sinks = torch.zeros(2, requires_grad=True)
    with pytest.raises(ValueError, match=CUTE_GRAD_REFUSAL):
        fm.attention(q.detach(), k, v, causal=True, backend="cute", sinks=sinks)


def test_the_backward_kernel_refuses_a_head_dim_pair_it_does_not_build_by_name():
    """The kernel builds (192, 128) and (256, 256) besides 64 and 128; (128, 64) it refuses, naming
    what it builds."""
    from flashmask3.optimized import interface

    q, k, v, _ = inputs(1, 16, 16, 2, 1, 128, 64, dtype=torch.bfloat16)
    out = torch.zeros(1, 16, 2, 64, dtype=torch.bfloat16)
    lse = torch.zeros(1, 2, 16)
    pairs = r"\(64, 64\), \(128, 128\), \(192, 128\), \(256, 256\)"
    message = rf"the cute backward takes head dims \(q/k, v\) of {pairs}, got \(128, 64\)"
    with pytest.raises(ValueError, match=message):
        interface.backward(out, q, k, v, out, lse, None, 0.1)


def test_auto_is_the_reference_on_cpu():
    q, k, v, _ = inputs(1, 50, 50, 4, 2, 24, 16, seed=12, dtype=torch.float32)
    mask = masks.build("causal_document", 50)
    assert api._auto_backend(q, k, v, backward=False) == "reference"
    assert torch.equal(fm.attention(q, k, v, mask), fm.attention(q, k, v, mask, backend="reference"))


def test_auto_takes_cute_for_the_forward_and_flex_for_gradients_at_another_value_head_dim(monkeypatch):
    """On a Hopper GPU (the device checks stood in for here): auto runs the kernels at Dv = D and at
    (192, 128) in both directions, and at (128, 64) for the forward alone; where gradients are
    needed there, or the pair is not one the kernels take, it falls back to flex."""
    monkeypatch.setattr(api, "unsupported_reason", head_dims_only)

    def on_cuda(*shape):
        return SimpleNamespace(is_cuda=True, device="cuda:0", dtype=torch.bfloat16, shape=shape)

    q, k = on_cuda(1, 128, 4, 128), on_cuda(1, 128, 2, 128)
    for backward in (False, True):
        assert api._auto_backend(q, k, on_cuda(1, 128, 2, 128), backward) == "cute"
        assert api._auto_backend(q, k, on_cuda(1, 128, 2, 96), backward) == "flex"
    for q_k_head_dim, v_head_dim in ((192, 128), (256, 256)):
        q_other, k_other = on_cuda(1, 128, 4, q_k_head_dim), on_cuda(1, 128, 2, q_k_head_dim)
        assert api._auto_backend(q_other, k_other, on_cuda(1, 128, 2, v_head_dim), backward=True) == "cute"
    assert api._auto_backend(q, k, on_cuda(1, 128, 2, 64), backward=False) == "cute"
    assert api._auto_backend(q, k, on_cuda(1, 128, 2, 64), backward=True) == "flex"
    assert "v head dim 64" in api._cute_unsupported(q, k, on_cuda(1, 128, 2, 64), backward=True)


# -- input checks -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "v_shape",
    [(1, 31, 2, 8), (2, 32, 2, 8), (1, 32, 1, 8)],  # another Sk, batch, number of heads
)
def test_k_and_v_must_agree_on_all_but_the_head_dim(v_shape):
    q, k, _, _ = inputs(1, 32, 32, 4, 2, 16, 8)
    v = torch.zeros(v_shape, dtype=torch.float64)
    match = (
        r"k and v must have the same batch, length and heads \(k \[B, Sk, Hkv, D\], v \[B, Sk, Hkv, Dv\]; "
        rf"only the head dims may differ\), got \(1, 32, 2, 16\) and {re.escape(str(v_shape))}"
    )
    with pytest.raises(ValueError, match=match):
        fm.attention(q, k, v)


def test_q_and_k_must_still_share_their_head_dim():
    q, k, v, _ = inputs(1, 32, 32, 4, 2, 16, 8)
    with pytest.raises(ValueError, match="q and k must have the same head dim, got 12 and 16"):
        fm.attention(q[..., :12], k, v)


# -- the other entry points -------------------------------------------------------------------------


def test_varlen_attention_with_another_value_head_dim():
    cu = torch.tensor([0, 1, 18, 23, 54, 55], dtype=torch.int32)
    q, k, v, dout = (x[0] for x in inputs(1, 55, 55, 4, 2, 24, 16, seed=13))
    got = values_and_grads(
        lambda *x: fm.varlen_attention(*x, cu, cu, 31, 31, causal=True, return_lse=True), (q, k, v), dout
    )
    attend = ColumnMask.causal_document(cu).to_dense()

    def expected_fn(*x):
        out, lse = dense_attention(*(t[None] for t in x), attend, 1 / math.sqrt(24))
        return out[0], lse[0]

    assert got[0].shape == (55, 4, 16) and got[4].shape == (55, 2, 16)
    assert_close_all(got, values_and_grads(expected_fn, (q, k, v), dout), 1e-10)
    with pytest.raises(
        ValueError, match=r"v must be \[total_k, Hkv, Dv\] with k's total and Hkv \(k is \(55, 2, 24\)\)"
    ):
        fm.varlen_attention(q, k, v[:, :1], cu, cu, 31, 31)


def test_paddle_flashmask_attention_with_another_value_head_dim():
    rows = torch.tensor([4, 4, 4, 4, 7, 7, 7, 10, 10, 10], dtype=torch.int32).view(1, 1, 10, 1)
    q, k, v, _ = inputs(2, 10, 10, 4, 2, 24, 16, seed=14)
    out, lse = fm.flashmask_attention(q, k, v, rows, causal=True, return_softmax_lse=True)
    expected, expected_lse = dense_attention(q, k, v, ColumnMask(rows, True, 10).to_dense(), 1 / math.sqrt(24))
    assert out.shape == (2, 10, 4, 16)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse, expected_lse.float(), rtol=1e-6, atol=1e-6)


def test_hf_deepseek_v3_matches_sdpa():
    """A tiny DeepSeek-V3 (MLA: q/k head dim 16 + 8 = 24, v head dim 8; an MoE layer) in fp64 with
    attn_implementation=hf.NAME: the model hands flashmask3 v with its own head dim (it pads v only
    for implementations named "flash..."). Logits, loss, gradients and greedy generation as sdpa's."""
    transformers = pytest.importorskip("transformers")
    from flashmask3.integrations import hf

    hf.register(backend="reference")
    config = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=32,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=None,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=8,
        n_routed_experts=2,
        num_experts_per_tok=1,
        n_group=1,
        topk_group=1,
        n_shared_experts=1,
        first_k_dense_replace=1,
        experts_implementation="eager",  # the grouped matmul takes no fp64
    )
    torch.manual_seed(3)
    ours, sdpa = (
        transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**config, attn_implementation=name)).double()
        for name in (hf.NAME, "sdpa")
    )
    sdpa.load_state_dict(ours.state_dict())
    shapes = []
    attention = hf.attention
    try:
        hf.attention = lambda q, k, v, *a, **kw: (
            shapes.append((q.shape[-1], v.shape[-1])) or attention(q, k, v, *a, **kw)
        )
        ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(11))
        got, expected = (model(input_ids=ids, labels=ids) for model in (ours, sdpa))
        assert shapes and set(shapes) == {(24, 8)}
        assert (got.logits - expected.logits).abs().max() < 1e-10
        got.loss.backward()
        expected.loss.backward()
        theirs = dict(sdpa.named_parameters())
        for name, p in ours.named_parameters():
            if p.grad is not None:
                torch.testing.assert_close(p.grad, theirs[name].grad, rtol=1e-9, atol=1e-9)
        prompt = ids[:, :5]
        generated = ours.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4, do_sample=False)
        assert torch.equal(
            generated,
            sdpa.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4, do_sample=False),
        )
    finally:
        hf.attention = attention


def test_context_parallel_refuses_another_value_head_dim_at_entry():
    from flashmask3.distributed import cp_attention, make_plan

    plan = make_plan(64, 2, 2, "zigzag")
    q, k, v, _ = inputs(1, 32, 32, 4, 2, 24, 16)
    with pytest.raises(
        ValueError,
        match=r"v_local must have k_local's shape \(1, 32, 2, 24\), got \(1, 32, 2, 16\): context parallelism "
        "takes a value head dim equal to the key head dim only",
    ):
        cp_attention(q, k, v, masks.build("causal", 64), plan)


def test_the_cute_forward_ops_shapes_follow_vs_head_dim_under_fake_tensors():
    """torch.compile traces the cute forward through its fake (the op is registered on import of
    flashmask3): out takes v's head dim."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(1, 100, 4, 192, device="cuda", dtype=torch.bfloat16)
        k = torch.empty(1, 100, 2, 192, device="cuda", dtype=torch.bfloat16)
        v = torch.empty(1, 100, 2, 128, device="cuda", dtype=torch.bfloat16)
        out, lse = torch.ops.flashmask3.cute_forward(q, k, v, None, True, False, 0.1, False)
    assert tuple(out.shape) == (1, 100, 4, 128) and tuple(lse.shape) == (1, 4, 100)
