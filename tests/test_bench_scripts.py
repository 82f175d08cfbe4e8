"""The H200 bench scripts' option parsing (CPU)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import bench_fwd  # noqa: E402


def test_kernel_overrides_are_typed_like_the_kernel_options():
    assert bench_fwd.kernel_overrides(["intra_wg_overlap=true", "num_stages=3", "pingpong=0"]) == {
        "intra_wg_overlap": True, "num_stages": 3, "pingpong": False}
    assert bench_fwd.kernel_overrides([]) == {}


def test_unknown_kernel_option_names_the_accepted_ones():
    with pytest.raises(SystemExit, match="unknown option 'tile_m'.*intra_wg_overlap"):
        bench_fwd.kernel_overrides(["tile_m=64"])


def test_record_names_the_kernel_options_and_is_saved_under_out(tmp_path, monkeypatch):
    import argparse
    import json

    monkeypatch.setenv("OUT", str(tmp_path))
    monkeypatch.setattr(bench_fwd.torch.cuda, "get_device_name", lambda: "test GPU")
    parser = argparse.ArgumentParser()
    parser.add_argument("what")
    bench_fwd.add_common_arguments(parser)
    result, save = bench_fwd.new_record(parser.parse_args(["bench", "--kernel", "intra_wg_overlap=1"]), "fwd")
    assert result["kernel_options"] == {"intra_wg_overlap": True} and result["gpu"] == "test GPU"
    save({**result, "bench": [{"mask": "full"}]})
    (path,) = tmp_path.glob("fwd_bench_*.json")
    assert json.loads(path.read_text())["bench"] == [{"mask": "full"}]
