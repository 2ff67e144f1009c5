//! Monitoring as a PgBouncer operator does it: the console's figures PgBouncer 1.25 shows
//! (maxwait, a client's wait and request_time, SHOW STATS_TOTALS / STATS_AVERAGES / TOTALS /
//! MEM / FDS, server connects), pgbouncer_exporter scraping the console under its PgBouncer
//! name, and pgmemo's own `/metrics` error counters and `/health`.

mod common;

use common::*;
use pgmemo::config::{PoolMode, Upstream};
use pgmemo::Pgmemo;
use std::collections::HashMap;
use std::path::PathBuf;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_postgres::{Client, SimpleQueryMessage};

type Row = HashMap<String, String>;

fn url(addr: std::net::SocketAddr, db: &str) -> String {
    proxy_url(addr, PGMEMO_USER, Some(PGMEMO_PASS), db)
}

/// A console command's column names and rows (NULL as "").
async fn show(admin: &Client, cmd: &str) -> (Vec<String>, Vec<Row>) {
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
                    .map(|(i, c)| (c.name().to_owned(), r.get(i).unwrap_or("").to_owned()))
                    .collect(),
            ),
            _ => {}
        }
    }
    (columns, rows)
}

fn num(row: &Row, col: &str) -> u64 {
    let v = row
        .get(col)
        .unwrap_or_else(|| panic!("no column {col} in {row:?}"));
    v.parse()
        .unwrap_or_else(|e| panic!("{col} = {v:?}: {e} in {row:?}"))
}

fn row_for<'a>(rows: &'a [Row], key: &str, value: &str) -> &'a Row {
    rows.iter()
        .find(|r| r.get(key).map(String::as_str) == Some(value))
        .unwrap_or_else(|| panic!("no row with {key} = {value} in {rows:?}"))
}

/// A SHOW POOLS row's `maxwait` and `maxwait_us`, in microseconds.
fn total_us(row: &Row) -> u64 {
    num(row, "maxwait") * 1_000_000 + num(row, "maxwait_us")
}

/// Waits until SHOW POOLS shows one client waiting in `db`'s pool for at least `at_least_us`
/// (polled, never slept); returns its `maxwait` then, in microseconds.
async fn wait_for_a_waiter(admin: &Client, db: &str, at_least_us: u64) -> u64 {
    wait_until(
        &format!("SHOW POOLS cl_waiting 1 with maxwait >= {at_least_us} us"),
        Duration::from_secs(10),
        || async move {
            let (_, pools) = show(admin, "SHOW POOLS").await;
            let pool = row_for(&pools, "database", db);
            num(pool, "cl_waiting") == 1 && total_us(pool) >= at_least_us
        },
    )
    .await;
    let (_, pools) = show(admin, "SHOW POOLS").await;
    total_us(row_for(&pools, "database", db))
}

/// `GET path` on `addr`: the status line and the body.
async fn http_get(addr: std::net::SocketAddr, path: &str) -> std::io::Result<(String, String)> {
    let mut sock = tokio::net::TcpStream::connect(addr).await?;
    sock.write_all(
        format!("GET {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n").as_bytes(),
    )
    .await?;
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), sock.read_to_end(&mut out))
        .await
        .map_err(|_| std::io::Error::other("no answer within 10 s"))??;
    let out = String::from_utf8_lossy(&out).into_owned();
    let (head, body) = out
        .split_once("\r\n\r\n")
        .ok_or_else(|| std::io::Error::other(format!("not an HTTP response: {out}")))?;
    let status = head.lines().next().unwrap_or_default().to_owned();
    Ok((status, body.to_owned()))
}

/// The value of the sample `name{labels}` (labels in the exposition's order), if present.
fn sample(body: &str, name: &str, labels: &str) -> Option<f64> {
    let prefix = if labels.is_empty() {
        format!("{name} ")
    } else {
        format!("{name}{{{labels}}} ")
    };
    body.lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .map(|v| v.trim().parse().expect("a number"))
}

fn must_sample(body: &str, name: &str, labels: &str) -> f64 {
    sample(body, name, labels).unwrap_or_else(|| panic!("no sample {name}{{{labels}}} in\n{body}"))
}

