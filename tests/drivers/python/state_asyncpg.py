#!/usr/bin/env python3
"""asyncpg's LISTEN/NOTIFY through pgmemo in transaction mode.

Usage: state_asyncpg.py URL

One connection listens with add_listener; another sends a notification, then the listener
notifies itself. asyncpg hands the callback the notifying process ID, which for the
listener's own NOTIFY must be its own get_server_pid() (the BackendKeyData process ID).
Both connections also run queries in between, each in its own transaction. Prints
"MISMATCH: ..." / "ERROR: ..." lines for problems and "OK ..." with exit code 0 when every
check passed; exits 1 otherwise.
"""

import asyncio
import sys

import asyncpg

PROBLEMS = []
CHECKED = [0]


def check(got, want, what):
    CHECKED[0] += 1
    if got != want:
        PROBLEMS.append(f"MISMATCH: {what}: expected {want!r}, got {got!r}")


async def main(url):
    listener = await asyncpg.connect(url)
    other = await asyncpg.connect(url)
    received = asyncio.Queue()

    def on_notify(conn, pid, channel, payload):
        received.put_nowait((pid, channel, payload))

    await listener.add_listener("asyncpg_jobs", on_notify)
    for i in range(3):
        check(await listener.fetchval("SELECT $1::int + 1", i), i + 1, f"listener query {i}")
        check(await other.fetchval("SELECT $1::int * 2", i), i * 2, f"other query {i}")
    await other.execute("NOTIFY asyncpg_jobs, 'from other'")
    pid, channel, payload = await asyncio.wait_for(received.get(), 10)
    check((channel, payload), ("asyncpg_jobs", "from other"), "other's notification")
    check(pid != listener.get_server_pid(), True, "other's notification is not the listener's")
    await listener.execute("SELECT pg_notify('asyncpg_jobs', 'own')")
    pid, channel, payload = await asyncio.wait_for(received.get(), 10)
    check(payload, "own", "own notification")
    check(pid, listener.get_server_pid(), "own notification's process ID")
    await listener.remove_listener("asyncpg_jobs", on_notify)
    check(await listener.fetchval("SELECT count(*) FROM pg_listening_channels()"), 0, "unlistened")
    await listener.close()
    await other.close()


if __name__ == "__main__":
    try:
        asyncio.run(main(sys.argv[1]))
    except Exception as e:  # noqa: BLE001 - every failure is reported
        PROBLEMS.append(f"ERROR: {type(e).__name__}: {e}")
    for p in PROBLEMS:
        print(p)
    if PROBLEMS:
        sys.exit(1)
    print(f"OK asyncpg listen: {CHECKED[0]} checks")
