"""The main job (`python -m flashmask3`): Hydra config, JSON record, offline wandb."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_module

from flashmask3.experiment import run_experiment

ROOT = Path(__file__).resolve().parents[1]


def config(overrides):
    with initialize_config_module(version_base="1.3", config_module="flashmask3.conf"):
        return compose(config_name="config", overrides=overrides)


def test_default_job_records_density_tiles_and_errors(tmp_path):
    cfg = config([f"logging.out_dir={tmp_path}", "seqlen=512", "bench.repeats=1", "bench.warmup=0"])
    assert cfg.mask.name == "causal_document" and cfg.backend == "reference" and cfg.device == "cpu"
    record = run_experiment(cfg)
    saved = json.loads(Path(record["path"]).read_text())
    assert saved["density"] == pytest.approx(record["density"]) and 0 < saved["density"] < 0.5
    tiles = saved["tiles_128"]
    assert tiles["skip"] + tiles["partial"] + tiles["unmasked"] == 16
    errors = saved["max_abs_err_vs_sdpa"]
    assert set(errors) == {"out", "dq", "dk", "dv"} and max(errors.values()) < 1e-4
    assert saved["fwd_ms"] > 0 and saved["fwd_bwd_tflops"] > 0 and saved["commit"]


def test_overrides_pick_mask_and_backend(tmp_path):
    cfg = config(
        [
            f"logging.out_dir={tmp_path}",
            "mask=share_question",
            "seqlen=384",
            "backend=flex",
            "bench.backward=false",
            "bench.repeats=1",
            "mask.params.num_docs=2",
        ]
    )
    record = run_experiment(cfg)
    assert record["config"]["mask"]["name"] == "share_question" and "fwd_bwd_ms" not in record
    assert record["max_abs_err_vs_sdpa"]["out"] < 1e-4


def test_wandb_offline_run_writes_its_files(tmp_path):
    cfg = config(
        [
            f"logging.out_dir={tmp_path}",
            "seqlen=256",
            "bench.repeats=1",
            "bench.backward=false",
            "logging.wandb.enabled=true",
        ]
    )
    env = {"WANDB_SILENT": "true", "WANDB_DISABLE_GIT": "true"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        run_experiment(cfg)
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    assert list(runs[0].glob("*.wandb")), "offline run has no data file"


def test_command_line_entry_point(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "flashmask3",
        "seqlen=256",
        "bench.repeats=1",
        f"logging.out_dir={tmp_path}",
        f"hydra.run.dir={tmp_path}/hydra",
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "density" in result.stdout and "max abs error vs sdpa" in result.stdout
    (record,) = tmp_path.glob("causal_document_reference_256_*.json")
    assert f"record: {record}" in result.stdout
    assert re.search(r"fwd [\d.]+ ms \([\d.]+ [GT]FLOP/s\)", result.stdout) and "0.000" not in result.stdout


@pytest.mark.parametrize("staging", [[], ["+cp.stage_chunks=1"]])
def test_cp_job_matches_single_device(tmp_path, staging):
    cfg = config(
        [
            f"logging.out_dir={tmp_path}",
            "cp=mask_aware",
            "cp.world_size=2",
            "seqlen=512",
            "mask=share_question",
            "heads=2",
            "kv_heads=1",
            "head_dim=16",
            *staging,
        ]
    )
    record = run_experiment(cfg)
    assert record["cp"]["scheme"] == "mask_aware" and len(record["per_rank"]) == 2
    assert record["cp"]["stage_chunks"] == (1 if staging else None)
    assert max(record["max_abs_err_vs_single_device"].values()) < 1e-5
    assert 1.0 <= record["imbalance"] < 1.5
    assert all(r["bytes_sent"] > 0 for r in record["per_rank"])
    assert Path(record["path"]).exists()


@pytest.mark.parametrize("experiment", ["kernel_ablation", "cp_ablation", "mask_sweep"])
def test_ablation_experiments_compose(experiment):
    with initialize_config_module(version_base="1.3", config_module="flashmask3.conf"):
        cfg = compose(config_name="config", overrides=[f"+experiment={experiment}"], return_hydra_config=True)
    params = cfg.hydra.sweeper.params
    assert "mask" in params and cfg.experiment == experiment  # the main job refuses it without -m
    if experiment == "kernel_ablation":
        assert cfg.backend == "cute" and cfg.device == "cuda" and cfg.seqlen == 8192 and cfg.dtype == "bf16"
        assert set(params) == {"mask", "kernel"}
        # A handful of named configurations, each the chosen ones with one field changed, not a product.
        assert config([]).kernel == {"name": "default", "changes": {}}
        for variant in params["kernel"].split(","):
            kernel = config([f"kernel={variant}"]).kernel
            assert kernel.name == variant and len(kernel.changes) == (variant != "default"), kernel
        assert config(["+kernel.changes.num_stages=3"]).kernel.changes == {"num_stages": 3}
    if experiment == "cp_ablation":
        assert cfg.cp.scheme == "mask_aware" and set(params) >= {"cp.assignment", "cp.prune", "cp.overlap"}


def test_cute_kernel_variant_runs_and_prints_its_configurations(tmp_path, monkeypatch, capsys):
    """backend=cute calls the kernels in the variant's configurations (here the reference stands in
    for them on the CPU), records them and prints them."""
    from flashmask3.optimized import interface
    from flashmask3.reference import attention as reference

    seen = []

    def fake_forward(q, k, v, mask, scale, config):
        seen.append(config)
        return reference.forward(q.detach(), k.detach(), v.detach(), mask, scale, q.dtype)

    def fake_backward(dout, q, k, v, out, lse, mask, scale, deterministic, config):
        seen.append(config)
        return reference.backward(dout, q.detach(), k.detach(), v.detach(), out, lse, mask, scale, q.dtype)

    monkeypatch.setattr(interface, "forward", fake_forward)
    monkeypatch.setattr(interface, "backward", fake_backward)
    overrides = ["backend=cute", "device=cpu", "kernel=no_persistent", "seqlen=256", "bench.repeats=1"]
    record = run_experiment(config([f"logging.out_dir={tmp_path}", "bench.warmup=0", *overrides]))
    fwd = {
        "tile_m": 192,
        "tile_n": 128,
        "num_stages": 2,
        "q_buffers": 2,
        "persistent": False,
        "uniform_tiles": True,
        "longest_tiles_first_waves": 128,
        "late_k_release": False,
        "fmax_row_max": False,
        "lazy_rescale": False,
        "diagonal_tiles": False,
        "off_diagonal_tiles": False,
        "one_interval_tiles": False,
        "segment_tiles": False,
        "o_from_registers": False,
        "turn_barriers": True,
        "counted_keys": False,
    }
    assert record["kernel"] == {
        "name": "no_persistent",
        "fwd": fwd,
        "bwd": {
            "key_tile": 128,
            "query_tile": 128,
            "keys_on_rows": True,
            "q_stages": 2,
            "do_stages": 0,
            "lse_ahead": False,
            "longest_ctas_first_waves": 16,
            "longest_ctas_first_buckets": 8,
            "diagonal_steps": True,
            "segment_steps": False,
            "dq_writer": True,
            "short_grid_q_stages": 0,
            "split_ctas_max_parts": 0,
            "split_ctas_slack_pct": 2,
            "counted_steps": False,
        },
    }
    assert {type(c).__name__ for c in seen} == {"FwdConfig", "BwdConfig"}
    assert all(c.persistent is False for c in seen if type(c).__name__ == "FwdConfig")
    assert max(record["max_abs_err_vs_sdpa"].values()) < 1e-4
    printed = capsys.readouterr().out
    chosen = (
        "fwd tile_m=192 tile_n=128 num_stages=2 q_buffers=2 persistent=False uniform_tiles=True"
        " longest_tiles_first_waves=128 late_k_release=False fmax_row_max=False lazy_rescale=False"
        " diagonal_tiles=False off_diagonal_tiles=False one_interval_tiles=False segment_tiles=False"
        " o_from_registers=False turn_barriers=True counted_keys=False;"
        " bwd key_tile=128 query_tile=128 keys_on_rows=True q_stages=2 do_stages=0 lse_ahead=False"
        " longest_ctas_first_waves=16 longest_ctas_first_buckets=8"
        " diagonal_steps=True segment_steps=False dq_writer=True short_grid_q_stages=0"
        " split_ctas_max_parts=0 split_ctas_slack_pct=2 counted_steps=False"
    )
    assert f"kernel=no_persistent: {chosen}" in printed


def test_groups_select_shapes_and_backends():
    cfg = config(["shape=gqa_8k", "dtype=bf16", "backend=flex", "logging=wandb"])
    assert (cfg.seqlen, cfg.heads, cfg.kv_heads, cfg.head_dim) == (8192, 32, 8, 128)
    assert cfg.dtype == "bf16" and cfg.backend == "flex" and cfg.logging.wandb.enabled


def test_plot_script_draws_records(tmp_path):
    records = []
    for backend in ("reference", "flex"):
        cfg = config(
            [
                f"logging.out_dir={tmp_path}",
                "seqlen=256",
                "bench.repeats=1",
                "bench.backward=false",
                f"backend={backend}",
            ]
        )
        records.append(run_experiment(cfg)["path"])
    out = tmp_path / "chart.png"
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "plot.py"), *records, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert out.stat().st_size > 5000