// ---------------------------------------------------------------------------------------------

/// A client queued behind a busy pool shows its wait, as PgBouncer computes it: SHOW POOLS'
/// maxwait is the oldest waiting client's, SHOW CLIENTS' wait the client's own, and both
/// fall back to 0 once it has its server. request_time moves with the client's requests.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_client_shows_its_wait() {
    const DB: &str = "monitoring_wait";
    fresh_db(DB).await;
    let proxy = pgmemo(PoolMode::Transaction, 1).await;
    let admin = connect(&url(proxy.local_addr(), "pgbouncer")).await;
    let holder = connect(&format!(
        "{}?application_name=holder",
        url(proxy.local_addr(), DB)
    ))
    .await;
    let waiter = connect(&format!(
        "{}?application_name=waiter",
        url(proxy.local_addr(), DB)
    ))
    .await;
    holder.batch_execute("BEGIN; SELECT 1").await.unwrap();
    let queued = tokio::spawn(async move {
        waiter.simple_query("SELECT 2").await.unwrap();
        waiter
    });

    // Until the waiter has waited at least 200 ms, by SHOW POOLS.
    let maxwait = wait_for_a_waiter(&admin, DB, 200_000).await;
    let (_, clients) = show(&admin, "SHOW CLIENTS").await;
    let waiting = row_for(&clients, "application_name", "waiter");
    assert_eq!(waiting["state"], "waiting", "{waiting:?}");
    let wait = num(waiting, "wait") * 1_000_000 + num(waiting, "wait_us");
    assert!(
        wait >= maxwait,
        "SHOW CLIENTS wait ({wait} us) read after SHOW POOLS maxwait ({maxwait} us)"
    );
    assert!(wait < 60_000_000, "{waiting:?}");
    assert!(
        waiting["request_time"] >= waiting["connect_time"],
        "{waiting:?}"
    );
    // The holder is in a transaction, idle: no query in flight, no wait.
    let holding = row_for(&clients, "application_name", "holder");
    assert_eq!(holding["state"], "active", "{holding:?}");
    assert_eq!((num(holding, "wait"), num(holding, "wait_us")), (0, 0));

    holder.batch_execute("COMMIT").await.unwrap();
    let waiter = queued.await.unwrap();
    let (_, pools) = show(&admin, "SHOW POOLS").await;
    let pool = row_for(&pools, "database", DB);
    assert_eq!(
        (num(pool, "cl_waiting"), total_us(pool)),
        (0, 0),
        "{pool:?}"
    );
    let (_, clients) = show(&admin, "SHOW CLIENTS").await;
    let served = row_for(&clients, "application_name", "waiter");
    assert_eq!(served["state"], "idle", "no server held: {served:?}");
    assert_eq!((num(served, "wait"), num(served, "wait_us")), (0, 0));
    // request_time follows the client's requests: once a second has passed since it
    // connected, its next query moves it past connect_time (shown to the second).
    wait_until(
        "request_time to pass connect_time",
        Duration::from_secs(5),
        || {
            let (admin, waiter) = (&admin, &waiter);
            async move {
                waiter.simple_query("SELECT 3").await.unwrap();
                let (_, clients) = show(admin, "SHOW CLIENTS").await;
                let me = row_for(&clients, "application_name", "waiter");
                me["request_time"] > me["connect_time"]
            }
        },
    )
    .await;
}

/// A client waiting for a server at login shows its wait as a queued query shows its own:
/// in session mode the client waits for its session's server, which another client holds.
/// It was in cl_waiting with SHOW POOLS' maxwait and its SHOW CLIENTS wait at 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_clients_wait_for_its_server_at_login_shows() {
    a_login_wait_shows(PoolMode::Session, "monitoring_login_wait_session").await;
}

/// As [`a_session_clients_wait_for_its_server_at_login_shows`] in transaction mode: a client
/// with a startup setting the pool has not seen waits at login for a server to settle it on,
/// while the pool's one server is in another client's transaction. It was not even counted
/// in cl_waiting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_clients_wait_at_login_shows() {
    a_login_wait_shows(PoolMode::Transaction, "monitoring_login_wait_xact").await;
}

