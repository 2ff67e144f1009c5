//! Whose role the server login is: the client's own by default, also behind an `[upstream]`
//! whose role is pgmemo's own (row-level security, GRANTs and `pg_stat_activity` see each
//! client's role, and PostgreSQL's permission errors reach it byte for byte as they do
//! directly); one fixed role where a database says `user = ...` (PgBouncer's `user=`); and a
//! clear refusal, never another role, for a client whose role pgmemo holds no server
//! password of.

mod common;

use common::*;
use pgmemo::config::{AuthType, Config, DatabaseConfig, PoolMode, UserConfig};
use std::sync::Once;

/// Two tenants of one table: each sees its own rows (row-level security); `tenant_b` may
/// insert, `tenant_a` may only read; neither may read `login_secrets`.
const TENANT_A: (&str, &str) = ("tenant_a", "tenant_a_pw");
const TENANT_B: (&str, &str) = ("tenant_b", "tenant_b_pw");

/// The database name under which pgmemo serves the test database as the fixed role `pgmemo`.
const AS_OWNER: &str = "as_owner";

fn set_up_tenants() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        cluster().psql(
            TEST_DB,
            &format!(
                "CREATE ROLE {a} LOGIN PASSWORD '{a_pw}';
                 CREATE ROLE {b} LOGIN PASSWORD '{b_pw}';
                 CREATE TABLE login_notes (owner name, body text);
                 INSERT INTO login_notes VALUES ('{a}', 'a1'), ('{b}', 'b1'), ('{b}', 'b2');
                 ALTER TABLE login_notes ENABLE ROW LEVEL SECURITY;
                 CREATE POLICY own ON login_notes USING (owner = current_user);
                 GRANT SELECT ON login_notes TO {a}, {b};
                 GRANT INSERT ON login_notes TO {b};
                 CREATE TABLE login_secrets (x int);",
                a = TENANT_A.0,
                a_pw = TENANT_A.1,
                b = TENANT_B.0,
                b_pw = TENANT_B.1,
            ),
        );
    });
}

fn user(password: Option<String>) -> UserConfig {
    UserConfig {
        password,
        ..Default::default()
    }
}

/// The SCRAM verifier PostgreSQL stores for `role`.
fn verifier(role: &str) -> String {
    let verifier = cluster()
        .psql(
            TEST_DB,
            &format!("SELECT rolpassword FROM pg_authid WHERE rolname = '{role}'"),
        )
        .trim()
        .to_owned();
    assert!(verifier.starts_with("SCRAM-SHA-256$"), "{verifier}");
    verifier
}

/// The test configuration (`[upstream]` is the `pgmemo` role with its password, no forced
/// user), with `[users]`: pgmemo itself and tenant_a with only the SCRAM verifiers PostgreSQL
/// stores (pass-through), tenant_b with its plain password; and database `as_owner`, the
/// test database logged into as the fixed role `pgmemo` with no password of its own (so the
/// upstream's: pgmemo's `[users]` verifier cannot log in by itself).
fn tenants_config() -> Config {
    set_up_tenants();
    let mut config = test_config(PoolMode::Transaction, 2);
    config
        .users
        .insert(PGMEMO_USER.into(), user(Some(verifier(PGMEMO_USER))));
    config
        .users
        .insert(TENANT_A.0.into(), user(Some(verifier(TENANT_A.0))));
    config
        .users
        .insert(TENANT_B.0.into(), user(Some(TENANT_B.1.into())));
    config
        .databases
        .insert("*".into(), DatabaseConfig::default());
    config.databases.insert(
        AS_OWNER.into(),
        DatabaseConfig {
            dbname: Some(TEST_DB.into()),
            user: Some(PGMEMO_USER.into()),
            ..Default::default()
        },
    );
    config
}

