#!/usr/bin/env python3
"""Where a pgmemo binary's instructions go, by source line, inlined code included.

    PROFILE_INSTR=1 PROFILE_KEEP=DIR bench/profile.sh -p PGPORT -m MODE -c 8 -t 500 -r 1 -n BIN
    python3 bench/lines.py DIR/BIN-MODE.callgrind BIN --tx 4000 [--function NAME] [--top N]
    python3 bench/lines.py DIR/BIN-MODE.callgrind BIN --tx 4000 --line src/replies.rs:432
    python3 bench/lines.py DIR/BIN-MODE.callgrind BIN --tx 4000 --footprint

bench/split.py says which feature a transaction's instructions go to, by the file of the code
callgrind counted; callgrind_annotate says which line, but an inlined function's lines are
those of the function it came from, and most of the hot path is inlined into a few large
functions (the message loops), whose lines it cannot tell apart. With the profile taken per
instruction (PROFILE_INSTR=1 makes bench/profile.sh run callgrind with --dump-instr=yes), this
asks addr2line for each instruction's chain of inlined frames and counts its cost against
the first frame in pgmemo's own source (src/...): the line a change would touch. Instructions
with no such frame (tokio's, the standard library's) are counted against their own line, as
`other:`. Self cost only: a call's cost is its callee's. `--line` lists one listed line's
instructions, disassembled (objdump), each with its count a transaction: what the line costs
is made of (a VecDeque push: its index arithmetic, not the entry's copy, session 54).

Found with it (2026-11-30, session 53): BytesMut::advance at every message (a buffer emptied
to its end is cleared instead), two looks at the reply queue's head after every reply (counted
instead), a search_path fallback read per message. Needs addr2line (binutils).
"""

import argparse
import collections
import os
import re
import subprocess
import sys


def costs(path, binary, function=None):
    """Self cost per instruction address of `binary` in a callgrind profile taken with
    --dump-instr=yes --compress-pos=no (names may be compressed, as callgrind writes them by
    default), of the functions whose name has `function` if given."""
    tables = {"ob": {}, "fn": {}}
    current = {"ob": None, "fn": ""}
    skip = False
    cost = collections.Counter()
    want = os.path.basename(binary)
    for line in open(path):
        m = re.match(r"(c?)(ob|fn)=(\((\d+)\))?\s*(.*)", line)
        if m:
            kind, ident, name = m.group(2), m.group(4), m.group(5).strip()
            if ident is not None:
                if name:
                    tables[kind][ident] = name
                name = tables[kind].get(ident, name)
            if not m.group(1):
                current[kind] = name
            continue
        if line.startswith("calls="):
            skip = True
            continue
        if not line.startswith("0x"):
            continue
        if skip:  # the inclusive cost of the call just named: the callee's
            skip = False
            continue
        parts = line.split()
        ob, fn = current["ob"], current["fn"]
        if (
            len(parts) >= 3
            and ob is not None
            and os.path.basename(ob) == want
            and (function is None or function in fn)
        ):
            cost[int(parts[0], 16)] += int(parts[2])
    return cost


def chains(binary, addresses):
    """addr2line's inlined frames (innermost first) for each address."""
    out = {}
    addresses = sorted(addresses)
    for start in range(0, len(addresses), 5000):
        batch = [hex(a) for a in addresses[start : start + 5000]]
        text = subprocess.run(
            ["addr2line", "-e", binary, "-i", "-a"] + batch,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        current = None
        for line in text.splitlines():
            if line.startswith("0x"):
                current = int(line, 16)
                out[current] = []
            elif line and current is not None:
                out[current].append(line.split(" (")[0])
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("profile")
    parser.add_argument("binary")
    parser.add_argument("--tx", type=int, required=True, help="transactions profiled")
    parser.add_argument("--function", help="only instructions of functions whose name has this")
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument(
        "--line", help="FILE:LINE (as listed): its instructions, disassembled, with their counts"
    )
    parser.add_argument(
        "--footprint", action="store_true",
        help="how much code runs in every transaction: its distinct 64-byte lines and 4 KiB pages",
    )
    args = parser.parse_args()
    cost = costs(args.profile, args.binary, args.function)
    if args.footprint:
        return footprint(args.binary, cost, args.tx)
    frames = chains(args.binary, cost)
    root = os.path.abspath(os.path.join(os.path.dirname(__file__), "..")) + "/"
    by_line = collections.Counter()
    keys = {}
    for addr, c in cost.items():
        chain = frames.get(addr, [])
        own = [f for f in chain if f.startswith(root + "src/")]
        if own:
            key = own[0][len(root) :]
        else:
            inner = chain[0] if chain else "?"
            key = "other:" + re.sub(r".*/(registry/src/[^/]+/|library/)", "", inner)
        keys[addr] = key
        by_line[key] += c
    if args.line:
        return disassemble(args.binary, {a: c for a, c in cost.items() if keys[a] == args.line}, args.tx)
    total = sum(cost.values())
    print(f"{args.binary}: {total / args.tx:,.0f} instructions a transaction in the binary itself")
    for key, c in by_line.most_common(args.top):
        print(f"{c / args.tx:8.1f}  {key}")


def footprint(binary, cost, tx):
    """The binary's code that runs at least once a transaction on average: after a sleep it is
    fetched again into caches the other processes used meanwhile, so the fewer cache lines and
    pages it spans, the cheaper a wake-up (a profile-guided build lays it out together)."""
    hot = [a for a, c in cost.items() if c >= tx]
    lines = {a // 64 for a in hot}
    pages = {a // 4096 for a in hot}
    every = sum(cost[a] for a in hot) / tx
    print(f"{binary}: {len(hot):,} instructions run every transaction ({every:,.0f} executed a "
          f"transaction), in {len(lines):,} 64-byte lines ({len(lines) * 64 / 1024:,.1f} KiB) "
          f"on {len(pages):,} 4 KiB pages")


def disassemble(binary, cost, tx):
    """Each instruction counted against one line, in address order, with its count per
    transaction (objdump): what the line's cost is made of."""
    print(f"{sum(cost.values()) / tx:.1f} instructions a transaction")
    for start in sorted(cost):
        text = subprocess.run(
            ["objdump", "-d", "--no-show-raw-insn", "-C", f"--start-address={start:#x}",
             f"--stop-address={start + 16:#x}", binary],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        insn = [l for l in text.splitlines() if re.match(r"\s+[0-9a-f]+:", l)]
        print(f"{cost[start] / tx:8.2f}  {insn[0].strip() if insn else hex(start)}")


if __name__ == "__main__":
    sys.exit(main())
