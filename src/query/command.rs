//! The SQL command classifier: what each top-level statement of a query is, read from its
//! leading keywords, as one [`Command`] (the breadth of PgDog's `router::parser::Command`).
//! Every feature that asks "what kind of statement is this" asks here: the statement planner
//! (the commands that change the prepared-statement namespace the protocol's Parse/Close
//! use: `PREPARE`, `EXECUTE`, `DEALLOCATE`, `DISCARD ALL`, `SET search_path`), the session
//! state watch (`SET`, `LOAD`), the schema watch (DDL), and the statements' transaction
//! starts and ends. The strict reading of the transaction control a session answers itself
//! is [`super::block`].
//!
//! This is deliberately not a SQL parser: it splits the text into top-level statements
//! (respecting quotes, dollar quotes and comments) and reads the leading keywords. Anything it
//! does not understand is [`Command::Other`], which pgmemo passes through untouched.

/// What one top-level statement of a simple query (or the text of a Parse) is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Command {
    /// `BEGIN`, `START TRANSACTION`.
    Begin,
    /// `COMMIT`, `END` (also `AND CHAIN`).
    Commit,
    /// `ROLLBACK`, `ABORT` (also `AND CHAIN`).
    Rollback,
    /// `SAVEPOINT name`.
    Savepoint,
    /// `RELEASE [SAVEPOINT] name`.
    Release,
    /// `ROLLBACK [WORK | TRANSACTION] TO [SAVEPOINT] name`.
    RollbackTo,
    /// `PREPARE TRANSACTION 'id'`.
    PrepareTransaction,
    /// `COMMIT PREPARED 'id'`, `ROLLBACK PREPARED 'id'`.
    EndPrepared,
    /// `PREPARE name [(types)] AS ...`; `text` is the whole statement.
    Prepare { name: String, text: String },
    /// `EXECUTE name [(args)]`, also under `EXPLAIN [options]`.
    Execute { name: String },
    /// `DEALLOCATE [PREPARE] name`.
    Deallocate { name: String },
    /// `DEALLOCATE [PREPARE] ALL`.
    DeallocateAll,
    /// `DISCARD ALL` (also drops every prepared statement).
    DiscardAll,
    /// `DISCARD PLANS | SEQUENCES | TEMP | TEMPORARY`.
    Discard,
    /// `SET [SESSION | LOCAL] search_path {TO | =} ...`, `SET search_path TO DEFAULT`,
    /// `RESET search_path`: the value as a `search_path` setting string (what `SHOW` would
    /// give, `""` for the server's default); what pgmemo cannot read is `\0` and its text.
    SetSearchPath { value: Option<String>, local: bool },
    /// Every other `SET ...` (of a setting, `SET TRANSACTION`, `SET ROLE`, `SET SESSION
    /// AUTHORIZATION`, `SET CONSTRAINTS`); `local`: `SET LOCAL`.
    Set { local: bool },
    /// `RESET ALL`.
    ResetAll,
    /// `RESET name` (of another setting than search_path).
    Reset,
    /// `LOAD 'library'`.
    Load,
    /// `LISTEN channel`.
    Listen,
    /// `UNLISTEN channel | *`.
    Unlisten,
    /// `NOTIFY channel [, payload]`.
    Notify,
    /// `DECLARE name ... CURSOR ...`.
    Declare,
    /// `FETCH`, `MOVE` in a cursor.
    Fetch,
    /// `CLOSE name | ALL`.
    Close,
    /// `COPY ...`.
    Copy,
    /// `CREATE`, `ALTER` or `DROP` of anything; `temp`: it changes only the session's own
    /// temporary objects, as its text proves (see [`only_temporary`]).
    Ddl { temp: bool },
    /// `INSERT`, `UPDATE`, `DELETE`, `MERGE`, `TRUNCATE`.
    Dml,
    /// `SELECT`, `VALUES`, `TABLE`, `WITH` (whose queries may still write).
    Select,
    /// `SHOW name | ALL`.
    Show,
    /// `EXPLAIN` of anything but an `EXECUTE`.
    Explain,
    /// Anything else (`GRANT`, `VACUUM`, `CALL`, `DO`, a statement in parentheses, ...).
    Other,
}

impl Command {
    /// Whether PostgreSQL still runs the statement in an aborted transaction block
    /// (`IsTransactionExitStmt`): COMMIT / END, ROLLBACK / ABORT (also `ROLLBACK TO`), PREPARE
    /// TRANSACTION — but not COMMIT PREPARED or ROLLBACK PREPARED.
    pub fn is_transaction_exit(&self) -> bool {
        matches!(
            self,
            Command::Commit | Command::Rollback | Command::RollbackTo | Command::PrepareTransaction
        )
    }

    /// Whether the statement opens a transaction block: BEGIN, START TRANSACTION.
    pub fn is_transaction_start(&self) -> bool {
        matches!(self, Command::Begin)
    }
}

/// Splits `sql` into top-level statements and classifies each. Empty statements are dropped.
/// A `PREPARE`'s text is kept where the query put it (see [`in_place`]).
pub fn classify(sql: &str) -> Vec<Command> {
    split(sql)
        .into_iter()
        .filter(|s| !s.trim().is_empty())
        .map(|stmt| match classify_statement(stmt) {
            Command::Prepare { name, text } => Command::Prepare {
                name,
                text: in_place(sql, stmt, text),
            },
            command => command,
        })
        .collect()
}

