"""Bad input wherever a user can reach: each error names the argument and the accepted values."""

import pytest
import torch

from flashmask3.reference import ColumnMask, masks


@pytest.mark.parametrize(
    "name, params, match",
    [
        ("sliding_window", {"window": 0}, r"window \(mask 'sliding_window', seqlen 256\) must be an int >= 1, got 0"),
        ("sliding_window", {"window": -3}, r"window .* must be an int >= 1, got -3"),
        ("sliding_window", {"window": 2.5}, r"window .* must be an int >= 1, got 2.5"),
        ("global_sliding_window", {"window": -1}, r"window .* must be an int >= 0, got -1"),
        ("global_sliding_window", {"global_tokens": -1}, r"global_tokens .* must be an int >= 0, got -1"),
        ("prefix_lm_causal", {"prefix": -1}, r"prefix .* must be an int in \[0, 256\], got -1"),
        ("prefix_lm_causal", {"prefix": 257}, r"prefix .* must be an int in \[0, 256\], got 257"),
        ("document", {"num_docs": -2}, r"num_docs .* must be an int in \[1, 256\], got -2"),
        ("causal_document", {"num_docs": 0}, r"num_docs .* must be an int in \[1, 256\], got 0"),
        ("share_question", {"num_docs": 300}, r"num_docs .* must be an int in \[1, 256\], got 300"),
        ("random_eviction", {"evict_start": 0}, r"evict_start .* must be an int in \[1, 256\], got 0"),
        ("random_eviction", {"evict_start": 257}, r"evict_start .* must be an int in \[1, 256\], got 257"),
        ("document", {"num_doc": 3}, "mask 'document' takes no parameter 'num_doc'; its parameters: num_docs"),
        ("causal", {"window": 8}, "mask 'causal' takes no parameter 'window'; its parameters: none"),
        ("random_eviction", {"batch": 0}, "batch must be an int >= 1, got 0"),
        ("random_eviction", {"heads": 0}, "heads must be an int >= 1, got 0"),
        ("causal", {"seed": -1}, "seed must be an int >= 0, got -1"),
    ],
)
def test_masks_build_names_a_bad_parameter_and_its_range(name, params, match):
    with pytest.raises(ValueError, match=match):
        masks.build(name, 256, **params)


def test_masks_build_keeps_defaults_and_the_ends_of_each_range():
    assert masks.build("sliding_window", 256, window=None) == masks.build("sliding_window", 256)
    assert masks.build("sliding_window", 256, window=1).to_dense()[0, 0].sum() == 256  # the diagonal
    assert masks.build("global_sliding_window", 256, window=0, global_tokens=4) == (
        ColumnMask.global_sliding_window(256, window=0, global_tokens=4))
    assert masks.build("document", 256, num_docs=256).to_dense()[0, 0].equal(torch.eye(256, dtype=torch.bool))
    assert masks.build("prefix_lm_causal", 256, prefix=256).to_dense().all()
    evict_none = masks.build("random_eviction", 256, evict_start=256)
    assert evict_none.to_dense()[0, 0].equal(torch.ones(256, 256, dtype=torch.bool).tril())
    assert masks.build("random_eviction", 256, evict_start=1).to_dense()[0, 0, 255].sum() == 1
