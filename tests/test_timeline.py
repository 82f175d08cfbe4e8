"""The timeline script's reading of the forward's event stamps (CPU, a hand-made buffer)."""

import math

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
    assert summary["fit_loop_per_key_tile_us"] == pytest.approx(2.0)
    assert summary["fit_loop_per_work_tile_us"] == pytest.approx(0.0, abs=1e-9)
    assert summary["median_epilogue_us"] == pytest.approx(1.0)
    assert summary["median_q_issue_to_landed_us"] == pytest.approx(1.0)
    assert summary["max_idle_tail_us"] == pytest.approx(34.3 - 2.5)
    assert "median_launch_gap_us" not in summary  # one persistent CTA per SM: no launches between tiles


def test_the_loop_splits_into_costs_per_key_tile_and_per_work_tile():
    """2 us per work tile and 1.5 per key tile, read back from three work tiles' loops."""
    fit = timeline.loop_fit([(2, 5.0), (4, 8.0), (6, 11.0)])
    assert fit["fit_loop_per_key_tile_us"] == pytest.approx(1.5)
    assert fit["fit_loop_per_work_tile_us"] == pytest.approx(2.0)
    assert all(math.isnan(value) for value in timeline.loop_fit([(3, 5.0), (3, 6.0)]).values())


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
    assert summary["mean_step_from_start_us"] == pytest.approx(64 / 30)  # 21 + 43 us from the consumers' start
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
    per_cta = timeline.work_tiles_of(stamps)
    timeline.draw([("ours: CTA", per_cta), ("FA4: SM", per_cta)], tmp_path / "t.png", 1, 10.0, "test")
    assert (tmp_path / "t.png").stat().st_size > 1000


def fa4_row(sm, start, block_min, block_max, loop_start, loop_end, stored):
    return [sm, start, block_min, block_max, loop_start, loop_end, stored]


def test_fa4_ctas_are_ordered_per_sm_and_summarized_as_our_work_tiles():
    from flashmask3.fa4_timeline import per_sm_work_tiles

    # SM, consumers' start, first block, one past the last, loop start, loop end, stored (ns)
    stamps = torch.full((5, 7), -1, dtype=torch.int64)
    stamps[0] = torch.tensor(fa4_row(7, 14000, 0, 4, 15000, 23000, 24000))  # SM 7's second CTA
    stamps[1] = torch.tensor(fa4_row(7, 1000, 2, 12, 2000, 12000, 13000))  # SM 7's first
    stamps[2] = torch.tensor(fa4_row(3, 1500, 0, 5, 3500, 8500, 9000))
    stamps[4] = torch.tensor(fa4_row(3, 9500, 3, 3, 10500, 10500, 11000))  # a CTA with no key block
    per_sm = per_sm_work_tiles(stamps)  # row 3 never ran
    assert [[tile["work_tile"] for tile in tiles] for tiles in per_sm] == [[2, 4], [1, 0]]
    assert [tile["key_tiles"] for tile in per_sm[1]] == [10, 4]
    assert per_sm[1][1]["loop_start"] == pytest.approx(14.0)  # us after the first consumers' start
    summary = timeline.summarize(per_sm, rows="sms")
    assert (summary["sms"], summary["work_tiles"], summary["kernel_us"]) == (2, 4, pytest.approx(23.0))
    assert "median_q_issue_to_landed_us" not in summary  # FA4's producer is not stamped
    # before each loop: 2.5 (SM 3 from the start), 1.5 (after its store at 8.0), 1.0 (SM 7), 2.0 (after 12.0)
    assert summary["median_wait_before_tile_us"] == pytest.approx(1.75)
    assert summary["median_launch_gap_us"] == pytest.approx(0.5)  # 0.5, 0.5, 0.0, 1.0
    assert summary["median_setup_us"] == pytest.approx(1.0)  # 2.0, 1.0, 1.0, 1.0
    assert summary["median_loop_per_key_tile_us"] == pytest.approx(1.0)  # 5/5, 10/10, 8/4: the empty CTA left out
    assert summary["median_epilogue_us"] == pytest.approx(0.75)  # 0.5, 0.5, 1.0, 1.0
    assert summary["max_idle_tail_us"] == pytest.approx(13.0)  # SM 3 done at 10.0, the kernel at 23.0
    timeline.with_tile_shape(summary, 128, 80)  # FA4's tiles at head dim 256
    assert summary["median_loop_per_128x128_key_tile_us"] == pytest.approx(1.6)


