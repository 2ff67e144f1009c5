//! What the session does with the client's messages: each is framed, shown to the result cache
//! (which may answer it), given a server when it needs one, noted for the session-state and
//! schema watches, planned (statements renamed, injected, autoprepared or answered locally) and
//! forwarded; malformed input ends the session as PostgreSQL ends it.

use super::{planner, replicas, End, Readable, ReadableAt, Session, HIGH_WATER};
use crate::app::ClientState;
use crate::buffers;
use crate::pool::{CheckoutError, PoolMode};
use crate::protocol::backend::{self as be, sqlstate, Severity};
use crate::protocol::{body, frame, frontend as fe};
use crate::query::facts;
use crate::replies::{Expected, Synth};
use crate::server::ServerConn;
use bytes::Buf;
use std::pin::Pin;

impl Session {
    /// Answers a batch of Parse / Describe / Close, ended by a Sync or Flush, that needs no
    /// server, if the client's input starts with one (see [`crate::statements::idle_batch`]);
    /// held by no server: idle, or in a block the session keeps (see `deferred`).
    pub(super) fn answer_idle_batch(&mut self) -> bool {
        let status = self.status_without_server();
        let Some(stmts) = self.plan.stmts.as_mut() else {
            return false;
        };
        buffers::lend(&mut self.client.wbuf);
        let limits = (
            self.plan.limits.max_count,
            self.plan.limits.max_bytes,
            self.max_message,
        );
        let Some(taken) = crate::statements::idle_batch::answer(
            &self.client.rbuf,
            stmts,
            &self.app.registry,
            limits,
            &mut self.client.wbuf,
            status,
        ) else {
            return false;
        };
        self.client.rbuf.advance(taken);
        self.stats.bytes_received += taken as u64;
        self.pool
            .stats
            .here()
            .serverless_batches
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        true
    }

    /// Plans every complete client message in the read buffer: answered locally, or queued
    /// for the server (taking one first when the session holds none).
    ///
    /// Each message goes through the same stages, one call per feature: framed (or judged a
    /// protocol violation); its text found and read once; the result cache may answer it; a
    /// server taken if it needs one; its effects noted (session state, DDL); planned
    /// (statements renamed, injected, autoprepared, answered locally); forwarded. The awaits
    /// stay here: the stages are plain functions, so that the session's task keeps no room
    /// for their states.
    pub(super) async fn handle_client_messages(&mut self) -> Result<(), End> {
        // The clock, read once per wake that has a message (SHOW CLIENTS' request_time and
        // the query's start): 0 until then.
        let mut now_us = 0;
        loop {
            let (tag, len) = match self.frame_client_message() {
                Ok(Some(framed)) => framed,
                Ok(None) => return Ok(()),
                Err(violation) => return self.violated(violation).await,
            };
            if now_us == 0 {
                now_us = self.app.clock_us();
                self.info.note_request(self.app.unix_secs(now_us));
            }
            if self.relay_in_lane(tag, len, now_us) {
                continue; // a portal message with nothing to do but relaying (see `lane`)
            }
            if self.answer_parse_in_lane(tag, len, now_us) {
                continue; // a driver's Parse of its unnamed statement again (see `lane`)
            }
            let query_text_len = self.find_query_text(tag, len);
            self.forget_portal_left_by_hit(tag, len);
            if self.transaction_control(tag, len, query_text_len) || self.extended_control(tag, len)
            {
                continue; // a block kept without a server opened or ended
            }
            if self.cache_may_answer(tag) {
                let answered = match self.cache_client_message(tag, len, query_text_len) {
                    Ok(answered) => answered,
                    Err(slow) => slow.await?,
                };
                if answered {
                    continue; // answered from the result cache
                }
            }
            // Decided before the await: a match's value would be kept across it (in the
            // session's task, for good).
            let mut acquire = match self.server_for(tag, len) {
                Next::Go => false,
                Next::Acquire => true,
                Next::Done => continue,
                Next::Stop => return Ok(()),
                Next::End(end) => return Err(end),
            };
            if self.reads.is_some() {
                // Only for pools with replicas: one test here for the others.
                match self.replica_stage(tag, len, query_text_len, acquire) {
                    replicas::Stage::Go => {}
                    replicas::Stage::Answered => continue,
                    replicas::Stage::Wait => return Ok(()),
                    replicas::Stage::Acquire => acquire = true,
                }
            }
            self.info.start_query(now_us);
            // Kept across the waits below as a flag, not the threshold: the session's task
            // keeps room for what an await holds (see `footprint`); the threshold is the
            // pool's, read again after.
            let (query_words, autoprepares) = {
                let autoprepare = self.autoprepare_for(tag);
                (
                    self.query_words(query_text_len, autoprepare),
                    autoprepare.is_some(),
                )
            };
            // One await for every way of taking a server but the common one (an idle server
            // at once): fewer states in the session's future, which the relay loop then
            // inlines (each await here cost ~100 instructions a transaction, callgrind).
            if acquire
                && (self.reads.is_some()
                    || self.may_need_a_database(tag, len, query_text_len, query_words)
                    || self.state.wants_pin_slot(query_words)
                    || !self.acquire_server_at_once())
            {
                Box::pin(self.acquire_server_slowly(tag, len, query_text_len, query_words)).await?;
            }
            let autoprepare = autoprepares
                .then(|| self.pool.autoprepare_threshold())
                .flatten();
            self.ask_transaction_id(tag, len, query_text_len);
            self.portal_left_by_hit(tag, len);
            self.note_effects(tag, len, query_text_len, query_words);
            let timing = self.start_timing(tag);
            // Read before planning, which may consume the message; counted unless it waits
            // to be planned again.
            let named = matches!(tag, fe::PARSE | fe::BIND) && self.names_a_statement(tag, len);
            let plan = self.plan_client_message(tag, len, query_text_len, query_words, autoprepare);
            if named && plan != planner::Plan::Wait {
                self.count_named_statement_message(tag);
            }
            match plan {
                planner::Plan::Forward => self.forward_client_messages(len),
                planner::Plan::Done => {
                    self.keep_timing(timing);
                    if !self.replies.has_pending_work() {
                        // Answered here: no query of the client's runs on the server.
                        self.info.forget_query();
                    }
                }
                planner::Plan::Wait => {
                    self.keep_timing(timing);
                    return Ok(());
                }
            }
        }
    }

