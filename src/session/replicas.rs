//! The session's side of streaming replicas (see [`crate::replicas`]): which server a unit of
//! work takes, and the WAL positions the client's reads must see.
//!
//! - Routing: when the client needs a server and holds none (transaction mode, nothing
//!   pinned or in flight), a unit of work that provably only reads — a simple query, or an
//!   extended batch buffered whole up to its Sync — goes to a replica that has replayed the
//!   client's floor ([`crate::replicas::ClientReads::floor`]), waiting up to
//!   `replica_wait` for one to, else to the primary. So does a read-only transaction block
//!   (`BEGIN READ ONLY`, see [`Session::opens_read_only_block`]), whole: what it runs stays
//!   on that replica until it ends.
//! - Read-your-writes: work on the primary that is not proven read-only has the primary's
//!   WAL position asked for behind it, in the same write ([`Session::ask_position`]; once
//!   the server is idle, for what nothing may follow: a COPY), before the server goes back;
//!   that position is the client's floor.
//! - Causal reads: `SHOW pgmemo.read_lsn` is answered here with the floor; the client's
//!   `pgmemo.min_read_lsn` setting (SET, or at connect) raises it. A client that sets
//!   `pgmemo.report_read_lsn` on is sent the floor as a ParameterStatus `pgmemo.read_lsn`
//!   whenever a write raises it, ahead of the ReadyForQuery that ends the write
//!   ([`Session::report_read_lsn`]).

use std::sync::Arc;

use super::deferred::MAX_CONTROL_LEN;
use super::{End, Session};
use crate::lsn;
use crate::protocol::backend as be;
use crate::protocol::{body, frame, frontend as fe};
use crate::query::block::{self, Control, Isolation, Modes};
use crate::query::hint;
use crate::replicas::{catalog::Catalog, Pick, Replica};
use crate::server::ServerConn;
use bytes::Buf;

/// The setting a client raises its floor with (a placeholder PostgreSQL keeps for it).
pub(super) const MIN_READ_LSN: &str = "pgmemo.min_read_lsn";

/// The setting a client asks with for its floor as a ParameterStatus `pgmemo.read_lsn`
/// after each write that raises it (a placeholder PostgreSQL keeps for it).
const REPORT_READ_LSN: &str = "pgmemo.report_read_lsn";

/// A statement a Bind runs, for [`Session::statement_only_reads`].
enum Statement<'a> {
    /// One the client prepared before.
    Known(&'a std::sync::Arc<crate::statements::Statement>),
    /// One a Parse of the batch at hand gives (its text).
    Parsed(&'a [u8]),
}

/// What [`Session::replica_stage`] decided for a client message.
pub(super) enum Stage {
    /// On as usual.
    Go,
    /// Answered here (`SHOW pgmemo.read_lsn`): consumed.
    Answered,
    /// Not read now: it waits for the replica's replies (see `Session::replica_stage`).
    Wait,
    /// It takes a server (the replica's went back).
    Acquire,
}

/// What a unit of work at the head of the client's input may run on a replica.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Work {
    /// It provably only reads.
    Reads,
    /// It opens a read-only transaction block: the block runs there whole.
    ReadOnlyBlock,
    /// A `BEGIN` whose block may still be made read-only: kept back when no server is held
    /// (see `session::deferred`), its first statement then decides; it waits for the position
    /// of the client's last write as a read does (see [`Session::waits_for_position`]).
    MayKeep,
}

/// How often a session waiting for a replica to replay its floor asks it again.
const ASK_EVERY: std::time::Duration = std::time::Duration::from_millis(1);

