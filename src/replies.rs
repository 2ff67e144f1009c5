//! The ordered queue of replies pgmemo expects from a server.
//!
//! Every message pgmemo writes to a server that PostgreSQL answers pushes one [`Entry`]; every
//! message the server sends is matched against the head of the queue. This is what lets a
//! session know, message by message, whose reply it is reading (the client's, or a message
//! pgmemo injected itself), when a server is truly idle (queue empty and ReadyForQuery said
//! `I`), and what PostgreSQL discards after an error in an extended-protocol batch (everything
//! up to the next Sync).
//!
//! The prepared-statement planner adds entries that send nothing to the server and are
//! answered by pgmemo itself ([`Action::Synthesize`]: a ParseComplete for a statement the
//! server need not parse), entries whose replies are swallowed ([`Action::Skip`]: a Parse
//! injected because the server lacked a statement), and bookkeeping [`Effect`]s that must be
//! undone, newest first, when PostgreSQL discards the message they belong to. The rule stays
//! the same: replies leave in the order the requests went in.

use crate::protocol::backend as be;
use crate::query::command;
use crate::statements::Effect;
use bytes::Bytes;
use std::collections::VecDeque;

/// What one request sent to the server will be answered with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Expected {
    /// A simple Query or FunctionCall from the client: everything through ReadyForQuery.
    Query,
    Parse,
    Bind,
    /// Optional ParameterDescription, then RowDescription or NoData.
    Describe,
    /// Rows or COPY traffic, ending in CommandComplete, EmptyQueryResponse or PortalSuspended.
    Execute,
    Close,
    Sync,
    /// A simple query pgmemo sent on its own behalf (parameter sync, reset): its replies are
    /// swallowed through its ReadyForQuery.
    Internal,
    /// Not a reply: marks where the client ended a COPY IN (CopyDone or CopyFail). PostgreSQL
    /// ignores Sync messages that arrive during COPY IN, so when a CopyInResponse shows that a
    /// COPY started, the Syncs queued between it and this marker will never be answered.
    CopyEnd,
}

impl Expected {
    /// The entry for a client message, or None for messages PostgreSQL does not answer
    /// (Flush, CopyData, CopyDone, CopyFail, Terminate).
    pub fn for_client_message(tag: u8) -> Option<Expected> {
        use crate::protocol::frontend as fe;
        Some(match tag {
            fe::QUERY | fe::FUNCTION_CALL => Expected::Query,
            fe::PARSE => Expected::Parse,
            fe::BIND => Expected::Bind,
            fe::DESCRIBE => Expected::Describe,
            fe::EXECUTE => Expected::Execute,
            fe::CLOSE => Expected::Close,
            fe::SYNC => Expected::Sync,
            fe::COPY_DONE | fe::COPY_FAIL => Expected::CopyEnd,
            _ => return None,
        })
    }

    /// Entries that an error in an extended batch makes PostgreSQL skip.
    fn skipped_after_error(self) -> bool {
        matches!(
            self,
            Expected::Parse
                | Expected::Bind
                | Expected::Describe
                | Expected::Execute
                | Expected::Close
                | Expected::CopyEnd
        )
    }
}

/// [`ReplyQueue::queued_special`] holds at most this many; this value means "not counted".
const SPECIAL_UNCOUNTED: u8 = u8::MAX;

/// A COPY end marker, or a reply pgmemo gives itself: the entries the head is looked at for
/// after every server message (see [`ReplyQueue::queued_special`]).
#[inline]
fn is_special(entry: &Entry) -> bool {
    entry.expected == Expected::CopyEnd || matches!(entry.action, Action::Synthesize(_))
}

/// What an entry counts as among the queued work: its kind, but a query pgmemo sent for the
/// client whose outcome it knows (a kept block's `BEGIN`: [`Action::Skip`] on an
/// [`Expected::Internal`], see `session::deferred`) counts as nothing: it neither is the
/// client's work in flight nor leaves the transaction's state unknown.
fn counted_as(entry: &Entry) -> Option<Expected> {
    match (entry.expected, &entry.action) {
        (Expected::Internal, Action::Skip) => None,
        (e, _) => Some(e),
    }
}

/// What pgmemo does with the replies to one entry.
#[derive(Debug, Clone)]
pub enum Action {
    /// They are the client's.
    Forward,
    /// They answer a message pgmemo injected (a Parse the server lacked, a Close evicting a
    /// statement): swallowed, except an error, which the client must see because it stands for
    /// the client's message that needed the injection.
    Skip,
    /// Nothing was sent to the server; pgmemo answers itself when the entry reaches the head,
    /// where PostgreSQL would have answered.
    Synthesize(Synth),
    /// A message pgmemo sent on its own account, at a point between the client's units of
    /// work: every reply is swallowed, an error too (it concerns nothing the client sent).
    Silent,
    /// pgmemo's question for the primary's WAL position after a client's unit of work (see
    /// `session::replicas`): as [`Action::Silent`], its row read as it passes.
    Position,
    /// A message pgmemo sent to make the server fail at this point (so PostgreSQL's own
    /// error-skip and transaction rules apply); the client sees the error rewritten.
    ReplaceError(Box<ErrorRewrite>),
    /// A Bind or Describe of a client's statement under its server name: its replies pass
    /// through, but an error that names the statement names it as the client does. The
    /// [`ErrorRewrite::Rename`] is made when an error comes, from the entry's `Effect::Uses`
    /// (the statement, the client's name), rather than boxed for every Bind.
    Rename,
    /// Part of a simple query that runs as an autoprepared statement: the replies a simple
    /// query has no counterpart for (ParseComplete, BindComplete, NoData) are swallowed, an
    /// error is shown as the simple query's ([`ErrorRewrite::AsSimpleQuery`]).
    AsSimpleQuery,
    /// The Describe of such a query that writes: its RowDescription is held back
    /// ([`Route::Hold`]) until the statement has produced its first row or completed.
    AsSimpleQueryHeld,
}

impl Action {
    /// [`Action::ReplaceError`], its rewrite boxed: rare, and an entry without it stays small
    /// (an entry is 56 bytes, 136 before this and the boxed effects; entries are moved
    /// through the queue for every message).
    pub fn replace_error(rewrite: ErrorRewrite) -> Action {
        Action::ReplaceError(Box::new(rewrite))
    }
}

/// How the server's error is shown to the client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ErrorRewrite {
    /// PostgreSQL's error, with the quoted name `from` in its message replaced by `to` (the
    /// client's statement name instead of the placeholder pgmemo sent).
    Rename { from: Bytes, to: Bytes },
    /// pgmemo's own ErrorResponse message, whole.
    Whole(Bytes),
    /// For a statement in which pgmemo hid a reserved statement name (`sql::hide_reserved`):
    /// PostgreSQL's 26000 about the name pgmemo sent instead (`sql::NOWHERE`) is shown about
    /// the client's `name`, or as pgmemo's `refusal` (a whole ErrorResponse message); any
    /// other error is PostgreSQL's.
    Hidden { name: Bytes, refusal: Option<Bytes> },
    /// PostgreSQL's error with this message text instead of its own (`M`), when its own
    /// message is about a placeholder pgmemo sent; every other field is the server's.
    Message(Bytes),
    /// The error of an autoprepared query's Parse or Bind, as PostgreSQL reports it for the
    /// client's simple query (see `autoprepare::simple_error`).
    AsSimpleQuery,
}

