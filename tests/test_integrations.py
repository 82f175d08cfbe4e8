"""Integrations: the cute kernels as custom ops under torch.compile (on CPU through a reference
kernel registered for the CPU dispatch key), PaddlePaddle's `flashmask_attention` with its
docstring's masks, and Hugging Face transformers with `attn_implementation=hf.NAME` (skipped
without transformers)."""

import math

import numpy as np
import pytest
import torch
from flashmask3.optimized import ops
from flashmask3.reference import ColumnMask
from torch._subclasses.fake_tensor import FakeTensorMode

import flashmask3 as fm


def dense_attention(q, k, v, attend, scale=None):
    """fp64 SDPA with a dense bool mask [B or 1, H or 1, Sq, Sk] (True = attend); rows that see no key
    give 0, as flashmask3's do."""
    qh, kh, vh = (x.transpose(1, 2) for x in (q, k, v))
    kh, vh = (x.repeat_interleave(q.shape[2] // k.shape[2], dim=1) for x in (kh, vh))
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = (qh @ kh.transpose(-1, -2) * scale).masked_fill(~attend, -math.inf)
    weights = torch.softmax(scores, -1).nan_to_num(0.0)
    return (weights @ vh).transpose(1, 2)


def random_qkv(batch, seqlen, heads_q, heads_kv, head_dim, seed=0, requires_grad=False):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(batch, seqlen, heads_q, head_dim)] + 2 * [(batch, seqlen, heads_kv, head_dim)]
    return [torch.randn(s, generator=gen, dtype=torch.float64).requires_grad_(requires_grad) for s in shapes]


# -- the cute custom ops --------------------------------------------------------------------------


def test_fake_implementations_give_the_kernels_shapes_and_dtypes():
    with FakeTensorMode():
        q = torch.empty(2, 300, 8, 128, dtype=torch.bfloat16, device="cuda")
        k = torch.empty(2, 200, 2, 128, dtype=torch.bfloat16, device="cuda")
        rows = torch.empty(2, 1, 200, 2, dtype=torch.int32, device="cuda")
        out, lse = ops.cute_forward(q, k, k, rows, False, True, 0.1, False)
        dq, dk, dv = ops.cute_backward(out, q, k, k, out, lse, None, False, 0.1, True)
    assert (out.shape, out.dtype, out.device.type) == ((2, 300, 8, 128), torch.bfloat16, "cuda")
    assert (lse.shape, lse.dtype) == ((2, 8, 300), torch.float32)
    assert [tuple(g.shape) for g in (dq, dk, dv)] == [(2, 300, 8, 128), (2, 200, 2, 128), (2, 200, 2, 128)]
    assert all(g.dtype == torch.bfloat16 and g.is_contiguous() for g in (dq, dk, dv))


@pytest.mark.parametrize("mask_name", [None, "causal_document", "share_question"])
def test_opcheck_of_the_forward_and_backward_ops(cute_on_cpu, mask_name):
    q, k, v = random_qkv(2, 70, 4, 2, 16, seed=1, requires_grad=True)
    mask = masks_or_none(mask_name, 70)
    rows, causal = (None, False) if mask is None else (mask.startend_row_indices, mask.causal)
    segmented = mask is not None and mask.segmented
    torch.library.opcheck(ops.cute_forward, (q, k, v, rows, causal, segmented, 0.25, False))
    out, lse = ops.cute_forward(q, k, v, rows, causal, segmented, 0.25, False)
    args = (torch.randn_like(out), *(x.detach() for x in (q, k, v, out, lse)), rows, causal, 0.25, False)
    torch.library.opcheck(ops.cute_backward, args)


def test_the_segmented_hint_reaches_the_forward_op(cute_on_cpu):
    """The document constructors' hint travels to the forward op (where the kernel picks its tiles
    by it): through `attention` and `varlen_attention`; a mask from raw
    boundaries and a causal window do not carry it."""
    from conftest import _reference_forward

    seen = []

    def recording(q, k, v, row_indices, causal, segmented, *rest):
        seen.append(segmented)
        return _reference_forward(q, k, v, row_indices, causal, segmented, *rest)

    ops.cute_forward.register_kernel("cpu", recording)
    q, k, v = (x.float() for x in random_qkv(1, 12, 2, 2, 16, seed=2))
    documents = ColumnMask.causal_document(torch.tensor([0, 5, 12]))
    raw = ColumnMask(documents.startend_row_indices, True, 12)
    for mask in (documents, raw, fm.masks.build("causal", 12)):
        fm.attention(q, k, v, mask, backend="cute")
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    fm.varlen_attention(q[0], k[0], v[0], cu, cu, 7, 7, causal=True, backend="cute")
    assert seen == [True, False, False, True]


def test_the_causal_mask_alone_reaches_the_ops_without_bounds(cute_on_cpu):
    """`attention(causal=True)` (no window, no documents) reaches the forward op as no boundaries and
    causal (the kernels then plan it as the causal mask alone), with Sq != Sk bottom-right aligned:
    the outputs and gradients of the same causal mask given as a ColumnMask; a window keeps its
    boundaries."""
    from conftest import _reference_forward

    seen = []

    def recording(q, k, v, row_indices, causal, *rest):
        seen.append((row_indices is None, causal))
        return _reference_forward(q, k, v, row_indices, causal, *rest)

    ops.cute_forward.register_kernel("cpu", recording)
    q, k, v = random_qkv(2, 40, 4, 2, 16, seed=5, requires_grad=True)
    for queries in (q, q[:, 25:]):  # Sq = Sk, then 15 queries against 40 keys
        out = fm.attention(queries, k, v, causal=True, backend="cute")
        mask = ColumnMask._band(queries.shape[1], 40, -1, -1, True)
        want = fm.attention(queries, k, v, mask, backend="reference")
        dout = torch.randn_like(out)
        for got, expected in zip(torch.autograd.grad(out, (q, k, v), dout), torch.autograd.grad(want, (q, k, v), dout)):
            assert ((got - expected).norm() / expected.norm()).item() < 1e-6
        assert (out - want).abs().max() < 1e-12
    fm.attention(q, k, v, causal=True, window_size=(7, 0), backend="cute")
    assert seen == [(True, True), (True, True), (False, True)]


def test_the_ops_take_transformers_views_without_a_copy(cute_on_cpu):
    """q, k and v as transformers passes them ([B, S, H, D] views of [B, H, S, D]) reach the forward
    op as they are (the kernels' TMA reads them in place), the backward op gets those very tensors
    back, and the gradients are the reference's, on the views."""
    from conftest import _reference_backward, _reference_forward

    seen = {}

    def forward(q, k, v, *rest):
        seen["forward"] = [x.data_ptr() for x in (q, k, v)]
        assert not any(x.is_contiguous() for x in (q, k, v))
        return _reference_forward(q, k, v, *rest)

    def backward(dout, q, k, v, *rest):
        seen["backward"] = [x.data_ptr() for x in (q, k, v)]
        return _reference_backward(dout, q, k, v, *rest)

    ops.cute_forward.register_kernel("cpu", forward)
    ops.cute_backward.register_kernel("cpu", backward)
    heads_major = [x.transpose(1, 2).contiguous() for x in random_qkv(2, 40, 4, 2, 16, seed=4)]
    leaves = [x.requires_grad_() for x in heads_major]
    mask = fm.masks.build("causal_document", 40, batch=2, seed=4)
    views = [x.transpose(1, 2) for x in leaves]
    out = fm.attention(*views, mask, backend="cute")
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, dout)
    expected = torch.autograd.grad(fm.attention(*views, mask, backend="reference"), leaves, dout)
    assert seen["backward"] == seen["forward"] == [x.data_ptr() for x in leaves]
    for grad, want in zip(grads, expected):  # the ops' backward reads the fp32 LSE the kernel keeps
        assert ((grad - want).norm() / want.norm()).item() < 1e-6


