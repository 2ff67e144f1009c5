//! The relay lane: a message that only needs relaying skips the stages.
//!
//! Most of an extended-protocol transaction is messages about a portal: `Describe` of it,
//! `Execute`, then `Sync` (and `Flush`); most of the replies to any transaction are its rows,
//! their description and the completions of its messages. With a server held and none of the
//! features that look at such messages in play, every stage of
//! [`Session::handle_client_messages`] passes them through unchanged: no text to read,
//! nothing the cache answers, no server to take, no statement to rename. Going through the
//! stages anyway cost about 300 instructions a message (callgrind, `python3
//! bench/budget.py`: 950 of a `pgbench -S -M prepared` transaction's 11,270 for its three
//! portal messages). Likewise the server's replies (see [`Session::lane_takes_reply`]),
//! those of an autoprepared query too: its BindComplete swallowed, its RowDescription held
//! until its first row (three of a `pgbench -S -M simple` transaction's four replies through
//! the stages, 347 instructions). The lane relays such a message as the stages would have,
//! and says exactly when it may (see [`Session::lane_takes`]); anything else takes the stages.
//! The client's portal messages that follow one another go as one run (see
//! [`Session::lane_run`]): one copy to the server, one note for the retry capture (-348
//! instructions a `pgbench -S -M prepared -c 8` transaction, -348 with `-M extended`).
//!
//! One message pgmemo answers itself takes a lane too: a driver's Parse of its unnamed
//! statement again, with nothing in flight (see [`Session::answer_parse_in_lane`]).

use super::{Session, HIGH_WATER};
use crate::buffers;
use crate::pool::PoolMode;
use crate::protocol::backend as be;
use crate::protocol::frontend as fe;
use crate::protocol::{body, frame};
use crate::query::database;
use crate::replies::{Expected, Route};
use crate::statements::idle_batch;
use bytes::Buf;

impl Session {
    /// Relays the message at the head of the client's input (framed: `tag`, `len` bytes) if
    /// the lane takes it. True: relayed, as the stages would have.
    #[inline]
    pub(super) fn relay_in_lane(&mut self, tag: u8, len: usize, now_us: u64) -> bool {
        if !self.lane_takes(tag) {
            return false;
        }
        if let Some(reader) = self.reading.reader.as_deref_mut() {
            reader.forget(); // a reading is of one message only
        }
        self.info.start_query(now_us);
        // The portal messages buffered after it go with it, up to a Sync (see `lane_run`).
        let (run, synced) = match tag {
            fe::SYNC => (len, true),
            _ => self.lane_run(len),
        };
        self.stats.bytes_received += run as u64;
        self.forward_client_messages(run);
        if synced && self.plan.stmts.is_some() {
            // The planner's Sync (nothing to clean up after it, see `lane_takes`) ends as any
            // message it plans does: the replies pgmemo gives itself that are due now.
            self.after_planned_locally();
        }
        // What planning any message does to the planner's wait (nothing waits here).
        self.plan.planned();
        true
    }

    /// The length of the run of client messages the lane relays at once, starting with the
    /// one at the head of the input (`len` bytes, taken by the lane, not a Sync), and whether
    /// it ends with a Sync. The run goes on over every whole message after it that the lane
    /// would take as well: a `Describe` of a portal, an `Execute`, a `Flush`, and a `Sync`,
    /// which ends it. Relaying one of them changes none of what [`Session::lane_takes`]
    /// reads (no server is taken or let go, no reply read; after a Sync the batch is over,
    /// so the run ends there), and framing each the way [`Session::frame_client_message`]
    /// does (its length within bounds, the server's output below [`HIGH_WATER`] before it)
    /// keeps each message's fate: anything else, a length out of bounds included, stops the
    /// run and takes the stages. One copy, one reply-queue visit per message and one
    /// advance for a `pgbench -M prepared` transaction's Describe, Execute and Sync, where
    /// the three went one by one.
    #[inline]
    fn lane_run(&self, len: usize) -> (usize, bool) {
        let input = &self.client.rbuf[..];
        let sent = self.server.as_ref().map_or(0, |s| s.wbuf.len());
        let mut run = len;
        while sent + run < HIGH_WATER {
            let rest = &input[run..];
            let Some(&tag) = rest.first() else {
                break;
            };
            let Ok(Some((_, n))) = frame(rest, fe::max_message_len(tag, self.max_message)) else {
                break;
            };
            if !self.lane_takes_message(tag, body(&rest[..n])) {
                break;
            }
            run += n;
            if tag == fe::SYNC {
                return (run, true);
            }
        }
        (run, false)
    }

