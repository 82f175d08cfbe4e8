"""Torch-facing side of the CuTe DSL kernels: support checks, compile cache, launch, autograd.

`cute_attention(q, k, v, mask, softmax_scale, deterministic)` checks the inputs and runs the Hopper
forward kernel and, under autograd, the Hopper backward (`backward`) through the custom ops (ops.py):
a preprocess kernel (Delta = rowsum(dO * O), the base-2 LSE, the zeroed dQ accumulator), the main
kernel, and a postprocess kernel (dQ in place and in the input dtype), all counted in the timings.
Each kernel runs the configuration `fwd_config` / `bwd_config` (config.py) choose for its head dim
and mask variant, or the one passed to `forward` / `backward` (ablations).

Kernels are compiled on first use per configuration for stand-ins of their tensors
(`_stand_in`: dtype and rank; for the `Contiguous` buffers also compact, their last extent a
constant), kept in memory and on disk (`kernel_cache`), and a new process loads them;
`compile_only` compiles them without launching, on any device. `compile_check` compiles the same
kernels for the SASS checks.

Launches go through TVM-FFI, as FA4's do: the compiled function takes the torch tensors and Python
scalars as they are and finds torch's current stream itself (a Python DLPack wrapper per tensor
cost 2.3-2.6x the host time per call).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import threading
import time
from collections.abc import Iterator, Mapping
from typing import NamedTuple

import torch

from ..reference import ColumnMask
from ..reference.attention import check_sinks
from . import kernel_cache
from .config import (
    BACKWARD_HEAD_DIMS,
    FORWARD_HEAD_DIMS,
    BwdConfig,
    FwdConfig,
    apply_overrides,
    bwd_config,
    fwd_config,
)
from .plans import (
    backward_grid,
    backward_plan,
    forward_plan,
    mask_bwd_config,
    mask_fwd_config,
    work_tiles,
)
from .plans import sm_count as gpu_sm_count
from .segments import forward_virtual_length
from .tile_plan import full_mask

_DTYPES = (torch.bfloat16, torch.float16)
_compiled: dict[tuple, object] = {}
_compile_lock = threading.Lock()
"""One compilation at a time: the DSL's compiler is not thread-safe (CP ranks as threads compiling
the same kernel at once aborted the process)."""
loaded_keys: set[tuple] = set()
"""The keys of the kernels this process loaded from the kernel cache (`kernel_cache`) instead of
compiling them."""
_compile_only_sms: int | None = None
"""The SMs `compile_only` plans for while it is active; None: kernels are launched."""
compile_seconds: dict[tuple, float] = {}
"""Wall time of each compilation, keyed like the cache: (direction, dtype, head_dim, head_dim_v,
causal, mask width, config, deterministic, each argument's layout (`_layout`), query tile)."""


def head_dims_unsupported(head_dim: int, head_dim_v: int, backward: bool = False) -> str | None:
    """Why the kernels cannot take q/k head dim `head_dim` with v head dim `head_dim_v` (with the
    backward too, where `backward`), or None. Shapes only: the same under torch.compile."""
    pair = (head_dim, head_dim_v)
    if pair in (BACKWARD_HEAD_DIMS if backward else FORWARD_HEAD_DIMS):
        return None
    both = ", ".join(map(str, BACKWARD_HEAD_DIMS))
    forward_only = ", ".join(str(p) for p in FORWARD_HEAD_DIMS if p not in BACKWARD_HEAD_DIMS)
    if pair in FORWARD_HEAD_DIMS:
        return (
            f"backend='cute' computes gradients at head dims (q/k, v) of {both}, got q/k head dim {head_dim} "
            f"and v head dim {head_dim_v} on inputs that require grad; its forward takes them without grad "
            "(torch.no_grad(), or detached inputs), and backend='flex' trains with them"
        )
    return (
        f"backend='cute' takes head dims (q/k, v) of {both} (forward and backward) and {forward_only} "
        f"(forward only), got ({head_dim}, {head_dim_v})"
    )


def requires_backward(*tensors: torch.Tensor | None) -> bool:
    """Whether autograd will ask for gradients of this call: grad mode on and an input requiring
    grad (known at trace time under torch.compile)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def unsupported_reason(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None = None, backward: bool = False
) -> str | None:
    """Why the cute backend cannot run these inputs (v: k's head dim where None; `backward`: the
    gradients too), or None if it can."""
    if not q.is_cuda:
        return "backend='cute' needs CUDA tensors"
    if torch.cuda.get_device_capability(q.device) != (9, 0):
        return f"backend='cute' needs a Hopper GPU (sm_90), got {torch.cuda.get_device_name(q.device)}"
    if q.dtype not in _DTYPES:
        return f"backend='cute' takes bf16 or fp16 inputs, got {q.dtype}"
    head_dims = head_dims_unsupported(int(q.shape[-1]), int((k if v is None else v).shape[-1]), backward)
    if head_dims:
        return head_dims
    try:
        import cutlass  # noqa: F401
    except ImportError:
        return "backend='cute' needs nvidia-cutlass-dsl (pip install 'flashmask3[gpu]')"
    if importlib.util.find_spec("tvm_ffi") is None:
        return "backend='cute' launches through apache-tvm-ffi (pip install 'flashmask3[gpu]')"
    return None


def mask_configs(
    head_dim: int,
    mask: ColumnMask | None,
    overrides: Mapping[str, bool | int] | None = None,
    deterministic: bool = False,
    causal: bool = False,
) -> tuple[FwdConfig, BwdConfig]:
    """Both directions' choices for this head dim and mask (the backward's for `deterministic`
    mode), with `overrides` (`apply_overrides`); `mask` None: no mask, or with `causal` the causal
    mask alone."""
    changes = overrides or {}
    return (
        apply_overrides(mask_fwd_config(head_dim, mask, causal), changes),
        apply_overrides(mask_bwd_config(head_dim, mask, deterministic, causal), changes),
    )


def tma_operand(x: torch.Tensor) -> torch.Tensor:
    """`x` itself where the kernels' TMA can read it in place (unit stride in the last dim, the
    base address and every other stride a positive multiple of 16 bytes: e.g. the [B, S, H, D]
    view of a [B, H, S, D] tensor, as transformers passes q, k and v), else a contiguous copy
    (broadcast views, with stride 0, included)."""
    size = x.element_size()
    # Traced (torch.compile), where the address is unknown, only the strides are checked: the
    # kernels' own call, outside the trace, checks the address too.
    base = 0 if torch.compiler.is_compiling() else x.data_ptr()
    aligned = base % 16 == 0 and all(stride > 0 and stride * size % 16 == 0 for stride in x.stride()[:-1])
    return x if x.stride(-1) == 1 and aligned else x.contiguous()


class Contiguous(NamedTuple):
    """A kernel argument the host made contiguous and whose last extent the kernel's configuration
    fixes (the row indices' width, the dQ accumulator's tile, ...): compiled with compact strides
    and that extent a constant, which frees the registers that runtime strides would hold (the
    backward at 192/128 and its split builds spilled with them). TVM-FFI checks both at each call."""

    tensor: torch.Tensor


def _contiguous(t: torch.Tensor | None) -> Contiguous | None:
    """`t` passed as `Contiguous` (a copy where it is not contiguous), None for None."""
    return None if t is None else Contiguous(t.contiguous())


def _sink_logits(sinks: torch.Tensor | None) -> torch.Tensor | None:
    """`sinks` as the kernel reads them: fp32 in a fresh (16-byte aligned) buffer of Hq values."""
    return None if sinks is None else torch.empty(sinks.shape, dtype=torch.float32, device=sinks.device).copy_(sinks)


def _stand_in(dtype, rank: int, last: int | None = None):
    """What a kernel is compiled for in place of a tensor of cutlass `dtype` and `rank`: where
    `last` is None, every extent and stride a runtime value but the last stride (1), 16-byte
    aligned, on a CUDA device, as TVM-FFI checks each call's tensors (the type the CUDA tensors
    themselves give: the same SASS); with `last`, a `Contiguous` argument: compact, its last extent
    `last`. The same with or without a GPU (`compile_only`)."""
    import cutlass.cute as cute

    shape = tuple(cute.sym_int32() for _ in range(rank - (last is not None)))
    if last is not None:
        order = tuple(reversed(range(rank)))
        return cute.runtime.make_fake_compact_tensor(dtype, (*shape, last), stride_order=order, assumed_align=16)
    stride = (*(cute.sym_int64() for _ in range(rank - 1)), 1)
    return cute.runtime.make_fake_tensor(dtype, shape, stride, assumed_align=16)


def _compile_operand(t: torch.Tensor | Contiguous):
    """`_stand_in` for `t`: its dtype and rank, and a `Contiguous` one's last extent."""
    import cutlass

    tensor = t.tensor if isinstance(t, Contiguous) else t
    dtype = {
        torch.bfloat16: cutlass.BFloat16,
        torch.float16: cutlass.Float16,
        torch.float32: cutlass.Float32,
        torch.int32: cutlass.Int32,
        torch.int64: cutlass.Int64,
    }[tensor.dtype]
    return _stand_in(dtype, tensor.dim(), tensor.shape[-1] if isinstance(t, Contiguous) else None)


