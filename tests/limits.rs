//! What protects PostgreSQL, against a real PostgreSQL: max_db_connections and
//! max_user_connections across pools (clients wait, an idle server of another pool is closed
//! for them), the reserve pool, max_db_client_connections and max_user_client_connections
//! (refused at login), query_timeout, idle_transaction_timeout, transaction_timeout and
//! client_idle_timeout, general and per user (PgBouncer's FATAL 08P01 messages), and TCP
//! keepalive on pgmemo's sockets.
//!
//! Every pool logs into the cluster as the `pgmemo` role (`[upstream]`), so two client users
//! make two pools of one database; server connections are counted in `pg_stat_activity`.
//! Each test uses its own databases. Waiting is always for a condition, polled with a bound.

mod common;

use common::*;
use pgmemo::config::{Config, DatabaseConfig, PoolMode, UserConfig};
use pgmemo::Pgmemo;
use std::collections::HashMap;
use std::time::Duration;
use tokio_postgres::{Client, SimpleQueryMessage};

const OTHER_USER: &str = "plain_user";
const OTHER_PASS: &str = "plain_pass";

/// The test configuration with two client users, `pgmemo` and `plain_user` (no PostgreSQL
/// role: both log into the server as the fixed role `pgmemo`).
fn two_users(pool_size: u32) -> Config {
    let mut cfg = test_config(PoolMode::Transaction, pool_size);
    log_in_as_pgmemo(&mut cfg);
    for (name, password) in [(PGMEMO_USER, PGMEMO_PASS), (OTHER_USER, OTHER_PASS)] {
        cfg.users.insert(
            name.into(),
            UserConfig {
                password: Some(password.into()),
                ..UserConfig::default()
            },
        );
    }
    cfg
}

async fn client(proxy: &Pgmemo, user: &str, db: &str) -> Client {
    let password = if user == PGMEMO_USER {
        PGMEMO_PASS
    } else {
        OTHER_PASS
    };
    connect(&proxy_url(proxy.local_addr(), user, Some(password), db)).await
}

async fn scalar(client: &Client, sql: &str) -> String {
    match &client.simple_query(sql).await.unwrap()[1] {
        SimpleQueryMessage::Row(r) => r.get(0).unwrap_or_default().to_owned(),
        other => panic!("expected a row, got {other:?}"),
    }
}

/// pgmemo's server connections to the databases `dbs`.
async fn backends(dbs: &[&str]) -> i64 {
    let direct = connect(&cluster().url(SUPERUSER, Some(SUPERUSER_PASS), "postgres")).await;
    let list = dbs
        .iter()
        .map(|d| format!("'{d}'"))
        .collect::<Vec<_>>()
        .join(",");
    scalar(
        &direct,
        &format!(
            "SELECT count(*) FROM pg_stat_activity WHERE datname IN ({list}) \
             AND usename = '{PGMEMO_USER}' AND backend_type = 'client backend'"
        ),
    )
    .await
    .parse()
    .unwrap()
}

/// The console's rows for `cmd`, as column name → value maps.
async fn admin(proxy: &Pgmemo, cmd: &str) -> Vec<HashMap<String, String>> {
    let console = client(proxy, PGMEMO_USER, "pgmemo").await;
    admin_rows(&console, cmd).await
}

/// Clients waiting in the pool of (`db`, `user`).
async fn waiting(proxy: &Pgmemo, db: &str, user: &str) -> usize {
    admin(proxy, "SHOW POOLS")
        .await
        .iter()
        .find(|r| r["database"] == db && r["user"] == user)
        .map_or(0, |r| r["cl_waiting"].parse().unwrap())
}

// ---------------------------------------------------------------------------------------------

