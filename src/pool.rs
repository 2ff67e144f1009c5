//! Server connections per (database, user): checkout and check-in, the size limit, the queue of
//! clients waiting for a server, connect retries, and idle/lifetime maintenance.
//!
//! A checked-out [`ServerConn`] is owned by the session using it, so the hot path touches the
//! pool only twice per transaction (take and give back), each under this pool's own short lock;
//! there is no global lock. Connections are boxed: one changes hands twice per transaction,
//! and moving a pointer is cheaper than moving the whole connection. A returned connection goes
//! straight to the oldest waiter when there is one, so a waiter never races a newcomer for it.

use crate::budget::{Budget, Member};
use crate::clock::Moment;
use crate::params::Vars;
use crate::server::{ServerConn, ServerError, ServerInfo, ServerState, ServerTarget};
use crate::stats::PoolStats;
use arc_swap::ArcSwap;
use parking_lot::Mutex;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{oneshot, Notify};

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PoolKey {
    pub database: String,
    pub user: String,
}

pub use crate::config::PoolMode;

/// The settings a pool runs with; replaced as a whole on reload.
#[derive(Debug, Clone)]
pub struct PoolSettings {
    pub target: ServerTarget,
    pub mode: PoolMode,
    pub pool_size: usize,
    pub min_pool_size: usize,
    pub query_wait_timeout: Duration,
    pub server_connect_timeout: Duration,
    pub server_idle_timeout: Duration,
    pub server_lifetime: Duration,
    pub server_check_delay: Duration,
    pub server_check_query: String,
    pub server_reset_query: String,
    pub server_reset_query_always: bool,
    /// `server_round_robin`: the idle server that waited longest goes out first.
    pub server_round_robin: bool,
    /// Prepared statements shared through the registry (the statement planner) for new
    /// clients: transaction mode, or session mode with `session_shared_statements`.
    pub prepared_statements: bool,
    /// Bound of each server connection's prepared-statement LRU.
    pub max_prepared_statements: usize,
    /// Simple queries run as autoprepared statements (needs `prepared_statements`).
    pub autoprepare: bool,
    /// Uses of a query shape before it is prepared.
    pub autoprepare_threshold: u64,
    /// Session settings carried per client and pinning (transaction mode; see
    /// `session::state`).
    pub pin_session_state: bool,
    /// A pinned client idle this long is closed; zero: never.
    pub pinned_idle_timeout: Duration,
    /// Fraction of `pool_size` that pinned clients may hold (see [`Pool::pin`]).
    pub max_pinned_fraction: f64,
    /// The database's server connections across its pools (0: no limit); the budget
    /// shared by them holds it (see budget.rs).
    pub max_db_connections: usize,
    /// The user's server connections across its pools (0: no limit).
    pub max_user_connections: usize,
    /// Extra connections for a client that waited `reserve_pool_timeout`.
    pub reserve_pool_size: usize,
    pub reserve_pool_timeout: Duration,
    /// Streaming replicas of `target` that provably read-only work may go to (see
    /// [`crate::replicas`]); empty: none.
    pub replicas: Vec<(String, u16)>,
}

impl PoolSettings {
    fn limits(&self) -> Limits {
        Limits {
            pool_size: self.pool_size,
            reserve_pool_size: self.reserve_pool_size,
            server_lifetime_ns: u64::try_from(self.server_lifetime.as_nanos()).unwrap_or(u64::MAX),
            server_check_delay: if self.server_check_query.is_empty() {
                Duration::MAX
            } else {
                self.server_check_delay
            },
            retire_before: None,
            round_robin: self.server_round_robin,
            primary: self
                .target
                .followed_primary()
                .map(|primary| (primary, self.target.session_attrs)),
        }
    }
}

/// The settings every checkout and check-in reads, kept in the pool's state by each reload:
/// read under the lock those take anyway, where loading the whole settings would cost an
/// ArcSwap load (~70 instructions) each time.
#[derive(Debug, Clone)]
struct Limits {
    pool_size: usize,
    /// Opened only for clients that waited reserve_pool_timeout; the pool shrinks to
    /// pool_size + reserve_pool_size.
    reserve_pool_size: usize,
    /// server_lifetime in nanoseconds, the unit of [`Moment`]: each checkout and check-in
    /// compares it (a `Duration` made and compared cost ~35 instructions, this ~5).
    server_lifetime_ns: u64,
    /// `Duration::MAX` when there is no server_check_query.
    server_check_delay: Duration,
    /// Connections opened at or before this are closed when next released or found idle
    /// (the console's RECONNECT); kept across reloads.
    retire_before: Option<Moment>,
    /// `server_round_robin`: the oldest idle server first.
    round_robin: bool,
    /// With `target_session_attrs` `read-write` or `primary`: the hosts' primary, and what a
    /// server must be. A server of another host than the primary's (it moved, see
    /// [`crate::primary`]), or that became what the attributes refuse (a primary reloaded
    /// with `default_transaction_read_only` reports it), is closed when next met.
    primary: Option<(Arc<crate::primary::Primary>, crate::config::SessionAttrs)>,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            pool_size: 0,
            reserve_pool_size: 0,
            server_lifetime_ns: u64::MAX,
            server_check_delay: Duration::MAX,
            retire_before: None,
            round_robin: false,
            primary: None,
        }
    }
}

impl Limits {
    /// The most connections the pool keeps: above it, returned ones are closed.
    fn bound(&self) -> usize {
        self.pool_size + self.reserve_pool_size
    }

    /// Whether `conn` has lived past server_lifetime at `now`, or was open at a RECONNECT,
    /// and must be closed.
    #[inline]
    fn outlived(&self, conn: &ServerConn, now: Moment) -> bool {
        now.nanos_since(conn.info.created) >= self.server_lifetime_ns
            || self.retired(&conn.info)
            || self.primary.as_ref().is_some_and(|(primary, attrs)| {
                !primary.is_at(conn.info.host_index)
                    || !attrs.accepts(conn.is_standby(), conn.is_read_only(), false)
            })
    }

    /// Whether `server` was open at the last RECONNECT.
    fn retired(&self, server: &ServerInfo) -> bool {
        self.retire_before.is_some_and(|t| server.created <= t)
    }

    /// Whether `conn` has been idle long enough at `now` to be checked before it is handed out.
    fn due_for_check(&self, conn: &ServerConn, now: Moment) -> bool {
        now.since(conn.last_used) >= self.server_check_delay
    }
}

/// What every query reads of the settings, kept by each reload as atomics: one load each
/// instead of an ArcSwap load.
#[derive(Debug, Default)]
struct QuerySettings {
    /// `autoprepare_threshold` when autoprepare is on, `u64::MAX` when it is off.
    autoprepare_threshold: AtomicU64,
    max_prepared_statements: AtomicUsize,
}

impl QuerySettings {
    fn store(&self, settings: &PoolSettings) {
        let threshold = if settings.autoprepare {
            settings.autoprepare_threshold.min(u64::MAX - 1)
        } else {
            u64::MAX
        };
        self.autoprepare_threshold
            .store(threshold, Ordering::Relaxed);
        self.max_prepared_statements
            .store(settings.max_prepared_statements, Ordering::Relaxed);
    }
}

