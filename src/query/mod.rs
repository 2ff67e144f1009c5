//! What pgmemo knows about a query's text: every reader of SQL text lives here, and nowhere
//! else, so that a newcomer finds in one room how pgmemo understands what a client sent.
//!
//! - [`lexer`]: one pass over a simple query, PostgreSQL's own lexer rules, that finds its
//!   literals and yields its *shape* (the text with literals as `$n`, and its hash): the hot
//!   path of autoprepare and the result cache's key.
//! - [`words`]: a cheap, generous test for which of a few SQL words a text contains, so the
//!   features that care about a word (session state, DDL, statement commands) look closer only
//!   when it is there.
//! - [`command`]: the SQL command classifier, what kind each statement is (`BEGIN`, `SET`,
//!   `PREPARE`, `LISTEN`, `COPY`, DDL, DML, `SELECT`, ...) as one `Command`; and
//!   [`block`], the strict reading of the transaction control a session answers itself.
//! - [`facts`]: what a statement does to its session (settings, temporary objects, `LISTEN`,
//!   advisory locks, held cursors) and to the schema (DDL).
//! - [`hint`]: the `/* pgmemo cache */` comments.
//! - [`database`]: the statements that need a database to themselves (`DROP DATABASE`,
//!   `ALTER DATABASE ... RENAME`, `CREATE DATABASE ... TEMPLATE`), read with pg_query on the
//!   cold path, so that pgmemo's own sessions leave that database first.
//! - [`analysis`]: what a statement reads and writes, and [`parameters`]: which of a simple
//!   query's literals may become parameters, both from PostgreSQL's own parser (pg_query),
//!   from one parse per shape, on the cold path.
//! - [`shapes`]: the one table of shapes every session shares, whose entry holds what was
//!   derived once per shape (its words, its analysis, the autoprepare decision).
//!
//! This room uses only the ground floor (protocol names, settings' values): the features
//! above it (statements, autoprepare, the cache, the session) all read queries through it.

pub mod analysis;
pub mod block;
pub mod columns;
pub mod command;
pub mod database;
pub mod facts;
pub mod hint;
pub mod lexer;
pub mod parameters;
pub mod point;
pub mod shapes;
pub mod words;

use lexer::{Lexed, Refusal};

/// PostgreSQL's parse of a text (pg_query), as the derivations of a shape read it.
pub enum Parsed {
    /// The parse tree, as JSON (every node an object named by its type).
    Tree(serde_json::Value),
    /// PostgreSQL's parser refuses the text: the server will too, and say why.
    Refused,
    /// Parsed, but the tree could not be read (never seen; treated as unknown).
    Unreadable,
}

/// Parses `sql` once, for every derivation that needs PostgreSQL's reading of it.
pub fn parse(sql: &str) -> Parsed {
    let Ok(parsed) = pg_query::parse(sql, 0) else {
        return Parsed::Refused;
    };
    match serde_json::to_value(&parsed.protobuf) {
        Ok(tree) => Parsed::Tree(tree),
        Err(_) => Parsed::Unreadable,
    }
}

/// Whether PostgreSQL describes `sql` (one statement) with NoData: certainly a statement that
/// returns no rows. False when unsure: it returns rows, or what it returns depends on what it
/// names (an `EXECUTE`, a `CALL`, a `FETCH`), or it is not one statement PostgreSQL reads.
///
/// PostgreSQL's own rule: a query returns rows when it is a `SELECT` (not `SELECT INTO`,
/// which runs as `CREATE TABLE AS`) or has `RETURNING`; a utility statement only when
/// `UtilityReturnsTuples` (tcop/utility.c) says so, for `EXPLAIN`, `SHOW`, and for `FETCH`
/// (not `MOVE`), `EXECUTE` and `CALL` by the portal, statement or procedure they name.
pub fn describes_no_rows(sql: &str) -> bool {
    let Parsed::Tree(tree) = parse(sql) else {
        return false;
    };
    let [stmt] = tree["stmts"].as_array().map(Vec::as_slice).unwrap_or(&[]) else {
        return false;
    };
    let Some((kind, node)) = stmt["stmt"]["node"]
        .as_object()
        .and_then(|n| n.iter().next())
    else {
        return false;
    };
    match kind.as_str() {
        "SelectStmt" => node.get("into_clause").is_some_and(|i| !i.is_null()),
        // (pg_query 18 reads PostgreSQL 18's grammar: `RETURNING` is a clause with its list.)
        "InsertStmt" | "UpdateStmt" | "DeleteStmt" | "MergeStmt" => node
            .get("returning_clause")
            .and_then(|c| c.get("exprs"))
            .and_then(|l| l.as_array())
            .is_none_or(Vec::is_empty),
        "FetchStmt" => node.get("ismove").and_then(|m| m.as_bool()) == Some(true),
        "ExplainStmt" | "VariableShowStmt" | "ExecuteStmt" | "CallStmt" => false,
        _ => true,
    }
}

