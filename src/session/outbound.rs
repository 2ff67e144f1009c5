//! What the session does with the server's messages: each reply is matched against the reply
//! queue and forwarded, rewritten or swallowed; the features that follow replies (autoprepare's
//! held descriptions and retries, the result cache's capture, ParameterStatus, pins) are told;
//! and once the server owes nothing, the transaction is settled and the server given back.

use super::{caching, planner, state, ClientParams, End, Planning, Session, HIGH_WATER};
use crate::buffers;
use crate::pool::PoolMode;
use crate::protocol::backend::{self as be, sqlstate, ErrorFields};
use crate::protocol::{body, frame, MAX_BACKEND_MESSAGE_SIZE};
use crate::replies::{self, ErrorRewrite, Route};
use bytes::Bytes;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

impl Session {
    /// Routes every complete server message, then gives the server back if the client's work
    /// on it is done (transaction mode).
    ///
    /// Each message goes through the same stages, one call per feature: framed; judged for a
    /// retry; its description noted for idle batches; routed by the reply queue (and by the
    /// retry); noted for the session (ReadyForQuery, ParameterStatus, a FATAL); autoprepare's
    /// held description let out; relayed as routed; shown to the result cache and the
    /// search_path watch; and the transaction settled.
    pub(super) fn handle_server_messages(&mut self) -> Result<(), End> {
        if self.server.is_none() {
            return Ok(());
        }
        // Usually lent when the client sent its query; not when the server speaks first (a
        // notification to an idle session-mode client).
        buffers::lend(&mut self.client.wbuf);
        self.local_replies_only = false;
        // Read once for the messages of this wake, when the result cache needs it.
        let mut pool_settings = None;
        while self.client.wbuf.len() < HIGH_WATER {
            // (Otherwise backpressure: let the client read first.)
            let Some((tag, len)) = self.frame_server_message()? else {
                break;
            };
            self.plan.waiting = false;
            if self.relay_reply_in_lane(tag, len) {
                continue; // a reply with nothing to do but relaying (see `lane`)
            }
            let out_at = self.client.wbuf.len();
            let again = self.again(tag, len);
            self.observe_description(tag, len);
            self.note_position(tag, len);
            // Whose error it is, read before the queue moves on: pgmemo's own query's, or the
            // client's statement's (swallowed when pgmemo prepares it silently).
            let own_error = tag == be::ERROR_RESPONSE && self.replies.answers_internal();
            let mut route = self.replies.on_server_message(tag);
            let turn = self.route_again(again, tag, len, &mut route);
            self.note_server_message(tag, len, route, again, own_error);
            route = self.release_held_description(tag, route);
            self.relay_reply(tag, len, route);
            self.cache_observe(tag, len, out_at, &mut pool_settings);
            self.consume_server_message(tag, len, turn);
            if self.server.is_none() {
                return Ok(());
            }
            if tag == be::READY_FOR_QUERY && self.done_with_server() {
                // What the server says after the ReadyForQuery that ended the client's work
                // on it is its own, not the client's (see `release_if_done`).
                break;
            }
        }
        self.release_if_done();
        Ok(())
    }

    /// The next complete message in the server's input: its type and length.
    #[inline]
    fn frame_server_message(&mut self) -> Result<Option<(u8, usize)>, End> {
        let server = self.server.as_mut().expect("a server is held");
        frame(&server.rbuf, MAX_BACKEND_MESSAGE_SIZE).map_err(|e| {
            server.broken = true;
            End::ServerGone(format!("server sent an invalid message: {e}"))
        })
    }