impl ErrorRewrite {
    /// Writes the server's ErrorResponse `msg` (whole message) as the client is shown it:
    /// rewritten as `rewrite` says (None: as it is). `as_simple_query` writes an autoprepared
    /// query's error as PostgreSQL reports it for the simple query, if it can (false: it
    /// cannot, and the error goes as it is).
    pub fn write(
        rewrite: Option<ErrorRewrite>,
        out: &mut bytes::BytesMut,
        msg: &[u8],
        as_simple_query: impl FnOnce(&mut bytes::BytesMut, &[u8]) -> bool,
    ) {
        let body = crate::protocol::body(msg);
        match rewrite {
            Some(ErrorRewrite::Rename { from, to }) => {
                be::error_with_renamed(out, body, &from, &to)
            }
            Some(ErrorRewrite::Whole(bytes)) => out.extend_from_slice(&bytes),
            Some(ErrorRewrite::Hidden { name, refusal }) => {
                let hidden = be::ErrorFields::parse(body)
                    .is_some_and(|f| f.code == "26000" && f.message == command::NOWHERE_MISSING);
                match refusal {
                    _ if !hidden => out.extend_from_slice(msg),
                    Some(refusal) => out.extend_from_slice(&refusal),
                    None => be::error_with_renamed(out, body, command::NOWHERE.as_bytes(), &name),
                }
            }
            Some(ErrorRewrite::Message(message)) => error_with_message(out, body, &message),
            Some(ErrorRewrite::AsSimpleQuery) => {
                if !as_simple_query(out, body) {
                    out.extend_from_slice(msg)
                }
            }
            None => out.extend_from_slice(msg),
        }
    }
}

/// Writes the ErrorResponse `body` with its `M` field replaced by `message`.
pub fn error_with_message(out: &mut bytes::BytesMut, body: &[u8], message: &[u8]) {
    crate::protocol::write_message(out, be::ERROR_RESPONSE, |b| {
        for (code, value) in be::fields(body) {
            b.extend_from_slice(&[code]);
            b.extend_from_slice(if code == b'M' { message } else { value });
            b.extend_from_slice(&[0]);
        }
        b.extend_from_slice(&[0]);
    });
}

/// A reply pgmemo writes itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Synth {
    ParseComplete,
    CloseComplete,
    /// These replies, ready-made: the ParameterDescription and NoData of a Describe that
    /// PostgreSQL answers even in an aborted transaction block (a statement that returns no
    /// rows) while the server lacks the statement.
    Replies(Box<Bytes>),
    /// The reply to a simple-query `DEALLOCATE name` of a protocol-level statement:
    /// CommandComplete and ReadyForQuery (or 25P02 in a failed transaction).
    Deallocate,
}

/// One expected reply.
#[derive(Debug)]
pub struct Entry {
    pub expected: Expected,
    pub action: Action,
    pub effect: Option<Effect>,
}

/// How an entry with an [`Effect`] ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The server (or pgmemo) answered it.
    Done,
    /// It failed: the ErrorResponse was its answer.
    Failed,
    /// PostgreSQL never ran it (an earlier error in the batch).
    Discarded,
}

/// What to do with one server message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// It belongs to the client.
    Forward,
    /// It answers something pgmemo sent itself.
    Swallow,
    /// An error to be shown as [`ReplyQueue::take_replacement`] instead.
    Replace,
    /// Kept by the session until the rows it describes come (see
    /// [`Action::AsSimpleQueryHeld`]).
    Hold,
}

/// An entry in the queue.
#[derive(Debug)]
struct Queued {
    entry: Entry,
    /// This entry ends a unit of work (a Sync, or a simple query) whose bookkeeping may still
    /// be undone: counted in [`ReplyQueue::uncertain_units`] while queued.
    closes_uncertain: bool,
    /// This Sync ends a batch that may have opened a transaction block: counted in
    /// [`ReplyQueue::queued_openers`] while queued.
    closes_opener: bool,
}

impl std::ops::Deref for Queued {
    type Target = Entry;
    fn deref(&self) -> &Entry {
        &self.entry
    }
}

impl std::ops::DerefMut for Queued {
    fn deref_mut(&mut self) -> &mut Entry {
        &mut self.entry
    }
}

#[derive(Debug, Default)]
pub struct ReplyQueue {
    entries: VecDeque<Queued>,
    /// Units of work in flight (batches up to their Sync, simple queries) whose bookkeeping
    /// may still be undone because a message may fail or be discarded. While there are any,
    /// what the client's statements are depends on replies not yet in: see
    /// [`ReplyQueue::is_uncertain`].
    uncertain_units: u32,
    /// The open batch has a message the server answers (which may fail, making PostgreSQL
    /// discard the rest of the batch).
    open_fallible: bool,
    /// The open batch has bookkeeping that may be undone.
    open_uncertain: bool,
    /// Queued entries of the kinds that may change the transaction state, counted so that
    /// the planner's questions about them cost O(1): simple queries, Executes, Syncs, and
    /// pgmemo's own queries.
    queued_queries: u32,
    queued_executes: u32,
    queued_syncs: u32,
    queued_internal: u32,
    /// Syncs queued whose batches bound a statement that opens a transaction block (an
    /// extended-protocol `BEGIN`): until they are answered, a message after them may run in a
    /// block, aborted by an error in it (see [`ReplyQueue::may_have_opened_block`]).
    queued_openers: u32,
    /// Queued COPY end markers and replies pgmemo gives itself ([`is_special`]): while there
    /// are none, the questions about the head that only they answer
    /// ([`ReplyQueue::moved_on`]'s markers, [`ReplyQueue::head_is_synthesized`], asked for
    /// every server message) need no look at it. [`SPECIAL_UNCOUNTED`] from that many on
    /// (one byte, for an idle client's footprint): then the head is looked at until the
    /// queue is empty again.
    queued_special: u8,
    /// The open batch bound a statement that opens a transaction block.
    open_opener: bool,
    /// Effects whose entries have ended, in the order they must be applied (undos of one
    /// error newest first). The session drains it after every message.
    outcomes: Vec<(Effect, Outcome)>,
    /// Boxed: rare, and every client holds a queue.
    replacement: Option<Box<ErrorRewrite>>,
    /// The client sent extended-protocol messages (Parse, Bind, Describe, Execute, Close) and
    /// no Sync since. PostgreSQL keeps the batch's implicit transaction open until that Sync
    /// (and, after an error, discards everything up to it), so the server is not free even
    /// when every reply is in: see [`ReplyQueue::is_idle`].
    open_batch: bool,
    /// An error ended the open batch and no Sync has been queued since: PostgreSQL discards
    /// every message up to the next Sync, so those messages expect no reply.
    skipping: bool,
    /// The server is in COPY IN (a CopyInResponse arrived) and the client has not ended it
    /// yet: PostgreSQL ignores the Syncs the client sends meanwhile.
    copy_in: bool,
    /// An error ended a COPY IN while the client was still sending it: its data up to its
    /// CopyDone or CopyFail are ignored by PostgreSQL (see [`ReplyQueue::takes_copy_message`]).
    copy_failed: bool,
}

impl ReplyQueue {
    pub fn new() -> Self {
        // Empty until the first query: an entry is over a hundred bytes, and an idle client
        // should cost as little as possible (the queue grows to the depth the client uses).
        ReplyQueue::default()
    }

