"""Attention sinks (gpt-oss): the reference against a dense softmax with a sink column and under
gradcheck, the after-the-fact form of cute, sdpa and flex, GQA, rows that see no key, bad sinks,
verify and the Hugging Face integration."""

import importlib
import math
from types import SimpleNamespace

import pytest
import torch
from conftest import dense_attention, random_column_mask
from flashmask3.reference import ColumnMask, masks, reference_attention
from flashmask3.verify import compare, random_inputs, random_sinks, run_suite
from flashmask3.verify.__main__ import main as verify_main

import flashmask3 as fm

compare_mod = importlib.import_module("flashmask3.verify.compare")


def first_rows_see_nothing(seqlen, dead_rows):
    """A causal mask under which rows [0, dead_rows) see no key."""
    attend = torch.ones(seqlen, seqlen, dtype=torch.bool).tril()
    attend[:dead_rows] = False
    return ColumnMask.from_dense(attend[None, None])


def random_mask(causal, width):
    """A random mask of the variant for batch 2 and the given mask heads (some rows may see nothing)."""
    return lambda sq, sk, heads: random_column_mask(
        torch.Generator().manual_seed(sq + width), 2, heads, sq, sk, causal, width
    )


MASKS = {  # (Sq, Sk, mask heads) -> mask
    "none": lambda sq, sk, heads: None,
    "causal, 1": random_mask(True, 1),
    "causal, 2": random_mask(True, 2),
    "bidirectional, 2": random_mask(False, 2),
    "bidirectional, 4": random_mask(False, 4),
    "rows that see nothing": lambda sq, sk, heads: first_rows_see_nothing(sq, sq // 3),
}


def inputs_with_sinks(batch, sq, sk, hq, hkv, d, seed=0, dtype=torch.float64):
    """q, k, v, sinks [hq] and dout; sinks in q's dtype."""
    q, k, v, dout = random_inputs(batch, sq, sk, hq, hkv, d, dtype, seed=seed)
    return q, k, v, random_sinks(hq, max(sk, 1), seed=seed).to(dtype), dout


def values_and_grads(fn, q, k, v, sinks, dout):
    """fn's (out, lse) and the gradients of out for dout: [out, lse, dq, dk, dv, dsinks]."""
    leaves = [x.clone().requires_grad_() for x in (q, k, v, sinks)]
    out, lse = fn(*leaves)
    return [out.detach(), lse.detach(), *torch.autograd.grad(out, leaves, dout)]


def assert_all_close(got, expected, tol):
    """[out, lse, dq, dk, dv, dsinks] within tol; lse within 1e-6 at least (the API's is fp32)."""
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv", "dsinks"), got, expected):
        close = max(tol, 1e-6) if name == "lse" else tol
        torch.testing.assert_close(a, b.to(a.dtype), rtol=close, atol=close, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("mask_name", list(MASKS))
@pytest.mark.parametrize(  # masks per kv head, per query head, broadcast
    "sq, sk, hq, hkv, mask_heads", [(70, 70, 4, 2, 2), (45, 90, 6, 2, 6), (300, 300, 4, 1, 1)]
)
def test_reference_matches_a_dense_softmax_with_a_sink_column(mask_name, sq, sk, hq, hkv, mask_heads):
    if mask_name == "rows that see nothing" and sq != sk:
        pytest.skip("the mask is square")
    mask = MASKS[mask_name](sq, sk, mask_heads)
    q, k, v, sinks, dout = inputs_with_sinks(2, sq, sk, hq, hkv, 16, seed=sq + hq)
    attend = None if mask is None else mask.to_dense()

    def ours(*x):
        return fm.attention(*x[:3], mask, backend="reference", softmax_scale=0.3, return_lse=True, sinks=x[3])

    expected = values_and_grads(lambda *x: dense_attention(*x[:3], attend, 0.3, x[3]), q, k, v, sinks, dout)
    assert_all_close(values_and_grads(ours, q, k, v, sinks, dout), expected, 1e-10)


@pytest.mark.parametrize("mask_name", list(MASKS))
def test_reference_gradcheck_with_sinks(mask_name):
    sq, sk = (9, 9) if mask_name == "rows that see nothing" else (7, 10)
    mask = MASKS[mask_name](sq, sk, 2)
    q, k, v, sinks, _ = inputs_with_sinks(2, sq, sk, 4, 2, 3, seed=5)
    leaves = [x.requires_grad_() for x in (q, k, v, sinks)]
    assert torch.autograd.gradcheck(lambda *x: reference_attention(*x[:3], mask, 0.5, sinks=x[3])[0], leaves)


def test_the_chunked_path_with_a_query_chunk_that_sees_nothing():
    """1300 rows: several query chunks, the first left out of the plan (rows [0, 300) see no key),
    keys 256-511 seen by no row (the other key blocks gathered). The rows that see nothing give
    out = 0 and lse = their sink, whether their chunk is computed or not."""
    hidden_from = torch.randint(300, 1301, (1300,), generator=torch.Generator().manual_seed(2))
    hidden_from[256:512] = 300
    # Non-causal [LTS, UTE]: key j is hidden from rows [LTS_j, Sq) and [0, UTE_j).
    rows = torch.stack([hidden_from, torch.full_like(hidden_from, 300)], -1)
    mask = ColumnMask(rows.view(1, 1, 1300, 2).to(torch.int32), False, 1300)
    attend = mask.to_dense()
    q, k, v, sinks, dout = inputs_with_sinks(1, 1300, 1300, 2, 1, 16, seed=2)
    got = values_and_grads(lambda *x: reference_attention(*x[:3], mask, 0.25, sinks=x[3]), q, k, v, sinks, dout)
    expected = values_and_grads(lambda *x: dense_attention(*x[:3], attend, 0.25, x[3]), q, k, v, sinks, dout)
    assert_all_close(got, expected, 1e-10)
    assert not got[0][:, :300].any() and torch.equal(got[1][..., :300], sinks.view(1, -1, 1).expand(1, 2, 300))


@pytest.mark.parametrize("mask_name", ["none", "causal, 2", "bidirectional, 4", "rows that see nothing"])
@pytest.mark.parametrize("hq, hkv", [(4, 2), (3, 1)])
def test_sdpa_with_sinks_after_the_fact_matches_the_reference(mask_name, hq, hkv):
    """out * sigmoid(lse - sink) and logaddexp(lse, sink), differentiated through SDPA's lse:
    out, lse, dq, dk, dv and dsinks as the reference computes them directly, in fp64."""
    mask = MASKS[mask_name](60, 60, hkv)
    q, k, v, sinks, dout = inputs_with_sinks(2, 60, 60, hq, hkv, 16, seed=hq)

    def run(backend):
        return lambda *x: fm.attention(*x[:3], mask, backend=backend, return_lse=True, sinks=x[3])

    expected = values_and_grads(run("reference"), q, k, v, sinks, dout)
    assert_all_close(values_and_grads(run("sdpa"), q, k, v, sinks, dout), expected, 1e-10)


def test_flex_with_sinks_forward_on_cpu():
    """FlexAttention has no CPU backward: the forward here, the backward on a GPU (below)."""
    mask = masks.build("prefix_lm_document", 384, batch=1)
    q, k, v, sinks, _ = inputs_with_sinks(1, 384, 384, 4, 2, 32, seed=3, dtype=torch.float32)
    out, lse = fm.attention(q, k, v, mask, backend="flex", return_lse=True, sinks=sinks)
    ref, ref_lse = fm.attention(q, k, v, mask, backend="reference", return_lse=True, sinks=sinks)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["cute", "flex", "sdpa", "auto"])
@pytest.mark.parametrize("mask_name", ["causal_document", "qk_sparse", "random_eviction"])
@pytest.mark.parametrize("head_dim, head_dim_v", [(64, 64), (128, 128), (192, 128), (256, 256)])
def test_sinks_on_a_gpu_pass_verify_against_the_fp64_reference(backend, mask_name, head_dim, head_dim_v):
    """Every backend within verify's tolerance, dsinks included, at each (q/k, v) head dim pair the
    cute backward takes: cute (and auto, which picks it) joins the sinks in its forward kernel's
    epilogue at every head dim."""
    mask = masks.build(mask_name, 1000, heads=4, seed=1, device="cuda")
    q, k, v, dout = random_inputs(1, 1000, 1000, 4, 2, head_dim, torch.bfloat16, "cuda", seed=1, head_dim_v=head_dim_v)
    report = compare(backend, q, k, v, mask, dout, sinks=random_sinks(4, 1000, "cuda", seed=1))
    assert report.passed and "dsinks" in report.errors, report.failures()


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim, head_dim_v", [(64, 64), (128, 128), (192, 128), (256, 256)])
def test_the_cute_kernels_sinks_on_rows_that_see_nothing(head_dim, head_dim_v):
    """The forward kernel's sinks against `join_sinks` of its output without them (GQA, bf16):
    rows that see no key give 0 and their sink (a sink of -inf: 0 and -inf), every other row
    within a bf16 rounding of the joined one; the gradients stay finite and zero on those rows."""
    from flashmask3.optimized import ops
    from flashmask3.reference.attention import join_sinks

    mask = first_rows_see_nothing(300, 70).to("cuda")
    q, k, v, dout = random_inputs(1, 300, 300, 4, 2, head_dim, torch.bfloat16, "cuda", seed=3, head_dim_v=head_dim_v)
    sinks = random_sinks(4, 300, "cuda", seed=3)
    sinks[3] = -math.inf
    scale = head_dim**-0.5
    plain_out, plain_lse = ops.attention(q, k, v, mask, scale)
    want_out, want_lse = join_sinks(plain_out, plain_lse, sinks)
    leaves = [x.requires_grad_() for x in (q, k, v, sinks)]
    out, lse = ops.attention(*leaves[:3], mask, scale, sinks=leaves[3])
    assert not out[:, :70].any()  # the LSE is the sink, through log2(e) and back in fp32
    torch.testing.assert_close(lse[:, :3, :70], sinks[:3].detach().view(1, 3, 1).expand(1, 3, 70), rtol=1e-6, atol=0)
    assert torch.isneginf(lse[:, 3, :70]).all()
    assert (out.float() - want_out.float()).abs().max().item() <= 2 * 2**-8 * want_out.float().abs().max().item()
    torch.testing.assert_close(lse[..., 70:], want_lse[..., 70:], rtol=0, atol=1e-5)
    grads = torch.autograd.grad(out, leaves, dout)
    assert all(bool(torch.isfinite(g).all()) for g in grads) and not grads[0][:, :70].any()


@pytest.mark.parametrize("backend", ["reference", "sdpa"])
def test_each_query_heads_sink_moves_only_that_head(backend):
    q, k, v, sinks, _ = inputs_with_sinks(1, 40, 40, 6, 2, 8, seed=6)
    out = fm.attention(q, k, v, causal=True, backend=backend, sinks=sinks)
    moved = sinks.clone()
    moved[4] += 1.0  # query head 4: the second of kv head 1's three
    changed = (fm.attention(q, k, v, causal=True, backend=backend, sinks=moved) != out).any(-1).any(1)
    assert changed.tolist() == [[False, False, False, False, True, False]]


@pytest.mark.parametrize("backend", ["auto", "reference", "sdpa", "flex"])
def test_rows_that_see_no_key_give_zero_and_their_sink(backend):
    mask = first_rows_see_nothing(64, 20)
    q, k, v, sinks, dout = inputs_with_sinks(1, 64, 64, 2, 2, 8, seed=7)
    leaves = [x.requires_grad_(backend != "flex") for x in (q, k, v, sinks)]  # flex: no CPU backward
    out, lse = fm.attention(*leaves[:3], mask, backend=backend, return_lse=True, sinks=leaves[3])
    assert not out[:, :20].any() and bool(out[:, 20:].any(-1).all())
    assert torch.equal(lse[..., :20], sinks.float().view(1, 2, 1).expand(1, 2, 20))
    if backend != "flex":
        grads = torch.autograd.grad(out, leaves, dout)
        assert all(bool(torch.isfinite(g).all()) for g in grads) and not grads[0][:, :20].any()


@pytest.mark.parametrize("backend", ["auto", "reference", "sdpa", "flex"])
def test_no_keys_at_all_give_zero_and_the_sinks(backend):
    q, k, v, sinks, dout = inputs_with_sinks(1, 8, 0, 2, 2, 16)
    leaves = [x.requires_grad_() for x in (q, k, v, sinks)]
    out, lse = fm.attention(*leaves[:3], causal=True, backend=backend, return_lse=True, sinks=leaves[3])
    assert not out.any() and torch.equal(lse, sinks.float().view(1, 2, 1).expand(1, 2, 8))
    dq, _, _, dsinks = torch.autograd.grad(out, leaves, dout)
    assert not dq.any() and not dsinks.any()  # out is 0 whatever the sink


# -- sinks of -inf ---------------------------------------------------------------------------------


def with_sinks(backend, mask):
    """fn(q, k, v, sinks) -> (out, lse) through fm.attention, softmax scale 0.3."""
    return lambda *x: fm.attention(*x[:3], mask, backend=backend, softmax_scale=0.3, return_lse=True, sinks=x[3])


@pytest.mark.parametrize("mask_name", ["none", "causal, 2", "rows that see nothing"])
@pytest.mark.parametrize("backend", ["reference", "sdpa", "cute"])
def test_sinks_of_minus_inf_are_no_sinks(cute_on_cpu, backend, mask_name):
    """Every sink -inf: out, lse, dq, dk and dv those of no sink (to the bit on the reference) and
    d(sinks) 0, rows that see nothing included (out 0, lse -inf, dq 0), no NaN."""
    mask = MASKS[mask_name](48, 48, 2)
    q, k, v, _, dout = inputs_with_sinks(2, 48, 48, 4, 2, 8, seed=12)
    sinks = torch.full((4,), -math.inf, dtype=torch.float64)
    got = values_and_grads(with_sinks(backend, mask), q, k, v, sinks, dout)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out, lse = fm.attention(*leaves, mask, backend=backend, softmax_scale=0.3, return_lse=True)
    expected = [out.detach(), lse.detach(), *torch.autograd.grad(out, leaves, dout), torch.zeros(4).double()]
    assert not any(bool(x.isnan().any()) for x in got)
    assert torch.equal(got[-1], expected[-1])
    if backend == "reference":
        for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, expected):
            assert torch.equal(a, b), name
    else:
        assert_all_close(got, expected, 1e-12)
    if mask_name == "rows that see nothing":  # rows [0, 16): no key to see, and no sink
        assert not got[0][:, :16].any() and bool(torch.isneginf(got[1][..., :16]).all())
        assert not got[2][:, :16].any()


