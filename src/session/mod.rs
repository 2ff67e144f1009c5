//! One client connection, from login to goodbye.
//!
//! After login a session relays messages between its client and, while it holds one, a server
//! connection. Client messages are framed in place and, one by one, appended to the server's
//! write buffer with an [`Expected`] entry in the reply queue; server messages are matched
//! against that queue and either forwarded to the client or swallowed (replies to queries pgmemo
//! sent itself). In transaction mode the server goes back to the pool the moment the queue is
//! empty and ReadyForQuery says the server is idle, so explicit transactions and pipelines stay
//! on one server and nothing else does.
//!
//! All I/O of a session happens in [`Session::poll_io`], one poll over both sockets: each side
//! is written before it is read, reading stops while the other side's write buffer is over
//! [`HIGH_WATER`] (backpressure instead of unbounded buffering), and a batch of client messages
//! becomes one write to the server.

mod caching;
pub mod login;
pub mod planner;
pub mod state;

use crate::app::{App, ClientInfo, ClientState, ServerCancel};
use crate::buffers;
use crate::params::{self, Vars};
use crate::pool::{CheckoutError, Pool, PoolMode};
use crate::protocol::backend::{self as be, sqlstate, ErrorFields, Severity};
use crate::protocol::{frame, frontend as fe, MAX_BACKEND_MESSAGE_SIZE};
use crate::query::{command, facts};
use crate::replies::{self, ErrorRewrite, Expected, ReplyQueue, Route, Synth};
use crate::server::{ServerConn, ServerError};
use crate::statements::ClientStatements;
use crate::stats::LocalStats;
use crate::stream::Stream;
use bytes::{Buf, Bytes, BytesMut};
use login::{Admitted, Startup};
use std::future::poll_fn;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use tokio::io::AsyncWriteExt;
use tokio_util::io::poll_read_buf;

/// Above this many unsent bytes for one side, pgmemo stops reading from the other side.
const HIGH_WATER: usize = 256 * 1024;

/// The client side of a session: its stream and buffers.
pub struct ClientConn {
    pub stream: Stream,
    pub rbuf: BytesMut,
    pub wbuf: BytesMut,
}

impl ClientConn {
    pub fn new(stream: Stream, rbuf: BytesMut) -> Self {
        // The write buffer grows on first use: an idle client should cost as little memory as
        // possible (thousands of them are normal behind a pooler).
        ClientConn {
            stream,
            rbuf,
            wbuf: BytesMut::new(),
        }
    }

    pub async fn flush(&mut self) -> io::Result<()> {
        if !self.wbuf.is_empty() {
            self.stream.write_all(&self.wbuf).await?;
            self.wbuf.clear();
        }
        self.stream.flush().await
    }

    /// Sends an error of the given severity now.
    pub async fn send_error(&mut self, severity: Severity, code: &str, message: &str) {
        be::error_response(&mut self.wbuf, severity, code, message);
        let _ = self.flush().await;
    }
}

/// A session that started: its client logged in to a database (not the admin console) and
/// was told its parameters; [`serve`] relays it to its end.
pub struct Started {
    info: Arc<ClientInfo>,
    session: Box<Session>,
}

/// Starts the session of a client that logged in to a database: registers the client, takes
/// a server for its parameters, tells it them. None when that failed (the client was told).
pub async fn start(app: Arc<App>, admitted: Box<Admitted>) -> Option<Started> {
    let info = app.register_client(
        admitted.peer,
        admitted.local,
        admitted.startup.conn.stream.is_tls(),
        &admitted.startup.user,
        &admitted.startup.database,
    );
    match Session::start(app.clone(), info.clone(), admitted).await {
        Some(session) => Some(Started { info, session }),
        None => {
            tracing::info!(client = %info.addr, "client login failed");
            app.unregister_client(&info);
            None
        }
    }
}

/// Relays a started session until its client goes. Not itself async: its future is the
/// relay's own, with no room kept for the arguments (see `footprint`).
pub fn serve(app: Arc<App>, started: Started) -> impl std::future::Future<Output = ()> + Send {
    serve_session(app, started.info, started.session)
}

/// Relays a logged-in client's session until it ends, or until it moves to another worker
/// to go on there.
async fn serve_session(app: Arc<App>, info: Arc<ClientInfo>, mut session: Box<Session>) {
    loop {
        // Matched by value, so that nothing of it is kept across the finish's await (the
        // task's future would keep room for it: see `footprint`).
        match session.relay().await {
            End::Move(worker) => match move_session(&app, &info, session, worker) {
                Some(unmoved) => session = unmoved,
                None => return,
            },
            End::Terminate | End::ClientGone => break,
            End::Shutdown => {
                tracing::debug!(client = %info.addr, "client closed for shutdown");
                break;
            }
            End::Protocol(why) | End::ServerGone(why) | End::NoServer(why) | End::Closed(why) => {
                tracing::info!(client = %info.addr, "client session ended: {why}");
                break;
            }
        }
    }
    Box::pin(session.finish()).await;
    app.unregister_client(&info);
}

/// Goes on with an idle session (no server, nothing owed) in a task of `worker`'s, its
/// client's socket registered with that worker's event loop; gives the session back when
/// there are no workers to move to.
#[cold]
#[inline(never)]
fn move_session(
    app: &Arc<App>,
    info: &Arc<ClientInfo>,
    mut session: Box<Session>,
    worker: u16,
) -> Option<Box<Session>> {
    let Some(loops) = app.workers.get().filter(|l| (worker as usize) < l.count()) else {
        return Some(session);
    };
    session
        .pool
        .stats
        .here()
        .client_moves
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let (app, info) = (app.clone(), info.clone());
    loops.spawn(
        worker,
        Box::pin(async move {
            if let Err(e) = session.client.stream.move_to_this_thread() {
                // Still served, at the price of a wake-up of the other thread for every read.
                tracing::debug!(error = %e, "a client connection stays on its worker");
            }
            serve_session(app, info, session).await
        }),
    );
    None
}

/// Why a session's relay loop ended.
#[derive(Debug)]
enum End {
    /// The client said Terminate.
    Terminate,
    /// The client closed its socket or its socket failed.
    ClientGone,
    /// The client broke the protocol; it has been told.
    Protocol(String),
    /// The server connection failed; the client has been told.
    ServerGone(String),
    /// No server could be had; the client has been told.
    NoServer(String),
    /// pgmemo closed a pinned client (`pinned_idle_timeout`, `max_pinned_fraction`); it has
    /// been told.
    Closed(String),
    Shutdown,
    /// Not an end: the session goes on on another worker (see
    /// [`Session::worker_to_move_to`]).
    Move(u16),
}

enum Event {
    ClientRead,
    ClientGone(Option<io::Error>),
    ServerRead,
    ServerGone(Option<io::Error>),
    /// pgmemo is shutting down: see [`Session::must_stop`].
    Stop,
    /// The cancel requests that kept the server from going back have been delivered (see
    /// [`Session::release_server`]).
    CancelsDelivered,
    /// A pinned client stayed idle past `pinned_idle_timeout` (see [`Session::pinned_idle`]).
    PinnedIdle,
}

