"""The CuTe kernels against the reference on a Hopper GPU (skipped elsewhere): forward and the
gradients for a spread of masks and shapes, and bitwise-deterministic gradients on request."""

import dataclasses
import math

import pytest
import torch
from flashmask3.reference import masks
from flashmask3.verify import compare, random_inputs

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _hopper_only():
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the cute backend needs a Hopper GPU")


def assert_same_gradients(inputs: tuple, first, second) -> tuple[torch.Tensor, ...]:
    """The backward under configs `first` and `second` on `inputs` (dout, q, k, v, out, lse, mask,
    scale) for configurations that change only when or where the work runs: dK and dV bit for bit,
    dQ within the fp32 add order's rounding, deterministic mode bit for bit. Returns `second`'s.
    Both run with whole CTAs: split ones add dK and dV in the order their parts finish
    (`test_split_ctas_match_the_reference` checks them)."""
    from flashmask3.optimized.interface import backward

    first, second = (dataclasses.replace(config, split_ctas_max_parts=0) for config in (first, second))
    dq, dk, dv = backward(*inputs, config=first)
    dq2, dk2, dv2 = backward(*inputs, config=second)
    assert torch.equal(dk, dk2) and torch.equal(dv, dv2)
    torch.testing.assert_close(dq2, dq, rtol=1e-2, atol=1e-3)
    deterministic = [backward(*inputs, True, config=c) for c in (first, second)]
    assert all(torch.equal(a, b) for a, b in zip(*deterministic))
    return dq2, dk2, dv2


@pytest.mark.parametrize("name", ["causal", "causal_document", "share_question", "random_eviction", "qk_sparse"])
@pytest.mark.parametrize("seqlen, head_dim, dtype", [(777, 64, torch.float16), (1024, 128, torch.bfloat16)])
def test_cute_forward_and_gradients_match_the_reference(name, seqlen, head_dim, dtype):
    mask = masks.build(name, seqlen, batch=2, heads=4, seed=3, device="cuda")
    q, k, v, dout = random_inputs(2, seqlen, seqlen, 4, 2, head_dim, dtype, "cuda", seed=3)
    report = compare("cute", q, k, v, mask, dout)
    assert report.passed, report.failures()


@pytest.mark.parametrize("causal, window_size", [(True, (-1, -1)), (False, (-1, -1)), (True, (300, 0))])
def test_varlen_with_other_key_packing_matches_the_reference(causal, window_size):
    """varlen_attention's mask where queries and keys are packed differently (the non-causal
    two-bound variant, Sq != Sk, causal aligned per document), on the kernels: within the verify
    tolerance, forward and gradients, GQA 4 on 2, a document without queries and one without keys."""
    from flashmask3.reference import ColumnMask

    cu_q = torch.tensor([0, 200, 711, 711, 1100, 1301], device="cuda")
    cu_k = torch.tensor([0, 640, 900, 1290, 2048, 2048], device="cuda")
    mask = ColumnMask._band(1301, 2048, *window_size, causal, cu_seqlens=cu_q, cu_seqlens_k=cu_k)
    q, k, v, dout = random_inputs(1, 1301, 2048, 4, 2, 128, torch.bfloat16, "cuda", seed=9)
    report = compare("cute", q, k, v, mask, dout)
    assert report.passed, report.failures()


@pytest.mark.parametrize("name, mask_batch", [("causal_document", 2), ("share_question", 1), ("random_eviction", 2)])
def test_longest_first_orders_give_the_default_orders_numbers(name, mask_batch):
    """`longest_tiles_first_waves` / `longest_ctas_first_waves`: the same work in another order, so the same
    outputs and gradients bit for bit (each work tile and each CTA computes alone; dQ's atomic adds
    are compared with the deterministic order's tolerance), GQA 4 on 2, a ragged length."""
    import dataclasses

    from flashmask3.optimized import bwd_config, fwd_config
    from flashmask3.optimized.interface import backward, forward

    seqlen, scale = 1531, 1 / math.sqrt(128)
    mask = masks.build(name, seqlen, batch=mask_batch, heads=4, seed=11, device="cuda")
    q, k, v, dout = random_inputs(2, seqlen, seqlen, 4, 2, 128, torch.bfloat16, "cuda", seed=11)
    variant = (mask.causal, mask.startend_row_indices.shape[-1])
    # Whole CTAs: split ones add dK and dV in the order their parts finish.
    fwd_default, bwd_default = (
        fwd_config(128, *variant),
        dataclasses.replace(bwd_config(128, *variant), split_ctas_max_parts=0),
    )
    fwd_grid = dataclasses.replace(fwd_default, longest_tiles_first_waves=0)
    bwd_grid = dataclasses.replace(bwd_default, longest_ctas_first_waves=0)
    out, lse = forward(q, k, v, mask, scale, config=fwd_grid)
    out_lpt, lse_lpt = forward(q, k, v, mask, scale, config=fwd_default)
    assert torch.equal(out, out_lpt) and torch.equal(lse, lse_lpt)
    dq, dk, dv = backward(dout, q, k, v, out, lse, mask, scale, config=bwd_grid)
    dq_lpt, dk_lpt, dv_lpt = backward(dout, q, k, v, out, lse, mask, scale, config=bwd_default)
    assert torch.equal(dk, dk_lpt) and torch.equal(dv, dv_lpt)
    torch.testing.assert_close(dq_lpt, dq, rtol=1e-2, atol=1e-3)  # fp32 adds in another order


@pytest.mark.parametrize("name", ["full", "causal_document", "global_sliding_window", "random_eviction"])
def test_three_query_stages_give_the_two_stage_backwards_numbers(name):
    """`q_stages=3` only lets the producer load further ahead: dK and dV bit for bit, dQ within the
    fp32 add order's rounding, deterministic mode bit for bit (GQA 4 on 2, a ragged length)."""
    from flashmask3.optimized import bwd_config
    from flashmask3.optimized.interface import forward

    seqlen, scale = 1531, 1 / math.sqrt(128)
    mask = masks.build(name, seqlen, batch=2, heads=4, seed=19, device="cuda")
    q, k, v, dout = random_inputs(2, seqlen, seqlen, 4, 2, 128, torch.bfloat16, "cuda", seed=19)
    three = dataclasses.replace(
        bwd_config(128, mask.causal, mask.startend_row_indices.shape[-1]), short_grid_q_stages=0
    )
    out, lse = forward(q, k, v, mask, scale)
    assert_same_gradients((dout, q, k, v, out, lse, mask, scale), dataclasses.replace(three, q_stages=2), three)