@pytest.mark.parametrize("backend", ["reference", "sdpa", "cute"])
def test_rows_that_see_nothing_with_a_sink_of_minus_inf(cute_on_cpu, backend):
    """Rows [0, 20) see no key; query heads 0 and 3 have a sink of -inf, 1 and 2 a finite one. The
    rows that see nothing give out 0 and lse -inf under a sink of -inf (their sink under a finite
    one), dq 0, and nothing to d(sinks). The rest as a dense softmax whose sink column is -1e4 where
    the sink is -inf (exp(-1e4 - L) is 0 in fp64), in fp64; no NaN anywhere."""
    mask = first_rows_see_nothing(64, 20)
    q, k, v, sinks, dout = inputs_with_sinks(2, 64, 64, 4, 2, 8, seed=13)
    sinks[[0, 3]] = -math.inf
    got = values_and_grads(with_sinks(backend, mask), q, k, v, sinks, dout)
    assert not any(bool(x.isnan().any()) for x in got)
    out, lse, dq, dk, dv, dsinks = got
    assert not out[:, :20].any() and not dq[:, :20].any()
    assert bool(torch.isneginf(lse[:, [0, 3], :20]).all()) and bool(torch.isfinite(lse[..., 20:]).all())
    assert torch.equal(lse[:, [1, 2], :20], sinks[[1, 2]].to(lse.dtype).view(1, 2, 1).expand(2, 2, 20))
    assert all(bool(torch.isfinite(g).all()) for g in (dq, dk, dv, dsinks)) and not dsinks[[0, 3]].any()

    almost_no_sinks = torch.where(torch.isneginf(sinks), -1e4, sinks)
    attend = mask.to_dense()
    expected = values_and_grads(lambda *x: dense_attention(*x[:3], attend, 0.3, x[3]), q, k, v, almost_no_sinks, dout)
    expected[1][:, [0, 3], :20] = -math.inf  # the one difference: no sink at all, where -1e4 gives -1e4
    assert_all_close(got, expected, 1e-5 if backend == "cute" else 1e-10)  # cute's LSE is fp32


