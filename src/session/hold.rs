//! Holding a server and giving it back: a server taken for the client's work, pins that keep it
//! (temporary objects, LISTEN, advisory locks, held cursors, unnamed settings) and the
//! pinned-idle timeout, the session-state probe after a transaction that may have changed the
//! server session, and the release to the pool.

use super::{planner, read_setting_functions, record_statement_stats, state, End, Session, NEVER};
use crate::app::ClientState;
use crate::clock::Moment;
use crate::params;
use crate::pool::Pool;
use crate::protocol::backend::{sqlstate, Severity};
use crate::protocol::{frame, frontend as fe, MAX_BACKEND_MESSAGE_SIZE};
use crate::replies::Expected;
use crate::server::ServerConn;
use crate::stats::LocalStats;
use bytes::BytesMut;
use std::future::poll_fn;
use std::pin::Pin;

impl Session {
    /// (Re)starts a pinned client's idle time at the end of one of its transactions.
    pub(super) fn start_pinned_idle(&mut self) {
        let timeout = self.pool.settings().pinned_idle_timeout;
        let deadline = std::time::Instant::now() + if timeout.is_zero() { NEVER } else { timeout };
        match self.state.pinned_idle.as_mut() {
            Some(timer) => timer.as_mut().reset(deadline),
            None if !timeout.is_zero() => {
                self.state.pinned_idle = Some(Box::pin(crate::timer::sleep_until(deadline)));
            }
            None => {}
        }
    }

    /// Counts the client's server among its pool's pinned ones as the client becomes pinned,
    /// or stops counting it; the pool's bound when it has that many pinned already
    /// (`max_pinned_fraction`).
    pub(super) fn count_pinned(&mut self) -> Result<(), usize> {
        let pinned = self.state.pins != 0;
        if pinned == self.state.counted {
            return Ok(());
        }
        if pinned {
            self.pool.pin()?;
        } else {
            self.pool.unpin();
        }
        self.state.counted = pinned;
        Ok(())
    }

