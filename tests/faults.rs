//! Faults while caching (issue 37, item 5): with the result cache (rules, invalidation from
//! writes through pgmemo and from the WAL), autoprepare and settings carried in transaction
//! mode, a mixed load runs under a consistency checker while faults are injected one after
//! another:
//!
//! - PostgreSQL restarted (`pg_ctl restart -m fast`, then `-m immediate`: crash recovery);
//! - every backend terminated (`pg_terminate_backend`): clients mid-transaction, mid-COPY,
//!   pgmemo's idle servers;
//! - the walsender of pgmemo's WAL follower terminated;
//! - a `statement_timeout` storm: a table locked directly while readers (with a carried
//!   `SET statement_timeout`) time out by the dozen;
//! - clients killed mid-message (half a Query, half a Bind, then the socket closes);
//! - pgmemo itself stopped (SIGSTOP) for 5 s and continued (`pgmemo_stopped_and_continued`, with
//!   pgmemo in its own process).
//!
//! The checker: each reader reads rows tagged with its own name (a wrong reply to another
//! client shows as a foreign tag or a foreign error) and never a value older than its floor:
//! for rows written through pgmemo, the last value whose write was acknowledged before the
//! read started (read-your-writes, for every client); for rows written directly, the last value
//! whose commit the WAL follower had applied before the read started. Right after each fault
//! the direct writer writes every row of the rarely written table, whose cached reads would
//! outlive a write the follower missed. After each fault the
//! load must make progress again (reads checked, writes acknowledged) before the next; at the
//! end every pool is back to normal (no server active, nobody waiting, no backend left in a
//! transaction), every row read through pgmemo equals PostgreSQL's, and the heap is back to its
//! level after the warm-up.

mod common;

use common::*;
use pgmemo::config::cache::Invalidation;
use pgmemo::config::{AuthType, Config, PoolMode, Upstream};
use pgmemo::demo::LocalPostgres;
use pgmemo::Pgmemo;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio_postgres::error::SqlState;
use tokio_postgres::{Client, NoTls, SimpleQueryMessage};

/// Two tables of ROWS rows: `acct`, written all the time (its cached reads are invalidated
/// as fast as they are made), and `ref`, written once in 500 writes (mostly read from the cache).
const TABLES: [&str; 2] = ["acct", "ref"];
/// In each table, rows 0..PROXY_ROWS are written through pgmemo, the others directly.
const ROWS: i64 = 8;
const PROXY_ROWS: i64 = 4;
const READERS: usize = 6;

/// A private cluster (the test restarts it): logical WAL for the follower, and commits that
/// survive an immediate shutdown (`synchronous_commit = on`; `fsync = off` is enough while the
/// machine itself stays up).
fn faults_cluster() -> LocalPostgres {
    private_cluster(&[
        ("wal_level", "logical"),
        ("synchronous_commit", "on"),
        ("max_connections", "100"),
    ])
}

fn config(pg: &LocalPostgres) -> Config {
    let mut config = test_config(PoolMode::Transaction, 6);
    config.upstream = Some(Upstream {
        host: "127.0.0.1".into(),
        port: pg.port(),
        user: "postgres".into(),
        password: None,
        ..Default::default()
    });
    config.general.auth_type = AuthType::Trust;
    config.general.admin_users = vec!["postgres".into()];
    config.cache.enabled = true;
    config.cache.admit_after = 1;
    config.cache.invalidation = Invalidation::Wal;
    config.cache.rules = vec![
        cache_rule("acct", "FROM acct"),
        cache_rule("ref", "FROM ref"),
    ];
    config
}

fn url(addr: std::net::SocketAddr, db: &str) -> String {
    format!("postgresql://postgres@{}:{}/{db}", addr.ip(), addr.port())
}

async fn try_connect(url: &str) -> Option<Client> {
    let (client, conn) =
        tokio::time::timeout(Duration::from_secs(10), tokio_postgres::connect(url, NoTls))
            .await
            .ok()?
            .ok()?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    Some(client)
}

fn first_row(messages: &[SimpleQueryMessage]) -> Option<Vec<String>> {
    messages.iter().find_map(|m| match m {
        SimpleQueryMessage::Row(r) => Some(
            (0..r.len())
                .map(|i| r.get(i).unwrap_or("NULL").to_owned())
                .collect(),
        ),
        _ => None,
    })
}

