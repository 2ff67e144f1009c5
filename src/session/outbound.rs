//! What the session does with the server's messages: each reply is matched against the reply
//! queue and forwarded, rewritten or swallowed; the features that follow replies (autoprepare's
//! held descriptions and retries, the result cache's capture, ParameterStatus, pins) are told;
//! and once the server owes nothing, the transaction is settled and the server given back.

use super::{caching, planner, state, End, Session, HIGH_WATER};
use crate::buffers;
use crate::pool::PoolMode;
use crate::protocol::backend::{self as be, sqlstate, ErrorFields};
use crate::protocol::{frame, MAX_BACKEND_MESSAGE_SIZE};
use crate::query::command;
use crate::replies::{self, ErrorRewrite, Route};
use bytes::{Buf, Bytes};
use std::sync::Arc;

impl Session {
    /// Routes every complete server message, then gives the server back if the client's work
    /// on it is done (transaction mode).
    pub(super) fn handle_server_messages(&mut self) -> Result<(), End> {
        let Some(mut server) = self.server.as_mut() else {
            return Ok(());
        };
        // Usually lent when the client sent its query; not when the server speaks first (a
        // notification to an idle session-mode client).
        buffers::lend(&mut self.client.wbuf);
        self.local_replies_only = false;
        // Read once for the messages of this wake, when the result cache needs it.
        let mut pool_settings = None;
        loop {
            if self.client.wbuf.len() >= HIGH_WATER {
                break; // backpressure: let the client read first
            }
            let (tag, len) = match frame(&server.rbuf, MAX_BACKEND_MESSAGE_SIZE) {
                Ok(Some(f)) => f,
                Ok(None) => break,
                Err(e) => {
                    server.broken = true;
                    return Err(End::ServerGone(format!(
                        "server sent an invalid message: {e}"
                    )));
                }
            };
            self.waiting = false;
            let out_at = self.client.wbuf.len();
            // 0A000 on the first statement of an implicit transaction whose batch is kept,
            // with nothing queued after the batch: sent again instead (see planner::Retry).
            let retry = tag == be::ERROR_RESPONSE
                && self.retry.is_armed()
                && self.replies.head_is_retry_point()
                && ErrorFields::parse(&server.rbuf[5..len]).is_some_and(|f| f.code == "0A000");
            // An autoprepared SELECT that failed before its first row (see
            // `ClientAutoprepare::rerun`), or an autoprepared query whose literal the Bind
            // refused (with two bad literals PostgreSQL's analysis may name another first),
            // as the first statement of an implicit transaction: nothing of it ran, so it runs
            // again as it is, for PostgreSQL's own reply. Only for data exceptions (class 22:
            // what folding constants and reading literals raise), never for a cancel, a
            // timeout, a deadlock or a serialization failure, which must reach the client.
            let rerun = tag == be::ERROR_RESPONSE
                && self.retry.is_armed()
                && crate::autoprepare::is_data_exception(&server.rbuf[5..len])
                && ((self.held_description && self.autoprepare.as_ref().is_some_and(|a| a.rerun))
                    || (self.replies.head_is_autoprepared_bind()
                        && crate::autoprepare::is_parameter_error(&server.rbuf[5..len])));
            if matches!(
                tag,
                be::PARAMETER_DESCRIPTION | be::ROW_DESCRIPTION | be::NO_DATA
            ) {
                if let Some((statement, generation)) = self.replies.head_describes() {
                    crate::statements::idle_batch::observe_description(
                        &mut server.describing,
                        statement,
                        generation,
                        &server.rbuf[..len],
                    );
                }
            }
            let mut route = self.replies.on_server_message(tag);
            let mut replay = false;
            let mut retried = false;
            if rerun {
                if self.replies.len() == 1 {
                    route = Route::Swallow;
                    self.retry.swallow_ready();
                    if let Some(ap) = self.autoprepare.as_mut() {
                        ap.bypass = true;
                    }
                } else {
                    self.retry.forget();
                }
            } else if retry {
                if self.replies.len() == 1 {
                    route = Route::Swallow;
                    retried = true;
                    self.retry.swallow_ready();
                } else {
                    self.retry.forget();
                }
            } else if tag == be::READY_FOR_QUERY && self.retry.is_pending() {
                route = Route::Swallow;
                replay = true;
            } else if tag == be::READY_FOR_QUERY && route == Route::Forward {
                // The kept batch ended.
                self.retry.forget();
            }
            let body = &server.rbuf[5..len];
            match tag {
                be::READY_FOR_QUERY => {
                    server.status = body.first().copied().unwrap_or(b'I');
                    if server.status != b'T' {
                        self.read_only_transaction = None;
                    }
                    if route == Route::Forward {
                        self.stats.query_count += 1;
                    }
                    if let Some(stmts) = self.stmts.as_mut() {
                        stmts
                            .schema
                            .ready(server.status == b'I' && self.replies.is_idle());
                    }
                }
                be::PARAMETER_STATUS => {
                    if let Some((name, value)) = be::parse_parameter_status(body) {
                        server.reported.set(name, value);
                        if route == Route::Forward
                            && self.reported.get(name) != Some(value)
                            && Arc::make_mut(&mut self.reported).set(name, value)
                        {
                            self.params_version += 1;
                            if name == "application_name" {
                                *self.info.application_name.lock() = self.app.intern(value);
                            }
                            if let Some(stmts) = self.stmts.as_mut().filter(|_| {
                                crate::statements::registry::LITERAL_SETTINGS.contains(&name)
                            }) {
                                stmts.literals_changed(
                                    &self.app.registry,
                                    crate::statements::registry::literal_settings(&self.reported),
                                );
                            }
                        }
                    }
                }
                be::ERROR_RESPONSE => {
                    let fields = ErrorFields::parse(body).unwrap_or_default();
                    if fields.is_fatal() {
                        server.broken = true;
                        self.server_fatal |= route == Route::Forward;
                    }
                    if route == Route::Swallow && !retry {
                        tracing::warn!(pool = ?self.pool.key, code = %fields.code, "pgmemo's own query failed on the server: {}", fields.message);
                        // It may have been the parameter sync: check it again next time.
                        server.params_synced_for = None;
                    }
                }
                _ => {}
            }
            let mut error_code = None;
            // A 0A000 ErrorResponse, whole: the answer to a statement it made stale.
            let mut stale_error = None;
            if self.held_description
                && matches!(
                    tag,
                    be::DATA_ROW | be::COMMAND_COMPLETE | be::ERROR_RESPONSE | be::READY_FOR_QUERY
                )
            {
                // The RowDescription held back for an autoprepared query (see
                // `Action::AsSimpleQueryHeld`): out before its first row or its
                // CommandComplete; with an error, dropped for a query that writes, and for a
                // SELECT dropped if it runs again, out before the error if it cannot.
                self.held_description = false;
                if let Some(ap) = self.autoprepare.as_mut() {
                    let out = matches!(tag, be::DATA_ROW | be::COMMAND_COMPLETE)
                        || (tag == be::ERROR_RESPONSE && ap.rerun && route != Route::Swallow);
                    if out {
                        self.client.wbuf.extend_from_slice(&ap.held);
                    }
                    ap.held.clear();
                }
            } else if self.held_description
                && tag == be::NOTICE_RESPONSE
                && self.autoprepare.as_ref().is_some_and(|a| a.rerun)
            {
                // Notices of a SELECT come after its RowDescription, and go with it.
                route = Route::Hold;
            }
            match route {
                Route::Forward if tag == be::NOTIFICATION_RESPONSE => {
                    state::write_notification(
                        &mut self.client.wbuf,
                        &server.rbuf[..len],
                        server.info.backend_pid,
                        self.info.pid(),
                    );
                    self.stats.bytes_sent += len as u64;
                }
                Route::Forward => {
                    self.client.wbuf.extend_from_slice(&server.rbuf[..len]);
                    self.stats.bytes_sent += len as u64;
                }
                Route::Hold => {
                    if let Some(ap) = self.autoprepare.as_mut() {
                        ap.held.extend_from_slice(&server.rbuf[..len]);
                        self.held_description = true;
                    }
                }
                Route::Replace => {
                    let at = self.client.wbuf.len();
                    match self.replies.take_replacement() {
                        Some(ErrorRewrite::Rename { from, to }) => {
                            be::error_with_renamed(&mut self.client.wbuf, body, &from, &to)
                        }
                        Some(ErrorRewrite::Whole(bytes)) => {
                            self.client.wbuf.extend_from_slice(&bytes)
                        }
                        Some(ErrorRewrite::Hidden { name, refusal }) => {
                            let hidden = ErrorFields::parse(body).is_some_and(|f| {
                                f.code == "26000" && f.message == command::NOWHERE_MISSING
                            });
                            match refusal {
                                _ if !hidden => {
                                    self.client.wbuf.extend_from_slice(&server.rbuf[..len])
                                }
                                Some(refusal) => self.client.wbuf.extend_from_slice(&refusal),
                                None => be::error_with_renamed(
                                    &mut self.client.wbuf,
                                    body,
                                    command::NOWHERE.as_bytes(),
                                    &name,
                                ),
                            }
                        }
                        Some(ErrorRewrite::Message(message)) => {
                            replies::error_with_message(&mut self.client.wbuf, body, &message)
                        }
                        Some(ErrorRewrite::AsSimpleQuery) => match self.autoprepare.as_deref() {
                            Some(client) => crate::autoprepare::simple_error(
                                &mut self.client.wbuf,
                                body,
                                client,
                            ),
                            None => self.client.wbuf.extend_from_slice(&server.rbuf[..len]),
                        },
                        None => self.client.wbuf.extend_from_slice(&server.rbuf[..len]),
                    }
                    self.stats.bytes_sent += (self.client.wbuf.len() - at) as u64;
                }
                Route::Swallow => {}
            }
            if let Some(client) = self.cache.as_deref_mut().filter(|c| c.watching()) {
                // Nothing in flight and no transaction open: whatever was sent has ended.
                let idle = tag == be::READY_FOR_QUERY
                    && body.first() == Some(&b'I')
                    && self.replies.is_idle();
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
            if tag == be::ERROR_RESPONSE {
                error_code = ErrorFields::parse(body).map(|f| f.code);
                if error_code.as_deref() == Some("0A000") {
                    stale_error = Some(Bytes::copy_from_slice(&server.rbuf[..len]));
                }
            }
            if let Some(stmts) = self.stmts.as_mut().filter(|s| s.search_path.is_open()) {
                // A SET of search_path in a transaction that may now end.
                stmts
                    .search_path
                    .observe(tag, &server.rbuf[5..len], server.status);
            }
            server.rbuf.advance(len);
            if self.stmts.is_some() {
                self.settle(error_code.as_deref(), stale_error, retried);
                // Settled just now: only a local reply due next leaves anything to do.
                if self.replies.head_is_synthesized() {
                    self.answer_locally();
                }
            }
            if replay {
                // Planned again before whatever the client sent since.
                let mut input = self.retry.replay();
                input.extend_from_slice(&self.client.rbuf);
                self.client.rbuf = input;
                tracing::debug!(client = %self.info.addr, "batch sent again after 0A000");
            }
            let Some(s) = self.server.as_mut() else {
                return Ok(());
            };
            server = s;
        }
        self.release_if_done();
        Ok(())
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
    #[inline]
    pub(super) fn release_if_done(&mut self) {
        if self.work_done() && !self.state.keeps_server() {
            self.release_server();
        }
    }

    /// Transaction mode, and the client's work on its server is done: nothing in flight,
    /// nothing waiting to be planned, the server idle outside a transaction.
    #[inline]
    pub(super) fn work_done(&self) -> bool {
        self.mode == PoolMode::Transaction
            && !self.replan
            && self.replies.is_idle()
            && self
                .server
                .as_ref()
                .is_some_and(|s| s.status == b'I' && s.rbuf.is_empty())
    }

    /// Applies the bookkeeping of entries that ended: kept when their message ran, undone
    /// (newest first) when PostgreSQL discarded it.
    #[inline]
    pub(super) fn settle(
        &mut self,
        error_code: Option<&str>,
        stale_error: Option<Bytes>,
        retried: bool,
    ) {
        // Called after every server read and local answer, mostly with nothing to do: that is
        // checked here, before the large frame of the work itself (~550 instructions per
        // transaction for nothing, measured).
        if self.replies.has_outcomes()
            || self
                .stmts
                .as_ref()
                .is_some_and(|s| s.search_path.has_carry())
        {
            self.settle_outcomes(error_code, stale_error, retried);
        }
    }

    #[inline(never)]
    pub(super) fn settle_outcomes(
        &mut self,
        error_code: Option<&str>,
        mut stale_error: Option<Bytes>,
        retried: bool,
    ) {
        let Session {
            app,
            replies,
            stmts,
            server,
            settings,
            params_version,
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
                if let Some(message) = stale_error.take() {
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
                retried,
            );
        }
        if let Some(path) = stmts.search_path.take_carry() {
            *params_version += 1;
            planner::carry_search_path(
                &path,
                &mut stmts.search_path,
                settings,
                server.as_deref_mut(),
            );
        }
    }
}
