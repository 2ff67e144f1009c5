//! Replication connections through pgmemo, as PgBouncer 1.23+ serves them: a logical one
//! (`replication=database`: pg_recvlogical) and a physical one (`replication=true`:
//! pg_basebackup) relayed to a server of their own, shown by the console with their kind,
//! stopped by KILL_CLIENT, their slot given back to the pool; the `replication` parameter and
//! HBA lines read as PostgreSQL reads them, with its words when it refuses.

mod common;

use common::*;
use pgmemo::config::{AuthType, Config, PoolMode, Upstream};
use pgmemo::demo::{LocalPostgres, LocalPostgresOptions};
use std::process::Stdio;
use std::time::Duration;

/// Runs the cluster's `program` (psql, pg_recvlogical, ...) with `args`, the password in the
/// environment: its standard output, or its standard error when it fails.
async fn run(program: &str, args: &[&str], password: Option<&str>) -> Result<String, String> {
    let mut command = tokio::process::Command::new(cluster().bin_dir().join(program));
    command
        .args(args)
        .env_remove("PGSERVICE")
        .stdin(Stdio::null())
        .kill_on_drop(true);
    if let Some(p) = password {
        command.env("PGPASSWORD", p);
    }
    let out = command.output().await.expect("run a PostgreSQL program");
    match out.status.success() {
        true => Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned()),
        false => Err(String::from_utf8_lossy(&out.stderr).trim().to_owned()),
    }
}

/// psql's `-At` output of `sql` over the connection string `conninfo`, or its error.
async fn psql(conninfo: &str, sql: &str, password: Option<&str>) -> Result<String, String> {
    run("psql", &["-X", "-At", "-d", conninfo, "-c", sql], password).await
}

/// A connection string to 127.0.0.1:`port`.
fn conninfo(port: u16, user: &str, db: &str, replication: &str) -> String {
    format!("host=127.0.0.1 port={port} user={user} dbname={db} replication={replication}")
}

/// The first FATAL line of a client's error output.
fn fatal(stderr: &str) -> &str {
    let at = stderr
        .find("FATAL:")
        .unwrap_or_else(|| panic!("no FATAL in {stderr:?}"));
    stderr[at..].lines().next().unwrap()
}

/// IDENTIFY_SYSTEM's systemid, timeline and dbname (its xlogpos moves).
fn identity(row: &str) -> Vec<String> {
    let fields: Vec<&str> = row.split('|').collect();
    assert_eq!(fields.len(), 4, "{row}");
    vec![fields[0].into(), fields[1].into(), fields[3].into()]
}

