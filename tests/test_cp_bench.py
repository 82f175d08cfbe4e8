"""The CP harnesses on CPU: scripts/cp_bench.py with its ranks as threads (every scheme against
single-device attention, the JSON it writes, a broken scheme reported as a failure), and
scripts/cp_memory.py's one rank with its peers faked (the K/V bytes the CP layer holds)."""

import collections
import json
import math
import re
import threading
import weakref

import cp_bench  # scripts/, on pytest's pythonpath
import cp_memory
import numpy as np
import pytest
import torch
from flashmask3.distributed import chunk_visibility, context_parallel, emulator
from flashmask3.reference import masks
from flashmask3.verify.cp import cp_plan

MASKS = ("causal_document", "share_question")
# 4 ranks x 64 tokens in 2 chunks, 4 heads x 16, 2 KV heads (--quick), fp64, the PyTorch kernels.
ARGV = ["--emulate", "4", "--quick", "--device", "cpu", "--dtype", "fp64", "--backend", "reference"]
LOCAL_KV = 2 * 64 * 2 * 16 * 8  # a rank's K and V: 64 tokens x 2 KV heads x 16, fp64


def run_bench(tmp_path, *extra: str) -> tuple[int, dict]:
    out = tmp_path / "cp_bench.json"
    code = cp_bench.main([*ARGV, "--masks", ",".join(MASKS), "--rounds", "2", *extra, "--out", str(out)])
    return code, json.loads(out.read_text())


def test_every_scheme_matches_single_device_and_is_timed(tmp_path, capsys):
    code, record = run_bench(tmp_path)
    assert code == 0 and record["failures"] == [] and record["launcher"] == "emulate"
    assert record["world_size"] == 4 and record["devices"] == ["cpu"] * 4 and record["kernels"] == "reference"
    rows = {(row["mask"], row["scheme"]): row for row in record["rows"]}
    assert list(rows) == [(m, s) for m in MASKS for s in cp_bench.SCHEMES]
    for row in rows.values():
        assert row["passed"] and max(row["rel_errors"].values()) < 1e-10 and row["max_abs_error"] < 1e-10, row
        assert row["fwd_bwd_ms"] > row["fwd_ms"] > 0 and row["tflops_fwd_bwd"] > 0
        assert 0 <= row["overlap_efficiency"] <= 1 and row["fwd_comm_ms"] > 0 and row["bwd_comm_ms"] > 0
    for mask in MASKS:
        # Bytes sent per layer, all ranks: ring passes 3 K/V blocks each way and 4 fp64 dK/dV
        # accumulators; all-gather gathers K/V twice and reduce-scatters dK/dV, 3 blocks each.
        assert rows[mask, "ring"]["sent_mib"] * 2**20 == 4 * 10 * LOCAL_KV
        assert rows[mask, "allgather"]["sent_mib"] * 2**20 == 4 * 9 * LOCAL_KV
        assert rows[mask, "mask_aware"]["sent_mib"] < rows[mask, "allgather"]["sent_mib"]
        for scheme in ("mask_aware", "hierarchical"):
            for other in ("ring", "allgather"):
                ratio = rows[mask, other]["fwd_bwd_ms"] / rows[mask, scheme]["fwd_bwd_ms"]
                assert math.isclose(rows[mask, scheme][f"fwd_bwd_speedup_vs_{other}"], ratio, rel_tol=2e-3)
    table = capsys.readouterr().out.splitlines()
    assert table[-1].startswith("share_question") and "allgather" in table[-1]


