//! The result cache against a real PostgreSQL: hits are byte-identical to PostgreSQL's own
//! replies, writes through pgmemo invalidate (read-your-writes, also under concurrency), what
//! must never be cached is not (the counters prove it), concurrent misses run one query, the
//! store stays within its memory limit, and the admin console shows and flushes it.

mod common;

use common::*;
use pgmemo::config::cache::Rule;
use pgmemo::config::{Config, PoolMode};
use pgmemo::Pgmemo;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

/// pgmemo in `mode` with the cache on and `rules`.
fn cache_config(mode: PoolMode, pool_size: u32, rules: Vec<Rule>) -> Config {
    let mut config = test_config(mode, pool_size);
    config.cache.enabled = true;
    config.cache.rules = rules;
    // Session mode caches statements it shares (see `session_shared_statements`).
    config.general.session_shared_statements = true;
    // Exact counts below: store at the first miss (admit_after = 2 has its own test).
    config.cache.admit_after = 1;
    config
}

fn rule(name: &str, contains: &str) -> Rule {
    cache_rule(name, contains)
}

/// Serves `db` as itself and as `alias`, whose pool logs into the server as `scram_user`:
/// a second pool on the same database, under another role.
fn with_alias(config: &mut Config, db: &str, alias: &str) {
    use pgmemo::config::DatabaseConfig;
    config
        .databases
        .insert(db.into(), DatabaseConfig::default());
    config.databases.insert(
        alias.into(),
        DatabaseConfig {
            dbname: Some(db.into()),
            user: Some(SCRAM_USER.into()),
            password: Some(SCRAM_PASS.into()),
            ..DatabaseConfig::default()
        },
    );
}

async fn raw_proxy(proxy: &Pgmemo, db: &str) -> RawClient {
    RawClient::connect(proxy.local_addr(), PGMEMO_USER, db, Some(PGMEMO_PASS), &[])
        .await
        .expect("login through pgmemo")
}

async fn raw_direct(db: &str) -> RawClient {
    RawClient::connect(cluster().addr(), PGMEMO_USER, db, Some(PGMEMO_PASS), &[])
        .await
        .expect("login to PostgreSQL")
}

/// One simple query's replies, as (tag, body) pairs.
async fn run(c: &mut RawClient, sql: &str) -> Vec<(u8, Vec<u8>)> {
    c.send(&[Frontend::query(sql)]).await.expect("send");
    c.recv_until_ready(1)
        .await
        .expect("replies")
        .into_iter()
        .map(|m| (m.tag, m.body))
        .collect()
}

/// The first column of the first row, as text.
fn first_value(replies: &[(u8, Vec<u8>)]) -> Option<String> {
    replies
        .iter()
        .find(|(t, _)| *t == b'D')
        .and_then(|(_, body)| {
            let len = i32::from_be_bytes(body[2..6].try_into().unwrap());
            (len >= 0).then(|| String::from_utf8_lossy(&body[6..6 + len as usize]).into_owned())
        })
}

/// The counters of `rule` (`"(hint)"`: of hinted queries).
fn rule_stats(proxy: &Pgmemo, rule: &str) -> std::sync::Arc<pgmemo::cache::RuleStats> {
    proxy
        .app()
        .cache
        .rule_stats()
        .into_iter()
        .find(|r| r.name == rule)
        .expect("rule stats")
}

fn stats(proxy: &Pgmemo, rule: &str) -> (u64, u64, u64) {
    let r = rule_stats(proxy, rule);
    (r.hits.get(), r.misses.get(), r.stores.load(Relaxed))
}

/// Whether two replies are the same messages, byte for byte.
fn same_replies(a: &[Backend], b: &[Backend]) -> bool {
    a.len() == b.len()
        && a.iter()
            .zip(b)
            .all(|(x, y)| x.tag == y.tag && x.body == y.body)
}

/// Sends each batch of `batches` in turn, each up to its ReadyForQuery, to PostgreSQL
/// (`direct`) and through pgmemo (`through`): the replies must be the same.
async fn same_batches(
    direct: &mut RawClient,
    through: &mut RawClient,
    batches: &[Vec<Frontend>],
    what: &str,
) {
    let mut replies = [vec![], vec![]];
    for (c, got) in [direct, through].into_iter().zip(&mut replies) {
        for msgs in batches {
            c.send(msgs).await.unwrap();
            got.extend(c.recv_until_ready(1).await.unwrap());
        }
    }
    assert!(
        same_replies(&replies[0], &replies[1]),
        "{what}: {:?} vs {:?}",
        replies[1],
        replies[0]
    );
}

async fn setup(db: &'static str, sql: &str) {
    fresh_db(db).await;
    let sql = sql.to_owned();
    tokio::task::spawn_blocking(move || cluster().psql(db, &sql))
        .await
        .unwrap();
}

#[tokio::test]
async fn hits_are_byte_identical_to_postgresql() {
    const DB: &str = "cache_bytes";
    setup(
        DB,
        "CREATE TABLE t (id int PRIMARY KEY, name text, score numeric, at timestamptz, \
           tags text[], blob bytea, note text);
         INSERT INTO t SELECT i, 'name ' || i, i * 1.5, '2026-01-01'::timestamptz + i * interval '1 hour', \
           ARRAY['a', 'b' || i], decode(md5(i::text), 'hex'), CASE WHEN i % 3 = 0 THEN NULL ELSE 'n' END \
           FROM generate_series(1, 200) i;
         CREATE TABLE nulls AS SELECT NULL::int a, NULL::text b, NULL::date c FROM generate_series(1, 50);
         CREATE TABLE big AS SELECT i, repeat('x', 1000) AS pad FROM generate_series(1, 5000) i;",
    )
    .await;
    let mut config = cache_config(PoolMode::Transaction, 2, vec![rule("bytes", "FROM")]);
    config.cache.max_result_bytes = 1024 * 1024;
    config.cache.rules[0].max_result_bytes = 1024 * 1024;
    let proxy = start_pgmemo(config).await;
    let queries = [
        "SELECT * FROM t WHERE id = 7",
        "SELECT * FROM t WHERE id BETWEEN 10 AND 60 ORDER BY id",
        "SELECT * FROM t WHERE id = -1",
        "SELECT * FROM nulls",
        "SELECT count(*), sum(score), max(at) FROM t",
        "select name, upper(name) FROM t where name like 'name 1%' order by id limit 5",
        "/* pgmemo cache ttl=30s */ SELECT tags FROM t WHERE id = 3",
        "SELECT i, pad FROM big ORDER BY i",
    ];
    let mut direct = raw_direct(DB).await;
    let mut through = raw_proxy(&proxy, DB).await;
    for sql in queries {
        let expected = run(&mut direct, sql).await;
        for round in 0..3 {
            let got = run(&mut through, sql).await;
            assert!(
                got == expected,
                "{sql} (round {round}) differs from PostgreSQL's reply"
            );
        }
    }
    let (hits, misses, stores) = stats(&proxy, "bytes");
    // 7 queries cacheable under the rule (the hinted one counts as the hint's), each stored
    // once and hit twice; the 5 MB result is never stored.
    assert_eq!(stores, 6, "stores");
    assert_eq!(misses, 7 + 2, "misses (the large result misses every time)");
    assert_eq!(hits, 12, "hits");
    assert!(cache_bypassed(&proxy, "larger than max_result_bytes") >= 3);
    let (hint_hits, _, hint_stores) = stats(&proxy, "(hint)");
    assert_eq!((hint_hits, hint_stores), (2, 1));

    // The same results again after a reconnect, in session mode, and by the cache in a
    // second pool: byte-identical all the same.
    let mut again = raw_proxy(&proxy, DB).await;
    for sql in &queries[..3] {
        assert!(run(&mut again, sql).await == run(&mut direct, sql).await);
    }
}

#[tokio::test]
async fn writes_through_pgmemo_invalidate() {
    const DB: &str = "cache_writes";
    setup(
        DB,
        "CREATE TABLE kv (k int PRIMARY KEY, v int);
         INSERT INTO kv SELECT i, 0 FROM generate_series(1, 10) i;
         CREATE TABLE child (id int PRIMARY KEY, k int REFERENCES kv ON DELETE CASCADE);
         INSERT INTO child VALUES (1, 1), (2, 2);
         CREATE VIEW kv_view AS SELECT k, v * 2 AS twice FROM kv;
         CREATE FUNCTION bump(key int) RETURNS int LANGUAGE sql AS 'UPDATE kv SET v = v + 100 WHERE k = key RETURNING v';
         GRANT SELECT, UPDATE ON kv TO scram_user;",
    )
    .await;
    let mut config = cache_config(
        PoolMode::Transaction,
        2,
        vec![rule("kv", "kv"), rule("child", "FROM child")],
    );
    with_alias(&mut config, DB, "cache_writes_other");
    let proxy = start_pgmemo(config).await;
    let mut reader = raw_proxy(&proxy, DB).await;
    let mut writer = raw_proxy(&proxy, DB).await;
    let mut direct = raw_direct(DB).await;
    let read = "SELECT v FROM kv WHERE k = 1";
    let view = "SELECT twice FROM kv_view WHERE k = 1";
    let children = "SELECT count(*) FROM child";

    async fn check(reader: &mut RawClient, direct: &mut RawClient, sqls: &[&str], step: &str) {
        for sql in sqls {
            let expected = run(direct, sql).await;
            let got = run(reader, sql).await;
            assert!(got == expected, "{step}: {sql}: {got:?} vs {expected:?}");
        }
    }
    let all = [read, view, children];
    check(&mut reader, &mut direct, &all, "first").await;
    check(&mut reader, &mut direct, &all, "cached").await;
    let hits_before = stats(&proxy, "kv").0;
    assert!(hits_before >= 2, "the reads were cached");

    // Another client's UPDATE (an implicit transaction).
    run(&mut writer, "UPDATE kv SET v = 1 WHERE k = 1").await;
    check(&mut reader, &mut direct, &all, "after UPDATE").await;
    // A multi-statement query.
    run(
        &mut writer,
        "SELECT 1; UPDATE kv SET v = 2 WHERE k = 1; SELECT 2",
    )
    .await;
    check(
        &mut reader,
        &mut direct,
        &all,
        "after a multi-statement query",
    )
    .await;
    // A block that commits, in separate messages.
    run(&mut writer, "BEGIN").await;
    run(&mut writer, "UPDATE kv SET v = 3 WHERE k = 1").await;
    check(&mut reader, &mut direct, &all, "inside the writer's block").await;
    run(&mut writer, "COMMIT").await;
    check(&mut reader, &mut direct, &all, "after COMMIT").await;
    // A block that rolls back: nothing changes, and the entries stay valid.
    check(&mut reader, &mut direct, &all, "cached again").await;
    let hits = stats(&proxy, "kv").0;
    run(
        &mut writer,
        "BEGIN; UPDATE kv SET v = 99 WHERE k = 1; ROLLBACK",
    )
    .await;
    check(&mut reader, &mut direct, &all, "after ROLLBACK").await;
    assert!(
        stats(&proxy, "kv").0 >= hits + 2,
        "a rolled-back write invalidates nothing: {:?} -> {:?}",
        hits,
        stats(&proxy, "kv")
    );
    // A write inside a function that pgmemo sees only as a SELECT.
    let bumped = run(&mut writer, "SELECT bump(1)").await;
    assert!(!bumped.iter().any(|(t, _)| *t == b'E'));
    check(&mut reader, &mut direct, &all, "after SELECT bump(1)").await;
    // The same function called by OID (the protocol's FunctionCall).
    check(
        &mut reader,
        &mut direct,
        &all,
        "cached before the FunctionCall",
    )
    .await;
    let oid = first_value(&run(&mut direct, "SELECT 'bump'::regproc::oid").await)
        .and_then(|v| v.parse().ok())
        .expect("bump's OID");
    writer
        .send(&[Frontend::FunctionCall {
            function_oid: oid,
            arg_formats: vec![],
            args: vec![Some(b"1".to_vec())],
            result_format: 0,
        }])
        .await
        .unwrap();
    let called = writer.recv_until_ready(1).await.unwrap();
    assert!(called.iter().any(|m| m.tag == b'V'), "{called:?}");
    check(
        &mut reader,
        &mut direct,
        &all,
        "after a FunctionCall of bump",
    )
    .await;
    // libpq's large-object calls (lo_creat, OID 957) write only pg_largeobject: what was
    // cached stays.
    check(&mut reader, &mut direct, &all, "cached before lo_creat").await;
    let hits = stats(&proxy, "kv").0;
    writer
        .send(&[Frontend::FunctionCall {
            function_oid: 957,
            arg_formats: vec![1],
            args: vec![Some((-1i32).to_be_bytes().to_vec())],
            result_format: 1,
        }])
        .await
        .unwrap();
    let created = writer.recv_until_ready(1).await.unwrap();
    assert!(created.iter().any(|m| m.tag == b'V'), "{created:?}");
    check(&mut reader, &mut direct, &all, "after lo_creat").await;
    assert!(
        stats(&proxy, "kv").0 >= hits + 2,
        "a large-object call invalidated the cache: {hits} -> {:?}",
        stats(&proxy, "kv")
    );
    // The extended protocol: Parse/Bind/Execute of an UPDATE.
    writer
        .send(&[
            Frontend::parse("upd", "UPDATE kv SET v = $1 WHERE k = 1", &[23]),
            Frontend::bind("", "upd", &[Some("7")]),
            Frontend::execute("", 0),
            Frontend::Sync,
        ])
        .await
        .unwrap();
    writer.recv_until_ready(1).await.unwrap();
    check(&mut reader, &mut direct, &all, "after an extended UPDATE").await;
    writer
        .send(&[
            Frontend::bind("", "upd", &[Some("8")]),
            Frontend::execute("", 0),
            Frontend::Sync,
        ])
        .await
        .unwrap();
    writer.recv_until_ready(1).await.unwrap();
    check(
        &mut reader,
        &mut direct,
        &all,
        "after a named statement ran again",
    )
    .await;
    // A cascade through a foreign key.
    run(&mut writer, "DELETE FROM kv WHERE k = 2").await;
    check(&mut reader, &mut direct, &all, "after a cascading DELETE").await;
    // DDL.
    run(&mut writer, "ALTER TABLE kv ADD COLUMN extra int DEFAULT 5").await;
    check(
        &mut reader,
        &mut direct,
        &["SELECT * FROM kv WHERE k = 1"],
        "after DDL",
    )
    .await;
    run(&mut writer, "UPDATE kv SET extra = 6").await;
    check(
        &mut reader,
        &mut direct,
        &["SELECT * FROM kv WHERE k = 1"],
        "after DDL and UPDATE",
    )
    .await;
    // A write by the reader itself is seen by its own next read.
    run(&mut reader, "UPDATE kv SET v = 42 WHERE k = 1").await;
    check(&mut reader, &mut direct, &all, "own write").await;
}

