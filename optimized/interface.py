"""Torch-facing side of the CuTe DSL kernels: support checks, compile cache, launch, autograd.

`cute_attention(q, k, v, mask, softmax_scale, deterministic)` checks the inputs and runs the Hopper
forward kernel and, under autograd, the Hopper backward (`backward`) through the custom ops (ops.py):
a preprocess kernel (Delta = rowsum(dO * O), the base-2 LSE, the zeroed dQ accumulator), the main
kernel, and a postprocess kernel (dQ in place and in the input dtype), all counted in the timings.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import time
from dataclasses import dataclass

import torch

from ..reference import ColumnMask
from .tile_plan import block_minmax, dq_ranks, full_mask


@dataclass(frozen=True)
class KernelOptions:
    """Kernel features (`kernel_options` changes them): the ones measured on the H200 are on by
    default and switched off only for ablations; prepared ones stay off until measured there."""

    num_stages: int = 2  # K/V pipeline depth
    skip_tiles: bool = True  # leave fully masked tiles out of the tile lists
    # forward: a PARTIAL tile's column bounds cp.async'd to smem a tile ahead (off: read from global
    # memory after the QK GEMM)
    bounds_prefetch: bool = True
    # forward, head dim 64: 192-row query tiles on three consumer warpgroups in round-robin turns
    # (FA3/FA4's SM90 choice; off = 128 rows on two, as at head dim 128)
    q_tile_192: bool = True
    # forward: one CTA per SM working through the work tiles it draws (off: one CTA per work tile)
    persistent: bool = True
    lse_ahead: bool = True  # backward: the LSE into registers before the S GEMM, not after it
    # backward, head dim 64: 128-row query steps (FA3/FA4's SM90 choice there; off = 64 rows, as at
    # head dim 128). Correct, but ptxas serializes its WGMMAs (C7512: the exponentials' 32 live LSE
    # values exceed the registers): +2-3% on the dense masks, -2% on partial-heavy ones as built
    bwd_q_tile_128: bool = False
    # host: launch through TVM-FFI, torch tensors passed as they are, instead of a Python DLPack
    # wrapper per tensor (~23 us each; FA4's launch path): 2.3-2.6x less host time per call
    tvm_ffi: bool = True

    def __post_init__(self) -> None:
        if self.num_stages not in (2, 3):
            raise ValueError(f"num_stages must be 2 or 3, got {self.num_stages}")


options = KernelOptions()
"""The options `forward` uses; change them with `kernel_options(...)`."""


@contextlib.contextmanager
def kernel_options(**changes):
    """Run the block with some kernel features changed, e.g. `kernel_options(persistent=False)`."""
    global options
    saved = options
    options = dataclasses.replace(options, **changes)
    try:
        yield options
    finally:
        options = saved


_DTYPES = (torch.bfloat16, torch.float16)
_HEAD_DIMS = (64, 128)
_compiled: dict[tuple, object] = {}
compile_seconds: dict[tuple, float] = {}
"""Wall time of each compilation, keyed like the cache:
(direction, dtype, head_dim, causal, mask width, options, deterministic)."""


def unsupported_reason(q: torch.Tensor, k: torch.Tensor) -> str | None:
    """Why the cute backend cannot run these inputs, or None if it can."""
    if not q.is_cuda:
        return "backend='cute' needs CUDA tensors"
    if torch.cuda.get_device_capability(q.device) != (9, 0):
        return f"backend='cute' needs a Hopper GPU (sm_90), got {torch.cuda.get_device_name(q.device)}"
    if q.dtype not in _DTYPES:
        return f"backend='cute' takes bf16 or fp16 inputs, got {q.dtype}"
    if q.shape[-1] not in _HEAD_DIMS:
        return f"backend='cute' takes head_dim 64 or 128, got {q.shape[-1]}"
    try:
        import cutlass  # noqa: F401
    except ImportError:
        return "backend='cute' needs nvidia-cutlass-dsl (pip install 'flashmask3[gpu]')"
    if options.tvm_ffi and importlib.util.find_spec("tvm_ffi") is None:
        return (
            "backend='cute' launches through apache-tvm-ffi (pip install 'flashmask3[gpu]'), "
            "or set kernel_options(tvm_ffi=False)"
        )
    return None


def _to_cute(t: torch.Tensor):
    from cutlass.cute.runtime import from_dlpack

    return from_dlpack(t.detach(), assumed_align=16, enable_tvm_ffi=options.tvm_ffi).mark_layout_dynamic(
        leading_dim=t.dim() - 1
    )


def _make_kernel(
    dtype: str,
    head_dim: int,
    causal: bool,
    width: int,
    opts: KernelOptions,
    direction: str = "fwd",
    deterministic: bool = False,
):
    import cutlass

    cute_dtype = {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16}[dtype]
    if direction == "bwd":
        from .flash_bwd_sm90 import FlashMaskBackwardSm90

        return FlashMaskBackwardSm90(
            cute_dtype,
            head_dim,
            causal,
            width,
            deterministic,
            skip_tiles=opts.skip_tiles,
            lse_ahead=opts.lse_ahead,
            tile_m=backward_tile_rows(head_dim, opts),
        )
    if direction in ("bwd_pre", "bwd_post"):
        from .flash_bwd_pre_post import BackwardPostprocess, BackwardPreprocess

        return (BackwardPreprocess if direction == "bwd_pre" else BackwardPostprocess)(
            cute_dtype, head_dim, backward_tile_rows(head_dim, opts)
        )
    from .flash_fwd_sm90 import FlashMaskForwardSm90

    return FlashMaskForwardSm90(
        cute_dtype,
        head_dim,
        causal,
        width,
        num_stages=opts.num_stages,
        skip_tiles=opts.skip_tiles,
        bounds_prefetch=opts.bounds_prefetch,
        q_tile_192=opts.q_tile_192,
    )


def forward_tile_rows(head_dim: int) -> int:
    """Query rows per forward CTA at this head dim under the current kernel options (needs the DSL)."""
    return _make_kernel("bf16", head_dim, False, 2, options).tile_m


def backward_tile_rows(head_dim: int, opts: KernelOptions | None = None) -> int:
    """Query rows per backward step at this head dim under `opts` (default: the current options)."""
    return 128 if head_dim == 64 and (opts or options).bwd_q_tile_128 else 64


def _launch(
    direction: str,
    dtype: torch.dtype,
    head_dim: int,
    causal: bool,
    width: int,
    tensors: list[torch.Tensor],
    scalars: list[float | int],
    deterministic: bool = False,
) -> None:
    """Run one kernel on the current stream, compiling it on first use per configuration (the
    scalars: floats are Float32, ints Int32). With `tvm_ffi` the compiled function takes the torch
    tensors and Python scalars as they are; else each call wraps them for the DSL first."""
    import cutlass.cute as cute
    from cutlass import Float32, Int32

    key = (direction, dtype, head_dim, causal, width, options, deterministic, tuple(t is None for t in tensors))
    if key not in _compiled or not options.tvm_ffi:
        cute_args = [
            *(None if t is None else _to_cute(t) for t in tensors),
            *(Float32(x) if isinstance(x, float) else Int32(x) for x in scalars),
        ]
    if key not in _compiled:
        name = "bf16" if dtype == torch.bfloat16 else "fp16"
        kernel = _make_kernel(name, head_dim, causal, width, options, direction, deterministic)
        start = time.perf_counter()
        if options.tvm_ffi:  # the stream: torch's current one, found by TVM-FFI at each call
            stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
            _compiled[key] = cute.compile(kernel, *cute_args, stream, options="--enable-tvm-ffi")
        else:
            _compiled[key] = cute.compile(kernel, *cute_args, _torch_stream(tensors[0].device))
        compile_seconds[key] = time.perf_counter() - start
    if options.tvm_ffi:
        _compiled[key](*(None if t is None else t.detach() for t in tensors), *scalars)
    else:
        _compiled[key](*cute_args, _torch_stream(tensors[0].device))


def _torch_stream(device: torch.device):
    import cuda.bindings.driver as cuda

    return cuda.CUstream(torch.cuda.current_stream(device).cuda_stream)


def forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: ColumnMask | None,
    softmax_scale: float,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    timeline: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, Sq, Hq, D], lse fp32 [B, Hq, Sq]) from the Hopper kernel, key-block min/max included.

    `out` / `lse` may be given (contiguous, right shape) to write into, e.g. poisoned buffers.
    `timeline`: an int64 [CTAs, work tiles, len(timeline.Event)] buffer runs a build of the kernel
    that stamps each role's events into it (`optimized/timeline.py`); CTAs = `forward_ctas(...)`.
    """
    from .flash_fwd_sm90 import FlashMaskForwardSm90 as Kernel

    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    if mask is None:
        mask = full_mask(b, sq, sk, q.device)
    bounds = block_minmax(mask, Kernel.tile_n)
    q, k, v = (x.contiguous() for x in (q, k, v))
    out = torch.empty_like(q) if out is None else out
    lse = torch.empty(b, hq, sq, dtype=torch.float32, device=q.device) if lse is None else lse
    row_indices = mask.startend_row_indices.contiguous()
    tile_counter = torch.zeros(1, dtype=torch.int32, device=q.device)
    max_ctas = _sm_count(q.device) if options.persistent else 2**31 - 1
    scalars = [float(softmax_scale), hq // hkv, hq // mask.heads, mask.batch // b, max_ctas]
    _launch(
        "fwd",
        q.dtype,
        d,
        mask.causal,
        row_indices.shape[-1],
        [q, k, v, out, lse, row_indices, bounds, tile_counter, timeline],
        scalars,
    )
    return out, lse


def forward_ctas(q: torch.Tensor) -> int:
    """The forward's grid size for q [B, Sq, Hq, D] under the current options."""
    b, sq, hq, d = q.shape
    work_tiles = b * hq * -(-sq // forward_tile_rows(d))
    return min(work_tiles, _sm_count(q.device)) if options.persistent else work_tiles


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) from the Hopper backward kernel, in q's dtype; dk, dv summed over each GQA group.

    `deterministic=True` makes the key tiles add into dQ in a fixed order: bitwise identical
    gradients run to run. `dk` / `dv` may be given (contiguous, k's shape) to write into.
    """
    from .flash_bwd_sm90 import FlashMaskBackwardSm90 as Kernel

    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    if mask is None:
        mask = full_mask(b, sq, sk, q.device)
    tile_m = backward_tile_rows(d)
    tiles_m = -(-sq // tile_m)
    bounds = block_minmax(mask, Kernel.tile_n)
    # The dQ ranks are read only in deterministic mode; otherwise any int32 tensor stands in.
    ranks = dq_ranks(mask, tile_m, Kernel.tile_n, options.skip_tiles) if deterministic else bounds[:1, :1, :1]
    q, k, v, dout = (x.contiguous() for x in (q, k, v, dout))
    lse2 = torch.empty(b, hq, tiles_m * tile_m, dtype=torch.float32, device=q.device)
    delta = torch.empty_like(lse2)
    dq_accum = torch.empty(b, hq, tiles_m, tile_m * d, dtype=torch.float32, device=q.device)
    _launch("bwd_pre", q.dtype, d, False, 2, [out.contiguous(), dout, lse.contiguous(), lse2, delta, dq_accum], [])
    dk = torch.empty_like(k) if dk is None else dk
    dv = torch.empty_like(v) if dv is None else dv
    semaphore = torch.zeros(b, hq, tiles_m, dtype=torch.int32, device=q.device)
    row_indices = mask.startend_row_indices.contiguous()
    tensors = [q, k, v, dout, lse2, delta, dq_accum, dk, dv, row_indices, bounds, ranks, semaphore]
    scalars = [float(softmax_scale), hq // hkv, hq // mask.heads, mask.batch // b]
    _launch("bwd", q.dtype, d, mask.causal, row_indices.shape[-1], tensors, scalars, deterministic)
    dq = torch.empty_like(q)
    _launch("bwd_post", q.dtype, d, False, 2, [dq_accum, dq], [float(softmax_scale)])
    return dq, dk, dv


def cute_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: ColumnMask | None,
    softmax_scale: float,
    deterministic: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    reason = unsupported_reason(q, k)
    if reason and q.is_cuda and torch.cuda.get_device_capability(q.device) != (9, 0):
        # The GPU, not an argument, is what the kernel cannot take: the error type torch raises
        # for an operator with no kernel for a device.
        major, minor = torch.cuda.get_device_capability(q.device)
        raise NotImplementedError(
            f"{reason}, compute capability {major}.{minor} (sm_{major}{minor}); backend='auto' falls back to flex"
        )
    if reason:
        raise ValueError(reason)
    from .ops import attention  # the custom ops, which import this module

    return attention(q, k, v, mask, softmax_scale, deterministic)


def compile_check(
    dtype: str = "bf16",
    head_dim: int = 128,
    causal: bool = True,
    width: int = 1,
    opts: KernelOptions = KernelOptions(),
    direction: str = "fwd",
    deterministic: bool = False,
    timeline: bool = False,
) -> float:
    """Compile the forward kernel (or, `direction="bwd"`, the backward's three kernels) for sm_90a
    without a GPU (fake tensors); return the seconds taken. Set CUTE_DSL_ARCH=sm_90a first when no
    GPU is present. `timeline`: the forward's timeline build."""
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, Int32

    from .timeline import Event

    cute_dtype = {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16}[dtype]
    b, sq, sk, hq, hkv = (cute.sym_int32() for _ in range(5))
    bm, hm, tm, tn = (cute.sym_int32() for _ in range(4))

    def fake(dt, shape):
        order = tuple(reversed(range(len(shape))))
        return cute.runtime.make_fake_compact_tensor(dt, shape, stride_order=order, assumed_align=16)

    q_like, kv_like = fake(cute_dtype, (b, sq, hq, head_dim)), fake(cute_dtype, (b, sk, hkv, head_dim))
    row_indices = fake(cutlass.Int32, (bm, hm, sk, width))
    bwd_tile_m = backward_tile_rows(head_dim, opts)
    if direction == "bwd":
        tensors = [
            q_like,
            kv_like,
            kv_like,
            q_like,
            fake(cutlass.Float32, (b, hq, sq)),
            fake(cutlass.Float32, (b, hq, sq)),
            fake(cutlass.Float32, (b, hq, tm, bwd_tile_m * head_dim)),
            kv_like,
            kv_like,
            row_indices,
            fake(cutlass.Int32, (bm, hm, tn, 2 * width)),
            fake(cutlass.Int32, (bm, hm, tn, tm)),
            fake(cutlass.Int32, (b, hq, tm)),
        ]
    else:
        tensors = [
            q_like,
            kv_like,
            kv_like,
            q_like,
            fake(cutlass.Float32, (b, hq, sq)),
            row_indices,
            fake(cutlass.Int32, (bm, hm, tn, 2 * width)),
            fake(cutlass.Int32, (1,)),
            fake(cutlass.Int64, (cute.sym_int32(), cute.sym_int32(), len(Event))) if timeline else None,
        ]
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=opts.tvm_ffi)
    scalars = [Float32(0.1), Int32(1), Int32(1), Int32(1)] + ([] if direction == "bwd" else [Int32(132)])
    args = [*tensors, *scalars, stream]
    flags = {"options": "--enable-tvm-ffi"} if opts.tvm_ffi else {}
    start = time.perf_counter()
    cute.compile(_make_kernel(dtype, head_dim, causal, width, opts, direction, deterministic), *args, **flags)
    if direction == "bwd":
        from .flash_bwd_pre_post import prepost_compile_args

        pre_args, post_args = prepost_compile_args(cute_dtype, head_dim, bwd_tile_m, stream)
        cute.compile(_make_kernel(dtype, head_dim, False, 2, opts, "bwd_pre"), *pre_args, **flags)
        cute.compile(_make_kernel(dtype, head_dim, False, 2, opts, "bwd_post"), *post_args, **flags)
    return time.perf_counter() - start
