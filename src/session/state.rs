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
//! Detection reads the SQL the client sends: a cheap word scan ([`crate::query::words`]) on every simple
//! query and once per prepared statement; only a transaction that contained one of the words
//! costs the probe's round trip. State made inside functions or dynamic SQL is not seen.

use crate::params::Vars;
pub use crate::pins::Pins;
use crate::protocol::backend as be;
use crate::query::facts::{Custom, SettingFunctions, Touch};
use bytes::BytesMut;

/// What the server session holds after a transaction: one row per setting changed at session
/// level (name, value as `SHOW` gives it), the role and session authorization, and whether
/// each kind of per-backend state exists. Temporary objects of any kind (tables, functions,
/// types and domains, collations, operators, statistics objects, ...) are found by their
/// dependency on the session's temporary schema, which every object in a schema records:
/// one index scan of `pg_depend`. Schema-qualified: the client's search_path may be
/// anything.
pub const PROBE: &str =
    "SELECT name, pg_catalog.current_setting(name) FROM pg_catalog.pg_settings \
    WHERE source = 'session' \
    UNION ALL SELECT '$role', pg_catalog.current_setting('role') \
    UNION ALL SELECT '$session_authorization', pg_catalog.current_setting('session_authorization') \
    UNION ALL SELECT '$temp', EXISTS (SELECT FROM pg_catalog.pg_depend \
        WHERE refclassid = 'pg_catalog.pg_namespace'::pg_catalog.regclass \
        AND refobjid = pg_catalog.pg_my_temp_schema())::text \
    UNION ALL SELECT '$listen', EXISTS (SELECT FROM pg_catalog.pg_listening_channels())::text \
    UNION ALL SELECT '$advisory_lock', EXISTS (SELECT FROM pg_catalog.pg_locks \
        WHERE locktype = 'advisory' AND pid = pg_catalog.pg_backend_pid())::text \
    UNION ALL SELECT '$cursor', EXISTS (SELECT FROM pg_catalog.pg_cursors)::text";

/// Settings that hold one transaction's characteristics (set by `SET TRANSACTION`, `BEGIN
/// ISOLATION LEVEL ...`); the session's defaults are the `default_` ones.
const TRANSACTION_SETTINGS: [&str; 3] = [
    "transaction_isolation",
    "transaction_read_only",
    "transaction_deferrable",
];

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
            name if reported.get(name).is_some() && !crate::params::is_kept_as_setting(name) => {}
            // A transaction's own characteristics (`SET TRANSACTION`), which PostgreSQL lists
            // at session level once one ended: nothing of the session, and nothing to carry.
            name if TRANSACTION_SETTINGS.contains(&name) => {}
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
    /// Its server is counted among its pool's pinned ones (`Pool::pin`): pinned, or about to
    /// run a statement that may pin it (see [`StateWatch::wants_pin_slot`]); the probe after
    /// that statement's transaction settles whether it stays counted.
    pub counted: bool,
    /// The client's settings from its startup packet (unreported ones), which `RESET` returns
    /// to.
    pub startup: Vars,
    /// Custom settings its SQL set (see [`crate::query::facts::custom_settings`]), which the probe asks for.
    /// Boxed (8 bytes in every session, not a Vec's 24): rarely any, and only added to.
    pub custom: Option<Box<Vec<Box<str>>>>,
    /// What the client's statements since the last probe did to settings pgmemo cannot name:
    /// Some(true) may have set some, Some(false) reset them all ([`Custom`]).
    pub unnamed_settings: Option<bool>,
    /// Its pool's [`SettingFunctions`], as last seen (None: none known).
    pub setting_functions: Option<std::sync::Arc<SettingFunctions>>,
    /// Fires when a pinned client has been idle for `pinned_idle_timeout`: made at its first
    /// pin with a timeout, reset at the end of each of its transactions, polled only while it
    /// is pinned and idle.
    pub pinned_idle: Option<std::pin::Pin<Box<crate::timer::Sleep>>>,
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

    /// The client's SQL may set custom settings: the probe follows those it names from now
    /// on; unnamed ones pin the client at the probe.
    pub fn note_custom(&mut self, custom: &Custom) {
        if !self.enabled {
            return;
        }
        if custom.unnamed {
            self.unnamed_settings = Some(true);
        } else if custom.reset_all {
            self.unnamed_settings = Some(false);
        }
        let names = &custom.names;
        if names.is_empty() {
            return;
        }
        // No allocation unless a name is new.
        for name in names {
            let custom = self.custom.get_or_insert_default();
            if custom.len() < MAX_CUSTOM_SETTINGS && !custom.contains(name) {
                custom.push(name.clone());
            }
        }
    }

    /// The client's SQL `text` may call a function that sets settings it does not name.
    #[inline]
    pub fn note_calls(&mut self, text: &[u8]) {
        if self
            .setting_functions
            .as_ref()
            .is_some_and(|f| !f.names.is_empty() && f.named_in(text))
        {
            self.touched = true;
            self.unnamed_settings = Some(true);
        }
    }

    /// Whether a slot among its pool's pinned servers must be the client's before it takes a
    /// server for a simple query whose words are `query_words`: it may pin the client, which
    /// is not counted yet.
    #[inline]
    pub fn wants_pin_slot(&self, query_words: u32) -> bool {
        self.enabled && !self.counted && crate::query::facts::may_pin(query_words)
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
        let settings = match self.unnamed_settings.take() {
            Some(true) => Pins::SETTINGS,
            Some(false) => 0,
            None => self.pins & Pins::SETTINGS,
        };
        self.pins = found | (self.pins & Pins::LOAD) | settings;
        self.pins & !before
    }
}

