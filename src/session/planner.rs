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
//!   ([`sync_sql_statements`], which also deallocates other clients' leftovers); they share
//!   the client's namespace with protocol-level names, as in PostgreSQL.
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

use crate::params::Vars;
use crate::protocol::backend::{self as be, sqlstate, Severity};
use crate::protocol::frontend::{self as fe, Bind, Parse, Target};
use crate::protocol::{pg_name, put_cstr, write_message};
use crate::query::command::{self, Command};
use crate::query::words::query;
use crate::replies::{Action, Entry, ErrorRewrite, Expected, Outcome, ReplyQueue, Synth};
use crate::server::ServerConn;
use crate::statements::{
    ClientStatements, Effect, Registry, ResetSnapshot, SqlCommands, SqlSnapshot, Statement,
    GUARD_NAME, GUARD_QUERY,
};
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
    /// The whole message, tag and length included.
    pub msg: &'a [u8],
    /// For a simple query: its text (None: malformed, or another message).
    pub query_text: Option<&'a [u8]>,
    pub server: &'a mut ServerConn,
    pub stmts: &'a mut ClientStatements,
    pub replies: &'a mut ReplyQueue,
    pub registry: &'a Registry,
    pub stats: &'a mut LocalStats,
    pub limits: Limits,
    /// Statement names to close on the server after the client's next Sync (see
    /// `Planner::duplicate_parse`).
    pub cleanup: &'a mut Cleanup,
    pub retry: &'a mut Retry,
    /// For a simple query: the words its text contains (`words::in_query`, found once by
    /// the session).
    pub query_words: u32,
    /// What the client's statements may do to its session (see `session::state`).
    pub state: &'a mut super::state::StateWatch,
    /// For a simple query of a client with autoprepare on.
    pub autoprepare: Option<crate::autoprepare::Use<'a>>,
    /// The client's reported parameters (its client_encoding, for a name that is not UTF-8).
    pub reported: &'a Vars,
}

/// The client's batch from its first statement to its Sync, kept while it runs, so that it can
/// be sent again once, transparently, when that first statement of an implicit transaction
/// fails with 0A000 ("cached plan must not change result type": a table's columns changed
/// since the statement was prepared). Nothing of the batch has run then: pgmemo swallows the
/// error and the batch's ReadyForQuery, and plans the kept messages again, which prepares
/// the statement afresh.
///
/// Only when the batch describes its portal before executing it (as libpq does): the client
/// then reads the new rows by the new RowDescription. A client that decodes rows by a
/// description it cached earlier must see the 0A000, as PostgreSQL gives it, or it would
/// read the new columns by the old description. Elsewhere too (in a transaction block,
/// after a statement already ran, behind further pipelined work) the client gets the error.
#[derive(Debug, Default)]
pub struct Retry {
    /// Keeping the client's messages (from a retry point on).
    capturing: bool,
    /// They reach the batch's Sync: the batch can be sent again.
    complete: bool,
    bytes: BytesMut,
    /// The first bytes of the client's input are a batch sent again: not again.
    replaying: usize,
    /// The 0A000 was swallowed: so is the batch's ReadyForQuery, then the batch goes again.
    pending: bool,
    /// The kept messages describe a portal before any Execute.
    describes: bool,
    /// The kept messages have an Execute.
    executes: bool,
    /// What is kept is one simple query, run as an autoprepared statement: complete once
    /// it is kept.
    query: bool,
}

/// A larger batch is not kept (its first statement's 0A000 reaches the client).
const MAX_RETRY_BYTES: usize = 1 << 20;

/// Statement names a duplicate Parse left on the server, closed after the client's next Sync
/// (see `Planner::duplicate_parse`). Boxed once there are any: rare, and every session holds
/// one (8 bytes, where a Vec takes 24).
#[derive(Default)]
#[allow(clippy::box_collection)]
pub struct Cleanup(Option<Box<Vec<Box<[u8]>>>>);

impl Cleanup {
    fn push(&mut self, name: Box<[u8]>) {
        self.0.get_or_insert_with(Default::default).push(name);
    }

    /// Whether one of the names is `name` as PostgreSQL reads it (truncated).
    fn holds(&self, name: &[u8]) -> bool {
        self.0
            .as_ref()
            .is_some_and(|names| names.iter().any(|n| pg_name(n) == name))
    }

    /// The names, leaving none.
    fn take(&mut self) -> Option<Vec<Box<[u8]>>> {
        self.0.take().map(|names| *names)
    }
}

impl Retry {
    fn can_start(&self) -> bool {
        !self.capturing && self.replaying == 0 && !self.pending
    }

    fn start(&mut self) {
        self.capturing = true;
    }

    /// Keeps the simple query being planned, which runs as an autoprepared statement (its
    /// portal described before it executes).
    fn start_query(&mut self) {
        self.capturing = true;
        self.query = true;
        self.describes = true;
    }

    /// The session consumed this client message (planned or forwarded).
    pub fn consumed(&mut self, msg: &[u8]) {
        self.replaying = self.replaying.saturating_sub(msg.len());
        if !self.capturing || self.complete {
            return;
        }
        if self.bytes.len() + msg.len() > MAX_RETRY_BYTES {
            self.forget();
            return;
        }
        self.bytes.extend_from_slice(msg);
        match msg.first() {
            Some(&fe::SYNC) => self.complete = true,
            Some(&fe::QUERY) if self.query => self.complete = true,
            Some(&fe::EXECUTE) => self.executes = true,
            Some(&fe::DESCRIBE) if msg.get(5) == Some(&b'P') && !self.executes => {
                self.describes = true
            }
            _ => {}
        }
    }

    /// Whether an error now may be the retry point's 0A000 with the whole batch kept.
    pub fn is_armed(&self) -> bool {
        self.complete && self.describes && !self.pending
    }

    /// The batch ended (or cannot be sent again): forget it.
    pub fn forget(&mut self) {
        self.capturing = false;
        self.complete = false;
        self.describes = false;
        self.executes = false;
        self.query = false;
        self.bytes.clear();
    }

    /// The 0A000 was swallowed; the batch's ReadyForQuery must be too.
    pub fn swallow_ready(&mut self) {
        self.pending = true;
    }

    pub fn is_pending(&self) -> bool {
        self.pending
    }

    /// The batch's ReadyForQuery arrived: the batch to plan again, before anything else the
    /// client sent.
    pub fn replay(&mut self) -> BytesMut {
        self.pending = false;
        let bytes = std::mem::take(&mut self.bytes);
        self.forget();
        self.replaying = bytes.len();
        bytes
    }
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
        let statement_target = || self.msg.get(5) == Some(&b'S');
        let reads_statements = match tag {
            fe::PARSE | fe::BIND | fe::QUERY => true,
            fe::DESCRIBE | fe::CLOSE => statement_target(),
            fe::EXECUTE => self.stmts.has_tracked_portals() && self.tracked_execute().is_some(),
            _ => false,
        };
        if reads_statements && self.replies.is_uncertain() {
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
            if !self.stmts.is_empty() {
                wanted |= Words::EXECUTE;
            }
            if !self.server.prepared.has_guard() && self.server.status != b'T' {
                wanted |= Words::BEGIN | Words::START;
            }
            self.query_words & wanted
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
        &self.msg[5..]
    }

