#!/usr/bin/env python3
"""The hit ratio no correct cache can pass on bench/cache_rw.sql.

Replays the workload's key sequence against an ideal cache: invalidation is instant and
exact (a write drops only its own row's entries), memory is unbounded and every miss is
stored. What is left are the misses correctness forces:
  - the read-back after each UPDATE (10 % of the transactions) must go to the server;
  - the next hot select of a row just written must too, and the rows written are
    `aid = client_id + 1`, the hottest keys of random_zipfian(1, 100000, 1.1);
  - the first read of each key (the Zipf tail is long).
pgmemo's measured ratio is compared with this in docs/benchmarks.md.

    python3 bench/cache_rw_ceiling.py --clients 8 --tx 526000 [--warm-rounds 2]

--tx is the transactions of one measured round (TPS x duration); the rounds before it
(the warm-up and earlier rounds of bench/run.py) are replayed first, counted out.
"""
import argparse
import bisect
import itertools
import random


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, required=True)
    p.add_argument("--tx", type=int, required=True, help="transactions in the measured round")
    p.add_argument("--warm-rounds", type=int, default=2, help="rounds replayed before it")
    p.add_argument("--seed", type=int, default=1)
    a = p.parse_args()

    n = 100_000
    # pgbench's random_zipfian with s > 1 draws from the exact Zipf distribution on 1..n.
    cumulative = list(itertools.accumulate(k ** -1.1 for k in range(1, n + 1)))
    rng = random.Random(a.seed)
    cached: set[int] = set()
    hits = lookups = 0
    total = (a.warm_rounds + 1) * a.tx
    for i in range(total):
        counted = i >= total - a.tx
        if rng.randint(1, 100) <= 90:
            aid = bisect.bisect_left(cumulative, rng.random() * cumulative[-1]) + 1
            if aid in cached:
                hits += counted
            else:
                cached.add(aid)
        else:
            cached.discard(i % a.clients + 1)  # the UPDATE of the client's own row
        lookups += counted  # the hot select, or the read-back (always a miss)
    print(f"cache-rw, {a.clients} clients, {a.tx} transactions after {a.warm_rounds} "
          f"rounds: ideal hit ratio {hits / lookups:.3f}")


if __name__ == "__main__":
    main()