#[tokio::test]
async fn read_your_writes_under_concurrency() {
    const DB: &str = "cache_ryw";
    setup(
        DB,
        "CREATE TABLE own (id int PRIMARY KEY, v int); INSERT INTO own SELECT i, 0 FROM generate_series(0, 19) i;",
    )
    .await;
    let proxy = start_pgmemo(cache_config(
        PoolMode::Transaction,
        4,
        vec![rule("own", "FROM own")],
    ))
    .await;
    let addr = proxy.local_addr();
    let mut tasks = Vec::new();
    for id in 0..20 {
        tasks.push(tokio::spawn(async move {
            let mut c = RawClient::connect(addr, PGMEMO_USER, DB, Some(PGMEMO_PASS), &[])
                .await
                .unwrap();
            let mut stale = 0;
            for i in 1..=60 {
                if i % 3 == 0 {
                    run(
                        &mut c,
                        &format!("BEGIN; UPDATE own SET v = {i} WHERE id = {id}; COMMIT"),
                    )
                    .await;
                } else {
                    run(&mut c, &format!("UPDATE own SET v = {i} WHERE id = {id}")).await;
                }
                for _ in 0..3 {
                    let got = first_value(
                        &run(&mut c, &format!("SELECT v FROM own WHERE id = {id}")).await,
                    );
                    if got.as_deref() != Some(&i.to_string()) {
                        stale += 1;
                    }
                }
                // Everyone's rows, cached and invalidated by everyone's writes.
                run(&mut c, "SELECT sum(v) FROM own").await;
            }
            stale
        }));
    }
    let mut stale = 0;
    for t in tasks {
        stale += t.await.unwrap();
    }
    assert_eq!(stale, 0, "stale reads");
    let (hits, misses, _) = stats(&proxy, "own");
    assert!(hits > 0 && misses > 0, "hits {hits}, misses {misses}");
}

/// A client that leaves while its write still runs on the server (it waits for a lock here;
/// asyncpg's `terminate()` after a timeout leaves one so): pgmemo bumps what it wrote when the
/// client leaves, but the write commits later. What another client reads in between (the old
/// value, rightly) is stored; once the write committed, the next reads through pgmemo give its
/// value, not that entry: the write is bumped again when its server's connection has ended.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_left_running_by_a_client_gone_is_bumped_when_it_ends() {
    use std::time::Duration;
    const DB: &str = "cache_gone";
    setup(
        DB,
        "CREATE TABLE gone (id int PRIMARY KEY, v int); INSERT INTO gone VALUES (1, 0);",
    )
    .await;
    let proxy = start_pgmemo(cache_config(
        PoolMode::Transaction,
        3,
        vec![rule("gone", "FROM gone")],
    ))
    .await;
    let waiting = "SELECT count(*) FROM pg_stat_activity \
                   WHERE wait_event_type = 'Lock' AND query LIKE 'UPDATE gone %'";
    let read = "SELECT v FROM gone WHERE id = 1";
    let mut direct = raw_direct(DB).await;
    let mut reader = raw_proxy(&proxy, DB).await;
    for v in 1..=2 {
        run(&mut direct, "BEGIN; LOCK gone IN SHARE MODE").await;
        let mut gone = raw_proxy(&proxy, DB).await;
        gone.send(&[
            Frontend::query(&format!("UPDATE gone SET v = {v} WHERE id = 1")),
            Frontend::Terminate,
        ])
        .await
        .unwrap();
        wait_until("the UPDATE waiting", Duration::from_secs(10), || async {
            first_value(&run(&mut raw_direct(DB).await, waiting).await).as_deref() == Some("1")
        })
        .await;
        drop(gone);
        // The session ends (and bumps) once pgmemo sees the client gone: wait for it.
        wait_until("the client gone", Duration::from_secs(10), || async {
            proxy.app().client_count() == 1
        })
        .await;
        let before = stats(&proxy, "gone").0;
        let old = (v - 1).to_string();
        for _ in 0..2 {
            assert_eq!(
                first_value(&run(&mut reader, read).await).as_deref(),
                Some(&*old)
            );
        }
        assert!(
            stats(&proxy, "gone").0 > before,
            "the old value was stored and served"
        );
        run(&mut direct, "COMMIT").await;
        wait_until("the UPDATE committed", Duration::from_secs(10), || async {
            first_value(&run(&mut raw_direct(DB).await, read).await) == Some(v.to_string())
        })
        .await;
        wait_until(
            "pgmemo to serve the committed value",
            Duration::from_secs(10),
            || async {
                first_value(&run(&mut raw_proxy(&proxy, DB).await, read).await)
                    == Some(v.to_string())
            },
        )
        .await;
    }
    proxy.shutdown().await;
}

#[tokio::test]
async fn what_must_not_be_cached_is_not() {
    const DB: &str = "cache_never";
    setup(
        DB,
        "CREATE TABLE t (id int PRIMARY KEY, v int); INSERT INTO t VALUES (1, 1);
         CREATE UNLOGGED TABLE u (id int); CREATE SEQUENCE s;
         CREATE FUNCTION stable_user() RETURNS int LANGUAGE sql STABLE AS 'SELECT 1';
         CREATE FUNCTION immutable_user() RETURNS int LANGUAGE sql IMMUTABLE AS 'SELECT 1';
         CREATE TABLE secret (owner text, v int); ALTER TABLE secret ENABLE ROW LEVEL SECURITY;
         CREATE POLICY p ON secret USING (owner = current_setting('app.owner', true));",
    )
    .await;
    let proxy = start_pgmemo(cache_config(PoolMode::Session, 2, vec![])).await;
    let mut c = raw_proxy(&proxy, DB).await;
    let cases = [
        ("SELECT random() FROM t", "volatile function"),
        ("SELECT nextval('s')", "volatile function"),
        ("SELECT now()", "time or session function"),
        ("SELECT current_timestamp", "time or session function"),
        ("SELECT clock_timestamp()", "time or session function"),
        ("SELECT * FROM t FOR UPDATE", "FOR UPDATE/SHARE"),
        (
            "WITH d AS (UPDATE t SET v = v RETURNING *) SELECT * FROM d",
            "data-modifying WITH",
        ),
        ("SELECT * FROM pg_class LIMIT 1", "system catalog"),
        ("SELECT * FROM u", "unlogged table"),
        ("SELECT * FROM s", "foreign table or sequence"),
        ("SELECT stable_user()", "non-immutable user function"),
        ("SELECT * FROM secret", "row security on a setting"),
        ("SELECT * FROM nowhere", "unknown relation or function"),
    ];
    for (sql, reason) in cases {
        let before = cache_bypassed(&proxy, reason);
        let hinted = format!("/* pgmemo cache */ {sql}");
        run(&mut c, &hinted).await;
        run(&mut c, &hinted).await;
        assert!(
            cache_bypassed(&proxy, reason) >= before + 2,
            "{sql}: not counted as {reason:?}"
        );
    }
    // A temporary table shadowing a cached table's name: the client's caching is off from
    // its CREATE on.
    run(&mut c, "/* pgmemo cache */ SELECT * FROM t").await;
    run(&mut c, "CREATE TEMP TABLE t (id int, v int)").await;
    let before = cache_bypassed(&proxy, "temporary table");
    let temp = run(&mut c, "/* pgmemo cache */ SELECT * FROM t").await;
    assert!(
        first_value(&temp).is_none(),
        "the temporary table is read, empty"
    );
    assert!(cache_bypassed(&proxy, "temporary table") > before);
    // Inside a REPEATABLE READ block (READ COMMITTED ones have their own test).
    let before = cache_bypassed(&proxy, "repeatable read or serializable");
    let mut d = raw_proxy(&proxy, DB).await;
    run(&mut d, "BEGIN ISOLATION LEVEL REPEATABLE READ").await;
    run(&mut d, "/* pgmemo cache */ SELECT * FROM t").await;
    run(&mut d, "COMMIT").await;
    assert!(cache_bypassed(&proxy, "repeatable read or serializable") > before);
    // The immutable function is cached.
    let (h0, _, s0) = stats(&proxy, "(hint)");
    run(&mut d, "/* pgmemo cache */ SELECT immutable_user()").await;
    run(&mut d, "/* pgmemo cache */ SELECT immutable_user()").await;
    let (h1, _, s1) = stats(&proxy, "(hint)");
    assert_eq!((h1 - h0, s1 - s0), (1, 1));
    // No stores for anything above.
    let stored: Vec<String> = proxy
        .app()
        .cache
        .entries()
        .iter()
        .map(|e| e.text.to_string())
        .collect();
    assert!(
        stored
            .iter()
            .all(|t| t.contains("immutable_user") || t.contains("FROM t")),
        "{stored:?}"
    );
}

#[tokio::test]
async fn set_role_turns_caching_off_for_that_client() {
    const DB: &str = "cache_roles";
    setup(
        DB,
        "DROP ROLE IF EXISTS cache_other; CREATE ROLE cache_other;
         CREATE TABLE rows_by_role (owner name, v int);
         INSERT INTO rows_by_role VALUES ('pgmemo', 1), ('cache_other', 2);
         ALTER TABLE rows_by_role ENABLE ROW LEVEL SECURITY; ALTER TABLE rows_by_role FORCE ROW LEVEL SECURITY;
         CREATE POLICY mine ON rows_by_role USING (owner = current_user);
         INSERT INTO rows_by_role VALUES ('scram_user', 3);
         GRANT SELECT ON rows_by_role TO cache_other, scram_user; GRANT cache_other TO pgmemo;",
    )
    .await;
    let mut config = cache_config(PoolMode::Session, 2, vec![rule("roles", "rows_by_role")]);
    with_alias(&mut config, DB, "cache_roles_other");
    let proxy = start_pgmemo(config).await;
    let sql = "SELECT v FROM rows_by_role";
    let mut a = raw_proxy(&proxy, DB).await;
    assert_eq!(first_value(&run(&mut a, sql).await).as_deref(), Some("1"));
    assert_eq!(first_value(&run(&mut a, sql).await).as_deref(), Some("1"));
    assert_eq!(stats(&proxy, "roles").0, 1, "the owner's read is cached");
    // The same text in a pool whose server role is another: its own rows, its own entry.
    let mut other = raw_proxy(&proxy, "cache_roles_other").await;
    for _ in 0..2 {
        assert_eq!(
            first_value(&run(&mut other, sql).await).as_deref(),
            Some("3")
        );
    }
    assert_eq!(
        stats(&proxy, "roles").0,
        2,
        "each role's read is cached apart"
    );
    assert_eq!(stats(&proxy, "roles").2, 2, "two entries");
    let mut b = raw_proxy(&proxy, DB).await;
    run(&mut b, "SET ROLE cache_other").await;
    for _ in 0..2 {
        assert_eq!(first_value(&run(&mut b, sql).await).as_deref(), Some("2"));
    }
    assert_eq!(stats(&proxy, "roles").0, 2, "no hit after SET ROLE");
    assert!(cache_bypassed(&proxy, "role or setting changed") >= 2);
    // A transaction's characteristics and the session's defaults for them are no setting
    // outside the key (the cache asks the server for a block's isolation): still hits.
    drop((a, b));
    let mut c = raw_proxy(&proxy, DB).await;
    for sql in [
        "BEGIN",
        "SET TRANSACTION ISOLATION LEVEL READ COMMITTED, READ ONLY",
        "COMMIT",
        "SET SESSION CHARACTERISTICS AS TRANSACTION READ ONLY",
    ] {
        run(&mut c, sql).await;
    }
    assert_eq!(first_value(&run(&mut c, sql).await).as_deref(), Some("1"));
    assert_eq!(stats(&proxy, "roles").0, 3, "a hit after SET TRANSACTION");
    // A setting outside the key changed for one transaction (SET LOCAL, set_config(...,
    // true)): no hit in it, hits again once it is over.
    let mut hits = 3;
    for local in [
        "SET LOCAL extra_float_digits = 0",
        "SELECT set_config('app.tenant', 'a', true)",
    ] {
        for sql in ["BEGIN", local, sql] {
            run(&mut c, sql).await;
        }
        assert_eq!(stats(&proxy, "roles").0, hits, "no hit after {local}");
        run(&mut c, "COMMIT").await;
        assert_eq!(first_value(&run(&mut c, sql).await).as_deref(), Some("1"));
        hits += 1;
        assert_eq!(
            stats(&proxy, "roles").0,
            hits,
            "a hit after {local}'s block"
        );
    }
    // Temporary objects: no hits while the client may hold one, hits again after DISCARD
    // TEMP (which names `temp` to drop them).
    run(&mut c, "CREATE TEMP TABLE scratch (a int)").await;
    run(&mut c, sql).await;
    assert_eq!(
        stats(&proxy, "roles").0,
        hits,
        "no hit with a temporary table"
    );
    // A DISCARD TEMP that fails (in an aborted block) drops nothing.
    for sql in ["BEGIN", "SELECT 1/0", "DISCARD TEMP", "ROLLBACK", sql, sql] {
        run(&mut c, sql).await;
    }
    assert_eq!(
        stats(&proxy, "roles").0,
        hits,
        "no hit after a failed DISCARD TEMP"
    );
    run(&mut c, "DISCARD TEMP").await;
    // (The CREATE, DDL, emptied the database's entries: a miss first.)
    run(&mut c, sql).await;
    run(&mut c, sql).await;
    assert_eq!(
        stats(&proxy, "roles").0,
        hits + 1,
        "a hit after DISCARD TEMP"
    );
}

#[tokio::test]
async fn concurrent_misses_run_one_query() {
    const DB: &str = "cache_flight";
    setup(DB, "CREATE TABLE one (v int); INSERT INTO one VALUES (1);").await;
    let mut config = cache_config(
        PoolMode::Transaction,
        10,
        vec![rule("slow", "generate_series")],
    );
    // The waiters must outwait the one query however loaded the machine is (other tests of
    // this binary run at once): past flight_wait each would run its own, 49 long queries on
    // 10 servers, beyond the client's receive timeout.
    config.cache.flight_wait = std::time::Duration::from_secs(60);
    let proxy = start_pgmemo(config).await;
    let addr = proxy.local_addr();
    // A query that takes a while (an immutable count over a long series).
    let sql = "SELECT count(*) FROM generate_series(1, 3000000) JOIN one ON true";
    let barrier = Arc::new(tokio::sync::Barrier::new(50));
    let mut tasks = Vec::new();
    for _ in 0..50 {
        let barrier = barrier.clone();
        tasks.push(tokio::spawn(async move {
            let mut c = RawClient::connect(addr, PGMEMO_USER, DB, Some(PGMEMO_PASS), &[])
                .await
                .unwrap();
            barrier.wait().await;
            first_value(&run(&mut c, sql).await)
        }));
    }
    for t in tasks {
        assert_eq!(t.await.unwrap().as_deref(), Some("3000000"));
    }
    let (hits, misses, stores) = stats(&proxy, "slow");
    assert_eq!(
        (misses, stores, hits),
        (1, 1, 49),
        "one query ran, 49 clients waited for it"
    );
}

