//! The result cache: chosen reads answered from memory, without a server, with the exact bytes
//! PostgreSQL sent for them; invalidated by the writes pgmemo sees (read-your-writes).
//!
//! - What: `[[cache.rules]]` and `/* pgmemo cache */` hints ([`crate::config::cache`],
//!   [`crate::query::hint`]) pick simple queries by their normalized text (the lexer's:
//!   literals as `$n`, comments dropped). PostgreSQL's parser then says, once per shape,
//!   whether the query can be cached at all and what it reads
//!   ([`analysis`](crate::query::analysis)); the catalog, once per shape and search_path,
//!   which tables those are and whether their functions are safe ([`catalog`]).
//! - Key: the client's context (database, server role, search_path, the settings that change
//!   how results are written), the normalized text and the literal values.
//! - Value: RowDescription, DataRows and CommandComplete as the client got them, in one
//!   [`Bytes`]; a hit appends them and a ReadyForQuery to the client's output: one write.
//! - Invalidation: table versions ([`versions`]); a result is stored with the versions it was
//!   sent under and never if one changed before it came back; every statement a client sends
//!   is looked at for what it writes ([`ResultCache::note_query`]), bumped once its
//!   transaction is over (`ClientCache::settle`), before the client hears so.
//! - Single flight: the first client that misses on a key runs the query; others missing on
//!   it meanwhile wait for its result (at most `flight_wait`).
//!
//! The cache in files, in the order a query meets them:
//! - `client.rs`: [`ClientCache`], a client's part: the context its keys start with, its
//!   buffers, what its statements may have written, the fill it has open;
//! - `lookup.rs`: the two tiers of lookup (a simple query's text exactly as sent, then its
//!   normalized text and literals, or an extended-protocol [`Batch`]), the rule or hint that
//!   chooses a query, and what the session does with it ([`Lookup`]);
//! - `flights.rs`: single flight, the fetches under way that other clients wait for;
//! - `store.rs`: fill and store: a miss's [`Fill`], captured from its replies and stored at
//!   their ReadyForQuery, and the store that holds the entries;
//! - `plans.rs`: which tables a shape reads under a search_path, resolved from the catalog
//!   ([`Resolve`]), and the catalog snapshots they are resolved against;
//! - `invalidation.rs`: what a client's statements may write, bumped when its transaction is
//!   over, and CACHE FLUSH;
//! - `shared.rs`: the shared tier, a second tier of lookup and store on Valkey that a fleet
//!   of instances shares, its entries judged by WAL positions; `valkey.rs`: how pgmemo
//!   reaches Valkey (a server or a cluster, over TCP or TLS);
//! - beside them, the parts those rooms share: `key.rs` (keys hashed once), `admission.rs`
//!   (which misses are stored), [`auto`], [`catalog`], [`columns`], [`rows`], [`versions`]
//!   and [`own_commits`].

mod admission;
pub mod auto;
pub mod catalog;
mod client;
pub mod columns;
mod flights;
mod invalidation;
mod key;
mod lookup;
pub mod own_commits;
mod plans;
pub mod rows;
pub mod shared;
mod store;
pub mod valkey;
pub mod versions;

pub use client::ClientCache;
pub use flights::Flight;
pub use invalidation::{FlushTarget, Unfinished};
pub use lookup::{batch, Batch};
pub use plans::Resolve;
pub use store::Fill;

use crate::config::cache::CacheConfig;
use crate::query::analysis::{Bypass, BYPASS_REASONS};
use crate::query::shapes::Shapes;
use admission::Admission;
use arc_swap::ArcSwap;
use bytes::Bytes;
use catalog::Snapshot;
use flights::Flights;
use invalidation::row_versions;
use key::KeyIsHash;
use lookup::RAW_ENTRIES;
use plans::Plan;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Instant;
use store::{EntryWeight, Evictions, Store};
use versions::{Seen, Versions};
// For the tests of `admission.rs`, which take their keys from here.
#[cfg(test)]
use key::KeyRef;

