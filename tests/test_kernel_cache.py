"""The kernel cache: compiled kernels kept on disk and loaded by a new process, filled without a GPU."""

import math
import os
import subprocess
import sys

import pytest
import torch
from flashmask3.optimized import config, interface, kernel_cache
from flashmask3.reference import masks
from flashmask3.verify import random_inputs

from flashmask3.precompile import main as precompile_main
from flashmask3.precompile import parse_head_dims


def precompile(cache, *arguments: str) -> str:
    """`python -m flashmask3.precompile --cache cache ...` in a fresh process; its last line."""
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a")
    done = subprocess.run(
        [sys.executable, "-m", "flashmask3.precompile", "--cache", str(cache), *arguments],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


def test_a_new_process_loads_the_kernels_a_first_one_compiled(tmp_path):
    workload = ("--masks", "causal_document", "--seqlens", "512", "--head-dims", "64", "--heads", "2")
    first = precompile(tmp_path, *workload)
    assert first.startswith("4 kernels: 4 compiled, 0 loaded"), first  # forward, backward and its two
    entries = list(tmp_path.glob("*/*.o"))
    assert len(entries) == 4 and all(entry.stat().st_size > 10_000 for entry in entries)
    second = precompile(tmp_path, *workload)
    assert second.startswith("4 kernels: 0 compiled, 4 loaded"), second
    assert sorted(tmp_path.glob("*/*.o")) == sorted(entries)


def test_precompiling_causal_takes_the_mask_and_the_causal_call_alone(tmp_path):
    """`--masks causal`: the forward of the causal mask given as a mask (its key tiles listed) and
    that of `attention(..., causal=True)` (counted), two kernels."""
    workload = ("--masks", "causal", "--seqlens", "512", "--head-dims", "128", "--heads", "2", "--forward-only")
    first = precompile(tmp_path, *workload)
    assert first.startswith("2 kernels: 2 compiled, 0 loaded"), first
    assert len(list(tmp_path.glob("*/*.o"))) == 2


def test_an_entry_that_cannot_be_loaded_is_a_miss(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHMASK3_KERNEL_CACHE", str(tmp_path))
    key = ("fwd", torch.bfloat16, 128, None, True, 1, config.fwd_config(128, True, 1), False, (False,), 64)
    path = kernel_cache.entry_path(key)
    path.parent.mkdir(parents=True)
    path.write_bytes(b"not an object file")
    assert kernel_cache.load(key) is None


def test_entries_are_named_by_every_choice_of_the_key(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHMASK3_KERNEL_CACHE", str(tmp_path))
    chosen = config.fwd_config(128, True, 1)
    key = ("fwd", torch.bfloat16, 128, None, True, 1, chosen, False, (False,), 64)
    path = kernel_cache.entry_path(key)
    assert path.parent == tmp_path / kernel_cache.fingerprint() and path.suffix == ".o"
    assert kernel_cache.entry_path(key) == path
    other_stages = (*key[:6], config.apply_overrides(chosen, {"num_stages": chosen.num_stages + 1}), *key[7:])
    others = [(*key[:1], torch.float16, *key[2:]), (*key[:4], False, *key[5:]), other_stages, (*key[:8], (True,), 64)]
    assert len({kernel_cache.entry_path(k) for k in others} | {path}) == 5


@pytest.mark.parametrize("setting", ["off", "OFF", "0", "false"])
def test_the_cache_is_turned_off_by_its_variable(monkeypatch, setting):
    monkeypatch.setenv("FLASHMASK3_KERNEL_CACHE", setting)
    assert kernel_cache.cache_root() is None
    assert kernel_cache.entry_path(("fwd",)) is None and kernel_cache.load(("fwd",)) is None


@pytest.mark.parametrize("setting", [None, ""])
def test_the_cache_defaults_to_the_user_cache_directory(monkeypatch, tmp_path, setting):
    if setting is None:
        monkeypatch.delenv("FLASHMASK3_KERNEL_CACHE", raising=False)
    else:
        monkeypatch.setenv("FLASHMASK3_KERNEL_CACHE", setting)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert kernel_cache.cache_root() == tmp_path / "flashmask3" / "kernels"


def test_a_kernel_that_cannot_be_written_warns_and_runs_uncached(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("FLASHMASK3_KERNEL_CACHE", str(blocker))  # a file where the directory would be
    with pytest.warns(UserWarning, match="not cached"):
        assert kernel_cache.store(("fwd",), object()) is None


def test_compile_only_launches_nothing_and_keeps_what_it_compiled(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHMASK3_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr(interface, "_compiled", {})
    q, k, v, _ = random_inputs(1, 256, 256, 2, 1, 64, torch.bfloat16, "cpu", seed=3)
    mask = masks.build("causal", 256, seed=3)
    out = torch.full((1, 256, 2, 64), math.nan, dtype=torch.bfloat16)
    with interface.compile_only(sm_count=8):
        interface.forward(q, k, v, mask, 0.125, out=out)
    assert out.isnan().all()  # nothing ran
    (key,) = interface._compiled
    assert key[0] == "fwd" and kernel_cache.entry_path(key).is_file()


def test_compile_only_refuses_a_bad_sm_count_and_nesting():
    with pytest.raises(ValueError, match="sm_count must be a positive number of SMs, got 0"):
        with interface.compile_only(sm_count=0):
            pass
    with interface.compile_only():
        with pytest.raises(RuntimeError, match="compile_only is already active"):
            with interface.compile_only():
                pass
    assert interface._compile_only_sms is None


def test_precompile_names_the_bad_argument(tmp_path, capsys):
    assert precompile_main(["--cache", str(tmp_path), "--head-dims", "100"]) == 2
    assert "head dims (q/k, v)" in capsys.readouterr().err
    assert precompile_main(["--cache", str(tmp_path), "--dtypes", "fp32"]) == 2
    assert "dtype 'fp32' is not one the kernels take; accepted: bf16, fp16" in capsys.readouterr().err
    assert precompile_main(["--cache", str(tmp_path), "--masks", "diagonal"]) == 2
    assert "unknown mask name 'diagonal'; accepted: none, full" in capsys.readouterr().err
    assert precompile_main(["--cache", str(tmp_path), "--seqlens", "8k"]) == 2
    assert "--seqlens takes lengths separated by commas" in capsys.readouterr().err
    assert precompile_main(["--cache", "off"]) == 2
    assert "FLASHMASK3_KERNEL_CACHE is off: pass --cache DIR" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_precompile_with_sinks_builds_the_forward_that_takes_them(monkeypatch):
    """`--sinks`: each forward is the build with the heads' sink logits (its key has the sinks
    argument where the plain one has none), which a model with sinks launches."""
    from flashmask3.precompile import precompile as precompile_workload

    keys = []
    monkeypatch.setenv("FLASHMASK3_KERNEL_CACHE", "off")
    monkeypatch.setattr(interface, "_compiled", {})
    monkeypatch.setattr(interface, "_compile", lambda key, *rest: keys.append(key) or object())
    for sinks in (False, True):
        precompile_workload(["causal"], [256], [(64, 64)], ["bf16"], backward=False, sinks=sinks)
    # (direction, dtype, head dim, ..., the arguments' layouts, ...): the last argument is the sinks
    assert [key[:3] for key in keys] == [("fwd", torch.bfloat16, 64)] * 2
    assert [key[8][-1] for key in keys] == [None, 0]


def test_head_dims_are_parsed_as_pairs():
    assert parse_head_dims("128,192/128, 64") == [(128, 128), (192, 128), (64, 64)]
    with pytest.raises(ValueError, match="--head-dims takes D or D/DV items"):
        parse_head_dims("128/64/32")


def _capture_compiles(monkeypatch) -> list[tuple]:
    """Each `interface._compile` call's arguments from now on, the in-memory and disk caches off."""
    calls = []
    compile_kernel = interface._compile

    def spy(*arguments):
        calls.append(arguments)
        return compile_kernel(*arguments)

    monkeypatch.setenv("FLASHMASK3_KERNEL_CACHE", "off")
    monkeypatch.setattr(interface, "_compiled", {})
    monkeypatch.setattr(interface, "_compile", spy)
    return calls


def _gpu_inputs(name="causal_document", d=128, seqlen=1024):
    q, k, v, dout = random_inputs(2, seqlen, seqlen, 4, 2, d, torch.bfloat16, "cuda", seed=5)
    return (q, k, v, dout), masks.build(name, seqlen, batch=2, heads=4, seed=5, device="cuda")


@pytest.mark.gpu
def test_kernels_compiled_from_stand_ins_are_those_compiled_from_the_tensors(monkeypatch):
    """The launch compiles each kernel for `_compile_operand`'s stand-ins, which a machine without
    a GPU can build too: with the tensors themselves in place of the stand-ins of the arguments
    passed with runtime strides (all but the `Contiguous` ones), the SASS is the same."""
    import cutlass.cute as cute
    from cutlass import Float32, Int32
    from cutlass.cute.runtime import from_dlpack
    from sass_fingerprints import text_sections

    calls = _capture_compiles(monkeypatch)
    (q, k, v, dout), mask = _gpu_inputs()
    out, lse = interface.forward(q, k, v, mask, 0.1)
    interface.backward(dout, q, k, v, out, lse, mask, 0.1)
    assert [call[0][0] for call in calls] == ["fwd", "bwd_pre", "bwd", "bwd_post"]

    def from_tensor(t):
        if isinstance(t, interface.Contiguous):
            return interface._compile_operand(t)
        return from_dlpack(t.detach(), assumed_align=16, enable_tvm_ffi=True).mark_layout_dynamic(t.dim() - 1)

    for key, tensors, scalars, deterministic, head_dim_v, query_tile in calls:
        direction, dtype, head_dim, _, causal, width, kernel_config = key[:7]
        sass = []
        for operand in (interface._compile_operand, from_tensor):
            kernel = interface._make_kernel(
                "bf16", head_dim, causal, width, kernel_config, direction, deterministic, head_dim_v, query_tile
            )
            arguments = [None if t is None else operand(t) for t in tensors]
            arguments += [Float32(x) if isinstance(x, float) else Int32(x) for x in scalars]
            stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
            compiled = cute.compile(kernel, *arguments, stream, options="--enable-tvm-ffi --keep-cubin")
            sass.append(text_sections(compiled.__cubin__))
        assert sass[0] == sass[1], direction


@pytest.mark.gpu
def test_a_kernel_loaded_from_the_cache_computes_what_the_compiled_one_does(tmp_path, monkeypatch):
    (q, k, v, dout), mask = _gpu_inputs("share_question")
    monkeypatch.setenv("FLASHMASK3_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr(interface, "_compiled", {})
    monkeypatch.setattr(interface, "loaded_keys", set())
    scale = 1 / math.sqrt(q.shape[-1])

    def run():
        out, lse = interface.forward(q, k, v, mask, scale)
        return (out, lse, *interface.backward(dout, q, k, v, out, lse, mask, scale, deterministic=True))

    compiled = run()
    assert len(list(tmp_path.glob("*/*.o"))) == 4 and not interface.loaded_keys
    monkeypatch.setattr(interface, "_compiled", {})  # as in a new process
    loaded = run()
    assert len(interface.loaded_keys) == 4
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), compiled, loaded):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("sm_count", [4, 132])  # long grids (work orders) and short ones (split CTAs)
@pytest.mark.parametrize("head_dims", [(128, 128), (192, 128), (64, 64)])
def test_the_contiguous_arguments_are_built_contiguous(monkeypatch, sm_count, head_dims):
    """Each `Contiguous` argument (compiled compact, its last extent fixed by the key) is contiguous
    as the host builds it, so the launch copies none, over every mask and head dim."""
    launched = []

    def fake_launch(direction, dtype, head_dim, causal, width, config, tensors, *rest, **options):
        launched.append(direction)
        for t in tensors:
            if isinstance(t, interface.Contiguous):
                assert t.tensor.is_contiguous()

    copies = []

    def passed_as_built(t):  # `_contiguous` without its copy, noting where one would be made
        if t is None:
            return None
        copies.append(not t.is_contiguous())
        return interface.Contiguous(t)

    monkeypatch.setattr(interface, "_launch", fake_launch)
    monkeypatch.setattr(interface, "_contiguous", passed_as_built)
    d, dv = head_dims
    q, k, v, dout = random_inputs(2, 640, 640, 4, 2, d, torch.bfloat16, "cpu", seed=1, head_dim_v=dv)
    for name in masks.MASK_NAMES:
        mask = masks.build(name, 640, batch=2, heads=4, seed=1)
        with interface.compile_only(sm_count):
            out, lse = interface.forward(q, k, v, mask, 0.1)
            interface.backward(dout, q, k, v, out, lse, mask, 0.1)
    assert launched.count("bwd") == len(masks.MASK_NAMES) and not any(copies)


def test_prune_removes_the_folders_of_other_versions_only(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHMASK3_KERNEL_CACHE", str(tmp_path))
    current = tmp_path / kernel_cache.fingerprint()
    current.mkdir()
    (current / "kept.o").write_bytes(b"x")
    for old in ("0123456789abcdef0123", "fedcba9876543210fedc"):
        (tmp_path / old).mkdir()
        (tmp_path / old / "stale.o").write_bytes(b"x")
    assert sorted(p.name for p in kernel_cache.prune()) == ["0123456789abcdef0123", "fedcba9876543210fedc"]
    assert [p.name for p in tmp_path.iterdir()] == [current.name] and (current / "kept.o").exists()
    monkeypatch.setenv("FLASHMASK3_KERNEL_CACHE", "off")
    assert kernel_cache.prune() == []
