#!/usr/bin/env python3
"""pgmemo benchmark: pgbench -S through pgmemo, directly against PostgreSQL, and
through PgBouncer, side by side in one run.

    python3 bench/run.py            # full default run (< 15 min on 2 cores)
    python3 bench/run.py --quick    # one round, 3 s runs, 8 clients (< 2 min)

What it does, by itself:
  * starts a throwaway PostgreSQL (initdb in a temp dir, trust on 127.0.0.1,
    fsync=off, free port) and loads `pgbench -i -s SCALE`;
  * builds pgmemo (`cargo build --release`, unless --no-build) and starts
    target/release/pgmemo in transaction mode; starts PgBouncer (Debian package
    `pgbouncer`, installed with apt-get when missing and running as root) in
    transaction mode with the same pool size; both on free loopback ports;
  * for each protocol x client count ("cell") and each round, runs
    `pgbench -S -n -j 2 -c C -T S -M P` against every target, the targets in
    rotating order (round r starts at target r mod n);
  * records TPS (without connection time), average latency, failed transactions,
    exit status, and for the proxies the CPU time per transaction (utime+stime of
    the process, all threads, from /proc/PID/stat) and RSS;
  * measures memory per idle client (bench/idle_clients.py) for the proxies;
  * prints a markdown table on stdout and writes runs.csv, memory.csv, tps.png,
    summary.md, meta.json and the servers' logs into bench/results/<timestamp>/.

Progress goes to stderr; the report goes to stdout. Nothing is left running when
it ends, also on Ctrl-C or an error: every child runs in its own process group
and is stopped in a finally block; the temp dir is removed.

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


def _child_setup() -> None:
    """Runs in the child after fork (and after the uid change): die with us,
    even when this harness is killed with SIGKILL."""
    if _libc is not None:
        _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


@dataclass
class RunAs:
    user: str
    uid: int
    gid: int
    home: str


class Procs:
    """Registry of the children we started (each the leader of its own group)."""

    def __init__(self) -> None:
        self.live: list[tuple[str, subprocess.Popen, int]] = []  # (name, proc, stop signal)
        self.pgids: set[int] = set()

    def spawn(self, name: str, argv: list[str], *, run_as: Optional[RunAs] = None,
              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
              stdin=subprocess.DEVNULL, cwd=None, env=None, text=False,
              stop_signal: int = signal.SIGTERM) -> subprocess.Popen:
        kw = {}
        if run_as is not None:
            kw = dict(user=run_as.uid, group=run_as.gid, extra_groups=[])
        p = subprocess.Popen(argv, stdin=stdin, stdout=stdout, stderr=stderr, cwd=cwd,
                             env=env, text=text, start_new_session=True,
                             preexec_fn=_child_setup, **kw)
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
        for stream in (p.stdin, p.stdout, p.stderr):
            if stream is not None:
                try:
                    stream.close()
                except OSError:
                    pass
        if entry:
            self.live.remove(entry)

    def stop_all(self) -> None:
        for name, p, _ in reversed(list(self.live)):
            self.stop(p, timeout=8.0)
        # Final sweep: anything still in one of our process groups.
        for pid_dir in glob.glob("/proc/[0-9]*"):
            try:
                with open(pid_dir + "/stat") as f:
                    rest = f.read().rsplit(")", 1)[1].split()
                pgrp = int(rest[2])
            except (OSError, IndexError, ValueError):
                continue
            if pgrp in self.pgids:
                try:
                    os.kill(int(pid_dir[6:]), signal.SIGKILL)
                    warn(f"killed leftover process {pid_dir[6:]} of group {pgrp}")
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
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])  # fields 14 and 15 of stat(5)
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
    kind: str = "external"           # direct | pgmemo | pgbouncer | external
    server: object = None            # the Server that runs it (None for direct/external)
    broken: Optional[str] = None     # why its runs were not done

    @property
    def pid(self) -> Optional[int]:
        p = getattr(self.server, "proc", None)
        return p.pid if p is not None and p.poll() is None else None

    @property
    def is_proxy(self) -> bool:
        return self.kind != "direct"

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
""")
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