impl Session {
    /// Takes a replica's server for the work at the head of the client's input when it may go
    /// to one (see the module's documentation); else leaves the session without a server, for
    /// the primary's.
    pub(super) async fn acquire_replica(
        &mut self,
        tag: u8,
        query_text_len: Option<usize>,
        query_words: u32,
    ) -> Result<(), End> {
        let Some(reads) = self.reads.as_deref().filter(|r| !r.set.is_retired()) else {
            return Ok(());
        };
        let now_us = reads.set.now_us();
        let Some(catalog) = self.catalog().filter(|c| !c.is_stale(now_us)) else {
            return Ok(());
        };
        if self.server.is_some()
            || self.state.pins != 0
            || self.state.wants_pin_slot(query_words)
            || !self.replies.is_empty()
            || self.plan.stmts.as_ref().is_some_and(|s| !s.sql.is_empty())
        {
            return Ok(());
        }
        // A miss the result cache fills: on a replica that replayed every commit its
        // versions include, else on the primary.
        let fill = self.cache.as_ref().and_then(|c| c.fill.as_ref());
        let fill_floor = match fill.map(|f| self.app.cache.fill_bumped(f)) {
            None => None,
            Some(bumped) => {
                let Some(covering) = bumped.and_then(|b| reads.set.covering_after(b)) else {
                    return Ok(());
                };
                Some(covering)
            }
        };
        let fills = fill_floor.is_some();
        let block = if self.keeps_block() {
            // A block the session kept (see `session::deferred`) starts on the server now.
            if fills || !self.kept_block_goes_to_replica(tag, query_text_len) {
                return Ok(());
            }
            true
        } else {
            match self.work_reads(tag, query_text_len, &catalog) {
                Some(Work::Reads) => false,
                // (The cache neither answers nor fills in a block on a replica.)
                Some(Work::ReadOnlyBlock) if !fills => true,
                // Not kept back after all (work was in flight): the primary's.
                _ => return Ok(()),
            }
        };
        let reads = self.reads.as_deref().expect("checked above");
        let floor = reads.floor(self.params.settings.get(MIN_READ_LSN));
        if floor == u64::MAX {
            return Ok(());
        }
        let floor = floor.max(fill_floor.unwrap_or(0));
        let (lag, wait) = {
            let g = &self.app.config.load().general;
            (g.max_replica_lag, g.replica_wait)
        };
        let (replica, ready) = match reads.set.pick(floor, reads.last.as_ref(), lag) {
            Pick::Ready(r) => (r, true),
            Pick::Behind(r) if !wait.is_zero() => (r, false),
            _ => return Ok(()),
        };
        let Some(mut server) = self.replica_server(&replica).await else {
            return Ok(());
        };
        if !ready && !wait_for_replay(&mut server, &replica, floor, wait).await {
            replica.pool.checkin(server);
            return Ok(());
        }
        if self.info.is_killed() {
            replica.pool.checkin(server);
            return Ok(());
        }
        let replayed = replica.replayed();
        let reads = self.reads.as_deref_mut().expect("checked above");
        reads.read_on(&replica, replayed);
        reads.block = block;
        if block {
            // The block reads the replica's state: the result cache, which holds the
            // primary's, neither answers nor fills in it (a later statement must never see
            // an older state than an earlier one did).
            if let Some(cache) = self.cache.as_deref_mut() {
                cache.off_for_transaction();
            }
        }
        self.hold(server);
        Ok(())
    }

    /// Whether the block the session kept goes to a replica as its first statement (at the
    /// head of the client's input) takes a server: the `BEGIN` with that statement's modes
    /// when it is a `SET TRANSACTION`, is read-only (see [`Session::reads_only`]), and
    /// nothing of the block was answered from the result cache (whose answers are the
    /// primary's: the replica's state may be older).
    fn kept_block_goes_to_replica(&self, tag: u8, query_text_len: Option<usize>) -> bool {
        let Some(kept) = self.kept.as_deref().filter(|k| !k.answered) else {
            return false;
        };
        let set = self
            .first_statement_text(tag, query_text_len)
            .filter(|t| t.len() <= MAX_CONTROL_LEN)
            .and_then(block::read_set_transaction);
        self.reads_only(set.map_or(kept.modes, |set| kept.modes.then(set)))
    }

    /// Whether a `BEGIN` with these modes may be kept for its first statement to decide where
    /// it goes: the pool has replicas, and the block is not read-only yet (it is routed at
    /// once) nor SERIALIZABLE.
    pub(super) fn may_become_read_only(&self, modes: Modes) -> bool {
        self.reads.as_deref().is_some_and(|r| !r.set.is_retired())
            && !modes.read_only
            && !self.serializable(modes.isolation)
    }

    /// Whether a block of these modes a replica may run whole: `READ ONLY` (named, or by the
    /// client's `default_transaction_read_only` unless `READ WRITE` is named) and not
    /// SERIALIZABLE (see [`Session::serializable`]).
    fn reads_only(&self, modes: Modes) -> bool {
        // PostgreSQL 14 and later report the setting (ParameterStatus); earlier ones do not,
        // and the session carries it as a setting.
        let read_only_default = self
            .params
            .settings
            .get("default_transaction_read_only")
            .or_else(|| self.params.reported.get("default_transaction_read_only"))
            .is_some_and(crate::params::is_on);
        let read_only = modes.read_only || (!modes.read_write && read_only_default);
        read_only && !self.serializable(modes.isolation)
    }

