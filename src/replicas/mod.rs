//! Streaming replicas: where provably read-only work may go, and whether a replica has
//! replayed what a client must see.
//!
//! A pool whose database names `replicas` (hosts of streaming standbys of its server, logged
//! into as the primary is) gets a [`Replicas`] set: a pool per replica, sized like the
//! primary's, and what is known of each replica's replay position, lag and health. The
//! session asks it for a replica for a read ([`Replicas::pick`]); the set's monitor keeps the
//! positions current ([`monitor`]); the catalog says which statements only read
//! ([`catalog`]); a client's own floors live in [`ClientReads`] ([`client`]).
//!
//! Positions, not counters (DESIGN.md §10): a client's read-your-writes floor is the WAL
//! position its last write committed at; a replica may serve it once its replay position is
//! past that floor. Unknown is never proof: a replica whose position is not known, or that
//! is down, lagging or promoted, takes no reads.

pub mod catalog;
pub mod client;
mod monitor;

pub use client::ClientReads;

use std::sync::atomic::Ordering::{AcqRel, Acquire, Relaxed};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize};
use std::sync::Arc;

use arc_swap::{ArcSwap, ArcSwapOption};
use parking_lot::Mutex;

use crate::clock::Moment;
use crate::config::ReplicaLag;
use crate::pool::{Pool, PoolSettings};

/// The replicas of one pool's server (see the module's documentation).
pub struct Replicas {
    /// The primary's pool: its key names the set in logs, its settings are the replicas'.
    pub primary: std::sync::Weak<Pool>,
    pub key: crate::pool::PoolKey,
    /// Swapped whole when a reload changes the list.
    members: ArcSwap<Vec<Arc<Replica>>>,
    /// Where the next client's first read starts looking (round-robin).
    next: AtomicUsize,
    /// The highest primary position known: clients' commits and the monitor's reads.
    primary_lsn: AtomicU64,
    /// Recent (time, primary position) pairs, oldest first: how long ago the primary was
    /// where a replica is now (a replica's lag in time).
    history: Mutex<std::collections::VecDeque<(u64, u64)>>,
    /// The monitor's reads of a primary position past every commit inserted before: what a
    /// fill on a replica waits for (see [`Replicas::covering_after`]).
    covering: crate::lsn::Covering,
    /// What statements the replicas may run, once read.
    pub catalog: ArcSwapOption<catalog::Catalog>,
    /// Set when a reload dropped this set: its monitor stops.
    retired: AtomicBool,
    /// The set's clock starts here (positions' history, the catalog's age).
    started: crate::clock::Moment,
}

/// One replica: its pool and what is known of it.
pub struct Replica {
    pub pool: Arc<Pool>,
    pub host: String,
    pub port: u16,
    /// Its replay position as last read (0: not known).
    replayed: AtomicU64,
    /// Its lag as last measured: bytes of WAL behind the primary, and microseconds.
    lag_bytes: AtomicU64,
    lag_us: AtomicU64,
    /// Whether it takes reads (bit 0: the monitor reached it and found it a standby, and it
    /// was not taken out since), and how many times it was taken out (the other bits): the
    /// monitor marks it up only if it was not taken out while it asked (see
    /// [`Replica::found_up`]).
    state: AtomicU64,
    /// Reads sent to it (statements, or blocks).
    pub reads: AtomicU64,
}

/// What [`Replicas::pick`] found for a read.
pub enum Pick {
    /// A replica known to have replayed the client's floor.
    Ready(Arc<Replica>),
    /// A usable replica that has not replayed it as far as pgmemo knows: worth asking again
    /// for `replica_wait`.
    Behind(Arc<Replica>),
    /// None is usable (down, lagging, promoted, or none configured).
    None,
}

/// How many (time, position) pairs the set keeps: at the monitor's pace, about a minute.
const HISTORY: usize = 600;

/// [`Replica::state`]'s bit for "up", and what one taking out adds.
const UP: u64 = 1;
const TAKEN_OUT: u64 = 2;

impl Replicas {
    /// The set of `primary`'s replicas (its settings' `replicas`); its monitor starts.
    pub fn new(primary: &Arc<Pool>) -> Arc<Replicas> {
        let set = Arc::new(Replicas {
            primary: Arc::downgrade(primary),
            key: primary.key.clone(),
            members: ArcSwap::from_pointee(Vec::new()),
            next: AtomicUsize::new(0),
            primary_lsn: AtomicU64::new(0),
            history: Mutex::new(std::collections::VecDeque::new()),
            covering: crate::lsn::Covering::default(),
            catalog: ArcSwapOption::empty(),
            retired: AtomicBool::new(false),
            started: crate::clock::Moment::now(),
        });
        set.reconfigure(&primary.settings());
        monitor::start(&set);
        set
    }

