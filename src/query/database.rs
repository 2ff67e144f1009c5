//! The statements that need a database to themselves: PostgreSQL refuses `DROP DATABASE x`,
//! `ALTER DATABASE x RENAME TO y`, `ALTER DATABASE x SET TABLESPACE t` and `CREATE DATABASE y
//! TEMPLATE x` (55006, "database "x" is being accessed by other users") while another session
//! is connected to `x`, and `DROP DATABASE x` (even `WITH (FORCE)`) while a replication slot
//! of `x` is in use. pgmemo's idle servers and its WAL follower are such sessions: the session
//! reads its client's statements here, and closes them first (see [`crate::vacate`]).
//!
//! `ALTER DATABASE x IS_TEMPLATE ...`, `ALLOW_CONNECTIONS`, `CONNECTION LIMIT`, `SET`
//! (a setting) and `OWNER TO` run with other sessions connected: they are not read.
//!
//! The names are read with PostgreSQL's own parser (pg_query), so quoting, case folding,
//! `IF EXISTS`, `WITH (FORCE)`, `WITH TEMPLATE = x` and `TEMPLATE 'x'` read as the server
//! reads them; on the cold path only: a simple query is read when its words
//! ([`super::words::in_query`]) have `DROP`, `ALTER` or `CREATE` and its text the word
//! `database`, a Parse when its text starts with one of those words.

use super::words::query;
use pg_query::protobuf::{node::Node as N, DefElem, Node, ObjectType};

/// What PostgreSQL does to the database a statement needs to itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// `DROP DATABASE x`.
    Drop,
    /// `ALTER DATABASE x RENAME TO y`.
    Rename,
    /// `ALTER DATABASE x SET TABLESPACE t`.
    Tablespace,
    /// `CREATE DATABASE y TEMPLATE x` (`template1` when it names none).
    Template,
}

impl Kind {
    /// Whether PostgreSQL refuses the statement from a session connected to the database
    /// itself ("cannot drop the currently open database"), before it looks at other
    /// sessions: then there is nothing to close for it. A template may be copied from a
    /// session connected to it, by no other.
    pub fn refused_from_inside(self) -> bool {
        !matches!(self, Kind::Template)
    }
}

/// One statement that needs a database to itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Use {
    pub kind: Kind,
    /// The database, named as PostgreSQL stores it (unquoted, case folded).
    pub database: String,
    /// The database the statement makes: a RENAME's new name, CREATE's new database. Whatever
    /// pgmemo knew of an earlier database of that name is not this one's.
    pub made: Option<String>,
}

/// Whether a simple query whose words are `words` ([`super::words::in_query`]) may hold such
/// a statement: the check on the hot path, one AND.
#[inline]
pub fn may_hold(words: u32) -> bool {
    words & (query::DROP | query::ALTER | query::CREATE) != 0
}

/// Whether `text` starts, after blanks and comments, with `DROP`, `ALTER` or `CREATE`: a
/// Parse's text (one statement), or a simple query's whose words were not read. Reads a few
/// bytes only; a NUL (the end of a Parse's text) stops it.
#[inline]
pub fn leads_with_ddl(text: &[u8]) -> bool {
    const WORDS: [&[u8]; 3] = [b"drop", b"alter", b"create"];
    let at = super::command::skip_space_and_comments(text, 0);
    let rest = &text[at..];
    // Most texts start with another letter: one look at it (~60 instructions a Parse of a
    // SELECT, where the three words were compared).
    if !matches!(
        rest.first().map(u8::to_ascii_lowercase),
        Some(b'd' | b'a' | b'c')
    ) {
        return false;
    }
    WORDS.iter().any(|word| {
        rest.len() >= word.len()
            && rest[..word.len()].eq_ignore_ascii_case(word)
            && rest
                .get(word.len())
                .is_none_or(|&c| !super::command::is_ident_byte(c))
    })
}

/// Whether the body of a Parse message has a text that [`leads_with_ddl`].
#[inline]
pub fn parse_leads_with_ddl(body: &[u8]) -> bool {
    // The statement's name, then its text.
    crate::protocol::nul_at(body).is_some_and(|end| leads_with_ddl(&body[end + 1..]))
}

