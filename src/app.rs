//! What every connection shares: the current configuration, the pools, the registry of clients
//! (for the admin console and cancel requests), TLS state, and the shutdown signal.

use crate::budget::{Budget, BudgetOf, ClientCounts};
use crate::cancel::Cancels;
use crate::config::{Config, PendingRestart, PoolMode, ServerTlsMode};
use crate::pool::{Pool, PoolKey, PoolSettings};
use crate::protocol::startup::Replication;
use crate::server::ServerTarget;
use arc_swap::{ArcSwap, ArcSwapOption};
use parking_lot::{Mutex, RwLock};
use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;
use std::time::SystemTime;
use tokio::sync::watch;

/// A client's socket address in 19 bytes instead of `SocketAddr`'s 32 (an IPv6 address keeps
/// no flow label or scope id, which pgmemo only ever shows): every client holds two. A
/// client on the Unix socket (`unix_socket_dir`) has no IP address: its endpoints are
/// PgBouncer's `unix` and the listen port. The port is kept as bytes, so that the address
/// has no padding: two of them in [`ClientInfo`] leave it room for two more bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Endpoint {
    /// None on a Unix socket (the niche of `IpAddr` keeps this 17 bytes).
    ip: Option<IpAddr>,
    port: [u8; 2],
}

impl Endpoint {
    /// A Unix-socket client's endpoint: its socket file's port (the listen port).
    pub fn unix(port: u16) -> Endpoint {
        Endpoint {
            ip: None,
            port: port.to_ne_bytes(),
        }
    }

    /// The IP address; None on a Unix socket.
    pub fn ip(&self) -> Option<IpAddr> {
        self.ip
    }

    /// The address as SHOW CLIENTS shows it: the IP address, or `unix`.
    pub fn host(&self) -> String {
        self.ip
            .map_or_else(|| "unix".to_string(), |ip| ip.to_string())
    }

    pub fn port(&self) -> u16 {
        u16::from_ne_bytes(self.port)
    }
}

impl From<SocketAddr> for Endpoint {
    fn from(addr: SocketAddr) -> Endpoint {
        Endpoint {
            ip: Some(addr.ip()),
            port: addr.port().to_ne_bytes(),
        }
    }
}

impl std::fmt::Display for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.ip {
            Some(ip) => SocketAddr::new(ip, self.port()).fmt(f),
            None => write!(f, "unix:{}", self.port()),
        }
    }
}

/// How pgmemo speaks TLS to a server: the mode, the CA file and the client certificate and
/// key (libpq's sslmode, sslrootcert, sslcert and sslkey).
type ServerTlsChoice = (
    ServerTlsMode,
    Option<std::path::PathBuf>,
    Option<(std::path::PathBuf, std::path::PathBuf)>,
);

/// Server TLS connectors by choice, for the servers whose connection string chooses.
type ServerConnectors = HashMap<ServerTlsChoice, Option<tokio_rustls::TlsConnector>>;

/// The TLS choice a connection string's options make with `[general]`'s, or None when it
/// sets none of them (the server then uses `general.server_tls` as is).
fn string_tls(
    g: &crate::config::General,
    o: &crate::config::ServerOptions,
) -> Option<ServerTlsChoice> {
    if o.tls.is_none() && o.tls_ca_file.is_none() && o.tls_identity.is_none() {
        return None;
    }
    let ca = o
        .tls_ca_file
        .clone()
        .or_else(|| g.server_tls_ca_file.clone());
    let identity = o.tls_identity.clone().or_else(|| general_identity(g));
    Some((o.tls.unwrap_or(g.server_tls), ca, identity))
}

/// A client certificate's (certificate, key) files as paths.
fn as_paths(
    identity: &Option<(std::path::PathBuf, std::path::PathBuf)>,
) -> Option<(&std::path::Path, &std::path::Path)> {
    identity.as_ref().map(|(c, k)| (c.as_path(), k.as_path()))
}

/// `general.server_tls_cert_file` and `server_tls_key_file`, when both are set.
fn general_identity(
    g: &crate::config::General,
) -> Option<(std::path::PathBuf, std::path::PathBuf)> {
    Some((
        g.server_tls_cert_file.clone()?,
        g.server_tls_key_file.clone()?,
    ))
}

/// Where a client's current query runs, so a CancelRequest can be passed on.
/// An unspecified `addr` is a server behind a Unix socket, whose socket file is looked up
/// when a cancel comes ([`App::cancel_addr`]): a path here would make every client's record
/// larger, for the rare cancel.
#[derive(Debug, Clone, Copy)]
pub struct ServerCancel {
    pub addr: SocketAddr,
    pub pid: i32,
    pub secret: i32,
}

/// [`ClientInfo`]'s link bit for a client over TLS.
const LINK_TLS: u8 = 1;

/// Client lifecycle states as PgBouncer's SHOW CLIENTS names them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum ClientState {
    Login = 0,
    /// Connected, no server assigned.
    Idle = 1,
    /// Waiting in the pool's queue.
    Waiting = 2,
    /// Holding a server.
    Active = 3,
}

impl ClientState {
    pub fn name(self) -> &'static str {
        match self {
            ClientState::Login => "login",
            ClientState::Idle => "idle",
            ClientState::Waiting => "waiting",
            ClientState::Active => "active",
        }
    }
}

/// Why a client was killed, which decides what it is told.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum KillReason {
    /// The console's KILL_CLIENT or KILL, or a shutdown's cutoff.
    Console = 0,
    /// Idle without a server past `client_idle_timeout`.
    ClientIdleTimeout = 1,
    /// Its query (waiting for a server included) ran past `query_timeout`.
    QueryTimeout = 2,
    /// Idle in a transaction past `idle_transaction_timeout`.
    IdleTransactionTimeout = 3,
    /// In a transaction (running or idle) past `transaction_timeout`.
    TransactionTimeout = 4,
}

