-- Result cache, 90 % reads / 10 % writes, for pgbench (bench/run.py, workload cache-rw):
--   pgbench -n -f bench/cache_rw.sql -s SCALE -M simple ...
-- 90 % of the transactions: the hot cached point select of bench/cache_hot.sql.
-- 10 %: a read-your-writes check on the client's own row (aid = client_id + 1, no
-- other client writes it): an autocommit UPDATE to a random value, then a cached
-- select of that row, which must return the value just written. A stale read (a
-- reply from the cache that the UPDATE should have invalidated) runs SELECT 1/0:
-- the client aborts and pgbench fails, which bench/run.py reports as FAIL.
-- -s SCALE must be given: for a custom script :scale is 1 otherwise.
\set r random(1, 100)
\if :r <= 90
\set aid random_zipfian(1, 100000, 1.1)
/* pgmemo cache ttl=60s */ SELECT abalance FROM pgbench_accounts WHERE aid = :aid;
\else
\set mine :client_id + 1
\set v random(1, 1000000)
UPDATE pgbench_accounts SET abalance = :v WHERE aid = :mine;
/* pgmemo cache ttl=60s */ SELECT abalance AS got FROM pgbench_accounts WHERE aid = :mine \gset
\if :got != :v
SELECT 1/0;
\endif
\endif
