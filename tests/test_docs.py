"""The README and the kernel notes: the results they cite are committed, and the README's examples
run as a newcomer would run them."""

import math
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
CODE_FOLDERS = ("flashmask3", "reference", "optimized", "distributed", "verify", "scripts", "tools", "tests")


def cited_result_files(doc: str) -> set[str]:
    return set(re.findall(r"`([\w.\-]+\.(?:json|txt))`", (ROOT / doc).read_text()))


def test_every_result_file_the_readme_cites_is_committed():
    cited = cited_result_files("README.md")
    assert cited, "README.md cites no result files"
    missing = sorted(name for name in cited if not (RESULTS / name).exists())
    assert not missing, f"README.md cites result files that are not in bench/results/: {missing}"


def test_the_kernel_notes_cite_files_in_bench_results_or_in_git_history():
    """The notes' older result files were removed from bench/results/; the notes name the commit
    that has them, and each must be there."""
    notes = (ROOT / "docs" / "kernel-notes.md").read_text()
    (commit,) = set(re.findall(r"in git history at commit ([0-9a-f]{7,40})", notes))
    elsewhere = sorted(name for name in cited_result_files("docs/kernel-notes.md") if not (RESULTS / name).exists())
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    paths = "".join(f"{commit}:bench/results/{name}\n" for name in elsewhere)
    result = subprocess.run(
        ["git", "cat-file", "--batch-check"], cwd=ROOT, input=paths, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    absent = [line.split()[0] for line in result.stdout.splitlines() if line.endswith(" missing")]
    assert not absent, f"not in bench/results/ and not at {commit}: {absent}"


def test_bench_results_keeps_only_what_the_docs_or_the_code_read():
    """Only the JSON behind the README's tables and text or the kernel log's measurements (docs/),
    and files the code names; git history keeps the rest."""
    docs = "\n".join(p.read_text() for p in (ROOT / "README.md", *(ROOT / "docs").glob("*.md")))
    code = "\n".join(p.read_text() for folder in CODE_FOLDERS for p in (ROOT / folder).rglob("*.py"))
    unused = sorted(f.name for f in RESULTS.iterdir() if f.name not in docs and f.name not in code)
    assert not unused, f"bench/results/ holds files that neither the docs nor the code name: {unused}"


def readme_example(contains: str) -> str:
    (block,) = [b for b in re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S) if contains in b]
    return block


def test_the_readme_quickstart_runs():
    scope: dict = {}
    exec(readme_example('fm.attention(q, k, v, mask, backend="auto", return_lse=True)'), scope)
    assert tuple(scope["out"].shape) == (1, 8192, 32, 128) and tuple(scope["lse"].shape) == (1, 32, 8192)


def test_the_readme_flash_attention_forms_run():
    import torch

    import flashmask3 as fm

    q = torch.randn(1, 1024, 4, 32)
    k = v = torch.randn(1, 1024, 2, 32)
    scope: dict = {"fm": fm, "torch": torch, "q": q, "k": k, "v": v}
    exec(readme_example("fm.varlen_attention("), scope)
    expected = torch.cat(
        [
            fm.attention(x, y, z, causal=True)
            for x, y, z in ((q[:, s:e], k[:, s:e], v[:, s:e]) for s, e in ((0, 300), (300, 301), (301, 1024)))
        ],
        1,
    )[0]
    torch.testing.assert_close(scope["out"], expected)


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
@pytest.mark.parametrize("document", ["README.md", "docs/results.md"])
def test_the_result_tables_are_what_results_table_makes(document):
    import results_table  # scripts/, on pytest's pythonpath

    text = (ROOT / document).read_text()
    block = text.split(results_table.BEGIN)[1].split(results_table.END)[0]
    assert block.strip() == results_table.document_tables(document).strip()
    for _, names in results_table.DOCUMENTS[document]:
        assert all((ROOT / "bench" / "results" / n).exists() for n in names)
    assert re.search(r"\*\*Forward.*\*\* \(`\w+\.json`.*; measured \d{4}-\d\d-\d\d\):", block)


def test_results_table_writes_between_the_markers_only(tmp_path):
    import results_table

    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\nbefore\n{results_table.BEGIN}\nold\n{results_table.END}\n\nafter\n")
    results_table.write_tables(readme, "| new |")
    assert readme.read_text() == f"# x\n\nbefore\n{results_table.BEGIN}\n| new |\n{results_table.END}\n\nafter\n"
    readme.write_text("no markers\n")
    with pytest.raises(SystemExit, match="must hold the markers"):
        results_table.write_tables(readme, "| new |")


def test_results_table_names_files_commits_and_dates(monkeypatch):
    import results_table

    monkeypatch.setattr(results_table, "commit_date", {"a1": "2026-01-02", "b2": "2026-03-04"}.get)
    rows = [{"commit": "b2"}, {"commit": "a1"}, {"commit": "zz"}]
    assert results_table.provenance(["x.json", "y.json"], rows) == (
        "(`x.json`, `y.json`; commits a1, b2, zz, measured 2026-01-02 to 2026-03-04)"
    )
    assert results_table.provenance(["x.json"], rows[:1], with_commits=False) == "(`x.json`; measured 2026-03-04)"