    /// The next complete message in the client's input, if the session reads one now: its
    /// type and length. `Err`: the client broke the protocol (the message says how).
    #[inline]
    fn frame_client_message(&mut self) -> Result<Option<(u8, usize)>, String> {
        if self.violation.is_some() {
            return Ok(None); // nothing after a violation is read
        }
        if self
            .server
            .as_ref()
            .is_some_and(|s| s.wbuf.len() >= HIGH_WATER)
        {
            return Ok(None); // backpressure: let the server drain first
        }
        if self.info.cancels.pending() {
            // A cancel request aimed at the client's work is being passed on: nothing new
            // goes to its server (it could cancel that instead), pgmemo's own queries
            // neither, until it is delivered.
            return Ok(None);
        }
        // Like PostgreSQL, judge the type byte first (as soon as it is there), then the
        // length against the limit for that type.
        let Some(&tag) = self.client.rbuf.first() else {
            return Ok(None);
        };
        if (self.copy_garbage || (!fe::is_known(tag) && self.replies.in_copy_in()))
            && self.hand_copy_garbage_over()
        {
            return Ok(None);
        }
        if !fe::is_known(tag) {
            return Err(format!("invalid frontend message type {tag}"));
        }
        let max = fe::max_message_len(tag, self.max_message);
        frame(&self.client.rbuf, max).map_err(|e| e.to_string())
    }

    /// A simple query's text, found once (its end is a search for the terminator) for the
    /// result cache, the word scan, the session-state watch and the planner: its length, or
    /// None (another message, or a malformed Query). The reading of the message before is
    /// forgotten.
    #[inline]
    fn find_query_text(&mut self, tag: u8, len: usize) -> Option<usize> {
        if let Some(reader) = self.reading.reader.as_deref_mut() {
            reader.forget(); // a reading is of one message only
        }
        if tag != fe::QUERY {
            return None;
        }
        fe::query_text(body(&self.client.rbuf[..len])).map(<[u8]>::len)
    }

    /// Whether the result cache is shown this message (and may answer it).
    #[inline]
    fn cache_may_answer(&mut self, tag: u8) -> bool {
        if !matches!(tag, fe::QUERY | fe::PARSE | fe::BIND | fe::FUNCTION_CALL) {
            return false;
        }
        if !self.caching() {
            // Off (a RELOAD) for a client it followed before: what runs unseen may write
            // anything, bumped when the transaction ends, which may be after the cache is on
            // again.
            if let Some(c) = self.cache.as_deref_mut().filter(|_| tag != fe::PARSE) {
                self.app.cache.note_unknown_write(c);
            }
            return false;
        }
        if let Some(c) = self.cache.as_deref_mut() {
            c.forget_message();
        }
        true
    }

