//! The prepared-statement planner: how one client message about statements becomes what the
//! held server must see, so that statements work in transaction mode with PostgreSQL's exact
//! answers.
//!
//! - Parse: a name the client already has with the same text, or a statement the registry
//!   knows was accepted before, is answered locally (ParseComplete at the right place in the
//!   reply stream); anything else goes to the server under the statement's own name.
//! - Bind / Describe(S): renamed; if the server lacks the statement, its Parse is injected
//!   first (and its ParseComplete swallowed), closing the least recently used one when the
//!   server's set is full.
//! - Close(S): the client's name is dropped and CloseComplete answered locally; the server keeps
//!   the shared statement for everyone else.
//! - `DISCARD ALL` / `DEALLOCATE ALL` / `DEALLOCATE name` in a simple query keep the maps right;
//!   so does the Execute of a portal bound from one of them ([`Statement::tracked`]), as
//!   psycopg sends them (see [`Planner::execute`]).
//! - `SET [SESSION | LOCAL] search_path` / `RESET search_path` (simple query or Execute) change
//!   the registry context of the client's next Parses (the same text means another statement
//!   under another search_path): a change lasts until its transaction ends, a session-level one
//!   stays if it commits and is then carried to the client's other servers like a startup
//!   setting ([`SearchPath`](crate::statements::SearchPath), [`carry_search_path`]).
//! - SQL-level `PREPARE name AS ...` statements are remembered per client (when their query
//!   completes) and prepared again on whichever server the client's next transaction runs
//!   ([`sync_sql_statements`], which also deallocates other clients' leftovers); one whose
//!   PREPARE fails there (a temporary table it reads is not there) stays the client's, its
//!   error standing for its EXECUTEs, and is prepared again before each use
//!   ([`Planner::sql_pending`]). They share the client's namespace with protocol-level names,
//!   as in PostgreSQL: SQL `EXECUTE`s and `DEALLOCATE`s protocol-level statements (a
//!   placeholder under the client's name on the server), the protocol binds, describes and
//!   closes SQL-level ones.
//! - Statement names `pgmemo_s<digits>` are pgmemo's on servers: SQL that names one (simple
//!   query, or the text of a Parse) reaches the server with the name hidden, an `EXECUTE` /
//!   `DEALLOCATE` of it failing with PostgreSQL's own 26000, a `PREPARE` of it refused
//!   (42939), where the statement runs ([`command::hide_reserved`]).
//! - Where PostgreSQL's answer depends on what is still in flight (an aborted block, a Parse
//!   that may fail), planning waits for those replies ([`Plan::Wait`]).
//!
//! Every map change is recorded as an [`Effect`] on the reply-queue entry of its message and
//! undone if PostgreSQL never runs that message (an earlier error in the batch). Errors that
//! pgmemo must report itself are raised *by the server* at the same place (a message that
//! cannot succeed), so PostgreSQL's own error-skip and transaction rules apply, and only the
//! error text is pgmemo's.
//!
//! In files by concern: this one holds the [`Planner`], its dispatch on the message type
//! ([`Planner::plan`]) and the helpers every part uses; `protocol.rs` the protocol-level
//! statements (Parse, Bind, Describe, Close, Sync), `sql.rs` the SQL-level ones (PREPARE,
//! EXECUTE, DEALLOCATE, DISCARD, SET search_path), `autoprepared.rs` simple queries run as
//! statements, and `settle.rs` what happens after the replies (effects kept or undone, the
//! retry after 0A000, the cleanup after Sync).

mod autoprepared;
mod protocol;
mod settle;
mod sql;

pub use settle::{settle, Cleanup, Retry};
pub use sql::{carry_search_path, sync_sql_statements};

use crate::params::Vars;
use crate::protocol::backend::{self as be, Severity};
use crate::protocol::frontend::{self as fe, Parse};
use crate::protocol::{put_cstr, write_message};
use crate::query::command;
use crate::query::words::query;
use crate::replies::{Action, Entry, ErrorRewrite, Expected, ReplyQueue};
use crate::server::ServerConn;
use crate::statements::{ClientStatements, Effect, Registry, Statement};
use crate::stats::LocalStats;
use bytes::{Bytes, BytesMut};
use std::sync::Arc;