    /// Whether a block with `isolation` (None: not named) is, or may be, SERIALIZABLE (which
    /// a standby refuses): by its options, the client's `default_transaction_isolation` or
    /// the pool's (READ COMMITTED, read with the setting functions; another or unknown: may
    /// be).
    fn serializable(&self, isolation: Option<Isolation>) -> bool {
        match isolation {
            Some(level) => level == Isolation::Serializable,
            None => match self.params.settings.get("default_transaction_isolation") {
                Some(own) => own.eq_ignore_ascii_case("serializable"),
                None => self.pool.read_committed_default() != Some(true),
            },
        }
    }

    /// What a `BEGIN` (`control`) opens, for a replica: a block it may run whole, one whose
    /// first statement may still make it so, or None.
    fn opens_block(&self, control: Control) -> Option<Work> {
        let Control::Begin { modes, .. } = control else {
            return None;
        };
        if self.reads_only(modes) {
            Some(Work::ReadOnlyBlock)
        } else if !modes.read_write && self.may_become_read_only(modes) {
            Some(Work::MayKeep)
        } else {
            None
        }
    }

    /// The text of the first statement the client's buffered input runs: a simple query's,
    /// or the statement the first Bind binds (parsed before it, or known), or, when it binds
    /// none before a Sync, the first one it parses (a statement prepared before it runs, as
    /// tokio-postgres and pgx do). Closes, Describes, Flushes and Syncs before them run
    /// nothing (tokio-postgres closes its last statement ahead of the next).
    fn first_statement_text(&self, tag: u8, query_text_len: Option<usize>) -> Option<&[u8]> {
        if tag == fe::QUERY {
            return query_text_len.map(|n| fe::query_text_of(&self.client.rbuf, n));
        }
        let mut parsed: Option<fe::Parse<'_>> = None;
        for (tag, body) in crate::protocol::messages(&self.client.rbuf) {
            match tag {
                fe::PARSE if parsed.is_none() => parsed = Some(fe::Parse::parse(body)?),
                fe::BIND => {
                    let bind = fe::Bind::parse(body)?;
                    return match parsed.filter(|p| p.name == bind.statement) {
                        Some(p) => Some(p.query),
                        None if parsed.is_none() => {
                            Some(&self.plan.stmts.as_ref()?.get(bind.statement)?.key.query)
                        }
                        None => None,
                    };
                }
                fe::SYNC if parsed.is_some() => break,
                fe::QUERY if parsed.is_none() => return fe::query_text(body),
                fe::PARSE | fe::DESCRIBE | fe::FLUSH | fe::CLOSE | fe::SYNC => {}
                _ => return None,
            }
        }
        parsed.map(|p| p.query)
    }

    /// A server of `replica`'s pool; None when it has none to give (it cannot be reached: it
    /// is marked down, and the work goes to the primary).
    async fn replica_server(&mut self, replica: &Arc<Replica>) -> Option<Box<ServerConn>> {
        if let Some(server) = replica.pool.checkout_at_once() {
            return Some(server);
        }
        match replica
            .pool
            .checkout_waiting(Some(self.info.killed_flag()))
            .await
        {
            Ok(server) => Some(server),
            Err(crate::pool::CheckoutError::Connect(e)) => {
                tracing::warn!(host = %replica.host, port = replica.port, error = %e, "replica unreachable: its reads go to the primary");
                replica.mark_down();
                None
            }
            Err(_) => None,
        }
    }

    /// What the unit of work at the head of the client's input is, for a replica (None:
    /// neither, it goes to the primary): a simple query is its own unit; extended messages
    /// are judged up to their Sync, which must be buffered.
    fn work_reads(
        &mut self,
        tag: u8,
        query_text_len: Option<usize>,
        catalog: &Catalog,
    ) -> Option<Work> {
        if tag == fe::QUERY {
            if let Some(n) = query_text_len.filter(|&n| n <= MAX_CONTROL_LEN) {
                let text = fe::query_text_of(&self.client.rbuf, n);
                if let Some(work) = block::read(text).and_then(|c| self.opens_block(c)) {
                    return Some(work);
                }
            }
            return self
                .query_only_reads(query_text_len, catalog)
                .then_some(Work::Reads);
        }
        self.batch_reads(catalog)
    }

