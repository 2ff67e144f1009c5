//! Invalidation from the WAL: with `cache.invalidation = "wal"`, pgmemo follows each cached
//! database's logical replication stream, so that a write made by anyone (another
//! application, a cron job, a migration, a trigger, another pgmemo) invalidates the cached
//! results that read the table it wrote, once its commit is decoded.
//!
//! One [`Follower`] per server database whose results are looked up in the cache, started at
//! the first lookup: a replication connection (`replication=database`), the publication
//! (`FOR ALL TABLES`, made by pgmemo when it may), a temporary slot (no WAL is kept once pgmemo
//! is gone), `pgoutput`. At each Commit the versions of the tables the transaction wrote are
//! bumped (a partition's ancestors too), and the versions of the rows its changes show by
//! their keys (see `cache::rows`: a table whose rows are named keeps its point reads of other
//! rows); a Relation whose columns changed bumps the catalog.
//!
//! Never stale without saying so: until the follower has caught up with the server's WAL
//! position of its start, the database's results are not served; when the stream drops, the
//! database's entries are flushed and caching stays off for it until the stream is back and
//! caught up again. A commit is decoded before other sessions can see it: what it wrote is
//! stale at once, but nothing read of it is stored until the server shows the commit visible
//! (see [`visibility`]).

pub mod fleet;
pub mod pgoutput;
pub mod replication;
pub mod test_decoding;
pub mod visibility;

use crate::cache::catalog::Snapshot;
use crate::cache::{FlushTarget, ResultCache};
use crate::config::cache::WalPlugin;
use crate::protocol::backend;
use crate::server::{ServerConn, ServerError, ServerTarget};
use parking_lot::Mutex;
use std::collections::{HashMap, HashSet};
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

/// A WAL position.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord)]
pub struct Lsn(pub u64);

impl fmt::Display for Lsn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:X}/{:X}", self.0 >> 32, self.0 & 0xffff_ffff)
    }
}

impl std::str::FromStr for Lsn {
    type Err = ();

    /// PostgreSQL's `X/Y` (hexadecimal halves).
    fn from_str(s: &str) -> Result<Lsn, ()> {
        let (hi, lo) = s.split_once('/').ok_or(())?;
        let hi = u64::from_str_radix(hi, 16).map_err(|_| ())?;
        let lo = u64::from_str_radix(lo, 16).map_err(|_| ())?;
        if hi > u32::MAX as u64 || lo > u32::MAX as u64 {
            return Err(());
        }
        Ok(Lsn(hi << 32 | lo))
    }
}

/// Where a follower is, for SHOW CACHE.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Phase {
    Connecting,
    /// Streaming, not yet at the server's WAL position of the start: not served.
    CatchingUp,
    Streaming,
    /// The last attempt failed (the reason, saying what to change); retried.
    Failed(String),
}

/// The stream of one server database.
pub struct Follower {
    /// The server database ([`crate::server::ServerTarget::database_id`], the cache's
    /// `database`).
    pub database: Box<str>,
    /// Its name on the server, as SHOW CACHE WAL prints it.
    pub name: Box<str>,
    /// The database's cached results may be served.
    ready: AtomicBool,
    /// Everything up to here is applied (versions bumped, the commits visible on the
    /// server: see [`visibility`]).
    applied: AtomicU64,
    /// The position to reach before the database's results are served (this stream's).
    catch_up: AtomicU64,
    /// Commits decoded and not yet seen, and the positions reached.
    progress: visibility::Progress,
    /// With the shared tier: primary positions past every commit inserted before each was
    /// asked (see [`read_positions`], [`Follower::covering_after`]).
    covering: crate::lsn::Covering,
    /// With `target_session_attrs` `read-write` or `primary`: the hosts' primary (see
    /// [`crate::primary`]), and the place of the host this stream comes from. A stream
    /// from another host than the primary's is not served from, and starts again.
    primary: Option<Arc<crate::primary::Primary>>,
    host: std::sync::atomic::AtomicUsize,
    /// The slot of the last stream: a stream cut by the network may leave it held by its
    /// walsender until the server notices; the next stream ends that walsender (and the
    /// temporary slot goes with it).
    last_slot: Mutex<Option<String>>,
    /// When (milliseconds on [`clock_ms`]) the follower last knew it had applied everything
    /// the server had written: what `cache.max_lag` is measured from.
    confirmed_ms: AtomicU64,
    phase: Mutex<Phase>,
    /// Its part in a fleet (see [`fleet`]), as SHOW CACHE WAL shows it.
    role: Mutex<fleet::Part>,
    lags: Mutex<crate::stats::Samples>,
    /// Commits applied, connections made.
    pub commits: AtomicU64,
    pub connects: AtomicU64,
    /// Set by [`Wal::stop`]: the follower closes its connections and ends.
    stop: tokio::sync::watch::Sender<bool>,
    /// Set when the follower has ended, its connections closed.
    ended: tokio::sync::watch::Sender<bool>,
}

/// What SHOW CACHE prints of a follower.
pub struct FollowerStatus {
    pub database: String,
    pub phase: String,
    /// "own", or its part in the fleet's decoding.
    pub decoder: String,
    pub applied: Lsn,
    pub commits: u64,
    pub connects: u64,
    /// Invalidation lag p50 / p99, microseconds.
    pub lag_us: Option<(u64, u64)>,
}

impl Follower {
    /// The follower of the server database `database` (named `name` there), not started;
    /// `primary`: the hosts' primary it must stream from, when it must.
    fn new(database: &str, name: &str, primary: Option<Arc<crate::primary::Primary>>) -> Follower {
        Follower {
            database: database.into(),
            name: name.into(),
            ready: AtomicBool::new(false),
            applied: AtomicU64::new(0),
            catch_up: AtomicU64::new(u64::MAX),
            progress: visibility::Progress::default(),
            covering: Default::default(),
            primary,
            host: std::sync::atomic::AtomicUsize::new(0),
            last_slot: Mutex::new(None),
            confirmed_ms: AtomicU64::new(0),
            phase: Mutex::new(Phase::Connecting),
            role: Mutex::new(fleet::Part::Own),
            lags: Mutex::new(crate::stats::Samples::default()),
            commits: AtomicU64::new(0),
            connects: AtomicU64::new(0),
            stop: tokio::sync::watch::Sender::new(false),
            ended: tokio::sync::watch::Sender::new(false),
        }
    }

    /// Whether the database's cached results may be served.
    #[inline]
    pub fn is_ready(&self) -> bool {
        self.ready.load(Relaxed) && self.on_primary()
    }

    /// Whether the stream comes from the primary as far as pgmemo knows (a reader of the
    /// fleet's stream, [`NO_HOST`], follows its leader's).
    #[inline]
    fn on_primary(&self) -> bool {
        let host = self.host.load(Relaxed);
        host == NO_HOST || self.primary.as_ref().is_none_or(|p| p.is_at(host))
    }

