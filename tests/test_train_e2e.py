"""The end-to-end training benchmark (`scripts/train_e2e.py`) on its tiny CPU config: the HF
integration and the mask constructors against HF's sdpa with the same mask, the packed batches,
the records."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_module

pytest.importorskip("transformers")
import train_e2e  # noqa: E402  (scripts/, on pytest's pythonpath)

ROOT = Path(__file__).resolve().parents[1]


def config(overrides: list[str]):
    with initialize_config_module(version_base="1.3", config_module="flashmask3.conf"):
        return compose(config_name="train_e2e", overrides=overrides)


def test_records_go_to_out_where_set_as_the_benchmarks(monkeypatch, tmp_path):
    """`logging.out_dir`, of this benchmark and of the main job, is $OUT where set (the benchmark
    scripts' folder), else runs/."""
    monkeypatch.delenv("OUT", raising=False)
    assert config([]).logging.out_dir == "runs"
    monkeypatch.setenv("OUT", str(tmp_path))
    assert config([]).logging.out_dir == str(tmp_path)
    assert config(["logging=wandb"]).logging.out_dir == str(tmp_path)
    with initialize_config_module(version_base="1.3", config_module="flashmask3.conf"):
        assert compose(config_name="config").logging.out_dir == str(tmp_path)  # the main job


def test_default_run_is_the_tiny_cpu_config_on_the_reference_backend(tmp_path):
    cfg = config([f"logging.out_dir={tmp_path}", "logging.wandb.enabled=true"])
    assert cfg.device == "cpu" and list(cfg.backends) == ["fm3"] and cfg.fm3_backend == "reference"
    (record,) = train_e2e.run(cfg)
    saved = json.loads(Path(record["path"]).read_text())
    assert "error" not in saved
    assert len(saved["losses"]) == cfg.train.steps and saved["timed_steps"] == cfg.train.steps - cfg.train.warmup_steps
    assert saved["losses"][-1] < saved["losses"][0]  # it learns
    assert saved["tokens_per_s"] > 0 and saved["step_ms_median"] > saved["attention_ms_median"] > 0
    assert 0 < saved["attention_share"] < 1 and 0 < saved["mask_density_mean"] < 0.5
    assert saved["model_tflops_per_s"] > 0 and saved["parameters"] > 0
    assert saved["peak_memory_gib"] is None and saved["mfu"] is None  # measured on a GPU only
    assert saved["environment"]["transformers"] and saved["commit"] and saved["config"]["data"]["mask"]
    (summary_path,) = tmp_path.glob("train_e2e_causal_document_256_summary_*.json")
    summary = json.loads(summary_path.read_text())
    assert Path(summary["plot"]).is_file() and summary["runs"][0]["backend"] == "fm3"
    assert list((tmp_path / "wandb").glob("offline-run-*"))


@pytest.mark.parametrize("mask", train_e2e.MASKS)
def test_reference_loss_equals_sdpa_with_the_same_dense_mask(tmp_path, mask):
    """fm3 (the HF integration, reference backend, the constructors' ColumnMask) and HF's sdpa (the
    mask's dense form) train the same curve in fp64."""
    cfg = config(
        [f"logging.out_dir={tmp_path}", f"data.mask={mask}", "dtype=fp64", "backends=[fm3,sdpa]", "train.steps=3"]
    )
    ours, sdpa = train_e2e.run(cfg)
    assert "error" not in ours and "error" not in sdpa
    assert max(abs(a - b) for a, b in zip(ours["losses"], sdpa["losses"])) < 1e-6


def dense_mask(mask: str, batch: train_e2e.PackedBatch) -> torch.Tensor:
    """The mask [B, 1, S, S] (True = attend) by its definition, from the packing metadata."""
    seqlen = batch.input_ids.shape[1]
    token = torch.arange(seqlen)
    rows = []
    for b in range(batch.input_ids.shape[0]):
        document = torch.searchsorted(batch.cu_seqlens[b], token, right=True) - 1
        attend = (document[:, None] == document[None]) & (token[None] <= token[:, None])
        if mask == "prefix_lm_document":
            prefix_end = batch.cu_seqlens[b][document] + batch.prefix_lens[b][document]
            attend |= (document[:, None] == document[None]) & (token < prefix_end)[None]
        elif mask == "share_question":
            segment = torch.searchsorted(batch.segments_cu[b], token, right=True) - 1
            attend &= (segment[:, None] == segment[None]) | batch.is_question[b][segment][None]
        rows.append(attend)
    return torch.stack(rows)[:, None]


@pytest.mark.parametrize("mask", train_e2e.MASKS)
def test_batches_masks_and_targets(mask):
    """The constructors' mask is the definition's; each target is seen by the row that predicts it
    only through what precedes it, right after it in position; the batch depends on seed and step."""
    data = config([f"data.mask={mask}"]).data
    batch = train_e2e.make_batch(data, 128, seed=0, step=1)
    assert batch.input_ids.shape == (2, 256) and batch.cu_seqlens.shape[0] == 2
    attend = dense_mask(mask, batch)
    assert torch.equal(train_e2e.column_mask(mask, batch).to_dense(), attend)
    rows, targets = (batch.labels[:, 1:] != train_e2e.IGNORE_INDEX).nonzero(as_tuple=True)
    targets = targets + 1
    assert len(targets) > 100
    assert not attend[rows, 0, targets - 1, targets].any()  # the predicting row does not see its target
    assert attend[rows, 0, targets, targets - 1].all()  # and the target's context holds the predicting token
    positions = batch.position_ids
    assert torch.equal(positions[rows, targets], positions[rows, targets - 1] + 1)
    assert torch.equal(batch.varlen_cu_seqlens[-1], torch.tensor(2 * 256, dtype=torch.int32))
    again = train_e2e.make_batch(data, 128, seed=0, step=1)
    assert torch.equal(again.input_ids, batch.input_ids) and torch.equal(again.labels, batch.labels)
    assert not torch.equal(train_e2e.make_batch(data, 128, seed=0, step=2).input_ids, batch.input_ids)


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["data.mask=share_question", "backends=[fa4_varlen]"], "fa4_varlen cannot express"),
        (["backends=[fm3,flash]"], "backends must be a list of"),
        (["data.mask=causal"], "data.mask must be one of"),
        (["train.warmup_steps=20"], "train.warmup_steps must be in"),
        (["train.take_turns=yes"], "train.take_turns must be true or false, got 'yes'"),
        (["train.profile_steps=-1"], "train.profile_steps must be an integer >= 0, got -1"),
    ],
)
def test_settings_it_cannot_take_are_refused_before_training(overrides, match):
    with pytest.raises(ValueError, match=match):
        train_e2e.run(config(overrides))


