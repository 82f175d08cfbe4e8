"""End-to-end training benchmark: a Llama-style decoder from transformers on packed documents.

    python scripts/train_e2e.py                                  # tiny model, CPU, flashmask3's reference kernels
    python scripts/train_e2e.py 'backends=[fm3,sdpa]'            # and HF's sdpa, from the same start: curves agree
    python scripts/train_e2e.py preset=h200_quick                # the 1B model on an H200, 32K tokens, 30 steps each
    python scripts/train_e2e.py -m preset=h200 data.seqlen=32768,65536     # 200 steps each: the loss curves
    python scripts/train_e2e.py preset=h200_quick data.mask=share_question 'backends=[fm3,flex_flash]'

Hydra-configured (conf/train_e2e.yaml, presets in conf/preset/). Each backend in `backends` trains
the same model (random init from `seed`) on the same batches in this process, one after the other
or, with `train.take_turns=true` (the GPU presets), side by side, one step each in turn (each with
its own model and optimizer), so that the machine's drifts fall on every backend alike:

- `fm3`: flashmask3 through its HF integration (`attn_implementation="fm3"`, `fm3_backend` the
  kernel: cute on the H200, reference on the CPU), the mask a ColumnMask built from the packing
  metadata by the constructors and passed as `attention_mask=mask`.
- `sdpa`: HF's sdpa with the same mask in dense form ([B, 1, S, S] bool: where it fits in memory).
- `flex_flash`: FlexAttention compiled with `kernel_options={"BACKEND": "FLASH"}` (FA4's kernels) on
  a 128 x 128 BlockMask from the same mask's tile classes.

Each backend's per-batch mask work runs with the batch, outside the timed step, as a data loader's
would: fm3's plans (`prepare_mask`), Flex's BlockMask, FA4 varlen's document offsets.
- `fa4_varlen`: FA4's `flash_attn_varlen_func` over the documents' `cu_seqlens` (causal_document only).
- `fm3_control`: fm3 once more, under its own implementation name: taking turns with fm3
  (`'backends=[fm3,fm3_control]'`), the spread between two identical backends, against which a
  difference between two others can be read.

The last two are benchmark-only: the library never imports them. Masks (`data.mask`): causal_document
(packed documents), share_question (SFT-style: a question and 2-6 answers per document, the loss on
the answers) and prefix_lm_document (a bidirectional prefix per document, the loss after it), the
documents' lengths lognormal (`data.doc_len_median`, `data.doc_len_sigma`), each document a
repeated pattern of Zipf-distributed token ids (the repeats are learnable only by attending within
the document).

Per backend a JSON record under `logging.out_dir` ($OUT where set, else runs/): tokens/s (over the
wall clock of the timed steps, or their summed CUDA-event times when taking turns), median step
time and attention time (CUDA events; attention's forward, recomputation and backward stamped
around every call), attention's share of the step, the time to build the backend's attention
inputs from the batch and its mask (the ColumnMask is built on the host and moved with the batch, as
a data loader would), peak memory (a step's peak over what other backends hold), model TFLOP/s and MFU
(6 FLOPs per linear weight per token plus 3x the forward FLOPs of the attended pairs, over
`peak_tflops`), the loss of every step, and on a GPU the median SM clock and power (NVML, read
every 2 ms) over the timed steps, within the attention calls and in the rest of the steps
("clocks"). Then a summary JSON (each run's numbers and its largest loss difference from
the first) and the loss curves' plot, both named after the mask and length. With
`train.profile_steps=N` each backend trains N more steps under torch's profiler, untimed, and its
record lists the kernels by device time per step ("profile"; on the CPU, ops by host time). `logging=wandb` adds an
offline wandb run per backend. A backend that fails (out of memory, a missing package) leaves its
error in its record and the others run; the exit code is then 2. A backend that cannot express the
mask (fa4_varlen on share_question or prefix_lm_document) is skipped, with a line and a summary row
saying so, so that one sweep over the masks takes all backends:

    python scripts/train_e2e.py -m preset=h200_quick data.mask=causal_document,share_question,prefix_lm_document
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import hydra
import numpy as np
import torch
import transformers
from flashmask3.reference import ColumnMask, masks
from flashmask3.verify.suite import DTYPES
from omegaconf import DictConfig, OmegaConf
from torch.nn.attention.flex_attention import BlockMask
from transformers import AttentionInterface, AutoModelForCausalLM, LlamaConfig, PreTrainedModel
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from flashmask3 import bench_peers, prepare_mask
from flashmask3.bench import ClockTrace, attention_flops, error_string, git_commit
from flashmask3.experiment import environment
from flashmask3.integrations import hf
from flashmask3.peers import flex_block_mask

TensorOrMask = TypeVar("TensorOrMask", torch.Tensor, ColumnMask)

MASKS = ("causal_document", "share_question", "prefix_lm_document")
IGNORE_INDEX = -100  # HF's label for tokens without a loss


# -- data: packed documents ----------------------------------------------------------------------


@dataclasses.dataclass
class PackedBatch:
    """One batch of packed documents and the packing metadata its masks are built from.

    Every row holds S tokens; rows with fewer documents (or segments) repeat their last boundary.
    """

    input_ids: torch.Tensor  # int64 [B, S]
    labels: torch.Tensor  # int64 [B, S], IGNORE_INDEX where a token is not a target
    position_ids: torch.Tensor  # int64 [B, S], RoPE positions: from 0 per document, answers continuing their question
    cu_seqlens: torch.Tensor  # int32 [B, N + 1], the documents' boundaries
    prefix_lens: torch.Tensor  # int32 [B, N], prefix-LM: each document's bidirectional prefix
    segments_cu: torch.Tensor  # int32 [B, M + 1], share-question: the questions' and answers' boundaries
    is_question: torch.Tensor  # bool [B, M]
    varlen_cu_seqlens: torch.Tensor  # int32 [D + 1], every row's documents as one varlen batch (B * S tokens)
    max_document: int  # the longest document (varlen's max_seqlen)

    def to(self, device: torch.device) -> PackedBatch:
        """On `device`; to a GPU from pinned memory without waiting for it, as a data loader with
        `pin_memory=True` copies (the host stays ahead of the steps it queues)."""
        return dataclasses.replace(
            self,
            **{
                field.name: _to_device(getattr(self, field.name), device)
                for field in dataclasses.fields(self)
                if isinstance(getattr(self, field.name), torch.Tensor)
            },
        )


def _to_device(host: TensorOrMask, device: torch.device) -> TensorOrMask:
    """`host` (a tensor or a ColumnMask) on `device`; to a GPU through pinned memory, not waiting."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


