//! Online restart and shutdown signals (issue 36, item 4), with the pgmemo binary as an
//! operator runs it:
//! - `pgmemo --takeover` takes over the running pgmemo's listening sockets and its clients:
//!   pgbench (simple and prepared, reads and TPC-B writes) runs across two restarts with no
//!   failed transaction and no reconnect;
//! - a client keeps what it set up in its session (settings, search_path, prepared
//!   statements of both kinds, its cancel key) and cannot tell the new process from the old;
//! - a client in a transaction finishes it in the old process, which exits after; a cancel
//!   request for it, arriving at the new process, is passed back to the old one;
//! - the new process's result cache holds back until the old one has exited, so no write
//!   made through the old process is read stale through the new one;
//! - `--takeover` with no pgmemo running starts as usual;
//! - under systemd, each process reports itself ready as the main one (`sd_notify`);
//! - SIGTERM waits for the clients to leave, SIGINT for the transactions, a second signal
//!   or SIGQUIT exits at once, as PgBouncer 1.23+ does.

mod common;

use common::*;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_pgmemo");

/// A pgmemo process started from a config file, killed (and reaped) on drop.
type Process = LoggedChild;

/// Ways of starting pgmemo for these tests, and of waiting for it.
impl LoggedChild {
    fn start_config(config: &Path, log: PathBuf, takeover: bool, notify: Option<&Path>) -> Process {
        let mut cmd = Command::new(BIN);
        match notify {
            Some(socket) => cmd.env("NOTIFY_SOCKET", socket),
            None => cmd.env_remove("NOTIFY_SOCKET"),
        };
        cmd.arg("--config").arg(config).env("PGMEMO_LOG", "info");
        if takeover {
            cmd.arg("--takeover");
        }
        LoggedChild::start(&mut cmd, log)
    }

    fn running(&mut self) -> bool {
        self.exit_status().is_none()
    }