    fn parse(&mut self) -> bool {
        let msg = self.msg;
        // A malformed Parse goes to the server as is, for PostgreSQL's own error.
        let Some(p) = Parse::parse(&msg[5..]) else {
            return false;
        };
        if std::str::from_utf8(p.name).is_err() && self.reported.is("client_encoding", "UTF8") {
            // PostgreSQL refuses the name before it reads the rest (22021, quoting the bad
            // bytes) and creates nothing: the Parse goes as it is, for that error.
            return false;
        }
        if self.stmts.is_sql(p.name) {
            // The name of one of the client's SQL-level statements, which the server has
            // under that name: PostgreSQL's own 42P05 (after its checks of the query).
            return false;
        }
        if !p.name.is_empty() && self.stmts.get(p.name).is_some() {
            return self.duplicate_parse(p.name);
        }
        if !p.name.is_empty()
            && (self.stmts.len() >= self.limits.max_count
                || self.stmts.bytes() + p.query.len() > self.limits.max_bytes)
        {
            let message = format!(
                "pgmemo: too many prepared statements for this client (limits: {} statements, {} bytes of query text)",
                self.limits.max_count, self.limits.max_bytes
            );
            self.fail_here(Expected::Parse, sqlstate::PROGRAM_LIMIT_EXCEEDED, &message);
            return true;
        }
        let statement = self.stmts.statement_for_parse(self.registry, &p);
        // Send the Parse only when PostgreSQL has never accepted this statement: an invalid
        // one must fail here, as it would without pgmemo. Otherwise the server gets it when it
        // is first used.
        let must_parse = !statement.is_validated() && !self.server.prepared.has_current(&statement);
        if !must_parse && self.may_be_aborted() {
            return self.probe_parse(p.name, statement);
        }
        let previous = self.stmts.set(p.name, Some(statement.clone()));
        let effect = Effect::Bound {
            name: p.name.into(),
            previous,
            statement: statement.clone(),
            prepared_here: must_parse,
        };
        if must_parse {
            self.stats.prepare_cache_miss += 1;
            self.write_parse(&statement);
            self.replies.push_entry(Entry {
                expected: Expected::Parse,
                action: renaming_errors(&statement, Bytes::copy_from_slice(p.name)),
                effect: Some(effect),
            });
        } else {
            statement
                .parse_hits
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            self.replies.push_entry(Entry {
                expected: Expected::Parse,
                action: Action::Synthesize(Synth::ParseComplete),
                effect: Some(effect),
            });
        }
        true
    }

    /// A Parse pgmemo would answer itself, but the session may be in an aborted transaction
    /// block, where PostgreSQL refuses every Parse (25P02) except of COMMIT, ROLLBACK and the
    /// like. The server decides: it gets the client's Parse under the unnamed name (pgmemo
    /// never keeps an unnamed statement on a server, so nothing is lost), followed by a Close
    /// of it; the client's name is bound only if the Parse succeeds.
    fn probe_parse(&mut self, name: &[u8], statement: Arc<Statement>) -> bool {
        let p = Parse::parse(&self.msg[5..]).expect("parsed by the caller");
        p.encode(b"", &mut self.server.wbuf);
        let previous = self.stmts.set(name, Some(statement.clone()));
        self.replies.push_entry(Entry {
            expected: Expected::Parse,
            action: Action::Forward,
            effect: Some(Effect::Bound {
                name: name.into(),
                previous,
                statement,
                prepared_here: false,
            }),
        });
        write_message(&mut self.server.wbuf, fe::CLOSE, |m| {
            m.extend_from_slice(b"S");
            put_cstr(m, b"");
        });
        self.replies.push_entry(Entry {
            expected: Expected::Close,
            action: Action::Skip,
            effect: None,
        });
        true
    }

    /// Whether the session may be in an aborted transaction block when the message being
    /// planned runs: it is (the last ReadyForQuery said so), or something still in flight
    /// may leave it so (see [`Planner::state_known`]).
    fn may_be_aborted(&self) -> bool {
        self.server.status == b'E' || !self.state_known()
    }

    /// A Parse of a name the client already has. PostgreSQL answers 42P05 — after checking
    /// the query, so a bad query gets its syntax error instead. The server is made to give that
    /// exact answer: the client's Parse is sent twice under the client's name (the first
    /// swallowed), and the name is closed again after the client's next Sync.
    fn duplicate_parse(&mut self, name: &[u8]) -> bool {
        if self.server.prepared.has_server_name(name) {
            // The name is one of pgmemo's own on this server: PostgreSQL already answers 42P05.
            return false;
        }
        self.server.wbuf.extend_from_slice(self.msg);
        self.replies.push_entry(Entry {
            expected: Expected::Parse,
            action: Action::Skip,
            effect: None,
        });
        self.server.wbuf.extend_from_slice(self.msg);
        self.replies.push(Expected::Parse);
        self.cleanup.push(name.into());
        true
    }

    fn bind(&mut self) -> Plan {
        let msg = self.msg;
        let Some(b) = Bind::parse(&msg[5..]) else {
            return Plan::Forward;
        };
        if self.stmts.has_tracked_portals() {
            self.stmts.forget_portal(b.portal);
        }
        let Some((client_name, statement)) = self
            .stmts
            .get_named(b.statement)
            .map(|(n, s)| (n.clone(), s.clone()))
        else {
            return self.unknown_statement(b.statement, Expected::Bind, |out, name| {
                write_message(out, fe::BIND, |m| {
                    put_cstr(m, b.portal);
                    put_cstr(m, name);
                    m.extend_from_slice(b.rest);
                })
            });
        };
        match self.in_aborted_block(&statement) {
            None => return Plan::Wait,
            Some(true) => {
                self.refuse_bind(&b, &statement);
                return Plan::Done;
            }
            Some(false) => {}
        }
        self.state.note(statement.session_touch);
        self.state.note_calls(&statement.key.query);
        if statement.session_touch.custom {
            self.state.note_custom(&statement.custom_settings);
        }
        self.stmts.schema.note(statement.ddl);
        if self.stmts.is_stale(b.statement) {
            // The client prepared this before a DDL change of its result type and may decode
            // rows by the description it got then: PostgreSQL keeps refusing such a statement
            // until the client prepares it again, and so does pgmemo (even on a server that
            // would happily prepare the new shape).
            match statement.stale_error() {
                Some(genuine) => self.fail_here_with(Expected::Bind, genuine),
                None => self.fail_here(
                    Expected::Bind,
                    "0A000",
                    "cached plan must not change result type",
                ),
            }
            return Plan::Done;
        }
        if statement.starts_transaction && !self.server.prepared.has_guard() {
            self.prepare_guard();
        }
        if statement.tracked.is_some() {
            self.stmts.bind_tracked_portal(b.portal, statement.clone());
        }
        let retry = self.retry_point();
        self.forward_renamed(statement, client_name, Expected::Bind, retry, |m, name| {
            put_cstr(m, b.portal);
            put_cstr(m, name);
            m.extend_from_slice(b.rest);
        })
    }