    /// Whether the simple query at the head of the client's input only reads.
    fn query_only_reads(&mut self, query_text_len: Option<usize>, catalog: &Catalog) -> bool {
        let Some(text_len) = query_text_len else {
            return false;
        };
        let text = fe::query_text_of(&self.client.rbuf, text_len);
        let reader = self.reading.reader.get_or_insert_with(Default::default);
        let analysis = match reader.shape(text, &self.app.shapes) {
            Ok((lexed, _)) if hint::asks_primary(text, &lexed.comment_spans) => return false,
            Ok((lexed, shape)) => shape
                .clone()
                .derived(text, &lexed.literals)
                .analysis
                .clone(),
            Err(_) if hint::statement_asks_primary(text) => return false,
            Err(_) => self
                .app
                .shapes
                .raw(text)
                .derived(text, &[])
                .analysis
                .clone(),
        };
        analysis.is_some_and(|a| catalog.only_reads(&a))
    }

    /// Whether a statement of the extended protocol only reads (and asks for no primary):
    /// one the client prepared (its shape kept with it), or a text parsed in the batch at hand.
    fn statement_only_reads(&self, statement: Statement<'_>, catalog: &Catalog) -> bool {
        let (text, shape) = match statement {
            Statement::Known(s) => (&s.key.query[..], s.shape(&self.app.shapes).cloned()),
            Statement::Parsed(text) => (text, self.app.shapes.statement(text)),
        };
        if hint::statement_asks_primary(text) {
            return false;
        }
        let analysis = shape.and_then(|s| s.analysis().cloned());
        analysis.is_some_and(|a| catalog.only_reads(&a))
    }

    /// What a statement of the extended protocol opens when it is a `BEGIN` (see
    /// [`Session::opens_block`]).
    fn statement_opens_block(&self, statement: &Statement<'_>) -> Option<Work> {
        let text = match statement {
            Statement::Known(s) => &s.key.query[..],
            Statement::Parsed(text) => text,
        };
        if text.len() > MAX_CONTROL_LEN {
            return None;
        }
        block::read(text).and_then(|c| self.opens_block(c))
    }

    /// Whether the message at the head of the client's input, on its own, only reads: a
    /// query or a Bind whose statement only reads, or a message that runs nothing (a Parse,
    /// Describe, Execute of a portal a Bind made, Close, Flush or Sync).
    fn message_only_reads(&mut self, tag: u8, len: usize, query_text_len: Option<usize>) -> bool {
        let Some(catalog) = self.catalog() else {
            return false;
        };
        match tag {
            fe::QUERY => self.query_only_reads(query_text_len, &catalog),
            fe::BIND => self
                .bound_statement(len)
                .is_some_and(|s| self.statement_only_reads(Statement::Known(s), &catalog)),
            fe::PARSE | fe::DESCRIBE | fe::EXECUTE | fe::CLOSE | fe::FLUSH | fe::SYNC => true,
            _ => false,
        }
    }

    /// What the replicas may run, once their monitor has read it.
    fn catalog(&self) -> Option<Arc<Catalog>> {
        self.reads.as_deref()?.set.catalog.load_full()
    }

    /// The client's statement the Bind at the head of its input (`len` bytes) runs, when
    /// the planner knows it.
    fn bound_statement(&self, len: usize) -> Option<&Arc<crate::statements::Statement>> {
        let bind = fe::Bind::parse(body(&self.client.rbuf[..len]))?;
        self.plan.stmts.as_ref()?.get(bind.statement)
    }

    /// Whether the message at the head of the client's input must wait before it is planned:
    /// the server held is a replica's and the message is not proven to only read (pipelined
    /// after the work that went there). It goes to the primary once the replica's server
    /// is given back, when the replies still owed are in.
    fn waits_for_primary(&mut self, tag: u8, len: usize, query_text_len: Option<usize>) -> bool {
        if self
            .reads
            .as_deref()
            .is_none_or(|r| r.on.is_none() || r.block)
        {
            return false;
        }
        !self.message_only_reads(tag, len, query_text_len)
    }