#[tokio::test]
async fn the_store_stays_within_its_memory_limit() {
    const DB: &str = "cache_memory";
    setup(DB, "CREATE TABLE pad AS SELECT i, repeat(md5(i::text), 64) AS p FROM generate_series(1, 100000) i;").await;
    let mut config = cache_config(PoolMode::Transaction, 2, vec![rule("pad", "FROM pad")]);
    config.cache.max_memory = 1024 * 1024;
    let proxy = start_pgmemo(config).await;
    let mut c = raw_proxy(&proxy, DB).await;
    let mut most = 0;
    for i in 0..400 {
        // ~10 KB each, 4 MB in all.
        run(
            &mut c,
            &format!(
                "SELECT p FROM pad WHERE i BETWEEN {} AND {}",
                i * 5,
                i * 5 + 4
            ),
        )
        .await;
        let (used, limit) = proxy.app().cache.memory();
        assert!(
            used <= limit,
            "store at {used} bytes over its limit {limit}"
        );
        most = most.max(used);
    }
    let (_, _, stores) = stats(&proxy, "pad");
    assert_eq!(stores, 400);
    assert!(
        most > 512 * 1024,
        "the store filled up to its limit ({most})"
    );
    let evictions = proxy
        .app()
        .cache
        .rule_stats()
        .iter()
        .find(|r| r.name == "pad")
        .unwrap()
        .evictions
        .load(Relaxed);
    assert!(evictions > 100, "evictions {evictions}");
    if let Ok(status) = std::fs::read_to_string("/proc/self/status") {
        let rss = status
            .lines()
            .find(|l| l.starts_with("VmRSS"))
            .unwrap_or("");
        eprintln!(
            "store peak {most} bytes of {} allowed; test process {rss}",
            1024 * 1024
        );
    }
}

#[tokio::test]
async fn admin_console_shows_and_flushes_the_cache() {
    const DB: &str = "cache_admin";
    setup(DB, "CREATE TABLE a (v int); INSERT INTO a VALUES (1); CREATE TABLE b (v int); INSERT INTO b VALUES (2);").await;
    let proxy = start_pgmemo(cache_config(
        PoolMode::Transaction,
        2,
        vec![rule("ab", "FROM")],
    ))
    .await;
    let mut c = raw_proxy(&proxy, DB).await;
    for _ in 0..2 {
        run(&mut c, "SELECT v FROM a").await;
        run(&mut c, "SELECT v FROM b").await;
    }
    let admin = connect(&proxy_url(
        proxy.local_addr(),
        PGMEMO_USER,
        Some(PGMEMO_PASS),
        "pgmemo",
    ))
    .await;
    let rows = |msgs: Vec<tokio_postgres::SimpleQueryMessage>| -> Vec<Vec<String>> {
        msgs.into_iter()
            .filter_map(|m| match m {
                tokio_postgres::SimpleQueryMessage::Row(r) => Some(
                    (0..r.len())
                        .map(|i| r.get(i).unwrap_or("").to_owned())
                        .collect(),
                ),
                _ => None,
            })
            .collect()
    };
    let cache = rows(admin.simple_query("SHOW CACHE").await.unwrap());
    let ab = cache.iter().find(|r| r[0] == "ab").expect("rule row");
    assert_eq!(
        (ab[1].as_str(), ab[3].as_str(), ab[4].as_str()),
        ("2", "2", "2")
    );
    let entries = rows(admin.simple_query("SHOW CACHE ENTRIES").await.unwrap());
    assert_eq!(entries.len(), 2, "{entries:?}");
    admin.simple_query("CACHE FLUSH TABLE a").await.unwrap();
    let entries = rows(admin.simple_query("SHOW CACHE ENTRIES").await.unwrap());
    assert_eq!(entries.len(), 1);
    assert!(entries[0][2].contains("FROM b"));
    run(&mut c, "SELECT v FROM b").await;
    assert_eq!(stats(&proxy, "ab").0, 3, "b still cached");
    admin.simple_query("CACHE FLUSH").await.unwrap();
    assert!(rows(admin.simple_query("SHOW CACHE ENTRIES").await.unwrap()).is_empty());
    let bypasses = rows(admin.simple_query("SHOW CACHE_BYPASSES").await.unwrap());
    assert!(bypasses.iter().any(|r| r[0] == "volatile function"));
}

#[tokio::test]
async fn rules_follow_a_reload() {
    const DB: &str = "cache_reload";
    setup(DB, "CREATE TABLE r (v int); INSERT INTO r VALUES (1);").await;
    let proxy = start_pgmemo(cache_config(PoolMode::Transaction, 2, vec![])).await;
    let mut c = raw_proxy(&proxy, DB).await;
    run(&mut c, "SELECT v FROM r").await;
    run(&mut c, "SELECT v FROM r").await;
    assert!(
        proxy.app().cache.entries().is_empty(),
        "nothing cached without a rule"
    );
    let config = cache_config(PoolMode::Transaction, 2, vec![rule("r", "FROM r")]);
    proxy.reload_with(config).expect("reload");
    run(&mut c, "SELECT v FROM r").await;
    run(&mut c, "SELECT v FROM r").await;
    assert_eq!(stats(&proxy, "r").0, 1);
    // A nocache hint wins over the rule.
    run(&mut c, "/* pgmemo nocache */ SELECT v FROM r").await;
    assert_eq!(stats(&proxy, "r").0, 1);
    // Once the rule is gone, what it stored is not answered any more.
    let r = rule_stats(&proxy, "r");
    proxy
        .reload_with(cache_config(PoolMode::Transaction, 2, vec![]))
        .expect("reload");
    run(&mut c, "SELECT v FROM r").await;
    run(&mut c, "SELECT v FROM r").await;
    assert_eq!(r.hits.get(), 1, "answered after its rule was removed");
    // Hints likewise: what they stored is answered only while hints are obeyed.
    let hinted = "/* pgmemo cache */ SELECT v, 2 FROM r";
    run(&mut c, hinted).await;
    run(&mut c, hinted).await;
    let hints = rule_stats(&proxy, "(hint)");
    assert_eq!(hints.hits.get(), 1);
    let mut config = cache_config(PoolMode::Transaction, 2, vec![]);
    config.cache.hints = false;
    proxy.reload_with(config).expect("reload");
    let from_server = run(&mut c, hinted).await;
    assert_eq!(hints.hits.get(), 1, "answered with hints off");
    assert_eq!(
        from_server.iter().filter(|(tag, _)| *tag == b'D').count(),
        1,
        "{from_server:?}"
    );
}

/// The extended protocol: unnamed and named statements, text and binary parameters and
/// results, with and without Describe: the cached replies are PostgreSQL's, byte for byte.
#[tokio::test]
async fn extended_protocol_hits_are_byte_identical() {
    const DB: &str = "cache_extended";
    setup(
        DB,
        "CREATE TABLE e (id int PRIMARY KEY, name text, score float8, n numeric);
         INSERT INTO e SELECT i, 'e' || i, i / 3.0, i * 1.25 FROM generate_series(1, 100) i;",
    )
    .await;
    let proxy = start_pgmemo(cache_config(
        PoolMode::Transaction,
        2,
        vec![rule("ext", "FROM e")],
    ))
    .await;
    let mut direct = raw_direct(DB).await;
    let mut through = raw_proxy(&proxy, DB).await;
    let sql = "SELECT id, name, score, n FROM e WHERE id <= $1 ORDER BY id";
    let int4 = |v: i32| v.to_be_bytes().to_vec();
    // Binary parameter, binary results.
    let binary_bind = |statement: &str, value: Vec<u8>| Frontend::Bind {
        portal: String::new(),
        statement: statement.to_string(),
        param_formats: vec![1],
        params: vec![Some(value)],
        result_formats: vec![1],
    };
    let batches: Vec<(&str, Vec<Frontend>)> = vec![
        (
            "unnamed, text, described",
            vec![
                Frontend::parse("", sql, &[23]),
                Frontend::bind("", "", &[Some("5")]),
                Frontend::describe_portal(""),
                Frontend::execute("", 0),
                Frontend::Sync,
            ],
        ),
        (
            "unnamed, untyped, not described",
            vec![
                Frontend::parse("", sql, &[]),
                Frontend::bind("", "", &[Some("3")]),
                Frontend::execute("", 0),
                Frontend::Sync,
            ],
        ),
        (
            "empty result",
            vec![
                Frontend::parse("", sql, &[23]),
                Frontend::bind("", "", &[Some("0")]),
                Frontend::describe_portal(""),
                Frontend::execute("", 0),
                Frontend::Sync,
            ],
        ),
    ];
    for (what, batch) in &batches {
        direct.send(batch).await.unwrap();
        let expected = direct.recv_until_ready(1).await.unwrap();
        for round in 0..3 {
            through.send(batch).await.unwrap();
            let got = through.recv_until_ready(1).await.unwrap();
            let same = got.len() == expected.len()
                && got
                    .iter()
                    .zip(&expected)
                    .all(|(a, b)| a.tag == b.tag && a.body == b.body);
            assert!(same, "{what} (round {round}): {got:?} vs {expected:?}");
        }
    }
    // Named statements, text and binary.
    for c in [&mut direct, &mut through] {
        c.send(&[Frontend::parse("named", sql, &[23]), Frontend::Sync])
            .await
            .unwrap();
        c.recv_until_ready(1).await.unwrap();
    }
    for round in 0..3 {
        for value in [7, 2] {
            let mut replies = Vec::new();
            for c in [&mut direct, &mut through] {
                c.send(&[
                    binary_bind("named", int4(value)),
                    Frontend::describe_portal(""),
                    Frontend::execute("", 0),
                    Frontend::Sync,
                ])
                .await
                .unwrap();
                replies.push(c.recv_until_ready(1).await.unwrap());
                c.send(&[
                    Frontend::bind("", "named", &[Some(&value.to_string())]),
                    Frontend::execute("", 0),
                    Frontend::Sync,
                ])
                .await
                .unwrap();
                replies.push(c.recv_until_ready(1).await.unwrap());
            }
            let same = same_replies;
            assert!(same(&replies[0], &replies[2]), "binary, round {round}");
            assert!(same(&replies[1], &replies[3]), "text, round {round}");
        }
    }
    let (hits, misses, stores) = stats(&proxy, "ext");
    assert_eq!(stores, 3 + 4, "stores");
    assert_eq!(misses, stores);
    // A statement no server has accepted yet goes to a server first (as PostgreSQL must
    // judge it): the first two unnamed statements are new in round 0 and fill in round 1.
    assert_eq!(hits, 1 + 1 + 2 + 4 * 2, "hits");
    assert_eq!(
        proxy.app().cache.flight_timeouts.load(Relaxed),
        0,
        "no batch waited for a fetch (its own) that never ended"
    );
    // A write through the extended protocol invalidates the extended entries.
    through
        .send(&[Frontend::query(
            "UPDATE e SET name = 'changed' WHERE id = 1",
        )])
        .await
        .unwrap();
    through.recv_until_ready(1).await.unwrap();
    for c in [&mut direct, &mut through] {
        c.send(&batches[0].1).await.unwrap();
    }
    let expected = direct.recv_until_ready(1).await.unwrap();
    let got = through.recv_until_ready(1).await.unwrap();
    assert!(
        got.iter().zip(&expected).all(|(a, b)| a.body == b.body) && got.len() == expected.len(),
        "after UPDATE"
    );
    // tokio-postgres (named statements from its own cache), with a nocache comparison.
    let client = connect(&proxy_url(
        proxy.local_addr(),
        PGMEMO_USER,
        Some(PGMEMO_PASS),
        DB,
    ))
    .await;
    let plain = connect(&cluster().url(PGMEMO_USER, Some(PGMEMO_PASS), DB)).await;
    let statement = client.prepare(sql).await.unwrap();
    for limit in [1i32, 10, 10, 1, 50] {
        let got: Vec<(i32, String, f64)> = client
            .query(&statement, &[&limit])
            .await
            .unwrap()
            .iter()
            .map(|r| (r.get(0), r.get(1), r.get(2)))
            .collect();
        let expected: Vec<(i32, String, f64)> = plain
            .query(sql, &[&limit])
            .await
            .unwrap()
            .iter()
            .map(|r| (r.get(0), r.get(1), r.get(2)))
            .collect();
        assert_eq!(got, expected);
    }
}

/// With `admit_after = 2` (the default) a miss is stored at once while the store has room;
/// once the store is full (it evicted an entry), a key is stored at its second miss, so keys
/// read once cost no store and evict nothing.
#[tokio::test]
async fn keys_are_admitted_at_their_second_miss_once_the_store_is_full() {
    const DB: &str = "cache_admit";
    setup(
        DB,
        "CREATE TABLE a (v int); INSERT INTO a SELECT generate_series(1, 1000);",
    )
    .await;
    let mut config = cache_config(PoolMode::Transaction, 2, vec![rule("a", "FROM a")]);
    config.cache.admit_after = 2;
    config.cache.max_memory = 16 * 1024;
    let proxy = start_pgmemo(config).await;
    let mut c = raw_proxy(&proxy, DB).await;
    let mut direct = raw_direct(DB).await;
    let mut read = async |v: u32| {
        let sql = format!("SELECT v FROM a WHERE v = {v}");
        assert!(run(&mut c, &sql).await == run(&mut direct, &sql).await);
    };
    read(1).await;
    read(1).await;
    assert_eq!(
        stats(&proxy, "a"),
        (1, 1, 1),
        "room: stored at the first miss"
    );
    let mut v = 2;
    while rule_stats(&proxy, "a").evictions.load(Relaxed) == 0 {
        read(v).await;
        v += 1;
        assert!(v < 1000, "16 KiB hold fewer than 1,000 entries");
    }
    let (hits, misses, stores) = stats(&proxy, "a");
    assert_eq!(
        cache_bypassed(&proxy, "first miss (admitted on the next)"),
        0
    );
    for (round, expected) in [
        (0, (hits, misses + 1, stores)),
        (1, (hits, misses + 2, stores + 1)),
        (2, (hits + 1, misses + 2, stores + 1)),
    ] {
        read(v).await;
        assert_eq!(
            stats(&proxy, "a"),
            expected,
            "full, round {round}: (hits, misses, stores)"
        );
    }
    assert_eq!(
        cache_bypassed(&proxy, "first miss (admitted on the next)"),
        1
    );
}

