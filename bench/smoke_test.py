#!/usr/bin/env python3
"""Smoke test of the benchmark harness (not a performance test: nothing about
speed is asserted).

Runs `python3 bench/run.py --quick --duration 1` (scale 1, 200 idle clients, the
default workloads plus one result-cache cell, cache-hot) into a temp dir and
checks that:
  * it exits 0 and prints the table with a row for every workload (simple,
    extended, prepared, orm-simple, cache-hot) x client count, a TPS cell (a
    number or FAIL(k/n)) for every target, a CPU µs/tx column for every proxy and,
    with pgmemo and a peer, a `pgmemo/best peer` column;
  * with pgmemo, the target pgmemo+cache (pgmemo --cache) is there, runs cache-hot
    only (its other cells are `—`), and the "Result cache" table has a cache-hot
    row with a hit ratio (also in runs.csv) and 0 failed transactions;
  * the target ceiling (bench/ceiling.c, when a C compiler is there) runs cache-hot
    only, has no CPU column and no memory row, and has its column in the "Result
    cache" table;
  * the target relay (bench/relay.c, the relay floor, when a C compiler is there)
    runs every workload but cache-hot, has a CPU column, no memory row, and the
    table a `pgmemo/relay` column with pgmemo;
  * direct PostgreSQL never fails (if it does, the harness is broken);
  * runs.csv has one row per run, cells.csv one per cell, the memory table a row
    per proxy (but pgmemo+cache, which the harness leaves out of it);
  * tps.png exists when matplotlib is installed;
  * every port the run used is closed afterwards (nothing left running, also
    Odyssey's daemon).

pgmemo is included when target/release/pgmemo exists (with --no-build; set
PGMEMO_SMOKE_BUILD=1 to let the harness build it), else the run uses --no-pgmemo.
The peers (PgBouncer 1.25, Odyssey) are included when already built under
PGMEMO_SMOKE_PEERS_PREFIX (default /opt/peers); otherwise they are skipped with a
message, never built here (that takes minutes: see run.py --peers-prefix);
PGMEMO_SMOKE_NO_PEERS=1 leaves them out.
Debian's PgBouncer is included when installed or when running as root (the harness
then installs it); PGMEMO_SMOKE_NO_PGBOUNCER=1 leaves it out.

    python3 bench/smoke_test.py [extra run.py options]
    python3 -m pytest bench/smoke_test.py
"""
from __future__ import annotations

import csv
import glob
import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
WORKLOADS = ["simple", "extended", "prepared", "orm-simple", "cache-hot"]
CACHE_WORKLOADS = ["cache-hot"]  # the only ones pgmemo+cache runs
CACHE_TARGET = "pgmemo+cache"
CEILING_TARGET = "ceiling"  # bench/ceiling.c: cache-hot only, not a proxy
RELAY_TARGET = "relay"  # bench/relay.c: all but the cache workloads, a proxy but no pooler
CLIENTS = [8]
CELL_RE = re.compile(r"^(?:[\d,]+(?: \([\d,]+–[\d,]+\))?(?: FAIL\(\d+/\d+\))?|FAIL\(\d+/\d+\))$")
BEST_RE = re.compile(r"^(?:—|\d+\.\d\d\*? \((?:pgbouncer|odyssey)-\S+\))$")
CPU_RE = re.compile(r"^\d+\.\d(?: \(\d+\.\d–\d+\.\d\))? \(user \d+\.\d\)$")  # µs CPU/tx, its user part
PEER_KINDS = ("pgbouncer", "odyssey")


