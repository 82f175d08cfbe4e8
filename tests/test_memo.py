"""Masks kept while the same tensors come back unchanged (flashmask3/memo.py), and its users: the
FlashAttention-style entry points and the HF integration (CPU)."""

import threading

import torch

from flashmask3.api import _flash_attention_mask
from flashmask3.memo import TensorMemo


def test_a_value_is_kept_for_the_same_tensors_until_they_change_in_place():
    memo, builds = TensorMemo(size=2), []
    a, b = torch.arange(4), torch.arange(4)

    def build(tag):
        builds.append(tag)
        return tag

    assert memo.get("k", [a], lambda: build("a")) == "a"
    assert memo.get("k", [a], lambda: build("again")) == "a"  # kept
    assert memo.get("k", [b], lambda: build("b")) == "b"  # equal values, another tensor
    assert memo.get("other", [a], lambda: build("other")) == "other"  # another key
    a.add_(1)
    assert memo.get("k", [a], lambda: build("changed")) == "changed"  # an in-place change
    assert builds == ["a", "b", "other", "changed"]
    assert len(memo._entries) == 2  # the last two only


def test_inference_tensors_are_built_every_time():
    memo, builds = TensorMemo(size=2), []
    with torch.inference_mode():
        a = torch.arange(4)
    for _ in range(2):
        memo.get("k", [a], lambda: builds.append(1))
    assert len(builds) == 2 and not memo._entries


def test_a_graph_capture_builds_again_unless_the_value_is_a_host_plan(monkeypatch):
    import flashmask3.memo as memo_module

    monkeypatch.setattr(memo_module, "_capturing", lambda tensors: True)
    a, builds = torch.arange(4), []
    recorded, plan = TensorMemo(size=2), TensorMemo(size=2, build_under_capture=False)
    for memo in (recorded, plan):
        for _ in range(2):
            memo.get("k", [a], lambda: builds.append(memo) or len(builds))
    assert builds == [recorded, recorded, plan]


def test_threads_each_get_the_value_of_their_own_key():
    memo = TensorMemo(size=1)  # every thread's entry evicts the others'
    tensors = [torch.arange(i + 1) for i in range(8)]
    wrong = []

    def worker(i):
        for _ in range(200):
            if memo.get(i, [tensors[i]], lambda: i) != i:
                wrong.append(i)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not wrong


def test_flash_attention_masks_are_kept_per_arguments_and_cu_seqlens_tensor():
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    causal = _flash_attention_mask(True, (-1, 0), 12, 12, torch.device("cpu"))
    assert _flash_attention_mask(True, (-1, 0), 12, 12, torch.device("cpu")) is causal
    assert _flash_attention_mask(True, (3, 0), 12, 12, torch.device("cpu")) is not causal
    documents = _flash_attention_mask(True, (-1, 0), 12, 12, torch.device("cpu"), cu_seqlens=cu)
    assert _flash_attention_mask(True, (-1, 0), 12, 12, torch.device("cpu"), cu_seqlens=cu) is documents
    cu[1] = 7
    moved = _flash_attention_mask(True, (-1, 0), 12, 12, torch.device("cpu"), cu_seqlens=cu)
    assert moved is not documents
    dense = moved.to_dense()[0, 0]
    assert not dense[7, 6] and dense[6, 5]  # the documents follow the new boundary
    with torch.inference_mode():
        assert _flash_attention_mask(True, (-1, 0), 12, 12, torch.device("cpu")) is causal  # no tensor