def masks_or_none(name, seqlen):
    return None if name is None else fm.masks.build(name, seqlen, batch=2, seed=3)


def test_cute_ops_match_the_reference_backend(cute_on_cpu):
    q, k, v = random_qkv(2, 150, 4, 2, 16, seed=2, requires_grad=True)
    mask = fm.masks.build("causal_document", 150, batch=2, seed=2)
    out, lse = fm.attention(q, k, v, mask, backend="cute", return_lse=True)
    ref_out, ref_lse = fm.attention(q, k, v, mask, backend="reference", return_lse=True)
    assert lse.dtype == torch.float32 and lse.requires_grad
    assert (out - ref_out).abs().max() < 1e-12 and (lse - ref_lse).abs().max() < 1e-6
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref_grads = torch.autograd.grad(ref_out, (q, k, v), dout)
    for grad, ref_grad in zip(grads, ref_grads):  # the ops' backward reads the fp32 LSE the kernel keeps
        assert ((grad - ref_grad).norm() / ref_grad.norm()).item() < 1e-6


@pytest.mark.parametrize("backend", ["cute", "reference"])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_a_loss_on_the_lse_has_the_dense_gradients(cute_on_cpu, backend, with_sinks):
    """The LSE is differentiable on every backend: a loss on out and the LSE (and on the LSE alone)
    gives textbook autograd's dQ, dK, dV and d(sinks) (GQA, Sq > Sk, rows that see no key)."""
    from conftest import dense_attention

    q = random_qkv(2, 45, 4, 2, 16, seed=7, requires_grad=True)[0]
    _, k, v = random_qkv(2, 33, 4, 2, 16, seed=8, requires_grad=True)
    documents = fm.masks.build("causal_document", 33, batch=2, seed=7)
    mask = ColumnMask(documents.startend_row_indices, True, 45)  # the first 12 rows see no key
    sinks = torch.randn(4, dtype=torch.float64, requires_grad=True) if with_sinks else None
    leaves = (q, k, v) + ((sinks,) if with_sinks else ())
    weights = torch.randn(2, 4, 45, dtype=torch.float64)
    want_out, want_lse = dense_attention(q, k, v, mask.to_dense(), 16**-0.5, sinks)
    out, lse = fm.attention(q, k, v, mask, backend=backend, return_lse=True, sinks=sinks)
    finite = torch.isfinite(want_lse)
    assert torch.equal(finite, torch.isfinite(lse)) and finite.all() == with_sinks  # rows that see no key
    losses = (
        lambda o, log_sum: o.sum() + (log_sum * weights)[finite].sum(),
        lambda o, log_sum: (log_sum * weights)[finite].sum(),
    )
    for loss_of in losses:
        want = torch.autograd.grad(loss_of(want_out, want_lse), leaves, retain_graph=True, allow_unused=True)
        got = torch.autograd.grad(loss_of(out, lse), leaves, retain_graph=True, allow_unused=True)
        for name, g, w in zip("q k v sinks".split(), got, want):
            w = torch.zeros_like(g) if w is None else w  # v takes no gradient from the LSE alone
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6, msg=name)  # the LSE is kept in fp32


