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
//!
//! - `settings.rs`: the `[general]` settings, one entry each (PgBouncer's `bouncer_params[]`);
//!   `table.rs` is the macro and the value kinds that turn the entries into the struct, its
//!   reading, checks, SHOW CONFIG rows and reference;
//! - `cache.rs`: `[cache]` and its rules;
//! - here: the errors, the `Config` as a whole, the other sections and the rules that
//!   involve several of them.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use serde::{Deserialize, Serialize};

pub mod cache;
mod locate;
mod settings;
mod table;

pub use locate::key_path;
use locate::{find_key_line, toml_error};
use settings::RawGeneral;
pub use settings::{parse_host_port, General};
use table::U32_RANGE;
pub use table::{Reload, SettingDoc};

/// The database name clients use to reach the admin console instead of a server.
pub const ADMIN_DATABASE: &str = "pgmemo";

/// The key under `[databases]` that serves any database name not listed on its own.
pub const WILDCARD_DATABASE: &str = "*";

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

        impl table::Value for $ty {
            type Raw = String;
            fn read(raw: String, _: &table::Context<'_>) -> Result<Self, String> {
                raw.parse()
            }
            fn show(&self) -> String {
                self.to_string()
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
        let doc = toml_edit::ImDocument::parse(text)
            .map_err(|e| toml_error(text, e.message(), e.span(), file, false))?;
        let raw = RawConfig::deserialize(toml_edit::de::Deserializer::from(doc))
            .map_err(|e| toml_error(text, e.message(), e.span(), file, true))?;
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
        g.check()?;

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
    /// RELOAD): the `[general]` table (`settings.rs`, where each entry says whether it is
    /// `Live` or needs a `Restart`), then the upstream. Passwords are never shown.
    pub fn settings_table(&self) -> Vec<(String, String, String, bool)> {
        let upstream = self.upstream.as_ref().map(Upstream::display_url);
        self.general
            .rows()
            .into_iter()
            .chain([(
                "upstream",
                upstream.unwrap_or_default(),
                String::new(),
                true,
            )])
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

const PORT_RANGE: &str = "1..=65535";

impl RawConfig {
    fn into_config(self, base_dir: Option<&Path>) -> Result<Config, ConfigError> {
        let general = self.general.into_general(&table::Context { base_dir })?;
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

fn read_file(path: &Path) -> Result<String, ConfigError> {
    std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: path.to_path_buf(),
        source,
    })
}

#[cfg(test)]
mod tests;
