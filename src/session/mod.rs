//! One client connection, from login to goodbye.
//!
//! After login a session relays messages between its client and, while it holds one, a server
//! connection. Client messages are framed in place and, one by one, appended to the server's
//! write buffer with an [`crate::replies::Expected`] entry in the reply queue; server messages are matched
//! against that queue and either forwarded to the client or swallowed (replies to queries pgmemo
//! sent itself). In transaction mode the server goes back to the pool the moment the queue is
//! empty and ReadyForQuery says the server is idle, so explicit transactions and pipelines stay
//! on one server and nothing else does.
//!
//! All I/O of a session happens in [`Session::poll_io`], one poll over both sockets: each side
//! is written before it is read, reading stops while the other side's write buffer is over
//! [`HIGH_WATER`] (backpressure instead of unbounded buffering), and a batch of client messages
//! becomes one write to the server.
//!
//! The session in files, in the order a client meets them:
//! - [`login`]: the startup packet, TLS, authentication, the limits on clients;
//! - `start.rs`: the client's parameters settled on a first server, what it will track;
//! - this file: [`Session`], the relay loop and its one poll over both sockets, the finish;
//! - `inbound.rs`: the client's messages, one by one, through each feature to the server;
//!   `lane.rs`: a portal message, or a reply to the client's own work, with nothing to do
//!   but relaying, past the stages of both;
//! - `outbound.rs`: the server's replies, matched to the reply queue, through each feature to
//!   the client, and the transaction settled;
//! - `hold.rs`: a server held and given back: pins, the state probe, the release;
//! - [`planner`] (statements renamed, injected, autoprepared, answered locally), `caching.rs`
//!   (the session's side of the result cache), [`state`] (the session state it carries);
//! - `replicas.rs`: which server a unit of work takes when the database has replicas, and
//!   the positions the client's reads must see;
//! - [`replication`]: a replication client, relayed byte for byte to a server of its own;
//! - `bench.rs`: [`BenchSession`], a session driven by hand for `benches/hot_path.rs`;
//!   `tests.rs`: the unit tests of its small parts and of an idle client's footprint.

mod bench;
pub use bench::BenchSession;
mod caching;
mod deferred;
mod handover;
pub use handover::{read_carried, resume, Carried};
mod hold;
mod inbound;
mod lane;
pub mod login;
mod outbound;
pub mod planner;
mod replicas;
pub mod replication;
mod start;
pub mod state;

use crate::app::{App, ClientInfo, KillReason};
use crate::buffers;
use crate::params::Vars;
use crate::pool::{Pool, PoolMode};
use crate::protocol::backend::{self as be, sqlstate, Severity};
use crate::protocol::{frame, frontend as fe, MAX_BACKEND_MESSAGE_SIZE};
use crate::query::facts;
use crate::replies::ReplyQueue;
use crate::server::{ServerConn, ServerError};
use crate::statements::ClientStatements;
use crate::stats::LocalStats;
use crate::stream::Stream;
use bytes::BytesMut;
use hold::pinned_idle_message;
use login::Admitted;
use std::future::poll_fn;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::io::AsyncWriteExt;
use tokio_util::io::poll_read_buf;

/// Above this many unsent bytes for one side, pgmemo stops reading from the other side.
const HIGH_WATER: usize = 256 * 1024;

/// How long a server left with work of a client gone is waited for, to bump what that work
/// may have written once it ended (see [`crate::cache::Unfinished`]); past it, bumped then.
const UNFINISHED_WAIT: Duration = Duration::from_secs(600);

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
        Some(session) => {
            if app.config.load().general.log_connections {
                let tls = if info.tls() { "yes" } else { "no" };
                tracing::info!(
                    client = %info.addr,
                    "login: db={} user={} tls={tls}",
                    info.database,
                    info.user
                );
            }
            Some(Started { info, session })
        }
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
            End::HandOver => {
                if hand_session_over(&app, &mut session) {
                    break;
                }
            }
            End::Terminate => {
                log_end(&app, &info, "client close request");
                break;
            }
            End::ClientGone => {
                log_end(&app, &info, "client unexpected eof");
                break;
            }
            End::Shutdown => {
                log_end(&app, &info, "pgmemo shutting down");
                break;
            }
            End::Protocol(why) | End::ServerGone(why) | End::NoServer(why) | End::Closed(why) => {
                tracing::info!(client = %info.addr, "client session ended: {why}");
                log_end(&app, &info, &why);
                break;
            }
        }
    }
    Box::pin(session.finish()).await;
    app.unregister_client(&info);
}