@pytest.mark.parametrize("mask_name", ["causal_document", "share_question"])
def test_compiled_block_calling_the_cute_backend_has_no_graph_break_and_matches_eager(cute_on_cpu, mask_name):
    """A block (projections around attention, backend="cute") under torch.compile(fullgraph=True):
    no graph break, and its loss and gradients equal eager's (fp64). The aot_eager backend: Dynamo
    and AOTAutograd (the fake implementations, the registered backward), no C++ compiler needed."""
    torch.manual_seed(4)
    b, s, h, d = 2, 100, 4, 16
    proj = torch.nn.Linear(h * d, 3 * h * d, dtype=torch.float64)
    mask = fm.masks.build(mask_name, s, batch=b, seed=4)

    def block(x, mask):
        q, k, v = proj(x).view(b, s, 3, h, d).unbind(2)
        return fm.attention(q, k, v, mask, backend="cute").square().mean()

    x = torch.randn(b, s, h * d, dtype=torch.float64, requires_grad=True)
    assert torch._dynamo.explain(block)(x, mask).graph_break_count == 0
    eager_loss = block(x, mask)
    eager_grads = torch.autograd.grad(eager_loss, (x, proj.weight))
    compiled_loss = torch.compile(block, fullgraph=True, backend="aot_eager")(x, mask)
    compiled_grads = torch.autograd.grad(compiled_loss, (x, proj.weight))
    assert abs(compiled_loss.item() - eager_loss.item()) < 1e-6 and eager_loss.item() > 0
    for compiled, eager in zip(compiled_grads, eager_grads):
        assert (compiled - eager).abs().max() < 1e-6 and eager.abs().max() > 0


# -- PaddlePaddle's flashmask_attention ----------------------------------------------------------

# The masks of Paddle's flashmask_attention docstring (10 tokens): its startend_row_indices, and the
# dense mask each stands for, written as a rule on (query i, key j).
_i = torch.arange(10).view(-1, 1)
_j = torch.arange(10).view(1, -1)
_doc = torch.tensor([0, 0, 0, 0, 1, 1, 1, 2, 2, 2])  # documents [0, 4), [4, 7), [7, 10)
PADDLE_EXAMPLES = {
    "causal, rows from 8 see nothing": (True, [[8] * 10], (_j <= _i) & (_i < 8)),
    "sliding window": (True, [[3, 4, 5, 6, 7, 8, 9, 10, 10, 10]], (_j <= _i) & (_i - 3 < _j)),
    "causal document": (True, [[4, 4, 4, 4, 7, 7, 7, 10, 10, 10]], (_j <= _i) & (_doc[:, None] == _doc)),
    "document": (False, [[4, 4, 4, 4, 7, 7, 7, 10, 10, 10], [0, 0, 0, 0, 4, 4, 4, 7, 7, 7]], _doc[:, None] == _doc),
    "share question": (  # question [0, 4), answers [4, 7) and [7, 10)
        True,
        [[10, 10, 10, 10, 7, 7, 7, 10, 10, 10]],
        (_j <= _i) & ((_j < 4) | (_doc[:, None] == _doc)),
    ),
    "global + sliding window": (
        False,
        [[10, 10, 4, 5, 6, 7, 8, 9, 10, 10], [10] * 10, [0, 0, 0, 0, 2, 2, 2, 2, 2, 2], [0, 0, 0, 0, 3, 4, 5, 6, 7, 8]],
        (_i < 2) | (_j < 2) | ((_i - _j).abs() <= 1),
    ),
    "causal blockwise": (  # the last block sees every earlier one
        True,
        [[4, 4, 4, 4, 10, 10, 10, 10, 10, 10], [7, 7, 7, 7, 10, 10, 10, 10, 10, 10]],
        (_j <= _i) & ((_doc[:, None] == _doc) | (_i >= 7)),
    ),
    "prefix-LM document": (  # documents [0, 3), [3, 5), [5, 10), prefixes of 2
        False,
        [[3, 3, 3, 5, 5, 10, 10, 10, 10, 10], [0, 0, 2, 3, 3, 5, 5, 7, 8, 9]],
        (torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2, 2]).view(-1, 1) == torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2, 2]))
        & ((_j <= _i) | torch.isin(_j, torch.tensor([0, 1, 3, 4, 5, 6]))),
    ),
    "prefix-LM causal": (False, [[10] * 10, [0, 0, 0, 0, 0, 5, 6, 7, 8, 9]], (_j <= _i) | (_j < 5)),
    "QK-sparse": (
        True,
        [[10, 10, 2, 3, 4, 5, 6, 7, 10, 10], [10, 10, 5, 5, 5, 5, 8, 8, 10, 10]],
        (_j <= _i) & ~((_i >= 2) & (_i < 5) & (_j >= 2)) & ~((_i >= 6) & (_i < 8) & (_j >= 6)),
    ),
}


