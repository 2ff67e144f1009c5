//! pgmemo's configuration: the TOML file, its validation, and the questions the rest of the
//! proxy asks of it ("where does database `app` live?", "what is alice's password?").
//!
//! Loading happens in two steps so that command-line flags can override the file before
//! anything is judged: the file is *parsed* into typed values (each key is checked on its own,
//! and a bad one is reported with the file name, the line and the key), then the whole
//! configuration is *validated* ([`Config::validate`]) for rules that involve several keys,
//! such as "trust authentication only on a loopback address". [`Config::load`] and
//! [`Config::from_toml_str`] do both; `cli::Cli` applies its flags in between.
//!
//! Every error names the key it is about in TOML's dotted form (`general.pool_mode`,
//! `databases.app.port`, `databases."*".host`), so a message can be acted upon without
//! reading code.
//!
//! The layout of the file is documented setting by setting in `pgmemo.example.toml`.

use std::collections::BTreeMap;
use std::fmt;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::Duration;

use serde::{Deserialize, Serialize};

pub mod cache;

/// The database name clients use to reach the admin console instead of a server.
pub const ADMIN_DATABASE: &str = "pgmemo";

/// The key under `[databases]` that serves any database name not listed on its own.
pub const WILDCARD_DATABASE: &str = "*";

/// The longest duration any setting accepts (one year), so that deadlines computed from a
/// setting can never overflow a clock.
const MAX_DURATION_SECS: f64 = 365.0 * 24.0 * 3600.0;

/// PostgreSQL itself never sends or accepts a message over 1 GiB.
const MAX_MESSAGE_SIZE_LIMIT: usize = 1 << 30;
const MIN_MESSAGE_SIZE_LIMIT: usize = 1024;

// ---------------------------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------------------------

/// A configuration that cannot be used, with enough context to fix it.
///
/// Displayed as one line: `pgmemo.toml, line 3: general.pool_mode: expected "session" or
/// "transaction", got "foo"`. Parts that are unknown (no file for a config built from flags,
/// no line for a rule involving several keys) are left out.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read at all.
    #[error("cannot read config file {}: {source}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The file was read, but a key is wrong, missing, misspelled or in conflict with another.
    #[error("{}", invalid_message(file.as_deref(), *line, key.as_deref(), message))]
    Invalid {
        /// The config file, when the configuration came from one.
        file: Option<PathBuf>,
        /// 1-based line in the file, when the problem is at one place in it.
        line: Option<usize>,
        /// The dotted key (`databases.app.port`), or a flag (`--upstream`).
        key: Option<String>,
        /// What is wrong, phrased to be read after the key.
        message: String,
    },
}

fn invalid_message(
    file: Option<&Path>,
    line: Option<usize>,
    key: Option<&str>,
    msg: &str,
) -> String {
    let mut location = Vec::new();
    if let Some(file) = file {
        location.push(file.display().to_string());
    }
    if let Some(line) = line {
        location.push(format!("line {line}"));
    }
    let mut parts = Vec::new();
    if !location.is_empty() {
        parts.push(location.join(", "));
    }
    if let Some(key) = key {
        parts.push(key.to_string());
    }
    parts.push(msg.to_string());
    parts.join(": ")
}

impl ConfigError {
    /// An error about one key (`general.listen`) or flag (`--upstream`).
    pub fn invalid(key: impl Into<String>, message: impl Into<String>) -> Self {
        ConfigError::Invalid {
            file: None,
            line: None,
            key: Some(key.into()),
            message: message.into(),
        }
    }

    /// The key (or flag) the error is about, if it is about one.
    pub fn key(&self) -> Option<&str> {
        match self {
            ConfigError::Read { .. } => None,
            ConfigError::Invalid { key, .. } => key.as_deref(),
        }
    }

    /// The same error, reported against another key (used when a value came from a flag).
    pub fn with_key(self, new_key: impl Into<String>) -> Self {
        match self {
            ConfigError::Invalid {
                file,
                line,
                message,
                ..
            } => ConfigError::Invalid {
                file,
                line,
                key: Some(new_key.into()),
                message,
            },
            other => other,
        }
    }

    /// The same error, located at the line where its key is set in `text`, if it is.
    fn at_line_of_key(self, text: &str) -> Self {
        match self {
            ConfigError::Invalid {
                file,
                line: None,
                key: Some(key),
                message,
            } => ConfigError::Invalid {
                file,
                line: find_key_line(text, &key),
                key: Some(key),
                message,
            },
            other => other,
        }
    }

    /// The same error, said to come from `file` (unless it already names a file).
    fn in_file(self, path: Option<&Path>) -> Self {
        match self {
            ConfigError::Invalid {
                file: None,
                line,
                key,
                message,
            } => ConfigError::Invalid {
                file: path.map(Path::to_path_buf),
                line,
                key,
                message,
            },
            other => other,
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Enumerated settings
// ---------------------------------------------------------------------------------------------

/// When a client gives its server connection back to the pool.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize, clap::ValueEnum,
)]
#[serde(rename_all = "kebab-case")]
pub enum PoolMode {
    /// A client keeps one server for its whole session; the server is reset with
    /// `server_reset_query` before the next client gets it. Everything PostgreSQL offers
    /// works (session `SET`, advisory locks, `LISTEN`, temp tables).
    Session,
    /// A client holds a server from the first message that needs one until ReadyForQuery
    /// says the server is idle outside a transaction; then the server goes back at once.
    /// Many more clients than servers; session state does not survive between transactions.
    #[default]
    Transaction,
}

/// How log lines are written (to stderr).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize, clap::ValueEnum,
)]
#[serde(rename_all = "kebab-case")]
pub enum LogFormat {
    /// Human-readable lines, coloured only when stderr is a terminal.
    #[default]
    Text,
    /// One JSON object per line (timestamp, level, target, fields), for log collectors.
    Json,
}

/// How clients prove who they are to pgmemo.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize, clap::ValueEnum,
)]
pub enum AuthType {
    /// No password is asked. Refused unless `listen` is a loopback address.
    #[serde(rename = "trust")]
    #[value(name = "trust")]
    Trust,
    /// MD5 challenge-response. As in PostgreSQL, a user whose secret is a SCRAM verifier is
    /// asked for SCRAM-SHA-256 instead. An md5 hash as secret requires this method.
    #[serde(rename = "md5")]
    #[value(name = "md5")]
    Md5,
    /// SCRAM-SHA-256 (the PostgreSQL default since version 14). Secrets must be plain
    /// passwords or SCRAM verifiers; an md5 hash cannot answer a SCRAM exchange.
    #[default]
    #[serde(rename = "scram-sha-256")]
    #[value(name = "scram-sha-256")]
    ScramSha256,
}

/// Whether clients connect to pgmemo over TLS.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ClientTlsMode {
    /// No TLS: an SSLRequest is answered `N` and the client continues in plaintext.
    #[default]
    Disable,
    /// TLS is offered to clients that ask for it; plaintext clients are accepted too.
    Allow,
    /// Plaintext clients are refused; only TLS connections may log in.
    Require,
}

/// Whether pgmemo uses TLS for its connections to PostgreSQL servers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ServerTlsMode {
    /// Plaintext only.
    #[default]
    Disable,
    /// TLS when the server offers it, plaintext otherwise; the certificate is not checked.
    Prefer,
    /// TLS or no connection; the certificate is not checked (like libpq's `sslmode=require`).
    Require,
    /// TLS, with the certificate checked against `server_tls_ca_file` (or the well-known
    /// web roots when unset) and the host name.
    VerifyFull,
}

/// One place for the names of each enumerated setting, so that parsing, errors, display
/// and `SHOW CONFIG` agree.
macro_rules! named_enum {
    ($ty:ty, $expected:expr, { $($variant:path => $name:expr),+ $(,)? }) => {
        impl $ty {
            /// The name used in the config file and on the command line.
            pub fn as_str(self) -> &'static str {
                match self {
                    $($variant => $name,)+
                }
            }
        }

        impl FromStr for $ty {
            type Err = String;

            fn from_str(s: &str) -> Result<Self, String> {
                match s {
                    $($name => Ok($variant),)+
                    _ => Err(format!("expected {}, got {:?}", $expected, s)),
                }
            }
        }

        impl fmt::Display for $ty {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }
    };
}

named_enum!(LogFormat, r#""text" or "json""#, {
    LogFormat::Text => "text",
    LogFormat::Json => "json",
});
named_enum!(PoolMode, r#""session" or "transaction""#, {
    PoolMode::Session => "session",
    PoolMode::Transaction => "transaction",
});
named_enum!(AuthType, r#""trust", "md5" or "scram-sha-256""#, {
    AuthType::Trust => "trust",
    AuthType::Md5 => "md5",
    AuthType::ScramSha256 => "scram-sha-256",
});
named_enum!(ClientTlsMode, r#""disable", "allow" or "require""#, {
    ClientTlsMode::Disable => "disable",
    ClientTlsMode::Allow => "allow",
    ClientTlsMode::Require => "require",
});
named_enum!(ServerTlsMode, r#""disable", "prefer", "require" or "verify-full""#, {
    ServerTlsMode::Disable => "disable",
    ServerTlsMode::Prefer => "prefer",
    ServerTlsMode::Require => "require",
    ServerTlsMode::VerifyFull => "verify-full",
});

