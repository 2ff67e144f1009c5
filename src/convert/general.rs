//! `[pgbouncer]` to `[general]`: each key by its row in `keys.rs`, the ones that go together
//! (`listen_addr` and `listen_port`, the TLS modes, `auth_type`) by hand, and PgBouncer's
//! defaults where pgmemo's differ.

use std::collections::BTreeMap;

use super::ini::Line;
use super::keys::{self, Form, Rule, Zero};
use super::toml::{self, Entry};
use super::{Conversion, ConvertError, Settings};
use crate::config::AuthType;

/// pgmemo's longest duration, written for PgBouncer's "0 = no limit".
const FOREVER_SECS: u64 = 31_536_000;

/// Converts the `[pgbouncer]` lines (the last of a repeated key wins, as in PgBouncer) into
/// `[general]`, and returns what the other sections need to know.
pub(super) fn convert<'a>(
    lines: impl Iterator<Item = &'a Line>,
    cx: &mut Conversion,
) -> Result<Settings, ConvertError> {
    let mut last: BTreeMap<&str, &Line> = BTreeMap::new();
    let mut order = Vec::new();
    for line in lines {
        if last.insert(line.key.as_str(), line).is_none() {
            order.push(line.key.as_str());
        }
    }
    for key in &order {
        let line = last[key];
        match keys::rule(key) {
            None => {
                let entry = cx.unknown(line, "setting");
                cx.general.push(entry);
            }
            Some(Rule::Not(why)) => cx.general.push(not_converted(line, why)),
            Some(Rule::To(to, form)) => simple(line, to, form, cx)?,
            Some(Rule::Special(_)) => {}
        }
    }
    let get = |key: &str| last.get(key).copied();
    let pool_mode = pool_mode(get("pool_mode"), cx)?;
    let listen_is_loopback = listen(get("listen_addr"), get("listen_port"), cx)?;
    let auth_type = auth_type(get("auth_type"), cx)?;
    tls(get("client_tls_sslmode"), get("server_tls_sslmode"), cx)?;
    prepared_statements(get("max_prepared_statements"), cx)?;
    rest(&get, cx)?;
    if get("max_client_conn").is_none() {
        cx.general.set_noted(
            "max_client_conn",
            "100".into(),
            Some("PgBouncer's default (pgmemo's is 1000)".into()),
        );
    }
    let count = |key: &str, default: u32| -> u32 {
        get(key)
            .and_then(|l| l.value.parse().ok())
            .unwrap_or(default)
    };
    let (default_pool_size, min_pool_size) =
        (count("default_pool_size", 20), count("min_pool_size", 0));
    if min_pool_size > default_pool_size {
        cx.general.set_noted(
            "min_pool_size",
            default_pool_size.to_string(),
            Some(format!(
                "min_pool_size = {min_pool_size} is above default_pool_size; capped, as pgmemo \
                 refuses more"
            )),
        );
    }
    Ok(Settings {
        auth_type,
        auth_file: get("auth_file").cloned(),
        admin_users: get("admin_users").cloned(),
        stats_users: get("stats_users").cloned(),
        listen_is_loopback,
        pool_mode,
        default_pool_size,
        min_pool_size: min_pool_size.min(default_pool_size),
    })
}

/// A `# not converted: KEY = VALUE (place) — why` line.
pub(super) fn not_converted(line: &Line, why: &str) -> Entry {
    Entry::Comment(format!(
        "not converted: {} = {} ({}) — {why}",
        line.key,
        line.value,
        line.place()
    ))
}

/// An error about a value PgBouncer itself would refuse.
pub(super) fn invalid(line: &Line, expected: &str) -> ConvertError {
    ConvertError::of(
        line,
        format!(
            "invalid value {:?} for {}: expected {expected}",
            line.value, line.key
        ),
    )
}

/// A whole number as PgBouncer reads one.
pub(super) fn number(line: &Line) -> Result<u32, ConvertError> {
    line.value
        .parse::<u32>()
        .map_err(|_| invalid(line, "a whole number 0 or more"))
}