    /// Whether every stage would pass the message through unchanged:
    /// - a `Describe` of a portal, an `Execute`, a `Sync` or a `Flush`: no text (the result
    ///   cache, the session-state watch, the transaction-id question and the statement
    ///   planner read none of them), no statement name;
    /// - a server held (none to take, no block kept without one), not a replica's and not a
    ///   pinned or session-mode client's (whose transaction's time starts at its first
    ///   message: see `Session::server_for`);
    /// - no portal the result cache left (see `Session::portal_left_by_hit`), no portal
    ///   tracked by the planner (an `Execute` of one is planned), no names to close after a
    ///   `Sync` (`Planner::sync`);
    /// - no guard statement to prepare first: the server has it, or is not in a block, or a
    ///   batch is open (see `Planner::prepare_guard`).
    #[inline]
    fn lane_takes(&self, tag: u8) -> bool {
        let message = self.lane_takes_message(tag, body(&self.client.rbuf));
        let Some(server) = self.server.as_deref() else {
            return false;
        };
        message
            && self.reads.is_none()
            && self.state.pins == 0
            && self.mode != PoolMode::Session
            && self
                .cache
                .as_deref()
                .is_none_or(|c| c.cached_portal.is_none())
            && self
                .plan
                .stmts
                .as_ref()
                .is_none_or(|s| !s.has_tracked_portals())
            && (server.prepared.has_guard() || server.status != b'T' || self.replies.in_batch())
    }

    /// The first of [`Session::lane_takes`]'s conditions, the message's own: a `Describe` of
    /// a portal (`body` starts with `P`), an `Execute`, a `Flush`, or a `Sync` with no names
    /// to close after it. (`body`: the message's, or a prefix of it.)
    #[inline]
    fn lane_takes_message(&self, tag: u8, body: &[u8]) -> bool {
        match tag {
            fe::EXECUTE | fe::FLUSH => true,
            fe::SYNC => self.plan.cleanup.is_empty(),
            fe::DESCRIBE => body.first() == Some(&b'P'),
            _ => false,
        }
    }
}

impl Session {
    /// Answers the Parse at the head of the client's input (framed: `tag`, `len` bytes) if
    /// it is the client's last Parse of its unnamed statement again, as drivers send one
    /// before every execution of an unprepared query (`pgbench -M extended`, JDBC, Npgsql),
    /// and the session is idle: no server held, nothing in flight. The planner answers such
    /// a Parse itself, ParseComplete at once (see `Planner::parse`: a statement PostgreSQL
    /// has accepted, bound to the unnamed name already, nothing to keep or undo), and no
    /// stage does anything else with it (see [`Session::parse_lane_open`]) but take a
    /// server for it first, when one is idle at once: so does the lane, then answers it if
    /// the server needs nothing queued ahead of the client's work (its parameters or
    /// SQL-level statements brought in line, whose replies come first). True: answered, as
    /// the stages would have (-744 instructions a `pgbench -S -M extended -c 8`
    /// transaction).
    #[inline]
    pub(super) fn answer_parse_in_lane(&mut self, tag: u8, len: usize, now_us: u64) -> bool {
        if tag != fe::PARSE || self.server.is_some() || !self.parse_lane_open() {
            return false;
        }
        let body = body(&self.client.rbuf[..len]);
        let Some(stmts) = self.plan.stmts.as_mut() else {
            return false;
        };
        let Some(statement) = stmts.unnamed_parse_again(body, &self.app.registry) else {
            return false;
        };
        debug_assert_eq!(
            statement.leads_with_ddl,
            database::parse_leads_with_ddl(body),
            "the statement's text is the Parse's"
        );
        if !statement.is_validated()
            || !stmts.is_bound_to(b"", &statement)
            // The planner prepares the guard for a block it may open (`Planner::plan`).
            || statement.starts_transaction
            // Such a statement has pgmemo's own sessions leave its database first
            // (`Session::may_need_a_database`): its text is the Parse's, read once.
            || statement.leads_with_ddl
            // Answered with the rest of its batch, when that needs no server (`server_for`).
            || idle_batch::only_statement_messages_after_parse(&self.client.rbuf, len)
        {
            return false;
        }
        // What the stages do with it: a reading forgotten, the query's start noted, a server
        // taken (else the stages wait for one), ...
        if let Some(reader) = self.reading.reader.as_deref_mut() {
            reader.forget();
        }
        self.info.start_query(now_us);
        if !self.acquire_server_at_once() || !self.replies.is_empty() {
            return false; // (the stages go on from there: their next steps are the same)
        }
        // ... and the planner's answer, given at once (nothing is queued ahead of it).
        self.stats.bytes_received += len as u64;
        statement
            .parse_hits
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.client.rbuf.advance(len);
        self.plan.planned();
        self.replies.parse_answered_at_once();
        if self.client.wbuf.is_empty() {
            self.local_replies_only = true;
        }
        crate::protocol::write_empty_message(&mut self.client.wbuf, be::PARSE_COMPLETE);
        self.stats.bytes_sent += crate::protocol::HEADER_LEN as u64;
        // Nothing of the client's runs on the server yet.
        self.info.forget_query();
        true
    }