    /// Waits for the process to exit on its own; its exit status.
    async fn exited(&mut self, what: &str) -> std::process::ExitStatus {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(status) = self.exit_status() {
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "{what}: pgmemo did not exit:\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Waits until the log has a line containing `text`.
    async fn logged(&mut self, text: &str) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while !self.log().contains(text) {
            assert!(
                self.running(),
                "pgmemo ({}) exited before logging {text:?}:\n{}",
                self.log.display(),
                self.log()
            );
            assert!(
                Instant::now() < deadline,
                "no {text:?} in the log:\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// A configuration file for pgmemo on `port`, in `dir`, serving the test cluster.
fn write_config(dir: &Path, port: u16) -> PathBuf {
    let c = cluster();
    let path = dir.join("pgmemo.toml");
    std::fs::write(
        &path,
        format!(
            r#"
[general]
listen = "127.0.0.1:{port}"
auth_type = "trust"
default_pool_size = 4
shutdown_timeout = 20
admin_users = ["{PGMEMO_USER}"]
takeover_socket = "{dir}/takeover"

[upstream]
url = "postgres://{PGMEMO_USER}:{PGMEMO_PASS}@127.0.0.1:{cport}/{TEST_DB}"

[databases."*"]
user = "{PGMEMO_USER}"
password = "{PGMEMO_PASS}"
"#,
            dir = dir.display(),
            cport = c.port(),
        ),
    )
    .unwrap();
    path
}

/// Starts pgmemo and waits until it serves a query.
async fn start(dir: &Path, port: u16, name: &str, takeover: bool) -> Process {
    start_with(dir, port, name, takeover, "").await
}

/// [`start`] with `extra` appended to the configuration file.
async fn start_with(dir: &Path, port: u16, name: &str, takeover: bool, extra: &str) -> Process {
    let config = write_config(dir, port);
    let mut text = std::fs::read_to_string(&config).unwrap();
    text.push_str(extra);
    std::fs::write(&config, text).unwrap();
    let notify = dir.join("notify");
    let notify = notify.exists().then_some(notify.as_path());
    let mut p = Process::start_config(&config, dir.join(format!("{name}.log")), takeover, notify);
    p.logged("pgmemo listening").await;
    p
}

fn url(port: u16, db: &str) -> String {
    format!("host=127.0.0.1 port={port} user={PGMEMO_USER} dbname={db}")
}

/// Runs `pg_sleep(seconds)` on `client`, cancels it with `cancel` once PostgreSQL runs it,
/// and asserts it ended with 57014.
async fn assert_cancelled(
    client: std::sync::Arc<tokio_postgres::Client>,
    cancel: &tokio_postgres::CancelToken,
    seconds: u32,
) {
    let sql = format!("SELECT pg_sleep({seconds})");
    let sleeping = tokio::spawn({
        let sql = sql.clone();
        async move { client.simple_query(&sql).await }
    });
    let running = format!("SELECT count(*) FROM pg_stat_activity WHERE query = '{sql}'");
    wait_until("the query to run", Duration::from_secs(10), || async {
        cluster().psql("postgres", &running).trim() == "1"
    })
    .await;
    cancel.cancel_query(tokio_postgres::NoTls).await.unwrap();
    let err = sleeping.await.unwrap().expect_err("cancelled");
    assert_eq!(
        err.code(),
        Some(&tokio_postgres::error::SqlState::QUERY_CANCELED)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pgbench_runs_across_two_restarts_without_a_failure() {
    pgbench_database("restart_bench").await;
    let dir = TempDir::new("restart", "pgbench");
    let port = free_port();
    let mut first = start(&dir, port, "first", false).await;
    let run = |mode: &'static str, script: &'static [&'static str]| {
        let mut args = vec!["-n", "-c", "4", "-j", "2", "-T", "6", "-M", mode];
        args.extend_from_slice(script);
        args.push("restart_bench");
        tokio::spawn(async move { pgbench(&args, port, PGMEMO_USER, "").await })
    };
    // Point reads in the simple protocol, and TPC-B's writing transactions with prepared
    // statements.
    let reads = run("simple", &["-S"]);
    let writes = run("prepared", &[]);
    tokio::time::sleep(Duration::from_secs(2)).await; // let pgbench run a while first
    let mut second = start(&dir, port, "second", true).await;
    second.logged("takeover complete").await;
    assert!(first.exited("first").await.success(), "{}", first.log());
    tokio::time::sleep(Duration::from_secs(2)).await;
    let mut third = start(&dir, port, "third", true).await;
    third.logged("takeover complete").await;
    assert!(second.exited("second").await.success(), "{}", second.log());
    for (what, run) in [("-S simple", reads), ("TPC-B prepared", writes)] {
        let out = run.await.unwrap();
        let (stdout, stderr) = (
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
        );
        // pgbench never reconnects: a client whose connection closed aborts, and the run
        // fails.
        assert!(
            out.status.success()
                && stdout.contains("number of failed transactions: 0")
                && !stderr.contains("aborted"),
            "pgbench {what} across the restarts:\n{stdout}\n{stderr}"
        );
    }
    // Every client went over each time: the old processes served 8 and handed 8 over.
    for p in [&first, &second] {
        assert!(p.log().contains("takeover: done clients=8"), "{}", p.log());
    }
    assert!(third.log().contains("clients=8"), "{}", third.log());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_keeps_its_session_across_a_restart() {
    fresh_db("restart_session").await;
    let dir = TempDir::new("restart", "session");
    let port = free_port();
    let mut old = start(&dir, port, "old", false).await;
    let client = connect(&url(port, "restart_session")).await;
    client
        .batch_execute(
            "CREATE SCHEMA kept; CREATE TABLE kept.t (id int PRIMARY KEY, note text);
             INSERT INTO kept.t VALUES (1, 'one'), (2, 'two');
             SET application_name = 'kept_app';
             SET search_path = kept, public;
             SET restart.custom = 'custom value';
             SET DateStyle = 'SQL, DMY';
             PREPARE sql_level (int) AS SELECT note FROM t WHERE id = $1;",
        )
        .await
        .unwrap();
    let statement = client
        .prepare("SELECT note || $1::text FROM t WHERE id = $2")
        .await
        .unwrap();
    let cancel = client.cancel_token();
    let state = "SELECT current_setting('application_name'), current_setting('search_path'), \
                 current_setting('restart.custom'), current_setting('DateStyle'), \
                 to_char(date '2026-11-27', 'DD/MM/YYYY') || ' ' || date '2026-11-27'";
    let read = |rows: Vec<tokio_postgres::Row>| -> Vec<String> {
        (0..5).map(|i| rows[0].get::<_, String>(i)).collect()
    };
    let before = read(client.query(state, &[]).await.unwrap());
    assert_eq!(before[0], "kept_app");

    let mut new = start(&dir, port, "new", true).await;
    new.logged("takeover complete").await;
    assert!(old.exited("old").await.success(), "{}", old.log());

    // Same settings, same statements, read through the new process.
    let after = read(client.query(state, &[]).await.unwrap());
    assert_eq!(after, before);
    let row = client.query_one(&statement, &[&"!", &2i32]).await.unwrap();
    assert_eq!(row.get::<_, String>(0), "two!");
    let rows = client.simple_query("EXECUTE sql_level(1)").await.unwrap();
    let note = rows.iter().find_map(|m| match m {
        tokio_postgres::SimpleQueryMessage::Row(r) => r.get(0).map(str::to_owned),
        _ => None,
    });
    assert_eq!(note.as_deref(), Some("one"));
    // The new process shows it as the old one did.
    let admin = admin_console(([127, 0, 0, 1], port).into()).await;
    let clients = admin_rows(&admin, "SHOW CLIENTS").await;
    assert!(
        clients
            .iter()
            .any(|c| c.get("application_name").map(String::as_str) == Some("kept_app")),
        "{clients:?}"
    );
    // The cancel key it was given before the restart cancels its query now.
    assert_cancelled(std::sync::Arc::new(client), &cancel, 30).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_finishes_in_the_old_process() {
    fresh_db("restart_tx").await;
    let dir = TempDir::new("restart", "tx");
    let port = free_port();
    let mut old = start(&dir, port, "old", false).await;
    let client = connect(&url(port, "restart_tx")).await;
    client
        .batch_execute("CREATE TABLE t (id int); BEGIN; INSERT INTO t VALUES (1); SAVEPOINT s;")
        .await
        .unwrap();
    let client = std::sync::Arc::new(client);
    let mut new = start(&dir, port, "new", true).await;
    new.logged("took over the listening sockets").await;
    // New clients reach the new process meanwhile.
    let other = connect(&url(port, "restart_tx")).await;
    other.simple_query("SELECT 1").await.unwrap();
    // The old process waits for the open transaction.
    assert!(
        old.running(),
        "the old process left a transaction open:\n{}",
        old.log()
    );
    // A cancel request reaches the new process, which passes it to the old one.
    assert_cancelled(client.clone(), &client.cancel_token(), 31).await;
    assert!(old.running());
    client
        .batch_execute("ROLLBACK TO s; INSERT INTO t VALUES (2); COMMIT;")
        .await
        .unwrap();
    assert!(old.exited("old").await.success(), "{}", old.log());
    let n: i64 = client
        .query_one("SELECT count(*) FROM t", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(n, 2);
    new.logged("takeover complete").await;
}

/// A new process that dies after it took the listeners over, while the old one still has a
/// client in a transaction: the old process accepts again and keeps its clients, and a later
/// takeover works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_old_process_serves_on_when_the_new_one_dies() {
    let dir = TempDir::new("restart", "dies");
    let port = free_port();
    let mut old = start(&dir, port, "old", false).await;
    let client = connect(&url(port, TEST_DB)).await;
    client.batch_execute("BEGIN; SELECT 1").await.unwrap();
    let mut doomed = start(&dir, port, "doomed", true).await;
    doomed.logged("took over the listening sockets").await;
    doomed.signal(libc::SIGKILL);
    let _ = doomed.exited("killed").await;
    old.logged("accepting again").await;
    old.logged("listening for another takeover").await;
    // New clients reach the old process again, and its client finishes its transaction there.
    let another = connect(&url(port, TEST_DB)).await;
    another
        .simple_query("SELECT 1")
        .await
        .expect("accepting again");
    client.batch_execute("COMMIT").await.unwrap();
    client.simple_query("SELECT 1").await.expect("still served");
    assert!(old.running(), "{}", old.log());
    // A second takeover goes through: both clients move.
    let mut new = start(&dir, port, "new", true).await;
    new.logged("takeover complete").await;
    assert!(old.exited("old").await.success(), "{}", old.log());
    assert!(
        old.log().contains("takeover: done clients=2"),
        "{}",
        old.log()
    );
    client
        .simple_query("SELECT 1")
        .await
        .expect("served by the new process");
    another
        .simple_query("SELECT 1")
        .await
        .expect("served by the new process");
}

/// A new process that cannot start (here: TLS files that do not load) fails before it asks
/// for anything: the old one keeps its listeners and its clients.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_process_that_cannot_start_takes_nothing_over() {
    let dir = TempDir::new("restart", "broken");
    let port = free_port();
    let mut old = start(&dir, port, "old", false).await;
    let client = connect(&url(port, TEST_DB)).await;
    let config = write_config(&dir, port);
    let mut text = std::fs::read_to_string(&config).unwrap();
    let missing = dir.join("missing.pem");
    text = text.replacen(
        "[general]\n",
        &format!(
            "[general]\ntls_cert_file = \"{m}\"\ntls_key_file = \"{m}\"\n",
            m = missing.display()
        ),
        1,
    );
    std::fs::write(&config, text).unwrap();
    let mut new = Process::start_config(&config, dir.join("new.log"), true, None);
    let status = new.exited("the broken new process").await;
    assert!(!status.success(), "{}", new.log());
    assert!(!old.log().contains("takeover"), "{}", old.log());
    assert!(old.running());
    client.simple_query("SELECT 1").await.expect("still served");
    let another = connect(&url(port, TEST_DB)).await;
    another
        .simple_query("SELECT 1")
        .await
        .expect("still accepting");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn takeover_with_nothing_running_starts_as_usual() {
    let dir = TempDir::new("restart", "alone");
    let port = free_port();
    let mut p = start(&dir, port, "alone", true).await;
    assert!(p.log().contains("no pgmemo answers there"), "{}", p.log());
    let client = connect(&url(port, TEST_DB)).await;
    client.simple_query("SELECT 1").await.unwrap();
    assert!(p.running());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn signals_shut_down_as_pgbouncer_does() {
    let dir = TempDir::new("restart", "signals");
    // SIGTERM: no new clients, the connected ones are served until they leave.
    let port = free_port();
    let mut p = start(&dir, port, "term", false).await;
    let client = connect(&url(port, TEST_DB)).await;
    p.signal(libc::SIGTERM);
    wait_until("the listener to close", Duration::from_secs(10), || async {
        tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_err()
    })
    .await;
    client.simple_query("SELECT 1").await.expect("still served");
    assert!(p.running());
    drop(client);
    assert!(p.exited("SIGTERM").await.success(), "{}", p.log());

    // SIGINT: an idle client is closed, and pgmemo exits.
    let port = free_port();
    let mut p = start(&dir, port, "int", false).await;
    let client = connect(&url(port, TEST_DB)).await;
    p.signal(libc::SIGINT);
    assert!(p.exited("SIGINT").await.success(), "{}", p.log());
    assert!(client.simple_query("SELECT 1").await.is_err());

    // SIGTERM, then SIGTERM again: the second does not wait for the client.
    let port = free_port();
    let mut p = start(&dir, port, "twice", false).await;
    let client = connect(&url(port, TEST_DB)).await;
    p.signal(libc::SIGTERM);
    p.logged("SIGTERM: shutting down once every client has disconnected")
        .await;
    p.signal(libc::SIGTERM);
    assert!(p.exited("second SIGTERM").await.success(), "{}", p.log());
    assert!(client.simple_query("SELECT 1").await.is_err());
}

/// The new process caches nothing while the old one still serves clients: a write made
/// through the old process (which the new one's invalidation does not see) is read by the
/// new process's clients, the writer's included, once it moves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_new_process_serves_no_result_the_old_one_made_stale() {
    fresh_db("restart_cache").await;
    let dir = TempDir::new("restart", "cache");
    let port = free_port();
    let cache = r#"
[cache]
enabled = true

[[cache.rules]]
name = "ryw"
query_contains = "FROM ryw"
ttl = "60s"
"#;
    let mut old = start_with(&dir, port, "old", false, cache).await;
    let writer = connect(&url(port, "restart_cache")).await;
    writer
        .batch_execute(
            "CREATE TABLE ryw (id int PRIMARY KEY, v text); INSERT INTO ryw VALUES (1, 'a')",
        )
        .await
        .unwrap();
    writer.batch_execute("BEGIN; SELECT 1").await.unwrap();
    let mut new = start_with(&dir, port, "new", true, cache).await;
    new.logged("took over the listening sockets").await;
    let value = |rows: Vec<tokio_postgres::SimpleQueryMessage>| {
        rows.iter()
            .find_map(|m| match m {
                tokio_postgres::SimpleQueryMessage::Row(r) => r.get(0).map(str::to_owned),
                _ => None,
            })
            .unwrap()
    };
    let reader = connect(&url(port, "restart_cache")).await;
    for _ in 0..3 {
        let v = value(
            reader
                .simple_query("SELECT v FROM ryw WHERE id = 1")
                .await
                .unwrap(),
        );
        assert_eq!(v, "a");
    }
    writer
        .batch_execute("UPDATE ryw SET v = 'b' WHERE id = 1; COMMIT;")
        .await
        .unwrap();
    assert!(old.exited("old").await.success(), "{}", old.log());
    new.logged("takeover complete").await;
    let v = value(
        reader
            .simple_query("SELECT v FROM ryw WHERE id = 1")
            .await
            .unwrap(),
    );
    assert_eq!(v, "b", "a result made stale through the old process");
    let v = value(
        writer
            .simple_query("SELECT v FROM ryw WHERE id = 1")
            .await
            .unwrap(),
    );
    assert_eq!(v, "b");
    // Once the old process has gone, the new one caches.
    for _ in 0..3 {
        reader
            .simple_query("SELECT v FROM ryw WHERE id = 1")
            .await
            .unwrap();
    }
    let admin = admin_console(([127, 0, 0, 1], port).into()).await;
    let rows = admin_rows(&admin, "SHOW CACHE").await;
    let hits: u64 = rows
        .iter()
        .filter_map(|r| r.get("hits").and_then(|h| h.parse::<u64>().ok()))
        .sum();
    assert!(hits >= 2, "{rows:?}");
}

/// Under systemd (`Type=notify`, `NotifyAccess=all`) the service's main process follows the
/// takeover: each process says `READY=1` with its own `MAINPID=` once it listens, the old
/// one first, the new one when it has taken the sockets over. A datagram socket stands in
/// for systemd's `NOTIFY_SOCKET`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_service_manager_hears_the_new_process_as_the_main_one() {
    let dir = TempDir::new("restart", "notify");
    let systemd = std::os::unix::net::UnixDatagram::bind(dir.join("notify")).unwrap();
    systemd
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let heard = || {
        let mut buf = [0u8; 512];
        let n = systemd.recv(&mut buf).expect("a notification");
        String::from_utf8_lossy(&buf[..n]).into_owned()
    };
    let port = free_port();
    let mut old = start(&dir, port, "old", false).await;
    assert_eq!(
        heard(),
        format!("READY=1\nMAINPID={}\nSTATUS=serving", old.child.id())
    );
    let mut new = start(&dir, port, "new", true).await;
    assert_eq!(
        heard(),
        format!("READY=1\nMAINPID={}\nSTATUS=serving", new.child.id())
    );
    assert!(old.exited("old").await.success(), "{}", old.log());
    new.signal(libc::SIGINT);
    assert_eq!(heard(), "STOPPING=1");
    assert!(new.exited("new").await.success(), "{}", new.log());
}
