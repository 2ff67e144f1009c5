//! Invalidation from the WAL (`cache.invalidation = "wal"`): cached results follow writes made
//! directly on PostgreSQL, not through pgmemo — an UPDATE, a trigger, `ON DELETE CASCADE`, a
//! function, TRUNCATE, COPY FROM, a partition's leaf read through its root, a table read
//! through a view. Each test waits for pgmemo's follower to have applied the server's WAL
//! position after the write (`SHOW CACHE WAL`'s applied LSN), never for a time.

mod common;

use common::first_value as value;
use common::*;
use pgmemo::config::cache::{CacheMode, Invalidation, Rule, WalPlugin};
use pgmemo::config::{Config, PoolMode};
use pgmemo::Pgmemo;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;
use tokio_postgres::Client;

/// The values written to a row, each with the server's WAL position after its commit.
type Writes = Vec<(i64, pgmemo::wal::Lsn)>;

fn rule(name: &str, contains: &str) -> Rule {
    cache_rule(name, contains)
}

fn wal_config(rules: Vec<Rule>) -> Config {
    let mut config = test_config(PoolMode::Transaction, 2);
    config.cache.enabled = true;
    config.cache.admit_after = 1;
    config.cache.invalidation = Invalidation::Wal;
    config.cache.rules = rules;
    config
}

async fn setup(db: &'static str, sql: &str) {
    fresh_db(db).await;
    let sql = sql.to_owned();
    tokio::task::spawn_blocking(move || cluster().psql(db, &sql))
        .await
        .unwrap();
}

fn hits(proxy: &Pgmemo, rule: &str) -> u64 {
    proxy
        .app()
        .cache
        .rule_stats()
        .into_iter()
        .find(|r| r.name == rule)
        .map(|r| r.hits.get())
        .expect("rule stats")
}

/// pgmemo's follower of the server database `db`, once started.
fn follower(proxy: &Pgmemo, db: &str) -> Option<std::sync::Arc<pgmemo::wal::Follower>> {
    wal_follower(proxy, db)
}

/// Waits until the follower of `db` serves cached results.
async fn wait_ready(proxy: &Pgmemo, db: &str) {
    wait_until(
        "the WAL follower to catch up",
        Duration::from_secs(30),
        || async { follower(proxy, db).is_some_and(|f| f.is_ready()) },
    )
    .await;
}

/// Waits until the follower of `db` has applied the server's WAL position as of now.
async fn wait_applied(proxy: &Pgmemo, direct: &Client, db: &str) {
    wait_wal_applied(proxy, direct, db).await;
}

/// For each (rule, cached read, direct write, value after): the read is answered from the
/// cache, the write is made on PostgreSQL directly, and once the follower applied it the read
/// gives the new value.
async fn writes_invalidate(
    proxy: &Pgmemo,
    client: &Client,
    direct: &Client,
    db: &str,
    cases: &[(&str, &str, &str, &str)],
) {
    for (rule, read, write, after) in cases {
        let before = cached(proxy, client, rule, read).await;
        assert_ne!(&before, after, "{read} before {write}");
        direct.batch_execute(write).await.unwrap();
        wait_applied(proxy, direct, db).await;
        assert_eq!(&value(client, read).await, after, "{read} after {write}");
    }
}

/// Reads `sql` through `client` (which starts the follower) until the follower's state is a
/// failure that says `says`.
async fn follower_fails(proxy: &Pgmemo, client: &Client, sql: &str, says: &str) {
    wait_until("the follower to fail", Duration::from_secs(30), || async {
        value(client, sql).await;
        proxy
            .app()
            .wal
            .followers()
            .iter()
            .any(|f| f.status().phase.contains(says))
    })
    .await;
}

/// Reads `sql` through pgmemo until it is answered from the cache (its rule's hits grow),
/// returning the value.
async fn cached(proxy: &Pgmemo, client: &Client, rule: &str, sql: &str) -> String {
    let before = hits(proxy, rule);
    let first = value(client, sql).await;
    let second = value(client, sql).await;
    assert_eq!(first, second, "{sql}");
    assert!(
        hits(proxy, rule) > before,
        "{sql} was not answered from the cache"
    );
    second
}

/// Auto mode's state of the shape whose text is `text` (None: no such shape, or neither chosen
/// nor retired).
fn auto_state(proxy: &Pgmemo, text: &str) -> Option<&'static str> {
    proxy
        .app()
        .shapes
        .iter()
        .find(|s| s.text() == text)
        .and_then(|s| pgmemo::cache::auto::state(&s))
}

