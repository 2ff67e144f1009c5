#!/usr/bin/env python3
"""A Django ORM app (tests/framework_apps.rs) with ATOMIC_REQUESTS' behaviour: every request
runs in transaction.atomic() (what ATOMIC_REQUESTS = True wraps each view in), committed when it
returns, rolled back when it raises. Settings are made in the script (settings.configure, no
project); the connection is Django's default one (it sets the session's time zone to UTC when
the server's differs, registers its types, ...). See workload.py for the requests and the
transcript.

Usage: django_app.py psycopg2|psycopg URL SEED THREADS REQUESTS
URL: postgresql://user:password@host:port/db

Django picks psycopg 3 when it can be imported: for "psycopg2" the script hides it first.
"""

import sys
from urllib.parse import urlparse

driver, url, seed, threads, requests = sys.argv[1:6]
if driver == "psycopg2":
    sys.modules["psycopg"] = None  # Django falls back to psycopg2
u = urlparse(url)

import django  # noqa: E402
from django.conf import settings  # noqa: E402

settings.configure(
    DEBUG=False,
    USE_TZ=True,
    INSTALLED_APPS=[],
    DATABASES={
        "default": {
            "ENGINE": "django.db.backends.postgresql",
            "NAME": u.path.lstrip("/"),
            "USER": u.username,
            "PASSWORD": u.password or "",
            "HOST": u.hostname,
            "PORT": str(u.port),
            "ATOMIC_REQUESTS": True,
        }
    },
)
django.setup()

from django.db import connection, connections, models, transaction  # noqa: E402
from django.db.models import F  # noqa: E402

import workload  # noqa: E402


class Category(models.Model):
    name = models.TextField()

    class Meta:
        app_label = "fw"
        db_table = "categories"
        managed = False


class User(models.Model):
    name = models.TextField()
    karma = models.IntegerField()

    class Meta:
        app_label = "fw"
        db_table = "users"
        managed = False


class Post(models.Model):
    user = models.ForeignKey(User, on_delete=models.CASCADE)
    category = models.ForeignKey(Category, on_delete=models.CASCADE)
    title = models.TextField()
    likes = models.IntegerField()

    class Meta:
        app_label = "fw"
        db_table = "posts"
        managed = False


def read_user(tr, n, uid):
    tr.log(n, "user", list(User.objects.filter(id=uid).values_list("name", "karma")))


def read_posts(tr, n, uid):
    tr.log(n, "posts", list(Post.objects.filter(user_id=uid).order_by("title").values_list("title", "likes")))


def read_page(tr, n, uid):
    tr.log(n, "categories", list(Category.objects.order_by("id").values_list("id", "name")))
    read_user(tr, n, uid)
    read_posts(tr, n, uid)
    q = Post.objects.filter(user_id=uid).select_related("category").order_by("title")
    tr.log(n, "posts with categories", [(p.title, p.category.name) for p in q])
    tr.log(n, "post count", Post.objects.filter(user_id=uid).count())


def request(view, *args):
    """One request as ATOMIC_REQUESTS runs a view: in transaction.atomic()."""
    try:
        with transaction.atomic():
            view(*args)
    except workload.Rolled:
        pass


def run_thread(t, ops, tr):
    try:
        for n, kind, uid, what in ops:
            if kind == "read":
                request(read_page, tr, n, uid)
            elif kind == "write":

                def write():
                    read_user(tr, n, uid)
                    if what == "insert":
                        Post.objects.create(user_id=uid, category_id=n % 5 + 1, title=f"u{uid}-t{t}-n{n}", likes=0)
                    elif what == "like":
                        first = Post.objects.filter(user_id=uid).order_by("title").first()
                        Post.objects.filter(id=first.id).update(likes=F("likes") + 1)
                    else:
                        User.objects.filter(id=uid).update(karma=F("karma") + 1)
                    read_user(tr, n, uid)
                    read_posts(tr, n, uid)

                request(write)
            else:

                def failing():
                    User.objects.filter(id=uid).update(karma=F("karma") + 1000)
                    Post.objects.create(user_id=uid, category_id=1, title=f"u{uid}-rolled-back-n{n}", likes=-1)
                    read_user(tr, n, uid)
                    read_posts(tr, n, uid)
                    raise workload.Rolled()

                request(failing)

                def after():
                    read_user(tr, n, uid)
                    read_posts(tr, n, uid)

                request(after)
    finally:
        connection.close()


def final(tr):
    def view():
        tr.log(0, "all users", list(User.objects.order_by("id").values_list("id", "name", "karma")))
        posts = Post.objects.order_by("title").values_list("user_id", "title", "likes", "category_id")
        tr.log(0, "all posts", list(posts))

    request(view)
    connections.close_all()


workload.run_threads(int(seed), int(threads), int(requests), run_thread, final)
