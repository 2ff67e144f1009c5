#!/usr/bin/env python3
"""A SQLAlchemy 2 ORM app (tests/framework_apps.rs) in SQLAlchemy's default transaction
handling: a Session per request, its first statement opening a transaction implicitly (the
DBAPI's BEGIN), reads, then commit (writes), rollback (a failed request) or close (a read-only
request: SQLAlchemy rolls back). See workload.py for the requests and the transcript.

Usage: sqlalchemy_app.py psycopg2|psycopg URL SEED THREADS REQUESTS
URL: postgresql://user:password@host:port/db
"""

import sys

from sqlalchemy import ForeignKey, create_engine, func, select
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

import workload


class Base(DeclarativeBase):
    pass


class Category(Base):
    __tablename__ = "categories"
    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str]


class User(Base):
    __tablename__ = "users"
    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str]
    karma: Mapped[int]


class Post(Base):
    __tablename__ = "posts"
    id: Mapped[int] = mapped_column(primary_key=True)
    user_id: Mapped[int] = mapped_column(ForeignKey("users.id"))
    category_id: Mapped[int] = mapped_column(ForeignKey("categories.id"))
    title: Mapped[str]
    likes: Mapped[int]


def rows(result):
    return [tuple(r) for r in result]


def read_user(s, tr, n, uid):
    tr.log(n, "user", rows(s.execute(select(User.name, User.karma).where(User.id == uid))))


def read_posts(s, tr, n, uid):
    q = select(Post.title, Post.likes).where(Post.user_id == uid).order_by(Post.title)
    tr.log(n, "posts", rows(s.execute(q)))


def read_page(s, tr, n, uid):
    tr.log(n, "categories", rows(s.execute(select(Category.id, Category.name).order_by(Category.id))))
    read_user(s, tr, n, uid)
    read_posts(s, tr, n, uid)
    q = (
        select(Post.title, Category.name)
        .join(Category, Post.category_id == Category.id)
        .where(Post.user_id == uid)
        .order_by(Post.title)
    )
    tr.log(n, "posts with categories", rows(s.execute(q)))
    tr.log(n, "post count", s.scalar(select(func.count()).select_from(Post).where(Post.user_id == uid)))


def main():
    driver, url, seed, threads, requests = sys.argv[1:6]
    url = url.replace("postgresql://", f"postgresql+{driver}://", 1)
    threads = int(threads)
    engine = create_engine(url, pool_size=threads, max_overflow=0)

    def run_thread(t, ops, tr):
        for n, kind, uid, what in ops:
            if kind == "read":
                with Session(engine) as s:
                    read_page(s, tr, n, uid)
            elif kind == "write":
                with Session(engine) as s:
                    read_user(s, tr, n, uid)
                    if what == "insert":
                        s.add(Post(user_id=uid, category_id=n % 5 + 1, title=f"u{uid}-t{t}-n{n}", likes=0))
                    elif what == "like":
                        post = s.scalars(select(Post).where(Post.user_id == uid).order_by(Post.title).limit(1)).one()
                        post.likes += 1
                    else:
                        s.get(User, uid).karma += 1
                    # Autoflush sends the write before these reads: read-your-writes inside.
                    read_user(s, tr, n, uid)
                    read_posts(s, tr, n, uid)
                    s.commit()
            else:
                with Session(engine) as s:
                    s.get(User, uid).karma += 1000
                    s.add(Post(user_id=uid, category_id=1, title=f"u{uid}-rolled-back-n{n}", likes=-1))
                    read_user(s, tr, n, uid)
                    read_posts(s, tr, n, uid)
                    s.rollback()
                # After the rollback: none of it.
                with Session(engine) as s:
                    read_user(s, tr, n, uid)
                    read_posts(s, tr, n, uid)

    def final(tr):
        with Session(engine) as s:
            tr.log(0, "all users", rows(s.execute(select(User.id, User.name, User.karma).order_by(User.id))))
            q = select(Post.user_id, Post.title, Post.likes, Post.category_id).order_by(Post.title)
            tr.log(0, "all posts", rows(s.execute(q)))

    workload.run_threads(int(seed), threads, int(requests), run_thread, final)


if __name__ == "__main__":
    main()