    /// Whether this server message makes pgmemo run the client's work again instead of
    /// relaying it.
    #[inline]
    fn again(&self, tag: u8, len: usize) -> Again {
        if tag != be::ERROR_RESPONSE || !self.plan.retry.is_armed() {
            return Again::No;
        }
        let body = body(&self.server.as_ref().expect("a server is held").rbuf[..len]);
        // An autoprepared query whose literal the Bind refused (with two bad literals
        // PostgreSQL's analysis may name another first), as the first statement of an
        // implicit transaction: PostgreSQL reads a Bind's parameters before it plans or runs
        // anything (15: `select count_call(), $1::int` bound with 'x' fails with 22P02 before
        // its BindComplete, count_call not called), so it runs again as it is, for
        // PostgreSQL's own reply, its position in the text included. Whatever the input
        // function said: a data exception, or a reg* type's 3F000, 42P01, 42883, 42704
        // (`regclass('ng_catalog.pg_class')`, pg_regress' regproc); never a cancel, a
        // timeout, a deadlock or a failure of the server, which must reach the client as
        // they are.
        if self.replies.head_is_autoprepared_bind()
            && crate::autoprepare::is_parameter_error(body)
            && crate::autoprepare::is_repeatable(body)
        {
            return Again::Rerun;
        }
        // An error the plain query would raise again (`regclass('ng_catalog.pg_class')`'s
        // 3F000 as well as a data exception): never a cancel or a timeout.
        if crate::autoprepare::is_repeatable(body) {
            // An autoprepared SELECT that failed after its BindComplete and RowDescription,
            // before its first row (see `ClientAutoprepare::checks_plan`): it was executing,
            // and whatever it called before the error has run. It is never sent again; its
            // plan is checked instead.
            if self.plan.held_description
                && self
                    .reading
                    .autoprepare
                    .as_ref()
                    .is_some_and(|a| a.checks_plan && !a.checking)
                && self.plan.retry.kept_query().is_some()
            {
                return Again::Check;
            }
        }
        // 0A000 on the first statement of an implicit transaction whose batch is kept, with
        // nothing queued after the batch: sent again instead (see planner::Retry).
        if self.replies.head_is_retry_point()
            && ErrorFields::parse(body).is_some_and(|f| f.code == "0A000")
        {
            return Again::Retry;
        }
        Again::No
    }

    /// A description of a statement an idle batch may describe later without a server.
    #[inline]
    fn observe_description(&mut self, tag: u8, len: usize) {
        if !matches!(
            tag,
            be::PARAMETER_DESCRIPTION | be::ROW_DESCRIPTION | be::NO_DATA
        ) {
            return;
        }
        if let Some((statement, generation)) = self.replies.head_describes() {
            let server = self.server.as_mut().expect("a server is held");
            crate::statements::idle_batch::observe_description(
                &mut server.describing,
                statement,
                generation,
                &server.rbuf[..len],
            );
        }
    }

    /// The retry's part in routing: an error run again is swallowed, and so is the
    /// ReadyForQuery before a kept batch is sent again; an error whose query's plan is
    /// checked is swallowed (kept with what is held) and the check sent. `len`: the message's.
    #[inline]
    fn route_again(&mut self, again: Again, tag: u8, len: usize, route: &mut Route) -> Turn {
        let mut turn = Turn::default();
        match again {
            // Other work queued behind it: the error reaches the client as it is (after the
            // RowDescription held, see `release_held_description`).
            Again::Rerun | Again::Retry | Again::Check if self.replies.len() != 1 => {
                self.plan.retry.forget()
            }
            Again::Check => {
                *route = Route::Swallow;
                self.check_plan(len);
            }
            Again::Rerun => {
                *route = Route::Swallow;
                self.plan.retry.swallow_ready();
                if let Some(ap) = self.reading.autoprepare.as_mut() {
                    ap.bypass = true;
                }
            }
            Again::Retry => {
                *route = Route::Swallow;
                turn.retried = true;
                self.plan.retry.swallow_ready();
            }
            Again::No if tag == be::READY_FOR_QUERY && self.plan.retry.is_pending() => {
                *route = Route::Swallow;
                turn.replay = true;
            }
            Again::No if tag == be::READY_FOR_QUERY && *route == Route::Forward => {
                // The kept batch ended.
                self.plan.retry.forget();
            }
            Again::No => {}
        }
        turn
    }

