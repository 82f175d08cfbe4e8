"""Fit the mask-aware rank-time model to the H200 rank-by-rank timings (CPU; no GPU needed).

    python scripts/cp_calibrate.py bench/results/cp_rank_times_union_r4-32.json

For every measured rank (scripts/cp_rank_times.py), recompute on the CPU its workload (the balancer's
`chunk_loads` of its chunks) and the number of KV chunks its queries need, then least-squares fit
    rank seconds = fixed + per_load * load + per_needed_chunk * needed
(and, for comparison, without the needed-chunk term, and with the per-load slope pinned to the
kernel's measured rate; the last is the one the cost model uses, `RankTimeFit`); where the timings
have the backward call too (`cp_rank_times.py --backward`), the same pinned fit of it at the
backward kernel's rate (`RankTimeFit.from_calibration` reads both). Prints the fits
(R^2) and, per mask / CP size / assignment, the measured imbalance (max / mean rank time) next to
the tile-count model and the pinned fit. Writes runs/cp_calibration.json ($OUT/ if set; the
committed fit is in bench/results/).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from flashmask3.distributed import CPConfig, chunk_loads, make_plan
from flashmask3.distributed.context_parallel import _Layout
from flashmask3.distributed.cost_model import BACKWARD_FLOPS, Hardware
from flashmask3.reference import masks

from flashmask3.bench import git_commit, result_json, results_dir


def rank_features(row: dict, tokens_per_rank: int, chunk: int) -> np.ndarray:
    """[load, needed chunks] of each rank of one measured configuration."""
    world = row["ranks"]
    seqlen = world * tokens_per_rank
    mask = masks.build(row["mask"], seqlen, seed=0)
    loads = chunk_loads(mask, chunk)
    plan = make_plan(seqlen, world, tokens_per_rank // chunk, row["assignment"], loads)
    layout = _Layout(mask, plan, CPConfig(backend="reference"))
    return np.array([[loads[list(plan.assignment[r])].sum(), sum(map(bool, layout.needs[r]))] for r in range(world)])


def fit_summary(design: np.ndarray, y: np.ndarray, coef: np.ndarray, names: list[str]) -> dict:
    """The fit's coefficients by name, R^2 and RMS error."""
    residual = y - design @ coef
    return {
        "coef": dict(zip(names, np.asarray(coef, dtype=float).tolist())),
        "r2": float(1 - (residual**2).sum() / ((y - y.mean()) ** 2).sum()),
        "rms_error_s": float(np.sqrt((residual**2).mean())),
    }


def pinned_slope_fit(design: np.ndarray, y: np.ndarray, per_load_s: float) -> dict:
    """fixed + per_needed_chunk * needed fitted with the per-load slope pinned to `per_load_s` (the
    free slope trades off against the chunk term); a chunk cannot save time, so where its term
    comes out negative the fixed cost is fitted alone."""
    rest = y - per_load_s * design[:, 1]
    coef = np.linalg.lstsq(design[:, [0, 2]], rest, rcond=None)[0]
    if coef[1] < 0:
        coef = np.array([rest.mean(), 0.0])
    full = np.array([coef[0], per_load_s, coef[1]])
    return fit_summary(design, y, full, ["fixed_s", "per_load_s", "per_needed_chunk_s"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("rank_times", help="JSON written by scripts/cp_rank_times.py")
    parser.add_argument("--tokens-per-rank", type=int, default=8192)
    parser.add_argument("--chunk", type=int, default=2048)
    args = parser.parse_args()
    measured = json.loads(Path(args.rank_times).read_text())
    features = [rank_features(row, args.tokens_per_rank, args.chunk) for row in measured["rows"]]
    x = np.concatenate(features)
    y = np.concatenate([np.array(row["rank_ms"]) * 1e-3 for row in measured["rows"]])
    design = np.c_[np.ones(len(y)), x]
    fits = {}
    for name, cols in (("load_only", [0, 1]), ("load_and_needed_chunks", [0, 1, 2])):
        coef = np.linalg.lstsq(design[:, cols], y, rcond=None)[0]
        fits[name] = fit_summary(design[:, cols], y, coef, ["fixed_s", "per_load_s", "per_needed_chunk_s"][: len(cols)])
    tile_flops = 32 * 4 * 128**3  # one unit of `chunk_loads`: a 128 x 128 tile x 32 heads
    hw = Hardware()  # the kernels' sustained rates on unmasked work
    fits["kernel_rate_slope"] = pinned_slope_fit(design, y, tile_flops / (hw.tflops * 1e12))
    backward = all("rank_bwd_ms" in row for row in measured["rows"])
    if backward:  # the backward call, fitted the same way (`RankTimeFit`'s bwd_ fields)
        y_bwd = np.concatenate([np.array(row["rank_bwd_ms"]) * 1e-3 for row in measured["rows"]])
        per_load = BACKWARD_FLOPS * tile_flops / (hw.bwd_tflops * 1e12)
        fits["backward_kernel_rate_slope"] = pinned_slope_fit(design, y_bwd, per_load)
    coef = np.array(list(fits["kernel_rate_slope"]["coef"].values()))
    rows = []
    for row, f in zip(measured["rows"], features):
        times = np.array(row["rank_ms"])
        fitted = np.c_[np.ones(len(f)), f] @ coef
        entry = {
            "mask": row["mask"],
            "ranks": row["ranks"],
            "assignment": row["assignment"],
            "measured": float(times.max() / times.mean()),
            "tile_model": float(f[:, 0].max() / f[:, 0].mean()),
            "fitted_model": float(fitted.max() / fitted.mean()),
            "needed_chunks": [int(f[:, 1].min()), int(f[:, 1].max())],
        }
        if backward:
            bwd_coef = np.array(list(fits["backward_kernel_rate_slope"]["coef"].values()))
            bwd_times, bwd_fitted = np.array(row["rank_bwd_ms"]), np.c_[np.ones(len(f)), f] @ bwd_coef
            entry["measured_bwd"] = float(bwd_times.max() / bwd_times.mean())
            entry["fitted_bwd_model"] = float(bwd_fitted.max() / bwd_fitted.mean())
        rows.append(entry)
    result = {
        "commit": git_commit(),
        "command": " ".join(["python", *sys.argv]),
        "source": args.rank_times,
        "source_commit": measured.get("commit"),
        "fits": fits,
        "rows": rows,
    }
    out_dir = results_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "cp_calibration.json").write_text(result_json(result))
    for name, fit in fits.items():
        print(
            f"{name:24s} R^2 {fit['r2']:.3f}  rms {fit['rms_error_s'] * 1e3:.3f} ms  "
            + "  ".join(f"{k} {v:.3g}" for k, v in fit["coef"].items())
        )
    print(f"{'mask':18s} {'R':>3s} {'assignment':>10s} {'measured':>9s} {'tiles':>7s} {'fitted':>7s} {'needed':>7s}")
    for r in rows:
        print(
            f"{r['mask']:18s} {r['ranks']:3d} {r['assignment']:>10s} {r['measured']:9.3f} {r['tile_model']:7.3f} "
            f"{r['fitted_model']:7.3f} {r['needed_chunks'][0]:3d}-{r['needed_chunks'][1]}"
        )


if __name__ == "__main__":
    main()
