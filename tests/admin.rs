//! The admin console (database `pgmemo`), the Prometheus endpoint, and the `pgmemo` binary
//! itself: flags, `--check`, SIGHUP reload, SIGINT exit.

mod common;

use common::*;
use pgmemo::config::{PoolMode, UserConfig};
use pgmemo::Pgmemo;
use std::collections::HashMap;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_postgres::{Client, NoTls, SimpleQueryMessage};

type Rows = Vec<HashMap<String, Option<String>>>;

fn url(addr: std::net::SocketAddr, db: &str) -> String {
    proxy_url(addr, PGMEMO_USER, Some(PGMEMO_PASS), db)
}

async fn admin_client(proxy: &Pgmemo) -> Client {
    connect(&url(proxy.local_addr(), "pgmemo")).await
}

/// A console command's column names and rows.
async fn show(admin: &Client, cmd: &str) -> (Vec<String>, Rows) {
    let msgs = admin
        .simple_query(cmd)
        .await
        .unwrap_or_else(|e| panic!("{cmd}: {e}"));
    let mut columns = Vec::new();
    let mut rows = Vec::new();
    for m in &msgs {
        match m {
            SimpleQueryMessage::RowDescription(cols) => {
                columns = cols.iter().map(|c| c.name().to_owned()).collect();
            }
            SimpleQueryMessage::Row(r) => rows.push(
                r.columns()
                    .iter()
                    .enumerate()
                    .map(|(i, c)| (c.name().to_owned(), r.get(i).map(str::to_owned)))
                    .collect(),
            ),
            _ => {}
        }
    }
    (columns, rows)
}

fn val<'a>(row: &'a HashMap<String, Option<String>>, col: &str) -> &'a str {
    row.get(col)
        .unwrap_or_else(|| panic!("no column {col} in {row:?}"))
        .as_deref()
        .unwrap_or("")
}

fn num(row: &HashMap<String, Option<String>>, col: &str) -> u64 {
    val(row, col)
        .parse()
        .unwrap_or_else(|e| panic!("{col} = {:?}: {e}", val(row, col)))
}

fn row_for<'a>(rows: &'a Rows, db: &str) -> &'a HashMap<String, Option<String>> {
    rows.iter()
        .find(|r| val(r, "database") == db)
        .unwrap_or_else(|| panic!("no row for database {db} in {rows:?}"))
}

fn assert_columns(got: &[String], expected: &[&str], what: &str) {
    for c in expected {
        assert!(
            got.iter().any(|g| g == c),
            "{what}: no column {c:?} in {got:?}"
        );
    }
}

/// The pids of pgmemo's server connections to `db`, straight from the server.
async fn server_pids(db: &str) -> Vec<String> {
    let direct = connect(&cluster().url(SUPERUSER, Some(SUPERUSER_PASS), "postgres")).await;
    let msgs = direct
        .simple_query(&format!(
            "SELECT pid FROM pg_stat_activity WHERE datname = '{db}' AND usename = '{PGMEMO_USER}' \
             AND backend_type = 'client backend' ORDER BY pid"
        ))
        .await
        .unwrap();
    msgs.iter()
        .filter_map(|m| match m {
            SimpleQueryMessage::Row(r) => r.get(0).map(str::to_owned),
            _ => None,
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------

/// SHOW POOLS / CLIENTS / SERVERS / STATS / CONFIG / VERSION: PgBouncer's column names and
/// values that agree with what happened and with the server's own view.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn show_commands_report_what_happened() {
    const DB: &str = "admin_show";
    fresh_db(DB).await;
    let proxy = pgmemo(PoolMode::Transaction, 3).await;
    let app_url = format!(
        "{}?application_name=admin-test-app",
        url(proxy.local_addr(), DB)
    );
    let client = connect(&app_url).await;
    for i in 0..5 {
        client.simple_query(&format!("SELECT {i}")).await.unwrap();
        client
            .batch_execute(&format!("BEGIN; SELECT {i}; COMMIT"))
            .await
            .unwrap();
    }
    // Two servers in use at once, so the pool has more than one.
    let other = connect(&url(proxy.local_addr(), DB)).await;
    client.batch_execute("BEGIN; SELECT 1").await.unwrap();
    other.batch_execute("BEGIN; SELECT 1").await.unwrap();
    client.batch_execute("COMMIT").await.unwrap();
    other.batch_execute("COMMIT").await.unwrap();

    let admin = admin_client(&proxy).await;

    let (cols, rows) = show(&admin, "SHOW STATS").await;
    assert_columns(
        &cols,
        &[
            "database",
            "total_xact_count",
            "total_query_count",
            "total_received",
            "total_sent",
            "total_xact_time",
            "total_query_time",
            "total_wait_time",
            "avg_xact_count",
            "avg_query_count",
            "avg_recv",
            "avg_sent",
            "avg_xact_time",
            "avg_query_time",
            "avg_wait_time",
        ],
        "SHOW STATS",
    );
    let stats = row_for(&rows, DB);
    // 5 single queries, 5 one-message transactions, then BEGIN / COMMIT on two clients;
    // a query is one round trip (one ReadyForQuery), as in PgBouncer.
    assert_eq!(num(stats, "total_xact_count"), 12, "{stats:?}");
    assert_eq!(num(stats, "total_query_count"), 14, "{stats:?}");
    assert!(
        num(stats, "total_received") > 0 && num(stats, "total_sent") > 0,
        "{stats:?}"
    );
    assert!(num(stats, "total_xact_time") > 0, "{stats:?}");

    let (cols, rows) = show(&admin, "SHOW POOLS").await;
    assert_columns(
        &cols,
        &[
            "database",
            "user",
            "cl_active",
            "cl_waiting",
            "sv_active",
            "sv_idle",
            "sv_used",
            "sv_tested",
            "sv_login",
            "maxwait",
            "maxwait_us",
            "pool_mode",
        ],
        "SHOW POOLS",
    );
    let pool = row_for(&rows, DB);
    assert_eq!(val(pool, "user"), PGMEMO_USER);
    assert_eq!(val(pool, "pool_mode"), "transaction");
    assert_eq!(num(pool, "cl_active"), 2, "{pool:?}");
    assert_eq!(num(pool, "cl_waiting"), 0, "{pool:?}");
    let pids = server_pids(DB).await;
    assert_eq!(pids.len(), 2, "two server connections");
    assert_eq!(
        num(pool, "sv_idle") + num(pool, "sv_active") + num(pool, "sv_used"),
        pids.len() as u64,
        "{pool:?}"
    );
    assert_eq!(num(pool, "sv_active"), 0, "{pool:?}");

    let (cols, rows) = show(&admin, "SHOW SERVERS").await;
    let conn_columns = [
        "type",
        "user",
        "database",
        "state",
        "addr",
        "port",
        "local_addr",
        "local_port",
        "connect_time",
        "request_time",
        "wait",
        "wait_us",
        "close_needed",
        "ptr",
        "link",
        "remote_pid",
        "tls",
        "application_name",
    ];
    assert_columns(&cols, &conn_columns, "SHOW SERVERS");
    let mut listed: Vec<String> = rows
        .iter()
        .filter(|r| val(r, "database") == DB)
        .inspect(|r| {
            assert_eq!(val(r, "type"), "S");
            assert_eq!(val(r, "state"), "idle");
            assert_eq!(val(r, "port"), cluster().port().to_string());
        })
        .map(|r| val(r, "remote_pid").to_owned())
        .collect();
    listed.sort();
    let mut pids = pids;
    pids.sort();
    assert_eq!(
        listed, pids,
        "SHOW SERVERS remote_pid = the server's own pids"
    );

    let (cols, rows) = show(&admin, "SHOW CLIENTS").await;
    assert_columns(&cols, &conn_columns, "SHOW CLIENTS");
    let me = rows
        .iter()
        .find(|r| val(r, "application_name") == "admin-test-app")
        .unwrap_or_else(|| panic!("the client is not listed: {rows:?}"));
    assert_eq!(val(me, "type"), "C");
    assert_eq!(val(me, "database"), DB);
    assert_eq!(val(me, "user"), PGMEMO_USER);
    // PgBouncer 1.25 calls a logged-in client that holds no server and waits for none
    // "idle" ("active" when linked to a server).
    assert_eq!(val(me, "state"), "idle");
    assert_eq!(val(me, "addr"), "127.0.0.1");
    assert_eq!(val(me, "local_port"), proxy.local_addr().port().to_string());
    assert_eq!(rows.iter().filter(|r| val(r, "database") == DB).count(), 2);

    let (cols, rows) = show(&admin, "SHOW CONFIG").await;
    assert_eq!(cols, ["key", "value", "default", "changeable"]);
    let setting = |key: &str| {
        rows.iter()
            .find(|r| val(r, "key") == key)
            .unwrap_or_else(|| panic!("no {key} in SHOW CONFIG"))
            .clone()
    };
    assert_eq!(val(&setting("default_pool_size"), "value"), "3");
    assert_eq!(val(&setting("default_pool_size"), "default"), "20");
    assert_eq!(val(&setting("default_pool_size"), "changeable"), "yes");
    assert_eq!(val(&setting("pool_mode"), "value"), "transaction");

    let (cols, rows) = show(&admin, "SHOW VERSION").await;
    assert_eq!(cols, ["version"]);
    assert!(val(&rows[0], "version").starts_with("pgmemo "), "{rows:?}");

    // A bad command is an error, and the console stays usable.
    let err = admin
        .simple_query("SHOW NONSENSE")
        .await
        .expect_err("bad command");
    assert_eq!(err.code().map(|c| c.code()), Some("42601"));
    let (_, rows) = show(&admin, "show version;").await;
    assert_eq!(rows.len(), 1);
    proxy.shutdown().await;
}

/// Only admin_users get the console: others are refused with 28000 (but may use databases).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn console_refuses_non_admin_users() {
    let mut cfg = test_config(PoolMode::Transaction, 2);
    // plain_user is no PostgreSQL role: its database login is the fixed role pgmemo.
    log_in_as_pgmemo(&mut cfg);
    for (name, password) in [(PGMEMO_USER, PGMEMO_PASS), ("plain_user", "plain_pass")] {
        cfg.users.insert(
            name.into(),
            UserConfig {
                password: Some(password.into()),
                ..UserConfig::default()
            },
        );
    }
    let proxy = start_pgmemo(cfg).await;
    let addr = proxy.local_addr();
    let err = tokio_postgres::connect(
        &proxy_url(addr, "plain_user", Some("plain_pass"), "pgmemo"),
        NoTls,
    )
    .await
    .err()
    .expect("a non-admin user is refused");
    assert_eq!(err.code().map(|c| c.code()), Some("28000"), "{err:?}");
    // The same user may use a real database, and an admin may use the console.
    let plain = connect(&proxy_url(addr, "plain_user", Some("plain_pass"), TEST_DB)).await;
    assert_eq!(plain.simple_query("SELECT 1").await.unwrap().len(), 3);
    let admin = admin_client(&proxy).await;
    let (_, rows) = show(&admin, "SHOW VERSION").await;
    assert_eq!(rows.len(), 1);
    proxy.shutdown().await;
}

/// PAUSE waits for running transactions to end and then holds back every new query, also
/// those that were already queued, until RESUME.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pause_waits_for_transactions_and_blocks_until_resume() {
    const DB: &str = "admin_pause";
    fresh_db(DB).await;
    let proxy = pgmemo(PoolMode::Transaction, 1).await;
    let addr = proxy.local_addr();
    let holder = connect(&url(addr, DB)).await;
    let queued = connect(&url(addr, DB)).await;
    let later = connect(&url(addr, DB)).await;
    let admin = admin_client(&proxy).await;
    let observer = admin_client(&proxy).await;
    async fn waiting(observer: &Client) -> u64 {
        num(
            row_for(&show(observer, "SHOW POOLS").await.1, DB),
            "cl_waiting",
        )
    }

    holder
        .batch_execute("BEGIN; CREATE TABLE p (x int)")
        .await
        .unwrap();
    // A client queued for the only server before the PAUSE.
    let queued_task =
        tokio::spawn(async move { queued.simple_query("SELECT 'queued'").await.map(|_| ()) });
    wait_until("the queued client", Duration::from_secs(5), || async {
        waiting(&observer).await == 1
    })
    .await;

    let pause = tokio::spawn(async move {
        admin.simple_query("PAUSE").await.unwrap();
        admin
    });
    // The transaction goes on while PAUSE waits for it.
    holder
        .batch_execute("INSERT INTO p VALUES (1)")
        .await
        .unwrap();
    let pauses = holder.simple_query("SELECT pg_sleep(0.2)").await;
    assert!(pauses.is_ok());
    assert!(
        !pause.is_finished(),
        "PAUSE returned while a transaction was running"
    );
    holder.batch_execute("COMMIT").await.unwrap();
    let admin = tokio::time::timeout(Duration::from_secs(5), pause)
        .await
        .expect("PAUSE returns once the transaction ended")
        .unwrap();

    // Paused: neither the queued client nor a new query gets a server.
    let later_task =
        tokio::spawn(async move { later.simple_query("SELECT 'later'").await.map(|_| ()) });
    wait_until(
        "both clients waiting while paused",
        Duration::from_secs(5),
        || async { waiting(&observer).await == 2 },
    )
    .await;
    assert!(
        !queued_task.is_finished(),
        "a queued client got a server while paused"
    );
    assert!(
        !later_task.is_finished(),
        "a new query got a server while paused"
    );
    let (_, rows) = show(&observer, "SHOW SERVERS").await;
    assert!(rows
        .iter()
        .filter(|r| val(r, "database") == DB)
        .all(|r| val(r, "state") == "idle"));

    admin.simple_query("RESUME").await.unwrap();
    for t in [queued_task, later_task] {
        tokio::time::timeout(Duration::from_secs(5), t)
            .await
            .expect("served after RESUME")
            .unwrap()
            .expect("query after RESUME");
    }
    let n = holder.simple_query("SELECT count(*) FROM p").await.unwrap();
    assert!(matches!(&n[1], SimpleQueryMessage::Row(r) if r.get(0) == Some("1")));
    proxy.shutdown().await;
}

