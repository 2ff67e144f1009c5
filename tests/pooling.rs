//! Pooling behaviour against a real PostgreSQL: the size limit, the wait queue and its
//! timeout, clients killed mid-transaction, a server restart under load, live pool resizing,
//! cancel requests, session reset, min_pool_size and server_idle_timeout.
//!
//! Server connections are counted in `pg_stat_activity` through a direct connection to the
//! cluster. Each test uses its own database so that the counts see only its own pgmemo.
//! Waiting is always for a condition, polled with a bound; never a sleep that hopes.

mod common;

use common::*;
use pgmemo::config::{AuthType, Config, PoolMode, Upstream};
use pgmemo::demo::{LocalPostgres, LocalPostgresOptions};
use pgmemo::Pgmemo;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio_postgres::{Client, NoTls, SimpleQueryMessage};

/// A client whose connection task can be aborted: the socket is then dropped without a
/// Terminate message, as when a client process is killed.
async fn connect_killable(url: &str) -> (Client, tokio::task::JoinHandle<()>) {
    let (client, conn) = tokio_postgres::connect(url, NoTls)
        .await
        .unwrap_or_else(|e| panic!("connect {url}: {e}"));
    let task = tokio::spawn(async move {
        let _ = conn.await;
    });
    (client, task)
}

/// A superuser connection straight to the shared cluster, for pg_stat_activity.
async fn direct() -> Client {
    let url = cluster().url(SUPERUSER, Some(SUPERUSER_PASS), "postgres");
    connect(&url).await
}

fn url(proxy: &Pgmemo, db: &str) -> String {
    proxy_url(proxy.local_addr(), PGMEMO_USER, Some(PGMEMO_PASS), db)
}

/// Rows of a simple query as text.
async fn rows(client: &Client, sql: &str) -> Vec<Vec<Option<String>>> {
    let msgs = client
        .simple_query(sql)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
    msgs.iter()
        .filter_map(|m| match m {
            SimpleQueryMessage::Row(r) => {
                Some((0..r.len()).map(|i| r.get(i).map(str::to_owned)).collect())
            }
            _ => None,
        })
        .collect()
}

async fn scalar(client: &Client, sql: &str) -> String {
    rows(client, sql).await[0][0].clone().unwrap_or_default()
}

/// pgmemo's server connections to `db` (those of the pgmemo role).
async fn backends(direct: &Client, db: &str) -> i64 {
    backends_where(direct, db, "true").await
}

async fn backends_where(direct: &Client, db: &str, cond: &str) -> i64 {
    scalar(
        direct,
        &format!(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = '{db}' AND usename = '{PGMEMO_USER}' \
             AND backend_type = 'client backend' AND ({cond})"
        ),
    )
    .await
    .parse()
    .unwrap()
}

/// The admin console's rows for `cmd`, as column name → value maps.
async fn admin(proxy: &Pgmemo, cmd: &str) -> Vec<HashMap<String, Option<String>>> {
    let client = connect(&url(proxy, "pgmemo")).await;
    let msgs = client.simple_query(cmd).await.unwrap();
    msgs.iter()
        .filter_map(|m| match m {
            SimpleQueryMessage::Row(r) => Some(
                r.columns()
                    .iter()
                    .enumerate()
                    .map(|(i, c)| (c.name().to_owned(), r.get(i).map(str::to_owned)))
                    .collect(),
            ),
            _ => None,
        })
        .collect()
}

async fn cl_waiting(proxy: &Pgmemo, db: &str) -> usize {
    admin(proxy, "SHOW POOLS")
        .await
        .iter()
        .find(|r| r["database"].as_deref() == Some(db))
        .map_or(0, |r| r["cl_waiting"].as_deref().unwrap().parse().unwrap())
}

// ---------------------------------------------------------------------------------------------

/// 20 clients, 3 servers: never more than 3 server connections, and all 3 get used.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pool_size_holds_under_concurrency() {
    const DB: &str = "pool_hold";
    fresh_db(DB).await;
    let proxy = pgmemo(PoolMode::Transaction, 3).await;
    let direct = direct().await;
    let mut clients = Vec::new();
    for _ in 0..20 {
        clients.push(connect(&url(&proxy, DB)).await);
    }
    let done = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for (i, client) in clients.into_iter().enumerate() {
        let done = done.clone();
        tasks.push(tokio::spawn(async move {
            let r = rows(&client, &format!("SELECT pg_sleep(0.2), {i}")).await;
            assert_eq!(r[0][1].as_deref(), Some(i.to_string().as_str()));
            done.fetch_add(1, Ordering::SeqCst);
        }));
    }
    let mut max = 0;
    let mut max_active = 0;
    while done.load(Ordering::SeqCst) < 20 {
        max = max.max(backends(&direct, DB).await);
        max_active = max_active.max(
            backends_where(
                &direct,
                DB,
                // Autoprepared, the server shows the query as `SELECT pg_sleep($1), $2`.
                "query LIKE 'SELECT pg_sleep(%' AND state = 'active'",
            )
            .await,
        );
        assert!(max <= 3, "{max} server connections for pool_size 3");
    }
    for t in tasks {
        t.await.unwrap();
    }
    assert!(max <= 3, "{max} server connections for pool_size 3");
    assert_eq!(max_active, 3, "the pool's 3 servers ran queries at once");
    proxy.shutdown().await;
}

