"""Bad input wherever a user can reach: each error names the argument and the accepted values."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from flashmask3.reference import ColumnMask, masks
from flashmask3.verify.__main__ import main as verify_main
from hydra import compose, initialize_config_module

import flashmask3 as fm
from flashmask3.experiment import run_experiment


def config(overrides):
    with initialize_config_module(version_base="1.3", config_module="flashmask3.conf"):
        return compose(config_name="config", overrides=overrides)


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
        ColumnMask.global_sliding_window(256, window=0, global_tokens=4)
    )
    assert masks.build("document", 256, num_docs=256).to_dense()[0, 0].equal(torch.eye(256, dtype=torch.bool))
    assert masks.build("prefix_lm_causal", 256, prefix=256).to_dense().all()
    evict_none = masks.build("random_eviction", 256, evict_start=256)
    assert evict_none.to_dense()[0, 0].equal(torch.ones(256, 256, dtype=torch.bool).tril())
    assert masks.build("random_eviction", 256, evict_start=1).to_dense()[0, 0, 255].sum() == 1


def qkv(batch=1, sq=8, sk=8, hq=2, hkv=2, d=16):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(batch, sq, hq, d, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(batch, sk, hkv, d, generator=gen, dtype=torch.float64) for _ in range(2))
    return q, k, v


@pytest.mark.parametrize("backend", ["auto", "reference", "sdpa", "flex", "cute"])
@pytest.mark.parametrize("form", ["no mask", "mask", "causal", "window"])
def test_no_keys_give_zero_and_minus_inf_on_every_backend(backend, form):
    q, k, v = (x.requires_grad_() for x in qkv(sk=0))
    kwargs = {
        "no mask": {},
        "mask": {"mask": ColumnMask(torch.zeros(1, 1, 0, 1, dtype=torch.int32), True, 8)},
        "causal": {"causal": True},
        "window": {"window_size": (2, 2)},
    }[form]
    out, lse = fm.attention(q, k, v, backend=backend, return_lse=True, **kwargs)
    assert out.shape == q.shape and not out.any() and lse.shape == (1, 2, 8) and (lse == -torch.inf).all()
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    assert not dq.any() and dk.shape == k.shape and dv.shape == v.shape


@pytest.mark.parametrize("backend", ["auto", "reference", "sdpa", "flex"])
@pytest.mark.parametrize("form", ["no mask", "mask", "causal", "window"])
def test_empty_batch_and_queries_give_empty_results(backend, form):
    for q, k, v in (qkv(batch=0), qkv(sq=0)):
        kwargs = {
            "no mask": {},
            "mask": {"mask": masks.build("causal", q.shape[1], batch=1) if q.shape[1] else None},
            "causal": {"causal": True},
            "window": {"window_size": (2, 2)},
        }[form]
        out, lse = fm.attention(q, k, v, backend=backend, return_lse=True, **kwargs)
        assert out.shape == q.shape and lse.shape == (q.shape[0], 2, q.shape[1])


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"softmax_scale": float("nan")}, ValueError, "softmax_scale must be a positive finite float, got nan"),
        ({"softmax_scale": float("inf")}, ValueError, "softmax_scale must be a positive finite float, got inf"),
        ({"softmax_scale": 0.0}, ValueError, "softmax_scale must be a positive finite float, got 0.0"),
        ({"softmax_scale": -0.5}, ValueError, "softmax_scale must be a positive finite float, got -0.5"),
        ({"softmax_scale": torch.tensor(0.5)}, TypeError, r"softmax_scale must be a float .*got Tensor; pass float"),
        ({"softmax_scale": "0.1"}, TypeError, r"softmax_scale must be a float or None \(1/sqrt\(D\)\), got str"),
        ({"softmax_scale": True}, TypeError, "softmax_scale must be a float or None"),
        ({"return_lse": "no"}, TypeError, "return_lse must be a bool, got str"),
        ({"deterministic": 1}, TypeError, "deterministic must be a bool, got int"),
    ],
)
def test_scale_and_flags_are_checked(kwargs, error, match):
    with pytest.raises(error, match=match):
        fm.attention(*qkv(), **kwargs)
    with pytest.raises(error, match=match):
        cu = torch.tensor([0, 8])
        fm.varlen_attention(*(x[0] for x in qkv()), cu, cu, 8, 8, **kwargs)


def test_a_numpy_scale_is_a_float():
    import numpy as np

    q, k, v = qkv()
    torch.testing.assert_close(
        fm.attention(q, k, v, softmax_scale=np.float32(0.5)), fm.attention(q, k, v, softmax_scale=0.5)
    )


def test_numpy_ints_are_taken_as_plain_ints_everywhere():
    """One rule for integer arguments: Python and numpy ints, stored as a plain int."""
    mask = ColumnMask.sliding_window(np.int64(50), np.int32(5))
    assert type(mask.seqlen_q) is int and mask.seqlen_q == 50
    again = ColumnMask(mask.startend_row_indices, mask.causal, mask.seqlen_q)
    assert again == mask and type(again.seqlen_q) is int
    from_numpy = ColumnMask(mask.startend_row_indices, mask.causal, np.int64(50))
    assert from_numpy == mask and type(from_numpy.seqlen_q) is int
    built = masks.build("causal", np.int64(10), batch=np.int64(2), heads=np.int8(3), seed=np.uint8(1))
    assert built == masks.build("causal", 10, batch=2) and type(built.seqlen_q) is int
    assert masks.build("sliding_window", 64, window=np.int64(4)) == masks.build("sliding_window", 64, window=4)
    q, k, v = qkv(sq=12, sk=12)
    windowed = fm.attention(q, k, v, causal=True, window_size=(np.int64(3), np.int32(0)))
    assert torch.equal(windowed, fm.attention(q, k, v, causal=True, window_size=(3, 0)))
    assert not torch.equal(windowed, fm.attention(q, k, v, causal=True))  # the window mattered


@pytest.mark.parametrize(
    "call, match",
    [
        (
            lambda: ColumnMask(torch.full((1, 1, 4, 1), 4, dtype=torch.int32), True, True),
            "seqlen_q must be an int >= 1",
        ),
        (lambda: masks.build("causal", True), "seqlen must be an int >= 2, got True"),
        (lambda: masks.build("causal", 64, batch=np.bool_(True)), "batch must be an int >= 1"),
        (
            lambda: masks.build("sliding_window", 64, window=True),
            r"window \(mask 'sliding_window', seqlen 64\) must be",
        ),
        (lambda: ColumnMask.sliding_window(64, True), "window must be an int >= 1, got True"),
        (lambda: fm.attention(*qkv(), causal=True, window_size=(True, 0)), r"window_size must be a pair .*\(True, 0\)"),
    ],
)
def test_bools_are_not_ints(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_paddle_entry_checks_query_before_reading_its_mask():
    q, k, v = qkv()
    rows = masks.build("causal_document", 8).startend_row_indices
    with pytest.raises(ValueError, match=r"query must be 4-D \[B, S, H, D\], got shape \(8, 2, 16\)"):
        fm.flashmask_attention(q[0], k[0], v[0], rows, causal=True)
    with pytest.raises(TypeError, match="query, key, value must share a dtype"):
        fm.flashmask_attention(q.float(), k, v, rows, causal=True)
    out = fm.flashmask_attention(q[:, :0], k, v, rows, causal=True)  # no query row: nothing to mask
    assert out.shape == (1, 0, 2, 16)


def test_cp_attention_checks_its_inputs_by_name(tmp_path):
    """Checked before any communication, on a one-rank gloo group: the same rules as attention's."""
    import torch.distributed as dist
    from flashmask3.distributed import CPConfig, cp_attention, make_plan

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        plan, mask = make_plan(64, 1), masks.build("causal_document", 64)
        q = k = torch.randn(1, 64, 4, 16, dtype=torch.float64)
        bad = [
            ((q.long(), k.long(), k.long(), mask, plan), TypeError, "q_local dtype must be one of bf16, fp16"),
            ((q.float(), k, k, mask, plan), TypeError, "q_local, k_local, v_local must share a dtype"),
            ((q, k[:, :, :3], k[:, :, :3], mask, plan), ValueError, r"q_local heads \(4\) must be a multiple of"),
            ((q, k[..., :8], k[..., :8], mask, plan), ValueError, "q_local and k_local must have the same head dim"),
            ((q, k, k, None, plan), TypeError, "mask must be a ColumnMask, got NoneType"),
            ((q, k, k, mask, plan, None, {"scheme": "ring"}), TypeError, "config must be a CPConfig, got dict"),
            ((q, k, k, masks.build("random_eviction", 64, heads=3), plan), ValueError, "head dim must be"),
            ((q, k, k, masks.build("causal_document", 64, batch=3), plan), ValueError, "batch dim must be"),
            ((q, k, k, mask, plan, None, CPConfig(), float("nan")), ValueError, "softmax_scale must be a positive"),
        ]
        for args, error, match in bad:
            with pytest.raises(error, match=match):
                cp_attention(*args)
        out = cp_attention(q, k, k, mask, plan)
        torch.testing.assert_close(out, fm.attention(q, k, k, mask), rtol=1e-10, atol=1e-10)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "shapes, match",
    [
        ({"d": 0}, r"q head dim \(D of \[B, S, H, D\]\) must be >= 1, got shape \(1, 8, 2, 0\)"),
        ({"hq": 0, "hkv": 0}, r"q heads \(H of \[B, S, H, D\]\) must be >= 1, got shape \(1, 8, 0, 16\)"),
        ({"hkv": 0}, r"k heads \(H of \[B, S, H, D\]\) must be >= 1, got shape \(1, 8, 0, 16\)"),
    ],
)
def test_zero_heads_or_head_dim_are_refused_by_name(shapes, match):
    with pytest.raises(ValueError, match=match):
        fm.attention(*qkv(**shapes))


