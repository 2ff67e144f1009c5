#!/usr/bin/env python3
"""pgmemo benchmark: pgbench through pgmemo, directly against PostgreSQL, and
through the peer poolers PgBouncer 1.25, Odyssey 1.5 and Debian's PgBouncer, side
by side in one run.

    python3 bench/run.py            # full default run (~29 min on 2 cores, the relay floor included)
    python3 bench/run.py --quick    # one round, 3 s runs, 8 clients (~2 min)
    python3 bench/run.py --quick --no-build --duration 2 --protocols simple --no-peers
    # the result cache (pgmemo --cache) against the same targets (~15 min on 2 cores):
    python3 bench/run.py --workloads cache-hot,cache-uniform,cache-rw --clients 8,32 --idle-clients 0

Targets (columns of the tables, in this order):
  * direct          the throwaway PostgreSQL itself (not a proxy);
  * pgmemo          target/release/pgmemo (built with `cargo build --release`
                    unless --no-build; --no-pgmemo leaves it out);
  * pgmemo+cache    a second pgmemo, the same arguments plus `--cache
                    --metrics-listen 127.0.0.1:<free port> --workers 2` (two event
                    loops; --cache-workers N), started only when a
                    cache workload (below) is selected; it runs only the cache
                    workloads (its cells of the others are `—`, not run, no
                    failure) and is left out of the idle-client memory test (the
                    same binary as pgmemo, with an empty cache there);
  * ceiling         bench/ceiling.c (compiled with cc into the temp dir; --no-ceiling
                    leaves it out), a server that answers every query at once with a
                    canned row and does nothing else: run only in the cache-hot
                    workloads (whose rows pgbench does not check), the TPS this
                    machine and pgbench reach with no work behind the socket;
  * relay           bench/relay.c (compiled with cc into the temp dir; --no-relay
                    leaves it out), the relay floor: each client gets its own
                    connection to PostgreSQL and bytes are copied both ways, nothing
                    else (no parsing, no pooling): run in every row but the cache
                    workloads, what any proxy costs on this machine before doing
                    anything (`pgmemo/relay`; at one client most of the latency every
                    proxy adds); not a peer;
  * pgbouncer-1.25, odyssey-1.5
                    the peers, built from source by REPO/../shared/peers/build.sh
                    into --peers-prefix (default /opt/peers; built there once,
                    ~2 min, when missing; if build.sh is missing or fails the run
                    goes on without them, with a warning) and started from that
                    directory's pgbouncer.ini.template / odyssey.conf.template;
                    --no-peers leaves them out;
  * pgbouncer-1.18  Debian's package `pgbouncer` (installed with apt-get when
                    missing and running as root), named with its version;
                    --no-pgbouncer leaves it out;
  * --target NAME=host:port  any already-running pooler (repeatable).
Every proxy runs in transaction mode with the same pool size (--pool-size) and
client limit (6000, or 1000 more than the largest --idle-clients count: the templates'
1000 is raised so that the idle-client test can open its clients), on a free loopback port; as root, PostgreSQL and the poolers run as
the unprivileged user `postgres` (they refuse or dislike root). The "peers" of
`pgmemo/best peer` are pgbouncer-1.25, odyssey-1.5 and Debian's PgBouncer (not
direct, not --target poolers); `pgmemo/best peer` is always about `pgmemo` (the
cache off), never about pgmemo+cache.

Workloads (rows; --workloads, default: the --protocols plus orm-simple, and the
three cache workloads with --cache-workloads):
  * simple, extended, prepared: `pgbench -S` (select-only) with that -M protocol;
  * orm-simple (also orm-extended, orm-prepared): bench/orm.sql, an ORM-like mix
    of a point select, a join with an IN list, an UPDATE and an INSERT, each its
    own autocommit statement, with that -M protocol (one "transaction" = one run
    of the script = 4 statements);
  * cache-hot, cache-uniform, cache-rw: the result cache, `-M simple` (and
    cache-hot-extended etc. with `-M extended`), run by every target (for all but
    pgmemo+cache the hint is just a comment):
      cache-hot      bench/cache_hot.sql: a point select of pgbench_accounts with
                     a leading `/* pgmemo cache ttl=60s */` hint, the aid drawn
                     random_zipfian(1, 100000, 1.1): a few hot keys, a high
                     hit ratio (the CPU µs per transaction is about that of a hit);
      cache-uniform  bench/cache_uniform.sql: the same select, the aid uniform: a
                     low hit ratio, so pgmemo+cache / pgmemo is the miss path's
                     cost (the goal: at most 10 % below pgmemo);
      cache-rw       bench/cache_rw.sql: 90 % the hot select; 10 % an UPDATE of the
                     client's own row and a cached read of it, which runs
                     `SELECT 1/0` (aborting the client: a FAIL) if the value read
                     is not the one just written, i.e. on a stale read;
      cache-tx       bench/cache_tx.sql: a web request in a transaction block: BEGIN,
                     three hot selects, in 10 % of requests an UPDATE of a teller
                     and a cached read of it in the block (a stale read aborts the
                     client), COMMIT.
    Before a cache workload's first cell, every target runs it once for
    --cache-warmup seconds, not measured: the cache is measured warm.

What it does, by itself:
  * starts a throwaway PostgreSQL (initdb in a temp dir, trust on 127.0.0.1,
    fsync=off, free port) and loads `pgbench -i -s SCALE`;
  * starts the proxies above;
  * for each workload x client count ("cell") and each round, runs
    `pgbench -n -j 2 -c C -T S -M P (-S | -f bench/orm.sql)` against every target,
    the targets in rotating order (round r starts at target r mod n);
  * records TPS (without connection time), average latency, failed transactions,
    exit status, and for the proxies the CPU time per transaction (utime+stime of
    the process, all threads, from /proc/PID/stat; Odyssey's daemon pid from its
    pid file) and RSS; for pgmemo+cache also the cache hits and misses of the run
    (pgmemo_cache_hits_total and pgmemo_cache_misses_total, each summed over its
    per-rule lines, scraped from its /metrics before and after the run, outside
    the CPU measurement) and the hit ratio hits / (hits + misses);
  * measures memory per idle client (bench/idle_clients.py) for the proxies;
  * prints markdown tables on stdout (per cell: median TPS and min-max of every
    target, proxy/direct ratios, `pgmemo/best peer` = pgmemo's median TPS over
    the best median among the peers, each proxy's CPU µs per transaction), with
    cache workloads a second table "Result cache" (per cache workload x clients:
    TPS of direct, pgmemo, pgmemo+cache and the best peer, pgmemo+cache over each
    of them, hit ratio, CPU µs per transaction of pgmemo and pgmemo+cache, and
    pgmemo+cache's failed transactions: pgbench's count plus aborted clients,
    0 in cache-rw = no stale read), and writes runs.csv (one row per run),
    cells.csv (one row per cell, the same columns as the tables), memory.csv,
    tps.png (TPS and CPU µs/tx per target), summary.md, meta.json and the
    servers' logs into bench/results/<timestamp>/.

Progress goes to stderr; the report goes to stdout. Nothing is left running when
it ends, also on Ctrl-C or an error: every child runs in its own process group
and is stopped in a finally block (Odyssey, which daemonizes, by the pid from its
pid file, with a watchdog that kills it should this harness be SIGKILLed); the
temp dir is removed.

Standard library only, except matplotlib for the plot (pip install -r
bench/requirements.txt); without it the plot is skipped with a warning.
"""
from __future__ import annotations

import argparse
import atexit
import csv
import ctypes
import datetime as dt
import glob
import http.client
import json
import os
import platform
import pwd
import re
import resource
import select
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field, asdict
from pathlib import Path
from typing import Optional

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE_KIB = os.sysconf("SC_PAGE_SIZE") // 1024

DB_USER = "bench"
DB_NAME = "bench"
PROTOCOLS = ("simple", "extended", "prepared")
ORM_SCRIPT = BENCH_DIR / "orm.sql"
# The result-cache workloads and their scripts: -M simple, and with an -extended suffix -M
# extended (the statement's hint is in its text, so both protocols are cached).
_CACHE_BASE = {"cache-hot": BENCH_DIR / "cache_hot.sql",
               "cache-uniform": BENCH_DIR / "cache_uniform.sql",
               "cache-rw": BENCH_DIR / "cache_rw.sql",
               "cache-tx": BENCH_DIR / "cache_tx.sql"}
CACHE_SCRIPTS = {**_CACHE_BASE, **{f"{k}-extended": v for k, v in _CACHE_BASE.items()}}
# The default cache workloads (--cache-workloads): simple and extended hot, the others simple.
CACHE_WORKLOADS = ("cache-hot", "cache-hot-extended", "cache-uniform", "cache-rw")
# Every workload name: the select-only protocols, the ORM-like script with each protocol,
# and the cache workloads.
# pgbench's built-in TPC-B-like script (not in the default matrix: see --workloads).
TPCB_WORKLOADS = tuple(f"tpcb-{p}" for p in PROTOCOLS)
WORKLOADS = (PROTOCOLS + tuple(f"orm-{p}" for p in PROTOCOLS) + tuple(CACHE_SCRIPTS)
             + TPCB_WORKLOADS)
# The pgmemo with its result cache on (--cache), started when a cache workload is selected.
CACHE_TARGET = "pgmemo+cache"
# bench/ceiling.c: a server that answers every query at once with a canned row, run in the
# cache-hot workloads (pgbench does not read their rows) as the most any target could reach.
CEILING_TARGET = "ceiling"
CEILING_SRC = BENCH_DIR / "ceiling.c"
# bench/relay.c: a byte relay with an upstream connection per client, run in the forwarding
# rows as the least any proxy can cost (the kernel's extra sends, reads and wake-ups).
RELAY_TARGET = "relay"
RELAY_SRC = BENCH_DIR / "relay.c"
# The same client limit for every proxy, above the largest default idle-client test (5000).
MAX_CLIENT_CONN = 6000
# Sources, build script and config templates of the peers (shared by the projects compared).
PEERS_SRC = REPO.parent / "shared" / "peers"
DEFAULT_PEERS_PREFIX = "/opt/peers"
PEER_BINARIES = {"pgbouncer": "pgbouncer/bin/pgbouncer", "odyssey": "odyssey/odyssey"}
PEER_TEMPLATES = {"pgbouncer": "pgbouncer.ini.template", "odyssey": "odyssey.conf.template"}
PEER_KINDS = ("pgbouncer", "odyssey")


class BenchError(Exception):
    """A failure that ends the run with a clear message."""


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def warn(msg: str) -> None:
    log("WARNING: " + msg)


# --------------------------------------------------------------------------
# Processes: every child in its own process group; all stopped on exit.
# --------------------------------------------------------------------------

try:
    _libc = ctypes.CDLL(None, use_errno=True)
except OSError:  # pragma: no cover
    _libc = None
PR_SET_PDEATHSIG = 1


def _child_setup(death_signal: int = signal.SIGKILL) -> None:
    """Runs in the child after fork (and after the uid change): die with us (or,
    for a watchdog, get told so), even when this harness is killed with SIGKILL."""
    if _libc is not None:
        _libc.prctl(PR_SET_PDEATHSIG, death_signal, 0, 0, 0)


def pid_alive(pid: Optional[int]) -> bool:
    """Whether pid runs. A zombie counts as gone (a daemon's is reaped by init),
    unless other threads still run: a main thread that exits first (Odyssey's,
    when it shuts down) leaves a zombie leader while the process lives on."""
    if not pid:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        if state not in ("Z", "X"):
            return True
        return len(os.listdir(f"/proc/{pid}/task")) > 1
    except (OSError, IndexError):
        return False


def pid_comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def pid_cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


# Kills the daemon whose pid is $1 when the harness dies (it gets SIGTERM as its
# parent-death signal); exits by itself once the daemon is gone.
WATCHDOG_SH = ('trap \'kill -KILL "$1" 2>/dev/null; exit 0\' TERM HUP INT\n'
               'while kill -0 "$1" 2>/dev/null; do sleep 1; done\n')


@dataclass
class RunAs:
    user: str
    uid: int
    gid: int
    home: str


def close_pipes(p: subprocess.Popen) -> None:
    """Closes a child's pipes (ours), whatever state they are in."""
    for stream in (p.stdin, p.stdout, p.stderr):
        if stream is not None:
            try:
                stream.close()
            except OSError:
                pass