/// What kind of secret a user's `password` string holds, following PostgreSQL's own rules
/// for `pg_authid.rolpassword`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SecretKind {
    /// The password itself.
    Plain,
    /// `md5` followed by 32 hex digits: md5(password || username).
    Md5,
    /// `SCRAM-SHA-256$<iterations>:<salt>$<StoredKey>:<ServerKey>`, as in `pg_authid`.
    ScramSha256,
}

impl SecretKind {
    /// Classifies a secret, or says why a string that looks like a hash is not a valid one.
    pub fn of(secret: &str) -> Result<SecretKind, String> {
        if let Some(rest) = secret.strip_prefix("SCRAM-SHA-256$") {
            return check_scram_verifier(rest).map(|()| SecretKind::ScramSha256);
        }
        if secret.len() == 35 && secret.starts_with("md5") {
            return if secret[3..].bytes().all(|b| b.is_ascii_hexdigit()) {
                Ok(SecretKind::Md5)
            } else {
                Err("looks like an md5 hash (\"md5\" + 32 characters) but is not hex".into())
            };
        }
        Ok(SecretKind::Plain)
    }
}

fn check_scram_verifier(rest: &str) -> Result<(), String> {
    const SHAPE: &str =
        "malformed SCRAM verifier; expected SCRAM-SHA-256$<iterations>:<salt>$<StoredKey>:<ServerKey> as in pg_authid";
    let bad = |what: &str| format!("{SHAPE} ({what})");
    let (iter_salt, keys) = rest.split_once('$').ok_or_else(|| bad("no second '$'"))?;
    let (iterations, salt) = iter_salt
        .split_once(':')
        .ok_or_else(|| bad("no ':' between iterations and salt"))?;
    match iterations.parse::<u32>() {
        Ok(n) if n > 0 => {}
        _ => return Err(bad("iterations is not a positive integer")),
    }
    match base64_len(salt) {
        Some(n) if n > 0 => {}
        _ => return Err(bad("salt is not base64")),
    }
    let (stored, server) = keys
        .split_once(':')
        .ok_or_else(|| bad("no ':' between StoredKey and ServerKey"))?;
    if base64_len(stored) != Some(32) || base64_len(server) != Some(32) {
        return Err(bad("StoredKey and ServerKey must be 32 bytes in base64"));
    }
    Ok(())
}

/// The decoded length of standard, padded base64, or None when `s` is not that.
fn base64_len(s: &str) -> Option<usize> {
    if !s.len().is_multiple_of(4) {
        return None;
    }
    let body = s.trim_end_matches('=');
    let padding = s.len() - body.len();
    if padding > 2
        || !body
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'+' || b == b'/')
    {
        return None;
    }
    Some(s.len() / 4 * 3 - padding)
}

// ---------------------------------------------------------------------------------------------
// The configuration
// ---------------------------------------------------------------------------------------------

/// Everything pgmemo is told: process-wide settings, where the servers are, which databases
/// and users exist. Built by [`Config::load`], [`Config::from_toml_str`] or
/// [`Config::for_upstream`]; replaced as a whole on RELOAD.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Config {
    /// `[general]`: process-wide settings and the defaults of every pool.
    pub general: General,
    /// `[upstream]`: the server used for every database that does not name its own host.
    pub upstream: Option<Upstream>,
    /// `[databases.NAME]`: the databases clients may ask for. Empty means "any name, served
    /// by the database of the same name on `upstream`". The key `"*"` serves any name that is
    /// not listed and supplies defaults for the listed ones.
    pub databases: BTreeMap<String, DatabaseConfig>,
    /// `[users.NAME]`: who may log in to pgmemo, and per-user pool settings.
    pub users: BTreeMap<String, UserConfig>,
    /// `[cache]`: the result cache and its rules.
    pub cache: cache::CacheConfig,
    /// The file this configuration came from, read again on RELOAD / SIGHUP.
    pub source: Option<PathBuf>,
}

/// `[general]`: settings of the whole process, and the defaults of every pool.
#[derive(Debug, Clone, PartialEq)]
pub struct General {
    /// Address clients connect to, `HOST:PORT` (IPv6 as `[::1]:6432`; port 0 picks a free
    /// port). Default `127.0.0.1:6432`.
    pub listen: String,
    /// Default pool mode of every pool. Default `transaction`.
    pub pool_mode: PoolMode,
    /// Server connections per (database, user) pool, unless the database or user says
    /// otherwise. Default 20.
    pub default_pool_size: u32,
    /// Server connections each pool keeps open even when idle. Default 0.
    pub min_pool_size: u32,
    /// Client connections accepted at once; more are refused with 53300. Default 1000.
    pub max_client_conn: u32,
    /// How clients authenticate to pgmemo. Default `scram-sha-256`; `trust` is refused
    /// unless `listen` is a loopback address.
    pub auth_type: AuthType,
    /// Users allowed to connect to the admin console, the database `pgmemo`. Default none.
    pub admin_users: Vec<String>,
    /// Address of the Prometheus metrics endpoint, `HOST:PORT`. Default: no endpoint.
    pub metrics_listen: Option<String>,
    /// A client waiting longer than this for a server gets an error (57014). Default 120 s.
    pub query_wait_timeout: Duration,
    /// Total time for connecting to a server, retries included, before the waiting client
    /// gets an error. Default 15 s.
    pub server_connect_timeout: Duration,
    /// A server idle in its pool longer than this is closed (down to `min_pool_size`).
    /// Default 600 s.
    pub server_idle_timeout: Duration,
    /// A server older than this is closed when it is next released. Default 3600 s.
    pub server_lifetime: Duration,
    /// A server idle longer than this is checked with `server_check_query` before it is
    /// lent out again; 0 checks every time. Default 30 s.
    pub server_check_delay: Duration,
    /// The query of that health check. Default `;` (an empty query: one round trip).
    pub server_check_query: String,
    /// SHOW STATS' `avg_*` columns are averages from the period boundary before the last to
    /// now (one to two periods), as PgBouncer's `stats_period`. Default 60 s.
    pub stats_period: Duration,
    /// A client must finish startup and authentication within this. Default 60 s.
    pub client_login_timeout: Duration,
    /// On SIGTERM / SHUTDOWN, how long running transactions may finish before their
    /// connections are closed; 0 closes at once. Default 30 s.
    pub shutdown_timeout: Duration,
    /// Run on a server after a session-mode client leaves, before the next client gets it;
    /// empty means no reset. Default `DISCARD ALL`.
    pub server_reset_query: String,
    /// Also run `server_reset_query` in transaction mode after every transaction. Default
    /// false.
    pub server_reset_query_always: bool,
    /// Largest message accepted from a client or server, in bytes; a longer one ends that
    /// connection with 08P01. Default 64 MiB.
    pub max_message_size: usize,
    /// PEM certificate chain for client-facing TLS (set together with `tls_key_file`).
    /// Relative paths are relative to the config file.
    pub tls_cert_file: Option<PathBuf>,
    /// PEM private key for client-facing TLS (set together with `tls_cert_file`).
    pub tls_key_file: Option<PathBuf>,
    /// Client-facing TLS. Default `allow` when a certificate and key are set, else `disable`.
    pub client_tls: ClientTlsMode,
    /// TLS towards the servers. Default `disable`.
    pub server_tls: ServerTlsMode,
    /// PEM CA certificates that server certificates are checked against (`verify-full`).
    /// Default: the well-known web roots.
    pub server_tls_ca_file: Option<PathBuf>,
    /// Keep prepared statements working in transaction mode by preparing them on whichever
    /// server runs them. Default true.
    pub prepared_statements: bool,
    /// Prepared statements kept per server connection; the least recently used beyond this
    /// are closed on the server. Default 500.
    pub max_prepared_statements: u32,
    /// Run simple-protocol queries as shared prepared statements, their literals made
    /// parameters (see README, "Autoprepare"). Default true; per database and user too.
    pub autoprepare: bool,
    /// Transaction mode: carry each client's session settings (SET, SET ROLE, ...) from
    /// server to server and pin a client to its server while it holds state that cannot be
    /// carried (temporary tables, LISTEN, advisory locks, WITH HOLD cursors, LOAD); see
    /// README, "How pooling behaves". `false` is PgBouncer's behaviour: what a client sets
    /// stays on the server. Default true; per database and user too.
    pub pin_session_state: bool,
    /// A client pinned to its server (see `pin_session_state`) that sends nothing for this
    /// long, outside a transaction, is closed with FATAL 08P01 `pinned_idle_timeout` and its
    /// server cleaned and given back; 0 never closes it. Default 0: a LISTEN client is pinned
    /// and may rightly wait hours for a notification; `max_pinned_fraction` bounds what
    /// pinned clients can hold.
    pub pinned_idle_timeout: Duration,
    /// At most this fraction of a pool's `pool_size` (rounded up) may be held by pinned
    /// clients; a client whose transaction would pin one more is closed with FATAL 53400
    /// (its session state goes with its server's reset). 0 refuses every pin, 1 bounds
    /// nothing. Default 0.5: the other half always serves unpinned clients.
    pub max_pinned_fraction: f64,
    /// Session mode: clients share prepared statements through the registry (pgmemo's own
    /// `pgmemo_s<n>` names on servers, autoprepare and the result cache for them), as in
    /// transaction mode. Default false: a session-mode client's statements go to its server
    /// under its own names, as on a direct connection.
    pub session_shared_statements: bool,
    /// Uses of a query shape before it is prepared. Default 2.
    pub autoprepare_threshold: u32,
    /// Query shapes remembered (with what was decided for each), least useful dropped
    /// first. Default 10000.
    pub autoprepare_max_shapes: u32,
    /// Log filter: a level (`error`, `warn`, `info`, `debug`, `trace`, `off`) or
    /// tracing-style directives such as `pgmemo=debug,info`. Default `info`.
    pub log_level: String,
    /// `text` (default; ANSI colours only on a terminal) or `json` (one object per line).
    pub log_format: LogFormat,
    /// Threads serving clients, each with an event loop of its own; a client goes to the one
    /// of the CPU its packets arrive on, and follows them between transactions (see
    /// `workers.rs`). Default 1, like PgBouncer; more serve more result-cache
    /// hits at once. Needs a restart.
    pub workers: u32,
}