/// Transaction mode, where pgmemo follows every setting a client holds: a SET ROLE or SET
/// changes the client's key instead of turning its caching off. Each role reads its own
/// rows (row-level security on current_user), cached apart; a client with another setting has
/// its own entries; RESET ROLE and RESET of the setting return to the shared ones.
#[tokio::test]
async fn transaction_mode_keys_by_the_settings_a_client_holds() {
    const DB: &str = "cache_keyed_settings";
    setup(
        DB,
        "DROP ROLE IF EXISTS cache_keyed_other; CREATE ROLE cache_keyed_other;
         CREATE TABLE mine (owner name, v int);
         INSERT INTO mine VALUES ('pgmemo', 1), ('cache_keyed_other', 2);
         ALTER TABLE mine ENABLE ROW LEVEL SECURITY; ALTER TABLE mine FORCE ROW LEVEL SECURITY;
         CREATE POLICY own ON mine USING (owner = current_user);
         GRANT SELECT ON mine TO cache_keyed_other; GRANT cache_keyed_other TO pgmemo;",
    )
    .await;
    let proxy = start_pgmemo(cache_config(
        PoolMode::Transaction,
        1,
        vec![rule("mine", "FROM mine")],
    ))
    .await;
    let sql = "SELECT v FROM mine";
    let mut a = raw_proxy(&proxy, DB).await;
    let mut b = raw_proxy(&proxy, DB).await;
    for _ in 0..2 {
        assert_eq!(first_value(&run(&mut a, sql).await).as_deref(), Some("1"));
    }
    assert_eq!(stats(&proxy, "mine").0, 1, "a's second read is a hit");
    run(&mut b, "SET ROLE cache_keyed_other").await;
    for _ in 0..2 {
        assert_eq!(first_value(&run(&mut b, sql).await).as_deref(), Some("2"));
    }
    assert_eq!(
        stats(&proxy, "mine").0,
        2,
        "b's second read is a hit, under its role"
    );
    assert_eq!(first_value(&run(&mut a, sql).await).as_deref(), Some("1"));
    run(&mut b, "SET work_mem = '3MB'").await;
    assert_eq!(first_value(&run(&mut b, sql).await).as_deref(), Some("2"));
    // (RESET ALL would keep the role, as PostgreSQL does.)
    run(&mut b, "RESET ROLE; RESET work_mem").await;
    let hits_before = stats(&proxy, "mine").0;
    assert_eq!(first_value(&run(&mut b, sql).await).as_deref(), Some("1"));
    assert_eq!(
        stats(&proxy, "mine").0,
        hits_before + 1,
        "back on a's entry"
    );
    assert_eq!(cache_bypassed(&proxy, "role or setting changed"), 0);
}

/// Inside READ COMMITTED transaction blocks (read-only or read-write) the cache answers and
/// fills reads of tables the block has not written, with replies byte-identical to
/// PostgreSQL's (ReadyForQuery `T` included): every step runs through pgmemo on one database
/// and directly on its twin, the same clients on each side. A table the block wrote is read
/// from the server until the block ends; a write rolled back leaves the entry good; another
/// client's uncommitted write is not seen, its commit is at the next read; REPEATABLE READ /
/// SERIALIZABLE blocks, failed blocks, and rules with `transactions = false` are never
/// answered.
#[tokio::test]
async fn reads_inside_read_committed_blocks() {
    const DBS: [&str; 2] = ["cache_blocks", "cache_blocks_twin"];
    for db in DBS {
        setup(
            db,
            "CREATE TABLE kv (id int PRIMARY KEY, v int); INSERT INTO kv VALUES (1, 1), (2, 2);
             CREATE TABLE other (v int); INSERT INTO other VALUES (7);
             CREATE TABLE strict (v int); INSERT INTO strict VALUES (3);",
        )
        .await;
    }
    let mut strict = rule("strict", "FROM strict");
    strict.transactions = false;
    let proxy = start_pgmemo(cache_config(
        PoolMode::Transaction,
        3,
        vec![rule("kv", "FROM kv"), rule("other", "FROM other"), strict],
    ))
    .await;
    let mut through = [
        raw_proxy(&proxy, DBS[0]).await,
        raw_proxy(&proxy, DBS[0]).await,
    ];
    let mut direct = [raw_direct(DBS[1]).await, raw_direct(DBS[1]).await];
    let hits = |proxy: &Pgmemo| {
        ["kv", "other", "strict"]
            .iter()
            .map(|r| stats(proxy, r).0)
            .sum::<u64>()
    };
    let kv = "SELECT v FROM kv WHERE id = 1";
    let other = "SELECT v FROM other";
    // (client, statement, answered by the cache)
    let steps: &[(usize, &str, bool)] = &[
        (0, kv, false),
        (0, kv, true),
        (0, "BEGIN", false),
        (0, kv, true),
        // Filled inside the block, answered at the next read.
        (0, other, false),
        (0, other, true),
        (0, "SELECT v FROM strict", false),
        (0, "SELECT v FROM strict", false),
        // The block writes kv: its reads of kv go to the server, other's are still answered.
        (0, "UPDATE kv SET v = 10 WHERE id = 1", false),
        (0, kv, false),
        (0, "SELECT v FROM kv WHERE id = 2", false),
        (0, other, true),
        // The other client does not see the uncommitted write: its read is answered.
        (1, kv, true),
        (0, "ROLLBACK", false),
        // Rolled back: the entry is still good.
        (0, kv, true),
        // A block that commits a write: the entry is gone for everyone.
        (0, "START TRANSACTION", false),
        (0, "UPDATE kv SET v = 11 WHERE id = 1", false),
        (0, "COMMIT", false),
        (1, kv, false),
        (1, kv, true),
        // Another client's commit is read at once inside an open READ COMMITTED block.
        (0, "BEGIN READ ONLY", false),
        (0, kv, true),
        (1, "UPDATE kv SET v = 12 WHERE id = 1", false),
        (0, kv, false),
        (0, kv, true),
        (0, "COMMIT", false),
        // One snapshot for the block: never.
        (0, "BEGIN ISOLATION LEVEL REPEATABLE READ", false),
        (0, kv, false),
        (0, "COMMIT", false),
        (0, "BEGIN", false),
        (0, "SET TRANSACTION ISOLATION LEVEL SERIALIZABLE", false),
        (0, kv, false),
        (0, "COMMIT", false),
        (
            0,
            "SET default_transaction_isolation = 'repeatable read'",
            false,
        ),
        (0, "BEGIN", false),
        (0, kv, false),
        (0, "COMMIT", false),
        (0, "RESET default_transaction_isolation", false),
        // A failed block: PostgreSQL's error, not the entry.
        (0, "BEGIN", false),
        (0, "SELECT 1/0", false),
        (0, kv, false),
        (0, "ROLLBACK", false),
        (0, kv, true),
    ];
    for (i, (who, sql, hit)) in steps.iter().enumerate() {
        let before = hits(&proxy);
        let got = without_table_oids(run(&mut through[*who], sql).await);
        let want = without_table_oids(run(&mut direct[*who], sql).await);
        assert_eq!(got, want, "step {i}: {sql}");
        assert_eq!(
            hits(&proxy) > before,
            *hit,
            "step {i}: {sql}: answered by the cache"
        );
    }
    assert!(cache_bypassed(&proxy, "written in this transaction") > 0);
    assert!(cache_bypassed(&proxy, "repeatable read or serializable") > 0);
    // The extended protocol (psycopg 3, pgx, JDBC) in a block: answered too, BindComplete and
    // ReadyForQuery `T` as PostgreSQL sends them; a row limit leaves a portal open in a
    // block, so that batch runs on the server.
    let batch = |max_rows: i32| {
        vec![
            Frontend::parse("", "SELECT v FROM other WHERE v > $1", &[23]),
            Frontend::bind("", "", &[Some("0")]),
            Frontend::describe_portal(""),
            Frontend::execute("", max_rows),
            Frontend::Sync,
        ]
    };
    for (sql, hit) in [
        ("BEGIN", false),
        ("", false),
        ("", false),
        ("", true),
        ("", true),
    ] {
        let before = hits(&proxy);
        let (got, want) = if sql.is_empty() {
            through[0].send(&batch(0)).await.unwrap();
            direct[0].send(&batch(0)).await.unwrap();
            (
                through[0].recv_until_ready(1).await.unwrap(),
                direct[0].recv_until_ready(1).await.unwrap(),
            )
        } else {
            run(&mut through[0], sql).await;
            run(&mut direct[0], sql).await;
            continue;
        };
        let got: Vec<_> = got.into_iter().map(|m| (m.tag, m.body)).collect();
        let want: Vec<_> = want.into_iter().map(|m| (m.tag, m.body)).collect();
        assert_eq!(without_table_oids(got), without_table_oids(want));
        assert_eq!(
            hits(&proxy) > before,
            hit,
            "extended batch: answered by the cache"
        );
    }
    let before = hits(&proxy);
    through[0].send(&batch(1)).await.unwrap();
    direct[0].send(&batch(1)).await.unwrap();
    let pairs = |m: Vec<Backend>| m.into_iter().map(|m| (m.tag, m.body)).collect();
    let got = pairs(through[0].recv_until_ready(1).await.unwrap());
    let want = pairs(direct[0].recv_until_ready(1).await.unwrap());
    assert_eq!(without_table_oids(got), without_table_oids(want));
    assert_eq!(
        hits(&proxy),
        before,
        "a batch with a row limit in a block runs"
    );
    run(&mut through[0], "COMMIT").await;
    run(&mut direct[0], "COMMIT").await;
}

/// A block of hits takes no server: `BEGIN` is answered by pgmemo and sent with the block's
/// first statement that needs a server; `COMMIT`/`ROLLBACK` of a block that never needed one
/// are answered by pgmemo. Every reply is PostgreSQL's (tags, warnings, errors, the status
/// of ReadyForQuery), and while a block of hits is open no backend of the database is in a
/// transaction.
#[tokio::test]
async fn a_block_of_hits_takes_no_server() {
    const DBS: [&str; 2] = ["cache_kept", "cache_kept_twin"];
    for db in DBS {
        setup(
            db,
            "CREATE TABLE kv (id int PRIMARY KEY, v int); INSERT INTO kv VALUES (1, 1), (2, 2);
             CREATE TABLE strict (v int); INSERT INTO strict VALUES (3);",
        )
        .await;
    }
    let mut strict = rule("strict", "FROM strict");
    strict.transactions = false;
    let proxy = start_pgmemo(cache_config(
        PoolMode::Transaction,
        2,
        vec![rule("kv", "FROM kv"), strict],
    ))
    .await;
    let hits = |proxy: &Pgmemo| stats(proxy, "kv").0 + stats(proxy, "strict").0;
    let mut through = [
        raw_proxy(&proxy, DBS[0]).await,
        raw_proxy(&proxy, DBS[0]).await,
    ];
    let mut direct = [raw_direct(DBS[1]).await, raw_direct(DBS[1]).await];
    let mut watch = raw_direct("postgres").await;
    let watch_sql = format!(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = '{}' AND state LIKE 'idle in transaction%'",
        DBS[0]
    );
    let kv = "SELECT v FROM kv WHERE id = 1";
    // (client, statement, answered by the cache, no backend of the database in a transaction
    // after it)
    let steps: &[(usize, &str, bool, bool)] = &[
        (0, kv, false, true),
        (0, kv, true, true),
        (0, "BEGIN", false, true),
        (0, kv, true, true),
        (0, "COMMIT", false, true),
        (0, "begin work;", false, true),
        (0, kv, true, true),
        (0, "ROLLBACK", false, true),
        (0, "START TRANSACTION READ ONLY", false, true),
        (0, kv, true, true),
        (0, "END", false, true),
        (
            0,
            "BEGIN ISOLATION LEVEL READ COMMITTED, NOT DEFERRABLE",
            false,
            true,
        ),
        (0, "ABORT TRANSACTION", false, true),
        // Outside a block: PostgreSQL's warnings.
        (0, "COMMIT", false, true),
        (0, "ROLLBACK", false, true),
        // What pgmemo does not keep takes the server at once.
        (0, "BEGIN", false, true),
        (0, "COMMIT AND CHAIN", false, false),
        (0, kv, true, false),
        (0, "COMMIT", false, true),
        (0, "BEGIN ISOLATION LEVEL REPEATABLE READ", false, false),
        (0, kv, false, false),
        (0, "COMMIT", false, true),
        (0, "BEGIN", false, true),
        (0, "BEGIN", false, false),
        (0, kv, true, false),
        (0, "COMMIT", false, true),
        // Hits, then a write: the write takes a server, the block's reads of kv run there.
        (0, "BEGIN", false, true),
        (0, kv, true, true),
        (0, "UPDATE kv SET v = v + 1 WHERE id = 2", false, false),
        (0, kv, false, false),
        (0, "SELECT v FROM kv WHERE id = 2", false, false),
        (0, "COMMIT", false, true),
        (0, "SELECT v FROM kv WHERE id = 2", false, true),
        // Row 1 was not written: still a hit (row-level invalidation).
        (0, kv, true, true),
        // After a hit the block has run a query: SET TRANSACTION fails as PostgreSQL fails it,
        // and COMMIT of the failed block is a ROLLBACK.
        (0, "BEGIN", false, true),
        (0, "SELECT v FROM kv WHERE id = 2", true, true),
        (
            0,
            "SET TRANSACTION ISOLATION LEVEL SERIALIZABLE",
            false,
            false,
        ),
        (0, kv, false, false),
        (0, "COMMIT", false, true),
        // Before any query it sets the block's isolation: no hit after it.
        (0, "BEGIN", false, true),
        (
            0,
            "SET TRANSACTION ISOLATION LEVEL REPEATABLE READ",
            false,
            false,
        ),
        (0, kv, false, false),
        (0, "COMMIT", false, true),
        // Savepoints and SET LOCAL run on the server, in the block.
        (0, "BEGIN", false, true),
        (0, kv, true, true),
        (0, "SAVEPOINT a", false, false),
        (0, "SET LOCAL statement_timeout = '7s'", false, false),
        (0, "SHOW statement_timeout", false, false),
        (0, "ROLLBACK TO SAVEPOINT a", false, false),
        (0, "SHOW statement_timeout", false, false),
        (0, "RELEASE SAVEPOINT b", false, false),
        (0, "ROLLBACK", false, true),
        (0, "BEGIN", false, true),
        (0, "SELECT 1/0", false, false),
        (0, "ROLLBACK", false, true),
        // Another client's commit is seen at the next read of a kept block.
        (0, "BEGIN", false, true),
        (0, kv, true, true),
        (1, "UPDATE kv SET v = 20 WHERE id = 1", false, true),
        (0, kv, false, false),
        (0, kv, true, false),
        (0, "COMMIT", false, true),
        // A block's uncommitted write is not seen by another client's kept block.
        (1, "BEGIN", false, true),
        (1, kv, true, true),
        (0, "BEGIN", false, true),
        (0, "UPDATE kv SET v = 21 WHERE id = 1", false, false),
        (1, kv, true, false),
        (0, "COMMIT", false, true),
        (1, kv, false, false),
        (1, "COMMIT", false, true),
        (1, kv, true, true),
        // A rule that keeps out of blocks: its entry answers when idle (from the first tier,
        // the exact text seen at a hit before), not in a kept block.
        (0, "SELECT v FROM strict", false, true),
        (0, "SELECT v FROM strict", true, true),
        (0, "SELECT v FROM strict", true, true),
        (0, "BEGIN", false, true),
        (0, kv, true, true),
        (0, "SELECT v FROM strict", false, false),
        (0, "COMMIT", false, true),
    ];
    for (i, (who, sql, hit, serverless)) in steps.iter().enumerate() {
        let before = hits(&proxy);
        let got = without_table_oids(run(&mut through[*who], sql).await);
        let want = without_table_oids(run(&mut direct[*who], sql).await);
        assert_eq!(got, want, "step {i}: {sql}");
        assert_eq!(
            hits(&proxy) > before,
            *hit,
            "step {i}: {sql}: answered by the cache"
        );
        let in_transaction = first_value(&run(&mut watch, &watch_sql).await);
        assert_eq!(
            in_transaction.as_deref() == Some("0"),
            *serverless,
            "step {i}: {sql}: no backend in a transaction"
        );
    }
    // The statement that takes a kept block's server is autoprepared as any other: the BEGIN
    // sent ahead of it is pgmemo's own query, not the client's work in flight.
    let before = autoprepared(&proxy);
    for i in 0..6 {
        let write = format!("UPDATE kv SET v = {i} WHERE id = 2");
        for sql in ["BEGIN", write.as_str(), "COMMIT"] {
            let got = without_table_oids(run(&mut through[0], sql).await);
            let want = without_table_oids(run(&mut direct[0], sql).await);
            assert_eq!(got, want, "{sql}");
        }
    }
    // Sessions add their counts to the pool's at the end of a transaction.
    assert!(
        autoprepared(&proxy) >= before + 4,
        "autoprepared {} -> {}",
        before,
        autoprepared(&proxy)
    );
}