    /// Whether, for a Parse with no server held, every stage of
    /// [`Session::handle_client_messages`] but taking a server and planning passes it by,
    /// and the planner answers it at once if it knows the statement:
    /// - nothing in flight (the ParseComplete is due now), no error skipped to a Sync;
    /// - no block kept without a server (`deferred`), no replicas (`replicas`), the result
    ///   cache off and never on for this client (it is shown a Parse and asks for
    ///   transaction ids: `caching`);
    /// - nothing waiting to be planned again, no batch kept for a retry or replayed (see
    ///   `Retry`), no outcome to settle or search_path to carry (`Session::settle`), no
    ///   `SET search_path` whose transaction may end (`Planner::plan` waits then).
    #[inline]
    fn parse_lane_open(&self) -> bool {
        self.replies.is_empty()
            && !self.replies.is_skipping()
            && !self.keeps_block()
            && self.reads.is_none()
            && !self.caching()
            && self.cache.is_none()
            && !self.plan.waiting
            && self.plan.retry.is_at_rest()
            && !self.settle_due()
            && self
                .plan
                .stmts
                .as_ref()
                .is_some_and(|s| !s.search_path.is_open())
    }
}

impl Session {
    /// Relays the server's message at the head of its input (framed: `tag`, `len` bytes) if
    /// the lane takes it: a row, a completion or a description of the client's own work, or
    /// of an autoprepared query, with none of the features that look at replies in play.
    /// True: relayed (or swallowed, or held), as the stages of
    /// [`Session::handle_server_messages`] would have.
    #[inline]
    pub(super) fn relay_reply_in_lane(&mut self, tag: u8, len: usize) -> bool {
        let Some((kind, route)) = self.lane_takes_reply(tag) else {
            return false;
        };
        // The queue moves on as for any reply (an entry done, its outcome noted).
        self.replies.moved_on(kind, tag);
        match route {
            Route::Forward => {
                if matches!(tag, be::DATA_ROW | be::COMMAND_COMPLETE) {
                    if tag == be::COMMAND_COMPLETE {
                        let server = self.server.as_mut().expect("a server is held");
                        server.completed_since_ready = true;
                    }
                    // An autoprepared query's RowDescription held back goes out before its
                    // first row or its completion (no plan check is in flight here).
                    self.release_held_description(tag, route);
                    self.note_rows(tag, len);
                }
                let server = self.server.as_mut().expect("a server is held");
                buffers::append(&mut self.client.wbuf, &server.rbuf[..len]);
                self.stats.bytes_sent += len as u64;
            }
            // An autoprepared query's RowDescription, held until its first row.
            Route::Hold => self.hold_reply(len),
            // An autoprepared query's ParseComplete, BindComplete or NoData.
            Route::Swallow => {}
            Route::Replace => unreachable!("the lane takes no error"),
        }
        let server = self.server.as_mut().expect("a server is held");
        buffers::consume(&mut server.rbuf, len);
        self.settle_reply(None, None, false);
        true
    }

    /// Whether every stage would route the server's message as the lane does, and do
    /// nothing else with it but move the reply queue, note its rows (SHOW QUERIES' timing)
    /// and settle the outcome of the entry it ends:
    /// - a ParseComplete, BindComplete, RowDescription, NoData, DataRow or CommandComplete
    ///   (not an error, whose retry, rewrite and bookkeeping take the stages; not a
    ///   ReadyForQuery, a notice, a ParameterStatus or COPY);
    /// - to the client's own entry, relayed as it is, or to an autoprepared query's
    ///   ([`ReplyQueue::lane_route`], which gives the route and the entry's kind); not a
    ///   statement's Describe (its description is kept for later, see
    ///   `Session::observe_description`);
    /// - no plan check of an autoprepared query in flight (`Session::settle_plan_check`), no
    ///   result cache watching, no replica position to read, no `SET search_path` whose
    ///   transaction may end.
    ///
    /// [`ReplyQueue::lane_route`]: crate::replies::ReplyQueue::lane_route
    #[inline]
    fn lane_takes_reply(&self, tag: u8) -> Option<(Expected, Route)> {
        let message = match tag {
            be::DATA_ROW | be::COMMAND_COMPLETE | be::BIND_COMPLETE | be::PARSE_COMPLETE => true,
            be::ROW_DESCRIPTION | be::NO_DATA => self.replies.head_describes().is_none(),
            _ => false,
        };
        let takes = message
            && !(self.plan.held_description
                && self
                    .reading
                    .autoprepare
                    .as_ref()
                    .is_some_and(|a| a.checking))
            && self.reads.is_none()
            && self.cache.as_deref().is_none_or(|c| !c.watching())
            && self
                .plan
                .stmts
                .as_ref()
                .is_none_or(|s| !s.search_path.is_open());
        takes.then(|| self.replies.lane_route(tag)).flatten()
    }
}
