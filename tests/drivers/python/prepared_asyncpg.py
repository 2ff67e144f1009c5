#!/usr/bin/env python3
"""asyncpg through pgmemo in transaction mode, with asyncpg's default statement cache.

Usage: prepared_asyncpg.py URL TABLE [CLIENTS] [ITERATIONS]

asyncpg prepares every query under a name (__asyncpg_stmt_<n>__, numbered per connection) in
one round trip and executes it by name in the next, also keeping it in a cache of 100 for
later use: without pgmemo's prepared-statement support the second round trip lands on a
server connection that does not have it, or has another client's statement of that name.

TABLE must exist as (id int primary key, label text, amount int8) with ids 1..100,
label 'item-<id>' and amount id*id; TABLE_log as (worker int, i int, note text,
primary key (worker, i)) and TABLE_batch as (worker int, i int, j int, primary key (worker,
i, j)), both empty. Each round's transaction also runs an executemany (one prepared
statement, many Bind/Execute, one Sync). Prints "MISMATCH: ..." for every wrong value,
"ERROR: ..." for every unexpected error, and "OK ..." with exit code 0 when every check
passed; exits 1 otherwise.
"""

import asyncio
import sys

import asyncpg

MAX_ERRORS = 5  # per worker, so that a run without prepared-statement support ends quickly

PROBLEMS = []
CHECKED = [0]


def check(got, want, what):
    CHECKED[0] += 1
    if got != want:
        PROBLEMS.append(f"MISMATCH: {what}: expected {want!r}, got {got!r}")


async def iteration(conn, table, w, i):
    # Several parameter types, a NULL among them.
    label = f"w{w}-i{i}-é"
    row = await conn.fetchrow(
        "SELECT $1::int4 * 2 + $2::int4, $3::text || '!', $4::int8, $5::float8 / 4",
        w,
        i,
        label,
        None,
        float(i),
    )
    check(tuple(row), (w * 2 + i, label + "!", None, i / 4), "arithmetic, text, null, float")

    # A row by key, and an aggregate.
    ident = (w * 7 + i) % 100 + 1
    row = await conn.fetchrow(f"SELECT label, amount FROM {table} WHERE id = $1", ident)
    check(tuple(row), (f"item-{ident}", ident * ident), "row by id")
    n = i % 100 + 1
    row = await conn.fetchrow(f"SELECT count(*), sum(amount)::int8 FROM {table} WHERE id <= $1", n)
    check(tuple(row), (n, n * (n + 1) * (2 * n + 1) // 6), "count and sum of squares")

    # Eight distinct statements, one per k, used in turn.
    k = i % 8
    check(await conn.fetchval(f"SELECT $1::int4 + {k}", i), i + k, "distinct statement")

    # Several rows.
    length = i % 5 + 1
    rows = await conn.fetch("SELECT g, $1::text || g FROM generate_series(1, $2::int4) g", "r", length)
    check([tuple(r) for r in rows], [(j, f"r{j}") for j in range(1, length + 1)], "series")

    # An expected error now and then; the connection goes on.
    if i % 10 == 3:
        code = None
        try:
            await conn.fetchval("SELECT 1 / $1::int4", 0)
        except asyncpg.exceptions.DivisionByZeroError as e:
            code = e.sqlstate
        check(code, "22012", "division by zero")

    # A transaction: insert, read back, commit.
    note = f"note {w}/{i}"
    async with conn.transaction():
        await conn.execute(f"INSERT INTO {table}_log (worker, i, note) VALUES ($1, $2, $3)", w, i, note)
        got = await conn.fetchval(f"SELECT note FROM {table}_log WHERE worker = $1 AND i = $2", w, i)
        check(got, note, "note read back in the transaction")
        row = await conn.fetchrow(f"SELECT label, amount FROM {table} WHERE id = $1", ident)
        check(tuple(row), (f"item-{ident}", ident * ident), "row by id in the transaction")
        await conn.executemany(
            f"INSERT INTO {table}_batch (worker, i, j) VALUES ($1, $2, $3)", [(w, i, j) for j in range(3)]
        )
        got = await conn.fetchval(f"SELECT count(*) FROM {table}_batch WHERE worker = $1 AND i = $2", w, i)
        check(got, 3, "rows from executemany in the transaction")


async def worker(url, table, w, iterations):
    try:
        conn = await asyncpg.connect(url)
    except Exception as e:
        PROBLEMS.append(f"ERROR: worker {w}: connect: {e!r}")
        return
    errors = 0
    committed = 0
    try:
        for i in range(iterations):
            try:
                await iteration(conn, table, w, i)
                committed += 1
            except Exception as e:
                sqlstate = getattr(e, "sqlstate", None)
                PROBLEMS.append(f"ERROR: worker {w} iteration {i}: {sqlstate or ''} {e!r}")
                errors += 1
                if errors >= MAX_ERRORS or conn.is_closed():
                    return
        got = await conn.fetchval(f"SELECT count(*) FROM {table}_log WHERE worker = $1", w)
        check(got, committed, f"worker {w}: rows committed")
    except Exception as e:
        PROBLEMS.append(f"ERROR: worker {w}: {e!r}")
    finally:
        conn.terminate()


async def main():
    if len(sys.argv) < 3:
        print("usage: prepared_asyncpg.py URL TABLE [CLIENTS] [ITERATIONS]", file=sys.stderr)
        sys.exit(2)
    url, table = sys.argv[1:3]
    clients = int(sys.argv[3]) if len(sys.argv) > 3 else 24
    iterations = int(sys.argv[4]) if len(sys.argv) > 4 else 30
    try:
        await asyncio.wait_for(
            asyncio.gather(*(worker(url, table, w, iterations) for w in range(clients))),
            timeout=60,
        )
    except asyncio.TimeoutError:
        PROBLEMS.append("ERROR: timed out after 60 s")
    if PROBLEMS:
        for p in PROBLEMS:
            print(p)
        sys.exit(1)
    print(
        f"OK asyncpg {asyncpg.__version__}: {clients} clients x {iterations} iterations, "
        f"{CHECKED[0]} values checked"
    )


if __name__ == "__main__":
    asyncio.run(main())