/// A pool of one server in `mode`, held by one client while another logs in: the second
/// waits at login, in cl_waiting, SHOW POOLS' maxwait and its own SHOW CLIENTS wait growing
/// from the start of its wait; once the server is free it logs in and works, its wait over
/// (0 again) and counted in SHOW STATS' total_wait_time, as the wait of the login the pool's
/// first server was opened for is.
async fn a_login_wait_shows(mode: PoolMode, db: &'static str) {
    fresh_db(db).await;
    let proxy = pgmemo(mode, 1).await;
    let admin = connect(&url(proxy.local_addr(), "pgbouncer")).await;
    let waiter_url = format!("{}?application_name=waiter", url(proxy.local_addr(), db));
    if mode == PoolMode::Session {
        // The waiter's settings known to the pool beforehand: it waits for its session's
        // server, not for one to settle its settings on.
        let warm = connect(&waiter_url).await;
        warm.simple_query("SELECT 1").await.unwrap();
    }
    let holder = connect(&format!(
        "{}?application_name=holder",
        url(proxy.local_addr(), db)
    ))
    .await;
    if mode == PoolMode::Transaction {
        holder.batch_execute("BEGIN; SELECT 1").await.unwrap();
    }
    // The pool's first server was opened for a login, which waited for it: as PgBouncer's,
    // the wait time counts that wait, the connect included (it counted the queue only).
    let (_, stats) = show(&admin, "SHOW STATS").await;
    let s = row_for(&stats, "database", db);
    assert!(num(s, "total_wait_time") > 0, "{s:?}");
    let login = tokio::spawn(async move { connect(&waiter_url).await });

    // Until the waiter has waited at least 100 ms at login, by SHOW POOLS.
    let maxwait = wait_for_a_waiter(&admin, db, 100_000).await;
    let (_, clients) = show(&admin, "SHOW CLIENTS").await;
    let waiting = clients
        .iter()
        .find(|c| c["database"] == db && c["state"] == "waiting")
        .unwrap_or_else(|| panic!("no waiting client in {clients:?}"));
    let wait = num(waiting, "wait") * 1_000_000 + num(waiting, "wait_us");
    assert!(
        wait >= maxwait,
        "SHOW CLIENTS wait ({wait} us) read after SHOW POOLS maxwait ({maxwait} us)"
    );
    assert!(wait < 60_000_000, "{waiting:?}");
    let holding = row_for(&clients, "application_name", "holder");
    assert_eq!(holding["state"], "active", "{holding:?}");
    assert_eq!((num(holding, "wait"), num(holding, "wait_us")), (0, 0));

    // The server freed, the waiter logs in and works.
    match mode {
        PoolMode::Session => drop(holder),
        _ => holder.batch_execute("COMMIT").await.unwrap(),
    }
    let waiter = login
        .await
        .expect("the waiter logs in once the server is free");
    // A simple query: tokio-postgres' query_one closes its statement after the rows came,
    // a message that is in flight (a wait of its own) while the console is asked below
    // (seen: SHOW CLIENTS' wait_us 160).
    let one = waiter.simple_query("SELECT 1").await.unwrap();
    let value = one.iter().find_map(|m| match m {
        SimpleQueryMessage::Row(r) => r.get(0).map(str::to_owned),
        _ => None,
    });
    assert_eq!(value.as_deref(), Some("1"));
    let (_, pools) = show(&admin, "SHOW POOLS").await;
    let pool = row_for(&pools, "database", db);
    assert_eq!(
        (num(pool, "cl_waiting"), total_us(pool)),
        (0, 0),
        "{pool:?}"
    );
    let (_, clients) = show(&admin, "SHOW CLIENTS").await;
    let served = row_for(&clients, "application_name", "waiter");
    assert_eq!(
        (num(served, "wait"), num(served, "wait_us")),
        (0, 0),
        "{served:?}"
    );
    // Its wait is in the pool's wait time, counted when it ended.
    let (_, stats) = show(&admin, "SHOW STATS").await;
    let s = row_for(&stats, "database", db);
    assert!(num(s, "total_wait_time") >= maxwait, "{maxwait} us: {s:?}");
}