@pytest.mark.parametrize("name", PADDLE_EXAMPLES)
def test_flashmask_attention_on_the_paddle_docstring_masks(name):
    causal, vectors, attend = PADDLE_EXAMPLES[name]
    rows = torch.tensor(vectors, dtype=torch.int32).T.reshape(1, 1, 10, len(vectors))
    assert ColumnMask(rows, causal, 10).to_dense()[0, 0].equal(attend)
    q, k, v = random_qkv(1, 10, 4, 2, 8, seed=5)
    out, lse = fm.flashmask_attention(q, k, v, rows, causal=causal, return_softmax_lse=True)
    assert (out - dense_attention(q, k, v, attend)).abs().max() < 1e-12
    assert lse.shape == (1, 4, 10) and lse.dtype == torch.float32
    assert torch.isneginf(lse[0, :, ~attend.any(-1)]).all()  # rows that see no key


def test_paddle_docstring_masks_are_those_of_the_constructors():
    cu = [0, 4, 7, 10]
    made = {
        "sliding window": ColumnMask.sliding_window(10, 3),
        "causal document": ColumnMask.causal_document(cu),
        "document": ColumnMask.document(cu),
        "share question": ColumnMask.share_question(cu, [True, False, False]),
        "prefix-LM document": ColumnMask.prefix_lm_document([0, 3, 5, 10], [2, 2, 2]),
        "prefix-LM causal": ColumnMask.prefix_lm_document([0, 10], [5]),
        "global + sliding window": ColumnMask.global_sliding_window(10, window=1, global_tokens=2),
    }
    for name, mask in made.items():
        causal, _, attend = PADDLE_EXAMPLES[name]
        assert mask.causal == causal and mask.to_dense()[0, 0].equal(attend), name


def test_paddle_first_example_per_head_masks_and_gqa():
    """Paddle's first example: two heads, rows from 8 (head 0) and from 5 (head 1) see nothing."""
    rows = torch.tensor([8] * 10 + [5] * 10, dtype=torch.int32).view(1, 2, 10, 1)
    q, k, v = random_qkv(1, 10, 4, 2, 8, seed=6)
    out = fm.flashmask_attention(q, k, v, rows, causal=True)
    attend = torch.stack([(_j <= _i) & (_i < 8), (_j <= _i) & (_i < 5)])[None]  # per kv head
    assert (out - dense_attention(q, k, v, attend.repeat_interleave(2, dim=1))).abs().max() < 1e-12
    assert not out[0, 8:, :2].any() and not out[0, 5:, 2:].any() and out[0, 7, 0].abs().sum() > 0


@pytest.mark.parametrize(
    "window_size, causal, attend",
    [
        (2, True, (_j <= _i) & (_j >= _i - 2)),  # [i - 2, i]
        ((3, 5), True, (_j <= _i) & (_j >= _i - 3)),  # the right side is not used when causal
        (2, False, (_i - _j).abs() <= 2),
        ((1, 3), False, (_j >= _i - 1) & (_j <= _i + 3)),
        ((np.int64(1), np.int32(3)), False, (_j >= _i - 1) & (_j <= _i + 3)),  # numpy ints as ints
    ],
)
def test_flashmask_attention_window_size(window_size, causal, attend):
    q, k, v = random_qkv(2, 10, 2, 1, 8, seed=7)
    out = fm.flashmask_attention(q, k, v, causal=causal, window_size=window_size)
    assert (out - dense_attention(q, k, v, attend)).abs().max() < 1e-12