    /// What a ReadyForQuery, ParameterStatus or ErrorResponse tells the session.
    #[inline]
    fn note_server_message(
        &mut self,
        tag: u8,
        len: usize,
        route: Route,
        again: Again,
        own_error: bool,
    ) {
        match tag {
            be::READY_FOR_QUERY => self.note_ready(len, route),
            be::PARAMETER_STATUS => self.note_parameter_status(len, route),
            be::COMMAND_COMPLETE => {
                let server = self.server.as_mut().expect("a server is held");
                server.completed_since_ready = true;
                // pgmemo's own queries (a parameter sync, a probe) are not the client's rows.
                if route == Route::Forward {
                    self.note_rows(tag, len);
                }
            }
            be::DATA_ROW | be::PORTAL_SUSPENDED if route == Route::Forward => {
                self.note_rows(tag, len);
            }
            // A row of pgmemo's own query: autoprepare's check of a statement's parameter
            // types is the only one whose rows say something.
            be::DATA_ROW if route == Route::Swallow => self.replies.note_checked_types(),
            be::ERROR_RESPONSE => {
                let server = self.server.as_mut().expect("a server is held");
                let fields = ErrorFields::parse(body(&server.rbuf[..len])).unwrap_or_default();
                if fields.is_fatal() {
                    server.broken = true;
                    // Passed on, as it is or rewritten (an autoprepared query's, a renamed
                    // statement's): the session ends with it, as PostgreSQL's does, before
                    // the client, told, may come back (see `Session::server_gone`).
                    self.server_fatal |= route != Route::Swallow;
                }
                if route == Route::Swallow && !matches!(again, Again::Retry | Again::Check) {
                    if own_error {
                        tracing::warn!(pool = ?self.pool.key, code = %fields.code, "pgmemo's own query failed on the server: {}", fields.message);
                    } else {
                        // The client's statement, prepared silently (autoprepare, a statement
                        // made again on another server): the client's error, its to see.
                        tracing::debug!(pool = ?self.pool.key, code = %fields.code, "a client's statement failed where pgmemo prepared it: {}", fields.message);
                    }
                    // It may have been the parameter sync: check it again next time.
                    server.params_synced_for = None;
                }
            }
            _ => {}
        }
    }

    /// A DataRow, CommandComplete or PortalSuspended, for a query being timed (SHOW QUERIES):
    /// a statement's rows are its tag's count (a write's, or a read's), or the DataRows
    /// before a PortalSuspended.
    #[inline]
    pub(super) fn note_rows(&mut self, message: u8, len: usize) {
        // About one query in `TIMED_EVERY` is timed: the others pay this test only, inline.
        if self
            .reading
            .reader
            .as_deref()
            .is_some_and(|r| r.timed.is_some())
        {
            self.note_timed_rows(message, len);
        }
    }

    #[inline(never)]
    fn note_timed_rows(&mut self, message: u8, len: usize) {
        let Some(timed) = self
            .reading
            .reader
            .as_deref_mut()
            .and_then(|r| r.timed.as_mut())
        else {
            return;
        };
        match message {
            be::DATA_ROW => timed.data_rows += 1,
            be::PORTAL_SUSPENDED => timed.rows += std::mem::take(&mut timed.data_rows),
            _ => {
                let server = self.server.as_ref().expect("a server is held");
                let tag = body(&server.rbuf[..len]);
                let data_rows = std::mem::take(&mut timed.data_rows);
                timed.rows += be::command_rows(tag).unwrap_or(data_rows);
            }
        }
    }

    /// A ReadyForQuery: the server's transaction status.
    #[inline]
    fn note_ready(&mut self, len: usize, route: Route) {
        let server = self.server.as_mut().expect("a server is held");
        server.set_ready(body(&server.rbuf[..len]).first().copied().unwrap_or(b'I'));
        if server.status != b'T' {
            if let Some(c) = self.cache.as_deref_mut() {
                c.read_committed = None;
            }
        }
        if route == Route::Forward {
            self.stats.query_count += 1;
            if !self.replies.has_pending_work() {
                // The client's work is answered: its query time ends (SHOW STATS).
                let in_transaction = server.status != b'I';
                if let Some(took) = self
                    .info
                    .end_query_at_ready(self.app.clock_us(), in_transaction)
                {
                    self.stats.query_time_us += took;
                }
            }
            let timed = self
                .reading
                .reader
                .as_deref_mut()
                .and_then(|r| r.timed.take());
            if let Some(t) = timed {
                t.shape
                    .stats
                    .note_timed(crate::clock::Moment::now().micros_since(t.sent), t.rows);
            }
        }
        if let Some(stmts) = self.plan.stmts.as_mut() {
            stmts
                .schema
                .ready(server.status == b'I' && self.replies.is_idle());
        }
    }