class _Row:
    """One packed row as it is drawn: tokens, targets, positions and the documents' metadata."""

    def __init__(self, seqlen: int):
        self.input_ids = np.empty(seqlen, np.int64)
        self.is_target = np.ones(seqlen, bool)
        self.position_ids = np.empty(seqlen, np.int64)
        self.documents: list[int] = []
        self.prefixes: list[int] = []
        self.segments: list[int] = []
        self.questions: list[bool] = []


@functools.cache
def _zipf_cdf(vocab_size: int) -> np.ndarray:
    """Cumulative distribution of a Zipf unigram (p ~ 1 / rank) over the vocabulary."""
    weights = 1.0 / np.arange(1, vocab_size + 1)
    return np.cumsum(weights) / weights.sum()


def make_batch(data: DictConfig, vocab_size: int, seed: int, step: int) -> PackedBatch:
    """The batch of training step `step`, drawn from `seed` and `step` alone: the same for every
    backend. The documents and tokens are also the same under every mask (all masks' metadata is
    drawn); the targets and positions follow `data.mask`."""
    rng = np.random.default_rng([seed, step])
    rows = [_pack_row(rng, data, vocab_size) for _ in range(data.batch)]
    documents = [length for row in rows for length in row.documents]
    return PackedBatch(
        input_ids=torch.from_numpy(np.stack([row.input_ids for row in rows])),
        labels=torch.from_numpy(np.stack([np.where(row.is_target, row.input_ids, IGNORE_INDEX) for row in rows])),
        position_ids=torch.from_numpy(np.stack([row.position_ids for row in rows])),
        cu_seqlens=_boundaries([row.documents for row in rows]),
        prefix_lens=_padded([row.prefixes for row in rows], 0, torch.int32),
        segments_cu=_boundaries([row.segments for row in rows]),
        is_question=_padded([row.questions for row in rows], False, torch.bool),
        varlen_cu_seqlens=torch.tensor(np.concatenate([[0], np.cumsum(documents)]), dtype=torch.int32),
        max_document=max(documents),
    )


def _pack_row(rng: np.random.Generator, data: DictConfig, vocab_size: int) -> _Row:
    """Documents of lognormal lengths until the row is full (the last one cut to fit)."""
    row, start = _Row(data.seqlen), 0
    low, high = data.pattern_len
    while start < data.seqlen:
        drawn = round(rng.lognormal(math.log(data.doc_len_median), data.doc_len_sigma))
        length = min(data.seqlen - start, max(1, drawn))
        end = start + length
        pattern = np.searchsorted(_zipf_cdf(vocab_size), rng.random(int(rng.integers(low, high + 1))))
        row.input_ids[start:end] = np.resize(np.minimum(pattern, vocab_size - 1), length)
        prefix = int(rng.integers(1, length + 1))  # as masks.build draws the prefix-LM documents
        parts = masks.split_lengths(rng, length, int(rng.integers(2, 7)) + 1)  # a question, 2-6 answers
        row.documents.append(length)
        row.prefixes.append(prefix)
        row.segments += parts
        row.questions += [True] + [False] * (len(parts) - 1)
        row.position_ids[start:end] = np.arange(length)
        row.is_target[start] = False  # nothing before it in its document predicts it
        if data.mask == "prefix_lm_document":
            row.is_target[start : start + prefix] = False  # the prefix rows see the tokens after them
        elif data.mask == "share_question":
            question = parts[0]
            row.is_target[start : start + question] = False  # SFT: the loss is on the answers
            answer_start = start + question
            for index, answer in enumerate(parts[1:]):
                # Each answer follows its question, not the answer packed before it ...
                row.position_ids[answer_start : answer_start + answer] = np.arange(question, question + answer)
                if index:  # ... so that answer's last token does not predict its first
                    row.is_target[answer_start] = False
                answer_start += answer
        start = end
    return row


