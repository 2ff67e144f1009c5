//! Real drivers using their own prepared statements through pgmemo in transaction mode.
//!
//! Each driver runs the same workload: [`CLIENTS`] concurrent connections through pgmemo in
//! transaction mode on a pool of [`POOL_SIZE`] server connections, each doing [`ITERATIONS`]
//! rounds of a mix of statements (several parameter types and a NULL, a row by key, an
//! aggregate, eight distinct statements used in turn, a set-returning query, an expected
//! division by zero now and then, and a transaction that inserts and reads back), every
//! returned value checked. The statements are the drivers' own prepared statements, prepared
//! in one transaction and executed in later ones, so on whichever server connection the pool
//! hands out:
//!
//! - Go pgx v5 with its default statement cache (`tests/drivers/go`);
//! - psycopg 3 with `prepare_threshold=0` and with its default threshold, asyncpg with its
//!   default statement cache (`tests/drivers/python`);
//! - node-postgres named queries `{name, text, values}` (`tests/drivers/node`);
//! - tokio-postgres statements from `Client::prepare`, reused across transactions, and sqlx
//!   with its default statement cache (`query_as` with binds, outside and inside
//!   transactions), both in this file;
//! - pgjdbc with `prepareThreshold=1`, built once with Maven into the cargo target dir
//!   (`tests/drivers/java`);
//! - `pgbench -S -M prepared` with 1, 8 and 32 clients (pool of 4).
//!
//! Each driver also runs once with pgmemo's prepared-statement support switched off
//! (`general.prepared_statements = false`). That run's result is recorded, not asserted: it
//! shows the difference the feature makes. The test asserts that the driver passes with the
//! feature on. Every test prints its rows of the driver matrix, and the last one to finish
//! prints the whole matrix:
//!
//! ```sh
//! cargo test --test prepared_drivers -- --nocapture
//! ```
//!
//! Beyond the matrix: four drivers at once with `max_prepared_statements = 1` (constant
//! eviction), and scenarios compared with PostgreSQL itself, run directly and through pgmemo
//! (a DDL that changes the result of prepared statements, with tokio-postgres and pgx; the
//! same text under different startup search_paths; `SET LOCAL search_path`).
//!
//! The drivers' dependencies (Go modules, npm packages, Maven artifacts, Python packages) are
//! installed by `scripts/setup`; the Go, Node and Java ones are also fetched on a first run
//! when missing, and a registry that cannot be reached fails the test with the command to run.

mod common;

use common::*;
use pgmemo::config::{Config, PoolMode};
use sqlx::Connection as _;
use std::collections::BTreeMap;
use std::fmt::Debug;
use std::future::Future;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::process::Command;
use tokio_postgres::types::ToSql;
use tokio_postgres::{Client, NoTls, Statement};

/// Concurrent client connections per driver run.
const CLIENTS: usize = 24;
/// Rounds of the statement mix per client.
const ITERATIONS: usize = 30;
/// Server connections in pgmemo's pool.
const POOL_SIZE: u32 = 2;
/// Errors one client records before it gives up (so that a failing run ends quickly).
const MAX_ERRORS: usize = 5;
/// A whole driver run (start-up included) must end within this.
const RUN_TIMEOUT: Duration = Duration::from_secs(120);

/// The rows of the driver matrix, in the order they are printed.
const DRIVERS: &[&str] = &[
    "Go pgx v5 (statement cache)",
    "psycopg 3 (prepare_threshold=0)",
    "psycopg 3 (default threshold)",
    "asyncpg (statement cache)",
    "node-postgres (named queries)",
    "tokio-postgres (Client::prepare)",
    "sqlx (statement cache)",
    "pgjdbc (prepareThreshold=1)",
    "pgbench -S -M prepared",
];

fn manifest_dir() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn drivers_dir(lang: &str) -> PathBuf {
    manifest_dir().join("tests/drivers").join(lang)
}

// ---------------------------------------------------------------------------------------------
// Outcomes and the matrix
// ---------------------------------------------------------------------------------------------

/// What one run of a driver gave.
struct Outcome {
    passed: bool,
    /// One line for the matrix: the driver's OK line, or a count of problems and the first.
    summary: String,
    /// Everything the run reported, for an assertion message.
    output: String,
}

impl Outcome {
    fn failed(summary: impl Into<String>) -> Outcome {
        let summary = summary.into();
        Outcome {
            passed: false,
            output: summary.clone(),
            summary,
        }
    }

    /// Reads the output of a driver program: "MISMATCH: ..." and "ERROR: ..." lines for
    /// problems, an "OK ..." line when everything passed.
    fn from_report(success: bool, report: &str, extra: &str) -> Outcome {
        let ok = report.lines().find(|l| l.starts_with("OK "));
        let mismatches: Vec<&str> = report
            .lines()
            .filter(|l| l.starts_with("MISMATCH"))
            .collect();
        let errors: Vec<&str> = report.lines().filter(|l| l.starts_with("ERROR")).collect();
        let output = format!("{report}\n{extra}").trim().to_string();
        if success && mismatches.is_empty() && errors.is_empty() {
            if let Some(ok) = ok {
                return Outcome {
                    passed: true,
                    summary: ok.trim_start_matches("OK ").to_string(),
                    output,
                };
            }
        }
        let first = mismatches
            .first()
            .or(errors.first())
            .map(|l| l.to_string())
            .unwrap_or_else(|| {
                let tail: Vec<&str> = extra.lines().rev().take(3).collect();
                format!(
                    "no report; {}",
                    tail.into_iter().rev().collect::<Vec<_>>().join(" / ")
                )
            });
        Outcome {
            passed: false,
            summary: format!(
                "{} failed checks, {} errors; first: {}",
                mismatches.len(),
                errors.len(),
                shorten(&first, 150)
            ),
            output,
        }
    }
}

fn shorten(s: &str, max: usize) -> String {
    let s = s.replace('|', "/");
    if s.chars().count() <= max {
        return s;
    }
    let mut out: String = s.chars().take(max).collect();
    out.push('…');
    out
}

/// The matrix rows recorded so far in this test binary, by position in [`DRIVERS`].
static MATRIX: Mutex<BTreeMap<usize, [String; 2]>> = Mutex::new(BTreeMap::new());

const MATRIX_HEADER: &str = "| driver | prepared_statements | result | detail |\n|---|---|---|---|";

fn matrix_row(driver: &str, on: bool, outcome: &Outcome) -> String {
    format!(
        "| {driver} | {} | {} | {} |",
        if on { "on" } else { "off" },
        if outcome.passed { "PASS" } else { "FAIL" },
        outcome.summary
    )
}