/// The text of the `PREPARE` statement `stmt` (a part of the query `sql`, `text` its trimmed
/// text) preceded by one space for every character before it in `sql`. PostgreSQL keeps the
/// whole query that held a PREPARE as the statement's source text, and the error of an
/// `EXECUTE` that analyses the statement again (a table it reads was dropped) points into
/// it (`P`, in characters): pgmemo prepares the statement again on other servers with this
/// text, where the same error points at the same place.
fn in_place(sql: &str, stmt: &str, text: String) -> String {
    let start = stmt.as_ptr() as usize - sql.as_ptr() as usize;
    let at = start + (stmt.len() - stmt.trim_start().len());
    let before = sql[..at].chars().count();
    if before == 0 {
        return text;
    }
    let mut placed = String::with_capacity(before + text.len());
    placed.extend(std::iter::repeat_n(' ', before));
    placed.push_str(&text);
    placed
}

/// What the text of a Parse is, when it is one of the commands that change the prepared
/// statements when executed: `DISCARD ALL`, `DEALLOCATE [PREPARE] ALL`, `DEALLOCATE [PREPARE]
/// name`, alone (a Parse holds one statement); or that needs one of them: `[EXPLAIN] EXECUTE
/// name`. Cheap for every other text: only its first word is read.
pub fn tracked_command(text: &str) -> Option<Command> {
    let first = leading_words(text, 1);
    let word = first.first()?;
    if ![
        "discard",
        "deallocate",
        "set",
        "reset",
        "prepare",
        "execute",
        "explain",
    ]
    .iter()
    .any(|kw| is_keyword(word, kw))
    {
        return None;
    }
    match classify(text).as_slice() {
        [c @ (Command::DiscardAll
        | Command::DeallocateAll
        | Command::Deallocate { .. }
        | Command::Prepare { .. }
        | Command::Execute { .. }
        | Command::SetSearchPath { .. })] => Some(c.clone()),
        _ => None,
    }
}

/// The prefix of pgmemo's own statement names on servers (`pgmemo_s<n>`, the guard
/// `pgmemo_s0`), and on its own the name pgmemo sends where a server must find no statement.
/// Names of this form are reserved: a client's SQL that names one never reaches a server
/// with it (see [`hide_reserved`]).
pub const NOWHERE: &str = "pgmemo_s";
/// PostgreSQL's message for a statement that names [`NOWHERE`].
pub const NOWHERE_MISSING: &str = "prepared statement \"pgmemo_s\" does not exist";

/// Whether a statement name (as PostgreSQL stores it) is reserved: `pgmemo_s` followed by
/// digits or nothing.
pub fn is_reserved_name(name: &[u8]) -> bool {
    let name = crate::protocol::pg_name(name);
    name.len() >= NOWHERE.len()
        && name[..NOWHERE.len()] == *NOWHERE.as_bytes()
        && name[NOWHERE.len()..].iter().all(u8::is_ascii_digit)
}

/// A statement of a query that names a reserved statement name, as pgmemo sends it instead.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReservedUse {
    /// `EXECUTE` / `DEALLOCATE` of it: sent naming [`NOWHERE`], which no server has, so that
    /// PostgreSQL fails it with its own 26000 (about `NOWHERE`, to be shown about this name).
    Missing(String),
    /// `PREPARE` of it: refused. The statement is sent as `EXECUTE pgmemo_s`, which fails the
    /// same way, at the same place; the error shown is pgmemo's.
    Refused(String),
}

impl ReservedUse {
    pub fn name(&self) -> &str {
        match self {
            ReservedUse::Missing(name) | ReservedUse::Refused(name) => name,
        }
    }
}

/// A query's text with every reserved name hidden (see [`ReservedUse`]): each replaced by
/// text of the same length in characters, so that the positions PostgreSQL reports in
/// errors stay right.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hidden {
    pub text: Vec<u8>,
    /// The index (as in [`classify`]) and use of each changed statement, in order.
    pub uses: Vec<(usize, ReservedUse)>,
}

/// Hides the reserved statement names a query's `PREPARE`, `EXECUTE` and `DEALLOCATE`
/// statements name, if any. Cheap when the text does not contain `pgmemo_s`. A text that
/// is not UTF-8 (another client_encoding) is read byte by byte: the words and the quotes
/// that matter are ASCII in every client encoding PostgreSQL accepts.
pub fn hide_reserved(sql: &[u8]) -> Option<Hidden> {
    if !sql
        .windows(NOWHERE.len())
        .any(|w| w.eq_ignore_ascii_case(NOWHERE.as_bytes()))
    {
        return None;
    }
    match std::str::from_utf8(sql) {
        Ok(text) => {
            let (text, uses) = hide_reserved_str(text)?;
            Some(Hidden {
                text: text.into_bytes(),
                uses,
            })
        }
        Err(_) => {
            let text: String = sql.iter().map(|&b| char::from(b)).collect();
            let (text, uses) = hide_reserved_str(&text)?;
            Some(Hidden {
                // Every char is one of the bytes, or ASCII pgmemo wrote.
                text: text.chars().map(|c| c as u8).collect(),
                uses,
            })
        }
    }
}

