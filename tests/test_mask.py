"""ColumnMask semantics, validation, conversions and block classification."""

import itertools

import pytest
import torch
from conftest import random_column_mask
from flashmask3.reference import PARTIAL, SKIP, UNMASKED, ColumnMask, masks
from flashmask3.reference import mask as mask_module
from hypothesis import given, settings
from hypothesis import strategies as st

VARIANTS = [(True, 1), (True, 2), (False, 2), (False, 4)]


def col(*vectors, causal):
    idx = torch.tensor(list(zip(*vectors)), dtype=torch.int32).view(1, 1, len(vectors[0]), len(vectors))
    return ColumnMask(idx, causal, len(vectors[0]))


def dense_of(pred, n=10):
    return torch.tensor([[bool(pred(i, j)) for j in range(n)] for i in range(n)])


def doc(i):
    return 0 if i < 4 else 1 if i < 7 else 2


# The 10-token examples of Paddle's flashmask_attention docstring, with the mask they describe.
DOCSTRING_EXAMPLES = {
    "causal_document": (
        col([4, 4, 4, 4, 7, 7, 7, 10, 10, 10], causal=True),
        lambda i, j: j <= i and doc(i) == doc(j),
    ),
    "document": (
        col([4, 4, 4, 4, 7, 7, 7, 10, 10, 10], [0, 0, 0, 0, 4, 4, 4, 7, 7, 7], causal=False),
        lambda i, j: doc(i) == doc(j),
    ),
    "sliding_window": (
        col([3, 4, 5, 6, 7, 8, 9, 10, 10, 10], causal=True),
        lambda i, j: j <= i < j + 3,
    ),
    "share_question": (
        col([10, 10, 10, 10, 7, 7, 7, 10, 10, 10], causal=True),
        lambda i, j: j <= i and (j < 4 or (j < 7) == (i < 7)),
    ),
    "global_sliding_window": (
        col(
            [10, 10, 4, 5, 6, 7, 8, 9, 10, 10],
            [10] * 10,
            [0, 0, 0, 0, 2, 2, 2, 2, 2, 2],
            [0, 0, 0, 0, 3, 4, 5, 6, 7, 8],
            causal=False,
        ),
        lambda i, j: i < 2 or j < 2 or abs(i - j) <= 1,
    ),
    "causal_blockwise": (
        col([4, 4, 4, 4, 10, 10, 10, 10, 10, 10], [7, 7, 7, 7, 10, 10, 10, 10, 10, 10], causal=True),
        lambda i, j: j <= i and (j >= 4 or i < 4 or i >= 7),
    ),
    "prefix_lm_causal": (
        col([10] * 10, [0, 0, 0, 0, 0, 5, 6, 7, 8, 9], causal=False),
        lambda i, j: j < 5 or j <= i,
    ),
    "qk_sparse": (
        col([10, 10, 2, 3, 4, 5, 6, 7, 10, 10], [10, 10, 5, 5, 5, 5, 8, 8, 10, 10], causal=True),
        lambda i, j: j <= i and not (2 <= j < 5 and j <= i < 5) and not (6 <= j < 8 and j <= i < 8),
    ),
}


@pytest.mark.parametrize("name", sorted(DOCSTRING_EXAMPLES))
def test_docstring_examples_match_their_dense_mask(name):
    mask, pred = DOCSTRING_EXAMPLES[name]
    expected = dense_of(pred)
    assert torch.equal(mask.to_dense()[0, 0], expected)
    assert mask.density() == pytest.approx(expected.float().mean().item())
    assert torch.equal(ColumnMask.from_dense(expected, mask.causal).to_dense()[0, 0], expected)


def test_causal_is_bottom_right_aligned_when_sq_differs_from_sk():
    sq, sk = 3, 5
    mask = ColumnMask(torch.full((1, 1, sk, 1), sq, dtype=torch.int32), True, sq)
    expected = torch.tensor([[j <= i + sk - sq for j in range(sk)] for i in range(sq)])
    assert torch.equal(mask.to_dense()[0, 0], expected)
    assert mask.visible_counts().sum().item() == expected.sum().item()


