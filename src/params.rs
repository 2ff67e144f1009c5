//! Session parameters that must follow a client from server to server.
//!
//! In transaction mode a client's next transaction may run on a server connection last used by
//! someone else. Two kinds of state must then be made to match the client's:
//! - *reported* parameters (PostgreSQL sends ParameterStatus for them: DateStyle, TimeZone,
//!   client_encoding, application_name, ...), whose current value on a server is always known;
//! - *settings* given in the client's startup packet that PostgreSQL does not report
//!   (search_path, statement_timeout, extra_float_digits, ...), whose value on a server is known
//!   only because pgmemo set it.
//!
//! Before a client's batch runs on a server, [`sync_sql`] builds the `set_config`/`RESET` statements
//! that make the server's state equal the client's; empty when they already match, which is the
//! common case once a pool has warmed up.

/// An ordered list of (name, value); names compare case-insensitively like GUC names.
///
/// Every client holds a few of these (its reported parameters and settings, what it had at
/// startup), so they are packed into one string, `name\0value\0name\0value\0...`: one
/// allocation instead of two per entry, a few hundred bytes for the usual dozen reported
/// parameters (memory per idle client). Lookups scan it; the lists are short. NUL cannot occur
/// in a name or value (the protocol ends strings with it; PostgreSQL's text cannot hold it).
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Vars {
    /// A box, not a String: no spare capacity kept, and 8 bytes less in every session.
    packed: Box<str>,
}

/// Where one entry lies in [`Vars::packed`]: the entry starts at `start`, its value spans
/// `value` (the NUL after it is at `value.end`).
struct Slot {
    start: usize,
    value: std::ops::Range<usize>,
}

impl Vars {
    pub fn new() -> Self {
        Vars::default()
    }

    /// The entries in order. The NULs are found with `memchr` (a byte search), not `str::find`
    /// of a char: a login looks up a dozen names, each a scan of every entry, and the char
    /// searcher's setup cost ~80 instructions a NUL (callgrind: 31,000 instructions of a
    /// connection's ~100,000 went to these scans).
    fn slots(&self) -> impl Iterator<Item = (&str, Slot)> {
        let packed: &str = &self.packed;
        let bytes = packed.as_bytes();
        let mut at = 0;
        std::iter::from_fn(move || {
            let rest = bytes.get(at..).filter(|r| !r.is_empty())?;
            let name_len = memchr::memchr(0, rest)?;
            let value_start = at + name_len + 1;
            let value_len = memchr::memchr(0, &bytes[value_start..])?;
            let slot = Slot {
                start: at,
                value: value_start..value_start + value_len,
            };
            // A NUL is ASCII: every slice here starts and ends at a character's boundary.
            let name = &packed[at..at + name_len];
            at = value_start + value_len + 1;
            Some((name, slot))
        })
    }

    fn edit(&mut self, change: impl FnOnce(&mut String)) {
        let mut packed = String::from(std::mem::take(&mut self.packed));
        change(&mut packed);
        self.packed = packed.into_boxed_str();
    }

    fn find(&self, name: &str) -> Option<Slot> {
        self.slots()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, slot)| slot)
    }

    pub fn get(&self, name: &str) -> Option<&str> {
        self.find(name).map(|slot| &self.packed[slot.value])
    }

    /// The values of `names`, found in one scan (where [`Vars::get`] of each scans once a
    /// name): for the few lookups every login makes.
    pub fn get_each<const N: usize>(&self, names: [&str; N]) -> [Option<&str>; N] {
        let mut found = [None; N];
        for (k, slot) in self.slots() {
            for (name, value) in names.iter().zip(found.iter_mut()) {
                if value.is_none() && name.eq_ignore_ascii_case(k) {
                    *value = Some(&self.packed[slot.value.clone()]);
                }
            }
        }
        found
    }

    /// Whether `name` is set to `value` (compared as PostgreSQL compares these words, without
    /// regard to case: `UTF8`, `on`).
    pub fn is(&self, name: &str, value: &str) -> bool {
        self.get(name)
            .is_some_and(|v| v.eq_ignore_ascii_case(value))
    }

    /// Sets `name`; returns true when the value changed.
    pub fn set(&mut self, name: &str, value: &str) -> bool {
        debug_assert!(!name.contains('\0') && !value.contains('\0'));
        match self.find(name) {
            Some(slot) if self.packed[slot.value.clone()] == *value => false,
            Some(slot) => {
                self.edit(|packed| packed.replace_range(slot.value, value));
                true
            }
            None => {
                self.edit(|packed| {
                    packed.reserve_exact(name.len() + value.len() + 2);
                    packed.push_str(name);
                    packed.push('\0');
                    packed.push_str(value);
                    packed.push('\0');
                });
                true
            }
        }
    }

    pub fn remove(&mut self, name: &str) {
        if let Some(slot) = self.find(name) {
            self.edit(|packed| packed.replace_range(slot.start..slot.value.end + 1, ""));
        }
    }

    pub fn clear(&mut self) {
        self.packed = Box::default();
    }

    pub fn iter(&self) -> impl Iterator<Item = (&str, &str)> {
        self.slots().map(|(k, slot)| (k, &self.packed[slot.value]))
    }

    pub fn is_empty(&self) -> bool {
        self.packed.is_empty()
    }

    pub fn len(&self) -> usize {
        self.slots().count()
    }
}