struct Session {
    app: Arc<App>,
    info: Arc<ClientInfo>,
    pool: Arc<Pool>,
    mode: PoolMode,
    client: ClientConn,
    server: Option<Box<ServerConn>>,
    replies: ReplyQueue,
    /// The reported parameters as this client believes them to be (shared with other
    /// clients that have the same: see [`Pool::share_reported`]).
    reported: Arc<Vars>,
    /// Unreported settings from the client's startup packet.
    settings: Vars,
    max_message: usize,
    stats: LocalStats,
    /// Bumped whenever `reported` or `settings` change, so a server last made to match this
    /// version for this client needs no comparison at the next checkout.
    params_version: u64,
    /// A protocol violation found in the client's input while earlier messages were still
    /// being answered: like PostgreSQL, those get their replies first, then the FATAL.
    violation: Option<Box<str>>,
    /// The client's prepared statements, when the planner is on.
    stmts: Option<ClientStatements>,
    statement_limits: planner::Limits,
    /// Names a duplicate Parse left on the server, closed after the next Sync.
    cleanup: planner::Cleanup,
    /// The next client message waits for the server's replies to what is in flight (see
    /// [`planner::Plan::Wait`]): client input is not planned until a server message arrives.
    waiting: bool,
    /// A client message waits to be planned again (see `waiting`): the server stays held
    /// for it even if it becomes idle meanwhile.
    replan: bool,
    /// The message that waited has now been planned.
    replanned: bool,
    /// A Flush has been sent for the current wait.
    wait_flushed: bool,
    /// The client's write buffer holds only replies pgmemo gave itself (a ParseComplete).
    /// While the server still owes replies they wait for those: PostgreSQL sends a batch's
    /// replies together, at its Sync or Flush, and a separate early write would cost a system
    /// call and a wake-up of the client.
    local_replies_only: bool,
    /// The batch kept to be sent again after 0A000 on its first statement.
    retry: planner::Retry,
    /// The reading of the simple query at hand (lexed once, for the result cache and
    /// autoprepare), made at the first simple query one of them reads.
    reader: Option<Box<crate::query::Reader>>,
    /// Autoprepare's buffers and statements for this client, made at its first simple query.
    autoprepare: Option<Box<crate::autoprepare::ClientAutoprepare>>,
    /// How pgmemo may read the client's text under its settings, as of a `params_version`.
    readable: ReadableAt,
    /// An autoprepared query's RowDescription waits in `autoprepare.held`.
    held_description: bool,
    /// The result cache's state for this client, made at its first Query or Bind while the
    /// cache is on.
    cache: Option<Box<crate::cache::ClientCache>>,
    /// What the client changed in its server session (transaction mode): settings to carry,
    /// state that pins it to its server.
    state: state::StateWatch,
    /// The client sent a message of an unknown type while its server waited for COPY data:
    /// from there on its bytes go to the server as they are, which fails the COPY and ends
    /// the connection with PostgreSQL's own messages.
    copy_garbage: bool,
    /// Whether the client's open transaction block is READ ONLY and READ COMMITTED (the
    /// result cache may answer inside it), once asked; forgotten when the block ends.
    read_only_transaction: Option<bool>,
    /// The server sent a FATAL error (relayed): when it then closes, the client has been told
    /// why, as a direct connection would have been, and gets nothing more from pgmemo.
    server_fatal: bool,
    /// Counts the reads of the client's socket (with several workers), to ask now and then
    /// which worker its client sends from (see [`Session::worker_to_move_to`]).
    idle_reads: u8,
    /// The server would have gone back, but a cancel request aimed at the client's work on it
    /// is still being passed on: it goes back once that is delivered.
    kept_for_cancels: bool,
    /// Fires when a pinned client has been idle for `pinned_idle_timeout`: made at its first
    /// pin with a timeout, reset at the end of each of its transactions, polled only while it
    /// is pinned and idle.
    pinned_idle: Option<Pin<Box<tokio::time::Sleep>>>,
}

/// How pgmemo's readers of SQL text may read the client's text under its settings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Readable {
    /// standard_conforming_strings is on: off, backslashes escape in plain strings, which
    /// pgmemo's lexers do not read so (its queries are then neither cached nor autoprepared).
    standard_strings: bool,
    /// Autoprepare may read the text as the server does (`autoprepare::settings_allow`).
    autoprepare: bool,
}

/// [`Readable`], worked out for one `params_version`: `(version + 1) << 2 | autoprepare << 1
/// | standard_strings` in one word (0: never worked out), 8 bytes in every session where a
/// `(u64, bool, bool)` takes 16.
#[derive(Clone, Copy, Default)]
struct ReadableAt(u64);

impl ReadableAt {
    fn new(params_version: u64, r: Readable) -> ReadableAt {
        ReadableAt(
            params_version.wrapping_add(1) << 2
                | (r.autoprepare as u64) << 1
                | r.standard_strings as u64,
        )
    }

    /// The answer, if it was worked out for `params_version` (a count of settings changes,
    /// far below the 2^62 where two versions would share a word).
    fn at(self, params_version: u64) -> Option<Readable> {
        (self.0 >> 2 == params_version.wrapping_add(1) & (u64::MAX >> 2)).then_some(Readable {
            standard_strings: self.0 & 1 == 1,
            autoprepare: self.0 & 2 == 2,
        })
    }
}

