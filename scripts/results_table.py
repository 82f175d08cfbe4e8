"""Markdown tables of the benchmark JSON (bench_fwd.py / bench_bwd.py `bench` records), peers as columns.

    python scripts/results_table.py bench/results/fwd_bench_v12_8k_peers.json bench/results/fwd_bench_v13_8k_fa4.json
    python scripts/results_table.py --docs            # the README's and docs/results.md's tables
    python scripts/results_table.py --docs --write    # regenerate them in those files

One row per (mask, sequence length), TFLOP/s on unmasked work; a later file's row replaces an
earlier one's for the same mask and length (pass them oldest first). The last column is ours over
the fastest peer that ran the mask. Each table is followed by its files, the commits they were
measured at and those commits' dates (from git). `--docs` makes the tables of `DOCUMENTS` (the
README's newest runs, docs/results.md's earlier ones) from bench/results/, each under its title and
with the date it was measured; `--write` puts each document's between its
`<!-- results_table.py -->` markers.
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
BEGIN, END = "<!-- results_table.py: begin -->", "<!-- results_table.py: end -->"

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

# The README's result tables (the newest measurement of each comparison): title, then the files
# (oldest first) in bench/results/.
README_TABLES: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "Forward + backward, the training shape: S = 32K, one sequence, 16 query / 4 KV heads, against FA4 "
        "(on an H100 80GB HBM3; every mask with the split CTAs, the default on the causal one-bound masks)",
        ("bwd_bench_train_32k_split_ctas_fa4_h100.json", "bwd_bench_train_32k_fa4_kernel_cache_h100.json"),
    ),
    (
        "Forward + backward, the training shape: S = 32K, one sequence, 16 query / 4 KV heads (before the split CTAs)",
        ("bwd_bench_train_32k_peers_h200.json",),
    ),
    (
        "Forward, the training shape: S = 32K, one sequence, 16 query / 4 KV heads (on an H100 80GB HBM3; "
        "the two document masks and share-question from a later run, full and causal from a third with their "
        "key tiles counted in registers, against FA4 native and block-sparse)",
        (
            "fwd_bench_train_32k_peers_segment_tiles_h100.json",
            "fwd_bench_train_32k_lazy_fa4_h100.json",
            "fwd_bench_without_sinks_train_32k_fa4_h100.json",
            "fwd_bench_train_32k_full_causal_fa4_h100.json",
        ),
    ),
    (
        "Forward with attention sinks, the training shape: S = 32K, one sequence, 16 query / 4 KV heads, every "
        "contender with the same per-head sink logits (FA4's `learnable_sink`; on an H100 80GB HBM3)",
        ("fwd_bench_sinks_train_32k_fa4_h100.json",),
    ),
    (
        "Forward + backward, S = 8K, every mask, against FA4 native, FA4 block-sparse and Flex FLASH "
        "(on an H100 80GB HBM3; the last seven masks against the two peers that run them)",
        ("bwd_bench_8k_native_masks_peers_h100.json", "bwd_bench_8k_column_masks_peers_h100.json"),
    ),
    (
        "Forward, S = 8K, every mask, against FA4 native, FA4 block-sparse and Flex FLASH (on an H100 80GB HBM3; "
        "full and causal from a later run with their key tiles counted in registers, against FA4 native alone: "
        "full at 1,515 MHz against FA4's 1,320 there, 0.95x per clock)",
        ("fwd_bench_8k_peers_h100.json", "fwd_bench_8k_full_causal_counted_keys_fa4_h100.json"),
    ),
    (
        "Forward, S = 8K, against cuDNN flex_attention (cudnn-frontend 1.32.0; on an H100 80GB HBM3, "
        "FA4 native and cuDNN's SDPA where they run the mask)",
        ("fwd_bench_8k_native_masks_cudnn_flex_h100.json", "fwd_bench_8k_column_masks_cudnn_flex_h100.json"),
    ),
    (
        "Forward + backward, S = 8K, against cuDNN flex_attention (cudnn-frontend 1.32.0; on an H100 80GB HBM3)",
        ("bwd_bench_8k_column_masks_cudnn_flex_h100.json",),
    ),
    (
        "Forward + backward, head dim 256: S = 32K, 4 sequences, 16 heads, against FA4 native and block-sparse "
        "(on an H100 80GB HBM3)",
        ("bwd_bench_hd256_32k_fa4_h100.json",),
    ),
    (
        "Forward, head dim 256: S = 32K, 4 sequences, 16 heads, against FA4 native and block-sparse "
        "(on an H100 80GB HBM3)",
        ("fwd_bench_hd256_32k_fa4_h100.json",),
    ),
    (
        "Forward + backward, head dim 256: S = 8K, 16 sequences, 16 heads, against FA4 native and block-sparse "
        "(on an H100 80GB HBM3; Flex FLASH does not take head dim 256's block sparsity)",
        ("bwd_bench_hd256_8k_peers_h100.json",),
    ),
    (
        "Forward, head dim 256: S = 8K, 16 sequences, 16 heads, against FA4 native and block-sparse "
        "(on an H100 80GB HBM3; the document masks before segment tiles, the causal two-bound and "
        "global-window masks with the lazy rescale, from a later run)",
        ("fwd_bench_hd256_8k_peers_h100.json", "fwd_bench_hd256_8k_lazy_w2_w4_fa4_sparse_h100.json"),
    ),
    (
        "Forward + backward, MLA's head dims (q/k 192, v 128): S = 32K, 4 sequences, 32 heads, against FA4 "
        "(on an H100 80GB HBM3)",
        ("bwd_bench_mla_32k_no_turn_barriers_fa4_h100.json",),
    ),
    (
        "Forward, MLA's head dims (q/k 192, v 128): S = 32K, 4 sequences, 32 heads, against FA4 (on an H100 80GB "
        "HBM3; the document masks with segment-aligned tiles)",
        ("fwd_bench_mla_32k_no_turn_barriers_fa4_h100.json",),
    ),
    (
        "Forward + backward, MLA's head dims (q/k 192, v 128): S = 8K, 16 sequences, 32 heads (on an H100 80GB HBM3)",
        ("bwd_bench_mla_8k_split_default_peers_h100.json",),
    ),
    (
        "Forward, MLA's head dims (q/k 192, v 128): S = 8K, 16 sequences, 16 heads (before segment-aligned tiles)",
        ("fwd_bench_hdim192_v128_8k_peers.json", "fwd_bench_hdim192_v128_8k_draw_order.json"),
    ),
    (
        "Forward + backward, head dim 64: S = 8K, 16 sequences, 64 heads (on an H100 80GB HBM3)",
        ("bwd_bench_hd64_8k_fa4_h100.json",),
    ),
)

# docs/results.md's tables: the earlier runs, on the kernels before the README's.
EARLIER_TABLES: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "Forward + backward, S = 8K, every mask, against FA4 and Flex FLASH "
        "(before the diagonal-only steps and the dQ writer)",
        ("bwd_bench_8k_q_stages_3_peers.json",),
    ),
    (
        "Forward + backward, S = 8K, every mask, against FA4, Flex Triton, cuDNN and cuDNN flex_attention "
        "(before the dQ writer)",
        ("bwd_bench_8k_diagonal_steps_fa4_flex_cudnn.json", "bwd_bench_8k_diagonal_steps_sparse_cudnn_flex.json"),
    ),
    (
        "Forward, S = 8K, every mask, against FA4, Flex Triton and cuDNN flex_attention (before segment-aligned tiles)",
        ("fwd_bench_8k_fa4_cudnn_flex_flex.json",),
    ),
    (
        "Forward + backward, MLA's head dims (q/k 192, v 128): S = 32K, 4 sequences, 32 heads, against FA4 "
        "(on an H100 80GB HBM3; the forward's warpgroups taking turns on the tensor cores)",
        ("bwd_bench_mla_32k_fa4_h100.json",),
    ),
    (
        "Forward, MLA's head dims (q/k 192, v 128): S = 32K, 4 sequences, 32 heads, against FA4 (on an H100 80GB "
        "HBM3; the forward's warpgroups taking turns on the tensor cores)",
        ("fwd_bench_mla_32k_fa4_h100.json",),
    ),
    (
        "Forward + backward, head dim 256: S = 8K, 16 sequences, 16 heads "
        "(on an H100 80GB HBM3; against FA4 native alone)",
        ("bwd_bench_hd256_8k_lazy_fa4_h100.json",),
    ),
    (
        "Forward, head dim 256: S = 8K, 16 sequences, 16 heads (on an H100 80GB HBM3; against FA4 native alone)",
        ("fwd_bench_hd256_8k_lazy_fa4_h100.json",),
    ),
    (
        "Forward + backward, head dim 256: S = 8K, 16 sequences, 16 heads (on an H100 80GB HBM3; "
        "before the lazy O rescale)",
        ("bwd_bench_hd256_8k_fa4_h100.json",),
    ),
    (
        "Forward, head dim 256: S = 8K, 16 sequences, 16 heads (on H100s 80GB HBM3; before the lazy O "
        "rescale; the causal masks from a later run)",
        ("fwd_bench_hd256_8k_fa4_h100.json", "fwd_bench_hd256_8k_causal_masks_fa4_h100.json"),
    ),
    (
        "Forward + backward, head dim 256: S = 8K, 16 sequences, 16 heads (before the dQ writer)",
        ("bwd_bench_hd256_8k_full_causal.json", "bwd_bench_hd256_8k_documents.json"),
    ),
    (
        "Forward, the training shape: S = 32K, one sequence, 16 query / 4 KV heads (before segment-aligned tiles)",
        ("fwd_bench_train_32k_fmax_peers.json",),
    ),
    (
        "Forward, S = 8K, the causal masks (diagonal-only and off-diagonal tiles)",
        ("fwd_bench_8k_causal_masks_peers.json",),
    ),
    (
        "Forward + backward, S = 8K, against cuDNN's interval-mask attention (diagonal-only steps)",
        ("bwd_bench_8k_diagonal_steps_cudnn_flex.json",),
    ),
    ("Forward, S = 8K, the column-mask kernels", ("fwd_bench_v14_8k_fmv3_cudnn.json",)),
    ("Forward + backward, S = 8K, the column-mask kernels", ("bwd_bench_v14_8k_fmv3_cudnn.json",)),
    ("Forward, S = 32K, the column-mask kernels", ("fwd_bench_v13_32k_fmv3_cudnn.json",)),
    ("Forward + backward, S = 32K, the column-mask kernels", ("bwd_bench_v13_32k_fmv3_cudnn.json",)),
    ("Forward, S = 8K", ("fwd_bench_v12_8k_peers.json", "fwd_bench_v13_8k_fa4.json")),
    ("Forward, S = 32K and 128K", ("fwd_bench_v12_32k_peers.json", "fwd_bench_v13_128k_partial.json")),
)

# Each document with generated tables, relative to the repository root, and its tables.
DOCUMENTS: dict[str, tuple[tuple[str, tuple[str, ...]], ...]] = {
    "README.md": README_TABLES,
    "docs/results.md": EARLIER_TABLES,
}


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
        label = "commit" if len(commits) == 1 else "commits"
        return f"({files}; {label} {', '.join(commits)}" + (f", {when}" if when else "") + ")"
    return f"({files}" + (f"; {when}" if when else "") + ")"


def document_tables(document: str, results: Path = RESULTS) -> str:
    """The result tables of `document` (a key of `DOCUMENTS`), each with its title and files."""
    blocks = []
    for title, names in DOCUMENTS[document]:
        rows = merged_rows([json.loads((results / n).read_text()) for n in names])
        blocks.append(f"**{title}** {provenance(list(names), rows, with_commits=False)}:\n\n{table(rows)}")
    return "\n\n".join(blocks)


def write_tables(document: Path, tables: str) -> None:
    """Replace what stands between the document's markers by `tables`."""
    text = document.read_text()
    if text.count(BEGIN) != 1 or text.count(END) != 1:
        raise SystemExit(f"{document} must hold the markers {BEGIN!r} and {END!r} once each")
    head, rest = text.split(BEGIN)
    document.write_text(f"{head}{BEGIN}\n{tables}\n{END}{rest.split(END)[1]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="*", type=Path)
    parser.add_argument("--docs", action="store_true", help="the tables of README.md and docs/results.md")
    parser.add_argument("--write", action="store_true", help="with --docs: put them into those files")
    args = parser.parse_args()
    if args.docs == bool(args.files) or (args.write and not args.docs):
        parser.error("give either result files or --docs (with --write to update the documents)")
    if args.docs:
        for document in DOCUMENTS:
            tables = document_tables(document)
            if args.write:
                write_tables(ROOT / document, tables)
                print(f"wrote the result tables into {document}")
            else:
                print(f"## {document}\n\n{tables}\n")
        return
    rows = merged_rows([json.loads(f.read_text()) for f in args.files])
    print(table(rows))
    print("\n" + provenance([f.name for f in args.files], rows))


if __name__ == "__main__":
    main()
