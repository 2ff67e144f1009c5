//! A session's start: the client's parameters settled on a first server, the statements and
//! state it will track, the setting functions read once per pool, and the client told what
//! PostgreSQL tells a client after its login.

use super::{
    login, planner, read_setting_functions, state, ClientConn, ClientParams, Planning, ReadableAt,
    Reading, Session,
};
use crate::app::{App, ClientInfo, ClientState};
use crate::params::{self, Vars};
use crate::pool::{CheckoutError, Pool, PoolMode};
use crate::protocol::backend::{self as be, sqlstate, Severity};
use crate::replies::ReplyQueue;
use crate::server::{ServerConn, ServerError};
use crate::statements::ClientStatements;
use crate::stats::{LocalStats, LoginFailure};
use login::{Admitted, Startup};
use std::sync::Arc;

impl Session {
    /// Finishes the login: finds the pool, settles the client's parameters, and sends the
    /// ParameterStatus / BackendKeyData / ReadyForQuery a PostgreSQL server would.
    ///
    /// Boxed: the session lives as long as its client, and a box of exactly its size costs
    /// less than the room a task's future would keep for it in every state.
    pub(super) async fn start(
        app: Arc<App>,
        info: Arc<ClientInfo>,
        admitted: Box<Admitted>,
    ) -> Option<Box<Session>> {
        let Startup {
            mut conn,
            user,
            database,
            params: startup_params,
            replication: _,
        } = admitted.startup;
        let pool = pool_of(&app, &mut conn, &database, &user).await?;
        let mut session = Box::new(Session::new(app, info, pool, conn));
        if let Err(e) = session.settle_parameters(&startup_params).await {
            tracing::info!(error = %e, "client startup parameters refused");
            session.app.errors.login_failed(LoginFailure::Server);
            return None;
        }
        session.params.reported = session.pool.share_reported(session.params.reported.clone());
        session.track_statements();
        session.state.startup = session.params.settings.clone();
        if session.state.enabled && session.pool.setting_functions_unread() {
            // Boxed: once per pool now and then, and the task need not keep room for it.
            if let Err(e) = Box::pin(session.read_setting_functions_at_login()).await {
                tracing::info!(error = %e, "no server for the login");
                session.app.errors.login_failed(LoginFailure::Server);
                return None;
            }
        }
        session.state.setting_functions = session.pool.setting_functions().clone();
        for (k, v) in session.params.reported.iter() {
            be::parameter_status(&mut session.client.wbuf, k, v);
        }
        if let Some(name) = session.params.reported.get("application_name") {
            *session.info.application_name.lock() = session.app.intern(name);
        }
        if session.mode == PoolMode::Session {
            // The server it keeps for life, taken now: its process ID is the client's.
            if session.acquire_server().await.is_err() {
                session.app.errors.login_failed(LoginFailure::Server);
                session.finish().await;
                return None;
            }
            if let Some(server) = session.server.as_ref() {
                session.app.show_pid(&session.info, server.info.backend_pid);
                // (Its notifications' process ID: the one it knows, see `App::notifier_pid`.)
                server.info.client_pid.store(
                    server.info.backend_pid,
                    std::sync::atomic::Ordering::Relaxed,
                );
            }
        }
        be::backend_key_data(
            &mut session.client.wbuf,
            session.info.pid(),
            session.info.secret,
        );
        be::ready_for_query(&mut session.client.wbuf, b'I');
        session
            .pool
            .stats
            .here()
            .client_logins
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        // A session-mode client is linked to its server for good: active, as PgBouncer shows
        // it (and as idle_transaction_timeout and client_idle_timeout read it).
        if session.mode != PoolMode::Session {
            session.info.set_state(ClientState::Idle);
        }
        if session.client.flush().await.is_err() {
            session.finish().await;
            return None;
        }
        Some(session)
    }

    /// A session for a client of `pool` whose login is done, holding no server yet.
    pub(super) fn new(
        app: Arc<App>,
        info: Arc<ClientInfo>,
        pool: Arc<Pool>,
        client: ClientConn,
    ) -> Session {
        let cfg = app.config.load();
        let pool_settings = pool.settings();
        let reads = (pool_settings.mode == PoolMode::Transaction)
            .then(|| app.replicas(&pool.key))
            .flatten()
            .map(crate::replicas::ClientReads::new);
        Session {
            mode: pool_settings.mode,
            state: state::StateWatch {
                enabled: pool_settings.mode == PoolMode::Transaction
                    && pool_settings.pin_session_state,
                ..Default::default()
            },
            max_message: cfg.general.max_message_size,
            app,
            info,
            pool,
            client,
            server: None,
            replies: ReplyQueue::new(),
            params: ClientParams {
                reported: Arc::default(),
                settings: Vars::new(),
                version: 0,
                readable: ReadableAt::default(),
            },
            stats: LocalStats::default(),
            violation: None,
            plan: Planning {
                stmts: None,
                limits: planner::Limits {
                    // A client may well hold more statements than one server keeps (that is
                    // what the per-server LRU is for); this bound only protects pgmemo's
                    // memory, so a small server limit must not make it tiny.
                    max_count: (cfg.general.max_prepared_statements as usize * 4)
                        .max(planner::MIN_CLIENT_STATEMENTS),
                    max_bytes: 64 * 1024 * 1024,
                },
                cleanup: planner::Cleanup::default(),
                waiting: false,
                replan: false,
                replanned: false,
                wait_flushed: false,
                retry: planner::Retry::default(),
                held_description: false,
            },
            local_replies_only: false,
            reading: Reading {
                reader: None,
                autoprepare: None,
            },
            cache: None,
            copy_garbage: false,
            server_fatal: false,
            idle_reads: 0,
            kept_for_cancels: false,
            client_read_armed: false,
            client_on_own_loop: true,
            reads,
            kept: None,
        }
    }