impl std::fmt::Debug for Vars {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_map().entries(self.iter()).finish()
    }
}

/// Reported parameters a client may change and that pgmemo carries between servers. The rest of
/// the reported set (server_version, is_superuser, ...) is fixed per server login.
pub const CARRIED: &[&str] = &[
    "application_name",
    "client_encoding",
    "DateStyle",
    // Reported since PostgreSQL 14.
    "default_transaction_read_only",
    "IntervalStyle",
    // Reported since PostgreSQL 16.
    "scram_iterations",
    "standard_conforming_strings",
    "TimeZone",
];

pub fn is_carried(name: &str) -> bool {
    CARRIED.iter().any(|c| c.eq_ignore_ascii_case(name))
}

/// A setting pgmemo carries as one of the client's unreported settings even where the server
/// reports it: `search_path`, reported by ParameterStatus since PostgreSQL 18. What the
/// client's statement texts mean depends on it, and the statement registry, the result
/// cache and the `RESET` of a startup value read it from the client's settings on every
/// server version alike; the client is still told its value (ParameterStatus) as PostgreSQL
/// 18 tells it.
pub fn is_kept_as_setting(name: &str) -> bool {
    name.eq_ignore_ascii_case("search_path")
}

/// Startup parameters that are not settings at all.
pub fn is_connection_keyword(name: &str) -> bool {
    matches!(
        name.to_ascii_lowercase().as_str(),
        "user" | "database" | "replication" | "options"
    ) || name.starts_with("_pq_.")
}

/// Whether a setting's value is a true boolean as PostgreSQL reads one (`parse_bool`: `on`,
/// `1`, and `true` or `yes` or a prefix of them, in any case).
pub fn is_on(value: &str) -> bool {
    let v = value.trim().to_ascii_lowercase();
    v == "on" || v == "1" || (!v.is_empty() && ("true".starts_with(&v) || "yes".starts_with(&v)))
}

/// Quotes a value as an escape string literal, which reads the same whatever
/// standard_conforming_strings is on the server.
pub fn quote_literal(value: &str) -> String {
    let mut out = String::with_capacity(value.len() + 3);
    out.push_str("E'");
    for c in value.chars() {
        match c {
            '\'' => out.push_str("''"),
            '\\' => out.push_str("\\\\"),
            c => out.push(c),
        }
    }
    out.push('\'');
    out
}

/// Quotes a GUC name as an identifier (names may contain dots for extension settings).
pub fn quote_name(name: &str) -> String {
    name.split('.')
        .map(|part| format!("\"{}\"", part.replace('"', "\"\"")))
        .collect::<Vec<_>>()
        .join(".")
}

/// Settings that decide whose privileges the session has, carried by pgmemo like other
/// settings but applied in their own order (see [`sync_sql`]).
const PRIVILEGE: [&str; 2] = ["session_authorization", "role"];

fn is_privilege(name: &str) -> bool {
    PRIVILEGE.iter().any(|p| p.eq_ignore_ascii_case(name))
}

