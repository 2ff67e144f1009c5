//! A client's session state in transaction mode: what it changes in the server session it
//! happens to run on, which must follow the client rather than stay with that server.
//!
//! - **Settings** (`SET`, `RESET`, `RESET ALL`, `SET ROLE`, `SET SESSION AUTHORIZATION`,
//!   `SET SESSION CHARACTERISTICS`, `set_config(..., false)`, `DISCARD ALL`) are values: after
//!   a transaction that may have changed one, pgmemo asks the server which settings the session
//!   now holds ([`PROBE`]) and records them for the client. That answer is exact whatever the
//!   syntax, and whether the transaction committed, rolled back or failed. The next server the
//!   client lands on gets the differences (`params::sync_sql`), and the server it leaves is
//!   reset to the next client's values, so no client sees another's.
//! - **State that lives inside one backend** (temporary objects, `LISTEN`, session advisory
//!   locks, `WITH HOLD` cursors, `LOAD`; temporary functions too) cannot be carried: the client keeps its server
//!   ([`Pins`]) until the same probe shows the state gone, and a pinned client's server is
//!   cleaned before anyone else gets it.
//!
//! Detection reads the SQL the client sends: a cheap word scan ([`WORDS`]) on every simple
//! query and once per prepared statement; only a transaction that contained one of the words
//! costs the probe's round trip. State made inside functions or dynamic SQL is not seen.

use crate::params::Vars;
use crate::protocol::backend as be;
use crate::statements::sql;
use crate::words::query;
use bytes::BytesMut;

/// Words of statements that may change session state or remove it (bits of
/// `words::in_query`'s answer).
const STATE_WORDS: u32 = query::SET
    | query::RESET
    | query::SET_CONFIG
    | query::DISCARD
    | query::LISTEN
    | query::UNLISTEN
    | query::TEMP
    | query::PG_TEMP
    | query::HOLD
    | query::LOAD
    | query::PG_ADVISORY
    | query::PG_TRY_ADVISORY
    | query::CLOSE
    | query::DROP;
/// Of those, the words that matter only at the start of a statement: `SET` is also part of
/// every `UPDATE`, `LOAD` a common column name.
const LEADING: u32 = query::SET | query::LOAD;

/// What a text may do to the session.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Touch {
    /// It may change settings or create or remove state: probe after its transaction.
    pub probe: bool,
    /// It has a `LOAD`, whose library stays loaded for the server's life.
    pub load: bool,
    /// It may set a custom setting (a dotted name such as `app.tenant`), which `pg_settings`
    /// does not list: see [`custom_settings`].
    pub custom: bool,
}

/// Reads `text` (a prepared statement's).
pub fn touch(text: &[u8]) -> Touch {
    touch_found(crate::words::in_query(text), text)
}

/// Reads `text` (a simple query's) whose words (`words::in_query`) are `found`.
pub fn touch_found(found: u32, text: &[u8]) -> Touch {
    let found = found & STATE_WORDS;
    if found == 0 {
        return Touch::default();
    }
    let mut probe = found & !LEADING != 0;
    let mut load = false;
    if found & LEADING != 0 {
        let text = match std::str::from_utf8(text) {
            Ok(text) => std::borrow::Cow::Borrowed(text),
            Err(_) => String::from_utf8_lossy(text),
        };
        // `UPDATE t SET ...` has the word too: one statement (no `;` but a last one) needs no
        // split to find its leading word.
        let single = memchr::memchr(b';', text.as_bytes())
            .is_none_or(|at| text[at + 1..].trim_ascii().is_empty());
        let mut leading = |statement: &str| {
            if let Some(word) = sql::leading_words(statement, 1).first() {
                probe |= sql::is_keyword(word, "set");
                load |= sql::is_keyword(word, "load");
            }
        };
        if single {
            leading(&text);
        } else {
            sql::split(&text).into_iter().for_each(leading);
        }
    }
    Touch {
        probe: probe || load,
        load,
        custom: found & (query::SET | query::SET_CONFIG) != 0 && text.contains(&b'.'),
    }
}