    /// [`Session::work_reads`] for extended-protocol messages: every message up to the Sync
    /// is a Parse, Bind, Describe, Execute, Close or Flush, and every statement a Bind runs
    /// is known and only reads, or the first opens a read-only block (whose statements all
    /// run in it).
    fn batch_reads(&self, catalog: &Catalog) -> Option<Work> {
        let buf = &self.client.rbuf[..];
        let mut at = 0;
        // Statements parsed in the batch, by name.
        let mut parsed: Vec<(&[u8], &[u8])> = Vec::new();
        let mut work = None;
        loop {
            let (tag, len) = frame(&buf[at..], self.max_message).ok()??;
            let message = &buf[at..at + len];
            at += len;
            match tag {
                fe::SYNC => return Some(work.unwrap_or(Work::Reads)),
                fe::DESCRIBE | fe::EXECUTE | fe::CLOSE | fe::FLUSH => {}
                fe::PARSE => {
                    let p = fe::Parse::parse(body(message))?;
                    parsed.retain(|(n, _)| *n != p.name);
                    parsed.push((p.name, p.query));
                }
                fe::BIND => {
                    let b = fe::Bind::parse(body(message))?;
                    let statement = match parsed.iter().rev().find(|(n, _)| *n == b.statement) {
                        Some((_, text)) => Statement::Parsed(text),
                        None => Statement::Known(self.plan.stmts.as_ref()?.get(b.statement)?),
                    };
                    work = match work {
                        Some(Work::ReadOnlyBlock) => Some(Work::ReadOnlyBlock),
                        // Only the batch's first statement may open a block.
                        None => self.statement_opens_block(&statement).or_else(|| {
                            self.statement_only_reads(statement, catalog)
                                .then_some(Work::Reads)
                        }),
                        Some(Work::Reads) => self
                            .statement_only_reads(statement, catalog)
                            .then_some(Work::Reads),
                        // Nothing runs after a BEGIN kept back but its block's statements.
                        Some(Work::MayKeep) => Some(Work::MayKeep),
                    };
                    work?;
                }
                _ => return None,
            }
        }
    }

    /// Before a message is planned: work on the primary that is not proven to only read may
    /// write (its commit position is then asked for, see [`Session::commit_position_due`]),
    /// and work that names `synchronous_commit` may commit without a flush.
    #[inline]
    pub(super) fn note_primary_work(&mut self, tag: u8, len: usize, query_text_len: Option<usize>) {
        let on_primary = self.reads.as_deref().is_some_and(|r| r.on.is_none());
        if !on_primary || !matches!(tag, fe::QUERY | fe::BIND | fe::FUNCTION_CALL) {
            return;
        }
        // A function called by OID (no text) may do anything.
        let (maybe_async, copy) = match self.statement_text(tag, len, query_text_len) {
            Some(text) => (names(text, b"synchronous_commit"), names(text, b"copy")),
            None => (true, true),
        };
        let wrote = self.reads.as_deref().is_some_and(|r| r.wrote)
            || !self.message_only_reads(tag, len, query_text_len);
        let reads = self.reads.as_deref_mut().expect("checked above");
        reads.wrote = wrote;
        reads.maybe_async |= maybe_async;
        reads.no_pipelining |= copy;
    }

    /// The text of the statement the message runs: a simple query's, or a Bind's statement's
    /// (None: another message, or one not known).
    fn statement_text(&self, tag: u8, len: usize, query_text_len: Option<usize>) -> Option<&[u8]> {
        match tag {
            fe::QUERY => query_text_len.map(|n| fe::query_text_of(&self.client.rbuf, n)),
            fe::BIND => self.bound_statement(len).map(|s| &s.key.query[..]),
            _ => None,
        }
    }

    /// Whether the primary's position must be asked for before the server goes back: work
    /// that may have written ran on it.
    #[inline]
    pub(super) fn commit_position_due(&self) -> bool {
        self.reads
            .as_deref()
            .is_some_and(|r| r.wrote && r.on.is_none() && !r.asked)
    }

    /// Asks the primary, idle after the client's work, for its WAL position (when it could not
    /// be asked behind the work, see [`Session::ask_position`]): at or past the commit of
    /// whatever that work wrote, and so the client's read-your-writes floor (see
    /// [`lsn::commit_position`]). The client has its replies first (but for its ReadyForQuery
    /// when it asked for its floor as a ParameterStatus). If the question fails, the floor is
    /// unknown until the next one succeeds: the client's reads go to the primary meanwhile.
    pub(super) async fn learn_commit_position(&mut self) -> Result<(), End> {
        // (Not a client that asked for its floor as a ParameterStatus: that goes ahead of the
        // ReadyForQuery, which waits for the answer.)
        if !self.client.wbuf.is_empty()
            && !self.reports_read_lsn()
            && self.client.flush().await.is_err()
        {
            return Err(End::ClientGone);
        }
        // A cancel aimed at the client's last statement must not reach the question instead.
        std::future::poll_fn(|cx| self.info.poll_cancels_delivered(cx)).await;
        let Some(server) = self.server.as_mut() else {
            return Ok(());
        };
        let maybe_async = self.reads.as_deref().is_some_and(|r| r.maybe_async);
        let rows = server.internal_query(lsn::COMMIT_POSITION_SQL).await;
        let at = rows
            .ok()
            .and_then(|rows| rows.into_iter().next())
            .and_then(|row| lsn::commit_position(&row, maybe_async));
        self.reads
            .as_deref_mut()
            .expect("commit_position_due")
            .learnt(at);
        self.report_read_lsn();
        Ok(())
    }

