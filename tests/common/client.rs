//! Small helpers for tests that talk through a real driver (tokio-postgres).

use super::cluster::*;
use std::future::Future;
use std::time::{Duration, Instant};
use tokio_postgres::{Client, NoTls};

/// The first column of the first row `sql` returns (`NULL`, or `no row`), as text.
pub async fn first_value(client: &Client, sql: &str) -> String {
    let messages = client.simple_query(sql).await.unwrap();
    messages
        .iter()
        .find_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(r) => {
                Some(r.get(0).unwrap_or("NULL").to_owned())
            }
            _ => None,
        })
        .unwrap_or_else(|| "no row".into())
}

/// A tokio-postgres client for `url`; its connection runs on a spawned task.
pub async fn connect(url: &str) -> Client {
    let (client, conn) = tokio_postgres::connect(url, NoTls)
        .await
        .unwrap_or_else(|e| panic!("connect {url}: {e:?}"));
    tokio::spawn(async move {
        let _ = conn.await;
    });
    client
}

/// A new, empty database `name` owned by the `pgmemo` role (dropped first if it exists).
pub async fn fresh_db(name: &'static str) {
    tokio::task::spawn_blocking(move || {
        cluster().psql(
            "postgres",
            &format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"),
        );
        cluster().psql(
            "postgres",
            &format!("CREATE DATABASE {name} OWNER {PGMEMO_USER}"),
        );
    })
    .await
    .unwrap();
}