/// A rule's `query` written as an operator writes it, with literals and its own spacing,
/// chooses the queries it spells out: normalized as client text is when the rules are taken.
#[tokio::test]
async fn a_rule_written_with_literals_matches_its_queries() {
    const DB: &str = "cache_rule_text";
    setup(
        DB,
        "CREATE TABLE lit (id int, v int); INSERT INTO lit VALUES (1, 10), (2, 20);",
    )
    .await;
    let mut spelled = rule("spelled", "");
    spelled.query_contains = None;
    spelled.query = Some("SELECT v  FROM lit\n WHERE id=7 /* the report */".into());
    let proxy = start_pgmemo(cache_config(PoolMode::Transaction, 2, vec![spelled])).await;
    let mut c = raw_proxy(&proxy, DB).await;
    for (sql, hits) in [
        ("SELECT v FROM lit WHERE id = 1", 0),
        ("SELECT v FROM lit WHERE id = 1", 1),
        ("SELECT v FROM lit WHERE id = 2", 1),
        ("SELECT v FROM lit WHERE id = 2", 2),
        // Another query is not chosen.
        ("SELECT v FROM lit WHERE id = 1 AND v = 10", 2),
        ("SELECT v FROM lit WHERE id = 1 AND v = 10", 2),
    ] {
        run(&mut c, sql).await;
        assert_eq!(stats(&proxy, "spelled").0, hits, "{sql}");
    }
}

/// A rule's `query_hash` (SHOW QUERIES' and SHOW AUTOPREPARE's) chooses its query whichever
/// protocol sends it: a prepared statement `... WHERE id = $1` and the simple query `...
/// WHERE id = 1` are one query with one hash, and SHOW QUERIES counts both in one row.
#[tokio::test]
async fn a_rule_by_query_hash_matches_the_query_in_both_protocols() {
    const DB: &str = "cache_rule_hash";
    setup(
        DB,
        "CREATE TABLE hashed (id int PRIMARY KEY, v int); INSERT INTO hashed VALUES (1, 10), (2, 20);",
    )
    .await;
    let hash = pgmemo::query::shapes::query_hash(b"SELECT v FROM hashed WHERE id = $1");
    let mut by_hash = rule("by_hash", "");
    by_hash.query_contains = None;
    by_hash.query_hash = Some(hash);
    let proxy = start_pgmemo(cache_config(PoolMode::Transaction, 2, vec![by_hash])).await;
    let client = connect(&proxy_url(
        proxy.local_addr(),
        PGMEMO_USER,
        Some(PGMEMO_PASS),
        DB,
    ))
    .await;
    let statement = client
        .prepare("SELECT v FROM hashed WHERE id = $1")
        .await
        .unwrap();
    for (id, hits) in [(1i32, 0), (1, 1), (2, 1), (2, 2)] {
        let v: i32 = client.query_one(&statement, &[&id]).await.unwrap().get(0);
        assert_eq!(v, id * 10);
        assert_eq!(stats(&proxy, "by_hash").0, hits, "extended, id {id}");
    }
    let mut c = raw_proxy(&proxy, DB).await;
    for (sql, hits) in [
        ("SELECT v FROM hashed WHERE id = 1", 2),
        ("SELECT v FROM hashed WHERE id = 1", 3),
        // Another query is not chosen.
        ("SELECT v FROM hashed WHERE id = 1 AND v = 10", 3),
        ("SELECT v FROM hashed WHERE id = 1 AND v = 10", 3),
    ] {
        assert_eq!(first_value(&run(&mut c, sql).await).as_deref(), Some("10"));
        assert_eq!(stats(&proxy, "by_hash").0, hits, "{sql}");
    }
    let figures = pgmemo::admin::query_figures(proxy.app());
    let rows: Vec<_> = figures.iter().filter(|q| q.query_hash == hash).collect();
    assert_eq!(rows.len(), 1);
    let q = rows[0];
    assert_eq!((q.calls, q.hits, q.misses), (6, 3, 3));
    assert_eq!(q.protocol, "both");
    let rules = proxy.app().cache.rule_stats();
    assert_eq!(rules[q.chosen as usize - 1].name, "by_hash");
}

/// Replies with the table OIDs of RowDescriptions zeroed: twin databases' tables differ only
/// there.
fn without_table_oids(mut replies: Vec<(u8, Vec<u8>)>) -> Vec<(u8, Vec<u8>)> {
    for (tag, body) in &mut replies {
        if *tag != b'T' {
            continue;
        }
        let fields = u16::from_be_bytes([body[0], body[1]]);
        let mut at = 2;
        for _ in 0..fields {
            at += body[at..].iter().position(|&b| b == 0).unwrap() + 1;
            body[at..at + 4].fill(0);
            at += 18;
        }
    }
    replies
}

/// `SELECT ...;` (as pgbench and psql scripts send it) and `SELECT ...` share an entry: their
/// replies are the same.
#[tokio::test]
async fn a_final_semicolon_shares_the_entry() {
    const DB: &str = "cache_semicolon";
    setup(
        DB,
        "CREATE TABLE semi (v int); INSERT INTO semi VALUES (4);",
    )
    .await;
    let proxy = start_pgmemo(cache_config(
        PoolMode::Transaction,
        1,
        vec![rule("semi", "FROM semi")],
    ))
    .await;
    let mut c = raw_proxy(&proxy, DB).await;
    let mut direct = raw_direct(DB).await;
    for sql in [
        "SELECT v FROM semi;",
        "SELECT v FROM semi",
        "SELECT v FROM semi ;  ",
    ] {
        assert_eq!(run(&mut c, sql).await, run(&mut direct, sql).await, "{sql}");
    }
    assert_eq!(
        stats(&proxy, "semi").0,
        2,
        "two hits on the first one's entry"
    );
}

/// An Execute with a row limit, as asyncpg's `fetchrow` and `fetchval` send (a limit of 1):
/// cached under its limit, and answered byte for byte as PostgreSQL answers it, PortalSuspended
/// included when rows are left; inside a transaction block, where the portal outlives the
/// Sync and the client may go on fetching, it is not answered from the cache.
#[tokio::test]
async fn an_execute_with_a_row_limit_hits_byte_identical() {
    const DB: &str = "cache_row_limit";
    setup(
        DB,
        "CREATE TABLE l (id int PRIMARY KEY, name text);
         INSERT INTO l SELECT i, 'l' || i FROM generate_series(1, 10) i;",
    )
    .await;
    let proxy = start_pgmemo(cache_config(
        PoolMode::Transaction,
        2,
        vec![rule("limit", "FROM l")],
    ))
    .await;
    let mut direct = raw_direct(DB).await;
    let mut through = raw_proxy(&proxy, DB).await;
    let sql = "SELECT id, name FROM l WHERE id <= $1 ORDER BY id";
    for c in [&mut direct, &mut through] {
        c.send(&[Frontend::parse("limited", sql, &[23]), Frontend::Sync])
            .await
            .unwrap();
        c.recv_until_ready(1).await.unwrap();
    }
    let before = stats(&proxy, "limit").0;
    for round in 0..3 {
        // Results of 0, 1, 2 and 5 rows under limits 1, 2 and none.
        for (rows, limit) in [(0, 1), (1, 1), (2, 1), (5, 2), (1, 0), (5, 0)] {
            let batch = [
                Frontend::bind("", "limited", &[Some(&rows.to_string())]),
                Frontend::describe_portal(""),
                Frontend::execute("", limit),
                Frontend::Sync,
            ];
            let mut replies = vec![];
            for c in [&mut direct, &mut through] {
                c.send(&batch).await.unwrap();
                replies.push(c.recv_until_ready(1).await.unwrap());
            }
            assert!(
                same_replies(&replies[0], &replies[1]),
                "{rows} rows, limit {limit}, round {round}: {:?} vs {:?}",
                replies[1],
                replies[0]
            );
        }
    }
    assert_eq!(
        stats(&proxy, "limit").0 - before,
        2 * 6,
        "every batch answered from the cache in rounds 1 and 2"
    );
    // In a transaction block the portal stays open after the Sync: the client fetches on.
    let hits = stats(&proxy, "limit").0;
    let block = [
        vec![Frontend::query("BEGIN")],
        vec![
            Frontend::bind("", "limited", &[Some("5")]),
            Frontend::execute("", 2),
            Frontend::Sync,
        ],
        vec![Frontend::execute("", 2), Frontend::Sync],
        vec![Frontend::query("COMMIT")],
    ];
    same_batches(
        &mut direct,
        &mut through,
        &block,
        "a row-limited read in a block",
    )
    .await;
    assert_eq!(
        stats(&proxy, "limit").0,
        hits,
        "no hit inside a transaction block"
    );
    assert!(cache_bypassed(&proxy, "row limit in a block, more rows possible") > 0);
}

/// In a transaction block, an Execute with a row limit (asyncpg's `fetchrow`/`fetchval`) of a
/// read that returns at most one row whatever the data (by its primary or a unique key, an
/// aggregate without GROUP BY, `LIMIT 1`, no FROM) is answered from the cache: its portal has
/// no rows left, and a later Execute, Describe or Close of it gets what PostgreSQL gives (the
/// portal is made on the server, run to its end). Reads that may return more rows are not
/// (a key parameter declared of another type, an `IN` list, a set-returning function, a
/// column that is no key, `GROUP BY ROLLUP`, `FETCH FIRST 1 ROW WITH TIES`).
#[tokio::test]
async fn a_row_limited_read_of_one_row_hits_in_a_block() {
    const DB: &str = "cache_one_row_block";
    setup(
        DB,
        "CREATE TABLE o (id int PRIMARY KEY, email text NOT NULL UNIQUE, nick text UNIQUE,            n int NOT NULL);
         INSERT INTO o SELECT i, 'e' || i, 'n' || i, i % 3 FROM generate_series(1, 10) i;",
    )
    .await;
    let proxy = start_pgmemo(cache_config(
        PoolMode::Transaction,
        2,
        vec![rule("one", "FROM o"), rule("nofrom", "SELECT 1 +")],
    ))
    .await;
    let mut direct = raw_direct(DB).await;
    let mut through = raw_proxy(&proxy, DB).await;
    // (text, declared parameter types, value, one row whatever the data)
    let reads: [(&str, &[u32], Option<&str>, bool); 13] = [
        ("SELECT email, n FROM o WHERE id = $1", &[], Some("3"), true),
        (
            "SELECT email, n FROM o WHERE id = $1",
            &[20],
            Some("4"),
            true,
        ),
        ("SELECT id FROM o WHERE email = $1", &[], Some("e5"), true),
        (
            "SELECT count(*) FROM o WHERE n = $1::int",
            &[],
            Some("1"),
            true,
        ),
        (
            "SELECT id FROM o WHERE n = $1::int ORDER BY id LIMIT 1",
            &[],
            Some("2"),
            true,
        ),
        ("SELECT 1 + $1::int", &[], Some("6"), true),
        // float8: `id = $1` compares as float8.
        (
            "SELECT email, n FROM o WHERE id = $1",
            &[701],
            Some("3"),
            false,
        ),
        (
            "SELECT email FROM o WHERE id IN (1, 2) AND n = $1::int",
            &[],
            Some("1"),
            false,
        ),
        (
            "SELECT generate_series(1, 2) FROM o WHERE id = $1::int",
            &[],
            Some("1"),
            false,
        ),
        // A unique column that may be NULL: `=` is never true of NULL.
        ("SELECT id FROM o WHERE nick = $1", &[], Some("n1"), true),
        ("SELECT id FROM o WHERE n = $1::int", &[], Some("1"), false),
        (
            "SELECT count(*) FROM o WHERE n = $1::int GROUP BY ROLLUP (n)",
            &[],
            Some("1"),
            false,
        ),
        (
            "SELECT id FROM o WHERE n >= $1::int ORDER BY n FETCH FIRST 1 ROW WITH TIES",
            &[],
            Some("0"),
            false,
        ),
    ];
    for (i, (sql, types, value, _)) in reads.iter().enumerate() {
        for c in [&mut direct, &mut through] {
            c.send(&[
                Frontend::parse(&format!("s{i}"), sql, types),
                Frontend::Sync,
            ])
            .await
            .unwrap();
            c.recv_until_ready(1).await.unwrap();
        }
        // Outside a block first (its entry: the same key as in a block).
        for c in [&mut direct, &mut through] {
            c.send(&[
                Frontend::bind("", &format!("s{i}"), &[*value]),
                Frontend::describe_portal(""),
                Frontend::execute("", 1),
                Frontend::Sync,
            ])
            .await
            .unwrap();
            c.recv_until_ready(1).await.unwrap();
        }
    }
    for round in 0..2 {
        for (i, (sql, _, value, one_row)) in reads.iter().enumerate() {
            let hits = stats(&proxy, "one").0 + stats(&proxy, "nofrom").0;
            let block = [
                vec![Frontend::query("BEGIN")],
                vec![
                    Frontend::bind("", &format!("s{i}"), &[*value]),
                    Frontend::describe_portal(""),
                    Frontend::execute("", 1),
                    Frontend::Sync,
                ],
                // The portal again: no rows left, its description, closed.
                vec![Frontend::execute("", 1), Frontend::Sync],
                vec![
                    Frontend::describe_portal(""),
                    Frontend::execute("", 0),
                    Frontend::close_portal(""),
                    Frontend::Sync,
                ],
                vec![Frontend::execute("", 0), Frontend::Sync],
                vec![Frontend::query("COMMIT")],
            ];
            let what = format!("{sql} (round {round})");
            same_batches(&mut direct, &mut through, &block, &what).await;
            let hit = stats(&proxy, "one").0 + stats(&proxy, "nofrom").0 > hits;
            assert_eq!(
                hit, *one_row,
                "{sql} (round {round}): answered from the cache"
            );
        }
    }
    assert!(cache_bypassed(&proxy, "row limit in a block, more rows possible") > 0);
}