def test_a_dense_mask_points_to_from_dense():
    q, k, v = qkv()
    with pytest.raises(TypeError, match=r"got a torch.bool tensor of shape \(8, 8\); .*ColumnMask.from_dense"):
        fm.attention(q, k, v, torch.ones(8, 8, dtype=torch.bool))


def test_mask_batch_and_head_errors_list_each_accepted_count_once():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="startend_row_indices batch dim must be 1, got 2$"):
        fm.attention(q, k, v, masks.build("causal", 8, batch=2))
    with pytest.raises(ValueError, match=r"head dim must be 1 or 2 \(q heads\), got 3$"):
        fm.attention(q, k, v, masks.build("random_eviction", 8, heads=3))
    with pytest.raises(ValueError, match=r"head dim must be 1, 2 \(kv heads\) or 4 \(q heads\), got 3$"):
        fm.attention(*qkv(hq=4), masks.build("random_eviction", 8, heads=3))


def test_cute_on_a_gpu_that_is_not_hopper_names_its_capability(monkeypatch):
    from types import SimpleNamespace

    from flashmask3.optimized import interface

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    q = SimpleNamespace(
        is_cuda=True, device="cuda:0", dtype=torch.bfloat16, shape=(1, 128, 2, 128), requires_grad=False
    )
    with pytest.raises(
        NotImplementedError, match=r"Hopper GPU \(sm_90\), got NVIDIA A100.*compute capability 8.0 \(sm_80\)"
    ):
        interface.cute_attention(q, q, q, None, 0.1)