class Procs:
    """Registry of the children we started (each the leader of its own group)."""

    def __init__(self) -> None:
        self.live: list[tuple[str, subprocess.Popen, int]] = []  # (name, proc, stop signal)
        self.pgids: set[int] = set()
        # Daemons (they leave our process groups): (name, pid, comm), stopped by pid.
        self.daemons: list[tuple[str, int, str]] = []
        # Strings in the command line of a daemon we started (its config path): the
        # final sweep also kills those, should one have daemonized before we got its pid.
        self.markers: set[str] = set()

    def spawn(self, name: str, argv: list[str], *, run_as: Optional[RunAs] = None,
              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
              stdin=subprocess.DEVNULL, cwd=None, env=None, text=False,
              stop_signal: int = signal.SIGTERM,
              death_signal: int = signal.SIGKILL) -> subprocess.Popen:
        kw = {}
        if run_as is not None:
            kw = dict(user=run_as.uid, group=run_as.gid, extra_groups=[])
        p = subprocess.Popen(argv, stdin=stdin, stdout=stdout, stderr=stderr, cwd=cwd,
                             env=env, text=text, start_new_session=True,
                             preexec_fn=lambda: _child_setup(death_signal), **kw)
        self.live.append((name, p, stop_signal))
        self.pgids.add(p.pid)
        return p

    def stop(self, p: subprocess.Popen, sig: Optional[int] = None, timeout: float = 10.0) -> None:
        entry = next((e for e in self.live if e[1] is p), None)
        if sig is None:
            sig = entry[2] if entry else signal.SIGTERM
        if p.poll() is None:
            try:
                os.kill(p.pid, sig)
            except ProcessLookupError:
                pass
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        # Whatever is left in the group (children of the child): kill it.
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            p.wait(5)
        except subprocess.TimeoutExpired:
            warn(f"process {p.pid} did not exit after SIGKILL")
        close_pipes(p)
        if entry:
            self.live.remove(entry)

    def release(self, p: subprocess.Popen) -> None:
        """Forget a child that has exited by itself (its group stays in the sweep)."""
        p.wait()
        close_pipes(p)
        self.live = [e for e in self.live if e[1] is not p]

    def adopt(self, name: str, pid: int) -> None:
        """Track a daemon (not our child, not in our groups) so that it is stopped."""
        self.daemons.append((name, pid, pid_comm(pid)))

    def stop_daemon(self, pid: int, timeout: float = 10.0) -> None:
        """SIGTERM, then SIGKILL; only while pid is still the process we adopted."""
        entry = next((e for e in self.daemons if e[1] == pid), None)
        comm = entry[2] if entry else None
        for sig, wait_s in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
            if not pid_alive(pid) or (comm and pid_comm(pid) != comm):
                break
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                break
            end = time.monotonic() + wait_s
            while pid_alive(pid) and time.monotonic() < end:
                time.sleep(0.05)
        if pid_alive(pid) and (not comm or pid_comm(pid) == comm):
            warn(f"daemon {pid} did not exit after SIGKILL")
        if entry:
            self.daemons.remove(entry)

    def stop_all(self) -> None:
        # Daemons first: their watchdogs (in `live`) would SIGKILL them when stopped.
        for name, pid, _ in reversed(list(self.daemons)):
            self.stop_daemon(pid, timeout=8.0)
        for name, p, _ in reversed(list(self.live)):
            self.stop(p, timeout=8.0)
        # Final sweep: anything still in one of our process groups, or a daemon of ours.
        for pid_dir in glob.glob("/proc/[0-9]*"):
            pid = int(pid_dir[6:])
            try:
                with open(pid_dir + "/stat") as f:
                    rest = f.read().rsplit(")", 1)[1].split()
                pgrp = int(rest[2])
            except (OSError, IndexError, ValueError):
                continue
            ours = pgrp in self.pgids
            if not ours and self.markers and pid != os.getpid():
                cmd = pid_cmdline(pid)
                ours = any(m in cmd for m in self.markers)
            if ours:
                comm = pid_comm(pid) or "?"
                try:
                    os.kill(pid, signal.SIGKILL)
                    warn(f"killed leftover process {pid} ({comm}) of group {pgrp}")
                except (ProcessLookupError, PermissionError):
                    pass


# --------------------------------------------------------------------------
# Small helpers
# --------------------------------------------------------------------------

_used_ports: set[int] = set()


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (asked from the kernel, never a fixed one)."""
    for _ in range(50):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _used_ports:
            _used_ports.add(port)
            return port
    raise BenchError("could not find a free port")


def port_open(host: str, port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def tail(path: Path, n: int = 25) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(lines[-n:])


def wait_port(name: str, host: str, port: int, proc: subprocess.Popen, logfile: Path,
              deadline_s: float = 30.0) -> None:
    """Wait until host:port accepts TCP connections; fail clearly if the process exits."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise BenchError(f"{name} exited with status {proc.returncode} before accepting "
                             f"connections on {host}:{port}; last lines of {logfile}:\n{tail(logfile)}")
        if port_open(host, port):
            return
        time.sleep(0.1)
    raise BenchError(f"{name} did not accept connections on {host}:{port} within "
                     f"{deadline_s:.0f} s; last lines of {logfile}:\n{tail(logfile)}")


def proc_cpu_ticks(pid: Optional[int]) -> Optional[int]:
    """utime+stime of the process (all threads, also exited ones), in clock ticks."""
    split = proc_cpu_split(pid)
    return sum(split) if split is not None else None


def proc_cpu_split(pid: Optional[int]) -> Optional[tuple[int, int]]:
    """(utime, stime) of the process (all threads, also exited ones), in clock ticks."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[11]), int(fields[12])  # fields 14 and 15 of stat(5)
    except (OSError, IndexError, ValueError):
        return None


def proc_status_kib(pid: Optional[int], key: str = "VmRSS") -> Optional[int]:
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def find_pg_bindir() -> Path:
    cands = sorted(glob.glob("/usr/lib/postgresql/*/bin"),
                   key=lambda p: [int(x) for x in re.findall(r"\d+", p)] or [0])
    for d in reversed(cands):
        if (Path(d) / "initdb").exists() and (Path(d) / "postgres").exists():
            return Path(d)
    initdb = shutil.which("initdb")
    if initdb:
        return Path(initdb).resolve().parent
    raise BenchError("PostgreSQL server binaries (initdb, postgres) not found in "
                     "/usr/lib/postgresql/*/bin or PATH: install Debian's postgresql "
                     "package (see the README's setup)")


def tool(bindir: Path, name: str) -> str:
    p = bindir / name
    if p.exists():
        return str(p)
    w = shutil.which(name)
    if w:
        return w
    raise BenchError(f"{name} not found (in {bindir} or PATH)")


def version_of(argv: list[str]) -> str:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=10)
        return (out.stdout or out.stderr).strip().splitlines()[0]
    except (OSError, subprocess.TimeoutExpired, IndexError):
        return "unknown"


def find_pgbouncer() -> Optional[str]:
    return shutil.which("pgbouncer") or next(
        (p for p in ("/usr/sbin/pgbouncer", "/usr/bin/pgbouncer") if os.path.exists(p)), None)


def ensure_pgbouncer() -> str:
    path = find_pgbouncer()
    if path:
        return path
    if os.geteuid() != 0:
        raise BenchError("pgbouncer not found: install it (sudo apt-get install -y pgbouncer) "
                         "or pass --no-pgbouncer")
    log("pgbouncer not found: apt-get update && apt-get install -y pgbouncer")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for argv in (["apt-get", "update"], ["apt-get", "install", "-y", "pgbouncer"]):
        r = subprocess.run(argv, env=env, stdout=sys.stderr, stderr=sys.stderr)
        if r.returncode != 0:
            raise BenchError(f"{' '.join(argv)} failed with status {r.returncode}")
    path = find_pgbouncer()
    if not path:
        raise BenchError("pgbouncer still not found after apt-get install")
    return path


def find_peers(prefix: Path) -> dict[str, Optional[str]]:
    """The peer binaries build.sh installs under prefix (None: not there)."""
    found = {}
    for kind, rel in PEER_BINARIES.items():
        path = prefix / rel
        found[kind] = str(path) if path.is_file() and os.access(path, os.X_OK) else None
    return found


def ensure_peers(prefix: Path, logdir: Path) -> dict[str, Optional[str]]:
    """The peers' binaries, built with PEERS_SRC/build.sh PREFIX when missing
    (once, ~2 min; it is idempotent). A missing or failing build.sh is not fatal:
    the run goes on without the peers that are not there, with a warning, since
    the comparison with direct PostgreSQL and Debian's PgBouncer still stands."""
    found = find_peers(prefix)
    missing = [k for k, v in found.items() if v is None]
    if not missing:
        return found
    build = PEERS_SRC / "build.sh"
    if not build.is_file():
        warn(f"{', '.join(missing)} not built under {prefix} and {build} not found: "
             f"going on without {', '.join(missing)} (pass --no-peers to silence this)")
        return found
    blog = logdir / "peers-build.log"
    log(f"{', '.join(missing)} not built under {prefix}: bash {build} {prefix} "
        f"(about 2 min; log in {blog})")
    t0 = time.monotonic()
    with open(blog, "w") as lf:
        r = subprocess.run(["bash", str(build), str(prefix)], stdin=subprocess.DEVNULL,
                           stdout=lf, stderr=subprocess.STDOUT)
    found = find_peers(prefix)
    missing = [k for k, v in found.items() if v is None]
    if r.returncode != 0 or missing:
        warn(f"{build} {prefix} failed (status {r.returncode}) after {time.monotonic() - t0:.0f} s"
             + (f": going on without {', '.join(missing)}" if missing else "")
             + f"; last lines of {blog}:\n{tail(blog, 15)}")
    else:
        log(f"peers built in {time.monotonic() - t0:.0f} s")
    return found


def render_template(path: Path, *, listen_port: int, pg_port: int, pool_size: int, dir: Path) -> str:
    """A peer's config from its template; every placeholder must be filled, so a
    template with a new placeholder fails here rather than in the peer."""
    text = path.read_text()
    for key, val in (("LISTEN_PORT", listen_port), ("PG_PORT", pg_port),
                     ("POOL_SIZE", pool_size), ("DIR", dir)):
        text = text.replace(f"@{key}@", str(val))
    left = sorted(set(re.findall(r"@[A-Z_]+@", text)))
    if left:
        raise BenchError(f"{path}: unknown placeholders {', '.join(left)}")
    return text


def set_client_limit(conf: str, key: str, sep: str) -> str:
    """The templates allow 1000 clients; the idle-client test opens more and pgmemo is
    given MAX_CLIENT_CONN: give every proxy the same limit."""
    new, n = re.subn(rf"(?m)^(\s*{key}\s*{sep}\s*)\d+", rf"\g<1>{MAX_CLIENT_CONN}", conf)
    return new if n else conf


def version_tuple(line: str) -> tuple:
    m = re.search(r"(\d+)\.(\d+)(?:\.(\d+))?", line)
    return tuple(int(x or 0) for x in m.groups()) if m else (0, 0, 0)


def ensure_run_as() -> Optional[RunAs]:
    """PostgreSQL refuses to run as root: as root, run servers as `postgres`."""
    if os.geteuid() != 0:
        return None
    try:
        pw = pwd.getpwnam("postgres")
    except KeyError:
        log("creating the unprivileged OS user 'postgres'")
        r = subprocess.run(["useradd", "--system", "--user-group", "--no-create-home",
                            "--home-dir", "/nonexistent", "--shell", "/usr/sbin/nologin",
                            "postgres"], stdout=sys.stderr, stderr=sys.stderr)
        if r.returncode != 0:
            raise BenchError("could not create the OS user 'postgres' (useradd failed)")
        pw = pwd.getpwnam("postgres")
    return RunAs(pw.pw_name, pw.pw_uid, pw.pw_gid, pw.pw_dir)


def raise_nofile(needed: int) -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= needed:
        return soft
    for lim in ((max(needed, hard), max(needed, hard)) if hard != resource.RLIM_INFINITY
                else (needed, hard), (hard, hard)):
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, lim)
            return lim[0]
        except (ValueError, OSError):
            continue
    return soft


def chown_tree(path: Path, run_as: Optional[RunAs]) -> None:
    if run_as is None:
        return
    os.chown(path, run_as.uid, run_as.gid)
    for root, dirs, files in os.walk(path):
        for n in dirs + files:
            os.chown(os.path.join(root, n), run_as.uid, run_as.gid, follow_symlinks=False)


def machine_info() -> dict:
    info = {"cores": os.cpu_count(), "kernel": platform.release(),
            "python": platform.python_version()}
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemTotal:"):
                info["memory_gib"] = round(int(line.split()[1]) / 1024 / 1024, 1)
    except OSError:
        pass
    info["loadavg_start"] = os.getloadavg()[0]
    return info


def script_ctx(args, prefix: str, outdir: Optional[Path] = None) -> "Ctx":
    """The context of a script built on this harness (bench/wal.py, hostile.py, soak.py):
    the release build unless --no-build, PostgreSQL's tools, the user to run it as, a temp
    dir (also the output dir unless `outdir`) with a logs/ dir."""
    if not args.no_build:
        subprocess.run(["cargo", "build", "--release", "--quiet"], cwd=REPO, check=True)
    ctx = Ctx(args)
    ctx.tmp = Path(tempfile.mkdtemp(prefix=prefix))
    ctx.outdir = outdir or ctx.tmp
    ctx.logdir = ctx.outdir / "logs"
    ctx.logdir.mkdir(parents=True, exist_ok=True)
    ctx.pg_bindir = find_pg_bindir()
    ctx.pg_version = version_of([tool(ctx.pg_bindir, "postgres"), "--version"])
    ctx.pgbench = tool(ctx.pg_bindir, "pgbench")
    ctx.run_as = ensure_run_as()
    chown_tree(ctx.tmp, ctx.run_as)
    return ctx


def script_done(ctx: "Ctx") -> None:
    """The end of a script_ctx script: its processes stopped, its logs closed, its cluster's
    files removed (the logs stay: the script printed their path)."""
    ctx.procs.stop_all()
    ctx.close_logs()
    shutil.rmtree(ctx.tmp / "pgdata", ignore_errors=True)


def git_rev() -> str:
    try:
        rev = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--", "src"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return (rev or "no-commit") + ("+dirty" if dirty else "")
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


# --------------------------------------------------------------------------
# Servers
# --------------------------------------------------------------------------

@dataclass
class Target:
    name: str
    host: str
    port: int
    user: str = DB_USER
    database: str = DB_NAME
    password: Optional[str] = None
    kind: str = "external"           # direct | pgmemo | pgbouncer | odyssey | ceiling | relay | external
    server: object = None            # the Server that runs it (None for direct/external)
    broken: Optional[str] = None     # why its runs were not done
    cache: bool = False              # pgmemo+cache: runs only the cache workloads

    def runs(self, wl: "Workload") -> bool:
        """Whether this target runs workload wl (pgmemo+cache: only the cache ones; the
        ceiling: only cache-hot; the relay: all but the cache ones; their other cells are not
        run by design, not failures)."""
        if self.kind == "ceiling":
            return wl.is_cache_hot
        if self.kind == "relay":
            return not wl.is_cache
        return wl.is_cache or not self.cache

    @property
    def metrics_url(self) -> Optional[str]:
        """pgmemo's Prometheus endpoint, when it has one (pgmemo+cache)."""
        return getattr(self.server, "metrics_url", None)

    @property
    def pid(self) -> Optional[int]:
        """The proxy's process while it runs (Odyssey: its daemon), for CPU and RSS."""
        return getattr(self.server, "pid", None)

    @property
    def is_proxy(self) -> bool:
        return self.kind not in ("direct", "ceiling")

    @property
    def is_peer(self) -> bool:
        """A pooler pgmemo is measured against (the `pgmemo/best peer` column)."""
        return self.kind in PEER_KINDS

    def env(self) -> dict:
        env = dict(os.environ, PGCONNECT_TIMEOUT="10")
        env.pop("PGPASSWORD", None)
        if self.password:
            env["PGPASSWORD"] = self.password
        return env


