#!/usr/bin/env python3
"""Reads on a streaming replica with read-your-writes (issue 58): how much of a 90/10
read/write workload leaves the primary, and what learning each write's WAL position costs.

    python3 bench/replicas.py                  # ~2 min
    python3 bench/replicas.py --duration 30 --clients 16

A throwaway primary (synchronous_commit = on, pgbench -i -s 10) and a real streaming standby
of it (pg_basebackup -R -X stream, its own port), pgmemo (release build, pool 10,
transaction mode) with the standby as its replica. The workload (`bench/replicas_rw.sql`),
one request per pgbench transaction: write a row, read it back at once (a miss is recorded
in a table of its own: a read-your-writes violation), then 9 point reads of other rows; for
-M simple and -M extended. Reported per protocol:
- requests per second, through pgmemo without and with the replica, and with the replica and
  the result cache on the 9 reads (WAL invalidation: their misses fill on the replica once it
  has every commit they must show) (the standby shares this machine's two cores with
  everything else: not what a second machine would add);
- the share of reads executed on the replica (SHOW REPLICAS' reads over the reads sent, and
  over the reads a server ran: the cache answers the others);
- violations (rows not read back);
- the client statements the primary ran per request (SHOW STATS' queries less the replica's
  reads: the write and the reads that stayed), and the position questions pgmemo asked;
- then, with `bench/profile.sh` (callgrind, 1 client, 2,000 requests of the write alone):
  pgmemo's instructions per write with and without the replica configured: the cost of
  learning a write's position, on top of its one extra round trip.
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

READS_PER_REQUEST = 10  # the read-back and 9 others
# The third pgmemo: the replica, and the result cache (WAL invalidation) on the 9 reads, whose
# misses fill on the replica when it has replayed every commit they must show.
CACHED = "with the replica and the result cache"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=int, default=20, help="seconds per protocol")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--scale", type=int, default=10)
    p.add_argument("--pgmemo-bin", default=str(b.REPO / "target" / "release" / "pgmemo"))
    p.add_argument("--no-build", action="store_true")
    p.add_argument("--no-profile", action="store_true", help="skip the callgrind part")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    outdir = Path(args.out) if args.out else BENCH_DIR / "results" / f"replicas-{stamp}"
    ctx = b.script_ctx(args, "pgmemo-replicas-bench-", outdir)
    try:
        return bench(ctx, args)
    finally:
        ctx.procs.stop_all()
        ctx.close_logs()


def standby_of(ctx: b.Ctx, pg: b.Postgres) -> int:
    """A streaming standby of `pg` on a port of its own; returns the port."""
    port = b.free_port()
    data = ctx.tmp / "standby"
    kw = dict(user=ctx.run_as.uid, group=ctx.run_as.gid, extra_groups=[]) if ctx.run_as else {}
    # A fast checkpoint: a spread one waits for most of checkpoint_timeout.
    r = subprocess.run([b.tool(ctx.pg_bindir, "pg_basebackup"), "-D", str(data), "-R", "-X", "stream",
                        "--no-sync", "-c", "fast", "-h", "127.0.0.1", "-p", str(pg.port), "-U", b.DB_USER],
                       capture_output=True, text=True, **kw)
    if r.returncode != 0:
        raise b.BenchError(f"pg_basebackup failed: {r.stderr.strip()}")
    with open(data / "postgresql.conf", "a") as f:
        f.write(f"\nport = {port}\nunix_socket_directories = '{ctx.tmp}'\nhot_standby = on\n")
    logfile = ctx.logdir / "standby.log"
    proc = ctx.procs.spawn("standby", [b.tool(ctx.pg_bindir, "postgres"), "-D", str(data)],
                           run_as=ctx.run_as, cwd=ctx.tmp, stdout=ctx.open_log(logfile),
                           stderr=subprocess.STDOUT)
    b.wait_port("standby", "127.0.0.1", port, proc, logfile, 60)
    end = time.monotonic() + 60
    while sql(ctx, port, "select pg_is_in_recovery()") != "t":
        if time.monotonic() > end:
            raise b.BenchError("the standby did not come up")
        time.sleep(0.2)
    b.log(f"a streaming standby on 127.0.0.1:{port}")
    return port


def sql(ctx: b.Ctx, port: int, text: str, db: str = b.DB_NAME) -> str:
    r = subprocess.run([b.tool(ctx.pg_bindir, "psql"), "-h", "127.0.0.1", "-p", str(port), "-U",
                        b.DB_USER, "-d", db, "-Atqc", text], capture_output=True, text=True,
                       timeout=60)
    return r.stdout.strip() if r.returncode == 0 else ""


def replica_reads(ctx: b.Ctx, port: int) -> int:
    rows = sql(ctx, port, "SHOW REPLICAS", db="pgmemo")
    return sum(int(line.split("|")[8]) for line in rows.splitlines() if line)


def queries(ctx: b.Ctx, port: int) -> int:
    """The client statements pgmemo ran for the bench database (SHOW STATS' total_query_count:
    on the primary or a replica)."""
    out = subprocess.run([b.tool(ctx.pg_bindir, "psql"), "-h", "127.0.0.1", "-p", str(port), "-U",
                          b.DB_USER, "-d", "pgmemo", "-c", "SHOW STATS", "--csv"], capture_output=True, text=True).stdout
    lines = out.splitlines()
    if not lines:
        return 0
    header = lines[0].split(",")
    at = header.index("total_query_count")
    return sum(int(l.split(",")[at]) for l in lines[1:] if l.split(",")[0] == b.DB_NAME)


def cache_figures(ctx: b.Ctx, port: int) -> tuple[int, int, int]:
    """The result cache's (hits, misses, stores), SHOW CACHE's accounts rule."""
    out = subprocess.run([b.tool(ctx.pg_bindir, "psql"), "-h", "127.0.0.1", "-p", str(port), "-U",
                          b.DB_USER, "-d", "pgmemo", "-c", "SHOW CACHE", "--csv"],
                         capture_output=True, text=True).stdout
    lines = out.splitlines()
    if not lines:
        return (0, 0, 0)
    header = lines[0].split(",")
    for line in lines[1:]:
        row = dict(zip(header, line.split(",")))
        if row.get("rule") == "accounts":
            return (int(row["hits"]), int(row["misses"]), int(row["stores"]))
    return (0, 0, 0)


def bench(ctx: b.Ctx, args) -> int:
    pg = b.Postgres(ctx, b.free_port())
    # (Logical: the third pgmemo's result cache follows the WAL.)
    pg.extra_conf = "synchronous_commit = on\nwal_level = logical\nmax_wal_senders = 10\n"
    pg.start()
    pg.psql(b.DB_NAME, "CREATE TABLE rw (id bigint PRIMARY KEY, v int); "
                       "CREATE TABLE rw_violations (id bigint)")
    sport = standby_of(ctx, pg)
    ports = {}
    cached = ctx.tmp / "cached.toml"
    cached.write_text('[cache]\nenabled = true\ninvalidation = "wal"\n\n[[cache.rules]]\n'
                      'name = "accounts"\n'
                      'query_contains = "FROM pgbench_accounts"\n'
                      'ttl = "600s"\n')
    b.chown_tree(ctx.tmp, ctx.run_as)
    replica = ["--replica", f"postgresql://127.0.0.1:{sport}"]
    for name, extra in [("without replicas", []),
                        ("with the replica", replica),
                        (CACHED, replica + ["--config", str(cached), "--cache"])]:
        port = b.free_port()
        argv = [args.pgmemo_bin, "--upstream", f"postgresql://{b.DB_USER}@127.0.0.1:{pg.port}",
                "--listen", f"127.0.0.1:{port}", "--pool-mode", "transaction", "--pool-size", "10",
                "--auth", "trust", "--admin-user", b.DB_USER] + extra
        logfile = ctx.logdir / f"pgmemo-{len(ports)}.log"
        proc = ctx.procs.spawn(name, argv, stdout=ctx.open_log(logfile), stderr=subprocess.STDOUT)
        b.wait_port(name, "127.0.0.1", port, proc, logfile)
        ports[name] = port
    for port in [ports["with the replica"], ports[CACHED]]:
        end = time.monotonic() + 30
        while sql(ctx, port, "select current_setting('port')") != str(sport):
            if time.monotonic() > end:
                raise b.BenchError("reads never reached the replica")
            time.sleep(0.2)
    script = BENCH_DIR / "replicas_rw.sql"
    print(f"\n## Reads on a replica, read-your-writes ({args.clients} clients, {args.duration} s, "
          f"scale {args.scale}, git {b.git_rev()})\n")
    print("| protocol | pgmemo | requests/s | reads on the replica | of the reads that reached a server | violations | client statements on the primary per request | position questions per request |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    notes = []
    for mode, (name, port) in [(m, t) for m in ["simple", "extended"] for t in ports.items()]:
        cache0 = cache_figures(ctx, port) if name == CACHED else None
        replicas = name != "without replicas"
        reads0 = replica_reads(ctx, port) if replicas else 0
        queries0 = queries(ctx, port)
        bad0 = int(sql(ctx, pg.port, "SELECT count(*) FROM rw_violations") or 0)
        run = subprocess.run([ctx.pgbench, "-n", "-f", str(script), "-M", mode, "-c", str(args.clients),
                              "-j", "2", "-T", str(args.duration), "-s", str(args.scale),
                              "-h", "127.0.0.1", "-p", str(port), "-U", b.DB_USER, b.DB_NAME],
                             capture_output=True, text=True)
        out = run.stdout + run.stderr
        (ctx.logdir / f"pgbench-{mode}-{len(name)}.log").write_text(out)
        tx = re.search(r"number of transactions actually processed: (\d+)", out)
        tps = re.search(r"tps = ([\d.]+)", out)
        if run.returncode != 0 or not tx or not tps:
            raise b.BenchError(f"pgbench failed:\n{out[-2000:]}")
        requests = int(tx.group(1))
        on_replica = replica_reads(ctx, port) - reads0 if replicas else 0
        bad = int(sql(ctx, pg.port, "SELECT count(*) FROM rw_violations") or 0) - bad0
        share = on_replica / (requests * READS_PER_REQUEST)
        cache = None
        if cache0 is not None:
            cache = [a - b0 for a, b0 in zip(cache_figures(ctx, port), cache0)]
        hits = cache[0] if cache else 0
        # SHOW STATS counts the queries the cache answered too.
        on_primary = queries(ctx, port) - queries0 - on_replica - hits
        # The reads a server ran: all but those the cache answered.
        served = requests * READS_PER_REQUEST - hits
        served_share = on_replica / served if served > 0 else 0
        # The client's statements the primary ran (the write, reads that did not go to the
        # replica), and with the replica one position question per write.
        questions = 1 if replicas else 0
        print(f"| {mode} | {name} | {float(tps.group(1)):,.0f} | {share:.3f} | {served_share:.3f} | "
              f"{bad} | {on_primary / requests:.2f} | {questions} |")
        if cache:
            hits, misses, stores = cache
            notes.append(f"- {mode}, {name}: {hits:,} hits, {misses:,} misses, {stores:,} "
                         f"stores ({hits / max(1, hits + misses):.3f} hit ratio)")
    print()
    print("\n".join(notes))
    if not args.no_profile:
        profile(ctx, args, pg, sport)
    b.script_done(ctx)
    return 0


def profile(ctx: b.Ctx, args, pg: b.Postgres, sport: int) -> None:
    """pgmemo's instructions per write with and without a replica configured (callgrind)."""
    writes = ctx.tmp / "writes.sql"
    writes.write_text("\\set id random(1, 1000000000)\n"
                      "INSERT INTO rw VALUES (:id, 1) ON CONFLICT (id) DO UPDATE SET v = rw.v + 1;\n")
    b.chown_tree(ctx.tmp, ctx.run_as)
    print("\n| pgmemo | instructions per write (callgrind, 1 client, -M simple) |")
    print("|---|---:|")
    for name, extra in [("without replicas", []),
                        ("with the replica (its position asked after each write)",
                         ["-x", "--replica", "-x", f"postgresql://127.0.0.1:{sport}"])]:
        cmd = ["bash", str(BENCH_DIR / "profile.sh"), "-n", "-p", str(pg.port), "-d", b.DB_NAME,
               "-u", b.DB_USER, "-m", "simple", "-c", "1", "-t", "2000", "-r", "1",
               "-f", str(writes), "-s", str(args.scale)] + extra + [args.pgmemo_bin]
        r = subprocess.run(cmd, capture_output=True, text=True,
                           env=dict(os.environ, PROFILE_PORT=str(b.free_port())))
        m = re.search(r"(\d+) user-space instructions/tx", r.stdout + r.stderr)
        if not m:
            raise b.BenchError(f"profile.sh failed:\n{(r.stdout + r.stderr)[-2000:]}")
        print(f"| {name} | {int(m.group(1)):,} |")


if __name__ == "__main__":
    sys.exit(main())