    /// Sends a Bind or Describe under the statement's server name, preparing it there first
    /// if needed; errors that name it are shown with the client's name.
    fn forward_renamed(
        &mut self,
        statement: Arc<Statement>,
        client_name: Bytes,
        expected: Expected,
        retry: bool,
        body: impl FnOnce(&mut BytesMut, &[u8]),
    ) -> Plan {
        self.ensure_prepared(&statement);
        let generation = statement.generation();
        let tag = if expected == Expected::Bind {
            fe::BIND
        } else {
            fe::DESCRIBE
        };
        write_message(&mut self.server.wbuf, tag, |m| {
            body(m, statement.server_name.as_bytes())
        });
        self.replies.push_entry(Entry {
            expected,
            action: renaming_errors(&statement, client_name),
            effect: Some(Effect::Uses {
                statement,
                generation,
                retry,
            }),
        });
        Plan::Done
    }

    /// A Bind that PostgreSQL would refuse in an aborted transaction block, of a statement
    /// the server lacks. The server refuses it too, binding the guard (see [`GUARD_NAME`]):
    /// with no parameters for 25P02, or, when the client's parameter count is wrong (which
    /// PostgreSQL checks first), with a wrong count for the guard, the error's message then
    /// being PostgreSQL's message about the client's statement.
    fn refuse_bind(&mut self, b: &Bind, statement: &Statement) {
        let supplied = bind_param_count(b.rest);
        let required = statement.param_count;
        let rewrite = (supplied != Some(required)).then(|| {
            let supplied = supplied.unwrap_or_default();
            ErrorRewrite::Message(Bytes::from(format!(
                "bind message supplies {supplied} parameters, but prepared statement \"{}\" requires {required}",
                String::from_utf8_lossy(b.statement)
            )))
        });
        write_message(&mut self.server.wbuf, fe::BIND, |m| {
            put_cstr(m, b.portal);
            put_cstr(m, GUARD_NAME);
            if rewrite.is_some() {
                // Formats none, one NULL value: "supplies 1 parameters, but ... requires 0".
                m.extend_from_slice(&[0, 0, 0, 1, 0xff, 0xff, 0xff, 0xff, 0, 0]);
            } else {
                m.extend_from_slice(&[0, 0, 0, 0, 0, 0]); // no formats, values, results
            }
        });
        self.replies.push_entry(Entry {
            expected: Expected::Bind,
            action: match rewrite {
                Some(rewrite) => Action::replace_error(rewrite),
                None => Action::Forward,
            },
            effect: None,
        });
    }

    fn describe(&mut self) -> Plan {
        let msg = self.msg;
        let Some(t) = Target::parse(&msg[5..]) else {
            return Plan::Forward;
        };
        if t.kind != b'S' {
            return Plan::Forward; // portals are per transaction: their names pass through
        }
        let Some((client_name, statement)) = self
            .stmts
            .get_named(t.name)
            .map(|(n, s)| (n.clone(), s.clone()))
        else {
            return self.unknown_statement(t.name, Expected::Describe, |out, name| {
                write_message(out, fe::DESCRIBE, |m| {
                    m.extend_from_slice(b"S");
                    put_cstr(m, name);
                })
            });
        };
        match self.in_aborted_block(&statement) {
            None => return Plan::Wait,
            Some(true) if statement.tracked.is_some() => {
                // PostgreSQL describes a statement that returns no rows (DISCARD ALL,
                // DEALLOCATE) in an aborted block too: its declared parameters, no row.
                let mut replies = BytesMut::new();
                write_message(&mut replies, be::PARAMETER_DESCRIPTION, |m| {
                    m.extend_from_slice(&statement.key.param_types)
                });
                write_message(&mut replies, be::NO_DATA, |_| {});
                self.replies.push_entry(Entry {
                    expected: Expected::Describe,
                    action: Action::Synthesize(Synth::Replies(Box::new(replies.freeze()))),
                    effect: None,
                });
                return Plan::Done;
            }
            Some(true) => {
                // PostgreSQL refuses to describe a statement that returns rows (25P02): so
                // does the server, describing the guard.
                write_message(&mut self.server.wbuf, fe::DESCRIBE, |m| {
                    m.extend_from_slice(b"S");
                    put_cstr(m, GUARD_NAME);
                });
                self.replies.push(Expected::Describe);
                return Plan::Done;
            }
            Some(false) => {}
        }
        // Not a retry point: PostgreSQL sends the ParameterDescription before it finds out
        // that the result type changed.
        let retry = false;
        // PostgreSQL describes the statement as it is now and accepts it afterwards: a client
        // that asked knows the new shape.
        self.stmts.refresh(&statement);
        self.forward_renamed(
            statement,
            client_name,
            Expected::Describe,
            retry,
            |m, name| {
                m.extend_from_slice(b"S");
                put_cstr(m, name);
            },
        )
    }

    fn close(&mut self) -> bool {
        let msg = self.msg;
        let Some(t) = Target::parse(&msg[5..]) else {
            return false;
        };
        if t.kind != b'S' {
            if self.stmts.has_tracked_portals() {
                self.stmts.forget_portal(t.name);
            }
            return false;
        }
        if self.stmts.is_sql(t.name) {
            // A SQL-level statement: it is on the server under the client's name.
            let name = String::from_utf8_lossy(pg_name(t.name)).into_owned();
            let text = self.stmts.sql.remove(&name).unwrap_or_default();
            self.server.prepared.sql.remove(&name);
            self.server.wbuf.extend_from_slice(msg);
            self.replies.push_entry(Entry {
                expected: Expected::Close,
                action: Action::Forward,
                effect: Some(Effect::SqlClosed(Box::new((name, text)))),
            });
            return true;
        }
        // Closing an unknown name is not an error in PostgreSQL.
        let effect = self
            .stmts
            .set(t.name, None)
            .map(|statement| Effect::Unbound {
                name: t.name.into(),
                statement,
            });
        self.replies.push_entry(Entry {
            expected: Expected::Close,
            action: Action::Synthesize(Synth::CloseComplete),
            effect,
        });
        true
    }

    /// The tracked statement ([`Statement::tracked`]) the portal of the Execute being
    /// planned was bound from, if any.
    fn tracked_execute(&self) -> Option<Arc<Statement>> {
        let x = fe::Execute::parse(self.body())?;
        self.stmts.tracked_portal(x.portal).cloned()
    }

