-- Result cache, hot keys, for pgbench (bench/run.py, workload cache-hot):
--   pgbench -n -f bench/cache_hot.sql -s SCALE -M simple ...
-- on pgbench's standard tables (pgbench -i). One point select per transaction,
-- the account drawn Zipf-distributed (s = 1.1) over the first 100,000 accounts, so
-- that a few keys take most reads. The leading hint makes pgmemo --cache answer
-- it from memory after the first time (60 s TTL, or until a write through pgmemo
-- to pgbench_accounts); for every other target it is just a comment. Simple
-- and extended protocol (workload cache-hot-extended: the hint is in the statement).
-- -s SCALE must be given: for a custom script :scale is 1 otherwise.
\set aid random_zipfian(1, 100000, 1.1)
/* pgmemo cache ttl=60s */ SELECT abalance FROM pgbench_accounts WHERE aid = :aid;
