-- Result cache, a web request in a transaction block, for pgbench (bench/run.py, workload
-- cache-tx): what an ORM session sends (SQLAlchemy, Django's ATOMIC_REQUESTS, Rails'
-- transaction do):
--   pgbench -n -f bench/cache_tx.sql -s SCALE -M simple ...
-- BEGIN; three hinted point selects of pgbench_accounts (aid random_zipfian(1, 100000, 1.1));
-- in 10 % of the requests a write in the block: an UPDATE of a teller to a random value, then a
-- hinted read of it in the same block, which must return the value just written (the block
-- holds the row's lock, so no other client can change it: a stale read is pgmemo's); a stale
-- read runs SELECT 1/0, which aborts the client (a FAIL in bench/run.py); COMMIT.
-- -s SCALE must be given: for a custom script :scale is 1 otherwise.
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
/* pgmemo cache ttl=60s */ SELECT tbalance AS got FROM pgbench_tellers WHERE tid = :tid \gset
\if :got != :v
SELECT 1/0;
\endif
\endif
COMMIT;