/// What the rest of pgmemo can see of one client connection.
#[derive(Debug)]
pub struct ClientInfo {
    pub id: u64,
    pub addr: Endpoint,
    pub local_addr: Endpoint,
    /// When the client connected, in whole seconds since the Unix epoch (all SHOW CLIENTS
    /// shows; until 2106): 4 bytes where a `SystemTime` takes 16.
    connect_secs: u32,
    /// How the client connected: over TLS ([`LINK_TLS`]), and as a replication connection of
    /// which kind (the bits above it, [`Replication`] as u8). One byte for both: ClientInfo
    /// stays in its allocator size class (see `footprint`).
    link: AtomicU8,
    /// Shared with the other clients of the same name (see [`App::intern`]).
    pub user: Arc<str>,
    pub database: Arc<str>,
    /// The secret key of the BackendKeyData pgmemo gave this client (pgmemo's own, never a
    /// server's).
    pub secret: i32,
    /// The process ID of that BackendKeyData: pgmemo's own in transaction mode, the server's
    /// in session mode (set once, at login: see [`App::show_pid`]).
    pid: std::sync::atomic::AtomicI32,
    state: AtomicU8,
    pub application_name: Mutex<Arc<str>>,
    /// The server running this client's work right now, if any.
    pub server: Mutex<Option<ServerCancel>>,
    /// Whether the client's work runs on that server, and the cancel requests being passed on
    /// to it (see [`crate::cancel`]).
    pub cancels: Cancels,
    pub server_id: AtomicU64,
    /// Why the client keeps its server (`pins::Pins`), 0 when it does not.
    pub pins: AtomicU8,
    /// Set by the console's KILL_CLIENT (and KILL): the session ends at its next wake.
    killed: AtomicBool,
    /// Why it was killed ([`KillReason`] as u8), what the client is told.
    kill_reason: AtomicU8,
    /// When the client last sent something, in whole seconds since the Unix epoch as
    /// [`App::unix_secs`] derives them from the monotonic clock (SHOW CLIENTS' request_time
    /// shows seconds, as connect_time). Written once per wake of the session that reads a
    /// message, not per message.
    request_secs: AtomicU32,
    /// When the client's current query began, in [`QUERY_TICK_US`] ticks of
    /// [`App::clock_us`], wrapping (0: none in flight): from its first message that needs a
    /// server to the ReadyForQuery that ends its work, waiting for a server included, as
    /// PgBouncer's `query_start`. SHOW CLIENTS' `wait`, SHOW POOLS' `maxwait` and SHOW
    /// STATS' `total_query_time` are read from it. A wait for a server that no query is in
    /// flight for (at login) is timed here too, while it lasts ([`ClientInfo::start_wait`]).
    /// 4 bytes, not a u64 of microseconds: an idle client's ClientInfo stays in its allocator
    /// size class (see `footprint`), which leaves no room for a wait start of its own.
    query_start: AtomicU32,
    /// Since when the client has been idle in a transaction, in whole seconds of
    /// [`App::clock_us`], wrapping at 18 hours (0: it is not): set at a ReadyForQuery of
    /// status T or E, read only while no query is in flight. Two bytes, so that ClientInfo
    /// keeps its size class.
    idle_in_transaction: AtomicU16,
    /// Since when the client's transaction has been open, in whole seconds of
    /// [`App::clock_us`] as `idle_in_transaction` (0: none is): from the first query after a
    /// ReadyForQuery of status I (a single statement is a transaction too, as PgBouncer's
    /// `xact_start`) to the next such ReadyForQuery (`transaction_timeout`).
    transaction_start: AtomicU16,
    /// Its session's task, woken when a shutdown begins or reaches its cutoff, or when the
    /// cancel requests it waited for have been delivered: the session reads the flags whenever
    /// it is polled. One waker set once per session costs less memory than a future waiting on
    /// a shared signal in every session's task. Cleared when the client is unregistered (the
    /// waker holds the task).
    pub stop_waker: Mutex<Option<std::task::Waker>>,
}

/// Databases the console paused (lower case, as it reads its words), or all of them.
#[derive(Default)]
struct Paused {
    all: bool,
    databases: std::collections::HashSet<String>,
}

impl Paused {
    fn covers(&self, database: &str) -> bool {
        self.all
            || (!self.databases.is_empty()
                && self.databases.contains(&database.to_ascii_lowercase()))
    }
}

/// The unit of [`ClientInfo`]'s query start, in microseconds: a u32 of them spans 19 hours.
pub const QUERY_TICK_US: u64 = 16;

/// `us` ([`App::clock_us`]) in [`QUERY_TICK_US`] ticks, wrapping.
fn query_tick(us: u64) -> u32 {
    (us / QUERY_TICK_US) as u32
}

/// `us` ([`App::clock_us`]) in whole seconds, wrapping (`idle_in_transaction`).
fn idle_second(us: u64) -> u16 {
    (us / 1_000_000) as u16
}

/// At most this many distinct client user and database names are shared.
const MAX_INTERNED_NAMES: usize = 1024;

impl ClientInfo {
    /// When the client connected (to the second).
    pub fn connect_time(&self) -> SystemTime {
        SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(u64::from(self.connect_secs))
    }

    /// The process ID the client was given in BackendKeyData.
    /// When the client connected, in seconds since the Unix epoch.
    pub fn connect_secs(&self) -> u32 {
        self.connect_secs
    }

    pub fn pid(&self) -> i32 {
        self.pid.load(Ordering::Relaxed)
    }

    pub fn state(&self) -> ClientState {
        match self.state.load(Ordering::Relaxed) {
            0 => ClientState::Login,
            1 => ClientState::Idle,
            2 => ClientState::Waiting,
            _ => ClientState::Active,
        }
    }

    pub fn set_state(&self, s: ClientState) {
        self.state.store(s as u8, Ordering::Relaxed);
    }

    /// Ends the client's session as soon as its task runs (the console's KILL_CLIENT): the
    /// client is told, and a transaction it was in is rolled back.
    pub fn kill(&self) {
        self.killed.store(true, Ordering::SeqCst);
        self.wake();
    }

    /// Ends the client for `reason` (a timeout of the janitor's): as [`ClientInfo::kill`],
    /// the client told why.
    pub fn kill_for(&self, reason: KillReason) {
        self.kill_reason.store(reason as u8, Ordering::Relaxed);
        self.kill();
    }

    /// Why the client was killed.
    pub fn kill_reason(&self) -> KillReason {
        match self.kill_reason.load(Ordering::Relaxed) {
            1 => KillReason::ClientIdleTimeout,
            2 => KillReason::QueryTimeout,
            3 => KillReason::IdleTransactionTimeout,
            4 => KillReason::TransactionTimeout,
            _ => KillReason::Console,
        }
    }

    /// When the client last sent something, in [`App::unix_secs`].
    pub fn request_secs(&self) -> u32 {
        self.request_secs.load(Ordering::Relaxed)
    }

    /// Wakes the session's task, to read its flags again.
    fn wake(&self) {
        if let Some(waker) = self.stop_waker.lock().as_ref() {
            waker.wake_by_ref();
        }
    }

