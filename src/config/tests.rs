//! Configuration tests: what the file may say, what is refused and how the refusal reads.

use super::locate::locate;
use super::*;
use std::time::Duration;

/// The message of a configuration that must be refused.
fn refused(toml: &str) -> String {
    match Config::from_toml_str(toml) {
        Ok(c) => panic!("accepted: {c:?}"),
        Err(e) => e.to_string(),
    }
}

const UPSTREAM: &str = "[upstream]\nurl = \"postgresql://app:pw@db.example:5433\"\n";

fn with_upstream(extra: &str) -> String {
    format!("{extra}\n{UPSTREAM}")
}

#[test]
fn an_upstream_alone_gets_every_default() {
    let c = Config::from_toml_str(UPSTREAM).unwrap();
    assert_eq!(c.general, General::default());
    let g = &c.general;
    assert_eq!(g.listen, "127.0.0.1:6432");
    assert_eq!(g.pool_mode, PoolMode::Transaction);
    assert_eq!(g.default_pool_size, 20);
    assert_eq!(g.min_pool_size, 0);
    assert_eq!(g.max_client_conn, 1000);
    assert_eq!(g.auth_type, AuthType::ScramSha256);
    assert_eq!(g.query_wait_timeout, Duration::from_secs(120));
    assert_eq!(g.server_connect_timeout, Duration::from_secs(15));
    assert_eq!(g.server_idle_timeout, Duration::from_secs(600));
    assert_eq!(g.server_lifetime, Duration::from_secs(3600));
    assert_eq!(g.server_check_delay, Duration::from_secs(30));
    assert_eq!(g.server_check_query, ";");
    assert_eq!(g.client_login_timeout, Duration::from_secs(60));
    assert_eq!(g.shutdown_timeout, Duration::from_secs(30));
    assert_eq!(g.server_reset_query, "DISCARD ALL");
    assert!(!g.server_reset_query_always);
    assert_eq!(g.max_message_size, 64 * 1024 * 1024);
    assert_eq!(g.client_tls, ClientTlsMode::Disable);
    assert_eq!(g.server_tls, ServerTlsMode::Disable);
    assert!(g.prepared_statements);
    assert_eq!(g.max_prepared_statements, 500);
    assert_eq!(g.log_level, "info");
    assert!(c.databases.is_empty() && c.users.is_empty());
    assert_eq!(c.source, None);
}

#[test]
fn cache_settings_are_checked_after_the_flags_too() {
    let mut c = Config::from_toml_str(UPSTREAM).unwrap();
    c.cache.refresh_at = 0.2;
    let e = c.validate().unwrap_err().to_string();
    assert!(
        e.contains("cache.refresh_at: must be between 0.5 and 1"),
        "{e}"
    );
}

#[test]
fn pinned_limits_are_checked() {
    let g = General::default();
    assert_eq!(g.pinned_idle_timeout, Duration::ZERO);
    assert_eq!(g.max_pinned_fraction, 0.5);
    let c = Config::from_toml_str(&with_upstream(
        "[general]\npinned_idle_timeout = 1.5\nmax_pinned_fraction = 1",
    ))
    .unwrap();
    c.validate().unwrap();
    assert_eq!(c.general.pinned_idle_timeout, Duration::from_millis(1500));
    assert_eq!(c.general.max_pinned_fraction, 1.0);
    let e = refused(&with_upstream("[general]\nmax_pinned_fraction = 1.5"));
    assert!(
        e.contains("general.max_pinned_fraction: must be 0..=1"),
        "{e}"
    );
}

#[test]
fn the_scale_out_sample_loads() {
    let c = Config::from_toml_str(include_str!("../../docs/scale-out/pgmemo.toml")).unwrap();
    c.validate().unwrap();
    assert_eq!(
        c.cache.invalidation,
        crate::config::cache::Invalidation::Wal
    );
    assert_eq!(c.cache.max_lag, Some(std::time::Duration::from_secs(2)));
}

#[test]
fn the_example_file_loads_and_documents_the_defaults() {
    let c = Config::from_toml_str(include_str!("../../pgmemo.example.toml")).unwrap();
    // The example writes every [general] setting at its default value.
    assert_eq!(c.general, General::default());
    assert!(c.upstream.is_some());
    assert!(c.databases.contains_key("app"));
    assert!(c.databases.contains_key("*"));
    assert_eq!(
        SecretKind::of(c.user_secret("alice").unwrap()),
        Ok(SecretKind::ScramSha256)
    );
    assert_eq!(
        SecretKind::of(c.user_secret("bob").unwrap()),
        Ok(SecretKind::Plain)
    );
}

#[test]
fn durations_are_seconds_as_integer_or_float() {
    let c = Config::from_toml_str(&with_upstream(
        "[general]\nquery_wait_timeout = 5\nserver_connect_timeout = 0.5\nserver_check_delay = 0",
    ))
    .unwrap();
    assert_eq!(c.general.query_wait_timeout, Duration::from_secs(5));
    assert_eq!(c.general.server_connect_timeout, Duration::from_millis(500));
    assert_eq!(c.general.server_check_delay, Duration::ZERO);

    let e = refused(&with_upstream("[general]\nquery_wait_timeout = \"2m\""));
    assert!(e.contains("line 2: general.query_wait_timeout:"), "{e}");
    assert!(e.contains("a number of seconds"), "{e}");
    let e = refused(&with_upstream("[general]\nserver_lifetime = -1"));
    assert!(
        e.contains("general.server_lifetime: must be a number of seconds, 0 or more"),
        "{e}"
    );
    let e = refused(&with_upstream("[general]\nquery_wait_timeout = 0"));
    assert!(
        e.contains("general.query_wait_timeout: must be more than 0 seconds"),
        "{e}"
    );
}

