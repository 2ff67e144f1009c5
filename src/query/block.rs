//! Reads the transaction-control statements a session may answer without a server (see
//! `session::deferred`): a `BEGIN` / `START TRANSACTION` whose options it understands, and
//! a plain `COMMIT` / `END` / `ROLLBACK` / `ABORT`. The grammar is PostgreSQL's
//! (`TransactionStmt` and `TransactionStmtLegacy` in gram.y), read strictly: one statement,
//! keywords separated by whitespace (and commas between modes), an optional `;` at the end,
//! no comments, nothing quoted. Anything else is None: the statement goes to a server, which
//! gives its own answer.

/// An isolation level named in a `BEGIN`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isolation {
    ReadUncommitted,
    ReadCommitted,
    RepeatableRead,
    Serializable,
}

/// What a transaction-control statement does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Control {
    /// `BEGIN [WORK | TRANSACTION] [modes]` or `START TRANSACTION [modes]`.
    Begin {
        /// The command tag PostgreSQL answers with: `BEGIN` or `START TRANSACTION`.
        tag: &'static str,
        modes: Modes,
    },
    /// `COMMIT` or `END` (tag `COMMIT`), without `AND CHAIN`.
    Commit,
    /// `ROLLBACK` or `ABORT` (tag `ROLLBACK`), without `AND CHAIN`.
    Rollback,
}

impl Control {
    /// The command tag PostgreSQL answers the statement with in an open block.
    pub fn tag(self) -> &'static str {
        match self {
            Control::Begin { tag, .. } => tag,
            Control::Commit => "COMMIT",
            Control::Rollback => "ROLLBACK",
        }
    }
}

/// The transaction-control statement `sql` is, when it is one of [`Control`]'s, written so
/// that it can be read without PostgreSQL's parser.
pub fn read(sql: &[u8]) -> Option<Control> {
    let trimmed = sql.trim_ascii();
    if let Some(control) = one_word(trimmed.strip_suffix(b";").unwrap_or(trimmed)) {
        return Some(control);
    }
    let tokens = words(sql)?;
    let (&first, rest) = tokens.split_first()?;
    let is = |w: &str, kw: &str| w.eq_ignore_ascii_case(kw);
    match first {
        w if is(w, "begin") => {
            let modes = match rest.first() {
                Some(w) if is(w, "work") || is(w, "transaction") => &rest[1..],
                _ => rest,
            };
            begin("BEGIN", modes)
        }
        w if is(w, "start") => match rest.first() {
            Some(w) if is(w, "transaction") => begin("START TRANSACTION", &rest[1..]),
            _ => None,
        },
        w if is(w, "commit") || is(w, "end") => plain_end(rest).then_some(Control::Commit),
        w if is(w, "rollback") || is(w, "abort") => plain_end(rest).then_some(Control::Rollback),
        _ => None,
    }
}

/// `BEGIN`, `COMMIT`, `END`, `ROLLBACK` or `ABORT` alone, the usual forms, read as [`read`]
/// reads them without splitting the text into words (a vector of them: ~400 instructions a
/// statement, callgrind).
fn one_word(word: &[u8]) -> Option<Control> {
    let is = |kw: &str| word.eq_ignore_ascii_case(kw.as_bytes());
    if is("begin") {
        begin("BEGIN", &[])
    } else if is("commit") || is("end") {
        Some(Control::Commit)
    } else if is("rollback") || is("abort") {
        Some(Control::Rollback)
    } else {
        None
    }
}

/// The words of `text`, each comma a token of its own.
fn tokens(text: &str) -> Vec<&str> {
    let mut out = Vec::new();
    for mut part in text.split_ascii_whitespace() {
        while let Some(i) = part.find(',') {
            if i > 0 {
                out.push(&part[..i]);
            }
            out.push(",");
            part = &part[i + 1..];
        }
        if !part.is_empty() {
            out.push(part);
        }
    }
    out
}

/// `[WORK | TRANSACTION]` and nothing else (no `AND [NO] CHAIN`, no `TO SAVEPOINT`,
/// no `PREPARED`).
fn plain_end(rest: &[&str]) -> bool {
    match rest {
        [] => true,
        [w] => w.eq_ignore_ascii_case("work") || w.eq_ignore_ascii_case("transaction"),
        _ => false,
    }
}

/// The transaction modes a `BEGIN` or `SET TRANSACTION` names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Modes {
    pub isolation: Option<Isolation>,
    /// `READ WRITE` was named.
    pub read_write: bool,
    /// `READ ONLY` was named.
    pub read_only: bool,
}