/// An error a fault explains: the server or the connection went, a statement timed out, the
/// server is starting or stopping, or pgmemo could not get a server meanwhile. Anything else
/// (a division by zero for a plain read, a syntax error) is someone else's reply.
fn a_faults_error(e: &tokio_postgres::Error) -> bool {
    let Some(db) = e.as_db_error() else {
        return true; // the connection closed, or an I/O error
    };
    let code = db.code().code();
    [
        "57P01", // terminated by administrator
        "57P02", // crash shutdown
        "57P03", // cannot connect now
        "57014", // statement timeout
        "25P02", // in failed transaction (after an error above inside BEGIN)
        "40P01", // deadlock (the lock storm)
        "55P03", // lock not available
    ]
    .contains(&code)
        || code.starts_with("08") // connection exceptions, pgmemo's "server closed"
        || code.starts_with("53") // insufficient resources (pgmemo's pool limits)
}

/// The values written directly to one row, each with the WAL position after its commit.
type Writes = Vec<(i64, pgmemo::wal::Lsn)>;

/// What the load has done, and the floors the checker reads.
#[derive(Default)]
struct Load {
    stop: AtomicBool,
    /// Per table and row written through pgmemo: the last value whose write was acknowledged.
    acknowledged: [[AtomicI64; PROXY_ROWS as usize]; 2],
    /// Per table and row written directly: the values written, each with the WAL position
    /// after its commit.
    direct: Mutex<[Vec<Writes>; 2]>,
    reads: AtomicU64,
    writes: AtomicU64,
    copies: AtomicU64,
    errors: AtomicU64,
    /// Writes the direct writer is to make to `ref` next (set after each fault).
    burst: AtomicI64,
}

/// What the test is doing (the fault), for the checker's messages.
static PHASE: Mutex<String> = Mutex::new(String::new());

fn phase() -> String {
    PHASE.lock().unwrap().clone()
}

fn set_phase(what: &str) {
    *PHASE.lock().unwrap() = what.to_owned();
}

impl Load {
    /// The lowest value row `k` of table `t` may be read as by a read starting now.
    fn floor(&self, t: usize, k: i64, proxy: &Pgmemo) -> i64 {
        if k < PROXY_ROWS {
            return self.acknowledged[t][k as usize].load(Relaxed);
        }
        let applied = follower(proxy).map_or(pgmemo::wal::Lsn::default(), |f| f.applied());
        self.direct.lock().unwrap()[t][(k - PROXY_ROWS) as usize]
            .iter()
            .filter(|(_, lsn)| *lsn <= applied)
            .map(|(v, _)| *v)
            .max()
            .unwrap_or(0)
    }
}

fn follower(proxy: &Pgmemo) -> Option<Arc<pgmemo::wal::Follower>> {
    wal_follower(proxy, "postgres")
}