/// One client's reading of the simple query at hand, made once: the first feature that needs
/// the lexer's reading of the text (the result cache, or autoprepare) makes it, and every
/// other one borrows it. The session forgets it when the next message comes
/// ([`Reader::forget`]); the buffers stay, so reading allocates only when a query is longer
/// than any before it.
#[derive(Debug, Default)]
pub struct Reader {
    lexed: Lexed,
    state: Read,
    /// The shape of the reading, once looked up.
    shape: Option<std::sync::Arc<shapes::Shape>>,
    /// A simple query of the client's being timed on the server for SHOW QUERIES (see
    /// `shapes::ShapeStats::timed`). Kept across messages (the session ends it at the
    /// query's ReadyForQuery).
    pub timed: Option<Timed>,
    /// The text `lexed` is the reading of, when the next text may be read by it
    /// ([`lexer::reread`]: the same query with other integers); empty otherwise.
    last: Vec<u8>,
    /// The message at hand was read by [`lexer::reread`]: its generalized text and literal
    /// kinds are those of the reading before it.
    reread: bool,
    /// The shape of the last message read before the one at hand, if it was looked up: a
    /// text read again ([`Reader::reread`]) has that shape if the table still gives it.
    last_shape: Option<std::sync::Arc<shapes::Shape>>,
}

/// A query being timed on the server: when it was sent, its shape, and the rows its
/// CommandCompletes gave so far.
#[derive(Debug)]
pub struct Timed {
    pub sent: crate::clock::Moment,
    pub shape: std::sync::Arc<shapes::Shape>,
    pub rows: u64,
    /// DataRows since the last CommandComplete or PortalSuspended: the rows of an Execute
    /// with a row limit that left its portal suspended (asyncpg's `fetchrow`), which has no
    /// tag to count them.
    pub data_rows: u64,
}

impl Timed {
    pub fn new(shape: std::sync::Arc<shapes::Shape>) -> Timed {
        Timed {
            sent: crate::clock::Moment::now(),
            shape,
            rows: 0,
            data_rows: 0,
        }
    }
}

/// How far the reading of the message at hand went.
#[derive(Debug, Default, Clone, Copy)]
enum Read {
    /// Not read yet.
    #[default]
    None,
    /// [`Reader::lexed`] holds it.
    Lexed,
    /// The lexer refused the text (the query then goes to the server as it is).
    Refused(Refusal),
}

impl Reader {
    /// The next message is not the one read. (Nothing to forget after a message that was not
    /// read, as most of an extended-protocol client's are: a shape is looked up only after a
    /// reading.)
    #[inline]
    pub fn forget(&mut self) {
        if !matches!(self.state, Read::None) {
            self.state = Read::None;
            self.last_shape = self.shape.take();
        }
    }

    /// The lexer's reading of `sql`, the text of the message at hand: lexed at the first call
    /// for that message, the same answer at every later one.
    pub fn read(&mut self, sql: &[u8]) -> Result<&Lexed, Refusal> {
        if let Read::None = self.state {
            self.state = self.read_anew(sql);
        }
        match self.state {
            Read::Refused(refusal) => Err(refusal),
            _ => Ok(&self.lexed),
        }
    }

    /// Reads `sql` by the last reading if it can, else with a pass of the lexer; keeps the
    /// text when the next one may be read by this reading.
    fn read_anew(&mut self, sql: &[u8]) -> Read {
        self.reread = !self.last.is_empty() && lexer::reread(sql, &self.last, &mut self.lexed);
        if self.reread {
            self.last.clear();
            self.last.extend_from_slice(sql);
            return Read::Lexed;
        }
        self.last.clear();
        match lexer::generalize(sql, &mut self.lexed) {
            Ok(()) => {
                if lexer::rereadable(sql, &self.lexed) {
                    self.last.extend_from_slice(sql);
                }
                Read::Lexed
            }
            Err(refusal) => Read::Refused(refusal),
        }
    }

    /// The reading of `sql`, the text of the message at hand, and its shape in `shapes`:
    /// looked up at the first call for that message (after [`Reader::read`]), the same at
    /// every later one.
    #[inline(always)]
    pub fn shape(
        &mut self,
        sql: &[u8],
        shapes: &shapes::Shapes,
    ) -> Result<(&Lexed, &std::sync::Arc<shapes::Shape>), Refusal> {
        // Looked up already (each query is asked for it twice, by the session and by
        // autoprepare): answered inline, without a call.
        match self.shape {
            Some(ref shape) => Ok((&self.lexed, shape)),
            None => self.first_shape(sql, shapes),
        }
    }