    /// Queues a plain entry: replies forwarded, no bookkeeping.
    #[inline]
    pub fn push(&mut self, e: Expected) {
        self.push_entry(Entry {
            expected: e,
            action: Action::Forward,
            effect: None,
        });
    }

    #[inline]
    pub fn push_entry(&mut self, entry: Entry) {
        self.push_known(entry);
    }

    /// [`ReplyQueue::push_entry`], always inlined: for a caller whose entries' kinds and
    /// actions are constants (an autoprepared query's Bind, Describe, Execute and Sync), the
    /// tests on them fold away (~100 instructions a query, callgrind).
    #[inline(always)]
    pub fn push_known(&mut self, entry: Entry) {
        let e = entry.expected;
        if e != Expected::Internal && e != Expected::CopyEnd {
            // The client went on without ending the COPY that failed.
            self.copy_failed = false;
        }
        match e {
            // Ignored by PostgreSQL in COPY IN (libpq sends one right after the Execute of a
            // COPY, not knowing it is one): it neither ends the batch nor gets an answer.
            Expected::Sync if self.copy_in => return,
            Expected::Sync => {
                self.open_batch = false;
                self.skipping = false;
            }
            // A COPY that an error ended, or that never began: PostgreSQL ignores the client's
            // end of it, and no reply would ever take the marker off the queue.
            Expected::CopyEnd if !self.copy_in && !self.may_start_copy() => return,
            Expected::CopyEnd => self.copy_in = false,
            Expected::Parse
            | Expected::Bind
            | Expected::Describe
            | Expected::Execute
            | Expected::Close => self.open_batch = true,
            // A simple query inside an open batch does not end it: if an earlier message of
            // the batch fails, PostgreSQL discards the query too.
            Expected::Query | Expected::Internal => {}
        }
        if self.skipping && e != Expected::Internal {
            // Discarded by the server, never answered.
            if let Some(effect) = entry.effect {
                self.outcomes.push((effect, Outcome::Discarded));
            }
            return;
        }
        // Bookkeeping that may still be undone: its message may fail, or be discarded because
        // an earlier message of its batch fails.
        let uncertain = entry.effect.as_ref().is_some_and(|effect| {
            effect.matters_for_planning()
                && (self.open_fallible
                    || (!matches!(entry.action, Action::Synthesize(_))
                        && effect.undone_on_failure()))
        });
        let mut closes_uncertain = false;
        let mut closes_opener = false;
        match e {
            Expected::Sync => {
                closes_uncertain = self.open_uncertain;
                closes_opener = std::mem::take(&mut self.open_opener);
                self.open_uncertain = false;
                self.open_fallible = false;
            }
            // A simple query counts at once: later messages run even if it fails.
            Expected::Query => closes_uncertain = uncertain,
            _ => {
                self.open_uncertain |= uncertain;
                if !matches!(entry.action, Action::Synthesize(_)) && e != Expected::Internal {
                    self.open_fallible = true;
                }
            }
        }
        self.uncertain_units += u32::from(closes_uncertain);
        self.queued_openers += u32::from(closes_opener);
        if let Some(e) = counted_as(&entry) {
            self.count(e, 1);
        }
        if is_special(&entry) && self.queued_special != SPECIAL_UNCOUNTED {
            self.queued_special += 1;
        }
        self.entries.push_back(Queued {
            entry,
            closes_uncertain,
            closes_opener,
        });
    }

    /// What a Parse pgmemo answers at once leaves of the queue, with nothing queued and no
    /// error being skipped: its entry pushed ([`ReplyQueue::push_known`]: the batch open, a
    /// failed COPY left behind) and taken off again at once ([`ReplyQueue::pop_synthesized`]:
    /// no effect, nothing counted). Without the two moves of an entry (see
    /// `Session::answer_parse_in_lane`; a unit test checks the queue comes out the same).
    #[inline]
    pub fn parse_answered_at_once(&mut self) {
        debug_assert!(self.entries.is_empty() && !self.skipping);
        self.copy_failed = false;
        self.open_batch = true;
    }

    /// Whether bookkeeping of an earlier unit of work (a batch up to its Sync, a simple
    /// query) may still be undone. Messages of the open batch do not count: if they fail,
    /// PostgreSQL discards whatever follows them in the batch as well.
    pub fn is_uncertain(&self) -> bool {
        self.uncertain_units > 0
    }

    /// Takes the head entry off the queue.
    #[inline]
    fn take_front(&mut self) -> Option<Entry> {
        let queued = self.entries.pop_front()?;
        self.removed(&queued);
        Some(queued.entry)
    }

    /// Counts `queued` out, taken off the queue.
    #[inline]
    fn removed(&mut self, queued: &Queued) {
        self.uncertain_units -= u32::from(queued.closes_uncertain);
        self.queued_openers -= u32::from(queued.closes_opener);
        if let Some(e) = counted_as(&queued.entry) {
            self.count(e, -1);
        }
        self.special_removed(&queued.entry);
    }

    /// Counts out a special entry (see [`ReplyQueue::queued_special`]) taken off the queue.
    #[inline]
    fn special_removed(&mut self, entry: &Entry) {
        if self.entries.is_empty() {
            self.queued_special = 0;
        } else if is_special(entry) && self.queued_special != SPECIAL_UNCOUNTED {
            self.queued_special -= 1;
        }
    }

    #[inline]
    fn count(&mut self, e: Expected, by: i32) {
        let counter = match e {
            Expected::Query => &mut self.queued_queries,
            Expected::Execute => &mut self.queued_executes,
            Expected::Sync => &mut self.queued_syncs,
            Expected::Internal => &mut self.queued_internal,
            _ => return,
        };
        *counter = counter.wrapping_add_signed(by);
    }

    /// PostgreSQL is discarding messages until the client's next Sync: whatever the client
    /// sends now needs no planning.
    pub fn is_skipping(&self) -> bool {
        self.skipping
    }

    /// Whether something still unanswered may change the transaction state (a query, an
    /// Execute, a Sync).
    pub fn may_change_transaction(&self) -> bool {
        self.has_pending_work() || self.queued_internal > 0
    }

    /// Whether a Sync of the client's is still unanswered.
    #[inline]
    pub fn syncs_queued(&self) -> bool {
        self.queued_syncs > 0
    }

    /// Whether a simple query, an Execute or a Sync of the client is still unanswered.
    pub fn has_pending_work(&self) -> bool {
        self.queued_queries + self.queued_executes + self.queued_syncs > 0
    }

    /// Whether the head entry is the first statement of an implicit transaction, whose batch
    /// may be sent again (see `planner::Retry`).
    pub fn head_is_retry_point(&self) -> bool {
        matches!(
            self.entries.front().and_then(|e| e.effect.as_ref()),
            Some(Effect::Uses { retry: true, .. })
        )
    }

    /// The head entry's replies are pgmemo's own from now on, swallowed ([`Action::Silent`]):
    /// the Sync of an autoprepared query that failed, whose plan check's ReadyForQuery is the
    /// client's instead (`Session::check_plan`). Its effect settles as before.
    pub fn silence_head(&mut self) {
        if let Some(head) = self.entries.front_mut() {
            let special = is_special(&head.entry);
            head.entry.action = Action::Silent;
            if special && !is_special(&head.entry) && self.queued_special != SPECIAL_UNCOUNTED {
                self.queued_special -= 1;
            }
        }
    }