/// Counters of one rule (or of all hint-chosen queries), for SHOW CACHE and Prometheus.
#[derive(Debug, Default)]
pub struct RuleStats {
    pub name: String,
    /// Written by every hit, every miss and every miss not stored of every worker: striped.
    pub hits: crate::stats::StripedCounter,
    pub misses: crate::stats::StripedCounter,
    pub stores: AtomicU64,
    pub evictions: AtomicU64,
    pub invalidations: AtomicU64,
    pub bypasses: crate::stats::StripedCounter,
    /// Entries refreshed ahead of their expiry (see [`Entry::refresh_at`]).
    pub refreshes: AtomicU64,
    /// The rule is in the configuration (the hints' counters: hints are obeyed), so entries
    /// it stored are answered: one load on a first-tier hit instead of the configuration's.
    chooses: AtomicBool,
    /// Its entries may answer inside a transaction block (the rule's `transactions`).
    in_blocks: AtomicBool,
}

/// The rule counters of hinted queries (after the configured rules, before auto mode's).
pub const HINT_RULE: &str = "(hint)";

/// One stored result.
#[derive(Debug)]
pub struct Entry {
    /// RowDescription, DataRows, CommandComplete, as sent to the client.
    pub reply: Bytes,
    pub expires: Instant,
    pub seen: Seen,
    pub rule: Arc<RuleStats>,
    /// The normalized text, for SHOW CACHE ENTRIES.
    pub text: Arc<str>,
    pub tables: Arc<[Box<str>]>,
    pub database: Arc<str>,
    pub hits: AtomicU64,
    /// The query's shape, whose figures a first-tier hit (of a simple query) adds to.
    pub shape: Option<Arc<Shape>>,
    /// Read from then on, it is refreshed by the query of the one client that claims it
    /// (`refreshing`) while the others keep getting hits (`cache.refresh_at`).
    pub refresh_at: Instant,
    pub refreshing: AtomicBool,
}

impl Entry {
    /// Whether a read now should refresh it (nobody claimed it yet).
    #[inline]
    fn refresh_due(&self, now: Instant) -> bool {
        now >= self.refresh_at && !self.refreshing.load(Relaxed)
    }
}

/// A simple query's shape (see [`crate::query::shapes`]): what the cache decides for a
/// query is derived once per shape and kept there.
pub use crate::query::shapes::Shape;

/// The result cache of the whole process.
pub struct ResultCache {
    config: ArcSwap<CacheConfig>,
    /// `config.enabled` and not `held_back`, readable with one load on the hot path.
    enabled: AtomicBool,
    /// An online restart is under way and this is the new process: the old one may still
    /// write through statements this one does not see, so nothing is cached or answered
    /// until it has exited (see [`ResultCache::hold_back`]).
    held_back: parking_lot::Mutex<bool>,
    /// Whether `config.invalidation` is the WAL's, likewise (asked at every lookup).
    follows_wal: AtomicBool,
    /// `cache.max_lag` in milliseconds (`u64::MAX`: none), read by every lookup without a
    /// load of the configuration.
    max_lag_ms: std::sync::atomic::AtomicU64,
    store: Store,
    pub versions: Versions,
    /// The first tier of simple-query lookups: (client context, the query's text exactly as
    /// sent) → its stored entry, so that a repeated text is answered without lexing, hint,
    /// rule and plan work; learnt at the text's first hit in the second tier
    /// ([`ResultCache::remember_raw`]). Weak: the store alone keeps entries (and bounds their
    /// memory).
    raw: quick_cache::sync::Cache<Box<[u8]>, std::sync::Weak<Entry>>,
    flights: Arc<Flights>,
    shapes: Arc<Shapes>,
    plans: quick_cache::sync::Cache<(u64, u64), Arc<Plan>>,
    /// One per database. A replaced snapshot (hundreds of KiB: every function of the
    /// catalog) is freed at once rather than in papaya's default batches of 32 per thread,
    /// which held a few old ones after every reconnect or DDL (the faults test's heap).
    /// Hashed with foldhash: read for every write of a cached block (see `catalog`).
    snapshots: papaya::HashMap<Box<str>, Arc<Snapshot>, foldhash::fast::RandomState>,
    /// One per rule of the configuration, then one for hints.
    rules: ArcSwap<Vec<Arc<RuleStats>>>,
    /// Bumped by every [`ResultCache::reconfigure`], after `config` and `rules`: a client
    /// keeps both (`ClientCache::settings`) while it is unchanged: one atomic load per lookup
    /// instead of two `ArcSwap` loads (~90 instructions fewer per lookup, callgrind).
    generation: AtomicU64,
    /// By reason (striped: a low hit ratio counts one per miss).
    pub bypasses: [crate::stats::StripedCounter; BYPASS_REASONS.len()],
    /// Database flushes and whole-cache flushes, by writes, DDL and CACHE FLUSH.
    pub flushes: AtomicU64,
    /// Clients that waited `flight_wait` for another's fetch in vain.
    pub flight_timeouts: AtomicU64,
    /// Which misses are stored (`admit_after = 2`).
    admission: Admission,
    /// Some database's snapshot has relations whose reading writes
    /// ([`Snapshot::reading_may_write`]); until then no statement is checked for it.
    reading_writes: AtomicBool,
    /// Row-level invalidation's figures (SHOW CACHE).
    pub row_figures: RowFigures,
    /// With WAL invalidation, the transactions through pgmemo bumped at their COMMIT.
    pub own_commits: own_commits::OwnCommits,
    /// `[cache.shared]`: the tier every instance of a fleet shares (see [`shared`]); set at
    /// start.
    shared: std::sync::OnceLock<Arc<shared::Shared>>,
}

