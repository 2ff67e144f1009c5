#!/usr/bin/env python3
"""What slow and hostile clients cost the others (issue 37, item 6): pgbench's latency and
pgmemo's memory, quiet and with hostile clients at work.

    python3 bench/hostile.py                  # ~1 min
    python3 bench/hostile.py --duration 30 --rounds 3

A throwaway PostgreSQL (pgbench -i -s 1) and pgmemo (release build, transaction mode, pool 10)
on loopback. Each round runs `pgbench -S -M simple -c 4` through pgmemo twice: quiet, then while
these clients work through the same pgmemo:

- 4 clients that each ask for ~3 GB of rows and read none (each holds a server);
- 2 clients that each pipeline 100,000 queries (50 MB of replies) and read none (a server each);
- 1 client after another that declares a 1 GB message and streams bytes (refused at once),
  20 a second (--huge-rate);
- 20 lanes of clients that log in, BEGIN, lock a row and go (closing the socket or sending
  Terminate), 500 a second in all (--abandon-rate).

--kinds picks some of them (never-reads,pipelines,huge,abandons).

Reported per round: pgbench's average latency quiet and hostile and their ratio (the issue asks
for at most 2x), pgmemo's VmRSS quiet, its peak while hostile and after the hostile clients
left, and how many abandoned transactions and refused messages there were. The ratio includes
the CPU the hostile clients and PostgreSQL's extra backends take from the 2 cores here.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))
import run as b  # noqa: E402  (bench/run.py: cluster, processes, pgbench helpers)


def startup(user: str, db: str) -> bytes:
    body = struct.pack("!i", 196608)
    for part in ("user", user, "database", db, ""):
        body += part.encode() + b"\0"
    return struct.pack("!i", len(body) + 4) + body


def query(sql: str) -> bytes:
    payload = sql.encode() + b"\0"
    return b"Q" + struct.pack("!i", len(payload) + 4) + payload


async def read_until_ready(reader: asyncio.StreamReader, count: int = 1) -> None:
    seen = 0
    while seen < count:
        tag = await reader.readexactly(1)
        (n,) = struct.unpack("!i", await reader.readexactly(4))
        await reader.readexactly(n - 4)
        if tag == b"Z":
            seen += 1


KINDS = ("never-reads", "pipelines", "huge", "abandons")
LANES = 20


class Hostile:
    """The hostile clients, on an asyncio loop of their own thread, until stopped."""

    def __init__(self, port: int, kinds: set, abandon_rate: float, huge_rate: float) -> None:
        self.port, self.kinds = port, kinds
        self.abandon_rate, self.huge_rate = abandon_rate, huge_rate
        self.stop = False
        self.abandoned = 0
        self.refused = 0
        self.writers: list = []

    async def login(self):
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        writer.write(startup(b.DB_USER, b.DB_NAME))
        await read_until_ready(reader)
        self.writers.append(writer)
        return reader, writer

    async def never_reads(self) -> None:
        _, writer = await self.login()
        writer.write(query("SELECT repeat('x', 1000) FROM generate_series(1, 3000000)"))
        await writer.drain()

    async def pipelines(self) -> None:
        _, writer = await self.login()
        batch = b"".join(query(f"SELECT {i}, repeat('y', 500)") for i in range(100_000))
        writer.write(batch)  # never drained in full: pgmemo stops reading

    async def huge_messages(self) -> None:
        chunk = b" " * (1 << 20)
        while not self.stop:
            await asyncio.sleep(1 / self.huge_rate)
            writer = None
            try:
                reader, writer = await self.login()
                self.writers.remove(writer)
                writer.write(b"Q" + struct.pack("!i", 1 << 30))
                for _ in range(64):
                    writer.write(chunk)
                    await writer.drain()
            except (ConnectionError, OSError, asyncio.IncompleteReadError):
                self.refused += 1
            finally:
                if writer is not None:
                    writer.close()

    async def abandons(self, lane: int) -> None:
        i = lane
        while not self.stop:
            await asyncio.sleep(LANES / self.abandon_rate)
            try:
                reader, writer = await self.login()
                self.writers.remove(writer)
                writer.write(query("BEGIN") + query(
                    f"UPDATE pgbench_accounts SET abalance = abalance WHERE aid = {1 + i % 100000}"))
                await read_until_ready(reader, 2)
                if i % 2 == 0:
                    writer.write(b"X\0\0\0\4")
                writer.close()
                self.abandoned += 1
            except (ConnectionError, OSError, asyncio.IncompleteReadError):
                pass
            i += LANES

    async def main(self) -> None:
        tasks = []
        if "never-reads" in self.kinds:
            for _ in range(4):
                await self.never_reads()
        if "pipelines" in self.kinds:
            for _ in range(2):
                await self.pipelines()
        if "huge" in self.kinds:
            tasks.append(asyncio.create_task(self.huge_messages()))
        if "abandons" in self.kinds:
            tasks += [asyncio.create_task(self.abandons(lane)) for lane in range(LANES)]
        while not self.stop:
            await asyncio.sleep(0.1)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for w in self.writers:
            w.transport.abort()

    def start(self) -> threading.Thread:
        t = threading.Thread(target=lambda: asyncio.run(self.main()), daemon=True)
        t.start()
        return t


def pgbench(ctx: b.Ctx, port: int, duration: int) -> float:
    r = subprocess.run([ctx.pgbench, "-n", "-S", "-M", "simple", "-c", "4", "-j", "2", "-T",
                        str(duration), "-h", "127.0.0.1", "-p", str(port), "-U", b.DB_USER,
                        b.DB_NAME], capture_output=True, text=True)
    m = b.re.search(r"latency average = ([0-9.]+) ms", r.stdout)
    if not m:
        raise b.BenchError(f"pgbench: {r.stderr.strip()[-500:]}")
    return float(m.group(1))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=int, default=10, help="seconds per pgbench run")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--pgmemo-bin", default=str(b.REPO / "target" / "release" / "pgmemo"))
    p.add_argument("--no-build", action="store_true")
    p.add_argument("--kinds", default=",".join(KINDS), help=f"which hostile clients: {','.join(KINDS)}")
    p.add_argument("--abandon-rate", type=float, default=500,
                   help="abandoned transactions per second (logins included)")
    p.add_argument("--huge-rate", type=float, default=20, help="1 GB messages per second")
    args = p.parse_args()
    kinds = set(args.kinds.split(","))
    args.scale = 1
    ctx = b.script_ctx(args, "pgmemo-hostile-")
    b.log(f"logs in {ctx.logdir}")
    b.raise_nofile(4096)
    try:
        pg = b.Postgres(ctx, b.free_port())
        pg.start()
        port = b.free_port()
        argv = [args.pgmemo_bin, "--upstream", f"postgresql://{b.DB_USER}@127.0.0.1:{pg.port}",
                "--listen", f"127.0.0.1:{port}", "--pool-mode", "transaction", "--pool-size", "10",
                "--auth", "trust"]
        logfile = ctx.logdir / "pgmemo.log"
        proc = ctx.procs.spawn("pgmemo", argv, stdout=ctx.open_log(logfile), stderr=subprocess.STDOUT)
        b.wait_port("pgmemo", "127.0.0.1", port, proc, logfile)
        pgbench(ctx, port, 2)  # warm-up
        ratios = []
        for rnd in range(args.rounds):
            quiet = pgbench(ctx, port, args.duration)
            rss_quiet = b.proc_status_kib(proc.pid)
            hostile = Hostile(port, kinds, args.abandon_rate, args.huge_rate)
            thread = hostile.start()
            peak = [rss_quiet]

            def sample() -> None:
                while thread.is_alive():
                    peak[0] = max(peak[0], b.proc_status_kib(proc.pid) or 0)
                    time.sleep(0.2)

            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            loaded = pgbench(ctx, port, args.duration)
            hostile.stop = True
            thread.join(30)
            sampler.join(5)
            # The pool back to normal: a quick query through every server.
            pgbench(ctx, port, 1)
            rss_after = b.proc_status_kib(proc.pid)
            ratios.append(loaded / quiet)
            b.log(f"round {rnd + 1}: latency quiet {quiet:.3f} ms, with hostile clients "
                  f"{loaded:.3f} ms ({loaded / quiet:.2f}x); pgmemo VmRSS quiet {rss_quiet} KiB, "
                  f"peak {peak[0]} KiB, after {rss_after} KiB; {hostile.abandoned} abandoned "
                  f"transactions, {hostile.refused} refused 1 GB messages")
        b.log(f"median ratio {statistics.median(ratios):.2f}x over {args.rounds} rounds "
              f"(pgmemo {b.version_of([args.pgmemo_bin, '--version'])}, git {b.git_rev()})")
        return 0
    finally:
        b.script_done(ctx)


if __name__ == "__main__":
    sys.exit(main())