/// A server-side name no statement ever has (a reserved name, see [`command::NOWHERE`]): a
/// message using it fails with 26000 exactly where pgmemo needs an error.
pub const MISSING_NAME: &[u8] = command::NOWHERE.as_bytes();

/// The per-client statement count limit is never below this, whatever the per-server limit.
pub const MIN_CLIENT_STATEMENTS: usize = 1000;

/// Per-client limits on statement names.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub max_count: usize,
    pub max_bytes: usize,
}

/// One planning step: the message and everything it may touch.
pub struct Planner<'a> {
    /// The client message being planned.
    pub message: Message<'a>,
    pub server: &'a mut ServerConn,
    pub stmts: &'a mut ClientStatements,
    pub replies: &'a mut ReplyQueue,
    pub registry: &'a Registry,
    pub stats: &'a mut LocalStats,
    /// The rest of the client's side that planning reads or changes.
    pub client: ClientContext<'a>,
}

/// The client message a [`Planner`] plans.
pub struct Message<'a> {
    /// The whole message, tag and length included.
    pub whole: &'a [u8],
    /// For a simple query: its text (None: malformed, or another message).
    pub text: Option<&'a [u8]>,
    /// For a simple query: the words its text contains (`words::in_query`, found once by
    /// the session).
    pub words: u32,
}

/// What a [`Planner`] borrows of the client's side besides its statements.
pub struct ClientContext<'a> {
    pub limits: Limits,
    /// Statement names to close on the server after the client's next Sync (see
    /// `Planner::duplicate_parse`).
    pub cleanup: &'a mut Cleanup,
    pub retry: &'a mut Retry,
    /// What the client's statements may do to its session (see `session::state`).
    pub state: &'a mut super::state::StateWatch,
    /// For a simple query of a client with autoprepare on.
    pub autoprepare: Option<crate::autoprepare::Use<'a>>,
    /// The shapes a client's prepared statements count their executions in (SHOW QUERIES).
    pub shapes: &'a crate::query::shapes::Shapes,
    /// The session's reading, where a Bind's execution timed on the server is kept until
    /// its ReadyForQuery (made when one is timed first). None for a simple query that may be
    /// autoprepared, which has the reading in `autoprepare`.
    pub timing: Option<&'a mut Option<Box<crate::query::Reader>>>,
    /// The client's reported parameters (its client_encoding, for a name that is not UTF-8).
    pub reported: &'a Vars,
}

/// What became of a client message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Plan {
    /// Planned: sent (as the server must see it) or answered locally.
    Done,
    /// Not the planner's business: the caller forwards it unchanged.
    Forward,
    /// What it needs depends on whether the session is in an aborted transaction block, which
    /// only the replies still in flight will tell: plan it again once they have arrived
    /// (pgmemo sends the server a Flush so that they do).
    Wait,
}