impl Default for General {
    fn default() -> Self {
        General {
            listen: "127.0.0.1:6432".into(),
            pool_mode: PoolMode::Transaction,
            default_pool_size: 20,
            min_pool_size: 0,
            max_client_conn: 1000,
            auth_type: AuthType::ScramSha256,
            admin_users: Vec::new(),
            metrics_listen: None,
            query_wait_timeout: Duration::from_secs(120),
            server_connect_timeout: Duration::from_secs(15),
            server_idle_timeout: Duration::from_secs(600),
            server_lifetime: Duration::from_secs(3600),
            server_check_delay: Duration::from_secs(30),
            server_check_query: ";".into(),
            stats_period: Duration::from_secs(60),
            client_login_timeout: Duration::from_secs(60),
            shutdown_timeout: Duration::from_secs(30),
            server_reset_query: "DISCARD ALL".into(),
            server_reset_query_always: false,
            max_message_size: 64 << 20,
            tls_cert_file: None,
            tls_key_file: None,
            client_tls: ClientTlsMode::Disable,
            server_tls: ServerTlsMode::Disable,
            server_tls_ca_file: None,
            prepared_statements: true,
            max_prepared_statements: 500,
            autoprepare: true,
            pin_session_state: true,
            pinned_idle_timeout: Duration::ZERO,
            max_pinned_fraction: 0.5,
            session_shared_statements: false,
            autoprepare_threshold: 2,
            autoprepare_max_shapes: 10_000,
            log_level: "info".into(),
            log_format: LogFormat::Text,
            workers: 1,
        }
    }
}

/// `[upstream]`: the PostgreSQL server pgmemo forwards to, and the role it logs in as.
#[derive(Clone, PartialEq, Eq)]
pub struct Upstream {
    pub host: String,
    pub port: u16,
    /// The role pgmemo logs into the server as, whatever the client's user.
    pub user: String,
    /// That role's password (plain text: pgmemo must be able to answer md5 and SCRAM).
    pub password: Option<String>,
}

/// `[databases.NAME]`: one database clients may ask for, and where it is served from.
/// Unset fields fall back to the `"*"` entry, then to `[upstream]` / `[general]`.
#[derive(Clone, PartialEq, Eq, Default)]
pub struct DatabaseConfig {
    /// Server host (name, IP address, or a directory for a Unix socket).
    pub host: Option<String>,
    pub port: Option<u16>,
    /// The database's name on the server; default: the name clients use.
    pub dbname: Option<String>,
    /// The role pgmemo logs into the server as. When no entry nor `[upstream]` gives one,
    /// pgmemo logs in as the client's user with the client's password.
    pub user: Option<String>,
    /// That role's password.
    pub password: Option<String>,
    /// Server connections per (this database, user) pool.
    pub pool_size: Option<u32>,
    /// Server connections kept open per pool even when idle.
    pub min_pool_size: Option<u32>,
    pub pool_mode: Option<PoolMode>,
    /// Autoprepare for this database's pools, over the general setting.
    pub autoprepare: Option<bool>,
    /// Session state handling for this database's pools, over the general setting.
    pub pin_session_state: Option<bool>,
}

/// `[users.NAME]`: a user who may log in to pgmemo.
#[derive(Clone, PartialEq, Eq, Default)]
pub struct UserConfig {
    /// The secret clients are checked against: a plain password, an md5 hash
    /// (`md5` + md5(password || user) in hex) or a SCRAM verifier (`SCRAM-SHA-256$...`,
    /// as `pg_authid` stores it). See [`SecretKind`].
    pub password: Option<String>,
    /// Pool mode of this user's pools, over the database's and the general one.
    pub pool_mode: Option<PoolMode>,
    /// Size of this user's pools, over the database's and the general one.
    pub pool_size: Option<u32>,
    /// Autoprepare for this user's pools, over the database's and the general setting.
    pub autoprepare: Option<bool>,
    /// Session state handling for this user's pools, over the database's and the general
    /// setting.
    pub pin_session_state: Option<bool>,
}

/// Where and how one client's (database, user) pool reaches its server: the answer of
/// [`Config::resolve`].
#[derive(Clone, PartialEq, Eq)]
pub struct ResolvedDatabase {
    pub host: String,
    pub port: u16,
    /// The database's name on the server.
    pub dbname: String,
    /// The role to log into the server as; None means the client's own user, with the
    /// password the client gave (PgBouncer's model).
    pub server_user: Option<String>,
    pub server_password: Option<String>,
    pub pool_size: u32,
    /// Never more than `pool_size`.
    pub min_pool_size: u32,
    pub pool_mode: PoolMode,
    pub autoprepare: bool,
    pub pin_session_state: bool,
}

/// Passwords never reach a log line: these types print `password: Some(<hidden>)`.
struct Hidden<'a>(&'a Option<String>);

impl fmt::Debug for Hidden<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(_) => f.write_str("Some(<hidden>)"),
            None => f.write_str("None"),
        }
    }
}

impl fmt::Debug for Upstream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Upstream")
            .field("host", &self.host)
            .field("port", &self.port)
            .field("user", &self.user)
            .field("password", &Hidden(&self.password))
            .finish()
    }
}

impl fmt::Debug for DatabaseConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DatabaseConfig")
            .field("host", &self.host)
            .field("port", &self.port)
            .field("dbname", &self.dbname)
            .field("user", &self.user)
            .field("password", &Hidden(&self.password))
            .field("pool_size", &self.pool_size)
            .field("min_pool_size", &self.min_pool_size)
            .field("pool_mode", &self.pool_mode)
            .finish()
    }
}

impl fmt::Debug for UserConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("UserConfig")
            .field("password", &Hidden(&self.password))
            .field("pool_mode", &self.pool_mode)
            .field("pool_size", &self.pool_size)
            .finish()
    }
}

impl fmt::Debug for ResolvedDatabase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResolvedDatabase")
            .field("host", &self.host)
            .field("port", &self.port)
            .field("dbname", &self.dbname)
            .field("server_user", &self.server_user)
            .field("server_password", &Hidden(&self.server_password))
            .field("pool_size", &self.pool_size)
            .field("min_pool_size", &self.min_pool_size)
            .field("pool_mode", &self.pool_mode)
            .finish()
    }
}

impl Upstream {
    /// The upstream as a URL without its password, for logs and SHOW CONFIG.
    pub fn display_url(&self) -> String {
        let host = if self.host.contains(':') {
            format!("[{}]", self.host)
        } else {
            self.host.clone()
        };
        format!("postgresql://{}@{}:{}", self.user, host, self.port)
    }
}

