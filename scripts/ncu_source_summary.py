"""Summarize an ncu source-counter CSV (warp-stall samples per SASS instruction) into a few lines.

    $NCU --clock-control none -k regex:FlashMaskForward -c 1 --section SourceCounters \\
        --section WarpStateStats --page source --print-source sass --csv \\
        python scripts/bench_fwd.py ablate --seqlens 8192 --masks full > ncu.csv
    python scripts/ncu_source_summary.py ncu.csv [--top 16]

The CSV (~0.6 MB) is not worth committing; this summary is. The hot loop is found as the
loop whose body holds the most samples (the consumers' per-tile or per-step loop); its share of
all samples, its stall reasons, its samples by opcode and its hottest instructions are printed.
"""

from __future__ import annotations

import argparse
import collections
import csv
import sys
from dataclasses import dataclass

SAMPLES = "Warp Stall Sampling (All Samples)"


@dataclass
class Instruction:
    offset: int  # from the kernel's first instruction
    source: str
    samples: float
    stalls: dict[str, float]  # reason -> samples
    branch_to: int | None  # a branch's target, as an offset

    @property
    def opcode(self) -> str:
        words = [w for w in self.source.split() if not w.startswith("@")]  # drop the predicate
        return words[0].split(".")[0] if words else "?"


def _branch_target(source: str) -> int | None:
    words = source.split()
    if "BRA" not in [w.split(".")[0] for w in words]:
        return None
    try:
        return int(words[-1], 16)
    except ValueError:  # an indirect branch
        return None


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:  # "-" or empty
        return 0.0


def read_instructions(lines) -> list[Instruction]:
    """The SASS rows of an ncu `--page source --csv` dump (program output before the header is skipped)."""
    rows = list(csv.reader(lines))
    header_at = next((i for i, row in enumerate(rows) if row and row[0] == "Address"), None)
    if header_at is None:
        raise ValueError("no 'Address' header: not an ncu --page source --csv dump")
    header = rows[header_at]
    samples_at = header.index(SAMPLES)
    reasons = {i: name[len("stall_"):] for i, name in enumerate(header)
               if name.startswith("stall_") and "Not Issued" not in name}
    body = [row for row in rows[header_at + 1:] if len(row) == len(header) and row[0].startswith("0x")]
    if not body:
        raise ValueError("the dump has a header but no instructions")
    base = int(body[0][0], 16)
    instructions = []
    for row in body:
        target = _branch_target(row[1])
        instructions.append(Instruction(int(row[0], 16) - base, row[1].strip(), _number(row[samples_at]),
                                        {name: _number(row[i]) for i, name in reasons.items()},
                                        None if target is None else target - base))
    return instructions


def hottest_loop(instructions: list[Instruction]) -> tuple[int, int]:
    """(first, last) offsets of the loop whose body holds the most samples: a loop closes with a
    predicated backward branch (the unconditional ones jump back from out-of-line wait retries)."""
    best, best_samples = None, -1.0
    for inst in instructions:
        if inst.branch_to is None or inst.branch_to >= inst.offset or not inst.source.startswith("@"):
            continue
        samples = sum(i.samples for i in instructions if inst.branch_to <= i.offset <= inst.offset)
        if samples > best_samples:
            best, best_samples = (inst.branch_to, inst.offset), samples
    if best is None:
        raise ValueError("no backward branch: no loop to summarize")
    return best


def summarize(instructions: list[Instruction], top: int = 16) -> str:
    """The summary's lines: totals, then the hottest loop's stall reasons, opcodes and instructions."""
    first, last = hottest_loop(instructions)
    total = sum(i.samples for i in instructions)
    loop = [i for i in instructions if first <= i.offset <= last]
    in_loop = sum(i.samples for i in loop)
    reasons = collections.Counter()
    opcodes = collections.Counter()
    for inst in loop:
        reasons.update(inst.stalls)
        opcodes[inst.opcode] += inst.samples
    reason_total = sum(reasons.values()) or 1.0

    def shares(counter, whole, n):
        return ", ".join(f"{name} {100 * value / whole:.1f}%" for name, value in counter.most_common(n))

    lines = [
        f"samples: {int(total)} in all, {int(in_loop)} ({100 * in_loop / total:.0f}%) in the hottest loop "
        f"(SASS +0x{first:x}..+0x{last:x})",
        f"loop stall reasons: {shares(reasons, reason_total, 8)}",
        f"loop samples by opcode: {shares(opcodes, in_loop, 10)}",
        "top loop instructions (share of loop samples, main reason):",
    ]
    for inst in sorted(loop, key=lambda i: -i.samples)[:top]:
        main = max(inst.stalls, key=inst.stalls.get) if inst.stalls else "-"
        lines.append(f"  {100 * inst.samples / in_loop:5.1f}% {main:12s} {inst.source[:64]}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("csv", help="ncu --page source --csv output")
    parser.add_argument("--top", type=int, default=16, help="hottest loop instructions to list")
    args = parser.parse_args()
    with open(args.csv, newline="") as f:
        print(summarize(read_instructions(f), args.top))


if __name__ == "__main__":
    sys.exit(main())
