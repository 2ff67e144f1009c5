//! `[upstream]`: the PostgreSQL server pgmemo forwards to and the role it logs in as, given
//! as a `postgresql://` URL (also the `--upstream` flag) or as separate keys.

use std::fmt;

use serde::Deserialize;

use super::{int, ConfigError, Hidden, PORT_RANGE};

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

/// What an upstream must have, however it was given (file, URL or flag).
pub(super) fn check_upstream(up: &Upstream) -> Result<(), ConfigError> {
    if up.host.is_empty() {
        return Err(ConfigError::invalid("upstream.host", "must not be empty"));
    }
    check_host("upstream.host", &up.host)?;
    if up.port == 0 {
        return Err(ConfigError::invalid("upstream.port", "must be 1..=65535"));
    }
    if up.user.is_empty() {
        return Err(ConfigError::invalid("upstream.user", "must not be empty"));
    }
    Ok(())
}

/// A server host pgmemo can reach: a name or an address. A Unix socket directory (a path, as
/// libpq takes it) is refused here rather than failing at the first login: pgmemo connects to
/// servers over TCP only (issue 36 adds Unix sockets).
pub(super) fn check_host(key: &str, host: &str) -> Result<(), ConfigError> {
    if host.starts_with('/') || host.starts_with('@') {
        return Err(ConfigError::invalid(
            key,
            format!(
                "{host:?} is a Unix socket directory; pgmemo reaches servers over TCP only: give \
                 a host name or address (e.g. 127.0.0.1 with the server's port)"
            ),
        ));
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

/// `[upstream]` as written: a URL, or the same as separate keys.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawUpstream {
    url: Option<String>,
    host: Option<String>,
    port: Option<i64>,
    user: Option<String>,
    password: Option<String>,
}

impl RawUpstream {
    pub(super) fn into_upstream(self) -> Result<Upstream, ConfigError> {
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
