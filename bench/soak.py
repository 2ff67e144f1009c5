#!/usr/bin/env python3
"""A soak (issue 37, item 7): 10,000 connected clients, a few hundred of them active with mixed
workloads, for 30 minutes, through one pgmemo with the result cache following the WAL.

    python3 bench/soak.py                         # 30 min
    python3 bench/soak.py --minutes 2 --idle 2000 # a short run

A throwaway PostgreSQL (wal_level = logical, pgbench -i -s 1) and pgmemo (release build,
transaction mode, pool 20, --cache --cache-invalidation wal) on loopback. bench/idle_clients.py
holds the idle clients; --active asyncpg clients (one process) each run one workload, chosen by
their number:

- simple: simple-protocol reads of a constant tagged with the client (autoprepared);
- extended: prepared statements with parameters (asyncpg's statement cache);
- cached: hinted reads of `pgbench_branches`, which nothing writes: always the value loaded;
- writer: writes its own account through pgmemo, then reads it back hinted (read-your-writes
  through the cache): always the value just written;
- copy: COPY of 500 rows into a log table, which says it copied 500;
- listen: LISTEN, while the writers NOTIFY: notifications arrive (8 listeners at most: each
  pins a server);
- errors: transactions that fail (division by zero) and roll back: the error each time;
- direct: like writer, but the write goes to PostgreSQL directly and the read through pgmemo
  must see it once pgmemo's follower applied it (read with a short retry: a bound, not a
  check of staleness at the instant).

Every check that fails counts as a wrong result. Every 30 s: pgmemo's VmRSS, its pools (SHOW
POOLS), its statement registry (SHOW PREPARED_STATEMENTS), shapes and cache bytes (/metrics), PostgreSQL's backends. At the end
the active clients stop and the report says whether every server is back (none active, none in
a transaction, no more than the pool), and how RSS moved after the warm-up (first 5 minutes, or
the first sixth of a short run).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))
import run as b  # noqa: E402  (bench/run.py: cluster, processes helpers)

KINDS = ("simple", "extended", "cached", "writer", "copy", "listen", "errors", "direct")
# A LISTEN pins its server (transaction mode), and pgmemo refuses to pin more than
# max_pinned_fraction (0.5) of the pool: 8 listeners on a pool of 20.
LISTENERS = 8
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def metric(port: int, name: str) -> float:
    with _NO_PROXY.open(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#"))


class Soak:
    def __init__(self, port: int, pg_port: int, active: int, kinds: tuple) -> None:
        self.port, self.pg_port, self.active, self.kinds = port, pg_port, active, kinds
        self.stop = False
        self.ops = {k: 0 for k in KINDS}
        self.errors = {k: 0 for k in KINDS}  # connection-level failures, reconnected
        self.wrong: list[str] = []
        self.notified = 0

    def dsn(self, port: int) -> str:
        return f"postgresql://{b.DB_USER}@127.0.0.1:{port}/{b.DB_NAME}"

    def check(self, ok: bool, what: str) -> None:
        if not ok and len(self.wrong) < 50:
            self.wrong.append(what)

    async def client(self, n: int) -> None:
        import asyncpg
        kind = self.kinds[n % len(self.kinds)]
        if kind == "listen" and n // len(self.kinds) >= LISTENERS:
            kind = "simple"  # each listener pins a server: at most max_pinned_fraction may
        rng = random.Random(n)
        i = 0
        while not self.stop:
            try:
                conn = await asyncpg.connect(self.dsn(self.port), statement_cache_size=100)
                direct = await asyncpg.connect(self.dsn(self.pg_port)) if kind == "direct" else None
                if kind == "listen":
                    await conn.add_listener("soak", lambda *_: self.__setattr__("notified", self.notified + 1))
                while not self.stop:
                    i += 1
                    await self.step(kind, n, i, rng, conn, direct)
                    self.ops[kind] += 1
                    if kind == "listen":
                        await asyncio.sleep(0.5)  # pacing: a listener mostly waits
            except (OSError, asyncpg.PostgresConnectionError, asyncpg.InterfaceError,
                    asyncio.TimeoutError) as e:
                self.errors[kind] += 1
                if self.errors[kind] < 5:
                    print(f"soak: {kind} client {n}: {e!r}", file=sys.stderr)
                await asyncio.sleep(0.1)

    async def step(self, kind, n, i, rng, conn, direct) -> None:
        import asyncpg
        if kind == "simple":
            v = await conn.fetchval(f"SELECT 'c{n}:' || {i % 100}")
            self.check(v == f"c{n}:{i % 100}", f"simple c{n}: {v}")
        elif kind == "extended":
            v = await conn.fetchval("SELECT $1::text || ':' || $2::int", f"c{n}", i)
            self.check(v == f"c{n}:{i}", f"extended c{n}: {v}")
        elif kind == "cached":
            # fetch (Execute of all rows) and fetchval (a row limit of 1) are cached apart.
            sql = "/* pgmemo cache ttl=60s */ SELECT bbalance FROM pgbench_branches WHERE bid = 1"
            v = (await conn.fetch(sql))[0][0] if i % 2 else await conn.fetchval(sql)
            self.check(v == 0, f"cached c{n}: bbalance {v}")
        elif kind in ("writer", "direct"):
            aid = 1000 + n
            if kind == "writer":
                await conn.execute(f"UPDATE pgbench_accounts SET abalance = {i} WHERE aid = {aid}")
                if i % 10 == 0:
                    await conn.execute("SELECT pg_notify('soak', $1)", str(i))
            else:
                await direct.execute(f"UPDATE pgbench_accounts SET abalance = {i} WHERE aid = {aid}")
            sql = f"/* pgmemo cache ttl=60s */ SELECT abalance FROM pgbench_accounts WHERE aid = {aid}"

            async def read():
                return (await conn.fetch(sql))[0][0] if i % 2 else await conn.fetchval(sql)
            v = await read()
            if kind == "direct":
                # The follower applies the write within its lag: read until seen, at most 5 s.
                end = time.monotonic() + 5
                while v != i and time.monotonic() < end:
                    await asyncio.sleep(0.01)
                    v = await read()
            self.check(v == i, f"{kind} c{n}: wrote {i}, read {v}")
        elif kind == "copy":
            rows = [(n, f"c{n} {i} {j}") for j in range(500)]
            r = await conn.copy_records_to_table("soak_log", records=rows, columns=["k", "note"])
            self.check(r == "COPY 500", f"copy c{n}: {r}")
            if i % 20 == 0:
                await conn.execute(f"DELETE FROM soak_log WHERE k = {n}")
        elif kind == "listen":
            v = await conn.fetchval("SELECT 1")
            self.check(v == 1, f"listen c{n}: {v}")
        elif kind == "errors":
            try:
                async with conn.transaction():
                    await conn.execute(f"UPDATE pgbench_accounts SET abalance = -1 WHERE aid = {2000 + n}")
                    await conn.fetchval("SELECT 1/0")
                self.check(False, f"errors c{n}: no error")
            except asyncpg.DivisionByZeroError:
                pass
            v = await conn.fetchval(f"SELECT abalance FROM pgbench_accounts WHERE aid = {2000 + n}")
            self.check(v == 0, f"errors c{n}: a rolled back write survived ({v})")

    async def run(self) -> None:
        tasks = [asyncio.create_task(self.client(n)) for n in range(self.active)]
        while not self.stop:
            await asyncio.sleep(0.2)
        await asyncio.gather(*tasks, return_exceptions=True)


def admin(port: int, cmd: str) -> list[dict]:
    import psycopg
    with psycopg.connect(host="127.0.0.1", port=port, user=b.DB_USER, dbname="pgmemo",
                         autocommit=True) as c:
        cur = c.execute(cmd)
        cols = [d.name for d in cur.description]
        return [dict(zip(cols, row)) for row in cur.fetchall()]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=30)
    p.add_argument("--idle", type=int, default=10_000)
    p.add_argument("--active", type=int, default=200)
    p.add_argument("--kinds", default=",".join(KINDS), help="the active clients' workloads")
    p.add_argument("--pgmemo-bin", default=str(b.REPO / "target" / "release" / "pgmemo"))
    p.add_argument("--no-build", action="store_true")
    p.add_argument("--out", default=None, help="write the samples as JSON lines here")
    args = p.parse_args()
    args.scale = 1
    ctx = b.script_ctx(args, "pgmemo-soak-")
    b.log(f"logs in {ctx.logdir}")
    b.raise_nofile(2 * args.idle + 4 * args.active + 1000)
    samples = []
    try:
        pg = b.Postgres(ctx, b.free_port())
        pg.extra_conf = ("wal_level = logical\nmax_wal_senders = 10\nmax_replication_slots = 10\n"
                         "synchronous_commit = on\n")
        pg.start()
        pg.psql(b.DB_NAME, "CREATE TABLE soak_log (k int, note text)")
        port, mport = b.free_port(), b.free_port()
        argv = [args.pgmemo_bin, "--upstream", f"postgresql://{b.DB_USER}@127.0.0.1:{pg.port}",
                "--listen", f"127.0.0.1:{port}", "--pool-mode", "transaction", "--pool-size", "20",
                "--auth", "trust", "--admin-user", b.DB_USER, "--cache", "--cache-invalidation", "wal",
                "--metrics-listen", f"127.0.0.1:{mport}",
                "--max-client-conn", str(args.idle + args.active + 1000)]
        logfile = ctx.logdir / "pgmemo.log"
        proc = ctx.procs.spawn("pgmemo", argv, stdout=ctx.open_log(logfile), stderr=subprocess.STDOUT)
        b.wait_port("pgmemo", "127.0.0.1", port, proc, logfile)
        b.wait_port("metrics", "127.0.0.1", mport, proc, logfile)
        idle = ctx.procs.spawn("idle clients", [sys.executable, str(BENCH_DIR / "idle_clients.py"),
                                                "--port", str(port), "--user", b.DB_USER,
                                                "--database", b.DB_NAME, "-n", str(args.idle)],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        ready = json.loads(idle.stdout.readline())
        b.log(f"{ready['opened']} idle clients logged in ({ready['failed']} failed) in "
              f"{ready['seconds']:.1f} s")
        soak = Soak(port, pg.port, args.active, tuple(args.kinds.split(",")))
        import threading
        thread = threading.Thread(target=lambda: asyncio.run(soak.run()), daemon=True)
        thread.start()
        t0 = time.monotonic()
        end = t0 + args.minutes * 60
        warm = t0 + min(300, args.minutes * 10)
        while True:
            now = time.monotonic()
            pools = [r for r in admin(port, "SHOW POOLS") if r["database"] == b.DB_NAME]
            s = dict(t=round(now - t0), rss_kib=b.proc_status_kib(proc.pid),
                     cl_active=sum(int(r["cl_active"]) for r in pools),
                     cl_waiting=sum(int(r["cl_waiting"]) for r in pools),
                     sv_active=sum(int(r["sv_active"]) for r in pools),
                     sv_idle=sum(int(r["sv_idle"]) for r in pools),
                     statements=len(admin(port, "SHOW PREPARED_STATEMENTS")),
                     shapes=metric(mport, "pgmemo_autoprepare_shapes"),
                     cache_bytes=metric(mport, "pgmemo_cache_bytes"),
                     cache_hits=metric(mport, "pgmemo_cache_hits_total"),
                     cache_flushes=metric(mport, "pgmemo_cache_flushes_total"),
                     wal_ready=metric(mport, "pgmemo_cache_wal_ready"),
                     ops=sum(soak.ops.values()), wrong=len(soak.wrong))
            samples.append(s)
            b.log(" ".join(f"{k}={v}" for k, v in s.items()))
            if now >= end or not thread.is_alive():
                break
            time.sleep(min(30, max(1, end - now)))
        soak.stop = True
        thread.join(60)
        time.sleep(1)
        pools = [r for r in admin(port, "SHOW POOLS") if r["database"] == b.DB_NAME]
        backends = pg.psql("postgres", "SELECT count(*), count(*) FILTER (WHERE state <> 'idle') "
                           f"FROM pg_stat_activity WHERE datname = '{b.DB_NAME}' "
                           "AND backend_type = 'client backend'")
        idle.stdin.close()
        after = [x for x in samples if x["t"] >= warm - t0] or samples[-1:]
        rss0, rss1 = after[0]["rss_kib"], samples[-1]["rss_kib"]
        b.log(f"ops {soak.ops}; reconnects {soak.errors}; notifications {soak.notified}")
        b.log(f"SHOW CACHE: {admin(port, 'SHOW CACHE')}")
        b.log(f"wrong results: {len(soak.wrong)} {soak.wrong[:5]}")
        b.log(f"at the end: sv_active {sum(int(r['sv_active']) for r in pools)}, cl_waiting "
              f"{sum(int(r['cl_waiting']) for r in pools)}, PostgreSQL backends (all, not idle) "
              f"{backends}; VmRSS after warm-up {rss0} KiB -> end {rss1} KiB "
              f"({(rss1 - rss0) / max(rss0, 1) * 100:+.1f}%), peak {max(x['rss_kib'] for x in samples)} KiB")
        b.log(f"git {b.git_rev()}, {args.minutes} min, {args.idle} idle, {args.active} active")
        if args.out:
            Path(args.out).write_text("".join(json.dumps(x) + "\n" for x in samples))
        return 1 if soak.wrong else 0
    finally:
        b.script_done(ctx)


if __name__ == "__main__":
    sys.exit(main())