    /// After the client's messages of a wake: when the last one ended a unit of work on the
    /// primary that may have written, the question for the primary's position goes right
    /// behind it, in the same write (no round trip of its own). Its row is read as it passes
    /// ([`Session::note_position`]); it counts only if the client's unit left the server
    /// idle (its transaction ended), else it is asked again later.
    #[cold]
    #[inline(never)]
    pub(super) fn ask_position(&mut self) {
        let Some(reads) = self.reads.as_deref_mut() else {
            return;
        };
        if reads.on.is_some() || !reads.wrote || reads.asked || reads.no_pipelining {
            return;
        }
        let Some(server) = self.server.as_mut() else {
            return;
        };
        if !self.replies.ends_with_unit() {
            return;
        }
        fe::query(&mut server.wbuf, lsn::COMMIT_POSITION_SQL);
        self.replies.push_entry(crate::replies::Entry {
            expected: crate::replies::Expected::Internal,
            action: crate::replies::Action::Position,
            effect: None,
        });
        reads.asking();
    }

    /// A server message, before the reply queue routes it: the row of pgmemo's question for
    /// the primary's position (see [`Session::ask_position`]) is read, and its
    /// ReadyForQuery ends the question.
    #[inline]
    pub(super) fn note_position(&mut self, tag: u8, len: usize) {
        if self.reads.is_none() || !matches!(tag, be::DATA_ROW | be::READY_FOR_QUERY) {
            return;
        }
        self.read_position(tag, len);
    }

    #[cold]
    #[inline(never)]
    fn read_position(&mut self, tag: u8, len: usize) {
        if !self.replies.head_is_position() {
            return;
        }
        let (Some(server), Some(reads)) = (self.server.as_ref(), self.reads.as_deref_mut()) else {
            return;
        };
        if tag == be::READY_FOR_QUERY {
            reads.question_ended();
            return;
        }
        // The client's unit ended its transaction (the ReadyForQuery before this row said
        // so): the position is past its commit. Otherwise (a block goes on) it says nothing.
        // (Work the client sent behind the question is still to be asked for.)
        if server.status == b'I' {
            let row = crate::server::parse_text_row(body(&server.rbuf[..len]));
            reads.answer(lsn::commit_position(&row, reads.asked_async));
            // (Work that touched the session's state may have changed whether the client
            // asked for reports: the probe that follows tells, see `checkpoint_state`.)
            if !self.state.touched {
                self.report_read_lsn();
            }
        }
    }

    /// Whether the client asked for its floor as a ParameterStatus (`pgmemo.report_read_lsn`
    /// on, at connect or by SET).
    fn reports_read_lsn(&self) -> bool {
        self.params
            .settings
            .get(REPORT_READ_LSN)
            .is_some_and(crate::params::is_on)
    }

    /// While the question for the position of the client's write is the only thing in
    /// flight, a client that asked for its floor as a ParameterStatus is sent nothing: the
    /// ReadyForQuery that ended its write waits for the answer (it comes next on the same
    /// server, asked in the same write), so that the client knows its floor once its write
    /// returns. So does a client whose work touched the session's state, which may have
    /// asked for that just now (see [`Session::checkpoint_state`]).
    #[inline]
    pub(super) fn holds_replies_for_position(&self) -> bool {
        self.reads.as_deref().is_some_and(|r| r.asked)
            && self.replies.only_position_pending()
            && (self.state.touched || self.reports_read_lsn())
    }

    /// Tells a client that asked for it (`pgmemo.report_read_lsn`) its floor, when its write
    /// raised it: a ParameterStatus `pgmemo.read_lsn`, ahead of the ReadyForQuery that ended
    /// the write, which waits for the answer (see [`Session::holds_replies_for_position`] and
    /// [`Session::learn_commit_position`]), else on its own.
    pub(super) fn report_read_lsn(&mut self) {
        if !self.reports_read_lsn() {
            return;
        }
        let Some(reads) = self.reads.as_deref_mut() else {
            return;
        };
        let floor = reads.floor(self.params.settings.get(MIN_READ_LSN));
        if floor == u64::MAX || floor <= reads.reported {
            return;
        }
        reads.reported = floor;
        let out = &mut self.client.wbuf;
        crate::buffers::lend(out);
        let ready = out
            .len()
            .checked_sub(6)
            .filter(|&at| out[at..at + 5] == [be::READY_FOR_QUERY, 0, 0, 0, 5]);
        let ready = ready.map(|at| out.split_off(at));
        be::parameter_status(out, "pgmemo.read_lsn", &lsn::format(floor));
        if let Some(ready) = ready {
            out.unsplit(ready);
        }
    }

