//! A server given as a libpq connection string (`host=db1,db2 port=5432 sslmode=require`)
//! or URL (`postgresql://app:pw@db1:5432/app?sslmode=require`): `[upstream] url`, the
//! `--upstream` flag and `[databases.NAME] connstring`.
//!
//! tokio-postgres' `Config` does the parsing (both forms, quoting, percent-decoding, several
//! hosts and ports). What it does not know is handled here before it sees the string:
//! `sslmode=verify-ca`/`verify-full` (it knows disable/prefer/require), `sslrootcert`,
//! `sslcert` and `sslkey`, and `load_balance_hosts=round-robin` (PgBouncer's; libpq knows
//! `disable` and `random`).
//! Everything else it refuses (an unknown key, a bad value) is a configuration error naming
//! that key, in tokio-postgres' words.

use std::path::PathBuf;
use std::time::Duration;

use tokio_postgres::config::Host;

use super::{ConfigError, ServerTlsMode};

/// What a connection string says beyond host, port, database and role: how pgmemo talks to
/// that server. Unset fields fall back to `[general]` (`server_tls`, `server_tls_ca_file`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ServerOptions {
    /// `sslmode`: over `general.server_tls` for this server.
    pub tls: Option<ServerTlsMode>,
    /// `sslrootcert`: over `general.server_tls_ca_file` for this server.
    pub tls_ca_file: Option<PathBuf>,
    /// `sslcert` and `sslkey` (given together): the client certificate presented to this
    /// server, over `general.server_tls_cert_file` / `server_tls_key_file`.
    pub tls_identity: Option<(PathBuf, PathBuf)>,
    /// `target_session_attrs`: which of several hosts a connection may use.
    pub session_attrs: SessionAttrs,
    /// `connect_timeout`, per host.
    pub connect_timeout: Option<Duration>,
    /// `application_name`: the server's default for sessions that set none.
    pub application_name: Option<String>,
    /// `load_balance_hosts`: the order in which the hosts are tried for a new connection.
    pub balance: HostOrder,
}

/// libpq's `target_session_attrs`: what a server must be for a connection to stay on it
/// (libpq's checks, from what PostgreSQL 14 and later report at login: `in_hot_standby`,
/// `default_transaction_read_only`). Of several hosts, the first that is (in the order
/// `load_balance_hosts` gives) is used.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SessionAttrs {
    /// `any` (the default): whichever host answers.
    #[default]
    Any,
    /// `read-write`: one that accepts writes (not a standby, not
    /// `default_transaction_read_only`).
    ReadWrite,
    /// `read-only`: one that does not.
    ReadOnly,
    /// `primary`: not a standby.
    Primary,
    /// `standby`: a standby.
    Standby,
    /// `prefer-standby`: a standby if one answers, else any host.
    PreferStandby,
}

impl SessionAttrs {
    pub fn parse(text: &str) -> Option<SessionAttrs> {
        Some(match text {
            "any" => SessionAttrs::Any,
            "read-write" => SessionAttrs::ReadWrite,
            "read-only" => SessionAttrs::ReadOnly,
            "primary" => SessionAttrs::Primary,
            "standby" => SessionAttrs::Standby,
            "prefer-standby" => SessionAttrs::PreferStandby,
            _ => return None,
        })
    }

    /// Its `target_session_attrs` value.
    pub fn as_str(self) -> &'static str {
        match self {
            SessionAttrs::Any => "any",
            SessionAttrs::ReadWrite => "read-write",
            SessionAttrs::ReadOnly => "read-only",
            SessionAttrs::Primary => "primary",
            SessionAttrs::Standby => "standby",
            SessionAttrs::PreferStandby => "prefer-standby",
        }
    }

    /// Whether a server (a standby or not, refusing writes or not) may be used; `last_pass`:
    /// `prefer-standby`'s second pass over the hosts, when none was a standby.
    pub fn accepts(self, standby: bool, read_only: bool, last_pass: bool) -> bool {
        match self {
            SessionAttrs::Any => true,
            SessionAttrs::ReadWrite => !standby && !read_only,
            SessionAttrs::ReadOnly => standby || read_only,
            SessionAttrs::Primary => !standby,
            SessionAttrs::Standby => standby,
            SessionAttrs::PreferStandby => standby || last_pass,
        }
    }

    /// Whether it names the one host that takes writes: pgmemo then follows the primary as
    /// it moves (see `server::Primary`).
    pub fn wants_primary(self) -> bool {
        matches!(self, SessionAttrs::ReadWrite | SessionAttrs::Primary)
    }
}