/// A client queues while the only server is in use and gets it when the transaction ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_queue_for_a_busy_server() {
    const DB: &str = "pool_queue";
    fresh_db(DB).await;
    let proxy = pgmemo(PoolMode::Transaction, 1).await;
    let holder = connect(&url(&proxy, DB)).await;
    let waiter = connect(&url(&proxy, DB)).await;
    holder.batch_execute("BEGIN").await.unwrap();
    let holder_pid = scalar(&holder, "SELECT pg_backend_pid()").await;
    let queued = tokio::spawn(async move { scalar(&waiter, "SELECT pg_backend_pid()").await });
    wait_until(
        "the second client to queue",
        Duration::from_secs(5),
        || async { cl_waiting(&proxy, DB).await == 1 },
    )
    .await;
    assert!(
        !queued.is_finished(),
        "the queued client ran without a server"
    );
    holder.batch_execute("COMMIT").await.unwrap();
    let waiter_pid = tokio::time::timeout(Duration::from_secs(5), queued)
        .await
        .expect("the queued client gets the server after COMMIT")
        .unwrap();
    assert_eq!(waiter_pid, holder_pid, "one server, handed over");
    proxy.shutdown().await;
}

/// query_wait_timeout: the waiting client gets an error and is disconnected; the client
/// holding the server is not disturbed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn query_wait_timeout_errors_and_disconnects() {
    const DB: &str = "pool_wait_timeout";
    fresh_db(DB).await;
    let mut cfg = test_config(PoolMode::Transaction, 1);
    cfg.general.query_wait_timeout = Duration::from_millis(500);
    let proxy = start_pgmemo(cfg).await;
    let holder = connect(&url(&proxy, DB)).await;
    let waiter = connect(&url(&proxy, DB)).await;
    holder
        .batch_execute("BEGIN; CREATE TABLE t (x int)")
        .await
        .unwrap();

    let started = Instant::now();
    let err = waiter
        .simple_query("SELECT 1")
        .await
        .expect_err("no server within query_wait_timeout");
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_millis(450),
        "error after only {waited:?}"
    );
    assert!(
        waited < Duration::from_secs(5),
        "error only after {waited:?}"
    );
    let db_err = err
        .as_db_error()
        .unwrap_or_else(|| panic!("not a server error: {err:?}"));
    assert!(
        db_err.message().contains("query_wait_timeout"),
        "{}",
        db_err.message()
    );
    assert_eq!(db_err.code().code(), "08P01");
    wait_until(
        "the waiting client's connection to close",
        Duration::from_secs(5),
        || async { waiter.is_closed() },
    )
    .await;

    holder
        .batch_execute("INSERT INTO t VALUES (1); COMMIT")
        .await
        .unwrap();
    assert_eq!(scalar(&holder, "SELECT count(*) FROM t").await, "1");
    proxy.shutdown().await;
}

/// A client that dies inside `BEGIN; UPDATE ...` (idle in the transaction, or in the middle of
/// a statement) leaves no open transaction and no lock behind, in either mode.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_client_leaves_no_transaction_or_lock() {
    const DB: &str = "pool_kill";
    fresh_db(DB).await;
    let direct = direct().await;
    for mode in [PoolMode::Transaction, PoolMode::Session] {
        let proxy = pgmemo(mode, 2).await;
        let setup = connect(&url(&proxy, DB)).await;
        setup
            .batch_execute("DROP TABLE IF EXISTS t; CREATE TABLE t (id int PRIMARY KEY, v int); INSERT INTO t VALUES (1, 0)")
            .await
            .unwrap();
        drop(setup);

        for mid_statement in [false, true] {
            let what = format!(
                "{mode:?}, killed {}",
                if mid_statement {
                    "mid-statement"
                } else {
                    "between statements"
                }
            );
            let (victim, conn_task) = connect_killable(&url(&proxy, DB)).await;
            victim
                .batch_execute("BEGIN; UPDATE t SET v = v + 1 WHERE id = 1")
                .await
                .unwrap();
            let (running, idle_victim) = if mid_statement {
                let q = tokio::spawn(async move {
                    let _ = victim.simple_query("SELECT pg_sleep(20)").await;
                });
                wait_until("the statement to run", Duration::from_secs(5), || async {
                    backends_where(
                        &direct,
                        DB,
                        "query = 'SELECT pg_sleep(20)' AND state = 'active'",
                    )
                    .await
                        == 1
                })
                .await;
                (Some(q), None)
            } else {
                assert_eq!(
                    backends_where(&direct, DB, "state = 'idle in transaction'").await,
                    1,
                    "{what}"
                );
                (None, Some(victim))
            };
            // Kill: the socket goes away without a Terminate (dropping the Client first would
            // make tokio-postgres say goodbye properly).
            conn_task.abort();
            let _ = conn_task.await;
            drop(idle_victim);

            // The row is not locked (the update was rolled back) ...
            let other = connect(&url(&proxy, DB)).await;
            let v = scalar(
                &other,
                "BEGIN; SET LOCAL lock_timeout = '5s'; UPDATE t SET v = v + 10 WHERE id = 1 RETURNING v",
            )
            .await;
            other.batch_execute("ROLLBACK").await.unwrap();
            assert_eq!(
                v, "10",
                "{what}: the killed client's update was not rolled back"
            );
            drop(other);
            // ... and no server stays idle in a transaction or keeps a lock on t.
            wait_until(
                &format!("{what}: no idle-in-transaction server"),
                Duration::from_secs(5),
                || async {
                    backends_where(
                        &direct,
                        DB,
                        "state LIKE 'idle in transaction%' OR query = 'SELECT pg_sleep(20)'",
                    )
                    .await
                        == 0
                },
            )
            .await;
            // A cancelled backend releases its locks as it finishes aborting: wait for that
            // (bounded), rather than sampling once.
            wait_until(
                &format!("{what}: no locks left behind"),
                Duration::from_secs(5),
                || async {
                    scalar(
                        &direct,
                        &format!(
                            "SELECT count(*) FROM pg_locks l JOIN pg_database d ON d.oid = l.database \
                             WHERE d.datname = '{DB}' AND l.locktype IN ('relation', 'tuple', 'transactionid') AND l.pid <> pg_backend_pid()"
                        ),
                    )
                    .await
                        == "0"
                },
            )
            .await;
            if let Some(q) = running {
                let _ = q.await;
            }
        }
        proxy.shutdown().await;
    }
}