/// Why a client could not get a server.
#[derive(Debug, thiserror::Error)]
pub enum CheckoutError {
    #[error("query_wait_timeout: no server connection became free in {0:?}")]
    WaitTimeout(Duration),
    #[error("could not connect to server: {0}")]
    Connect(ServerError),
    #[error("pgmemo is shutting down")]
    Closed,
    #[error("the client was killed from the admin console while it waited")]
    Stopped,
}

/// How a client that could not be served at once waits (see [`Pool::checkout_slowly`]).
struct Wait<'a> {
    /// Set by the console's KILL: the wait ends.
    stop: Option<&'a AtomicBool>,
    /// query_wait_timeout from the start of the wait.
    deadline: Moment,
    /// reserve_pool_timeout from the start, when the pool has a reserve.
    reserve_at: Option<Moment>,
}

impl Wait<'_> {
    /// Ready once `stop` is set (polled again when its setter wakes the task).
    fn stopped(&self) -> impl std::future::Future<Output = ()> + '_ {
        std::future::poll_fn(move |_| match self.stop {
            Some(s) if s.load(Ordering::Relaxed) => std::task::Poll::Ready(()),
            _ => std::task::Poll::Pending,
        })
    }
}

/// The database's and the user's budgets that a pool draws on (see budget.rs).
struct Budgets {
    database: Arc<Budget>,
    user: Arc<Budget>,
}

impl Budgets {
    /// One more connection counted in both, or in neither.
    fn take(&self) -> bool {
        if !self.database.try_take() {
            return false;
        }
        if !self.user.try_take() {
            self.database.untake();
            return false;
        }
        true
    }

    /// Gives back what [`Budgets::take`] counted for a connection never opened.
    fn untake(&self) {
        self.database.untake();
        self.user.untake();
    }

    /// `n` connections closed.
    fn give_back(&self, n: usize) {
        self.database.give_back(n);
        self.user.give_back(n);
    }

    #[inline]
    fn starved(&self) -> bool {
        self.database.starved() || self.user.starved()
    }

    fn mark_starved(&self) {
        for b in [&self.database, &self.user] {
            if b.spent() {
                b.mark_starved();
            }
        }
    }

    /// Closes an idle server elsewhere in whichever budget is spent.
    fn make_room(&self) {
        for b in [&self.database, &self.user] {
            if b.spent() {
                b.make_room();
            }
        }
    }
}

/// What a look at the pool found (see `Pool::grant_or_queue`).
enum Look {
    Granted(Grant),
    /// Queued: the grant comes through the receiver.
    Queued(oneshot::Receiver<Grant>),
    Paused,
}

/// What a waiting client is handed: a connection, or the right to open one (a slot freed by a
/// connection that was closed).
enum Grant {
    Conn(Box<ServerConn>),
    Slot,
}

/// A client queued for a server.
struct Waiter {
    grant: oneshot::Sender<Grant>,
    /// The worker its session runs on (see workers.rs).
    worker: u16,
    /// How many clients queued after it were served before it.
    passed: u8,
}

/// How many later clients a queued one may see served first: a server checked in on one
/// worker goes to a client of the same worker near the front of the queue rather than to
/// the oldest, which would move it to the other worker (five system calls, a wake-up of the
/// other thread). With one worker the queue is strictly first come, first served. At 4, two
/// workers with clients unevenly placed moved a server in 11–16% of transactions (`pgbench
/// -c 32`, pool 10: 1–2 µs each); at 16, 1–2%, and a client waits at most 16 transactions'
/// hand-overs longer (~0.4 ms at 40k TPS).
const MAX_PASSED: u8 = 16;

/// How far into the queue a client of the same worker is looked for.
const SAME_WORKER_WINDOW: usize = 16;

#[derive(Default)]
struct PoolState {
    /// Idle connections, most recently used last (taken LIFO, so the oldest ones idle out).
    /// Boxed although a Vec is on the heap already: each one leaves this Vec for its session
    /// as a pointer rather than a copy of the whole connection.
    #[allow(clippy::vec_box)]
    idle: Vec<Box<ServerConn>>,
    /// Every connection counted against pool_size: idle + in use + being opened.
    total: usize,
    waiters: VecDeque<Waiter>,
    paused: bool,
    closed: bool,
    limits: Limits,
    /// Until then no connection is opened for min_pool_size: the pool's database was left to
    /// a client's statement that needs it to itself (see [`Pool::vacate`]).
    refill_after: Option<Instant>,
}

pub struct Pool {
    pub key: PoolKey,
    /// Swapped whole by a reload, read without a lock; what every transaction reads of it is
    /// copied out by the reload too (`query_settings`, `PoolState::limits`).
    settings: ArcSwap<PoolSettings>,
    query_settings: QuerySettings,
    state: Mutex<PoolState>,
    resumed: Notify,
    /// Every live server connection, for SHOW SERVERS.
    servers: Mutex<HashMap<u64, Arc<ServerInfo>>>,
    pub stats: PoolStats,
    /// Where SHOW STATS' averages start (`stats_period`).
    pub stats_periods: crate::stats::StatsPeriods,
    /// The reported parameters a fresh server connection starts with; what a client is told at
    /// login before its own startup parameters are applied.
    defaults: Mutex<Option<Vars>>,
    /// Startup parameter values already checked on a server: (name, raw value) → the value as
    /// the server reports it. Saves a round trip for every client login after the first.
    normalized: Mutex<HashMap<(String, String), String>>,
    /// Clients' reported parameter sets, shared: clients of one application log in with the
    /// same values, and each would otherwise hold its own copy (memory per idle client).
    reported_sets: Mutex<Vec<Arc<Vars>>>,
    /// The database's functions that may set custom settings (session-state watch), and when
    /// they were last read (`Instant` of the pool's creation + milliseconds; 0: never).
    setting_functions: arc_swap::ArcSwapOption<crate::query::facts::SettingFunctions>,
    setting_functions_read: std::sync::atomic::AtomicU64,
    /// Bumped at each store of `setting_functions`: a session compares it (one load) before
    /// loading them (an `ArcSwap` load, ~70 instructions) at a checkout.
    setting_functions_generation: std::sync::atomic::AtomicU32,
    /// Whether a transaction of this pool's servers is READ COMMITTED unless a client says
    /// otherwise (`default_transaction_isolation` as its role, database and server give it):
    /// [`ISOLATION_UNKNOWN`] until read with the setting functions, then
    /// [`ISOLATION_READ_COMMITTED`] or [`ISOLATION_OTHER`].
    isolation_default: std::sync::atomic::AtomicU8,
    created: Instant,
    /// Servers held by clients pinned to them (see [`Pool::pin`]).
    pinned: AtomicUsize,
    /// Wakes the clients waiting for a pin slot (see [`Pool::wait_to_pin`]) when one is
    /// freed.
    pin_freed: tokio::sync::Notify,
    /// max_db_connections and max_user_connections.
    budgets: Budgets,
}

/// How long the database's setting functions are trusted before they are read again: a
/// function created without pgmemo seeing the DDL is followed after at most this.
const SETTING_FUNCTIONS_TTL_MS: u64 = 5_000;

/// [`Pool::read_committed_default`]'s states.
const ISOLATION_UNKNOWN: u8 = 0;
const ISOLATION_READ_COMMITTED: u8 = 1;
const ISOLATION_OTHER: u8 = 2;

/// At most this many distinct reported sets are kept for sharing; more are not shared.
const MAX_SHARED_REPORTED_SETS: usize = 64;

/// `server_round_robin`'s pick: the connection idle longest that worker `here` serves, else
/// the one idle longest (`idle`, not empty, is in the order they came back).
#[allow(clippy::vec_box)]
fn take_oldest(idle: &mut Vec<Box<ServerConn>>, here: u16) -> Box<ServerConn> {
    let at = idle.iter().position(|c| c.worker == here).unwrap_or(0);
    idle.remove(at)
}

/// The most recently used of `idle` (not empty) that worker `here` serves, else the most
/// recently used; out of line, as only several workers need it.
#[cold]
#[inline(never)]
#[allow(clippy::vec_box)]
fn take_from(idle: &mut Vec<Box<ServerConn>>, here: u16) -> Box<ServerConn> {
    let at = idle
        .iter()
        .rposition(|c| c.worker == here)
        .unwrap_or(idle.len() - 1);
    idle.remove(at)
}

impl PoolState {
    /// The client a server of worker `home` goes to: the first one of `home`, or one that may
    /// not be passed again, near the front of the queue; else the oldest.
    #[inline]
    fn next_waiter(&mut self, home: u16) -> Option<Waiter> {
        let first = self.waiters.front()?;
        if first.worker == home {
            return self.waiters.pop_front(); // always, with one worker
        }
        self.next_waiter_behind(home)
    }

    /// [`PoolState::next_waiter`] when the oldest client is on another worker.
    #[cold]
    #[inline(never)]
    fn next_waiter_behind(&mut self, home: u16) -> Option<Waiter> {
        let at = self
            .waiters
            .iter()
            .take(SAME_WORKER_WINDOW)
            .position(|w| w.worker == home || w.passed >= MAX_PASSED)
            .unwrap_or(0);
        for w in self.waiters.iter_mut().take(at) {
            w.passed += 1;
        }
        self.waiters.remove(at)
    }
}

impl Pool {
    /// A pool of its own budgets: its database and user have no other pool (tests, benches).
    pub fn new(key: PoolKey, settings: PoolSettings) -> Arc<Pool> {
        let database = Budget::new(settings.max_db_connections);
        let user = Budget::new(settings.max_user_connections);
        Pool::with_budgets(key, settings, database, user)
    }

    /// A pool drawing on its database's and its user's budgets, which it joins.
    pub fn with_budgets(
        key: PoolKey,
        settings: PoolSettings,
        database: Arc<Budget>,
        user: Arc<Budget>,
    ) -> Arc<Pool> {
        database.set_max(settings.max_db_connections);
        user.set_max(settings.max_user_connections);
        let pool = Pool::unjoined(key, settings, Budgets { database, user });
        let member: std::sync::Weak<dyn Member> = Arc::downgrade(&pool) as _;
        pool.budgets.database.join(member.clone());
        pool.budgets.user.join(member);
        pool
    }

    fn unjoined(key: PoolKey, settings: PoolSettings, budgets: Budgets) -> Arc<Pool> {
        let query_settings = QuerySettings::default();
        query_settings.store(&settings);
        let state = PoolState {
            limits: settings.limits(),
            ..PoolState::default()
        };
        Arc::new(Pool {
            key,
            settings: ArcSwap::from_pointee(settings),
            query_settings,
            state: Mutex::new(state),
            resumed: Notify::new(),
            servers: Mutex::new(HashMap::new()),
            stats: PoolStats::default(),
            stats_periods: crate::stats::StatsPeriods::new(Instant::now()),
            defaults: Mutex::new(None),
            setting_functions: arc_swap::ArcSwapOption::empty(),
            setting_functions_read: std::sync::atomic::AtomicU64::new(0),
            setting_functions_generation: std::sync::atomic::AtomicU32::new(0),
            isolation_default: std::sync::atomic::AtomicU8::new(ISOLATION_UNKNOWN),
            created: Instant::now(),
            pinned: AtomicUsize::new(0),
            pin_freed: tokio::sync::Notify::new(),
            budgets,
            normalized: Mutex::new(HashMap::new()),
            reported_sets: Mutex::new(Vec::new()),
        })
    }

    pub fn settings(&self) -> Arc<PoolSettings> {
        self.settings.load_full()
    }

    /// The settings for a moment (not across an await): no reference count taken, for
    /// what every query reads.
    pub fn settings_now(&self) -> arc_swap::Guard<Arc<PoolSettings>> {
        self.settings.load()
    }

    /// The per-server prepared-statement bound.
    pub fn max_prepared_statements(&self) -> usize {
        self.query_settings
            .max_prepared_statements
            .load(Ordering::Relaxed)
    }

    /// Uses of a query shape before it is autoprepared, None when autoprepare is off.
    pub fn autoprepare_threshold(&self) -> Option<u64> {
        let threshold = self
            .query_settings
            .autoprepare_threshold
            .load(Ordering::Relaxed);
        (threshold != u64::MAX).then_some(threshold)
    }

    /// Applies reloaded settings; a larger pool_size hands freed capacity to waiters at once.
    pub fn reconfigure(&self, settings: PoolSettings) {
        let mut limits = settings.limits();
        let (max_db, max_user) = (settings.max_db_connections, settings.max_user_connections);
        self.query_settings.store(&settings);
        self.settings.store(Arc::new(settings));
        let mut st = self.state.lock();
        limits.retire_before = st.limits.retire_before;
        st.limits = limits;
        drop(st);
        self.budgets.database.set_max(max_db);
        self.budgets.user.set_max(max_user);
        self.dispatch();
    }

    /// Hands idle connections, then free slots, to queued waiters, oldest first. Check-ins
    /// feed waiters by themselves; this is for capacity that appears otherwise: RESUME (while
    /// paused, returned connections stay idle and waiters stay queued), a larger pool_size,
    /// and a place freed in the database's or user's budget.
    fn dispatch(&self) {
        let mut st = self.state.lock();
        let pool_size = st.limits.pool_size;
        while !st.paused && !st.closed {
            let Some(w) = st.waiters.pop_front() else {
                break;
            };
            if let Some(conn) = st.idle.pop() {
                conn.set_state(ServerState::Active);
                if let Err(Grant::Conn(back)) = w.grant.send(Grant::Conn(conn)) {
                    back.set_state(ServerState::Idle);
                    st.idle.push(back);
                }
            } else if st.total < pool_size && self.budgets.take() {
                st.total += 1;
                if w.grant.send(Grant::Slot).is_err() {
                    st.total -= 1;
                    self.budgets.untake();
                }
            } else {
                if st.total < pool_size {
                    // Waiting for the budget: the next server idle in it is closed for us.
                    self.budgets.mark_starved();
                }
                st.waiters.push_front(w);
                break;
            }
        }
    }