/// max_db_connections = 2 over two pools of 2: the second user's client waits while the
/// first holds both servers in transactions, gets a server as soon as one is returned (it is
/// closed for it), and when the first user's servers are idle one of them is closed for the
/// second user's client at once. PostgreSQL never sees more than 2.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_db_connections_holds_across_pools() {
    const DB: &str = "limits_db";
    fresh_db(DB).await;
    let mut cfg = two_users(2);
    cfg.databases.insert(
        DB.into(),
        DatabaseConfig {
            max_db_connections: Some(2),
            ..DatabaseConfig::default()
        },
    );
    let proxy = start_pgmemo(cfg).await;
    // The other user's pool first, its server left idle.
    let b = client(&proxy, OTHER_USER, DB).await;
    b.batch_execute("SELECT 1").await.unwrap();
    // Two transactions of the first user: the second one's server is the other pool's
    // idle one, closed for it.
    let a1 = client(&proxy, PGMEMO_USER, DB).await;
    let a2 = client(&proxy, PGMEMO_USER, DB).await;
    for a in [&a1, &a2] {
        tokio::time::timeout(Duration::from_secs(10), a.batch_execute("BEGIN; SELECT 1"))
            .await
            .expect("the other pool's idle server is closed for it")
            .unwrap();
    }
    assert_eq!(backends(&[DB]).await, 2);

    // Both servers busy: the other pool's client waits (it does not fail).
    let queued = tokio::spawn(async move {
        let pid = scalar(&b, "SELECT pg_backend_pid()").await;
        (b, pid)
    });
    wait_until(
        "the other user's client to wait",
        Duration::from_secs(10),
        || async { waiting(&proxy, DB, OTHER_USER).await >= 1 },
    )
    .await;
    assert!(!queued.is_finished());
    assert_eq!(backends(&[DB]).await, 2, "the limit holds while it waits");

    // A server returned: closed for the waiting client of the other pool, which proceeds.
    a1.batch_execute("COMMIT").await.unwrap();
    let (b, _) = tokio::time::timeout(Duration::from_secs(10), queued)
        .await
        .expect("the waiting client gets a server once one is returned")
        .unwrap();
    assert!(backends(&[DB]).await <= 2);
    a2.batch_execute("COMMIT").await.unwrap();

    // Now the first pool holds idle servers; a second client of the other user, while the
    // first one's server is held in a transaction, gets one of them closed for it at once.
    b.batch_execute("BEGIN; SELECT 1").await.unwrap();
    a1.batch_execute("SELECT 1").await.unwrap();
    let b2 = client(&proxy, OTHER_USER, DB).await;
    tokio::time::timeout(Duration::from_secs(10), b2.batch_execute("SELECT 1"))
        .await
        .expect("an idle server of the other pool is closed for it")
        .unwrap();
    assert!(backends(&[DB]).await <= 2);
    b.batch_execute("COMMIT").await.unwrap();

    let dbs = admin(&proxy, "SHOW DATABASES").await;
    let row = dbs.iter().find(|r| r["name"] == DB).unwrap();
    assert_eq!(row["max_connections"], "2");
    assert!(row["current_connections"].parse::<i64>().unwrap() <= 2);
    proxy.shutdown().await;
}