@pytest.mark.parametrize(
    "idx, causal, sq, error, match",
    [
        (torch.zeros(1, 1, 4, 1, dtype=torch.int64), True, 4, TypeError, "int32"),
        (torch.zeros(1, 4, 1, dtype=torch.int32), True, 4, ValueError, "4-D"),
        (torch.zeros(1, 1, 4, 4, dtype=torch.int32), True, 4, ValueError, r"one of \(1, 2\) when causal=True"),
        (torch.zeros(1, 1, 4, 1, dtype=torch.int32), False, 4, ValueError, r"one of \(2, 4\) when causal=False"),
        (torch.full((1, 1, 4, 1), 5, dtype=torch.int32), True, 4, ValueError, r"\[0, seqlen_q=4\]"),
        (torch.full((1, 1, 4, 1), -1, dtype=torch.int32), True, 4, ValueError, r"\[0, seqlen_q=4\]"),
        (torch.tensor([[[[3, 1]] * 4]], dtype=torch.int32), True, 4, ValueError, "LTS > LTE"),
        (torch.tensor([[[[0, 4, 3, 1]] * 4]], dtype=torch.int32), False, 4, ValueError, "UTS > UTE"),
        (torch.zeros(1, 1, 4, 1, dtype=torch.int32), 1, 4, TypeError, "causal must be a bool"),
        (torch.zeros(1, 1, 4, 1, dtype=torch.int32), True, 0, ValueError, "seqlen_q"),
        ([[0]], True, 4, TypeError, "torch.Tensor"),
    ],
)
def test_validation_errors_name_the_problem(idx, causal, sq, error, match):
    with pytest.raises(error, match=match):
        ColumnMask(idx, causal, sq)


def test_non_causal_two_vectors_allow_lts_below_ute():
    mask = col([1, 1], [2, 2], causal=False)  # every row hidden: [1, 2) U [0, 2)
    assert not mask.to_dense().any()


def test_check_compatible_names_the_mismatch():
    mask = masks.build("causal", 64)
    with pytest.raises(ValueError, match="seqlen"):
        mask.check_compatible(1, 4, 4, 32, 64)
    with pytest.raises(ValueError, match="Sk=64"):
        mask.check_compatible(1, 4, 4, 64, 32)
    with pytest.raises(ValueError, match="batch dim must be 1 or 2"):
        masks.build("causal", 64, batch=3).check_compatible(2, 4, 4, 64, 64)
    with pytest.raises(ValueError, match="head dim must be 1, 2"):
        masks.build("random_eviction", 64, heads=3).check_compatible(1, 4, 2, 64, 64)


def test_from_dense_rejects_unrepresentable_columns():
    dense = torch.ones(6, 6, dtype=torch.bool)
    dense[[0, 2, 4], 3] = False  # three runs in column 3
    with pytest.raises(ValueError, match="key column 3 .* 3 masked row runs"):
        ColumnMask.from_dense(dense, causal=False)
    causal = torch.tril(torch.ones(6, 6, dtype=torch.bool))
    causal[[2, 4], 1] = False  # two runs below the diagonal
    with pytest.raises(ValueError, match="key column 1"):
        ColumnMask.from_dense(causal, causal=True)
    with pytest.raises(ValueError, match="not causal: query 0 attends key 1"):
        ColumnMask.from_dense(torch.ones(4, 4, dtype=torch.bool), causal=True)
    with pytest.raises(TypeError, match="bool"):
        ColumnMask.from_dense(torch.ones(4, 4))


def test_from_dense_picks_the_smallest_variant():
    assert ColumnMask.from_dense(torch.tril(torch.ones(8, 8, dtype=torch.bool))).startend_row_indices.shape[-1] == 1
    assert not ColumnMask.from_dense(torch.ones(8, 8, dtype=torch.bool)).causal


def test_from_mask_mod_matches_flex_style_definition():
    docs = torch.tensor([0] * 5 + [1] * 7 + [2] * 4)

    def mask_mod(b, h, q, kv):
        return (docs[q] == docs[kv]) & (kv <= q)

    mask = ColumnMask.from_mask_mod(mask_mod, 1, 1, 16, 16)
    assert mask.causal and mask.startend_row_indices.shape[-1] == 1
    assert mask.startend_row_indices.flatten().tolist() == [5] * 5 + [12] * 7 + [16] * 4

    with pytest.raises(ValueError, match="not representable"):
        ColumnMask.from_mask_mod(lambda b, h, q, kv: (q + kv) % 3 == 0, 1, 1, 8, 8)


@pytest.mark.parametrize("causal, width", VARIANTS)
@pytest.mark.parametrize("sq, sk", [(37, 37), (29, 41), (50, 23)])
def test_dense_roundtrip_density_and_classes_on_random_masks(causal, width, sq, sk):
    gen = torch.Generator().manual_seed(sq * 7 + sk + width)
    mask = random_column_mask(gen, 2, 3, sq, sk, causal, width)
    dense = mask.to_dense()
    back = ColumnMask.from_dense(dense, causal)
    assert torch.equal(back.to_dense(), dense)
    assert torch.equal(mask.visible_counts(), dense.sum(-2))
    assert_classes_exact(mask, dense, 8, 16)