/// The custom settings (dotted names: `app.tenant`, `my.flag`) that `text` sets with
/// `SET [SESSION | LOCAL] name ...` or `set_config('name', ...)`, lower-cased. PostgreSQL
/// keeps those as placeholders that `pg_settings` does not show, so the probe asks for each
/// by name. A name computed at run time (`set_config($1, ...)`, dynamic SQL) is not seen.
pub fn custom_settings(text: &[u8]) -> Vec<Box<str>> {
    let text = String::from_utf8_lossy(text);
    let mut names: Vec<Box<str>> = Vec::new();
    let mut add = |name: &str| {
        let name = name.to_ascii_lowercase();
        if name.contains('.') && !names.iter().any(|n| **n == *name) {
            names.push(name.into());
        }
    };
    let dotted = |s: &str| -> usize {
        s.bytes()
            .take_while(|&b| b.is_ascii_alphanumeric() || b == b'_' || b == b'.' || b == b'$')
            .count()
    };
    for statement in sql::split(&text) {
        let words = sql::leading_words(statement, 3);
        if words.first().is_some_and(|w| sql::is_keyword(w, "set")) {
            let at = match words.get(1) {
                Some(w) if sql::is_keyword(w, "session") || sql::is_keyword(w, "local") => 2,
                _ => 1,
            };
            if let Some(word) = words.get(at) {
                // A subslice of `statement`: the dotted name continues past the word.
                let start = word.as_ptr() as usize - statement.as_ptr() as usize;
                let rest = &statement[start..];
                add(&rest[..dotted(rest)]);
            }
        }
        let lower = statement.to_ascii_lowercase();
        let mut from = 0;
        while let Some(at) = lower[from..].find("set_config") {
            from += at + "set_config".len();
            let rest = lower[from..].trim_start();
            let Some(rest) = rest.strip_prefix('(') else {
                continue;
            };
            if let Some(rest) = rest.trim_start().strip_prefix('\'') {
                if let Some(end) = rest.find('\'') {
                    add(&rest[..end]);
                }
            }
        }
    }
    names
}

/// Why a client keeps its server (a set of bits).
pub struct Pins;

impl Pins {
    pub const TEMP: u8 = 1;
    pub const LISTEN: u8 = 2;
    pub const ADVISORY_LOCK: u8 = 4;
    pub const CURSOR: u8 = 8;
    pub const LOAD: u8 = 16;

    pub const ALL: [(u8, &'static str); 5] = [
        (Self::TEMP, "temp"),
        (Self::LISTEN, "listen"),
        (Self::ADVISORY_LOCK, "advisory_lock"),
        (Self::CURSOR, "cursor"),
        (Self::LOAD, "load"),
    ];

    /// The reasons in `pins`, comma-separated (`""` for none), as SHOW CLIENTS prints them.
    pub fn describe(pins: u8) -> String {
        Self::ALL
            .iter()
            .filter(|(bit, _)| pins & bit != 0)
            .map(|(_, name)| *name)
            .collect::<Vec<_>>()
            .join(",")
    }
}

/// What the server session holds after a transaction: one row per setting changed at session
/// level (name, value as `SHOW` gives it), the role and session authorization, and whether
/// each kind of per-backend state exists. Schema-qualified: the client's search_path may be
/// anything.
pub const PROBE: &str =
    "SELECT name, pg_catalog.current_setting(name) FROM pg_catalog.pg_settings \
    WHERE source = 'session' \
    UNION ALL SELECT '$role', pg_catalog.current_setting('role') \
    UNION ALL SELECT '$session_authorization', pg_catalog.current_setting('session_authorization') \
    UNION ALL SELECT '$temp', (EXISTS (SELECT FROM pg_catalog.pg_class \
        WHERE relnamespace = pg_catalog.pg_my_temp_schema()) \
        OR EXISTS (SELECT FROM pg_catalog.pg_proc \
        WHERE pronamespace = pg_catalog.pg_my_temp_schema()))::text \
    UNION ALL SELECT '$listen', EXISTS (SELECT FROM pg_catalog.pg_listening_channels())::text \
    UNION ALL SELECT '$advisory_lock', EXISTS (SELECT FROM pg_catalog.pg_locks \
        WHERE locktype = 'advisory' AND pid = pg_catalog.pg_backend_pid())::text \
    UNION ALL SELECT '$cursor', EXISTS (SELECT FROM pg_catalog.pg_cursors)::text";

/// At most this many custom setting names are followed per client.
const MAX_CUSTOM_SETTINGS: usize = 64;

/// [`PROBE`], asking also for the custom settings `custom` (which `pg_settings` does not list).
pub fn probe_sql(custom: &[Box<str>]) -> std::borrow::Cow<'static, str> {
    if custom.is_empty() {
        return PROBE.into();
    }
    let mut sql = String::from(PROBE);
    for name in custom {
        let name = crate::params::quote_literal(name);
        sql.push_str(&format!(
            " UNION ALL SELECT {name}, pg_catalog.current_setting({name}, true)"
        ));
    }
    sql.into()
}

