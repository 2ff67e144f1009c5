//! Every way of writing that a cache must see, for the result-cache tests: a schema, the
//! cached reads that each write changes, and the writes — each a statement that changes `kv`
//! (or what reads it) in a way that is not a plain `UPDATE`: through EXPLAIN ANALYZE, DO,
//! CALL, MERGE, a writable CTE, an upsert, a rule, a trigger on another table, a read that
//! calls a writing function, a view, a cascade, a materialized view's refresh, a held
//! cursor's FETCH.

/// The schema (run directly as a superuser, then `GRANT`ed to everyone).
pub const SCHEMA: &str = "
    CREATE TABLE kv (k int PRIMARY KEY, v int);
    INSERT INTO kv SELECT g, 0 FROM generate_series(1, 5) g;
    CREATE TABLE log (n int);
    CREATE TABLE tlog (n int);
    CREATE FUNCTION bump(key int) RETURNS int LANGUAGE sql
        AS 'UPDATE kv SET v = v + 1 WHERE k = key RETURNING v';
    CREATE FUNCTION t_bump() RETURNS trigger LANGUAGE plpgsql
        AS $$ BEGIN UPDATE kv SET v = v + 1 WHERE k = 1; RETURN NEW; END $$;
    CREATE TRIGGER t AFTER INSERT ON tlog FOR EACH ROW EXECUTE FUNCTION t_bump();
    CREATE RULE r AS ON INSERT TO log DO ALSO UPDATE kv SET v = v + 1 WHERE k = 1;
    CREATE PROCEDURE p_bump() LANGUAGE sql AS $$ UPDATE kv SET v = v + 1 WHERE k = 1 $$;
    CREATE VIEW kvv AS SELECT * FROM kv;
    CREATE MATERIALIZED VIEW mv AS SELECT sum(v) AS s FROM kv;
    CREATE TABLE parent (id int PRIMARY KEY);
    INSERT INTO parent VALUES (1);
    CREATE TABLE child (id int PRIMARY KEY, p int REFERENCES parent ON UPDATE CASCADE);
    INSERT INTO child VALUES (1, 1);";

/// The reads cached before each write and compared with PostgreSQL's after it.
pub const READS: [&str; 5] = [
    "SELECT v FROM kv WHERE k = 1",
    "SELECT sum(v) FROM kv",
    "SELECT s FROM mv",
    "SELECT p FROM child WHERE id = 1",
    "SELECT count(*) FROM log",
];

/// (what it is, its statements, each a simple query). Each changes what some read reads.
pub const WRITES: &[(&str, &[&str])] = &[
    (
        "EXPLAIN ANALYZE of an UPDATE",
        &["EXPLAIN (ANALYZE, COSTS OFF, TIMING OFF, SUMMARY OFF) UPDATE kv SET v = v + 1 WHERE k = 1"],
    ),
    ("DO", &["DO $$ BEGIN UPDATE kv SET v = v + 1 WHERE k = 1; END $$"]),
    ("CALL", &["CALL p_bump()"]),
    (
        "MERGE",
        &["MERGE INTO kv USING (VALUES (1)) s(k) ON kv.k = s.k WHEN MATCHED THEN UPDATE SET v = kv.v + 1"],
    ),
    (
        "a writable CTE",
        &["WITH x AS (UPDATE kv SET v = v + 1 WHERE k = 1 RETURNING v) SELECT v FROM x"],
    ),
    (
        "an upsert",
        &["INSERT INTO kv VALUES (1, 0) ON CONFLICT (k) DO UPDATE SET v = kv.v + 1"],
    ),
    ("a rule", &["INSERT INTO log VALUES (1)"]),
    ("a trigger on another table", &["INSERT INTO tlog VALUES (1)"]),
    (
        "a read that calls a writing function",
        &["SELECT v FROM kv WHERE k = 2 AND bump(1) > 0"],
    ),
    ("an UPDATE of a view", &["UPDATE kvv SET v = v + 1 WHERE k = 1"]),
    ("ON UPDATE CASCADE", &["UPDATE parent SET id = id + 1"]),
    ("REFRESH MATERIALIZED VIEW", &["REFRESH MATERIALIZED VIEW mv"]),
];