    /// An Execute of a portal bound from `DISCARD ALL`, `DEALLOCATE ALL` or `DEALLOCATE name`
    /// (psycopg sends them so). The server runs it; the client's statements (and the server's
    /// set) change as PostgreSQL's would, at once for whatever is planned after it, and are
    /// restored if it fails or is discarded. Whether it fails is PostgreSQL's decision (DISCARD
    /// ALL in a transaction block or a pipeline, an aborted block, a portal that is gone).
    fn execute(&mut self) -> Plan {
        let Some(command) = self.tracked_execute().and_then(|s| s.tracked.clone()) else {
            return Plan::Forward;
        };
        let plan = match command {
            Command::DiscardAll | Command::DeallocateAll => {
                // Every named statement, pgmemo's on the server too (the guard included); the
                // unnamed one stays.
                let snapshot = ResetSnapshot {
                    names: self.stmts.take_named(),
                    prepared: self.server.prepared.snapshot(),
                    guard: self.server.prepared.has_guard(),
                    sole_command: true,
                    discard_all: command == Command::DiscardAll,
                    sql: Some(Box::new(SqlSnapshot {
                        client: std::mem::take(&mut self.stmts.sql),
                        server: std::mem::take(&mut self.server.prepared.sql),
                    })),
                };
                self.server.prepared.clear();
                self.forward_execute(Some(Effect::Reset(Box::new(snapshot))));
                Plan::Done
            }
            Command::Deallocate { name } => self.execute_deallocate(name.as_bytes()),
            // Of a reserved name (see `Statement::hidden`): the server runs it naming
            // `pgmemo_s`, which it does not have.
            Command::Execute { name } => {
                self.forward_execute_with(None, missing_as(&name));
                Plan::Done
            }
            Command::Prepare { name, .. } => {
                self.forward_execute_with(None, refusing(&name));
                Plan::Done
            }
            Command::SetSearchPath { value, local } => {
                // Statements parsed after it are keyed by the new search_path.
                let before = crate::statements::SearchPath::clone(&self.stmts.search_path);
                self.stmts.search_path.set(value.as_deref(), local);
                self.forward_execute(Some(Effect::SearchPathSet(Box::new(before))));
                Plan::Done
            }
            _ => Plan::Forward,
        };
        // Its command runs to completion at once: an Execute of it again fails on the server
        // (55000, "portal cannot be run"), as it would on PostgreSQL. (If this Execute does not
        // run, the portal is gone or failed with its transaction anyway.)
        if plan != Plan::Wait {
            let msg = self.msg;
            if let Some(x) = fe::Execute::parse(&msg[5..]) {
                self.stmts.forget_portal(x.portal);
            }
        }
        plan
    }

    /// The Execute of `DEALLOCATE name`: the server runs it, and must find a statement under
    /// that name exactly when PostgreSQL would (the client has one).
    fn execute_deallocate(&mut self, name: &[u8]) -> Plan {
        if !self.state_known() {
            return Plan::Wait;
        }
        if self.server.status == b'E' {
            // In an aborted block the server refuses it (25P02), as PostgreSQL would.
            return Plan::Forward;
        }
        let name = pg_name(name);
        if self.stmts.is_sql(name) {
            // A SQL-level statement: on the server under the client's name.
            let name = String::from_utf8_lossy(name).into_owned();
            let text = self.stmts.sql.remove(&name).unwrap_or_default();
            self.server.prepared.sql.remove(&name);
            self.forward_execute(Some(Effect::SqlDeallocated(Box::new((name, text)))));
            return Plan::Done;
        }
        // Something of pgmemo's has this name on the server: its own statement (a client may
        // name one `pgmemo_s<n>`), or what a duplicate Parse left until the next Sync.
        let own = self.server.prepared.by_server_name(name);
        let taken = own.is_some()
            || (name == GUARD_NAME && self.server.prepared.has_guard())
            || self.cleanup.holds(name);
        match self.stmts.set(name, None) {
            Some(statement) => {
                let mut effect = Effect::Deallocated {
                    name: name.into(),
                    statement,
                };
                if let Some((own, generation)) = own {
                    // The DEALLOCATE drops pgmemo's copy: it is not there for what follows.
                    self.server.prepared.remove(&own);
                    let closed = Effect::Closed {
                        statement: own,
                        generation,
                    };
                    effect = Effect::Both(Box::new((closed, effect)));
                } else if name == GUARD_NAME {
                    self.server.prepared.set_guard(false);
                } else if !taken {
                    // The client's statement is on the server under pgmemo's name: a
                    // placeholder under the client's name is what the DEALLOCATE drops. Closed
                    // after the client's next Sync in case the Execute does not run.
                    self.parse_guard_query(name, Action::Skip, None);
                    self.cleanup.push(name.into());
                }
                self.forward_execute(Some(effect));
            }
            None if taken => {
                // PostgreSQL: 26000, which the server would not say. It says it, from the same
                // lookup, to a Describe of a name no server has.
                write_message(&mut self.server.wbuf, fe::DESCRIBE, |m| {
                    m.extend_from_slice(b"S");
                    put_cstr(m, MISSING_NAME);
                });
                self.replies.push_entry(Entry {
                    expected: Expected::Describe,
                    action: Action::replace_error(ErrorRewrite::Rename {
                        from: Bytes::from_static(MISSING_NAME),
                        to: Bytes::copy_from_slice(name),
                    }),
                    effect: None,
                });
            }
            // The server fails it with PostgreSQL's 26000 (or finds the portal gone).
            None => return Plan::Forward,
        }
        Plan::Done
    }

    /// Sends the client's Execute as it is, with bookkeeping.
    fn forward_execute(&mut self, effect: Option<Effect>) {
        self.forward_execute_with(effect, Action::Forward);
    }

    fn forward_execute_with(&mut self, effect: Option<Effect>, action: Action) {
        self.server.wbuf.extend_from_slice(self.msg);
        self.replies.push_entry(Entry {
            expected: Expected::Execute,
            action,
            effect,
        });
    }

    /// `DISCARD ALL` / `DEALLOCATE ALL` drop every statement on the server and every name of
    /// the client; `DEALLOCATE name` of a protocol-level statement is answered by pgmemo (the
    /// server knows it under another name). Everything else passes through.
    fn query(&mut self, words: u32) -> Plan {
        let statement_words = Words::PREPARE
            | Words::DEALLOCATE
            | Words::DISCARD
            | Words::EXECUTE
            | Words::SEARCH_PATH
            | Words::PGMEMO_S;
        if words & statement_words == 0 {
            if let Some(plan) = self.autoprepared() {
                return plan;
            }
        }
        if self.deallocates_protocol_name(words) && !self.state_known() {
            // Answered locally, unless the session is in an aborted block: not known yet.
            return Plan::Wait;
        }
        // PostgreSQL drops the unnamed statement at the start of every simple query (even one
        // that then fails).
        let unnamed = self
            .stmts
            .get(b"")
            .is_some()
            .then(|| self.stmts.set(b"", None))
            .flatten()
            .map(|statement| Effect::Unbound {
                name: Box::default(),
                statement,
            });
        let effect = self.query_effect(words);
        match effect {
            QueryPlan::Synthesize(effect) => self.replies.push_entry(Entry {
                expected: Expected::Query,
                action: Action::Synthesize(Synth::Deallocate),
                effect: Effect::combine(unnamed, Some(effect)),
            }),
            QueryPlan::Forward(effect, placeholders, hidden) => {
                if unnamed.is_none()
                    && effect.is_none()
                    && placeholders.is_empty()
                    && hidden.is_none()
                {
                    return Plan::Forward;
                }
                let bracket = !placeholders.is_empty() && !self.replies.in_batch();
                if bracket {
                    self.placeholders(&placeholders, fe::PARSE);
                }
                let action = match hidden {
                    Some((text, action)) => {
                        write_message(&mut self.server.wbuf, fe::QUERY, |m| put_cstr(m, &text));
                        action
                    }
                    None => {
                        self.server.wbuf.extend_from_slice(self.msg);
                        Action::Forward
                    }
                };
                self.replies.push_entry(Entry {
                    expected: Expected::Query,
                    action,
                    effect: Effect::combine(unnamed, effect),
                });
                if bracket {
                    self.placeholders(&placeholders, fe::CLOSE);
                }
            }
        }
        Plan::Done
    }