def run_main(tmp_path, *overrides, multirun=False):
    cmd = [
        sys.executable,
        "-m",
        "flashmask3",
        *(["-m"] if multirun else []),
        *overrides,
        f"logging.out_dir={tmp_path}/runs",
        f"hydra.run.dir={tmp_path}/hydra",
        f"hydra.sweep.dir={tmp_path}/sweep",
    ]
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    return subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the message of a machine without a GPU")
def test_main_job_without_a_gpu_says_so_in_one_line(tmp_path):
    result = run_main(tmp_path, "backend=cute")  # which sets device=cuda
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"error: device=cuda, but torch {torch.__version__} sees no CUDA GPU: on the CPU use backend=reference, "
        "sdpa or flex with device=cpu (backend=cute and backend=flex_cuda set device=cuda)"
    ]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the message of a machine without a GPU")
def test_gpu_sweep_without_a_gpu_stops_before_its_first_job(tmp_path):
    """One line for the whole kernel ablation (20 jobs), none launched, not one line per job."""
    result = run_main(tmp_path, "+experiment=kernel_ablation", multirun=True)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"error: every job of this sweep runs with backend=cute device=cuda, but torch {torch.__version__} sees no "
        "CUDA GPU, so none was launched: run it on a machine with a Hopper GPU (sm_90) and the gpu extra "
        '(pip install -e ".[experiments,gpu]")'
    ]
    assert "Launching" not in result.stdout and not (tmp_path / "sweep").exists()


