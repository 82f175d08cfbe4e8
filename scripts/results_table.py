"""Markdown tables of the benchmark JSON (bench_fwd.py / bench_bwd.py `bench` records), peers as columns.

    python scripts/results_table.py bench/results/fwd_bench_v12_8k_peers.json bench/results/fwd_bench_v13_8k_fa4.json
    python scripts/results_table.py --readme              # the README's result tables, as the README has them
    python scripts/results_table.py --readme --write README.md   # regenerate them there

One row per (mask, sequence length), TFLOP/s on unmasked work; a later file's row replaces an
earlier one's for the same mask and length (pass them oldest first). The last column is ours over
the fastest peer that ran the mask. Each table is followed by its files, the commits they were
measured at and those commits' dates (from git). `--readme` makes the README's tables, from the
files of `README_TABLES` in bench/results/, each under its title and with the date it was measured;
`--write` puts them between the README's `<!-- results_table.py -->` markers.
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
BEGIN, END = "<!-- results_table.py --readme: begin -->", "<!-- results_table.py --readme: end -->"

PEERS = ("fa4", "fa4_sparse", "flex_flash", "flex", "cudnn", "flashmask_v3", "cudnn_flex")
PEER_NAMES = {
    "fa4": "FA4 native",
    "fa4_sparse": "FA4 block-sparse",
    "flex_flash": "Flex FLASH",
    "flex": "Flex Triton",
    "cudnn": "cuDNN",
    "flashmask_v3": "FlashMask V3",
    "cudnn_flex": "cuDNN flex_attention",
}

# The README's result tables: title, then the files (oldest first) in bench/results/.
README_TABLES: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "Forward, S = 8K, the causal masks on the current kernels (diagonal-only and off-diagonal tiles)",
        ("fwd_bench_8k_causal_masks_peers.json",),
    ),
    (
        "Forward + backward, S = 8K, every mask (three Q/dO stages, before the dQ writer warp)",
        ("bwd_bench_8k_q_stages_3_peers.json",),
    ),
    (
        "Forward, S = 8K, every mask against FA4 native, cuDNN flex_attention and Flex Triton",
        ("fwd_bench_8k_fa4_cudnn_flex_flex.json",),
    ),
    (
        "Forward + backward, S = 8K, every mask against FA4, Flex Triton and cuDNN (diagonal-only steps)",
        ("bwd_bench_8k_diagonal_steps_fa4_flex_cudnn.json", "bwd_bench_8k_diagonal_steps_sparse_cudnn_flex.json"),
    ),
    (
        "Forward + backward, S = 8K, against cuDNN's interval-mask attention (diagonal-only steps)",
        ("bwd_bench_8k_diagonal_steps_cudnn_flex.json",),
    ),
    ("Forward, S = 8K, the column-mask kernels (earlier kernels)", ("fwd_bench_v14_8k_fmv3_cudnn.json",)),
    (
        "Forward + backward, S = 8K, the column-mask kernels (earlier kernels)",
        ("bwd_bench_v14_8k_fmv3_cudnn.json",),
    ),
    ("Forward, S = 32K, the column-mask kernels (the previous kernels)", ("fwd_bench_v13_32k_fmv3_cudnn.json",)),
    (
        "Forward + backward, S = 32K, the column-mask kernels (the previous kernels)",
        ("bwd_bench_v13_32k_fmv3_cudnn.json",),
    ),
    ("Forward, S = 8K", ("fwd_bench_v12_8k_peers.json", "fwd_bench_v13_8k_fa4.json")),
    ("Forward, S = 32K and 128K", ("fwd_bench_v12_32k_peers.json", "fwd_bench_v13_128k_partial.json")),
    (
        "Forward, the training shape: S = 32K, one sequence, 16 query / 4 KV heads",
        ("fwd_bench_train_32k_fmax_peers.json",),
    ),
    (
        "Forward + backward, the training shape: S = 32K, one sequence, 16 query / 4 KV heads (the dQ writer warp)",
        ("bwd_bench_train_32k_peers_h200.json",),
    ),
    (
        "Forward, MLA's head dims (q/k 192, v 128): S = 8K, 16 sequences, 16 heads",
        ("fwd_bench_hdim192_v128_8k_peers.json",),
    ),
    (
        "Forward + backward, head dim 256: S = 8K, 16 sequences, 16 heads",
        ("bwd_bench_hd256_8k_full_causal.json", "bwd_bench_hd256_8k_documents.json"),
    ),
)


def shape_of(row: dict) -> tuple:
    """(batch, query heads, KV heads, head dim) of a bench row, None where it does not say."""
    heads = row.get("heads")
    return row.get("batch"), heads, row.get("kv_heads") or heads, row.get("head_dim")


def merged_rows(records: list[dict]) -> list[dict]:
    """The records' bench rows, one per (mask, seqlen), later records winning, in first-seen order.
    A table has one shape: a later row of another shape (batch, heads, KV heads, head dim) for the
    same mask and length is a ValueError, not a replacement."""
    rows: dict[tuple, dict] = {}
    for record in records:
        for row in record["bench"]:
            key = (row["mask"], row["seqlen"])
            if key in rows and shape_of(rows[key]) != shape_of(row):
                raise ValueError(
                    f"{row['mask']} at S={row['seqlen']}: a row of shape {shape_of(row)} would replace one of "
                    f"{shape_of(rows[key])} (batch, heads, KV heads, head dim); put each shape in its own table"
                )
            rows[key] = {**row, "commit": record.get("commit", "?")}
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


def commit_date(commit: str) -> str | None:
    """The commit's date (YYYY-MM-DD) from git, or None where git or the commit is not there."""
    try:
        result = subprocess.run(
            ["git", "show", "-s", "--format=%cs", commit], cwd=ROOT, capture_output=True, text=True, timeout=30
        )
    except OSError:
        return None
    return result.stdout.strip() or None if result.returncode == 0 else None


