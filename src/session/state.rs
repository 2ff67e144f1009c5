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
pub use crate::pins::Pins;
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

/// What [`custom_settings`] makes of a text.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Custom {
    /// The custom settings it sets by name, as PostgreSQL resolves the name (lower case:
    /// setting names are case-insensitive).
    pub names: Vec<Box<str>>,
    /// It may set settings pgmemo cannot name (`set_config` with a computed name, or a text
    /// that names `set_config` where pgmemo cannot read the call: dynamic SQL, a `DO` block):
    /// the client keeps its server ([`Pins::SETTINGS`]).
    pub unnamed: bool,
    /// It ends with every setting reset (`RESET ALL`, `DISCARD ALL`), unnamed ones included.
    pub reset_all: bool,
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
    let probe = found & !LEADING != 0;
    let mut load = false;
    let mut set = false;
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
                set |= sql::is_keyword(word, "set");
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
        probe: probe || load || set,
        load,
        // A custom setting's name has a dot, written as one or through a backslash escape
        // (`"app.tenant"`, `E'app\x2etenant'`): a SET whose text has neither (`SET LOCAL
        // statement_timeout = '5s'`, sent by some applications in every transaction) needs no
        // parse. Every text naming set_config, RESET or DISCARD is read.
        custom: (set && text.iter().any(|&b| b == b'.' || b == b'\\'))
            || found & (query::SET_CONFIG | query::RESET | query::DISCARD) != 0,
    }
}

/// The custom settings (dotted names: `app.tenant`, `my.flag`) that `text` sets with
/// `SET [SESSION] name ...` or `set_config(name, value, false)`, read with PostgreSQL's own
/// parser (`standard_strings`: the client's standard_conforming_strings), so a name is found
/// however it is spelt: quoted, in an escape string, a Unicode escape or a dollar quote.
/// PostgreSQL keeps those as placeholders that `pg_settings` does not show, so the probe asks
/// for each by name. What pgmemo cannot name is [`Custom::unnamed`].
pub fn custom_settings(text: &[u8], standard_strings: bool) -> Custom {
    let mut custom = Custom::default();
    let Ok(text) = std::str::from_utf8(text) else {
        // Not UTF-8: the server refuses it in a UTF-8 database; elsewhere it is not read.
        custom.unnamed = true;
        return custom;
    };
    let options = if standard_strings {
        pg_query::ParserOptions::default()
    } else {
        pg_query::ParserOptions::DISABLE_STANDARD_CONFORMING_STRINGS
    };
    let tree = match pg_query::parse(text, options) {
        Ok(parsed) => serde_json::to_value(&parsed.protobuf).ok(),
        // The server refuses it too: nothing runs.
        Err(_) => return custom,
    };
    let Some(tree) = tree else {
        custom.unnamed = true;
        return custom;
    };
    let mut calls = 0;
    let mut read = 0;
    walk_settings(&tree, &mut custom, &mut calls, &mut read);
    // `set_config` named where no call of it could be read (in a string run as SQL, a DO
    // block's body, a function's): it may set anything.
    let named = text.to_ascii_lowercase().matches("set_config").count();
    if named > calls || read < calls {
        custom.unnamed = true;
    }
    custom
}