    /// Whether it decodes for the fleet (see [`fleet`]).
    pub fn leads(&self) -> bool {
        matches!(*self.role.lock(), fleet::Part::Leader(_))
    }

    fn set_role(&self, role: fleet::Part) {
        *self.role.lock() = role;
    }

    /// Whether it has applied everything its server had written when last told.
    fn confirmed_now(&self) -> bool {
        let (applied, server_end) = self.progress.applied();
        applied >= server_end
    }

    pub fn applied(&self) -> Lsn {
        Lsn(self.applied.load(Relaxed))
    }

    pub fn status(&self) -> FollowerStatus {
        let phase = match &*self.phase.lock() {
            Phase::Connecting => "connecting".to_string(),
            Phase::CatchingUp => "catching up".to_string(),
            Phase::Streaming => "streaming".to_string(),
            Phase::Failed(why) => format!("failed: {why}"),
        };
        FollowerStatus {
            database: self.name.to_string(),
            phase,
            decoder: self.role.lock().to_string(),
            applied: self.applied(),
            commits: self.commits.load(Relaxed),
            connects: self.connects.load(Relaxed),
            lag_us: self.lags.lock().percentiles(),
        }
    }

    /// A commit made at `timestamp` (microseconds since 2000-01-01) was applied.
    fn committed(&self, timestamp: Option<i64>) {
        self.commits.fetch_add(1, Relaxed);
        if let Some(at) = timestamp {
            let lag = (replication::pg_now() - at).max(0) as u64;
            self.lags.lock().add(lag);
        }
    }

    fn set_phase(&self, phase: Phase) {
        *self.phase.lock() = phase;
    }

    /// Publishes the applied position ([`visibility::Progress::applied`]): once it reaches
    /// the server's end of WAL the follower knew itself caught up now, once it reaches the
    /// stream's start the database's results may be served (and its version is marked
    /// bumped then: what committed before the stream started bumped nothing, and a fill on
    /// a replica must see it, see [`crate::cache::versions::Versions::last_bumped`]).
    fn publish(&self, versions: &crate::cache::versions::Versions) {
        let (applied, server_end) = self.progress.applied();
        self.applied.store(applied.0, Relaxed);
        if applied >= server_end {
            self.confirmed_ms.store(clock_ms(), Relaxed);
        }
        if !self.is_ready() && applied.0 >= self.catch_up.load(Relaxed) {
            versions.mark_bumped(
                versions.database_slot(&self.database),
                crate::clock::Moment::now(),
            );
            self.serve("caught up");
        }
    }

    /// Serves the database's results from now on (`how` it knows its writes, for the log).
    fn serve(&self, how: &str) {
        self.ready.store(true, Relaxed);
        self.set_phase(Phase::Streaming);
        tracing::info!(database = %self.database, applied = %self.applied(), "WAL invalidation: {how}; caching on");
    }

    /// A position of the primary's WAL past every commit this instance knew of at `at` (a
    /// bump's time, see [`crate::cache::versions::Versions::last_bumped`]): the first the
    /// follower read after it (None: none yet, or no shared tier).
    pub fn covering_after(&self, at: crate::clock::Moment) -> Option<u64> {
        self.covering.after(at)
    }

    /// The stream ended: what it guarded is flushed, then its commits not yet seen are let
    /// go (nothing stored before the flush is served after it).
    fn end_stream(&self, cache: &ResultCache) {
        self.ready.store(false, Relaxed);
        self.covering.clear();
        self.catch_up.store(u64::MAX, Relaxed);
        cache.flush(FlushTarget::Database(&self.database));
        self.progress.settle_all(&cache.versions);
    }
}

/// The host of a follower that reads the fleet's stream (see [`Follower::on_primary`]).
const NO_HOST: usize = usize::MAX;

/// Milliseconds since the first call: a cheap monotonic clock for `max_lag`.
fn clock_ms() -> u64 {
    static START: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    START
        .get_or_init(std::time::Instant::now)
        .elapsed()
        .as_millis() as u64
}

/// Every follower of the process.
#[derive(Default)]
pub struct Wal {
    /// By database. Hashed by foldhash: every cache lookup with WAL invalidation finds its
    /// database's follower here, and std's SipHash cost ~135 instructions a hit.
    followers: papaya::HashMap<Box<str>, Arc<Follower>, foldhash::fast::RandomState>,
    /// With the shared tier and one decoder for the fleet (see [`fleet`]).
    fleet: std::sync::OnceLock<Arc<fleet::Fleet>>,
}

/// How a follower connects and what it may do there.
#[derive(Clone)]
pub struct Setup {
    /// The pool's server connection settings, logging in as `cache.replication_user` or
    /// pgmemo's own role (`crate::app::App::wal_login`).
    pub target: ServerTarget,
    pub plugin: WalPlugin,
    /// pgoutput's publication, and whether pgmemo may create it.
    pub publication: String,
    pub create_publication: bool,
    /// pgmemo is shutting down: the follower closes its connections (its temporary slot goes
    /// with them).
    pub shutdown: tokio::sync::watch::Receiver<bool>,
    /// The result cache has a shared tier: the follower also reads the primary's position
    /// every [`POSITIONS_EVERY`] (see [`read_positions`]).
    pub positions: bool,
}

impl Wal {
    /// With `[cache.shared]` and `decoder = "one"`: the fleet shares one decoder per
    /// database (see [`fleet`]).
    pub fn start_fleet(&self, cache: &ResultCache, config: &crate::config::cache::CacheConfig) {
        let (Some(tier), Some(shared)) = (&config.shared, cache.shared()) else {
            return;
        };
        if tier.decoder == crate::config::cache::Decoder::One {
            let fleet = fleet::Fleet::new(shared, tier, cache.versions.row_versions());
            let _ = self.fleet.set(Arc::new(fleet));
        }
    }

    /// The follower of `setup`'s database, started if there is none; whether its cached
    /// results may be served now: it is caught up and, with `max_lag`, knew itself caught up
    /// at most that long ago.
    pub fn ready(
        &self,
        cache: &Arc<ResultCache>,
        setup: impl FnOnce() -> Setup,
        database: &str,
        max_lag: Option<Duration>,
    ) -> bool {
        let followers = self.followers.pin();
        if let Some(f) = followers.get(database) {
            return f.is_ready()
                && max_lag.is_none_or(|max| {
                    clock_ms().saturating_sub(f.confirmed_ms.load(Relaxed))
                        <= max.as_millis() as u64
                });
        }
        drop(followers);
        self.start_following(cache, setup, database);
        false
    }