impl Planner<'_> {
    /// Plans the message.
    pub fn plan(mut self, tag: u8) -> Plan {
        // Planning reads the client's statements and the server's: wait until no reply still
        // to come can undo changes made to them by earlier units of work (pipelined past a
        // Sync, say, behind a Parse that may fail). Portals are not planned.
        let statement_target = || self.message.whole.get(5) == Some(&b'S');
        let reads_statements = match tag {
            fe::PARSE | fe::BIND | fe::QUERY => true,
            fe::DESCRIBE | fe::CLOSE => statement_target(),
            fe::EXECUTE => self.stmts.has_tracked_portals() && self.tracked_execute().is_some(),
            _ => false,
        };
        if reads_statements && self.replies.is_uncertain() {
            return Plan::Wait;
        }
        if !self.server.prepared.sql_settled() && self.names_sql_statement(tag) {
            // Whether the server has the client's SQL-level statement it names is not known
            // until the PREPARE of it in flight is answered (see `sync_sql_statements`).
            return Plan::Wait;
        }
        if tag == fe::PARSE && self.stmts.search_path.is_open() && !self.state_known() {
            // The search_path a SET changed in the open transaction, which replies still to
            // come may end (and the change with it): the Parse's key is not known yet.
            return Plan::Wait;
        }
        // Only a transaction block can be aborted: the guard is prepared on a server the
        // first time pgmemo plans a message in one, or one that may open one. (Not while an
        // earlier DISCARD ALL may yet fail: the server's statements are not known then.)
        // The words of a simple query that matter here.
        let words = if tag == fe::QUERY {
            let mut wanted = Words::PREPARE
                | Words::DEALLOCATE
                | Words::DISCARD
                | Words::SEARCH_PATH
                | Words::PGMEMO_S;
            if !self.stmts.is_empty() || !self.stmts.sql.is_empty() {
                wanted |= Words::EXECUTE;
            }
            if !self.server.prepared.has_guard() && self.server.status != b'T' {
                wanted |= Words::BEGIN | Words::START;
            }
            self.message.words & wanted
        } else {
            0
        };
        if !self.server.prepared.has_guard()
            && (self.server.status == b'T' || self.may_open_block(tag, words))
        {
            self.prepare_guard();
        }
        let planned = match tag {
            fe::PARSE => self.parse(),
            fe::BIND => return self.bind(),
            fe::DESCRIBE => return self.describe(),
            fe::CLOSE => self.close(),
            fe::QUERY => return self.query(words),
            fe::EXECUTE if self.stmts.has_tracked_portals() => return self.execute(),
            fe::SYNC => self.sync(),
            _ => false,
        };
        if planned {
            Plan::Done
        } else {
            Plan::Forward
        }
    }

    fn body(&self) -> &[u8] {
        crate::protocol::body(self.message.whole)
    }

    /// Whether the Parse, Bind, Describe or Close being planned names one of the client's
    /// SQL-level statements. (A simple query's are read where it is planned.)
    fn names_sql_statement(&self, tag: u8) -> bool {
        if self.stmts.sql.is_empty() {
            return false;
        }
        let body = self.body();
        let name = match tag {
            fe::PARSE => Parse::parse(body).map(|p| p.name),
            fe::BIND => fe::Bind::parse(body).map(|b| b.statement),
            fe::DESCRIBE | fe::CLOSE => fe::Target::parse(body)
                .filter(|t| t.kind == b'S')
                .map(|t| t.name),
            _ => None,
        };
        name.is_some_and(|name| self.stmts.is_sql(name))
    }

    /// Whether the session may be in an aborted transaction block when the message being
    /// planned runs: it is (the last ReadyForQuery said so), or something still in flight
    /// may leave it so (see [`Planner::state_known`]).
    fn may_be_aborted(&self) -> bool {
        self.server.status == b'E' || !self.state_known()
    }

    /// A Bind or Describe naming a statement the client does not have. Sent under a name no
    /// server has, so PostgreSQL itself fails it (26000, with its skip-to-Sync and transaction
    /// rules); the error names the client's statement. Never sent under the client's own name:
    /// on a shared server that name might be someone else's SQL-level statement.
    fn unknown_statement(
        &mut self,
        name: &[u8],
        expected: Expected,
        encode: impl FnOnce(&mut BytesMut, &[u8]),
    ) -> Plan {
        if name.is_empty() || self.stmts.is_sql(name) {
            // pgmemo never leaves an unnamed statement on a server: PostgreSQL's own answer
            // ("unnamed prepared statement does not exist") is the right one. A SQL-level
            // statement of the client is on the server under the client's name.
            return Plan::Forward;
        }
        // A name that is not UTF-8 fails PostgreSQL's encoding check before the lookup
        // (22021, quoting the bad bytes): sent after the reserved name, the server checks the
        // same bytes (and a database that takes any byte still names the client's statement).
        let missing = if std::str::from_utf8(name).is_ok() {
            Bytes::from_static(MISSING_NAME)
        } else {
            Bytes::from([MISSING_NAME, name].concat())
        };
        encode(&mut self.server.wbuf, &missing);
        self.replies.push_entry(Entry {
            expected,
            action: Action::replace_error(ErrorRewrite::Rename {
                from: missing,
                to: Bytes::copy_from_slice(name),
            }),
            effect: None,
        });
        Plan::Done
    }

    /// Makes the server fail at this point with pgmemo's own error.
    fn fail_here(&mut self, expected: Expected, code: &str, message: &str) {
        let mut error = BytesMut::new();
        be::error_response(&mut error, Severity::Error, code, message);
        self.fail_here_with(expected, error.freeze());
    }

    /// Makes the server fail at this point, showing `error` (a whole ErrorResponse).
    fn fail_here_with(&mut self, expected: Expected, error: Bytes) {
        write_message(&mut self.server.wbuf, fe::DESCRIBE, |m| {
            m.extend_from_slice(b"S");
            put_cstr(m, MISSING_NAME);
        });
        self.replies.push_entry(Entry {
            expected,
            action: Action::replace_error(ErrorRewrite::Whole(error)),
            effect: None,
        });
    }

    /// Whether the message may open a transaction block: a simple query that mentions BEGIN
    /// or START (a cheap, generous test), a Parse of BEGIN or START TRANSACTION.
    fn may_open_block(&self, tag: u8, words: u32) -> bool {
        match tag {
            fe::QUERY => words & (Words::BEGIN | Words::START) != 0,
            // (A look at the query's first bytes first, past the statement name: a Parse is
            // planned per query.)
            fe::PARSE => {
                let body = self.body();
                crate::protocol::nul_at(body)
                    .is_some_and(|name_end| Words::may_start_transaction(&body[name_end + 1..]))
                    && Parse::parse(body)
                        .and_then(|p| std::str::from_utf8(p.query).ok())
                        .is_some_and(|text| {
                            command::classify_statement(text).is_transaction_start()
                        })
            }
            // A Bind of BEGIN: see bind().
            _ => false,
        }
    }

    /// Closes the least recently used statement on the server to make room, and counts it.
    fn evict(&mut self, victim: Arc<Statement>) {
        let generation = self
            .server
            .prepared
            .generation_of(&victim)
            .unwrap_or_default();
        victim
            .evictions
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.stats.prepare_evictions += 1;
        self.write_close(victim, generation);
    }

    /// For a Bind or Describe of `statement`: whether it runs in an aborted transaction block
    /// on a server that lacks the statement (PostgreSQL would refuse it in Bind or Describe,
    /// but a Parse injected first would be refused in Parse), or None when that is not known
    /// yet. Only asked when it matters: the server lacks the statement, it is not COMMIT,
    /// ROLLBACK or the like (PostgreSQL parses and runs those in an aborted block), and the
    /// guard is there to answer with.
    fn in_aborted_block(&mut self, statement: &Statement) -> Option<bool> {
        if statement.ends_transaction
            || !self.server.prepared.has_guard()
            || self.server.prepared.has_current(statement)
        {
            return Some(false);
        }
        self.state_known().then_some(self.server.aborted())
    }

    /// Whether the transaction state the message being planned runs in is the one the last
    /// ReadyForQuery reported. In a transaction block anything still in flight may change it
    /// (an error aborts the block, an Execute of ROLLBACK ends it); outside one, only a
    /// simple query, or a batch that binds a `BEGIN` and ends before this message, can open a
    /// block and fail in it before this message (an error in this message's own batch makes
    /// PostgreSQL skip this message anyway).
    fn state_known(&self) -> bool {
        match self.server.status {
            b'I' => !self.replies.has_pending_query() && !self.replies.may_have_opened_block(),
            _ => !self.replies.may_change_transaction(),
        }
    }

    /// Whether the message being planned certainly runs in an aborted transaction block.
    fn certainly_aborted(&self) -> bool {
        self.server.aborted() && self.state_known()
    }

    /// Whether the Bind being planned is the first statement of an implicit
    /// transaction, so that its batch can be sent again if it fails with 0A000 ("cached plan
    /// must not change result type") — nothing of the batch has run yet. If so, the session
    /// keeps the client's messages from here to the batch's Sync ([`Retry`]).
    fn retry_point(&mut self) -> bool {
        let first = self.server.status == b'I'
            && !self.server.completed_since_ready
            && self.client.retry.can_start()
            && !self.replies.has_pending_work();
        if first {
            self.client.retry.start();
        }
        first
    }

    /// Injects the statement's Parse unless the server has a current copy.
    #[inline]
    fn ensure_prepared(&mut self, statement: &Arc<Statement>) {
        if self.server.prepared.has_current(statement) {
            self.stats.prepare_cache_hit += 1;
            return;
        }
        self.parse_here(statement);
    }

    /// Parses `statement` on the server under its name (a prepare-cache miss), its
    /// ParseComplete swallowed and the server's record of it kept when it comes.
    fn parse_here(&mut self, statement: &Arc<Statement>) {
        self.stats.prepare_cache_miss += 1;
        self.write_parse(statement);
        self.replies.push_entry(Entry {
            expected: Expected::Parse,
            action: Action::Skip,
            effect: Some(Effect::Prepared(statement.clone())),
        });
    }

    /// Writes the statement's Parse, after closing a stale copy and making room in the LRU.
    /// The caller queues the Parse's entry.
    fn write_parse(&mut self, statement: &Arc<Statement>) {
        if let Some(generation) = self.server.prepared.generation_of(statement) {
            // A copy from before a DDL change: replace it.
            self.write_close(statement.clone(), generation);
        }
        while let Some(victim) = self.server.prepared.victim(statement) {
            self.evict(victim);
        }
        self.server
            .wbuf
            .extend_from_slice(statement.parse_message());
        self.server.prepared.insert(statement.clone());
    }

    fn write_close(&mut self, statement: Arc<Statement>, generation: u32) {
        statement.encode_close(&mut self.server.wbuf);
        self.server.prepared.remove(&statement);
        self.replies.push_entry(Entry {
            expected: Expected::Close,
            action: Action::Skip,
            effect: Some(Effect::Closed {
                statement,
                generation,
            }),
        });
    }
}