/// max_user_connections = 1 for one user over two databases: its client of the second
/// database waits until the first returns its server, and the other user is not limited.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_user_connections_holds_across_databases() {
    const DB1: &str = "limits_user1";
    const DB2: &str = "limits_user2";
    fresh_db(DB1).await;
    fresh_db(DB2).await;
    let mut cfg = two_users(2);
    cfg.users.get_mut(OTHER_USER).unwrap().max_user_connections = Some(1);
    let proxy = start_pgmemo(cfg).await;
    let second = client(&proxy, OTHER_USER, DB2).await;
    second.batch_execute("SELECT 1").await.unwrap();
    // The user's server in DB2 is idle: closed for its client of DB1.
    let first = client(&proxy, OTHER_USER, DB1).await;
    first.batch_execute("BEGIN; SELECT 1").await.unwrap();
    let queued = tokio::spawn(async move { second.batch_execute("SELECT 1").await });
    wait_until(
        "the user's second client to wait",
        Duration::from_secs(10),
        || async { waiting(&proxy, DB2, OTHER_USER).await >= 1 },
    )
    .await;
    // Another user is not limited by it.
    let other = client(&proxy, PGMEMO_USER, DB2).await;
    other.batch_execute("SELECT 1").await.unwrap();
    assert_eq!(backends(&[DB1, DB2]).await, 2);
    assert!(!queued.is_finished());
    first.batch_execute("COMMIT").await.unwrap();
    tokio::time::timeout(Duration::from_secs(10), queued)
        .await
        .expect("the waiting client gets a server once the user's one is returned")
        .unwrap()
        .unwrap();
    let users = admin(&proxy, "SHOW USERS").await;
    let row = users.iter().find(|r| r["name"] == OTHER_USER).unwrap();
    assert_eq!(row["max_user_connections"], "1");
    proxy.shutdown().await;
}

/// reserve_pool_size = 1: with the only server held, a client that has waited
/// reserve_pool_timeout gets a reserve server and runs; a third client then waits (the
/// reserve is spent) and runs once a server is returned.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reserve_pool_serves_a_client_that_waited() {
    const DB: &str = "limits_reserve";
    fresh_db(DB).await;
    let mut cfg = test_config(PoolMode::Transaction, 1);
    cfg.general.reserve_pool_size = 1;
    cfg.general.reserve_pool_timeout = Duration::from_millis(200);
    let proxy = start_pgmemo(cfg).await;
    let holder = client(&proxy, PGMEMO_USER, DB).await;
    holder.batch_execute("BEGIN; SELECT 1").await.unwrap();
    let second = client(&proxy, PGMEMO_USER, DB).await;
    tokio::time::timeout(
        Duration::from_secs(10),
        second.batch_execute("BEGIN; SELECT 1"),
    )
    .await
    .expect("the reserve pool serves the client that waited (query_wait_timeout is 120 s)")
    .unwrap();
    assert_eq!(backends(&[DB]).await, 2, "pool_size + reserve_pool_size");
    let third = client(&proxy, PGMEMO_USER, DB).await;
    let queued = tokio::spawn(async move { third.batch_execute("SELECT 1").await });
    wait_until(
        "the third client to wait",
        Duration::from_secs(10),
        || async { waiting(&proxy, DB, PGMEMO_USER).await >= 1 },
    )
    .await;
    assert_eq!(backends(&[DB]).await, 2, "the reserve is spent");
    holder.batch_execute("COMMIT").await.unwrap();
    tokio::time::timeout(Duration::from_secs(10), queued)
        .await
        .expect("the third client runs once a server is returned")
        .unwrap()
        .unwrap();
    second.batch_execute("COMMIT").await.unwrap();
    let dbs = admin(&proxy, "SHOW DATABASES").await;
    assert_eq!(
        dbs.iter().find(|r| r["name"] == DB).unwrap()["reserve_pool_size"],
        "1"
    );
    proxy.shutdown().await;
}

