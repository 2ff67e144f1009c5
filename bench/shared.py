#!/usr/bin/env python3
"""The result cache's shared tier (issue 59): how often a fleet asks PostgreSQL for one key,
with the shared tier and without, what a shared-tier hit costs in time, and what the fleet's
WAL decoding costs the primary with one decoder and with one per instance.

    python3 bench/shared.py                       # ~3 min
    python3 bench/shared.py --keys 10000 --zipf 0 # uniform

A throwaway PostgreSQL (wal_level = logical, pg_stat_statements, pgbench -i -s SCALE), a
Debian `redis-server` (the Valkey stand-in, no persistence) and four pgmemo instances (release
build, transaction mode, the result cache on the accounts' point read, WAL invalidation),
each with a pgbench of its own (round robin across the fleet: 2 clients each, -M simple) that
reads accounts drawn from `--keys` (zipfian, `--zipf`; 0: uniform), `--transactions` per
client with a fixed seed of its own (the same draws in every run, each instance its own). Three runs, fresh instances and an
empty Valkey each: without the shared tier; with it and `decoder = "each"` (every instance
follows the WAL); with it and `decoder = "one"` (the default: one decodes for the fleet).
Reported per run:
- the point read's executions on PostgreSQL (pg_stat_statements' calls) per distinct key
  the fleet read (the keys Valkey holds after a shared run: every key read was filled);
- requests per second, the fleet's hits in memory and in the shared tier, refusals;
- the shared tier's lookup round trip (SHOW CACHE SHARED's p50/p99) against a point read on
  PostgreSQL directly (pgbench's latency, 1 client, -M simple, same keys);
- then, the fleet idle, `--write-rate` UPDATEs a second made on PostgreSQL directly for
  `--write-seconds`: the walsenders on the primary and their CPU time per write (all of
  them, /proc), and (one decoder) the readers' stream lag p50/p99 (SHOW CACHE SHARED).
"""

from __future__ import annotations

import argparse
import os
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
TICK = os.sysconf("SC_CLK_TCK")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--transactions", type=int, default=50_000, help="reads per client")
    p.add_argument("--keys", type=int, default=100_000, help="accounts read")
    p.add_argument("--zipf", type=float, default=1.1, help="zipfian parameter (0: uniform)")
    p.add_argument("--write-rate", type=int, default=500, help="direct UPDATEs per second")
    p.add_argument("--write-seconds", type=int, default=10)
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


def pgbench(ctx: b.Ctx, port: int, script: Path, clients: int, transactions: int, seed: int,
            log: Path):
    return subprocess.Popen([ctx.pgbench, "-n", "-f", str(script), "-M", "simple", "-c",
                             str(clients), "-j", "1", "-t", str(transactions),
                             "--random-seed", str(seed), "-h", "127.0.0.1",
                             "-p", str(port), "-U", b.DB_USER, b.DB_NAME],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT)


RUNS = [("without the shared tier", None), ("shared tier, decoder = each", "each"),
        ("shared tier, one decoder", "one")]


def start_fleet(ctx: b.Ctx, args, pg: b.Postgres, rport: int, decoder) -> tuple[list, list]:
    """Four instances (the shared tier with `decoder`, or none), each serving its database's
    results; their (ports, processes)."""
    tag = decoder or "none"
    conf = ctx.tmp / f"pgmemo-{tag}.toml"
    text = ('[cache]\nenabled = true\ninvalidation = "wal"\n\n[[cache.rules]]\n'
            'name = "accounts"\nquery_contains = "FROM pgbench_accounts"\nttl = "600s"\n')
    if decoder:
        text += f'\n[cache.shared]\nurl = "redis://127.0.0.1:{rport}/0"\ndecoder = "{decoder}"\n'
    conf.write_text(text)
    b.chown_tree(ctx.tmp, ctx.run_as)
    ports, procs = [], []
    for i in range(INSTANCES):
        port = b.free_port()
        log = ctx.logdir / f"pgmemo-{tag}-{i}.log"
        name = f"pgmemo-{tag}-{i}"
        proc = ctx.procs.spawn(name, [args.pgmemo_bin, "--config", str(conf), "--cache",
                                      "--upstream", f"postgresql://{b.DB_USER}@127.0.0.1:{pg.port}",
                                      "--listen", f"127.0.0.1:{port}", "--pool-mode",
                                      "transaction", "--pool-size", "4", "--auth", "trust",
                                      "--admin-user", b.DB_USER],
                               stdout=ctx.open_log(log), stderr=subprocess.STDOUT)
        b.wait_port(name, "127.0.0.1", port, proc, log)
        ports.append(port)
        procs.append(proc)
    # Each instance serving before the run (its first lookup starts its follower or reader;
    # one after the other, so that with one decoder the first takes the lease).
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
    return ports, procs


