"""The CuTe DSL forward and backward kernels compile for sm_90a without a GPU (fake tensors), every config."""

import dataclasses
import math
import re

import pytest

cutlass = pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl not installed")


@pytest.mark.slow  # 16 compiles, ~30 s; the quick tier compiles one config of each kind below
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal, width", [(True, 1), (True, 2), (False, 2), (False, 4)])
def test_forward_kernel_compiles_for_sm90a(dtype, head_dim, causal, width):
    from flashmask3.optimized import compile_check

    seconds = compile_check(dtype, head_dim, causal, width)
    assert 0 < seconds < 120


def test_unsupported_head_dims_and_tile_shapes_are_refused():
    from flashmask3.optimized import bwd_config, compile_check, fwd_config
    from flashmask3.optimized.flash_bwd_sm90 import FlashMaskBackwardSm90
    from flashmask3.optimized.flash_fwd_sm90 import FlashMaskForwardSm90

    with pytest.raises(ValueError, match="head_dim must be 64, 128, 192 or 256 for the cute backend, got 96"):
        FlashMaskForwardSm90(cutlass.BFloat16, 96, True, 1, fwd_config(128, True, 1))
    with pytest.raises(ValueError, match="192-row query tiles need head_dim 64"):
        FlashMaskForwardSm90(cutlass.BFloat16, 128, True, 1, fwd_config(64, True, 1))
    with pytest.raises(ValueError, match="head_dim 192 needs q_buffers=1 .*got q_buffers=2"):
        FlashMaskForwardSm90(cutlass.BFloat16, 192, True, 1, fwd_config(128, True, 1), head_dim_v=128)
    with pytest.raises(ValueError, match="head_dim 256 needs q_buffers=1 .*got q_buffers=2"):
        FlashMaskForwardSm90(cutlass.BFloat16, 256, True, 1, fwd_config(128, True, 1))
    for head_dim_v in (192, 256, 96):
        message = f"head_dim_v must be 64, 128 or 256 and at most head_dim .*got {head_dim_v}"
        with pytest.raises(ValueError, match=message):
            FlashMaskForwardSm90(cutlass.BFloat16, 192, True, 1, fwd_config(192, True, 1), head_dim_v=head_dim_v)
    with pytest.raises(ValueError, match="head_dim_v must be 64, 128 or 256 and at most head_dim \\(64"):
        FlashMaskForwardSm90(cutlass.BFloat16, 64, True, 1, fwd_config(64, True, 1), head_dim_v=128)
    pairs = r"\(64, 64\), \(128, 128\), \(192, 128\), \(256, 256\)"
    with pytest.raises(ValueError, match=rf"the cute backward takes head dims \(q/k, v\) of {pairs}, got \(128, 64\)"):
        compile_check("bf16", 128, True, 1, direction="bwd", head_dim_v=64)
    with pytest.raises(ValueError, match="keys_on_rows=True is not built for head dim 256: keys on rows .* at 64"):
        FlashMaskBackwardSm90(cutlass.BFloat16, 256, True, 1, bwd_config(128, True, 1))
    with pytest.raises(ValueError, match="keys_on_rows=False is not built for head dim 128"):
        FlashMaskBackwardSm90(cutlass.BFloat16, 128, True, 1, bwd_config(256, True, 1))


@pytest.mark.parametrize(
    "head_dim, head_dim_v, q_buffers, needed",
    [(192, 128, 1, 299008), (128, None, 2, 266240)],
)
def test_a_config_over_the_shared_memory_is_refused_at_compile_time(head_dim, head_dim_v, q_buffers, needed):
    """Three K/V stages take 292 KB at head dim 192 and 260 KB at 128 (two Q buffers): refused when
    compiled, naming the fields to change, not by an invalid-configuration error at the first launch."""
    from flashmask3.optimized import compile_check, fwd_config

    config = dataclasses.replace(fwd_config(head_dim, True, 1), num_stages=3)
    message = (
        f"the forward at head dim {head_dim} with tile_m=128, tile_n=128, num_stages=3, q_buffers={q_buffers} "
        f"needs {needed} bytes of shared memory, over the 232448 of sm_90"
    )
    with pytest.raises(ValueError, match=message):
        compile_check("bf16", head_dim, True, 1, config=config, head_dim_v=head_dim_v)


def test_a_second_do_stage_at_head_dim_256_is_refused_at_compile_time():
    """The backward at head dim 256 keeps one dO stage: a second one (32 KB) does not fit beside the
    64 KB of fp32 dQ staging, and the compile names the fields to change."""
    from flashmask3.optimized import bwd_config, compile_check

    config = dataclasses.replace(bwd_config(256, True, 1), do_stages=2)
    message = (
        "the backward at head dim 256 with key_tile=48, q_stages=2, do_stages=2 needs 261120 bytes of shared "
        "memory, over the 232448 of sm_90"
    )
    with pytest.raises(ValueError, match=message):
        compile_check("bf16", 256, True, 1, config, direction="bwd")


def test_the_forward_compiles_without_the_persistent_grid():
    """`persistent=False` changes only the grid (one CTA per work tile), which the launch decides:
    the same kernel compiles."""
    from flashmask3.optimized import compile_check, fwd_config

    assert compile_check("bf16", 128, True, 1, dataclasses.replace(fwd_config(128, True, 1), persistent=False)) > 0


@pytest.mark.parametrize(
    "head_dim, causal, width, changes",
    [
        (128, True, 1, dict(q_stages=2)),
        (128, True, 2, dict(diagonal_steps=False)),
        (64, True, 1, dict(diagonal_steps=False)),
    ],
)
def test_backward_configs_compile(head_dim, causal, width, changes):
    """The backward's non-default choices compile: two Q/dO stages, and every partial step masked
    from its keys' bounds at both head dims and both causal mask widths."""
    from flashmask3.optimized import bwd_config, compile_check

    config = dataclasses.replace(bwd_config(head_dim, causal, width), **changes)
    assert compile_check("bf16", head_dim, causal, width, config, direction="bwd") > 0


@pytest.mark.parametrize("changes", [dict(tile_m=128), dict(num_stages=3)])
def test_head_dim_64_configs_compile(changes):
    """Head dim 64 is chosen 192-row query tiles on three consumer warpgroups; the 128-row shape
    and three stages compile with it too."""
    from flashmask3.optimized import compile_check, fwd_config

    assert compile_check("fp16", 64, False, 4, dataclasses.replace(fwd_config(64, False, 4), **changes)) > 0


@pytest.mark.slow  # 16 compiles, ~30 s
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal, width", [(True, 1), (True, 2), (False, 2), (False, 4)])
def test_backward_kernel_compiles_for_sm90a(dtype, head_dim, causal, width):
    from flashmask3.optimized import compile_check

    assert 0 < compile_check(dtype, head_dim, causal, width, direction="bwd") < 120


@pytest.mark.slow  # compiles and disassembles eight backwards, ~60 s
@pytest.mark.parametrize("head_dim, head_dim_v", [(192, 128), (256, 256)])
@pytest.mark.parametrize(
    "dtype, causal, width", [("bf16", True, 1), ("fp16", True, 2), ("bf16", False, 2), ("fp16", False, 4)]
)
def test_the_backward_with_queries_on_rows_keeps_its_wgmmas_in_flight(
    tmp_path, dtype, causal, width, head_dim, head_dim_v
):
    """Head dims 192 (v 128) and 256: 96 and 48 keys per CTA with two Q stages fit in shared memory
    (the compile checks it), the step's 46 and 51 WGMMAs stay in flight, nothing lives in local
    memory."""
    args = f"'{dtype}', {head_dim}, {causal}, {width}, direction='bwd', head_dim_v={head_dim_v}"
    name = f"bwd_{head_dim}_{causal}_{width}"
    _, summary = hot_loop_in_registers(compiled_sass(tmp_path, name, "FlashMaskBackward", args), name)
    assert f"{46 if head_dim == 192 else 51} HGMMA" in summary