/// A logical replication client (pg_recvlogical) through pgmemo in transaction mode, on a
/// pool of one server: its slot made, its changes streamed from its own walsender (the idle
/// server closed to make room), the console showing it as `logical` on both sides with the
/// walsender's process ID as its own, KILL_CLIENT ending it with PostgreSQL's words, and the
/// pool's one slot free again for the next client.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logical_replication_is_relayed_to_a_server_of_its_own() {
    let c = cluster();
    let slot = "pgmemo_relay_test";
    c.psql(
        TEST_DB,
        &format!(
            "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots \
             WHERE slot_name = '{slot}';
             DROP TABLE IF EXISTS replication_relay;
             CREATE TABLE replication_relay (id int PRIMARY KEY, v text);"
        ),
    );
    let proxy = pgmemo(PoolMode::Transaction, 1).await;
    let port = proxy.local_addr().port();
    let pass = Some(PGMEMO_PASS);
    let client = connect(&proxy_url(proxy.local_addr(), PGMEMO_USER, pass, TEST_DB)).await;
    client.simple_query("SELECT 1").await.unwrap();

    // The walsender's answers, as PostgreSQL gives them directly.
    let direct = psql(
        &conninfo(c.port(), PGMEMO_USER, TEST_DB, "database"),
        "IDENTIFY_SYSTEM",
        pass,
    )
    .await
    .unwrap();
    let through = psql(
        &conninfo(port, PGMEMO_USER, TEST_DB, "database"),
        "IDENTIFY_SYSTEM",
        pass,
    )
    .await
    .unwrap();
    assert_eq!(identity(&through), identity(&direct));

    let dsn = format!("host=127.0.0.1 port={port} user={PGMEMO_USER} dbname={TEST_DB}");
    run(
        "pg_recvlogical",
        &[
            "-d",
            &dsn,
            "-S",
            slot,
            "--create-slot",
            "-P",
            "test_decoding",
        ],
        pass,
    )
    .await
    .unwrap();
    client
        .simple_query("INSERT INTO replication_relay VALUES (1, 'streamed through pgmemo')")
        .await
        .unwrap();

    let dir = TempDir::new("replication", "logical");
    let out = dir.join("changes.txt");
    let recv = tokio::process::Command::new(c.bin_dir().join("pg_recvlogical"))
        .args([
            "-d",
            &dsn,
            "-S",
            slot,
            "--start",
            "--no-loop",
            "-F",
            "0",
            "-f",
        ])
        .arg(&out)
        .env("PGPASSWORD", PGMEMO_PASS)
        .env_remove("PGSERVICE")
        .stdin(Stdio::null())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    wait_until("the change streamed", Duration::from_secs(30), || async {
        std::fs::read_to_string(&out)
            .is_ok_and(|s| s.contains("INSERT: id[integer]:1 v[text]:'streamed through pgmemo'"))
    })
    .await;

    let admin = admin_console(proxy.local_addr()).await;
    let clients = admin_rows(&admin, "SHOW CLIENTS").await;
    let logical: Vec<_> = clients
        .iter()
        .filter(|r| r["replication"] == "logical")
        .collect();
    assert_eq!(logical.len(), 1, "{clients:?}");
    let servers = admin_rows(&admin, "SHOW SERVERS").await;
    assert_eq!(servers.len(), 1, "the idle server made room: {servers:?}");
    assert_eq!(servers[0]["replication"], "logical");
    assert_eq!(servers[0]["link"], logical[0]["id"]);
    assert_eq!(servers[0]["state"], "active");
    let walsender = c.psql(
        "postgres",
        "SELECT pid FROM pg_stat_replication WHERE application_name = 'pg_recvlogical'",
    );
    let walsender = walsender.trim();
    assert_eq!(logical[0]["remote_pid"], walsender, "{clients:?}");
    assert_eq!(logical[0]["application_name"], "pg_recvlogical");
    assert!(clients
        .iter()
        .filter(|r| r["replication"] == "none")
        .all(|r| r["database"] != TEST_DB || r["remote_pid"] != walsender));
    let sent: u64 = admin_rows(&admin, "SHOW STATS")
        .await
        .iter()
        .find(|r| r["database"] == TEST_DB)
        .map(|r| r["total_sent"].parse().unwrap())
        .unwrap();
    assert!(sent > 0);

    admin
        .simple_query(&format!("KILL_CLIENT {}", logical[0]["id"]))
        .await
        .unwrap();
    let ended = tokio::time::timeout(Duration::from_secs(30), recv.wait_with_output())
        .await
        .expect("pg_recvlogical ends")
        .unwrap();
    assert!(!ended.status.success());
    let stderr = String::from_utf8_lossy(&ended.stderr);
    assert!(
        stderr.contains("terminating connection due to administrator command"),
        "{stderr}"
    );
    // The pool's one slot is free again: a client gets a server (not query_wait_timeout).
    tokio::time::timeout(
        Duration::from_secs(10),
        client.simple_query("SELECT count(*) FROM replication_relay"),
    )
    .await
    .expect("the replication client's slot came back")
    .unwrap();
    wait_until("the walsender gone", Duration::from_secs(30), || async {
        c.psql(
            "postgres",
            &format!(
                "SELECT count(*) FROM pg_replication_slots WHERE slot_name = '{slot}' AND active"
            ),
        )
        .trim()
            == "0"
    })
    .await;
    let servers = admin_rows(&admin, "SHOW SERVERS").await;
    assert!(
        servers.iter().all(|s| s["replication"] == "none"),
        "{servers:?}"
    );
    run(
        "pg_recvlogical",
        &["-d", &dsn, "-S", slot, "--drop-slot"],
        pass,
    )
    .await
    .unwrap();
    proxy.shutdown().await;
}