    /// Whether the message needs a server, and what to do when the session holds none.
    #[inline]
    fn server_for(&mut self, tag: u8, len: usize) -> Next {
        if self.server.is_none() {
            return match tag {
                fe::TERMINATE => Next::End(End::Terminate),
                // In a block kept without a server, a Sync is answered as PostgreSQL would
                // (the block is open), a Flush has nothing to flush, and everything else is
                // the block's.
                fe::SYNC | fe::FLUSH if len == 5 && self.keeps_block() => {
                    if tag == fe::SYNC {
                        be::ready_for_query(&mut self.client.wbuf, b'T');
                    }
                    self.client.rbuf.advance(len);
                    Next::Done
                }
                // Preparing, describing or closing known statements needs no server (in a
                // kept block too: its first statement decides where it goes).
                fe::PARSE | fe::CLOSE | fe::DESCRIBE if self.answer_idle_batch() => Next::Done,
                _ if self.keeps_block() => Next::Acquire,
                // With no server held the session is idle: a lone Sync is answered as
                // PostgreSQL would, a Flush has nothing to flush, and stray COPY messages
                // are ignored as PostgreSQL ignores them outside COPY.
                // A Sync or Flush with a body is malformed: PostgreSQL has to say so.
                fe::SYNC if len == 5 => {
                    be::ready_for_query(&mut self.client.wbuf, b'I');
                    self.client.rbuf.advance(len);
                    Next::Done
                }
                fe::FLUSH if len == 5 => {
                    self.client.rbuf.advance(len);
                    Next::Done
                }
                fe::COPY_DATA | fe::COPY_DONE | fe::COPY_FAIL => {
                    self.client.rbuf.advance(len);
                    Next::Done
                }
                _ => Next::Acquire,
            };
        }
        if tag == fe::TERMINATE {
            if self.terminate_waits() {
                // PostgreSQL answers what came before a Terminate before it reads it: the
                // Terminate waits (unread: see `may_read_client`) until that is relayed.
                return Next::Stop;
            }
            return Next::End(End::Terminate);
        }
        if is_copy_message(tag) && !self.replies.takes_copy_message(tag) {
            // Ignored by PostgreSQL (no COPY IN, or one an error ended while the client was
            // still sending it): not sent, so the error's ReadyForQuery is the end of it.
            self.client.rbuf.advance(len);
            return Next::Done;
        }
        if (self.state.pins != 0 && self.work_done()) || self.session_idle() {
            // A pinned client's (or a session-mode client's) next transaction starts on the
            // server it kept: its time counts from here (see `pinned_transaction_done`,
            // `session_transaction_counted`).
            if let Some(server) = self.server.as_mut() {
                server.checked_out = crate::clock::Moment::now();
            }
        }
        Next::Go
    }

    /// Session mode, between transactions: the client's next message starts one, whose time
    /// counts from it (see `session_transaction_counted`).
    #[inline]
    fn session_idle(&self) -> bool {
        self.mode == PoolMode::Session
            && self.replies.is_idle()
            && self.server.as_ref().is_some_and(|s| s.status == b'I')
    }

    /// Whether a Parse or Bind names a statement (not the unnamed one), when pgmemo tracks the
    /// client's statements: PgBouncer counts those only, with `max_prepared_statements` on.
    #[inline]
    fn names_a_statement(&self, tag: u8, len: usize) -> bool {
        if self.plan.stmts.is_none() {
            return false;
        }
        let body = body(&self.client.rbuf[..len]);
        // A Parse names its statement first; a Bind names its portal, then its statement.
        let name = match tag {
            fe::PARSE => Some(0),
            _ => crate::protocol::nul_at(body).map(|end| end + 1),
        };
        name.and_then(|at| body.get(at)).is_some_and(|&b| b != 0)
    }

    /// Counts a Parse or Bind of a named statement (SHOW STATS' client_parse_count and
    /// bind_count) into the pool's counters of this worker at once: the session's own
    /// counters are not widened for them (see `footprint`).
    fn count_named_statement_message(&self, tag: u8) {
        let here = self.pool.stats.here();
        let counter = if tag == fe::PARSE {
            &here.client_parses
        } else {
            &here.binds
        };
        counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }

    /// Starts timing a simple query on the server for SHOW QUERIES (see
    /// `ShapeStats::time_this_call`), when nothing else of the client's is in flight: its
    /// ReadyForQuery is then the next one the client is sent (pgmemo's own queries queued
    /// ahead of it, a parameter sync or a kept block's BEGIN, are answered to pgmemo).
    /// True: started.
    #[inline]
    fn start_timing(&mut self, tag: u8) -> bool {
        if tag != fe::QUERY || self.replies.has_pending_work() || self.replies.in_batch() {
            return false;
        }
        let Some(reader) = self.reading.reader.as_deref_mut() else {
            return false;
        };
        let Some(shape) = reader.current_shape().filter(|s| s.stats.time_this_call()) else {
            return false;
        };
        let shape = shape.clone();
        reader.timed = Some(crate::query::Timed::new(shape));
        true
    }

    /// After a message planned `Done` or `Wait`: a timing started for it goes on only if it
    /// went to the server (autoprepared), not if it was answered here or waits.
    #[inline]
    fn keep_timing(&mut self, started: bool) {
        if started && (!self.replies.has_pending_work() || self.plan.waiting) {
            if let Some(reader) = self.reading.reader.as_deref_mut() {
                reader.timed = None;
            }
        }
    }

    /// `autoprepare_threshold` for a simple query that may be autoprepared.
    #[inline]
    fn autoprepare_for(&mut self, tag: u8) -> Option<u64> {
        if tag == fe::QUERY {
            self.autoprepare_threshold()
        } else {
            None
        }
    }

    /// The words of a simple query that the planner and the session-state watch look for:
    /// those of its autoprepare shape (found once per shape) and its string literals, or else
    /// those of one pass over its text.
    #[inline]
    fn query_words(&mut self, query_text_len: Option<usize>, autoprepare: Option<u64>) -> u32 {
        if !self.reads_words() {
            return 0;
        }
        let Some(text_len) = query_text_len else {
            return 0;
        };
        let text = fe::query_text_of(&self.client.rbuf, text_len);
        let read = match autoprepare {
            Some(_) => self.app.autoprepare.read_ahead(
                text,
                self.reading.reader.get_or_insert_with(Default::default),
            ),
            None => None,
        };
        read.unwrap_or_else(|| crate::query::words::in_query(text))
    }

    /// Whether a simple query's words are read ([`Session::query_words`]): for the
    /// session-state watch or the statement planner.
    #[inline]
    fn reads_words(&self) -> bool {
        self.state.enabled || self.plan.stmts.is_some()
    }

    /// Takes a server when the pool had none idle at once, or when the message must wait
    /// first: a statement that needs a database to itself has pgmemo's own sessions of it
    /// leave first (`DROP DATABASE` and the like, see [`Session::vacate_for`]), and one that
    /// may pin the client waits for a slot among the pinned servers, holding no server
    /// meanwhile (see [`Session::wait_for_pin_slot`]).
    async fn acquire_server_slowly(
        &mut self,
        tag: u8,
        len: usize,
        query_text_len: Option<usize>,
        query_words: u32,
    ) -> Result<(), End> {
        // Its rare ways boxed, each: this future is made and moved into its box at every
        // wait for a server (with them inline, ~300 instructions of copying, callgrind).
        if self.reads.is_some() {
            Box::pin(self.acquire_replica(tag, query_text_len, query_words)).await?;
        }
        if self.server.is_none() && self.may_need_a_database(tag, len, query_text_len, query_words)
        {
            Box::pin(self.vacate_for(tag, len, query_text_len)).await;
        }
        if self.server.is_none() && self.state.wants_pin_slot(query_words) {
            Box::pin(self.wait_for_pin_slot()).await?;
        }
        // (Not acquire_server_at_once first: acquire_server's first look is the same one.)
        if self.server.is_none() {
            self.acquire_server().await?;
        }
        if self.reads.is_some() {
            self.note_primary_work(tag, len, query_text_len);
        }
        Ok(())
    }

    /// Whether the message may hold a statement that needs a database to itself (see
    /// [`crate::query::database`]): a simple query whose words have `DROP`, `ALTER` or
    /// `CREATE` (when they are not read: that starts with one), a Parse whose text starts
    /// with one. Nothing else is read. Asked only when the message takes a server: none of
    /// those statements runs in a transaction block but `ALTER DATABASE ... RENAME`, which
    /// in a block through pgmemo finds pgmemo's sessions of the database as they are.
    #[inline]
    fn may_need_a_database(
        &self,
        tag: u8,
        len: usize,
        query_text_len: Option<usize>,
        query_words: u32,
    ) -> bool {
        use crate::query::database;
        match tag {
            fe::QUERY if self.reads_words() => database::may_hold(query_words),
            fe::QUERY => query_text_len
                .is_some_and(|n| database::leads_with_ddl(fe::query_text_of(&self.client.rbuf, n))),
            fe::PARSE => database::parse_leads_with_ddl(body(&self.client.rbuf[..len])),
            _ => false,
        }
    }

