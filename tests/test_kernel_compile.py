"""The CuTe DSL forward and backward kernels compile for sm_90a without a GPU (fake tensors), every config."""

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


def test_forward_tile_rows_follow_the_head_dim_and_q_tile_192():
    """The query rows per forward CTA that the overhead fit divides by: 192 only at head dim 64."""
    from flashmask3.optimized import kernel_options
    from flashmask3.optimized.interface import forward_tile_rows

    assert (forward_tile_rows(64), forward_tile_rows(128)) == (192, 128)
    with kernel_options(q_tile_192=False):
        assert forward_tile_rows(64) == 128


def test_unsupported_head_dim_is_refused():
    from flashmask3.optimized.flash_fwd_sm90 import FlashMaskForwardSm90

    with pytest.raises(ValueError, match="head_dim must be 64 or 128"):
        FlashMaskForwardSm90(cutlass.BFloat16, 96, True, 1)


@pytest.mark.parametrize("changes", [dict(num_stages=3), dict(persistent=False)])
def test_forward_configs_compile(changes):
    """Three K/V stages; `persistent=False` changes only the grid (one CTA per work tile), which the
    launch decides: the same kernel compiles."""
    from flashmask3.optimized import KernelOptions, compile_check

    assert compile_check("bf16", 128, True, 1, KernelOptions(**changes)) > 0


@pytest.mark.parametrize("changes", [dict(q_tile_192=False), dict(num_stages=3)])
def test_head_dim_64_variants_compile(changes):
    """Head dim 64 defaults to 192-row query tiles on three consumer warpgroups; the 128-row shape
    and three stages compile with it too."""
    from flashmask3.optimized import KernelOptions, compile_check

    assert compile_check("fp16", 64, False, 4, KernelOptions(**changes)) > 0


@pytest.mark.parametrize("causal,width", [(True, 1), (False, 4)])
def test_forward_without_bounds_prefetch_compiles_for_every_mask_variant(causal, width):
    """The element mask reading the 1, 2 or 4 boundaries per key column from global memory (the
    default cp.asyncs them into smem a tile ahead)."""
    from flashmask3.optimized import KernelOptions, compile_check

    assert compile_check("bf16", 128, causal, width, KernelOptions(bounds_prefetch=False)) > 0


def test_kernel_options_are_validated_and_restored():
    from flashmask3.optimized import interface, kernel_options

    with kernel_options(persistent=False, skip_tiles=False) as opts:
        assert not opts.persistent and interface.options is opts
    assert interface.options.persistent and interface.options.skip_tiles
    with pytest.raises(ValueError, match="num_stages must be 2 or 3"):
        with kernel_options(num_stages=5):
            pass


@pytest.mark.slow  # 16 compiles, ~30 s
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal, width", [(True, 1), (True, 2), (False, 2), (False, 4)])
def test_backward_kernel_compiles_for_sm90a(dtype, head_dim, causal, width):
    from flashmask3.optimized import compile_check

    assert 0 < compile_check(dtype, head_dim, causal, width, direction="bwd") < 120


def test_deterministic_backward_compiles_for_sm90a():
    from flashmask3.optimized import compile_check

    assert compile_check("bf16", 128, False, 4, direction="bwd", deterministic=True) > 0


def test_backward_without_lse_ahead_compiles():
    """`lse_ahead=False`: the backward reads the LSE from smem after the S GEMM (the v8 loop)."""
    from flashmask3.optimized import KernelOptions, compile_check

    assert compile_check("bf16", 128, True, 1, KernelOptions(lse_ahead=False), direction="bwd") > 0


@pytest.mark.parametrize("causal,width,deterministic", [(True, 1, False), (False, 4, False), (False, 2, True)])
def test_backward_with_128_row_steps_compiles_at_head_dim_64(causal, width, deterministic):
    """`bwd_q_tile_128`: 128 query rows per backward step at head dim 64 (pre/post kernels included)."""
    from flashmask3.optimized import KernelOptions, compile_check

    opts = KernelOptions(bwd_q_tile_128=True)
    assert compile_check("fp16", 64, causal, width, opts, direction="bwd", deterministic=deterministic) > 0


def test_backward_tile_rows_and_their_limit():
    """128-row backward steps only at head dim 64 (at 128, S^T and dP^T would not fit beside dK, dV)."""
    from flashmask3.optimized import KernelOptions
    from flashmask3.optimized.flash_bwd_sm90 import FlashMaskBackwardSm90
    from flashmask3.optimized.interface import backward_tile_rows

    opts = KernelOptions(bwd_q_tile_128=True)
    assert (backward_tile_rows(64), backward_tile_rows(128)) == (64, 64)
    assert (backward_tile_rows(64, opts), backward_tile_rows(128, opts)) == (128, 64)
    with pytest.raises(ValueError, match="tile_m must be 64, or 128 at head_dim 64"):
        FlashMaskBackwardSm90(cutlass.BFloat16, 128, True, 1, tile_m=128)