/// `cache.mode = "auto"`: with no rule, pgmemo caches the read it saw called and measured,
/// follows writes made directly (the WAL), keeps a `nocache` query out, and retires a read
/// whose table is written between its reads (its lookups never hit).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_mode_caches_the_costly_reads_that_pay() {
    const DB: &str = "wal_auto";
    setup(
        DB,
        "CREATE TABLE a_kv (id int PRIMARY KEY, v int);
         INSERT INTO a_kv SELECT g, g FROM generate_series(1, 10) g;
         CREATE TABLE a_hot (v int); INSERT INTO a_hot VALUES (1);",
    )
    .await;
    let mut config = wal_config(vec![]);
    config.cache.mode = CacheMode::Auto;
    let proxy = start_pgmemo(config).await;
    let client = connect(&proxy_db_url(&proxy, DB)).await;
    let direct = connect(&direct_db_url(DB)).await;
    let read = "SELECT v FROM a_kv WHERE id = 3";
    assert_eq!(value(&client, read).await, "3");
    wait_ready(&proxy, DB).await;
    wait_until(
        "auto mode to choose the read",
        Duration::from_secs(30),
        || async {
            value(&client, read).await;
            hits(&proxy, "(auto)") > 0
        },
    )
    .await;
    assert!(auto_state(&proxy, "SELECT v FROM a_kv WHERE id = $1")
        .is_some_and(|s| s.starts_with("chosen")));
    // A write made directly: the next read has it.
    direct
        .batch_execute("UPDATE a_kv SET v = 30 WHERE id = 3")
        .await
        .unwrap();
    wait_applied(&proxy, &direct, DB).await;
    assert_eq!(value(&client, read).await, "30");
    assert_eq!(value(&client, read).await, "30");
    // nocache keeps it out.
    let before = hits(&proxy, "(auto)");
    value(&client, &format!("/* pgmemo nocache */ {read}")).await;
    assert_eq!(hits(&proxy, "(auto)"), before);
    // Written between every read: chosen, then retired.
    let hot = "SELECT v FROM a_hot";
    wait_until(
        "auto mode to retire a read of a table written between its reads",
        Duration::from_secs(60),
        || async {
            value(&client, hot).await;
            client
                .batch_execute("UPDATE a_hot SET v = v + 1")
                .await
                .unwrap();
            // Caught up, so that the next read is looked up (not passed by while the WAL
            // is behind).
            wait_applied(&proxy, &direct, DB).await;
            auto_state(&proxy, hot).is_some_and(|s| s.starts_with("retired"))
        },
    )
    .await;
    let v = value(&direct, hot).await;
    assert_eq!(value(&client, hot).await, v);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_made_directly_invalidate_cached_reads() {
    const DB: &str = "wal_writes";
    setup(
        DB,
        "CREATE TABLE t (id int PRIMARY KEY, v int); INSERT INTO t VALUES (1, 1);
         CREATE TABLE audit (n int); INSERT INTO audit VALUES (0);
         CREATE TABLE src (id int);
         CREATE FUNCTION bump_audit() RETURNS trigger LANGUAGE plpgsql AS
           $$ BEGIN UPDATE audit SET n = n + 1; RETURN NEW; END $$;
         CREATE TRIGGER src_audit AFTER INSERT ON src FOR EACH ROW EXECUTE FUNCTION bump_audit();
         CREATE TABLE parent (id int PRIMARY KEY);
         CREATE TABLE child (pid int REFERENCES parent ON DELETE CASCADE);
         INSERT INTO parent VALUES (1), (2); INSERT INTO child VALUES (1), (1), (2);
         CREATE FUNCTION set_v(x int) RETURNS void LANGUAGE sql AS 'UPDATE t SET v = x WHERE id = 1';
         CREATE TABLE gone (x int); INSERT INTO gone VALUES (1), (2);
         CREATE TABLE copied (x int);
         CREATE TABLE measures (at int, v int) PARTITION BY RANGE (at);
         CREATE TABLE measures_1 PARTITION OF measures FOR VALUES FROM (0) TO (100);
         INSERT INTO measures VALUES (1, 10);
         CREATE VIEW t_view AS SELECT v * 100 AS big FROM t WHERE id = 1;",
    )
    .await;
    let proxy = start_pgmemo(wal_config(vec![
        rule("t", "FROM t WHERE"),
        rule("audit", "FROM audit"),
        rule("child", "FROM child"),
        rule("gone", "FROM gone"),
        rule("copied", "FROM copied"),
        rule("measures", "FROM measures"),
        rule("view", "FROM t_view"),
    ]))
    .await;
    let client = connect(&proxy_db_url(&proxy, DB)).await;
    let direct = connect(&direct_db_url(DB)).await;
    // The first lookup starts following the database; nothing is served until it caught up.
    assert_eq!(value(&client, "SELECT v FROM t WHERE id = 1").await, "1");
    wait_ready(&proxy, DB).await;

    let cases: &[(&str, &str, &str, &str)] = &[
        // (rule, cached read, direct write, value after)
        (
            "t",
            "SELECT v FROM t WHERE id = 1",
            "UPDATE t SET v = 2 WHERE id = 1",
            "2",
        ),
        (
            "audit",
            "SELECT n FROM audit",
            "INSERT INTO src VALUES (1)",
            "1",
        ),
        (
            "child",
            "SELECT count(*) FROM child",
            "DELETE FROM parent WHERE id = 1",
            "1",
        ),
        ("t", "SELECT v FROM t WHERE id = 1", "SELECT set_v(7)", "7"),
        ("gone", "SELECT count(*) FROM gone", "TRUNCATE gone", "0"),
        (
            "copied",
            "SELECT count(*) FROM copied",
            "COPY copied FROM PROGRAM 'echo 5'",
            "1",
        ),
        (
            "measures",
            "SELECT sum(v) FROM measures",
            "INSERT INTO measures_1 VALUES (2, 5)",
            "15",
        ),
        (
            "view",
            "SELECT big FROM t_view",
            "UPDATE t SET v = 3 WHERE id = 1",
            "300",
        ),
    ];
    writes_invalidate(&proxy, &client, &direct, DB, cases).await;
    let admin = admin_console(proxy.local_addr()).await;
    let rows = admin_rows(&admin, "SHOW CACHE WAL").await;
    let row = rows
        .iter()
        .find(|r| r["database"] == DB)
        .map(|r| (r["state"].clone(), r["commits"].clone()))
        .expect("a SHOW CACHE WAL row");
    assert_eq!(row.0, "streaming");
    assert!(
        row.1.parse::<u64>().unwrap() >= cases.len() as u64,
        "{row:?}"
    );
    proxy.shutdown().await;
    // The temporary slot went with pgmemo's connection (other tests' slots, of other
    // databases, may be there meanwhile).
    let slots = format!(
        "SELECT count(*) FROM pg_replication_slots WHERE slot_name LIKE 'pgmemo%' \
         AND database = '{DB}'"
    );
    wait_until("the slot to go", Duration::from_secs(10), || async {
        value(&direct, &slots).await == "0"
    })
    .await;
}

/// The stream drops (its walsender is terminated): the database's entries are flushed and
/// nothing is served until the follower is back and caught up, so a write made meanwhile is
/// never hidden by an old entry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_stream_flushes_and_comes_back() {
    const DB: &str = "wal_drop";
    setup(
        DB,
        "CREATE TABLE k (id int PRIMARY KEY, v int); INSERT INTO k VALUES (1, 1);",
    )
    .await;
    let proxy = start_pgmemo(wal_config(vec![rule("k", "FROM k")])).await;
    let client = connect(&proxy_db_url(&proxy, DB)).await;
    let direct = connect(&direct_db_url(DB)).await;
    value(&client, "SELECT v FROM k WHERE id = 1").await;
    wait_ready(&proxy, DB).await;
    assert_eq!(
        cached(&proxy, &client, "k", "SELECT v FROM k WHERE id = 1").await,
        "1"
    );
    direct
        .batch_execute(&format!(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
             WHERE backend_type = 'walsender' AND datname = '{DB}'"
        ))
        .await
        .unwrap();
    direct
        .batch_execute("UPDATE k SET v = 2 WHERE id = 1")
        .await
        .unwrap();
    // Whether or not pgmemo noticed the drop yet, the value read is never the old one once
    // the follower is back: the drop flushed the entry.
    wait_until(
        "the follower to reconnect",
        Duration::from_secs(30),
        || async {
            follower(&proxy, DB).is_some_and(|f| f.connects.load(Relaxed) >= 2 && f.is_ready())
        },
    )
    .await;
    assert_eq!(value(&client, "SELECT v FROM k WHERE id = 1").await, "2");
    assert_eq!(
        cached(&proxy, &client, "k", "SELECT v FROM k WHERE id = 1").await,
        "2"
    );
    proxy.shutdown().await;
}

