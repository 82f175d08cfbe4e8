"""The CuTe kernels against the reference on a Hopper GPU (skipped elsewhere): forward and the
gradients for a spread of masks and shapes, and bitwise-deterministic gradients on request."""

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


@pytest.mark.parametrize("name", ["causal", "causal_document", "share_question", "random_eviction", "qk_sparse"])
@pytest.mark.parametrize("seqlen, head_dim, dtype", [(777, 64, torch.float16), (1024, 128, torch.bfloat16)])
def test_cute_forward_and_gradients_match_the_reference(name, seqlen, head_dim, dtype):
    mask = masks.build(name, seqlen, batch=2, heads=4, seed=3, device="cuda")
    q, k, v, dout = random_inputs(2, seqlen, seqlen, 4, 2, head_dim, dtype, "cuda", seed=3)
    report = compare("cute", q, k, v, mask, dout)
    assert report.passed, report.failures()


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