    /// Starts following `database` (no follower of it is in the map). Out of line: the
    /// follower's task, built here before it is spawned, is tens of kilobytes, and a caller
    /// it is inlined into probes that much stack on every call (~70 instructions a cache
    /// hit, in [`Wal::ready`]'s caller).
    #[cold]
    #[inline(never)]
    fn start_following(
        &self,
        cache: &Arc<ResultCache>,
        setup: impl FnOnce() -> Setup,
        database: &str,
    ) {
        let setup = setup();
        let follower = Arc::new(Follower::new(
            database,
            setup.target.dbname.as_str(),
            setup.target.followed_primary(),
        ));
        if self
            .followers
            .pin()
            .try_insert(database.into(), follower.clone())
            .is_ok()
        {
            let fleet = self.fleet.get().cloned();
            tokio::spawn(follow(follower, cache.clone(), setup, fleet));
        }
    }

    /// Stops the follower of `database`, if there is one: a client's statement needs the
    /// database to itself (`DROP DATABASE` and the like, see [`crate::vacate`]), which
    /// PostgreSQL refuses while another session is connected to it, and `DROP DATABASE` while
    /// a replication slot of it is in use. The follower closes its connections (its temporary
    /// slot goes with the replication connection); the receiver tells when they are gone.
    /// Nothing of the database is served meanwhile, and its next lookup starts a new
    /// follower (of a new database of that name, perhaps). The caller flushes what the
    /// follower guarded: writes made before the new one starts are never seen.
    pub fn stop(&self, database: &str) -> Option<tokio::sync::watch::Receiver<bool>> {
        let follower = self.followers.pin().remove(database).cloned()?;
        follower.ready.store(false, Relaxed);
        let ended = follower.ended.subscribe();
        follower.stop.send_replace(true);
        Some(ended)
    }

    /// The follower of the server database `database`, once started.
    pub fn follower(&self, database: &str) -> Option<Arc<Follower>> {
        self.followers.pin().get(database).cloned()
    }

    pub fn followers(&self) -> Vec<Arc<Follower>> {
        let mut v: Vec<_> = self.followers.pin().values().cloned().collect();
        v.sort_by(|a, b| (&a.name, &a.database).cmp(&(&b.name, &b.database)));
        v
    }
}

/// How long a stopped follower waits for the server to close its connections (see
/// [`Wal::stop`]).
const STOP_WAIT: Duration = Duration::from_secs(5);

/// The connections of a follower's replication session, kept outside its future so that a
/// stop ([`Wal::stop`]) can end them and wait until the server closed them.
#[derive(Default)]
struct Connections {
    replication: Option<ServerConn>,
    /// The ordinary connection that reads the catalog (see [`ancestors`]).
    catalog: Option<ServerConn>,
    /// The ordinary connection that asks which commits are visible (see [`settle_seen`]).
    visibility: Option<ServerConn>,
    /// The ordinary connection that reads the primary's position (see [`read_positions`]).
    positions: Option<ServerConn>,
}

impl Connections {
    /// Ends both connections and waits, at most `within`, until the server closed them.
    async fn close(&mut self, within: Duration) {
        let end = |conn: Option<ServerConn>| async move {
            if let Some(conn) = conn {
                conn.terminate_and_wait(within).await;
            }
        };
        tokio::join!(
            end(self.replication.take()),
            end(self.catalog.take()),
            end(self.visibility.take()),
            end(self.positions.take()),
        );
    }
}

/// Marks its follower ended when dropped: when [`follow`] returns, or its task is dropped.
struct Ending<'a>(&'a Follower);

impl Drop for Ending<'_> {
    fn drop(&mut self) {
        self.0.ended.send_replace(true);
    }
}

/// Follows one database for the life of the process, or until it is stopped ([`Wal::stop`]):
/// takes its part (its own stream, or in a fleet the leader's or a reader's, see [`fleet`]),
/// and after a failure flushes what the part guarded and tries again.
async fn follow(
    follower: Arc<Follower>,
    cache: Arc<ResultCache>,
    setup: Setup,
    fleet: Option<Arc<fleet::Fleet>>,
) {
    let _ending = Ending(&follower);
    let mut backoff = Duration::from_millis(500);
    let mut shutdown = setup.shutdown.clone();
    let mut stopping = follower.stop.subscribe();
    let mut conns = Connections::default();
    loop {
        follower.set_phase(Phase::Connecting);
        follower.connects.fetch_add(1, Relaxed);
        let role = match &fleet {
            Some(fleet) => fleet.role(&follower.database).await,
            None => fleet::Role::Own,
        };
        // Decided in the select, acted on after it: what a branch's wait returns is kept
        // until the select ends.
        let moved = async {
            match &follower.primary {
                Some(primary) => primary.moved().await,
                None => std::future::pending().await,
            }
        };
        let part = take_part(
            &follower,
            &cache,
            &setup,
            &mut conns,
            fleet.as_deref(),
            role,
        );
        let outcome = tokio::select! {
            outcome = part => Some(outcome),
            _ = moved => Some(Err(MOVED.to_string())),
            _ = shutdown.wait_for(|stop| *stop) => Some(Err(SHUTDOWN.to_string())),
            _ = stopping.wait_for(|stop| *stop) => None,
        };
        if matches!(&outcome, Some(Err(why)) if why == SHUTDOWN) {
            follower.end_stream(&cache);
            if let Some(fleet) = fleet.as_deref().filter(|_| follower.leads()) {
                // Another instance takes over at once, not when the lease lapses.
                fleet.let_go(&follower.database).await;
            }
            return;
        }
        // Writes from here on may be missed: nothing is served until the stream is back.
        follower.end_stream(&cache);
        let Some(outcome) = outcome else {
            conns.close(STOP_WAIT).await;
            return;
        };
        // The failed session's connections go (as they are: the stream is broken).
        conns = Connections::default();
        let why = match outcome {
            Ok(()) => "the server ended the replication stream".to_string(),
            Err(e) => e,
        };
        tracing::warn!(database = %follower.database, "WAL invalidation: {why}; caching is off for this database until the stream is back");
        if why == MOVED || why.starts_with(fleet::HANDOVER) {
            // Not a failure: the new primary's stream, or the fleet's new part, starts now.
            backoff = Duration::from_millis(500);
            continue;
        }
        follower.set_phase(Phase::Failed(why));
        tokio::select! {
            _ = crate::timer::sleep(backoff) => {}
            _ = shutdown.wait_for(|stop| *stop) => return,
            _ = stopping.wait_for(|stop| *stop) => return,
        }
        backoff = (backoff * 2).min(Duration::from_secs(30));
    }
}