/// The order in which the hosts of a connection string are tried for a new server
/// connection (`load_balance_hosts`); each passes over a host that fails to the next.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum HostOrder {
    /// `disable` (libpq's default): as written, so the first host takes every connection it
    /// can (failover).
    #[default]
    InOrder,
    /// `round-robin` (PgBouncer's default for a host list): each new connection starts at the
    /// next host.
    RoundRobin,
    /// `random` (libpq's): each new connection starts at a host chosen at random.
    Random,
}

impl HostOrder {
    /// Its `load_balance_hosts` value.
    pub fn as_str(self) -> &'static str {
        match self {
            HostOrder::InOrder => "disable",
            HostOrder::RoundRobin => "round-robin",
            HostOrder::Random => "random",
        }
    }
}

/// A connection string, read.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Connstring {
    /// Hosts and their ports in the order given; a host starting with `/` is a Unix socket
    /// directory. Empty when the string names no host.
    pub hosts: Vec<(String, u16)>,
    pub dbname: Option<String>,
    pub user: Option<String>,
    pub password: Option<String>,
    pub options: ServerOptions,
}

/// The keys tokio-postgres accepts that pgmemo does not act on: refused rather than
/// silently ignored.
const NOT_SUPPORTED: &[&str] = &[
    "options",
    "hostaddr",
    "sslnegotiation",
    "tcp_user_timeout",
    "keepalives",
    "keepalives_idle",
    "keepalives_interval",
    "keepalives_retries",
    "channel_binding",
];

impl std::fmt::Debug for Connstring {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connstring")
            .field("hosts", &self.hosts)
            .field("dbname", &self.dbname)
            .field("user", &self.user)
            .field("password", &super::Hidden(&self.password))
            .field("options", &self.options)
            .finish()
    }
}