    /// A ParameterStatus: the server's setting, and the client's when it is told it.
    fn note_parameter_status(&mut self, len: usize, route: Route) {
        let server = self.server.as_mut().expect("a server is held");
        server.note_parameter_status(len);
        let Some((name, value)) = be::parse_parameter_status(body(&server.rbuf[..len])) else {
            return;
        };
        if route != Route::Forward
            || self.params.reported.get(name) == Some(value)
            || !Arc::make_mut(&mut self.params.reported).set(name, value)
        {
            return;
        }
        self.params.version += 1;
        if name == "application_name" {
            *self.info.application_name.lock() = self.app.intern(value);
        }
        if let Some(stmts) = self
            .plan
            .stmts
            .as_mut()
            .filter(|_| crate::statements::registry::LITERAL_SETTINGS.contains(&name))
        {
            stmts.literals_changed(
                &self.app.registry,
                crate::statements::registry::literal_settings(&self.params.reported),
            );
        }
    }

    /// The RowDescription held back for an autoprepared query (see
    /// `Action::AsSimpleQueryHeld`): out before its first row or its CommandComplete; with an
    /// error, dropped for a query that writes, and for a SELECT kept for its plan check (see
    /// `Session::settle_plan_check`), out before the error if the check cannot be sent.
    /// Notices of a SELECT come after its RowDescription, and are held with it. The message's
    /// route.
    // Always inlined into its two callers, the stages and the relay lane: a call cost the
    // lane ~45 instructions a `-M simple` transaction (bench/budget.py).
    #[inline(always)]
    pub(super) fn release_held_description(&mut self, tag: u8, route: Route) -> Route {
        if !self.plan.held_description {
            return route;
        }
        let (checking, checks_plan) = self
            .reading
            .autoprepare
            .as_ref()
            .map_or((false, false), |a| (a.checking, a.checks_plan));
        if checking {
            return self.settle_plan_check(tag, route);
        }
        match tag {
            be::DATA_ROW | be::COMMAND_COMPLETE | be::ERROR_RESPONSE | be::READY_FOR_QUERY => {
                self.plan.held_description = false;
                if let Some(ap) = self.reading.autoprepare.as_mut() {
                    let out = matches!(tag, be::DATA_ROW | be::COMMAND_COMPLETE)
                        || (tag == be::ERROR_RESPONSE && ap.checks_plan && route != Route::Swallow);
                    if out {
                        self.client.wbuf.extend_from_slice(&ap.held);
                        self.stats.bytes_sent += ap.held.len() as u64;
                    }
                    ap.held.clear();
                }
                route
            }
            be::NOTICE_RESPONSE if checks_plan => Route::Hold,
            _ => route,
        }
    }

    /// Holds the server's message (`len` bytes) back with the autoprepared query's
    /// RowDescription (see [`Session::release_held_description`]).
    #[inline(always)]
    pub(super) fn hold_reply(&mut self, len: usize) {
        let server = self.server.as_ref().expect("a server is held");
        if let Some(ap) = self.reading.autoprepare.as_mut() {
            ap.held.extend_from_slice(&server.rbuf[..len]);
            self.plan.held_description = true;
        }
    }

    /// Sends the plan check of an autoprepared SELECT that failed while executing, before its
    /// first row (see `ClientAutoprepare::checks_plan`), with nothing of the client's queued
    /// after its Sync: the error (the server's message, `len` bytes) joins the RowDescription
    /// and notices held, the query's ReadyForQuery is swallowed, and the client's text is
    /// parsed and bound without an Execute ([`crate::autoprepare::write_plan_check`]),
    /// pipelined after the query's Sync on the same server. Its ReadyForQuery is the client's.
    /// Before, the query ran again as it was: a volatile function called before the error
    /// (`select nextval('s') + 1/(select 0)`) ran twice.
    #[cold]
    fn check_plan(&mut self, len: usize) {
        let server = self.server.as_mut().expect("a server is held");
        let (Some(ap), Some(sql)) = (
            self.reading.autoprepare.as_mut(),
            self.plan.retry.kept_query(),
        ) else {
            return; // (`again` made sure of both)
        };
        ap.held.extend_from_slice(&server.rbuf[..len]);
        ap.checking = true;
        crate::autoprepare::write_plan_check(&mut server.wbuf, sql);
        // The failed query's Sync, now at the head: its ReadyForQuery is pgmemo's.
        self.replies.push_plan_check();
        self.plan.retry.forget();
        self.app.autoprepare.plan_checks.fetch_add(1, Relaxed);
    }