def _boundaries(lengths_per_row: list[list[int]]) -> torch.Tensor:
    """cu_seqlens [B, N + 1] of per-row lengths, short rows repeating their last boundary."""
    boundaries = [np.concatenate([[0], np.cumsum(lengths)]).tolist() for lengths in lengths_per_row]
    return _padded(boundaries, None, torch.int32)


def _padded(rows: list[list], fill: object, dtype: torch.dtype) -> torch.Tensor:
    """Rows of different lengths as one tensor, padded with `fill` (None: the row's last value)."""
    width = max(len(row) for row in rows)
    return torch.tensor([row + [row[-1] if fill is None else fill] * (width - len(row)) for row in rows], dtype=dtype)


def column_mask(mask_name: str, batch: PackedBatch) -> ColumnMask:
    """The batch's mask, built from its packing metadata by the ColumnMask constructors, on the
    metadata's device (no host read there: seqlen is given). The trainer builds it on the host,
    as a data loader would, and moves it with the batch."""
    seqlen = batch.input_ids.shape[-1]
    if mask_name == "causal_document":
        return ColumnMask.causal_document(batch.cu_seqlens, seqlen=seqlen)
    if mask_name == "prefix_lm_document":
        return ColumnMask.prefix_lm_document(batch.cu_seqlens, batch.prefix_lens, seqlen=seqlen)
    return ColumnMask.share_question(batch.segments_cu, batch.is_question, seqlen=seqlen)


# -- backends ------------------------------------------------------------------------------------


def _fm3_inputs(batch: PackedBatch, mask: ColumnMask, config: LlamaConfig) -> dict:
    return {"attention_mask": mask}


def _fm3_mask(host_mask: ColumnMask, device: torch.device, config: LlamaConfig, batch: int) -> ColumnMask:
    """The mask on the device with the kernels' per-mask plans made on the host, as a data loader
    makes them (`flashmask3.prepare_mask`; only the copy off a GPU)."""
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    return prepare_mask(host_mask, device, batch=batch, q_heads=heads, kv_heads=kv_heads, head_dim=config.head_dim)


def _copied_mask(host_mask: ColumnMask, device: torch.device, config: LlamaConfig, batch: int) -> ColumnMask:
    return _to_device(host_mask, device)


def _sdpa_inputs(batch: PackedBatch, mask: ColumnMask, config: LlamaConfig) -> dict:
    return {"attention_mask": mask.to_dense()}


def _flex_inputs(batch: PackedBatch, mask: BlockMask, config: LlamaConfig) -> dict:
    return {"attention_mask": mask}


def _flex_mask(host_mask: ColumnMask, device: torch.device, config: LlamaConfig, batch: int) -> BlockMask:
    """Flex's BlockMask on the device, made with the batch as a data loader would (as fm3's plans
    are): from the column vectors' tile classes, as the kernel benchmarks' Flex peers, O(S^2 / 128^2)."""
    mask, seqlen = _to_device(host_mask, device), host_mask.seqlen_q
    return flex_block_mask(mask, batch, config.num_attention_heads, seqlen, seqlen, device, from_tiles=True)


def _varlen_inputs(batch: PackedBatch, mask: ColumnMask, config: LlamaConfig) -> dict:
    cu_seqlens, longest = batch.varlen_cu_seqlens, batch.max_document
    return {"cu_seq_lens_q": cu_seqlens, "cu_seq_lens_k": cu_seqlens, "max_length_q": longest, "max_length_k": longest}


@functools.cache
def _compiled_flex() -> Callable:
    from torch.nn.attention.flex_attention import flex_attention

    # As the kernel benchmarks' Flex peers: past the default limit of 8 recompilations (a mask
    # sweep in one process, grad modes) dynamo would run the unfused eager flex_attention instead,
    # which materializes the scores, unnoticed.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 256)
    return torch.compile(flex_attention, dynamic=False)


def flex_flash_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """HF's attention interface for FlexAttention on FA4's kernels; `attention_mask` is a BlockMask."""
    out = _compiled_flex()(
        query,
        key,
        value,
        block_mask=attention_mask,
        scale=scaling,
        enable_gqa=query.shape[1] != key.shape[1],
        kernel_options={"BACKEND": "FLASH"},
    )
    return out.transpose(1, 2), None


def fa4_varlen_attention(
    module,
    query,
    key,
    value,
    attention_mask,
    dropout=0.0,
    scaling=None,
    *,
    cu_seq_lens_q,
    cu_seq_lens_k,
    max_length_q,
    max_length_k,
    **kwargs,
):
    """HF's attention interface for FA4's varlen kernel, causal within each document: the B rows
    of S tokens as one batch of B * S tokens."""
    from flash_attn.cute import flash_attn_varlen_func

    batch_size, heads, seqlen, head_dim = query.shape
    q, k, v = (x.transpose(1, 2).reshape(batch_size * seqlen, x.shape[1], head_dim) for x in (query, key, value))
    out = flash_attn_varlen_func(
        q,
        k,
        v,
        cu_seqlens_q=cu_seq_lens_q,
        cu_seqlens_k=cu_seq_lens_k,
        max_seqlen_q=max_length_q,
        max_seqlen_k=max_length_k,
        softmax_scale=scaling,
        causal=True,
    )[0]
    return out.view(batch_size, seqlen, heads, head_dim), None


