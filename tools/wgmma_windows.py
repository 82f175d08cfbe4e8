"""Where each WGMMA wait sits against the float work of one loop iteration, read from SASS without
a GPU (docs/bwd-sass-comparison.md, "The WGMMA waits against the float work").

    CUTE_DSL_ARCH=sm_90a CUTE_DSL_KEEP=cubin CUTE_DSL_DUMP_DIR=$DUMP python -c \\
        "from flashmask3.optimized import compile_check; compile_check('bf16', 128, False, 2, direction='bwd')"
    nvdisasm -c $DUMP/*FlashMaskBackwardSm90*.cubin > bwd.sass
    python tools/wgmma_windows.py bwd.sass [--partial] [--lane0] [--names S,dP,dV,dQ,dK] [--cubin C]

The iteration is walked through the innermost loop holding the most HGMMA instructions
(the back edge's target to the back edge), one conditional branch at a time: a branch out of the
loop (an mbarrier wait's retry) is not taken; a forward branch over a stretch holding the element
mask (16 or more FSEL/ISETP and no HGMMA) skips it unless `--partial`; over a stretch of one
thread's work (bulk copies, semaphores: UBLKRED, ELECT, DEPBAR SB0, ATOM, LDG without HGMMA) skips
it unless `--lane0`; over an mbarrier wait's blocking retry (only SYNCS) skips it; otherwise
falls through. Unconditional branches are followed.

Printed: the events of the iteration in order (WGMMA group issues, named G1.. or `--names`, the
group waits `WARPGROUP.DEPBAR.LE gsb0, N` with the groups they retire, named barriers, mbarrier
waits and arrives) with the instruction mix between consecutive events, then per GEMM group the
float work issued while it may be in flight (from its issue to the wait that retires it), then
the iteration's size, local memory (STL/LDL in the whole kernel), `USETMAXREG` and, with `--cubin`,
the kernel's register count (`EIATTR_REGCOUNT`).
"""

from __future__ import annotations

import argparse
import collections
import re
import struct

from ncu_source_summary import SASS_LINE, opcode
from sass_path import read_blocks

