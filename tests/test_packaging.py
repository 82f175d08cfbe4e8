"""Packaging: the library without its experiment tooling, the installed layout, the type check."""

import os
import subprocess
import sys
import sysconfig

import package_tree  # tools/, on pytest's pythonpath
import pytest

EXPERIMENT_PACKAGES = ("hydra", "omegaconf", "wandb", "tqdm", "matplotlib")  # the `experiments` extra


def test_the_library_works_without_the_experiment_packages():
    """With torch, numpy and numba only (the core dependencies): the API, the masks and a CP plan.
    The experiment packages are made unimportable, as where they are not installed."""
    code = f"""
import sys
for name in {EXPERIMENT_PACKAGES!r}:
    sys.modules[name] = None
import torch
import flashmask3 as fm
from flashmask3.distributed import chunk_loads, make_plan
mask = fm.ColumnMask.causal_document(torch.tensor([0, 200, 512]))
q = torch.randn(1, 512, 2, 32)
out = fm.attention(q, q, q, mask, backend="reference")
plan = make_plan(512, 2, chunks_per_rank=2, scheme="balanced", loads=chunk_loads(mask, 128))
print(tuple(out.shape), len(plan.assignment))
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["(1,", "512,", "2,", "32)", "2"]


def test_the_link_tree_imports_as_installed(tmp_path):
    """`tools/package_tree.py`, for a checkout that is not installed (the device machine's copy):
    with the tree on the path, and no site-packages hooks (-S, so no install of the package), the
    subpackages import from their top-level folders."""
    tree = package_tree.build(tmp_path)
    paths = sysconfig.get_paths()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree), paths["purelib"], paths["platlib"]]))
    code = "import flashmask3.distributed, flashmask3.verify, flashmask3.conf; print(flashmask3.reference.__file__)"
    result = subprocess.run(
        [sys.executable, "-S", "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(tree / "flashmask3" / "reference" / "__init__.py")
    assert (tree / "flashmask3" / "reference" / "mask.py").resolve() == package_tree.ROOT / "reference" / "mask.py"


def test_the_typed_core_passes_mypy():
    """`tools/typecheck.py`: the targets and settings of pyproject.toml's [tool.mypy]."""
    pytest.importorskip("mypy")
    result = subprocess.run(
        [sys.executable, str(package_tree.ROOT / "tools" / "typecheck.py")], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]])
def test_the_tree_passes_ruff(command):
    """The house style: pyproject.toml's [tool.ruff] lint rules and formatting."""
    pytest.importorskip("ruff")
    result = subprocess.run(
        [sys.executable, "-m", "ruff", *command, str(package_tree.ROOT)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr
