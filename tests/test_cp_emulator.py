"""CP attention with its ranks as threads (distributed/emulator.py) against single-device attention,
the emulator's NCCL checks, and its negative control: skipped waits must show as wrong numbers."""

import dataclasses
import gc
import hashlib
import json
import sys
import threading
import weakref

import cp_emulate  # scripts/, on pytest's pythonpath
import pytest
import torch
import torch.distributed as dist
from flashmask3.distributed import CPConfig, EmulatorError, context_parallel, emulate, make_plan
from flashmask3.optimized import interface
from flashmask3.reference import masks
from flashmask3.verify.cp import (
    compile_cp_kernels,
    cp_plan,
    cp_report,
    low_precision,
    max_error,
    run_cp,
    single_device,
)

WORLD, SEQLEN = 4, 256
CONFIGS = {
    "mask_aware": CPConfig(),
    "hierarchical": CPConfig(ranks_per_node=2),
    "staged": CPConfig(stage_chunks=1),  # mask_aware, one remote chunk per stage
    "ring": CPConfig(scheme="ring"),
    "allgather": CPConfig(scheme="allgather"),
}
MASKS = ("causal_document", "share_question", "sliding_window", "full")
PLANS = ("zigzag", "balanced")


@pytest.fixture(scope="module")
def references():
    return {name: single_device(name, SEQLEN, seed=i) for i, name in enumerate(MASKS)}


def layout_hash(mask, plan, config) -> str:
    """Who needs which chunk and the routes, as a rank computes them from its own mask and plan."""
    layout = context_parallel._Layout(mask, plan, config)
    return hashlib.sha256(layout.needs.tobytes() + repr(layout.phases).encode()).hexdigest()


def sweep(references, **options) -> list[dict]:
    """Every mask x plan x scheme through the emulator; each rank builds its own mask and plan, as a
    process would. One row per case: the largest error over ranks, the layout hashes, the calls."""
    rows = []
    for i, (name, (_, inputs, expected)) in enumerate(references.items()):
        for assignment in PLANS:
            for scheme, config in CONFIGS.items():

                def rank_main(rank, world):
                    mask = masks.build(name, SEQLEN, heads=4, seed=i)
                    plan = cp_plan(mask, world, 2, assignment)
                    got = run_cp(rank, plan, mask, inputs, config)
                    return max_error(rank, plan, got, expected), layout_hash(mask, plan, config)

                emulation = emulate(rank_main, WORLD, **options)
                errors, hashes = zip(*emulation.results)
                rows.append(
                    {
                        "case": (name, assignment, scheme),
                        "error": max(errors),
                        "hashes": set(hashes),
                        "first_p2p": emulation.first_p2p_index(),
                    }
                )
    return rows


@pytest.mark.parametrize("delay", [0.0, 1e-3], ids=["plain", "delay"])
def test_cp_attention_through_the_emulator_equals_single_device(references, delay):
    """Forward and dQ/dK/dV of every scheme and plan on 4 emulated ranks, fp64, with and without a
    delay before each transfer; every rank agrees on the layout and joins a collective before its
    first point-to-point call (NCCL's rule), the same one on every rank."""
    rows = sweep(references, delay=delay)
    assert len(rows) == len(MASKS) * len(PLANS) * len(CONFIGS)
    assert max(row["error"] for row in rows) < 1e-10, [r for r in rows if not r["error"] < 1e-10][:3]
    for row in rows:
        assert len(row["hashes"]) == 1, row["case"]
        firsts = {index for index in row["first_p2p"] if index is not None}
        scheme = row["case"][2]
        # After the warm-up's reduce-scatter; hierarchical: after the node check's two all-gathers too.
        expected = {"mask_aware": {1}, "hierarchical": {3}, "staged": {1}, "ring": {1}, "allgather": set()}
        assert firsts == expected[scheme], row


def test_skipped_waits_give_wrong_numbers_wherever_messages_travel(references):
    """The negative control: with waits that do nothing, every case that sends messages reads
    buffers not yet filled; all-gather (collectives only) still passes. The harness sees a
    missing wait."""
    rows = sweep(references, skip_waits=True)
    failed = {row["case"] for row in rows if not row["error"] < 1e-10}
    with_messages = {row["case"] for row in rows if row["case"][2] != "allgather"}
    assert failed == with_messages and len(failed) == 32