/// Reads `text`, the value of configuration key `key`.
pub fn parse(key: &str, text: &str) -> Result<Connstring, ConfigError> {
    let err = |m: String| ConfigError::invalid(key, m);
    if let Some((scheme, _)) = text.split_once("://") {
        if scheme != "postgresql" && scheme != "postgres" {
            return Err(err(format!(
                "not a postgresql:// URL ({scheme}://); expected \
                 postgresql://USER[:PASSWORD]@HOST[:PORT] or a connection string host=... user=..."
            )));
        }
    }
    let (rest, sslmode) = take_param(text, "sslmode");
    let (rest, rootcert) = take_param(&rest, "sslrootcert");
    let (rest, sslcert) = take_param(&rest, "sslcert");
    let (rest, sslkey) = take_param(&rest, "sslkey");
    let (rest, balance) = take_param(&rest, "load_balance_hosts");
    // Read here: tokio-postgres knows only any, read-write and read-only.
    let (rest, attrs) = take_param(&rest, "target_session_attrs");
    let session_attrs = match attrs.as_deref() {
        None => SessionAttrs::Any,
        Some(text) => SessionAttrs::parse(text).ok_or_else(|| {
            err(format!(
                "invalid value {text:?} for option `target_session_attrs` (expected any, \
                 read-write, read-only, primary, standby or prefer-standby)"
            ))
        })?,
    };
    let balance = match balance.as_deref() {
        None | Some("disable") => HostOrder::InOrder,
        Some("round-robin") => HostOrder::RoundRobin,
        Some("random") => HostOrder::Random,
        Some(other) => {
            return Err(err(format!(
                "invalid value {other:?} for option `load_balance_hosts` (expected disable, \
                 round-robin or random)"
            )))
        }
    };
    let tls_identity = match (sslcert, sslkey) {
        (Some(cert), Some(key)) => Some((PathBuf::from(cert), PathBuf::from(key))),
        (None, None) => None,
        _ => return Err(err("give sslcert and sslkey together".into())),
    };
    let tls = sslmode
        .map(|mode| match mode.as_str() {
            "disable" | "allow" => Ok(ServerTlsMode::Disable),
            "prefer" => Ok(ServerTlsMode::Prefer),
            "require" => Ok(ServerTlsMode::Require),
            // pgmemo's only verifying mode checks the host name too: verify-ca is stricter.
            "verify-ca" | "verify-full" => Ok(ServerTlsMode::VerifyFull),
            other => Err(err(format!(
                "invalid value {other:?} for option `sslmode` (expected disable, allow, \
                 prefer, require, verify-ca or verify-full)"
            ))),
        })
        .transpose()?;
    let config: tokio_postgres::Config =
        rest.parse().map_err(
            |e: tokio_postgres::Error| match std::error::Error::source(&e) {
                Some(cause) => err(format!("{e}: {cause}")),
                None => err(e.to_string()),
            },
        )?;
    for name in NOT_SUPPORTED {
        if has_param(&rest, name) {
            return Err(err(format!("option `{name}` is not supported by pgmemo")));
        }
    }
    let ports = config.get_ports();
    let hosts = config.get_hosts();
    if ports.len() > 1 && ports.len() != hosts.len().max(1) {
        return Err(err(format!(
            "{} ports for {} hosts: give one port, or one for each host",
            ports.len(),
            hosts.len()
        )));
    }
    if ports.contains(&0) {
        return Err(err("a port must be 1..=65535".into()));
    }
    let port_of = |i: usize| match ports {
        [] => 5432,
        [one] => *one,
        many => many[i],
    };
    let mut host_list = Vec::with_capacity(hosts.len());
    for (i, host) in hosts.iter().enumerate() {
        let name = match host {
            Host::Tcp(name) => name.clone(),
            Host::Unix(dir) => dir.to_string_lossy().into_owned(),
        };
        if name.is_empty() {
            return Err(err("a host must not be empty".into()));
        }
        host_list.push((name, port_of(i)));
    }
    if host_list.is_empty() && !ports.is_empty() {
        host_list.push(("127.0.0.1".to_string(), port_of(0)));
    }
    let password = config
        .get_password()
        .map(|p| String::from_utf8(p.to_vec()).map_err(|_| err("the password is not UTF-8".into())))
        .transpose()?;
    Ok(Connstring {
        hosts: host_list,
        dbname: config.get_dbname().map(str::to_owned),
        user: config.get_user().map(str::to_owned),
        password,
        options: ServerOptions {
            tls,
            tls_ca_file: rootcert.map(PathBuf::from),
            tls_identity,
            session_attrs,
            connect_timeout: config.get_connect_timeout().copied(),
            application_name: config.get_application_name().map(str::to_owned),
            balance,
        },
    })
}

/// Whether `text` gives parameter `name` (as `name=` in a key/value string or after `?`/`&`
/// in a URL).
fn has_param(text: &str, name: &str) -> bool {
    find_param(text, name).is_some()
}

/// `text` without parameter `name`, and that parameter's value (unquoted): how the two
/// parameters tokio-postgres does not know reach pgmemo. A value is read up to the next
/// space (`&` in a URL) and may not be quoted.
fn take_param(text: &str, name: &str) -> (String, Option<String>) {
    let Some((start, value_start)) = find_param(text, name) else {
        return (text.to_string(), None);
    };
    let url = text.contains("://");
    let value_end = text[value_start..]
        .find(|c: char| {
            if url {
                c == '&' || c == '#'
            } else {
                c.is_ascii_whitespace()
            }
        })
        .map_or(text.len(), |i| value_start + i);
    let value = text[value_start..value_end].to_string();
    let mut rest = String::with_capacity(text.len());
    rest.push_str(&text[..start]);
    let mut after = &text[value_end..];
    if url {
        // Drop the separator too, keeping the `?` when the parameter was the first.
        match (rest.chars().last(), after.strip_prefix('&')) {
            (Some('?'), Some(a)) => after = a,
            (Some('&'), _) => {
                rest.pop();
            }
            (Some('?'), None) => {
                rest.pop();
            }
            _ => {}
        }
    }
    rest.push_str(after);
    (rest, Some(value))
}

