//! Clients reaching pgmemo over its Unix socket (`unix_socket_dir`), as they reach PostgreSQL
//! with `psql -h DIR -p PORT`: queries, the admin console's view of them, cancel requests, and
//! the socket file's life (a stale one replaced, a live one refused, kept across RELOAD,
//! removed at shutdown), with psql and tokio-postgres.

mod common;

use common::*;
use pgmemo::config::PoolMode;
use std::path::Path;
use std::time::Duration;
use tokio_postgres::error::SqlState;

/// A new empty directory for a socket, short enough for a socket path (108 bytes).
fn socket_dir(name: &str) -> TempDir {
    TempDir::new("unix", name)
}

/// pgmemo listening on 127.0.0.1:`port` and on a Unix socket in `dir`.
fn unix_config(dir: &Path, port: u16) -> pgmemo::config::Config {
    let mut config = test_config(PoolMode::Transaction, 2);
    config.general.listen = format!("127.0.0.1:{port}");
    config.general.unix_socket_dir = Some(dir.to_owned());
    config
}

/// A tokio-postgres connection string for pgmemo's socket in `dir`.
fn unix_url(dir: &Path, port: u16, db: &str) -> String {
    format!(
        "host={} port={port} user={PGMEMO_USER} password={PGMEMO_PASS} dbname={db}",
        dir.display()
    )
}

/// Runs the cluster's psql through the socket in `dir`: its output, or its error.
async fn psql(dir: &Path, port: u16, sql: &str) -> Result<String, String> {
    psql_as(dir, port, PGMEMO_USER, "postgres", Some(PGMEMO_PASS), sql).await
}

/// [`psql`] as `user` in `db`, with `password` (None: none given).
async fn psql_as(
    dir: &Path,
    port: u16,
    user: &str,
    db: &str,
    password: Option<&str>,
    sql: &str,
) -> Result<String, String> {
    let mut command = tokio::process::Command::new(cluster().bin_dir().join("psql"));
    command.args(["-X", "-At", "-h"]).arg(dir).args([
        "-p",
        &port.to_string(),
        "-U",
        user,
        "-d",
        db,
        "-c",
        sql,
    ]);
    match password {
        Some(password) => command.env("PGPASSWORD", password),
        None => command.env_remove("PGPASSWORD"),
    };
    let out = command.output().await.unwrap();
    match out.status.success() {
        true => Ok(String::from_utf8_lossy(&out.stdout).trim().to_string()),
        false => Err(String::from_utf8_lossy(&out.stderr).trim().to_string()),
    }
}

#[tokio::test]
async fn psql_and_tokio_postgres_run_queries_over_the_unix_socket() {
    let (dir, port) = (socket_dir("queries"), free_port());
    let proxy = start_pgmemo(unix_config(&dir, port)).await;
    let socket = dir.join(format!(".s.PGSQL.{port}"));
    assert_eq!(proxy.unix_socket(), Some(socket.as_path()));
    // psql with -h DIR, as with PostgreSQL: the query runs on the server behind pgmemo.
    assert_eq!(
        psql(&dir, port, "SELECT current_user || ' ' || 40 + 2").await,
        Ok("pgmemo 42".into())
    );
    // tokio-postgres with host=DIR; the admin console (over TCP) shows it as PgBouncer does:
    // addr `unix`, and the listen port on both sides.
    let client = connect(&unix_url(&dir, port, "postgres")).await;
    let row = client
        .query_one("SELECT $1::int + 1", &[&41i32])
        .await
        .unwrap();
    assert_eq!(row.get::<_, i32>(0), 42);
    let admin = admin_console(proxy.local_addr()).await;
    let clients = admin_rows(&admin, "SHOW CLIENTS").await;
    let unix: Vec<_> = clients.iter().filter(|c| c["addr"] == "unix").collect();
    assert_eq!(unix.len(), 1, "{clients:?}");
    assert_eq!(unix[0]["port"], port.to_string());
    assert_eq!(unix[0]["local_addr"], "unix");
    assert_eq!(unix[0]["local_port"], port.to_string());
    assert_eq!(unix[0]["database"], "postgres");
    // The admin console itself is reachable over the socket too.
    let console = connect(&unix_url(&dir, port, "pgmemo")).await;
    assert!(!admin_rows(&console, "SHOW POOLS").await.is_empty());
    drop((client, console, admin));
    proxy.shutdown().await;
    assert!(!socket.exists(), "the socket file is removed at shutdown");
}

#[tokio::test]
async fn ssl_is_refused_with_n_on_the_unix_socket_as_postgresql_does() {
    use std::io::{Read, Write};
    let (dir, port) = (socket_dir("ssl"), free_port());
    let proxy = start_pgmemo(unix_config(&dir, port)).await;
    let path = proxy.unix_socket().unwrap().to_owned();
    let answer = tokio::task::spawn_blocking(move || {
        let mut s = std::os::unix::net::UnixStream::connect(path).unwrap();
        // SSLRequest: length 8, code 80877103.
        s.write_all(&[0, 0, 0, 8, 0x04, 0xd2, 0x16, 0x2f]).unwrap();
        let mut answer = [0u8; 1];
        s.read_exact(&mut answer).unwrap();
        answer[0]
    })
    .await
    .unwrap();
    assert_eq!(answer, b'N');
}