def test_flashmask_attention_without_a_mask_and_with_a_scale():
    q, k, v = random_qkv(1, 10, 2, 2, 8, seed=8)
    full = torch.ones(10, 10, dtype=torch.bool)
    assert (fm.flashmask_attention(q, k, v) - dense_attention(q, k, v, full)).abs().max() < 1e-12
    causal = fm.flashmask_attention(q, k, v, causal=True, softmax_scale=0.5)
    assert (causal - dense_attention(q, k, v, _j <= _i, scale=0.5)).abs().max() < 1e-12
    no_dropout = fm.flashmask_attention(q, k, v, dropout=0.1, training=False, name="attn")  # Paddle: none then
    assert torch.equal(no_dropout, fm.flashmask_attention(q, k, v))


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"dropout": 0.1}, ValueError, "dropout=0.1 with training=True"),
        ({"return_seed_offset": True}, ValueError, "return_seed_offset=True"),
        ({"fixed_seed_offset": torch.zeros(2, dtype=torch.int64)}, ValueError, "fixed_seed_offset"),
        ({"rng_name": "local_seed"}, ValueError, "rng_name='local_seed'"),
        ({"window_size": -1}, ValueError, "window_size must be an int >= 0"),
        ({"window_size": (1, 2, 3)}, ValueError, "window_size must be an int >= 0"),
        ({"window_size": (True, 0)}, ValueError, r"window_size must be an int >= 0 .*\(True, 0\)"),
        (
            {"startend_row_indices": torch.full((1, 1, 10, 1), 10, dtype=torch.int32), "window_size": 2},
            ValueError,
            "window_size and startend_row_indices cannot be given together",
        ),
        (
            {"startend_row_indices": torch.full((1, 1, 10, 1), 10), "causal": True},
            TypeError,
            "startend_row_indices must be int32",
        ),
        (
            {"startend_row_indices": torch.full((1, 1, 10, 3), 10, dtype=torch.int32)},
            ValueError,
            r"last dim must be one of \(2, 4\) when causal=False",
        ),
    ],
)
def test_flashmask_attention_refuses_what_it_cannot_honour(kwargs, error, match):
    q, k, v = random_qkv(1, 10, 2, 2, 8)
    with pytest.raises(error, match=match):
        fm.flashmask_attention(q, k, v, **kwargs)


# -- Hugging Face transformers -------------------------------------------------------------------

LENGTHS = (5, 9, 7)  # the packed documents


@pytest.fixture(scope="module")
def transformers():
    transformers = pytest.importorskip("transformers")
    from flashmask3.integrations import hf

    hf.register(backend="reference")
    return transformers


@pytest.fixture(scope="module")
def llama(transformers):
    """A 2-layer GQA Llama (4 query heads, 2 kv heads) with attn_implementation=hf.NAME, and the same
    weights with sdpa, in fp64."""
    return ours_and_sdpa(transformers.LlamaForCausalLM, transformers.LlamaConfig, seed=0)


def ours_and_sdpa(model_class, config_class, seed: int, **config_changes):
    """A tiny 2-layer GQA decoder (4 query heads, 2 kv heads of 8) of `model_class` with
    attn_implementation=hf.NAME, and the same weights with sdpa, in fp64."""
    from flashmask3.integrations import hf

    torch.manual_seed(seed)
    config = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        **config_changes,
    )
    model = model_class(config_class(**config, attn_implementation=hf.NAME)).double()
    sdpa = model_class(config_class(**config, attn_implementation="sdpa")).double()
    sdpa.load_state_dict(model.state_dict())
    return model, sdpa


@pytest.fixture(scope="module")
def packed(transformers):
    """HF's padding-free batch of three documents: input_ids, labels, position_ids, cu_seq_lens."""
    gen = torch.Generator().manual_seed(1)
    features = [{"input_ids": torch.randint(0, 64, (n,), generator=gen).tolist()} for n in LENGTHS]
    return transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)(features)


def document_mask(lengths=LENGTHS):
    """The dense per-document causal mask [1, 1, S, S] (True = attend)."""
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    i = torch.arange(len(doc))
    return ((doc[:, None] == doc[None]) & (i[None] <= i[:, None]))[None, None]


def assert_same(ours, sdpa, rows=slice(None)):
    assert (ours.logits[:, rows] - sdpa.logits[:, rows]).abs().max() < 1e-6
    if ours.loss is not None:
        assert abs(ours.loss.item() - sdpa.loss.item()) < 1e-6


@pytest.mark.parametrize("use_cache", [False, True])
def test_packed_batch_matches_sdpa_with_the_dense_document_mask(llama, packed, use_cache):
    """Padding-free packing (position_ids from DataCollatorWithFlattening): logits, loss and gradients
    equal sdpa's given the dense per-document causal mask. With use_cache=True too (the default),
    where HF's sdpa mask does not look for packing."""
    model, sdpa = llama
    ids, labels, positions = packed["input_ids"], packed["labels"], packed["position_ids"]
    ours = model(input_ids=ids, position_ids=positions, labels=labels, use_cache=use_cache)
    theirs = sdpa(input_ids=ids, position_ids=positions, labels=labels, attention_mask=document_mask())
    assert_same(ours, theirs)
    grads = torch.autograd.grad(ours.loss, list(model.parameters()))
    sdpa_grads = torch.autograd.grad(theirs.loss, list(sdpa.parameters()))
    assert max((a - b).abs().max().item() for a, b in zip(grads, sdpa_grads)) < 1e-6


def test_packed_batch_matches_each_document_run_alone(llama, packed):
    model, sdpa = llama
    ids = packed["input_ids"]
    ours = model(input_ids=ids, position_ids=packed["position_ids"]).logits
    bounds = packed["cu_seq_lens_q"].tolist()
    alone = torch.cat([sdpa(input_ids=ids[:, a:b]).logits for a, b in zip(bounds[:-1], bounds[1:])], dim=1)
    assert (ours - alone).abs().max() < 1e-6


