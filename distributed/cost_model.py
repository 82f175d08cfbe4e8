"""A cost model (a model, not a measurement) of CP attention time per rank, forward and backward.

It follows the order of operations of the code (default config: pruning, overlap), per rank:

- Compute: each kernel call the code makes costs its tiles at the kernel's sustained rate:
  non-skipped 128 x 128 tiles, PARTIAL ones weighted by PARTIAL_TILE_COST, the forward at 577
  TFLOP/s and the backward (2.5x the forward's FLOPs) at 533 TFLOP/s, both measured on the H200 at
  8K with the full mask (bwd_bench_v13_8k_fmv3_cudnn.json: fwd+bwd 544 TFLOP/s). Calls per
  direction: mask_aware two (the own chunks, the remote chunks; none for an empty set), ring one
  per step whose block the rank needs, allgather one. With `fit`, each call costs the fitted rank
  time below instead.
- Communication: bytes per link (NVLink 450 GB/s per direction inside a node, 400 Gb/s = 50 GB/s
  per GPU between nodes); one batch of messages takes a rank its larger direction on its slowest
  link in use. K/V travel in the input dtype, dK/dV in fp32 (the accumulator the code sends).
  Hierarchical routing's phases run one after the other (the relays forward what the first
  brought), so their times add.

Per scheme, with C_p the K/V routes' phase p (C_0 inter-node where hierarchical), D_p the dK/dV
return of phase p, F / B forward / backward calls on the own (o) and remote (r) chunks or on the
ring's step s, X one K/V block and Y one dK/dV block to the next rank:
- mask_aware: forward max(F_o, C_0) + C_1 + F_r (the own chunks computed while phase 0 travels);
  backward C_0 + C_1 (K/V fetched again; none with `hold_remote_kv`) + B_r + D_1 + max(B_o, D_0)
  (the own chunks' backward while the last return phase travels).
- ring: forward sum over s < R-1 of max(F_s, X), + F_{R-1} (step s computes while block s+1
  travels); backward max(B_0, X) + sum over 0 < s < R-1 of max(B_s, X + Y) + max(B_{R-1}, Y) + Y
  (the next K/V block and the previous step's dK/dV accumulator share the link; X = 0 when held).
- allgather: forward all-gather, then one call; backward the all-gather again (unless held), one
  call, the reduce-scatter of dK/dV.
- mask_aware with `stage_chunks=k` (`CPConfig.stage_chunks`: flat routing, the remote K/V in n
  stages of at most k chunks per rank, n the same on every rank; the code's stages, each rank's
  chunks in ring order), with S_s / E_s the K/V / dK/dV messages of stage s, F_s / B_s one call
  on the rank's chunks of stage s (none where it receives nothing in it; every call pays its
  fixed cost): forward max(F_o, S_0) + sum over s < n-1 of max(F_s, S_{s+1}) + F_{n-1} (stage 0
  travels under the own chunks, stage s+1 under stage s);
  backward S_0 + sum over s of max(B_s, S_{s+1} + E_{s-1}) + max(B_o, E_{n-1}) (the next stage's
  K/V and the previous stage's dK/dV share the link under stage s; the last stage's dK/dV go home
  under the own chunks; S_n = E_{-1} = 0). A stage's transfer starts only under the compute before
  it (a pipeline of one step, as the ring's). K/V held at peak per rank: the own plus the two
  largest consecutive stages' receive buffers (stage s+1 is posted before stage s is let go),
  against the own plus every remote chunk in one stage. As everywhere here, a rank is charged its
  own messages only (not a wait on a sender busy with other receivers), so the order of the
  stages shows only in what a rank itself sends and receives in each.
Overlap efficiency = the part of the transfer time hidden under compute, both directions.

`RankTimeFit`: the mask-aware rank's measured compute time is not tiles / rate alone. Fitted on the
H200 rank-by-rank timings of the forward and the backward call (scripts/cp_rank_times.py
--backward, scripts/cp_calibrate.py, bench/results/cp_calibration_fwd_bwd_h200.json), each is
    seconds = fixed + per_load * (its chunks' workload) + per_needed_chunk * (KV chunks it needs),
the last term being the cost of each extra KV chunk in the union call (gathering it, its mask
and tile plan): 0.18 ms fixed forward, 0.36 ms backward. `predict(..., fit=RankTimeFit())`
charges it per call of every scheme (`RankTimeFit.from_calibration` reads another calibration).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..reference import PARTIAL, ColumnMask
from .balance import PARTIAL_TILE_COST
from .context_parallel import CPConfig, _Layout
from .plan import CPPlan

NVLINK_BPS = 450e9
INTER_NODE_BPS = 400e9 / 8
BACKWARD_FLOPS = 2.5
"""Backward FLOPs per forward FLOP (five matmuls to two)."""
_GRAD_BYTES = 4  # dK/dV travel in fp32


@dataclass(frozen=True)
class Hardware:
    tflops: float = 577.0  # sustained forward kernel rate on unmasked work
    bwd_tflops: float = 533.0  # sustained backward kernel rate (2.5x the forward's FLOPs)
    ranks_per_node: int = 8
    nvlink_bps: float = NVLINK_BPS
    inter_node_bps: float = INTER_NODE_BPS


@dataclass(frozen=True)
class RankTimeFit:
    """A rank's local attention call (8K queries, 32 x 128 query heads, 8 KV heads, bf16) fitted to
    the H200 rank-by-rank measurements of today's kernels, forward and backward
    (bench/results/cp_calibration_fwd_bwd_h200.json, scripts/cp_calibrate.py). Forward: the free fit
    ("load_and_needed_chunks", R^2 0.999; pinned to 577 TFLOP/s it would need a negative fixed cost:
    the kernel outruns that rate). Backward: the per-load slope pinned to the backward kernel's rate
    ("backward_kernel_rate_slope", R^2 0.997; the free slope is within 2% of it)."""

    fixed_s: float = 0.183e-3
    per_load_s: float = 0.390e-6  # per unit of `chunk_loads` (a 128 x 128 tile x 32 heads)
    per_needed_chunk_s: float = 12.4e-6
    # The backward call's; None: the forward's fixed and per-chunk costs, its per-load cost scaled
    # by the backward's FLOPs and rate.
    bwd_fixed_s: float | None = 0.359e-3
    bwd_per_load_s: float | None = 1.259e-6
    bwd_per_needed_chunk_s: float | None = 0.70e-6

    def seconds(self, load: float, needed_chunks: int) -> float:
        return self.fixed_s + self.per_load_s * load + self.per_needed_chunk_s * needed_chunks

    def backward_seconds(self, load: float, needed_chunks: int, hw: Hardware) -> float:
        """A backward call on the same chunks as a forward call of `load`."""
        fixed = self.fixed_s if self.bwd_fixed_s is None else self.bwd_fixed_s
        per_load = self.bwd_per_load_s
        if per_load is None:
            per_load = self.per_load_s * BACKWARD_FLOPS * hw.tflops / hw.bwd_tflops
        per_chunk = self.per_needed_chunk_s if self.bwd_per_needed_chunk_s is None else self.bwd_per_needed_chunk_s
        return fixed + per_load * load + per_chunk * needed_chunks

    @classmethod
    def from_calibration(
        cls, calibration: dict, forward: str = "load_and_needed_chunks", backward: str = "backward_kernel_rate_slope"
    ) -> RankTimeFit:
        """The fits named `forward` and `backward` of a `scripts/cp_calibrate.py` result; without a
        backward fit (forward-only timings) the backward is derived from the forward."""
        fits = calibration["fits"]
        coef = {"per_needed_chunk_s": 0.0, **fits[forward]["coef"]}
        bwd = fits[backward]["coef"] if backward in fits else {}
        return cls(
            coef["fixed_s"],
            coef["per_load_s"],
            coef["per_needed_chunk_s"],
            bwd.get("fixed_s"),
            bwd.get("per_load_s"),
            bwd.get("per_needed_chunk_s"),
        )


def received_chunk_load(
    chunk_size: int,
    kv_heads: int,
    head_dim: int,
    hw: Hardware = Hardware(),
    fit: RankTimeFit = RankTimeFit(),
    bytes_per_elem: int = 2,
) -> float:
    """Receiving one K/V chunk between nodes in units of `chunk_loads` (the fit's seconds per unit):
    the `chunk_comm` of `balance` / `make_plan` that counts communication with compute."""
    return 2 * chunk_size * kv_heads * head_dim * bytes_per_elem / hw.inter_node_bps / fit.per_load_s


def _tile_weight(local: ColumnMask) -> float:
    """Non-skipped 128 x 128 tiles, PARTIAL ones weighted, over batch and mask heads (the units of
    `chunk_loads`)."""
    classes = local.block_classes(128, 128).classes
    return float(((classes == PARTIAL) * PARTIAL_TILE_COST + (classes > PARTIAL)).sum())


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
    hold_remote_kv: bool = False,
    stage_chunks: int | None = None,
) -> dict:
    """Modeled per-rank seconds, forward and backward, the slowest rank and the overlap efficiency.

    Returns {"scheme", "slowest_rank_s" (forward + backward), "slowest_forward_s",
    "slowest_backward_s", "overlap_efficiency", "per_rank": [{"forward_s", "backward_s", "total_s",
    "compute_s", "comm_s", "hidden_s"}]}. With `fit`, each kernel call costs `fit.seconds` of its
    load and chunks instead of its tiles at the kernel rate.

    With `stage_chunks` (mask_aware only, flat routing whatever `hw.ranks_per_node`; not with
    `hold_remote_kv`), the staged fetch; the result and each per_rank entry also carry
    "stages", "peak_kv_bytes" (own K/V + at most two stages' receive buffers; the result's: the
    largest rank's) and "single_stage_peak_kv_bytes" (own + every remote chunk the rank needs).
    """
    if stage_chunks is not None:
        CPConfig(scheme=scheme, hold_remote_kv=hold_remote_kv, stage_chunks=stage_chunks)  # its checks
    world, chunk = plan.world_size, plan.chunk_size
    kv_bytes = 2 * chunk * kv_heads * head_dim * bytes_per_elem
    grad_bytes = kv_bytes // bytes_per_elem * _GRAD_BYTES
    layout = _Layout(mask, plan, CPConfig(scheme="mask_aware", ranks_per_node=hw.ranks_per_node))
    stages: list[dict[tuple[int, int], list[int]]] = []  # the staged fetch's (flat routing)
    if stage_chunks is not None:
        stages = _Layout(mask, plan, CPConfig(stage_chunks=stage_chunks)).stages or []
    flops_per_weight = 4 * 128 * 128 * head_dim * heads / mask.heads

    def call_s(weight: float, chunks: int, backward: bool) -> float:
        """One kernel call on `chunks` needed chunks of total tile weight `weight` (none: no call)."""
        if not chunks:
            return 0.0
        if fit is not None:
            return fit.backward_seconds(weight, chunks, hw) if backward else fit.seconds(weight, chunks)
        flops = weight * flops_per_weight * (BACKWARD_FLOPS if backward else 1.0)
        return flops / ((hw.bwd_tflops if backward else hw.tflops) * 1e12)

    def batch_s(messages: dict, rank: int, chunk_bytes: int, back: bool = False) -> float:
        """One batch of messages (reversed where `back`): the rank's larger direction, slowest link."""
        sent, received = {"nv": 0, "ib": 0}, {"nv": 0, "ib": 0}
        for (src, dst), chunks in messages.items():
            if back:
                src, dst = dst, src
            link = "nv" if src // hw.ranks_per_node == dst // hw.ranks_per_node else "ib"
            if src == rank:
                sent[link] += len(chunks) * chunk_bytes
            if dst == rank:
                received[link] += len(chunks) * chunk_bytes
        return max(max(sent["nv"], received["nv"]) / hw.nvlink_bps, max(sent["ib"], received["ib"]) / hw.inter_node_bps)

    per_rank = []
    for r in range(world):
        weights = {c: _tile_weight(layout.union_mask(r, [c])) for c in layout.needed(r, range(plan.num_chunks))}

        def calls(chunks, backward: bool) -> float:
            needed = [c for c in chunks if c in weights]
            return call_s(sum(weights[c] for c in needed), len(needed), backward)

        own = plan.assignment[r]
        remote = [c for c in weights if c not in own]
        if stage_chunks is not None:
            staged = _staged(r, own, remote, calls, batch_s, stages, kv_bytes, grad_bytes)
            forward, backward, compute, comm, hidden, held = staged
        elif scheme == "mask_aware":
            fetch = [batch_s(phase, r, kv_bytes) for phase in layout.phases]
            back = [batch_s(phase, r, grad_bytes, back=True) for phase in layout.phases]
            f_own, f_remote = calls(own, False), calls(remote, False)
            b_own, b_remote = calls(own, True), calls(remote, True)
            refetch = 0.0 if hold_remote_kv else sum(fetch)
            forward = max(f_own, fetch[0]) + sum(fetch[1:]) + f_remote
            backward = refetch + b_remote + sum(back[1:]) + max(b_own, back[0])
            compute = f_own + f_remote + b_own + b_remote
            comm = sum(fetch) + refetch + sum(back)
            hidden = min(f_own, fetch[0]) + min(b_own, back[0])
        else:
            bps = hw.inter_node_bps if world > hw.ranks_per_node else hw.nvlink_bps
            block_kv = len(own) * kv_bytes / bps
            block_grad = len(own) * grad_bytes / bps
            refetch = 0.0 if hold_remote_kv else block_kv
            if scheme == "ring":
                blocks = [plan.assignment[(r - s) % world] for s in range(world)]
                f_steps = [calls(b, False) for b in blocks]
                b_steps = [calls(b, True) for b in blocks]
                # What travels during each step's compute: forward, the next K/V block; backward,
                # the next K/V block and the previous step's dK/dV accumulator (the last step's
                # accumulator goes home after it).
                f_comm = [block_kv] * (world - 1) + [0.0]
                b_comm = [refetch + block_grad * (s > 0) for s in range(world - 1)] + [block_grad * (world > 1)]
                home = block_grad * (world > 1)
                forward = sum(max(f, c) for f, c in zip(f_steps, f_comm))
                backward = sum(max(b, c) for b, c in zip(b_steps, b_comm)) + home
                compute = sum(f_steps) + sum(b_steps)
                comm = sum(f_comm) + sum(b_comm) + home
                hidden = sum(min(f, c) for f, c in zip(f_steps, f_comm)) + sum(
                    min(b, c) for b, c in zip(b_steps, b_comm)
                )
            else:
                gather, scatter = block_kv * (world - 1), block_grad * (world - 1)
                f_all, b_all = calls(range(plan.num_chunks), False), calls(range(plan.num_chunks), True)
                refetch = 0.0 if hold_remote_kv else gather
                forward = gather + f_all
                backward = refetch + b_all + scatter
                compute, comm, hidden = f_all + b_all, gather + refetch + scatter, 0.0
        per_rank.append(
            {
                "forward_s": forward,
                "backward_s": backward,
                "total_s": forward + backward,
                "compute_s": compute,
                "comm_s": comm,
                "hidden_s": hidden,
            }
        )
        if stage_chunks is not None:
            per_rank[-1] |= {
                "stages": len(stages),
                "peak_kv_bytes": (len(own) + held) * kv_bytes,
                "single_stage_peak_kv_bytes": (len(own) + len(remote)) * kv_bytes,
            }
    comm_total = sum(p["comm_s"] for p in per_rank)
    result = {
        "scheme": scheme,
        "slowest_rank_s": max(p["total_s"] for p in per_rank),
        "slowest_forward_s": max(p["forward_s"] for p in per_rank),
        "slowest_backward_s": max(p["backward_s"] for p in per_rank),
        "overlap_efficiency": (sum(p["hidden_s"] for p in per_rank) / comm_total) if comm_total else 1.0,
        "per_rank": per_rank,
    }
    if stage_chunks is not None:
        result["stage_chunks"] = stage_chunks
        result["stages"] = len(stages)
        for key in ("peak_kv_bytes", "single_stage_peak_kv_bytes"):
            result[key] = max(p[key] for p in per_rank)
    return result


def _staged(rank: int, own, remote, calls, batch_s, stages, kv_bytes: int, grad_bytes: int) -> tuple:
    """mask_aware with `stage_chunks`, one rank, in the code's order (`_kv_stages`,
    `_backward_mask_aware_staged`): (forward, backward, compute, comm, hidden seconds, the most
    remote chunks it holds at once). `calls(chunks, backward)` is one kernel call's seconds,
    `batch_s(messages, rank, chunk_bytes, back)` one batch of messages'."""
    n = len(stages)
    mine = [[c for (src, dst), chunks in stage.items() if dst == rank for c in chunks] for stage in stages]
    assert sorted(c for m in mine for c in m) == sorted(remote), "stages carry the remote chunks the rank needs"
    fetch = [batch_s(stage, rank, kv_bytes) for stage in stages] + [0.0]  # S_s, S_n = 0
    back = [0.0] + [batch_s(stage, rank, grad_bytes, back=True) for stage in stages]  # E_{s-1} at s: E_{-1} = 0
    f_own, b_own = calls(own, False), calls(own, True)
    f_stage, b_stage = [calls(m, False) for m in mine], [calls(m, True) for m in mine]
    if not n:  # nothing remote anywhere: the own chunks only
        return f_own, b_own, f_own + b_own, 0.0, 0.0, 0
    # Forward: stage 0 under the own chunks, stage s+1 under stage s, the last stage alone.
    f_under = [fetch[s + 1] for s in range(n)]
    forward = max(f_own, fetch[0]) + sum(max(f, c) for f, c in zip(f_stage, f_under))
    # Backward: stage 0's K/V alone, then under stage s the next stage's K/V and the previous
    # stage's dK/dV, under the own chunks the last stage's dK/dV.
    b_under = [fetch[s + 1] + back[s] for s in range(n)]
    backward = fetch[0] + sum(max(b, c) for b, c in zip(b_stage, b_under)) + max(b_own, back[n])
    compute = f_own + sum(f_stage) + b_own + sum(b_stage)
    comm = 2 * sum(fetch) + sum(back)
    hidden = (
        min(f_own, fetch[0])
        + sum(min(f, c) for f, c in zip(f_stage, f_under))
        + sum(min(b, c) for b, c in zip(b_stage, b_under))
        + min(b_own, back[n])
    )
    held = max((len(mine[s]) + (len(mine[s + 1]) if s + 1 < n else 0) for s in range(n)), default=0)
    return forward, backward, compute, comm, hidden, held