class PgBouncer:
    kind = "pgbouncer"

    def __init__(self, ctx: "Ctx", binary: str) -> None:
        self.ctx, self.binary = ctx, binary
        self.version_line = version_of([binary, "--version"])
        m = re.search(r"(\d+)\.(\d+)(?:\.(\d+))?", self.version_line)
        self.version = tuple(int(x or 0) for x in m.groups()) if m else (0, 0, 0)
        self.logfile = ctx.logdir / "pgbouncer.log"
        self.proc: Optional[subprocess.Popen] = None
        self.port = 0

    @property
    def dir(self) -> Path:
        return self.ctx.tmp / "pgbouncer"

    def start(self) -> int:
        c = self.ctx
        self.port = free_port()
        self.dir.mkdir(exist_ok=True)
        (self.dir / "userlist.txt").write_text(f'"{DB_USER}" ""\n')
        extra = ""
        if self.version >= (1, 21):
            extra = "max_prepared_statements = 200\n"
        (self.dir / "pgbouncer.ini").write_text(f"""[databases]
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
max_client_conn = 6000
ignore_startup_parameters = extra_float_digits
logfile =
pidfile =
log_connections = 0
log_disconnections = 0
admin_users = {DB_USER}
{extra}""")
        chown_tree(self.dir, c.run_as)
        lf = c.open_log(self.logfile)
        self.proc = c.procs.spawn("pgbouncer", [self.binary, str(self.dir / "pgbouncer.ini")],
                                  run_as=c.run_as, cwd=self.dir, stdout=lf, stderr=subprocess.STDOUT,
                                  env=dict(os.environ, HOME=str(self.dir)), stop_signal=signal.SIGTERM)
        wait_port("pgbouncer", "127.0.0.1", self.port, self.proc, self.logfile)
        return self.port

    def stop(self) -> None:
        if self.proc is not None:
            self.ctx.procs.stop(self.proc)
            self.proc = None


class Pgmemo:
    kind = "pgmemo"

    def __init__(self, ctx: "Ctx", binary: Path) -> None:
        self.ctx, self.binary = ctx, binary
        self.version_line = version_of([str(binary), "--version"])
        self.logfile = ctx.logdir / "pgmemo.log"
        self.proc: Optional[subprocess.Popen] = None
        self.port = 0
        self.argv: list[str] = []

    def start(self) -> int:
        c = self.ctx
        self.port = free_port()
        self.argv = [str(self.binary), "--upstream", f"postgresql://{DB_USER}@127.0.0.1:{c.pg.port}",
                     "--listen", f"127.0.0.1:{self.port}", "--pool-mode", "transaction",
                     "--pool-size", str(c.args.pool_size), "--auth", "trust",
                     # The same client limit as PgBouncer's config above.
                     "--max-client-conn", "6000"] + list(c.args.pgmemo_arg)
        lf = c.open_log(self.logfile)
        lf.write(f"\n# {shlex.join(self.argv)}\n".encode())
        lf.flush()
        self.proc = c.procs.spawn("pgmemo", self.argv, cwd=REPO, stdout=lf, stderr=subprocess.STDOUT,
                                  stop_signal=signal.SIGTERM)
        wait_port("pgmemo", "127.0.0.1", self.port, self.proc, self.logfile)
        return self.port

    def stop(self) -> None:
        if self.proc is not None:
            self.ctx.procs.stop(self.proc)
            self.proc = None


# --------------------------------------------------------------------------
# pgbench
# --------------------------------------------------------------------------

RE_TPS = re.compile(r"^tps = ([0-9.]+) \((?:without initial connection time|excluding connections establishing)\)", re.M)
RE_TPS_ANY = re.compile(r"^tps = ([0-9.]+)", re.M)
RE_LAT = re.compile(r"^latency average = ([0-9.]+) ms", re.M)
RE_TX = re.compile(r"^number of transactions actually processed: (\d+)", re.M)
RE_FAILED = re.compile(r"^number of failed transactions: (\d+)", re.M)
RE_ABORTED = re.compile(r"client \d+ .*aborted", re.M)


@dataclass
class Run:
    cell: int
    round: int
    order: int
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
    proxy_rss_kib: Optional[int] = None
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


def one_line(text: str) -> str:
    return " ".join(text.split())


def first_error(err: str) -> str:
    lines = [l.strip() for l in err.splitlines() if l.strip()]
    pick = next((l for l in lines if "error" in l.lower() or "fatal" in l.lower()), None)
    pick = pick or (lines[0] if lines else "")
    pick = re.sub(r"^pgbench: (error: )?", "", pick)
    return one_line(pick)[:240]