/// The statements of `text` (a simple query's, or a Parse's) that need a database to
/// themselves, in order; `standard_strings`: the client's standard_conforming_strings. Empty
/// for a text that does not name `database`, that is not UTF-8, or that PostgreSQL's parser
/// refuses (the server refuses it too).
pub fn uses(text: &[u8], standard_strings: bool) -> Vec<Use> {
    if !text.windows(8).any(|w| w.eq_ignore_ascii_case(b"database")) {
        return Vec::new();
    }
    let Ok(text) = std::str::from_utf8(text) else {
        return Vec::new();
    };
    let options = if standard_strings {
        pg_query::ParserOptions::default()
    } else {
        pg_query::ParserOptions::DISABLE_STANDARD_CONFORMING_STRINGS
    };
    let Ok(parsed) = pg_query::parse(text, options) else {
        return Vec::new();
    };
    parsed
        .protobuf
        .stmts
        .iter()
        .filter_map(|raw| use_of(raw.stmt.as_deref()?.node.as_ref()?))
        .collect()
}

/// What one parsed statement needs, if anything.
fn use_of(statement: &N) -> Option<Use> {
    match statement {
        N::DropdbStmt(drop) => Some(Use {
            kind: Kind::Drop,
            database: drop.dbname.clone(),
            made: None,
        }),
        N::RenameStmt(rename) if rename.rename_type == ObjectType::ObjectDatabase as i32 => {
            Some(Use {
                kind: Kind::Rename,
                database: rename.subname.clone(),
                made: Some(rename.newname.clone()),
            })
        }
        // `SET TABLESPACE t`, or `WITH TABLESPACE t` (its only option then).
        N::AlterDatabaseStmt(alter)
            if alter
                .options
                .iter()
                .filter_map(def_elem)
                .any(|o| o.defname == "tablespace") =>
        {
            Some(Use {
                kind: Kind::Tablespace,
                database: alter.dbname.clone(),
                made: None,
            })
        }
        N::CreatedbStmt(create) => {
            let template = create
                .options
                .iter()
                .filter_map(def_elem)
                .find(|o| o.defname == "template");
            // `TEMPLATE = DEFAULT`, or none: template1. A number is read as its text.
            let database = match template.and_then(|o| o.arg.as_deref()?.node.as_ref()) {
                None => "template1".to_owned(),
                Some(N::String(name)) => name.sval.clone(),
                Some(N::Integer(number)) => number.ival.to_string(),
                Some(_) => return None,
            };
            Some(Use {
                kind: Kind::Template,
                database,
                made: Some(create.dbname.clone()),
            })
        }
        _ => None,
    }
}