/// A PostgreSQL subscription whose connection string points at pgmemo: its apply worker and
/// its table-sync worker (pgoutput, with the `options` a subscriber sends) stream through
/// pgmemo, the table's rows and a later insert arrive, and DROP SUBSCRIPTION drops its slot
/// through pgmemo.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_postgresql_subscription_streams_through_pgmemo() {
    let c = cluster();
    c.psql(
        TEST_DB,
        "DROP PUBLICATION IF EXISTS relay_pub;
         DROP TABLE IF EXISTS relay_sub;
         CREATE TABLE relay_sub (id int PRIMARY KEY, v text);
         INSERT INTO relay_sub VALUES (1, 'there before');
         CREATE PUBLICATION relay_pub FOR TABLE relay_sub;
         SELECT pg_create_logical_replication_slot('relay_sub_slot', 'pgoutput');",
    );
    c.psql("postgres", "DROP DATABASE IF EXISTS relay_subscriber");
    c.psql("postgres", "CREATE DATABASE relay_subscriber");
    let proxy = pgmemo(PoolMode::Transaction, 2).await;
    let port = proxy.local_addr().port();
    c.psql(
        "relay_subscriber",
        &format!(
            "CREATE TABLE relay_sub (id int PRIMARY KEY, v text);
             CREATE SUBSCRIPTION relay_subscription CONNECTION 'host=127.0.0.1 port={port} \
             user={PGMEMO_USER} password={PGMEMO_PASS} dbname={TEST_DB}' PUBLICATION relay_pub \
             WITH (create_slot = false, slot_name = 'relay_sub_slot');"
        ),
    );
    let rows = || {
        c.psql(
            "relay_subscriber",
            "SELECT string_agg(v, ',' ORDER BY id) FROM relay_sub",
        )
    };
    wait_until("the table copied", Duration::from_secs(60), || async {
        rows().trim() == "there before"
    })
    .await;
    let client = connect(&proxy_url(
        proxy.local_addr(),
        PGMEMO_USER,
        Some(PGMEMO_PASS),
        TEST_DB,
    ))
    .await;
    client
        .simple_query("INSERT INTO relay_sub VALUES (2, 'inserted later')")
        .await
        .unwrap();
    wait_until("the insert applied", Duration::from_secs(60), || async {
        rows().trim() == "there before,inserted later"
    })
    .await;
    let admin = admin_console(proxy.local_addr()).await;
    let clients = admin_rows(&admin, "SHOW CLIENTS").await;
    assert!(
        clients
            .iter()
            .any(|r| r["replication"] == "logical" && r["application_name"] == "relay_subscription"),
        "{clients:?}"
    );
    c.psql("relay_subscriber", "DROP SUBSCRIPTION relay_subscription");
    assert_eq!(
        c.psql(
            TEST_DB,
            "SELECT count(*) FROM pg_replication_slots WHERE slot_name = 'relay_sub_slot'"
        )
        .trim(),
        "0"
    );
    proxy.shutdown().await;
}