/// `log_disconnections`' line, as PgBouncer writes it: why, and the client's age.
#[cold]
fn log_end(app: &App, info: &ClientInfo, why: &str) {
    if !app.config.load().general.log_disconnections {
        return;
    }
    // The wall clock as SHOW CLIENTS reads it (connect_secs is on the same clock).
    let age = app
        .unix_secs(app.clock_us())
        .saturating_sub(info.connect_secs());
    tracing::info!(
        client = %info.addr,
        "closing because: {why} (age={age}s) db={} user={}",
        info.database,
        info.user
    );
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
            let moved = session.client.stream.move_to_this_thread();
            if let Err(e) = &moved {
                // Still served, at the price of a wake-up of the other thread for every read.
                tracing::debug!(error = %e, "a client connection stays on its worker");
            }
            session.client_on_own_loop = moved.is_ok();
            serve_session(app, info, session).await
        }),
    );
    None
}

/// Sends an idle session's client to the process taking over (an online restart): true when
/// it went, and the session ends here without a word to the client. False when the new
/// process is gone: the session goes on here.
#[cold]
#[inline(never)]
fn hand_session_over(app: &Arc<App>, session: &mut Session) -> bool {
    let client = session.info.addr;
    let unix = session.client.stream.is_unix();
    let Some(handoff) = session.hand_over() else {
        return false;
    };
    match app.handoff.send(handoff) {
        Ok(()) => {
            tracing::debug!(%client, "client handed over to the new process");
            true
        }
        Err(handoff) => {
            // The new process went away: the client stays, its socket back in the session.
            tracing::warn!(%client, "the new process is gone: the client stays here");
            match handover::open_socket(unix, handoff.socket) {
                Ok(stream) => {
                    session.client.stream = stream;
                    false
                }
                Err(e) => {
                    tracing::warn!(%client, error = %e, "cannot take a client's socket back");
                    true
                }
            }
        }
    }
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
    /// Not an end either: the session goes on in the process taking this one's clients over
    /// (an online restart, see [`handover`]).
    HandOver,
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
    /// The client's session parameters, as it believes them to be, and what follows from them.
    params: ClientParams,
    max_message: usize,
    stats: LocalStats,
    /// A protocol violation found in the client's input while earlier messages were still
    /// being answered: like PostgreSQL, those get their replies first, then the FATAL. (A
    /// box of a String, not a `Box<str>`: one word in every session for rare state.)
    #[allow(clippy::box_collection)]
    violation: Option<Box<String>>,
    /// What the statement planner keeps for the client between its messages.
    plan: Planning,
    /// The client's write buffer holds only replies pgmemo gave itself (a ParseComplete).
    /// While the server still owes replies they wait for those: PostgreSQL sends a batch's
    /// replies together, at its Sync or Flush, and a separate early write would cost a system
    /// call and a wake-up of the client.
    local_replies_only: bool,
    /// pgmemo's reading of the client's simple queries, and autoprepare's part.
    reading: Reading,
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
    /// The server sent a FATAL error (relayed): when it then closes, the client has been told
    /// why, as a direct connection would have been, and gets nothing more from pgmemo.
    server_fatal: bool,
    /// Counts the reads of the client's socket (with several workers), to ask now and then
    /// which worker its client sends from (see [`Session::worker_to_move_to`]).
    idle_reads: u8,
    /// The server would have gone back, but a cancel request aimed at the client's work on it
    /// is still being passed on: it goes back once that is delivered.
    kept_for_cancels: bool,
    /// The relay's last read poll of the client's socket found nothing: the session's waker
    /// is registered for it until the runtime sees it readable (see
    /// [`Session::poll_client_read`]). Only ever set by that poll, within one relay, and only
    /// while `client_on_own_loop`.
    client_read_armed: bool,
    /// The client's socket is watched by the event loop that runs this session, on its one
    /// thread: the runtime is single-threaded (pgmemo's own loops; not a multi-threaded
    /// runtime pgmemo is embedded in) and the socket was not left on another worker by a
    /// failed move. Only then does a waker registered with the socket stay until the socket
    /// is seen readable ([`Session::poll_client_read`]). Worked out at each relay's start.
    client_on_own_loop: bool,
    /// Where the client's reads may go and what they must see, when its pool has replicas
    /// (transaction mode).
    reads: Option<Box<crate::replicas::ClientReads>>,
    /// The client's `BEGIN`, answered here and held back until the block's first statement
    /// that needs a server (see `deferred`).
    kept: Option<Box<deferred::KeptBlock>>,
}