@dataclasses.dataclass(frozen=True)
class Backend:
    """A way to run the model's attention: the HF implementation (names without "flash": HF treats
    those as FlashAttention), the model inputs each step builds for it from the batch and its mask
    (both on the device), and how the data loader's work takes the mask to the device (the mask
    there as the backend takes it: a prepared ColumnMask, Flex's BlockMask)."""

    attn_implementation: str
    model_inputs: Callable[[PackedBatch, Any, LlamaConfig], dict]
    masks: tuple[str, ...] = MASKS
    device_mask: Callable[[ColumnMask, torch.device, LlamaConfig, int], Any] = _copied_mask


BACKENDS = {
    "fm3": Backend(hf.NAME, _fm3_inputs, device_mask=_fm3_mask),
    # fm3 again under a name of its own: against fm3, the spread between two identical backends.
    "fm3_control": Backend("fm3_control", _fm3_inputs, device_mask=_fm3_mask),
    "sdpa": Backend("sdpa", _sdpa_inputs),
    "flex_flash": Backend("flex_fa4", _flex_inputs, device_mask=_flex_mask),
    "fa4_varlen": Backend("fa4_varlen", _varlen_inputs, masks=("causal_document",)),
}


def register_backends(fm3_backend: str) -> None:
    """Register the benchmark's attention implementations with transformers (sdpa is its own)."""
    hf.register(fm3_backend)
    hf.register(fm3_backend, name=BACKENDS["fm3_control"].attn_implementation)
    AttentionInterface.register(BACKENDS["flex_flash"].attn_implementation, flex_flash_attention)
    AttentionInterface.register(BACKENDS["fa4_varlen"].attn_implementation, fa4_varlen_attention)


# -- timing attention ----------------------------------------------------------------------------

Stamp = torch.cuda.Event | float


