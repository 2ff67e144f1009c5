//! The TOML `convert` writes: tables of keys in the order they were converted, each key with
//! the note that explains it, and the comment lines for what was not converted. Written by
//! hand rather than through a serializer so that the comments stand where they belong; the
//! tests load every result with pgmemo's own parser.

use std::path::Path;

use super::Conversion;

/// One line (or a comment and a line) of a table.
#[derive(Debug, Clone, PartialEq)]
pub enum Entry {
    /// `key = value`, the value already in TOML syntax, after a `# note` when there is one.
    Set {
        key: String,
        value: String,
        note: Option<String>,
    },
    /// A `# ...` line.
    Comment(String),
}

/// A table's entries, in order.
#[derive(Debug, Default)]
pub struct Table(Vec<Entry>);

impl Table {
    /// Sets `key` (again: the last value wins, as PgBouncer's last line does).
    pub fn set(&mut self, key: &str, value: String) {
        self.set_noted(key, value, None);
    }

    pub fn set_noted(&mut self, key: &str, value: String, note: Option<String>) {
        self.0
            .retain(|e| !matches!(e, Entry::Set { key: k, .. } if k == key));
        self.0.push(Entry::Set {
            key: key.to_string(),
            value,
            note,
        });
    }

    pub fn push(&mut self, entry: Entry) {
        self.0.push(entry);
    }

    /// The value written for `key`, in TOML syntax.
    pub fn value_of(&self, key: &str) -> Option<&str> {
        self.0.iter().find_map(|e| match e {
            Entry::Set { key: k, value, .. } if k == key => Some(value.as_str()),
            _ => None,
        })
    }

    /// Takes `key` out, returning its value.
    pub fn remove(&mut self, key: &str) -> Option<String> {
        let at = self
            .0
            .iter()
            .position(|e| matches!(e, Entry::Set { key: k, .. } if k == key))?;
        match self.0.remove(at) {
            Entry::Set { value, .. } => Some(value),
            Entry::Comment(_) => None,
        }
    }

    /// Adds `other`'s entries; its keys replace this table's.
    pub fn extend(&mut self, other: Table) {
        for entry in other.0 {
            match entry {
                Entry::Set { key, value, note } => self.set_noted(&key, value, note),
                comment => self.push(comment),
            }
        }
    }

    fn write(&self, out: &mut String) {
        for entry in &self.0 {
            match entry {
                Entry::Set { key, value, note } => {
                    if let Some(note) = note {
                        comment(out, note);
                    }
                    out.push_str(&format!("{} = {value}\n", bare_or_quoted(key)));
                }
                Entry::Comment(text) => comment(out, text),
            }
        }
    }
}

/// A comment of one or more lines (a line break in `text` starts a new `#` line).
fn comment(out: &mut String, text: &str) {
    for line in text.lines() {
        out.push_str("# ");
        out.push_str(line);
        out.push('\n');
    }
}

/// `text` as a TOML basic string (the configuration's own writer, which the console's SET
/// uses too).
pub use crate::config::toml_string as string;

/// The text of a string written by [`string`].
pub fn unstring(value: &str) -> String {
    let inner = value
        .strip_prefix('"')
        .and_then(|v| v.strip_suffix('"'))
        .unwrap_or(value);
    let mut out = String::new();
    let mut chars = inner.chars();
    while let Some(c) = chars.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('n') => out.push('\n'),
            Some('t') => out.push('\t'),
            Some('r') => out.push('\r'),
            Some('u') => {
                let hex: String = chars.by_ref().take(4).collect();
                if let Some(c) = u32::from_str_radix(&hex, 16).ok().and_then(char::from_u32) {
                    out.push(c);
                }
            }
            Some(c) => out.push(c),
            None => {}
        }
    }
    out
}

/// A key as TOML writes it: bare when it may be, else quoted.
pub fn bare_or_quoted(key: &str) -> String {
    let bare = !key.is_empty()
        && key
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    if bare {
        key.to_string()
    } else {
        string(key)
    }
}

/// Seconds as TOML writes them: whole numbers without a fraction.
pub fn seconds(secs: f64) -> String {
    if secs.fract() == 0.0 && secs.abs() < 1e15 {
        format!("{}", secs as i64)
    } else {
        format!("{secs}")
    }
}

impl Conversion {
    /// The whole file: a header, then `[general]`, `[databases.*]` and `[users.*]`.
    pub(super) fn render(&self, ini: &Path, userlist: Option<&Path>) -> String {
        let mut out = String::new();
        let from = match userlist {
            Some(u) => format!("{} and {}", ini.display(), u.display()),
            None => ini.display().to_string(),
        };
        comment(
            &mut out,
            &format!(
                "pgmemo configuration converted from PgBouncer's {from}\n\
                 by pgmemo convert {}. What pgmemo has no equivalent for is kept below as a\n\
                 \"not converted:\" comment saying why; see docs/migrating-from-pgbouncer.md.\n\
                 The admin console is the database \"pgmemo\" (PgBouncer's is \"pgbouncer\").\n\
                 pgmemo's own features (autoprepare, session state carried in transaction\n\
                 mode) are at their defaults; pgmemo.example.toml describes every setting.",
                env!("CARGO_PKG_VERSION")
            ),
        );
        if !self.users.is_empty() {
            comment(
                &mut out,
                "This file holds the users' passwords: keep it readable by pgmemo only.",
            );
        }
        for entry in &self.top {
            if let Entry::Comment(text) = entry {
                comment(&mut out, text);
            }
        }
        out.push_str("\n[general]\n");
        self.general.write(&mut out);
        for (name, table) in &self.databases {
            out.push_str(&format!("\n[databases.{}]\n", bare_or_quoted(name)));
            table.write(&mut out);
        }
        for (name, table) in &self.users {
            out.push_str(&format!("\n[users.{}]\n", bare_or_quoted(name)));
            table.write(&mut out);
        }
        if !self.left_out.is_empty() {
            out.push('\n');
            Table(self.left_out.clone()).write(&mut out);
        }
        out
    }
}