def test_reference_gradcheck_with_a_sink_of_minus_inf_and_rows_that_see_nothing():
    """dq, dk, dv of out and of the LSE against finite differences with sinks [-inf, finite] (a sink
    of -inf has none to take), rows [0, 3) seeing no key (their LSE of -inf taken as 0, which no
    input moves)."""
    mask = first_rows_see_nothing(9, 3)
    q, k, v, sinks, _ = inputs_with_sinks(1, 9, 9, 2, 1, 3, seed=14)
    sinks[0] = -math.inf
    leaves = [x.requires_grad_() for x in (q, k, v)]

    def out_and_finite_lse(*x):
        out, lse = reference_attention(*x, mask, 0.5, sinks=sinks)
        return out, lse.masked_fill(torch.isneginf(lse), 0.0)

    assert torch.autograd.gradcheck(out_and_finite_lse, leaves)


@pytest.mark.parametrize("backend", ["reference", "sdpa", "flex"])
def test_no_keys_at_all_and_sinks_of_minus_inf(backend):
    q, k, v, _, dout = inputs_with_sinks(1, 8, 0, 2, 2, 16)
    sinks = torch.tensor([-math.inf, -math.inf], dtype=torch.float64)
    leaves = [x.requires_grad_() for x in (q, k, v, sinks)]
    out, lse = fm.attention(*leaves[:3], causal=True, backend=backend, return_lse=True, sinks=leaves[3])
    assert not out.any() and bool(torch.isneginf(lse).all())
    dq, _, _, dsinks = torch.autograd.grad(out, leaves, dout)
    assert torch.equal(dq, torch.zeros_like(dq)) and torch.equal(dsinks, torch.zeros_like(dsinks))