def run_pgbench(ctx: "Ctx", t: Target, protocol: str, clients: int, duration: int,
                run: Run) -> Run:
    argv = [ctx.pgbench, "-S", "-n", "-j", str(min(2, clients)), "-c", str(clients),
            "-T", str(duration), "-M", protocol, "-h", t.host, "-p", str(t.port),
            "-U", t.user, t.database]
    pid = t.pid
    if t.kind in ("pgmemo", "pgbouncer") and pid is None:
        run.error = f"{t.name} is not running"
        return run
    run.started = dt.datetime.now().isoformat(timespec="seconds")
    cpu0 = proc_cpu_ticks(pid)
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
    cpu1 = proc_cpu_ticks(pid)
    run.proxy_rss_kib = proc_status_kib(pid)
    run.exit_status = p.returncode
    parse_pgbench(run, out, err)
    if cpu0 is not None and cpu1 is not None:
        run.proxy_cpu_s = round((cpu1 - cpu0) / CLK_TCK, 3)
        if run.transactions:
            run.proxy_cpu_us_per_tx = round(run.proxy_cpu_s * 1e6 / run.transactions, 2)
    problems = []
    if timed_out:
        problems.append(f"timed out after {duration + ctx.grace_s} s (killed)")
    if run.exit_status not in (0, None) and not timed_out:
        problems.append(f"pgbench exit {run.exit_status}")
    if run.aborted_clients:
        problems.append(f"{run.aborted_clients} client(s) aborted")
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
        self.pgbouncer: Optional[PgBouncer] = None
        self.pgmemo: Optional[Pgmemo] = None
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
        f.write(f"\n===== cell {run.cell} round {run.round} {run.target} {run.protocol} "
                f"c={run.clients} started {run.started} exit {run.exit_status}\n$ {shlex.join(argv)}\n")
        f.write(out)
        if err.strip():
            f.write("--- stderr\n")
            errl = err.splitlines()
            f.write("\n".join(errl[:40] + (["... (%d more lines)" % (len(errl) - 40)] if len(errl) > 40 else [])) + "\n")
        f.flush()

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
    if t.name in ("direct", "pgmemo", "pgbouncer"):
        raise BenchError(f"--target name {t.name!r} is reserved")
    return t


def csv_list(s: str, conv=str) -> list:
    return [conv(x.strip()) for x in s.split(",") if x.strip()]


def build_args(argv=None):
    p = argparse.ArgumentParser(
        prog="python3 bench/run.py",
        description="pgbench -S through pgmemo vs PostgreSQL directly vs PgBouncer, side by side.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="one round, 3 s runs, 8 clients, idle-client test with 1000 (under 2 min); "
                        "options given explicitly still win")
    p.add_argument("--protocols", type=lambda s: csv_list(s), default=None,
                   help="comma list of pgbench -M protocols [simple,extended,prepared]")
    p.add_argument("--clients", type=lambda s: csv_list(s, int), default=None,
                   help="comma list of client counts [1,8,32; quick: 8]")
    p.add_argument("--duration", "-T", type=int, default=None,
                   help="seconds per pgbench run [8; quick: 3]")
    p.add_argument("--rounds", type=int, default=None, help="rounds per cell [3; quick: 1]")
    p.add_argument("--scale", type=int, default=10, help="pgbench -i scale")
    p.add_argument("--pool-size", type=int, default=10, help="server connections per pool (pgmemo and PgBouncer)")
    p.add_argument("--target", action="append", default=[], metavar="NAME=host:port",
                   help="an already-running pooler to add (repeatable); also NAME=postgresql://user[:pw]@host:port/db. "
                        "It must serve database 'bench' as user 'bench' with pgbench tables (see --pg-port)")
    p.add_argument("--pg-port", type=int, default=0,
                   help="port for the throwaway PostgreSQL (0: a free one), e.g. to point a --target pooler at it")
    p.add_argument("--no-pgmemo", action="store_true", help="leave pgmemo out")
    p.add_argument("--no-pgbouncer", action="store_true", help="leave PgBouncer out")
    p.add_argument("--no-build", action="store_true", help="do not run cargo build --release")
    p.add_argument("--pgmemo-bin", default=str(REPO / "target" / "release" / "pgmemo"))
    p.add_argument("--pgmemo-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for pgmemo (repeatable; use --pgmemo-arg=--flag for dashes)")
    p.add_argument("--idle-clients", type=lambda s: csv_list(s, int), default=None,
                   help="idle-client counts for the memory test, comma list; 0 or empty to skip [1000,5000; quick: 1000]")
    p.add_argument("--out", default=None, help="results directory [bench/results/<timestamp>]")
    p.add_argument("--warmup", type=int, default=None, help="seconds of warm-up per target before the runs [2; quick: 1]")
    args = p.parse_args(argv)
    q = args.quick
    if args.protocols is None:
        args.protocols = list(PROTOCOLS)
    if args.clients is None:
        args.clients = [8] if q else [1, 8, 32]
    if args.duration is None:
        args.duration = 3 if q else 8
    if args.rounds is None:
        args.rounds = 1 if q else 3
    if args.idle_clients is None:
        args.idle_clients = [1000] if q else [1000, 5000]
    args.idle_clients = [n for n in args.idle_clients if n > 0]
    if args.warmup is None:
        args.warmup = 1 if q else 2
    for proto in args.protocols:
        if proto not in PROTOCOLS:
            p.error(f"unknown protocol {proto!r} (use {', '.join(PROTOCOLS)})")
    if not args.clients or min(args.clients) < 1 or args.duration < 1 or args.rounds < 1:
        p.error("clients, duration and rounds must be positive")
    return args


