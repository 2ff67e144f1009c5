//! Session state in transaction mode as real drivers use it, through pgmemo on a pool of two
//! servers: pgx with temporary tables, LISTEN/WaitForNotification and advisory locks
//! (tests/drivers/go/state.go), asyncpg's add_listener with the own-notification process ID
//! check (state_asyncpg.py), psycopg2's named WITH HOLD cursors across transactions
//! (state_psycopg2.py). Each program checks every value itself and is run directly against
//! PostgreSQL first (so its checks are PostgreSQL's behaviour), then through pgmemo; the pins
//! pgmemo counted for it are printed (`--nocapture`) and must be there.

mod common;

use common::*;
use pgmemo::config::PoolMode;
use std::path::PathBuf;
use std::process::Stdio;
use tokio::process::Command;

fn drivers_dir(lang: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/drivers")
        .join(lang)
}

/// Runs a driver program; panics with its output unless it printed its OK line and exited 0.
async fn run_program(mut cmd: Command, what: &str) -> String {
    cmd.stdin(Stdio::null()).kill_on_drop(true);
    let out = tokio::time::timeout(std::time::Duration::from_secs(120), cmd.output())
        .await
        .unwrap_or_else(|_| panic!("{what}: timed out"))
        .unwrap_or_else(|e| panic!("{what}: could not run {cmd:?}: {e}"));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.lines().any(|l| l.starts_with("OK ")),
        "{what} failed ({}):\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    stdout.trim().to_owned()
}

/// Runs the program `cmd(url)` makes directly and through pgmemo (transaction mode, two
/// servers); returns the pins pgmemo counted, by reason (SHOW STATS `pins` and Prometheus'
/// reasons through SHOW CLIENTS are per client; the pool's total is what is returned).
async fn directly_and_through_pgmemo(what: &str, cmd: impl Fn(&str) -> Command) -> u64 {
    let direct = cluster().url(PGMEMO_USER, Some(PGMEMO_PASS), TEST_DB);
    run_program(cmd(&direct), &format!("{what} directly")).await;
    let proxy = pgmemo(PoolMode::Transaction, 2).await;
    let url = proxy_url(proxy.local_addr(), PGMEMO_USER, Some(PGMEMO_PASS), TEST_DB);
    let ok = run_program(cmd(&url), &format!("{what} through pgmemo")).await;
    let admin = admin_console(proxy.local_addr()).await;
    let pins: u64 = admin_rows(&admin, "SHOW STATS")
        .await
        .iter()
        .filter(|r| r["database"] == TEST_DB)
        .map(|r| r["pins"].parse::<u64>().unwrap())
        .sum();
    eprintln!("{what}: {ok}; pins counted by pgmemo: {pins}");
    proxy.shutdown().await;
    pins
}

async fn require_python_module(module: &str) {
    let ok = Command::new("python3")
        .args(["-c", &format!("import {module}")])
        .output()
        .await
        .is_ok_and(|o| o.status.success());
    assert!(ok, "python3 cannot import {module}: run scripts/setup");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pgx_temp_tables_listen_and_advisory_locks() {
    let bin = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("go-driver/pgx-state-check");
    let mut build = std::process::Command::new("go");
    build
        .args(["build", "-o"])
        .arg(&bin)
        .arg(".")
        .current_dir(drivers_dir("go"));
    let built = tokio::task::spawn_blocking(move || build.output())
        .await
        .unwrap()
        .expect("go build (scripts/setup installs Go and the modules)");
    assert!(
        built.status.success(),
        "go build: {}",
        String::from_utf8_lossy(&built.stderr)
    );
    let pins = directly_and_through_pgmemo("pgx", |url| {
        let mut cmd = Command::new(&bin);
        cmd.args(["state", url]);
        cmd
    })
    .await;
    // a: temp, listen, advisory_lock; b: temp, advisory_lock.
    assert_eq!(pins, 5, "pins counted for the pgx clients");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn asyncpg_add_listener_with_its_own_process_id() {
    require_python_module("asyncpg").await;
    let pins = directly_and_through_pgmemo("asyncpg", |url| {
        let mut cmd = Command::new("python3");
        cmd.arg(drivers_dir("python").join("state_asyncpg.py"))
            .arg(url);
        cmd
    })
    .await;
    assert_eq!(pins, 1, "the listener's pin");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn psycopg2_named_cursors_with_hold() {
    require_python_module("psycopg2").await;
    let pins = directly_and_through_pgmemo("psycopg2", |url| {
        let mut cmd = Command::new("python3");
        cmd.arg(drivers_dir("python").join("state_psycopg2.py"))
            .arg(url);
        cmd
    })
    .await;
    assert_eq!(pins, 1, "the held cursor's pin");
}