/// SHOW STATS_TOTALS, STATS_AVERAGES and TOTALS have PgBouncer 1.25's columns and the same
/// figures as SHOW STATS; query time is measured (a 100 ms sleep shows), server assignments
/// and named Parse / Bind messages are counted; SHOW MEM and SHOW FDS have PgBouncer's
/// columns.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stats_commands_have_pgbouncers_columns_and_agree() {
    const DB: &str = "monitoring_stats";
    fresh_db(DB).await;
    let proxy = pgmemo(PoolMode::Transaction, 2).await;
    let client = connect(&url(proxy.local_addr(), DB)).await;
    client.simple_query("SELECT pg_sleep(0.1)").await.unwrap();
    // tokio-postgres prepares named statements: one Parse, then a Bind per execution.
    let statement = client.prepare("SELECT $1::int + 1").await.unwrap();
    for i in 0..3 {
        client.query_one(&statement, &[&i]).await.unwrap();
    }
    let admin = connect(&url(proxy.local_addr(), "pgmemo")).await;

    let (cols, stats) = show(&admin, "SHOW STATS").await;
    let pgbouncer_stats = [
        "database",
        "total_server_assignment_count",
        "total_xact_count",
        "total_query_count",
        "total_received",
        "total_sent",
        "total_xact_time",
        "total_query_time",
        "total_wait_time",
        "total_client_parse_count",
        "total_server_parse_count",
        "total_bind_count",
        "avg_server_assignment_count",
        "avg_xact_count",
        "avg_query_count",
        "avg_recv",
        "avg_sent",
        "avg_xact_time",
        "avg_query_time",
        "avg_wait_time",
        "avg_client_parse_count",
        "avg_server_parse_count",
        "avg_bind_count",
    ];
    assert_eq!(cols[..pgbouncer_stats.len()], pgbouncer_stats, "SHOW STATS");
    let s = row_for(&stats, "database", DB).clone();
    assert!(num(&s, "total_query_time") >= 100_000, "{s:?}");
    // From the client's first message (before its server is taken) to the ReadyForQuery:
    // the transaction's time and the wait, and the checkout's own few microseconds.
    let slack_us = 1_000 * num(&s, "total_query_count");
    assert!(
        num(&s, "total_query_time")
            <= num(&s, "total_xact_time") + num(&s, "total_wait_time") + slack_us,
        "a query's time is within its transaction's and its wait: {s:?}"
    );
    assert!(num(&s, "avg_query_time") > 0, "{s:?}");
    // A server per transaction, and one more for the login's parameters.
    assert_eq!(
        num(&s, "total_server_assignment_count"),
        num(&s, "total_xact_count") + 1,
        "{s:?}"
    );
    assert!(num(&s, "total_client_parse_count") >= 1, "{s:?}");
    assert!(num(&s, "total_bind_count") >= 3, "{s:?}");
    assert!(num(&s, "total_server_parse_count") >= 1, "{s:?}");

    let (cols, totals) = show(&admin, "SHOW STATS_TOTALS").await;
    assert_eq!(
        cols,
        [
            "database",
            "server_assignment_count",
            "xact_count",
            "query_count",
            "bytes_received",
            "bytes_sent",
            "xact_time",
            "query_time",
            "wait_time",
            "client_parse_count",
            "server_parse_count",
            "bind_count",
        ]
    );
    let t = row_for(&totals, "database", DB);
    for (total, stat) in [
        ("query_count", "total_query_count"),
        ("query_time", "total_query_time"),
        ("bytes_received", "total_received"),
        ("bind_count", "total_bind_count"),
    ] {
        assert_eq!(num(t, total), num(&s, stat), "{total}: {t:?} vs {s:?}");
    }

    let (cols, averages) = show(&admin, "SHOW STATS_AVERAGES").await;
    assert_eq!(
        cols,
        [
            "database",
            "server_assignment_count",
            "xact_count",
            "query_count",
            "bytes_received",
            "bytes_sent",
            "xact_time",
            "query_time",
            "wait_time",
            "avg_client_parse_count",
            "avg_server_parse_count",
            "avg_bind_count",
        ]
    );
    let a = row_for(&averages, "database", DB);
    assert_eq!(num(a, "query_time"), num(&s, "avg_query_time"));

    let (cols, totals) = show(&admin, "SHOW TOTALS").await;
    assert_eq!(cols, ["name", "value"]);
    let named: HashMap<&str, u64> = totals
        .iter()
        .map(|r| (r["name"].as_str(), num(r, "value")))
        .collect();
    assert_eq!(named.len(), 22, "{named:?}");
    let all_queries: u64 = stats.iter().map(|r| num(r, "total_query_count")).sum();
    assert_eq!(named["total_query_count"], all_queries);
    assert!(named["total_query_time"] >= 100_000, "{named:?}");
    assert!(named.contains_key("avg_ps_bind_count"), "{named:?}");

    let (cols, mem) = show(&admin, "SHOW MEM").await;
    assert_eq!(cols, ["name", "size", "used", "free", "memtotal"]);
    let clients = row_for(&mem, "name", "client_cache");
    assert_eq!(num(clients, "used"), 1, "the console is no client: {mem:?}");
    assert_eq!(
        num(clients, "memtotal"),
        num(clients, "size") * num(clients, "used")
    );
    let (cols, fds) = show(&admin, "SHOW FDS").await;
    assert_eq!(
        cols[..8],
        ["fd", "task", "user", "database", "addr", "port", "cancel", "link"]
    );
    assert!(fds.is_empty(), "pgmemo has no online restart: {fds:?}");
    for (command, first) in [
        ("SHOW PEERS", "peer_id"),
        ("SHOW PEER_POOLS", "peer_id"),
        ("SHOW DNS_HOSTS", "hostname"),
        ("SHOW DNS_ZONES", "zonename"),
    ] {
        let (cols, rows) = show(&admin, command).await;
        assert_eq!(cols.first().map(String::as_str), Some(first), "{command}");
        assert!(rows.is_empty(), "{command}: {rows:?}");
    }
}