/// The settings of [`PROBE`]'s answer that pgmemo carries (those PostgreSQL reports with
/// ParameterStatus, in `reported`, are carried from those messages instead), with `role` and
/// `session_authorization` when they differ from the server login's (`login_user`), and the
/// pins it shows.
pub fn read_probe(rows: &[Vec<Option<String>>], reported: &Vars, login_user: &str) -> (Vars, u8) {
    let mut settings = Vars::new();
    let mut pins = 0;
    for row in rows {
        let (Some(Some(name)), Some(Some(value))) = (row.first(), row.get(1)) else {
            continue;
        };
        let yes = value == "true";
        match name.as_str() {
            // A custom setting's placeholder that is reset reads as ''.
            name if name.contains('.') && value.is_empty() => {}
            "$role" if value != "none" => {
                settings.set("role", value);
            }
            "$session_authorization" if value != login_user => {
                settings.set("session_authorization", value);
            }
            "$temp" if yes => pins |= Pins::TEMP,
            "$listen" if yes => pins |= Pins::LISTEN,
            "$advisory_lock" if yes => pins |= Pins::ADVISORY_LOCK,
            "$cursor" if yes => pins |= Pins::CURSOR,
            name if name.starts_with('$') => {}
            name if reported.get(name).is_some() => {}
            name => {
                settings.set(name, value);
            }
        }
    }
    (settings, pins)
}

/// What the client wants its session's settings to be after a probe found `now`: the same,
/// and for each of its startup settings that `now` lacks (a `RESET`, `RESET ALL` or
/// `DISCARD ALL` took it back to the server's default), its startup value, as PostgreSQL's
/// `RESET` returns to the value the connection started with.
pub fn wanted(now: &Vars, startup: &Vars) -> Vars {
    let mut wanted = now.clone();
    for (name, value) in startup.iter() {
        if now.get(name).is_none() {
            wanted.set(name, value);
        }
    }
    wanted
}

/// Per-client record of session state.
#[derive(Debug, Default)]
pub struct StateWatch {
    /// Watching at all: transaction mode with `pin_session_state` on.
    pub enabled: bool,
    /// The client's work on its current server may have changed session state: the server is
    /// probed before it goes back to the pool.
    pub touched: bool,
    /// Why the client keeps its server ([`Pins`]).
    pub pins: u8,
    /// The client's settings from its startup packet (unreported ones), which `RESET` returns
    /// to.
    pub startup: Vars,
    /// Custom settings its SQL set (see [`custom_settings`]), which the probe asks for.
    /// A boxed slice (16 bytes in every session, not a Vec's 24): rarely any, and only added to.
    pub custom: Box<[Box<str>]>,
}

impl StateWatch {
    #[inline]
    pub fn note(&mut self, touch: Touch) {
        if !self.enabled {
            return;
        }
        self.touched |= touch.probe;
        if touch.load {
            // A loaded library cannot be unloaded: the client keeps its server for good.
            self.pins |= Pins::LOAD;
        }
    }

    /// The client's SQL `text` may set custom settings: the probe follows them from now on.
    pub fn note_custom(&mut self, names: &[Box<str>]) {
        if !self.enabled {
            return;
        }
        // No allocation unless a name is new: a boxed slice turns into a Vec of the same
        // length and capacity, and back.
        let mut custom = std::mem::take(&mut self.custom).into_vec();
        for name in names {
            if custom.len() < MAX_CUSTOM_SETTINGS && !custom.contains(name) {
                custom.push(name.clone());
            }
        }
        self.custom = custom.into_boxed_slice();
    }

    /// The server must not go back to the pool as things are.
    #[inline]
    pub fn keeps_server(&self) -> bool {
        self.touched || self.pins != 0
    }

    /// Takes the pins a probe found (a `LOAD` is never undone); returns the reasons that are
    /// new.
    pub fn set_pins(&mut self, found: u8) -> u8 {
        let before = self.pins;
        self.pins = found | (self.pins & Pins::LOAD);
        self.pins & !before
    }
}