/// A key whose row names its pgmemo key and form.
fn simple(line: &Line, to: &str, form: Form, cx: &mut Conversion) -> Result<(), ConvertError> {
    let key = to.trim_start_matches("general.");
    let value = match form {
        Form::Count { min } => {
            let n = number(line)?;
            if n < min {
                let why = format!("pgmemo's {key} must be at least {min}");
                cx.general.push(not_converted(line, &why));
                return Ok(());
            }
            n.to_string()
        }
        Form::Flag => match line.value.as_str() {
            "0" => "false".into(),
            "1" => "true".into(),
            _ => return Err(invalid(line, "0 or 1")),
        },
        Form::Text => toml::string(&line.value),
        Form::Seconds(zero) => {
            let secs = line
                .value
                .parse::<f64>()
                .ok()
                .filter(|s| s.is_finite() && *s >= 0.0)
                .ok_or_else(|| invalid(line, "a number of seconds"))?;
            if secs == 0.0 {
                match zero {
                    Zero::Same => {}
                    Zero::Refused(why) => {
                        cx.general.push(not_converted(line, why));
                        return Ok(());
                    }
                    Zero::NoLimit => {
                        cx.general.set_noted(
                            key,
                            FOREVER_SECS.to_string(),
                            Some(format!(
                                "{} = 0 (no limit in PgBouncer): pgmemo's longest, one year",
                                line.key
                            )),
                        );
                        return Ok(());
                    }
                }
            }
            toml::seconds(secs.min(FOREVER_SECS as f64))
        }
    };
    cx.general.set(key, value);
    Ok(())
}

/// `pool_mode`: PgBouncer's default is session (pgmemo's transaction); statement becomes
/// transaction, which allows more.
fn pool_mode(line: Option<&Line>, cx: &mut Conversion) -> Result<&'static str, ConvertError> {
    let (mode, note) = match line.map(|l| (l, l.value.as_str())) {
        None => (
            "session",
            Some("PgBouncer's default (pgmemo's is transaction)".into()),
        ),
        Some((_, "session")) => ("session", None),
        Some((_, "transaction")) => ("transaction", None),
        Some((l, "statement")) => ("transaction", Some(statement_note(l))),
        Some((l, _)) => return Err(invalid(l, "session, transaction or statement")),
    };
    cx.general.set_noted("pool_mode", toml::string(mode), note);
    Ok(mode)
}

/// Why `statement` became `transaction`.
pub(super) fn statement_note(line: &Line) -> String {
    format!(
        "{} = statement ({}): pgmemo has no statement mode; transaction mode also lets\n\
         multi-statement transactions through",
        line.key,
        line.place()
    )
}

/// `listen_addr` and `listen_port` into `listen`. Returns whether the address is a
/// loopback one (for `trust`).
fn listen(
    addr: Option<&Line>,
    port: Option<&Line>,
    cx: &mut Conversion,
) -> Result<bool, ConvertError> {
    let port_number = match port {
        Some(l) => match l.value.parse::<u16>() {
            Ok(p) if p > 0 => p,
            _ => return Err(invalid(l, "a port 1..=65535")),
        },
        None => 6432,
    };
    let given = addr.map(|l| l.value.trim()).unwrap_or("");
    let mut notes = Vec::new();
    let all: Vec<&str> = given
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .collect();
    if all.len() > 1 {
        notes.push(format!(
            "listen_addr = {given}: pgmemo listens on one address; the first is used"
        ));
    }
    let host = match all.first().copied() {
        None => {
            notes.push(
                "PgBouncer listens on no TCP address without listen_addr, only on its Unix \
                 socket;\npgmemo listens on TCP only: on this machine's loopback address"
                    .to_string(),
            );
            "127.0.0.1".to_string()
        }
        Some("*") => {
            notes.push(
                "listen_addr = * (every address): pgmemo listens on every IPv4 address".into(),
            );
            "0.0.0.0".to_string()
        }
        Some("localhost") => "127.0.0.1".to_string(),
        Some(h) if h.contains(':') => format!("[{h}]"),
        Some(h) => h.to_string(),
    };
    let listen = format!("{host}:{port_number}");
    let loopback = match crate::config::parse_host_port(&listen) {
        Ok((h, _)) => h
            .parse::<std::net::IpAddr>()
            .map(|ip| ip.is_loopback())
            .unwrap_or(h == "localhost"),
        Err(e) => return Err(invalid(addr.or(port).expect("a value was given"), &e)),
    };
    let note = (!notes.is_empty()).then(|| notes.join("\n"));
    cx.general.set_noted("listen", toml::string(&listen), note);
    Ok(loopback)
}