#[test]
fn each_error_names_its_key() {
    let cases: &[(&str, &str)] = &[
        (
            "[general]\npool_mode = \"foo\"",
            r#"general.pool_mode: expected "session" or "transaction", got "foo""#,
        ),
        (
            "[general]\nauth_type = \"password\"",
            "general.auth_type: expected \"trust\"",
        ),
        (
            "[general]\nlisten = \"6432\"",
            "general.listen: expected HOST:PORT",
        ),
        (
            "[general]\nlisten = \"::1:6432\"",
            "general.listen: put an IPv6 address in brackets",
        ),
        (
            "[general]\nmetrics_listen = \"x\"",
            "general.metrics_listen: expected HOST:PORT",
        ),
        (
            "[general]\nunix_socket_mode = \"0778\"",
            "general.unix_socket_mode: expected a file mode in octal, 0000 to 0777, got \"0778\"",
        ),
        (
            "[general]\nunix_socket_mode = \"1777\"",
            "general.unix_socket_mode: expected a file mode in octal",
        ),
        (
            "[general]\ndefault_pool_size = 0",
            "general.default_pool_size: must be at least 1",
        ),
        (
            "[general]\ndefault_pool_size = -3",
            "general.default_pool_size: must be a whole number",
        ),
        (
            "[general]\nmin_pool_size = 30",
            "general.min_pool_size: must not exceed general.default_pool_size (20)",
        ),
        (
            "[general]\nmax_client_conn = 0",
            "general.max_client_conn: must be at least 1",
        ),
        (
            "[general]\nmax_message_size = 10",
            "general.max_message_size: must be 1024..=",
        ),
        (
            "[general]\nserver_check_query = \"\"",
            "general.server_check_query: must not be empty",
        ),
        (
            "[general]\nlog_level = \"loud\"",
            "general.log_level: expected a level",
        ),
        (
            "[general]\ntls_key_file = \"k.pem\"",
            "general.tls_key_file: set tls_cert_file too",
        ),
        (
            "[general]\ntls_cert_file = \"c.pem\"",
            "general.tls_cert_file: set tls_key_file too",
        ),
        (
            "[general]\nclient_tls = \"require\"",
            "general.client_tls: \"require\" needs tls_cert_file and tls_key_file",
        ),
        (
            "[general]\nserver_tls = \"verify-ca\"",
            "general.server_tls: expected \"disable\"",
        ),
        (
            "[general]\nserver_reset_query_always = \"yes\"",
            "general.server_reset_query_always: invalid type",
        ),
        (
            "[databases.app]\nport = 0",
            "databases.app.port: must be 1..=65535",
        ),
        (
            "[databases.app]\nport = 70000",
            "databases.app.port: must be 1..=65535",
        ),
        (
            "[databases.app]\npool_mode = \"statement\"",
            "databases.app.pool_mode: expected",
        ),
        (
            "[databases.app]\npassword = \"x\"",
            "databases.app.password: set user too",
        ),
        (
            "[databases.app]\npool_size = 0",
            "databases.app.pool_size: must be at least 1",
        ),
        (
            "[databases.app]\nmin_pool_size = 21",
            "databases.app.min_pool_size: must not exceed the pool size (20)",
        ),
        (
            "[databases.pgmemo]\n",
            "databases.pgmemo: the name \"pgmemo\" is reserved",
        ),
        (
            "[databases.\"*\"]\nport = 0",
            "databases.\"*\".port: must be 1..=65535",
        ),
        (
            "[users.alice]\npool_size = 1",
            "users.alice.password: missing",
        ),
        (
            "[users.alice]\npassword = \"\"",
            "users.alice.password: must not be empty",
        ),
        (
            "[users.alice]\npassword = \"SCRAM-SHA-256$4096:c2FsdA==$bad\"",
            "users.alice.password: malformed SCRAM verifier",
        ),
        (
            "[users.alice]\npassword = \"md5zzzzzzzzzzzzzzzzzzzzzzzzzzzzzzzz\"",
            "users.alice.password: looks like an md5 hash",
        ),
        (
            "[users.alice]\npassword = \"md5a3556571e93b0d20722ba62be61e8c2d\"",
            "users.alice.password: an md5 hash cannot answer auth_type \"scram-sha-256\"",
        ),
        (
            "[users.alice]\npool_mode = \"x\"\npassword = \"p\"",
            "users.alice.pool_mode: expected",
        ),
        (
            "[general]\nadmin_users = [\"root\"]",
            "general.admin_users: \"root\" has no password among the users",
        ),
    ];
    for (toml, expected) in cases {
        let e = refused(&with_upstream(toml));
        assert!(
            e.contains(expected),
            "for {toml:?}:\n got {e}\n want {expected}"
        );
    }
}

#[test]
fn upstream_section_errors_name_their_key() {
    let e = refused("[upstream]\nurl = \"mysql://a@b\"");
    assert!(
        e.contains("line 2: upstream.url: not a postgresql:// URL"),
        "{e}"
    );
    let e = refused("[upstream]\nurl = \"postgresql://a@b\"\nhost = \"c\"");
    assert!(e.contains("upstream.host: give either upstream.url"), "{e}");
    let e = refused("[upstream]\nhost = \"c\"");
    assert!(e.contains("upstream.user: missing"), "{e}");
    let e = refused("[upstream]\nuser = \"u\"\npassword = \"p\"\nport = 0");
    assert!(e.contains("upstream.port: must be 1..=65535"), "{e}");
    let e = refused("[general]\nlisten = \"127.0.0.1:6432\"");
    assert!(e.contains("upstream: missing"), "{e}");
    let e = refused("[upstream]\nuser = \"u\"");
    assert!(e.contains("users: no client could log in"), "{e}");
    // A password may sit beside a URL without one.
    let c =
        Config::from_toml_str("[upstream]\nurl = \"postgresql://u@h\"\npassword = \"p\"").unwrap();
    assert_eq!(c.user_secret("u"), Some("p"));
    // A database with no host anywhere.
    let e = refused("[general]\nauth_type = \"trust\"\n[databases.app]\nport = 5432");
    assert!(e.contains("databases.app.host: missing"), "{e}");
}