impl Modes {
    /// A block's modes once its first statement, a `SET TRANSACTION` naming `set`, ran: each
    /// mode as the SET names it, else as before.
    pub fn then(self, set: Modes) -> Modes {
        let access_named = set.read_write || set.read_only;
        Modes {
            isolation: set.isolation.or(self.isolation),
            read_write: if access_named {
                set.read_write
            } else {
                self.read_write
            },
            read_only: if access_named {
                set.read_only
            } else {
                self.read_only
            },
        }
    }
}

/// `SET TRANSACTION modes` (the block's first statement may still set them), read as
/// [`read`] reads a `BEGIN`: one statement, its modes as a `BEGIN` names them. Not `SET
/// TRANSACTION SNAPSHOT`, `SET SESSION CHARACTERISTICS` or `SET LOCAL`.
pub fn read_set_transaction(sql: &[u8]) -> Option<Modes> {
    match &words(sql)?[..] {
        [set, transaction, named @ ..]
            if set.eq_ignore_ascii_case("set")
                && transaction.eq_ignore_ascii_case("transaction")
                && !named.is_empty() =>
        {
            modes(named)
        }
        _ => None,
    }
}

/// The words of a statement [`read`] and [`read_set_transaction`] may read: one statement of
/// letters, whitespace and commas, an optional `;` at the end. None for anything else
/// (comments, quotes, a second statement, parameters).
fn words(sql: &[u8]) -> Option<Vec<&str>> {
    let text = std::str::from_utf8(sql).ok()?.trim_ascii();
    let text = text.strip_suffix(';').unwrap_or(text);
    if text
        .bytes()
        .any(|b| !(b.is_ascii_alphabetic() || b.is_ascii_whitespace() || b == b','))
    {
        return None;
    }
    Some(tokens(text))
}

/// A `BEGIN` with the transaction modes `named`.
fn begin(tag: &'static str, named: &[&str]) -> Option<Control> {
    Some(Control::Begin {
        tag,
        modes: modes(named)?,
    })
}

