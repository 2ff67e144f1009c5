//! pgmemo in front of a highly available cluster: a primary with a synchronous standby.
//!
//! A committing backend flushes its commit record, waits for its synchronous standby, and
//! only then becomes visible; pgmemo's WAL follower decodes the commit while the backend
//! waits. The standby here is a real one (`pg_receivewal --synchronous`, named in
//! `synchronous_standby_names`), held with SIGSTOP while a write commits, so that the gap is
//! there on every write, not by chance: reads through pgmemo in the gap get what PostgreSQL
//! gives (the old value), and once the write has returned and the follower has passed it,
//! every read gets the new value.

mod common;

use common::*;
use pgmemo::config::cache::{Invalidation, WalPlugin};
use pgmemo::config::{Config, PoolMode};
use pgmemo::demo::{LocalPostgres, LocalPostgresOptions};
use pgmemo::Pgmemo;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;
use tokio_postgres::Client;

/// A primary whose commits wait for the standby named `hold`, its WAL decodable, its
/// replication connections trusted.
fn primary() -> LocalPostgres {
    let settings = [
        ("wal_level", "logical"),
        ("synchronous_commit", "on"),
        ("synchronous_standby_names", "hold"),
    ];
    LocalPostgres::start(LocalPostgresOptions {
        settings: settings
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        hba: vec![
            "local replication all trust".into(),
            "host replication all 127.0.0.1/32 trust".into(),
        ],
        ..LocalPostgresOptions::default()
    })
    .expect("a primary")
}

/// A synchronous standby of `pg`'s WAL (`pg_receivewal --synchronous`, application name
/// `hold`): it flushes and answers at once, unless held.
struct SyncStandby {
    child: tokio::process::Child,
    pid: i32,
}