@pytest.mark.parametrize(
    "sweep, refused",
    [
        ([], True),
        (["mask=causal,full"], True),
        (["backend=reference,cute"], False),  # the reference jobs run on the CPU
        (["device=cpu,cuda"], False),
    ],
)
def test_gpu_sweep_check_leaves_a_sweep_over_backend_or_device_to_its_jobs(sweep, refused, monkeypatch, capsys):
    from hydra import compose, initialize_config_module
    from omegaconf import open_dict

    from flashmask3.experiment import RefuseSweepWithoutItsGpu

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with initialize_config_module(version_base="1.3", config_module="flashmask3.conf"):
        cfg = compose(config_name="config", overrides=["+experiment=kernel_ablation"], return_hydra_config=True)
    with open_dict(cfg):  # what Hydra's multirun holds: the command line's overrides, sweeps included
        cfg.hydra.overrides.task = ["+experiment=kernel_ablation", *sweep]
    if refused:
        with pytest.raises(SystemExit) as stop:
            RefuseSweepWithoutItsGpu().on_multirun_start(config=cfg)
        assert stop.value.code == 2
        assert capsys.readouterr().err.startswith("error: every job of this sweep runs with backend=cute")
    else:
        RefuseSweepWithoutItsGpu().on_multirun_start(config=cfg)
        assert capsys.readouterr().err == ""


def test_named_ablations_ask_for_multirun(tmp_path):
    result = run_main(tmp_path, "+experiment=cp_ablation")
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        "error: +experiment=cp_ablation is a sweep: run it with -m (python -m flashmask3 -m +experiment=cp_ablation)"
    ]
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    "override, match",
    [
        ("+mask.params.num_doc=3", "mask 'causal_document' takes no parameter 'num_doc'; its parameters: num_docs"),
        (
            "mask.params.num_docs=0",
            r"num_docs \(mask 'causal_document', seqlen 256\) must be an int in \[1, 256\], got 0",
        ),
        ("+mask.params.window=8", "mask 'causal_document' takes no parameter 'window'"),
    ],
)
def test_mask_parameters_from_hydra_overrides_are_checked(tmp_path, override, match):
    with pytest.raises(ValueError, match=match):
        run_experiment(config([f"logging.out_dir={tmp_path}", "seqlen=256", override]))


def test_a_failing_job_of_a_sweep_leaves_the_others_running(tmp_path):
    result = run_main(
        tmp_path, "mask.params.num_docs=0,2", "seqlen=256", "bench.repeats=1", "bench.backward=false", multirun=True
    )
    assert result.returncode == 2
    assert [line for line in result.stderr.splitlines() if line.startswith("error:")] == [
        "error: num_docs (mask 'causal_document', seqlen 256) must be an int in [1, 256], got 0"
    ]
    assert len(list((tmp_path / "runs").glob("*.json"))) == 1


def test_verify_of_flex_on_the_cpu_checks_the_forward_only(capsys):
    assert verify_main(["backend=flex", "masks=causal", "seqlens=130", "head_dim=16"]) == 0
    out = capsys.readouterr().out
    assert "FlexAttention has no CPU backward; checking the forward only" in out and "1 passed, 0 failed" in out


def test_plot_and_cp_report_write_under_runs_by_default(tmp_path, monkeypatch, capsys):
    import cp_report
    import plot

    monkeypatch.delenv("OUT", raising=False)  # the default folder, as without $OUT
    monkeypatch.chdir(tmp_path)
    record = run_experiment(config(["seqlen=256", "bench.repeats=1", "bench.backward=false"]))["path"]
    monkeypatch.setattr(sys, "argv", ["plot.py", record])
    plot.main()
    assert (tmp_path / "runs" / "tflops.png").stat().st_size > 5000
    report = ["cp_report.py", "--tokens-per-rank", "1024", "--ranks", "2", "--chunk", "256", "--masks", "causal"]
    for extra, path in (([], Path("runs/cp_report_1k_per_rank.json")), (["--out", "cp.json"], Path("cp.json"))):
        monkeypatch.setattr(sys, "argv", report + extra)
        cp_report.main()
        assert json.loads(path.read_text())["rows"][0]["mask"] == "causal"
        assert capsys.readouterr().out.strip().endswith(f"wrote {path}")