/// The `tcp_*` settings are on pgmemo's sockets, read back with getsockopt: the accepted
/// client socket and the server connection (pgmemo runs in this process, so its sockets are
/// among this process's file descriptors).
#[cfg(target_os = "linux")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_keepalive_is_set_on_client_and_server_sockets() {
    use pgmemo::keepalive::{read, Keepalive};
    use std::os::fd::FromRawFd;
    const DB: &str = "limits_keepalive";
    fresh_db(DB).await;
    let mut cfg = test_config(PoolMode::Transaction, 1);
    cfg.general.tcp_keepidle = Duration::from_secs(37);
    cfg.general.tcp_keepintvl = Duration::from_secs(7);
    cfg.general.tcp_keepcnt = 4;
    cfg.general.tcp_user_timeout = Duration::from_millis(2500);
    let proxy = start_pgmemo(cfg).await;
    let c = client(&proxy, PGMEMO_USER, DB).await;
    c.batch_execute("SELECT 1").await.unwrap();
    let (pgmemo_port, pg_port) = (proxy.local_addr().port(), cluster().port());
    // This process's TCP sockets: (local port, peer port, what is set on it).
    let mut sockets = Vec::new();
    for entry in std::fs::read_dir("/proc/self/fd").unwrap().flatten() {
        let Ok(fd) = entry.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let link = std::fs::read_link(entry.path()).unwrap_or_default();
        if !link.to_string_lossy().starts_with("socket:") {
            continue;
        }
        // Borrowed, never closed here.
        let tcp = std::mem::ManuallyDrop::new(unsafe { std::net::TcpStream::from_raw_fd(fd) });
        if let (Ok(local), Ok(peer), Ok(k)) = (tcp.local_addr(), tcp.peer_addr(), read(&fd)) {
            sockets.push((local.port(), peer.port(), k));
        }
    }
    let want = Keepalive {
        enabled: true,
        idle: Duration::from_secs(37),
        interval: Duration::from_secs(7),
        count: 4,
        user_timeout: Duration::from_millis(2500),
    };
    let accepted: Vec<_> = sockets.iter().filter(|s| s.0 == pgmemo_port).collect();
    let to_server: Vec<_> = sockets.iter().filter(|s| s.1 == pg_port).collect();
    assert!(!accepted.is_empty(), "{sockets:?}");
    for s in &accepted {
        assert_eq!(s.2, want, "accepted socket {}→{}", s.0, s.1);
    }
    // Other tests' clients and pgmemos reach the cluster too, with their own settings: this
    // pgmemo's server connection is among them.
    assert!(
        to_server.iter().any(|s| s.2 == want),
        "no server connection with the settings: {to_server:?}"
    );
    proxy.shutdown().await;
}

/// A client whose connection task is kept: its result carries the FATAL that ended it.
async fn client_and_end(
    proxy: &Pgmemo,
    db: &str,
) -> (
    Client,
    tokio::task::JoinHandle<Result<(), tokio_postgres::Error>>,
) {
    let url = proxy_url(proxy.local_addr(), PGMEMO_USER, Some(PGMEMO_PASS), db);
    let (client, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .unwrap();
    (client, tokio::spawn(conn))
}

/// The SQLSTATE and message of the FATAL that ended a connection.
async fn fatal(
    end: tokio::task::JoinHandle<Result<(), tokio_postgres::Error>>,
) -> (String, String) {
    let e = tokio::time::timeout(Duration::from_secs(10), end)
        .await
        .expect("the connection ends")
        .unwrap()
        .expect_err("with an error");
    let db = e
        .as_db_error()
        .unwrap_or_else(|| panic!("a FATAL, got {e:?}"));
    (db.code().code().to_owned(), db.message().to_owned())
}

/// query_timeout = 1 s: a query still running is cancelled, its server closed and the client
/// closed with PgBouncer's FATAL 08P01 "query timeout"; another client is not disturbed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn query_timeout_closes_the_client_and_its_server() {
    const DB: &str = "limits_query_timeout";
    fresh_db(DB).await;
    let mut cfg = test_config(PoolMode::Transaction, 2);
    cfg.general.query_timeout = Duration::from_secs(1);
    let proxy = start_pgmemo(cfg).await;
    let other = client(&proxy, PGMEMO_USER, DB).await;
    let (slow, end) = client_and_end(&proxy, DB).await;
    // The FATAL answers the query in flight; then the connection ends.
    let e = tokio::time::timeout(
        Duration::from_secs(10),
        slow.batch_execute("SELECT pg_sleep(60)"),
    )
    .await
    .expect("query_timeout ends the query")
    .expect_err("with an error");
    let db = e
        .as_db_error()
        .unwrap_or_else(|| panic!("a FATAL, got {e:?}"));
    assert_eq!((db.code().code(), db.message()), ("08P01", "query timeout"));
    tokio::time::timeout(Duration::from_secs(10), end)
        .await
        .expect("the connection ends")
        .unwrap()
        .ok();
    let direct = connect(&cluster().url(SUPERUSER, Some(SUPERUSER_PASS), "postgres")).await;
    wait_until("the slow query to end on the server", Duration::from_secs(10), || async {
        scalar(
            &direct,
            &format!("SELECT count(*) FROM pg_stat_activity WHERE datname = '{DB}' AND query LIKE '%pg_sleep(60)%' AND state = 'active'"),
        )
        .await
            == "0"
    })
    .await;
    other.batch_execute("SELECT 1").await.unwrap();
    proxy.shutdown().await;
}