/// `auth_type`: PgBouncer's default is md5 (pgmemo's scram-sha-256); methods pgmemo does not
/// have become md5, which accepts every kind of secret of the auth file.
fn auth_type(line: Option<&Line>, cx: &mut Conversion) -> Result<AuthType, ConvertError> {
    let Some(line) = line else {
        cx.general.set_noted(
            "auth_type",
            toml::string("md5"),
            Some("PgBouncer's default (pgmemo's is scram-sha-256)".into()),
        );
        return Ok(AuthType::Md5);
    };
    let (auth, why) = match line.value.as_str() {
        "md5" => (AuthType::Md5, None),
        "scram-sha-256" => (AuthType::ScramSha256, None),
        "trust" => (AuthType::Trust, None),
        "any" => (
            AuthType::Trust,
            Some("any: pgmemo's trust, which still checks the user is known".to_string()),
        ),
        "plain" => (
            AuthType::Md5,
            Some(
                "plain: pgmemo never asks for a clear-text password; md5 accepts the same secrets"
                    .into(),
            ),
        ),
        "hba" => (
            AuthType::Hba,
            Some(
                "hba: pgmemo reads local/host/hostssl/hostnossl lines with trust, reject, md5, \
                 scram-sha-256, peer and cert; `pgmemo --check` names a line it cannot honour"
                    .into(),
            ),
        ),
        "cert" => (AuthType::Cert, None),
        m @ ("pam" | "ldap") => (
            AuthType::Md5,
            Some(format!(
                "{m}: pgmemo checks passwords only; md5 accepts every kind of secret in [users]"
            )),
        ),
        _ => {
            return Err(invalid(
                line,
                "any, trust, plain, md5, cert, hba, pam, ldap or scram-sha-256",
            ))
        }
    };
    let note = why.map(|w| format!("auth_type = {} ({}) — {w}", line.value, line.place()));
    cx.general
        .set_noted("auth_type", toml::string(auth.as_str()), note);
    Ok(auth)
}

/// `client_tls_sslmode` into `client_tls`, `server_tls_sslmode` into `server_tls` (whose
/// PgBouncer default, prefer, is written out: pgmemo's is disable).
fn tls(
    client: Option<&Line>,
    server: Option<&Line>,
    cx: &mut Conversion,
) -> Result<(), ConvertError> {
    const MODES: &str = "disable, allow, prefer, require, verify-ca or verify-full";
    if client.is_none() && cx.general.value_of("tls_cert_file").is_some() {
        // pgmemo offers TLS once a certificate is set; PgBouncer only when asked to.
        cx.general.set_noted(
            "client_tls",
            toml::string("disable"),
            Some("PgBouncer's default client_tls_sslmode (pgmemo's is allow once a certificate is set)".into()),
        );
    }
    if let Some(line) = client {
        let mode = match line.value.as_str() {
            "disable" => "disable",
            "allow" | "prefer" => "allow",
            m @ ("require" | "verify-ca" | "verify-full") => m,
            _ => return Err(invalid(line, MODES)),
        };
        cx.general.set("client_tls", toml::string(mode));
    }
    let (mode, note) = match server.map(|l| (l, l.value.as_str())) {
        None => (
            "prefer",
            Some("PgBouncer's default server_tls_sslmode (pgmemo's is disable)".to_string()),
        ),
        Some((_, "disable")) => ("disable", None),
        Some((l, "allow")) => (
            "prefer",
            Some(format!(
                "{} = allow ({}): pgmemo's nearest is prefer",
                l.key,
                l.place()
            )),
        ),
        Some((_, "prefer")) => ("prefer", None),
        Some((_, "require")) => ("require", None),
        Some((l, "verify-ca")) => (
            "verify-full",
            Some(format!(
                "{} = verify-ca ({}): pgmemo checks the host name too (verify-full)",
                l.key,
                l.place()
            )),
        ),
        Some((_, "verify-full")) => ("verify-full", None),
        Some((l, _)) => return Err(invalid(l, MODES)),
    };
    cx.general.set_noted("server_tls", toml::string(mode), note);
    Ok(())
}