    /// Ready once no cancel request is being passed on to the client's server (see
    /// [`Cancels::pending`]); until then the task polling is woken when the last is delivered.
    pub fn poll_cancels_delivered(&self, cx: &mut std::task::Context<'_>) -> std::task::Poll<()> {
        if self.cancels.pending() {
            {
                let mut waker = self.stop_waker.lock();
                if !waker.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
                    *waker = Some(cx.waker().clone());
                }
            }
            // Delivered meanwhile, before the waker was there to be woken?
            if self.cancels.pending() {
                return std::task::Poll::Pending;
            }
        }
        std::task::Poll::Ready(())
    }

    /// The client's work runs on `server` from now on: SHOW CLIENTS and SHOW SERVERS link
    /// the two, and a CancelRequest with the client's key goes to it.
    #[inline]
    pub fn hold(&self, server: &crate::server::ServerConn) {
        server.info.client_id.store(self.id, Ordering::Relaxed);
        server.info.client_pid.store(self.pid(), Ordering::Relaxed);
        *self.server.lock() = Some(ServerCancel {
            addr: server.info.addr,
            pid: server.info.backend_pid,
            secret: server.backend_secret,
        });
        self.server_id.store(server.info.id, Ordering::Relaxed);
        self.set_state(ClientState::Active);
    }

    /// The client's work runs on no server any more (see [`ClientInfo::hold`]).
    #[inline]
    pub fn let_go(&self) {
        *self.server.lock() = None;
        self.server_id.store(0, Ordering::Relaxed);
    }

    /// Whether the client is a replication connection (relayed to a server of its own), and
    /// which kind; SHOW CLIENTS' `replication`.
    pub fn replication(&self) -> Replication {
        match self.link.load(Ordering::Relaxed) >> 1 {
            x if x == Replication::Logical as u8 => Replication::Logical,
            x if x == Replication::Physical as u8 => Replication::Physical,
            _ => Replication::None,
        }
    }

    pub fn set_replication(&self, kind: Replication) {
        self.link.fetch_or((kind as u8) << 1, Ordering::Relaxed);
    }

    /// Whether the client connected over TLS.
    pub fn tls(&self) -> bool {
        self.link.load(Ordering::Relaxed) & LINK_TLS != 0
    }

    pub fn is_killed(&self) -> bool {
        self.killed.load(Ordering::Relaxed)
    }

    /// Notes that the client sent something at `unix_secs` ([`App::unix_secs`]).
    #[inline]
    pub fn note_request(&self, unix_secs: u32) {
        self.request_secs.store(unix_secs, Ordering::Relaxed);
    }

    /// When the client last sent something (to the second).
    pub fn request_time(&self) -> SystemTime {
        let secs = self.request_secs.load(Ordering::Relaxed);
        SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(u64::from(secs))
    }

    /// Starts timing the client's query at `now_us` ([`App::clock_us`]) unless one is in
    /// flight already (a pipelined message belongs to the work in flight, as in PgBouncer).
    #[inline]
    pub fn start_query(&self, now_us: u64) {
        if self.query_start.load(Ordering::Relaxed) == 0 {
            self.query_start
                .store(query_tick(now_us).max(1), Ordering::Relaxed);
            if self.transaction_start.load(Ordering::Relaxed) == 0 {
                self.transaction_start
                    .store(idle_second(now_us).max(1), Ordering::Relaxed);
            }
        }
    }

    /// Ends the query in flight, if one is: how long it took, in microseconds.
    #[inline]
    pub fn end_query(&self, now_us: u64) -> Option<u64> {
        let age = self.query_age_us(now_us)?;
        self.query_start.store(0, Ordering::Relaxed);
        Some(age)
    }

    /// [`ClientInfo::end_query`] at a ReadyForQuery whose server is in a transaction
    /// (`in_transaction`): the client is idle in transaction from `now_us` until its next
    /// query (`idle_transaction_timeout`); otherwise not.
    #[inline]
    pub fn end_query_at_ready(&self, now_us: u64, in_transaction: bool) -> Option<u64> {
        let age = self.end_query(now_us)?;
        let since = if in_transaction {
            idle_second(now_us).max(1)
        } else {
            0
        };
        self.idle_in_transaction.store(since, Ordering::Relaxed);
        if !in_transaction {
            self.transaction_start.store(0, Ordering::Relaxed);
        }
        Some(age)
    }

    /// How long the client's transaction has been open at `now_us`, running or idle, in
    /// microseconds (to the second); None when it is in none.
    pub fn transaction_age_us(&self, now_us: u64) -> Option<u64> {
        match self.transaction_start.load(Ordering::Relaxed) {
            0 => None,
            since => Some(u64::from(idle_second(now_us).wrapping_sub(since)) * 1_000_000),
        }
    }

    /// How long the client has been idle in a transaction at `now_us`, in microseconds (as
    /// [`ClientInfo::query_age_us`]); None when it is not.
    pub fn idle_in_transaction_us(&self, now_us: u64) -> Option<u64> {
        if self.query_start.load(Ordering::Relaxed) != 0 {
            return None;
        }
        match self.idle_in_transaction.load(Ordering::Relaxed) {
            0 => None,
            since => Some(u64::from(idle_second(now_us).wrapping_sub(since)) * 1_000_000),
        }
    }

    /// Forgets the query in flight, without timing it (answered by pgmemo itself).
    #[inline]
    pub fn forget_query(&self) {
        self.query_start.store(0, Ordering::Relaxed);
        // Outside a transaction before it, the query answered here began none.
        if self.idle_in_transaction.load(Ordering::Relaxed) == 0 {
            self.transaction_start.store(0, Ordering::Relaxed);
        }
    }

    /// Times a wait for a server from `now_us` ([`App::clock_us`]) when no query of the
    /// client's is in flight to time it: a wait at login (for a server to settle its
    /// parameters or read the setting functions on, or for a session's own server), which
    /// PgBouncer counts from when it began. The wait is kept as the query's start, so that
    /// SHOW CLIENTS' `wait`, SHOW POOLS' `maxwait` and `query_timeout` read it as they read a
    /// waiting query's. True when it did; the waiter then calls [`ClientInfo::end_wait`] once
    /// the wait is over, before any query of the client's can begin.
    pub fn start_wait(&self, now_us: u64) -> bool {
        if self.query_start.load(Ordering::Relaxed) != 0 {
            return false; // the query in flight times the wait already
        }
        self.query_start
            .store(query_tick(now_us).max(1), Ordering::Relaxed);
        true
    }

    /// Ends a wait [`ClientInfo::start_wait`] timed: no query is in flight again. Its time is
    /// the pool's wait time (SHOW STATS' `total_wait_time`), not a query's.
    pub fn end_wait(&self) {
        self.query_start.store(0, Ordering::Relaxed);
    }

    /// How long the query in flight has run at `now_us` ([`App::clock_us`]), in
    /// microseconds (to [`QUERY_TICK_US`], and modulo the ticks' range of 19 hours); None
    /// when none is in flight.
    pub fn query_age_us(&self, now_us: u64) -> Option<u64> {
        match self.query_start.load(Ordering::Relaxed) {
            0 => None,
            start => Some(u64::from(query_tick(now_us).wrapping_sub(start)) * QUERY_TICK_US),
        }
    }

    /// The flag [`ClientInfo::kill`] sets, for a wait to end on (`Pool::checkout`).
    pub fn killed_flag(&self) -> &AtomicBool {
        &self.killed
    }
}

/// How pgmemo logs into a server as a client whose password it never saw, learnt from the
/// client's login against a stored secret.
#[derive(Clone, Debug)]
pub enum Passthrough {
    /// The ClientKey recovered from its SCRAM proof and the verifier's ServerKey.
    Scram(crate::auth::ScramKeys),
    /// The md5 hash it was checked against, which answers a server's md5 challenge too.
    Md5(String),
}

/// The cancel key and connect time a client brings from the process that served it before
/// an online restart.
#[derive(Clone, Copy, Debug)]
pub struct ResumedKey {
    pub pid: i32,
    pub secret: i32,
    pub connect_secs: u32,
}

