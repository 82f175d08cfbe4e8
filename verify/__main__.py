"""`python -m flashmask3.verify backend=reference dtype=bf16 seqlens=257,1000 ...`

Runs the equivalence suite and prints a table of errors per mask; exits 1 on any failure. A bad
option (or a device this machine does not have) prints one `error: ...` line and exits 2.
`head_dim_v=N` gives v (and the output) a head dim other than q's and k's `head_dim` (DeepSeek's
MLA: head_dim=192 head_dim_v=128).
"""

from __future__ import annotations

import sys

import torch

from ..api import BACKENDS
from ..reference import masks
from .suite import DTYPES, format_table, run_suite

_INTS = {"batch": 1, "heads": 1, "kv_heads": 1, "head_dim": 1, "head_dim_v": 1, "seed": 0}  # each one's least value
_BOOLS = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}
_USAGE = (
    "usage: python -m flashmask3.verify [backend=NAME] [dtype=bf16|fp16|fp32|fp64] "
    "[masks=a,b] [seqlens=257,1000] [batch=N] [heads=N] [kv_heads=N] [head_dim=N] [head_dim_v=N] "
    "[backward=true|false] [sinks=true|false] [device=cpu|cuda] [seed=N]"
)


def _int(key: str, value: str, least: int) -> int:
    try:
        number = int(value)
    except ValueError:
        number = least - 1
    if number < least:
        raise ValueError(f"{key} must be an int >= {least}, got {value!r}")
    return number


def parse(argv: list[str]) -> dict:
    """The suite's options from `key=value` arguments; ValueError naming a bad one."""
    opts: dict = {"backend": "reference"}
    for arg in argv:
        key, sep, value = arg.partition("=")
        if not sep:
            raise ValueError(f"bad argument {arg!r}; {_USAGE}")
        if key in _INTS:
            opts[key] = _int(key, value, _INTS[key])
        elif key == "seqlens":
            opts["seqlens"] = [_int("each of seqlens", x, 2) for x in value.split(",")]
        elif key == "masks":
            opts["mask_names"] = value.split(",")
        elif key in ("backward", "sinks"):
            if value.lower() not in _BOOLS:
                raise ValueError(f"{key} must be true or false, got {value!r}")
            opts[key] = _BOOLS[value.lower()]
        elif key in ("backend", "dtype", "device"):
            opts[key] = value
        else:
            raise ValueError(f"unknown option {key!r}; {_USAGE}")
    for name in opts.get("mask_names", ()):
        if name not in masks.MASK_NAMES:
            raise ValueError(f"unknown mask {name!r}; accepted: {', '.join(masks.MASK_NAMES)}")
    if opts["backend"] not in BACKENDS:
        raise ValueError(f"unknown backend {opts['backend']!r}; accepted: {', '.join(BACKENDS)}")
    heads, kv_heads = opts.get("heads", 4), opts.get("kv_heads", 2)  # run_suite's defaults
    if heads % kv_heads:
        raise ValueError(f"heads must be a multiple of kv_heads (GQA), got heads={heads} kv_heads={kv_heads}")
    if opts.get("dtype", "fp32") not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {opts['dtype']!r}")
    _check_device(opts)
    return opts


def _check_device(opts: dict) -> None:
    device = opts.get("device", "cpu")
    try:
        kind = torch.device(device).type
    except RuntimeError:
        raise ValueError(f"device must be cpu or cuda (or cuda:N), got {device!r}") from None
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"device must be cpu or cuda (or cuda:N), got {device!r}")
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device}, but torch {torch.__version__} sees no CUDA GPU: use device=cpu")
    if opts["backend"] == "cute" and kind != "cuda":
        raise ValueError("backend=cute runs on a Hopper GPU (sm_90): add device=cuda")


def main(argv: list[str] | None = None) -> int:
    """0 if every case passes, 1 if one fails, 2 on a bad option or an error of the backend."""
    try:
        opts = parse(sys.argv[1:] if argv is None else argv)
        if opts["backend"] == "flex" and opts.get("device", "cpu") == "cpu" and opts.get("backward", True):
            print("note: FlexAttention has no CPU backward; checking the forward only (backward=false)")
            opts["backward"] = False
        cases = run_suite(**opts)
    except (ValueError, RuntimeError) as error:  # NotImplementedError too: cute on a GPU other than sm_90
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(format_table(cases))
    failed = [c for c in cases if not c.report.passed]
    print(f"{len(cases) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
