"""A context-parallel experiment (`python -m flashmask3 cp=mask_aware cp.world_size=4`).

Spawns `cp.world_size` gloo processes on this machine, runs CP attention forward + backward on
each rank's chunks, and checks the reassembled output and gradients against single-device
reference attention. Reports per-rank times, bytes sent, the K/V bytes held (peak per direction,
and what the forward keeps for the backward), load imbalance and the max error.
`+cp.hold_remote_kv=true` keeps the remote K/V from the forward instead of fetching it again;
`+cp.stage_chunks=2` receives the remote K/V two chunks per stage (mask_aware, flat routing).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .api import attention
from .distributed import CPConfig, chunk_loads, context_parallel, cp_attention, imbalance, make_plan
from .reference import masks
from .verify.compare import random_inputs
from .verify.suite import DTYPES

STAT_NAMES = ("bytes_sent", "chunks_received", "peak_kv_bytes", "wait_s", "compute_local_s", "compute_remote_s")
"""Per-rank `CPStats` fields reported for the forward, and with a `bwd_` prefix for the backward."""


def _setup(cfg: dict):
    mask = masks.build(cfg["mask"], cfg["seqlen"], cfg["batch"], cfg["heads"], cfg["seed"], **cfg["params"])
    inputs = random_inputs(
        cfg["batch"],
        cfg["seqlen"],
        cfg["seqlen"],
        cfg["heads"],
        cfg["kv_heads"],
        cfg["head_dim"],
        DTYPES[cfg["dtype"]],
        seed=cfg["seed"],
    )
    chunk = cfg["seqlen"] // (cfg["world_size"] * cfg["chunks_per_rank"])
    tile = 128 if chunk % 128 == 0 else chunk
    loads = chunk_loads(mask, chunk, tile=tile)
    plan = make_plan(cfg["seqlen"], cfg["world_size"], cfg["chunks_per_rank"], cfg["assignment"], loads)
    return mask, inputs, plan, loads


def _worker(rank: int, cfg: dict, out_dir: str) -> None:
    # The ranks meet through a file store in the run's directory (a free TCP port could be taken
    # by another process before rank 0 binds it).
    store = Path(out_dir) / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=cfg["world_size"])
    torch.set_num_threads(1)
    mask, (q, k, v, dout), plan, _loads = _setup(cfg)
    config = CPConfig(
        scheme=cfg["scheme"],
        prune=cfg["prune"],
        overlap=cfg["overlap"],
        ranks_per_node=cfg["ranks_per_node"],
        hold_remote_kv=cfg["hold_remote_kv"],
        stage_chunks=cfg["stage_chunks"],
    )
    local = [plan.shard(x, rank).requires_grad_() for x in (q, k, v)]
    # Warm-up: the first call opens the point-to-point connections.
    torch.autograd.grad(cp_attention(*local, mask, plan, config=config), local, plan.shard(dout, rank))
    dist.barrier()
    start = time.perf_counter()
    out = cp_attention(*local, mask, plan, config=config)
    fwd_s = time.perf_counter() - start
    grads = torch.autograd.grad(out, local, plan.shard(dout, rank))
    total_s = time.perf_counter() - start
    fwd, bwd = context_parallel.last_forward_stats, context_parallel.last_backward_stats
    record = {"fwd_s": fwd_s, "total_s": total_s, "saved_kv_bytes": fwd.saved_kv_bytes}
    for prefix, stats in (("", fwd), ("bwd_", bwd)):
        record |= {prefix + name: getattr(stats, name) for name in STAT_NAMES}
    torch.save(
        {"out": out.detach(), "grads": [g.detach() for g in grads], "record": record}, Path(out_dir) / f"rank{rank}.pt"
    )
    dist.destroy_process_group()


def run_cp(cfg) -> dict:
    """Run the CP experiment described by the Hydra config `cfg` (cfg.cp.scheme != 'none')."""
    plain = {
        "mask": cfg.mask.name,
        "params": {k: v for k, v in dict(cfg.mask.params).items() if v is not None},
        "seqlen": cfg.seqlen,
        "batch": cfg.batch,
        "heads": cfg.heads,
        "kv_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim,
        "dtype": cfg.dtype,
        "seed": cfg.seed,
        "scheme": cfg.cp.scheme,
        "world_size": cfg.cp.world_size,
        "chunks_per_rank": cfg.cp.chunks_per_rank,
        "assignment": cfg.cp.assignment,
        "prune": cfg.cp.prune,
        "overlap": cfg.cp.overlap,
        "ranks_per_node": cfg.cp.ranks_per_node,
        "hold_remote_kv": bool(cfg.cp.get("hold_remote_kv", False)),
        "stage_chunks": cfg.cp.get("stage_chunks"),
    }
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(plain, tmp), nprocs=plain["world_size"], join=True)
        ranks = [torch.load(Path(tmp) / f"rank{r}.pt") for r in range(plain["world_size"])]
    mask, (q, k, v, dout), plan, loads = _setup(plain)
    ins = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = attention(*ins, mask, backend="reference")
    ref_grads = torch.autograd.grad(ref, ins, dout)
    errors = {"out": float((plan.unshard([r["out"] for r in ranks]) - ref.detach()).abs().max())}
    for i, name in enumerate(("dq", "dk", "dv")):
        full = plan.unshard([r["grads"][i] for r in ranks])
        errors[name] = float((full - ref_grads[i]).abs().max())
    return {
        "cp": {
            k: plain[k]
            for k in (
                "scheme",
                "world_size",
                "chunks_per_rank",
                "assignment",
                "prune",
                "overlap",
                "ranks_per_node",
                "hold_remote_kv",
                "stage_chunks",
            )
        },
        "imbalance": imbalance(loads, plan.assignment),
        "per_rank": [r["record"] for r in ranks],
        "max_abs_err_vs_single_device": errors,
    }