def test_fa4_ctas_that_stored_without_their_loop_stamps_are_refused():
    from flashmask3.fa4_timeline import per_sm_work_tiles, summarize_backward

    stamps = torch.full((1, 7), -1, dtype=torch.int64)
    stamps[0] = torch.tensor(fa4_row(0, 1000, 0, 4, -1, -1, 24000))  # a path without the loop's wrappers
    with pytest.raises(ValueError, match="FA4 CTAs stored without a LOOP_START stamp"):
        per_sm_work_tiles(stamps)
    with pytest.raises(ValueError, match="FA4 CTAs stored without a LOOP_START stamp"):
        summarize_backward(stamps, sm_count=1)


def test_fa4_backward_ctas_are_summarized_per_step():
    from flashmask3.fa4_timeline import summarize_backward

    stamps = torch.full((3, 7), -1, dtype=torch.int64)
    stamps[0] = torch.tensor(fa4_row(0, 0, 0, 10, 1000, 21000, 22000))
    stamps[1] = torch.tensor(fa4_row(1, 0, 4, 24, 2000, 42000, 45000))
    stamps[2] = torch.tensor(fa4_row(0, 22500, 5, 5, 23000, 23000, 23500))  # no query block sees its keys
    summary = summarize_backward(stamps, sm_count=2)
    assert (summary["ctas"], summary["ctas_with_steps"], summary["median_steps"]) == (3, 2, 15)
    assert summary["kernel_us"] == pytest.approx(45.0)
    assert summary["sm_busy_share"] == pytest.approx(68 / 90, abs=1e-4)  # 22 + 45 + 1 us on 2 SMs over 45
    assert summary["mean_step_from_start_us"] == pytest.approx(63 / 30)  # 21 + 42 us over 10 + 20 steps
    assert summary["median_setup_before_loads_us"] == pytest.approx(1.5)
    assert summary["median_step_with_first_loads_us"] == pytest.approx(2.0)
    assert summary["median_epilogue_us"] == pytest.approx(2.0)


def test_backward_steps_of_other_shapes_are_scaled_to_a_64_by_128_step():
    ours, fa4 = {"mean_step_from_start_us": 2.0}, {"mean_step_from_start_us": 2.4}
    timeline.with_step_shape(ours, 64, 128)
    timeline.with_step_shape(fa4, 80, 128)  # FA4's non-causal steps at head dim 128
    assert (ours["step_shape"], ours["mean_us_per_64x128_step_from_start"]) == ([64, 128], pytest.approx(2.0))
    assert (fa4["step_shape"], fa4["mean_us_per_64x128_step_from_start"]) == ([80, 128], pytest.approx(1.92))


@pytest.mark.parametrize("mask_name", ["causal_document", "document", "causal"])
def test_fa4s_buffers_hold_its_whole_grid(mask_name):
    """`fa4_grid_bound` is above FA4's grid at its smallest tiles (64 rows): one CTA per 64 rows of
    each document (varlen) or sequence, per query head, and not far above it."""
    from flashmask3.reference import masks

    from flashmask3 import bench_peers

    batch, heads, seqlen = 2, 3, 4096
    mask = masks.build(mask_name, seqlen, batch=batch, heads=heads, seed=0)
    case = bench_peers.PeerCase(mask_name, mask, batch, heads, 0.1)
    if mask_name == "causal":
        lengths = [seqlen] * batch
    else:
        lengths = bench_peers.document_cu_seqlens(mask, batch)[0].diff().tolist()
    grid = heads * sum(-(-length // 64) for length in lengths)
    assert grid <= timeline.fa4_grid_bound(case) <= grid + heads * (len(lengths) + batch)


def test_fa4_step_marks_become_cycles_per_segment():
    from flashmask3.fa4_timeline import STEP_MARKS, step_mark_rows, step_segments

    marks = step_mark_rows(2, 8, "cpu")
    labels = ["entry", "TMA wait", "wait_group(0)", "exit"]
    marks[0, 3, :4] = torch.tensor([1000, 1100, 1400, 1450])  # query block 3
    marks[0, 4, :4] = torch.tensor([2000, 2300, 2500, 2600])
    marks[1, 0, :4] = torch.tensor([2**31 - 100, -(2**31) + 100, -(2**31) + 300, -(2**31) + 340])  # the clock wraps
    marks[1, 1, :4] = torch.tensor([0, 100, 200, 300])
    for cta, block in ((0, 3), (0, 4), (1, 0), (1, 1)):
        marks[cta, block, STEP_MARKS] = block + 1
    marks[1, 5, :4] = torch.tensor([1, 2, 3, 4])  # never completed: left out
    segments = step_segments(marks, labels)
    assert segments["marked_steps"] == 4
    # per segment: 100, 300, 200, 100 / 300, 200, 200, 100 / 50, 100, 40, 100 (the middle two's mean)
    assert segments["segment_cycles_per_step"] == {"01 TMA wait": 150.0, "02 wait_group(0)": 200.0, "03 exit": 75.0}
    assert segments["median_step_cycles"] == 445.0  # 450, 600, 440 and 300 cycles
    assert math.isnan(step_segments(step_mark_rows(1, 8, "cpu"), labels)["median_step_cycles"])  # none marked


def test_the_fa4_stamps_buffer_is_checked():
    from flashmask3.fa4_timeline import stamped_fa4

    with pytest.raises(
        ValueError, match=r"stamps must be a contiguous int64 \[CTAs, 7\] tensor, got torch.int32 \[4, 7\]"
    ):
        with stamped_fa4(torch.zeros(4, 7, dtype=torch.int32)):
            pass
    stamps = torch.zeros(4, 7, dtype=torch.int64)
    with pytest.raises(
        ValueError, match=r"step_marks must be an int32 \[CTAs, steps, 17\] tensor, got torch.int32 \[4, 17\]"
    ):
        with stamped_fa4(stamps, torch.zeros(4, 17, dtype=torch.int32)):
            pass


def test_our_turn_profile_is_summarized_per_turn():
    # turns, then cycles summed over them for wait_k, wait_turn, issue, next_entry, wait_s, mask, softmax,
    # wait_pv, rescale
    profile = torch.zeros(3, 10, dtype=torch.int64)
    profile[0] = torch.tensor([10, 100, 200, 300, 400, 500, 600, 700, 800, 900])
    profile[1] = torch.tensor([20, 400, 400, 400, 400, 400, 400, 400, 400, 400])  # a CTA of 20 turns
    summary = timeline.summarize_turns(profile)  # the third CTA profiled no turn
    assert summary["profiled_ctas"] == 2
    assert summary["median_turn_cycles"] == pytest.approx((450 + 180) / 2)
    assert summary["segment_cycles_per_turn"]["wait_k"] == pytest.approx(15.0)  # 10 and 20 per turn
    assert summary["segment_cycles_per_turn"]["rescale"] == pytest.approx(55.0)  # 90 and 20
    assert math.isnan(timeline.summarize_turns(torch.zeros(2, 10, dtype=torch.int64))["median_turn_cycles"])
    assert list(summary["segment_cycles_per_turn"]) == [
        "wait_k",
        "wait_turn",
        "issue",
        "next_entry",
        "wait_s",
        "mask",
        "softmax",
        "wait_pv",
        "rescale",
    ]


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


FA4_BUILD = """
import contextlib, json, sys
import fa4_fwd_sass
fa4_fwd_sass._stub_autotuner()
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from flash_attn.cute.interface import _flash_attn_bwd, _flash_attn_fwd
from flashmask3.fa4_timeline import patch_points, stamp_rows, stamped_fa4, step_mark_rows
build = sys.argv[1]
originals = [(owner, name, vars(owner).get(name)) for owner, name in patch_points()]
stamps, marks = stamp_rows(1024, "cpu"), step_mark_rows(1024, 64, "cpu") if build == "marked" else None
with (stamped_fa4(stamps, marks) if build != "plain" else contextlib.nullcontext({})) as labels, FakeTensorMode():
    q = torch.empty(1, 4096, 16, 128, dtype=torch.bfloat16, device="cuda")
    k, v = (torch.empty(1, 4096, 4, 128, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    out, lse, *_ = _flash_attn_fwd(q, k, v, causal=True, return_lse=True)
    _flash_attn_bwd(q, k, v, out, torch.empty_like(out), lse, causal=True)
with contextlib.suppress(KeyError), stamped_fa4(stamps, marks):
    raise KeyError("an error inside the block")
assert all(vars(owner).get(name) is original for owner, name, original in originals), "a wrapper outlived stamped_fa4"
print(json.dumps(labels))
"""


FORWARD_MARKS = [
    "entry",
    "TMA wait",
    "barrier (256 threads)",
    "TMA wait",
    "barrier arrive (256 threads)",
    "wait_group(1)",
    "before wait_group(0)",
    "wait_group(0)",
    "exit",
]
BACKWARD_MARKS = [
    "entry",
    "TMA wait",
    "TMA wait",
    "wait_group(1)",
    "before wait_group(0)",
    "wait_group(0)",
    "barrier (256 threads)",
    "wait_group(1)",
    "wait_group(1)",
    "barrier (160 threads)",
    "barrier arrive (160 threads)",
    "before wait_group(0)",
    "wait_group(0)",
    "exit",
]


@pytest.mark.slow  # six compiles, ~40 s
def test_the_stamped_fa4_kernels_record_each_event_outside_their_loops(tmp_path):
    """FA4's SM90 forward and backward, built by FA4's own interface for sm_90a under a fake-tensor
    mode (no GPU): plain, stamped, and with their steps marked. The stamped builds read the global
    timer at their events (forward: consumers' start, loop start and end, stores; backward: also the
    loop start's stamp traced in the producer and dQ-writer warps, which never fire) and record the
    SM, while their hot loops keep the plain builds' instructions. The marked builds read the SM
    clock at each mark of the step (the forward's step is traced twice: its diagonal and interior
    loops), with the WGMMAs as they were. Every patched attribute is restored, after an error too."""
    import collections
    import importlib.util
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    if importlib.util.find_spec("flash_attn") is None:
        pytest.skip("FA4 (flash-attn-4) not installed")
    import sass_path
    from ncu_source_summary import opcode
    from test_kernel_compile import nvdisasm_path

    nvdisasm = nvdisasm_path()
    tools = Path(__file__).parents[1] / "tools"
    path = os.pathsep.join([str(tools), *sys.path])
    fa4_target = {"FLASH_ATTENTION_ARCH": "sm_90", "FLASH_ATTENTION_NUM_SMS": "132"}  # its kernel choice, no GPU
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a", CUTE_DSL_KEEP="cubin", PYTHONPATH=path, **fa4_target)
    sass, labels = {}, {}
    for build in ("plain", "stamped", "marked"):
        dump = tmp_path / build
        dump.mkdir()
        env["CUTE_DSL_DUMP_DIR"] = str(dump)
        done = subprocess.run(
            [sys.executable, "-c", FA4_BUILD, build], env=env, check=True, capture_output=True, text=True, timeout=600
        )
        labels[build] = json.loads(done.stdout.splitlines()[-1])
        for kernel in ("ForwardSm90", "BackwardSm90"):
            (cubin,) = dump.glob(f"*FlashAttention{kernel}*.cubin")
            disassembled = subprocess.run([nvdisasm, "-c", str(cubin)], check=True, capture_output=True, text=True)
            sass[build, kernel] = disassembled.stdout

    def loop_opcodes(text: str) -> collections.Counter:
        blocks = sass_path.hot_loop(sass_path.read_blocks(text.splitlines()))
        return collections.Counter(opcode(inst) for _, body in blocks for inst in body)

    for kernel, timer_reads, clock_reads in (("ForwardSm90", 4, 2 * 9), ("BackwardSm90", 6, 14)):
        plain, stamped, marked = (sass[build, kernel] for build in ("plain", "stamped", "marked"))
        assert "GLOBALTIMER" not in plain and stamped.count("SR_GLOBALTIMER") == timer_reads, kernel
        assert "SR_VIRTUALSMID" in stamped and "STL" not in stamped and "LDL" not in stamped, kernel
        before, after = loop_opcodes(plain), loop_opcodes(stamped)
        assert sum(before.values()) == sum(after.values()), kernel
        for op in ("HGMMA", "WARPGROUP", "MUFU", "SYNCS", "BAR", "STG", "CS2R"):
            assert before[op] == after[op], (kernel, op)
        assert marked.count("SR_CLOCKLO") == clock_reads and "STL" not in marked and "LDL" not in marked, kernel
        in_loop = loop_opcodes(marked)
        assert (in_loop["HGMMA"], in_loop["WARPGROUP"]) == (before["HGMMA"], before["WARPGROUP"]), kernel
    assert labels["stamped"] == {}
    assert labels["marked"] == {"forward": FORWARD_MARKS, "backward": BACKWARD_MARKS}