/// Plays `role` for the follower's database until it ends (an error says why; Ok: the
/// server ended the stream).
async fn take_part(
    follower: &Follower,
    cache: &ResultCache,
    setup: &Setup,
    conns: &mut Connections,
    fleet: Option<&fleet::Fleet>,
    role: fleet::Role,
) -> Result<(), String> {
    let Some(fleet) = fleet else {
        follower.set_role(fleet::Part::Own);
        return stream(follower, cache, setup, conns, false).await;
    };
    match role {
        fleet::Role::Leader(conn) => {
            let mut release = conn.clone();
            let outcome = tokio::select! {
                outcome = stream(follower, cache, setup, conns, true) => outcome,
                outcome = fleet.lead(follower, conn) => outcome,
            };
            fleet.release(&mut release, &follower.database).await;
            outcome
        }
        fleet::Role::Reader(conn) => {
            follower.host.store(NO_HOST, Relaxed);
            let Connections { positions, .. } = conns;
            tokio::select! {
                outcome = fleet.read(follower, cache, conn) => {
                    outcome.and(Err(format!("{}: the lease is free", fleet::HANDOVER)))
                }
                outcome = read_positions(positions, follower, setup) => outcome,
            }
        }
        fleet::Role::Own => {
            follower.set_role(fleet::Part::Unreachable);
            let own = async {
                if fleet.follows_without_valkey() {
                    stream(follower, cache, setup, conns, false).await
                } else {
                    follower.set_phase(Phase::Failed(
                        "Valkey unreachable (cache.shared.without_valkey = \"no_caching\")".into(),
                    ));
                    std::future::pending().await
                }
            };
            tokio::select! {
                outcome = own => outcome,
                _ = fleet.answers_again() => Err(format!("{}: Valkey answers again", fleet::HANDOVER)),
            }
        }
    }
}

/// A stream the server has not answered for this long (it answers a keepalive asked every
/// 500 ms at once) is not served from until it is heard again; for [`SILENT_LIMIT`], it is
/// given up and started again (a network cut leaves a TCP connection open for minutes).
const SILENT_UNSERVED: Duration = Duration::from_secs(2);
const SILENT_LIMIT: Duration = Duration::from_secs(15);

/// Why a part ends when pgmemo shuts down.
const SHUTDOWN: &str = "pgmemo is shutting down";

/// Why a stream ends when the primary moved (see [`crate::primary`]).
const MOVED: &str = "the primary moved to another host";

/// Sends a replication command (or query) and reads its replies up to ReadyForQuery, or up to
/// CopyBothResponse for START_REPLICATION.
async fn command(conn: &mut ServerConn, sql: &str) -> Result<Vec<Vec<Option<String>>>, String> {
    conn.internal_query(sql).await.map_err(|e| describe(&e))
}

fn describe(e: &ServerError) -> String {
    match e {
        ServerError::Server { fields, .. } => format!("{} ({})", fields.message, fields.code),
        other => other.to_string(),
    }
}

/// One replication session: set up, catch up, stream until it fails. Its connections are
/// kept in `conns`. `publishing`: the follower leads a fleet (see [`fleet`]).
async fn stream(
    follower: &Follower,
    cache: &ResultCache,
    setup: &Setup,
    conns: &mut Connections,
    publishing: bool,
) -> Result<(), String> {
    let start = start_streaming(follower, setup, &mut conns.replication).await?;
    let conn = conns
        .replication
        .as_mut()
        .ok_or("no replication connection")?;
    follower.set_phase(Phase::CatchingUp);
    follower.catch_up.store(start.0, Relaxed);
    tokio::select! {
        outcome = apply_stream(conn, &mut conns.catalog, follower, cache, (setup, publishing)) => outcome,
        outcome = settle_seen(&mut conns.visibility, follower, cache, setup) => outcome,
        outcome = read_positions(&mut conns.positions, follower, setup) => outcome,
    }
}

/// How often the follower reads the primary's position for the shared tier.
pub const POSITIONS_EVERY: Duration = Duration::from_millis(100);

/// With the shared tier (`setup.positions`), every [`POSITIONS_EVERY`]: a position of the
/// primary past every commit inserted before the question was sent, on an ordinary
/// connection of its own (see [`Follower::covering_after`]). Returns only when that
/// connection fails: the stream then starts again (and the positions are forgotten).
async fn read_positions(
    conn: &mut Option<ServerConn>,
    follower: &Follower,
    setup: &Setup,
) -> Result<(), String> {
    if !setup.positions {
        return std::future::pending().await;
    }
    let mut tick = crate::timer::Ticker::every(POSITIONS_EVERY);
    loop {
        tick.tick().await;
        let asking = ordinary(conn, setup, "read positions").await?;
        let sent = crate::clock::Moment::now();
        let rows = command(asking, crate::lsn::COMMIT_POSITION_SQL).await?;
        follower.covering.note_answer(sent, &rows);
    }
}

/// One of the follower's ordinary connections, `conn`, made when there is none or it broke
/// (`what` it is for names it in the error).
async fn ordinary<'a>(
    conn: &'a mut Option<ServerConn>,
    setup: &Setup,
    what: &str,
) -> Result<&'a mut ServerConn, String> {
    if conn.as_ref().is_none_or(|c| c.broken) {
        *conn = Some(
            ServerConn::connect(&setup.target)
                .await
                .map_err(|e| format!("connecting to {what}: {}", describe(&e)))?,
        );
    }
    conn.as_mut()
        .ok_or_else(|| format!("no connection to {what}"))
}

/// How soon the server is asked again whether the commits decoded are visible: at once for
/// the first commit after a quiet spell, then at most every [`FIRST_ASK`] while commits keep
/// coming (one question settles all those decoded before it: at 1,000 commits/s, about 500
/// questions instead of 1,000, measured with `bench/wal.py`), doubling up to [`LAST_ASK`]
/// while none becomes visible (a synchronous standby holding them). How long rows just
/// written go uncached, never what is served.
const FIRST_ASK: Duration = Duration::from_millis(2);
const LAST_ASK: Duration = Duration::from_millis(16);

/// Settles the follower's decoded commits as the server shows them visible (see
/// [`visibility`]), asking on an ordinary connection of its own. Returns only when that
/// connection fails: the stream then starts again.
async fn settle_seen(
    conn: &mut Option<ServerConn>,
    follower: &Follower,
    cache: &ResultCache,
    setup: &Setup,
) -> Result<(), String> {
    let progress = &follower.progress;
    let mut wait = FIRST_ASK;
    loop {
        if progress.is_settled() {
            progress.decoded_commit.notified().await;
            wait = FIRST_ASK;
            continue;
        }
        let asking = ordinary(conn, setup, "see commits").await?;
        let rows = command(asking, "SELECT pg_catalog.pg_current_snapshot()::text").await?;
        let snapshot = rows
            .first()
            .and_then(|r| r.first().cloned().flatten())
            .and_then(|text| visibility::ServerSnapshot::parse(&text))
            .ok_or("pg_current_snapshot() gave no snapshot")?;
        if progress.settle_shown(&cache.versions, &snapshot) > 0 {
            progress.seen_commit.notify_one();
            follower.publish(&cache.versions);
            wait = FIRST_ASK;
        } else {
            wait = (wait * 2).min(LAST_ASK);
        }
        // Commits decoded meanwhile wait for the next question (a notice of one already
        // settled only makes the loop look again).
        crate::timer::sleep(wait).await;
    }
}

