//! `[databases.NAME]` and `[users.NAME]`: which databases clients may ask for and where each
//! is served from, who may log in, and the question the pools ask of them: where and how does
//! (database, user) reach its server ([`Config::resolve`]).

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use serde::Deserialize;

use super::table::{Context, Seconds, Value};
use super::{
    key_path, named, opt_int, AuthType, Config, ConfigError, Hidden, PoolMode, SecretKind,
    ServerOptions, PORT_RANGE, U32_RANGE, WILDCARD_DATABASE,
};

/// An optional number of seconds of a `[users.NAME]` entry, judged as `[general]`'s.
fn opt_secs(key: &str, v: Option<Seconds>) -> Result<Option<Duration>, ConfigError> {
    let cx = Context { base_dir: None };
    v.map(|s| Duration::read(s, &cx).map_err(|m| ConfigError::invalid(key, m)))
        .transpose()
}

/// `[databases.NAME]`: one database clients may ask for, and where it is served from.
/// Unset fields fall back to the `"*"` entry, then to `[upstream]` / `[general]` (but for
/// `user`: `[upstream]`'s is pgmemo's own role, not the clients' server login).
#[derive(Clone, PartialEq, Eq, Default)]
pub struct DatabaseConfig {
    /// Server host: a name, an IP address or a Unix socket directory (starts with `/`).
    pub host: Option<String>,
    pub port: Option<u16>,
    /// The database's name on the server; default: the name clients use.
    pub dbname: Option<String>,
    /// The one role every client of this database logs into the server as (PgBouncer's
    /// `user=`). When neither this entry nor `"*"` gives one, each client logs in as its own
    /// role, with its plain password or by pass-through (the SCRAM keys or md5 hash of the
    /// client's own login); `[upstream]`'s user is never taken for it.
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
    /// Server connections to this database across its pools, over the general setting.
    pub max_db_connections: Option<u32>,
    /// Client connections to this database at once, over the general setting.
    pub max_db_client_connections: Option<u32>,
    /// Extra connections per pool after `reserve_pool_timeout`, over the general setting.
    pub reserve_pool_size: Option<u32>,
    /// Session state handling for this database's pools, over the general setting.
    pub pin_session_state: Option<bool>,
    /// `auth_query` for this database's clients, over the general `auth_user`,
    /// `auth_query` and `auth_dbname` (PgBouncer's per-database overrides).
    pub auth_user: Option<String>,
    pub auth_query: Option<String>,
    pub auth_dbname: Option<String>,
    /// Hosts to try after `host`, in order, and the connection's TLS and other options: from
    /// `connstring` (which also sets host, port, dbname, user and password).
    pub fallbacks: Vec<(String, u16)>,
    pub options: ServerOptions,
    /// Streaming replicas of this entry's server that reads may go to (`replicas`, hosts and
    /// ports only: see docs/replicas.md); None: unset (the `"*"` entry's or `[upstream]`'s
    /// then, when the host comes from there).
    pub replicas: Option<Vec<(String, u16)>>,
    /// Whether provably read-only work goes to the replicas (`replica_reads`, "on" or "off",
    /// or a boolean); unset: on whenever there are replicas.
    pub replica_reads: Option<bool>,
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
    /// Server connections of this user across its pools, over the general setting.
    pub max_user_connections: Option<u32>,
    /// Client connections of this user at once, over the general setting.
    pub max_user_client_connections: Option<u32>,
    /// This user's clients' timeouts, over the general ones (PgBouncer's `[users]` has
    /// them too); 0 or unset: the general one.
    pub query_timeout: Option<Duration>,
    pub idle_transaction_timeout: Option<Duration>,
    pub transaction_timeout: Option<Duration>,
    pub client_idle_timeout: Option<Duration>,
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
    /// The role to log into the server as; None means the client's own role (PgBouncer's
    /// model), with a password from its login (see [`crate::app::App`]'s pool settings).
    pub server_user: Option<String>,
    /// The password of the server login's role that the configuration gives: the database's
    /// own, else `[upstream]`'s when the role is pgmemo's own ([`Config::own_password`]).
    pub server_password: Option<String>,
    /// Hosts to try after `host:port` (a connection string's others), in order.
    pub fallbacks: Vec<(String, u16)>,
    /// TLS and the rest of a connection string's parameters, for the entry the host came
    /// from; unset TLS fields fall back to `[general]`.
    pub server_options: ServerOptions,
    pub pool_size: u32,
    /// Never more than `pool_size`.
    pub min_pool_size: u32,
    pub pool_mode: PoolMode,
    pub autoprepare: bool,
    pub pin_session_state: bool,
    /// Server connections to the database across its pools; 0: no limit.
    pub max_db_connections: u32,
    /// Server connections of the user across its pools; 0: no limit.
    pub max_user_connections: u32,
    /// Extra connections for a client that waited `reserve_pool_timeout`.
    pub reserve_pool_size: u32,
    /// The streaming replicas of `host` that provably read-only work may go to (empty: none,
    /// or `replica_reads` off).
    pub replicas: Vec<(String, u16)>,
}