@pytest.mark.slow  # compiles and disassembles three backwards, ~30 s
def test_the_backward_with_queries_on_rows_builds_deterministic_and_profiled(tmp_path):
    """The deterministic build at 256 and at 192/128 (a per-query-tile semaphore before each dQ add)
    and the profiled build at 192/128 (clock reads around each step's segments): all in registers,
    with the step's WGMMAs, the profiled one alone reading the SM clock."""
    for name, head_dim, args in (
        ("deterministic_256", 256, "'bf16', 256, False, 4, direction='bwd', deterministic=True"),
        ("deterministic_192", 192, "'bf16', 192, True, 2, direction='bwd', deterministic=True, head_dim_v=128"),
        ("profiled_192", 192, "'bf16', 192, True, 1, direction='bwd', timeline=True, head_dim_v=128"),
    ):
        sass = compiled_sass(tmp_path, name, "FlashMaskBackward", args)
        assert "STL" not in sass and "LDL" not in sass
        assert sass.count("HGMMA") == (51 if head_dim == 256 else 46), name
        assert ("SR_CLOCKLO" in sass) == name.startswith("profiled")


@pytest.mark.slow  # compiles and disassembles twenty backwards, ~2 min
@pytest.mark.parametrize(
    "head_dim, head_dim_v, causal, width",
    [
        (128, 128, True, 1),
        (128, 128, True, 2),
        (128, 128, False, 2),
        (128, 128, False, 4),
        (64, 64, True, 1),
        (64, 64, False, 4),
        (192, 128, True, 1),
        (192, 128, True, 2),
        (192, 128, False, 2),
        (256, 256, False, 2),
    ],
)
def test_split_ctas_keep_the_step_and_add_the_parts_in_16_byte_accesses(tmp_path, head_dim, head_dim_v, causal, width):
    """`split_ctas_max_parts`: the step loop keeps the whole CTAs' WGMMAs in flight, in registers;
    the epilogue writes the part's dK and dV in 16-byte stores (one per 4 of the thread's values),
    counts itself with one gpu-scope atomic and reads the other parts in 16-byte loads; nothing
    goes to local memory (the mask-role warp and the epilogue included)."""
    config = f"bwd_config({head_dim}, {causal}, {width})"
    args = f"'bf16', {head_dim}, {causal}, {width}, direction='bwd', head_dim_v={head_dim_v}, config=%s"
    setup = "import dataclasses\nfrom flashmask3.optimized import bwd_config"
    summaries = {}
    for name, cfg in (("whole", config), ("split", f"dataclasses.replace({config}, split_ctas_max_parts=4)")):
        sass = compiled_sass(tmp_path, name, "FlashMaskBackward", args % cfg, setup)
        _, summaries[name] = hot_loop_in_registers(sass, name)
        if name == "split":
            keys = {192: 96, 256: 48}.get(head_dim, 128)
            values = keys * (head_dim + head_dim_v) // 256  # the thread's dK and dV
            assert sass.count("STG.E.128") == values // 4
            assert sass.count("LDG.E.128") >= values // 4
            assert sass.count("ATOMG.E.ADD.STRONG.GPU") == 1
    # The same WGMMAs in flight; ptxas schedules the loop a little differently (-2 to +2% instructions).
    assert summaries["split"].split(", ", 1)[1] == summaries["whole"].split(", ", 1)[1]
    counts = [int(summaries[name].split()[2]) for name in ("split", "whole")]
    assert abs(counts[0] - counts[1]) <= 0.02 * counts[1]


def unwrapped(argument):
    """A launch argument's tensor (a `Contiguous` one's, or the argument itself)."""
    from flashmask3.optimized import interface

    return argument.tensor if isinstance(argument, interface.Contiguous) else argument


def test_split_ctas_are_launched_in_short_grids_only(monkeypatch):
    """The work table and the workspace go to the kernel (in place of the longest-first order) only
    with `split_ctas_max_parts`, in a short grid, not in deterministic mode and not in a profiled
    build; the table is built once per mask and the part counters share the dQ semaphores' memset,
    16-byte aligned behind them (as the kernels take every tensor), and there are at most as many
    slots as the CTAs' parts."""
    import torch
    from flashmask3.optimized import bwd_config, interface
    from flashmask3.reference import masks

    launched = {}
    monkeypatch.setattr(
        interface, "_launch", lambda direction, *args, **kw: launched.setdefault(direction, []).append(args)
    )
    monkeypatch.setattr(interface, "_sm_count", lambda device: 2)  # 8 CTAs: 4 waves, 8 slots
    q = torch.randn(1, 512, 4, 64, dtype=torch.bfloat16)
    k, v = torch.randn(2, 1, 512, 2, 64, dtype=torch.bfloat16)
    mask = masks.build("causal_document", 512, batch=1, heads=1, seed=0)
    split = dataclasses.replace(bwd_config(64, True, 1), longest_ctas_first_waves=4, split_ctas_max_parts=4)
    runs = [
        (split, False),
        (split, False),
        (split, True),
        (dataclasses.replace(split, longest_ctas_first_waves=3), False),
    ]
    for config, deterministic in runs:
        interface.backward(q, q, k, v, q, torch.zeros(1, 4, 512), mask, 0.125, deterministic, config=config)
    # (dtype, d, causal, width, config, tensors, ...); the table and workspace go as Contiguous.
    assert [type(t) for t in launched["bwd"][0][5][16:]] == [interface.Contiguous, interface.Contiguous, torch.Tensor]
    tensors = [[unwrapped(t) for t in args[5]] for args in launched["bwd"]]
    work, partials, counters = tensors[0][16:]
    assert work.shape == (8 + 2 * 4, 4) and tensors[0][13] is None and tensors[1][16] is work
    assert partials.shape == (8, 128 * (64 + 64)) and partials.dtype == torch.float32
    assert counters.shape == (8,) and torch.all(counters == 0)
    assert counters.data_ptr() == tensors[0][12].data_ptr() + 4 * tensors[0][12].numel()
    for later in tensors[2:]:  # deterministic mode; a long grid
        assert later[16:] == [None, None, None]
    # 2 query heads of 3 query tiles (128 rows): 6 semaphores, the counters from the 8th int; 6 CTAs.
    q, k, v = torch.randn(3, 1, 320, 2, 64, dtype=torch.bfloat16)
    mask = masks.build("causal_document", 320, batch=1, heads=1, seed=0)
    interface.backward(q, q, k, v, q, torch.zeros(1, 2, 320), mask, 0.125, config=split)
    tensors = [unwrapped(t) for t in launched["bwd"][-1][5]]
    semaphore, (work, _, counters) = tensors[12], tensors[16:]
    assert semaphore.numel() == 6 and counters.data_ptr() == semaphore.data_ptr() + 4 * 8
    assert counters.data_ptr() % 16 == 0 and counters.shape == (8,) and work.shape == (6 + 8, 4)


def test_deterministic_backward_compiles_for_sm90a():
    from flashmask3.optimized import compile_check

    assert compile_check("bf16", 128, False, 4, direction="bwd", deterministic=True) > 0