#[tokio::test]
async fn a_cancel_over_the_unix_socket_cancels_the_query() {
    let (dir, port) = (socket_dir("cancel"), free_port());
    let _proxy = start_pgmemo(unix_config(&dir, port)).await;
    let client = connect(&unix_url(&dir, port, "postgres")).await;
    let token = client.cancel_token();
    let sleeping = tokio::spawn(async move {
        let r = client.simple_query("SELECT pg_sleep(29.5)").await;
        (r, client)
    });
    // Cancel once the query runs on PostgreSQL.
    wait_until("the query to run", Duration::from_secs(10), || async {
        cluster()
            .psql(
                "postgres",
                "SELECT count(*) FROM pg_stat_activity WHERE query = 'SELECT pg_sleep(29.5)' \
                 AND state = 'active'",
            )
            .trim()
            == "1"
    })
    .await;
    token.cancel_query(tokio_postgres::NoTls).await.unwrap();
    let (r, client) = tokio::time::timeout(Duration::from_secs(10), sleeping)
        .await
        .expect("the cancel ends the query")
        .unwrap();
    let e = r.expect_err("the query was cancelled");
    assert_eq!(e.code(), Some(&SqlState::QUERY_CANCELED), "{e:?}");
    // The connection goes on.
    client.simple_query("SELECT 1").await.unwrap();
}

#[tokio::test]
async fn a_stale_socket_file_is_replaced_and_a_live_one_refused() {
    let (dir, port) = (socket_dir("stale"), free_port());
    let socket = dir.join(format!(".s.PGSQL.{port}"));
    // A socket file left by a process that is gone (a listener dropped without unlinking).
    drop(std::os::unix::net::UnixListener::bind(&socket).unwrap());
    assert!(socket.exists());
    let proxy = start_pgmemo(unix_config(&dir, port)).await;
    assert_eq!(psql(&dir, port, "SELECT 1").await, Ok("1".into()));
    // Another listener on that socket (a second pgmemo whose TCP port is in use elsewhere):
    // refused, and the first goes on serving.
    let e = pgmemo::listen::UnixSocket::bind(&dir, port, 0o777, None)
        .err()
        .expect("a live socket is refused");
    assert!(
        e.to_string()
            .contains("another process listens on Unix socket"),
        "{e:#}"
    );
    assert_eq!(psql(&dir, port, "SELECT 2").await, Ok("2".into()));
    // A file there that is no socket is left alone.
    std::fs::write(dir.join(".s.PGSQL.1"), "not a socket").unwrap();
    let e = pgmemo::listen::UnixSocket::bind(&dir, 1, 0o777, None)
        .err()
        .expect("a file that is no socket is refused");
    assert!(
        e.to_string().contains("exists and is not a socket"),
        "{e:#}"
    );
    // A directory that does not exist is a clear error at start.
    let missing = dir.join("missing");
    let e = pgmemo::Pgmemo::start(unix_config(&missing, free_port()))
        .await
        .err()
        .expect("a missing directory is refused");
    assert!(
        format!("{e:#}").contains("is not a directory (it must exist)"),
        "{e:#}"
    );
    proxy.shutdown().await;
}

#[tokio::test]
async fn reload_keeps_the_socket_until_a_restart() {
    let (dir, port) = (socket_dir("reload"), free_port());
    let other = socket_dir("reload-other");
    let proxy = start_pgmemo(unix_config(&dir, port)).await;
    let pending = proxy.reload_with(unix_config(&other, port)).unwrap();
    assert!(
        pending.iter().any(|p| p.key == "general.unix_socket_dir"),
        "{pending:?}"
    );
    assert_eq!(psql(&dir, port, "SELECT 3").await, Ok("3".into()));
    assert!(!other.join(format!(".s.PGSQL.{port}")).exists());
    proxy.shutdown().await;
}

#[tokio::test]
async fn the_socket_file_takes_its_mode_and_group() {
    use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _};
    let (dir, port) = (socket_dir("mode"), free_port());
    // The test's own group, by number: the one group a test can be sure to belong to.
    let gid = std::fs::metadata(&*dir).unwrap().gid();
    let mut config = unix_config(&dir, port);
    config.general.unix_socket_mode = "0770".into();
    config.general.unix_socket_group = Some(gid.to_string());
    let proxy = start_pgmemo(config).await;
    let meta = std::fs::metadata(proxy.unix_socket().unwrap()).unwrap();
    assert_eq!(meta.permissions().mode() & 0o777, 0o770);
    assert_eq!(meta.gid(), gid);
    assert_eq!(psql(&dir, port, "SELECT 4").await, Ok("4".into()));
    // A group that does not exist stops the start, and leaves no socket behind.
    let (other, other_port) = (socket_dir("mode-bad"), free_port());
    let mut config = unix_config(&other, other_port);
    config.general.unix_socket_group = Some("no_such_group_pgmemo".into());
    let e = pgmemo::Pgmemo::start(config).await.err().expect("refused");
    assert!(
        format!("{e:#}").contains("no group \"no_such_group_pgmemo\""),
        "{e:#}"
    );
    assert!(!other.join(format!(".s.PGSQL.{other_port}")).exists());
    proxy.shutdown().await;
}