impl Config {
    /// Reads, parses and validates a config file. `source` is set to `path` for RELOAD.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        Config::parse_and_validate(&read_file(path)?, Some(path))
    }

    /// Parses and validates a configuration given as TOML text (no file involved).
    pub fn from_toml_str(s: &str) -> Result<Config, ConfigError> {
        Config::parse_and_validate(s, None)
    }

    fn parse_and_validate(text: &str, file: Option<&Path>) -> Result<Config, ConfigError> {
        let config = Config::parse(text, file)?;
        // No flag changed anything, so the key's line in the file is where the problem is.
        config.validate().map_err(|e| e.at_line_of_key(text))?;
        Ok(config)
    }

    /// Reads and parses a file, checking each key on its own but not yet the rules that
    /// involve several keys: command-line flags are applied in between, then
    /// [`Config::validate`].
    pub fn parse_file(path: &Path) -> Result<Config, ConfigError> {
        Config::parse(&read_file(path)?, Some(path))
    }

    /// A configuration with default settings that serves every database from `upstream`:
    /// what `--upstream URL` and the demo mode start from. Not yet validated.
    pub fn for_upstream(upstream: Upstream) -> Config {
        Config {
            upstream: Some(upstream),
            ..Config::default()
        }
    }

    fn parse(text: &str, file: Option<&Path>) -> Result<Config, ConfigError> {
        // Syntax first: a syntax error is about a line, not about a setting.
        if let Err(e) = text.parse::<toml::Table>() {
            return Err(toml_error(text, &e, file, false));
        }
        let raw: RawConfig = toml::from_str(text).map_err(|e| toml_error(text, &e, file, true))?;
        let base_dir = file.and_then(Path::parent);
        let mut config = raw
            .into_config(base_dir)
            .map_err(|e| e.at_line_of_key(text).in_file(file))?;
        config.source = file.map(Path::to_path_buf);
        Ok(config)
    }

    /// Checks the rules that involve several settings, and every value a flag may have
    /// changed. Run after command-line overrides, and before a configuration is used.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.check().map_err(|e| e.in_file(self.source.as_deref()))
    }

    fn check(&self) -> Result<(), ConfigError> {
        let g = &self.general;

        let (listen_host, _) =
            parse_host_port(&g.listen).map_err(|m| ConfigError::invalid("general.listen", m))?;
        if let Some(metrics) = &g.metrics_listen {
            parse_host_port(metrics)
                .map_err(|m| ConfigError::invalid("general.metrics_listen", m))?;
        }
        if g.auth_type == AuthType::Trust && !is_loopback(&listen_host) {
            return Err(ConfigError::invalid(
                "general.auth_type",
                format!(
                    "\"trust\" lets anyone in without a password, so it is only allowed when \
                     general.listen is a loopback address (127.0.0.1, ::1 or localhost), not \
                     {:?}; use md5 or scram-sha-256 (--auth), or listen on 127.0.0.1 (--listen)",
                    g.listen
                ),
            ));
        }

        if g.default_pool_size == 0 {
            return Err(ConfigError::invalid(
                "general.default_pool_size",
                "must be at least 1",
            ));
        }
        if g.min_pool_size > g.default_pool_size {
            return Err(ConfigError::invalid(
                "general.min_pool_size",
                format!(
                    "must not exceed general.default_pool_size ({})",
                    g.default_pool_size
                ),
            ));
        }
        if !(1..=MAX_WORKERS).contains(&g.workers) {
            return Err(ConfigError::invalid(
                "general.workers",
                format!("must be between 1 and {MAX_WORKERS}"),
            ));
        }
        if g.max_client_conn == 0 {
            return Err(ConfigError::invalid(
                "general.max_client_conn",
                "must be at least 1",
            ));
        }
        if g.max_prepared_statements == 0 {
            return Err(ConfigError::invalid(
                "general.max_prepared_statements",
                "must be at least 1",
            ));
        }
        if !(MIN_MESSAGE_SIZE_LIMIT..=MAX_MESSAGE_SIZE_LIMIT).contains(&g.max_message_size) {
            return Err(ConfigError::invalid(
                "general.max_message_size",
                format!("must be {MIN_MESSAGE_SIZE_LIMIT}..={MAX_MESSAGE_SIZE_LIMIT} bytes"),
            ));
        }
        for (key, value, zero_ok) in [
            ("general.query_wait_timeout", g.query_wait_timeout, false),
            (
                "general.server_connect_timeout",
                g.server_connect_timeout,
                false,
            ),
            ("general.server_idle_timeout", g.server_idle_timeout, false),
            ("general.server_lifetime", g.server_lifetime, false),
            ("general.server_check_delay", g.server_check_delay, true),
            (
                "general.client_login_timeout",
                g.client_login_timeout,
                false,
            ),
            ("general.shutdown_timeout", g.shutdown_timeout, true),
            ("general.stats_period", g.stats_period, false),
            ("general.pinned_idle_timeout", g.pinned_idle_timeout, true),
        ] {
            if value.is_zero() && !zero_ok {
                return Err(ConfigError::invalid(key, "must be more than 0 seconds"));
            }
            if value.as_secs_f64() > MAX_DURATION_SECS {
                return Err(ConfigError::invalid(
                    key,
                    "must be at most 31536000 seconds (one year)",
                ));
            }
        }
        if !(0.0..=1.0).contains(&g.max_pinned_fraction) {
            return Err(ConfigError::invalid(
                "general.max_pinned_fraction",
                "must be 0..=1",
            ));
        }
        if g.server_check_query.trim().is_empty() {
            return Err(ConfigError::invalid(
                "general.server_check_query",
                "must not be empty (\";\" is the cheapest check)",
            ));
        }
        check_log_level(&g.log_level).map_err(|m| ConfigError::invalid("general.log_level", m))?;

        match (&g.tls_cert_file, &g.tls_key_file) {
            (Some(_), None) => {
                return Err(ConfigError::invalid(
                    "general.tls_cert_file",
                    "set tls_key_file too",
                ))
            }
            (None, Some(_)) => {
                return Err(ConfigError::invalid(
                    "general.tls_key_file",
                    "set tls_cert_file too",
                ))
            }
            _ => {}
        }
        if g.client_tls != ClientTlsMode::Disable && g.tls_cert_file.is_none() {
            return Err(ConfigError::invalid(
                "general.client_tls",
                format!(
                    "{:?} needs tls_cert_file and tls_key_file",
                    g.client_tls.as_str()
                ),
            ));
        }

        if let Some(up) = &self.upstream {
            check_upstream(up)?;
        }
        if self.upstream.is_none() && self.databases.is_empty() {
            return Err(ConfigError::invalid(
                "upstream",
                "missing: give an [upstream] (or --upstream URL) or at least one [databases.NAME]",
            ));
        }
        for (name, db) in &self.databases {
            self.check_database(name, db)?;
        }

        for (name, user) in &self.users {
            let key = key_path(&["users", name, "password"]);
            if name.is_empty() {
                return Err(ConfigError::invalid(
                    "users",
                    "a user name must not be empty",
                ));
            }
            if let Some(size) = user.pool_size {
                if size == 0 {
                    return Err(ConfigError::invalid(
                        key_path(&["users", name, "pool_size"]),
                        "must be at least 1",
                    ));
                }
            }
            match &user.password {
                None if g.auth_type != AuthType::Trust => {
                    return Err(ConfigError::invalid(
                        key,
                        format!(
                            "missing; with auth_type {:?} every user needs a password or verifier",
                            g.auth_type.as_str()
                        ),
                    ));
                }
                None => {}
                Some(p) if p.is_empty() => {
                    return Err(ConfigError::invalid(key, "must not be empty"))
                }
                Some(p) => {
                    match SecretKind::of(p).map_err(|m| ConfigError::invalid(key.clone(), m))? {
                        SecretKind::Md5 if g.auth_type == AuthType::ScramSha256 => {
                            return Err(ConfigError::invalid(
                            key,
                            "an md5 hash cannot answer auth_type \"scram-sha-256\"; give the plain \
                             password or a SCRAM-SHA-256 verifier, or use auth_type \"md5\"",
                        ));
                        }
                        _ => {}
                    }
                }
            }
        }

        if g.auth_type != AuthType::Trust {
            if self.users.is_empty() && self.implicit_user().is_none() {
                return Err(ConfigError::invalid(
                    "users",
                    format!(
                        "no client could log in: auth_type is {:?} but there are no [users] and \
                         the upstream has no password; add [users.NAME] entries, put a password \
                         in the upstream URL, or use auth_type \"trust\" on a loopback address",
                        g.auth_type.as_str()
                    ),
                ));
            }
            for admin in &g.admin_users {
                if self.user_secret(admin).is_none() {
                    return Err(ConfigError::invalid(
                        "general.admin_users",
                        format!(
                            "{admin:?} has no password among the users, so it could never log in"
                        ),
                    ));
                }
            }
        }
        Ok(())
    }

    fn check_database(&self, name: &str, db: &DatabaseConfig) -> Result<(), ConfigError> {
        let key = |field: &str| key_path(&["databases", name, field]);
        if name.is_empty() {
            return Err(ConfigError::invalid(
                "databases",
                "a database name must not be empty",
            ));
        }
        if name == ADMIN_DATABASE {
            return Err(ConfigError::invalid(
                key_path(&["databases", name]),
                "the name \"pgmemo\" is reserved for the admin console",
            ));
        }
        let star = self.wildcard().filter(|_| name != WILDCARD_DATABASE);
        if db.host.is_none()
            && star.and_then(|s| s.host.as_ref()).is_none()
            && self.upstream.is_none()
        {
            return Err(ConfigError::invalid(
                key("host"),
                "missing, and neither databases.\"*\" nor [upstream] gives one",
            ));
        }
        if db.host.as_deref() == Some("") {
            return Err(ConfigError::invalid(key("host"), "must not be empty"));
        }
        if db.port == Some(0) {
            return Err(ConfigError::invalid(key("port"), "must be 1..=65535"));
        }
        if db.dbname.as_deref() == Some("") {
            return Err(ConfigError::invalid(key("dbname"), "must not be empty"));
        }
        if db.password.is_some() && db.user.is_none() {
            return Err(ConfigError::invalid(
                key("password"),
                "set user too (the password is that user's)",
            ));
        }
        if db.pool_size == Some(0) {
            return Err(ConfigError::invalid(key("pool_size"), "must be at least 1"));
        }
        if let Some(min) = db.min_pool_size {
            let size = db
                .pool_size
                .or(star.and_then(|s| s.pool_size))
                .unwrap_or(self.general.default_pool_size);
            if min > size {
                return Err(ConfigError::invalid(
                    key("min_pool_size"),
                    format!("must not exceed the pool size ({size})"),
                ));
            }
        }
        Ok(())
    }

    fn wildcard(&self) -> Option<&DatabaseConfig> {
        self.databases.get(WILDCARD_DATABASE)
    }

    /// The one client user known without `[users]`: the upstream role, with its password.
    fn implicit_user(&self) -> Option<(&str, &str)> {
        let up = self.upstream.as_ref()?;
        Some((up.user.as_str(), up.password.as_deref()?))
    }

    /// Where database `dbname` asked for by client user `user` is served from, and with
    /// which pool settings; None when no such database is configured (answer 3D000), and
    /// always for the admin database `pgmemo`.
    ///
    /// Each field comes from the first of these that sets it:
    /// - host, port, server credentials: `[databases.NAME]` → `[databases."*"]` →
    ///   `[upstream]` (port 5432 at the end). The server user and its password travel
    ///   together: they come from the first of these that names a user;
    /// - dbname: `[databases.NAME].dbname` → `"*"`'s dbname → the name the client asked for;
    /// - pool_size and pool_mode: `[users.USER]` → `[databases.NAME]` → `[databases."*"]` →
    ///   `[general]` (`default_pool_size`, `pool_mode`);
    /// - min_pool_size: `[databases.NAME]` → `"*"` → `[general]`, capped at pool_size.
    ///
    /// Any database name is served when there is no `[databases]` (from `[upstream]`) or a
    /// `"*"` entry; otherwise only the listed names.
    pub fn resolve(&self, dbname: &str, user: &str) -> Option<ResolvedDatabase> {
        if dbname == ADMIN_DATABASE {
            return None;
        }
        let empty = DatabaseConfig::default();
        let star = self.wildcard();
        let entry = match self.databases.get(dbname) {
            Some(entry) if dbname != WILDCARD_DATABASE => entry,
            _ if self.databases.is_empty() => &empty,
            _ => star?,
        };
        let star = star.unwrap_or(&empty);
        let up = self.upstream.as_ref();
        let user_cfg = self.users.get(user);
        let g = &self.general;

        let host = entry
            .host
            .clone()
            .or_else(|| star.host.clone())
            .or_else(|| up.map(|u| u.host.clone()))?;
        let port = entry
            .port
            .or(star.port)
            .or(up.map(|u| u.port))
            .unwrap_or(5432);
        let server_dbname = entry
            .dbname
            .clone()
            .or_else(|| star.dbname.clone())
            .unwrap_or_else(|| dbname.to_string());
        let (server_user, server_password) = if entry.user.is_some() {
            (entry.user.clone(), entry.password.clone())
        } else if star.user.is_some() {
            (star.user.clone(), star.password.clone())
        } else if let Some(up) = up {
            (Some(up.user.clone()), up.password.clone())
        } else {
            (None, None)
        };
        let pool_size = user_cfg
            .and_then(|u| u.pool_size)
            .or(entry.pool_size)
            .or(star.pool_size)
            .unwrap_or(g.default_pool_size);
        let pool_mode = user_cfg
            .and_then(|u| u.pool_mode)
            .or(entry.pool_mode)
            .or(star.pool_mode)
            .unwrap_or(g.pool_mode);
        let min_pool_size = entry
            .min_pool_size
            .or(star.min_pool_size)
            .unwrap_or(g.min_pool_size)
            .min(pool_size);
        let autoprepare = user_cfg
            .and_then(|u| u.autoprepare)
            .or(entry.autoprepare)
            .or(star.autoprepare)
            .unwrap_or(g.autoprepare);
        let pin_session_state = user_cfg
            .and_then(|u| u.pin_session_state)
            .or(entry.pin_session_state)
            .or(star.pin_session_state)
            .unwrap_or(g.pin_session_state);
        Some(ResolvedDatabase {
            host,
            port,
            dbname: server_dbname,
            server_user,
            server_password,
            pool_size,
            min_pool_size,
            pool_mode,
            autoprepare,
            pin_session_state,
        })
    }

    /// The secret client user `user` must prove (see [`SecretKind`]), or None for an
    /// unknown user or one without a password. With no `[users]`, the upstream role is the
    /// one known user, with the upstream password: `pgmemo --upstream
    /// postgresql://app:pw@host:5432` lets clients log in as app / pw.
    pub fn user_secret(&self, user: &str) -> Option<&str> {
        if self.users.is_empty() {
            return self
                .implicit_user()
                .filter(|(name, _)| *name == user)
                .map(|(_, secret)| secret);
        }
        self.users.get(user)?.password.as_deref()
    }

    /// Whether `user` may log in at all, before any password is checked: a `[users]` entry,
    /// or without `[users]` the upstream role, and the admin users. With neither `[users]`
    /// nor `[upstream]` anyone may (pgmemo then logs into servers as the client, and the
    /// server decides).
    pub fn is_known_user(&self, user: &str) -> bool {
        if self.is_admin(user) {
            return true;
        }
        if !self.users.is_empty() {
            return self.users.contains_key(user);
        }
        self.upstream.as_ref().is_none_or(|up| up.user == user)
    }

    /// Whether `user` may use the admin console.
    pub fn is_admin(&self, user: &str) -> bool {
        self.general.admin_users.iter().any(|a| a == user)
    }

    /// The rows of the admin console's SHOW CONFIG: (key, value, default, changeable by
    /// RELOAD). Passwords are never shown. `listen`, `metrics_listen`, `log_level` and the
    /// prepared-statement settings need a restart; the rest apply to new connections and
    /// new checkouts after a RELOAD.
    pub fn settings_table(&self) -> Vec<(String, String, String, bool)> {
        let g = &self.general;
        let d = General::default();
        let secs = |v: Duration| v.as_secs_f64().to_string();
        let opt = |v: &Option<String>| v.clone().unwrap_or_default();
        let path = |v: &Option<PathBuf>| {
            v.as_ref()
                .map(|p| p.display().to_string())
                .unwrap_or_default()
        };
        let default_client_tls = if g.tls_cert_file.is_some() && g.tls_key_file.is_some() {
            ClientTlsMode::Allow
        } else {
            ClientTlsMode::Disable
        };
        let rows: Vec<(&str, String, String, bool)> = vec![
            ("listen", g.listen.clone(), d.listen.clone(), false),
            (
                "pool_mode",
                g.pool_mode.to_string(),
                d.pool_mode.to_string(),
                true,
            ),
            (
                "default_pool_size",
                g.default_pool_size.to_string(),
                d.default_pool_size.to_string(),
                true,
            ),
            (
                "min_pool_size",
                g.min_pool_size.to_string(),
                d.min_pool_size.to_string(),
                true,
            ),
            (
                "max_client_conn",
                g.max_client_conn.to_string(),
                d.max_client_conn.to_string(),
                true,
            ),
            (
                "auth_type",
                g.auth_type.to_string(),
                d.auth_type.to_string(),
                true,
            ),
            ("admin_users", g.admin_users.join(","), String::new(), true),
            (
                "metrics_listen",
                opt(&g.metrics_listen),
                String::new(),
                false,
            ),
            (
                "query_wait_timeout",
                secs(g.query_wait_timeout),
                secs(d.query_wait_timeout),
                true,
            ),
            (
                "server_connect_timeout",
                secs(g.server_connect_timeout),
                secs(d.server_connect_timeout),
                true,
            ),
            (
                "server_idle_timeout",
                secs(g.server_idle_timeout),
                secs(d.server_idle_timeout),
                true,
            ),
            (
                "server_lifetime",
                secs(g.server_lifetime),
                secs(d.server_lifetime),
                true,
            ),
            (
                "server_check_delay",
                secs(g.server_check_delay),
                secs(d.server_check_delay),
                true,
            ),
            (
                "stats_period",
                secs(g.stats_period),
                secs(d.stats_period),
                true,
            ),
            (
                "server_check_query",
                g.server_check_query.clone(),
                d.server_check_query.clone(),
                true,
            ),
            (
                "client_login_timeout",
                secs(g.client_login_timeout),
                secs(d.client_login_timeout),
                true,
            ),
            (
                "shutdown_timeout",
                secs(g.shutdown_timeout),
                secs(d.shutdown_timeout),
                true,
            ),
            (
                "server_reset_query",
                g.server_reset_query.clone(),
                d.server_reset_query.clone(),
                true,
            ),
            (
                "server_reset_query_always",
                g.server_reset_query_always.to_string(),
                d.server_reset_query_always.to_string(),
                true,
            ),
            (
                "max_message_size",
                g.max_message_size.to_string(),
                d.max_message_size.to_string(),
                true,
            ),
            ("tls_cert_file", path(&g.tls_cert_file), String::new(), true),
            ("tls_key_file", path(&g.tls_key_file), String::new(), true),
            (
                "client_tls",
                g.client_tls.to_string(),
                default_client_tls.to_string(),
                true,
            ),
            (
                "server_tls",
                g.server_tls.to_string(),
                d.server_tls.to_string(),
                true,
            ),
            (
                "server_tls_ca_file",
                path(&g.server_tls_ca_file),
                String::new(),
                true,
            ),
            (
                "prepared_statements",
                g.prepared_statements.to_string(),
                d.prepared_statements.to_string(),
                false,
            ),
            (
                "max_prepared_statements",
                g.max_prepared_statements.to_string(),
                d.max_prepared_statements.to_string(),
                false,
            ),
            (
                "autoprepare",
                g.autoprepare.to_string(),
                d.autoprepare.to_string(),
                true,
            ),
            (
                "pin_session_state",
                g.pin_session_state.to_string(),
                d.pin_session_state.to_string(),
                true,
            ),
            (
                "pinned_idle_timeout",
                secs(g.pinned_idle_timeout),
                secs(d.pinned_idle_timeout),
                true,
            ),
            (
                "max_pinned_fraction",
                g.max_pinned_fraction.to_string(),
                d.max_pinned_fraction.to_string(),
                true,
            ),
            (
                "session_shared_statements",
                g.session_shared_statements.to_string(),
                d.session_shared_statements.to_string(),
                true,
            ),
            (
                "autoprepare_threshold",
                g.autoprepare_threshold.to_string(),
                d.autoprepare_threshold.to_string(),
                true,
            ),
            (
                "autoprepare_max_shapes",
                g.autoprepare_max_shapes.to_string(),
                d.autoprepare_max_shapes.to_string(),
                true,
            ),
            ("log_level", g.log_level.clone(), d.log_level.clone(), false),
            (
                "log_format",
                g.log_format.to_string(),
                d.log_format.to_string(),
                false,
            ),
            (
                "workers",
                g.workers.to_string(),
                d.workers.to_string(),
                false,
            ),
            (
                "upstream",
                self.upstream
                    .as_ref()
                    .map(Upstream::display_url)
                    .unwrap_or_default(),
                String::new(),
                true,
            ),
        ];
        rows.into_iter()
            .map(|(k, v, def, reload)| (k.to_string(), v, def, reload))
            .collect()
    }
}