    /// Whether the head entry is the Bind of a simple query run as an autoprepared statement.
    /// Whether the head entry is pgmemo's question for a WAL position ([`Action::Position`]).
    pub fn head_is_position(&self) -> bool {
        self.entries
            .front()
            .is_some_and(|e| matches!(e.action, Action::Position))
    }

    /// Whether nothing but pgmemo's question for a WAL position is in flight.
    pub fn only_position_pending(&self) -> bool {
        self.entries.len() == 1 && self.head_is_position()
    }

    /// Whether the last entry queued is a client's unit of work's end: a simple query's, or
    /// a Sync's.
    pub fn ends_with_unit(&self) -> bool {
        self.entries.back().is_some_and(|e| {
            matches!(e.expected, Expected::Query | Expected::Sync)
                && matches!(e.action, Action::Forward)
        })
    }

    pub fn head_is_autoprepared_bind(&self) -> bool {
        self.entries.front().is_some_and(|e| {
            e.expected == Expected::Bind && matches!(e.action, Action::AsSimpleQuery)
        })
    }

    /// The statement (and its generation as sent) the head entry describes, when it is a
    /// client's Describe of a statement.
    pub fn head_describes(&self) -> Option<(&std::sync::Arc<crate::statements::Statement>, u32)> {
        let head = self.entries.front()?;
        match &head.effect {
            Some(Effect::Uses {
                statement,
                generation,
                ..
            }) if head.expected == Expected::Describe => Some((statement, *generation)),
            _ => None,
        }
    }

    /// A DataRow of pgmemo's own: if the head entry is autoprepare's check of a statement's
    /// parameter types, its row came (see [`Effect::CheckTypes`]).
    #[cold]
    pub fn note_checked_types(&mut self) {
        if let Some(Effect::CheckTypes { passed, .. }) = self
            .entries
            .front_mut()
            .and_then(|e| e.entry.effect.as_mut())
        {
            *passed = true;
        }
    }

    /// Whether a query pgmemo sent on the client's behalf (a kept block's `BEGIN`, see
    /// [`counted_as`]) is still unanswered: the server's last ReadyForQuery may then predate
    /// the transaction block the client's next statement runs in.
    pub fn has_query_for_client(&self) -> bool {
        self.entries.iter().any(|e| counted_as(e).is_none())
    }

    /// Whether a simple query's reply is still outstanding.
    pub fn has_pending_query(&self) -> bool {
        self.queued_queries > 0
    }

    /// The open batch binds a statement that opens a transaction block (`BEGIN`, `START
    /// TRANSACTION`): see [`ReplyQueue::may_have_opened_block`].
    pub fn note_block_opener(&mut self) {
        self.open_opener = true;
    }

    /// Whether a batch still unanswered, ended by its Sync, may have opened a transaction
    /// block: a message the client sent after that Sync may then run in a block, and in an
    /// aborted one if a statement failed there (`BEGIN; Sync; RELEASE x; Sync; Parse ...`).
    pub fn may_have_opened_block(&self) -> bool {
        self.queued_openers > 0
    }

    /// The server is in COPY IN, waiting for the client's data.
    pub fn in_copy_in(&self) -> bool {
        self.copy_in
    }

    /// Whether a CopyData, CopyDone or CopyFail (`tag`) the client sends now is read by
    /// PostgreSQL: while its server is in COPY IN, or a COPY may yet begin (a query or an
    /// Execute is unanswered; a client may send data before the CopyInResponse arrives). Not
    /// after an error ended the COPY the client is still sending: PostgreSQL answers at once
    /// (ErrorResponse, ReadyForQuery after a simple query) and ignores the rest of the data,
    /// and so does pgmemo, which drops them. The CopyDone or CopyFail dropped ends that COPY
    /// on the client's side too.
    pub fn takes_copy_message(&mut self, tag: u8) -> bool {
        use crate::protocol::frontend as fe;
        if self.copy_failed {
            self.copy_failed = tag == fe::COPY_DATA;
            return false;
        }
        self.copy_in || self.may_start_copy()
    }

    /// An unanswered query or Execute may yet start a COPY.
    fn may_start_copy(&self) -> bool {
        self.queued_queries + self.queued_executes > 0
    }

    /// The client has an extended-protocol batch open (no Sync since its last message).
    pub fn in_batch(&self) -> bool {
        self.open_batch
    }

    /// No reply is outstanding.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// No reply is outstanding and no extended-protocol batch is waiting for its Sync: the
    /// server may go to another client (transaction mode) or be reset.
    #[inline]
    pub fn is_idle(&self) -> bool {
        self.entries.is_empty() && !self.open_batch
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Forgets everything (the server connection is gone). Effects still pending are reported
    /// as discarded so their bookkeeping is undone.
    pub fn clear(&mut self) {
        while let Some(queued) = self.entries.pop_back() {
            if let Some(effect) = queued.entry.effect {
                self.outcomes.push((effect, Outcome::Discarded));
            }
        }
        self.uncertain_units = 0;
        self.queued_queries = 0;
        self.queued_executes = 0;
        self.queued_syncs = 0;
        self.queued_internal = 0;
        self.queued_openers = 0;
        self.queued_special = 0;
        self.open_opener = false;
        self.open_fallible = false;
        self.open_uncertain = false;
        self.open_batch = false;
        self.skipping = false;
        self.copy_in = false;
        self.copy_failed = false;
    }

    /// Whether entries with effects ended since the last [`ReplyQueue::drain_outcomes`].
    #[inline]
    pub fn has_outcomes(&self) -> bool {
        !self.outcomes.is_empty()
    }

    /// Ended effects to apply, in order.
    #[inline]
    pub fn drain_outcomes(&mut self) -> Option<std::vec::Drain<'_, (Effect, Outcome)>> {
        if self.outcomes.is_empty() {
            None
        } else {
            Some(self.outcomes.drain(..))
        }
    }

    /// The error to show instead of the one just routed as [`Route::Replace`].
    pub fn take_replacement(&mut self) -> Option<ErrorRewrite> {
        self.replacement.take().map(|r| *r)
    }

    /// How [`Self::on_server_message`] routes a reply `tag` (a ParseComplete, BindComplete,
    /// RowDescription, NoData, DataRow or CommandComplete: not an error, a notice, a
    /// notification or a ParameterStatus) to the head entry, when the relay lane may take it:
    /// the client's own entry, its replies relayed as they are, or an autoprepared query's,
    /// whose replies a simple query has no counterpart for are swallowed and whose
    /// RowDescription may be held; with the head's kind, for [`Self::moved_on`]. None: the
    /// head is pgmemo's, or nothing is queued. (Its routes are `on_server_message`'s, a unit
    /// test checks, without its other arms.)
    #[inline]
    pub fn lane_route(&self, tag: u8) -> Option<(Expected, Route)> {
        let q = self.entries.front()?;
        if q.entry.expected == Expected::Internal {
            return None;
        }
        let route = match q.entry.action {
            Action::Forward | Action::ReplaceError(_) | Action::Rename => Route::Forward,
            Action::AsSimpleQuery | Action::AsSimpleQueryHeld => match tag {
                be::PARSE_COMPLETE | be::BIND_COMPLETE | be::NO_DATA => Route::Swallow,
                be::ROW_DESCRIPTION if matches!(q.entry.action, Action::AsSimpleQueryHeld) => {
                    Route::Hold
                }
                _ => Route::Forward,
            },
            _ => return None,
        };
        Some((q.entry.expected, route))
    }