def _layout(t: torch.Tensor | Contiguous | None) -> int | None:
    """An argument's part of the compile key: None (not passed), 0 (runtime strides), or a
    `Contiguous` one's last extent."""
    if t is None:
        return None
    return int(t.tensor.shape[-1]) if isinstance(t, Contiguous) else 0


def _make_kernel(
    dtype: str,
    head_dim: int,
    causal: bool,
    width: int,
    config: FwdConfig | BwdConfig | None,
    direction: str = "fwd",
    deterministic: bool = False,
    head_dim_v: int | None = None,
    query_tile: int = 64,
):
    """The kernel object of `direction` ("fwd", "bwd", or the backward's "bwd_pre" / "bwd_post",
    which take no configuration, only the main kernel's `query_tile` rows per step); `head_dim_v`:
    V's and O's head dim when not `head_dim`."""
    import cutlass

    cute_dtype = {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16}[dtype]
    if direction in ("bwd_pre", "bwd_post"):
        from .flash_bwd_pre_post import BackwardPostprocess, BackwardPreprocess

        if direction == "bwd_pre":
            return BackwardPreprocess(cute_dtype, head_dim, query_tile, head_dim_v)
        return BackwardPostprocess(cute_dtype, head_dim, query_tile)
    if direction == "bwd":
        from .flash_bwd_sm90 import FlashMaskBackwardSm90

        if not isinstance(config, BwdConfig):
            raise TypeError(f"the backward takes a BwdConfig, got {config!r}")
        return FlashMaskBackwardSm90(cute_dtype, head_dim, causal, width, config, deterministic, head_dim_v)
    from .flash_fwd_sm90 import FlashMaskForwardSm90

    if not isinstance(config, FwdConfig):
        raise TypeError(f"the forward takes a FwdConfig, got {config!r}")
    return FlashMaskForwardSm90(cute_dtype, head_dim, causal, width, config, head_dim_v)