def test_a_backend_that_fails_leaves_its_error_and_the_others_train(tmp_path, monkeypatch):
    """FA4 missing: fa4_varlen's record holds the import error, and fm3 after it trains the same
    curve as alone; the summary lists both."""
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", None)
    overrides = ["train.steps=3", "train.warmup_steps=1"]
    failed, ours = train_e2e.run(config([f"logging.out_dir={tmp_path}", "backends=[fa4_varlen,fm3]", *overrides]))
    assert failed["backend"] == "fa4_varlen" and "flash_attn" in failed["error"] and "losses" not in failed
    assert json.loads(Path(failed["path"]).read_text())["error"] == failed["error"]
    assert "error" not in ours and len(ours["losses"]) == 3
    (alone,) = train_e2e.run(config([f"logging.out_dir={tmp_path / 'alone'}", "backends=[fm3]", *overrides]))
    assert ours["losses"] == alone["losses"]
    (summary_path,) = tmp_path.glob("train_e2e_causal_document_256_summary_*.json")
    summary = json.loads(summary_path.read_text())
    assert summary["loss_reference"] == "fm3"
    assert [run["backend"] for run in summary["runs"]] == ["fa4_varlen", "fm3"]
    assert summary["runs"][0]["error"] == failed["error"] and "final_loss" not in summary["runs"][0]
    assert summary["runs"][1]["max_abs_loss_diff"] == 0.0


def test_backends_taking_turns_train_the_curves_they_train_alone(tmp_path):
    """`train.take_turns`: fm3 and sdpa side by side, one step each in turn, each with its own model,
    train exactly the curves each trains alone; tokens/s over the timed steps' summed times."""
    overrides = ["dtype=fp64", "train.steps=4", "train.warmup_steps=1"]
    both = config([f"logging.out_dir={tmp_path}", "backends=[fm3,sdpa]", "train.take_turns=true", *overrides])
    records = train_e2e.run(both)
    assert [r["backend"] for r in records] == ["fm3", "sdpa"]
    for record in records:
        assert "error" not in record and record["took_turns"] and Path(record["path"]).is_file()
        assert record["tokens_per_s"] == pytest.approx(2 * 256 * 3 / (sum(record["step_ms"]) / 1e3))
        name = record["backend"]
        (alone,) = train_e2e.run(config([f"logging.out_dir={tmp_path / name}", f"backends=[{name}]", *overrides]))
        assert not alone["took_turns"] and record["losses"] == alone["losses"]


def test_the_control_is_fm3_again_under_its_own_name(tmp_path):
    """`fm3_control` taking turns with fm3: the same model from the same start on the same data,
    through its own implementation entry (so each backend's attention timer sees only its own
    calls), trains the same curve."""
    overrides = ["dtype=fp64", "train.steps=3", "train.warmup_steps=1", "train.take_turns=true"]
    records = train_e2e.run(config([f"logging.out_dir={tmp_path}", "backends=[fm3,fm3_control]", *overrides]))
    assert [r["backend"] for r in records] == ["fm3", "fm3_control"]
    assert records[0]["losses"] == records[1]["losses"]
    assert records[0]["attention_ms_median"] > 0 and records[1]["attention_ms_median"] > 0
    assert records[1]["attn_implementation"] == "fm3_control"