/// `pg_ctl restart -m fast` while clients run queries in a loop: errors are allowed during
/// the restart, then every client's queries work again within server_connect_timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recovers_from_server_restart_under_load() {
    // A private cluster: restarting the shared one would disturb the other tests.
    let pg = tokio::task::spawn_blocking(|| LocalPostgres::start(LocalPostgresOptions::default()))
        .await
        .unwrap()
        .expect("private PostgreSQL for the restart test");
    let pg = Arc::new(Mutex::new(pg));
    let port = pg.lock().unwrap().port();
    let mut cfg = Config::for_upstream(Upstream {
        host: "127.0.0.1".into(),
        port,
        user: "postgres".into(),
        password: None,
        ..Default::default()
    });
    cfg.general.listen = "127.0.0.1:0".into();
    cfg.general.auth_type = AuthType::Trust;
    cfg.general.default_pool_size = 4;
    let connect_timeout = Duration::from_secs(10);
    cfg.general.server_connect_timeout = connect_timeout;
    let proxy = start_pgmemo(cfg).await;
    let url = proxy_url(proxy.local_addr(), "postgres", None, "postgres");

    const WORKERS: usize = 6;
    let stop = Arc::new(AtomicBool::new(false));
    // Per worker: successful queries, and when the last one succeeded.
    let successes: Arc<Vec<AtomicUsize>> =
        Arc::new((0..WORKERS).map(|_| AtomicUsize::new(0)).collect());
    let last_ok: Arc<Mutex<Vec<Option<Instant>>>> = Arc::new(Mutex::new(vec![None; WORKERS]));
    let errors = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for w in 0..WORKERS {
        let (stop, successes, last_ok, errors, url) = (
            stop.clone(),
            successes.clone(),
            last_ok.clone(),
            errors.clone(),
            url.clone(),
        );
        tasks.push(tokio::spawn(async move {
            let mut client: Option<Client> = None;
            let mut i = 0u64;
            while !stop.load(Ordering::Relaxed) {
                if client.as_ref().is_none_or(|c| c.is_closed()) {
                    client = match tokio_postgres::connect(&url, NoTls).await {
                        Ok((c, conn)) => {
                            tokio::spawn(conn);
                            Some(c)
                        }
                        Err(_) => {
                            errors.fetch_add(1, Ordering::Relaxed);
                            None
                        }
                    };
                }
                if let Some(c) = &client {
                    i += 1;
                    // Alternate between plain queries and short transactions.
                    let sql = if i.is_multiple_of(2) {
                        format!("SELECT {i}")
                    } else {
                        format!("BEGIN; SELECT {i}; COMMIT")
                    };
                    match c.simple_query(&sql).await {
                        Ok(msgs) => {
                            let got = msgs.iter().find_map(|m| match m {
                                SimpleQueryMessage::Row(r) => r.get(0).map(str::to_owned),
                                _ => None,
                            });
                            assert_eq!(got, Some(i.to_string()), "worker {w}");
                            successes[w].fetch_add(1, Ordering::Relaxed);
                            last_ok.lock().unwrap()[w] = Some(Instant::now());
                        }
                        Err(_) => {
                            errors.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                }
                // Pace the load a little (not a synchronisation).
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }));
    }
    wait_until(
        "every worker to run queries",
        Duration::from_secs(10),
        || async { successes.iter().all(|s| s.load(Ordering::Relaxed) >= 5) },
    )
    .await;

    let pg2 = pg.clone();
    tokio::task::spawn_blocking(move || pg2.lock().unwrap().restart("fast"))
        .await
        .unwrap()
        .expect("pg_ctl restart -m fast");
    let restarted = Instant::now();
    wait_until(
        "every worker to succeed again after the restart",
        connect_timeout,
        || async {
            last_ok
                .lock()
                .unwrap()
                .iter()
                .all(|t| t.is_some_and(|t| t > restarted))
        },
    )
    .await;
    stop.store(true, Ordering::Relaxed);
    for t in tasks {
        t.await.unwrap();
    }
    // A brand-new client works too.
    let fresh = connect(&url).await;
    assert_eq!(
        scalar(&fresh, "SELECT 'after restart'").await,
        "after restart"
    );
    eprintln!(
        "restart test: {} successful queries, {} errors during the restart",
        successes
            .iter()
            .map(|s| s.load(Ordering::Relaxed))
            .sum::<usize>(),
        errors.load(Ordering::Relaxed)
    );
    drop(fresh);
    proxy.shutdown().await;
    tokio::task::spawn_blocking(move || drop(pg)).await.unwrap();
}

/// RELOAD (admin console, with the reloader the binary sets) and `Pgmemo::reload_with` grow
/// pool_size while clients wait: the waiting clients get servers at once and the number of
/// server connections rises.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reload_changes_pool_size_live() {
    const DB: &str = "pool_reload";
    fresh_db(DB).await;
    let direct = direct().await;
    let proxy = pgmemo(PoolMode::Transaction, 2).await;
    proxy.set_reloader(Box::new(|| Ok(test_config(PoolMode::Transaction, 5))));

    // Hold both servers in open transactions.
    let mut holders = Vec::new();
    for _ in 0..2 {
        let c = connect(&url(&proxy, DB)).await;
        c.batch_execute("BEGIN; SELECT 1").await.unwrap();
        holders.push(c);
    }
    let spawn_waiters = |n: usize| {
        let mut v = Vec::new();
        for _ in 0..n {
            let url = url(&proxy, DB);
            v.push(tokio::spawn(async move {
                let c = connect(&url).await;
                scalar(&c, "SELECT 'served'").await
            }));
        }
        v
    };
    let waiters = spawn_waiters(3);
    wait_until("3 clients waiting", Duration::from_secs(5), || async {
        cl_waiting(&proxy, DB).await == 3
    })
    .await;
    assert_eq!(backends(&direct, DB).await, 2);

    let client = connect(&url(&proxy, "pgmemo")).await;
    client.simple_query("RELOAD").await.expect("RELOAD");
    for w in waiters {
        let got = tokio::time::timeout(Duration::from_secs(5), w)
            .await
            .expect("a waiting client is served after RELOAD grew the pool")
            .unwrap();
        assert_eq!(got, "served");
    }
    assert_eq!(backends(&direct, DB).await, 5);
    let size = admin(&proxy, "SHOW CONFIG")
        .await
        .into_iter()
        .find(|r| r["key"].as_deref() == Some("default_pool_size"))
        .expect("default_pool_size in SHOW CONFIG");
    assert_eq!(size["value"].as_deref(), Some("5"));

    // Hold all 5, queue 2 more, then grow to 7 with reload_with.
    for _ in 0..3 {
        let c = connect(&url(&proxy, DB)).await;
        c.batch_execute("BEGIN; SELECT 1").await.unwrap();
        holders.push(c);
    }
    let waiters = spawn_waiters(2);
    wait_until("2 clients waiting", Duration::from_secs(5), || async {
        cl_waiting(&proxy, DB).await == 2
    })
    .await;
    assert_eq!(backends(&direct, DB).await, 5);
    proxy
        .reload_with(test_config(PoolMode::Transaction, 7))
        .expect("reload_with");
    for w in waiters {
        let got = tokio::time::timeout(Duration::from_secs(5), w)
            .await
            .expect("a waiting client is served after reload_with grew the pool")
            .unwrap();
        assert_eq!(got, "served");
    }
    assert_eq!(backends(&direct, DB).await, 7);

    // Shrinking: servers beyond the new size are closed as they come back.
    proxy
        .reload_with(test_config(PoolMode::Transaction, 2))
        .expect("reload_with");
    for h in &holders {
        h.batch_execute("COMMIT").await.unwrap();
    }
    wait_until(
        "the pool to shrink to 2 servers",
        Duration::from_secs(5),
        || async { backends(&direct, DB).await == 2 },
    )
    .await;
    // Still a working pool of 2: two transactions at once, a third client waits.
    holders[0].batch_execute("BEGIN; SELECT 1").await.unwrap();
    holders[1].batch_execute("BEGIN; SELECT 1").await.unwrap();
    let mut third = spawn_waiters(1);
    wait_until("a third client waiting", Duration::from_secs(5), || async {
        cl_waiting(&proxy, DB).await == 1
    })
    .await;
    holders[0].batch_execute("COMMIT").await.unwrap();
    let got = tokio::time::timeout(Duration::from_secs(5), third.pop().unwrap())
        .await
        .expect("served after COMMIT")
        .unwrap();
    assert_eq!(got, "served");
    holders[1].batch_execute("COMMIT").await.unwrap();
    assert!(backends(&direct, DB).await <= 2);
    proxy.shutdown().await;
}

/// A CancelRequest sent to pgmemo (with the BackendKeyData pgmemo gave) cancels that
/// client's query within 2 s, and only that one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_reaches_only_the_right_server() {
    const DB: &str = "pool_cancel";
    fresh_db(DB).await;
    let direct = direct().await;
    for mode in [PoolMode::Transaction, PoolMode::Session] {
        let proxy = pgmemo(mode, 2).await;
        let victim = Arc::new(connect(&url(&proxy, DB)).await);
        let bystander = connect(&url(&proxy, DB)).await;
        let token = victim.cancel_token();

        let v = victim.clone();
        let long = tokio::spawn(async move {
            let r = v.simple_query("SELECT pg_sleep(30)").await;
            (r, Instant::now())
        });
        let short = tokio::spawn(async move {
            let started = Instant::now();
            let r = bystander.simple_query("SELECT pg_sleep(1)").await;
            (r, started.elapsed())
        });
        wait_until("both queries to run", Duration::from_secs(5), || async {
            backends_where(
                &direct,
                DB,
                "query LIKE 'SELECT pg_sleep(%' AND state = 'active'",
            )
            .await
                == 2
        })
        .await;

        let cancelled_at = Instant::now();
        token
            .cancel_query(NoTls)
            .await
            .expect("send cancel to pgmemo");
        let (r, ended) = tokio::time::timeout(Duration::from_secs(2), long)
            .await
            .unwrap_or_else(|_| panic!("{mode:?}: pg_sleep(30) still running 2 s after the cancel"))
            .unwrap();
        let err = r.expect_err("the cancelled query fails");
        assert_eq!(
            err.code().map(|c| c.code()),
            Some("57014"),
            "{mode:?}: {err:?}"
        );
        assert!(ended - cancelled_at < Duration::from_secs(2));

        let (r, took) = short.await.unwrap();
        r.unwrap_or_else(|e| panic!("{mode:?}: the other client's query was disturbed: {e:?}"));
        assert!(
            took >= Duration::from_millis(950),
            "{mode:?}: pg_sleep(1) ended after {took:?}"
        );
        // The cancelled client carries on.
        assert_eq!(scalar(&victim, "SELECT 'still here'").await, "still here");
        drop(victim);
        proxy.shutdown().await;
    }
}