    /// [`Reader::shape`] at its first call for the message at hand.
    #[inline(never)]
    fn first_shape(
        &mut self,
        sql: &[u8],
        shapes: &shapes::Shapes,
    ) -> Result<(&Lexed, &std::sync::Arc<shapes::Shape>), Refusal> {
        self.read(sql)?;
        let lexed = &self.lexed;
        // Read again, the text is the last one's shape: the table's answer is that shape when
        // it is the same one (no comparison of the texts needed).
        let last = self.last_shape.as_ref().filter(|_| self.reread);
        Ok((
            lexed,
            self.shape.get_or_insert_with(|| {
                let shape = shapes.get(lexed, last);
                shape
                    .stats
                    .calls
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                shape
            }),
        ))
    }

    /// The shape of the message at hand, if it was looked up.
    #[inline]
    pub fn current_shape(&self) -> Option<&std::sync::Arc<shapes::Shape>> {
        self.shape.as_ref()
    }

    /// The reading made for the message at hand, if one was made and the lexer accepted it.
    #[inline]
    pub fn lexed(&self) -> Option<&Lexed> {
        matches!(self.state, Read::Lexed).then_some(&self.lexed)
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn statements_described_without_rows() {
        for no_rows in [
            "UPDATE t SET v = 1",
            "insert into t values (1)",
            "DELETE FROM t WHERE id = $1",
            "SAVEPOINT s",
            "SET x = 1",
            "DECLARE c CURSOR FOR SELECT 1",
            "COPY t TO STDOUT",
            "SELECT 1 AS a INTO t2",
            "MOVE 1 IN c",
            "CREATE SCHEMA s",
            "ANALYZE t",
            "ALTER SEQUENCE s RESTART",
            "CREATE FUNCTION f() RETURNS int LANGUAGE sql AS 'SELECT 1'",
        ] {
            assert!(super::describes_no_rows(no_rows), "{no_rows}");
        }
        for rows_or_unsure in [
            "SELECT 1",
            "UPDATE t SET v = 1 RETURNING v",
            "INSERT INTO t VALUES (1) RETURNING *",
            "SHOW x",
            "FETCH 1 FROM c",
            "EXECUTE p",
            "CALL f()",
            "EXPLAIN SELECT 1",
            "VALUES (1)",
            "WITH d AS (DELETE FROM t RETURNING *) SELECT * FROM d",
            "MERGE INTO t USING u ON t.id = u.id WHEN MATCHED THEN DELETE RETURNING *",
            "",
            "UPDATE t SET v = 1; UPDATE t SET v = 2",
            "SELEC 1",
        ] {
            assert!(
                !super::describes_no_rows(rows_or_unsure),
                "{rows_or_unsure}"
            );
        }
    }

    /// A text read again (the same query, other integers) gets the last one's shape through
    /// the table, as a text read anew does: the same shape while the table keeps it, the
    /// table's new one once it started afresh (a RELOAD), never the one the reader kept.
    #[test]
    fn a_text_read_again_gets_the_shape_the_table_gives() {
        use super::{shapes::Shapes, Reader};
        use std::sync::Arc;
        let shapes = Shapes::new(100);
        let mut reader = Reader::default();
        let shape_of = |reader: &mut Reader, sql: &str| {
            reader.forget();
            let (lexed, shape) = reader.shape(sql.as_bytes(), &shapes).unwrap();
            assert_eq!(lexed.literals.len(), 1);
            shape.clone()
        };
        let first = shape_of(&mut reader, "SELECT v FROM t WHERE id = 5");
        let again = shape_of(&mut reader, "SELECT v FROM t WHERE id = 61");
        assert!(reader.reread, "read by the last reading");
        assert!(Arc::ptr_eq(&first, &again));
        assert_eq!(
            first.stats.calls.load(std::sync::atomic::Ordering::Relaxed),
            2
        );
        shapes.set_max(50); // the table starts afresh
        let after = shape_of(&mut reader, "SELECT v FROM t WHERE id = 7");
        assert!(reader.reread);
        assert!(!Arc::ptr_eq(&first, &after), "the table's new shape");
        assert!(Arc::ptr_eq(
            &after,
            &shape_of(&mut reader, "SELECT v FROM t WHERE id = 8")
        ));
        // Another text of the same length is read anew, its own shape.
        let other = shape_of(&mut reader, "SELECT w FROM t WHERE id = 8");
        assert!(!reader.reread);
        assert!(!Arc::ptr_eq(&other, &after));
    }
}