/// `max_prepared_statements`: 0 turns the tracking off; PgBouncer's default is 200.
fn prepared_statements(line: Option<&Line>, cx: &mut Conversion) -> Result<(), ConvertError> {
    match line.map(|l| (l, number(l))) {
        None => cx.general.set_noted(
            "max_prepared_statements",
            "200".into(),
            Some("PgBouncer's default (pgmemo's is 500)".into()),
        ),
        Some((_, Ok(0))) => cx.general.set("prepared_statements", "false".into()),
        Some((_, Ok(n))) => cx.general.set("max_prepared_statements", n.to_string()),
        Some((_, Err(e))) => return Err(e),
    }
    Ok(())
}

/// `max_packet_size`, `server_check_query`, `verbose`.
fn rest<'a>(
    get: &impl Fn(&str) -> Option<&'a Line>,
    cx: &mut Conversion,
) -> Result<(), ConvertError> {
    if let Some(line) = get("max_packet_size") {
        let n = line
            .value
            .parse::<u64>()
            .map_err(|_| invalid(line, "a number of bytes"))?;
        let clamped = n.clamp(1024, 1 << 30);
        let note = (clamped != n).then(|| {
            format!(
                "max_packet_size = {n} ({}): pgmemo's bounds are 1 KiB..1 GiB",
                line.place()
            )
        });
        cx.general
            .set_noted("max_message_size", clamped.to_string(), note);
    }
    if let Some(line) = get("server_check_query") {
        match line.value.as_str() {
            "" => cx.general.push(not_converted(
                line,
                "pgmemo always checks a server idle longer than server_check_delay",
            )),
            "<empty>" => cx.general.set("server_check_query", toml::string(";")),
            q => cx.general.set("server_check_query", toml::string(q)),
        }
    }
    if let Some(line) = get("verbose") {
        let level = match number(line)? {
            0 => "info",
            1 => "debug",
            _ => "trace",
        };
        cx.general.set("log_level", toml::string(level));
    }
    Ok(())
}

/// `admin_users` and `stats_users`, keeping those who could log in: with a password, unless
/// auth is trust.
pub(super) fn console_users(settings: &Settings, cx: &mut Conversion) {
    let lists = [
        ("admin_users", "admin user", &settings.admin_users),
        ("stats_users", "stats user", &settings.stats_users),
    ];
    for (key, kind, line) in lists {
        let Some(line) = line else {
            continue;
        };
        let mut kept = Vec::new();
        for name in line
            .value
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
        {
            if settings.auth_type == AuthType::Trust || cx.secret_of(name).is_some() {
                kept.push(toml::string(name));
            } else {
                cx.general.push(Entry::Comment(format!(
                    "not converted: {kind} {name:?} ({}) — no password for it among the users, \
                     so it could never log in",
                    line.place()
                )));
            }
        }
        let note = (key == "admin_users")
            .then(|| "the console is the database \"pgmemo\" (or \"pgbouncer\")".into());
        cx.general
            .set_noted(key, format!("[{}]", kept.join(", ")), note);
    }
}