def _device_part(config: FwdConfig | BwdConfig | None) -> FwdConfig | BwdConfig | None:
    """`config` without its host-only choices (when to pass a work order; the kernel sees only
    whether one is passed), so changing them compiles nothing new."""
    if isinstance(config, FwdConfig):
        return dataclasses.replace(config, longest_tiles_first_waves=0)
    if isinstance(config, BwdConfig):  # and do_stages=0 as the count it stands for: one kernel
        return dataclasses.replace(
            config,
            longest_ctas_first_waves=0,
            longest_ctas_first_buckets=0,
            short_grid_q_stages=0,
            split_ctas_max_parts=0,
            split_ctas_slack_pct=0,
            do_stages=config.do_depth,
        )
    return config


def _launch(
    direction: str,
    dtype: torch.dtype,
    head_dim: int,
    causal: bool,
    width: int,
    config: FwdConfig | BwdConfig | None,
    tensors: list[torch.Tensor | Contiguous | None],
    scalars: list[float | int],
    deterministic: bool = False,
    head_dim_v: int | None = None,
    query_tile: int = 64,
) -> None:
    """Run one kernel on the current stream, loading or compiling it on first use per configuration
    (the scalars: floats are Float32, ints Int32). The compiled function takes the torch tensors and
    Python scalars as they are (TVM-FFI). `head_dim_v`, `query_tile`: as in `_make_kernel`."""
    config = _device_part(config)
    layouts = tuple(_layout(t) for t in tensors)
    key = (direction, dtype, head_dim, head_dim_v, causal, width, config, deterministic, layouts, query_tile)
    compiled = _compiled.get(key)
    if compiled is None:
        with _compile_lock:
            compiled = _compiled.get(key)
            if compiled is None:
                compiled = kernel_cache.load(key)
                if compiled is None:
                    compiled = _compile(key, tensors, scalars, deterministic, head_dim_v, query_tile)
                else:
                    loaded_keys.add(key)
                _compiled[key] = compiled
    if _compile_only_sms is None:
        compiled(
            *(None if t is None else (t.tensor if isinstance(t, Contiguous) else t).detach() for t in tensors), *scalars
        )