/// Polls `cond` until it holds, failing the test after `timeout`: waiting for a condition,
/// never sleeping as synchronisation.
pub async fn wait_until<F, Fut>(what: &str, timeout: Duration, mut cond: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if cond().await {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {timeout:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Runs the cluster's own pgbench against 127.0.0.1:`port` as `user`.
pub async fn pgbench(args: &[&str], port: u16, user: &str, password: &str) -> std::process::Output {
    let bin = cluster().bin_dir().join("pgbench");
    let mut cmd = tokio::process::Command::new(&bin);
    cmd.args(args)
        .args(["-h", "127.0.0.1", "-p", &port.to_string(), "-U", user])
        .env("PGPASSWORD", password)
        .env_remove("PGSERVICE")
        .env_remove("PGDATABASE")
        .stdin(std::process::Stdio::null())
        .kill_on_drop(true);
    cmd.output().await.expect("run pgbench")
}

/// A fresh database `name` with pgbench's tables (`pgbench -i -s 1`), loaded directly.
pub async fn pgbench_database(name: &'static str) {
    pgbench_database_as(name, SUPERUSER, SUPERUSER_PASS).await
}

/// [`pgbench_database`] with the tables made by `user` (who then owns them).
pub async fn pgbench_database_as(name: &'static str, user: &str, password: &str) {
    fresh_db(name).await;
    let init = pgbench(
        &["-i", "-s", "1", "-q", name],
        cluster().port(),
        user,
        password,
    )
    .await;
    assert!(
        init.status.success(),
        "pgbench -i: {}",
        String::from_utf8_lossy(&init.stderr)
    );
}

/// A client of pgmemo's admin console at `addr`, as the `pgmemo` role.
pub async fn admin_console(addr: std::net::SocketAddr) -> Client {
    connect(&super::proxy_url(
        addr,
        PGMEMO_USER,
        Some(PGMEMO_PASS),
        "pgmemo",
    ))
    .await
}

/// The rows of an admin console command, column name → value.
pub async fn admin_rows(
    admin: &Client,
    command: &str,
) -> Vec<std::collections::HashMap<String, String>> {
    admin
        .simple_query(command)
        .await
        .unwrap()
        .iter()
        .filter_map(|m| match m {
            tokio_postgres::SimpleQueryMessage::Row(r) => Some(
                r.columns()
                    .iter()
                    .enumerate()
                    .map(|(i, c)| (c.name().to_owned(), r.get(i).unwrap_or("").to_owned()))
                    .collect(),
            ),
            _ => None,
        })
        .collect()
}

/// The batches pgmemo at `addr` answered without a server for the test database
/// (`SHOW STATS` `serverless_batches`).
pub async fn serverless_batches(addr: std::net::SocketAddr) -> u64 {
    let admin = admin_console(addr).await;
    admin_rows(&admin, "SHOW STATS")
        .await
        .iter()
        .filter(|r| r["database"] == super::TEST_DB)
        .map(|r| r["serverless_batches"].parse::<u64>().unwrap())
        .sum()
}

/// Waits until pgmemo's pool of `database` is back to normal: nobody waiting and no server
/// linked to a client (SHOW POOLS, through the admin console `admin`), and no backend of
/// `database` but `direct`'s own running or in a transaction (pg_stat_activity, through
/// `direct`, a client of PostgreSQL itself).
pub async fn wait_pool_normal(admin: &Client, direct: &Client, database: &str) {
    let busy_sql = format!(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = '{database}' \
         AND backend_type = 'client backend' AND state <> 'idle' AND pid <> pg_backend_pid()"
    );
    wait_until(
        "the pool to be back to normal",
        Duration::from_secs(60),
        || async {
            let pools = admin_rows(admin, "SHOW POOLS").await;
            let mut ours = pools
                .iter()
                .filter(|r| r["database"] == database)
                .peekable();
            let quiet = ours.peek().is_some()
                && ours.all(|r| r["cl_waiting"] == "0" && r["sv_active"] == "0");
            let busy = direct.simple_query(&busy_sql).await.unwrap();
            let busy = busy.iter().find_map(|m| match m {
                tokio_postgres::SimpleQueryMessage::Row(r) => r.get(0).map(str::to_owned),
                _ => None,
            });
            quiet && busy.as_deref() == Some("0")
        },
    )
    .await;
}

/// Whether `program` with `args` runs and exits successfully (a tool or a module is there).
pub async fn succeeds(program: &str, args: &[&str]) -> bool {
    tokio::process::Command::new(program)
        .args(args)
        .stdin(std::process::Stdio::null())
        .output()
        .await
        .is_ok_and(|o| o.status.success())
}

/// Runs `cmd` to prepare a driver or an app (a build, a package install); panics with `hint`
/// and the output when it fails.
pub async fn prepare_step(mut cmd: tokio::process::Command, hint: &str) {
    cmd.stdin(std::process::Stdio::null()).kill_on_drop(true);
    let out = cmd
        .output()
        .await
        .unwrap_or_else(|e| panic!("{hint}: could not run {cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{hint}: {cmd:?} failed ({}):\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The time `path` or the newest file under it was changed.
pub fn newest_mtime(path: &std::path::Path) -> std::time::SystemTime {
    let mut newest = std::time::SystemTime::UNIX_EPOCH;
    let mut stack = vec![path.to_path_buf()];
    while let Some(p) = stack.pop() {
        let Ok(meta) = std::fs::metadata(&p) else {
            continue;
        };
        if meta.is_dir() {
            if let Ok(entries) = std::fs::read_dir(&p) {
                stack.extend(entries.flatten().map(|e| e.path()));
            }
        } else if let Ok(m) = meta.modified() {
            newest = newest.max(m);
        }
    }
    newest
}

/// tests/drivers/java's jar (pgjdbc shaded in), built with Maven into the cargo target dir
/// when its sources (`src/`, `pom.xml`) are newer.
pub async fn pgjdbc_jar() -> std::path::PathBuf {
    let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/drivers/java");
    let build_dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("java-driver");
    let jar = build_dir.join("pgjdbc-check.jar");
    let built = std::fs::metadata(&jar).and_then(|m| m.modified()).ok();
    let sources = newest_mtime(&src.join("src")).max(newest_mtime(&src.join("pom.xml")));
    if built.is_none_or(|b| b < sources) {
        let mut build = tokio::process::Command::new("mvn");
        build
            .args([
                "-q",
                "-B",
                "package",
                "-Dmaven.test.skip=true",
                "-Dstyle.color=never",
            ])
            .arg(format!("-Dpgmemo.buildDir={}", build_dir.display()))
            .arg("-f")
            .arg(src.join("pom.xml"));
        prepare_step(
            build,
            "building tests/drivers/java with Maven (mvn and Maven Central are needed; \
             scripts/setup builds it)",
        )
        .await;
    }
    jar
}