/// The client's session parameters, as it believes them to be, and what follows from them.
struct ClientParams {
    /// The reported parameters as this client believes them to be (shared with other
    /// clients that have the same: see [`Pool::share_reported`]).
    reported: Arc<Vars>,
    /// Unreported settings from the client's startup packet.
    settings: Vars,
    /// Bumped whenever `reported` or `settings` change, so a server last made to match this
    /// version for this client needs no comparison at the next checkout.
    version: u64,
    /// How pgmemo may read the client's text under its settings, as of a `version`.
    readable: ReadableAt,
}

/// What the statement planner keeps for the client between its messages.
struct Planning {
    /// The client's prepared statements, when the planner is on.
    stmts: Option<ClientStatements>,
    limits: planner::Limits,
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
    /// The batch kept to be sent again after 0A000 on its first statement.
    retry: planner::Retry,
    /// An autoprepared query's RowDescription waits in `autoprepare.held` (see
    /// `Action::AsSimpleQueryHeld`), or, with its error, for the query's plan check (see
    /// `Session::check_plan`).
    held_description: bool,
}

impl Planning {
    /// A client message was planned (or relayed), not made to wait: the Flush sent for a
    /// wait is spent, and a message that waited is planned now.
    #[inline]
    fn planned(&mut self) {
        self.wait_flushed = false;
        self.replanned |= std::mem::take(&mut self.replan);
    }
}