@pytest.mark.parametrize(
    "name, seqlen_q, seqlen_k",
    [(name, 1531, 1531) for name in ("causal", "sliding_window", "causal_document", "causal_blockwise")]
    + [(f"plain_causal_{width}", sq, sk) for width in (1, 2) for sq, sk in ((1000, 1024), (1531, 1000), (1000, 1531))],
)
def test_diagonal_steps_give_the_default_backwards_numbers(name, seqlen_q, seqlen_k):
    """`diagonal_steps` masks the steps only the causal diagonal cuts by the causal comparison alone:
    the same elements hidden, so the deterministic backward's dQ, dK, dV bit for bit (GQA 4 on 2,
    ragged lengths, both causal mask widths; plain causal masks with Sq != Sk, the diagonal
    bottom-right aligned, and a ragged query tile among their diagonal-only steps)."""
    from conftest import plain_causal_mask
    from flashmask3.optimized import bwd_config
    from flashmask3.optimized.interface import backward, forward

    if name.startswith("plain_causal_"):
        mask = plain_causal_mask(2, seqlen_q, seqlen_k, int(name[-1]), "cuda")
    else:
        mask = masks.build(name, seqlen_k, batch=2, heads=4, seed=29, device="cuda")
    q, k, v, dout = random_inputs(2, seqlen_q, seqlen_k, 4, 2, 128, torch.bfloat16, "cuda", seed=29)
    scale = 1 / math.sqrt(128)
    default = bwd_config(128, mask.causal, mask.startend_row_indices.shape[-1])
    out, lse = forward(q, k, v, mask, scale)
    grads = [
        backward(dout, q, k, v, out, lse, mask, scale, True, config=dataclasses.replace(default, diagonal_steps=on))
        for on in (False, True)
    ]
    assert all(torch.equal(a, b) for a, b in zip(*grads))


@pytest.mark.parametrize(
    "name, head_dim",
    [("full", 128), ("causal_document", 128), ("global_sliding_window", 128), ("causal", 64)]
    + [("share_question", 256)],
)
def test_the_dq_writer_gives_the_default_backwards_numbers(name, head_dim):
    """`dq_writer` moves only who issues dQ's reduce-adds and when sdQ is reused: the deterministic
    backward bit for bit, dK and dV bit for bit, dQ within the fp32 add order's rounding and
    against the fp32 reference (GQA 4 on 2, a ragged length)."""
    from flashmask3.optimized import bwd_config
    from flashmask3.optimized.interface import forward
    from flashmask3.reference import reference_attention

    seqlen, scale = 1531, 1 / math.sqrt(head_dim)
    mask = masks.build(name, seqlen, batch=2, heads=4, seed=31, device="cuda")
    q, k, v, dout = random_inputs(2, seqlen, seqlen, 4, 2, head_dim, torch.bfloat16, "cuda", seed=31)
    default = bwd_config(head_dim, mask.causal, mask.startend_row_indices.shape[-1])
    writer = dataclasses.replace(default, dq_writer=not default.dq_writer)
    out, lse = forward(q, k, v, mask, scale)
    dq_w, dk_w, dv_w = assert_same_gradients((dout, q, k, v, out, lse, mask, scale), default, writer)
    fp32 = [t.detach().float().requires_grad_() for t in (q, k, v)]
    expected = torch.autograd.grad(reference_attention(*fp32, mask, scale)[0], fp32, dout.float())
    for got, want in zip((dq_w, dk_w, dv_w), expected):
        assert (got.float() - want).norm() <= 2e-2 * want.norm()


@pytest.mark.parametrize("name", ["full", "causal_document", "share_question", "random_eviction"])
def test_late_k_release_gives_the_early_releases_numbers(name):
    """`late_k_release` (the default at head dim 128) moves only a pipeline release: the outputs and
    LSE of the release right after S_j lands, bit for bit (GQA 4 on 2, a ragged length)."""
    from flashmask3.optimized import fwd_config
    from flashmask3.optimized.interface import forward

    seqlen, scale = 1531, 1 / math.sqrt(128)
    mask = masks.build(name, seqlen, batch=2, heads=4, seed=13, device="cuda")
    q, k, v, _ = random_inputs(2, seqlen, seqlen, 4, 2, 128, torch.bfloat16, "cuda", seed=13)
    default = fwd_config(128, mask.causal, mask.startend_row_indices.shape[-1])
    assert default.late_k_release
    out, lse = forward(q, k, v, mask, scale, config=default)
    out_early, lse_early = forward(q, k, v, mask, scale, config=dataclasses.replace(default, late_k_release=False))
    assert torch.equal(out, out_early) and torch.equal(lse, lse_early)


@pytest.mark.parametrize("head_dim, head_dim_v", [(128, 64), (192, 128), (256, 256)])
@pytest.mark.parametrize("name", ["full", "causal_document", "share_question", "random_eviction"])
def test_forward_at_the_other_head_dims_matches_the_reference(name, head_dim, head_dim_v):
    """The forward with V and O of a head dim below Q's and K's (O staged in a part of Q's buffer;
    at 192, one Q buffer) and at head dim 256 (one Q buffer, 64-key tiles), into a NaN-poisoned
    output: within twice the bf16 reference's own error of the fp64 one, GQA 4 on 2, a ragged
    length."""
    from flashmask3.optimized.interface import forward
    from flashmask3.reference.attention import forward as reference_forward

    seqlen, scale = 1531, 1 / math.sqrt(head_dim)
    mask = masks.build(name, seqlen, batch=2, heads=4, seed=11, device="cuda")
    q, k, v, _ = random_inputs(
        2, seqlen, seqlen, 4, 2, head_dim, torch.bfloat16, "cuda", seed=11, head_dim_v=head_dim_v
    )
    poisoned = torch.full((2, seqlen, 4, head_dim_v), math.nan, device="cuda").bfloat16()
    out, lse = forward(q, k, v, mask, scale, out=poisoned)
    exact, exact_lse = reference_forward(q, k, v, mask, scale, torch.float64)
    in_bf16, _ = reference_forward(q, k, v, mask, scale, torch.bfloat16)
    tolerance = 2 * (in_bf16.double() - exact).abs().max().item() + 1e-3
    assert out.shape == (2, seqlen, 4, head_dim_v) and not out.isnan().any()
    assert (out.double() - exact).abs().max().item() <= tolerance
    seen = exact_lse.isfinite()
    assert torch.equal(lse.isfinite(), seen)
    torch.testing.assert_close(lse.double()[seen], exact_lse[seen], rtol=0, atol=1e-3)


def assert_the_forward_matches_the_reference(
    name: str, head_dim: int, head_dim_v: int, seed: int, change, keys=None, **build
):
    """The forward of mask `name` (`masks.build(..., **build)`: 1,531 rows, 2 sequences, GQA 4 on
    2, bf16) under its chosen configuration changed by `change(config)`, into NaN-poisoned out and
    LSE: out within twice the bf16 reference's own error of the fp64 one, every seen row's LSE.
    `keys`: a function of the random K giving the K to use instead."""
    from flashmask3.optimized import fwd_config
    from flashmask3.optimized.interface import forward
    from flashmask3.reference.attention import forward as reference_forward

    seqlen, scale = 1531, 1 / math.sqrt(head_dim)
    mask = masks.build(name, seqlen, batch=2, heads=4, seed=seed, device="cuda", **build)
    q, k, v, _ = random_inputs(
        2, seqlen, seqlen, 4, 2, head_dim, torch.bfloat16, "cuda", seed=seed, head_dim_v=head_dim_v
    )
    k = k if keys is None else keys(k)
    config = change(fwd_config(head_dim, mask.causal, mask.startend_row_indices.shape[-1]))
    out = torch.full((2, seqlen, 4, head_dim_v), math.nan, device="cuda").bfloat16()
    lse = torch.full((2, 4, seqlen), math.nan, device="cuda")
    forward(q, k, v, mask, scale, out=out, lse=lse, config=config)
    exact, exact_lse = reference_forward(q, k, v, mask, scale, torch.float64)
    in_bf16, _ = reference_forward(q, k, v, mask, scale, torch.bfloat16)
    tolerance = 2 * (in_bf16.double() - exact).abs().max().item() + 1e-3
    assert not out.isnan().any() and not lse.isnan().any()
    assert (out.double() - exact).abs().max().item() <= tolerance
    seen = exact_lse.isfinite()
    assert torch.equal(lse.isfinite(), seen)
    torch.testing.assert_close(lse.double()[seen], exact_lse[seen], rtol=0, atol=1e-3)