/// A traceparent as sqlcommenter writes it, different for every `n`.
fn traceparent(n: u32) -> String {
    format!("traceparent='00-{n:032x}-{:016x}-01'", n * 7 + 1)
}

/// The hint's hits and stores.
fn hint_counts(proxy: &Pgmemo) -> (u64, u64) {
    let (hits, _, stores) = stats(proxy, "(hint)");
    (hits, stores)
}

/// A hint counts in any comment of the statement, where frameworks put theirs: trailing,
/// in the middle, a `--` comment, and sqlcommenter's `pgmemo` key, plain or URL-encoded.
/// Each is answered as PostgreSQL answers it, then from the cache.
#[tokio::test]
async fn hints_count_in_any_comment() {
    const DB: &str = "cache_hints_anywhere";
    setup(
        DB,
        "CREATE TABLE h (id int PRIMARY KEY, v text);
         INSERT INTO h SELECT i, 'v' || i FROM generate_series(1, 10) i;",
    )
    .await;
    let proxy = start_pgmemo(cache_config(PoolMode::Transaction, 2, vec![])).await;
    let mut direct = raw_direct(DB).await;
    let mut through = raw_proxy(&proxy, DB).await;
    let queries = [
        "SELECT v FROM h WHERE id = 1 /* pgmemo cache */".to_owned(),
        "SELECT v /* pgmemo cache ttl=30s */ FROM h WHERE id = 2".to_owned(),
        "SELECT v FROM h WHERE id = 3 -- pgmemo cache ttl=30s".to_owned(),
        format!(
            "SELECT v FROM h WHERE id = 4 /*pgmemo='cache ttl=30s',{}*/",
            traceparent(1)
        ),
        format!(
            "SELECT v FROM h WHERE id = 5 /*{},pgmemo='cache%20ttl%3D30s'*/",
            traceparent(2)
        ),
        "SELECT v FROM h WHERE id = 6 /*controller='h',pgmemo='cache'*/;".to_owned(),
    ];
    for (i, sql) in queries.iter().enumerate() {
        let expected = run(&mut direct, sql).await;
        for round in 0..2 {
            assert_eq!(run(&mut through, sql).await, expected, "{sql} ({round})");
        }
        let n = i as u64 + 1;
        assert_eq!(hint_counts(&proxy), (n, n), "{sql}: stored, then hit");
    }
}

/// Comments that change with every request (sqlcommenter's traceparent) are neither in the
/// cache's key nor in the shape: the requests share one entry and one shape.
#[tokio::test]
async fn a_trace_id_in_a_trailing_comment_shares_the_entry() {
    const DB: &str = "cache_hints_trace";
    setup(
        DB,
        "CREATE TABLE tr (id int PRIMARY KEY, v text);
         INSERT INTO tr SELECT i, 'v' || i FROM generate_series(1, 10) i;",
    )
    .await;
    let proxy = start_pgmemo(cache_config(PoolMode::Transaction, 2, vec![])).await;
    let mut direct = raw_direct(DB).await;
    let mut through = raw_proxy(&proxy, DB).await;
    let request = |n: u32| {
        format!(
            "SELECT v FROM tr WHERE id = 7 /*pgmemo='cache',route='%2Ftr',{}*/",
            traceparent(n)
        )
    };
    let expected = run(&mut direct, &request(0)).await;
    for n in 1..=5 {
        assert_eq!(
            run(&mut through, &request(n)).await,
            expected,
            "request {n}"
        );
    }
    assert_eq!(
        hint_counts(&proxy),
        (4, 1),
        "one entry, hit by every later request"
    );
    assert_eq!(proxy.app().cache.entries().len(), 1);
    let shapes: Vec<_> = proxy
        .app()
        .shapes
        .iter()
        .filter(|s| s.text().contains("FROM tr"))
        .collect();
    assert_eq!(shapes.len(), 1, "one shape for every trace id");
    assert!(!shapes[0].text().contains("traceparent"));
}

/// A hint's words in a string, a dollar-quoted body or a quoted name are no comment: a
/// `nocache` there does not stop a real hint, and a `cache` there caches nothing.
#[tokio::test]
async fn hint_words_in_strings_are_not_hints() {
    const DB: &str = "cache_hints_strings";
    setup(
        DB,
        "CREATE TABLE s (id int PRIMARY KEY, v text);
         INSERT INTO s SELECT i, 'v' || i FROM generate_series(1, 10) i;",
    )
    .await;
    let proxy = start_pgmemo(cache_config(PoolMode::Transaction, 2, vec![])).await;
    let mut direct = raw_direct(DB).await;
    let mut through = raw_proxy(&proxy, DB).await;
    let not_hints = [
        "SELECT '/* pgmemo cache */' AS c, v FROM s WHERE id = 1",
        "SELECT $$-- pgmemo cache$$ AS c, v FROM s WHERE id = 1",
        "SELECT $q$ /*pgmemo='cache'*/ $q$ AS c, v FROM s WHERE id = 1",
        "SELECT v AS \"/* pgmemo cache */\" FROM s WHERE id = 1",
        "SELECT E'\\' /* pgmemo cache */' AS c, v FROM s WHERE id = 1",
    ];
    for sql in not_hints {
        let expected = run(&mut direct, sql).await;
        for _ in 0..2 {
            assert_eq!(run(&mut through, sql).await, expected, "{sql}");
        }
    }
    assert_eq!(hint_counts(&proxy), (0, 0), "nothing cached by a string");
    // A nocache in a string does not count; the trailing hint does.
    let sql = "SELECT '/* pgmemo nocache */' AS c, v FROM s WHERE id = 2 /* pgmemo cache */";
    let expected = run(&mut direct, sql).await;
    for _ in 0..2 {
        assert_eq!(run(&mut through, sql).await, expected, "{sql}");
    }
    assert_eq!(hint_counts(&proxy), (1, 1));
    assert_eq!(cache_bypassed(&proxy, "nocache hint"), 0);
}

/// Several comments: a `nocache` anywhere wins over a `cache` (the safe choice), else the
/// first hint counts, whatever other comments there are.
#[tokio::test]
async fn several_comments_nocache_wins() {
    const DB: &str = "cache_hints_several";
    setup(
        DB,
        "CREATE TABLE sc (id int PRIMARY KEY, v text);
         INSERT INTO sc SELECT i, 'v' || i FROM generate_series(1, 10) i;",
    )
    .await;
    let proxy = start_pgmemo(cache_config(
        PoolMode::Transaction,
        2,
        vec![rule("sc", "FROM sc")],
    ))
    .await;
    let mut direct = raw_direct(DB).await;
    let mut through = raw_proxy(&proxy, DB).await;
    let nocache = [
        "/* app='x' */ SELECT v FROM sc WHERE id = 1 /* pgmemo cache ttl=30s */ -- pgmemo nocache",
        "/* pgmemo cache */ SELECT v FROM sc /*pgmemo='nocache'*/ WHERE id = 1",
    ];
    for sql in nocache {
        let expected = run(&mut direct, sql).await;
        for _ in 0..2 {
            assert_eq!(run(&mut through, sql).await, expected, "{sql}");
        }
    }
    assert_eq!(
        cache_bypassed(&proxy, "nocache hint"),
        4,
        "nocache, over the rule too"
    );
    assert_eq!(stats(&proxy, "sc"), (0, 0, 0));
    assert_eq!(hint_counts(&proxy), (0, 0));
    let sql = format!(
        "/* app='x' */ SELECT v FROM sc WHERE id = 2 /* pgmemo cache ttl=1h */ /* pgmemo cache ttl=bad */ /*{}*/",
        traceparent(3)
    );
    let expected = run(&mut direct, &sql).await;
    for _ in 0..2 {
        assert_eq!(run(&mut through, &sql).await, expected);
    }
    assert_eq!(
        hint_counts(&proxy),
        (1, 1),
        "the first good hint, not the rule"
    );
    let entry = proxy.app().cache.entries();
    assert!(
        entry.iter().any(|e| e.rule.name == "(hint)"),
        "stored under the hint"
    );
}

/// A malformed hint (an unknown word, a bad ttl) never changes what the query returns: it is
/// ignored, as if it were not there (a rule still caches the query), and counted.
#[tokio::test]
async fn malformed_hints_are_ignored_and_counted() {
    const DB: &str = "cache_hints_malformed";
    setup(
        DB,
        "CREATE TABLE m (id int PRIMARY KEY, v text);
         INSERT INTO m SELECT i, 'v' || i FROM generate_series(1, 10) i;
         CREATE TABLE ruled (id int PRIMARY KEY, v text);
         INSERT INTO ruled SELECT i, 'r' || i FROM generate_series(1, 10) i;",
    )
    .await;
    let proxy = start_pgmemo(cache_config(
        PoolMode::Transaction,
        2,
        vec![rule("ruled", "FROM ruled")],
    ))
    .await;
    let mut direct = raw_direct(DB).await;
    let mut through = raw_proxy(&proxy, DB).await;
    let malformed = [
        "/* pgmemo cahce */ SELECT v FROM m WHERE id = 1",
        "SELECT v FROM m WHERE id = 1 /* pgmemo cache ttl=abc */",
        "SELECT v FROM m WHERE id = 1 /* pgmemo cache ttl=-1 */",
        "SELECT v FROM m WHERE id = 1 -- pgmemo nocache please",
        "SELECT v FROM m WHERE id = 1 /*pgmemo='cache%20ttl%3Dforever'*/",
        "SELECT v FROM m WHERE id = 1 /* pgmemo */",
    ];
    for sql in malformed {
        let expected = run(&mut direct, sql).await;
        for _ in 0..2 {
            assert_eq!(run(&mut through, sql).await, expected, "{sql}");
        }
    }
    assert_eq!(
        hint_counts(&proxy),
        (0, 0),
        "nothing cached by a malformed hint"
    );
    assert_eq!(cache_bypassed(&proxy, "malformed hint"), 12);
    // Ignored: the rule caches the query as it would with no hint.
    let sql = "SELECT v FROM ruled WHERE id = 1 /* pgmemo nocahce */";
    let expected = run(&mut direct, sql).await;
    for _ in 0..3 {
        assert_eq!(run(&mut through, sql).await, expected);
    }
    assert_eq!(
        stats(&proxy, "ruled"),
        (2, 1, 1),
        "the rule's, as with no hint"
    );
    assert_eq!(cache_bypassed(&proxy, "nocache hint"), 0);
}

/// The replies to an unnamed statement's Parse, Bind (one text parameter), Describe, Execute
/// and Sync.
async fn unnamed(c: &mut RawClient, sql: &str, value: &str) -> Vec<(u8, Vec<u8>)> {
    c.send(&[
        Frontend::parse("", sql, &[]),
        Frontend::bind("", "", &[Some(value)]),
        Frontend::describe_portal(""),
        Frontend::execute("", 0),
        Frontend::Sync,
    ])
    .await
    .unwrap();
    c.recv_until_ready(1)
        .await
        .unwrap()
        .into_iter()
        .map(|m| (m.tag, m.body))
        .collect()
}

/// A statement of the extended protocol reads its hints in any comment too, once per
/// statement: a trailing hint caches it, a trailing `nocache` keeps the rule's hands off.
#[tokio::test]
async fn extended_statements_read_hints_in_any_comment() {
    const DB: &str = "cache_hints_extended";
    setup(
        DB,
        "CREATE TABLE x (id int PRIMARY KEY, v text);
         INSERT INTO x SELECT i, 'x' || i FROM generate_series(1, 10) i;",
    )
    .await;
    let proxy = start_pgmemo(cache_config(
        PoolMode::Transaction,
        2,
        vec![rule("x", "FROM x WHERE v")],
    ))
    .await;
    let mut direct = raw_direct(DB).await;
    let mut through = raw_proxy(&proxy, DB).await;
    let cached = format!(
        "SELECT v FROM x WHERE id = $1 /*pgmemo='cache%20ttl%3D30s',{}*/",
        traceparent(4)
    );
    let ruled_but_nocache = "SELECT id FROM x WHERE v = $1 -- pgmemo nocache";
    for (sql, value) in [(cached.as_str(), "3"), (ruled_but_nocache, "x4")] {
        let expected = unnamed(&mut direct, sql, value).await;
        // A statement no server has accepted yet goes to a server first: stored in round 1.
        for round in 0..4 {
            assert_eq!(
                unnamed(&mut through, sql, value).await,
                expected,
                "{sql} ({round})"
            );
        }
    }
    assert_eq!(hint_counts(&proxy), (2, 1));
    assert_eq!(
        stats(&proxy, "x"),
        (0, 0, 0),
        "the nocache wins over the rule"
    );
    assert_eq!(cache_bypassed(&proxy, "nocache hint"), 3);
}