/// Which of the words that matter to the planner a simple query contains, in any case: a
/// cheap and generous test run on every simple query (`command::classify` decides what the query
/// really does). Bits of `words::in_query`'s answer.
struct Words;

impl Words {
    const BEGIN: u32 = query::BEGIN;
    const START: u32 = query::START;
    const PREPARE: u32 = query::PREPARE;
    const DEALLOCATE: u32 = query::DEALLOCATE;
    const DISCARD: u32 = query::DISCARD;
    const EXECUTE: u32 = query::EXECUTE;
    const SEARCH_PATH: u32 = query::SEARCH_PATH;
    /// A reserved statement name may follow (see `command::hide_reserved`).
    const PGMEMO_S: u32 = query::PGMEMO_S;

    /// Which of the `wanted` words `text` contains (a set of the bits above).
    #[cfg(test)]
    fn found_in(text: &[u8], wanted: u32) -> u32 {
        query::WORDS.found_in(text, wanted)
    }

    /// Whether a statement's text may begin with BEGIN or START (after blanks or a comment):
    /// a look at its first bytes (`st`, not the `se` of every SELECT), before the exact check.
    fn may_start_transaction(text: &[u8]) -> bool {
        let Some(at) = text.iter().position(|c| !c.is_ascii_whitespace()) else {
            return false;
        };
        match text[at] {
            b'b' | b'B' | b'-' | b'/' => true,
            b's' | b'S' => matches!(text.get(at + 1), Some(b't' | b'T')),
            _ => false,
        }
    }
}