/// A replication role that may not replicate: pgmemo starts, says why (SHOW CACHE WAL), and
/// serves every query uncached and right.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_role_without_replication_serves_uncached() {
    const DB: &str = "wal_norepl";
    setup(DB, "CREATE TABLE n (v int); INSERT INTO n VALUES (1);").await;
    let mut config = wal_config(vec![rule("n", "FROM n")]);
    config.cache.replication_user = Some(MD5_USER.into());
    config.cache.replication_password = Some(MD5_PASS.into());
    let proxy = start_pgmemo(config).await;
    let client = connect(&proxy_db_url(&proxy, DB)).await;
    let direct = connect(&direct_db_url(DB)).await;
    follower_fails(&proxy, &client, "SELECT v FROM n", "REPLICATION").await;
    for i in 2..5 {
        direct
            .batch_execute(&format!("UPDATE n SET v = {i}"))
            .await
            .unwrap();
        assert_eq!(value(&client, "SELECT v FROM n").await, i.to_string());
    }
    assert_eq!(hits(&proxy, "n"), 0);
    proxy.shutdown().await;
}

/// The stream logs in as pgmemo's own role (`[upstream]`'s user, which has REPLICATION), not as
/// the client whose query started it: that client logs into PostgreSQL as itself, a role
/// without REPLICATION, and its cached read still follows a direct write.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_stream_logs_in_as_pgmemos_own_role_not_as_the_client() {
    const DB: &str = "wal_own_role";
    setup(
        DB,
        &format!(
            "CREATE TABLE t (v int); INSERT INTO t VALUES (1); GRANT SELECT ON t TO {SCRAM_USER};"
        ),
    )
    .await;
    let mut config = wal_config(vec![rule("t", "FROM t")]);
    for (name, password) in [(PGMEMO_USER, PGMEMO_PASS), (SCRAM_USER, SCRAM_PASS)] {
        config.users.insert(
            name.into(),
            pgmemo::config::UserConfig {
                password: Some(password.into()),
                ..Default::default()
            },
        );
    }
    let proxy = start_pgmemo(config).await;
    let client = connect(&proxy_url(
        proxy.local_addr(),
        SCRAM_USER,
        Some(SCRAM_PASS),
        DB,
    ))
    .await;
    let direct = connect(&direct_db_url(DB)).await;
    assert_eq!(value(&client, "SELECT session_user").await, SCRAM_USER);
    value(&client, "SELECT v FROM t").await;
    wait_ready(&proxy, DB).await;
    writes_invalidate(
        &proxy,
        &client,
        &direct,
        DB,
        &[("t", "SELECT v FROM t", "UPDATE t SET v = 2", "2")],
    )
    .await;
    proxy.shutdown().await;
}

/// The same through pgoutput (`cache.wal_plugin = "pgoutput"`): pgmemo makes its publication
/// (`FOR ALL TABLES`) and follows writes by relation id, a partition's leaf invalidating reads
/// of its root. (Such a publication makes PostgreSQL refuse UPDATE/DELETE on tables without a
/// replica identity: these tables have primary keys.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pgoutput_follows_writes_too() {
    const DB: &str = "wal_pgoutput";
    setup(
        DB,
        "CREATE TABLE p (id int PRIMARY KEY, v int); INSERT INTO p VALUES (1, 1);
         CREATE TABLE readings (at int, v int, PRIMARY KEY (at)) PARTITION BY RANGE (at);
         CREATE TABLE readings_1 PARTITION OF readings FOR VALUES FROM (0) TO (100);
         INSERT INTO readings VALUES (1, 10);",
    )
    .await;
    let mut config = wal_config(vec![rule("p", "FROM p"), rule("readings", "FROM readings")]);
    config.cache.wal_plugin = pgmemo::config::cache::WalPlugin::Pgoutput;
    let proxy = start_pgmemo(config).await;
    let client = connect(&proxy_db_url(&proxy, DB)).await;
    let direct = connect(&direct_db_url(DB)).await;
    value(&client, "SELECT v FROM p WHERE id = 1").await;
    wait_ready(&proxy, DB).await;
    assert_eq!(
        value(
            &direct,
            "SELECT count(*) FROM pg_publication WHERE pubname = 'pgmemo'"
        )
        .await,
        "1"
    );
    let cases: &[(&str, &str, &str, &str)] = &[
        (
            "p",
            "SELECT v FROM p WHERE id = 1",
            "UPDATE p SET v = 2 WHERE id = 1",
            "2",
        ),
        (
            "p",
            "SELECT v FROM p WHERE id = 1",
            "DELETE FROM p",
            "no row",
        ),
        (
            "readings",
            "SELECT sum(v) FROM readings",
            "UPDATE readings_1 SET v = 11",
            "11",
        ),
        (
            "readings",
            "SELECT sum(v) FROM readings",
            "TRUNCATE readings_1",
            "NULL",
        ),
    ];
    writes_invalidate(&proxy, &client, &direct, DB, cases).await;
    proxy.shutdown().await;
}