/// One reader: reads rows tagged `r<id>` in four ways (simple and autoprepared, extended,
/// inside a transaction, an error it expects), checking tag and floor, reconnecting after
/// a fault.
async fn reader(id: usize, addr: std::net::SocketAddr, proxy: Arc<Pgmemo>, load: Arc<Load>) {
    let mut rng = Rng(0x9E37_79B9 + id as u64);
    let tag = format!("r{id}");
    while !load.stop.load(Relaxed) {
        let Some(mut c) = try_connect(&url(addr, "postgres")).await else {
            continue;
        };
        // Carried by pgmemo onto whichever server runs the next statement.
        if c.batch_execute("SET statement_timeout = '400ms'")
            .await
            .is_err()
        {
            continue;
        }
        while !load.stop.load(Relaxed) && !c.is_closed() {
            let t = rng.below(2);
            let table = TABLES[t];
            let k = rng.below(ROWS as usize) as i64;
            let floor = load.floor(t, k, &proxy);
            let got: Result<Option<(i64, String)>, tokio_postgres::Error> =
                match rng.below(4) {
                    0 => c
                        .simple_query(&format!(
                            "SELECT v, '{tag}' AS who FROM {table} WHERE id = {k}"
                        ))
                        .await
                        .map(|m| first_row(&m).map(|r| (r[0].parse().unwrap(), r[1].clone()))),
                    1 => c
                        .query_opt(
                            &format!("SELECT v, $2::text AS who FROM {table} WHERE id = $1"),
                            &[&(k as i32), &tag],
                        )
                        .await
                        .map(|r| r.map(|r| (r.get::<_, i64>(0), r.get::<_, String>(1)))),
                    2 => {
                        async {
                            let t = c.transaction().await?;
                            let row = t
                        .query_one(
                            &format!("SELECT v, '{tag}'::text AS who FROM {table} WHERE id = {k}"),
                            &[],
                        )
                        .await?;
                            t.commit().await?;
                            Ok(Some((row.get::<_, i64>(0), row.get::<_, String>(1))))
                        }
                        .await
                    }
                    _ => match c.simple_query(&format!("SELECT 1/0 AS {tag}")).await {
                        Err(e) if e.code() == Some(&SqlState::DIVISION_BY_ZERO) => continue,
                        Err(e) => Err(e),
                        Ok(m) => panic!("{tag}: SELECT 1/0 answered {:?}", first_row(&m)),
                    },
                };
            match got {
                Ok(Some((v, who))) => {
                    assert_eq!(who, tag, "a reply meant for {who} reached {tag}");
                    assert!(
                        v >= floor,
                        "{tag} read {table} row {k} as {v}, older than {floor} (written before \
                         the read)"
                    );
                    load.reads.fetch_add(1, Relaxed);
                }
                Ok(None) => panic!("{tag}: {table} row {k} missing"),
                Err(e) => {
                    assert!(
                        a_faults_error(&e),
                        "{tag} {table} row {k}, {}: {e:?}",
                        phase()
                    );
                    load.errors.fetch_add(1, Relaxed);
                }
            }
        }
    }
}

/// Writes rows 0..PROXY_ROWS through pgmemo (autocommit and in transactions with a second
/// statement), values strictly increasing; a value counts once its write is acknowledged.
async fn proxy_writer(addr: std::net::SocketAddr, load: Arc<Load>) {
    let mut n = 0i64;
    while !load.stop.load(Relaxed) {
        let Some(mut c) = try_connect(&url(addr, "postgres")).await else {
            continue;
        };
        while !load.stop.load(Relaxed) && !c.is_closed() {
            n += 1;
            let k = n % PROXY_ROWS;
            let t = usize::from(n % 500 == 0);
            let sql = format!("UPDATE {} SET v = {n} WHERE id = {k}", TABLES[t]);
            let done = if n % 3 == 0 {
                async {
                    let t = c.transaction().await?;
                    t.batch_execute(&sql).await?;
                    t.batch_execute(&format!("INSERT INTO log VALUES ({k}, 'w{n}')"))
                        .await?;
                    t.commit().await
                }
                .await
            } else {
                c.batch_execute(&sql).await
            };
            match done {
                Ok(()) => {
                    load.acknowledged[t][k as usize].fetch_max(n, Relaxed);
                    load.writes.fetch_add(1, Relaxed);
                }
                Err(e) => {
                    assert!(a_faults_error(&e), "writer, {}: {e:?}", phase());
                    load.errors.fetch_add(1, Relaxed);
                }
            }
        }
    }
}

/// Writes rows PROXY_ROWS..ROWS directly on PostgreSQL, recording each value with the WAL
/// position after its commit.
async fn direct_writer(direct_url: String, load: Arc<Load>) {
    let mut n = 0i64;
    while !load.stop.load(Relaxed) {
        let Some(c) = try_connect(&direct_url).await else {
            continue;
        };
        while !load.stop.load(Relaxed) && !c.is_closed() {
            n += 1;
            let k = PROXY_ROWS + n % (ROWS - PROXY_ROWS);
            // After a fault (`burst`), the next writes go to `ref`, whose cached reads a
            // follower that missed them would keep serving.
            let burst = load.burst.load(Relaxed) > 0;
            let t = usize::from(n % 500 == 0 || burst);
            let done = async {
                c.batch_execute(&format!("UPDATE {} SET v = {n} WHERE id = {k}", TABLES[t]))
                    .await?;
                let rows = c.simple_query("SELECT pg_current_wal_insert_lsn()").await?;
                Ok::<_, tokio_postgres::Error>(first_row(&rows).unwrap()[0].parse().unwrap())
            }
            .await;
            if let Ok(lsn) = done {
                load.direct.lock().unwrap()[t][(k - PROXY_ROWS) as usize].push((n, lsn));
                load.writes.fetch_add(1, Relaxed);
                if burst {
                    load.burst.fetch_sub(1, Relaxed);
                }
            }
        }
    }
}