@pytest.mark.parametrize(
    "override, line",
    [
        (
            "mask=nope",
            "error: In 'config': Could not find 'mask/nope'; Available options in 'mask': causal, causal_blockwise, "
            "causal_document, document, full, global_sliding_window, prefix_lm_causal, prefix_lm_document, qk_sparse, "
            "random_eviction, share_question, sliding_window",
        ),
        (
            "nope=1",
            "error: Could not override 'nope'. To append to your config use +nope=1 (Key 'nope' is not in struct)",
        ),
        ("seqlen=[1", "error: cannot parse the override 'seqlen=[1': no viable alternative at input '[1'; See "),
    ],
)
def test_hydra_errors_print_one_line(tmp_path, override, line):
    result = run_main(tmp_path, override)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    (printed,) = result.stderr.strip().splitlines()
    assert printed.startswith(line)
    assert not (tmp_path / "runs").exists()


def test_hydra_full_error_still_gives_the_traceback(tmp_path):
    env = dict(os.environ, HYDRA_FULL_ERROR="1")
    cmd = [sys.executable, "-m", "flashmask3", "nope=1", f"hydra.run.dir={tmp_path}/hydra"]
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert result.returncode == 1 and "Traceback" in result.stderr
    assert "hydra.errors.ConfigCompositionException: Could not override 'nope'." in result.stderr


def test_hydra_error_messages_are_joined_into_one_line():
    from hydra.errors import ConfigCompositionException, MissingConfigException
    from omegaconf.errors import ConfigKeyError

    from flashmask3.__main__ import one_line

    missing = MissingConfigException(
        "In 'config': Could not find 'mask/x'\n\nAvailable options in 'mask':\n\tcausal\n\tfull\n"
        "Config search path:\n\tprovider=main, path=pkg://flashmask3.conf"
    )
    assert one_line(missing) == "In 'config': Could not find 'mask/x'; Available options in 'mask': causal, full"
    composed = ConfigCompositionException("Could not override 'x'.\nTo append to your config use +x=1")
    composed.__cause__ = ConfigKeyError("Key 'x' is not in struct\n    full_key: x\n    object_type=dict")
    assert one_line(composed) == "Could not override 'x'. To append to your config use +x=1 (Key 'x' is not in struct)"


def test_mask_params_must_be_given_by_name(tmp_path):
    with pytest.raises(ValueError, match=r"mask.params takes the mask's parameters by name .*, got 3$"):
        run_experiment(config([f"logging.out_dir={tmp_path}", "seqlen=256", "mask.params=3"]))


@pytest.mark.parametrize(
    "args, line",
    [
        (["backend=cute"], "error: backend=cute runs on a Hopper GPU (sm_90): add device=cuda"),
        (["backend=nope"], "error: unknown backend 'nope'; accepted: auto, reference, cute, sdpa, flex"),
        (["dtype=bf17"], "error: dtype must be one of bf16, fp16, fp32, fp64, got 'bf17'"),
        (["head_dim=abc"], "error: head_dim must be an int >= 1, got 'abc'"),
        (["head_dim_v=0"], "error: head_dim_v must be an int >= 1, got '0'"),
        (["seqlens=1000,"], "error: each of seqlens must be an int >= 2, got ''"),
        (["kv_heads=3"], "error: heads must be a multiple of kv_heads (GQA), got heads=4 kv_heads=3"),
        (["backward=maybe"], "error: backward must be true or false, got 'maybe'"),
        (["sinks=maybe"], "error: sinks must be true or false, got 'maybe'"),
        (["device=mps"], "error: device must be cpu or cuda (or cuda:N), got 'mps'"),
        (["masks=x"], "error: unknown mask 'x'; accepted: full, causal, sliding_window, "),
        (["color=red"], "error: unknown option 'color'; usage: python -m flashmask3.verify "),
    ],
)
def test_verify_prints_one_line_for_a_bad_option(capsys, args, line):
    assert verify_main(args) == 2
    captured = capsys.readouterr()
    (printed,) = captured.err.strip().splitlines()
    assert printed.startswith(line) and not captured.out