/// Session mode: the next client on a server sees nothing of the previous one's session
/// (settings, temp tables, prepared statements): DISCARD ALL ran in between.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_mode_resets_servers_between_clients() {
    const DB: &str = "pool_reset";
    fresh_db(DB).await;
    let proxy = pgmemo(PoolMode::Session, 1).await;
    let a = connect(&url(&proxy, DB)).await;
    let default_work_mem = scalar(&a, "SHOW work_mem").await;
    a.batch_execute(
        "SET work_mem = '7MB'; CREATE TEMP TABLE tmp_a (x int); INSERT INTO tmp_a VALUES (1); \
         PREPARE stmt_a AS SELECT 1; SELECT set_config('my.var', 'client a', false)",
    )
    .await
    .unwrap();
    assert_eq!(scalar(&a, "SHOW work_mem").await, "7MB");
    let pid_a = scalar(&a, "SELECT pg_backend_pid()").await;
    drop(a);

    let b = connect(&url(&proxy, DB)).await;
    assert_eq!(
        scalar(&b, "SELECT pg_backend_pid()").await,
        pid_a,
        "the same server (pool of 1)"
    );
    assert_eq!(scalar(&b, "SHOW work_mem").await, default_work_mem);
    assert_eq!(
        scalar(&b, "SELECT count(*) FROM pg_class WHERE relname = 'tmp_a'").await,
        "0",
        "client A's temp table is visible to client B"
    );
    // Client A's statement is gone; pgmemo's own shared statements (`pgmemo_s<n>`, from
    // autoprepare here) are kept by the reset on purpose.
    assert_eq!(
        scalar(
            &b,
            "SELECT count(*) FROM pg_prepared_statements WHERE name !~ '^pgmemo_s[0-9]+$'"
        )
        .await,
        "0"
    );
    assert_eq!(
        scalar(&b, "SELECT coalesce(current_setting('my.var', true), '')").await,
        ""
    );
    drop(b);
    proxy.shutdown().await;
}