def test_backward_without_lse_ahead_compiles():
    """`lse_ahead=False`: the backward reads the LSE from smem after the S GEMM (chosen at mask width 4)."""
    from flashmask3.optimized import bwd_config, compile_check

    config = dataclasses.replace(bwd_config(128, True, 1), lse_ahead=False)
    assert compile_check("bf16", 128, True, 1, config, direction="bwd") > 0


def test_launch_compiles_once_per_configuration_and_passes_torch_tensors(monkeypatch):
    """`_launch` (CPU plumbing, the compiled function faked): one compile per configuration, with
    --enable-tvm-ffi; each call passes the torch tensors and Python scalars as they are (the stream
    is the env stream)."""
    import cutlass.cute as cute
    import torch
    from flashmask3.optimized import interface

    compiled, calls = [], []

    def fake_compile(kernel, *args, **flags):
        compiled.append((type(kernel).__name__, args, flags))
        return lambda *call_args: calls.append(call_args)

    monkeypatch.setattr(cute, "compile", fake_compile)
    monkeypatch.setattr(interface, "_compiled", {})
    out, dq = torch.zeros(2, 8, 2, 64, dtype=torch.float32), torch.zeros(2, 8, 2, 64, dtype=torch.bfloat16)
    for _ in range(2):
        interface._launch("bwd_post", torch.bfloat16, 64, False, 2, None, [out, dq, None], [0.125])
    ((name, args, flags),) = compiled
    assert name == "BackwardPostprocess" and len(args) == 5 and len(calls) == 2  # no step table: None
    assert flags == {"options": "--enable-tvm-ffi"}
    assert calls[1][0] is not out and calls[1][0].data_ptr() == out.data_ptr() and calls[1][2:] == (None, 0.125)
    assert len(calls[1]) == 4


