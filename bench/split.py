#!/usr/bin/env python3
"""Where a transaction's instructions go, by feature: the split of callgrind profiles.

    python3 bench/split.py --tx N PROFILE [PROFILE...]

PROFILE: a callgrind output of a pgmemo release build (bench/profile.sh keeps them with
PROFILE_KEEP=DIR, or prints this split itself with -F), N the transactions it counted (8
clients x 500: 4000). Prints one column per profile, instructions per transaction.

How: callgrind_annotate's exclusive counts per (source file, function), where an inlined piece
of code keeps its own source file (so the reply queue's code inlined into the session's loop
still counts as the reply queue). A piece of pgmemo's source is its file's feature below; a
library's code inlined into a pgmemo function is that function's module's; a library function
of its own is the runtime's, the I/O's, or memory (copies and allocation, whose callers
callgrind_annotate does not name). The features add up to the total.
"""

import argparse
import collections
import os
import re
import subprocess
import sys

# pgmemo's modules, by path under src/ (source files) and by module path (a library's code
# inlined into a pgmemo function): the first that matches.
FEATURES = [
    ("framing (protocol/)", r"protocol/|::protocol::"),
    ("reply queue (replies.rs)", r"replies\.rs|::replies::"),
    ("statement registry (statements/)", r"statements/|::statements::"),
    ("autoprepare", r"autoprepare/|planner/autoprepared\.rs|::autoprepare::|planner::autoprepared"),
    ("query reading (query/: lexer, shapes)", r"query/|::query::"),
    ("session state (state, params, deferred)",
     r"session/state\.rs|params\.rs|session/deferred\.rs|::session::state::|::params::|::session::deferred::"),
    ("result cache (cache/, session/caching.rs)", r"cache/|session/caching\.rs|::cache::|::session::caching::"),
    ("pool checkout and release (pool, hold, server)",
     r"pool\.rs|session/hold\.rs|server\.rs|::pool::|::session::hold::|::server::"),
    ("planning (session/planner/)", r"session/planner/|::session::planner::"),
    ("accounting (stats, clock, cancel, timeouts)",
     r"stats\.rs|clock\.rs|cancel\.rs|timeouts\.rs|::stats::|::clock::|::cancel::|::timeouts::"),
    ("I/O: reads and writes (stream, buffers, tokio net)", r"stream\.rs|buffers\.rs|::stream::|::buffers::"),
    ("session dispatch (session/, connection.rs)", r"session/|connection\.rs|::session::|::connection::"),
]
# Library functions of their own (not inlined into pgmemo's).
LIBRARY = [
    ("I/O: reads and writes (stream, buffers, tokio net)",
     r"^tokio::net::|^tokio::io::|^tokio_util::|^<tokio::net|^<tokio::io|^mio::|^recv$|^send$|"
     r"^__libc_(recv|send)|^tokio::runtime::io::registration|^<std::io::error"),
    ("runtime: wake, park, timers (tokio)",
     r"^tokio::|^<tokio::|clock_gettime|Timespec|^epoll_wait|^tokio_"),
    ("memory: copies and allocation (libc, mimalloc)",
     r"^__mem|^mi_|^_mi_|^alloc::|^<alloc::|^bytes::|^<bytes::|malloc|free|realloc"),
]
OTHER = "other (hashing, formatting, std, logging)"
# The rows as printed: pgmemo's features, then memory, the runtime and the rest (LIBRARY's
# I/O row is FEATURES' own; LIBRARY's order is the order of its tests, the runtime's before
# memory's, whose "free" would take some of tokio's functions).
ORDER = list(dict.fromkeys([f for f, _ in FEATURES] + [LIBRARY[2][0], LIBRARY[1][0], OTHER]))

# The debug information names pgmemo's files by the path they were built at: this checkout's.
SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src") + "/"
LINE = re.compile(r"\s*([\d,]+)\s+(\S.*?)(?: \[[^\]]*\])?$")


def classify(source, function):
    # pgmemo's own source, inlined or not (named relative to the directory callgrind_annotate
    # runs in when it is this checkout).
    if source.startswith(SRC) or source.startswith("src/"):
        path = source[len(SRC):] if source.startswith(SRC) else source[len("src/"):]
        for feature, pattern in FEATURES:
            if re.search(pattern, path):
                return feature
        return OTHER
    if function.startswith(("pgmemo::", "<pgmemo::")) or "<impl pgmemo::" in function[:60]:
        for feature, pattern in FEATURES:
            if re.search(pattern, function):
                return feature
        return OTHER
    for feature, pattern in LIBRARY:
        if re.search(pattern, function):
            return feature
    return OTHER


def split(profile):
    out = subprocess.run(
        ["callgrind_annotate", "--auto=no", "--threshold=100", "--show-percs=no", profile],
        capture_output=True, text=True, check=True).stdout
    counts = collections.Counter()
    total = 0
    table = False
    for line in out.splitlines():
        if line.rstrip().endswith("file:function"):
            table = True
            continue
        m = LINE.match(line)
        if not m:
            continue
        n = int(m.group(1).replace(",", ""))
        rest = m.group(2)
        if rest.startswith("PROGRAM TOTALS"):
            total = n
            continue
        if not table:
            continue
        source, _, function = rest.partition(":")
        counts[classify(source, function)] += n
    return counts, total


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tx", type=int, required=True, help="transactions counted per profile")
    parser.add_argument("--names", help="column names, comma-separated (default: the files')")
    parser.add_argument("profiles", nargs="+")
    args = parser.parse_args()
    names = args.names.split(",") if args.names else [p.rsplit("/", 1)[-1] for p in args.profiles]
    splits = [split(p) for p in args.profiles]
    width = max(len(f) for f in ORDER)
    print("| feature | " + " | ".join(names) + " |")
    print("|---|" + "---:|" * len(names))
    for feature in ORDER:
        cells = [f"{c[feature] / args.tx:,.0f}" for c, _ in splits]
        print(f"| {feature:<{width}} | " + " | ".join(cells) + " |")
    print(f"| {'total (instructions per transaction)':<{width}} | "
          + " | ".join(f"{t / args.tx:,.0f}" for _, t in splits) + " |")
    for counts, total in splits:
        if abs(sum(counts.values()) - total) > total * 0.01:
            print(f"split.py: the features add up to {sum(counts.values())}, not {total}", file=sys.stderr)


if __name__ == "__main__":
    main()
