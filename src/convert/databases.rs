//! `[databases]` connection strings to `[databases.NAME]` tables, and `[users]` settings to
//! `[users.NAME]`.
//!
//! One difference shapes this file: in PgBouncer a listed database does not inherit from the
//! `*` entry (each line is complete, the rest are `[pgbouncer]` defaults), while in pgmemo a
//! listed database takes what it does not set from `"*"`. So where `*` sets a key that a
//! listed database does not, PgBouncer's value for it is written out in that database.

use super::general::{invalid, not_converted, number, statement_note};
use super::ini::{parse_pairs, Line};
use super::keys::{not_in, DATABASE_NOT, USER_NOT};
use super::toml::{self, Entry, Table};
use super::{Conversion, ConvertError, Settings};
use crate::config::{AuthType, SecretKind, ADMIN_DATABASE, WILDCARD_DATABASE};

/// A database entry with no `host` (PgBouncer's Unix socket in its `unix_socket_dir`) or an
/// abstract-namespace socket (`@name`, which pgmemo cannot reach).
const LOCAL_HOST: &str = "127.0.0.1";

/// The keys a listed database would otherwise take from `"*"` in pgmemo.
const INHERITED: [&str; 5] = ["port", "dbname", "pool_size", "min_pool_size", "pool_mode"];

pub(super) fn convert<'a>(
    lines: impl Iterator<Item = &'a Line>,
    settings: &Settings,
    cx: &mut Conversion,
) -> Result<(), ConvertError> {
    let lines: Vec<&Line> = lines.collect();
    for line in &lines {
        if line.key == ADMIN_DATABASE {
            cx.left_out.push(not_converted(
                line,
                "the name \"pgmemo\" is pgmemo's admin console; rename the database",
            ));
            continue;
        }
        let table = database(line, settings, cx)?;
        cx.databases.insert(line.key.clone(), table);
    }
    match cx.databases.remove(WILDCARD_DATABASE) {
        Some(star) => {
            complete_listed(&star, settings, cx);
            cx.databases.insert(WILDCARD_DATABASE.into(), star);
        }
        None if cx.databases.is_empty() => no_databases(cx),
        None => {}
    }
    for table in cx.databases.values_mut() {
        fold_host_list(table);
    }
    Ok(())
}

/// The key a database with a host list carries until [`fold_host_list`] makes it a
/// `connstring` (PgBouncer's `load_balance_hosts`; never written out).
const BALANCE: &str = "load_balance_hosts";

/// A database with several hosts (`host=a,b`): pgmemo's `host` takes one, so its host, port,
/// database name, user and password go into a `connstring`, with `load_balance_hosts` as
/// PgBouncer balances the list (round-robin unless it said disable).
fn fold_host_list(table: &mut Table) {
    let Some(balance) = table.remove(BALANCE) else {
        return;
    };
    let mut parts = Vec::new();
    for key in ["host", "port", "dbname", "user", "password"] {
        if let Some(value) = table.remove(key) {
            let text = match key {
                "port" => value,
                _ => toml::unstring(&value),
            };
            parts.push(format!("{key}={}", libpq_value(&text)));
        }
    }
    let note = match toml::unstring(&balance).as_str() {
        "disable" => {
            "several hosts (PgBouncer's load_balance_hosts=disable): tried in order, the first \
             that works taking each new connection"
        }
        _ => {
            parts.push("load_balance_hosts=round-robin".into());
            "several hosts, balanced round-robin as PgBouncer balances a host list"
        }
    };
    table.set_noted(
        "connstring",
        toml::string(&parts.join(" ")),
        Some(note.into()),
    );
}

/// A value as libpq's key=value strings take it: bare, or quoted when it has a space, a
/// quote or a backslash (or is empty).
fn libpq_value(text: &str) -> String {
    if !text.is_empty() && !text.contains([' ', '\'', '\\']) {
        return text.to_owned();
    }
    format!("'{}'", text.replace('\\', "\\\\").replace('\'', "\\'"))
}

