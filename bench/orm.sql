-- ORM-like mix for pgbench (bench/run.py, workload orm-<protocol>):
--   pgbench -n -f bench/orm.sql -s SCALE -M simple ...
-- on pgbench's standard tables (pgbench -i). Each statement is its own
-- autocommit transaction (no BEGIN), as an ORM issues them outside a transaction
-- block; with -M simple every value is a literal in the query text.
-- -s SCALE must be given: for a custom script :scale is 1 otherwise.
\set aid random(1, 100000 * :scale)
\set aid2 random(1, 100000 * :scale)
\set aid3 random(1, 100000 * :scale)
\set bid random(1, 1 * :scale)
\set tid random(1, 10 * :scale)
\set delta random(-5000, 5000)
SELECT aid, bid, abalance, filler FROM pgbench_accounts WHERE aid = :aid;
SELECT a.aid, a.abalance, b.bid, b.bbalance FROM pgbench_accounts a JOIN pgbench_branches b ON b.bid = a.bid WHERE a.aid IN (:aid, :aid2, :aid3) ORDER BY a.aid;
UPDATE pgbench_accounts SET abalance = abalance + :delta WHERE aid = :aid;
INSERT INTO pgbench_history (tid, bid, aid, delta, mtime, filler) VALUES (:tid, :bid, :aid, :delta, '2026-01-01 12:00:00', 'orm');
