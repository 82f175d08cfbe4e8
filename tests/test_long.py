"""32K-token checks: the chunked reference against independent per-document attention."""

import math

import pytest
import torch
import torch.nn.functional as F
from flashmask3.reference import masks
from flashmask3.verify import random_inputs, rel_l2

import flashmask3 as fm


@pytest.mark.slow  # 32K tokens: 3 s idle, ~20 s on a loaded CPU
def test_causal_document_32k_equals_per_document_causal_attention():
    seqlen = 32768
    mask = masks.build("causal_document", seqlen, seed=7)
    ends = torch.unique(mask.startend_row_indices.flatten()).tolist()
    assert 10 <= len(ends) <= 14
    q, k, v, dout = random_inputs(1, seqlen, seqlen, 2, 1, 32, torch.float32, seed=3)
    ins = [x.clone().requires_grad_() for x in (q, k, v)]
    out = fm.attention(*ins, mask, backend="reference")
    grads = torch.autograd.grad(out, ins, dout)

    # Documents do not see each other: attention splits into independent causal problems.
    ref_ins = [x.double().clone().requires_grad_() for x in (q, k, v)]
    pieces, start = [], 0
    for end in ends:
        qd, kd, vd = (x[:, start:end].transpose(1, 2) for x in ref_ins)
        pieces.append(
            F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, enable_gqa=True, scale=1 / math.sqrt(32))
        )
        start = end
    ref = torch.cat(pieces, dim=2).transpose(1, 2)
    ref_grads = torch.autograd.grad(ref, ref_ins, dout.double())
    assert rel_l2(out, ref) < 1e-5
    for got, want in zip(grads, ref_grads):
        assert rel_l2(got, want) < 1e-5