/// Transaction modes, each kind at most once; commas only between modes.
fn modes(modes: &[&str]) -> Option<Modes> {
    let is = |w: &str, kw: &str| w.eq_ignore_ascii_case(kw);
    let (mut isolation, mut access, mut deferrable) = (None, None, None);
    let mut i = 0;
    while i < modes.len() {
        let w = |k: usize| modes.get(i + k).copied().unwrap_or("");
        let taken = if is(w(0), "isolation") && is(w(1), "level") {
            let (level, n) = match (w(2), w(3)) {
                (a, b) if is(a, "read") && is(b, "uncommitted") => (Isolation::ReadUncommitted, 4),
                (a, b) if is(a, "read") && is(b, "committed") => (Isolation::ReadCommitted, 4),
                (a, b) if is(a, "repeatable") && is(b, "read") => (Isolation::RepeatableRead, 4),
                (a, _) if is(a, "serializable") => (Isolation::Serializable, 3),
                _ => return None,
            };
            isolation.replace(level).is_none().then_some(n)
        } else if is(w(0), "read") && (is(w(1), "only") || is(w(1), "write")) {
            access.replace(is(w(1), "write")).is_none().then_some(2)
        } else if is(w(0), "deferrable") {
            deferrable.replace(true).is_none().then_some(1)
        } else if is(w(0), "not") && is(w(1), "deferrable") {
            deferrable.replace(false).is_none().then_some(2)
        } else {
            None
        };
        i += taken?;
        if modes.get(i) == Some(&",") {
            // A comma only between two modes (not first, last or doubled: the next word is
            // read as a mode).
            i += 1;
            if i == modes.len() {
                return None;
            }
        }
    }
    Some(Modes {
        isolation,
        read_write: access == Some(true),
        read_only: access == Some(false),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn begin(tag: &'static str, isolation: Option<Isolation>, read_write: bool) -> Option<Control> {
        Some(Control::Begin {
            tag,
            modes: Modes {
                isolation,
                read_write,
                read_only: false,
            },
        })
    }

    fn read_only(tag: &'static str, isolation: Option<Isolation>) -> Option<Control> {
        Some(Control::Begin {
            tag,
            modes: Modes {
                isolation,
                read_write: false,
                read_only: true,
            },
        })
    }

    #[test]
    fn reads_begin_and_its_modes() {
        assert_eq!(read(b"BEGIN"), begin("BEGIN", None, false));
        assert_eq!(read(b"  begin work ;  "), begin("BEGIN", None, false));
        assert_eq!(read(b"Begin Transaction"), begin("BEGIN", None, false));
        assert_eq!(
            read(b"START TRANSACTION ISOLATION LEVEL READ COMMITTED, READ ONLY"),
            read_only("START TRANSACTION", Some(Isolation::ReadCommitted))
        );
        assert_eq!(read(b"begin read only"), read_only("BEGIN", None));
        assert_eq!(
            read(b"BEGIN TRANSACTION READ ONLY, ISOLATION LEVEL REPEATABLE READ;"),
            read_only("BEGIN", Some(Isolation::RepeatableRead))
        );
        assert_eq!(
            read(b"begin isolation level serializable read write not deferrable"),
            begin("BEGIN", Some(Isolation::Serializable), true)
        );
        assert_eq!(
            read(b"BEGIN ISOLATION LEVEL REPEATABLE READ"),
            begin("BEGIN", Some(Isolation::RepeatableRead), false)
        );
    }

    #[test]
    fn leaves_what_it_cannot_read_to_the_server() {
        for sql in [
            "START",
            "BEGIN; SELECT 1",
            "BEGIN /* x */",
            "BEGIN -- x",
            "BEGIN, READ ONLY",
            "BEGIN READ ONLY,",
            "BEGIN READ ONLY,, DEFERRABLE",
            "BEGIN READ ONLY READ WRITE",
            "BEGIN ISOLATION LEVEL READ",
            "BEGIN ISOLATION LEVEL SERIALIZABLE ISOLATION LEVEL READ COMMITTED",
            "BEGIN WORK WORK",
            "BEGIN TRANSACTION WORK",
            "BEGINX",
            "COMMIT AND CHAIN",
            "COMMIT AND NO CHAIN",
            "COMMIT PREPARED 'x'",
            "ROLLBACK TO SAVEPOINT a",
            "ROLLBACK PREPARED 'x'",
            "END WORK TRANSACTION",
            "SELECT 1",
            "",
            ";",
        ] {
            assert_eq!(read(sql.as_bytes()), None, "{sql}");
        }
    }

    #[test]
    fn reads_set_transaction() {
        let modes = |isolation, read_write, read_only| {
            Some(Modes {
                isolation,
                read_write,
                read_only,
            })
        };
        assert_eq!(
            read_set_transaction(b"SET TRANSACTION READ ONLY"),
            modes(None, false, true)
        );
        assert_eq!(
            read_set_transaction(b" set transaction isolation level repeatable read, read only; "),
            modes(Some(Isolation::RepeatableRead), false, true)
        );
        assert_eq!(
            read_set_transaction(b"SET TRANSACTION READ WRITE"),
            modes(None, true, false)
        );
        let begun = Modes {
            isolation: Some(Isolation::RepeatableRead),
            read_write: true,
            read_only: false,
        };
        assert_eq!(
            begun.then(read_set_transaction(b"SET TRANSACTION READ ONLY").unwrap()),
            Modes {
                isolation: Some(Isolation::RepeatableRead),
                read_write: false,
                read_only: true,
            }
        );
        let serializable = b"SET TRANSACTION ISOLATION LEVEL SERIALIZABLE";
        assert_eq!(
            begun.then(read_set_transaction(serializable).unwrap()),
            Modes {
                isolation: Some(Isolation::Serializable),
                ..begun
            }
        );
        for sql in [
            "SET TRANSACTION",
            "SET TRANSACTION SNAPSHOT '00000003-0000001B-1'",
            "SET SESSION CHARACTERISTICS AS TRANSACTION READ ONLY",
            "SET LOCAL TRANSACTION READ ONLY",
            "SET TRANSACTION READ ONLY; SELECT 1",
            "SET TRANSACTION READ ONLY READ WRITE",
            "SET transaction_read_only = on",
            "BEGIN READ ONLY",
        ] {
            assert_eq!(read_set_transaction(sql.as_bytes()), None, "{sql}");
        }
    }

    #[test]
    fn reads_the_ends_of_a_block() {
        for (sql, control) in [
            ("COMMIT", Control::Commit),
            ("end transaction;", Control::Commit),
            ("Commit Work", Control::Commit),
            ("ROLLBACK", Control::Rollback),
            ("abort", Control::Rollback),
            ("rollback transaction ;", Control::Rollback),
        ] {
            assert_eq!(read(sql.as_bytes()), Some(control), "{sql}");
        }
        assert_eq!(Control::Commit.tag(), "COMMIT");
        assert_eq!(
            read(b"START TRANSACTION").unwrap().tag(),
            "START TRANSACTION"
        );
    }
}