/// A statement that differs from another only in a per-request comment (sqlcommenter's
/// trace id appended to every query, as psycopg 3, pgx or JDBC send it in the extended
/// protocol) shares its entries: the comment is not part of the key, and a server's
/// acceptance of one is the other's (PostgreSQL reads a comment as a space). Each answer is
/// PostgreSQL's.
#[tokio::test]
async fn a_per_request_comment_in_a_statement_shares_the_entry() {
    const DB: &str = "cache_trace_extended";
    setup(
        DB,
        "CREATE TABLE x (id int PRIMARY KEY, v text);
         INSERT INTO x SELECT i, 'x' || i FROM generate_series(1, 10) i;",
    )
    .await;
    let proxy = start_pgmemo(cache_config(
        PoolMode::Transaction,
        2,
        vec![rule("x", "FROM x")],
    ))
    .await;
    let mut direct = raw_direct(DB).await;
    let mut through = raw_proxy(&proxy, DB).await;
    let traced = |n| format!("SELECT v FROM x WHERE id = $1 /*{}*/", traceparent(n));
    let expected = unnamed(&mut direct, &traced(1), "3").await;
    // The first request's statement goes to a server (twice: stored at the second).
    for _ in 0..2 {
        assert_eq!(unnamed(&mut through, &traced(1), "3").await, expected);
    }
    let (hits, ..) = stats(&proxy, "x");
    for n in 2..6 {
        assert_eq!(
            unnamed(&mut through, &traced(n), "3").await,
            expected,
            "request {n}"
        );
    }
    assert_eq!(
        stats(&proxy, "x").0,
        hits + 4,
        "every later request's statement is a hit"
    );
    // Another value is another entry; a comment inside a string is not a comment.
    let other = unnamed(&mut direct, &traced(9), "4").await;
    assert_eq!(unnamed(&mut through, &traced(9), "4").await, other);
    let quoted = "SELECT v FROM x WHERE id = $1 AND v <> '/*x*/'";
    let expected = unnamed(&mut direct, quoted, "3").await;
    assert_eq!(unnamed(&mut through, quoted, "3").await, expected);
}

/// `sql` as an extended-protocol unit of the unnamed statement and portal: Parse, Bind (no
/// parameters), Execute, as JDBC sends `BEGIN` and `COMMIT`.
fn unit(sql: &str) -> Vec<Frontend> {
    vec![
        Frontend::parse("", sql, &[]),
        Frontend::bind("", "", &[]),
        Frontend::execute("", 0),
    ]
}

/// The messages `parts` in one batch, ended by a Sync.
fn synced(parts: &[&Vec<Frontend>]) -> Vec<Frontend> {
    let mut batch: Vec<Frontend> = parts.iter().flat_map(|p| p.iter().cloned()).collect();
    batch.push(Frontend::Sync);
    batch
}

/// The replies to `batch` (ended by one Sync), as (tag, body) pairs.
async fn batch_replies(c: &mut RawClient, batch: &[Frontend]) -> Vec<(u8, Vec<u8>)> {
    c.send(batch).await.expect("send");
    c.recv_until_ready(1)
        .await
        .expect("replies")
        .into_iter()
        .map(|m| (m.tag, m.body))
        .collect()
}

/// A `BEGIN` sent in the extended protocol (JDBC with autocommit off, often in the same Sync
/// as the block's first query; pgx, Npgsql) is kept as a simple one is: a block of hits takes
/// no server, and every reply is PostgreSQL's, byte for byte (compared with a twin database
/// read directly). What uses the BEGIN's portal, a miss, an error in the batch, a second
/// BEGIN and what pgmemo does not keep reach the server with the BEGIN ahead.
#[tokio::test]
async fn an_extended_begin_is_kept_without_a_server() {
    const DBS: [&str; 2] = ["cache_ext_kept", "cache_ext_kept_twin"];
    for db in DBS {
        setup(
            db,
            "CREATE TABLE kv (id int PRIMARY KEY, v int);
             INSERT INTO kv VALUES (1, 1), (2, 2), (3, 3);",
        )
        .await;
    }
    let proxy = start_pgmemo(cache_config(
        PoolMode::Transaction,
        2,
        vec![rule("kv", "FROM kv")],
    ))
    .await;
    let hits = |proxy: &Pgmemo| stats(proxy, "kv").0;
    let mut through = raw_proxy(&proxy, DBS[0]).await;
    let mut direct = raw_direct(DBS[1]).await;
    let admin = admin_console(proxy.local_addr()).await;
    let mut watch = raw_direct("postgres").await;
    let watch_sql = format!(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = '{}' AND state LIKE 'idle in transaction%'",
        DBS[0]
    );
    let read = |id: &str| {
        vec![
            Frontend::parse("", "SELECT v FROM kv WHERE id = $1", &[]),
            Frontend::bind("", "", &[Some(id)]),
            Frontend::describe_portal(""),
            Frontend::execute("", 0),
        ]
    };
    let begin = unit("BEGIN");
    let begin_described = vec![
        Frontend::parse("", "BEGIN", &[]),
        Frontend::bind("", "", &[]),
        Frontend::describe_portal(""),
        Frontend::execute("", 0),
    ];
    let named = |name: &str| vec![Frontend::bind("", name, &[]), Frontend::execute("", 0)];
    let commit = unit("COMMIT");
    let rollback = unit("ROLLBACK");
    let simple = |sql: &str| vec![Frontend::query(sql)];
    // (batch, answered by the cache, no server linked to the client and no backend of the
    // database in a transaction after it)
    let steps: Vec<(&str, Vec<Frontend>, bool, bool)> = vec![
        // A statement no server has parsed yet goes to one (as PostgreSQL must judge it),
        // then the cache fills.
        ("parse", synced(&[&read("1")]), false, true),
        ("fill", synced(&[&read("1")]), false, true),
        ("hit", synced(&[&read("1")]), true, true),
        (
            "simple fill",
            simple("SELECT v FROM kv WHERE id = 1"),
            false,
            true,
        ),
        // A BEGIN no server has parsed yet goes to one (as every new statement does).
        ("first BEGIN", synced(&[&begin]), false, false),
        (
            "hit in a server's block",
            synced(&[&read("1")]),
            true,
            false,
        ),
        ("first COMMIT", synced(&[&commit]), false, true),
        // Kept: a block of hits, ended here.
        ("BEGIN", synced(&[&begin]), false, true),
        ("hit in a kept block", synced(&[&read("1")]), true, true),
        ("COMMIT of a kept block", synced(&[&commit]), false, true),
        // JDBC: BEGIN and the first query in one Sync.
        ("BEGIN + hit", synced(&[&begin, &read("1")]), true, true),
        ("hit", synced(&[&read("1")]), true, true),
        ("first ROLLBACK", synced(&[&rollback]), false, true),
        ("BEGIN + hit", synced(&[&begin, &read("1")]), true, true),
        (
            "ROLLBACK of a kept block",
            synced(&[&rollback]),
            false,
            true,
        ),
        ("BEGIN, described", synced(&[&begin_described]), false, true),
        ("a lone Sync", synced(&[]), false, true),
        ("a simple COMMIT", simple("COMMIT"), false, true),
        (
            "BEGIN and COMMIT in one Sync",
            synced(&[&begin, &commit]),
            false,
            true,
        ),
        // A miss: BEGIN and the query go to the server together.
        ("BEGIN + miss", synced(&[&begin, &read("2")]), false, false),
        ("hit in the block", synced(&[&read("1")]), true, false),
        ("COMMIT", synced(&[&commit]), false, true),
        ("BEGIN", synced(&[&begin]), false, true),
        ("stored by a block", synced(&[&read("2")]), true, true),
        ("miss", synced(&[&read("3")]), false, false),
        ("COMMIT", synced(&[&commit]), false, true),
        // An error in the batch: the rest is skipped, the block fails.
        (
            "BEGIN + error",
            synced(&[&begin, &unit("SELECT 1/0"), &read("1")]),
            false,
            false,
        ),
        ("COMMIT of a failed block", synced(&[&commit]), false, true),
        // The BEGIN's portal and statement, used after it.
        ("BEGIN", synced(&[&begin]), false, true),
        (
            "Describe of its portal",
            synced(&[&vec![Frontend::describe_portal("")]]),
            false,
            false,
        ),
        ("ROLLBACK", synced(&[&rollback]), false, true),
        ("BEGIN", synced(&[&begin]), false, true),
        (
            "Execute of its portal",
            synced(&[&vec![Frontend::execute("", 0)]]),
            false,
            false,
        ),
        ("ROLLBACK", synced(&[&rollback]), false, true),
        ("BEGIN", synced(&[&begin]), false, true),
        (
            "a Parse, then Execute of its portal",
            synced(&[&vec![
                Frontend::parse("", "SELECT 1", &[]),
                Frontend::execute("", 0),
            ]]),
            false,
            false,
        ),
        ("ROLLBACK", synced(&[&rollback]), false, true),
        ("BEGIN", synced(&[&begin]), false, true),
        (
            "Close of its portal",
            synced(&[&vec![Frontend::close_portal("")]]),
            false,
            false,
        ),
        ("ROLLBACK", synced(&[&rollback]), false, true),
        ("BEGIN", synced(&[&begin]), false, true),
        (
            "Describe of its statement",
            synced(&[&vec![Frontend::describe_statement("")]]),
            false,
            false,
        ),
        ("ROLLBACK", synced(&[&rollback]), false, true),
        ("BEGIN", synced(&[&begin]), false, true),
        (
            "its statement again: WARNING",
            synced(&[&named("")]),
            false,
            false,
        ),
        ("ROLLBACK", synced(&[&rollback]), false, true),
        (
            "BEGIN + BEGIN: WARNING",
            synced(&[&begin, &begin]),
            false,
            false,
        ),
        ("COMMIT", synced(&[&commit]), false, true),
        ("simple BEGIN", simple("BEGIN"), false, true),
        ("BEGIN in it: WARNING", synced(&[&begin]), false, false),
        ("COMMIT", synced(&[&commit]), false, true),
        // Outside a block: PostgreSQL's warnings.
        ("COMMIT outside a block", synced(&[&commit]), false, true),
        (
            "ROLLBACK outside a block",
            synced(&[&rollback]),
            false,
            true,
        ),
        // Named statements (JDBC's after five uses).
        (
            "prepare",
            synced(&[&vec![
                Frontend::parse("b", "BEGIN", &[]),
                Frontend::parse("c", "COMMIT", &[]),
            ]]),
            false,
            true,
        ),
        (
            "named BEGIN + hit",
            synced(&[&named("b"), &read("1")]),
            true,
            true,
        ),
        ("named COMMIT", synced(&[&named("c")]), false, true),
        // Options.
        (
            "START TRANSACTION READ ONLY",
            synced(&[&unit(
                "START TRANSACTION ISOLATION LEVEL READ COMMITTED, READ ONLY",
            )]),
            false,
            false,
        ),
        ("COMMIT", synced(&[&commit]), false, true),
        (
            "START TRANSACTION READ ONLY",
            synced(&[&unit(
                "START TRANSACTION ISOLATION LEVEL READ COMMITTED, READ ONLY",
            )]),
            false,
            true,
        ),
        ("hit", synced(&[&read("1")]), true, true),
        ("END", synced(&[&unit("END")]), false, true),
        (
            "REPEATABLE READ is not kept",
            synced(&[&unit("BEGIN ISOLATION LEVEL REPEATABLE READ")]),
            false,
            false,
        ),
        ("ROLLBACK", synced(&[&rollback]), false, true),
        (
            "REPEATABLE READ is not kept",
            synced(&[&unit("BEGIN ISOLATION LEVEL REPEATABLE READ")]),
            false,
            false,
        ),
        ("no hit there", synced(&[&read("1")]), false, false),
        ("ROLLBACK", synced(&[&rollback]), false, true),
        // Another spelling: parsed by a server first, then kept.
        (
            "new text",
            synced(&[&unit("begin transaction;")]),
            false,
            false,
        ),
        ("COMMIT", synced(&[&commit]), false, true),
        ("kept", synced(&[&unit("begin transaction;")]), false, true),
        ("COMMIT", synced(&[&commit]), false, true),
        // A row limit (pgjdbc's 1 for COMMIT) changes nothing for them.
        (
            "BEGIN, a row limit",
            synced(&[&vec![
                Frontend::parse("", "BEGIN", &[]),
                Frontend::bind("", "", &[]),
                Frontend::execute("", 1),
            ]]),
            false,
            true,
        ),
        (
            "COMMIT, a row limit",
            synced(&[&vec![
                Frontend::parse("", "COMMIT", &[]),
                Frontend::bind("", "", &[]),
                Frontend::execute("", 1),
            ]]),
            false,
            true,
        ),
        // Kept in the extended protocol, ended in the simple one, and the other way round.
        ("BEGIN", synced(&[&begin]), false, true),
        (
            "simple hit",
            simple("SELECT v FROM kv WHERE id = 1"),
            true,
            true,
        ),
        ("simple ROLLBACK", simple("ROLLBACK"), false, true),
        ("simple BEGIN", simple("BEGIN"), false, true),
        ("COMMIT", synced(&[&commit]), false, true),
    ];
    for (i, (what, batch, hit, serverless)) in steps.iter().enumerate() {
        let before = hits(&proxy);
        let got = without_table_oids(batch_replies(&mut through, batch).await);
        let want = without_table_oids(batch_replies(&mut direct, batch).await);
        assert_eq!(got, want, "step {i}: {what}");
        assert_eq!(
            hits(&proxy) > before,
            *hit,
            "step {i}: {what}: answered by the cache"
        );
        let in_transaction = first_value(&run(&mut watch, &watch_sql).await);
        assert_eq!(
            in_transaction.as_deref() == Some("0"),
            *serverless,
            "step {i}: {what}: no backend in a transaction"
        );
        assert_eq!(
            linked_servers(&admin, DBS[0]).await == 0,
            *serverless,
            "step {i}: {what}: no server linked (SHOW POOLS sv_active)"
        );
    }
}

/// Servers linked to a client of `database` (SHOW POOLS `sv_active`).
async fn linked_servers(admin: &tokio_postgres::Client, database: &str) -> u64 {
    admin_rows(admin, "SHOW POOLS")
        .await
        .into_iter()
        .filter(|r| r["database"] == database)
        .map(|r| r["sv_active"].parse::<u64>().unwrap())
        .sum()
}