FLOAT = ("MUFU", "FFMA", "FMUL", "FADD", "F2FP", "FMNMX", "FSEL", "FSETP", "SHFL")
MEMORY = ("LDS", "STS", "STSM", "LDSM", "LDG", "STG")
_TARGET = re.compile(r"\bBRA\b.*?\(?\.(L_x_\d+)")
_WAIT = re.compile(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x([0-9a-f]+)")
_LANE0 = ("UBLKRED", "ELECT", "UTMACMDFLUSH", "ATOM", "ATOMG", "RED", "LDG")


def _mix(ops: collections.Counter, keys=FLOAT + MEMORY) -> str:
    shown = " ".join(f"{k}:{ops[k]}" for k in keys if ops[k])
    rest = sum(ops.values()) - sum(ops[k] for k in keys)
    return f"{sum(ops.values()):4d}  {shown}{' other:' + str(rest) if rest else ''}"


def inner_loop(blocks, head_label: str | None = None):
    """(head index, back-edge index) of the innermost loop with the most HGMMAs (or the one whose
    back edge goes to `head_label`)."""
    where = {label: i for i, (label, _) in enumerate(blocks)}
    best, best_key = None, None
    for i, (_, body) in enumerate(blocks):
        for inst in body:
            t = _TARGET.search(inst)
            if head_label and (not t or t.group(1) != head_label):
                continue
            if t and inst.startswith("@") and t.group(1) in where and where[t.group(1)] <= i:
                span = blocks[where[t.group(1)] : i + 1]
                weight = sum(opcode(x) == "HGMMA" for _, b in span for x in b)
                key = (weight, -sum(len(b) for _, b in span))  # innermost: the shortest
                if best_key is None or key > best_key:
                    best, best_key = (where[t.group(1)], i), key
    if best is None:
        raise ValueError("no loop")
    return best


def walk(blocks, partial: bool, lane0: bool, head_label: str | None = None) -> tuple[list[str], list[str]]:
    """One iteration's instructions and the labels of the blocks it took."""
    where = {label: i for i, (label, _) in enumerate(blocks)}
    head, back = inner_loop(blocks, head_label)
    insts, taken, i = [], [], head
    while True:
        label, body = blocks[i]
        taken.append(label)
        nxt = i + 1
        for inst in body:
            insts.append(inst)
            t = _TARGET.search(inst)
            if not t or opcode(inst) != "BRA":
                continue
            target = where.get(t.group(1))
            if i == back and target == head:
                return insts, taken
            if target is None or target > back or target < head:
                continue  # a retry out of line: not taken
            if target <= i:
                continue  # a backward retry inside the loop (elect loop): once
            if not inst.startswith("@"):
                nxt = target
                continue
            skipped = [x for _, b in blocks[i + 1 : target] for x in b]
            ops = collections.Counter(opcode(x) for x in skipped)
            if "HGMMA" in ops:
                continue
            if set(ops) <= {"SYNCS", "BRA"}:
                nxt = target  # an mbarrier wait's blocking retry: the try-wait succeeded
                continue
            if ops["FSEL"] + ops["ISETP"] >= 16 and ops["UBLKRED"] == 0:
                nxt = i + 1 if partial else target
            elif any(ops[k] for k in _LANE0) or any(x.startswith("DEPBAR.LE SB0") for x in skipped):
                nxt = i + 1 if lane0 else target
        i = nxt
        if i > back:
            return insts, taken


def events(insts: list[str], names: list[str]) -> tuple[str, list[tuple[str, collections.Counter]]]:
    rows, ops = [], collections.Counter()
    in_flight: list[str] = []
    issued = 0
    since_issue: dict[str, collections.Counter] = {}
    under: list[tuple[str, collections.Counter]] = []

    def cut(text: str) -> None:
        nonlocal ops
        rows.append("    " + _mix(ops))
        rows.append(f"[{text}]")
        for g in in_flight:
            since_issue[g].update(ops)
        ops = collections.Counter()

    for inst in insts:
        op = opcode(inst)
        if op == "HGMMA":
            if "gsb0" in inst:
                name = names[issued] if issued < len(names) else f"G{issued + 1}"
                issued += 1
                cut(f"issue {name}" + (f"   (in flight: {','.join(in_flight)})" if in_flight else ""))
                in_flight.append(name)
                since_issue[name] = collections.Counter()
            continue
        m = _WAIT.search(inst)
        if m:
            keep = int(m.group(1), 16)
            done = in_flight[: max(0, len(in_flight) - keep)]
            cut(
                f"wait <= {keep}: {','.join(done) or '-'} done"
                + f"   (in flight: {','.join(in_flight[len(done) :]) or '-'})"
            )
            for g in done:
                under.append((g, since_issue.pop(g)))
            in_flight = in_flight[len(done) :]
            continue
        if op in ("BAR", "SYNCS", "MEMBAR", "FENCE") or inst.startswith("DEPBAR") or op == "WARPGROUP":
            if op == "WARPGROUP":
                continue  # arrives: counted, not shown
            cut(inst.rstrip(" ;")[:70])
            continue
        ops[op] += 1
    rows.append("    " + _mix(ops))
    for g in in_flight:
        since_issue[g].update(ops)
        under.append((g + " (to the iteration's end)", since_issue[g]))
    return "\n".join(rows), under


def regcount(cubin: str) -> dict[str, int]:
    """EIATTR_REGCOUNT (0x2f) per function from the ELF's .nv.info sections."""
    data = open(cubin, "rb").read()
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + k * shentsize) for k in range(shnum)]

    def name(off: int, strtab) -> str:
        end = data.index(b"\0", strtab[4] + off)
        return data[strtab[4] + off : end].decode()

    shstr = sections[shstrndx]
    symtab = next(s for s in sections if s[1] == 2)
    strtab = sections[symtab[6]]
    symbols = [struct.unpack_from("<IBBHQQ", data, symtab[4] + k * 24) for k in range(symtab[5] // 24)]
    out = {}
    for s in sections:
        if not name(s[0], shstr).startswith(".nv.info"):
            continue
        pos, end = s[4], s[4] + s[5]
        while pos + 4 <= end:
            fmt, attr, size = struct.unpack_from("<BBH", data, pos)
            if fmt == 0x04:
                if attr == 0x2F:
                    sym, regs = struct.unpack_from("<II", data, pos + 4)
                    out[name(symbols[sym][0], strtab)] = regs
                pos += 4 + size
            else:
                pos += 4
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sass", help="nvdisasm -c output")
    parser.add_argument("--partial", action="store_true", help="take the element mask's branch")
    parser.add_argument("--lane0", action="store_true", help="take the one-thread branches (bulk add, semaphores)")
    parser.add_argument("--names", default="S,dP,dV,dQ,dK", help="the GEMM groups in issue order")
    parser.add_argument("--cubin", help="the kernel's cubin, for its register count")
    parser.add_argument("--head", help="the loop whose back edge goes to this label (default: most HGMMAs)")
    args = parser.parse_args()
    with open(args.sass) as f:
        lines = f.readlines()
    blocks = read_blocks(lines)
    insts, labels = walk(blocks, args.partial, args.lane0, args.head)
    text, under = events(insts, args.names.split(","))
    print("path: " + ",".join(labels))
    print(text)
    print("\nfloat work issued while each GEMM group may be in flight (issue -> its wait):")
    for g, ops in under:
        print(f"  {g:6s} {_mix(ops)}")
    everything = collections.Counter(opcode(m.group(2)) for m in map(SASS_LINE.match, lines) if m)
    maxreg = sorted({int(x.split()[-2].rstrip(" ;,"), 16) for x in lines if "USETMAXREG" in x})
    print(
        f"\niteration: {len(insts)} instructions; kernel: STL {everything['STL']} LDL {everything['LDL']}; "
        f"USETMAXREG {' / '.join(map(str, maxreg)) or '-'}"
    )
    if args.cubin:
        for fn, regs in regcount(args.cubin).items():
            print(f"REGCOUNT {regs}  {fn[:80]}")


if __name__ == "__main__":
    main()