impl Session {
    /// Finishes the login: finds the pool, settles the client's parameters, and sends the
    /// ParameterStatus / BackendKeyData / ReadyForQuery a PostgreSQL server would.
    ///
    /// Boxed: the session lives as long as its client, and a box of exactly its size costs
    /// less than the room a task's future would keep for it in every state.
    async fn start(
        app: Arc<App>,
        info: Arc<ClientInfo>,
        admitted: Box<Admitted>,
    ) -> Option<Box<Session>> {
        let Startup {
            mut conn,
            user,
            database,
            params: startup_params,
        } = admitted.startup;
        if app.is_disabled(&database) {
            // PostgreSQL's answer for a database that does not allow connections.
            conn.send_error(
                Severity::Fatal,
                sqlstate::OBJECT_NOT_IN_PREREQUISITE_STATE,
                &format!("database \"{database}\" is not currently accepting connections"),
            )
            .await;
            return None;
        }
        let Some(pool) = app.pool(&database, &user) else {
            conn.send_error(
                Severity::Fatal,
                sqlstate::INVALID_CATALOG_NAME,
                &format!("database \"{database}\" does not exist"),
            )
            .await;
            return None;
        };
        let mut session = Box::new(Session::new(app, info, pool, conn));
        if let Err(e) = session.settle_parameters(&startup_params).await {
            tracing::info!(error = %e, "client startup parameters refused");
            return None;
        }
        session.reported = session.pool.share_reported(session.reported.clone());
        session.track_statements();
        session.state.startup = session.settings.clone();
        if session.state.enabled && session.pool.setting_functions_unread() {
            // Boxed: once per pool now and then, and the task need not keep room for it.
            if let Err(e) = Box::pin(session.read_setting_functions_at_login()).await {
                tracing::info!(error = %e, "no server for the login");
                return None;
            }
        }
        session.state.setting_functions = session.pool.setting_functions().clone();
        for (k, v) in session.reported.iter() {
            be::parameter_status(&mut session.client.wbuf, k, v);
        }
        if let Some(name) = session.reported.get("application_name") {
            *session.info.application_name.lock() = session.app.intern(name);
        }
        if session.mode == PoolMode::Session {
            // The server it keeps for life, taken now: its process ID is the client's.
            if session.acquire_server().await.is_err() {
                session.finish().await;
                return None;
            }
            if let Some(server) = session.server.as_ref() {
                session.app.show_pid(&session.info, server.info.backend_pid);
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
        session.info.set_state(ClientState::Idle);
        if session.client.flush().await.is_err() {
            session.finish().await;
            return None;
        }
        Some(session)
    }

    /// A session for a client of `pool` whose login is done, holding no server yet.
    fn new(app: Arc<App>, info: Arc<ClientInfo>, pool: Arc<Pool>, client: ClientConn) -> Session {
        let cfg = app.config.load();
        let pool_settings = pool.settings();
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
            reported: Arc::default(),
            settings: Vars::new(),
            stats: LocalStats::default(),
            params_version: 0,
            violation: None,
            stmts: None,
            statement_limits: planner::Limits {
                // A client may well hold more statements than one server keeps (that is what
                // the per-server LRU is for); this bound only protects pgmemo's memory, so a
                // small server limit must not make it tiny.
                max_count: (cfg.general.max_prepared_statements as usize * 4)
                    .max(planner::MIN_CLIENT_STATEMENTS),
                max_bytes: 64 * 1024 * 1024,
            },
            cleanup: planner::Cleanup::default(),
            waiting: false,
            replan: false,
            replanned: false,
            wait_flushed: false,
            local_replies_only: false,
            retry: planner::Retry::default(),
            reader: None,
            autoprepare: None,
            readable: ReadableAt::default(),
            held_description: false,
            cache: None,
            copy_garbage: false,
            read_only_transaction: None,
            server_fatal: false,
            idle_reads: 0,
            kept_for_cancels: false,
            pinned_idle: None,
        }
    }

    /// Turns the statement planner on for this client when its pool has it, for the client's
    /// settings as settled at login.
    fn track_statements(&mut self) {
        let pool_settings = self.pool.settings();
        if pool_settings.prepared_statements {
            // Statements are shared only between clients for whom the same text means the same
            // thing: same database, same server role, same search_path, literals read alike.
            let context = self.app.registry.context(
                &pool_settings.target.database_id,
                &pool_settings.target.user,
                self.settings.get("search_path").unwrap_or(""),
                crate::statements::registry::literal_settings(&self.reported),
            );
            let schema = crate::statements::schema::SchemaWatch::new(
                self.app
                    .registry
                    .schema_epoch(&pool_settings.target.database_id),
            );
            self.stmts = Some(ClientStatements::new(context, schema));
        }
    }

    /// Works out the client's parameter values. Values never seen before are tried on a server
    /// once (an invalid one fails the login with PostgreSQL's own error, as a direct connection
    /// would) and remembered in the pool, normalized the way the server reports them.
    async fn settle_parameters(&mut self, startup: &[(String, String)]) -> Result<(), String> {
        let defaults = match self.pool.defaults() {
            Some(d) => d,
            None => {
                let mut server = self.login_checkout().await?;
                let d = server.reported.clone();
                // The pool's first login: the setting functions are read on the same server.
                if self.state.enabled && self.pool.setting_functions_unread() {
                    read_setting_functions(&self.pool, &mut server).await;
                }
                self.pool.checkin(server);
                d
            }
        };
        self.reported = Arc::new(defaults.clone());
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
            let reported = defaults.get(name).is_some();
            if reported && !params::is_carried(name) {
                continue; // server_version and the like cannot be set
            }
            if reported && defaults.get(name) == Some(value.as_str()) {
                continue;
            }
            match self.pool.normalized(name, value) {
                Some(n) if reported => {
                    Arc::make_mut(&mut self.reported).set(name, &n);
                }
                Some(_) => {
                    self.settings.set(name, value);
                }
                None => unknown.push((name, value)),
            }
        }
        if unknown.is_empty() {
            return Ok(());
        }
        let mut sql = String::new();
        for (name, value) in &unknown {
            params::push_set(&mut sql, name, value);
        }
        let shows: Vec<String> = unknown
            .iter()
            .map(|(n, _)| format!("current_setting({})", params::quote_literal(n)))
            .collect();
        sql.push_str(&format!("SELECT {}", shows.join(", ")));
        let mut server = self.login_checkout().await?;
        let result = server.internal_query(&sql).await;
        // Put the server back as it was, so pool state stays what pgmemo believes it is.
        let restore = unknown
            .iter()
            .map(|(n, _)| format!("RESET {};", params::quote_name(n)))
            .collect::<String>();
        let restored = server.internal_query(&restore).await.is_ok();
        if restored {
            self.pool.checkin(server);
        } else {
            server.broken = true;
            self.pool.checkin(server);
        }
        match result {
            Ok(rows) => {
                // The last row is the SELECT of current_setting()s; set_config() rows precede it.
                let row = rows.into_iter().last().unwrap_or_default();
                for (i, (name, value)) in unknown.iter().enumerate() {
                    let normalized = row.get(i).cloned().flatten().unwrap_or_default();
                    if !repeated(name) {
                        self.pool.remember_normalized(name, value, &normalized);
                    }
                    if defaults.get(name).is_some() {
                        Arc::make_mut(&mut self.reported).set(name, &normalized);
                    } else {
                        self.settings.set(name, value);
                    }
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

    async fn login_checkout(&mut self) -> Result<Box<ServerConn>, String> {
        match self.pool.checkout(Some(self.info.killed_flag())).await {
            Ok(s) => Ok(s),
            Err(e) => {
                let msg = e.to_string();
                self.report_checkout_error(e).await;
                Err(msg)
            }
        }
    }

    /// Tells the client why it got no server, the way PostgreSQL or PgBouncer would.
    async fn report_checkout_error(&mut self, e: CheckoutError) {
        match e {
            CheckoutError::Connect(ServerError::Server { raw, .. }) => {
                // PostgreSQL's own refusal (unknown database, bad password for pgmemo's
                // server login, too many connections): show it as is, as FATAL.
                be::error_with_severity(&mut self.client.wbuf, &raw, Severity::Fatal);
                let _ = self.client.flush().await;
            }
            CheckoutError::Connect(other) => {
                let msg = format!("pgmemo could not connect to server: {other}");
                self.client
                    .send_error(Severity::Fatal, sqlstate::CONNECTION_FAILURE, &msg)
                    .await;
            }
            CheckoutError::WaitTimeout(d) => {
                let msg = format!(
                    "query_wait_timeout: no server connection became free within {:.1}s",
                    d.as_secs_f64()
                );
                self.client
                    .send_error(Severity::Fatal, sqlstate::PROTOCOL_VIOLATION, &msg)
                    .await;
            }
            CheckoutError::Closed | CheckoutError::Stopped => {
                self.shutdown_client().await;
            }
        }
    }

    /// The relay loop; returns why it ended.
    async fn relay(&mut self) -> End {
        // Set before the flags are first read: a shutdown that begins later wakes the task.
        *self.info.stop_waker.lock() = Some(poll_fn(|cx| Poll::Ready(cx.waker().clone())).await);
        loop {
            if let Err(end) = self.handle_client_messages().await {
                return end;
            }
            self.note_running();
            // A message planned again after a wait may have been answered by pgmemo alone,
            // leaving the server idle with nothing more to come from it.
            if std::mem::take(&mut self.replanned) {
                self.release_if_done();
                if let Err(end) = self.checkpoint_state().await {
                    return end;
                }
            }
            // The sockets first: what is already there is handled before a shutdown.
            let event = poll_fn(|cx| match self.poll_io(cx) {
                Poll::Pending if self.must_stop() => Poll::Ready(Event::Stop),
                Poll::Pending if self.idle_too_long(cx) => Poll::Ready(Event::PinnedIdle),
                polled => polled,
            })
            .await;
            match event {
                Event::ClientRead => {
                    if let Some(worker) = self.worker_to_move_to() {
                        return End::Move(worker);
                    }
                }
                Event::ServerRead => {
                    if let Err(end) = self.handle_server_messages() {
                        return end;
                    }
                    if self.server_fatal {
                        // PostgreSQL ends a session after a FATAL: so does pgmemo once it has
                        // passed one on, rather than go on with another server (the client's
                        // COPY, transaction and statements were that server's).
                        return self.server_gone(None).await;
                    }
                    self.note_running();
                    if let Err(end) = self.checkpoint_state().await {
                        return end;
                    }
                    // A server waiting for COPY data reads the bad message itself (see
                    // `copy_garbage`): PostgreSQL's own answer.
                    if self.violation.is_some()
                        && self.replies.in_copy_in()
                        && self.hand_copy_garbage_over()
                    {
                        self.violation = None;
                    }
                    if self.violation.is_some()
                        && (self.replies.is_empty() || self.replies.in_copy_in())
                    {
                        let message = self.violation.take().map(String::from).unwrap_or_default();
                        return self.protocol_violation(message).await;
                    }
                    if self.server.is_none()
                        && self.app.is_shutting_down()
                        && self.client.rbuf.is_empty()
                    {
                        let _ = self.client.flush().await;
                        return self.shutdown_client().await;
                    }
                }
                Event::ClientGone(e) => {
                    if let Some(e) = e {
                        tracing::debug!(client = %self.info.addr, error = %e, "client connection failed");
                    }
                    return End::ClientGone;
                }
                Event::ServerGone(e) => return self.server_gone(e).await,
                Event::Stop => return self.shutdown_client().await,
                Event::CancelsDelivered => self.release_if_done(),
                Event::PinnedIdle => return self.close_pinned(pinned_idle_message()).await,
            }
        }
    }

    /// The worker this session should go on from, when it is not the current one: the one of
    /// the CPU its client sent this request from (`SO_INCOMING_CPU`), asked at every 64th read
    /// of the client's socket if the session is idle then (no server, nothing owed or unsent)
    /// and there are several workers. Placement at accept time goes by the CPU the client's
    /// thread connected from, which need not be where it runs later: when two client threads
    /// connected from one CPU, every client would otherwise stay on one worker while the other
    /// idles.
    #[inline]
    fn worker_to_move_to(&mut self) -> Option<u16> {
        let loops = self.app.workers.get()?;
        if loops.count() == 1 {
            return None;
        }
        self.idle_reads = self.idle_reads.wrapping_add(1);
        if !self.idle_reads.is_multiple_of(64)
            || self.server.is_some()
            || !self.replies.is_empty()
            || !self.client.wbuf.is_empty()
            || self.waiting
            || self.replanned
            || self.violation.is_some()
        {
            return None;
        }
        let worker = loops.worker_of(self.client.stream.tcp())?;
        (worker != crate::workers::current()).then_some(worker)
    }

    /// Answers a batch of Parse / Describe / Close, ended by a Sync or Flush, that needs no
    /// server, if the client's input starts with one (see [`crate::statements::idle_batch`]).
    fn answer_idle_batch(&mut self) -> bool {
        let Some(stmts) = self.stmts.as_mut() else {
            return false;
        };
        buffers::lend(&mut self.client.wbuf);
        let limits = (
            self.statement_limits.max_count,
            self.statement_limits.max_bytes,
            self.max_message,
        );
        let Some(taken) = crate::statements::idle_batch::answer(
            &self.client.rbuf,
            stmts,
            &self.app.registry,
            limits,
            &mut self.client.wbuf,
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

    /// A kill from the console (KILL_CLIENT, KILL) closes the client at once. A shutdown
    /// closes it only between transactions, never mid-work, unless shutdown_timeout has
    /// passed: then mid-transaction too (finish() rolls back or closes the server, as for a
    /// kill).
    #[inline]
    fn must_stop(&self) -> bool {
        self.info.is_killed()
            || self.app.is_cut_off()
            || (self.app.is_shutting_down()
                && self.replies.is_idle()
                && self.server.as_ref().is_none_or(|s| s.status == b'I'))
    }

    /// Whether a pinned client has sent nothing, outside a transaction, for
    /// `pinned_idle_timeout` (polls the timer only then: the task is woken when it fires).
    fn idle_too_long(&mut self, cx: &mut Context<'_>) -> bool {
        let idle = self.state.pins != 0 && self.work_done() && self.client.rbuf.is_empty();
        match self.pinned_idle.as_mut() {
            Some(timer) if idle => std::future::Future::poll(timer.as_mut(), cx).is_ready(),
            _ => false,
        }
    }

    /// (Re)starts a pinned client's idle time at the end of one of its transactions.
    fn start_pinned_idle(&mut self) {
        let timeout = self.pool.settings().pinned_idle_timeout;
        let deadline =
            tokio::time::Instant::now() + if timeout.is_zero() { NEVER } else { timeout };
        match self.pinned_idle.as_mut() {
            Some(timer) => timer.as_mut().reset(deadline),
            None if !timeout.is_zero() => {
                self.pinned_idle = Some(Box::pin(tokio::time::sleep_until(deadline)));
            }
            None => {}
        }
    }

    /// Counts the client's server among its pool's pinned ones as the client becomes pinned,
    /// or stops counting it; the pool's bound when it has that many pinned already
    /// (`max_pinned_fraction`).
    fn count_pinned(&mut self) -> Result<(), usize> {
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
    fn close_pinned(
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

    /// The server connection failed. Boxed, like the other ends of a session: the session's
    /// task need not keep room for them.
    fn server_gone(
        &mut self,
        e: Option<io::Error>,
    ) -> Pin<Box<dyn std::future::Future<Output = End> + Send + '_>> {
        Box::pin(async move {
            let detail = e
                .map(|e| e.to_string())
                .unwrap_or_else(|| "server closed the connection unexpectedly".into());
            if let Some(server) = self.server.as_mut() {
                server.broken = true;
            }
            // Whatever the server managed to send still reaches the client (often a FATAL
            // explaining why), then, unless that was a FATAL, the client is told the
            // connection is gone.
            let _ = self.handle_server_messages();
            if self.server_fatal {
                let _ = self.client.flush().await;
            } else {
                self.client
                    .send_error(
                        Severity::Fatal,
                        sqlstate::CONNECTION_FAILURE,
                        "server closed the connection unexpectedly",
                    )
                    .await;
            }
            End::ServerGone(detail)
        })
    }

    /// Boxed: once per client at most, and the session's task need not keep room for it.
    fn shutdown_client(&mut self) -> Pin<Box<dyn std::future::Future<Output = End> + Send + '_>> {
        Box::pin(async move {
            self.client
                .send_error(
                    Severity::Fatal,
                    sqlstate::ADMIN_SHUTDOWN,
                    "terminating connection due to administrator command",
                )
                .await;
            End::Shutdown
        })
    }

    /// Plans every complete client message in the read buffer: answered locally, or queued
    /// for the server (taking one first when the session holds none).
    async fn handle_client_messages(&mut self) -> Result<(), End> {
        loop {
            if self.violation.is_some() {
                return Ok(()); // nothing after a violation is read
            }
            if self
                .server
                .as_ref()
                .is_some_and(|s| s.wbuf.len() >= HIGH_WATER)
            {
                return Ok(()); // backpressure: let the server drain first
            }
            if self.info.cancels.pending() {
                // A cancel request aimed at the client's work is being passed on: nothing new
                // goes to its server (it could cancel that instead), pgmemo's own queries
                // neither, until it is delivered.
                return Ok(());
            }
            // Like PostgreSQL, judge the type byte first (as soon as it is there), then the
            // length against the limit for that type.
            let Some(&tag) = self.client.rbuf.first() else {
                return Ok(());
            };
            if (self.copy_garbage || (!fe::is_known(tag) && self.replies.in_copy_in()))
                && self.hand_copy_garbage_over()
            {
                return Ok(());
            }
            if !fe::is_known(tag) {
                return self
                    .violated(format!("invalid frontend message type {tag}"))
                    .await;
            }
            let max = fe::max_message_len(tag, self.max_message);
            let (tag, len) = match frame(&self.client.rbuf, max) {
                Ok(Some(f)) => f,
                Ok(None) => return Ok(()),
                Err(e) => return self.violated(e.to_string()).await,
            };
            // A simple query's text, found once (its end is a search for the terminator) for
            // the result cache, the word scan, the session-state watch and the planner.
            let query_text_len = if tag == fe::QUERY {
                fe::query_text(&self.client.rbuf[5..len]).map(<[u8]>::len)
            } else {
                None
            };
            fn text_of(rbuf: &[u8], len: Option<usize>) -> Option<&[u8]> {
                len.map(|n| &rbuf[5..5 + n])
            }
            if let Some(reader) = self.reader.as_deref_mut() {
                reader.forget(); // a reading is of one message only
            }
            if matches!(tag, fe::QUERY | fe::PARSE | fe::BIND) && self.caching() {
                if let Some(c) = self.cache.as_deref_mut() {
                    c.forget_message();
                }
                let answered = match self.cache_client_message(tag, len, query_text_len) {
                    Ok(answered) => answered,
                    Err(slow) => slow.await?,
                };
                if answered {
                    continue; // answered from the result cache
                }
            }
            if self.server.is_none() {
                match tag {
                    fe::TERMINATE => return Err(End::Terminate),
                    // With no server held the session is idle: a lone Sync is answered as
                    // PostgreSQL would, a Flush has nothing to flush, and stray COPY messages
                    // are ignored as PostgreSQL ignores them outside COPY.
                    // A Sync or Flush with a body is malformed: PostgreSQL has to say so.
                    fe::SYNC if len == 5 => {
                        be::ready_for_query(&mut self.client.wbuf, b'I');
                        self.client.rbuf.advance(len);
                        continue;
                    }
                    fe::FLUSH if len == 5 => {
                        self.client.rbuf.advance(len);
                        continue;
                    }
                    fe::COPY_DATA | fe::COPY_DONE | fe::COPY_FAIL => {
                        self.client.rbuf.advance(len);
                        continue;
                    }
                    // Preparing, describing or closing known statements needs no server.
                    fe::PARSE | fe::CLOSE | fe::DESCRIBE if self.answer_idle_batch() => continue,
                    _ => self.acquire_server().await?,
                }
            } else if tag == fe::TERMINATE {
                if self.terminate_waits() {
                    // PostgreSQL answers what came before a Terminate before it reads it: the
                    // Terminate waits (unread: see `may_read_client`) until that is relayed.
                    return Ok(());
                }
                return Err(End::Terminate);
            } else if is_copy_message(tag) && !self.replies.takes_copy_message(tag) {
                // Ignored by PostgreSQL (no COPY IN, or one an error ended while the client was
                // still sending it): not sent, so the error's ReadyForQuery is the end of it.
                self.client.rbuf.advance(len);
                continue;
            } else if self.state.pins != 0 && self.work_done() {
                // A pinned client's next transaction starts on the server it kept: its time
                // counts from here (see `pinned_transaction_done`).
                if let Some(server) = self.server.as_mut() {
                    server.checked_out = Instant::now();
                }
            }
            let autoprepare = if tag == fe::QUERY {
                self.autoprepare_threshold()
            } else {
                None
            };
            if let Some(ap) = self.autoprepare.as_deref_mut() {
                ap.forget_reading(); // a reading is of one message only
            }
            // The words of a simple query that the planner and the session-state watch look
            // for: those of its autoprepare shape (found once per shape) and its string
            // literals, or else those of one pass over its text.
            let query_words = if self.state.enabled || self.stmts.is_some() {
                let text = text_of(&self.client.rbuf, query_text_len);
                let read = match (autoprepare, text) {
                    (Some(_), Some(text)) => self
                        .autoprepare
                        .get_or_insert_with(Default::default)
                        .read_ahead(
                            &self.app.autoprepare,
                            text,
                            self.reader.get_or_insert_with(Default::default),
                        ),
                    _ => None,
                };
                read.or_else(|| text.map(crate::query::words::in_query))
                    .unwrap_or(0)
            } else {
                0
            };
            if self.state.enabled {
                self.note_state(tag, len, query_text_len, query_words);
            }
            if let Some(stmts) = self.stmts.as_mut().filter(|_| query_words != 0) {
                if let Some(text) = text_of(&self.client.rbuf, query_text_len) {
                    stmts
                        .schema
                        .note(crate::query::facts::ddl_found(query_words, text));
                }
            }
            let server = self.server.as_mut().expect("server acquired above");
            self.stats.bytes_received += len as u64;
            // Statement messages are planned (renamed, injected, answered locally), unless
            // PostgreSQL is discarding everything until the next Sync anyway. The Sync itself
            // always is: the planner may have cleanup to send after it. COPY data is no
            // statement (and nothing may be injected into it: see `Planner::prepare_guard`).
            let skipping = (self.replies.is_skipping() && tag != fe::SYNC) || is_copy_message(tag);
            if let Some(stmts) = self.stmts.as_mut().filter(|_| !skipping) {
                let planned = planner::Planner {
                    msg: &self.client.rbuf[..len],
                    query_text: text_of(&self.client.rbuf, query_text_len),
                    server,
                    stmts,
                    replies: &mut self.replies,
                    registry: &self.app.registry,
                    stats: &mut self.stats,
                    limits: self.statement_limits,
                    cleanup: &mut self.cleanup,
                    retry: &mut self.retry,
                    query_words,
                    state: &mut self.state,
                    autoprepare: autoprepare.map(|threshold| crate::autoprepare::Use {
                        global: &self.app.autoprepare,
                        client: self.autoprepare.get_or_insert_with(Default::default),
                        reader: self.reader.get_or_insert_with(Default::default),
                        threshold,
                    }),
                    reported: &self.reported,
                }
                .plan(tag);
                if planned != planner::Plan::Wait {
                    self.wait_flushed = false;
                    self.replanned |= std::mem::take(&mut self.replan);
                }
                match planned {
                    planner::Plan::Done => {
                        self.retry.consumed(&self.client.rbuf[..len]);
                        self.client.rbuf.advance(len);
                        let pending_output = self.client.wbuf.len();
                        self.answer_locally();
                        if pending_output == 0 && !self.client.wbuf.is_empty() {
                            self.local_replies_only = true;
                        }
                        continue;
                    }
                    planner::Plan::Wait => {
                        // Planned again when the server has answered what is in flight,
                        // which a Flush makes it send.
                        self.stats.bytes_received -= len as u64;
                        if !self.wait_flushed {
                            crate::protocol::write_message(&mut server.wbuf, fe::FLUSH, |_| {});
                            self.wait_flushed = true;
                        }
                        self.waiting = true;
                        self.replan = true;
                        return Ok(());
                    }
                    planner::Plan::Forward => {}
                }
            }
            if let Some(expected) = Expected::for_client_message(tag) {
                self.replies.push(expected);
            }
            server.wbuf.extend_from_slice(&self.client.rbuf[..len]);
            self.retry.consumed(&self.client.rbuf[..len]);
            self.client.rbuf.advance(len);
        }
    }

    /// A message of an unknown type while the server waits for COPY data: PostgreSQL reads
    /// it itself, fails the COPY ("unexpected message type during COPY from stdin") and then,
    /// out of step with the client, ends the connection (FATAL 08P01); its replies reach the
    /// client as they are. Everything the client sent from there on goes to the server as it
    /// is. False when no server is held.
    fn hand_copy_garbage_over(&mut self) -> bool {
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
    fn violated(
        &mut self,
        message: String,
    ) -> Pin<Box<dyn std::future::Future<Output = Result<(), End>> + Send + '_>> {
        Box::pin(async move {
            if self.replies.is_empty() {
                return Err(self.protocol_violation(message).await);
            }
            self.violation = Some(message.into_boxed_str());
            Ok(())
        })
    }

    /// Boxed: rare, and the session's task need not keep room for the message and its
    /// sending.
    fn protocol_violation(
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
    fn autoprepare_threshold(&mut self) -> Option<u64> {
        let threshold = self.pool.autoprepare_threshold()?;
        self.stmts.as_ref()?; // autoprepare runs through the statement planner
        if !self.readable().autoprepare {
            self.stats.autoprepare_passed += 1;
            self.app
                .autoprepare
                .count_pass(crate::autoprepare::Pass::Settings);
            return None;
        }
        Some(threshold)
    }

    /// Takes a server from the pool and makes its session parameters match this client's.
    async fn acquire_server(&mut self) -> Result<(), End> {
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
            None => match Box::pin(self.pool.checkout_waiting(Some(self.info.killed_flag()))).await
            {
                Ok(server) => self.use_server(server),
                Err(e) => Some(self.checkout_failed(e)),
            },
        };
        match failed {
            None => Ok(()),
            Some(failed) => Err(failed.await),
        }
    }

    /// Holds the server the pool gave, unless the client was killed meanwhile: then it goes
    /// back, and nothing of what the client asked for runs.
    fn use_server(
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
    fn checkout_failed(
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

    /// Makes `server` the one this session's work runs on, after queueing what brings it in
    /// line with the client: its parameters and its SQL-level prepared statements.
    fn hold(&mut self, mut server: Box<ServerConn>) {
        server
            .info
            .client_id
            .store(self.info.id, std::sync::atomic::Ordering::Relaxed);
        *self.info.server.lock() = Some(ServerCancel {
            addr: server.info.addr,
            pid: server.info.backend_pid,
            secret: server.backend_secret,
        });
        self.info
            .server_id
            .store(server.info.id, std::sync::atomic::Ordering::Relaxed);
        self.info.set_state(ClientState::Active);
        let params_key = Some((self.info.id, self.params_version));
        if server.params_synced_for != params_key {
            if let Some(sql) = params::sync_sql(
                &self.reported,
                &server.reported,
                &self.settings,
                &server.settings,
            ) {
                fe::query(&mut server.wbuf, &sql);
                self.replies.push(Expected::Internal);
                // Reported values are updated from the server's ParameterStatus replies;
                // unreported ones are only known by what was set.
                server.settings = self.settings.clone();
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
        if let Some(stmts) = self.stmts.as_ref() {
            server
                .prepared
                .set_limit(self.pool.max_prepared_statements());
            planner::sync_sql_statements(stmts, &mut server, &mut self.replies);
        }
        self.server = Some(server);
    }

    /// Routes every complete server message, then gives the server back if the client's work
    /// on it is done (transaction mode).
    fn handle_server_messages(&mut self) -> Result<(), End> {
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
    fn note_running(&self) {
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
    fn release_if_done(&mut self) {
        if self.work_done() && !self.state.keeps_server() {
            self.release_server();
        }
    }

    /// Transaction mode, and the client's work on its server is done: nothing in flight,
    /// nothing waiting to be planned, the server idle outside a transaction.
    #[inline]
    fn work_done(&self) -> bool {
        self.mode == PoolMode::Transaction
            && !self.replan
            && self.replies.is_idle()
            && self
                .server
                .as_ref()
                .is_some_and(|s| s.status == b'I' && s.rbuf.is_empty())
    }

    /// Takes the pins a probe found, for SHOW CLIENTS and the pool's counters too; a pin
    /// beyond the pool's `max_pinned_fraction` is an error (the bound).
    fn note_pins(&mut self, found: u8) -> Result<(), usize> {
        let new = self.state.set_pins(found);
        if let Some(stmts) = self.stmts.as_mut() {
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

    /// Reads what a simple query (its text `query_text_len` bytes long, its words
    /// `query_words`) or, without the statement planner, a Parse may do to the session's
    /// state (see [`state`]).
    fn note_state(&mut self, tag: u8, len: usize, query_text_len: Option<usize>, query_words: u32) {
        let standard = self.standard_strings();
        let body = &self.client.rbuf[5..len];
        let text = match tag {
            fe::QUERY => query_text_len.map(|n| &body[..n]),
            fe::PARSE if self.stmts.is_none() => fe::Parse::parse(body).map(|p| p.query),
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
    fn readable(&mut self) -> Readable {
        if let Some(readable) = self.readable.at(self.params_version) {
            return readable;
        }
        let readable = Readable {
            standard_strings: self.reported.is("standard_conforming_strings", "on"),
            autoprepare: crate::autoprepare::settings_allow(&self.reported),
        };
        self.readable = ReadableAt::new(self.params_version, readable);
        readable
    }

    /// After a transaction that may have changed the session's state: asks the server what it
    /// now holds, records the client's settings and pins, and gives the server back unless
    /// the client is pinned to it. A pinned client whose server holds other settings than it
    /// wants (a RESET of a startup setting) gets them at once.
    async fn checkpoint_state(&mut self) -> Result<(), End> {
        if !self.state.keeps_server() || !self.work_done() {
            return Ok(());
        }
        if self.state.touched {
            self.state.touched = false;
            // Boxed: rare, and the session's task need not keep room for a round trip.
            Box::pin(self.probe_touched_state()).await?;
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

    /// Reads the pool's [`state::SettingFunctions`] on a server taken for it at login.
    async fn read_setting_functions_at_login(&mut self) -> Result<(), String> {
        let mut server = self.login_checkout().await?;
        read_setting_functions(&self.pool, &mut server).await;
        self.pool.checkin(server);
        Ok(())
    }

    /// Asks the held server what the client's last statements left in its session.
    async fn probe_touched_state(&mut self) -> Result<(), End> {
        // The client's replies first: the probe is pgmemo's own round trip.
        if !self.client.wbuf.is_empty() && self.client.flush().await.is_err() {
            return Err(End::ClientGone);
        }
        // A cancel aimed at the client's last statement must not reach the probe instead.
        poll_fn(|cx| self.info.poll_cancels_delivered(cx)).await;
        let mut server = self.server.take().expect("work_done: a server is held");
        let pins = self.probe_state(&mut server).await;
        let counted = self.note_pins(if server.broken { 0 } else { pins });
        self.server = Some(server);
        if let Err(bound) = counted {
            // The statement that pinned has succeeded and the client has been told: its
            // session ends, as a backend's would, and the state goes with the server's reset.
            let message = format!(
                "max_pinned_fraction: {bound} of this pool's servers are pinned already and \
                 this session's {} would pin another; closing the connection",
                state::Pins::describe(self.state.pins)
            );
            let why = "max_pinned_fraction";
            return Err(self
                .close_pinned((sqlstate::CONFIGURATION_LIMIT_EXCEEDED, message, why))
                .await);
        }
        Ok(())
    }

    /// A pinned client's transaction ended on the server it keeps: counted (SHOW STATS, the
    /// server's statement counters) as [`Session::release_server`] counts one that gives its
    /// server back.
    fn pinned_transaction_done(&mut self) {
        // Nothing ran since the last count: a notification woke the session.
        if self.stats.query_count == 0 {
            return;
        }
        let Some(server) = self.server.as_mut() else {
            return;
        };
        let now = Instant::now();
        let held_us = now
            .saturating_duration_since(server.checked_out)
            .as_micros() as u64;
        self.stats.xact_count += 1;
        self.stats.xact_time_us += held_us;
        self.pool.stats.here().xact_duration.observe_us(held_us);
        server.checked_out = now;
        if self.stmts.is_some() {
            record_statement_stats(server, &self.stats);
        }
        self.pool.stats.add(&mut self.stats);
        self.start_pinned_idle();
    }

    /// Asks `server` (held by this client, idle) what its session holds ([`state::PROBE`]):
    /// records the client's settings and returns the pins found. Notifications that arrive
    /// meanwhile go to the client. A server whose state cannot be known is marked broken.
    async fn probe_state(&mut self, server: &mut ServerConn) -> u8 {
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
            state::write_notification(
                &mut self.client.wbuf,
                &msg,
                server.info.backend_pid,
                self.info.pid(),
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
        let (now, pins) = state::read_probe(&rows, &server.reported, login_user);
        let wanted = state::wanted(&now, &self.state.startup);
        server.settings = now;
        if wanted != self.settings {
            self.settings = wanted;
            self.params_version += 1;
        }
        // A client that keeps its server gets its settings there at once (a RESET of a
        // startup setting); others get them wherever they land next.
        if pins | (self.state.pins & state::Pins::LOAD) != 0 {
            if let Some(sql) = params::sync_sql(
                &self.reported,
                &server.reported,
                &self.settings,
                &server.settings,
            ) {
                if server.internal_query(&sql).await.is_err() {
                    server.broken = true;
                }
                server.settings = self.settings.clone();
            }
            server.params_synced_for = Some((self.info.id, self.params_version));
        }
        pins
    }

    /// Writes the replies pgmemo gives itself (ParseComplete, CloseComplete, ...) that have
    /// reached the head of the queue, i.e. whose turn it is in PostgreSQL's order.
    fn answer_locally(&mut self) {
        while let Some(synth) = self.replies.pop_synthesized() {
            match synth {
                Synth::ParseComplete => crate::protocol::write_message(
                    &mut self.client.wbuf,
                    be::PARSE_COMPLETE,
                    |_| {},
                ),
                Synth::CloseComplete => crate::protocol::write_message(
                    &mut self.client.wbuf,
                    be::CLOSE_COMPLETE,
                    |_| {},
                ),
                Synth::Replies(replies) => self.client.wbuf.extend_from_slice(&replies),
                Synth::Deallocate => {
                    let status = self.server.as_ref().map_or(b'I', |s| s.status);
                    be::command_complete(&mut self.client.wbuf, "DEALLOCATE");
                    be::ready_for_query(&mut self.client.wbuf, status);
                    self.stats.query_count += 1;
                }
            }
        }
        self.settle(None, None, false);
    }

    /// Applies the bookkeeping of entries that ended: kept when their message ran, undone
    /// (newest first) when PostgreSQL discarded it.
    #[inline]
    fn settle(&mut self, error_code: Option<&str>, stale_error: Option<Bytes>, retried: bool) {
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
    fn settle_outcomes(
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

    fn release_server(&mut self) {
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
        *self.info.server.lock() = None;
        self.info
            .server_id
            .store(0, std::sync::atomic::Ordering::Relaxed);
        self.info.set_state(ClientState::Idle);
        let now = Instant::now();
        let held_us = now
            .saturating_duration_since(server.checked_out)
            .as_micros() as u64;
        self.stats.xact_count += 1;
        self.stats.xact_time_us += held_us;
        self.pool.stats.here().xact_duration.observe_us(held_us);
        if self.stmts.is_some() {
            record_statement_stats(&server, &self.stats);
        }
        self.pool.stats.add(&mut self.stats);
        self.pool.checkin_at(server, now);
    }

    /// One poll over both connections: writes pending output, then reads whichever side may be
    /// read. Returns as soon as there is something to process.
    fn poll_io(&mut self, cx: &mut Context<'_>) -> Poll<Event> {
        if self.kept_for_cancels && !self.info.cancels.pending() {
            self.kept_for_cancels = false;
            return Poll::Ready(Event::CancelsDelivered);
        }
        if let Some(server) = self.server.as_mut() {
            if let Err(e) = poll_write_buf(&mut server.stream, &mut server.wbuf, cx) {
                return Poll::Ready(Event::ServerGone(Some(e)));
            }
        }
        let hold = self.local_replies_only && !self.replies.is_empty();
        if !hold {
            if let Err(e) = poll_write_buf(&mut self.client.stream, &mut self.client.wbuf, cx) {
                return Poll::Ready(Event::ClientGone(Some(e)));
            }
        }
        // Nothing in flight: the client's buffers go back to the free list until it sends
        // again (an idle client then costs no buffer memory). Not for TLS: its stream is always
        // "ready" (see Stream::poll_read_ready), so it would borrow them straight back.
        if self.replies.is_empty()
            && self.client.rbuf.is_empty()
            && self.client.wbuf.is_empty()
            && !self.client.stream.is_tls()
        {
            buffers::take_back(&mut self.client.rbuf);
            buffers::take_back(&mut self.client.wbuf);
        }
        // A message already buffered is handled before either socket is read.
        if self.may_read_client() && !matches!(frame(&self.client.rbuf, self.max_message), Ok(None))
        {
            return Poll::Ready(Event::ClientRead); // left unplanned by backpressure
        }
        // While replies are owed, the server is read first: its answer is what the client
        // waits for, and when it is there the client's socket need not be polled (each poll of
        // a socket that is not ready costs tokio a waker registration).
        let event = if self.replies.is_empty() {
            self.poll_client_read(cx)
                .or_else(|| self.poll_server_read(cx))
        } else {
            self.poll_server_read(cx)
                .or_else(|| self.poll_client_read(cx))
        };
        event.map_or(Poll::Pending, Poll::Ready)
    }

    /// Whether the client's messages may be read and planned now: not while the server has a
    /// backlog to drain, after a protocol violation (only the replies still owed are
    /// relayed), while a message waits to be planned again, while a cancel request aimed
    /// at the client's work is being passed on (the task is woken when it is delivered), or
    /// while a Terminate waits for the replies to what the client sent before it.
    fn may_read_client(&self) -> bool {
        let server_backlog = self.server.as_ref().map_or(0, |s| s.wbuf.len());
        server_backlog < HIGH_WATER
            && self.violation.is_none()
            && !self.waiting
            && !self.info.cancels.pending()
            && !(self.client.rbuf.first() == Some(&fe::TERMINATE) && self.terminate_waits())
    }

    /// Whether a Terminate waits for replies still owed: those of queries or of batches the
    /// client ended with a Sync, which PostgreSQL sends before it reads the Terminate. Not in
    /// a batch left open (PostgreSQL may hold its replies until a Sync that never comes) nor
    /// in a COPY IN.
    fn terminate_waits(&self) -> bool {
        !self.replies.is_empty() && !self.replies.in_batch() && !self.replies.in_copy_in()
    }

    /// Reads the client's socket if it may be read: an event, or None (nothing to read now).
    fn poll_client_read(&mut self, cx: &mut Context<'_>) -> Option<Event> {
        if !self.may_read_client() {
            return None;
        }
        // Without a buffer, wait for the socket to have bytes before borrowing one; the
        // replies to what it sends will need a write buffer too.
        let readable = self.client.rbuf.capacity() != 0
            || match self.client.stream.poll_read_ready(cx) {
                Poll::Ready(Ok(())) => true,
                Poll::Ready(Err(e)) => return Some(Event::ClientGone(Some(e))),
                Poll::Pending => false,
            };
        if !readable {
            return None;
        }
        buffers::lend(&mut self.client.rbuf);
        buffers::lend(&mut self.client.wbuf);
        reserve(&mut self.client.rbuf);
        match poll_read_buf(Pin::new(&mut self.client.stream), cx, &mut self.client.rbuf) {
            Poll::Ready(Ok(0)) => Some(Event::ClientGone(None)),
            Poll::Ready(Ok(_)) => Some(Event::ClientRead),
            Poll::Ready(Err(e)) => Some(Event::ClientGone(Some(e))),
            Poll::Pending => None,
        }
    }

    /// Reads the server's socket, if a server is held and the client's output has room.
    fn poll_server_read(&mut self, cx: &mut Context<'_>) -> Option<Event> {
        let server = self.server.as_mut()?;
        if self.client.wbuf.len() >= HIGH_WATER {
            return None;
        }
        if !matches!(frame(&server.rbuf, MAX_BACKEND_MESSAGE_SIZE), Ok(None)) {
            return Some(Event::ServerRead);
        }
        reserve(&mut server.rbuf);
        match poll_read_buf(Pin::new(&mut server.stream), cx, &mut server.rbuf) {
            Poll::Ready(Ok(0)) => Some(Event::ServerGone(None)),
            Poll::Ready(Ok(_)) => Some(Event::ServerRead),
            Poll::Ready(Err(e)) => Some(Event::ServerGone(Some(e))),
            Poll::Pending => None,
        }
    }

    /// After the relay: leaves the server, if one is still held, clean for the next client
    /// (rolled back and reset), or closes it when that cannot be done safely.
    async fn finish(&mut self) {
        self.cache_abandon();
        if self.stmts.take().is_some() {
            self.app.registry.note_released();
        }
        let pending_output = !self.client.wbuf.is_empty();
        if pending_output {
            let _ = tokio::time::timeout(Duration::from_secs(1), self.client.flush()).await;
        }
        if self.state.counted {
            self.state.counted = false;
            self.pool.unpin();
        }
        let Some(mut server) = self.server.take() else {
            return;
        };
        // A cancel request aimed at the client's last statement may still be on its way: the
        // server gets nothing more (a reset), and goes to nobody else, before it is delivered.
        self.info.cancels.done();
        poll_fn(|cx| self.info.poll_cancels_delivered(cx)).await;
        *self.info.server.lock() = None;
        record_statement_stats(&server, &self.stats);
        self.pool.stats.add(&mut self.stats);
        let settings = self.pool.settings();
        // A batch without its Sync holds an implicit transaction that PostgreSQL would roll
        // back when the client leaves; closing the server does exactly that.
        let idle_between_queries = !server.broken
            && self.replies.is_idle()
            && server.rbuf.is_empty()
            && server.wbuf.is_empty();
        if !idle_between_queries {
            // Work is still running on the server: cancel it and close the connection; a
            // half-read reply stream cannot be handed to anyone else.
            let (addr, pid, secret) = (
                server.info.addr,
                server.info.backend_pid,
                server.backend_secret,
            );
            self.pool.release_slot(&server);
            tokio::spawn(async move {
                let _ = crate::server::send_cancel(addr, pid, secret).await;
                server.terminate().await;
            });
            return;
        }
        let clean = async {
            if server.status != b'I' {
                server.internal_query("ROLLBACK").await?;
            }
            // A client that may have left per-backend state on its server (transaction mode:
            // pinned, or not probed since its last statements) gets it cleaned as DISCARD ALL
            // would, whatever server_reset_query says (it may be empty).
            let pinned = self.mode == PoolMode::Transaction && self.state.keeps_server();
            if self.mode == PoolMode::Session || settings.server_reset_query_always || pinned {
                let reset_query = if pinned {
                    "DISCARD ALL"
                } else {
                    settings.server_reset_query.as_str()
                };
                let keep_statements =
                    settings.prepared_statements && reset_query.eq_ignore_ascii_case("DISCARD ALL");
                if keep_statements {
                    // pgmemo's own statements are shared by every client: keep them, so a
                    // statement is parsed once per server rather than once per client.
                    server.internal_query(RESET_KEEPING_STATEMENTS).await?;
                } else if !reset_query.is_empty() {
                    server.internal_query(reset_query).await?;
                    // The reset may have dropped statements: forget them all.
                    server.prepared.clear();
                }
                // Clients' SQL-level statements are gone either way.
                server.prepared.sql.clear();
                server.settings.clear();
            }
            Ok::<_, ServerError>(())
        };
        match tokio::time::timeout(Duration::from_secs(5), clean).await {
            Ok(Ok(())) if server.status == b'I' => self.pool.checkin(server),
            _ => {
                server.broken = true;
                self.pool.checkin(server);
            }
        }
    }
}

/// No deadline: a timer for a pinned client while `pinned_idle_timeout` is 0.
const NEVER: Duration = Duration::from_secs(365 * 24 * 3600);

/// What a client pinned and idle past `pinned_idle_timeout` is told, in PgBouncer's words for
/// its `client_idle_timeout` (FATAL 08P01, the setting's name).
fn pinned_idle_message() -> (&'static str, String, &'static str) {
    let why = "pinned_idle_timeout";
    (sqlstate::PROTOCOL_VIOLATION, why.into(), why)
}

/// `DISCARD ALL` minus what would drop pgmemo's shared statements: everything a client can
/// leave behind (settings, cursors, LISTEN, advisory locks, temp tables, sequences state, its
/// own SQL-level prepared statements) is reset, but `pgmemo_s<n>` statements stay prepared.
const RESET_KEEPING_STATEMENTS: &str = "CLOSE ALL; SET SESSION AUTHORIZATION DEFAULT; RESET ALL; \
    UNLISTEN *; SELECT pg_advisory_unlock_all(); DISCARD PLANS; DISCARD TEMP; DISCARD SEQUENCES; \
    DO $pgmemo$ DECLARE s text; BEGIN FOR s IN SELECT name FROM pg_prepared_statements \
    WHERE name !~ '^pgmemo_s[0-9]+$' LOOP EXECUTE format('DEALLOCATE %I', s); END LOOP; END $pgmemo$";

/// Reads the database's functions that may set custom settings ([`facts::SETTING_FUNCTIONS_SQL`])
/// on `server` (idle, nobody's notifications to lose) into `pool`. A failure leaves what was
/// known; it is read again after its time.
async fn read_setting_functions(pool: &Pool, server: &mut ServerConn) {
    match server.internal_query(facts::SETTING_FUNCTIONS_SQL).await {
        Ok(rows) => pool.set_setting_functions(
            rows.into_iter()
                .filter_map(|row| row.into_iter().next().flatten())
                .map(String::into_boxed_str)
                .collect(),
        ),
        Err(e) => tracing::debug!(error = %e, "could not read the setting functions"),
    }
}

/// Adds a session's statement counters to the server it used (for SHOW SERVERS).
fn record_statement_stats(server: &ServerConn, stats: &LocalStats) {
    use std::sync::atomic::Ordering::Relaxed;
    let info = &server.info;
    info.prepared_statements
        .store(server.prepared.len() as u64, Relaxed);
    if stats.prepare_cache_hit | stats.prepare_cache_miss | stats.prepare_evictions != 0 {
        info.prepare_cache_hit
            .fetch_add(stats.prepare_cache_hit, Relaxed);
        info.prepare_cache_miss
            .fetch_add(stats.prepare_cache_miss, Relaxed);
        info.prepare_evictions
            .fetch_add(stats.prepare_evictions, Relaxed);
    }
}

/// CopyData, CopyDone and CopyFail: the client's side of a COPY FROM STDIN, never planned.
#[inline]
fn is_copy_message(tag: u8) -> bool {
    matches!(tag, fe::COPY_DATA | fe::COPY_DONE | fe::COPY_FAIL)
}

/// Makes room for the next read: small for a quiet client, larger once traffic is flowing
/// (BytesMut reuses the freed front of the buffer when it can, so steady state allocates
/// nothing).
fn reserve(buf: &mut BytesMut) {
    if buf.capacity() - buf.len() < 1024 {
        buf.reserve(8 * 1024);
    }
}

/// Writes as much of `buf` as the socket takes without blocking.
fn poll_write_buf(stream: &mut Stream, buf: &mut BytesMut, cx: &mut Context<'_>) -> io::Result<()> {
    use tokio::io::AsyncWrite;
    while !buf.is_empty() {
        match Pin::new(&mut *stream).poll_write(cx, buf) {
            Poll::Ready(Ok(0)) => return Err(io::ErrorKind::WriteZero.into()),
            Poll::Ready(Ok(n)) => buf.advance(n),
            Poll::Ready(Err(e)) => return Err(e),
            Poll::Pending => return Ok(()),
        }
    }
    if stream.is_tls() {
        if let Poll::Ready(Err(e)) = Pin::new(&mut *stream).poll_flush(cx) {
            return Err(e);
        }
    }
    Ok(())
}

/// A session driven by hand instead of by its relay loop, with nothing read from or written to
/// its sockets: for benches/hot_path.rs, which times the session's own code for a client's
/// batch and for the server's replies. Not part of pgmemo's API.
#[doc(hidden)]
pub struct BenchSession(Session);

impl BenchSession {
    /// A logged-in client of `pool` (`info` its entry in the app, `client` its connection) that
    /// holds `server`, with its statement planner on if the pool has it.
    pub fn new(
        app: Arc<App>,
        info: Arc<ClientInfo>,
        pool: Arc<Pool>,
        client: ClientConn,
        server: ServerConn,
    ) -> BenchSession {
        let mut session = Session::new(app, info, pool, client);
        session.reported = session.pool.share_reported(session.reported.clone());
        session.track_statements();
        session.hold(Box::new(server));
        BenchSession(session)
    }

    /// What the client sent, as read from its socket.
    pub fn client_input(&mut self) -> &mut BytesMut {
        &mut self.0.client.rbuf
    }

    /// What the session has for the client, not yet written to its socket.
    pub fn client_output(&mut self) -> &mut BytesMut {
        &mut self.0.client.wbuf
    }

    /// The server held (its `rbuf` is what it sent, its `wbuf` what it is to be sent).
    pub fn server(&mut self) -> &mut ServerConn {
        self.0
            .server
            .as_mut()
            .expect("a bench session holds its server")
    }

    /// The client's prepared statements, if the planner is on.
    pub fn statements(&self) -> Option<&ClientStatements> {
        self.0.stmts.as_ref()
    }

    /// Plans every complete message of the client's input, as the relay loop does when the
    /// client's socket was readable. Panics if that had to wait (for a server or for replies)
    /// or ended the session.
    pub fn client_messages(&mut self) {
        let planned = {
            let planning = std::pin::pin!(self.0.handle_client_messages());
            let mut cx = Context::from_waker(std::task::Waker::noop());
            std::future::Future::poll(planning, &mut cx)
        };
        match planned {
            Poll::Ready(Ok(())) => assert!(!self.0.waiting, "planning waits for replies"),
            Poll::Ready(Err(end)) => panic!("the session ended: {end:?}"),
            Poll::Pending => panic!("planning waits for a server"),
        }
    }

    /// Routes every complete message of the server's input, as the relay loop does when the
    /// server's socket was readable. Panics if that ended the session.
    pub fn server_messages(&mut self) {
        if let Err(end) = self.0.handle_server_messages() {
            panic!("the session ended: {end:?}");
        }
    }

    /// Drops the replies still expected (and their bookkeeping, unapplied), the batch kept
    /// for a retry, and the server's unsent output: the state after the server has answered a
    /// batch that needed no bookkeeping, without routing its answers.
    pub fn forget_replies(&mut self) {
        let session = &mut self.0;
        session.replies.clear();
        session.replies.drain_outcomes();
        session.retry.forget();
        if let Some(server) = session.server.as_mut() {
            server.wbuf.clear();
        }
    }
}

#[cfg(test)]
mod readable_at {
    use super::{Readable, ReadableAt};

    #[test]
    fn an_answer_holds_for_its_settings_version_only() {
        assert_eq!(ReadableAt::default().at(0), None, "never worked out");
        for version in [0, 1, 41, u64::MAX >> 3] {
            for (standard_strings, autoprepare) in
                [(false, false), (false, true), (true, false), (true, true)]
            {
                let answer = Readable {
                    standard_strings,
                    autoprepare,
                };
                let known = ReadableAt::new(version, answer);
                assert_eq!(known.at(version), Some(answer));
                assert_eq!(known.at(version + 1), None);
                assert_eq!(known.at(version.wrapping_sub(1)), None);
            }
        }
    }
}

#[cfg(test)]
mod footprint {
    use super::*;
    use std::mem::size_of;

    /// The size of what `f` returns (a future, for an async fn).
    fn returned<A, B, F>(_: fn(A, B) -> F) -> usize {
        size_of::<F>()
    }

    /// An idle client is mostly these allocations (plus tokio's task cell and socket
    /// registration): each stays within an allocator size class (mimalloc's 224, 256 and 640
    /// bytes), so that the memory per idle client does not creep. A field that crosses a
    /// class costs every client the class step (32 to 128 bytes): put rare state behind a box.
    #[test]
    fn an_idle_clients_allocations_stay_in_their_size_classes() {
        assert!(
            size_of::<Session>() <= 640,
            "Session is {} bytes",
            size_of::<Session>()
        );
        let task = returned(crate::connection::serve_client);
        assert!(task <= 256, "the session's task future is {task} bytes");
        // An Arc's allocation: two counts and the value.
        let info = 16 + size_of::<crate::app::ClientInfo>();
        assert!(info <= 224, "ClientInfo's Arc is {info} bytes");
    }
}