/// client_idle_timeout = 1 s: a client that sends nothing is closed with PgBouncer's FATAL
/// 08P01 "client_idle_timeout"; one that keeps sending is not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_idle_timeout_closes_an_idle_client() {
    const DB: &str = "limits_client_idle";
    fresh_db(DB).await;
    let mut cfg = test_config(PoolMode::Transaction, 2);
    cfg.general.client_idle_timeout = Duration::from_secs(1);
    let proxy = start_pgmemo(cfg).await;
    let (idle, end) = client_and_end(&proxy, DB).await;
    idle.batch_execute("SELECT 1").await.unwrap();
    assert_eq!(
        fatal(end).await,
        ("08P01".to_owned(), "client_idle_timeout".to_owned())
    );
    proxy.shutdown().await;
}

/// idle_transaction_timeout = 1 s: a client idle inside a transaction is closed with
/// PgBouncer's FATAL 08P01 "idle transaction timeout", its transaction rolled back (its
/// insert is not there); a client idle outside a transaction is not closed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_transaction_timeout_closes_a_client_idle_in_transaction() {
    idle_transaction_timeout_in(PoolMode::Transaction, "limits_idle_tx").await;
}

/// The same in session mode, where the client holds its server between transactions too
/// (it is shown active, as PgBouncer shows a client linked to a server).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_transaction_timeout_closes_a_session_mode_client_idle_in_transaction() {
    idle_transaction_timeout_in(PoolMode::Session, "limits_idle_tx_session").await;
}

async fn idle_transaction_timeout_in(mode: PoolMode, db: &'static str) {
    fresh_db(db).await;
    let mut cfg = test_config(mode, 2);
    cfg.general.idle_transaction_timeout = Duration::from_secs(1);
    let proxy = start_pgmemo(cfg).await;
    let (outside, outside_end) = client_and_end(&proxy, db).await;
    outside
        .batch_execute("CREATE TABLE t (n int)")
        .await
        .unwrap();
    let (inside, end) = client_and_end(&proxy, db).await;
    inside
        .batch_execute("BEGIN; INSERT INTO t VALUES (1)")
        .await
        .unwrap();
    assert_eq!(
        fatal(end).await,
        ("08P01".to_owned(), "idle transaction timeout".to_owned())
    );
    assert_eq!(scalar(&outside, "SELECT count(*) FROM t").await, "0");
    assert!(
        !outside_end.is_finished(),
        "the client outside a transaction stays"
    );
    proxy.shutdown().await;
}

/// How a login through pgmemo as `user` to `db` is refused: its SQLSTATE and message.
async fn refused(proxy: &Pgmemo, user: &str, db: &str) -> (String, String) {
    let password = if user == PGMEMO_USER {
        PGMEMO_PASS
    } else {
        OTHER_PASS
    };
    let url = proxy_url(proxy.local_addr(), user, Some(password), db);
    let e = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .err()
        .unwrap_or_else(|| panic!("{user}'s login to {db} is refused"));
    let db = e
        .as_db_error()
        .unwrap_or_else(|| panic!("a FATAL, got {e:?}"));
    (db.code().code().to_owned(), db.message().to_owned())
}