def test_positions_that_jump_with_a_padding_mask_are_one_sequence_per_row(llama):
    """PoSE-style positions (a jump, no restart) with a 2-D attention_mask at batch 2: HF infers no
    packing there (sdpa and flex only without the mask, FlashAttention only at batch 1), so every
    row attends over all of itself, as sdpa does."""
    model, sdpa = llama
    ids = torch.randint(0, 64, (2, 20), generator=torch.Generator().manual_seed(6))
    keep = torch.ones(2, 20, dtype=torch.long)
    positions = torch.cat([torch.arange(10), torch.arange(50, 60)])[None].expand(2, -1)
    ours = model(input_ids=ids, attention_mask=keep, position_ids=positions)
    assert_same(ours, sdpa(input_ids=ids, attention_mask=keep, position_ids=positions))
    split = sdpa(input_ids=ids, position_ids=positions, attention_mask=document_mask((10, 10)).expand(2, -1, -1, -1))
    assert (ours.logits[:, 10:] - split.logits[:, 10:]).abs().max() > 1e-3  # a split would have mattered


def test_a_packed_row_without_a_mask_splits_where_positions_restart_not_where_they_jump(llama):
    """A batch of one without attention_mask: a document starts where the position drops back to 0
    (HF's FlashAttention rule), not at a jump inside a document (here 2 -> 10 in the second one)."""
    model, sdpa = llama
    ids = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(7))
    positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 10, 11, 12, 13]])
    ours = model(input_ids=ids, position_ids=positions, use_cache=False)
    assert_same(ours, sdpa(input_ids=ids, position_ids=positions, attention_mask=document_mask((5, 7))))
    three = document_mask((5, 3, 4))  # had the jump split too
    assert (ours.logits - sdpa(input_ids=ids, position_ids=positions, attention_mask=three).logits).abs().max() > 1e-3


def test_cu_seq_lens_give_the_documents(llama, packed):
    """FlashAttention's cu_seq_lens_q / cu_seq_lens_k (return_flash_attn_kwargs=True) mark the documents
    even with the default, unpacked positions."""
    model, sdpa = llama
    ids, cu = packed["input_ids"], packed["cu_seq_lens_q"]
    ours = model(input_ids=ids, cu_seq_lens_q=cu, cu_seq_lens_k=cu.clone(), max_length_q=9, max_length_k=9)
    assert_same(ours, sdpa(input_ids=ids, attention_mask=document_mask()))
    with pytest.raises(ValueError, match="cu_seq_lens_k must equal cu_seq_lens_q"):
        model(input_ids=ids, cu_seq_lens_q=cu, cu_seq_lens_k=torch.tensor([0, 5, 15, 21], dtype=torch.int32))


@pytest.mark.parametrize("kind", ["prefix_lm_document", "share_question"])
def test_a_column_mask_passes_through_the_model_call(llama, packed, kind):
    """Masks varlen attention cannot express, given as attention_mask=mask (the ColumnMask as it is):
    the same logits as sdpa with the mask's dense form."""
    model, sdpa = llama
    cu = packed["cu_seq_lens_q"]
    if kind == "prefix_lm_document":
        mask = ColumnMask.prefix_lm_document(cu, torch.tensor([2, 4, 3]))
    else:  # a question of 5 tokens, answers of 9 and 7
        mask = ColumnMask.share_question(cu, torch.tensor([True, False, False]))
    ids, labels = packed["input_ids"], packed["labels"]
    ours = model(input_ids=ids, attention_mask=mask, labels=labels)
    theirs = sdpa(input_ids=ids, attention_mask=mask.to_dense(), labels=labels)
    assert_same(ours, theirs)
    causal = model(input_ids=ids, labels=labels)  # the mask made a difference
    assert (causal.logits - ours.logits).abs().max() > 1e-3


def test_a_dense_4d_mask_is_converted_exactly(llama, packed):
    model, sdpa = llama
    ids = packed["input_ids"]
    mask = ColumnMask.prefix_lm_document(packed["cu_seq_lens_q"], torch.tensor([3, 1, 6])).to_dense()
    theirs = sdpa(input_ids=ids, attention_mask=mask)
    assert_same(model(input_ids=ids, attention_mask=mask), theirs)
    additive = torch.zeros(mask.shape, dtype=torch.float64).masked_fill(~mask, torch.finfo(torch.float64).min)
    assert_same(model(input_ids=ids, attention_mask=additive), theirs)


def assert_same_generation(model, sdpa, cache):
    """Greedy generation from a left-padded batch (2-D attention_mask) through a dynamic or static
    cache: the queries of each step against the cached keys."""
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(2))
    keep = torch.ones(2, 8, dtype=torch.long)
    keep[0, :3] = 0
    assert_same(
        model(input_ids=ids, attention_mask=keep), sdpa(input_ids=ids, attention_mask=keep), rows=slice(3, None)
    )
    model.eval(), sdpa.eval()
    try:
        ours, theirs = (
            m.generate(ids, attention_mask=keep, max_new_tokens=6, do_sample=False, cache_implementation=cache)
            for m in (model, sdpa)
        )
    finally:
        model.train(), sdpa.train()
    assert ours.shape == (2, 14) and torch.equal(ours, theirs)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_padding_and_generation_match_sdpa(llama, cache):
    assert_same_generation(*llama, cache)