def _compile(
    key: tuple,
    tensors: list[torch.Tensor | Contiguous | None],
    scalars: list[float | int],
    deterministic: bool,
    head_dim_v: int | None,
    query_tile: int,
):
    """Compile the kernel of `_launch`'s `key` for these arguments' dtypes and ranks, and keep it
    on disk (`kernel_cache`)."""
    import cutlass.cute as cute
    from cutlass import Float32, Int32

    direction, dtype, head_dim, _, causal, width, config = key[:7]
    cute_args = [
        *(None if t is None else _compile_operand(t) for t in tensors),
        *(Float32(x) if isinstance(x, float) else Int32(x) for x in scalars),
    ]
    name = "bf16" if dtype == torch.bfloat16 else "fp16"
    kernel = _make_kernel(name, head_dim, causal, width, config, direction, deterministic, head_dim_v, query_tile)
    start = time.perf_counter()
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)  # torch's current one
    compiled = cute.compile(kernel, *cute_args, stream, options="--enable-tvm-ffi")
    compile_seconds[key] = time.perf_counter() - start
    kernel_cache.store(key, compiled)
    return compiled


@contextlib.contextmanager
def compile_only(sm_count: int = 132) -> Iterator[None]:
    """Within it, `forward` and `backward` compile (or load) each kernel they would launch, keep it
    in the kernel cache (`kernel_cache`), and launch nothing: on tensors of any device, so a machine
    without a GPU (CUTE_DSL_ARCH=sm_90a) fills the cache for the GPU machines. `sm_count`: the SMs
    of the GPU the kernels will run on (132 on the H100 SXM and H200), which some plans depend on.
    The outputs hold no values."""
    global _compile_only_sms
    if sm_count < 1:
        raise ValueError(f"sm_count must be a positive number of SMs, got {sm_count}")
    with _compile_lock:
        if _compile_only_sms is not None:
            raise RuntimeError("compile_only is already active")
        _compile_only_sms = sm_count
    try:
        yield
    finally:
        _compile_only_sms = None


def _sm_count(device: torch.device) -> int:
    """The SMs the plans divide the work over: the GPU's, or `compile_only`'s."""
    return _compile_only_sms or gpu_sm_count(device)


def forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: ColumnMask | None,
    softmax_scale: float,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    timeline: torch.Tensor | None = None,
    config: FwdConfig | None = None,
    turn_profile: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    causal: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, Sq, Hq, Dv], lse fp32 [B, Hq, Sq]) from the Hopper kernel, key-block min/max included.
    Head dims (D, Dv): `config.FORWARD_HEAD_DIMS`, V's below Q's and K's at (128, 64) and (192, 128);
    above 128 with one Q buffer.

    `out` / `lse` may be given (contiguous, right shape) to write into, e.g. poisoned buffers.
    `timeline`: an int64 [CTAs, work tiles, len(timeline.Event)] buffer runs a build of the kernel
    that stamps each role's events into it (`optimized/timeline.py`); CTAs = `forward_ctas(...)`
    (with segment tiles the virtual rows' grid); work tiles: those a CTA lists (granules with no
    real row are not), a CTA's tiles past the buffer's are not stamped.
    `config`: the kernel's configuration (default: `fwd_config`'s choice for the head dim and mask).
    `turn_profile`: an int64 [CTAs, len(timeline.TurnEvent)] buffer runs a build that sums the SM
    cycles of each segment of the key-tile loop's turns into it (consumer thread 0); CTAs: the
    grid, `forward_ctas(...)` (with segment tiles the virtual rows' grid, which a mismatch names).
    `sinks`: [Hq] each query head's sink logit (gpt-oss), joined to its rows' softmax in the
    kernel's epilogue: out and lse are those of `reference.attention.join_sinks`.
    `causal`: with `mask` None, the causal mask alone (each query sees the keys up to its own,
    bottom-right aligned where Sq != Sk); no interval then hides a row, which the plan may use.
    """
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    if sinks is not None:
        check_sinks(sinks, q)
    plain = _check_plain(mask, causal)
    uniform_work = plain and not causal  # every work tile sees every key tile: nothing to order
    config = config or mask_fwd_config(d, mask, causal)
    if mask is None:
        mask = _no_mask(q, sk, causal)
    width = mask.startend_row_indices.shape[-1]
    if config.tile_m == 192 and turn_profile is not None:  # three consumer warpgroups at 160 registers each
        raise ValueError(
            "the turn profile spills at tile_m=192 (head dim 64's tiles, causal): profile a config with tile_m=128"
        )
    plan = forward_plan(mask, config, b, hq, _sm_count(q.device), uniform_work, sq != sk or _capturing(q), plain)
    mask, config, tile_rows, bounds, order = plan.mask, plan.config, plan.tile_rows, plan.bounds, plan.order
    row_indices = mask.startend_row_indices.contiguous()
    q, k, v = (tma_operand(x) for x in (q, k, v))
    dv = v.shape[-1]
    out = q.new_empty(b, sq, hq, dv) if out is None else out
    lse = torch.empty(b, hq, sq, dtype=torch.float32, device=q.device) if lse is None else lse
    tile_counter = torch.zeros(1, dtype=torch.int32, device=q.device)
    max_ctas = _sm_count(q.device) if config.persistent else 2**31 - 1
    if turn_profile is not None or timeline is not None:  # the kernel writes a row per CTA of its grid
        from .timeline import Event, TurnEvent

        ctas = forward_ctas(q, config)  # with segment tiles, of the plan's virtual rows (mask.seqlen_q)

        if turn_profile is not None:
            _check_stamp_buffer("turn_profile", turn_profile, [ctas, len(TurnEvent)], "(CTAs, events)", q.device)
        if timeline is not None:
            shape = [ctas, None, len(Event)]
            _check_stamp_buffer("timeline", timeline, shape, "(CTAs, work tiles, events)", q.device)
    scalars = [float(softmax_scale), hq // hkv, hq // mask.heads, mask.batch // b, max_ctas]
    _launch(
        "fwd",
        q.dtype,
        d,
        mask.causal,
        width,
        config,
        [q, k, v, out, lse, Contiguous(row_indices), _contiguous(bounds), tile_counter, order, _contiguous(tile_rows)]
        + [_contiguous(timeline), _contiguous(turn_profile), _sink_logits(sinks)],
        scalars,
        head_dim_v=None if dv == d else dv,
    )
    return out, lse


def backward_ctas(k: torch.Tensor, config: BwdConfig, seqlen_k: int | None = None) -> int:
    """The backward's grid size for k [B, Sk, Hkv, D] under `config`: one CTA per key tile, KV head
    and batch; `seqlen_k`: the keys the CTAs walk where not k's (the virtual rows of segment steps)."""
    b, sk, hkv, _ = k.shape
    return backward_grid(b, hkv, sk if seqlen_k is None else seqlen_k, config)


def forward_ctas(q: torch.Tensor, config: FwdConfig) -> int:
    """The forward's grid size for q [B, Sq, Hq, D] under `config` (with segment tiles, Sq = Sk:
    the virtual rows' grid, `segments.forward_virtual_length`)."""
    rows = forward_virtual_length(q.shape[1]) if config.segment_tiles else q.shape[1]
    tiles = work_tiles(q.shape[0], q.shape[2], rows, config)
    return min(tiles, _sm_count(q.device)) if config.persistent else tiles


def _check_stamp_buffer(
    name: str, buffer: torch.Tensor, shape: list[int | None], dims: str, device: torch.device
) -> None:
    """A profiled build's buffer: contiguous int64 of `shape` (None: any size) on q's device."""
    fits = buffer.dim() == len(shape) and all(want in (None, got) for want, got in zip(shape, buffer.shape))
    if buffer.dtype != torch.int64 or not fits or not buffer.is_contiguous():
        wanted = "[" + ", ".join("any" if want is None else str(want) for want in shape) + "]"
        got = f"{buffer.dtype} {list(buffer.shape)}"
        raise ValueError(f"{name} must be a contiguous int64 tensor of shape {wanted} {dims}, got {got}")
    if buffer.device != device:
        raise ValueError(f"{name} must be on q's device ({device}), got {buffer.device}")


def _check_plain(mask: ColumnMask | None, causal: bool) -> bool:
    """Whether the call has no mask (with `causal`, the causal one alone); `causal` with a mask is
    a ValueError: the mask says which keys each query sees."""
    if causal and mask is not None:
        raise ValueError("causal=True stands for the causal mask alone: pass it with mask=None")
    return mask is None


def _no_mask(q: torch.Tensor, seqlen_k: int, causal: bool = False) -> ColumnMask:
    """The full mask (or with `causal` the causal mask alone) the kernels run on where the call has
    none: one kept per (Sq, Sk, device), so its key blocks' min/max (kept per mask) are made once,
    not at every call; made anew while a CUDA graph is captured, where a kept one would belong to
    the graph."""
    if _capturing(q):
        return _plain_mask(q.shape[1], seqlen_k, q.device, causal)
    return _kept_plain_mask(q.shape[1], seqlen_k, q.device, causal)


def _plain_mask(seqlen_q: int, seqlen_k: int, device: torch.device, causal: bool) -> ColumnMask:
    return (
        ColumnMask._band(seqlen_q, seqlen_k, -1, -1, True, device=device)
        if causal
        else full_mask(seqlen_q, seqlen_k, device)
    )


@functools.lru_cache(maxsize=8)
def _kept_plain_mask(seqlen_q: int, seqlen_k: int, device: torch.device, causal: bool) -> ColumnMask:
    return _plain_mask(seqlen_q, seqlen_k, device, causal)


def _capturing(q: torch.Tensor) -> bool:
    """Whether a CUDA graph is being captured on the current stream, where the kernels keep the
    sequence's tiles: a segment plan kept from before would be replayed stale, the backward's plan
    syncs with the host, and the forward's plan kernels are not checked under capture."""
    return q.is_cuda and torch.cuda.is_current_stream_capturing()


def backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    mask: ColumnMask | None,
    softmax_scale: float,
    deterministic: bool = False,
    dk: torch.Tensor | None = None,
    dv: torch.Tensor | None = None,
    config: BwdConfig | None = None,
    timeline: torch.Tensor | None = None,
    causal: bool = False,
    dlse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) from the Hopper backward kernel, in q's dtype; dk, dv summed over each GQA group.

    `deterministic=True` makes the key tiles add into dQ in a fixed order: bitwise identical
    gradients run to run. `dk` / `dv` may be given (contiguous, k's and v's shapes) to write into.
    Head dims (D, Dv): `config.BACKWARD_HEAD_DIMS`.
    `config`: the main kernel's configuration (default: `bwd_config`'s choice for the head dim and
    mask). `timeline`: an int64 [CTAs, len(timeline.BwdEvent)] buffer runs a build of the main
    kernel that records each CTA's phases and the cycles of each segment of its steps
    (`optimized/timeline.py`); CTAs = `backward_ctas(...)`. `causal`: as in `forward`. `dlse`
    [B, Hq, Sq]: a gradient that reaches the LSE too, taken off each row's Delta (rowsum(dO * O))
    between the preprocess and the main kernel (`reference.attention.row_sums`).
    """
    from .flash_bwd_sm90 import head_dims_refusal

    b, sq, hq, d = q.shape
    head_dim_v = v.shape[-1]
    refusal = head_dims_refusal(d, head_dim_v)  # before the preprocess is launched
    if refusal:
        raise ValueError(refusal)
    sk, hkv = k.shape[1], k.shape[2]
    plain = _check_plain(mask, causal)
    uniform_work = plain and not causal  # every CTA sees every query tile: nothing to order
    if mask is None:
        mask = _no_mask(q, sk, causal)
    width = mask.startend_row_indices.shape[-1]
    config = config or bwd_config(d, mask.causal, width, deterministic, plain)
    if config.segment_steps and timeline is not None:  # its buffer is sized for the sequence's tiles
        raise ValueError("a profiled build runs on the sequence's tiles: pass a config with segment_steps=False")
    sms = _sm_count(q.device)
    sequence_tiles = sq != sk or _capturing(q)
    plan = backward_plan(
        mask, config, b, hq, hkv, sms, uniform_work, sequence_tiles, deterministic, timeline is not None, plain
    )
    mask, config, step_rows, bounds, order = plan.mask, plan.config, plan.step_rows, plan.bounds, plan.order
    tile_m, tile_n = config.query_tile, config.key_tile
    row_indices = mask.startend_row_indices.contiguous()
    tiles_m = -(-mask.seqlen_q // tile_m)
    # The dQ ranks are read only in deterministic mode; otherwise any int32 tensor stands in.
    ranks = bounds[:1, :1, :1] if plan.ranks is None else plan.ranks
    q, k, v, dout = (tma_operand(x) for x in (q, k, v, dout))
    lse2 = torch.empty(b, hq, tiles_m * tile_m, dtype=torch.float32, device=q.device)
    delta = torch.empty_like(lse2)
    dq_accum = torch.empty(b, hq, tiles_m, tile_m * d, dtype=torch.float32, device=q.device)
    accumulator, rows = Contiguous(dq_accum), _contiguous(step_rows)
    prepared = [out.contiguous(), dout, lse.contiguous(), lse2, delta, accumulator, rows]
    dims_v = None if head_dim_v == d else head_dim_v
    _launch("bwd_pre", q.dtype, d, False, 2, None, prepared, [], head_dim_v=dims_v, query_tile=tile_m)
    if dlse is not None:
        if step_rows is not None:  # Delta's rows are then the segments', not the sequence's
            raise ValueError(
                "a gradient through the LSE needs the sequence's rows: pass a config with segment_steps=False"
            )
        delta[..., :sq] -= dlse
    dk = k.new_empty(k.shape) if dk is None else dk  # contiguous, whatever the inputs' strides
    dv = v.new_empty(v.shape) if dv is None else dv
    # One memset: the dQ semaphores, then (16-byte aligned, as every kernel tensor) the split CTAs' counters.
    semaphores, slots = b * hq * tiles_m, plan.slots
    counters = torch.zeros(-(-semaphores // 4) * 4 + slots, dtype=torch.int32, device=q.device)
    semaphore = counters[:semaphores].view(b, hq, tiles_m)
    split = [None, None, None]
    if plan.split_table is not None:
        workspace = torch.empty(slots, tile_n * (d + head_dim_v), dtype=torch.float32, device=q.device)
        split = [_contiguous(plan.split_table), Contiguous(workspace), counters[-slots:]]
    tensors = [q, k, v, dout, lse2, delta, accumulator, dk, dv, Contiguous(row_indices), _contiguous(bounds), ranks]
    tensors += [semaphore, order, rows, _contiguous(timeline), *split]
    scalars = [float(softmax_scale), hq // hkv, hq // mask.heads, mask.batch // b]
    _launch("bwd", q.dtype, d, mask.causal, width, config, tensors, scalars, deterministic, dims_v)
    dq = q.new_empty(q.shape)
    _launch("bwd_post", q.dtype, d, False, 2, None, [accumulator, dq, rows], [float(softmax_scale)], query_tile=tile_m)
    return dq, dk, dv


def unsupported_error(reason: str, q: torch.Tensor) -> Exception:
    """The exception for an `unsupported_reason`: NotImplementedError where the GPU, not an
    argument, is what the kernels cannot take (the error type torch raises for an operator with no
    kernel for a device), else ValueError."""
    if q.is_cuda and torch.cuda.get_device_capability(q.device) != (9, 0):
        major, minor = torch.cuda.get_device_capability(q.device)
        return NotImplementedError(
            f"{reason}, compute capability {major}.{minor} (sm_{major}{minor}); backend='auto' falls back to flex"
        )
    return ValueError(reason)


def cute_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: ColumnMask | None,
    softmax_scale: float,
    deterministic: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    reason = unsupported_reason(q, k, v, backward=requires_backward(q, k, v))
    if reason:
        raise unsupported_error(reason, q)
    from .ops import attention  # the custom ops, which import this module

    return attention(q, k, v, mask, softmax_scale, deterministic)


def compile_check(
    dtype: str = "bf16",
    head_dim: int = 128,
    causal: bool = True,
    width: int = 1,
    config: FwdConfig | BwdConfig | None = None,
    direction: str = "fwd",
    deterministic: bool = False,
    timeline: bool = False,
    head_dim_v: int | None = None,
    turn_profile: bool = False,
    segmented: bool = False,
    sinks: bool = False,
    plain: bool = False,
) -> float:
    """Compile the forward kernel (or, `direction="bwd"`, the backward's three kernels) for sm_90a
    without a GPU, for the stand-ins `_launch` compiles them for (`_stand_in`), i.e. the kernels
    that run; return the seconds taken.
    Set CUTE_DSL_ARCH=sm_90a first when no GPU is present. `head_dim_v`: V's and O's head dim
    when not `head_dim`. `config`: the forward's (backward's)
    configuration, by default the chosen one; `timeline`: the forward's timeline build, or the
    backward's profiled build; `turn_profile`: the forward's turn-profiled build; `segmented`: the
    forward chosen for a segmented mask (`ColumnMask.segmented`); `sinks`: the forward with the
    heads' sink logits; `plain`: the kernels chosen for a call without a mask (`causal`: with the
    causal one alone; `width` then 2, or 1 with `causal`)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32

    from .timeline import BwdEvent, Event, TurnEvent

    cute_dtype = {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16}[dtype]
    f32, i32, i64 = cutlass.Float32, cutlass.Int32, cutlass.Int64

    def each(*specs: tuple | None) -> list:
        """A stand-in per (dtype, rank) or, for a `Contiguous` argument, (dtype, rank, last extent);
        None where a spec is None (an argument not passed)."""
        return [None if spec is None else _stand_in(*spec) for spec in specs]

    qkv = (cute_dtype, 4)
    rows, bounds = (i32, 4, width), (i32, 4, 2 * width)
    if direction == "bwd":
        config = config or bwd_config(head_dim, causal, width, deterministic, plain)
        split = config.split_ctas_max_parts > 0 and not (deterministic or config.segment_steps or timeline)
        ordered = config.longest_ctas_first_waves > 0 and not (deterministic or split)
        step_rows = (i32, 4, 2) if config.segment_steps else None
        accumulator = (f32, 4, config.query_tile * head_dim)
        workspace = (f32, 2, config.key_tile * (head_dim + (head_dim_v or head_dim)))
        # q, k, v, dO, LSE, Delta, the dQ accumulator, dK, dV, the row indices, block bounds, dQ
        # ranks, semaphores, work order, step rows, timeline; the split table, workspace, counters.
        tensors = each(qkv, qkv, qkv, qkv, (f32, 3), (f32, 3), accumulator, qkv, qkv, rows, bounds, (i32, 4))
        timeline_spec = (i64, 2, len(BwdEvent)) if timeline else None
        tensors += each((i32, 3), (i32, 1) if ordered else None, step_rows, timeline_spec)
        tensors += each(*([(i32, 2, 4), workspace, (i32, 1)] if split else [None] * 3))
        # The preprocess: O, dO, LSE, its base-2 copy, Delta, the dQ accumulator, step rows; the
        # postprocess: the accumulator, dQ, step rows, the softmax scale.
        pre_args = each(qkv, qkv, (f32, 3), (f32, 3), (f32, 3), accumulator, step_rows)
        post_args = [*each(accumulator, qkv, step_rows), Float32(0.1)]
    else:
        config = config or fwd_config(head_dim, causal, width, segmented, plain)
        # q, k, v, out, LSE, the row indices, block bounds, tile counter, work order, tile rows,
        # timeline, turn profile, sinks.
        tensors = each(qkv, qkv, qkv, qkv, (f32, 3), rows, bounds, (i32, 1))
        tensors += each(
            (i32, 1) if config.longest_tiles_first_waves else None, (i32, 4, 2) if config.segment_tiles else None
        )
        tensors += each(
            (i64, 3, len(Event)) if timeline else None,
            (i64, 2, len(TurnEvent)) if turn_profile else None,
            (f32, 1) if sinks else None,
        )
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    scalars = [Float32(0.1), Int32(1), Int32(1), Int32(1)] + ([] if direction == "bwd" else [Int32(132)])
    args = [*tensors, *scalars, stream]
    flags = {"options": "--enable-tvm-ffi"}
    with _compile_lock:
        start = time.perf_counter()
        kernel = _make_kernel(dtype, head_dim, causal, width, config, direction, deterministic, head_dim_v)
        cute.compile(kernel, *args, **flags)
        if isinstance(config, BwdConfig):
            tile_m = config.query_tile
            pre = _make_kernel(dtype, head_dim, False, 2, None, "bwd_pre", head_dim_v=head_dim_v, query_tile=tile_m)
            cute.compile(pre, *pre_args, stream, **flags)
            post = _make_kernel(dtype, head_dim, False, 2, None, "bwd_post", query_tile=tile_m)
            cute.compile(post, *post_args, stream, **flags)
        return time.perf_counter() - start
