"""The verify harness: tolerances, pass/fail verdicts and the command line."""

import importlib
import math

import pytest
import torch
from flashmask3.reference import masks
from flashmask3.verify import FLOOR, compare, random_inputs, rel_l2, run_suite
from flashmask3.verify.__main__ import main

compare_mod = importlib.import_module("flashmask3.verify.compare")


def test_rel_l2():
    ref = torch.tensor([3.0, 4.0, -math.inf])
    assert rel_l2(ref, ref) == 0
    assert rel_l2(torch.tensor([3.0, 4.5, -math.inf]), ref) == pytest.approx(0.1)
    assert rel_l2(torch.tensor([math.nan, 4.0, 0.0]), ref) == math.inf


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reference_in_low_precision_passes_with_a_real_margin(dtype):
    mask = masks.build("share_question", 300)
    q, k, v, dout = random_inputs(1, 300, 300, 2, 2, 64, dtype, seed=1)
    report = compare("reference", q, k, v, mask, dout)
    assert report.passed, report.failures()
    assert set(report.errors) == {"out", "lse", "dq", "dk", "dv"}
    # The low-precision baseline is a real computation with a real error.
    assert 1e-4 < report.baseline["out"] < 2e-2
    assert report.tolerance("out") == pytest.approx(2 * report.baseline["out"] + FLOOR[dtype])


def test_a_wrong_backend_fails(monkeypatch):
    real = compare_mod.attention

    def off_by_a_bit(q, k, v, mask, **kw):
        out, lse = real(q, k, v, mask, **kw)
        return out * 1.01, lse

    monkeypatch.setattr(compare_mod, "attention", off_by_a_bit)
    q, k, v, dout = random_inputs(1, 128, 128, 2, 2, 32, torch.bfloat16)
    report = compare("reference", q, k, v, masks.build("causal", 128), dout)
    assert not report.passed
    assert any(f.startswith("out:") for f in report.failures())


def test_dead_rows_must_be_zero(monkeypatch):
    real = compare_mod.attention

    def nan_rows(q, k, v, mask, **kw):
        out, lse = real(q, k, v, mask, **kw)
        return out + 1.0, lse  # rows that see nothing are no longer 0

    monkeypatch.setattr(compare_mod, "attention", nan_rows)
    q, k, v, _ = random_inputs(1, 64, 64, 1, 1, 8, torch.float32)
    report = compare("reference", q, k, v, masks.build("qk_sparse", 64, num_docs=1))
    assert "out: rows that see no key are not 0" in report.notes


def test_suite_and_cli(capsys):
    cases = run_suite("sdpa", ["causal", "document"], seqlens=[130], dtype="bf16", heads=2, kv_heads=1, head_dim=32)
    assert len(cases) == 2 and all(c.report.passed for c in cases)
    assert main(["backend=reference", "dtype=fp32", "masks=causal,qk_sparse", "seqlens=97", "head_dim=16"]) == 0
    table = capsys.readouterr().out
    assert "qk_sparse" in table and "2 passed, 0 failed" in table
    assert main(["masks=x"]) == 2 and "error: unknown mask 'x'" in capsys.readouterr().err