    /// Whether the head of the queue is a reply pgmemo gives itself ([`Self::pop_synthesized`]).
    #[inline]
    pub fn head_is_synthesized(&self) -> bool {
        debug_assert!(
            self.queued_special != 0
                || !self
                    .entries
                    .front()
                    .is_some_and(|q| matches!(q.entry.action, Action::Synthesize(_))),
            "a synthesized reply queued uncounted"
        );
        self.queued_special != 0
            && self
                .entries
                .front()
                .is_some_and(|q| matches!(q.entry.action, Action::Synthesize(_)))
    }

    /// If the head is a reply pgmemo answers itself, takes it.
    #[inline]
    pub fn pop_synthesized(&mut self) -> Option<Synth> {
        let Some(Entry {
            action: Action::Synthesize(synth),
            ..
        }) = self.entries.front().map(|q| &q.entry)
        else {
            return None;
        };
        let synth = synth.clone();
        self.pop_done();
        Some(synth)
    }

    #[inline]
    fn pop_done(&mut self) {
        let Some(entry) = self.take_front() else {
            return;
        };
        // Most entries end with nothing to note (a Bind's use, a portal message's reply):
        // their effect, if any, is dropped where it lies.
        if let Some(effect) = entry.effect {
            if effect.matters_when_done() {
                self.outcomes.push((effect, Outcome::Done));
            }
        }
    }

    /// Drops the COPY end markers at the head.
    #[cold]
    fn drop_copy_ends(&mut self) {
        while self
            .entries
            .front()
            .is_some_and(|e| e.expected == Expected::CopyEnd)
        {
            self.pop_done();
        }
    }

    /// Queues the replies to autoprepare's plan check (`autoprepare::write_plan_check`: Parse
    /// and Bind of the client's text, Sync, Close, Sync), sent after the failed query whose
    /// Sync is at the head: that Sync's ReadyForQuery is pgmemo's, the check's first Sync
    /// answers the client (with the check's error, if its Parse or Bind fails), and the
    /// Close's are pgmemo's.
    pub fn push_plan_check(&mut self) {
        self.silence_head();
        for (expected, action) in [
            (Expected::Parse, Action::Skip),
            (Expected::Bind, Action::Skip),
            (Expected::Sync, Action::Forward),
            (Expected::Close, Action::Silent),
            (Expected::Sync, Action::Silent),
        ] {
            self.push_entry(Entry {
                expected,
                action,
                effect: None,
            });
        }
    }

    /// Whether the reply at hand answers one of pgmemo's own queries (a parameter sync, a
    /// probe, a reset), not a statement of the client's (a SQL-level statement of the
    /// client's prepared again, [`Effect::SqlSync`], is the client's).
    #[inline]
    pub fn answers_internal(&self) -> bool {
        self.entries.front().is_some_and(|head| {
            head.expected == Expected::Internal
                && !matches!(head.effect, Some(Effect::SqlSync { .. }))
        })
    }

    /// Matches one server message against the head of the queue and advances it.
    // Always inlined into its one caller, the session's routing loop: called for every server
    // message, it is measurably cheaper there (bench/profile.sh).
    #[inline(always)]
    pub fn on_server_message(&mut self, tag: u8) -> Route {
        let Some(head) = self.entries.front() else {
            // Nothing outstanding: asynchronous traffic (NOTIFY in session mode, a FATAL
            // before a shutdown). It is the client's, if anyone's. An ERROR here answers a
            // malformed Flush, which PostgreSQL treats as part of an extended batch: it now
            // skips to the next Sync.
            if tag == be::ERROR_RESPONSE {
                self.open_batch = true;
                self.skipping = true;
            }
            return Route::Forward;
        };
        let kind = head.expected;
        let route = match (&head.action, tag) {
            // The client's own entries, most replies: every arm below says Forward for them.
            (Action::Forward, _) if kind != Expected::Internal => Route::Forward,
            // A notification is the client's whatever pgmemo is doing on its server: the
            // server sends it when it goes idle, which may be at the end of pgmemo's own work.
            (_, be::NOTIFICATION_RESPONSE) => Route::Forward,
            (Action::Silent | Action::Position, _) => Route::Swallow,
            // A query pgmemo sent for the client (a kept block's BEGIN): its error is shown.
            (Action::Skip, be::ERROR_RESPONSE) if kind == Expected::Internal => Route::Forward,
            (_, be::ERROR_RESPONSE) if kind == Expected::Internal => Route::Swallow,
            (
                Action::ReplaceError(_) | Action::Rename | Action::AsSimpleQuery,
                be::ERROR_RESPONSE,
            ) => Route::Replace,
            (
                Action::AsSimpleQuery | Action::AsSimpleQueryHeld,
                be::PARSE_COMPLETE | be::BIND_COMPLETE | be::NO_DATA,
            ) => Route::Swallow,
            (Action::AsSimpleQueryHeld, be::ROW_DESCRIPTION) => Route::Hold,
            (_, be::ERROR_RESPONSE | be::NOTICE_RESPONSE) => Route::Forward,
            (Action::Skip, _) => Route::Swallow,
            _ if kind == Expected::Internal => Route::Swallow,
            _ => Route::Forward,
        };
        self.moved_on(kind, tag);
        route
    }

    /// The head entry (of kind `kind`) got the server's message `tag`: it is done with, or
    /// it ends, or an error's bookkeeping is made; then COPY's end markers at the head go.
    /// (The second half of [`Self::on_server_message`], the relay lane's whole.)
    #[inline(always)]
    pub fn moved_on(&mut self, kind: Expected, tag: u8) {
        // Whether the message completes the head entry: one call of `pop_done` below, inlined
        // (a call from each arm, as it was, cost ~100 instructions a transaction, callgrind).
        let done = match tag {
            // Asynchronous messages never complete anything.
            be::NOTICE_RESPONSE | be::NOTIFICATION_RESPONSE | be::PARAMETER_STATUS => false,
            be::READY_FOR_QUERY => {
                matches!(kind, Expected::Query | Expected::Internal | Expected::Sync)
            }
            be::ERROR_RESPONSE => {
                self.on_error(kind);
                false
            }
            be::COMMAND_COMPLETE if kind == Expected::Query => {
                // One more statement of the query ran.
                if let Some(effect) = self.entries.front_mut().and_then(|e| e.effect.as_mut()) {
                    effect.command_completed();
                }
                false
            }
            be::PARSE_COMPLETE => kind == Expected::Parse,
            be::BIND_COMPLETE => kind == Expected::Bind,
            be::CLOSE_COMPLETE => kind == Expected::Close,
            be::ROW_DESCRIPTION | be::NO_DATA => kind == Expected::Describe,
            be::COMMAND_COMPLETE | be::EMPTY_QUERY_RESPONSE | be::PORTAL_SUSPENDED => {
                kind == Expected::Execute
            }
            be::COPY_IN_RESPONSE => {
                self.on_copy_in();
                false
            }
            _ => false,
        };
        if done {
            self.pop_done();
        }
        // Markers carry no reply: drop them once they reach the head.
        debug_assert!(
            self.queued_special != 0
                || !self
                    .entries
                    .front()
                    .is_some_and(|q| q.entry.expected == Expected::CopyEnd),
            "a COPY end marker queued uncounted"
        );
        if self.queued_special != 0
            && self
                .entries
                .front()
                .is_some_and(|e| e.expected == Expected::CopyEnd)
        {
            self.drop_copy_ends();
        }
    }