    /// A message while a plan check is in flight (see `Session::check_plan`): what is held
    /// (RowDescription, notices, the error) goes out when the Bind of the client's text
    /// completes, for PostgreSQL plans the simple query without an error and describes its
    /// rows before it fails executing; it is dropped when the Parse or Bind fails, that error
    /// (forwarded as it is) being PostgreSQL's own answer to the simple query, which failed
    /// while planning. Everything else goes as routed: the ParseComplete and BindComplete are
    /// swallowed (`Action::Skip`), the failed query's ReadyForQuery too, the check's
    /// forwarded. The message's route.
    #[cold]
    fn settle_plan_check(&mut self, tag: u8, route: Route) -> Route {
        let release = match tag {
            be::BIND_COMPLETE => true,
            // (A ReadyForQuery of the client's before either cannot come: the Parse or the
            // Bind answers first.)
            be::ERROR_RESPONSE | be::READY_FOR_QUERY if route == Route::Forward => false,
            _ => return route,
        };
        self.plan.held_description = false;
        if let Some(ap) = self.reading.autoprepare.as_mut() {
            if release {
                self.client.wbuf.extend_from_slice(&ap.held);
                self.stats.bytes_sent += ap.held.len() as u64;
            }
            ap.held.clear();
            ap.checking = false;
        }
        route
    }

    /// Relays the message as routed: to the client (as it is, or rewritten), held, or not.
    #[inline]
    fn relay_reply(&mut self, tag: u8, len: usize, route: Route) {
        let server = self.server.as_mut().expect("a server is held");
        let msg = &server.rbuf[..len];
        match route {
            Route::Forward if tag == be::NOTIFICATION_RESPONSE => {
                let app = &self.app;
                state::write_notification(
                    &mut self.client.wbuf,
                    msg,
                    server.info.backend_pid,
                    self.info.pid(),
                    |pid| app.notifier_pid(pid),
                );
                self.stats.bytes_sent += len as u64;
            }
            // PostgreSQL's 26000 about a SQL-level statement of the client's whose PREPARE
            // failed on this server: what PostgreSQL's own EXECUTE would raise (see
            // `ServerSet::sql_error`).
            Route::Forward if tag == be::ERROR_RESPONSE && server.prepared.has_sql_errors() => {
                let shown = server
                    .prepared
                    .sql_error_for(body(msg))
                    .map_or(msg, |e| &e[..]);
                self.client.wbuf.extend_from_slice(shown);
                self.stats.bytes_sent += shown.len() as u64;
            }
            Route::Forward => {
                buffers::append(&mut self.client.wbuf, msg);
                self.stats.bytes_sent += len as u64;
            }
            Route::Hold => self.hold_reply(len),
            Route::Replace => {
                let at = self.client.wbuf.len();
                let autoprepare = self.reading.autoprepare.as_deref();
                ErrorRewrite::write(
                    self.replies.take_replacement(),
                    &mut self.client.wbuf,
                    msg,
                    |out, body| match autoprepare {
                        Some(client) => {
                            crate::autoprepare::simple_error(out, body, client);
                            true
                        }
                        None => false,
                    },
                );
                self.stats.bytes_sent += (self.client.wbuf.len() - at) as u64;
            }
            Route::Swallow => {}
        }
    }

    /// Shows the result cache the message and what the client was sent for it (from
    /// `out_at` in its output).
    #[inline]
    fn cache_observe(
        &mut self,
        tag: u8,
        len: usize,
        out_at: usize,
        pool_settings: &mut Option<arc_swap::Guard<Arc<crate::pool::PoolSettings>>>,
    ) {
        let Some(client) = self.cache.as_deref_mut().filter(|c| c.watching()) else {
            return;
        };
        let body = body(&self.server.as_ref().expect("a server is held").rbuf[..len]);
        // Nothing in flight and no transaction open: whatever was sent has ended.
        let idle =
            tag == be::READY_FOR_QUERY && body.first() == Some(&b'I') && self.replies.is_idle();
        let pool_settings = pool_settings.get_or_insert_with(|| self.pool.settings_now());
        caching::after_server_message(
            client,
            &self.app.cache,
            &pool_settings.target.database_id,
            &self.client.wbuf[out_at..],
            tag,
            body,
            idle,
        );
    }