    /// Closes a pinned client with FATAL `message` (its server is cleaned by
    /// [`Session::finish`], which discards the state that pinned it). Boxed: once per client.
    pub(super) fn close_pinned(
        &mut self,
        (code, message, why): (&'static str, String, &'static str),
    ) -> Pin<Box<dyn std::future::Future<Output = End> + Send + '_>> {
        Box::pin(async move {
            self.client
                .send_error(Severity::Fatal, code, &message)
                .await;
            End::Closed(why.into())
        })
    }

    /// Makes `server` the one this session's work runs on, after queueing what brings it in
    /// line with the client: its parameters and its SQL-level prepared statements.
    pub(super) fn hold(&mut self, mut server: Box<ServerConn>) {
        self.info.hold(&server);
        let params_key = Some((self.info.id, self.params.version));
        if server.params_synced_for != params_key {
            // Last made to match another client: usually one whose parameters are the same
            // (the same shared copy of the reported ones, known to match without comparing)
            // and that set nothing; else the differences are sent.
            let same = server.reports_as(&self.params.reported)
                && ((self.params.settings.is_empty() && server.settings.is_empty())
                    || self.params.settings == server.settings);
            let sql = (!same)
                .then(|| {
                    params::sync_sql(
                        &self.params.reported,
                        server.reported(),
                        &self.params.settings,
                        &server.settings,
                    )
                })
                .flatten();
            if let Some(sql) = sql {
                fe::query(&mut server.wbuf, &sql);
                self.replies.push(Expected::Internal);
                // Reported values are updated from the server's ParameterStatus replies;
                // unreported ones are only known by what was set.
                server.settings = self.params.settings.clone();
            }
            server.params_synced_for = params_key;
        }
        if self.state.enabled {
            let known = self
                .state
                .setting_functions
                .as_ref()
                .map_or(0, |f| f.generation);
            if self.pool.setting_functions_generation() != known {
                self.state.setting_functions = self.pool.setting_functions().clone();
            }
        }
        if let Some(stmts) = self.plan.stmts.as_ref() {
            server
                .prepared
                .set_limit(self.pool.max_prepared_statements());
            planner::sync_sql_statements(stmts, &mut server, &mut self.replies);
        }
        self.begin_kept_block(&mut server);
        self.server = Some(server);
    }

    /// Takes the pins a probe found, for SHOW CLIENTS and the pool's counters too; a pin
    /// beyond the pool's `max_pinned_fraction` is an error (the bound).
    pub(super) fn note_pins(&mut self, found: u8) -> Result<(), usize> {
        let new = self.state.set_pins(found);
        if let Some(stmts) = self.plan.stmts.as_mut() {
            stmts.schema.temp_found(found & state::Pins::TEMP != 0);
        }
        if let Some(cache) = self.cache.as_deref_mut() {
            // What the server holds, whatever the texts suggested.
            cache.temp = found & state::Pins::TEMP != 0;
        }
        // Counted before it shows in SHOW CLIENTS: whoever sees the pin sees it counted.
        self.pool.stats.count_pins(new);
        self.info
            .pins
            .store(self.state.pins, std::sync::atomic::Ordering::Relaxed);
        self.count_pinned()
    }

    /// Whether [`Session::checkpoint_state`] has anything to do: tested before its future is
    /// made (most transactions touch no session state).
    #[inline]
    pub(super) fn checkpoint_due(&self) -> bool {
        (self.state.keeps_server() || self.commit_position_due()) && self.work_done()
    }

    /// After a transaction that may have changed the session's state: asks the server what it
    /// now holds, records the client's settings and pins, and gives the server back unless
    /// the client is pinned to it. A pinned client whose server holds other settings than it
    /// wants (a RESET of a startup setting) gets them at once.
    /// Called when [`Session::checkpoint_due`].
    pub(super) async fn checkpoint_state(&mut self) -> Result<(), End> {
        if !self.checkpoint_due() {
            return Ok(());
        }
        // With replicas, whether the client asked for its floor as a ParameterStatus is what
        // the probe shows (its work may have SET, RESET or `set_config`'d
        // `pgmemo.report_read_lsn`): work that touched the session's state is probed first,
        // the client's ReadyForQuery held meanwhile (see `holds_replies_for_position`), and
        // its floor reported after.
        let probe_first = self.state.touched && self.reads.is_some();
        if probe_first {
            Box::pin(self.probe_touched_state(false)).await?;
        }
        if self.commit_position_due() {
            Box::pin(self.learn_commit_position()).await?;
        } else if probe_first {
            self.report_read_lsn();
        }
        if self.state.touched {
            // Boxed: rare, and the session's task need not keep room for a round trip.
            Box::pin(self.probe_touched_state(true)).await?;
        }
        if self.state.pins == 0 {
            if self.pool.setting_functions_due() {
                if let Some(mut server) = self.server.take() {
                    Box::pin(read_setting_functions(&self.pool, &mut server)).await;
                    self.server = Some(server);
                }
            }
            self.release_server();
        } else {
            self.pinned_transaction_done();
        }
        Ok(())
    }

    /// Asks the held server what the client's last statements left in its session; the
    /// client has its replies first (`replies_first`, the probe being pgmemo's own round
    /// trip) unless something the probe shows decides what goes ahead of them.
    pub(super) async fn probe_touched_state(&mut self, replies_first: bool) -> Result<(), End> {
        self.state.touched = false;
        if replies_first && !self.client.wbuf.is_empty() && self.client.flush().await.is_err() {
            return Err(End::ClientGone);
        }
        // A cancel aimed at the client's last statement must not reach the probe instead.
        poll_fn(|cx| self.info.poll_cancels_delivered(cx)).await;
        let mut server = self.server.take().expect("work_done: a server is held");
        let pins = self.probe_state(&mut server).await;
        let counted = self.note_pins(if server.broken { 0 } else { pins });
        self.server = Some(server);
        if counted.is_err() {
            // Pinned by what pgmemo could not foresee before it took a server (a simple
            // query that may pin waits for a slot first): the statement ran and the client
            // has its reply; the server holds its state either way. Counted over the bound
            // rather than closing a client that did nothing wrong.
            tracing::info!(client = %self.info.addr, pool = ?self.pool.key, "a pin over max_pinned_fraction: {}", state::Pins::describe(self.state.pins));
            self.pool.pin_over_bound();
            self.state.counted = true;
        }
        Ok(())
    }

    /// Counts the client's server among its pool's pinned ones before a statement that may
    /// pin it takes a server, waiting for a slot when `max_pinned_fraction` of the pool is
    /// pinned already, as a client waits for a server (PgBouncer's `query_wait_timeout` error
    /// if none is freed in time), and holding none meanwhile: the pool serves others. A
    /// pinned client that leaves frees its slot at once.
    pub(super) async fn wait_for_pin_slot(&mut self) -> Result<(), End> {
        let pool = self.pool.clone();
        let waited = pool.wait_to_pin(self.info.killed_flag()).await;
        match waited {
            Ok(()) => {
                self.state.counted = true;
                Ok(())
            }
            Err(e) => {
                let msg = e.to_string();
                tracing::warn!(client = %self.info.addr, pool = ?self.pool.key, "waiting for a pin slot: {msg}");
                self.report_checkout_error(e).await;
                Err(End::NoServer(msg))
            }
        }
    }

    /// A pinned client's transaction ended on the server it keeps: counted (SHOW STATS, the
    /// server's statement counters) as [`Session::release_server`] counts one that gives its
    /// server back.
    pub(super) fn pinned_transaction_done(&mut self) {
        // Nothing ran since the last count: a notification woke the session.
        if self.stats.query_count == 0 {
            return;
        }
        let Some(server) = self.server.as_mut() else {
            return;
        };
        server.checked_out = count_transaction(&mut self.stats, &self.pool, server);
        if self.plan.stmts.is_some() {
            record_statement_stats(server, &self.stats);
        }
        self.pool.stats.add(&mut self.stats);
        self.start_pinned_idle();
    }

    /// A session-mode client's transaction ended: counted (SHOW STATS, the server's statement
    /// counters) as PgBouncer counts it, when it ends, not when the client leaves. The next
    /// one's time starts with its first message (see `Session::server_for`).
    pub(super) fn session_transaction_counted(&mut self) {
        let Some(server) = self.server.as_mut() else {
            return;
        };
        count_transaction(&mut self.stats, &self.pool, server);
        if self.plan.stmts.is_some() {
            record_statement_stats(server, &self.stats);
        }
        self.pool.stats.add(&mut self.stats);
    }

    /// Asks `server` (held by this client, idle) what its session holds ([`state::PROBE`]):
    /// records the client's settings and returns the pins found. Notifications that arrive
    /// meanwhile go to the client. A server whose state cannot be known is marked broken.
    pub(super) async fn probe_state(&mut self, server: &mut ServerConn) -> u8 {
        self.pool
            .stats
            .here()
            .state_probes
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let mut notifications = BytesMut::new();
        // Custom settings pg_settings does not list: those the client's SQL named, and those
        // the server holds as far as pgmemo knows (a startup `-c app.tenant=...` of this
        // client or of one before it): what the probe answers becomes the server's record,
        // and a placeholder missing from it would never be reset for the next client.
        let mut custom = self.state.custom.as_deref().cloned().unwrap_or_default();
        for (name, _) in server.settings.iter().chain(self.state.startup.iter()) {
            if name.contains('.') && !custom.iter().any(|c| c.eq_ignore_ascii_case(name)) {
                custom.push(name.to_ascii_lowercase().into());
            }
        }
        let probed = server
            .internal_query_relaying(&state::probe_sql(&custom), Some(&mut notifications))
            .await;
        while let Ok(Some((_, len))) = frame(&notifications, MAX_BACKEND_MESSAGE_SIZE) {
            let msg = notifications.split_to(len);
            let app = &self.app;
            state::write_notification(
                &mut self.client.wbuf,
                &msg,
                server.info.backend_pid,
                self.info.pid(),
                |pid| app.notifier_pid(pid),
            );
        }
        let rows = match probed {
            Ok(rows) => rows,
            Err(e) => {
                // Nobody else may have this server, and the client's per-backend state goes
                // with it.
                tracing::warn!(client = %self.info.addr, error = %e, "session state probe failed; closing the server");
                server.broken = true;
                return 0;
            }
        };
        let login_user = &self.pool.settings().target.user;
        let (now, pins) = state::read_probe(&rows, server.reported(), login_user);
        let wanted = state::wanted(&now, &self.state.startup);
        server.settings = now;
        if wanted != self.params.settings {
            self.params.settings = wanted;
            self.params.version += 1;
        }
        // A client that keeps its server gets its settings there at once (a RESET of a
        // startup setting); others get them wherever they land next.
        if pins | (self.state.pins & state::Pins::LOAD) != 0 {
            if let Some(sql) = params::sync_sql(
                &self.params.reported,
                server.reported(),
                &self.params.settings,
                &server.settings,
            ) {
                if server.internal_query(&sql).await.is_err() {
                    server.broken = true;
                }
                server.settings = self.params.settings.clone();
            }
            server.params_synced_for = Some((self.info.id, self.params.version));
        }
        pins
    }

    pub(super) fn release_server(&mut self) {
        if self.server.is_none() {
            return;
        }
        if self.info.cancels.done() {
            // A cancel aimed at the work just done may still reach the server: nobody else
            // gets it before the request is delivered (`Event::CancelsDelivered`).
            self.kept_for_cancels = true;
            return;
        }
        let Some(server) = self.server.take() else {
            return;
        };
        if self.state.counted && self.state.pins == 0 {
            // A slot taken for a statement that may have pinned, and did not.
            let _ = self.count_pinned();
        }
        self.info.let_go();
        self.info.set_state(ClientState::Idle);
        let now = count_transaction(&mut self.stats, &self.pool, &server);
        if self.plan.stmts.is_some() {
            record_statement_stats(&server, &self.stats);
        }
        self.pool.stats.add(&mut self.stats);
        self.give_server_back(server, now);
    }
}

/// What a client pinned and idle past `pinned_idle_timeout` is told, in PgBouncer's words for
/// its `client_idle_timeout` (FATAL 08P01, the setting's name).
pub(super) fn pinned_idle_message() -> (&'static str, String, &'static str) {
    let why = "pinned_idle_timeout";
    (sqlstate::PROTOCOL_VIOLATION, why.into(), why)
}

/// Counts a transaction that ends now on `server` (SHOW STATS' xact counters and the
/// transaction-time histogram); returns now.
fn count_transaction(stats: &mut LocalStats, pool: &Pool, server: &ServerConn) -> Moment {
    let now = Moment::now();
    let held_us = now.micros_since(server.checked_out);
    stats.xact_count += 1;
    stats.xact_time_us += held_us;
    pool.stats.here().xact_duration.observe_us(held_us);
    now
}