def assert_classes_exact(mask, dense, bm, bn):
    classes = mask.block_classes(bm, bn)
    tm, tn = classes.classes.shape[-2:]
    assert tm == -(-mask.seqlen_q // bm) and tn == -(-mask.seqlen_k // bn)
    for i, j in itertools.product(range(tm), range(tn)):
        tile = dense[:, :, i * bm : (i + 1) * bm, j * bn : (j + 1) * bn].flatten(2)
        c = classes.classes[:, :, i, j]
        assert bool((~tile[c == SKIP]).all()), "a SKIP tile has a visible element"
        assert bool(tile[c == UNMASKED].all()), "an UNMASKED tile has a masked element"
    total = classes.skip + classes.partial + classes.unmasked
    assert total == classes.classes.numel()
    assert classes.partial == int((classes.classes == PARTIAL).sum())


@settings(max_examples=60, deadline=None)
@given(
    variant=st.sampled_from(VARIANTS),
    sq=st.integers(1, 40),
    sk=st.integers(1, 40),
    bm=st.sampled_from([1, 4, 16]),
    bn=st.sampled_from([1, 8, 32]),
    seed=st.integers(0, 2**31 - 1),
)
def test_block_classes_are_exact_for_any_mask(variant, sq, sk, bm, bn, seed):
    mask = random_column_mask(torch.Generator().manual_seed(seed), 1, 2, sq, sk, *variant)
    dense = mask.to_dense()
    assert_classes_exact(mask, dense, bm, bn)
    assert torch.equal(ColumnMask.from_dense(dense, variant[0]).to_dense(), dense)


def test_equality_compares_variant_length_device_and_boundaries_without_raising():
    a = masks.build("causal_document", 64, seed=1)
    same = ColumnMask(a.startend_row_indices.clone(), True, 64)
    assert a == same and not (a != same) and hash(a) == hash(same)
    assert len({a, same}) == 1
    assert a != masks.build("causal_document", 64, seed=2)
    assert a != ColumnMask(a.startend_row_indices, True, 65)
    assert a != ColumnMask(a.startend_row_indices.expand(2, -1, -1, -1).contiguous(), True, 64)
    assert a != a.to("meta")
    assert a != None and a != "causal_document"  # noqa: E711
    # The same dense mask in another variant is another mask.
    lte = torch.full_like(a.startend_row_indices, 64)
    wider = ColumnMask(torch.cat([a.startend_row_indices, lte], -1), True, 64)
    assert torch.equal(wider.to_dense(), a.to_dense()) and wider != a


@pytest.mark.parametrize("chunk_elements", [1, 97])
@pytest.mark.parametrize("causal, width", VARIANTS)
def test_from_dense_in_small_chunks_is_exact(monkeypatch, chunk_elements, causal, width):
    # 1 element: one query row per chunk; 97: chunks whose runs cross chunk boundaries.
    monkeypatch.setattr(mask_module, "_CHUNK_ELEMENTS", chunk_elements)
    for sq, sk in [(37, 37), (29, 41), (50, 23)]:
        mask = random_column_mask(torch.Generator().manual_seed(sq + width), 2, 3, sq, sk, causal, width)
        dense = mask.to_dense()
        back = ColumnMask.from_dense(dense, causal)
        assert back.causal == causal and torch.equal(back.to_dense(), dense)
        assert torch.equal(ColumnMask.from_dense(dense).to_dense(), dense)
    test_from_dense_rejects_unrepresentable_columns()


def test_from_mask_mod_evaluates_chunks_of_rows_and_broadcasts(monkeypatch):
    monkeypatch.setattr(mask_module, "_CHUNK_ELEMENTS", 8192)
    sq = sk = 1024
    calls = []

    def mask_mod(b, h, q, kv):
        calls.append(q.numel() * kv.numel() * b.numel() * h.numel())
        causal = kv <= q
        if int(q.min()) < 300:  # the first chunks do not depend on the head, later ones do
            return causal
        return causal & ((h == 1) | (kv >= q - 3) | (b == 1))

    mask = ColumnMask.from_mask_mod(mask_mod, 2, 2, sq, sk)
    assert max(calls) == 8192 and len(calls) == sq // 2  # 2 rows x 1024 keys x 2 batches x 2 heads
    i, j = torch.arange(sq).view(1, 1, -1, 1), torch.arange(sk).view(1, 1, 1, -1)
    b, h = torch.arange(2).view(-1, 1, 1, 1), torch.arange(2).view(1, -1, 1, 1)
    expected = (j <= i) & ((i < 300) | (h == 1) | (j >= i - 3) | (b == 1))
    assert mask.causal and mask.startend_row_indices.shape == (2, 2, sk, 1)
    assert torch.equal(mask.to_dense(), expected.expand(2, 2, sq, sk))