@pytest.mark.parametrize("name", ["causal", "causal_document", "sliding_window", "share_question", "random_eviction"])
def test_80_key_tiles_at_head_dim_256_match_the_reference(name):
    """Head dim 256 in 80-key tiles (FA4's SM90 shape there; causal masks with one bound per key:
    what fits in smem beside two K/V stages of 80 keys), 1,531 keys (no multiple of 80), against
    the reference."""
    assert masks.build(name, 256, batch=1, heads=1, seed=0).startend_row_indices.shape[-1] == 1
    assert_the_forward_matches_the_reference(name, 256, 256, 13, lambda c: dataclasses.replace(c, tile_n=80))


@pytest.mark.parametrize("head_dim, head_dim_v", [(128, 128), (256, 256), (192, 128)])
@pytest.mark.parametrize(
    "name",
    [
        "full",
        "causal",
        "causal_document",
        "sliding_window",
        "share_question",
        "causal_blockwise",
        "qk_sparse",
        "global_sliding_window",
    ],
)
def test_lazy_rescale_matches_the_reference_where_row_maxima_jump(name, head_dim, head_dim_v):
    """`lazy_rescale` on every mask variant (causal with one and two bounds per key, non-causal with
    two and four), on keys whose scores swing by up to 7x from one 64-key block to the next (the
    row maxima jump past the threshold and fall back again, many times per row) and on plain random
    keys (a row's max moves past it in its first key tiles only)."""
    swing = torch.tensor([1.0, 7.0, 2.0, 5.0, 0.5, 3.0], device="cuda")

    def swinging(k):
        blocks = torch.arange(k.shape[1], device="cuda") // 64
        return (k.float() * swing[blocks % len(swing)][None, :, None, None]).bfloat16()

    def lazy(config):
        return dataclasses.replace(config, lazy_rescale=True)

    for keys in (swinging, None):
        assert_the_forward_matches_the_reference(name, head_dim, head_dim_v, 23, lazy, keys=keys)


@pytest.mark.parametrize("head_dim, head_dim_v", [(192, 128), (256, 256)])
@pytest.mark.parametrize("name", ["full", "causal_document", "share_question", "global_sliding_window", "qk_sparse"])
def test_backward_with_queries_on_rows_matches_the_reference(name, head_dim, head_dim_v):
    """The backward at head dims 192 (v 128) and 256 (queries on rows, 96 and 48 keys per CTA,
    P and dS through smem): dQ, dK and dV within twice the bf16 reference's own error of the fp64
    one, from the reference's O and LSE, GQA 4 on 2, a ragged length; deterministic mode bit for
    bit run to run."""
    from flashmask3.optimized.interface import backward
    from flashmask3.reference import attention as reference

    seqlen, scale = 1531, 1 / math.sqrt(head_dim)
    mask = masks.build(name, seqlen, batch=2, heads=4, seed=5, device="cuda")
    q, k, v, dout = random_inputs(
        2, seqlen, seqlen, 4, 2, head_dim, torch.bfloat16, "cuda", seed=5, head_dim_v=head_dim_v
    )
    out, lse = reference.forward(q, k, v, mask, scale, torch.float64)
    exact = reference.backward(dout, q, k, v, out, lse, mask, scale, torch.float64)
    in_bf16 = reference.backward(dout, q, k, v, out.bfloat16(), lse.float(), mask, scale, torch.bfloat16)
    poisoned = [torch.full_like(x, math.nan) for x in (k, v)]  # every row must be written
    got = backward(dout, q, k, v, out.bfloat16(), lse.float(), mask, scale, dk=poisoned[0], dv=poisoned[1])
    for grad, want, rounded in zip(got, exact, in_bf16):
        assert grad.shape == want.shape and not grad.isnan().any()
        tolerance = 2 * (rounded.double() - want).abs().max().item() + 1e-3
        assert (grad.double() - want).abs().max().item() <= tolerance
    first = backward(dout, q, k, v, out.bfloat16(), lse.float(), mask, scale, deterministic=True)
    again = backward(dout, q, k, v, out.bfloat16(), lse.float(), mask, scale, deterministic=True)
    assert all(torch.equal(a, b) for a, b in zip(first, again))


