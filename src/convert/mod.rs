//! `pgmemo convert pgbouncer.ini [userlist.txt]`: PgBouncer's configuration as pgmemo's.
//!
//! An operator arrives with a pgbouncer.ini and its auth file (DESIGN.md §9). This reads both
//! as PgBouncer 1.25 does (`ini.rs`), looks each setting up in the table of every PgBouncer
//! key (`keys.rs`) and writes the pgmemo TOML that means the same (`toml.rs`). Nothing is
//! dropped in silence: a key pgmemo has no equivalent for becomes a `# not converted:` line
//! saying why, an unknown one a `# unknown:` line and a warning with its line. A line PgBouncer
//! itself would refuse (a syntax error, a value that is not a number, a broken auth file
//! line) is an error with its line, and nothing is written.
//!
//! Where PgBouncer's default differs from pgmemo's (pool_mode session, auth_type md5,
//! max_client_conn 100, server_tls prefer, max_prepared_statements 200), PgBouncer's is
//! written out, so that the converted file behaves as the old one did.
//!
//! The result is meant to load as it is (`pgmemo --check --config OUT`); where it cannot (no
//! user with a password, trust on a public address) a warning says so.

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};

use crate::config::{AuthType, SecretKind};

mod databases;
mod general;
mod ini;
pub mod keys;
mod toml;

use ini::{AuthUser, Line};
use toml::{Entry, Table};

/// A PgBouncer file that cannot be converted, with its place when it is about a line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConvertError {
    file: Option<PathBuf>,
    line: Option<usize>,
    message: String,
}

impl ConvertError {
    fn new(message: String) -> ConvertError {
        ConvertError {
            file: None,
            line: None,
            message,
        }
    }

    fn at(file: &Path, line: usize, message: String) -> ConvertError {
        ConvertError {
            file: Some(file.to_path_buf()),
            line: Some(line),
            message,
        }
    }

    fn of(line: &Line, message: String) -> ConvertError {
        ConvertError::at(&line.file, line.line, message)
    }

    /// The same error, said to be in a file `%include`d from `file` at `line`.
    fn included_from(mut self, file: &Path, line: usize) -> ConvertError {
        self.message = format!(
            "{} (included from {}, line {line})",
            self.message,
            file.display()
        );
        self
    }

    /// The 1-based line the error is about, when it is about one.
    pub fn line(&self) -> Option<usize> {
        self.line
    }
}

impl fmt::Display for ConvertError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (&self.file, self.line) {
            (Some(file), Some(line)) => write!(f, "{}, line {line}: ", file.display())?,
            (Some(file), None) => write!(f, "{}: ", file.display())?,
            _ => {}
        }
        f.write_str(&self.message)
    }
}

impl std::error::Error for ConvertError {}

/// What `convert` produced: the TOML, and the warnings to show the operator (each with its
/// file and line).
#[derive(Debug)]
pub struct Converted {
    pub toml: String,
    pub warnings: Vec<String>,
}

/// Converts the PgBouncer configuration `ini` (and the auth file `userlist`, or else the one
/// its `auth_file` names when it can be read) into pgmemo's TOML.
pub fn convert(ini_path: &Path, userlist: Option<&Path>) -> Result<Converted, ConvertError> {
    let ini = ini::read_ini(ini_path)?;
    let mut cx = Conversion::default();
    for section in &ini.sections {
        match section.name.as_str() {
            "pgbouncer" | "databases" | "users" => {}
            "peers" => cx.top.push(Entry::Comment(format!(
                "not converted: [peers] ({}, line {}) — pgmemo has no peers; general.workers \
                 runs several threads in one process",
                section.file.display(),
                section.line
            ))),
            other => {
                cx.warn_at(
                    &section.file,
                    section.line,
                    format!("unknown section [{other}], left out"),
                );
                cx.top.push(Entry::Comment(format!(
                    "unknown: [{other}] ({}, line {}) — not a PgBouncer section; left out",
                    section.file.display(),
                    section.line
                )));
            }
        }
    }
    let section = |name: &'static str| ini.lines.iter().filter(move |l| l.section == name);
    let settings = general::convert(section("pgbouncer"), &mut cx)?;
    let users = read_users(&settings, userlist, ini_path, &mut cx)?;
    cx.add_users(&settings, users);
    general::console_users(&settings, &mut cx);
    databases::convert(section("databases"), &settings, &mut cx)?;
    databases::user_settings(section("users"), &settings, &mut cx)?;
    cx.check_logins(&settings);
    Ok(Converted {
        toml: cx.render(ini_path, userlist),
        warnings: cx.warnings,
    })
}

/// The `[pgbouncer]` values other sections depend on.
pub(crate) struct Settings {
    pub auth_type: AuthType,
    /// `auth_file` as written, with its line.
    pub auth_file: Option<Line>,
    pub admin_users: Option<Line>,
    pub stats_users: Option<Line>,
    /// The loopback check of `trust`: whether pgmemo's listen address is one.
    pub listen_is_loopback: bool,
    pub pool_mode: &'static str,
    pub default_pool_size: u32,
    pub min_pool_size: u32,
}

