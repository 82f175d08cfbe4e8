"""The timeline script's reading of the forward's event stamps (CPU, a hand-made buffer)."""

import pytest
import timeline  # scripts/, on pytest's pythonpath
import torch


def test_work_tiles_are_read_per_cta_and_summarized():
    # events: work tile, listed, list end, Q issued, Q landed, loop start, loop end, stored, key tiles (ns)
    stamps = torch.full((2, 3, 9), -1, dtype=torch.int64)
    stamps[0, 0] = torch.tensor([0, 1000, 1100, 1200, 2200, 2300, 12300, 13300, 5])
    stamps[0, 1] = torch.tensor([2, 12000, 12100, 12400, 13400, 14300, 34300, 35300, 10])
    stamps[1, 0] = torch.tensor([1, 1000, 1050, 1200, 2200, 2500, 2500, 3500, 0])
    per_cta = timeline.work_tiles_of(stamps)
    assert [len(t) for t in per_cta] == [2, 1]
    assert per_cta[0][1]["work_tile"] == 2 and per_cta[0][1]["key_tiles"] == 10
    assert per_cta[0][1]["loop_start"] == pytest.approx(13.3)  # us after the first stamp (1000 ns)
    summary = timeline.summarize(per_cta)
    assert summary["work_tiles"] == 3 and summary["kernel_us"] == pytest.approx(34.3)
    # waits: 1.3 (CTA 0's first tile), 1.0 (after its first store), 1.5 (CTA 1)
    assert summary["median_wait_before_tile_us"] == pytest.approx(1.3)
    assert summary["median_loop_per_key_tile_us"] == pytest.approx(2.0)  # 10/5 and 20/10 us per key tile
    assert summary["median_epilogue_us"] == pytest.approx(1.0)
    assert summary["median_q_issue_to_landed_us"] == pytest.approx(1.0)
    assert summary["max_idle_tail_us"] == pytest.approx(34.3 - 2.5)


def test_the_backward_profile_is_summarized_per_step():
    # start, K/V landed, loop end, stored (ns), steps, then cycles of the 10 segments over all steps
    stamps = torch.zeros(3, 15, dtype=torch.int64)
    stamps[0] = torch.tensor([0, 1000, 21000, 22000, 10, 100, 200, 300, 400, 500, 600, 700, 800, 900, 50])
    stamps[1] = torch.tensor([0, 3000, 43000, 45000, 20, 400, 400, 600, 800, 1000, 1200, 1400, 1600, 1800, 0])
    stamps[2, 4] = 0  # a CTA whose key tile no query tile sees: left out of the medians
    summary = timeline.summarize_backward(stamps, sm_count=2)
    assert (summary["ctas"], summary["ctas_with_steps"], summary["median_steps"]) == (3, 2, 15)
    assert summary["kernel_us"] == pytest.approx(45.0)
    assert summary["sm_busy_share"] == pytest.approx(67 / 90, abs=1e-4)  # 22 + 45 us on 2 SMs over 45 us
    assert summary["mean_step_us"] == pytest.approx(2.0)  # 60 us over 30 steps
    assert summary["mean_cta_overhead_us"] == pytest.approx(3.5)  # (1 + 1) and (3 + 2) us
    assert summary["median_kv_wait_us"] == pytest.approx(2.0)
    assert summary["median_step_us"] == pytest.approx(2.0)  # 20 us / 10 steps and 40 us / 20 steps
    assert summary["median_epilogue_us"] == pytest.approx(1.5)
    assert summary["segment_cycles_per_step"]["wait_q"] == pytest.approx(15.0)  # 10 and 20 per step
    assert summary["segment_cycles_per_step"]["wait_dk"] == pytest.approx(90.0)
    assert summary["segment_cycles_per_step"]["next_entry"] == pytest.approx(2.5)  # 5 and 0 per step
    assert summary["median_step_cycles"] == pytest.approx(457.5)  # 4550 / 10 and 9200 / 20
    assert sum(summary["segment_share"].values()) == pytest.approx(1.0, abs=1e-3)
    assert list(summary["segment_share"]) == [
        "wait_q",
        "wait_s",
        "softmax",
        "wait_dp",
        "ds",
        "ds_barrier",
        "wait_dq",
        "add_dq",
        "wait_dk",
        "next_entry",
    ]


def test_the_picture_is_drawn(tmp_path):
    pytest.importorskip("matplotlib")
    stamps = torch.full((1, 1, 9), -1, dtype=torch.int64)
    stamps[0, 0] = torch.tensor([0, 0, 10, 20, 900, 1000, 5000, 5600, 3])
    timeline.draw(timeline.work_tiles_of(stamps), tmp_path / "t.png", 1, 10.0, "test")
    assert (tmp_path / "t.png").stat().st_size > 1000


def test_results_table_merges_runs_and_compares_with_the_fastest_peer():
    import results_table

    older = {
        "commit": "a",
        "bench": [
            {"mask": "full", "seqlen": 8192, "cute_tflops": 600.0, "fa4_tflops": 650.0},
            {
                "mask": "share_question",
                "seqlen": 8192,
                "cute_tflops": 370.0,
                "fa4_sparse_tflops": 330.0,
                "flex_flash_tflops": 300.0,
            },
        ],
    }
    newer = {
        "commit": "b",
        "bench": [{"mask": "full", "seqlen": 8192, "cute_tflops": 620.0, "fa4_tflops": 640.0, "cudnn_tflops": 610.0}],
    }
    rows = results_table.merged_rows([older, newer])
    assert [(r["mask"], r["cute_tflops"], r["commit"]) for r in rows] == [
        ("full", 620.0, "b"),
        ("share_question", 370.0, "a"),
    ]
    gqa = {"commit": "c", "bench": [{**newer["bench"][0], "batch": 1, "heads": 16, "kv_heads": 4, "head_dim": 128}]}
    with pytest.raises(ValueError, match=r"full at S=8192: a row of shape \(1, 16, 4, 128\) would replace one of"):
        results_table.merged_rows([older, gqa])
    lines = results_table.table(rows).splitlines()
    assert lines[0] == "| mask | S | ours | FA4 native | FA4 block-sparse | Flex FLASH | cuDNN | ours / best peer |"
    assert lines[2] == "| full | 8K | 620 | 640 | – | – | 610 | 0.97 |"
    assert lines[3] == "| share_question | 8K | 370 | – | 330 | 300 | – | 1.12 |"