def test_each_rank_reads_its_own_stats_when_ranks_are_threads(references):
    """The module's last_forward_stats / last_backward_stats are the process's, whichever rank
    thread finished last; `rank_stats()` is each rank's: the remote chunks it received, forward and
    backward (fetched again), are those its queries see (contiguous causal-document: 0 for rank 0,
    more further on)."""
    mask, inputs, _ = references["causal_document"]
    plan = cp_plan(mask, WORLD, 2, "contiguous")
    layout = context_parallel._Layout(mask, plan, CPConfig())
    remote = [sum(layout.needs[r, c] and plan.owner(c) != r for c in range(plan.num_chunks)) for r in range(WORLD)]

    def rank_main(rank, world):
        run_cp(rank, plan, mask, inputs, CPConfig())
        fwd, bwd = context_parallel.rank_stats()
        return fwd.chunks_received, bwd.chunks_received

    assert emulate(rank_main, WORLD).results == [(n, n) for n in remote] and len(set(remote)) == 3


def test_backward_counts_the_dkv_message_buffers_in_flight(references):
    """Full mask, 4 ranks x 2 chunks of 32 tokens (zigzag), fp64: one chunk's [dK; dV] is
    2 x 32 x 2 kv heads x 16 x 8 bytes. `peak_grad_bytes`, backward, every rank: one stage sends
    the dK/dV of the 6 remote chunks and receives 2 for each own chunk from each of the 3 other
    ranks (12); stages of 2 (the next rank's both chunks, so 2 sent and 2 received per stage)
    hold two stages in flight (8), one without `overlap` (4); stages of 1 hold two of 2 (4); the
    ring one block accumulator sent and one arriving (4); hierarchical with 2 ranks per node the
    intra-node return (rank 0 sends the chunks of rank 1 and, as relay, of rank 3, and receives
    its own and the relayed ones of rank 2: 8); allgather's reduce-scatter is not counted. The
    forward holds none."""
    mask, inputs, expected = references["full"]
    plan = make_plan(SEQLEN, WORLD, 2, "zigzag")
    chunk = 2 * 32 * 2 * 16 * 8
    cases = {  # name: (config, chunks' dK/dV at peak)
        "one stage": (CPConfig(), 12),
        "stages of 2": (CPConfig(stage_chunks=2), 8),
        "stages of 2, no overlap": (CPConfig(stage_chunks=2, overlap=False), 4),
        "stages of 1": (CPConfig(stage_chunks=1), 4),
        "ring": (CPConfig(scheme="ring"), 4),
        "hierarchical": (CPConfig(ranks_per_node=2), 8),
        "allgather": (CPConfig(scheme="allgather"), 0),
    }

    def rank_main(rank, world):
        peaks = {}
        for name, (config, _) in cases.items():
            got = run_cp(rank, plan, mask, inputs, config)
            assert max_error(rank, plan, got, expected) < 1e-10, name
            fwd, bwd = context_parallel.rank_stats()
            peaks[name] = (fwd.peak_grad_bytes, bwd.peak_grad_bytes)
        return peaks

    for peaks in emulate(rank_main, WORLD).results:
        assert peaks == {name: (0, chunks * chunk) for name, (_, chunks) in cases.items()}


def test_a_steady_state_call_plans_nothing_on_any_rank(references, monkeypatch):
    """Every scheme on 4 ranks as threads, each rank with its own mask and plan, the schemes taking
    turns: after each one's first call, no rank builds a layout or localizes a mask again (planning
    is where the host would wait on the device), and the numbers stay those of the first call."""
    builds = []
    real_init = context_parallel._Layout.__init__

    def counted_init(self, *args):
        builds.append(threading.get_ident())
        real_init(self, *args)

    monkeypatch.setattr(context_parallel._Layout, "__init__", counted_init)
    localized = []
    real_localize = context_parallel.localize
    monkeypatch.setattr(context_parallel, "localize", lambda *a: localized.append(1) or real_localize(*a))
    _, inputs, _ = references["causal_document"]

    def rank_main(rank, world):
        mask = masks.build("causal_document", SEQLEN, heads=4, seed=0)
        plan = cp_plan(mask, world, 2, "balanced")
        first = {scheme: run_cp(rank, plan, mask, inputs, config) for scheme, config in CONFIGS.items()}
        dist.barrier()
        counts = (len(builds), len(localized))
        dist.barrier()
        again = {scheme: run_cp(rank, plan, mask, inputs, config) for scheme, config in CONFIGS.items()}
        dist.barrier()
        same = all(torch.equal(a, b) for s in CONFIGS for a, b in zip(first[s], again[s]))
        return counts, (len(builds), len(localized)), same

    results = emulate(rank_main, WORLD).results
    assert len(builds) == WORLD * len(CONFIGS)  # one layout per rank and scheme, all in the first calls
    for before, after, same in results:
        assert before == after and same


