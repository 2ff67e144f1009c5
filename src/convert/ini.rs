//! PgBouncer's three text formats, read as PgBouncer 1.25 reads them: the ini file
//! (`lib/usual/cfparser.c`), the connection strings of `[databases]` and `[users]`
//! (`cstr_get_pair` in `src/loader.c`) and the auth file (`load_auth_file`, same file).
//!
//! Each reader keeps the line of what it read, so that the converter's comments, warnings
//! and errors can name it. Nothing here knows what a key means; `keys.rs` does.

use std::path::{Path, PathBuf};

use super::ConvertError;

/// How deep `%include` may nest, as PgBouncer's `MAX_INCLUDE`.
const MAX_INCLUDE: usize = 10;

/// One `key = value` line of the ini file, with its section and place.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Line {
    /// The section it is in, lower case (`pgbouncer`, `databases`, `users`, ...).
    pub section: String,
    pub key: String,
    /// The rest of the line after `=`, spaces trimmed; never unquoted (PgBouncer keeps it
    /// whole too).
    pub value: String,
    pub file: PathBuf,
    pub line: usize,
}

impl Line {
    /// `pgbouncer.ini, line 12`: where the line is, for messages.
    pub fn place(&self) -> String {
        format!("{}, line {}", self.file.display(), self.line)
    }
}

/// A section header that names no section PgBouncer knows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Section {
    pub name: String,
    pub file: PathBuf,
    pub line: usize,
}

/// What an ini file holds: its key lines in order, and every section header met.
#[derive(Debug, Default)]
pub struct Ini {
    pub lines: Vec<Line>,
    pub sections: Vec<Section>,
}

/// Reads `path` and the files it `%include`s (relative names from the current directory,
/// as PgBouncer), or the first syntax error with its file and line.
pub fn read_ini(path: &Path) -> Result<Ini, ConvertError> {
    let mut ini = Ini::default();
    let mut section = None;
    read_into(path, 0, &mut section, &mut ini)?;
    Ok(ini)
}

fn read_into(
    path: &Path,
    depth: usize,
    section: &mut Option<String>,
    ini: &mut Ini,
) -> Result<(), ConvertError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| ConvertError::new(format!("cannot read {}: {e}", path.display())))?;
    for (i, raw) in text.lines().enumerate() {
        let at = |message: String| ConvertError::at(path, i + 1, message);
        let line = raw.trim();
        if line.is_empty() || line.starts_with(';') || line.starts_with('#') {
            continue;
        }
        if let Some(included) = line
            .strip_prefix("%include")
            .filter(|rest| rest.starts_with([' ', '\t']))
        {
            if depth + 1 >= MAX_INCLUDE {
                return Err(at("include nesting level too deep".into()));
            }
            let included = Path::new(included.trim());
            read_into(included, depth + 1, section, ini)
                .map_err(|e| e.included_from(path, i + 1))?;
            continue;
        }
        if let Some(rest) = line.strip_prefix('[') {
            let name = rest
                .split_once(']')
                .map(|(name, _)| name)
                .ok_or_else(|| at("syntax error: a section header must end with ']'".into()))?;
            let name = name.trim().to_ascii_lowercase();
            ini.sections.push(Section {
                name: name.clone(),
                file: path.to_path_buf(),
                line: i + 1,
            });
            *section = Some(name);
            continue;
        }
        let (key, value) = split_key(line).map_err(at)?;
        let Some(section) = section.clone() else {
            return Err(at(format!(
                "{key} = ... comes before any [section]; PgBouncer refuses that too"
            )));
        };
        ini.lines.push(Line {
            section,
            key,
            value,
            file: path.to_path_buf(),
            line: i + 1,
        });
    }
    Ok(())
}

/// `key = value`: a key of `[A-Za-z0-9_.*-]`, or quoted in `'...'` (PgBouncer) or `"..."`
/// (SQL identifier quoting, as its docs say for database names, `""` for a quote).
fn split_key(line: &str) -> Result<(String, String), String> {
    let (key, rest) = if let Some(rest) = line.strip_prefix('\'') {
        let (key, rest) = rest
            .split_once('\'')
            .ok_or("syntax error: a quoted key must end with '")?;
        (key.to_string(), rest)
    } else if let Some(rest) = line.strip_prefix('"') {
        quoted_identifier(rest)?
    } else {
        let end = line
            .find(|c: char| !(c.is_ascii_alphanumeric() || "_.-*".contains(c)))
            .unwrap_or(line.len());
        (line[..end].to_string(), &line[end..])
    };
    let value = rest
        .trim_start_matches([' ', '\t'])
        .strip_prefix('=')
        .ok_or_else(|| format!("syntax error: expected KEY = VALUE, got {line:?}"))?;
    if key.is_empty() {
        return Err(format!("syntax error: no key before '=' in {line:?}"));
    }
    Ok((key, value.trim().to_string()))
}

