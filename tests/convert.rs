//! `pgmemo convert` from the command line: PgBouncer's own example configuration becomes a file
//! `pgmemo --check` accepts; a PgBouncer setup in front of a real PostgreSQL, converted, serves
//! queries; bad input fails with its line.

mod common;

use common::*;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};
use tokio_postgres::{NoTls, SimpleQueryMessage};

const BIN: &str = env!("CARGO_BIN_EXE_pgmemo");

fn temp_dir(name: &str) -> PathBuf {
    let dir =
        std::env::temp_dir().join(format!("pgmemo-convert-test-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// PgBouncer 1.25.2's `etc/` files, kept in tests/data (see its README).
fn data(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data")
        .join(name)
}

async fn pgmemo(args: &[&str]) -> std::process::Output {
    tokio::process::Command::new(BIN)
        .args(args)
        .env_remove("PGMEMO_CONFIG")
        .env_remove("PGMEMO_UPSTREAM")
        .output()
        .await
        .expect("run pgmemo")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pgbouncers_example_config_converts_to_a_file_pgmemo_accepts() {
    let dir = temp_dir("example");
    let out = dir.join("pgmemo.toml");
    let (ini, users) = (data("pgbouncer.ini"), data("userlist.txt"));
    let run = pgmemo(&[
        "convert",
        ini.to_str().unwrap(),
        users.to_str().unwrap(),
        "-o",
        out.to_str().unwrap(),
    ])
    .await;
    assert!(run.status.success(), "{}", text(&run.stderr));
    let toml = std::fs::read_to_string(&out).unwrap();
    for line in [
        "# not converted: logfile = /var/log/pgbouncer/pgbouncer.log",
        "# not converted: pidfile = /var/run/pgbouncer/pgbouncer.pid",
        "auth_type = \"md5\"",
        "pool_mode = \"session\"",
        "[users.marko]",
    ] {
        assert!(toml.contains(line), "no {line:?} in\n{toml}");
    }
    // Its [databases] is empty: said on stderr, and served from this machine.
    assert!(text(&run.stderr).contains("[databases] is empty"));

    let check = pgmemo(&["--check", "--config", out.to_str().unwrap()]).await;
    assert!(
        check.status.success(),
        "{}\n--- converted:\n{toml}",
        text(&check.stderr)
    );
    // To stdout without -o: the same text.
    let stdout = pgmemo(&["convert", ini.to_str().unwrap(), users.to_str().unwrap()]).await;
    assert_eq!(text(&stdout.stdout), toml);
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_pgbouncer_files_fail_with_their_line_and_unknown_keys_warn() {
    let dir = temp_dir("bad");
    let ini = dir.join("pgbouncer.ini");
    let ini_arg = ini.to_str().unwrap();

    std::fs::write(&ini, "[pgbouncer]\nlisten_port = 6432\nauth_type md5\n").unwrap();
    let run = pgmemo(&["convert", ini_arg]).await;
    assert_eq!(run.status.code(), Some(1));
    let stderr = text(&run.stderr);
    assert!(
        stderr.contains("pgbouncer.ini, line 3: syntax error"),
        "{stderr}"
    );
    assert!(run.stdout.is_empty());

    let users = dir.join("userlist.txt");
    std::fs::write(&users, "\"a\" \"b\"\n\"c\" \"d\"\nmarko asdasd\n").unwrap();
    std::fs::write(&ini, "[databases]\ndb = host=h\n").unwrap();
    let run = pgmemo(&["convert", ini_arg, users.to_str().unwrap()]).await;
    assert_eq!(run.status.code(), Some(1));
    let stderr = text(&run.stderr);
    assert!(
        stderr.contains("userlist.txt, line 3: malformed auth file line"),
        "{stderr}"
    );

    std::fs::write(
        &ini,
        "[databases]\ndb = host=h\n[pgbouncer]\nauth_type = trust\nlisten_adr = 0.0.0.0\n",
    )
    .unwrap();
    let run = pgmemo(&["convert", ini_arg]).await;
    assert!(run.status.success(), "{}", text(&run.stderr));
    let stderr = text(&run.stderr);
    assert!(
        stderr.contains("pgbouncer.ini, line 5: unknown setting \"listen_adr\""),
        "{stderr}"
    );
    assert!(text(&run.stdout).contains("# unknown: listen_adr = 0.0.0.0"));
    let _ = std::fs::remove_dir_all(&dir);
}

/// A PgBouncer setup (databases as connection strings, an auth file with a SCRAM user and an
/// admin, transaction pooling) in front of the test cluster, converted and started: a client
/// logs in with its PgBouncer password and runs queries, and the console answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_converted_pgbouncer_setup_serves_queries() {
    let dir = temp_dir("serve");
    // The cluster first: started on first use, it takes a free port of its own, which could
    // be the one picked for pgmemo if that were picked before (it once was: pgmemo could not
    // listen, and the test's clients reached PostgreSQL itself, where "renamed" does not
    // exist).
    let pg = cluster().port();
    let port = free_port();
    let ini = dir.join("pgbouncer.ini");
    std::fs::write(
        &ini,
        format!(
            "[databases]\n\
             {TEST_DB} = host=127.0.0.1 port={pg} pool_size=3\n\
             renamed = host=127.0.0.1 port={pg} dbname={TEST_DB} reserve_pool=2\n\
             [pgbouncer]\n\
             listen_addr = 127.0.0.1\n\
             listen_port = {port}\n\
             auth_type = scram-sha-256\n\
             auth_file = userlist.txt\n\
             admin_users = {PGMEMO_USER}\n\
             pool_mode = transaction\n\
             default_pool_size = 4\n\
             server_tls_sslmode = disable\n\
             logfile = pgbouncer.log\n",
        ),
    )
    .unwrap();
    std::fs::write(
        dir.join("userlist.txt"),
        format!("\"{PGMEMO_USER}\" \"{PGMEMO_PASS}\"\n"),
    )
    .unwrap();
    let out = dir.join("pgmemo.toml");
    let run = pgmemo(&[
        "convert",
        ini.to_str().unwrap(),
        "-o",
        out.to_str().unwrap(),
    ])
    .await;
    assert!(run.status.success(), "{}", text(&run.stderr));
    assert!(run.stderr.is_empty(), "{}", text(&run.stderr));

    let log_path = dir.join("pgmemo.log");
    let mut child = tokio::process::Command::new(BIN)
        .args(["--config", out.to_str().unwrap()])
        .env_remove("PGMEMO_CONFIG")
        .env_remove("PGMEMO_UPSTREAM")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log_path).unwrap())
        .kill_on_drop(true)
        .spawn()
        .expect("start pgmemo");
    let addr: std::net::SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let log = || std::fs::read_to_string(&log_path).unwrap_or_default();
    let url = |db: &str| proxy_url(addr, PGMEMO_USER, Some(PGMEMO_PASS), db);

    let deadline = Instant::now() + Duration::from_secs(15);
    let client = loop {
        match tokio_postgres::connect(&url(TEST_DB), NoTls).await {
            Ok((c, conn)) => {
                tokio::spawn(conn);
                break c;
            }
            Err(e) => {
                assert!(
                    Instant::now() < deadline,
                    "pgmemo did not start: {e}\n{}",
                    log()
                );
                assert!(
                    child.try_wait().unwrap().is_none(),
                    "pgmemo exited:\n{}",
                    log()
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    };
    let one = |msgs: Vec<SimpleQueryMessage>| match &msgs[1] {
        SimpleQueryMessage::Row(r) => r.get(0).map(str::to_owned),
        other => panic!("no row: {other:?}"),
    };
    let db = client
        .simple_query("SELECT current_database()")
        .await
        .unwrap();
    assert_eq!(one(db).as_deref(), Some(TEST_DB));
    // The renamed database reaches the same one on the server.
    let renamed = connect(&url("renamed")).await;
    let db = renamed
        .simple_query("SELECT current_database()")
        .await
        .unwrap();
    assert_eq!(one(db).as_deref(), Some(TEST_DB));
    // A wrong password is refused, as PgBouncer would.
    let wrong = proxy_url(addr, PGMEMO_USER, Some("wrong"), TEST_DB);
    assert!(tokio_postgres::connect(&wrong, NoTls).await.is_err());

    let admin = connect(&url("pgmemo")).await;
    let rows = admin.simple_query("SHOW CONFIG").await.unwrap();
    let setting = |key: &str| {
        rows.iter().find_map(|m| match m {
            SimpleQueryMessage::Row(r) if r.get(0) == Some(key) => r.get(1).map(str::to_owned),
            _ => None,
        })
    };
    assert_eq!(setting("pool_mode").as_deref(), Some("transaction"));
    assert_eq!(setting("default_pool_size").as_deref(), Some("4"));
    assert_eq!(setting("max_client_conn").as_deref(), Some("100"));

    child.kill().await.unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}