fn hide_reserved_str(sql: &str) -> Option<(String, Vec<(usize, ReservedUse)>)> {
    let offset = |part: &str| part.as_ptr() as usize - sql.as_ptr() as usize;
    let mut text = String::new();
    let mut copied = 0;
    let mut uses = Vec::new();
    let statements = split(sql).into_iter().filter(|s| !s.trim().is_empty());
    for (index, stmt) in statements.enumerate() {
        let words = leading_words(stmt, 3);
        let Some(&first) = words.first() else {
            continue;
        };
        let prepare = is_keyword(first, "prepare");
        let token = if prepare || is_keyword(first, "execute") {
            words.get(1)
        } else if is_keyword(first, "deallocate") {
            match words.get(1) {
                Some(w) if is_keyword(w, "prepare") => words.get(2),
                w => w,
            }
        } else {
            None
        };
        let Some(&token) = token else {
            continue;
        };
        let name = identifier(token);
        if !is_reserved_name(name.as_bytes()) {
            continue;
        }
        let (start, end, replacement, used) = if prepare {
            let start = offset(first);
            let end = offset(stmt) + stmt.len();
            (start, end, "EXECUTE pgmemo_s", ReservedUse::Refused(name))
        } else {
            let start = offset(token);
            (
                start,
                start + token.len(),
                NOWHERE,
                ReservedUse::Missing(name),
            )
        };
        let width = sql[start..end].chars().count();
        text.push_str(&sql[copied..start]);
        text.push_str(replacement);
        text.extend(std::iter::repeat_n(
            ' ',
            width.saturating_sub(replacement.len()),
        ));
        copied = end;
        uses.push((index, used));
    }
    if uses.is_empty() {
        return None;
    }
    text.push_str(&sql[copied..]);
    Some((text, uses))
}

/// Whether a `CREATE`, `ALTER` or `DROP` statement provably changes only the session's own
/// temporary objects: `CREATE [OR REPLACE] [GLOBAL | LOCAL] TEMP | TEMPORARY ...`, or a name
/// in the session's temporary schema (`pg_temp.t`, `pg_temp_3.t`). A word that only starts
/// with "temp" (`DROP TABLE templates`) proves nothing: such DDL was taken for the session's
/// own, its shared statements kept, and PostgreSQL then refused them (0A000, found by
/// pg_regress's `temp` through pgmemo). When unsure, the DDL is the schema's.
fn only_temporary(stmt: &str) -> bool {
    let lower = stmt.to_ascii_lowercase();
    let words: Vec<&str> = lower
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == '$'))
        .filter(|w| !w.is_empty())
        .collect();
    let mut at = 1;
    if words.first() == Some(&"create") {
        if words.get(at) == Some(&"or") && words.get(at + 1) == Some(&"replace") {
            at += 2;
        }
        if matches!(words.get(at), Some(&"global" | &"local")) {
            at += 1;
        }
        if matches!(words.get(at), Some(&"temp" | &"temporary")) {
            return true;
        }
    }
    words.iter().any(|w| {
        *w == "pg_temp"
            || w.strip_prefix("pg_temp_")
                .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
    })
}

/// What one statement (of [`split`]'s, or a Parse's text) is.
pub fn classify_statement(stmt: &str) -> Command {
    if let Some(explained) = explained(stmt) {
        // `EXPLAIN [ANALYZE] EXECUTE name` runs (or plans) the statement `name`.
        return match classify_statement(explained) {
            execute @ Command::Execute { .. } => execute,
            _ => Command::Explain,
        };
    }
    let words = leading_words(stmt, 3);
    let word = |i: usize| words.get(i).map(|w| w.to_ascii_lowercase());
    let Some(first) = word(0) else {
        return Command::Other;
    };
    match first.as_str() {
        "begin" => Command::Begin,
        "start" if word(1).as_deref() == Some("transaction") => Command::Begin,
        "commit" | "rollback" if word(1).as_deref() == Some("prepared") => Command::EndPrepared,
        "commit" | "end" => Command::Commit,
        "rollback" if rolls_back_to(&words) => Command::RollbackTo,
        "rollback" | "abort" => Command::Rollback,
        "savepoint" => Command::Savepoint,
        "release" => Command::Release,
        "prepare" => match words.get(1) {
            Some(name) if is_keyword(name, "transaction") => Command::PrepareTransaction,
            Some(name) => Command::Prepare {
                name: identifier(name),
                text: stmt.trim().to_owned(),
            },
            None => Command::Other,
        },
        "execute" => match words.get(1) {
            Some(name) => Command::Execute {
                name: identifier(name),
            },
            None => Command::Other,
        },
        "deallocate" => {
            let at = if word(1).as_deref() == Some("prepare") {
                2
            } else {
                1
            };
            match words.get(at) {
                Some(w) if is_keyword(w, "all") => Command::DeallocateAll,
                Some(name) => Command::Deallocate {
                    name: identifier(name),
                },
                None => Command::Other,
            }
        }
        "discard" if word(1).as_deref() == Some("all") => Command::DiscardAll,
        "discard" => Command::Discard,
        "set" => set_search_path(stmt).unwrap_or(Command::Set {
            local: word(1).as_deref() == Some("local"),
        }),
        "reset" if word(1).as_deref() == Some("all") => Command::ResetAll,
        "reset" => set_search_path(stmt).unwrap_or(Command::Reset),
        "load" => Command::Load,
        "listen" => Command::Listen,
        "unlisten" => Command::Unlisten,
        "notify" => Command::Notify,
        "declare" => Command::Declare,
        "fetch" | "move" => Command::Fetch,
        "close" => Command::Close,
        "copy" => Command::Copy,
        "create" | "alter" | "drop" => Command::Ddl {
            temp: only_temporary(stmt),
        },
        "insert" | "update" | "delete" | "merge" | "truncate" => Command::Dml,
        "select" | "values" | "table" | "with" => Command::Select,
        "show" => Command::Show,
        _ => Command::Other,
    }
}