@pytest.mark.parametrize("take_turns", [True, False])
def test_each_backend_records_the_clocks_of_its_steps_attention_and_the_rest(tmp_path, monkeypatch, take_turns):
    """ "clocks": the NVML readings (here a steady fake trace over the whole run) filed by time
    under each backend's timed steps, the attention calls within them and the rest; none on a
    machine without NVML."""
    import contextlib
    import time

    from flashmask3.bench import ClockTrace

    class SteadyTrace(ClockTrace):
        @contextlib.contextmanager
        def sampling(self):
            start = time.perf_counter()
            yield self
            end = time.perf_counter()
            self.samples = [(start + (end - start) * i / 4000, 1500.0, 600.0) for i in range(4001)]

    monkeypatch.setattr(train_e2e, "ClockTrace", SteadyTrace)
    overrides = ["train.steps=3", "train.warmup_steps=1", f"train.take_turns={str(take_turns).lower()}"]
    records = train_e2e.run(config([f"logging.out_dir={tmp_path}", "backends=[fm3,sdpa]", *overrides]))
    for record in records:
        clocks = record["clocks"]
        assert {part: clocks[part]["sm_mhz"] for part in clocks} == {
            "steps": 1500.0,
            "attention": 1500.0,
            "rest": 1500.0,
        }
        assert clocks["attention"]["readings"] + clocks["rest"]["readings"] == clocks["steps"]["readings"]
        assert 0 < clocks["attention"]["readings"] < clocks["steps"]["readings"]


@pytest.mark.parametrize("take_turns", [True, False])
def test_profile_steps_list_each_backends_ops_after_the_timed_steps(tmp_path, take_turns):
    """`train.profile_steps`: that many more steps per backend under torch's profiler, after the
    timed ones (the record's steps and losses are the timed run's): the ops by time per step, the
    total first, the matrix products among them."""
    overrides = ["train.steps=3", "train.warmup_steps=1", "train.profile_steps=2", f"train.take_turns={take_turns}"]
    records = train_e2e.run(config([f"logging.out_dir={tmp_path}", "backends=[fm3,sdpa]", *overrides]))
    for record in records:
        total, *rows = record["profile"]
        assert total["name"] == "(all)" and total["ms"] >= sum(r["ms"] for r in rows) > 0
        assert [r["ms"] for r in rows] == sorted((r["ms"] for r in rows), reverse=True)
        assert any(r["name"] == "aten::mm" and r["calls"] > 0 for r in rows)
        assert len(record["losses"]) == 3 and len(record["step_ms"]) == 2


def test_a_backend_that_fails_while_taking_turns_leaves_them(tmp_path, monkeypatch):
    """FA4 missing: fa4_varlen fails in its first step and keeps the error; fm3 trains every step."""
    monkeypatch.setitem(sys.modules, "flash_attn", None)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", None)
    overrides = ["train.steps=3", "train.warmup_steps=1", "train.take_turns=true"]
    failed, ours = train_e2e.run(config([f"logging.out_dir={tmp_path}", "backends=[fa4_varlen,fm3]", *overrides]))
    assert "flash_attn" in failed["error"] and "losses" not in failed
    assert "error" not in ours and len(ours["losses"]) == 3 and ours["took_turns"]


def test_a_backend_that_cannot_express_the_mask_is_skipped(tmp_path):
    """fa4_varlen on share_question: no training and no record file, a summary row saying why; the
    other backends train (one sweep over the masks takes every backend)."""
    cfg = config(
        [
            f"logging.out_dir={tmp_path}",
            "data.mask=share_question",
            "backends=[fa4_varlen,fm3]",
            "train.steps=2",
            "train.warmup_steps=1",
        ]
    )
    skipped, ours = train_e2e.run(cfg)
    reason = "backend fa4_varlen cannot express data.mask=share_question; it takes causal_document"
    assert skipped == {"backend": "fa4_varlen", "mask": "share_question", "seqlen": 256, "skipped": reason}
    assert "error" not in ours and len(ours["losses"]) == 2
    assert Path(ours["path"]).is_file() and not list(tmp_path.glob("*fa4_varlen*"))
    (summary_path,) = tmp_path.glob("train_e2e_share_question_256_summary_*.json")
    runs = json.loads(summary_path.read_text())["runs"]
    assert runs[0]["backend"] == "fa4_varlen" and runs[0]["skipped"] == reason and runs[0]["path"] is None
    assert runs[1]["backend"] == "fm3" and runs[1]["skipped"] is None and runs[1]["max_abs_loss_diff"] == 0.0


def test_command_line_run(tmp_path):
    """`python scripts/train_e2e.py`, the README's example (here 2 steps)."""
    command = ["scripts/train_e2e.py", f"logging.out_dir={tmp_path}", "train.steps=2", "train.warmup_steps=0"]
    result = subprocess.run(
        [sys.executable, *command],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "fm3 causal_document S=256:" in result.stdout and "tokens/s" in result.stdout
    assert len(list(tmp_path.glob("train_e2e_causal_document_fm3_256_*.json"))) == 1
