"""Fingerprints of the kernels' machine code, compiled for sm_90a on the CPU.

    python tools/sass_fingerprints.py           # compare with tools/sass_fingerprints.json
    python tools/sass_fingerprints.py --write   # record the current ones

A change that must leave today's kernels as they are (a refactor, plumbing for new head dims or
tile shapes) is checked by their code: each configuration the host chooses (`fwd_config` /
`bwd_config` at head dim 64 and 128, the four mask variants; the forward at 128, 192/128 and 256 on
segmented masks, at 128 and 256 with attention sinks, both directions at every head dim without a
mask and with the causal one alone (counted key tiles and query steps); the deterministic backward
and fp16 at 128, 192 with v 128 and 256; the forward and the backward at q/k 192 with v 128 and at head dim 256) is
compiled as `compile_check` does, and the sha256 of each kernel's `.text` sections (the SASS, read
from the cubin's ELF, so no disassembler is involved) is compared with the recorded one. A change
that is meant to alter a kernel shows which configurations it touched; record them again with
`--write` in the same commit. The fingerprints hold for one CuTe DSL version (the `gpu` extra's
pin); compiling takes about a minute.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

RECORD = Path(__file__).with_name("sass_fingerprints.json")
VARIANTS = ((True, 1), (True, 2), (False, 2), (False, 4))  # (causal, boundaries per key)


def cases() -> dict[str, dict]:
    """label -> `compile_check` keyword arguments, each with the host's chosen configuration."""
    from flashmask3.optimized import bwd_config, fwd_config

    chosen = {}
    for head_dim in (64, 128):
        for direction in ("fwd", "bwd"):
            for causal, width in VARIANTS:
                label = f"{direction} bf16 d{head_dim} {'causal' if causal else 'noncausal'} w{width}"
                chosen[label] = dict(dtype="bf16", head_dim=head_dim, causal=causal, width=width, direction=direction)
    chosen["bwd bf16 d128 causal w1 short grid"] = dict(  # the CTAs longest first: two Q/dO stages
        dtype="bf16",
        head_dim=128,
        causal=True,
        width=1,
        direction="bwd",
        config=bwd_config(128, True, 1).for_short_grid(),
    )
    for head_dim, head_dim_v in ((128, 128), (192, 128), (256, 256)):  # the deterministic backward, fp16
        dims = f"d{head_dim}" + (f" v{head_dim_v}" if head_dim_v != head_dim else "")
        same = dict(head_dim=head_dim, causal=True, width=1, head_dim_v=head_dim_v)
        chosen[f"bwd bf16 {dims} causal w1 deterministic"] = dict(
            dtype="bf16", direction="bwd", deterministic=True, **same
        )
        for direction in ("fwd", "bwd"):
            chosen[f"{direction} fp16 {dims} causal w1"] = dict(dtype="fp16", direction=direction, **same)
    for head_dim in (128, 192, 256):  # the forward on segmented masks: segment-aligned tiles
        head_dim_v = 128 if head_dim == 192 else head_dim
        dims = f"d{head_dim}" + (f" v{head_dim_v}" if head_dim_v != head_dim else "")
        for causal, width in VARIANTS:
            label = f"fwd bf16 {dims} {'causal' if causal else 'noncausal'} w{width} segmented"
            chosen[label] = dict(
                dtype="bf16", head_dim=head_dim, causal=causal, width=width, segmented=True, head_dim_v=head_dim_v
            )
    for head_dim in (128, 256):  # the forward that joins the heads' sink logits in its epilogue
        chosen[f"fwd bf16 d{head_dim} causal w1 sinks"] = dict(
            dtype="bf16", head_dim=head_dim, causal=True, width=1, sinks=True
        )
    for head_dim in (64, 128, 192, 256):  # calls without a mask, or the causal one alone: counted keys and steps
        head_dim_v = 128 if head_dim == 192 else head_dim
        dims = f"d{head_dim}" + (f" v{head_dim_v}" if head_dim_v != head_dim else "")
        for causal, width in ((False, 2), (True, 1)):
            kind = "causal" if causal else "noncausal"
            if fwd_config(head_dim, causal, width, plain=True).counted_keys:
                chosen[f"fwd bf16 {dims} {kind} plain"] = dict(
                    dtype="bf16", head_dim=head_dim, causal=causal, width=width, plain=True, head_dim_v=head_dim_v
                )
            chosen[f"bwd bf16 {dims} {kind} plain"] = dict(  # counted query steps
                dtype="bf16",
                head_dim=head_dim,
                causal=causal,
                width=width,
                plain=True,
                head_dim_v=head_dim_v,
                direction="bwd",
            )
    for causal, width in VARIANTS:  # the forward at q/k 192, v 128 (MLA)
        label = f"fwd bf16 d192 v128 {'causal' if causal else 'noncausal'} w{width}"
        chosen[label] = dict(dtype="bf16", head_dim=192, causal=causal, width=width, head_dim_v=128)
    for causal, width in VARIANTS:  # the forward at head dim 256 (64-key tiles)
        label = f"fwd bf16 d256 {'causal' if causal else 'noncausal'} w{width}"
        chosen[label] = dict(dtype="bf16", head_dim=256, causal=causal, width=width)
    for causal, width in VARIANTS:  # the backward with queries on rows
        kind = "causal" if causal else "noncausal"
        chosen[f"bwd bf16 d192 v128 {kind} w{width}"] = dict(
            dtype="bf16", head_dim=192, causal=causal, width=width, direction="bwd", head_dim_v=128
        )
        chosen[f"bwd bf16 d256 {kind} w{width}"] = dict(
            dtype="bf16", head_dim=256, causal=causal, width=width, direction="bwd"
        )
    return chosen