/// With `auth_type = "hba"`, a client on the Unix socket is a `local` one: a `local ... reject`
/// line refuses it with PostgreSQL's message (`host "[local]"`), while the same user over TCP
/// takes the `host` line.
#[tokio::test]
async fn an_hba_local_line_decides_for_the_unix_socket() {
    let dir = socket_dir("hba");
    let hba = dir.0.join("hba.conf");
    std::fs::write(
        &hba,
        format!("local all {PGMEMO_USER} reject\nhost all all 127.0.0.1/32 scram-sha-256\n"),
    )
    .unwrap();
    let port = free_port();
    let mut config = unix_config(&dir.0, port);
    config.general.auth_type = pgmemo::config::AuthType::Hba;
    config.general.auth_hba_file = Some(hba);
    config.read_auth_file().unwrap();
    let proxy = start_pgmemo(config).await;
    let refused = psql(&dir.0, port, "SELECT 1").await.unwrap_err();
    assert!(
        refused.ends_with(&format!(
            "FATAL:  pg_hba.conf rejects connection for host \"[local]\", user \
             \"{PGMEMO_USER}\", database \"postgres\", no encryption"
        )),
        "{refused}"
    );
    let tcp = connect(&proxy_url(
        proxy.local_addr(),
        PGMEMO_USER,
        Some(PGMEMO_PASS),
        "postgres",
    ))
    .await;
    assert!(tcp.simple_query("SELECT 1").await.is_ok());
}

/// `peer` on a local line: a client whose operating-system user is the user it logs in as
/// gets in without a password; another gets PostgreSQL's refusal. The names of a line may
/// come from an `@file` next to the HBA file.
#[tokio::test]
async fn peer_lets_in_the_socket_users_own_name() {
    let dir = socket_dir("peer");
    let os_user = std::process::Command::new("id")
        .arg("-un")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap();
    assert!(!os_user.is_empty() && os_user != PGMEMO_USER);
    std::fs::write(dir.0.join("databases"), "peerdb\npostgres\n").unwrap();
    let hba = dir.0.join("hba.conf");
    std::fs::write(&hba, "local @databases all peer\n").unwrap();
    let port = free_port();
    let mut config = unix_config(&dir.0, port);
    config.general.auth_type = pgmemo::config::AuthType::Hba;
    config.general.auth_hba_file = Some(hba.clone());
    // The OS user is a pgmemo user, served by a database that logs into the server as
    // pgmemo's own role.
    config.users.insert(
        PGMEMO_USER.into(),
        pgmemo::config::UserConfig {
            password: Some(PGMEMO_PASS.into()),
            ..Default::default()
        },
    );
    config.users.insert(
        os_user.clone(),
        pgmemo::config::UserConfig {
            password: Some("unused".into()),
            ..Default::default()
        },
    );
    config.databases.insert(
        "peerdb".into(),
        pgmemo::config::DatabaseConfig {
            dbname: Some("postgres".into()),
            user: Some(PGMEMO_USER.into()),
            password: Some(PGMEMO_PASS.into()),
            ..Default::default()
        },
    );
    config.read_auth_file().unwrap();
    let proxy = start_pgmemo(config.clone()).await;
    let current_user = "SELECT current_user";
    let own = psql_as(&dir.0, port, &os_user, "peerdb", None, current_user).await;
    assert_eq!(own.unwrap(), PGMEMO_USER);
    let refused = psql_as(&dir.0, port, PGMEMO_USER, "peerdb", None, current_user)
        .await
        .unwrap_err();
    assert!(
        refused.ends_with(&format!(
            "FATAL:  Peer authentication failed for user \"{PGMEMO_USER}\""
        )),
        "{refused}"
    );
    proxy.shutdown().await;

    // With an ident map (auth_ident_file, map=NAME): the OS user logs in as the users its map
    // names, and no longer as itself (unless mapped to itself too).
    let ident = dir.0.join("ident.conf");
    std::fs::write(&ident, format!("socket {os_user} {PGMEMO_USER}\n")).unwrap();
    std::fs::write(&hba, "local @databases all peer map=socket\n").unwrap();
    config.general.auth_ident_file = Some(ident);
    config.read_auth_file().unwrap();
    let proxy = start_pgmemo(config).await;
    let mapped = psql_as(&dir.0, port, PGMEMO_USER, "peerdb", None, current_user).await;
    assert_eq!(mapped.unwrap(), PGMEMO_USER);
    let own = psql_as(&dir.0, port, &os_user, "peerdb", None, current_user)
        .await
        .unwrap_err();
    assert!(
        own.ends_with(&format!(
            "FATAL:  Peer authentication failed for user \"{os_user}\""
        )),
        "{own}"
    );
    proxy.shutdown().await;
}
