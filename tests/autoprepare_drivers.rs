//! Autoprepare with real clients that send simple-protocol queries with their values in the
//! text: pgbench `-M simple`, psql scripts, psycopg2 (client-side interpolation), PHP PDO with
//! emulated prepares, node-postgres with values spliced in by the application. pgmemo runs in
//! transaction mode with autoprepare on (threshold 1, so everything repeated runs prepared);
//! every value is checked by the client programs, and each test also asserts that queries did
//! run autoprepared (a run that silently passed everything through would prove nothing).
//!
//! The programs for the other languages are in `tests/drivers/{python,php,node}`;
//! `scripts/setup` installs psycopg2, PHP with pdo_pgsql and node-postgres.

mod common;

use common::*;
use pgmemo::config::PoolMode;
use pgmemo::Pgmemo;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;
use tokio::process::Command;

fn drivers_dir(lang: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/drivers")
        .join(lang)
}

/// pgmemo in transaction mode on `pool_size` servers with autoprepare from the first use.
async fn autoprepare_proxy(pool_size: u32) -> Pgmemo {
    let mut config = test_config(PoolMode::Transaction, pool_size);
    config.general.autoprepare_threshold = 1;
    start_pgmemo(config).await
}

/// Queries that ran autoprepared, summed over the pools (as SHOW STATS counts them once the
/// sessions have reported).
async fn autoprepared_at_least(proxy: &Pgmemo, n: u64) -> u64 {
    let app = proxy.app().clone();
    let count = move || -> u64 {
        app.pools()
            .iter()
            .map(|p| p.stats.snapshot().autoprepared)
            .sum()
    };
    let counted = count.clone();
    wait_until(
        &format!("{n} queries counted as autoprepared"),
        Duration::from_secs(10),
        || {
            let c = counted();
            async move { c >= n }
        },
    )
    .await;
    count()
}

/// The driver tables of tests/drivers/python/autoprepare_psycopg2.py.
async fn create_tables(table: &str) {
    let mut c = RawClient::direct(&[]).await.expect("login");
    c.send(&[Frontend::query(&format!(
        "DROP TABLE IF EXISTS {table}, {table}_log;
         CREATE TABLE {table} (id int PRIMARY KEY, label text NOT NULL, amount int8 NOT NULL);
         INSERT INTO {table} SELECT g, 'item-' || g, g::int8 * g FROM generate_series(1, 100) g;
         CREATE TABLE {table}_log (worker int, i int, note text, PRIMARY KEY (worker, i));"
    ))])
    .await
    .unwrap();
    let replies = c.recv_until_ready(1).await.unwrap();
    assert!(!replies.iter().any(Backend::is_error), "{replies:?}");
}

/// Runs a client program; asserts it printed its OK line and exited 0.
async fn run_program(mut cmd: Command, what: &str) -> String {
    cmd.stdin(Stdio::null()).kill_on_drop(true);
    let out = tokio::time::timeout(Duration::from_secs(180), cmd.output())
        .await
        .unwrap_or_else(|_| panic!("{what} timed out"))
        .unwrap_or_else(|e| panic!("{what}: could not run {cmd:?}: {e} (run scripts/setup)"));
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stdout.lines().any(|l| l.starts_with("OK ")),
        "{what} failed ({}):\n{stdout}\n{stderr}",
        out.status
    );
    stdout.into_owned()
}

/// Runs pgbench through `proxy` on the database `ap_pgbench` with `args`; asserts that it
/// completed without a failed transaction.
async fn pgbench_through(proxy: &Pgmemo, args: &[&str]) {
    let mut all = vec!["-M", "simple", "-n", "-j", "2"];
    all.extend_from_slice(args);
    all.push("ap_pgbench");
    let out = pgbench(&all, proxy.local_addr().port(), PGMEMO_USER, PGMEMO_PASS).await;
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("number of failed transactions: 0"),
        "pgbench {all:?} through pgmemo:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pgbench_simple_protocol_has_no_failures() {
    pgbench_database("ap_pgbench").await;
    let proxy = autoprepare_proxy(4).await;
    for clients in ["1", "8", "32"] {
        pgbench_through(&proxy, &["-S", "-c", clients, "-t", "200"]).await;
    }
    // The TPC-B-like script: BEGIN, three UPDATEs, a SELECT, an INSERT, END.
    pgbench_through(&proxy, &["-c", "8", "-t", "100"]).await;
    // 8,200 point selects and 800 transactions of five statements, nearly all prepared.
    let n = autoprepared_at_least(&proxy, 10_000).await;
    println!("pgbench -M simple: {n} queries autoprepared");
}

/// A psql script with every kind of reply psql shows (rows, errors with their position as a
/// caret under the query, notices, transaction blocks), run by psql directly and through
/// pgmemo: the outputs must be the same, character for character.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn psql_script_output_is_the_same() {
    const SCRIPT: &str = r#"
