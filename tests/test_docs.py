"""The README and the kernel notes cite measured results by file name: each must be committed."""

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