    /// Takes a server connection: an idle one, a new one if the pool is below its size, or the
    /// next one returned, waiting at most query_wait_timeout.
    ///
    /// The common case, an idle connection that needs no check, is taken at once with one
    /// clock reading. Everything else (waiting, connecting, discarding, checking) is a future
    /// of its own, boxed: a session's task, which lives as long as its client, then need not
    /// have room for a whole connect-and-login.
    ///
    /// A wait ends with [`CheckoutError::Stopped`] once `stop` is set (the console's KILL,
    /// KILL_CLIENT); whoever sets it wakes the waiting task.
    pub async fn checkout(
        &self,
        stop: Option<&AtomicBool>,
    ) -> Result<Box<ServerConn>, CheckoutError> {
        match self.checkout_at_once() {
            Some(conn) => Ok(conn),
            None => Box::pin(self.checkout_waiting(stop)).await,
        }
    }

    /// [`Pool::checkout`]'s common case alone: an idle connection ready to hand out, or None
    /// (then [`Pool::checkout_waiting`]). A session calls the two itself so that its task
    /// keeps no room for the waiting future.
    pub fn checkout_at_once(&self) -> Option<Box<ServerConn>> {
        let mut conn = self.take_idle_now()?;
        self.stats.here().wait_duration.observe_us(0);
        self.serve_here(&mut conn);
        Some(conn)
    }

    /// [`Pool::checkout`] when [`Pool::checkout_at_once`] found nothing: waits, connects,
    /// discards or checks as needed.
    pub async fn checkout_waiting(
        &self,
        stop: Option<&AtomicBool>,
    ) -> Result<Box<ServerConn>, CheckoutError> {
        let mut conn = self.checkout_slowly(stop, &[]).await?;
        self.serve_here(&mut conn);
        Ok(conn)
    }

    /// A new server of its own for a replication client, as PgBouncer opens one: a slot of
    /// the pool taken as any checkout takes one (the queue, PAUSE, query_wait_timeout, the
    /// budgets), an idle server granted instead closed to make room for it, and the connection
    /// opened with the `extra` startup parameters (`replication`, the client's settings). It
    /// never goes back to the pool: [`Pool::release_slot`] when the client is done.
    pub async fn checkout_dedicated(
        &self,
        stop: Option<&AtomicBool>,
        extra: &[(&str, &str)],
    ) -> Result<Box<ServerConn>, CheckoutError> {
        debug_assert!(!extra.is_empty());
        self.checkout_slowly(stop, extra).await
    }

    /// Moves `conn` to the calling worker's event loop if it served another one.
    fn serve_here(&self, conn: &mut ServerConn) {
        if conn.move_here() {
            self.stats
                .here()
                .server_moves
                .fetch_add(1, Ordering::Relaxed);
        }
    }

    /// An idle connection ready to hand out, or None (then [`Pool::checkout_slowly`]).
    fn take_idle_now(&self) -> Option<Box<ServerConn>> {
        let mut st = self.state.lock();
        if st.closed || st.paused {
            return None;
        }
        // The most recently used one that this worker serves already, else the most recently
        // used (see workers.rs; with one worker, always the last).
        let here = crate::workers::current();
        let last = st.idle.last()?;
        // The clock once there is one to take (a client that waits reads it for its wait).
        let now = Moment::now();
        let mut conn = match (st.limits.round_robin, last.worker == here) {
            (false, true) => st.idle.pop()?,
            (false, false) => take_from(&mut st.idle, here),
            (true, _) => take_oldest(&mut st.idle, here),
        };
        if !conn.looks_alive()
            || st.limits.outlived(&conn, now)
            || st.limits.due_for_check(&conn, now)
        {
            st.idle.push(conn); // checkout_slowly() closes or checks it
            return None;
        }
        drop(st);
        conn.set_state(ServerState::Active);
        conn.checked_out = now;
        conn.info.note_request(now);
        Some(conn)
    }

    /// One look at the pool for a client that could not be served at once: a live idle
    /// connection, a free slot to connect in, a place in the queue, or a paused pool. Dead or
    /// outlived idle connections met on the way are closed. A client queued because the
    /// database's or user's budget is spent (not this pool's size) makes room: an idle
    /// server of another pool of theirs is closed.
    fn grant_or_queue(&self, now: Moment) -> Result<Look, CheckoutError> {
        let mut discard = Vec::new();
        let mut over_budget = false;
        let next = {
            let mut st = self.state.lock();
            if st.closed {
                return Err(CheckoutError::Closed);
            }
            if st.paused {
                Look::Paused
            } else {
                let mut got = None;
                while let Some(conn) = st.idle.pop() {
                    if conn.looks_alive() && !st.limits.outlived(&conn, now) {
                        got = Some(Grant::Conn(conn));
                        break;
                    }
                    st.total -= 1;
                    discard.push(conn);
                }
                let room = st.total < st.limits.pool_size;
                match got {
                    Some(g) => Look::Granted(g),
                    None if room && self.budgets.take() => {
                        st.total += 1;
                        Look::Granted(Grant::Slot)
                    }
                    None => {
                        over_budget = room;
                        let (tx, rx) = oneshot::channel();
                        st.waiters.push_back(Waiter {
                            grant: tx,
                            worker: crate::workers::current(),
                            passed: 0,
                        });
                        Look::Queued(rx)
                    }
                }
            }
        };
        for conn in &discard {
            self.forget(conn);
        }
        self.budgets.give_back(discard.len());
        if over_budget {
            self.budgets.make_room();
        }
        Ok(next)
    }