/// How row-level invalidation went (SHOW CACHE).
#[derive(Default)]
pub struct RowFigures {
    /// Results filled that depend on their rows, not on their tables.
    pub point_fills: AtomicU64,
    /// Results of point reads whose values named no row: they depend on their table.
    pub point_fallbacks: AtomicU64,
    /// Rows bumped by writes through pgmemo and by the WAL.
    pub rows_bumped: AtomicU64,
    /// Writes to a table whose rows were not named (through pgmemo and in the WAL).
    pub unknown_rows: AtomicU64,
    /// Results filled that depend on the columns and values they read, not on their tables
    /// (see [`columns`]).
    pub column_fills: AtomicU64,
    /// Of their equalities, those whose values named no value (the read then depended on
    /// every row added or removed).
    pub value_fallbacks: AtomicU64,
    /// UPDATEs in the WAL that did not show their old row whole (no `REPLICA IDENTITY
    /// FULL`): every read of their table was changed.
    pub wal_updates_whole: AtomicU64,
    /// Results stored depending on the rows they hold for the columns they only show (see
    /// [`columns::HeldRows`]), counted per table.
    pub held_fills: AtomicU64,
}

/// Where a lookup happens: the client's context.
pub struct Where<'a> {
    /// The server database ([`crate::server::ServerTarget::database_id`]): what keys,
    /// versions and plans are per.
    pub database: &'a str,
    /// Its name on the server, which rules name.
    pub name: &'a str,
    pub user: &'a str,
    /// The search_path the client's queries run with; None: the server's default.
    /// Whether a transaction block is open or other work is in flight.
    pub transaction: Transaction,
    /// WAL invalidation is on and the database's stream is not caught up (see `wal`).
    pub wal_behind: bool,
}

/// The client's transaction as a lookup sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transaction {
    /// No transaction block, nothing in flight.
    Idle,
    /// In a transaction block that has not failed, with nothing in flight; whether it is READ
    /// COMMITTED, once asked (see [`Lookup::Isolation`]). In READ COMMITTED every statement
    /// takes a new snapshot, so a current entry of tables the block has not written is what
    /// the statement would read: it is answered, and a miss is filled (no statement of the
    /// block runs meanwhile). REPEATABLE READ and SERIALIZABLE read one snapshot: never.
    Block { read_committed: Option<bool> },
    /// A block that failed, or work in flight.
    Busy,
}

/// What the session does with a query.
pub enum Lookup {
    /// Not the cache's: run it as usual.
    Pass,
    /// Answer with these bytes and a ReadyForQuery.
    Hit(Arc<Entry>),
    /// Run it; its replies are captured (`ClientCache::fill`).
    Miss,
    /// Another client is fetching it: wait, then look up again.
    Wait(Arc<Flight>),
    /// The catalog must be read first (on a server, see [`Resolve`]), then look up again.
    /// Boxed: rare, and a lookup's outcome is held across the session's awaits.
    Resolve(Box<Resolve>),
    /// The query may be answered in the client's transaction block if it is READ COMMITTED:
    /// ask the server, then look up again with [`Transaction::Block`] knowing it.
    Isolation,
}