def test_join_sinks_and_sinks_backward_where_neither_a_key_nor_the_sink_is_seen():
    """The after-the-fact join on lse -inf and a sink of -inf: out 0, lse -inf, every gradient 0,
    where the plain formulas give NaN (sigmoid(-inf + inf), exp(-inf + inf)); rows with a key or a
    finite sink as before. Under torch.compile(fullgraph=True) too: no branch on values."""
    from flashmask3.reference.attention import join_sinks, sinks_backward

    lse = torch.tensor([[[-math.inf, 0.7, -math.inf], [-math.inf, 0.7, -1.0]]], dtype=torch.float64)  # [1, 2, 3]
    out = torch.randn(1, 3, 2, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(15))
    out[:, 0] = 0
    out[:, 2, 0] = 0  # out is 0 where lse is -inf
    sinks = torch.tensor([-math.inf, 0.2], dtype=torch.float64)
    dout = torch.randn(out.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(16))
    for join in (join_sinks, torch.compile(join_sinks, fullgraph=True, backend="aot_eager")):
        leaves = [x.clone().requires_grad_() for x in (out, lse, sinks)]
        joined_out, joined_lse = join(*leaves)
        dlse = torch.ones_like(joined_lse)
        d_out, d_lse, d_sinks = torch.autograd.grad((joined_out, joined_lse), leaves, (dout, dlse), retain_graph=True)
        for x in (joined_out, d_out, d_lse, d_sinks):
            assert not x.isnan().any()
        # head 0, no sink: out and lse as they were, no d(sink); the gradients passed on unchanged
        # where a key is seen (row 1), 0 where none is (rows 0 and 2)
        assert torch.equal(joined_out[:, :, 0], out[:, :, 0])
        assert torch.equal(joined_lse[:, 0], lse[:, 0]) and d_sinks[0] == 0
        assert torch.equal(d_out[:, 1, 0], dout[:, 1, 0]) and not d_out[:, [0, 2], 0].any()
        assert torch.equal(d_lse[:, 0], torch.tensor([[0.0, 1.0, 0.0]], dtype=torch.float64))
        # head 1, a finite sink: its share, lse the sink's where nothing is seen
        assert torch.equal(joined_lse[0, 1, 0], sinks[1]) and not joined_out[:, 0, 1].any()
        torch.testing.assert_close(joined_lse[:, 1], torch.logaddexp(lse[:, 1], sinks[1]), rtol=0, atol=0)
    # the explicit d(sinks) of the reference and cute: autograd's through the joined out alone
    dsinks = sinks_backward(dout, joined_out.detach(), joined_lse.detach(), sinks, torch.float64)
    through_out = torch.autograd.grad(joined_out, leaves[2], dout)[0]
    assert dsinks[0] == 0 and through_out[0] == 0 and bool(torch.isfinite(dsinks).all())
    torch.testing.assert_close(dsinks, through_out, rtol=1e-12, atol=1e-12)


