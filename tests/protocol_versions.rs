//! Clients of protocol 3.2 (issue 57): libpq 18 asking for the newest protocol
//! (`max_protocol_version=latest`) through pgmemo, which speaks 3.0 to its clients, in front
//! of whichever PostgreSQL the tests run (`PGMEMO_TEST_PGBIN`: 15, 17 or 18). pgmemo answers
//! with NegotiateProtocolVersion as PostgreSQL 15-17 do (the bytes are compared in
//! `differential::protocol_version_negotiation_matches_postgres`); here libpq 18 itself goes
//! on in 3.0, runs its queries and cancels one with the 4-byte key pgmemo gave it.
//!
//! libpq 18's psql is the cluster's own when it is 18, else `PGMEMO_TEST_CLIENT_PGBIN`'s
//! (`scripts/test` runs this file in front of 15 with 18's psql, and against 18). Without a
//! libpq 18 nothing here can run: each test says so and passes, as a psql older than 18 does
//! not know `max_protocol_version`.

mod common;

use common::*;
use pgmemo::config::PoolMode;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;
use tokio::process::Command;

/// psql of libpq 18 or later, or None (with why, printed).
fn psql_18() -> Option<PathBuf> {
    let dir = std::env::var_os("PGMEMO_TEST_CLIENT_PGBIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| cluster().bin_dir());
    let psql = dir.join("psql");
    let version = std::process::Command::new(&psql)
        .arg("--version")
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default();
    // "psql (PostgreSQL) 18.6"
    let major: u32 = version
        .rsplit(' ')
        .next()
        .and_then(|v| v.trim().split('.').next()?.parse().ok())
        .unwrap_or(0);
    if major >= 18 {
        return Some(psql);
    }
    eprintln!(
        "not run: {} is psql {major}, which has no max_protocol_version (set \
         PGMEMO_TEST_CLIENT_PGBIN to PostgreSQL 18's bin, scripts/postgres 18)",
        psql.display()
    );
    None
}

/// A connection string to `port` asking for the newest protocol libpq knows.
fn conninfo(port: u16) -> String {
    format!(
        "host=127.0.0.1 port={port} user={PGMEMO_USER} password={PGMEMO_PASS} \
         dbname={TEST_DB} max_protocol_version=latest"
    )
}

async fn psql(bin: &Path, port: u16, command: &str) -> std::process::Output {
    Command::new(bin)
        .args(["-X", "-At", "-d", &conninfo(port), "-c", command])
        .stdin(Stdio::null())
        .kill_on_drop(true)
        .output()
        .await
        .expect("run psql")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn libpq_18_asking_for_protocol_3_2_goes_on_in_3_0() {
    let Some(bin) = psql_18() else { return };
    let proxy = pgmemo(PoolMode::Transaction, 2).await;
    let port = proxy.local_addr().port();
    let out = psql(&bin, port, "SELECT 41 + 1").await;
    assert!(out.status.success(), "{out:?}");
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "42");
    // What libpq settled on: 3.0 through pgmemo, whatever the server behind it speaks.
    let out = psql(&bin, port, "\\conninfo").await;
    let info = String::from_utf8_lossy(&out.stdout);
    assert!(
        info.lines().any(|l| l.starts_with("Protocol Version|3.0")),
        "{info}"
    );
    proxy.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn libpq_18_cancels_through_pgmemo_with_the_key_it_was_given() {
    let Some(bin) = psql_18() else { return };
    let proxy = pgmemo(PoolMode::Transaction, 2).await;
    let port = proxy.local_addr().port();
    let marker = "protocol_versions_cancel_me";
    let child = Command::new(&bin)
        .args([
            "-X",
            "-At",
            "-d",
            &conninfo(port),
            "-c",
            &format!("SELECT pg_sleep(300) /* {marker} */"),
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("start psql");
    // Running on a server: then psql's SIGINT handler sends libpq's cancel request.
    let running = format!(
        "SELECT count(*) FROM pg_stat_activity WHERE state = 'active' AND query LIKE '%{marker}%' \
         AND pid <> pg_backend_pid()"
    );
    let mut polls = 0;
    while cluster().psql("postgres", &running).trim() != "1" {
        polls += 1;
        assert!(polls < 3000, "the query never ran");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let pid = child.id().expect("psql runs") as i32;
    // SAFETY: a plain kill(2) of our own child.
    unsafe { libc::kill(pid, libc::SIGINT) };
    let out = child.wait_with_output().await.expect("psql ends");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("canceling statement due to user request"),
        "psql was not cancelled: {out:?}"
    );
    proxy.shutdown().await;
}