/// Whether a `ROLLBACK`'s leading words (up to three) go on with `TO`: `ROLLBACK TO`,
/// `ROLLBACK WORK TO`, `ROLLBACK TRANSACTION TO`.
fn rolls_back_to(words: &[&str]) -> bool {
    match words.get(1) {
        Some(w) if is_keyword(w, "to") => true,
        Some(w) if is_keyword(w, "work") || is_keyword(w, "transaction") => {
            words.get(2).is_some_and(|w| is_keyword(w, "to"))
        }
        _ => false,
    }
}

/// `SET [SESSION | LOCAL] search_path ...` or `RESET search_path`, if `stmt` is one.
fn set_search_path(stmt: &str) -> Option<Command> {
    let words = leading_words(stmt, 3);
    let mut i = 1;
    let mut local = false;
    if is_keyword(words.first()?, "reset") {
        return (identifier(words.get(1)?) == "search_path").then_some(Command::SetSearchPath {
            value: Some(String::new()),
            local: false,
        });
    }
    match words.get(1) {
        Some(w) if is_keyword(w, "local") => {
            local = true;
            i = 2;
        }
        Some(w) if is_keyword(w, "session") => i = 2,
        _ => {}
    }
    let name = words.get(i)?;
    if identifier(name) != "search_path" {
        return None;
    }
    // What follows the name: `TO` or `=`, then the value list.
    let at = name.as_ptr() as usize - stmt.as_ptr() as usize + name.len();
    let b = stmt.as_bytes();
    let mut j = skip_space_and_comments(b, at);
    if b.get(j) == Some(&b'=') {
        j += 1;
    } else if b.len() >= j + 2
        && b[j..j + 2].eq_ignore_ascii_case(b"to")
        && !b.get(j + 2).is_some_and(|&c| is_ident_byte(c))
    {
        j += 2;
    } else {
        return None;
    }
    // What this reader cannot read is keyed by its text, marked as unreadable (see
    // `statements::is_unknown_search_path`).
    let value = search_path_value(&stmt[j..]).unwrap_or_else(|| format!("\0{}", stmt[j..].trim()));
    Some(Command::SetSearchPath {
        value: Some(value),
        local,
    })
}

pub(super) fn is_ident_byte(c: u8) -> bool {
    c.is_ascii_alphanumeric() || c == b'_' || c == b'$' || c >= 0x80
}

/// The list after `SET search_path TO` as PostgreSQL stores it: each item (identifier or
/// string) as a quoted-if-needed identifier, joined by `, `; `DEFAULT` is `""`. None for what
/// this small reader does not understand.
fn search_path_value(text: &str) -> Option<String> {
    let b = text.as_bytes();
    let mut items: Vec<String> = Vec::new();
    let mut i = skip_space_and_comments(b, 0);
    loop {
        let item = match *b.get(i)? {
            b'"' | b'\'' => {
                let q = b[i];
                let end = skip_quoted(b, i, i);
                if end > b.len() || b.get(end - 1) != Some(&q) || end - 1 == i {
                    return None;
                }
                let doubled = [q as char, q as char].iter().collect::<String>();
                let inner = text[i + 1..end - 1].replace(&doubled, &(q as char).to_string());
                if q == b'\'' && inner.contains('\\') {
                    return None; // backslashes depend on standard_conforming_strings
                }
                i = end;
                inner
            }
            c if c.is_ascii_alphabetic() || c == b'_' || c >= 0x80 => {
                let start = i;
                while i < b.len() && is_ident_byte(b[i]) {
                    i += 1;
                }
                let word = &text[start..i];
                if !word.is_ascii() {
                    return None; // case folding of non-ASCII letters depends on the encoding
                }
                if items.is_empty() && word.eq_ignore_ascii_case("default") {
                    i = skip_space_and_comments(b, i);
                    return (i >= b.len()).then(String::new);
                }
                word.to_ascii_lowercase()
            }
            _ => return None,
        };
        items.push(quote_identifier(&item));
        i = skip_space_and_comments(b, i);
        match b.get(i) {
            None => return Some(items.join(", ")),
            Some(b',') => i = skip_space_and_comments(b, i + 1),
            Some(_) => return None,
        }
    }
}

/// An identifier quoted unless it is a plain lower-case one (PostgreSQL also quotes keywords,
/// which only changes the text, not the schema it names).
fn quote_identifier(name: &str) -> String {
    let plain = name
        .bytes()
        .next()
        .is_some_and(|c| c.is_ascii_lowercase() || c == b'_')
        && name
            .bytes()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'_');
    if plain {
        name.to_owned()
    } else {
        format!("\"{}\"", name.replace('"', "\"\""))
    }
}

/// Whether `word` (one of [`leading_words`]) is the keyword `kw`, in any case, unquoted.
pub fn is_keyword(word: &str, kw: &str) -> bool {
    !word.starts_with('"') && word.eq_ignore_ascii_case(kw)
}

/// An identifier as PostgreSQL folds it: quoted keeps case (with `""` unescaped), unquoted is
/// lower-cased.
fn identifier(word: &str) -> String {
    match word.strip_prefix('"').and_then(|w| w.strip_suffix('"')) {
        Some(inner) => inner.replace("\"\"", "\""),
        None => word.to_lowercase(),
    }
}

