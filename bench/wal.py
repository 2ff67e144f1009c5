#!/usr/bin/env python3
"""The result cache under writes made directly on PostgreSQL (not through pgmemo), by
invalidation mode: PostgreSQL directly, pgmemo without cache, with the cache invalidated by
writes through pgmemo and TTL only (`--cache`), and following the WAL (`--cache
--cache-invalidation wal`).

    python3 bench/wal.py                 # ~3 min
    python3 bench/wal.py --duration 20 --rounds 3 --write-rate 1000

A throwaway PostgreSQL (wal_level = logical, pgbench -i -s 10) and the three pgmemo targets
(release build, pool 10, transaction mode) on loopback. Each run: readers `pgbench -f
bench/cache_hot.sql -M simple` (a hinted point select, Zipf over the first 100,000
accounts) through the target while a writer updates random accounts of that range directly on
PostgreSQL at --write-rate per second (1,000/s = 1% of the range per second). Per target:
reader TPS, cache hit ratio (pgmemo's /metrics), stale hot keys right after the run (of the
100 hottest accounts, how many read through the target differ from PostgreSQL one second
after the writer stopped), pgmemo's CPU per read, and for the WAL target the invalidation lag
p50/p99 (pgmemo_cache_invalidation_lag_seconds) and the server's decoding cost: the walsender
process's CPU time, per written transaction and as a share of one core.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))
import run as b  # noqa: E402  (bench/run.py: cluster, processes, pgbench helpers)

TICK = os.sysconf("SC_CLK_TCK")
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def metrics(port: int) -> str:
    with _NO_PROXY.open(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return r.read().decode()


def metric_sum(text: str, name: str, label: str = "") -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and label in line and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def psql(pg: b.Postgres, sql: str) -> str:
    return pg.psql(b.DB_NAME, sql)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=int, default=15, help="seconds per run")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--clients", type=int, default=16, help="reader clients")
    p.add_argument("--write-rate", type=int, default=1000, help="direct UPDATEs per second")
    p.add_argument("--scale", type=int, default=10)
    p.add_argument("--pgmemo-bin", default=str(b.REPO / "target" / "release" / "pgmemo"))
    p.add_argument("--no-build", action="store_true")
    p.add_argument("--out", default=None)
    p.add_argument("--sync-standby", action="store_true",
                   help="a synchronous standby (pg_receivewal --synchronous) every commit waits for")
    args = p.parse_args()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    outdir = Path(args.out) if args.out else BENCH_DIR / "results" / f"wal-{stamp}"
    ctx = b.script_ctx(args, "pgmemo-wal-bench-", outdir)
    try:
        return bench(ctx, args)
    finally:
        ctx.procs.stop_all()
        ctx.close_logs()


def sync_standby(ctx: b.Ctx, pg: b.Postgres) -> None:
    """Makes every commit wait for a synchronous standby: pg_receivewal --synchronous (it
    flushes and answers each WAL position at once), named in synchronous_standby_names."""
    sink = ctx.tmp / "receivewal"
    sink.mkdir()
    conninfo = f"host=127.0.0.1 port={pg.port} user={b.DB_USER} application_name=bench_sync"
    ctx.procs.spawn("pg_receivewal", [b.tool(ctx.pg_bindir, "pg_receivewal"), "-D", str(sink),
                                      "--synchronous", "-d", conninfo],
                    stdout=ctx.open_log(ctx.logdir / "pg_receivewal.log"), stderr=subprocess.STDOUT)
    end = time.monotonic() + 30
    while psql(pg, "SELECT count(*) FROM pg_stat_replication WHERE application_name = 'bench_sync'") != "1":
        if time.monotonic() > end:
            raise b.BenchError("pg_receivewal did not connect")
        time.sleep(0.2)
    psql(pg, "ALTER SYSTEM SET synchronous_standby_names = 'bench_sync'")
    psql(pg, "SELECT pg_reload_conf()")
    while psql(pg, "SELECT sync_state FROM pg_stat_replication WHERE application_name = 'bench_sync'") != "sync":
        if time.monotonic() > end:
            raise b.BenchError("pg_receivewal did not become synchronous")
        time.sleep(0.2)
    b.log("a synchronous standby (pg_receivewal --synchronous) confirms every commit")


def bench(ctx: b.Ctx, args) -> int:
    pg = b.Postgres(ctx, b.free_port())
    # synchronous_commit = on (run.py's cluster turns it off): with it off, a commit reaches
    # the WAL sender only when the WAL writer flushes (wal_writer_delay, 200 ms), which would
    # be most of the lag measured.
    pg.extra_conf = ("wal_level = logical\nmax_wal_senders = 10\nmax_replication_slots = 10\n"
                     "synchronous_commit = on\n")
    pg.start()
    if args.sync_standby:
        sync_standby(ctx, pg)
    writer_sql = ctx.tmp / "writer.sql"
    writer_sql.write_text("\\set aid random(1, 100000)\n"
                          "UPDATE pgbench_accounts SET abalance = abalance + 1 WHERE aid = :aid;\n")
    b.chown_tree(ctx.tmp, ctx.run_as)
    # PostgreSQL directly: the readers' baseline (no pgmemo, no metrics).
    targets = {"PostgreSQL directly": (pg.port, None, None)}
    for name, extra in [("no cache", []), ("cache, TTL", ["--cache"]),
                        ("cache, WAL", ["--cache", "--cache-invalidation", "wal"])]:
        port, mport = b.free_port(), b.free_port()
        argv = [args.pgmemo_bin, "--upstream", f"postgresql://{b.DB_USER}@127.0.0.1:{pg.port}",
                "--listen", f"127.0.0.1:{port}", "--pool-mode", "transaction", "--pool-size", "10",
                "--auth", "trust", "--metrics-listen", f"127.0.0.1:{mport}"] + extra
        logfile = ctx.logdir / f"pgmemo-{len(targets) - 1}.log"
        proc = ctx.procs.spawn(name, argv, stdout=ctx.open_log(logfile), stderr=subprocess.STDOUT)
        b.wait_port(name, "127.0.0.1", port, proc, logfile)
        targets[name] = (port, mport, proc)
    rows = {name: [] for name in targets}
    for rnd in range(args.rounds):
        for name, (port, mport, proc) in targets.items():
            # Warm: the WAL target's follower starts at its first lookup and catches up.
            warm = [ctx.pgbench, "-n", "-f", str(BENCH_DIR / "cache_hot.sql"), "-s", str(args.scale),
                    "-M", "simple", "-c", "2", "-T", "2", "-h", "127.0.0.1", "-p", str(port),
                    "-U", b.DB_USER, b.DB_NAME]
            subprocess.run(warm, capture_output=True)
            m0 = metrics(mport) if mport else ""
            # The WAL target's walsender (it keeps decoding during the other targets' runs:
            # counted for its own only).
            walsenders = psql(pg, "SELECT pid FROM pg_stat_activity WHERE backend_type = 'walsender'")
            senders = [int(x) for x in walsenders.split()] if walsenders and name == "cache, WAL" else []
            ticks0 = sum(b.proc_cpu_ticks(pid) or 0 for pid in senders)
            cpu0 = (b.proc_cpu_ticks(proc.pid) or 0) if proc else 0
            reader = subprocess.Popen(
                [ctx.pgbench, "-n", "-f", str(BENCH_DIR / "cache_hot.sql"), "-s", str(args.scale),
                 "-M", "simple", "-c", str(args.clients), "-j", "2", "-T", str(args.duration),
                 "-h", "127.0.0.1", "-p", str(port), "-U", b.DB_USER, b.DB_NAME],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            writer = subprocess.Popen(
                [ctx.pgbench, "-n", "-f", str(writer_sql), "-R", str(args.write_rate), "-c", "2",
                 "-j", "1", "-T", str(args.duration), "-M", "prepared", "-h", "127.0.0.1",
                 "-p", str(pg.port), "-U", b.DB_USER, b.DB_NAME],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            rout, rerr = reader.communicate()
            wout, werr = writer.communicate()
            cpu = ((b.proc_cpu_ticks(proc.pid) or 0) - cpu0) / TICK if proc else None
            ticks = sum(b.proc_cpu_ticks(pid) or 0 for pid in senders) - ticks0
            m1 = metrics(mport) if mport else ""
            tps = float(b.RE_TPS.search(rout).group(1)) if b.RE_TPS.search(rout) else None
            reads = int(b.RE_TX.search(rout).group(1)) if b.RE_TX.search(rout) else 0
            writes = int(b.RE_TX.search(wout).group(1)) if b.RE_TX.search(wout) else 0
            hits = metric_sum(m1, "pgmemo_cache_hits_total") - metric_sum(m0, "pgmemo_cache_hits_total")
            misses = metric_sum(m1, "pgmemo_cache_misses_total") - metric_sum(m0, "pgmemo_cache_misses_total")
            lag = [metric_sum(m1, "pgmemo_cache_invalidation_lag_seconds", f'quantile="{q}"')
                   for q in ("0.5", "0.99")]
            time.sleep(1)  # the writer has stopped: what is still stale a second later
            stale = 0
            for aid in range(1, 101):
                # The text exactly as pgbench sends it (its `;` included: part of the key).
                sql = f"/* pgmemo cache ttl=60s */ SELECT abalance FROM pgbench_accounts WHERE aid = {aid};"
                # With pgbench's client_encoding (the database's), so that psql's reads use the
                # same cache keys as pgbench's.
                through = subprocess.run(
                    [b.tool(ctx.pg_bindir, "psql"), "-h", "127.0.0.1", "-p", str(port), "-U", b.DB_USER,
                     "-d", b.DB_NAME, "-Atqc", sql], capture_output=True, text=True,
                    env=dict(os.environ, PGCLIENTENCODING="UTF8")).stdout.strip()
                stale += through != psql(pg, sql)
            row = dict(tps=tps, hit=hits / (hits + misses) if hits + misses else None, stale=stale,
                       cpu_us=cpu / reads * 1e6 if reads and cpu is not None else None,
                       writes=writes,
                       lag50=lag[0] * 1000 if name == "cache, WAL" else None,
                       lag99=lag[1] * 1000 if name == "cache, WAL" else None,
                       dec_us=ticks / TICK / writes * 1e6 if writes and senders else None,
                       dec_core=ticks / TICK / args.duration if senders else None)
            rows[name].append(row)
            b.log(f"round {rnd + 1} {name}: {tps} tps, hit {row['hit']}, stale {stale}/100, "
                  f"writes {writes}, lag {row['lag50']}/{row['lag99']} ms, "
                  f"walsender {row['dec_us']} us/write ({row['dec_core']} core)")

    def med(name, key, fmt):
        vals = [r[key] for r in rows[name] if r[key] is not None]
        return fmt.format(statistics.median(vals)) if vals else "—"

    direct = [r["tps"] for r in rows["PostgreSQL directly"] if r["tps"]]

    def times_direct(name):
        vals = [r["tps"] for r in rows[name] if r["tps"]]
        if not vals or not direct:
            return "—"
        return "{:.2f}".format(statistics.median(vals) / statistics.median(direct))

    lines = ["| target | reader TPS | × direct | hit ratio | stale hot keys (of 100) | pgmemo µs CPU/read | "
             "invalidation lag p50 / p99 (ms) | walsender µs CPU/write | walsender share of a core |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name in targets:
        lines.append(f"| {name} | {med(name, 'tps', '{:,.0f}')} | {times_direct(name)} | "
                     f"{med(name, 'hit', '{:.3f}')} | "
                     f"{med(name, 'stale', '{:.0f}')} | {med(name, 'cpu_us', '{:.1f}')} | "
                     f"{med(name, 'lag50', '{:.1f}')} / {med(name, 'lag99', '{:.1f}')} | "
                     f"{med(name, 'dec_us', '{:.1f}')} | {med(name, 'dec_core', '{:.3f}')} |")
    summary = "\n".join([
        f"`python3 bench/wal.py --duration {args.duration} --rounds {args.rounds} "
        f"--clients {args.clients} --write-rate {args.write_rate}`: readers `pgbench -f bench/cache_hot.sql "
        f"-M simple -c {args.clients}` through each target while a writer updates "
        f"{args.write_rate}/s random accounts of the read range directly on PostgreSQL "
        f"({ctx.pg_version}); medians of {args.rounds} rounds.", "", *lines])
    print(summary)
    (ctx.outdir / "summary.md").write_text(summary + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
