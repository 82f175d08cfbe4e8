"""Markdown tables of the benchmark JSON (bench_fwd.py / bench_bwd.py `bench` records), peers as columns.

    python scripts/results_table.py bench/results/fwd_bench_v12_8k_peers.json bench/results/fwd_bench_v13_8k_fa4.json

One row per (mask, sequence length), TFLOP/s on unmasked work; a later file's row replaces an
earlier one's for the same mask and length (pass them oldest first). The last column is ours over
the fastest peer that ran the mask. The README's result tables are this script's output.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

PEERS = ("fa4", "fa4_sparse", "flex_flash", "flex", "cudnn")
PEER_NAMES = {
    "fa4": "FA4 native",
    "fa4_sparse": "FA4 block-sparse",
    "flex_flash": "Flex FLASH",
    "flex": "Flex Triton",
    "cudnn": "cuDNN",
}


def merged_rows(records: list[dict]) -> list[dict]:
    """The records' bench rows, one per (mask, seqlen), later records winning, in first-seen order."""
    rows: dict[tuple, dict] = {}
    for record in records:
        for row in record["bench"]:
            rows[(row["mask"], row["seqlen"])] = {**row, "commit": record.get("commit", "?")}
    return list(rows.values())


def table(rows: list[dict]) -> str:
    """The markdown table: the peers that appear in any row become columns."""
    peers = [p for p in PEERS if any(f"{p}_tflops" in r for r in rows)]
    head = ["mask", "S", "ours", *(PEER_NAMES[p] for p in peers), "ours / best peer"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        ran = {p: r[f"{p}_tflops"] for p in peers if f"{p}_tflops" in r}
        cells = [
            r["mask"],
            f"{r['seqlen'] // 1024}K",
            f"{r['cute_tflops']:.0f}",
            *(f"{ran[p]:.0f}" if p in ran else "–" for p in peers),
            f"{r['cute_tflops'] / max(ran.values()):.2f}" if ran else "–",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+", type=Path)
    args = parser.parse_args()
    rows = merged_rows([json.loads(f.read_text()) for f in args.files])
    print(table(rows))
    print(
        "\n("
        + ", ".join(sorted({f"{f.name}" for f in args.files}))
        + "; commits "
        + ", ".join(sorted({r["commit"] for r in rows}))
        + ")"
    )


if __name__ == "__main__":
    main()
