"""ColumnMask constructors from packing metadata against their dense definitions and masks.build."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from flashmask3.reference import ColumnMask, masks
from hypothesis import given, settings
from hypothesis import strategies as st

# Document lengths per batch row: a single document, all length 1, and random ones with 1s.
LAYOUTS = {
    "single": [[37], [37]],
    "ones": [[1] * 9, [4, 1, 1, 3]],
    "random": [[1, 12, 3, 1, 1, 20, 2], [15, 1, 23, 1]],
}


def cu_of(rows):
    """Batched cu_seqlens, rows with fewer documents padded by repeating their last entry."""
    n = max(len(r) for r in rows)
    cu = [np.concatenate([[0], np.cumsum(r), np.full(n - len(r), sum(r))]) for r in rows]
    return torch.tensor(np.stack(cu))


def document_ids_of(rows):
    # Ids are arbitrary values; neighbouring documents differ.
    return torch.tensor(np.stack([np.repeat(np.arange(len(r)) * 7 % 5 + np.arange(len(r)) * 10, r) for r in rows]))


def position_ids_of(rows):
    return torch.tensor(np.stack([np.concatenate([np.arange(n) for n in r]) for r in rows]))


def doc_of(rows):
    return torch.tensor(np.stack([np.repeat(np.arange(len(r)), r) for r in rows]))


def dense(pred, rows):
    """[B, 1, S, S] from pred(b, i, j) over broadcast index tensors."""
    s = sum(rows[0])
    b = torch.arange(len(rows)).view(-1, 1, 1)
    i = torch.arange(s).view(1, -1, 1)
    j = torch.arange(s).view(1, 1, -1)
    return pred(b, i, j).expand(len(rows), s, s).unsqueeze(1)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("causal", [True, False])
def test_document_masks_match_the_dense_definition_from_every_form(layout, causal):
    rows = LAYOUTS[layout]
    doc = doc_of(rows)
    expected = dense(lambda b, i, j: (doc[b, i] == doc[b, j]) & ((j <= i) | (not causal)), rows)
    build = ColumnMask.causal_document if causal else ColumnMask.document
    forms = [
        build(cu_of(rows)),
        build(document_ids=document_ids_of(rows)),
        build(position_ids=position_ids_of(rows)),
        build(cu_of(rows).to(torch.int32), seqlen=sum(rows[0])),
    ]
    for mask in forms:
        assert mask.causal == causal and mask.seqlen_q == sum(rows[0])
        assert torch.equal(mask.to_dense(), expected)
        assert mask.shape == expected.shape and mask.ndim == expected.ndim == 4
        assert mask == forms[0]
    # One sequence: a plain list of boundaries, batch 1.
    one = build([0, *np.cumsum(rows[0]).tolist()])
    assert one.batch == 1 and torch.equal(one.to_dense()[0], expected[0])


def test_tokens_after_the_last_boundary_form_one_more_document():
    mask = ColumnMask.causal_document([0, 3, 5], seqlen=9)
    doc = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2])
    i, j = torch.arange(9).view(-1, 1), torch.arange(9).view(1, -1)
    assert torch.equal(mask.to_dense()[0, 0], (doc[i] == doc[j]) & (j <= i))


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_prefix_lm_document_matches_the_dense_definition(layout):
    rows = LAYOUTS[layout]
    n = max(len(r) for r in rows)
    # Prefix 0 (causal), 1, the whole document and longer than it; 0 on padded slots.
    prefix = torch.tensor(
        [[(0, 1, length, length + 5)[d % 4] for d, length in enumerate(r)] + [0] * (n - len(r)) for r in rows]
    )
    doc = doc_of(rows)
    cu = cu_of(rows)
    start = cu.gather(1, doc)
    prefix_end = start + prefix.gather(1, doc)
    expected = dense(lambda b, i, j: (doc[b, i] == doc[b, j]) & ((j < prefix_end[b, j]) | (j <= i)), rows)
    mask = ColumnMask.prefix_lm_document(cu, prefix)
    assert not mask.causal and torch.equal(mask.to_dense(), expected)


def share_question_case(rows):
    """Segments per row: (cu_seqlens, is_question, segment id per token, document id per token)."""
    cus, flags, segs, docs = [], [], [], []
    for r in rows:
        gen = np.random.default_rng(len(r))
        parts, is_q = [], []
        for length in r:  # each document: a question, then 0-3 answers when it is long enough
            cuts = np.sort(
                gen.choice(np.arange(1, length), size=min(length - 1, int(gen.integers(0, 4))), replace=False)
            )
            sizes = np.diff(np.concatenate([[0], cuts, [length]]))
            parts += sizes.tolist()
            is_q += [True] + [False] * (len(sizes) - 1)
        cus.append(np.concatenate([[0], np.cumsum(parts)]))
        flags.append(is_q)
        segs.append(np.repeat(np.arange(len(parts)), parts))
        docs.append(np.repeat(np.cumsum(is_q) - 1, parts))
    n = max(len(f) for f in flags)
    cu = torch.tensor(np.stack([np.concatenate([c, np.full(n + 1 - len(c), c[-1])]) for c in cus]))
    is_question = torch.tensor([f + [False] * (n - len(f)) for f in flags])
    return cu, is_question, torch.tensor(np.stack(segs)), torch.tensor(np.stack(docs))


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_share_question_matches_the_dense_definition(layout):
    rows = LAYOUTS[layout]
    cu, is_question, seg, doc = share_question_case(rows)
    question = is_question.gather(1, seg)
    expected = dense(
        lambda b, i, j: (j <= i) & (doc[b, i] == doc[b, j]) & ((seg[b, i] == seg[b, j]) | question[b, j]), rows
    )
    mask = ColumnMask.share_question(cu, is_question)
    assert mask.causal and torch.equal(mask.to_dense(), expected)


def test_share_question_answers_before_any_question_and_empty_questions():
    # Segments: answer [0, 2), question [2, 4), answer [4, 5), empty question at 5, answer [5, 8).
    mask = ColumnMask.share_question([0, 2, 4, 5, 5, 8], [False, True, False, True, False])
    seg = torch.tensor([0, 0, 1, 1, 2, 4, 4, 4])
    i, j = torch.arange(8).view(-1, 1), torch.arange(8).view(1, -1)
    sees_question = (seg[j] == 1) & (seg[i] == 2)
    assert torch.equal(mask.to_dense()[0, 0], (j <= i) & ((seg[i] == seg[j]) | sees_question))


def replayed_documents(name, seqlen, batch, seed):
    """The documents (and prefixes or segments) masks.build samples, from the same seeds."""
    out = []
    for b in range(batch):
        rng = np.random.default_rng([seed, b, 0])
        lengths = masks.sample_docs(rng, seqlen, None)
        if name == "prefix_lm_document":
            out.append((lengths, [int(rng.integers(1, n + 1)) for n in lengths]))
        elif name == "share_question":
            parts = [masks.split_lengths(rng, n, int(rng.integers(2, 7)) + 1) for n in lengths]
            out.append(([p for doc in parts for p in doc], [k == 0 for doc in parts for k in range(len(doc))]))
        else:
            out.append((lengths, None))
    n = max(len(lengths) for lengths, _ in out)
    cu = cu_of([lengths for lengths, _ in out])
    extra = None
    if out[0][1] is not None:
        fill = False if name == "share_question" else 0
        extra = torch.tensor([list(x) + [fill] * (n - len(x)) for _, x in out])
    return cu, extra


@pytest.mark.parametrize("name", ["causal_document", "document", "prefix_lm_document", "share_question"])
@pytest.mark.parametrize("seqlen, seed", [(300, 0), (1000, 3), (8192, 1)])
def test_document_constructors_equal_masks_build_for_the_same_documents(name, seqlen, seed):
    cu, extra = replayed_documents(name, seqlen, 3, seed)
    built = masks.build(name, seqlen, batch=3, seed=seed)
    if name in ("causal_document", "document"):
        mask = getattr(ColumnMask, name)(cu)
    else:
        mask = getattr(ColumnMask, name)(cu, extra)
    assert mask == built


@pytest.mark.parametrize("seqlen, window", [(1, 1), (50, 1), (50, 7), (50, 50), (50, 80), (8192, 512)])
def test_sliding_window_equals_masks_build_and_the_dense_definition(seqlen, window):
    mask = ColumnMask.sliding_window(seqlen, window)
    if seqlen >= 2:
        assert mask == masks.build("sliding_window", seqlen, window=window)
    if seqlen <= 50:
        i, j = torch.arange(seqlen).view(-1, 1), torch.arange(seqlen).view(1, -1)
        assert torch.equal(mask.to_dense()[0, 0], (j <= i) & (i - window < j))
        both_sides = ColumnMask.sliding_window(seqlen, window, causal=False)
        assert not both_sides.causal
        assert torch.equal(both_sides.to_dense()[0, 0], (i - j).abs() < window)


@pytest.mark.parametrize(
    "seqlen, window, global_tokens", [(40, 3, 4), (40, 0, 0), (40, 5, 40), (40, 39, 2), (8192, 512, 16)]
)
def test_global_sliding_window_equals_masks_build_and_the_dense_definition(seqlen, window, global_tokens):
    mask = ColumnMask.global_sliding_window(seqlen, window, global_tokens)
    if window > 0:  # masks.build takes window=0 for its default
        built = masks.build("global_sliding_window", seqlen, window=window, global_tokens=global_tokens)
        assert mask == built
    if seqlen <= 40:
        i, j = torch.arange(seqlen).view(-1, 1), torch.arange(seqlen).view(1, -1)
        expected = ((i - j).abs() <= window) | (i < global_tokens) | (j < global_tokens)
        assert torch.equal(mask.to_dense()[0, 0], expected)


def test_constructors_read_no_value_on_the_host():
    """On the meta device any host read of a value raises: the constructors make none, while
    the checked public constructor does (it validates the boundaries)."""
    meta = torch.device("meta")
    cu = cu_of(LAYOUTS["random"]).to(meta)
    ids = document_ids_of(LAYOUTS["random"]).to(meta)
    positions = position_ids_of(LAYOUTS["random"]).to(meta)
    s = 40
    built = [
        ColumnMask.causal_document(cu, seqlen=s),
        ColumnMask.document(document_ids=ids),
        ColumnMask.causal_document(position_ids=positions),
        ColumnMask.prefix_lm_document(cu, torch.ones(2, 7, dtype=torch.int64, device=meta), seqlen=s),
        ColumnMask.share_question(cu, torch.ones(2, 7, dtype=torch.bool, device=meta), seqlen=s),
        ColumnMask.sliding_window(s, 8, device=meta),
        ColumnMask.global_sliding_window(s, 8, 4, device=meta),
        ColumnMask.causal_document(cu, seqlen=s).to(meta),
    ]
    for mask in built:
        assert mask.device == meta and mask.seqlen_k == s
        assert mask.startend_row_indices.dtype == torch.int32
        assert mask.startend_row_indices.is_contiguous()
    with pytest.raises((RuntimeError, NotImplementedError)):
        ColumnMask(built[0].startend_row_indices, True, s)


@pytest.mark.parametrize(
    "call, error, match",
    [
        (
            lambda: ColumnMask.causal_document(),
            ValueError,
            "exactly one of cu_seqlens, document_ids, position_ids; got none",
        ),
        (
            lambda: ColumnMask.document([0, 4], document_ids=torch.zeros(4, dtype=torch.int64)),
            ValueError,
            "got cu_seqlens, document_ids",
        ),
        (lambda: ColumnMask.causal_document([1, 4]), ValueError, "cu_seqlens must start at 0"),
        (lambda: ColumnMask.causal_document([0, 4, 2, 6]), ValueError, "cu_seqlens must be non-decreasing"),
        (lambda: ColumnMask.causal_document([0, 4, 9], seqlen=8), ValueError, r"at or before seqlen=8, got \[9\]"),
        (lambda: ColumnMask.causal_document([0]), ValueError, r"cu_seqlens must be \[N \+ 1\]"),
        (lambda: ColumnMask.causal_document([0.0, 4.0]), TypeError, "cu_seqlens must hold integers"),
        (lambda: ColumnMask.causal_document([0, 4], seqlen=0), ValueError, "seqlen must be an int >= 1"),
        (
            lambda: ColumnMask.document(document_ids=torch.zeros(2, 5, dtype=torch.int64), seqlen=4),
            ValueError,
            "seqlen=4 but document_ids has 5 tokens",
        ),
        (lambda: ColumnMask.document(position_ids=torch.zeros(5)), TypeError, "position_ids must hold integers"),
        (
            lambda: ColumnMask.document(document_ids=torch.zeros(1, 2, 5, dtype=torch.int64)),
            ValueError,
            r"document_ids must be a tensor \[S\] or \[B, S\]",
        ),
        (
            lambda: ColumnMask.prefix_lm_document([0, 3, 8], [1]),
            ValueError,
            r"prefix_lens must have one entry per segment of cu_seqlens, shape \(2,\)",
        ),
        (lambda: ColumnMask.prefix_lm_document([0, 3, 8], [1, -2]), ValueError, "prefix_lens must be >= 0"),
        (lambda: ColumnMask.share_question([0, 3, 8], [1, 0]), TypeError, "is_question must be bool"),
        (lambda: ColumnMask.sliding_window(16, 0), ValueError, "window must be an int >= 1, got 0"),
        (lambda: ColumnMask.sliding_window(16, 4, causal=1), TypeError, "causal must be a bool"),
        (lambda: ColumnMask.global_sliding_window(16, -1, 2), ValueError, "window must be an int >= 0"),
        (lambda: ColumnMask.global_sliding_window(16, 2, 2.0), ValueError, "global_tokens must be an int >= 0"),
    ],
)
def test_constructor_errors_name_the_argument(call, error, match):
    with pytest.raises(error, match=match):
        call()


@settings(max_examples=60, deadline=None)
@given(
    seqlen=st.integers(1, 48),
    batch=st.integers(1, 3),
    seed=st.integers(0, 2**31 - 1),
)
def test_random_layouts_match_the_dense_definitions(seqlen, batch, seed):
    gen = np.random.default_rng(seed)
    rows = []
    for _ in range(batch):  # a random composition of seqlen, often with documents of length 1
        cuts = np.flatnonzero(gen.random(seqlen - 1) < gen.choice([0.05, 0.3, 0.9]))
        rows.append(np.diff(np.concatenate([[0], cuts + 1, [seqlen]])).tolist())
    doc = doc_of(rows)
    cu = cu_of(rows)
    for causal, build in [(True, ColumnMask.causal_document), (False, ColumnMask.document)]:
        expected = dense(lambda b, i, j: (doc[b, i] == doc[b, j]) & ((j <= i) | (not causal)), rows)
        for mask in (build(cu), build(document_ids=document_ids_of(rows)), build(position_ids=position_ids_of(rows))):
            assert torch.equal(mask.to_dense(), expected)
    prefix = torch.as_tensor(gen.integers(0, seqlen + 1, size=tuple(cu.shape[:-1]) + (cu.shape[-1] - 1,)))
    prefix_end = cu.gather(1, doc) + prefix.gather(1, doc)
    expected = dense(lambda b, i, j: (doc[b, i] == doc[b, j]) & ((j < prefix_end[b, j]) | (j <= i)), rows)
    assert torch.equal(ColumnMask.prefix_lm_document(cu, prefix).to_dense(), expected)
    # The same boundaries as segments, random ones questions.
    is_question = torch.as_tensor(gen.random(prefix.shape) < 0.4)
    seg = doc
    question = is_question.gather(1, seg)
    qdoc = torch.cumsum(torch.where(question & (F.pad(seg[:, 1:] != seg[:, :-1], (1, 0), value=True)), 1, 0), 1)
    expected = dense(
        lambda b, i, j: (j <= i) & (qdoc[b, i] == qdoc[b, j]) & ((seg[b, i] == seg[b, j]) | question[b, j]), rows
    )
    assert torch.equal(ColumnMask.share_question(cu, is_question).to_dense(), expected)


def test_the_constructors_from_packing_metadata_say_their_masks_are_segmented():
    """`segmented`: a hint the document constructors and `masks.build`'s document masks set (the
    cute forward then aligns its tiles to the segments); kept by `to`, not part of equality."""
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    made = [
        ColumnMask.causal_document(cu),
        ColumnMask.document(cu),
        ColumnMask.prefix_lm_document(cu, [1, 2]),
        ColumnMask.share_question(cu, [True, False]),
    ]
    assert all(mask.segmented and mask.to("cpu").segmented for mask in made)
    assert not ColumnMask.sliding_window(8, 3).segmented
    for name in masks.MASK_NAMES:
        expected = name in ("causal_document", "document", "share_question", "prefix_lm_document")
        assert masks.build(name, 64).segmented == expected, name
    plain = ColumnMask(made[0].startend_row_indices, True, 8)
    assert not plain.segmented and plain == made[0]
    with pytest.raises(TypeError, match="segmented must be a bool, got int"):
        ColumnMask(made[0].startend_row_indices, True, 8, segmented=1)