pub struct App {
    pub config: ArcSwap<Config>,
    pools: RwLock<HashMap<PoolKey, Arc<Pool>>>,
    /// The budgets of each database and each user that has a pool (see budget.rs).
    budgets: Mutex<HashMap<(BudgetOf, String), Arc<Budget>>>,
    pub tls_acceptor: ArcSwapOption<tokio_rustls::TlsAcceptor>,
    server_tls: ArcSwapOption<tokio_rustls::TlsConnector>,
    /// The connectors of the servers whose connection string sets its own TLS (`sslmode`,
    /// `sslrootcert`), by (mode, CA file); made by [`App::load_tls`], so a CA file that
    /// does not load fails the start or the RELOAD, not a login.
    server_tls_by_string: ArcSwap<ServerConnectors>,
    clients: Mutex<HashMap<u64, Arc<ClientInfo>>>,
    /// The primary of each server list (see [`crate::primary`]), by
    /// [`ServerTarget::hosts_key`]: shared by its pools and WAL follower, across reloads.
    primaries: Mutex<HashMap<String, Arc<crate::primary::Primary>>>,
    /// The replicas of each pool whose database names some (see [`crate::replicas`]), made
    /// with the pool (or by the reload that gave it replicas).
    replica_sets: Mutex<HashMap<PoolKey, Arc<crate::replicas::Replicas>>>,
    /// The registered clients per database and per user (`max_db_client_connections`,
    /// `max_user_client_connections`).
    client_counts: ClientCounts,
    /// Secret key → client: a CancelRequest must also carry the client's process ID.
    cancel_keys: Mutex<HashMap<i32, Arc<ClientInfo>>>,
    next_client_id: AtomicU64,
    /// User and database names of clients, shared (see [`App::intern`]).
    names: Mutex<std::collections::HashSet<Arc<str>>>,
    /// Databases the console's DISABLE closed to new clients (lower case, as the console
    /// reads its words), until ENABLE.
    disabled: Mutex<std::collections::HashSet<String>>,
    /// What the console's PAUSE and KILL paused: PgBouncer pauses the database, so a pool
    /// made for it later (another user's) starts paused too.
    paused: Mutex<Paused>,
    pub shutdown_tx: watch::Sender<bool>,
    /// True while the listeners accept clients (see [`App::accepting_signal`]).
    accepting_tx: watch::Sender<bool>,
    /// Set when shutdown_timeout has passed: sessions still in a transaction are closed too.
    cutoff_tx: watch::Sender<bool>,
    pub shutting_down: AtomicBool,
    /// Set with `cutoff_tx`.
    cut_off: AtomicBool,
    pub started: crate::clock::Moment,
    /// The wall clock at `started`, in microseconds since the Unix epoch.
    started_unix_us: u64,
    pub listen_addr: Mutex<Option<SocketAddr>>,
    /// How RELOAD obtains a fresh configuration (set by the binary: re-read file + flags).
    pub reloader: Mutex<Option<crate::Reloader>>,
    /// The answers of `auth_query`, for a short while (see auth_query.rs).
    auth_query: crate::auth_query::AuthQueryCache,
    /// What logged-in clients left that lets pgmemo log into servers as them without their
    /// password (pass-through), by user.
    passthrough: Mutex<HashMap<String, Passthrough>>,
    /// Every prepared statement any client has parsed, shared across pools.
    pub registry: crate::statements::Registry,
    /// Query shapes seen in simple queries, and what autoprepare decided for each.
    pub autoprepare: crate::autoprepare::Autoprepare,
    /// The simple queries' shapes, shared by autoprepare and the result cache.
    pub shapes: Arc<crate::query::shapes::Shapes>,
    /// Cached results, table versions and the analyses behind them.
    pub cache: Arc<crate::cache::ResultCache>,
    /// The replication streams that invalidate cached results (`cache.invalidation = "wal"`).
    pub wal: crate::wal::Wal,
    /// The workers' event loops, set once they run (`general.workers`); unset (one loop) in
    /// an App that serves no clients.
    pub workers: std::sync::OnceLock<crate::workers::Loops>,
    /// Errors that belong to no pool (login failures, max_client_conn refusals).
    pub errors: crate::stats::ErrorCounters,
    /// `log_stats`' periods: every pool's totals, rolled by the janitor.
    pub stats_log: crate::stats::StatsPeriods,
    /// An online restart's way out for idle sessions, and in for cancel requests (see
    /// [`crate::takeover`]).
    pub handoff: crate::handoff::Outbox,
    /// `SHUTDOWN WAIT_FOR_CLIENTS` / SIGTERM: no new clients, and pgmemo exits once the last
    /// one has gone (see [`App::begin_drain`]).
    draining: AtomicBool,
}

impl App {
    pub fn new(config: Config) -> anyhow::Result<Arc<App>> {
        let (shutdown_tx, _) = watch::channel(false);
        let (accepting_tx, _) = watch::channel(true);
        let (cutoff_tx, _) = watch::channel(false);
        let shapes = Arc::new(crate::query::shapes::Shapes::new(
            config.general.autoprepare_max_shapes as usize,
        ));
        let config_cache = config.cache.clone();
        let app = Arc::new(App {
            config: ArcSwap::from_pointee(config),
            pools: RwLock::new(HashMap::new()),
            budgets: Mutex::new(HashMap::new()),
            tls_acceptor: ArcSwapOption::empty(),
            server_tls: ArcSwapOption::empty(),
            server_tls_by_string: ArcSwap::from_pointee(HashMap::new()),
            clients: Mutex::new(HashMap::new()),
            primaries: Mutex::new(HashMap::new()),
            replica_sets: Mutex::new(HashMap::new()),
            client_counts: ClientCounts::default(),
            cancel_keys: Mutex::new(HashMap::new()),
            next_client_id: AtomicU64::new(1),
            names: Mutex::new(std::collections::HashSet::new()),
            disabled: Mutex::new(std::collections::HashSet::new()),
            paused: Mutex::new(Paused::default()),
            shutdown_tx,
            accepting_tx,
            cutoff_tx,
            shutting_down: AtomicBool::new(false),
            cut_off: AtomicBool::new(false),
            started: crate::clock::Moment::now(),
            started_unix_us: SystemTime::now()
                .duration_since(SystemTime::UNIX_EPOCH)
                .map_or(0, |d| d.as_micros() as u64),
            listen_addr: Mutex::new(None),
            reloader: Mutex::new(None),
            auth_query: Default::default(),
            passthrough: Mutex::new(HashMap::new()),
            registry: crate::statements::Registry::new(),
            autoprepare: crate::autoprepare::Autoprepare::new(shapes.clone()),
            cache: Arc::new(crate::cache::ResultCache::new(
                &config_cache,
                shapes.clone(),
            )),
            shapes,
            wal: crate::wal::Wal::default(),
            workers: std::sync::OnceLock::new(),
            errors: Default::default(),
            stats_log: crate::stats::StatsPeriods::new(std::time::Instant::now()),
            handoff: Default::default(),
            draining: AtomicBool::new(false),
        });
        app.load_tls()?;
        app.cache.start_shared(&config_cache);
        app.wal.start_fleet(&app.cache, &config_cache);
        Ok(app)
    }