/// min_pool_size: the pool opens servers by itself, up to the minimum.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn min_pool_size_opens_servers() {
    const DB: &str = "pool_min";
    fresh_db(DB).await;
    let direct = direct().await;
    let mut cfg = test_config(PoolMode::Transaction, 4);
    cfg.general.min_pool_size = 3;
    let proxy = start_pgmemo(cfg).await;
    // Pools are made on first use: one client, one query, one server.
    let client = connect(&url(&proxy, DB)).await;
    assert_eq!(scalar(&client, "SELECT 1").await, "1");
    wait_until("min_pool_size servers", Duration::from_secs(5), || async {
        backends(&direct, DB).await == 3
    })
    .await;
    let idle = admin(&proxy, "SHOW POOLS")
        .await
        .into_iter()
        .find(|r| r["database"].as_deref() == Some(DB))
        .unwrap();
    assert_eq!(idle["sv_idle"].as_deref(), Some("3"));
    proxy.shutdown().await;
}

/// server_idle_timeout: idle servers are closed, down to min_pool_size.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_idle_timeout_closes_idle_servers() {
    const DB: &str = "pool_idle";
    fresh_db(DB).await;
    let direct = direct().await;
    let mut cfg = test_config(PoolMode::Transaction, 4);
    cfg.general.server_idle_timeout = Duration::from_millis(300);
    cfg.general.min_pool_size = 1;
    let proxy = start_pgmemo(cfg).await;
    // Three transactions at once open three servers.
    let mut clients = Vec::new();
    for _ in 0..3 {
        let c = connect(&url(&proxy, DB)).await;
        c.batch_execute("BEGIN; SELECT 1").await.unwrap();
        clients.push(c);
    }
    assert_eq!(backends(&direct, DB).await, 3);
    for c in &clients {
        c.batch_execute("COMMIT").await.unwrap();
    }
    wait_until(
        "idle servers to be closed down to min_pool_size",
        Duration::from_secs(6),
        || async { backends(&direct, DB).await == 1 },
    )
    .await;
    // Still usable.
    assert_eq!(scalar(&clients[0], "SELECT 'ok'").await, "ok");
    proxy.shutdown().await;
}