/// SHOW DATABASES / USERS / LISTS: PgBouncer's columns, counts that agree with SHOW CLIENTS,
/// SERVERS and POOLS, and a paused database shown as paused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn databases_users_and_lists_agree_with_clients_and_servers() {
    const DB: &str = "admin_lists";
    fresh_db(DB).await;
    let proxy = pgmemo(PoolMode::Transaction, 3).await;
    let addr = proxy.local_addr();
    let a = connect(&url(addr, DB)).await;
    let b = connect(&url(addr, DB)).await;
    // Two servers held at once.
    a.batch_execute("BEGIN; SELECT 1").await.unwrap();
    b.batch_execute("BEGIN; SELECT 1").await.unwrap();
    let admin = admin_client(&proxy).await;
    let (_, clients) = show(&admin, "SHOW CLIENTS").await;
    let (_, servers) = show(&admin, "SHOW SERVERS").await;
    let (_, pools) = show(&admin, "SHOW POOLS").await;
    let db_servers: Vec<_> = servers
        .iter()
        .filter(|r| val(r, "database") == DB)
        .collect();
    assert_eq!(db_servers.len(), 2, "{servers:?}");

    let (cols, databases) = show(&admin, "SHOW DATABASES").await;
    assert_eq!(
        cols,
        [
            "name",
            "host",
            "port",
            "database",
            "force_user",
            "pool_size",
            "min_pool_size",
            "reserve_pool_size",
            "server_lifetime",
            "pool_mode",
            "load_balance_hosts",
            "max_connections",
            "current_connections",
            "max_client_connections",
            "current_client_connections",
            "paused",
            "disabled",
            // pgmemo's own, after PgBouncer's.
            "replicas",
        ]
    );
    assert_eq!(
        val(
            databases.iter().find(|r| val(r, "name") == DB).unwrap(),
            "replicas"
        ),
        "",
        "no replicas configured"
    );
    let db = databases
        .iter()
        .find(|r| val(r, "name") == DB)
        .unwrap_or_else(|| panic!("no {DB} in {databases:?}"));
    assert_eq!(val(db, "database"), DB);
    assert_eq!(val(db, "port"), val(db_servers[0], "port"));
    assert_eq!(num(db, "pool_size"), 3);
    assert_eq!(num(db, "current_connections"), 2);
    assert_eq!(num(db, "current_client_connections"), 2);
    assert_eq!(
        num(db, "current_client_connections") as usize,
        clients.iter().filter(|r| val(r, "database") == DB).count()
    );
    assert_eq!(val(db, "paused"), "0");

    let (cols, users) = show(&admin, "SHOW USERS").await;
    assert_eq!(
        cols,
        [
            "name",
            "pool_size",
            "reserve_pool_size",
            "pool_mode",
            "max_user_connections",
            "current_connections",
            "max_user_client_connections",
            "current_client_connections",
        ]
    );
    let user = users
        .iter()
        .find(|r| val(r, "name") == PGMEMO_USER)
        .unwrap_or_else(|| panic!("no {PGMEMO_USER} in {users:?}"));
    assert_eq!(num(user, "current_connections"), 2);
    assert_eq!(
        num(user, "current_client_connections") as usize,
        clients
            .iter()
            .filter(|r| val(r, "user") == PGMEMO_USER)
            .count()
    );

    let (cols, lists) = show(&admin, "SHOW LISTS").await;
    assert_eq!(cols, ["list", "items"]);
    let item = |name: &str| {
        lists
            .iter()
            .find(|r| val(r, "list") == name)
            .map(|r| num(r, "items") as usize)
            .unwrap_or_else(|| panic!("no {name} in {lists:?}"))
    };
    assert_eq!(item("databases"), databases.len());
    assert_eq!(item("users"), users.len());
    assert_eq!(item("pools"), pools.len());
    assert_eq!(item("used_clients"), clients.len());
    assert_eq!(item("used_servers"), servers.len());
    assert_eq!(item("login_clients"), 0);

    a.batch_execute("COMMIT").await.unwrap();
    b.batch_execute("COMMIT").await.unwrap();
    admin.simple_query(&format!("PAUSE {DB}")).await.unwrap();
    assert_eq!(database_column(&admin, DB, "paused").await, "1");
    admin.simple_query(&format!("RESUME {DB}")).await.unwrap();
    assert_eq!(database_column(&admin, DB, "paused").await, "0");
    proxy.shutdown().await;
}

/// One column of SHOW DATABASES' row for `db`.
async fn database_column(admin: &Client, db: &str, column: &str) -> String {
    let (_, databases) = show(admin, "SHOW DATABASES").await;
    let row = databases
        .iter()
        .find(|r| val(r, "name") == db)
        .unwrap_or_else(|| panic!("no {db} in {databases:?}"));
    val(row, column).to_owned()
}

