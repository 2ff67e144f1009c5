#!/usr/bin/env python3
"""asyncpg prepares statements and reads their descriptions, and executes nothing.

Usage: prepare_only_asyncpg.py [--named] URL SQL...

Connects, prepares each SQL with `Connection.prepare` (asyncpg sends Parse, Describe and Flush,
and waits for the answer) and prints, per statement, one line of JSON: its parameters' type
OIDs and its columns' names and type OIDs. Exits 0 when every prepare succeeded. Without
--named the statement cache is off (statement_cache_size=0, as behind a pooler) and asyncpg
prepares the unnamed statement; with it, named statements `__asyncpg_stmt_N__`.
"""

import asyncio
import json
import sys

import asyncpg


async def main(named, url, sqls):
    conn = await asyncpg.connect(url, statement_cache_size=100 if named else 0)
    try:
        for sql in sqls:
            stmt = await conn.prepare(sql)
            print(json.dumps({
                "params": [t.oid for t in stmt.get_parameters()],
                "columns": [[a.name, a.type.oid] for a in stmt.get_attributes()],
            }))
    finally:
        await conn.close()


if __name__ == "__main__":
    args = sys.argv[1:]
    named = args[:1] == ["--named"]
    if named:
        args = args[1:]
    asyncio.run(main(named, args[0], args[1:]))
