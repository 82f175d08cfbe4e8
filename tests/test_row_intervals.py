"""`row_intervals`: each query row's visible keys as intervals, exactly the mask's dense definition."""

import importlib

import numpy as np
import pytest
import torch
from conftest import random_column_mask
from flashmask3.reference import ColumnMask, IntervalLimitError, masks, row_intervals

# The package's `row_intervals` is the function; its module holds the chunk budget.
row_intervals_module = importlib.import_module("flashmask3.reference.row_intervals")


def decoded(endpoints: torch.Tensor, seqlen_k: int) -> torch.Tensor:
    """bool [..., Sq, Sk] (True = attend): key j is in [0, E_0) U [E_1, E_2) U ... exactly when an
    even number of endpoints are <= j."""
    keys = torch.arange(seqlen_k).view(-1, 1)
    return (endpoints.unsqueeze(-2) <= keys).sum(-1) % 2 == 0


def assert_exact(mask: ColumnMask, endpoints: torch.Tensor) -> None:
    """The endpoints are in the documented form, as short as the widest row allows, and decode to
    the dense mask."""
    n = endpoints.shape[-1]
    assert endpoints.dtype == torch.int32 and n % 2 == 1
    assert endpoints.shape == (mask.batch, mask.heads, mask.seqlen_q, n)
    assert int(endpoints.min()) >= 0 and int(endpoints.max()) <= mask.seqlen_k
    assert bool((endpoints[..., 1:] >= endpoints[..., :-1]).all())
    # A row that needs all n endpoints has its second-last one before Sk; padding is Sk.
    assert n == 1 or bool((endpoints[..., -2] < mask.seqlen_k).any())
    assert torch.equal(decoded(endpoints, mask.seqlen_k), mask.to_dense())


@pytest.mark.parametrize("name", masks.MASK_NAMES)
def test_the_benchmark_masks_convert_exactly(name):
    mask = masks.build(name, 301, batch=2, heads=3, seed=7)
    assert_exact(mask, row_intervals(mask))


@pytest.mark.parametrize("causal, width", [(True, 1), (True, 2), (False, 2), (False, 4)])
@pytest.mark.parametrize("batch, heads, seqlen_q, seqlen_k", [(1, 1, 97, 97), (2, 3, 61, 133), (3, 2, 150, 37)])
def test_random_masks_of_every_variant_convert_exactly(causal, width, batch, heads, seqlen_q, seqlen_k):
    """Random boundaries give rows with many intervals; causal with Sq != Sk is bottom-right aligned."""
    gen = torch.Generator().manual_seed(seqlen_q * 31 + width)
    mask = random_column_mask(gen, batch, heads, seqlen_q, seqlen_k, causal, width)
    assert_exact(mask, row_intervals(mask))


def test_rows_that_see_all_or_nothing():
    """A row seeing every key is [0, Sk); one seeing none starts with the empty [0, 0)."""
    seqlen = 5
    # Non-causal [LTS, UTE]: key 0 hidden from row 2 on, the others never.
    idx = torch.tensor([[[[2, 0], [5, 0], [5, 0], [5, 0], [5, 0]]]], dtype=torch.int32)
    endpoints = row_intervals(ColumnMask(idx, False, seqlen))
    assert endpoints[0, 0].tolist() == [[5, 5, 5]] * 2 + [[0, 1, 5]] * 3
    nothing = ColumnMask(torch.zeros(1, 1, seqlen, 1, dtype=torch.int32), True, seqlen)
    assert row_intervals(nothing)[0, 0].tolist() == [[0]] * seqlen


def test_rows_are_converted_a_chunk_at_a_time(monkeypatch):
    """Never more rows at once than the chunk budget allows, and the same endpoints as in one go;
    chunks of different widths are padded with Sk."""
    mask = masks.build("share_question", 509, batch=2, seed=3)
    whole = row_intervals(mask)
    seen = []
    masked = ColumnMask.masked

    def recorded(self, rows, cols=None):
        seen.append(len(rows))
        return masked(self, rows, cols)

    monkeypatch.setattr(ColumnMask, "masked", recorded)
    monkeypatch.setattr(row_intervals_module, "_CHUNK_ELEMENTS", 2 * 510 * 7)
    assert torch.equal(row_intervals(mask), whole)
    assert max(seen) == 7 and sum(seen) == 509


def test_a_row_needing_more_than_max_intervals_is_refused_where_it_is_found():
    mask = masks.build("share_question", 301, seed=7)
    most = (row_intervals(mask).shape[-1] + 1) // 2
    assert torch.equal(row_intervals(mask, max_intervals=most), row_intervals(mask))
    with pytest.raises(IntervalLimitError, match=rf"query row \d+ \(batch 0, mask head 0\) needs {most} intervals, "):
        row_intervals(mask, max_intervals=most - 1)


def test_the_first_row_over_the_limit_is_named(monkeypatch):
    """Per head: mask head 1's row 3 is the first to see two runs of keys."""
    idx = torch.full((1, 2, 6, 1), 6, dtype=torch.int32)
    idx[0, 1, 2] = 3  # key 2 hidden from row 3 on: rows 3.. see [0, 2) U [3, ...)
    mask = ColumnMask(idx, True, 6)
    monkeypatch.setattr(row_intervals_module, "_CHUNK_ELEMENTS", 2 * 7 * 2)
    with pytest.raises(IntervalLimitError, match=r"query row 3 \(batch 0, mask head 1\) needs 2 intervals"):
        row_intervals(mask, max_intervals=1)
    assert torch.equal(row_intervals(mask, max_intervals=np.int64(2)), row_intervals(mask))


@pytest.mark.parametrize(
    "mask, max_intervals, error, message",
    [
        (torch.zeros(1, 1, 4, 1, dtype=torch.int32), None, TypeError, "mask must be a ColumnMask, got Tensor"),
        (None, 0, ValueError, "max_intervals must be a positive int or None, got 0"),
        (None, True, ValueError, "max_intervals must be a positive int or None, got True"),
        (None, 2.0, ValueError, "max_intervals must be a positive int or None, got 2.0"),
    ],
)
def test_bad_arguments_are_named(mask, max_intervals, error, message):
    mask = masks.build("causal", 16) if mask is None else mask
    with pytest.raises(error, match=message):
        row_intervals(mask, max_intervals)