/// RECONNECT db: the idle server is closed at once, the one inside a transaction finishes the
/// transaction and is closed when released (WAIT_CLOSE returns then), and the next queries
/// get new servers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconnect_closes_servers_once_released() {
    const DB: &str = "admin_reconnect";
    fresh_db(DB).await;
    let proxy = pgmemo(PoolMode::Transaction, 3).await;
    let addr = proxy.local_addr();
    let busy = connect(&url(addr, DB)).await;
    let other = connect(&url(addr, DB)).await;
    async fn backend_pid(c: &Client) -> String {
        let msgs = c.simple_query("SELECT pg_backend_pid()").await.unwrap();
        msgs.iter()
            .find_map(|m| match m {
                SimpleQueryMessage::Row(r) => r.get(0).map(str::to_owned),
                _ => None,
            })
            .unwrap()
    }
    busy.batch_execute("BEGIN").await.unwrap();
    let busy_pid = backend_pid(&busy).await;
    // `other` runs on the second server, idle again once its query is done.
    let idle_pid = backend_pid(&other).await;
    assert_ne!(busy_pid, idle_pid);
    assert_eq!(server_pids(DB).await, sorted([&busy_pid, &idle_pid]));

    let admin = admin_client(&proxy).await;
    admin
        .simple_query(&format!("RECONNECT {DB}"))
        .await
        .unwrap();
    let (_, servers) = show(&admin, "SHOW SERVERS").await;
    let busy_row = servers
        .iter()
        .find(|r| val(r, "remote_pid") == busy_pid)
        .unwrap_or_else(|| panic!("no server {busy_pid} in {servers:?}"));
    assert_eq!(val(busy_row, "close_needed"), "1");
    // The idle server was told to terminate before RECONNECT answered; its backend exits
    // on reading that.
    wait_until(
        "the idle server closed by RECONNECT, the busy one kept",
        Duration::from_secs(5),
        || async { server_pids(DB).await == [busy_pid.clone()] },
    )
    .await;
    assert_eq!(
        backend_pid(&busy).await,
        busy_pid,
        "the transaction goes on on its server"
    );
    // WAIT_CLOSE waits for the server still inside the transaction.
    let waiter = admin_client(&proxy).await;
    let wait_close = tokio::spawn(async move {
        waiter
            .simple_query(&format!("WAIT_CLOSE {DB}"))
            .await
            .map(|_| ())
    });
    busy.simple_query("SELECT pg_sleep(0.1)").await.unwrap();
    assert!(
        !wait_close.is_finished(),
        "WAIT_CLOSE returned while a server open at RECONNECT was in use"
    );
    busy.batch_execute("COMMIT").await.unwrap();
    tokio::time::timeout(Duration::from_secs(5), wait_close)
        .await
        .expect("WAIT_CLOSE returns once the server is released and closed")
        .unwrap()
        .unwrap();
    wait_until(
        "the released server closed",
        Duration::from_secs(5),
        || async { !server_pids(DB).await.contains(&busy_pid) },
    )
    .await;
    for c in [&busy, &other] {
        let now = backend_pid(c).await;
        assert!(
            now != busy_pid && now != idle_pid,
            "a server open at RECONNECT was used again"
        );
    }
    proxy.shutdown().await;
}

fn sorted<'a>(pids: impl IntoIterator<Item = &'a String>) -> Vec<String> {
    let mut v: Vec<String> = pids.into_iter().cloned().collect();
    v.sort_by_key(|p| p.parse::<u32>().unwrap());
    v
}

/// The `id` (also `ptr`) of the one client with this application_name.
async fn client_id(admin: &Client, application_name: &str) -> String {
    let (_, clients) = show(admin, "SHOW CLIENTS").await;
    let mine: Vec<_> = clients
        .iter()
        .filter(|r| val(r, "application_name") == application_name)
        .collect();
    assert_eq!(mine.len(), 1, "{clients:?}");
    assert_eq!(val(mine[0], "id"), val(mine[0], "ptr"));
    val(mine[0], "id").to_owned()
}

/// KILL_CLIENT id: the client is told and disconnected, its open transaction rolled back, a
/// client waiting for a server stops waiting at once and runs nothing of what it sent, the
/// others go on; an unknown id is an error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_client_ends_one_client_and_rolls_back_its_work() {
    const DB: &str = "admin_kill_client";
    fresh_db(DB).await;
    let proxy = pgmemo(PoolMode::Transaction, 1).await;
    let addr = proxy.local_addr();
    let named = |name: &str| format!("{}?application_name={name}", url(addr, DB));
    let victim = connect(&named("victim")).await;
    let waiter = connect(&named("waiter")).await;
    let bystander = connect(&named("bystander")).await;
    let admin = admin_client(&proxy).await;
    bystander
        .batch_execute("CREATE TABLE k (who text)")
        .await
        .unwrap();

    // The victim holds the only server inside a transaction; the waiter queues behind it.
    victim
        .batch_execute("BEGIN; INSERT INTO k VALUES ('victim')")
        .await
        .unwrap();
    let waiter_id = client_id(&admin, "waiter").await;
    let waiting = tokio::spawn(async move {
        waiter
            .batch_execute("INSERT INTO k VALUES ('waiter')")
            .await
    });
    wait_until("the waiter queued", Duration::from_secs(5), || async {
        num(
            row_for(&show(&admin, "SHOW POOLS").await.1, DB),
            "cl_waiting",
        ) == 1
    })
    .await;
    admin
        .simple_query(&format!("KILL_CLIENT {waiter_id}"))
        .await
        .unwrap();
    // The waiter is gone at once, while the victim still holds the only server.
    let waited = tokio::time::timeout(Duration::from_secs(5), waiting)
        .await
        .expect("a killed waiter stops waiting")
        .unwrap();
    let err = waited.expect_err("a killed waiter's query");
    assert!(
        err.as_db_error()
            .is_some_and(|e| e.code().code() == "57P01"),
        "{err:?}"
    );
    let victim_id = client_id(&admin, "victim").await;
    admin
        .simple_query(&format!("KILL_CLIENT {victim_id}"))
        .await
        .unwrap();

    let err = victim
        .simple_query("SELECT 1")
        .await
        .expect_err("a killed client's query");
    assert!(
        err.as_db_error()
            .is_some_and(|e| e.code().code() == "57P01")
            || victim.is_closed(),
        "{err:?}"
    );
    let rows = bystander
        .simple_query("SELECT count(*) FROM k")
        .await
        .unwrap();
    assert!(
        matches!(&rows[1], SimpleQueryMessage::Row(r) if r.get(0) == Some("0")),
        "the victim's transaction rolled back and the waiter's insert never ran"
    );
    let (_, clients) = show(&admin, "SHOW CLIENTS").await;
    assert!(clients
        .iter()
        .all(|r| !matches!(val(r, "application_name"), "victim" | "waiter")));

    let err = admin
        .simple_query("KILL_CLIENT 999999999")
        .await
        .expect_err("an unknown client");
    assert_eq!(err.as_db_error().unwrap().message(), "client not found");
    proxy.shutdown().await;
}

/// KILL db: every client of the database is disconnected and its servers closed, a client
/// waiting in the paused database too; a new client waits (the database is paused) until
/// RESUME.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_disconnects_a_database_until_resume() {
    const DB: &str = "admin_kill";
    fresh_db(DB).await;
    let proxy = pgmemo(PoolMode::Transaction, 2).await;
    let addr = proxy.local_addr();
    let a = connect(&url(addr, DB)).await;
    let b = connect(&url(addr, DB)).await;
    a.batch_execute("BEGIN; SELECT 1").await.unwrap();
    b.batch_execute("SELECT 1").await.unwrap();
    let admin = admin_client(&proxy).await;
    admin.simple_query(&format!("KILL {DB}")).await.unwrap();
    for c in [&a, &b] {
        assert!(c.simple_query("SELECT 1").await.is_err());
    }
    wait_until("the servers closed", Duration::from_secs(5), || async {
        server_pids(DB).await.is_empty()
    })
    .await;

    let later = connect(&url(addr, DB)).await;
    let query = tokio::spawn(async move { later.simple_query("SELECT 1").await.map(|_| ()) });
    wait_until("the new client waiting", Duration::from_secs(5), || async {
        num(
            row_for(&show(&admin, "SHOW POOLS").await.1, DB),
            "cl_waiting",
        ) == 1
    })
    .await;
    assert!(!query.is_finished(), "a query ran while killed");
    // KILL again: the client waiting in the paused database is disconnected at once.
    admin.simple_query(&format!("KILL {DB}")).await.unwrap();
    let err = tokio::time::timeout(Duration::from_secs(5), query)
        .await
        .expect("a killed client stops waiting")
        .unwrap()
        .expect_err("a killed client's query");
    assert!(
        err.as_db_error()
            .is_some_and(|e| e.code().code() == "57P01"),
        "{err:?}"
    );
    let later = connect(&url(addr, DB)).await;
    let query = tokio::spawn(async move { later.simple_query("SELECT 1").await.map(|_| ()) });
    wait_until(
        "another new client waiting",
        Duration::from_secs(5),
        || async {
            num(
                row_for(&show(&admin, "SHOW POOLS").await.1, DB),
                "cl_waiting",
            ) == 1
        },
    )
    .await;
    admin.simple_query(&format!("RESUME {DB}")).await.unwrap();
    tokio::time::timeout(Duration::from_secs(5), query)
        .await
        .expect("served after RESUME")
        .unwrap()
        .expect("the query after RESUME");
    proxy.shutdown().await;
}

/// DISABLE db refuses new clients with PostgreSQL's own error for a database that does not
/// allow connections (compared with PostgreSQL's, for a database altered so), keeps the
/// connected ones, shows in SHOW DATABASES; ENABLE lets clients in again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disable_refuses_new_clients_as_postgresql_does() {
    const DB: &str = "admin_disable";
    const CLOSED: &str = "admin_disable_pg";
    fresh_db(DB).await;
    fresh_db(CLOSED).await;
    let superuser = connect(&cluster().url(SUPERUSER, Some(SUPERUSER_PASS), "postgres")).await;
    superuser
        .batch_execute(&format!("ALTER DATABASE {CLOSED} ALLOW_CONNECTIONS false"))
        .await
        .unwrap();
    let refusal = |e: tokio_postgres::Error, db: &str| {
        let e = e
            .as_db_error()
            .unwrap_or_else(|| panic!("{db}: {e:?}"))
            .clone();
        (
            e.severity().to_owned(),
            e.code().code().to_owned(),
            e.message().replace(db, "DB"),
        )
    };
    let direct = tokio_postgres::connect(
        &cluster().url(PGMEMO_USER, Some(PGMEMO_PASS), CLOSED),
        NoTls,
    )
    .await
    .map(|_| ())
    .expect_err("PostgreSQL refuses a database that does not allow connections");
    let expected = refusal(direct, CLOSED);

    let proxy = pgmemo(PoolMode::Transaction, 2).await;
    let addr = proxy.local_addr();
    let connected = connect(&url(addr, DB)).await;
    let admin = admin_client(&proxy).await;
    admin.simple_query(&format!("DISABLE {DB}")).await.unwrap();
    let refused = tokio_postgres::connect(&url(addr, DB), NoTls)
        .await
        .map(|_| ())
        .expect_err("a new client of a disabled database");
    assert_eq!(refusal(refused, DB), expected);
    connected
        .simple_query("SELECT 1")
        .await
        .expect("a connected client goes on");
    assert_eq!(database_column(&admin, DB, "disabled").await, "1");
    let err = admin
        .simple_query("DISABLE pgmemo")
        .await
        .expect_err("the console's own database");
    assert_eq!(
        err.as_db_error().unwrap().message(),
        "cannot disable admin db: pgmemo"
    );

    admin.simple_query(&format!("ENABLE {DB}")).await.unwrap();
    connect(&url(addr, DB))
        .await
        .simple_query("SELECT 1")
        .await
        .expect("a new client after ENABLE");
    assert_eq!(database_column(&admin, DB, "disabled").await, "0");
    superuser
        .batch_execute(&format!("ALTER DATABASE {CLOSED} ALLOW_CONNECTIONS true"))
        .await
        .unwrap();
    proxy.shutdown().await;
}

