//! Small helpers for tests that talk through a real driver (tokio-postgres).

use super::cluster::*;
use std::future::Future;
use std::time::{Duration, Instant};
use tokio_postgres::{Client, NoTls};

/// A tokio-postgres client for `url`; its connection runs on a spawned task.
pub async fn connect(url: &str) -> Client {
    let (client, conn) = tokio_postgres::connect(url, NoTls)
        .await
        .unwrap_or_else(|e| panic!("connect {url}: {e}"));
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
