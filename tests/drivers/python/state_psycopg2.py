#!/usr/bin/env python3
"""psycopg2 named (server-side) cursors WITH HOLD through pgmemo in transaction mode.

Usage: state_psycopg2.py URL

psycopg2's default: autocommit off, every statement in a transaction that commit() ends. A
named cursor declared withhold=True (DECLARE ... CURSOR WITH HOLD) outlives its transaction:
the client fetches from it across several later transactions, while a second client works in
between. Prints "MISMATCH: ..." / "ERROR: ..." lines for problems and "OK ..." with exit code 0
when every check passed; exits 1 otherwise.
"""

import sys

import psycopg2

PROBLEMS = []
CHECKED = [0]


def check(got, want, what):
    CHECKED[0] += 1
    if got != want:
        PROBLEMS.append(f"MISMATCH: {what}: expected {want!r}, got {got!r}")


def main(url):
    reader = psycopg2.connect(url)
    other = psycopg2.connect(url)
    cur = reader.cursor("held_rows", withhold=True)
    cur.itersize = 4
    cur.execute("SELECT g, 'row ' || g FROM generate_series(1, 12) g ORDER BY g")
    reader.commit()
    seen = []
    for batch in range(4):
        rows = cur.fetchmany(3)
        seen.extend(r[0] for r in rows)
        reader.commit()
        with other.cursor() as o:
            o.execute("SELECT count(*) FROM pg_cursors WHERE name = 'held_rows'")
            check(o.fetchone()[0], 0, f"the other client does not see the cursor (batch {batch})")
        other.commit()
    check(seen, list(range(1, 13)), "rows fetched across transactions")
    cur.close()
    reader.commit()
    with reader.cursor() as c:
        c.execute("SELECT count(*) FROM pg_cursors")
        check(c.fetchone()[0], 0, "cursor closed")
    reader.commit()
    reader.close()
    other.close()


if __name__ == "__main__":
    try:
        main(sys.argv[1])
    except Exception as e:  # noqa: BLE001 - every failure is reported
        PROBLEMS.append(f"ERROR: {type(e).__name__}: {e}")
    for p in PROBLEMS:
        print(p)
    if PROBLEMS:
        sys.exit(1)
    print(f"OK psycopg2 held cursor: {CHECKED[0]} checks")