/// Finds, in a parse tree as JSON, the settings set by name ([`custom_settings`]); counts
/// the calls of `set_config` (`calls`) and those whose name and scope were constants (`read`).
fn walk_settings(
    value: &serde_json::Value,
    custom: &mut Custom,
    calls: &mut usize,
    read: &mut usize,
) {
    use serde_json::Value;
    let Value::Object(fields) = value else {
        if let Value::Array(items) = value {
            for item in items {
                walk_settings(item, custom, calls, read);
            }
        }
        return;
    };
    for (key, inner) in fields {
        match key.as_str() {
            "VariableSetStmt" => {
                // pg_query's enums come as numbers: VAR_RESET_ALL is 6.
                let reset_all = inner["kind"].as_i64() == Some(6)
                    || inner["kind"].as_str() == Some("VAR_RESET_ALL");
                let local = inner["is_local"].as_bool() == Some(true);
                if reset_all {
                    custom.reset_all = true;
                } else if !local {
                    if let Some(name) = inner["name"].as_str() {
                        add_custom(custom, name);
                    }
                }
            }
            // DISCARD_ALL is 1.
            "DiscardStmt"
                if inner["target"].as_i64() == Some(1)
                    || inner["target"].as_str() == Some("DISCARD_ALL") =>
            {
                custom.reset_all = true;
            }
            "FuncCall"
                if crate::cache::analysis::last_name(&inner["funcname"]) == Some("set_config") =>
            {
                *calls += 1;
                let args = inner["args"].as_array().map(Vec::as_slice).unwrap_or(&[]);
                let constant = |i: usize| args.get(i).and_then(constant_text);
                if let (Some(name), Some(local)) = (constant(0), constant(2)) {
                    *read += 1;
                    // set_config(..., true) lasts until the transaction ends.
                    if !matches!(local.as_str(), "t" | "true" | "on" | "yes" | "1") {
                        add_custom(custom, &name);
                    }
                }
            }
            _ => {}
        }
        walk_settings(inner, custom, calls, read);
    }
}

/// A constant argument's text: a string or a boolean (`'app.tenant'`, `false`).
fn constant_text(arg: &serde_json::Value) -> Option<String> {
    let c = &arg["node"]["AConst"];
    if c.is_null() || c["isnull"].as_bool() == Some(true) {
        return None;
    }
    let val = &c["val"];
    if let Some(s) = val["Sval"]["sval"].as_str() {
        return Some(s.trim().to_ascii_lowercase());
    }
    if let Some(b) = val.get("Boolval") {
        let yes = b["boolval"].as_bool() == Some(true);
        return Some(if yes { "true" } else { "false" }.into());
    }
    None
}

fn add_custom(custom: &mut Custom, name: &str) {
    // PostgreSQL compares setting names without regard to case.
    let name = name.to_ascii_lowercase();
    if name.contains('.') && !custom.names.iter().any(|n| **n == *name) {
        custom.names.push(name.into());
    }
}

/// The database's own functions whose source may set a custom setting (`set_config`, or
/// `SET [SESSION] a.b` in a procedural body): a call of one sets something the client's text
/// does not name, so the client is treated as having set unnamed settings ([`Pins::SETTINGS`]).
/// A function that calls such a function is not followed (nor `EXECUTE` of a built string).
pub const SETTING_FUNCTIONS_SQL: &str = "SELECT DISTINCT pg_catalog.lower(p.proname::text) \
    FROM pg_catalog.pg_proc p JOIN pg_catalog.pg_language l ON l.oid = p.prolang \
    WHERE p.oid >= 16384 AND l.lanname NOT IN ('internal', 'c') \
    AND (p.prosrc ~* 'set_config' \
      OR p.prosrc ~* '\\mset\\s+(session\\s+)?(\"[^\"]*\\.|[a-z_][a-z0-9_$]*\\s*\\.)')";

/// The names of [`SETTING_FUNCTIONS_SQL`]'s answer, lower case.
#[derive(Debug, Default)]
pub struct SettingFunctions {
    /// The pool's generation of them (`Pool::setting_functions_generation`), from 1.
    pub generation: u32,
    pub names: Box<[Box<str>]>,
}