def harness():
    """bench/run.py as a module, for where it looks for the peers."""
    spec = importlib.util.spec_from_file_location("bench_run", BENCH / "run.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def peers_ready(prefix: Path) -> str | None:
    """Why the peers are left out (None: built under prefix, templates there).
    The smoke test never builds them: it must stay fast."""
    run = harness()
    missing = [k for k, v in run.find_peers(prefix).items() if v is None]
    if missing:
        return (f"{', '.join(missing)} not built under {prefix} (build them with "
                f"{run.PEERS_SRC / 'build.sh'} {prefix}, ~2 min, or run bench/run.py once)")
    templates = [run.PEERS_SRC / t for t in run.PEER_TEMPLATES.values()]
    missing = [str(t) for t in templates if not t.is_file()]
    if missing:
        return f"config templates missing: {', '.join(missing)}"
    return None


def prerequisites() -> str | None:
    """Why the smoke test cannot run here, or None."""
    have_pg = glob.glob("/usr/lib/postgresql/*/bin/initdb") or shutil.which("initdb")
    if not have_pg or not shutil.which("pgbench") and not glob.glob("/usr/lib/postgresql/*/bin/pgbench"):
        return "PostgreSQL server binaries / pgbench not installed"
    return None


def parse_table(stdout: str, after: str | None = None):
    """The first markdown table whose header starts with `| workload | clients |`
    (after the line `after`, when given): its header and {(workload, clients): row}."""
    all_lines = stdout.splitlines()
    first = all_lines.index(after) + 1 if after in all_lines else (0 if after is None else len(all_lines))
    lines = [l for l in all_lines[first:] if l.startswith("| workload | clients |")]
    if not lines:
        return None, {}
    start = all_lines.index(lines[0], first)
    header = [c.strip() for c in all_lines[start].strip("|").split("|")]
    rows = {}
    for l in all_lines[start + 2:]:
        if not l.startswith("|"):
            break
        cells = [c.strip() for c in l.strip().strip("|").split("|")]
        rows[(cells[0], cells[1])] = dict(zip(header, cells))
    return header, rows


def ports_closed(ports) -> list[int]:
    still = []
    for p in ports:
        try:
            with socket.create_connection(("127.0.0.1", int(p)), timeout=0.5):
                still.append(int(p))
        except OSError:
            pass
    return still


def run_smoke(extra: list[str] | None = None) -> list[str]:
    """Run the harness once; return a list of problems (empty: passed)."""
    problems: list[str] = []
    out = Path(tempfile.mkdtemp(prefix="pgmemo-smoke-"))
    try:
        argv = [sys.executable, str(BENCH / "run.py"), "--quick", "--duration", "1", "--scale", "1",
                "--idle-clients", "200", "--workloads", ",".join(WORKLOADS), "--out", str(out)]
        targets = ["direct"]
        binary = REPO / "target" / "release" / "pgmemo"
        if os.environ.get("PGMEMO_SMOKE_BUILD") == "1":
            targets.append("pgmemo")
        elif binary.exists():
            argv.append("--no-build")
            targets.append("pgmemo")
        else:
            argv.append("--no-pgmemo")
        has_bouncer = shutil.which("pgbouncer") or os.path.exists("/usr/sbin/pgbouncer")
        debian_bouncer = not (os.environ.get("PGMEMO_SMOKE_NO_PGBOUNCER") == "1"
                              or (not has_bouncer and os.geteuid() != 0))
        if not debian_bouncer:
            argv.append("--no-pgbouncer")
        prefix = Path(os.environ.get("PGMEMO_SMOKE_PEERS_PREFIX", "/opt/peers"))
        why = "PGMEMO_SMOKE_NO_PEERS=1" if os.environ.get("PGMEMO_SMOKE_NO_PEERS") == "1" \
            else peers_ready(prefix)
        if why:
            print(f"smoke: peers skipped: {why}", flush=True)
            argv.append("--no-peers")
        else:
            argv += ["--peers-prefix", str(prefix)]
        argv += list(extra or [])
        print("smoke: " + " ".join(argv), file=sys.stderr, flush=True)
        r = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=REPO)
        if r.returncode != 0:
            return [f"run.py exited {r.returncode}; stderr tail:\n" + "\n".join(r.stderr.splitlines()[-20:])]
        meta = json.loads((out / "meta.json").read_text())
        # The targets' names carry versions (pgbouncer-1.25, odyssey-1.5, pgbouncer-1.18): take them from meta.
        kinds = {}
        for t in meta["targets"]:
            kinds.setdefault(t["kind"], []).append(t["name"])
        # pgmemo and, for the cache workload, pgmemo+cache (the same binary with --cache)
        has_cc = int(bool(shutil.which("cc") or shutil.which("gcc")))  # the servers in C
        want_kinds = {"direct": 1, "pgmemo": 2 * int("pgmemo" in targets),
                      "pgbouncer": int(debian_bouncer) + int(not why), "odyssey": int(not why),
                      "ceiling": has_cc, "relay": has_cc}
        for kind, n in want_kinds.items():
            if len(kinds.get(kind, [])) != n:
                problems.append(f"expected {n} target(s) of kind {kind}, got {kinds.get(kind, [])}")
        targets = [t["name"] for t in meta["targets"]]
        proxies = [t for t in targets[1:] if t != CEILING_TARGET]
        has_cache = CACHE_TARGET in targets
        if has_cache != ("pgmemo" in targets):
            problems.append(f"target {CACHE_TARGET} expected exactly when pgmemo runs: {targets}")
        def runs_wl(t, wl):  # its cells
            if t == RELAY_TARGET:
                return wl not in CACHE_WORKLOADS
            return t not in (CACHE_TARGET, CEILING_TARGET) or wl in CACHE_WORKLOADS
        peers = [t["name"] for t in meta["targets"] if t["kind"] in PEER_KINDS]
        header, rows = parse_table(r.stdout)
        if header is None:
            return problems + ["no table in stdout:\n" + r.stdout[-2000:]]
        for t in targets:
            if f"{t} TPS" not in header:
                problems.append(f"table has no column for {t}: {header}")
        for t in proxies:
            if f"{t} µs CPU/tx" not in header:
                problems.append(f"table has no CPU column for {t}: {header}")
        has_best = "pgmemo" in targets and bool(peers)
        if "pgmemo" in targets and RELAY_TARGET in targets and f"pgmemo/{RELAY_TARGET}" not in header:
            problems.append(f"column `pgmemo/{RELAY_TARGET}` missing: {header}")
        if has_best != ("pgmemo/best peer" in header):
            problems.append(f"column `pgmemo/best peer` {'missing' if has_best else 'unexpected'}: {header}")
        for wl in WORKLOADS:
            for c in CLIENTS:
                row = rows.get((wl, str(c)))
                if row is None:
                    problems.append(f"table has no row for {wl} / {c} clients")
                    continue
                for t in targets:
                    v = row.get(f"{t} TPS", "")
                    if not runs_wl(t, wl):
                        if v != "—":
                            problems.append(f"cell {wl}/{c}/{t} is {v!r}, expected — (not run by design)")
                        continue
                    if not CELL_RE.match(v):
                        problems.append(f"cell {wl}/{c}/{t} is {v!r}, expected a TPS or FAIL(k/n)")
                    if t == "direct" and "FAIL" in v:
                        problems.append(f"direct PostgreSQL failed in {wl}/{c}: harness problem")
                for t in proxies:
                    v = row.get(f"{t} µs CPU/tx", "")
                    if runs_wl(t, wl) and v and not CPU_RE.match(v):
                        problems.append(f"CPU cell {wl}/{c}/{t} is {v!r}, expected µs and its user part")
                if has_best and not BEST_RE.match(row.get("pgmemo/best peer", "")):
                    problems.append(f"pgmemo/best peer in {wl}/{c} is {row.get('pgmemo/best peer')!r}")
        with open(out / "runs.csv") as f:
            runs = list(csv.DictReader(f))
        want = sum(runs_wl(t, wl) for wl in WORKLOADS for t in targets) * len(CLIENTS)
        if len(runs) != want:
            problems.append(f"runs.csv has {len(runs)} rows, expected {want}")
        with open(out / "cells.csv") as f:
            cells = list(csv.DictReader(f))
        if [x["workload"] for x in cells] != [w for w in WORKLOADS for _ in CLIENTS]:
            problems.append(f"cells.csv rows: {[x['workload'] for x in cells]}")
        if has_best and cells and "pgmemo/best_peer" not in cells[0]:
            problems.append("cells.csv has no pgmemo/best_peer column")
        if has_cache:
            problems += check_cache(r.stdout, runs, cells, CEILING_TARGET in targets)
        mem_path = out / "memory.csv"
        mem = set()
        if mem_path.exists():
            with open(mem_path) as f:
                mem = {row["target"] for row in csv.DictReader(f)}
        for t in proxies:
            mine = [x for x in runs if x["target"] == t]
            # a proxy that was never skipped as broken must have been memory-tested
            if t not in (CACHE_TARGET, RELAY_TARGET) and mine and not any(x["error"].startswith("not run") for x in mine) \
                    and t not in mem:
                problems.append(f"memory.csv has no row for {t}")
        if RELAY_TARGET in mem:
            problems.append(f"memory.csv has a row for {RELAY_TARGET} (no pooler: a connection per client)")
        if mem and "| proxy | idle clients |" not in r.stdout:
            problems.append("memory table missing from stdout")
        if importlib.util.find_spec("matplotlib") and not (out / "tps.png").stat().st_size > 0:
            problems.append("tps.png missing")
        left = ports_closed(meta["ports"].values())
        if left:
            problems.append(f"ports still accepting connections after exit: {left}")
        if not problems:
            print(r.stdout, file=sys.stderr)
        return problems
    finally:
        shutil.rmtree(out, ignore_errors=True)


