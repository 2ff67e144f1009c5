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
//! One file per part, as PgBouncer keeps one table of settings:
//! - `settings.rs`: the `[general]` settings, one entry each (PgBouncer's `bouncer_params[]`);
//!   `table.rs` is the macro and the value kinds that turn the entries into the struct, its
//!   reading, checks, SHOW CONFIG rows and reference; `choices.rs` the settings that are one
//!   of a few words;
//! - `cache.rs`: `[cache]`, a table of the same kind, and its `[[cache.rules]]`;
//! - `upstream.rs`, `databases.rs` (with `[users]`): the other sections;
//! - `secrets.rs`: what a user's password string holds;
//! - `auth_file.rs`: `general.auth_file`, PgBouncer's `userlist.txt`;
//! - `locate.rs`: an error's line and key, from the parser's spans;
//! - here: the errors, the `Config` as a whole, loading, and the rules that involve several
//!   sections.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use serde::Deserialize;

mod auth_file;
pub mod cache;
mod choices;
mod connstring;
mod databases;
pub mod hba;
pub mod ident;
mod lag;
mod locate;
mod secrets;
mod settings;
mod table;
mod upstream;

pub use auth_file::{parse_userlist, AuthFile, AuthLine, BrokenLine};
pub use choices::{tls_protocols, AuthType, ClientTlsMode, LogFormat, PoolMode, ServerTlsMode};
pub use connstring::{parse_replicas, HostOrder, ServerOptions, SessionAttrs};
pub use databases::{AuthLookup, ClientTimeouts, DatabaseConfig, ResolvedDatabase, UserConfig};
use databases::{RawDatabase, RawUser};
pub use lag::ReplicaLag;
pub use secrets::SecretKind;
use upstream::{check_upstream, RawUpstream};
pub use upstream::{parse_upstream_url, Upstream};

use locate::{find_key_line, toml_error};
pub use locate::{key_path, toml_string};
use settings::RawGeneral;
pub use settings::{parse_host_port, parse_mode, General};
use table::U32_RANGE;
pub use table::{PendingRestart, Reload, SettingDoc};

/// The database name clients use to reach the admin console instead of a server.
pub const ADMIN_DATABASE: &str = "pgmemo";

/// The console's other name, PgBouncer's: tools made for PgBouncer (pgbouncer_exporter,
/// dashboards, scripts running `psql -d pgbouncer -c 'SHOW POOLS'`) reach it unchanged. As in
/// PgBouncer, no database of this name can be served.
pub const PGBOUNCER_ADMIN_DATABASE: &str = "pgbouncer";