impl ResultCache {
    /// `shapes`: the table of simple queries' shapes every session shares (with autoprepare).
    pub fn new(config: &CacheConfig, shapes: Arc<Shapes>) -> ResultCache {
        let admission = Admission::new();
        let evictions = Evictions {
            full: admission.full_flag(),
        };
        let cache = ResultCache {
            config: ArcSwap::from_pointee(config.clone()),
            enabled: AtomicBool::new(config.enabled),
            held_back: parking_lot::Mutex::new(false),
            follows_wal: AtomicBool::new(false),
            max_lag_ms: std::sync::atomic::AtomicU64::new(u64::MAX),
            store: Store::with(
                1024,
                (config.max_memory as u64).max(1),
                EntryWeight,
                KeyIsHash,
                evictions,
            ),
            versions: Versions::new(row_versions(config)),
            raw: quick_cache::sync::Cache::new(RAW_ENTRIES),
            flights: Arc::new(Flights::new()),
            shapes,
            plans: quick_cache::sync::Cache::new(10_000),
            snapshots: papaya::HashMap::builder()
                .hasher(foldhash::fast::RandomState::default())
                .collector(seize::Collector::new().batch_size(1))
                .build(),
            rules: ArcSwap::from_pointee(Vec::new()),
            generation: AtomicU64::new(0),
            bypasses: Default::default(),
            flushes: AtomicU64::new(0),
            flight_timeouts: AtomicU64::new(0),
            admission,
            reading_writes: AtomicBool::new(false),
            row_figures: RowFigures::default(),
            own_commits: Default::default(),
            shared: std::sync::OnceLock::new(),
        };
        cache.reconfigure(config);
        cache
    }

    /// Applies a reloaded `[cache]`: rules, limits; counters of rules kept by name.
    pub fn reconfigure(&self, config: &CacheConfig) {
        // A rule kept by name may now match other texts: the first tier decided by the old
        // rules is forgotten (the store's entries are judged again at their next lookup).
        self.raw.clear();
        let old = self.rules.load();
        let stats_for = |name: &str| {
            old.iter()
                .find(|r| r.name == name)
                .cloned()
                .unwrap_or_else(|| {
                    Arc::new(RuleStats {
                        name: name.to_owned(),
                        ..RuleStats::default()
                    })
                })
        };
        let mut rules: Vec<_> = config.rules.iter().map(|r| stats_for(&r.name)).collect();
        rules.push(stats_for(HINT_RULE));
        rules.push(stats_for(auto::AUTO));
        for r in old
            .iter()
            .filter(|r| !rules.iter().any(|n| Arc::ptr_eq(r, n)))
        {
            r.chooses.store(false, Relaxed);
        }
        let auto_mode = config.mode == crate::config::cache::CacheMode::Auto;
        for (i, r) in rules.iter().enumerate() {
            let chooses = match i.checked_sub(config.rules.len()) {
                None => true,
                Some(0) => config.hints,
                Some(_) => auto_mode,
            };
            r.chooses.store(chooses, Relaxed);
            let in_blocks = config.rules.get(i).is_none_or(|rule| rule.transactions);
            r.in_blocks.store(in_blocks, Relaxed);
        }
        self.rules.store(Arc::new(rules));
        self.store.set_capacity(self.store_capacity(config));
        if !config.enabled {
            self.store.clear();
        }
        self.admission.shrunk();
        let held_back = self.held_back.lock();
        self.enabled.store(config.enabled && !*held_back, Relaxed);
        drop(held_back);
        self.follows_wal.store(
            config.invalidation == crate::config::cache::Invalidation::Wal,
            Relaxed,
        );
        let max_lag_ms = config
            .max_lag
            .map_or(u64::MAX, |lag| (lag.as_millis() as u64).min(u64::MAX - 1));
        self.max_lag_ms.store(max_lag_ms, Relaxed);
        let mut config = config.clone();
        for rule in &mut config.rules {
            if let Some(text) = rule.query.as_deref().and_then(normalized_rule_text) {
                rule.query = Some(text);
            }
        }
        self.config.store(Arc::new(config));
        self.generation
            .fetch_add(1, std::sync::atomic::Ordering::Release);
    }

    #[inline]
    /// Whether writes are followed in the database's WAL (`cache.invalidation = "wal"`).
    pub fn follows_wal(&self) -> bool {
        self.follows_wal.load(Relaxed)
    }

    /// `cache.max_lag` (see [`crate::wal::Wal::ready`]).
    #[inline]
    pub fn max_lag(&self) -> Option<std::time::Duration> {
        match self.max_lag_ms.load(Relaxed) {
            u64::MAX => None,
            ms => Some(std::time::Duration::from_millis(ms)),
        }
    }

