"""The installed package layout as a tree of links into the checkout, for uses without an install.

pyproject.toml maps the subpackages onto top-level folders (`flashmask3.reference` is `reference/`).
pip applies that mapping, `PYTHONPATH=.` does not; with `PYTHONPATH=DEST` after

    python tools/package_tree.py DEST

the checkout imports as installed (the device machine's copy, which is not installed), and mypy,
which cannot follow the mapping, sees the package it checks (`tools/typecheck.py`).
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: tomli, a dependency of pytest and mypy there
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]


def package_dirs() -> dict[str, str]:
    """pyproject.toml's package-dir mapping: package name -> folder of the checkout."""
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]


def build(dest: Path) -> Path:
    """DEST/flashmask3/...: a folder per package, its entries links to those of the mapped folder."""
    mapping = package_dirs()
    for top in {package.split(".")[0] for package in mapping}:
        shutil.rmtree(dest / top, ignore_errors=True)
    for package in sorted(mapping):  # parents before their subpackages
        folder = dest.joinpath(*package.split("."))
        folder.mkdir(parents=True)  # new: never a link into the checkout
        for entry in (ROOT / mapping[package]).iterdir():
            if entry.name != "__pycache__":
                (folder / entry.name).symlink_to(entry)
    return dest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dest", type=Path, help="folder to put the package in (its old copy is replaced)")
    print(build(parser.parse_args().dest))


if __name__ == "__main__":
    main()