/// Two pgmemo instances on one server, each following the WAL: writers update rows through A
/// while readers read them, cached, through B. Once a writer's commit is within B's applied
/// position, B never serves an older value of that row (each read is checked against the
/// writes B had applied when it started).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_stay_consistent() {
    use std::sync::{Arc, Mutex};
    const DB: &str = "wal_two";
    const WRITERS: usize = 5;
    const WRITES: i64 = 30;
    const READERS: usize = 8;
    setup(
        DB,
        "CREATE TABLE counters (id int PRIMARY KEY, v int);
         INSERT INTO counters SELECT g, 0 FROM generate_series(0, 4) g;",
    )
    .await;
    let a = start_pgmemo(wal_config(vec![rule("counters", "FROM counters")])).await;
    let b = start_pgmemo(wal_config(vec![rule("counters", "FROM counters")])).await;
    for proxy in [&a, &b] {
        let c = connect(&proxy_db_url(proxy, DB)).await;
        value(&c, "SELECT v FROM counters WHERE id = 0").await;
        wait_ready(proxy, DB).await;
    }
    // Per row: the values committed through A, with the WAL position after each commit.
    let committed: Arc<Mutex<Vec<Writes>>> =
        Arc::new(Mutex::new(vec![vec![(0, pgmemo::wal::Lsn(0))]; WRITERS]));
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut writers = Vec::new();
    for w in 0..WRITERS {
        let url = proxy_db_url(&a, DB);
        let committed = committed.clone();
        writers.push(tokio::spawn(async move {
            let c = connect(&url).await;
            for i in 1..=WRITES {
                c.batch_execute(&format!("UPDATE counters SET v = {i} WHERE id = {w}"))
                    .await
                    .unwrap();
                let lsn = value(&c, "SELECT pg_current_wal_insert_lsn()")
                    .await
                    .parse()
                    .unwrap();
                committed.lock().unwrap()[w].push((i, lsn));
            }
        }));
    }
    let mut readers = Vec::new();
    for r in 0..READERS {
        let url = proxy_db_url(&b, DB);
        let committed = committed.clone();
        let done = done.clone();
        let app = b.app().clone();
        readers.push(tokio::spawn(async move {
            let c = connect(&url).await;
            let mut reads = 0u64;
            let mut row = r % WRITERS;
            // At least a few rounds of the rows each, however fast the writers were (they may
            // be done before a reader has logged in): B then has stable rows to answer.
            while !done.load(Relaxed) || reads < 4 * WRITERS as u64 {
                // The newest value of the row whose commit B had applied before this read.
                let applied = app
                    .wal
                    .followers()
                    .iter()
                    .find(|f| &*f.database == DB)
                    .map(|f| f.applied())
                    .unwrap_or_default();
                let floor = committed.lock().unwrap()[row]
                    .iter()
                    .filter(|(_, lsn)| *lsn <= applied)
                    .map(|(v, _)| *v)
                    .max()
                    .unwrap_or(0);
                let got: i64 = value(&c, &format!("SELECT v FROM counters WHERE id = {row}"))
                    .await
                    .parse()
                    .unwrap();
                assert!(
                    got >= floor,
                    "B served {got} for row {row} after it had applied the commit of {floor}"
                );
                reads += 1;
                row = (row + 1) % WRITERS;
            }
            reads
        }));
    }
    for w in writers {
        w.await.unwrap();
    }
    done.store(true, Relaxed);
    let mut reads = 0;
    for r in readers {
        reads += r.await.unwrap();
    }
    // Through B, the final values once it has applied them.
    let direct = connect(&direct_db_url(DB)).await;
    wait_applied(&b, &direct, DB).await;
    let c = connect(&proxy_db_url(&b, DB)).await;
    for w in 0..WRITERS {
        assert_eq!(
            value(&c, &format!("SELECT v FROM counters WHERE id = {w}")).await,
            WRITES.to_string()
        );
    }
    let hits = hits(&b, "counters");
    let lag = b.app().wal.followers()[0].status().lag_us;
    eprintln!("two instances: {reads} reads through B, {hits} cache hits, invalidation lag p50/p99 {lag:?} µs");
    assert!(hits > 0, "B answered nothing from its cache");
    assert!(lag.is_some());
    a.shutdown().await;
    b.shutdown().await;
}

fn private_config(pg: &pgmemo::demo::LocalPostgres, rules: Vec<Rule>) -> Config {
    let mut config = wal_config(rules);
    config.upstream = Some(pgmemo::config::Upstream {
        host: "127.0.0.1".into(),
        port: pg.port(),
        user: "postgres".into(),
        password: None,
        ..Default::default()
    });
    config.general.auth_type = pgmemo::config::AuthType::Trust;
    config
}

fn private_url(addr: std::net::SocketAddr) -> String {
    format!(
        "postgresql://postgres@{}:{}/postgres",
        addr.ip(),
        addr.port()
    )
}

/// A private cluster with `settings` that keep the follower from starting: pgmemo says why
/// (`says`, in SHOW CACHE WAL's state), and serves every read uncached and right.
async fn serves_uncached_and_says_why(
    settings: &'static [(&'static str, &'static str)],
    says: &str,
) {
    let pg = tokio::task::spawn_blocking(move || private_cluster(settings))
        .await
        .unwrap();
    pg.psql(
        "postgres",
        "CREATE TABLE w (v int); INSERT INTO w VALUES (1);",
    )
    .unwrap();
    let proxy = start_pgmemo(private_config(&pg, vec![rule("w", "FROM w")])).await;
    let client = connect(&private_url(proxy.local_addr())).await;
    follower_fails(&proxy, &client, "SELECT v FROM w", says).await;
    pg.psql("postgres", "UPDATE w SET v = 2").unwrap();
    assert_eq!(value(&client, "SELECT v FROM w").await, "2");
    assert_eq!(hits(&proxy, "w"), 0);
    proxy.shutdown().await;
}

/// `wal_level = replica`: pgmemo starts, says what to change, and serves uncached.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wal_level_replica_serves_uncached_and_says_why() {
    serves_uncached_and_says_why(
        &[("wal_level", "replica")],
        "wal_level is replica: set wal_level = logical",
    )
    .await;
}