impl fmt::Debug for DatabaseConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DatabaseConfig")
            .field("host", &self.host)
            .field("port", &self.port)
            .field("dbname", &self.dbname)
            .field("user", &self.user)
            .field("password", &Hidden(&self.password))
            .field("fallbacks", &self.fallbacks)
            .field("options", &self.options)
            .field("pool_size", &self.pool_size)
            .field("min_pool_size", &self.min_pool_size)
            .field("pool_mode", &self.pool_mode)
            .field("replicas", &self.replicas)
            .field("replica_reads", &self.replica_reads)
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
            .field("fallbacks", &self.fallbacks)
            .field("server_options", &self.server_options)
            .field("pool_size", &self.pool_size)
            .field("min_pool_size", &self.min_pool_size)
            .field("pool_mode", &self.pool_mode)
            .field("replicas", &self.replicas)
            .finish()
    }
}

impl Config {
    /// `[databases.NAME]`'s rules, which depend on the `"*"` entry and `[upstream]`.
    pub(super) fn check_database(
        &self,
        name: &str,
        db: &DatabaseConfig,
    ) -> Result<(), ConfigError> {
        let key = |field: &str| key_path(&["databases", name, field]);
        if name.is_empty() {
            return Err(ConfigError::invalid(
                "databases",
                "a database name must not be empty",
            ));
        }
        if super::is_admin_database(name) {
            return Err(ConfigError::invalid(
                key_path(&["databases", name]),
                format!("the name \"{name}\" is reserved for the admin console"),
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
        if db.auth_query.as_ref().is_some_and(|q| !q.contains("$1")) {
            return Err(ConfigError::invalid(
                key("auth_query"),
                "must use $1, the user name",
            ));
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

    /// Where a database entry's server is, with the rest that travels with its host: the
    /// other hosts, the connection options, the replicas (none when `replica_reads` is off):
    /// the entry's own host, else `"*"`'s, else `[upstream]`'s. An entry's own `replicas`
    /// may name replicas of a host it takes from `"*"` or `[upstream]`.
    #[allow(clippy::type_complexity)]
    fn server_of(
        entry: &DatabaseConfig,
        star: &DatabaseConfig,
        up: Option<&super::Upstream>,
    ) -> Option<(
        String,
        Vec<(String, u16)>,
        ServerOptions,
        Vec<(String, u16)>,
    )> {
        let own = entry.replicas.as_ref();
        let (host, fallbacks, server_options, replicas) = if let Some(h) = &entry.host {
            let replicas = own.cloned().unwrap_or_default();
            (
                h.clone(),
                entry.fallbacks.clone(),
                entry.options.clone(),
                replicas,
            )
        } else if let Some(h) = &star.host {
            let replicas = own.or(star.replicas.as_ref()).cloned().unwrap_or_default();
            (
                h.clone(),
                star.fallbacks.clone(),
                star.options.clone(),
                replicas,
            )
        } else {
            let up = up?;
            let replicas = own
                .or(star.replicas.as_ref())
                .unwrap_or(&up.replicas)
                .clone();
            (
                up.host.clone(),
                up.fallbacks.clone(),
                up.options.clone(),
                replicas,
            )
        };
        let replica_reads = entry.replica_reads.or(star.replica_reads).unwrap_or(true);
        let replicas = if replica_reads { replicas } else { Vec::new() };
        Some((host, fallbacks, server_options, replicas))
    }

    fn wildcard(&self) -> Option<&DatabaseConfig> {
        self.databases.get(WILDCARD_DATABASE)
    }

    /// `[users.NAME]`'s rules, which depend on `general.auth_type`.
    pub(super) fn check_user(&self, name: &str, user: &UserConfig) -> Result<(), ConfigError> {
        let g = &self.general;
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
            None if g.auth_type != AuthType::Trust && self.auth_file.secret(name).is_none() => {
                return Err(ConfigError::invalid(
                    key,
                    format!(
                        "missing; with auth_type {:?} every user needs a password or verifier \
                         (here or in general.auth_file)",
                        g.auth_type.as_str()
                    ),
                ));
            }
            None => {}
            Some(p) if p.is_empty() => return Err(ConfigError::invalid(key, "must not be empty")),
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
        Ok(())
    }

    /// Where database `dbname` asked for by client user `user` is served from, and with
    /// which pool settings; None when no such database is configured (answer 3D000), and
    /// always for the admin database `pgmemo`.
    ///
    /// Each field comes from the first of these that sets it:
    /// - host, port: `[databases.NAME]` → `[databases."*"]` → `[upstream]` (port 5432 at the
    ///   end);
    /// - the server user and its password travel together: they come from the first of
    ///   `[databases.NAME]` and `[databases."*"]` that names a user, else the server login is
    ///   the client's own role (`user`). Never from `[upstream]`, whose user is pgmemo's own
    ///   role; but a login as that role without a password of its own takes `[upstream]`'s;
    /// - dbname: `[databases.NAME].dbname` → `"*"`'s dbname → the name the client asked for;
    /// - pool_size and pool_mode: `[users.USER]` → `[databases.NAME]` → `[databases."*"]` →
    ///   `[general]` (`default_pool_size`, `pool_mode`);
    /// - min_pool_size: `[databases.NAME]` → `"*"` → `[general]`, capped at pool_size.
    ///
    /// Any database name is served when there is no `[databases]` (from `[upstream]`) or a
    /// `"*"` entry; otherwise only the listed names.
    pub fn resolve(&self, dbname: &str, user: &str) -> Option<ResolvedDatabase> {
        if super::is_admin_database(dbname) {
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

        let (host, fallbacks, server_options, replicas) = Config::server_of(entry, star, up)?;
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
        } else {
            (None, None)
        };
        let login = server_user.as_deref().unwrap_or(user);
        let server_password =
            server_password.or_else(|| self.own_password(login).map(str::to_owned));
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
        let max_db_connections = entry
            .max_db_connections
            .or(star.max_db_connections)
            .unwrap_or(g.max_db_connections);
        let max_user_connections = user_cfg
            .and_then(|u| u.max_user_connections)
            .unwrap_or(g.max_user_connections);
        let reserve_pool_size = entry
            .reserve_pool_size
            .or(star.reserve_pool_size)
            .unwrap_or(g.reserve_pool_size);
        Some(ResolvedDatabase {
            host,
            port,
            dbname: server_dbname,
            server_user,
            server_password,
            fallbacks,
            server_options,
            pool_size,
            min_pool_size,
            pool_mode,
            autoprepare,
            pin_session_state,
            max_db_connections,
            max_user_connections,
            reserve_pool_size,
            replicas,
        })
    }

    /// The client connections database `dbname` and user `user` may each have at once
    /// (`max_db_client_connections`, `max_user_client_connections`; 0: no limit): the
    /// database's own, then `"*"`'s, then `[general]`'s; the user's own, then `[general]`'s.
    /// A 0 of a database's or user's own falls back too, as in PgBouncer.
    pub fn client_limits(&self, dbname: &str, user: &str) -> (u32, u32) {
        let own = |n: Option<u32>| n.filter(|n| *n > 0);
        let database = own(self
            .databases
            .get(dbname)
            .and_then(|d| d.max_db_client_connections))
        .or_else(|| own(self.wildcard().and_then(|d| d.max_db_client_connections)))
        .unwrap_or(self.general.max_db_client_connections);
        let user = own(self
            .users
            .get(user)
            .and_then(|u| u.max_user_client_connections))
        .unwrap_or(self.general.max_user_client_connections);
        (database, user)
    }
}

/// `[databases.NAME]` as written: every key optional, numbers wide.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawDatabase {
    /// A libpq connection string or URL: host(s), port(s), dbname, user, password and the
    /// connection's options, instead of the separate keys.
    connstring: Option<String>,
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
    max_db_connections: Option<i64>,
    max_db_client_connections: Option<i64>,
    reserve_pool_size: Option<i64>,
    auth_user: Option<String>,
    auth_query: Option<String>,
    auth_dbname: Option<String>,
    replicas: Option<String>,
    replica_reads: Option<OnOff>,
}

/// A switch written as a boolean or as PostgreSQL writes one, `"on"` or `"off"`.
#[derive(Deserialize)]
#[serde(untagged)]
pub(super) enum OnOff {
    Bool(bool),
    Text(String),
}

impl OnOff {
    pub(super) fn read(key: &str, raw: Option<OnOff>) -> Result<Option<bool>, ConfigError> {
        match raw {
            None => Ok(None),
            Some(OnOff::Bool(b)) => Ok(Some(b)),
            Some(OnOff::Text(t)) => match t.to_ascii_lowercase().as_str() {
                "on" | "true" => Ok(Some(true)),
                "off" | "false" => Ok(Some(false)),
                _ => Err(ConfigError::invalid(
                    key,
                    format!("{t:?}: expected \"on\" or \"off\""),
                )),
            },
        }
    }
}

/// `[users.NAME]` as written.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawUser {
    password: Option<String>,
    pool_mode: Option<String>,
    pool_size: Option<i64>,
    autoprepare: Option<bool>,
    pin_session_state: Option<bool>,
    max_user_connections: Option<i64>,
    max_user_client_connections: Option<i64>,
    query_timeout: Option<Seconds>,
    idle_transaction_timeout: Option<Seconds>,
    transaction_timeout: Option<Seconds>,
    client_idle_timeout: Option<Seconds>,
}

/// `[databases]` as written, each value judged with its key in hand.
pub(super) fn read_databases(
    raw: BTreeMap<String, RawDatabase>,
) -> Result<BTreeMap<String, DatabaseConfig>, ConfigError> {
    let mut databases = BTreeMap::new();
    for (name, db) in raw {
        let key = |field: &str| key_path(&["databases", &name, field]);
        let mut entry = DatabaseConfig {
            port: opt_int::<u16>(&key("port"), db.port, PORT_RANGE)?,
            pool_size: opt_int(&key("pool_size"), db.pool_size, U32_RANGE)?,
            min_pool_size: opt_int(&key("min_pool_size"), db.min_pool_size, U32_RANGE)?,
            pool_mode: named(&key("pool_mode"), db.pool_mode)?,
            autoprepare: db.autoprepare,
            pin_session_state: db.pin_session_state,
            max_db_connections: opt_int(
                &key("max_db_connections"),
                db.max_db_connections,
                U32_RANGE,
            )?,
            max_db_client_connections: opt_int(
                &key("max_db_client_connections"),
                db.max_db_client_connections,
                U32_RANGE,
            )?,
            reserve_pool_size: opt_int(&key("reserve_pool_size"), db.reserve_pool_size, U32_RANGE)?,
            auth_user: db.auth_user,
            auth_query: db.auth_query,
            auth_dbname: db.auth_dbname,
            host: db.host,
            dbname: db.dbname,
            user: db.user,
            password: db.password,
            fallbacks: Vec::new(),
            options: ServerOptions::default(),
            replicas: db
                .replicas
                .as_deref()
                .map(|text| super::connstring::parse_replicas(&key("replicas"), text))
                .transpose()?,
            replica_reads: OnOff::read(&key("replica_reads"), db.replica_reads)?,
        };
        if let Some(text) = &db.connstring {
            apply_connstring(&mut entry, &key("connstring"), text)?;
        }
        databases.insert(name, entry);
    }
    Ok(databases)
}

/// Fills a database entry from its `connstring`, which must be the only place that gives
/// host, port, dbname, user and password.
fn apply_connstring(entry: &mut DatabaseConfig, key: &str, text: &str) -> Result<(), ConfigError> {
    let given = [
        ("host", entry.host.is_some()),
        ("port", entry.port.is_some()),
        ("dbname", entry.dbname.is_some()),
        ("user", entry.user.is_some()),
        ("password", entry.password.is_some()),
    ];
    if let Some((field, _)) = given.iter().find(|(_, set)| *set) {
        return Err(ConfigError::invalid(
            key,
            format!("give either connstring or {field}, not both (put {field} in connstring)"),
        ));
    }
    let c = super::connstring::parse(key, text)?;
    let mut hosts = c.hosts.into_iter();
    if let Some((host, port)) = hosts.next() {
        entry.host = Some(host);
        entry.port = Some(port);
    }
    entry.fallbacks = hosts.collect();
    entry.dbname = c.dbname;
    entry.user = c.user;
    entry.password = c.password;
    entry.options = c.options;
    Ok(())
}

/// `[users]` as written, each value judged with its key in hand.
pub(super) fn read_users(
    raw: BTreeMap<String, RawUser>,
) -> Result<BTreeMap<String, UserConfig>, ConfigError> {
    let mut users = BTreeMap::new();
    for (name, user) in raw {
        let key = |field: &str| key_path(&["users", &name, field]);
        let entry = UserConfig {
            pool_mode: named(&key("pool_mode"), user.pool_mode)?,
            pool_size: opt_int(&key("pool_size"), user.pool_size, U32_RANGE)?,
            autoprepare: user.autoprepare,
            pin_session_state: user.pin_session_state,
            max_user_connections: opt_int(
                &key("max_user_connections"),
                user.max_user_connections,
                U32_RANGE,
            )?,
            max_user_client_connections: opt_int(
                &key("max_user_client_connections"),
                user.max_user_client_connections,
                U32_RANGE,
            )?,
            query_timeout: opt_secs(&key("query_timeout"), user.query_timeout)?,
            idle_transaction_timeout: opt_secs(
                &key("idle_transaction_timeout"),
                user.idle_transaction_timeout,
            )?,
            transaction_timeout: opt_secs(&key("transaction_timeout"), user.transaction_timeout)?,
            client_idle_timeout: opt_secs(&key("client_idle_timeout"), user.client_idle_timeout)?,
            password: user.password,
        };
        users.insert(name, entry);
    }
    Ok(users)
}

/// A client's timeouts (`query_timeout`, `idle_transaction_timeout`, `transaction_timeout`,
/// `client_idle_timeout`; zero: none), its user's own over the general ones.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ClientTimeouts {
    pub query: Duration,
    pub idle_transaction: Duration,
    pub transaction: Duration,
    pub client_idle: Duration,
}

impl ClientTimeouts {
    /// Whether none is set.
    pub fn none(&self) -> bool {
        [
            self.query,
            self.idle_transaction,
            self.transaction,
            self.client_idle,
        ]
        .iter()
        .all(Duration::is_zero)
    }
}

impl Config {
    /// The general timeouts of every client.
    pub fn general_timeouts(&self) -> ClientTimeouts {
        let g = &self.general;
        ClientTimeouts {
            query: g.query_timeout,
            idle_transaction: g.idle_transaction_timeout,
            transaction: g.transaction_timeout,
            client_idle: g.client_idle_timeout,
        }
    }

    /// Whether some `[users.NAME]` sets a timeout of its own.
    pub fn any_user_timeouts(&self) -> bool {
        self.users.values().any(|u| {
            [
                u.query_timeout,
                u.idle_transaction_timeout,
                u.transaction_timeout,
                u.client_idle_timeout,
            ]
            .iter()
            .any(|t| t.is_some_and(|t| !t.is_zero()))
        })
    }

    /// `user`'s clients' timeouts: its own where it sets one above 0 (PgBouncer's rule), else
    /// `general`'s ([`Config::general_timeouts`]).
    pub fn user_timeouts(&self, user: &str, general: ClientTimeouts) -> ClientTimeouts {
        let Some(u) = self.users.get(user) else {
            return general;
        };
        let pick = |own: Option<Duration>, general: Duration| {
            own.filter(|t| !t.is_zero()).unwrap_or(general)
        };
        ClientTimeouts {
            query: pick(u.query_timeout, general.query),
            idle_transaction: pick(u.idle_transaction_timeout, general.idle_transaction),
            transaction: pick(u.transaction_timeout, general.transaction),
            client_idle: pick(u.client_idle_timeout, general.client_idle),
        }
    }
}

/// How the secret of a client of one database is looked up (`auth_query`): as whom, with
/// which query, in which server database.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AuthLookup {
    pub user: String,
    pub query: String,
    /// Where the query runs: the database clients ask for (its name in pgmemo).
    pub dbname: String,
}

impl Config {
    /// The `auth_query` lookup of client database `dbname`: each of `auth_user`,
    /// `auth_query` and `auth_dbname` from `[databases.NAME]`, then `"*"`, then `[general]`
    /// (PgBouncer's per-database overrides); `auth_dbname` defaults to `dbname`. None when
    /// no `auth_user` is set.
    pub fn auth_lookup(&self, dbname: &str) -> Option<AuthLookup> {
        let entry = self.databases.get(dbname);
        let star = self.wildcard();
        let pick = |f: fn(&DatabaseConfig) -> &Option<String>, general: &Option<String>| {
            entry
                .and_then(|e| f(e).clone())
                .or_else(|| star.and_then(|s| f(s).clone()))
                .or_else(|| general.clone())
        };
        let g = &self.general;
        Some(AuthLookup {
            user: pick(|d| &d.auth_user, &g.auth_user)?,
            query: pick(|d| &d.auth_query, &None).unwrap_or_else(|| g.auth_query.clone()),
            dbname: pick(|d| &d.auth_dbname, &g.auth_dbname).unwrap_or_else(|| dbname.into()),
        })
    }

    /// Whether some client could have its secret looked up (`auth_user` in general or for
    /// some database).
    pub fn any_auth_user(&self) -> bool {
        self.general.auth_user.is_some() || self.databases.values().any(|d| d.auth_user.is_some())
    }
}