/// One `name = connection string` line.
fn database(line: &Line, settings: &Settings, cx: &mut Conversion) -> Result<Table, ConvertError> {
    let pairs = parse_pairs(&line.value)
        .map_err(|e| ConvertError::of(line, format!("database {:?}: {e}", line.key)))?;
    let mut table = Table::default();
    let mut host = None;
    let mut balance = None;
    for (key, value) in &pairs {
        match key.as_str() {
            "host" => host = Some(value.as_str()),
            "port" => match value.parse::<u16>() {
                Ok(p) if p > 0 => table.set("port", p.to_string()),
                _ => return Err(invalid(line, "port=1..65535")),
            },
            "dbname" | "user" | "password" | "auth_user" | "auth_query" | "auth_dbname" => {
                table.set(key, toml::string(value))
            }
            "pool_size"
            | "min_pool_size"
            | "max_db_connections"
            | "max_db_client_connections"
            | "reserve_pool_size" => {
                let n = value
                    .parse::<u32>()
                    .map_err(|_| invalid(line, &format!("{key}=a whole number")))?;
                table.set(key, n.to_string());
            }
            "reserve_pool" => {
                let n = value
                    .parse::<u32>()
                    .map_err(|_| invalid(line, "reserve_pool=a whole number"))?;
                table.set("reserve_pool_size", n.to_string());
            }
            "pool_mode" => pool_mode(line, value, &mut table)?,
            BALANCE => match value.as_str() {
                "round-robin" | "disable" => balance = Some(value.as_str()),
                _ => return Err(invalid(line, "load_balance_hosts=round-robin or disable")),
            },
            other => match not_in(DATABASE_NOT, other) {
                Some(why) => table.push(pair_not_converted(line, other, value, why)),
                None => {
                    let entry = cx.unknown(&pair_line(line, other, value), "database parameter");
                    table.push(entry);
                }
            },
        }
    }
    set_host(line, host, &mut table);
    if host.is_some_and(|h| h.contains(',')) {
        table.set(BALANCE, toml::string(balance.unwrap_or("round-robin")));
    }
    if table.value_of("user").is_some() && table.value_of("password").is_none() {
        forced_user_password(line, &mut table, cx);
    }
    if table.value_of("user").is_none() && table.remove("password").is_some() {
        table.push(Entry::Comment(format!(
            "not converted: password=... of {} ({}) — without user= PgBouncer logs in as each \
             client, with the client's own password; so does pgmemo",
            line.key,
            line.place()
        )));
    }
    cap_min_pool_size(&mut table, settings.default_pool_size);
    Ok(table)
}

/// `host`: one host. A Unix socket directory (a path) is kept: pgmemo connects to it as
/// libpq does. An abstract socket (`@name`) or no host at all becomes this machine's
/// loopback address; a list is kept for [`fold_host_list`].
fn set_host(line: &Line, host: Option<&str>, table: &mut Table) {
    let note = |what: &str| Some(format!("{} ({}): {what}", line.key, line.place()));
    let (value, note) = match host {
        None => (
            LOCAL_HOST.to_string(),
            note("no host, which is PgBouncer's Unix socket; pgmemo connects over TCP only"),
        ),
        Some(h) if h.starts_with('@') => (
            LOCAL_HOST.to_string(),
            note(&format!(
                "host={h} is an abstract Unix socket, which pgmemo does not reach"
            )),
        ),
        // Several hosts: made a connstring at the end (fold_host_list).
        Some(h) if h.contains(',') => (h.to_string(), None),
        Some(h) => (h.to_string(), None),
    };
    table.set_noted("host", toml::string(&value), note);
}

/// A database that logs in as a fixed `user=` without `password=`: PgBouncer takes the
/// password from the auth file. pgmemo can when it is a plain one.
fn forced_user_password(line: &Line, table: &mut Table, cx: &Conversion) {
    let user = toml::unstring(table.value_of("user").unwrap_or_default());
    match cx.secret_of(&user) {
        Some(secret) if SecretKind::of(&secret) == Ok(SecretKind::Plain) => table.set_noted(
            "password",
            toml::string(&secret),
            Some(format!("{user}'s password, from the auth file")),
        ),
        Some(_) => table.push(Entry::Comment(format!(
            "not converted: {user}'s password for {} ({}) — the auth file holds a hash; pgmemo \
             needs the plain password to log in as a fixed user (set password = \"...\")",
            line.key,
            line.place()
        ))),
        None => {}
    }
}

/// pgmemo refuses a `min_pool_size` above the pool's size; PgBouncer caps it.
fn cap_min_pool_size(table: &mut Table, default_pool_size: u32) {
    let get = |t: &Table, k| t.value_of(k).and_then(|v| v.parse::<u32>().ok());
    let size = get(table, "pool_size").unwrap_or(default_pool_size);
    if let Some(min) = get(table, "min_pool_size").filter(|min| *min > size) {
        table.set_noted(
            "min_pool_size",
            size.to_string(),
            Some(format!(
                "min_pool_size={min} is above the pool's size; capped"
            )),
        );
    }
}