    /// [`Pool::checkout`] when no idle connection could be handed out at once: looks at the
    /// pool, waits as told (for RESUME, in the queue), then readies what it was granted.
    ///
    /// With `dedicated` startup parameters (a replication client's server, see
    /// [`Pool::checkout_dedicated`]) a granted idle server is closed and a new one opened in
    /// its slot.
    async fn checkout_slowly(
        &self,
        stop: Option<&AtomicBool>,
        dedicated: &[(&str, &str)],
    ) -> Result<Box<ServerConn>, CheckoutError> {
        let started = Moment::now();
        let settings = self.settings.load_full();
        // The deadlines on the same clock reading (pgmemo's timers take Moments).
        let wait = Wait {
            stop,
            deadline: started.after(settings.query_wait_timeout),
            reserve_at: (settings.reserve_pool_size > 0)
                .then(|| started.after(settings.reserve_pool_timeout)),
        };
        // The last clock reading.
        let mut now = started;
        // The rare ways (a paused pool, a connect, a check) are boxed: a waiting client's
        // future, made and moved into its box at every wait, stays small (the whole
        // connect-and-login in it was ~300 instructions of copying a wait, callgrind).
        loop {
            let grant = match self.grant_or_queue(now)? {
                Look::Paused => {
                    Box::pin(self.wait_resumed(&wait, &settings)).await?;
                    now = Moment::now();
                    continue;
                }
                Look::Granted(g) => g,
                Look::Queued(rx) => {
                    let g = self.wait_in_queue(rx, &wait, &settings).await?;
                    now = Moment::now();
                    g
                }
            };
            match grant {
                Grant::Conn(conn) if !dedicated.is_empty() => {
                    // Its slot (and budget) now the new connection's.
                    self.forget(&conn);
                    tokio::spawn(conn.terminate());
                    return Box::pin(self.open_granted(
                        &settings,
                        wait.deadline,
                        started,
                        dedicated,
                    ))
                    .await;
                }
                Grant::Conn(conn) => {
                    let ready = if settings.limits().due_for_check(&conn, now) {
                        Box::pin(self.checked(conn, &settings)).await
                    } else {
                        Some(conn)
                    };
                    if let Some(mut conn) = ready {
                        Self::activate(&mut conn, now);
                        self.note_wait(started, now);
                        return Ok(conn);
                    }
                }
                Grant::Slot => {
                    return Box::pin(self.open_granted(
                        &settings,
                        wait.deadline,
                        started,
                        dedicated,
                    ))
                    .await
                }
            }
        }
    }

    /// Paused: waits for RESUME (or the deadline, or the console's KILL).
    async fn wait_resumed(
        &self,
        wait: &Wait<'_>,
        settings: &PoolSettings,
    ) -> Result<(), CheckoutError> {
        let notified = self.resumed.notified();
        if !self.state.lock().paused {
            return Ok(());
        }
        tokio::select! {
            biased;
            () = wait.stopped() => Err(CheckoutError::Stopped),
            waited = crate::timer::timeout_at_moment(wait.deadline, notified) => match waited {
                Ok(()) => Ok(()),
                Err(_) => Err(CheckoutError::WaitTimeout(settings.query_wait_timeout)),
            },
        }
    }

    /// Queued: waits for a grant until query_wait_timeout, taking a reserve slot once the
    /// client has waited reserve_pool_timeout (when the reserve has one).
    async fn wait_in_queue(
        &self,
        mut rx: oneshot::Receiver<Grant>,
        wait: &Wait<'_>,
        settings: &PoolSettings,
    ) -> Result<Grant, CheckoutError> {
        let mut reserve_at = wait.reserve_at.filter(|t| *t < wait.deadline);
        loop {
            let until = reserve_at.unwrap_or(wait.deadline);
            let waited = tokio::select! {
                biased;
                waited = crate::timer::timeout_at_moment(until, &mut rx) => waited,
                () = wait.stopped() => {
                    // Killed while queued: a grant sent just before is given back.
                    if let Some(g) = self.leave_queue(&mut rx) {
                        self.give_back_grant(g);
                    }
                    return Err(CheckoutError::Stopped);
                }
            };
            match waited {
                Ok(Ok(g)) => return Ok(g),
                Ok(Err(_)) => return Err(CheckoutError::Closed),
                Err(_) if reserve_at.is_some() => {
                    reserve_at = None;
                    if self.take_reserve() {
                        tracing::warn!(pool = ?self.key, "taking connection from reserve_pool");
                        return Ok(match self.leave_queue(&mut rx) {
                            Some(g) => {
                                self.give_slot_back();
                                g
                            }
                            None => Grant::Slot,
                        });
                    }
                }
                Err(_) => {
                    return match self.leave_queue(&mut rx) {
                        Some(g) => Ok(g),
                        None => {
                            self.stats
                                .here()
                                .wait_timeouts
                                .fetch_add(1, Ordering::Relaxed);
                            Err(CheckoutError::WaitTimeout(settings.query_wait_timeout))
                        }
                    };
                }
            }
        }
    }

    /// Leaves the queue. A grant may have been sent just before: closing first makes any
    /// later send fail (the sender passes its grant on), and one that already arrived is
    /// returned, never dropped with the receiver, which would lose that server and its slot
    /// for good.
    fn leave_queue(&self, rx: &mut oneshot::Receiver<Grant>) -> Option<Grant> {
        rx.close();
        match rx.try_recv() {
            Ok(g) => Some(g),
            Err(_) => {
                // Our dead entry must not count as a waiting client.
                self.state.lock().waiters.retain(|w| !w.grant.is_closed());
                None
            }
        }
    }

    /// A slot of the reserve pool, counted, when the pool is below pool_size +
    /// reserve_pool_size and the budgets allow one more.
    fn take_reserve(&self) -> bool {
        let mut st = self.state.lock();
        let bound = st.limits.pool_size + st.limits.reserve_pool_size;
        if st.closed || st.paused || st.total >= bound || !self.budgets.take() {
            return false;
        }
        st.total += 1;
        true
    }

    /// A granted connection idle past server_check_delay, checked with server_check_query:
    /// None when that check failed (it is closed).
    async fn checked(
        &self,
        mut conn: Box<ServerConn>,
        settings: &PoolSettings,
    ) -> Option<Box<ServerConn>> {
        conn.set_state(ServerState::Tested);
        if conn
            .internal_query(&settings.server_check_query)
            .await
            .is_err()
        {
            self.release_slot(&conn);
            return None;
        }
        Some(conn)
    }

    /// A granted connection made ready to hand out (checked first if it was due).
    fn activate(conn: &mut ServerConn, now: Moment) {
        conn.set_state(ServerState::Active);
        conn.checked_out = now;
        conn.info.note_request(now);
    }

    /// Opens a connection in a granted slot; the slot passes on if that fails.
    async fn open_granted(
        &self,
        settings: &PoolSettings,
        deadline: Moment,
        started: Moment,
        extra: &[(&str, &str)],
    ) -> Result<Box<ServerConn>, CheckoutError> {
        match self.connect(settings, deadline, extra).await {
            Ok(mut conn) => {
                conn.set_state(ServerState::Active);
                conn.checked_out = Moment::now();
                conn.info.note_request(conn.checked_out);
                self.note_wait(started, conn.checked_out);
                Ok(conn)
            }
            Err(e) => {
                self.give_slot_back();
                Err(CheckoutError::Connect(e))
            }
        }
    }

    /// Records a client's whole wait for a server, from `started` to `now` when it is handed
    /// one: SHOW STATS' wait time as PgBouncer counts it (from the wait's start to the
    /// client's activation, the connect of a server opened for it included; a wait that ends
    /// without a server is not counted), and the wait histogram's observation.
    fn note_wait(&self, started: Moment, now: Moment) {
        let waited = now.micros_since(started);
        let stats = self.stats.here();
        stats.wait_time_us.fetch_add(waited, Ordering::Relaxed);
        stats.wait_duration.observe_us(waited);
    }