    /// After a reload: the replicas' pools take the primary's new settings; a changed list
    /// makes new pools (the old ones' servers close as they come back).
    pub fn reconfigure(&self, settings: &PoolSettings) {
        let current = self.members.load();
        let same = current.len() == settings.replicas.len()
            && current
                .iter()
                .zip(&settings.replicas)
                .all(|(r, (h, p))| r.host == *h && r.port == *p);
        if same {
            for r in current.iter() {
                r.pool
                    .reconfigure(replica_settings(settings, &r.host, r.port));
            }
            return;
        }
        let members = settings
            .replicas
            .iter()
            .map(|(host, port)| {
                Arc::new(Replica {
                    pool: Pool::new(self.key.clone(), replica_settings(settings, host, *port)),
                    host: host.clone(),
                    port: *port,
                    replayed: AtomicU64::new(0),
                    lag_bytes: AtomicU64::new(u64::MAX),
                    lag_us: AtomicU64::new(u64::MAX),
                    state: AtomicU64::new(0),
                    reads: AtomicU64::new(0),
                })
            })
            .collect();
        let old = self.members.swap(Arc::new(members));
        close_pools(&old);
    }

    /// The set's clock, in microseconds.
    pub fn now_us(&self) -> u64 {
        crate::clock::Moment::now().micros_since(self.started)
    }

    /// Whether any replica is configured.
    #[inline]
    pub fn any(&self) -> bool {
        !self.members.load().is_empty()
    }

    pub fn members(&self) -> Arc<Vec<Arc<Replica>>> {
        self.members.load_full()
    }

    /// The primary position known (0: none yet).
    pub fn primary_lsn(&self) -> u64 {
        self.primary_lsn.load(Relaxed)
    }

    /// The primary was at `lsn` (or past it) at `now_us`: a client's commit, or the monitor's
    /// read.
    pub fn note_primary(&self, lsn: u64, now_us: u64) {
        if self.primary_lsn.fetch_max(lsn, Relaxed) >= lsn {
            return;
        }
        let mut h = self.history.lock();
        if h.back().is_some_and(|&(_, l)| l >= lsn) {
            return;
        }
        h.push_back((now_us, lsn));
        if h.len() > HISTORY {
            h.pop_front();
        }
    }

    /// A position of the primary's WAL past every commit pgmemo knew of at `at` (see
    /// [`crate::lsn::Covering::after`]). A replica that replayed it has them all (a fill there sees
    /// every commit its versions include, when `at` is their last bump: see
    /// [`crate::cache::versions::Versions::last_bumped`]).
    pub fn covering_after(&self, at: Moment) -> Option<u64> {
        self.covering.after(at)
    }

    /// How long ago (microseconds) the primary first passed `replayed`, as far as the
    /// history tells: 0 when it is not known to have; the age of the oldest pair otherwise.
    fn behind_since(&self, replayed: u64, now_us: u64) -> u64 {
        let h = self.history.lock();
        match h.iter().find(|&&(_, lsn)| lsn > replayed) {
            Some(&(at, _)) => now_us.saturating_sub(at),
            None => 0,
        }
    }

    /// A replica for a read whose client must see `floor` (0: anything), preferring
    /// `sticky` (the one its last read used: a client's reads then never go back in time).
    pub fn pick(&self, floor: u64, sticky: Option<&Arc<Replica>>, lag: ReplicaLag) -> Pick {
        let members = self.members.load();
        let usable = |r: &Arc<Replica>| r.usable(lag);
        if let Some(r) = sticky.filter(|r| usable(r)) {
            return if r.replayed() >= floor.max(1) {
                Pick::Ready(r.clone())
            } else {
                Pick::Behind(r.clone())
            };
        }
        let n = members.len();
        if n == 0 {
            return Pick::None;
        }
        let start = self.next.fetch_add(1, Relaxed);
        let mut behind: Option<&Arc<Replica>> = None;
        for i in 0..n {
            let r = &members[(start + i) % n];
            if !usable(r) {
                continue;
            }
            if r.replayed() >= floor.max(1) {
                return Pick::Ready(r.clone());
            }
            if behind.is_none_or(|b| b.replayed() < r.replayed()) {
                behind = Some(r);
            }
        }
        behind.map_or(Pick::None, |r| Pick::Behind(r.clone()))
    }

    /// Whether a reload dropped the set: its clients' reads go to the primary.
    #[inline]
    pub fn is_retired(&self) -> bool {
        self.retired.load(Relaxed)
    }

