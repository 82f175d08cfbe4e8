"""Charts from the JSON results: TFLOP/s per mask per backend, and scaling with sequence length.

    python scripts/plot.py bench/results/fwd_bench_v12_8k_peers.json bench/results/fwd_bench_v12_32k_peers.json \
        --out docs/fwd_tflops.png    # the chart in docs/results.md
    python scripts/plot.py runs/*.json        # records of `python -m flashmask3 -m ...`: runs/tflops.png

Kernel benchmark files (`scripts/bench_fwd.py`) give one bar group per mask and sequence length
(cute, FA4 native, FA4 with block sparsity, Flex FLASH and Triton, cuDNN) plus a scaling panel;
main-job records give fwd TFLOP/s per mask per backend.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

# fa4_sparse: FA4 with our block lists; flashmask_v3, cudnn_flex: the other column/interval-mask kernels
BACKENDS = ("cute", "fa4", "fa4_sparse", "flex_flash", "flex", "cudnn", "flashmask_v3", "cudnn_flex")


def load_rows(paths: list[str]) -> tuple[list[dict], list[dict]]:
    """(kernel benchmark rows, main-job records) from the given JSON files."""
    bench, records = [], []
    for path in paths:
        data = json.loads(Path(path).read_text())
        if "bench" in data:
            bench += data["bench"]
        elif "config" in data and "fwd_tflops" in data:
            records.append(data)
    return bench, records


def plot_bench(rows: list[dict], out: str) -> None:
    seqlens = sorted({r["seqlen"] for r in rows})
    masks = list(dict.fromkeys(r["mask"] for r in rows))
    fig, axes = plt.subplots(len(seqlens) + 1, 1, figsize=(13, 3.6 * (len(seqlens) + 1)))
    backends = [b for b in BACKENDS if any(f"{b}_tflops" in r for r in rows)]
    width = 0.8 / len(backends)
    direction = "forward + backward" if any("deterministic" in r for r in rows) else "forward"  # bench_bwd rows
    for ax, seqlen in zip(axes, seqlens):
        by_mask = {r["mask"]: r for r in rows if r["seqlen"] == seqlen}
        for i, backend in enumerate(backends):
            xs = [m for m, name in enumerate(masks) if f"{backend}_tflops" in by_mask.get(name, {})]
            ys = [by_mask[masks[m]][f"{backend}_tflops"] for m in xs]
            if xs:
                ax.bar([x + (i - (len(backends) - 1) / 2) * width for x in xs], ys, width, label=backend, color=f"C{i}")
        ax.set_xticks(range(len(masks)), masks, rotation=25, ha="right", fontsize=8)
        ax.set_ylabel("TFLOP/s (unmasked work)")
        ax.set_title(f"{direction}, S = {seqlen // 1024}K, hidden 4096, 128K tokens per run")
        ax.legend(fontsize=8, ncol=4)
    scaling = axes[-1]
    per_mask = defaultdict(list)
    for r in rows:
        per_mask[r["mask"]].append((r["seqlen"], r["cute_tflops"]))
    for name, points in per_mask.items():
        points.sort()
        scaling.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=name)
    scaling.set_xscale("log", base=2)
    scaling.set_xlabel("sequence length")
    scaling.set_ylabel("cute TFLOP/s")
    scaling.set_title(f"scaling of the cute {direction} with sequence length")
    scaling.legend(fontsize=7, ncol=4)
    fig.tight_layout()
    fig.savefig(out, dpi=70)


def plot_records(records: list[dict], out: str) -> None:
    values = defaultdict(dict)
    for r in records:
        c = r["config"]
        values[f"{c['mask']['name']}\nS={c['seqlen']}"][c["backend"]] = r["fwd_tflops"]
    labels = list(values)
    backends = sorted({b for v in values.values() for b in v})
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(labels)), 4))
    width = 0.8 / max(1, len(backends))
    for i, backend in enumerate(backends):
        xs = [x for x, label in enumerate(labels) if backend in values[label]]
        ax.bar([x + i * width for x in xs], [values[labels[x]][backend] for x in xs], width, label=backend)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(labels))], labels, fontsize=8)
    ax.set_ylabel("forward TFLOP/s (unmasked work)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=70)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+")
    # Under runs/ by default, so a chart of a sweep never overwrites the committed figures in docs/.
    parser.add_argument("--out", type=Path, default=Path("runs/tflops.png"))
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    bench, records = load_rows(args.files)
    if not bench and not records:
        raise SystemExit("no benchmark rows or main-job records in the given files")
    if bench:
        plot_bench(bench, args.out)
    else:
        plot_records(records, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