/// pgmemo's reading of the client's simple queries, and autoprepare's part.
struct Reading {
    /// The reading of the simple query at hand (lexed once, for the result cache and
    /// autoprepare), made at the first simple query one of them reads.
    reader: Option<Box<crate::query::Reader>>,
    /// Autoprepare's buffers and statements for this client, made at its first simple query.
    autoprepare: Option<Box<crate::autoprepare::ClientAutoprepare>>,
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
    /// The relay loop; returns why it ended.
    async fn relay(&mut self) -> End {
        // Set before the flags are first read: a shutdown that begins later wakes the task.
        *self.info.stop_waker.lock() = Some(poll_fn(|cx| Poll::Ready(cx.waker().clone())).await);
        // Whatever registered the socket's waker before (another task, another worker) is
        // not this relay's.
        self.client_read_armed = false;
        self.client_on_own_loop = self.client_on_own_loop && single_threaded_runtime();
        loop {
            // Nothing read from the client (most wakes are the server's): no future made.
            if !self.client.rbuf.is_empty() {
                if let Err(end) = self.handle_client_messages().await {
                    return end;
                }
                if self.reads.is_some() {
                    self.ask_position();
                }
            }
            self.note_running();
            // A message planned again after a wait may have been answered by pgmemo alone,
            // leaving the server idle with nothing more to come from it.
            if std::mem::take(&mut self.plan.replanned) {
                self.release_if_done();
                if self.checkpoint_due() {
                    if let Err(end) = self.checkpoint_state().await {
                        return end;
                    }
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
                    // A kill that came before these bytes wins over them (KILL_CLIENT has
                    // returned to the console by then): the console's word is final.
                    if self.info.is_killed() || self.app.is_cut_off() {
                        return self.stop().await;
                    }
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
                    if self.checkpoint_due() {
                        if let Err(end) = self.checkpoint_state().await {
                            return end;
                        }
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
                        let message = self.violation.take().map(|m| *m).unwrap_or_default();
                        return self.protocol_violation(message).await;
                    }
                    if self.server.is_none()
                        && self.client.rbuf.is_empty()
                        && (self.app.is_shutting_down()
                            || (self.app.is_handing_over() && self.can_hand_over()))
                    {
                        let _ = self.client.flush().await;
                        return self.stop().await;
                    }
                }
                Event::ClientGone(e) => {
                    if let Some(e) = e {
                        tracing::debug!(client = %self.info.addr, error = %e, "client connection failed");
                    }
                    if self.terminate_waiting() {
                        // It said goodbye first (see `poll_client_hangup`).
                        return End::Terminate;
                    }
                    return End::ClientGone;
                }
                Event::ServerGone(e) => return self.server_gone(e).await,
                Event::Stop => return self.stop().await,
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
            || self.plan.waiting
            || self.plan.replanned
            || self.violation.is_some()
        {
            return None;
        }
        let worker = loops.worker_of(self.client.stream.tcp()?)?;
        (worker != crate::workers::current()).then_some(worker)
    }

    /// A kill from the console (KILL_CLIENT, KILL) closes the client at once. A shutdown
    /// closes it only between transactions, never mid-work, unless shutdown_timeout has
    /// passed: then mid-transaction too (finish() rolls back or closes the server, as for a
    /// kill).
    ///
    /// During an online restart an idle session is not closed but handed over, once it can be
    /// ([`Session::can_hand_over`]; until then it is served as usual).
    #[inline]
    fn must_stop(&self) -> bool {
        self.info.is_killed()
            || self.app.is_cut_off()
            || (self.app.is_handing_over() && self.can_hand_over())
            || (self.app.is_shutting_down()
                && self.replies.is_idle()
                && self.server.as_ref().is_none_or(|s| s.status == b'I'))
    }

    /// How a session that must stop ends: handed over during an online restart, else closed.
    fn stop(&mut self) -> Pin<Box<dyn std::future::Future<Output = End> + Send + '_>> {
        if !self.info.is_killed()
            && !self.app.is_cut_off()
            && self.app.is_handing_over()
            && self.can_hand_over()
        {
            return Box::pin(std::future::ready(End::HandOver));
        }
        self.shutdown_client()
    }

    /// Whether a pinned client has sent nothing, outside a transaction, for
    /// `pinned_idle_timeout` (polls the timer only then: the task is woken when it fires).
    fn idle_too_long(&mut self, cx: &mut Context<'_>) -> bool {
        let idle = self.state.pins != 0 && self.work_done() && self.client.rbuf.is_empty();
        match self.state.pinned_idle.as_mut() {
            Some(timer) if idle => std::future::Future::poll(timer.as_mut(), cx).is_ready(),
            _ => false,
        }
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
            // A replica's server gone (a standby shutting down): the replica takes no more
            // reads before the client hears of it, for the client may come straight back
            // with its next read (see `let_replica_server_go`, which marks it so too, later).
            if let Some(replica) = self.reads.as_deref().and_then(|r| r.on.as_ref()) {
                replica.mark_down();
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
            // PgBouncer's words for its timeouts: the setting's name, or "query timeout"
            // when it closes the server running the query.
            let (code, message) = match self.info.kill_reason() {
                KillReason::ClientIdleTimeout => {
                    (sqlstate::PROTOCOL_VIOLATION, "client_idle_timeout")
                }
                KillReason::QueryTimeout if self.server.is_some() => {
                    (sqlstate::PROTOCOL_VIOLATION, "query timeout")
                }
                KillReason::QueryTimeout => (sqlstate::PROTOCOL_VIOLATION, "query_timeout"),
                KillReason::IdleTransactionTimeout => {
                    (sqlstate::PROTOCOL_VIOLATION, "idle transaction timeout")
                }
                KillReason::TransactionTimeout => {
                    (sqlstate::PROTOCOL_VIOLATION, "transaction timeout")
                }
                KillReason::Console => (
                    sqlstate::ADMIN_SHUTDOWN,
                    "terminating connection due to administrator command",
                ),
            };
            self.client.send_error(Severity::Fatal, code, message).await;
            End::Shutdown
        })
    }

