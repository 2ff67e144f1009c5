#!/usr/bin/env python3
"""Open N idle PostgreSQL client connections and hold them.

Used by bench/run.py to measure a pooler's memory per idle client, and usable by
hand:

    python3 bench/idle_clients.py --port 6432 --user bench --database bench -n 1000

Each connection sends a StartupMessage (protocol 3.0) with the user and database,
expects trust authentication (AuthenticationOk; any password request is counted as
a failure), and reads until ReadyForQuery. Then it stays idle.

Once every connection has either logged in or failed, one JSON line is printed on
stdout:

    {"event": "ready", "requested": N, "opened": n, "failed": f, "seconds": s,
     "errors": {"message": count, ...}}

The connections are then held until stdin reaches EOF (the parent closes the pipe),
SIGTERM/SIGINT arrives, or --hold seconds pass; they are closed with Terminate and
the program exits (status 0 if all N opened, 1 otherwise).

Standard library only.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import signal
import struct
import sys
import time


def raise_nofile(needed: int) -> int:
    """Raise RLIMIT_NOFILE so that `needed` descriptors fit; return the soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= needed:
        return soft
    want = needed if hard == resource.RLIM_INFINITY else max(needed, hard)
    try:  # raising the hard limit works as root (CAP_SYS_RESOURCE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, want))
        return want
    except (ValueError, OSError):
        pass
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        return hard
    except (ValueError, OSError):
        return soft


def startup_message(user: str, database: str, appname: str) -> bytes:
    params = b""
    for k, v in (("user", user), ("database", database), ("application_name", appname)):
        params += k.encode() + b"\0" + v.encode() + b"\0"
    params += b"\0"
    body = struct.pack("!i", 196608) + params
    return struct.pack("!i", len(body) + 4) + body


def error_text(payload: bytes) -> str:
    """Readable text of an ErrorResponse payload (fields S, C, M)."""
    fields = {}
    for part in payload.split(b"\0"):
        if part:
            fields[chr(part[0])] = part[1:].decode("utf-8", "replace")
    return " ".join(x for x in (fields.get("S"), fields.get("C"), fields.get("M")) if x)


async def login(host: str, port: int, user: str, database: str, appname: str,
                timeout: float):
    """Open one connection; return (reader, writer) or raise RuntimeError(reason)."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    except asyncio.TimeoutError:
        raise RuntimeError("connect timeout")
    except OSError as e:
        raise RuntimeError(f"connect: {e.strerror or e}")
    try:
        writer.write(startup_message(user, database, appname))
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError("login timeout")
            head = await asyncio.wait_for(reader.readexactly(5), left)
            kind, length = head[:1], struct.unpack("!i", head[1:])[0]
            payload = await asyncio.wait_for(reader.readexactly(length - 4), left)
            if kind == b"R":
                code = struct.unpack("!i", payload[:4])[0]
                if code != 0:
                    raise RuntimeError(f"server asks for authentication (code {code}); trust expected")
            elif kind == b"E":
                raise RuntimeError("ErrorResponse: " + error_text(payload))
            elif kind == b"Z":
                return reader, writer
            # S (ParameterStatus), K (BackendKeyData), N (Notice): ignore
    except asyncio.TimeoutError:
        writer.close()
        raise RuntimeError("login timeout")
    except asyncio.IncompleteReadError:
        writer.close()
        raise RuntimeError("connection closed during login")
    except OSError as e:
        writer.close()
        raise RuntimeError(f"socket: {e.strerror or e}")
    except RuntimeError:
        writer.close()
        raise


async def main_async(args) -> int:
    sem = asyncio.Semaphore(args.concurrency)
    conns = []
    errors: dict[str, int] = {}

    async def one(i: int):
        async with sem:
            try:
                conns.append(await login(args.host, args.port, args.user, args.database,
                                         args.application_name, args.timeout))
            except RuntimeError as e:
                errors[str(e)] = errors.get(str(e), 0) + 1

    t0 = time.monotonic()
    await asyncio.gather(*(one(i) for i in range(args.n)))
    elapsed = time.monotonic() - t0
    nfailed = sum(errors.values())
    print(json.dumps({"event": "ready", "requested": args.n, "opened": len(conns),
                      "failed": nfailed, "seconds": round(elapsed, 3), "errors": errors}),
          flush=True)

    # Hold until stdin EOF, a signal, or --hold seconds.
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):
            pass

    def stdin_watch():
        try:
            while sys.stdin.buffer.read(4096):
                pass
        except (OSError, ValueError):
            pass
        loop.call_soon_threadsafe(stop.set)

    if not args.no_stdin:
        loop.run_in_executor(None, stdin_watch)
    try:
        await asyncio.wait_for(stop.wait(), args.hold if args.hold > 0 else None)
    except asyncio.TimeoutError:
        pass

    # Close politely (Terminate), then go.
    for _, w in conns:
        try:
            w.write(b"X\0\0\0\4")
            w.close()
        except Exception:
            pass
    await asyncio.sleep(0.05)
    if not args.quiet:
        print(json.dumps({"event": "closed", "count": len(conns)}), flush=True)
    return 0 if nfailed == 0 else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-n", "--clients", dest="n", type=int, default=1000)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--user", default=os.environ.get("PGUSER", "bench"))
    p.add_argument("--database", default=os.environ.get("PGDATABASE", "bench"))
    p.add_argument("--application-name", default="pgmemo_idle_clients")
    p.add_argument("--concurrency", type=int, default=64,
                   help="logins in flight at once (keeps the listen backlog from overflowing)")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds per login")
    p.add_argument("--hold", type=float, default=0.0,
                   help="seconds to hold the connections (0: until stdin EOF or a signal)")
    p.add_argument("--no-stdin", action="store_true",
                   help="do not watch stdin for EOF (use with --hold or signals)")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    limit = raise_nofile(args.n + 64)
    if limit < args.n + 64:
        print(f"idle_clients: RLIMIT_NOFILE is {limit}, too low for {args.n} connections",
              file=sys.stderr)
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
