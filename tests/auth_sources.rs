//! Where pgmemo finds the secrets clients are checked against, besides `[users]`:
//! `general.auth_file`, PgBouncer's `userlist.txt` (plain, md5 and SCRAM secrets, read again
//! on RELOAD, a broken line refused with its file and line), and `auth_query` run as
//! `auth_user` in PostgreSQL (SCRAM and md5 secrets from `pg_authid`; no row, a wrong password:
//! PostgreSQL's 28P01; two rows or an error: refused with a clear message; lookups of two
//! users at once do not wait for each other; a database pgmemo does not serve: 3D000;
//! auth_user, auth_query and auth_dbname per database); and pass-through: a client checked against a
//! stored SCRAM verifier or md5 hash logs into PostgreSQL as itself with the keys of its own
//! login, pgmemo holding no password of it.
//!
//! Clients are real: psql with a password, and tokio-postgres.

mod common;

use common::*;
use pgmemo::config::{AuthType, Config, DatabaseConfig, PoolMode};
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

fn md5_secret(user: &str, password: &str) -> String {
    postgres_protocol::password::md5(password.as_bytes(), user)
}

fn scram_secret(password: &str) -> String {
    postgres_protocol::password::scram_sha_256(password.as_bytes())
}

/// pgmemo's test configuration with `userlist` as its auth file and no `[users]`; the
/// console's user (`pgmemo`) must then be in the file, unless `admin` is false. The file's
/// users are no PostgreSQL roles: every client logs into the server as the fixed role
/// `pgmemo`.
fn auth_file_config(userlist: &Path, auth: AuthType, admin: bool) -> anyhow::Result<Config> {
    let mut config = test_config(PoolMode::Transaction, 2);
    log_in_as_pgmemo(&mut config);
    config.general.auth_type = auth;
    if !admin {
        config.general.admin_users.clear();
    }
    config.general.auth_file = Some(userlist.to_path_buf());
    config.read_auth_file()?;
    config.validate()?;
    Ok(config)
}

/// Runs `SELECT current_user` with psql through pgmemo at `port` as `user` / `password`:
/// stdout on success, stderr on failure.
async fn psql(port: u16, user: &str, password: &str) -> Result<String, String> {
    psql_to(port, user, password, TEST_DB).await
}

/// [`psql`] to database `db`.
async fn psql_to(port: u16, user: &str, password: &str, db: &str) -> Result<String, String> {
    let out = tokio::process::Command::new(cluster().bin_dir().join("psql"))
        .args(["-X", "-A", "-t", "-h", "127.0.0.1", "-p", &port.to_string()])
        .args(["-U", user, "-d", db, "-c", "SELECT current_user"])
        .env("PGPASSWORD", password)
        .env_remove("PGSERVICE")
        .stdin(Stdio::null())
        .kill_on_drop(true)
        .output()
        .await
        .expect("run psql");
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).trim().to_owned())
    }
}