/// A physical replication client: pg_basebackup through pgmemo makes a backup that
/// pg_verifybackup accepts; the `replication` parameter is read as PostgreSQL reads it (its
/// FATAL for a value it refuses); physical connections match only `replication` lines of the
/// HBA file, refused in PostgreSQL's words, as a server with the same lines refuses them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn physical_replication_and_its_hba_lines() {
    let hba_lines = [
        "host replication postgres 127.0.0.1/32 reject",
        "host replication all 127.0.0.1/32 trust",
    ];
    let pg = LocalPostgres::start(LocalPostgresOptions {
        hba: hba_lines.iter().map(|l| l.to_string()).collect(),
        ..Default::default()
    })
    .expect("a private cluster");
    pg.psql("postgres", "CREATE ROLE rep LOGIN REPLICATION")
        .unwrap();
    let dir = TempDir::new("replication", "physical");
    let hba = dir.join("pgmemo_hba.conf");
    std::fs::write(
        &hba,
        format!(
            "{}\nhost all all 127.0.0.1/32 trust\n",
            hba_lines.join("\n")
        ),
    )
    .unwrap();
    let mut config = Config::for_upstream(Upstream {
        host: "127.0.0.1".into(),
        port: pg.port(),
        user: "postgres".into(),
        password: None,
        ..Default::default()
    });
    config.general.listen = "127.0.0.1:0".into();
    config.general.auth_type = AuthType::Hba;
    config.general.auth_hba_file = Some(hba.clone());
    for user in ["rep", "postgres"] {
        config.users.insert(
            user.into(),
            pgmemo::config::UserConfig {
                password: Some("unused".into()),
                ..Default::default()
            },
        );
    }
    config.read_auth_file().unwrap();
    let proxy = start_pgmemo(config.clone()).await;
    let port = proxy.local_addr().port();

    // The backup, through pgmemo, as the replication role.
    let backup = dir.join("backup");
    let dsn = format!("host=127.0.0.1 port={port} user=rep");
    run(
        "pg_basebackup",
        &[
            "-d",
            &dsn,
            "-D",
            backup.to_str().unwrap(),
            "-X",
            "stream",
            "-c",
            "fast",
            "--no-sync",
        ],
        None,
    )
    .await
    .unwrap();
    run("pg_verifybackup", &[backup.to_str().unwrap()], None)
        .await
        .unwrap();

    // Refused as the server refuses it: a `reject` line for postgres, and a value of
    // `replication` PostgreSQL does not read.
    for (user, replication) in [("postgres", "true"), ("rep", "maybe"), ("rep", "o")] {
        let direct = psql(
            &conninfo(pg.port(), user, "postgres", replication),
            "SELECT 1",
            None,
        )
        .await
        .unwrap_err();
        let through = psql(
            &conninfo(port, user, "postgres", replication),
            "SELECT 1",
            None,
        )
        .await
        .unwrap_err();
        assert_eq!(fatal(&through), fatal(&direct), "{user} {replication}");
        assert_eq!(
            through.lines().nth(1),
            direct.lines().nth(1),
            "the hint, {user} {replication}"
        );
    }
    assert_eq!(
        fatal(
            &psql(
                &conninfo(port, "postgres", "postgres", "yes"),
                "SELECT 1",
                None
            )
            .await
            .unwrap_err()
        ),
        "FATAL:  pg_hba.conf rejects replication connection for host \"127.0.0.1\", user \
         \"postgres\", no encryption"
    );
    // `replication=false` and a logical connection are connections to their database: the
    // `all` line lets them in.
    for replication in ["off", "database"] {
        let row = psql(
            &conninfo(port, "postgres", "postgres", replication),
            "IDENTIFY_SYSTEM",
            None,
        )
        .await;
        match replication {
            "off" => {
                let e = row.unwrap_err();
                assert!(e.contains("syntax error"), "a plain session: {e}")
            }
            _ => assert!(row.unwrap().ends_with("|postgres")),
        }
    }
    proxy.shutdown().await;

    // No `replication` line at all: PostgreSQL's words for that too.
    std::fs::write(&hba, "host all all 127.0.0.1/32 trust\n").unwrap();
    config.read_auth_file().unwrap();
    let proxy = start_pgmemo(config).await;
    let port = proxy.local_addr().port();
    assert_eq!(
        fatal(
            &psql(
                &conninfo(port, "rep", "postgres", "true"),
                "IDENTIFY_SYSTEM",
                None
            )
            .await
            .unwrap_err()
        ),
        "FATAL:  no pg_hba.conf entry for replication connection from host \"127.0.0.1\", \
         user \"rep\", no encryption"
    );
    proxy.shutdown().await;
}
