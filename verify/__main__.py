"""`python -m flashmask3.verify backend=reference dtype=bf16 seqlens=257,1000 ...`

Runs the equivalence suite and prints a table of errors per mask; exits 1 on any failure.
"""

from __future__ import annotations

import sys

from ..reference import masks
from .suite import format_table, run_suite

_INTS = {"batch", "heads", "kv_heads", "head_dim", "seed"}
_LISTS = {"masks", "seqlens"}
_USAGE = (
    "usage: python -m flashmask3.verify [backend=NAME] [dtype=bf16|fp16|fp32|fp64] "
    "[masks=a,b] [seqlens=257,1000] [batch=N] [heads=N] [kv_heads=N] [head_dim=N] "
    "[backward=true|false] [device=cpu|cuda] [seed=N]"
)


def parse(argv: list[str]) -> dict:
    opts: dict = {"backend": "reference"}
    for arg in argv:
        key, sep, value = arg.partition("=")
        if not sep:
            raise SystemExit(f"bad argument {arg!r}; {_USAGE}")
        if key in _INTS:
            opts[key] = int(value)
        elif key == "seqlens":
            opts["seqlens"] = [int(x) for x in value.split(",")]
        elif key == "masks":
            opts["mask_names"] = value.split(",")
        elif key == "backward":
            opts["backward"] = value.lower() in ("1", "true", "yes")
        elif key in ("backend", "dtype", "device"):
            opts[key] = value
        else:
            raise SystemExit(f"unknown option {key!r}; {_USAGE}")
    for name in opts.get("mask_names", ()):
        if name not in masks.MASK_NAMES:
            raise SystemExit(f"unknown mask {name!r}; accepted: {', '.join(masks.MASK_NAMES)}")
    return opts


def main(argv: list[str] | None = None) -> int:
    opts = parse(sys.argv[1:] if argv is None else argv)
    if opts["backend"] == "flex" and opts.get("device", "cpu") == "cpu" and opts.get("backward", True):
        print("note: FlexAttention has no CPU backward; checking the forward only (backward=false)")
        opts["backward"] = False
    cases = run_suite(**opts)
    print(format_table(cases))
    failed = [c for c in cases if not c.report.passed]
    print(f"{len(cases) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