/// Each server connection pgmemo opens is counted once (SHOW SERVERS lists as many), and each
/// hand-over of one to a client (PgBouncer's server_assignment_count).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_connects_are_counted() {
    const DB: &str = "monitoring_connects";
    fresh_db(DB).await;
    let mut cfg = test_config(PoolMode::Transaction, 3);
    cfg.general.metrics_listen = Some("127.0.0.1:0".into());
    let proxy = start_pgmemo(cfg).await;
    let clients = [
        connect(&url(proxy.local_addr(), DB)).await,
        connect(&url(proxy.local_addr(), DB)).await,
        connect(&url(proxy.local_addr(), DB)).await,
    ];
    // Three transactions open at once need three servers.
    for c in &clients {
        c.batch_execute("BEGIN; SELECT 1").await.unwrap();
    }
    for c in &clients {
        c.batch_execute("COMMIT").await.unwrap();
    }
    let scrape = || async {
        let (_, body) = http_get(proxy.metrics_addr().unwrap(), "/metrics")
            .await
            .unwrap();
        body
    };
    let labels = format!("database=\"{DB}\",user=\"{PGMEMO_USER}\"");
    let before = scrape().await;
    assert_eq!(
        must_sample(&before, "pgmemo_server_connects_total", &labels),
        3.0
    );
    assert_eq!(
        must_sample(&before, "pgmemo_server_connect_failures_total", &labels),
        0.0
    );
    // Each query outside a transaction block is handed a server of its own (transaction
    // mode), and no server is opened for them: three idle ones are there.
    for i in 0..5 {
        clients[0]
            .simple_query(&format!("SELECT {i}"))
            .await
            .unwrap();
    }
    let after = scrape().await;
    let assigned = |body: &str| must_sample(body, "pgmemo_server_assignments_total", &labels);
    assert_eq!(assigned(&after) - assigned(&before), 5.0, "{after}");
    assert_eq!(
        must_sample(&after, "pgmemo_server_connects_total", &labels),
        3.0
    );
    let admin = connect(&url(proxy.local_addr(), "pgbouncer")).await;
    let (_, servers) = show(&admin, "SHOW SERVERS").await;
    let mine = servers.iter().filter(|s| s["database"] == DB).count();
    assert_eq!(
        mine, 3,
        "SHOW SERVERS lists the servers counted: {servers:?}"
    );
}