fn check_upstream(up: &Upstream) -> Result<(), ConfigError> {
    if up.host.is_empty() {
        return Err(ConfigError::invalid("upstream.host", "must not be empty"));
    }
    if up.port == 0 {
        return Err(ConfigError::invalid("upstream.port", "must be 1..=65535"));
    }
    if up.user.is_empty() {
        return Err(ConfigError::invalid("upstream.user", "must not be empty"));
    }
    Ok(())
}

/// Accepts the common forms of a tracing `EnvFilter`: comma-separated `LEVEL` or
/// `TARGET=LEVEL`.
fn check_log_level(s: &str) -> Result<(), String> {
    const LEVELS: [&str; 6] = ["off", "error", "warn", "info", "debug", "trace"];
    let is_level = |l: &str| LEVELS.iter().any(|x| x.eq_ignore_ascii_case(l));
    let bad = || {
        format!(
            "expected a level (off, error, warn, info, debug, trace) or directives like \
             \"pgmemo=debug,info\", got {s:?}"
        )
    };
    if s.trim().is_empty() {
        return Err(bad());
    }
    for part in s.split(',') {
        let part = part.trim();
        let ok = match part.split_once('=') {
            Some((target, level)) => {
                !target.is_empty()
                    && target
                        .chars()
                        .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':')
                    && is_level(level)
            }
            // A bare word must be a level: a misspelt level would otherwise be read as a
            // target name and silently log nothing.
            None => is_level(part),
        };
        if !ok {
            return Err(bad());
        }
    }
    Ok(())
}