/// Many clients with a tiny query_wait_timeout churn through a small pool: some time out,
/// some get servers at the last moment. Afterwards every slot of the pool is still usable
/// (a server handed to a waiter just as it gave up must not be lost, nor its slot).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wait_timeouts_under_churn_lose_no_slot() {
    const DB: &str = "pool_churn";
    fresh_db(DB).await;
    let direct = direct().await;
    let proxy = pgmemo(PoolMode::Transaction, 2).await;
    let mut clients = Vec::new();
    for _ in 0..12 {
        clients.push(connect(&url(&proxy, DB)).await);
    }
    let mut cfg = test_config(PoolMode::Transaction, 2);
    cfg.general.query_wait_timeout = Duration::from_millis(5);
    proxy.reload_with(cfg).unwrap();
    let timeouts = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for mut client in clients {
        let url = url(&proxy, DB);
        let timeouts = timeouts.clone();
        tasks.push(tokio::spawn(async move {
            for i in 0..60 {
                match client.simple_query(&format!("SELECT {i}")).await {
                    Ok(_) => {}
                    Err(_) => {
                        timeouts.fetch_add(1, Ordering::Relaxed);
                        client = connect(&url).await;
                    }
                }
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    eprintln!("churn: {} wait timeouts", timeouts.load(Ordering::Relaxed));
    // Both slots still work: two transactions at once, each on its own server.
    let mut cfg = test_config(PoolMode::Transaction, 2);
    cfg.general.query_wait_timeout = Duration::from_secs(5);
    proxy.reload_with(cfg).unwrap();
    let a = connect(&url(&proxy, DB)).await;
    let b = connect(&url(&proxy, DB)).await;
    a.batch_execute("BEGIN; SELECT 1").await.unwrap();
    b.batch_execute("BEGIN; SELECT 1")
        .await
        .expect("the pool's second slot is lost");
    assert_ne!(
        scalar(&a, "SELECT pg_backend_pid()").await,
        scalar(&b, "SELECT pg_backend_pid()").await
    );
    a.batch_execute("COMMIT").await.unwrap();
    b.batch_execute("COMMIT").await.unwrap();
    let pools = admin(&proxy, "SHOW POOLS").await;
    let pool = pools
        .iter()
        .find(|r| r["database"].as_deref() == Some(DB))
        .unwrap();
    assert_eq!(pool["cl_waiting"].as_deref(), Some("0"));
    let servers = admin(&proxy, "SHOW SERVERS").await;
    let listed = servers
        .iter()
        .filter(|r| r["database"].as_deref() == Some(DB))
        .count() as i64;
    assert_eq!(
        listed,
        backends(&direct, DB).await,
        "SHOW SERVERS lists exactly the live servers"
    );
    assert!(listed <= 2);
    proxy.shutdown().await;
}

/// Upstream down: a client gets a clear error within server_connect_timeout, not a hang;
/// once the server is up, pgmemo serves again by itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_down_errors_in_time_and_recovers() {
    let port = free_port();
    let mut cfg = Config::for_upstream(Upstream {
        host: "127.0.0.1".into(),
        port,
        user: "postgres".into(),
        password: None,
        ..Default::default()
    });
    cfg.general.listen = "127.0.0.1:0".into();
    cfg.general.auth_type = AuthType::Trust;
    let connect_timeout = Duration::from_secs(1);
    cfg.general.server_connect_timeout = connect_timeout;
    let proxy = start_pgmemo(cfg).await;
    let url = proxy_url(proxy.local_addr(), "postgres", None, "postgres");

    let started = Instant::now();
    let err = match tokio_postgres::connect(&url, NoTls).await {
        Ok((client, conn)) => {
            tokio::spawn(conn);
            client
                .simple_query("SELECT 1")
                .await
                .expect_err("no server to run it")
        }
        Err(e) => e,
    };
    let took = started.elapsed();
    assert!(
        took < connect_timeout + Duration::from_secs(2),
        "the error came only after {took:?}"
    );
    let db_err = err
        .as_db_error()
        .unwrap_or_else(|| panic!("not an error from pgmemo: {err:?}"));
    assert_eq!(db_err.code().code(), "08006", "{db_err:?}");
    assert!(
        db_err.message().contains("could not connect"),
        "{}",
        db_err.message()
    );

    // The server comes up on that port; pgmemo needs no restart.
    let pg = tokio::task::spawn_blocking(move || {
        LocalPostgres::start(LocalPostgresOptions {
            port: Some(port),
            ..LocalPostgresOptions::default()
        })
    })
    .await
    .unwrap()
    .expect("PostgreSQL on the upstream port");
    let client = connect(&url).await;
    assert_eq!(scalar(&client, "SELECT 'back'").await, "back");
    drop(client);
    proxy.shutdown().await;
    tokio::task::spawn_blocking(move || drop(pg)).await.unwrap();
}

/// max_client_conn: one client too many is refused with 53300; the others are unaffected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_client_conn_refuses_extra_clients() {
    let mut cfg = test_config(PoolMode::Transaction, 2);
    cfg.general.max_client_conn = 2;
    let proxy = start_pgmemo(cfg).await;
    let a = connect(&url(&proxy, TEST_DB)).await;
    let b = connect(&url(&proxy, TEST_DB)).await;
    let err = tokio_postgres::connect(&url(&proxy, TEST_DB), NoTls)
        .await
        .err()
        .expect("a third client is refused");
    assert_eq!(err.code().map(|c| c.code()), Some("53300"), "{err:?}");
    assert_eq!(scalar(&a, "SELECT 1").await, "1");
    drop(b);
    // A free place again once a client left.
    wait_until(
        "a place for a new client",
        Duration::from_secs(5),
        || async {
            match tokio_postgres::connect(&url(&proxy, TEST_DB), NoTls).await {
                Ok((c, conn)) => {
                    tokio::spawn(conn);
                    c.simple_query("SELECT 1").await.is_ok()
                }
                Err(_) => false,
            }
        },
    )
    .await;
    proxy.shutdown().await;
}

/// The CPUs this thread may run on.
fn allowed_cpus() -> Vec<usize> {
    // SAFETY: a zeroed cpu_set_t is an empty set, filled in by the kernel.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    let size = std::mem::size_of::<libc::cpu_set_t>();
    if unsafe { libc::sched_getaffinity(0, size, &mut set) } != 0 {
        return Vec::new();
    }
    (0..libc::CPU_SETSIZE as usize)
        .filter(|&cpu| unsafe { libc::CPU_ISSET(cpu, &set) })
        .collect()
}

/// A fresh database `db` with an empty table `writes (client, n)`, and pgmemo on two workers
/// with a transaction pool of 2 in front of it.
async fn two_workers_writing(db: &'static str) -> Pgmemo {
    fresh_db(db).await;
    let setup = connect(&cluster().url(PGMEMO_USER, Some(PGMEMO_PASS), db)).await;
    setup
        .batch_execute("CREATE TABLE writes (client int, n int)")
        .await
        .unwrap();
    let mut config = test_config(PoolMode::Transaction, 2);
    config.general.workers = 2;
    start_pgmemo(config).await
}

/// A single-threaded runtime for a client thread of its own (pinned to a CPU by the caller).
fn own_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// Keeps the calling thread on `cpu` (its connections' packets then arrive there).
fn pin_to(cpu: usize) {
    // SAFETY: as above; a set holding one CPU.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    unsafe { libc::CPU_SET(cpu, &mut set) };
    let r = unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) };
    assert_eq!(r, 0, "sched_setaffinity to CPU {cpu}");
}