/// The statement an `EXPLAIN` is about: the text after `EXPLAIN`, its options in parentheses
/// or the words ANALYZE and VERBOSE.
fn explained(stmt: &str) -> Option<&str> {
    let b = stmt.as_bytes();
    let mut i = skip_space_and_comments(b, 0);
    let word_at = |i: usize, w: &str| {
        b.len() >= i + w.len()
            && b[i..i + w.len()].eq_ignore_ascii_case(w.as_bytes())
            && !b
                .get(i + w.len())
                .is_some_and(|&c| c.is_ascii_alphanumeric() || c == b'_' || c == b'$' || c >= 0x80)
    };
    if !word_at(i, "explain") {
        return None;
    }
    i = skip_space_and_comments(b, i + "explain".len());
    if b.get(i) == Some(&b'(') {
        i += b[i..].iter().position(|&c| c == b')')? + 1;
    } else {
        for w in ["analyze", "analyse", "verbose"] {
            if word_at(i, w) {
                i = skip_space_and_comments(b, i + w.len());
            }
        }
    }
    Some(&stmt[i..])
}

/// The first `n` words of a statement (keywords, identifiers, quoted identifiers), after
/// blanks and comments.
pub fn leading_words(stmt: &str, n: usize) -> Vec<&str> {
    let b = stmt.as_bytes();
    let mut words = Vec::new();
    let mut i = 0;
    while words.len() < n {
        i = skip_space_and_comments(b, i);
        if i >= b.len() {
            break;
        }
        let start = i;
        if b[i] == b'"' {
            i += 1;
            loop {
                match b.get(i) {
                    None => return words,
                    Some(b'"') if b.get(i + 1) == Some(&b'"') => i += 2,
                    Some(b'"') => {
                        i += 1;
                        break;
                    }
                    Some(_) => i += 1,
                }
            }
        } else if b[i].is_ascii_alphabetic() || b[i] == b'_' || b[i] >= 0x80 {
            while i < b.len()
                && (b[i].is_ascii_alphanumeric() || b[i] == b'_' || b[i] == b'$' || b[i] >= 0x80)
            {
                i += 1;
            }
        } else {
            break;
        }
        words.push(&stmt[start..i]);
    }
    words
}

pub(super) fn skip_space_and_comments(b: &[u8], mut i: usize) -> usize {
    loop {
        while i < b.len() && b[i].is_ascii_whitespace() {
            i += 1;
        }
        if b[i..].starts_with(b"--") {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
        } else if b[i..].starts_with(b"/*") {
            i = skip_block_comment(b, i);
        } else {
            return i;
        }
    }
}

/// Block comments nest in PostgreSQL.
fn skip_block_comment(b: &[u8], mut i: usize) -> usize {
    let mut depth = 0;
    while i < b.len() {
        if b[i..].starts_with(b"/*") {
            depth += 1;
            i += 2;
        } else if b[i..].starts_with(b"*/") {
            depth -= 1;
            i += 2;
            if depth == 0 {
                return i;
            }
        } else {
            i += 1;
        }
    }
    i
}

/// The highest `$n` parameter reference outside quotes, dollar quotes and comments (0 when
/// there is none): with the types a Parse declares, how many parameters PostgreSQL gives the
/// statement.
pub fn highest_parameter(sql: &str) -> usize {
    let b = sql.as_bytes();
    let mut highest = 0;
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'\'' | b'"' => i = skip_quoted(b, 0, i),
            b'-' if b.get(i + 1) == Some(&b'-') => {
                while i < b.len() && b[i] != b'\n' {
                    i += 1;
                }
            }
            b'/' if b.get(i + 1) == Some(&b'*') => i = skip_block_comment(b, i),
            b'$' => {
                let digits = b[i + 1..].iter().take_while(|c| c.is_ascii_digit()).count();
                let in_identifier = i > 0 && (b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'_');
                if digits > 0 && !in_identifier {
                    let n = sql[i + 1..i + 1 + digits].parse().unwrap_or(usize::MAX);
                    highest = highest.max(n);
                    i += 1 + digits;
                } else {
                    i = skip_dollar_quote(b, i);
                }
            }
            c if c.is_ascii_alphanumeric() || c == b'_' || c >= 0x80 => {
                // An identifier or keyword, in which `$` does not start anything.
                while i < b.len()
                    && (b[i].is_ascii_alphanumeric()
                        || b[i] == b'_'
                        || b[i] == b'$'
                        || b[i] >= 0x80)
                {
                    i += 1;
                }
            }
            _ => i += 1,
        }
    }
    highest
}

/// Skips the quoted string or identifier starting at `i`; returns the index after it.
fn skip_quoted(b: &[u8], stmt_start: usize, mut i: usize) -> usize {
    let q = b[i];
    i += 1;
    while i < b.len() {
        if b[i] == q {
            if b.get(i + 1) == Some(&q) {
                i += 2;
                continue;
            }
            break;
        }
        // E'' strings escape with backslash; a backslash-quote never ends them.
        if q == b'\'' && b[i] == b'\\' && is_escape_string(b, stmt_start, i) {
            i += 2;
            continue;
        }
        i += 1;
    }
    i + 1
}

/// Skips the dollar-quoted string starting at `i` (`$tag$ ... $tag$`), or just the `$` if it
/// does not start one.
fn skip_dollar_quote(b: &[u8], i: usize) -> usize {
    let tag_end = b[i + 1..]
        .iter()
        .position(|&c| !(c.is_ascii_alphanumeric() || c == b'_'))
        .map(|p| i + 1 + p);
    match tag_end {
        Some(e) if b[e] == b'$' && !b[i + 1..e].first().is_some_and(u8::is_ascii_digit) => {
            let tag = &b[i..=e];
            let body = e + 1;
            match b[body..].windows(tag.len()).position(|w| w == tag) {
                Some(p) => body + p + tag.len(),
                None => b.len(),
            }
        }
        _ => i + 1,
    }
}