def test_threads_launching_a_new_kernel_together_compile_it_once_and_one_at_a_time(monkeypatch):
    """The DSL's compiler is not thread-safe (threads as CP ranks aborted the process): concurrent
    first launches wait for one compilation and then all run it."""
    import threading
    import time

    import cutlass.cute as cute
    import torch
    from flashmask3.optimized import interface

    running, overlaps, compiled, calls = [0], [], [], []

    def fake_compile(kernel, *args, **flags):
        running[0] += 1
        overlaps.append(running[0])
        time.sleep(0.05)
        running[0] -= 1
        compiled.append(type(kernel).__name__)
        return lambda *call_args: calls.append(threading.current_thread().name)

    monkeypatch.setattr(cute, "compile", fake_compile)
    monkeypatch.setattr(interface, "_compiled", {})
    out, dq = torch.zeros(2, 8, 2, 64, dtype=torch.float32), torch.zeros(2, 8, 2, 64, dtype=torch.bfloat16)

    def launch(head_dim):
        interface._launch("bwd_post", torch.bfloat16, head_dim, False, 2, None, [out, dq, None], [0.125])

    threads = [threading.Thread(target=launch, args=(64 if i < 4 else 128,)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert compiled == ["BackwardPostprocess"] * 2 and max(overlaps) == 1
    assert len(calls) == 6 and len(set(calls)) == 6


def test_the_backward_launches_longest_first_in_short_grids_when_not_deterministic(monkeypatch):
    """`longest_ctas_first_waves`: the main kernel gets the CTA order (a permutation of its CTAs) when
    its grid is at most that many waves and not `deterministic=True` (whose key tiles wait for the
    ones before them in grid order); the order is sorted once per mask."""
    import torch
    from flashmask3.optimized import bwd_config, interface
    from flashmask3.reference import masks

    launched = {}
    monkeypatch.setattr(
        interface, "_launch", lambda direction, *args, **kw: launched.setdefault(direction, []).append(args)
    )
    monkeypatch.setattr(interface, "_sm_count", lambda device: 2)  # 8 CTAs: 4 waves
    q = torch.randn(1, 512, 4, 64, dtype=torch.bfloat16)
    k, v = torch.randn(2, 1, 512, 2, 64, dtype=torch.bfloat16)
    mask = masks.build("causal_document", 512, batch=1, heads=1, seed=0)
    runs = [(4, False), (4, False), (3, False), (4, True)]  # (longest_ctas_first_waves, deterministic)
    for waves, deterministic in runs:
        config = dataclasses.replace(
            bwd_config(64, True, 1), longest_ctas_first_waves=waves, longest_ctas_first_buckets=0
        )
        interface.backward(q, q, k, v, q, torch.zeros(1, 4, 512), mask, 0.125, deterministic, config=config)
    orders = [args[5][13] for args in launched["bwd"]]  # (dtype, d, causal, width, config, tensors, ...)
    assert sorted(orders[0].tolist()) == list(range(1 * 2 * 4))
    assert orders[1] is orders[0] and orders[2] is None and orders[3] is None


def test_the_forward_draws_longest_first_when_few_per_sm(monkeypatch):
    """`longest_tiles_first_waves`: the forward kernel gets the work tiles' draw order (a
    permutation) when there are at most that many work tiles per SM."""
    import dataclasses

    import torch
    from flashmask3.optimized import fwd_config, interface
    from flashmask3.reference import masks

    launched = []
    monkeypatch.setattr(interface, "_launch", lambda direction, *args, **kw: launched.append(args))
    monkeypatch.setattr(interface, "_sm_count", lambda device: 2)  # 8 work tiles: 4 per SM
    q, k, v = torch.randn(3, 1, 512, 2, 128, dtype=torch.bfloat16)
    mask = masks.build("causal_document", 512, batch=1, heads=1, seed=0)
    for waves in (4, 3, 0):
        config = dataclasses.replace(fwd_config(128, True, 1), longest_tiles_first_waves=waves)
        interface.forward(q, k, v, mask, 0.125, config=config)
    interface.forward(q, k, v, None, 0.125)  # no mask: every work tile alike, no order
    orders = [args[5][8] for args in launched]  # (dtype, d, causal, width, config, tensors, ...)
    assert sorted(orders[0].tolist()) == list(range(2 * 4)) and orders[1] is None and orders[2] is None
    assert orders[3] is None


def test_the_causal_mask_alone_launches_the_causal_kernels_on_bounds_kept_per_shape(monkeypatch):
    """`causal=True` without a mask: both directions launch the causal one-bound kernels on a kept
    causal mask (every bound at Sq: only the diagonal cuts a tile), the same tensor call after call,
    with the forward's work tiles drawn longest first (they are not alike, unlike no mask's), the
    key tiles counted by default (`counted_keys`) and listed where a configuration says so."""

    import torch
    from flashmask3.optimized import fwd_config, interface

    launched = []
    monkeypatch.setattr(interface, "_launch", lambda direction, *args, **kw: launched.append((direction, args)))
    monkeypatch.setattr(interface, "_sm_count", lambda device: 2)
    q, k, v = torch.randn(3, 1, 512, 2, 128, dtype=torch.bfloat16)
    listed = fwd_config(128, True, 1)
    assert not listed.counted_keys
    for config in (None, listed):
        interface.forward(q, k, v, None, 0.125, config=config, causal=True)
    interface.backward(q, q, k, v, q, torch.zeros(1, 2, 512), None, 0.125, causal=True)
    forwards = [args for direction, args in launched if direction == "fwd"]
    (backward,) = [args for direction, args in launched if direction == "bwd"]
    assert [args[1:4] for args in forwards + [backward]] == [(128, True, 1)] * 3  # (d, causal, width)
    assert [args[4].counted_keys for args in forwards] == [True, False]  # (..., config, tensors, ...)
    bounds = [args[5][5].tensor for args in forwards]  # tensors: q, k, v, out, lse, the mask's bounds
    assert bounds[0] is bounds[1] and bounds[0].shape[-1] == 1 and bool((bounds[0] == 512).all())
    assert forwards[0][5][8] is not None  # the draw order


def test_the_host_only_choices_compile_no_new_kernel():
    """The longest-first thresholds and length classes decide on the host whether and which order
    is passed; the kernel is keyed on the rest of its configuration."""
    import dataclasses

    from flashmask3.optimized import bwd_config, fwd_config
    from flashmask3.optimized.interface import _device_part

    fwd, bwd = fwd_config(128, True, 1), bwd_config(128, True, 1)
    assert _device_part(fwd) == _device_part(dataclasses.replace(fwd, longest_tiles_first_waves=1))
    assert _device_part(bwd) == _device_part(dataclasses.replace(bwd, longest_ctas_first_waves=1))
    assert _device_part(bwd) == _device_part(dataclasses.replace(bwd, longest_ctas_first_buckets=16))
    assert _device_part(bwd) == _device_part(
        dataclasses.replace(bwd, split_ctas_max_parts=4, split_ctas_slack_pct=-100)
    )
    assert _device_part(fwd) != _device_part(dataclasses.replace(fwd, late_k_release=False))


_SERIALIZATION_CASES = {  # name: (kernel, compile_check arguments)
    "fwd": ("FlashMaskForward", "'bf16', 128, True, 1"),
    "bwd": ("FlashMaskBackward", "'bf16', 128, False, 2, direction='bwd'"),
    "fwd_value_dim_64": ("FlashMaskForward", "'bf16', 128, False, 4, head_dim_v=64"),
    "fwd_head_dim_192_128": ("FlashMaskForward", "'bf16', 192, True, 2, head_dim_v=128"),
}


def nvdisasm_path() -> str:
    """The nvdisasm of the nvidia-cuda-nvdisasm wheel (a dev extra); the calling test skips without it."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("nvidia")
    packages = (spec.submodule_search_locations or []) if spec else []
    candidates = [Path(p) / "cu13" / "bin" / "nvdisasm" for p in packages]
    nvdisasm = next((c for c in candidates if c.exists()), None)
    if nvdisasm is None:
        pytest.skip("nvdisasm not installed (pip install nvidia-cuda-nvdisasm)")
    return str(nvdisasm)


def compiled_sass(tmp_path, name: str, kernel: str, args: str, setup: str = "") -> str:
    """SASS of one kernel as `compile_check(args)` builds it for sm_90a (after the statements
    `setup`), disassembled by nvdisasm."""
    import os
    import subprocess
    import sys

    nvdisasm = nvdisasm_path()
    (tmp_path / name).mkdir()
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a", CUTE_DSL_KEEP="cubin", CUTE_DSL_DUMP_DIR=str(tmp_path / name))
    code = f"{setup}\nfrom flashmask3.optimized.interface import compile_check; compile_check({args})"
    subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True, timeout=600)
    (cubin,) = (tmp_path / name).glob(f"*{kernel}Sm90*.cubin")
    return subprocess.run([str(nvdisasm), "-c", str(cubin)], check=True, capture_output=True, text=True).stdout


def hot_loop_in_registers(sass: str, name: str) -> tuple[list, str]:
    """The kernel's hot loop (`sass_path` blocks) and its summary, asserting on the way that the
    kernel `name` uses no local memory and that the loop has WGMMAs, none serialized (C7512)."""
    import sass_path

    assert "STL" not in sass and "LDL" not in sass, f"{name} uses local memory"
    blocks = sass_path.hot_loop(sass_path.read_blocks(sass.splitlines()))
    summary = sass_path.loop_summary(blocks)
    assert " 0 HGMMA" not in summary and "serialized" not in summary, f"{name}: {summary}"
    return blocks, summary


@pytest.mark.slow  # compiles and disassembles both kernels, ~12 s
def test_default_kernels_keep_their_wgmmas_in_flight(tmp_path):
    """ptxas serializes every WGMMA when registers run short (its C7512 warning: an arrive and a wait
    around each HGMMA); a kernel built that way measured 1-9% off while looking correct (the
    backward's 128-row query steps, `s_ahead`). The default forward and backward main loops must
    keep theirs in flight (the check itself is tested on a serialized loop in
    test_bench_scripts.py)."""
    for name, (kernel, args) in _SERIALIZATION_CASES.items():
        hot_loop_in_registers(compiled_sass(tmp_path, name, kernel, args), name)


def changed_forward_sass(
    tmp_path, name: str, head_dim: int, causal: bool, width: int, changes: str, head_dim_v: int | None = None
) -> str:
    """The SASS of the bf16 forward under `fwd_config(head_dim, causal, width)` with `changes`
    (`dataclasses.replace` keywords, as source text), V of `head_dim_v` where given."""
    config = f"dataclasses.replace(fwd_config({head_dim}, {causal}, {width}), {changes})"
    setup = "import dataclasses; from flashmask3.optimized import fwd_config"
    args = f"'bf16', {head_dim}, {causal}, {width}, {config}"
    if head_dim_v is not None:
        args += f", head_dim_v={head_dim_v}"
    return compiled_sass(tmp_path, name, "FlashMaskForward", args, setup)


def forward_hot_loop(
    tmp_path, name: str, head_dim: int, causal: bool, width: int, changes: str, head_dim_v: int | None = None
) -> list[str]:
    """The instructions of the forward's key-tile loop under `changed_forward_sass`'s configuration,
    checked free of local memory and of serialized WGMMAs."""
    sass = changed_forward_sass(tmp_path, name, head_dim, causal, width, changes, head_dim_v)
    blocks, _ = hot_loop_in_registers(sass, name)
    return [inst for _, block in blocks for inst in block]


def forward_loop_with_one_change(tmp_path, field: str, value: bool) -> tuple[list[str], int, int]:
    """The forward's key-tile loop (head dim 128, causal, width 1: O rescaled at every turn) with one
    `FwdConfig` field changed (`forward_hot_loop`): its instructions and the positions of the wait
    for S_j (`wait_group 1`) and then for the warpgroup's own PV GEMM (`wait_group 0`)."""
    loop = forward_hot_loop(tmp_path, f"{field}_{value}", 128, True, 1, f"{field}={value}")
    s_wait = next(i for i, inst in enumerate(loop) if "WARPGROUP.DEPBAR.LE gsb0, 0x1" in inst)
    pv_wait = next(i for i, inst in enumerate(loop) if i > s_wait and "WARPGROUP.DEPBAR.LE gsb0, 0x0" in inst)
    return loop, s_wait, pv_wait


@pytest.mark.slow  # compiles and disassembles three forwards, ~50 s
@pytest.mark.parametrize(
    "head_dim, causal, width, tile_n, q_buffers",
    [(128, False, 2, 176, 1), (128, False, 2, 144, 2), (256, True, 1, 80, 1)],
)
def test_key_tiles_not_a_multiple_of_64_keep_the_pv_gemm_in_flight(
    tmp_path, head_dim, causal, width, tile_n, q_buffers
):
    """Key tiles that are not a multiple of 64 wide (FA3's 176 at head dim 128 without a causal
    mask, FA4's 80 at 256): S goes to the PV GEMM's A operand one packed cvt per register, else
    ptxas moves registers between its WGMMAs and serializes them (C7519); the bounds' copies go per
    128 keys. At 256, Q, two K/V stages of 80 keys and one bound per key fit in smem (the
    1024-aligned tiles first, no padding before them). No local memory, the WGMMAs in flight (4
    arrives in the loop, as at 128 keys)."""
    changes = f"tile_n={tile_n}, q_buffers={q_buffers}"
    loop = forward_hot_loop(tmp_path, f"d{head_dim}_tile_n_{tile_n}", head_dim, causal, width, changes)
    assert sum("WARPGROUP.ARRIVE" in inst for inst in loop) == 4
    assert any(f"HGMMA.64x{tile_n}x16" in inst for inst in loop)


@pytest.mark.slow  # compiles and disassembles two forwards, ~20 s
@pytest.mark.parametrize("causal, width", [(True, 1), (False, 4)])
def test_the_forward_at_head_dim_256_keeps_its_loop_in_registers(tmp_path, causal, width):
    """Head dim 256 (64-key tiles, one Q buffer, O's 128 accumulators per thread): its shared
    storage fits (the compile checks it), no local memory, the WGMMAs in flight."""
    name = f"hd256_{causal}_{width}"
    hot_loop_in_registers(compiled_sass(tmp_path, name, "FlashMaskForward", f"'bf16', 256, {causal}, {width}"), name)


@pytest.mark.slow  # compiles and disassembles four forwards, ~40 s
@pytest.mark.parametrize("head_dim, causal, width", [(128, True, 1), (256, False, 4)])
def test_sinks_join_in_the_forwards_epilogue_and_leave_its_loop_as_it_was(tmp_path, head_dim, causal, width):
    """The heads' sink logits are read and joined once per work tile, in the epilogue: against the
    build without them, the work-tile loop gains one global load and a few dozen float
    instructions, and no WGMMA, barrier or mbarrier operation; no local memory."""
    import collections

    import sass_path

    counts = []
    for sinks in (False, True):
        name = f"sinks_{sinks}_{head_dim}_{causal}_{width}"
        args = f"'bf16', {head_dim}, {causal}, {width}, sinks={sinks}"
        blocks, _ = hot_loop_in_registers(compiled_sass(tmp_path, name, "FlashMaskForward", args), name)
        counts.append(collections.Counter(sass_path.opcode(inst) for _, block in blocks for inst in block))
    plain, with_sinks = counts
    added = with_sinks - plain
    assert added["LDG"] == 1 and sum(added.values()) <= 40, added
    for op in ("HGMMA", "WARPGROUP", "BAR", "SYNCS", "MUFU"):
        assert with_sinks[op] - plain[op] <= (4 if op == "MUFU" else 0), (op, added)


@pytest.mark.slow  # compiles and disassembles two forwards, ~20 s
@pytest.mark.parametrize("head_dim, head_dim_v, causal, width", [(192, 128, True, 2), (256, 256, False, 2)])
def test_the_fp16_forward_at_head_dims_192_and_256_keeps_its_loop_in_registers(
    tmp_path, head_dim, head_dim_v, causal, width
):
    """fp16 at q/k 192 with v 128 and at 256 (the bf16 builds' loops are checked above and in
    `test_o_from_registers_keeps_the_loop_and_stores_8_bytes`): no local memory, the loop's 40
    WGMMAs in flight, each an fp16 one (bf16's carry a .BF16 suffix)."""
    name = f"fp16_{head_dim}_{causal}_{width}"
    args = f"'fp16', {head_dim}, {causal}, {width}, head_dim_v={head_dim_v}"
    sass = compiled_sass(tmp_path, name, "FlashMaskForward", args)
    _, summary = hot_loop_in_registers(sass, name)
    assert " 40 HGMMA" in summary, summary
    wgmmas = [line for line in sass.splitlines() if "HGMMA." in line]
    assert wgmmas and not any(".BF16" in line for line in wgmmas)


@pytest.mark.slow  # compiles and disassembles four forwards, ~40 s
@pytest.mark.parametrize("width", [2, 4])
def test_one_interval_tiles_keep_the_loop_in_registers(tmp_path, width):
    """`one_interval_tiles` (non-causal masks) adds two element masks of one interval each to the
    forward's PARTIAL branch: no local memory, the WGMMAs not serialized, the loop's HGMMA count as
    without it."""
    loops = {
        on: forward_hot_loop(tmp_path, f"one_interval_{width}_{on}", 128, False, width, f"one_interval_tiles={on}")
        for on in (False, True)
    }
    assert sum("HGMMA" in inst for inst in loops[True]) == sum("HGMMA" in inst for inst in loops[False])


@pytest.mark.slow  # compiles and disassembles two backwards, ~12 s
@pytest.mark.parametrize("head_dim", [64, 128])
def test_diagonal_steps_keep_the_loop_in_registers(tmp_path, head_dim):
    """`diagonal_steps` (sliding window's variant: causal, one bound) adds a branch to the
    backward's step: the same LDG and HGMMA counts in the loop, no local memory, the WGMMAs not
    serialized."""
    setup = "import dataclasses; from flashmask3.optimized import bwd_config"

    def loop_of(on: bool) -> list[str]:
        config = f"dataclasses.replace(bwd_config({head_dim}, True, 1), diagonal_steps={on})"
        args = f"'bf16', {head_dim}, True, 1, {config}, direction='bwd'"
        name = f"diagonal_steps_{head_dim}_{on}"
        blocks, _ = hot_loop_in_registers(compiled_sass(tmp_path, name, "FlashMaskBackward", args, setup), name)
        return [inst for _, block in blocks for inst in block]

    default, diagonal = loop_of(False), loop_of(True)
    assert sum("LDG" in inst for inst in diagonal) == sum("LDG" in inst for inst in default)
    assert sum("HGMMA" in inst for inst in diagonal) == sum("HGMMA" in inst for inst in default)


@pytest.mark.slow  # compiles and disassembles two backwards with their pre/post kernels, ~25 s
@pytest.mark.parametrize("causal, width", [(False, 2), (True, 1), (True, 2)])
def test_128_row_steps_at_head_dim_64_keep_the_step_in_registers(tmp_path, causal, width):
    """The default `query_tile=128` at head dim 64 (FA4's step there; two Q/dO stages, the LSE read
    after the S GEMM): no local memory and the WGMMAs in flight, the S^T GEMM 64 keys x 128 queries
    per warpgroup, the dQ GEMM's rows split between the warpgroups."""
    config = f"bwd_config(64, {causal}, {width})"
    setup = "from flashmask3.optimized import bwd_config"
    name = f"query_tile_128_{causal}_{width}"
    sass = compiled_sass(
        tmp_path, name, "FlashMaskBackward", f"'bf16', 64, {causal}, {width}, {config}, direction='bwd'", setup
    )
    blocks, _ = hot_loop_in_registers(sass, name)
    loop = [inst for _, block in blocks for inst in block]
    assert any("HGMMA.64x128x16" in inst for inst in loop)  # S^T and dP^T: 64 keys x 128 queries


@pytest.mark.slow  # compiles and disassembles two forwards, ~10 s
def test_late_k_release_puts_the_pv_wait_below_the_softmax(tmp_path):
    """`late_k_release`: in the forward's key-tile loop (head dim 128, causal), the exponentials
    between the wait for S_j (`wait_group 1`) and the wait for the warpgroup's own PV GEMM
    (`wait_group 0`) run while that GEMM does: none of the 66 per tile in the default build, most
    with the K stage released after the mask; no local memory either way."""

    def exponentials_under_the_pv(late: bool) -> int:
        loop, s_wait, pv_wait = forward_loop_with_one_change(tmp_path, "late_k_release", late)
        return sum("MUFU.EX2" in inst for inst in loop[s_wait:pv_wait])

    assert exponentials_under_the_pv(False) == 0
    assert exponentials_under_the_pv(True) >= 40


@pytest.mark.slow  # compiles and disassembles two forwards, ~10 s
def test_fmax_row_max_drops_the_nan_compares_from_the_loop(tmp_path):
    """`fmax_row_max`: the key-tile loop's row maxima without NaN-propagating compares (FSETP
    falls by at least 6), the exponentials still under the PV GEMM, no local memory."""

    def loop_counts(fmax: bool) -> tuple[int, int]:
        loop, s_wait, pv_wait = forward_loop_with_one_change(tmp_path, "fmax_row_max", fmax)
        return sum("FSETP" in inst for inst in loop), sum("MUFU.EX2" in inst for inst in loop[s_wait:pv_wait])

    (compares, _), (compares_fmax, under_pv) = loop_counts(False), loop_counts(True)
    assert compares_fmax <= compares - 6 and under_pv >= 40


@pytest.mark.slow  # compiles and disassembles three forwards, ~40 s
@pytest.mark.parametrize("head_dim, causal, width", [(192, True, 1), (192, False, 2), (256, True, 2)])
def test_without_turn_barriers_the_loop_meets_only_per_warpgroup(tmp_path, head_dim, causal, width):
    """`turn_barriers=False` (FA3/FA4's choice above head dim 128): the key-tile loop has no
    256-thread barrier (the turns' BAR.SYNC and BAR.ARV), only the warpgroup's own 128-thread bounds
    barrier, now also before each refill (more of them than in the default's loop, one per copy of
    the refill ptxas makes); no local memory, the WGMMAs in flight."""
    head_dim_v = 128 if head_dim == 192 else head_dim
    with_turns, without = (
        forward_hot_loop(
            tmp_path,
            f"turns_{head_dim}_{causal}_{width}_{on}",
            head_dim,
            causal,
            width,
            f"turn_barriers={on}",
            head_dim_v,
        )
        for on in (True, False)
    )
    for instructions, turns in ((with_turns, True), (without, False)):
        wide = sum(("BAR.SYNC" in inst or "BAR.ARV" in inst) and "0x100" in inst for inst in instructions)
        assert (wide > 0) == turns, (turns, wide)
    per_warpgroup = [sum("BAR.SYNC" in inst and "0x80" in inst for inst in x) for x in (with_turns, without)]
    assert per_warpgroup[1] > per_warpgroup[0], per_warpgroup


@pytest.mark.slow  # compiles and disassembles one forward, ~10 s
def test_the_lazy_rescale_puts_os_multiplies_behind_one_vote(tmp_path):
    """`lazy_rescale` (the default at head dim 256): after the wait for the warpgroup's own PV GEMM,
    O's 128 multiplies per thread run only past a warp vote's branch, so a turn whose rows all kept
    their max issues none of them; no local memory, the WGMMAs in flight."""
    from flashmask3.optimized import fwd_config

    assert fwd_config(256, True, 1).lazy_rescale  # the default's kernel
    loop = forward_hot_loop(tmp_path, "lazy_256", 256, True, 1, "lazy_rescale=True")
    vote = next(i for i, inst in enumerate(loop) if "VOTE.ANY" in inst)
    branch = next(i for i in range(vote, len(loop)) if " BRA " in loop[i] and "@" in loop[i])
    pv_wait = max(i for i in range(vote) if "WARPGROUP.DEPBAR.LE gsb0, 0x0" in loop[i])
    assert sum("FMUL" in inst for inst in loop[pv_wait:branch]) <= 8
    assert sum("FMUL" in inst for inst in loop[branch : branch + 160]) >= 120


@pytest.mark.slow  # compiles and disassembles two forwards, ~10 s
def test_only_the_mask_role_reads_the_longest_first_order(tmp_path):
    """With the longest-first order the work-tile headers carry the work tile, looked up once by the
    mask role: one global load more than the build drawing in index order, none in the producer's
    or the consumers' path before a tile's Q load and first GEMM; no local memory, and the loop's
    WGMMAs stay in flight."""

    def build(waves: int) -> str:
        return changed_forward_sass(tmp_path, f"waves_{waves}", 128, True, 1, f"longest_tiles_first_waves={waves}")

    index_order, longest_first = build(0), build(128)
    loads = [sum("LDG" in line for line in sass.splitlines()) for sass in (index_order, longest_first)]
    assert loads[1] - loads[0] == 1, loads
    hot_loop_in_registers(longest_first, "longest first")


@pytest.mark.slow  # compiles and disassembles five forwards, ~30 s
@pytest.mark.parametrize(
    "head_dim, causal, width", [(128, True, 1), (128, True, 2), (128, False, 2), (128, False, 4), (256, True, 1)]
)
def test_segment_tiles_keep_the_loop_in_registers(tmp_path, head_dim, causal, width):
    """`segment_tiles` (loads from each tile's real first row, a segment's last tile stored row by
    row): no local memory, the loop's WGMMAs in flight, as many as the sequence tiles' loop, and
    the row-by-row store's 16-byte global stores (STG.E.128) beside the TMA store; at 256, whose O
    leaves from registers (8-byte stores, a segment's rows predicated), neither."""
    name = f"segments_{head_dim}_{causal}_{width}"
    sass = changed_forward_sass(tmp_path, name, head_dim, causal, width, "segment_tiles=True")
    _, summary = hot_loop_in_registers(sass, name)
    hgmma = {128: 32, 256: 40}[head_dim]
    assert f" {hgmma} HGMMA" in summary, summary
    if head_dim == 256:
        assert "STG.E.64" in sass and "UTMASTG" not in sass
    else:
        assert "STG.E.128" in sass and "UTMASTG" in sass


@pytest.mark.slow  # compiles and disassembles six forwards, ~60 s
@pytest.mark.parametrize(
    "head_dim, causal, width, segments", [(256, True, 1, False), (256, False, 2, True), (192, False, 4, False)]
)
def test_o_from_registers_keeps_the_loop_and_stores_8_bytes(tmp_path, head_dim, causal, width, segments):
    """`o_from_registers` (O stored from registers, the Q buffer freed after the last S GEMM): no
    local memory, the loop's WGMMAs in flight, as many as the staged build's; no stmatrix and no
    TMA store of O, but two rows of Dv / 16 8-byte stores per thread (quads of lanes 32 contiguous
    bytes of a row each), one quad shuffle more than the staged build per store."""
    head_dim_v = 128 if head_dim == 192 else head_dim

    def sass_of(on: bool) -> list[str]:
        changes = f"o_from_registers={on}" + (", segment_tiles=True" if segments else "")
        name = f"o_from_registers_{head_dim}_{causal}_{width}_{on}"
        return changed_forward_sass(tmp_path, name, head_dim, causal, width, changes, head_dim_v).splitlines()

    sass, staged = sass_of(True), sass_of(False)
    _, summary = hot_loop_in_registers("\n".join(sass), "o_from_registers")
    _, staged_summary = hot_loop_in_registers("\n".join(staged), "the staged store")
    wgmmas = re.search(r" (\d+) HGMMA", staged_summary).group(1)
    assert f" {wgmmas} HGMMA" in summary, (summary, staged_summary)
    assert not any("STSM" in line or "UTMASTG" in line for line in sass)
    stores = sum("STG.E.64" in line for line in sass)
    assert stores == 2 * head_dim_v // 16
    shuffles = sum("SHFL.BFLY" in line for line in sass) - sum("SHFL.BFLY" in line for line in staged)
    assert shuffles == stores


@pytest.mark.slow  # compiles and disassembles five backwards, ~40 s
@pytest.mark.parametrize(
    "head_dim, causal, width", [(128, True, 1), (128, True, 2), (128, False, 2), (128, False, 4), (64, False, 4)]
)
def test_segment_steps_keep_the_loop_in_registers(tmp_path, head_dim, causal, width):
    """`segment_steps` (loads from each tile's real first row, a segment's last key tile stored
    row by row): no local memory (at mask width 4 with the producer warpgroup at 32 registers), the
    step's WGMMAs in flight, as many as the sequence tiles' step, and the row-by-row store's 16-byte
    global stores beside the TMA stores."""
    setup = "import dataclasses; from flashmask3.optimized import bwd_config"
    config = f"dataclasses.replace(bwd_config({head_dim}, {causal}, {width}), segment_steps=True)"
    args = f"'bf16', {head_dim}, {causal}, {width}, {config}, direction='bwd'"
    name = f"segment_steps_{head_dim}_{causal}_{width}"
    sass = compiled_sass(tmp_path, name, "FlashMaskBackward", args, setup)
    _, summary = hot_loop_in_registers(sass, name)
    assert f" {({64: 24, 128: 32})[head_dim]} HGMMA" in summary, summary
    assert "STG.E.128" in sass and "UTMASTG" in sass


@pytest.mark.slow  # compiles and disassembles five backwards, ~30 s
@pytest.mark.parametrize(
    "head_dim, causal, width, deterministic",
    [(128, True, 1, False), (128, False, 4, False), (128, True, 2, True), (64, False, 2, False), (256, True, 1, False)],
)
def test_the_dq_writer_keeps_the_loop_in_registers(tmp_path, head_dim, causal, width, deterministic):
    """`dq_writer` moves the dQ reduce-add's issue and its smem-read wait to warp 2 (24 or 32
    registers, deterministic mode's semaphore included): no local memory anywhere, the step's
    WGMMAs in flight, the bulk reduce-add still in the kernel, and the same HGMMA count as without."""
    setup = "import dataclasses; from flashmask3.optimized import bwd_config"

    def build(on: bool) -> tuple[str, str]:
        config = f"dataclasses.replace(bwd_config({head_dim}, {causal}, {width}), dq_writer={on})"
        args = f"'bf16', {head_dim}, {causal}, {width}, {config}, direction='bwd', deterministic={deterministic}"
        name = f"dq_writer_{head_dim}_{causal}_{width}_{deterministic}_{on}"
        sass = compiled_sass(tmp_path, name, "FlashMaskBackward", args, setup)
        return sass, hot_loop_in_registers(sass, name)[1]

    (sass, summary), (_, default_summary) = build(True), build(False)
    assert "UBLKRED" in sass or "BULK" in sass, "no bulk reduce-add in the writer's build"
    hgmma = [part for part in summary.split(",") if "HGMMA" in part]
    assert hgmma == [part for part in default_summary.split(",") if "HGMMA" in part], (summary, default_summary)


@pytest.mark.slow  # compiles and disassembles two backwards, ~15 s
def test_the_short_grid_backward_keeps_the_loop_in_registers(tmp_path):
    """The short grids' build (two Q/dO stages with the dQ writer, causal, one bound per key): no
    local memory, its WGMMAs in flight, as many as the long grids' three-stage build."""
    setup = "from flashmask3.optimized import bwd_config"
    summaries = []
    for config in ("bwd_config(128, True, 1)", "bwd_config(128, True, 1).for_short_grid()"):
        args = f"'bf16', 128, True, 1, {config}, direction='bwd'"
        name = f"short_grid_{len(summaries)}"
        summaries.append(
            hot_loop_in_registers(compiled_sass(tmp_path, name, "FlashMaskBackward", args, setup), name)[1]
        )
    assert [p for p in summaries[0].split(",") if "HGMMA" in p] == [p for p in summaries[1].split(",") if "HGMMA" in p]


def test_backward_grid_order_build_compiles():
    """The build long grids run (the default compile is the longest-first one): key tile, KV head
    and batch from the 3-D grid."""
    from flashmask3.optimized import bwd_config, compile_check

    config = dataclasses.replace(bwd_config(128, True, 1), longest_ctas_first_waves=0)
    assert compile_check("bf16", 128, True, 1, config, direction="bwd") > 0


def test_forward_draw_order_build_compiles():
    """The build many work tiles per SM run (the default compile is the longest-first one): the
    work tiles drawn in index order."""
    import dataclasses

    from flashmask3.optimized import compile_check, fwd_config

    config = dataclasses.replace(fwd_config(128, True, 1), longest_tiles_first_waves=0)
    assert compile_check("bf16", 128, True, 1, config) > 0


def test_backward_profiled_build_compiles():
    """The debugging build that sums each step segment's cycles (`optimized/timeline.py`); the
    default build has none of it."""
    from flashmask3.optimized import compile_check

    assert compile_check("bf16", 128, False, 2, direction="bwd", timeline=True) > 0


def test_forward_timeline_build_compiles():
    """The debugging build that stamps each role's events (`optimized/timeline.py`); the default build
    has none of it."""
    from flashmask3.optimized import compile_check

    assert compile_check("bf16", 64, False, 4, timeline=True) > 0
    assert compile_check("bf16", 128, True, 1, timeline=True, segmented=True) > 0  # on segment tiles


@pytest.mark.slow  # compiles and disassembles three forwards, ~15 s
@pytest.mark.parametrize(
    "head_dim, causal, width, segmented", [(128, False, 2, False), (128, True, 1, True), (256, True, 1, False)]
)
def test_the_turn_profile_marks_each_segment_with_the_loop_in_registers(tmp_path, head_dim, causal, width, segmented):
    """The turn-profiled build (`forward(..., turn_profile=...)`) reads the SM clock once per segment
    of a steady-state turn (9) and once before the loop, with no local memory and its WGMMAs in
    flight (the default build has none of it: the fingerprints test); on segment tiles too. At 256,
    where O leaves from registers and Q's buffer is freed after the last S GEMM, ptxas copies two
    of the turn's reads into the branch that frees it (12 in all)."""
    name = f"turn_profile_{head_dim}_{causal}_{width}_{segmented}"
    args = f"'bf16', {head_dim}, {causal}, {width}, turn_profile=True, segmented={segmented}"
    sass = compiled_sass(tmp_path, name, "FlashMaskForward", args)
    hot_loop_in_registers(sass, name)
    assert sass.count("SR_CLOCKLO") == (12 if head_dim == 256 else 10)


def test_the_turn_profile_is_refused_at_192_row_tiles_and_needs_a_row_per_cta(monkeypatch):
    import torch
    from flashmask3.optimized import interface

    launched = []
    monkeypatch.setattr(interface, "_launch", lambda direction, *args, **kw: launched.append(args))
    monkeypatch.setattr(interface, "_sm_count", lambda device: 3)  # 8 work tiles below: 3 CTAs
    q, k, v = (torch.zeros(1, 256, 2, 64, dtype=torch.bfloat16) for _ in range(3))
    with pytest.raises(ValueError, match="the turn profile spills at tile_m=192 .* a config with tile_m=128"):
        interface.forward(q, k, v, None, 0.125, turn_profile=torch.zeros(1, 10, dtype=torch.int64))
    q, k, v = (torch.zeros(2, 512, 2, 128, dtype=torch.bfloat16) for _ in range(3))
    message = (
        r"turn_profile must be a contiguous int64 tensor of shape \[3, 10\] \(CTAs, events\), got torch.int64 \[8, 10\]"
    )
    with pytest.raises(ValueError, match=message):
        interface.forward(q, k, v, None, 0.125, turn_profile=torch.zeros(8, 10, dtype=torch.int64))
    profile = torch.zeros(3, 10, dtype=torch.int64)
    interface.forward(q, k, v, None, 0.125, turn_profile=profile)
    # (dtype, d, causal, width, config, tensors, ...): the tensors end with the timeline, the turn
    # profile and the sinks
    assert unwrapped(launched[0][5][-2]) is profile and launched[0][5][-1] is None


def test_the_sinks_reach_the_forward_kernel_as_fp32_logits(monkeypatch):
    """`sinks` in any float dtype go to the kernel as a fresh fp32 copy of [Hq] values (its last
    tensor argument), which is what the sinks build compiles for."""
    import torch
    from flashmask3.optimized import interface

    launched = []
    monkeypatch.setattr(interface, "_launch", lambda direction, *args, **kw: launched.append(args))
    monkeypatch.setattr(interface, "_sm_count", lambda device: 132)
    q, k, v = (torch.zeros(1, 256, 4, 128, dtype=torch.bfloat16) for _ in range(3))
    sinks = torch.tensor([0.5, -1.0, 2.25, -math.inf], dtype=torch.bfloat16)
    interface.forward(q, k, v, None, 0.125, sinks=sinks)
    given = launched[0][5][-1]
    assert given.dtype == torch.float32 and given.tolist() == [0.5, -1.0, 2.25, -math.inf]
    assert given.data_ptr() != sinks.data_ptr()
    with pytest.raises(ValueError, match=r"sinks must be a 1-D tensor \[Hq\] = \[4\], .* got shape \(2,\)"):
        interface.forward(q, k, v, None, 0.125, sinks=sinks[:2])  # one per KV head: the kernel would read past it


def test_the_timeline_needs_a_row_per_cta_of_the_virtual_grid_with_segment_tiles(monkeypatch):
    """On a segmented mask the default forward takes segment tiles: its grid, and so the timeline's
    rows, count the virtual rows' work tiles (`forward_ctas` knows them from S alone)."""
    import torch
    from flashmask3.optimized import fwd_config, interface
    from flashmask3.optimized.timeline import Event
    from flashmask3.reference import ColumnMask

    launched = []
    monkeypatch.setattr(interface, "_launch", lambda direction, *args, **kw: launched.append(args))
    monkeypatch.setattr(interface, "_sm_count", lambda device: 1000)  # a CTA per work tile
    q, k, v = (torch.zeros(1, 1000, 2, 128, dtype=torch.bfloat16) for _ in range(3))
    mask = ColumnMask.causal_document(torch.tensor([0, 300, 1000]))
    config = fwd_config(128, True, 1, segmented=True)
    assert interface.forward_ctas(q, config) == 2 * 2048 // 128  # 1,000 + 8 x 127 rows, rounded up
    plain = interface.forward_ctas(q, fwd_config(128, True, 1))
    message = r"timeline must be a contiguous int64 tensor of shape \[32, any, 9\] .* got torch.int64 \[16, 4, 9\]"
    with pytest.raises(ValueError, match=message):
        interface.forward(q, k, v, mask, 0.1, timeline=torch.zeros(plain, 4, len(Event), dtype=torch.int64))
    stamps = torch.zeros(32, 4, len(Event), dtype=torch.int64)
    interface.forward(q, k, v, mask, 0.1, timeline=stamps)
    assert (
        launched[0][4].segment_tiles and unwrapped(launched[0][5][-3]) is stamps
    )  # (dtype, d, causal, width, config, tensors): the timeline, then the turn profile and the sinks


@pytest.mark.slow  # compiles 52 configurations, ~2.5 min
def test_the_kernels_machine_code_is_as_recorded():
    """Each configuration the host chooses compiles to the machine code recorded in
    tools/sass_fingerprints.json: a refactor leaves them, a kernel change names the ones it touched
    (record them again with `python tools/sass_fingerprints.py --write`)."""
    import json

    import sass_fingerprints

    recorded = json.loads(sass_fingerprints.RECORD.read_text())
    assert sass_fingerprints.differences(recorded, sass_fingerprints.current()) == []


def test_the_fingerprint_reads_only_the_code_sections():
    """An ELF with a `.text.kernel` section among others: only its bytes count."""
    import struct

    import sass_fingerprints

    names = b"\0.shstrtab\0.text.kernel\0.nv.info\0"
    blobs = [b"", names, b"\x01\x02\x03\x04", b"info"]
    name_offsets = [0, 1, 11, 24]
    body, offsets = b"", []
    for blob in blobs:
        offsets.append(64 + len(body))
        body += blob
    section_offset = 64 + len(body)
    header = bytearray(64)
    struct.pack_into("<Q", header, 0x28, section_offset)
    struct.pack_into("<HHH", header, 0x3A, 64, len(blobs), 1)
    sections = b"".join(
        struct.pack("<IIQQQQ", name, 0, 0, 0, offset, len(blob)).ljust(64, b"\0")
        for name, offset, blob in zip(name_offsets, offsets, blobs)
    )
    assert sass_fingerprints.text_sections(bytes(header) + body + sections) == b"\x01\x02\x03\x04"
    assert sass_fingerprints.differences({"a": "1", "b": "2"}, {"a": "1", "b": "3", "c": "4"}) == [
        "changed: b",
        "new: c",
    ]


@pytest.mark.slow  # compiles and disassembles ten forwards, ~50 s
@pytest.mark.parametrize(
    "head_dim, head_dim_v, causal, width",
    [(128, 128, False, 2), (64, 64, False, 2), (192, 128, False, 2), (128, 128, True, 1), (256, 256, True, 1)],
)
def test_counted_key_tiles_leave_the_bounds_out_of_the_kernel(tmp_path, head_dim, head_dim_v, causal, width):
    """`counted_keys` (calls without a mask, or with the causal one alone): the kernel copies no
    bounds (no cp.async at all; the listed build copies a PARTIAL tile's), and its key-tile loop is
    shorter than the listed build's; no local memory, the WGMMAs in flight."""
    loops = {}
    for counted in (False, True):
        name = f"counted_{head_dim}_{causal}_{counted}"
        sass = changed_forward_sass(tmp_path, name, head_dim, causal, width, f"counted_keys={counted}", head_dim_v)
        assert ("LDGSTS" in sass) != counted, name
        blocks, _ = hot_loop_in_registers(sass, name)
        loops[counted] = [inst for _, block in blocks for inst in block]
    assert len(loops[True]) < len(loops[False])


@pytest.mark.slow  # compiles and disassembles eight backwards, ~40 s
@pytest.mark.parametrize(
    "head_dim, head_dim_v, causal, width",
    [(128, 128, False, 2), (128, 128, True, 1), (64, 64, False, 2), (256, 256, True, 1)],
)
def test_counted_query_steps_leave_the_bounds_mask_out_of_the_step(tmp_path, head_dim, head_dim_v, causal, width):
    """`counted_steps` (calls without a mask, or with the causal one alone): no step is masked by
    its keys' bounds, so the step's loop is shorter than the listed build's; no local memory, the
    WGMMAs in flight, as many as the list's."""
    setup = "import dataclasses; from flashmask3.optimized import bwd_config"
    loops, summaries = {}, {}
    for counted in (False, True):
        config = f"dataclasses.replace(bwd_config({head_dim}, {causal}, {width}), counted_steps={counted})"
        args = f"'bf16', {head_dim}, {causal}, {width}, {config}, direction='bwd', head_dim_v={head_dim_v}"
        name = f"counted_steps_{head_dim}_{causal}_{counted}"
        blocks, summary = hot_loop_in_registers(compiled_sass(tmp_path, name, "FlashMaskBackward", args, setup), name)
        loops[counted] = [inst for _, block in blocks for inst in block]
        summaries[counted] = [part for part in summary.split(",") if "HGMMA" in part]
    assert summaries[True] == summaries[False]
    assert len(loops[True]) < len(loops[False])