def test_sinks_in_low_precision_keep_their_dtype():
    q, k, v, dout = random_inputs(1, 128, 128, 4, 2, 32, torch.bfloat16, seed=8)
    sinks = random_sinks(4, 128, seed=8).requires_grad_()  # an fp32 parameter beside bf16 activations
    ins = [x.requires_grad_() for x in (q, k, v)]
    for backend in ("reference", "sdpa"):
        out, lse = fm.attention(*ins, causal=True, backend=backend, return_lse=True, sinks=sinks)
        dsinks = torch.autograd.grad(out, sinks, dout)[0]
        assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32 and dsinks.dtype == torch.float32


@pytest.mark.parametrize(
    "sinks, error, match",
    [
        (
            torch.zeros(2),
            ValueError,
            r"sinks must be a 1-D tensor \[Hq\] = \[4\], one logit per query head, got shape \(2,\)",
        ),
        (torch.zeros(1, 4), ValueError, r"sinks must be a 1-D tensor \[Hq\] = \[4\].* got shape \(1, 4\)"),
        (
            torch.zeros(4, dtype=torch.int64),
            TypeError,
            "sinks dtype must be one of bf16, fp16, fp32, fp64, got torch.int64",
        ),
        ([0.0] * 4, TypeError, r"sinks must be a torch.Tensor \[Hq\] or None, got list"),
        (torch.zeros(4, device="meta"), ValueError, r"sinks must be on q's device \(cpu\), got meta"),
    ],
)
def test_bad_sinks_are_refused_by_name(sinks, error, match):
    q, k, v, _ = random_inputs(1, 16, 16, 4, 2, 8, torch.float64)
    with pytest.raises(error, match=match):
        fm.attention(q, k, v, sinks=sinks)