/// PAUSE pauses databases, not only the pools of the moment: a pool made while paused (the
/// first client of another database, or of the paused one) hands out no server until RESUME.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pause_holds_pools_made_while_paused() {
    const EVERY: &str = "admin_pause_all";
    const ONE: &str = "admin_pause_one";
    fresh_db(EVERY).await;
    fresh_db(ONE).await;
    let proxy = pgmemo(PoolMode::Transaction, 2).await;
    let addr = proxy.local_addr();
    let admin = admin_client(&proxy).await;
    let bystander = connect(&url(addr, "postgres")).await;

    // Connects and runs one query while paused: done only after RESUME.
    let held = |pause: String, db: &'static str, resume: String| {
        let admin = &admin;
        let bystander = &bystander;
        async move {
            admin.simple_query(&pause).await.unwrap();
            let task = tokio::spawn(async move {
                let c = connect(&url(addr, db)).await;
                c.simple_query("SELECT 1").await.map(|_| ())
            });
            wait_until("its pool made", Duration::from_secs(5), || async {
                show(admin, "SHOW POOLS")
                    .await
                    .1
                    .iter()
                    .any(|r| val(r, "database") == db)
            })
            .await;
            // Time for a query that was not held to finish.
            if db == ONE {
                bystander
                    .simple_query("SELECT pg_sleep(0.2)")
                    .await
                    .unwrap();
            } else {
                let direct =
                    connect(&cluster().url(PGMEMO_USER, Some(PGMEMO_PASS), "postgres")).await;
                direct.simple_query("SELECT pg_sleep(0.2)").await.unwrap();
            }
            assert!(!task.is_finished(), "{db}: a query ran while paused");
            admin.simple_query(&resume).await.unwrap();
            tokio::time::timeout(Duration::from_secs(5), task)
                .await
                .expect("served after RESUME")
                .unwrap()
                .expect("the query after RESUME");
        }
    };
    held("PAUSE".into(), EVERY, "RESUME".into()).await;
    held(format!("PAUSE {ONE}"), ONE, format!("RESUME {ONE}")).await;

    let state = |rows: Rows| {
        rows.iter()
            .map(|r| format!("{}={}", val(r, "key"), val(r, "value")))
            .collect::<Vec<_>>()
    };
    assert_eq!(
        state(show(&admin, "SHOW STATE").await.1),
        ["active=yes", "paused=no", "suspended=no"]
    );
    admin.simple_query("PAUSE").await.unwrap();
    assert_eq!(
        state(show(&admin, "SHOW STATE").await.1),
        ["active=no", "paused=yes", "suspended=no"]
    );
    let err = admin
        .simple_query(&format!("RESUME {ONE}"))
        .await
        .expect_err("RESUME db while everything is paused");
    assert_eq!(
        err.as_db_error().unwrap().message(),
        "pooler is paused, issue RESUME"
    );
    admin.simple_query("RESUME").await.unwrap();
    proxy.shutdown().await;
}

/// SHOW STATS' averages cover the last one or two stats periods, as PgBouncer's, not the
/// uptime: after a burst of transactions they fall back to 0 once periods pass without any,
/// while the totals stay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stats_averages_follow_the_stats_period() {
    const DB: &str = "admin_stats_period";
    fresh_db(DB).await;
    let mut cfg = test_config(PoolMode::Transaction, 2);
    cfg.general.stats_period = Duration::from_millis(200);
    let proxy = start_pgmemo(cfg).await;
    let client = connect(&url(proxy.local_addr(), DB)).await;
    for i in 0..20 {
        client.simple_query(&format!("SELECT {i}")).await.unwrap();
    }
    let admin = admin_client(&proxy).await;
    let stats = show(&admin, "SHOW STATS").await.1;
    let row = row_for(&stats, DB);
    assert!(num(row, "total_xact_count") >= 20, "{row:?}");
    assert!(num(row, "avg_xact_count") > 0, "{row:?}");
    assert!(num(row, "avg_xact_time") > 0, "{row:?}");
    wait_until(
        "the averages back to 0 after idle periods",
        Duration::from_secs(10),
        || async {
            let stats = show(&admin, "SHOW STATS").await.1;
            let row = row_for(&stats, DB);
            num(row, "avg_xact_count") == 0 && num(row, "avg_query_count") == 0
        },
    )
    .await;
    let stats = show(&admin, "SHOW STATS").await.1;
    assert!(num(row_for(&stats, DB), "total_xact_count") >= 20);
    proxy.shutdown().await;
}

/// SHUTDOWN from the console stops pgmemo: `Pgmemo::wait` returns, idle clients are told,
/// and nothing listens any more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_command_stops_pgmemo() {
    let proxy = pgmemo(PoolMode::Transaction, 2).await;
    let addr = proxy.local_addr();
    let client = connect(&url(addr, TEST_DB)).await;
    client.simple_query("SELECT 1").await.unwrap();
    let admin = admin_client(&proxy).await;
    admin.simple_query("SHUTDOWN").await.expect("SHUTDOWN");
    tokio::time::timeout(Duration::from_secs(10), proxy.wait())
        .await
        .expect("Pgmemo::wait returns after SHUTDOWN");
    wait_until(
        "the idle client to be disconnected",
        Duration::from_secs(5),
        || async { client.is_closed() },
    )
    .await;
    wait_until(
        "the console session to be closed",
        Duration::from_secs(5),
        || async { admin.is_closed() },
    )
    .await;
    assert!(
        tokio::net::TcpStream::connect(addr).await.is_err(),
        "pgmemo still accepts connections after SHUTDOWN"
    );
}