/// Where parameter `name` starts in `text` and where its value starts.
fn find_param(text: &str, name: &str) -> Option<(usize, usize)> {
    let url = text.contains("://");
    let query_start = if url { text.find('?')? } else { 0 };
    let mut from = query_start;
    while let Some(i) = text[from..].find(name) {
        let start = from + i;
        let before = text[..start].chars().last();
        let boundary = match before {
            None => true,
            Some(c) if url => c == '?' || c == '&',
            Some(c) => c.is_ascii_whitespace(),
        };
        let after = text[start + name.len()..].trim_start_matches(' ');
        if boundary && after.starts_with('=') {
            let eq = text.len() - after.len();
            let value =
                eq + 1 + (text[eq + 1..].len() - text[eq + 1..].trim_start_matches(' ').len());
            return Some((start, value));
        }
        from = start + name.len();
    }
    None
}

/// A `replicas` value (`[upstream]`, `[databases.NAME]`, `--replica`): a libpq connection
/// string or URL that names hosts and ports only (`host=r1,r2 port=5432`,
/// `postgresql://r1:5432,r2:5433`). A replica is logged into as its primary is (the same
/// role, password, database and TLS settings): anything else it gives is refused rather
/// than silently ignored.
pub fn parse_replicas(key: &str, text: &str) -> Result<Vec<(String, u16)>, ConfigError> {
    let c = parse(key, text)?;
    let given = [
        ("user", c.user.is_some()),
        ("password", c.password.is_some()),
        ("dbname", c.dbname.is_some()),
        ("connection options", c.options != ServerOptions::default()),
    ];
    if let Some((what, _)) = given.iter().find(|(_, set)| *set) {
        return Err(ConfigError::invalid(
            key,
            format!(
                "names hosts and ports only ({what} given): replicas are logged into as the \
                 primary is"
            ),
        ));
    }
    if c.hosts.is_empty() {
        return Err(ConfigError::invalid(key, "names no host"));
    }
    Ok(c.hosts)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_value_strings_and_urls_read_the_same() {
        let kv = parse(
            "k",
            "host=db1,db2 port=5433,5434 dbname=app user=u password='p w' \
             sslmode=verify-full sslrootcert=/etc/ca.pem target_session_attrs=read-write \
             connect_timeout=3 application_name=pgm",
        )
        .unwrap();
        let url = parse(
            "k",
            "postgresql://u:p%20w@db1:5433,db2:5434/app?sslmode=verify-full&\
             sslrootcert=/etc/ca.pem&target_session_attrs=read-write&connect_timeout=3&\
             application_name=pgm",
        )
        .unwrap();
        for c in [&kv, &url] {
            assert_eq!(
                c.hosts,
                vec![("db1".to_string(), 5433), ("db2".to_string(), 5434)]
            );
            assert_eq!(c.dbname.as_deref(), Some("app"));
            assert_eq!(c.user.as_deref(), Some("u"));
            assert_eq!(c.password.as_deref(), Some("p w"));
            assert_eq!(c.options.tls, Some(ServerTlsMode::VerifyFull));
            assert_eq!(c.options.tls_ca_file, Some(PathBuf::from("/etc/ca.pem")));
            assert_eq!(c.options.session_attrs, SessionAttrs::ReadWrite);
            assert_eq!(c.options.connect_timeout, Some(Duration::from_secs(3)));
            assert_eq!(c.options.application_name.as_deref(), Some("pgm"));
        }
    }

    #[test]
    fn modes_sockets_and_single_ports() {
        let c = parse("k", "host=/tmp,db port=6000 sslmode=require").unwrap();
        assert_eq!(
            c.hosts,
            vec![("/tmp".to_string(), 6000), ("db".to_string(), 6000)]
        );
        assert_eq!(c.options.tls, Some(ServerTlsMode::Require));
        let c = parse("k", "postgresql://u@h?sslmode=prefer").unwrap();
        assert_eq!(c.hosts, vec![("h".to_string(), 5432)]);
        assert_eq!(c.options.tls, Some(ServerTlsMode::Prefer));
        let c = parse("k", "postgres://u@h:7000").unwrap();
        assert_eq!(c.options, ServerOptions::default());
        let c = parse("k", "postgresql://u@%2Fvar%2Frun%2Fpostgresql:5433/db").unwrap();
        assert_eq!(c.hosts, vec![("/var/run/postgresql".to_string(), 5433)]);
    }

    #[test]
    fn bad_strings_name_the_key() {
        let e = parse("upstream.url", "host=h bogus=1")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("upstream.url") && e.contains("unknown option `bogus`"),
            "{e}"
        );
        let e = parse("k", "postgresql://u@h?bogus=1")
            .unwrap_err()
            .to_string();
        assert!(e.contains("unknown option `bogus`"), "{e}");
        let c = parse("k", "host=h sslcert=/etc/c.crt sslkey=/etc/c.key").unwrap();
        assert_eq!(
            c.options.tls_identity,
            Some(("/etc/c.crt".into(), "/etc/c.key".into()))
        );
        let c = parse(
            "k",
            "postgresql://u@h/db?sslkey=/k&sslcert=/c&sslmode=require",
        )
        .unwrap();
        assert_eq!(c.options.tls_identity, Some(("/c".into(), "/k".into())));
        assert_eq!(c.dbname.as_deref(), Some("db"));
        let e = parse("k", "host=h sslcert=/etc/c.crt")
            .unwrap_err()
            .to_string();
        assert!(e.contains("sslcert and sslkey together"), "{e}");
        let c = parse("k", "host=a,b load_balance_hosts=round-robin").unwrap();
        assert_eq!(c.options.balance, HostOrder::RoundRobin);
        let c = parse("k", "postgresql://u@a,b/db?load_balance_hosts=random").unwrap();
        assert_eq!(c.options.balance, HostOrder::Random);
        assert_eq!(
            parse("k", "host=a").unwrap().options.balance,
            HostOrder::InOrder
        );
        let e = parse("k", "host=a load_balance_hosts=sometimes")
            .unwrap_err()
            .to_string();
        assert!(e.contains("load_balance_hosts"), "{e}");
        let e = parse("k", "host=h sslmode=sometimes")
            .unwrap_err()
            .to_string();
        assert!(e.contains("sslmode"), "{e}");
        let e = parse("k", "host=h keepalives=1").unwrap_err().to_string();
        assert!(e.contains("`keepalives` is not supported"), "{e}");
        let e = parse("k", "host=a,b,c port=1,2").unwrap_err().to_string();
        assert!(e.contains("2 ports for 3 hosts"), "{e}");
        let e = parse("k", "host=a target_session_attrs=writable")
            .unwrap_err()
            .to_string();
        assert!(e.contains("target_session_attrs"), "{e}");
        // (standby, read-only) of a primary, a read-only primary, a standby; the last pass.
        let servers = [(false, false), (false, true), (true, true)];
        let takes = |attrs: SessionAttrs, last_pass| {
            servers.map(|(standby, ro)| attrs.accepts(standby, ro, last_pass))
        };
        assert_eq!(takes(SessionAttrs::Any, false), [true, true, true]);
        assert_eq!(takes(SessionAttrs::ReadWrite, false), [true, false, false]);
        assert_eq!(takes(SessionAttrs::ReadOnly, false), [false, true, true]);
        assert_eq!(takes(SessionAttrs::Primary, false), [true, true, false]);
        assert_eq!(takes(SessionAttrs::Standby, false), [false, false, true]);
        assert_eq!(
            takes(SessionAttrs::PreferStandby, false),
            [false, false, true]
        );
        assert_eq!(takes(SessionAttrs::PreferStandby, true), [true, true, true]);
        for attrs in [
            "any",
            "read-write",
            "read-only",
            "primary",
            "standby",
            "prefer-standby",
        ] {
            let kv = parse("k", &format!("host=a,b target_session_attrs={attrs}")).unwrap();
            let url = parse(
                "k",
                &format!("postgresql://a,b/d?target_session_attrs={attrs}"),
            );
            assert_eq!(kv.options.session_attrs.as_str(), attrs);
            assert_eq!(url.unwrap().options.session_attrs, kv.options.session_attrs);
        }
    }
}