/// COPY FROM STDIN through pgmemo, 2,000 rows at a time: a COPY that succeeds says it copied
/// all of them.
async fn copier(addr: std::net::SocketAddr, load: Arc<Load>) {
    use futures_util::SinkExt;
    while !load.stop.load(Relaxed) {
        let Some(c) = try_connect(&url(addr, "postgres")).await else {
            continue;
        };
        while !load.stop.load(Relaxed) && !c.is_closed() {
            let copied = async {
                let sink = c
                    .copy_in::<_, bytes::Bytes>("COPY log (k, note) FROM STDIN")
                    .await?;
                futures_util::pin_mut!(sink);
                for chunk in 0..20 {
                    let mut rows = String::new();
                    for i in 0..100 {
                        rows.push_str(&format!("{}\tcopy {chunk} {i}\n", i % ROWS));
                    }
                    sink.send(bytes::Bytes::from(rows)).await?;
                }
                sink.finish().await
            }
            .await;
            match copied {
                Ok(n) => {
                    assert_eq!(n, 2000, "a COPY that succeeded copied {n} rows");
                    load.copies.fetch_add(1, Relaxed);
                }
                Err(e) => {
                    assert!(a_faults_error(&e), "copy, {}: {e:?}", phase());
                    load.errors.fetch_add(1, Relaxed);
                }
            }
        }
    }
}

/// Clients that log in and die mid-message: half a Query, or a Bind cut short.
async fn half_messages(addr: std::net::SocketAddr, count: usize) {
    for i in 0..count {
        let Ok(mut c) = RawClient::connect(addr, "postgres", "postgres", None, &[]).await else {
            continue;
        };
        let mut bytes = vec![];
        if i % 2 == 0 {
            Frontend::query("SELECT v FROM acct WHERE id = 1").encode(&mut bytes);
        } else {
            Frontend::parse("", "SELECT v FROM acct WHERE id = $1", &[]).encode(&mut bytes);
            Frontend::bind("", "", &[Some("1")]).encode(&mut bytes);
        }
        bytes.truncate(bytes.len() - 3);
        let _ = c.send_raw(&bytes).await;
        drop(c);
    }
}

/// The load's tasks, started together and stopped together.
struct Running {
    load: Arc<Load>,
    tasks: tokio::task::JoinSet<()>,
}

fn start_load(proxy: &Arc<Pgmemo>, direct_url: &str) -> Running {
    let load = Arc::new(Load::default());
    *load.direct.lock().unwrap() = [0, 1].map(|_| vec![vec![]; (ROWS - PROXY_ROWS) as usize]);
    let addr = proxy.local_addr();
    let mut tasks = tokio::task::JoinSet::new();
    for id in 0..READERS {
        tasks.spawn(reader(id, addr, proxy.clone(), load.clone()));
    }
    tasks.spawn(proxy_writer(addr, load.clone()));
    tasks.spawn(direct_writer(direct_url.to_owned(), load.clone()));
    tasks.spawn(copier(addr, load.clone()));
    Running { load, tasks }
}

impl Running {
    /// Waits until the load made progress: `reads` more reads checked and `writes` more writes
    /// acknowledged than now (a fault is over when its clients work again).
    async fn progress(&self, what: &str, reads: u64, writes: u64) {
        set_phase(&format!("after {what}"));
        self.load.burst.store(ROWS - PROXY_ROWS, Relaxed);
        let (r0, w0) = (
            self.load.reads.load(Relaxed),
            self.load.writes.load(Relaxed),
        );
        wait_until(
            &format!("the load to go on after {what}"),
            Duration::from_secs(60),
            || async {
                self.load.reads.load(Relaxed) >= r0 + reads
                    && self.load.writes.load(Relaxed) >= w0 + writes
            },
        )
        .await;
    }