/// Two workers and a pool of 2 servers for 8 clients: a client is served by the worker its
/// packets arrive at (its connecting thread is pinned to alternate CPUs here, so both
/// workers get clients), and a server handed to a client on the other worker moves there.
/// Every transaction still reads exactly its client's own writes, on the same 2 backends
/// throughout (moving keeps the connection), and the moves are counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn servers_move_between_workers_with_their_clients() {
    const DB: &str = "pool_workers";
    const CLIENTS: usize = 8;
    const ROUNDS: usize = 60;
    let proxy = two_workers_writing(DB).await;
    let cpus = allowed_cpus();
    let url = url(&proxy, DB);
    // Both servers are opened from the first CPU's worker first (two transactions at once):
    // the other worker's clients then cannot be served without a move. Otherwise each worker
    // could keep one server for its own clients for the whole run (check-in prefers a client
    // of the server's worker), and `moves > 0` below would be luck.
    if let Some(&cpu) = cpus.first() {
        let url = url.clone();
        tokio::task::spawn_blocking(move || {
            std::thread::spawn(move || {
                pin_to(cpu);
                own_runtime().block_on(async move {
                    let (a, b) = (connect(&url).await, connect(&url).await);
                    a.batch_execute("BEGIN; SELECT 1").await.unwrap();
                    b.batch_execute("BEGIN; SELECT 1").await.unwrap();
                    a.batch_execute("COMMIT").await.unwrap();
                    b.batch_execute("COMMIT").await.unwrap();
                })
            })
            .join()
        })
        .await
        .unwrap()
        .expect("opening both servers");
    }
    let threads: Vec<_> = (0..CLIENTS)
        .map(|client| {
            let url = url.clone();
            let cpu = (cpus.len() >= 2).then(|| cpus[client % 2]);
            std::thread::spawn(move || {
                if let Some(cpu) = cpu {
                    pin_to(cpu);
                }
                own_runtime().block_on(async move {
                    let c = connect(&url).await;
                    let mut backends = Vec::new();
                    for n in 1..=ROUNDS {
                        let sql = format!(
                            "BEGIN; INSERT INTO writes VALUES ({client}, {n}); \
                             SELECT count(*), sum(n), pg_backend_pid() FROM writes \
                             WHERE client = {client}; COMMIT"
                        );
                        let r = rows(&c, &sql).await;
                        let expected_sum = n * (n + 1) / 2;
                        assert_eq!(
                            (r[0][0].as_deref(), r[0][1].as_deref()),
                            (
                                Some(n.to_string().as_str()),
                                Some(expected_sum.to_string().as_str())
                            ),
                            "client {client}, round {n}"
                        );
                        backends.push(r[0][2].clone().unwrap());
                    }
                    backends
                })
            })
        })
        .collect();
    let backends: std::collections::HashSet<String> = tokio::task::spawn_blocking(move || {
        threads
            .into_iter()
            .flat_map(|t| t.join().expect("client thread"))
            .collect()
    })
    .await
    .unwrap();
    assert!(
        backends.len() <= 2,
        "{} backends served a pool of 2: {backends:?}",
        backends.len()
    );
    let moves: u64 = proxy
        .app()
        .pools()
        .iter()
        .map(|p| p.stats.snapshot().server_moves)
        .sum();
    // A client goes to worker (its CPU % 2): with two CPUs of different parity both workers
    // had clients, and the 2 servers went back and forth between them.
    if cpus.len() >= 2 && cpus[0] % 2 != cpus[1] % 2 {
        assert!(moves > 0, "no server moved between the workers");
    } else {
        eprintln!("fewer than two CPUs of different parity here ({cpus:?}): moves not checked");
    }
    proxy.shutdown().await;
}