    /// (Re)builds the TLS acceptor and server connector from the current configuration.
    fn load_tls(&self) -> anyhow::Result<()> {
        let cfg = self.config.load();
        let g = &cfg.general;
        let acceptor = match (&g.tls_cert_file, &g.tls_key_file) {
            (Some(cert), Some(key)) => Some(Arc::new(crate::tls::load_acceptor(
                cert,
                key,
                g.tls_ca_file.as_deref(),
                g.client_tls.requires_certificate(),
                &g.tls_protocols,
            )?)),
            _ => None,
        };
        let identity = general_identity(g);
        let protocols = g.server_tls_protocols.as_str();
        let connector = crate::tls::server_connector(
            g.server_tls,
            g.server_tls_ca_file.as_deref(),
            as_paths(&identity),
            protocols,
        )?;
        let mut by_string = HashMap::new();
        let options = cfg.upstream.iter().map(|u| &u.options);
        for o in options.chain(cfg.databases.values().map(|d| &d.options)) {
            let Some(key) = string_tls(g, o) else {
                continue;
            };
            if let std::collections::hash_map::Entry::Vacant(slot) = by_string.entry(key) {
                let (mode, ca, identity) = slot.key();
                let made = crate::tls::server_connector(
                    *mode,
                    ca.as_deref(),
                    as_paths(identity),
                    protocols,
                )?;
                slot.insert(made);
            }
        }
        self.tls_acceptor.store(acceptor);
        self.server_tls.store(connector.map(Arc::new));
        self.server_tls_by_string.store(Arc::new(by_string));
        Ok(())
    }

    /// Applies a new configuration to everything that can change without a restart: pool
    /// sizes, timeouts, users and passwords, TLS files. Clients stay connected.
    ///
    /// Settings that need a restart (`Reload::Restart` in the settings tables) keep their
    /// running values, so that SHOW CONFIG shows what is in effect; each one the file changes
    /// is logged and returned, for RELOAD's notices. A configuration that is invalid with
    /// those running values, or whose TLS files do not load, is refused whole: the old one
    /// stays.
    pub fn reload(&self, mut config: Config) -> anyhow::Result<Vec<PendingRestart>> {
        let pending = config.keep_restart_settings(&self.config.load());
        config.validate().map_err(|e| {
            anyhow::anyhow!("{e} (with the running values of the settings that need a restart)")
        })?;
        let old = self.config.swap(Arc::new(config));
        if let Err(e) = self.load_tls() {
            self.config.store(old);
            return Err(e);
        }
        self.auth_query.clear();
        let cfg = self.config.load();
        self.shapes
            .set_max(cfg.general.autoprepare_max_shapes as usize);
        self.cache.reconfigure(&cfg.cache);
        for pool in self.pools.read().values() {
            if let Some(settings) = self.pool_settings(&cfg, &pool.key) {
                pool.reconfigure(settings);
                self.reconfigure_replicas(pool);
            }
        }
        for p in &pending {
            tracing::warn!(
                key = %p.key,
                running = %p.running,
                new = %p.pending,
                "{} cannot be changed without restarting pgmemo: keeping the running value",
                p.key
            );
        }
        for notice in cfg.notices() {
            tracing::warn!("{notice}");
        }
        tracing::info!("configuration reloaded");
        Ok(pending)
    }

    /// The pool for (database, user), created on first use; None when the configuration does
    /// not serve that database.
    pub fn pool(&self, database: &str, user: &str) -> Option<Arc<Pool>> {
        let key = PoolKey {
            database: database.to_owned(),
            user: user.to_owned(),
        };
        if let Some(p) = self.pools.read().get(&key) {
            return Some(p.clone());
        }
        let cfg = self.config.load();
        let settings = self.pool_settings(&cfg, &key)?;
        let mut pools = self.pools.write();
        Some(
            pools
                .entry(key.clone())
                .or_insert_with(|| {
                    let paused = self.paused.lock().covers(&key.database);
                    let (database, user) = self.budgets(&key);
                    let pool = Pool::with_budgets(key, settings, database, user);
                    if paused {
                        pool.pause();
                    }
                    self.reconfigure_replicas(&pool);
                    pool
                })
                .clone(),
        )
    }

    /// The replicas of `pool`'s server, when its database names some.
    pub fn replicas(&self, pool: &PoolKey) -> Option<Arc<crate::replicas::Replicas>> {
        self.replica_sets.lock().get(pool).cloned()
    }

    /// Every set of replicas (the janitor, SHOW SERVERS, the metrics).
    pub fn replica_sets(&self) -> Vec<Arc<crate::replicas::Replicas>> {
        self.replica_sets.lock().values().cloned().collect()
    }

    /// Makes, updates or drops `pool`'s set of replicas to match its settings.
    fn reconfigure_replicas(&self, pool: &Arc<Pool>) {
        let settings = pool.settings();
        let mut sets = self.replica_sets.lock();
        match (sets.get(&pool.key), settings.replicas.is_empty()) {
            (Some(set), false) => set.reconfigure(&settings),
            (Some(_), true) => {
                if let Some(set) = sets.remove(&pool.key) {
                    set.retire();
                }
            }
            (None, false) => {
                sets.insert(pool.key.clone(), crate::replicas::Replicas::new(pool));
            }
            (None, true) => {}
        }
    }

    /// The budgets of `key`'s database and user (max_db_connections, max_user_connections),
    /// shared by their pools; made on first use.
    fn budgets(&self, key: &PoolKey) -> (Arc<Budget>, Arc<Budget>) {
        let mut budgets = self.budgets.lock();
        let mut get = |kind: BudgetOf, name: &str| {
            budgets
                .entry((kind, name.to_owned()))
                .or_insert_with(|| Budget::new(0))
                .clone()
        };
        (
            get(BudgetOf::Database, &key.database),
            get(BudgetOf::User, &key.user),
        )
    }

    /// `PAUSE [db]` (and KILL): the database's pools, or every pool, hand out no server until
    /// RESUME, including pools made meanwhile. Returns the pools paused now.
    pub fn pause_databases(&self, database: Option<&str>) -> Vec<Arc<Pool>> {
        {
            let mut paused = self.paused.lock();
            match database {
                Some(db) => {
                    paused.databases.insert(db.to_ascii_lowercase());
                }
                None => paused.all = true,
            }
        }
        let pools = self.pools_of(database);
        for p in &pools {
            p.pause();
        }
        pools
    }

    /// The pools of `database` (any case, as the console reads its words), or all of them.
    pub fn pools_of(&self, database: Option<&str>) -> Vec<Arc<Pool>> {
        self.pools()
            .into_iter()
            .filter(|p| database.is_none_or(|db| p.key.database.eq_ignore_ascii_case(db)))
            .collect()
    }

    /// Whether the console's PAUSE (or KILL) without a database is in force.
    pub fn is_paused_all(&self) -> bool {
        self.paused.lock().all
    }

    /// Whether the console paused `database` (PAUSE, KILL), pools or not.
    pub fn is_paused_database(&self, database: &str) -> bool {
        self.paused.lock().covers(database)
    }