@pytest.mark.parametrize("head_dim", [128, 64])
@pytest.mark.parametrize(
    "name, num_docs, mask_heads",
    [
        ("causal_document", None, 1),
        ("document", None, 1),
        ("share_question", None, 1),
        ("prefix_lm_document", None, 1),
        ("causal_document", 40, 1),  # documents of ~38 tokens: most boundaries merged, a few kept
        ("random_eviction", None, 2),  # per-KV-head masks, one segment each
        ("random_eviction", None, 4),  # per-query-head masks under GQA: the sequence's tiles
    ],
)
def test_segment_steps_match_the_reference(name, num_docs, mask_heads, head_dim):
    """`segment_steps`: the backward (and its preprocess and postprocess) on segment-aligned
    virtual rows, per-batch masks with their own segments, into NaN-poisoned dK and dV: dQ, dK and
    dV within twice the bf16 reference's own error of the fp64 one, from the reference's O and LSE,
    GQA 4 on 2, a ragged length; deterministic mode bit for bit run to run."""
    from flashmask3.optimized import bwd_config
    from flashmask3.optimized.interface import backward
    from flashmask3.reference import ColumnMask
    from flashmask3.reference import attention as reference

    seqlen, scale = 1531, 1 / math.sqrt(head_dim)
    mask = masks.build(name, seqlen, batch=2, heads=4, seed=5, device="cuda", num_docs=num_docs)
    idx = mask.startend_row_indices
    mask = ColumnMask(idx[:, :: idx.shape[1] // mask_heads] if idx.shape[1] > 1 else idx, mask.causal, seqlen)
    q, k, v, dout = random_inputs(2, seqlen, seqlen, 4, 2, head_dim, torch.bfloat16, "cuda", seed=5)
    # Segment steps walk 64-row query tiles (head dim 64's default 128-row step takes none).
    config = dataclasses.replace(bwd_config(head_dim, mask.causal, idx.shape[-1]), query_tile=64, segment_steps=True)
    out, lse = reference.forward(q, k, v, mask, scale, torch.float64)
    exact = reference.backward(dout, q, k, v, out, lse, mask, scale, torch.float64)
    in_bf16 = reference.backward(dout, q, k, v, out.bfloat16(), lse.float(), mask, scale, torch.bfloat16)
    poisoned = [torch.full_like(x, math.nan) for x in (k, v)]  # every row must be written
    args = (dout, q, k, v, out.bfloat16(), lse.float(), mask, scale)
    got = backward(*args, dk=poisoned[0], dv=poisoned[1], config=config)
    for grad, want, rounded in zip(got, exact, in_bf16):
        assert grad.shape == want.shape and not grad.isnan().any()
        tolerance = 2 * (rounded.double() - want).abs().max().item() + 1e-3
        assert (grad.double() - want).abs().max().item() <= tolerance
    first = backward(*args, deterministic=True, config=config)
    again = backward(*args, deterministic=True, config=config)
    assert all(torch.equal(a, b) for a, b in zip(first, again))


_BWD_DIMS = [(128, 128), (64, 64), (192, 128), (256, 256)]


@pytest.mark.parametrize(
    "name, head_dim, head_dim_v, slack_pct, parts",
    [(name, *dims, -100, 4) for name in ("causal_document", "share_question", "random_eviction") for dims in _BWD_DIMS]
    + [(name, *dims, -100, 4) for name in ("document", "global_sliding_window") for dims in _BWD_DIMS[::2]]
    + [("causal_blockwise", 192, 128, -100, 4), ("causal_document", 192, 128, -100, 2), ("document", 128, 128, -100, 2)]
    + [("causal_blockwise", 128, 128, -100, 4), ("qk_sparse", 128, 128, 2, 4)]
    + [("causal_document", 128, 128, 2, 4), ("causal", 64, 64, 2, 4)],
)
def test_split_ctas_match_the_reference(name, head_dim, head_dim_v, slack_pct, parts):
    """`split_ctas_max_parts`: a key tile's query tiles split between up to `parts` CTAs, whose fp32
    dK and dV meet in the workspace (the last part adds them up and stores). With the slack at
    -100 every CTA splits: dQ, dK and dV within twice the bf16 reference's own error of the fp64
    one, into NaN-poisoned dK and dV (every row written), GQA 4 on 2, per-head masks, a ragged
    length, three runs (the parts finish in any order); the plan queues no host sync; deterministic
    mode does not split (bit for bit the whole CTAs' gradients)."""
    from flashmask3.optimized import bwd_config
    from flashmask3.optimized.interface import backward
    from flashmask3.reference import ColumnMask
    from flashmask3.reference import attention as reference

    seqlen, scale = 1531, 1 / math.sqrt(head_dim)
    mask = masks.build(name, seqlen, batch=2, heads=4, seed=41, device="cuda")
    q, k, v, dout = random_inputs(
        2, seqlen, seqlen, 4, 2, head_dim, torch.bfloat16, "cuda", seed=41, head_dim_v=head_dim_v
    )
    whole = dataclasses.replace(
        bwd_config(head_dim, mask.causal, mask.startend_row_indices.shape[-1]), split_ctas_max_parts=0
    )
    split = dataclasses.replace(whole, split_ctas_max_parts=parts, split_ctas_slack_pct=slack_pct)
    out, lse = reference.forward(q, k, v, mask, scale, torch.float64)
    exact = reference.backward(dout, q, k, v, out, lse, mask, scale, torch.float64)
    in_bf16 = reference.backward(dout, q, k, v, out.bfloat16(), lse.float(), mask, scale, torch.bfloat16)
    args = (dout, q, k, v, out.bfloat16(), lse.float())
    for run in range(3):
        fresh = ColumnMask(mask.startend_row_indices.clone(), mask.causal, mask.seqlen_q)  # a new plan
        poisoned = [torch.full_like(x, math.nan) for x in (k, v)]
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = backward(*args, fresh, scale, dk=poisoned[0], dv=poisoned[1], config=split)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        for grad, want, rounded in zip(got, exact, in_bf16):
            assert not grad.isnan().any(), run
            tolerance = 2 * (rounded.double() - want).abs().max().item() + 1e-3
            assert (grad.double() - want).abs().max().item() <= tolerance, run
    deterministic = [backward(*args, mask, scale, True, config=c) for c in (whole, split)]
    assert all(torch.equal(a, b) for a, b in zip(*deterministic))


@pytest.mark.parametrize("name", ["causal_document", "share_question", "full"])
def test_a_steady_state_training_call_never_waits_on_the_gpu(name):
    """After a first call (compilation, the mask's cached tile order), a forward + backward through
    the public entry queues all its work without a host sync (torch's sync debug mode as errors);
    "full" is called without a mask (the kernels' stand-in full mask)."""
    import flashmask3 as fm

    mask = None if name == "full" else masks.build(name, 4096, batch=1, heads=8, seed=2, device="cuda")
    q, k, v, dout = random_inputs(1, 4096, 4096, 8, 2, 128, torch.bfloat16, "cuda", seed=2)
    leaves = [x.requires_grad_() for x in (q, k, v)]

    def step():
        out = fm.attention(*leaves, mask, backend="cute")
        return torch.autograd.grad(out, leaves, dout)

    expected = step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        grads = step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for got, first in zip(grads, expected):  # dQ's atomic adds may round differently run to run
        torch.testing.assert_close(got, first)


@pytest.mark.parametrize("name", ["causal_document", "share_question"])
def test_a_mask_prepared_on_the_host_brings_its_plans(name):
    """`prepare_mask` on a host mask: the training call on its GPU copy launches at least a hundred
    fewer kernels than on a plain copy (the plans were made on the host) and gives the same out
    and, within the split CTAs' summation order, the same gradients; with its plans already there
    the call never waits on the GPU."""
    from torch.profiler import ProfilerActivity, profile

    import flashmask3 as fm

    host = masks.build(name, 8192, batch=1, heads=1, seed=4)
    q, k, v, dout = random_inputs(1, 8192, 8192, 16, 4, 128, torch.bfloat16, "cuda", seed=4)
    leaves = [x.requires_grad_() for x in (q, k, v)]

    def step(mask):
        out = fm.attention(*leaves, mask, backend="cute")
        return out, *torch.autograd.grad(out, leaves, dout)

    step(host.to("cuda"))  # compiles
    results, kernels = [], []
    for mask in (host.to("cuda"), fm.prepare_mask(host, "cuda", batch=1, q_heads=16, kv_heads=4, head_dim=128)):
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as profiler:
            if len(results) == 1:
                torch.cuda.set_sync_debug_mode("error")
            try:
                results.append(step(mask))
            finally:
                torch.cuda.set_sync_debug_mode("default")
            torch.cuda.synchronize()
        kernels.append(sum(e.count for e in profiler.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA))
    assert kernels[1] + 100 < kernels[0], kernels
    assert torch.equal(results[0][0], results[1][0])
    for got, plain in zip(results[1][1:], results[0][1:]):
        torch.testing.assert_close(got, plain)


def test_a_training_step_replays_from_a_cuda_graph():
    """fwd + bwd through the public entry, the mask's preprocessing included, captured in a CUDA
    graph after a warm-up on a side stream: replayed on new inputs copied into the captured ones, it
    gives eager's out and gradients on them. Without the segmented hint: under capture the forward
    takes the sequence's tiles, which eager would leave for segment tiles on a segmented mask."""
    import flashmask3 as fm

    built = masks.build("causal_document", 2048, batch=1, heads=4, seed=4, device="cuda")
    mask = fm.ColumnMask(built.startend_row_indices, built.causal, built.seqlen_q)
    q, k, v, dout = random_inputs(1, 2048, 2048, 4, 2, 128, torch.bfloat16, "cuda", seed=4)
    leaves = [x.requires_grad_() for x in (q, k, v)]

    def step():
        out = fm.attention(*leaves, mask, backend="cute")
        return (out, *torch.autograd.grad(out, leaves, dout))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    fresh = random_inputs(1, 2048, 2048, 4, 2, 128, torch.bfloat16, "cuda", seed=5)
    with torch.no_grad():
        for static, new in zip((*leaves, dout), fresh):
            static.copy_(new)
    graph.replay()
    for got, expected in zip(captured, step()):
        torch.testing.assert_close(got, expected)


def test_the_public_entry_trains_mlas_head_dims_on_the_kernels():
    """attention(...) at q/k 192, v 128: "cute" gives the kernel's numbers (those of
    `interface.forward` and `interface.backward`, bit for bit, deterministic mode), "auto" takes the
    kernels for gradients too; at (128, 64), which the backward does not build, "cute" names what it
    cannot do with inputs that require grad."""
    from flashmask3.optimized.interface import backward, forward

    import flashmask3 as fm

    seqlen, scale = 1000, 1 / math.sqrt(192)
    mask = masks.build("causal_document", seqlen, batch=2, heads=4, seed=5, device="cuda")
    q, k, v, dout = random_inputs(2, seqlen, seqlen, 4, 2, 192, torch.bfloat16, "cuda", seed=5, head_dim_v=128)
    out, lse = fm.attention(q, k, v, mask, backend="cute", return_lse=True)
    expected, expected_lse = forward(q, k, v, mask, scale)
    assert torch.equal(out, expected) and torch.equal(lse, expected_lse)
    expected_grads = backward(dout, q, k, v, out, lse, mask, scale, deterministic=True)
    for backend in ("cute", "auto"):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        fm.attention(*leaves, mask, backend=backend, deterministic=True).backward(dout)
        assert all(torch.equal(x.grad, want) for x, want in zip(leaves, expected_grads))
    q, k, v, _ = random_inputs(1, 256, 256, 4, 2, 128, torch.bfloat16, "cuda", seed=5, head_dim_v=64)
    with pytest.raises(ValueError, match="computes gradients at head dims"):
        fm.attention(q.requires_grad_(), k, v, mask=None, backend="cute")


@pytest.mark.parametrize("name", [None, "causal_document", "share_question"])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_a_loss_on_the_lse_gives_the_references_gradients(name, with_sinks):
    """A loss on out and the LSE through `attention(..., backend="cute")`: dQ, dK, dV and d(sinks)
    against the reference's in fp64 from the same bf16 inputs (GQA 4 on 2, Sq > Sk), as close as
    a loss on out alone."""
    from flashmask3.reference import ColumnMask

    import flashmask3 as fm

    seqlen_q, seqlen_k = 1100, 1000
    q, k, v, dout = random_inputs(2, seqlen_q, seqlen_k, 4, 2, 128, torch.bfloat16, "cuda", seed=13)
    mask = None
    if name is not None:
        keys = masks.build(name, seqlen_k, batch=2, seed=13, device="cuda")
        mask = ColumnMask(keys.startend_row_indices, keys.causal, seqlen_q)
    sinks = torch.randn(4, device="cuda") if with_sinks else None
    weights = torch.randn(2, 4, seqlen_q, device="cuda")
    grads = {}
    for backend in ("cute", "reference"):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)] + (
            [sinks.clone().requires_grad_()] if with_sinks else []
        )
        cast = [x.double() for x in leaves] if backend == "reference" else leaves
        out, lse = fm.attention(
            *cast[:3], mask, backend=backend, return_lse=True, sinks=cast[3] if with_sinks else None
        )
        finite = torch.isfinite(lse)
        loss = (out.double() * dout.double()).sum() + (lse.double() * weights.double())[finite].sum()
        grads[backend] = torch.autograd.grad(loss, leaves)
    for name_, got, want in zip("q k v sinks".split(), grads["cute"], grads["reference"]):
        error = ((got.double() - want.double()).norm() / want.double().norm()).item()
        assert error < 1e-2, (name_, error)


