//! `general.auth_file`: PgBouncer's `userlist.txt`, users and their secrets read from a file of
//! their own, as PgBouncer 1.25 reads it (`load_auth_file` in `src/loader.c`): one
//! `"user" "secret"` pair per line, `""` for a quote inside a field, anything after the
//! second field ignored, blank lines and lines starting with `;` skipped.
//!
//! Where PgBouncer logs "broken auth file" and keeps the users it read so far, pgmemo refuses
//! the file with its name and line, and the secret of each line is checked as a `[users]`
//! password is (a malformed SCRAM verifier or md5 hash is an error, not a plain password).
//! The file is read with the configuration, so RELOAD and SIGHUP read it again.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};

use super::{ConfigError, SecretKind};

/// One user of the auth file, as written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AuthLine {
    pub name: String,
    /// A plain password, `md5...` or `SCRAM-SHA-256$...`, as written.
    pub secret: String,
    /// 1-based line in the file.
    pub line: usize,
}

/// A line that is not `"user" "secret"`: its 1-based number and what is wrong.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BrokenLine {
    pub line: usize,
    pub message: String,
}

/// The users of the auth file, by name: what `Config` keeps of it. A name on several lines
/// has the secret of the last one, as in PgBouncer.
#[derive(Clone, PartialEq, Eq, Default)]
pub struct AuthFile {
    /// The file, as the configuration names it (made absolute against the config file).
    pub path: Option<PathBuf>,
    users: BTreeMap<String, AuthLine>,
}

// Secrets never reach a log line: only the file and the names are shown.
impl fmt::Debug for AuthFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AuthFile")
            .field("path", &self.path)
            .field("users", &self.users.keys().collect::<Vec<_>>())
            .finish()
    }
}

impl AuthFile {
    /// Reads and checks the auth file at `path`; an error names the file, and the line when
    /// one is broken.
    pub fn load(path: &Path) -> Result<AuthFile, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|e| {
            ConfigError::invalid(
                "general.auth_file",
                format!("cannot read {}: {e}", path.display()),
            )
        })?;
        let at = |line: usize, message: String| ConfigError::Invalid {
            file: Some(path.to_path_buf()),
            line: Some(line),
            key: None,
            message,
        };
        let lines = parse_userlist(&text).map_err(|b| at(b.line, b.message))?;
        let mut users = BTreeMap::new();
        for line in lines {
            SecretKind::of(&line.secret).map_err(|m| {
                at(
                    line.line,
                    format!("the secret of user {:?}: {m}", line.name),
                )
            })?;
            users.insert(line.name.clone(), line);
        }
        Ok(AuthFile {
            path: Some(path.to_path_buf()),
            users,
        })
    }

    /// Whether an auth file is configured (even an empty one: then it lists nobody).
    pub fn is_set(&self) -> bool {
        self.path.is_some()
    }

    /// The secret of `user`, if the file lists it.
    pub fn secret(&self, user: &str) -> Option<&str> {
        self.users.get(user).map(|l| l.secret.as_str())
    }

    /// Every user of the file, by name.
    pub fn users(&self) -> impl Iterator<Item = &AuthLine> {
        self.users.values()
    }
}

/// The auth file's lines, or the first broken one (PgBouncer stops there too).
pub fn parse_userlist(text: &str) -> Result<Vec<AuthLine>, BrokenLine> {
    let mut users = Vec::new();
    for (i, raw) in text.lines().enumerate() {
        let line = raw.trim();
        if line.is_empty() || line.starts_with(';') {
            continue;
        }
        let broken = |why: &str| BrokenLine {
            line: i + 1,
            message: format!("malformed auth file line: {why}; expected \"user\" \"secret\""),
        };
        let rest = line
            .strip_prefix('"')
            .ok_or_else(|| broken("it does not start with '\"'"))?;
        let (name, rest) = quoted(rest).ok_or_else(|| broken("the user's quote is not closed"))?;
        let rest = rest
            .trim_start()
            .strip_prefix('"')
            .ok_or_else(|| broken("no quoted secret after the user"))?;
        let (secret, _) = quoted(rest).ok_or_else(|| broken("the secret's quote is not closed"))?;
        if name.is_empty() {
            return Err(broken("the user name is empty"));
        }
        users.push(AuthLine {
            name,
            secret,
            line: i + 1,
        });
    }
    Ok(users)
}

/// The text up to the closing quote (`""` is a quote inside), and what follows it.
fn quoted(text: &str) -> Option<(String, &str)> {
    let mut value = String::new();
    let mut chars = text.char_indices();
    while let Some((i, c)) = chars.next() {
        if c != '"' {
            value.push(c);
        } else if text[i + 1..].starts_with('"') {
            value.push('"');
            chars.next();
        } else {
            return Some((value, &text[i + 1..]));
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_read_as_pgbouncer_reads_them() {
        let text =
            "\"marko\" \"asdasd\"\n; \"commented\" \"x\"\n\n\"q\"\"uote\" \"md5abc\" extra\n";
        let users = parse_userlist(text).unwrap();
        let got: Vec<_> = users
            .iter()
            .map(|u| (u.name.as_str(), u.secret.as_str(), u.line))
            .collect();
        assert_eq!(got, [("marko", "asdasd", 1), ("q\"uote", "md5abc", 4)]);
        for (bad, line) in [
            ("\"a\" \"b\"\nmarko asdasd\n", 2),
            ("\"a\" \"b\"\n\"a\" \"b\n", 2),
            ("\"a\"\n", 1),
            ("\"\" \"b\"\n", 1),
        ] {
            let e = parse_userlist(bad).unwrap_err();
            assert_eq!(e.line, line, "{bad:?}");
            assert!(e.message.starts_with("malformed auth file line"), "{e:?}");
        }
    }

    #[test]
    fn a_malformed_secret_is_an_error_with_file_and_line() {
        let dir = std::env::temp_dir().join(format!("pgmemo-authfile-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("userlist.txt");
        std::fs::write(
            &path,
            "\"alice\" \"pw\"\n\"bob\" \"SCRAM-SHA-256$4096:c2FsdA==$bad\"\n",
        )
        .unwrap();
        let e = AuthFile::load(&path).unwrap_err().to_string();
        assert!(
            e.starts_with(&format!(
                "{}, line 2: the secret of user \"bob\"",
                path.display()
            )),
            "{e}"
        );
        assert!(e.contains("malformed SCRAM verifier"), "{e}");

        std::fs::write(&path, "\"alice\" \"old\"\n\"alice\" \"new\"\n").unwrap();
        let file = AuthFile::load(&path).unwrap();
        assert_eq!(file.secret("alice"), Some("new"));
        assert!(!format!("{file:?}").contains("new"));

        let missing = dir.join("nonexistent.txt");
        let e = AuthFile::load(&missing).unwrap_err().to_string();
        assert!(e.starts_with("general.auth_file: cannot read"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