    /// One poll over both connections: writes pending output, then reads whichever side may be
    /// read. Returns as soon as there is something to process.
    #[inline]
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
        let hold = (self.local_replies_only && !self.replies.is_empty())
            || (self.reads.is_some() && self.holds_replies_for_position());
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
            buffers::take_back_both(&mut self.client.rbuf, &mut self.client.wbuf);
        }
        // A message already buffered is handled before either socket is read. (Mostly nothing
        // is: asked first, before the conditions of `may_read_client`.)
        if !self.client.rbuf.is_empty()
            && self.may_read_client()
            && !matches!(frame(&self.client.rbuf, self.max_message), Ok(None))
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
    #[inline]
    fn may_read_client(&self) -> bool {
        let server_backlog = self.server.as_ref().map_or(0, |s| s.wbuf.len());
        server_backlog < HIGH_WATER
            && self.violation.is_none()
            && !self.plan.waiting
            && !self.info.cancels.pending()
            && !self.terminate_waiting()
    }

    /// Whether the client's input starts with a Terminate that waits for the replies still
    /// owed ([`Session::terminate_waits`]): read, never planned, until they are relayed.
    #[inline]
    fn terminate_waiting(&self) -> bool {
        self.client.rbuf.first() == Some(&fe::TERMINATE) && self.terminate_waits()
    }

    /// Whether a Terminate waits for replies still owed: those of queries or of batches the
    /// client ended with a Sync, which PostgreSQL sends before it reads the Terminate. Not in
    /// a batch left open (PostgreSQL may hold its replies until a Sync that never comes) nor
    /// in a COPY IN.
    fn terminate_waits(&self) -> bool {
        !self.replies.is_empty() && !self.replies.in_batch() && !self.replies.in_copy_in()
    }

    /// Reads the client's socket if it may be read: an event, or None (nothing to read now).
    #[inline(always)]
    fn poll_client_read(&mut self, cx: &mut Context<'_>) -> Option<Event> {
        if !self.may_read_client() {
            self.client_read_armed = false;
            return self.poll_client_hangup(cx);
        }
        // Polled before and found nothing, and nothing seen since: the waker registered then
        // is still there (the runtime takes it only when it sees the socket readable, and
        // marks it so first), so another poll would only register it again: once a
        // transaction, after the replies (-104 instructions a transaction, callgrind). Only
        // on the socket's own loop (`client_on_own_loop`): an I/O driver on another thread
        // marks the socket readable, then takes the waker, and between the two this session
        // may read the bytes and register again; the driver then takes the new registration,
        // and the wake finds nothing to read (framework_apps::go_database_sql_pgx hung so on
        // the tests' multi-threaded runtime, a client's next query left unread).
        let seen = self.client.stream.seen_readable();
        if self.client_read_armed && !seen {
            return None;
        }
        // The wake-up after a poll that registered: the socket is read without another poll
        // (later reads of this wake are polled, and so spend the task's cooperative budget).
        let woken = std::mem::take(&mut self.client_read_armed);
        // Wait for the socket to have bytes before borrowing a buffer (the replies to what
        // it sends will need a write buffer too), or before reading into the one it holds:
        // a poll of readiness registers the waker without a read's set-up. Seen readable
        // already (the wake-up after the last poll), it needs no poll to say so.
        let readable = seen
            || match self.client.stream.poll_read_ready(cx) {
                Poll::Ready(Ok(())) => true,
                Poll::Ready(Err(e)) => return Some(Event::ClientGone(Some(e))),
                Poll::Pending => false,
            };
        if !readable {
            self.client_read_armed = self.registration_stays();
            return None;
        }
        buffers::lend_both(&mut self.client.rbuf, &mut self.client.wbuf);
        reserve(&mut self.client.rbuf);
        if woken {
            match self
                .client
                .stream
                .try_read_buf_socket(&mut self.client.rbuf)
            {
                Some(Err(e)) if e.kind() == io::ErrorKind::WouldBlock => {} // polled below
                None => {} // polled below, which registers the waker
                Some(read) => return Some(read_event(read, Event::ClientRead, Event::ClientGone)),
            }
        }
        match poll_read_buf(Pin::new(&mut self.client.stream), cx, &mut self.client.rbuf) {
            Poll::Ready(read) => Some(read_event(read, Event::ClientRead, Event::ClientGone)),
            Poll::Pending => {
                self.client_read_armed = self.registration_stays();
                None
            }
        }
    }

    /// After a poll of the client's socket returned Pending: whether the waker it registered
    /// stays until the socket is seen readable, so that the next poll may be skipped. Only on
    /// the socket's own loop (`client_on_own_loop`), and only if it registered at all: not
    /// when the task's cooperative budget was spent, as tokio then returns Pending without
    /// looking at the socket (and wakes the task again at once). A poll that registered had
    /// budget, which its Pending gave back.
    #[inline]
    fn registration_stays(&self) -> bool {
        self.client_on_own_loop && tokio::task::coop::has_budget_remaining()
    }

    /// While a Terminate waits for the replies owed before it ([`Session::terminate_waiting`]),
    /// the client's socket is still read, for its end only: a client that says Terminate
    /// mostly hangs up at once (libpq's `PQfinish`, asyncpg's `terminate()` after a timed-out
    /// query), and a server kept to relay replies nobody reads would hold a place in the pool
    /// until the statement ends (asyncpg's tests each left a `pg_sleep(10)` so, and a pool of
    /// two was held for minutes). What the client sends after its Terminate stays unread, as
    /// PostgreSQL leaves it; past [`HIGH_WATER`] of it the socket is no longer watched.
    #[cold]
    fn poll_client_hangup(&mut self, cx: &mut Context<'_>) -> Option<Event> {
        if !self.terminate_waiting() {
            return None;
        }
        while self.client.rbuf.len() < HIGH_WATER {
            reserve(&mut self.client.rbuf);
            match poll_read_buf(Pin::new(&mut self.client.stream), cx, &mut self.client.rbuf) {
                Poll::Ready(Ok(0)) => return Some(Event::ClientGone(None)),
                Poll::Ready(Ok(_)) => {}
                Poll::Ready(Err(e)) => return Some(Event::ClientGone(Some(e))),
                Poll::Pending => return None,
            }
        }
        None
    }

    /// Reads the server's socket, if a server is held and the client's output has room.
    #[inline(always)]
    fn poll_server_read(&mut self, cx: &mut Context<'_>) -> Option<Event> {
        let server = self.server.as_mut()?;
        if self.client.wbuf.len() >= HIGH_WATER {
            return None;
        }
        if !matches!(frame(&server.rbuf, MAX_BACKEND_MESSAGE_SIZE), Ok(None)) {
            return Some(Event::ServerRead);
        }
        // Not seen readable since the last read: the poll only registers the waker (once a
        // transaction, right after the client's work went out), which asking for readiness
        // does without a read's set-up.
        if !server.stream.seen_readable() {
            match server.stream.poll_read_ready(cx) {
                Poll::Ready(Ok(())) => {}
                Poll::Ready(Err(e)) => return Some(Event::ServerGone(Some(e))),
                Poll::Pending => {
                    server.read_armed = true;
                    return None;
                }
            }
        }
        reserve(&mut server.rbuf);
        // The wake-up after that Pending: read without another poll (as the client's).
        if std::mem::take(&mut server.read_armed) {
            match server.stream.try_read_buf_socket(&mut server.rbuf) {
                Some(Err(e)) if e.kind() == io::ErrorKind::WouldBlock => {} // polled below
                None => {} // polled below, which registers the waker
                Some(read) => return Some(read_event(read, Event::ServerRead, Event::ServerGone)),
            }
        }
        match poll_read_buf(Pin::new(&mut server.stream), cx, &mut server.rbuf) {
            Poll::Ready(read) => Some(read_event(read, Event::ServerRead, Event::ServerGone)),
            Poll::Pending => {
                server.read_armed = true;
                None
            }
        }
    }

    /// After the relay: leaves the server, if one is still held, clean for the next client
    /// (rolled back and reset), or closes it when that cannot be done safely.
    async fn finish(&mut self) {
        let unfinished = self.cache_abandon();
        if self.plan.stmts.take().is_some() {
            self.app.registry.note_released();
        }
        let pending_output = !self.client.wbuf.is_empty();
        if pending_output {
            let _ = crate::timer::timeout(Duration::from_secs(1), self.client.flush()).await;
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
            // Work is still running on the server; a half-read reply stream cannot be handed
            // to anyone else, so the connection goes, and its place in the pool is free at
            // once. A client that hung up after a Terminate that waited for the replies to
            // its work (see `poll_client_hangup`): its own backend would go on with that
            // work, then read the Terminate, its replies lost on a closed socket, so the
            // server gets the Terminate after the work, no cancel. Otherwise the work is
            // cancelled first.
            let cancel = (!self.terminate_waiting()).then(|| {
                let info = &server.info;
                (info.cancel_addr(), info.backend_pid, server.backend_secret)
            });
            match self.let_replica_server_go(&server) {
                Some(replica) => replica.pool.release_slot(&server),
                None => self.pool.release_slot(&server),
            }
            let app = self.app.clone();
            tokio::spawn(async move {
                match cancel {
                    Some((addr, pid, secret)) => {
                        let _ = crate::server::send_cancel(&addr, pid, secret).await;
                        // The cancel may come too late: what ran may commit until the
                        // backend ends.
                        server.terminate_and_wait(UNFINISHED_WAIT).await;
                    }
                    None => server.finish_and_wait(UNFINISHED_WAIT).await,
                }
                if let Some(unfinished) = unfinished {
                    unfinished.ended(&app.cache);
                }
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
                let keep_statements = settings.prepared_statements && is_discard_all(reset_query);
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
        let ok = matches!(
            crate::timer::timeout(Duration::from_secs(5), clean).await,
            Ok(Ok(())) if server.status == b'I'
        );
        server.broken |= !ok;
        self.give_server_back(server, crate::clock::Moment::now());
    }
}

/// No deadline: a timer for a pinned client while `pinned_idle_timeout` is 0.
const NEVER: Duration = Duration::from_secs(365 * 24 * 3600);

/// `DISCARD ALL` minus what would drop pgmemo's shared statements: everything a client can
/// leave behind (settings, cursors, LISTEN, advisory locks, temp tables, sequences state, its
/// own SQL-level prepared statements) is reset, but `pgmemo_s<n>` statements stay prepared.
const RESET_KEEPING_STATEMENTS: &str = "CLOSE ALL; SET SESSION AUTHORIZATION DEFAULT; RESET ALL; \
    UNLISTEN *; SELECT pg_advisory_unlock_all(); DISCARD PLANS; DISCARD TEMP; DISCARD SEQUENCES; \
    DO $pgmemo$ DECLARE s text; BEGIN FOR s IN SELECT name FROM pg_prepared_statements \
    WHERE name !~ '^pgmemo_s[0-9]+$' LOOP EXECUTE format('DEALLOCATE %I', s); END LOOP; END $pgmemo$";

/// Reads the database's functions that may set custom settings ([`facts::SETTING_FUNCTIONS_SQL`])
/// and the servers' default isolation ([`DEFAULT_ISOLATION_SQL`]) on `server` (idle, nobody's
/// notifications to lose) into `pool`. A failure leaves what was known of the functions and
/// the isolation unknown (no block is kept without a server); both are read again after
/// their time.
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
    let isolation = match server.internal_query(DEFAULT_ISOLATION_SQL).await {
        Ok(rows) => rows
            .into_iter()
            .next()
            .and_then(|r| r.into_iter().next().flatten()),
        Err(e) => {
            tracing::debug!(error = %e, "could not read the default isolation");
            None
        }
    };
    pool.set_isolation_default(isolation.as_deref());
}

/// The isolation a transaction of the pool's servers has when the client names none: the
/// reset value (server, database, role), not a setting some client left.
const DEFAULT_ISOLATION_SQL: &str = "SELECT reset_val FROM pg_catalog.pg_settings \
    WHERE name = 'default_transaction_isolation'";

/// Whether a `server_reset_query` is exactly `DISCARD ALL` (however it is spelt), which pgmemo
/// replaces with the same reset that keeps its shared statements.
fn is_discard_all(reset_query: &str) -> bool {
    matches!(
        crate::query::command::classify(reset_query).as_slice(),
        [crate::query::command::Command::DiscardAll]
    )
}

/// Adds a session's statement counters to the server it used (for SHOW SERVERS).
fn record_statement_stats(server: &ServerConn, stats: &LocalStats) {
    use std::sync::atomic::Ordering::Relaxed;
    let info = &server.info;
    info.prepared_statements
        .store(server.prepared.len() as u64, Relaxed);
    if stats.prepare_cache_hit | u64::from(stats.prepare_cache_miss | stats.prepare_evictions) != 0
    {
        info.prepare_cache_hit
            .fetch_add(stats.prepare_cache_hit, Relaxed);
        info.prepare_cache_miss
            .fetch_add(u64::from(stats.prepare_cache_miss), Relaxed);
        info.prepare_evictions
            .fetch_add(u64::from(stats.prepare_evictions), Relaxed);
    }
}

/// Whether this task runs on a single-threaded runtime, whose I/O driver runs on the same
/// thread between polls of its tasks, never during one.
fn single_threaded_runtime() -> bool {
    tokio::runtime::Handle::try_current()
        .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::CurrentThread)
}