// ---------------------------------------------------------------------------------------------
// pgbouncer_exporter

/// The exporter binary: `$PGBOUNCER_EXPORTER`, or prometheus-community/pgbouncer_exporter as
/// scripts/setup-tests installs it from the Go module proxy, or (when the proxy does not serve
/// it) the stand-in in tests/exporter, built here: the same queries, driver and column rules.
async fn exporter() -> (PathBuf, &'static str) {
    if let Some(bin) = std::env::var_os("PGBOUNCER_EXPORTER") {
        return (bin.into(), "pgbouncer_exporter ($PGBOUNCER_EXPORTER)");
    }
    let installed =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/tmp/exporter/pgbouncer_exporter");
    if installed.exists() {
        return (installed, "prometheus-community/pgbouncer_exporter");
    }
    let bin = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("exporter/standin");
    let mut build = tokio::process::Command::new("go");
    build
        .args(["build", "-o"])
        .arg(&bin)
        .arg(".")
        .current_dir(PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/exporter"));
    prepare_step(
        build,
        "building tests/exporter (go and the Go module proxy are needed; scripts/setup-tests \
         downloads lib/pq)",
    )
    .await;
    (bin, "the stand-in in tests/exporter")
}

/// pgbouncer_exporter, pointed at the console as `database=pgbouncer` exactly as at a
/// PgBouncer, reports pgmemo up, and its pool, stats, database, list and config metrics are
/// the console's figures.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pgbouncer_exporter_scrapes_the_console() {
    const DB: &str = "monitoring_exporter";
    fresh_db(DB).await;
    let mut cfg = test_config(PoolMode::Transaction, 2);
    cfg.general.max_client_conn = 321;
    let proxy = start_pgmemo(cfg).await;
    let client = connect(&url(proxy.local_addr(), DB)).await;
    for i in 0..5 {
        client.simple_query(&format!("SELECT {i}")).await.unwrap();
    }
    client.simple_query("SELECT pg_sleep(0.05)").await.unwrap();

    let (bin, which) = exporter().await;
    eprintln!("scraping with {which}: {}", bin.display());
    let port = free_port();
    let console = format!(
        "postgres://{PGMEMO_USER}:{PGMEMO_PASS}@127.0.0.1:{}/pgbouncer?sslmode=disable",
        proxy.local_addr().port()
    );
    let mut child = tokio::process::Command::new(&bin)
        .arg(format!("--pgBouncer.connectionString={console}"))
        .arg(format!("--web.listen-address=127.0.0.1:{port}"))
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .unwrap_or_else(|e| panic!("starting {}: {e}", bin.display()));
    let addr: std::net::SocketAddr = ([127, 0, 0, 1], port).into();
    // Polled until the exporter listens (it starts in a moment), with a deadline.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let body = loop {
        match http_get(addr, "/metrics").await {
            Ok((status, body)) if status.contains(" 200") => break body,
            other => assert!(
                std::time::Instant::now() < deadline,
                "the exporter does not serve /metrics: {other:?}"
            ),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let _ = child.start_kill();
    assert_eq!(
        must_sample(&body, "pgbouncer_up", ""),
        1.0,
        "the exporter failed its scrape ({which}); its log is above\n{body}"
    );

    let admin = connect(&url(proxy.local_addr(), "pgbouncer")).await;
    let (_, pools) = show(&admin, "SHOW POOLS").await;
    let pool = row_for(&pools, "database", DB);
    let labels = format!("database=\"{DB}\",user=\"{PGMEMO_USER}\"");
    for (column, metric) in [
        ("sv_idle", "pgbouncer_pools_server_idle_connections"),
        ("sv_active", "pgbouncer_pools_server_active_connections"),
        ("cl_active", "pgbouncer_pools_client_active_connections"),
        ("cl_waiting", "pgbouncer_pools_client_waiting_connections"),
        ("maxwait", "pgbouncer_pools_client_maxwait_seconds"),
    ] {
        assert_eq!(
            must_sample(&body, metric, &labels),
            num(pool, column) as f64,
            "{metric} vs SHOW POOLS {column}"
        );
    }
    assert!(must_sample(&body, "pgbouncer_pools_server_idle_connections", &labels) >= 1.0);

    let (_, totals) = show(&admin, "SHOW STATS_TOTALS").await;
    let t = row_for(&totals, "database", DB);
    let labels = format!("database=\"{DB}\"");
    assert_eq!(
        must_sample(
            &body,
            "pgbouncer_stats_totals_queries_pooled_total",
            &labels
        ),
        num(t, "query_count") as f64
    );
    assert!(num(t, "query_count") >= 6, "{t:?}");
    assert_eq!(
        must_sample(
            &body,
            "pgbouncer_stats_totals_sql_transactions_pooled_total",
            &labels
        ),
        num(t, "xact_count") as f64
    );
    let seconds = must_sample(
        &body,
        "pgbouncer_stats_totals_queries_duration_seconds_total",
        &labels,
    );
    assert!(
        seconds >= 0.05,
        "the 50 ms sleep is in the query time: {seconds}"
    );

    let (_, lists) = show(&admin, "SHOW LISTS").await;
    assert_eq!(
        must_sample(&body, "pgbouncer_pools", ""),
        num(row_for(&lists, "list", "pools"), "items") as f64
    );
    assert_eq!(
        must_sample(&body, "pgbouncer_config_max_client_connections", ""),
        321.0
    );
    assert!(
        body.lines().any(
            |l| l.starts_with("pgbouncer_databases_current_connections{")
                && l.contains(&format!("name=\"{DB}\""))
        ),
        "SHOW DATABASES is exported:\n{body}"
    );
    assert!(body.contains("pgbouncer_version_info{"), "{body}");
}

// ---------------------------------------------------------------------------------------------
// pgmemo's own /metrics and /health

/// pgmemo with its metrics endpoint, its upstream at `port`.
async fn with_metrics(port: u16, tune: impl FnOnce(&mut pgmemo::config::Config)) -> Pgmemo {
    let mut cfg = test_config(PoolMode::Transaction, 2);
    cfg.upstream = Some(Upstream {
        host: "127.0.0.1".into(),
        port,
        user: PGMEMO_USER.into(),
        password: Some(PGMEMO_PASS.into()),
        ..Default::default()
    });
    cfg.general.metrics_listen = Some("127.0.0.1:0".into());
    tune(&mut cfg);
    start_pgmemo(cfg).await
}

async fn metrics(proxy: &Pgmemo) -> String {
    let (status, body) = http_get(proxy.metrics_addr().unwrap(), "/metrics")
        .await
        .unwrap();
    assert!(status.contains(" 200"), "{status}");
    body
}

/// Failed logins are counted by reason (a wrong password, a database pgmemo does not serve),
/// and so are clients turned away at max_client_conn; pgmemo_build_info carries the version.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn login_failures_and_refusals_are_counted() {
    let proxy = with_metrics(cluster().port(), |cfg| {
        cfg.general.max_client_conn = 1;
        cfg.databases
            .insert("postgres".into(), pgmemo::config::DatabaseConfig::default());
    })
    .await;
    let body = metrics(&proxy).await;
    let version = format!("version=\"{}\"", env!("CARGO_PKG_VERSION"));
    assert_eq!(must_sample(&body, "pgmemo_build_info", &version), 1.0);
    for reason in ["password", "unknown_database"] {
        let labels = format!("reason=\"{reason}\"");
        assert_eq!(
            must_sample(&body, "pgmemo_client_login_failures_total", &labels),
            0.0
        );
    }

    let addr = proxy.local_addr();
    let wrong = proxy_url(addr, PGMEMO_USER, Some("not the password"), "postgres");
    let err = tokio_postgres::connect(&wrong, tokio_postgres::NoTls)
        .await
        .err()
        .expect("a wrong password is refused");
    assert_eq!(err.code().map(|c| c.code()), Some("28P01"), "{err}");
    let unknown = url(addr, "no_such_database");
    let err = tokio_postgres::connect(&unknown, tokio_postgres::NoTls)
        .await
        .err()
        .expect("an unknown database is refused");
    assert_eq!(err.code().map(|c| c.code()), Some("3D000"), "{err}");
    // One client in; the next is one too many.
    let _first = connect(&url(addr, "postgres")).await;
    let err = tokio_postgres::connect(&url(addr, "postgres"), tokio_postgres::NoTls)
        .await
        .err()
        .expect("max_client_conn = 1");
    assert_eq!(err.code().map(|c| c.code()), Some("53300"), "{err}");

    let body = metrics(&proxy).await;
    let failures = |reason: &str| {
        must_sample(
            &body,
            "pgmemo_client_login_failures_total",
            &format!("reason=\"{reason}\""),
        )
    };
    assert_eq!(failures("password"), 1.0, "{body}");
    assert_eq!(failures("unknown_database"), 1.0, "{body}");
    assert_eq!(failures("server"), 0.0, "{body}");
    assert_eq!(
        must_sample(&body, "pgmemo_max_client_conn_refusals_total", ""),
        1.0
    );
}

