"""The README and the kernel notes: the results they cite are committed, and the README's examples
run as a newcomer would run them."""

import math
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("doc", ["README.md", "docs/kernel-notes.md"])
def test_every_cited_result_file_exists(doc):
    cited = set(re.findall(r"`([\w.\-]+\.(?:json|txt))`", (ROOT / doc).read_text()))
    assert cited, f"{doc} cites no result files"
    missing = sorted(name for name in cited if not (ROOT / "bench" / "results" / name).exists())
    assert not missing, f"{doc} cites result files that are not in bench/results/: {missing}"


def readme_example(contains: str) -> str:
    (block,) = [b for b in re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S) if contains in b]
    return block


def test_the_readme_quickstart_runs():
    scope: dict = {}
    exec(readme_example('fm.attention(q, k, v, mask, backend="auto", return_lse=True)'), scope)
    assert tuple(scope["out"].shape) == (1, 8192, 32, 128) and tuple(scope["lse"].shape) == (1, 32, 8192)


def test_the_readme_hugging_face_example_runs():
    pytest.importorskip("transformers")
    scope: dict = {}
    exec(readme_example("LlamaConfig"), scope)
    assert math.isfinite(float(scope["loss"]))


def test_the_readme_paddle_example_runs():
    scope: dict = {}
    exec("import torch\nimport flashmask3 as fm\n" + readme_example("fm.flashmask_attention("), scope)
    assert tuple(scope["out"].shape) == (1, 1024, 4, 64) and tuple(scope["lse"].shape) == (1, 4, 1024)