@pytest.mark.gpu
def test_a_steady_state_cp_call_never_waits_on_the_gpu(tmp_path):
    """On a GPU, the CuTe kernels on 2 emulated ranks: after its checked first call, every scheme's
    forward + backward queues all its work without a host sync (the layouts are kept, so nothing
    is planned again), and its numbers pass the check."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the cute backend needs a Hopper GPU")
    out = tmp_path / "cp_bench.json"
    argv = ["--emulate", "2", "--device", "cuda", "--backend", "cute", "--tokens-per-gpu", "1024"]
    argv += ["--chunks-per-rank", "2", "--heads", "4", "--kv-heads", "2", "--head-dim", "128"]
    argv += ["--masks", "causal_document,full", "--warmup", "0", "--rounds", "1", "--stage-chunks", "1"]
    assert cp_bench.main([*argv, "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 2 * (len(cp_bench.SCHEMES) + 1)
    assert {(row["mask"], row["scheme"]): row["host_syncs"] for row in rows if row["host_syncs"]} == {}


def test_stage_chunks_adds_the_staged_scheme_checked_and_timed(tmp_path, capsys):
    """`--stage-chunks 1`: a mask_aware_staged row after each mask_aware one (up to 6 stages of one
    chunk per rank at CP 4 x 2 chunks), checked against single-device attention and timed like
    mask_aware, sending the same bytes (the same chunks, in stages); every row names its
    stage_chunks. The emulator checks that every rank makes the same collectives in the same order."""
    code, record = run_bench(tmp_path, "--schemes", "mask_aware,ring,allgather", "--stage-chunks", "1")
    assert code == 0 and record["failures"] == [] and record["args"]["stage_chunks"] == 1
    rows = {(row["mask"], row["scheme"]): row for row in record["rows"]}
    schemes = ("mask_aware", cp_bench.STAGED, "ring", "allgather")
    assert list(rows) == [(m, s) for m in MASKS for s in schemes]
    for (mask, scheme), row in rows.items():
        assert row["stage_chunks"] == (1 if scheme == cp_bench.STAGED else None)
        assert row["passed"] and max(row["rel_errors"].values()) < 1e-10 and row["max_abs_error"] < 1e-10, row
        assert row["fwd_bwd_ms"] > row["fwd_ms"] > 0 and row["tflops_fwd_bwd"] > 0
        assert 0 <= row["overlap_efficiency"] <= 1 and row["fwd_comm_ms"] > 0 and row["bwd_comm_ms"] > 0
    for mask in MASKS:
        staged = rows[mask, cp_bench.STAGED]
        assert staged["assignment"] == "balanced" and staged["sent_mib"] == rows[mask, "mask_aware"]["sent_mib"]
        for other in ("ring", "allgather"):
            ratio = rows[mask, other]["fwd_bwd_ms"] / staged["fwd_bwd_ms"]
            assert math.isclose(staged[f"fwd_bwd_speedup_vs_{other}"], ratio, rel_tol=2e-3)
    table = capsys.readouterr().out
    assert re.search(r"^share_question +mask_aware_staged +ok ", table, re.MULTILINE)


def test_a_broken_scheme_is_a_failure_and_the_run_goes_on(tmp_path, monkeypatch):
    """ring's output off by 0.1% fails its check (and is still timed); an all-gather that raises on
    every rank records its error, is not timed, and the other schemes go on; the exit code is 1."""
    ring_forward = context_parallel._FORWARD["ring"]

    def wrong_ring(attn, comm, q, local):
        (out, lse), kept = ring_forward(attn, comm, q, local)
        return (out * 1.001, lse), kept

    def broken_allgather(attn, comm, q, local):
        raise RuntimeError("all-gather broken on purpose")

    monkeypatch.setitem(context_parallel._FORWARD, "ring", wrong_ring)
    monkeypatch.setitem(context_parallel._FORWARD, "allgather", broken_allgather)
    code, record = run_bench(tmp_path, "--schemes", "mask_aware,ring,allgather")
    assert code == 1
    rows = {(row["mask"], row["scheme"]): row for row in record["rows"]}
    for mask in MASKS:
        assert rows[mask, "mask_aware"]["passed"] and max(rows[mask, "mask_aware"]["rel_errors"].values()) < 1e-10
        ring = rows[mask, "ring"]
        assert not ring["passed"] and math.isclose(ring["rel_errors"]["out"], 1e-3, rel_tol=1e-6)
        assert ring["check_failures"][0].startswith("out: 0.001 > tol 1e-10") and ring["fwd_bwd_ms"] > 0
        allgather = rows[mask, "allgather"]
        assert allgather["error"] == "every rank: RuntimeError: all-gather broken on purpose"
        assert "fwd_ms" not in allgather and "passed" not in allgather
        assert "fwd_bwd_speedup_vs_ring" in rows[mask, "mask_aware"]
        assert "fwd_bwd_speedup_vs_allgather" not in rows[mask, "mask_aware"]
    assert [(f["mask"], f["scheme"]) for f in record["failures"]] == [
        (m, s) for m in MASKS for s in ("ring", "allgather")
    ]


def test_a_run_fits_a_device_of_fixed_memory(tmp_path, monkeypatch):
    """The failure of `cp_bench.py --emulate 4 --rounds 3` on an H200, on the CPU: the emulator held
    every collective's tensors for the whole run (~20 GiB more per round at the default size),
    a rank ran out of memory in the 6th round of the first mask, amid the all-gather baseline's
    backward, and, its error swallowed, went on to the next scheme's barrier while the others
    reduce-scattered ("rank 2 calls barrier but another rank called reduce_scatter"). Here the
    device holds 8 MiB of tensors passed to collectives: a collective raises out of memory past
    that. The run holds ~1.5 MiB of them at once; all it passes, 47 MiB."""
    budget, lock, live = 8 * 2**20, threading.Lock(), {}  # storage -> (a tensor's weakref, bytes)
    peak = [0]
    collective = emulator._Emulator.collective

    def on_a_small_device(self, state, rank, op, args, run):
        with lock:
            for t in emulator._tensors(args):
                live[t.untyped_storage().data_ptr()] = (weakref.ref(t), t.untyped_storage().nbytes())
            for ptr in [p for p, (ref, _) in live.items() if ref() is None]:
                del live[ptr]
            held = sum(n for _, n in live.values())
            peak[0] = max(peak[0], held)
        if held > budget:
            raise torch.OutOfMemoryError(f"{held} bytes held by collectives' tensors, the device has {budget}")
        return collective(self, state, rank, op, args, run)

    monkeypatch.setattr(emulator._Emulator, "collective", on_a_small_device)
    code, record = run_bench(tmp_path, "--masks", "full,causal_document", "--warmup", "3", "--rounds", "3")
    assert "run_error" not in record and code == 0 and record["failures"] == []
    assert len(record["rows"]) == 8 and all(row["passed"] and row["fwd_bwd_ms"] > 0 for row in record["rows"])
    assert 0 < peak[0] <= budget / 2


def test_an_error_while_timing_on_one_rank_ends_the_run_with_that_error(tmp_path, monkeypatch):
    """The all-gather baseline's backward runs out of memory on rank 2 in the last timed round,
    after its all-gather, before its reduce-scatter: the run stops with rank 2's error. (Swallowed,
    rank 2 went on to the next scheme's barrier: "collective 89 on group 0: rank 2 calls barrier but
    another rank called reduce_scatter", on the H200.)"""
    reduce_scatter = context_parallel._Comm.reduce_scatter
    calls = collections.Counter()

    def out_of_memory_on_rank_2(comm, per_rank):
        calls[comm.rank] += 1
        # The check's, then 2 per round (timed, communication alone): the 4th round's timed one.
        if comm.rank == 2 and calls[2] == 8:
            raise torch.OutOfMemoryError("CUDA out of memory on purpose")
        return reduce_scatter(comm, per_rank)

    monkeypatch.setattr(context_parallel._Comm, "reduce_scatter", out_of_memory_on_rank_2)
    code, record = run_bench(tmp_path, "--masks", "full", "--warmup", "1", "--rounds", "3")
    assert code == 1 and record["rows"] == [] and calls[2] == 8
    assert record["run_error"] == "EmulatorError: rank 2 failed: OutOfMemoryError: CUDA out of memory on purpose"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--quick"], "launch with torchrun --nproc-per-node N"),
        (["--emulate", "1"], "--emulate takes the number of ranks, 2 or more, got 1"),
        (["--emulate", "2", "--masks", "causal,diagonal"], r"--masks: unknown \['diagonal'\]; accepted: full, causal"),
        (["--emulate", "2", "--schemes", "tree"], r"--schemes: unknown \['tree'\]; accepted: mask_aware, hierarchical"),
        (["--emulate", "2", "--heads", "6", "--kv-heads", "4"], r"--heads \(6\) of --kv-heads \(4\)"),
        (["--emulate", "2", "--stage-chunks", "0"], "--stage-chunks must be a positive int, got 0"),
    ],
)
def test_bad_arguments_name_the_option_and_the_accepted_values(argv, message, capsys, monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    with pytest.raises(SystemExit):
        cp_bench.main(argv)
    assert re.search(message, capsys.readouterr().err)


def test_one_rank_with_faked_peers_holds_its_own_kv_and_one_stage_unless_holding(tmp_path):
    """CP 8 at 1024 tokens (2 chunks of 64 per rank), fp32: by default the forward keeps only the
    rank's own K/V for the backward and holds, at peak, its own plus one stage's receive buffers
    (mask-aware: every remote chunk its queries see; ring: the block computed and the one
    arriving); holding keeps the remote K/V too."""
    out = tmp_path / "cp_memory.json"
    argv = ["--world", "8", "--tokens", "1024", "--chunks-per-rank", "2", "--heads", "4", "--kv-heads", "2"]
    argv += ["--head-dim", "16"]
    argv += ["--device", "cpu", "--masks", "causal_document", "--schemes", "mask_aware,ring", "--out", str(out)]
    assert cp_memory.main(argv) == 0
    rows = {(r["scheme"], r["hold_remote_kv"]): r for r in json.loads(out.read_text())["rows"]}
    local, chunk = 2 * 128 * 2 * 16 * 4, 2 * 64 * 2 * 16 * 4  # bytes of k and v, fp32
    # The rank that needs the most remote chunks, from the mask alone.
    mask = masks.build("causal_document", 1024, heads=4, seed=0)
    plan = cp_plan(mask, 8, 2, "balanced")
    needs = chunk_visibility(mask, plan.chunk_size)[np.asarray(plan.assignment)].any(axis=1)
    remote = [sum(needs[r, c] and plan.owner(c) != r for c in range(16)) for r in range(8)]
    rank, received = int(np.argmax(remote)), max(remote)
    assert received > 0 and {r["rank"] for r in rows.values()} == {rank}

    def kv(scheme, hold):
        row = rows[scheme, hold]
        return row["saved_kv_bytes"], row["fwd_peak_kv_bytes"], row["bwd_peak_kv_bytes"]

    stage = local + received * chunk
    assert rows["mask_aware", False]["remote_chunks"] == received
    assert kv("mask_aware", False) == (local, stage, stage)
    assert kv("mask_aware", True) == (stage, stage, stage)
    # The ring passes every block; holding keeps the chunks this rank's queries see, as above.
    assert kv("ring", False) == (local, 3 * local, 3 * local)
    saved, fwd_peak, bwd_peak = kv("ring", True)
    assert saved == bwd_peak == stage < fwd_peak
    for row in rows.values():
        assert row["kernel_fwd_ms"] > 0 and row["kernel_bwd_ms"] > 0 and row["fwd_bwd_ms"] > 0
        assert "peak_gib" not in row  # no allocator statistics on the CPU


@pytest.mark.parametrize("script", ["cp_bench", "cp_memory"])
def test_the_json_goes_to_out_where_set_else_under_runs(script, tmp_path, monkeypatch):
    """Without --out the JSON goes to $OUT where it is set (the GPU harness brings back only what is
    there), else under runs/; --out goes first."""
    module, argv, name = {
        "cp_bench": (
            cp_bench,
            [*ARGV, "--masks", "causal_document", "--schemes", "mask_aware", "--rounds", "1"],
            "cp_bench_cp4.json",
        ),
        "cp_memory": (
            cp_memory,
            ["--world", "8", "--tokens", "1024", "--chunks-per-rank", "2", "--heads", "4", "--kv-heads", "2"]
            + ["--head-dim", "16", "--device", "cpu", "--masks", "causal_document"],
            "cp_memory_cp8.json",
        ),
    }[script]
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("OUT", raising=False)
    assert module.main(argv) == 0
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    assert module.main(argv) == 0
    assert module.main([*argv, "--out", "chosen.json"]) == 0
    written = sorted(str(path.relative_to(tmp_path)) for path in tmp_path.rglob("*.json"))
    assert written == ["chosen.json", f"out/{name}", f"runs/{name}"]


def test_staged_fetch_holds_its_own_kv_and_two_stages(tmp_path):
    """`--stage-chunks 2` on the full mask (14 remote chunks per rank at CP 8 x 2 chunks): the K/V
    held at peak, both directions, is the own K/V plus two stages of 2 chunks, not all 14, and the
    backward's dK/dV messages in flight two stages' each way (8 chunks' worth, where one stage
    has all 14 out and 14 in); the ring's rows are as without it."""
    out = tmp_path / "cp_memory.json"
    argv = ["--world", "8", "--tokens", "1024", "--chunks-per-rank", "2", "--heads", "4", "--kv-heads", "2"]
    argv += ["--head-dim", "16", "--device", "cpu", "--masks", "full", "--schemes", "mask_aware,ring"]
    assert cp_memory.main([*argv, "--stage-chunks", "2", "--out", str(out)]) == 0
    rows = {(r["scheme"], r["hold_remote_kv"]): r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {("mask_aware", False), ("ring", False), ("ring", True)}
    local, chunk = 2 * 128 * 2 * 16 * 4, 2 * 64 * 2 * 16 * 4  # bytes of k and v, fp32
    staged = rows["mask_aware", False]
    assert staged["stage_chunks"] == 2 and staged["remote_chunks"] == 14
    assert (staged["saved_kv_bytes"], staged["fwd_peak_kv_bytes"], staged["bwd_peak_kv_bytes"]) == (
        local,
        local + 4 * chunk,
        local + 4 * chunk,
    )
    assert staged["bwd_peak_grad_bytes"] == 8 * chunk
    assert rows["ring", False]["stage_chunks"] is None and rows["ring", False]["fwd_peak_kv_bytes"] == 3 * local