/// The rest of a `"quoted"` name after its first quote: the name and what follows it.
fn quoted_identifier(rest: &str) -> Result<(String, &str), String> {
    let mut name = String::new();
    let mut chars = rest.char_indices().peekable();
    while let Some((i, c)) = chars.next() {
        if c != '"' {
            name.push(c);
        } else if chars.peek().is_some_and(|&(_, next)| next == '"') {
            chars.next();
            name.push('"');
        } else {
            return Ok((name, &rest[i + 1..]));
        }
    }
    Err("syntax error: a quoted name must end with \"".into())
}

/// A connection string of `[databases]` or settings of `[users]`: `key=value` pairs
/// separated by spaces, a value in `'...'` when it holds spaces (`''` for a quote), as
/// PgBouncer's `cstr_get_pair`. Empty values are refused, as there.
pub fn parse_pairs(text: &str) -> Result<Vec<(String, String)>, String> {
    let mut pairs = Vec::new();
    let mut rest = text.trim_start();
    while !rest.is_empty() {
        let eq = rest
            .find('=')
            .ok_or_else(|| format!("expected key=value, got {rest:?}"))?;
        let key = rest[..eq].trim_end();
        if key.is_empty() || key.contains(' ') {
            return Err(format!("expected key=value, got {rest:?}"));
        }
        let after = rest[eq + 1..].trim_start();
        let (value, next) = if let Some(quoted) = after.strip_prefix('\'') {
            unquote_value(quoted)
                .ok_or_else(|| format!("the value of {key} has no closing quote"))?
        } else {
            let end = after.find(' ').unwrap_or(after.len());
            (after[..end].to_string(), &after[end..])
        };
        if value.is_empty() {
            return Err(format!("{key} has an empty value"));
        }
        pairs.push((key.to_string(), value));
        rest = next.trim_start();
    }
    Ok(pairs)
}

/// A `'...'` value after its opening quote (`''` is a quote): the value and what follows.
fn unquote_value(text: &str) -> Option<(String, &str)> {
    let mut value = String::new();
    let mut chars = text.char_indices().peekable();
    while let Some((i, c)) = chars.next() {
        if c != '\'' {
            value.push(c);
        } else if chars.peek().is_some_and(|&(_, next)| next == '\'') {
            chars.next();
            value.push('\'');
        } else {
            return Some((value, &text[i + 1..]));
        }
    }
    None
}

/// One user of the auth file: the same reading pgmemo's `general.auth_file` uses.
pub use crate::config::AuthLine as AuthUser;

/// The auth file (`userlist.txt`), read as `general.auth_file` is
/// (`config::parse_userlist`); a broken line is an error naming the file and the line.
pub fn parse_userlist(text: &str, file: &Path) -> Result<Vec<AuthUser>, ConvertError> {
    crate::config::parse_userlist(text).map_err(|b| ConvertError::at(file, b.line, b.message))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ini(text: &str) -> Result<Ini, ConvertError> {
        static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("pgmemo-ini-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("t.ini");
        std::fs::write(&path, text).unwrap();
        let read = read_ini(&path);
        let _ = std::fs::remove_dir_all(&dir);
        read
    }

    #[test]
    fn keys_sections_and_comments_read_as_pgbouncer_reads_them() {
        let i = ini(
            "; comment\n# another\n[PgBouncer]\nlisten_port = 6433\n\
                     [databases]\n'odd name' = host=x\n\"q\"\"d\" = \n* = host=y ; not a comment\n",
        )
        .unwrap();
        let got: Vec<_> = i
            .lines
            .iter()
            .map(|l| (l.section.as_str(), l.key.as_str(), l.value.as_str(), l.line))
            .collect();
        assert_eq!(
            got,
            [
                ("pgbouncer", "listen_port", "6433", 4),
                ("databases", "odd name", "host=x", 6),
                ("databases", "q\"d", "", 7),
                ("databases", "*", "host=y ; not a comment", 8),
            ]
        );
    }

    #[test]
    fn syntax_errors_name_their_line() {
        for (text, line) in [
            ("[pgbouncer]\nlisten_port 6432\n", 2),
            ("[pgbouncer\n", 1),
            ("listen_port = 1\n", 1),
            ("[databases]\n\n'x = host=y\n", 3),
        ] {
            let e = ini(text).unwrap_err().to_string();
            assert!(e.contains(&format!("line {line}:")), "{text:?}: {e}");
        }
    }

    #[test]
    fn connection_strings_split_into_pairs() {
        assert_eq!(
            parse_pairs("host=h  port=5433 password='a b''c' dbname=d").unwrap(),
            [
                ("host".to_string(), "h".to_string()),
                ("port".into(), "5433".into()),
                ("password".into(), "a b'c".into()),
                ("dbname".into(), "d".into()),
            ]
        );
        assert!(parse_pairs("").unwrap().is_empty());
        for bad in ["host", "host=", "password='open", "=x"] {
            assert!(parse_pairs(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn the_auth_file_reads_users_and_secrets() {
        // The reading itself is config::auth_file's (tested there); here: its errors name
        // the file and the line.
        let users = parse_userlist("\"marko\" \"asdasd\"\n", Path::new("userlist.txt")).unwrap();
        assert_eq!(users[0].name, "marko");
        let e = parse_userlist("\"a\" \"b\"\nmarko asdasd\n", Path::new("u.txt"))
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("u.txt, line 2: malformed"), "{e}");
    }
}
