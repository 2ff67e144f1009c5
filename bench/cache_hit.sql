-- Result cache, hits only, for bench/profile.sh and the instruction budget (bench/budget.toml):
--   pgbench -n -f bench/cache_hit.sql -s SCALE -M simple ...   (pgmemo --cache)
-- The cached point select of bench/cache_hot.sql over 100 accounts only, drawn uniformly: after
-- profile.sh's two warm-up runs (at least 1,000 transactions each) every key is in the cache,
-- so each transaction measured is a hit (the odds that one of the 100 keys was never drawn in
-- 1,000 draws are about 1 in 230; with bench/budget.py's fixed seed the draws are the same
-- every run). -s SCALE must be given: for a custom script :scale is 1 otherwise.
\set aid random(1, 100)
/* pgmemo cache ttl=600s */ SELECT abalance FROM pgbench_accounts WHERE aid = :aid;
