//! What a statement does to its session and to the schema, read from its text: the facts the
//! session-state watch (`session::state`) and the schema epochs (`statements::schema`) act on.
//!
//! Each reader is generous and cheap on the hot path: it looks closer only when the word scan
//! ([`super::words`]) found one of its words, and then errs on the side of "it may": a text
//! that may change settings is probed after its transaction, a text that may be DDL bumps the
//! schema epoch. Being wrong that way costs a round trip or a re-prepare, never a wrong answer.
//!
//! - [`touch`]: settings changed, state created or removed (temporary objects, `LISTEN`,
//!   advisory locks, held cursors, `LOAD`);
//! - [`custom_settings`]: the custom settings (`app.tenant`) a text sets by name, which
//!   `pg_settings` does not list, and [`SettingFunctions`], the database's functions that set
//!   one inside;
//! - [`ddl`]: whether a text's DDL changes the shared schema or only the session's temporary
//!   objects.

use super::command::{self, Command};
use super::words::{self, query};

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
/// Of those, the words of statements that may make state a server keeps for its session
/// alone (see [`crate::pins::Pins`]; `LOAD` aside, a leading word).
const PIN_WORDS: u32 = query::LISTEN
    | query::TEMP
    | query::PG_TEMP
    | query::HOLD
    | query::PG_ADVISORY
    | query::PG_TRY_ADVISORY;

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
    /// the client keeps its server ([`crate::pins::Pins::SETTINGS`]).
    pub unnamed: bool,
    /// It ends with every setting reset (`RESET ALL`, `DISCARD ALL`), unnamed ones included.
    pub reset_all: bool,
}

/// Whether a simple query whose words (`words::in_query`) are `found` may make state that
/// lives in its server alone (a temporary object, `LISTEN`, an advisory lock, a held
/// cursor), which pins its client to that server.
#[inline]
pub fn may_pin(found: u32) -> bool {
    found & PIN_WORDS != 0
}

/// Reads `text` (a prepared statement's).
pub fn touch(text: &[u8]) -> Touch {
    touch_found(words::in_query(text), text)
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
        // (`RESET search_path` reads as a SET of it: a text naming RESET is probed and read
        // for settings anyway, below.)
        let mut leading = |statement: &str| match command::classify_statement(statement) {
            Command::Set { .. } | Command::SetSearchPath { .. } => set = true,
            Command::Load => load = true,
            // A DO block's body may SET what it likes (pg_regress's brin_multi through
            // pgmemo: a SET there stayed on the server for the next client): probed after.
            _ if command::leading_words(statement, 1)
                .first()
                .is_some_and(|w| w.eq_ignore_ascii_case("do")) =>
            {
                set = true
            }
            _ => {}
        };
        if single {
            leading(&text);
        } else {
            command::split(&text).into_iter().for_each(leading);
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
            "FuncCall" if super::analysis::last_name(&inner["funcname"]) == Some("set_config") => {
                *calls += 1;
                let args = inner["args"].as_array().map(Vec::as_slice).unwrap_or(&[]);
                let constant = |i: usize| args.get(i).and_then(constant_text);
                if let (Some(name), Some(_)) = (constant(0), constant(2)) {
                    *read += 1;
                    // set_config(..., true) lasts until the transaction ends.
                    if !args.get(2).is_some_and(is_true) {
                        add_custom(custom, &name);
                    }
                }
            }
            _ => {}
        }
        walk_settings(inner, custom, calls, read);
    }
}

/// Whether an argument is a constant that reads as boolean true (`true`, `'on'`).
pub(crate) fn is_true(arg: &serde_json::Value) -> bool {
    constant_text(arg).is_some_and(|v| matches!(v.as_str(), "t" | "true" | "on" | "yes" | "1"))
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
/// does not name, so the client is treated as having set unnamed settings ([`crate::pins::Pins::SETTINGS`]).
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
    /// generous test, as for [`super::words`]).
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

/// Words that may start DDL.
const DDL_WORDS: u32 = query::CREATE | query::ALTER | query::DROP;

/// What a text's DDL may change.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Ddl {
    /// The schema every session sees.
    pub shared: bool,
    /// Only the session's own temporary objects (the statement names `temp` or `pg_temp`).
    pub temp: bool,
}

/// Reads `text` (a prepared statement's).
pub fn ddl(text: &[u8]) -> Ddl {
    ddl_found(words::in_query(text), text)
}

/// Reads `text` (a simple query's), whose words (`words::in_query`) are `found`.
pub fn ddl_found(found: u32, text: &[u8]) -> Ddl {
    let mut ddl = Ddl::default();
    if found & DDL_WORDS == 0 {
        return ddl;
    }
    let text = String::from_utf8_lossy(text);
    for statement in command::split(&text) {
        match command::classify_statement(statement) {
            Command::Ddl { temp: true } => ddl.temp = true,
            Command::Ddl { temp: false } => ddl.shared = true,
            _ => {}
        }
    }
    ddl
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
    }

    #[test]
    fn ddl_is_read_per_statement() {
        let shared = Ddl {
            shared: true,
            temp: false,
        };
        let temp = Ddl {
            shared: false,
            temp: true,
        };
        assert_eq!(ddl(b"ALTER TABLE t ADD COLUMN c int"), shared);
        assert_eq!(
            ddl(b"/* x */ drop type mood; create type mood AS ENUM ('a')"),
            shared
        );
        assert_eq!(ddl(b"CREATE TEMP TABLE t (a int)"), temp);
        assert_eq!(ddl(b"create table pg_temp.t (a int)"), temp);
        assert_eq!(
            ddl(b"CREATE TEMPORARY TABLE t (a int); ALTER TABLE u DROP COLUMN b"),
            Ddl {
                shared: true,
                temp: true
            }
        );
        assert_eq!(ddl(b"SELECT created_at FROM t"), Ddl::default());
        assert_eq!(ddl(b"SELECT 'x' AS alter_ego, dropped"), Ddl::default());
        assert_eq!(ddl(b"SELECT 1 AS drop"), Ddl::default());
    }
}