/// Prints this driver's rows, records them, and prints the whole matrix once every driver
/// has reported.
fn record(driver: &str, on: &Outcome, off: &Outcome) {
    let index = DRIVERS
        .iter()
        .position(|d| *d == driver)
        .expect("driver listed in DRIVERS");
    let rows = [matrix_row(driver, true, on), matrix_row(driver, false, off)];
    println!(
        "driver matrix row (transaction mode, {CLIENTS} clients, pool of {POOL_SIZE}):\n{MATRIX_HEADER}\n{}\n{}",
        rows[0], rows[1]
    );
    let mut matrix = MATRIX.lock().unwrap_or_else(|e| e.into_inner());
    matrix.insert(index, rows);
    if matrix.len() == DRIVERS.len() {
        let mut all = String::new();
        for rows in matrix.values() {
            all.push_str(&format!("\n{}\n{}", rows[0], rows[1]));
        }
        println!(
            "\nDRIVER MATRIX (pgmemo in transaction mode, pool of {POOL_SIZE} servers, \
             {CLIENTS} clients x {ITERATIONS} iterations; pgbench: pool of 4)\n{MATRIX_HEADER}{all}\n"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Running a driver against pgmemo, with the feature on and off
// ---------------------------------------------------------------------------------------------

/// Where a driver run connects, and the tables it works on.
#[derive(Clone)]
struct Target {
    addr: SocketAddr,
    url: String,
    table: String,
}

/// Creates `table` (ids 1..100, label `item-<id>`, amount id*id) and empty `table_log` and
/// `table_batch` (for drivers that batch inserts), directly on PostgreSQL, so that a run without the feature fails only at its own work.
async fn create_tables(table: &str) {
    let url = cluster().url(PGMEMO_USER, Some(PGMEMO_PASS), TEST_DB);
    let (client, conn) = tokio_postgres::connect(&url, NoTls)
        .await
        .expect("connect to PostgreSQL");
    let conn = tokio::spawn(conn);
    client
        .batch_execute(&format!(
            "DROP TABLE IF EXISTS {table}, {table}_log, {table}_batch;
             CREATE TABLE {table} (id int PRIMARY KEY, label text NOT NULL, amount int8 NOT NULL);
             INSERT INTO {table} SELECT g, 'item-' || g, g::int8 * g FROM generate_series(1, 100) g;
             CREATE TABLE {table}_log (worker int, i int, note text, PRIMARY KEY (worker, i));
             CREATE TABLE {table}_batch (worker int, i int, j int, PRIMARY KEY (worker, i, j));"
        ))
        .await
        .expect("create the driver tables");
    drop(client);
    let _ = conn.await;
}

/// pgmemo in transaction mode on [`POOL_SIZE`] servers, prepared-statement support `on` or off.
fn driver_config(on: bool) -> Config {
    let mut config = test_config(PoolMode::Transaction, POOL_SIZE);
    config.general.prepared_statements = on;
    config
}

/// Runs `run` against a fresh pgmemo started with `config`, on fresh tables named `table`.
async fn run_once<F, Fut>(table: String, config: Config, run: F) -> Outcome
where
    F: FnOnce(Target) -> Fut,
    Fut: Future<Output = Outcome>,
{
    create_tables(&table).await;
    let proxy = start_pgmemo(config).await;
    let target = Target {
        addr: proxy.local_addr(),
        url: proxy_url(proxy.local_addr(), PGMEMO_USER, Some(PGMEMO_PASS), TEST_DB),
        table,
    };
    let outcome = tokio::time::timeout(RUN_TIMEOUT, run(target))
        .await
        .unwrap_or_else(|_| Outcome::failed(format!("timed out after {RUN_TIMEOUT:?}")));
    proxy.shutdown().await;
    outcome
}

/// Runs the driver with the feature on and off (at the same time, each on its own pgmemo),
/// records both in the matrix and asserts that the run with the feature on passed.
async fn driver_matrix<F, Fut>(driver: &str, key: &str, run: F)
where
    F: Fn(Target) -> Fut + Clone,
    Fut: Future<Output = Outcome>,
{
    let (on, off) = tokio::join!(
        run_once(format!("pd_{key}_on"), driver_config(true), run.clone()),
        run_once(format!("pd_{key}_off"), driver_config(false), run)
    );
    record(driver, &on, &off);
    assert!(
        on.passed,
        "{driver} through pgmemo with prepared_statements = on failed: {}\n{}",
        on.summary,
        on.output.lines().take(60).collect::<Vec<_>>().join("\n")
    );
}

/// Runs a driver program; it is killed if the run times out.
async fn run_program(mut cmd: Command) -> Outcome {
    cmd.stdin(Stdio::null()).kill_on_drop(true);
    let out = match cmd.output().await {
        Ok(out) => out,
        Err(e) => return Outcome::failed(format!("could not run {cmd:?}: {e}")),
    };
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    Outcome::from_report(
        out.status.success(),
        &stdout,
        &format!("{}\n{stderr}", out.status),
    )
}

fn tool_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
}

// ---------------------------------------------------------------------------------------------
// Go pgx v5
// ---------------------------------------------------------------------------------------------

/// Builds tests/drivers/go into the cargo target dir (Go's build cache makes this quick).
/// Tests in one binary may build it at once, hence a lock and a build per process.
async fn build_pgx() -> PathBuf {
    static BUILT: tokio::sync::OnceCell<PathBuf> = tokio::sync::OnceCell::const_new();
    BUILT
        .get_or_init(|| async {
            let bin = tool_dir().join("go-driver/pgx-check");
            let mut build = Command::new("go");
            build
                .args(["build", "-o"])
                .arg(&bin)
                .arg(".")
                .current_dir(drivers_dir("go"));
            prepare_step(
                build,
                "building tests/drivers/go (go and the Go module proxy are needed; \
                 scripts/setup downloads the modules)",
            )
            .await;
            bin
        })
        .await
        .clone()
}

async fn run_pgx(t: Target) -> Outcome {
    let mut cmd = Command::new(build_pgx().await);
    cmd.args([
        &t.url,
        &t.table,
        &CLIENTS.to_string(),
        &ITERATIONS.to_string(),
    ]);
    run_program(cmd).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pgx_v5_statement_cache() {
    build_pgx().await;
    driver_matrix(DRIVERS[0], "pgx", run_pgx).await;
}

// ---------------------------------------------------------------------------------------------
// Python: psycopg 3 and asyncpg
// ---------------------------------------------------------------------------------------------

/// Fails with the install command when `python3` cannot import `module`.
async fn require_python_module(module: &str, package: &str) {
    assert!(
        succeeds("python3", &["-c", &format!("import {module}")]).await,
        "python3 cannot import {module}: run scripts/setup, or: python3 -m pip install '{package}'"
    );
}

/// psycopg with `prepare_threshold` `threshold` ("0" or "default").
async fn run_psycopg(threshold: &'static str, t: Target) -> Outcome {
    let mut cmd = Command::new("python3");
    cmd.arg(drivers_dir("python").join("prepared_psycopg.py"))
        .args([
            &t.url,
            &t.table,
            threshold,
            &CLIENTS.to_string(),
            &ITERATIONS.to_string(),
        ]);
    run_program(cmd).await
}

/// psycopg with `prepare_threshold=0`, every tenth round running DISCARD ALL.
async fn run_psycopg_discard(t: Target) -> Outcome {
    let mut cmd = Command::new("python3");
    cmd.arg(drivers_dir("python").join("prepared_psycopg.py"))
        .args([
            &t.url,
            &t.table,
            "0",
            &CLIENTS.to_string(),
            &ITERATIONS.to_string(),
            "discard",
        ]);
    run_program(cmd).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn psycopg3_prepare_threshold_0() {
    require_python_module("psycopg", "psycopg[binary]>=3.1").await;
    driver_matrix(DRIVERS[1], "psycopg0", |t| run_psycopg("0", t)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn psycopg3_default_threshold() {
    require_python_module("psycopg", "psycopg[binary]>=3.1").await;
    driver_matrix(DRIVERS[2], "psycopg5", |t| run_psycopg("default", t)).await;
}

/// psycopg sends every statement through the extended protocol, DISCARD ALL too (prepared,
/// with `prepare_threshold=0`), and forgets its own prepared statements when it sees one
/// succeed. The same program runs against PostgreSQL directly (it must pass there) and
/// through pgmemo.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn psycopg3_discard_all_like_postgresql() {
    require_python_module("psycopg", "psycopg[binary]>=3.1").await;
    let table = "pd_discard_direct".to_string();
    create_tables(&table).await;
    let direct = run_psycopg_discard(Target {
        addr: cluster().addr(),
        url: cluster().url(PGMEMO_USER, Some(PGMEMO_PASS), TEST_DB),
        table,
    })
    .await;
    assert!(
        direct.passed,
        "the psycopg DISCARD ALL run fails against PostgreSQL itself: {}\n{}",
        direct.summary, direct.output
    );
    let through = run_once(
        "pd_discard_pgmemo".into(),
        driver_config(true),
        run_psycopg_discard,
    )
    .await;
    println!(
        "psycopg 3 (prepare_threshold=0) with DISCARD ALL: directly {}, through pgmemo {} ({})",
        if direct.passed { "PASS" } else { "FAIL" },
        if through.passed { "PASS" } else { "FAIL" },
        through.summary
    );
    assert!(
        through.passed,
        "psycopg with DISCARD ALL fails through pgmemo: {}\n{}",
        through.summary,
        through
            .output
            .lines()
            .take(60)
            .collect::<Vec<_>>()
            .join("\n")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn asyncpg_statement_cache() {
    require_python_module("asyncpg", "asyncpg>=0.29").await;
    driver_matrix(DRIVERS[3], "asyncpg", |t: Target| async move {
        let mut cmd = Command::new("python3");
        cmd.arg(drivers_dir("python").join("prepared_asyncpg.py"))
            .args([
                &t.url,
                &t.table,
                &CLIENTS.to_string(),
                &ITERATIONS.to_string(),
            ]);
        run_program(cmd).await
    })
    .await;
}

// ---------------------------------------------------------------------------------------------
// node-postgres
// ---------------------------------------------------------------------------------------------

/// Installs tests/drivers/node's packages when they are missing.
async fn npm_install() {
    let dir = drivers_dir("node");
    if !dir.join("node_modules/pg/package.json").exists() {
        let mut install = Command::new("npm");
        install
            .args(["ci", "--no-audit", "--no-fund", "--loglevel=error"])
            .current_dir(&dir);
        prepare_step(
            install,
            "installing tests/drivers/node's packages (npm and the npm registry are needed; \
             scripts/setup does this)",
        )
        .await;
    }
}

async fn run_node(t: Target) -> Outcome {
    let mut cmd = Command::new("node");
    cmd.arg(drivers_dir("node").join("check.js")).args([
        &t.url,
        &t.table,
        &CLIENTS.to_string(),
        &ITERATIONS.to_string(),
    ]);
    run_program(cmd).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_postgres_named_queries() {
    npm_install().await;
    driver_matrix(DRIVERS[4], "nodepg", run_node).await;
}

// ---------------------------------------------------------------------------------------------
// Java pgjdbc
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pgjdbc_prepare_threshold_1() {
    let jar = pgjdbc_jar().await;
    driver_matrix(DRIVERS[7], "pgjdbc", |t: Target| {
        let jar = jar.clone();
        async move {
            let url = format!(
                "jdbc:postgresql://{}:{}/{TEST_DB}?user={PGMEMO_USER}&password={PGMEMO_PASS}\
                 &prepareThreshold=1&sslmode=disable",
                t.addr.ip(),
                t.addr.port()
            );
            let mut cmd = Command::new("java");
            cmd.arg("-jar").arg(&jar).args([
                &url,
                &t.table,
                &CLIENTS.to_string(),
                &ITERATIONS.to_string(),
            ]);
            run_program(cmd).await
        }
    })
    .await;
}

// ---------------------------------------------------------------------------------------------
// Rust drivers, in-process
// ---------------------------------------------------------------------------------------------

/// Collects problems and counts checked values for the in-process drivers, like the driver
/// programs' report.
#[derive(Default)]
struct Checker {
    problems: Mutex<Vec<String>>,
    checked: AtomicU64,
}

impl Checker {
    fn check<T: PartialEq + Debug>(&self, got: T, want: T, what: &str) {
        self.checked.fetch_add(1, Ordering::Relaxed);
        if got != want {
            self.problem(format!("MISMATCH: {what}: expected {want:?}, got {got:?}"));
        }
    }

    fn problem(&self, p: String) {
        self.problems
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(p);
    }

    fn outcome(&self, name: &str) -> Outcome {
        let problems = self.problems.lock().unwrap_or_else(|e| e.into_inner());
        let mut report = problems.join("\n");
        if problems.is_empty() {
            report = format!(
                "OK {name}: {CLIENTS} clients x {ITERATIONS} iterations, {} values checked",
                self.checked.load(Ordering::Relaxed)
            );
        }
        Outcome::from_report(true, &report, "")
    }
}

/// Runs `worker` for each of [`CLIENTS`] clients at once; problems land in the checker.
async fn rust_clients<F, Fut>(name: &str, worker: F) -> Outcome
where
    F: Fn(usize, Arc<Checker>) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let checker = Arc::new(Checker::default());
    // A JoinSet aborts what is left of its tasks if the run times out.
    let mut tasks = tokio::task::JoinSet::new();
    for w in 0..CLIENTS {
        tasks.spawn(worker(w, checker.clone()));
    }
    while let Some(done) = tasks.join_next().await {
        if let Err(e) = done {
            checker.problem(format!("ERROR: a client task panicked: {e}"));
        }
    }
    checker.outcome(name)
}

/// A database error as SQLSTATE and message.
fn tp_error(e: &tokio_postgres::Error) -> String {
    match e.as_db_error() {
        Some(db) => format!("{} {}", db.code().code(), db.message()),
        None => e.to_string(),
    }
}

/// tokio-postgres statements, prepared once per client and used in every round.
struct TpStatements {
    arith: Statement,
    by_id: Statement,
    agg: Statement,
    k: Vec<Statement>,
    series: Statement,
    div: Statement,
    insert: Statement,
    note: Statement,
    count_log: Statement,
}

impl TpStatements {
    async fn prepare(c: &Client, table: &str) -> Result<TpStatements, tokio_postgres::Error> {
        let mut k = Vec::new();
        for n in 0..8 {
            k.push(c.prepare(&format!("SELECT $1::int4 + {n}")).await?);
        }
        Ok(TpStatements {
            arith: c
                .prepare(
                    "SELECT $1::int4 * 2 + $2::int4, $3::text || '!', $4::int8, $5::float8 / 4",
                )
                .await?,
            by_id: c
                .prepare(&format!("SELECT label, amount FROM {table} WHERE id = $1"))
                .await?,
            agg: c
                .prepare(&format!(
                    "SELECT count(*), sum(amount)::int8 FROM {table} WHERE id <= $1"
                ))
                .await?,
            k,
            series: c
                .prepare("SELECT g, $1::text || g FROM generate_series(1, $2::int4) g")
                .await?,
            div: c.prepare("SELECT 1 / $1::int4").await?,
            insert: c
                .prepare(&format!(
                    "INSERT INTO {table}_log (worker, i, note) VALUES ($1, $2, $3)"
                ))
                .await?,
            note: c
                .prepare(&format!(
                    "SELECT note FROM {table}_log WHERE worker = $1 AND i = $2"
                ))
                .await?,
            count_log: c
                .prepare(&format!(
                    "SELECT count(*) FROM {table}_log WHERE worker = $1"
                ))
                .await?,
        })
    }
}

fn sum_of_squares(n: i64) -> i64 {
    n * (n + 1) * (2 * n + 1) / 6
}

async fn tokio_postgres_round(
    client: &mut Client,
    s: &TpStatements,
    chk: &Checker,
    w: i32,
    i: i32,
) -> Result<(), tokio_postgres::Error> {
    let label = format!("w{w}-i{i}-é");
    let row = client
        .query_one(&s.arith, &[&w, &i, &label, &None::<i64>, &f64::from(i)])
        .await?;
    chk.check(
        (
            row.get::<_, i32>(0),
            row.get::<_, String>(1),
            row.get::<_, Option<i64>>(2),
            row.get::<_, f64>(3),
        ),
        (w * 2 + i, format!("{label}!"), None, f64::from(i) / 4.0),
        "arithmetic, text, null, float",
    );

    let id = (w * 7 + i) % 100 + 1;
    let row = client.query_one(&s.by_id, &[&id]).await?;
    chk.check(
        (row.get::<_, String>(0), row.get::<_, i64>(1)),
        (format!("item-{id}"), i64::from(id * id)),
        "row by id",
    );
    let n = i % 100 + 1;
    let row = client.query_one(&s.agg, &[&n]).await?;
    chk.check(
        (row.get::<_, i64>(0), row.get::<_, i64>(1)),
        (i64::from(n), sum_of_squares(i64::from(n))),
        "count and sum of squares",
    );

    let k = i % 8;
    let row = client.query_one(&s.k[k as usize], &[&i]).await?;
    chk.check(row.get::<_, i32>(0), i + k, "distinct statement");

    let len = i % 5 + 1;
    let rows = client.query(&s.series, &[&"r", &len]).await?;
    let got: Vec<(i32, String)> = rows.iter().map(|r| (r.get(0), r.get(1))).collect();
    let want: Vec<(i32, String)> = (1..=len).map(|j| (j, format!("r{j}"))).collect();
    chk.check(got, want, "series");

    // Pipelined: several queries in flight on the connection at once, each its own
    // Bind/Execute/Sync, written together.
    let by_i: [&(dyn ToSql + Sync); 1] = [&i];
    let by_id: [&(dyn ToSql + Sync); 1] = [&id];
    let (a, b, c) = tokio::try_join!(
        client.query_one(&s.k[1], &by_i),
        client.query_one(&s.by_id, &by_id),
        client.query_one(&s.k[2], &by_i),
    )?;
    chk.check(
        (
            a.get::<_, i32>(0),
            b.get::<_, String>(0),
            c.get::<_, i32>(0),
        ),
        (i + 1, format!("item-{id}"), i + 2),
        "pipelined queries",
    );

    if i % 10 == 3 {
        let code = match client.query_one(&s.div, &[&0i32]).await {
            Ok(_) => None,
            Err(e) => e.code().map(|c| c.code().to_string()),
        };
        chk.check(code.as_deref(), Some("22012"), "division by zero");
    }

    let note = format!("note {w}/{i}");
    let tx = client.transaction().await?;
    let n = tx.execute(&s.insert, &[&w, &i, &note]).await?;
    chk.check(n, 1, "rows inserted");
    let row = tx.query_one(&s.note, &[&w, &i]).await?;
    chk.check(
        row.get::<_, String>(0),
        note,
        "note read back in the transaction",
    );
    let row = tx.query_one(&s.by_id, &[&id]).await?;
    chk.check(
        row.get::<_, String>(0),
        format!("item-{id}"),
        "row by id in the transaction",
    );
    tx.commit().await
}

async fn tokio_postgres_client(url: String, table: String, w: usize, chk: Arc<Checker>) {
    let (mut client, conn) = match tokio_postgres::connect(&url, NoTls).await {
        Ok(c) => c,
        Err(e) => return chk.problem(format!("ERROR: worker {w}: connect: {e}")),
    };
    let conn = tokio::spawn(conn);
    let stmts = match TpStatements::prepare(&client, &table).await {
        Ok(s) => s,
        Err(e) => return chk.problem(format!("ERROR: worker {w}: prepare: {}", tp_error(&e))),
    };
    let w = w as i32;
    let mut errors = 0;
    let mut committed = 0i64;
    for i in 0..ITERATIONS as i32 {
        match tokio_postgres_round(&mut client, &stmts, &chk, w, i).await {
            Ok(()) => committed += 1,
            Err(e) => {
                chk.problem(format!("ERROR: worker {w} iteration {i}: {}", tp_error(&e)));
                errors += 1;
                if errors >= MAX_ERRORS || client.is_closed() {
                    return;
                }
            }
        }
    }
    match client.query_one(&stmts.count_log, &[&w]).await {
        Ok(row) => chk.check(
            row.get::<_, i64>(0),
            committed,
            &format!("worker {w}: rows committed"),
        ),
        Err(e) => chk.problem(format!("ERROR: worker {w}: {}", tp_error(&e))),
    }
    drop(client);
    let _ = conn.await;
}

async fn run_tokio_postgres(t: Target) -> Outcome {
    rust_clients("tokio-postgres 0.7", |w, chk| {
        tokio_postgres_client(t.url.clone(), t.table.clone(), w, chk)
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokio_postgres_prepared_statements() {
    driver_matrix(DRIVERS[5], "tokiopg", run_tokio_postgres).await;
}

/// A sqlx error as SQLSTATE and message.
fn sqlx_error(e: &sqlx::Error) -> String {
    match e.as_database_error() {
        Some(db) => format!("{} {}", db.code().unwrap_or_default(), db.message()),
        None => e.to_string(),
    }
}

async fn sqlx_round(
    conn: &mut sqlx::PgConnection,
    table: &str,
    chk: &Checker,
    w: i32,
    i: i32,
) -> Result<(), sqlx::Error> {
    let label = format!("w{w}-i{i}-é");
    let row: (i32, String, Option<i64>, f64) =
        sqlx::query_as("SELECT $1::int4 * 2 + $2::int4, $3::text || '!', $4::int8, $5::float8 / 4")
            .bind(w)
            .bind(i)
            .bind(&label)
            .bind(None::<i64>)
            .bind(f64::from(i))
            .fetch_one(&mut *conn)
            .await?;
    chk.check(
        row,
        (w * 2 + i, format!("{label}!"), None, f64::from(i) / 4.0),
        "arithmetic, text, null, float",
    );

    let id = (w * 7 + i) % 100 + 1;
    let by_id = format!("SELECT label, amount FROM {table} WHERE id = $1");
    let row: (String, i64) = sqlx::query_as(&by_id)
        .bind(id)
        .fetch_one(&mut *conn)
        .await?;
    chk.check(row, (format!("item-{id}"), i64::from(id * id)), "row by id");
    let n = i % 100 + 1;
    let agg = format!("SELECT count(*), sum(amount)::int8 FROM {table} WHERE id <= $1");
    let row: (i64, i64) = sqlx::query_as(&agg).bind(n).fetch_one(&mut *conn).await?;
    chk.check(
        row,
        (i64::from(n), sum_of_squares(i64::from(n))),
        "count and sum of squares",
    );

    let k = i % 8;
    let distinct = format!("SELECT $1::int4 + {k}");
    let row: (i32,) = sqlx::query_as(&distinct)
        .bind(i)
        .fetch_one(&mut *conn)
        .await?;
    chk.check(row.0, i + k, "distinct statement");

    let len = i % 5 + 1;
    let rows: Vec<(i32, String)> =
        sqlx::query_as("SELECT g, $1::text || g FROM generate_series(1, $2::int4) g")
            .bind("r")
            .bind(len)
            .fetch_all(&mut *conn)
            .await?;
    let want: Vec<(i32, String)> = (1..=len).map(|j| (j, format!("r{j}"))).collect();
    chk.check(rows, want, "series");

    if i % 10 == 3 {
        let got: Result<(i32,), _> = sqlx::query_as("SELECT 1 / $1::int4")
            .bind(0i32)
            .fetch_one(&mut *conn)
            .await;
        let code = got
            .err()
            .and_then(|e| e.as_database_error()?.code().map(|c| c.into_owned()));
        chk.check(code.as_deref(), Some("22012"), "division by zero");
    }

    let note = format!("note {w}/{i}");
    let mut tx = conn.begin().await?;
    let done = sqlx::query(&format!(
        "INSERT INTO {table}_log (worker, i, note) VALUES ($1, $2, $3)"
    ))
    .bind(w)
    .bind(i)
    .bind(&note)
    .execute(&mut *tx)
    .await?;
    chk.check(done.rows_affected(), 1, "rows inserted");
    let row: (String,) = sqlx::query_as(&format!(
        "SELECT note FROM {table}_log WHERE worker = $1 AND i = $2"
    ))
    .bind(w)
    .bind(i)
    .fetch_one(&mut *tx)
    .await?;
    chk.check(row.0, note, "note read back in the transaction");
    let row: (String, i64) = sqlx::query_as(&by_id).bind(id).fetch_one(&mut *tx).await?;
    chk.check(
        row,
        (format!("item-{id}"), i64::from(id * id)),
        "row by id in the transaction",
    );
    tx.commit().await
}

async fn sqlx_client(url: String, table: String, w: usize, chk: Arc<Checker>) {
    let mut conn = match sqlx::PgConnection::connect(&url).await {
        Ok(c) => c,
        Err(e) => return chk.problem(format!("ERROR: worker {w}: connect: {e}")),
    };
    let w = w as i32;
    let mut errors = 0;
    let mut committed = 0i64;
    for i in 0..ITERATIONS as i32 {
        match sqlx_round(&mut conn, &table, &chk, w, i).await {
            Ok(()) => committed += 1,
            Err(e) => {
                chk.problem(format!(
                    "ERROR: worker {w} iteration {i}: {}",
                    sqlx_error(&e)
                ));
                errors += 1;
                if errors >= MAX_ERRORS {
                    return;
                }
            }
        }
    }
    let count: Result<(i64,), _> = sqlx::query_as(&format!(
        "SELECT count(*) FROM {table}_log WHERE worker = $1"
    ))
    .bind(w)
    .fetch_one(&mut conn)
    .await;
    match count {
        Ok(row) => chk.check(row.0, committed, &format!("worker {w}: rows committed")),
        Err(e) => chk.problem(format!("ERROR: worker {w}: {}", sqlx_error(&e))),
    }
    let _ = conn.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlx_statement_cache() {
    driver_matrix(DRIVERS[6], "sqlx", |t: Target| async move {
        rust_clients("sqlx 0.8", |w, chk| {
            sqlx_client(t.url.clone(), t.table.clone(), w, chk)
        })
        .await
    })
    .await;
}

// ---------------------------------------------------------------------------------------------
// pgbench -S -M prepared
// ---------------------------------------------------------------------------------------------

/// `pgbench -S -M prepared -t 200` with `clients` clients; passes when every transaction
/// was processed and none failed.
async fn pgbench_prepared(db: &str, port: u16, clients: u32) -> Outcome {
    let c = clients.to_string();
    let jobs = clients.min(2).to_string();
    let out = pgbench(
        &[
            "-S", "-M", "prepared", "-c", &c, "-j", &jobs, "-t", "200", db,
        ],
        port,
        PGMEMO_USER,
        PGMEMO_PASS,
    )
    .await;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let expected = format!(
        "number of transactions actually processed: {}/{}",
        clients * 200,
        clients * 200
    );
    let processed = stdout
        .lines()
        .find(|l| l.starts_with("number of transactions actually processed"))
        .unwrap_or("no transactions processed");
    let passed = out.status.success()
        && stdout.contains("number of failed transactions: 0 ")
        && stdout.contains(&expected);
    let first_error = stderr
        .lines()
        .find(|l| l.contains("ERROR") || l.contains("error") || l.contains("aborted"))
        .unwrap_or("");
    Outcome {
        passed,
        summary: if passed {
            format!("-c {clients}: {processed}, 0 failed")
        } else {
            format!(
                "-c {clients}: {processed}; {}",
                shorten(first_error.trim(), 150)
            )
        },
        output: format!("{}\n{stdout}\n{stderr}", out.status),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pgbench_select_only_prepared() {
    let db = "pd_pgbench";
    pgbench_database(db).await;

    let on = async {
        let mut config = test_config(PoolMode::Transaction, 4);
        config.general.prepared_statements = true;
        let proxy = start_pgmemo(config).await;
        let port = proxy.local_addr().port();
        let mut runs = Vec::new();
        for clients in [1, 8, 32] {
            runs.push(pgbench_prepared(db, port, clients).await);
        }
        proxy.shutdown().await;
        runs
    };
    let off = async {
        let mut config = test_config(PoolMode::Transaction, 4);
        config.general.prepared_statements = false;
        let proxy = start_pgmemo(config).await;
        let outcome = pgbench_prepared(db, proxy.local_addr().port(), 8).await;
        proxy.shutdown().await;
        outcome
    };
    let (on, off) = tokio::join!(on, off);
    let on_all = Outcome {
        passed: on.iter().all(|o| o.passed),
        summary: on
            .iter()
            .map(|o| o.summary.as_str())
            .collect::<Vec<_>>()
            .join("; "),
        output: on
            .iter()
            .filter(|o| !o.passed)
            .map(|o| o.output.as_str())
            .collect::<Vec<_>>()
            .join("\n"),
    };
    record(DRIVERS[8], &on_all, &off);
    assert!(
        on_all.passed,
        "pgbench -S -M prepared through pgmemo failed: {}\n{}",
        on_all.summary, on_all.output
    );
}

/// `pgbench -M prepared` with the default TPC-B-like script, 16 clients in one thread, a pool
/// of 8. pgbench prepares each client's statements synchronously before its first
/// transaction; a client waiting for a server there blocks the thread, and with it the other
/// clients that hold servers mid-transaction: through a pooler that must take a server for
/// every Parse this never ends (it did through pgmemo before, and does through PgBouncer 1.25).
/// pgmemo answers the Parse of a statement PostgreSQL already accepted without a server, so
/// after the first client each prepare costs no checkout, and the run completes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pgbench_tpcb_prepared_with_more_clients_than_servers() {
    let db = "pd_pgbench_tpcb";
    // Loaded by the database's owner, so that the script's UPDATEs are allowed through pgmemo.
    pgbench_database_as(db, PGMEMO_USER, PGMEMO_PASS).await;
    let proxy = start_pgmemo(test_config(PoolMode::Transaction, 8)).await;
    let port = proxy.local_addr().port();
    let args = [
        "-n", "-M", "prepared", "-c", "16", "-j", "1", "-t", "50", db,
    ];
    let run = pgbench(&args, port, PGMEMO_USER, PGMEMO_PASS);
    let out = tokio::time::timeout(std::time::Duration::from_secs(120), run)
        .await
        .expect("pgbench -M prepared -c 16 through a pool of 8 stalled");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success()
            && stdout.contains("number of transactions actually processed: 800/800")
            && stdout.contains("number of failed transactions: 0 "),
        "{}\n{stdout}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    proxy.shutdown().await;
}

/// asyncpg prepares on a pool of one server held by another client's transaction: its
/// `Connection.prepare` (Parse, Describe, Flush) of statements a server has prepared and
/// described before gets PostgreSQL's description from pgmemo at once, with no server, the
/// same parameter and column types as a direct connection's; with its statement cache off
/// (the unnamed statement, as behind a pooler) and on (named statements). Without the local
/// answers it would wait for the held server (and the test time out).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn asyncpg_prepares_known_statements_without_a_server() {
    require_python_module("asyncpg", "asyncpg>=0.29").await;
    let sqls = [
        "SELECT $1::int + 1 AS n, 'x'::text AS t",
        "SELECT generate_series(1, $1::int) AS i, $2::numeric AS amount",
    ];
    let prepare = |url: String, named: bool| {
        let mut cmd = Command::new("python3");
        cmd.arg(drivers_dir("python").join("prepare_only_asyncpg.py"));
        if named {
            cmd.arg("--named");
        }
        cmd.arg(url)
            .args(sqls)
            .stdin(Stdio::null())
            .kill_on_drop(true);
        async move {
            let out = tokio::time::timeout(Duration::from_secs(30), cmd.output())
                .await
                .expect("asyncpg's prepare waited for the held server")
                .expect("python3 runs");
            assert!(
                out.status.success(),
                "{}\n{}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            );
            String::from_utf8_lossy(&out.stdout).into_owned()
        }
    };
    let direct = cluster().url(PGMEMO_USER, Some(PGMEMO_PASS), TEST_DB);
    let want = prepare(direct, false).await;
    assert_eq!(want.lines().count(), sqls.len(), "{want}");

    let proxy = start_pgmemo(test_config(PoolMode::Transaction, 1)).await;
    let url = proxy_url(proxy.local_addr(), PGMEMO_USER, Some(PGMEMO_PASS), TEST_DB);
    // A server prepares and describes them once, unnamed and named...
    assert_eq!(prepare(url.clone(), false).await, want);
    assert_eq!(prepare(url.clone(), true).await, want);
    // ... then the only one is held in a transaction.
    let (holder, conn) = tokio_postgres::connect(&url, NoTls).await.unwrap();
    tokio::spawn(conn);
    holder.batch_execute("BEGIN").await.unwrap();
    for named in [false, true] {
        assert_eq!(prepare(url.clone(), named).await, want, "named: {named}");
    }
    let served = serverless_batches(proxy.local_addr()).await;
    assert!(served >= 2 * sqls.len() as u64, "served: {served}");
    holder.batch_execute("COMMIT").await.unwrap();
    proxy.shutdown().await;
}

// ---------------------------------------------------------------------------------------------
// Constant eviction
// ---------------------------------------------------------------------------------------------

/// The same workload with `max_prepared_statements = 1`: each client uses about 15 distinct
/// statements, and batches and transactions need several at once, so the servers close
/// statements and prepare them again all the time, inside pipelines and transactions too.
/// Four drivers at once, each on its own pgmemo.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drivers_under_constant_eviction() {
    build_pgx().await;
    require_python_module("psycopg", "psycopg[binary]>=3.1").await;
    npm_install().await;
    let evicting = |key: &str| {
        let mut config = driver_config(true);
        config.general.max_prepared_statements = 1;
        (format!("pd_{key}_evict"), config)
    };
    let ((t1, c1), (t2, c2), (t3, c3), (t4, c4)) = (
        evicting("pgx"),
        evicting("psycopg0"),
        evicting("nodepg"),
        evicting("tokiopg"),
    );
    let (pgx, psycopg, node, tokio_pg) = tokio::join!(
        run_once(t1, c1, run_pgx),
        run_once(t2, c2, |t| run_psycopg("0", t)),
        run_once(t3, c3, run_node),
        run_once(t4, c4, run_tokio_postgres),
    );
    let runs = [
        ("Go pgx v5", pgx),
        ("psycopg 3 (prepare_threshold=0)", psycopg),
        ("node-postgres", node),
        ("tokio-postgres", tokio_pg),
    ];
    for (driver, outcome) in &runs {
        println!(
            "max_prepared_statements = 1: {driver}: {} ({})",
            if outcome.passed { "PASS" } else { "FAIL" },
            outcome.summary
        );
    }
    for (driver, outcome) in &runs {
        assert!(
            outcome.passed,
            "{driver} with max_prepared_statements = 1 failed: {}\n{}",
            outcome.summary,
            outcome
                .output
                .lines()
                .take(60)
                .collect::<Vec<_>>()
                .join("\n")
        );
    }
}

// ---------------------------------------------------------------------------------------------
// A DDL that changes the result of prepared statements
// ---------------------------------------------------------------------------------------------
//
// Two clients prepare `SELECT * FROM t WHERE id = $1` on (id, a, b) and run it; then, directly
// on PostgreSQL, columns a and b swap names, so the statement's result changes (same types,
// other names). With PostgreSQL directly every client's statement answers 0A000 ("cached plan
// must not change result type") until the driver prepares it again, which some drivers do
// (pgx) and some never do (tokio-postgres). Through pgmemo a driver must see the same: never
// rows of the new shape under the description it cached for the old one.

/// Runs `transcript` (given a URL and a name prefix for the objects it creates) against
/// PostgreSQL directly and through pgmemo in transaction mode, and compares what it saw.
async fn same_as_postgresql<F, Fut>(scenario: &str, prefixes: [&str; 2], transcript: F)
where
    F: Fn(String, String) -> Fut,
    Fut: Future<Output = Vec<String>>,
{
    let direct_url = cluster().url(PGMEMO_USER, Some(PGMEMO_PASS), TEST_DB);
    let direct = transcript(direct_url, prefixes[0].to_owned()).await;
    let proxy = pgmemo(PoolMode::Transaction, POOL_SIZE).await;
    let url = proxy_url(proxy.local_addr(), PGMEMO_USER, Some(PGMEMO_PASS), TEST_DB);
    let through = transcript(url, prefixes[1].to_owned()).await;
    proxy.shutdown().await;
    assert_same_transcript(scenario, &direct, &through);
}

/// Compares what a driver saw in a scenario directly and through pgmemo, printing both.
fn assert_same_transcript(scenario: &str, direct: &[String], through: &[String]) {
    let mut table = String::new();
    for i in 0..direct.len().max(through.len()) {
        let d = direct.get(i).map_or("", String::as_str);
        let t = through.get(i).map_or("", String::as_str);
        let mark = if d == t { " " } else { "≠" };
        table.push_str(&format!("{mark} direct: {d}\n  pgmemo: {t}\n"));
    }
    println!("{scenario}:\n{table}");
    assert!(
        direct == through,
        "{scenario}: through pgmemo the driver sees something else than directly:\n{table}"
    );
}

fn tp_outcome(result: Result<tokio_postgres::Row, tokio_postgres::Error>) -> String {
    match result {
        Ok(row) => {
            let cols: Vec<String> = row
                .columns()
                .iter()
                .enumerate()
                .map(|(i, c)| match c.type_() {
                    &tokio_postgres::types::Type::INT4 => {
                        format!("{}={:?}", c.name(), row.try_get::<_, i32>(i).ok())
                    }
                    _ => format!(
                        "{}={}",
                        c.name(),
                        row.try_get::<_, String>(i)
                            .unwrap_or_else(|e| format!("<{e}>"))
                    ),
                })
                .collect();
            format!("OK {}", cols.join(" "))
        }
        Err(e) => format!("ERROR {}", tp_error(&e)),
    }
}

/// The tokio-postgres side of the DDL scenario, through `url`.
async fn tokio_postgres_ddl_transcript(url: &str, table: &str) -> Vec<String> {
    let direct_url = cluster().url(PGMEMO_USER, Some(PGMEMO_PASS), TEST_DB);
    let (direct, conn) = tokio_postgres::connect(&direct_url, NoTls).await.unwrap();
    tokio::spawn(conn);
    direct
        .batch_execute(&format!(
            "DROP TABLE IF EXISTS {table}; CREATE TABLE {table} (id int, a text, b text);
             INSERT INTO {table} VALUES (1, 'value-of-a', 'value-of-b')"
        ))
        .await
        .unwrap();
    let query = format!("SELECT * FROM {table} WHERE id = $1");
    let mut clients = Vec::new();
    for _ in 0..2 {
        let (c, conn) = tokio_postgres::connect(url, NoTls).await.unwrap();
        tokio::spawn(conn);
        let stmt = c.prepare(&query).await.unwrap();
        clients.push((c, stmt));
    }
    let mut transcript = Vec::new();
    for round in 0..2 {
        for (n, (c, stmt)) in clients.iter().enumerate() {
            let got = tp_outcome(c.query_one(stmt, &[&1i32]).await);
            transcript.push(format!("before, round {round}, client {n}: {got}"));
        }
    }
    direct
        .batch_execute(&format!(
            "ALTER TABLE {table} RENAME COLUMN a TO tmp; ALTER TABLE {table} RENAME COLUMN b TO a;
             ALTER TABLE {table} RENAME COLUMN tmp TO b"
        ))
        .await
        .unwrap();
    for round in 0..3 {
        for (n, (c, stmt)) in clients.iter().enumerate() {
            let got = tp_outcome(c.query_one(stmt, &[&1i32]).await);
            transcript.push(format!("after, round {round}, client {n}: {got}"));
        }
    }
    let (late, conn) = tokio_postgres::connect(url, NoTls).await.unwrap();
    tokio::spawn(conn);
    let stmt = late.prepare(&query).await.unwrap();
    let got = tp_outcome(late.query_one(&stmt, &[&1i32]).await);
    transcript.push(format!("after, a new client: {got}"));
    transcript
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokio_postgres_ddl_like_postgresql() {
    same_as_postgresql(
        "tokio-postgres, a DDL changes a prepared statement's result",
        ["ddl_tp_direct", "ddl_tp_pgmemo"],
        |url, prefix| async move { tokio_postgres_ddl_transcript(&url, &prefix).await },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pgx_v5_ddl_like_postgresql() {
    let bin = build_pgx().await;
    let direct_url = cluster().url(PGMEMO_USER, Some(PGMEMO_PASS), TEST_DB);
    let transcript = |url: String, table: &'static str| {
        let (bin, direct_url) = (bin.clone(), direct_url.clone());
        async move {
            let out = Command::new(&bin)
                .args(["ddl", &direct_url, &url, table])
                .stdin(Stdio::null())
                .kill_on_drop(true)
                .output()
                .await
                .expect("run pgx-check ddl");
            assert!(
                out.status.success(),
                "pgx-check ddl: {}\n{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            String::from_utf8_lossy(&out.stdout)
                .lines()
                .map(str::to_owned)
                .collect::<Vec<_>>()
        }
    };
    let direct = transcript(direct_url.clone(), "ddl_pgx_direct").await;
    let proxy = pgmemo(PoolMode::Transaction, POOL_SIZE).await;
    let url = proxy_url(proxy.local_addr(), PGMEMO_USER, Some(PGMEMO_PASS), TEST_DB);
    let through = transcript(url, "ddl_pgx_pgmemo").await;
    proxy.shutdown().await;
    assert_same_transcript(
        "pgx v5, a DDL changes a prepared statement's result",
        &direct,
        &through,
    );
}

// ---------------------------------------------------------------------------------------------
// The same text under different search_paths
// ---------------------------------------------------------------------------------------------
//
// Schemas <p>1 and <p>2 each have a table `items`, with an int4 column in one and a text
// column in the other, so that `SELECT v FROM items` means different statements with different
// results depending on search_path.

async fn create_search_path_schemas(prefix: &str) {
    let url = cluster().url(PGMEMO_USER, Some(PGMEMO_PASS), TEST_DB);
    let (direct, conn) = tokio_postgres::connect(&url, NoTls).await.unwrap();
    tokio::spawn(conn);
    direct
        .batch_execute(&format!(
            "DROP SCHEMA IF EXISTS {prefix}1 CASCADE; DROP SCHEMA IF EXISTS {prefix}2 CASCADE;
             CREATE SCHEMA {prefix}1; CREATE SCHEMA {prefix}2;
             CREATE TABLE {prefix}1.items (v int4); INSERT INTO {prefix}1.items VALUES (1);
             CREATE TABLE {prefix}2.items (v text); INSERT INTO {prefix}2.items VALUES ('two');"
        ))
        .await
        .unwrap();
}

/// A client whose startup packet sets search_path to `schema`.
async fn connect_with_search_path(url: &str, schema: &str) -> Client {
    let (c, conn) =
        tokio_postgres::connect(&format!("{url}?options=-csearch_path%3D{schema}"), NoTls)
            .await
            .unwrap();
    tokio::spawn(conn);
    c
}

/// What a prepared `SELECT v FROM items` gives: its column type and value.
async fn items_outcome(c: &impl tokio_postgres::GenericClient) -> String {
    match c.prepare("SELECT v FROM items").await {
        Err(e) => format!("prepare: ERROR {}", tp_error(&e)),
        Ok(s) => {
            let ty = s.columns()[0].type_().clone();
            match c.query_one(&s, &[]).await {
                Err(e) => format!("{ty}: ERROR {}", tp_error(&e)),
                Ok(row) if ty == tokio_postgres::types::Type::INT4 => {
                    format!(
                        "{ty}: {:?}",
                        row.try_get::<_, i32>(0).map_err(|e| e.to_string())
                    )
                }
                Ok(row) => format!(
                    "{ty}: {:?}",
                    row.try_get::<_, String>(0).map_err(|e| e.to_string())
                ),
            }
        }
    }
}

/// Clients whose startup search_paths differ, preparing and running the same text in turns.
async fn startup_search_path_transcript(url: &str, prefix: &str) -> Vec<String> {
    create_search_path_schemas(prefix).await;
    let mut clients = Vec::new();
    for n in 0..4 {
        let schema = format!("{prefix}{}", n % 2 + 1);
        clients.push((schema.clone(), connect_with_search_path(url, &schema).await));
    }
    let mut transcript = Vec::new();
    for round in 0..3 {
        for (n, (schema, c)) in clients.iter().enumerate() {
            let got = items_outcome(c).await;
            let schema = &schema[prefix.len()..];
            transcript.push(format!(
                "round {round}, client {n} (schema {schema}): {got}"
            ));
        }
    }
    transcript
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn startup_search_path_like_postgresql() {
    same_as_postgresql(
        "tokio-postgres, startup search_path",
        ["spd", "spp"],
        |url, prefix| async move { startup_search_path_transcript(&url, &prefix).await },
    )
    .await;
}

/// A client of schema 1 prepares the text; then another client of schema 1 switches to
/// schema 2 with `SET LOCAL search_path` inside a transaction and prepares the same text.
async fn set_local_search_path_transcript(url: &str, prefix: &str) -> Vec<String> {
    create_search_path_schemas(prefix).await;
    let first = connect_with_search_path(url, &format!("{prefix}1")).await;
    let mut transcript = vec![format!("schema 1: {}", items_outcome(&first).await)];
    let mut other = connect_with_search_path(url, &format!("{prefix}1")).await;
    let tx = other.transaction().await.unwrap();
    tx.batch_execute(&format!("SET LOCAL search_path = {prefix}2"))
        .await
        .unwrap();
    transcript.push(format!(
        "SET LOCAL search_path to schema 2: {}",
        items_outcome(&tx).await
    ));
    drop(tx);
    transcript.push(format!(
        "after the transaction, schema 1 again: {}",
        items_outcome(&other).await
    ));
    transcript
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn set_local_search_path_like_postgresql() {
    same_as_postgresql(
        "tokio-postgres, SET LOCAL search_path",
        ["sld", "slp"],
        |url, prefix| async move { set_local_search_path_transcript(&url, &prefix).await },
    )
    .await;
}
