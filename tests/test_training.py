"""A tiny transformer trains on packed documents; backends give the same loss curve."""

import pytest
import torch
import train_tiny  # scripts/, on pytest's pythonpath


@pytest.mark.slow  # 40 training steps on two backends: 1 s idle, ~40 s on a loaded CPU
def test_reference_training_matches_sdpa_and_learns():
    result = train_tiny.main(["--backend", "reference", "--compare", "sdpa", "--steps", "40"])
    losses = result["losses"]
    assert result["max_loss_diff"] < 1e-4
    assert sum(losses[-5:]) / 5 < 0.9 * sum(losses[:5]) / 5  # it learns


@pytest.mark.gpu
def test_cute_training_follows_the_reference_curve():
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the cute backend needs a Hopper GPU")
    result = train_tiny.main(
        [
            "--backend",
            "cute",
            "--compare",
            "reference",
            "--device",
            "cuda",
            "--dtype",
            "bf16",
            "--steps",
            "30",
            "--dim",
            "256",
            "--heads",
            "2",
            "--kv-heads",
            "1",
        ]
    )
    assert result["max_loss_diff"] < 5e-2
