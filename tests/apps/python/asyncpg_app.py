#!/usr/bin/env python3
"""An asyncpg app (tests/framework_apps.rs) as asyncpg apps are written: a connection per
worker, every request in `async with conn.transaction()`, one-row reads with `fetchrow` and
`fetchval` (an Execute with a row limit of 1), lists with `fetch`, writes with `execute`;
asyncpg prepares every statement (named, in its statement cache). See workload.py for the
requests and the transcript.

Usage: asyncpg_app.py asyncpg URL SEED THREADS REQUESTS
URL: postgresql://user:password@host:port/db
"""

import asyncio
import sys

import asyncpg

import workload


def rows(records):
    return [tuple(r) for r in records]


async def read_user(c, tr, n, uid):
    row = await c.fetchrow("SELECT name, karma FROM users WHERE id = $1", uid)
    tr.log(n, "user", tuple(row) if row is not None else None)


async def read_posts(c, tr, n, uid):
    q = "SELECT title, likes FROM posts WHERE user_id = $1 ORDER BY title"
    tr.log(n, "posts", rows(await c.fetch(q, uid)))


async def read_page(c, tr, n, uid):
    tr.log(n, "categories", rows(await c.fetch("SELECT id, name FROM categories ORDER BY id")))
    await read_user(c, tr, n, uid)
    await read_posts(c, tr, n, uid)
    q = (
        "SELECT p.title, c.name FROM posts p JOIN categories c ON p.category_id = c.id "
        "WHERE p.user_id = $1 ORDER BY p.title"
    )
    tr.log(n, "posts with categories", rows(await c.fetch(q, uid)))
    count = await c.fetchval("SELECT count(*) FROM posts WHERE user_id = $1", uid)
    tr.log(n, "post count", count)
    # The first post's title, as a "latest item" widget reads one row.
    first = await c.fetchval(
        "SELECT title FROM posts WHERE user_id = $1 ORDER BY title LIMIT 1", uid
    )
    tr.log(n, "first post", first)


async def run_requests(url, t, ops, tr):
    c = await asyncpg.connect(url)
    try:
        for n, kind, uid, what in ops:
            if kind == "read":
                async with c.transaction():
                    await read_page(c, tr, n, uid)
            elif kind == "write":
                async with c.transaction():
                    await read_user(c, tr, n, uid)
                    if what == "insert":
                        await c.execute(
                            "INSERT INTO posts (user_id, category_id, title, likes) "
                            "VALUES ($1, $2, $3, 0)",
                            uid,
                            n % 5 + 1,
                            f"u{uid}-t{t}-n{n}",
                        )
                    elif what == "like":
                        post = await c.fetchval(
                            "SELECT id FROM posts WHERE user_id = $1 ORDER BY title LIMIT 1",
                            uid,
                        )
                        await c.execute("UPDATE posts SET likes = likes + 1 WHERE id = $1", post)
                    else:
                        await c.execute("UPDATE users SET karma = karma + 1 WHERE id = $1", uid)
                    # Read-your-writes inside the block.
                    await read_user(c, tr, n, uid)
                    await read_posts(c, tr, n, uid)
            else:
                try:
                    async with c.transaction():
                        await c.execute(
                            "UPDATE users SET karma = karma + 1000 WHERE id = $1", uid
                        )
                        await c.execute(
                            "INSERT INTO posts (user_id, category_id, title, likes) "
                            "VALUES ($1, 1, $2, -1)",
                            uid,
                            f"u{uid}-rolled-back-n{n}",
                        )
                        await read_user(c, tr, n, uid)
                        await read_posts(c, tr, n, uid)
                        raise workload.Rolled()
                except workload.Rolled:
                    pass
                # After the rollback: none of it.
                async with c.transaction():
                    await read_user(c, tr, n, uid)
                    await read_posts(c, tr, n, uid)
    finally:
        await c.close()


async def read_all(url, tr):
    c = await asyncpg.connect(url)
    try:
        async with c.transaction():
            tr.log(0, "all users", rows(await c.fetch("SELECT id, name, karma FROM users ORDER BY id")))
            q = "SELECT user_id, title, likes, category_id FROM posts ORDER BY title"
            tr.log(0, "all posts", rows(await c.fetch(q)))
    finally:
        await c.close()


def main():
    _driver, url, seed, threads, requests = sys.argv[1:6]

    def run_thread(t, ops, tr):
        asyncio.run(run_requests(url, t, ops, tr))

    def final(tr):
        asyncio.run(read_all(url, tr))

    workload.run_threads(int(seed), int(threads), int(requests), run_thread, final)


if __name__ == "__main__":
    main()