def walsenders(pg: b.Postgres) -> list[int]:
    out = pg.psql(b.DB_NAME, "SELECT pid FROM pg_stat_activity WHERE backend_type = 'walsender'")
    return [int(x) for x in out.split()] if out else []


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
    draw = (f"random_zipfian(1, {args.keys}, {args.zipf})" if args.zipf
            else f"random(1, {args.keys})")
    script.write_text(f"\\set aid {draw}\n{READ}\n")
    writer = ctx.tmp / "write.sql"
    writer.write_text(f"\\set aid random(1, {args.keys})\n"
                      "UPDATE pgbench_accounts SET abalance = abalance + 1 WHERE aid = :aid;\n")
    b.chown_tree(ctx.tmp, ctx.run_as)
    kind = f"zipfian {args.zipf}" if args.zipf else "uniform"
    print(f"\n## The shared tier ({INSTANCES} instances x 2 clients x {args.transactions:,} reads, "
          f"{args.keys:,} keys {kind}, git {b.git_rev()})\n")
    results = []
    distinct = None
    for label, decoder in RUNS:
        redis(rport, "FLUSHALL")
        ports, procs = start_fleet(ctx, args, pg, rport, decoder)
        pg.psql(b.DB_NAME, "SELECT pg_stat_statements_reset()")
        runs = [pgbench(ctx, port, script, 2, args.transactions, 42 + i,
                        ctx.logdir / f"pgbench-{decoder}-{i}.log") for i, port in enumerate(ports)]
        for r in runs:
            r.wait()
        tps = 0.0
        for i in range(INSTANCES):
            out = (ctx.logdir / f"pgbench-{decoder}-{i}.log").read_text()
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
        if decoder:
            distinct = int(redis(rport, "DBSIZE") or 0)
        # The writes: the fleet idle, its decoding on the primary.
        senders = walsenders(pg)
        ticks0 = sum(b.proc_cpu_ticks(pid) or 0 for pid in senders)
        w = subprocess.run([ctx.pgbench, "-n", "-f", str(writer), "-R", str(args.write_rate),
                            "-c", "2", "-j", "1", "-T", str(args.write_seconds), "-M", "prepared",
                            "-h", "127.0.0.1", "-p", str(pg.port), "-U", b.DB_USER, b.DB_NAME],
                           capture_output=True, text=True)
        time.sleep(1)  # (the last writes decoded)
        ticks = sum(b.proc_cpu_ticks(pid) or 0 for pid in senders) - ticks0
        m = b.RE_TX.search(w.stdout)
        writes = int(m.group(1)) if m else 0
        stream = [(r["stream_lag_p50_ms"], r["stream_lag_p99_ms"]) for port in ports
                  for r in table(ctx, port, "SHOW CACHE SHARED") if r.get("stream_lag_p50_ms")]
        results.append(dict(label=label, tps=tps, calls=calls, hits=hits, shared_hits=shared_hits,
                            refused=refused, lat=lat, senders=len(senders), writes=writes,
                            us_per_write=ticks / TICK / writes * 1e6 if writes else None,
                            stream=stream))
        for proc in procs:
            ctx.procs.stop(proc)
    print("| run | requests/s | PostgreSQL executions of the read | per distinct key | hits in memory "
          "| shared tier hits | refused | lookup p50 / p99 ms |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for r in results:
        per_key = f"{r['calls'] / distinct:.2f}" if distinct else "—"
        latency = ", ".join(f"{p50} / {p99}" for p50, p99 in r["lat"]) if r["lat"] else "—"
        print(f"| {r['label']} | {r['tps']:,.0f} | {r['calls']:,} | {per_key} | {r['hits']:,} | "
              f"{r['shared_hits']:,} | {r['refused']:,} | {latency} |")
    print(f"\nDistinct keys read (Valkey's keys after a shared run, the same draw each run): "
          f"{distinct:,}\n")
    print(f"Then {args.write_rate} UPDATEs/s on PostgreSQL directly for {args.write_seconds} s:\n")
    print("| run | walsenders on the primary | their CPU µs per write | readers' stream lag p50 / p99 ms |")
    print("|---|---:|---:|---|")
    for r in results:
        cpu = f"{r['us_per_write']:.1f}" if r["us_per_write"] is not None else "—"
        stream = ", ".join(f"{p50} / {p99}" for p50, p99 in r["stream"]) or "—"
        print(f"| {r['label']} | {r['senders']} | {cpu} | {stream} |")
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