/// Splits `HOST:PORT` (IPv6 as `[::1]:PORT`) into host (without brackets) and port.
/// Port 0 is allowed: the system then picks a free port.
pub fn parse_host_port(s: &str) -> Result<(String, u16), String> {
    let bad = || format!("expected HOST:PORT, like 127.0.0.1:6432 or [::1]:6432, got {s:?}");
    let (host, port) = if let Some(rest) = s.strip_prefix('[') {
        let (host, rest) = rest.split_once(']').ok_or_else(bad)?;
        if host.parse::<std::net::Ipv6Addr>().is_err() {
            return Err(format!("{host:?} in brackets is not an IPv6 address"));
        }
        (host, rest.strip_prefix(':').ok_or_else(bad)?)
    } else {
        let (host, port) = s.rsplit_once(':').ok_or_else(bad)?;
        if host.contains(':') {
            return Err(format!(
                "put an IPv6 address in brackets, like [::1]:6432, got {s:?}"
            ));
        }
        (host, port)
    };
    if host.is_empty() || host.contains(char::is_whitespace) {
        return Err(bad());
    }
    let port = port
        .parse::<u16>()
        .map_err(|_| format!("the port in {s:?} must be a number 0..=65535"))?;
    Ok((host.to_string(), port))
}

/// Whether a listen host only accepts connections from this machine.
fn is_loopback(host: &str) -> bool {
    host.eq_ignore_ascii_case("localhost")
        || host
            .parse::<IpAddr>()
            .map(|ip| ip.is_loopback())
            .unwrap_or(false)
}

/// Parses `postgresql://USER[:PASSWORD]@HOST[:PORT][/DATABASE]` (or `postgres://`).
///
/// USER is required; HOST defaults to 127.0.0.1 and PORT to 5432; user and password are
/// percent-decoded (`p%40ss` is `p@ss`); an IPv6 host is written `[::1]`. A database path is
/// ignored: clients choose the database. Query parameters are refused rather than silently
/// ignored (`?sslmode=require` must not quietly become plaintext; use `general.server_tls`).
pub fn parse_upstream_url(url: &str) -> Result<Upstream, ConfigError> {
    let err = |m: String| ConfigError::invalid("upstream.url", m);
    let lower = url.get(..13).unwrap_or(url).to_ascii_lowercase();
    let rest = if lower.starts_with("postgresql://") {
        &url[13..]
    } else if lower.starts_with("postgres://") {
        &url[11..]
    } else {
        return Err(err(
            "not a postgresql:// URL; expected postgresql://USER[:PASSWORD]@HOST[:PORT]".into(),
        ));
    };
    let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(end);
    let path_end = tail.find(['?', '#']).unwrap_or(tail.len());
    if !tail[path_end..].is_empty() {
        return Err(err(
            "query parameters are not supported; set TLS with general.server_tls".into(),
        ));
    }
    let (userinfo, hostport) = authority
        .rsplit_once('@')
        .ok_or_else(|| err("a user is required, as in postgresql://USER@HOST:PORT".into()))?;
    let (user, password) = match userinfo.split_once(':') {
        Some((u, p)) => (u, Some(p)),
        None => (userinfo, None),
    };
    let user = percent_decode(user).map_err(err)?;
    if user.is_empty() {
        return Err(err(
            "a user is required, as in postgresql://USER@HOST:PORT".into()
        ));
    }
    let password = password.map(percent_decode).transpose().map_err(err)?;

    let (host, port) = if let Some(v6) = hostport.strip_prefix('[') {
        let (host, after) = v6
            .split_once(']')
            .ok_or_else(|| err("unclosed '[' in the host".into()))?;
        if host.parse::<std::net::Ipv6Addr>().is_err() {
            return Err(err(format!("{host:?} in brackets is not an IPv6 address")));
        }
        let port = match after {
            "" => None,
            p => Some(
                p.strip_prefix(':')
                    .ok_or_else(|| err("expected ':PORT' after ']'".into()))?,
            ),
        };
        (host.to_string(), port)
    } else {
        let (host, port) = match hostport.split_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (hostport, None),
        };
        if host.contains(',') {
            return Err(err("several hosts are not supported".into()));
        }
        (percent_decode(host).map_err(err)?, port)
    };
    let host = if host.is_empty() {
        "127.0.0.1".to_string()
    } else {
        host
    };
    let port = match port {
        None | Some("") => 5432,
        Some(p) => match p.parse::<u16>() {
            Ok(n) if n > 0 => n,
            _ => return Err(err(format!("port {p:?} must be 1..=65535"))),
        },
    };
    Ok(Upstream {
        host,
        port,
        user,
        password,
    })
}

fn percent_decode(s: &str) -> Result<String, String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = s
                .get(i + 1..i + 3)
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .ok_or_else(|| "a '%' must be followed by two hex digits".to_string())?;
            out.push(hex);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| "percent-encoded text is not UTF-8".to_string())
}