#[cfg(test)]
mod words_tests {
    use super::Words;

    #[test]
    fn finds_each_word_in_any_case_anywhere() {
        let all = 0xff_u32;
        let text = b"select 1; BEGIN; Prepare p AS select 1; dEaLlOcAtE p";
        assert_eq!(
            Words::found_in(text, all),
            Words::BEGIN | Words::PREPARE | Words::DEALLOCATE
        );
        assert_eq!(
            Words::found_in(text, Words::START | Words::BEGIN),
            Words::BEGIN
        );
        assert_eq!(Words::found_in(b"xdiscard", all), 0);
        assert_eq!(Words::found_in(b"1;discard", all), Words::DISCARD);
        assert_eq!(Words::found_in(b"/**/Discard", all), Words::DISCARD);
        assert_eq!(Words::found_in(b"(begin", all), Words::BEGIN);
        assert_eq!(Words::found_in(b"dd START", all), Words::START);
        assert_eq!(Words::found_in(b"EXECUTE q", all), Words::EXECUTE);
        assert_eq!(Words::found_in(b"EXECUTE q", Words::BEGIN), 0);
        assert_eq!(
            Words::found_in(b"set local SEARCH_PATH = a", all),
            Words::SEARCH_PATH
        );
        let pgbench = b"SELECT abalance FROM pgbench_accounts WHERE aid = 1;";
        assert_eq!(Words::found_in(pgbench, all), 0);
        assert_eq!(Words::found_in(b"begi", all), 0);
        assert_eq!(Words::found_in(b"", all), 0);
        assert_eq!(
            Words::found_in(b"DEALLOCATE \"PGMEMO_S1\"", Words::PGMEMO_S),
            Words::PGMEMO_S
        );
    }
}