/// The console's row of `cmd` whose `name` is `name`.
async fn row_named(proxy: &Pgmemo, cmd: &str, name: &str) -> HashMap<String, String> {
    admin(proxy, cmd)
        .await
        .into_iter()
        .find(|r| r["name"] == name)
        .unwrap_or_else(|| panic!("{cmd} has a row {name}"))
}

/// max_db_client_connections = 2 on one database: a third client of it (whatever its user)
/// is refused with PgBouncer's FATAL 08P01, while another database and the admin console
/// still let clients in and the two clients go on; SHOW DATABASES shows the limit and the
/// count; once a client has gone, a new one gets in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_db_client_connections_refuses_a_client_over_the_limit() {
    const DB: &str = "limits_db_clients";
    const OTHER_DB: &str = "limits_db_clients_other";
    fresh_db(DB).await;
    fresh_db(OTHER_DB).await;
    let mut cfg = two_users(2);
    cfg.databases.insert(
        DB.into(),
        DatabaseConfig {
            max_db_client_connections: Some(2),
            ..DatabaseConfig::default()
        },
    );
    let proxy = start_pgmemo(cfg).await;
    let a = client(&proxy, PGMEMO_USER, DB).await;
    let b = client(&proxy, OTHER_USER, DB).await;
    let over = (
        "08P01".to_owned(),
        "client connections exceeded (max_db_client_connections)".to_owned(),
    );
    assert_eq!(refused(&proxy, PGMEMO_USER, DB).await, over);
    assert_eq!(refused(&proxy, OTHER_USER, DB).await, over);
    let elsewhere = client(&proxy, PGMEMO_USER, OTHER_DB).await;
    elsewhere.batch_execute("SELECT 1").await.unwrap();
    a.batch_execute("SELECT 1").await.unwrap();
    let row = row_named(&proxy, "SHOW DATABASES", DB).await;
    assert_eq!(
        (
            row["max_client_connections"].as_str(),
            row["current_client_connections"].as_str()
        ),
        ("2", "2")
    );
    drop(b);
    wait_until(
        "the gone client to be counted out",
        Duration::from_secs(10),
        || async {
            row_named(&proxy, "SHOW DATABASES", DB).await["current_client_connections"] == "1"
        },
    )
    .await;
    let c = client(&proxy, OTHER_USER, DB).await;
    c.batch_execute("SELECT 1").await.unwrap();
    proxy.shutdown().await;
}

/// max_user_client_connections = 1 in general and 2 for `plain_user`: counted across
/// databases, the client over its user's limit is refused with PgBouncer's FATAL 08P01; the
/// admin console does not count (the console user is at its limit and still gets in); SHOW
/// USERS shows each user's limit and count.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_user_client_connections_refuses_a_client_over_the_limit() {
    const DB: &str = "limits_user_clients";
    const OTHER_DB: &str = "limits_user_clients_other";
    fresh_db(DB).await;
    fresh_db(OTHER_DB).await;
    let mut cfg = two_users(2);
    cfg.general.max_user_client_connections = 1;
    cfg.users
        .get_mut(OTHER_USER)
        .unwrap()
        .max_user_client_connections = Some(2);
    let proxy = start_pgmemo(cfg).await;
    let over = (
        "08P01".to_owned(),
        "client connections exceeded (max_user_client_connections)".to_owned(),
    );
    let a = client(&proxy, PGMEMO_USER, DB).await;
    assert_eq!(refused(&proxy, PGMEMO_USER, OTHER_DB).await, over);
    let b1 = client(&proxy, OTHER_USER, DB).await;
    let b2 = client(&proxy, OTHER_USER, OTHER_DB).await;
    assert_eq!(refused(&proxy, OTHER_USER, DB).await, over);
    for c in [&a, &b1, &b2] {
        c.batch_execute("SELECT 1").await.unwrap();
    }
    // `admin` logs into the console as `pgmemo`, whose one client is in use.
    let mine = row_named(&proxy, "SHOW USERS", PGMEMO_USER).await;
    let other = row_named(&proxy, "SHOW USERS", OTHER_USER).await;
    let limits = |r: &HashMap<String, String>| {
        (
            r["max_user_client_connections"].clone(),
            r["current_client_connections"].clone(),
        )
    };
    assert_eq!(limits(&mine), ("1".to_owned(), "1".to_owned()));
    assert_eq!(limits(&other), ("2".to_owned(), "2".to_owned()));
    proxy.shutdown().await;
}