    async fn stop(mut self) -> Arc<Load> {
        self.load.stop.store(true, Relaxed);
        while let Some(done) = self.tasks.join_next().await {
            if let Err(e) = done {
                std::panic::resume_unwind(e.into_panic());
            }
        }
        self.load
    }
}

/// Waits until the pool of `postgres` is back to normal (see the common helper).
async fn wait_pool_normal(proxy: &Pgmemo, direct: &Client) {
    let admin = connect(&url(proxy.local_addr(), "pgmemo")).await;
    common::wait_pool_normal(&admin, direct, "postgres").await;
}

async fn wait_follower_caught_up(proxy: &Pgmemo, direct: &Client) {
    let rows = direct
        .simple_query("SELECT pg_current_wal_insert_lsn()")
        .await
        .unwrap();
    let lsn: pgmemo::wal::Lsn = first_row(&rows).unwrap()[0].parse().unwrap();
    wait_until(
        "the WAL follower to apply the last writes",
        Duration::from_secs(60),
        || async { follower(proxy).is_some_and(|f| f.is_ready() && f.applied() >= lsn) },
    )
    .await;
}

async fn terminate_backends(direct: &Client, which: &str) {
    direct
        .batch_execute(&format!(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
             WHERE {which} AND pid <> pg_backend_pid()"
        ))
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn faults_while_caching_serve_no_stale_read_and_no_wrong_reply() {
    let pg = tokio::task::spawn_blocking(faults_cluster).await.unwrap();
    pg.psql(
        "postgres",
        &format!(
            "CREATE TABLE acct (id int PRIMARY KEY, v bigint NOT NULL);
             INSERT INTO acct SELECT g, 0 FROM generate_series(0, {last}) g;
             CREATE TABLE ref (id int PRIMARY KEY, v bigint NOT NULL);
             INSERT INTO ref SELECT g, 0 FROM generate_series(0, {last}) g;
             CREATE TABLE log (k bigint, note text);",
            last = ROWS - 1
        ),
    )
    .unwrap();
    let direct_url = pg.url("postgres", None, "postgres");
    let proxy = Arc::new(start_pgmemo(config(&pg)).await);
    let pg = Arc::new(Mutex::new(pg));
    let direct = || async { connect(&direct_url).await };

    // Warm-up: the follower starts with the first cached read; buffers, servers, statements.
    let running = start_load(&proxy, &direct_url);
    wait_until("the follower", Duration::from_secs(30), || async {
        follower(&proxy).is_some_and(|f| f.is_ready())
    })
    .await;
    running.progress("the start", 300, 50).await;
    running.stop().await;
    let d = direct().await;
    wait_pool_normal(&proxy, &d).await;
    let heap_warm = heap_in_use_kib();

    let running = start_load(&proxy, &direct_url);
    running.progress("the restart of the load", 100, 20).await;
    for mode in ["fast", "immediate"] {
        let restarting = pg.clone();
        tokio::task::spawn_blocking(move || restarting.lock().unwrap().restart(mode).unwrap())
            .await
            .unwrap();
        running
            .progress(&format!("a restart -m {mode}"), 200, 50)
            .await;
    }
    for round in 0..5 {
        let d = direct().await;
        terminate_backends(&d, "backend_type = 'client backend'").await;
        running
            .progress(&format!("terminating every backend ({round})"), 200, 50)
            .await;
    }
    let d = direct().await;
    terminate_backends(&d, "backend_type = 'walsender'").await;
    running.progress("terminating the walsender", 200, 50).await;
    // The storm: readers that miss the cache wait on the lock and time out (400 ms).
    let locker = direct().await;
    locker
        .batch_execute("BEGIN; LOCK TABLE acct, ref IN ACCESS EXCLUSIVE MODE; SELECT pg_sleep(2)")
        .await
        .unwrap();
    locker.batch_execute("COMMIT").await.unwrap();
    running.progress("a lock held for 2 s", 200, 50).await;
    half_messages(proxy.local_addr(), 50).await;
    running
        .progress("clients killed mid-message", 200, 50)
        .await;
    let load = running.stop().await;

    let d = direct().await;
    wait_pool_normal(&proxy, &d).await;
    wait_follower_caught_up(&proxy, &d).await;
    let through = connect(&url(proxy.local_addr(), "postgres")).await;
    for (table, k) in TABLES.iter().flat_map(|t| (0..ROWS).map(move |k| (t, k))) {
        let sql = format!("SELECT v FROM {table} WHERE id = {k}");
        let want = first_row(&d.simple_query(&sql).await.unwrap()).unwrap();
        for _ in 0..2 {
            let got = first_row(&through.simple_query(&sql).await.unwrap()).unwrap();
            assert_eq!(got, want, "{table} row {k} through pgmemo after the faults");
        }
    }
    drop(through);
    wait_pool_normal(&proxy, &d).await;
    let grown = heap_in_use_kib().saturating_sub(heap_warm);
    let hits: u64 = proxy
        .app()
        .cache
        .rule_stats()
        .iter()
        .map(|r| r.hits.get())
        .sum();
    eprintln!(
        "faults: {} reads checked ({hits} cache hits in all), {} writes, {} COPYs, {} errors \
         from faults, {} follower connects; heap {grown} KiB over its level after the warm-up",
        load.reads.load(Relaxed),
        load.writes.load(Relaxed),
        load.copies.load(Relaxed),
        load.errors.load(Relaxed),
        follower(&proxy).map_or(0, |f| f.connects.load(Relaxed)),
    );
    assert!(
        hits > 0,
        "nothing was read from the cache: no cached read was checked"
    );
    assert!(grown < 4 * 1024, "{grown} KiB more held after the faults");
    Arc::try_unwrap(proxy)
        .ok()
        .expect("the load's tasks are gone")
        .shutdown()
        .await;
}

/// What a client sees when its backend is terminated in the middle of a COPY FROM STDIN sent
/// with the extended protocol, then sends the end of the COPY, a Sync and a query: PostgreSQL
/// sends its FATAL and closes. pgmemo passed the FATAL on and went on with another server, so
/// the client's next statements met a server without them ("prepared statement does not
/// exist", found by the faults test above).
async fn fatal_mid_copy(addr: Option<std::net::SocketAddr>) -> Vec<String> {
    let mut client = match addr {
        None => RawClient::direct(&[]).await.unwrap(),
        Some(addr) => RawClient::through(addr, &[]).await.unwrap(),
    };
    client
        .send(&[
            Frontend::parse("", "COPY fatal_copy FROM STDIN", &[]),
            Frontend::bind("", "", &[]),
            Frontend::execute("", 0),
            Frontend::Sync,
        ])
        .await
        .unwrap();
    let mut seen: Vec<String> = client
        .recv_until_tag(b'G')
        .await
        .unwrap()
        .iter()
        .map(|m| m.name().to_owned())
        .collect();
    client
        .send(&[Frontend::copy_data(b"1\n2\n")])
        .await
        .unwrap();
    tokio::task::spawn_blocking(|| {
        cluster().psql(
            TEST_DB,
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
             WHERE query LIKE 'COPY fatal_copy%' AND pid <> pg_backend_pid()",
        )
    })
    .await
    .unwrap();
    let fatal = loop {
        let msg = client.recv().await.expect("the FATAL");
        if msg.is_error() {
            break msg;
        }
    };
    let (severity, code, _) = error_triple(&fatal);
    seen.push(format!("{severity} {code}"));
    // Whatever the client sends now, nothing more comes back: the session is over.
    let _ = client
        .send(&[
            Frontend::CopyDone,
            Frontend::Sync,
            Frontend::query("SELECT 1"),
        ])
        .await;
    while let Ok(msg) = client.recv().await {
        seen.push(format!("after the FATAL: {}", msg.name()));
    }
    seen
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fatal_mid_copy_ends_the_session_as_postgresql_does() {
    tokio::task::spawn_blocking(|| {
        cluster().psql(TEST_DB, "CREATE TABLE IF NOT EXISTS fatal_copy (n int)")
    })
    .await
    .unwrap();
    let direct = fatal_mid_copy(None).await;
    assert_eq!(
        direct,
        [
            "ParseComplete",
            "BindComplete",
            "CopyInResponse",
            "FATAL 57P01"
        ],
        "PostgreSQL itself"
    );
    for mode in [PoolMode::Transaction, PoolMode::Session] {
        let proxy = pgmemo(mode, 2).await;
        let through = fatal_mid_copy(Some(proxy.local_addr())).await;
        assert_eq!(through, direct, "{mode:?}");
        proxy.shutdown().await;
    }
}

/// A client's simple query, run often enough to be autoprepared, meets a server that was
/// terminated while the client was idle (its FATAL already sent): PostgreSQL's client reads
/// that FATAL and the end of the connection, and so must pgmemo's, rather than the FATAL
/// (rewritten, as an autoprepared query's error is) and then, at the server's end, a second
/// FATAL of pgmemo's own. Until then pgmemo had not noted the server gone when the client
/// came back after the first (a replica's is then taken out of reads first: the replicas
/// test's client that failed twice). In a transaction block (its server held), pgmemo in
/// its own process is stopped while the query is sent and the backend terminated, so that
/// it reads the query before it sees the FATAL (as it may at any time, on a busy machine,
/// with a server just taken from the pool).
async fn fatal_meets_autoprepared(child: Option<&Child>) -> Vec<String> {
    let mut client = match child {
        None => RawClient::direct(&[]).await.unwrap(),
        Some(child) => RawClient::through(child.addr, &[]).await.unwrap(),
    };
    let query = "SELECT pg_sleep(0) AS fatal_autoprepared";
    let mut seen = Vec::new();
    client.send(&[Frontend::query("BEGIN")]).await.unwrap();
    client.recv_until_tag(b'Z').await.unwrap();
    for _ in 0..3 {
        client.send(&[Frontend::query(query)]).await.unwrap();
        for msg in client.recv_until_tag(b'Z').await.unwrap() {
            seen.push(msg.name().to_owned());
        }
    }
    let sql = |sql: &'static str| async move {
        tokio::task::spawn_blocking(move || cluster().psql(TEST_DB, sql))
            .await
            .unwrap()
    };
    let terminated = sql(
        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity \
         WHERE query LIKE '%fatal_autoprepared%' AND pid <> pg_backend_pid()",
    );
    // pgmemo stopped before the query is sent; PostgreSQL's client sends it once the backend
    // is gone.
    if let Some(child) = child {
        child.signal(libc::SIGSTOP);
        client.send(&[Frontend::query(query)]).await.unwrap();
    }
    assert_eq!(terminated.await.trim(), "1");
    wait_until("the backend to end", Duration::from_secs(30), || async {
        sql("SELECT count(*) FROM pg_stat_activity \
             WHERE query LIKE '%fatal_autoprepared%' AND pid <> pg_backend_pid()")
        .await
        .trim()
            == "0"
    })
    .await;
    match child {
        None => client.send(&[Frontend::query(query)]).await.unwrap(),
        Some(child) => child.signal(libc::SIGCONT),
    }
    // Everything until the connection ends.
    while let Ok(msg) = client.recv().await {
        if msg.is_error() {
            let (severity, code, _) = error_triple(&msg);
            seen.push(format!("{severity} {code}"));
        } else {
            seen.push(msg.name().to_owned());
        }
    }
    seen
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fatal_that_meets_an_autoprepared_query_ends_the_session_as_postgresql_does() {
    let direct = fatal_meets_autoprepared(None).await;
    assert_eq!(
        direct.last().map(String::as_str),
        Some("FATAL 57P01"),
        "PostgreSQL itself: {direct:?}"
    );
    let (child, url) = Child::listening().await;
    let through = fatal_meets_autoprepared(Some(&child)).await;
    assert_eq!(through, direct, "through pgmemo at {url}");
}

/// pgmemo in its own process (`SIGSTOP` would stop the test with it), in front of the test
/// cluster, with the result cache on; killed when dropped.
struct Child {
    process: std::process::Child,
    addr: std::net::SocketAddr,
}

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.process.kill();
        let _ = self.process.wait();
    }
}