@pytest.mark.parametrize("direction", ["fwd", "bwd"])
def test_kernels_compile_for_the_tvm_ffi_launch(direction):
    """`tvm_ffi`: compiled with --enable-tvm-ffi and the env stream, to take torch tensors directly."""
    pytest.importorskip("tvm_ffi", reason="apache-tvm-ffi not installed")
    from flashmask3.optimized import KernelOptions, compile_check

    assert compile_check("bf16", 128, True, 1, KernelOptions(tvm_ffi=True), direction=direction) > 0


@pytest.mark.parametrize("tvm_ffi", [False, True])
def test_launch_compiles_once_and_passes_what_each_launch_path_takes(monkeypatch, tvm_ffi):
    """`_launch` (CPU plumbing, the compiled function faked): one compile per configuration; the
    DLPack path passes DSL tensors, typed scalars and the torch stream, the TVM-FFI path the torch
    tensors and Python scalars as they are (its stream is the env stream)."""
    import cutlass.cute as cute
    import torch
    from flashmask3.optimized import interface, kernel_options

    compiled, calls = [], []

    def fake_compile(kernel, *args, **flags):
        compiled.append((type(kernel).__name__, args, flags))
        return lambda *call_args: calls.append(call_args)

    monkeypatch.setattr(cute, "compile", fake_compile)
    monkeypatch.setattr(interface, "_torch_stream", lambda device: "torch stream")
    monkeypatch.setattr(interface, "_compiled", {})
    out, dq = torch.zeros(2, 8, 2, 64, dtype=torch.float32), torch.zeros(2, 8, 2, 64, dtype=torch.bfloat16)
    with kernel_options(tvm_ffi=tvm_ffi):
        for _ in range(2):
            interface._launch("bwd_post", torch.bfloat16, 64, False, 2, [out, dq], [0.125])
    ((name, args, flags),) = compiled
    assert name == "BackwardPostprocess" and len(args) == 4 and len(calls) == 2
    if tvm_ffi:
        assert flags == {"options": "--enable-tvm-ffi"}
        assert calls[1][0] is not out and calls[1][0].data_ptr() == out.data_ptr() and calls[1][2:] == (0.125,)
        assert len(calls[1]) == 3
    else:
        assert flags == {} and args[-1] == "torch stream" and calls[1][-1] == "torch stream"
        assert not isinstance(calls[1][0], torch.Tensor) and len(calls[1]) == 4


_SERIALIZATION_CASES = {  # name: (kernel, compile_check arguments)
    "fwd": ("FlashMaskForward", "'bf16', 128, True, 1"),
    "bwd": ("FlashMaskBackward", "'bf16', 128, False, 2, direction='bwd'"),
    "bwd_q_tile_128": ("FlashMaskBackward", "'bf16', 64, False, 2, KernelOptions(bwd_q_tile_128=True), 'bwd'"),
}


@pytest.mark.slow  # compiles and disassembles every kernel, ~17 s
def test_default_kernels_keep_their_wgmmas_in_flight(tmp_path):
    """ptxas serializes every WGMMA when registers run short (its C7512 warning: an arrive and a wait
    around each HGMMA); a kernel built that way measured 1-9% off while looking correct
    (`bwd_q_tile_128`, `s_ahead`). The default forward and backward main loops must keep theirs in
    flight; `bwd_q_tile_128` (known serialized) shows the check sees it. SASS from the compiled cubins
    by nvdisasm (the nvidia-cuda-nvdisasm wheel, a dev extra)."""
    import importlib.util
    import os
    import subprocess
    import sys
    from pathlib import Path

    spec = importlib.util.find_spec("nvidia")
    packages = (spec.submodule_search_locations or []) if spec else []
    candidates = [Path(p) / "cu13" / "bin" / "nvdisasm" for p in packages]
    nvdisasm = next((c for c in candidates if c.exists()), None)
    if nvdisasm is None:
        pytest.skip("nvdisasm not installed (pip install nvidia-cuda-nvdisasm)")
    import sass_path

    summaries = {}
    for name, (kernel, args) in _SERIALIZATION_CASES.items():
        (tmp_path / name).mkdir()
        env = dict(os.environ, CUTE_DSL_ARCH="sm_90a", CUTE_DSL_KEEP="cubin", CUTE_DSL_DUMP_DIR=str(tmp_path / name))
        code = f"from flashmask3.optimized.interface import KernelOptions, compile_check; compile_check({args})"
        subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True, timeout=600)
        (cubin,) = (tmp_path / name).glob(f"*{kernel}Sm90*.cubin")
        sass = subprocess.run([str(nvdisasm), "-c", str(cubin)], check=True, capture_output=True, text=True).stdout
        summaries[name] = sass_path.loop_summary(sass_path.hot_loop(sass_path.read_blocks(sass.splitlines())))
    assert "serialized" not in summaries["fwd"] and "serialized" not in summaries["bwd"], summaries
    assert summaries["bwd_q_tile_128"].endswith("the WGMMAs are serialized)"), summaries


def test_forward_timeline_build_compiles():
    """The debugging build that stamps each role's events (`optimized/timeline.py`); the default build
    has none of it."""
    from flashmask3.optimized import compile_check

    assert compile_check("bf16", 64, False, 4, timeline=True) > 0
