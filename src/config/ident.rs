//! `general.auth_ident_file`: user name maps for the HBA file's `peer` and `cert` lines
//! (`map=NAME`), in PostgreSQL's `pg_ident.conf` format as PgBouncer 1.25 reads it: lines of
//! `MAPNAME SYSTEM-USERNAME DATABASE-USERNAME`, where the system name is the client's
//! operating-system user (peer) or its certificate's Common Name (cert), and the database
//! name is a user or `all`. A line whose map a `peer` or `cert` line names lets that system
//! name log in as that user; no other does (without a map, only as the user of its own name).
//!
//! What pgmemo cannot honour is refused with its line rather than skipped, as PgBouncer
//! refuses it: regular expressions (`/...`), `+group`, and `include` directives.

use super::hba::{fields, read_file, Field};
use super::ConfigError;
use std::collections::HashMap;
use std::path::Path;

/// The maps of the ident file, by name.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct IdentMaps {
    maps: HashMap<String, Vec<Mapping>>,
}

/// One line of a map.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Mapping {
    system: String,
    /// None: `all` users.
    user: Option<String>,
}

impl IdentMaps {
    /// Reads and checks the ident file at `path`; an error names the file and the line.
    pub fn load(path: &Path) -> Result<IdentMaps, ConfigError> {
        read_file("general.auth_ident_file", path, IdentMaps::parse)
    }

    /// The maps of `text`; the first line that cannot be honoured, with what is wrong.
    pub fn parse(text: &str) -> Result<IdentMaps, (usize, String)> {
        let mut maps: HashMap<String, Vec<Mapping>> = HashMap::new();
        for (i, line) in text.lines().enumerate() {
            let fields = fields(line).map_err(|m| (i + 1, m))?;
            if fields.is_empty() {
                continue;
            }
            let (map, mapping) = mapping(&fields).map_err(|m| (i + 1, m))?;
            maps.entry(map).or_default().push(mapping);
        }
        Ok(IdentMaps { maps })
    }

    /// Whether a map of this name has lines.
    pub fn has(&self, map: &str) -> bool {
        self.maps.contains_key(map)
    }

    /// Whether `map` lets the system name `system` log in as `user`.
    pub fn allows(&self, map: &str, system: &str, user: &str) -> bool {
        self.maps.get(map).is_some_and(|lines| {
            lines
                .iter()
                .any(|m| m.system == system && m.user.as_deref().is_none_or(|u| u == user))
        })
    }
}

/// A line's map name and mapping.
fn mapping(fields: &[Field]) -> Result<(String, Mapping), String> {
    let single = |i: usize, what: &str| -> Result<(String, bool), String> {
        match fields.get(i).map(Vec::as_slice) {
            Some([(text, quoted)]) if !text.is_empty() => Ok((text.clone(), *quoted)),
            Some([]) | Some([_]) | None => Err(format!("no {what}")),
            Some(_) => Err(format!("the {what} is one name, not a list")),
        }
    };
    let (map, _) = single(0, "map name")?;
    if map == "include" || map == "include_if_exists" || map == "include_dir" {
        return Err(format!("{map}: pgmemo reads no other ident file"));
    }
    let (system, quoted) = single(1, "system user name")?;
    if system.starts_with('/') && !quoted {
        return Err(format!(
            "{system}: regular expressions are not supported (write each name)"
        ));
    }
    let (user, quoted) = single(2, "database user name")?;
    let user = match (quoted, user.as_str()) {
        (false, "all") => None,
        (false, u) if u.starts_with('+') => return Err(format!("{u}: +group is not supported")),
        (false, u) if u.starts_with('/') => {
            return Err(format!("{u}: regular expressions are not supported"))
        }
        _ => Some(user),
    };
    if fields.len() > 3 {
        return Err("more than three fields".into());
    }
    Ok((map, Mapping { system, user }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_name_who_may_log_in_as_whom() {
        let maps = IdentMaps::parse(
            "# MAPNAME SYSTEM-USERNAME PG-USERNAME\n\
             ops   alice    app      # alice runs the app\n\
             ops   \"bob smith\" all\n\
             certs web.example.com \"all\"\n",
        )
        .unwrap();
        assert!(maps.allows("ops", "alice", "app"));
        assert!(!maps.allows("ops", "alice", "other"));
        assert!(maps.allows("ops", "bob smith", "anyone"));
        assert!(!maps.allows("ops", "carol", "app"));
        // A quoted "all" is a user of that name.
        assert!(maps.allows("certs", "web.example.com", "all"));
        assert!(!maps.allows("certs", "web.example.com", "app"));
        assert!(!maps.allows("nomap", "alice", "app"));
        assert!(maps.has("ops") && !maps.has("nomap"));
    }

    #[test]
    fn what_pgmemo_cannot_honour_is_refused_with_its_line() {
        for (text, line, says) in [
            ("m /^(.*)$ \\1\n", 1, "regular expressions"),
            ("\nm alice +admins\n", 2, "+group"),
            ("include other.conf\n", 1, "reads no other"),
            ("m alice\n", 1, "no database user name"),
            ("m alice app extra\n", 1, "more than three"),
            ("m alice,bob app\n", 1, "not a list"),
        ] {
            let (at, message) = IdentMaps::parse(text).unwrap_err();
            assert_eq!(at, line, "{text:?}");
            assert!(message.contains(says), "{text:?}: {message}");
        }
    }
}
