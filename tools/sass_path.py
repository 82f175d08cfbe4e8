"""The instructions a warp issues per loop iteration, read from SASS without a GPU.

    CUTE_DSL_ARCH=sm_90a CUTE_DSL_KEEP=ptx CUTE_DSL_DUMP_DIR=/tmp/k python -c \\
        "from flashmask3.optimized import compile_check; compile_check('bf16', 128, False, 2)"
    ptxas -arch=sm_90a /tmp/k/*FlashMaskForward*.ptx -o /tmp/k.cubin   # (lower the PTX .version to
    nvdisasm -c /tmp/k.cubin > ours.sass                                 #  what this ptxas takes)
    python tools/sass_path.py ours.sass                  # the hot loop's basic blocks
    python tools/sass_path.py ours.sass --path L_x_39,L_x_248 [--against fa4.sass --against-path ...]

Without `--path`: the loop (a backward branch) holding the most MUFU and HGMMA instructions, first
its size and whether ptxas serialized its WGMMAs (an arrive per HGMMA), then block by block: its
label, size, commonest opcodes and its control and synchronization instructions, so the blocks one
iteration takes (e.g. past the element mask of an unmasked tile) can be picked by hand. With
`--path`: the opcode counts summed over those blocks; with `--against`, another kernel's path beside
it and the difference per opcode (how FA4's per-tile path was compared with ours, docs/kernel-notes.md).
"""

from __future__ import annotations

import argparse
import collections
import re

from ncu_source_summary import SASS_LINE, opcode

_LABEL = re.compile(r"^\s*\.(L_x_\d+):")
_BRANCH_TO = re.compile(r"\bBRA\b.*?\(?\.(L_x_\d+)")
_NOTABLE = ("BRA", "BAR", "SYNCS", "WARPGROUP", "DEPBAR", "HGMMA", "EXIT")


def read_blocks(lines) -> list[tuple[str, list[str]]]:
    """`nvdisasm -c` output as basic blocks in program order: (name, instructions). A block starts at
    a label (its name) or after a branch (the label's name + the instructions since the label, e.g.
    `L_x_251+5`, so a path can stop at a branch it takes); code before the first label is "start"."""
    blocks: list[tuple[str, list[str]]] = [("start", [])]
    label, since_label = "start", 0
    for line in lines:
        found = _LABEL.match(line)
        if found:
            label, since_label = found.group(1), 0
            blocks.append((label, []))
            continue
        inst = SASS_LINE.match(line)
        if inst:
            if blocks[-1][1] and opcode(blocks[-1][1][-1]) == "BRA":
                blocks.append((f"{label}+{since_label}", []))
            blocks[-1][1].append(inst.group(2))
            since_label += 1
    return [b for b in blocks if b[1]]


def hot_loop(blocks: list[tuple[str, list[str]]]) -> list[tuple[str, list[str]]]:
    """The blocks from a predicated backward branch's target to the branch whose span holds the most
    MUFU and HGMMA instructions, the shortest such span (the attention kernels' per-tile loop, not a loop
    around it)."""
    where = {label: i for i, (label, _) in enumerate(blocks)}
    best, best_weight = None, (-1, 0)
    for i, (_, instructions) in enumerate(blocks):
        for inst in instructions:
            target = _BRANCH_TO.search(inst)
            # a loop closes with a predicated backward branch; unconditional ones come back from
            # out-of-line wait retries
            if target and inst.startswith("@") and target.group(1) in where and where[target.group(1)] <= i:
                span = blocks[where[target.group(1)] : i + 1]
                weight = (
                    sum(opcode(x) in ("MUFU", "HGMMA") for _, body in span for x in body),
                    -sum(len(body) for _, body in span),
                )
                if weight > best_weight:
                    best, best_weight = span, weight
    if best is None:
        raise ValueError("no backward branch: no loop")
    return best


def path_opcodes(blocks: list[tuple[str, list[str]]], labels: list[str]) -> collections.Counter:
    """Opcode counts summed over the named blocks (a path one iteration takes)."""
    by_label = dict(blocks)
    missing = [label for label in labels if label not in by_label]
    if missing:
        raise ValueError(f"no such block: {', '.join(missing)}")
    return collections.Counter(opcode(x) for label in labels for x in by_label[label])


def describe_blocks(blocks: list[tuple[str, list[str]]], top: int = 6) -> str:
    rows = []
    for label, instructions in blocks:
        mix = collections.Counter(opcode(x) for x in instructions).most_common(top)
        rows.append(f"{label:10s} {len(instructions):5d}  " + " ".join(f"{op}:{n}" for op, n in mix))
        rows += [f"{'':17s}{x[:90]}" for x in instructions if opcode(x) in _NOTABLE]
    return "\n".join(rows)


def loop_summary(loop: list[tuple[str, list[str]]]) -> str:
    """One line on the loop: its size, HGMMAs and warpgroup arrives. An arrive per HGMMA means ptxas
    serialized the WGMMAs (its C7512 warning: too few registers to keep them in flight)."""
    ops = collections.Counter(opcode(x) for _, body in loop for x in body)
    arrives = sum(x.startswith("WARPGROUP.ARRIVE") for _, body in loop for x in body)
    line = f"hot loop: {sum(ops.values())} instructions, {ops['HGMMA']} HGMMA, {arrives} WARPGROUP.ARRIVE"
    if ops["HGMMA"] > 1 and arrives >= ops["HGMMA"]:
        line += " (an arrive per HGMMA: the WGMMAs are serialized)"
    return line


def compare(ours: collections.Counter, theirs: collections.Counter) -> str:
    rows = [
        f"{'opcode':12s} {'path':>6s} {'against':>8s} {'diff':>6s}",
        f"{'(all)':12s} {sum(ours.values()):6d} {sum(theirs.values()):8d} "
        f"{sum(ours.values()) - sum(theirs.values()):+6d}",
    ]
    for op in sorted(set(ours) | set(theirs), key=lambda op: (-(ours[op] - theirs[op]), op)):
        if ours[op] != theirs[op]:
            rows.append(f"{op:12s} {ours[op]:6d} {theirs[op]:8d} {ours[op] - theirs[op]:+6d}")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sass", help="nvdisasm -c output")
    parser.add_argument("--path", help="comma-separated block labels one iteration takes")
    parser.add_argument("--against", help="another kernel's nvdisasm -c output")
    parser.add_argument("--against-path", help="its blocks, comma-separated")
    args = parser.parse_args()
    with open(args.sass) as f:
        blocks = read_blocks(f)
    if not args.path:
        loop = hot_loop(blocks)
        print(loop_summary(loop) + "\n" + describe_blocks(loop))
        return
    ours = path_opcodes(blocks, args.path.split(","))
    if not args.against:
        rows = [f"{op:12s} {n:5d}" for op, n in ours.most_common()]
        print("\n".join(rows + [f"{'(all)':12s} {sum(ours.values()):5d}"]))
        return
    if not args.against_path:
        parser.error("--against needs --against-path")
    with open(args.against) as f:
        theirs = path_opcodes(read_blocks(f), args.against_path.split(","))
    print(compare(ours, theirs))


if __name__ == "__main__":
    main()
