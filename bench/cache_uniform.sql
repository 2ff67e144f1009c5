-- Result cache, uniform keys, for pgbench (bench/run.py, workload cache-uniform):
--   pgbench -n -f bench/cache_uniform.sql -s SCALE -M simple ...
-- The same cached point select as bench/cache_hot.sql, but the account drawn
-- uniformly over 100,000 * SCALE accounts: few repeats, so a low hit ratio, and
-- pgmemo --cache mostly pays its miss path (key, lookup, storing the reply)
-- against the same run without the cache (pgmemo+cache / pgmemo).
-- -s SCALE must be given: for a custom script :scale is 1 otherwise.
\set aid random(1, 100000 * :scale)
/* pgmemo cache ttl=60s */ SELECT abalance FROM pgbench_accounts WHERE aid = :aid;