/// Splits on semicolons outside quotes, dollar quotes and comments.
pub fn split(sql: &str) -> Vec<&str> {
    let b = sql.as_bytes();
    let mut out = Vec::new();
    let mut start = 0;
    let mut i = 0;
    let mut paren = 0i32;
    while i < b.len() {
        match b[i] {
            b'\'' | b'"' => i = skip_quoted(b, start, i),
            b'-' if b.get(i + 1) == Some(&b'-') => {
                while i < b.len() && b[i] != b'\n' {
                    i += 1;
                }
            }
            b'/' if b.get(i + 1) == Some(&b'*') => i = skip_block_comment(b, i),
            // $tag$ ... $tag$ (a $1 parameter is not a dollar quote).
            b'$' => i = skip_dollar_quote(b, i),
            b'(' => {
                paren += 1;
                i += 1;
            }
            b')' => {
                paren -= 1;
                i += 1;
            }
            b';' if paren <= 0 => {
                out.push(&sql[start..i]);
                i += 1;
                start = i;
            }
            _ => i += 1,
        }
    }
    if start < b.len() {
        out.push(&sql[start..]);
    }
    out
}

/// Whether the quote before position `at` opened an E'' string (conservative: looks back for
/// the quote's opening and an E just before it).
fn is_escape_string(b: &[u8], stmt_start: usize, at: usize) -> bool {
    let mut j = at;
    while j > stmt_start {
        j -= 1;
        if b[j] == b'\'' {
            return j > 0
                && matches!(b[j - 1], b'E' | b'e')
                && (j < 2 || !b[j - 2].is_ascii_alphanumeric());
        }
    }
    false
}

#[cfg(test)]
mod tests {
    #[test]
    fn explain_execute_is_an_execute() {
        for sql in [
            "EXPLAIN EXECUTE s1(1)",
            "explain analyze verbose execute s1",
            "EXPLAIN (COSTS OFF, FORMAT JSON) EXECUTE s1 (1)",
            "EXPLAIN /* c */ ANALYZE EXECUTE \"s1\"",
        ] {
            assert_eq!(
                classify(sql),
                [Command::Execute { name: "s1".into() }],
                "{sql}"
            );
        }
        assert_eq!(classify("EXPLAIN SELECT 1"), [Command::Explain]);
        assert_eq!(classify("EXPLAINED"), [Command::Other]);
    }

    use super::*;

    #[test]
    fn recognizes_statement_commands() {
        assert_eq!(
            classify("PREPARE Foo (int) AS SELECT $1; execute foo(1)"),
            vec![
                Command::Prepare {
                    name: "foo".into(),
                    text: "PREPARE Foo (int) AS SELECT $1".into()
                },
                Command::Execute { name: "foo".into() }
            ]
        );
        assert_eq!(
            classify("deallocate \"Foo\""),
            vec![Command::Deallocate { name: "Foo".into() }]
        );
        assert_eq!(
            classify("DEALLOCATE PREPARE ALL;"),
            vec![Command::DeallocateAll]
        );
        assert_eq!(
            classify(" /* hi */ discard -- x\n all"),
            vec![Command::DiscardAll]
        );
        assert_eq!(classify("DISCARD PLANS"), vec![Command::Discard]);
        assert_eq!(
            classify("PREPARE TRANSACTION 'x'"),
            vec![Command::PrepareTransaction]
        );
        assert_eq!(classify("SELECT 1"), vec![Command::Select]);
    }

    /// A PREPARE's text keeps its place in its query: its errors point where PostgreSQL's do.
    #[test]
    fn prepare_texts_keep_their_place() {
        assert_eq!(
            classify("CREATE TEMP TABLE t AS SELECT 1; PREPARE p AS SELECT * FROM t; DROP TABLE t"),
            vec![
                Command::Ddl { temp: true },
                Command::Prepare {
                    name: "p".into(),
                    text: format!("{}PREPARE p AS SELECT * FROM t", " ".repeat(33)),
                },
                Command::Ddl { temp: false },
            ]
        );
        // Characters, not bytes.
        assert_eq!(
            classify("SELECT 'é';\n  prepare q as select 1"),
            vec![
                Command::Select,
                Command::Prepare {
                    name: "q".into(),
                    text: format!("{}prepare q as select 1", " ".repeat(14)),
                },
            ]
        );
        assert_eq!(
            tracked_command(" PREPARE p AS SELECT 1"),
            Some(Command::Prepare {
                name: "p".into(),
                text: " PREPARE p AS SELECT 1".into()
            })
        );
    }

    #[test]
    fn tracked_commands_of_a_parse() {
        assert_eq!(tracked_command("DISCARD ALL"), Some(Command::DiscardAll));
        assert_eq!(
            tracked_command(" deallocate prepare ALL ;"),
            Some(Command::DeallocateAll)
        );
        assert_eq!(
            tracked_command("DEALLOCATE \"A\""),
            Some(Command::Deallocate { name: "A".into() })
        );
        assert_eq!(
            tracked_command("PREPARE p AS SELECT 1"),
            Some(Command::Prepare {
                name: "p".into(),
                text: "PREPARE p AS SELECT 1".into()
            })
        );
        assert_eq!(
            tracked_command("execute \"P\"(1)"),
            Some(Command::Execute { name: "P".into() })
        );
        assert_eq!(
            tracked_command("EXPLAIN (COSTS OFF) EXECUTE p"),
            Some(Command::Execute { name: "p".into() })
        );
        assert_eq!(tracked_command("EXPLAIN SELECT 1"), None);
        for no in [
            "SELECT 1",
            "DISCARD PLANS",
            "PREPARE TRANSACTION 'x'",
            "DEALLOCATE a; DEALLOCATE b",
            "",
        ] {
            assert_eq!(tracked_command(no), None, "{no}");
        }
    }