    /// Turns the statement planner on for this client when its pool has it, for the client's
    /// settings as settled at login.
    pub(super) fn track_statements(&mut self) {
        let pool_settings = self.pool.settings();
        if pool_settings.prepared_statements {
            // Statements are shared only between clients for whom the same text means the same
            // thing: same database, same server role, same search_path, literals read alike.
            let context = self.app.registry.context(
                &pool_settings.target.database_id,
                &pool_settings.target.user,
                self.params.settings.get("search_path").unwrap_or(""),
                crate::statements::registry::literal_settings(&self.params.reported),
            );
            let schema = crate::statements::schema::SchemaWatch::new(
                self.app
                    .registry
                    .schema_epoch(&pool_settings.target.database_id),
            );
            self.plan.stmts = Some(ClientStatements::new(context, schema));
        }
    }

    /// Works out the client's parameter values. Values never seen before are tried on a server
    /// once (an invalid one fails the login with PostgreSQL's own error, as a direct connection
    /// would) and remembered in the pool, normalized the way the server reports them.
    pub(super) async fn settle_parameters(
        &mut self,
        startup: &[(String, String)],
    ) -> Result<(), String> {
        let defaults = match self.pool.defaults() {
            Some(d) => d,
            None => {
                let mut server = self.login_checkout().await?;
                let d = server.reported().clone();
                // The pool's first login: the setting functions are read on the same server.
                if self.state.enabled && self.pool.setting_functions_unread() {
                    read_setting_functions(&self.pool, &mut server).await;
                }
                self.pool.checkin(server);
                d
            }
        };
        self.params.reported = Arc::new(defaults.clone());
        // A setting given twice (in `options` and as a parameter) ends as the server makes of
        // the sequence, which for DateStyle combines both values: such settings are always
        // tried on a server, and their values are not remembered one by one.
        let repeated = |name: &str| {
            startup
                .iter()
                .filter(|(n, _)| n.eq_ignore_ascii_case(name))
                .count()
                > 1
        };
        let mut unknown: Vec<(&str, &str)> = Vec::new();
        for (name, value) in startup {
            if repeated(name) {
                unknown.push((name, value));
                continue;
            }
            let reported = defaults.get(name).is_some() && !params::is_kept_as_setting(name);
            if reported && !params::is_carried(name) {
                continue; // server_version and the like cannot be set
            }
            if reported && defaults.get(name) == Some(value.as_str()) {
                continue;
            }
            match self.pool.normalized(name, value) {
                Some(n) => self.record_startup_value(&defaults, name, value, &n),
                None => unknown.push((name, value)),
            }
        }
        if unknown.is_empty() {
            return Ok(());
        }
        // Tried for this transaction only (`set_config(..., true)` in one multi-statement
        // query, which is one implicit transaction): whatever the server held before, another
        // client's SET included, is what it holds after, so its record stays true. A RESET
        // afterwards would have put the server's defaults where pgmemo's record still said
        // the other client's value, and the next client wanting that value would run without
        // it.
        let mut sql = String::new();
        for (name, value) in &unknown {
            params::push_set_local(&mut sql, name, value);
        }
        let shows: Vec<String> = unknown
            .iter()
            .map(|(n, _)| format!("pg_catalog.current_setting({})", params::quote_literal(n)))
            .collect();
        sql.push_str(&format!("SELECT {}", shows.join(", ")));
        let mut server = self.login_checkout().await?;
        let result = server.internal_query(&sql).await;
        self.pool.checkin(server);
        match result {
            Ok(rows) => {
                // The last row is the SELECT of current_setting()s; set_config() rows precede it.
                let row = rows.into_iter().last().unwrap_or_default();
                for (i, (name, value)) in unknown.iter().enumerate() {
                    let normalized = row.get(i).cloned().flatten().unwrap_or_default();
                    if !repeated(name) {
                        self.pool.remember_normalized(name, value, &normalized);
                    }
                    self.record_startup_value(&defaults, name, value, &normalized);
                }
                Ok(())
            }
            Err(ServerError::Server { raw, fields }) => {
                be::error_with_severity(&mut self.client.wbuf, &raw, Severity::Fatal);
                let _ = self.client.flush().await;
                Err(fields.message)
            }
            Err(e) => {
                let msg = format!("pgmemo: server failed during login: {e}");
                self.client
                    .send_error(Severity::Fatal, sqlstate::CONNECTION_FAILURE, &msg)
                    .await;
                Err(msg)
            }
        }
    }