def setup_targets(ctx: Ctx) -> list[Target]:
    a = ctx.args
    targets = [Target("direct", "127.0.0.1", ctx.pg.port, kind="direct")]
    if not a.no_pgmemo:
        s = ctx.pgmemo
        port = s.start()
        log(f"pgmemo up on 127.0.0.1:{port} (pid {s.proc.pid}): {shlex.join(s.argv[1:])}")
        targets.append(Target("pgmemo", "127.0.0.1", port, kind="pgmemo", server=s))
    if not a.no_pgbouncer:
        s = ctx.pgbouncer
        port = s.start()
        log(f"pgbouncer up on 127.0.0.1:{port} (pid {s.proc.pid})")
        targets.append(Target("pgbouncer", "127.0.0.1", port, kind="pgbouncer", server=s))
    for spec in a.target:
        targets.append(parse_target(spec))
    return targets


def check_target(ctx: Ctx, t: Target) -> None:
    """A login and `select 1`, then a short pgbench warm-up; a target that fails
    here is marked broken and its cells are reported as FAIL (not run)."""
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
    if ctx.args.warmup > 0:
        w = run_pgbench(ctx, t, "simple", min(8, max(ctx.args.clients)), ctx.args.warmup,
                        Run(-1, -1, -1, "simple", 0, t.name, ctx.args.warmup))
        if not w.ok:
            t.broken = f"warm-up pgbench failed: {w.error}"
            warn(f"{t.name}: {t.broken}")
            return
        log(f"{t.name}: ok, warm-up {w.tps:,.0f} tps")


def run_matrix(ctx: Ctx, targets: list[Target]) -> list[Run]:
    a = ctx.args
    cells = [(proto, c) for proto in a.protocols for c in a.clients]
    n = len(targets)
    total = len(cells) * a.rounds * n
    runs: list[Run] = []
    k = 0
    for ci, (proto, clients) in enumerate(cells):
        for r in range(a.rounds):
            for i in range(n):
                t = targets[(r + i) % n]
                k += 1
                run = Run(ci, r, i, proto, clients, t.name, a.duration)
                if t.broken:
                    run.error = f"not run: {t.broken}"
                else:
                    run_pgbench(ctx, t, proto, clients, a.duration, run)
                    if "timed out" in run.error or "exited during the run" in run.error \
                            or (t.kind in ("pgmemo", "pgbouncer") and t.pid is None):
                        t.broken = f"an earlier run failed: {run.error[:160]}"
                        warn(f"{t.name}: {t.broken}; its remaining runs are skipped (FAIL)")
                runs.append(run)
                status = f"{run.tps:,.0f} tps" if run.tps is not None else "-"
                cpu = f", {run.proxy_cpu_us_per_tx:.1f} us/tx" if run.proxy_cpu_us_per_tx is not None else ""
                flag = "" if run.ok else f"  FAIL: {run.error}"
                if not t.broken:
                    log(f"[{k}/{total}] {proto:8s} c={clients:<3d} round {r + 1} {t.name:10s} {status}{cpu}{flag}")
    return runs