def text_sections(cubin: bytes) -> bytes:
    """The `.text.*` sections of an ELF64 little-endian cubin, concatenated in header order."""
    (section_offset,) = struct.unpack_from("<Q", cubin, 0x28)
    entry_size, count, names_index = struct.unpack_from("<HHH", cubin, 0x3A)

    def header(i: int) -> tuple[int, int, int]:
        name, _, _, _, offset, size = struct.unpack_from("<IIQQQQ", cubin, section_offset + i * entry_size)
        return name, offset, size

    _, names_offset, names_size = header(names_index)
    names = cubin[names_offset : names_offset + names_size]
    code = b""
    for i in range(count):
        name, offset, size = header(i)
        if names[name : names.index(b"\0", name)].startswith(b".text."):
            code += cubin[offset : offset + size]
    return code


def kernel_name(cubin_path: Path) -> str:
    """The kernel class in a dumped cubin's file name (FlashMaskForwardSm90, BackwardPreprocess...)."""
    for name in ("FlashMaskForward", "FlashMaskBackward", "BackwardPreprocess", "BackwardPostprocess"):
        if name in cubin_path.name:
            return name
    raise ValueError(f"no known kernel in the cubin name {cubin_path.name}")


def compile_all(dump_dir: Path) -> dict[str, str]:
    """In this process (CUTE_DSL_DUMP_DIR=dump_dir): each case compiled, its cubins fingerprinted
    and removed before the next (later compiles reuse their file names)."""
    from flashmask3.optimized.interface import compile_check

    fingerprints = {}
    for label, arguments in cases().items():
        compile_check(**arguments)
        cubins = sorted(dump_dir.glob("*.cubin"))
        if not cubins:
            raise RuntimeError(f"{label}: no cubin dumped (CUTE_DSL_KEEP=cubin, CUTE_DSL_DUMP_DIR)")
        for cubin in cubins:
            digest = hashlib.sha256(text_sections(cubin.read_bytes())).hexdigest()[:16]
            fingerprints[f"{label}: {kernel_name(cubin)}"] = digest
            cubin.unlink()
    return fingerprints


def current() -> dict[str, str]:
    """The fingerprints of the current sources, compiled in a fresh process."""
    with tempfile.TemporaryDirectory() as dump_dir:
        env = dict(os.environ, CUTE_DSL_ARCH="sm_90a", CUTE_DSL_KEEP="cubin", CUTE_DSL_DUMP_DIR=dump_dir)
        done = subprocess.run(
            [sys.executable, __file__, "--worker", dump_dir], env=env, capture_output=True, text=True, timeout=1200
        )
        if done.returncode:
            raise RuntimeError(f"compiling the kernels failed:\n{done.stderr[-4000:]}")
        return json.loads(done.stdout.splitlines()[-1])


def differences(recorded: dict[str, str], now: dict[str, str]) -> list[str]:
    """Lines naming each kernel whose fingerprint changed, appeared or went."""
    lines = [f"changed: {k}" for k in recorded if k in now and recorded[k] != now[k]]
    lines += [f"new: {k}" for k in now if k not in recorded]
    lines += [f"gone: {k}" for k in recorded if k not in now]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true", help="record the current fingerprints")
    parser.add_argument("--worker", metavar="DUMP_DIR", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(compile_all(Path(args.worker))))
        return
    now = current()
    if args.write:
        RECORD.write_text(json.dumps(now, indent=1, sort_keys=True) + "\n")
        print(f"recorded {len(now)} kernels in {RECORD}")
        return
    changed = differences(json.loads(RECORD.read_text()), now)
    print("\n".join(changed) if changed else f"all {len(now)} kernels as recorded")
    sys.exit(1 if changed else 0)


if __name__ == "__main__":
    main()