/// The server restarts (`pg_ctl restart -m fast`) while a writer writes directly and readers
/// read through pgmemo: no read is ever older than a write the follower had applied when the
/// read started, the follower reconnects by itself and caching resumes, and its temporary
/// slot does not outlive pgmemo.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_restart_under_load() {
    use std::sync::{Arc, Mutex};
    let pg = tokio::task::spawn_blocking(|| private_cluster(&[("wal_level", "logical")]))
        .await
        .unwrap();
    pg.psql(
        "postgres",
        "CREATE TABLE r (id int PRIMARY KEY, v int); INSERT INTO r VALUES (1, 0);",
    )
    .unwrap();
    let direct_url = pg.url("postgres", None, "postgres");
    let proxy = start_pgmemo(private_config(&pg, vec![rule("r", "FROM r")])).await;
    let url = private_url(proxy.local_addr());
    let first = connect(&url).await;
    value(&first, "SELECT v FROM r WHERE id = 1").await;
    wait_ready(&proxy, "postgres").await;
    let pg = Arc::new(Mutex::new(pg));
    let written: Arc<Mutex<Writes>> = Arc::new(Mutex::new(vec![]));
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let follower = || follower(&proxy, "postgres").expect("the follower");
    let applied_of = follower();
    let mut readers = Vec::new();
    for _ in 0..4 {
        let (url, written, stop, f) = (
            url.clone(),
            written.clone(),
            stop.clone(),
            applied_of.clone(),
        );
        readers.push(tokio::spawn(async move {
            let mut checked = 0u64;
            while !stop.load(Relaxed) {
                let Ok((c, conn)) = tokio_postgres::connect(&url, tokio_postgres::NoTls).await
                else {
                    continue;
                };
                tokio::spawn(conn);
                while !stop.load(Relaxed) {
                    let applied = f.applied();
                    let floor = written
                        .lock()
                        .unwrap()
                        .iter()
                        .filter(|(_, lsn)| *lsn <= applied)
                        .map(|(v, _)| *v)
                        .max()
                        .unwrap_or(0);
                    let Ok(rows) = c.simple_query("SELECT v FROM r WHERE id = 1").await else {
                        break; // the restart: connect again
                    };
                    let got: i64 = rows
                        .iter()
                        .find_map(|m| match m {
                            tokio_postgres::SimpleQueryMessage::Row(r) => {
                                r.get(0).map(str::to_owned)
                            }
                            _ => None,
                        })
                        .unwrap()
                        .parse()
                        .unwrap();
                    assert!(
                        got >= floor,
                        "read {got} after the follower had applied {floor}"
                    );
                    checked += 1;
                }
            }
            checked
        }));
    }
    let write = |i: i64| {
        let (direct_url, written) = (direct_url.clone(), written.clone());
        async move {
            loop {
                let Ok((c, conn)) =
                    tokio_postgres::connect(&direct_url, tokio_postgres::NoTls).await
                else {
                    continue;
                };
                tokio::spawn(conn);
                if c.batch_execute(&format!("UPDATE r SET v = {i} WHERE id = 1"))
                    .await
                    .is_err()
                {
                    continue;
                }
                let lsn = value(&c, "SELECT pg_current_wal_insert_lsn()")
                    .await
                    .parse()
                    .unwrap();
                written.lock().unwrap().push((i, lsn));
                return;
            }
        }
    };
    for i in 1..=20 {
        write(i).await;
    }
    let restarting = pg.clone();
    tokio::task::spawn_blocking(move || restarting.lock().unwrap().restart("fast").unwrap())
        .await
        .unwrap();
    for i in 21..=40 {
        write(i).await;
    }
    wait_until(
        "the follower to be back",
        Duration::from_secs(60),
        || async {
            let f = follower();
            f.connects.load(Relaxed) >= 2 && f.is_ready()
        },
    )
    .await;
    let direct = connect(&direct_url).await;
    wait_applied(&proxy, &direct, "postgres").await;
    stop.store(true, Relaxed);
    let mut checked = 0;
    for r in readers {
        checked += r.await.unwrap();
    }
    let after = connect(&url).await;
    assert_eq!(value(&after, "SELECT v FROM r WHERE id = 1").await, "40");
    assert_eq!(
        cached(&proxy, &after, "r", "SELECT v FROM r WHERE id = 1").await,
        "40"
    );
    eprintln!(
        "restart: {checked} reads checked, {} connects",
        follower().connects.load(Relaxed)
    );
    proxy.shutdown().await;
    wait_until("the slot to go", Duration::from_secs(10), || async {
        value(&direct, "SELECT count(*) FROM pg_replication_slots").await == "0"
    })
    .await;
}

fn bypassed_behind(proxy: &Pgmemo) -> u64 {
    cache_bypassed(proxy, "WAL stream not caught up")
}

/// `cache.max_lag`: while the stream is silent (its walsender stopped with SIGSTOP) for longer
/// than the bound, nothing is served from the cache — a write made meanwhile is read at once —
/// and once it speaks again, caching resumes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_lag_stops_serving_a_silent_stream() {
    const DB: &str = "wal_lag";
    setup(
        DB,
        "CREATE TABLE l (id int PRIMARY KEY, v int); INSERT INTO l VALUES (1, 1);",
    )
    .await;
    let mut config = wal_config(vec![rule("l", "FROM l")]);
    config.cache.max_lag = Some(Duration::from_secs(1));
    let proxy = start_pgmemo(config).await;
    let client = connect(&proxy_db_url(&proxy, DB)).await;
    let direct = connect(&direct_db_url(DB)).await;
    value(&client, "SELECT v FROM l WHERE id = 1").await;
    wait_ready(&proxy, DB).await;
    assert_eq!(
        cached(&proxy, &client, "l", "SELECT v FROM l WHERE id = 1").await,
        "1"
    );
    let pid: i32 = value(
        &direct,
        &format!("SELECT pid FROM pg_stat_activity WHERE backend_type = 'walsender' AND datname = '{DB}'"),
    )
    .await
    .parse()
    .unwrap();
    let signal = |sig: libc::c_int| {
        // SAFETY: kill(2) on a process id; no memory is involved.
        assert_eq!(unsafe { libc::kill(pid, sig) }, 0, "signal {sig} to {pid}");
    };
    signal(libc::SIGSTOP);
    let before = bypassed_behind(&proxy);
    wait_until(
        "lookups to stop being served",
        Duration::from_secs(30),
        || async {
            value(&client, "SELECT v FROM l WHERE id = 1").await;
            bypassed_behind(&proxy) > before
        },
    )
    .await;
    direct
        .batch_execute("UPDATE l SET v = 2 WHERE id = 1")
        .await
        .unwrap();
    assert_eq!(value(&client, "SELECT v FROM l WHERE id = 1").await, "2");
    signal(libc::SIGCONT);
    wait_applied(&proxy, &direct, DB).await;
    let hits_before = hits(&proxy, "l");
    wait_until("caching to resume", Duration::from_secs(30), || async {
        assert_eq!(value(&client, "SELECT v FROM l WHERE id = 1").await, "2");
        hits(&proxy, "l") > hits_before
    })
    .await;
    proxy.shutdown().await;
}

/// No replication slot to be had (`max_replication_slots = 0`): pgmemo says so, with what to
/// change, and serves uncached.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_replication_slots_serves_uncached_and_says_why() {
    serves_uncached_and_says_why(
        &[("wal_level", "logical"), ("max_replication_slots", "0")],
        "max_replication_slots",
    )
    .await;
}