    /// Reads the client's statement (a simple query's, or a Parse's), and when it needs a
    /// database to itself, pgmemo's own sessions of that database leave it first (see
    /// [`crate::vacate`]).
    async fn vacate_for(&mut self, tag: u8, len: usize, query_text_len: Option<usize>) {
        let standard = self.standard_strings();
        let uses = {
            let body = body(&self.client.rbuf[..len]);
            let text = match tag {
                fe::QUERY => query_text_len.map(|n| &body[..n]),
                _ => fe::Parse::parse(body).map(|p| p.query),
            };
            match text {
                Some(text) => crate::query::database::uses(text, standard),
                None => return,
            }
        };
        if uses.is_empty() {
            return;
        }
        let settings = self.pool.settings();
        crate::vacate::vacate(&self.app, &settings.target, &uses).await;
    }

    /// What the message may change that the session follows: its session state (transaction
    /// mode) and the schema its statements are prepared against.
    #[inline]
    fn note_effects(
        &mut self,
        tag: u8,
        len: usize,
        query_text_len: Option<usize>,
        query_words: u32,
    ) {
        if self.state.enabled {
            self.note_state(tag, len, query_text_len, query_words);
        }
        if let (Some(stmts), Some(text_len)) = (
            self.plan.stmts.as_mut().filter(|_| query_words != 0),
            query_text_len,
        ) {
            let text = fe::query_text_of(&self.client.rbuf, text_len);
            stmts.schema.note(facts::ddl_found(query_words, text));
        }
    }

    /// Statement messages are planned (renamed, injected, answered locally), unless
    /// PostgreSQL is discarding everything until the next Sync anyway. The Sync itself always
    /// is: the planner may have cleanup to send after it. COPY data is no statement (and
    /// nothing may be injected into it: see `Planner::prepare_guard`). `Forward`: the message
    /// goes to the server as it is; `Done`: it was answered locally; `Wait`: it waits for the
    /// server's replies to what is in flight.
    #[inline]
    fn plan_client_message(
        &mut self,
        tag: u8,
        len: usize,
        query_text_len: Option<usize>,
        query_words: u32,
        autoprepare: Option<u64>,
    ) -> planner::Plan {
        let server = self.server.as_mut().expect("server acquired above");
        self.stats.bytes_received += len as u64;
        let skipping = (self.replies.is_skipping() && tag != fe::SYNC) || is_copy_message(tag);
        let Some(stmts) = self.plan.stmts.as_mut().filter(|_| !skipping) else {
            return planner::Plan::Forward;
        };
        // A simple query may be autoprepared; a Bind's execution may be timed (SHOW QUERIES),
        // in the reading a simple query would use.
        let (autoprepare, timing) = match autoprepare {
            Some(threshold) => (
                Some(crate::autoprepare::Use {
                    global: &self.app.autoprepare,
                    client: self
                        .reading
                        .autoprepare
                        .get_or_insert_with(Default::default),
                    reader: self.reading.reader.get_or_insert_with(Default::default),
                    threshold,
                }),
                None,
            ),
            // Only a Bind reads it.
            None => (None, Some(&mut self.reading.reader)),
        };
        let planned = planner::Planner {
            message: planner::Message {
                whole: &self.client.rbuf[..len],
                text: query_text_len.map(|n| fe::query_text_of(&self.client.rbuf, n)),
                words: query_words,
            },
            server,
            stmts,
            replies: &mut self.replies,
            registry: &self.app.registry,
            stats: &mut self.stats,
            client: planner::ClientContext {
                limits: self.plan.limits,
                cleanup: &mut self.plan.cleanup,
                retry: &mut self.plan.retry,
                state: &mut self.state,
                autoprepare,
                shapes: &self.app.shapes,
                timing,
                reported: &self.params.reported,
            },
        }
        .plan(tag);
        if planned != planner::Plan::Wait {
            self.plan.planned();
        }
        match planned {
            planner::Plan::Forward => {}
            planner::Plan::Done => {
                let sync_end = if tag == fe::SYNC { len } else { 0 };
                self.plan.retry.consumed(&self.client.rbuf[..len], sync_end);
                buffers::consume(&mut self.client.rbuf, len);
                self.after_planned_locally();
            }
            planner::Plan::Wait => {
                // Planned again when the server has answered what is in flight, which a
                // Flush makes it send.
                self.stats.bytes_received -= len as u64;
                if !self.plan.wait_flushed {
                    let server = self.server.as_mut().expect("server acquired above");
                    crate::protocol::write_empty_message(&mut server.wbuf, fe::FLUSH);
                    self.plan.wait_flushed = true;
                }
                self.plan.waiting = true;
                self.plan.replan = true;
            }
        }
        planned
    }