/// Who the server says the client is, what it may read, and what it may not do.
fn whoami_script() -> Vec<Step> {
    let q = |sql: &str| Step::Send(vec![Frontend::query(sql)]);
    vec![
        q("SELECT current_user, session_user, \
           (SELECT usename FROM pg_stat_activity WHERE pid = pg_backend_pid())"),
        Step::Expect(1),
        q("SELECT owner, body FROM login_notes ORDER BY body"),
        Step::Expect(1),
        // tenant_a: no INSERT privilege; tenant_b: the policy refuses another owner's row.
        q("INSERT INTO login_notes VALUES ('tenant_a', 'x')"),
        Step::Expect(1),
        q("SELECT * FROM login_secrets"),
        Step::Expect(1),
        Step::Send(vec![
            Frontend::parse("", "SELECT count(*) FROM login_secrets", &[]),
            Frontend::bind("", "", &[]),
            Frontend::execute("", 0),
            Frontend::Sync,
        ]),
        Step::Expect(1),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn behind_an_upstream_each_client_logs_in_as_its_own_role() {
    let proxy = start_pgmemo(tenants_config()).await;
    let targets = [cluster().addr(), proxy.local_addr()];
    for (role, password) in [TENANT_A, TENANT_B] {
        // Twice: a second login finds the pool the first one made.
        for _ in 0..2 {
            let transcripts =
                differential(&targets, role, Some(password), TEST_DB, &whoami_script()).await;
            assert!(
                transcripts[0]
                    .iter()
                    .any(|l| l.contains("42501") && l.contains("login_secrets")),
                "the script must meet PostgreSQL's permission error: {:#?}",
                transcripts[0]
            );
            assert_same(&transcripts[0], &transcripts[1]);
        }
    }
    // A driver too: current_user, session_user and pg_stat_activity name the client's role.
    for (role, password) in [TENANT_A, TENANT_B] {
        let client = connect(&proxy_url(
            proxy.local_addr(),
            role,
            Some(password),
            TEST_DB,
        ))
        .await;
        let row = client
            .query_one(
                "SELECT current_user::text, session_user::text, \
                 (SELECT usename::text FROM pg_stat_activity WHERE pid = pg_backend_pid())",
                &[],
            )
            .await
            .unwrap();
        let names: (String, String, String) = (row.get(0), row.get(1), row.get(2));
        assert_eq!(
            names,
            (role.to_owned(), role.to_owned(), role.to_owned()),
            "{role}"
        );
    }
    // The console's SHOW DATABASES: no forced user but where a database names one.
    let admin = admin_console(proxy.local_addr()).await;
    let databases = admin_rows(&admin, "SHOW DATABASES").await;
    let force_user = |name: &str| {
        databases
            .iter()
            .find(|d| d["name"] == name)
            .map(|d| d["force_user"].clone())
    };
    assert_eq!(force_user(TEST_DB).as_deref(), Some(""), "{databases:#?}");
    assert_eq!(
        force_user(AS_OWNER).as_deref(),
        Some(PGMEMO_USER),
        "{databases:#?}"
    );
    proxy.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_with_a_user_logs_every_client_in_as_that_role() {
    let proxy = start_pgmemo(tenants_config()).await;
    for (role, password) in [TENANT_A, TENANT_B] {
        let client = connect(&proxy_url(
            proxy.local_addr(),
            role,
            Some(password),
            AS_OWNER,
        ))
        .await;
        let row = client
            .query_one(
                "SELECT current_user::text, session_user::text, \
                 (SELECT count(*) FROM login_notes)",
                &[],
            )
            .await
            .unwrap();
        let seen: (String, String, i64) = (row.get(0), row.get(1), row.get(2));
        // pgmemo is a superuser: no policy hides a row from it.
        assert_eq!(
            seen,
            (PGMEMO_USER.to_owned(), PGMEMO_USER.to_owned(), 3),
            "{role}"
        );
    }
    proxy.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_role_pgmemo_has_no_server_password_of_is_refused_not_logged_in_as_another() {
    set_up_tenants();
    // auth_type trust: pgmemo learns no password nor keys from the clients' logins.
    let mut config = test_config(PoolMode::Transaction, 2);
    config.general.auth_type = AuthType::Trust;
    config.users.insert(PGMEMO_USER.into(), user(None));
    config.users.insert(TENANT_A.0.into(), user(None));
    config.users.insert(TRUST_USER.into(), user(None));
    let proxy = start_pgmemo(config).await;
    let addr = proxy.local_addr();

    // PostgreSQL asks tenant_a for a SCRAM password pgmemo does not have.
    let e = tokio_postgres::connect(
        &proxy_url(addr, TENANT_A.0, None, TEST_DB),
        tokio_postgres::NoTls,
    )
    .await
    .err()
    .expect("tenant_a must not get in");
    let db = e.as_db_error().unwrap_or_else(|| panic!("{e:?}"));
    assert_eq!(
        (db.severity(), db.code().code(), db.message()),
        (
            "FATAL",
            "28P01",
            "pgmemo has no password to log into the server as \"tenant_a\""
        )
    );
    assert!(
        db.hint().is_some_and(|h| h.contains("[users]")),
        "{:?}",
        db.hint()
    );

    // A role the server trusts needs none; pgmemo's own role has the upstream's password.
    for (role, expected) in [(TRUST_USER, TRUST_USER), (PGMEMO_USER, PGMEMO_USER)] {
        let client = connect(&proxy_url(addr, role, None, TEST_DB)).await;
        let row = client
            .query_one("SELECT session_user::text", &[])
            .await
            .unwrap();
        assert_eq!(row.get::<_, String>(0), expected);
    }
    proxy.shutdown().await;
}