/// A replication slot name no other follower uses: slot names are per server, not per
/// database, and two pgmemo processes may have the same process ID (each one pid 1 in its
/// container). The process's ID, a random word drawn once per process, and a count of the
/// slots it made; 40 characters at most (PostgreSQL allows 63).
fn slot_name() -> String {
    static PROCESS_WORD: std::sync::OnceLock<u32> = std::sync::OnceLock::new();
    static SLOTS: AtomicU64 = AtomicU64::new(0);
    format!(
        "pgmemo_{}_{:08x}_{}",
        std::process::id(),
        PROCESS_WORD.get_or_init(rand::random),
        SLOTS.fetch_add(1, Relaxed)
    )
}

/// Sets a replication session up: a replication connection (kept in `held`), its checks
/// (wal_level, the publication), a temporary slot, START_REPLICATION. The end of WAL to catch
/// up with before anything is served.
async fn start_streaming(
    follower: &Follower,
    setup: &Setup,
    held: &mut Option<ServerConn>,
) -> Result<Lsn, String> {
    let conn = held.insert(connect_replication(&setup.target).await?);
    follower.host.store(conn.info.host_index, Relaxed);
    let last = follower.last_slot.lock().take();
    if let Some(last) = last {
        // Held still by a walsender the server has not yet found cut off (best effort: the
        // server ends it at wal_sender_timeout anyway).
        let _ = command(
            conn,
            &format!(
                "SELECT pg_catalog.pg_terminate_backend(active_pid) \
                 FROM pg_catalog.pg_replication_slots \
                 WHERE slot_name = {} AND active_pid IS NOT NULL",
                crate::params::quote_literal(&last)
            ),
        )
        .await;
    }
    let wal_level = command(conn, "SHOW wal_level").await?;
    let level = wal_level
        .first()
        .and_then(|r| r.first().cloned().flatten())
        .unwrap_or_default();
    if level != "logical" {
        return Err(format!(
            "wal_level is {level}: set wal_level = logical in postgresql.conf and restart PostgreSQL"
        ));
    }
    if setup.plugin == WalPlugin::Pgoutput {
        ensure_publication(conn, setup).await?;
    }
    // The position to catch up with before anything is served.
    let identity = command(conn, "IDENTIFY_SYSTEM").await?;
    let start: Lsn = identity
        .first()
        .and_then(|r| r.get(2).cloned().flatten())
        .and_then(|s| s.parse().ok())
        .ok_or("IDENTIFY_SYSTEM gave no WAL position")?;
    let slot = slot_name();
    let options = create_slot(conn, &slot, setup).await?;
    *follower.last_slot.lock() = Some(slot.clone());
    crate::protocol::frontend::query(
        &mut conn.wbuf,
        &format!("START_REPLICATION SLOT {slot} LOGICAL 0/0 {options}"),
    );
    conn.flush().await.map_err(|e| e.to_string())?;
    loop {
        let (tag, body) = conn.read_message().await.map_err(|e| describe(&e))?;
        match tag {
            backend::COPY_BOTH_RESPONSE => break,
            backend::ERROR_RESPONSE => {
                return Err(format!(
                    "START_REPLICATION: {}",
                    describe(&crate::server::server_error(body))
                ))
            }
            _ => {}
        }
    }
    tracing::info!(database = %follower.database, slot, %start, "WAL invalidation: streaming");
    Ok(start)
}

/// A replication connection to `target`, or what the operator must change to get one.
async fn connect_replication(target: &ServerTarget) -> Result<ServerConn, String> {
    ServerConn::connect_with(target, &[("replication", "database")])
        .await
        .map_err(|e| match &e {
            ServerError::Server { fields, .. } if fields.code == "42501" => format!(
                "role \"{}\" may not start a replication connection: give it the REPLICATION \
                 attribute (ALTER ROLE {} REPLICATION) or set cache.replication_user",
                target.user, target.user
            ),
            ServerError::Server { fields, .. } if fields.code == "53300" => format!(
                "{}: raise max_wal_senders (and max_connections) in postgresql.conf",
                fields.message
            ),
            other => format!("replication connection: {}", describe(other)),
        })
}

/// Creates the session's temporary replication slot `slot` for the configured decoder; the
/// decoder's options for START_REPLICATION.
async fn create_slot(conn: &mut ServerConn, slot: &str, setup: &Setup) -> Result<String, String> {
    let (plugin, options) = match setup.plugin {
        WalPlugin::TestDecoding => ("test_decoding", test_decoding::OPTIONS.to_string()),
        WalPlugin::Pgoutput => (
            "pgoutput",
            format!(
                "(proto_version '1', publication_names '{}')",
                // The replication grammar takes plain '...' strings only (no E'...').
                crate::params::quote_name(&setup.publication).replace('\'', "''")
            ),
        ),
    };
    command(
        conn,
        &format!("CREATE_REPLICATION_SLOT {slot} TEMPORARY LOGICAL {plugin} NOEXPORT_SNAPSHOT"),
    )
    .await
    .map_err(|e| {
        if e.contains("53400") {
            format!("{e}: raise max_replication_slots in postgresql.conf")
        } else if e.contains("58P01") {
            format!(
                "{e}: the {plugin} decoder is not installed (test_decoding comes with \
                 PostgreSQL's contrib modules), or set cache.wal_plugin = \"pgoutput\""
            )
        } else {
            format!("creating the replication slot: {e}")
        }
    })?;
    Ok(options)
}