    /// After the planner dealt with a message itself (`Plan::Done`): the replies pgmemo gives
    /// itself that are due now are written, and the client's output noted as pgmemo's alone
    /// if nothing else was in it.
    #[inline]
    pub(super) fn after_planned_locally(&mut self) {
        let pending_output = self.client.wbuf.len();
        self.answer_locally();
        if pending_output == 0 && !self.client.wbuf.is_empty() {
            self.local_replies_only = true;
        }
    }

    /// The whole messages at the head of the client's input (`run` bytes: one, or the relay
    /// lane's run) go to the server as the client sent them, in one copy, the reply of each
    /// expected.
    #[inline]
    pub(super) fn forward_client_messages(&mut self, run: usize) {
        let server = self.server.as_mut().expect("server acquired above");
        let messages = &self.client.rbuf[..run];
        let (mut at, mut sync_end) = (0, 0);
        while let Some(&[tag, a, b, c, d]) = messages.get(at..at + 5) {
            if let Some(expected) = Expected::for_client_message(tag) {
                self.replies.push(expected);
            }
            at += 1 + u32::from_be_bytes([a, b, c, d]) as usize;
            if tag == fe::SYNC && sync_end == 0 {
                sync_end = at;
            }
        }
        server.wbuf.extend_from_slice(messages);
        self.plan.retry.consumed(messages, sync_end);
        buffers::consume(&mut self.client.rbuf, run);
    }

    /// A message of an unknown type while the server waits for COPY data: PostgreSQL reads
    /// it itself, fails the COPY ("unexpected message type during COPY from stdin") and then,
    /// out of step with the client, ends the connection (FATAL 08P01); its replies reach the
    /// client as they are. Everything the client sent from there on goes to the server as it
    /// is. False when no server is held.
    pub(super) fn hand_copy_garbage_over(&mut self) -> bool {
        let Some(server) = self.server.as_mut() else {
            return false;
        };
        self.copy_garbage = true;
        server.wbuf.extend_from_slice(&self.client.rbuf);
        self.client.rbuf.clear();
        true
    }

