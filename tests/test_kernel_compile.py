"""The CuTe DSL forward and backward kernels compile for sm_90a without a GPU (fake tensors), every config."""

import pytest

cutlass = pytest.importorskip("cutlass", reason="nvidia-cutlass-dsl not installed")


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal, width", [(True, 1), (True, 2), (False, 2), (False, 4)])
def test_forward_kernel_compiles_for_sm90a(dtype, head_dim, causal, width):
    from flashmask3.optimized import compile_check

    seconds = compile_check(dtype, head_dim, causal, width)
    assert 0 < seconds < 120


def test_unsupported_head_dim_is_refused():
    from flashmask3.optimized.flash_fwd_sm90 import FlashMaskForwardSm90

    with pytest.raises(ValueError, match="head_dim must be 64 or 128"):
        FlashMaskForwardSm90(cutlass.BFloat16, 96, True, 1)


@pytest.mark.parametrize(
    "changes", [dict(num_stages=3), dict(pingpong=False), dict(setmaxnreg=False), dict(intra_wg_overlap=False),
                dict(intra_wg_overlap=False, pingpong=False), dict(tma_store=False),
                dict(k_ahead=False), dict(k_ahead=False, num_stages=3, tma_store=False),
                dict(entry_ahead=False), dict(bounds_prefetch=False)]
)
def test_ablation_variants_compile(changes):
    from flashmask3.optimized import KernelOptions, compile_check

    assert compile_check("bf16", 128, True, 1, KernelOptions(**changes)) > 0


@pytest.mark.parametrize(
    "changes", [dict(q_tile_192=False), dict(pingpong=False), dict(intra_wg_overlap=False), dict(num_stages=3)]
)
def test_head_dim_64_variants_compile(changes):
    """Head dim 64 defaults to 192-row query tiles on three consumer warpgroups; the 128-row shape
    and the ablation switches that change the consumers' loop compile with it too."""
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

    with kernel_options(pingpong=False, skip_tiles=False) as opts:
        assert not opts.pingpong and interface.options is opts
    assert interface.options.pingpong and interface.options.skip_tiles
    with pytest.raises(ValueError, match="num_stages must be 2 or 3"):
        with kernel_options(num_stages=5):
            pass


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


@pytest.mark.parametrize("deterministic", [False, True])
def test_backward_with_dq_writer_compiles(deterministic):
    """`dq_writer`: warp 2 issues the dQ reduce-adds behind full/empty named barriers."""
    from flashmask3.optimized import KernelOptions, compile_check

    assert compile_check("bf16", 128, False, 2, KernelOptions(dq_writer=True), direction="bwd",
                         deterministic=deterministic) > 0