@pytest.mark.parametrize("head_dim, head_dim_v", [(128, 128), (64, 64), (192, 128), (256, 256)])
def test_heads_major_inputs_run_in_place_with_the_contiguous_numbers(head_dim, head_dim_v):
    """q, k, v and dout as transformers holds them ([B, H, S, D], passed as their [B, S, H, D]
    views): the kernels read them in place (no copy: their strides go to TMA) and give the
    contiguous inputs' out and LSE, and deterministic gradients, bit for bit, as contiguous tensors."""
    from flashmask3.optimized.interface import backward, forward, tma_operand

    seqlen, scale = 1000, 1 / math.sqrt(head_dim)
    mask = masks.build("causal_document", seqlen, batch=2, heads=4, seed=9, device="cuda")
    inputs = random_inputs(2, seqlen, seqlen, 4, 2, head_dim, torch.bfloat16, "cuda", seed=9, head_dim_v=head_dim_v)
    views = [x.transpose(1, 2).contiguous().transpose(1, 2) for x in inputs]  # [B, S, H, D] over [B, H, S, D]
    assert all(tma_operand(x) is x and not x.is_contiguous() for x in views)
    q, k, v, dout = inputs
    out, lse = forward(q, k, v, mask, scale)
    out_view, lse_view = forward(*views[:3], mask, scale)
    assert torch.equal(out_view, out) and torch.equal(lse_view, lse)
    grads = backward(dout, q, k, v, out, lse, mask, scale, deterministic=True)
    grads_view = backward(views[3], *views[:3], out, lse, mask, scale, deterministic=True)
    assert all(g.is_contiguous() and torch.equal(g, want) for g, want in zip(grads_view, grads))


@pytest.mark.parametrize("name", ["full", "causal_document", "random_eviction"])
def test_fmax_row_max_gives_the_default_forwards_numbers(name):
    """`fmax_row_max` changes only how the row maxima are reduced (never NaN here): the default's
    outputs and LSE bit for bit (GQA 4 on 2, a ragged length)."""
    from flashmask3.optimized import fwd_config
    from flashmask3.optimized.interface import forward

    seqlen, scale = 1531, 1 / math.sqrt(128)
    mask = masks.build(name, seqlen, batch=2, heads=4, seed=17, device="cuda")
    q, k, v, _ = random_inputs(2, seqlen, seqlen, 4, 2, 128, torch.bfloat16, "cuda", seed=17)
    default = fwd_config(128, mask.causal, mask.startend_row_indices.shape[-1])
    out, lse = forward(q, k, v, mask, scale, config=default)
    out_fmax, lse_fmax = forward(q, k, v, mask, scale, config=dataclasses.replace(default, fmax_row_max=True))
    assert torch.equal(out, out_fmax) and torch.equal(lse, lse_fmax)