    /// A simple query run as an autoprepared statement (see [`crate::autoprepare`]): Bind of
    /// the statement to the unnamed portal with the literals' values, Describe of the portal,
    /// Execute, Sync, the replies shown as PostgreSQL answers the simple query. None: the
    /// query goes to the server as it is.
    ///
    /// Only with nothing of the client's in flight (so the session knows the transaction
    /// state, and one query's error translation is pending at a time) and outside an aborted
    /// block. A statement no server has accepted yet is prepared on the side first
    /// ([`Planner::probe`]) while this query goes to the server as it is.
    fn autoprepared(&mut self) -> Option<Plan> {
        let ap = self.autoprepare.take()?;
        if self.replies.has_pending_work() || self.replies.in_batch() || self.may_be_aborted() {
            self.stats.autoprepare_passed += 1;
            ap.global.count_pass(crate::autoprepare::Pass::Busy);
            return None;
        }
        let text = self.query_text?;
        self.stmts.refresh_context(self.registry);
        let statement = match ap.client.statement(
            ap.global,
            self.registry,
            text,
            ap.reader,
            (self.stmts.context, self.stmts.schema.epoch()),
            ap.threshold,
        ) {
            Ok(statement) => statement,
            Err(pass) => {
                self.stats.autoprepare_passed += 1;
                ap.global.count_pass(pass);
                return None;
            }
        };
        if !statement.is_validated() && !self.server.prepared.has_current(&statement) {
            self.probe(statement);
            self.stats.autoprepare_passed += 1;
            ap.global.count_pass(crate::autoprepare::Pass::Probing);
            return None;
        }
        // Every simple query drops the client's unnamed statement, even one that fails.
        let unnamed = self.stmts.set(b"", None).map(|statement| Effect::Unbound {
            name: Box::default(),
            statement,
        });
        if self.server.prepared.has_current(&statement) {
            self.stats.prepare_cache_hit += 1;
        } else {
            self.stats.prepare_cache_miss += 1;
            self.write_parse(&statement);
            self.replies.push_entry(Entry {
                expected: Expected::Parse,
                action: Action::AsSimpleQuery,
                effect: Some(Effect::Prepared(statement.clone())),
            });
        }
        // The first statement of an implicit transaction: after 0A000 the query is planned
        // again (the statement re-prepared), invisibly.
        let retry = self.server.status == b'I'
            && self.retry.can_start()
            && !self.replies.has_pending_work();
        if retry {
            self.retry.start_query();
        }
        let generation = statement.generation();
        let lexed = ap.reader.lexed().expect("statement() read the text");
        ap.client.write_bind(
            lexed,
            statement.server_name.as_bytes(),
            &mut self.server.wbuf,
        );
        crate::autoprepare::write_run(&mut self.server.wbuf);
        ap.client.executed();
        self.stats.autoprepared += 1;
        self.replies.push_entry(Entry {
            expected: Expected::Bind,
            action: Action::AsSimpleQuery,
            effect: Some(Effect::Uses {
                statement,
                generation,
                retry,
            }),
        });
        ap.client.rerun = retry && !ap.client.modifies;
        self.replies.push_entry(Entry {
            expected: Expected::Describe,
            action: if ap.client.modifies || ap.client.rerun {
                Action::AsSimpleQueryHeld
            } else {
                Action::AsSimpleQuery
            },
            effect: None,
        });
        self.replies.push(Expected::Execute);
        self.replies.push_entry(Entry {
            expected: Expected::Sync,
            action: Action::Forward,
            effect: unnamed,
        });
        Some(Plan::Done)
    }

    /// Prepares an autoprepared statement that no server has accepted yet, on its own and
    /// silently, before the client's query (which then goes to the server as it is): if
    /// PostgreSQL accepts it, the client's next query of its shape runs prepared; if not, the
    /// shape is never tried again ([`Effect::Probe`]). In a transaction block the Parse runs
    /// inside a savepoint that is rolled back and released after it, so a Parse PostgreSQL
    /// refuses never aborts the client's transaction. Pipelined: no round trip is added.
    fn probe(&mut self, statement: Arc<Statement>) {
        let in_block = self.server.status == b'T';
        if in_block {
            fe::query(&mut self.server.wbuf, "SAVEPOINT pgmemo_probe");
            self.replies.push(Expected::Internal);
        }
        self.stats.prepare_cache_miss += 1;
        self.write_parse(&statement);
        self.replies.push_entry(Entry {
            expected: Expected::Parse,
            action: Action::Silent,
            effect: Some(Effect::Probe(statement)),
        });
        fe::sync(&mut self.server.wbuf);
        self.replies.push_entry(Entry {
            expected: Expected::Sync,
            action: Action::Silent,
            effect: None,
        });
        if in_block {
            fe::query(
                &mut self.server.wbuf,
                "ROLLBACK TO SAVEPOINT pgmemo_probe; RELEASE SAVEPOINT pgmemo_probe",
            );
            self.replies.push(Expected::Internal);
        }
    }

    /// A query that PREPAREs, EXECUTEs or DEALLOCATEs a name that is one of the client's
    /// protocol-level statements, which the server knows under pgmemo's name only: for
    /// PostgreSQL's own answer (42P05, the statement's rows, a DEALLOCATE that works), the
    /// statements are prepared on the server under the client's names before the query
    /// (`tag` PARSE) and closed after it (`tag` CLOSE; closing a name that is not there is
    /// not an error). Each group is a unit of its own, between the client's, and silent.
    fn placeholders(&mut self, names: &[(String, Arc<Statement>)], tag: u8) {
        for (name, statement) in names {
            if tag == fe::PARSE {
                write_message(&mut self.server.wbuf, fe::PARSE, |m| {
                    put_cstr(m, name.as_bytes());
                    put_cstr(m, &statement.server_query);
                    m.extend_from_slice(&statement.key.param_types);
                });
            } else {
                write_message(&mut self.server.wbuf, fe::CLOSE, |m| {
                    m.extend_from_slice(b"S");
                    put_cstr(m, name.as_bytes());
                });
            }
            self.replies.push_entry(Entry {
                expected: if tag == fe::PARSE {
                    Expected::Parse
                } else {
                    Expected::Close
                },
                action: Action::Silent,
                effect: None,
            });
        }
        fe::sync(&mut self.server.wbuf);
        self.replies.push_entry(Entry {
            expected: Expected::Sync,
            action: Action::Silent,
            effect: None,
        });
    }

