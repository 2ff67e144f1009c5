"""The request plan and transcript the Python framework apps share (tests/framework_apps.rs).

Each thread owns the users whose id % THREADS is its number and only reads and writes those
(and the never-written categories), so what each read returns depends on nothing but the
thread's own earlier requests: the transcript is the same whichever way the threads
interleave, and the same directly against PostgreSQL and through pgmemo, when both start from
tests/apps/schema.sql.

A request is one of
- ("read", uid): categories, the user, its posts, its posts joined with their categories;
- ("write", uid, kind): reads the user, writes (kind "insert": a new post, "like": likes + 1 on
  its first post, "karma": karma + 1), reads the written rows back in the same transaction
  (read-your-writes inside), commits;
- ("rollback", uid): karma + 1000 and a new post, read back inside the block (they must show),
  then rolled back; the thread's next request reads the user (they must not show).

A thread's transcript has one line per read: "t<thread> n<request> <what>: <rows>".
"""

import random
import sys
import threading

USERS = 40


def plan(seed, threads, requests):
    """Per thread, the list of (n, kind, uid, write_kind) requests."""
    plans = []
    for t in range(threads):
        rng = random.Random(seed * 1000 + t)
        own = [u for u in range(1, USERS + 1) if u % threads == t]
        ops = []
        for n in range(requests):
            # Skewed: a few users get most requests, as a web app's hot rows do.
            uid = own[int(len(own) * rng.random() ** 3)]
            r = rng.random()
            if r < 0.07:
                ops.append((n, "write", uid, rng.choice(["insert", "like", "karma"])))
            elif r < 0.10:
                ops.append((n, "rollback", uid, None))
            else:
                ops.append((n, "read", uid, None))
        plans.append(ops)
    return plans


class Rolled(Exception):
    """Raised inside a request's transaction to roll it back."""


class Transcript:
    def __init__(self, t):
        self.t = t
        self.lines = []

    def log(self, n, what, rows):
        self.lines.append(f"t{self.t} n{n} {what}: {rows!r}")


def run_threads(seed, threads, requests, run_thread, final):
    """Runs run_thread(t, ops, transcript) on THREADS threads, then final(transcript) on this
    one (a read of every row, after every thread's writes committed), and prints the
    transcripts in thread order, then "OK <reads>". Exits 1 on any error."""
    plans = plan(seed, threads, requests)
    transcripts = [Transcript(t) for t in range(threads)]
    errors = []

    def wrap(t):
        try:
            run_thread(t, plans[t], transcripts[t])
        except Exception as e:  # noqa: BLE001 - reported, makes the run fail
            import traceback

            errors.append(f"thread {t}: {e!r}\n{traceback.format_exc()}")

    workers = [threading.Thread(target=wrap, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    if errors:
        print("\n".join(errors), file=sys.stderr)
        sys.exit(1)
    last = Transcript("final")
    final(last)
    reads = 0
    for tr in transcripts + [last]:
        for line in tr.lines:
            print(line)
            reads += 1
    print(f"OK {reads} reads")