/// Follows the stream: each transaction's writes invalidate what they touched (settled by
/// [`settle_seen`]); positions are confirmed to the server; once applied up to the stream's
/// start the database is caught up and its results may be cached. Returns when the server ends the stream, fails with its error.
/// `catalog`: the connection that reads the catalog, opened when needed; `publishing`: the
/// follower leads a fleet, and each commit seen is published (see [`fleet`]).
async fn apply_stream(
    conn: &mut ServerConn,
    catalog: &mut Option<ServerConn>,
    follower: &Follower,
    cache: &ResultCache,
    (setup, publishing): (&Setup, bool),
) -> Result<(), String> {
    let mut state = Decoder {
        publishing,
        ..Decoder::default()
    };
    // With the shared tier, as often as positions are read: the applied position is the
    // one a fill's entry carries there (see `cache::shared`), and while the database is
    // quiet it moves only with the keepalive asked here.
    let status_interval = if setup.positions {
        POSITIONS_EVERY
    } else {
        Duration::from_millis(500)
    };
    // When the server was last heard from (it answers the keepalive asked for each
    // status_interval of silence at once).
    let mut heard = std::time::Instant::now();
    // A status every status_interval, the first at once (a timerfd: no timer in the event
    // loop's wheel while the cache serves hits, see `timer::Ticker`).
    let mut status_due = crate::timer::Ticker::every(status_interval);
    let mut applied = Lsn(0);
    // The server's end of WAL as last reported.
    let mut server_end = Lsn(0);
    loop {
        // `read_message` keeps what it read in the connection's buffer: cancelling it loses
        // nothing.
        let read = tokio::select! {
            m = conn.read_message() => Some(m),
            () = status_due.tick() => None,
        };
        let message = match read {
            Some(m) => m.map_err(|e| describe(&e))?,
            None => {
                if !follower.on_primary() {
                    return Err(MOVED.into());
                }
                let silent = heard.elapsed();
                if silent >= SILENT_LIMIT {
                    return Err(format!(
                        "no word from the server for {} s (a network cut?)",
                        silent.as_secs()
                    ));
                }
                if silent >= SILENT_UNSERVED && follower.ready.swap(false, Relaxed) {
                    // Writes may be going on that it cannot tell: nothing is served until
                    // the server is heard from again (the stream then goes on where it was).
                    tracing::info!(database = %follower.database, "WAL invalidation: the server is silent; not serving until it is heard from");
                }
                // Asks for a keepalive: while no transaction is open, its position is applied.
                replication::status_update(&mut conn.wbuf, applied, true);
                conn.flush().await.map_err(|e| e.to_string())?;
                continue;
            }
        };
        heard = std::time::Instant::now();
        let (tag, body) = message;
        match tag {
            backend::COPY_DATA => {}
            backend::ERROR_RESPONSE => {
                return Err(describe(&crate::server::server_error(body)));
            }
            backend::COPY_DONE => return Ok(()),
            _ => continue,
        }
        let Some(from) = replication::parse(&body) else {
            return Err("malformed replication message".into());
        };
        match from {
            replication::FromServer::XLogData {
                start,
                wal_end,
                data,
            } => {
                server_end = server_end.max(wal_end);
                let done = match setup.plugin {
                    WalPlugin::Pgoutput => {
                        let message = pgoutput::decode(data).map_err(|e| e.to_string())?;
                        state
                            .apply(message, follower, cache, catalog, setup)
                            .await?
                    }
                    WalPlugin::TestDecoding => {
                        let line = test_decoding::decode(data);
                        // A commit's output is sent at its record's end.
                        state
                            .apply_text(line, start, follower, cache, catalog, setup)
                            .await
                    }
                };
                if let Some(end) = done {
                    state.commit_decoded(follower, cache, (applied, end));
                    applied = applied.max(end);
                }
            }
            replication::FromServer::Keepalive { wal_end, reply } => {
                server_end = server_end.max(wal_end);
                if !state.in_transaction {
                    applied = applied.max(wal_end);
                }
                if reply {
                    replication::status_update(&mut conn.wbuf, applied, false);
                    conn.flush().await.map_err(|e| e.to_string())?;
                }
            }
        }
        follower.progress.decoded_to(applied, server_end);
        follower.publish(&cache.versions);
    }
}

/// pgoutput's publication: there, or made (`FOR ALL TABLES`) when pgmemo may. (Such a
/// publication makes PostgreSQL refuse UPDATE and DELETE on tables without a replica identity:
/// see `test_decoding`.)
async fn ensure_publication(conn: &mut ServerConn, setup: &Setup) -> Result<(), String> {
    let publication = &setup.publication;
    let exists = command(
        conn,
        &format!(
            "SELECT 1 FROM pg_catalog.pg_publication WHERE pubname = {}",
            crate::params::quote_literal(publication)
        ),
    )
    .await?;
    if !exists.is_empty() {
        return Ok(());
    }
    if !setup.create_publication {
        return Err(format!(
            "publication \"{publication}\" does not exist: CREATE PUBLICATION \
             \"{publication}\" FOR ALL TABLES, or set cache.create_publication = true"
        ));
    }
    // PostgreSQL 18 refuses UPDATE and DELETE on a table whose replica identity (FULL, or an
    // index) holds a generated column that the publication does not publish, and publishes
    // none by default: published, such tables stay writable as they were without pgmemo.
    let generated = match conn.major_version() {
        Some(major) if major >= 18 => " WITH (publish_generated_columns = stored)",
        _ => "",
    };
    command(
        conn,
        &format!(
            "CREATE PUBLICATION {} FOR ALL TABLES{generated}",
            crate::params::quote_name(publication)
        ),
    )
    .await
    .map_err(|e| {
        format!(
            "could not create publication \"{publication}\" ({e}): create it as a superuser \
             (CREATE PUBLICATION \"{publication}\" FOR ALL TABLES)"
        )
    })?;
    Ok(())
}

/// A relation's columns as pgoutput describes them (name, type OID, type modifier).
type Columns = Vec<(String, u32, i32)>;

/// What the stream has told so far: relations by id (pgoutput) or by name (test_decoding),
/// the open transaction's writes.
#[derive(Default)]
struct Decoder {
    /// Relation id → the names a write to it invalidates (itself, and its ancestors when it
    /// is a partition), and its columns.
    relations: HashMap<u32, (Vec<Box<str>>, Columns)>,
    written: HashSet<u32>,
    /// (schema, name) → the names a write to it invalidates.
    tables: HashMap<(String, String), Vec<Box<str>>>,
    written_tables: HashSet<(String, String)>,
    /// The slots of the rows the open transaction's changes named (see `cache::rows`).
    rows: Vec<u32>,
    /// What it wrote without naming the rows (pgoutput's relations, test_decoding's tables).
    unnamed: HashSet<u32>,
    unnamed_tables: HashSet<(String, String)>,
    in_transaction: bool,
    /// The open (or last) transaction's ID, as the WAL names it (see `cache::own_commits`).
    xid: Option<u32>,
    /// The slots the last transaction's commit bumps (see [`visibility`]), taken by the
    /// stream's loop.
    bumps: Vec<u32>,
    /// The follower leads a fleet: each commit's bumps are published whole, its own
    /// commits' too (the other instances did not bump them at their COMMIT).
    publishing: bool,
    /// The last transaction was made through pgmemo (see [`Decoder::bumped_through_pgmemo`]),
    /// and it flushed its database.
    own: bool,
    flushed: bool,
}

/// The most row slots one transaction keeps; beyond, its tables are bumped whole.
const MAX_WAL_ROWS: usize = 1 << 16;

