//! After the replies: a statement's effects settled once PostgreSQL has answered (kept, or
//! undone when it never ran), the batch kept to be sent again after 0A000 ([`Retry`]), and the
//! statements to close after the next Sync ([`Cleanup`]).

use super::sql::{apply_sql_command, forget_sql_statement, restore_sql_statement};
use crate::protocol::frontend as fe;
use crate::protocol::pg_name;
use crate::replies::Outcome;
use crate::server::ServerConn;
use crate::statements::{ClientStatements, Effect, NameBound, Statement};
use bytes::{Bytes, BytesMut};

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
    pub(super) fn push(&mut self, name: Box<[u8]>) {
        self.0.get_or_insert_with(Default::default).push(name);
    }

    /// Whether one of the names is `name` as PostgreSQL reads it (truncated).
    pub(super) fn holds(&self, name: &[u8]) -> bool {
        self.0
            .as_ref()
            .is_some_and(|names| names.iter().any(|n| pg_name(n) == name))
    }

    /// No name waits to be closed.
    pub fn is_empty(&self) -> bool {
        self.0.is_none()
    }

    /// The names, leaving none.
    pub(super) fn take(&mut self) -> Option<Vec<Box<[u8]>>> {
        self.0.take().map(|names| *names)
    }
}

impl Retry {
    /// Nothing kept, nothing being replayed (see `session::handover`).
    pub fn is_at_rest(&self) -> bool {
        self.can_start() && self.bytes.is_empty()
    }

    pub(super) fn can_start(&self) -> bool {
        !self.capturing && self.replaying == 0 && !self.pending
    }

    pub(super) fn start(&mut self) {
        self.capturing = true;
    }

    /// Keeps the simple query being planned, which runs as an autoprepared statement (its
    /// portal described before it executes).
    pub(super) fn start_query(&mut self) {
        self.capturing = true;
        self.query = true;
    }

    /// The session consumed these whole client messages (planned or forwarded): one, or a
    /// run the relay lane forwarded at once, kept in one copy. `sync_end`: where the first
    /// Sync among them ends (0: none), found by the caller as it framed them; the batch ends
    /// there. Nothing else of them is read here: whether the batch can go again is read
    /// from what is kept when an error comes ([`Retry::is_armed`]), not at every message
    /// (-110 instructions a `pgbench -S -M prepared` transaction, callgrind).
    #[inline]
    pub fn consumed(&mut self, msgs: &[u8], sync_end: usize) {
        self.replaying = self.replaying.saturating_sub(msgs.len());
        if self.capturing && !self.complete {
            self.keep(msgs, sync_end);
        }
    }

    /// Keeps the batch's messages among `msgs`: up to its Sync, or the simple query that is
    /// the whole of it.
    fn keep(&mut self, msgs: &[u8], sync_end: usize) {
        debug_assert!(
            !self.query || msgs.is_empty() || msgs[0] == fe::QUERY,
            "a capture started at a simple query consumes that query first"
        );
        let kept = match msgs {
            // The query being planned comes first (`start_query`): it is the batch.
            &[fe::QUERY, a, b, c, d, ..] if self.query => {
                self.complete = true;
                (1 + u32::from_be_bytes([a, b, c, d]) as usize).min(msgs.len())
            }
            _ if sync_end != 0 => {
                self.complete = true;
                sync_end
            }
            _ => msgs.len(),
        };
        if self.bytes.len() + kept > MAX_RETRY_BYTES {
            self.forget();
            return;
        }
        self.bytes.extend_from_slice(&msgs[..kept]);
    }

    /// Whether the kept batch describes its portal before it executes it. A batch that
    /// executes first (a driver that decodes rows by a description it keeps, as pgx does)
    /// is not sent again (see `is_armed`). A simple query run as an autoprepared statement
    /// is described.
    fn describes(&self) -> bool {
        if self.query {
            return true;
        }
        for (tag, body) in crate::protocol::messages(&self.bytes) {
            match tag {
                fe::DESCRIBE if body.first() == Some(&b'P') => return true,
                fe::EXECUTE => return false,
                _ => {}
            }
        }
        false
    }

    /// The text of the simple query kept (one run as an autoprepared statement), when it is
    /// kept whole: for the plan check of a query that failed (`Session::check_plan`).
    pub fn kept_query(&self) -> Option<&[u8]> {
        if !(self.query && self.complete) {
            return None;
        }
        fe::query_text(self.bytes.get(crate::protocol::HEADER_LEN..)?)
    }

    /// Whether an error now may be the retry point's 0A000 with the whole batch kept.
    pub fn is_armed(&self) -> bool {
        self.complete && !self.pending && self.describes()
    }