fn pool_mode(line: &Line, value: &str, table: &mut Table) -> Result<(), ConvertError> {
    match value {
        "session" | "transaction" => table.set("pool_mode", toml::string(value)),
        "statement" => table.set_noted(
            "pool_mode",
            toml::string("transaction"),
            Some(statement_note(&pair_line(line, "pool_mode", value))),
        ),
        _ => return Err(invalid(line, "pool_mode=session, transaction or statement")),
    }
    Ok(())
}

/// The ini line, narrowed to one `key=value` pair of its connection string.
fn pair_line(line: &Line, key: &str, value: &str) -> Line {
    Line {
        key: key.into(),
        value: value.into(),
        ..line.clone()
    }
}

fn pair_not_converted(line: &Line, key: &str, value: &str, why: &str) -> Entry {
    not_converted(&pair_line(line, key, value), why)
}

/// Writes into each listed database what it would otherwise take from `"*"` in pgmemo but
/// not in PgBouncer.
fn complete_listed(star: &Table, settings: &Settings, cx: &mut Conversion) {
    for (name, table) in cx.databases.iter_mut() {
        for key in INHERITED {
            if star.value_of(key).is_none() || table.value_of(key).is_some() {
                continue;
            }
            let value = match key {
                "port" => "5432".to_string(),
                "dbname" => toml::string(name),
                "pool_size" => settings.default_pool_size.to_string(),
                "min_pool_size" => settings.min_pool_size.to_string(),
                _ => toml::string(settings.pool_mode),
            };
            table.set_noted(
                key,
                value,
                Some("PgBouncer's value: a listed database does not inherit from \"*\"".into()),
            );
        }
        if star.value_of("user").is_some() && table.value_of("user").is_none() {
            cx.warnings.push(format!(
                "database {name:?} logs in as each client's user in PgBouncer, but in pgmemo it \
                 takes \"*\"'s user; give it user= explicitly"
            ));
        }
    }
}

/// PgBouncer with an empty `[databases]` serves no database; pgmemo needs one.
fn no_databases(cx: &mut Conversion) {
    cx.warnings.push(
        "[databases] is empty: PgBouncer serves no database, but pgmemo needs at least one; \
         the converted file serves every database from 127.0.0.1:5432 (databases.\"*\"), edit it"
            .into(),
    );
    let mut star = Table::default();
    star.set_noted(
        "host",
        toml::string(LOCAL_HOST),
        Some(
            "PgBouncer's [databases] is empty, so it serves no database; pgmemo needs at least\n\
             one. This serves every database from the PostgreSQL on this machine, as\n\
             `* = host=127.0.0.1` would in PgBouncer: name your databases here instead."
                .into(),
        ),
    );
    cx.databases.insert(WILDCARD_DATABASE.into(), star);
}

/// `[users]`: `name = pool_mode=... pool_size=...` into that user's table. A user without a
/// password cannot be written unless auth is trust (pgmemo lets in only users with one).
pub(super) fn user_settings<'a>(
    lines: impl Iterator<Item = &'a Line>,
    settings: &Settings,
    cx: &mut Conversion,
) -> Result<(), ConvertError> {
    for line in lines {
        let pairs = parse_pairs(&line.value)
            .map_err(|e| ConvertError::of(line, format!("user {:?}: {e}", line.key)))?;
        let mut table = Table::default();
        for (key, value) in &pairs {
            match key.as_str() {
                "pool_mode" => pool_mode(line, value, &mut table)?,
                "pool_size" => {
                    let n = number(&pair_line(line, key, value))?;
                    table.set("pool_size", n.max(1).to_string());
                }
                "max_user_connections"
                | "max_user_client_connections"
                | "query_timeout"
                | "idle_transaction_timeout"
                | "transaction_timeout"
                | "client_idle_timeout" => {
                    let n = number(&pair_line(line, key, value))?;
                    table.set(key, n.to_string());
                }
                other => match not_in(USER_NOT, other) {
                    Some(why) => table.push(pair_not_converted(line, other, value, why)),
                    None => {
                        let entry = cx.unknown(&pair_line(line, other, value), "user parameter");
                        table.push(entry);
                    }
                },
            }
        }
        match cx.users.get_mut(&line.key) {
            Some(user) => user.extend(table),
            None if settings.auth_type == AuthType::Trust => {
                cx.users.insert(line.key.clone(), table);
            }
            None => cx.left_out.push(not_converted(
                line,
                "this user has no password in the auth file, and pgmemo lets in only users \
                 with one",
            )),
        }
    }
    Ok(())
}