def test_layout_cache_is_safe_across_threads():
    """Threads as ranks, each with its own masks, all calling context_parallel's layout cache
    with switches between every bytecode: a thread always gets the layout of its own mask."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    wrong = []

    def worker(name):
        mask, plan = masks.build(name, 64), make_plan(64, 2, 2, "zigzag")
        for _ in range(20000):
            if context_parallel._layout_for(mask, plan, CPConfig()).mask is not mask:
                wrong.append(name)

    try:
        threads = [threading.Thread(target=worker, args=(n,)) for n in ("causal", "full", "document")]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert not wrong


# -- the emulator's own checks --------------------------------------------------------------
def exchange(rank, world, send, recv_like=None, tag=0, wait=True):
    """Rank 0 sends `send` to rank 1, which receives it into a buffer like `recv_like`."""
    if rank == 0:
        works = dist.batch_isend_irecv([dist.P2POp(dist.isend, send, 1, tag=tag)])
    else:
        buffer = torch.empty_like(send if recv_like is None else recv_like)
        works = dist.batch_isend_irecv([dist.P2POp(dist.irecv, buffer, 0)])
    if wait:
        for w in works:
            w.wait()
    return None if rank == 0 else buffer


@pytest.mark.parametrize(
    "send, recv_like, tag, message",
    [
        (torch.ones(4, 2).t(), None, 0, "must be contiguous"),
        (torch.ones(4), torch.ones(3), 0, "sent 4 x torch.float32 with tag 0 but received into 3 x torch.float32"),
        (torch.ones(4), torch.ones(4, dtype=torch.float64), 0, "but received into 4 x torch.float64"),
        (torch.ones(4), None, 1, "with tag 1 but received into 4 x torch.float32 with tag 0"),
    ],
)
def test_point_to_point_ends_must_agree(send, recv_like, tag, message):
    with pytest.raises(EmulatorError, match=message):
        emulate(lambda rank, world: exchange(rank, world, send, recv_like, tag), 2)


def test_a_buffer_read_before_its_wait_is_poisoned_and_a_late_write_is_seen():
    """CPU transfers happen as late as allowed: at the receiver's wait, from the send buffer as the
    sender's wait finds it."""

    def rank_main(rank, world):
        if rank == 0:
            data = torch.zeros(3)
            (work,) = dist.batch_isend_irecv([dist.P2POp(dist.isend, data, 1)])
            data += 7  # overwritten before the send completed: undefined under NCCL, seen here
            dist.barrier()  # the write lands before the receiver's wait
            work.wait()
            return None
        buffer = torch.zeros(3)
        (work,) = dist.batch_isend_irecv([dist.P2POp(dist.irecv, buffer, 0)])
        early = buffer.clone()
        dist.barrier()
        work.wait()
        return early, buffer

    early, late = emulate(rank_main, 2).results[1]
    assert early.isnan().all() and late.tolist() == [7.0, 7.0, 7.0]


def test_send_buffers_are_kept_alive_unless_protection_is_off():
    def rank_main(rank, world):
        dist.barrier()  # every rank in the group's first call
        if rank == 0:  # the tensor dies at once: only the work refers to the message
            works = dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.full((2,), 5.0), 1)])
            dist.barrier()
            return works[0].wait()
        dist.barrier()  # the receive comes after the send buffer is gone
        return exchange(rank, world, torch.empty(2))

    assert emulate(rank_main, 2).results[1].tolist() == [5.0, 5.0]
    with pytest.raises(EmulatorError, match="dropped its send buffer before the transfer"):
        emulate(rank_main, 2, protect_buffers=False)


def test_collectives_let_go_of_the_ranks_tensors_once_they_ran():
    """All-gather, reduce-scatter and all-reduce give their sums, and none keeps a rank's tensors
    once it ran: the emulator that held every collective's tensors for the whole run grew by
    ~20 GiB per round of scripts/cp_bench.py on CP 4 until a rank ran out of memory on an H200."""

    def rank_main(rank, world):
        values, refs = [], []
        for step in range(3):
            part, gathered = torch.full((2,), 10.0 * rank + step), [torch.empty(2) for _ in range(world)]
            dist.all_gather(gathered, part)
            whole, mine = torch.arange(2.0 * world) + rank + step, torch.empty(2)
            context_parallel._reduce_scatter(mine, whole)
            summed = torch.full((3,), 2.0**rank)
            dist.all_reduce(summed)
            values.append((torch.cat(gathered).tolist(), mine.tolist(), summed.tolist()))
            refs += [weakref.ref(t) for t in (part, *gathered, whole, mine, summed)]
            del part, gathered, whole, mine, summed
        dist.barrier()  # every rank past its collectives' waits: nothing of this rank's is in flight
        gc.collect()
        return values, sum(ref() is not None for ref in refs)

    results = emulate(rank_main, 4).results
    for rank, (values, alive) in enumerate(results):
        assert alive == 0, f"rank {rank}: {alive} tensors of 3 rounds of collectives still alive"
        for step, (gathered, mine, summed) in enumerate(values):
            assert gathered == [10.0 * r + step for r in range(4) for _ in range(2)]
            # whole = arange(8) + r + step summed over r = 0..3; rank gets elements 2 rank, 2 rank + 1
            assert mine == [4.0 * (2 * rank + i) + 6 + 4 * step for i in range(2)]
            assert summed == [15.0] * 3