/// /health answers 200 while the upstream answers, and 503 naming it when it does not (a
/// port nothing listens on); a client's failed server connection is counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_follows_the_upstream() {
    let proxy = with_metrics(cluster().port(), |_| {}).await;
    let (status, body) = http_get(proxy.metrics_addr().unwrap(), "/health")
        .await
        .unwrap();
    assert!(status.contains(" 200"), "{status}\n{body}");
    assert!(
        body.contains(&format!(
            "upstream 127.0.0.1:{}: answered",
            cluster().port()
        )),
        "{body}"
    );

    let dead = free_port(); // nothing listens there
    let proxy = with_metrics(dead, |cfg| {
        cfg.general.server_connect_timeout = Duration::from_millis(300);
        cfg.general.query_wait_timeout = Duration::from_secs(5);
    })
    .await;
    let (status, body) = http_get(proxy.metrics_addr().unwrap(), "/health")
        .await
        .unwrap();
    assert!(status.contains(" 503"), "{status}\n{body}");
    assert!(
        body.contains(&format!("upstream 127.0.0.1:{dead}:")),
        "{body}"
    );
    assert!(body.contains("listener"), "{body}");

    // A client whose login needs that server is refused, and the failed connects counted.
    tokio_postgres::connect(&url(proxy.local_addr(), "postgres"), tokio_postgres::NoTls)
        .await
        .err()
        .expect("no server to log in with");
    let body = metrics(&proxy).await;
    let labels = format!("database=\"postgres\",user=\"{PGMEMO_USER}\"");
    assert!(
        must_sample(&body, "pgmemo_server_connect_failures_total", &labels) >= 1.0,
        "{body}"
    );
    assert_eq!(
        must_sample(&body, "pgmemo_server_connects_total", &labels),
        0.0
    );
}