def test_packed_sliding_window_matches_sdpa(transformers):
    """Mistral's sliding window (3 keys) within packed documents."""

    model, sdpa = ours_and_sdpa(transformers.MistralForCausalLM, transformers.MistralConfig, seed=3, sliding_window=3)
    ids = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(3))
    positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6]])
    i = torch.arange(12)
    window = (i[None] > i[:, None] - 3)[None, None]
    ours = model(input_ids=ids, position_ids=positions, use_cache=False)
    assert_same(ours, sdpa(input_ids=ids, position_ids=positions, attention_mask=document_mask((5, 7)) & window))
    for cache in ("dynamic", "static"):
        assert_same_generation(model, sdpa, cache)


@pytest.mark.parametrize(
    "name, window", [("causal", (-1, 0)), ("sliding_window_causal", (2, 0)), ("bidirectional", (-1, -1))]
)
def test_packing_without_position_remapping_is_read(transformers, name, window):
    """transformers 5.17 packs with and_masks(mask function, packed_sequence_mask_function) alone;
    newer versions also wrap the mask function to remap positions."""
    from flashmask3.integrations import hf

    masking_utils = transformers.masking_utils
    mask_function = getattr(masking_utils, f"{name}_mask_function")
    if name.startswith("sliding"):
        mask_function = mask_function(3)
    packed = masking_utils.packed_sequence_mask_function(torch.zeros(1, 4, dtype=torch.long))
    assert hf._window_of(masking_utils.and_masks(mask_function, packed)) == window


def test_packed_bidirectional_model_matches_sdpa(transformers):
    """A bidirectional model (config is_causal=False): attention within each packed document."""

    model, sdpa = ours_and_sdpa(transformers.LlamaModel, transformers.LlamaConfig, seed=5, is_causal=False)
    ids = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(5))
    positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6]])
    doc = torch.tensor([0] * 5 + [1] * 7)
    ours = model(input_ids=ids, position_ids=positions).last_hidden_state
    theirs = sdpa(input_ids=ids, position_ids=positions, attention_mask=(doc[:, None] == doc)[None, None])
    assert (ours - theirs.last_hidden_state).abs().max() < 1e-6


def test_what_flashmask3_cannot_honour_raises_naming_it(llama, packed, transformers):
    from transformers.masking_utils import create_causal_mask

    from flashmask3.integrations import hf

    model, _ = llama
    ids = packed["input_ids"]
    q = torch.randn(1, 4, 21, 8, dtype=torch.float64)
    k = torch.randn(1, 2, 21, 8, dtype=torch.float64)
    forward = transformers.AttentionInterface()[hf.NAME]
    layer = model.model.layers[0].self_attn
    for name, value in (("softcap", 30.0), ("position_bias", torch.zeros(1, 4, 21, 21))):
        with pytest.raises(ValueError, match=f"^{name}: flashmask3 does not support it"):
            forward(layer, q, k, k, None, **{name: value})
    with pytest.raises(ValueError, match="^sliding_window=4, but the model's mask function has no window"):
        forward(layer, q, k, k, hf._create_mask(1, 21, 21), sliding_window=4)
    with pytest.raises(ValueError, match="^output_attentions=True"):
        model(input_ids=ids, output_attentions=True)
    with pytest.raises(ValueError, match=r"^mask_function: .* or_mask"):
        create_causal_mask(model.config, torch.zeros(1, 21, 32), None, None, or_mask_function=lambda b, h, i, j: j < 2)
    layer.attention_dropout = 0.1  # as from the config's attention_dropout, in training
    try:
        with pytest.raises(ValueError, match=r"^dropout=0.1: flashmask3 has no attention dropout"):
            model(input_ids=ids)
    finally:
        layer.attention_dropout = 0.0
    three_runs = torch.ones(1, 1, 21, 21, dtype=torch.bool)
    three_runs[..., [3, 6, 9], 0] = False  # key 0 hidden from three separate rows: two intervals at most
    with pytest.raises(ValueError, match="^attention_mask: this dense mask is not a FlashMask column mask"):
        model(input_ids=ids, attention_mask=three_runs)
    with pytest.raises(ValueError, match=r"^attention_mask: takes a 2-D padding mask .* got shape \(1, 21, 21\)"):
        model(input_ids=ids, attention_mask=torch.ones(1, 21, 21, dtype=torch.bool))
    with pytest.raises(ValueError, match="^attention_mask: an additive mask must hold only 0"):
        model(input_ids=ids, attention_mask=torch.full((1, 1, 21, 21), -1.0, dtype=torch.float64))
    with pytest.raises(ValueError, match="^unknown backend 'triton'"):
        hf.register(backend="triton")
    with pytest.raises(ValueError, match="^name must be a non-empty string without 'flash'.* got 'my_flash'"):
        hf.register(backend="reference", name="my_flash")