    /// The server held, `server`, leaves the session: the replica it is of, if it is a
    /// replica's (None: the primary's). A replica whose server broke under a read (a standby
    /// shutting down) is marked down: no more reads there until its monitor finds it up
    /// again.
    pub(super) fn let_replica_server_go(&mut self, server: &ServerConn) -> Option<Arc<Replica>> {
        let reads = self.reads.as_deref_mut()?;
        reads.block = false;
        let replica = reads.on.take()?;
        if server.broken {
            replica.mark_down();
        }
        Some(replica)
    }

    /// The server held goes back to the pool it came from (a replica's, or the primary's).
    #[inline]
    pub(super) fn give_server_back(&mut self, server: Box<ServerConn>, now: crate::clock::Moment) {
        match self.reads.as_deref().and_then(|r| r.on.as_ref()) {
            None => self.pool.checkin_at(server, now),
            Some(_) => self.give_replica_server_back(server, now),
        }
    }

    /// [`Session::give_server_back`] for a replica's server.
    #[cold]
    fn give_replica_server_back(&mut self, server: Box<ServerConn>, now: crate::clock::Moment) {
        match self.let_replica_server_go(&server) {
            Some(replica) => replica.pool.checkin_at(server, now),
            None => self.pool.checkin_at(server, now),
        }
    }

    /// The replica feature's stage of a client message (called only for pools with
    /// replicas, after [`Session::server_for`]; `acquire`: the message takes a server, none is
    /// held): `SHOW pgmemo.read_lsn` answered; a message pipelined behind work a replica runs
    /// that is not proven to only read waits for the primary; work on the primary noted
    /// (routing itself happens where a server is taken, see [`Session::acquire_replica`]).
    #[cold]
    #[inline(never)]
    pub(super) fn replica_stage(
        &mut self,
        tag: u8,
        len: usize,
        query_text_len: Option<usize>,
        acquire: bool,
    ) -> Stage {
        if let Some(stage) = self.show_read_lsn(tag, len, query_text_len) {
            return stage;
        }
        if acquire {
            return Stage::Go;
        }
        if self.reads.as_deref().is_some_and(|r| r.block) {
            // In a read-only block on a replica: everything goes there. Once the block's end
            // is sent, what is pipelined behind it is judged as any work is.
            if self.ends_block(tag, len, query_text_len) {
                self.reads.as_deref_mut().expect("checked above").block = false;
            }
            return Stage::Go;
        }
        if self.waits_for_primary(tag, len, query_text_len) {
            // Pipelined after work a replica runs, and not proven to only read: it waits for
            // the replica's replies, then takes the primary.
            if self.replies.is_empty() {
                self.release_if_done();
            }
            if self.server.is_some() {
                self.plan.waiting = true;
                return Stage::Wait;
            }
            return Stage::Acquire;
        }
        if self.waits_for_position(tag, query_text_len) {
            // Nothing but pgmemo's question for the position of the client's last write is
            // in flight on the primary's server, and this unit only reads: it waits for the
            // answer (the server then goes back), and is routed as any read.
            self.plan.waiting = true;
            return Stage::Wait;
        }
        self.note_primary_work(tag, len, query_text_len);
        Stage::Go
    }

    /// Whether the message is a `COMMIT` or `ROLLBACK` (a simple query, or a Bind of one),
    /// read as [`block::read`] reads them. A block ended otherwise (a query of several
    /// statements, `COMMIT AND CHAIN`) leaves what follows on the replica until the server
    /// goes back (see docs/replicas.md).
    fn ends_block(&self, tag: u8, len: usize, query_text_len: Option<usize>) -> bool {
        self.statement_text(tag, len, query_text_len)
            .filter(|t| t.len() <= MAX_CONTROL_LEN)
            .and_then(block::read)
            .is_some_and(|c| matches!(c, Control::Commit | Control::Rollback))
    }

    /// Whether the unit of work at the head of the client's input, which provably only
    /// reads (or opens a read-only block), comes while the primary's server is held for
    /// nothing but the question for the position of the client's last write
    /// ([`Session::ask_position`]).
    fn waits_for_position(&mut self, tag: u8, query_text_len: Option<usize>) -> bool {
        let asked = self
            .reads
            .as_deref()
            .is_some_and(|r| r.on.is_none() && r.asked);
        if !asked || !self.replies.only_position_pending() {
            return false;
        }
        let Some(catalog) = self.catalog() else {
            return false;
        };
        self.work_reads(tag, query_text_len, &catalog).is_some()
    }

