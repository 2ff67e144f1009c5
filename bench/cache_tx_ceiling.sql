-- bench/cache_tx.sql without its read-back check, for measuring the web-request workload
-- against the ceiling (bench/ceiling.c), whose canned row has no `got` column to check:
--   pgbench -n -j 2 -c C -T 8 -M simple -f bench/cache_tx_ceiling.sql -s 10 ...
-- run against PostgreSQL directly, pgmemo --cache and the ceiling in turn (see
-- docs/benchmarks.md, "A web request in a transaction block"). The same messages as
-- cache_tx.sql: BEGIN, three hinted zipfian point reads, in 10% of requests an UPDATE of a
-- teller and a hinted read of it, COMMIT.
\set r random(1, 100)
\set a1 random_zipfian(1, 100000, 1.1)
\set a2 random_zipfian(1, 100000, 1.1)
\set a3 random_zipfian(1, 100000, 1.1)
BEGIN;
/* pgmemo cache ttl=60s */ SELECT abalance FROM pgbench_accounts WHERE aid = :a1;
/* pgmemo cache ttl=60s */ SELECT abalance FROM pgbench_accounts WHERE aid = :a2;
/* pgmemo cache ttl=60s */ SELECT abalance FROM pgbench_accounts WHERE aid = :a3;
\if :r > 90
\set tid random(1, 10 * :scale)
\set v random(1, 1000000)
UPDATE pgbench_tellers SET tbalance = :v WHERE tid = :tid;
/* pgmemo cache ttl=60s */ SELECT tbalance AS got FROM pgbench_tellers WHERE tid = :tid;
\endif
COMMIT;