/// The TOML being written and the warnings so far.
#[derive(Default)]
pub(crate) struct Conversion {
    /// Comments at the top of the file (sections that are not converted).
    top: Vec<Entry>,
    general: Table,
    databases: BTreeMap<String, Table>,
    users: BTreeMap<String, Table>,
    /// What cannot be written in any table (users, databases), commented out with why.
    left_out: Vec<Entry>,
    warnings: Vec<String>,
}

impl Conversion {
    fn warn_at(&mut self, file: &Path, line: usize, message: String) {
        self.warnings
            .push(format!("{}, line {line}: {message}", file.display()));
    }

    fn warn(&mut self, line: &Line, message: String) {
        self.warn_at(&line.file.clone(), line.line, message);
    }

    /// A key pgmemo does not know: a comment in the output and a warning.
    fn unknown(&mut self, line: &Line, what: &str) -> Entry {
        self.warn(line, format!("unknown {what} {:?}, left out", line.key));
        Entry::Comment(format!(
            "unknown: {} = {} ({}) — not a PgBouncer 1.25 {what}; left out",
            line.key,
            line.value,
            line.place()
        ))
    }

    /// The users of the auth file under `[users]`, each with its secret, unless pgmemo
    /// would refuse the secret under this auth_type (then commented out, with why).
    fn add_users(&mut self, settings: &Settings, users: Vec<AuthUser>) {
        for user in users {
            let refused = match SecretKind::of(&user.secret) {
                _ if settings.auth_type == AuthType::Trust && user.secret.is_empty() => None,
                _ if user.secret.is_empty() => Some(
                    "an empty password; pgmemo refuses it (and PgBouncer lets nobody log in \
                     with one)",
                ),
                Ok(SecretKind::Md5) if settings.auth_type == AuthType::ScramSha256 => Some(
                    "an md5 hash cannot answer auth_type scram-sha-256 (PgBouncer refuses this \
                     user's logins too); give the plain password or a SCRAM verifier",
                ),
                _ => None,
            };
            if let Some(why) = refused {
                self.left_out.push(Entry::Comment(format!(
                    "not converted: user {:?} (auth file line {}) — {why}",
                    user.name, user.line
                )));
                continue;
            }
            let table = self.users.entry(user.name).or_default();
            if !user.secret.is_empty() {
                table.set("password", toml::string(&user.secret));
            }
        }
    }

    /// The secret of a converted user, if it has one.
    fn secret_of(&self, user: &str) -> Option<String> {
        self.users.get(user)?.value_of("password").map(|v| {
            // Written by `toml::string` from the secret: read it back.
            toml::unstring(v)
        })
    }

    /// Warns when pgmemo would refuse the result because nobody could log in.
    fn check_logins(&mut self, settings: &Settings) {
        if settings.auth_type != AuthType::Trust && self.users.is_empty() {
            self.warnings.push(format!(
                "no user has a password: with auth_type {} pgmemo refuses a configuration \
                 nobody can log in with; pass the auth file (pgmemo convert pgbouncer.ini \
                 userlist.txt) or add [users.NAME] password = \"...\"",
                settings.auth_type.as_str()
            ));
        }
        if settings.auth_type == AuthType::Trust && !settings.listen_is_loopback {
            self.warnings.push(
                "auth_type trust on an address other than loopback: pgmemo refuses to let \
                 anyone in without a password from the network; use md5 or scram-sha-256"
                    .into(),
            );
        }
    }
}

/// The auth file's users: from `userlist` when given, else from the file `auth_file` names
/// (as written, or next to the ini file) when it can be read; else none, with a comment.
fn read_users(
    settings: &Settings,
    userlist: Option<&Path>,
    ini_path: &Path,
    cx: &mut Conversion,
) -> Result<Vec<AuthUser>, ConvertError> {
    let path = match (userlist, &settings.auth_file) {
        (Some(path), _) => path.to_path_buf(),
        (None, None) => return Ok(Vec::new()),
        (None, Some(line)) => {
            let named = PathBuf::from(&line.value);
            let beside = ini_path.parent().map(|dir| dir.join(&named));
            match std::iter::once(named.clone())
                .chain(beside.filter(|_| named.is_relative()))
                .find(|p| p.is_file())
            {
                Some(found) => found,
                None => {
                    cx.warn(
                        line,
                        format!(
                            "cannot read auth_file {}: no users converted; pass the file as \
                             the second argument",
                            line.value
                        ),
                    );
                    cx.general.push(Entry::Comment(format!(
                        "not converted: auth_file = {} — the file could not be read here; run \
                         pgmemo convert pgbouncer.ini USERLIST to convert its users",
                        line.value
                    )));
                    return Ok(Vec::new());
                }
            }
        }
    };
    let text = std::fs::read_to_string(&path)
        .map_err(|e| ConvertError::new(format!("cannot read {}: {e}", path.display())))?;
    let users = ini::parse_userlist(&text, &path)?;
    if let Some(line) = &settings.auth_file {
        cx.general.push(Entry::Comment(format!(
            "auth_file = {} ({}): its users are the [users] below, read from {}",
            line.value,
            line.place(),
            path.display()
        )));
    }
    for user in &users {
        if let Err(why) = SecretKind::of(&user.secret) {
            return Err(ConvertError::at(
                &path,
                user.line,
                format!("user {:?}: {why}", user.name),
            ));
        }
    }
    Ok(users)
}

#[cfg(test)]
mod tests;