/// A block that wrote through pgmemo is bumped at its COMMIT, and its WAL bumps nothing
/// again (`cache::own_commits`): a read stored after the COMMIT stays a hit once the WAL is
/// applied. What the block wrote through a trigger (another table) is current all the same,
/// and writes made outside a block, or directly, are still bumped by the WAL. Both decoders.
async fn a_block_through_pgmemo_is_bumped_once(db: &'static str, plugin: WalPlugin) {
    setup(
        db,
        "CREATE TABLE t (id int PRIMARY KEY, v int, note text);
         INSERT INTO t SELECT g, g, 'n' || g FROM generate_series(1, 5) g;
         CREATE TABLE audit (n int);
         CREATE FUNCTION audited() RETURNS trigger LANGUAGE plpgsql AS
           $$ BEGIN INSERT INTO audit VALUES (NEW.v); RETURN NEW; END $$;
         CREATE TRIGGER audited AFTER UPDATE ON t FOR EACH ROW EXECUTE FUNCTION audited();",
    )
    .await;
    let mut config = wal_config(vec![rule("t", "FROM t"), rule("audit", "FROM audit")]);
    config.cache.wal_plugin = plugin;
    let proxy = start_pgmemo(config).await;
    let client = connect(&proxy_db_url(&proxy, db)).await;
    let writer = connect(&proxy_db_url(&proxy, db)).await;
    let direct = connect(&direct_db_url(db)).await;
    value(&client, "SELECT sum(v) FROM t").await;
    wait_ready(&proxy, db).await;
    let skipped = || proxy.app().cache.own_commits.skipped.load(Relaxed);
    let reads = [
        "SELECT sum(v) FROM t",
        "SELECT count(*) FROM audit",
        "SELECT note FROM t WHERE id = 2",
    ];
    async fn same(client: &Client, direct: &Client, reads: &[&str], step: &str) {
        for read in reads {
            assert_eq!(
                value(client, read).await,
                value(direct, read).await,
                "{read} {step}"
            );
        }
    }
    // A block's WAL may come before its COMMIT's reply (then it bumps as usual): one of a
    // few blocks is enough to see a skip.
    // The COMMIT as a simple query, then in the extended protocol (tokio-postgres' Parse,
    // Describe, Sync, then Bind, Execute, Sync).
    for extended in [false, true] {
        let mut skips = 0;
        for round in 0..5 {
            same(&client, &direct, &reads, "before the block").await;
            same(&client, &direct, &reads, "before the block, cached").await;
            let skipped_before = skipped();
            writer.batch_execute("BEGIN").await.unwrap();
            writer
                .batch_execute("UPDATE t SET v = v + 1 WHERE id = 1")
                .await
                .unwrap();
            if extended {
                writer.execute("COMMIT", &[]).await.unwrap();
            } else {
                writer.batch_execute("COMMIT").await.unwrap();
            }
            // The COMMIT's bump: every read current at once (the trigger's table too).
            same(&client, &direct, &reads, "after the block's COMMIT").await;
            // Stored after the COMMIT (or answered, when the WAL came first).
            cached(&proxy, &client, "t", "SELECT sum(v) FROM t").await;
            wait_applied(&proxy, &direct, db).await;
            if skipped() == skipped_before {
                continue;
            }
            // The WAL bumped nothing: what was stored after the COMMIT is still a hit.
            let before = hits(&proxy, "t");
            value(&client, "SELECT sum(v) FROM t").await;
            assert_eq!(
                hits(&proxy, "t"),
                before + 1,
                "round {round} (extended: {extended}): after the WAL"
            );
            same(&client, &direct, &reads, "after its WAL").await;
            skips += 1;
        }
        assert!(
            skips >= 1,
            "no block's WAL was skipped (extended: {extended})"
        );
    }

    // Outside a block, through pgmemo, and directly: the WAL bumps.
    let skipped_now = skipped();
    let cases: &[(&str, &str, &str, &str)] = &[(
        "t",
        "SELECT v FROM t WHERE id = 3",
        "UPDATE t SET v = 30 WHERE id = 3",
        "30",
    )];
    writes_invalidate(&proxy, &client, &direct, db, cases).await;
    cached(&proxy, &client, "t", "SELECT note FROM t WHERE id = 4").await;
    writer
        .batch_execute("UPDATE t SET note = 'changed' WHERE id = 4")
        .await
        .unwrap();
    wait_applied(&proxy, &direct, db).await;
    same(&client, &direct, &reads, "after a write outside a block").await;
    assert_eq!(skipped(), skipped_now, "only blocks are skipped");

    // The question is not seen: a block's replies are PostgreSQL's, byte for byte (a
    // COMMIT in either protocol, and one after an error).
    use common::raw::{Frontend, RawClient};
    let commit_extended = [
        Frontend::parse("", "COMMIT", &[]),
        Frontend::bind("", "", &[]),
        Frontend::execute("", 0),
        Frontend::Sync,
    ];
    let blocks: [&[Frontend]; 4] = [
        &[Frontend::query("COMMIT")],
        &commit_extended,
        &[Frontend::query("END;")],
        &[Frontend::query("SELECT 1/0"), Frontend::query("COMMIT")],
    ];
    for (i, end) in blocks.iter().enumerate() {
        let mut transcripts = Vec::new();
        for addr in [cluster().addr(), proxy.local_addr()] {
            let mut raw = RawClient::connect(addr, PGMEMO_USER, db, Some(PGMEMO_PASS), &[])
                .await
                .unwrap();
            let begin = [
                Frontend::query("BEGIN"),
                Frontend::query("UPDATE t SET v = v + 1 WHERE id = 5"),
            ];
            raw.send(&begin).await.unwrap();
            let mut replies = raw.recv_until_ready(2).await.unwrap();
            raw.send(end).await.unwrap();
            let readies = end
                .iter()
                .filter(|m| matches!(m, Frontend::Query(_) | Frontend::Sync))
                .count();
            replies.extend(raw.recv_until_ready(readies).await.unwrap());
            transcripts.push(replies);
        }
        assert_eq!(transcripts[0], transcripts[1], "block {i}");
    }
    wait_applied(&proxy, &direct, db).await;
    assert!(skipped() > skipped_now, "the blocks' WAL were skipped");
    proxy.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_block_through_pgmemo_is_bumped_once_test_decoding() {
    a_block_through_pgmemo_is_bumped_once("wal_own_td", WalPlugin::TestDecoding).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_block_through_pgmemo_is_bumped_once_pgoutput() {
    a_block_through_pgmemo_is_bumped_once("wal_own_po", WalPlugin::Pgoutput).await;
}

/// A server that refuses the question (`txid_current_if_assigned()` revoked from the
/// client's role): that block's COMMIT fails with PostgreSQL's error and rolls back, as
/// after any error in a block, and pgmemo asks no more: the next blocks commit, their WAL
/// bumped as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_question_is_not_asked_again() {
    const DB: &str = "wal_own_refused";
    setup(
        DB,
        "CREATE TABLE t (id int PRIMARY KEY, v int);
         INSERT INTO t VALUES (1, 0);
         GRANT SELECT, UPDATE ON t TO scram_user;
         REVOKE EXECUTE ON FUNCTION txid_current_if_assigned() FROM PUBLIC;",
    )
    .await;
    // Served as `refused`, whose pool logs into the server as scram_user.
    let mut config = wal_config(vec![rule("t", "FROM t")]);
    config.databases.insert(
        "refused".into(),
        pgmemo::config::DatabaseConfig {
            dbname: Some(DB.into()),
            user: Some(SCRAM_USER.into()),
            password: Some(SCRAM_PASS.into()),
            ..Default::default()
        },
    );
    // The stream logs in as pgmemo's own role (scram_user may not replicate).
    config.cache.replication_user = Some(PGMEMO_USER.into());
    config.cache.replication_password = Some(PGMEMO_PASS.into());
    let proxy = start_pgmemo(config).await;
    let client = connect(&proxy_db_url(&proxy, "refused")).await;
    let direct = connect(&direct_db_url(DB)).await;
    value(&client, "SELECT v FROM t").await;
    wait_ready(&proxy, DB).await;
    let block = |v: i32| format!("UPDATE t SET v = {v} WHERE id = 1");
    client.batch_execute("BEGIN").await.unwrap();
    client.batch_execute(&block(1)).await.unwrap();
    let refused = client.batch_execute("COMMIT").await.unwrap_err();
    assert_eq!(
        refused.as_db_error().map(|e| e.code().code()),
        Some("42501"),
        "{refused}"
    );
    assert_eq!(value(&client, "SELECT v FROM t").await, "0", "rolled back");
    for v in [2, 3] {
        client.batch_execute("BEGIN").await.unwrap();
        client.batch_execute(&block(v)).await.unwrap();
        client.batch_execute("COMMIT").await.unwrap();
        assert_eq!(value(&client, "SELECT v FROM t").await, v.to_string());
    }
    wait_applied(&proxy, &direct, DB).await;
    assert_eq!(value(&client, "SELECT v FROM t").await, "3");
    assert_eq!(proxy.app().cache.own_commits.skipped.load(Relaxed), 0);
    proxy.shutdown().await;
}

/// Every way of writing in `common::write_forms`, inside a block through pgmemo whose WAL is
/// then skipped (`cache::own_commits`): what the COMMIT bumped must cover all of it, since
/// nothing bumps it again. Each read is PostgreSQL's right after the COMMIT, and again once
/// the WAL is applied (read and stored in between).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_way_of_writing_in_a_block_is_bumped_at_its_commit() {
    use common::write_forms::{READS, SCHEMA, WRITES};
    const DB: &str = "wal_write_forms";
    setup(DB, SCHEMA).await;
    let proxy = start_pgmemo(wal_config(vec![rule("all", "FROM")])).await;
    let client = connect(&proxy_db_url(&proxy, DB)).await;
    let writer = connect(&proxy_db_url(&proxy, DB)).await;
    let direct = connect(&direct_db_url(DB)).await;
    value(&client, READS[0]).await;
    wait_ready(&proxy, DB).await;
    async fn same(client: &Client, direct: &Client, step: &str) {
        for read in READS {
            let (got, want) = (value(client, read).await, value(direct, read).await);
            assert_eq!(got, want, "{read} {step}");
        }
    }
    let skipped = || proxy.app().cache.own_commits.skipped.load(Relaxed);
    let skipped_before = skipped();
    for (what, statements) in WRITES {
        same(&client, &direct, &format!("before {what}")).await;
        same(&client, &direct, &format!("before {what}, cached")).await;
        writer.batch_execute("BEGIN").await.unwrap();
        for statement in *statements {
            writer.simple_query(statement).await.unwrap();
        }
        writer.batch_execute("COMMIT").await.unwrap();
        same(&client, &direct, &format!("after {what}'s COMMIT")).await;
        same(&client, &direct, &format!("after {what}'s COMMIT, cached")).await;
        wait_applied(&proxy, &direct, DB).await;
        same(&client, &direct, &format!("after {what}'s WAL")).await;
    }
    assert!(skipped() > skipped_before, "no block's WAL was skipped");
    proxy.shutdown().await;
}