impl SyncStandby {
    async fn start(pg: &LocalPostgres, direct: &Client) -> SyncStandby {
        let dir = pg.socket_dir().join("receivewal");
        std::fs::create_dir_all(&dir).unwrap();
        let conninfo = format!(
            "host=127.0.0.1 port={} user=postgres application_name=hold",
            pg.port()
        );
        let child = tokio::process::Command::new(pg.bin_dir().join("pg_receivewal"))
            .args(["--synchronous", "--no-loop", "-D"])
            .arg(&dir)
            .args(["-d", &conninfo])
            .env_remove("PGSERVICE")
            .stdin(std::process::Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("pg_receivewal");
        let pid = child.id().expect("its pid") as i32;
        wait_until(
            "the standby to be synchronous",
            Duration::from_secs(30),
            || async {
                value(
                    direct,
                    "SELECT count(*) FROM pg_stat_replication \
                 WHERE application_name = 'hold' AND sync_state = 'sync'",
                )
                .await
                    == "1"
            },
        )
        .await;
        SyncStandby { child, pid }
    }

    /// Stops the standby: commits wait for it.
    fn hold(&self) {
        assert_eq!(unsafe { libc::kill(self.pid, libc::SIGSTOP) }, 0);
    }

    fn release(&self) {
        assert_eq!(unsafe { libc::kill(self.pid, libc::SIGCONT) }, 0);
    }
}

impl Drop for SyncStandby {
    fn drop(&mut self) {
        self.release();
        let _ = self.child.start_kill();
    }
}

fn config(pg: &LocalPostgres, plugin: WalPlugin) -> Config {
    let mut config = test_config(PoolMode::Transaction, 3);
    config.upstream = Some(pgmemo::config::Upstream {
        host: "127.0.0.1".into(),
        port: pg.port(),
        user: "postgres".into(),
        password: None,
        ..Default::default()
    });
    config.general.auth_type = pgmemo::config::AuthType::Trust;
    config.cache.enabled = true;
    config.cache.admit_after = 1;
    config.cache.invalidation = Invalidation::Wal;
    config.cache.wal_plugin = plugin;
    config.cache.rules = vec![cache_rule("kv", "FROM kv")];
    config
}

async fn value(client: &Client, sql: &str) -> String {
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

/// Waits for `cond`, asking every millisecond (a decode takes about that long).
async fn soon<F, Fut>(what: &str, mut cond: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while !cond().await {
        assert!(
            std::time::Instant::now() < deadline,
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

const READ: &str = "SELECT v FROM kv WHERE k = 1";

/// [`READ`], alone or in a transaction block.
async fn read(client: &Client, in_block: bool) -> String {
    if !in_block {
        return value(client, READ).await;
    }
    client.batch_execute("BEGIN").await.unwrap();
    let v = value(client, READ).await;
    client.batch_execute("COMMIT").await.unwrap();
    v
}

/// Writes per writer (directly, and through pgmemo) and decoder: 1,000 in all.
const WRITES: i64 = 250;

/// Each write commits while the standby is held: the follower decodes it, reads through
/// pgmemo (outside a block and in one) race it and get the old value, as PostgreSQL gives
/// it; the standby is released, the write returns, the follower passes it, and the next reads
/// through pgmemo get the new value. Written directly and through pgmemo (an autocommit
/// statement, whose commit only the WAL tells other pgmemo clients' fills about).
async fn held_commits_are_never_cached_stale(plugin: WalPlugin) {
    let pg = tokio::task::spawn_blocking(primary).await.unwrap();
    let direct = connect(&pg.url("postgres", None, "postgres")).await;
    let standby = SyncStandby::start(&pg, &direct).await;
    direct
        .batch_execute(
            "CREATE TABLE kv (k int PRIMARY KEY, v bigint); INSERT INTO kv VALUES (1, 0), (2, 0)",
        )
        .await
        .unwrap();
    let proxy = start_pgmemo(config(&pg, plugin)).await;
    let url = format!("postgresql://postgres@{}/postgres", proxy.local_addr());
    let reader = connect(&url).await;
    let writers = [
        Arc::new(connect(&pg.url("postgres", None, "postgres")).await),
        Arc::new(connect(&url).await),
    ];
    value(&reader, READ).await;
    soon("the follower to catch up", || async {
        follower(&proxy).is_some_and(|f| f.is_ready())
    })
    .await;
    let mut written = 0;
    for (writer, through_pgmemo) in writers.iter().zip([false, true]) {
        for _ in 0..WRITES {
            written += 1;
            let f = follower(&proxy).unwrap();
            let decoded = f.commits.load(Relaxed);
            standby.hold();
            let update = format!("UPDATE kv SET v = {written} WHERE k = 1");
            let writer = writer.clone();
            let write = tokio::spawn(async move { writer.batch_execute(&update).await.unwrap() });
            soon("the write's commit to be decoded", || async {
                f.commits.load(Relaxed) > decoded
            })
            .await;
            let old = (written - 1).to_string();
            assert_eq!(value(&direct, READ).await, old, "PostgreSQL, in the gap");
            for in_block in [false, true, false] {
                let read = read(&reader, in_block).await;
                assert_eq!(
                    read, old,
                    "write {written}, in the gap (in a block: {in_block})"
                );
            }
            standby.release();
            write.await.unwrap();
            wait_passed(&proxy, &direct).await;
            let new = written.to_string();
            for in_block in [false, false, true, true] {
                assert_eq!(
                    read(&reader, in_block).await,
                    new,
                    "write {written} (through pgmemo: {through_pgmemo}), once the follower \
                     passed it (in a block: {in_block})"
                );
            }
        }
    }
    // Each write's second and fourth reads after it, at least.
    let hits = cache_hits(&proxy);
    assert!(
        hits >= 2 * written as u64,
        "{hits} hits: {:?}",
        cache_bypasses(&proxy)
    );
    proxy.shutdown().await;
}

fn follower(proxy: &Pgmemo) -> Option<std::sync::Arc<pgmemo::wal::Follower>> {
    proxy.app().wal.followers().into_iter().next()
}

/// Waits until the follower has applied the server's WAL position as of now.
async fn wait_passed(proxy: &Pgmemo, direct: &Client) {
    let lsn: pgmemo::wal::Lsn = value(direct, "SELECT pg_current_wal_insert_lsn()")
        .await
        .parse()
        .unwrap();
    soon("the follower to pass the write", || async {
        follower(proxy).is_some_and(|f| f.is_ready() && f.applied() >= lsn)
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_commits_are_never_cached_stale_test_decoding() {
    held_commits_are_never_cached_stale(WalPlugin::TestDecoding).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_commits_are_never_cached_stale_pgoutput() {
    held_commits_are_never_cached_stale(WalPlugin::Pgoutput).await;
}