    /// An ErrorResponse to the head entry (of kind `kind`): a COPY IN ends, the error's
    /// rewrite is kept for the session, and what PostgreSQL now skips is undone.
    fn on_error(&mut self, kind: Expected) {
        // An error ends a COPY IN on the server's side; later Syncs count again, and
        // what the client still sends of it is ignored.
        self.copy_failed |= self.copy_in;
        self.copy_in = false;
        match self.entries.front().map(|e| (&e.action, &e.effect)) {
            Some((Action::ReplaceError(rewrite), _)) => self.replacement = Some(rewrite.clone()),
            Some((
                Action::Rename,
                Some(Effect::Uses {
                    statement, name, ..
                }),
            )) => {
                self.replacement = Some(Box::new(ErrorRewrite::Rename {
                    from: statement.server_name_bytes.clone(),
                    to: name
                        .as_deref()
                        .map(Bytes::copy_from_slice)
                        .unwrap_or_default(),
                }))
            }
            Some((Action::AsSimpleQuery, _)) => {
                self.replacement = Some(Box::new(ErrorRewrite::AsSimpleQuery))
            }
            _ => {}
        }
        if kind.skipped_after_error() {
            // PostgreSQL discards every message up to the next Sync, simple queries
            // and function calls included; if none is queued yet, what the client
            // sends until its Sync is discarded too. Their bookkeeping is undone,
            // newest first.
            let mut ended = Vec::new();
            let mut first = true;
            while self
                .entries
                .front()
                .is_some_and(|e| e.expected != Expected::Sync)
            {
                let entry = self.take_front().expect("checked");
                if let Some(effect) = entry.effect {
                    let outcome = if first {
                        Outcome::Failed
                    } else {
                        Outcome::Discarded
                    };
                    ended.push((effect, outcome));
                }
                first = false;
            }
            self.outcomes.extend(ended.into_iter().rev());
            if self.entries.is_empty() {
                self.skipping = true;
                // The open batch's bookkeeping has been undone.
                self.open_fallible = false;
                self.open_uncertain = false;
            }
        } else if let Some(entry) = self.entries.front_mut() {
            // A simple query (or Sync) goes on to its ReadyForQuery; its effect failed.
            if let Some(effect) = entry.effect.take() {
                self.outcomes.push((effect, Outcome::Failed));
            }
        }
    }