/// Followers of several databases of one server each make a replication slot of their own
/// at their first try (issue 54: slot names were counted per database, so the second
/// database's follower found its name taken, failed and retried with back-off, caching off
/// meanwhile; the fifth waited 8 s).
#[tokio::test]
async fn followers_of_several_databases_start_at_once() {
    const DBS: [&str; 4] = ["wal_many_1", "wal_many_2", "wal_many_3", "wal_many_4"];
    for db in DBS {
        setup(
            db,
            "CREATE TABLE t (id int PRIMARY KEY, v int); INSERT INTO t VALUES (1, 1);",
        )
        .await;
    }
    let proxy = start_pgmemo(wal_config(vec![rule("t", "FROM t WHERE")])).await;
    for db in DBS {
        let client = connect(&proxy_db_url(&proxy, db)).await;
        // The first lookup starts following the database.
        value(&client, "SELECT v FROM t WHERE id = 1").await;
    }
    for db in DBS {
        wait_ready(&proxy, db).await;
        let status = follower(&proxy, db).expect("a follower").status();
        assert_eq!(
            status.connects, 1,
            "{db}: the follower's first try made its slot"
        );
    }
    proxy.shutdown().await;
}

/// The number of backends PostgreSQL counts on database `db` (pgmemo's servers, its
/// follower's walsender and catalog connection), as seen through `direct`.
async fn backends_on(direct: &Client, db: &str) -> u64 {
    value(
        direct,
        &format!("SELECT count(*) FROM pg_stat_activity WHERE datname = '{db}'"),
    )
    .await
    .parse()
    .unwrap()
}

