//! `[upstream]`: the PostgreSQL server pgmemo forwards to and pgmemo's own role there, given
//! as a libpq URL or connection string (also the `--upstream` flag) or as separate keys.
//!
//! The role is pgmemo's, not every client's: clients log into the server as their own roles
//! (PgBouncer's model; a `[databases]` entry's `user` makes it one fixed role). The upstream
//! role serves WAL invalidation (unless `cache.replication_user`) and is a client user like
//! any other, whose server login uses the upstream password: `pgmemo --upstream
//! postgresql://app:pw@db` lets clients log in as app / pw and logs them in as app.

use std::fmt;

use serde::Deserialize;

use super::connstring::ServerOptions;
use super::{int, ConfigError, Hidden, PORT_RANGE};

/// `[upstream]`: the PostgreSQL server pgmemo forwards to, and pgmemo's own role there.
/// Default: nothing set (for struct literals that give the four first fields).
#[derive(Clone, PartialEq, Eq, Default)]
pub struct Upstream {
    pub host: String,
    pub port: u16,
    /// pgmemo's own role: WAL invalidation logs in as it (unless `cache.replication_user`),
    /// and so do the clients who log in as it. Not the other clients' server login.
    pub user: String,
    /// That role's password (plain text: pgmemo must be able to answer md5 and SCRAM); also
    /// the server password of any login as that role that has none of its own.
    pub password: Option<String>,
    /// Hosts to try after `host:port`, in order (a URL or connection string with several).
    pub fallbacks: Vec<(String, u16)>,
    /// TLS, read-write, timeout and application name from the URL's parameters.
    pub options: ServerOptions,
    /// Streaming replicas of these hosts that provably read-only work may go to
    /// (`upstream.replicas`, `--replica`; see docs/replicas.md).
    pub replicas: Vec<(String, u16)>,
}

impl fmt::Debug for Upstream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Upstream")
            .field("host", &self.host)
            .field("port", &self.port)
            .field("user", &self.user)
            .field("password", &Hidden(&self.password))
            .field("fallbacks", &self.fallbacks)
            .field("options", &self.options)
            .field("replicas", &self.replicas)
            .finish()
    }
}

impl Upstream {
    /// The upstream as a URL without its password, for logs and SHOW CONFIG.
    pub fn display_url(&self) -> String {
        let host = |(h, p): (&str, u16)| {
            if h.contains(':') {
                format!("[{h}]:{p}")
            } else {
                format!("{}:{p}", h.replace('/', "%2F"))
            }
        };
        let hosts: Vec<String> = std::iter::once((self.host.as_str(), self.port))
            .chain(self.fallbacks.iter().map(|(h, p)| (h.as_str(), *p)))
            .map(host)
            .collect();
        let o = &self.options;
        let mut params = Vec::new();
        if let Some(mode) = o.tls {
            params.push(format!("sslmode={}", mode.as_str()));
        }
        if let Some(ca) = &o.tls_ca_file {
            params.push(format!("sslrootcert={}", ca.display()));
        }
        if let Some((cert, key)) = &o.tls_identity {
            params.push(format!("sslcert={}", cert.display()));
            params.push(format!("sslkey={}", key.display()));
        }
        if o.session_attrs != super::SessionAttrs::Any {
            params.push(format!("target_session_attrs={}", o.session_attrs.as_str()));
        }
        if o.balance != super::connstring::HostOrder::InOrder {
            params.push(format!("load_balance_hosts={}", o.balance.as_str()));
        }
        if let Some(t) = o.connect_timeout {
            params.push(format!("connect_timeout={}", t.as_secs()));
        }
        if let Some(name) = &o.application_name {
            params.push(format!("application_name={name}"));
        }
        let query = if params.is_empty() {
            String::new()
        } else {
            format!("?{}", params.join("&"))
        };
        format!("postgresql://{}@{}{query}", self.user, hosts.join(","))
    }
}

/// What an upstream must have, however it was given (file, URL or flag).
pub(super) fn check_upstream(up: &Upstream) -> Result<(), ConfigError> {
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

/// Reads the upstream from a libpq URL (`postgresql://USER[:PASSWORD]@HOST[:PORT][,HOST2...]
/// [/DATABASE][?PARAMS]`, also `postgres://`) or connection string (`host=... user=...`); see
/// [`super::connstring`] for the parameters.
///
/// USER is required; HOST defaults to 127.0.0.1 and PORT to 5432; a host that is a directory
/// (`host=/var/run/postgresql`, or `%2F...` in a URL) is a Unix socket directory. A database
/// is ignored: clients choose the database.
pub fn parse_upstream_url(url: &str) -> Result<Upstream, ConfigError> {
    let key = "upstream.url";
    let c = super::connstring::parse(key, url)?;
    let user = c.user.filter(|u| !u.is_empty()).ok_or_else(|| {
        ConfigError::invalid(
            key,
            "a user is required, as in postgresql://USER@HOST:PORT or user=USER",
        )
    })?;
    let mut hosts = c.hosts.into_iter();
    let (host, port) = hosts
        .next()
        .unwrap_or_else(|| ("127.0.0.1".to_string(), 5432));
    Ok(Upstream {
        host,
        port,
        user,
        password: c.password,
        fallbacks: hosts.collect(),
        options: c.options,
        replicas: Vec::new(),
    })
}

/// `[upstream]` as written: a URL, or the same as separate keys.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawUpstream {
    url: Option<String>,
    host: Option<String>,
    port: Option<i64>,
    user: Option<String>,
    password: Option<String>,
    /// Hosts and ports of its streaming replicas (a connection string or URL).
    replicas: Option<String>,
}

impl RawUpstream {
    pub(super) fn into_upstream(self) -> Result<Upstream, ConfigError> {
        let replicas = self
            .replicas
            .as_deref()
            .map(|text| super::connstring::parse_replicas("upstream.replicas", text))
            .transpose()?
            .unwrap_or_default();
        let mut up = self.into_primary()?;
        up.replicas = replicas;
        Ok(up)
    }

    fn into_primary(self) -> Result<Upstream, ConfigError> {
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
            fallbacks: Vec::new(),
            options: ServerOptions::default(),
            replicas: Vec::new(),
        })
    }
}