SELECT 1 AS one, 'two' AS two, 3.5 AS three;
SELECT id, label FROM ap_psql WHERE id IN (1, 2, 3) ORDER BY id;
SELECT id, label FROM ap_psql WHERE id = 5;
SELECT id, label FROM ap_psql WHERE id = 6;
SELECT * FROM ap_psql WHERE id = 'seven';
SELECT * FROM ap_psql WHERE id = 'eight';
SELECT * FROM ap_psql
  WHERE label = 'item-9'
    AND amount = 'many';
SELECT /* a comment */ label FROM ap_psql WHERE id = 10 AND amount > 'x';
SELECT 1/0;
SELECT nosuch FROM ap_psql WHERE id = 1;
SELECT 'é' || label FROM ap_psql WHERE id = 11;
BEGIN;
INSERT INTO ap_psql_log VALUES (1, 1, 'in a block') RETURNING note;
SELECT count(*) FROM ap_psql_log WHERE worker = 1;
SELECT 'x'::int;
SELECT 1;
ROLLBACK;
SELECT count(*) FROM ap_psql_log WHERE worker = 1;
DO $$ BEGIN RAISE NOTICE 'hello %', 1; END $$;
SELECT id FROM ap_psql ORDER BY 1 DESC LIMIT 2;
INSERT INTO ap_psql_log VALUES (2, 1, 'a'), (2, 2, 'b');
INSERT INTO ap_psql_log VALUES (2, 2, 'dup');
UPDATE ap_psql SET amount = amount + 1 WHERE id = 12 RETURNING amount;
"#;
    async fn run_psql(port: u16) -> String {
        create_tables("ap_psql").await;
        let bin = cluster().bin_dir().join("psql");
        let file = Path::new(env!("CARGO_TARGET_TMPDIR")).join("autoprepare_psql_script.sql");
        std::fs::write(&file, SCRIPT.repeat(2)).expect("write the psql script");
        let out = Command::new(bin)
            .args([
                "-X",
                "-h",
                "127.0.0.1",
                "-p",
                &port.to_string(),
                "-U",
                PGMEMO_USER,
            ])
            .args(["-d", TEST_DB, "-v", "VERBOSITY=default", "-f"])
            .arg(&file)
            .env("PGPASSWORD", PGMEMO_PASS)
            .stdin(Stdio::null())
            .kill_on_drop(true)
            .output()
            .await
            .expect("run psql");
        format!(
            "{}\n--- stderr ---\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    }
    let direct = run_psql(cluster().port()).await;
    let proxy = autoprepare_proxy(2).await;
    let proxied = run_psql(proxy.local_addr().port()).await;
    assert!(
        direct.contains("LINE 1: SELECT * FROM ap_psql WHERE id = 'seven'"),
        "{direct}"
    );
    assert_eq!(direct, proxied);
    autoprepared_at_least(&proxy, 20).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn psycopg2_client_side_interpolation() {
    create_tables("ap_psycopg2").await;
    let proxy = autoprepare_proxy(2).await;
    let url = proxy_url(proxy.local_addr(), PGMEMO_USER, Some(PGMEMO_PASS), TEST_DB);
    let mut cmd = Command::new("python3");
    cmd.arg(drivers_dir("python").join("autoprepare_psycopg2.py"))
        .args([&url, "ap_psycopg2", "8", "40"]);
    let out = run_program(cmd, "psycopg2").await;
    let n = autoprepared_at_least(&proxy, 8 * 40 * 8 - 20).await;
    println!("psycopg2: {} ({n} queries autoprepared)", out.trim());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn php_pdo_emulated_prepares() {
    create_tables("ap_php").await;
    let proxy = autoprepare_proxy(2).await;
    let addr = proxy.local_addr();
    let mut cmd = Command::new("php");
    cmd.arg(drivers_dir("php").join("autoprepare.php")).args([
        &addr.ip().to_string(),
        &addr.port().to_string(),
        PGMEMO_USER,
        PGMEMO_PASS,
        TEST_DB,
        "ap_php",
        "40",
    ]);
    let out = run_program(cmd, "PHP PDO").await;
    // Three statements 40 times, less the first use of each (prepared on the side).
    let n = autoprepared_at_least(&proxy, 40 * 3 - 3).await;
    println!("PHP PDO: {} ({n} queries autoprepared)", out.trim());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_postgres_interpolated_values() {
    create_tables("ap_node").await;
    let proxy = autoprepare_proxy(2).await;
    let url = proxy_url(proxy.local_addr(), PGMEMO_USER, Some(PGMEMO_PASS), TEST_DB);
    let mut cmd = Command::new("node");
    cmd.arg(drivers_dir("node").join("autoprepare.js"))
        .args([&url, "ap_node", "8", "40"]);
    let out = run_program(cmd, "node-postgres").await;
    let n = autoprepared_at_least(&proxy, 8 * 40 * 3 - 10).await;
    println!("node-postgres: {} ({n} queries autoprepared)", out.trim());
}

/// A cancel reaches an autoprepared query: the client gets PostgreSQL's 57014 at once and the
/// query is neither run again nor has its plan checked (only data exceptions do; see
/// `ClientAutoprepare::checks_plan`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_autoprepared_query_stays_cancelled() {
    let proxy = autoprepare_proxy(2).await;
    let url = proxy_url(proxy.local_addr(), PGMEMO_USER, Some(PGMEMO_PASS), TEST_DB);
    let client = connect(&url).await;
    // The shape `SELECT pg_sleep($1), $2` (a numeric and an int4) is prepared on its first use
    // and runs prepared after.
    for i in 0..2 {
        client
            .simple_query(&format!("SELECT pg_sleep(0.01), {i}"))
            .await
            .unwrap();
    }
    let token = client.cancel_token();
    let started = std::time::Instant::now();
    let query = tokio::spawn(async move {
        let r = client.simple_query("SELECT pg_sleep(30.0), 2").await;
        (r, client)
    });
    wait_until(
        "the query to run on the server",
        Duration::from_secs(10),
        || async {
            let mut c = RawClient::direct(&[]).await.expect("login");
            c.send(&[Frontend::query(
                "SELECT count(*) FROM pg_stat_activity WHERE query = 'SELECT pg_sleep($1), $2' AND state = 'active'",
            )])
            .await
            .unwrap();
            let replies = c.recv_until_ready(1).await.unwrap();
            replies
                .iter()
                .filter_map(|r| r.data_row())
                .any(|row| row[0].as_deref() == Some(&b"1"[..]))
        },
    )
    .await;
    token.cancel_query(tokio_postgres::NoTls).await.unwrap();
    let (result, client) = tokio::time::timeout(Duration::from_secs(10), query)
        .await
        .expect("the cancelled query ended")
        .unwrap();
    let error = result.expect_err("cancelled");
    assert_eq!(
        error.code(),
        Some(&tokio_postgres::error::SqlState::QUERY_CANCELED),
        "{error:?}"
    );
    assert!(started.elapsed() < Duration::from_secs(10));
    // The client carries on, its queries still autoprepared.
    client
        .simple_query("SELECT pg_sleep(0.01), 3")
        .await
        .unwrap();
}

/// Rails' and Django's connection setup (`SET intervalstyle = iso_8601`, `SET TIME ZONE`) and
/// a DMY DateStyle no longer turn autoprepare off: literals kept in a statement's text are
/// read under the settings of its context, which every client sharing it has. Clients with
/// the defaults and clients with each framework's settings interleave the same texts on one
/// server; every reply equals PostgreSQL's to the same client, and the framework clients'
/// queries run autoprepared.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn framework_settings_keep_autoprepare_on() {
    let mut config = test_config(PoolMode::Transaction, 1);
    config.general.autoprepare_threshold = 1;
    let proxy = start_pgmemo(config).await;
    let through = proxy_url(proxy.local_addr(), PGMEMO_USER, Some(PGMEMO_PASS), TEST_DB);
    let direct = cluster().url(PGMEMO_USER, Some(PGMEMO_PASS), TEST_DB);
    let setups = [
        "",
        "SET intervalstyle = iso_8601; SET TIME ZONE 'UTC'", // Rails
        "SET TIME ZONE 'America/Chicago'",                   // Django with USE_TZ
        "SET DateStyle = 'ISO, DMY'",
        "SET IntervalStyle = 'sql_standard'; SET TimeZone = 'Asia/Kolkata'",
    ];
    let mut clients = vec![];
    for setup in setups {
        let (a, b) = (connect(&through).await, connect(&direct).await);
        if !setup.is_empty() {
            a.batch_execute(setup).await.unwrap();
            b.batch_execute(setup).await.unwrap();
        }
        clients.push((setup, a, b));
    }
    let rows = |messages: Vec<tokio_postgres::SimpleQueryMessage>| -> Vec<Vec<Option<String>>> {
        messages
            .iter()
            .filter_map(|m| match m {
                tokio_postgres::SimpleQueryMessage::Row(r) => {
                    Some((0..r.len()).map(|i| r.get(i).map(str::to_owned)).collect())
                }
                _ => None,
            })
            .collect()
    };
    let before = autoprepared_at_least(&proxy, 0).await;
    for i in 0..4 {
        for (setup, a, b) in &clients {
            for sql in [
                format!(
                    "SELECT '0{}/02/2024'::date, '2024-01-02 03:04:0{i}'::timestamptz",
                    i + 1
                ),
                format!("SELECT '-1 2:0{i}'::interval, interval '1 day 0{i}:00'"),
                format!(
                    "SELECT '2024-01-0{}'::date + {i}, now() > '2000-01-01'",
                    i + 1
                ),
                "SELECT '31/12/2024'::date".to_string(),
            ] {
                let got = a
                    .simple_query(&sql)
                    .await
                    .map(rows)
                    .map_err(|e| e.to_string());
                let want = b
                    .simple_query(&sql)
                    .await
                    .map(rows)
                    .map_err(|e| e.to_string());
                assert_eq!(got, want, "{sql} after {setup:?}");
            }
        }
    }
    // 5 clients × 4 rounds × 3 queries that succeed everywhere, the first round of each text
    // being new: most ran autoprepared.
    let ran = autoprepared_at_least(&proxy, before + 30).await - before;
    println!("framework settings: {ran} queries autoprepared");
    proxy.shutdown().await;
}