impl SettingFunctions {
    /// Whether `text` names one of the functions as a word, in any case (quoted too: a
    /// generous test, as for [`crate::words`]).
    pub fn named_in(&self, text: &[u8]) -> bool {
        let word_byte = |b: u8| b.is_ascii_alphanumeric() || b == b'_' || b == b'$' || b >= 0x80;
        self.names.iter().any(|name| {
            let name = name.as_bytes();
            text.windows(name.len()).enumerate().any(|(at, window)| {
                window.eq_ignore_ascii_case(name)
                    && (at == 0 || !word_byte(text[at - 1]))
                    && text.get(at + name.len()).is_none_or(|&b| !word_byte(b))
            })
        })
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
    /// Its server is counted among its pool's pinned ones (`Pool::pin`).
    pub counted: bool,
    /// The client's settings from its startup packet (unreported ones), which `RESET` returns
    /// to.
    pub startup: Vars,
    /// Custom settings its SQL set (see [`custom_settings`]), which the probe asks for.
    /// Boxed (8 bytes in every session, not a Vec's 24): rarely any, and only added to.
    pub custom: Option<Box<Vec<Box<str>>>>,
    /// What the client's statements since the last probe did to settings pgmemo cannot name:
    /// Some(true) may have set some, Some(false) reset them all ([`Custom`]).
    pub unnamed_settings: Option<bool>,
    /// Its pool's [`SettingFunctions`], as last seen (None: none known).
    pub setting_functions: Option<std::sync::Arc<SettingFunctions>>,
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
        assert!(touch(b"SET \"app.tenant\" = 'b'").custom);
        assert!(!touch(b"UPDATE t SET a = 1.5").custom);
        assert!(!touch(b"select load from t").load);
    }

    #[test]
    fn custom_setting_names() {
        let read = |t: &str| custom_settings(t.as_bytes(), true);
        let names = |t: &str| -> Vec<String> {
            let custom = read(t);
            assert!(!custom.unnamed, "{t}: {custom:?}");
            custom.names.iter().map(|n| n.to_string()).collect()
        };
        assert_eq!(names("SET app.tenant = 'a'"), ["app.tenant"]);
        assert_eq!(
            names("set session My.Flag to on; SET LOCAL x.y = 1"),
            ["my.flag"]
        );
        assert_eq!(
            names("SELECT set_config('app.user', $1, false), pg_catalog.set_config ( 'work_mem', '1MB', false)"),
            ["app.user"]
        );
        assert!(names("SET work_mem = '1MB'; UPDATE t SET a.b = 1").is_empty());
        // However the name is spelt, it is the name PostgreSQL resolves.
        assert_eq!(names(r#"SET "app.tenant" = 'b'"#), ["app.tenant"]);
        assert_eq!(names(r#"SET "App"."Tenant" TO 'b'"#), ["app.tenant"]);
        assert_eq!(
            names(r"SELECT set_config(E'app\x2etenant', 'b', false)"),
            ["app.tenant"]
        );
        assert_eq!(
            names(r"SELECT set_config(U&'app\002etenant', 'b', false)"),
            ["app.tenant"]
        );
        assert_eq!(
            names("SELECT set_config($q$app.tenant$q$, 'b', false)"),
            ["app.tenant"]
        );
        assert_eq!(
            names("SELECT \"set_config\"('app.tenant', 'b', 'false')"),
            ["app.tenant"]
        );
        assert!(names("SELECT set_config('app.tenant', 'b', true)").is_empty());
        // Names pgmemo cannot read.
        assert!(read("SELECT set_config($1, $2, false)").unnamed);
        assert!(read("SELECT set_config('app.' || 'tenant', 'b', false)").unnamed);
        assert!(read("SELECT set_config('app.tenant', 'b', $1)").unnamed);
        assert!(read("DO $$ BEGIN PERFORM set_config('app.tenant', 'b', false); END $$").unnamed);
        assert!(read("RESET ALL").reset_all);
        assert!(read("DISCARD ALL").reset_all);
        // With standard_conforming_strings off, a backslash escapes the quote.
        let text = br"SELECT '\' /* '; SET app.tenant = 'b'; -- */";
        assert!(custom_settings(text, true).names.is_empty());
        let off = custom_settings(text, false);
        assert_eq!(off.names, vec!["app.tenant".into()] as Vec<Box<str>>);
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