/// The statements that make a server's parameters equal a client's, or None when they match.
///
/// `client_reported`/`server_reported` hold the carried reported parameters;
/// `client_settings`/`server_settings` the unreported ones pgmemo manages, `role` and
/// `session_authorization` among them. Those two are taken back first (so the leftovers of
/// another client are reset, and superuser-only settings set, with the login's privileges)
/// and set last.
pub fn sync_sql(
    client_reported: &Vars,
    server_reported: &Vars,
    client_settings: &Vars,
    server_settings: &Vars,
) -> Option<String> {
    // The common case once a pool is warm: the server was left exactly as this client wants it
    // (clients of one application log in alike). Equal lists are cheap to compare.
    if client_reported == server_reported && client_settings == server_settings {
        return None;
    }
    let mut sql = String::new();
    let privileges_differ = PRIVILEGE
        .iter()
        .any(|name| client_settings.get(name) != server_settings.get(name));
    if privileges_differ {
        // SET SESSION AUTHORIZATION DEFAULT also resets the role.
        if server_settings.get("session_authorization").is_some() {
            sql.push_str("SET SESSION AUTHORIZATION DEFAULT;");
        } else if server_settings.get("role").is_some() {
            sql.push_str("RESET ROLE;");
        }
    }
    for (name, value) in client_reported.iter() {
        if is_carried(name) && server_reported.get(name) != Some(value) {
            push_set(&mut sql, name, value);
        }
    }
    for (name, value) in client_settings.iter() {
        if !is_privilege(name) && server_settings.get(name) != Some(value) {
            push_set(&mut sql, name, value);
        }
    }
    for (name, _) in server_settings.iter() {
        if !is_privilege(name) && client_settings.get(name).is_none() {
            sql.push_str("RESET ");
            sql.push_str(&quote_name(name));
            sql.push(';');
        }
    }
    if privileges_differ {
        for name in PRIVILEGE {
            if let Some(value) = client_settings.get(name) {
                push_set(&mut sql, name, value);
            }
        }
    }
    (!sql.is_empty()).then_some(sql)
}

/// Appends the statement that sets `name` to `value` for the session.
///
/// `set_config` takes the value as a startup packet carries it. `SET name = 'value'` does not
/// for list settings: `SET search_path = 'a, b'` makes one schema named "a, b".
pub fn push_set(sql: &mut String, name: &str, value: &str) {
    push_set_config(sql, name, value, false);
}

/// Appends the statement that sets `name` to `value` for the transaction at hand only.
pub fn push_set_local(sql: &mut String, name: &str, value: &str) {
    push_set_config(sql, name, value, true);
}

fn push_set_config(sql: &mut String, name: &str, value: &str, local: bool) {
    sql.push_str("SELECT pg_catalog.set_config(");
    sql.push_str(&quote_literal(name));
    sql.push_str(", ");
    sql.push_str(&quote_literal(value));
    sql.push_str(if local { ", true);" } else { ", false);" });
}

