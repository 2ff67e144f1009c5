//! Where in the file an error is: its line, and the dotted key of the setting written there
//! (`general.pool_mode`, `databases."*".port`, `cache.rules[0].ttl`).
//!
//! The parser (`toml_edit`) keeps the byte span of every key, value and table it reads, and
//! its errors carry the span of the key or value they are about. [`Keys`] is the list of
//! every key of a file with those spans: an error's offset finds the innermost key around
//! it, and a key named by a check finds its line. Nothing here reads TOML by itself.

use std::ops::Range;
use std::path::Path;

use toml_edit::{ImDocument, Item, TableLike, Value};

use super::ConfigError;

/// A dotted key in TOML syntax, quoting the parts that are not bare keys
/// (`databases."*".port`).
pub fn key_path(parts: &[&str]) -> String {
    parts
        .iter()
        .map(|p| {
            let bare = !p.is_empty()
                && p.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
            if bare {
                p.to_string()
            } else {
                format!("{p:?}")
            }
        })
        .collect::<Vec<_>>()
        .join(".")
}

/// One line from one of the parser's errors, given its message and span; `with_key` names
/// the setting at the error's place (not for syntax errors, which are about the text, not a
/// setting).
pub(super) fn toml_error(
    text: &str,
    message: &str,
    span: Option<Range<usize>>,
    file: Option<&Path>,
    with_key: bool,
) -> ConfigError {
    let message = message
        .trim()
        .replace('\n', "; ")
        .replacen("unknown field", "unknown key", 1);
    let (line, key) = match span {
        Some(span) => {
            let (line, key) = locate(text, span.start);
            (Some(line), key.filter(|_| with_key))
        }
        None => (None, None),
    };
    ConfigError::Invalid {
        file: file.map(Path::to_path_buf),
        line,
        key,
        message,
    }
}

/// The 1-based line of byte `offset` in `text`, and the dotted key of the setting written
/// there (the innermost key whose key or value holds the offset; a table's value reaches from
/// its header to its last key).
pub(super) fn locate(text: &str, offset: usize) -> (usize, Option<String>) {
    let key = Keys::of(text).and_then(|keys| keys.at(offset).map(str::to_owned));
    (line_of(text, offset), key)
}

/// The 1-based line where dotted key `key` (as [`key_path`] writes it) is set in `text`.
pub(super) fn find_key_line(text: &str, key: &str) -> Option<usize> {
    let span = Keys::of(text)?.span_of(key)?;
    Some(line_of(text, span.start))
}

/// The 1-based line of byte `offset` (clamped to the text).
fn line_of(text: &str, offset: usize) -> usize {
    let end = offset.min(text.len());
    text.as_bytes()[..end]
        .iter()
        .filter(|&&b| b == b'\n')
        .count()
        + 1
}

/// Every key of a file, with where it is written.
struct Keys(Vec<Key>);

struct Key {
    /// Dotted, as [`key_path`] writes it; an element of an array of tables is `name[i]`.
    path: String,
    /// The key itself (for a table, its name in the header).
    key: Range<usize>,
    /// The key and its value together.
    whole: Range<usize>,
}

impl Keys {
    /// The keys of `text`, or None when it is not TOML.
    fn of(text: &str) -> Option<Keys> {
        let doc = ImDocument::parse(text).ok()?;
        let mut keys = Vec::new();
        collect(doc.as_table(), "", &mut keys);
        Some(Keys(keys))
    }

    /// The innermost key around byte `offset`.
    fn at(&self, offset: usize) -> Option<&str> {
        self.0
            .iter()
            .filter(|k| k.whole.contains(&offset))
            .min_by_key(|k| k.whole.len())
            .map(|k| k.path.as_str())
    }

    /// Where key `path` is written.
    fn span_of(&self, path: &str) -> Option<Range<usize>> {
        self.0
            .iter()
            .find(|k| k.path == path)
            .map(|k| k.key.clone())
    }
}

/// Adds the keys of `table` (whose own dotted key is `prefix`) and of the tables in it.
fn collect(table: &dyn TableLike, prefix: &str, out: &mut Vec<Key>) {
    for (name, item) in table.iter() {
        let path = match prefix {
            "" => key_path(&[name]),
            _ => format!("{prefix}.{}", key_path(&[name])),
        };
        let Some(key) = table.key(name).and_then(|k| k.span()) else {
            continue;
        };
        let whole = match item.span() {
            Some(value) => key.start.min(value.start)..key.end.max(value.end),
            None => key.clone(),
        };
        match item {
            Item::Table(t) => collect(t, &path, out),
            Item::Value(Value::InlineTable(t)) => collect(t, &path, out),
            Item::ArrayOfTables(tables) => {
                for (i, t) in tables.iter().enumerate() {
                    let element = format!("{path}[{i}]");
                    if let Some(span) = t.span() {
                        out.push(Key {
                            path: element.clone(),
                            key: span.clone(),
                            whole: span,
                        });
                    }
                    collect(t, &element, out);
                }
            }
            _ => {}
        }
        out.push(Key { path, key, whole });
    }
}

/// `text` as a TOML basic string: how the converter writes a value, and how the console's
/// `SET key = 'text'` reads one as the file would.
pub fn toml_string(text: &str) -> String {
    let mut s = String::with_capacity(text.len() + 2);
    s.push('"');
    for c in text.chars() {
        match c {
            '"' => s.push_str("\\\""),
            '\\' => s.push_str("\\\\"),
            '\n' => s.push_str("\\n"),
            '\t' => s.push_str("\\t"),
            '\r' => s.push_str("\\r"),
            c if c.is_control() => s.push_str(&format!("\\u{:04X}", c as u32)),
            c => s.push(c),
        }
    }
    s.push('"');
    s
}