    /// `SHOW pgmemo.read_lsn`, answered here (Some(Stage::Answered)): the WAL position the
    /// client's reads must see. Its reply comes in order, and the floor covers what the
    /// client sent before it: while anything is in flight on the server held (the client's
    /// work, or pgmemo's question for the position of its last write), it waits for the
    /// replies (Some(Stage::Wait)).
    fn show_read_lsn(
        &mut self,
        tag: u8,
        len: usize,
        query_text_len: Option<usize>,
    ) -> Option<Stage> {
        let text_len = query_text_len.filter(|_| tag == fe::QUERY)?;
        if self.reads.is_none() || !is_show_read_lsn(fe::query_text_of(&self.client.rbuf, text_len))
        {
            return None;
        }
        if !self.replies.is_empty() {
            // (Replies owed with no server held are pgmemo's own, already in the output.)
            self.server.as_ref()?;
            self.plan.waiting = true;
            return Some(Stage::Wait);
        }
        let reads = self.reads.as_deref()?;
        let floor = match reads.floor(self.params.settings.get(MIN_READ_LSN)) {
            u64::MAX => None,
            at => Some(lsn::format(at)),
        };
        let status = self.client_status_now();
        let out = &mut self.client.wbuf;
        crate::buffers::lend(out);
        be::row_description_text(out, &["pgmemo.read_lsn"]);
        be::data_row(out, &[floor]);
        be::command_complete(out, "SHOW");
        be::ready_for_query(out, status);
        self.client.rbuf.advance(len);
        self.stats.bytes_received += len as u64;
        Some(Stage::Answered)
    }

    fn client_status_now(&self) -> u8 {
        match self.server.as_ref() {
            Some(s) => s.status,
            None => self.status_without_server(),
        }
    }
}

/// Whether `text` has `name` in it, in any case.
fn names(text: &[u8], name: &[u8]) -> bool {
    text.windows(name.len())
        .any(|w| w.eq_ignore_ascii_case(name))
}

/// Whether `text` is `SHOW pgmemo.read_lsn` (any case and spacing, a `;` at the end).
fn is_show_read_lsn(text: &[u8]) -> bool {
    let text = std::str::from_utf8(text).unwrap_or("");
    let text = text.trim().trim_end_matches(';').trim_end();
    let mut words = text.split_ascii_whitespace();
    words.next().is_some_and(|w| w.eq_ignore_ascii_case("show"))
        && words
            .next()
            .is_some_and(|w| w.eq_ignore_ascii_case("pgmemo.read_lsn"))
        && words.next().is_none()
}

/// Asks `server` (of `replica`) for its replay position until it has replayed `floor`, for at
/// most `wait`: whether it did.
async fn wait_for_replay(
    server: &mut ServerConn,
    replica: &Replica,
    floor: u64,
    wait: std::time::Duration,
) -> bool {
    let deadline = std::time::Instant::now() + wait;
    loop {
        let at = server
            .internal_query(
                "SELECT CASE WHEN pg_catalog.pg_is_in_recovery() \
                 THEN pg_catalog.pg_last_wal_replay_lsn() END",
            )
            .await
            .ok()
            .and_then(|rows| rows.into_iter().next())
            .and_then(|row| row.into_iter().next().flatten())
            .and_then(|text| lsn::parse(&text));
        let Some(at) = at else {
            // Broken, or no standby any more (promoted).
            if !server.broken {
                replica.mark_down();
            }
            return false;
        };
        replica.note_replayed(at);
        if at >= floor {
            return true;
        }
        let now = std::time::Instant::now();
        if now >= deadline {
            return false;
        }
        crate::timer::sleep(ASK_EVERY.min(deadline - now)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_read_lsn_question_is_recognised_however_it_is_spelt() {
        for yes in [
            "SHOW pgmemo.read_lsn",
            "show PGMEMO.READ_LSN;",
            "  show\n pgmemo.read_lsn ; ",
        ] {
            assert!(is_show_read_lsn(yes.as_bytes()), "{yes}");
        }
        for no in [
            "SHOW pgmemo.min_read_lsn",
            "SHOW pgmemo.read_lsn x",
            "SELECT 1",
            "SHOW",
        ] {
            assert!(!is_show_read_lsn(no.as_bytes()), "{no}");
        }
    }
}
