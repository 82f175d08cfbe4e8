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