    pub fn enabled(&self) -> bool {
        self.enabled.load(Relaxed)
    }

    /// Starts the shared tier `config` names, if any (at start: `[cache.shared]` is read
    /// once). A URL the client cannot use is logged, and the tier stays off.
    pub fn start_shared(&self, config: &CacheConfig) {
        let Some(tier) = &config.shared else {
            return;
        };
        match shared::Shared::new(tier) {
            Ok(s) => {
                let _ = self.shared.set(Arc::new(s));
            }
            Err(e) => tracing::error!("result cache: no shared tier: {e}"),
        }
    }

    /// The shared tier, when there is one.
    #[inline]
    pub fn shared(&self) -> Option<&Arc<shared::Shared>> {
        self.shared.get()
    }

    /// Whether the shared tier's entry of `fill`'s key, whose query saw every commit up to
    /// `position`, may answer `fill`'s query here: nothing the result depends on changed
    /// since the lookup began (or was unsettled then), and every commit to it this instance
    /// knew of by then ends at or before `position`: the first primary position read after
    /// its last bump (`covering_after`, the follower's) is at most `position`.
    pub fn serves_shared(
        &self,
        fill: &Fill,
        position: u64,
        covering_after: impl FnOnce(crate::clock::Moment) -> Option<u64>,
    ) -> bool {
        self.versions.unchanged(fill.seen())
            && covering_after(self.versions.last_bumped(fill.slots()))
                .is_some_and(|covering| covering <= position)
    }

    /// When a version `fill`'s result depends on was last bumped: a replica that replayed a
    /// position of the primary read after then has every commit the result must show (see
    /// [`versions::Versions::last_bumped`]). None without WAL invalidation: writes made
    /// around pgmemo bump nothing, and the fill is the primary's.
    pub fn fill_bumped(&self, fill: &Fill) -> Option<crate::clock::Moment> {
        self.follows_wal()
            .then(|| self.versions.last_bumped(fill.slots()))
    }

    /// Holds the cache off (`true`) while the old process of an online restart still serves
    /// clients, whose writes this process would not see (read-your-writes for a client that
    /// wrote there and reads here next); `false` when it has exited. Whatever this process
    /// cached before is dropped at the hold.
    pub fn hold_back(&self, held: bool) {
        let mut held_back = self.held_back.lock();
        *held_back = held;
        if held {
            self.store.clear();
        }
        self.enabled
            .store(self.config.load().enabled && !held, Relaxed);
    }

    pub fn rule_stats(&self) -> Vec<Arc<RuleStats>> {
        self.rules.load().iter().cloned().collect()
    }

    /// (entries, bytes) stored per rule name.
    pub fn usage(&self) -> std::collections::HashMap<String, (u64, u64)> {
        let mut out = std::collections::HashMap::new();
        for (key, entry) in self.store.iter() {
            let e = out.entry(entry.rule.name.clone()).or_insert((0, 0));
            e.0 += 1;
            e.1 += quick_cache::Weighter::weight(&EntryWeight, &key, &entry);
        }
        out
    }

    pub fn entries(&self) -> Vec<Arc<Entry>> {
        self.store.iter().map(|(_, e)| e).collect()
    }

    /// Bytes the store holds (keys, results and bookkeeping), and its limit.
    pub fn memory(&self) -> (u64, u64) {
        (self.store.weight(), self.store.capacity())
    }

    /// What `max_memory` leaves to the store once the rows' versions are counted (at least
    /// half of it: a reload may lower `max_memory`, the row versions stay).
    fn store_capacity(&self, config: &CacheConfig) -> u64 {
        let max = config.max_memory as u64;
        max.saturating_sub(self.versions.row_bytes() as u64)
            .max(max / 2)
            .max(1)
    }

    fn count(&self, why: Bypass) {
        self.bypasses[why.index()].add(1);
    }
}

/// A rule's `query` written with literals, normalized as the lexer normalizes client text
/// (literals as `$n`, comments dropped), so that it matches the queries it spells out. None:
/// the lexer does not read it (a text already normalized, with `$n`, is kept as written).
fn normalized_rule_text(query: &str) -> Option<String> {
    let mut lexed = crate::query::lexer::Lexed::default();
    crate::query::lexer::generalize(query.as_bytes(), &mut lexed).ok()?;
    String::from_utf8(lexed.text).ok()
}