    /// The message is done with: the search_path watch sees it, it leaves the input, the
    /// transaction is settled, and a kept batch is planned again when `turn` says so.
    #[inline]
    fn consume_server_message(&mut self, tag: u8, len: usize, turn: Turn) {
        let server = self.server.as_mut().expect("a server is held");
        let mut error_code = None;
        // The ErrorResponse, whole, when it ended bookkeeping: a 0A000 answers the clients of
        // a statement it made stale; a SQL-level statement's failed PREPARE stands for the
        // EXECUTEs of it (see `ServerSet::sql_error`).
        let mut error = None;
        if tag == be::ERROR_RESPONSE {
            error_code = ErrorFields::parse(body(&server.rbuf[..len])).map(|f| f.code);
            if self.replies.has_outcomes() || error_code.as_deref() == Some("0A000") {
                error = Some(Bytes::copy_from_slice(&server.rbuf[..len]));
            }
        }
        if let Some(stmts) = self.plan.stmts.as_mut().filter(|s| s.search_path.is_open()) {
            // A SET of search_path in a transaction that may now end.
            stmts
                .search_path
                .observe(tag, body(&server.rbuf[..len]), server.status);
        }
        buffers::consume(&mut server.rbuf, len);
        self.settle_reply(error_code.as_deref(), error, turn.retried);
        if turn.replay {
            // Planned again before whatever the client sent since.
            let mut input = self.plan.retry.replay();
            input.extend_from_slice(&self.client.rbuf);
            self.client.rbuf = input;
            tracing::debug!(client = %self.info.addr, "batch sent again after 0A000");
        }
    }

    /// After a server message left the input: the statements' outcomes it decided are
    /// settled, and a local reply it brought to the head of the queue is written.
    #[inline]
    pub(super) fn settle_reply(
        &mut self,
        error_code: Option<&str>,
        error: Option<Bytes>,
        retried: bool,
    ) {
        if self.plan.stmts.is_some() {
            self.settle(error_code, error, retried);
            // Settled just now: only a local reply due next leaves anything to do.
            if self.replies.head_is_synthesized() {
                self.answer_locally();
            }
        }
    }

    /// Tells cancel requests whether the client's work runs on its server (see
    /// [`crate::cancel`]): from when it is sent until its last reply is in.
    #[inline]
    pub(super) fn note_running(&self) {
        if self.replies.is_empty() {
            self.info.cancels.done();
        } else {
            self.info.cancels.running();
        }
    }

    /// Gives the server back in transaction mode when the client's work on it is done. Not
    /// before the Sync of an extended batch: until then PostgreSQL keeps the batch's implicit
    /// transaction open (or skips everything after an error), whatever ReadyForQuery said
    /// last. Nor while a client message waits to be planned again on it.
    ///
    /// A server the client is done with that has said more (a FATAL as PostgreSQL shuts down
    /// or a backend is terminated, read with the reply before it): that is the server's news,
    /// not the client's, which holds no server between transactions. The server is closed
    /// (PgBouncer: "idle server got something"); the client goes on on another. Relayed, it
    /// ended a client whose transaction had succeeded (tests/pooling.rs).
    #[inline]
    pub(super) fn release_if_done(&mut self) {
        if self.done_with_server() {
            if let Some(server) = self.server.as_mut().filter(|s| !s.rbuf.is_empty()) {
                server.broken = true;
            }
            self.release_server();
        } else if self.session_transaction_done() {
            self.session_transaction_counted();
        }
    }

    /// The client's work on its server ended (see [`Session::work_ended`], whatever the
    /// server has sent since), and nothing keeps the server: it goes back.
    #[inline]
    fn done_with_server(&self) -> bool {
        self.work_ended() && !self.state.keeps_server() && !self.commit_position_due()
    }