/// An option (`FORCE`, `TEMPLATE = x`, `TABLESPACE t`, ...).
fn def_elem(node: &Node) -> Option<&DefElem> {
    match node.node.as_ref()? {
        N::DefElem(option) => {
            let option: &DefElem = option;
            Some(option)
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one(sql: &str) -> Option<(Kind, String, Option<String>)> {
        match uses(sql.as_bytes(), true).as_slice() {
            [] => None,
            [u] => Some((u.kind, u.database.clone(), u.made.clone())),
            more => panic!("{sql}: {more:?}"),
        }
    }

    fn dropped(db: &str) -> Option<(Kind, String, Option<String>)> {
        Some((Kind::Drop, db.into(), None))
    }

    #[test]
    fn the_database_is_named_as_postgresql_reads_it() {
        assert_eq!(one("DROP DATABASE x"), dropped("x"));
        assert_eq!(one("drop database X;"), dropped("x"));
        assert_eq!(one("DROP DATABASE \"My DB\""), dropped("My DB"));
        assert_eq!(one("DROP DATABASE \"a\"\"b\""), dropped("a\"b"));
        assert_eq!(one("DROP DATABASE IF EXISTS test_app"), dropped("test_app"));
        assert_eq!(one("DROP DATABASE x WITH (FORCE)"), dropped("x"));
        assert_eq!(one("DROP DATABASE IF EXISTS \"x\" (FORCE)"), dropped("x"));
        assert_eq!(one("/* teardown */ DROP -- now\n DATABASE x"), dropped("x"));
        assert_eq!(
            one("DROP DATABASE U&\"d\\0061t\\+000061\""),
            dropped("data"),
            "a Unicode escape"
        );
        assert_eq!(
            one("ALTER DATABASE x RENAME TO y"),
            Some((Kind::Rename, "x".into(), Some("y".into())))
        );
        assert_eq!(
            one("ALTER DATABASE \"X\" RENAME TO \"New\""),
            Some((Kind::Rename, "X".into(), Some("New".into())))
        );
        assert_eq!(
            one("ALTER DATABASE x SET TABLESPACE t"),
            Some((Kind::Tablespace, "x".into(), None))
        );
        assert_eq!(
            one("ALTER DATABASE x WITH TABLESPACE t"),
            Some((Kind::Tablespace, "x".into(), None))
        );
        let template = |db: &str, made: &str| Some((Kind::Template, db.into(), Some(made.into())));
        assert_eq!(one("CREATE DATABASE z TEMPLATE x"), template("x", "z"));
        assert_eq!(
            one("CREATE DATABASE z WITH TEMPLATE = x"),
            template("x", "z")
        );
        assert_eq!(one("CREATE DATABASE z TEMPLATE \"X\""), template("X", "z"));
        assert_eq!(one("CREATE DATABASE z TEMPLATE 'x'"), template("x", "z"));
        assert_eq!(
            one("CREATE DATABASE \"Z\" OWNER app ENCODING 'UTF8' TEMPLATE template0"),
            template("template0", "Z")
        );
        assert_eq!(one("CREATE DATABASE z"), template("template1", "z"));
        assert_eq!(
            one("CREATE DATABASE z TEMPLATE = DEFAULT"),
            template("template1", "z")
        );
    }

    #[test]
    fn only_what_needs_the_database_to_itself() {
        for sql in [
            "ALTER DATABASE x IS_TEMPLATE false",
            "ALTER DATABASE x WITH IS_TEMPLATE true",
            "ALTER DATABASE x ALLOW_CONNECTIONS false",
            "ALTER DATABASE x CONNECTION LIMIT 5",
            "ALTER DATABASE x SET work_mem = '1MB'",
            "ALTER DATABASE x RESET ALL",
            "ALTER DATABASE x OWNER TO app",
            "ALTER TABLE database RENAME TO t",
            "DROP TABLE database",
            "CREATE TABLE database (a int)",
            "SELECT 'DROP DATABASE x'",
            "ALTER SCHEMA s RENAME TO database",
            "DROP DATABASE",
            "DROP DATABASE x y",
        ] {
            assert_eq!(one(sql), None, "{sql}");
        }
    }

    #[test]
    fn every_statement_of_a_query() {
        let found = uses(
            b"ALTER DATABASE a RENAME TO b; SELECT 1; ALTER DATABASE b RENAME TO a",
            true,
        );
        let names: Vec<_> = found.iter().map(|u| u.database.as_str()).collect();
        assert_eq!(names, ["a", "b"]);
    }

    #[test]
    fn backslashes_read_by_the_clients_setting() {
        // With standard_conforming_strings off, 'a\'b' is one string.
        let found = uses(b"CREATE DATABASE z TEMPLATE 'a\\'b'", false);
        assert_eq!(found[0].database, "a'b");
        let found = uses(b"CREATE DATABASE z TEMPLATE 'a\\b'", true);
        assert_eq!(found[0].database, "a\\b");
    }

    #[test]
    fn the_cheap_checks() {
        use super::super::words::in_query;
        for sql in [
            "DROP DATABASE x",
            "  alter database x rename to y",
            "/* a /* nested */ comment */ Create Database z",
            "-- why\nDROP DATABASE x",
        ] {
            assert!(leads_with_ddl(sql.as_bytes()), "{sql}");
            assert!(may_hold(in_query(sql.as_bytes())), "{sql}");
        }
        for sql in [
            "SELECT 1",
            "dropped",
            "created_at",
            "SELECT 1; DROP DATABASE x",
            "",
            "--",
        ] {
            assert!(!leads_with_ddl(sql.as_bytes()), "{sql}");
        }
        assert!(!may_hold(in_query(b"SELECT created_at FROM t")));
        // A Parse's body: its name, its text, its parameter types.
        assert!(parse_leads_with_ddl(b"s1\0DROP DATABASE x\0\0\0"));
        assert!(parse_leads_with_ddl(b"\0 create database z\0\0\0"));
        assert!(!parse_leads_with_ddl(b"drop\0SELECT 1\0\0\0"));
        assert!(!parse_leads_with_ddl(b"no end"));
    }
}