/// Writes a NotificationResponse for the client: one its own server session sent (a NOTIFY
/// of its own) carries the process ID the client was given in BackendKeyData, which drivers
/// compare against (`server_pid`: its server's real one).
pub fn write_notification(out: &mut BytesMut, msg: &[u8], server_pid: i32, client_pid: i32) {
    let pid = msg
        .get(5..9)
        .map(|b| i32::from_be_bytes([b[0], b[1], b[2], b[3]]));
    if pid == Some(server_pid) && msg[0] == be::NOTIFICATION_RESPONSE {
        out.extend_from_slice(&msg[..5]);
        out.extend_from_slice(&client_pid.to_be_bytes());
        out.extend_from_slice(&msg[9..]);
    } else {
        out.extend_from_slice(msg);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn touches() {
        let probe = |t: &str| touch(t.as_bytes()).probe;
        assert!(probe("SET work_mem = '1MB'"));
        assert!(probe("select 1; /* c */ set role r"));
        assert!(probe("RESET ALL"));
        assert!(probe("SELECT set_config('a.b', 'c', false)"));
        assert!(probe("CREATE TEMP TABLE t (a int)"));
        assert!(probe("create temporary table t (a int)"));
        assert!(probe("create table pg_temp.t (a int)"));
        assert!(probe("LISTEN ch"));
        assert!(probe("UNLISTEN *"));
        assert!(probe("SELECT pg_advisory_lock(1)"));
        assert!(probe("SELECT pg_try_advisory_lock($1)"));
        assert!(probe("DECLARE c CURSOR WITH HOLD FOR SELECT 1"));
        assert!(probe("CLOSE c"));
        assert!(probe("DISCARD ALL"));
        assert!(!probe("UPDATE t SET a = 1 WHERE b = 2"));
        assert!(!probe("UPDATE t SET a = 1 WHERE b = 2 ; \n"));
        assert!(!probe("UPDATE t SET a = ';' WHERE b = 2"));
        assert!(probe("UPDATE t SET a = 1; SET work_mem = '1MB'"));
        assert!(probe("/* x */ SET work_mem = '1MB';"));
        assert!(!probe(
            "SELECT abalance FROM pgbench_accounts WHERE aid = 1"
        ));
        assert!(!probe("SELECT load FROM machines"));
        assert!(touch(b"LOAD 'auto_explain'").load);
        assert!(touch(b"SELECT set_config('app.tenant', $1, false)").custom);
        assert!(!touch(b"SET work_mem = '1MB'").custom);
        assert!(!touch(b"select load from t").load);
    }

    #[test]
    fn custom_setting_names() {
        let names = |t: &str| -> Vec<String> {
            custom_settings(t.as_bytes())
                .iter()
                .map(|n| n.to_string())
                .collect()
        };
        assert_eq!(names("SET app.tenant = 'a'"), ["app.tenant"]);
        assert_eq!(
            names("set session My.Flag to on; SET LOCAL x.y = 1"),
            ["my.flag", "x.y"]
        );
        assert_eq!(
            names("SELECT set_config('app.user', $1, false), pg_catalog.set_config ( 'work_mem', '1MB', false)"),
            ["app.user"]
        );
        assert!(names("SET work_mem = '1MB'; UPDATE t SET a.b = 1").is_empty());
        assert!(names("SELECT set_config($1, $2, false)").is_empty());
        let sql = probe_sql(&["app.o'x".into()]);
        assert!(sql.ends_with("SELECT E'app.o''x', pg_catalog.current_setting(E'app.o''x', true)"));
    }

    #[test]
    fn probe_rows() {
        let row = |n: &str, v: &str| vec![Some(n.to_owned()), Some(v.to_owned())];
        let mut reported = Vars::new();
        reported.set("TimeZone", "UTC");
        let rows = vec![
            row("work_mem", "8MB"),
            row("TimeZone", "Europe/Paris"),
            row("$role", "r1"),
            row("$session_authorization", "app"),
            row("$temp", "true"),
            row("$listen", "false"),
            row("$cursor", "true"),
        ];
        let (settings, pins) = read_probe(&rows, &reported, "app");
        assert_eq!(settings.get("work_mem"), Some("8MB"));
        assert_eq!(settings.get("role"), Some("r1"));
        assert_eq!(settings.get("timezone"), None);
        assert_eq!(settings.get("session_authorization"), None);
        assert_eq!(pins, Pins::TEMP | Pins::CURSOR);
        assert_eq!(Pins::describe(pins), "temp,cursor");
    }

    #[test]
    fn reset_returns_to_startup_values() {
        let mut startup = Vars::new();
        startup.set("work_mem", "2MB");
        startup.set("search_path", "app");
        let mut now = Vars::new();
        now.set("search_path", "other");
        let wanted = wanted(&now, &startup);
        assert_eq!(wanted.get("search_path"), Some("other"));
        assert_eq!(wanted.get("work_mem"), Some("2MB"));
    }

    #[test]
    fn own_notifications_carry_the_clients_pid() {
        let mut msg = BytesMut::new();
        crate::protocol::write_message(&mut msg, be::NOTIFICATION_RESPONSE, |b| {
            b.extend_from_slice(&77i32.to_be_bytes());
            b.extend_from_slice(b"ch\0payload\0");
        });
        let mut out = BytesMut::new();
        write_notification(&mut out, &msg, 77, 5);
        assert_eq!(&out[5..9], &5i32.to_be_bytes());
        assert_eq!(&out[9..], &msg[9..]);
        out.clear();
        write_notification(&mut out, &msg, 78, 5);
        assert_eq!(&out[..], &msg[..]);
    }
}