    /// Session mode, and a transaction of the client ended on the server it keeps: nothing
    /// in flight, the server idle outside a transaction, and something ran since the last
    /// count (not a notification's wake).
    #[inline]
    fn session_transaction_done(&self) -> bool {
        self.mode == PoolMode::Session
            && self.stats.query_count != 0
            && !self.plan.replan
            && self.replies.is_idle()
            && self
                .server
                .as_ref()
                .is_some_and(|s| s.status == b'I' && s.rbuf.is_empty())
    }

    /// Transaction mode, and the client's work on its server is done: it ended
    /// ([`Session::work_ended`]) and the server has said nothing since.
    #[inline]
    pub(super) fn work_done(&self) -> bool {
        self.work_ended() && self.server.as_ref().is_some_and(|s| s.rbuf.is_empty())
    }

    /// Transaction mode, and the client's work on its server ended: nothing in flight,
    /// nothing waiting to be planned, the server idle outside a transaction.
    #[inline]
    fn work_ended(&self) -> bool {
        self.mode == PoolMode::Transaction
            && !self.plan.replan
            && self.replies.is_idle()
            && self.server.as_ref().is_some_and(|s| s.status == b'I')
    }

    /// Applies the bookkeeping of entries that ended: kept when their message ran, undone
    /// (newest first) when PostgreSQL discarded it.
    #[inline]
    pub(super) fn settle(&mut self, error_code: Option<&str>, error: Option<Bytes>, retried: bool) {
        // Called after every server read and local answer, mostly with nothing to do: that is
        // checked here, before the large frame of the work itself (~550 instructions per
        // transaction for nothing, measured).
        if self.settle_due() {
            self.settle_outcomes(error_code, error, retried);
        }
    }

    /// Whether [`Session::settle`] has work: outcomes, or a search_path to carry.
    #[inline]
    pub(super) fn settle_due(&self) -> bool {
        self.replies.has_outcomes()
            || self
                .plan
                .stmts
                .as_ref()
                .is_some_and(|s| s.search_path.has_carry())
    }

    #[inline(never)]
    pub(super) fn settle_outcomes(
        &mut self,
        error_code: Option<&str>,
        error: Option<Bytes>,
        retried: bool,
    ) {
        let Session {
            app,
            replies,
            plan: Planning { stmts, .. },
            server,
            params: ClientParams {
                settings, version, ..
            },
            ..
        } = self;
        let outcomes = replies.drain_outcomes();
        let Some(stmts) = stmts.as_mut() else {
            return;
        };
        for (effect, outcome) in outcomes.into_iter().flatten() {
            if let (
                crate::statements::Effect::Uses { statement, .. },
                replies::Outcome::Failed,
                Some("0A000"),
            ) = (&effect, outcome, error_code)
            {
                if let Some(message) = error.clone() {
                    statement.set_stale_error(message);
                }
            }
            if let (
                crate::statements::Effect::Uses { statement, .. },
                replies::Outcome::Failed,
                Some(sqlstate::INTERNAL_ERROR),
            ) = (&effect, outcome, error_code)
            {
                // "cache lookup failed for type N": the server's copy outlived a type that a
                // schema change pgmemo did not see dropped. Later Parses get a fresh one.
                if app.registry.retire(statement) {
                    tracing::info!(statement = %statement.server_name, "statement retired after XX000 (a schema change made outside pgmemo?)");
                }
            }
            planner::settle(
                stmts,
                server.as_deref_mut(),
                effect,
                outcome,
                error_code,
                error.as_ref(),
                retried,
            );
        }
        if let Some(path) = stmts.search_path.take_carry() {
            *version += 1;
            planner::carry_search_path(
                &path,
                &mut stmts.search_path,
                settings,
                server.as_deref_mut(),
            );
        }
    }
}

/// Whether a server's error makes pgmemo run the client's work again (see `Session::again`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Again {
    No,
    /// An autoprepared query whose literal the Bind refused runs again as the client sent
    /// it.
    Rerun,
    /// An autoprepared SELECT that failed while executing has its plan checked (see
    /// `Session::check_plan`).
    Check,
    /// The kept batch is sent again after 0A000 (see `planner::Retry`).
    Retry,
}

/// What the retry decided for after the message: the error was retried; the kept batch is
/// planned again now.
#[derive(Debug, Clone, Copy, Default)]
struct Turn {
    retried: bool,
    replay: bool,
}