    /// The batch ended (or cannot be sent again): forget it.
    pub fn forget(&mut self) {
        self.capturing = false;
        self.complete = false;
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

/// A statement pgmemo prepared on a server itself ran: valid, and counted.
fn validated_here(statement: &Statement) {
    statement.mark_validated();
    statement
        .server_prepares
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
}

/// Applies the bookkeeping of one ended entry: kept when its message ran, undone when
/// PostgreSQL discarded it (or it failed). `error_code` is the SQLSTATE of the error that
/// ended it, if any, and `error` that error (a whole ErrorResponse).
pub fn settle(
    stmts: &mut ClientStatements,
    mut server: Option<&mut ServerConn>,
    effect: Effect,
    outcome: Outcome,
    error_code: Option<&str>,
    error: Option<&Bytes>,
    retried: bool,
) {
    let done = outcome == Outcome::Done;
    match effect {
        Effect::Prepared(s) if done => validated_here(&s),
        Effect::Bound(bound) if done && bound.prepared_here => validated_here(&bound.statement),
        Effect::Prepared(s) => {
            if let Some(server) = server {
                server.prepared.remove(&s);
            }
        }
        Effect::Probe(s) if done => {
            // With a check of its parameter types to come, validated once that passes.
            if s.types_checked() {
                s.mark_validated();
            }
            s.server_prepares
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        Effect::CheckTypes { statement, passed } if outcome != Outcome::Discarded => {
            // Its row came (see `ReplyQueue::note_checked_types`); without it (a parameter of a
            // domain type), or after an error, pgmemo cannot vouch for the types.
            if done && passed {
                statement.mark_types_checked();
                statement.mark_validated();
            } else {
                statement.refuse_types();
            }
        }
        Effect::Probe(s) => {
            if outcome == Outcome::Failed {
                s.mark_rejected();
            }
            if let Some(server) = server {
                server.prepared.remove(&s);
            }
        }
        Effect::Bound(_) if done => {}
        Effect::Bound(bound) => {
            let NameBound {
                name,
                previous,
                statement,
                prepared_here,
            } = *bound;
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
        Effect::SqlPrepared(named) if !done => forget_sql_statement(stmts, server, *named),
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
            ..
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
        Effect::Reset(snapshot) if !done && snapshot.ran() != Some(true) => {
            undo_reset(stmts, server, *snapshot)
        }
        // Done, or it ran before a later statement of its query failed.
        Effect::Reset(snapshot) if snapshot.discard_all => {
            stmts.search_path.discarded();
            if let Some(server) = server {
                // RESET ALL: the settings pgmemo made on the server are gone.
                server.settings.clear();
                server.params_synced_for = None;
            }
        }
        Effect::Sql(sql) if outcome != Outcome::Discarded => {
            let failed = outcome == Outcome::Failed;
            for command in sql.commands.into_iter().take(sql.completed) {
                apply_sql_command(stmts, server.as_deref_mut(), command, failed);
            }
        }
        Effect::SqlSync { name } => {
            if let Some(server) = server {
                let error = error.filter(|_| outcome == Outcome::Failed).cloned();
                server.prepared.sql_answered(&name, done, error);
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
                error,
                retried,
            );
            settle(stmts, server, b, outcome, error_code, error, retried);
        }
        _ => {}
    }
}

/// A `DISCARD ALL` / `DEALLOCATE ALL` that did not run (or may not have): the client's
/// names, its SQL-level statements and the server's set are as they were before it.
fn undo_reset(
    stmts: &mut ClientStatements,
    mut server: Option<&mut ServerConn>,
    snapshot: crate::statements::ResetSnapshot,
) {
    let unknown = snapshot.ran().is_none();
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
        if unknown {
            // It may have run before the error: what the server holds is unknown, so this
            // connection is not reused (and the client's session state on it is lost).
            server.broken = true;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(tag: u8, body: &[u8]) -> Vec<u8> {
        let mut m = BytesMut::new();
        crate::protocol::write_message(&mut m, tag, |m| m.extend_from_slice(body));
        m.to_vec()
    }

    /// Where the first Sync among `msgs` ends, as the session finds it framing them.
    fn sync_end(msgs: &[u8]) -> usize {
        let mut messages = crate::protocol::messages(msgs);
        while let Some((tag, _)) = messages.next() {
            if tag == fe::SYNC {
                return messages.at;
            }
        }
        0
    }

    /// A batch that describes its portal before executing it is kept whole, to be sent
    /// again; one that executes first is never sent again, yet still ends at its Sync.
    #[test]
    fn only_a_batch_that_can_go_again_is_kept() {
        let bind = message(fe::BIND, b"\0s\0\0\0\0\0\0\0");
        let describe = message(fe::DESCRIBE, b"P\0");
        let execute = message(fe::EXECUTE, b"\0\0\0\0\0");
        let sync = message(fe::SYNC, b"");

        let mut described = Retry::default();
        described.start();
        for m in [&bind, &describe, &execute, &sync] {
            described.consumed(m, sync_end(m));
        }
        assert!(described.is_armed());
        assert_eq!(
            described.replay().to_vec(),
            [&bind[..], &describe, &execute, &sync].concat()
        );

        let mut undescribed = Retry::default();
        undescribed.start();
        for m in [&bind, &execute, &describe, &sync] {
            undescribed.consumed(m, sync_end(m));
        }
        assert!(undescribed.complete, "the batch ends at its Sync");
        assert!(!undescribed.is_armed());
        undescribed.forget();
        assert!(undescribed.is_at_rest());

        // A run that goes on past the Sync (the next batch, pipelined) keeps the batch only.
        let mut pipelined = Retry::default();
        pipelined.start();
        let run = [&bind[..], &describe, &execute, &sync, &bind, &sync].concat();
        pipelined.consumed(&run, sync_end(&run));
        assert!(pipelined.is_armed());
        assert_eq!(
            pipelined.replay().to_vec(),
            [&bind[..], &describe, &execute, &sync].concat()
        );
    }

    /// The rule as it was read message by message (session 53 and before): whether the batch
    /// is complete, whether it may go again, and what was kept.
    fn read_message_by_message(query: bool, consumed: &[&[u8]]) -> (bool, bool, Vec<u8>) {
        let (mut complete, mut describes, mut executes) = (false, query, false);
        let mut kept = Vec::new();
        let mut keeping = true;
        for run in consumed {
            let mut messages = crate::protocol::messages(run);
            let mut start = 0;
            while let Some((tag, body)) = messages.next() {
                if complete {
                    break;
                }
                keeping &= describes || !(executes || tag == fe::EXECUTE);
                if keeping {
                    kept.extend_from_slice(&run[start..messages.at]);
                }
                match tag {
                    fe::SYNC => complete = true,
                    fe::QUERY if query => complete = true,
                    fe::EXECUTE => executes = true,
                    fe::DESCRIBE if body.first() == Some(&b'P') && !executes => describes = true,
                    _ => {}
                }
                start = messages.at;
            }
        }
        (complete, complete && describes, kept)
    }

    /// Messages consumed as one run (the relay lane's) leave exactly what consuming them one
    /// by one leaves, and what reading every message as it came decided: every sequence of
    /// up to four of a batch's messages, from a capture started at a Bind or at a simple
    /// query, and with a run that crosses the limit.
    #[test]
    fn a_run_is_kept_as_its_messages_one_by_one() {
        let messages = [
            message(fe::BIND, b"\0s\0\0\0\0\0\0\0"),
            message(fe::DESCRIBE, b"P\0"),
            message(fe::DESCRIBE, b"S\0"),
            message(fe::EXECUTE, b"\0\0\0\0\0"),
            message(fe::SYNC, b""),
            message(fe::QUERY, b"select 1\0"),
        ];
        let state = |r: &Retry| {
            (
                r.bytes.to_vec(),
                [r.capturing, r.complete, r.query, r.is_armed()],
                r.replaying,
            )
        };
        let mut sequences = vec![vec![]];
        for _ in 0..4 {
            let longer: Vec<Vec<usize>> = sequences
                .iter()
                .flat_map(|s: &Vec<usize>| {
                    (0..messages.len()).map(move |m| [&s[..], &[m]].concat())
                })
                .collect();
            sequences.extend(longer);
        }
        sequences.dedup();
        for sequence in &sequences {
            for (query, already) in [(false, 0), (true, 0), (false, MAX_RETRY_BYTES - 20)] {
                // A capture started at a simple query consumes that query first.
                if query && sequence.first().is_some_and(|&m| m != 5) {
                    continue;
                }
                let fresh = || {
                    let mut r = Retry::default();
                    if query {
                        r.start_query();
                    } else {
                        r.start();
                    }
                    r.bytes.extend_from_slice(&vec![b'x'; already]);
                    r.replaying = 30;
                    r
                };
                let (mut one_by_one, mut at_once) = (fresh(), fresh());
                let mut run = Vec::new();
                for &m in sequence {
                    one_by_one.consumed(&messages[m], sync_end(&messages[m]));
                    run.extend_from_slice(&messages[m]);
                }
                at_once.consumed(&run, sync_end(&run));
                let context = format!("{sequence:?}, query {query}, {already} bytes kept before");
                assert_eq!(state(&at_once), state(&one_by_one), "{context}");
                if already == 0 {
                    let msgs: Vec<&[u8]> = sequence.iter().map(|&m| &messages[m][..]).collect();
                    let (complete, armed, kept) = read_message_by_message(query, &msgs);
                    assert_eq!(
                        (at_once.complete, at_once.is_armed()),
                        (complete, armed),
                        "{context}"
                    );
                    if armed {
                        assert_eq!(at_once.bytes.to_vec(), kept, "{context}");
                    }
                }
            }
        }
    }
}
