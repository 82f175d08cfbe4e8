"""The profiled builds on a Hopper GPU (skipped elsewhere): our forward's turn profile and FA4's
stamped and step-marked kernels give the numbers of the builds without them, and record one row
per CTA with the work the mask implies."""

import math

import pytest
import torch
from flashmask3.reference import masks
from flashmask3.verify import random_inputs

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _hopper_only():
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the profiled builds are Hopper kernels")


@pytest.mark.parametrize("name", ["causal", "causal_document", "share_question"])
def test_the_turn_profile_gives_the_default_forwards_numbers_and_counts_every_turn(name):
    """Out and LSE bit for bit as the default build's (on the document masks, segment tiles: the
    grid of the virtual rows); the turns counted over all CTAs are the steady-state turns the
    timeline build's key-tile counts imply (a work tile of n key tiles takes n - 1), and every
    counted CTA has cycles in every segment."""
    from flashmask3.optimized.interface import forward, forward_ctas, mask_fwd_config
    from flashmask3.optimized.timeline import Event, TurnEvent

    seqlen, heads, batch = 2048, 4, 2
    mask = masks.build(name, seqlen, batch=batch, heads=heads, seed=1, device="cuda")
    q, k, v, _ = random_inputs(batch, seqlen, seqlen, heads, 2, 128, torch.bfloat16, "cuda", seed=1)
    scale, config = 1 / math.sqrt(128), mask_fwd_config(128, mask)
    assert config.segment_tiles == (name != "causal")
    ctas = forward_ctas(q, config)
    out, lse = forward(q, k, v, mask, scale, config=config)
    profile = torch.zeros(ctas, len(TurnEvent), dtype=torch.int64, device="cuda")
    profiled_out, profiled_lse = forward(q, k, v, mask, scale, config=config, turn_profile=profile)
    assert torch.equal(out, profiled_out) and torch.equal(lse, profiled_lse)
    stamps = torch.full((ctas, batch * heads * seqlen // 128, len(Event)), -1, dtype=torch.int64, device="cuda")
    forward(q, k, v, mask, scale, config=config, timeline=stamps)
    key_tiles = stamps[..., Event.KEY_TILES][stamps[..., Event.WORK_TILE] >= 0]
    assert int(profile[:, TurnEvent.TURNS].sum()) == int((key_tiles - 1).clamp(min=0).sum())
    counted = profile[profile[:, TurnEvent.TURNS] > 0]
    assert len(counted) > 0 and bool((counted[:, TurnEvent.WAIT_K :] > 0).all())


def _fa4():
    pytest.importorskip("flash_attn.cute", reason="FA4 (flash-attn-4) not installed")
    from flash_attn.cute import flash_attn_func

    from flashmask3 import fa4_timeline

    return flash_attn_func, fa4_timeline


def test_fa4_stamped_gives_fa4s_numbers_with_a_row_per_cta():
    """FA4's causal forward and backward (head dim 128, MHA: one CTA per 128-row query tile
    forward, per 128-key tile backward), plain against stamped and step-marked: the same output,
    dK and dV bit for bit (dQ by FA4's atomic adds, to their rounding), one stored row per CTA
    with ordered times and the causal block ranges (query tile m: key blocks 0..m; key tile n:
    64-row query blocks 2n..), and marks in every step of the marked CTAs."""
    flash_attn_func, fa4_timeline = _fa4()
    seqlen, heads, batch, tiles = 2048, 4, 2, 2048 // 128
    q, k, v, dout = random_inputs(batch, seqlen, seqlen, heads, heads, 128, torch.bfloat16, "cuda", seed=2)
    q, k, v = (x.requires_grad_() for x in (q, k, v))

    def forward_backward():
        out = flash_attn_func(q, k, v, causal=True)[0]
        return (out, *torch.autograd.grad(out, (q, k, v), dout))

    plain = forward_backward()
    ctas = batch * heads * tiles
    expected_blocks = {
        "forward": [m + 1 for m in range(tiles)],
        "backward": [seqlen // 64 - 2 * n for n in range(tiles)],
    }
    for marked in (False, True):
        rows, segments, results = {}, {}, {}
        for kind in ("forward", "backward"):
            stamps = fa4_timeline.stamp_rows(2 * ctas)
            marks = fa4_timeline.step_mark_rows(ctas, seqlen // 64) if marked else None
            with fa4_timeline.stamped_fa4(stamps, marks) as labels:
                if kind == "forward":
                    results["out"] = flash_attn_func(q, k, v, causal=True)[0]
                else:
                    results["grads"] = torch.autograd.grad(results["out"], (q, k, v), dout)
                torch.cuda.synchronize()
            rows[kind] = stamps.cpu()
            if marked:
                segments[kind] = fa4_timeline.step_segments(marks.cpu(), labels[kind])
        dq, dk, dv = results["grads"]
        assert torch.equal(results["out"], plain[0]) and torch.equal(dk, plain[2]) and torch.equal(dv, plain[3])
        assert torch.allclose(dq.float(), plain[1].float(), atol=1e-2, rtol=1e-2)
        for kind, stamped in rows.items():
            stored = stamped[stamped[:, fa4_timeline.PeerEvent.STORED] >= 0]
            assert len(stored) == ctas, kind
            start, end = fa4_timeline.PeerEvent.START, fa4_timeline.PeerEvent.LOOP_END
            assert bool((stored[:, start] <= stored[:, end]).all()), kind
            assert bool((stored[:, end] <= stored[:, fa4_timeline.PeerEvent.STORED]).all()), kind
            counts = stored[:, fa4_timeline.PeerEvent.BLOCK_MAX] - stored[:, fa4_timeline.PeerEvent.BLOCK_MIN]
            assert sorted(counts.tolist()) == sorted(expected_blocks[kind] * (batch * heads)), kind
        for kind, summary in segments.items():
            assert summary["marked_steps"] > 0 and summary["median_step_cycles"] > 0, kind
            assert all(cycles >= 0 for cycles in summary["segment_cycles_per_step"].values()), kind