@pytest.mark.parametrize("head_dim, head_dim_v", [(128, 128), (64, 64), (192, 128), (256, 256)])
@pytest.mark.parametrize(
    "name, num_docs",
    [
        ("causal_document", None),
        ("document", None),
        ("share_question", None),
        ("prefix_lm_document", None),
        ("causal_document", 40),  # documents of ~38 tokens: most boundaries merged, a few kept
        ("random_eviction", None),  # per-head masks, one segment each
        ("causal_blockwise", None),  # no segments: the sequence's tiles, then granules with no real row
        ("qk_sparse", None),
        ("sliding_window", None),
    ],
)
def test_segment_tiles_match_the_reference(name, num_docs, head_dim, head_dim_v):
    """`segment_tiles`: the forward on segment-aligned virtual rows (per-batch masks with their own
    segments; the plan's fixed length leaves granules with no real row, which the mask role draws
    past; a segment's last tile stored row by row), against the reference."""
    assert_the_forward_matches_the_reference(
        name,
        head_dim,
        head_dim_v,
        5,
        lambda c: dataclasses.replace(c, tile_m=128, segment_tiles=True),
        num_docs=num_docs,
    )


def assert_a_field_keeps_the_forwards_numbers(field: str, name: str, head_dim, head_dim_v, seqlen, seed: int):
    """The chosen forward with `field` off and on, on mask `name` (GQA 4 on 2; bf16): the same
    outputs and LSE bit for bit."""
    from flashmask3.optimized import fwd_config
    from flashmask3.optimized.interface import forward

    scale = 1 / math.sqrt(head_dim)
    mask = masks.build(name, seqlen, batch=2, heads=4, seed=seed, device="cuda")
    q, k, v, _ = random_inputs(
        2, seqlen, seqlen, 4, 2, head_dim, torch.bfloat16, "cuda", seed=seed, head_dim_v=head_dim_v
    )
    default = fwd_config(head_dim, mask.causal, mask.startend_row_indices.shape[-1])
    out, lse = forward(q, k, v, mask, scale, config=dataclasses.replace(default, **{field: False}))
    changed = forward(q, k, v, mask, scale, config=dataclasses.replace(default, **{field: True}))
    assert torch.equal(out, changed[0]) and torch.equal(lse, changed[1])


@pytest.mark.parametrize(
    "name, segments",
    [
        ("full", False),
        ("causal", False),
        ("causal_document", False),
        ("causal_document", True),
        ("document", True),
        ("share_question", True),
    ],
)
@pytest.mark.parametrize("head_dim, head_dim_v", [(256, 256), (192, 128)])
def test_o_from_registers_gives_the_staged_stores_numbers(name, head_dim, head_dim_v, segments):
    """`o_from_registers`: O stored from registers, the Q buffer freed after the last S GEMM, into
    NaN-poisoned outputs: the staged TMA store's outputs and LSE bit for bit (a ragged length: the
    last tile's rows past the end left out; with segment tiles, each segment's last tile's too),
    GQA 4 on 2."""
    from flashmask3.optimized import fwd_config
    from flashmask3.optimized.interface import forward

    seqlen, scale = 1531, 1 / math.sqrt(head_dim)
    mask = masks.build(name, seqlen, batch=2, heads=4, seed=43, device="cuda")
    q, k, v, _ = random_inputs(
        2, seqlen, seqlen, 4, 2, head_dim, torch.bfloat16, "cuda", seed=43, head_dim_v=head_dim_v
    )
    staged = fwd_config(head_dim, mask.causal, mask.startend_row_indices.shape[-1])
    staged = dataclasses.replace(staged, segment_tiles=segments, o_from_registers=False)
    results = []
    for config in (staged, dataclasses.replace(staged, o_from_registers=True)):
        out = torch.full((2, seqlen, 4, head_dim_v), math.nan, device="cuda").bfloat16()
        lse = torch.full((2, 4, seqlen), math.nan, device="cuda")
        forward(q, k, v, mask, scale, out=out, lse=lse, config=config)
        results.append((out, lse))
    (out, lse), (direct, direct_lse) = results
    assert not direct.isnan().any()
    assert torch.equal(out, direct) and torch.equal(lse, direct_lse)


@pytest.mark.parametrize("head_dim, head_dim_v", [(256, 256), (192, 128)])
def test_o_from_registers_frees_q_of_a_work_tile_with_no_key_tile(head_dim, head_dim_v):
    """`o_from_registers` where the first two query tiles see no key (non-causal [LTS, UTE] =
    [Sq, 256]: rows 0-255 masked for every key), so their lists are empty and each warpgroup frees
    the Q buffer without an S GEMM: the staged store's numbers bit for bit (zero rows, LSE -inf)."""
    from flashmask3.optimized import fwd_config
    from flashmask3.optimized.interface import forward
    from flashmask3.reference import ColumnMask

    seqlen, scale = 1531, 1 / math.sqrt(head_dim)
    bounds = torch.tensor([seqlen, 256], dtype=torch.int32, device="cuda").expand(2, 1, seqlen, 2).contiguous()
    mask = ColumnMask(bounds, False, seqlen)
    q, k, v, _ = random_inputs(
        2, seqlen, seqlen, 4, 2, head_dim, torch.bfloat16, "cuda", seed=47, head_dim_v=head_dim_v
    )
    staged = dataclasses.replace(fwd_config(head_dim, False, 2), o_from_registers=False)
    out, lse = forward(q, k, v, mask, scale, config=staged)
    direct, direct_lse = forward(q, k, v, mask, scale, config=dataclasses.replace(staged, o_from_registers=True))
    assert torch.equal(out, direct) and torch.equal(lse, direct_lse)
    assert not direct[:, :256].any() and direct_lse[:, :, :256].isneginf().all()
    assert direct[:, 256:].abs().sum() > 0


_HEAD_DIMS = [(128, 128, 1531), (64, 64, 4096), (192, 128, 1531)]  # (q/k, v, a ragged length)


@pytest.mark.parametrize("name", ["causal", "causal_document", "sliding_window", "causal_blockwise"])
@pytest.mark.parametrize("head_dim, head_dim_v, seqlen", _HEAD_DIMS)
def test_diagonal_tiles_give_the_bounds_masks_numbers(name, head_dim, head_dim_v, seqlen):
    """`diagonal_tiles`: the tiles only the causal diagonal cuts, masked by the comparison alone,
    get the same -inf positions as when masked from their keys' bounds (the ragged last key tile
    stays PARTIAL)."""
    assert_a_field_keeps_the_forwards_numbers("diagonal_tiles", name, head_dim, head_dim_v, seqlen, seed=13)


@pytest.mark.parametrize(
    "name", ["full", "causal", "causal_document", "share_question", "random_eviction", "global_sliding_window"]
)
@pytest.mark.parametrize("head_dim, head_dim_v, seqlen", [(192, 128, 1531), (256, 256, 1531), (128, 128, 1531)])
def test_turn_barriers_leave_the_forwards_numbers(name, head_dim, head_dim_v, seqlen):
    """`turn_barriers` off: the warpgroups issue their GEMMs without taking turns, and each refill of
    a warpgroup's prefetched bounds waits for the warpgroup at its bounds barrier; the same outputs
    and LSE bit for bit (the partial-heavy masks race a refill against a slower warp's read if that
    barrier is missing)."""
    assert_a_field_keeps_the_forwards_numbers("turn_barriers", name, head_dim, head_dim_v, seqlen, seed=37)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim, head_dim_v", [(128, 128), (64, 64), (192, 128), (256, 256)])