    /// Records a startup parameter the server takes (`normalized`: as the server shows it): a
    /// reported parameter's value is what the client is told, an unreported one is one of the
    /// client's settings, and `search_path` is both where the server reports it (see
    /// [`params::is_kept_as_setting`]).
    fn record_startup_value(&mut self, defaults: &Vars, name: &str, value: &str, normalized: &str) {
        let reported = defaults.get(name).is_some();
        if reported {
            Arc::make_mut(&mut self.params.reported).set(name, normalized);
        }
        if !reported || params::is_kept_as_setting(name) {
            self.params.settings.set(name, value);
        }
    }

    /// A server for the login's own reads (the pool's defaults, parameters never seen before,
    /// the setting functions); the caller gives it back. A client that has to wait for it
    /// waits as PgBouncer's CL_WAITING_LOGIN does: counted in `cl_waiting`, its wait timed
    /// from its start (SHOW CLIENTS' `wait`, SHOW POOLS' `maxwait`) until the server comes.
    /// Told why when it gets none.
    pub(super) async fn login_checkout(&mut self) -> Result<Box<ServerConn>, String> {
        let checked_out = match self.pool.checkout_at_once() {
            Some(server) => Ok(server),
            None => {
                let state = self.info.state();
                self.info.set_state(ClientState::Waiting);
                let timed = self.info.start_wait(self.app.clock_us());
                // Boxed as `Pool::checkout` boxes it: the wait is rare, and long.
                let waited =
                    Box::pin(self.pool.checkout_waiting(Some(self.info.killed_flag()))).await;
                if timed {
                    self.info.end_wait();
                }
                self.info.set_state(state);
                waited
            }
        };
        match checked_out {
            Ok(s) => Ok(s),
            Err(e) => {
                let msg = e.to_string();
                self.report_checkout_error(e).await;
                Err(msg)
            }
        }
    }

    /// Tells the client why it got no server, the way PostgreSQL or PgBouncer would.
    pub(super) async fn report_checkout_error(&mut self, e: CheckoutError) {
        if !tell_no_server(&mut self.client, e).await {
            self.shutdown_client().await;
        }
    }

    /// Reads the pool's [`state::SettingFunctions`] on a server taken for it at login.
    pub(super) async fn read_setting_functions_at_login(&mut self) -> Result<(), String> {
        let mut server = self.login_checkout().await?;
        read_setting_functions(&self.pool, &mut server).await;
        self.pool.checkin(server);
        Ok(())
    }
}

/// Tells a client why it got no server, the way PostgreSQL or PgBouncer would; false for a
/// client stopped while it waited (killed, or pgmemo closing), whose caller says why.
pub(super) async fn tell_no_server(client: &mut ClientConn, e: CheckoutError) -> bool {
    match e {
        CheckoutError::Connect(ServerError::Server { raw, .. }) => {
            // PostgreSQL's own refusal (unknown database, bad password for pgmemo's server
            // login, too many connections): show it as is, as FATAL.
            be::error_with_severity(&mut client.wbuf, &raw, Severity::Fatal);
            let _ = client.flush().await;
        }
        CheckoutError::Connect(other) => {
            let msg = format!("pgmemo could not connect to server: {other}");
            client
                .send_error(Severity::Fatal, sqlstate::CONNECTION_FAILURE, &msg)
                .await;
        }
        CheckoutError::WaitTimeout(d) => {
            let msg = format!(
                "query_wait_timeout: no server connection became free within {:.1}s",
                d.as_secs_f64()
            );
            client
                .send_error(Severity::Fatal, sqlstate::PROTOCOL_VIOLATION, &msg)
                .await;
        }
        CheckoutError::Closed | CheckoutError::Stopped => return false,
    }
    true
}

/// The pool a client that logged in to `database` as `user` is served from; None when the
/// database is disabled or unknown (the client was told, as PostgreSQL tells it).
pub(super) async fn pool_of(
    app: &App,
    conn: &mut ClientConn,
    database: &str,
    user: &str,
) -> Option<Arc<Pool>> {
    if app.is_disabled(database) {
        app.errors.login_failed(LoginFailure::DatabaseDisabled);
        // PostgreSQL's answer for a database that does not allow connections.
        conn.send_error(
            Severity::Fatal,
            sqlstate::OBJECT_NOT_IN_PREREQUISITE_STATE,
            &format!("database \"{database}\" is not currently accepting connections"),
        )
        .await;
        return None;
    }
    let pool = app.pool(database, user);
    if pool.is_none() {
        app.errors.login_failed(LoginFailure::UnknownDatabase);
        conn.send_error(
            Severity::Fatal,
            sqlstate::INVALID_CATALOG_NAME,
            &format!("database \"{database}\" does not exist"),
        )
        .await;
    }
    pool
}