class AttentionTimer:
    """Stamps around every attention call, forward and backward: CUDA events on the GPU (read once
    the run is over, so no step waits for them), the host clock on the CPU (where ops run in order).

    The backward is stamped by identity autograd nodes around the call: the one on its output runs
    right before attention's backward, the one on its inputs right after."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.spans: list[tuple[Stamp, Stamp]] = []  # the current step's (start, end) pairs
        self._backward_starts: list[Stamp] = []

    def stamp(self) -> Stamp:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def take_spans(self) -> list[tuple[Stamp, Stamp]]:
        spans, self.spans = self.spans, []
        return spans

    def backward_stamp(self, opens: bool) -> None:
        if opens:
            self._backward_starts.append(self.stamp())
        else:
            self.spans.append((self._backward_starts.pop(), self.stamp()))

    def wrap(self, attention_fn: Callable) -> Callable:
        """`attention_fn` (HF's attention interface) with its calls stamped."""

        def timed(module, query, key, value, *args, **kwargs):
            query, key, value = _BackwardStamp.apply(self, False, query, key, value)
            start = self.stamp()
            out, weights = attention_fn(module, query, key, value, *args, **kwargs)
            self.spans.append((start, self.stamp()))
            (out,) = _BackwardStamp.apply(self, True, out)
            return out, weights

        return timed


class _BackwardStamp(torch.autograd.Function):
    """Identity on its tensors; its backward stamps the timer (`opens`: a span's start)."""

    @staticmethod
    def forward(ctx, timer: AttentionTimer, opens: bool, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.timer, ctx.opens = timer, opens
        return tuple(tensor.view_as(tensor) for tensor in tensors)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        ctx.timer.backward_stamp(ctx.opens)
        return (None, None, *grads)


def seconds(start: Stamp, end: Stamp) -> float:
    if isinstance(start, float):
        return end - start
    return start.elapsed_time(end) / 1e3


Anchor = tuple[Stamp, float]


def _anchor(device: torch.device, timer: AttentionTimer) -> Anchor:
    """A stamp taken on an idle device with the host clock beside it: from it, `host_seconds` puts
    later stamps on the host clock (where the NVML readings are)."""
    _synchronize(device)
    return timer.stamp(), time.perf_counter()


def host_seconds(anchor: Anchor, stamp: Stamp) -> float:
    """`stamp` on the host's `time.perf_counter()` clock (a CUDA event: through `anchor`)."""
    return stamp if isinstance(stamp, float) else anchor[1] + seconds(anchor[0], stamp)


@contextlib.contextmanager
def timed_attention(attn_implementation: str, timer: AttentionTimer) -> Iterator[None]:
    """The model's attention calls go through `timer` (a local override in HF's registry, removed on exit)."""
    ALL_ATTENTION_FUNCTIONS[attn_implementation] = timer.wrap(ALL_ATTENTION_FUNCTIONS[attn_implementation])
    try:
        yield
    finally:
        del ALL_ATTENTION_FUNCTIONS[attn_implementation]


# -- training ------------------------------------------------------------------------------------


def build_model(cfg: DictConfig, attn_implementation: str, device: torch.device) -> PreTrainedModel:
    """The Llama of `cfg.model`, random weights from `cfg.seed` (the same for every backend), in
    `cfg.dtype`, on `device`."""
    config = LlamaConfig(
        **OmegaConf.to_container(cfg.model),
        max_position_embeddings=cfg.data.seqlen,
        attention_dropout=0.0,
        use_cache=False,
        attn_implementation=attn_implementation,
    )
    torch.manual_seed(cfg.seed)
    # Built in its dtype (RoPE's frequencies stay fp32), where it trains: a 1B model's init on the
    # host takes a while.
    with device:
        model = AutoModelForCausalLM.from_config(config, dtype=DTYPES[cfg.dtype])
    if cfg.train.activation_checkpointing:  # by its 5.17 name (newer: activation_checkpointing_enable)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.train()


def model_flops(linear_weights: int, config: LlamaConfig, batch: int, seqlen: int, density: float) -> float:
    """FLOPs of one training step as MFU counts them (forward and backward, no recomputation): 6 per
    linear weight per token, and 3x the forward FLOPs of the (query, key) pairs the mask keeps."""
    attention = attention_flops(batch, config.num_attention_heads, seqlen, seqlen, config.head_dim, density)
    return 6.0 * linear_weights * batch * seqlen + 3.0 * config.num_hidden_layers * attention


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _new_record(cfg: DictConfig, name: str) -> dict:
    """A backend's record before it trains: what ran, where, with what."""
    return {
        "benchmark": "train_e2e",
        "backend": name,
        "mask": cfg.data.mask,
        "seqlen": cfg.data.seqlen,
        "batch": cfg.data.batch,
        "attn_implementation": BACKENDS[name].attn_implementation,
        "config": OmegaConf.to_container(cfg, resolve=True),
        "commit": git_commit(),
        "environment": environment(cfg.device) | {"transformers": transformers.__version__},
        "versions": bench_peers.versions(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


def train_backend(cfg: DictConfig, name: str) -> dict:
    """Train with backend `name` alone; its record (with "error" where it failed: the others still run)."""
    device = torch.device(cfg.device)
    record = _new_record(cfg, name)
    gc.collect()  # the previous backend's model and optimizer
    if device.type == "cuda":
        torch.cuda.empty_cache()
    try:
        trainer = Trainer(cfg, BACKENDS[name], device)
        trace, anchor = ClockTrace(), None
        with timed_attention(trainer.backend.attn_implementation, trainer.timer), trace.sampling():
            for step in range(cfg.train.steps):
                if step == cfg.train.warmup_steps:
                    anchor = _anchor(device, trainer.timer)
                    timed_start = time.perf_counter()
                trainer.step(step, make_batch(cfg.data, cfg.model.vocab_size, cfg.seed, step))
            _synchronize(device)
        _finish_record(record, trainer, trace, anchor, wall_seconds=time.perf_counter() - timed_start)
    except Exception as exc:  # out of memory or a missing package is a result for this backend
        record["error"] = error_string(exc)
    return record


def train_taking_turns(cfg: DictConfig, names: list[str]) -> list[dict]:
    """Train the backends `names` side by side, one step each in turn (the order reversed every
    step, so none always runs first), each with its own model and optimizer from the same start:
    drifts of the machine (clocks, temperature, neighbours) fall on all alike. Step times are CUDA
    events (the host's data work between steps is in none), tokens/s their sum over the timed
    steps. A backend that fails keeps its error and leaves the turns; the others go on."""
    device = torch.device(cfg.device)
    records = {name: _new_record(cfg, name) for name in names}
    trainers: dict[str, Trainer] = {}
    for name in names:
        try:
            trainers[name] = Trainer(cfg, BACKENDS[name], device)
        except Exception as exc:
            records[name]["error"] = error_string(exc)
    trace, anchor = ClockTrace(), None
    with contextlib.ExitStack() as stack:
        for trainer in trainers.values():
            stack.enter_context(timed_attention(trainer.backend.attn_implementation, trainer.timer))
        stack.enter_context(trace.sampling())
        for step in range(cfg.train.steps):
            if step == cfg.train.warmup_steps and trainers:
                anchor = _anchor(device, next(iter(trainers.values())).timer)
            host_batch = make_batch(cfg.data, cfg.model.vocab_size, cfg.seed, step)  # once for all of them
            order = list(trainers)
            for name in order if step % 2 == 0 else reversed(order):
                error = _step_error(trainers[name], step, host_batch)
                if error is not None:
                    records[name]["error"] = error
                    del trainers[name]
                    gc.collect()  # its model and optimizer, for the others' steps
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
        _synchronize(device)
    for name, trainer in trainers.items():
        _finish_record(records[name], trainer, trace, anchor, wall_seconds=None)
    return [records[name] for name in names]


def _finish_record(
    record: dict, trainer: Trainer, trace: ClockTrace, anchor: Anchor | None, wall_seconds: float | None
) -> None:
    """Into `record`, once the timed steps are done: `trainer.results(wall_seconds)`, the clocks of
    its steps, and with `train.profile_steps` its profiled steps (after the timed ones), or where
    they fail their error ("profile_error"): the timed results stand and the other backends still
    profile."""
    record |= trainer.results(wall_seconds=wall_seconds)
    record["clocks"] = trainer.clocks(trace, anchor)
    if trainer.cfg.train.profile_steps:
        try:
            with timed_attention(trainer.backend.attn_implementation, trainer.timer):
                record["profile"] = trainer.profile(trainer.cfg.train.profile_steps)
        except Exception as exc:  # out of memory under the profiler is a result for this backend
            record["profile_error"] = error_string(exc)


def _step_error(trainer: Trainer, step: int, host_batch: PackedBatch) -> str | None:
    """The error of `trainer`'s step `step` on `host_batch`, None if it trained (the exception and
    its frames are gone on return, so the trainer's memory can be freed)."""
    try:
        trainer.step(step, host_batch)
    except Exception as exc:  # out of memory or a missing package is a result for this backend
        return error_string(exc)
    return None


class Trainer:
    """One backend's model (random init from `cfg.seed`: the same for every backend), its optimizer
    and what its steps measured; `step` trains on step `step`'s batch (`make_batch`, on the host)."""

    def __init__(self, cfg: DictConfig, backend: Backend, device: torch.device):
        self.cfg, self.backend, self.device = cfg, backend, device
        self.model = build_model(cfg, backend.attn_implementation, device)
        self.linear_weights = sum(m.weight.numel() for m in self.model.modules() if isinstance(m, torch.nn.Linear))
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=cfg.train.lr,
            betas=(0.9, 0.95),
            weight_decay=cfg.train.weight_decay,
            fused=device.type == "cuda",
        )
        self.timer = AttentionTimer(device)
        self.losses: list[torch.Tensor] = []
        self.densities: list[float] = []
        self.flops: list[float] = []
        self.step_stamps: list[tuple[Stamp, Stamp, Stamp]] = []
        self.attention_spans: list[list[tuple[Stamp, Stamp]]] = []
        self.peak_bytes = 0

    def step(self, step: int, host_batch: PackedBatch) -> None:
        cfg, config, model = self.cfg, self.model.config, self.model
        # The data loader's work, outside the step: the mask from the packing metadata and its
        # density for the FLOPs, the copy.
        host_mask = column_mask(cfg.data.mask, host_batch)
        self.densities.append(host_mask.density())
        self.flops.append(model_flops(self.linear_weights, config, cfg.data.batch, cfg.data.seqlen, self.densities[-1]))
        batch = host_batch.to(self.device)
        mask = self.backend.device_mask(host_mask, self.device, config, cfg.data.batch)
        cuda = self.device.type == "cuda"
        if cuda:  # the step's peak over what was allocated before it (other backends' models too)
            before = torch.cuda.memory_allocated() - self.resident_bytes()
            torch.cuda.reset_peak_memory_stats()
        start = self.timer.stamp()
        inputs = self.backend.model_inputs(batch, mask, config)
        inputs_built = self.timer.stamp()
        for group in self.optimizer.param_groups:
            group["lr"] = cfg.train.lr * min(1.0, (step + 1) / max(1, cfg.train.lr_warmup_steps))
        loss = model(input_ids=batch.input_ids, labels=batch.labels, position_ids=batch.position_ids, **inputs).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.losses.append(loss.detach())
        self.step_stamps.append((start, inputs_built, self.timer.stamp()))
        self.attention_spans.append(self.timer.take_spans())
        if cuda:
            self.peak_bytes = max(self.peak_bytes, torch.cuda.max_memory_allocated() - before)

    def profile(self, steps: int, top: int = 40) -> list[dict]:
        """`steps` more steps (after the timed ones, so their results leave them out) under torch's
        profiler: the `top` kernels by device time (on the CPU, ops by their own host time), most
        first, each with its calls and milliseconds per step, and "(all)" first: where a step's
        time goes, the attention kernels beside the rest and beside another backend's."""
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile

        cuda = self.device.type == "cuda"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        first = len(self.losses)
        batches = [make_batch(self.cfg.data, self.cfg.model.vocab_size, self.cfg.seed, first + i) for i in range(steps)]
        _synchronize(self.device)
        with profile(activities=activities) as profiler:
            for i, batch in enumerate(batches):
                self.step(first + i, batch)
            _synchronize(self.device)
        rows = []
        for event in profiler.key_averages():
            if cuda and event.device_type != DeviceType.CUDA:
                continue
            micros = event.self_device_time_total if cuda else event.self_cpu_time_total
            rows.append({"name": event.key[:160], "calls": event.count // steps, "ms": micros / 1e3 / steps})
        rows.sort(key=lambda row: -row["ms"])
        total = {"name": "(all)", "calls": sum(r["calls"] for r in rows), "ms": sum(r["ms"] for r in rows)}
        return [total, *rows[:top]]

    def resident_bytes(self) -> int:
        """The bytes this backend keeps between steps: its weights and optimizer state (created in
        its first step)."""
        tensors = [*self.model.parameters()]
        tensors += [t for state in self.optimizer.state.values() for t in state.values() if torch.is_tensor(t)]
        return sum(t.numel() * t.element_size() for t in tensors)

    def clocks(self, trace: ClockTrace, anchor: Anchor | None) -> dict | None:
        """The GPU's median SM clock and power (NVML) over this backend's timed steps, within its
        attention calls and in the rest of its steps: whether the same kernels around attention
        ran at another clock with another backend. None where nothing was read (no NVML)."""
        if anchor is None or not trace.samples:
            return None
        timed = slice(self.cfg.train.warmup_steps, None)
        steps = [(host_seconds(anchor, a), host_seconds(anchor, b)) for a, _, b in self.step_stamps[timed]]
        spans = [(host_seconds(anchor, a), host_seconds(anchor, b)) for s in self.attention_spans[timed] for a, b in s]
        return {"steps": trace.within(steps), "attention": trace.within(spans), "rest": trace.within(steps, spans)}

    def results(self, wall_seconds: float | None) -> dict:
        """The measurements over the timed steps (after `train.warmup_steps`), once the device has
        finished them; tokens/s over `wall_seconds` where given, else over the steps' summed times."""
        cfg = self.cfg
        timed = slice(cfg.train.warmup_steps, None)
        step_s = [seconds(start, end) for start, _, end in self.step_stamps[timed]]
        attention_s = [sum(seconds(*span) for span in spans) for spans in self.attention_spans[timed]]
        inputs_s = [seconds(start, built) for start, built, _ in self.step_stamps[timed]]
        timed_seconds = sum(step_s) if wall_seconds is None else wall_seconds
        tflops = sum(self.flops[timed]) / timed_seconds / 1e12
        return {
            "parameters": sum(p.numel() for p in self.model.parameters()),
            "steps": cfg.train.steps,
            "timed_steps": len(step_s),
            "took_turns": wall_seconds is None,
            "tokens_per_s": cfg.data.batch * cfg.data.seqlen * len(step_s) / timed_seconds,
            "step_ms_median": statistics.median(step_s) * 1e3,
            "attention_ms_median": statistics.median(attention_s) * 1e3,
            "attention_share": sum(attention_s) / sum(step_s),
            "mask_inputs_ms_median": statistics.median(inputs_s) * 1e3,
            "peak_memory_gib": self.peak_bytes / 2**30 if self.device.type == "cuda" else None,
            "model_tflops_per_s": tflops,
            "mfu": tflops / cfg.peak_tflops if cfg.peak_tflops else None,
            "peak_tflops": cfg.peak_tflops,
            "mask_density_mean": statistics.mean(self.densities),
            "step_ms": [s * 1e3 for s in step_s],
            "losses": torch.stack(self.losses).tolist(),
        }


# -- records, comparison, plot -------------------------------------------------------------------


def _write(record: dict, out_dir: Path, name: str) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}_{time.strftime('%Y%m%d-%H%M%S')}_{os.getpid()}.json"
    path.write_text(json.dumps(record, indent=1))
    return path


def _log_wandb(record: dict, wandb_cfg: DictConfig, out_dir: Path) -> None:
    """One offline wandb run: the loss and step time of every step, the metrics as its summary."""
    import wandb

    run = wandb.init(
        project=wandb_cfg.project,
        mode=wandb_cfg.mode,
        dir=str(out_dir),
        config=record["config"],
        name=f"train_e2e-{record['mask']}-{record['backend']}-{record['seqlen']}",
        reinit="finish_previous",
    )
    first_timed = record["steps"] - record["timed_steps"]
    for step, loss in enumerate(record["losses"]):
        timed = step - first_timed
        run.log({"loss": loss} | ({"step_ms": record["step_ms"][timed]} if timed >= 0 else {}), step=step)
    run.summary.update({key: value for key, value in record.items() if isinstance(value, (int, float))})
    run.finish()


def _line(record: dict) -> str:
    head = f"{record['backend']} {record['mask']} S={record['seqlen']}"
    if "skipped" in record:
        return f"{head}: skipped: {record['skipped']}"
    if "error" in record:
        return f"{head}: error: {record['error']}"
    losses, mfu = record["losses"], record["mfu"]
    return (
        f"{head}: {record['tokens_per_s']:.0f} tokens/s, step {record['step_ms_median']:.1f} ms, "
        f"attention {100 * record['attention_share']:.1f}%, mask inputs {record['mask_inputs_ms_median']:.2f} ms, "
        + (f"peak {record['peak_memory_gib']:.1f} GiB, " if record["peak_memory_gib"] is not None else "")
        + (f"MFU {100 * mfu:.1f}%, " if mfu is not None else "")
        + f"loss {losses[0]:.4f} -> {losses[-1]:.4f}"
    )


SUMMARY_KEYS = (
    "backend",
    "path",
    "error",
    "skipped",
    "tokens_per_s",
    "step_ms_median",
    "attention_share",
    "mask_inputs_ms_median",
    "peak_memory_gib",
    "mfu",
)
FINAL_STEPS = 10  # the final loss: the mean over this many last steps (one step's loss is noisy)


def summarize(records: list[dict], out_dir: Path) -> dict | None:
    """The runs side by side, with each run's final loss and its largest loss difference from the
    first run that trained; written as JSON, after a plot of the loss curves. None if none trained."""
    trained = [r for r in records if "losses" in r]
    if not trained:
        return None
    first = trained[0]
    runs = []
    for record in records:
        run = {key: record.get(key) for key in SUMMARY_KEYS}
        if "losses" in record:
            run["final_loss"] = statistics.mean(record["losses"][-FINAL_STEPS:])
            run["max_abs_loss_diff"] = max(abs(a - b) for a, b in zip(record["losses"], first["losses"]))
        runs.append(run)
    stem = f"train_e2e_{first['mask']}_{first['seqlen']}_summary"
    plot: Path | None = out_dir / f"{stem}_{time.strftime('%Y%m%d-%H%M%S')}_{os.getpid()}.png"
    try:
        plot_losses(trained, plot)
    except ImportError as error:  # a GPU machine without matplotlib still gets the numbers
        print(f"no plot: {error}")
        plot = None
    summary = {
        "benchmark": "train_e2e_summary",
        "mask": first["mask"],
        "seqlen": first["seqlen"],
        "loss_reference": first["backend"],
        "runs": runs,
        "plot": None if plot is None else str(plot),
    }
    summary["path"] = str(_write(summary, out_dir, stem))
    for run in runs:
        if "final_loss" in run:
            print(
                f"{run['backend']}: final loss {run['final_loss']:.4f} (mean of the last {FINAL_STEPS} steps), "
                f"max |loss - {first['backend']} loss| {run['max_abs_loss_diff']:.2e}"
            )
    print(f"summary: {summary['path']}" + ("" if plot is None else f"\nloss curves: {plot}"))
    return summary


def plot_losses(records: list[dict], path: Path) -> None:
    """Loss per step of each run, and its difference from the first run's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    first = records[0]
    fig, (curves, differences) = plt.subplots(2, 1, figsize=(8, 6), sharex=True, height_ratios=(2, 1))
    for record in records:
        curves.plot(record["losses"], label=record["backend"], lw=1)
        if record is not first:
            difference = [a - b for a, b in zip(record["losses"], first["losses"])]
            differences.plot(difference, label=f"{record['backend']} - {first['backend']}", lw=1)
    curves.set_ylabel("loss")
    curves.set_title(f"{first['mask']}, {first['seqlen']} tokens x {first['batch']}, {first['config']['dtype']}")
    curves.legend()
    differences.set_xlabel("step")
    differences.set_ylabel("loss difference")
    if len(records) > 1:
        differences.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


# -- entry point ---------------------------------------------------------------------------------


def cannot_express(name: str, mask_name: str) -> str:
    return f"backend {name} cannot express data.mask={mask_name}; it takes {', '.join(BACKENDS[name].masks)}"


def check_config(cfg: DictConfig) -> None:
    """A ValueError or RuntimeError naming the first setting this run cannot take. A backend that
    cannot express `data.mask` is skipped by `run` (one mask sweep takes every backend), unless
    none of them can."""
    unknown = [name for name in cfg.backends if name not in BACKENDS]
    if unknown or not cfg.backends:
        raise ValueError(f"backends must be a list of {', '.join(BACKENDS)}, got {list(cfg.backends)}")
    if cfg.data.mask not in MASKS:
        raise ValueError(f"data.mask must be one of {', '.join(MASKS)}, got {cfg.data.mask!r}")
    if all(cfg.data.mask not in BACKENDS[name].masks for name in cfg.backends):
        raise ValueError(cannot_express(cfg.backends[0], cfg.data.mask))
    if cfg.dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {cfg.dtype!r}")
    if not 0 <= cfg.train.warmup_steps < cfg.train.steps:
        raise ValueError(
            f"train.warmup_steps must be in [0, train.steps), got {cfg.train.warmup_steps} and {cfg.train.steps}"
        )
    if not isinstance(cfg.train.take_turns, bool):
        raise ValueError(f"train.take_turns must be true or false, got {cfg.train.take_turns!r}")
    if not isinstance(cfg.train.profile_steps, int) or cfg.train.profile_steps < 0:
        raise ValueError(f"train.profile_steps must be an integer >= 0, got {cfg.train.profile_steps!r}")
    if torch.device(cfg.device).type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device={cfg.device}, but torch {torch.__version__} sees no CUDA GPU (the CPU: preset=cpu)")
    if cfg.logging.wandb.enabled:
        import wandb  # noqa: F401  (fail before training, not after)


def run(cfg: DictConfig) -> list[dict]:
    """Train every backend of `cfg.backends`, one after the other or (`train.take_turns`) side by
    side a step each in turn; their records (written, with their "path"), then the summary and the
    loss curves. A backend that cannot express `data.mask` is not trained: its record (not
    written) and its summary row say "skipped"."""
    check_config(cfg)
    register_backends(cfg.fm3_backend)
    out_dir = Path(cfg.logging.out_dir)
    trainable = [name for name in cfg.backends if cfg.data.mask in BACKENDS[name].masks]
    trained = iter(train_taking_turns(cfg, trainable)) if cfg.train.take_turns else None
    records = []
    for name in cfg.backends:
        if name not in trainable:
            record = {"backend": name, "mask": cfg.data.mask, "seqlen": cfg.data.seqlen}
            record["skipped"] = cannot_express(name, cfg.data.mask)
            print(_line(record))
            records.append(record)
            continue
        record = next(trained) if trained is not None else train_backend(cfg, name)
        record["path"] = str(_write(record, out_dir, f"train_e2e_{cfg.data.mask}_{name}_{cfg.data.seqlen}"))
        print(_line(record))
        print(f"record: {record['path']}")
        if cfg.logging.wandb.enabled and "error" not in record:
            _log_wandb(record, cfg.logging.wandb, out_dir)
        records.append(record)
    summarize(records, out_dir)
    return records


_failed_jobs: list[str] = []


@hydra.main(version_base="1.3", config_path="pkg://flashmask3.conf", config_name="train_e2e")
def main(cfg: DictConfig) -> None:
    try:
        records = run(cfg)
    except (ValueError, RuntimeError) as error:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        print(f"error: {error}", file=sys.stderr)
        _failed_jobs.append(str(error))
        return
    _failed_jobs.extend(r["error"] for r in records if "error" in r)


if __name__ == "__main__":
    main()
    sys.exit(2 if _failed_jobs else 0)