impl Child {
    fn start() -> Child {
        let c = cluster();
        let addr = std::net::SocketAddr::from(([127, 0, 0, 1], free_port()));
        let process = std::process::Command::new(env!("CARGO_BIN_EXE_pgmemo"))
            .args([
                "--upstream",
                &format!(
                    "postgresql://{PGMEMO_USER}:{PGMEMO_PASS}@127.0.0.1:{}",
                    c.port()
                ),
                "--listen",
                &addr.to_string(),
                "--pool-size",
                "4",
                "--auth",
                "trust",
                "--admin-user",
                PGMEMO_USER,
                "--cache",
                "--log-level",
                "warn",
            ])
            .stdin(std::process::Stdio::null())
            .spawn()
            .expect("start target/debug/pgmemo");
        Child { process, addr }
    }

    /// [`Child::start`], once it accepts clients; with its URL.
    async fn listening() -> (Child, String) {
        let child = Child::start();
        let url = format!(
            "postgresql://{PGMEMO_USER}@{}:{}/{TEST_DB}",
            child.addr.ip(),
            child.addr.port()
        );
        wait_until("pgmemo to listen", Duration::from_secs(30), || async {
            try_connect(&url).await.is_some()
        })
        .await;
        (child, url)
    }

    fn signal(&self, signal: libc::c_int) {
        // SAFETY: kill only sends a signal to our own child.
        assert_eq!(unsafe { libc::kill(self.process.id() as i32, signal) }, 0);
    }

