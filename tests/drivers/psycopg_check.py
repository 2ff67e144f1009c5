#!/usr/bin/env python3
"""psycopg 3 through pgmemo: a mix of queries, transactions, server-side parameters, COPY,
server-side cursors and pipelines, every value checked.

Usage: psycopg_check.py URL [transaction|session]

In transaction mode psycopg must not prepare named statements (prepare_threshold=None): a
statement prepared on one server connection is not known on the next one until pgmemo keeps
prepared statements working there. In session mode psycopg's default threshold (5) is kept, so
the loops below run on named prepared statements after their fifth execution.

Prints "psycopg check OK" and exits 0 when every check passed; exits 1 on any mismatch and
with a traceback on any error.
"""

import datetime
import decimal
import os
import sys
import threading

import psycopg

FAILURES = []


def check(actual, expected, what):
    if actual != expected:
        FAILURES.append(f"{what}: expected {expected!r}, got {actual!r}")


def connect(url, mode, **kwargs):
    if mode == "transaction":
        kwargs["prepare_threshold"] = None
    return psycopg.connect(url, **kwargs)


def basics(url, mode, table):
    with connect(url, mode, autocommit=True) as conn:
        conn.execute(f"DROP TABLE IF EXISTS {table}")
        conn.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, name text, amount numeric, at timestamptz)")

        # Server-side parameters of many types, repeatedly (named statements after 5 runs
        # in session mode).
        for i in range(12):
            row = conn.execute(
                "SELECT %s::int + 1, %s::text, %s::numeric * 2, %s::date, %s::bytea, %s::bool, %s::int, %s::int[], %s::jsonb",
                (
                    i,
                    f"héllo {i}",
                    decimal.Decimal("1.25"),
                    datetime.date(2024, 2, 29),
                    bytes(range(256)),
                    i % 2 == 0,
                    None,
                    [i, i + 1],
                    psycopg.types.json.Jsonb({"i": i}),
                ),
            ).fetchone()
            check(row[0], i + 1, "int param")
            check(row[1], f"héllo {i}", "text param")
            check(row[2], decimal.Decimal("2.50"), "numeric param")
            check(row[3], datetime.date(2024, 2, 29), "date param")
            check(bytes(row[4]), bytes(range(256)), "bytea param")
            check(row[5], i % 2 == 0, "bool param")
            check(row[6], None, "null param")
            check(row[7], [i, i + 1], "array param")
            check(row[8], {"i": i}, "jsonb param")

        # Simple-protocol statements, several in one string.
        cur = conn.cursor()
        cur.execute("SELECT 1; SELECT 2")
        check(cur.fetchone(), (1,), "first result of a multi-statement query")
        check(cur.nextset(), True, "a second result set")
        check(cur.fetchone(), (2,), "second result of a multi-statement query")

        # An error, then the connection still works.
        try:
            conn.execute("SELECT 1/0")
            FAILURES.append("division by zero did not fail")
        except psycopg.errors.DivisionByZero:
            pass
        check(conn.execute("SELECT 'after error'").fetchone(), ("after error",), "query after an error")

        # executemany (pipelined by psycopg) and COPY.
        with conn.cursor() as cur:
            cur.executemany(
                f"INSERT INTO {table} (id, name, amount) VALUES (%s, %s, %s)",
                [(i, f"n{i}", decimal.Decimal(i) / 4) for i in range(100)],
            )
        check(
            conn.execute(f"SELECT count(*), sum(amount) FROM {table}").fetchone(),
            (100, decimal.Decimal("1237.50")),
            "executemany",
        )
        with conn.cursor() as cur:
            with cur.copy(f"COPY {table} (id, name) FROM STDIN") as copy:
                for i in range(1000, 1300):
                    copy.write_row((i, f"copied {i}"))
            rows = []
            with cur.copy(f"COPY (SELECT id, name FROM {table} WHERE id >= 1000 ORDER BY id) TO STDOUT") as copy:
                for row in copy.rows():
                    rows.append(row)
        check(rows, [(str(i), f"copied {i}") for i in range(1000, 1300)], "COPY out")

        # A pipeline of several queries with one Sync.
        with conn.pipeline():
            c1 = conn.execute("SELECT %s::int * 2", (21,))
            c2 = conn.execute("SELECT %s::text || 'b'", ("a",))
            c3 = conn.execute(f"SELECT count(*) FROM {table} WHERE id < %s", (50,))
        check(c1.fetchone(), (42,), "pipeline 1")
        check(c2.fetchone(), ("ab",), "pipeline 2")
        check(c3.fetchone(), (50,), "pipeline 3")


def transactions(url, mode, table):
    # autocommit off: psycopg opens a transaction with the first statement.
    with connect(url, mode) as conn:
        with conn.transaction():
            conn.execute(f"INSERT INTO {table} (id, name) VALUES (%s, %s)", (5000, "kept"))
        try:
            with conn.transaction():
                conn.execute(f"INSERT INTO {table} (id, name) VALUES (%s, %s)", (5001, "rolled back"))
                check(
                    conn.execute(f"SELECT count(*) FROM {table} WHERE id = %s", (5001,)).fetchone(),
                    (1,),
                    "own insert visible inside the transaction",
                )
                raise RuntimeError("roll back")
        except RuntimeError:
            pass
        check(
            conn.execute(f"SELECT count(*) FROM {table} WHERE id IN (5000, 5001)").fetchone(),
            (1,),
            "commit kept, rollback discarded",
        )
        conn.commit()

        # An error inside a transaction aborts it until ROLLBACK.
        try:
            conn.execute("SELECT 1/0")
        except psycopg.errors.DivisionByZero:
            pass
        try:
            conn.execute("SELECT 1")
            FAILURES.append("query in an aborted transaction did not fail")
        except psycopg.errors.InFailedSqlTransaction:
            pass
        conn.rollback()
        check(conn.execute("SELECT 7").fetchone(), (7,), "query after rollback")
        conn.rollback()

        # A server-side cursor (DECLARE ... inside the transaction), fetched in batches.
        with conn.transaction():
            with conn.cursor(name="big") as cur:
                cur.itersize = 100
                cur.execute("SELECT g, g * 2 FROM generate_series(1, 1000) g")
                total = 0
                count = 0
                for a, b in cur:
                    check(b, a * 2, "server-side cursor row")
                    total += a
                    count += 1
        check((count, total), (1000, 500500), "server-side cursor")


def worker(url, mode, n, errors):
    try:
        with connect(url, mode, autocommit=True) as conn:
            for i in range(30):
                row = conn.execute("SELECT %s::int * 1000 + %s::int, %s::text", (n, i, f"w{n}-{i}")).fetchone()
                check(row, (n * 1000 + i, f"w{n}-{i}"), f"worker {n} query {i}")
    except Exception as e:  # reported by the main thread
        errors.append(f"worker {n}: {e!r}")


def main():
    url = sys.argv[1]
    mode = sys.argv[2] if len(sys.argv) > 2 else "transaction"
    table = f"drv_psycopg_{mode}_{os.getpid()}"
    basics(url, mode, table)
    transactions(url, mode, table)

    errors = []
    threads = [threading.Thread(target=worker, args=(url, mode, n, errors)) for n in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    FAILURES.extend(errors)

    with connect(url, mode, autocommit=True) as conn:
        conn.execute(f"DROP TABLE {table}")

    if FAILURES:
        for f in FAILURES:
            print("MISMATCH:", f)
        sys.exit(1)
    print(f"psycopg check OK ({mode} mode, psycopg {psycopg.__version__})")


if __name__ == "__main__":
    main()