async fn http_get(addr: std::net::SocketAddr, path: &str) -> (String, String) {
    let mut sock = tokio::net::TcpStream::connect(addr).await.unwrap();
    sock.write_all(format!("GET {path} HTTP/1.1\r\nHost: test\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut out = String::new();
    tokio::time::timeout(Duration::from_secs(5), sock.read_to_string(&mut out))
        .await
        .expect("the metrics endpoint answers and closes")
        .unwrap();
    let (head, body) = out.split_once("\r\n\r\n").expect("an HTTP response");
    (head.to_owned(), body.to_owned())
}

/// The value of one sample line, `name{labels} value`.
fn sample(body: &str, name: &str, labels: &str) -> f64 {
    let prefix = format!("{name}{{{labels}}} ");
    body.lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .unwrap_or_else(|| panic!("no sample {prefix} in\n{body}"))
        .trim()
        .parse()
        .unwrap()
}

/// The Prometheus endpoint's counters are the same numbers as SHOW STATS and SHOW POOLS,
/// wait timeouts included, and a client that gave up waiting is not counted as waiting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_match_show_stats() {
    const DB: &str = "admin_metrics";
    fresh_db(DB).await;
    let mut cfg = test_config(PoolMode::Transaction, 1);
    cfg.general.metrics_listen = Some("127.0.0.1:0".into());
    // Long enough for the pool's first connection to a fresh database, whose login's wait
    // it also bounds (300 ms once ran out on the loaded 2-core VM: "could not connect").
    cfg.general.query_wait_timeout = Duration::from_secs(2);
    let proxy = start_pgmemo(cfg).await;
    let metrics = proxy.metrics_addr().expect("metrics endpoint");
    let client = connect(&url(proxy.local_addr(), DB)).await;
    for i in 0..7 {
        client
            .batch_execute(&format!("SELECT {i}; SELECT 2"))
            .await
            .unwrap();
    }
    // One client gives up waiting (query_wait_timeout) while another holds the server.
    let impatient = connect(&url(proxy.local_addr(), DB)).await;
    client.batch_execute("BEGIN").await.unwrap();
    impatient
        .simple_query("SELECT 1")
        .await
        .expect_err("query_wait_timeout");
    // The client that gave up is not counted as waiting any more, even before the server
    // comes back.
    let (_, body) = http_get(metrics, "/metrics").await;
    let labels = format!("database=\"{DB}\",user=\"{PGMEMO_USER}\"");
    assert_eq!(
        sample(&body, "pgmemo_clients_waiting", &labels),
        0.0,
        "{body}"
    );
    assert_eq!(sample(&body, "pgmemo_wait_timeouts_total", &labels), 1.0);
    assert_eq!(
        sample(
            &body,
            "pgmemo_servers",
            &format!("{labels},state=\"active\"")
        ),
        1.0
    );
    client.batch_execute("COMMIT").await.unwrap();

    let admin = admin_client(&proxy).await;
    let (_, stats) = show(&admin, "SHOW STATS").await;
    let (_, pools) = show(&admin, "SHOW POOLS").await;
    let (head, body) = http_get(metrics, "/metrics").await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(
        head.to_ascii_lowercase()
            .contains("content-type: text/plain"),
        "{head}"
    );
    let stats = row_for(&stats, DB);
    let pool = row_for(&pools, DB);
    for (metric, column) in [
        ("pgmemo_transactions_total", "total_xact_count"),
        ("pgmemo_queries_total", "total_query_count"),
        ("pgmemo_received_bytes_total", "total_received"),
        ("pgmemo_sent_bytes_total", "total_sent"),
    ] {
        assert_eq!(
            sample(&body, metric, &labels),
            num(stats, column) as f64,
            "{metric} vs {column}"
        );
    }
    // 7 queries of two statements each, then BEGIN and COMMIT.
    assert_eq!(num(stats, "total_xact_count"), 8);
    assert_eq!(num(stats, "total_query_count"), 9);
    let wait = sample(&body, "pgmemo_wait_seconds_total", &labels);
    assert!(
        (wait - num(stats, "total_wait_time") as f64 / 1e6).abs() < 1e-3,
        "{wait}"
    );
    assert_eq!(sample(&body, "pgmemo_wait_timeouts_total", &labels), 1.0);
    for state in ["idle", "active", "used", "tested", "login"] {
        assert_eq!(
            sample(
                &body,
                "pgmemo_servers",
                &format!("{labels},state=\"{state}\"")
            ),
            num(pool, &format!("sv_{state}")) as f64,
            "servers {state}"
        );
    }
    assert_eq!(
        sample(&body, "pgmemo_servers", &format!("{labels},state=\"idle\"")),
        1.0
    );
    assert_eq!(
        sample(&body, "pgmemo_clients_waiting", &labels),
        0.0,
        "the impatient client left"
    );
    assert_eq!(num(pool, "cl_waiting"), 0);

    // Histograms: one observation per transaction (and per checkout), cumulative buckets
    // ending in +Inf = _count, and the transaction time summed as SHOW STATS sums it.
    let les = [
        "0.0001", "0.00025", "0.0005", "0.001", "0.0025", "0.005", "0.01", "0.025", "0.05", "0.1",
        "0.25", "1", "2.5", "10", "+Inf",
    ];
    for name in [
        "pgmemo_transaction_duration_seconds",
        "pgmemo_client_wait_seconds",
    ] {
        let buckets: Vec<f64> = les
            .iter()
            .map(|le| {
                sample(
                    &body,
                    &format!("{name}_bucket"),
                    &format!("{labels},le=\"{le}\""),
                )
            })
            .collect();
        assert!(
            buckets.windows(2).all(|w| w[0] <= w[1]),
            "{name}: {buckets:?}"
        );
        let count = sample(&body, &format!("{name}_count"), &labels);
        assert_eq!(buckets[buckets.len() - 1], count, "{name}");
    }
    let xacts = num(stats, "total_xact_count") as f64;
    assert_eq!(
        sample(&body, "pgmemo_transaction_duration_seconds_count", &labels),
        xacts
    );
    let held = sample(&body, "pgmemo_transaction_duration_seconds_sum", &labels);
    assert!(
        (held - num(stats, "total_xact_time") as f64 / 1e6).abs() < 1e-3,
        "{held}"
    );
    // Every transaction checked a server out (the login's checkout may add one); the one
    // that timed out is not an observation.
    let checkouts = sample(&body, "pgmemo_client_wait_seconds_count", &labels);
    assert!(
        (xacts..=xacts + 1.0).contains(&checkouts),
        "{checkouts} checkouts for {xacts} transactions"
    );

    let (head, _) = http_get(metrics, "/nope").await;
    assert!(head.starts_with("HTTP/1.1 404"), "{head}");
    proxy.shutdown().await;
}

// ---------------------------------------------------------------------------------------------
// The binary
// ---------------------------------------------------------------------------------------------

const BIN: &str = env!("CARGO_BIN_EXE_pgmemo");

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("pgmemo-admin-test-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn upstream_url() -> String {
    format!(
        "postgresql://{PGMEMO_USER}:{PGMEMO_PASS}@127.0.0.1:{}",
        cluster().port()
    )
}

async fn run(args: &[&str]) -> std::process::Output {
    tokio::process::Command::new(BIN)
        .args(args)
        .env_remove("PGMEMO_CONFIG")
        .env_remove("PGMEMO_UPSTREAM")
        .output()
        .await
        .expect("run pgmemo")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn help_mentions_every_flag() {
    let out = run(&["--help"]).await;
    assert!(out.status.success());
    let help = String::from_utf8_lossy(&out.stdout);
    for flag in [
        "--config",
        "--upstream",
        "--listen",
        "--pool-mode",
        "--pool-size",
        "--auth",
        "--admin-user",
        "--metrics-listen",
        "--log-level",
        "--log-format",
        "--check",
        "--help",
        "--version",
    ] {
        assert!(
            help.contains(flag),
            "--help does not mention {flag}:\n{help}"
        );
    }
    for value in ["session", "transaction", "trust", "md5", "scram-sha-256"] {
        assert!(help.contains(value), "--help does not mention {value}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn config_errors_name_the_key_and_fail() {
    let dir = temp_dir("invalid");
    for (text, key) in [
        ("[general]\ndefault_pool_size = 0\n", "default_pool_size"),
        ("[general]\npool_mode = \"sometimes\"\n", "pool_mode"),
        ("[general]\npool_sise = 3\n", "pool_sise"),
        ("[general]\nquery_wait_timeout = -1\n", "query_wait_timeout"),
    ] {
        let file = dir.join("bad.toml");
        std::fs::write(&file, text).unwrap();
        for extra in [&["--check"][..], &[][..]] {
            let mut args = vec![
                "--config",
                file.to_str().unwrap(),
                "--upstream",
                "postgresql://u:p@127.0.0.1:1",
            ];
            args.extend_from_slice(extra);
            let out = run(&args).await;
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert!(!out.status.success(), "{text:?} {extra:?} was accepted");
            assert!(
                stderr.contains(key),
                "{text:?}: the error does not name {key}: {stderr}"
            );
        }
    }
    // A flag value is checked too.
    let out = run(&[
        "--upstream",
        "postgresql://u:p@127.0.0.1:1",
        "--pool-size",
        "0",
        "--check",
    ])
    .await;
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("pool-size"));
    let _ = std::fs::remove_dir_all(&dir);
}

/// The real binary with `--config` and `--upstream`: `--check` accepts it; it serves
/// queries; SIGHUP re-reads the file (visible in SHOW CONFIG); SIGINT exits 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn binary_checks_reloads_on_sighup_and_exits_on_sigint() {
    let dir = temp_dir("binary");
    let port = free_port();
    let file = dir.join("pgmemo.toml");
    let config = |pool_size: u32| {
        format!(
            "[general]\nlisten = \"127.0.0.1:{port}\"\nadmin_users = [\"{PGMEMO_USER}\"]\n\
             default_pool_size = {pool_size}\nquery_wait_timeout = 10\nstats_period = 1\n"
        )
    };
    std::fs::write(&file, config(3)).unwrap();
    let upstream = upstream_url();
    let file_arg = file.to_str().unwrap();

    let out = run(&["--config", file_arg, "--upstream", &upstream, "--check"]).await;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("configuration OK"));
    let out = run(&["--upstream", &upstream, "--pool-mode", "session", "--check"]).await;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Valid, but the cache would never answer: said, naming the setting that changes it.
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("warning: autoprepare does not apply to session-mode pools")
            && stderr.contains("session_shared_statements"),
        "{stderr}"
    );
    let out = run(&["--upstream", &upstream, "--cache", "--check"]).await;
    assert!(!String::from_utf8_lossy(&out.stderr).contains("warning"));

    let log_path = dir.join("pgmemo.log");
    let log = std::fs::File::create(&log_path).unwrap();
    let mut child = tokio::process::Command::new(BIN)
        .args(["--config", file_arg, "--upstream", &upstream])
        .env_remove("PGMEMO_CONFIG")
        .env_remove("PGMEMO_UPSTREAM")
        .stdout(Stdio::null())
        .stderr(log)
        .kill_on_drop(true)
        .spawn()
        .expect("start pgmemo");
    let pid = child.id().expect("pid") as libc::pid_t;
    let addr: std::net::SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let log_text = || std::fs::read_to_string(&log_path).unwrap_or_default();

    let deadline = Instant::now() + Duration::from_secs(15);
    let admin = loop {
        match tokio_postgres::connect(&url(addr, "pgmemo"), NoTls).await {
            Ok((c, conn)) => {
                tokio::spawn(conn);
                break c;
            }
            Err(e) => {
                assert!(
                    Instant::now() < deadline,
                    "pgmemo did not start: {e}\n{}",
                    log_text()
                );
                assert!(
                    child.try_wait().unwrap().is_none(),
                    "pgmemo exited:\n{}",
                    log_text()
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    };
    async fn pool_size(admin: &Client) -> String {
        let (_, rows) = show(admin, "SHOW CONFIG").await;
        val(
            rows.iter()
                .find(|r| val(r, "key") == "default_pool_size")
                .unwrap(),
            "value",
        )
        .to_owned()
    }
    assert_eq!(pool_size(&admin).await, "3");
    let client = connect(&url(addr, TEST_DB)).await;
    let rows = client
        .simple_query("SELECT 'through the binary'")
        .await
        .unwrap();
    assert!(
        matches!(&rows[1], SimpleQueryMessage::Row(r) if r.get(0) == Some("through the binary"))
    );

    // log_connections and log_disconnections, on by default as in PgBouncer.
    let short = connect(&url(addr, TEST_DB)).await;
    short.simple_query("SELECT 1").await.unwrap();
    drop(short);
    wait_until(
        "the client's end to be logged",
        Duration::from_secs(10),
        || async { log_text().contains("closing because: client close request (age=") },
    )
    .await;
    assert!(
        log_text().contains(&format!("login: db={TEST_DB} user={PGMEMO_USER} tls=no")),
        "{}",
        log_text()
    );
    // log_stats, on by default as in PgBouncer: a line per stats_period (1 s here), which
    // counts these transactions (PgBouncer's whole numbers per second).
    for _ in 0..50 {
        client.simple_query("SELECT 1").await.unwrap();
    }
    wait_until(
        "a stats line with transactions",
        Duration::from_secs(10),
        || async {
            log_text().lines().any(|l| {
                l.split("stats: ")
                    .nth(1)
                    .and_then(|s| s.split(' ').next())
                    .is_some_and(|n| n.parse::<u64>().is_ok_and(|n| n > 0))
                    && l.contains("queries/s")
                    && l.contains("wait ")
            })
        },
    )
    .await;

    std::fs::write(&file, config(6)).unwrap();
    // SAFETY: kill(2) on our own child's pid.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGHUP) }, 0);
    wait_until(
        "SIGHUP to reload the file",
        Duration::from_secs(10),
        || async { pool_size(&admin).await == "6" },
    )
    .await;
    // The client connected before the reload is still served.
    assert!(
        client.simple_query("SELECT 1").await.is_ok(),
        "{}",
        log_text()
    );

    // SIGINT, the safe shutdown (the service unit's KillSignal): idle clients are closed.
    // SIGTERM would wait for them to leave (tests/online_restart.rs).
    // SAFETY: as above.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGINT) }, 0);
    let status = tokio::time::timeout(Duration::from_secs(15), child.wait())
        .await
        .unwrap_or_else(|_| panic!("pgmemo did not exit after SIGINT:\n{}", log_text()))
        .unwrap();
    assert!(
        status.success(),
        "exit status {status} after SIGINT:\n{}",
        log_text()
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A graceful shutdown stops accepting at once but lets a running transaction finish; its
/// client is disconnected when it ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_lets_running_transactions_finish() {
    const DB: &str = "admin_graceful";
    fresh_db(DB).await;
    let proxy = pgmemo(PoolMode::Transaction, 2).await;
    let addr = proxy.local_addr();
    let client = connect(&url(addr, DB)).await;
    client
        .batch_execute("CREATE TABLE g (x int); BEGIN; INSERT INTO g VALUES (1)")
        .await
        .unwrap();
    let shutdown = tokio::spawn(proxy.shutdown());
    wait_until(
        "pgmemo to stop accepting",
        Duration::from_secs(5),
        || async { tokio::net::TcpStream::connect(addr).await.is_err() },
    )
    .await;
    client
        .batch_execute("INSERT INTO g VALUES (2)")
        .await
        .expect("the transaction goes on");
    client.batch_execute("COMMIT").await.expect("and commits");
    tokio::time::timeout(Duration::from_secs(5), shutdown)
        .await
        .expect("shutdown completes once the transaction ended")
        .unwrap();
    wait_until(
        "the client to be disconnected",
        Duration::from_secs(5),
        || async { client.is_closed() },
    )
    .await;
    let count = tokio::task::spawn_blocking(|| cluster().psql(DB, "SELECT count(*) FROM g"))
        .await
        .unwrap();
    assert_eq!(count.trim(), "2");
}

/// A transaction still open after shutdown_timeout is cut off: the shutdown completes, the
/// client is disconnected and its transaction rolled back on the server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_timeout_cuts_off_long_transactions() {
    const DB: &str = "admin_cutoff";
    fresh_db(DB).await;
    let mut cfg = test_config(PoolMode::Transaction, 2);
    cfg.general.shutdown_timeout = Duration::from_millis(500);
    let proxy = start_pgmemo(cfg).await;
    let client = connect(&url(proxy.local_addr(), DB)).await;
    client
        .batch_execute("CREATE TABLE c (x int)")
        .await
        .unwrap();
    client
        .batch_execute("BEGIN; INSERT INTO c VALUES (1)")
        .await
        .unwrap();
    let started = Instant::now();
    tokio::time::timeout(Duration::from_secs(5), proxy.shutdown())
        .await
        .expect("shutdown completes after shutdown_timeout");
    assert!(started.elapsed() >= Duration::from_millis(450));
    wait_until(
        "the lingering client to be disconnected",
        Duration::from_secs(5),
        || async { client.is_closed() },
    )
    .await;
    wait_until("its server to be gone", Duration::from_secs(5), || async {
        server_pids(DB).await.is_empty()
    })
    .await;
    let count = tokio::task::spawn_blocking(|| cluster().psql(DB, "SELECT count(*) FROM c"))
        .await
        .unwrap();
    assert_eq!(
        count.trim(),
        "0",
        "the unfinished transaction was rolled back"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prepared_statements_are_visible_in_the_console() {
    fresh_db("admin_prepared").await;
    let proxy = pgmemo(PoolMode::Transaction, 1).await;
    let admin = admin_client(&proxy).await;
    let client = connect(&url(proxy.local_addr(), "admin_prepared")).await;
    let stmt = client
        .prepare_typed(
            "SELECT $1::int + 1 AS admin_prepared_probe",
            &[tokio_postgres::types::Type::INT4],
        )
        .await
        .unwrap();
    for i in 0..5 {
        let row = client.query_one(&stmt, &[&i]).await.unwrap();
        assert_eq!(row.get::<_, i32>(0), i + 1);
    }
    let (columns, rows) = show(&admin, "SHOW PREPARED_STATEMENTS").await;
    assert_columns(
        &columns,
        &[
            "hash",
            "name",
            "query",
            "parameter_types",
            "clients",
            "servers",
            "parse_hits",
            "server_prepares",
            "evictions",
        ],
        "SHOW PREPARED_STATEMENTS",
    );
    let probe = rows
        .iter()
        .find(|r| val(r, "query").contains("admin_prepared_probe"))
        .unwrap_or_else(|| panic!("statement not listed: {rows:?}"));
    assert_eq!(val(probe, "parameter_types"), "23");
    assert_eq!(num(probe, "clients"), 1);
    assert_eq!(num(probe, "servers"), 1);
    assert_eq!(
        num(probe, "server_prepares"),
        1,
        "parsed once on the one server"
    );
    assert!(val(probe, "name").starts_with("pgmemo_s"));

    let (_, stats) = show(&admin, "SHOW STATS").await;
    let db = row_for(&stats, "admin_prepared");
    assert!(num(db, "prepare_cache_hit") >= 5, "{db:?}");
    assert!(num(db, "prepare_cache_miss") >= 1, "{db:?}");
    let (_, servers) = show(&admin, "SHOW SERVERS").await;
    let server = row_for(&servers, "admin_prepared");
    assert!(num(server, "prepared_statements") >= 1, "{server:?}");
    assert!(num(server, "prepare_cache_hit") >= 5, "{server:?}");

    drop(client);
    proxy.shutdown().await;
}

/// Logs written to a pipe (a file, journald) carry no ANSI colour codes; `--log-format json`
/// writes one JSON object per line.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn log_lines_are_plain_off_a_terminal_or_json() {
    use tokio::io::AsyncBufReadExt;
    for format in ["text", "json"] {
        let upstream = upstream_url();
        let mut child = tokio::process::Command::new(BIN)
            .args([
                "--upstream",
                &upstream,
                "--listen",
                "127.0.0.1:0",
                "--log-level",
                "info",
                "--log-format",
                format,
            ])
            .env_remove("PGMEMO_CONFIG")
            .env_remove("PGMEMO_LOG")
            .stderr(std::process::Stdio::piped())
            .stdout(std::process::Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("run pgmemo");
        let mut lines = tokio::io::BufReader::new(child.stderr.take().unwrap()).lines();
        let mut seen = Vec::new();
        let listening = tokio::time::timeout(Duration::from_secs(30), async {
            while let Some(line) = lines.next_line().await.unwrap() {
                let done = line.contains("pgmemo listening");
                seen.push(line);
                if done {
                    return;
                }
            }
        })
        .await;
        assert!(listening.is_ok(), "{format}: no listening line in {seen:?}");
        for line in &seen {
            assert!(
                !line.contains('\u{1b}'),
                "{format}: colour codes in {line:?}"
            );
            if format == "json" {
                let v: serde_json::Value = serde_json::from_str(line)
                    .unwrap_or_else(|e| panic!("not JSON ({e}): {line:?}"));
                assert!(
                    v["level"].is_string() && v["timestamp"].is_string(),
                    "{line}"
                );
                assert!(v["fields"]["message"].is_string(), "{line}");
            } else {
                assert!(line.contains("INFO"), "{line}");
                assert!(serde_json::from_str::<serde_json::Value>(line).is_err());
            }
        }
        child.kill().await.unwrap();
    }
}

/// SHOW QUERIES says which queries are worth caching: per shape, its calls and time on the
/// server (the slowest first), the tables it reads, whether the cache may keep it and why
/// not, what chose it, the cache's hits and misses; the Prometheus endpoint exports the same
/// figures by `query_hash`, the hash SHOW AUTOPREPARE prints.
#[tokio::test]
async fn show_queries_says_what_is_worth_caching() {
    const DB: &str = "admin_queries";
    fresh_db(DB).await;
    tokio::task::spawn_blocking(|| {
        cluster().psql(
            DB,
            "CREATE TABLE q_kv (id int PRIMARY KEY, v int); INSERT INTO q_kv VALUES (1, 1), (2, 2);",
        )
    })
    .await
    .unwrap();
    let mut cfg = test_config(PoolMode::Transaction, 2);
    cfg.general.metrics_listen = Some("127.0.0.1:0".into());
    cfg.cache.enabled = true;
    cfg.cache.admit_after = 1;
    cfg.cache.rules = vec![cache_rule("kv", "FROM q_kv")];
    let proxy = start_pgmemo(cfg).await;
    let client = connect(&url(proxy.local_addr(), DB)).await;
    let slow = "SELECT pg_sleep(0.02), v FROM q_kv WHERE id = 1";
    for sql in [slow, slow] {
        client.simple_query(sql).await.unwrap();
    }
    for i in 0..10 {
        let sql = format!("SELECT v FROM q_kv WHERE id = {}", 1 + i % 2);
        client.simple_query(&sql).await.unwrap();
    }
    client
        .simple_query("UPDATE q_kv SET v = v WHERE id = 3")
        .await
        .unwrap();
    let admin = admin_client(&proxy).await;
    let (columns, rows) = show(&admin, "SHOW QUERIES").await;
    assert_columns(
        &columns,
        &[
            "query_hash",
            "query",
            "calls",
            "total_server_ms",
            "mean_server_us",
            "rows",
            "tables",
            "cacheable",
            "chosen_by",
            "last_bypass",
            "cache_hits",
            "cache_misses",
            "hit_ratio",
            "autoprepared",
            "autoprepare_never",
        ],
        "SHOW QUERIES",
    );
    let find = |text: &str| {
        rows.iter()
            .find(|r| val(r, "query") == text)
            .unwrap_or_else(|| panic!("no row for {text} in {rows:?}"))
            .clone()
    };
    // The slow one first: measured on the server (a shape's first query is timed).
    let first = &rows[0];
    assert_eq!(
        val(first, "query"),
        "SELECT pg_sleep($1), v FROM q_kv WHERE id = $2"
    );
    assert_eq!(num(first, "calls"), 2);
    let mean: f64 = val(first, "mean_server_us").parse().unwrap();
    assert!(mean >= 20_000.0, "mean {mean}");
    // One row per call, whichever calls were timed.
    assert_eq!(num(first, "rows"), 2);
    assert_eq!(val(first, "chosen_by"), "kv");
    assert_eq!(val(first, "last_bypass"), "time or session function");
    let kv = find("SELECT v FROM q_kv WHERE id = $1");
    assert_eq!(num(&kv, "calls"), 10);
    assert_eq!(val(&kv, "tables"), "q_kv");
    assert_eq!(val(&kv, "cacheable"), "yes");
    assert_eq!(val(&kv, "chosen_by"), "kv");
    assert_eq!((num(&kv, "cache_hits"), num(&kv, "cache_misses")), (8, 2));
    assert_eq!(val(&kv, "hit_ratio"), "0.800");
    let update = find("UPDATE q_kv SET v = v WHERE id = $1");
    assert_ne!(val(&update, "cacheable"), "yes");
    // The hash is SHOW AUTOPREPARE's, and the endpoint's label.
    let (_, shapes) = show(&admin, "SHOW AUTOPREPARE").await;
    let hash = val(&kv, "query_hash").to_owned();
    assert!(shapes
        .iter()
        .any(|s| val(s, "hash") == hash && val(s, "query") == val(&kv, "query")));
    let (_, body) = http_get(proxy.metrics_addr().unwrap(), "/metrics").await;
    let labels = format!("query_hash=\"{hash}\"");
    assert_eq!(sample(&body, "pgmemo_query_calls_total", &labels), 10.0);
    assert_eq!(sample(&body, "pgmemo_query_cache_hits_total", &labels), 8.0);
    assert_eq!(sample(&body, "pgmemo_query_rows_total", &labels), 10.0);
}

/// SHOW QUERIES counts the rows of an Execute with a row limit that left its portal suspended
/// (asyncpg's `fetchrow` and `fetchval` send such a limit): no CommandComplete tag counts them.
#[tokio::test]
async fn show_queries_counts_the_rows_of_a_suspended_portal() {
    const DB: &str = "admin_queries_limit";
    const READ: &str = "SELECT v FROM q_limit WHERE id <= $1 ORDER BY id";
    fresh_db(DB).await;
    tokio::task::spawn_blocking(|| {
        cluster().psql(
            DB,
            "CREATE TABLE q_limit (id int PRIMARY KEY, v int); \
             INSERT INTO q_limit VALUES (1, 1), (2, 2), (3, 3);",
        )
    })
    .await
    .unwrap();
    let proxy = start_pgmemo(test_config(PoolMode::Transaction, 2)).await;
    let mut client =
        RawClient::connect(proxy.local_addr(), PGMEMO_USER, DB, Some(PGMEMO_PASS), &[])
            .await
            .expect("login");
    for _ in 0..4 {
        // As asyncpg sends a fetch of at most two rows: one batch.
        let batch = [
            Frontend::parse("", READ, &[]),
            Frontend::bind("", "", &[Some("3")]),
            Frontend::execute("", 2),
            Frontend::Sync,
        ];
        client.send(&batch).await.unwrap();
        let names: Vec<_> = client
            .recv_until_ready(1)
            .await
            .unwrap()
            .iter()
            .map(|m| m.name())
            .collect();
        assert_eq!(
            names,
            [
                "ParseComplete",
                "BindComplete",
                "DataRow",
                "DataRow",
                "PortalSuspended",
                "ReadyForQuery"
            ]
        );
    }
    let admin = admin_client(&proxy).await;
    let (_, rows) = show(&admin, "SHOW QUERIES").await;
    let row = rows
        .iter()
        .find(|r| val(r, "query") == READ)
        .unwrap_or_else(|| panic!("no row for {READ} in {rows:?}"));
    assert_eq!(num(row, "calls"), 4, "{row:?}");
    assert_eq!(num(row, "rows"), 8, "two rows a call: {row:?}");
    proxy.shutdown().await;
}

/// SHOW QUERIES covers prepared statements (tokio-postgres' named statements): their calls,
/// their time on the server, the tables they read and whether the cache may keep them. A
/// statement `... WHERE id = $1` and the simple query `... WHERE id = 2` are one query: one
/// row, one `query_hash` (SHOW AUTOPREPARE's and the endpoint's), their calls added up.
#[tokio::test]
async fn show_queries_counts_prepared_statements_with_their_simple_twins() {
    const DB: &str = "admin_queries_ext";
    fresh_db(DB).await;
    tokio::task::spawn_blocking(|| {
        cluster().psql(
            DB,
            "CREATE TABLE q_ext (id int PRIMARY KEY, v int); INSERT INTO q_ext VALUES (1, 1), (2, 2);",
        )
    })
    .await
    .unwrap();
    let mut cfg = test_config(PoolMode::Transaction, 2);
    cfg.general.metrics_listen = Some("127.0.0.1:0".into());
    let proxy = start_pgmemo(cfg).await;
    let client = connect(&url(proxy.local_addr(), DB)).await;
    let slow = client
        .prepare("SELECT pg_sleep($2), v FROM q_ext WHERE id = $1")
        .await
        .unwrap();
    for _ in 0..3 {
        let rows = client.query(&slow, &[&1i32, &0.02f64]).await.unwrap();
        assert_eq!(rows[0].get::<_, i32>(1), 1);
    }
    let read = client
        .prepare("SELECT v FROM q_ext WHERE id = $1")
        .await
        .unwrap();
    for i in 0..5 {
        let v: i32 = client
            .query_one(&read, &[&(1 + i % 2)])
            .await
            .unwrap()
            .get(0);
        assert_eq!(v, 1 + i % 2);
    }
    for _ in 0..4 {
        client
            .simple_query("SELECT v FROM q_ext WHERE id = 2")
            .await
            .unwrap();
    }
    let admin = admin_client(&proxy).await;
    let (columns, rows) = show(&admin, "SHOW QUERIES").await;
    assert_columns(
        &columns,
        &["query_hash", "timed", "protocol"],
        "SHOW QUERIES",
    );
    let find = |text: &str| {
        let found: Vec<_> = rows.iter().filter(|r| val(r, "query") == text).collect();
        assert_eq!(found.len(), 1, "rows for {text} in {rows:?}");
        found[0].clone()
    };
    // The slow statement first, timed on the server.
    let first = &rows[0];
    assert_eq!(
        val(first, "query"),
        "SELECT pg_sleep($2), v FROM q_ext WHERE id = $1"
    );
    assert_eq!(num(first, "calls"), 3);
    assert!(num(first, "timed") >= 1);
    let mean: f64 = val(first, "mean_server_us").parse().unwrap();
    assert!(mean >= 20_000.0, "mean {mean}");
    assert_eq!(val(first, "protocol"), "extended");
    assert_eq!(val(first, "cacheable"), "time or session function");
    assert_eq!(
        val(first, "autoprepare_never"),
        "prepared by the client (extended protocol)"
    );
    // The read and its simple twin: one row.
    let kv = find("SELECT v FROM q_ext WHERE id = $1");
    assert_eq!(num(&kv, "calls"), 9);
    assert_eq!(val(&kv, "protocol"), "both");
    assert!(num(&kv, "timed") >= 2, "each protocol's first call timed");
    assert_eq!(val(&kv, "tables"), "q_ext");
    assert_eq!(val(&kv, "cacheable"), "yes");
    let hash = val(&kv, "query_hash").to_owned();
    assert_eq!(
        hash,
        format!(
            "{:016x}",
            pgmemo::query::shapes::query_hash(b"SELECT v FROM q_ext WHERE id = $1")
        )
    );
    let (_, shapes) = show(&admin, "SHOW AUTOPREPARE").await;
    assert!(shapes
        .iter()
        .any(|s| val(s, "hash") == hash && val(s, "query") == val(&kv, "query")));
    let (_, body) = http_get(proxy.metrics_addr().unwrap(), "/metrics").await;
    let labels = format!("query_hash=\"{hash}\"");
    assert_eq!(sample(&body, "pgmemo_query_calls_total", &labels), 9.0);
}

/// pgbench's select-only script sent with `-M extended` (unnamed statements) and `-M
/// prepared` (named ones) shows in SHOW QUERIES as one query with every call counted and
/// its time measured; `-M simple` adds to the same row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn show_queries_counts_pgbench_extended_and_prepared() {
    const DB: &str = "admin_queries_pgbench";
    pgbench_database(DB).await;
    let proxy = start_pgmemo(test_config(PoolMode::Transaction, 2)).await;
    let port = proxy.local_addr().port();
    let admin = admin_client(&proxy).await;
    for (protocol, calls, seen) in [
        ("extended", 100, "extended"),
        ("prepared", 200, "extended"),
        ("simple", 300, "both"),
    ] {
        let out = pgbench(
            &["-S", "-M", protocol, "-c", "2", "-t", "50", DB],
            port,
            PGMEMO_USER,
            PGMEMO_PASS,
        )
        .await;
        assert!(
            out.status.success(),
            "pgbench -M {protocol}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let (_, rows) = show(&admin, "SHOW QUERIES").await;
        let found: Vec<_> = rows
            .iter()
            .filter(|r| val(r, "query").contains("FROM pgbench_accounts WHERE aid = $1"))
            .collect();
        assert_eq!(found.len(), 1, "-M {protocol}: {rows:?}");
        let row = found[0];
        assert_eq!(num(row, "calls"), calls, "-M {protocol}");
        assert_eq!(val(row, "protocol"), seen, "-M {protocol}");
        assert!(num(row, "timed") >= calls / 8, "-M {protocol}: {row:?}");
        let mean: f64 = val(row, "mean_server_us").parse().unwrap();
        assert!(mean > 0.0, "-M {protocol}");
        // `-S` reads one row per call, in either protocol.
        assert_eq!(num(row, "rows"), calls, "-M {protocol}: {row:?}");
        assert_eq!(val(row, "tables"), "pgbench_accounts");
        assert_eq!(val(row, "cacheable"), "yes");
    }
}

/// `--check` reads the databases a cache rule applies to: a `query_contains` naming a
/// relation none of them has is an error at the rule's line; one it names in some database,
/// a prefix of a longer name at the end of the text, a function, or a name in a string
/// passes; a database it cannot read is a warning.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_refuses_a_cache_rule_that_can_never_match() {
    fresh_db("rule_check").await;
    tokio::task::spawn_blocking(|| {
        cluster().psql(
            "rule_check",
            "CREATE TABLE accounts (id int); CREATE VIEW \"Accounts View\" AS SELECT 1",
        )
    })
    .await
    .unwrap();
    let dir = temp_dir("rule_check");
    let file = dir.join("pgmemo.toml");
    let write = |rules: &str| {
        std::fs::write(
            &file,
            format!(
                "[general]\nlisten = \"127.0.0.1:0\"\n[databases.rule_check]\n\
                 [cache]\nenabled = true\n{rules}"
            ),
        )
        .unwrap();
    };
    let upstream = upstream_url();
    let args = [
        "--config",
        file.to_str().unwrap(),
        "--upstream",
        &upstream,
        "--check",
    ];
    let check = || run(&args);
    write(
        "[[cache.rules]]\nquery_contains = \"FROM accounts WHERE\"\n\
         [[cache.rules]]\nquery_contains = \"FROM public.Accounts a JOIN \\\"Accounts View\\\" v\"\n\
         [[cache.rules]]\nquery_contains = \"FROM acc\"\n\
         [[cache.rules]]\nquery_contains = \"FROM generate_series\"\n\
         [[cache.rules]]\nquery_contains = \"WHERE note = 'FROM nothing'\"\n",
    );
    let out = check().await;
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{stderr}");
    assert!(!stderr.contains("warning"), "{stderr}");

    write(
        "[[cache.rules]]\nquery_contains = \"FROM accounts\"\n\n\
         [[cache.rules]]\nname = \"typo\"\nquery_contains = \"FROM acounts WHERE\"\n\
         [[cache.rules]]\nquery_contains = \"JOIN \\\"accounts View\\\" v\"\n",
    );
    let out = check().await;
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("line 11: cache.rules[1].query_contains: names acounts, and database rule_check has no relation"),
        "{stderr}"
    );
    assert!(
        stderr.contains("line 13: cache.rules[2].query_contains: names accounts View"),
        "{stderr}"
    );
    assert!(!stderr.contains("rules[0]"), "{stderr}");

    // A database it cannot read: said, not refused.
    write("[[cache.rules]]\ndatabase = \"no_such_db\"\nquery_contains = \"FROM x \"\n");
    let out = check().await;
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("warning: cache.rules[0]: could not read database no_such_db"),
        "{stderr}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// SHOW CONFIG's values by key.
async fn config_values(admin: &Client) -> HashMap<String, String> {
    let (_, rows) = show(admin, "SHOW CONFIG").await;
    rows.into_iter()
        .map(|r| (val(&r, "key").to_owned(), val(&r, "value").to_owned()))
        .collect()
}

/// `SET key = value` on the console, as PgBouncer's: a `[general]` setting changed in the
/// running configuration (a pool's size at once), a value that does not fit refused with
/// `SET failed` and the setting kept, a restart-only setting kept with a NOTICE; the session
/// parameters drivers set on connecting are ignored (`SET`) or shown (`SHOW`) as PgBouncer
/// answers them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn set_changes_a_setting_of_the_running_configuration() {
    const DB: &str = "admin_set";
    fresh_db(DB).await;
    let proxy = start_pgmemo(test_config(PoolMode::Transaction, 2)).await;
    let client = connect(&url(proxy.local_addr(), DB)).await;
    client.simple_query("SELECT 1").await.unwrap();
    let admin = admin_client(&proxy).await;
    let pool_size = |rows: Rows| num(row_for(&rows, DB), "pool_size");
    assert_eq!(pool_size(show(&admin, "SHOW DATABASES").await.1), 2);
    admin
        .simple_query("SET default_pool_size = 7")
        .await
        .unwrap();
    admin
        .simple_query("set server_check_query TO 'select 2';")
        .await
        .unwrap();
    admin.simple_query("SET autoprepare = off").await.unwrap();
    let c = config_values(&admin).await;
    assert_eq!(c["default_pool_size"], "7");
    assert_eq!(pool_size(show(&admin, "SHOW DATABASES").await.1), 7);
    assert_eq!(c["server_check_query"], "select 2");
    assert_eq!(c["autoprepare"], "false");

    for (bad, says) in [
        ("SET default_pool_size = 'many'", "default_pool_size"),
        ("SET default_pool_size = 0", "at least 1"),
        ("SET no_such_setting = 1", "no such setting"),
    ] {
        let e = admin.simple_query(bad).await.unwrap_err();
        let e = e.as_db_error().unwrap_or_else(|| panic!("{bad}: {e}"));
        assert!(
            e.message().starts_with("SET failed") && e.message().contains(says),
            "{bad}: {}",
            e.message()
        );
    }
    assert_eq!(config_values(&admin).await["default_pool_size"], "7");
    // Needs a restart: kept (with a NOTICE), as RELOAD keeps it.
    let listen = config_values(&admin).await["listen"].clone();
    admin
        .simple_query("SET listen = '127.0.0.1:1'")
        .await
        .unwrap();
    assert_eq!(config_values(&admin).await["listen"], listen);

    admin
        .simple_query("SET client_encoding = 'UTF8'")
        .await
        .unwrap();
    let (columns, rows) = show(&admin, "SHOW client_encoding").await;
    assert_eq!(columns, ["client_encoding"]);
    assert_eq!(val(&rows[0], "client_encoding"), "UTF-8");
    // Plain SQL is still no console command.
    assert!(admin
        .simple_query("SET default_pool_size = 1 + 1")
        .await
        .is_err());
}

/// `application_name_add_host`: the client's application_name, as its session and the
/// server's pg_stat_activity see it, ends with its address and port (`app` when it gave
/// none), as PgBouncer's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn application_name_add_host_names_the_clients_address() {
    const DB: &str = "admin_app_host";
    fresh_db(DB).await;
    let mut config = test_config(PoolMode::Transaction, 2);
    config.general.application_name_add_host = true;
    let proxy = start_pgmemo(config).await;
    for (given, name) in [("?application_name=shop", "shop"), ("", "app")] {
        let client = connect(&format!("{}{given}", url(proxy.local_addr(), DB))).await;
        let one = |sql: &'static str| {
            let client = &client;
            async move {
                let row = client.query_one(sql, &[]).await.unwrap();
                row.get::<_, String>(0)
            }
        };
        let shown = one("SHOW application_name").await;
        let seen =
            one("SELECT application_name::text FROM pg_stat_activity WHERE pid = pg_backend_pid()")
                .await;
        let (prefix, port) = shown.rsplit_once(':').unwrap_or_else(|| panic!("{shown}"));
        assert_eq!(prefix, format!("{name} - 127.0.0.1"), "{shown}");
        assert!(port.parse::<u16>().is_ok(), "{shown}");
        assert_eq!(seen, shown);
    }
}

/// SHOW STATS' `total_sent` counts every byte of the replies a client is sent, and
/// `total_received` every byte it sent: a query forwarded as it is, an autoprepared one (a
/// SELECT's RowDescription held back until its first row was not counted), an extended batch
/// (its ParseComplete pgmemo's own once the server has the statement: not counted either).
/// Each transaction's bytes, as the client sent and received them, against the counters'
/// rise.
#[tokio::test]
async fn total_sent_counts_every_byte_a_client_is_sent() {
    const DB: &str = "admin_sent";
    fresh_db(DB).await;
    tokio::task::spawn_blocking(|| {
        cluster().psql(
            DB,
            "CREATE TABLE sent (id int PRIMARY KEY, v text); \
             INSERT INTO sent VALUES (1, 'one'), (2, 'two');",
        )
    })
    .await
    .unwrap();
    let mut config = test_config(PoolMode::Transaction, 2);
    config.general.autoprepare_threshold = 1;
    let proxy = start_pgmemo(config).await;
    let admin = admin_client(&proxy).await;
    async fn stats(admin: &Client) -> (u64, u64, u64) {
        let (_, rows) = show(admin, "SHOW STATS").await;
        let row = row_for(&rows, DB);
        (
            num(row, "total_sent"),
            num(row, "total_received"),
            num(row, "autoprepared"),
        )
    }
    let mut client =
        RawClient::connect(proxy.local_addr(), PGMEMO_USER, DB, Some(PGMEMO_PASS), &[])
            .await
            .expect("login");
    let mut autoprepared = 0;
    for round in 0..3 {
        let batches = [
            vec![Frontend::query("SELECT v FROM sent WHERE id = 1")],
            vec![Frontend::query(&format!(
                "INSERT INTO sent VALUES ({}, 'new')",
                10 + round
            ))],
            vec![Frontend::query("SELECT count(*) FROM sent")],
            vec![
                Frontend::parse("", "SELECT v FROM sent WHERE id = $1", &[]),
                Frontend::bind("", "", &[Some("2")]),
                Frontend::describe_portal(""),
                Frontend::execute("", 0),
                Frontend::Sync,
            ],
        ];
        for batch in batches {
            let (sent, received, _) = stats(&admin).await;
            client.send(&batch).await.unwrap();
            let replies = client.recv_until_ready(1).await.unwrap();
            assert!(replies.iter().all(|m| !m.is_error()), "{replies:?}");
            let bytes: u64 = replies.iter().map(|m| 5 + m.body.len() as u64).sum();
            let mut asked = Vec::new();
            batch.iter().for_each(|m| m.encode(&mut asked));
            let (sent_after, received_after, ap) = stats(&admin).await;
            assert_eq!(
                (sent_after - sent, received_after - received),
                (bytes, asked.len() as u64),
                "round {round}: {batch:?} {replies:?}"
            );
            autoprepared = ap;
        }
    }
    assert!(
        autoprepared >= 4,
        "the SELECT and the INSERT autoprepared: {autoprepared}"
    );
    proxy.shutdown().await;
}