@pytest.mark.parametrize("mask_name", ["causal_document", "share_question", "random_eviction"])
def test_cute_with_sinks_through_its_custom_ops_matches_the_reference(cute_on_cpu, mask_name):
    """The cute path's plumbing, its kernels stood in for by the reference on the CPU: the sinks
    joined after the forward op, the backward op run on the joined out and LSE, d(sinks) added."""
    mask = masks.build(mask_name, 90, batch=2, heads=4, seed=4)
    q, k, v, sinks, dout = inputs_with_sinks(2, 90, 90, 4, 2, 16, seed=4)

    def run(backend):
        return lambda *x: fm.attention(*x[:3], mask, backend=backend, return_lse=True, sinks=x[3])

    expected = values_and_grads(run("reference"), q, k, v, sinks, dout)
    assert_all_close(values_and_grads(run("cute"), q, k, v, sinks, dout), expected, 1e-5)  # fp32 LSE


# -- verify --------------------------------------------------------------------------------------


def test_verify_suite_and_cli_with_sinks(capsys):
    cases = run_suite("sdpa", ["causal", "qk_sparse"], seqlens=[130], dtype="bf16", heads=2, kv_heads=1, sinks=True)
    assert all(c.report.passed and "dsinks" in c.report.errors for c in cases), [c.report.failures() for c in cases]
    assert verify_main(["sinks=true", "dtype=fp64", "masks=qk_sparse", "seqlens=97", "head_dim=16"]) == 0
    assert "dsinks" in capsys.readouterr().out
    assert verify_main(["backend=sdpa", "sinks=true", "dtype=fp64", "masks=causal", "seqlens=97", "head_dim=16"]) == 0


