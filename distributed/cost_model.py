"""A cost model (a model, not a measurement) of CP attention forward time per scheme.

Compute: every rank's non-skipped 128 x 128 tiles against the keys it attends, partial tiles
weighted by PARTIAL_TILE_COST, at a sustained kernel rate (default: the forward kernel's full-mask
577 TFLOP/s measured on the H200 at 8K). Communication: the bytes each rank sends and receives,
per link (NVLink 450 GB/s per direction inside a node, 400 Gb/s = 50 GB/s per GPU between nodes);
a rank's transfer time is its larger direction on its slowest link in use.

- mask_aware: local chunks overlap the transfers: max(compute_local, comm) + compute_remote.
- ring: R steps, each max(compute of the block, one block transfer); the first step has no wait.
- allgather: all-gather first (every chunk to every rank), then all compute.
Overlap efficiency = the part of the transfer time hidden under compute.

`RankTimeFit`: the mask-aware rank's measured compute time is not tiles / rate alone. Fitted on the
H200 rank-by-rank timings (scripts/cp_calibrate.py, bench/results/cp_calibration.json), it is
    seconds = fixed + per_load * (its chunks' workload) + per_needed_chunk * (KV chunks it needs),
the last term being the cost of each extra KV chunk in the union call (gathering it, its mask
and tile plan); the fixed part (~1.8 ms per rank call) is the robust finding.
`predict(..., fit=RankTimeFit())` uses it for the mask-aware compute.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..reference import PARTIAL, ColumnMask
from .balance import PARTIAL_TILE_COST
from .context_parallel import CPConfig, _Layout
from .plan import CPPlan

NVLINK_BPS = 450e9
INTER_NODE_BPS = 400e9 / 8


@dataclass(frozen=True)
class Hardware:
    tflops: float = 577.0  # sustained kernel rate on unmasked work
    ranks_per_node: int = 8
    nvlink_bps: float = NVLINK_BPS
    inter_node_bps: float = INTER_NODE_BPS


@dataclass(frozen=True)
class RankTimeFit:
    """A rank's local attention time (forward, 8K queries, 32 x 128 query heads, 8 KV heads, bf16)
    fitted to the H200 rank-by-rank measurements; defaults from bench/results/cp_calibration.json
    ("kernel_rate_slope": the per-load slope pinned to the kernel's rate; a free slope fits a little
    better, R^2 0.974 vs 0.959, but implies a rate beyond the kernel's and so over-predicts dense masks)."""

    fixed_s: float = 1.77e-3
    per_load_s: float = 0.465e-6  # per unit of `chunk_loads` (a 128 x 128 tile x 32 heads at 577 TFLOP/s)
    per_needed_chunk_s: float = 2.5e-6

    def seconds(self, load: float, needed_chunks: int) -> float:
        return self.fixed_s + self.per_load_s * load + self.per_needed_chunk_s * needed_chunks


def _tile_seconds(local: ColumnMask, heads: int, head_dim: int, hw: Hardware) -> float:
    classes = local.block_classes(128, 128).classes
    weight = ((classes == PARTIAL) * PARTIAL_TILE_COST + (classes > PARTIAL)).sum().item()
    weight *= heads // local.heads
    return weight * 4 * 128 * 128 * head_dim / (hw.tflops * 1e12)


def predict(
    mask: ColumnMask,
    plan: CPPlan,
    scheme: str,
    heads: int,
    kv_heads: int,
    head_dim: int,
    hw: Hardware = Hardware(),
    bytes_per_elem: int = 2,
    fit: RankTimeFit | None = None,
    loads=None,
) -> dict:
    """Modeled per-rank forward seconds, the slowest rank, and the overlap efficiency.

    With `fit` (and the plan's `chunk_loads` as `loads`), the mask-aware compute of a rank comes
    from the fitted rank-time model instead of tiles at the kernel rate, split between local and
    remote chunks in proportion to their tile time.
    """
    world, chunk = plan.world_size, plan.chunk_size
    chunk_bytes = 2 * chunk * kv_heads * head_dim * bytes_per_elem
    layout = _Layout(mask, plan, CPConfig(scheme="mask_aware", ranks_per_node=hw.ranks_per_node))

    def node(r):
        return r // hw.ranks_per_node

    per_rank = []
    for r in range(world):
        own = plan.assignment[r]
        compute = {
            c: _tile_seconds(layout.union_mask(r, [c]), heads, head_dim, hw)
            for c in range(plan.num_chunks)
            if layout.needs[r][c]
        }
        local_s = sum(v for c, v in compute.items() if c in own)
        remote_s = sum(v for c, v in compute.items() if c not in own)
        if fit is not None and scheme == "mask_aware":
            fitted = fit.seconds(float(sum(loads[c] for c in own)), len(compute))
            share = local_s / (local_s + remote_s) if local_s + remote_s else 1.0
            local_s, remote_s = fitted * share, fitted * (1 - share)
        if scheme == "mask_aware":
            out_b = {"nv": 0, "ib": 0}
            in_b = {"nv": 0, "ib": 0}
            for phase in layout.phases:
                for (src, dst), chunks in phase.items():
                    link = "nv" if node(src) == node(dst) else "ib"
                    if src == r:
                        out_b[link] += len(chunks) * chunk_bytes
                    if dst == r:
                        in_b[link] += len(chunks) * chunk_bytes
            comm = max(max(out_b["nv"], in_b["nv"]) / hw.nvlink_bps, max(out_b["ib"], in_b["ib"]) / hw.inter_node_bps)
            total = max(local_s, comm) + remote_s
            hidden = min(comm, local_s)
        else:
            cross = world > hw.ranks_per_node
            bps = hw.inter_node_bps if cross else hw.nvlink_bps
            block = len(plan.assignment[r]) * chunk_bytes
            if scheme == "ring":
                steps = [sum(compute.get(c, 0.0) for c in plan.assignment[(r - s) % world]) for s in range(world)]
                step_comm = block / bps
                total = steps[0] + sum(max(s, step_comm) for s in steps[1:])
                comm = step_comm * (world - 1)
                hidden = sum(min(s, step_comm) for s in steps[1:])
            else:
                comm = block * (world - 1) / bps
                total = comm + local_s + remote_s
                hidden = 0.0
        per_rank.append({"compute_s": local_s + remote_s, "comm_s": comm, "total_s": total, "hidden_s": hidden})
    slowest = max(p["total_s"] for p in per_rank)
    comm_total = sum(p["comm_s"] for p in per_rank)
    return {
        "scheme": scheme,
        "slowest_rank_s": slowest,
        "overlap_efficiency": (sum(p["hidden_s"] for p in per_rank) / comm_total) if comm_total else 1.0,
        "per_rank": per_rank,
    }