/// transaction_timeout = 2 s, in session and in transaction mode: a client whose
/// transaction runs a long query is closed with PgBouncer's FATAL 08P01 "transaction timeout"
/// (no query_timeout or idle_transaction_timeout is set), its transaction rolled back; a
/// client that ran a whole transaction and statements before, and has been idle outside one
/// since (holding its server, in session mode), is not closed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transaction_timeout_closes_a_client_in_a_long_transaction() {
    const DB: &str = "limits_tx_timeout";
    for mode in [PoolMode::Session, PoolMode::Transaction] {
        fresh_db(DB).await;
        let mut cfg = test_config(mode, 2);
        cfg.general.transaction_timeout = Duration::from_secs(2);
        let proxy = start_pgmemo(cfg).await;
        let (outside, outside_end) = client_and_end(&proxy, DB).await;
        outside
            .batch_execute("CREATE TABLE t (n int); BEGIN; SELECT 1; COMMIT")
            .await
            .unwrap();
        outside.batch_execute("SELECT 1").await.unwrap();
        let (inside, end) = client_and_end(&proxy, DB).await;
        inside
            .batch_execute("BEGIN; INSERT INTO t VALUES (1)")
            .await
            .unwrap();
        let e = tokio::time::timeout(
            Duration::from_secs(10),
            inside.batch_execute("SELECT pg_sleep(60)"),
        )
        .await
        .expect("transaction_timeout ends the transaction")
        .expect_err("with an error");
        let db = e
            .as_db_error()
            .unwrap_or_else(|| panic!("a FATAL, got {e:?}"));
        assert_eq!(
            (db.code().code(), db.message()),
            ("08P01", "transaction timeout"),
            "{mode:?}"
        );
        tokio::time::timeout(Duration::from_secs(10), end)
            .await
            .expect("the connection ends")
            .unwrap()
            .ok();
        assert!(
            !outside_end.is_finished(),
            "{mode:?}: the client outside a transaction stays"
        );
        assert_eq!(scalar(&outside, "SELECT count(*) FROM t").await, "0");
        drop(outside);
        proxy.shutdown().await;
    }
}