fn write_userlist(path: &Path, lines: &[(&str, String)]) {
    let mut text = String::from("; written by the test\n");
    for (user, secret) in lines {
        text.push_str(&format!("\"{user}\" \"{secret}\"\n"));
    }
    std::fs::write(path, text).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn users_of_the_auth_file_log_in_and_reload_reads_it_again() {
    let dir = TempDir::new("auth", "userlist");
    let userlist = dir.0.join("userlist.txt");
    // The console's user is in the file too: with an auth file, the upstream role is no
    // longer a client user by itself (as with [users]).
    write_userlist(
        &userlist,
        &[
            (PGMEMO_USER, PGMEMO_PASS.to_owned()),
            ("alice", "alice_pw".to_owned()),
            ("carol", scram_secret("carol_pw")),
        ],
    );
    let proxy =
        start_pgmemo(auth_file_config(&userlist, AuthType::ScramSha256, true).unwrap()).await;
    let reload_path = userlist.clone();
    proxy.set_reloader(Box::new(move || {
        auth_file_config(&reload_path, AuthType::ScramSha256, true)
    }));
    let port = proxy.local_addr().port();

    // Plain and SCRAM secrets answer SCRAM; the server login is the fixed role's.
    assert_eq!(psql(port, "alice", "alice_pw").await.unwrap(), PGMEMO_USER);
    assert_eq!(psql(port, "carol", "carol_pw").await.unwrap(), PGMEMO_USER);
    let wrong = psql(port, "carol", "wrong").await.unwrap_err();
    assert!(
        wrong.contains("FATAL:  password authentication failed for user \"carol\""),
        "{wrong}"
    );
    let nobody = psql(port, "nobody", "alice_pw").await.unwrap_err();
    assert!(
        nobody.contains("FATAL:  password authentication failed for user \"nobody\""),
        "{nobody}"
    );

    // RELOAD reads the file again: alice is gone, dave is new.
    write_userlist(
        &userlist,
        &[
            (PGMEMO_USER, PGMEMO_PASS.to_owned()),
            ("carol", scram_secret("carol_pw")),
            ("dave", "dave_pw".to_owned()),
        ],
    );
    let admin = admin_console(proxy.local_addr()).await;
    admin.simple_query("RELOAD").await.unwrap();
    assert_eq!(psql(port, "dave", "dave_pw").await.unwrap(), PGMEMO_USER);
    let gone = psql(port, "alice", "alice_pw").await.unwrap_err();
    assert!(
        gone.contains("password authentication failed for user \"alice\""),
        "{gone}"
    );

    // A broken file is refused with its line, and the users read before stay.
    std::fs::write(
        &userlist,
        format!(
            "\"{PGMEMO_USER}\" \"{PGMEMO_PASS}\"\n\"dave\" \"SCRAM-SHA-256$4096:c2FsdA==$x\"\n"
        ),
    )
    .unwrap();
    let e = refused_reload(&admin).await;
    assert!(
        e.contains(&format!(
            "{}, line 2: the secret of user \"dave\"",
            userlist.display()
        )),
        "{e}"
    );
    assert!(e.contains("malformed SCRAM verifier"), "{e}");
    assert_eq!(psql(port, "dave", "dave_pw").await.unwrap(), PGMEMO_USER);
    proxy.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_md5_secret_of_the_auth_file_answers_md5_and_a_users_password_wins() {
    let dir = TempDir::new("auth", "md5");
    let userlist = dir.0.join("userlist.txt");
    write_userlist(
        &userlist,
        &[
            ("bob", md5_secret("bob", "bob_pw")),
            ("erin", "file_pw".to_owned()),
        ],
    );
    let mut config = auth_file_config(&userlist, AuthType::Md5, false).unwrap();
    config.users.insert(
        "erin".into(),
        pgmemo::config::UserConfig {
            password: Some("toml_pw".into()),
            ..Default::default()
        },
    );
    let proxy = start_pgmemo(config).await;
    let port = proxy.local_addr().port();
    assert_eq!(psql(port, "bob", "bob_pw").await.unwrap(), PGMEMO_USER);
    assert_eq!(psql(port, "erin", "toml_pw").await.unwrap(), PGMEMO_USER);
    let e = psql(port, "erin", "file_pw").await.unwrap_err();
    assert!(e.contains("password authentication failed"), "{e}");
    proxy.shutdown().await;

    // The same md5 hash cannot answer SCRAM: refused when the configuration is checked.
    let e = auth_file_config(&userlist, AuthType::ScramSha256, false)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains(&format!(
            "{}, line 2: user \"bob\" has an md5 hash",
            userlist.display()
        )),
        "{e}"
    );
}

#[tokio::test]
async fn a_broken_auth_file_is_a_config_error_with_file_and_line() {
    let dir = TempDir::new("auth", "broken");
    let toml = dir.0.join("pgmemo.toml");
    std::fs::write(
        &toml,
        format!(
            "[general]\nauth_file = \"users.txt\"\n[upstream]\nurl = \"postgresql://{PGMEMO_USER}:{PGMEMO_PASS}@127.0.0.1:{}\"\n",
            cluster().port()
        ),
    )
    .unwrap();
    let e = Config::load(&toml).unwrap_err().to_string();
    assert!(
        e.contains("pgmemo.toml, line 2: general.auth_file: cannot read"),
        "{e}"
    );
    let users = dir.0.join("users.txt");
    std::fs::write(&users, "\"alice\" \"pw\"\nbob secret\n").unwrap();
    let e = Config::load(&toml).unwrap_err().to_string();
    assert!(
        e.starts_with(&format!(
            "{}, line 2: malformed auth file line: it does not start with '\"'",
            users.display()
        )),
        "{e}"
    );
    std::fs::write(&users, "\"alice\" \"pw\"\n").unwrap();
    let config = Config::load(&toml).unwrap();
    assert_eq!(config.user_secret("alice"), Some("pw"));
}

/// pgmemo with `auth_user = postgres` (its password in `[users]`) looking up everyone else
/// with `query` (None: PgBouncer's default); every client logs into the server as the fixed
/// role `pgmemo` (clients as themselves: `a_user_found_by_auth_query_logs_into_postgresql_as_itself`).
fn auth_query_config(auth: AuthType, query: Option<&str>) -> Config {
    let mut config = test_config(PoolMode::Transaction, 2);
    log_in_as_pgmemo(&mut config);
    config.general.auth_type = auth;
    config.general.admin_users.clear();
    config.general.auth_user = Some(SUPERUSER.into());
    if let Some(query) = query {
        config.general.auth_query = query.into();
    }
    config.users.insert(
        SUPERUSER.into(),
        pgmemo::config::UserConfig {
            password: Some(SUPERUSER_PASS.into()),
            ..Default::default()
        },
    );
    config
}

/// The `FATAL:  ...` part of psql's error output.
fn fatal(stderr: &str) -> &str {
    let at = stderr
        .find("FATAL:")
        .unwrap_or_else(|| panic!("no FATAL in {stderr:?}"));
    stderr[at..].lines().next().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auth_query_looks_up_scram_and_md5_secrets_and_refuses_as_postgresql_does() {
    let direct = cluster().port();
    let proxy = start_pgmemo(auth_query_config(AuthType::ScramSha256, None)).await;
    let port = proxy.local_addr().port();
    // scram_user's secret is a SCRAM verifier in pg_authid, never in pgmemo's configuration.
    assert_eq!(
        psql(port, SCRAM_USER, SCRAM_PASS).await.unwrap(),
        PGMEMO_USER
    );
    // A wrong password, and a user the query finds no row for: PostgreSQL's own answer.
    let reference = psql(direct, SCRAM_USER, "wrong").await.unwrap_err();
    let wrong = psql(port, SCRAM_USER, "wrong").await.unwrap_err();
    assert_eq!(fatal(&wrong), fatal(&reference));
    let nobody_direct = psql(direct, "nobody", "wrong").await.unwrap_err();
    let nobody = psql(port, "nobody", "wrong").await.unwrap_err();
    assert_eq!(fatal(&nobody), fatal(&nobody_direct));
    assert_eq!(
        fatal(&nobody),
        "FATAL:  password authentication failed for user \"nobody\""
    );
    proxy.shutdown().await;

    // md5_user's secret is an md5 hash: it answers auth_type md5.
    let proxy = start_pgmemo(auth_query_config(AuthType::Md5, None)).await;
    let port = proxy.local_addr().port();
    assert_eq!(psql(port, MD5_USER, MD5_PASS).await.unwrap(), PGMEMO_USER);
    let wrong = psql(port, MD5_USER, "wrong").await.unwrap_err();
    assert_eq!(
        fatal(&wrong),
        "FATAL:  password authentication failed for user \"md5_user\""
    );
    proxy.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_auth_query_with_two_rows_or_an_error_refuses_the_login_clearly() {
    for query in [
        "SELECT rolname, rolpassword FROM pg_authid WHERE rolname = $1 OR rolname = 'pgmemo'",
        "SELECT rolname, no_such_column FROM pg_authid WHERE rolname = $1",
    ] {
        let proxy = start_pgmemo(auth_query_config(AuthType::ScramSha256, Some(query))).await;
        let port = proxy.local_addr().port();
        let e = psql(port, SCRAM_USER, SCRAM_PASS).await.unwrap_err();
        assert_eq!(
            fatal(&e),
            "FATAL:  pgmemo could not look up the password of user \"scram_user\" \
             (auth_query failed; see pgmemo's log)",
            "{query}"
        );
        // Users pgmemo knows itself are not disturbed.
        assert_eq!(
            psql(port, SUPERUSER, SUPERUSER_PASS).await.unwrap(),
            PGMEMO_USER
        );
        proxy.shutdown().await;
    }
}

/// Whether a backend waits on advisory lock `key` (the gate of the test below).
async fn waits_on_gate(direct: &tokio_postgres::Client, key: i64) -> bool {
    let row = direct
        .query_one(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted \
             AND objid = $1::bigint::oid",
            &[&key],
        )
        .await
        .unwrap();
    row.get::<_, i64>(0) > 0
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lookups_of_two_users_run_at_once() {
    // scram_user's lookup waits on an advisory lock the test holds; md5_user's must not
    // wait behind it. Every lookup is logged, so the cache is seen as lookups not run.
    const GATE: i64 = 36_4242;
    let direct = connect(&direct_db_url(TEST_DB)).await;
    direct
        .batch_execute(&format!(
            "CREATE TABLE IF NOT EXISTS auth_lookups (rolname name);
             CREATE OR REPLACE FUNCTION auth_gate(u name) RETURNS bool LANGUAGE plpgsql AS $$
             BEGIN
                 INSERT INTO auth_lookups VALUES (u);
                 IF u = '{SCRAM_USER}' THEN PERFORM pg_advisory_xact_lock_shared({GATE}); END IF;
                 RETURN true;
             END $$;
             SELECT pg_advisory_lock({GATE});"
        ))
        .await
        .unwrap();
    let query = "SELECT rolname, rolpassword FROM pg_authid WHERE rolname = $1 AND auth_gate($1)";
    let proxy = start_pgmemo(auth_query_config(AuthType::Md5, Some(query))).await;
    let port = proxy.local_addr().port();
    let held = tokio::spawn(async move { psql(port, SCRAM_USER, SCRAM_PASS).await });
    wait_until(
        "scram_user's lookup waits on the gate",
        Duration::from_secs(30),
        || waits_on_gate(&direct, GATE),
    )
    .await;
    let other = tokio::time::timeout(Duration::from_secs(30), psql(port, MD5_USER, MD5_PASS))
        .await
        .expect("md5_user's login waited behind scram_user's lookup");
    assert_eq!(other.unwrap(), PGMEMO_USER);
    assert!(!held.is_finished(), "scram_user's lookup passed the gate");
    direct
        .batch_execute(&format!("SELECT pg_advisory_unlock({GATE})"))
        .await
        .unwrap();
    assert_eq!(held.await.unwrap().unwrap(), PGMEMO_USER);
    // The answer is cached: a second login of md5_user runs no lookup.
    assert_eq!(psql(port, MD5_USER, MD5_PASS).await.unwrap(), PGMEMO_USER);
    let lookups: i64 = direct
        .query_one(
            "SELECT count(*) FROM auth_lookups WHERE rolname = $1::text::name",
            &[&MD5_USER],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        lookups, 1,
        "md5_user was looked up again instead of from the cache"
    );
    proxy.shutdown().await;
}

/// pgmemo with no server user anywhere (each client logs into PostgreSQL as itself) and
/// `users`' secrets.
fn passthrough_config(auth: AuthType, users: &[(&str, String)]) -> Config {
    let mut config = test_config(PoolMode::Transaction, 2);
    config.general.auth_type = auth;
    config.general.admin_users.clear();
    config.upstream = None;
    config.databases.insert(
        "*".into(),
        pgmemo::config::DatabaseConfig {
            host: Some("127.0.0.1".into()),
            port: Some(cluster().port()),
            ..Default::default()
        },
    );
    for (name, secret) in users {
        config.users.insert(
            (*name).into(),
            pgmemo::config::UserConfig {
                password: Some(secret.clone()),
                ..Default::default()
            },
        );
    }
    config
}

fn rolpassword(role: &str) -> String {
    cluster()
        .psql(
            TEST_DB,
            &format!("SELECT rolpassword FROM pg_authid WHERE rolname = '{role}'"),
        )
        .trim()
        .to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_log_into_postgresql_as_themselves_with_only_their_stored_secret() {
    // pg_hba asks scram_user for scram-sha-256 and md5_user for md5; pgmemo holds only
    // what pg_authid holds.
    let verifier = rolpassword(SCRAM_USER);
    let md5 = rolpassword(MD5_USER);
    assert!(verifier.starts_with("SCRAM-SHA-256$"), "{verifier}");
    assert!(md5.starts_with("md5"), "{md5}");
    let config = passthrough_config(AuthType::Md5, &[(SCRAM_USER, verifier), (MD5_USER, md5)]);
    let proxy = start_pgmemo(config).await;
    let port = proxy.local_addr().port();
    for _ in 0..2 {
        assert_eq!(
            psql(port, SCRAM_USER, SCRAM_PASS).await.unwrap(),
            SCRAM_USER
        );
        assert_eq!(psql(port, MD5_USER, MD5_PASS).await.unwrap(), MD5_USER);
    }
    // tokio-postgres with SCRAM, on a pool psql's logins opened.
    let (client, conn) = tokio_postgres::connect(
        &proxy_url(proxy.local_addr(), SCRAM_USER, Some(SCRAM_PASS), TEST_DB),
        tokio_postgres::NoTls,
    )
    .await
    .unwrap();
    tokio::spawn(conn);
    let row = client.query_one("SELECT session_user", &[]).await.unwrap();
    assert_eq!(row.get::<_, String>(0), SCRAM_USER);
    drop(client);
    proxy.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_user_found_by_auth_query_logs_into_postgresql_as_itself() {
    let mut config = passthrough_config(
        AuthType::ScramSha256,
        &[(PGMEMO_USER, PGMEMO_PASS.to_owned())],
    );
    config.general.auth_user = Some(PGMEMO_USER.into());
    let proxy = start_pgmemo(config).await;
    let port = proxy.local_addr().port();
    assert_eq!(
        psql(port, SCRAM_USER, SCRAM_PASS).await.unwrap(),
        SCRAM_USER
    );
    let e = psql(port, SCRAM_USER, "wrong").await.unwrap_err();
    assert_eq!(
        fatal(&e),
        "FATAL:  password authentication failed for user \"scram_user\""
    );
    proxy.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stats_users_may_only_show() {
    let mut config = test_config(PoolMode::Transaction, 2);
    config.general.stats_users = vec!["watcher".into()];
    config.users.insert(
        "watcher".into(),
        pgmemo::config::UserConfig {
            password: Some("watcher_pw".into()),
            ..Default::default()
        },
    );
    config.users.insert(
        PGMEMO_USER.into(),
        pgmemo::config::UserConfig {
            password: Some(PGMEMO_PASS.into()),
            ..Default::default()
        },
    );
    let proxy = start_pgmemo(config).await;
    for console in ["pgmemo", "pgbouncer"] {
        let url = proxy_url(proxy.local_addr(), "watcher", Some("watcher_pw"), console);
        let (client, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
            .await
            .unwrap();
        tokio::spawn(conn);
        // The driver parameters PgBouncer's console fakes, for stats users too.
        for show in [
            "SHOW POOLS",
            "show stats;",
            "SHOW CONFIG",
            "SET client_encoding = 'UTF8'",
            "SHOW timezone",
        ] {
            client.simple_query(show).await.unwrap();
        }
        for command in [
            "RELOAD",
            "SET default_pool_size = 1",
            "PAUSE",
            "SHOW FDS",
            "SHUTDOWN",
            "KILL pgmemo_test",
        ] {
            let e = client.simple_query(command).await.unwrap_err();
            let db = e.as_db_error().expect("an ErrorResponse");
            assert_eq!(
                (db.code().code(), db.message()),
                ("08P01", "admin access needed"),
                "{command}"
            );
        }
        // Nothing was paused or shut down: a client still gets through.
        let user = connect(&proxy_db_url(&proxy, TEST_DB)).await;
        let row = user.query_one("SELECT 1::int4", &[]).await.unwrap();
        assert_eq!(row.get::<_, i32>(0), 1, "{console}");
    }
    // An admin still may.
    let admin = admin_console(proxy.local_addr()).await;
    admin.simple_query("SHOW FDS").await.unwrap();
    proxy.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_user_without_a_password_takes_it_from_the_auth_file() {
    // [databases."*"] user = md5_user, no password: as PgBouncer, the auth file's line for
    // md5_user gives it (here its md5 hash, which answers the server's md5 challenge).
    let dir = TempDir::new("auth", "server-user");
    let userlist = dir.0.join("userlist.txt");
    write_userlist(
        &userlist,
        &[
            (PGMEMO_USER, PGMEMO_PASS.to_owned()),
            (MD5_USER, rolpassword(MD5_USER)),
        ],
    );
    let mut config = passthrough_config(AuthType::Md5, &[]);
    config.general.auth_file = Some(userlist);
    config.read_auth_file().unwrap();
    config.databases.get_mut("*").unwrap().user = Some(MD5_USER.into());
    let proxy = start_pgmemo(config).await;
    assert_eq!(
        psql(proxy.local_addr().port(), PGMEMO_USER, PGMEMO_PASS)
            .await
            .unwrap(),
        MD5_USER
    );
    proxy.shutdown().await;
}

/// [`auth_query_config`] serving only the databases `dbs` (each logging in as `pgmemo`), with
/// no `"*"`.
fn auth_query_config_for(dbs: &[(&str, DatabaseConfig)]) -> Config {
    let mut config = auth_query_config(AuthType::ScramSha256, None);
    config.databases.clear();
    for (name, db) in dbs {
        let mut db = db.clone();
        db.user.get_or_insert_with(|| PGMEMO_USER.into());
        config.databases.insert((*name).into(), db);
    }
    config
}

/// With auth_query, a client that asks for a database pgmemo does not serve (no entry, no
/// `"*"`) gets PostgreSQL's 3D000, as a user of `[users]` does, not a password failure; the
/// lookup still serves the database that exists.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auth_query_for_a_database_that_does_not_exist_answers_3d000() {
    let proxy = start_pgmemo(auth_query_config_for(&[(
        TEST_DB,
        DatabaseConfig::default(),
    )]))
    .await;
    let port = proxy.local_addr().port();
    let missing = "FATAL:  database \"no_such_database\" does not exist";
    let e = psql_to(port, SCRAM_USER, SCRAM_PASS, "no_such_database")
        .await
        .unwrap_err();
    assert_eq!(fatal(&e), missing, "looked up by auth_query");
    let e = psql_to(port, SUPERUSER, SUPERUSER_PASS, "no_such_database")
        .await
        .unwrap_err();
    assert_eq!(fatal(&e), missing, "a user of [users]");
    assert_eq!(
        psql(port, SCRAM_USER, SCRAM_PASS).await.unwrap(),
        PGMEMO_USER
    );
    proxy.shutdown().await;
}

/// `auth_user`, `auth_query` and `auth_dbname` per database, with none in `[general]`: the
/// database with an auth_user looks its clients up; one without refuses them as PostgreSQL
/// refuses a wrong password; one whose own auth_query finds no row refuses them so; one whose
/// auth_dbname is a database whose server does not exist cannot look up (the lookup ran
/// there, not in the client's database).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auth_user_auth_query_and_auth_dbname_per_database() {
    let looked_up = DatabaseConfig {
        dbname: Some(TEST_DB.into()),
        auth_user: Some(SUPERUSER.into()),
        ..DatabaseConfig::default()
    };
    let none = DatabaseConfig {
        dbname: Some(TEST_DB.into()),
        ..DatabaseConfig::default()
    };
    let no_row = DatabaseConfig {
        auth_query: Some(
            "SELECT rolname, rolpassword FROM pg_authid WHERE rolname = $1 AND false".into(),
        ),
        ..looked_up.clone()
    };
    let elsewhere = DatabaseConfig {
        auth_dbname: Some("gone".into()),
        ..looked_up.clone()
    };
    let gone = DatabaseConfig {
        dbname: Some("no_such_server_database".into()),
        ..DatabaseConfig::default()
    };
    let mut config = auth_query_config_for(&[
        ("looked_up", looked_up),
        ("none", none),
        ("no_row", no_row),
        ("elsewhere", elsewhere),
        ("gone", gone),
    ]);
    config.general.auth_user = None;
    let proxy = start_pgmemo(config).await;
    let port = proxy.local_addr().port();
    assert_eq!(
        psql_to(port, SCRAM_USER, SCRAM_PASS, "looked_up")
            .await
            .unwrap(),
        PGMEMO_USER
    );
    let wrong = "FATAL:  password authentication failed for user \"scram_user\"";
    for db in ["none", "no_row"] {
        let e = psql_to(port, SCRAM_USER, SCRAM_PASS, db).await.unwrap_err();
        assert_eq!(fatal(&e), wrong, "{db}");
    }
    let e = psql_to(port, SCRAM_USER, SCRAM_PASS, "elsewhere")
        .await
        .unwrap_err();
    assert_eq!(
        fatal(&e),
        "FATAL:  pgmemo could not look up the password of user \"scram_user\" \
         (auth_query failed; see pgmemo's log)"
    );
    proxy.shutdown().await;
}

/// `auth_type = "hba"`: each connection's method from the first matching line of
/// `auth_hba_file` (PgBouncer's HBA file): `reject` and no matching line refused with
/// PostgreSQL's FATAL 28000 messages, `trust` letting a known user in without its password,
/// `md5` checking it; RELOAD reads the file again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_hba_file_chooses_each_connections_method() {
    let dir = TempDir::new("auth", "hba");
    let userlist = dir.0.join("userlist.txt");
    let hba = dir.0.join("pgmemo_hba.conf");
    write_userlist(
        &userlist,
        &[
            (PGMEMO_USER, PGMEMO_PASS.to_owned()),
            ("alice", "alice_pw".to_owned()),
            ("mia", md5_secret("mia", "mia_pw")),
            ("rex", "rex_pw".to_owned()),
            ("tina", "tina_pw".to_owned()),
        ],
    );
    std::fs::write(
        &hba,
        "# the test's\n\
         host all rex 127.0.0.1/32 reject\n\
         host all tina 127.0.0.1/32 trust\n\
         host other_db all all reject\n\
         host all all 127.0.0.1 255.255.255.255 md5\n",
    )
    .unwrap();
    let config = {
        let (userlist, hba) = (userlist.clone(), hba.clone());
        move || {
            let mut config = test_config(PoolMode::Transaction, 2);
            log_in_as_pgmemo(&mut config);
            config.general.auth_type = AuthType::Hba;
            config.general.auth_file = Some(userlist.clone());
            config.general.auth_hba_file = Some(hba.clone());
            config.read_auth_file()?;
            config.validate()?;
            anyhow::Ok(config)
        }
    };
    let proxy = start_pgmemo(config().unwrap()).await;
    proxy.set_reloader(Box::new(config));
    let port = proxy.local_addr().port();

    assert_eq!(psql(port, "alice", "alice_pw").await.unwrap(), PGMEMO_USER);
    assert_eq!(psql(port, "mia", "mia_pw").await.unwrap(), PGMEMO_USER);
    let wrong = psql(port, "alice", "wrong").await.unwrap_err();
    assert_eq!(
        fatal(&wrong),
        "FATAL:  password authentication failed for user \"alice\""
    );
    // trust: the password is not asked for.
    assert_eq!(psql(port, "tina", "anything").await.unwrap(), PGMEMO_USER);
    let rex = psql(port, "rex", "rex_pw").await.unwrap_err();
    assert_eq!(
        fatal(&rex),
        format!(
            "FATAL:  pg_hba.conf rejects connection for host \"127.0.0.1\", user \"rex\", \
             database \"{TEST_DB}\", no encryption"
        )
    );
    let other = psql_to(port, "alice", "alice_pw", "other_db")
        .await
        .unwrap_err();
    assert!(fatal(&other).contains("rejects connection"), "{other}");

    // RELOAD reads the file again: no line for alice now.
    std::fs::write(
        &hba,
        "host all rex 127.0.0.1/32 reject\nhost all pgmemo all md5\n",
    )
    .unwrap();
    let admin = admin_console(proxy.local_addr()).await;
    admin.simple_query("RELOAD").await.unwrap();
    let none = psql(port, "alice", "alice_pw").await.unwrap_err();
    assert_eq!(
        fatal(&none),
        format!(
            "FATAL:  no pg_hba.conf entry for host \"127.0.0.1\", user \"alice\", database \
             \"{TEST_DB}\", no encryption"
        )
    );
    // A line pgmemo cannot honour is refused with its line; the rules read before stay.
    std::fs::write(&hba, "host all all all md5\nhost all all all peer\n").unwrap();
    let e = refused_reload(&admin).await;
    assert!(
        e.contains(&format!(
            "{}, line 2: method \"peer\" is for local lines only",
            hba.display()
        )),
        "{e}"
    );
    assert!(psql(port, "alice", "alice_pw").await.is_err());
    proxy.shutdown().await;
}

/// The message of the error a RELOAD the console refuses answers with.
async fn refused_reload(admin: &tokio_postgres::Client) -> String {
    let e = admin.simple_query("RELOAD").await.unwrap_err();
    e.as_db_error()
        .expect("an ErrorResponse")
        .message()
        .to_owned()
}