    /// Whether the message is a simple query that is only `DEALLOCATE` of one of the client's
    /// protocol-level statements.
    fn deallocates_protocol_name(&self, words: u32) -> bool {
        if self.stmts.is_empty() || words & Words::DEALLOCATE == 0 {
            return false;
        }
        let Some(text) = self.query_text else {
            return false;
        };
        let Ok(text) = std::str::from_utf8(text) else {
            return false;
        };
        matches!(command::classify(text).as_slice(),
            [Command::Deallocate { name }] if self.stmts.get(name.as_bytes()).is_some())
    }

    /// What a simple query does to the client's statements.
    fn query_effect(&mut self, words: u32) -> QueryPlan {
        let Some(text) = self.query_text else {
            return QueryPlan::Forward(None, Vec::new(), None);
        };
        let commands = Words::PREPARE
            | Words::DEALLOCATE
            | Words::DISCARD
            | Words::EXECUTE
            | Words::SEARCH_PATH
            | Words::PGMEMO_S;
        if words & commands == 0 {
            return QueryPlan::Forward(None, Vec::new(), None);
        }
        let Ok(text) = std::str::from_utf8(text) else {
            // Another client_encoding: its reserved names are hidden all the same.
            let hidden = (words & Words::PGMEMO_S != 0)
                .then(|| command::hide_reserved(text))
                .flatten()
                .map(|h| {
                    let action = reserved_action(&h.uses[0].1);
                    (h.text, action)
                });
            return QueryPlan::Forward(None, Vec::new(), hidden);
        };
        let commands = command::classify(text);
        if let [Command::Deallocate { name }] = commands.as_slice() {
            // In an aborted transaction block the server refuses it (25P02) whatever the name,
            // exactly as PostgreSQL would.
            if !self.certainly_aborted() {
                if let Some(statement) = self.stmts.set(name.as_bytes(), None) {
                    return QueryPlan::Synthesize(Effect::Unbound {
                        name: name.as_bytes().into(),
                        statement,
                    });
                }
            }
        }
        // An EXECUTE of a protocol-level statement whose text is DEALLOCATE runs that
        // DEALLOCATE (placeholders below prepare both names on the server).
        let executed: Vec<Command> = commands
            .iter()
            .map(|c| match c {
                Command::Execute { name } => match self
                    .stmts
                    .get(name.as_bytes())
                    .and_then(|s| s.tracked.clone())
                {
                    Some(t @ (Command::Deallocate { .. } | Command::DeallocateAll)) => t,
                    _ => c.clone(),
                },
                _ => c.clone(),
            })
            .collect();
        // Protocol-level names that the query PREPAREs, EXECUTEs or DEALLOCATEs.
        let mut placeholders: Vec<(String, Arc<Statement>)> = Vec::new();
        for command in commands.iter().chain(&executed) {
            if let Command::Prepare { name, .. }
            | Command::Execute { name }
            | Command::Deallocate { name } = command
            {
                if let Some(statement) = self.stmts.get(name.as_bytes()) {
                    if !name.starts_with("pgmemo_s") && !placeholders.iter().any(|(n, _)| n == name)
                    {
                        placeholders.push((name.clone(), statement.clone()));
                    }
                }
            }
        }
        let mut effect = None;
        if executed
            .iter()
            .any(|c| matches!(c, Command::DiscardAll | Command::DeallocateAll))
        {
            let snapshot = ResetSnapshot {
                names: self.stmts.take_all(),
                prepared: self.server.prepared.snapshot(),
                guard: self.server.prepared.has_guard(),
                sole_command: commands.len() == 1,
                discard_all: commands.contains(&Command::DiscardAll),
                sql: None,
            };
            self.server.prepared.clear();
            effect = Some(Effect::Reset(Box::new(snapshot)));
        }
        // Reserved names (`pgmemo_s<n>`) are pgmemo's on the server: hidden from it (see
        // `command::hide_reserved`). PostgreSQL stops at the first statement that fails, and each
        // hidden one fails: the error, if about `pgmemo_s`, is about the first of them (or of
        // the client's statements whose hidden text an EXECUTE runs, see `placeholders`).
        let hidden = if words & Words::PGMEMO_S != 0 {
            command::hide_reserved(text.as_bytes())
        } else {
            None
        };
        let first_hidden = commands.iter().enumerate().find_map(|(i, c)| {
            if let Some((_, used)) = hidden
                .as_ref()
                .and_then(|h| h.uses.iter().find(|(j, _)| *j == i))
            {
                return Some(used.clone());
            }
            match c {
                Command::Execute { name } if !command::is_reserved_name(name.as_bytes()) => {
                    self.stmts.get(name.as_bytes())?.hidden.clone()
                }
                _ => None,
            }
        });
        let hidden = match (hidden, first_hidden) {
            (Some(h), Some(used)) => Some((h.text, reserved_action(&used))),
            (None, Some(used)) => Some((text.as_bytes().to_vec(), reserved_action(&used))),
            (Some(h), None) => Some((h.text, Action::Forward)),
            (None, None) => None,
        };
        let commands = executed;
        if commands.iter().any(|c| {
            matches!(
                c,
                Command::Prepare { .. }
                    | Command::SetSearchPath { .. }
                    | Command::Deallocate { .. }
                    | Command::DeallocateAll
                    | Command::DiscardAll
            )
        }) {
            let sql = Effect::Sql(Box::new(SqlCommands {
                commands,
                completed: 0,
            }));
            effect = Effect::combine(effect, Some(sql));
        }
        QueryPlan::Forward(effect, placeholders, hidden)
    }