/// Servers handed to clients of `database` so far (SHOW STATS `total_server_assignment_count`).
async fn server_assignments(admin: &tokio_postgres::Client, database: &str) -> u64 {
    admin_rows(admin, "SHOW STATS")
        .await
        .into_iter()
        .filter(|r| r["database"] == database)
        .map(|r| r["total_server_assignment_count"].parse::<u64>().unwrap())
        .sum()
}

/// pgjdbc with autocommit off sends each block's BEGIN in the extended protocol, in the same
/// Sync as the block's first query (unnamed, then as its named S_1), and COMMIT and ROLLBACK
/// too: once its statements are known, its blocks of cached reads take no server at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pgjdbc_blocks_of_hits_take_no_server() {
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt};
    const DB: &str = "cache_jdbc_blocks";
    const WARM: usize = 20;
    const MEASURED: usize = 30;
    setup(
        DB,
        "CREATE TABLE kv (id int PRIMARY KEY, v int); INSERT INTO kv VALUES (1, 1), (2, 2);",
    )
    .await;
    let jar = pgjdbc_jar().await;
    let proxy = start_pgmemo(cache_config(
        PoolMode::Transaction,
        2,
        vec![rule("kv", "FROM kv")],
    ))
    .await;
    let admin = admin_console(proxy.local_addr()).await;
    let url = format!(
        "jdbc:postgresql://{}:{}/{DB}?user={PGMEMO_USER}&password={PGMEMO_PASS}&sslmode=disable",
        proxy.local_addr().ip(),
        proxy.local_addr().port()
    );
    let mut child = tokio::process::Command::new("java")
        .arg("-cp")
        .arg(&jar)
        .args(["JdbcBlocks", &url, &WARM.to_string(), &MEASURED.to_string()])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("java runs");
    let mut lines = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
    let mut output = Vec::new();
    let wait = std::time::Duration::from_secs(120);
    loop {
        let line = tokio::time::timeout(wait, lines.next_line())
            .await
            .expect("in time")
            .unwrap();
        match line {
            Some(l) if l == "WARM" => break,
            Some(l) => output.push(l),
            None => panic!("JdbcBlocks ended early: {output:?}"),
        }
    }
    let (assigned, hits) = (server_assignments(&admin, DB).await, stats(&proxy, "kv").0);
    let mut stdin = child.stdin.take().unwrap();
    stdin.write_all(b"go\n").await.unwrap();
    while let Some(l) = tokio::time::timeout(wait, lines.next_line())
        .await
        .expect("in time")
        .unwrap()
    {
        output.push(l);
    }
    let status = child.wait().await.unwrap();
    assert!(status.success(), "JdbcBlocks: {status}: {output:?}");
    assert!(
        output.last().is_some_and(|l| l.starts_with("OK")),
        "{output:?}"
    );
    assert_eq!(
        stats(&proxy, "kv").0 - hits,
        2 * MEASURED as u64,
        "every read of the measured blocks was a hit"
    );
    assert_eq!(
        server_assignments(&admin, DB).await,
        assigned,
        "the measured blocks took no server"
    );
}

/// A block that wrote while the cache was off (a RELOAD turned it off, another back on
/// before its COMMIT): what it wrote unseen is invalidated at its end all the same (the
/// database's results), not served stale to the clients that read it meanwhile.
#[tokio::test]
async fn writes_made_while_the_cache_was_off_are_invalidated() {
    const DB: &str = "cache_off_block";
    setup(
        DB,
        "CREATE TABLE kv (k int PRIMARY KEY, v int); INSERT INTO kv VALUES (1, 0), (2, 0);
         CREATE TABLE other (v int);",
    )
    .await;
    let on = || cache_config(PoolMode::Transaction, 2, vec![rule("kv", "FROM kv")]);
    let proxy = start_pgmemo(on()).await;
    let mut writer = raw_proxy(&proxy, DB).await;
    let mut reader = raw_proxy(&proxy, DB).await;
    let mut direct = raw_direct(DB).await;
    let read = "SELECT v FROM kv WHERE k = 1";
    run(&mut writer, "BEGIN").await;
    run(&mut writer, "INSERT INTO other VALUES (1)").await;
    let mut off = on();
    off.cache.enabled = false;
    proxy.reload_with(off).expect("reload");
    run(&mut writer, "UPDATE kv SET v = 1 WHERE k = 1").await;
    proxy.reload_with(on()).expect("reload");
    // Stored meanwhile: the write is not committed yet.
    run(&mut reader, read).await;
    run(&mut reader, read).await;
    assert!(stats(&proxy, "kv").0 >= 1, "the read was cached");
    run(&mut writer, "COMMIT").await;
    assert_eq!(run(&mut reader, read).await, run(&mut direct, read).await);
}

/// Every way of writing in `common::write_forms` (EXPLAIN ANALYZE, DO, CALL, MERGE, a
/// writable CTE, an upsert, a rule, a trigger on another table, a read that writes, a view, a
/// cascade, REFRESH MATERIALIZED VIEW) and a held cursor's FETCH, made by another client
/// through pgmemo: the reads cached before it give PostgreSQL's answer after it.
#[tokio::test]
async fn every_way_of_writing_invalidates() {
    use common::write_forms::{READS, SCHEMA, WRITES};
    const DB: &str = "cache_write_forms";
    setup(
        DB,
        &format!("{SCHEMA} GRANT ALL ON ALL TABLES IN SCHEMA public TO PUBLIC;"),
    )
    .await;
    let proxy = start_pgmemo(cache_config(
        PoolMode::Transaction,
        2,
        vec![rule("all", "FROM")],
    ))
    .await;
    let mut reader = raw_proxy(&proxy, DB).await;
    let mut writer = raw_proxy(&proxy, DB).await;
    let mut direct = raw_direct(DB).await;
    async fn cached_reads(proxy: &Pgmemo, reader: &mut RawClient) {
        let before = stats(proxy, "all").0;
        for _ in 0..2 {
            for read in READS {
                run(reader, read).await;
            }
        }
        assert!(stats(proxy, "all").0 > before, "the reads were cached");
    }
    async fn same(reader: &mut RawClient, direct: &mut RawClient, after: &str) {
        for read in READS {
            let (got, want) = (run(reader, read).await, run(direct, read).await);
            assert!(got == want, "{read} after {after}: {got:?} vs {want:?}");
        }
    }
    for (what, statements) in WRITES {
        cached_reads(&proxy, &mut reader).await;
        for statement in *statements {
            let replies = run(&mut writer, statement).await;
            assert!(
                !replies.iter().any(|(t, _)| *t == b'E'),
                "{what}: {replies:?}"
            );
        }
        same(&mut reader, &mut direct, what).await;
    }
    // A held cursor whose FETCH calls a writing function, in transactions after its own.
    run(
        &mut writer,
        "DECLARE c CURSOR WITH HOLD FOR SELECT bump(1) FROM generate_series(1, 3)",
    )
    .await;
    for _ in 0..2 {
        cached_reads(&proxy, &mut reader).await;
        run(&mut writer, "FETCH 1 FROM c").await;
        same(&mut reader, &mut direct, "a held cursor's FETCH").await;
    }
}

/// Session mode: a SET of a setting the key does not follow turns the client's caching off
/// (its server keeps the setting); a `DISCARD ALL` returns that server to the settings and role
/// the client logged in with, and turns it on again. Each reply is PostgreSQL's.
#[tokio::test]
async fn discard_all_turns_caching_on_again_in_session_mode() {
    const DB: &str = "cache_discard_all";
    setup(
        DB,
        "CREATE TABLE f (id int PRIMARY KEY, x float8); INSERT INTO f VALUES (1, 1 / 3.0);
         CREATE SCHEMA s2; CREATE TABLE s2.f (id int PRIMARY KEY, x float8);
         INSERT INTO s2.f VALUES (1, 2 / 3.0); GRANT ALL ON SCHEMA s2 TO PUBLIC;",
    )
    .await;
    let proxy = start_pgmemo(cache_config(
        PoolMode::Session,
        2,
        vec![rule("f", "FROM f")],
    ))
    .await;
    let mut through = raw_proxy(&proxy, DB).await;
    let mut direct = raw_direct(DB).await;
    let read = "SELECT x FROM f WHERE id = 1";
    // (statement, whether the read after it is answered from the cache)
    let steps = [
        (read, Some(true)),
        ("SET extra_float_digits = 0", Some(false)),
        ("SET ROLE NONE", Some(false)),
        ("DISCARD ALL", Some(true)),
        ("SET extra_float_digits = 0", Some(false)),
        // Not a DISCARD ALL alone: it runs in the implicit block of its text and fails.
        ("DISCARD ALL; SELECT 1", Some(false)),
        ("DISCARD TEMP", Some(false)),
        ("DISCARD ALL", Some(true)),
        // The search_path is part of the key (another f), and DISCARD ALL resets it too
        // (the read right after it may run on the server: pgmemo's own SET of the startup
        // search_path, carried to the server, goes ahead of it).
        ("SET search_path = s2, public", Some(false)),
        ("SET extra_float_digits = 0", Some(false)),
        ("DISCARD ALL", None),
        ("SELECT 1", Some(true)),
    ];
    run(&mut through, read).await;
    for (sql, served) in steps {
        assert_eq!(
            run(&mut through, sql).await,
            run(&mut direct, sql).await,
            "{sql}"
        );
        let hits = stats(&proxy, "f").0;
        assert_eq!(
            run(&mut through, read).await,
            run(&mut direct, read).await,
            "the read after {sql}"
        );
        let hit = stats(&proxy, "f").0 > hits;
        if let Some(served) = served {
            assert_eq!(hit, served, "the read after {sql} answered from the cache");
        }
    }
}

/// Transaction mode keys results by every setting and the role the client holds, as known
/// when its transaction began: whatever a block then does to them (`SET LOCAL ROLE`,
/// `set_config(..., true)`, a `SET` or `RESET` inside it, `SET SESSION AUTHORIZATION`, by the
/// simple or the extended protocol) must not be answered from a key without it: the block's
/// later reads go to the server (issue 54: a `SET LOCAL ROLE NONE` read rows its role may
/// not, and its COMMIT answered COMMIT where PostgreSQL answers ROLLBACK). Each reply is
/// PostgreSQL's, and the reads after each block are answered from the cache again.
#[tokio::test]
async fn a_blocks_own_role_or_setting_change_is_never_answered_from_the_cache() {
    const DB: &str = "cache_block_roles";
    setup(
        DB,
        "DO $$ BEGIN
           IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'c54_reader') THEN
             CREATE ROLE c54_reader; CREATE ROLE c54_other; CREATE ROLE c54_nobody;
           END IF; END $$;
         CREATE TABLE r (id int PRIMARY KEY, who text);
         INSERT INTO r VALUES (1, 'c54_reader'), (2, 'c54_other');
         ALTER TABLE r ENABLE ROW LEVEL SECURITY;
         CREATE POLICY mine ON r USING (who = current_user);
         GRANT SELECT ON r TO c54_reader, c54_other;
         CREATE TABLE f (id int PRIMARY KEY, x float8); INSERT INTO f VALUES (1, 1 / 3.0);
         GRANT SELECT ON f TO PUBLIC;",
    )
    .await;
    let proxy = start_pgmemo(cache_config(
        PoolMode::Transaction,
        2,
        vec![rule("r", "FROM r"), rule("f", "FROM f")],
    ))
    .await;
    let mut through = raw_proxy(&proxy, DB).await;
    let mut direct = raw_direct(DB).await;
    let reads = [
        ("r", "SELECT id, who FROM r ORDER BY id"),
        ("f", "SELECT x FROM f WHERE id = 1"),
    ];
    for sql in ["SET ROLE c54_reader", "SET extra_float_digits = 1"] {
        assert_eq!(run(&mut through, sql).await, run(&mut direct, sql).await);
    }
    let hits = |proxy: &Pgmemo| stats(proxy, "r").0 + stats(proxy, "f").0;
    // Filled, then answered from the cache: the reads the blocks below must not get.
    for (_, read) in reads {
        run(&mut through, read).await;
        let before = hits(&proxy);
        assert_eq!(run(&mut through, read).await, run(&mut direct, read).await);
        assert_eq!(hits(&proxy), before + 1, "{read} answered from the cache");
    }
    let changes = [
        "SET LOCAL ROLE c54_nobody",
        "SET LOCAL ROLE c54_other",
        "SET LOCAL ROLE NONE",
        "SELECT pg_catalog.set_config('role', 'c54_other', true)",
        "SET ROLE c54_other",
        "RESET ROLE",
        "SET SESSION AUTHORIZATION c54_other",
        "SET LOCAL extra_float_digits = 0",
        "SELECT pg_catalog.set_config('extra_float_digits', '0', true)",
        "SET extra_float_digits = 0",
        "RESET extra_float_digits",
        "RESET ALL",
    ];
    for change in changes {
        for end in ["COMMIT", "ROLLBACK"] {
            for extended in [false, true] {
                let what = format!("BEGIN; {change} (extended: {extended}); the reads; {end}");
                assert_eq!(
                    run(&mut through, "BEGIN").await,
                    run(&mut direct, "BEGIN").await
                );
                if extended {
                    let batch = vec![
                        Frontend::parse("", change, &[]),
                        Frontend::bind("", "", &[]),
                        Frontend::execute("", 0),
                        Frontend::Sync,
                    ];
                    same_batches(&mut direct, &mut through, &[batch], &what).await;
                } else {
                    assert_eq!(
                        run(&mut through, change).await,
                        run(&mut direct, change).await,
                        "{what}"
                    );
                }
                let before = hits(&proxy);
                for (_, read) in reads {
                    assert_eq!(
                        run(&mut through, read).await,
                        run(&mut direct, read).await,
                        "{what}: {read}"
                    );
                }
                assert_eq!(hits(&proxy), before, "{what}: answered from the cache");
                assert_eq!(
                    run(&mut through, end).await,
                    run(&mut direct, end).await,
                    "{what}"
                );
                // Back to the session's role and settings, as the reads were first keyed.
                for sql in [
                    "RESET SESSION AUTHORIZATION",
                    "SET ROLE c54_reader",
                    "SET extra_float_digits = 1",
                ] {
                    assert_eq!(run(&mut through, sql).await, run(&mut direct, sql).await);
                }
                let before = hits(&proxy);
                for (_, read) in reads {
                    assert_eq!(
                        run(&mut through, read).await,
                        run(&mut direct, read).await,
                        "after {what}: {read}"
                    );
                }
                assert_eq!(
                    hits(&proxy),
                    before + 2,
                    "after {what}: the session's reads answered from the cache again"
                );
            }
        }
    }
}
