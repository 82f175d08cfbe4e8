"""Draw the 12 benchmark masks (black = attend) into one PNG, runs/masks.png unless --out; or, with
--column-format, the column format on one small mask, runs/column_format.png unless --out.

python scripts/plot_masks.py --seqlen 1024 --out docs/masks.png   # the README's figure of the masks
python scripts/plot_masks.py --column-format --out docs/column_format.png   # the README's figure of the format
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from flashmask3.reference import ColumnMask, masks  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

# The column-format example: 16 tokens, a band of 3 keys each side and 2 global tokens, so that its
# columns show all four vectors, an interval left empty (start == end) and a column never masked.
EXAMPLE_SEQLEN, EXAMPLE_WINDOW, EXAMPLE_GLOBAL_TOKENS = 16, 3, 2
EXAMPLE_COLUMNS = (4, 9)  # the key columns whose intervals are drawn: LT only, then LT and UT
LT_COLOR, UT_COLOR = "tab:orange", "tab:blue"


def draw_masks(seqlen: int, seed: int) -> Figure:
    """The 12 benchmark masks at `seqlen`, each with its density and the share of 128 x 128 tiles skipped."""
    fig, axes = plt.subplots(3, 4, figsize=(12, 9.6))
    for ax, name in zip(axes.flat, masks.MASK_NAMES):
        mask = masks.build(name, seqlen, seed=seed)
        dense = mask.to_dense()[0, 0].float().numpy()
        ax.imshow(dense, cmap="Greys", interpolation="nearest", vmin=0, vmax=1)
        c = mask.block_classes(128, 128)
        ax.set_title(
            f"{name}\ndensity {mask.density():.2f}, skip {c.skip / c.classes.numel():.0%} of tiles", fontsize=9
        )
        ax.set_xticks([])
        ax.set_yticks([])
    fig.suptitle(f"The 12 benchmark masks, S = {seqlen} (rows: queries, columns: keys; black = attend)")
    fig.tight_layout()
    return fig


def draw_column_format() -> Figure:
    """One small non-causal mask as a grid of queries x keys, the masked rows of `EXAMPLE_COLUMNS`
    colored by interval (LT = [LTS, LTE), UT = [UTS, UTE)), and under each key column its four
    values: the whole mask is that [Sk, 4] table."""
    size = EXAMPLE_SEQLEN
    mask = ColumnMask.global_sliding_window(size, window=EXAMPLE_WINDOW, global_tokens=EXAMPLE_GLOBAL_TOKENS)
    dense = mask.to_dense()[0, 0].float().numpy()
    vectors = {name: values[0, 0].tolist() for name, values in zip(("LTS", "LTE", "UTS", "UTE"), mask.intervals())}

    fig, ax = plt.subplots(figsize=(5.6, 6.6))
    ax.imshow(dense, cmap="Greys", interpolation="nearest", vmin=0, vmax=1.6)  # attend: grey, masked: white
    for column in EXAMPLE_COLUMNS:
        for (start, end), color, label in (
            ((vectors["LTS"][column], vectors["LTE"][column]), LT_COLOR, "LT"),
            ((vectors["UTS"][column], vectors["UTE"][column]), UT_COLOR, "UT"),
        ):
            if end > start:
                ax.add_patch(Rectangle((column - 0.5, start - 0.5), 1, end - start, color=color, alpha=0.85, lw=0))
                ax.text(
                    column,
                    (start + end - 1) / 2,
                    f"{label} [{start}, {end})",
                    ha="center",
                    va="center",
                    rotation=90,
                    fontsize=7,
                    color="white",
                    weight="bold",
                )
        # The column, down through its four values in the table.
        ax.add_patch(Rectangle((column - 0.5, -0.5), 1, size + 4.6, fill=False, ec="black", lw=1.5, clip_on=False))
    for edge in range(size + 1):  # cell borders
        ax.plot([edge - 0.5] * 2, [-0.5, size - 0.5], color="white", lw=0.5)
        ax.plot([-0.5, size - 0.5], [edge - 0.5] * 2, color="white", lw=0.5)
    # The table: the four vectors, one value per key column, under the grid.
    for row, (name, values) in enumerate(vectors.items()):
        y = size + 0.6 + row
        color = LT_COLOR if name.startswith("LT") else UT_COLOR
        ax.text(-0.9, y, name, ha="right", va="center", fontsize=8, color=color, weight="bold")
        for column, value in enumerate(values):
            bold = "bold" if column in EXAMPLE_COLUMNS else "normal"
            ax.text(column, y, str(value), ha="center", va="center", fontsize=7, weight=bold)
    ax.text(
        (size - 1) / 2,
        size + 4.6,
        f"startend_row_indices[0, 0, j] = (LTS, LTE, UTS, UTE): [Sk, 4] values, causal=False, Sq = {size}",
        ha="center",
        va="center",
        fontsize=7,
    )
    ax.set_xlim(-0.5, size - 0.5)
    ax.set_ylim(size + 4.1, -0.5)
    ax.set_xticks(range(size))
    ax.set_yticks(range(size))
    ax.tick_params(labelsize=7, length=0, labeltop=True, labelbottom=False)
    ax.set_xlabel("key column j", fontsize=8)
    ax.xaxis.set_label_position("top")
    ax.set_ylabel("query row i", fontsize=8)
    for spine in ax.spines.values():
        spine.set_visible(False)
    first, second = EXAMPLE_COLUMNS
    ax.set_title(
        f"Column j masks query rows [LTS_j, LTE_j) ∪ [UTS_j, UTE_j) (grey = attend)\n"
        f"global_sliding_window(S={size}, window={EXAMPLE_WINDOW}, global_tokens={EXAMPLE_GLOBAL_TOKENS}): "
        f"column {first}: LT only, {second}: LT and UT",
        fontsize=8,
    )
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqlen", type=int, default=1024, help="the 12 masks' length")
    parser.add_argument("--seed", type=int, default=0, help="the 12 masks' seed (documents, eviction)")
    parser.add_argument(
        "--column-format", action="store_true", help="draw the column format on one 16 x 16 mask instead"
    )
    # Under runs/ by default, so a trial never overwrites the committed figures in docs/.
    parser.add_argument("--out", type=Path, help="the PNG (default runs/masks.png or runs/column_format.png)")
    args = parser.parse_args(argv)
    if args.column_format:  # a small grid: a higher resolution keeps its numbers legible
        fig, out, dpi = draw_column_format(), args.out or Path("runs/column_format.png"), 110
    else:
        fig, out, dpi = draw_masks(args.seqlen, args.seed), args.out or Path("runs/masks.png"), 72
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=dpi)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