// ---------------------------------------------------------------------------------------------
// The file as written: every key optional, numbers wide, so that each value is judged with
// its key name in hand.
// ---------------------------------------------------------------------------------------------

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    #[serde(default)]
    general: RawGeneral,
    upstream: Option<RawUpstream>,
    #[serde(default)]
    databases: BTreeMap<String, RawDatabase>,
    #[serde(default)]
    users: BTreeMap<String, RawUser>,
    #[serde(default)]
    cache: cache::RawCache,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawGeneral {
    listen: Option<String>,
    pool_mode: Option<String>,
    default_pool_size: Option<i64>,
    min_pool_size: Option<i64>,
    max_client_conn: Option<i64>,
    auth_type: Option<String>,
    admin_users: Option<Vec<String>>,
    metrics_listen: Option<String>,
    query_wait_timeout: Option<Seconds>,
    server_connect_timeout: Option<Seconds>,
    server_idle_timeout: Option<Seconds>,
    server_lifetime: Option<Seconds>,
    server_check_delay: Option<Seconds>,
    server_check_query: Option<String>,
    stats_period: Option<Seconds>,
    client_login_timeout: Option<Seconds>,
    shutdown_timeout: Option<Seconds>,
    server_reset_query: Option<String>,
    server_reset_query_always: Option<bool>,
    max_message_size: Option<i64>,
    tls_cert_file: Option<PathBuf>,
    tls_key_file: Option<PathBuf>,
    client_tls: Option<String>,
    server_tls: Option<String>,
    server_tls_ca_file: Option<PathBuf>,
    prepared_statements: Option<bool>,
    max_prepared_statements: Option<i64>,
    autoprepare: Option<bool>,
    pin_session_state: Option<bool>,
    pinned_idle_timeout: Option<Seconds>,
    max_pinned_fraction: Option<f64>,
    session_shared_statements: Option<bool>,
    autoprepare_threshold: Option<i64>,
    autoprepare_max_shapes: Option<i64>,
    log_level: Option<String>,
    log_format: Option<String>,
    workers: Option<i64>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawUpstream {
    url: Option<String>,
    host: Option<String>,
    port: Option<i64>,
    user: Option<String>,
    password: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawDatabase {
    host: Option<String>,
    port: Option<i64>,
    dbname: Option<String>,
    user: Option<String>,
    password: Option<String>,
    pool_size: Option<i64>,
    min_pool_size: Option<i64>,
    pool_mode: Option<String>,
    autoprepare: Option<bool>,
    pin_session_state: Option<bool>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawUser {
    password: Option<String>,
    pool_mode: Option<String>,
    pool_size: Option<i64>,
    autoprepare: Option<bool>,
    pin_session_state: Option<bool>,
}

/// A duration written as a number of seconds, integer or fractional (`120`, `0.5`).
struct Seconds(f64);

impl<'de> Deserialize<'de> for Seconds {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl serde::de::Visitor<'_> for Visitor {
            type Value = Seconds;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a number of seconds, like 120 or 0.5")
            }
            fn visit_i64<E>(self, v: i64) -> Result<Seconds, E> {
                Ok(Seconds(v as f64))
            }
            fn visit_u64<E>(self, v: u64) -> Result<Seconds, E> {
                Ok(Seconds(v as f64))
            }
            fn visit_f64<E>(self, v: f64) -> Result<Seconds, E> {
                Ok(Seconds(v))
            }
        }
        d.deserialize_any(Visitor)
    }
}

fn seconds(key: &str, v: Option<Seconds>, default: Duration) -> Result<Duration, ConfigError> {
    let Some(Seconds(s)) = v else {
        return Ok(default);
    };
    if !s.is_finite() || s < 0.0 {
        return Err(ConfigError::invalid(
            key,
            "must be a number of seconds, 0 or more",
        ));
    }
    if s > MAX_DURATION_SECS {
        return Err(ConfigError::invalid(
            key,
            "must be at most 31536000 seconds (one year)",
        ));
    }
    Ok(Duration::from_secs_f64(s))
}

fn int<T: TryFrom<i64>>(
    key: &str,
    v: Option<i64>,
    default: T,
    range: &str,
) -> Result<T, ConfigError> {
    match v {
        None => Ok(default),
        Some(n) => {
            T::try_from(n).map_err(|_| ConfigError::invalid(key, format!("must be {range}")))
        }
    }
}

fn opt_int<T: TryFrom<i64>>(
    key: &str,
    v: Option<i64>,
    range: &str,
) -> Result<Option<T>, ConfigError> {
    v.map(|n| T::try_from(n).map_err(|_| ConfigError::invalid(key, format!("must be {range}"))))
        .transpose()
}

fn named<T: FromStr<Err = String>>(key: &str, v: Option<String>) -> Result<Option<T>, ConfigError> {
    v.map(|s| s.parse::<T>().map_err(|m| ConfigError::invalid(key, m)))
        .transpose()
}

/// The most worker threads `general.workers` may ask for.
const MAX_WORKERS: u32 = 64;

const U32_RANGE: &str = "a whole number 0..=4294967295";
const PORT_RANGE: &str = "1..=65535";

impl RawConfig {
    fn into_config(self, base_dir: Option<&Path>) -> Result<Config, ConfigError> {
        let g = self.general;
        let d = General::default();
        let relative = |p: Option<PathBuf>| match (p, base_dir) {
            (Some(p), Some(dir)) if p.is_relative() && !dir.as_os_str().is_empty() => {
                Some(dir.join(p))
            }
            (p, _) => p,
        };
        let tls_cert_file = relative(g.tls_cert_file);
        let tls_key_file = relative(g.tls_key_file);
        let client_tls = named("general.client_tls", g.client_tls)?.unwrap_or(
            if tls_cert_file.is_some() && tls_key_file.is_some() {
                ClientTlsMode::Allow
            } else {
                ClientTlsMode::Disable
            },
        );
        let general = General {
            listen: g.listen.unwrap_or(d.listen),
            pool_mode: named("general.pool_mode", g.pool_mode)?.unwrap_or(d.pool_mode),
            default_pool_size: int(
                "general.default_pool_size",
                g.default_pool_size,
                d.default_pool_size,
                U32_RANGE,
            )?,
            min_pool_size: int(
                "general.min_pool_size",
                g.min_pool_size,
                d.min_pool_size,
                U32_RANGE,
            )?,
            max_client_conn: int(
                "general.max_client_conn",
                g.max_client_conn,
                d.max_client_conn,
                U32_RANGE,
            )?,
            auth_type: named("general.auth_type", g.auth_type)?.unwrap_or(d.auth_type),
            admin_users: g.admin_users.unwrap_or(d.admin_users),
            metrics_listen: g.metrics_listen,
            query_wait_timeout: seconds(
                "general.query_wait_timeout",
                g.query_wait_timeout,
                d.query_wait_timeout,
            )?,
            server_connect_timeout: seconds(
                "general.server_connect_timeout",
                g.server_connect_timeout,
                d.server_connect_timeout,
            )?,
            server_idle_timeout: seconds(
                "general.server_idle_timeout",
                g.server_idle_timeout,
                d.server_idle_timeout,
            )?,
            server_lifetime: seconds(
                "general.server_lifetime",
                g.server_lifetime,
                d.server_lifetime,
            )?,
            server_check_delay: seconds(
                "general.server_check_delay",
                g.server_check_delay,
                d.server_check_delay,
            )?,
            server_check_query: g.server_check_query.unwrap_or(d.server_check_query),
            client_login_timeout: seconds(
                "general.client_login_timeout",
                g.client_login_timeout,
                d.client_login_timeout,
            )?,
            shutdown_timeout: seconds(
                "general.shutdown_timeout",
                g.shutdown_timeout,
                d.shutdown_timeout,
            )?,
            stats_period: seconds("general.stats_period", g.stats_period, d.stats_period)?,
            server_reset_query: g.server_reset_query.unwrap_or(d.server_reset_query),
            server_reset_query_always: g
                .server_reset_query_always
                .unwrap_or(d.server_reset_query_always),
            max_message_size: int(
                "general.max_message_size",
                g.max_message_size,
                d.max_message_size,
                "1024..=1073741824 bytes",
            )?,
            tls_cert_file,
            tls_key_file,
            client_tls,
            server_tls: named("general.server_tls", g.server_tls)?.unwrap_or(d.server_tls),
            server_tls_ca_file: relative(g.server_tls_ca_file),
            prepared_statements: g.prepared_statements.unwrap_or(d.prepared_statements),
            max_prepared_statements: int(
                "general.max_prepared_statements",
                g.max_prepared_statements,
                d.max_prepared_statements,
                U32_RANGE,
            )?,
            autoprepare: g.autoprepare.unwrap_or(d.autoprepare),
            pin_session_state: g.pin_session_state.unwrap_or(d.pin_session_state),
            pinned_idle_timeout: seconds(
                "general.pinned_idle_timeout",
                g.pinned_idle_timeout,
                d.pinned_idle_timeout,
            )?,
            max_pinned_fraction: g.max_pinned_fraction.unwrap_or(d.max_pinned_fraction),
            session_shared_statements: g
                .session_shared_statements
                .unwrap_or(d.session_shared_statements),
            autoprepare_threshold: int(
                "general.autoprepare_threshold",
                g.autoprepare_threshold,
                d.autoprepare_threshold,
                U32_RANGE,
            )?,
            autoprepare_max_shapes: int(
                "general.autoprepare_max_shapes",
                g.autoprepare_max_shapes,
                d.autoprepare_max_shapes,
                U32_RANGE,
            )?,
            log_level: g.log_level.unwrap_or(d.log_level),
            log_format: named("general.log_format", g.log_format)?.unwrap_or(d.log_format),
            workers: int("general.workers", g.workers, d.workers, U32_RANGE)?,
        };

        let upstream = self.upstream.map(RawUpstream::into_upstream).transpose()?;

        let mut databases = BTreeMap::new();
        for (name, db) in self.databases {
            let key = |field: &str| key_path(&["databases", &name, field]);
            let entry = DatabaseConfig {
                port: opt_int::<u16>(&key("port"), db.port, PORT_RANGE)?,
                pool_size: opt_int(&key("pool_size"), db.pool_size, U32_RANGE)?,
                min_pool_size: opt_int(&key("min_pool_size"), db.min_pool_size, U32_RANGE)?,
                pool_mode: named(&key("pool_mode"), db.pool_mode)?,
                autoprepare: db.autoprepare,
                pin_session_state: db.pin_session_state,
                host: db.host,
                dbname: db.dbname,
                user: db.user,
                password: db.password,
            };
            databases.insert(name, entry);
        }

        let mut users = BTreeMap::new();
        for (name, user) in self.users {
            let key = |field: &str| key_path(&["users", &name, field]);
            let entry = UserConfig {
                pool_mode: named(&key("pool_mode"), user.pool_mode)?,
                pool_size: opt_int(&key("pool_size"), user.pool_size, U32_RANGE)?,
                autoprepare: user.autoprepare,
                pin_session_state: user.pin_session_state,
                password: user.password,
            };
            users.insert(name, entry);
        }

        Ok(Config {
            general,
            upstream,
            databases,
            users,
            cache: self.cache.into_config()?,
            source: None,
        })
    }
}