/// Two workers: a client is placed by the CPU it connected from, and its session moves to
/// the worker of the CPU it sends from later (checked at every 64th read while idle). Here
/// every client connects from one CPU, then its thread moves to a CPU of the other parity:
/// every session moves to the other worker, and each keeps reading exactly its own writes,
/// by the simple and the extended protocol, before and after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_follow_the_cpu_their_client_sends_from() {
    const DB: &str = "pool_client_moves";
    const CLIENTS: usize = 4;
    const ROUNDS: i64 = 200;
    let cpus = allowed_cpus();
    let Some((from, to)) = cpus
        .iter()
        .find_map(|&a| cpus.iter().find(|&&b| a % 2 != b % 2).map(|&b| (a, b)))
    else {
        eprintln!("no two CPUs of different parity here ({cpus:?}): not run");
        return;
    };
    let proxy = two_workers_writing(DB).await;
    let url = url(&proxy, DB);
    let threads: Vec<_> = (0..CLIENTS as i32)
        .map(|client| {
            let url = url.clone();
            std::thread::spawn(move || {
                pin_to(from);
                own_runtime().block_on(async move {
                    let c = connect(&url).await;
                    pin_to(to);
                    for n in 1..=ROUNDS {
                        let sql = format!(
                            "INSERT INTO writes VALUES ({client}, {n}); \
                             SELECT count(*) FROM writes WHERE client = {client}"
                        );
                        let r = rows(&c, &sql).await;
                        assert_eq!(r[0][0].as_deref(), Some(n.to_string().as_str()));
                        let row = c
                            .query_one("SELECT sum(n) FROM writes WHERE client = $1", &[&client])
                            .await
                            .unwrap();
                        assert_eq!(row.get::<_, i64>(0), n * (n + 1) / 2, "client {client}");
                    }
                })
            })
        })
        .collect();
    tokio::task::spawn_blocking(move || {
        for t in threads {
            t.join().expect("client thread");
        }
    })
    .await
    .unwrap();
    let moves: u64 = proxy
        .app()
        .pools()
        .iter()
        .map(|p| p.stats.snapshot().client_moves)
        .sum();
    assert!(
        moves >= CLIENTS as u64,
        "{moves} session moves for {CLIENTS} clients that all changed CPU"
    );
    proxy.shutdown().await;
}

/// `server_round_robin` (PgBouncer's): the idle server that waited longest goes out first, so
/// a client's transactions take turns over the pool's servers; by default the most recently
/// used one takes them all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_round_robin_takes_turns_over_the_idle_servers() {
    for round_robin in [false, true] {
        let mut config = test_config(PoolMode::Transaction, 2);
        config.general.server_round_robin = round_robin;
        let proxy = start_pgmemo(config).await;
        let url = proxy_url(proxy.local_addr(), PGMEMO_USER, Some(PGMEMO_PASS), TEST_DB);
        // Two servers open: two transactions at once.
        let (a, b) = (connect(&url).await, connect(&url).await);
        a.simple_query("BEGIN").await.unwrap();
        b.simple_query("BEGIN").await.unwrap();
        let first = scalar(&a, "SELECT pg_backend_pid()").await;
        let second = scalar(&b, "SELECT pg_backend_pid()").await;
        assert_ne!(first, second);
        a.simple_query("COMMIT").await.unwrap();
        b.simple_query("COMMIT").await.unwrap();
        let mut pids = Vec::new();
        for _ in 0..4 {
            pids.push(scalar(&a, "SELECT pg_backend_pid()").await);
        }
        match round_robin {
            // The server a returned first, then b's, then a's again: turns.
            true => assert_eq!(pids, [&*first, &second, &first, &second], "round robin"),
            // The one b gave back last, every time.
            false => assert_eq!(pids, [second.as_str(); 4], "most recently used"),
        }
        proxy.shutdown().await;
    }
}

/// A server's FATAL right behind its ReadyForQuery to a client whose work on it that ends (a
/// fast shutdown or a terminated backend, read in one go with the reply) is the server's news,
/// not the client's: in transaction mode the client holds no server between transactions.
/// PgBouncer closes an idle server that says something; pgmemo closes the server and the
/// client goes on on another. (Relayed, the FATAL ended a client whose query had succeeded:
/// tests/replicas.rs saw it once as a standby stopped under load.) On one thread, so that
/// pgmemo reads the reply and the FATAL together: the thread is held by a blocking psql from
/// while the query runs until its backend, done with it, has been terminated and is gone.
#[tokio::test]
async fn a_fatal_right_behind_the_last_reply_closes_the_server_not_the_client() {
    const DB: &str = "pool_fatal_behind";
    fresh_db(DB).await;
    let direct = direct().await;
    let proxy = pgmemo(PoolMode::Transaction, 1).await;
    let client = connect(&url(&proxy, DB)).await;
    let pid = scalar(&client, "SELECT pg_backend_pid()").await;
    let query = tokio::spawn(async move {
        let done = client.simple_query("SELECT pg_sleep(0.2)").await;
        (client, done)
    });
    wait_until("the query to run", Duration::from_secs(5), || async {
        backends_where(&direct, DB, &format!("pid = {pid} AND state = 'active'")).await == 1
    })
    .await;
    // pgmemo's thread is held from here: the backend's last reply and its FATAL wait in the
    // socket until it is gone.
    cluster().psql(
        "postgres",
        &format!(
            "DO $$ BEGIN
               WHILE (SELECT state FROM pg_stat_activity WHERE pid = {pid}) = 'active' LOOP
                 PERFORM pg_sleep(0.01); PERFORM pg_stat_clear_snapshot();
               END LOOP;
               PERFORM pg_terminate_backend({pid});
               WHILE EXISTS (SELECT FROM pg_stat_activity WHERE pid = {pid}) LOOP
                 PERFORM pg_sleep(0.01); PERFORM pg_stat_clear_snapshot();
               END LOOP;
             END $$"
        ),
    );
    let (client, done) = query.await.unwrap();
    done.expect("the query's reply");
    // (A client whose connection ended panics here.)
    let other = scalar(&client, "SELECT pg_backend_pid()").await;
    assert_ne!(other, pid, "another server");
}