class Postgres:
    def __init__(self, ctx: "Ctx", port: int) -> None:
        self.ctx, self.port = ctx, port
        self.datadir = ctx.tmp / "pgdata"
        self.logfile = ctx.logdir / "postgres.log"
        self.proc: Optional[subprocess.Popen] = None
        # More postgresql.conf lines (bench/wal.py: wal_level = logical).
        self.extra_conf = ""

    def start(self) -> None:
        c = self.ctx
        log(f"initdb ({c.pg_version}) into {self.datadir}")
        env = dict(os.environ, LC_ALL="C", LANG="C", HOME=str(c.tmp))
        kw = dict(user=c.run_as.uid, group=c.run_as.gid, extra_groups=[]) if c.run_as else {}
        with open(c.logdir / "initdb.log", "w") as lf:
            r = subprocess.run([tool(c.pg_bindir, "initdb"), "-D", str(self.datadir),
                                "-U", DB_USER, "--auth=trust", "-E", "UTF8", "--no-locale",
                                "--no-sync"], cwd=c.tmp, env=env, stdout=lf, stderr=lf, **kw)
        if r.returncode != 0:
            raise BenchError(f"initdb failed:\n{tail(c.logdir / 'initdb.log')}")
        with open(self.datadir / "postgresql.conf", "a") as f:
            f.write(f"""
# pgmemo bench: throwaway cluster
listen_addresses = '127.0.0.1'
port = {self.port}
unix_socket_directories = '{c.tmp}'
max_connections = 200
fsync = off
synchronous_commit = off
full_page_writes = off
shared_buffers = 512MB
max_parallel_workers_per_gather = 0
logging_collector = off
log_min_messages = warning
{self.extra_conf}""")
        self.proc = c.procs.spawn("postgres", [tool(c.pg_bindir, "postgres"), "-D", str(self.datadir)],
                                  run_as=c.run_as, cwd=c.tmp, env=env,
                                  stdout=c.open_log(self.logfile), stderr=subprocess.STDOUT,
                                  stop_signal=signal.SIGQUIT)  # immediate: data is thrown away
        wait_port("postgres", "127.0.0.1", self.port, self.proc, self.logfile, 60)
        # TCP accept happens before recovery finishes: wait for a real login.
        end = time.monotonic() + 60
        while True:
            r = subprocess.run([tool(c.pg_bindir, "psql"), "-h", "127.0.0.1", "-p", str(self.port),
                                "-U", DB_USER, "-d", "postgres", "-Atqc", "select 1"],
                               capture_output=True, text=True, env=dict(os.environ, PGCONNECT_TIMEOUT="5"))
            if r.returncode == 0:
                break
            if self.proc.poll() is not None or time.monotonic() > end:
                raise BenchError(f"postgres not ready: {r.stderr.strip()}\n{tail(self.logfile)}")
            time.sleep(0.2)
        self.psql("postgres", f"create database {DB_NAME}")
        log(f"postgres up on 127.0.0.1:{self.port}; pgbench -i -s {c.args.scale}")
        t0 = time.monotonic()
        with open(c.logdir / "pgbench-init.log", "w") as lf:
            r = subprocess.run([c.pgbench, "-i", "-q", "-s", str(c.args.scale), "-h", "127.0.0.1",
                                "-p", str(self.port), "-U", DB_USER, DB_NAME],
                               stdout=lf, stderr=lf)
        if r.returncode != 0:
            raise BenchError(f"pgbench -i failed:\n{tail(c.logdir / 'pgbench-init.log')}")
        log(f"pgbench -i done in {time.monotonic() - t0:.1f} s")

    def psql(self, db: str, sql: str) -> str:
        r = subprocess.run([tool(self.ctx.pg_bindir, "psql"), "-h", "127.0.0.1", "-p", str(self.port),
                            "-U", DB_USER, "-d", db, "-v", "ON_ERROR_STOP=1", "-Atqc", sql],
                           capture_output=True, text=True, timeout=120)
        if r.returncode != 0:
            raise BenchError(f"psql {sql!r} failed: {r.stderr.strip()}")
        return r.stdout.strip()


class ChildServer:
    """A server this harness runs as its own child process (`proc`): its pid while it runs,
    and how it is stopped."""
    ctx: "Ctx"
    proc: Optional[subprocess.Popen] = None

    @property
    def pid(self) -> Optional[int]:
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else None

    def stop(self) -> None:
        if self.proc is not None:
            self.ctx.procs.stop(self.proc)
            self.proc = None


class PgBouncer(ChildServer):
    """PgBouncer in the foreground as our child: the peer built from source (its
    config from the shared template) or Debian's package (the config below)."""
    kind = "pgbouncer"
    dir_logs: tuple = ()  # its logfile repeats what it writes on stderr, into logfile below

    def __init__(self, ctx: "Ctx", binary: str, template: Optional[Path] = None) -> None:
        self.ctx, self.binary, self.template = ctx, binary, template
        self.version_line = version_of([binary, "--version"])
        self.version = version_tuple(self.version_line)
        self.name = f"pgbouncer-{self.version[0]}.{self.version[1]}"
        self.proc: Optional[subprocess.Popen] = None
        self.port = 0

    @property
    def logfile(self) -> Path:
        return self.ctx.logdir / f"{self.name}.log"

    @property
    def dir(self) -> Path:
        return self.ctx.tmp / self.name

    def config(self) -> str:
        c = self.ctx
        if self.template is not None:
            conf = render_template(self.template, listen_port=self.port, pg_port=c.pg.port,
                                   pool_size=c.args.pool_size, dir=self.dir)
            return set_client_limit(conf, "max_client_conn", "=")
        extra = ""
        if self.version >= (1, 21):
            extra = "max_prepared_statements = 200\n"
        return f"""[databases]
* = host=127.0.0.1 port={c.pg.port}

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {self.port}
unix_socket_dir =
auth_type = trust
auth_file = {self.dir}/userlist.txt
pool_mode = transaction
default_pool_size = {c.args.pool_size}
min_pool_size = 0
reserve_pool_size = 0
max_client_conn = {MAX_CLIENT_CONN}
ignore_startup_parameters = extra_float_digits
logfile =
pidfile =
log_connections = 0
log_disconnections = 0
admin_users = {DB_USER}
{extra}"""

    def start(self) -> int:
        c = self.ctx
        self.port = free_port()
        self.dir.mkdir(exist_ok=True)
        # trust auth still needs the client user in auth_file
        (self.dir / "userlist.txt").write_text(f'"{DB_USER}" ""\n')
        (self.dir / "pgbouncer.pid").unlink(missing_ok=True)  # a stale one stops it starting
        (self.dir / "pgbouncer.ini").write_text(self.config())
        chown_tree(self.dir, c.run_as)
        lf = c.open_log(self.logfile)
        self.proc = c.procs.spawn(self.name, [self.binary, str(self.dir / "pgbouncer.ini")],
                                  run_as=c.run_as, cwd=self.dir, stdout=lf, stderr=subprocess.STDOUT,
                                  env=dict(os.environ, HOME=str(self.dir)), stop_signal=signal.SIGTERM)
        wait_port(self.name, "127.0.0.1", self.port, self.proc, self.logfile)
        return self.port