    /// The client broke the protocol: it is told so and disconnected at once, or, when
    /// messages before the bad one still await replies, once those replies are out.
    /// Boxed: rare, and the session's task need not keep room for the message.
    pub(super) fn violated(
        &mut self,
        message: String,
    ) -> Pin<Box<dyn std::future::Future<Output = Result<(), End>> + Send + '_>> {
        Box::pin(async move {
            if self.replies.is_empty() {
                return Err(self.protocol_violation(message).await);
            }
            self.violation = Some(Box::new(message));
            Ok(())
        })
    }

    /// Boxed: rare, and the session's task need not keep room for the message and its
    /// sending.
    pub(super) fn protocol_violation(
        &mut self,
        message: String,
    ) -> Pin<Box<dyn std::future::Future<Output = End> + Send + '_>> {
        Box::pin(async move {
            tracing::warn!(client = %self.info.addr, "protocol violation: {message}");
            self.client
                .send_error(Severity::Fatal, sqlstate::PROTOCOL_VIOLATION, &message)
                .await;
            End::Protocol(message)
        })
    }

    /// `autoprepare_threshold` if this client's simple queries may be autoprepared: its pool
    /// has autoprepare on and its settings let autoprepare read its text as the server does.
    #[inline]
    pub(super) fn autoprepare_threshold(&mut self) -> Option<u64> {
        let threshold = self.pool.autoprepare_threshold()?;
        self.plan.stmts.as_ref()?; // autoprepare runs through the statement planner
        if !self.readable().autoprepare {
            self.stats.autoprepare_passed += 1;
            self.app
                .autoprepare
                .count_pass(crate::autoprepare::Pass::Settings);
            return None;
        }
        Some(threshold)
    }

    /// [`Session::acquire_server`]'s common case, without making its future: nothing unsent to
    /// the client, which is not killed, and an idle server in the pool at once. False: none
    /// was taken, [`Session::acquire_server`] takes the rest of the ways.
    #[inline]
    pub(super) fn acquire_server_at_once(&mut self) -> bool {
        if !self.client.wbuf.is_empty() || self.info.is_killed() {
            return false;
        }
        self.info.set_state(ClientState::Waiting);
        let Some(server) = self.pool.checkout_at_once() else {
            return false;
        };
        self.hold(server);
        true
    }

    /// Takes a server from the pool and makes its session parameters match this client's.
    pub(super) async fn acquire_server(&mut self) -> Result<(), End> {
        self.info.set_state(ClientState::Waiting);
        // Boxed (the session's task keeps no room for a write): replies pgmemo gave itself
        // before the client needed a server are rarely still unsent here.
        if !self.client.wbuf.is_empty() && Box::pin(self.client.flush()).await.is_err() {
            return Err(End::ClientGone);
        }
        // The error's future is made inside the match and awaited after it: awaited inside,
        // the match's checkout result would take room in the session's task. The wait is
        // boxed (the task keeps no room for it either), and a kill ends it.
        let failed = match self.pool.checkout_at_once() {
            Some(server) => self.use_server(server),
            None => match Box::pin(self.wait_for_server()).await {
                Ok(server) => self.use_server(server),
                Err(e) => Some(self.checkout_failed(e)),
            },
        };
        match failed {
            None => Ok(()),
            Some(failed) => Err(failed.await),
        }
    }

    /// The pool's wait for a server ([`Session::wait_in_pool`]). A wait that no query of the
    /// client's is in flight for (a session's own server, taken at login) is timed from its
    /// start all the same, as PgBouncer times a waiting client's: SHOW CLIENTS' `wait` and
    /// SHOW POOLS' `maxwait` show it, not 0. A transaction's wait is its query's already.
    async fn wait_for_server(&mut self) -> Result<Box<ServerConn>, CheckoutError> {
        let timed = self.info.start_wait(self.app.clock_us());
        let waited = self.wait_in_pool().await;
        if timed {
            self.info.end_wait();
        }
        waited
    }

    /// The pool's wait for a server; once it has lasted `query_wait_notify`, the client is
    /// told it waits with PgBouncer's NOTICE (once), and the wait goes on.
    async fn wait_in_pool(&mut self) -> Result<Box<ServerConn>, CheckoutError> {
        let (pool, info) = (self.pool.clone(), self.info.clone());
        let wait = pool.checkout_waiting(Some(info.killed_flag()));
        let notify = self.app.config.load().general.query_wait_notify;
        if notify.is_zero() {
            return wait.await;
        }
        tokio::pin!(wait);
        // Biased: the wait first (a server granted at the notice's deadline is taken), and no
        // random draw for the order (~100 instructions a wait, callgrind).
        tokio::select! {
            biased;
            done = &mut wait => return done,
            () = crate::timer::sleep(notify) => {}
        }
        be::notice_response(
            &mut self.client.wbuf,
            sqlstate::SUCCESSFUL_COMPLETION,
            "No server connection available in postgres backend, client being queued",
        );
        // A client gone meanwhile is found when its server comes.
        let _ = self.client.flush().await;
        wait.await
    }

    /// Holds the server the pool gave, unless the client was killed meanwhile: then it goes
    /// back, and nothing of what the client asked for runs.
    pub(super) fn use_server(
        &mut self,
        server: Box<ServerConn>,
    ) -> Option<Pin<Box<dyn std::future::Future<Output = End> + Send + '_>>> {
        if self.info.is_killed() {
            self.pool.checkin(server);
            return Some(self.shutdown_client());
        }
        self.hold(server);
        None
    }

    /// Tells the client why it got no server. Boxed: rare, and the session's task need not
    /// keep room for the error and its reporting.
    pub(super) fn checkout_failed(
        &mut self,
        e: CheckoutError,
    ) -> Pin<Box<dyn std::future::Future<Output = End> + Send + '_>> {
        Box::pin(async move {
            let msg = e.to_string();
            tracing::warn!(client = %self.info.addr, pool = ?self.pool.key, "{msg}");
            self.report_checkout_error(e).await;
            End::NoServer(msg)
        })
    }

    /// Reads what a simple query (its text `query_text_len` bytes long, its words
    /// `query_words`) or, without the statement planner, a Parse may do to the session's
    /// state (see [`state`]).
    #[inline]
    pub(super) fn note_state(
        &mut self,
        tag: u8,
        len: usize,
        query_text_len: Option<usize>,
        query_words: u32,
    ) {
        let standard = self.standard_strings();
        let body = body(&self.client.rbuf[..len]);
        let text = match tag {
            fe::QUERY => query_text_len.map(|n| &body[..n]),
            fe::PARSE if self.plan.stmts.is_none() => fe::Parse::parse(body).map(|p| p.query),
            // Its statement was read with standard strings: probed after, whatever it does.
            fe::BIND if !standard => {
                self.state.touched = true;
                None
            }
            _ => None,
        };
        if let Some(text) = text {
            let mut touch = if tag == fe::QUERY {
                facts::touch_found(query_words, text)
            } else {
                facts::touch(text)
            };
            if !standard {
                // Backslashes in plain strings: where a statement starts is read by PostgreSQL's
                // parser alone, so every text is probed after and read for settings.
                touch.probe = true;
                touch.custom = true;
            }
            self.state.note(touch);
            self.state.note_calls(text);
            if touch.custom {
                self.state
                    .note_custom(&facts::custom_settings(text, standard));
            }
        }
    }

    /// Whether the client's standard_conforming_strings is on (see [`Readable`]).
    pub(super) fn standard_strings(&mut self) -> bool {
        self.readable().standard_strings
    }

    /// How pgmemo may read the client's text, worked out once per `params_version`.
    #[inline]
    pub(super) fn readable(&mut self) -> Readable {
        match self.params.readable.at(self.params.version) {
            Some(readable) => readable,
            None => self.work_out_readable(),
        }
    }

    /// [`Session::readable`] after a change of the client's settings (kept out of the
    /// per-message path).
    #[cold]
    #[inline(never)]
    fn work_out_readable(&mut self) -> Readable {
        let readable = Readable {
            standard_strings: self.params.reported.is("standard_conforming_strings", "on"),
            autoprepare: crate::autoprepare::settings_allow(&self.params.reported),
        };
        self.params.readable = ReadableAt::new(self.params.version, readable);
        readable
    }

    /// Writes the replies pgmemo gives itself (ParseComplete, CloseComplete, ...) that have
    /// reached the head of the queue, i.e. whose turn it is in PostgreSQL's order.
    // Mostly there are none, nor outcomes to settle: that is checked inline (a call that does
    // nothing cost ~40 instructions, two or three a transaction).
    #[inline]
    pub(super) fn answer_locally(&mut self) {
        if self.replies.head_is_synthesized() || self.settle_due() {
            self.answer_locally_now();
        }
    }

    #[inline(never)]
    fn answer_locally_now(&mut self) {
        let before = self.client.wbuf.len();
        while let Some(synth) = self.replies.pop_synthesized() {
            match synth {
                Synth::ParseComplete => {
                    crate::protocol::write_empty_message(&mut self.client.wbuf, be::PARSE_COMPLETE)
                }
                Synth::CloseComplete => {
                    crate::protocol::write_empty_message(&mut self.client.wbuf, be::CLOSE_COMPLETE)
                }
                Synth::Replies(replies) => self.client.wbuf.extend_from_slice(&replies),
                Synth::Deallocate => {
                    let status = self.server.as_ref().map_or(b'I', |s| s.status);
                    be::command_complete(&mut self.client.wbuf, "DEALLOCATE");
                    be::ready_for_query(&mut self.client.wbuf, status);
                    self.stats.query_count += 1;
                }
            }
        }
        // Replies in the server's place are replies sent (SHOW STATS' total_sent).
        self.stats.bytes_sent += (self.client.wbuf.len() - before) as u64;
        self.settle(None, None, false);
    }
}

/// CopyData, CopyDone and CopyFail: the client's side of a COPY FROM STDIN, never planned.
#[inline]
pub(super) fn is_copy_message(tag: u8) -> bool {
    matches!(tag, fe::COPY_DATA | fe::COPY_DONE | fe::COPY_FAIL)
}

/// What the session does next with the message at the head of the client's input.
#[derive(Debug)]
enum Next {
    /// Go on with it (to the next stage, or to the server).
    Go,
    /// It is dealt with: on to the next message.
    Done,
    /// Read no further for now (it waits for the server).
    Stop,
    /// Take a server first.
    Acquire,
    /// The session ends.
    End(End),
}