    /// Forwards the Sync, then closes the names a duplicate Parse left on the server.
    fn sync(&mut self) -> bool {
        self.server.wbuf.extend_from_slice(self.msg);
        self.replies.push(Expected::Sync);
        if let Some(names) = self.cleanup.take() {
            for name in names {
                write_message(&mut self.server.wbuf, fe::CLOSE, |m| {
                    m.extend_from_slice(b"S");
                    put_cstr(m, &name);
                });
                self.replies.push_entry(Entry {
                    expected: Expected::Close,
                    action: Action::Skip,
                    effect: None,
                });
            }
            fe::sync(&mut self.server.wbuf);
            self.replies.push_entry(Entry {
                expected: Expected::Sync,
                action: Action::Skip,
                effect: None,
            });
        }
        true
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
                memchr::memchr(0, body)
                    .is_some_and(|name_end| Words::may_start_transaction(&body[name_end + 1..]))
                    && Parse::parse(body)
                        .and_then(|p| std::str::from_utf8(p.query).ok())
                        .is_some_and(command::is_transaction_start)
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

    /// Sends a Parse of the guard's query (a statement that does nothing) under `name`, its
    /// reply handled as `action` says.
    fn parse_guard_query(&mut self, name: &[u8], action: Action, effect: Option<Effect>) {
        write_message(&mut self.server.wbuf, fe::PARSE, |m| {
            put_cstr(m, name);
            put_cstr(m, GUARD_QUERY);
            m.extend_from_slice(&[0, 0]);
        });
        self.replies.push_entry(Entry {
            expected: Expected::Parse,
            action,
            effect,
        });
    }

    /// Prepares the guard statement (see [`GUARD_NAME`]) if this is a safe moment: between
    /// the client's units of work (no batch open), unless the block is known to be aborted.
    /// A Sync follows, so that the Parse is a unit of its own (inside a transaction block a
    /// Sync commits nothing); if an earlier unit still in flight leaves the block aborted,
    /// the Parse fails, silently, and the guard is not there.
    fn prepare_guard(&mut self) {
        if self.replies.in_batch()
            || self.replies.in_copy_in()
            || self.certainly_aborted()
            || self.server.prepared.limit() < 2
        {
            // (With room for one statement only, the client's statements need it.)
            return;
        }
        // The guard counts toward the limit: make room if the set is full.
        if let Some(victim) = self.server.prepared.lru_if_full() {
            self.evict(victim);
        }
        self.parse_guard_query(GUARD_NAME, Action::Silent, Some(Effect::Guard));
        fe::sync(&mut self.server.wbuf);
        self.replies.push_entry(Entry {
            expected: Expected::Sync,
            action: Action::Silent,
            effect: None,
        });
        self.server.prepared.set_guard(true);
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
        self.state_known().then_some(self.server.status == b'E')
    }

    /// Whether the transaction state the message being planned runs in is the one the last
    /// ReadyForQuery reported. In a transaction block anything still in flight may change it
    /// (an error aborts the block, an Execute of ROLLBACK ends it); outside one, only a
    /// simple query can open a block and fail in it before this message (an error in this
    /// batch makes PostgreSQL skip this message anyway).
    fn state_known(&self) -> bool {
        match self.server.status {
            b'I' => !self.replies.has_pending_query(),
            _ => !self.replies.may_change_transaction(),
        }
    }

    /// Whether the message being planned certainly runs in an aborted transaction block.
    fn certainly_aborted(&self) -> bool {
        self.server.status == b'E' && self.state_known()
    }

    /// Whether the Bind being planned is the first statement of an implicit
    /// transaction, so that its batch can be sent again if it fails with 0A000 ("cached plan
    /// must not change result type") — nothing of the batch has run yet. If so, the session
    /// keeps the client's messages from here to the batch's Sync ([`Retry`]).
    fn retry_point(&mut self) -> bool {
        let first = self.server.status == b'I'
            && self.retry.can_start()
            && !self.replies.has_pending_work();
        if first {
            self.retry.start();
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

/// The number of parameter values in a Bind (after its names), if the message says.
fn bind_param_count(rest: &[u8]) -> Option<usize> {
    let formats = u16::from_be_bytes(rest.get(..2)?.try_into().ok()?) as usize;
    let at = 2 + 2 * formats;
    Some(u16::from_be_bytes(rest.get(at..at + 2)?.try_into().ok()?) as usize)
}

/// How a simple query is sent, and what it does to the client's statements.
enum QueryPlan {
    /// To the server, between placeholders for these names (see [`Planner::placeholders`]);
    /// with reserved statement names hidden, this text, its errors shown so.
    Forward(
        Option<Effect>,
        Vec<(String, Arc<Statement>)>,
        Option<(Vec<u8>, Action)>,
    ),
    /// Answered by pgmemo (`DEALLOCATE` of a protocol-level statement).
    Synthesize(Effect),
}

/// A client's SQL-level statement (name, text) whose drop did not happen: the client has it
/// again, and so does the server it was dropped on.
fn restore_sql_statement(
    stmts: &mut ClientStatements,
    server: Option<&mut ServerConn>,
    (name, text): (String, String),
) {
    if let Some(server) = server {
        server.prepared.sql.insert(name.clone(), text.clone());
    }
    stmts.sql.insert(name, text);
}

/// Applies the bookkeeping of one ended entry: kept when its message ran, undone when
/// PostgreSQL discarded it (or it failed). `error_code` is the SQLSTATE of the error that
/// ended it, if any.
pub fn settle(
    stmts: &mut ClientStatements,
    mut server: Option<&mut ServerConn>,
    effect: Effect,
    outcome: Outcome,
    error_code: Option<&str>,
    retried: bool,
) {
    let done = outcome == Outcome::Done;
    match effect {
        Effect::Prepared(s)
        | Effect::Bound {
            statement: s,
            prepared_here: true,
            ..
        } if done => {
            s.mark_validated();
            s.server_prepares
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        Effect::Prepared(s) => {
            if let Some(server) = server {
                server.prepared.remove(&s);
            }
        }
        Effect::Probe(s) if done => {
            s.mark_validated();
            s.server_prepares
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        Effect::Probe(s) => {
            if outcome == Outcome::Failed {
                s.mark_rejected();
            }
            if let Some(server) = server {
                server.prepared.remove(&s);
            }
        }
        Effect::Bound { .. } if done => {}
        Effect::Bound {
            name,
            previous,
            statement,
            prepared_here,
        } => {
            if name.is_empty() && outcome == Outcome::Failed {
                // PostgreSQL drops the unnamed statement before it parses the new one, so
                // an unnamed Parse that fails leaves none.
                stmts.set(b"", None);
            } else {
                stmts.set(&name, previous);
            }
            if prepared_here {
                if let Some(server) = server {
                    server.prepared.remove(&statement);
                }
            }
        }
        Effect::Unbound { name, statement } if outcome == Outcome::Discarded => {
            stmts.set(&name, Some(statement));
        }
        Effect::Deallocated { name, statement } if !done => {
            stmts.set(&name, Some(statement));
        }
        Effect::SearchPathSet(before) if !done => stmts.search_path.restore(*before),
        Effect::SqlDeallocated(named) if !done => restore_sql_statement(stmts, server, *named),
        Effect::Closed {
            statement,
            generation,
        } if !done => {
            if let Some(server) = server {
                server
                    .prepared
                    .insert_with_generation(statement, generation);
            }
        }
        Effect::Uses {
            statement,
            generation,
            retry,
        } if outcome == Outcome::Failed && error_code == Some("0A000") => {
            // "cached plan must not change result type": every server's copy is now stale
            // and is re-parsed on its next use.
            statement.invalidate(generation);
            if retry && retried {
                // Its batch is being sent again and re-describes the portal: this client gets
                // the new shape, so its name is current again. Other clients stay stale.
                stmts.refresh(&statement);
            }
        }
        Effect::Reset(snapshot) if done && snapshot.discard_all => {
            stmts.search_path.discarded();
            if let Some(server) = server {
                // RESET ALL: the settings pgmemo made on the server are gone.
                server.settings.clear();
                server.params_synced_for = None;
            }
        }
        Effect::Reset(snapshot) if !done => {
            stmts.restore_all(snapshot.names);
            if let Some(sql) = snapshot.sql {
                stmts.sql = sql.client;
                if let Some(server) = server.as_deref_mut() {
                    server.prepared.sql = sql.server;
                }
            }
            if let Some(server) = server {
                server.prepared.clear();
                for (s, generation) in snapshot.prepared {
                    server.prepared.insert_with_generation(s, generation);
                }
                server.prepared.set_guard(snapshot.guard);
                if !snapshot.sole_command {
                    // It may have run before the error: what the server holds is unknown,
                    // so this connection is not reused.
                    server.broken = true;
                }
            }
        }
        Effect::Sql(sql) if outcome != Outcome::Discarded => {
            let failed = outcome == Outcome::Failed;
            for command in sql.commands.into_iter().take(sql.completed) {
                apply_sql_command(stmts, server.as_deref_mut(), command, failed);
            }
        }
        Effect::SqlSync { name } if !done => {
            if let Some(server) = server {
                server.prepared.sql.remove(&name);
            }
        }
        Effect::SqlClosed(named) if outcome == Outcome::Discarded => {
            restore_sql_statement(stmts, server, *named)
        }
        Effect::Guard if !done => {
            if let Some(server) = server {
                server.prepared.set_guard(false);
            }
        }
        Effect::Both(both) => {
            let (first, second) = *both;
            // Undone newest first.
            let (a, b) = if done {
                (first, second)
            } else {
                (second, first)
            };
            settle(
                stmts,
                server.as_deref_mut(),
                a,
                outcome,
                error_code,
                retried,
            );
            settle(stmts, server, b, outcome, error_code, retried);
        }
        _ => {}
    }
}

/// One SQL-level statement command that ran, in a query that `failed` or not.
fn apply_sql_command(
    stmts: &mut ClientStatements,
    server: Option<&mut ServerConn>,
    command: Command,
    failed: bool,
) {
    let status = server.as_ref().map_or(b'I', |s| s.status);
    let server_sql = server.map(|s| &mut s.prepared.sql);
    match command {
        Command::SetSearchPath { value, local } => {
            if status == b'I' {
                // The query's transaction has ended: committed, unless the query failed.
                if !failed {
                    stmts.search_path.set(value.as_deref(), local);
                    stmts.search_path.end(true);
                }
            } else {
                // In a transaction block, until it ends (see `SearchPath::observe`).
                stmts.search_path.set(value.as_deref(), local);
            }
        }
        Command::Prepare { name, text } => {
            if let Some(server_sql) = server_sql {
                server_sql.insert(name.clone(), text.clone());
            }
            stmts.sql.insert(name, text);
        }
        Command::Deallocate { name } => {
            if stmts.sql.remove(&name).is_none() {
                // A protocol-level statement (the server had a placeholder).
                stmts.set(name.as_bytes(), None);
            }
            if let Some(server_sql) = server_sql {
                server_sql.remove(&name);
            }
        }
        Command::DeallocateAll | Command::DiscardAll => {
            stmts.sql.clear();
            if let Some(server_sql) = server_sql {
                server_sql.clear();
            }
        }
        Command::Execute { .. } | Command::Other => {}
    }
}

/// A session-level search_path the client SET and committed (or, after DISCARD ALL, the startup
/// packet's again): from now on the client's setting (carried to every server its transactions
/// run on, like a startup packet's), and what this server has. `""` is the server's default; a value pgmemo could not read is not carried, but
/// the server is marked as unlike anyone's, so the next client sets its own.
pub fn carry_search_path(
    path: &str,
    state: &mut crate::statements::SearchPath,
    client: &mut Vars,
    server: Option<&mut ServerConn>,
) {
    const NAME: &str = "search_path";
    state.remember_startup(client.get(NAME));
    let client_only = std::mem::take(&mut state.carry_to_client_only);
    let mut server = server.filter(|_| !client_only);
    if let Some(server) = server.as_deref_mut() {
        // Its recorded settings change here, outside the parameter sync.
        server.params_synced_for = None;
    }
    if crate::statements::is_unknown_search_path(path) {
        if let Some(server) = server {
            server.settings.set(NAME, path);
        }
        return;
    }
    for settings in std::iter::once(client).chain(server.map(|s| &mut s.settings)) {
        if path.is_empty() {
            settings.remove(NAME);
        } else {
            settings.set(NAME, path);
        }
    }
}

/// Makes the server's SQL-level statements the client's (a transaction runs wherever the pool
/// puts it): DEALLOCATE what another client left there, PREPARE what this client prepared
/// elsewhere — also so that a client never runs another client's statement. Called when the
/// session takes a server, before any of the client's messages; each is a query of its own,
/// whose replies are swallowed.
pub fn sync_sql_statements(
    stmts: &ClientStatements,
    server: &mut ServerConn,
    replies: &mut ReplyQueue,
) {
    if stmts.sql.is_empty() && server.prepared.sql.is_empty() {
        return;
    }
    let stale: Vec<String> = server
        .prepared
        .sql
        .iter()
        .filter(|(name, text)| stmts.sql.get(name) != Some(*text))
        .map(|(name, _)| name.clone())
        .collect();
    for name in stale {
        server.prepared.sql.remove(&name);
        fe::query(
            &mut server.wbuf,
            &format!("DEALLOCATE \"{}\"", name.replace('"', "\"\"")),
        );
        replies.push(Expected::Internal);
    }
    for (name, text) in stmts.sql.iter() {
        if server.prepared.sql.contains_key(name) {
            continue;
        }
        server.prepared.sql.insert(name.clone(), text.clone());
        fe::query(&mut server.wbuf, text);
        replies.push_entry(Entry {
            expected: Expected::Internal,
            action: Action::Forward,
            effect: Some(Effect::SqlSync { name: name.clone() }),
        });
    }
}

/// The replies to a statement that names the reserved `name` (see `command::ReservedUse`).
fn reserved_action(used: &command::ReservedUse) -> Action {
    match used {
        command::ReservedUse::Missing(name) => missing_as(name),
        command::ReservedUse::Refused(name) => refusing(name),
    }
}

/// PostgreSQL's 26000 about [`MISSING_NAME`] is about the client's `name`.
fn missing_as(name: &str) -> Action {
    Action::replace_error(ErrorRewrite::Hidden {
        name: Bytes::copy_from_slice(name.as_bytes()),
        refusal: None,
    })
}

/// PostgreSQL's 26000 about [`MISSING_NAME`] is pgmemo's refusal to prepare the reserved
/// `name`.
fn refusing(name: &str) -> Action {
    let mut error = BytesMut::new();
    be::error_response(
        &mut error,
        Severity::Error,
        sqlstate::RESERVED_NAME,
        &format!(
            "pgmemo: prepared statement name \"{name}\" is reserved (names pgmemo_s followed by digits are pgmemo's own on the server)"
        ),
    );
    Action::replace_error(ErrorRewrite::Hidden {
        name: Bytes::copy_from_slice(name.as_bytes()),
        refusal: Some(error.freeze()),
    })
}

/// Replies pass through, but an error that names the statement names it as the client does.
#[inline]
fn renaming_errors(statement: &Statement, client_name: Bytes) -> Action {
    Action::replace_error(ErrorRewrite::Rename {
        from: statement.server_name_bytes.clone(),
        to: client_name,
    })
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