def test_compiled_model_with_a_column_mask_has_no_graph_break(llama, packed, cute_on_cpu):
    """The model under torch.compile(fullgraph=True) with backend="cute" (the custom ops) and the
    documents given as a ColumnMask: one graph, the eager loss."""
    from flashmask3.integrations import hf

    model, _ = llama
    ids, labels, positions = packed["input_ids"], packed["labels"], packed["position_ids"]
    mask = ColumnMask.causal_document(position_ids=positions)
    hf.register(backend="cute")
    try:

        def loss(ids, mask):
            return model(input_ids=ids, position_ids=positions, attention_mask=mask, labels=labels).loss

        eager = loss(ids, mask)
        compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")(ids, mask)
    finally:
        hf.register(backend="reference")
    assert abs(compiled.item() - eager.item()) < 1e-6 and eager.item() > 0


def test_the_layers_of_one_forward_share_one_built_mask(llama, packed, monkeypatch):
    """The mask is built from the spec and the packing metadata once per forward (both layers get
    the same ColumnMask object, so the kernels' tile orders are sorted once); new metadata tensors
    or an in-place change of them build it again, and the logits follow the new documents."""
    from flashmask3.integrations import hf

    model, sdpa = llama
    built, seen = [], []
    build, attend = hf._build, hf.attention
    monkeypatch.setattr(hf, "_build", lambda *args: built.append(1) or build(*args))
    monkeypatch.setattr(
        hf, "attention", lambda q, k, v, mask, **kwargs: seen.append(mask) or attend(q, k, v, mask, **kwargs)
    )
    ids, positions = packed["input_ids"], packed["position_ids"].clone()
    first = model(input_ids=ids, position_ids=positions).logits
    assert len(built) == 1 and len(seen) == 2 and seen[0] is seen[1]
    model(input_ids=ids, position_ids=positions)
    assert len(built) == 1  # the same spec values and metadata tensor: reused across forwards too
    model(input_ids=ids, position_ids=positions.clone())
    assert len(built) == 2
    positions[:, 5:] = torch.arange(positions.shape[1] - 5)  # documents [0, 5) and [5, S)
    again = model(input_ids=ids, position_ids=positions).logits
    assert len(built) == 3
    two_documents = document_mask([5, len(positions[0]) - 5])
    assert (again - sdpa(input_ids=ids, attention_mask=two_documents).logits).abs().max() < 1e-6
    assert (again - first).abs().max() > 1e-3


def test_inference_mode_and_alternating_windows_keep_their_own_masks(transformers, monkeypatch):
    """Qwen2 with a sliding and a full layer, on packed documents: one mask built per window and
    forward (the memo keeps both), logits equal sdpa's with the two dense masks; under
    torch.inference_mode, with positions made there (inference tensors have no version), the masks
    are built per layer and the logits are the same."""
    from flashmask3.integrations import hf

    model, sdpa = ours_and_sdpa(
        transformers.Qwen2ForCausalLM,
        transformers.Qwen2Config,
        seed=5,
        use_sliding_window=True,
        sliding_window=3,
        max_window_layers=0,
        layer_types=["sliding_attention", "full_attention"],
    )
    built, build = [], hf._build
    monkeypatch.setattr(hf, "_build", lambda *args: built.append(args[0].window) or build(*args))
    ids = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(5))
    positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6]])
    i = torch.arange(12)
    window = (i[None] > i[:, None] - 3)[None, None]
    documents = document_mask((5, 7))
    ours = model(input_ids=ids, position_ids=positions, use_cache=False).logits
    assert sorted(built) == [(-1, 0), (2, 0)]
    with torch.inference_mode():
        inferred = model(input_ids=ids, position_ids=positions.clone(), use_cache=False).logits
    assert len(built) == 2 + 2
    masks_per_layer = {"sliding_attention": documents & window, "full_attention": documents}
    both = sdpa(input_ids=ids, position_ids=positions, attention_mask=masks_per_layer, use_cache=False).logits
    assert (ours - both).abs().max() < 1e-6 and (inferred - both).abs().max() < 1e-6


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_generation_scores_without_padding_match_sdpa(llama, cache):
    """Greedy decoding of an unpadded batch: every step's scores equal sdpa's (fp64), also through a
    static cache, whose length tensor advances in place before the attention call (the query must
    not see the next, empty slot)."""
    model, sdpa = llama
    ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(4))
    model.eval(), sdpa.eval()
    try:
        ours, theirs = (
            m.generate(
                ids,
                max_new_tokens=5,
                do_sample=False,
                cache_implementation=cache,
                output_scores=True,
                return_dict_in_generate=True,
            )
            for m in (model, sdpa)
        )
    finally:
        model.train(), sdpa.train()
    assert torch.equal(ours.sequences, theirs.sequences)
    assert max((a - b).abs().max().item() for a, b in zip(ours.scores, theirs.scores)) < 1e-6