/// Splits libpq's `options` startup parameter (`-c name=value --name=value`, backslash
/// escapes spaces) into settings.
pub fn parse_options(options: &str) -> Vec<(String, String)> {
    let mut words = Vec::new();
    let mut word = String::new();
    let mut chars = options.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => {
                if let Some(n) = chars.next() {
                    word.push(n)
                }
            }
            c if c.is_whitespace() => {
                if !word.is_empty() {
                    words.push(std::mem::take(&mut word));
                }
            }
            c => word.push(c),
        }
    }
    if !word.is_empty() {
        words.push(word);
    }
    let mut out = Vec::new();
    let mut it = words.into_iter();
    while let Some(w) = it.next() {
        let setting = if w == "-c" {
            it.next()
        } else if let Some(rest) = w.strip_prefix("--") {
            Some(rest.to_owned())
        } else {
            w.strip_prefix("-c").map(str::to_owned)
        };
        if let Some((k, v)) = setting.as_deref().and_then(|s| s.split_once('=')) {
            out.push((k.replace('-', "_"), v.to_owned()));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars(pairs: &[(&str, &str)]) -> Vars {
        let mut v = Vars::new();
        for (k, val) in pairs {
            v.set(k, val);
        }
        v
    }

    #[test]
    fn packed_vars_keep_order_case_and_empty_values() {
        let mut v = vars(&[("DateStyle", "ISO, MDY"), ("search_path", ""), ("x.y", "1")]);
        assert_eq!(v.len(), 3);
        assert_eq!(v.get("datestyle"), Some("ISO, MDY"));
        assert_eq!(v.get("search_path"), Some(""));
        assert_eq!(v.get("search"), None);
        assert!(!v.set("DATESTYLE", "ISO, MDY"));
        assert!(v.set("search_path", "a longer value than before"));
        assert!(v.set("DateStyle", "SQL"));
        v.remove("SEARCH_PATH");
        assert_eq!(
            v.iter().collect::<Vec<_>>(),
            [("DateStyle", "SQL"), ("x.y", "1")]
        );
        v.remove("x.y");
        v.remove("absent");
        assert!(v.set("search_path", "b"));
        assert_eq!(
            v.iter().collect::<Vec<_>>(),
            [("DateStyle", "SQL"), ("search_path", "b")]
        );
        v.clear();
        assert!(v.is_empty() && v.iter().count() == 0 && v.get("DateStyle").is_none());
    }

    #[test]
    fn one_scan_finds_each_name_as_get_does() {
        let v = vars(&[("DateStyle", "ISO, MDY"), ("search_path", ""), ("é.x", "ü")]);
        let names = ["datestyle", "absent", "SEARCH_PATH", "é.x", "DateStyle"];
        assert_eq!(v.get_each(names), names.map(|n| v.get(n)));
        assert_eq!(
            v.get_each(names),
            [
                Some("ISO, MDY"),
                None,
                Some(""),
                Some("ü"),
                Some("ISO, MDY")
            ]
        );
        assert_eq!(Vars::new().get_each(["a"]), [None]);
    }

    #[test]
    fn nothing_to_do_when_equal() {
        let r = vars(&[("DateStyle", "ISO, MDY"), ("TimeZone", "UTC")]);
        let s = vars(&[("search_path", "a")]);
        assert_eq!(sync_sql(&r, &r, &s, &s), None);
    }

    #[test]
    fn sets_differences_and_resets_leftovers() {
        let client = vars(&[("timezone", "UTC"), ("server_version", "15")]);
        let server = vars(&[("TimeZone", "Europe/Paris"), ("server_version", "14")]);
        let cs = vars(&[("search_path", "it's")]);
        let ss = vars(&[("statement_timeout", "5s")]);
        let sql = sync_sql(&client, &server, &cs, &ss).unwrap();
        assert_eq!(
            sql,
            "SELECT pg_catalog.set_config(E'timezone', E'UTC', false);\
             SELECT pg_catalog.set_config(E'search_path', E'it''s', false);\
             RESET \"statement_timeout\";"
        );
    }

    #[test]
    fn privileges_are_taken_back_first_and_given_last() {
        let none = Vars::new();
        let client = vars(&[("role", "tenant_b"), ("work_mem", "1MB")]);
        let server = vars(&[("session_authorization", "other"), ("role", "tenant_a")]);
        assert_eq!(
            sync_sql(&none, &none, &client, &server).unwrap(),
            "SET SESSION AUTHORIZATION DEFAULT;\
             SELECT pg_catalog.set_config(E'work_mem', E'1MB', false);\
             SELECT pg_catalog.set_config(E'role', E'tenant_b', false);"
        );
        let server = vars(&[("role", "tenant_a"), ("statement_timeout", "1s")]);
        assert_eq!(
            sync_sql(&none, &none, &none, &server).unwrap(),
            "RESET ROLE;RESET \"statement_timeout\";"
        );
    }

    #[test]
    fn quoting_is_injection_safe() {
        assert_eq!(quote_literal(r"a\'; DROP"), r"E'a\\''; DROP'");
        assert_eq!(quote_name("my.x\"y"), "\"my\".\"x\"\"y\"");
    }

    #[test]
    fn options_parsing() {
        assert_eq!(
            parse_options(r"-c search_path=a\ b --statement-timeout=5s -cwork_mem=1MB"),
            vec![
                ("search_path".into(), "a b".into()),
                ("statement_timeout".into(), "5s".into()),
                ("work_mem".into(), "1MB".into())
            ]
        );
    }

    #[test]
    fn booleans_read_as_postgresql_reads_them() {
        for yes in ["on", "ON", "1", "t", "tr", "true", "y", "yes", " Yes "] {
            assert!(is_on(yes), "{yes}");
        }
        for no in ["off", "0", "f", "false", "n", "no", "", "o", "truer", "2"] {
            assert!(!is_on(no), "{no}");
        }
    }
}
