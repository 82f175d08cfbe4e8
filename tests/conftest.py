import os

import pytest
import torch

if not torch.cuda.is_available():
    # Without a GPU the CuTe DSL targets sm_100a; compile checks of the Hopper kernel need sm_90a.
    # It is read when cutlass is first imported, so it is set before any test imports it.
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

from flashmask3.reference import ColumnMask


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def random_column_mask(gen: torch.Generator, batch, heads, seqlen_q, seqlen_k, causal, width) -> ColumnMask:
    """A random valid ColumnMask of the given variant (start <= end within each pair)."""
    pairs = []
    for _ in range(width // 2 if width > 1 else 1):
        a = torch.randint(0, seqlen_q + 1, (batch, heads, seqlen_k, 2), generator=gen)
        pairs.append(a.sort(-1).values)
    if width == 1:
        idx = pairs[0][..., :1]
    elif causal or width == 4:
        idx = torch.cat(pairs, -1)
    else:  # non-causal [LTS, UTE]: independent
        idx = torch.stack([pairs[0][..., 0], pairs[0][..., 1]], -1)
    return ColumnMask(idx.to(torch.int32), causal, seqlen_q)