/// Whether `name` is the admin console's database ([`ADMIN_DATABASE`] or its PgBouncer alias).
pub fn is_admin_database(name: &str) -> bool {
    name == ADMIN_DATABASE || name == PGBOUNCER_ADMIN_DATABASE
}

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
    pub(crate) fn at_line_of_key(self, text: &str) -> Self {
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
// The configuration
// ---------------------------------------------------------------------------------------------

/// Everything pgmemo is told: process-wide settings, where the servers are, which databases
/// and users exist. Built by [`Config::load`], [`Config::from_toml_str`] or
/// [`Config::for_upstream`]; replaced as a whole on RELOAD.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Config {
    /// `[general]`: process-wide settings and the defaults of every pool.
    pub general: General,
    /// `[upstream]`: the server used for every database that does not name its own host, and
    /// pgmemo's own role there (WAL invalidation's default login; clients who log in as that
    /// role use its password). Not the clients' server login: each logs in as its own role
    /// unless a `[databases]` entry names a `user`.
    pub upstream: Option<Upstream>,
    /// `[databases.NAME]`: the databases clients may ask for. Empty means "any name, served
    /// by the database of the same name on `upstream`". The key `"*"` serves any name that is
    /// not listed and supplies defaults for the listed ones.
    pub databases: BTreeMap<String, DatabaseConfig>,
    /// `[users.NAME]`: who may log in to pgmemo, and per-user pool settings.
    pub users: BTreeMap<String, UserConfig>,
    /// The users of `general.auth_file`, read with the file (and again on RELOAD) by
    /// [`Config::read_auth_file`]. A `[users.NAME] password` wins over the file's secret.
    pub auth_file: AuthFile,
    /// The rules of `general.auth_hba_file`, read with the file (and again on RELOAD) by
    /// [`Config::read_auth_file`].
    pub hba: std::sync::Arc<hba::Hba>,
    /// `[cache]`: the result cache and its rules.
    pub cache: cache::CacheConfig,
    /// The file this configuration came from, read again on RELOAD / SIGHUP.
    pub source: Option<PathBuf>,
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
        config
            .read_auth_file()
            .map_err(|e| e.at_line_of_key(text).in_file(file))?;
        Ok(config)
    }

    /// Reads `general.auth_file` into [`Config::auth_file`] (or empties it when the setting
    /// is unset). Loading a file does this; a configuration built in code calls it after
    /// setting `general.auth_file`.
    pub fn read_auth_file(&mut self) -> Result<(), ConfigError> {
        self.auth_file = match &self.general.auth_file {
            Some(path) => AuthFile::load(path)?,
            None => AuthFile::default(),
        };
        self.hba = match &self.general.auth_hba_file {
            Some(path) => std::sync::Arc::new(hba::Hba::load(
                path,
                self.general.auth_ident_file.as_deref(),
            )?),
            None => Default::default(),
        };
        Ok(())
    }

    /// `error` located as a problem of this configuration's file is: at its key's line (read
    /// again from the file; a configuration built from flags has none).
    pub fn locate(&self, error: ConfigError) -> ConfigError {
        let error = match self.source.as_deref().map(std::fs::read_to_string) {
            Some(Ok(text)) => error.at_line_of_key(&text),
            _ => error,
        };
        error.in_file(self.source.as_deref())
    }

    /// This configuration with `[general]`'s setting `key` set to `value` as the admin
    /// console's `SET key = value` says it (PgBouncer's form: `SET default_pool_size = 30`,
    /// `SET server_check_query = 'select 2'`, `SET log_stats = 1`): the value is read as
    /// the file would read it written bare, else as a string, else (`on`, `off`, `1`, `0`,
    /// `yes`, `no`) as a boolean; the whole configuration is then checked. Also says
    /// whether the setting applies without a restart.
    pub fn with_general_setting(
        &self,
        key: &str,
        value: &str,
    ) -> Result<(Config, bool), ConfigError> {
        let full_key = format!("general.{key}");
        let Some(doc) = General::reference().into_iter().find(|d| d.name == key) else {
            return Err(ConfigError::invalid(
                full_key,
                "no such setting in [general]",
            ));
        };
        let quoted = toml_string(value);
        let boolean = match value.to_ascii_lowercase().as_str() {
            "on" | "1" | "yes" | "true" => Some("true"),
            "off" | "0" | "no" | "false" => Some("false"),
            _ => None,
        };
        let bare = (!value.contains(['\n', '\r', '#', '='])).then_some(value);
        // The error of the value read as a string: a bare word that is no TOML value says
        // only that.
        let mut error = None;
        for candidate in [bare, Some(quoted.as_str()), boolean].into_iter().flatten() {
            match Config::parse(&format!("[general]\n{key} = {candidate}\n"), None) {
                Ok(one) => {
                    let mut config = self.clone();
                    config.general.take_key(&one.general, key);
                    // About the value given, not the file's line.
                    config.check()?;
                    return Ok((config, doc.reload == table::Reload::Live));
                }
                Err(e) if candidate == quoted || error.is_none() => error = Some(e),
                Err(_) => {}
            }
        }
        Err(match error {
            Some(ConfigError::Invalid { message, .. }) => ConfigError::invalid(full_key, message),
            Some(other) => other,
            None => ConfigError::invalid(full_key, "cannot be read"),
        })
    }

    /// Whether the event loops need tokio's time driver besides their own timers
    /// (`crate::timer`): the shared tier's Valkey client times out with tokio's timers.
    pub fn needs_tokio_timers(&self) -> bool {
        self.cache.shared.is_some()
    }

    /// What is valid but likely not what the operator means, one sentence each: printed by
    /// `--check` and logged as warnings at start and on RELOAD.
    pub fn notices(&self) -> Vec<String> {
        let mut notices = Vec::new();
        let what = match (self.cache.enabled, self.general.autoprepare) {
            (true, _) => "the result cache and autoprepare do",
            (false, true) => "autoprepare does",
            (false, false) => "",
        };
        let session = |mode: Option<PoolMode>| mode == Some(PoolMode::Session);
        let mut in_session: Vec<String> = Vec::new();
        if self.general.pool_mode == PoolMode::Session {
            in_session.push("general.pool_mode".into());
        }
        for (name, db) in &self.databases {
            if session(db.pool_mode) {
                in_session.push(format!("databases.{name}"));
            }
        }
        for (name, user) in &self.users {
            if session(user.pool_mode) {
                in_session.push(format!("users.{name}"));
            }
        }
        if !what.is_empty() && !in_session.is_empty() && !self.general.session_shared_statements {
            notices.push(format!(
                "{what} not apply to session-mode pools ({}) unless \
                 general.session_shared_statements = true: a session-mode client's statements \
                 otherwise go to its server as on a direct connection",
                in_session.join(", ")
            ));
        }
        notices
    }

    /// Checks the rules that involve several settings, and every value a flag may have
    /// changed. Run after command-line overrides, and before a configuration is used.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.check().map_err(|e| e.in_file(self.source.as_deref()))
    }

    fn check(&self) -> Result<(), ConfigError> {
        let g = &self.general;
        g.check()?;
        // Run again on the final values: command-line flags set some after the file was read.
        self.cache.check()?;

        if let Some(up) = &self.upstream {
            check_upstream(up)?;
        }
        if self.cache.enabled
            && self.cache.mode == cache::CacheMode::Auto
            && self.cache.invalidation != cache::Invalidation::Wal
        {
            return Err(ConfigError::invalid(
                "cache.mode",
                "\"auto\" needs cache.invalidation = \"wal\": pgmemo chooses queries nobody \
                 wrote a rule for, and only the WAL shows it every write to their tables (one \
                 made around this pgmemo would be served stale)",
            ));
        }
        if u64::from(self.cache.row_versions) * 8 > self.cache.max_memory as u64 / 2 {
            return Err(ConfigError::invalid(
                "cache.row_versions",
                format!(
                    "{} counters take {} bytes, more than half of cache.max_memory_mb",
                    self.cache.row_versions,
                    u64::from(self.cache.row_versions) * 8
                ),
            ));
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
            self.check_user(name, user)?;
        }
        self.check_auth_file()?;
        if g.auth_type == AuthType::Hba && g.auth_hba_file.is_none() {
            return Err(ConfigError::invalid(
                "general.auth_hba_file",
                "auth_type is \"hba\": name the HBA file whose lines give each connection its \
                 method",
            ));
        }
        let cert_lines = self.hba.uses_cert();
        if (g.auth_type == AuthType::Cert || cert_lines) && g.tls_ca_file.is_none() {
            return Err(ConfigError::invalid(
                "general.tls_ca_file",
                "certificate authentication needs tls_ca_file (the CA client certificates \
                 chain to) and client TLS",
            ));
        }

        if g.auth_type != AuthType::Trust {
            if !self.lists_users() && self.implicit_user().is_none() && !self.any_auth_user() {
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
            for (key, admin) in g
                .admin_users
                .iter()
                .map(|u| ("general.admin_users", u))
                .chain(g.stats_users.iter().map(|u| ("general.stats_users", u)))
            {
                if self.user_secret(admin).is_none() {
                    return Err(ConfigError::invalid(
                        key,
                        format!(
                            "{admin:?} has no password among the users, so it could never log in"
                        ),
                    ));
                }
            }
        }
        Ok(())
    }

    /// An md5 hash in the auth file cannot answer SCRAM, as in `[users]`; a user whose
    /// `[users]` password wins is not judged by its line.
    fn check_auth_file(&self) -> Result<(), ConfigError> {
        if self.general.auth_type != AuthType::ScramSha256 {
            return Ok(());
        }
        for line in self.auth_file.users() {
            let overridden = self
                .users
                .get(&line.name)
                .is_some_and(|u| u.password.is_some());
            if !overridden && SecretKind::of(&line.secret) == Ok(SecretKind::Md5) {
                return Err(ConfigError::Invalid {
                    file: self.auth_file.path.clone(),
                    line: Some(line.line),
                    key: None,
                    message: format!(
                        "user {:?} has an md5 hash, which cannot answer auth_type \
                         \"scram-sha-256\"; give its plain password or SCRAM-SHA-256 verifier, \
                         or use auth_type \"md5\"",
                        line.name
                    ),
                });
            }
        }
        Ok(())
    }

    /// The password of `role` that pgmemo holds as its own: `[upstream]`'s, when `role` is
    /// the upstream's user (pgmemo's own role, which clients of that name log in as too).
    pub fn own_password(&self, role: &str) -> Option<&str> {
        let up = self.upstream.as_ref().filter(|up| up.user == role)?;
        up.password.as_deref()
    }

    /// The one client user known without `[users]`: the upstream role, with its password.
    fn implicit_user(&self) -> Option<(&str, &str)> {
        let up = self.upstream.as_ref()?;
        Some((up.user.as_str(), up.password.as_deref()?))
    }

    /// The secret client user `user` must prove (see [`SecretKind`]), or None for an
    /// unknown user or one without a password: its `[users]` password, else its line of
    /// `general.auth_file`. With neither `[users]` nor an auth file, the upstream role is the
    /// one known user, with the upstream password: `pgmemo --upstream
    /// postgresql://app:pw@host:5432` lets clients log in as app / pw.
    pub fn user_secret(&self, user: &str) -> Option<&str> {
        if !self.lists_users() {
            return self
                .implicit_user()
                .filter(|(name, _)| *name == user)
                .map(|(_, secret)| secret);
        }
        self.users
            .get(user)
            .and_then(|u| u.password.as_deref())
            .or_else(|| self.auth_file.secret(user))
    }

    /// Whether the users who may log in are listed: in `[users]` or an auth file.
    fn lists_users(&self) -> bool {
        !self.users.is_empty() || self.auth_file.is_set()
    }

    /// Whether `user` may log in at all, before any password is checked: a `[users]` entry
    /// or a line of the auth file, or without either the upstream role, and the admin users.
    /// With no user list nor `[upstream]` anyone may (pgmemo then logs into servers as the
    /// client, and the server decides).
    pub fn is_known_user(&self, user: &str) -> bool {
        if self.is_admin(user) || self.is_stats_user(user) {
            return true;
        }
        if self.lists_users() {
            return self.users.contains_key(user) || self.auth_file.secret(user).is_some();
        }
        self.upstream.as_ref().is_none_or(|up| up.user == user)
    }

    /// Whether `user` may use the admin console.
    pub fn is_admin(&self, user: &str) -> bool {
        self.general.admin_users.iter().any(|a| a == user)
    }

    /// Whether `user` may use the console read-only (`general.stats_users`).
    pub fn is_stats_user(&self, user: &str) -> bool {
        self.general.stats_users.iter().any(|a| a == user)
    }

    /// Makes this configuration, read by a RELOAD, one that `running` can switch to: every
    /// setting that needs a restart keeps its running value (PgBouncer ignores such keys on a
    /// reload too), and is returned with the value the file gives. Run [`Config::validate`]
    /// again afterwards: a rule between settings may not hold with the running values (trust
    /// written for a new, loopback `listen`).
    pub fn keep_restart_settings(&mut self, running: &Config) -> Vec<PendingRestart> {
        let mut pending = self.general.keep_running(&running.general);
        pending.extend(self.cache.keep_running(&running.cache));
        pending
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
        let cx = table::Context { base_dir };
        let general = self.general.into_settings(&cx)?;
        let upstream = self.upstream.map(RawUpstream::into_upstream).transpose()?;
        let databases = databases::read_databases(self.databases)?;
        let users = databases::read_users(self.users)?;

        Ok(Config {
            general,
            upstream,
            databases,
            users,
            auth_file: AuthFile::default(),
            hba: Default::default(),
            cache: self.cache.into_settings(&cx)?,
            source: None,
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