/// Pushes to `out` the slots of a change's rows of `table` (its old row's key, when shown,
/// and its new row's; an UPDATE that shows no old row kept its key), where `column` reads a
/// column of a row by name. False: they name no row (no row key, a key column not shown).
fn change_rows<'r, R>(
    cache: &ResultCache,
    snapshot: Option<&Snapshot>,
    (database, table): (&str, &str),
    rows: [Option<&'r R>; 2],
    column: impl Fn(&'r R, &str) -> Option<Option<&'r [u8]>>,
    out: &mut Vec<u32>,
) -> bool {
    let Some(key) = snapshot.and_then(|s| s.row_key(table)) else {
        return false;
    };
    if rows.iter().all(Option::is_none) || out.len() >= MAX_WAL_ROWS {
        return false;
    }
    let slots = rows.into_iter().flatten().map(|row| {
        crate::cache::rows::text_row_slot(&cache.versions, database, table, key, |c| column(row, c))
    });
    crate::cache::rows::push_all(out, slots)
}

/// Pushes to `out` what a test_decoding change of `table` changed column by column (see
/// `cache::columns`); `rows`: its old and new rows as shown.
fn text_columns(
    cache: &ResultCache,
    snapshot: Option<&Snapshot>,
    (database, table): (&str, &str),
    kind: test_decoding::ChangeKind,
    [old, new]: [&Option<test_decoding::Row>; 2],
    out: &mut Vec<u32>,
) {
    use crate::cache::columns::{push_change, Change};
    use test_decoding::ChangeKind;
    fn find<'r>(row: &'r Option<test_decoding::Row>, c: &str) -> Option<Option<&'r [u8]>> {
        let (_, v) = row.as_ref()?.iter().find(|(n, _)| n == c)?;
        Some(v.as_deref())
    }
    let (change, shown) = match kind {
        ChangeKind::Insert => (Change::Insert, new),
        // The old row in full (every column the new one shows is in it): what differs.
        ChangeKind::Update => {
            let changed = old.as_ref().zip(new.as_ref()).and_then(|(o, n)| {
                n.iter()
                    .map(|(c, v)| {
                        let (_, was) = o.iter().find(|(oc, _)| oc == c)?;
                        Some((was != v).then_some(c.as_str()))
                    })
                    .collect::<Option<Vec<_>>>()
                    .map(|c| c.into_iter().flatten().collect())
            });
            if changed.is_none() {
                cache.row_figures.wal_updates_whole.fetch_add(1, Relaxed);
            }
            (Change::Update(changed), new)
        }
        // Columns not shown (the key only) are not known: counted as such.
        ChangeKind::Delete => (
            Change::Delete {
                full: old.is_some(),
            },
            old,
        ),
    };
    let of = snapshot.and_then(|s| s.table_columns(table));
    push_change(
        change,
        of,
        &cache.versions,
        (database, table),
        |c| find(shown, c),
        out,
    )
}

/// [`text_columns`] for a pgoutput change (`kind` `I`/`U`/`D`) of a relation of `columns`;
/// `old_full`: its old row is shown whole, not only its key.
fn binary_columns(
    cache: &ResultCache,
    snapshot: Option<&Snapshot>,
    (database, table): (&str, &str),
    columns: &Columns,
    kind: u8,
    ([old, new], old_full): ([&Option<Vec<pgoutput::Column>>; 2], bool),
    out: &mut Vec<u32>,
) {
    use crate::cache::columns::{push_change, Change};
    use pgoutput::Column;
    let (change, shown) = match kind {
        b'I' => (Change::Insert, new),
        b'U' => {
            let changed = match (old, new) {
                (Some(o), Some(n)) if old_full && o.len() == n.len() => Some(
                    columns
                        .iter()
                        .zip(o.iter().zip(n))
                        .filter(|(_, (was, is))| **is != Column::Unchanged && was != is)
                        .map(|((c, _, _), _)| c.as_str())
                        .collect(),
                ),
                _ => None,
            };
            if changed.is_none() {
                cache.row_figures.wal_updates_whole.fetch_add(1, Relaxed);
            }
            (Change::Update(changed), new)
        }
        _ => (
            Change::Delete {
                full: old_full && old.is_some(),
            },
            old,
        ),
    };
    let find = |c: &str| -> Option<Option<&[u8]>> {
        let at = columns.iter().position(|(n, _, _)| n == c)?;
        match shown.as_ref()?.get(at)? {
            Column::Text(v) => Some(Some(v)),
            Column::Null => Some(None),
            _ => None,
        }
    };
    let of = snapshot.and_then(|s| s.table_columns(table));
    push_change(change, of, &cache.versions, (database, table), find, out)
}

/// Pushes to `bumps` what a committed transaction wrote to a table known by `names` (itself,
/// then its ancestors): only its writes' version when its rows were named (their slots are
/// bumped with the transaction's rows), else everything of it; its ancestors' everything (a
/// read of a partitioned table is not a point read).
fn bump_written(
    cache: &ResultCache,
    database: &str,
    names: &[Box<str>],
    named: bool,
    bumps: &mut Vec<u32>,
) {
    for (i, name) in names.iter().enumerate() {
        if i == 0 && named {
            bumps.push(cache.versions.table_slot(database, name));
        } else {
            bumps.extend(cache.versions.table_slots(database, name));
            cache.row_figures.unknown_rows.fetch_add(1, Relaxed);
        }
    }
}

/// Pushes to `bumps` the rows a committed transaction named.
fn bump_rows(cache: &ResultCache, rows: &mut Vec<u32>, bumps: &mut Vec<u32>) {
    cache
        .row_figures
        .rows_bumped
        .fetch_add(rows.len() as u64, Relaxed);
    bumps.append(rows);
}

/// Flushes a database whose tables' shapes changed (DDL made outside pgmemo), and pushes to
/// `bumps` its own slots: nothing of it read before the commit that showed the change is
/// visible is stored.
fn flush_database(cache: &ResultCache, database: &str, bumps: &mut Vec<u32>) {
    cache.flush(FlushTarget::Database(database));
    bumps.extend(cache.database_slots(database));
}

impl Decoder {
    /// At its commit: whether the open transaction was made through pgmemo, which bumped
    /// what it wrote at its COMMIT (see `cache::own_commits`). Its rows are then not bumped
    /// again (its tables are left to the caller).
    /// A leader computes its bumps all the same (they are published), and bumps nothing
    /// of them here ([`Decoder::commit_decoded`]).
    fn bumped_through_pgmemo(&mut self, cache: &ResultCache, database: &str) -> bool {
        self.own = self
            .xid
            .is_some_and(|xid| cache.own_commits.take(database, xid));
        let skipped = self.own && !self.publishing;
        if skipped {
            self.rows.clear();
        }
        skipped
    }

    /// The commit just applied: its bumps wait to be seen (and a leader's to be published).
    /// `before`: the position applied before it; `end`: its commit's end.
    fn commit_decoded(
        &mut self,
        follower: &Follower,
        cache: &ResultCache,
        (before, end): (Lsn, Lsn),
    ) {
        let (own, flushed) = (
            std::mem::take(&mut self.own),
            std::mem::take(&mut self.flushed),
        );
        if self.bumps.is_empty() {
            return;
        }
        let bumps = std::mem::take(&mut self.bumps);
        let published = self
            .publishing
            .then(|| fleet::Commit::of(&cache.versions, (self.xid, end), &bumps, flushed));
        let local = if self.publishing && own && !flushed {
            Vec::new()
        } else {
            bumps
        };
        follower
            .progress
            .decoded(&cache.versions, (self.xid, before), local, published);
    }

