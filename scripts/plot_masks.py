"""Draw the 12 benchmark masks (black = attend) into one PNG, runs/masks.png unless --out.

python scripts/plot_masks.py --seqlen 1024 --out docs/masks.png   # the README's figure
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from flashmask3.reference import masks  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seqlen", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    # Under runs/ by default, so a trial never overwrites the committed figure in docs/.
    parser.add_argument("--out", type=Path, default=Path("runs/masks.png"))
    args = parser.parse_args()
    fig, axes = plt.subplots(3, 4, figsize=(12, 9.6))
    for ax, name in zip(axes.flat, masks.MASK_NAMES):
        mask = masks.build(name, args.seqlen, seed=args.seed)
        dense = mask.to_dense()[0, 0].float().numpy()
        ax.imshow(dense, cmap="Greys", interpolation="nearest", vmin=0, vmax=1)
        c = mask.block_classes(128, 128)
        ax.set_title(
            f"{name}\ndensity {mask.density():.2f}, skip {c.skip / c.classes.numel():.0%} of tiles", fontsize=9
        )
        ax.set_xticks([])
        ax.set_yticks([])
    fig.suptitle(f"The 12 benchmark masks, S = {args.seqlen} (rows: queries, columns: keys; black = attend)")
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=72)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