    /// CopyInResponse: the Syncs the client sent inside the COPY are ignored by PostgreSQL.
    #[cold]
    fn on_copy_in(&mut self) {
        // Syncs sent before the client ended this COPY are ignored by PostgreSQL.
        let copy_end = self
            .entries
            .iter()
            .position(|e| e.expected == Expected::CopyEnd);
        // Not ended yet: so are the Syncs the client sends from now on.
        self.copy_in = copy_end.is_none();
        let mut end = copy_end.unwrap_or(self.entries.len());
        let mut i = 1;
        while i < end {
            if self.entries[i].expected == Expected::Sync {
                if let Some(sync) = self.entries.remove(i) {
                    self.uncertain_units -= u32::from(sync.closes_uncertain);
                    self.count(Expected::Sync, -1);
                    self.special_removed(&sync.entry);
                }
                end -= 1;
            } else {
                i += 1;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Entries are moved into and out of the queue for every message: a rare effect's
    /// payload is boxed (as `Effect::Bound`'s and `Action::ReplaceError`'s are) rather than
    /// make every entry larger.
    #[test]
    fn an_entry_stays_within_eight_words() {
        assert!(
            std::mem::size_of::<Queued>() <= 64,
            "{} bytes",
            std::mem::size_of::<Queued>()
        );
        assert!(std::mem::size_of::<Effect>() <= 32);
    }

    #[test]
    fn pipeline_completes_in_order() {
        let mut q = ReplyQueue::new();
        for e in [
            Expected::Parse,
            Expected::Bind,
            Expected::Describe,
            Expected::Execute,
            Expected::Sync,
        ] {
            q.push(e);
        }
        for tag in [
            be::PARSE_COMPLETE,
            be::BIND_COMPLETE,
            be::ROW_DESCRIPTION,
            be::DATA_ROW,
            be::COMMAND_COMPLETE,
        ] {
            assert_eq!(q.on_server_message(tag), Route::Forward);
        }
        assert_eq!(q.len(), 1);
        q.on_server_message(be::READY_FOR_QUERY);
        assert!(q.is_empty());
    }

    /// The head is a reply pgmemo gives itself exactly when one is queued there, however
    /// many are queued (past the count's byte too), and whichever way they leave: answered,
    /// silenced, discarded by an error.
    #[test]
    fn replies_pgmemo_gives_itself_are_found_at_the_head_however_many() {
        let synthesized = |q: &mut ReplyQueue| {
            q.push_entry(Entry {
                expected: Expected::Parse,
                action: Action::Synthesize(Synth::ParseComplete),
                effect: None,
            })
        };
        for n in [1, 3, 254, 255, 256, 600] {
            let mut q = ReplyQueue::new();
            q.push(Expected::Bind);
            for _ in 0..n {
                synthesized(&mut q);
            }
            q.push(Expected::Sync);
            assert!(!q.head_is_synthesized(), "{n}: a Bind first");
            q.on_server_message(be::BIND_COMPLETE);
            for i in 0..n {
                assert!(q.head_is_synthesized(), "{n}: {i}");
                assert_eq!(q.pop_synthesized(), Some(Synth::ParseComplete));
            }
            assert!(!q.head_is_synthesized(), "{n}: the Sync");
            q.on_server_message(be::READY_FOR_QUERY);
            assert!(q.is_empty());
            // Counted afresh once the queue is empty.
            synthesized(&mut q);
            assert!(q.head_is_synthesized(), "{n}: again");
            q.silence_head();
            assert!(!q.head_is_synthesized(), "{n}: silenced");
        }
        // Discarded by an error before it: none left at the head.
        let mut q = ReplyQueue::new();
        q.push(Expected::Bind);
        synthesized(&mut q);
        q.push(Expected::Sync);
        q.on_server_message(be::ERROR_RESPONSE);
        assert!(!q.head_is_synthesized());
        q.on_server_message(be::READY_FOR_QUERY);
        assert!(q.is_empty());
        synthesized(&mut q);
        assert!(q.head_is_synthesized());
    }

    /// A Parse answered at once leaves the queue as its entry pushed and taken again does,
    /// whatever the flags an idle queue may carry (see `session::lane`).
    #[test]
    fn a_parse_answered_at_once_leaves_the_queue_as_its_entry_does() {
        for flags in 0..32u32 {
            let queue = || {
                let mut q = ReplyQueue::new();
                q.copy_failed = flags & 1 != 0;
                q.open_batch = flags & 2 != 0;
                q.open_fallible = flags & 4 != 0;
                q.open_uncertain = flags & 8 != 0;
                q.open_opener = flags & 16 != 0;
                q
            };
            let (mut entry, mut at_once) = (queue(), queue());
            entry.push_known(Entry {
                expected: Expected::Parse,
                action: Action::Synthesize(Synth::ParseComplete),
                effect: None,
            });
            assert!(matches!(
                entry.pop_synthesized(),
                Some(Synth::ParseComplete)
            ));
            at_once.parse_answered_at_once();
            assert_eq!(
                format!("{at_once:?}"),
                format!("{entry:?}"),
                "flags {flags:#b}"
            );
        }
    }

    /// The relay lane's route of a reply is `on_server_message`'s, and moving the queue on
    /// leaves it as `on_server_message` does, for every kind of entry and action the lane
    /// takes and every reply it takes (see `session::lane`).
    #[test]
    fn the_lanes_route_is_the_queues() {
        let kinds = [
            Expected::Query,
            Expected::Parse,
            Expected::Bind,
            Expected::Describe,
            Expected::Execute,
            Expected::Close,
            Expected::Sync,
            Expected::Internal,
        ];
        let actions = || {
            [
                Action::Forward,
                Action::Skip,
                Action::Silent,
                Action::Position,
                Action::replace_error(ErrorRewrite::Whole(Bytes::from_static(b"E"))),
                Action::Rename,
                Action::AsSimpleQuery,
                Action::AsSimpleQueryHeld,
            ]
        };
        let tags = [
            be::PARSE_COMPLETE,
            be::BIND_COMPLETE,
            be::ROW_DESCRIPTION,
            be::NO_DATA,
            be::DATA_ROW,
            be::COMMAND_COMPLETE,
        ];
        let mut taken = 0;
        for kind in kinds {
            for i in 0..actions().len() {
                for tag in tags {
                    // The entry, and a Sync after it.
                    let queue = || {
                        let mut q = ReplyQueue::new();
                        let action = actions().into_iter().nth(i).expect("an action");
                        for (expected, action) in
                            [(kind, action), (Expected::Sync, Action::Forward)]
                        {
                            q.push_entry(Entry {
                                expected,
                                action,
                                effect: None,
                            });
                        }
                        q
                    };
                    let (mut lane, mut stages) = (queue(), queue());
                    let Some((head, route)) = lane.lane_route(tag) else {
                        continue;
                    };
                    taken += 1;
                    assert_eq!(head, kind);
                    assert_eq!(route, stages.on_server_message(tag), "{kind:?} {tag}");
                    lane.moved_on(head, tag);
                    assert_eq!(lane.len(), stages.len(), "{kind:?} {tag}");
                }
            }
        }
        // Five actions of seven kinds (not Internal), six replies each.
        assert_eq!(taken, 5 * 7 * 6);
    }

    #[test]
    fn error_skips_to_sync_but_not_past_it() {
        let mut q = ReplyQueue::new();
        for e in [
            Expected::Parse,
            Expected::Bind,
            Expected::Execute,
            Expected::Sync,
            Expected::Parse,
            Expected::Sync,
        ] {
            q.push(e);
        }
        q.on_server_message(be::ERROR_RESPONSE);
        assert_eq!(q.len(), 3);
        q.on_server_message(be::READY_FOR_QUERY);
        assert_eq!(q.len(), 2);
        q.on_server_message(be::PARSE_COMPLETE);
        q.on_server_message(be::READY_FOR_QUERY);
        assert!(q.is_empty());
    }

    /// pgx's TestListenNotify through pgmemo lost a notification about once in 800 runs: it
    /// came while pgmemo's own work was at the head of the queue, and went with its replies.
    #[test]
    fn a_notification_reaches_the_client_whatever_pgmemo_is_doing() {
        let mut q = ReplyQueue::new();
        q.push(Expected::Internal);
        q.push_entry(Entry {
            expected: Expected::Parse,
            action: Action::Silent,
            effect: None,
        });
        q.push_entry(Entry {
            expected: Expected::Sync,
            action: Action::Skip,
            effect: None,
        });
        assert_eq!(
            q.on_server_message(be::NOTIFICATION_RESPONSE),
            Route::Forward
        );
        assert_eq!(q.on_server_message(be::COMMAND_COMPLETE), Route::Swallow);
        assert_eq!(q.on_server_message(be::READY_FOR_QUERY), Route::Swallow);
        assert_eq!(
            q.on_server_message(be::NOTIFICATION_RESPONSE),
            Route::Forward
        );
        assert_eq!(q.on_server_message(be::PARSE_COMPLETE), Route::Swallow);
        assert_eq!(
            q.on_server_message(be::NOTIFICATION_RESPONSE),
            Route::Forward
        );
        assert_eq!(q.on_server_message(be::READY_FOR_QUERY), Route::Swallow);
        assert!(q.is_empty());
    }

    #[test]
    fn internal_query_is_swallowed_and_client_query_forwarded() {
        let mut q = ReplyQueue::new();
        q.push(Expected::Internal);
        q.push(Expected::Query);
        assert_eq!(q.on_server_message(be::COMMAND_COMPLETE), Route::Swallow);
        assert_eq!(q.on_server_message(be::ERROR_RESPONSE), Route::Swallow);
        assert_eq!(q.on_server_message(be::READY_FOR_QUERY), Route::Swallow);
        assert_eq!(q.on_server_message(be::ERROR_RESPONSE), Route::Forward);
        assert_eq!(q.on_server_message(be::READY_FOR_QUERY), Route::Forward);
        assert!(q.is_empty());
    }

    #[test]
    fn syncs_during_copy_in_are_not_expected() {
        let mut q = ReplyQueue::new();
        // B E S (data...) CopyDone S: PostgreSQL ignores the first Sync.
        for tag in [b'B', b'E', b'S', b'c', b'S'] {
            if let Some(e) = Expected::for_client_message(tag) {
                q.push(e);
            }
        }
        q.on_server_message(be::BIND_COMPLETE);
        q.on_server_message(be::COPY_IN_RESPONSE);
        q.on_server_message(be::COMMAND_COMPLETE);
        assert_eq!(q.len(), 1);
        q.on_server_message(be::READY_FOR_QUERY);
        assert!(q.is_empty());
    }

    #[test]
    fn syncs_sent_after_copy_in_response_are_not_expected() {
        let mut q = ReplyQueue::new();
        // P B E S, then CopyInResponse, then (data) Flush Sync (data) CopyDone Sync.
        for tag in [b'P', b'B', b'E', b'S'] {
            q.push(Expected::for_client_message(tag).unwrap());
        }
        q.on_server_message(be::PARSE_COMPLETE);
        q.on_server_message(be::BIND_COMPLETE);
        q.on_server_message(be::COPY_IN_RESPONSE);
        for tag in [b'S', b'c', b'S'] {
            q.push(Expected::for_client_message(tag).unwrap());
        }
        q.on_server_message(be::COMMAND_COMPLETE);
        q.on_server_message(be::READY_FOR_QUERY);
        assert!(q.is_idle(), "{q:?}");
        // The next query is matched with its own ReadyForQuery.
        q.push(Expected::Query);
        q.on_server_message(be::COMMAND_COMPLETE);
        assert!(!q.is_empty());
        q.on_server_message(be::READY_FOR_QUERY);
        assert!(q.is_idle());
    }

    #[test]
    fn the_rest_of_a_copy_an_error_ended_expects_nothing() {
        use crate::protocol::frontend as fe;
        let mut q = ReplyQueue::new();
        q.push(Expected::Query);
        // Data sent before the CopyInResponse arrives is the server's.
        assert!(q.takes_copy_message(fe::COPY_DATA));
        q.on_server_message(be::COPY_IN_RESPONSE);
        assert!(q.takes_copy_message(fe::COPY_DATA));
        q.on_server_message(be::ERROR_RESPONSE);
        assert!(
            !q.takes_copy_message(fe::COPY_DATA),
            "ignored by PostgreSQL"
        );
        q.on_server_message(be::READY_FOR_QUERY);
        assert!(q.is_idle());
        assert!(!q.takes_copy_message(fe::COPY_DATA));
        assert!(!q.takes_copy_message(fe::COPY_DONE));
        // No marker that no reply would ever take off the queue.
        q.push(Expected::CopyEnd);
        assert!(q.is_idle(), "{q:?}");
        // The next COPY, ended before its CopyInResponse arrives.
        q.push(Expected::Query);
        assert!(q.takes_copy_message(fe::COPY_DATA));
        assert!(q.takes_copy_message(fe::COPY_DONE));
        q.push(Expected::CopyEnd);
        for tag in [
            be::COPY_IN_RESPONSE,
            be::COMMAND_COMPLETE,
            be::READY_FOR_QUERY,
        ] {
            q.on_server_message(tag);
        }
        assert!(q.is_idle(), "{q:?}");
    }

    #[test]
    fn an_unsynced_batch_is_not_idle() {
        let mut q = ReplyQueue::new();
        q.push(Expected::Parse);
        q.on_server_message(be::PARSE_COMPLETE);
        assert!(q.is_empty() && !q.is_idle());
        q.push(Expected::Sync);
        q.on_server_message(be::READY_FOR_QUERY);
        assert!(q.is_idle());
    }

    #[test]
    fn an_error_discards_queries_up_to_the_sync() {
        let mut q = ReplyQueue::new();
        for e in [
            Expected::Parse,
            Expected::Query,
            Expected::Bind,
            Expected::Sync,
        ] {
            q.push(e);
        }
        q.on_server_message(be::ERROR_RESPONSE);
        assert_eq!(q.len(), 1);
        q.on_server_message(be::READY_FOR_QUERY);
        assert!(q.is_idle());
    }

    #[test]
    fn after_an_error_messages_until_sync_expect_nothing() {
        let mut q = ReplyQueue::new();
        q.push(Expected::Parse);
        q.on_server_message(be::ERROR_RESPONSE);
        assert!(q.is_empty() && !q.is_idle());
        q.push(Expected::Query);
        q.push(Expected::Bind);
        assert!(q.is_empty(), "discarded by the server: {q:?}");
        q.push(Expected::Sync);
        q.on_server_message(be::READY_FOR_QUERY);
        assert!(q.is_idle());
        // A malformed Flush fails with nothing queued: skip to Sync as well.
        q.on_server_message(be::ERROR_RESPONSE);
        assert!(!q.is_idle());
        q.push(Expected::Query);
        q.push(Expected::Sync);
        assert_eq!(q.len(), 1);
    }

    /// The O(1) counters agree with the queue, through answers, an error's skip, COPY IN.
    #[test]
    fn pending_kinds_are_counted() {
        fn scan(q: &ReplyQueue) -> (bool, bool, bool) {
            let has = |kinds: &[Expected]| q.entries.iter().any(|e| kinds.contains(&e.expected));
            (
                has(&[Expected::Query]),
                has(&[Expected::Query, Expected::Execute, Expected::Sync]),
                has(&[
                    Expected::Query,
                    Expected::Execute,
                    Expected::Sync,
                    Expected::Internal,
                ]),
            )
        }
        let counted = |q: &ReplyQueue| {
            (
                q.has_pending_query(),
                q.has_pending_work(),
                q.may_change_transaction(),
            )
        };
        let mut q = ReplyQueue::new();
        q.push(Expected::Internal);
        for tag in [b'P', b'B', b'E', b'S', b'Q', b'B', b'E', b'S'] {
            q.push(Expected::for_client_message(tag).unwrap());
        }
        assert_eq!(counted(&q), scan(&q));
        for tag in [
            be::COMMAND_COMPLETE,
            be::READY_FOR_QUERY,
            be::PARSE_COMPLETE,
            be::ERROR_RESPONSE,
        ] {
            q.on_server_message(tag);
            assert_eq!(counted(&q), scan(&q), "{q:?}");
        }
        for tag in [
            be::READY_FOR_QUERY,
            be::COMMAND_COMPLETE,
            be::READY_FOR_QUERY,
            be::BIND_COMPLETE,
            be::COPY_IN_RESPONSE,
        ] {
            q.on_server_message(tag);
            assert_eq!(counted(&q), scan(&q), "{q:?}");
        }
        q.push(Expected::CopyEnd);
        q.push(Expected::Sync);
        q.on_server_message(be::COMMAND_COMPLETE);
        q.on_server_message(be::READY_FOR_QUERY);
        assert!(q.is_idle(), "{q:?}");
        assert_eq!(counted(&q), (false, false, false));
        q.push(Expected::Query);
        q.clear();
        assert_eq!(counted(&q), (false, false, false));
    }

    /// An autoprepared query's Sync after an error in its Execute, silenced, then the plan
    /// check pgmemo sends after it (`Session::check_plan`): the client sees one ReadyForQuery,
    /// the check's, and the check's error if its Parse or Bind fails.
    #[test]
    fn a_plan_check_answers_the_client_once() {
        fn queue() -> ReplyQueue {
            let mut q = ReplyQueue::new();
            q.push(Expected::Sync);
            q.push_plan_check();
            q
        }
        // Each server message routed as said, and nothing left in the queue after them.
        fn routed(q: &mut ReplyQueue, steps: &[(u8, Route)]) {
            for &(tag, route) in steps {
                assert_eq!(q.on_server_message(tag), route, "{q:?}");
            }
            assert!(q.is_idle(), "{q:?}");
        }
        let mut q = queue();
        routed(
            &mut q,
            &[
                (be::READY_FOR_QUERY, Route::Swallow),
                (be::PARSE_COMPLETE, Route::Swallow),
                (be::BIND_COMPLETE, Route::Swallow),
                (be::READY_FOR_QUERY, Route::Forward),
                (be::CLOSE_COMPLETE, Route::Swallow),
                (be::READY_FOR_QUERY, Route::Swallow),
            ],
        );
        // The Bind fails (the simple query would have failed while planning).
        let mut q = queue();
        routed(
            &mut q,
            &[
                (be::READY_FOR_QUERY, Route::Swallow),
                (be::PARSE_COMPLETE, Route::Swallow),
                (be::ERROR_RESPONSE, Route::Forward),
                (be::READY_FOR_QUERY, Route::Forward),
                (be::CLOSE_COMPLETE, Route::Swallow),
                (be::READY_FOR_QUERY, Route::Swallow),
            ],
        );
        // The Parse fails: the Bind is skipped.
        let mut q = queue();
        routed(
            &mut q,
            &[
                (be::READY_FOR_QUERY, Route::Swallow),
                (be::ERROR_RESPONSE, Route::Forward),
                (be::READY_FOR_QUERY, Route::Forward),
                (be::CLOSE_COMPLETE, Route::Swallow),
                (be::READY_FOR_QUERY, Route::Swallow),
            ],
        );
        assert!(q.take_replacement().is_none(), "the error goes as it is");
    }

    #[test]
    fn describe_waits_for_row_description() {
        let mut q = ReplyQueue::new();
        q.push(Expected::Describe);
        q.on_server_message(be::PARAMETER_DESCRIPTION);
        assert_eq!(q.len(), 1);
        q.on_server_message(be::NO_DATA);
        assert!(q.is_empty());
    }
}