def check_cache(stdout: str, runs: list[dict], cells: list[dict], ceiling: bool) -> list[str]:
    """The result-cache part: the "Result cache" table's rows, the hit ratio in
    runs.csv and cells.csv, and no failed transaction through pgmemo+cache."""
    problems = []
    header, rows = parse_table(stdout, after="### Result cache")
    if header is None:
        return ["no `### Result cache` table in stdout"]
    cols = [f"{CACHE_TARGET} TPS", f"{CACHE_TARGET}/pgmemo", "hit ratio", f"{CACHE_TARGET} failed tx"]
    cols += [f"{CEILING_TARGET} TPS", f"{CACHE_TARGET}/{CEILING_TARGET}"] if ceiling else []
    for col in cols:
        if col not in header:
            problems.append(f"Result cache table has no column {col!r}: {header}")
    if sorted(rows) != sorted((wl, str(c)) for wl in CACHE_WORKLOADS for c in CLIENTS):
        problems.append(f"Result cache table rows: {sorted(rows)}")
    for key, row in rows.items():
        if not re.match(r"^\d+\.\d%", row.get("hit ratio", "")):
            problems.append(f"Result cache {key}: hit ratio {row.get('hit ratio')!r}")
        if row.get(f"{CACHE_TARGET} failed tx") != "0":
            problems.append(f"Result cache {key}: failed tx {row.get(f'{CACHE_TARGET} failed tx')!r}")
        if ceiling and not re.match(r"^\d+\.\d\d$", row.get(f"{CACHE_TARGET}/{CEILING_TARGET}", "")):
            problems.append(f"Result cache {key}: {CACHE_TARGET}/{CEILING_TARGET} "
                            f"{row.get(f'{CACHE_TARGET}/{CEILING_TARGET}')!r}, expected a ratio")
    mine = [x for x in runs if x["target"] == CACHE_TARGET]
    if not mine or any(x["workload"] not in CACHE_WORKLOADS for x in mine):
        problems.append(f"runs.csv: {CACHE_TARGET} ran {[x['workload'] for x in mine]}")
    if any(x["ok"] == "True" and not x["cache_hit_ratio"] for x in mine):
        problems.append(f"runs.csv: a {CACHE_TARGET} run without cache_hit_ratio")
    if cells and f"{CACHE_TARGET}_hit_ratio" not in cells[0]:
        problems.append(f"cells.csv has no {CACHE_TARGET}_hit_ratio column")
    return problems


def test_quick_smoke():
    import pytest  # only under pytest
    why = prerequisites()
    if why:
        pytest.skip(why)
    problems = run_smoke()
    assert not problems, "\n".join(problems)


def main() -> int:
    why = prerequisites()
    if why:
        print(f"smoke: skipped: {why}")
        return 0
    problems = run_smoke(sys.argv[1:])
    for p in problems:
        print("smoke: FAIL: " + p)
    print(f"{0 if problems else 1} passed, {1 if problems else 0} failed")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