@pytest.mark.parametrize("seqlen_q, seqlen_k", [(1531, 2048), (2048, 1536), (8192, 8192)])
def test_counted_key_tiles_give_the_listed_tiles_numbers(causal, head_dim, head_dim_v, seqlen_q, seqlen_k):
    """`counted_keys` on calls without a mask or with the causal one alone (`causal=True`): each
    work tile's key tiles counted by the loads and the loop instead of read from the mask warp's
    list (the diagonal's by the comparison), the same outputs and LSE bit for bit as the list, and
    as the same causal mask given with its bounds (GQA 4 on 2; with Sq != Sk the causal diagonal
    bottom-right: a ragged last query tile, or with more queries than keys rows that see none)."""
    from conftest import plain_causal_mask
    from flashmask3.optimized.interface import forward, mask_configs

    scale = 1 / math.sqrt(head_dim)
    q, k, v, _ = random_inputs(
        2, seqlen_q, seqlen_k, 4, 2, head_dim, torch.bfloat16, "cuda", seed=59, head_dim_v=head_dim_v
    )
    mask = plain_causal_mask(1, seqlen_q, seqlen_k, 1, "cuda") if causal else None
    listed = dataclasses.replace(mask_configs(head_dim, mask)[0], counted_keys=False)
    out, lse = forward(q, k, v, None, scale, config=listed, causal=causal)
    counted = forward(q, k, v, None, scale, config=dataclasses.replace(listed, counted_keys=True), causal=causal)
    if causal:
        bounded = forward(q, k, v, mask, scale, config=listed)
        assert torch.equal(out, bounded[0]) and torch.equal(lse, bounded[1])
    assert torch.equal(out, counted[0]) and torch.equal(lse, counted[1])


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim, head_dim_v", [(128, 128), (64, 64), (192, 128), (256, 256)])
@pytest.mark.parametrize("seqlen_q, seqlen_k", [(1531, 2048), (2048, 1536), (4096, 4096)])
def test_counted_query_steps_give_the_listed_steps_gradients(causal, head_dim, head_dim_v, seqlen_q, seqlen_k):
    """`counted_steps` on calls without a mask or with the causal one alone: each key tile's query
    tiles counted by the loads and the steps instead of listed by the mask warp, with no stage for a
    head's end. Against the list (GQA 4 on 2, a ragged last query tile, rows that see no key): dK
    and dV bit for bit and dQ within the fp32 adds' order in whole CTAs, deterministic mode bit for
    bit, also against the causal mask given with its bounds; split CTAs (every one split, each part
    counting its own query tiles) within their parts' summation order."""
    from conftest import plain_causal_mask
    from flashmask3.optimized.interface import backward, forward, mask_configs

    scale = 1 / math.sqrt(head_dim)
    q, k, v, dout = random_inputs(
        2, seqlen_q, seqlen_k, 4, 2, head_dim, torch.bfloat16, "cuda", seed=61, head_dim_v=head_dim_v
    )
    out, lse = forward(q, k, v, None, scale, causal=causal)
    args = (dout, q, k, v, out, lse, None, scale)
    listed = dataclasses.replace(mask_configs(head_dim, None, causal=causal)[1], counted_steps=False)
    counted = dataclasses.replace(listed, counted_steps=True)
    whole = [dataclasses.replace(c, split_ctas_max_parts=0) for c in (listed, counted)]
    (dq, dk, dv), (dq2, dk2, dv2) = (backward(*args, config=c, causal=causal) for c in whole)
    assert torch.equal(dk, dk2) and torch.equal(dv, dv2)
    torch.testing.assert_close(dq2, dq, rtol=1e-2, atol=1e-3)
    deterministic = [backward(*args, True, config=c, causal=causal) for c in whole]
    assert all(torch.equal(a, b) for a, b in zip(*deterministic))
    if causal:
        mask = plain_causal_mask(1, seqlen_q, seqlen_k, 1, "cuda")
        bounded = backward(dout, q, k, v, out, lse, mask, scale, True, config=whole[0])
        assert all(torch.equal(a, b) for a, b in zip(deterministic[1], bounded))
        split = [dataclasses.replace(c, split_ctas_max_parts=4, split_ctas_slack_pct=-100) for c in (listed, counted)]
        for a, b in zip(*(backward(*args, config=c, causal=causal) for c in split)):
            torch.testing.assert_close(b, a, rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("name", ["global_sliding_window", "document", "prefix_lm_document", "prefix_lm_causal"])
@pytest.mark.parametrize("head_dim, head_dim_v, seqlen", [*_HEAD_DIMS, (256, 256, 1531)])
def test_one_interval_tiles_give_the_full_masks_numbers(name, head_dim, head_dim_v, seqlen):
    """`one_interval_tiles`: PARTIAL tiles of a non-causal mask that one interval alone reaches,
    masked by that interval's bounds, get the same -inf positions as with both intervals."""
    assert_a_field_keeps_the_forwards_numbers("one_interval_tiles", name, head_dim, head_dim_v, seqlen, seed=37)


@pytest.mark.parametrize(
    "name", ["sliding_window", "causal_document", "share_question", "causal_blockwise", "qk_sparse", "random_eviction"]
)
@pytest.mark.parametrize("head_dim, head_dim_v, seqlen", _HEAD_DIMS)
def test_off_diagonal_tiles_give_the_full_masks_numbers(name, head_dim, head_dim_v, seqlen):
    """`off_diagonal_tiles`: PARTIAL tiles the causal diagonal does not cut, masked by their bounds
    alone, get the same -inf positions as with the causal comparison."""
    assert_a_field_keeps_the_forwards_numbers("off_diagonal_tiles", name, head_dim, head_dim_v, seqlen, seed=31)


@pytest.mark.parametrize(
    "name",
    [
        "full",
        "causal",
        "causal_document",
        "document",
        "share_question",
        "sliding_window",
        "random_eviction",
        "causal_blockwise",
        "qk_sparse",
    ],
)
def test_128_row_steps_at_head_dim_64_match_the_reference(name):
    """`query_tile=128` (two Q/dO stages, the LSE after the S GEMM): dQ, dK and dV against the fp32
    reference as close as the 64-row steps' (GQA 4 on 2, a ragged length, NaN-poisoned dK/dV),
    deterministic mode bit for bit run to run."""
    from flashmask3.optimized import bwd_config
    from flashmask3.optimized.interface import backward, forward
    from flashmask3.reference import reference_attention

    seqlen, scale = 1531, 1 / math.sqrt(64)
    mask = masks.build(name, seqlen, batch=2, heads=4, seed=41, device="cuda")
    q, k, v, dout = random_inputs(2, seqlen, seqlen, 4, 2, 64, torch.bfloat16, "cuda", seed=41)
    default = bwd_config(64, mask.causal, mask.startend_row_indices.shape[-1])
    rows_64 = dataclasses.replace(default, query_tile=64, q_stages=3, lse_ahead=mask.startend_row_indices.shape[-1] < 4)
    rows_128 = dataclasses.replace(default, query_tile=128, q_stages=2, lse_ahead=False, short_grid_q_stages=0)
    out, lse = forward(q, k, v, mask, scale)
    fp32 = [t.detach().float().requires_grad_() for t in (q, k, v)]
    expected = torch.autograd.grad(reference_attention(*fp32, mask, scale)[0], fp32, dout.float())
    inputs = (dout, q, k, v, out, lse, mask, scale)
    errors = {}
    for label, config in (("64", rows_64), ("128", rows_128)):
        poisoned = [torch.full_like(t, math.nan) for t in (k, v)]
        grads = backward(*inputs, dk=poisoned[0], dv=poisoned[1], config=config)
        errors[label] = [((g.float() - w).norm() / w.norm()).item() for g, w in zip(grads, expected)]
    assert all(e128 <= 1.5 * e64 + 1e-3 for e64, e128 in zip(errors["64"], errors["128"])), errors
    runs = [backward(*inputs, True, config=rows_128) for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(*runs))


@pytest.mark.parametrize("kind", ["random", "plain"])
@pytest.mark.parametrize("width", [1, 2])
@pytest.mark.parametrize("seqlen_q, seqlen_k", [(1000, 1531), (1531, 1000)])
def test_diagonal_flags_keep_the_numbers_with_unequal_lengths(kind, width, seqlen_q, seqlen_k):
    """Both causal tile flags (diagonal-only, off-diagonal) with Sq != Sk (the diagonal bottom-right
    aligned, query tiles that see no key), on random causal masks (partial tiles off the diagonal)
    and on plain causal ones (tiles only the diagonal cuts): bit for bit the outputs and LSE of
    masking every PARTIAL tile from its bounds with the causal comparison."""
    from conftest import plain_causal_mask, random_column_mask
    from flashmask3.optimized import fwd_config
    from flashmask3.optimized.interface import forward

    if kind == "plain":
        mask = plain_causal_mask(2, seqlen_q, seqlen_k, width, "cuda")
    else:
        gen = torch.Generator().manual_seed(37 + width)
        mask = random_column_mask(gen, 2, 4, seqlen_q, seqlen_k, True, width).to("cuda")
    q, k, v, _ = random_inputs(2, seqlen_q, seqlen_k, 4, 2, 128, torch.bfloat16, "cuda", seed=37)
    plain = dataclasses.replace(fwd_config(128, True, width), diagonal_tiles=False, off_diagonal_tiles=False)
    out, lse = forward(q, k, v, mask, 1 / math.sqrt(128), config=plain)
    flagged = dataclasses.replace(plain, diagonal_tiles=True, off_diagonal_tiles=True)
    flagged_out, flagged_lse = forward(q, k, v, mask, 1 / math.sqrt(128), config=flagged)
    assert torch.equal(out, flagged_out) and torch.equal(lse, flagged_lse)


def test_deterministic_gradients_are_bitwise_equal():
    from flashmask3.optimized.interface import backward, forward

    q, k, v, dout = random_inputs(1, 2048, 2048, 4, 4, 128, torch.bfloat16, "cuda", seed=5)
    mask = masks.build("document", 2048, batch=1, heads=4, seed=5, device="cuda")
    scale = 1 / math.sqrt(128)
    out, lse = forward(q, k, v, mask, scale)
    first = backward(dout, q, k, v, out, lse, mask, scale, deterministic=True)
    for _ in range(3):
        again = backward(dout, q, k, v, out, lse, mask, scale, deterministic=True)
        assert all(torch.equal(a, b) for a, b in zip(first, again))


def test_torch_compile_of_a_cute_attention_block_matches_eager():
    """A user's `torch.compile` around a block that calls the cute backend (projections before and
    after it): the compiled block gives the eager output and gradients (the kernels themselves run
    outside Dynamo's graphs)."""
    import flashmask3 as fm

    torch.manual_seed(7)
    b, s, h, d = 2, 1024, 4, 128
    mask = masks.build("causal_document", s, batch=b, heads=h, seed=7, device="cuda")
    proj = torch.nn.Linear(h * d, h * d, device="cuda", dtype=torch.bfloat16)

    def block(x):
        q = k = v = proj(x).view(b, s, h, d)
        return proj(fm.attention(q, k, v, mask, backend="cute").reshape(b, s, h * d)).float().square().mean()

    x = torch.randn(b, s, h * d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    eager_loss = block(x)
    eager_grads = torch.autograd.grad(eager_loss, [x, proj.weight])
    compiled_loss = torch.compile(block)(x)
    compiled_grads = torch.autograd.grad(compiled_loss, [x, proj.weight])
    torch.testing.assert_close(compiled_loss, eager_loss, rtol=1e-2, atol=0)
    for compiled, eager in zip(compiled_grads, eager_grads):  # relative to the gradient's size: bf16 roundings
        assert eager.norm() > 0
        assert ((compiled.float() - eager.float()).norm() / eager.float().norm()).item() < 2e-2


@pytest.mark.parametrize("head_dim, dtype", [(128, torch.bfloat16), (64, torch.float16)])
def test_persistent_forward_is_bitwise_the_one_cta_per_tile_forward(monkeypatch, head_dim, dtype):
    """The persistent grid with a handful of CTAs (each drawing dozens of work tiles, short lists and
    empty ones among them) writes every output and gives bitwise the result of one CTA per work
    tile, which matches the reference; every mask, GQA, and Sq > Sk (query tiles that see no key)."""
    from conftest import plain_causal_mask
    from flashmask3.optimized import interface
    from flashmask3.optimized.interface import forward, mask_fwd_config

    cases = [
        (name, masks.build(name, 1536, batch=3, heads=2, seed=11, device="cuda"), 3, 1536, 1536)
        for name in masks.MASK_NAMES
    ]
    cases.append(
        (
            "causal_sq>sk",
            plain_causal_mask(1, 1300, 700, 1, "cuda"),
            2,
            1300,
            700,
        )
    )
    for name, mask, batch, sq, sk in cases:
        q, k, v, _ = random_inputs(batch, sq, sk, 8, 2, head_dim, dtype, "cuda", seed=sq + len(name))
        scale = 1 / math.sqrt(head_dim)
        one_cta_per_tile = dataclasses.replace(mask_fwd_config(head_dim, mask), persistent=False)
        expected_out, expected_lse = forward(q, k, v, mask, scale, config=one_cta_per_tile)
        report = compare("cute", q, k, v, mask)  # the chosen, persistent configuration
        assert report.passed, (name, report.failures())
        for ctas in (1, 5):
            monkeypatch.setattr(interface, "_sm_count", lambda device, ctas=ctas: ctas)
            out = torch.full_like(q, math.nan)
            lse = torch.full((batch, 8, sq), math.nan, device="cuda")
            forward(q, k, v, mask, scale, out=out, lse=lse)
            assert torch.equal(out, expected_out) and torch.equal(lse, expected_lse), (name, ctas)