def memory_test(ctx: Ctx, targets: list[Target]) -> list[dict]:
    rows = []
    for t in targets:
        if t.kind not in ("pgmemo", "pgbouncer") or t.broken:
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
                    run_pgbench(ctx, t, "simple", 4, 1, Run(-1, -1, -1, "simple", 4, t.name, 1))
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
    nfail: int = 0

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
        c = cells.setdefault((r.protocol, r.clients, r.target), Cell([]))
        c.runs.append(r)
        if r.ok:
            c.ok_tps.append(r.tps)
            if r.proxy_cpu_us_per_tx is not None:
                c.cpu.append(r.proxy_cpu_us_per_tx)
        else:
            c.nfail += 1
    return cells


def ratio(a: Optional[Cell], b: Optional[Cell]) -> str:
    if a is None or b is None or a.median is None or b.median is None:
        return "—"
    s = f"{a.median / b.median:.2f}"
    return s + "*" if a.nfail or b.nfail else s


def table(args, targets: list[Target], runs: list[Run]) -> tuple[str, list[str]]:
    cells = cells_of(runs)
    names = [t.name for t in targets]
    proxies = [t for t in targets if t.is_proxy]
    hdr = ["protocol", "clients"] + [f"{n} TPS" for n in names]
    ratios = []
    if "direct" in names:
        ratios += [(p.name, "direct") for p in proxies]
    if "pgmemo" in names and "pgbouncer" in names:
        ratios.append(("pgmemo", "pgbouncer"))
    for p in proxies:
        if p.kind == "external" and "pgmemo" in names:
            ratios.append(("pgmemo", p.name))
    hdr += [f"{a}/{b}" for a, b in ratios]
    hdr += [f"{p.name} µs CPU/tx" for p in proxies]
    lines = ["| " + " | ".join(hdr) + " |",
             "|" + "|".join(["---", "---:"] + ["---:"] * (len(hdr) - 2)) + "|"]
    notes = []
    for proto in args.protocols:
        for c in args.clients:
            row = [proto, str(c)]
            row += [cells[(proto, c, n)].tps_text() if (proto, c, n) in cells else "MISSING" for n in names]
            row += [ratio(cells.get((proto, c, a)), cells.get((proto, c, b))) for a, b in ratios]
            for p in proxies:
                cell = cells.get((proto, c, p.name))
                row.append(fmt_range(cell.cpu, lambda x: f"{x:.1f}") if cell and p.kind != "external" else "")
            lines.append("| " + " | ".join(row) + " |")
            for n in names:
                cell = cells.get((proto, c, n))
                if cell and cell.nfail:
                    errs = sorted({r.error for r in cell.runs if not r.ok})
                    notes.append(f"- **{n}**, {proto}, {c} clients: {cell.nfail}/{len(cell.runs)} runs failed: "
                                 + " | ".join(errs))
    return "\n".join(lines), notes


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
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib not installed (pip install -r bench/requirements.txt): plot skipped"
    cells = cells_of(runs)
    groups = [(p, c) for p in args.protocols for c in args.clients]
    names = [t.name for t in targets]
    width = 0.8 / len(names)
    fig, ax = plt.subplots(figsize=(max(6, 1.4 * len(groups) * max(1, len(names) / 3) + 2), 4.8))
    ymax = max([max(c.ok_tps) for c in cells.values() if c.ok_tps] or [1])
    for i, n in enumerate(names):
        xs, hs, lo, hi, fails = [], [], [], [], []
        for g, (p, c) in enumerate(groups):
            cell = cells.get((p, c, n))
            x = g + (i - (len(names) - 1) / 2) * width
            if cell is None or not cell.ok_tps:
                fails.append((x, "FAIL"))
                continue
            m = cell.median
            xs.append(x); hs.append(m)
            lo.append(m - min(cell.ok_tps)); hi.append(max(cell.ok_tps) - m)
            if cell.nfail:
                fails.append((x, f"FAIL {cell.nfail}/{len(cell.runs)}"))
        bars = ax.bar(xs, hs, width, label=n, yerr=[lo, hi] if args.rounds > 1 else None, capsize=2)
        color = bars.patches[0].get_facecolor() if bars.patches else None
        for x, label in fails:
            ax.text(x, ymax * 0.02, label, rotation=90, ha="center", va="bottom", fontsize=7,
                    color="red", fontweight="bold")
            if color is not None:
                ax.bar([x], [0], width, color=color)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels([f"{p}\n{c} client{'s' if c != 1 else ''}" for p, c in groups], fontsize=8)
    ax.set_ylabel("TPS (median; whiskers min–max over rounds)")
    ax.set_title(f"pgbench -S, {args.duration} s runs, {args.rounds} round(s), pool size {args.pool_size}")
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


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

    if not args.no_pgbouncer:
        ctx.pgbouncer = PgBouncer(ctx, ensure_pgbouncer())
        log(f"PgBouncer: {ctx.pgbouncer.version_line} ({ctx.pgbouncer.binary})")
        if ctx.pgbouncer.version < (1, 21):
            log("PgBouncer < 1.21 has no prepared statements in transaction mode: "
                "its -M prepared cells are expected to FAIL (they are run and reported)")
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

    need_fds = max(args.idle_clients or [0]) + 1024
    lim = raise_nofile(need_fds)
    if lim < need_fds:
        warn(f"RLIMIT_NOFILE is {lim}: the idle-client test may fail above ~{lim - 1024} clients")

    n_targets = 1 + (not args.no_pgmemo) + (not args.no_pgbouncer) + len(args.target)
    n_runs = len(args.protocols) * len(args.clients) * args.rounds * n_targets
    est = n_runs * (args.duration + 0.3) + 10 + n_targets * args.warmup \
        + sum(3 + n / 1500 for n in args.idle_clients) * (n_targets - 1 - len(args.target))
    log(f"{n_runs} pgbench runs of {args.duration} s ({len(args.protocols)} protocols x "
        f"{len(args.clients)} client counts x {args.rounds} rounds x {n_targets} targets); "
        f"estimated {est / 60:.1f} min")

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
    write_csv(ctx.outdir / "memory.csv", mem_rows)
    tbl, notes = table(args, targets, runs)
    plot_err = plot(ctx.outdir / "tps.png", args, targets, runs)
    versions = {"postgres": ctx.pg_version, "pgbench": version_of([ctx.pgbench, "--version"])}
    if not args.no_pgbouncer:
        versions["pgbouncer"] = ctx.pgbouncer.version_line
    if not args.no_pgmemo:
        versions["pgmemo"] = f"{ctx.pgmemo.version_line}, git {git_rev()}"
    cmd = "python3 bench/run.py" + ("" if len(sys.argv) < 2 else " " + shlex.join(sys.argv[1:]))
    meta = {"date": stamp, "command": cmd, "machine": info, "versions": versions,
            "args": vars(args), "ports": {t.name: t.port for t in targets} | {"postgres": ctx.pg.port},
            "matrix_seconds": round(matrix_s, 1), "total_seconds": round(total_s, 1),
            "rss_after_runs_kib": rss_after_runs,
            "pgmemo_argv": getattr(getattr(ctx, "pgmemo", None), "argv", None)}
    (ctx.outdir / "meta.json").write_text(json.dumps(meta, indent=2, default=str))

    head = [f"## pgmemo benchmark {dt.datetime.now().strftime('%Y-%m-%d %H:%M')}",
            "",
            f"`{cmd}`",
            "",
            f"Machine: {info.get('cpu', '?')}, {info['cores']} cores, {info.get('memory_gib', '?')} GiB, "
            f"Linux {info['kernel']}; load average {info['loadavg_start']:.2f} at start, "
            f"{info['loadavg_end']:.2f} at end.",
            "Versions: " + "; ".join(f"{k}: {v}" for k, v in versions.items()) + ".",
            f"Workload: `pgbench -S -n -j 2 -c C -T {args.duration} -M P`, scale {args.scale}, "
            f"{args.rounds} round(s) per cell, targets interleaved in rotating order; "
            f"pool size {args.pool_size}, transaction mode. TPS excludes connection time; "
            "cells show median (min–max over rounds); `FAIL(k/n)`: k of n runs failed "
            "(non-zero exit, aborted clients or failed transactions), the median is over the others; "
            "ratios of medians, `*` when a side had failures; µs CPU/tx = proxy utime+stime / transactions.",
            ""]
    body = head + [tbl, ""]
    if notes:
        body += ["Failures:", ""] + notes + [""]
    if mem_rows:
        body += ["Memory per idle client (RSS of a freshly started, warmed-up proxy before and after "
                 "opening N idle logged-in client connections):", "", memory_table(mem_rows), ""]
    if rss_after_runs:
        body += ["RSS after the TPS runs: " + ", ".join(f"{k} {v / 1024:.1f} MiB" for k, v in rss_after_runs.items()), ""]
    files = [f for f in ("runs.csv", "memory.csv", "tps.png", "summary.md", "meta.json")
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