    #[test]
    fn reads_set_search_path() {
        let set = |value: Option<&str>, local| Command::SetSearchPath {
            value: value.map(str::to_owned),
            local,
        };
        for (text, want) in [
            ("SET search_path = a", set(Some("a"), false)),
            (
                "set LOCAL search_path TO A, \"B\", 'c d'",
                set(Some("a, \"B\", \"c d\""), true),
            ),
            (
                "SET SESSION \"search_path\" TO \"$user\" , public",
                set(Some("\"$user\", public"), false),
            ),
            ("SET search_path TO DEFAULT", set(Some(""), false)),
            ("RESET search_path", set(Some(""), false)),
            ("SET search_path = 'it''s'", set(Some("\"it's\""), false)),
            ("SET search_path = E'x'", set(Some("\0E'x'"), false)),
            ("SET search_path = a b", set(Some("\0a b"), false)),
            ("SET search_path TO", set(Some("\0"), false)),
        ] {
            assert_eq!(classify(text), vec![want], "{text}");
        }
        for (other, want) in [
            ("SET search_paths = a", Command::Set { local: false }),
            ("SET work_mem = 1", Command::Set { local: false }),
            ("RESET ALL", Command::ResetAll),
            ("RESET work_mem", Command::Reset),
            (
                "SET LOCAL statement_timeout = 5",
                Command::Set { local: true },
            ),
        ] {
            assert_eq!(classify(other), vec![want], "{other}");
        }
        assert_eq!(
            tracked_command("SET search_path = a"),
            Some(set(Some("a"), false))
        );
        assert_eq!(tracked_command("SET work_mem = 1"), None);
    }

    #[test]
    fn counts_parameters_as_postgres_does() {
        assert_eq!(highest_parameter("SELECT 1"), 0);
        assert_eq!(highest_parameter("SELECT $1::int + $3"), 3);
        assert_eq!(
            highest_parameter("SELECT '$9', \"$8\", $$ $7 $$, $q$ $6 $q$ -- $5"),
            0
        );
        assert_eq!(
            highest_parameter("SELECT a$2 FROM t WHERE b = $12 /* $99 */"),
            12
        );
        assert_eq!(highest_parameter(r"SELECT E'\' $4', $2"), 2);
        assert_eq!(highest_parameter("$"), 0);
    }

    #[test]
    fn hides_reserved_names_keeping_positions() {
        assert_eq!(
            NOWHERE_MISSING,
            format!("prepared statement \"{NOWHERE}\" does not exist")
        );
        assert!(is_reserved_name(b"pgmemo_s0"));
        assert!(is_reserved_name(b"pgmemo_s"));
        assert!(is_reserved_name(b"pgmemo_s12345"));
        for no in [
            &b"pgmemo_s1x"[..],
            b"PGMEMO_S1",
            b"pgmemo_",
            b"xpgmemo_s1",
            b"pgmemo_missing",
        ] {
            assert!(!is_reserved_name(no));
        }
        assert_eq!(hide_reserved(b"SELECT 1; DEALLOCATE a"), None);
        assert_eq!(hide_reserved(b"SELECT 'pgmemo_s1'"), None);
        let query = "SELECT 1; DEALLOCATE PREPARE \"pgmemo_s12\"; execute PGMEMO_S3(1); \
                     prepare pgmemo_s4 AS SELECT 'é'; SELECT 2";
        let h = hide_reserved(query.as_bytes()).unwrap();
        let text = String::from_utf8(h.text).unwrap();
        assert_eq!(
            text,
            "SELECT 1; DEALLOCATE PREPARE pgmemo_s    ; execute pgmemo_s (1); \
             EXECUTE pgmemo_s               ; SELECT 2"
        );
        assert_eq!(text.chars().count(), query.chars().count());
        assert_eq!(
            h.uses,
            vec![
                (1, ReservedUse::Missing("pgmemo_s12".into())),
                (2, ReservedUse::Missing("pgmemo_s3".into())),
                (3, ReservedUse::Refused("pgmemo_s4".into())),
            ]
        );
        assert_eq!(hide_reserved(b"EXECUTE \"PGMEMO_S1\""), None);
        assert_eq!(hide_reserved(b"PREPARE TRANSACTION 'pgmemo_s1'"), None);
        // Latin-1 (not UTF-8): byte for byte.
        let h = hide_reserved(b"SELECT '\xe9'; EXECUTE pgmemo_s7").unwrap();
        assert_eq!(h.text, b"SELECT '\xe9'; EXECUTE pgmemo_s ");
        assert_eq!(h.uses, vec![(1, ReservedUse::Missing("pgmemo_s7".into()))]);
    }