    /// `RESUME [db]`; `Err` for RESUME db while every database is paused (as PgBouncer).
    pub fn resume_databases(&self, database: Option<&str>) -> Result<(), &'static str> {
        {
            let mut paused = self.paused.lock();
            match database {
                Some(_) if paused.all => return Err("pooler is paused, issue RESUME"),
                Some(db) => {
                    paused.databases.remove(&db.to_ascii_lowercase());
                }
                None => *paused = Paused::default(),
            }
        }
        for p in self.pools_of(database) {
            p.resume();
        }
        Ok(())
    }

    /// Remembers how to log into servers as `user`, learnt from its login (see
    /// [`Passthrough`]).
    pub fn learn_passthrough(&self, user: &str, how: Passthrough) {
        self.passthrough.lock().insert(user.to_owned(), how);
    }

    /// `auth_query`: the secret of client `user` logging in to `database`, looked up as
    /// its `auth_user` ([`Config::auth_lookup`]; None: no auth_user, no such database or no
    /// such user).
    pub async fn look_up_secret(
        &self,
        database: &str,
        user: &str,
    ) -> Result<Option<String>, crate::auth_query::LookupError> {
        let cfg = self.config.load_full();
        let Some(lookup) = cfg.auth_lookup(database) else {
            return Ok(None);
        };
        let auth_user = lookup.user;
        let key = PoolKey {
            database: lookup.dbname,
            user: auth_user.clone(),
        };
        let Some(settings) = self.pool_settings(&cfg, &key) else {
            return Ok(None);
        };
        let mut target = settings.target;
        if target.user != auth_user {
            // The database logs in as a fixed role: auth_user's own password is needed (the
            // upstream's when auth_user is pgmemo's own role).
            target.password = cfg
                .own_password(&auth_user)
                .or_else(|| {
                    cfg.user_secret(&auth_user).filter(|s| {
                        matches!(crate::auth::Secret::parse(s), crate::auth::Secret::Plain(_))
                    })
                })
                .map(str::to_owned);
            target.scram_keys = None;
            target.user = auth_user;
        }
        self.auth_query.secret(&target, &lookup.query, user).await
    }

    /// Whom WAL invalidation's connections to `pool`'s server database log in as (`target`:
    /// the pool's server login): `cache.replication_user`, else pgmemo's own role
    /// (`[upstream]`'s user) unless the database names a fixed user, else the pool's login.
    /// A follower serves every client of its database, so it takes no client's own role
    /// while pgmemo has one of its own.
    ///
    /// It connects to the first host that accepts it, in order (the primary), whatever order
    /// the pool's connections take (`load_balance_hosts`).
    pub fn wal_login(cfg: &Config, pool: &PoolKey, target: &ServerTarget) -> ServerTarget {
        ServerTarget {
            order: crate::config::HostOrder::InOrder,
            ..Self::wal_role(cfg, pool, target)
        }
    }

    /// [`App::wal_login`]'s role and password.
    fn wal_role(cfg: &Config, pool: &PoolKey, target: &ServerTarget) -> ServerTarget {
        let fixed = || {
            cfg.resolve(&pool.database, &pool.user)
                .is_some_and(|db| db.server_user.is_some())
        };
        let user = match (&cfg.cache.replication_user, &cfg.upstream) {
            (Some(user), _) => user,
            (None, Some(up)) if !fixed() => &up.user,
            _ => return target.clone(),
        };
        let password = match &cfg.cache.replication_user {
            Some(_) => cfg.cache.replication_password.as_deref(),
            None => None,
        };
        ServerTarget {
            user: user.clone(),
            password: password
                .or_else(|| cfg.own_password(user))
                .map(str::to_owned),
            scram_keys: None,
            ..target.clone()
        }
    }

    /// Where pgmemo's own role logs in to `database` (see [`App::wal_login`]): for its reads
    /// of a database that are no client's (`--check`'s look at the rules).
    pub fn own_target(&self, database: &str) -> Option<ServerTarget> {
        let cfg = self.config.load();
        let key = PoolKey {
            database: database.to_owned(),
            user: cfg
                .upstream
                .as_ref()
                .map(|u| u.user.clone())
                .unwrap_or_default(),
        };
        let settings = self.pool_settings(&cfg, &key)?;
        Some(App::wal_login(&cfg, &key, &settings.target))
    }

    fn pool_settings(&self, cfg: &Config, key: &PoolKey) -> Option<PoolSettings> {
        let db = cfg.resolve(&key.database, &key.user)?;
        let g = &cfg.general;
        // No fixed server user: log in as the client's own role (PgBouncer's model), with the
        // first password known for it. Without any, the server login is refused as soon as
        // the server asks for one (see `ServerConn::login`), never made as another role.
        let (user, password, scram_keys) = match db.server_user {
            // A fixed server user without a password (nor the upstream's): its password from
            // [users] / auth_file, as PgBouncer takes it from the auth file (a plain one, or
            // an md5 hash for md5).
            Some(u) => {
                let password = db.server_password.or_else(|| {
                    cfg.user_secret(&u)
                        .filter(|s| {
                            !matches!(crate::auth::Secret::parse(s), crate::auth::Secret::Scram(_))
                        })
                        .map(str::to_owned)
                });
                (u, password, None)
            }
            None => {
                // The upstream's password for pgmemo's own role, or a plain password (it logs
                // in with any method; "md5_pass" is one, not an md5 hash); else what the
                // client's own login left: its SCRAM keys, or the md5 hash it was checked
                // against (pass-through, as PgBouncer).
                let plain = db.server_password.as_deref().or_else(|| {
                    cfg.user_secret(&key.user).filter(|s| {
                        matches!(crate::auth::Secret::parse(s), crate::auth::Secret::Plain(_))
                    })
                });
                let learnt = self.passthrough.lock().get(&key.user).cloned();
                let (password, keys) = match (plain, learnt) {
                    (Some(p), _) => (Some(p.to_owned()), None),
                    (None, Some(Passthrough::Md5(hash))) => (Some(hash), None),
                    (None, Some(Passthrough::Scram(keys))) => (None, Some(keys)),
                    (None, None) => (None, None),
                };
                (key.user.clone(), password, keys)
            }
        };
        let o = db.server_options;
        let (tls_mode, tls) = match string_tls(g, &o) {
            Some(key) => {
                let connector = self.server_tls_by_string.load().get(&key).cloned();
                (key.0, connector.flatten())
            }
            None => (
                g.server_tls,
                self.server_tls.load_full().map(|c| (*c).clone()),
            ),
        };
        let mut target = ServerTarget {
            database_id: ServerTarget::database_id(&db.host, db.port, &db.dbname),
            host: db.host,
            port: db.port,
            dbname: db.dbname,
            user,
            password,
            tls_mode,
            tls,
            fallbacks: db.fallbacks,
            session_attrs: o.session_attrs,
            primary: Default::default(),
            connect_timeout: o.connect_timeout,
            application_name: o.application_name,
            scram_keys,
            keepalive: g.keepalive(),
            order: o.balance,
            turn: Default::default(),
        };
        target.primary = self
            .primaries
            .lock()
            .entry(target.hosts_key())
            .or_default()
            .clone();
        Some(PoolSettings {
            target,
            mode: db.pool_mode,
            pool_size: db.pool_size as usize,
            min_pool_size: db.min_pool_size as usize,
            query_wait_timeout: g.query_wait_timeout,
            server_connect_timeout: g.server_connect_timeout,
            server_idle_timeout: g.server_idle_timeout,
            server_lifetime: g.server_lifetime,
            server_check_delay: g.server_check_delay,
            server_check_query: g.server_check_query.clone(),
            server_reset_query: g.server_reset_query.clone(),
            server_reset_query_always: g.server_reset_query_always,
            server_round_robin: g.server_round_robin,
            prepared_statements: g.prepared_statements
                && (db.pool_mode == PoolMode::Transaction || g.session_shared_statements),
            max_prepared_statements: g.max_prepared_statements as usize,
            autoprepare: db.autoprepare,
            autoprepare_threshold: u64::from(g.autoprepare_threshold),
            pin_session_state: db.pin_session_state,
            pinned_idle_timeout: g.pinned_idle_timeout,
            max_pinned_fraction: g.max_pinned_fraction,
            max_db_connections: db.max_db_connections as usize,
            max_user_connections: db.max_user_connections as usize,
            reserve_pool_size: db.reserve_pool_size as usize,
            reserve_pool_timeout: g.reserve_pool_timeout,
            replicas: db.replicas,
        })
    }

    /// The process ID a listener should see for a notification that server process
    /// `server_pid` sent: the one pgmemo gave the client that last held that server (in
    /// transaction mode a client's NOTIFY runs on whichever server it was given, whose
    /// process ID it never saw), or None for a process that is none of pgmemo's servers (a
    /// session connected to PostgreSQL directly). Notifications are rare: the servers are
    /// searched.
    pub fn notifier_pid(&self, server_pid: i32) -> Option<i32> {
        let pools: Vec<Arc<Pool>> = self.pools.read().values().cloned().collect();
        pools.iter().find_map(|pool| {
            pool.servers()
                .iter()
                .find(|s| s.backend_pid == server_pid)
                .map(|s| s.client_pid.load(Ordering::Relaxed))
                .filter(|&pid| pid != 0)
        })
    }

    pub fn pools(&self) -> Vec<Arc<Pool>> {
        let mut v: Vec<_> = self.pools.read().values().cloned().collect();
        v.sort_by(|a, b| (&a.key.database, &a.key.user).cmp(&(&b.key.database, &b.key.user)));
        v
    }

    /// Registers a new client and gives it a unique cancel key.
    pub fn register_client(
        &self,
        addr: impl Into<Endpoint>,
        local_addr: impl Into<Endpoint>,
        tls: bool,
        user: &str,
        database: &str,
    ) -> Arc<ClientInfo> {
        let endpoints = (addr.into(), local_addr.into());
        self.register(endpoints, tls, user, database, None)
    }

    /// Registers a client another pgmemo process served until now (an online restart), with
    /// the cancel key it was given there and the time it connected.
    pub fn register_resumed_client(
        &self,
        endpoints: (Endpoint, Endpoint),
        user: &str,
        database: &str,
        key: ResumedKey,
    ) -> Arc<ClientInfo> {
        self.register(endpoints, false, user, database, Some(key))
    }

    fn register(
        &self,
        (addr, local_addr): (Endpoint, Endpoint),
        tls: bool,
        user: &str,
        database: &str,
        resumed: Option<ResumedKey>,
    ) -> Arc<ClientInfo> {
        let id = self.next_client_id.fetch_add(1, Ordering::Relaxed);
        // Interned before the cancel keys are locked: one lock at a time.
        let (user, database, no_name) = (self.intern(user), self.intern(database), self.intern(""));
        let mut keys = self.cancel_keys.lock();
        let (pid, secret, connect_secs) = match resumed {
            // A key this process gave too (2^-32 per pair) would now cancel either client's
            // work: the newer one keeps it.
            Some(k) => (k.pid, k.secret, k.connect_secs),
            None => {
                let (pid, secret) = loop {
                    let k = (rand::random::<i32>() & 0x7fff_ffff, rand::random::<i32>());
                    if k.0 != 0 && !keys.contains_key(&k.1) {
                        break k;
                    }
                };
                let connect_secs = SystemTime::now()
                    .duration_since(SystemTime::UNIX_EPOCH)
                    .map_or(0, |d| d.as_secs() as u32);
                (pid, secret, connect_secs)
            }
        };
        let info = Arc::new(ClientInfo {
            id,
            addr,
            local_addr,
            connect_secs,
            link: AtomicU8::new(u8::from(tls) * LINK_TLS),
            user,
            database,
            secret,
            pid: std::sync::atomic::AtomicI32::new(pid),
            state: AtomicU8::new(ClientState::Login as u8),
            application_name: Mutex::new(no_name),
            server: Mutex::new(None),
            cancels: Cancels::default(),
            server_id: AtomicU64::new(0),
            pins: AtomicU8::new(0),
            killed: AtomicBool::new(false),
            kill_reason: AtomicU8::new(KillReason::Console as u8),
            request_secs: AtomicU32::new(connect_secs),
            query_start: AtomicU32::new(0),
            idle_in_transaction: AtomicU16::new(0),
            transaction_start: AtomicU16::new(0),
            stop_waker: Mutex::new(None),
        });
        keys.insert(secret, info.clone());
        drop(keys);
        self.clients.lock().insert(id, info.clone());
        self.client_counts.add(&info.database, &info.user);
        info
    }

    /// pgmemo's clock for the console's times: microseconds since start, never 0 (0 means
    /// "none" where a time is kept in an atomic). A monotonic read, a few nanoseconds.
    #[inline]
    pub fn clock_us(&self) -> u64 {
        crate::clock::Moment::now().micros_since(self.started) + 1
    }

    /// `clock_us` ([`App::clock_us`]) in whole seconds since the Unix epoch: the wall clock at
    /// start plus the monotonic time since, without a second clock read.
    #[inline]
    pub fn unix_secs(&self, clock_us: u64) -> u32 {
        ((self.started_unix_us + clock_us) / 1_000_000) as u32
    }

    /// One shared copy of a user, database or application name for every client that uses it
    /// (memory per idle client). Bounded: a client can name databases that do not exist.
    pub fn intern(&self, name: &str) -> Arc<str> {
        let mut names = self.names.lock();
        if let Some(known) = names.get(name) {
            return known.clone();
        }
        let name: Arc<str> = Arc::from(name);
        if names.len() < MAX_INTERNED_NAMES {
            names.insert(name.clone());
        }
        name
    }

    pub fn unregister_client(&self, info: &ClientInfo) {
        info.stop_waker.lock().take();
        self.cancel_keys.lock().remove(&info.secret);
        if self.clients.lock().remove(&info.id).is_some() {
            self.client_counts.remove(&info.database, &info.user);
        }
    }

    pub fn clients(&self) -> Vec<Arc<ClientInfo>> {
        let mut v: Vec<_> = self.clients.lock().values().cloned().collect();
        v.sort_by_key(|c| c.id);
        v
    }

    pub fn client_count(&self) -> usize {
        self.clients.lock().len()
    }

    /// The clients registered now of database `name` (`BudgetOf::Database`) or user `name`.
    pub fn clients_of(&self, of: BudgetOf, name: &str) -> u32 {
        self.client_counts.get(of, name)
    }

    /// Gives `client` (logging in, not yet told its BackendKeyData) the process ID `pid`: in
    /// session mode its server's, so that `pg_backend_pid()`, notifications and the server's
    /// logs agree with what the client was told. The secret stays pgmemo's.
    pub fn show_pid(&self, client: &ClientInfo, pid: i32) {
        client.pid.store(pid, Ordering::Relaxed);
    }

    /// Passes a client's CancelRequest to the server running its work, if its work runs
    /// there (see [`crate::cancel`]), and returns once the server has handled it. Unknown keys
    /// are ignored silently, as PostgreSQL does.
    pub async fn cancel(&self, pid: i32, secret: i32) {
        let client = {
            let keys = self.cancel_keys.lock();
            keys.get(&secret).filter(|c| c.pid() == pid).cloned()
        };
        let Some(client) = client else {
            // During an online restart the key may be a client the old process still serves.
            self.handoff.forward_cancel(pid, secret);
            return;
        };
        if !client.cancels.begin() {
            return; // nothing runs
        }
        // Counted out however this ends, even if dropped midway: the session waits for it.
        struct Passing(Arc<ClientInfo>);
        impl Drop for Passing {
            fn drop(&mut self) {
                if self.0.cancels.end() {
                    self.0.wake();
                }
            }
        }
        let passing = Passing(client);
        // The server the work runs on: the session keeps it while the request is counted in.
        let target = *passing.0.server.lock();
        if let Some(t) = target {
            let addr = self.cancel_addr(&passing.0, t.addr);
            if let Err(e) = crate::server::send_cancel(&addr, t.pid, t.secret).await {
                tracing::warn!(error = %e, "could not forward cancel request");
            }
        }
    }

    /// Where a cancel for `client`'s server at `addr` goes: that address, or for a server
    /// behind a Unix socket (an unspecified address) its socket file, found among the
    /// pools' servers by the id of the client's server.
    fn cancel_addr(&self, client: &ClientInfo, addr: SocketAddr) -> crate::server::CancelAddr {
        if !addr.ip().is_unspecified() {
            return crate::server::CancelAddr::Tcp(addr);
        }
        let id = client.server_id.load(Ordering::Relaxed);
        self.pools()
            .iter()
            .flat_map(|p| p.servers())
            .find(|s| s.id == id)
            .map_or(crate::server::CancelAddr::Tcp(addr), |s| s.cancel_addr())
    }

    /// Takes every lock of the app (the pools' map exclusively) and of its statement registry,
    /// and keeps them until the result is dropped: for benches/hot_path.rs (see
    /// [`Pool::hold_locks`]).
    #[doc(hidden)]
    pub fn hold_locks(&self) -> impl Sized + '_ {
        (
            self.pools.write(),
            self.clients.lock(),
            self.cancel_keys.lock(),
            self.listen_addr.lock(),
            self.reloader.lock(),
            self.registry.hold_locks(),
        )
    }

    pub fn shutdown_signal(&self) -> watch::Receiver<bool> {
        self.shutdown_tx.subscribe()
    }

    pub fn begin_shutdown(&self) {
        self.shutting_down.store(true, Ordering::SeqCst);
        self.accepting_tx.send_replace(false);
        self.shutdown_tx.send_replace(true);
        self.wake_sessions();
    }

    /// Fires when a shutdown stops waiting for transactions to finish (shutdown_timeout):
    /// every session ends then, mid-transaction or not, rolling back what it held.
    pub fn cutoff_signal(&self) -> watch::Receiver<bool> {
        self.cutoff_tx.subscribe()
    }

    pub fn cut_off(&self) {
        self.cut_off.store(true, Ordering::SeqCst);
        self.cutoff_tx.send_replace(true);
        self.wake_sessions();
    }

    /// Wakes every session, to read the shutdown flags (see [`ClientInfo::stop_waker`]).
    fn wake_sessions(&self) {
        for client in self.clients.lock().values() {
            if let Some(waker) = client.stop_waker.lock().as_ref() {
                waker.wake_by_ref();
            }
        }
    }

    /// DISABLE (`true`) or ENABLE (`false`) new client connections to `database`.
    pub fn set_disabled(&self, database: &str, disabled: bool) {
        let name = database.to_ascii_lowercase();
        let mut set = self.disabled.lock();
        if disabled {
            set.insert(name);
        } else {
            set.remove(&name);
        }
    }

    /// Whether new clients of `database` are refused (DISABLE).
    pub fn is_disabled(&self, database: &str) -> bool {
        let set = self.disabled.lock();
        !set.is_empty() && set.contains(&database.to_ascii_lowercase())
    }

    pub fn is_cut_off(&self) -> bool {
        self.cut_off.load(Ordering::Relaxed)
    }

    pub fn is_shutting_down(&self) -> bool {
        self.shutting_down.load(Ordering::Relaxed)
    }

    /// `SHUTDOWN WAIT_FOR_CLIENTS` (PgBouncer's "super safe shutdown", SIGTERM): stop
    /// accepting and exit once every client has gone; the clients that are here go on being
    /// served meanwhile. [`crate::Pgmemo::wait`] begins the shutdown when the last one leaves.
    pub fn begin_drain(&self) {
        self.draining.store(true, Ordering::SeqCst);
        self.accepting_tx.send_replace(false);
    }

    /// Turns false when pgmemo stops accepting clients: at any shutdown, and at a
    /// `SHUTDOWN WAIT_FOR_CLIENTS` (the accept loop's signal; see [`App::shutdown_signal`] for
    /// the end of everything else).
    pub fn accepting_signal(&self) -> watch::Receiver<bool> {
        self.accepting_tx.subscribe()
    }

    /// Whether a `SHUTDOWN WAIT_FOR_CLIENTS` waits for the clients to leave.
    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Relaxed)
    }

    /// A new process takes this one's clients over (an online restart): this one accepts no
    /// more, and its sessions hand their clients over between transactions; logins already
    /// under way are completed here (and handed over next). Not a shutdown: the janitor and
    /// the WAL streams go on, and if the new process goes away this one accepts again (see
    /// [`App::begin_handover`]).
    pub fn is_handing_over(&self) -> bool {
        self.handoff.is_open()
    }

    /// An online restart begins: sessions hand their clients to `sink` from now on, and the
    /// listeners stop accepting (the new process accepts on them).
    pub fn begin_handover(&self, sink: std::sync::mpsc::Sender<crate::handoff::Handoff>) {
        self.handoff.open(sink);
        self.accepting_tx.send_replace(false);
        self.wake_sessions();
    }

    /// The new process of an online restart went away before it had every client: this one
    /// keeps the clients it still has and accepts again.
    pub fn end_handover(&self) {
        // Accepting again first: closing the handoff ends the takeover thread's wait, which
        // then listens for another takeover, and the task it starts ends at once if it finds
        // the listeners still stopped (leaving the control socket's file with nobody on it).
        if !self.is_shutting_down() && !self.is_draining() {
            self.accepting_tx.send_replace(true);
        }
        self.handoff.close();
    }
}

/// Whether a pool mode keeps a server for the whole session.
pub fn is_session_mode(mode: PoolMode) -> bool {
    mode == PoolMode::Session
}

#[cfg(test)]
mod tests {
    use super::Endpoint;
    use std::net::SocketAddr;

    #[test]
    fn an_endpoint_shows_and_splits_as_its_socket_address() {
        for text in [
            "127.0.0.1:6432",
            "[::1]:5432",
            "[2001:db8::7]:65535",
            "0.0.0.0:0",
        ] {
            let addr: SocketAddr = text.parse().unwrap();
            let endpoint = Endpoint::from(addr);
            assert_eq!(endpoint.to_string(), text);
            assert_eq!(
                (endpoint.ip(), endpoint.port()),
                (Some(addr.ip()), addr.port())
            );
            assert_eq!(endpoint.host(), addr.ip().to_string());
        }
        let unix = Endpoint::unix(6432);
        assert_eq!(
            (unix.host(), unix.port(), unix.to_string()),
            ("unix".into(), 6432, "unix:6432".into())
        );
        assert_eq!(std::mem::size_of::<Endpoint>(), 19);
    }
}
