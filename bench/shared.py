#!/usr/bin/env python3
"""The result cache's shared tier (issue 59): how often a fleet asks PostgreSQL for one key,
with the shared tier and without, and what a shared-tier hit costs in time.

    python3 bench/shared.py                       # ~2 min
    python3 bench/shared.py --duration 30 --keys 20000

A throwaway PostgreSQL (wal_level = logical, pg_stat_statements, pgbench -i -s SCALE), a
Debian `redis-server` (the Valkey stand-in, no persistence) and four pgmemo instances (release
build, transaction mode, the result cache on the accounts' point read, WAL invalidation),
each with a pgbench of its own (round robin across the fleet: 2 clients each, -M simple) that
reads `--keys` accounts drawn uniformly, for `--duration` seconds; once without the shared
tier, once with it (Valkey emptied, fresh instances). Reported per run:
- the point read's executions on PostgreSQL (pg_stat_statements' calls) per distinct key
  the fleet read (the keys filled: with the shared tier, the keys Valkey holds; without, at
  least that many were read, the same draw);
- requests per second, the fleet's hits in memory and in the shared tier, refusals;
- the shared tier's lookup round trip (SHOW CACHE SHARED's p50/p99) against a point read on
  PostgreSQL directly (pgbench's latency, 1 client, -M simple, same keys).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))
import run as b  # noqa: E402  (bench/run.py: cluster, processes, pgbench helpers)

INSTANCES = 4
READ = "SELECT abalance FROM pgbench_accounts WHERE aid = :aid;"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=int, default=20, help="seconds per run")
    p.add_argument("--keys", type=int, default=10_000, help="accounts read (uniformly)")
    p.add_argument("--scale", type=int, default=1)
    p.add_argument("--pgmemo-bin", default=str(b.REPO / "target" / "release" / "pgmemo"))
    p.add_argument("--no-build", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    outdir = Path(args.out) if args.out else BENCH_DIR / "results" / f"shared-{stamp}"
    ctx = b.script_ctx(args, "pgmemo-shared-bench-", outdir)
    try:
        return bench(ctx, args)
    finally:
        ctx.procs.stop_all()
        ctx.close_logs()


def psql(ctx: b.Ctx, port: int, text: str, db: str = b.DB_NAME, csv: bool = False) -> str:
    argv = [b.tool(ctx.pg_bindir, "psql"), "-h", "127.0.0.1", "-p", str(port), "-U", b.DB_USER,
            "-d", db, "-c", text] + (["--csv"] if csv else ["-Atq"])
    return subprocess.run(argv, capture_output=True, text=True, timeout=60).stdout.strip()


def table(ctx: b.Ctx, port: int, command: str) -> list[dict]:
    lines = psql(ctx, port, command, db="pgmemo", csv=True).splitlines()
    if not lines:
        return []
    header = lines[0].split(",")
    return [dict(zip(header, line.split(","))) for line in lines[1:]]


def redis(port: int, *command: str) -> str:
    return subprocess.run(["redis-cli", "-p", str(port), *command], capture_output=True,
                          text=True, timeout=30).stdout.strip()


def pgbench(ctx: b.Ctx, port: int, script: Path, clients: int, duration: int, log: Path):
    return subprocess.Popen([ctx.pgbench, "-n", "-f", str(script), "-M", "simple", "-c",
                             str(clients), "-j", "1", "-T", str(duration), "-h", "127.0.0.1",
                             "-p", str(port), "-U", b.DB_USER, b.DB_NAME],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT)


def bench(ctx: b.Ctx, args) -> int:
    pg = b.Postgres(ctx, b.free_port())
    pg.extra_conf = ("wal_level = logical\nmax_wal_senders = 20\nmax_replication_slots = 20\n"
                     "shared_preload_libraries = 'pg_stat_statements'\n")
    pg.start()
    pg.psql(b.DB_NAME, "CREATE EXTENSION pg_stat_statements")
    rport = b.free_port()
    rlog = ctx.logdir / "redis.log"
    ctx.procs.spawn("redis", ["redis-server", "--port", str(rport), "--bind", "127.0.0.1",
                              "--save", "", "--appendonly", "no"],
                    stdout=ctx.open_log(rlog), stderr=subprocess.STDOUT)
    end = time.monotonic() + 20
    while redis(rport, "PING") != "PONG":
        if time.monotonic() > end:
            raise b.BenchError("redis-server did not answer")
        time.sleep(0.1)
    script = ctx.tmp / "read.sql"
    script.write_text(f"\\set aid random(1, {args.keys})\n{READ}\n")
    b.chown_tree(ctx.tmp, ctx.run_as)
    print(f"\n## The shared tier ({INSTANCES} instances x 2 clients, {args.duration} s, "
          f"{args.keys:,} keys uniform, git {b.git_rev()})\n")
    print("| run | requests/s | PostgreSQL executions of the read | distinct keys | executions per key | hits in memory | shared tier hits | refused | lookup p50 / p99 ms |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for shared in [False, True]:
        redis(rport, "FLUSHALL")
        pg.psql(b.DB_NAME, "SELECT pg_stat_statements_reset()")
        conf = ctx.tmp / f"pgmemo-{int(shared)}.toml"
        text = ('[cache]\nenabled = true\ninvalidation = "wal"\n\n[[cache.rules]]\n'
                'name = "accounts"\nquery_contains = "FROM pgbench_accounts"\nttl = "600s"\n')
        if shared:
            text += f'\n[cache.shared]\nurl = "redis://127.0.0.1:{rport}/0"\n'
        conf.write_text(text)
        b.chown_tree(ctx.tmp, ctx.run_as)
        ports = []
        procs = []  # (the instances' processes, stopped after the run)
        for i in range(INSTANCES):
            port = b.free_port()
            log = ctx.logdir / f"pgmemo-{int(shared)}-{i}.log"
            name = f"pgmemo-{int(shared)}-{i}"
            proc = ctx.procs.spawn(name, [args.pgmemo_bin, "--config", str(conf), "--cache",
                                          "--upstream", f"postgresql://{b.DB_USER}@127.0.0.1:{pg.port}",
                                          "--listen", f"127.0.0.1:{port}", "--pool-mode",
                                          "transaction", "--pool-size", "4", "--auth", "trust",
                                          "--admin-user", b.DB_USER],
                                   stdout=ctx.open_log(log), stderr=subprocess.STDOUT)
            b.wait_port(name, "127.0.0.1", port, proc, log)
            ports.append(port)
            procs.append(proc)
        # Each instance's follower streaming before the run (its first lookup starts it).
        for port in ports:
            end = time.monotonic() + 60
            while True:
                psql(ctx, port, READ.replace(":aid", "0"))
                wal = table(ctx, port, "SHOW CACHE WAL")
                if wal and all(r.get("serving") == "true" for r in wal):
                    break
                if time.monotonic() > end:
                    raise b.BenchError(f"the follower of 127.0.0.1:{port} did not catch up: {wal}")
                time.sleep(0.2)
        time.sleep(0.5)  # (the followers' first positions: read every 100 ms)
        pg.psql(b.DB_NAME, "SELECT pg_stat_statements_reset()")
        runs = [pgbench(ctx, port, script, 2, args.duration,
                        ctx.logdir / f"pgbench-{int(shared)}-{i}.log") for i, port in enumerate(ports)]
        for r in runs:
            r.wait()
        tps = 0.0
        for i in range(INSTANCES):
            out = (ctx.logdir / f"pgbench-{int(shared)}-{i}.log").read_text()
            m = re.search(r"tps = ([\d.]+)", out)
            if not m:
                raise b.BenchError(f"pgbench failed:\n{out[-2000:]}")
            tps += float(m.group(1))
        calls = int(pg.psql(b.DB_NAME, "SELECT coalesce(sum(calls), 0) FROM pg_stat_statements "
                                       "WHERE query LIKE '%pgbench_accounts WHERE aid%'") or 0)
        hits = shared_hits = refused = 0
        lat = []
        for port in ports:
            for r in table(ctx, port, "SHOW CACHE"):
                if r.get("rule") == "accounts":
                    hits += int(r["hits"])
            for r in table(ctx, port, "SHOW CACHE SHARED"):
                shared_hits += int(r["hits"])
                refused += int(r["refused"])
                lat.append((r["latency_p50_ms"], r["latency_p99_ms"]))
        keys = int(redis(rport, "DBSIZE") or 0) if shared else None
        distinct = f"{keys:,}" if keys is not None else "(the same draw)"
        per_key = f"{calls / keys:.2f}" if keys else "—"
        latency = ", ".join(f"{p50} / {p99}" for p50, p99 in lat) if lat else "—"
        print(f"| {'with the shared tier' if shared else 'without'} | {tps:,.0f} | {calls:,} | "
              f"{distinct} | {per_key} | {hits:,} | {shared_hits:,} | {refused:,} | {latency} |")
        if not shared:
            print(f"|  |  |  |  | {calls / args.keys:.2f} (at most {args.keys:,} keys) |  |  |  |  |")
        for proc in procs:
            ctx.procs.stop(proc)
    # A point read on PostgreSQL directly, for the latency's comparison.
    direct = subprocess.run([ctx.pgbench, "-n", "-f", str(script), "-M", "simple", "-c", "1",
                             "-T", "5", "-h", "127.0.0.1", "-p", str(pg.port), "-U", b.DB_USER,
                             "-r", b.DB_NAME], capture_output=True, text=True)
    m = re.search(r"latency average = ([\d.]+) ms", direct.stdout)
    print(f"\nA point read on PostgreSQL directly (pgbench, 1 client, -M simple): "
          f"{m.group(1) if m else '?'} ms average per transaction (round trip included).")
    b.script_done(ctx)
    return 0


if __name__ == "__main__":
    sys.exit(main())