def test_verify_catches_a_wrong_sink_and_a_wrong_lse_for_rows_that_see_nothing(monkeypatch):
    real = compare_mod.attention
    q, k, v, sinks, dout = inputs_with_sinks(1, 64, 64, 2, 2, 8, seed=9, dtype=torch.float32)
    mask = first_rows_see_nothing(64, 10)

    monkeypatch.setattr(compare_mod, "attention", lambda *a, sinks, **kw: real(*a, sinks=sinks * 1.01, **kw))
    failed = {failure.split(":")[0] for failure in compare("reference", q, k, v, mask, dout, sinks=sinks).failures()}
    assert {"out", "dsinks"} <= failed

    def dead_rows_at_minus_inf(*a, **kw):
        out, lse = real(*a, **kw)
        return out, lse.index_fill(-1, torch.arange(10), -math.inf)

    monkeypatch.setattr(compare_mod, "attention", dead_rows_at_minus_inf)
    assert compare("reference", q, k, v, mask, sinks=sinks).notes == [
        "lse: rows that see no key do not give their sink"
    ]


# -- Hugging Face --------------------------------------------------------------------------------


@pytest.fixture
def hf_reference():
    pytest.importorskip("transformers")
    from flashmask3.integrations import hf

    hf.register(backend="reference")
    return hf


@pytest.mark.parametrize("backend", ["reference", "cute"])
def test_hf_attention_passes_s_aux_on_as_sinks(hf_reference, cute_on_cpu, backend):
    """HF's attention call (q [B, H, S, D]) with gpt-oss's s_aux: a dense causal softmax with a sink
    column, gradients too (cute: its custom ops, the kernels stood in for by the reference)."""
    from transformers import AttentionInterface

    hf_reference.register(backend=backend)
    try:
        forward = AttentionInterface()[hf_reference.NAME]
        q, k, v, sinks, dout = inputs_with_sinks(2, 21, 21, 4, 2, 8, seed=10)
        causal = torch.ones(21, 21, dtype=torch.bool).tril()[None, None]
        leaves = [x.clone().requires_grad_() for x in (q, k, v, sinks)]
        heads_first = (x.transpose(1, 2) for x in leaves[:3])
        out, _ = forward(SimpleNamespace(is_causal=True), *heads_first, None, scaling=0.4, s_aux=leaves[3])
        dense = values_and_grads(lambda *x: dense_attention(*x[:3], causal, 0.4, x[3]), q, k, v, sinks, dout)
        grads = torch.autograd.grad(out, leaves, dout)
        tol = 1e-10 if backend == "reference" else 1e-5  # cute's LSE is fp32
        torch.testing.assert_close([out, *grads], dense[:1] + dense[2:], rtol=tol, atol=tol)
    finally:
        hf_reference.register(backend="reference")


def test_hf_gpt_oss_matches_eager(hf_reference):
    """A tiny gpt-oss (sinks in every layer, a sliding-window layer and a full one, GQA) in fp64:
    logits, loss, the sinks' gradients and greedy generation as its eager attention gives them."""
    import transformers

    config = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_local_experts=2,
        num_experts_per_tok=1,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention"],
        experts_implementation="eager",  # the grouped matmul takes no fp64
    )
    torch.manual_seed(11)
    ours, eager = (
        transformers.GptOssForCausalLM(transformers.GptOssConfig(**config, attn_implementation=name)).double()
        for name in (hf_reference.NAME, "eager")
    )
    for layer in ours.model.layers:
        torch.nn.init.normal_(layer.self_attn.sinks)
    eager.load_state_dict(ours.state_dict())
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(11))
    got, expected = (model(input_ids=ids, labels=ids) for model in (ours, eager))
    assert (got.logits - expected.logits).abs().max() < 1e-10
    sink_grads = [
        torch.autograd.grad(result.loss, [layer.self_attn.sinks for layer in model.model.layers])
        for result, model in ((got, ours), (expected, eager))
    ]
    for a, b in zip(*sink_grads):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12)
    ours.eval(), eager.eval()
    generated = [model.generate(ids, max_new_tokens=5, do_sample=False) for model in (ours, eager)]
    assert torch.equal(*generated)