    fn rss_kib(&self) -> u64 {
        process_status_kib(&self.process.id().to_string(), "VmRSS")
    }
}

/// pgmemo stopped (SIGSTOP) for 5 s under load and continued: every client goes on where it
/// was, with its own replies and no error, cached and uncached, and the pool is back to normal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pgmemo_stopped_and_continued() {
    let (child, url) = Child::listening().await;
    let stop = Arc::new(AtomicBool::new(false));
    let done: Arc<Vec<AtomicU64>> = Arc::new((0..4).map(|_| AtomicU64::new(0)).collect());
    let mut tasks = tokio::task::JoinSet::new();
    for id in 0..4usize {
        let (url, stop, done) = (url.clone(), stop.clone(), done.clone());
        tasks.spawn(async move {
            let c = connect(&url).await;
            let mut i = 0u64;
            while !stop.load(Relaxed) {
                i += 1;
                let tag = format!("c{id}");
                let (hinted, extended) = (i.is_multiple_of(2), i.is_multiple_of(3));
                let got: String = if extended {
                    c.query_one("SELECT $1::text || ':' || $2::bigint", &[&tag, &(i as i64)])
                        .await
                        .unwrap()
                        .get(0)
                } else {
                    let hint = if hinted { "/* pgmemo cache */ " } else { "" };
                    let rows = c
                        .simple_query(&format!("{hint}SELECT '{tag}:' || {}", i % 10))
                        .await
                        .unwrap();
                    first_row(&rows).unwrap().remove(0)
                };
                let want = format!("{tag}:{}", if extended { i } else { i % 10 });
                assert_eq!(got, want, "client {id}, query {i}");
                done[id].fetch_add(1, Relaxed);
            }
        });
    }
    let all_moved_on = |from: Vec<u64>| {
        let done = done.clone();
        async move {
            wait_until("every client to go on", Duration::from_secs(30), || async {
                done.iter()
                    .zip(&from)
                    .all(|(d, f)| d.load(Relaxed) >= f + 50)
            })
            .await;
        }
    };
    let now = |done: &Arc<Vec<AtomicU64>>| done.iter().map(|d| d.load(Relaxed)).collect();
    all_moved_on(now(&done)).await;
    let rss_before = child.rss_kib();
    child.signal(libc::SIGSTOP);
    // The fault's length, not a wait for anything.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let stopped_at = now(&done);
    child.signal(libc::SIGCONT);
    all_moved_on(stopped_at).await;
    stop.store(true, Relaxed);
    while let Some(t) = tasks.join_next().await {
        t.unwrap();
    }
    let admin = connect(&format!(
        "postgresql://{PGMEMO_USER}@{}:{}/pgmemo",
        child.addr.ip(),
        child.addr.port()
    ))
    .await;
    wait_until("the pool to be normal", Duration::from_secs(30), || async {
        admin_rows(&admin, "SHOW POOLS")
            .await
            .iter()
            .filter(|r| r["database"] == TEST_DB)
            .all(|r| r["cl_waiting"] == "0" && r["sv_active"] == "0")
    })
    .await;
    eprintln!(
        "SIGSTOP for 5 s: VmRSS {rss_before} KiB before, {} KiB after",
        child.rss_kib()
    );
}