/// In session mode, as in PgBouncer, each transaction counts in SHOW STATS when it ends, not
/// when the client leaves: a long-lived session's traffic is seen while it lasts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_mode_transactions_count_as_they_end() {
    const DB: &str = "monitoring_session";
    fresh_db(DB).await;
    let proxy = pgmemo(PoolMode::Session, 2).await;
    let client = connect(&url(proxy.local_addr(), DB)).await;
    for i in 0..3 {
        client.simple_query(&format!("SELECT {i}")).await.unwrap();
    }
    client
        .batch_execute("BEGIN; SELECT pg_sleep(0.05); COMMIT")
        .await
        .unwrap();
    let admin = connect(&url(proxy.local_addr(), "pgbouncer")).await;
    let (_, stats) = show(&admin, "SHOW STATS").await;
    let s = row_for(&stats, "database", DB);
    assert_eq!(num(s, "total_xact_count"), 4, "{s:?}");
    assert_eq!(num(s, "total_query_count"), 4, "{s:?}");
    assert!(num(s, "total_xact_time") >= 50_000, "{s:?}");
    assert!(num(s, "total_query_time") >= 50_000, "{s:?}");
    // The time between transactions is no transaction's.
    assert!(num(s, "total_xact_time") < 1_000_000, "{s:?}");
    drop(client);
}