def provenance(names: list[str], rows: list[dict], with_commits: bool = True) -> str:
    """`(files; commits A, B of DATE)`, or the dates alone without `with_commits`."""
    commits = sorted({r["commit"] for r in rows})
    dates = sorted({d for d in map(commit_date, commits) if d})
    files = ", ".join(f"`{n}`" for n in names)
    when = ("measured " + " to ".join(dict.fromkeys([dates[0], dates[-1]]))) if dates else ""
    if with_commits:
        return f"({files}; commits {', '.join(commits)}" + (f", {when}" if when else "") + ")"
    return f"({files}" + (f"; {when}" if when else "") + ")"


def readme_tables(results: Path = RESULTS) -> str:
    """The README's result tables, each with its title and files, from `README_TABLES`."""
    blocks = []
    for title, names in README_TABLES:
        rows = merged_rows([json.loads((results / n).read_text()) for n in names])
        blocks.append(f"**{title}** {provenance(list(names), rows, with_commits=False)}:\n\n{table(rows)}")
    return "\n\n".join(blocks)


def write_readme(readme: Path, tables: str) -> None:
    """Replace what stands between the README's markers by `tables`."""
    text = readme.read_text()
    if text.count(BEGIN) != 1 or text.count(END) != 1:
        raise SystemExit(f"{readme} must hold the markers {BEGIN!r} and {END!r} once each")
    head, rest = text.split(BEGIN)
    readme.write_text(f"{head}{BEGIN}\n{tables}\n{END}{rest.split(END)[1]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="*", type=Path)
    parser.add_argument("--readme", action="store_true", help="the README's tables, from bench/results/")
    parser.add_argument("--write", type=Path, metavar="README", help="with --readme: put them into this file")
    args = parser.parse_args()
    if args.readme == bool(args.files) or (args.write and not args.readme):
        parser.error("give either result files or --readme (with --write README to update the README)")
    if args.readme:
        tables = readme_tables()
        if args.write:
            write_readme(args.write, tables)
            print(f"wrote the result tables into {args.write}")
        else:
            print(tables)
        return
    rows = merged_rows([json.loads(f.read_text()) for f in args.files])
    print(table(rows))
    print("\n" + provenance([f.name for f in args.files], rows))


if __name__ == "__main__":
    main()
