#!/usr/bin/env python3
"""psycopg2 through pgmemo with autoprepare: every query is a simple-protocol Query with the
values spliced into its text by the driver (client-side interpolation, as Django and SQLAlchemy
send them), so pgmemo generalizes the literals and runs the queries as prepared statements.

Usage: autoprepare_psycopg2.py URL TABLE [CLIENTS] [ITERATIONS]

TABLE must exist as (id int primary key, label text, amount int8) with ids 1..100, label
'item-<id>' and amount id*id, and TABLE_log as (worker int, i int, note text, primary key
(worker, i)), empty. Prints "MISMATCH: ..." for every wrong value, "ERROR: ..." for every
unexpected error, and "OK ..." with exit code 0 when every check passed.
"""

import datetime
import decimal
import sys
import threading

import psycopg2

LOCK = threading.Lock()
PROBLEMS = []
CHECKED = [0]


def check(got, want, what):
    with LOCK:
        CHECKED[0] += 1
        if got != want:
            PROBLEMS.append(f"MISMATCH: {what}: expected {want!r}, got {got!r}")


def one(cur, sql, args=None):
    cur.execute(sql, args)
    return cur.fetchone()


def iteration(conn, table, w, i):
    cur = conn.cursor()
    ident = (w * 7 + i) % 100 + 1
    check(one(cur, f"SELECT label, amount FROM {table} WHERE id = %s", (ident,)),
          (f"item-{ident}", ident * ident), "row by id")
    n = i % 100 + 1
    check(one(cur, f"SELECT count(*), sum(amount)::int8 FROM {table} WHERE id <= %s", (n,)),
          (n, n * (n + 1) * (2 * n + 1) // 6), "count and sum of squares")
    text = f"it's w{w} \\ i{i} é 日本"
    check(one(cur, "SELECT %s || '!', length(%s)", (text, text)), (text + "!", len(text)),
          "strings with quotes, backslashes, non-ASCII")
    check(one(cur, "SELECT %s::int8 * 3, %s + 0.5, %s IS NULL", (3_000_000_000 + i, i, None)),
          (9_000_000_000 + 3 * i, decimal.Decimal(i) + decimal.Decimal("0.5"), True),
          "int8, numeric, NULL")
    day = datetime.date(2024, 1, 1) + datetime.timedelta(days=i)
    check(one(cur, "SELECT %s::date + 1, %s::timestamp", (day, datetime.datetime(2024, 2, 3, 4, 5, 6))),
          (day + datetime.timedelta(days=1), datetime.datetime(2024, 2, 3, 4, 5, 6)), "dates")
    ids = [ident, (ident % 100) + 1, ((ident + 1) % 100) + 1]
    cur.execute(f"SELECT id FROM {table} WHERE id IN %s ORDER BY id", (tuple(ids),))
    check([r[0] for r in cur.fetchall()], sorted(set(ids)), "IN list")
    # A transaction: an insert, its row read back, committed.
    conn.autocommit = False
    cur.execute(f"INSERT INTO {table}_log VALUES (%s, %s, %s)", (w, i, f"note {i}"))
    check(one(cur, f"SELECT note FROM {table}_log WHERE worker = %s AND i = %s", (w, i)),
          (f"note {i}",), "insert read back in its transaction")
    conn.commit()
    conn.autocommit = True
    # An error PostgreSQL reports at the literal, with its position.
    prefix = f"SELECT * FROM {table} WHERE id = "
    try:
        cur.execute(prefix + "%s", ("x",))
        check("no error", "22P02", "invalid input")
    except psycopg2.Error as e:
        # PostgreSQL reports the literal's position (1-based characters).
        check((e.pgcode, e.diag.statement_position), ("22P02", str(len(prefix) + 1)),
              "invalid input error and position")


def worker(url, table, w, iterations):
    try:
        conn = psycopg2.connect(url)
        conn.autocommit = True
        for i in range(iterations):
            iteration(conn, table, w, i)
        cur = conn.cursor()
        check(one(cur, f"SELECT count(*) FROM {table}_log WHERE worker = %s", (w,)),
              (iterations,), "committed inserts")
        conn.close()
    except Exception as e:  # noqa: BLE001 - every failure is reported
        with LOCK:
            PROBLEMS.append(f"ERROR: worker {w}: {type(e).__name__}: {e}")


def main():
    url, table = sys.argv[1], sys.argv[2]
    clients = int(sys.argv[3]) if len(sys.argv) > 3 else 8
    iterations = int(sys.argv[4]) if len(sys.argv) > 4 else 40
    threads = [threading.Thread(target=worker, args=(url, table, w, iterations)) for w in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for p in PROBLEMS[:50]:
        print(p)
    if PROBLEMS:
        sys.exit(1)
    print(f"OK {CHECKED[0]} values checked, {clients} clients")


if __name__ == "__main__":
    main()