class Odyssey:
    """Odyssey from the shared template. It daemonizes (the launcher exits at
    once) and writes its pid file: that pid is what we measure and stop, and a
    watchdog child kills it should this harness die without its finally block."""
    kind = "odyssey"
    dir_logs = ("odyssey.log",)

    def __init__(self, ctx: "Ctx", binary: str, template: Path) -> None:
        self.ctx, self.binary, self.template = ctx, binary, template
        self.version_line = version_of([binary, "--version"])
        self.version = version_tuple(self.version_line)
        self.name = f"odyssey-{self.version[0]}.{self.version[1]}"
        self.daemon_pid: Optional[int] = None
        self.watchdog: Optional[subprocess.Popen] = None
        self.port = 0

    @property
    def logfile(self) -> Path:
        return self.ctx.logdir / f"{self.name}.log"  # the launcher's output; the daemon logs in dir

    @property
    def dir(self) -> Path:
        return self.ctx.tmp / self.name

    @property
    def pidfile(self) -> Path:
        return self.dir / "odyssey.pid"

    @property
    def pid(self) -> Optional[int]:
        return self.daemon_pid if pid_alive(self.daemon_pid) else None

    def _read_pid(self) -> Optional[int]:
        try:
            pid = int(self.pidfile.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None
        return pid if pid_alive(pid) else None

    def _fail(self, why: str) -> BenchError:
        return BenchError(f"{self.name} {why}; last lines of {self.logfile}:\n{tail(self.logfile, 10)}\n"
                          f"last lines of {self.dir / 'odyssey.log'}:\n{tail(self.dir / 'odyssey.log')}")

    def start(self) -> int:
        c = self.ctx
        self.port = free_port()
        self.dir.mkdir(exist_ok=True)
        self.pidfile.unlink(missing_ok=True)
        conf_path = self.dir / "odyssey.conf"
        conf = render_template(self.template, listen_port=self.port, pg_port=c.pg.port,
                               pool_size=c.args.pool_size, dir=self.dir)
        conf_path.write_text(set_client_limit(conf, "client_max", ""))
        chown_tree(self.dir, c.run_as)
        c.procs.markers.add(str(conf_path))
        lf = c.open_log(self.logfile)
        launcher = c.procs.spawn(self.name, [self.binary, str(conf_path)], run_as=c.run_as,
                                 cwd=self.dir, stdout=lf, stderr=subprocess.STDOUT,
                                 env=dict(os.environ, HOME=str(self.dir)))
        try:
            rc = launcher.wait(30)
        except subprocess.TimeoutExpired:
            rc = None
        if rc is None:
            c.procs.stop(launcher, timeout=1)
        else:
            # not stop(): its killpg could hit the daemon before the daemon's setsid()
            c.procs.release(launcher)
        if rc != 0:
            raise self._fail("did not daemonize (launcher " +
                             ("still running after 30 s" if rc is None else f"exited with status {rc}") + ")")
        end = time.monotonic() + 30
        while self.daemon_pid is None:
            pid = self._read_pid()
            if pid is not None:
                self.daemon_pid = pid
                c.procs.adopt(self.name, pid)
                self.watchdog = c.procs.spawn(f"{self.name}-watchdog", ["sh", "-c", WATCHDOG_SH, "watchdog",
                                                                         str(pid)],
                                              death_signal=signal.SIGTERM)
            elif time.monotonic() > end:
                raise self._fail(f"wrote no pid file {self.pidfile} within 30 s")
            else:
                time.sleep(0.05)
        while not port_open("127.0.0.1", self.port):
            if self.pid is None:
                raise self._fail(f"(pid {self.daemon_pid}) exited before accepting connections")
            if time.monotonic() > end:
                raise self._fail(f"did not accept connections on 127.0.0.1:{self.port} within 30 s")
            time.sleep(0.1)
        return self.port

    def stop(self) -> None:
        if self.daemon_pid is not None:
            self.ctx.procs.stop_daemon(self.daemon_pid)
            self.daemon_pid = None
        if self.watchdog is not None:
            # SIGKILL: its TERM trap would SIGKILL the (already stopped) daemon's pid
            self.ctx.procs.stop(self.watchdog, sig=signal.SIGKILL, timeout=2)
            self.watchdog = None


class Pgmemo(ChildServer):
    """target/release/pgmemo; with cache=True the pgmemo+cache target: the same
    arguments plus --cache, --workers (--cache-workers) and a Prometheus endpoint
    (--metrics-listen) on a free port, from which the harness reads the cache's hits
    and misses."""
    kind = "pgmemo"

    def __init__(self, ctx: "Ctx", binary: Path, cache: bool = False,
                 variant: Optional[tuple[str, str]] = None) -> None:
        self.ctx, self.binary, self.cache = ctx, binary, cache
        self.version_line = version_of([str(binary), "--version"])
        # A variant: (name, a [general] TOML line), e.g. ("nopin", "pin_session_state = false").
        self.variant = variant
        self.name = CACHE_TARGET if cache else f"pgmemo-{variant[0]}" if variant else "pgmemo"
        self.logfile = ctx.logdir / f"{self.name}.log"
        self.proc: Optional[subprocess.Popen] = None
        self.port = 0
        self.metrics_port = 0
        self.argv: list[str] = []

    @property
    def metrics_url(self) -> Optional[str]:
        return f"http://127.0.0.1:{self.metrics_port}/metrics" if self.cache and self.metrics_port else None

    def start(self) -> int:
        c = self.ctx
        self.port = free_port()
        self.argv = [str(self.binary), "--upstream", f"postgresql://{DB_USER}@127.0.0.1:{c.pg.port}",
                     "--listen", f"127.0.0.1:{self.port}", "--pool-mode", "transaction",
                     "--pool-size", str(c.args.pool_size), "--auth", "trust",
                     # The same client limit as the other proxies.
                     "--max-client-conn", str(MAX_CLIENT_CONN)] + list(c.args.pgmemo_arg)
        if self.cache:
            self.metrics_port = free_port()
            self.argv += ["--cache", "--metrics-listen", f"127.0.0.1:{self.metrics_port}"]
            if not any(a.startswith("--workers") for a in c.args.pgmemo_arg):
                self.argv += ["--workers", str(c.args.cache_workers)]
        if self.variant:
            config = c.logdir / f"{self.name}.toml"
            config.write_text(f"[general]\n{self.variant[1]}\n")
            self.argv += ["--config", str(config)]
        lf = c.open_log(self.logfile)
        lf.write(f"\n# {shlex.join(self.argv)}\n".encode())
        lf.flush()
        self.proc = c.procs.spawn(self.name, self.argv, cwd=REPO, stdout=lf, stderr=subprocess.STDOUT,
                                  stop_signal=signal.SIGTERM)
        wait_port(self.name, "127.0.0.1", self.port, self.proc, self.logfile)
        if self.cache:
            wait_port(f"{self.name} metrics", "127.0.0.1", self.metrics_port, self.proc, self.logfile)
        return self.port


class CompiledServer(ChildServer):
    """A server of bench/ written in C (`source`), compiled with the system's C compiler into
    the temp dir and run as our child on a free port."""
    kind = ""
    name = ""
    source: Path

    def __init__(self, ctx: "Ctx", compiler: str) -> None:
        self.ctx, self.compiler = ctx, compiler
        self.logfile = ctx.logdir / f"{self.name}.log"
        self.proc: Optional[subprocess.Popen] = None
        self.port = 0

    def arguments(self) -> list[str]:
        """Its command line after the binary (`self.port` chosen)."""
        return [str(self.port)]

    def start(self) -> int:
        c = self.ctx
        binary = c.tmp / self.name
        r = subprocess.run([self.compiler, "-O2", "-o", str(binary), str(self.source)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            raise BenchError(f"{self.compiler} {self.source.name} failed: {one_line(r.stderr)[:300]}")
        self.port = free_port()
        lf = c.open_log(self.logfile)
        self.proc = c.procs.spawn(self.name, [str(binary)] + self.arguments(), stdout=lf,
                                  stderr=subprocess.STDOUT)
        wait_port(self.name, "127.0.0.1", self.port, self.proc, self.logfile)
        return self.port


class Ceiling(CompiledServer):
    """bench/ceiling.c: a PostgreSQL-protocol server that answers every query at once with a
    canned row (see the file). Its TPS in the cache-hot workloads is what this machine and
    pgbench reach with no work at all behind the socket."""
    kind = "ceiling"
    name = CEILING_TARGET
    source = CEILING_SRC


class Relay(CompiledServer):
    """bench/relay.c: bytes copied between each client and a PostgreSQL connection of its own
    (see the file). Its cells in the forwarding rows are what any proxy costs on this machine
    before it does anything: a floor for pgmemo's and the peers'."""
    kind = "relay"
    name = RELAY_TARGET
    source = RELAY_SRC

    def arguments(self) -> list[str]:
        return [str(self.port), str(self.ctx.pg.port)]


# --------------------------------------------------------------------------
# pgbench
# --------------------------------------------------------------------------

RE_TPS = re.compile(r"^tps = ([0-9.]+) \((?:without initial connection time|excluding connections establishing)\)", re.M)
RE_TPS_ANY = re.compile(r"^tps = ([0-9.]+)", re.M)
RE_LAT = re.compile(r"^latency average = ([0-9.]+) ms", re.M)
RE_TX = re.compile(r"^number of transactions actually processed: (\d+)", re.M)
RE_FAILED = re.compile(r"^number of failed transactions: (\d+)", re.M)
RE_ABORTED = re.compile(r"client \d+ .*aborted", re.M)
# pgmemo's result-cache counters, one line per cache rule: `name{rule="(hint)"} N`.
RE_CACHE_METRIC = re.compile(r"^(pgmemo_cache_hits_total|pgmemo_cache_misses_total)(?:\{[^}]*\})?\s+(\S+)\s*$",
                             re.M)
# Straight to the loopback endpoint, whatever http_proxy says.
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def cache_counters(url: Optional[str]) -> Optional[tuple[int, int]]:
    """(hits, misses) of pgmemo's result cache from its Prometheus endpoint, each
    metric summed over its lines (one per rule); None when it cannot be read."""
    if not url:
        return None
    try:
        with _NO_PROXY.open(url, timeout=5) as resp:
            text = resp.read().decode(errors="replace")
    except (OSError, ValueError, http.client.HTTPException):
        return None
    found = RE_CACHE_METRIC.findall(text)
    if not found:
        return None  # no result cache in this pgmemo (or other names): no ratio rather than 0/0
    sums = {"pgmemo_cache_hits_total": 0.0, "pgmemo_cache_misses_total": 0.0}
    for name, value in found:
        try:
            sums[name] += float(value)
        except ValueError:
            return None
    return int(sums["pgmemo_cache_hits_total"]), int(sums["pgmemo_cache_misses_total"])


@dataclass(frozen=True)
class Workload:
    """A row of the report: pgbench's select-only script (-S) or bench/orm.sql,
    with one -M protocol, or a result-cache script (bench/cache_*.sql, -M simple)."""
    name: str                        # simple | extended | prepared | orm-<protocol> | cache-<kind> | tpcb-<protocol>
    protocol: str                    # pgbench -M
    script: Optional[Path] = None    # None: a built-in script (select-only, or TPC-B-like for tpcb-*)

    @classmethod
    def parse(cls, name: str) -> "Workload":
        if name in PROTOCOLS:
            return cls(name, name)
        if name.startswith("orm-") and name[4:] in PROTOCOLS:
            return cls(name, name[4:], ORM_SCRIPT)
        if name in TPCB_WORKLOADS:
            return cls(name, name[5:])
        if name in CACHE_SCRIPTS:
            protocol = "extended" if name.endswith("-extended") else "simple"
            return cls(name, protocol, CACHE_SCRIPTS[name])
        raise ValueError(f"unknown workload {name!r} (use {', '.join(WORKLOADS)})")

    @property
    def is_cache(self) -> bool:
        """A result-cache workload: the only ones pgmemo+cache runs."""
        return self.name in CACHE_SCRIPTS

    @property
    def is_cache_hot(self) -> bool:
        """cache-hot with either protocol: the cache workloads the ceiling runs (the others
        check what they read)."""
        return self.name.startswith("cache-hot")

    def pgbench_args(self, scale: int) -> list[str]:
        if self.script is None:
            # tpcb-*: pgbench's default script (UPDATEs of three tables and an INSERT in a
            # BEGIN ... END block).
            return [] if self.name in TPCB_WORKLOADS else ["-S"]
        # -s: a custom script's :scale is 1 unless given (pgbench only counts
        # pgbench_branches for its built-in scripts)
        return ["-f", str(self.script), "-s", str(scale)]


SELECT_SIMPLE = Workload("simple", "simple")


@dataclass
class Run:
    cell: int
    round: int
    order: int
    workload: str
    protocol: str
    clients: int
    target: str
    duration_s: int
    started: str = ""
    wall_s: float = 0.0
    exit_status: Optional[int] = None
    tps: Optional[float] = None
    latency_ms: Optional[float] = None
    transactions: Optional[int] = None
    failed_tx: Optional[int] = None
    aborted_clients: int = 0
    proxy_cpu_s: Optional[float] = None
    proxy_cpu_us_per_tx: Optional[float] = None
    proxy_user_us_per_tx: Optional[float] = None  # the user-space part (utime) of the above
    proxy_rss_kib: Optional[int] = None
    cache_hits: Optional[int] = None        # pgmemo+cache: result-cache hits during the run
    cache_misses: Optional[int] = None      # ... and misses (queries sent to fill the cache)
    cache_hit_ratio: Optional[float] = None  # hits / (hits + misses)
    latency_p50_us: Optional[float] = None   # one client only: from pgbench's per-transaction log
    latency_p99_us: Optional[float] = None
    ok: bool = False
    error: str = ""


def parse_pgbench(run: Run, out: str, err: str) -> None:
    m = RE_TPS.search(out) or RE_TPS_ANY.search(out)
    run.tps = float(m.group(1)) if m else None
    m = RE_LAT.search(out)
    run.latency_ms = float(m.group(1)) if m else None
    m = RE_TX.search(out)
    run.transactions = int(m.group(1)) if m else None
    m = RE_FAILED.search(out)
    run.failed_tx = int(m.group(1)) if m else (0 if run.transactions is not None else None)
    run.aborted_clients = len(RE_ABORTED.findall(err))


def percentile(sorted_vals: list, q: float) -> float:
    """The q-quantile (0..1) of sorted values, nearest rank."""
    i = min(len(sorted_vals) - 1, max(0, int(round(q * len(sorted_vals) + 0.5)) - 1))
    return sorted_vals[i]


def read_latency_log(prefix: Path) -> list[int]:
    """Per-transaction latencies (µs) from pgbench's --log files `<prefix>.<pid>[.<thread>]`
    (the third field of each line), which are removed after reading."""
    lat = []
    for f in sorted(prefix.parent.glob(prefix.name + ".*")):
        try:
            for line in f.read_text().splitlines():
                parts = line.split()
                if len(parts) >= 3 and parts[2].isdigit():
                    lat.append(int(parts[2]))
        finally:
            f.unlink(missing_ok=True)
    return lat


def one_line(text: str) -> str:
    return " ".join(text.split())


def first_error(err: str) -> str:
    lines = [l.strip() for l in err.splitlines() if l.strip()]
    pick = next((l for l in lines if "error" in l.lower() or "fatal" in l.lower()), None)
    pick = pick or (lines[0] if lines else "")
    pick = re.sub(r"^pgbench: (error: )?", "", pick)
    return one_line(pick)[:240]


def run_pgbench(ctx: "Ctx", t: Target, wl: Workload, clients: int, duration: int,
                run: Run) -> Run:
    argv = [ctx.pgbench] + wl.pgbench_args(ctx.args.scale) + [
            "-n", "-j", str(min(2, clients)), "-c", str(clients),
            "-T", str(duration), "-M", wl.protocol, "-h", t.host, "-p", str(t.port),
            "-U", t.user, t.database]
    # One client: every transaction's latency is logged, for the p50/p99 the proxy adds.
    lat_prefix = ctx.tmp / f"latency-{run.cell}-{run.round}-{t.name}" if clients == 1 else None
    if lat_prefix is not None:
        argv[1:1] = ["--log", f"--log-prefix={lat_prefix}"]
    pid = t.pid
    if t.server is not None and pid is None:
        run.error = f"{t.name} is not running"
        return run
    run.started = dt.datetime.now().isoformat(timespec="seconds")
    counters0 = cache_counters(t.metrics_url)  # before the CPU reading: the scrape is not the run's
    cpu0 = proc_cpu_split(pid)
    t0 = time.monotonic()
    p = ctx.procs.spawn("pgbench", argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                        env=t.env(), text=True, stop_signal=signal.SIGINT)
    timed_out = False
    try:
        out, err = p.communicate(timeout=duration + ctx.grace_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        out, err = p.communicate()
    finally:
        ctx.procs.stop(p, timeout=1)
    run.wall_s = round(time.monotonic() - t0, 3)
    cpu1 = proc_cpu_split(pid)
    counters1 = cache_counters(t.metrics_url)
    run.proxy_rss_kib = proc_status_kib(pid)
    if counters0 is not None and counters1 is not None:
        run.cache_hits = counters1[0] - counters0[0]
        run.cache_misses = counters1[1] - counters0[1]
        if run.cache_hits + run.cache_misses > 0:
            run.cache_hit_ratio = round(run.cache_hits / (run.cache_hits + run.cache_misses), 4)
    elif t.metrics_url:
        warn(f"{t.name}: could not read the cache counters from {t.metrics_url}: no hit ratio for this run")
    run.exit_status = p.returncode
    parse_pgbench(run, out, err)
    if lat_prefix is not None:
        lat = sorted(read_latency_log(lat_prefix))
        if lat:
            run.latency_p50_us = float(percentile(lat, 0.50))
            run.latency_p99_us = float(percentile(lat, 0.99))
            if run.round >= 0:  # not a warm-up
                ctx.latencies.setdefault((wl.name, t.name), []).extend(lat)
    if cpu0 is not None and cpu1 is not None:
        user_s = (cpu1[0] - cpu0[0]) / CLK_TCK
        run.proxy_cpu_s = round(user_s + (cpu1[1] - cpu0[1]) / CLK_TCK, 3)
        if run.transactions:
            run.proxy_cpu_us_per_tx = round(run.proxy_cpu_s * 1e6 / run.transactions, 2)
            run.proxy_user_us_per_tx = round(user_s * 1e6 / run.transactions, 2)
    problems = []
    if timed_out:
        problems.append(f"timed out after {duration + ctx.grace_s} s (killed)")
    if run.exit_status not in (0, None) and not timed_out:
        problems.append(f"pgbench exit {run.exit_status}")
    if run.aborted_clients:
        problems.append(f"{run.aborted_clients} client(s) aborted")
        if wl.name in ("cache-rw", "cache-tx") and "division by zero" in err:
            problems.append(f"STALE READ ({wl.name} read back a value other than the one it wrote)")
    if run.failed_tx:
        problems.append(f"{run.failed_tx} failed transactions")
    if run.tps is None or not run.transactions:
        problems.append("no transactions")
    if pid is not None and t.pid is None:
        problems.append(f"{t.name} exited during the run")
    run.ok = not problems
    if problems:
        detail = first_error(err)
        run.error = "; ".join(problems) + (f": {detail}" if detail else "")
    ctx.save_pgbench_output(run, argv, out, err)
    return run


# --------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------

class Ctx:
    def __init__(self, args) -> None:
        self.args = args
        self.procs = Procs()
        self.tmp: Path = Path()
        self.outdir: Path = Path()
        self.logdir: Path = Path()
        self.run_as: Optional[RunAs] = None
        self.pg_bindir: Path = Path()
        self.pg_version = ""
        self.pgbench = ""
        self.pg: Optional[Postgres] = None
        self.pgmemo: Optional[Pgmemo] = None
        self.pgmemo_cache: Optional[Pgmemo] = None  # pgmemo+cache, with cache workloads only
        self.ceiling: Optional[Ceiling] = None  # with the cache-hot workloads, unless --no-ceiling
        self.relay: Optional[Relay] = None  # with the forwarding workloads, unless --no-relay
        self.pgmemo_variants: list[Pgmemo] = []  # --pgmemo-variant, in every cell
        # The other poolers we start: the peers (PgBouncer 1.25, Odyssey), then Debian's PgBouncer.
        self.poolers: list = []
        self.workloads: list[Workload] = []
        # One client: every measured run's per-transaction latencies (µs), pooled over the
        # rounds per (workload, target) for the latency table's p50 / p99.
        self.latencies: dict[tuple[str, str], list[int]] = {}
        self.grace_s = 30
        self._logs: list = []
        self._pgbench_out = None

    def open_log(self, path: Path):
        f = open(path, "ab")
        self._logs.append(f)
        return f

    def save_pgbench_output(self, run: Run, argv, out, err) -> None:
        if self._pgbench_out is None:
            self._pgbench_out = open(self.logdir / "pgbench-runs.log", "a")
        f = self._pgbench_out
        f.write(f"\n===== cell {run.cell} round {run.round} {run.target} {run.workload} "
                f"c={run.clients} started {run.started} exit {run.exit_status}\n$ {shlex.join(argv)}\n")
        f.write(out)
        if err.strip():
            f.write("--- stderr\n")
            errl = err.splitlines()
            f.write("\n".join(errl[:40] + (["... (%d more lines)" % (len(errl) - 40)] if len(errl) > 40 else [])) + "\n")
        f.flush()

    def save_pooler_logs(self) -> None:
        """Copy the logs a pooler writes into its own dir (in the temp dir, removed
        at the end; Odyssey's daemon logs nowhere else) next to the other logs."""
        for srv in self.poolers:
            for name in srv.dir_logs:
                try:
                    shutil.copyfile(srv.dir / name, self.logdir / f"{srv.name}-{name}")
                except OSError:
                    pass

    def close_logs(self) -> None:
        for f in self._logs + ([self._pgbench_out] if self._pgbench_out else []):
            try:
                f.close()
            except OSError:
                pass


def parse_target(spec: str) -> Target:
    """NAME=host:port, host:port, or NAME=postgresql://user[:pw]@host:port/db."""
    name, _, addr = spec.rpartition("=") if "=" in spec.split("://")[0] else ("", "", spec)
    if addr.startswith(("postgres://", "postgresql://")):
        from urllib.parse import urlparse, unquote
        u = urlparse(addr)
        if not u.hostname or not u.port:
            raise BenchError(f"--target {spec}: need host and port")
        t = Target(name or f"{u.hostname}:{u.port}", u.hostname, u.port,
                   user=unquote(u.username) if u.username else DB_USER,
                   database=u.path.lstrip("/") or DB_NAME,
                   password=unquote(u.password) if u.password else None)
    else:
        host, _, port = addr.rpartition(":")
        if not host or not port.isdigit():
            raise BenchError(f"--target {spec}: expected NAME=host:port")
        t = Target(name or addr, host, int(port))
    if t.name in ("direct", "pgmemo", CACHE_TARGET, CEILING_TARGET, RELAY_TARGET) or t.name.startswith(("pgbouncer-", "odyssey-", "pgmemo-")):
        raise BenchError(f"--target name {t.name!r} is reserved")
    return t


def csv_list(s: str, conv=str) -> list:
    return [conv(x.strip()) for x in s.split(",") if x.strip()]


def build_args(argv=None):
    p = argparse.ArgumentParser(
        prog="python3 bench/run.py",
        description="pgbench through pgmemo vs PostgreSQL directly vs the peer poolers (PgBouncer 1.25, "
                    "Odyssey 1.5, Debian's PgBouncer), side by side: select-only (-S) with each protocol, "
                    "an ORM-like mix (bench/orm.sql) and, on request, the result-cache workloads "
                    "(bench/cache_*.sql, also through pgmemo --cache as target pgmemo+cache).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="one round, 3 s runs, 8 clients, idle-client test with 1000 (about 2 min with "
                        "all targets); options given explicitly still win")
    p.add_argument("--protocols", type=lambda s: csv_list(s), default=None,
                   help="comma list of pgbench -M protocols for the select-only workload (pgbench -S); "
                        "the default --workloads are these plus orm-simple [simple,extended,prepared]")
    p.add_argument("--workloads", type=lambda s: csv_list(s), default=None,
                   help="comma list of workloads (rows): simple, extended, prepared = pgbench -S -M that; "
                        "orm-simple, orm-extended, orm-prepared = bench/orm.sql (point select, join with "
                        "an IN list, UPDATE, INSERT; autocommit) -M that; cache-hot, cache-uniform, cache-rw "
                        "= bench/cache_hot.sql (zipfian point select with a cache hint), cache_uniform.sql "
                        "(uniform), cache_rw.sql (90%% hot select, 10%% UPDATE + read-your-writes check) "
                        "-M simple, which also start target pgmemo+cache; tpcb-simple, tpcb-extended, "
                        "tpcb-prepared = pgbench's built-in TPC-B-like script -M that (e.g. --workloads "
                        "tpcb-prepared --clients 16,64 --pool-size 8: more clients than servers) "
                        "[the --protocols, then orm-simple]")
    p.add_argument("--cache-workloads", action="store_true",
                   help="add the result-cache workloads cache-hot, cache-uniform, cache-rw to the workloads "
                        "(default or --workloads/--protocols)")
    p.add_argument("--clients", type=lambda s: csv_list(s, int), default=None,
                   help="comma list of client counts [1,8,32; quick: 8]")
    p.add_argument("--duration", "-T", type=int, default=None,
                   help="seconds per pgbench run [8; quick: 3]")
    p.add_argument("--rounds", type=int, default=None, help="rounds per cell [3; quick: 1]")
    p.add_argument("--scale", type=int, default=10, help="pgbench -i scale")
    p.add_argument("--pool-size", type=int, default=10,
                   help="server connections per pool (pgmemo and every pooler it is compared with)")
    p.add_argument("--target", action="append", default=[], metavar="NAME=host:port",
                   help="an already-running pooler to add (repeatable); also NAME=postgresql://user[:pw]@host:port/db. "
                        "It must serve database 'bench' as user 'bench' with pgbench tables (see --pg-port)")
    p.add_argument("--pg-port", type=int, default=0,
                   help="port for the throwaway PostgreSQL (0: a free one), e.g. to point a --target pooler at it")
    p.add_argument("--no-pgmemo", action="store_true", help="leave pgmemo out")
    p.add_argument("--peers-prefix", default=DEFAULT_PEERS_PREFIX, metavar="DIR",
                   help=f"where the peers PgBouncer 1.25 (DIR/{PEER_BINARIES['pgbouncer']}) and Odyssey 1.5 "
                        f"(DIR/{PEER_BINARIES['odyssey']}) are; built there with {PEERS_SRC}/build.sh DIR "
                        "(~2 min, once) when missing, going on without them if that fails")
    p.add_argument("--no-relay", action="store_true",
                   help="leave out the relay floor (bench/relay.c, compiled with cc): bytes copied "
                        "between each client and a PostgreSQL connection of its own, nothing else")
    p.add_argument("--no-peers", action="store_true", help="leave the peers PgBouncer 1.25 and Odyssey out")
    p.add_argument("--no-pgbouncer", action="store_true",
                   help="leave Debian's PgBouncer (package pgbouncer, e.g. pgbouncer-1.18) out")
    p.add_argument("--no-ceiling", action="store_true",
                   help="leave out the ceiling (bench/ceiling.c, compiled with cc), which the cache-hot "
                        "workloads otherwise also run")
    p.add_argument("--no-build", action="store_true", help="do not run cargo build --release")
    p.add_argument("--pgmemo-bin", default=str(REPO / "target" / "release" / "pgmemo"))
    p.add_argument("--pgmemo-variant", action="append", default=[], metavar="NAME=SETTING",
                   help="also run pgmemo-NAME: the same binary with one more [general] setting, e.g. "
                        "nopin='pin_session_state = false' (repeatable), in every cell")
    p.add_argument("--pgmemo-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for pgmemo (repeatable; use --pgmemo-arg=--flag for dashes)")
    p.add_argument("--idle-clients", type=lambda s: csv_list(s, int), default=None,
                   help="idle-client counts for the memory test, comma list; 0 or empty to skip [1000,5000; quick: 1000]")
    p.add_argument("--max-idle-kib", type=float, default=None, metavar="KIB",
                   help="fail (exit 1) when pgmemo's memory per idle client exceeds KIB at any "
                        "--idle-clients count, or could not be measured (the test suite's memory check)")
    p.add_argument("--out", default=None, help="results directory [bench/results/<timestamp>]")
    p.add_argument("--warmup", type=int, default=None, help="seconds of warm-up per target before the runs [2; quick: 1]")
    p.add_argument("--cache-workers", type=int, default=2, metavar="N",
                   help="pgmemo+cache runs with --workers N: a hit is answered inside pgmemo, so its "
                        "threads bound the hits it serves (1: one event loop, as the pgmemo target; "
                        "a --pgmemo-arg=--workers=N given for both targets wins) [2]")
    p.add_argument("--cache-warmup", type=int, default=None,
                   help="seconds each target runs a cache workload, not measured, before its first cell "
                        "(0: none) [5; quick: 1]")
    args = p.parse_args(argv)
    q = args.quick
    if args.protocols is not None and args.workloads is not None:
        p.error("give --workloads or --protocols, not both (--workloads simple,orm-simple "
                "is --protocols simple with the default ORM workload)")
    if args.protocols is None:
        args.protocols = list(PROTOCOLS)
    for proto in args.protocols:
        if proto not in PROTOCOLS:
            p.error(f"unknown protocol {proto!r} (use {', '.join(PROTOCOLS)})")
    if args.workloads is None:
        args.workloads = list(args.protocols) + ["orm-simple"]
    if args.cache_workloads:
        args.workloads = list(args.workloads) + list(CACHE_WORKLOADS)
    args.workloads = list(dict.fromkeys(args.workloads))  # once each, in the order given
    for name in args.workloads:
        try:
            Workload.parse(name)
        except ValueError as e:
            p.error(str(e))
    if args.clients is None:
        args.clients = [8] if q else [1, 8, 32]
    if args.duration is None:
        args.duration = 3 if q else 8
    if args.rounds is None:
        args.rounds = 1 if q else 3
    if args.idle_clients is None:
        args.idle_clients = [1000] if q else [1000, 5000]
    args.idle_clients = [n for n in args.idle_clients if n > 0]
    global MAX_CLIENT_CONN
    MAX_CLIENT_CONN = max(MAX_CLIENT_CONN, max(args.idle_clients, default=0) + 1000)
    if args.warmup is None:
        args.warmup = 1 if q else 2
    if args.cache_warmup is None:
        args.cache_warmup = 1 if q else 5
    if not args.workloads:
        p.error("no workload to run")
    if not args.clients or min(args.clients) < 1 or args.duration < 1 or args.rounds < 1:
        p.error("clients, duration and rounds must be positive")
    return args


def setup_poolers(ctx: Ctx) -> None:
    """The poolers pgmemo is compared with, in column order: the peers built at
    --peers-prefix (PgBouncer 1.25, Odyssey), then Debian's PgBouncer."""
    a = ctx.args
    if not a.no_peers:
        found = ensure_peers(Path(a.peers_prefix), ctx.logdir)
        for kind, cls in (("pgbouncer", PgBouncer), ("odyssey", Odyssey)):
            template = PEERS_SRC / PEER_TEMPLATES[kind]
            if found[kind] is None:
                continue  # ensure_peers said why
            if not template.is_file():
                warn(f"{template} not found: going on without {kind} from {found[kind]}")
                continue
            srv = cls(ctx, found[kind], template=template)
            ctx.poolers.append(srv)
            log(f"peer {srv.name}: {srv.version_line} ({srv.binary}, config from {template.name})")
    if not a.no_pgbouncer:
        srv = PgBouncer(ctx, ensure_pgbouncer())
        if srv.name in {s.name for s in ctx.poolers}:
            srv.name += "-debian"
        ctx.poolers.append(srv)
        log(f"Debian's PgBouncer {srv.name}: {srv.version_line} ({srv.binary})")
        if srv.version < (1, 21):
            log(f"PgBouncer < 1.21 has no prepared statements in transaction mode: "
                f"{srv.name}'s -M prepared cells are expected to FAIL (they are run and reported)")


def start_compiled(s: CompiledServer, targets: list[Target], role: str) -> None:
    """Starts a server of bench/ in C and adds it to `targets`; one that does not compile or
    start is left out, with a warning."""
    t = Target(s.name, "127.0.0.1", 0, kind=s.kind, server=s)
    try:
        t.port = s.start()
        log(f"{s.name} up on 127.0.0.1:{t.port} (pid {s.pid}): {s.source.name}, {role}")
        targets.append(t)
    except BenchError as e:
        warn(f"{s.name}: {e}; going on without it")


def setup_targets(ctx: Ctx) -> list[Target]:
    a = ctx.args
    targets = [Target("direct", "127.0.0.1", ctx.pg.port, kind="direct")]
    if not a.no_pgmemo:
        s = ctx.pgmemo
        port = s.start()
        log(f"pgmemo up on 127.0.0.1:{port} (pid {s.proc.pid}): {shlex.join(s.argv[1:])}")
        targets.append(Target("pgmemo", "127.0.0.1", port, kind="pgmemo", server=s))
    for s in ctx.pgmemo_variants:
        port = s.start()
        log(f"{s.name} up on 127.0.0.1:{port} (pid {s.proc.pid}): {shlex.join(s.argv[1:])}")
        targets.append(Target(s.name, "127.0.0.1", port, kind="pgmemo", server=s))
    if ctx.pgmemo_cache is not None:
        s = ctx.pgmemo_cache
        port = s.start()
        log(f"{s.name} up on 127.0.0.1:{port} (pid {s.proc.pid}, metrics {s.metrics_url}): "
            f"{shlex.join(s.argv[1:])}")
        targets.append(Target(s.name, "127.0.0.1", port, kind="pgmemo", server=s, cache=True))
    if ctx.ceiling is not None:
        start_compiled(ctx.ceiling, targets, "for the cache-hot rows")
    for s in ctx.poolers:
        t = Target(s.name, "127.0.0.1", 0, kind=s.kind, server=s)
        try:
            t.port = s.start()
            log(f"{s.name} up on 127.0.0.1:{t.port} (pid {s.pid}): {s.version_line}")
        except BenchError as e:
            # A peer that does not start is reported (FAIL cells), not fatal: the others still compare.
            s.stop()
            t.broken = f"did not start: {one_line(str(e))[:300]}"
            warn(f"{s.name}: {t.broken}")
        targets.append(t)
    if ctx.relay is not None:
        start_compiled(ctx.relay, targets, "the relay floor")
    for spec in a.target:
        targets.append(parse_target(spec))
    return targets


def check_target(ctx: Ctx, t: Target) -> None:
    """A login and `select 1`, then a short pgbench warm-up; a target that fails
    here is marked broken and its cells are reported as FAIL (not run)."""
    if t.broken:
        return  # did not start: setup_targets said why
    try:
        r = subprocess.run([tool(ctx.pg_bindir, "psql"), "-h", t.host, "-p", str(t.port), "-U", t.user,
                            "-d", t.database, "-Atqc", "select 1"], capture_output=True, text=True,
                           env=t.env(), timeout=60)
        bad = r.returncode != 0 or r.stdout.strip() != "1"
        why = one_line(r.stderr or r.stdout)[:200]
    except subprocess.TimeoutExpired:
        bad, why = True, "no answer within 60 s"
    if bad:
        t.broken = f"startup check `psql -c 'select 1'` failed: {why}"
        warn(f"{t.name}: {t.broken}")
        return
    if ctx.args.warmup > 0 and t.kind != "ceiling":  # -S would read the scale from its canned row
        w = run_pgbench(ctx, t, SELECT_SIMPLE, min(8, max(ctx.args.clients)), ctx.args.warmup,
                        Run(-1, -1, -1, "warm-up", "simple", 0, t.name, ctx.args.warmup))
        if not w.ok:
            t.broken = f"warm-up pgbench failed: {w.error}"
            warn(f"{t.name}: {t.broken}")
            return
        log(f"{t.name}: ok, warm-up {w.tps:,.0f} tps")


def run_matrix(ctx: Ctx, targets: list[Target]) -> list[Run]:
    """Every cell (workload x clients), each round over the targets that run that
    workload (pgmemo+cache: only the cache ones), in rotating order."""
    a = ctx.args
    cells = [(wl, c) for wl in ctx.workloads for c in a.clients]
    total = sum(a.rounds * sum(t.runs(wl) for t in targets) for wl, _ in cells)
    width = max(len(t.name) for t in targets)
    wwidth = max(len(w.name) for w in ctx.workloads)
    runs: list[Run] = []
    k = 0
    warmed: set[str] = set()
    for ci, (wl, clients) in enumerate(cells):
        cell_targets = [t for t in targets if t.runs(wl)]
        n = len(cell_targets)
        if wl.is_cache and wl.name not in warmed and a.cache_warmup > 0:
            warm_up_cache_workload(ctx, cell_targets, wl, clients)
            warmed.add(wl.name)
        for r in range(a.rounds):
            for i in range(n):
                t = cell_targets[(r + i) % n]
                k += 1
                run = Run(ci, r, i, wl.name, wl.protocol, clients, t.name, a.duration)
                if t.broken:
                    run.error = f"not run: {t.broken}"
                else:
                    run_pgbench(ctx, t, wl, clients, a.duration, run)
                    if "timed out" in run.error or "exited during the run" in run.error \
                            or (t.server is not None and t.pid is None):
                        t.broken = f"an earlier run failed: {run.error[:160]}"
                        warn(f"{t.name}: {t.broken}; its remaining runs are skipped (FAIL)")
                runs.append(run)
                status = f"{run.tps:,.0f} tps" if run.tps is not None else "-"
                cpu = f", {run.proxy_cpu_us_per_tx:.1f} us/tx" if run.proxy_cpu_us_per_tx is not None else ""
                if run.cache_hit_ratio is not None:
                    cpu += f", hit ratio {run.cache_hit_ratio:.1%}"
                flag = "" if run.ok else f"  FAIL: {run.error}"
                if not t.broken:
                    log(f"[{k}/{total}] {wl.name:{wwidth}s} c={clients:<3d} round {r + 1} {t.name:{width}s} "
                        f"{status}{cpu}{flag}")
    return runs


def warm_up_cache_workload(ctx: Ctx, targets: list[Target], wl: Workload, clients: int) -> None:
    """Runs a cache workload once on every target before its first measured cell, not
    measured: the result cache is measured warm, as a cache in service is, and not by how
    fast one round happened to fill it (every target gets the same run)."""
    for t in targets:
        if t.broken:
            continue
        w = run_pgbench(ctx, t, wl, clients, ctx.args.cache_warmup,
                        Run(-1, -1, -1, "warm-up", wl.protocol, clients, t.name, ctx.args.cache_warmup))
        ratio = f", hit ratio {w.cache_hit_ratio:.1%}" if w.cache_hit_ratio is not None else ""
        log(f"{wl.name}: {t.name} warm-up {w.tps or 0:,.0f} tps{ratio}" if w.ok
            else f"{wl.name}: {t.name} warm-up failed: {w.error}")


def memory_test(ctx: Ctx, targets: list[Target]) -> list[dict]:
    rows = []
    for t in targets:
        if t.server is None or t.broken or t.cache or t.kind in ("ceiling", "relay"):
            # pgmemo+cache: the same binary as pgmemo, its cache empty with idle clients; the
            # relay: no pooler (a PostgreSQL connection per client)
            continue
        for n in ctx.args.idle_clients:
            row = {"target": t.name, "idle_clients": n, "opened": 0, "failed": n,
                   "rss_before_kib": None, "rss_after_kib": None, "kib_per_client": None,
                   "login_s": None, "error": ""}
            rows.append(row)
            try:
                # A fresh proxy for each count, warmed up, so that freed memory of an
                # earlier test is not reused and counted as zero.
                t.server.stop()
                t.port = t.server.start()
                if ctx.args.warmup > 0:
                    run_pgbench(ctx, t, SELECT_SIMPLE, 4, 1, Run(-1, -1, -1, "warm-up", "simple", 4, t.name, 1))
                time.sleep(0.5)
                row["rss_before_kib"] = before = proc_status_kib(t.pid)
                p = ctx.procs.spawn("idle_clients", [sys.executable, str(BENCH_DIR / "idle_clients.py"),
                                                     "--host", t.host, "--port", str(t.port), "--user", t.user,
                                                     "--database", t.database, "-n", str(n), "--quiet"],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                deadline = time.monotonic() + 60 + n / 20
                line = ""
                while time.monotonic() < deadline and p.poll() is None:
                    ready, _, _ = select.select([p.stdout], [], [], 0.5)
                    if ready:
                        line = p.stdout.readline()
                        break
                if not line:
                    row["error"] = "idle_clients did not report in time" if p.poll() is None \
                        else f"idle_clients exited with {p.returncode}"
                    ctx.procs.stop(p)
                    continue
                info = json.loads(line)
                time.sleep(1.0)
                row["rss_after_kib"] = after = proc_status_kib(t.pid)
                row.update(opened=info["opened"], failed=info["failed"], login_s=info["seconds"])
                if info["errors"]:
                    row["error"] = "; ".join(f"{v}x {k}" for k, v in info["errors"].items())[:300]
                if before is not None and after is not None and info["opened"]:
                    row["kib_per_client"] = round((after - before) / info["opened"], 2)
                if t.pid is None:
                    row["error"] = (row["error"] + "; " if row["error"] else "") + f"{t.name} exited"
                p.stdin.close()
                try:
                    p.wait(20)
                except subprocess.TimeoutExpired:
                    pass
                ctx.procs.stop(p)
            except BenchError as e:
                row["error"] = str(e).splitlines()[0]
            log(f"memory {t.name}: {n} idle clients: opened {row['opened']}, "
                f"{row['kib_per_client']} KiB/client {row['error']}")
    return rows


# --------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------

def fmt_int(x: Optional[float]) -> str:
    return "" if x is None else f"{x:,.0f}"


def fmt_range(vals: list[float], fmt) -> str:
    if not vals:
        return ""
    med = statistics.median(vals)
    if len(vals) == 1:
        return fmt(med)
    return f"{fmt(med)} ({fmt(min(vals))}–{fmt(max(vals))})"


@dataclass
class Cell:
    runs: list
    ok_tps: list = field(default_factory=list)
    cpu: list = field(default_factory=list)
    user: list = field(default_factory=list)  # the user-space part of each `cpu`
    hit: list = field(default_factory=list)  # cache hit ratios of the runs that have one
    nfail: int = 0

    @property
    def failed_tx(self) -> int:
        """pgbench's failed transactions plus aborted clients (each aborts at a
        failed transaction: in cache-rw, a stale read), over all runs."""
        return sum((r.failed_tx or 0) + r.aborted_clients for r in self.runs)

    @property
    def median(self) -> Optional[float]:
        return statistics.median(self.ok_tps) if self.ok_tps else None

    def tps_text(self) -> str:
        s = fmt_range(self.ok_tps, fmt_int)
        if self.nfail:
            s = (s + " " if s else "") + f"FAIL({self.nfail}/{len(self.runs)})"
        return s


def cells_of(runs: list[Run]) -> dict:
    cells: dict = {}
    for r in runs:
        c = cells.setdefault((r.workload, r.clients, r.target), Cell([]))
        c.runs.append(r)
        if r.ok:
            c.ok_tps.append(r.tps)
            if r.proxy_cpu_us_per_tx is not None:
                c.cpu.append(r.proxy_cpu_us_per_tx)
                if r.proxy_user_us_per_tx is not None:
                    c.user.append(r.proxy_user_us_per_tx)
        else:
            c.nfail += 1
        if r.cache_hit_ratio is not None:
            c.hit.append(r.cache_hit_ratio)
    return cells


def ratio_value(a: Optional[Cell], b: Optional[Cell]) -> Optional[float]:
    if a is None or b is None or a.median is None or b.median is None:
        return None
    return a.median / b.median


def ratio(a: Optional[Cell], b: Optional[Cell]) -> str:
    v = ratio_value(a, b)
    if v is None:
        return "—"
    s = f"{v:.2f}"
    return s + "*" if a.nfail or b.nfail else s


def best_peer(cells: dict, key: tuple, peers: list[str]) -> Optional[str]:
    """The peer with the highest median TPS in this cell (None: no peer has one).
    Failed runs are left out of a median; a peer whose runs all failed has none."""
    meds = [(cells[key + (n,)].median, n) for n in peers
            if key + (n,) in cells and cells[key + (n,)].median is not None]
    return max(meds)[1] if meds else None


def comparisons(targets: list[Target]) -> tuple[list[tuple[str, str]], list[str], bool]:
    """What the report compares: (a, b) ratio pairs, the peers' names, and whether
    there is a `pgmemo/best peer` column."""
    names = [t.name for t in targets]
    proxies = [t for t in targets if t.is_proxy]
    peers = [t.name for t in targets if t.is_peer]
    pairs = []
    if "direct" in names:
        pairs += [(p.name, "direct") for p in proxies]
    for p in proxies:
        if p.kind in ("external", "relay") and "pgmemo" in names:
            pairs.append(("pgmemo", p.name))
    return pairs, peers, "pgmemo" in names and bool(peers)


def best_peer_text(cells: dict, key: tuple, peers: list[str]) -> str:
    best = best_peer(cells, key, peers)
    if best is None:
        return "—"
    r = ratio(cells.get(key + ("pgmemo",)), cells[key + (best,)])
    if r == "—":
        return r
    # a `*` also when a peer that might have been the best had failures
    if not r.endswith("*") and any(cells[key + (n,)].nfail for n in peers if key + (n,) in cells):
        r += "*"
    return f"{r} ({best})"


def cpu_text(cell: Optional[Cell]) -> str:
    """CPU per transaction over the rounds, with the median of its user-space part: the rest
    is the kernel's, mostly the same system calls and wake-ups for every proxy."""
    if not cell:
        return ""
    text = fmt_range(cell.cpu, lambda x: f"{x:.1f}")
    return text + (f" (user {statistics.median(cell.user):.1f})" if cell.user else "")


def tps_cell_text(cells: dict, key: tuple, t: Target) -> str:
    """A target's TPS cell: `—` where it does not run that workload by design
    (pgmemo+cache outside the cache workloads), MISSING should a run be lost."""
    cell = cells.get(key + (t.name,))
    if cell is not None:
        return cell.tps_text()
    return "—" if not t.runs(Workload.parse(key[0])) else "MISSING"


def table(args, targets: list[Target], runs: list[Run]) -> tuple[str, list[str]]:
    cells = cells_of(runs)
    names = [t.name for t in targets]
    measured = [t for t in targets if t.is_proxy and t.kind != "external"]  # CPU of our own processes
    pairs, peers, has_best = comparisons(targets)
    hdr = ["workload", "clients"] + [f"{n} TPS" for n in names]
    hdr += [f"{a}/{b}" for a, b in pairs]
    if has_best:
        hdr.append("pgmemo/best peer")
    hdr += [f"{p.name} µs CPU/tx" for p in measured]
    lines = ["| " + " | ".join(hdr) + " |",
             "|" + "|".join(["---", "---:"] + ["---:"] * (len(hdr) - 2)) + "|"]
    notes = []
    for wl in args.workloads:
        for c in args.clients:
            key = (wl, c)
            row = [wl, str(c)]
            row += [tps_cell_text(cells, key, t) for t in targets]
            row += [ratio(cells.get(key + (a,)), cells.get(key + (b,))) for a, b in pairs]
            if has_best:
                row.append(best_peer_text(cells, key, peers))
            row += [cpu_text(cells.get(key + (p.name,))) for p in measured]
            lines.append("| " + " | ".join(row) + " |")
            for n in names:
                cell = cells.get(key + (n,))
                if cell and cell.nfail:
                    errs = sorted({r.error for r in cell.runs if not r.ok})
                    notes.append(f"- **{n}**, {wl}, {c} clients: {cell.nfail}/{len(cell.runs)} runs failed: "
                                 + " | ".join(errs))
    return "\n".join(lines), notes


def cell_rows(args, targets: list[Target], runs: list[Run]) -> list[dict]:
    """cells.csv: one row per workload x client count, the table's columns as numbers
    (medians; empty when there is none), plus min/max, failures and pgmemo/each peer."""
    cells = cells_of(runs)
    pairs, peers, has_best = comparisons(targets)
    if "pgmemo" in (t.name for t in targets):
        pairs = pairs + [("pgmemo", n) for n in peers]
    num = lambda v, nd: "" if v is None else round(v, nd)
    rows = []
    for wl in args.workloads:
        for c in args.clients:
            key = (wl, c)
            row = {"workload": wl, "protocol": Workload.parse(wl).protocol, "clients": c}
            for t in targets:
                cell = cells.get(key + (t.name,))
                ok = cell.ok_tps if cell else []
                row[f"{t.name}_tps_median"] = num(cell.median if cell else None, 1)
                row[f"{t.name}_tps_min"] = num(min(ok) if ok else None, 1)
                row[f"{t.name}_tps_max"] = num(max(ok) if ok else None, 1)
                row[f"{t.name}_runs"] = len(cell.runs) if cell else 0
                row[f"{t.name}_failed"] = cell.nfail if cell else 0
            for a, b in pairs:
                row[f"{a}/{b}"] = num(ratio_value(cells.get(key + (a,)), cells.get(key + (b,))), 3)
            if has_best:
                best = best_peer(cells, key, peers)
                row["pgmemo/best_peer"] = num(ratio_value(cells.get(key + ("pgmemo",)),
                                                          cells.get(key + (best,)) if best else None), 3)
                row["best_peer"] = best or ""
            for t in targets:
                if t.is_proxy and t.kind != "external":
                    cell = cells.get(key + (t.name,))
                    row[f"{t.name}_cpu_us_per_tx"] = num(statistics.median(cell.cpu) if cell and cell.cpu
                                                         else None, 2)
                    row[f"{t.name}_user_cpu_us_per_tx"] = num(statistics.median(cell.user)
                                                              if cell and cell.user else None, 2)
            for t in targets:
                if t.cache:  # the Result cache table's columns (empty outside the cache workloads)
                    cell = cells.get(key + (t.name,))
                    best = best_peer(cells, key, peers)
                    row[f"{t.name}/pgmemo"] = num(ratio_value(cell, cells.get(key + ("pgmemo",))), 3)
                    row[f"{t.name}/best_peer"] = num(ratio_value(cell, cells.get(key + (best,)) if best
                                                                 else None), 3)
                    row[f"{t.name}/{CEILING_TARGET}"] = num(ratio_value(cell, cells.get(key + (CEILING_TARGET,))), 3)
                    row[f"{t.name}_hit_ratio"] = num(statistics.median(cell.hit) if cell and cell.hit
                                                     else None, 4)
                    row[f"{t.name}_failed_tx"] = cell.failed_tx if cell else ""
            rows.append(row)
    return rows


def latency_table(args, targets: list[Target], latencies: dict[tuple[str, str], list[int]]) -> str:
    """The "Latency at one client" table (empty without 1 in --clients): per workload, each
    target's p50 / p99 transaction latency in µs over every transaction of its rounds (pooled:
    a p99 of one 8 s run rests on a few hundred transactions and moves by tens of µs between
    runs), from pgbench's per-transaction log, and what each proxy adds to PostgreSQL
    directly's."""
    if 1 not in args.clients:
        return ""
    def quantiles(wl: str, name: str) -> tuple[Optional[float], Optional[float]]:
        lat = sorted(latencies.get((wl, name), []))
        if not lat:
            return (None, None)
        return (float(percentile(lat, 0.50)), float(percentile(lat, 0.99)))
    names = [t.name for t in targets]
    proxies = [t.name for t in targets if t.is_proxy and not t.cache]
    has_direct = "direct" in names
    hdr = ["workload"] + [f"{n} p50 / p99" for n in names]
    if has_direct:
        hdr += [f"{n} adds p50 / p99" for n in proxies]
    lines = ["| " + " | ".join(hdr) + " |", "|" + "|".join(["---"] + ["---:"] * (len(hdr) - 1)) + "|"]
    pair = lambda a, b: "—" if a is None or b is None else f"{a:,.0f} / {b:,.0f}"
    for wl in args.workloads:
        q = {n: quantiles(wl, n) for n in names}
        if all(v == (None, None) for v in q.values()):
            continue
        row = [wl] + [pair(*q[n]) for n in names]
        if has_direct:
            d50, d99 = q["direct"]
            for n in proxies:
                p50, p99 = q[n]
                row.append("—" if None in (p50, p99, d50, d99) else f"{p50 - d50:+,.0f} / {p99 - d99:+,.0f}")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) if len(lines) > 2 else ""


def cache_table(args, targets: list[Target], runs: list[Run]) -> str:
    """The "Result cache" table (empty without cache workloads): per cache workload
    x clients, TPS of direct, pgmemo (cache off), pgmemo+cache and the best peer,
    pgmemo+cache over each, its hit ratio, CPU µs/tx of both pgmemos, and
    pgmemo+cache's failed transactions (pgbench's count plus aborted clients)."""
    wls = [w for w in args.workloads if Workload.parse(w).is_cache]
    if not wls:
        return ""
    cells = cells_of(runs)
    by_name = {t.name: t for t in targets}
    _, peers, _ = comparisons(targets)
    c = CACHE_TARGET
    ceiling = CEILING_TARGET in by_name
    hdr = ["workload", "clients", "direct TPS", "pgmemo TPS", f"{c} TPS", "best peer TPS"]
    hdr += [f"{CEILING_TARGET} TPS"] if ceiling else []
    # --pgmemo-variant targets (e.g. w2='workers = 2', pgmemo+cache's thread count with the
    # cache off: the miss path's baseline on as many workers).
    variants = [t.name for t in targets if t.kind == "pgmemo" and t.name not in ("pgmemo", c)]
    hdr += [f"{c}/direct", f"{c}/best peer", f"{c}/pgmemo"] + [f"{c}/{v}" for v in variants]
    hdr += [f"{c}/{CEILING_TARGET}"] if ceiling else []
    hdr += ["hit ratio", "pgmemo µs CPU/tx"] + [f"{v} µs CPU/tx" for v in variants]
    hdr += [f"{c} µs CPU/tx", f"{c} failed tx"]
    lines = ["| " + " | ".join(hdr) + " |",
             "|" + "|".join(["---", "---:"] + ["---:"] * (len(hdr) - 2)) + "|"]
    pct = lambda x: f"{x:.1%}"
    for wl in wls:
        for n in args.clients:
            key = (wl, n)
            tps = lambda name: tps_cell_text(cells, key, by_name[name]) if name in by_name else "—"
            mine = cells.get(key + (c,))
            best = best_peer(cells, key, peers)
            row = [wl, str(n), tps("direct"), tps("pgmemo"), tps(c),
                   f"{tps(best)} ({best})" if best else "—"]
            row += [tps(CEILING_TARGET)] if ceiling else []
            row += [ratio(mine, cells.get(key + ("direct",))),
                    ratio(mine, cells.get(key + (best,))) if best else "—",
                    ratio(mine, cells.get(key + ("pgmemo",)))]
            row += [ratio(mine, cells.get(key + (v,))) for v in variants]
            row += [ratio(mine, cells.get(key + (CEILING_TARGET,)))] if ceiling else []
            row += [fmt_range(mine.hit, pct) if mine and mine.hit else "—",
                    cpu_text(cells.get(key + ("pgmemo",)))]
            row += [cpu_text(cells.get(key + (v,))) for v in variants]
            row += [cpu_text(mine),
                    str(mine.failed_tx) + (f" FAIL({mine.nfail}/{len(mine.runs)})" if mine.nfail else "")
                    if mine else "—"]
            lines.append("| " + " | ".join(row) + " |")
    intro = (f"Result cache: {c} is pgmemo with `--cache` (the same binary and arguments as pgmemo, whose "
             "cache is off: for it and every other target the `/* pgmemo cache ttl=60s */` hint is just a "
             "comment), run only for these workloads, interleaved with the others. Before a cache workload's "
             f"first cell every target runs it once for {args.cache_warmup} s, not measured (the cache is "
             "measured warm). Hit ratio: its cache "
             "hits / (hits + misses) during each run, from its /metrics; in cache-hot (nearly all hits) "
             "the µs CPU/tx is about that of a hit, in cache-uniform (mostly misses) "
             f"`{c}/pgmemo` is the miss path's cost (with a `--pgmemo-variant` of pgmemo+cache's "
             f"`workers`, the ratio to it is that cost on as many threads). `{c} failed tx`: pgbench's failed transactions plus "
             "aborted clients over all runs; in cache-rw a stale read aborts its client, so 0 = no stale "
             "read. Best peer: the peer with the highest median TPS in that cell."
             + (f" {CEILING_TARGET}: bench/ceiling.c, a server that answers every query at once with a "
                "canned row and does nothing else (cache-hot rows only): the TPS this machine and pgbench "
                "reach with no work behind the socket, the most any cache could." if ceiling else ""))
    return "\n".join(["### Result cache", "", intro, ""] + lines)


def memory_table(rows: list[dict]) -> str:
    if not rows:
        return ""
    out = ["| proxy | idle clients | opened | RSS before (MiB) | RSS after (MiB) | KiB per client | login time (s) |",
           "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        kib = "" if r["kib_per_client"] is None else f"{r['kib_per_client']:.1f}"
        if r["failed"] or r["error"]:
            kib = (kib + " " if kib else "") + f"FAIL({r['failed']})"
        mib = lambda v: "" if v is None else f"{v / 1024:.1f}"
        out.append(f"| {r['target']} | {r['idle_clients']} | {r['opened']} | {mib(r['rss_before_kib'])} | "
                   f"{mib(r['rss_after_kib'])} | {kib} | {'' if r['login_s'] is None else r['login_s']} |")
    errs = [f"- {r['target']} {r['idle_clients']}: {r['error']}" for r in rows if r["error"]]
    return "\n".join(out + ([""] + errs if errs else []))


def plot(path: Path, args, targets: list[Target], runs: list[Run]) -> Optional[str]:
    """Two panels over the same groups (workload x clients): TPS of every target,
    with `pgmemo/best peer` written over each group, and the proxies' CPU µs per
    transaction; each target keeps its colour in both."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib not installed (pip install -r bench/requirements.txt): plot skipped"
    cells = cells_of(runs)
    groups = [(w, c) for w in args.workloads for c in args.clients]
    names = [t.name for t in targets]
    measured = [t.name for t in targets if t.is_proxy and t.kind != "external"]
    _, peers, has_best = comparisons(targets)
    colors = {n: f"C{i % 10}" for i, n in enumerate(names)}
    fig, (ax, ax_cpu) = plt.subplots(
        2, 1, sharex=True, gridspec_kw={"height_ratios": [3, 2]},
        figsize=(max(7, 1.3 * len(groups) * max(1, len(names) / 3) + 2), 7.5))

    def bars(axis, series: list[str], values, fail_marks: bool) -> None:
        width = 0.8 / max(1, len(series))
        top = max([v[0] for n in series for g in groups if (v := values(g, n)) is not None] or [1])
        for i, n in enumerate(series):
            xs, hs, lo, hi, fails = [], [], [], [], []
            for gi, g in enumerate(groups):
                x = gi + (i - (len(series) - 1) / 2) * width
                v = values(g, n)
                cell = cells.get(g + (n,))
                if v is None:
                    if fail_marks and cell is not None:  # no cell: not run by design (pgmemo+cache)
                        fails.append((x, "FAIL"))
                    continue
                xs.append(x); hs.append(v[0]); lo.append(v[0] - v[1]); hi.append(v[2] - v[0])
                if fail_marks and cell is not None and cell.nfail:
                    fails.append((x, f"FAIL {cell.nfail}/{len(cell.runs)}"))
            axis.bar(xs, hs, width, label=n, color=colors[n],
                     yerr=[lo, hi] if args.rounds > 1 else None, capsize=2)
            for x, label in fails:
                axis.text(x, top * 0.02, label, rotation=90, ha="center", va="bottom", fontsize=7,
                          color="red", fontweight="bold")
        axis.grid(axis="y", alpha=0.3)

    def tps(g, n):
        cell = cells.get(g + (n,))
        return (cell.median, min(cell.ok_tps), max(cell.ok_tps)) if cell and cell.ok_tps else None

    def cpu(g, n):
        cell = cells.get(g + (n,))
        return (statistics.median(cell.cpu), min(cell.cpu), max(cell.cpu)) if cell and cell.cpu else None

    bars(ax, names, tps, True)
    ax.set_ylabel("TPS (median; whiskers min–max)")
    if has_best:
        ymax = ax.get_ylim()[1]  # above the tallest bar: the labels go over all of them
        for gi, g in enumerate(groups):
            ax.text(gi, ymax * 1.01, "pgmemo/best peer\n" + best_peer_text(cells, g, peers).replace(" (", "\n("),
                    ha="center", va="bottom", fontsize=7)
        ax.set_ylim(top=ymax * 1.2)
    ax.set_title(f"pgbench, {args.duration} s runs, {args.rounds} round(s), pool size {args.pool_size}, "
                 "transaction mode", fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    if measured:
        bars(ax_cpu, measured, cpu, False)
        ax_cpu.set_ylabel("proxy CPU µs per transaction")
    ax_cpu.set_xticks(range(len(groups)))
    ax_cpu.set_xticklabels([f"{w}\n{c} client{'s' if c != 1 else ''}" for w, c in groups], fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def workloads_text(workloads: list[Workload], args) -> str:
    """The report's sentence on what the rows ran."""
    sel = [w.name for w in workloads if w.script is None and w.name not in TPCB_WORKLOADS]
    tpcb = [w.name for w in workloads if w.name in TPCB_WORKLOADS]
    orm = [w.name for w in workloads if w.script == ORM_SCRIPT]
    cache = [w.name for w in workloads if w.is_cache]
    parts = []
    if sel:
        parts.append(f"`-S` (select-only; rows {', '.join(sel)})")
    if tpcb:
        parts.append(f"pgbench's built-in TPC-B-like script (rows {', '.join(tpcb)}: three UPDATEs, a "
                     "SELECT and an INSERT in a BEGIN ... END block)")
    if orm:
        parts.append(f"`-f bench/orm.sql -s {args.scale}` (rows {', '.join(orm)}: a point select, a join "
                     "with an IN list of three ids, an UPDATE and an INSERT, each its own autocommit "
                     "statement; one transaction = one run of the script)")
    if cache:
        parts.append(f"`-f bench/cache_*.sql -s {args.scale}` (rows {', '.join(cache)}, -M simple or, "
                     "for the -extended rows, extended: a point "
                     "select of pgbench_accounts with a `/* pgmemo cache ttl=60s */` hint, aid "
                     f"random_zipfian(1, 100,000, 1.1) in cache-hot, uniform over {100000 * args.scale:,} in "
                     "cache-uniform; cache-rw: 90 % the hot select, 10 % an UPDATE of the client's own row "
                     "and a cached read of it that aborts the client if it is not the value written)")
    return (f"Workloads: `pgbench -n -j 2 -c C -T {args.duration} -M P` with " + " or ".join(parts)
            + f", scale {args.scale};")


def write_csv(path: Path, rows: list[dict]) -> None:
    if not rows:
        return
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
        w.writeheader()
        w.writerows(rows)


# --------------------------------------------------------------------------

def main(argv=None) -> int:
    args = build_args(argv)
    ctx = Ctx(args)
    t_start = time.monotonic()
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    ctx.outdir = Path(args.out) if args.out else BENCH_DIR / "results" / stamp
    ctx.outdir.mkdir(parents=True, exist_ok=True)
    ctx.logdir = ctx.outdir / "logs"
    ctx.logdir.mkdir(exist_ok=True)

    cleaned = False

    def cleanup() -> None:
        nonlocal cleaned
        if cleaned:
            return
        cleaned = True
        old = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
        try:
            ctx.procs.stop_all()
            ctx.save_pooler_logs()
            ctx.close_logs()
            if ctx.tmp != Path() and ctx.tmp.exists():
                shutil.rmtree(ctx.tmp, ignore_errors=True)
        finally:
            for s, h in old.items():
                signal.signal(s, h)

    def on_signal(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGHUP, on_signal)
    atexit.register(cleanup)

    try:
        return _main(ctx, args, t_start, stamp)
    except KeyboardInterrupt:
        log("interrupted: stopping everything")
        return 130
    except BenchError as e:
        log(f"ERROR: {e}")
        return 2
    finally:
        cleanup()
        log(f"stopped all processes; results (if any) in {ctx.outdir}")


def _main(ctx: Ctx, args, t_start: float, stamp: str) -> int:
    info = machine_info()
    ctx.pg_bindir = find_pg_bindir()
    ctx.pg_version = version_of([tool(ctx.pg_bindir, "postgres"), "--version"])
    ctx.pgbench = tool(ctx.pg_bindir, "pgbench")
    ctx.run_as = ensure_run_as()

    ctx.workloads = [Workload.parse(w) for w in args.workloads]
    setup_poolers(ctx)
    if not args.no_pgmemo:
        binary = Path(args.pgmemo_bin)
        if not args.no_build:
            log("cargo build --release")
            r = subprocess.run(["cargo", "build", "--release"], cwd=REPO, stdout=sys.stderr, stderr=sys.stderr)
            if r.returncode != 0:
                raise BenchError("cargo build --release failed (use --no-pgmemo to benchmark without pgmemo)")
        if not binary.exists():
            raise BenchError(f"{binary} not found (build it, or pass --no-pgmemo)")
        ctx.pgmemo = Pgmemo(ctx, binary)
        log(f"pgmemo: {binary} ({ctx.pgmemo.version_line}), git {git_rev()}")
        for spec in args.pgmemo_variant:
            name, _, line = spec.partition("=")
            if not name or not line or not re.fullmatch(r"[a-z0-9_]+", name):
                raise BenchError(f"--pgmemo-variant {spec!r}: expected NAME='setting = value'")
            ctx.pgmemo_variants.append(Pgmemo(ctx, binary, variant=(name, line)))
            log(f"also pgmemo-{name}: the same binary with [general] {line}")
        if any(w.is_cache for w in ctx.workloads):
            ctx.pgmemo_cache = Pgmemo(ctx, binary, cache=True)
            log(f"cache workloads selected: also {CACHE_TARGET} (pgmemo --cache), for those only")
    compiler = shutil.which("cc") or shutil.which("gcc")  # for bench/'s servers in C
    if any(w.is_cache_hot for w in ctx.workloads) and not args.no_ceiling:
        if compiler:
            ctx.ceiling = Ceiling(ctx, compiler)
            log(f"cache-hot workloads selected: also {CEILING_TARGET} ({CEILING_SRC.name}), for those only")
        else:
            warn(f"no C compiler (cc): going on without {CEILING_TARGET}")
    if not all(w.is_cache for w in ctx.workloads) and not args.no_relay:
        if compiler:
            ctx.relay = Relay(ctx, compiler)
            log(f"also {RELAY_TARGET} ({RELAY_SRC.name}): the relay floor, in the forwarding rows")
        else:
            warn(f"no C compiler (cc): going on without {RELAY_TARGET}")

    need_fds = max(args.idle_clients or [0]) + 1024
    lim = raise_nofile(need_fds)
    if lim < need_fds:
        warn(f"RLIMIT_NOFILE is {lim}: the idle-client test may fail above ~{lim - 1024} clients")

    n_ours = (not args.no_pgmemo) + len(ctx.pgmemo_variants) + len(ctx.poolers)  # we start these
    n_targets = 1 + n_ours + len(args.target)
    n_cache = sum(w.is_cache for w in ctx.workloads) if ctx.pgmemo_cache else 0  # pgmemo+cache's rows
    n_hot = sum(w.is_cache_hot for w in ctx.workloads) if ctx.ceiling else 0  # the ceiling's rows
    n_relay = sum(not w.is_cache for w in ctx.workloads) if ctx.relay else 0  # the relay's rows
    n_runs = (len(ctx.workloads) * n_targets + n_cache + n_hot + n_relay) * len(args.clients) * args.rounds
    est = n_runs * (args.duration + 0.3) + 10 + (n_targets + bool(n_cache)) * args.warmup \
        + sum(3 + n / 1500 for n in args.idle_clients) * n_ours \
        + n_cache * (n_targets + 1) * args.cache_warmup
    log(f"{n_runs} pgbench runs of {args.duration} s ({len(ctx.workloads)} workloads x "
        f"{len(args.clients)} client counts x {args.rounds} rounds x {n_targets} targets"
        + (f", plus {CACHE_TARGET} for the {n_cache} cache workloads" if n_cache else "")
        + f"); estimated {est / 60:.1f} min")

    ctx.tmp = Path(tempfile.mkdtemp(prefix="pgmemo-bench-"))
    chown_tree(ctx.tmp, ctx.run_as)
    pg_port = args.pg_port or free_port()
    _used_ports.add(pg_port)
    ctx.pg = Postgres(ctx, pg_port)
    ctx.pg.start()

    targets = setup_targets(ctx)
    for t in targets:
        check_target(ctx, t)

    t_matrix = time.monotonic()
    runs = run_matrix(ctx, targets)
    matrix_s = time.monotonic() - t_matrix
    rss_after_runs = {t.name: proc_status_kib(t.pid) for t in targets if t.pid}
    mem_rows = memory_test(ctx, targets) if args.idle_clients else []
    info["loadavg_end"] = os.getloadavg()[0]
    total_s = time.monotonic() - t_start

    # ---- report
    run_rows = [asdict(r) for r in runs]
    write_csv(ctx.outdir / "runs.csv", run_rows)
    write_csv(ctx.outdir / "cells.csv", cell_rows(args, targets, runs))
    write_csv(ctx.outdir / "memory.csv", mem_rows)
    tbl, notes = table(args, targets, runs)
    cache_tbl = cache_table(args, targets, runs)
    latency_tbl = latency_table(args, targets, ctx.latencies)
    plot_err = plot(ctx.outdir / "tps.png", args, targets, runs)
    versions = {"postgres": ctx.pg_version, "pgbench": version_of([ctx.pgbench, "--version"])}
    if not args.no_pgmemo:
        versions["pgmemo"] = f"{ctx.pgmemo.version_line}, git {git_rev()}"
        for v in ctx.pgmemo_variants:
            versions[v.name] = f"the same binary with [general] {v.variant[1]}"
        if ctx.pgmemo_cache:
            versions[CACHE_TARGET] = "the same binary with --cache"
    for srv in ctx.poolers:
        versions[srv.name] = f"{srv.version_line} ({srv.binary})"
    cmd = "python3 bench/run.py" + ("" if len(sys.argv) < 2 else " " + shlex.join(sys.argv[1:]))
    meta = {"date": stamp, "command": cmd, "machine": info, "versions": versions,
            "args": vars(args), "ports": {t.name: t.port for t in targets} | {"postgres": ctx.pg.port},
            "matrix_seconds": round(matrix_s, 1), "total_seconds": round(total_s, 1),
            "rss_after_runs_kib": rss_after_runs,
            "targets": [{"name": t.name, "kind": t.kind, "port": t.port, "broken": t.broken}
                        for t in targets],
            "workloads": {w.name: shlex.join(w.pgbench_args(args.scale) + ["-M", w.protocol])
                          for w in ctx.workloads},
            "pgmemo_argv": getattr(getattr(ctx, "pgmemo", None), "argv", None),
            "pgmemo_cache_argv": getattr(ctx.pgmemo_cache, "argv", None)}
    (ctx.outdir / "meta.json").write_text(json.dumps(meta, indent=2, default=str))

    head = [f"## pgmemo benchmark {dt.datetime.now().strftime('%Y-%m-%d %H:%M')}",
            "",
            f"`{cmd}`",
            "",
            f"Machine: {info.get('cpu', '?')}, {info['cores']} cores, {info.get('memory_gib', '?')} GiB, "
            f"Linux {info['kernel']}; load average {info['loadavg_start']:.2f} at start, "
            f"{info['loadavg_end']:.2f} at end.",
            "Versions: " + "; ".join(f"{k}: {v}" for k, v in versions.items()) + ".",
            workloads_text(ctx.workloads, args)
            + f" {args.rounds} round(s) per cell, targets interleaved in rotating order; "
            f"pool size {args.pool_size}, transaction mode, for every proxy. TPS excludes connection time; "
            "cells show median (min–max over rounds); `FAIL(k/n)`: k of n runs failed "
            "(non-zero exit, aborted clients or failed transactions, or the target did not start), "
            "the median is over the others; ratios of medians, `*` when a side had failures; "
            + (f"`pgmemo/best peer`: pgmemo's median over the best median among the peer poolers "
               f"({', '.join(t.name for t in targets if t.is_peer)}), that peer in parentheses; "
               if comparisons(targets)[2] else "")
            + "µs CPU/tx = proxy utime+stime (all threads) / transactions, the median utime part "
            "in parentheses (`user`: the proxy's own code; the rest is the kernel's)."
            + (f" {CACHE_TARGET} (pgmemo --cache) runs only the cache workloads (`—` elsewhere)."
               if ctx.pgmemo_cache else "")
            + (f" {RELAY_TARGET} ({RELAY_SRC.name}) is the relay floor: bytes copied between each "
               "client and a PostgreSQL connection of its own, no pooling, no parsing; what any "
               "proxy costs here before doing anything (not a peer; not in the cache workloads)."
               if any(t.kind == "relay" for t in targets) else ""),
            ""]
    body = head + [tbl, ""]
    if latency_tbl:
        body += ["Latency at one client, µs per transaction (pgbench -c 1 --log; p50 and p99 over every "
                 "transaction of the rounds; `adds`: the proxy's over PostgreSQL directly's):", "",
                 latency_tbl, ""]
    if cache_tbl:
        body += [cache_tbl, ""]
    if notes:
        body += ["Failures:", ""] + notes + [""]
    if mem_rows:
        body += ["Memory per idle client (RSS of a freshly started, warmed-up proxy before and after "
                 "opening N idle logged-in client connections):", "", memory_table(mem_rows), ""]
    if rss_after_runs:
        body += ["RSS after the TPS runs: " + ", ".join(f"{k} {v / 1024:.1f} MiB" for k, v in rss_after_runs.items()), ""]
    files = [f for f in ("runs.csv", "cells.csv", "memory.csv", "tps.png", "summary.md", "meta.json")
             if (ctx.outdir / f).exists() or f == "summary.md"] + ["logs/"]
    body += [f"Run time: {total_s / 60:.1f} min ({matrix_s / 60:.1f} min of pgbench runs). "
             f"Files: {ctx.outdir}/ ({', '.join(files)})."]
    if plot_err:
        body += ["", f"Plot: {plot_err}"]
        warn(plot_err)
    report = "\n".join(body) + "\n"
    (ctx.outdir / "summary.md").write_text(report)
    if not args.out:
        latest = BENCH_DIR / "results" / "latest"
        try:
            if latest.is_symlink() or latest.exists():
                latest.unlink()
            latest.symlink_to(stamp)
        except OSError:
            pass
    sys.stdout.write(report)
    sys.stdout.flush()
    if args.max_idle_kib is not None:
        ours = [r for r in mem_rows if r["target"] == "pgmemo"]
        over = [r for r in ours if r["kib_per_client"] is None or r["kib_per_client"] > args.max_idle_kib
                or r["failed"]]
        if not ours or over:
            for r in over or [{"idle_clients": n, "kib_per_client": None, "error": "not measured"}
                              for n in args.idle_clients]:
                warn(f"memory per idle client over --max-idle-kib {args.max_idle_kib}: "
                     f"{r['idle_clients']} clients, {r['kib_per_client']} KiB/client {r.get('error', '')}")
            return 1
        log(f"memory per idle client within {args.max_idle_kib} KiB: "
            + ", ".join(f"{r['idle_clients']} clients {r['kib_per_client']} KiB" for r in ours))
    return 0


if __name__ == "__main__":
    sys.exit(main())
