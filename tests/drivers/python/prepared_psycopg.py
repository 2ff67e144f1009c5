#!/usr/bin/env python3
"""psycopg 3 through pgmemo in transaction mode, with server-side prepared statements.

Usage: prepared_psycopg.py URL TABLE THRESHOLD [CLIENTS] [ITERATIONS] [discard]

THRESHOLD is psycopg's prepare_threshold: "0" prepares every statement on its first
execution, "default" keeps psycopg's default (5 executions, then prepared). psycopg names its
statements _pg3_0, _pg3_1, ... per connection, so different clients use the same names for
different queries: without pgmemo's prepared-statement support they collide on a shared
server connection. With "discard", every tenth round also runs DISCARD ALL.

TABLE must exist as (id int primary key, label text, amount int8) with ids 1..100,
label 'item-<id>' and amount id*id; TABLE_log as (worker int, i int, note text,
primary key (worker, i)) and TABLE_batch as (worker int, i int, j int, primary key (worker,
i, j)), both empty. Each round also runs a pipeline (several statements, one Sync) and an
executemany. Prints "MISMATCH: ..." for every wrong value,
"ERROR: ..." for every unexpected error, and "OK ..." with exit code 0 when every check
passed; exits 1 otherwise.
"""

import sys
import threading

import psycopg

MAX_ERRORS = 5  # per worker, so that a run without prepared-statement support ends quickly

LOCK = threading.Lock()
PROBLEMS = []
CHECKED = [0]


def check(got, want, what):
    with LOCK:
        CHECKED[0] += 1
        if got != want:
            PROBLEMS.append(f"MISMATCH: {what}: expected {want!r}, got {got!r}")


def problem(text):
    with LOCK:
        PROBLEMS.append(text)


def iteration(conn, table, w, i, discard):
    # Several parameter types, a NULL among them.
    label = f"w{w}-i{i}-é"
    row = conn.execute(
        "SELECT %s::int4 * 2 + %s::int4, %s::text || '!', %s::int8, %s::float8 / 4",
        (w, i, label, None, float(i)),
    ).fetchone()
    check(row, (w * 2 + i, label + "!", None, i / 4), "arithmetic, text, null, float")

    # A row by key, and an aggregate.
    ident = (w * 7 + i) % 100 + 1
    row = conn.execute(f"SELECT label, amount FROM {table} WHERE id = %s", (ident,)).fetchone()
    check(row, (f"item-{ident}", ident * ident), "row by id")
    n = i % 100 + 1
    row = conn.execute(f"SELECT count(*), sum(amount)::int8 FROM {table} WHERE id <= %s", (n,)).fetchone()
    check(row, (n, n * (n + 1) * (2 * n + 1) // 6), "count and sum of squares")

    # Eight distinct statements, one per k, used in turn.
    k = i % 8
    row = conn.execute(f"SELECT %s::int4 + {k}", (i,)).fetchone()
    check(row, (i + k,), "distinct statement")

    # Several rows.
    length = i % 5 + 1
    rows = conn.execute("SELECT g, %s::text || g FROM generate_series(1, %s::int4) g", ("r", length)).fetchall()
    check(rows, [(j, f"r{j}") for j in range(1, length + 1)], "series")

    # A pipeline: several statements, one Sync.
    with conn.pipeline():
        cursors = [conn.execute("SELECT %s::int4 * %s::int4 + 1", (i, j)) for j in range(3)]
        by_id = conn.execute(f"SELECT label, amount FROM {table} WHERE id = %s", (ident,))
    for j, cur in enumerate(cursors):
        check(cur.fetchone(), (i * j + 1,), "pipeline value")
    check(by_id.fetchone(), (f"item-{ident}", ident * ident), "row by id in a pipeline")

    # An expected error now and then; the connection goes on.
    if i % 10 == 3:
        code = None
        try:
            conn.execute("SELECT 1 / %s::int4", (0,))
        except psycopg.errors.DivisionByZero as e:
            code = e.sqlstate
        check(code, "22012", "division by zero")

    # With "discard", now and then reset the session; psycopg sees the DISCARD ALL and forgets
    # its prepared statements, the next uses prepare them again. psycopg runs DISCARD ALL
    # through the extended protocol (Parse/Bind/Execute), prepared too with threshold 0.
    if discard and i % 10 == 7:
        conn.execute("DISCARD ALL")

    # A transaction: insert, read back, commit.
    note = f"note {w}/{i}"
    with conn.transaction():
        conn.execute(f"INSERT INTO {table}_log (worker, i, note) VALUES (%s, %s, %s)", (w, i, note))
        row = conn.execute(f"SELECT note FROM {table}_log WHERE worker = %s AND i = %s", (w, i)).fetchone()
        check(row, (note,), "note read back in the transaction")
        row = conn.execute(f"SELECT label, amount FROM {table} WHERE id = %s", (ident,)).fetchone()
        check(row, (f"item-{ident}", ident * ident), "row by id in the transaction")
        with conn.cursor() as cur:
            cur.executemany(
                f"INSERT INTO {table}_batch (worker, i, j) VALUES (%s, %s, %s)", [(w, i, j) for j in range(3)]
            )
        row = conn.execute(f"SELECT count(*) FROM {table}_batch WHERE worker = %s AND i = %s", (w, i)).fetchone()
        check(row, (3,), "rows from executemany in the transaction")


def worker(url, table, threshold, w, iterations, discard):
    kwargs = {"autocommit": True}
    if threshold != "default":
        kwargs["prepare_threshold"] = int(threshold)
    try:
        conn = psycopg.connect(url, **kwargs)
    except Exception as e:
        problem(f"ERROR: worker {w}: connect: {e!r}")
        return
    errors = 0
    committed = 0
    with conn:
        for i in range(iterations):
            try:
                iteration(conn, table, w, i, discard)
                committed += 1
            except Exception as e:
                sqlstate = getattr(e, "sqlstate", None)
                problem(f"ERROR: worker {w} iteration {i}: {sqlstate or ''} {e!r}")
                errors += 1
                if errors >= MAX_ERRORS or conn.closed:
                    return
        try:
            row = conn.execute(f"SELECT count(*) FROM {table}_log WHERE worker = %s", (w,)).fetchone()
            check(row, (committed,), f"worker {w}: rows committed")
        except Exception as e:
            problem(f"ERROR: worker {w}: {e!r}")


def main():
    if len(sys.argv) < 4:
        print("usage: prepared_psycopg.py URL TABLE THRESHOLD [CLIENTS] [ITERATIONS] [discard]", file=sys.stderr)
        sys.exit(2)
    url, table, threshold = sys.argv[1:4]
    clients = int(sys.argv[4]) if len(sys.argv) > 4 else 24
    iterations = int(sys.argv[5]) if len(sys.argv) > 5 else 30
    discard = len(sys.argv) > 6 and sys.argv[6] == "discard"
    threads = [
        threading.Thread(target=worker, args=(url, table, threshold, w, iterations, discard))
        for w in range(clients)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if PROBLEMS:
        for p in PROBLEMS:
            print(p)
        sys.exit(1)
    print(
        f"OK psycopg {psycopg.__version__} (prepare_threshold={threshold}{', DISCARD ALL' if discard else ''}): "
        f"{clients} clients x {iterations} iterations, {CHECKED[0]} values checked"
    )


if __name__ == "__main__":
    main()