def test_every_rank_must_join_the_first_call_of_a_group():
    with pytest.raises(EmulatorError, match=r"ranks \[0, 1\] began with a point-to-point call"):
        emulate(lambda rank, world: exchange(rank, world, torch.ones(2)) if rank < 2 else None, 4)


def test_hangs_and_mismatched_collectives_are_errors():
    with pytest.raises(EmulatorError, match="every rank waits and none can go on.*rank 1 waits for rank 0"):
        emulate(lambda rank, world: exchange(rank, world, torch.ones(2)) if rank == 1 else None, 2)
    with pytest.raises(EmulatorError, match="calls (barrier|allreduce) but another rank called (allreduce|barrier)"):
        emulate(lambda rank, world: dist.barrier() if rank else dist.all_reduce(torch.ones(1)), 2)


@pytest.mark.parametrize("world_size", [True, 0, 2.0])
def test_a_world_size_that_is_not_a_positive_int_is_named(world_size):
    with pytest.raises(ValueError, match=f"world_size must be an int >= 1, got {world_size!r}"):
        emulate(lambda rank, world: rank, world_size)


def test_a_ranks_exception_stops_the_others_and_names_the_rank():
    def rank_main(rank, world):
        if rank == 2:
            raise ValueError("bad input")
        dist.barrier()

    with pytest.raises(EmulatorError, match="rank 2 failed: ValueError: bad input") as error:
        emulate(rank_main, 4)
    assert isinstance(error.value.__cause__, ValueError)


def test_cp_emulate_script_runs_a_tiny_sweep(tmp_path, capsys):
    out = tmp_path / "cp.json"
    argv = ["--tokens", "128", "--masks", "causal_document,share_question", "--plans", "zigzag,balanced"]
    assert cp_emulate.main([*argv, "--out", str(out)]) == 0
    summary = json.loads(out.read_text())["summary"]
    for mode in ("plain", "delay"):
        assert summary[mode]["cases"] == 16 and summary[mode]["failed"] == 0 and summary[mode]["max_abs_error"] < 1e-10
    assert summary["no_wait"]["failed"] == 12  # every scheme but all-gather
    assert "no_wait" in capsys.readouterr().out


# -- CUDA: one GPU, every rank on it -------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("name", ["causal_document", "share_question", "sliding_window", "full"])
def test_cp_attention_on_one_gpu_streams_and_events(name):
    """bf16 on 4 emulated ranks sharing the GPU, each on its own stream; the CuTe kernels where they
    run (compiled first on the main thread), else the reference; verify's bf16 tolerance. With
    skipped waits the delayed copies arrive too late: wrong numbers."""
    device = torch.device("cuda")
    mask, inputs, expected = single_device(name, 2048, 0, 8, 2, 128, torch.bfloat16, device)
    baseline = low_precision(mask, inputs)
    kernels = "cute" if interface.unsupported_reason(inputs[0], inputs[1]) is None else "reference"
    warm_up = (lambda: compile_cp_kernels(device, torch.bfloat16, 128)) if kernels == "cute" else None
    # Without waits, a rank reads its buffers well before 20 ms copies have landed.
    modes = {"plain": {}, "delay": {"delay": 2e-3}, "no_wait": {"delay": 2e-2, "skip_waits": True}}
    for assignment in PLANS:
        plan = cp_plan(mask, WORLD, 2, assignment)
        for scheme, config in CONFIGS.items():
            config = dataclasses.replace(config, backend=kernels)
            reports = {}
            for mode, options in modes.items():
                emulation = emulate(
                    lambda rank, world: run_cp(rank, plan, mask, inputs, config),
                    WORLD,
                    device=device,
                    warm_up=warm_up,
                    **options,
                )
                reports[mode] = cp_report(kernels, plan, emulation.results, expected, baseline)
            assert reports["plain"].passed and reports["delay"].passed, (scheme, assignment, reports)
            assert reports["no_wait"].passed == (scheme == "allgather"), (scheme, assignment, reports["no_wait"])