    /// Opens a connection for a slot already counted in `total`, retrying until
    /// server_connect_timeout (or the caller's deadline) so a restarting server is waited for.
    async fn connect(
        &self,
        settings: &PoolSettings,
        deadline: Moment,
        extra: &[(&str, &str)],
    ) -> Result<Box<ServerConn>, ServerError> {
        let started = Moment::now();
        let connect_deadline = started.after(settings.server_connect_timeout).min(deadline);
        let mut delay = Duration::from_millis(50);
        loop {
            let attempt = crate::timer::timeout_at_moment(
                connect_deadline,
                ServerConn::connect_with(&settings.target, extra),
            )
            .await;
            let err = match attempt {
                Ok(Ok(conn)) => {
                    self.stats
                        .here()
                        .server_connects
                        .fetch_add(1, Ordering::Relaxed);
                    let conn = Box::new(conn);
                    self.servers.lock().insert(conn.info.id, conn.info.clone());
                    let mut defaults = self.defaults.lock();
                    // (Not from a replication client's server, opened with its settings.)
                    if defaults.is_none() && extra.is_empty() {
                        *defaults = Some(conn.reported().clone());
                    }
                    return Ok(conn);
                }
                // The server spoke: wrong password, unknown database, too many connections.
                // Retrying will not help (except "starting up" / "shutting down").
                Ok(Err(ServerError::Server { fields, raw }))
                    if !matches!(fields.code.as_str(), "57P03" | "57P01" | "53300") =>
                {
                    self.count_connect_failure();
                    return Err(ServerError::Server { fields, raw });
                }
                Ok(Err(e)) => e,
                Err(_) => ServerError::Io(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    // The caller's deadline (query_wait_timeout) may come first: the time
                    // given, not server_connect_timeout (a 300 ms wait was reported as 15 s).
                    format!(
                        "timed out after {:?} connecting to {:?}",
                        connect_deadline.since(started),
                        settings.target
                    ),
                )),
            };
            self.count_connect_failure();
            if Moment::now().after(delay) >= connect_deadline {
                tracing::warn!(pool = ?self.key, error = %err, "server connection failed");
                return Err(err);
            }
            tracing::debug!(pool = ?self.key, error = %err, "server connection failed, retrying");
            crate::timer::sleep(delay).await;
            delay = (delay * 2).min(Duration::from_secs(1));
        }
    }

    /// Counts a failed attempt to open a server connection (pgmemo_server_connect_failures_total).
    fn count_connect_failure(&self) {
        self.stats
            .here()
            .server_connect_failures
            .fetch_add(1, Ordering::Relaxed);
    }

    /// Returns a connection. Broken, dirty or expired ones are closed and their slot passes on.
    pub fn checkin(&self, conn: Box<ServerConn>) {
        self.checkin_at(conn, Moment::now());
    }

    /// [`Pool::checkin`] with the clock already read by the caller (`now`).
    pub fn checkin_at(&self, mut conn: Box<ServerConn>, now: Moment) {
        conn.info.client_id.store(0, Ordering::Relaxed);
        conn.info.note_request(now);
        if conn.broken || conn.status != b'I' {
            if conn.status != b'I' && !conn.broken {
                tracing::warn!(pool = ?self.key, "closing a server returned inside a transaction");
            }
            self.release_slot(&conn);
            tokio::spawn(conn.terminate());
            return;
        }
        let mut st = self.state.lock();
        if st.limits.outlived(&conn, now) {
            drop(st);
            self.release_slot(&conn);
            tokio::spawn(conn.terminate());
            return;
        }
        conn.last_used = now;
        conn.set_state(ServerState::Idle);
        if st.total > st.limits.bound() {
            // pool_size was lowered by a reload: shrink as connections come back.
            st.total -= 1;
            drop(st);
            self.close_counted(conn);
            return;
        }
        // While paused, nobody gets a server: the connection stays idle and the waiters stay
        // queued until RESUME dispatches them.
        // Its event loop's worker: a client there takes it without moving it.
        let home = conn.worker;
        while !st.paused {
            let Some(w) = st.next_waiter(home) else {
                break;
            };
            conn.set_state(ServerState::Active);
            match w.grant.send(Grant::Conn(conn)) {
                Ok(()) => return,
                Err(Grant::Conn(back)) => {
                    conn = back;
                    conn.set_state(ServerState::Idle);
                }
                Err(Grant::Slot) => unreachable!("sent a connection"),
            }
        }
        if st.closed {
            drop(st);
            self.forget(&conn);
            tokio::spawn(conn.terminate());
            return;
        }
        if self.budgets.starved() {
            // Another pool's client waits for the database's or user's budget: this idle
            // server makes room for it (PgBouncer evicts one too).
            st.total -= 1;
            drop(st);
            self.close_counted(conn);
            return;
        }
        st.idle.push(conn);
    }

    /// Closes a connection already taken off `total`, and gives back its place in the
    /// budgets.
    fn close_counted(&self, conn: Box<ServerConn>) {
        self.forget(&conn);
        tokio::spawn(conn.terminate());
        self.budgets.give_back(1);
    }

    /// Drops a connection that will not come back, freeing its slot for a waiter.
    pub fn release_slot(&self, conn: &ServerConn) {
        self.forget(conn);
        self.give_slot_back();
    }

    fn give_slot_back(&self) {
        let mut st = self.state.lock();
        let pool_size = st.limits.pool_size;
        // Passed on to a waiter, unless paused or the pool is over a lowered pool_size.
        if !st.paused && st.total <= pool_size {
            while let Some(w) = st.waiters.pop_front() {
                if w.grant.send(Grant::Slot).is_ok() {
                    return;
                }
            }
        }
        st.total -= 1;
        drop(st);
        self.budgets.give_back(1);
    }

    /// A grant its waiter no longer wants (killed as it came): the connection goes back to
    /// the pool, the slot to the next waiter.
    fn give_back_grant(&self, grant: Grant) {
        match grant {
            Grant::Conn(conn) => self.checkin(conn),
            Grant::Slot => self.give_slot_back(),
        }
    }

    fn forget(&self, conn: &ServerConn) {
        self.servers.lock().remove(&conn.info.id);
    }

    /// PgBouncer's RECONNECT: every server connection open now is closed when it is next
    /// released, the idle ones at once; new ones are opened as clients need them (and up to
    /// min_pool_size). For a server that moved (failover, a changed DNS name).
    pub async fn reconnect(self: &Arc<Self>) {
        self.retire_open();
        self.maintain().await;
    }

    /// [`Pool::reconnect`]'s first half, at once: no connection open now is handed out again
    /// (the idle ones are closed by the next [`Pool::maintain`], or by the checkout that
    /// meets them).
    pub fn retire_open(&self) {
        self.state.lock().limits.retire_before = Some(Moment::now());
    }

    /// Before a client's statement that needs this pool's server database to itself (`DROP
    /// DATABASE` and the like, see [`crate::vacate`]): the idle connections are taken out, to
    /// be closed by the caller, and those in use are closed when released, as after
    /// RECONNECT (PostgreSQL refuses the statement while they are open). For `hold` no
    /// connection is opened for min_pool_size; clients get new ones as they need them.
    pub fn vacate(&self, hold: Duration) -> Vec<Box<ServerConn>> {
        let idle: Vec<Box<ServerConn>> = {
            let mut st = self.state.lock();
            st.limits.retire_before = Some(Moment::now());
            st.refill_after = Some(Instant::now() + hold);
            let idle: Vec<Box<ServerConn>> = st.idle.drain(..).collect();
            st.total -= idle.len();
            idle
        };
        self.budgets.give_back(idle.len());
        for conn in &idle {
            self.forget(conn);
        }
        idle
    }

    /// Whether `server` was open at the last RECONNECT and is closed when next released
    /// (SHOW SERVERS' close_needed).
    pub fn is_retired(&self, server: &ServerInfo) -> bool {
        self.state.lock().limits.retired(server)
    }

    /// How many server connections open at the last RECONNECT are still open (the console's
    /// WAIT_CLOSE waits for none).
    pub fn retiring(&self) -> usize {
        let limits = self.state.lock().limits.clone();
        if limits.retire_before.is_none() {
            return 0;
        }
        self.servers
            .lock()
            .values()
            .filter(|s| limits.retired(s))
            .count()
    }

    /// Closes idle connections past server_idle_timeout (keeping min_pool_size) or
    /// server_lifetime, and opens connections up to min_pool_size. Called by the janitor.
    pub async fn maintain(self: &Arc<Self>) {
        let settings = self.settings();
        let now = Moment::now();
        let expired: Vec<Box<ServerConn>> = {
            let mut st = self.state.lock();
            let mut keep = Vec::with_capacity(st.idle.len());
            let mut out = Vec::new();
            let total = st.total;
            let limits = st.limits.clone();
            for conn in st.idle.drain(..) {
                let idle_too_long = now.since(conn.last_used) >= settings.server_idle_timeout
                    && total - out.len() > settings.min_pool_size;
                // Over a pool_size lowered by a reload: idle ones go first.
                let over_size = total - out.len() > limits.bound();
                if idle_too_long || over_size || limits.outlived(&conn, now) || !conn.looks_alive()
                {
                    out.push(conn);
                } else {
                    keep.push(conn);
                }
            }
            st.idle = keep;
            st.total -= out.len();
            out
        };
        self.budgets.give_back(expired.len());
        for conn in expired {
            self.forget(&conn);
            conn.terminate().await;
        }
        loop {
            {
                let mut st = self.state.lock();
                if st.closed
                    || st.paused
                    || st.total >= settings.min_pool_size.min(settings.pool_size)
                    || st.refill_after.is_some_and(|t| Instant::now() < t)
                    || !self.budgets.take()
                {
                    break;
                }
                st.total += 1;
            }
            match self
                .connect(
                    &settings,
                    Moment::now().after(settings.server_connect_timeout),
                    &[],
                )
                .await
            {
                Ok(conn) => self.checkin(conn),
                Err(_) => {
                    self.give_slot_back();
                    break;
                }
            }
        }
    }

    pub fn pause(&self) {
        self.state.lock().paused = true;
    }

    pub fn resume(&self) {
        self.state.lock().paused = false;
        self.resumed.notify_waiters();
        self.dispatch();
    }

    pub fn is_paused(&self) -> bool {
        self.state.lock().paused
    }

    /// Closes idle connections and refuses new checkouts (shutdown).
    pub async fn close(&self) {
        let idle: Vec<Box<ServerConn>> = {
            let mut st = self.state.lock();
            st.closed = true;
            st.waiters.clear();
            let idle: Vec<Box<ServerConn>> = st.idle.drain(..).collect();
            st.total -= idle.len();
            idle
        };
        self.budgets.give_back(idle.len());
        for conn in idle {
            self.forget(&conn);
            conn.terminate().await;
        }
    }

    /// Counts for SHOW POOLS: (idle, in use or opening, waiting clients).
    pub fn counts(&self) -> (usize, usize, usize) {
        let st = self.state.lock();
        (st.idle.len(), st.total - st.idle.len(), st.waiters.len())
    }

    /// Takes every lock of the pool and keeps them until the result is dropped: for
    /// benches/hot_path.rs, which holds them while it times a session's hot path, to show
    /// that the path takes none of them (it would wait forever). (The settings take no lock.)
    #[doc(hidden)]
    pub fn hold_locks(&self) -> impl Sized + '_ {
        (
            self.state.lock(),
            self.servers.lock(),
            self.defaults.lock(),
            self.normalized.lock(),
        )
    }

    /// A client's server becomes pinned: counted, unless `max_pinned_fraction` of pool_size
    /// (rounded up) is pinned already: then that bound, and nothing is counted. One atomic
    /// per pin, none per transaction.
    pub fn pin(&self) -> Result<(), usize> {
        let settings = self.settings.load();
        let bound = (settings.pool_size as f64 * settings.max_pinned_fraction).ceil() as usize;
        self.pinned
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| {
                (n < bound).then_some(n + 1)
            })
            .map(|_| ())
            .map_err(|_| bound)
    }

    /// A server pinned past [`Pool::pin`]'s bound by what could not be foreseen before it
    /// ran (see `Session::probe_touched_state`): counted all the same.
    pub fn pin_over_bound(&self) {
        self.pinned.fetch_add(1, Ordering::Relaxed);
    }

    /// A server counted by [`Pool::pin`] is no longer pinned (its client unpinned, or left).
    pub fn unpin(&self) {
        self.pinned.fetch_sub(1, Ordering::Relaxed);
        self.pin_freed.notify_waiters();
    }

    /// [`Pool::pin`], waiting for a slot when `max_pinned_fraction` of the pool is pinned
    /// already, as a client waits for a server: until another client unpins or leaves, or
    /// `query_wait_timeout` (the error then: [`CheckoutError::WaitTimeout`]). A kill
    /// (`killed`) ends the wait too, as [`CheckoutError::Stopped`].
    pub async fn wait_to_pin(&self, killed: &AtomicBool) -> Result<(), CheckoutError> {
        let timeout = self.settings.load().query_wait_timeout;
        let deadline = std::time::Instant::now() + timeout;
        loop {
            // Registered before the try: a slot freed between the two still wakes it.
            let freed = self.pin_freed.notified();
            tokio::pin!(freed);
            freed.as_mut().enable();
            if self.pin().is_ok() {
                return Ok(());
            }
            if killed.load(Ordering::Relaxed) {
                return Err(CheckoutError::Stopped);
            }
            // Tried again each second as well: a reload may raise the bound, and a kill sets
            // a flag without waking this wait.
            let next = deadline.min(std::time::Instant::now() + Duration::from_secs(1));
            tokio::select! {
                () = &mut freed => {}
                () = crate::timer::sleep_until(next) => {
                    if std::time::Instant::now() >= deadline {
                        return Err(CheckoutError::WaitTimeout(timeout));
                    }
                }
            }
        }
    }

    /// Servers held by pinned clients, for SHOW POOLS and the metrics.
    pub fn pinned_servers(&self) -> usize {
        self.pinned.load(Ordering::Relaxed)
    }

    pub fn servers(&self) -> Vec<Arc<ServerInfo>> {
        self.servers.lock().values().cloned().collect()
    }

    /// The database's functions that may set custom settings, as last read.
    #[inline]
    pub fn setting_functions(
        &self,
    ) -> arc_swap::Guard<Option<Arc<crate::query::facts::SettingFunctions>>> {
        self.setting_functions.load()
    }

    /// Whether the setting functions are due to be read (never read, or read over
    /// [`SETTING_FUNCTIONS_TTL_MS`] ago): the caller reads them
    /// and [`Pool::set_setting_functions`]. Claims the read, so one session does it.
    pub fn setting_functions_due(&self) -> bool {
        let read = self.setting_functions_read.load(Ordering::Relaxed);
        let now = self.created.elapsed().as_millis() as u64 + 1;
        (read == 0 || now.saturating_sub(read) > SETTING_FUNCTIONS_TTL_MS)
            && self
                .setting_functions_read
                .compare_exchange(read, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
    }

    /// Whether the setting functions were never read; claims the first read (logins read
    /// them only then: later they are read again at the session-state probes, see
    /// [`Pool::setting_functions_due`]).
    pub fn setting_functions_unread(&self) -> bool {
        let now = self.created.elapsed().as_millis() as u64 + 1;
        self.setting_functions_read
            .compare_exchange(0, now, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
    }

    /// Whether the pool's servers begin READ COMMITTED transactions by default (None: not
    /// read yet).
    #[inline]
    pub fn read_committed_default(&self) -> Option<bool> {
        match self.isolation_default.load(Ordering::Relaxed) {
            ISOLATION_READ_COMMITTED => Some(true),
            ISOLATION_OTHER => Some(false),
            _ => None,
        }
    }

    /// Records the servers' `default_transaction_isolation` (its reset value), read with the
    /// setting functions; None: it could not be read.
    pub fn set_isolation_default(&self, value: Option<&str>) {
        let known = match value {
            Some("read committed") => ISOLATION_READ_COMMITTED,
            Some(_) => ISOLATION_OTHER,
            None => ISOLATION_UNKNOWN,
        };
        self.isolation_default.store(known, Ordering::Relaxed);
    }

    pub fn set_setting_functions(&self, names: Box<[Box<str>]>) {
        let generation = self.setting_functions_generation.load(Ordering::Relaxed) + 1;
        self.setting_functions
            .store(Some(Arc::new(crate::query::facts::SettingFunctions {
                generation,
                names,
            })));
        self.setting_functions_generation
            .store(generation, Ordering::Release);
    }

    /// Changes whenever [`Pool::setting_functions`] does.
    #[inline]
    pub fn setting_functions_generation(&self) -> u32 {
        self.setting_functions_generation.load(Ordering::Acquire)
    }

    pub fn defaults(&self) -> Option<Vars> {
        self.defaults.lock().clone()
    }

    /// The shared copy of `vars` when another client has the same reported parameters (a
    /// client that later changes one gets its own copy: `Arc::make_mut`).
    pub fn share_reported(&self, vars: Arc<Vars>) -> Arc<Vars> {
        let mut sets = self.reported_sets.lock();
        if let Some(shared) = sets.iter().find(|s| **s == vars) {
            return shared.clone();
        }
        if sets.len() < MAX_SHARED_REPORTED_SETS {
            sets.push(vars.clone());
        }
        vars
    }

    pub fn normalized(&self, name: &str, raw: &str) -> Option<String> {
        self.normalized
            .lock()
            .get(&(name.to_ascii_lowercase(), raw.to_owned()))
            .cloned()
    }

    pub fn remember_normalized(&self, name: &str, raw: &str, value: &str) {
        let mut map = self.normalized.lock();
        // Bounded: a client sending endless distinct values must not grow memory.
        if map.len() < 10_000 {
            map.insert(
                (name.to_ascii_lowercase(), raw.to_owned()),
                value.to_owned(),
            );
        }
    }
}

/// What the database's and user's budgets ask of a pool (see budget.rs).
impl Member for Pool {
    fn dispatch(&self) {
        Pool::dispatch(self);
    }

    fn oldest_idle(&self) -> Option<Moment> {
        self.state.lock().idle.first().map(|c| c.last_used)
    }

    fn evict_idle(&self) -> bool {
        let mut st = self.state.lock();
        if st.idle.is_empty() {
            return false;
        }
        // Idle ones are kept most recently used last.
        let conn = st.idle.remove(0);
        st.total -= 1;
        drop(st);
        tracing::debug!(pool = ?self.key, "closing an idle server for another pool's client");
        self.close_counted(conn);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Queues clients of the given workers; their receivers, in queue order.
    fn queue(st: &mut PoolState, workers: &[u16]) -> Vec<oneshot::Receiver<Grant>> {
        workers
            .iter()
            .map(|&worker| {
                let (grant, rx) = oneshot::channel();
                st.waiters.push_back(Waiter {
                    grant,
                    worker,
                    passed: 0,
                });
                rx
            })
            .collect()
    }

    /// Which queued client (by queue position) the next server of worker `home` goes to.
    fn serve(st: &mut PoolState, rxs: &mut [oneshot::Receiver<Grant>], home: u16) -> usize {
        let w = st.next_waiter(home).expect("a waiter");
        assert!(w.grant.send(Grant::Slot).is_ok());
        rxs.iter_mut()
            .position(|rx| rx.try_recv().is_ok())
            .expect("one client got it")
    }

    #[test]
    fn one_worker_serves_first_come_first_served() {
        let mut st = PoolState::default();
        let mut rxs = queue(&mut st, &[0, 0, 0]);
        let order: Vec<usize> = (0..3).map(|_| serve(&mut st, &mut rxs, 0)).collect();
        assert_eq!(order, [0, 1, 2]);
    }

    #[test]
    fn a_client_of_another_worker_is_passed_at_most_max_passed_times() {
        let mut st = PoolState::default();
        // The oldest client is on worker 1; every server comes back on worker 0.
        let mut workers = vec![0; MAX_PASSED as usize + 2];
        workers[0] = 1;
        let mut rxs = queue(&mut st, &workers);
        let order: Vec<usize> = (0..=MAX_PASSED as usize)
            .map(|_| serve(&mut st, &mut rxs, 0))
            .collect();
        let mut expected: Vec<usize> = (1..=MAX_PASSED as usize).collect();
        expected.push(0);
        assert_eq!(
            order, expected,
            "worker 0's clients first, then the one passed over"
        );
        // A server of worker 1 goes to worker 1's client even behind others.
        let mut st = PoolState::default();
        let mut rxs = queue(&mut st, &[0, 0, 1]);
        assert_eq!(serve(&mut st, &mut rxs, 1), 2);
        assert_eq!(
            serve(&mut st, &mut rxs, 1),
            0,
            "none of worker 1 left: the oldest"
        );
    }
}