#[test]
fn unknown_keys_are_refused_by_name_and_line() {
    let e = refused(&with_upstream(
        "[general]\nlisten = \"127.0.0.1:6432\"\npool_sise = 3",
    ));
    assert!(
        e.contains("line 3: general.pool_sise: unknown key `pool_sise`"),
        "{e}"
    );
    let e = refused(&with_upstream("[databases.app]\nhots = \"x\""));
    assert!(e.contains("databases.app.hots: unknown key"), "{e}");
    let e = refused(&with_upstream("[genral]\nlisten = \"x:1\""));
    assert!(e.contains("line 1: genral: unknown key"), "{e}");
    let e = refused(&format!("{UPSTREAM}bogus = 1"));
    assert!(e.contains("upstream.bogus: unknown key"), "{e}");
}

#[test]
fn errors_from_a_file_name_the_file_in_one_line() {
    let dir = std::env::temp_dir().join(format!("pgmemo-config-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("bad.toml");
    std::fs::write(&path, with_upstream("[general]\npool_mode = \"foo\"")).unwrap();
    let e = Config::load(&path).unwrap_err().to_string();
    assert_eq!(
        e,
        format!(
            "{}, line 2: general.pool_mode: expected \"session\" or \"transaction\", got \"foo\"",
            path.display()
        )
    );
    // A rule over several keys points at the line of the key it names.
    std::fs::write(
        &path,
        with_upstream("[general]\nlisten = \"0.0.0.0:6432\"\nauth_type = \"trust\""),
    )
    .unwrap();
    let e = Config::load(&path).unwrap_err().to_string();
    assert!(
        e.starts_with(&format!("{}, line 3: general.auth_type: ", path.display())),
        "{e}"
    );
    // A syntax error names the line, and no setting.
    std::fs::write(&path, "[general]\n[general\nlisten = 1").unwrap();
    let e = Config::load(&path).unwrap_err().to_string();
    assert!(
        e.starts_with(&format!("{}, line 2: invalid table header", path.display())),
        "{e}"
    );
    assert!(!e.contains('\n'), "{e}");
    // Relative TLS paths are relative to the file; `source` remembers the file.
    std::fs::write(
        &path,
        with_upstream("[general]\ntls_cert_file = \"c.pem\"\ntls_key_file = \"/k.pem\""),
    )
    .unwrap();
    let c = Config::load(&path).unwrap();
    assert_eq!(c.general.tls_cert_file, Some(dir.join("c.pem")));
    assert_eq!(c.general.tls_key_file, Some(PathBuf::from("/k.pem")));
    assert_eq!(c.general.client_tls, ClientTlsMode::Allow);
    assert_eq!(c.source, Some(path.clone()));
    let e = Config::load(&dir.join("missing.toml"))
        .unwrap_err()
        .to_string();
    assert!(e.starts_with("cannot read config file "), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn trust_is_refused_on_a_non_loopback_address() {
    for listen in [
        "0.0.0.0:6432",
        "10.0.0.5:6432",
        "[::]:6432",
        "db.example:6432",
    ] {
        let e = refused(&with_upstream(&format!(
            "[general]\nauth_type = \"trust\"\nlisten = \"{listen}\""
        )));
        assert!(e.contains("general.auth_type: \"trust\""), "{e}");
        assert!(e.contains("loopback"), "{e}");
    }
    for listen in [
        "127.0.0.1:6432",
        "127.0.0.2:1",
        "[::1]:6432",
        "localhost:6432",
    ] {
        Config::from_toml_str(&with_upstream(&format!(
            "[general]\nauth_type = \"trust\"\nlisten = \"{listen}\""
        )))
        .unwrap();
    }
}

#[test]
fn upstream_urls() {
    let u = parse_upstream_url("postgresql://app:s3cret@db.example:5433/ignored").unwrap();
    assert_eq!(
        (
            u.host.as_str(),
            u.port,
            u.user.as_str(),
            u.password.as_deref()
        ),
        ("db.example", 5433, "app", Some("s3cret"))
    );
    let u = parse_upstream_url("postgres://app@").unwrap();
    assert_eq!(
        (u.host.as_str(), u.port, u.password),
        ("127.0.0.1", 5432, None)
    );
    let u = parse_upstream_url("postgresql://app@localhost").unwrap();
    assert_eq!((u.host.as_str(), u.port), ("localhost", 5432));
    let u = parse_upstream_url("postgresql://a%40b:p%3Aw%2F@[::1]:6000/").unwrap();
    assert_eq!(
        (
            u.host.as_str(),
            u.port,
            u.user.as_str(),
            u.password.as_deref()
        ),
        ("::1", 6000, "a@b", Some("p:w/"))
    );
    let u = parse_upstream_url("postgresql://app:@[::1]").unwrap();
    assert_eq!(
        (u.host.as_str(), u.port, u.password.as_deref()),
        ("::1", 5432, Some(""))
    );
    // A password may contain '@' percent-encoded; SHOW CONFIG and logs never show it.
    let u = parse_upstream_url("postgresql://app:p%40ss@h:1").unwrap();
    assert_eq!(u.password.as_deref(), Some("p@ss"));
    assert_eq!(u.display_url(), "postgresql://app@h:1");
    assert!(!format!("{u:?}").contains("p@ss"));
    // A libpq connection string works as well as a URL, with several hosts and options.
    let u = parse_upstream_url(
        "host=/var/run/postgresql,db2 port=5433,5434 user=app password=pw \
         sslmode=require target_session_attrs=read-write",
    )
    .unwrap();
    assert_eq!((u.host.as_str(), u.port), ("/var/run/postgresql", 5433));
    assert_eq!(u.fallbacks, vec![("db2".to_string(), 5434)]);
    assert_eq!(u.options.tls, Some(ServerTlsMode::Require));
    assert_eq!(u.options.session_attrs.as_str(), "read-write");
    assert_eq!(
        u.display_url(),
        "postgresql://app@%2Fvar%2Frun%2Fpostgresql:5433,db2:5434\
         ?sslmode=require&target_session_attrs=read-write"
    );

    for (url, expected) in [
        ("mysql://a@b", "not a postgresql:// URL"),
        ("db.example:5432", "invalid connection string"),
        ("postgresql://db.example:5432", "a user is required"),
        ("postgresql://:pw@db", "a user is required"),
        ("postgresql://a@b:0", "must be 1..=65535"),
        ("postgresql://a@b:99999", "invalid value for option `port`"),
        ("postgresql://a@b:x", "invalid value for option `port`"),
        ("postgresql://a@b/db?sslmode=sometimes", "`sslmode`"),
        ("postgresql://a@b/db?colour=blue", "unknown option `colour`"),
        ("host=b user=a colour=blue", "unknown option `colour`"),
    ] {
        let e = parse_upstream_url(url).unwrap_err();
        assert_eq!(e.key(), Some("upstream.url"));
        let e = e.to_string();
        assert!(
            e.starts_with("upstream.url: ") && e.contains(expected),
            "{url}: {e}"
        );
    }
}

#[test]
fn resolve_without_databases_serves_every_name_from_the_upstream() {
    let c = Config::from_toml_str(UPSTREAM).unwrap();
    let r = c.resolve("shop", "anyone").unwrap();
    assert_eq!(
        (r.host.as_str(), r.port, r.dbname.as_str()),
        ("db.example", 5433, "shop")
    );
    // The upstream's user is pgmemo's own role, not a forced one: a client logs in as itself.
    assert_eq!((r.server_user, r.server_password), (None, None));
    // A client who is the upstream's user logs in as itself with the upstream's password.
    let r = c.resolve("shop", "app").unwrap();
    assert_eq!(r.server_user, None);
    assert_eq!(r.server_password.as_deref(), Some("pw"));
    assert_eq!(
        (r.pool_size, r.min_pool_size, r.pool_mode),
        (20, 0, PoolMode::Transaction)
    );
    assert_eq!(
        c.resolve("pgmemo", "app"),
        None,
        "the admin console is not a pool"
    );
    assert_eq!(c.user_secret("app"), Some("pw"));
    assert_eq!(c.user_secret("other"), None);
}

#[test]
fn resolve_precedence_user_over_database_over_wildcard_over_general() {
    let c = Config::from_toml_str(&with_upstream(
        r#"
[general]
default_pool_size = 10
min_pool_size = 2
pool_mode = "transaction"

[databases.app]
dbname = "app_production"
host = "app-db"
pool_size = 5

[databases.reports]
user = "reporter"
password = "rpw"
pool_mode = "session"

[databases."*"]
port = 6000
pool_size = 7
min_pool_size = 1

[users.alice]
password = "a"
pool_size = 3
pool_mode = "session"

[users.bob]
password = "b"
"#,
    ))
    .unwrap();

    let r = c.resolve("app", "alice").unwrap();
    assert_eq!(
        (r.host.as_str(), r.port, r.dbname.as_str()),
        ("app-db", 6000, "app_production")
    );
    assert_eq!(
        (r.pool_size, r.pool_mode, r.min_pool_size),
        (3, PoolMode::Session, 1)
    );
    assert_eq!(r.server_user, None, "not [upstream]'s: alice's own role");

    let r = c.resolve("app", "bob").unwrap();
    assert_eq!((r.pool_size, r.pool_mode), (5, PoolMode::Transaction));

    let r = c.resolve("reports", "bob").unwrap();
    assert_eq!(
        (r.host.as_str(), r.port, r.dbname.as_str()),
        ("db.example", 6000, "reports")
    );
    assert_eq!(r.server_user.as_deref(), Some("reporter"));
    assert_eq!(r.server_password.as_deref(), Some("rpw"));
    assert_eq!((r.pool_size, r.pool_mode), (7, PoolMode::Session));
    assert_eq!(c.own_password("reporter"), None);

    let r = c.resolve("other", "bob").unwrap();
    assert_eq!((r.dbname.as_str(), r.port, r.pool_size), ("other", 6000, 7));

    // With [users], the upstream role is not a client user by itself.
    assert_eq!(c.user_secret("app"), None);
    assert_eq!(c.user_secret("alice"), Some("a"));
    assert_eq!(c.user_secret("nobody"), None);
}

#[test]
fn a_database_user_forces_the_login_and_takes_the_upstream_password_for_its_role() {
    let c = Config::from_toml_str(&with_upstream(
        r#"
[databases."*"]
user = "app"

[databases.reports]
user = "reporter"

[users.alice]
password = "a"
"#,
    ))
    .unwrap();
    // "*"'s user is every listed database's too, unless it names its own.
    let r = c.resolve("shop", "alice").unwrap();
    assert_eq!(r.server_user.as_deref(), Some("app"));
    assert_eq!(r.server_password.as_deref(), Some("pw"), "[upstream]'s");
    let r = c.resolve("reports", "alice").unwrap();
    assert_eq!(r.server_user.as_deref(), Some("reporter"));
    assert_eq!(
        r.server_password, None,
        "not the upstream role: no password of its own"
    );
}

#[test]
fn resolve_without_wildcard_knows_only_listed_databases() {
    let c = Config::from_toml_str(
        "[general]\nauth_type = \"trust\"\n[databases.app]\nhost = \"h\"\nmin_pool_size = 5",
    )
    .unwrap();
    let r = c.resolve("app", "anyone").unwrap();
    assert_eq!((r.host.as_str(), r.port, r.server_user), ("h", 5432, None));
    assert_eq!(r.min_pool_size, 5);
    assert_eq!(c.resolve("other", "anyone"), None);
    assert_eq!(c.resolve("*", "anyone"), None);
}

#[test]
fn min_pool_size_is_capped_at_the_pool_size() {
    let c = Config::from_toml_str(&with_upstream(
        "[general]\nmin_pool_size = 4\n[users.alice]\npassword = \"a\"\npool_size = 2",
    ))
    .unwrap();
    let r = c.resolve("x", "alice").unwrap();
    assert_eq!((r.pool_size, r.min_pool_size), (2, 2));
}

#[test]
fn secrets() {
    let verifier = "SCRAM-SHA-256$4096:W22ZaJ0SNY7soEsUEjb6gQ==$WG5d8oPm3OtcPnkdi4Uo7BkeZkBFzpcXkuLmtbsT4qY=:HKZbgHu9Rw8b6/W+fFI6bGyg8wJWrAf6ZHh9i/t2sC4=";
    assert_eq!(SecretKind::of(verifier), Ok(SecretKind::ScramSha256));
    assert_eq!(
        SecretKind::of("md5a3556571e93b0d20722ba62be61e8c2d"),
        Ok(SecretKind::Md5)
    );
    assert_eq!(SecretKind::of("md5short"), Ok(SecretKind::Plain));
    assert_eq!(SecretKind::of("hunter2"), Ok(SecretKind::Plain));
    assert!(SecretKind::of("SCRAM-SHA-256$0:c2FsdA==$a:b").is_err());
    let c = Config::from_toml_str(&with_upstream(
        "[general]\nauth_type = \"md5\"\n[users.alice]\npassword = \"md5a3556571e93b0d20722ba62be61e8c2d\"",
    ))
    .unwrap();
    assert!(
        !format!("{c:?}").contains("a3556571"),
        "Debug hides passwords"
    );
}

#[test]
fn settings_table_lists_every_setting_and_no_password() {
    let c = Config::from_toml_str(&with_upstream("[general]\nquery_wait_timeout = 0.5")).unwrap();
    let rows = c.settings_table();
    let row = |k: &str| rows.iter().find(|r| r.0 == k).unwrap().clone();
    assert_eq!(
        row("query_wait_timeout"),
        (
            "query_wait_timeout".into(),
            "0.5".into(),
            "120".into(),
            true
        )
    );
    assert!(!row("listen").3);
    assert_eq!(row("upstream").1, "postgresql://app@db.example:5433");
    assert!(rows.iter().all(|r| !r.1.contains("pw")));
    assert_eq!(rows.len(), 78);
}

#[test]
fn locate_finds_keys_in_tables_dotted_keys_and_multiline_values() {
    let text =
        "a = 1\n[general]\nlisten = \"x\"\nadmin_users = [\n  1,\n]\n[databases.\"*\"]\nport = 0\n";
    let at = |needle: &str| locate(text, text.find(needle).unwrap());
    assert_eq!(at("a ="), (1, Some("a".into())));
    assert_eq!(at("\"x\""), (3, Some("general.listen".into())));
    assert_eq!(at("1,"), (5, Some("general.admin_users".into())));
    assert_eq!(at("[databases"), (7, Some("databases.\"*\"".into())));
    assert_eq!(at("0\n"), (8, Some("databases.\"*\".port".into())));
    assert_eq!(find_key_line(text, "databases.\"*\".port"), Some(8));
    assert_eq!(find_key_line(text, "general.listen"), Some(3));
    assert_eq!(find_key_line(text, "general.nothing"), None);
}

#[test]
fn errors_in_arrays_of_tables_and_inline_tables_name_their_element_and_line() {
    let e = refused(&with_upstream("[[cache.rules]]\nquery = \"x\"\nbogus = 1"));
    assert!(
        e.starts_with("line 3: cache.rules[0].bogus: unknown key `bogus`"),
        "{e}"
    );
    let e = refused(&with_upstream(
        "[[cache.rules]]\nquery = \"x\"\n[[cache.rules]]\nquery = \"y\"\nttl = \"soon\"",
    ));
    assert!(
        e.starts_with("line 5: cache.rules[1].ttl: must be a duration"),
        "{e}"
    );
    let e = refused(&with_upstream("[databases]\napp = { host = \"\" }"));
    assert!(
        e.starts_with("line 2: databases.app.host: must not be empty"),
        "{e}"
    );
    let e = refused(&with_upstream(
        "[general]\nadmin_users = [\n  \"a\",\n  1,\n]",
    ));
    assert!(
        e.starts_with("line 4: general.admin_users: invalid type"),
        "{e}"
    );
}

/// The reference cannot drift from the table: every `[general]` setting has its paragraph in
/// `pgmemo.example.toml` (its line commented out when it has no value to write), marked
/// "(restart)" exactly when a RELOAD does not change it.
#[test]
fn the_example_file_documents_every_setting_and_its_reload_class() {
    let example = include_str!("../../pgmemo.example.toml");
    let general = &example[..example.find("\n[upstream]").unwrap()];
    documents("general", general, General::reference());
}

/// The same for every `[cache]` setting, in the file's `[cache]` section (up to its rules).
#[test]
fn the_example_file_documents_every_cache_setting_and_its_reload_class() {
    let example = include_str!("../../pgmemo.example.toml");
    let cache = &example[example.find("\n[cache]").unwrap()..];
    let cache = &cache[..cache.find("[[cache.rules]]").unwrap()];
    documents("cache", cache, cache::CacheConfig::reference());
    // And writes each at its default.
    let c = Config::from_toml_str(example).unwrap();
    assert_eq!(c.cache, cache::CacheConfig::default());
}

/// Each setting of `reference` is written in `section` (the text of `[name]`), its
/// paragraph saying "(restart)" exactly when it is `Restart`.
fn documents(name: &str, section: &str, reference: Vec<SettingDoc>) {
    let lines: Vec<&str> = section.lines().collect();
    for setting in reference {
        let assignment = format!("{} = ", setting.name);
        let at = lines
            .iter()
            .position(|l| l.trim_start_matches("# ").starts_with(&assignment))
            .unwrap_or_else(|| {
                panic!(
                    "pgmemo.example.toml does not document {name}.{}",
                    setting.name
                )
            });
        let paragraph: Vec<&str> = lines[..at]
            .iter()
            .rev()
            .take_while(|l| l.starts_with('#'))
            .copied()
            .collect();
        assert_eq!(
            paragraph.iter().any(|l| l.contains("(restart)")),
            setting.reload == Reload::Restart,
            "{name}.{} is {:?} but its paragraph says otherwise: {paragraph:?}",
            setting.name,
            setting.reload
        );
        assert!(
            !setting.doc.is_empty(),
            "{name}.{} has no doc",
            setting.name
        );
    }
}

/// docs/configuration.md's tables of `[general]` and `[cache]` are the settings tables'
/// reference written out, between `<!-- settings: NAME -->` and `<!-- end settings: NAME -->`:
/// a setting missing there, or shown there with another type, default, reload class or doc,
/// fails here. `PGMEMO_BLESS=1 cargo test --lib config` writes them anew.
#[test]
fn the_configuration_reference_documents_every_setting() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/docs/configuration.md");
    let text = std::fs::read_to_string(path).unwrap();
    let mut expected = text.clone();
    for (section, reference) in [
        ("general", General::reference()),
        ("cache", cache::CacheConfig::reference()),
    ] {
        expected = with_generated(&expected, section, &reference_table(section, &reference));
    }
    if expected == text {
        return;
    }
    if std::env::var("PGMEMO_BLESS").is_ok_and(|v| v == "1") {
        std::fs::write(path, &expected).unwrap();
        return;
    }
    let (want, got) = expected
        .lines()
        .zip(text.lines().chain(std::iter::repeat("(end of file)")))
        .find(|(want, got)| want != got)
        .unwrap_or(("(the same lines, more of them)", ""));
    panic!(
        "docs/configuration.md is not the settings tables' reference: \
         expected\n  {want}\nfound\n  {got}\n\
         (PGMEMO_BLESS=1 cargo test --lib config rewrites it)"
    );
}

/// One section's settings as the reference's table: key, type, default, reload, meaning.
fn reference_table(section: &str, reference: &[SettingDoc]) -> String {
    let cell = |s: &str| s.replace('|', "\\|");
    let mut out =
        String::from("| key | type | default | RELOAD | meaning |\n|---|---|---|---|---|\n");
    for s in reference {
        let default = match s.default.as_str() {
            "" => "none".to_string(),
            d => format!("`{}`", cell(d)),
        };
        let reload = match s.reload {
            Reload::Live => "yes",
            Reload::Restart => "restart",
        };
        out += &format!(
            "| <a id=\"{section}.{name}\"></a>`{name}` | {} | {default} | {reload} | {} |\n",
            cell(s.kind),
            cell(&s.doc),
            name = s.name,
        );
    }
    out
}

/// `text` with the part between `section`'s markers replaced by `table`.
fn with_generated(text: &str, section: &str, table: &str) -> String {
    let begin = format!("<!-- settings: {section} -->\n");
    let end = format!("<!-- end settings: {section} -->");
    let (Some(from), Some(to)) = (text.find(&begin), text.find(&end)) else {
        panic!("docs/configuration.md lacks the markers {begin:?} and {end:?}");
    };
    let from = from + begin.len();
    assert!(
        from <= to,
        "docs/configuration.md: {end:?} comes before {begin:?}"
    );
    format!("{}{table}{}", &text[..from], &text[to..])
}

/// Every `[cache]` key refused with its message, as the hand-written reading said them.
#[test]
fn cache_errors_name_their_key() {
    let cases = [
        ("max_memory_mb = 0", "cache.max_memory_mb: must be a number of MiB above 0"),
        ("max_memory_mb = 2000000", "cache.max_memory_mb: must be a number of MiB above 0"),
        (
            "flight_wait = \"soon\"",
            "cache.flight_wait: must be a duration: seconds, or a number with ms, s, m or h (\"5s\")",
        ),
        (
            "default_ttl = -1",
            "cache.default_ttl: must be a duration: seconds, or a number with ms, s, m or h (\"5s\")",
        ),
        (
            "max_lag = 31536001",
            "cache.max_lag: must be a duration: seconds, or a number with ms, s, m or h (\"5s\")",
        ),
        ("max_result_bytes = 0", "cache.max_result_bytes: must be a number of bytes above 0"),
        ("max_result_bytes = -5", "cache.max_result_bytes: must be a number of bytes above 0"),
        ("admit_after = 0", "cache.admit_after: must be 1 or 2"),
        ("admit_after = 3", "cache.admit_after: must be 1 or 2"),
        ("admit_after = -1", "cache.admit_after: must be 1 or 2"),
        ("admit_after = 5000000000", "cache.admit_after: must be 1 or 2"),
        ("invalidation = \"x\"", "cache.invalidation: expected \"proxy\" or \"wal\", got \"x\""),
        (
            "wal_plugin = \"x\"",
            "cache.wal_plugin: expected \"test_decoding\" or \"pgoutput\", got \"x\"",
        ),
        (
            "bogus = 1",
            "cache.bogus: unknown key `bogus`, expected one of `enabled`, `max_memory_mb`, \
             `hints`, `flight_wait`, `default_ttl`, `max_result_bytes`, `admit_after`, `row_versions`, \
             `refresh_at`, `mode`, \
             `invalidation`, `replication_user`, `replication_password`, `wal_plugin`, \
             `max_lag`, `publication`, `create_publication`, `rules`, `shared`",
        ),
        (
            "[[cache.rules]]\nquery_hash = \"xyz\"",
            "cache.rules[0].query_hash: must be the 16 hexadecimal digits SHOW AUTOPREPARE \
             prints (got 3)",
        ),
        (
            "[[cache.rules]]\nquery_hash = \"0x6f1c0a1e2b3d4c5\"",
            "cache.rules[0].query_hash: must be the 16 hexadecimal digits SHOW AUTOPREPARE \
             prints (got 15)",
        ),
        (
            "[[cache.rules]]\nquery_hash = \"6f1c0a1e2b3d4c5g\"",
            "cache.rules[0].query_hash: must be a hexadecimal hash",
        ),
        (
            "[[cache.rules]]\nquery = \"x\"\nmax_result_bytes = 0",
            "cache.rules[0].max_result_bytes: must be a number of bytes above 0",
        ),
    ];
    for (toml, expected) in cases {
        let e = refused(&format!("[cache]\n{toml}\n{UPSTREAM}"));
        let line = 1 + toml.lines().count();
        assert_eq!(e, format!("line {line}: {expected}"), "{toml}");
    }
    let c = Config::from_toml_str(&with_upstream(
        "[cache]\nmax_memory_mb = 0.5\nflight_wait = \"500ms\"\nmax_lag = 2\nadmit_after = 1\n\
         [[cache.rules]]\nquery = \"x\"",
    ))
    .unwrap();
    assert_eq!(c.cache.max_memory, 512 * 1024);
    assert_eq!(c.cache.flight_wait, Duration::from_millis(500));
    assert_eq!(c.cache.max_lag, Some(Duration::from_secs(2)));
    assert_eq!(c.cache.admit_after, 1);
    assert_eq!(c.cache.rules[0].ttl, c.cache.default_ttl);
    assert_eq!(c.cache.rules[0].max_result_bytes, c.cache.max_result_bytes);
}

/// A rule's `query` matches whatever the spacing: whitespace counts as one space between word
/// characters only.
#[test]
fn rule_texts_match_whatever_their_spacing() {
    use super::cache::same_text;
    for (a, b) in [
        (
            "SELECT v FROM kv WHERE id = $1",
            "SELECT v FROM kv WHERE id=$1",
        ),
        ("select  v\n\tfrom kv", " select v from kv "),
        ("SELECT a, b FROM t", "SELECT a ,b FROM t"),
        (
            "SELECT abalance FROM pgbench_accounts WHERE aid = $1",
            "SELECT abalance FROM pgbench_accounts WHERE aid = $1;",
        ),
        ("SELECT 1 ;\n", "SELECT 1"),
    ] {
        assert!(same_text(a, b), "{a} / {b}");
    }
    for (a, b) in [
        ("SELECT ab FROM t", "SELECT a b FROM t"),
        ("SELECT v FROM kv", "SELECT v FROM kv2"),
        ("SELECT $1", "SELECT $ 1"),
        ("SELECT 1; SELECT 2", "SELECT 1"),
    ] {
        assert!(!same_text(a, b), "{a} / {b}");
    }
    let c = Config::from_toml_str(&with_upstream(
        "[[cache.rules]]\nquery = \"SELECT 1\"\nquery_hash = \"0x00000000000000ff\"",
    ))
    .unwrap();
    assert_eq!(c.cache.rules[0].query_hash, Some(255));
}

/// Auto mode chooses queries nobody wrote a rule for: only WAL invalidation sees every write
/// to their tables, so without it the configuration is refused.
#[test]
fn auto_mode_needs_wal_invalidation() {
    let e = refused(&with_upstream("[cache]\nenabled = true\nmode = \"auto\""));
    assert!(
        e.contains("cache.mode: \"auto\" needs cache.invalidation = \"wal\""),
        "{e}"
    );
    let c = Config::from_toml_str(&with_upstream(
        "[cache]\nenabled = true\nmode = \"auto\"\ninvalidation = \"wal\"",
    ))
    .unwrap();
    assert_eq!(c.cache.mode, cache::CacheMode::Auto);
    let e = refused(&with_upstream("[cache]\nmode = \"sometimes\""));
    assert!(e.contains("expected \"rules\" or \"auto\""), "{e}");
}

#[test]
fn a_reload_keeps_the_running_values_of_restart_settings() {
    let running = Config::from_toml_str(&with_upstream(
        "[general]\nlisten = \"127.0.0.1:6432\"\nworkers = 2\ndefault_pool_size = 3\n\
         [cache]\npublication = \"old\"",
    ))
    .unwrap();
    let mut new = Config::from_toml_str(&with_upstream(
        "[general]\nlisten = \"127.0.0.1:7000\"\nworkers = 2\ndefault_pool_size = 9\n\
         [cache]\npublication = \"new\"\nmax_memory_mb = 8",
    ))
    .unwrap();
    let pending = new.keep_restart_settings(&running);
    let keys: Vec<_> = pending
        .iter()
        .map(|p| (p.key.as_str(), p.running.as_str(), p.pending.as_str()))
        .collect();
    assert_eq!(
        keys,
        [
            ("general.listen", "127.0.0.1:6432", "127.0.0.1:7000"),
            ("cache.publication", "old", "new"),
        ]
    );
    // The running values are back; the live ones are the file's.
    assert_eq!(new.general.listen, "127.0.0.1:6432");
    assert_eq!(new.cache.publication, "old");
    assert_eq!(new.general.default_pool_size, 9);
    assert_eq!(new.cache.max_memory, 8 << 20);
    assert!(new.keep_restart_settings(&running).is_empty());
}

/// A Unix socket directory is a server host like a name or an address.
#[test]
fn a_unix_socket_directory_is_a_server_host() {
    let c = Config::from_toml_str(
        "[upstream]\nhost = \"/var/run/postgresql\"\nuser = \"u\"\npassword = \"p\"",
    )
    .unwrap();
    assert_eq!(c.resolve("db", "u").unwrap().host, "/var/run/postgresql");
    let c = Config::from_toml_str(&with_upstream("[databases.app]\nhost = \"/tmp\"")).unwrap();
    assert_eq!(c.resolve("app", "u").unwrap().host, "/tmp");
}

/// `[databases.NAME] connstring` gives the server as libpq would, and is the only place for
/// what it gives; its hosts and options reach the resolved database.
#[test]
fn a_database_connstring_gives_hosts_credentials_and_options() {
    let c = Config::from_toml_str(&with_upstream(
        "[databases.app]\nconnstring = \"host=p1,p2 port=6000 dbname=real user=srv \
         password=pw sslmode=verify-full sslrootcert=/ca.pem target_session_attrs=read-write\"",
    ))
    .unwrap();
    let db = c.resolve("app", "someone").unwrap();
    assert_eq!(
        (db.host.as_str(), db.port, db.dbname.as_str()),
        ("p1", 6000, "real")
    );
    assert_eq!(db.fallbacks, vec![("p2".to_string(), 6000)]);
    assert_eq!(db.server_user.as_deref(), Some("srv"));
    assert_eq!(db.server_password.as_deref(), Some("pw"));
    assert_eq!(db.server_options.tls, Some(ServerTlsMode::VerifyFull));
    assert_eq!(db.server_options.session_attrs.as_str(), "read-write");
    assert!(!format!("{:?}", c.databases["app"]).contains("pw\""));

    let e = refused(&with_upstream(
        "[databases.app]\nconnstring = \"host=x\"\nport = 5433",
    ));
    assert!(
        e.contains("databases.app.connstring: give either connstring or port"),
        "{e}"
    );
    let e = refused(&with_upstream(
        "[databases.app]\nconnstring = \"host=x sslcert=/c.pem sslcrl=/r.pem\"",
    ));
    assert!(
        e.contains("databases.app.connstring") && e.contains("sslcert and sslkey together"),
        "{e}"
    );
    let e = refused(&with_upstream(
        "[databases.app]\nconnstring = \"host=x sslcrl=/r.pem\"",
    ));
    assert!(
        e.contains("databases.app.connstring") && e.contains("unknown option `sslcrl`"),
        "{e}"
    );
}

#[test]
fn session_mode_without_shared_statements_is_noticed() {
    let notices = |extra: &str| {
        Config::from_toml_str(&with_upstream(extra))
            .unwrap()
            .notices()
    };
    assert!(notices("").is_empty());
    assert!(notices("[cache]\nenabled = true\n").is_empty());
    let n = notices(
        "[general]\npool_mode = \"transaction\"\n[cache]\nenabled = true\n\
         [databases.app]\npool_mode = \"session\"\n",
    );
    assert_eq!(n.len(), 1);
    assert!(
        n[0].starts_with("the result cache and autoprepare do not apply"),
        "{n:?}"
    );
    assert!(n[0].contains("(databases.app)"), "{n:?}");
    let n = notices("[general]\npool_mode = \"session\"\n");
    assert!(n[0].starts_with("autoprepare does not apply"), "{n:?}");
    assert!(
        notices("[general]\npool_mode = \"session\"\nsession_shared_statements = true\n")
            .is_empty()
    );
    assert!(notices("[general]\npool_mode = \"session\"\nautoprepare = false\n").is_empty());
}

#[test]
fn replicas_travel_with_the_host_they_were_given_with() {
    let c = Config::from_toml_str(
        "[general]\nreplica_wait = 0.2\nmax_replica_lag = \"16MB\"\n\
         [upstream]\nurl = \"postgresql://app:pw@db:5433\"\nreplicas = \"host=r1,r2 port=5433\"\n\
         [databases.app]\n\
         [databases.report]\nreplicas = \"postgresql://r3:6000\"\n\
         [databases.off]\nreplica_reads = \"off\"\n\
         [databases.elsewhere]\nhost = \"other\"\n",
    )
    .unwrap();
    c.validate().unwrap();
    assert_eq!(c.general.replica_wait, Duration::from_millis(200));
    assert_eq!(c.general.max_replica_lag, ReplicaLag::Bytes(16 << 20));
    let replicas = |db: &str| c.resolve(db, "app").unwrap().replicas;
    let r = |h: &str, p: u16| (h.to_string(), p);
    assert_eq!(replicas("app"), vec![r("r1", 5433), r("r2", 5433)]);
    assert_eq!(replicas("report"), vec![r("r3", 6000)]);
    assert_eq!(replicas("off"), vec![], "replica_reads = off");
    assert_eq!(
        replicas("elsewhere"),
        vec![],
        "another host: not its replicas"
    );
}

#[test]
fn replicas_name_hosts_and_ports_only() {
    for (value, says) in [
        ("postgresql://someone@r1", "user given"),
        ("host=r1 dbname=x", "dbname given"),
        ("host=r1 sslmode=require", "connection options given"),
        ("", "names no host"),
    ] {
        let e = refused(&with_upstream(&format!(
            "[databases.app]\nreplicas = \"{value}\""
        )));
        assert!(
            e.contains("databases.app.replicas") && e.contains(says),
            "{value}: {e}"
        );
    }
    let e = refused(&with_upstream(
        "[databases.app]\nreplica_reads = \"sometimes\"",
    ));
    assert!(e.contains("expected \"on\" or \"off\""), "{e}");
    let e = refused(&with_upstream("[general]\nmax_replica_lag = \"3 parsecs\""));
    assert!(e.contains("general.max_replica_lag"), "{e}");
}