@pytest.mark.skipif(torch.cuda.is_available(), reason="the message of a machine without a GPU")
def test_verify_on_cuda_without_a_gpu_says_so_in_one_line():
    cmd = [sys.executable, "-m", "flashmask3.verify", "device=cuda", "backend=cute"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2 and not result.stdout
    assert result.stderr.strip().splitlines() == [
        f"error: device=cuda, but torch {torch.__version__} sees no CUDA GPU: use device=cpu"
    ]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--backend", "cute"], "the cute backend runs on a Hopper GPU (sm_90): add --device cuda"),
        (["--compare", "cute"], "the cute backend runs on a Hopper GPU (sm_90): add --device cuda"),
        (["--device", "xyz"], "--device must be cpu or cuda (or cuda:N), got 'xyz'"),
        (["--backend", "nope"], "argument --backend: invalid choice: 'nope'"),
    ],
)
def test_train_tiny_refuses_a_backend_or_device_it_cannot_run(capsys, args, message):
    import train_tiny

    with pytest.raises(SystemExit) as exit_info:
        train_tiny.main(args)
    assert exit_info.value.code == 2
    assert f"error: {message}" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the message of a machine without a GPU")
def test_train_tiny_on_cuda_without_a_gpu_says_so(capsys):
    import train_tiny

    with pytest.raises(SystemExit):
        train_tiny.main(["--device", "cuda"])
    assert f"error: --device cuda, but torch {torch.__version__} sees no CUDA GPU" in capsys.readouterr().err


def test_plot_masks_writes_under_runs_by_default(tmp_path, monkeypatch):
    import plot_masks

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["plot_masks.py", "--seqlen", "256"])
    plot_masks.main()
    assert (tmp_path / "runs" / "masks.png").stat().st_size > 5000


def test_plot_masks_draws_the_column_format_under_runs_by_default(tmp_path, monkeypatch):
    import plot_masks

    monkeypatch.chdir(tmp_path)
    plot_masks.main(["--column-format"])
    assert 5000 < (tmp_path / "runs" / "column_format.png").stat().st_size < 100_000
    plot_masks.main(["--column-format", "--out", "figure.png"])
    assert (tmp_path / "figure.png").exists() and [p.name for p in tmp_path.glob("*/*.png")] == ["column_format.png"]


def test_cp_report_takes_the_per_call_cost_with_the_model_only(monkeypatch, capsys):
    import cp_report
    from flashmask3.distributed import chunk_loads
    from flashmask3.distributed.cost_model import RankTimeFit
    from flashmask3.reference import masks

    base = ["cp_report.py", "--tokens-per-rank", "1024", "--ranks", "4", "--chunk", "256", "--masks", "full"]
    for extra, message in (
        (["--call-ms", "0.1"], "--call-ms goes with --model (it changes the cost model only)"),
        (["--model", "--call-ms", "-1"], "--call-ms takes a number of ms >= 0, got -1.0"),
    ):
        monkeypatch.setattr(sys, "argv", base + extra)
        with pytest.raises(SystemExit):
            cp_report.main()
        assert message in capsys.readouterr().err
    mask = masks.build("full", 4096)
    loads = chunk_loads(mask, 256)
    costly = cp_report.modeled(mask, 4096, 4, 4, loads, fit=RankTimeFit(fixed_s=1.5e-3, bwd_fixed_s=1.5e-3))
    cheap = cp_report.modeled(mask, 4096, 4, 4, loads, fit=RankTimeFit(fixed_s=0.15e-3, bwd_fixed_s=0.15e-3))
    # Four ring calls per direction pay the per-call cost, one or two mask-aware ones.
    assert cheap["ring_tflops_per_gpu"] > 1.2 * costly["ring_tflops_per_gpu"]
    assert cheap["mask_aware_tflops_per_gpu"] > costly["mask_aware_tflops_per_gpu"]


def test_the_kernels_causal_alone_refuses_a_mask_beside_it():
    """The kernel interface's `causal=True` stands for the causal mask alone: given with a mask, a
    ValueError that says so, in both directions, before anything runs."""
    from flashmask3.optimized import interface

    q = torch.zeros(1, 8, 2, 64, dtype=torch.bfloat16)
    mask = masks.build("causal", 8)
    with pytest.raises(ValueError, match="causal=True stands for the causal mask alone"):
        interface.forward(q, q, q, mask, 0.125, causal=True)
    lse = torch.zeros(1, 2, 8)
    with pytest.raises(ValueError, match="causal=True stands for the causal mask alone"):
        interface.backward(q, q, q, q, q, lse, mask, 0.125, causal=True)