    /// Applies one test_decoding line; returns the position it completes (a commit's, `at`).
    async fn apply_text(
        &mut self,
        line: test_decoding::Line,
        at: Lsn,
        follower: &Follower,
        cache: &ResultCache,
        catalog: &mut Option<ServerConn>,
        setup: &Setup,
    ) -> Option<Lsn> {
        use test_decoding::Line;
        match line {
            Line::Begin { xid } => {
                self.in_transaction = true;
                self.xid = xid;
                self.written_tables.clear();
                self.unnamed_tables.clear();
                self.rows.clear();
            }
            Line::Tables(tables) => {
                self.unnamed_tables.extend(tables.iter().cloned());
                self.written_tables.extend(tables);
            }
            Line::Change {
                table,
                kind,
                old,
                new,
            } => {
                let at = (&*follower.database, &*table.1);
                let named = cache.with_snapshot(at.0, |snapshot| {
                    text_columns(cache, snapshot, at, kind, [&old, &new], &mut self.rows);
                    change_rows(
                        cache,
                        snapshot,
                        at,
                        [old.as_ref(), new.as_ref()],
                        |row: &test_decoding::Row, c| {
                            let (_, v) = row.iter().find(|(n, _)| n == c)?;
                            Some(v.as_deref())
                        },
                        &mut self.rows,
                    )
                });
                if !named {
                    self.unnamed_tables.insert(table.clone());
                }
                self.written_tables.insert(table);
            }
            Line::Commit { timestamp } => {
                self.in_transaction = false;
                if self.bumped_through_pgmemo(cache, &follower.database) {
                    self.written_tables.clear();
                }
                let written: Vec<_> = self.written_tables.drain().collect();
                for table in written {
                    if !self.tables.contains_key(&table) {
                        let relation = crate::params::quote_literal(&format!(
                            "{}.{}",
                            crate::params::quote_name(&table.0),
                            crate::params::quote_name(&table.1)
                        ));
                        let names =
                            ancestors(catalog, setup, &format!("{relation}::regclass"), &table.1)
                                .await;
                        self.tables.insert(table.clone(), names);
                    }
                    let named = !self.unnamed_tables.contains(&table);
                    let names = &self.tables[&table];
                    bump_written(cache, &follower.database, names, named, &mut self.bumps);
                }
                bump_rows(cache, &mut self.rows, &mut self.bumps);
                self.unnamed_tables.clear();
                follower.committed(timestamp);
                return Some(at);
            }
            Line::Other => {}
        }
        None
    }

    /// Applies one message; returns the position it completes (a Commit's end).
    async fn apply(
        &mut self,
        message: pgoutput::Message,
        follower: &Follower,
        cache: &ResultCache,
        catalog: &mut Option<ServerConn>,
        setup: &Setup,
    ) -> Result<Option<Lsn>, String> {
        use pgoutput::Message;
        let database = &follower.database;
        match message {
            Message::Begin { xid, .. } => {
                self.in_transaction = true;
                self.xid = Some(xid);
                self.written.clear();
                self.unnamed.clear();
                self.rows.clear();
            }
            Message::Relation(rel) => {
                let changed = self
                    .relations
                    .get(&rel.id)
                    .is_some_and(|(_, columns)| *columns != rel.columns);
                let names = match self.relations.get(&rel.id) {
                    Some((names, _)) if !changed => names.clone(),
                    _ => ancestors(catalog, setup, &format!("{}::oid", rel.id), &rel.name).await,
                };
                if changed {
                    // Its shape changed (DDL made outside pgmemo): what read it, and what
                    // pgmemo knows of the catalog, is stale.
                    flush_database(cache, database, &mut self.bumps);
                    self.flushed = true;
                }
                self.relations.insert(rel.id, (names, rel.columns));
            }
            Message::Change {
                relation,
                kind,
                old,
                old_full,
                new,
            } => {
                let rows = &mut self.rows;
                let named = self
                    .relations
                    .get(&relation)
                    .is_some_and(|(names, columns)| {
                        let at = (&**database, &*names[0]);
                        cache.with_snapshot(database, |snapshot| {
                            let shown = ([&old, &new], old_full);
                            binary_columns(cache, snapshot, at, columns, kind, shown, rows);
                            change_rows(
                                cache,
                                snapshot,
                                at,
                                [old.as_ref(), new.as_ref()],
                                |row: &Vec<pgoutput::Column>, c| {
                                    let at = columns.iter().position(|(n, _, _)| n == c)?;
                                    match row.get(at)? {
                                        pgoutput::Column::Text(v) => Some(Some(v)),
                                        pgoutput::Column::Null => Some(None),
                                        _ => None,
                                    }
                                },
                                rows,
                            )
                        })
                    });
                if !named {
                    self.unnamed.insert(relation);
                }
                self.written.insert(relation);
            }
            Message::Truncate { relations } => {
                self.unnamed.extend(relations.iter().copied());
                self.written.extend(relations);
            }
            Message::Commit {
                end_lsn, timestamp, ..
            } => {
                self.in_transaction = false;
                if self.bumped_through_pgmemo(cache, database) {
                    self.written.clear();
                }
                for id in self.written.drain() {
                    match self.relations.get(&id) {
                        Some((names, _)) => {
                            let named = !self.unnamed.contains(&id);
                            bump_written(cache, database, names, named, &mut self.bumps);
                        }
                        // pgoutput always describes a relation before its first change.
                        None => {
                            flush_database(cache, database, &mut self.bumps);
                            self.flushed = true;
                        }
                    }
                }
                bump_rows(cache, &mut self.rows, &mut self.bumps);
                self.unnamed.clear();
                follower.committed(Some(timestamp));
                return Ok(Some(end_lsn));
            }
            Message::Other(_) => {}
        }
        Ok(None)
    }
}

/// The names whose cached reads a write to `relation` (SQL for its OID, named `name`)
/// invalidates: its own and, for a partition, its ancestors' (a query reads the partitioned
/// table by its name).
/// Asked on a second, ordinary connection; without it, only the relation's own name.
async fn ancestors(
    catalog: &mut Option<ServerConn>,
    setup: &Setup,
    relation: &str,
    name: &str,
) -> Vec<Box<str>> {
    let mut names: Vec<Box<str>> = vec![name.into()];
    if catalog.as_ref().is_none_or(|c| c.broken) {
        *catalog = ServerConn::connect(&setup.target).await.ok();
    }
    if let Some(conn) = catalog.as_mut() {
        let sql = format!(
            "SELECT c.relname FROM pg_catalog.pg_partition_ancestors({relation}) a \
             JOIN pg_catalog.pg_class c ON c.oid = a.relid WHERE a.relid <> {relation}"
        );
        if let Ok(rows) = conn.internal_query(&sql).await {
            names.extend(
                rows.into_iter()
                    .filter_map(|r| r.into_iter().next().flatten())
                    .map(Into::into),
            );
        }
    }
    names
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lsn_text() {
        let lsn: Lsn = "16/B374D848".parse().unwrap();
        assert_eq!(lsn, Lsn(0x16_B374_D848));
        assert_eq!(lsn.to_string(), "16/B374D848");
        assert!("16".parse::<Lsn>().is_err());
        assert!("x/1".parse::<Lsn>().is_err());
        assert!(Lsn(1) < Lsn(2));
    }
}
