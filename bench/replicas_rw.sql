-- bench/replicas.py's request: a write, read back at once (a miss is a read-your-writes
-- violation, recorded), then 9 point reads of other rows. Run with -s SCALE.
\set id random(1, 1000000000)
\set a1 random(1, 100000 * :scale)
\set a2 random(1, 100000 * :scale)
\set a3 random(1, 100000 * :scale)
\set a4 random(1, 100000 * :scale)
\set a5 random(1, 100000 * :scale)
\set a6 random(1, 100000 * :scale)
\set a7 random(1, 100000 * :scale)
\set a8 random(1, 100000 * :scale)
\set a9 random(1, 100000 * :scale)
INSERT INTO rw VALUES (:id, 1) ON CONFLICT (id) DO UPDATE SET v = rw.v + 1;
SELECT count(*) AS seen FROM rw WHERE id = :id \gset
\if :seen = 0
INSERT INTO rw_violations VALUES (:id);
\endif
SELECT abalance FROM pgbench_accounts WHERE aid = :a1;
SELECT abalance FROM pgbench_accounts WHERE aid = :a2;
SELECT abalance FROM pgbench_accounts WHERE aid = :a3;
SELECT abalance FROM pgbench_accounts WHERE aid = :a4;
SELECT abalance FROM pgbench_accounts WHERE aid = :a5;
SELECT abalance FROM pgbench_accounts WHERE aid = :a6;
SELECT abalance FROM pgbench_accounts WHERE aid = :a7;
SELECT abalance FROM pgbench_accounts WHERE aid = :a8;
SELECT abalance FROM pgbench_accounts WHERE aid = :a9;