/// Makes room for the next read: small for a quiet client, larger once traffic is flowing
/// (BytesMut reuses the freed front of the buffer when it can, so steady state allocates
/// nothing).
fn reserve(buf: &mut BytesMut) {
    if buf.capacity() - buf.len() < 1024 {
        buf.reserve(8 * 1024);
    }
}

/// Writes as much of `buf` as the socket takes without blocking. Most polls have nothing to
/// write: that is tested here, inlined, without a call (a TLS stream is flushed even then).
#[inline(always)]
fn poll_write_buf(stream: &mut Stream, buf: &mut BytesMut, cx: &mut Context<'_>) -> io::Result<()> {
    if buf.is_empty() && !stream.is_tls() {
        return Ok(());
    }
    poll_write_some(stream, buf, cx)
}

/// What a read of a socket came to: bytes (`read`), or its end or an error (`gone`).
#[inline(always)]
fn read_event(
    result: io::Result<usize>,
    read: Event,
    gone: fn(Option<io::Error>) -> Event,
) -> Event {
    match result {
        Ok(0) => gone(None),
        Ok(_) => read,
        Err(e) => gone(Some(e)),
    }
}

/// [`poll_write_buf`] when there is something to write or a TLS stream to flush.
#[inline(never)]
fn poll_write_some(
    stream: &mut Stream,
    buf: &mut BytesMut,
    cx: &mut Context<'_>,
) -> io::Result<()> {
    use tokio::io::AsyncWrite;
    while !buf.is_empty() {
        // A plain socket is tried first without the runtime's poll (its cooperative budget
        // and readiness check, ~70 instructions a write, callgrind): it nearly always takes
        // the bytes. Only when it would block is it polled, which registers the waker.
        match stream.try_write_socket(buf) {
            Some(Ok(0)) => return Err(io::ErrorKind::WriteZero.into()),
            Some(Ok(n)) => {
                buffers::consume(buf, n);
                continue;
            }
            Some(Err(e)) if e.kind() != io::ErrorKind::WouldBlock => return Err(e),
            Some(Err(_)) | None => {}
        }
        match Pin::new(&mut *stream).poll_write(cx, buf) {
            Poll::Ready(Ok(0)) => return Err(io::ErrorKind::WriteZero.into()),
            Poll::Ready(Ok(n)) => buffers::consume(buf, n),
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

#[cfg(test)]
mod tests;