    #[test]
    fn recognizes_transaction_exit_statements() {
        for yes in [
            "COMMIT",
            "commit and chain",
            "END",
            "ROLLBACK",
            " /* x */ rollback to savepoint a",
            "ABORT",
            "PREPARE TRANSACTION 'x'",
            "ROLLBACK;",
        ] {
            assert!(classify_statement(yes).is_transaction_exit(), "{yes}");
        }
        for no in [
            "COMMIT PREPARED 'x'",
            "ROLLBACK PREPARED 'x'",
            "BEGIN",
            "SAVEPOINT a",
            "SELECT 1",
            "PREPARE p AS SELECT 1",
            "\"commit\"",
            "",
        ] {
            assert!(!classify_statement(no).is_transaction_exit(), "{no}");
        }
    }

    #[test]
    fn classifies_every_kind_of_statement() {
        for (text, want) in [
            ("begin", Command::Begin),
            (
                "START TRANSACTION ISOLATION LEVEL SERIALIZABLE",
                Command::Begin,
            ),
            ("START", Command::Other),
            ("END", Command::Commit),
            ("commit and chain", Command::Commit),
            ("ABORT", Command::Rollback),
            ("rollback work", Command::Rollback),
            ("ROLLBACK TO a", Command::RollbackTo),
            ("rollback transaction to savepoint a", Command::RollbackTo),
            ("SAVEPOINT a", Command::Savepoint),
            ("RELEASE SAVEPOINT a", Command::Release),
            ("COMMIT PREPARED 'x'", Command::EndPrepared),
            ("rollback prepared 'x'", Command::EndPrepared),
            ("DISCARD TEMP", Command::Discard),
            (
                "SET SESSION AUTHORIZATION DEFAULT",
                Command::Set { local: false },
            ),
            ("set local role r", Command::Set { local: true }),
            ("LOAD 'auto_explain'", Command::Load),
            ("LISTEN ch", Command::Listen),
            ("UNLISTEN *", Command::Unlisten),
            ("NOTIFY ch, 'x'", Command::Notify),
            ("DECLARE c CURSOR WITH HOLD FOR SELECT 1", Command::Declare),
            ("FETCH 10 FROM c", Command::Fetch),
            ("MOVE c", Command::Fetch),
            ("CLOSE ALL", Command::Close),
            ("COPY t FROM STDIN", Command::Copy),
            ("CREATE TABLE t (a int)", Command::Ddl { temp: false }),
            (
                "create temporary table t (a int)",
                Command::Ddl { temp: true },
            ),
            (
                "ALTER TABLE pg_temp.t ADD b int",
                Command::Ddl { temp: true },
            ),
            ("DROP INDEX i", Command::Ddl { temp: false }),
            ("DROP TABLE templates", Command::Ddl { temp: false }),
            (
                "ALTER TABLE temptest ADD b int",
                Command::Ddl { temp: false },
            ),
            ("CREATE TABLE t (temp int)", Command::Ddl { temp: false }),
            (
                "create or replace temp view v as select 1",
                Command::Ddl { temp: true },
            ),
            (
                "CREATE GLOBAL TEMPORARY TABLE g (a int)",
                Command::Ddl { temp: true },
            ),
            ("DROP TABLE pg_temp_3.t", Command::Ddl { temp: true }),
            ("INSERT INTO t VALUES (1)", Command::Dml),
            ("update t set a = 1", Command::Dml),
            ("DELETE FROM t", Command::Dml),
            (
                "MERGE INTO t USING s ON true WHEN MATCHED THEN DELETE",
                Command::Dml,
            ),
            ("TRUNCATE t", Command::Dml),
            ("/* c */ SELECT 1", Command::Select),
            ("VALUES (1)", Command::Select),
            ("TABLE t", Command::Select),
            ("WITH x AS (SELECT 1) SELECT * FROM x", Command::Select),
            ("SHOW ALL", Command::Show),
            ("EXPLAIN ANALYZE SELECT 1", Command::Explain),
            ("GRANT SELECT ON t TO r", Command::Other),
            ("(SELECT 1)", Command::Other),
            ("\"select\" 1", Command::Other),
            ("selected", Command::Other),
        ] {
            assert_eq!(classify_statement(text), want, "{text}");
        }
    }

    #[test]
    fn recognizes_transaction_start_statements() {
        assert!(classify_statement("BEGIN").is_transaction_start());
        assert!(classify_statement("begin isolation level serializable").is_transaction_start());
        assert!(classify_statement("START TRANSACTION READ ONLY").is_transaction_start());
        assert!(!classify_statement("START").is_transaction_start());
        assert!(!classify_statement("COMMIT").is_transaction_start());
        assert!(!classify_statement("\"begin\"").is_transaction_start());
    }

    #[test]
    fn splitting_respects_quotes_and_comments() {
        assert_eq!(split("SELECT ';'; SELECT 2").len(), 2);
        assert_eq!(split("SELECT $$a;b$$; SELECT $x$;$x$").len(), 2);
        assert_eq!(split("SELECT $1; SELECT 2").len(), 2);
        assert_eq!(split("SELECT 1 -- ;\n; SELECT /* ; */ 2").len(), 2);
        assert_eq!(split(r"SELECT E'\';'; SELECT 2").len(), 2);
        assert_eq!(split("SELECT \"a;b\"").len(), 1);
        assert_eq!(classify(";;"), vec![]);
    }

    #[test]
    fn garbage_never_panics() {
        for s in [
            "$",
            "$$",
            "'",
            "\"",
            "/*",
            "--",
            "$a",
            "E'\\",
            "PREPARE",
            "DEALLOCATE PREPARE",
            "\"unterminated",
        ] {
            let _ = classify(s);
        }
    }
}