impl RawUpstream {
    fn into_upstream(self) -> Result<Upstream, ConfigError> {
        if let Some(url) = &self.url {
            for (key, set) in [
                ("upstream.host", self.host.is_some()),
                ("upstream.port", self.port.is_some()),
                ("upstream.user", self.user.is_some()),
            ] {
                if set {
                    return Err(ConfigError::invalid(
                        key,
                        "give either upstream.url or host/port/user, not both",
                    ));
                }
            }
            let mut up = parse_upstream_url(url)?;
            if let Some(password) = self.password {
                if up.password.is_some() {
                    return Err(ConfigError::invalid(
                        "upstream.password",
                        "the url has a password already",
                    ));
                }
                up.password = Some(password);
            }
            return Ok(up);
        }
        let user = self.user.ok_or_else(|| {
            ConfigError::invalid("upstream.user", "missing (or give upstream.url)")
        })?;
        Ok(Upstream {
            host: self.host.unwrap_or_else(|| "127.0.0.1".into()),
            port: int("upstream.port", self.port, 5432u16, PORT_RANGE)?,
            user,
            password: self.password,
        })
    }
}

// ---------------------------------------------------------------------------------------------
// Error locations: TOML's errors carry a byte span; turn it into a line and a dotted key.
// ---------------------------------------------------------------------------------------------

/// A dotted key in TOML syntax, quoting the parts that are not bare keys
/// (`databases."*".port`).
pub fn key_path(parts: &[&str]) -> String {
    parts
        .iter()
        .map(|p| {
            let bare = !p.is_empty()
                && p.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
            if bare {
                p.to_string()
            } else {
                format!("{p:?}")
            }
        })
        .collect::<Vec<_>>()
        .join(".")
}

fn read_file(path: &Path) -> Result<String, ConfigError> {
    std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: path.to_path_buf(),
        source,
    })
}

/// One line from one of toml's errors; `with_key` names the setting at the error's place
/// (not for syntax errors, which are about the text, not a setting).
fn toml_error(text: &str, e: &toml::de::Error, file: Option<&Path>, with_key: bool) -> ConfigError {
    let message =
        e.message()
            .trim()
            .replace('\n', "; ")
            .replacen("unknown field", "unknown key", 1);
    let (line, key) = match e.span() {
        Some(span) => {
            let (line, key) = locate(text, span.start);
            (Some(line), key.filter(|_| with_key))
        }
        None => (None, None),
    };
    ConfigError::Invalid {
        file: file.map(Path::to_path_buf),
        line,
        key,
        message,
    }
}

/// The 1-based line of byte `offset` in `text`, and the dotted key of the setting written
/// there: the nearest table header above, plus the key of the `key = value` line (or of the
/// line where a multi-line value started).
fn locate(text: &str, offset: usize) -> (usize, Option<String>) {
    let mut offset = offset.min(text.len());
    while !text.is_char_boundary(offset) {
        offset -= 1;
    }
    let line_no = text[..offset].matches('\n').count();
    let mut table: Vec<String> = Vec::new();
    let mut last_key: Option<Vec<String>> = None;
    let mut on_header = false;
    for line in text.split('\n').take(line_no + 1) {
        on_header = false;
        if let Some(header) = parse_header(line) {
            table = header;
            last_key = None;
            on_header = true;
        } else if let Some(key) = parse_assignment(line) {
            last_key = Some(key);
        }
    }
    let mut parts = table;
    if !on_header {
        parts.extend(last_key.unwrap_or_default());
    }
    let refs: Vec<&str> = parts.iter().map(String::as_str).collect();
    let key = (!refs.is_empty()).then(|| key_path(&refs));
    (line_no + 1, key)
}

/// The 1-based line where dotted key `key` (as [`key_path`] writes it) is set in `text`.
fn find_key_line(text: &str, key: &str) -> Option<usize> {
    let mut table: Vec<String> = Vec::new();
    for (i, line) in text.split('\n').enumerate() {
        if let Some(header) = parse_header(line) {
            table = header;
            let refs: Vec<&str> = table.iter().map(String::as_str).collect();
            if key_path(&refs) == key {
                return Some(i + 1);
            }
        } else if let Some(k) = parse_assignment(line) {
            let full: Vec<&str> = table.iter().chain(&k).map(String::as_str).collect();
            if key_path(&full) == key {
                return Some(i + 1);
            }
        }
    }
    None
}

/// `[a.b]` or `[[a.b]]` → the key parts.
fn parse_header(line: &str) -> Option<Vec<String>> {
    let t = line.trim_start();
    let double = t.starts_with("[[");
    let rest = t.strip_prefix(if double { "[[" } else { "[" })?;
    let (parts, rest) = parse_dotted_key(rest)?;
    let rest = rest
        .strip_prefix(if double { "]]" } else { "]" })?
        .trim_start();
    (rest.is_empty() || rest.starts_with('#')).then_some(parts)
}

/// `a.b = value` → the key parts.
fn parse_assignment(line: &str) -> Option<Vec<String>> {
    let (parts, rest) = parse_dotted_key(line)?;
    rest.starts_with('=').then_some(parts)
}

/// Parses `part(.part)*` at the start of `s` (after whitespace); returns the parts and the
/// text after the key, with leading whitespace removed.
fn parse_dotted_key(s: &str) -> Option<(Vec<String>, &str)> {
    let mut parts = Vec::new();
    let mut rest = s.trim_start();
    loop {
        let (part, after) = if let Some(q) = rest.strip_prefix('"') {
            let mut out = String::new();
            let mut chars = q.char_indices();
            let mut end = None;
            while let Some((i, c)) = chars.next() {
                match c {
                    '"' => {
                        end = Some(i + 1);
                        break;
                    }
                    '\\' => out.extend(chars.next().map(|(_, c)| c)),
                    c => out.push(c),
                }
            }
            (out, &q[end?..])
        } else if let Some(q) = rest.strip_prefix('\'') {
            let end = q.find('\'')?;
            (q[..end].to_string(), &q[end + 1..])
        } else {
            let end = rest
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == '-'))
                .unwrap_or(rest.len());
            if end == 0 {
                return None;
            }
            (rest[..end].to_string(), &rest[end..])
        };
        parts.push(part);
        rest = after.trim_start();
        match rest.strip_prefix('.') {
            Some(r) => rest = r.trim_start(),
            None => return Some((parts, rest)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
            crate::cache::config::Invalidation::Wal
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
        let c = Config::from_toml_str("[upstream]\nurl = \"postgresql://u@h\"\npassword = \"p\"")
            .unwrap();
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
        let u = parse_upstream_url("POSTGRESQL://a%40b:p%3Aw%2F@[::1]:6000/").unwrap();
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
        // A password may contain '@' unescaped: the last '@' ends the user info.
        let u = parse_upstream_url("postgresql://app:p@ss@h:1").unwrap();
        assert_eq!(u.password.as_deref(), Some("p@ss"));
        assert_eq!(u.display_url(), "postgresql://app@h:1");
        assert!(!format!("{u:?}").contains("p@ss"));

        for (url, expected) in [
            ("mysql://a@b", "not a postgresql:// URL"),
            ("db.example:5432", "not a postgresql:// URL"),
            ("postgresql://db.example:5432", "a user is required"),
            ("postgresql://:pw@db", "a user is required"),
            ("postgresql://a@b:0", "must be 1..=65535"),
            ("postgresql://a@b:99999", "must be 1..=65535"),
            ("postgresql://a@b:x", "must be 1..=65535"),
            ("postgresql://a@[::1", "unclosed '['"),
            ("postgresql://a@[nope]:1", "not an IPv6 address"),
            (
                "postgresql://a@b/db?sslmode=require",
                "query parameters are not supported",
            ),
            ("postgresql://a@h1,h2", "several hosts"),
            ("postgresql://a%zz@b", "two hex digits"),
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
        assert_eq!(r.server_user.as_deref(), Some("app"));
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
        assert_eq!(r.server_user.as_deref(), Some("app"), "from [upstream]");

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

        let r = c.resolve("other", "bob").unwrap();
        assert_eq!((r.dbname.as_str(), r.port, r.pool_size), ("other", 6000, 7));

        // With [users], the upstream role is not a client user by itself.
        assert_eq!(c.user_secret("app"), None);
        assert_eq!(c.user_secret("alice"), Some("a"));
        assert_eq!(c.user_secret("nobody"), None);
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
        let c =
            Config::from_toml_str(&with_upstream("[general]\nquery_wait_timeout = 0.5")).unwrap();
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
        assert_eq!(rows.len(), 38);
    }

    #[test]
    fn locate_finds_keys_in_tables_dotted_keys_and_multiline_values() {
        let text = "a = 1\n[general]\nlisten = \"x\"\nadmin_users = [\n  1,\n]\n[databases.\"*\"]\nport = 0\n";
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
}
