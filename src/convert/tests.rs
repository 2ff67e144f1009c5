//! `pgmemo convert`: PgBouncer setups converted, loaded by pgmemo's own parser and checked
//! setting by setting; bad input refused with its line.

use super::*;
use crate::config::{Config, PoolMode, ServerTlsMode};
use std::time::Duration;

/// A directory of its own for each test's files, removed when the test is done with it.
fn dir(name: &str) -> Dir {
    let dir = std::env::temp_dir().join(format!("pgmemo-convert-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    Dir(dir)
}

/// See [`dir`].
struct Dir(PathBuf);

impl std::ops::Deref for Dir {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.0
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Converts `ini` (and `userlist`) written to files in `dir`.
fn convert_text(dir: &Path, ini: &str, userlist: Option<&str>) -> Result<Converted, ConvertError> {
    let ini_path = dir.join("pgbouncer.ini");
    std::fs::write(&ini_path, ini).unwrap();
    let users_path = dir.join("userlist.txt");
    if let Some(text) = userlist {
        std::fs::write(&users_path, text).unwrap();
    }
    convert(&ini_path, userlist.map(|_| users_path.as_path()))
}

/// The converted text, loaded as pgmemo loads a file.
fn load(converted: &Converted) -> Config {
    Config::from_toml_str(&converted.toml)
        .unwrap_or_else(|e| panic!("{e}\n--- converted:\n{}", converted.toml))
}

const SETUP: &str = "\
[databases]
app = host=db1.internal port=5433 dbname=app_prod pool_size=10 min_pool_size=2 pool_mode=transaction reserve_pool=3 max_db_connections=50
forced = host=/var/run/postgresql user=svc
reports = host='db2.internal' pool_mode=statement connect_query='SELECT 1' password=unused
* = host=fallback.internal port=6000 pool_size=5

[users]
alice = pool_mode=session pool_size=3 max_user_connections=4
carol = pool_size=2

[pgbouncer]
listen_addr = *
listen_port = 6433
auth_type = scram-sha-256
auth_file = /nonexistent/userlist.txt
auth_user = pgbouncer_auth
auth_query = SELECT usename, passwd FROM pg_shadow WHERE usename=$1
pool_mode = transaction
max_client_conn = 500
default_pool_size = 25
min_pool_size = 1
reserve_pool_size = 5
max_db_connections = 100
server_reset_query = DISCARD ALL
server_lifetime = 1800
server_idle_timeout = 0
query_wait_timeout = 30.5
server_tls_sslmode = verify-ca
server_tls_ca_file = /etc/ssl/ca.pem
admin_users = alice, nobody
stats_users = stats, svc
ignore_startup_parameters = extra_float_digits
max_prepared_statements = 0
logfile = /var/log/pgbouncer.log
bogus_key = 1
";

const USERS: &str = "\
\"alice\" \"alice_pw\"
\"svc\" \"svc_pw\"
;\"commented\" \"x\"
\"bob\" \"md5a3556571e93b0d20722ba62be61e8c2d\"
";

#[test]
fn a_pgbouncer_setup_with_databases_users_auth_and_limits_converts_and_loads() {
    let d = dir("setup");
    let converted = convert_text(&d, SETUP, Some(USERS)).unwrap();
    let c = load(&converted);
    let text = &converted.toml;
    let g = &c.general;
    assert_eq!(g.listen, "0.0.0.0:6433");
    assert_eq!(g.auth_type, AuthType::ScramSha256);
    assert_eq!(g.pool_mode, PoolMode::Transaction);
    assert_eq!(g.max_client_conn, 500);
    assert_eq!((g.default_pool_size, g.min_pool_size), (25, 1));
    assert_eq!(g.server_lifetime, Duration::from_secs(1800));
    assert_eq!(g.server_idle_timeout, Duration::from_secs(31_536_000));
    assert_eq!(g.query_wait_timeout, Duration::from_secs_f64(30.5));
    assert_eq!(g.server_tls, ServerTlsMode::VerifyFull);
    assert_eq!(g.server_tls_ca_file, Some(PathBuf::from("/etc/ssl/ca.pem")));
    assert!(!g.prepared_statements);
    assert_eq!(g.admin_users, ["alice"]);
    assert_eq!(g.stats_users, ["svc"], "stats has no password");
    assert_eq!(g.auth_user.as_deref(), Some("pgbouncer_auth"));
    assert_eq!(
        g.auth_query,
        "SELECT usename, passwd FROM pg_shadow WHERE usename=$1"
    );

    let app = &c.databases["app"];
    assert_eq!(app.host.as_deref(), Some("db1.internal"));
    assert_eq!(
        (app.port, app.dbname.as_deref()),
        (Some(5433), Some("app_prod"))
    );
    assert_eq!((app.pool_size, app.min_pool_size), (Some(10), Some(2)));
    // Without user=, each client logs into the server as its own role, as in PgBouncer.
    let own = c.resolve("app", "alice").unwrap();
    assert_eq!((own.server_user, own.server_password), (None, None));
    // A Unix socket directory is kept; user= makes every client log in as that fixed role,
    // whose password comes from the auth file.
    let forced = c.resolve("forced", "dave").unwrap();
    assert_eq!(
        (forced.host.as_str(), forced.port),
        ("/var/run/postgresql", 5432)
    );
    assert_eq!(forced.server_user.as_deref(), Some("svc"));
    assert_eq!(forced.server_password.as_deref(), Some("svc_pw"));
    // A listed database takes nothing from "*" in PgBouncer: not its port, nor its size.
    assert_eq!((forced.dbname.as_str(), forced.pool_size), ("forced", 25));
    let reports = c.resolve("reports", "svc").unwrap();
    assert_eq!(reports.pool_mode, PoolMode::Transaction);
    assert!(text.contains("pgmemo has no statement mode"), "{text}");
    // Any other name is served by "*".
    let other = c.resolve("other", "svc").unwrap();
    assert_eq!(
        (other.host.as_str(), other.port, other.pool_size),
        ("fallback.internal", 6000, 5)
    );

    let alice = &c.users["alice"];
    assert_eq!(alice.password.as_deref(), Some("alice_pw"));
    assert_eq!(
        (alice.pool_mode, alice.pool_size),
        (Some(PoolMode::Session), Some(3))
    );
    assert!(
        !c.users.contains_key("bob"),
        "an md5 hash cannot answer SCRAM"
    );
    assert!(!c.users.contains_key("carol"), "no password");
    for not in [
        "# not converted: connect_query = SELECT 1",
        "# not converted: password=... of reports",
        "# not converted: stats user \"stats\"",
        "# not converted: ignore_startup_parameters = extra_float_digits",
        "# not converted: logfile = /var/log/pgbouncer.log",
        "# not converted: admin user \"nobody\"",
        "# not converted: user \"bob\" (auth file line 4)",
        "# not converted: carol = pool_size=2",
        "# unknown: bogus_key = 1 (",
    ] {
        assert!(text.contains(not), "no {not:?} in\n{text}");
    }
    assert!(
        text.contains("line 35) — not a PgBouncer 1.25 setting"),
        "{text}"
    );
    assert_eq!(converted.warnings.len(), 1, "{:?}", converted.warnings);
    assert!(
        converted.warnings[0]
            .ends_with("pgbouncer.ini, line 35: unknown setting \"bogus_key\", left out"),
        "{:?}",
        converted.warnings
    );
}

#[test]
fn pgbouncer_defaults_that_differ_from_pgmemo_are_written_out() {
    let d = dir("defaults");
    let converted = convert_text(
        &d,
        "[databases]\ndb = host=127.0.0.1\n[pgbouncer]\nlisten_addr = 127.0.0.1\n\
         client_tls_key_file = /k.pem\nclient_tls_cert_file = /c.pem\n",
        Some("\"u\" \"md5a3556571e93b0d20722ba62be61e8c2d\"\n"),
    )
    .unwrap();
    let c = load(&converted);
    assert_eq!(c.general.pool_mode, PoolMode::Session);
    assert_eq!(c.general.auth_type, AuthType::Md5);
    assert_eq!(c.general.max_client_conn, 100);
    assert_eq!(c.general.server_tls, ServerTlsMode::Prefer);
    assert_eq!(c.general.max_prepared_statements, 200);
    assert_eq!(c.general.listen, "127.0.0.1:6432");
    assert_eq!(c.general.client_tls, crate::config::ClientTlsMode::Disable);
    assert_eq!(c.general.tls_key_file, Some(PathBuf::from("/k.pem")));
    assert_eq!(
        c.user_secret("u"),
        Some("md5a3556571e93b0d20722ba62be61e8c2d")
    );
    assert!(converted.warnings.is_empty(), "{:?}", converted.warnings);
}

#[test]
fn the_auth_file_named_by_auth_file_is_read_when_no_userlist_is_given() {
    let d = dir("auth-file");
    std::fs::write(d.join("users.txt"), "\"app\" \"secret\"\n").unwrap();
    let ini = "[databases]\napp = host=h\n[pgbouncer]\nauth_file = users.txt\nauth_type = trust\n";
    let converted = convert_text(&d, ini, None).unwrap();
    let c = load(&converted);
    assert_eq!(c.general.auth_type, AuthType::Trust);
    assert_eq!(c.user_secret("app"), Some("secret"));
    assert!(converted.toml.contains("auth_file = users.txt"));

    // Unreadable: said in the file and on stderr, and pgmemo would refuse the result.
    let ini = "[databases]\napp = host=h\n[pgbouncer]\nauth_file = /nonexistent/u.txt\n";
    let converted = convert_text(&d, ini, None).unwrap();
    assert!(converted
        .toml
        .contains("# not converted: auth_file = /nonexistent/u.txt"));
    let warnings = converted.warnings.join("\n");
    assert!(
        warnings.contains("line 4: cannot read auth_file"),
        "{warnings}"
    );
    assert!(warnings.contains("no user has a password"), "{warnings}");
    assert!(Config::from_toml_str(&converted.toml).is_err());
}

#[test]
fn include_files_are_followed() {
    let d = dir("include");
    let part = d.join("databases.ini");
    std::fs::write(&part, "[databases]\nincluded = host=inc\n").unwrap();
    let ini = format!(
        "%include {}\n[pgbouncer]\nauth_type = trust\n",
        part.display()
    );
    let c = load(&convert_text(&d, &ini, None).unwrap());
    assert_eq!(c.databases["included"].host.as_deref(), Some("inc"));

    let ini = "[pgbouncer]\n%include /nonexistent/other.ini\n";
    let e = convert_text(&d, ini, None).unwrap_err().to_string();
    assert!(
        e.contains("/nonexistent/other.ini") && e.contains("line 2"),
        "{e}"
    );
}

#[test]
fn bad_input_is_an_error_with_its_line() {
    let d = dir("bad");
    for (ini, userlist, line, what) in [
        ("[pgbouncer]\nlisten_port 6432\n", None, 2, "syntax error"),
        ("[pgbouncer\n", None, 1, "syntax error"),
        (
            "[pgbouncer]\n\ndefault_pool_size = lots\n",
            None,
            3,
            "default_pool_size",
        ),
        ("[pgbouncer]\npool_mode = sometimes\n", None, 2, "pool_mode"),
        ("[pgbouncer]\nauth_type = kerberos\n", None, 2, "auth_type"),
        ("[databases]\na = host=h port=x\n", None, 2, "port"),
        ("[databases]\na = host='h\n", None, 2, "closing quote"),
        ("[users]\nu = pool_mode=sometimes\n", None, 2, "pool_mode"),
        (
            "[pgbouncer]\n",
            Some("\"a\" \"b\"\nc d\n"),
            2,
            "malformed auth file line",
        ),
        (
            "[pgbouncer]\n",
            Some("\"a\" \"SCRAM-SHA-256$4096:salt$x:y\"\n"),
            1,
            "malformed SCRAM verifier",
        ),
    ] {
        let e = convert_text(&d, ini, userlist).unwrap_err();
        let text = e.to_string();
        assert_eq!(e.line(), Some(line), "{ini:?}: {text}");
        assert!(text.contains(&format!("line {line}: ")), "{text}");
        assert!(text.contains(what), "{ini:?}: {text}");
    }
}

#[test]
fn every_pgbouncer_key_has_a_row_in_the_migration_guide() {
    let guide = include_str!("../../docs/migrating-from-pgbouncer.md");
    for (key, rule) in keys::PGBOUNCER_KEYS {
        let row = guide
            .lines()
            .find(|l| l.starts_with(&format!("| `{key}` |")))
            .unwrap_or_else(|| panic!("docs/migrating-from-pgbouncer.md has no row for {key}"));
        if let keys::Rule::To(to, _) = rule {
            assert!(
                row.contains(to),
                "the row of {key} does not name {to}: {row}"
            );
        }
        if let keys::Rule::Not(why) = rule {
            assert!(
                row.contains("not converted") && row.contains(why),
                "{key}: {row}"
            );
        }
    }
    for (key, _) in keys::DATABASE_NOT.iter().chain(keys::USER_NOT) {
        assert!(
            guide.contains(&format!("`{key}`")),
            "the guide does not mention {key}"
        );
    }
}

/// PgBouncer's client limits, transaction_timeout, per-user timeouts and per-database
/// auth_user/auth_query/auth_dbname are carried over (they were "not converted").
#[test]
fn client_limits_timeouts_and_per_database_auth_query_convert() {
    let d = dir("client-limits");
    let ini = "\
[databases]
app = host=db1 auth_user=lookup auth_dbname=authdb auth_query='SELECT u, p FROM s WHERE u=$1' max_db_client_connections=7
authdb = host=db1

[users]
alice = max_user_client_connections=3 query_timeout=4 idle_transaction_timeout=5 transaction_timeout=6 client_idle_timeout=7

[pgbouncer]
listen_port = 6432
auth_file = userlist.txt
max_db_client_connections = 100
max_user_client_connections = 20
transaction_timeout = 30
";
    let converted = convert_text(&d, ini, Some("\"alice\" \"pw\"\n\"lookup\" \"pw2\"\n")).unwrap();
    let c = load(&converted);
    let g = &c.general;
    assert_eq!(
        (g.max_db_client_connections, g.max_user_client_connections),
        (100, 20)
    );
    assert_eq!(g.transaction_timeout, Duration::from_secs(30));
    let app = &c.databases["app"];
    assert_eq!(app.max_db_client_connections, Some(7));
    assert_eq!(
        c.auth_lookup("app"),
        Some(crate::config::AuthLookup {
            user: "lookup".into(),
            query: "SELECT u, p FROM s WHERE u=$1".into(),
            dbname: "authdb".into(),
        })
    );
    assert_eq!(c.auth_lookup("authdb"), None);
    let alice = &c.users["alice"];
    assert_eq!(alice.max_user_client_connections, Some(3));
    let secs = |n| Some(Duration::from_secs(n));
    assert_eq!(
        (
            alice.query_timeout,
            alice.idle_transaction_timeout,
            alice.transaction_timeout,
            alice.client_idle_timeout
        ),
        (secs(4), secs(5), secs(6), secs(7))
    );
    assert!(
        !converted.toml.contains("# not converted: "),
        "{}",
        converted.toml
    );
}

#[test]
fn a_host_list_becomes_a_balanced_connstring() {
    let dir = dir("hosts");
    let converted = convert_text(
        &dir,
        "[databases]\n\
         app = host=r1.internal,r2.internal port=6000 dbname=app_prod user=svc password='s p' pool_size=7\n\
         pinned = host=a,b load_balance_hosts=disable\n\
         * = host=c,d\n\
         [pgbouncer]\nauth_type = md5\n",
        Some("\"svc\" \"s p\"\n"),
    )
    .unwrap();
    let c = load(&converted);
    let app = &c.databases["app"];
    assert_eq!(
        (app.host.as_deref(), app.port, app.fallbacks.clone()),
        (
            Some("r1.internal"),
            Some(6000),
            vec![("r2.internal".to_string(), 6000)]
        )
    );
    assert_eq!(app.options.balance, crate::config::HostOrder::RoundRobin);
    assert_eq!(
        (
            app.dbname.as_deref(),
            app.user.as_deref(),
            app.password.as_deref()
        ),
        (Some("app_prod"), Some("svc"), Some("s p"))
    );
    assert_eq!(app.pool_size, Some(7));
    let pinned = &c.databases["pinned"];
    assert_eq!(pinned.options.balance, crate::config::HostOrder::InOrder);
    assert_eq!(pinned.fallbacks, vec![("b".to_string(), 5432)]);
    let star = c.resolve("other", "u").unwrap();
    assert_eq!((star.host.as_str(), star.fallbacks.len()), ("c", 1));
    assert!(
        !converted.toml.contains("\nload_balance_hosts"),
        "{}",
        converted.toml
    );
    let bad = convert_text(
        &dir,
        "[databases]\nx = host=a,b load_balance_hosts=maybe\n",
        None,
    );
    assert!(bad.is_err());
}
