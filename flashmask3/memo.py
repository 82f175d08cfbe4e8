"""Masks built from tensors, kept while the same tensors come back unchanged.

The layers of one forward pass the same packing metadata (and the same HF mask description), so a
mask built from it once serves all of them, and so do the kernels' work orders kept per mask
(`optimized/tile_plan.py`). An entry is reused only for the very tensors it was built from (by
identity, checked through weak references) at the versions it saw, so an in-place change builds
again. Inference tensors have no version, so they build every time, and so does a CUDA graph being
captured, which must record the build (unless the value is a host-side plan: `build_under_capture`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

import torch

T = TypeVar("T")


class TensorMemo(Generic[T]):
    """The last `size` values built, each keyed by plain values and the tensors it came from.
    `build_under_capture`: build again while a CUDA graph is captured (a value made of GPU work,
    which the graph must record); off for a value the host derives once from the tensors' contents
    (a plan), which the graph may reuse as it is."""

    def __init__(self, size: int, build_under_capture: bool = True):
        self.size = size
        self.build_under_capture = build_under_capture
        self._entries: dict[Hashable, tuple[list[weakref.ref], T]] = {}

    def get(self, key: Hashable, tensors: list[torch.Tensor], build: Callable[[], T]) -> T:
        """`build()`, or the value it gave for `key` and these `tensors` (unchanged) before."""
        if any(torch.is_inference(t) for t in tensors) or (self.build_under_capture and _capturing(tensors)):
            return build()
        full_key = (key, tuple((id(t), t._version) for t in tensors))
        entry = self._entries.get(full_key)  # read once: other threads may replace entries
        if entry is not None and all(ref() is t for ref, t in zip(entry[0], tensors, strict=True)):
            return entry[1]
        value = build()
        self._entries[full_key] = ([weakref.ref(t) for t in tensors], value)
        for stale in list(self._entries)[: -self.size]:
            self._entries.pop(stale, None)
        return value


def _capturing(tensors: list[torch.Tensor]) -> bool:
    return any(t.is_cuda for t in tensors) and torch.cuda.is_current_stream_capturing()