/// Uses `db` through pgmemo until it holds idle servers of it and a follower that serves
/// `read` (rule `k`) from the cache; returns the value read.
async fn use_through_pgmemo(proxy: &Pgmemo, direct: &Client, db: &str, read: &str) -> String {
    let a = connect(&proxy_db_url(proxy, db)).await;
    let b = connect(&proxy_db_url(proxy, db)).await;
    value(&a, read).await;
    wait_ready(proxy, db).await;
    let read_value = cached(proxy, &a, "k", read).await;
    // Two transactions at once: two servers, idle in the pool once both ended.
    a.batch_execute("BEGIN; SELECT txid_current()")
        .await
        .unwrap();
    b.batch_execute("BEGIN; SELECT txid_current()")
        .await
        .unwrap();
    a.batch_execute("COMMIT").await.unwrap();
    b.batch_execute("COMMIT").await.unwrap();
    // Two servers and a walsender at least: today PostgreSQL would refuse DROP DATABASE.
    assert!(backends_on(direct, db).await >= 3, "pgmemo holds {db}");
    read_value
}

/// `DROP DATABASE` through pgmemo (Django's test runner drops its test database, and the next
/// run creates it again): pgmemo's idle servers of the database and its WAL follower (its
/// temporary slot) are closed first, where PostgreSQL refused the statement with 55006 ("being
/// accessed by other users"), and PgBouncer's idle servers make it fail too. Likewise `ALTER
/// DATABASE ... RENAME` and `CREATE DATABASE ... TEMPLATE`, in simple and extended queries.
/// A database made again under the same name is followed again, and nothing cached of the
/// old one is served. A server in use by another client stands: PostgreSQL's 55006 then, and
/// that server is closed when released, as after RECONNECT.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drop_database_through_pgmemo_closes_its_servers_and_follower_first() {
    const DB: &str = "wal_dropdb";
    const RENAMED: &str = "wal_dropdb_renamed";
    const COPY: &str = "wal_dropdb_copy";
    const READ: &str = "SELECT v FROM k WHERE id = 1";
    let leftovers = format!(
        "DROP DATABASE IF EXISTS {RENAMED} WITH (FORCE); DROP DATABASE IF EXISTS {COPY} WITH (FORCE)"
    );
    tokio::task::spawn_blocking(move || cluster().psql("postgres", &leftovers))
        .await
        .unwrap();
    setup(
        DB,
        "CREATE TABLE k (id int PRIMARY KEY, v int); INSERT INTO k VALUES (1, 1);",
    )
    .await;
    let proxy = start_pgmemo(wal_config(vec![rule("k", "FROM k")])).await;
    let direct = connect(&direct_db_url("postgres")).await;
    // A client of another database through pgmemo, as Django's test runner.
    let other = connect(&proxy_db_url(&proxy, "postgres")).await;

    assert_eq!(use_through_pgmemo(&proxy, &direct, DB, READ).await, "1");
    // Quoted, IF EXISTS: as Django writes it.
    other
        .simple_query(&format!("DROP DATABASE IF EXISTS \"{DB}\""))
        .await
        .expect("DROP DATABASE through pgmemo");
    assert!(follower(&proxy, DB).is_none(), "the follower was stopped");

    // Made again: followed again, nothing of the old one's cached results served.
    other
        .simple_query(&format!("CREATE DATABASE {DB}"))
        .await
        .unwrap();
    let again = connect(&proxy_db_url(&proxy, DB)).await;
    again
        .batch_execute("CREATE TABLE k (id int PRIMARY KEY, v int); INSERT INTO k VALUES (1, 2);")
        .await
        .unwrap();
    assert_eq!(value(&again, READ).await, "2");
    assert_eq!(use_through_pgmemo(&proxy, &direct, DB, READ).await, "2");
    let direct_db = connect(&direct_db_url(DB)).await;
    direct_db
        .batch_execute("UPDATE k SET v = 3 WHERE id = 1")
        .await
        .unwrap();
    wait_applied(&proxy, &direct_db, DB).await;
    assert_eq!(value(&again, READ).await, "3", "the new follower follows");
    drop(direct_db);
    drop(again);

    // The client's own database: PostgreSQL refuses at once, and pgmemo keeps what it has.
    let inside = connect(&proxy_db_url(&proxy, DB)).await;
    let err = inside
        .simple_query(&format!("DROP DATABASE {DB}"))
        .await
        .unwrap_err();
    let refused = err.as_db_error().expect("PostgreSQL's error");
    assert_eq!(
        (refused.code().code(), refused.message()),
        ("55006", "cannot drop the currently open database")
    );
    assert!(follower(&proxy, DB).is_some_and(|f| f.is_ready()));
    drop(inside);

    // Renamed and back, in the extended protocol (Parse, Bind, Execute).
    other
        .execute(&format!("ALTER DATABASE {DB} RENAME TO {RENAMED}"), &[])
        .await
        .expect("ALTER DATABASE ... RENAME through pgmemo");
    other
        .execute(&format!("ALTER DATABASE {RENAMED} RENAME TO {DB}"), &[])
        .await
        .unwrap();
    assert_eq!(use_through_pgmemo(&proxy, &direct, DB, READ).await, "3");

    // Copied as a template.
    other
        .execute(&format!("CREATE DATABASE {COPY} TEMPLATE {DB}"), &[])
        .await
        .expect("CREATE DATABASE ... TEMPLATE through pgmemo");
    let copy = connect(&proxy_db_url(&proxy, COPY)).await;
    assert_eq!(value(&copy, READ).await, "3");
    drop(copy);

    // Another client's transaction on it: its server stands, and PostgreSQL's error with it
    // (after PostgreSQL's own wait of 5 s for the database's other sessions to go).
    use_through_pgmemo(&proxy, &direct, DB, READ).await;
    let holder = connect(&proxy_db_url(&proxy, DB)).await;
    holder
        .batch_execute("BEGIN; SELECT txid_current()")
        .await
        .unwrap();
    let err = other
        .simple_query(&format!("DROP DATABASE {DB}"))
        .await
        .unwrap_err();
    let refused = err.as_db_error().expect("PostgreSQL's error");
    assert_eq!(refused.code().code(), "55006", "{refused:?}");
    assert!(
        refused
            .message()
            .contains("is being accessed by other users"),
        "{refused:?}"
    );
    // Its transaction ends: the server is closed, not kept, and the drop goes through.
    holder.batch_execute("COMMIT").await.unwrap();
    other
        .execute(&format!("DROP DATABASE {DB}"), &[])
        .await
        .expect("DROP DATABASE once the other client's transaction ended");
    drop(holder);

    // The copy goes the same way: pgmemo's servers and follower of it are closed first
    // (PostgreSQL's own `WITH (FORCE)` would still fail on the follower's slot).
    other
        .simple_query(&format!("DROP DATABASE {COPY}"))
        .await
        .expect("DROP DATABASE of the copy");
    proxy.shutdown().await;
}