/// Each user's own timeouts in `[users.NAME]` override the general ones (none set here):
/// `plain_user` idle in a transaction, `tx_user` in a long transaction, `query_user` in a
/// long query and `idle_user` idle are each closed with PgBouncer's FATAL; `pgmemo`, without
/// timeouts, idle in a transaction all along, is not, and commits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_user_timeouts_override_the_general_ones() {
    const DB: &str = "limits_user_timeouts";
    fresh_db(DB).await;
    let mut cfg = two_users(2);
    let second = Some(Duration::from_secs(1));
    let user = |f: &dyn Fn(&mut UserConfig)| {
        let mut u = UserConfig {
            password: Some(OTHER_PASS.into()),
            ..UserConfig::default()
        };
        f(&mut u);
        u
    };
    cfg.users.insert(
        OTHER_USER.into(),
        user(&|u| u.idle_transaction_timeout = second),
    );
    cfg.users
        .insert("tx_user".into(), user(&|u| u.transaction_timeout = second));
    cfg.users
        .insert("query_user".into(), user(&|u| u.query_timeout = second));
    cfg.users.insert(
        "idle_user".into(),
        user(&|u| u.client_idle_timeout = second),
    );
    let proxy = start_pgmemo(cfg).await;
    let connect_as = |name: &'static str| {
        let url = proxy_url(proxy.local_addr(), name, Some(OTHER_PASS), DB);
        async move {
            let (client, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
                .await
                .unwrap();
            (client, tokio::spawn(conn))
        }
    };
    let (mine, mine_end) = client_and_end(&proxy, DB).await;
    mine.batch_execute("BEGIN; SELECT 1").await.unwrap();

    let (idle_tx, end) = connect_as(OTHER_USER).await;
    idle_tx.batch_execute("BEGIN; SELECT 1").await.unwrap();
    assert_eq!(
        fatal(end).await,
        ("08P01".to_owned(), "idle transaction timeout".to_owned())
    );
    let (idle, end) = connect_as("idle_user").await;
    idle.batch_execute("SELECT 1").await.unwrap();
    assert_eq!(
        fatal(end).await,
        ("08P01".to_owned(), "client_idle_timeout".to_owned())
    );
    for (name, sql, want) in [
        (
            "tx_user",
            "BEGIN; SELECT pg_sleep(60)",
            "transaction timeout",
        ),
        ("query_user", "SELECT pg_sleep(60)", "query timeout"),
    ] {
        let (c, _end) = connect_as(name).await;
        let e = tokio::time::timeout(Duration::from_secs(10), c.batch_execute(sql))
            .await
            .unwrap_or_else(|_| panic!("{name}'s timeout ends its query"))
            .expect_err("with an error");
        let db = e
            .as_db_error()
            .unwrap_or_else(|| panic!("a FATAL, got {e:?}"));
        assert_eq!((db.code().code(), db.message()), ("08P01", want), "{name}");
    }
    assert!(!mine_end.is_finished(), "pgmemo's client stays");
    mine.batch_execute("SELECT 1; COMMIT").await.unwrap();
    proxy.shutdown().await;
}

/// `query_wait_notify`: a client that has waited that long for a server is told so with
/// PgBouncer's NOTICE, once, and still gets its answer when a server comes (psql shows the
/// NOTICE on stderr while it waits).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_client_is_told_it_is_queued() {
    use tokio::io::{AsyncBufReadExt, BufReader};
    const DB: &str = "limits_notify";
    fresh_db(DB).await;
    let mut cfg = two_users(1);
    cfg.general.query_wait_notify = Duration::from_millis(200);
    let proxy = start_pgmemo(cfg).await;
    let psql = || {
        tokio::process::Command::new(cluster().bin_dir().join("psql"))
            .args(["-X", "-A", "-t", "-h", "127.0.0.1"])
            .args(["-p", &proxy.local_addr().port().to_string()])
            .args(["-U", PGMEMO_USER, "-d", DB, "-c", "SELECT 'served'"])
            .env("PGPASSWORD", PGMEMO_PASS)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("run psql")
    };
    // Once before: psql's parameters are then known, so its login needs no server (the
    // NOTICE is for a client that logged in and waits for its query's server, as PgBouncer's).
    assert!(psql().wait_with_output().await.unwrap().status.success());
    let holder = client(&proxy, PGMEMO_USER, DB).await;
    holder.batch_execute("BEGIN; SELECT 1").await.unwrap();

    let mut psql = psql();
    let mut stderr = BufReader::new(psql.stderr.take().unwrap()).lines();
    let line = tokio::time::timeout(Duration::from_secs(30), stderr.next_line())
        .await
        .expect("no NOTICE while the client waited")
        .unwrap()
        .expect("psql ended without a NOTICE");
    assert_eq!(
        line,
        "NOTICE:  No server connection available in postgres backend, client being queued"
    );
    // The holder's block ends; the waiting client is served, told once only.
    holder.batch_execute("COMMIT").await.unwrap();
    let out = psql.wait_with_output().await.unwrap();
    assert!(out.status.success());
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "served");
    assert_eq!(stderr.next_line().await.unwrap(), None);
}