    /// Stops the monitor (a reload dropped the set) and closes the replicas' pools.
    pub fn retire(&self) {
        self.retired.store(true, Relaxed);
        close_pools(&self.members.load());
    }
}

impl Replica {
    /// Its replay position as last read (0: not known).
    #[inline]
    pub fn replayed(&self) -> u64 {
        self.replayed.load(Relaxed)
    }

    /// A read of its replay position (by the monitor or a session's question).
    pub fn note_replayed(&self, lsn: u64) {
        self.replayed.fetch_max(lsn, Relaxed);
    }

    /// Whether it is up and how many times it was taken out, read before the monitor asks it
    /// (see [`Replica::found_up`]).
    pub(super) fn state(&self) -> u64 {
        self.state.load(Acquire)
    }

    /// The monitor's question, asked when it was in `state`, found it a standby that replayed
    /// `replayed`. Marked up only if it was not taken out since: a server that broke under a
    /// read since (a standby shutting down) may have answered just before; the next round
    /// tells. Coming up, its position is the one just read (one from before it went down may
    /// be past what a restarted standby shows). Returns whether it is up.
    pub(super) fn found_up(&self, state: u64, replayed: u64) -> bool {
        if state & UP != 0 {
            self.note_replayed(replayed);
            // (Taken out meanwhile: it stays down; its stale position is replaced when it
            // comes up.)
            return self.state.load(Acquire) == state;
        }
        self.replayed.store(replayed, Relaxed);
        self.state
            .compare_exchange(state, state | UP, AcqRel, Relaxed)
            .is_ok()
    }

    /// Whether it takes reads: reached, a standby, and not further behind than `lag`.
    pub fn usable(&self, lag: ReplicaLag) -> bool {
        if !self.is_up() {
            return false;
        }
        match lag {
            ReplicaLag::Bytes(max) => self.lag_bytes.load(Relaxed) <= max,
            ReplicaLag::Time(max) => self.lag_us.load(Relaxed) <= max.as_micros() as u64,
        }
    }

    /// Whether the monitor last found it up (reached and a standby).
    pub fn is_up(&self) -> bool {
        self.state.load(Relaxed) & UP != 0
    }

    /// Its lag as last measured: (bytes, microseconds); None when not known.
    pub fn lag(&self) -> Option<(u64, u64)> {
        let bytes = self.lag_bytes.load(Relaxed);
        (bytes != u64::MAX).then(|| (bytes, self.lag_us.load(Relaxed)))
    }

    /// It could not be reached or is no standby: no reads, and its position is forgotten (a
    /// standby that restarts may come back showing an older state than it did). Its pool's
    /// connections, which a standby that stopped or restarted has closed, are closed too (the
    /// idle ones at once, as after RECONNECT): a read after it comes back is not given one
    /// of them to fail on.
    pub fn mark_down(&self) {
        if self.take_out() {
            // Retired now, not when the task below runs: should the monitor find it up again
            // before (a standby still answering as it shuts down), no read is given a
            // connection it closed.
            self.pool.retire_open();
            if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                let pool = self.pool.clone();
                runtime.spawn(async move { pool.reconnect().await });
            }
        }
    }

    /// No more reads, and its position forgotten; whether it was up.
    fn take_out(&self) -> bool {
        // Down, and counted: a question the monitor asked before cannot mark it up again.
        let was = self
            .state
            .fetch_update(AcqRel, Acquire, |s| Some((s & !UP).wrapping_add(TAKEN_OUT)));
        let was_up = was.is_ok_and(|s| s & UP != 0);
        self.replayed.store(0, Relaxed);
        self.lag_bytes.store(u64::MAX, Relaxed);
        self.lag_us.store(u64::MAX, Relaxed);
        was_up
    }
}

/// Closes the pools of replicas no longer in the set: their idle servers at once, the others
/// as they come back.
fn close_pools(old: &[Arc<Replica>]) {
    for r in old {
        // No read picks it again (a client's last replica may be one of them); its pool is
        // closed below, not reconnected.
        r.take_out();
        let pool = r.pool.clone();
        tokio::spawn(async move { pool.close().await });
    }
}

/// A replica's pool settings: the primary's, at the replica's host and port, with no other
/// host to fall back to and no primary to follow.
fn replica_settings(primary: &PoolSettings, host: &str, port: u16) -> PoolSettings {
    let mut s = primary.clone();
    s.replicas = Vec::new();
    let t = &mut s.target;
    t.host = host.to_string();
    t.port = port;
    t.fallbacks = Vec::new();
    t.session_attrs = crate::config::SessionAttrs::Any;
    t.primary = Default::default();
    t.order = crate::config::HostOrder::InOrder;
    t.turn = Default::default();
    s
}
