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


@pytest.mark.skipif(not (ROOT / ".git").exists(), reason="the tables' dates come from git")
def test_the_readme_result_tables_are_what_results_table_makes():
    import results_table  # scripts/, on pytest's pythonpath

    readme = (ROOT / "README.md").read_text()
    block = readme.split(results_table.BEGIN)[1].split(results_table.END)[0]
    assert block.strip() == results_table.readme_tables().strip()
    for _, names in results_table.README_TABLES:
        assert all((ROOT / "bench" / "results" / n).exists() for n in names)
    assert re.search(r"\*\*Forward, S = 8K\*\* \(`fwd_bench_v12_8k_peers.json`, .*; measured \d{4}-\d\d-\d\d\):", block)


def test_results_table_writes_between_the_markers_only(tmp_path):
    import results_table

    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\nbefore\n{results_table.BEGIN}\nold\n{results_table.END}\n\nafter\n")
    results_table.write_readme(readme, "| new |")
    assert readme.read_text() == f"# x\n\nbefore\n{results_table.BEGIN}\n| new |\n{results_table.END}\n\nafter\n"
    readme.write_text("no markers\n")
    with pytest.raises(SystemExit, match="must hold the markers"):
        results_table.write_readme(readme, "| new |")


def test_results_table_names_files_commits_and_dates(monkeypatch):
    import results_table

    monkeypatch.setattr(results_table, "commit_date", {"a1": "2026-01-02", "b2": "2026-03-04"}.get)
    rows = [{"commit": "b2"}, {"commit": "a1"}, {"commit": "zz"}]
    assert results_table.provenance(["x.json", "y.json"], rows) == (
        "(`x.json`, `y.json`; commits a1, b2, zz, measured 2026-01-02 to 2026-03-04)"
    )
    assert results_table.provenance(["x.json"], rows[:1], with_commits=False) == "(`x.json`; measured 2026-03-04)"
