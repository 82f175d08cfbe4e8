"""Summarize an ncu source-counter CSV (warp-stall samples per SASS instruction) into a few lines.

    $NCU --clock-control none -k regex:FlashMaskForward -c 1 --section SourceCounters \\
        --section WarpStateStats --page source --print-source sass --csv \\
        python scripts/bench_fwd.py ablate --seqlens 8192 --masks full > ncu.csv
    python tools/ncu_source_summary.py ncu.csv [--top 16] [--lines kernel.sass [--outside]]

The CSV (~0.6 MB) is not worth committing; this summary is. The hot loop is found as the
loop whose body holds the most samples (the consumers' per-tile or per-step loop); its share of
all samples, its stall reasons, its samples by opcode and its hottest instructions are printed.

`--lines` adds the loop's samples per Python source line (`--outside`: the rest of the kernel's). It
takes `nvdisasm -g` of the same kernel compiled with line info, which needs no GPU (nvdisasm: PyPI
nvidia-cuda-nvdisasm):

    CUTE_DSL_ARCH=sm_90a CUTE_DSL_LINEINFO=1 CUTE_DSL_KEEP=cubin CUTE_DSL_DUMP_DIR=/tmp/k python -c \\
        "from flashmask3.optimized import compile_check; compile_check('bf16', 128, False, 2)"
    nvdisasm -g -c /tmp/k/*FlashMaskForward*.cubin > kernel.sass

A compile with fake tensors differs from the profiled one in a few parameter loads, so the two
instruction streams are aligned by opcode and operands other than registers, constants and
immediates; the share of loop samples left unaligned is printed.
"""

from __future__ import annotations

import argparse
import collections
import csv
import difflib
import re
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
        return opcode(self.source)


def _unpredicated(source: str) -> list[str]:
    """The instruction's words without its guard predicate (@P0, @!UP1)."""
    return [w for w in source.split() if not w.startswith("@")]


def opcode(source: str) -> str:
    """The opcode without its guard predicate and modifiers: `@!P0 SYNCS.ARRIVE.TRANS64 ...` -> SYNCS."""
    words = _unpredicated(source)
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
    reasons = {
        i: name[len("stall_") :]
        for i, name in enumerate(header)
        if name.startswith("stall_") and "Not Issued" not in name
    }
    body = [row for row in rows[header_at + 1 :] if len(row) == len(header) and row[0].startswith("0x")]
    if not body:
        raise ValueError("the dump has a header but no instructions")
    base = int(body[0][0], 16)
    instructions = []
    for row in body:
        target = _branch_target(row[1])
        instructions.append(
            Instruction(
                int(row[0], 16) - base,
                row[1].strip(),
                _number(row[samples_at]),
                {name: _number(row[i]) for i, name in reasons.items()},
                None if target is None else target - base,
            )
        )
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


_LINE = re.compile(r'\s*//## File "([^"]+)", line (\d+)')
SASS_LINE = re.compile(r"\s*/\*([0-9a-f]+)\*/\s+(.*?)\s*;")
_VOLATILE_OPERAND = re.compile(r"^[-|!]*(U?R\d+|U?P\d+|UPT|PT|RZ|URZ|c\[|0x|\d)")
_REGISTER = re.compile(r"U?R\d+")


def read_line_info(lines) -> list[tuple[str, str]]:
    """(instruction, "file.py:line") in order from `nvdisasm -g` output."""
    where, listing = "?", []
    for line in lines:
        if match := _LINE.match(line):
            where = f"{match.group(1).rsplit('/', 1)[-1]}:{match.group(2)}"
        elif match := SASS_LINE.match(line):
            listing.append((match.group(2), where))
    return listing


def _shape(source: str) -> str:
    """An instruction without its predicate, registers, constants and immediates (registers inside
    an operand such as gdesc[UR8] blanked): what a compile with other parameter loads keeps."""
    words = [w.rstrip(",") for w in _unpredicated(source)]
    kept = words[:1] + [w for w in words[1:] if not _VOLATILE_OPERAND.match(w)]
    return _REGISTER.sub("#", " ".join(kept))


def loop_lines(
    instructions: list[Instruction], listing: list[tuple[str, str]], top: int = 16, outside: bool = False
) -> str:
    """The hottest loop's samples per source line, through an alignment of the two instruction streams
    (`outside`: the samples outside it instead, the prologue, epilogue and the other roles' loops, as
    shares of all samples; waiting warps are sampled too, so a share is presence, not critical path)."""
    matcher = difflib.SequenceMatcher(
        None, [_shape(i.source) for i in instructions], [_shape(source) for source, _ in listing], autojunk=False
    )
    where = {}
    for block in matcher.get_matching_blocks():
        for k in range(block.size):
            where[block.a + k] = listing[block.b + k][1]
    first, last = hottest_loop(instructions)
    per_line = collections.Counter()
    reasons = collections.defaultdict(collections.Counter)
    in_region = 0.0
    for index, inst in enumerate(instructions):
        if (first <= inst.offset <= last) != outside:
            in_region += inst.samples
            line = where.get(index, "unaligned")
            per_line[line] += inst.samples
            reasons[line].update(inst.stalls)
    share_of = sum(inst.samples for inst in instructions) if outside else in_region
    title = "samples outside the loop" if outside else "loop samples"
    lines = [
        f"{title} per source line ({100 * per_line['unaligned'] / in_region:.0f}% unaligned; "
        "main stall reasons of each):"
    ]
    for line, samples in per_line.most_common(top + 1):
        if line == "unaligned":
            continue
        total = sum(reasons[line].values()) or 1.0
        main = ", ".join(f"{name} {100 * n / total:.0f}%" for name, n in reasons[line].most_common(2) if n)
        lines.append(f"  {100 * samples / share_of:5.1f}% {line:28s} ({main})")
    return "\n".join(lines[: top + 1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("csv", help="ncu --page source --csv output")
    parser.add_argument("--top", type=int, default=16, help="hottest loop instructions (and lines) to list")
    parser.add_argument("--lines", help="nvdisasm -g output of the kernel compiled with line info")
    parser.add_argument(
        "--outside",
        action="store_true",
        help="with --lines: the samples outside the hot loop per line, as shares of all",
    )
    args = parser.parse_args()
    with open(args.csv, newline="") as f:
        instructions = read_instructions(f)
    print(summarize(instructions, args.top))
    if args.lines:
        with open(args.lines) as f:
            print(loop_lines(instructions, read_line_info(f), args.top, args.outside))


if __name__ == "__main__":
    sys.exit(main())