/// Writes a NotificationResponse for the client with the process ID drivers compare against
/// the notifier's BackendKeyData: one its own server session sent (a NOTIFY of its own)
/// carries the process ID the client was given (`server_pid`: its server's real one,
/// `client_pid`: the client's); one another server sent, what `other` says of that server's
/// process (the ID pgmemo gave the client that last held it), or its own when nothing.
pub fn write_notification(
    out: &mut BytesMut,
    msg: &[u8],
    server_pid: i32,
    client_pid: i32,
    other: impl FnOnce(i32) -> Option<i32>,
) {
    let pid = msg
        .get(5..9)
        .map(|b| i32::from_be_bytes([b[0], b[1], b[2], b[3]]));
    let given = match pid {
        Some(pid) if msg[0] == be::NOTIFICATION_RESPONSE && pid == server_pid => Some(client_pid),
        Some(pid) if msg[0] == be::NOTIFICATION_RESPONSE => other(pid),
        _ => None,
    };
    match given {
        Some(given) => {
            out.extend_from_slice(&msg[..5]);
            out.extend_from_slice(&given.to_be_bytes());
            out.extend_from_slice(&msg[9..]);
        }
        None => out.extend_from_slice(msg),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn probe_rows() {
        let sql = probe_sql(&["app.o'x".into()]);
        assert!(sql.ends_with("SELECT E'app.o''x', pg_catalog.current_setting(E'app.o''x', true)"));
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
            row("transaction_isolation", "read committed"),
            row("default_transaction_isolation", "serializable"),
        ];
        let (settings, pins) = read_probe(&rows, &reported, "app");
        assert_eq!(settings.get("work_mem"), Some("8MB"));
        assert_eq!(settings.get("transaction_isolation"), None);
        assert_eq!(
            settings.get("default_transaction_isolation"),
            Some("serializable")
        );
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
        write_notification(&mut out, &msg, 77, 5, |_| None);
        assert_eq!(&crate::protocol::body(&out)[..4], &5i32.to_be_bytes());
        assert_eq!(&out[9..], &msg[9..]);
        out.clear();
        write_notification(&mut out, &msg, 78, 5, |_| None);
        assert_eq!(&out[..], &msg[..]);
        out.clear();
        // Another of pgmemo's servers: the ID of the client that last held it.
        write_notification(&mut out, &msg, 78, 5, |pid| (pid == 77).then_some(9));
        assert_eq!(&crate::protocol::body(&out)[..4], &9i32.to_be_bytes());
        assert_eq!(&out[9..], &msg[9..]);
    }
}
